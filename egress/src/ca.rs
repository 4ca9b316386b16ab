//! The sandbox's own certificate authority. The proxy terminates TLS only for
//! destinations a secret is bound to; for those it presents a leaf certificate this CA
//! minted, and the guest trusts this CA (its certificate is installed in the guest).
//! The private key never leaves the host.
//!
//! Files: `<dir>/ca.pem` (certificate, 0644) and `<dir>/ca-key.pem` (PKCS#8 key, 0600,
//! created with that mode so it is never readable by others, not even briefly), in
//! `<dir>` (0700). Each load refuses a directory or key file others can reach, as ssh
//! does its keys, and notes a certificate that expires within
//! [`EXPIRY_WARNING_DAYS`] days ([`CertificateAuthority::expires_soon`]) for the
//! caller to warn of, once, where its user reads it.
//!
//! The key's bytes, as read, written or generated here, are held in buffers zeroized
//! when dropped, and the PKCS#8 document ring generates a key into is zeroed once
//! copied (it has no `Drop` that would). rcgen signs through [`rcgen::RemoteKeyPair`]
//! with ring's key pair rather than with its own key pair, which keeps a plain copy of
//! the PKCS#8 bytes, and a leaf's public key is read from its PKCS#8 bytes rather
//! than from a key pair built for the purpose. What ring keeps inside its key pairs
//! (the CA's, and the leaves' inside rustls's server configurations) and the
//! temporaries of its key generation are beyond this crate's reach and not zeroized.

use std::collections::HashMap;
use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{self, Write};
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, PublicKeyData, RemoteKeyPair, SanType,
    SignatureAlgorithm,
};
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair as _, ECDSA_P256_SHA256_ASN1_SIGNING};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use zeroize::Zeroizing;

const CERT_FILE: &str = "ca.pem";
const KEY_FILE: &str = "ca-key.pem";
/// How many hosts' leaf configurations are kept; the guest talks to few hosts.
const LEAF_CACHE_ENTRIES: usize = 512;
/// Leaves live 30 days; re-mint well before that for long-running sandboxes.
const LEAF_REFRESH: Duration = Duration::from_secs(24 * 3600);
const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);
/// A CA certificate that expires within this many days is warned of at each load.
pub const EXPIRY_WARNING_DAYS: u64 = 30;
/// The one key type this CA and its leaves use.
static KEY_ALGORITHM: &SignatureAlgorithm = &rcgen::PKCS_ECDSA_P256_SHA256;
/// The PEM label of a PKCS#8 private key.
const PRIVATE_KEY_LABEL: &str = "PRIVATE KEY";

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("cannot create the CA directory {path}: {source}")]
    CreateDir { path: PathBuf, source: io::Error },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("{path} is not usable ({reason}); delete the directory {dir} to regenerate the CA")]
    Corrupt {
        path: PathBuf,
        dir: PathBuf,
        reason: String,
    },
    #[error(
        "the sandbox's egress CA certificate {path} expired on {not_after}; {remedy}",
        remedy = renewal(.dir)
    )]
    Expired {
        path: PathBuf,
        dir: PathBuf,
        not_after: String,
    },
    #[error(
        "the egress CA directory {path} is not private to you ({why}): others could list \
         or replace what is in it. `chmod 700 {path}` (and make it yours); if anyone else \
         could have written in it, delete it to make a new CA",
        path = .path.display()
    )]
    DirNotPrivate { path: PathBuf, why: String },
    #[error(
        "{path} is not private to you ({why}): whoever can read it can mint certificates \
         the guests trust. If nobody else could have read it, `chmod 600` it (and make it \
         yours); else delete the directory {dir} to make a new CA"
    )]
    KeyNotPrivate {
        path: PathBuf,
        dir: PathBuf,
        why: String,
    },
    #[error("cannot generate a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("cannot generate a key: {0}")]
    GenerateKey(ring::error::Unspecified),
    #[error(
        "the key just generated has no public key where PKCS#8 (RFC 5915) puts it, so \
         no certificate can be made for it; the crypto library's key format has changed \
         and this is a bug in vmctl: report it"
    )]
    NoPublicKey,
    #[error("cannot build the TLS configuration for {host}: {source}")]
    Tls { host: String, source: rustls::Error },
}

/// What to do about a CA certificate that expired or is about to.
fn renewal(dir: &Path) -> String {
    format!(
        "delete the directory {} to make a new CA (the VM is given the new certificate \
         when it next starts)",
        dir.display()
    )
}

/// A CA certificate that expires within [`EXPIRY_WARNING_DAYS`] days: when, and what
/// to do (as for one that expired).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiresSoon {
    pub path: PathBuf,
    pub dir: PathBuf,
    pub not_after: String,
    /// Whole days left (0: less than one).
    pub days_left: u64,
}

impl std::fmt::Display for ExpiresSoon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the sandbox's egress CA certificate {} expires on {} (in {} day(s)); after \
             that the VM's TLS through the proxy to the hosts secrets are bound to fails. \
             Before then, {}",
            self.path.display(),
            self.not_after,
            self.days_left,
            renewal(&self.dir)
        )
    }
}

/// The CA of one sandbox.
pub struct CertificateAuthority {
    cert_pem: String,
    /// The CA certificate as rcgen needs it to sign leaves: rebuilt from the same
    /// name and key, so its subject and key identifier match the stored certificate.
    issuer: Certificate,
    /// A [`CaKey`] lent to rcgen: it holds no copy of the key's bytes.
    key: KeyPair,
    expires_soon: Option<ExpiresSoon>,
    leaves: Mutex<HashMap<String, (Instant, Arc<rustls::ServerConfig>)>>,
}

/// The CA's signing key as rcgen uses it ([the module](self) says why not rcgen's own).
struct CaKey {
    key: EcdsaKeyPair,
    rng: SystemRandom,
}

impl CaKey {
    /// The key pair rcgen signs with, from PKCS#8 bytes (P-256 ECDSA, as this module
    /// makes them); the error says why they are not.
    fn key_pair(pkcs8: &[u8]) -> Result<KeyPair, String> {
        let rng = SystemRandom::new();
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8, &rng)
            .map_err(|e| format!("not a P-256 ECDSA key ({e})"))?;
        KeyPair::from_remote(Box::new(CaKey { key, rng })).map_err(|e| e.to_string())
    }
}

impl RemoteKeyPair for CaKey {
    fn public_key(&self) -> &[u8] {
        self.key.public_key().as_ref()
    }

    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        self.key
            .sign(&self.rng, msg)
            .map(|signature| signature.as_ref().to_vec())
            .map_err(|_| rcgen::Error::RingUnspecified)
    }

    fn algorithm(&self) -> &'static SignatureAlgorithm {
        KEY_ALGORITHM
    }
}

/// A leaf's public key, for rcgen to put in its certificate.
struct LeafPublicKey(Vec<u8>);

impl PublicKeyData for LeafPublicKey {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &SignatureAlgorithm {
        KEY_ALGORITHM
    }
}

/// A new P-256 key, PKCS#8.
fn generate_pkcs8() -> Result<Zeroizing<Vec<u8>>, CaError> {
    let mut document =
        EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &SystemRandom::new())
            .map_err(CaError::GenerateKey)?;
    Ok(take_pkcs8(&mut document))
}

/// The bytes of `document`, copied into a buffer zeroized when dropped, and
/// `document` zeroed: it has no `Drop`, so the key would stay where it lay (on the
/// stack) once it is gone.
fn take_pkcs8(document: &mut ring::pkcs8::Document) -> Zeroizing<Vec<u8>> {
    let pkcs8 = Zeroizing::new(document.as_ref().to_vec());
    // SAFETY: `document` is borrowed exclusively, and ring 0.17's `Document` is plain
    // data (a byte array and its length: no pointer, reference, niche or `Drop`), so
    // all zeros is a valid value of it: an empty document.
    unsafe { zeroize::zeroize_flat_type(document as *mut ring::pkcs8::Document) };
    pkcs8
}

/// The public key (an uncompressed point) in `pkcs8`, a P-256 key as ring makes
/// them: RFC 5208's PrivateKeyInfo holding RFC 5915's ECPrivateKey, whose optional
/// `publicKey [1]` ring always fills in. Read from the bytes, as a key pair built to
/// ask it would hold the private key where nothing zeroizes it.
fn public_key_of(pkcs8: &[u8]) -> Option<&[u8]> {
    let (SEQUENCE, info, _) = der_element(pkcs8)? else {
        return None;
    };
    // The version and the algorithm come first.
    let mut rest = info;
    for _ in 0..2 {
        rest = der_element(rest)?.2;
    }
    let (OCTET_STRING, private_key, _) = der_element(rest)? else {
        return None;
    };
    let (SEQUENCE, ec_private_key, _) = der_element(private_key)? else {
        return None;
    };
    // Its version and the private key itself, then the optional fields.
    let mut rest = ec_private_key;
    for _ in 0..2 {
        rest = der_element(rest)?.2;
    }
    while !rest.is_empty() {
        let (tag, field, after) = der_element(rest)?;
        if tag == EC_PUBLIC_KEY_TAG {
            let (BIT_STRING, bits, _) = der_element(field)? else {
                return None;
            };
            // A point is whole bytes: no unused bits.
            return match bits.split_first()? {
                (0, point) if point.first() == Some(&UNCOMPRESSED_POINT) => Some(point),
                _ => None,
            };
        }
        rest = after;
    }
    None
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .finish_non_exhaustive()
    }
}

impl CertificateAuthority {
    /// Loads the CA in `dir`, or creates it (and `dir`) if there is none yet.
    /// `name` (the sandbox's) goes into the CA's common name.
    pub fn load_or_create(dir: &Path, name: &str) -> Result<Self, CaError> {
        create_private_dir(dir)?;
        // Each time, not only when made: a directory opened up since (a `chmod -R`, a
        // copy, a restore from a backup) lets others see or swap what is in it.
        check_private_dir(dir)?;
        let cert_path = dir.join(CERT_FILE);
        let key_path = dir.join(KEY_FILE);
        if cert_path.exists() && key_path.exists() {
            return Self::load(dir, name);
        }
        // A half-written CA (one file only) cannot have been handed to a guest
        // together with its key, so starting over loses nothing.
        let pkcs8 = generate_pkcs8()?;
        let key = CaKey::key_pair(&pkcs8).map_err(|reason| CaError::Corrupt {
            path: key_path.clone(),
            dir: dir.to_path_buf(),
            reason: format!("the key just generated is unusable: {reason}"),
        })?;
        let cert = ca_params(name).self_signed(&key)?;
        let key_pem = to_pem(PRIVATE_KEY_LABEL, &pkcs8);
        write_new(&key_path, key_pem.as_bytes(), 0o600)?;
        write_new(&cert_path, cert.pem().as_bytes(), 0o644)?;
        Ok(Self::new(cert.pem(), cert, key, None))
    }

    fn load(dir: &Path, name: &str) -> Result<Self, CaError> {
        let cert_path = dir.join(CERT_FILE);
        let key_path = dir.join(KEY_FILE);
        let corrupt = |path: &Path, reason: String| CaError::Corrupt {
            path: path.to_path_buf(),
            dir: dir.to_path_buf(),
            reason,
        };
        let cert_pem = fs::read_to_string(&cert_path).map_err(|source| CaError::Read {
            path: cert_path.clone(),
            source,
        })?;
        let key_pem = read_private_key(&key_path, dir)?;
        let pkcs8 = from_pem(PRIVATE_KEY_LABEL, &key_pem)
            .ok_or_else(|| corrupt(&key_path, "no PEM private key (PKCS#8) in it".into()))?;
        let key = CaKey::key_pair(&pkcs8).map_err(|reason| corrupt(&key_path, reason))?;
        let cert_der = first_certificate(&cert_pem)
            .ok_or_else(|| corrupt(&cert_path, "no PEM certificate in it".into()))?;
        // The proxy's own check below cannot see this: a root's validity is not
        // checked when it is the trust anchor, but the guest's TLS clients check it.
        let not_after = not_after(&cert_der)
            .ok_or_else(|| corrupt(&cert_path, "its validity cannot be read".into()))?;
        let now = since_epoch().as_secs();
        if not_after.unix_secs < now {
            return Err(CaError::Expired {
                path: cert_path,
                dir: dir.to_path_buf(),
                not_after: not_after.text,
            });
        }
        let seconds_left = not_after.unix_secs - now;
        let expires_soon =
            (seconds_left < EXPIRY_WARNING_DAYS * DAY.as_secs()).then(|| ExpiresSoon {
                path: cert_path.clone(),
                dir: dir.to_path_buf(),
                not_after: not_after.text,
                days_left: seconds_left / DAY.as_secs(),
            });
        let issuer = ca_params(name).self_signed(&key)?;
        let ca = Self::new(cert_pem, issuer, key, expires_soon);
        // Prove the pair works: a leaf signed with the key must verify against the
        // stored certificate. This catches a key from another CA and a certificate
        // made for another sandbox name, which would otherwise fail later, in the
        // guest, as an obscure TLS error.
        let probe = ca.mint_leaf("probe.invalid")?;
        verify_leaf(&cert_der, &probe.0, "probe.invalid").map_err(|e| {
            corrupt(
                &cert_path,
                format!("it does not match {KEY_FILE} or was made for another name: {e}"),
            )
        })?;
        // Not logged here: the caller says it where its user reads it (vmctl's
        // supervisor, as a `vmctl: warning:` line that `vmctl up` shows), and a log
        // line here would say it a second time.
        Ok(ca)
    }

    fn new(
        cert_pem: String,
        issuer: Certificate,
        key: KeyPair,
        expires_soon: Option<ExpiresSoon>,
    ) -> Self {
        Self {
            cert_pem,
            issuer,
            key,
            expires_soon,
            leaves: Mutex::new(HashMap::new()),
        }
    }

    /// Set when the CA certificate expires within [`EXPIRY_WARNING_DAYS`] days: for
    /// the caller to warn its user of, with what to do (loading logs nothing of it).
    pub fn expires_soon(&self) -> Option<&ExpiresSoon> {
        self.expires_soon.as_ref()
    }

    /// The CA certificate, PEM, as the guest installs it.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A TLS server configuration presenting a leaf certificate for `host` (a DNS
    /// name or an IP literal), ALPN `http/1.1` only. Cached per host.
    pub fn server_config_for(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, CaError> {
        if let Some(config) = self.cached(host) {
            return Ok(config);
        }
        let (cert, mut key) = self.mint_leaf(host)?;
        // Moved out, not copied: rustls's key provider zeroizes it once read.
        let key = std::mem::replace(&mut *key, PrivateKeyDer::Pkcs8(Vec::new().into()));
        let tls = |source| CaError::Tls {
            host: host.to_string(),
            source,
        };
        let mut config = rustls::ServerConfig::builder_with_provider(crate_provider())
            .with_safe_default_protocol_versions()
            .map_err(tls)?
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .map_err(tls)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let config = Arc::new(config);
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        if leaves.len() >= LEAF_CACHE_ENTRIES {
            // Simple eviction: minting is cheap, a full cache means an unusual guest.
            leaves.clear();
        }
        leaves.insert(host.to_string(), (Instant::now(), config.clone()));
        Ok(config)
    }

    fn cached(&self, host: &str) -> Option<Arc<rustls::ServerConfig>> {
        let leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        let (minted, config) = leaves.get(host)?;
        (minted.elapsed() < LEAF_REFRESH).then(|| config.clone())
    }

    /// A fresh key and a certificate for `host` signed by this CA.
    fn mint_leaf(
        &self,
        host: &str,
    ) -> Result<(CertificateDer<'static>, Zeroizing<PrivateKeyDer<'static>>), CaError> {
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, host);
        let san = match host.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(host.try_into()?),
        };
        params.subject_alt_names = vec![san];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        // An hour back tolerates a guest clock slightly behind the host's.
        let since_epoch = since_epoch();
        params.not_before = rcgen::date_time_ymd(1970, 1, 1) + since_epoch.saturating_sub(HOUR);
        params.not_after = rcgen::date_time_ymd(1970, 1, 1) + since_epoch + 30 * DAY;
        let mut pkcs8 = generate_pkcs8()?;
        let public_key = public_key_of(&pkcs8).ok_or(CaError::NoPublicKey)?.to_vec();
        let cert = params.signed_by(&LeafPublicKey(public_key), &self.issuer, &self.key)?;
        // Moved, not copied: one buffer holds the key's bytes, zeroized when dropped.
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(std::mem::take(&mut *pkcs8)));
        Ok((cert.der().clone(), Zeroizing::new(key_der)))
    }
}

/// The CA's parameters; deterministic for a name, so a reloaded key rebuilds an
/// issuer whose subject matches the stored certificate.
fn ca_params(name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, format!("vmctl egress CA ({name})"));
    // Path length 0: this CA signs leaves only, never another CA.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let since_epoch = since_epoch();
    params.not_before = rcgen::date_time_ymd(1970, 1, 1) + since_epoch.saturating_sub(HOUR);
    params.not_after = rcgen::date_time_ymd(1970, 1, 1) + since_epoch + 3650 * DAY;
    params
}

/// Time since the Unix epoch (rcgen's dates are built from it, which spares this
/// crate a direct dependency on `time`).
fn since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// The crypto provider all of this crate's TLS uses, chosen explicitly so nothing
/// depends on a process-wide default being installed.
pub(crate) fn crate_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn first_certificate(pem: &str) -> Option<CertificateDer<'static>> {
    rustls_pemfile::certs(&mut pem.as_bytes()).next()?.ok()
}

/// When a certificate stops being valid: as Unix time, and as text for people.
struct NotAfter {
    unix_secs: u64,
    text: String,
}

/// The end of `cert`'s validity (RFC 5280 4.1: Certificate, TBSCertificate,
/// Validity), or `None` if the DER does not hold one where it should.
fn not_after(cert: &[u8]) -> Option<NotAfter> {
    let (SEQUENCE, cert, _) = der_element(cert)? else {
        return None;
    };
    let (SEQUENCE, tbs, _) = der_element(cert)? else {
        return None;
    };
    let mut rest = tbs;
    // The version, [0], is absent from a v1 certificate.
    let (tag, _, after_version) = der_element(rest)?;
    if tag == VERSION_TAG {
        rest = after_version;
    }
    // The serial number, the signature algorithm and the issuer come first.
    for _ in 0..3 {
        rest = der_element(rest)?.2;
    }
    let (SEQUENCE, validity, _) = der_element(rest)? else {
        return None;
    };
    let (_, _, after_not_before) = der_element(validity)?;
    let (tag, time, _) = der_element(after_not_before)?;
    der_time(tag, time)
}

const SEQUENCE: u8 = 0x30;
const BIT_STRING: u8 = 0x03;
const OCTET_STRING: u8 = 0x04;
/// ECPrivateKey's `publicKey [1]` (RFC 5915, 3).
const EC_PUBLIC_KEY_TAG: u8 = 0xa1;
/// The first byte of an uncompressed elliptic-curve point (SEC 1, 2.3.3).
const UNCOMPRESSED_POINT: u8 = 0x04;
const VERSION_TAG: u8 = 0xa0;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;

/// The DER element at the start of `der`: its tag, its contents and what follows it.
fn der_element(der: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 || rest.len() < count {
            return None;
        }
        let len = rest[..count]
            .iter()
            .fold(0usize, |len, byte| (len << 8) | usize::from(*byte));
        (len, &rest[count..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// A certificate's time (RFC 5280 4.1.2.5: UTCTime `YYMMDDHHMMSSZ`, years 1950 to
/// 2049, or GeneralizedTime `YYYYMMDDHHMMSSZ`).
fn der_time(tag: u8, text: &[u8]) -> Option<NotAfter> {
    let text = std::str::from_utf8(text).ok()?;
    let digits = text.strip_suffix('Z')?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (year, rest) = match (tag, digits.len()) {
        (UTC_TIME, 12) => {
            let short: u64 = digits[..2].parse().ok()?;
            (
                if short < 50 {
                    2000 + short
                } else {
                    1900 + short
                },
                &digits[2..],
            )
        }
        (GENERALIZED_TIME, 14) => (digits[..4].parse().ok()?, &digits[4..]),
        _ => return None,
    };
    let field = |at: usize| rest[at..at + 2].parse::<u64>().ok();
    let (month, day) = (field(0)?, field(2)?);
    let (hour, minute, second) = (field(4)?, field(6)?, field(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 {
        return None;
    }
    let unix_secs =
        days_since_epoch(year, month, day)? * 86_400 + hour * 3600 + minute * 60 + second;
    Some(NotAfter {
        unix_secs,
        text: format!("{year:04}-{month:02}-{day:02} {hour:02}:{minute:02}:{second:02} UTC"),
    })
}

/// Days from 1970-01-01 to the date (Howard Hinnant's `days_from_civil`), for dates
/// from 1970 on.
fn days_since_epoch(year: u64, month: u64, day: u64) -> Option<u64> {
    let year = if month <= 2 {
        year.checked_sub(1)?
    } else {
        year
    };
    let era = year / 400;
    let year_of_era = year % 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    (era * 146_097 + day_of_era).checked_sub(719_468)
}

/// Verifies `leaf` for `host` against the single root `ca`.
pub(crate) fn verify_leaf(
    ca: &CertificateDer<'static>,
    leaf: &CertificateDer<'static>,
    host: &str,
) -> Result<(), rustls::Error> {
    use rustls::client::danger::ServerCertVerifier;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone())?;
    let verifier =
        rustls::client::WebPkiServerVerifier::builder_with_provider(roots.into(), crate_provider())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| rustls::Error::General(e.to_string()))?;
    let now = rustls::pki_types::UnixTime::now();
    verifier.verify_server_cert(leaf, &[], &name, &[], now)?;
    Ok(())
}

/// Reads the key file, refusing one that is not a regular file of this user's with
/// no access for anyone else. Checked on the file opened (no symlink followed), so
/// what is read is what was checked.
fn read_private_key(path: &Path, dir: &Path) -> Result<Zeroizing<String>, CaError> {
    use std::io::Read;
    let read_error = |source| CaError::Read {
        path: path.to_path_buf(),
        source,
    };
    // O_NONBLOCK: a FIFO put there must not hold the open; it is refused below.
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => CaError::KeyNotPrivate {
                path: path.to_path_buf(),
                dir: dir.to_path_buf(),
                why: "it is a symlink".into(),
            },
            _ => read_error(e),
        })?;
    let meta = file.metadata().map_err(read_error)?;
    let why = if !meta.file_type().is_file() {
        Some("it is not a regular file".to_string())
    } else {
        why_not_private(&meta)
    };
    if let Some(why) = why {
        return Err(CaError::KeyNotPrivate {
            path: path.to_path_buf(),
            dir: dir.to_path_buf(),
            why,
        });
    }
    let mut key = Zeroizing::new(String::new());
    file.read_to_string(&mut key).map_err(read_error)?;
    Ok(key)
}

/// Why a file or directory with `meta` is not this user's alone: another's, or open
/// to its group or others in any way.
fn why_not_private(meta: &fs::Metadata) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        Some(format!(
            "it belongs to uid {}, not to you ({me})",
            meta.uid()
        ))
    } else if meta.mode() & 0o077 != 0 {
        Some(format!("its mode is {:o}", meta.mode() & 0o7777))
    } else {
        None
    }
}

/// Refuses `dir` unless it is a directory of this user's that no one else has any
/// access to (it is made so: 0700).
fn check_private_dir(dir: &Path) -> Result<(), CaError> {
    let meta = fs::metadata(dir).map_err(|source| CaError::Read {
        path: dir.to_path_buf(),
        source,
    })?;
    let why = if !meta.is_dir() {
        Some("it is not a directory".to_string())
    } else {
        why_not_private(&meta)
    };
    match why {
        Some(why) => Err(CaError::DirNotPrivate {
            path: dir.to_path_buf(),
            why,
        }),
        None => Ok(()),
    }
}

/// `der` as PEM with `label`, in a buffer zeroized when dropped.
fn to_pem(label: &str, der: &[u8]) -> Zeroizing<String> {
    use base64::Engine;
    let body = Zeroizing::new(base64::engine::general_purpose::STANDARD.encode(der));
    let lines = body.len().div_ceil(64);
    let mut pem = Zeroizing::new(String::with_capacity(
        body.len() + lines + 2 * label.len() + 40,
    ));
    pem.push_str(&format!("-----BEGIN {label}-----\n"));
    for line in body.as_bytes().chunks(64) {
        // Base64 is ASCII: each chunk is text.
        pem.push_str(std::str::from_utf8(line).unwrap_or_default());
        pem.push('\n');
    }
    pem.push_str(&format!("-----END {label}-----\n"));
    pem
}

/// The bytes of the first PEM block labelled `label` in `pem`, decoded into a buffer
/// zeroized when dropped (as are the intermediate copies).
fn from_pem(label: &str, pem: &str) -> Option<Zeroizing<Vec<u8>>> {
    use base64::Engine;
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let start = pem.find(&begin)? + begin.len();
    let stop = start + pem[start..].find(&end)?;
    let mut text = Zeroizing::new(String::with_capacity(stop - start));
    text.extend(
        pem[start..stop]
            .chars()
            .filter(|c| !c.is_ascii_whitespace()),
    );
    let mut der = Zeroizing::new(Vec::with_capacity(text.len() / 4 * 3 + 3));
    base64::engine::general_purpose::STANDARD
        .decode_vec(text.as_bytes(), &mut der)
        .ok()?;
    Some(der)
}

/// Creates `dir` (and its parents) with the directory itself 0700.
fn create_private_dir(dir: &Path) -> Result<(), CaError> {
    let err = |source| CaError::CreateDir {
        path: dir.to_path_buf(),
        source,
    };
    if !dir.exists() {
        if let Some(parent) = dir.parent() {
            fs::create_dir_all(parent).map_err(err)?;
        }
        match DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(err(e)),
        }
    }
    Ok(())
}

/// Writes `path` through a temporary file created with `mode` from the start, then
/// renames it into place, so a crash never leaves a truncated file under the name.
fn write_new(path: &Path, contents: &[u8], mode: u32) -> Result<(), CaError> {
    let err = |source| CaError::Write {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("pem.tmp");
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    file.write_all(contents).map_err(err)?;
    // The umask may have narrowed the mode; widening a public certificate is safe.
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(err)?;
    file.sync_all().map_err(err)?;
    fs::rename(&tmp, path).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A temporary directory as the CA's is made: 0700 (tempfile's may be wider).
    fn private_tempdir() -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o700)).unwrap();
        tmp
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn creates_files_with_private_modes() {
        let tmp = private_tempdir();
        let dir = tmp.path().join("state/ca");
        let ca = CertificateAuthority::load_or_create(&dir, "box1").unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join(KEY_FILE)), 0o600);
        assert_eq!(mode(&dir.join(CERT_FILE)), 0o644);
        assert!(ca.cert_pem().starts_with("-----BEGIN CERTIFICATE-----"));
        let on_disk = fs::read_to_string(dir.join(CERT_FILE)).unwrap();
        assert_eq!(on_disk, ca.cert_pem());
        assert!(!dir.join("ca-key.pem.tmp").exists());
    }

    #[test]
    fn a_key_others_can_read_is_refused_until_it_is_private_again() {
        let tmp = private_tempdir();
        CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        let key = tmp.path().join(KEY_FILE);
        for open in [0o640, 0o604, 0o620] {
            fs::set_permissions(&key, fs::Permissions::from_mode(open)).unwrap();
            let e = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap_err();
            assert!(matches!(e, CaError::KeyNotPrivate { .. }), "{open:o}: {e}");
            assert!(e.to_string().contains(&format!("mode is {open:o}")), "{e}");
        }
        fs::set_permissions(&key, fs::Permissions::from_mode(0o600)).unwrap();
        CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        // A symlink to a key elsewhere is no private key file of the CA's either.
        let elsewhere = tmp.path().join("elsewhere.pem");
        fs::rename(&key, &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &key).unwrap();
        let e = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap_err();
        assert!(e.to_string().contains("it is a symlink"), "{e}");
    }

    #[test]
    fn reload_gives_the_same_ca_and_its_leaves_verify() {
        let tmp = private_tempdir();
        let first = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        let again = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        assert_eq!(first.cert_pem(), again.cert_pem());
        let root = first_certificate(first.cert_pem()).unwrap();
        let (leaf, _) = again.mint_leaf("api.example.com").unwrap();
        verify_leaf(&root, &leaf, "api.example.com").unwrap();
        assert!(verify_leaf(&root, &leaf, "other.example.com").is_err());
    }

    #[test]
    fn leaf_for_an_ip_literal_has_an_ip_san() {
        let tmp = private_tempdir();
        let ca = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        let root = first_certificate(ca.cert_pem()).unwrap();
        let (leaf, _) = ca.mint_leaf("203.0.113.7").unwrap();
        verify_leaf(&root, &leaf, "203.0.113.7").unwrap();
    }

    #[test]
    fn server_configs_are_cached_per_host() {
        let tmp = private_tempdir();
        let ca = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        let a = ca.server_config_for("a.test").unwrap();
        let a2 = ca.server_config_for("a.test").unwrap();
        let b = ca.server_config_for("b.test").unwrap();
        assert!(Arc::ptr_eq(&a, &a2));
        assert!(!Arc::ptr_eq(&a, &b));
        assert_eq!(a.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }

    #[test]
    fn corrupt_files_name_the_path_and_the_remedy() {
        let tmp = private_tempdir();
        CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        fs::write(tmp.path().join(KEY_FILE), "garbage").unwrap();
        let err = CertificateAuthority::load_or_create(tmp.path(), "box1")
            .unwrap_err()
            .to_string();
        assert!(err.contains(KEY_FILE), "{err}");
        assert!(err.contains("delete the directory"), "{err}");
    }

    #[test]
    fn an_expired_ca_says_so_and_what_to_do() {
        let tmp = private_tempdir();
        CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        let key_pem = fs::read_to_string(tmp.path().join(KEY_FILE)).unwrap();
        let key = KeyPair::from_pem(&key_pem).unwrap();
        let mut params = ca_params("box1");
        params.not_before = rcgen::date_time_ymd(2000, 1, 1);
        params.not_after = rcgen::date_time_ymd(2010, 1, 1);
        let expired = params.self_signed(&key).unwrap();
        fs::write(tmp.path().join(CERT_FILE), expired.pem()).unwrap();
        let err = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap_err();
        assert!(matches!(err, CaError::Expired { .. }), "{err}");
        let err = err.to_string();
        assert!(err.contains("expired on 2010-01-01 00:00:00 UTC"), "{err}");
        assert!(err.contains("delete the directory"), "{err}");
    }

    /// A CA certificate signed by the key in `dir` for `name`, valid until `days`
    /// from now, written over the one there.
    fn reissue(dir: &Path, name: &str, days: u64) {
        let key_pem = fs::read_to_string(dir.join(KEY_FILE)).unwrap();
        let key = KeyPair::from_pem(&key_pem).unwrap();
        let mut params = ca_params(name);
        params.not_after = rcgen::date_time_ymd(1970, 1, 1) + since_epoch() + DAY * days as u32;
        fs::write(dir.join(CERT_FILE), params.self_signed(&key).unwrap().pem()).unwrap();
    }

    /// What `run` logs through `tracing`, at any level, with its result.
    fn logged_while<T>(run: impl FnOnce() -> T) -> (T, String) {
        #[derive(Clone, Default)]
        struct Log(Arc<Mutex<Vec<u8>>>);
        impl Write for Log {
            fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let log = Log::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .finish();
        let result = tracing::subscriber::with_default(subscriber, run);
        let logged = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        (result, logged)
    }

    #[test]
    fn a_ca_that_expires_within_30_days_is_loaded_with_a_warning() {
        let tmp = private_tempdir();
        let fresh = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        assert_eq!(fresh.expires_soon(), None);
        reissue(tmp.path(), "box1", 10);
        let (ca, logged) =
            logged_while(|| CertificateAuthority::load_or_create(tmp.path(), "box1"));
        let ca = ca.unwrap();
        // Said once, by the caller (vmctl's `vmctl: warning:` line): not logged too.
        assert_eq!(logged, "");
        let soon = ca.expires_soon().expect("no warning 10 days before expiry");
        // 10 days less the time since, or 10 with the certificate's whole seconds.
        assert!((9..=10).contains(&soon.days_left), "{soon}");
        let text = soon.to_string();
        assert!(
            text.contains(&tmp.path().join(CERT_FILE).display().to_string()),
            "{text}"
        );
        assert!(
            text.contains(&format!("expires on {}", soon.not_after)),
            "{text}"
        );
        // The same remedy as for an expired CA.
        assert!(text.contains(&renewal(tmp.path())), "{text}");
        // Still usable meanwhile.
        ca.server_config_for("api.example.com").unwrap();
        reissue(tmp.path(), "box1", EXPIRY_WARNING_DAYS + 1);
        let later = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        assert_eq!(later.expires_soon(), None);
    }

    #[test]
    fn a_ca_directory_others_can_reach_is_refused_until_it_is_private_again() {
        let tmp = private_tempdir();
        let dir = tmp.path().join("ca");
        CertificateAuthority::load_or_create(&dir, "box1").unwrap();
        for open in [0o750, 0o705, 0o701, 0o770] {
            fs::set_permissions(&dir, fs::Permissions::from_mode(open)).unwrap();
            let e = CertificateAuthority::load_or_create(&dir, "box1").unwrap_err();
            assert!(matches!(e, CaError::DirNotPrivate { .. }), "{open:o}: {e}");
            let text = e.to_string();
            assert!(text.contains(&format!("mode is {open:o}")), "{text}");
            assert!(
                text.contains(&format!("`chmod 700 {}`", dir.display())),
                "{text}"
            );
        }
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        CertificateAuthority::load_or_create(&dir, "box1").unwrap();
        // One made by someone else, before any CA was: no CA is made in it.
        let premade = tmp.path().join("premade");
        fs::create_dir(&premade).unwrap();
        fs::set_permissions(&premade, fs::Permissions::from_mode(0o755)).unwrap();
        let e = CertificateAuthority::load_or_create(&premade, "box1").unwrap_err();
        assert!(matches!(e, CaError::DirNotPrivate { .. }), "{e}");
        assert!(!premade.join(KEY_FILE).exists());
    }

    /// Whether rcgen holds the bytes of `key`: it serializes them if it does, and
    /// panics if it has none (a remote key pair), its only way of telling.
    fn rcgen_holds_the_bytes_of(key: &KeyPair) -> bool {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| key.serialized_der().len()))
            .is_ok_and(|len| len > 0)
    }

    /// rcgen's own key pairs keep the PKCS#8 bytes in a buffer never zeroized; the
    /// CA's is lent to rcgen without them.
    #[test]
    fn rcgen_holds_no_copy_of_the_ca_key() {
        let generated = KeyPair::generate_for(KEY_ALGORITHM).unwrap();
        assert!(rcgen_holds_the_bytes_of(&generated));
        let tmp = private_tempdir();
        let created = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        assert!(!rcgen_holds_the_bytes_of(&created.key));
        let loaded = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        assert!(!rcgen_holds_the_bytes_of(&loaded.key));
        let root = first_certificate(loaded.cert_pem()).unwrap();
        let (leaf, key) = loaded.mint_leaf("api.example.com").unwrap();
        verify_leaf(&root, &leaf, "api.example.com").unwrap();
        assert!(matches!(&*key, PrivateKeyDer::Pkcs8(der) if !der.secret_pkcs8_der().is_empty()));
    }

    #[test]
    fn rings_pkcs8_document_is_zeroed_once_copied() {
        let mut document =
            EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &SystemRandom::new())
                .unwrap();
        let pkcs8 = take_pkcs8(&mut document);
        let rng = SystemRandom::new();
        EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &pkcs8, &rng).unwrap();
        assert!(document.as_ref().is_empty());
        // SAFETY: reads the bytes of a value that is borrowed immutably for as long and
        // not moved since the wipe, which wrote every one of them (padding included).
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&document as *const ring::pkcs8::Document).cast::<u8>(),
                std::mem::size_of::<ring::pkcs8::Document>(),
            )
        };
        assert!(bytes.iter().all(|byte| *byte == 0), "{bytes:?}");
    }

    #[test]
    fn a_leafs_public_key_is_read_from_its_pkcs8_bytes() {
        let rng = SystemRandom::new();
        for _ in 0..8 {
            let pkcs8 = generate_pkcs8().unwrap();
            let pair =
                EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &pkcs8, &rng).unwrap();
            assert_eq!(public_key_of(&pkcs8), Some(pair.public_key().as_ref()));
            // Cut anywhere, the bytes hold no key.
            for end in 0..pkcs8.len() {
                assert_eq!(public_key_of(&pkcs8[..end]), None, "cut at {end}");
            }
        }
        let by_rcgen = KeyPair::generate_for(KEY_ALGORITHM).unwrap();
        assert_eq!(
            public_key_of(&by_rcgen.serialize_der()),
            Some(by_rcgen.public_key_raw())
        );
        assert_eq!(public_key_of(b"\x30\x00"), None);
    }

    /// A CA made before the key was written here (by rcgen) loads as before.
    #[test]
    fn a_key_written_by_rcgen_loads() {
        let tmp = private_tempdir();
        CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        let key = KeyPair::generate_for(KEY_ALGORITHM).unwrap();
        let cert = ca_params("box1").self_signed(&key).unwrap();
        fs::write(tmp.path().join(KEY_FILE), key.serialize_pem()).unwrap();
        fs::write(tmp.path().join(CERT_FILE), cert.pem()).unwrap();
        let ca = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        assert_eq!(ca.cert_pem(), cert.pem());
        let root = first_certificate(ca.cert_pem()).unwrap();
        let (leaf, _) = ca.mint_leaf("api.example.com").unwrap();
        verify_leaf(&root, &leaf, "api.example.com").unwrap();
    }

    #[test]
    fn pem_round_trips_and_finds_its_block() {
        let der: Vec<u8> = (0..=255).collect();
        let pem = to_pem(PRIVATE_KEY_LABEL, &der);
        assert!(pem.lines().all(|line| line.len() <= 64));
        assert_eq!(from_pem(PRIVATE_KEY_LABEL, &pem).as_deref(), Some(&der));
        let crlf = format!("junk\r\n{}", pem.replace('\n', "\r\n"));
        assert_eq!(from_pem(PRIVATE_KEY_LABEL, &crlf).as_deref(), Some(&der));
        assert_eq!(from_pem("CERTIFICATE", &pem), None);
        assert_eq!(
            from_pem(PRIVATE_KEY_LABEL, "-----BEGIN PRIVATE KEY-----\n!!\n"),
            None
        );
    }

    #[test]
    fn a_fresh_ca_lasts_ten_years() {
        let tmp = private_tempdir();
        let ca = CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        let der = first_certificate(ca.cert_pem()).unwrap();
        let end = not_after(&der).unwrap().unix_secs;
        let ten_years = 3650 * DAY.as_secs();
        let now = since_epoch().as_secs();
        assert!(end.abs_diff(now + ten_years) < 60, "{end} vs {now}");
    }

    #[test]
    fn certificate_times_read_in_both_forms() {
        let utc = der_time(UTC_TIME, b"491231235959Z").unwrap();
        assert_eq!(utc.unix_secs, 2_524_607_999);
        assert_eq!(utc.text, "2049-12-31 23:59:59 UTC");
        assert_eq!(der_time(UTC_TIME, b"700101000000Z").unwrap().unix_secs, 0);
        let general = der_time(GENERALIZED_TIME, b"20500101000000Z").unwrap();
        assert_eq!(general.unix_secs, 2_524_608_000);
        for bad in [
            &b"20500101000000"[..],
            b"2050010100000Z",
            b"20501301000000Z",
            b"2050O101000000Z",
        ] {
            assert!(der_time(GENERALIZED_TIME, bad).is_none(), "{bad:?}");
        }
        assert!(der_time(UTC_TIME, b"20500101000000Z").is_none());
    }

    #[test]
    fn a_key_from_another_ca_is_refused() {
        let tmp = private_tempdir();
        let other = private_tempdir();
        CertificateAuthority::load_or_create(tmp.path(), "box1").unwrap();
        CertificateAuthority::load_or_create(other.path(), "box1").unwrap();
        fs::copy(other.path().join(KEY_FILE), tmp.path().join(KEY_FILE)).unwrap();
        let err = CertificateAuthority::load_or_create(tmp.path(), "box1")
            .unwrap_err()
            .to_string();
        assert!(err.contains(CERT_FILE), "{err}");
        assert!(err.contains("delete the directory"), "{err}");
    }
}
