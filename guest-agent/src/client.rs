//! The host-side client of the guest agent (used by `vmctl`).
//!
//! Each request uses its own connection: connect ([`connect_hybrid`] through the
//! VMM's hybrid-vsock Unix socket, or [`Connection::handshake`] over any byte
//! stream), then call one of [`Connection::exec`], [`Connection::health`],
//! [`Connection::list_ports`], [`Connection::configure_network`],
//! [`Connection::connect_port`] or [`Connection::shutdown`]. The exception is
//! [`Connection::show_host_edits`], which keeps its connection for batch after batch.
//!
//! ```no_run
//! # async fn demo() -> Result<(), guest_agent::client::ClientError> {
//! use guest_agent::client::connect_hybrid;
//! use guest_agent::protocol::ExecRequest;
//! let conn = connect_hybrid("/run/vm/vsock.sock".as_ref(), 1024).await?;
//! let out = conn
//!     .exec(ExecRequest { argv: vec!["uname".into(), "-a".into()], ..Default::default() })
//!     .await?
//!     .output(b"")
//!     .await?;
//! println!("{} (exit {:?})", String::from_utf8_lossy(&out.stdout), out.status.code);
//! # Ok(()) }
//! ```

use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::UnixStream;
use tokio::sync::Semaphore;

use crate::protocol::{
    write_frame, AgentMessage, ClientMessage, EditsShown, ExecRequest, FrameReader, HealthInfo,
    Hello, HostEdit, ListeningPort, NetworkConfig, OutputStream, ProtocolError, CHUNK_SIZE,
    PROTOCOL_VERSION, STDIN_WINDOW, UNSUPPORTED_VERSION,
};
pub use crate::raw::RawStream;

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("cannot connect to {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{path} is served by another user (uid {uid}), not by this user's vmctl; refusing \
         to talk to it (someone else may have planted it: remove it, or see who made it)"
    )]
    ForeignPeer { path: String, uid: u32 },
    #[error("hybrid vsock handshake failed: {0}")]
    HybridHandshake(String),
    /// The VMM's socket closed the connection during the hybrid-vsock handshake, after
    /// `received` of its reply line.
    #[error(
        "hybrid vsock handshake failed: connection closed after {received:?} (is the agent \
         listening on port {port}?)"
    )]
    HybridClosed { received: String, port: u32 },
    #[error("the agent reported: {0}")]
    Agent(String),
    #[error("the agent reported: {0}. {advice}", advice = other_protocol_advice(.0))]
    OtherProtocol(String),
    /// The program could not be run (`NotStarted`): the shell's words and exit code.
    #[error("{message}")]
    NotStarted { message: String, exit_code: u8 },
    #[error("unexpected message from the agent: {0}")]
    Unexpected(String),
    #[error("the agent closed the connection unexpectedly")]
    Closed,
}

impl ClientError {
    /// Whether the connection to the agent broke, while connecting or after: closed by
    /// the other end, or reset. A VM that went away (a guest crash, a stop) ends its
    /// connections so; vmctl then says why (`vmctl/src/lost_vm.rs`).
    pub fn is_connection_lost(&self) -> bool {
        match self {
            ClientError::Closed | ClientError::HybridClosed { .. } => true,
            ClientError::Io(e)
            | ClientError::Protocol(ProtocolError::Io(e))
            | ClientError::Connect { source: e, .. } => {
                e.kind() == std::io::ErrorKind::ConnectionReset
            }
            _ => false,
        }
    }
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// What to do about a running VM whose agent refused this crate's protocol, from its
/// words (`agent_said`): a newer agent's VM works with the vmctl that started it, and
/// stopping it would end that vmctl's sessions for nothing.
pub fn other_protocol_advice(agent_said: &str) -> String {
    match crate::protocol::version_spoken_in(agent_said) {
        Some(theirs) if theirs > PROTOCOL_VERSION => format!(
            "The VM was started by a newer vmctl (guest agent protocol {theirs}, this \
             vmctl's {PROTOCOL_VERSION}): use that vmctl, or rebuild this one with \
             scripts/setup.sh; the VM itself is fine"
        ),
        _ => "The VM was started by an older vmctl, with an older guest agent; stop it \
              (`vmctl stop`, which asks it to shut down, ending what runs in it) and start \
              it again"
            .to_owned(),
    }
}

/// Connects to the guest's vsock `port` through the VMM's hybrid-vsock Unix socket
/// (`CONNECT <port>\n` → `OK <n>\n`), then says Hello.
pub async fn connect_hybrid(uds_path: &Path, port: u32) -> Result<Connection<UnixStream>> {
    let mut stream = connect_own(uds_path).await?;
    hybrid_connect(&mut stream, port).await?;
    Connection::handshake(stream).await
}

/// The oldest protocol whose `Hello`, `Health`/`Healthy`, `Shutdown`/`Ok` and `Error`
/// encode as this one's: they never change (PROTOCOL.md, "Messages every version
/// keeps").
pub const OLDEST_WITH_STABLE_MESSAGES: u32 = 3;

/// A connection to an agent of any protocol since [`OLDEST_WITH_STABLE_MESSAGES`], for
/// the messages they all encode alike: a VM that another vmctl (older or newer) started
/// can still be asked how many commands it runs, and to shut down cleanly.
pub struct StableConnection(Connection<UnixStream>);

impl StableConnection {
    /// The agent's health and resource usage.
    pub async fn health(self) -> Result<HealthInfo> {
        self.0.health().await
    }

    /// Asks the guest to power off cleanly (its commands get SIGTERM, the guest syncs).
    pub async fn shutdown(self) -> Result<()> {
        self.0.shutdown().await
    }

    /// The protocol the agent speaks, which need not be this crate's.
    pub fn protocol_version(&self) -> u32 {
        self.0.protocol_version()
    }
}

/// [`connect_hybrid`] to an agent of any protocol that keeps the stable messages: one
/// that refuses this crate's `Hello`, saying which version it speaks, is greeted again
/// in that version.
pub async fn connect_hybrid_any_protocol(uds_path: &Path, port: u32) -> Result<StableConnection> {
    let agent_said = match connect_hybrid(uds_path, port).await {
        Err(ClientError::OtherProtocol(agent_said)) => agent_said,
        connected => return connected.map(StableConnection),
    };
    let Some(spoken) = crate::protocol::version_spoken_in(&agent_said)
        .filter(|version| *version >= OLDEST_WITH_STABLE_MESSAGES)
    else {
        return Err(ClientError::OtherProtocol(agent_said));
    };
    let mut stream = connect_own(uds_path).await?;
    hybrid_connect(&mut stream, port).await?;
    Connection::handshake_speaking(stream, spoken)
        .await
        .map(StableConnection)
}

/// Connects to an agent listening on a plain Unix socket (`guest-agent --listen unix:PATH`).
pub async fn connect_unix(path: &Path) -> Result<Connection<UnixStream>> {
    Connection::handshake(connect_own(path).await?).await
}

/// Connects to the Unix socket at `path` if a process of this user serves it: what is
/// said on it (a command, its environment, its input) is for this user's VM only.
async fn connect_own(path: &Path) -> Result<UnixStream> {
    let connect_error = |source| ClientError::Connect {
        path: path.display().to_string(),
        source,
    };
    let stream = UnixStream::connect(path).await.map_err(connect_error)?;
    if let Some(uid) = foreign_peer(&stream).map_err(connect_error)? {
        return Err(ClientError::ForeignPeer {
            path: path.display().to_string(),
            uid,
        });
    }
    Ok(stream)
}

/// The uid of the process serving the Unix socket `stream` is connected to (as it was
/// when it listened), if that is not this process's user.
pub fn foreign_peer(stream: &impl std::os::fd::AsRawFd) -> std::io::Result<Option<u32>> {
    let cred = peer_credentials(stream)?;
    // SAFETY: geteuid cannot fail and touches no memory.
    let me = unsafe { libc::geteuid() };
    Ok((cred.uid != me).then_some(cred.uid))
}

/// The pid, uid and gid of the process at the other end of the Unix socket `stream`
/// (as they were when it listened or connected).
pub fn peer_credentials(stream: &impl std::os::fd::AsRawFd) -> std::io::Result<libc::ucred> {
    // SAFETY: ucred is plain data; all zeroes is a valid value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live and writable, `len` holds the size of `cred`,
    // and the descriptor is the stream's, open for this call.
    let done = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if done != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred)
}

/// The hybrid-vsock preamble: sends `CONNECT <port>\n` and expects `OK <n>\n`. Reads
/// byte by byte so nothing after the line is consumed.
pub async fn hybrid_connect<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    port: u32,
) -> Result<()> {
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await?;
    let mut line = Vec::new();
    loop {
        let b = match stream.read_u8().await {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(ClientError::HybridClosed {
                    received: String::from_utf8_lossy(&line).into_owned(),
                    port,
                })
            }
            Err(e) => return Err(e.into()),
        };
        if b == b'\n' {
            break;
        }
        line.push(b);
        if line.len() > 128 {
            return Err(ClientError::HybridHandshake("reply line too long".into()));
        }
    }
    let line = String::from_utf8_lossy(&line);
    if line.starts_with("OK ") || line == "OK" {
        Ok(())
    } else {
        Err(ClientError::HybridHandshake(format!(
            "expected 'OK <n>', got {line:?}"
        )))
    }
}

/// A connection that completed the Hello exchange, ready for one request.
pub struct Connection<S = UnixStream> {
    reader: FrameReader<ReadHalf<S>>,
    writer: WriteHalf<S>,
    agent_version: String,
    protocol_version: u32,
}

/// How many of the agent's characters the host quotes.
const QUOTED_MAX: usize = 300;

/// The agent's words as the host quotes them in its own messages: on one line, and
/// shown as written: control characters, line and paragraph separators and
/// bidirectional controls escaped (a line break would start a line that could pass
/// for the host's own; a bidi override reorders what follows it), and only the first
/// `QUOTED_MAX` characters. The guest is not trusted.
pub fn quoted(words: &str) -> String {
    let (head, cut) = match words.char_indices().nth(QUOTED_MAX) {
        Some((at, _)) => (&words[..at], true),
        None => (words, false),
    };
    let mut out = guest_log::one_line(head).into_owned();
    if cut {
        out.push_str("...");
    }
    out
}

fn unexpected(msg: &AgentMessage) -> ClientError {
    match msg {
        AgentMessage::Error { message } => ClientError::Agent(quoted(message)),
        other => {
            let s = format!("{other:?}");
            ClientError::Unexpected(s.chars().take(200).collect())
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Send + 'static> Connection<S> {
    /// Sends Hello over `stream` and waits for HelloOk.
    pub async fn handshake(stream: S) -> Result<Self> {
        Self::handshake_speaking(stream, PROTOCOL_VERSION).await
    }

    /// [`Self::handshake`] in `protocol_version`: only the stable messages may follow
    /// when that is not this crate's ([`StableConnection`]).
    async fn handshake_speaking(stream: S, protocol_version: u32) -> Result<Self> {
        let (r, mut writer) = tokio::io::split(stream);
        let mut reader = FrameReader::new(r);
        let hello = Hello {
            protocol_version,
            client: format!("vmctl {}", env!("CARGO_PKG_VERSION")),
            host_time_ns: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .ok()
                .and_then(|t| u64::try_from(t.as_nanos()).ok()),
        };
        write_frame(&mut writer, &ClientMessage::Hello(hello)).await?;
        match reader.next::<AgentMessage>().await? {
            Some(AgentMessage::HelloOk {
                agent_version,
                protocol_version,
            }) => Ok(Self {
                reader,
                writer,
                agent_version,
                protocol_version,
            }),
            Some(AgentMessage::Error { message }) if message.starts_with(UNSUPPORTED_VERSION) => {
                Err(ClientError::OtherProtocol(quoted(&message)))
            }
            Some(other) => Err(unexpected(&other)),
            None => Err(ClientError::Closed),
        }
    }

    pub fn agent_version(&self) -> &str {
        &self.agent_version
    }

    pub fn protocol_version(&self) -> u32 {
        self.protocol_version
    }

    async fn request(mut self, msg: ClientMessage) -> Result<AgentMessage> {
        write_frame(&mut self.writer, &msg).await?;
        match self.reader.next::<AgentMessage>().await? {
            Some(AgentMessage::Error { message }) => Err(ClientError::Agent(quoted(&message))),
            Some(m) => Ok(m),
            None => Err(ClientError::Closed),
        }
    }

    /// The agent's health and resource usage.
    pub async fn health(self) -> Result<HealthInfo> {
        match self.request(ClientMessage::Health).await? {
            AgentMessage::Healthy(h) => Ok(h),
            other => Err(unexpected(&other)),
        }
    }

    /// The guest's listening TCP ports.
    pub async fn list_ports(self) -> Result<Vec<ListeningPort>> {
        match self.request(ClientMessage::ListPorts).await? {
            AgentMessage::Ports(p) => Ok(p),
            other => Err(unexpected(&other)),
        }
    }

    /// Sends one batch of host edits and waits for the agent's account of it; the
    /// connection stays open for the next batch.
    pub async fn show_host_edits(&mut self, edits: Vec<HostEdit>) -> Result<EditsShown> {
        write_frame(&mut self.writer, &ClientMessage::HostEdits(edits)).await?;
        match self.reader.next::<AgentMessage>().await? {
            Some(AgentMessage::EditsShown(shown)) => Ok(shown),
            Some(other) => Err(unexpected(&other)),
            None => Err(ClientError::Closed),
        }
    }

    /// Asks the guest to power off (the agent answers, then syncs and resets the VM).
    pub async fn shutdown(self) -> Result<()> {
        match self.request(ClientMessage::Shutdown).await? {
            AgentMessage::Ok => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Sets up the guest's network side (egress CA, environment, proxy listener,
    /// relays of guest loopback ports to the host). Returns the relay ports the agent
    /// could not set up, with why; other relays work regardless.
    pub async fn configure_network(self, config: NetworkConfig) -> Result<Vec<(u16, String)>> {
        match self
            .request(ClientMessage::ConfigureNetwork(config))
            .await?
        {
            AgentMessage::NetworkConfigured { failed_relays } => Ok(failed_relays
                .into_iter()
                .map(|(port, reason)| (port, quoted(&reason)))
                .collect()),
            other => Err(unexpected(&other)),
        }
    }

    /// Connects this connection to the guest's loopback `port` (127.0.0.1, else
    /// `[::1]`); the returned stream carries that TCP connection's bytes. Shutting
    /// down its write side half-closes the guest connection.
    pub async fn connect_port(mut self, port: u16) -> Result<RawStream<S>>
    where
        S: Unpin,
    {
        write_frame(&mut self.writer, &ClientMessage::ConnectPort(port)).await?;
        match self.reader.next::<AgentMessage>().await? {
            Some(AgentMessage::Connected) => {
                // Whatever the frame reader holds past `Connected` is already raw data.
                let (r, pending) = self.reader.into_parts();
                Ok(RawStream::new(pending, r.unsplit(self.writer)))
            }
            Some(other) => Err(unexpected(&other)),
            None => Err(ClientError::Closed),
        }
    }

    /// Starts a command; returns once the agent reports it running (`Started`), or
    /// [`ClientError::NotStarted`] for a program that cannot be run.
    pub async fn exec(mut self, req: ExecRequest) -> Result<ExecSession<S>> {
        write_frame(&mut self.writer, &ClientMessage::Exec(req)).await?;
        match self.reader.next::<AgentMessage>().await? {
            Some(AgentMessage::NotStarted { message, exit_code }) => Err(ClientError::NotStarted {
                message: quoted(&message),
                exit_code,
            }),
            Some(AgentMessage::Started { pid }) => {
                let window = StdinWindow(Arc::new(Semaphore::new(STDIN_WINDOW)));
                Ok(ExecSession {
                    pid,
                    input: ExecInput {
                        writer: self.writer,
                        window: window.clone(),
                    },
                    output: ExecOutput {
                        reader: self.reader,
                        window,
                        done: false,
                    },
                })
            }
            Some(other) => Err(unexpected(&other)),
            None => Err(ClientError::Closed),
        }
    }
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    /// Exit code, if the command exited.
    pub code: Option<i32>,
    /// Signal number, if a signal killed the command.
    pub signal: Option<i32>,
}

impl ExitStatus {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// Something a running command produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    /// The last event: the command ended.
    Exited(ExitStatus),
}

/// Collected result of [`ExecSession::output`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub status: ExitStatus,
}

/// A running command. Use the methods directly, or [`ExecSession::split`] it to feed
/// input and read events from different tasks. Dropping it (closing the
/// connection) before the command exits makes the agent kill the command's process
/// group.
pub struct ExecSession<S = UnixStream> {
    pid: u32,
    input: ExecInput<S>,
    output: ExecOutput<S>,
}

/// The sending half of an exec session.
pub struct ExecInput<S = UnixStream> {
    writer: WriteHalf<S>,
    window: StdinWindow,
}

/// The receiving half of an exec session.
pub struct ExecOutput<S = UnixStream> {
    reader: FrameReader<ReadHalf<S>>,
    /// Grown by each `StdinTaken` read here, for the input half.
    window: StdinWindow,
    done: bool,
}

/// How many bytes of stdin may be sent before the command takes some
/// ([`STDIN_WINDOW`] ahead at most). The output half reads the agent's
/// `StdinTaken`, so it must be read for stdin to go on.
#[derive(Clone)]
pub struct StdinWindow(Arc<Semaphore>);

impl StdinWindow {
    /// Waits until some stdin may be sent; returns how many bytes. Cancel-safe: a
    /// `select!` can wait for this beside signals, and read only as much input as
    /// [`ExecInput::send_stdin`] will then send without waiting.
    pub async fn open(&self) -> usize {
        loop {
            let open = self.0.available_permits();
            if open > 0 {
                return open;
            }
            // Never closed: this only waits.
            if let Ok(permit) = self.0.acquire().await {
                drop(permit);
            }
        }
    }

    async fn take(&self, bytes: usize) {
        let bytes = u32::try_from(bytes.min(STDIN_WINDOW)).unwrap_or(u32::MAX);
        if let Ok(permits) = self.0.acquire_many(bytes).await {
            permits.forget();
        }
    }

    /// What the agent gave back, up to the whole window (an agent cannot grant more).
    fn give_back(&self, taken: u32) {
        let room = STDIN_WINDOW.saturating_sub(self.0.available_permits());
        self.0.add_permits((taken as usize).min(room));
    }
}

impl<S: AsyncRead + AsyncWrite> ExecInput<S> {
    /// Sends bytes to the command's stdin (split into frames of at most [`CHUNK_SIZE`]).
    /// Waits while the command has not taken the [`STDIN_WINDOW`] sent before, which
    /// the output half learns: read it meanwhile (another task, [`ExecSession::output`]),
    /// or wait for [`Self::stdin_window`] first. Not cancel-safe.
    pub async fn send_stdin(&mut self, data: &[u8]) -> Result<()> {
        for chunk in data.chunks(CHUNK_SIZE) {
            self.window.take(chunk.len()).await;
            write_frame(&mut self.writer, &ClientMessage::Stdin(chunk.to_vec())).await?;
        }
        Ok(())
    }

    /// Closes the command's stdin (with a tty: sends `^D`).
    pub async fn close_stdin(&mut self) -> Result<()> {
        Ok(write_frame(&mut self.writer, &ClientMessage::StdinEof).await?)
    }

    /// How much stdin may be sent now, and a way to wait for more.
    pub fn stdin_window(&self) -> StdinWindow {
        self.window.clone()
    }

    /// Resizes the command's terminal (no effect without a tty).
    pub async fn resize(&mut self, rows: u16, cols: u16) -> Result<()> {
        Ok(write_frame(&mut self.writer, &ClientMessage::Resize { rows, cols }).await?)
    }

    /// Sends a signal to the command's process group.
    pub async fn signal(&mut self, signal: i32) -> Result<()> {
        Ok(write_frame(&mut self.writer, &ClientMessage::Signal(signal)).await?)
    }

    /// Says that this output's reader went away: the command's next write there
    /// fails with `EPIPE` (`SIGPIPE`), and the session goes on (no effect with a tty).
    pub async fn close_output(&mut self, stream: OutputStream) -> Result<()> {
        Ok(write_frame(&mut self.writer, &ClientMessage::OutputClosed(stream)).await?)
    }
}

impl<S: AsyncRead + AsyncWrite> ExecOutput<S> {
    /// The next event; `Ok(None)` after [`ExecEvent::Exited`] was returned.
    /// Cancel-safe.
    pub async fn next_event(&mut self) -> Result<Option<ExecEvent>> {
        if self.done {
            return Ok(None);
        }
        loop {
            let msg = match self.reader.next::<AgentMessage>().await {
                Ok(Some(m)) => m,
                Ok(None) | Err(ProtocolError::TruncatedFrame) => return Err(ClientError::Closed),
                Err(e) => return Err(e.into()),
            };
            return match msg {
                AgentMessage::StdinTaken(taken) => {
                    self.window.give_back(taken);
                    continue;
                }
                AgentMessage::Stdout(d) => Ok(Some(ExecEvent::Stdout(d))),
                AgentMessage::Stderr(d) => Ok(Some(ExecEvent::Stderr(d))),
                AgentMessage::Exited { code, signal } => {
                    self.done = true;
                    Ok(Some(ExecEvent::Exited(ExitStatus { code, signal })))
                }
                other => Err(unexpected(&other)),
            };
        }
    }
}

impl<S: AsyncRead + AsyncWrite> ExecSession<S> {
    /// The command's pid in the guest.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn split(self) -> (ExecInput<S>, ExecOutput<S>) {
        (self.input, self.output)
    }

    pub async fn send_stdin(&mut self, data: &[u8]) -> Result<()> {
        self.input.send_stdin(data).await
    }

    pub async fn close_stdin(&mut self) -> Result<()> {
        self.input.close_stdin().await
    }

    pub async fn resize(&mut self, rows: u16, cols: u16) -> Result<()> {
        self.input.resize(rows, cols).await
    }

    pub async fn signal(&mut self, signal: i32) -> Result<()> {
        self.input.signal(signal).await
    }

    pub async fn close_output(&mut self, stream: OutputStream) -> Result<()> {
        self.input.close_output(stream).await
    }

    pub async fn next_event(&mut self) -> Result<Option<ExecEvent>> {
        self.output.next_event().await
    }

    /// Feeds `stdin` (then closes it) while collecting all output until the command
    /// exits. A command that exits without reading all of `stdin` is not an error.
    pub async fn output(self, stdin: &[u8]) -> Result<Output> {
        let (mut input, mut output) = self.split();
        let feed = async {
            if !stdin.is_empty() {
                input.send_stdin(stdin).await?;
            }
            input.close_stdin().await
        };
        let collect = async {
            let mut out = Output {
                stdout: Vec::new(),
                stderr: Vec::new(),
                status: ExitStatus {
                    code: None,
                    signal: None,
                },
            };
            while let Some(ev) = output.next_event().await? {
                match ev {
                    ExecEvent::Stdout(d) => out.stdout.extend(d),
                    ExecEvent::Stderr(d) => out.stderr.extend(d),
                    ExecEvent::Exited(s) => out.status = s,
                }
            }
            Ok::<_, ClientError>(out)
        };
        tokio::pin!(feed);
        tokio::pin!(collect);
        let mut feed_done = false;
        loop {
            tokio::select! {
                r = &mut feed, if !feed_done => {
                    // Write errors are expected when the command exits early; the
                    // collector reports what really happened.
                    let _ = r;
                    feed_done = true;
                }
                r = &mut collect => return r,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket someone else serves (planted where vmctl looks for its VM's) is
    /// refused before a byte is sent on it.
    #[tokio::test]
    async fn a_socket_another_user_serves_is_refused() {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::PermissionsExt;
        // SAFETY: geteuid touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            crate::not_run(
                "client::tests::a_socket_another_user_serves_is_refused",
                "serving a socket as another user needs root",
            );
            return;
        }
        const NOBODY: u32 = 65534;
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let path = dir.path().join("planted.sock");
        // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (slot, byte) in addr.sun_path.iter_mut().zip(path.as_os_str().as_bytes()) {
            *slot = *byte as libc::c_char;
        }
        // SAFETY: the child only makes system calls (no allocation, no locks) until
        // it is killed, as is required after fork in a threaded process.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: plain system calls on values prepared before the fork.
            unsafe {
                libc::setgid(NOBODY);
                libc::setuid(NOBODY);
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
                libc::bind(fd, (&addr as *const libc::sockaddr_un).cast(), len);
                libc::listen(fd, 1);
                loop {
                    libc::pause();
                }
            }
        }
        assert!(child > 0, "fork failed");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !path.exists() && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // Talking to it would wait for an answer that never comes: bounded.
        let refused =
            tokio::time::timeout(std::time::Duration::from_secs(5), connect_unix(&path)).await;
        // SAFETY: `child` is our child process; reaping it frees its slot.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        match refused {
            Ok(Err(ClientError::ForeignPeer { uid, .. })) => assert_eq!(uid, NOBODY),
            Ok(Err(other)) => panic!("refused for another reason: {other}"),
            Ok(Ok(_)) | Err(_) => panic!("talked to another user's socket"),
        }
    }

    #[tokio::test]
    async fn hello_carries_the_hosts_time() {
        let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let (ours, theirs) = tokio::io::duplex(4096);
        let (r, mut w) = tokio::io::split(theirs);
        let agent = tokio::spawn(async move {
            let mut reader = FrameReader::new(r);
            let Ok(Some(ClientMessage::Hello(hello))) = reader.next::<ClientMessage>().await else {
                panic!("expected Hello");
            };
            let ok = AgentMessage::HelloOk {
                agent_version: "test".into(),
                protocol_version: PROTOCOL_VERSION,
            };
            write_frame(&mut w, &ok).await.unwrap();
            hello
        });
        let connection = Connection::handshake(ours).await.unwrap();
        assert_eq!(connection.agent_version(), "test");
        let sent = std::time::Duration::from_nanos(agent.await.unwrap().host_time_ns.unwrap());
        let after = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        assert!(
            (before..=after).contains(&sent),
            "{sent:?} not in {before:?}..{after:?}"
        );
    }

    #[tokio::test]
    async fn an_agent_of_another_protocol_says_how_to_get_a_matching_one() {
        let message = format!("{UNSUPPORTED_VERSION} 3 (this agent 0.0.9 speaks 2)");
        let (ours, theirs) = tokio::io::duplex(4096);
        let (r, mut w) = tokio::io::split(theirs);
        let reply = AgentMessage::Error {
            message: message.clone(),
        };
        tokio::spawn(async move {
            let mut reader = FrameReader::new(r);
            let _hello = reader.next::<ClientMessage>().await;
            write_frame(&mut w, &reply).await.unwrap();
        });
        let Err(err) = Connection::handshake(ours).await else {
            panic!("the handshake succeeded");
        };
        assert!(matches!(err, ClientError::OtherProtocol(_)), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains(&message) && text.contains("vmctl stop"),
            "{text}"
        );
    }

    /// However the connection breaks, the error says it was lost: vmctl then says why
    /// the VM went away, whatever the words of the error.
    #[tokio::test]
    async fn a_connection_that_breaks_is_lost_at_every_step() {
        // In the hybrid handshake: the VMM's socket closes in the middle of its reply.
        let (mut ours, theirs) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let mut reader = tokio::io::BufReader::new(theirs);
            let mut line = String::new();
            tokio::io::AsyncBufReadExt::read_line(&mut reader, &mut line)
                .await
                .unwrap();
            tokio::io::AsyncWriteExt::write_all(reader.get_mut(), b"OK")
                .await
                .unwrap();
        });
        let err = hybrid_connect(&mut ours, 1024).await.unwrap_err();
        assert!(err.is_connection_lost(), "{err:?}");
        assert_eq!(
            err.to_string(),
            "hybrid vsock handshake failed: connection closed after \"OK\" (is the agent \
             listening on port 1024?)"
        );

        // In the Hello exchange: the agent reads Hello and goes.
        let (ours, theirs) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let _hello = FrameReader::new(theirs).next::<ClientMessage>().await;
        });
        let Err(err) = Connection::handshake(ours).await else {
            panic!("the handshake succeeded");
        };
        assert!(matches!(err, ClientError::Closed), "{err:?}");
        assert!(err.is_connection_lost(), "{err:?}");

        // In a command's session: the agent goes after its first output.
        let (ours, theirs) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let (r, mut w) = tokio::io::split(theirs);
            let mut reader = FrameReader::new(r);
            let _hello = reader.next::<ClientMessage>().await;
            let ok = AgentMessage::HelloOk {
                agent_version: "0.0.9".into(),
                protocol_version: PROTOCOL_VERSION,
            };
            write_frame(&mut w, &ok).await.unwrap();
            let _exec = reader.next::<ClientMessage>().await;
            write_frame(&mut w, &AgentMessage::Started { pid: 7 })
                .await
                .unwrap();
            write_frame(&mut w, &AgentMessage::Stdout(b"hi".to_vec()))
                .await
                .unwrap();
        });
        let session = Connection::handshake(ours)
            .await
            .unwrap()
            .exec(ExecRequest::default())
            .await
            .unwrap();
        let (_input, mut output) = session.split();
        assert_eq!(
            output.next_event().await.unwrap(),
            Some(ExecEvent::Stdout(b"hi".to_vec()))
        );
        let err = output.next_event().await.unwrap_err();
        assert!(err.is_connection_lost(), "{err:?}");

        // A reset, wherever it is read.
        let reset = || std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(ClientError::Io(reset()).is_connection_lost());
        assert!(ClientError::Protocol(ProtocolError::Io(reset())).is_connection_lost());
        // Not a lost connection: the agent's refusal, even in those words.
        assert!(!ClientError::Agent("the agent closed the connection".into()).is_connection_lost());
        assert!(!ClientError::Io(std::io::ErrorKind::BrokenPipe.into()).is_connection_lost());
    }

    /// An agent of another protocol (answering its own version only, as agents do)
    /// can still be asked to shut down; one older than the stable messages cannot.
    #[tokio::test]
    async fn an_agent_of_another_protocol_is_greeted_in_its_own_for_a_shutdown() {
        for (spoken, greeted) in [(PROTOCOL_VERSION - 1, true), (2, false)] {
            let dir = tempfile::tempdir().unwrap();
            let socket = dir.path().join("vsock.sock");
            let listener = tokio::net::UnixListener::bind(&socket).unwrap();
            let agent = tokio::spawn(async move {
                let mut requests = Vec::new();
                for _ in 0..2 {
                    let Ok((stream, _)) = listener.accept().await else {
                        break;
                    };
                    let (r, mut w) = tokio::io::split(stream);
                    let mut reader = tokio::io::BufReader::new(r);
                    let mut line = String::new();
                    tokio::io::AsyncBufReadExt::read_line(&mut reader, &mut line)
                        .await
                        .unwrap();
                    assert_eq!(line, "CONNECT 1024\n");
                    tokio::io::AsyncWriteExt::write_all(&mut w, b"OK 7\n")
                        .await
                        .unwrap();
                    let mut reader = FrameReader::new(reader);
                    let Ok(Some(ClientMessage::Hello(hello))) = reader.next().await else {
                        panic!("expected Hello");
                    };
                    if hello.protocol_version != spoken {
                        let message = format!(
                            "{UNSUPPORTED_VERSION} {} (this agent 0.0.9 speaks {spoken})",
                            hello.protocol_version
                        );
                        write_frame(&mut w, &AgentMessage::Error { message })
                            .await
                            .unwrap();
                        continue;
                    }
                    let ok = AgentMessage::HelloOk {
                        agent_version: "0.0.9".into(),
                        protocol_version: spoken,
                    };
                    write_frame(&mut w, &ok).await.unwrap();
                    let request: Option<ClientMessage> = reader.next().await.unwrap();
                    requests.extend(request);
                    write_frame(&mut w, &AgentMessage::Ok).await.unwrap();
                }
                requests
            });
            let asked = connect_hybrid_any_protocol(&socket, 1024).await;
            match asked {
                Ok(connection) => {
                    assert!(greeted, "greeted an agent of protocol {spoken}");
                    assert_eq!(connection.protocol_version(), spoken);
                    connection.shutdown().await.unwrap();
                    assert_eq!(agent.await.unwrap(), vec![ClientMessage::Shutdown]);
                }
                Err(ClientError::OtherProtocol(said)) => {
                    assert!(!greeted, "refused protocol {spoken}: {said}");
                    agent.abort();
                }
                Err(other) => panic!("{other}"),
            }
        }
    }

    #[test]
    fn advice_on_another_protocol_says_which_side_is_older() {
        let said = |spoken: u32| {
            format!("{UNSUPPORTED_VERSION} {PROTOCOL_VERSION} (this agent 9.9 speaks {spoken})")
        };
        let newer = other_protocol_advice(&said(PROTOCOL_VERSION + 1));
        assert!(
            newer.contains("use that vmctl") && !newer.contains("vmctl stop"),
            "{newer}"
        );
        let older = other_protocol_advice(&said(PROTOCOL_VERSION - 1));
        assert!(older.contains("vmctl stop"), "{older}");
    }

    /// A guest's words in the host's errors stay on their line, and short: a line
    /// break in them could start a line that passes for vmctl's own.
    #[tokio::test]
    async fn the_agents_words_are_quoted_on_one_line_and_cut() {
        let forged = format!("no\nvmctl: error: fake\x1b[2J{}", "x".repeat(10_000));
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        let (r, mut w) = tokio::io::split(theirs);
        let reply = AgentMessage::Error {
            message: forged.clone(),
        };
        tokio::spawn(async move {
            let mut reader = FrameReader::new(r);
            let _hello = reader.next::<ClientMessage>().await;
            let ok = AgentMessage::HelloOk {
                agent_version: "test".into(),
                protocol_version: PROTOCOL_VERSION,
            };
            write_frame(&mut w, &ok).await.unwrap();
            let _health = reader.next::<ClientMessage>().await;
            write_frame(&mut w, &reply).await.unwrap();
        });
        let connection = Connection::handshake(ours).await.unwrap();
        let err = connection.health().await.unwrap_err();
        let text = err.to_string();
        assert!(!text.contains('\n') && !text.contains('\x1b'), "{text:?}");
        assert!(text.contains("no\\nvmctl: error: fake"), "{text:?}");
        assert!(text.len() < 400, "{} bytes", text.len());
        assert_eq!(quoted("plain words"), "plain words");
        assert_eq!(quoted("a\u{2028}b\u{202e}c"), "a\\u{2028}b\\u{202e}c");
    }
}
