//! The agent's server: accepts connections (vsock or Unix socket), runs one request
//! per connection, and runs commands (`Exec`) with pipes or a pseudo-terminal.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, TryLockError};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot, watch, Notify, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

use crate::cgroups::{ExecCgroup, ExecCgroups};
use crate::clock;
use crate::host_edits::HostEditTarget;
use crate::idle_caches::{self, Activity};
use crate::network::{self, Network};
use crate::protocol::{
    write_frame, AgentMessage, ClientMessage, ExecRequest, FrameReader, HealthInfo, HostEdit,
    NetworkConfig, OutputStream, ProtocolError, TtyRequest, User, AGENT_VERSION, PROTOCOL_VERSION,
    STDIN_WINDOW, UNSUPPORTED_VERSION,
};
use crate::users::{self, Account};

/// Errors of the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("cannot bind {what}: {source}")]
    Bind { what: String, source: io::Error },
    #[error("{0}")]
    User(#[from] users::UserError),
    #[error("cannot start the command: {0}")]
    Spawn(io::Error),
    /// The program could not be run, in a shell's words, with a shell's exit code.
    #[error("{message}")]
    NotRunnable { message: String, exit_code: u8 },
    #[error("invalid exec request: {0}")]
    BadRequest(String),
}

/// The open files limit commands start with (the agent's own is higher), as on a
/// Debian host: `select()` users count on no descriptor past 1,023.
pub const COMMAND_OPEN_FILES: libc::rlim_t = 1024;
/// The hard open files limit of the agent and its commands (systemd's default).
pub const OPEN_FILES_CEILING: libc::rlim_t = 524_288;

/// How long the client has to send `Hello` and its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Output messages queued towards the client before output reading pauses (each at
/// most [`OUTPUT_READ_SIZE`] bytes).
const OUTPUT_QUEUE: usize = 8;
const OUTPUT_READ_SIZE: usize = 32 * 1024;
/// After the command exits, what its outputs (pipes or terminal) held then is always
/// forwarded, however slowly the client reads it. Past that, whatever processes it
/// left behind write there is forwarded until end of file, this long without data,
/// or [`DRAIN_MAX`] after the exit, whichever comes first: a background process may
/// keep the outputs open forever.
const DRAIN_IDLE: Duration = Duration::from_millis(250);
/// The longest the session waits for more output after the command exited. Without
/// it, a job left behind that writes more often than every [`DRAIN_IDLE`] (a
/// `while :; do echo tick; sleep 0.1; done &`) kept the session, and the client
/// waiting for `Exited`, forever. Long enough for a command's children that finish
/// writing just after it (a pipeline's last stage) to be heard.
const DRAIN_MAX: Duration = Duration::from_secs(2);
/// Between SIGHUP and SIGKILL when the client goes away.
const KILL_GRACE: Duration = Duration::from_secs(1);
pub(crate) const DEFAULT_PATH: &str =
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The host user the VM was configured with (`vmctl.user=NAME:UID:GID:HOME`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// Server settings.
#[derive(Debug, Clone, Default)]
pub struct ServerConfig {
    /// Who `User::Default` is; root when `None`.
    pub default_user: Option<HostUser>,
    /// Reap every child (`waitpid(-1)`), as PID 1 must; otherwise only our commands.
    pub reap_all: bool,
    /// Step the clock to the host's time each `Hello` carries (see [`crate::clock`]):
    /// the VM's init does, an agent running on some machine for tests must not.
    pub follow_host_clock: bool,
    /// The network side (`ConfigureNetwork`, `ConnectPort`); the default writes the
    /// guest's real files and reaches the host over vsock. Shared so that tests can
    /// look at it (e.g. [`Network::egress_addr`]).
    pub network: Arc<Network>,
    /// The writable shares, where `HostEdits` are shown (none by default).
    pub host_edits: Arc<HostEditTarget>,
    /// Where each command gets a cgroup of its own, which a client that goes away
    /// has killed whole; without it (the default), its process group only is.
    pub exec_cgroups: Option<Arc<ExecCgroups>>,
    /// Drop the guest's caches once no command has run for this long (see
    /// [`crate::idle_caches`]); never when `None` (the default).
    pub drop_caches_after_idle: Option<Duration>,
}

/// Where the agent listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Vsock(u32),
    Unix(PathBuf),
}

impl std::str::FromStr for ListenAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            Ok(ListenAddr::Unix(PathBuf::from(p)))
        } else if let Some(p) = s.strip_prefix("vsock:") {
            p.parse()
                .map(ListenAddr::Vsock)
                .map_err(|e| format!("bad vsock port '{p}': {e}"))
        } else {
            Err(format!("expected unix:PATH or vsock:PORT, got '{s}'"))
        }
    }
}

/// Dispatches exit statuses to the exec sessions waiting for them. There is one
/// reaper per server; as PID 1 it also reaps orphans.
struct Reaper {
    /// Read-held over each spawn, until its pid is registered: std waits on a child
    /// whose exec failed itself, and a new child's status must not be taken before
    /// someone waits for it, so no reap-any-child sweep (`waitpid(-1)`) may run then.
    /// Spawns do not wait for each other: one exec stuck on a share holds no other up.
    spawning: RwLock<()>,
    /// The sessions waiting for their command's exit status, by pid; held briefly.
    waiting: Mutex<HashMap<i32, oneshot::Sender<i32>>>,
    reap_all: bool,
}

impl Reaper {
    fn new(reap_all: bool) -> Self {
        Self {
            spawning: RwLock::new(()),
            waiting: Mutex::new(HashMap::new()),
            reap_all,
        }
    }

    fn waiting(&self) -> MutexGuard<'_, HashMap<i32, oneshot::Sender<i32>>> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Spawns `cmd` and registers its pid before any sweep can reap it; the receiver
    /// gets its wait status.
    fn spawn(
        &self,
        cmd: &mut Command,
    ) -> io::Result<(std::process::Child, oneshot::Receiver<i32>)> {
        let _spawning = self.spawning.read().unwrap_or_else(PoisonError::into_inner);
        let child = cmd.spawn()?;
        let (tx, rx) = oneshot::channel();
        self.waiting().insert(child.id() as i32, tx);
        Ok((child, rx))
    }

    /// Collects every exit status available now. While a spawn is under way (it may
    /// wait long on a share), only the registered commands are reaped, each by its
    /// pid; orphans wait for a later sweep.
    fn reap(&self) {
        let sweep = if self.reap_all {
            match self.spawning.try_write() {
                Ok(guard) => Some(guard),
                Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            }
        } else {
            None
        };
        let mut waiting = self.waiting();
        if sweep.is_some() {
            loop {
                let mut status = 0;
                // SAFETY: waitpid with a valid pointer to a local int.
                let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
                if pid <= 0 {
                    break;
                }
                match waiting.remove(&pid) {
                    Some(tx) => {
                        let _ = tx.send(status);
                    }
                    None => debug!(pid, status, "reaped orphan"),
                }
            }
        } else {
            let pids: Vec<i32> = waiting.keys().copied().collect();
            for pid in pids {
                let mut status = 0;
                // SAFETY: waitpid on our own child with a valid pointer to a local int.
                let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                if r == pid {
                    if let Some(tx) = waiting.remove(&pid) {
                        let _ = tx.send(status);
                    }
                } else if r < 0 {
                    // Not our child any more (should not happen): report it as killed.
                    if let Some(tx) = waiting.remove(&pid) {
                        let _ = tx.send(libc::SIGKILL);
                    }
                }
            }
        }
    }
}

/// Shared state of a running server.
struct State {
    config: ServerConfig,
    reaper: Reaper,
    started: Instant,
    /// Commands running and started, for the health report and the idle watch.
    activity: Arc<Activity>,
    shutdown: Notify,
    shutdown_requested: std::sync::atomic::AtomicBool,
    /// The last `Hello` that found the guest's clock ahead (see [`clock`]).
    clock_ahead_seen: clock::AheadSeen,
    refused_peers: RefusedPeers,
    /// Whether a command was started without its cgroup yet: warned of on the console
    /// once, at debug level after that (a cgroup that cannot be made fails for every
    /// command alike).
    cgroup_failure_warned: std::sync::atomic::AtomicBool,
}

/// A bound listener.
pub enum Listener {
    Vsock(tokio_vsock::VsockListener),
    Unix(tokio::net::UnixListener),
}

impl Listener {
    /// Binds `addr` (must run inside a tokio runtime).
    pub fn bind(addr: &ListenAddr) -> Result<Self, ServerError> {
        match addr {
            ListenAddr::Vsock(port) => {
                let a = tokio_vsock::VsockAddr::new(tokio_vsock::VMADDR_CID_ANY, *port);
                tokio_vsock::VsockListener::bind(a)
                    .map(Listener::Vsock)
                    .map_err(|source| ServerError::Bind {
                        what: format!("vsock port {port}"),
                        source,
                    })
            }
            ListenAddr::Unix(path) => {
                let _ = std::fs::remove_file(path);
                tokio::net::UnixListener::bind(path)
                    .map(Listener::Unix)
                    .map_err(|source| ServerError::Bind {
                        what: path.display().to_string(),
                        source,
                    })
            }
        }
    }
}

/// Serves connections until a client sends `Shutdown`; then returns (the caller
/// powers off). Accept errors are logged and retried.
pub async fn serve(listener: Listener, config: ServerConfig) -> Result<(), ServerError> {
    let state = Arc::new(State {
        reaper: Reaper::new(config.reap_all),
        config,
        started: Instant::now(),
        activity: Arc::default(),
        shutdown: Notify::new(),
        shutdown_requested: Default::default(),
        clock_ahead_seen: clock::AheadSeen::default(),
        refused_peers: RefusedPeers::default(),
        cgroup_failure_warned: Default::default(),
    });
    // SIGCHLD → reap. Registered before any command starts, so none is missed; a
    // periodic sweep covers anything odd (several runtimes in one test process).
    let mut sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())?;
    let reaper_state = state.clone();
    let reaper = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                _ = sigchld.recv() => {}
                _ = tick.tick() => {}
            }
            reaper_state.reaper.reap();
        }
    });
    let idle_watch = state
        .config
        .drop_caches_after_idle
        .map(|after| tokio::spawn(idle_caches::watch(state.activity.clone(), after)));
    let result = loop {
        let accepted: io::Result<Box<dyn Stream>> = tokio::select! {
            _ = state.shutdown.notified() => break Ok(()),
            r = accept(&listener, &state.refused_peers) => r,
        };
        match accepted {
            Ok(stream) => {
                let state = state.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle_connection(stream, state).await {
                        debug!("connection ended with an error: {e}");
                    }
                });
            }
            Err(e) => {
                warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    reaper.abort();
    if let Some(idle_watch) = idle_watch {
        idle_watch.abort();
    }
    result
}

/// A connection's byte stream.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

/// Accepts the next connection to serve. On vsock that is the host's only (see
/// [`accept_from_host`]).
async fn accept(listener: &Listener, refused: &RefusedPeers) -> io::Result<Box<dyn Stream>> {
    match listener {
        Listener::Vsock(l) => Ok(Box::new(accept_from_host(l, refused).await?)),
        Listener::Unix(l) => Ok(Box::new(l.accept().await?.0)),
    }
}

/// A listener whose connections come with their peer's vsock CID and port.
trait PeerListener {
    type Connection: Stream;
    async fn accept_with_peer(&self) -> io::Result<(Self::Connection, u32, u32)>;
}

impl PeerListener for tokio_vsock::VsockListener {
    type Connection = tokio_vsock::VsockStream;
    async fn accept_with_peer(&self) -> io::Result<(Self::Connection, u32, u32)> {
        let (stream, peer) = self.accept().await?;
        Ok((stream, peer.cid(), peer.port()))
    }
}

/// The next connection from the host. A guest process can reach the listener too,
/// through vsock loopback (CID 1, or the guest's own CID), and would run commands as
/// root: such connections are closed at once, before a byte is read.
async fn accept_from_host<L: PeerListener>(
    listener: &L,
    refused: &RefusedPeers,
) -> io::Result<L::Connection> {
    loop {
        let (stream, cid, port) = listener.accept_with_peer().await?;
        match vsock_peer(cid) {
            VsockPeer::Host => return Ok(stream),
            other => {
                refused.note(other, cid, port);
                // Closed unread: the guest process sees the connection end.
                drop(stream);
            }
        }
    }
}

/// Who is at the other end of a vsock connection, as its CID says. The transport
/// sets the CID, so a guest process cannot claim the host's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum VsockPeer {
    /// `VMADDR_CID_HOST`: the VMM, on behalf of vmctl. The only peer served.
    Host,
    /// `VMADDR_CID_LOCAL`: a process of this guest, through vsock loopback.
    Loopback,
    /// Any other CID: this guest's own (loopback again), the hypervisor's, or another
    /// VM's.
    Other,
}

impl VsockPeer {
    fn describe(self) -> &'static str {
        match self {
            VsockPeer::Host => "the host",
            VsockPeer::Loopback => "this guest through vsock loopback (CID 1)",
            VsockPeer::Other => "a CID other than the host's (the guest's own, or another VM's)",
        }
    }
}

fn vsock_peer(cid: u32) -> VsockPeer {
    match cid {
        tokio_vsock::VMADDR_CID_HOST => VsockPeer::Host,
        tokio_vsock::VMADDR_CID_LOCAL => VsockPeer::Loopback,
        _ => VsockPeer::Other,
    }
}

/// The refused vsock peers: each kind is warned of once, on the console, and at
/// debug level after that, so that a guest process connecting in a loop cannot flood
/// the console.
#[derive(Default)]
struct RefusedPeers {
    loopback_warned: std::sync::atomic::AtomicBool,
    other_warned: std::sync::atomic::AtomicBool,
}

impl RefusedPeers {
    /// Logs a refused connection; whether it was warned of (the first of its kind).
    fn note(&self, peer: VsockPeer, cid: u32, port: u32) -> bool {
        let warned = match peer {
            VsockPeer::Host => return false,
            VsockPeer::Loopback => &self.loopback_warned,
            VsockPeer::Other => &self.other_warned,
        };
        let kind = peer.describe();
        if warned.swap(true, Ordering::Relaxed) {
            debug!(cid, port, "refused a vsock connection from {kind}");
            false
        } else {
            warn!(
                cid,
                port,
                "refused a vsock connection from {kind}: only the host may talk to the \
                 agent (further ones of this kind are logged at debug level)"
            );
            true
        }
    }
}

/// The most characters of a message the agent sends about a failure. Messages quote
/// what the peer sent (an environment variable's name, a program's), which may take
/// up to a whole frame, and grow when quoted (`\0` for a NUL, U+FFFD for a byte that
/// is not UTF-8): cut, the reply always fits in a frame.
const MAX_MESSAGE_CHARS: usize = 400;

/// `message`, cut to [`MAX_MESSAGE_CHARS`] (with `…` where it was cut).
fn clipped(message: String) -> String {
    match message.char_indices().nth(MAX_MESSAGE_CHARS) {
        None => message,
        Some((cut, _)) => format!("{}…", &message[..cut]),
    }
}

/// An `Error` reply, its message cut to fit in a frame.
fn error_reply(message: String) -> AgentMessage {
    AgentMessage::Error {
        message: clipped(message),
    }
}

/// Replies `Error` and closes the sending side (failures are moot: the peer is gone).
async fn send_error<W: AsyncWrite + Unpin>(w: &mut W, message: String) -> Result<(), ServerError> {
    let message = clipped(message);
    debug!("replying with an error: {message}");
    reply_and_close(w, &AgentMessage::Error { message }).await
}

/// Sends `reply`, the connection's last message, and closes it.
async fn reply_and_close<W: AsyncWrite + Unpin>(
    w: &mut W,
    reply: &AgentMessage,
) -> Result<(), ServerError> {
    if let Err(e) = write_frame(w, reply).await {
        debug!("the last reply was not sent: {e}");
    }
    let _ = w.shutdown().await;
    Ok(())
}

/// A clock that cannot be set costs the guest only its accuracy: said, not fatal.
fn follow_host_clock(host_time_ns: u64, ahead_seen: &clock::AheadSeen) {
    match clock::follow_host(host_time_ns, ahead_seen) {
        Ok(None) => {}
        Ok(Some(step)) => info!("the guest's clock {step}"),
        Err(e) => warn!("{e}"),
    }
}

async fn handle_connection(stream: Box<dyn Stream>, state: Arc<State>) -> Result<(), ServerError> {
    let (r, mut w) = tokio::io::split(stream);
    let mut reader = FrameReader::new(r);
    let hello = match tokio::time::timeout(REQUEST_TIMEOUT, reader.next::<ClientMessage>()).await {
        Err(_) => return send_error(&mut w, "timed out waiting for Hello".into()).await,
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => return send_error(&mut w, e.to_string()).await,
        Ok(Ok(Some(m))) => m,
    };
    match hello {
        ClientMessage::Hello(h) if h.protocol_version == PROTOCOL_VERSION => {
            debug!(client = %h.client, "hello");
            if state.config.follow_host_clock {
                if let Some(host_time_ns) = h.host_time_ns {
                    follow_host_clock(host_time_ns, &state.clock_ahead_seen);
                }
            }
            write_frame(
                &mut w,
                &AgentMessage::HelloOk {
                    agent_version: AGENT_VERSION.into(),
                    protocol_version: PROTOCOL_VERSION,
                },
            )
            .await?;
        }
        ClientMessage::Hello(h) => {
            let msg = format!(
                "{UNSUPPORTED_VERSION} {} (this agent {AGENT_VERSION} speaks {PROTOCOL_VERSION})",
                h.protocol_version
            );
            return send_error(&mut w, msg).await;
        }
        _ => return send_error(&mut w, "the first message must be Hello".into()).await,
    }
    let request = match tokio::time::timeout(REQUEST_TIMEOUT, reader.next::<ClientMessage>()).await
    {
        Err(_) => return send_error(&mut w, "timed out waiting for a request".into()).await,
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => return send_error(&mut w, e.to_string()).await,
        Ok(Ok(Some(m))) => m,
    };
    match request {
        ClientMessage::Exec(req) => run_exec(req, reader, w, state).await,
        ClientMessage::Health => {
            let info = health(&state);
            write_frame(&mut w, &AgentMessage::Healthy(info)).await?;
            let _ = w.shutdown().await;
            Ok(())
        }
        ClientMessage::ListPorts => {
            match crate::ports::listening_ports() {
                Ok(p) => write_frame(&mut w, &AgentMessage::Ports(p)).await?,
                Err(e) => send_error(&mut w, e.to_string()).await?,
            }
            let _ = w.shutdown().await;
            Ok(())
        }
        ClientMessage::ConfigureNetwork(config) => configure_network(&config, w, &state).await,
        ClientMessage::ConnectPort(port) => connect_port(port, reader, w).await,
        ClientMessage::HostEdits(edits) => show_host_edits(edits, reader, w, &state).await,
        ClientMessage::Shutdown => {
            info!("shutdown requested");
            write_frame(&mut w, &AgentMessage::Ok).await?;
            let _ = w.shutdown().await;
            state.shutdown_requested.store(true, Ordering::SeqCst);
            state.shutdown.notify_one();
            Ok(())
        }
        other => {
            let name = format!("{other:?}");
            let name = name
                .split(['(', ' ', '{'])
                .next()
                .unwrap_or("?")
                .to_string();
            send_error(
                &mut w,
                format!("unexpected {name} message: expected a request"),
            )
            .await
        }
    }
}

/// Shows batches of host edits until the host closes the connection; the supervisor
/// keeps it open for the VM's life, so no batch waits for a new connection.
async fn show_host_edits<R, W>(
    mut edits: Vec<HostEdit>,
    mut reader: FrameReader<R>,
    mut w: W,
    state: &State,
) -> Result<(), ServerError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    loop {
        let target = state.config.host_edits.clone();
        // Touching goes through virtiofsd: blocking calls, kept off the runtime.
        let shown = tokio::task::spawn_blocking(move || target.show(&edits))
            .await
            .unwrap_or_default();
        write_frame(&mut w, &AgentMessage::EditsShown(shown)).await?;
        edits = match reader.next::<ClientMessage>().await {
            Ok(Some(ClientMessage::HostEdits(next))) => next,
            Ok(None) => return Ok(()),
            Ok(Some(_)) => {
                return send_error(&mut w, "expected HostEdits on this connection".into()).await
            }
            Err(e) => return send_error(&mut w, e.to_string()).await,
        };
    }
}

async fn configure_network<W: AsyncWrite + Unpin>(
    config: &NetworkConfig,
    mut w: W,
    state: &State,
) -> Result<(), ServerError> {
    match state.config.network.configure(config) {
        Ok(failed_relays) => {
            for (port, why) in &failed_relays {
                warn!(port, "relay not set up: {why}");
            }
            write_frame(&mut w, &AgentMessage::NetworkConfigured { failed_relays }).await?;
            let _ = w.shutdown().await;
            Ok(())
        }
        Err(e) => send_error(&mut w, format!("network configuration failed: {e}")).await,
    }
}

/// `ConnectPort`: after `Connected`, this connection carries the guest TCP
/// connection's bytes.
async fn connect_port(
    port: u16,
    reader: FrameReader<tokio::io::ReadHalf<Box<dyn Stream>>>,
    mut w: tokio::io::WriteHalf<Box<dyn Stream>>,
) -> Result<(), ServerError> {
    let tcp = match network::relay::connect_guest_port(port).await {
        Ok(t) => t,
        Err(e) => return send_error(&mut w, e.to_string()).await,
    };
    write_frame(&mut w, &AgentMessage::Connected).await?;
    // Bytes the frame reader already took past the request belong to the TCP stream.
    let (r, pending) = reader.into_parts();
    network::relay::forward(r.unsplit(w), pending, tcp).await;
    Ok(())
}

pub(crate) fn read_kib_field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The agent's resident set size in bytes (`VmRSS` of `/proc/self/status`).
pub fn agent_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    read_kib_field(&status, "VmRSS:") * 1024
}

fn health(state: &State) -> HealthInfo {
    let uptime_ms = std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .next()
                .and_then(|f| f.parse::<f64>().ok())
        })
        .map(|secs| (secs * 1000.0) as u64)
        .unwrap_or(0);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    HealthInfo {
        agent_version: AGENT_VERSION.into(),
        uptime_ms,
        agent_uptime_ms: state.started.elapsed().as_millis() as u64,
        agent_rss_bytes: agent_rss_bytes(),
        active_execs: state.activity.running.load(Ordering::Relaxed),
        mem_total_kib: read_kib_field(&meminfo, "MemTotal:"),
        mem_available_kib: read_kib_field(&meminfo, "MemAvailable:"),
    }
}

// ---------------------------------------------------------------------------
// Exec

/// Where the command's stdin goes.
enum StdinSink {
    Pipe(pipe::Sender),
    Pty(Arc<AsyncFd<OwnedFd>>),
}

/// Where the command's output comes from.
enum OutputSource {
    Pipe(pipe::Receiver),
    Pty(Arc<AsyncFd<OwnedFd>>),
}

struct Spawned {
    pid: i32,
    exit: oneshot::Receiver<i32>,
    stdin: StdinSink,
    stdout: OutputSource,
    stderr: Option<OutputSource>,
    pty: Option<Arc<AsyncFd<OwnedFd>>>,
    /// Kept until the session ends, so that it is not swept while the command runs.
    cgroup: Option<ExecCgroup>,
}

fn resolve_user(user: &User, config: &ServerConfig) -> Result<Account, ServerError> {
    match user {
        User::Root => Ok(users::root()),
        User::Named(name) => Ok(users::lookup(name)?),
        User::Default => match &config.default_user {
            None => Ok(users::root()),
            // The host user's ids, always: an account of that name the image already
            // had (another uid) would make the shares look owned by someone else.
            Some(h) => Ok(match users::lookup(&h.name) {
                Ok(account) if account.uid == h.uid && account.gid == h.gid => account,
                found => Account {
                    name: h.name.clone(),
                    uid: h.uid,
                    gid: h.gid,
                    home: h.home.clone(),
                    shell: found.map_or_else(|_| "/bin/sh".into(), |account| account.shell),
                    groups: vec![h.gid],
                },
            }),
        },
    }
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own; no pointers involved.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    Ok(())
}

fn winsize(rows: u16, cols: u16) -> libc::winsize {
    libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// Opens a pseudo-terminal of the requested size: (master, slave). Both ends are
/// close-on-exec from the start: another session may spawn its command at any
/// moment, and that command must not inherit this terminal (it could type into it,
/// and would keep it from hanging up).
fn open_pty(tty: &TtyRequest) -> io::Result<(OwnedFd, OwnedFd)> {
    // SAFETY: posix_openpt takes flags only and returns a new descriptor or -1.
    let master =
        cvt(unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) })?;
    // SAFETY: posix_openpt succeeded, so the descriptor is open and nobody else owns it.
    let master = unsafe { OwnedFd::from_raw_fd(master) };
    // SAFETY: grantpt and unlockpt take a descriptor we own; no pointers involved.
    cvt(unsafe { libc::grantpt(master.as_raw_fd()) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::unlockpt(master.as_raw_fd()) })?;
    // SAFETY: TIOCGPTPEER takes the flags of the new descriptor and returns it or -1.
    let slave = cvt(unsafe {
        libc::ioctl(
            master.as_raw_fd(),
            libc::TIOCGPTPEER as _,
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    })?;
    // SAFETY: the ioctl succeeded, so the descriptor is open and nobody else owns it.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    let ws = winsize(tty.rows, tty.cols);
    // SAFETY: TIOCSWINSZ reads one winsize from a live local.
    cvt(unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCSWINSZ, &ws) })?;
    accept_utf8_input(&slave)?;
    Ok((master, slave))
}

/// Sets IUTF8, as sshd does for a UTF-8 client: without it, a backspace in a line
/// being typed erases one byte of a multi-byte character, not the character.
fn accept_utf8_input(slave: &OwnedFd) -> io::Result<()> {
    // SAFETY: an all-zero termios is a valid value for tcgetattr to overwrite.
    let mut settings: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: tcgetattr writes one termios into a live local.
    cvt(unsafe { libc::tcgetattr(slave.as_raw_fd(), &mut settings) })?;
    settings.c_iflag |= libc::IUTF8;
    // SAFETY: tcsetattr reads one termios from a live local.
    cvt(unsafe { libc::tcsetattr(slave.as_raw_fd(), libc::TCSANOW, &settings) })?;
    Ok(())
}

/// Makes the terminal `slave` the command's, as a login would: owned by its user and
/// the `tty` group, mode 0620 (or 0600 to its own group without a `tty` group). The
/// agent opened it, so it was root's, and a command running as another user could not
/// open its own terminal by name (`$(tty)`: gpg's pinentry, `screen`).
fn give_terminal_to(slave: &OwnedFd, account: &Account) -> io::Result<()> {
    let (group, mode) = match users::group_id("tty") {
        Some(tty) => (tty, 0o620),
        None => (account.gid, 0o600),
    };
    // SAFETY: fchown and fchmod on a descriptor we own; no pointers involved.
    cvt(unsafe { libc::fchown(slave.as_raw_fd(), account.uid, group) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fchmod(slave.as_raw_fd(), mode) })?;
    Ok(())
}

/// Every command's locale unless its request names one.
const DEFAULT_LANG: &str = "C.UTF-8";

fn spawn(req: &ExecRequest, state: &State) -> Result<Spawned, ServerError> {
    // Arguments, values and the directory are bytes, which need not be UTF-8.
    let Some((program, args)) = req.argv.split_first() else {
        return Err(ServerError::BadRequest("argv is empty".into()));
    };
    let program = OsStr::from_bytes(program);
    let account = resolve_user(&req.user, &state.config)?;
    let mut cmd = Command::new(program);
    cmd.args(args.iter().map(|arg| OsStr::from_bytes(arg)));
    cmd.env_clear()
        .env("PATH", DEFAULT_PATH)
        .env("HOME", &account.home)
        .env("USER", &account.name)
        .env("LOGNAME", &account.name)
        .env("SHELL", &account.shell)
        // UTF-8, as an ssh session gets from the host's LANG: without it `ls`, less and
        // vim show every non-ASCII name as escapes. The image's one locale is glibc's
        // built-in C.UTF-8; the request's LANG or LC_* still win.
        .env("LANG", DEFAULT_LANG);
    if let Some(tty) = &req.tty {
        cmd.env("TERM", &tty.term);
    }
    // The network's variables (proxy, CA paths), which the request's own override.
    for (k, v) in state.config.network.env() {
        cmd.env(k, v);
    }
    for (k, v) in &req.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains(&0) {
            return Err(ServerError::BadRequest(format!(
                "invalid environment variable {k:?}"
            )));
        }
        cmd.env(k, OsStr::from_bytes(v));
    }
    // A working directory the guest does not have (a host directory outside the
    // shares) falls back to the home directory; one that exists but cannot be used
    // (a share whose server died: EIO) is an error, never a silent move elsewhere.
    let asked_cwd = req
        .cwd
        .as_deref()
        .map(|dir| Path::new(OsStr::from_bytes(dir)));
    if let Some(dir) = asked_cwd {
        match std::fs::metadata(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(ServerError::BadRequest(format!(
                    "cannot use the working directory {}: {e}",
                    dir.display()
                )));
            }
            _ => {}
        }
    }
    let cwd = asked_cwd
        .filter(|c| c.is_dir())
        .unwrap_or(Path::new(&account.home));
    if cwd.is_dir() {
        cmd.current_dir(cwd);
    } else {
        cmd.current_dir("/");
    }

    let pty = match &req.tty {
        Some(tty) => {
            let (master, slave) = open_pty(tty).map_err(ServerError::Spawn)?;
            give_terminal_to(&slave, &account).map_err(ServerError::Spawn)?;
            let s1 = slave.try_clone().map_err(ServerError::Spawn)?;
            let s2 = slave.try_clone().map_err(ServerError::Spawn)?;
            cmd.stdin(Stdio::from(slave))
                .stdout(Stdio::from(s1))
                .stderr(Stdio::from(s2));
            Some(master)
        }
        None => {
            cmd.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            None
        }
    };

    // Without its cgroup, a command is still killed by process group: said, not fatal.
    let cgroup = state
        .config
        .exec_cgroups
        .as_ref()
        .and_then(|cgroups| match cgroups.create() {
            Ok(cgroup) => Some(cgroup),
            Err(e) => {
                if state.cgroup_failure_warned.swap(true, Ordering::Relaxed) {
                    debug!("{e}: started without its cgroup");
                } else {
                    warn!(
                        "{e}: this command's processes outside its process group will \
                         outlive a client that goes away (further such failures are \
                         logged at debug level)"
                    );
                }
                None
            }
        });
    let joiner = cgroup.as_ref().map(ExecCgroup::joiner);
    let groups: Vec<libc::gid_t> = account.groups.clone();
    let (uid, gid) = (account.uid, account.gid);
    let want_ctty = pty.is_some();
    let umask = req.umask.map(|mask| (mask & 0o777) as libc::mode_t);
    let change_ids = uid != 0 || gid != 0 || groups.iter().any(|g| *g != 0);
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (no allocation: `groups` and the cgroup's path
    // were built before fork).
    unsafe {
        cmd.pre_exec(move || {
            // First, as root. A failure leaves the command in the agent's cgroup,
            // which the parent finds and says (`in_its_cgroup`).
            if let Some(joiner) = &joiner {
                let _ = joiner.join();
            }
            // A new session: the command leads its own process group, so signals and
            // the disconnect kill reach the whole group.
            cvt(libc::setsid())?;
            // Lowered only if the agent's is higher (it raised it as PID 1).
            let mut open_files = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut open_files) == 0
                && open_files.rlim_cur > COMMAND_OPEN_FILES
            {
                open_files.rlim_cur = COMMAND_OPEN_FILES;
                cvt(libc::setrlimit(libc::RLIMIT_NOFILE, &open_files))?;
            }
            if want_ctty {
                cvt(libc::ioctl(0, libc::TIOCSCTTY as _, 0))?;
            }
            if let Some(mask) = umask {
                libc::umask(mask);
            }
            if change_ids {
                cvt(libc::setgroups(groups.len(), groups.as_ptr()))?;
                cvt(libc::setgid(gid))?;
                cvt(libc::setuid(uid))?;
            }
            Ok(())
        });
    }

    let spawned = state.reaper.spawn(&mut cmd);
    let (mut child, rx) =
        spawned.map_err(
            |e| match shell_report(program, &e, || program_exists(&cmd, program)) {
                Some((message, exit_code)) => ServerError::NotRunnable { message, exit_code },
                None => ServerError::Spawn(io::Error::new(
                    e.kind(),
                    format!("{}: {e}", program.to_string_lossy()),
                )),
            },
        )?;
    drop(cmd); // closes our copies of the pty slave
    let pid = child.id() as i32;
    let cgroup = cgroup.filter(|cgroup| in_its_cgroup(cgroup, child.id()));
    // Running, but nobody would end it or report on it: it must not outlive the error.
    match connect_stdio(&mut child, pid, rx, pty) {
        Ok(spawned) => Ok(Spawned { cgroup, ..spawned }),
        Err(e) => {
            kill_group(pid, libc::SIGKILL);
            kill_cgroup(cgroup.as_ref());
            Err(e)
        }
    }
}

/// Whether the command `pid` (exec'd by now) joined its cgroup, as it did before exec
/// unless its cgroup could not be joined. One that did not is said, and ended by
/// process group alone: its cgroup, empty, would make the kill of a client's going
/// away reach nothing.
fn in_its_cgroup(cgroup: &ExecCgroup, pid: u32) -> bool {
    match cgroup.holds(pid) {
        Ok(true) => true,
        Ok(false) => {
            warn!(
                pid,
                cgroup = %cgroup.path().display(),
                "the command is not in its cgroup (it could not join it): its processes \
                 outside its process group will outlive a client that goes away"
            );
            false
        }
        // Ended and reaped already: what it started is in the cgroup, if anything.
        Err(e) => {
            debug!(pid, "cannot read the command's cgroup: {e}");
            true
        }
    }
}

/// What the session works with: the running command's terminal or pipes, registered
/// with the runtime.
fn connect_stdio(
    child: &mut std::process::Child,
    pid: i32,
    exit: oneshot::Receiver<i32>,
    pty: Option<OwnedFd>,
) -> Result<Spawned, ServerError> {
    let to_pipe_sender = |fd: OwnedFd| pipe::Sender::from_owned_fd(fd).map_err(ServerError::Spawn);
    let to_pipe_receiver =
        |fd: OwnedFd| pipe::Receiver::from_owned_fd(fd).map_err(ServerError::Spawn);
    match pty {
        Some(master) => {
            set_nonblocking(master.as_raw_fd()).map_err(ServerError::Spawn)?;
            // SAFETY: `master` is an open descriptor owned by the OwnedFd, which the
            // AsyncFd owns from now on, so it stays open and unchanged while registered.
            let master = unsafe { AsyncFd::register(master) }
                .map_err(|e| ServerError::Spawn(io::Error::other(e.to_string())))?;
            let master = Arc::new(master);
            Ok(Spawned {
                pid,
                exit,
                stdin: StdinSink::Pty(master.clone()),
                stdout: OutputSource::Pty(master.clone()),
                stderr: None,
                pty: Some(master),
                cgroup: None,
            })
        }
        None => {
            let (Some(i), Some(o), Some(e)) =
                (child.stdin.take(), child.stdout.take(), child.stderr.take())
            else {
                return Err(ServerError::Spawn(io::Error::other("missing stdio pipes")));
            };
            Ok(Spawned {
                pid,
                exit,
                stdin: StdinSink::Pipe(to_pipe_sender(i.into())?),
                stdout: OutputSource::Pipe(to_pipe_receiver(o.into())?),
                stderr: Some(OutputSource::Pipe(to_pipe_receiver(e.into())?)),
                pty: None,
                cgroup: None,
            })
        }
    }
}

/// How a shell reports a program it could not run: its words, and its exit code
/// (127: not found, 126: found but not runnable). None for other failures.
/// `exists` tells a program that is there from one that is not, when exec said "not
/// found": a script whose `#!` interpreter the guest lacks is there.
fn shell_report(
    program: &OsStr,
    error: &io::Error,
    exists: impl FnOnce() -> bool,
) -> Option<(String, u8)> {
    let (has_slash, program) = (
        program.as_bytes().contains(&b'/'),
        program.to_string_lossy(),
    );
    match error.kind() {
        io::ErrorKind::NotFound if exists() => Some((
            format!("{program}: cannot execute: required file not found (its interpreter?)"),
            127,
        )),
        io::ErrorKind::NotFound if has_slash => {
            Some((format!("{program}: No such file or directory"), 127))
        }
        io::ErrorKind::NotFound => Some((format!("{program}: command not found"), 127)),
        io::ErrorKind::PermissionDenied => Some((format!("{program}: Permission denied"), 126)),
        _ => None,
    }
}

/// Whether `program` names a file that `cmd` would run: beside its working
/// directory when it has a slash, else in a directory of its PATH.
fn program_exists(cmd: &Command, program: &OsStr) -> bool {
    let is_file = |path: &Path| path.metadata().is_ok_and(|m| m.is_file());
    if program.as_bytes().contains(&b'/') {
        let dir = cmd.get_current_dir().unwrap_or(Path::new("/"));
        return is_file(&dir.join(program));
    }
    let path = cmd
        .get_envs()
        .find(|(key, _)| *key == "PATH")
        .and_then(|(_, value)| value)
        .unwrap_or(OsStr::new(DEFAULT_PATH));
    std::env::split_paths(path).any(|dir| is_file(&dir.join(program)))
}

/// The process group in the foreground of the terminal whose master is `master`.
fn foreground_group(master: &AsyncFd<OwnedFd>) -> Option<i32> {
    let mut group: libc::pid_t = 0;
    // SAFETY: TIOCGPGRP writes one pid_t into a live local.
    let r = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPGRP, &mut group) };
    (r == 0 && group > 0).then_some(group)
}

/// Signals the command's process group (its pid: the command leads the session
/// `spawn` made, or it did not start). Once the group is gone there is nobody to
/// signal, and its number may already be another process's: never `kill(pid)` then.
fn kill_group(pid: i32, sig: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    if unsafe { libc::kill(-pid, sig) } < 0 {
        debug!(
            pid,
            sig,
            "no process group to signal: {}",
            io::Error::last_os_error()
        );
    }
}

/// Whether any process is left in the process group `pgid` (a zombie not yet reaped
/// counts: its number is still taken).
fn group_exists(pgid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks; no memory-safety preconditions.
    let found = unsafe { libc::kill(-pgid, 0) } == 0;
    found || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// SIGKILLs every process of the command's cgroup, if it has one; whether that was
/// done (false: no cgroup, or its `cgroup.kill` failed, as in a cgroup a root command
/// made threaded).
fn kill_cgroup(cgroup: Option<&ExecCgroup>) -> bool {
    match cgroup.map(ExecCgroup::kill) {
        Some(Ok(())) => true,
        Some(Err(e)) => {
            warn!("{e}: processes the command started outside its process group live on");
            false
        }
        None => false,
    }
}

/// Ends a command whose client went away: `SIGHUP` (and `SIGCONT`, for a stopped
/// one) to its process group; [`KILL_GRACE`] later, `SIGKILL` to whatever is left of
/// it (see [`kill_what_is_left`]). Returns once the leader has ended.
async fn end_abandoned_command(
    pid: i32,
    exit: &mut oneshot::Receiver<i32>,
    cgroup: Option<&ExecCgroup>,
) {
    kill_group(pid, libc::SIGHUP);
    kill_group(pid, libc::SIGCONT);
    let grace_end = tokio::time::Instant::now() + KILL_GRACE;
    let leader_ended = tokio::time::timeout_at(grace_end, &mut *exit).await.is_ok();
    // Whatever heeds the hang-up may end before the grace is over; once nothing is
    // left, nothing is signalled.
    let lingering = loop {
        let lingering = group_exists(pid) || cgroup.is_some_and(ExecCgroup::is_populated);
        if !lingering || tokio::time::Instant::now() >= grace_end {
            break lingering;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    if lingering {
        kill_what_is_left(
            cgroup.map(|cgroup| move || kill_cgroup(Some(cgroup))),
            || group_exists(pid),
            || kill_group(pid, libc::SIGKILL),
        );
    }
    if !leader_ended {
        let _ = exit.await;
    }
}

/// The last kill of an abandoned command, once the grace is over. With a cgroup, the
/// cgroup alone (`kill_cgroup`): its process group may be gone by then, and its number
/// another's (a new command's group: each calls `setsid`, and the guest's pids wrap at
/// 32768), which a group `SIGKILL` would kill. (A member that root moved out of the
/// cgroup is spared.) Without one, or when the cgroup's kill could not be sent (a root
/// command made its cgroup threaded, where `cgroup.kill` is refused), the process
/// group (`kill_group`), if a group of that number is there right before: while a
/// member of the command's remains, no other group can take the number; once none
/// does, only the moment between the check and the kill is left for a new group to
/// take it.
fn kill_what_is_left(
    kill_cgroup: Option<impl FnOnce() -> bool>,
    group_exists: impl FnOnce() -> bool,
    kill_group: impl FnOnce(),
) {
    let cgroup_killed = kill_cgroup.is_some_and(|kill| kill());
    if !cgroup_killed && group_exists() {
        kill_group();
    }
}

async fn pty_read(fd: &AsyncFd<OwnedFd>, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        let mut guard = fd.readable().await?;
        let res = guard.try_io(|inner| {
            // SAFETY: reading into a live, correctly sized buffer from our descriptor.
            let n = unsafe { libc::read(inner.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match res {
            Ok(Ok(n)) => return Ok(n),
            // EIO: every slave descriptor is closed, the terminal's end of file.
            Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
}

async fn pty_write_all(fd: &AsyncFd<OwnedFd>, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        let mut guard = fd.writable().await?;
        let res = guard.try_io(|inner| {
            // SAFETY: writing from a live buffer to our descriptor.
            let n = unsafe { libc::write(inner.as_raw_fd(), data.as_ptr().cast(), data.len()) };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match res {
            Ok(Ok(n)) => data = &data[n..],
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
    Ok(())
}

impl OutputSource {
    async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            OutputSource::Pipe(p) => p.read(buf).await,
            OutputSource::Pty(fd) => pty_read(fd, buf).await,
        }
    }

    /// How many bytes are there to read now, without waiting (`FIONREAD`); 0 if the
    /// kernel does not say.
    fn buffered(&self) -> usize {
        let fd = match self {
            OutputSource::Pipe(p) => p.as_raw_fd(),
            OutputSource::Pty(fd) => fd.as_raw_fd(),
        };
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int into a live local; the descriptor is ours
        // and open for as long as `self` is.
        let r = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
        if r < 0 {
            0
        } else {
            usize::try_from(n).unwrap_or(0)
        }
    }
}

/// How an output is drained once the command exited (see [`DRAIN_IDLE`]).
struct Drain {
    /// Bytes the output held when the exit was seen, not read yet: the command's
    /// last words, forwarded whatever the time.
    owed: usize,
    /// When the session stops waiting for more: [`DRAIN_MAX`] after this output saw
    /// the exit (late only if it was busy passing output on to a slow client).
    until: tokio::time::Instant,
}

impl Drain {
    /// How long the next read may wait for data; `None`: stop reading.
    fn next_wait(&self) -> Option<Duration> {
        if self.owed > 0 {
            return Some(DRAIN_IDLE);
        }
        let left = self
            .until
            .saturating_duration_since(tokio::time::Instant::now());
        (!left.is_zero()).then(|| left.min(DRAIN_IDLE))
    }
}

/// Forwards one output of the command to the client. It stops, and so closes the
/// pipe's read end, when the client says that output's reader went away
/// (`closed_by_host`): the command's next write there then fails as it would have
/// on the host. Once the command exited, it drains the output (see [`DRAIN_IDLE`]).
async fn pump_output(
    mut src: OutputSource,
    is_stderr: bool,
    tx: mpsc::Sender<AgentMessage>,
    mut exited: watch::Receiver<bool>,
    mut host_closed: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; OUTPUT_READ_SIZE];
    let mut drain: Option<Drain> = None;
    loop {
        if drain.is_none() && *exited.borrow() {
            drain = Some(Drain {
                owed: src.buffered(),
                until: tokio::time::Instant::now() + DRAIN_MAX,
            });
        }
        let res = if let Some(d) = &drain {
            let Some(wait) = d.next_wait() else {
                debug!(is_stderr, "done draining the output");
                return left_to_background(src);
            };
            tokio::select! {
                r = tokio::time::timeout(wait, src.read(&mut buf)) => match r {
                    Ok(r) => r,
                    // Silent for DRAIN_IDLE, or the time is up.
                    Err(_) => return left_to_background(src),
                },
                () = closed_by_host(&mut host_closed) => break,
            }
        } else {
            tokio::select! {
                r = src.read(&mut buf) => r,
                _ = exited.changed() => continue,
                () = closed_by_host(&mut host_closed) => {
                    debug!(is_stderr, "the client's reader went away: closing the pipe");
                    break;
                }
            }
        };
        let n = match res {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                debug!("output read failed: {e}");
                break;
            }
        };
        if let Some(d) = &mut drain {
            d.owed = d.owed.saturating_sub(n);
        }
        let data = buf[..n].to_vec();
        let msg = if is_stderr {
            AgentMessage::Stderr(data)
        } else {
            AgentMessage::Stdout(data)
        };
        if tx.send(msg).await.is_err() {
            break; // the client is gone
        }
    }
}

/// An output the session stopped draining, which processes the command left behind
/// (`npm run dev &`) may still hold. A pipe is read on, what comes discarded, until
/// they close it, as a terminal nobody watches would take it: closed, it would kill
/// them (SIGPIPE) at their next write, or fail it (EPIPE). A terminal is hung up, as
/// sshd does.
fn left_to_background(src: OutputSource) {
    let OutputSource::Pipe(mut pipe) = src else {
        return;
    };
    tokio::spawn(async move {
        let mut buf = vec![0u8; OUTPUT_READ_SIZE];
        loop {
            match pipe.read(&mut buf).await {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return debug!("reading what a job left behind wrote failed: {e}"),
            }
        }
    });
}

/// Resolves once the client has closed this output; never if it cannot any more.
async fn closed_by_host(host_closed: &mut watch::Receiver<bool>) {
    if host_closed.wait_for(|closed| *closed).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// What tells each output pump that the client's reader of its stream went away.
struct OutputClosers {
    stdout: watch::Sender<bool>,
    stderr: watch::Sender<bool>,
}

impl OutputClosers {
    fn close(&self, stream: OutputStream) {
        let sender = match stream {
            OutputStream::Stdout => &self.stdout,
            OutputStream::Stderr => &self.stderr,
        };
        sender.send_replace(true);
    }
}

enum StdinItem {
    Data(Vec<u8>, OwnedSemaphorePermit),
    Eof,
}

async fn pump_stdin(
    mut sink: StdinSink,
    mut rx: mpsc::UnboundedReceiver<StdinItem>,
    out_tx: mpsc::Sender<AgentMessage>,
) {
    // The last byte that went into the terminal since its last end of input: whether
    // that ends a line is the terminal's settings' to say, at the end.
    let mut last_byte: Option<u8> = None;
    while let Some(item) = rx.recv().await {
        match item {
            StdinItem::Data(data, _permit) => {
                if let Some(&last) = data.last() {
                    last_byte = Some(last);
                }
                let res = match &mut sink {
                    StdinSink::Pipe(p) => p.write_all(&data).await,
                    StdinSink::Pty(fd) => pty_write_all(fd, &data).await,
                };
                give_back_stdin_window(&out_tx, data.len()).await;
                if let Err(e) = res {
                    // The command closed its stdin: drop further input.
                    debug!("stdin write failed: {e}");
                    drop_stdin(rx, &out_tx).await;
                    return;
                }
            }
            StdinItem::Eof => match sink {
                StdinSink::Pipe(p) => {
                    drop(p);
                    drop_stdin(rx, &out_tx).await;
                    return;
                }
                StdinSink::Pty(ref fd) => {
                    let _ = pty_write_all(fd, &end_of_input(fd, last_byte)).await;
                    last_byte = None;
                }
            },
        }
    }
}

/// What ends a terminal's input, as a user's Ctrl-D does: in canonical mode its EOF
/// character, twice after a partial line (the first only hands the line over, as a
/// read without its newline, and `cat` would wait for more); in raw mode, one ^D,
/// which is all a user's key sends there. `last_byte`: the last one written since the
/// last end of input.
fn end_of_input(master: &AsyncFd<OwnedFd>, last_byte: Option<u8>) -> Vec<u8> {
    const CTRL_D: u8 = 0x04;
    // SAFETY: an all-zero termios is a valid value for tcgetattr to overwrite.
    let mut settings: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: tcgetattr writes one termios into a live local; on a master it reads
    // the terminal's settings, the ones the command set.
    if unsafe { libc::tcgetattr(master.as_raw_fd(), &mut settings) } < 0
        || settings.c_lflag & libc::ICANON == 0
    {
        return vec![CTRL_D];
    }
    let eof = match settings.c_cc[libc::VEOF] {
        0 => CTRL_D, // disabled (_POSIX_VDISABLE): the usual key is all we have
        eof => eof,
    };
    if last_byte.is_some_and(|byte| !ends_a_line(&settings, byte)) {
        vec![eof, eof]
    } else {
        vec![eof]
    }
}

/// Whether `byte`, typed into a canonical terminal with `settings`, ends a line: a
/// newline, its EOF or end-of-line characters, or a carriage return it maps to a
/// newline.
fn ends_a_line(settings: &libc::termios, byte: u8) -> bool {
    let special = [libc::VEOF, libc::VEOL, libc::VEOL2]
        .iter()
        .any(|&index| settings.c_cc[index] != 0 && settings.c_cc[index] == byte);
    byte == b'\n' || special || (byte == b'\r' && settings.c_iflag & libc::ICRNL != 0)
}

/// Drops the rest of a command's stdin (it closed its end, or the host closed it),
/// giving the host its window back as if the command had read it.
async fn drop_stdin(
    mut rx: mpsc::UnboundedReceiver<StdinItem>,
    out_tx: &mpsc::Sender<AgentMessage>,
) {
    while let Some(item) = rx.recv().await {
        if let StdinItem::Data(data, _permit) = item {
            give_back_stdin_window(out_tx, data.len()).await;
        }
    }
}

async fn give_back_stdin_window(out_tx: &mpsc::Sender<AgentMessage>, taken: usize) {
    let taken = u32::try_from(taken).unwrap_or(u32::MAX);
    let _ = out_tx.send(AgentMessage::StdinTaken(taken)).await;
}

/// How the client side of an exec ended.
enum InputEnd {
    /// End of stream or I/O error: the client went away.
    Disconnected,
    /// Protocol violation (an `Error` was sent).
    Malformed,
}

async fn pump_input<R: AsyncRead + Unpin>(
    mut reader: FrameReader<R>,
    pid: i32,
    pty: Option<Arc<AsyncFd<OwnedFd>>>,
    stdin_tx: mpsc::UnboundedSender<StdinItem>,
    out_tx: mpsc::Sender<AgentMessage>,
    output_closers: OutputClosers,
) -> InputEnd {
    // Stdin buffered for the command before the agent stops reading the socket: as
    // much as a host may send ahead, so only one that does not keep to the window is
    // ever stopped.
    let backlog = Arc::new(Semaphore::new(STDIN_WINDOW));
    loop {
        let msg = match reader.next::<ClientMessage>().await {
            Ok(Some(m)) => m,
            Ok(None) => return InputEnd::Disconnected,
            Err(ProtocolError::Io(_)) | Err(ProtocolError::TruncatedFrame) => {
                return InputEnd::Disconnected
            }
            Err(e) => {
                let _ = out_tx.send(error_reply(e.to_string())).await;
                return InputEnd::Malformed;
            }
        };
        match msg {
            ClientMessage::Stdin(data) => {
                if data.is_empty() {
                    continue;
                }
                // Waits (not reading the socket) while the backlog is full, which only
                // a host that sends more than STDIN_WINDOW ahead makes it.
                let n = data.len().min(STDIN_WINDOW) as u32;
                let Ok(permit) = backlog.clone().acquire_many_owned(n).await else {
                    continue;
                };
                // Stdin after StdinEof goes there too: the stdin task drops it and
                // gives the window back, as the host is told for a closed stdin.
                if let Err(unsent) = stdin_tx.send(StdinItem::Data(data, permit)) {
                    // The stdin task is gone (the session is ending): the window
                    // still comes back.
                    if let StdinItem::Data(data, _) = unsent.0 {
                        give_back_stdin_window(&out_tx, data.len()).await;
                    }
                }
            }
            ClientMessage::StdinEof => {
                let _ = stdin_tx.send(StdinItem::Eof);
            }
            ClientMessage::Resize { rows, cols } => {
                if let Some(fd) = &pty {
                    let ws = winsize(rows, cols);
                    // SAFETY: TIOCSWINSZ reads a winsize from a live local.
                    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
                    if r < 0 {
                        debug!("TIOCSWINSZ failed: {}", io::Error::last_os_error());
                    }
                }
            }
            ClientMessage::Signal(sig) => {
                if (1..=64).contains(&sig) {
                    kill_group(pid, sig);
                    // An interactive shell runs each job in a group of its own (and
                    // ignores SIGINT and SIGTERM itself): the job in the foreground
                    // gets the signal too, as it would from the keyboard.
                    match pty.as_deref().and_then(foreground_group) {
                        Some(job) if job != pid => kill_group(job, sig),
                        _ => {}
                    }
                } else {
                    debug!(sig, "ignoring an invalid signal number");
                }
            }
            // A terminal's output has no separate reader to lose: the client ends the
            // session instead.
            ClientMessage::OutputClosed(stream) if pty.is_none() => output_closers.close(stream),
            ClientMessage::OutputClosed(_) => debug!("ignoring OutputClosed with a tty"),
            other => {
                let message = format!("unexpected message during exec: {other:?}");
                let _ = out_tx.send(error_reply(message)).await;
                return InputEnd::Malformed;
            }
        }
    }
}

struct ActiveGuard<'a>(&'a AtomicU32);
impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn run_exec<R, W>(
    req: ExecRequest,
    reader: FrameReader<R>,
    mut w: W,
    state: Arc<State>,
) -> Result<(), ServerError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    // Off the runtime's one thread: the checks of the working directory, and the
    // fork and exec that `spawn` waits for, go through virtio-fs (a share's cwd, a
    // program in node_modules) and may take long, when every session's output and
    // input must go on meanwhile.
    let spawning = {
        let (req, state) = (req.clone(), state.clone());
        tokio::task::spawn_blocking(move || spawn(&req, &state)).await
    };
    let spawned = match spawning.unwrap_or_else(|e| {
        Err(ServerError::Spawn(io::Error::other(format!(
            "the spawning thread failed: {e}"
        ))))
    }) {
        Ok(s) => s,
        Err(ServerError::NotRunnable { message, exit_code }) => {
            let message = clipped(message);
            info!("not started: {message}");
            return reply_and_close(&mut w, &AgentMessage::NotStarted { message, exit_code }).await;
        }
        Err(e) => {
            return send_error(&mut w, e.to_string()).await;
        }
    };
    state.activity.started.fetch_add(1, Ordering::Relaxed);
    state.activity.running.fetch_add(1, Ordering::Relaxed);
    let _active = ActiveGuard(&state.activity.running);
    let Spawned {
        pid,
        mut exit,
        stdin,
        stdout,
        stderr,
        pty,
        cgroup,
    } = spawned;
    // Shown as text, a byte that is not UTF-8 escaped (`\xE9`).
    let argv: Vec<&OsStr> = req.argv.iter().map(|arg| OsStr::from_bytes(arg)).collect();
    info!(pid, ?argv, tty = req.tty.is_some(), "started");

    let (out_tx, mut out_rx) = mpsc::channel::<AgentMessage>(OUTPUT_QUEUE);
    // Started goes first: queue it before any output pump exists.
    let _ = out_tx.send(AgentMessage::Started { pid: pid as u32 }).await;
    let (exited_tx, exited_rx) = watch::channel(false);
    let (stdout_closer, stdout_closed) = watch::channel(false);
    let (stderr_closer, stderr_closed) = watch::channel(false);
    let output_closers = OutputClosers {
        stdout: stdout_closer,
        stderr: stderr_closer,
    };
    let mut pumps = Vec::new();
    pumps.push(tokio::spawn(pump_output(
        stdout,
        false,
        out_tx.clone(),
        exited_rx.clone(),
        stdout_closed,
    )));
    if let Some(e) = stderr {
        pumps.push(tokio::spawn(pump_output(
            e,
            true,
            out_tx.clone(),
            exited_rx.clone(),
            stderr_closed,
        )));
    }
    let (stdin_tx, stdin_rx) = mpsc::unbounded_channel();
    let stdin_task = tokio::spawn(pump_stdin(stdin, stdin_rx, out_tx.clone()));
    let mut input = tokio::spawn(pump_input(
        reader,
        pid,
        pty,
        stdin_tx,
        out_tx.clone(),
        output_closers,
    ));
    let mut writer = tokio::spawn(async move {
        while let Some(msg) = out_rx.recv().await {
            write_frame(&mut w, &msg).await?;
        }
        let _ = w.shutdown().await;
        Ok::<(), ProtocolError>(())
    });

    let client_gone = |why: &str| debug!(pid, "client {why}: killing the process group");
    // A JoinHandle must not be polled again once it has returned: tokio panics.
    let mut writer_ended = false;
    let status = tokio::select! {
        st = &mut exit => st.ok(),
        r = &mut input => {
            match r {
                Ok(InputEnd::Malformed) => client_gone("sent a malformed message"),
                _ => client_gone("disconnected"),
            }
            None
        }
        r = &mut writer => {
            writer_ended = true;
            if let Ok(Err(e)) = r { debug!("write failed: {e}") }
            client_gone("stopped accepting data");
            None
        }
    };
    let Some(status) = status else {
        end_abandoned_command(pid, &mut exit, cgroup.as_ref()).await;
        input.abort();
        stdin_task.abort();
        for p in &pumps {
            p.abort();
        }
        drop(out_tx);
        // Let an Error reach the client, but don't wait on a client that doesn't read.
        if !writer_ended {
            let _ = tokio::time::timeout(Duration::from_secs(1), writer).await;
        }
        info!(pid, "ended after the client went away");
        return Ok(());
    };

    let _ = exited_tx.send(true);
    for p in pumps {
        let _ = p.await;
    }
    let (code, signal) = if libc::WIFEXITED(status) {
        (Some(libc::WEXITSTATUS(status)), None)
    } else if libc::WIFSIGNALED(status) {
        (None, Some(libc::WTERMSIG(status)))
    } else {
        (None, None)
    };
    info!(pid, ?code, ?signal, "exited");
    // Nothing may follow Exited, its window given back included. With both tasks
    // gone (the pumps are) the last handle on a terminal's master is closed, which
    // ends the terminal session as sshd does when the shell exits: the kernel hangs
    // up the terminal, so a job the shell left in a group of its own (`set -m`),
    // which its exit did not hang up, reads end of file and fails to write there
    // instead of writing to a session nobody reads. And the input task holds an
    // out_tx clone: the writer finishes once it is gone.
    stdin_task.abort();
    let _ = stdin_task.await;
    input.abort();
    let _ = input.await;
    let _ = out_tx.send(AgentMessage::Exited { code, signal }).await;
    drop(out_tx);
    match writer.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the host's CID is served: vsock loopback (CID 1), the guest's own CID (3
    /// under vmctl) and anything else would let a guest process run commands as root.
    #[test]
    fn only_the_hosts_cid_is_a_peer_to_serve() {
        assert_eq!(vsock_peer(tokio_vsock::VMADDR_CID_HOST), VsockPeer::Host);
        assert_eq!(vsock_peer(2), VsockPeer::Host);
        assert_eq!(vsock_peer(1), VsockPeer::Loopback);
        for cid in [0, 3, 4, 1000, tokio_vsock::VMADDR_CID_ANY] {
            assert_eq!(vsock_peer(cid), VsockPeer::Other, "CID {cid}");
        }
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let short = "no such user 'x'".to_string();
        assert_eq!(clipped(short.clone()), short);
        let exact = "é".repeat(MAX_MESSAGE_CHARS);
        assert_eq!(clipped(exact.clone()), exact);
        let long = clipped("é".repeat(MAX_MESSAGE_CHARS + 1));
        assert_eq!(long.chars().count(), MAX_MESSAGE_CHARS + 1);
        assert!(long.ends_with("é…"), "{long}");
    }

    /// Connections as from vsock peers of the CIDs given, in that order; each
    /// connection's other end is the test's.
    struct InjectedPeers(Mutex<std::collections::VecDeque<(tokio::net::UnixStream, u32)>>);

    impl PeerListener for InjectedPeers {
        type Connection = tokio::net::UnixStream;
        async fn accept_with_peer(&self) -> io::Result<(Self::Connection, u32, u32)> {
            let next = self
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop_front();
            match next {
                Some((stream, cid)) => Ok((stream, cid, 50_000 + cid)),
                None => std::future::pending().await,
            }
        }
    }

    /// The agent's CID filter, with the peers' CIDs injected (the guest kernel has no
    /// vsock loopback, so no VM test can get a guest process's connection to it): a
    /// guest process through loopback (CID 1) or at the guest's own CID (3), whose
    /// Hello is already sent, is closed unread; the host's connection is the one
    /// served.
    #[tokio::test]
    async fn only_a_connection_from_the_hosts_cid_is_accepted() {
        let hello = crate::protocol::encode_frame(&crate::protocol::ClientMessage::Hello(
            crate::protocol::Hello {
                protocol_version: crate::protocol::PROTOCOL_VERSION,
                client: "guest-process".into(),
                host_time_ns: None,
            },
        ))
        .unwrap();
        let mut queue = std::collections::VecDeque::new();
        let mut peers = Vec::new();
        for cid in [1, 3, tokio_vsock::VMADDR_CID_HOST] {
            let (agent_end, mut peer_end) = tokio::net::UnixStream::pair().unwrap();
            peer_end.write_all(&hello).await.unwrap();
            peer_end.write_all(&[cid as u8]).await.unwrap();
            queue.push_back((agent_end, cid));
            peers.push((cid, peer_end));
        }
        let listener = InjectedPeers(Mutex::new(queue));
        let refused = RefusedPeers::default();
        let mut served = tokio::time::timeout(
            Duration::from_secs(10),
            accept_from_host(&listener, &refused),
        )
        .await
        .expect("the host's connection was not accepted")
        .unwrap();
        let mut sent = vec![0; hello.len() + 1];
        served.read_exact(&mut sent).await.unwrap();
        assert_eq!(
            sent.last(),
            Some(&(tokio_vsock::VMADDR_CID_HOST as u8)),
            "served a connection from another CID than the host's"
        );
        for (cid, mut peer_end) in peers {
            if cid == tokio_vsock::VMADDR_CID_HOST {
                continue;
            }
            // Closed with the Hello unread: the end of the stream, or a reset.
            let mut answer = [0; 64];
            let read = tokio::time::timeout(Duration::from_secs(10), peer_end.read(&mut answer))
                .await
                .unwrap_or_else(|_| panic!("the connection from CID {cid} is still open"));
            assert!(
                matches!(read, Ok(0) | Err(_)),
                "CID {cid} got an answer: {read:?}"
            );
        }
        assert!(refused.loopback_warned.load(Ordering::Relaxed));
        assert!(refused.other_warned.load(Ordering::Relaxed));
    }

    /// With a cgroup, the last kill is the cgroup's alone; without, the group's, only
    /// while a group of its number is there.
    #[test]
    fn the_last_kill_goes_to_the_group_only_without_a_cgroup() {
        let unasked = || panic!("the group was looked for, though the cgroup reaches all");
        let cgroup_killed = std::cell::Cell::new(false);
        kill_what_is_left(
            Some(|| {
                cgroup_killed.set(true);
                true
            }),
            unasked,
            || panic!("the group was killed, though the cgroup reaches all"),
        );
        assert!(cgroup_killed.get());
        // Without a cgroup: a_failed_cgroup_kill_falls_back_to_the_process_group.
    }

    /// A cgroup whose `cgroup.kill` fails (made threaded by a root command) leaves the
    /// process group to be killed, as without a cgroup; one that is killed does not.
    #[test]
    fn a_failed_cgroup_kill_falls_back_to_the_process_group() {
        let group_killed = |cgroup_kill_works: Option<bool>, group_exists: bool| {
            let killed = std::cell::Cell::new(false);
            kill_what_is_left(
                cgroup_kill_works.map(|works| move || works),
                || group_exists,
                || killed.set(true),
            );
            killed.get()
        };
        assert!(
            !group_killed(Some(true), true),
            "the cgroup's kill reached all"
        );
        assert!(group_killed(Some(false), true), "the cgroup's kill failed");
        assert!(!group_killed(Some(false), false), "no group left to kill");
        assert!(group_killed(None, true));
        assert!(!group_killed(None, false));
    }

    /// By the end of the grace, the command's group is gone and its number is
    /// another's (here a stranger's session, which ignores the hang-up as a group that
    /// took the number after it was sent would not have had it): the `SIGKILL` goes to
    /// the command's cgroup, where what it left still runs, and spares the stranger.
    /// (Review: the group was SIGKILLed whenever the cgroup was still populated.)
    #[tokio::test]
    async fn the_last_kill_spares_a_group_that_took_the_commands_number() {
        let Some(parent) = crate::cgroups::test_support::test_parent("spares-stranger") else {
            return;
        };
        let cgroup = parent.cgroups.create().unwrap();
        let joiner = cgroup.joiner();
        let mut left = Command::new("sleep");
        left.arg("1000");
        // SAFETY: join is async-signal-safe.
        unsafe { left.pre_exec(move || joiner.join()) };
        let mut left = left.spawn().unwrap();
        let mut stranger = Command::new("sleep");
        stranger.arg("1000");
        // SAFETY: setsid and signal are plain system calls, async-signal-safe; an
        // ignored signal stays ignored across exec.
        unsafe {
            stranger.pre_exec(|| {
                cvt(libc::setsid())?;
                libc::signal(libc::SIGHUP, libc::SIG_IGN);
                Ok(())
            })
        };
        let mut stranger = stranger.spawn().unwrap();
        let (leader_ended, mut exit) = oneshot::channel();
        let _ = leader_ended.send(0);

        end_abandoned_command(stranger.id() as i32, &mut exit, Some(&cgroup)).await;
        let left_status = left.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&left_status),
            Some(libc::SIGKILL)
        );
        let spared = stranger.try_wait().unwrap();
        let _ = stranger.kill();
        let _ = stranger.wait();
        assert_eq!(spared, None, "the stranger's group was killed");
    }

    /// The parent's check after spawn: a command that did not join its cgroup is
    /// ended by process group, not through its empty cgroup; one already reaped keeps
    /// its cgroup, where what it started is.
    #[test]
    fn a_command_outside_its_cgroup_is_ended_by_process_group() {
        let Some(parent) = crate::cgroups::test_support::test_parent("outside") else {
            return;
        };
        let cgroup = parent.cgroups.create().unwrap();
        let mut outside = Command::new("sleep").arg("1000").spawn().unwrap();
        assert!(!in_its_cgroup(&cgroup, outside.id()));
        let joiner = cgroup.joiner();
        let mut inside = Command::new("sleep");
        inside.arg("1000");
        // SAFETY: join is async-signal-safe.
        unsafe { inside.pre_exec(move || joiner.join()) };
        let mut inside = inside.spawn().unwrap();
        assert!(in_its_cgroup(&cgroup, inside.id()));
        outside.kill().unwrap();
        outside.wait().unwrap();
        assert!(in_its_cgroup(&cgroup, outside.id()), "a reaped command");
        inside.kill().unwrap();
        inside.wait().unwrap();
    }

    /// A guest process that connects in a loop gets one warning per kind of peer, not
    /// one per connection.
    #[test]
    fn refused_peers_are_warned_of_once_per_kind() {
        let refused = RefusedPeers::default();
        assert!(refused.note(VsockPeer::Loopback, 1, 50_000));
        assert!(!refused.note(VsockPeer::Loopback, 1, 50_001));
        assert!(refused.note(VsockPeer::Other, 3, 50_002));
        assert!(!refused.note(VsockPeer::Other, 3, 50_003));
        assert!(!refused.note(VsockPeer::Loopback, 1, 50_004));
    }

    /// What an output held when the command exited is all forwarded, however long the
    /// client takes to read it; the drain's time limit is for what comes after. Here a
    /// pipe holds 160 KiB at the exit (its writer, a job left behind, stays), the client
    /// takes one message and then reads nothing for longer than the limit.
    #[tokio::test(start_paused = true)]
    async fn what_an_output_held_at_the_exit_is_forwarded_however_late_it_is_read() {
        const HELD: usize = 160 * 1024;
        let (reader, mut writer) = std::io::pipe().unwrap();
        // SAFETY: F_SETPIPE_SZ on a pipe descriptor we own; no pointers involved.
        let size = unsafe { libc::fcntl(writer.as_raw_fd(), libc::F_SETPIPE_SZ, 256 * 1024) };
        assert!(size >= 256 * 1024, "{}", io::Error::last_os_error());
        std::io::Write::write_all(&mut writer, &[7; HELD]).unwrap();
        let source = OutputSource::Pipe(pipe::Receiver::from_owned_fd(reader.into()).unwrap());
        let (tx, mut rx) = mpsc::channel(1);
        let (_exited_tx, exited) = watch::channel(true);
        let (_closer, host_closed) = watch::channel(false);
        let pump = tokio::spawn(pump_output(source, false, tx, exited, host_closed));
        let mut forwarded = 0;
        if let Some(AgentMessage::Stdout(d)) = rx.recv().await {
            forwarded += d.len();
        }
        tokio::time::sleep(DRAIN_MAX * 5).await;
        while let Some(message) = rx.recv().await {
            let AgentMessage::Stdout(d) = message else {
                panic!("{message:?}")
            };
            forwarded += d.len();
        }
        assert_eq!(forwarded, HELD);
        pump.await.unwrap();
        drop(writer);
    }

    /// A job left behind that writes more often than [`DRAIN_IDLE`] is heard for
    /// [`DRAIN_MAX`] after the exit, no longer, and lives on.
    #[tokio::test(start_paused = true)]
    async fn the_drain_ends_in_time_while_a_job_left_behind_keeps_writing() {
        let (reader, writer) = std::io::pipe().unwrap();
        let source = OutputSource::Pipe(pipe::Receiver::from_owned_fd(reader.into()).unwrap());
        let mut writer = pipe::Sender::from_owned_fd(writer.into()).unwrap();
        let ticking = tokio::spawn(async move {
            while writer.write_all(b"tick\n").await.is_ok() {
                tokio::time::sleep(DRAIN_IDLE / 4).await;
            }
        });
        let (tx, mut rx) = mpsc::channel(OUTPUT_QUEUE);
        let (_exited_tx, exited) = watch::channel(true);
        let (_closer, host_closed) = watch::channel(false);
        let start = tokio::time::Instant::now();
        let pump = tokio::spawn(pump_output(source, false, tx, exited, host_closed));
        let drained = async { while rx.recv().await.is_some() {} };
        tokio::time::timeout(DRAIN_MAX * 5, drained)
            .await
            .expect("still draining");
        let took = start.elapsed();
        assert!(
            took >= DRAIN_MAX && took < DRAIN_MAX + DRAIN_IDLE,
            "{took:?}"
        );
        pump.await.unwrap();
        // The job lives on: what it writes now is read and dropped, its writes do not
        // fail (a closed pipe would kill it with SIGPIPE).
        tokio::time::sleep(DRAIN_MAX * 2).await;
        assert!(!ticking.is_finished(), "the job's writes failed");
        ticking.abort();
    }

    /// The image has an account of the host user's name, with other ids: commands
    /// still run with the host user's.
    #[test]
    fn the_default_user_has_the_host_users_ids_whatever_the_image_says() {
        let root = users::root();
        let config = ServerConfig {
            default_user: Some(HostUser {
                name: root.name.clone(),
                uid: 4242,
                gid: 4243,
                home: "/home/dev".into(),
            }),
            ..ServerConfig::default()
        };
        let account = resolve_user(&User::Default, &config).unwrap();
        assert_eq!(
            (
                account.uid,
                account.gid,
                account.home.as_str(),
                account.groups
            ),
            (4242, 4243, "/home/dev", vec![4243])
        );
        assert_eq!(account.shell, root.shell);
    }
}
