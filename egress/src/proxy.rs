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

use std::collections::HashMap;
use std::convert::Infallible;
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::Authority;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1 as client_http1;
use hyper::ext::ReasonPhrase;
use hyper::server::conn::http1 as server_http1;
use hyper::service::service_fn;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};
use tokio::time::timeout;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::ca::{crate_provider, CaError, CertificateAuthority};
use crate::log::{DecisionLog, LogEntry};
use crate::rules::{Decision, EgressRules, Injection};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ProxyBody = BoxBody<Bytes, BoxError>;
type Upstream = client_http1::SendRequest<ProxyBody>;

/// How long redacted upgraded streams hold back bytes that might begin a secret
/// before sending them anyway (an interactive protocol must not stall on them).
const HOLD_FLUSH: Duration = Duration::from_millis(100);
/// Secrets (or their credential part) shorter than this are not searched for in
/// responses: redacting every short string would mangle ordinary content.
const MIN_REDACTED_LEN: usize = 8;

/// Bounds on what one guest can make the proxy hold.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest request head (request line and headers); larger gets 431.
    pub max_header_bytes: usize,
    /// Time a client has to send a complete request head; then it is cut off.
    pub header_timeout: Duration,
    /// Time to resolve, connect and TLS-handshake with an upstream.
    pub connect_timeout: Duration,
    /// Guest connections served at once (tunnels included); more get 503.
    pub max_connections: usize,
    /// How often a tunnel or an upgraded connection asks the policy again: one the
    /// policy no longer allows is closed, as a new request would be refused.
    pub policy_recheck: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_header_bytes: 64 * 1024,
            header_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            max_connections: 512,
            policy_recheck: Duration::from_secs(2),
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
    /// lookup. For tests: such an address skips the address check, not the policy.
    pub resolve_overrides: HashMap<String, SocketAddr>,
    pub log: Arc<DecisionLog>,
    pub limits: Limits,
    /// The connection slots, created on first use from `limits.max_connections`.
    slots: OnceLock<Arc<Semaphore>>,
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
        }
    }

    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    pub fn with_resolve_override(mut self, host_port: impl Into<String>, addr: SocketAddr) -> Self {
        self.resolve_overrides.insert(host_port.into(), addr);
        self
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
    #[error("too many connections (limit {limit}); retry later")]
    Busy { limit: usize },
    #[error("{what} refused by rule: {rule}")]
    Refused { what: String, rule: String },
    #[error(
        "{what} refused: {target} resolves to {ip}, {reason}; \
         the proxy does not connect to local, private or metadata addresses"
    )]
    ForbiddenAddress {
        what: String,
        target: String,
        ip: IpAddr,
        reason: &'static str,
    },
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
}

impl ProxyError {
    /// The status the guest sees for this error.
    pub fn status(&self) -> StatusCode {
        use ProxyError::*;
        match self {
            BadRequest(_) | MalformedRequestLine { .. } => StatusCode::BAD_REQUEST,
            HeadTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            HeadTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Refused { .. } | ForbiddenAddress { .. } | HostMismatch { .. } => StatusCode::FORBIDDEN,
            Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            Resolve { .. }
            | NoAddress { .. }
            | Connect { .. }
            | UpstreamTls { .. }
            | Upstream { .. }
            | UnaskedUpgrade { .. } => StatusCode::BAD_GATEWAY,
            ReadCa { .. } | NoCertificates { .. } | NoTrustRoots | Tls(_) | Ca(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }
}

/// The TLS client configuration for upstream connections, trusting
/// [`upstream_roots`]. HTTP/1.1 only, which is what the proxy speaks upstream.
pub fn upstream_tls_config(extra_ca: Option<&Path>) -> Result<rustls::ClientConfig, ProxyError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(upstream_roots(extra_ca)?);
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

/// Why the proxy never connects to `ip`, if it is a loopback, private, link-local,
/// shared, metadata, multicast, broadcast, reserved or unspecified address, or one
/// of IPv6's forms of an IPv4 address that is (mapped, compatible, SIIT, NAT64 and
/// 6to4; Teredo, whose IPv4 address is hidden, altogether).
pub fn forbidden_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, ..] = ip.octets();
    if ip == Ipv4Addr::new(169, 254, 169, 254) {
        Some("the cloud metadata address")
    } else if ip.is_loopback() {
        Some("a loopback address")
    } else if a == 0 {
        // 0.0.0.0/8: "this network", which Linux connects to the local host.
        Some("an unspecified address")
    } else if ip.is_private() {
        Some("a private address")
    } else if ip.is_link_local() {
        Some("a link-local address")
    } else if a == 100 && (b & 0xc0) == 64 {
        Some("a shared (CGNAT) address")
    } else if ip.is_multicast() {
        Some("a multicast address")
    } else if a >= 240 {
        // 240.0.0.0/4, the broadcast address among them.
        Some("a reserved address")
    } else if a == 192 && b == 0 && ip.octets()[2] == 0 {
        Some("an IETF protocol address (192.0.0.0/24)")
    } else {
        // Not 198.18.0.0/15 (benchmarking): "fake-IP" DNS proxies on the host
        // (Clash, Surge, sing-box) answer every name with one of those.
        None
    }
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let seg = ip.segments();
    if ip == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254) {
        Some("the cloud metadata address")
    } else if ip.is_unspecified() {
        Some("an unspecified address")
    } else if ip.is_loopback() {
        Some("a loopback address")
    } else if let Some(v4) = ip.to_ipv4_mapped() {
        forbidden_v4(v4)
    } else if seg[..6] == [0; 6]
        || seg[..6] == [0, 0, 0, 0, 0xffff, 0]
        || seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
        || seg[..3] == [0x64, 0xff9b, 1]
    {
        // IPv4-compatible (::a.b.c.d), SIIT (::ffff:0:a.b.c.d), NAT64
        // (64:ff9b::a.b.c.d) and local NAT64 (64:ff9b:1::/48) end in an IPv4 address
        // that may be a private one.
        forbidden_v4(Ipv4Addr::from(((seg[6] as u32) << 16) | seg[7] as u32))
    } else if seg[0] == 0x2002 {
        // 6to4: 2002:a.b.c.d::/48.
        forbidden_v4(Ipv4Addr::from(((seg[1] as u32) << 16) | seg[2] as u32))
    } else if seg[..2] == [0x2001, 0] {
        Some("a Teredo address (its IPv4 address cannot be checked)")
    } else if seg[..4] == [0x100, 0, 0, 0] {
        Some("a discard-only address")
    } else if (seg[0] & 0xfe00) == 0xfc00 {
        Some("a unique-local (private) address")
    } else if (seg[0] & 0xffc0) == 0xfe80 {
        Some("a link-local address")
    } else if (seg[0] & 0xffc0) == 0xfec0 {
        Some("a site-local (private) address")
    } else if ip.is_multicast() {
        Some("a multicast address")
    } else {
        None
    }
}

/// Serves one guest connection until it closes (tunnels and upgraded connections it
/// starts run on in their own tasks, holding the connection's slot).
pub async fn serve_connection<S>(mut stream: S, config: Arc<ProxyConfig>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let Ok(permit) = config.slots().clone().try_acquire_owned() else {
        let busy = ProxyError::Busy {
            limit: config.limits.max_connections,
        };
        return answer_and_close(stream, &busy).await;
    };
    let head = match read_first_head(&mut stream, &config.limits).await {
        Ok(Some(head)) => head,
        Ok(None) => return,
        Err(e) => return answer_and_close(stream, &e).await,
    };
    let conn = Arc::new(Conn {
        config,
        _permit: permit,
    });
    let limits = conn.config.limits.clone();
    let service = service_fn(move |req| {
        let conn = conn.clone();
        async move { Ok::<_, Infallible>(handle(req, conn).await) }
    });
    let stream = Prefixed {
        prefix: head.into(),
        inner: stream,
    };
    let served = server_builder(&limits)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades()
        .await;
    if let Err(e) = served {
        tracing::debug!("guest connection ended: {e}");
    }
}

/// One guest connection's share of the proxy; tasks it spawns keep a clone, so the
/// connection slot is held until all of them are done.
struct Conn {
    config: Arc<ProxyConfig>,
    _permit: OwnedSemaphorePermit,
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

/// Reads the connection's first request head before hyper does, so that the
/// commonest failures (a client that is no HTTP proxy client, oversized or slow
/// headers) get an answer saying what was wrong: hyper's own are empty, or none
/// for a timeout. hyper then parses the head again from the returned bytes (which
/// may include more than the head). `None`: closed, or silent until the timeout.
async fn read_first_head<S>(stream: &mut S, limits: &Limits) -> Result<Option<Vec<u8>>, ProxyError>
where
    S: AsyncRead + Unpin,
{
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    let read_head = async {
        loop {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return io::Result::Ok(false);
            }
            let searched = buf.len().saturating_sub(3);
            buf.extend_from_slice(&chunk[..n]);
            if head_end(&buf, searched).is_some() || buf.len() > limits.max_header_bytes {
                return Ok(true);
            }
        }
    };
    match timeout(limits.header_timeout, read_head).await {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) | Ok(Err(_)) => return Ok(None),
        Err(_) if buf.is_empty() => return Ok(None),
        Err(_) => {
            return Err(ProxyError::HeadTimeout {
                after: limits.header_timeout,
            })
        }
    }
    match head_end(&buf, 0) {
        Some(end) if end <= limits.max_header_bytes => {
            check_request_line(&buf[..end])?;
            Ok(Some(buf))
        }
        _ => Err(ProxyError::HeadTooLarge {
            max: limits.max_header_bytes,
        }),
    }
}

/// Where the head in `buf` ends (after its empty line), looking from `from` on.
fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    (from..buf.len()).find_map(|i| {
        let rest = &buf[i..];
        if rest.starts_with(b"\n\r\n") {
            Some(i + 3)
        } else if rest.starts_with(b"\n\n") {
            Some(i + 2)
        } else {
            None
        }
    })
}

/// Refuses a request line that is not `METHOD TARGET HTTP/1.x`.
fn check_request_line(head: &[u8]) -> Result<(), ProxyError> {
    // Empty lines before a request are allowed (RFC 9112, 2.2).
    let start = head
        .iter()
        .position(|b| !matches!(b, b'\r' | b'\n'))
        .unwrap_or(head.len());
    let line = head[start..]
        .split(|b| *b == b'\n')
        .next()
        .unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let parts: Vec<&[u8]> = line.split(|b| *b == b' ').collect();
    let valid = match parts[..] {
        [method, target, version] => {
            !method.is_empty()
                && method
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b))
                && !target.is_empty()
                && target.iter().all(|b| b.is_ascii_graphic() || *b >= 0x80)
                && (version == b"HTTP/1.1" || version == b"HTTP/1.0")
        }
        _ => false,
    };
    if valid {
        return Ok(());
    }
    let mut shown = String::from_utf8_lossy(line).into_owned();
    if shown.len() > 100 {
        let cut = (0..=100)
            .rev()
            .find(|i| shown.is_char_boundary(*i))
            .unwrap_or(0);
        shown.truncate(cut);
        shown.push_str("...");
    }
    Err(ProxyError::MalformedRequestLine { line: shown })
}

/// Answers `err` on a connection hyper does not serve, then closes it.
async fn answer_and_close<S>(mut stream: S, err: &ProxyError)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    tracing::debug!("egress proxy: {err}");
    let status = err.status();
    let body = format!("vmctl egress: {err}\n");
    let response = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    );
    let answer = async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await?;
        // Read (a bounded amount of) what the client sent: closing with unread data
        // would reset the connection, and the client might lose the answer.
        let mut sink = [0u8; 4096];
        let mut total = 0;
        while total < 64 * 1024 {
            let n = stream.read(&mut sink).await?;
            if n == 0 {
                break;
            }
            total += n;
        }
        io::Result::Ok(())
    };
    let _ = timeout(Duration::from_secs(1), answer).await;
}

/// A stream that first yields `prefix` (bytes already read from `inner`).
struct Prefixed<S> {
    prefix: Bytes,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.prefix.is_empty() {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        let n = self.prefix.len().min(buf.remaining());
        let taken = self.prefix.split_to(n);
        buf.put_slice(&taken);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

async fn handle(req: Request<Incoming>, conn: Arc<Conn>) -> Response<ProxyBody> {
    let result = if req.method() == Method::CONNECT {
        connect(req, &conn).await
    } else {
        plain_http(req, &conn).await
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

// ---- CONNECT -------------------------------------------------------------------

async fn connect(
    mut req: Request<Incoming>,
    conn: &Arc<Conn>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let config = &conn.config;
    let (host, port) = connect_target(req.uri())?;
    let target = display_target(&host, port);
    let ask = Ask {
        host: host.clone(),
        port,
        kind: "connect",
        method: "CONNECT".into(),
        what: format!("CONNECT {target}"),
    };
    let decision = ask.decide(config)?;
    let addrs = vetted_addresses(config, &ask, &decision).await?;
    let injection = config.rules.injection(&host, port);
    config
        .log
        .record(&ask.entry(true, &decision.rule, injection.as_ref()));
    let on_upgrade = hyper::upgrade::on(&mut req);
    if injection.is_none() {
        // Connect before answering, so a dead upstream is a 502, not a dead tunnel.
        let upstream = connect_tcp(&addrs, &target, config.limits.connect_timeout).await?;
        tokio::spawn(tunnel(on_upgrade, upstream, conn.clone(), ask));
    } else {
        let tls = config.ca.server_config_for(&host)?;
        let session = Arc::new(Session {
            conn: conn.clone(),
            host,
            port,
            target,
            addrs,
            upstream: Mutex::new(None),
        });
        tokio::spawn(session.serve(on_upgrade, tls));
    }
    let mut response = Response::new(empty());
    response
        .extensions_mut()
        .insert(ReasonPhrase::from_static(b"Connection established"));
    Ok(response)
}

/// Relays raw bytes between the guest and `upstream`: TLS the proxy does not touch.
async fn tunnel(on_upgrade: OnUpgrade, upstream: TcpStream, conn: Arc<Conn>, ask: Ask) {
    match on_upgrade.await {
        Ok(upgraded) => {
            let guest = TokioIo::new(upgraded);
            let relay = byte_relay::both_ways(guest, upstream);
            relay_while_allowed(relay, &ask, &conn.config, "tunnel").await;
        }
        Err(e) => tracing::debug!("CONNECT was not upgraded: {e}"),
    }
}

/// Runs `relay` (a tunnel, an upgraded connection: `what`) until it ends, or until
/// the policy no longer allows what `ask` asked for.
async fn relay_while_allowed(
    relay: impl std::future::Future<Output = byte_relay::Relayed>,
    ask: &Ask,
    config: &ProxyConfig,
    what: &str,
) {
    tokio::select! {
        relayed = relay => {
            if let Some(e) = relayed.error() {
                tracing::debug!("{what} ended: {e}");
            }
        }
        () = ask.until_refused(config) => {}
    }
}

/// `host:port` of a CONNECT request, normalised.
fn connect_target(uri: &Uri) -> Result<(String, u16), ProxyError> {
    let authority = uri
        .authority()
        .ok_or_else(|| ProxyError::BadRequest("CONNECT needs a host:port target".into()))?;
    let port = authority
        .port_u16()
        .filter(|port| *port != 0)
        .ok_or_else(|| {
            ProxyError::BadRequest(format!("CONNECT {authority}: the target needs a port"))
        })?;
    Ok((normalize_host(authority.host())?, port))
}

// ---- TLS terminated for a destination with a secret ------------------------------

/// The guest's side of a CONNECT whose TLS the proxy terminates, and the upstream
/// connection its requests go out on.
struct Session {
    conn: Arc<Conn>,
    host: String,
    port: u16,
    target: String,
    /// Vetted at CONNECT time; reconnections use them rather than resolve again
    /// (a second lookup could answer a private address).
    addrs: Vec<SocketAddr>,
    upstream: Mutex<Option<Upstream>>,
}

impl Session {
    async fn serve(self: Arc<Self>, on_upgrade: OnUpgrade, tls: Arc<rustls::ServerConfig>) {
        let limits = self.conn.config.limits.clone();
        let upgraded = match on_upgrade.await {
            Ok(upgraded) => upgraded,
            Err(e) => return tracing::debug!("CONNECT was not upgraded: {e}"),
        };
        let accept = TlsAcceptor::from(tls).accept(TokioIo::new(upgraded));
        let stream = match timeout(limits.header_timeout, accept).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                return tracing::debug!(
                    "TLS handshake with the guest for {} failed: {e}",
                    self.target
                )
            }
            Err(_) => {
                return tracing::debug!(
                    "TLS handshake with the guest for {} timed out",
                    self.target
                )
            }
        };
        let session = self.clone();
        let service = service_fn(move |req| {
            let session = session.clone();
            async move {
                let response = session.forward(req).await;
                Ok::<_, Infallible>(response.unwrap_or_else(|e| error_response(&e)))
            }
        });
        let served = server_builder(&limits)
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades()
            .await;
        if let Err(e) = served {
            tracing::debug!("terminated TLS connection for {} ended: {e}", self.target);
        }
    }

    /// Forwards one request from inside the terminated TLS, with the secret set.
    async fn forward(&self, mut req: Request<Incoming>) -> Result<Response<ProxyBody>, ProxyError> {
        let config = &self.conn.config;
        if req.method() == Method::CONNECT {
            return Err(ProxyError::BadRequest(
                "CONNECT inside a CONNECT tunnel is not supported".into(),
            ));
        }
        let ask = Ask {
            host: self.host.clone(),
            port: self.port,
            kind: "tls-request",
            method: req.method().to_string(),
            what: format!(
                "{} https://{}{}",
                req.method(),
                self.target,
                path_of(req.uri())
            ),
        };
        let claims = claimed_authorities(Some(req.uri()), req.headers())?;
        if claims.is_empty() {
            return Err(ProxyError::BadRequest(
                "the request has no Host header".into(),
            ));
        }
        let expected = format!("CONNECT target {}", self.target);
        if let Err(e) = check_claims(claims, &self.host, self.port, 443, &expected) {
            return Err(ask.refuse(config, &e.to_string(), e));
        }
        // The policy may have changed since the CONNECT; the secret may have too.
        let decision = ask.decide(config)?;
        let injection = config.rules.injection(&self.host, self.port);
        config
            .log
            .record(&ask.entry(true, &decision.rule, injection.as_ref()));

        let guest_upgrade = wants_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        prepare_request(&mut parts, host_header(&self.host, self.port, 443));
        let redactor = injection.as_ref().and_then(|injection| {
            inject(&mut parts.headers, injection);
            Redactor::for_secret(
                injection.value.as_bytes(),
                injection.secret_value.expose().as_bytes(),
            )
        });
        let response = self.send(Request::from_parts(parts, boxed(body))).await?;
        relay_response(response, guest_upgrade, redactor, ask, &self.conn)
    }

    /// Sends on the session's upstream connection, (re)connecting as needed. A
    /// request a stale pooled connection did not take is retried once on a new one.
    async fn send(&self, req: Request<ProxyBody>) -> Result<Response<Incoming>, ProxyError> {
        let mut slot = self.upstream.lock().await;
        let pooled = slot.take().filter(|sender| !sender.is_closed());
        let was_pooled = pooled.is_some();
        let mut sender = match pooled {
            Some(sender) => sender,
            None => self.connect_upstream().await?,
        };
        let upstream_err = |source| ProxyError::Upstream {
            target: self.target.clone(),
            source,
        };
        match send_on(&mut sender, req).await {
            Ok(response) => {
                *slot = Some(sender);
                Ok(response)
            }
            Err((Some(req), _)) if was_pooled => {
                let mut fresh = self.connect_upstream().await?;
                let response = send_on(&mut fresh, req)
                    .await
                    .map_err(|(_, e)| upstream_err(e))?;
                *slot = Some(fresh);
                Ok(response)
            }
            Err((_, e)) => Err(upstream_err(e)),
        }
    }

    /// A verified TLS connection to the destination, SNI = the CONNECT host.
    async fn connect_upstream(&self) -> Result<Upstream, ProxyError> {
        let config = &self.conn.config;
        let limit = config.limits.connect_timeout;
        let tcp = connect_tcp(&self.addrs, &self.target, limit).await?;
        let name = ServerName::try_from(self.host.clone()).map_err(|e| {
            ProxyError::BadRequest(format!("{} is not a TLS server name: {e}", self.host))
        })?;
        let handshake = TlsConnector::from(config.upstream_tls.clone()).connect(name, tcp);
        let tls = timeout(limit, handshake)
            .await
            .map_err(|_| ProxyError::Timeout {
                what: "the TLS handshake with",
                target: self.target.clone(),
                after: limit,
            })?
            .map_err(|source| ProxyError::UpstreamTls {
                target: self.target.clone(),
                source,
            })?;
        http1_client(TokioIo::new(tls), &self.target).await
    }
}

async fn send_on(
    sender: &mut Upstream,
    req: Request<ProxyBody>,
) -> Result<Response<Incoming>, (Option<Request<ProxyBody>>, hyper::Error)> {
    if let Err(e) = sender.ready().await {
        return Err((Some(req), e));
    }
    sender
        .try_send_request(req)
        .await
        .map_err(|mut e| (e.take_message(), e.into_error()))
}

/// Sets the secret's header (replacing what the guest sent) and removes the headers
/// the binding says to. Nothing else, and never anything in the body.
fn inject(headers: &mut HeaderMap, injection: &Injection) {
    for name in &injection.remove {
        headers.remove(name);
    }
    let mut value = injection.value.clone();
    value.set_sensitive(true);
    headers.insert(injection.header.clone(), value);
    // The response is searched for the secret; a compressed one would hide it, and
    // so would a range that starts inside it (an echo of the request, from byte 1).
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    headers.remove(header::RANGE);
    headers.remove(header::IF_RANGE);
}

// ---- plain HTTP ------------------------------------------------------------------

async fn plain_http(
    mut req: Request<Incoming>,
    conn: &Arc<Conn>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let config = &conn.config;
    let (host, port) = absolute_target(req.uri())?;
    let target = display_target(&host, port);
    let expected = format!("the request URI's {target}");
    // The URI names the target; Host headers (optional in HTTP/1.0) must agree.
    let claims = claimed_authorities(None, req.headers())?;
    check_claims(claims, &host, port, 80, &expected)?;
    let ask = Ask {
        host: host.clone(),
        port,
        kind: "http",
        method: req.method().to_string(),
        what: format!("{} http://{target}", req.method()),
    };
    let decision = ask.decide(config)?;
    let addrs = vetted_addresses(config, &ask, &decision).await?;
    let mut entry = ask.entry(true, &decision.rule, None);
    if let Some(injection) = config.rules.injection(&host, port) {
        // A secret in clear text could be read on the way; it goes only over TLS.
        entry.rule = format!(
            "{}; secret {} not sent over plain HTTP",
            decision.rule, injection.secret
        );
    }
    config.log.record(&entry);

    let guest_upgrade = wants_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    prepare_request(&mut parts, host_header(&host, port, 80));
    let tcp = connect_tcp(&addrs, &target, config.limits.connect_timeout).await?;
    let mut sender = http1_client(TokioIo::new(tcp), &target).await?;
    let response = sender
        .send_request(Request::from_parts(parts, boxed(body)))
        .await
        .map_err(|source| ProxyError::Upstream {
            target: target.clone(),
            source,
        })?;
    relay_response(response, guest_upgrade, None, ask, conn)
}

/// `host:port` of an absolute-form `http://` request, normalised.
fn absolute_target(uri: &Uri) -> Result<(String, u16), ProxyError> {
    let Some(authority) = uri.authority() else {
        return Err(ProxyError::BadRequest(
            "this is an HTTP proxy: send requests in absolute form (GET http://host/path) \
             or open a tunnel with CONNECT host:port"
                .into(),
        ));
    };
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(ProxyError::BadRequest(
                "https:// URLs go through a tunnel: CONNECT host:443".into(),
            ))
        }
        other => {
            return Err(ProxyError::BadRequest(format!(
                "unsupported scheme {other:?}: this proxy forwards http:// requests and CONNECT"
            )))
        }
    }
    Ok((
        normalize_host(authority.host())?,
        authority.port_u16().unwrap_or(80),
    ))
}

// ---- shared by both ------------------------------------------------------------

/// One thing the guest asked for, as the policy checks and the log need it. A
/// tunnel or an upgraded connection keeps its own, to ask again while it lasts.
struct Ask {
    host: String,
    port: u16,
    /// `connect`, `http` or `tls-request`.
    kind: &'static str,
    method: String,
    /// How messages name it, e.g. `CONNECT api.example.com:443`.
    what: String,
}

impl Ask {
    /// Asks the policy; a refusal is logged and becomes a 403 naming the rule.
    fn decide(&self, config: &ProxyConfig) -> Result<Decision, ProxyError> {
        let decision = config.rules.decide(&self.host, self.port);
        if decision.allowed {
            return Ok(decision);
        }
        let refused = ProxyError::Refused {
            what: self.what.clone(),
            rule: decision.rule.clone(),
        };
        Err(self.refuse(config, &decision.rule, refused))
    }

    /// Logs a refusal for `rule` (the reason) and passes `err` on.
    fn refuse(&self, config: &ProxyConfig, rule: &str, err: ProxyError) -> ProxyError {
        config.log.record(&self.entry(false, rule, None));
        err
    }

    /// A log entry; with the secret's name (never its value) if one is injected.
    fn entry(&self, allowed: bool, rule: &str, injection: Option<&Injection>) -> LogEntry {
        let mut entry = LogEntry::new(&self.host, self.port, allowed, rule, self.kind);
        entry.method = Some(self.method.clone());
        entry.secret = injection.map(|i| i.secret.clone());
        entry
    }

    fn target(&self) -> String {
        display_target(&self.host, self.port)
    }

    /// Returns once the policy refuses what was asked for (the refusal logged), asked
    /// every [`Limits::policy_recheck`]; never while it allows it.
    async fn until_refused(&self, config: &ProxyConfig) {
        // A zero period would make `interval` panic.
        let period = config.limits.policy_recheck.max(Duration::from_millis(10));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is at once; it was allowed a moment ago.
        tick.tick().await;
        loop {
            tick.tick().await;
            if let Err(e) = self.decide(config) {
                tracing::info!("{e}; closing the open connection");
                return;
            }
        }
    }
}

/// The addresses `host:port` resolves to, refused (and logged) if any of them is
/// local, private or otherwise forbidden: a name the guest controls must not reach
/// the host's or the cloud's internal services.
async fn vetted_addresses(
    config: &ProxyConfig,
    ask: &Ask,
    decision: &Decision,
) -> Result<Vec<SocketAddr>, ProxyError> {
    let (host, port) = (ask.host.as_str(), ask.port);
    let target = display_target(host, port);
    if let Some(addr) = config.resolve_overrides.get(&target) {
        return Ok(vec![*addr]);
    }
    let limit = config.limits.connect_timeout;
    let addrs: Vec<SocketAddr> = match timeout(limit, tokio::net::lookup_host((host, port))).await {
        Err(_) => {
            return Err(ProxyError::Timeout {
                what: "resolving",
                target,
                after: limit,
            })
        }
        Ok(Err(source)) => return Err(ProxyError::Resolve { target, source }),
        Ok(Ok(addrs)) => addrs.collect(),
    };
    if addrs.is_empty() {
        return Err(ProxyError::NoAddress { target });
    }
    let forbidden = addrs
        .iter()
        .find_map(|addr| forbidden_address(addr.ip()).map(|reason| (addr.ip(), reason)));
    if let Some((ip, reason)) = forbidden {
        let rule = format!("{}, but {ip} is {reason}", decision.rule);
        let err = ProxyError::ForbiddenAddress {
            what: ask.what.clone(),
            target,
            ip,
            reason,
        };
        return Err(ask.refuse(config, &rule, err));
    }
    Ok(addrs)
}

/// The first of `addrs` that accepts a connection.
async fn connect_tcp(
    addrs: &[SocketAddr],
    target: &str,
    limit: Duration,
) -> Result<TcpStream, ProxyError> {
    let mut last = ProxyError::NoAddress {
        target: target.to_string(),
    };
    for addr in addrs {
        match timeout(limit, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => {
                // Small writes (SSE events, keystrokes) must not wait for more.
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Ok(Err(source)) => {
                last = ProxyError::Connect {
                    target: target.to_string(),
                    source,
                }
            }
            Err(_) => {
                last = ProxyError::Timeout {
                    what: "connecting to",
                    target: target.to_string(),
                    after: limit,
                }
            }
        }
    }
    Err(last)
}

/// An HTTP/1.1 client on `io`, its connection driven by a task of its own.
async fn http1_client<I>(io: I, target: &str) -> Result<Upstream, ProxyError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, connection) =
        client_http1::handshake(io)
            .await
            .map_err(|source| ProxyError::Upstream {
                target: target.to_string(),
                source,
            })?;
    let target = target.to_string();
    tokio::spawn(async move {
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!("upstream connection to {target} ended: {e}");
        }
    });
    Ok(sender)
}

/// Makes a guest request fit to send upstream: no hop-by-hop or proxy headers,
/// origin-form URI, a Host header.
fn prepare_request(parts: &mut http::request::Parts, host: HeaderValue) {
    let upgrade = wants_upgrade(&parts.headers);
    strip_hop_by_hop(&mut parts.headers, upgrade);
    let origin = parts
        .uri
        .path_and_query()
        .map_or("/", |path| path.as_str())
        .parse()
        .unwrap_or_else(|_| Uri::from_static("/"));
    parts.uri = origin;
    parts.version = Version::HTTP_11;
    // Ours, whatever the guest wrote (`API.TEST.:443` named the same host to the
    // policy, but an upstream may route it to another).
    parts.headers.insert(header::HOST, host);
}

/// Turns the upstream's response into the guest's: hop-by-hop headers removed, the
/// secret redacted, and for a 101 the two upgraded connections spliced together.
fn relay_response(
    mut response: Response<Incoming>,
    guest_upgrade: Option<OnUpgrade>,
    redactor: Option<Redactor>,
    ask: Ask,
    conn: &Arc<Conn>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let switching = response.status() == StatusCode::SWITCHING_PROTOCOLS;
    if switching {
        let Some(guest) = guest_upgrade else {
            return Err(ProxyError::UnaskedUpgrade {
                target: ask.target(),
            });
        };
        let upstream = hyper::upgrade::on(&mut response);
        tokio::spawn(splice(guest, upstream, redactor.clone(), conn.clone(), ask));
    }
    strip_hop_by_hop(response.headers_mut(), switching);
    Ok(match redactor {
        Some(redactor) => {
            redactor.redact_headers(response.headers_mut());
            // An upstream's own reason phrase could quote the secret: the guest gets
            // the standard one for the status.
            response.extensions_mut().remove::<ReasonPhrase>();
            response.map(|body| RedactedBody::new(body, redactor).boxed())
        }
        None => response.map(boxed),
    })
}

/// Copies between the upgraded guest and upstream connections (a WebSocket, say),
/// redacting the secret from what flows to the guest when there is one.
async fn splice(
    guest: OnUpgrade,
    upstream: OnUpgrade,
    redactor: Option<Redactor>,
    conn: Arc<Conn>,
    ask: Ask,
) {
    let (guest, upstream) = match tokio::try_join!(guest, upstream) {
        Ok(both) => both,
        Err(e) => return tracing::debug!("upgrade failed: {e}"),
    };
    let guest = TokioIo::new(guest);
    let upstream = TokioIo::new(upstream);
    let relay = async {
        match redactor {
            None => byte_relay::both_ways(guest, upstream).await,
            Some(redactor) => {
                let (guest_rx, guest_tx) = tokio::io::split(guest);
                let (upstream_rx, upstream_tx) = tokio::io::split(upstream);
                let (a_to_b, b_to_a) = tokio::join!(
                    byte_relay::one_way(guest_rx, upstream_tx),
                    copy_redacted(upstream_rx, guest_tx, redactor)
                );
                byte_relay::Relayed { a_to_b, b_to_a }
            }
        }
    };
    relay_while_allowed(relay, &ask, &conn.config, "upgraded connection").await;
}

/// Copies `from` to `to` through `redactor`, then closes `to`'s sending side (after
/// a failure too: the other way goes on, and `to`'s reader must not wait forever).
/// Bytes held back because they might begin the secret are sent anyway after
/// [`HOLD_FLUSH`] without more data (see [`Redactor::flush_held`]: a pause inside the
/// secret does not let it through); after a failure they are dropped.
async fn copy_redacted<R, W>(from: R, mut to: W, redactor: Redactor) -> io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let copied = redact_until_end(from, &mut to, redactor).await;
    let _ = to.shutdown().await;
    copied
}

/// [`copy_redacted`]'s copy: the bytes it sent, once `from` ended.
async fn redact_until_end<R, W>(mut from: R, to: &mut W, mut redactor: Redactor) -> io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut sent = 0u64;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let read = if redactor.holding() {
            match timeout(HOLD_FLUSH, from.read(&mut buf)).await {
                Ok(read) => read?,
                Err(_) => {
                    sent += send(to, redactor.flush_held()).await?;
                    continue;
                }
            }
        } else {
            from.read(&mut buf).await?
        };
        if read == 0 {
            return Ok(sent + send(to, redactor.finish()).await?);
        }
        sent += send(to, redactor.feed(&buf[..read])).await?;
    }
}

/// Writes and flushes `bytes`: the number sent.
async fn send<W: AsyncWrite + Unpin>(to: &mut W, bytes: Bytes) -> io::Result<u64> {
    to.write_all(&bytes).await?;
    to.flush().await?;
    Ok(bytes.len() as u64)
}

const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    HeaderName::from_static("keep-alive"),
];

/// Removes the headers that concern only one hop: the standard ones, those the
/// Connection header lists, and every `proxy-*` header. An upgrade keeps its
/// `Upgrade` and `Connection: upgrade`, which the next hop needs.
fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    let upgrade = headers.get(header::UPGRADE).cloned();
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    let proxy: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for name in listed.iter().chain(&HOP_BY_HOP).chain(&proxy) {
        headers.remove(name);
    }
    if let (true, Some(upgrade)) = (keep_upgrade, upgrade) {
        headers.insert(header::UPGRADE, upgrade);
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
}

/// Does the request ask to switch protocols (`Connection: upgrade` and `Upgrade`)?
fn wants_upgrade(headers: &HeaderMap) -> bool {
    let connection_upgrade = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"));
    connection_upgrade && headers.contains_key(header::UPGRADE)
}

/// The authorities a request names: its URI's (absolute form, when `uri` is given)
/// and its Host headers.
fn claimed_authorities(uri: Option<&Uri>, headers: &HeaderMap) -> Result<Vec<String>, ProxyError> {
    let mut claims: Vec<String> = uri
        .and_then(Uri::authority)
        .map(|authority| authority.as_str().to_string())
        .into_iter()
        .collect();
    for value in headers.get_all(header::HOST) {
        let value = value
            .to_str()
            .map_err(|_| ProxyError::BadRequest("the Host header is not text".into()))?;
        claims.push(value.to_string());
    }
    Ok(claims)
}

/// Checks that every claimed authority is `host`, with `port` or `default_port` if
/// it names a port. Otherwise the request would reach `host` while meant for
/// another (virtual) host, which could carry the secret where it is not bound.
fn check_claims(
    claims: Vec<String>,
    host: &str,
    port: u16,
    default_port: u16,
    expected: &str,
) -> Result<(), ProxyError> {
    match claims
        .into_iter()
        .find(|claim| !authority_names(claim, host, port, default_port))
    {
        Some(claimed) => Err(ProxyError::HostMismatch {
            claimed,
            expected: expected.to_string(),
        }),
        None => Ok(()),
    }
}

fn authority_names(claim: &str, host: &str, port: u16, default_port: u16) -> bool {
    let Ok(authority) = claim.parse::<Authority>() else {
        return false;
    };
    let same_host = !claim.contains('@')
        && normalize_host(authority.host()).is_ok_and(|claimed| claimed == host);
    let same_port = authority
        .port_u16()
        .is_none_or(|claimed| claimed == port || claimed == default_port);
    same_host && same_port
}

/// Lower case, no trailing dot, no IPv6 brackets; refuses what is no host name.
fn normalize_host(raw: &str) -> Result<String, ProxyError> {
    let host = raw
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(raw);
    let host = host.strip_suffix('.').unwrap_or(host);
    let valid_chars = host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b':'));
    let valid = !host.is_empty()
        && host.len() <= 253
        && valid_chars
        // `a..example.com` would match `*.example.com`, yet no rule could name it.
        && !host.split('.').any(str::is_empty)
        && (!host.contains(':') || host.parse::<Ipv6Addr>().is_ok());
    if !valid {
        return Err(ProxyError::BadRequest(format!(
            "{raw:?} is not a host name"
        )));
    }
    Ok(host.to_ascii_lowercase())
}

/// `host:port`, IPv6 literals in brackets.
fn display_target(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The Host header for a request that came without one.
fn host_header(host: &str, port: u16, default_port: u16) -> HeaderValue {
    let text = if port == default_port {
        if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_string()
        }
    } else {
        display_target(host, port)
    };
    // The host was validated by normalize_host, so this cannot fail in practice.
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

fn path_of(uri: &Uri) -> &str {
    uri.path_and_query().map_or("/", |path| path.as_str())
}

// ---- redaction -----------------------------------------------------------------

/// Replaces the secret in what the upstream sends back, so a server that echoes
/// the request (or quotes the credential in an error) cannot hand it to the guest.
/// Replacements keep the length, so Content-Length and framing stay right.
#[derive(Clone)]
struct Redactor {
    /// The whole header value and its credential part, longest first.
    /// Copies of the secret: wiped when the last redactor of a request goes.
    needles: Arc<[zeroize::Zeroizing<Vec<u8>>]>,
    /// The end of the data seen so far when it might begin a needle.
    held: Vec<u8>,
    /// Bytes already sent (by [`Redactor::flush_held`]) that might begin a needle:
    /// matched against with what comes next, so the rest of the needle is redacted.
    carried: Vec<u8>,
}

impl Redactor {
    /// Redacts the header `value` that carries `secret`, its last word, and `secret`
    /// itself (which a header template may wrap in other text).
    fn for_secret(value: &[u8], secret: &[u8]) -> Option<Self> {
        let secret_copy = |bytes: &[u8]| zeroize::Zeroizing::new(bytes.to_vec());
        let mut needles = vec![secret_copy(value), secret_copy(secret)];
        // "Bearer <token>": the token alone is as secret as the whole value.
        if let Some(space) = value.iter().rposition(|b| *b == b' ') {
            needles.push(secret_copy(&value[space + 1..]));
        }
        needles.retain(|needle| needle.len() >= MIN_REDACTED_LEN);
        needles.sort_by_key(|needle| std::cmp::Reverse(needle.len()));
        needles.dedup();
        (!needles.is_empty()).then(|| Self {
            needles: needles.into(),
            held: Vec::new(),
            carried: Vec::new(),
        })
    }

    /// The part of the stream up to `chunk` that is safe to pass on now.
    fn feed(&mut self, chunk: &[u8]) -> Bytes {
        // [already sent | held | chunk], searched as one.
        let mut window = std::mem::take(&mut self.carried);
        let sent = window.len();
        window.append(&mut self.held);
        window.extend_from_slice(chunk);
        self.redact(&mut window);
        let keep = self.prefix_at_end(&window);
        let hold = keep.min(window.len() - sent);
        self.held = window.split_off(window.len() - hold);
        // A possible needle start reaching back into sent bytes (then nothing is
        // left to send) stays carried.
        self.carried = if keep > hold {
            window[sent - (keep - hold)..sent].to_vec()
        } else {
            Vec::new()
        };
        Bytes::from(window.split_off(sent))
    }

    /// For a stream that must not stall: sends the held bytes now. They might begin a
    /// needle, so they are masked when long enough to carry a secret's own characters
    /// ([`MIN_REDACTED_LEN`]; shorter starts are too short to say anything, and
    /// masking them would mangle ordinary text), and remembered, so the rest of a
    /// needle they begin is still redacted when it comes.
    fn flush_held(&mut self) -> Bytes {
        let held = std::mem::take(&mut self.held);
        let started = self.carried.len() + held.len();
        let out = if started >= MIN_REDACTED_LEN {
            vec![b'*'; held.len()]
        } else {
            held.clone()
        };
        self.carried.extend_from_slice(&held);
        Bytes::from(out)
    }

    /// Whatever was held back, at the end of the stream: masked, as
    /// [`Redactor::flush_held`] masks, when it might be most of a needle (a stream
    /// that ends one byte short of the secret must not deliver the rest of it).
    fn finish(&mut self) -> Bytes {
        let rest = self.flush_held();
        self.carried.clear();
        rest
    }

    fn holding(&self) -> bool {
        !self.held.is_empty()
    }

    fn redact(&self, data: &mut [u8]) {
        for needle in self.needles.iter() {
            let mut at = 0;
            while let Some(found) = find(&data[at..], needle) {
                let start = at + found;
                data[start..start + needle.len()].copy_from_slice(&replacement(needle.len()));
                at = start + needle.len();
            }
        }
    }

    /// The length of the longest end of `data` that is a proper prefix of a needle:
    /// the bytes that must wait for the next chunk.
    fn prefix_at_end(&self, data: &[u8]) -> usize {
        let mut longest = 0;
        for needle in self.needles.iter() {
            let max = (needle.len() - 1).min(data.len());
            if let Some(k) = (longest + 1..=max)
                .rev()
                .find(|k| data.ends_with(&needle[..*k]))
            {
                longest = k;
            }
        }
        longest
    }

    fn redact_headers(&self, headers: &mut HeaderMap) {
        for value in headers.values_mut() {
            let mut bytes = value.as_bytes().to_vec();
            self.redact(&mut bytes);
            if bytes != value.as_bytes() {
                // The replacement is visible ASCII, so the value stays valid.
                *value = HeaderValue::from_bytes(&bytes)
                    .unwrap_or_else(|_| HeaderValue::from_static("[REDACTED]"));
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

/// `[REDACTED]` padded with `*` to `len` bytes (or just `*`s if shorter).
fn replacement(len: usize) -> Vec<u8> {
    const MARKER: &[u8] = b"[REDACTED]";
    let mut out = if len >= MARKER.len() {
        MARKER.to_vec()
    } else {
        Vec::new()
    };
    out.resize(len, b'*');
    out
}

/// A response body streamed through a [`Redactor`], chunk by chunk.
struct RedactedBody {
    inner: Incoming,
    redactor: Redactor,
    trailers: Option<HeaderMap>,
    done: bool,
}

impl RedactedBody {
    fn new(inner: Incoming, redactor: Redactor) -> Self {
        Self {
            inner,
            redactor,
            trailers: None,
            done: false,
        }
    }
}

impl Body for RedactedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))));
            }
            let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => frame,
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                None => {
                    this.done = true;
                    let rest = this.redactor.finish();
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                    continue;
                }
            };
            match frame.into_data() {
                Ok(data) => {
                    let safe = this.redactor.feed(&data);
                    if !safe.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(safe))));
                    }
                }
                Err(frame) => {
                    if let Ok(mut trailers) = frame.into_trailers() {
                        this.redactor.redact_headers(&mut trailers);
                        this.trailers = Some(trailers);
                    }
                    // Trailers end the body: send what was held, then them.
                    this.done = true;
                    let rest = this.redactor.finish();
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(rest))));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        // Replacements keep lengths: what is left is the inner rest plus what is held.
        let inner = self.inner.size_hint();
        let held = self.redactor.held.len() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + held);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + held);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn forbidden_addresses() {
        for (addr, reason) in [
            ("127.0.0.1", "loopback"),
            ("127.8.9.10", "loopback"),
            ("0.0.0.0", "unspecified"),
            ("10.0.0.1", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("169.254.1.1", "link-local"),
            ("169.254.169.254", "metadata"),
            ("100.64.0.1", "CGNAT"),
            ("100.127.255.255", "CGNAT"),
            ("224.0.0.1", "multicast"),
            ("::", "unspecified"),
            ("::1", "loopback"),
            ("fc00::1", "unique-local"),
            ("fd12:3456::1", "unique-local"),
            ("fe80::1", "link-local"),
            ("fd00:ec2::254", "metadata"),
            ("ff02::1", "multicast"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:10.1.2.3", "private"),
            ("::ffff:169.254.169.254", "metadata"),
            ("::10.1.2.3", "private"),
            ("::127.0.0.1", "loopback"),
            ("64:ff9b::192.168.0.1", "private"),
            ("::ffff:0:10.0.0.1", "private"),
            ("64:ff9b:1::10.0.0.1", "private"),
            ("2002:a00:1::1", "private"),
            ("2002:7f00:1::", "loopback"),
            ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"),
            ("100::1", "discard"),
            ("192.0.0.170", "IETF"),
            ("240.0.0.1", "reserved"),
            ("255.255.255.255", "reserved"),
        ] {
            let got = forbidden_address(ip(addr));
            assert!(
                got.is_some_and(|r| r.contains(reason)),
                "{addr}: expected {reason}, got {got:?}"
            );
        }
        for addr in [
            "1.1.1.1",
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "192.169.0.1",
            "2606:4700::1111",
            "::ffff:1.1.1.1",
            "64:ff9b::8.8.8.8",
            "64:ff9b:1::8.8.8.8",
            "2002:808:808::1",
            "2001:db9::1",
            "198.18.0.1",
            "192.0.1.1",
            "223.255.255.255",
        ] {
            assert_eq!(forbidden_address(ip(addr)), None, "{addr}");
        }
    }

    #[test]
    fn hosts_are_normalised() {
        assert_eq!(
            normalize_host("API.Example.COM.").unwrap(),
            "api.example.com"
        );
        assert_eq!(normalize_host("[::1]").unwrap(), "::1");
        assert_eq!(normalize_host("[2001:DB8::1]").unwrap(), "2001:db8::1");
        assert!(normalize_host("").is_err());
        assert!(normalize_host("a b").is_err());
        assert!(normalize_host("exa%mple").is_err());
        assert!(normalize_host("not:v6").is_err());
        for empty_label in ["a..example.com", "..example.com", ".example.com", "a.."] {
            assert!(normalize_host(empty_label).is_err(), "{empty_label}");
        }
        assert_eq!(
            normalize_host("[::ffff:1.2.3.4]").unwrap(),
            "::ffff:1.2.3.4"
        );
    }

    /// A request to a bound host: the secret in its header, and nothing that would
    /// keep it out of reach of the response's redaction (compression, a range).
    #[test]
    fn a_bound_request_gets_its_secret_and_loses_what_would_hide_an_echo() {
        let mut headers = HeaderMap::new();
        headers.insert(header::RANGE, HeaderValue::from_static("bytes=1-"));
        headers.insert(header::IF_RANGE, HeaderValue::from_static("\"etag\""));
        headers.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip"));
        headers.insert("x-api-key", HeaderValue::from_static("placeholder"));
        let injection = Injection {
            secret: "test".into(),
            header: HeaderName::from_static("x-api-key"),
            value: HeaderValue::from_static("sk-test-0123456789"),
            secret_value: crate::secrets::read_secret(&b"sk-test-0123456789"[..]).unwrap(),
            remove: vec![],
        };
        inject(&mut headers, &injection);
        assert_eq!(headers["x-api-key"], "sk-test-0123456789");
        assert_eq!(headers[header::ACCEPT_ENCODING], "identity");
        assert!(!headers.contains_key(header::RANGE));
        assert!(!headers.contains_key(header::IF_RANGE));
    }

    /// The upstream gets the Host header the policy judged, not the guest's spelling.
    #[test]
    fn the_host_header_sent_upstream_is_the_proxys() {
        let (mut parts, ()) = Request::get("https://api.test/v1")
            .header(header::HOST, "API.TEST.:443")
            .header(header::RANGE, "bytes=1-")
            .body(())
            .unwrap()
            .into_parts();
        prepare_request(&mut parts, host_header("api.test", 443, 443));
        let hosts: Vec<_> = parts.headers.get_all(header::HOST).iter().collect();
        assert_eq!(hosts, ["api.test"]);
        assert_eq!(parts.uri, "/v1");
    }

    #[test]
    fn connect_targets() {
        let uri: Uri = "Example.com.:443".parse().unwrap();
        assert_eq!(connect_target(&uri).unwrap(), ("example.com".into(), 443));
        let uri: Uri = "[::1]:8443".parse().unwrap();
        assert_eq!(connect_target(&uri).unwrap(), ("::1".into(), 8443));
        let uri: Uri = "example.com".parse().unwrap();
        assert!(connect_target(&uri).is_err());
        assert_eq!(display_target("::1", 443), "[::1]:443");
    }

    #[test]
    fn authority_checks() {
        let ok = |claim| authority_names(claim, "api.test", 443, 443);
        assert!(ok("api.test"));
        assert!(ok("API.test."));
        assert!(ok("api.test:443"));
        assert!(!ok("api.test:444"));
        assert!(!ok("evil.test"));
        assert!(!ok("user@api.test"));
        assert!(!ok("api.test.evil.test"));
        assert!(!ok(""));
        assert!(authority_names("api.test:8443", "api.test", 8443, 443));
    }

    #[test]
    fn hop_by_hop_and_proxy_headers_are_removed() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-private"),
            ("keep-alive", "timeout=5"),
            ("x-private", "1"),
            ("proxy-authorization", "Basic abc"),
            ("proxy-connection", "keep-alive"),
            ("te", "trailers"),
            ("x-kept", "yes"),
        ] {
            headers.insert(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        strip_hop_by_hop(&mut headers, false);
        let names: Vec<&str> = headers.keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["x-kept"]);
    }

    #[test]
    fn an_upgrade_keeps_its_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert!(wants_upgrade(&headers));
        strip_hop_by_hop(&mut headers, true);
        assert_eq!(headers[header::UPGRADE], "websocket");
        assert_eq!(headers[header::CONNECTION], "upgrade");
    }

    #[test]
    fn request_lines() {
        assert!(check_request_line(b"CONNECT api.test:443 HTTP/1.1\r\n\r\n").is_ok());
        assert!(check_request_line(b"\r\nGET http://x/ HTTP/1.0\r\nA: b\r\n\r\n").is_ok());
        for bad in [
            &b"THIS IS NOT HTTP\r\n\r\n"[..],
            b"GET /\r\n\r\n",
            b"GET  / HTTP/1.1\r\n\r\n",
            b"G\x01T / HTTP/1.1\r\n\r\n",
            b"GET / HTTP/2.0\r\n\r\n",
            b"\r\n\r\n",
        ] {
            let err = check_request_line(bad).unwrap_err();
            assert!(
                matches!(err, ProxyError::MalformedRequestLine { .. }),
                "{err}"
            );
        }
        let long = [b"GET /".as_slice(), &[b'a'; 500], b" HTTP/9\r\n\r\n"].concat();
        assert!(check_request_line(&long).unwrap_err().to_string().len() < 300);
    }

    #[test]
    fn head_ends() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nbody", 0), Some(24));
        assert_eq!(head_end(b"GET / HTTP/1.1\nA: b\n\nbody", 0), Some(21));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n", 0), None);
    }

    #[tokio::test]
    async fn the_first_head_is_read_within_limits() {
        let limits = Limits {
            max_header_bytes: 100,
            header_timeout: Duration::from_millis(200),
            ..Limits::default()
        };
        let mut input: &[u8] = b"GET http://x/ HTTP/1.1\r\n\r\nextra";
        let head = read_first_head(&mut input, &limits).await.unwrap().unwrap();
        assert_eq!(head, b"GET http://x/ HTTP/1.1\r\n\r\nextra");
        let mut input: &[u8] = &[b'a'; 1000];
        let err = read_first_head(&mut input, &limits).await.unwrap_err();
        assert_eq!(err.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
        let mut input: &[u8] = b"";
        assert!(read_first_head(&mut input, &limits)
            .await
            .unwrap()
            .is_none());
        let (mut silent, _other_end) = tokio::io::duplex(64);
        assert!(read_first_head(&mut silent, &limits)
            .await
            .unwrap()
            .is_none());
        let (mut slow, mut other_end) = tokio::io::duplex(64);
        other_end.write_all(b"GET http://x/").await.unwrap();
        let err = read_first_head(&mut slow, &limits).await.unwrap_err();
        assert_eq!(err.status(), StatusCode::REQUEST_TIMEOUT);
    }

    const SECRET: &[u8] = b"Bearer sk-test-0123456789";
    const TOKEN: &[u8] = b"sk-test-0123456789";

    /// A template that wraps the secret without a space (`session={}`): the secret
    /// alone is redacted too, as an upstream might quote it without the wrapping.
    #[test]
    fn the_bare_secret_is_redacted_whatever_wraps_it_in_the_header() {
        let mut redactor =
            Redactor::for_secret(b"session=abcdefgh12345", b"abcdefgh12345").unwrap();
        let mut out = redactor.feed(b"bad token abcdefgh12345!").to_vec();
        out.extend_from_slice(&redactor.finish());
        assert!(
            !contains(&out, b"abcdefgh12345"),
            "{}",
            String::from_utf8_lossy(&out)
        );
    }

    fn redact_all(chunks: &[&[u8]]) -> Vec<u8> {
        let mut redactor = Redactor::for_secret(SECRET, TOKEN).unwrap();
        let mut out = Vec::new();
        for chunk in chunks {
            out.extend_from_slice(&redactor.feed(chunk));
        }
        out.extend_from_slice(&redactor.finish());
        out
    }

    #[test]
    fn redaction_keeps_lengths_and_finds_split_secrets() {
        let input = b"a Bearer sk-test-0123456789 b sk-test-0123456789 c";
        let out = redact_all(&[input]);
        assert_eq!(out.len(), input.len());
        assert!(
            !contains(&out, b"sk-test"),
            "{}",
            String::from_utf8_lossy(&out)
        );
        assert!(out.starts_with(b"a [REDACTED]"));
        for split in 1..input.len() {
            let out = redact_all(&[&input[..split], &input[split..]]);
            assert_eq!(out.len(), input.len());
            assert!(!contains(&out, b"0123456789"), "split at {split}");
        }
        let bytewise: Vec<&[u8]> = input.chunks(1).collect();
        assert!(!contains(&redact_all(&bytewise), b"0123456789"));
    }

    /// A body that ends in all of the secret but its last byte (an echo cut short)
    /// does not end in that much of it.
    #[test]
    fn a_stream_ending_inside_the_secret_does_not_end_in_it() {
        let input = b"key=sk-test-012345678";
        let out = redact_all(&[input]);
        assert_no_token_piece(&out, input.len(), "cut short");
        assert!(
            out.starts_with(b"key="),
            "{}",
            String::from_utf8_lossy(&out)
        );
        // A short start is too short to say anything and stays as it was.
        assert_eq!(redact_all(&[b"ends in sk-"]), b"ends in sk-");
    }

    #[test]
    fn redaction_holds_back_only_possible_secret_starts() {
        let mut redactor = Redactor::for_secret(SECRET, TOKEN).unwrap();
        assert_eq!(&redactor.feed(b"data: one\n\n")[..], b"data: one\n\n");
        assert!(!redactor.holding());
        assert_eq!(&redactor.feed(b"xx Bear")[..], b"xx ");
        assert!(redactor.holding());
        assert_eq!(&redactor.feed(b"d")[..], b"Beard");
        assert_eq!(
            Redactor::for_secret(b"short", b"short").map(|r| r.needles.len()),
            None
        );
    }

    /// Feeds `chunks` in turn, each followed by a pause (a flush) where it says so,
    /// then ends the stream.
    fn redact_paused(chunks: &[(&[u8], bool)]) -> Vec<u8> {
        let mut redactor = Redactor::for_secret(SECRET, TOKEN).unwrap();
        let mut out = Vec::new();
        for (chunk, pause) in chunks {
            out.extend_from_slice(&redactor.feed(chunk));
            if *pause {
                out.extend_from_slice(&redactor.flush_held());
            }
        }
        out.extend_from_slice(&redactor.finish());
        out
    }

    /// `out` kept the input's length and holds no piece of the token long enough to
    /// be redacted.
    fn assert_no_token_piece(out: &[u8], input_len: usize, context: &str) {
        let shown = String::from_utf8_lossy(out);
        assert_eq!(out.len(), input_len, "{context}: {shown}");
        for window in TOKEN.windows(MIN_REDACTED_LEN) {
            assert!(!contains(out, window), "{context}: {shown}");
        }
    }

    /// An interactive stream (an upgraded connection) that pauses inside the secret:
    /// the held start goes out masked and the rest, when it comes, redacted, so the
    /// guest never gets the secret in two pieces.
    #[test]
    fn a_pause_inside_the_secret_does_not_let_it_through() {
        let input = b"a Bearer sk-test-0123456789 b sk-test-0123456789 c";
        for pause in 1..input.len() {
            let out = redact_paused(&[(&input[..pause], true), (&input[pause..], false)]);
            assert_no_token_piece(&out, input.len(), &format!("pause at {pause}"));
        }
    }

    /// A pause byte by byte, the worst case: each byte is held, then flushed.
    #[test]
    fn a_pause_after_every_byte_does_not_let_the_secret_through() {
        let input = b"x Bearer sk-test-0123456789 y";
        let bytes: Vec<(&[u8], bool)> = input.chunks(1).map(|byte| (byte, true)).collect();
        assert_no_token_piece(&redact_paused(&bytes), input.len(), "byte by byte");
    }

    /// Seeded random streams: secrets, pieces of them and other bytes, cut into
    /// random chunks, with random pauses (flushes). With pauses no secret reaches the
    /// guest whole; without, the output is the same however the stream is cut.
    #[test]
    fn random_streams_cut_and_paused_anywhere_never_carry_the_secret() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n.max(1) as u64) as usize
        };
        for round in 0..2000 {
            let mut input = Vec::new();
            for _ in 0..next(8) {
                match next(4) {
                    0 => input.extend_from_slice(TOKEN),
                    1 => input.extend_from_slice(SECRET),
                    2 => input.extend_from_slice(&TOKEN[..next(TOKEN.len())]),
                    _ => input.extend((0..next(12)).map(|_| b"ab sk-Bearer 01"[next(15)])),
                }
            }
            let mut chunks: Vec<(&[u8], bool)> = Vec::new();
            let mut at = 0;
            while at < input.len() {
                let len = 1 + next(input.len() - at);
                chunks.push((&input[at..at + len], next(3) == 0));
                at += len;
            }
            let out_paused = redact_paused(&chunks);
            let steady: Vec<&[u8]> = chunks.iter().map(|(chunk, _)| *chunk).collect();
            let shown = String::from_utf8_lossy(&input);
            assert_eq!(out_paused.len(), input.len(), "round {round}: {shown}");
            assert!(!contains(&out_paused, TOKEN), "round {round}: {shown}");
            assert_eq!(
                redact_all(&steady),
                redact_all(&[&input]),
                "round {round}: {shown}"
            );
        }
    }

    /// Ordinary text that only looks like a short start of the secret goes out as it
    /// is when the stream pauses, and what follows is not touched.
    #[test]
    fn a_pause_after_a_short_lookalike_changes_nothing() {
        let mut redactor = Redactor::for_secret(SECRET, TOKEN).unwrap();
        assert_eq!(&redactor.feed(b"xx Bear")[..], b"xx ");
        assert_eq!(&redactor.flush_held()[..], b"Bear");
        assert_eq!(&redactor.feed(b"d and sk-")[..], b"d and ");
        assert_eq!(&redactor.flush_held()[..], b"sk-");
        assert_eq!(&redactor.feed(b"stuff")[..], b"stuff");
        assert!(!redactor.holding());
    }

    #[test]
    fn redaction_in_headers() {
        let redactor = Redactor::for_secret(SECRET, TOKEN).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-echo", HeaderValue::from_static("got sk-test-0123456789"));
        redactor.redact_headers(&mut headers);
        assert_eq!(headers["x-echo"], "got [REDACTED]********");
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        find(haystack, needle).is_some()
    }
}
