//! The host side of the device (Firecracker-style "hybrid vsock"): the Unix
//! listener at `P`, host clients' `CONNECT <port>\n` handshakes, guest connections
//! to `P_<port>`, and the map of live connections keyed by (local port, peer port).
//!
//! The muxer owns the epoll set; the worker adds its own event fds with tokens below
//! [`FIRST_DYNAMIC_TOKEN`].

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::io::{ErrorKind, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::connection::{Connection, State};
use super::packet::{Header, Op, TxPacket};

/// epoll token of the listener.
pub const LISTENER_TOKEN: u64 = 8;
/// Tokens from here on name host sockets.
pub const FIRST_DYNAMIC_TOKEN: u64 = 1 << 32;
/// Most live connections; further requests are refused.
pub const MAX_CONNECTIONS: usize = 1024;
/// Connections only host clients may open: vmctl's calls into the guest (`exec`, the
/// network setup, published ports, `Shutdown`) must get through however many
/// connections the guest holds to host services (a CLI leaking keep-alive
/// connections to the egress proxy is enough to hold hundreds).
pub const HOST_RESERVED_CONNECTIONS: usize = 128;
/// Most live connections the guest opened; its further requests are refused.
pub const MAX_GUEST_CONNECTIONS: usize = MAX_CONNECTIONS - HOST_RESERVED_CONNECTIONS;
/// Most host clients still sending their `CONNECT` line.
pub const MAX_PENDING_CLIENTS: usize = 256;
/// Most RSTs for unknown connections waiting for a receive buffer.
pub const MAX_PENDING_RSTS: usize = 1024;
/// Longest accepted `CONNECT <port>\n` line.
const MAX_CONNECT_LINE: usize = 32;
/// First host port handed to host-initiated connections.
pub const FIRST_LOCAL_PORT: u32 = 1024;
/// How long the listener rests when the process is out of file descriptors. Host
/// clients wait in its backlog meanwhile.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);
/// How long a host client's request may wait for the guest's answer (OP_RESPONSE or
/// RST; a guest kernel gives one at once, even a loaded one in the nested host in well
/// under a second). A guest that never answers would otherwise keep the client
/// waiting and its slot taken for ever.
#[cfg(not(test))]
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
#[cfg(test)]
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_millis(1500);

/// How long a host client has, once accepted, to send its whole `CONNECT` line (vmctl
/// sends it at once). Clients that never do would otherwise hold the pending slots
/// for ever, and every later client would be refused.
#[cfg(not(test))]
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
#[cfg(test)]
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_millis(500);

/// (local (host) port, peer (guest) port).
pub type ConnKey = (u32, u32);

#[derive(Debug, thiserror::Error)]
pub enum MuxerError {
    #[error("cannot create the epoll set: {0}")]
    Epoll(std::io::Error),
    #[error("cannot register the listener with epoll: {0}")]
    RegisterListener(std::io::Error),
    #[error("malformed connect line from a host client: {0:?}")]
    BadConnectLine(String),
    #[error("too many connections ({MAX_CONNECTIONS})")]
    TooManyConnections,
    #[error(
        "the guest holds {MAX_GUEST_CONNECTIONS} connections to host services, the most it \
         may (the other {HOST_RESERVED_CONNECTIONS} are kept for vmctl's calls into the \
         guest); its connection to host port {0} is refused until it closes some"
    )]
    TooManyGuestConnections(u32),
    #[error("cannot connect to {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Counters for things the guest or host clients got wrong.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub bad_packets: u64,
    pub resets_sent: u64,
    pub rsts_dropped: u64,
    pub refused_clients: u64,
    pub expired_requests: u64,
    /// Guest requests refused for [`MAX_GUEST_CONNECTIONS`].
    pub refused_guest_requests: u64,
}

/// A host client that has not finished its `CONNECT` line yet.
struct PendingClient {
    stream: UnixStream,
    line: Vec<u8>,
}

pub struct Muxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: Arc<UnixListener>,
    epoll: Epoll,
    conns: HashMap<ConnKey, Connection>,
    /// Of `conns`, those the guest opened.
    guest_opened: usize,
    tokens: HashMap<u64, ConnKey>,
    pending_clients: HashMap<u64, PendingClient>,
    next_token: u64,
    next_local_port: u32,
    rx_ready: VecDeque<ConnKey>,
    rst_queue: VecDeque<Header>,
    /// Host clients' requests to the guest in the order they went out, each with when
    /// it expires and its socket's token (a key may be reused by a later connection).
    requests: VecDeque<(Instant, ConnKey, u64)>,
    /// Pending clients' tokens in the order they were accepted, each with when its
    /// handshake expires.
    handshakes: VecDeque<(Instant, u64)>,
    /// The listener is out of epoll until then: accepting failed for want of file
    /// descriptors, and a level-triggered listener would wake us again at once.
    accept_paused_until: Option<Instant>,
    /// Out of file descriptors was reported, and no accept has succeeded since.
    exhaustion_reported: bool,
    pub stats: Stats,
}

impl Muxer {
    pub fn new(
        guest_cid: u64,
        uds_path: &Path,
        listener: Arc<UnixListener>,
    ) -> Result<Self, MuxerError> {
        let epoll = Epoll::new().map_err(MuxerError::Epoll)?;
        epoll
            .ctl(
                ControlOperation::Add,
                listener.as_raw_fd(),
                EpollEvent::new(EventSet::IN, LISTENER_TOKEN),
            )
            .map_err(MuxerError::RegisterListener)?;
        Ok(Self {
            guest_cid,
            uds_path: uds_path.to_path_buf(),
            listener,
            epoll,
            conns: HashMap::new(),
            guest_opened: 0,
            tokens: HashMap::new(),
            pending_clients: HashMap::new(),
            next_token: FIRST_DYNAMIC_TOKEN,
            next_local_port: FIRST_LOCAL_PORT,
            rx_ready: VecDeque::new(),
            rst_queue: VecDeque::new(),
            requests: VecDeque::new(),
            handshakes: VecDeque::new(),
            accept_paused_until: None,
            exhaustion_reported: false,
            stats: Stats::default(),
        })
    }

    pub fn epoll(&self) -> &Epoll {
        &self.epoll
    }

    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    fn new_token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(FIRST_DYNAMIC_TOKEN);
        t
    }

    /// An epoll event for a token this muxer owns.
    pub fn handle_event(&mut self, token: u64, events: EventSet) {
        if token == LISTENER_TOKEN {
            self.accept_clients();
        } else if self.pending_clients.contains_key(&token) {
            self.read_connect_line(token);
        } else if let Some(&key) = self.tokens.get(&token) {
            if let Some(conn) = self.conns.get_mut(&key) {
                if events.intersects(EventSet::HANG_UP | EventSet::ERROR) {
                    conn.hung_up();
                }
                if events.contains(EventSet::IN) {
                    conn.readable = true;
                }
                if events.contains(EventSet::OUT) {
                    conn.flush_tx();
                }
            }
            self.sync(key);
        }
    }

    fn accept_clients(&mut self) {
        loop {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if is_out_of_descriptors(&e) => {
                    self.pause_accepting(&e);
                    return;
                }
                Err(e) => {
                    tracing::warn!("vsock: accept on {} failed: {e}", self.uds_path.display());
                    return;
                }
            };
            self.exhaustion_reported = false;
            if self.pending_clients.len() >= MAX_PENDING_CLIENTS
                || self.conns.len() >= MAX_CONNECTIONS
            {
                self.stats.refused_clients += 1;
                tracing::debug!("vsock: refusing a host client: too many connections");
                continue;
            }
            if let Err(e) = stream.set_nonblocking(true) {
                tracing::warn!("vsock: cannot make a host client non-blocking: {e}");
                continue;
            }
            let token = self.new_token();
            if let Err(e) = self.epoll.ctl(
                ControlOperation::Add,
                stream.as_raw_fd(),
                EpollEvent::new(EventSet::IN, token),
            ) {
                tracing::warn!("vsock: cannot poll a host client: {e}");
                continue;
            }
            self.pending_clients.insert(
                token,
                PendingClient {
                    stream,
                    line: Vec::new(),
                },
            );
            self.handshakes
                .push_back((Instant::now() + HANDSHAKE_TIMEOUT, token));
        }
    }

    /// Takes the listener out of epoll for [`ACCEPT_RETRY`]: the client stays in the
    /// backlog, and the worker neither spins on it nor stops serving live connections.
    fn pause_accepting(&mut self, error: &std::io::Error) {
        if !self.exhaustion_reported {
            self.exhaustion_reported = true;
            tracing::warn!(
                "vsock: cannot accept host clients on {}: {error}; they wait until \
                 connections close (raise the open files limit, `ulimit -n`, if this \
                 persists)",
                self.uds_path.display()
            );
        }
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Delete,
            self.listener.as_raw_fd(),
            EpollEvent::default(),
        ) {
            tracing::warn!("vsock: cannot pause the listener: {e}");
            return;
        }
        self.accept_paused_until = Some(Instant::now() + ACCEPT_RETRY);
    }

    /// The epoll timeout the worker should use: until the paused listener is due
    /// back or the oldest request or handshake expires, else none (-1).
    pub fn poll_timeout_ms(&self) -> i32 {
        let oldest_request = self.requests.front().map(|(expiry, _, _)| *expiry);
        let oldest_handshake = self.handshakes.front().map(|(expiry, _)| *expiry);
        match self
            .accept_paused_until
            .into_iter()
            .chain(oldest_request)
            .chain(oldest_handshake)
            .min()
        {
            Some(until) => {
                let left = until.saturating_duration_since(Instant::now());
                // Rounded up: a wait that ends early would find it not yet due.
                i32::try_from(left.as_millis() + 1).unwrap_or(i32::MAX)
            }
            None => -1,
        }
    }

    /// Ends what waited too long: handshakes and requests.
    pub fn expire_overdue(&mut self) {
        self.expire_handshakes();
        self.expire_requests();
    }

    /// Closes the host clients that did not send their `CONNECT` line within
    /// [`HANDSHAKE_TIMEOUT`].
    fn expire_handshakes(&mut self) {
        let now = Instant::now();
        while let Some(&(expiry, token)) = self.handshakes.front() {
            if expiry > now {
                return;
            }
            self.handshakes.pop_front();
            // Dropping the stream closes it (and takes it out of epoll).
            if let Some(client) = self.pending_clients.remove(&token) {
                self.stats.refused_clients += 1;
                tracing::debug!(
                    "vsock: a host client sent no CONNECT line within {} s ({} bytes of it)",
                    HANDSHAKE_TIMEOUT.as_secs_f32(),
                    client.line.len()
                );
            }
        }
    }

    /// Ends the host clients' requests the guest left unanswered for
    /// [`REQUEST_TIMEOUT`]: the client's socket is closed, and the guest is sent an RST
    /// in case it answers later.
    fn expire_requests(&mut self) {
        let now = Instant::now();
        while let Some(&(expiry, key, token)) = self.requests.front() {
            if expiry > now {
                return;
            }
            self.requests.pop_front();
            let unanswered = self
                .conns
                .get(&key)
                .is_some_and(|conn| conn.token == token && conn.state() == State::LocalInit);
            if unanswered {
                self.stats.expired_requests += 1;
                tracing::debug!(
                    "vsock: the guest did not answer the request for its port {} within {} s",
                    key.1,
                    REQUEST_TIMEOUT.as_secs_f32()
                );
                self.remove(key);
                self.queue_rst_between(key.0, key.1);
            }
        }
    }

    /// Puts a paused listener back into epoll once its rest is over.
    pub fn resume_accepting_if_due(&mut self) {
        let Some(until) = self.accept_paused_until else {
            return;
        };
        if Instant::now() < until {
            return;
        }
        match self.epoll.ctl(
            ControlOperation::Add,
            self.listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, LISTENER_TOKEN),
        ) {
            Ok(()) => self.accept_paused_until = None,
            Err(e) => {
                tracing::warn!("vsock: cannot resume the listener: {e}");
                self.accept_paused_until = Some(Instant::now() + ACCEPT_RETRY);
            }
        }
    }

    /// Reads the handshake a byte at a time, so no stream data is consumed with it.
    fn read_connect_line(&mut self, token: u64) {
        let Some(client) = self.pending_clients.get_mut(&token) else {
            return;
        };
        let mut byte = [0u8; 1];
        let done = loop {
            match client.stream.read(&mut byte) {
                Ok(0) => break Err(MuxerError::BadConnectLine("(closed)".into())),
                Ok(_) if byte[0] == b'\n' => break parse_connect(&client.line),
                Ok(_) if client.line.len() >= MAX_CONNECT_LINE => {
                    break Err(MuxerError::BadConnectLine(
                        String::from_utf8_lossy(&client.line).into_owned(),
                    ))
                }
                Ok(_) => client.line.push(byte[0]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => break Err(MuxerError::BadConnectLine(e.to_string())),
            }
        };
        let Some(client) = self.pending_clients.remove(&token) else {
            return;
        };
        let peer_port = match done {
            Ok(port) => port,
            Err(e) => {
                self.stats.refused_clients += 1;
                tracing::debug!("vsock: {e}");
                return; // dropping the stream closes it (and removes it from epoll)
            }
        };
        if self.conns.len() >= MAX_CONNECTIONS {
            self.stats.refused_clients += 1;
            tracing::debug!("vsock: {}", MuxerError::TooManyConnections);
            return;
        }
        let Some(local_port) = self.allocate_local_port(peer_port) else {
            self.stats.refused_clients += 1;
            return;
        };
        let mut conn =
            Connection::new_local(self.guest_cid, local_port, peer_port, client.stream, token);
        // Still registered (for IN) from the handshake.
        conn.registered = Some(EventSet::IN);
        self.insert(conn);
        self.requests.push_back((
            Instant::now() + REQUEST_TIMEOUT,
            (local_port, peer_port),
            token,
        ));
    }

    fn allocate_local_port(&mut self, peer_port: u32) -> Option<u32> {
        for _ in 0..=MAX_CONNECTIONS {
            let port = self.next_local_port;
            self.next_local_port = match port.checked_add(1) {
                Some(p) => p,
                None => FIRST_LOCAL_PORT,
            };
            if !self.conns.contains_key(&(port, peer_port)) {
                return Some(port);
            }
        }
        None
    }

    fn insert(&mut self, conn: Connection) {
        let key = (conn.local_port, conn.peer_port);
        if conn.opened_by_guest {
            self.guest_opened += 1;
        }
        self.tokens.insert(conn.token, key);
        self.conns.insert(key, conn);
        self.sync(key);
    }

    fn remove(&mut self, key: ConnKey) {
        if let Some(conn) = self.conns.remove(&key) {
            if conn.opened_by_guest {
                self.guest_opened = self.guest_opened.saturating_sub(1);
            }
            self.tokens.remove(&conn.token);
            if conn.registered.is_some() {
                // Closing the socket removes it too; this is for tidiness.
                let _ = self.epoll.ctl(
                    ControlOperation::Delete,
                    conn.stream.as_raw_fd(),
                    EpollEvent::default(),
                );
            }
            if conn.in_rx_ready {
                self.rx_ready.retain(|k| *k != key);
            }
        }
    }

    /// Brings a connection's epoll registration and ready-list membership up to date
    /// after anything touched it; removes dead connections.
    fn sync(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if conn.dead {
            self.remove(key);
            return;
        }
        // A hung-up socket stays readable forever: it leaves epoll and is drained
        // through the ready list.
        let want = if conn.hup {
            None
        } else {
            Some(conn.desired_interest())
        };
        if want != conn.registered {
            let fd = conn.stream.as_raw_fd();
            let result = match (conn.registered, want) {
                (Some(_), None) => {
                    self.epoll
                        .ctl(ControlOperation::Delete, fd, EpollEvent::default())
                }
                (None, Some(set)) => {
                    self.epoll
                        .ctl(ControlOperation::Add, fd, EpollEvent::new(set, conn.token))
                }
                (Some(_), Some(set)) => self.epoll.ctl(
                    ControlOperation::Modify,
                    fd,
                    EpollEvent::new(set, conn.token),
                ),
                (None, None) => Ok(()),
            };
            match result {
                Ok(()) => conn.registered = want,
                Err(e) => {
                    tracing::warn!("vsock: epoll_ctl for port {} failed: {e}", conn.local_port);
                    conn.reset();
                }
            }
        }
        if !conn.in_rx_ready && conn.wants_rx() {
            conn.in_rx_ready = true;
            self.rx_ready.push_back(key);
        }
    }

    /// Answers the guest's packet `to` with an RST.
    fn queue_rst(&mut self, to: &Header) {
        self.queue_rst_between(to.dst_port, to.src_port);
    }

    /// Queues an RST from the host's `local_port` to the guest's `peer_port`.
    fn queue_rst_between(&mut self, local_port: u32, peer_port: u32) {
        if self.rst_queue.len() >= MAX_PENDING_RSTS {
            self.stats.rsts_dropped += 1;
            return;
        }
        self.stats.resets_sent += 1;
        self.rst_queue.push_back(Header::to_guest(
            self.guest_cid,
            local_port,
            peer_port,
            Op::Rst,
        ));
    }

    /// A packet from the guest (already checked for CIDs and length).
    pub fn handle_guest_packet(&mut self, pkt: TxPacket) {
        let key = (pkt.hdr.dst_port, pkt.hdr.src_port);
        let op = match pkt.op() {
            Ok(op) => op,
            Err(e) => {
                self.stats.bad_packets += 1;
                tracing::debug!("vsock: bad packet from the guest: {e}");
                if let Some(conn) = self.conns.get_mut(&key) {
                    conn.reset();
                    self.sync(key);
                } else {
                    self.queue_rst(&pkt.hdr);
                }
                return;
            }
        };
        if let Some(conn) = self.conns.get_mut(&key) {
            if op == Op::Rst {
                tracing::debug!(
                    "vsock: {}:{}: the guest reset the connection ({} bytes from it unwritten)",
                    key.0,
                    key.1,
                    conn.unwritten()
                );
                self.remove(key);
                return;
            }
            if let Err(e) = conn.handle_guest(&pkt, op) {
                self.stats.bad_packets += 1;
                tracing::debug!("vsock: resetting {}:{}: {e}", key.0, key.1);
                conn.reset();
            }
            self.sync(key);
            return;
        }
        match op {
            Op::Request => self.guest_connect(&pkt.hdr),
            Op::Rst => {}
            _ => self.queue_rst(&pkt.hdr),
        }
    }

    /// The guest connects to host port `dst_port`: forward to `P_<port>`.
    fn guest_connect(&mut self, req: &Header) {
        if self.guest_opened >= MAX_GUEST_CONNECTIONS {
            self.stats.refused_guest_requests += 1;
            guest_log::guest_warn!(
                "vsock: {}",
                MuxerError::TooManyGuestConnections(req.dst_port)
            );
            self.queue_rst(req);
            return;
        }
        if self.conns.len() >= MAX_CONNECTIONS {
            tracing::debug!("vsock: {}", MuxerError::TooManyConnections);
            self.queue_rst(req);
            return;
        }
        let mut path = OsString::from(self.uds_path.as_os_str());
        path.push(format!("_{}", req.dst_port));
        let path = PathBuf::from(path);
        let stream = match connect_without_waiting(&path) {
            Ok(s) => s,
            Err(source) => {
                tracing::debug!("vsock: {}", MuxerError::Connect { path, source });
                self.queue_rst(req);
                return;
            }
        };
        let token = self.new_token();
        let conn = Connection::new_peer(self.guest_cid, req, stream, token);
        self.insert(conn);
    }

    /// Whether there is something for the guest's rx queue.
    pub fn has_pending_rx(&self) -> bool {
        !self.rst_queue.is_empty() || !self.rx_ready.is_empty()
    }

    /// The next packet for the guest, its payload read into `buf` (whose length is
    /// the most the receive buffer takes). Connections take turns.
    pub fn next_rx_packet(&mut self, buf: &mut [u8]) -> Option<(Header, usize)> {
        if let Some(hdr) = self.rst_queue.pop_front() {
            return Some((hdr, 0));
        }
        for _ in 0..self.rx_ready.len() {
            let key = self.rx_ready.pop_front()?;
            let Some(conn) = self.conns.get_mut(&key) else {
                continue;
            };
            conn.in_rx_ready = false;
            let out = conn.produce(buf);
            self.sync(key);
            if out.is_some() {
                return out;
            }
        }
        None
    }

    /// A packet could not be delivered (guest memory error): the connection is reset.
    pub fn delivery_failed(&mut self, hdr: &Header) {
        let key = (hdr.src_port, hdr.dst_port);
        if let Some(conn) = self.conns.get_mut(&key) {
            if conn.state() != State::Closing {
                conn.reset();
                self.sync(key);
            }
        }
    }
}

/// Connects to a host service's socket without ever putting the vsock thread to sleep:
/// a blocking connect to a listener whose backlog is full (a busy service, or a guest
/// piling up connections it then resets) waits until the service accepts, and every
/// connection of the VM with it. Non-blocking, such a connect is refused at once.
fn connect_without_waiting(path: &Path) -> std::io::Result<UnixStream> {
    let socket = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    socket.connect(&socket2::SockAddr::unix(path)?)?;
    Ok(UnixStream::from(std::os::fd::OwnedFd::from(socket)))
}

/// Whether `error` means the process or system has no file descriptor to spare.
fn is_out_of_descriptors(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// Parses `CONNECT <port>` (the newline already stripped).
fn parse_connect(line: &[u8]) -> Result<u32, MuxerError> {
    let bad = || MuxerError::BadConnectLine(String::from_utf8_lossy(line).into_owned());
    let text = std::str::from_utf8(line).map_err(|_| bad())?;
    let text = text.strip_suffix('\r').unwrap_or(text);
    let mut words = text.split_ascii_whitespace();
    match (words.next(), words.next(), words.next()) {
        (Some(cmd), Some(port), None) if cmd.eq_ignore_ascii_case("connect") => {
            port.parse::<u32>().map_err(|_| bad())
        }
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Set in the child process that runs the out-of-descriptors scenario alone: it
    /// lowers the process's open files limit, which would starve tests beside it.
    const FD_EXHAUSTION_CHILD: &str = "VSOCK_TEST_FD_EXHAUSTION_CHILD";

    #[test]
    fn out_of_descriptors_pauses_the_listener_instead_of_spinning() {
        if std::env::var_os(FD_EXHAUSTION_CHILD).is_some() {
            return out_of_descriptors_scenario();
        }
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "devices::virtio::vsock::muxer::tests::out_of_descriptors_pauses_the_listener_instead_of_spinning",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(FD_EXHAUSTION_CHILD, "1")
            .output()
            .unwrap();
        let report = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && report.contains("1 passed"),
            "the scenario failed in its own process: {report}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    fn out_of_descriptors_scenario() {
        let dir = std::env::temp_dir().join(format!("vsock-emfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("v.sock");
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let mut muxer = Muxer::new(3, &path, Arc::new(listener)).unwrap();
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: both calls get a pointer to a live, properly aligned rlimit.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
            limit.rlim_cur = 64;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
        // Fill the descriptor table, leaving one for the client.
        let mut filler = Vec::new();
        while let Ok(file) = std::fs::File::open("/dev/null") {
            filler.push(file);
        }
        filler.pop();
        let _client = UnixStream::connect(&path).unwrap();

        let mut events = [EpollEvent::default(); 8];
        assert_eq!(muxer.epoll().wait(0, &mut events).unwrap(), 1);
        muxer.handle_event(LISTENER_TOKEN, EventSet::IN);
        assert!(muxer.pending_clients.is_empty());
        assert_eq!(
            muxer.epoll().wait(0, &mut events).unwrap(),
            0,
            "the listener must leave epoll, or the worker spins on it"
        );
        assert!(muxer.poll_timeout_ms() > 0);

        drop(filler);
        muxer.resume_accepting_if_due();
        assert_eq!(
            muxer.epoll().wait(0, &mut events).unwrap(),
            0,
            "resumed early"
        );
        let timeout = muxer.poll_timeout_ms();
        assert!(muxer.epoll().wait(timeout, &mut events).unwrap() == 0);
        muxer.resume_accepting_if_due();
        assert_eq!(muxer.poll_timeout_ms(), -1);
        assert_eq!(muxer.epoll().wait(0, &mut events).unwrap(), 1);
        muxer.handle_event(LISTENER_TOKEN, EventSet::IN);
        assert_eq!(
            muxer.pending_clients.len(),
            1,
            "the waiting client is accepted"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_client_that_never_finishes_its_connect_line_is_closed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let mut muxer = Muxer::new(3, &path, Arc::new(listener)).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        client.write_all(b"CONNECT 5").unwrap();
        muxer.handle_event(LISTENER_TOKEN, EventSet::IN);
        let token = *muxer.pending_clients.keys().next().unwrap();
        muxer.handle_event(token, EventSet::IN);
        assert_eq!(
            muxer.pending_clients.len(),
            1,
            "half a line is no handshake"
        );
        let timeout = muxer.poll_timeout_ms();
        assert!(
            timeout > 0 && u128::from(timeout.unsigned_abs()) <= HANDSHAKE_TIMEOUT.as_millis() + 1
        );

        muxer.expire_overdue();
        assert_eq!(muxer.pending_clients.len(), 1, "expired early");
        std::thread::sleep(HANDSHAKE_TIMEOUT + Duration::from_millis(50));
        muxer.expire_overdue();
        assert!(muxer.pending_clients.is_empty());
        assert_eq!(muxer.stats.refused_clients, 1);
        assert_eq!(muxer.poll_timeout_ms(), -1);
        let mut rest = Vec::new();
        assert_eq!(client.read_to_end(&mut rest).unwrap(), 0, "closed");
    }

    #[test]
    fn connect_lines() {
        assert_eq!(parse_connect(b"CONNECT 52").unwrap(), 52);
        assert_eq!(parse_connect(b"CONNECT 4294967295\r").unwrap(), u32::MAX);
        assert_eq!(parse_connect(b"connect  7").unwrap(), 7);
        for bad in [
            &b"CONNECT"[..],
            b"CONNECT -1",
            b"CONNECT 4294967296",
            b"CONNECT 1 2",
            b"LISTEN 1",
            b"",
            b"\xff\xfe",
        ] {
            assert!(parse_connect(bad).is_err(), "{bad:?}");
        }
    }
}
