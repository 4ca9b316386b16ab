//! The daemon's client side: leases, pins, status, shutdown; starts the daemon when
//! none runs.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::protocol::{Request, Response, VmStatus};
use crate::state::VmDir;

/// How long a freshly started daemon may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a client waits for a daemon that is stopping to be gone: its VMs stop in
/// parallel, each within 45 s, after at most 30 s for a start under way to run the
/// VM's supervisor and 10 s more for the start to finish.
const STOPPING_WAIT: Duration = Duration::from_secs(90);

/// How long `vmctl daemon --stop` waits for the daemon it stops to end (as
/// [`STOPPING_WAIT`], with room for a daemon slow to see the request).
const SHUTDOWN_WAIT: Duration = Duration::from_secs(120);

#[derive(Debug, thiserror::Error)]
pub enum DaemonClientError {
    #[error("cannot start the vmctl daemon: {0}")]
    Start(String),
    #[error("talking to the vmctl daemon at {}: {source}", .socket.display())]
    Io {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("the vmctl daemon answered something unreadable: {0}")]
    BadAnswer(String),
    #[error(
        "the vmctl daemon at {} went away before it answered (killed, or crashed); its log: {}",
        .socket.display(),
        super::log_path().display()
    )]
    Vanished { socket: PathBuf },
    #[error(
        "the vmctl daemon at {} did not answer within {waited:?}: it is stopped (Ctrl-Z \
         in its terminal: 'fg' it) or stuck (its pid is in {}, its log: {}; kill it, and \
         the next command starts another)",
        .socket.display(),
        super::pid_path().display(),
        super::log_path().display()
    )]
    NotAnswering { socket: PathBuf, waited: Duration },
    #[error("the vmctl daemon refused: {0}")]
    Refused(String),
    #[error(
        "the vmctl daemon at {} has been stopping its VMs for longer than {waited:?}; \
         its log ({}) says which it waits for, and `vmctl ps` which still run",
        .socket.display(),
        super::log_path().display()
    )]
    StillStopping { socket: PathBuf, waited: Duration },
}

/// Keeps a VM running while it lives (dropping it closes the connection).
#[derive(Debug)]
pub struct Lease {
    _connection: UnixStream,
}

/// Takes a lease on `vm` for `purpose`, starting the daemon if needed.
pub fn lease(vm: &VmDir, purpose: &str) -> Result<Lease, DaemonClientError> {
    let request = Request::Lease {
        vm_dir: vm.path.clone(),
        purpose: purpose.to_string(),
        pid: std::process::id(),
    };
    let (connection, _) = ask_a_running_daemon(&request, connect_or_start, STOPPING_WAIT)?;
    warn_if_another_build_serves(&connection);
    Ok(Lease {
        _connection: connection,
    })
}

/// Pins `vm` (`vmctl up`), starting the daemon if needed.
pub fn pin(vm: &VmDir) -> Result<(), DaemonClientError> {
    let request = Request::Pin {
        vm_dir: vm.path.clone(),
    };
    let (connection, _) = ask_a_running_daemon(&request, connect_or_start, STOPPING_WAIT)?;
    warn_if_another_build_serves(&connection);
    Ok(())
}

/// Says so when the daemon at the other end of `connection` runs another build of
/// vmctl than this one: one started before an upgrade keeps running, with the old
/// build's idle stops and config reading, until it is restarted.
fn warn_if_another_build_serves(connection: &UnixStream) {
    if let Some(pid) = served_by_another_build(connection) {
        vmm::to_stderr!(
            "vmctl: the vmctl daemon (pid {pid}) runs another build of vmctl than this one \
             (started before an upgrade?), and keeps that build's ways until it restarts: \
             `vmctl daemon --stop` restarts it at the next command, stopping every VM \
             cleanly"
        );
    }
}

/// The pid of the process at the other end of `connection` if it runs another program
/// than this one.
fn served_by_another_build(connection: &UnixStream) -> Option<i32> {
    let peer = guest_agent::client::peer_credentials(connection).ok()?;
    crate::procfs::runs_another_program(peer.pid).then_some(peer.pid)
}

/// Unpins `vm` if a daemon runs (`vmctl stop`).
pub fn unpin(vm: &VmDir) -> Result<(), DaemonClientError> {
    let Some(socket) = running_socket() else {
        let _ = std::fs::remove_file(vm.pin_file());
        return Ok(());
    };
    let request = Request::Unpin {
        vm_dir: vm.path.clone(),
    };
    if let (_, Response::Stopping) = ask(&socket, &request)? {
        // It stops the VM anyway; the pin must not outlive it for the next daemon.
        let _ = std::fs::remove_file(vm.pin_file());
    }
    Ok(())
}

/// What keeps each VM running, if a daemon runs.
pub fn status() -> Option<Vec<VmStatus>> {
    let socket = running_socket()?;
    match ask(&socket, &Request::Status) {
        Ok((_, Response::Status { vms })) => Some(vms),
        _ => None,
    }
}

/// Stops the daemon (and with it every VM), saying so while it waits; false if none
/// ran.
pub fn shutdown() -> Result<bool, DaemonClientError> {
    let Some(socket) = running_socket() else {
        return Ok(false);
    };
    let (connection, _) = ask(&socket, &Request::Shutdown)?;
    // Each VM's guest gets up to 30 s to shut down, and the command no word meanwhile
    // otherwise.
    vmm::to_stderr!("vmctl: stopping the daemon and every VM with it (up to a minute)");
    wait_for_the_end(connection, &socket, SHUTDOWN_WAIT)?;
    Ok(true)
}

/// Waits for the daemon at `socket` to close `connection` to it, which it does as it
/// exits, once every VM has stopped; one that has not after `wait` still stops VMs
/// ([`DaemonClientError::StillStopping`]).
fn wait_for_the_end(
    mut connection: UnixStream,
    socket: &Path,
    wait: Duration,
) -> Result<(), DaemonClientError> {
    let still_stopping = || DaemonClientError::StillStopping {
        socket: socket.to_path_buf(),
        waited: wait,
    };
    let io = |source| DaemonClientError::Io {
        socket: socket.to_path_buf(),
        source,
    };
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(still_stopping());
        }
        connection.set_read_timeout(Some(left)).map_err(io)?;
        match connection.read(&mut [0u8; 64]) {
            Ok(0) => return Ok(()),
            // Nothing follows the answer; only the end counts.
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(still_stopping())
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // A daemon that died rather than exited is gone all the same.
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return Ok(()),
            Err(source) => return Err(io(source)),
        }
    }
}

/// Sends `request` to the daemon `connect_or_start` reaches; one that answers it is
/// stopping is waited out (for `wait` at most), and the request goes to the next.
fn ask_a_running_daemon(
    request: &Request,
    mut connect_or_start: impl FnMut() -> Result<PathBuf, DaemonClientError>,
    wait: Duration,
) -> Result<(UnixStream, Response), DaemonClientError> {
    let deadline = Instant::now() + wait;
    let mut said = false;
    let mut said_vanished = false;
    loop {
        let socket = connect_or_start()?;
        let asked = match ask(&socket, request) {
            // A daemon killed a moment ago may still take a connection (its threads
            // close its socket last) but never answer: the next daemon will.
            Err(DaemonClientError::Vanished { .. }) if Instant::now() < deadline => {
                if !said_vanished {
                    vmm::to_stderr!(
                        "vmctl: the vmctl daemon went away before it answered; starting the next"
                    );
                    said_vanished = true;
                }
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            asked => asked?,
        };
        match asked {
            (_, Response::Stopping) if Instant::now() < deadline => {
                if !said {
                    vmm::to_stderr!(
                        "vmctl: the vmctl daemon is stopping, and every VM with it; waiting \
                         for it to end, to start the next"
                    );
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            (_, Response::Stopping) => {
                return Err(DaemonClientError::StillStopping {
                    socket,
                    waited: wait,
                })
            }
            answered => return Ok(answered),
        }
    }
}

/// The socket of a running daemon, if one answers.
fn running_socket() -> Option<PathBuf> {
    let socket = super::socket_path();
    listens(&socket).then_some(socket)
}

/// Whether a daemon (of this user's) listens on `socket`.
fn listens(socket: &Path) -> bool {
    crate::own_socket::connect(socket).is_ok()
}

fn connect_or_start() -> Result<PathBuf, DaemonClientError> {
    if let Some(socket) = running_socket() {
        return Ok(socket);
    }
    let mut daemon = start_daemon()?;
    let socket = super::socket_path();
    wait_for_start(&socket, &super::log_path(), &mut daemon, START_TIMEOUT)
}

/// Waits, within `limit`, until a daemon listens on `socket`: the one started
/// (`daemon`, logging to `log`), or another that won a race to start. One that exited
/// failing is said at once, with its log's last lines. (Review: a daemon that could
/// not bind its socket cost every command 10 s, and the reason was in its log only.)
fn wait_for_start(
    socket: &Path,
    log: &Path,
    daemon: &mut std::process::Child,
    limit: Duration,
) -> Result<PathBuf, DaemonClientError> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if listens(socket) {
            return Ok(socket.to_path_buf());
        }
        // A daemon that finds another running ends too, with success.
        if let Ok(Some(status)) = daemon.try_wait() {
            if !status.success() && !listens(socket) {
                let said = crate::log_keeper::last_lines(log, 16 << 10, 3);
                return Err(DaemonClientError::Start(format!(
                    "it exited at once ({status}){}; its log: {}",
                    match said.is_empty() {
                        true => String::new(),
                        false =>
                            format!(", saying: {}", crate::terminal::one_line(&said.join(" | "))),
                    },
                    log.display()
                )));
            }
        }
        // The first command after a login waits on this: the daemon listens within
        // a few ms of its start.
        std::thread::sleep(Duration::from_millis(5));
    }
    Err(DaemonClientError::Start(format!(
        "it did not listen on {} within {limit:?} (its log: {})",
        socket.display(),
        log.display()
    )))
}

/// Starts `vmctl daemon` in a session of its own, logging to [`super::log_path`].
fn start_daemon() -> Result<std::process::Child, DaemonClientError> {
    let start = DaemonClientError::Start;
    let exe = std::env::current_exe()
        .map_err(|e| start(format!("cannot find vmctl's own executable: {e}")))?;
    let log_path = super::log_path();
    crate::state::create_state_dir().map_err(|e| start(e.to_string()))?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| start(format!("cannot open its log {}: {e}", log_path.display())))?;
    daemon_command(&exe, log)
        .and_then(|mut command| command.spawn())
        .map_err(|e| {
            start(format!(
                "cannot run {} daemon: {e}; run it by hand to see why",
                exe.display()
            ))
        })
}

/// `exe daemon` (`exe`: vmctl's own executable, or a test's stand-in) in a session of
/// its own, writing to `log`, with no other descriptor of this process.
fn daemon_command(exe: &Path, log: std::fs::File) -> std::io::Result<Command> {
    let mut command = Command::new(exe);
    command
        .arg("daemon")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // It runs on after this vmctl: it must not keep what this vmctl's caller gave it.
    crate::vmm_process::start_without_inherited_descriptors(&mut command);
    // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    Ok(command)
}

/// How long the daemon has to take a request and answer it: it answers at once,
/// unless it is stopped (Ctrl-Z on `vmctl daemon` in a terminal) or stuck, when every
/// command that asks it would hang without a word.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Sends `request` and reads the answer; returns the open connection too (a lease
/// lives as long as it).
fn ask(socket: &Path, request: &Request) -> Result<(UnixStream, Response), DaemonClientError> {
    ask_within(socket, request, ANSWER_TIMEOUT)
}

fn ask_within(
    socket: &Path,
    request: &Request,
    timeout: Duration,
) -> Result<(UnixStream, Response), DaemonClientError> {
    let io = |source| DaemonClientError::Io {
        socket: socket.to_path_buf(),
        source,
    };
    let vanished = || DaemonClientError::Vanished {
        socket: socket.to_path_buf(),
    };
    let gone_or = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe
        | std::io::ErrorKind::ConnectionRefused
        | std::io::ErrorKind::NotFound => vanished(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            DaemonClientError::NotAnswering {
                socket: socket.to_path_buf(),
                waited: timeout,
            }
        }
        _ => io(e),
    };
    let mut connection = crate::own_socket::connect(socket).map_err(gone_or)?;
    let set_timeouts = |connection: &UnixStream, timeout| {
        connection
            .set_read_timeout(timeout)
            .and_then(|()| connection.set_write_timeout(timeout))
            .map_err(io)
    };
    set_timeouts(&connection, Some(timeout))?;
    let mut line =
        serde_json::to_vec(request).map_err(|e| DaemonClientError::BadAnswer(e.to_string()))?;
    line.push(b'\n');
    connection.write_all(&line).map_err(gone_or)?;
    let mut answer = String::new();
    BufReader::new(connection.try_clone().map_err(io)?)
        .read_line(&mut answer)
        .map_err(gone_or)?;
    if answer.is_empty() {
        return Err(vanished());
    }
    // A lease's connection is held for as long as the session runs.
    set_timeouts(&connection, None)?;
    match serde_json::from_str::<Response>(&answer) {
        Ok(Response::Error { message }) => Err(DaemonClientError::Refused(message)),
        Ok(response) => Ok((connection, response)),
        Err(e) => Err(DaemonClientError::BadAnswer(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_daemon_of_this_build_is_not_taken_for_another() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("daemon.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let connection = UnixStream::connect(&socket).unwrap();
        assert_eq!(served_by_another_build(&connection), None);
        let peer = guest_agent::client::peer_credentials(&connection).unwrap();
        assert_eq!(peer.pid, std::process::id() as i32);
        let mut other = crate::state::spawn_in_test(Command::new("sleep").arg("30"));
        let verdict = crate::procfs::runs_another_program(other.id() as i32);
        let _ = other.kill();
        let _ = other.wait();
        assert!(verdict, "sleep taken for this build");
    }

    /// A daemon that takes connections but answers none (stopped with Ctrl-Z) is
    /// reported, not waited for. (Review: every command, `vmctl stop` too, hung.)
    #[test]
    fn a_daemon_that_does_not_answer_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("daemon.sock");
        // Bound and listening, never accepting: the kernel takes the connection.
        let _stopped = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let (answered, answer) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let asked = ask_within(&socket, &Request::Status, Duration::from_millis(300));
            let _ = answered.send(asked.map(|(_, response)| response));
        });
        let err = answer
            .recv_timeout(Duration::from_secs(10))
            .expect("the client still waits for the answer")
            .unwrap_err();
        assert!(
            matches!(err, DaemonClientError::NotAnswering { .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains("did not answer within 300ms"),
            "{err}"
        );
    }

    /// A daemon that exits at once is said so with its words, not waited for.
    #[test]
    fn a_daemon_that_cannot_start_is_reported_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("vmctl");
        crate::vmm_process::script(
            &exe,
            "#!/bin/sh\necho 'vmctl: error: cannot bind /x/daemon.sock: Permission denied' >&2\nexit 1\n",
        );
        let log_path = dir.path().join("daemon.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let mut daemon = daemon_command(&exe, log).unwrap().spawn().unwrap();
        let started = Instant::now();
        let socket = dir.path().join("daemon.sock");
        let err = wait_for_start(&socket, &log_path, &mut daemon, Duration::from_secs(20))
            .unwrap_err()
            .to_string();
        assert!(started.elapsed() < Duration::from_secs(5), "{err}");
        assert!(err.contains("exited at once (exit status: 1)"), "{err}");
        assert!(
            err.contains("cannot bind /x/daemon.sock: Permission denied"),
            "{err}"
        );
    }

    /// A caller waiting for the end of a pipe it gave vmctl (an IDE, an agent harness)
    /// is not kept waiting as long as the daemon runs.
    #[test]
    fn the_daemon_gets_no_descriptor_vmctl_inherited() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("vmctl");
        crate::vmm_process::script(&exe, "#!/bin/sh\nexec sleep 30\n");
        let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
        let held = crate::vmm_process::inherited_pipe_ends(|| {
            daemon_command(&exe, log).unwrap().spawn().unwrap()
        });
        assert!(
            held.is_empty(),
            "the daemon holds the caller's pipe: {held:?}"
        );
    }
    /// A stand-in daemon on `socket` that answers each connection with the next of
    /// `answers`.
    fn daemon_answering(socket: &Path, answers: Vec<Response>) -> std::thread::JoinHandle<()> {
        let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
        std::thread::spawn(move || {
            for answer in answers {
                let (connection, _) = listener.accept().unwrap();
                let mut request = String::new();
                BufReader::new(&connection).read_line(&mut request).unwrap();
                let mut line = serde_json::to_vec(&answer).unwrap();
                line.push(b'\n');
                (&connection).write_all(&line).unwrap();
            }
        })
    }

    /// A session that comes as the daemon stops every VM waits for the next daemon,
    /// which tracks the VM the session starts: the one stopping is about to go.
    #[test]
    fn a_daemon_that_is_stopping_is_waited_out() {
        let dir = tempfile::tempdir().unwrap();
        let (old, next) = (dir.path().join("old.sock"), dir.path().join("next.sock"));
        let stopping = daemon_answering(&old, vec![Response::Stopping, Response::Stopping]);
        let running = daemon_answering(&next, vec![Response::Ok]);
        let mut asked = 0;
        let connect = || {
            asked += 1;
            // The old daemon's socket until it is gone, then the next one's.
            Ok(if asked <= 2 {
                old.clone()
            } else {
                next.clone()
            })
        };
        let request = Request::Status;
        let (_, answer) = ask_a_running_daemon(&request, connect, Duration::from_secs(30)).unwrap();
        assert_eq!(answer, Response::Ok);
        assert_eq!(asked, 3);
        stopping.join().unwrap();
        running.join().unwrap();

        // One that keeps stopping is given up on, saying where to look.
        let stuck = dir.path().join("stuck.sock");
        let _stuck = daemon_answering(&stuck, vec![Response::Stopping]);
        let error = ask_a_running_daemon(&request, || Ok(stuck.clone()), Duration::ZERO)
            .unwrap_err()
            .to_string();
        assert!(error.contains("has been stopping its VMs"), "{error}");
        assert!(error.contains("daemon.log"), "{error}");
    }

    /// A daemon killed a moment ago may still take a connection and then close it
    /// unanswered (its socket goes with its last thread): the client starts over with
    /// the next daemon instead of going on without a lease. (CI: a session after a
    /// SIGKILLed daemon ran with no daemon, and its VM never stopped when idle.)
    #[test]
    fn a_daemon_that_goes_away_unanswering_is_followed_by_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let (dying, next) = (dir.path().join("dying.sock"), dir.path().join("next.sock"));
        let listener = std::os::unix::net::UnixListener::bind(&dying).unwrap();
        let dies = std::thread::spawn(move || {
            let (connection, _) = listener.accept().unwrap();
            drop(connection);
        });
        let running = daemon_answering(&next, vec![Response::Ok]);
        let mut asked = 0;
        let connect = || {
            asked += 1;
            Ok(if asked == 1 {
                dying.clone()
            } else {
                next.clone()
            })
        };
        let (_, answer) =
            ask_a_running_daemon(&Request::Status, connect, Duration::from_secs(30)).unwrap();
        assert_eq!(answer, Response::Ok);
        assert_eq!(asked, 2);
        dies.join().unwrap();
        running.join().unwrap();

        // Past the wait, it is said, with the log to read.
        let gone = dir.path().join("gone.sock");
        let listener = std::os::unix::net::UnixListener::bind(&gone).unwrap();
        let closes = std::thread::spawn(move || drop(listener.accept().unwrap()));
        let error = ask_a_running_daemon(&Request::Status, || Ok(gone.clone()), Duration::ZERO)
            .unwrap_err();
        assert!(
            matches!(error, DaemonClientError::Vanished { .. }),
            "{error:?}"
        );
        assert!(error.to_string().contains("daemon.log"), "{error}");
        closes.join().unwrap();
    }

    /// `vmctl daemon --stop` succeeds once the daemon is gone (it closes the
    /// connection as it exits), and says when it is not after its wait.
    #[test]
    fn a_daemon_stop_succeeds_only_once_the_daemon_is_gone() {
        let socket = Path::new("/run/user/1000/vmctl/daemon-x.sock");
        let (client, daemon) = UnixStream::pair().unwrap();
        let exits = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(daemon);
        });
        wait_for_the_end(client, socket, Duration::from_secs(30)).unwrap();
        exits.join().unwrap();

        // One that wrote more before it exited: still only its end counts.
        let (client, mut daemon) = UnixStream::pair().unwrap();
        daemon.write_all(b"{\"ok\":null}\n").unwrap();
        drop(daemon);
        wait_for_the_end(client, socket, Duration::from_secs(30)).unwrap();

        // Still stopping its VMs when the wait ends.
        let (client, _still_running) = UnixStream::pair().unwrap();
        let wait = Duration::from_millis(200);
        let started = Instant::now();
        let error = wait_for_the_end(client, socket, wait).unwrap_err();
        assert!(started.elapsed() >= wait);
        assert!(
            matches!(&error, DaemonClientError::StillStopping { waited, .. } if *waited == wait),
            "{error:?}"
        );
        let error = error.to_string();
        assert!(
            error.contains("daemon-x.sock has been stopping its VMs for longer than 200ms"),
            "{error}"
        );
        assert!(error.contains("daemon.log"), "{error}");
    }
}
