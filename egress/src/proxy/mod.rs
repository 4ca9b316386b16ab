//! The HTTP proxy every outbound connection of the guest goes through.
//!
//! Each guest connection is served by [`serve_connection`] with hyper's HTTP/1.1
//! server, which parses requests (and refuses malformed or oversized ones) for us:
//!
//! - `CONNECT host:port`: checked against the policy and the resolved addresses. For
//!   a destination without a secret the bytes are tunnelled untouched; for one with a
//!   secret the proxy terminates TLS with a leaf from the sandbox's CA, forwards each
//!   request over verified TLS and sets the secret's header on the way out (and
//!   redacts the secret from what comes back, so an echoing server cannot hand it to
//!   the guest).
//! - `GET http://host/path` (absolute form): plain HTTP, checked the same way,
//!   forwarded without any secret.
//!
//! The guest is untrusted: nothing it sends may panic the proxy, exhaust its memory or
//! steer a secret to a host it is not bound to.
//!
//! Here: the configuration, the errors and the connection's service. The rest, in
//! the order a request meets it: `first_head` (the first request head, read before
//! hyper), `tunnels` (CONNECT), `session` (TLS terminated where a secret is
//! set), `plain` (plain HTTP), `upstream` (the policy's question and the vetted
//! upstream connection, shared by both), `headers`, `addresses` (where the proxy
//! never connects), `decode` (compressed responses undone) and `redact` (the secret
//! kept out of what comes back).

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::fs;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1 as client_http1;
use hyper::server::conn::http1 as server_http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{oneshot, watch, OwnedSemaphorePermit, Semaphore};

use crate::ca::{crate_provider, CaError, CertificateAuthority};
use crate::log::DecisionLog;
use crate::rules::EgressRules;

mod addresses;
mod cutoff;
mod decode;
mod first_head;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod headers;
mod kept;
mod plain;
mod redact;
mod session;
#[cfg(test)]
mod tests;
mod tunnels;
mod upstream;

pub use addresses::forbidden_address;
use first_head::{answer_and_close, read_first_head, Prefixed};
use kept::KeptUpstream;
use plain::plain_http;
use tunnels::connect;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ProxyBody = BoxBody<Bytes, BoxError>;
type Upstream = client_http1::SendRequest<ProxyBody>;

/// Bounds on what one guest can make the proxy hold.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest request head (request line and headers); larger gets 431.
    pub max_header_bytes: usize,
    /// Time a client has to send a complete request head; then it is cut off.
    pub header_timeout: Duration,
    /// Time to resolve, connect and TLS-handshake with an upstream.
    pub connect_timeout: Duration,
    /// Requests served at once, each counted from its head until its response is
    /// sent, or until the tunnel or upgraded connection it opened closes; more get
    /// 503. A kept-alive connection between requests holds none.
    pub max_connections: usize,
    /// Guest connections waiting for a request head: their first, or, kept alive,
    /// their next. One more closes the one that has waited longest: idle connections
    /// (a browser's speculative ones, a stuck program, a pool's spare) must not keep a
    /// real request out.
    pub max_waiting_connections: usize,
    /// Connections displaced from the waiting room that are given `CLOSING_GRACE`
    /// to finish the request head they may be sending. Past them, a displaced
    /// connection is closed at once (answered 503 if it had begun a head): in their
    /// grace they wait outside `max_waiting_connections`, and a guest that keeps
    /// displacing its own connections must not hold more that way. A proxy holds
    /// at most `max_connections + max_waiting_connections + max_displaced_in_grace`
    /// guest connections open, besides those it is answering 503 (for a second at
    /// the most).
    pub max_displaced_in_grace: usize,
    /// How often a tunnel or an upgraded connection asks the policy again: one the
    /// policy no longer allows is closed, as a new request would be refused.
    pub policy_recheck: Duration,
    /// New upstream connections a second, on average, after a burst of
    /// `connect_burst`; past them a request gets 503. Each connection the guest has
    /// the proxy open and close leaves a host port in TIME_WAIT for a minute: a guest
    /// opening thousands a second would leave none for the host's other programs
    /// towards that destination.
    pub connects_per_second: u32,
    pub connect_burst: u32,
    /// Name lookups a second, on average, after a burst of `lookup_burst`; past them
    /// a request gets 503. Each lookup of a new name (a guest asking for
    /// `<random>.githubusercontent.com`) goes to the host's resolver, whose upstream
    /// limits queries per client: a guest must not spend the host's share.
    pub lookups_per_second: u32,
    pub lookup_burst: u32,
    /// Lookups under way at once, each on a thread of its own (getaddrinfo blocks
    /// and outlives `connect_timeout`); more wait their turn within that timeout.
    pub max_lookups: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_header_bytes: 64 * 1024,
            header_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            max_connections: 512,
            max_waiting_connections: 512,
            // A grace is for a client caught half-way through a head, a moment's
            // race: a few at once are plenty.
            max_displaced_in_grace: 64,
            policy_recheck: Duration::from_secs(2),
            // At most some 6,000 ports in TIME_WAIT at a time, of the host's 28,000
            // towards one destination; far more than a build or an agent opens.
            connects_per_second: 100,
            connect_burst: 400,
            // Each new connection needs at most one; cached names cost the resolver
            // little, and a build resolves a handful of registries.
            lookups_per_second: 100,
            lookup_burst: 400,
            max_lookups: 16,
        }
    }
}

/// Everything one sandbox's proxy needs. Build it with [`ProxyConfig::new`], adjust
/// the public fields (or use the `with_` methods), then share it in an `Arc`.
pub struct ProxyConfig {
    pub ca: Arc<CertificateAuthority>,
    pub rules: Arc<dyn EgressRules>,
    pub upstream_tls: Arc<rustls::ClientConfig>,
    /// `"host:port"` (IPv6 hosts in brackets) to the address to use instead of a DNS
    /// lookup. For tests: such an address skips the address check, not the policy nor
    /// the lookup rate.
    pub resolve_overrides: HashMap<String, SocketAddr>,
    pub log: Arc<DecisionLog>,
    pub limits: Limits,
    /// The request slots, created on first use from `limits.max_connections`.
    slots: OnceLock<Arc<Semaphore>>,
    /// The connections waiting for a request head: their first, or their next.
    waiting: WaitingRoom,
    /// What is left of `limits.connects_per_second` and `connect_burst`.
    connects: std::sync::Mutex<Option<ConnectTokens>>,
    /// What is left of `limits.lookups_per_second` and `lookup_burst`.
    lookup_tokens: std::sync::Mutex<Option<ConnectTokens>>,
    /// The lookups under way, created on first use from `limits.max_lookups`.
    lookups: OnceLock<Arc<Semaphore>>,
    /// The host's own addresses and networks, which the proxy never connects to.
    host_networks: addresses::HostNetworksCache,
    /// Each secret's watch for probes, by name, for as long as this proxy runs.
    tripwires: std::sync::Mutex<HashMap<String, Arc<redact::Tripwire>>>,
    /// Where the watches keep their counts between runs (a file per secret), if at all.
    probe_records: Option<PathBuf>,
}

impl ProxyConfig {
    pub fn new(
        ca: Arc<CertificateAuthority>,
        rules: Arc<dyn EgressRules>,
        upstream_tls: Arc<rustls::ClientConfig>,
        log: Arc<DecisionLog>,
    ) -> Self {
        Self {
            ca,
            rules,
            upstream_tls,
            resolve_overrides: HashMap::new(),
            log,
            limits: Limits::default(),
            slots: OnceLock::new(),
            waiting: WaitingRoom::default(),
            connects: std::sync::Mutex::new(None),
            lookup_tokens: std::sync::Mutex::new(None),
            lookups: OnceLock::new(),
            host_networks: addresses::HostNetworksCache::default(),
            tripwires: std::sync::Mutex::new(HashMap::new()),
            probe_records: None,
        }
    }

    /// Keeps the secrets' probe counts (see `redact::Tripwire`) in `dir`, so that
    /// they outlast this proxy.
    pub fn with_probe_records(mut self, dir: impl Into<PathBuf>) -> Self {
        self.probe_records = Some(dir.into());
        self
    }

    /// The watch for probes of the secret `name` of value `value`; a new value (set
    /// while the proxy runs) gets a new watch.
    fn tripwire(&self, name: &str, value: &[u8]) -> Arc<redact::Tripwire> {
        let mut tripwires = self
            .tripwires
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let fresh = || {
            let record = self
                .probe_records
                .as_ref()
                .map(|dir| dir.join(format!("{name}.json")));
            Arc::new(redact::Tripwire::new(name, value, record))
        };
        let watch = tripwires.entry(name.to_owned()).or_insert_with(fresh);
        if !watch.watches(value) {
            *watch = fresh();
        }
        watch.clone()
    }

    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    pub fn with_resolve_override(mut self, host_port: impl Into<String>, addr: SocketAddr) -> Self {
        self.resolve_overrides.insert(host_port.into(), addr);
        self
    }

    /// Takes one new upstream connection of the rate the limits allow, or says why
    /// not.
    fn take_connect(&self, target: &str) -> Result<(), ProxyError> {
        let (rate, burst) = (self.limits.connects_per_second, self.limits.connect_burst);
        if take_token(&self.connects, rate, burst) {
            Ok(())
        } else {
            Err(ProxyError::TooManyConnects {
                target: target.to_string(),
                per_second: rate,
            })
        }
    }

    /// Takes one name lookup of the rate the limits allow, or says why not.
    fn take_lookup(&self, target: &str) -> Result<(), ProxyError> {
        let (rate, burst) = (self.limits.lookups_per_second, self.limits.lookup_burst);
        if take_token(&self.lookup_tokens, rate, burst) {
            Ok(())
        } else {
            Err(ProxyError::TooManyLookups {
                target: target.to_string(),
                per_second: rate,
            })
        }
    }

    fn lookups(&self) -> &Arc<Semaphore> {
        self.lookups.get_or_init(|| {
            Arc::new(Semaphore::new(
                self.limits.max_lookups.clamp(1, Semaphore::MAX_PERMITS),
            ))
        })
    }

    fn slots(&self) -> &Arc<Semaphore> {
        self.slots.get_or_init(|| {
            Arc::new(Semaphore::new(
                self.limits.max_connections.clamp(1, Semaphore::MAX_PERMITS),
            ))
        })
    }
}

impl std::fmt::Debug for ProxyConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyConfig")
            .field("resolve_overrides", &self.resolve_overrides)
            .field("log", &self.log.path())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// Takes a token of `bucket` (full at first), refilled at `rate` a second up to `burst`.
fn take_token(bucket: &std::sync::Mutex<Option<ConnectTokens>>, rate: u32, burst: u32) -> bool {
    let mut tokens = bucket
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    tokens
        .get_or_insert_with(|| ConnectTokens::full(burst))
        .take(Instant::now(), rate, burst)
}

/// A token bucket: new upstream connections (or lookups) the rate still allows.
#[derive(Debug)]
struct ConnectTokens {
    left: f64,
    at: Instant,
}

impl ConnectTokens {
    fn full(burst: u32) -> Self {
        Self {
            left: f64::from(burst),
            at: Instant::now(),
        }
    }

    /// Refills for the time since the last take, at `rate` a second up to `burst`,
    /// then takes one if there is one.
    fn take(&mut self, now: Instant, rate: u32, burst: u32) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.left = (self.left + elapsed * f64::from(rate)).min(f64::from(burst));
        self.at = now;
        if self.left >= 1.0 {
            self.left -= 1.0;
            true
        } else {
            false
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("cannot read the extra CA file {path}: {source}")]
    ReadCa { path: PathBuf, source: io::Error },
    #[error("{path} holds no PEM certificate; pass a file with the upstream's CA certificate")]
    NoCertificates { path: PathBuf },
    #[error("no trusted root certificates found on the host; install the ca-certificates package")]
    NoTrustRoots,
    #[error("cannot build the TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error(transparent)]
    Ca(#[from] CaError),
    #[error("{0}")]
    BadRequest(String),
    #[error(
        "malformed request line {line:?}: expected METHOD TARGET HTTP/1.1, \
         e.g. CONNECT host:443 HTTP/1.1 or GET http://host/path HTTP/1.1"
    )]
    MalformedRequestLine { line: String },
    #[error("the request headers are larger than {max} bytes")]
    HeadTooLarge { max: usize },
    #[error("the request headers did not arrive within {after:?}")]
    HeadTimeout { after: Duration },
    #[error(
        "too many requests at once (limit {limit}, open tunnels and upgraded connections \
         included); retry later"
    )]
    Busy { limit: usize },
    #[error(
        "too many new connections to upstreams (over {per_second} a second: each tunnel, \
         and each plain-HTTP request, is one); {target} not connected to; retry later"
    )]
    TooManyConnects { target: String, per_second: u32 },
    #[error(
        "too many name lookups (over {per_second} a second: each new connection to a \
         name is one); {target} not resolved; retry later"
    )]
    TooManyLookups { target: String, per_second: u32 },
    #[error(
        "more than {limit} connections waited to send a request (their first, or kept \
         alive, their next), and this one had waited longest, so it was closed; send \
         the request at once on a new connection"
    )]
    Displaced { limit: usize },
    #[error("{what} refused by rule: {rule}")]
    Refused { what: String, rule: String },
    #[error(
        "{what} refused: {target} resolves to {ip}, {reason}; \
         the proxy does not connect to local, private or metadata addresses, nor \
         to the host's own or the networks it is attached to"
    )]
    ForbiddenAddress {
        what: String,
        target: String,
        ip: IpAddr,
        reason: &'static str,
    },
    #[error(
        "cannot list this host's own addresses and networks, which the proxy never \
         connects to, so {target} is not connected to: {source}"
    )]
    HostAddresses { target: String, source: io::Error },
    #[error("Host header {claimed:?} disagrees with {expected}; request not sent")]
    HostMismatch { claimed: String, expected: String },
    #[error("cannot resolve {target}: {source}")]
    Resolve { target: String, source: io::Error },
    #[error("{target} resolves to no address")]
    NoAddress { target: String },
    #[error("cannot connect to {target}: {source}")]
    Connect { target: String, source: io::Error },
    #[error("{what} {target} timed out after {after:?}")]
    Timeout {
        what: &'static str,
        target: String,
        after: Duration,
    },
    #[error("TLS with {target} failed: {source}")]
    UpstreamTls { target: String, source: io::Error },
    #[error("the HTTP exchange with {target} failed: {source}")]
    Upstream {
        target: String,
        source: hyper::Error,
    },
    #[error("{target} switched protocols without being asked to")]
    UnaskedUpgrade { target: String },
    #[error(
        "{target} answered in a coding the proxy did not ask for and cannot decode (it \
         decodes gzip and deflate; the host's log names the coding): {why}"
    )]
    UndecodableResponse { target: String, why: &'static str },
}

impl ProxyError {
    /// The status the guest sees for this error.
    pub fn status(&self) -> StatusCode {
        use ProxyError::*;
        match self {
            BadRequest(_) | MalformedRequestLine { .. } => StatusCode::BAD_REQUEST,
            HeadTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            HeadTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Busy { .. } | Displaced { .. } | TooManyConnects { .. } | TooManyLookups { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Refused { .. } | ForbiddenAddress { .. } | HostMismatch { .. } => StatusCode::FORBIDDEN,
            Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            HostAddresses { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            Resolve { .. }
            | NoAddress { .. }
            | Connect { .. }
            | UpstreamTls { .. }
            | Upstream { .. }
            | UnaskedUpgrade { .. }
            | UndecodableResponse { .. } => StatusCode::BAD_GATEWAY,
            ReadCa { .. } | NoCertificates { .. } | NoTrustRoots | Tls(_) | Ca(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }
}

/// The TLS client configuration for upstream connections, trusting
/// [`upstream_roots`]. HTTP/1.1 only, which is what the proxy speaks upstream.
pub fn upstream_tls_config(extra_ca: Option<&Path>) -> Result<rustls::ClientConfig, ProxyError> {
    tls_config_trusting(upstream_roots(extra_ca)?)
}

/// [`upstream_tls_config`] of roots read already (a caller that needs them for the
/// guest too reads the host's store once: a few hundred files and certificates).
pub fn tls_config_trusting(
    certs: Vec<rustls::pki_types::CertificateDer<'static>>,
) -> Result<rustls::ClientConfig, ProxyError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(certs);
    if roots.is_empty() {
        return Err(ProxyError::NoTrustRoots);
    }
    let mut config = rustls::ClientConfig::builder_with_provider(crate_provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The certificates the proxy trusts upstream: the host's trust roots (as the host's
/// TLS clients find them: the system store, `SSL_CERT_FILE`, `SSL_CERT_DIR`, so a
/// TLS-inspecting company proxy's CA among them), plus the PEM certificates in
/// `extra_ca` when given (for tests). The guest trusts them too, for the TLS it runs
/// end to end through the proxy's tunnels.
pub fn upstream_roots(
    extra_ca: Option<&Path>,
) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, ProxyError> {
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        tracing::debug!("skipping a host trust root: {e}");
    }
    let mut roots = native.certs;
    if let Some(path) = extra_ca {
        let read_err = |source| ProxyError::ReadCa {
            path: path.to_path_buf(),
            source,
        };
        let pem = fs::read(path).map_err(read_err)?;
        let certs = rustls_pemfile::certs(&mut pem.as_slice())
            .collect::<Result<Vec<_>, _>>()
            .map_err(read_err)?;
        if certs.is_empty() {
            return Err(ProxyError::NoCertificates {
                path: path.to_path_buf(),
            });
        }
        roots.extend(certs);
    }
    Ok(roots)
}

/// `certs` as PEM text, one block each.
pub fn to_pem(certs: &[rustls::pki_types::CertificateDer<'_>]) -> String {
    use base64::Engine;
    let mut pem = String::new();
    for cert in certs {
        let body = base64::engine::general_purpose::STANDARD.encode(cert.as_ref());
        pem.push_str("-----BEGIN CERTIFICATE-----\n");
        for line in body.as_bytes().chunks(64) {
            pem.push_str(&String::from_utf8_lossy(line));
            pem.push('\n');
        }
        pem.push_str("-----END CERTIFICATE-----\n");
    }
    pem
}

/// Serves one guest connection until it closes (tunnels and upgraded connections it
/// starts run on in their own tasks, holding their request's slot).
pub async fn serve_connection<S>(mut stream: S, config: Arc<ProxyConfig>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // A slot is taken only once a request has come: connections that never send one
    // are bounded apart, so that they cannot keep real requests out.
    let (place, displaced) = config.waiting.enter(config.limits.max_waiting_connections);
    let displaced = async {
        // An error too: the place was given up.
        let _ = displaced.await;
    };
    let head = read_first_head(&mut stream, &config.limits, displaced).await;
    // Waiting is over, whatever came of it: an answer is no reason to keep the place.
    drop(place);
    let head = match head {
        Ok(Some(head)) => head,
        Ok(None) => return,
        Err(e) => return answer_and_close(stream, &e).await,
    };
    let Ok(permit) = config.slots().clone().try_acquire_owned() else {
        let busy = ProxyError::Busy {
            limit: config.limits.max_connections,
        };
        return answer_and_close(stream, &busy).await;
    };
    let stream = Prefixed {
        prefix: head.into(),
        inner: stream,
    };
    // Plain HTTP requests of this connection go on using one upstream connection.
    let kept = Arc::new(KeptUpstream::default());
    let handler = move |req, in_flight| handle(req, in_flight, kept.clone());
    let served = serve_requests(TokioIo::new(stream), config, Some(permit), handler).await;
    if let Err(e) = served {
        tracing::debug!("guest connection ended: {e}");
    }
}

/// Serves the HTTP/1.1 requests that come on `io`, each with `handler`, until the
/// connection closes or is upgraded. Each request holds a slot of its own from its
/// head until it is done ([`InFlight`]); `first` is the one already taken for the
/// first request, whose head has come. Between requests a kept-alive connection holds
/// none: it waits in the [`WaitingRoom`] with the connections that have not sent
/// their first head, and is closed if it has waited longest when that is full. An
/// idle connection must not keep a real request out, first or next.
///
/// A connection told to leave may be half-way through a head. It leaves the room at
/// once, but is given [`CLOSING_GRACE`] to finish it, if fewer than
/// [`Limits::max_displaced_in_grace`] are: a request that comes is served, and the
/// connection closed after it. Past the grace (or without one) it is closed,
/// answered first with why if it had begun a head, as one displaced before its first
/// head is.
/// hyper's own way, a graceful shutdown, does neither: it closes a kept-alive
/// connection between requests at once, whatever part of a head it has read, and
/// leaves one that has not finished its first open until its header timeout.
async fn serve_requests<I, H, F>(
    io: I,
    config: Arc<ProxyConfig>,
    first: Option<OwnedSemaphorePermit>,
    handler: H,
) -> Result<(), hyper::Error>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    H: Fn(Request<Incoming>, Arc<InFlight>) -> F + Send + Sync + 'static,
    F: std::future::Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let (busy, mut requests_in_flight) = watch::channel(0usize);
    let busy = Arc::new(busy);
    // Made now: the first head has come, so the connection is not idle before hyper
    // has even parsed it.
    let first = first.map(|permit| InFlight::new(config.clone(), permit, busy.clone()));
    let first = std::sync::Mutex::new(first);
    let handler = Arc::new(handler);
    let service_config = config.clone();
    let service = service_fn(move |req| {
        let taken = first
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        let in_flight = taken.or_else(|| {
            let permit = service_config.slots().clone().try_acquire_owned().ok()?;
            Some(InFlight::new(service_config.clone(), permit, busy.clone()))
        });
        let limit = service_config.limits.max_connections;
        let handler = handler.clone();
        async move {
            let Some(in_flight) = in_flight else {
                return Ok::<_, Infallible>(error_response(&ProxyError::Busy { limit }));
            };
            let in_flight = Arc::new(in_flight);
            let response = handler(req, in_flight.clone()).await;
            Ok(response.map(|body| holding(body, in_flight)))
        }
    });
    // Not pinned in place: a connection whose grace runs out is taken apart.
    let mut connection = server_builder(&config.limits)
        .serve_connection(io, service)
        .with_upgrades();
    let mut waiting = None;
    let mut closing = Closing::No;
    loop {
        let idle = *requests_in_flight.borrow_and_update() == 0;
        if !idle && matches!(closing, Closing::Grace { .. }) {
            // Told to leave as its request came: served, then closed.
            Pin::new(&mut connection).graceful_shutdown();
            closing = Closing::AfterRequest;
        }
        if !idle || !matches!(closing, Closing::No) {
            waiting = None;
        } else if waiting.is_none() {
            waiting = Some(config.waiting.enter(config.limits.max_waiting_connections));
        }
        let displaced = async {
            match &mut waiting {
                // An error too: the place was given up.
                Some((_, notice)) => {
                    let _ = notice.await;
                }
                None => std::future::pending().await,
            }
        };
        let grace_over = async {
            match &closing {
                Closing::Grace { until, .. } => tokio::time::sleep_until(*until).await,
                _ => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            served = &mut connection => return served,
            Ok(()) = requests_in_flight.changed() => Event::RequestsChanged,
            () = displaced => Event::Displaced,
            () = grace_over => Event::GraceOver,
        };
        let close_now = match event {
            Event::Displaced => match config.waiting.grace(config.limits.max_displaced_in_grace) {
                Some(in_grace) => {
                    closing = Closing::Grace {
                        until: tokio::time::Instant::now() + CLOSING_GRACE,
                        _in_grace: in_grace,
                    };
                    false
                }
                None => true,
            },
            // No request was in flight when the grace began, so one has come since
            // (it may even be done already).
            Event::RequestsChanged if matches!(closing, Closing::Grace { .. }) => {
                Pin::new(&mut connection).graceful_shutdown();
                closing = Closing::AfterRequest;
                false
            }
            Event::RequestsChanged => false,
            Event::GraceOver => true,
        };
        if close_now {
            // `None`: upgraded, which no request has been.
            if let Some(parts) = connection.into_parts() {
                if began_a_head(&parts.read_buf) {
                    let displaced = ProxyError::Displaced {
                        limit: config.limits.max_waiting_connections,
                    };
                    answer_and_close(TokioIo::new(parts.io), &displaced).await;
                }
            }
            return Ok(());
        }
    }
}

/// How long a connection told to leave the [`WaitingRoom`] has to finish the head it
/// may be sending: a client that has begun one sends the rest at once.
const CLOSING_GRACE: Duration = Duration::from_secs(1);

/// Where a connection is in being closed for the [`WaitingRoom`]'s sake.
enum Closing<'a> {
    No,
    /// Told to leave while no request was in flight; closed at `until` unless a
    /// request comes first. It holds one of the room's places in grace meanwhile.
    Grace {
        until: tokio::time::Instant,
        _in_grace: InGrace<'a>,
    },
    /// Told to leave; closed once its request is done.
    AfterRequest,
}

/// What [`serve_requests`] waits for, besides the connection's end.
enum Event {
    RequestsChanged,
    Displaced,
    GraceOver,
}

/// Whether `unparsed` (what hyper read and has not parsed) begins a request head:
/// the empty lines a client may send between requests (RFC 9112, 2.2) do not.
fn began_a_head(unparsed: &[u8]) -> bool {
    unparsed.iter().any(|byte| !matches!(byte, b'\r' | b'\n'))
}

/// `body`, holding `in_flight` (its request's slot) until it is sent or dropped.
fn holding(body: ProxyBody, in_flight: Arc<InFlight>) -> ProxyBody {
    body.map_frame(move |frame| {
        // Owned by the closure, so by the body: dropped with it.
        let _held = &in_flight;
        frame
    })
    .boxed()
}

/// The connections waiting for a request head (their first, or kept alive, their
/// next), oldest first, each with the sender of its notice to leave, and how many
/// told to leave are in their grace.
#[derive(Default)]
struct WaitingRoom {
    waiting: std::sync::Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    /// The number the next connection to enter gets: the oldest has the lowest.
    next: u64,
    places: BTreeMap<u64, oneshot::Sender<()>>,
    in_grace: usize,
}

/// A displaced connection's place in grace ([`WaitingRoom::grace`]), given up when
/// dropped.
struct InGrace<'a> {
    room: &'a WaitingRoom,
}

/// A connection's place in the [`WaitingRoom`], given up when dropped.
struct WaitingPlace<'a> {
    room: &'a WaitingRoom,
    number: u64,
}

impl WaitingRoom {
    /// A place for a new connection, and its notice to leave: past `bound`, the one
    /// that has waited longest is given that notice.
    fn enter(&self, bound: usize) -> (WaitingPlace<'_>, oneshot::Receiver<()>) {
        let (notice, receiver) = oneshot::channel();
        let mut waiting = self.lock();
        while waiting.places.len() >= bound.max(1) {
            if let Some((_, longest)) = waiting.places.pop_first() {
                let _ = longest.send(());
            }
        }
        let number = waiting.next;
        waiting.next += 1;
        waiting.places.insert(number, notice);
        (WaitingPlace { room: self, number }, receiver)
    }

    /// A place in grace for a connection told to leave, if fewer than `bound` hold
    /// one.
    fn grace(&self, bound: usize) -> Option<InGrace<'_>> {
        let mut waiting = self.lock();
        if waiting.in_grace >= bound {
            return None;
        }
        waiting.in_grace += 1;
        Some(InGrace { room: self })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().places.len()
    }
}

impl Drop for WaitingPlace<'_> {
    fn drop(&mut self) {
        self.room.lock().places.remove(&self.number);
    }
}

impl Drop for InGrace<'_> {
    fn drop(&mut self) {
        let mut waiting = self.room.lock();
        waiting.in_grace = waiting.in_grace.saturating_sub(1);
    }
}

/// One request's share of the proxy: a slot, held until the request is done. The
/// handler, the response's body and the tasks it spawns (a tunnel, an upgraded
/// connection, TLS terminated for a secret's host until its handshake is done) each
/// keep a clone.
struct InFlight {
    config: Arc<ProxyConfig>,
    _permit: OwnedSemaphorePermit,
    /// The count of its connection's requests in flight, which this is one of.
    busy: Arc<watch::Sender<usize>>,
}

impl InFlight {
    fn new(
        config: Arc<ProxyConfig>,
        permit: OwnedSemaphorePermit,
        busy: Arc<watch::Sender<usize>>,
    ) -> Self {
        busy.send_modify(|count| *count += 1);
        Self {
            config,
            _permit: permit,
            busy,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.busy
            .send_modify(|count| *count = count.saturating_sub(1));
    }
}

/// hyper's server with our limits: it answers 431 to oversized heads, 400 to
/// malformed ones (without a body), and closes connections that do not finish a
/// head in time.
fn server_builder(limits: &Limits) -> server_http1::Builder {
    let mut builder = server_http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_header_size(limits.max_header_bytes)
        // The read buffer only needs to hold a head plus some body; hyper's minimum
        // is 8 KiB.
        .max_buf_size(limits.max_header_bytes.max(8192) + 8192);
    builder
}

async fn handle(
    req: Request<Incoming>,
    in_flight: Arc<InFlight>,
    kept: Arc<KeptUpstream>,
) -> Response<ProxyBody> {
    let result = if req.method() == Method::CONNECT {
        connect(req, &in_flight).await
    } else {
        plain_http(req, &in_flight, &kept).await
    };
    result.unwrap_or_else(|e| error_response(&e))
}

/// A short plain-text answer saying what went wrong; the connection closes after it.
fn error_response(err: &ProxyError) -> Response<ProxyBody> {
    let status = err.status();
    if status.is_server_error() {
        guest_log::guest_warn!("egress proxy: {err}");
    } else {
        tracing::debug!("egress proxy: {err}");
    }
    let mut response = Response::new(full(format!("vmctl egress: {err}\n")));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

fn full(text: String) -> ProxyBody {
    Full::new(Bytes::from(text))
        .map_err(|never| match never {})
        .boxed()
}

fn empty() -> ProxyBody {
    full(String::new())
}

fn boxed(body: Incoming) -> ProxyBody {
    body.map_err(BoxError::from).boxed()
}

// ---- TLS terminated for a destination with a secret ------------------------------
// ---- shared by both ------------------------------------------------------------
// ---- redaction -----------------------------------------------------------------
