//! The agent's network side on the host, without a VM: each test runs an agent on a
//! Unix socket whose files live in a temp dir and whose "host service" is a Unix
//! socket the test accepts on.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use guest_agent::client::{connect_unix, ClientError, Connection, RawStream};
use guest_agent::network::files::{ENV_BLOCK_BEGIN, ENV_BLOCK_END};
use guest_agent::network::{HostConnector, Network, NetworkPaths, NetworkSettings};
use guest_agent::protocol::{
    encode_frame, AgentMessage, ClientMessage, ExecRequest, FrameReader, Hello, NetworkConfig,
    ServiceAnswer, ServiceRequest, PROTOCOL_VERSION,
};
use guest_agent::server::{self, ListenAddr, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UnixListener, UnixStream};

const PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIBtestcert\n-----END CERTIFICATE-----\n";

/// Fails the test instead of hanging it.
async fn within<T>(fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .expect("timed out")
}

struct Agent {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    paths: NetworkPaths,
    network: Arc<Network>,
    /// The fake host service.
    host: UnixListener,
}

impl Agent {
    async fn start() -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let host_path = dir.path().join("host.sock");
        let host = UnixListener::bind(&host_path).unwrap();
        let paths = NetworkPaths::under(&dir.path().join("root"));
        let network = Arc::new(Network::new(NetworkSettings {
            paths: paths.clone(),
            host: HostConnector::Unix(host_path),
            egress_port: 0,
        }));
        let config = ServerConfig {
            network: network.clone(),
            ..Default::default()
        };
        let listener = server::Listener::bind(&ListenAddr::Unix(socket.clone())).unwrap();
        tokio::spawn(server::serve(listener, config));
        Agent {
            _dir: dir,
            socket,
            paths,
            network,
            host,
        }
    }

    async fn conn(&self) -> Connection<UnixStream> {
        within(connect_unix(&self.socket)).await.unwrap()
    }

    async fn configure(&self, config: NetworkConfig) -> Result<Vec<(u16, String)>, ClientError> {
        within(self.conn().await.configure_network(config)).await
    }

    /// Accepts the next host-service connection and answers it `Connected`: its
    /// request and its raw bytes.
    async fn accept_host(&self) -> (ServiceRequest, RawStream<UnixStream>) {
        self.accept_host_answering(ServiceAnswer::Connected).await
    }

    /// Accepts the next host-service connection and gives `answer`.
    async fn accept_host_answering(
        &self,
        answer: ServiceAnswer,
    ) -> (ServiceRequest, RawStream<UnixStream>) {
        let (s, _) = within(self.host.accept()).await.unwrap();
        let mut frames = FrameReader::new(s);
        let req = within(frames.next::<ServiceRequest>())
            .await
            .unwrap()
            .unwrap();
        let (s, pending) = frames.into_parts();
        let mut s = RawStream::new(pending, s);
        s.write_all(&[answer as u8]).await.unwrap();
        (req, s)
    }
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Loopback ports kept for the agent to listen on, and the sockets that keep them:
/// each is bound with SO_REUSEADDR but not listening. The kernel hands a bound port
/// to no other socket (neither a bind to port 0, as the agent's own egress proxy
/// does, nor a connect's source port), while the agent, which listens with
/// SO_REUSEADDR too, may still take it. A port merely found free and released was,
/// now and then, the egress proxy's by the time the agent bound it.
fn reserve_ports<const N: usize>() -> ([u16; N], Vec<TcpSocket>) {
    let held: Vec<TcpSocket> = (0..N)
        .map(|_| {
            let socket = TcpSocket::new_v4().unwrap();
            socket.set_reuseaddr(true).unwrap();
            socket.bind(([127, 0, 0, 1], 0).into()).unwrap();
            socket
        })
        .collect();
    let ports = std::array::from_fn(|i| held[i].local_addr().unwrap().port());
    (ports, held)
}

async fn read_all<R: AsyncReadExt + Unpin>(r: &mut R) -> Vec<u8> {
    let mut out = Vec::new();
    within(r.read_to_end(&mut out)).await.unwrap();
    out
}

#[tokio::test]
async fn configure_writes_the_ca_and_environment_once() {
    let agent = Agent::start().await;
    let p = &agent.paths;
    std::fs::create_dir_all(p.ca_bundle.parent().unwrap()).unwrap();
    std::fs::write(&p.ca_bundle, "SYSTEM CERTS\n").unwrap();
    std::fs::create_dir_all(p.environment.parent().unwrap()).unwrap();
    std::fs::write(&p.environment, "LANG=C.UTF-8\n").unwrap();

    let failed = agent
        .configure(NetworkConfig {
            ca_cert_pem: PEM.into(),
            env: env(&[("HTTPS_PROXY", "http://127.0.0.1:3128"), ("OLD", "x")]),
            relay_ports: vec![],
            trusted_roots_pem: String::new(),
        })
        .await
        .unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    let egress = agent.network.egress_addr().expect("egress listening");
    assert_eq!(std::fs::read_to_string(&p.ca_file).unwrap(), PEM);
    assert_eq!(std::fs::read_to_string(&p.ca_store_file).unwrap(), PEM);

    // Again, with other variables and the host's roots (the CA among them): the
    // bundle keeps one copy of each, the block is replaced.
    let host_root = "-----BEGIN CERTIFICATE-----\nSE9TVA==\n-----END CERTIFICATE-----\n";
    agent
        .configure(NetworkConfig {
            ca_cert_pem: PEM.into(),
            env: env(&[("HTTPS_PROXY", "http://127.0.0.1:3128"), ("NEW", "y z")]),
            relay_ports: vec![],
            trusted_roots_pem: format!("{PEM}{host_root}"),
        })
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(&p.ca_bundle).unwrap(),
        format!("SYSTEM CERTS\n{PEM}{host_root}")
    );
    assert_eq!(
        std::fs::read_to_string(&p.roots_store_file).unwrap(),
        format!("{PEM}{host_root}")
    );
    assert_eq!(
        std::fs::read_to_string(&p.environment).unwrap(),
        format!(
            "LANG=C.UTF-8\n{ENV_BLOCK_BEGIN}\nHTTPS_PROXY=\"http://127.0.0.1:3128\"\nNEW=\"y z\"\n{ENV_BLOCK_END}\n"
        )
    );
    assert_eq!(
        agent.network.env(),
        env(&[("HTTPS_PROXY", "http://127.0.0.1:3128"), ("NEW", "y z")])
    );
    // The egress listener is set up once.
    assert_eq!(agent.network.egress_addr(), Some(egress));

    // Empty CA and env (a request that only adds relays) leave them as they are.
    agent.configure(NetworkConfig::default()).await.unwrap();
    assert_eq!(agent.network.env().len(), 2);
    assert!(std::fs::read_to_string(&p.environment)
        .unwrap()
        .contains("NEW=\"y z\""));
}

#[tokio::test]
async fn configure_rejects_bad_input() {
    let agent = Agent::start().await;
    let cases = [
        (
            NetworkConfig {
                ca_cert_pem: "not a certificate".into(),
                ..Default::default()
            },
            "not PEM",
        ),
        (
            NetworkConfig {
                env: env(&[("1BAD", "v")]),
                ..Default::default()
            },
            "1BAD",
        ),
        (
            NetworkConfig {
                env: env(&[("GOOD", "v"), ("A-B", "v")]),
                ..Default::default()
            },
            "A-B",
        ),
        (
            NetworkConfig {
                env: env(&[("MULTI", "line\nbreak")]),
                ..Default::default()
            },
            "MULTI",
        ),
        (
            NetworkConfig {
                env: env(&[("NUL", "a\0b")]),
                ..Default::default()
            },
            "NUL",
        ),
    ];
    for (config, needle) in cases {
        let err = agent.configure(config).await.unwrap_err();
        assert!(
            matches!(&err, ClientError::Agent(m) if m.contains(needle)),
            "{needle}: {err}"
        );
    }
    // Nothing was changed by the rejected requests.
    assert!(!agent.paths.ca_file.exists());
    assert!(!agent.paths.environment.exists());
    assert!(agent.network.egress_addr().is_none());
    assert!(agent.network.env().is_empty());
}

#[tokio::test]
async fn exec_gets_the_network_environment_under_its_own() {
    let agent = Agent::start().await;
    agent
        .configure(NetworkConfig {
            env: env(&[
                ("NET_ONLY", "from-net"),
                ("SHARED", "net"),
                ("HOME", "/net"),
            ]),
            ..Default::default()
        })
        .await
        .unwrap();
    let req = ExecRequest {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "echo \"$NET_ONLY|$SHARED|$HOME\"".into(),
        ],
        env: vec![("SHARED".into(), "req".into())],
        ..Default::default()
    };
    let out = within(async {
        agent
            .conn()
            .await
            .exec(req)
            .await
            .unwrap()
            .output(b"")
            .await
            .unwrap()
    })
    .await;
    // The network's variables override the defaults (HOME), the request's override them.
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-net|req|/net\n");
}

#[tokio::test]
async fn egress_connections_reach_the_host_with_half_close() {
    let agent = Agent::start().await;
    agent.configure(NetworkConfig::default()).await.unwrap();
    let addr = agent.network.egress_addr().unwrap();
    assert!(addr.ip().is_loopback());

    let mut tcp = within(TcpStream::connect(addr)).await.unwrap();
    let request = b"CONNECT example.com:443 HTTP/1.1\r\n\r\n";
    tcp.write_all(request).await.unwrap();
    tcp.shutdown().await.unwrap(); // half-close: the response must still come back

    let (req, mut host) = agent.accept_host().await;
    assert_eq!(req, ServiceRequest::Egress);
    assert_eq!(read_all(&mut host).await, request);
    host.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
    host.shutdown().await.unwrap();
    assert_eq!(read_all(&mut tcp).await, b"HTTP/1.1 200 OK\r\n\r\n");

    // Over [::1] too, when this machine has IPv6 (a port of its own there says so).
    if std::net::TcpListener::bind("[::1]:0").is_ok() {
        let mut tcp6 = TcpStream::connect(("::1", addr.port()))
            .await
            .expect("the egress listener is not on [::1], though this machine has IPv6");
        tcp6.write_all(b"v6").await.unwrap();
        let (req, mut host) = agent.accept_host().await;
        assert_eq!(req, ServiceRequest::Egress);
        let mut got = [0u8; 2];
        within(host.read_exact(&mut got)).await.unwrap();
        assert_eq!(&got, b"v6");
    }
}

#[tokio::test]
async fn egress_without_a_host_service_resets_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    let network = Network::new(NetworkSettings {
        paths: NetworkPaths::under(dir.path()),
        host: HostConnector::Unix(dir.path().join("nobody-listens.sock")),
        egress_port: 0,
    });
    network.configure(&NetworkConfig::default()).unwrap();
    let mut tcp = TcpStream::connect(network.egress_addr().unwrap())
        .await
        .unwrap();
    let mut buf = Vec::new();
    // A reset, not an empty answer that looks like the server's.
    let r = within(tcp.read_to_end(&mut buf)).await;
    assert!(
        r.as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "{r:?}"
    );
}

/// Reads what `tcp` gets until its end, which must be a reset: the guest's client
/// learns that the connection was refused or broke, not that it ended.
async fn assert_reset(tcp: &mut TcpStream) {
    let mut buf = Vec::new();
    let r = within(tcp.read_to_end(&mut buf)).await;
    assert!(
        r.as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "not reset: {r:?} after {buf:?}"
    );
}

/// The host refuses a relayed connection (nothing listens on its port, or the guest
/// holds too many): the guest's client is reset, not given an empty answer.
#[tokio::test]
async fn a_connection_the_host_refuses_is_reset() {
    let agent = Agent::start().await;
    let ([port], _reserved) = reserve_ports::<1>();
    let failed = agent
        .configure(NetworkConfig {
            relay_ports: vec![port],
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    for answer in [ServiceAnswer::Refused, ServiceAnswer::Busy] {
        let mut tcp = within(TcpStream::connect(("127.0.0.1", port)))
            .await
            .unwrap();
        let (req, _host) = agent.accept_host_answering(answer).await;
        assert_eq!(req, ServiceRequest::Loopback { port });
        assert_reset(&mut tcp).await;
    }
}

/// The host side's stream breaks mid-way (a Unix socket closed with data unread
/// reads as a reset): the guest's client, which has taken all that came, is reset
/// too. Only a Unix socket breaks so: over vsock the guest's kernel reads the VMM's
/// RST as an end of stream (PROTOCOL.md), which is passed on as one.
#[tokio::test]
async fn a_host_side_that_breaks_resets_the_guests_client() {
    let agent = Agent::start().await;
    agent.configure(NetworkConfig::default()).await.unwrap();
    let mut tcp = within(TcpStream::connect(agent.network.egress_addr().unwrap()))
        .await
        .unwrap();
    let (_, mut host) = agent.accept_host().await;
    host.write_all(b"partial answer").await.unwrap();
    let mut got = [0u8; 14];
    within(tcp.read_exact(&mut got)).await.unwrap();
    tcp.write_all(b"never read").await.unwrap();
    // Once the bytes are in the host's socket, it closes with them unread.
    within(bytes_arrived(host.get_ref())).await;
    drop(host);
    assert_reset(&mut tcp).await;
}

/// Returns once `socket` holds bytes to read, which it leaves there.
async fn bytes_arrived(socket: &UnixStream) {
    use std::os::fd::AsRawFd;
    loop {
        socket.readable().await.unwrap();
        // Readiness may be left over from the frames read before: a peek that finds
        // nothing clears it, and the wait goes on.
        let peeked = socket.try_io(tokio::io::Interest::READABLE, || {
            let mut byte = 0u8;
            // SAFETY: a one-byte buffer of ours, on a descriptor the stream keeps open.
            let n = unsafe {
                libc::recv(
                    socket.as_raw_fd(),
                    (&mut byte as *mut u8).cast(),
                    1,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n)
            }
        });
        match peeked {
            Ok(0) => panic!("the host's socket reached its end before the bytes came"),
            Ok(_) => return,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => panic!("peeking at the host's socket: {e}"),
        }
    }
}

#[tokio::test]
async fn relays_are_additive_and_report_failures() {
    let agent = Agent::start().await;
    let ([p1, p2], _reserved) = reserve_ports::<2>();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_port = busy.local_addr().unwrap().port();

    let failed = agent
        .configure(NetworkConfig {
            relay_ports: vec![p1],
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    let egress_port = agent.network.egress_addr().unwrap().port();

    let mut c1 = within(TcpStream::connect(("127.0.0.1", p1))).await.unwrap();
    c1.write_all(b"to host").await.unwrap();
    let (req, mut host) = agent.accept_host().await;
    assert_eq!(req, ServiceRequest::Loopback { port: p1 });
    let mut got = [0u8; 7];
    within(host.read_exact(&mut got)).await.unwrap();
    assert_eq!(&got, b"to host");
    host.write_all(b"back").await.unwrap();
    drop(host);
    assert_eq!(read_all(&mut c1).await, b"back");

    // The same port again plus new ones: p1 is kept (not bound twice), p2 added, the
    // unusable ones reported while the others still work.
    let failed = agent
        .configure(NetworkConfig {
            relay_ports: vec![p1, p2, busy_port, 0, egress_port, p2],
            ..Default::default()
        })
        .await
        .unwrap();
    let failed_ports: Vec<u16> = failed.iter().map(|(p, _)| *p).collect();
    assert_eq!(failed_ports, vec![busy_port, 0, egress_port], "{failed:?}");
    let in_use = &failed[0].1;
    assert!(
        in_use.contains(&busy_port.to_string()) && in_use.to_lowercase().contains("in use"),
        "{in_use}"
    );
    let mut expected = vec![p1, p2];
    expected.sort();
    assert_eq!(agent.network.relayed_ports(), expected);

    for port in [p2, p1] {
        let mut c = within(TcpStream::connect(("127.0.0.1", port)))
            .await
            .unwrap();
        c.write_all(b"x").await.unwrap();
        let (req, mut host) = agent.accept_host().await;
        assert_eq!(req, ServiceRequest::Loopback { port });
        let mut one = [0u8; 1];
        within(host.read_exact(&mut one)).await.unwrap();
    }
    drop(busy);
}

/// An echo server on `listener`; each connection's write side closes after its
/// read side does.
fn echo(listener: TcpListener) {
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
}

#[tokio::test]
async fn connect_port_reaches_a_loopback_server() {
    let agent = Agent::start().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    echo(listener);

    let mut s = within(agent.conn().await.connect_port(port)).await.unwrap();
    s.write_all(b"ping").await.unwrap();
    let mut got = [0u8; 4];
    within(s.read_exact(&mut got)).await.unwrap();
    assert_eq!(&got, b"ping");
    // Half-close reaches the guest server, whose close comes back as end of stream.
    s.write_all(b" last").await.unwrap();
    s.shutdown().await.unwrap();
    assert_eq!(read_all(&mut s).await, b" last");
}

#[tokio::test]
async fn connect_port_forwards_pipelined_bytes() {
    let agent = Agent::start().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    echo(listener);

    // Hello, the request and the first data in one write, before any answer.
    let mut bytes = encode_frame(&ClientMessage::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        client: "pipelined".into(),
        host_time_ns: None,
    }))
    .unwrap();
    bytes.extend(encode_frame(&ClientMessage::ConnectPort(port)).unwrap());
    bytes.extend_from_slice(b"early bytes");
    let (r, mut w) = UnixStream::connect(&agent.socket)
        .await
        .unwrap()
        .into_split();
    w.write_all(&bytes).await.unwrap();
    w.shutdown().await.unwrap();
    let mut frames = FrameReader::new(r);
    assert!(matches!(
        within(frames.next::<AgentMessage>()).await.unwrap(),
        Some(AgentMessage::HelloOk { .. })
    ));
    assert_eq!(
        within(frames.next::<AgentMessage>()).await.unwrap(),
        Some(AgentMessage::Connected)
    );
    let (r, pending) = frames.into_parts();
    let mut raw = RawStream::new(pending, r);
    assert_eq!(read_all(&mut raw).await, b"early bytes");
}

#[tokio::test]
async fn connect_port_falls_back_to_ipv6_loopback() {
    let Ok(listener) = TcpListener::bind("[::1]:0").await else {
        not_run(
            "connect_port_falls_back_to_ipv6_loopback",
            "no IPv6 loopback here",
        );
        return;
    };
    let port = listener.local_addr().unwrap().port();
    if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
        not_run(
            "connect_port_falls_back_to_ipv6_loopback",
            "the IPv4 port beside the IPv6 one is taken: the agent would reach that instead",
        );
        return;
    }
    echo(listener);
    let agent = Agent::start().await;
    let mut s = within(agent.conn().await.connect_port(port)).await.unwrap();
    s.write_all(b"six").await.unwrap();
    s.shutdown().await.unwrap();
    assert_eq!(read_all(&mut s).await, b"six");
}

#[tokio::test]
async fn connect_port_to_a_closed_port_is_an_error() {
    let agent = Agent::start().await;
    let ([closed], _reserved) = reserve_ports::<1>();
    let err = within(agent.conn().await.connect_port(closed))
        .await
        .err()
        .unwrap();
    let ClientError::Agent(message) = &err else {
        panic!("expected an agent error, got {err}")
    };
    assert!(
        message.contains(&format!("guest port {closed}")) && message.contains("refused"),
        "{message}"
    );
    let err = within(agent.conn().await.connect_port(0))
        .await
        .err()
        .unwrap();
    assert!(
        matches!(&err, ClientError::Agent(m) if m.contains("port 0")),
        "{err}"
    );
}

/// Says loudly, past libtest's capture of a passing test's output, that `test` did
/// not run here and why.
fn not_run(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "\n!!!!!!!! NOT RUN {test}: {why}\n");
}
