//! Test servers on the host's loopback: an HTTPS (or plain HTTP) upstream with its
//! own test CA that echoes requests, streams server-sent events and echoes upgraded
//! connections, serves N bytes on request (for throughput benchmarks), and records
//! what it received.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

/// A CA of the tests' own, and a server certificate it signed.
pub struct TestCa {
    pub ca_pem: String,
    server_config: Arc<rustls::ServerConfig>,
}

impl TestCa {
    /// A CA and a certificate for `names` (DNS names).
    pub fn new(names: &[&str]) -> TestCa {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "vmctl test upstream CA");
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
        let server_key = KeyPair::generate().expect("server key");
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let server_params = CertificateParams::new(names).expect("server params");
        let server_cert = server_params
            .signed_by(&server_key, &ca_cert, &ca_key)
            .expect("server certificate");
        let key = rustls::pki_types::PrivateKeyDer::try_from(server_key.serialize_der())
            .expect("server key DER");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server_config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(vec![server_cert.der().clone()], key)
            .expect("server TLS config");
        TestCa {
            ca_pem: ca_cert.pem(),
            server_config: Arc::new(server_config),
        }
    }
}

/// What the upstream received: each request's head (request line and headers) and
/// body, as text.
#[derive(Clone, Default)]
pub struct Seen(Arc<Mutex<Vec<String>>>);

impl Seen {
    pub fn requests(&self) -> Vec<String> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
    fn push(&self, request: String) {
        if let Ok(mut v) = self.0.lock() {
            v.push(request);
        }
    }
}

/// The largest `GET /bytes/N` the upstream serves: 1 GiB.
pub const MAX_BYTES: u64 = 1 << 30;

/// A running upstream; it serves until the test process ends.
pub struct Upstream {
    pub addr: SocketAddr,
    pub seen: Seen,
}

/// Starts an upstream on 127.0.0.1: TLS with `ca`'s certificate, or plain HTTP.
///
/// Paths: `/sse` streams three events one second apart; `GET /bytes/N` answers 200
/// with `Content-Length: N` and N bytes, streamed (N at most [`MAX_BYTES`], else
/// 400); a request with `Upgrade` gets `101` and its bytes echoed; anything else is
/// answered with the request it got (head and body), so a test sees what reached the
/// upstream.
pub fn start(ca: Option<&TestCa>) -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the test upstream");
    let addr = listener.local_addr().expect("upstream address");
    let seen = Seen::default();
    let tls = ca.map(|ca| ca.server_config.clone());
    let recorder = seen.clone();
    thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let tls = tls.clone();
            let seen = recorder.clone();
            thread::spawn(move || serve(stream, tls, seen));
        }
    });
    Upstream { addr, seen }
}

fn serve(stream: TcpStream, tls: Option<Arc<rustls::ServerConfig>>, seen: Seen) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(60)));
    match tls {
        Some(config) => {
            let Ok(connection) = rustls::ServerConnection::new(config) else {
                return;
            };
            let mut tls = rustls::StreamOwned::new(connection, stream);
            let _ = answer(&mut tls, &seen);
            tls.conn.send_close_notify();
            let _ = tls.flush();
        }
        None => {
            let mut plain = stream;
            let _ = answer(&mut plain, &seen);
        }
    }
}

/// Reads one request and answers it (the connection closes after).
fn answer<S: Read + Write>(stream: &mut S, seen: &Seen) -> std::io::Result<()> {
    let mut reader = BufReader::new(&mut *stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let header = |name: &str| {
        head.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.eq_ignore_ascii_case(name)
                .then(|| value.trim().to_string())
        })
    };
    let length: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length.min(1 << 20)];
    reader.read_exact(&mut body)?;
    let upgrade = header("upgrade").is_some();
    let request_line = head.lines().next().unwrap_or("");
    let sse = request_line.contains(" /sse");
    let bytes = bytes_request(request_line);
    let request = format!("{head}\r\n{}", String::from_utf8_lossy(&body));
    seen.push(request.clone());
    drop(reader);
    if upgrade {
        stream.write_all(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        )?;
        stream.flush()?;
        let mut buf = [0u8; 4096];
        loop {
            let n = stream.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            stream.write_all(&buf[..n])?;
            stream.flush()?;
        }
    }
    if let Some(n) = bytes {
        return send_bytes(stream, n);
    }
    if sse {
        stream.write_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n",
        )?;
        for i in 1..=3 {
            stream.write_all(format!("data: event {i}\n\n").as_bytes())?;
            stream.flush()?;
            if i < 3 {
                thread::sleep(Duration::from_secs(1));
            }
        }
        return Ok(());
    }
    let response = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{request}",
        request.len()
    );
    stream.write_all(response.as_bytes())?;
    stream.flush()
}

/// `Some(Ok(N))` for `GET /bytes/N` with N <= [`MAX_BYTES`], `Some(Err(..))` for a
/// `GET /bytes/...` that is not, `None` for any other request.
fn bytes_request(request_line: &str) -> Option<Result<u64, String>> {
    let mut parts = request_line.split_whitespace();
    let (method, target) = (parts.next()?, parts.next()?);
    // The path of an origin-form target, or of an absolute-form one.
    let path = match target.split_once("://") {
        Some((_, rest)) => rest.find('/').map_or("/", |i| &rest[i..]),
        None => target,
    };
    let n = path.strip_prefix("/bytes/")?;
    if method != "GET" {
        return Some(Err(format!("/bytes/N takes GET, not {method}")));
    }
    Some(match n.parse::<u64>() {
        Ok(n) if n <= MAX_BYTES => Ok(n),
        Ok(n) => Err(format!("{n} bytes is more than {MAX_BYTES}")),
        Err(_) => Err(format!("{n:?} is not a number of bytes")),
    })
}

/// Answers a `/bytes/N` request: N bytes in 64 KiB chunks, or 400.
fn send_bytes<S: Write>(stream: &mut S, n: Result<u64, String>) -> std::io::Result<()> {
    let n = match n {
        Ok(n) => n,
        Err(why) => {
            let response = format!(
                "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{why}",
                why.len()
            );
            stream.write_all(response.as_bytes())?;
            return stream.flush();
        }
    };
    stream.write_all(
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )?;
    let chunk: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    let mut left = n;
    while left > 0 {
        let k = left.min(chunk.len() as u64) as usize;
        stream.write_all(&chunk[..k])?;
        left -= k as u64;
    }
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, target: &str) -> Vec<u8> {
        let mut stream = TcpStream::connect(addr).expect("connect");
        write!(stream, "GET {target} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).unwrap();
        response
    }

    fn split(response: &[u8]) -> (String, &[u8]) {
        let end = response
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a response head");
        (
            String::from_utf8_lossy(&response[..end]).into_owned(),
            &response[end + 4..],
        )
    }

    #[test]
    fn bytes_requests_are_recognised() {
        assert_eq!(bytes_request("GET /bytes/10 HTTP/1.1"), Some(Ok(10)));
        assert_eq!(
            bytes_request("GET http://bench.test/bytes/0 HTTP/1.1"),
            Some(Ok(0))
        );
        assert_eq!(
            bytes_request("GET /bytes/1073741824 HTTP/1.1"),
            Some(Ok(1 << 30))
        );
        assert!(matches!(
            bytes_request("GET /bytes/1073741825 HTTP/1.1"),
            Some(Err(_))
        ));
        assert!(matches!(
            bytes_request("GET /bytes/x HTTP/1.1"),
            Some(Err(_))
        ));
        assert!(matches!(
            bytes_request("POST /bytes/1 HTTP/1.1"),
            Some(Err(_))
        ));
        assert_eq!(bytes_request("GET /latency HTTP/1.1"), None);
        assert_eq!(bytes_request("GET /v1/bytes/3 HTTP/1.1"), None);
        assert_eq!(bytes_request(""), None);
    }

    #[test]
    fn serves_n_bytes_and_echoes_the_rest() {
        let upstream = start(None);
        let n = 200_000;
        let response = get(upstream.addr, &format!("/bytes/{n}"));
        let (head, body) = split(&response);
        assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
        assert!(head.contains(&format!("Content-Length: {n}")), "{head}");
        assert_eq!(body.len(), n);
        assert_eq!((body[0], body[250], body[251]), (0, 250, 0));
        let (head, _) = split(&get(upstream.addr, "/bytes/2000000000"));
        assert!(head.starts_with("HTTP/1.1 400"), "{head}");
        let echo = get(upstream.addr, "/echo");
        let (head, body) = split(&echo);
        assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
        assert!(String::from_utf8_lossy(body).starts_with("GET /echo HTTP/1.1"));
        assert_eq!(upstream.seen.requests().len(), 3);
    }
}
