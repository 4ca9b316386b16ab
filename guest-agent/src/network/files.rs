//! The guest files `ConfigureNetwork` manages: the egress CA (its own file, the
//! `update-ca-certificates` source directory, the system bundle) and a managed block
//! of `/etc/environment`. Every write is idempotent, so the host may resend its
//! configuration.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::protocol::{GUEST_CA_BUNDLE, GUEST_CA_FILE, GUEST_NODE_PRELOAD};

/// The largest CA certificate (chain) accepted.
pub const MAX_CA_SIZE: usize = 64 * 1024;
/// The largest set of trusted roots accepted (a system bundle is ~220 KiB).
pub const MAX_ROOTS_SIZE: usize = 768 * 1024;
/// First and last line of the block of `/etc/environment` the agent owns.
pub const ENV_BLOCK_BEGIN: &str = "# vmctl network (managed)";
pub const ENV_BLOCK_END: &str = "# end vmctl network";

const PEM_BEGIN: &str = "-----BEGIN CERTIFICATE-----";
const PEM_END: &str = "-----END CERTIFICATE-----";

/// Errors of validating and writing the network files.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("the {what} is {size} bytes, more than the {max} allowed")]
    PemTooLarge {
        what: &'static str,
        size: usize,
        max: usize,
    },
    #[error("the {0} is not PEM (expected {PEM_BEGIN} ... {PEM_END})")]
    NotPem(&'static str),
    #[error("invalid environment variable name {0:?} (expected [A-Za-z_][A-Za-z0-9_]*)")]
    BadEnvName(String),
    #[error("the value of environment variable {0} contains a line break or NUL")]
    BadEnvValue(String),
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

/// Where the files go; [`Default`] is the guest's real paths, tests use [`Self::under`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkPaths {
    /// The CA alone ([`GUEST_CA_FILE`]), for `SSL_CERT_FILE`-style variables.
    pub ca_file: PathBuf,
    /// The CA as an `update-ca-certificates` source, so a later run (which rebuilds
    /// the bundle, and links `/etc/ssl/certs/vmctl-egress.pem` to this file) keeps it.
    pub ca_store_file: PathBuf,
    /// The host's trusted roots as an `update-ca-certificates` source, likewise.
    pub roots_store_file: PathBuf,
    /// The system bundle ([`GUEST_CA_BUNDLE`]) the CA and the roots are appended to.
    pub ca_bundle: PathBuf,
    /// `/etc/environment`.
    pub environment: PathBuf,
    /// [`GUEST_NODE_PRELOAD`].
    pub node_preload: PathBuf,
}

const CA_STORE_FILE: &str = "/usr/local/share/ca-certificates/vmctl-egress.crt";
const ROOTS_STORE_FILE: &str = "/usr/local/share/ca-certificates/vmctl-host-roots.crt";
const ENVIRONMENT_FILE: &str = "/etc/environment";

impl Default for NetworkPaths {
    fn default() -> Self {
        Self {
            ca_file: GUEST_CA_FILE.into(),
            ca_store_file: CA_STORE_FILE.into(),
            roots_store_file: ROOTS_STORE_FILE.into(),
            ca_bundle: GUEST_CA_BUNDLE.into(),
            environment: ENVIRONMENT_FILE.into(),
            node_preload: GUEST_NODE_PRELOAD.into(),
        }
    }
}

impl NetworkPaths {
    /// The production paths moved under `root` (e.g. a test's temp dir).
    pub fn under(root: &Path) -> Self {
        let at = |p: &str| root.join(p.trim_start_matches('/'));
        Self {
            ca_file: at(GUEST_CA_FILE),
            ca_store_file: at(CA_STORE_FILE),
            roots_store_file: at(ROOTS_STORE_FILE),
            ca_bundle: at(GUEST_CA_BUNDLE),
            environment: at(ENVIRONMENT_FILE),
            node_preload: at(GUEST_NODE_PRELOAD),
        }
    }
}

/// Checks that `pem` is one or more PEM certificates and returns it trimmed, with a
/// final newline.
pub fn validate_ca(pem: &str) -> Result<String, FileError> {
    validate_pem(pem, "CA certificate", MAX_CA_SIZE)
}

/// [`validate_ca`] for the host's trusted roots.
pub fn validate_roots(pem: &str) -> Result<String, FileError> {
    validate_pem(pem, "set of trusted roots", MAX_ROOTS_SIZE)
}

fn validate_pem(pem: &str, what: &'static str, max: usize) -> Result<String, FileError> {
    if pem.len() > max {
        return Err(FileError::PemTooLarge {
            what,
            size: pem.len(),
            max,
        });
    }
    let pem = pem.trim();
    let begin_count = pem.matches(PEM_BEGIN).count();
    if !pem.starts_with(PEM_BEGIN)
        || !pem.ends_with(PEM_END)
        || begin_count != pem.matches(PEM_END).count()
        || pem.contains('\0')
    {
        return Err(FileError::NotPem(what));
    }
    Ok(format!("{pem}\n"))
}

/// Checks variable names and values, and keeps the last value of a repeated name.
pub fn validate_env(env: &[(String, String)]) -> Result<Vec<(String, String)>, FileError> {
    let mut out: Vec<(String, String)> = Vec::with_capacity(env.len());
    for (k, v) in env {
        let mut chars = k.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(FileError::BadEnvName(k.chars().take(64).collect()));
        }
        if v.contains(['\n', '\r', '\0']) {
            return Err(FileError::BadEnvValue(k.clone()));
        }
        out.retain(|(old, _)| old != k);
        out.push((k.clone(), v.clone()));
    }
    Ok(out)
}

fn write_err(path: &Path) -> impl FnOnce(io::Error) -> FileError + '_ {
    move |source| FileError::Write {
        path: path.to_owned(),
        source,
    }
}

fn create_parent(path: &Path) -> Result<(), FileError> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            fs::create_dir_all(dir).map_err(write_err(path))
        }
        _ => Ok(()),
    }
}

/// Replaces `path` with `contents` (mode 0644) through a temporary file and a
/// rename, so readers never see half a file.
fn write_atomic(path: &Path, contents: &[u8]) -> Result<(), FileError> {
    create_parent(path)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".vmctl-tmp");
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&tmp)?;
        f.write_all(contents)?;
        // The mode given to open() is filtered by the umask.
        f.set_permissions(fs::Permissions::from_mode(0o644))?;
        drop(f);
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(write_err(path))
}

fn read_optional(path: &Path) -> Result<String, FileError> {
    match fs::read(path) {
        Ok(bytes) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(String::new()),
        Err(source) => Err(FileError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Installs a validated CA (see [`validate_ca`]): its own two files, and the bundle
/// unless the bundle already holds it. The bundle is appended to in place, keeping
/// whatever else it has.
pub fn install_ca(paths: &NetworkPaths, pem: &str) -> Result<(), FileError> {
    write_atomic(&paths.ca_file, pem.as_bytes())?;
    write_atomic(&paths.ca_store_file, pem.as_bytes())?;
    let bundle = read_optional(&paths.ca_bundle)?;
    if bundle.contains(pem.trim()) {
        return Ok(());
    }
    append_to_bundle(paths, &bundle, pem)
}

/// Installs validated trusted roots (see [`validate_roots`]): their own file, and in
/// the bundle each certificate it does not hold yet (compared by content, whatever
/// the line breaks).
pub fn install_roots(paths: &NetworkPaths, pem: &str) -> Result<(), FileError> {
    write_atomic(&paths.roots_store_file, pem.as_bytes())?;
    let bundle = read_optional(&paths.ca_bundle)?;
    let held: std::collections::HashSet<String> =
        pem_blocks(&bundle).map(|block| block.body).collect();
    let mut missing = String::new();
    for block in pem_blocks(pem) {
        if !held.contains(&block.body) {
            missing.push_str(block.text);
            missing.push('\n');
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    append_to_bundle(paths, &bundle, &missing)
}

/// One certificate of a PEM text: as written, and its base64 body without
/// whitespace (what identifies it).
struct PemBlock<'a> {
    text: &'a str,
    body: String,
}

fn pem_blocks(pem: &str) -> impl Iterator<Item = PemBlock<'_>> {
    pem.match_indices(PEM_BEGIN).filter_map(move |(start, _)| {
        // The end marker after the begin marker: the two may share dashes
        // (`-----BEGIN CERTIFICATE-----END CERTIFICATE-----`).
        let after_begin = start + PEM_BEGIN.len();
        let end = pem[after_begin..].find(PEM_END)? + after_begin + PEM_END.len();
        let text = &pem[start..end];
        let body = text[PEM_BEGIN.len()..text.len() - PEM_END.len()]
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        Some(PemBlock { text, body })
    })
}

/// Appends `addition` to the bundle whose current text is `bundle`.
fn append_to_bundle(paths: &NetworkPaths, bundle: &str, addition: &str) -> Result<(), FileError> {
    let mut addition = addition.to_string();
    if !bundle.is_empty() && !bundle.ends_with('\n') {
        addition.insert(0, '\n');
    }
    create_parent(&paths.ca_bundle)?;
    let path = &paths.ca_bundle;
    fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o644)
        .open(path)
        .and_then(|mut f| f.write_all(addition.as_bytes()))
        .map_err(write_err(path))
}

/// Node before 24 ignores the proxy variables in `fetch`: route it through undici's
/// `EnvHttpProxyAgent` (undici is in the default image) and leave newer Node, or an
/// image without undici, as they are. It must never stop Node from starting.
const NODE_PRELOAD: &str = r#"// Written by the vmctl guest agent: Node's fetch through the egress proxy.
try {
  const major = Number(process.versions.node.split(".")[0]);
  if (major < 24 && (process.env.HTTPS_PROXY || process.env.HTTP_PROXY)) {
    const undici = require("/usr/local/lib/node_modules/undici");
    // Its constructor warns that it is experimental, on every CLI's stderr: not ours
    // to show.
    const emitWarning = process.emitWarning;
    process.emitWarning = () => {};
    try {
      undici.setGlobalDispatcher(new undici.EnvHttpProxyAgent());
    } finally {
      process.emitWarning = emitWarning;
    }
    globalThis.fetch = undici.fetch;
  }
} catch (error) {
  // No undici in this image: fetch goes direct (and fails: there is no network).
}
"#;

/// Writes the Node preload script (see `NODE_PRELOAD`).
pub fn install_node_preload(paths: &NetworkPaths) -> Result<(), FileError> {
    create_parent(&paths.node_preload)?;
    write_atomic(&paths.node_preload, NODE_PRELOAD.as_bytes())
}

/// `value` quoted for `/etc/environment`, which both pam_env and shells (`.
/// /etc/environment`) read: double quotes, with the characters special inside them
/// escaped.
fn quote(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        if matches!(c, '"' | '\\' | '$' | '`') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// `existing` without its managed block (if any), followed by a new block for `env`
/// (none when `env` is empty). A block missing its end marker runs to the end.
pub fn render_environment(existing: &str, env: &[(String, String)]) -> String {
    let mut out = String::with_capacity(existing.len() + 64 * env.len());
    let mut in_block = false;
    for line in existing.lines() {
        match line.trim_end() {
            ENV_BLOCK_BEGIN => in_block = true,
            ENV_BLOCK_END if in_block => in_block = false,
            _ if in_block => {}
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    if !env.is_empty() {
        out.push_str(ENV_BLOCK_BEGIN);
        out.push('\n');
        for (k, v) in env {
            out.push_str(k);
            out.push('=');
            out.push_str(&quote(v));
            out.push('\n');
        }
        out.push_str(ENV_BLOCK_END);
        out.push('\n');
    }
    out
}

/// Rewrites the managed block of `/etc/environment` (validated `env`).
pub fn write_environment(paths: &NetworkPaths, env: &[(String, String)]) -> Result<(), FileError> {
    let existing = read_optional(&paths.environment)?;
    let new = render_environment(&existing, env);
    if new == existing {
        return Ok(());
    }
    write_atomic(&paths.environment, new.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----";

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn ca_validation() {
        assert_eq!(
            validate_ca(&format!("\n {PEM}\n\n")).unwrap(),
            format!("{PEM}\n")
        );
        let chain = format!("{PEM}\n{PEM}\n");
        assert!(validate_ca(&chain).is_ok());
        for bad in [
            "",
            "hello",
            "-----BEGIN CERTIFICATE-----\nMIIB",
            "-----BEGIN PRIVATE KEY-----\nx\n-----END PRIVATE KEY-----",
            "junk -----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----",
        ] {
            assert!(
                matches!(validate_ca(bad), Err(FileError::NotPem(_))),
                "{bad:?}"
            );
        }
        let huge = format!("{PEM_BEGIN}\n{}\n{PEM_END}", "A".repeat(MAX_CA_SIZE));
        assert!(matches!(
            validate_ca(&huge),
            Err(FileError::PemTooLarge { .. })
        ));
        // A host's whole bundle is too large for a CA but not for the roots.
        assert!(validate_roots(&huge).is_ok());
        let too_many = format!("{PEM_BEGIN}\n{}\n{PEM_END}", "A".repeat(MAX_ROOTS_SIZE));
        assert!(matches!(
            validate_roots(&too_many),
            Err(FileError::PemTooLarge { .. })
        ));
    }

    /// Markers that share their dashes hold no certificate, and break nothing: the
    /// roots come from the host, and the bundle they are added to is the guest's.
    #[test]
    fn overlapping_markers_are_no_block() {
        let overlapping = "-----BEGIN CERTIFICATE-----END CERTIFICATE-----";
        assert_eq!(pem_blocks(overlapping).count(), 0);
        let then_one = format!("{overlapping}\n{PEM}\n");
        assert!(pem_blocks(&then_one).any(|block| block.body == "MIIB"));
    }

    #[test]
    fn env_validation() {
        let ok = validate_env(&env(&[("A", "1"), ("_b9", "x y"), ("A", "2")])).unwrap();
        assert_eq!(ok, env(&[("_b9", "x y"), ("A", "2")]));
        for name in ["", "9A", "A-B", "A=B", "É", "A B"] {
            assert!(
                matches!(
                    validate_env(&env(&[(name, "v")])),
                    Err(FileError::BadEnvName(_))
                ),
                "{name:?}"
            );
        }
        for value in ["a\nb", "a\rb", "a\0b"] {
            assert!(matches!(
                validate_env(&env(&[("K", value)])),
                Err(FileError::BadEnvValue(_))
            ));
        }
    }

    #[test]
    fn environment_block_is_replaced() {
        let base = "PATH=\"/usr/bin\"\nLANG=C\n";
        let one = render_environment(base, &env(&[("A", "1"), ("Q", "say \"$x\" \\")]));
        assert_eq!(
            one,
            format!(
                "{base}{ENV_BLOCK_BEGIN}\nA=\"1\"\nQ=\"say \\\"\\$x\\\" \\\\\"\n{ENV_BLOCK_END}\n"
            )
        );
        // Lines added after the block survive; the block moves to the end.
        let edited = format!("{one}EXTRA=1\n");
        let two = render_environment(&edited, &env(&[("B", "2")]));
        assert_eq!(
            two,
            format!("{base}EXTRA=1\n{ENV_BLOCK_BEGIN}\nB=\"2\"\n{ENV_BLOCK_END}\n")
        );
        assert_eq!(render_environment(&two, &[]), format!("{base}EXTRA=1\n"));
        // A file without a final newline.
        assert_eq!(
            render_environment("X=1", &env(&[("B", "2")])),
            format!("X=1\n{ENV_BLOCK_BEGIN}\nB=\"2\"\n{ENV_BLOCK_END}\n")
        );
    }

    #[test]
    fn install_ca_appends_once() {
        let dir = tempfile::tempdir().unwrap();
        let paths = NetworkPaths::under(dir.path());
        fs::create_dir_all(paths.ca_bundle.parent().unwrap()).unwrap();
        fs::write(&paths.ca_bundle, "existing").unwrap();
        let pem = validate_ca(PEM).unwrap();
        install_ca(&paths, &pem).unwrap();
        install_ca(&paths, &pem).unwrap();
        assert_eq!(
            fs::read_to_string(&paths.ca_bundle).unwrap(),
            format!("existing\n{pem}")
        );
        for f in [&paths.ca_file, &paths.ca_store_file] {
            assert_eq!(fs::read_to_string(f).unwrap(), pem);
            let mode = fs::metadata(f).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o644, "{}", f.display());
        }
    }

    #[test]
    fn install_roots_adds_only_the_certificates_the_bundle_lacks() {
        let dir = tempfile::tempdir().unwrap();
        let paths = NetworkPaths::under(dir.path());
        fs::create_dir_all(paths.ca_bundle.parent().unwrap()).unwrap();
        let held = format!("{PEM_BEGIN}\nSEVNTEQ=\n{PEM_END}");
        let new = format!("{PEM_BEGIN}\nTkVX\n{PEM_END}");
        fs::write(&paths.ca_bundle, format!("# the image's roots\n{held}")).unwrap();
        // The held one again, with other line breaks, and one the bundle lacks.
        let held_rewrapped = format!("{PEM_BEGIN}\nSEVN\nTEQ=\n{PEM_END}");
        let roots = validate_roots(&format!("{held_rewrapped}\n{new}\n")).unwrap();
        install_roots(&paths, &roots).unwrap();
        install_roots(&paths, &roots).unwrap();
        assert_eq!(
            fs::read_to_string(&paths.ca_bundle).unwrap(),
            format!("# the image's roots\n{held}\n{new}\n")
        );
        assert_eq!(fs::read_to_string(&paths.roots_store_file).unwrap(), roots);
        let mode = fs::metadata(&paths.roots_store_file)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644);
    }

    #[test]
    fn node_preload_is_written_and_guarded() {
        let dir = tempfile::tempdir().unwrap();
        let paths = NetworkPaths::under(dir.path());
        install_node_preload(&paths).unwrap();
        let script = fs::read_to_string(&paths.node_preload).unwrap();
        assert!(script.contains("EnvHttpProxyAgent"));
        assert!(script.trim_start().starts_with("//") && script.contains("catch"));
    }
}
