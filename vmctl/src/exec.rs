//! Running commands in a workspace VM through its guest agent: `vmctl exec` and
//! `vmctl shell`, with stdio relayed, the terminal in raw mode for a PTY, window size
//! followed and the exit code propagated.

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use guest_agent::client::{self, ExecEvent};
use guest_agent::protocol::{ExecRequest, OutputStream, TtyRequest, User};
use tokio::signal::unix::{signal, SignalKind};

use crate::state::VmDir;

/// The most stdin read at once (it is then sent as one frame).
const STDIN_READ: usize = 32 * 1024;
/// Output messages (each at most 32 KiB) waiting for the thread that writes them
/// before output is no longer read from the agent, which then stops the command.
const OUTPUT_QUEUE: usize = 4;
/// The vsock port the guest agent listens on.
pub const AGENT_PORT: u32 = 1024;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("cannot reach the guest agent through {}: {reason}", .socket.display())]
    Connect {
        socket: std::path::PathBuf,
        reason: client::ClientError,
    },
    #[error("the command's session failed: {0}")]
    Session(client::ClientError),
    #[error(
        "the guest agent did not start the command within {} s; the VM may be stuck \
         (`vmctl ps` shows it, `vmctl stop` stops it)",
        AGENT_TIMEOUT.as_secs()
    )]
    NotStarted,
    #[error(
        "cannot write the command's {stream}: {source}; the command was stopped (make \
         room where the output goes, or send it elsewhere)"
    )]
    Output {
        stream: &'static str,
        source: std::io::Error,
    },
    #[error(
        "the command's arguments and environment take {size} bytes, more than the {} the \
         guest agent takes in one request; pass a long list in a file, or on stdin (to \
         `xargs` in the VM)",
        guest_agent::protocol::MAX_FRAME_SIZE
    )]
    TooLong { size: usize },
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("the thread that writes the command's output: {0}")]
    OutputThread(std::io::Error),
    #[error("cannot start the thread that reads stdin: {0}")]
    StdinThread(std::io::Error),
}

impl ExecError {
    /// Whether the connection to the guest agent broke, while connecting or during the
    /// session: what a VM that went away does ([`crate::lost_vm::explain`]).
    pub fn is_connection_lost(&self) -> bool {
        match self {
            ExecError::Connect { reason, .. } | ExecError::Session(reason) => {
                reason.is_connection_lost()
            }
            _ => false,
        }
    }
}

/// What to run. Arguments, values and the directory go to the guest as the bytes they
/// are (they need not be UTF-8); variable names are text.
pub struct ExecOptions {
    pub argv: Vec<OsString>,
    pub env: Vec<(String, OsString)>,
    pub cwd: Option<PathBuf>,
    pub user: User,
    pub tty: bool,
    /// Whether vmctl's stdin is the command's; otherwise the command reads end of
    /// file at once, and vmctl reads none of its stdin (a loop reading its list from
    /// it keeps the rest).
    pub stdin: bool,
}

/// Where a command started in the host directory `host_dir` runs in `vm`: at the same
/// files in the guest when a share holds them, else at the workspace's root, never in
/// a directory of the guest's own, whose files would go with the VM. (Should the VM's
/// record be unreadable, the guest agent decides: `host_dir` if the guest has it, else
/// the home directory.)
pub fn guest_cwd(vm: &VmDir, host_dir: &Path) -> PathBuf {
    let host_dir = host_dir
        .canonicalize()
        .unwrap_or_else(|_| host_dir.to_path_buf());
    // A path, never text: a name that is not UTF-8 reaches the guest as it is.
    match vm.read_record() {
        Ok(record) => record
            .shares
            .and_then(|set| set.guest_path_of(&host_dir))
            .unwrap_or(record.workspace),
        Err(_) => host_dir,
    }
}

/// Parses `--user`: empty/default → the host user, `root`, or a guest account name.
pub fn parse_user(user: Option<&str>) -> User {
    match user {
        None | Some("") => User::Default,
        Some("root") => User::Root,
        Some(name) => User::Named(name.to_string()),
    }
}

/// Runs the command in the VM behind `socket`; returns its exit code (128+N when a
/// signal N killed it).
pub fn run(socket: &Path, options: ExecOptions) -> Result<u8, ExecError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ExecError::Runtime)?;
    let outcome = runtime.block_on(relay(socket, options));
    // What is left of the session's tasks is not waited for, as a plain drop of the
    // runtime would.
    runtime.shutdown_background();
    outcome
}

/// How long the guest agent may take to answer a call: start a command (until then
/// the terminal is still cooked, so Ctrl-C works), list ports, apply the network
/// setup. The bound is for a VM whose vsock answers but whose agent is stuck.
pub const AGENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Why one call to the guest agent ([`call_agent`]) failed.
#[derive(Debug)]
pub enum AgentCallError {
    /// Its vsock socket did not take the connection.
    Connect(client::ClientError),
    /// The agent took it and refused or broke the call.
    Call(client::ClientError),
    /// No answer within [`AGENT_TIMEOUT`].
    Timeout,
}

impl AgentCallError {
    /// One line for the user; `timed_out` says what did not happen in time.
    pub fn describe(&self, timed_out: &str) -> String {
        match self {
            AgentCallError::Connect(e) => format!("cannot reach the guest agent: {e}"),
            AgentCallError::Call(e) => e.to_string(),
            AgentCallError::Timeout => format!(
                "{timed_out} within {} s; the VM may be stuck (`vmctl stop` stops it)",
                AGENT_TIMEOUT.as_secs()
            ),
        }
    }
}

/// Connects to the guest agent behind `vsock` and makes one `call` on the connection,
/// both within [`AGENT_TIMEOUT`].
pub async fn call_agent<T, F, Fut>(vsock: &Path, call: F) -> Result<T, AgentCallError>
where
    F: FnOnce(client::Connection) -> Fut,
    Fut: std::future::Future<Output = client::Result<T>>,
{
    let attempt = async {
        let connection = client::connect_hybrid(vsock, AGENT_PORT)
            .await
            .map_err(AgentCallError::Connect)?;
        call(connection).await.map_err(AgentCallError::Call)
    };
    tokio::time::timeout(AGENT_TIMEOUT, attempt)
        .await
        .map_err(|_| AgentCallError::Timeout)?
}

async fn relay(socket: &Path, options: ExecOptions) -> Result<u8, ExecError> {
    // Listened for before the size is read: a resize while the command starts (an
    // IDE's terminal settling) is then sent once it runs, not lost.
    let mut winch = options
        .tty
        .then(|| signal(SignalKind::window_change()).ok())
        .flatten();
    let tty = options.tty.then(|| {
        let (rows, cols) = terminal_size().unwrap_or((24, 80));
        TtyRequest {
            rows,
            cols,
            term: std::env::var("TERM").unwrap_or_else(|_| "xterm-256color".into()),
        }
    });
    let request = ExecRequest {
        argv: options.argv.into_iter().map(OsString::into_vec).collect(),
        env: options
            .env
            .into_iter()
            .map(|(name, value)| (name, value.into_vec()))
            .collect(),
        cwd: options.cwd.map(|dir| dir.into_os_string().into_vec()),
        user: options.user,
        tty,
        umask: own_umask(),
    };
    // The agent takes requests of a bounded size: a command line past it is said so,
    // with what to do, not as a protocol error once sent.
    let exec = guest_agent::protocol::ClientMessage::Exec(request.clone());
    if let Err(guest_agent::protocol::ProtocolError::FrameTooLarge(size)) =
        guest_agent::protocol::encode_frame(&exec)
    {
        return Err(ExecError::TooLong { size });
    }
    // A program the guest cannot run is the command's outcome, as in a shell: its
    // words on stderr, and 127 or 126.
    let started = call_agent(socket, |connection| async move {
        match connection.exec(request).await {
            Err(client::ClientError::NotStarted { message, exit_code }) => {
                Ok(Err((message, exit_code)))
            }
            started => started.map(Ok),
        }
    })
    .await
    .map_err(|e| match e {
        AgentCallError::Connect(reason) => ExecError::Connect {
            socket: socket.to_path_buf(),
            reason,
        },
        AgentCallError::Call(reason) => ExecError::Session(reason),
        AgentCallError::Timeout => ExecError::NotStarted,
    })?;
    let session = match started {
        Ok(session) => session,
        Err((message, exit_code)) => {
            vmm::to_stderr!("vmctl: {message} (in the VM)");
            return Ok(exit_code);
        }
    };
    // Raw from here on: keys, Ctrl-C included, go to the command's PTY.
    let _raw = if options.tty {
        RawTerminal::enter()
    } else {
        None
    };
    let (mut input, output) = session.split();
    let is_tty = options.tty;
    let forward_stdin = options.stdin;
    // Set when we stop waiting for a command that a signal did not end.
    let (give_up, gave_up) = tokio::sync::mpsc::channel::<GiveUp>(1);
    // An output whose reader went away, for the agent to close in the guest.
    let (close_output, mut outputs_closed) = tokio::sync::mpsc::channel::<OutputStream>(2);

    // Signals have a task of their own: a write to the agent that blocks (a guest that
    // stops reading) must not keep vmctl from giving up on the command.
    let (signals, signal_source) = signals_received();
    let (forward_signal, mut signals_to_forward) = tokio::sync::mpsc::channel::<i32>(1);
    let watch = tokio::spawn(watch_signals(signals, forward_signal, give_up));

    // Host → guest: stdin, window resizes, and (without a PTY) Ctrl-C / SIGTERM.
    let mut stdin = forward_stdin
        .then(|| crate::stdin_reader::StdinReader::start(rustix::stdio::stdin()))
        .transpose()
        .map_err(ExecError::StdinThread)?;
    let forward = tokio::spawn(async move {
        // Input is read only as far as the agent will take it at once, so a signal
        // never waits behind stdin that a command does not read.
        let window = input.stdin_window();
        if !forward_stdin && input.close_stdin().await.is_err() {
            return;
        }
        loop {
            tokio::select! {
                read = async {
                    let open = window.open().await;
                    match &mut stdin {
                        Some(stdin) => stdin.read(open.min(STDIN_READ)).await,
                        None => Ok(Vec::new()),
                    }
                }, if stdin.is_some() => {
                    match read {
                        Ok(bytes) if !bytes.is_empty() => {
                            if input.send_stdin(&bytes).await.is_err() { return; }
                        }
                        Ok(_) | Err(_) => {
                            // Its end: the reader (and its thread) goes.
                            stdin = None;
                            if input.close_stdin().await.is_err() { return; }
                        }
                    }
                },
                Some(()) = recv(&mut winch), if is_tty => {
                    if let Some((rows, cols)) = terminal_size() {
                        if input.resize(rows, cols).await.is_err() { return; }
                    }
                },
                Some(stream) = outputs_closed.recv() => {
                    if input.close_output(stream).await.is_err() { return; }
                },
                Some(signal) = signals_to_forward.recv() => {
                    if input.signal(signal).await.is_err() { return; }
                },
                // Nothing more to send; the session stays open until the command ends.
                else => std::future::pending().await,
            }
        }
    });

    let writer = OutputWriter::start(std::io::stdout(), std::io::stderr())
        .map_err(ExecError::OutputThread)?;
    let outcome = relay_output(output, writer, gave_up, close_output, is_tty, interrupted).await;
    forward.abort();
    watch.abort();
    signal_source.abort();
    outcome
}

/// The first SIGINT or SIGTERM that [`signals_received`] took (0: none yet).
static FIRST_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// Ends vmctl by the signal it took, when `code` (what it would exit with) says that
/// signal ended the command: as a local command would end. A shell that ran vmctl
/// (in a loop, a script) stops at Ctrl-C only when its child died of SIGINT: it takes
/// a child that exits 130 to have handled the Ctrl-C, and goes on. Returns otherwise.
pub(crate) fn end_by_the_signal_that_ended_it(code: u8) {
    let Some(signal) =
        signal_to_end_by(code, FIRST_SIGNAL.load(std::sync::atomic::Ordering::SeqCst))
    else {
        return;
    };
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: puts back the default action of a signal vmctl handled (tokio's handler
    // only notes it) and raises it in this thread; neither touches memory of ours.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

/// The signal to end by: `first`, the signal vmctl took, when `code` is 128 + it.
fn signal_to_end_by(code: u8, first: i32) -> Option<i32> {
    (first != 0 && i32::from(code) == 128 + first).then_some(first)
}

/// SIGINT and SIGTERM as they come, from now on, and the task that listens for them.
pub(crate) fn signals_received() -> (
    tokio::sync::mpsc::Receiver<i32>,
    tokio::task::JoinHandle<()>,
) {
    let (sender, signals) = tokio::sync::mpsc::channel(4);
    let mut interrupt = signal(SignalKind::interrupt()).ok();
    let mut terminate = signal(SignalKind::terminate()).ok();
    let source = tokio::spawn(async move {
        loop {
            let received = tokio::select! {
                Some(()) = recv(&mut interrupt) => libc::SIGINT,
                Some(()) = recv(&mut terminate) => libc::SIGTERM,
            };
            let _ = FIRST_SIGNAL.compare_exchange(
                0,
                received,
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
            );
            if sender.send(received).await.is_err() {
                return;
            }
        }
    });
    (signals, source)
}

/// Has the first of `signals` forwarded to the command (by the task that writes to
/// the agent, through `forward`), and gives up on the command at a second one, or
/// when the first has not ended it within [`SIGNAL_GRACE`]. Whether or not the
/// forwarding got through: a guest that stops reading cannot keep vmctl waiting.
async fn watch_signals(
    mut signals: tokio::sync::mpsc::Receiver<i32>,
    forward: tokio::sync::mpsc::Sender<i32>,
    give_up: tokio::sync::mpsc::Sender<GiveUp>,
) {
    let Some(first) = signals.recv().await else {
        return;
    };
    // The only signal ever forwarded: there is room for it.
    let _ = forward.try_send(first);
    let deadline = tokio::time::Instant::now() + SIGNAL_GRACE;
    let reason = tokio::select! {
        Some(again) = signals.recv() => GiveUp::Again(again),
        () = tokio::time::sleep_until(deadline) => GiveUp::Timeout(first),
    };
    let _ = give_up.send(reason).await;
}

/// Passes the command's output on to where it goes on the host until the command
/// exited and what it wrote is written, or `vmctl` gives up on it; returns its exit
/// code. The writes are [`OutputWriter`]'s, off the runtime's one thread, so a write
/// that blocks (a reader that stalls, Ctrl-S) holds up neither the forwarding of a
/// signal nor giving up: `timeout 10 vmctl exec -- cmd | stalled` ends. After the
/// exit, while output is still being written, the first signal of
/// `after_exit_signal()` ends `vmctl` as it would a local command still writing.
async fn relay_output<S, F, Fut>(
    mut output: client::ExecOutput<S>,
    writer: OutputWriter,
    mut gave_up: tokio::sync::mpsc::Receiver<GiveUp>,
    close_output: tokio::sync::mpsc::Sender<OutputStream>,
    is_tty: bool,
    after_exit_signal: F,
) -> Result<u8, ExecError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite,
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = i32>,
{
    let OutputWriter {
        queue,
        mut failures,
    } = writer;
    let outcome = loop {
        // Room for the event first: while the writer lags, no more output is read.
        let (room, event) = tokio::select! {
            next = async { (queue.reserve().await, output.next_event().await) } => next,
            Some((stream, source)) = failures.recv() => {
                match output_failed(stream, source, is_tty, &close_output).await {
                    Some(end) => return end,
                    None => continue,
                }
            }
            Some(reason) = gave_up.recv() => return Ok(tell_gave_up(&reason, is_tty)),
        };
        let (stream, bytes) = match event {
            Ok(Some(ExecEvent::Stdout(bytes))) => (OutputStream::Stdout, bytes),
            Ok(Some(ExecEvent::Stderr(bytes))) => (OutputStream::Stderr, bytes),
            Ok(Some(ExecEvent::Exited(status))) => {
                break Ok(exit_code(status.code, status.signal));
            }
            // `None` comes only after `Exited`, which ends the loop.
            Ok(None) => break Err(ExecError::Session(client::ClientError::Closed)),
            Err(e) => break Err(ExecError::Session(e)),
        };
        let Ok(room) = room else {
            return Err(ExecError::OutputThread(std::io::Error::other("it ended")));
        };
        room.send((stream, bytes));
    };
    // What came before is written, then the outcome is told; the writer ends once it
    // has written all that is queued.
    drop(queue);
    let mut signalled = std::pin::pin!(after_exit_signal());
    loop {
        tokio::select! {
            failure = failures.recv() => match failure {
                None => return outcome,
                Some((stream, source)) => {
                    if let Some(end) = output_failed(stream, source, is_tty, &close_output).await {
                        return end;
                    }
                }
            },
            signal = &mut signalled => return Ok(exit_code(None, Some(signal))),
            // A signal forwarded before the exit (`timeout` sends one, once) still
            // ends vmctl in its time while the output waits for a stalled reader.
            Some(reason) = gave_up.recv() => return Ok(tell_gave_up(&reason, is_tty)),
        }
    }
}

/// Says why vmctl stopped waiting for the command; returns the exit code for it. On
/// a terminal still raw, a line feed alone would not return the carriage.
fn tell_gave_up(reason: &GiveUp, is_tty: bool) -> u8 {
    if is_tty {
        vmm::to_stderr!("\r\nvmctl: {reason}\r");
    } else {
        vmm::to_stderr!("vmctl: {reason}");
    }
    reason.exit_code()
}

/// What to do after a write of `stream` failed: nothing more (its reader went away
/// without a PTY: the agent is told, to close that output in the guest), or end with
/// this outcome.
async fn output_failed(
    stream: OutputStream,
    source: std::io::Error,
    is_tty: bool,
    close_output: &tokio::sync::mpsc::Sender<OutputStream>,
) -> Option<Result<u8, ExecError>> {
    match output_lost(stream, source) {
        OutputLost::ReaderGone if !is_tty => {
            // The forward task may be gone (a write to the agent failed): nothing to tell.
            let _ = close_output.send(stream).await;
            None
        }
        // Closing the session (returning) makes the guest agent end the command.
        OutputLost::ReaderGone => Some(Ok(exit_code(None, Some(libc::SIGPIPE)))),
        OutputLost::Failed(e) => Some(Err(e)),
    }
}

/// The first SIGINT or SIGTERM from now on: with the command gone, nobody to forward
/// it to.
async fn interrupted() -> i32 {
    let mut interrupt = signal(SignalKind::interrupt()).ok();
    let mut terminate = signal(SignalKind::terminate()).ok();
    tokio::select! {
        Some(()) = recv(&mut interrupt) => libc::SIGINT,
        Some(()) = recv(&mut terminate) => libc::SIGTERM,
        else => std::future::pending().await,
    }
}

/// The thread that writes the command's output where it goes on the host, in order,
/// so that the runtime's one thread never waits for a write: a blocked stdout (a
/// reader that stalls, Ctrl-S) must not stop signals from being forwarded, nor
/// `vmctl` from giving up. After a failed write it writes nothing more to that output
/// and says why on `failures`; it ends once `queue` is dropped and all of it written.
struct OutputWriter {
    queue: tokio::sync::mpsc::Sender<(OutputStream, Vec<u8>)>,
    failures: tokio::sync::mpsc::UnboundedReceiver<(OutputStream, std::io::Error)>,
}

impl OutputWriter {
    fn start(
        stdout: impl Write + Send + 'static,
        stderr: impl Write + Send + 'static,
    ) -> std::io::Result<Self> {
        let (queue, mut writes) =
            tokio::sync::mpsc::channel::<(OutputStream, Vec<u8>)>(OUTPUT_QUEUE);
        let (failed, failures) = tokio::sync::mpsc::unbounded_channel();
        std::thread::Builder::new()
            .name("vmctl-output".into())
            .spawn(move || {
                let mut outputs = HostOutputs {
                    stdout: Some(stdout),
                    stderr: Some(stderr),
                };
                while let Some((stream, bytes)) = writes.blocking_recv() {
                    if let Err(source) = outputs.write(stream, &bytes) {
                        outputs.close(stream);
                        let _ = failed.send((stream, source));
                    }
                }
            })?;
        Ok(Self { queue, failures })
    }
}

/// The host's ends of the command's output, each until its reader goes away.
struct HostOutputs<O, E> {
    stdout: Option<O>,
    stderr: Option<E>,
}

impl<O: Write, E: Write> HostOutputs<O, E> {
    /// Writes `bytes` where `stream` goes on the host; what comes for an output
    /// whose reader went away is dropped, as a closed pipe would have.
    fn write(&mut self, stream: OutputStream, bytes: &[u8]) -> std::io::Result<()> {
        match stream {
            OutputStream::Stdout => self
                .stdout
                .as_mut()
                .map_or(Ok(()), |s| write_output(s, bytes)),
            OutputStream::Stderr => self
                .stderr
                .as_mut()
                .map_or(Ok(()), |s| write_output(s, bytes)),
        }
    }

    fn close(&mut self, stream: OutputStream) {
        match stream {
            OutputStream::Stdout => self.stdout = None,
            OutputStream::Stderr => self.stderr = None,
        }
    }
}

fn write_output(sink: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    sink.write_all(bytes)?;
    sink.flush()
}

/// What a failed write of the command's output means.
#[derive(Debug)]
enum OutputLost {
    /// Its reader went away (`vmctl exec -- yes | head -1`). Without a PTY the agent
    /// closes that output in the guest too, so the command's next write there fails
    /// as it would have on the host (`yes` dies of SIGPIPE, 141), and the command goes
    /// on. With a PTY the session ends (the command gets SIGHUP) and `vmctl` exits
    /// 141, silently, as a local command killed by SIGPIPE would.
    ReaderGone,
    /// Anything else (a full disk, an I/O error) is said: output must not be lost
    /// without a word.
    Failed(ExecError),
}

fn output_lost(stream: OutputStream, source: std::io::Error) -> OutputLost {
    if source.kind() == std::io::ErrorKind::BrokenPipe {
        OutputLost::ReaderGone
    } else {
        let stream = match stream {
            OutputStream::Stdout => "standard output",
            OutputStream::Stderr => "standard error",
        };
        OutputLost::Failed(ExecError::Output { stream, source })
    }
}

/// How long a command may take to exit after a forwarded Ctrl-C or SIGTERM before
/// `vmctl` stops waiting (the guest may be stuck, or the command ignores it).
const SIGNAL_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Why `vmctl` stopped waiting for the command. Closing the session then makes the
/// guest agent kill it (as when `vmctl` dies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GiveUp {
    /// The command was still running [`SIGNAL_GRACE`] after this signal.
    Timeout(i32),
    /// This signal came after one was already forwarded.
    Again(i32),
}

impl GiveUp {
    /// As if the signal had killed the command.
    fn exit_code(self) -> u8 {
        let (GiveUp::Timeout(signal) | GiveUp::Again(signal)) = self;
        exit_code(None, Some(signal))
    }
}

impl std::fmt::Display for GiveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = |signal: i32| match signal {
            libc::SIGINT => "Ctrl-C (SIGINT)",
            libc::SIGTERM => "SIGTERM",
            _ => "the signal",
        };
        match *self {
            GiveUp::Timeout(signal) => write!(
                f,
                "the command is still running {} s after {}; not waiting for it any longer \
                 (the guest agent ends it; if the VM is stuck, 'vmctl stop' it)",
                SIGNAL_GRACE.as_secs(),
                name(signal)
            ),
            GiveUp::Again(signal) => write!(
                f,
                "{} again: not waiting for the command any longer (the guest agent ends it)",
                name(signal)
            ),
        }
    }
}

async fn recv(signal: &mut Option<tokio::signal::unix::Signal>) -> Option<()> {
    match signal {
        Some(signal) => signal.recv().await,
        None => std::future::pending().await,
    }
}

pub(crate) fn exit_code(code: Option<i32>, signal: Option<i32>) -> u8 {
    match (code, signal) {
        // No exit status is out of 0..=255: a guest that says so did not succeed.
        (Some(code), _) => u8::try_from(code).unwrap_or(255),
        (None, Some(signal @ 1..=127)) => 128 + signal as u8,
        _ => 1,
    }
}

/// This process's file mode creation mask, as /proc says it: asking umask(2) would
/// set it for a moment, for every thread. `None` where /proc does not say.
fn own_umask() -> Option<u32> {
    umask_in_status(&std::fs::read_to_string("/proc/self/status").ok()?)
}

/// The `Umask:` of a `/proc/PID/status` text (Linux 4.7+).
fn umask_in_status(status: &str) -> Option<u32> {
    let value = status
        .lines()
        .find_map(|line| line.strip_prefix("Umask:"))?;
    u32::from_str_radix(value.trim(), 8).ok()
}

/// The host terminal's size, when stdin is one.
fn terminal_size() -> Option<(u16, u16)> {
    // SAFETY: winsize is plain data that TIOCGWINSZ fills on success.
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: `size` is a valid, writable winsize for the ioctl.
    let rc = unsafe { libc::ioctl(0, libc::TIOCGWINSZ, &mut size) };
    (rc == 0 && size.ws_row > 0).then_some((size.ws_row, size.ws_col))
}

/// Raw mode on the host terminal for the life of a PTY session; restored on drop, and
/// by the panic hook ([`restore_on_panic`]).
struct RawTerminal {
    saved: libc::termios,
}

/// The settings a raw session saved, while it lasts: vmctl's release build aborts on
/// panic, running no destructor, and a panic mid-session would leave the user's
/// terminal raw (no echo, no line editing) after vmctl is gone.
static SAVED_TERMINAL: std::sync::Mutex<Option<libc::termios>> = std::sync::Mutex::new(None);

/// Has a panic put the terminal back as [`SAVED_TERMINAL`] holds it, before the
/// panic's message (which must be readable) and whatever the hook before did.
fn restore_on_panic() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let saved = *SAVED_TERMINAL.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(saved) = saved {
                // SAFETY: restores the termios read from the same descriptor.
                unsafe { libc::tcsetattr(0, libc::TCSANOW, &saved) };
            }
            previous(info);
        }));
    });
}

impl RawTerminal {
    fn enter() -> Option<Self> {
        // SAFETY: isatty only inspects the descriptor.
        if unsafe { libc::isatty(0) } != 1 {
            return None;
        }
        // SAFETY: termios is plain data; tcgetattr fills it on success (checked).
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `saved` is a valid termios.
        if unsafe { libc::tcgetattr(0, &mut saved) } != 0 {
            return None;
        }
        restore_on_panic();
        *SAVED_TERMINAL.lock().unwrap_or_else(|e| e.into_inner()) = Some(saved);
        crate::terminal::make_raw(&std::io::stdin()).ok()?;
        Some(Self { saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        *SAVED_TERMINAL.lock().unwrap_or_else(|e| e.into_inner()) = None;
        // SAFETY: restores the termios read from the same descriptor.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &self.saved) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;

    /// A panic in a raw session puts the terminal back, with no destructor run (the
    /// release build aborts). (Review: the user's terminal stayed raw.) Run in a child
    /// of this test, on a pseudo-terminal this test made, which it then looks at.
    #[test]
    fn a_panic_in_a_raw_session_puts_the_terminal_back() {
        const CHILD: &str = "VMCTL_TEST_PANIC_RAW";
        if std::env::var_os(CHILD).is_some() {
            let raw = RawTerminal::enter().expect("stdin is a terminal");
            std::mem::forget(raw);
            panic!("a bug mid-session");
        }
        let (mut master, mut slave) = (-1, -1);
        // SAFETY: openpty writes the two descriptors; the other arguments may be null.
        let opened = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(opened, 0, "{}", std::io::Error::last_os_error());
        // SAFETY: both were just opened and are ours alone.
        let (_master, slave) = unsafe {
            use std::os::fd::FromRawFd;
            (
                std::os::fd::OwnedFd::from_raw_fd(master),
                std::os::fd::OwnedFd::from_raw_fd(slave),
            )
        };
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "exec::tests::a_panic_in_a_raw_session_puts_the_terminal_back",
                "--exact",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .stdin(slave.try_clone().unwrap())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(!status.success(), "the child did not panic: {status}");
        // SAFETY: termios is plain data that tcgetattr fills (checked).
        let mut termios: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `termios` is a valid, writable termios; the descriptor is open.
        let got = unsafe { libc::tcgetattr(std::os::fd::AsRawFd::as_raw_fd(&slave), &mut termios) };
        assert_eq!(got, 0);
        assert_ne!(
            termios.c_lflag & libc::ICANON,
            0,
            "left raw: no line editing"
        );
        assert_ne!(termios.c_lflag & libc::ECHO, 0, "left raw: no echo");
    }

    /// vmctl, having taken a SIGINT that ended the command (exit code 130), dies of
    /// SIGINT rather than exit 130, so that a shell loop around it stops. (Review: one
    /// Ctrl-C ended only the current `vmctl exec` of a `for` loop.) Run in a child of
    /// this test, which the signal ends.
    #[test]
    fn vmctl_dies_of_the_signal_it_took_when_that_ended_the_command() {
        const CHILD: &str = "VMCTL_TEST_END_BY_SIGNAL";
        if std::env::var_os(CHILD).is_some() {
            FIRST_SIGNAL.store(libc::SIGINT, std::sync::atomic::Ordering::SeqCst);
            // The command ended otherwise (its own exit 143): vmctl exits with that.
            end_by_the_signal_that_ended_it(128 + libc::SIGTERM as u8);
            end_by_the_signal_that_ended_it(128 + libc::SIGINT as u8);
            std::process::exit(0);
        }
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "exec::tests::vmctl_dies_of_the_signal_it_took_when_that_ended_the_command",
                "--exact",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGINT),
            "{status}"
        );
        // No signal taken: the guest's own SIGINT is an exit code like any.
        assert_eq!(signal_to_end_by(130, 0), None);
        assert_eq!(signal_to_end_by(143, libc::SIGTERM), Some(libc::SIGTERM));
    }

    #[test]
    fn a_command_runs_at_its_directorys_place_in_the_guest_else_at_the_workspace() {
        let host = tempfile::tempdir().unwrap();
        let workspace = host.path().join("project");
        let elsewhere = host.path().join("elsewhere");
        std::fs::create_dir_all(workspace.join("src")).unwrap();
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::os::unix::fs::symlink(workspace.join("src"), host.path().join("link")).unwrap();
        let vm = VmDir {
            path: host.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        // A name that is not UTF-8 (Latin-1): the guest has it byte for byte.
        let latin1 = workspace.join(std::ffi::OsStr::from_bytes(b"d\xe9j\xe0"));
        std::fs::create_dir(&latin1).unwrap();
        let canonical = workspace.canonicalize().unwrap();
        let cwd = |dir: &Path| guest_cwd(&vm, dir);

        // No record: the host path as it is, for the agent to judge.
        assert_eq!(cwd(&elsewhere), elsewhere);
        assert_eq!(cwd(&latin1), latin1);

        vm.write_record(&crate::state::test_record(&vm, &canonical))
            .unwrap();
        assert_eq!(cwd(&workspace.join("src")), canonical.join("src"));
        assert_eq!(cwd(&host.path().join("link")), canonical.join("src"));
        assert_eq!(cwd(&latin1), canonical.join(latin1.file_name().unwrap()));
        assert_eq!(cwd(&elsewhere), canonical);
        assert_eq!(cwd(Path::new("/")), canonical);
    }

    /// `argv` run as the default user, in the default directory, without a terminal
    /// or stdin.
    fn plain(argv: Vec<OsString>) -> ExecOptions {
        ExecOptions {
            argv,
            env: Vec::new(),
            cwd: None,
            user: User::Default,
            tty: false,
            stdin: false,
        }
    }

    /// A VM whose vsock accepts but whose agent never answers: `vmctl exec` gives up
    /// (before raw mode, so Ctrl-C works meanwhile) instead of waiting forever.
    #[tokio::test(start_paused = true)]
    async fn an_agent_that_never_starts_the_command_is_given_up_on() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock");
        let _silent = tokio::net::UnixListener::bind(&socket).unwrap();
        let options = ExecOptions {
            stdin: true,
            ..plain(vec!["true".into()])
        };
        let err = tokio::time::timeout(AGENT_TIMEOUT * 2, relay(&socket, options))
            .await
            .expect("still waiting for the agent after twice the start timeout")
            .unwrap_err();
        assert!(matches!(err, ExecError::NotStarted), "{err}");
        assert!(err.to_string().contains("vmctl stop"), "{err}");
    }

    /// An agent that goes away (its VM stopped) while connecting or while the command
    /// runs fails the session with a lost connection, which [`crate::lost_vm::explain`]
    /// explains, whatever the words of the client's error.
    #[tokio::test]
    async fn an_agent_that_goes_away_loses_the_connection() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let removed = "; the VM was removed (`vmctl rm`), its logs with it";

        // While connecting: the VMM's socket closes before its `OK`.
        let socket = dir.path().join("vsock.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let mut reader = tokio::io::BufReader::new(stream);
            let mut line = String::new();
            let _ = tokio::io::AsyncBufReadExt::read_line(&mut reader, &mut line).await;
        });
        let options = plain(vec!["true".into()]);
        let err = relay(&socket, options).await.unwrap_err();
        assert!(matches!(err, ExecError::Connect { .. }), "{err}");
        assert!(err.is_connection_lost(), "{err}");
        assert_eq!(
            crate::lost_vm::explain(&vm, &err),
            format!("{err}{removed}")
        );

        // While the command runs: the agent goes after `Started`.
        let (output, _input) = session_with(Vec::new(), AfterMessages::GoAway).await;
        let writer = OutputWriter::start(std::io::sink(), std::io::sink()).unwrap();
        let (_give_up, gave_up) = tokio::sync::mpsc::channel(1);
        let (close_output, _closed) = tokio::sync::mpsc::channel(2);
        let err = relay_output(
            output,
            writer,
            gave_up,
            close_output,
            false,
            std::future::pending::<i32>,
        )
        .await
        .unwrap_err();
        assert!(matches!(err, ExecError::Session(_)), "{err}");
        assert!(err.is_connection_lost(), "{err}");
        assert_eq!(
            crate::lost_vm::explain(&vm, &err),
            format!("{err}{removed}")
        );
    }

    /// The command starts with vmctl's umask, read from /proc. (Review: a 0002 host's
    /// files made in the VM lost group-write.)
    #[test]
    fn the_umask_is_vmctls_own() {
        assert_eq!(
            umask_in_status("Name:\tvmctl\nUmask:\t0002\nState:\tR\n"),
            Some(0o002)
        );
        assert_eq!(umask_in_status("Name:\tvmctl\n"), None);
        // SAFETY: umask only sets this process's mask; set back at once.
        let actual = unsafe {
            let mask = libc::umask(0o022);
            libc::umask(mask);
            mask
        };
        assert_eq!(own_umask(), Some(actual));
    }

    /// A command line longer than a request may be is refused before any agent is
    /// asked, saying what to do. (Review: it failed as a protocol error, with 125.)
    #[tokio::test]
    async fn a_command_line_longer_than_a_request_is_refused_saying_what_to_do() {
        let options = plain(vec!["echo".into(), "x".repeat(2 << 20).into()]);
        let err = relay(Path::new("/nonexistent/vsock.sock"), options)
            .await
            .unwrap_err();
        assert!(matches!(err, ExecError::TooLong { .. }), "{err}");
        assert!(err.to_string().contains("xargs"), "{err}");
    }

    use guest_agent::protocol::{write_frame, AgentMessage, ClientMessage, FrameReader};
    use std::sync::{mpsc as std_mpsc, Arc, Mutex};
    use std::time::Duration;

    /// The output half of an exec session whose agent sends `messages` after
    /// `Started`, and its input half (the agent keeps the connection until it goes).
    async fn session_sending(
        messages: Vec<AgentMessage>,
    ) -> (
        client::ExecOutput<tokio::net::UnixStream>,
        client::ExecInput<tokio::net::UnixStream>,
    ) {
        session_with(messages, AfterMessages::Stay).await
    }

    /// What the fake agent of [`session_with`] does once it sent its messages.
    enum AfterMessages {
        /// Keeps the connection until the client closes it.
        Stay,
        /// Goes away, as an agent whose VM stopped.
        GoAway,
    }

    async fn session_with(
        messages: Vec<AgentMessage>,
        after: AfterMessages,
    ) -> (
        client::ExecOutput<tokio::net::UnixStream>,
        client::ExecInput<tokio::net::UnixStream>,
    ) {
        let (host, agent) = tokio::net::UnixStream::pair().unwrap();
        tokio::spawn(async move {
            let (r, mut w) = agent.into_split();
            let mut r = FrameReader::new(r);
            let _hello = r.next::<ClientMessage>().await;
            let hello_ok = AgentMessage::HelloOk {
                agent_version: "test".into(),
                protocol_version: guest_agent::protocol::PROTOCOL_VERSION,
            };
            let _ = write_frame(&mut w, &hello_ok).await;
            let _exec = r.next::<ClientMessage>().await;
            let _ = write_frame(&mut w, &AgentMessage::Started { pid: 1 }).await;
            for message in messages {
                if write_frame(&mut w, &message).await.is_err() {
                    return;
                }
            }
            if let AfterMessages::Stay = after {
                while let Ok(Some(_)) = r.next::<ClientMessage>().await {}
            }
        });
        let session = client::Connection::handshake(host)
            .await
            .unwrap()
            .exec(ExecRequest::default())
            .await
            .unwrap();
        let (input, output) = session.split();
        (output, input)
    }

    /// An output whose reader stalls: its first write says so on `began`, then blocks
    /// until `release` is dropped.
    struct Stalled {
        began: std_mpsc::Sender<()>,
        release: std_mpsc::Receiver<()>,
    }

    impl Write for Stalled {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            let _ = self.began.send(());
            let _ = self.release.recv();
            Err(std::io::Error::other("released"))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn stalled() -> (Stalled, std_mpsc::Receiver<()>, std_mpsc::Sender<()>) {
        let (began, began_rx) = std_mpsc::channel();
        let (release_tx, release) = std_mpsc::channel();
        (Stalled { began, release }, began_rx, release_tx)
    }

    /// Runs `relay_output` as `vmctl` does, on a current-thread runtime (of a thread of
    /// its own here, which a blocked write may hold for good); its outcome comes on the
    /// channel returned.
    fn relay_on_its_own_thread(
        messages: Vec<AgentMessage>,
        stdout: impl Write + Send + 'static,
        gave_up: tokio::sync::mpsc::Receiver<GiveUp>,
        after_exit_signal: tokio::sync::oneshot::Receiver<i32>,
    ) -> std_mpsc::Receiver<Result<u8, ExecError>> {
        let (outcome_tx, outcome) = std_mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let result = runtime.block_on(async move {
                let (output, _input) = session_sending(messages).await;
                let (close_output, _closed) = tokio::sync::mpsc::channel(2);
                let writer = OutputWriter::start(stdout, std::io::sink()).unwrap();
                let signalled = || async move { after_exit_signal.await.unwrap_or(0) };
                relay_output(output, writer, gave_up, close_output, false, signalled).await
            });
            let _ = outcome_tx.send(result);
        });
        outcome
    }

    /// How vmctl is told to end while a write of the command's output blocks.
    enum EndBy {
        /// Giving up on the command (a signal forwarded, and no exit in its time).
        GivingUp,
        /// A signal after the command exited.
        Signal,
    }

    /// Relays `messages` to an output whose reader stalls, ends vmctl `by` once a
    /// write blocks, and returns the code vmctl ended with, in 10 s at most.
    fn code_when_ended_while_stalled(messages: Vec<AgentMessage>, by: EndBy) -> u8 {
        let (stdout, began, release) = stalled();
        let (give_up, gave_up) = tokio::sync::mpsc::channel(1);
        let (signal, after_exit_signal) = tokio::sync::oneshot::channel();
        let outcome = relay_on_its_own_thread(messages, stdout, gave_up, after_exit_signal);
        began
            .recv_timeout(Duration::from_secs(10))
            .expect("no output written within 10 s");
        match by {
            EndBy::GivingUp => give_up.try_send(GiveUp::Again(libc::SIGTERM)).unwrap(),
            EndBy::Signal => signal.send(libc::SIGTERM).unwrap(),
        }
        let outcome = outcome.recv_timeout(Duration::from_secs(10));
        drop(release);
        outcome
            .expect("vmctl still waits for the blocked write 10 s after it was told to end")
            .unwrap()
    }

    /// `timeout 10 vmctl exec -- cmd | stalled`: while a write of the command's output
    /// blocks, vmctl still gives up on the command (here: a second signal) and ends;
    /// before, the write held the runtime's one thread, so no signal was forwarded and
    /// nothing could end vmctl.
    #[test]
    fn a_blocked_write_of_the_output_does_not_stop_vmctl_from_giving_up() {
        let chunk = AgentMessage::Stdout(vec![b'x'; 32 * 1024]);
        assert_eq!(
            code_when_ended_while_stalled(vec![chunk; 16], EndBy::GivingUp),
            143
        );
    }

    /// The command's last output, then its exit.
    fn last_words_then(code: Option<i32>, signal: Option<i32>) -> Vec<AgentMessage> {
        vec![
            AgentMessage::Stdout(b"last words".to_vec()),
            AgentMessage::Exited { code, signal },
        ]
    }

    /// The command exited, and its last output is still being written to a reader that
    /// stalls: a signal ends vmctl, as it would a local command still writing.
    #[test]
    fn a_signal_ends_vmctl_while_the_output_of_a_command_that_exited_is_written() {
        let messages = last_words_then(Some(0), None);
        assert_eq!(code_when_ended_while_stalled(messages, EndBy::Signal), 143);
    }

    /// `timeout 10 vmctl exec -- cmd | stalled`: the one SIGTERM was forwarded, the
    /// command exited of it, and its last output waits for the stalled reader. Giving
    /// up on the signal, in its time, still ends vmctl; no second signal comes.
    #[test]
    fn giving_up_after_the_exit_ends_vmctl_while_the_output_waits() {
        let messages = last_words_then(None, Some(libc::SIGTERM));
        assert_eq!(
            code_when_ended_while_stalled(messages, EndBy::GivingUp),
            143
        );
    }

    /// One buffer behind both outputs, to see the order of the writes.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What the command wrote is all written, in order, before its exit code is
    /// returned; without a PTY, an output whose reader went away is closed in the guest
    /// too, and the rest goes on.
    #[tokio::test]
    async fn the_output_is_written_in_order_before_the_exit_code_is_returned() {
        let messages = vec![
            AgentMessage::Stdout(b"a".to_vec()),
            AgentMessage::Stderr(b"b".to_vec()),
            AgentMessage::Stdout(b"c".to_vec()),
            AgentMessage::Exited {
                code: Some(3),
                signal: None,
            },
        ];
        let (output, _input) = session_sending(messages).await;
        let both = Shared::default();
        let writer = OutputWriter::start(both.clone(), both.clone()).unwrap();
        let (_give_up, gave_up) = tokio::sync::mpsc::channel(1);
        let (close_output, _closed) = tokio::sync::mpsc::channel(2);
        let code = relay_output(output, writer, gave_up, close_output, false, || {
            std::future::pending::<i32>()
        })
        .await
        .unwrap();
        assert_eq!(code, 3);
        assert_eq!(*both.0.lock().unwrap(), b"abc");

        struct Gone;
        impl Write for Gone {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let messages = vec![
            AgentMessage::Stdout(b"lost".to_vec()),
            AgentMessage::Stdout(b"lost too".to_vec()),
            AgentMessage::Stderr(b"said".to_vec()),
            AgentMessage::Exited {
                code: Some(0),
                signal: None,
            },
        ];
        let (output, _input) = session_sending(messages).await;
        let stderr = Shared::default();
        let writer = OutputWriter::start(Gone, stderr.clone()).unwrap();
        let (_give_up, gave_up) = tokio::sync::mpsc::channel(1);
        let (close_output, mut closed) = tokio::sync::mpsc::channel(2);
        let code = relay_output(output, writer, gave_up, close_output, false, || {
            std::future::pending::<i32>()
        })
        .await
        .unwrap();
        assert_eq!(code, 0);
        assert_eq!(*stderr.0.lock().unwrap(), b"said");
        assert_eq!(closed.try_recv().ok(), Some(OutputStream::Stdout));
        assert!(closed.try_recv().is_err(), "closed twice");
    }

    #[test]
    fn giving_up_on_a_command_exits_as_if_the_signal_killed_it() {
        assert_eq!(GiveUp::Timeout(libc::SIGTERM).exit_code(), 143);
        assert_eq!(GiveUp::Again(libc::SIGINT).exit_code(), 130);
        let timeout = GiveUp::Timeout(libc::SIGTERM).to_string();
        assert!(
            timeout.starts_with("the command is still running 10 s after SIGTERM"),
            "{timeout}"
        );
        assert!(timeout.contains("'vmctl stop'"), "{timeout}");
        assert!(GiveUp::Again(libc::SIGINT)
            .to_string()
            .starts_with("Ctrl-C (SIGINT) again"));
    }

    /// A guest that stops reading its input blocks every write to it, the forwarded
    /// signal's too: vmctl still gives up on the command, at a second signal or when
    /// the first one's grace is over.
    #[tokio::test(start_paused = true)]
    async fn giving_up_does_not_wait_for_the_signal_to_reach_the_guest() {
        use tokio::sync::mpsc;
        let second = Duration::from_secs(1);
        for again in [None, Some(libc::SIGINT)] {
            let (send_signal, signals) = mpsc::channel(4);
            // Taken only to check it: the task that writes to the agent is blocked.
            let (forward, mut forwarded) = mpsc::channel(1);
            let (give_up, mut gave_up) = mpsc::channel(1);
            let watch = tokio::spawn(watch_signals(signals, forward, give_up));
            send_signal.send(libc::SIGTERM).await.unwrap();
            tokio::time::sleep(second).await;
            assert_eq!(forwarded.try_recv().ok(), Some(libc::SIGTERM));
            let reason = match again {
                Some(signal) => {
                    send_signal.send(signal).await.unwrap();
                    tokio::time::sleep(second).await;
                    gave_up.try_recv().ok()
                }
                None => {
                    tokio::time::sleep(SIGNAL_GRACE - second * 2).await;
                    assert!(gave_up.try_recv().is_err(), "gave up before the grace");
                    tokio::time::sleep(second * 2).await;
                    gave_up.try_recv().ok()
                }
            };
            let expected = match again {
                Some(signal) => GiveUp::Again(signal),
                None => GiveUp::Timeout(libc::SIGTERM),
            };
            assert_eq!(reason, Some(expected));
            watch.await.unwrap();
        }
    }

    #[test]
    fn lost_output_is_a_closed_pipe_or_is_said() {
        let gone = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        assert!(matches!(
            output_lost(OutputStream::Stdout, gone),
            OutputLost::ReaderGone
        ));
        assert_eq!(exit_code(None, Some(libc::SIGPIPE)), 141);
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let OutputLost::Failed(error) = output_lost(OutputStream::Stdout, full) else {
            panic!("a full disk passed for a reader that went away");
        };
        let message = error.to_string();
        assert!(
            message.starts_with("cannot write the command's standard output: No space left"),
            "{message}"
        );
    }

    #[test]
    fn exit_codes_follow_the_shell_convention() {
        assert_eq!(exit_code(Some(3), None), 3);
        assert_eq!(exit_code(None, Some(9)), 137);
        assert_eq!(exit_code(None, None), 1);
        assert_eq!(exit_code(Some(300), None), 255);
        assert_eq!(
            exit_code(Some(-1), None),
            255,
            "a negative code is no success"
        );
        assert_eq!(exit_code(None, Some(0)), 1, "0 is no signal");
        assert_eq!(exit_code(None, Some(200)), 1);
    }

    #[test]
    fn user_names_map_to_agent_users() {
        assert_eq!(parse_user(None), User::Default);
        // `--user "$U"` with U unset, as the help says.
        assert_eq!(parse_user(Some("")), User::Default);
        assert_eq!(parse_user(Some("root")), User::Root);
        assert_eq!(parse_user(Some("alice")), User::Named("alice".into()));
    }
}
