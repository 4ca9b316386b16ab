//! Byte relays between the guest's loopback and the host: listeners whose
//! connections go to the host service (egress proxy, host loopback ports), and
//! `ConnectPort` connections from the host to a guest loopback port.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::protocol::{
    write_frame, ProtocolError, ServiceAnswer, ServiceRequest, HOST_SERVICE_PORT,
    SERVICE_ANSWER_TIMEOUT,
};
use crate::raw::RawStream;
use crate::server::Stream;

/// How long opening a connection (to the host service or a guest port) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Pending connections per listener.
const BACKLOG: u32 = 128;

/// Errors of the relays.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("cannot connect to the host service at {to}: {source}")]
    HostConnect { to: String, source: io::Error },
    #[error("cannot send the service request to the host: {0}")]
    HostRequest(#[from] ProtocolError),
    #[error(
        "the host refused the connection to {what}: it is not relayed, or nothing on the \
         host accepted the connection in time ('vmctl logs --supervisor' on the host says \
         which)"
    )]
    HostRefused { what: String },
    #[error(
        "the host refused the connection to {what}: the VM holds as many connections to \
         the host services as the host allows; a program in the VM may leave its \
         connections open"
    )]
    HostBusy { what: String },
    #[error("the host did not answer the request for {what}: {why}")]
    NoHostAnswer { what: String, why: String },
    #[error("port 0 is not a port one can connect to")]
    PortZero,
    #[error("cannot connect to guest port {port}: 127.0.0.1: {v4}; [::1]: {v6}")]
    GuestConnect {
        port: u16,
        v4: io::Error,
        v6: io::Error,
    },
}

/// How the agent reaches the host service ([`HOST_SERVICE_PORT`]): vsock in the VM,
/// a Unix or TCP socket in tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostConnector {
    Vsock { cid: u32, port: u32 },
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl Default for HostConnector {
    fn default() -> Self {
        HostConnector::Vsock {
            cid: tokio_vsock::VMADDR_CID_HOST,
            port: HOST_SERVICE_PORT,
        }
    }
}

impl std::fmt::Display for HostConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostConnector::Vsock { cid, port } => write!(f, "vsock {cid}:{port}"),
            HostConnector::Unix(p) => write!(f, "unix:{}", p.display()),
            HostConnector::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

async fn timed<T>(fut: impl std::future::Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::time::timeout(CONNECT_TIMEOUT, fut)
        .await
        .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
}

impl HostConnector {
    async fn connect(&self) -> io::Result<Box<dyn Stream>> {
        Ok(match self {
            HostConnector::Vsock { cid, port } => {
                let addr = tokio_vsock::VsockAddr::new(*cid, *port);
                Box::new(timed(tokio_vsock::VsockStream::connect(addr)).await?)
            }
            HostConnector::Unix(path) => {
                Box::new(timed(tokio::net::UnixStream::connect(path)).await?)
            }
            HostConnector::Tcp(addr) => {
                let s = timed(TcpStream::connect(addr)).await?;
                let _ = s.set_nodelay(true);
                Box::new(s)
            }
        })
    }

    /// A connection to the host service that asked for `req` and was answered
    /// [`ServiceAnswer::Connected`]; raw bytes follow.
    pub async fn open(&self, req: &ServiceRequest) -> Result<Box<dyn Stream>, RelayError> {
        let mut s = self
            .connect()
            .await
            .map_err(|source| RelayError::HostConnect {
                to: self.to_string(),
                source,
            })?;
        write_frame(&mut s, req).await?;
        let what = || match req {
            ServiceRequest::Egress => "the egress proxy".to_string(),
            ServiceRequest::Loopback { port } => format!("its loopback port {port}"),
        };
        let answer = tokio::time::timeout(SERVICE_ANSWER_TIMEOUT, s.read_u8()).await;
        match answer {
            Ok(Ok(byte)) => match ServiceAnswer::from_byte(byte) {
                Some(ServiceAnswer::Connected) => Ok(s),
                Some(ServiceAnswer::Refused) => Err(RelayError::HostRefused { what: what() }),
                Some(ServiceAnswer::Busy) => Err(RelayError::HostBusy { what: what() }),
                None => Err(RelayError::NoHostAnswer {
                    what: what(),
                    why: format!("it answered {byte}, which is no answer this agent knows"),
                }),
            },
            Ok(Err(e)) => Err(RelayError::NoHostAnswer {
                what: what(),
                why: e.to_string(),
            }),
            Err(_) => Err(RelayError::NoHostAnswer {
                what: what(),
                why: format!("none within {} s", SERVICE_ANSWER_TIMEOUT.as_secs()),
            }),
        }
    }
}

/// Makes closing `tcp` reset the connection, so that its peer learns the connection
/// was refused: an ordinary close would tell it that the stream ended, and a client
/// would take an empty answer for a whole one. (A relay that broke off after bytes
/// went through ends with [`byte_relay::pass_on_break`], which keeps what is queued.)
fn reset_on_close(tcp: &TcpStream) {
    if let Err(e) = tcp.set_zero_linger() {
        debug!("cannot make a connection's close a reset: {e}");
    }
}

/// Listeners that relay each connection to the host service; dropping it stops
/// accepting (connections already relayed carry on).
#[derive(Debug)]
pub struct Relay {
    addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl Relay {
    /// The IPv4 address listened on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn listen(ip: IpAddr, port: u16) -> io::Result<TcpListener> {
    let socket = match ip {
        IpAddr::V4(_) => TcpSocket::new_v4()?,
        IpAddr::V6(_) => TcpSocket::new_v6()?,
    };
    // Lets a port whose last connections linger in TIME_WAIT be listened on again.
    socket.set_reuseaddr(true)?;
    socket.bind(SocketAddr::new(ip, port))?;
    socket.listen(BACKLOG)
}

/// Listens on 127.0.0.1:`port` (0: any free port) and, best effort, on the same
/// port of `[::1]`, and relays every connection to the host with `req`. Must run in a
/// tokio runtime.
pub fn start(port: u16, req: ServiceRequest, host: Arc<HostConnector>) -> io::Result<Relay> {
    let v4 = listen(IpAddr::V4(Ipv4Addr::LOCALHOST), port)?;
    let addr = v4.local_addr()?;
    let mut listeners = vec![v4];
    match listen(IpAddr::V6(Ipv6Addr::LOCALHOST), addr.port()) {
        Ok(l) => listeners.push(l),
        // No IPv6, or something else has the port there: IPv4 clients still work.
        Err(e) => debug!(port = addr.port(), "not listening on [::1]: {e}"),
    }
    let tasks = listeners
        .into_iter()
        .map(|l| tokio::spawn(accept_loop(l, req.clone(), host.clone())))
        .collect();
    Ok(Relay { addr, tasks })
}

async fn accept_loop(listener: TcpListener, req: ServiceRequest, host: Arc<HostConnector>) {
    loop {
        match listener.accept().await {
            Ok((tcp, peer)) => {
                let (req, host) = (req.clone(), host.clone());
                tokio::spawn(async move {
                    relay_to_host(tcp, &req, &host).await;
                    debug!(%peer, ?req, "relay connection ended");
                });
            }
            Err(e) => {
                // Out of descriptors, most likely: let some connections finish.
                warn!(?req, "accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn relay_to_host(mut tcp: TcpStream, req: &ServiceRequest, host: &HostConnector) {
    let _ = tcp.set_nodelay(true);
    let upstream = match host.open(req).await {
        Ok(s) => s,
        Err(e) => {
            match e {
                // The host warned of it, and the client gets a reset.
                RelayError::HostRefused { .. } => info!(?req, "{e}"),
                _ => warn!(?req, "{e}"),
            }
            reset_on_close(&tcp);
            return;
        }
    };
    let relayed = byte_relay::both_ways(&mut tcp, upstream).await;
    if let Some(e) = relayed.error() {
        debug!(?req, "relay failed: {e}");
    }
    byte_relay::end_side(tcp, byte_relay::Side::A, &relayed).await;
}

/// Connects to the guest's loopback `port`: 127.0.0.1, then `[::1]` (a server bound
/// to IPv6 only).
pub async fn connect_guest_port(port: u16) -> Result<TcpStream, RelayError> {
    if port == 0 {
        return Err(RelayError::PortZero);
    }
    let v4 = match timed(TcpStream::connect((Ipv4Addr::LOCALHOST, port))).await {
        Ok(s) => return Ok(s),
        Err(e) => e,
    };
    match timed(TcpStream::connect((Ipv6Addr::LOCALHOST, port))).await {
        Ok(s) => Ok(s),
        Err(v6) => Err(RelayError::GuestConnect { port, v4, v6 }),
    }
}

/// Relays a host connection that switched to raw bytes (`pending`: bytes already
/// read from it) and a guest TCP connection until both directions end.
pub async fn forward(client: Box<dyn Stream>, pending: Vec<u8>, mut tcp: TcpStream) {
    let _ = tcp.set_nodelay(true);
    let client = RawStream::new(pending, client);
    let relayed = byte_relay::both_ways(client, &mut tcp).await;
    match &relayed {
        byte_relay::Relayed {
            a_to_b: Ok(up),
            b_to_a: Ok(down),
        } => debug!(up, down, "published port connection ended"),
        relayed => debug!(?relayed, "published port connection failed"),
    }
    byte_relay::end_side(tcp, byte_relay::Side::B, &relayed).await;
}
