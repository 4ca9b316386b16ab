//! `vmctl daemon`: tracks leases and pins, stops idle VMs, stops every VM when it
//! stops (SIGTERM, SIGINT, or `vmctl daemon --stop`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::Notify;

use super::protocol::{Request, Response, VmStatus};
use crate::state::VmDir;

/// Default seconds a VM without leases keeps running.
pub const DEFAULT_IDLE_TIMEOUT_S: u64 = 30;
/// Longest request line.
const MAX_REQUEST: u64 = 16 * 1024;
/// How often VMs that stopped by themselves are forgotten.
const REAP_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("a vmctl daemon already runs on {}", .0.display())]
    AlreadyRunning(PathBuf),
    #[error("cannot listen on {}: {source}", .path.display())]
    Listen {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the daemon's runtime: {0}")]
    Runtime(std::io::Error),
}

/// What the daemon knows of one VM.
#[derive(Default)]
struct Tracked {
    leases: HashMap<u64, String>,
    pinned: bool,
    /// When it stops for idleness; a new `generation` cancels that.
    idle_deadline: Option<Instant>,
    generation: u64,
    /// The run found going when this daemon started, if this is it.
    adopted: Option<AdoptedRun>,
}

/// A run of a VM found going when the daemon started: sessions of the daemon before
/// may still be under way in it, without leases, and only its guest agent knows of
/// them.
#[derive(Debug, Clone, Copy)]
struct AdoptedRun {
    /// Its supervisor's: a later run of the VM is not the one adopted.
    pid: i32,
    at: tokio::time::Instant,
}

/// How long the guest of an adopted run is believed when it says sessions are under
/// way: a guest that keeps saying so is stopped when idle after that all the same.
const ADOPTED_SESSIONS_TRUSTED: Duration = Duration::from_secs(24 * 3600);

struct Daemon {
    vms: Mutex<HashMap<PathBuf, Tracked>>,
    next_lease: AtomicU64,
    /// Daemon-wide, so that a VM forgotten and tracked again never takes a number an
    /// idle timer of its earlier run still waits with.
    next_generation: AtomicU64,
    shutdown: Notify,
    /// The idle timeout in seconds, when not the config file's (tests).
    idle_timeout_s: Option<u64>,
}

impl Daemon {
    fn vms(&self) -> MutexGuard<'_, HashMap<PathBuf, Tracked>> {
        self.vms
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn new_generation(&self) -> u64 {
        self.next_generation.fetch_add(1, Ordering::Relaxed)
    }
}

/// How long a pin file may wait for its VM to start: `vmctl up` pins before it takes
/// the lifecycle lock.
const PIN_GRACE: Duration = Duration::from_secs(60);

/// Runs the daemon in the foreground until it is told to stop.
pub fn run() -> Result<u8, DaemonError> {
    let socket = super::socket_path();
    // The lock is held until every VM stopped.
    let Bound {
        listener,
        lock: held_until_stopped,
    } = bind(&socket)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(DaemonError::Runtime)?;
    vmm::to_stderr!("vmctl daemon: listening on {}", socket.display());
    let pid_file = super::pid_path();
    let _ = std::fs::write(
        &pid_file,
        format!("{}\n{}\n", std::process::id(), socket.display()),
    );
    let daemon = Arc::new(Daemon {
        vms: Mutex::new(HashMap::new()),
        next_lease: AtomicU64::new(1),
        next_generation: AtomicU64::new(1),
        shutdown: Notify::new(),
        idle_timeout_s: None,
    });
    runtime.block_on(async {
        let listener = UnixListener::from_std(listener).map_err(|source| DaemonError::Listen {
            path: socket.clone(),
            source,
        })?;
        adopt_running_vms(&daemon);
        // What `reap_stopped_vms` watches: it must exist to be seen going.
        let vms_dir = crate::state::create_state_dir().unwrap_or_else(|e| {
            tracing::warn!("{e}");
            crate::state::vms_dir()
        });
        tokio::spawn(reap_stopped_vms(daemon.clone(), vms_dir));
        let mut terminate = signal(SignalKind::terminate()).map_err(DaemonError::Runtime)?;
        let mut interrupt = signal(SignalKind::interrupt()).map_err(DaemonError::Runtime)?;
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => { tokio::spawn(serve(stream, daemon.clone())); }
                    Err(e) => tracing::warn!("accepting a client: {e}"),
                },
                _ = terminate.recv() => break,
                _ = interrupt.recv() => break,
                _ = daemon.shutdown.notified() => break,
            }
        }
        vmm::to_stderr!("vmctl daemon: stopping every VM");
        let mut stopping = tokio::task::spawn_blocking(|| stop_every_vm(VmDir::all()));
        // The socket stays, answering that this daemon is stopping: a session that
        // comes meanwhile waits for the next daemon, which tracks the VM it starts,
        // instead of starting a daemon that cannot run yet (this one holds the lock).
        loop {
            tokio::select! {
                stopped = &mut stopping => {
                    break stopped
                        .map_err(|e| DaemonError::Runtime(std::io::Error::other(e.to_string())));
                }
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => { tokio::spawn(answer_stopping(stream)); }
                    Err(e) => tracing::warn!("accepting a client: {e}"),
                },
            }
        }
    })?;
    let _ = std::fs::remove_file(&pid_file);
    // The next daemon may start the moment the socket is gone: the lock goes with it
    // (and the pid file before, not to remove the next one's).
    let _ = std::fs::remove_file(&socket);
    // Unlinked while still held, so that lock files do not pile up in the runtime
    // directory (one per state directory: tests make hundreds); `take_lock` tells a
    // lock on a file unlinked meanwhile from the one at the path.
    let _ = std::fs::remove_file(socket.with_extension("lock"));
    drop(held_until_stopped);
    vmm::to_stderr!("vmctl daemon: stopped");
    Ok(0)
}

/// Answers a client of a daemon that is stopping: [`Response::Stopping`], but for a
/// `vmctl daemon --stop`, which is told yes and waits, as when it came first, for the
/// connection to close as the daemon exits.
async fn answer_stopping(stream: UnixStream) {
    let (reader, mut writer) = stream.into_split();
    let mut line = String::new();
    if BufReader::new(reader.take(MAX_REQUEST))
        .read_line(&mut line)
        .await
        .is_err()
    {
        return;
    }
    if matches!(serde_json::from_str(&line), Ok(Request::Shutdown)) {
        let _ = answer(&mut writer, &Response::Ok).await;
        std::mem::forget(writer);
    } else {
        let _ = answer(&mut writer, &Response::Stopping).await;
    }
}

/// The daemon's listening socket, and the lock that makes it the only daemon of this
/// state directory for as long as it holds it.
struct Bound {
    listener: std::os::unix::net::UnixListener,
    lock: std::fs::File,
}

fn bind(socket: &Path) -> Result<Bound, DaemonError> {
    let error = |source| DaemonError::Listen {
        path: socket.to_path_buf(),
        source,
    };
    let mut dirs = Vec::new();
    if let Some(own) = socket.parent() {
        // The runtime directory itself only when it is vmctl's /tmp stand-in: a user's
        // own is theirs, not vmctl's to change.
        let runtime = own.parent();
        dirs.extend(runtime.filter(|dir| *dir == crate::state::private_tmp_dir()));
        dirs.push(own);
    }
    for dir in dirs {
        crate::state::ensure_private_dir(dir).map_err(|e| DaemonError::Listen {
            path: socket.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })?;
    }
    // Two clients may start a daemon at the same moment: without the lock both would
    // bind, the second over the first's socket, and the first would run on unreachable
    // (and never stop: `vmctl daemon --stop` reaches only the second).
    let lock = take_lock(&socket.with_extension("lock"), socket)?;
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        return Err(DaemonError::AlreadyRunning(socket.to_path_buf()));
    }
    let _ = std::fs::remove_file(socket);
    let listener = std::os::unix::net::UnixListener::bind(socket).map_err(error)?;
    listener.set_nonblocking(true).map_err(error)?;
    Ok(Bound { listener, lock })
}

/// Takes the exclusive lock on `path` without waiting: held by another daemon of
/// `socket`, it is [`DaemonError::AlreadyRunning`].
fn take_lock(path: &Path, socket: &Path) -> Result<std::fs::File, DaemonError> {
    let error = |source| DaemonError::Listen {
        path: path.to_path_buf(),
        source,
    };
    // A daemon that stops unlinks its lock file before it lets go of it: a lock taken
    // on the file it unlinked is no one's, and is taken again on the path's new file.
    // A few tries are plenty: each one lost means another daemon stopped meanwhile.
    for _ in 0..8 {
        let file = crate::state::open_lock_file(path).map_err(error)?;
        if let Some(locked) = lock_if_current(file, path, socket)? {
            return Ok(locked);
        }
    }
    Err(error(std::io::Error::other(
        "its lock file kept being replaced while it was taken; try again",
    )))
}

/// `file`, opened at `path`, locked, if it is still the file there once locked; `None`
/// when a stopping daemon unlinked it meanwhile (its lock is no one's).
fn lock_if_current(
    file: std::fs::File,
    path: &Path,
    socket: &Path,
) -> Result<Option<std::fs::File>, DaemonError> {
    let error = |source| DaemonError::Listen {
        path: path.to_path_buf(),
        source,
    };
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Err(DaemonError::AlreadyRunning(socket.to_path_buf()))
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(error(e)),
    }
    Ok(is_linked_at(&file, path).map_err(error)?.then_some(file))
}

/// Whether `file` is still the file at `path` (not one unlinked since it was opened).
fn is_linked_at(file: &std::fs::File, path: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let held = file.metadata()?;
    match std::fs::metadata(path) {
        Ok(at_path) => Ok(at_path.dev() == held.dev() && at_path.ino() == held.ino()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// VMs already running (the daemon restarted) are tracked: pinned ones stay, the
/// others get the idle timeout like any VM whose last session ended.
fn adopt_running_vms(daemon: &Arc<Daemon>) {
    for vm in VmDir::all() {
        if let Some(pid) = vm.running_pid() {
            adopt(daemon, &vm, pid, "which ran before this daemon started");
        }
    }
}

/// Running VMs this daemon does not track are adopted as [`adopt_running_vms`] does
/// at its start: one whose session took its lease from a daemon that died while the
/// VM booted (the start scan missed it) would otherwise never stop when idle. One that
/// is being stopped (by this daemon's idle stop, which stops tracking it first, or by
/// `vmctl stop` or `rm`) is not: it would be said to be adopted as it went.
fn adopt_untracked_vms(daemon: &Arc<Daemon>, vms: Vec<VmDir>) {
    for vm in vms {
        let Some(pid) = vm.running_pid() else {
            continue;
        };
        if !daemon.vms().contains_key(&vm.path) && crate::vm::running_vm_stopped_by(&vm).is_none() {
            adopt(
                daemon,
                &vm,
                pid,
                "which runs without this daemon's lease or pin",
            );
        }
    }
}

/// Tracks `vm`, running as `pid` (`how` says why the daemon did not know it).
fn adopt(daemon: &Arc<Daemon>, vm: &VmDir, pid: i32, how: &str) {
    let pinned = {
        let mut vms = daemon.vms();
        let tracked = track(&mut vms, &vm.path);
        tracked.adopted = Some(AdoptedRun {
            pid,
            at: tokio::time::Instant::now(),
        });
        tracked.pinned
    };
    vmm::to_stderr!(
        "vmctl daemon: adopted the VM of {} (pid {pid}), {how}; {}",
        vm.path.display(),
        if pinned {
            "pinned by `vmctl up`"
        } else {
            "it stops once idle, unless the guest agent says sessions are under way"
        }
    );
    if !pinned {
        schedule_idle_stop(daemon, &vm.path);
    }
}

async fn serve(stream: UnixStream, daemon: Arc<Daemon>) {
    let (reader, mut writer) = stream.into_split();
    let mut reader = BufReader::new(reader.take(MAX_REQUEST));
    let mut line = String::new();
    if reader.read_line(&mut line).await.is_err() {
        return;
    }
    let request = match serde_json::from_str::<Request>(&line) {
        Ok(request) => request,
        Err(e) => {
            let message = format!("unreadable request: {e}");
            let _ = answer(&mut writer, &Response::Error { message }).await;
            return;
        }
    };
    match request {
        Request::Lease {
            vm_dir,
            purpose,
            pid,
        } => {
            let id = daemon.next_lease.fetch_add(1, Ordering::Relaxed);
            take_lease(&daemon, &vm_dir, id, format!("{purpose} (pid {pid})"));
            if answer(&mut writer, &Response::Ok).await.is_ok() {
                // The lease lasts until the client closes the connection.
                let mut sink = [0u8; 256];
                while matches!(reader.read(&mut sink).await, Ok(n) if n > 0) {}
            }
            release_lease(&daemon, &vm_dir, id);
        }
        Request::Pin { vm_dir } => {
            set_pinned(&daemon, &vm_dir, true);
            let _ = answer(&mut writer, &Response::Ok).await;
        }
        Request::Unpin { vm_dir } => {
            set_pinned(&daemon, &vm_dir, false);
            let _ = answer(&mut writer, &Response::Ok).await;
        }
        Request::Status => {
            let vms = status(&daemon);
            let _ = answer(&mut writer, &Response::Status { vms }).await;
        }
        Request::Shutdown => {
            let _ = answer(&mut writer, &Response::Ok).await;
            daemon.shutdown.notify_one();
            // The client waits for this connection to close: keep it open until the
            // process exits, after every VM stopped.
            std::mem::forget(writer);
        }
    }
}

async fn answer(
    writer: &mut tokio::net::unix::OwnedWriteHalf,
    response: &Response,
) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(response).map_err(std::io::Error::other)?;
    line.push(b'\n');
    writer.write_all(&line).await
}

/// What the daemon knows of the VM in `vm_dir`; one it does not know yet starts out
/// pinned if `vmctl up` pinned its current run (its pin file, which outlives the
/// daemon's memory).
fn track<'a>(vms: &'a mut HashMap<PathBuf, Tracked>, vm_dir: &Path) -> &'a mut Tracked {
    vms.entry(vm_dir.to_path_buf()).or_insert_with(|| Tracked {
        pinned: pin_is_current(&VmDir {
            path: vm_dir.to_path_buf(),
        }),
        ..Tracked::default()
    })
}

/// Whether `vm`'s pin file pins a run that is on, starting, or about to start. One left
/// by a run that ended without `vmctl stop` (the guest powered off, the host rebooted)
/// is removed: it must not keep the next run from stopping when idle.
fn pin_is_current(vm: &VmDir) -> bool {
    let pin = vm.pin_file();
    let Ok(meta) = std::fs::metadata(&pin) else {
        return false;
    };
    let recent = meta
        .modified()
        .ok()
        .and_then(|written| written.elapsed().ok())
        .is_some_and(|age| age < PIN_GRACE);
    if recent || vm.running_pid().is_some() || crate::vm::lifecycle_lock_held(vm) {
        return true;
    }
    tracing::info!("{} pinned a run that has ended; removing it", pin.display());
    let _ = std::fs::remove_file(&pin);
    false
}

fn take_lease(daemon: &Daemon, vm_dir: &Path, id: u64, holder: String) {
    let mut vms = daemon.vms();
    let tracked = track(&mut vms, vm_dir);
    tracked.leases.insert(id, holder);
    tracked.idle_deadline = None;
    tracked.generation = daemon.new_generation();
}

fn release_lease(daemon: &Arc<Daemon>, vm_dir: &Path, id: u64) {
    let idle = {
        let mut vms = daemon.vms();
        let Some(tracked) = vms.get_mut(vm_dir) else {
            return;
        };
        tracked.leases.remove(&id);
        tracked.leases.is_empty() && !tracked.pinned
    };
    if idle {
        schedule_idle_stop(daemon, vm_dir);
    }
}

fn set_pinned(daemon: &Arc<Daemon>, vm_dir: &Path, pinned: bool) {
    let vm = VmDir {
        path: vm_dir.to_path_buf(),
    };
    let idle = {
        let mut vms = daemon.vms();
        let tracked = track(&mut vms, vm_dir);
        tracked.pinned = pinned;
        tracked.idle_deadline = None;
        tracked.generation = daemon.new_generation();
        !pinned && tracked.leases.is_empty()
    };
    if pinned {
        let _ = std::fs::write(vm.pin_file(), b"pinned by vmctl up\n");
    } else {
        let _ = std::fs::remove_file(vm.pin_file());
    }
    if idle {
        schedule_idle_stop(daemon, vm_dir);
    }
}

/// Stops the VM after the idle timeout, unless a lease or pin comes first.
fn schedule_idle_stop(daemon: &Arc<Daemon>, vm_dir: &Path) {
    let timeout = Duration::from_secs(daemon.idle_timeout_s.unwrap_or_else(idle_timeout_s));
    let generation = {
        let mut vms = daemon.vms();
        let Some(tracked) = vms.get_mut(vm_dir) else {
            return;
        };
        tracked.generation = daemon.new_generation();
        tracked.idle_deadline = Some(Instant::now() + timeout);
        tracked.generation
    };
    let daemon = daemon.clone();
    let vm_dir = vm_dir.to_path_buf();
    tokio::spawn(async move {
        tokio::time::sleep(timeout).await;
        let vm = VmDir { path: vm_dir };
        // Sessions hold leases, but those of a daemon that died (killed, crashed) are
        // lost with it, and the VM it left is adopted without: the guest agent knows.
        // Asked of adopted runs only: a guest's word must not keep every VM up.
        let asks_guest = asks_guest_for_sessions(&daemon.vms(), &vm, generation);
        if asks_guest {
            if let Some(sessions) = sessions_in_guest(&vm).await {
                vmm::to_stderr!(
                    "vmctl daemon: {} has {sessions} session(s) under way that hold no \
                     lease (a daemon before this one had theirs); not stopping it",
                    vm.path.display()
                );
                schedule_idle_stop(&daemon, &vm.path);
                return;
            }
            // Those sessions are over: from now on, leases alone count.
            vmm::to_stderr!(
                "vmctl daemon: {} runs no session that holds no lease; leases alone \
                 count from now on",
                vm.path.display()
            );
            if let Some(tracked) = daemon.vms().get_mut(&vm.path) {
                tracked.adopted = None;
            }
        }
        // Held while the VM goes down, so that a session coming meanwhile waits in its
        // start and boots a fresh VM instead of attaching to this one as it stops.
        let lifecycle_lock = match crate::vm::try_lock_lifecycle(&vm) {
            Ok(Some(lock)) => {
                crate::vm::note_lock_holder(&lock, crate::vm::LockHolder::Stopping);
                Some(lock)
            }
            Ok(None) => {
                // A session is attaching to the VM (its lease decides from now on),
                // or a start without one is under way: look again after a timeout.
                vmm::to_stderr!(
                    "vmctl daemon: {}'s start lock is held (a session attaching, or a \
                     start); not stopping it now",
                    vm.path.display()
                );
                if is_still_idle(&daemon.vms(), &vm.path, generation) {
                    schedule_idle_stop(&daemon, &vm.path);
                }
                return;
            }
            Err(e) => {
                tracing::debug!("cannot take {}'s start lock: {e}", vm.path.display());
                None
            }
        };
        let still_idle = {
            let mut vms = daemon.vms();
            let idle = is_still_idle(&vms, &vm.path, generation);
            if idle {
                vms.remove(&vm.path);
            }
            idle
        };
        if still_idle {
            vmm::to_stderr!(
                "vmctl daemon: {} idle for {timeout:?}; stopping it",
                vm.path.display()
            );
            let why = format!(
                "no session for {} s (the daemon stops idle VMs; `idle_timeout_s` in the \
                 config file sets how soon)",
                timeout.as_secs()
            );
            let _ = tokio::task::spawn_blocking(move || {
                let began = std::time::Instant::now();
                if let Some(supervisor) = crate::vm::stop_vm(&vm, &why) {
                    match crate::vm::stopped(&vm, supervisor) {
                        Ok(()) => vmm::to_stderr!(
                            "vmctl daemon: {} stopped after {:.1} s",
                            vm.path.display(),
                            began.elapsed().as_secs_f64()
                        ),
                        Err(e) => vmm::to_stderr!("vmctl daemon: error: {e}"),
                    }
                }
                drop(lifecycle_lock);
            })
            .await;
        }
    });
}

/// How long an adopted VM's guest agent has to say how many sessions it runs.
const SESSIONS_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// How many commands the guest agent of `vm` runs, if any; `None` too when it does not
/// answer (a VM stuck that way is stopped like an idle one).
async fn sessions_in_guest(vm: &VmDir) -> Option<u32> {
    let ask = async {
        // An older vmctl's VM (its sessions' leases went with an older daemon) is
        // asked in its own protocol: "cannot ask" would stop it under them.
        let connection = guest_agent::client::connect_hybrid_any_protocol(
            &vm.vsock_socket(),
            crate::exec::AGENT_PORT,
        )
        .await?;
        connection.health().await
    };
    match tokio::time::timeout(SESSIONS_ANSWER_TIMEOUT, ask).await {
        Ok(Ok(health)) => (health.active_execs > 0).then_some(health.active_execs),
        Ok(Err(e)) => {
            vmm::to_stderr!(
                "vmctl daemon: cannot ask the guest agent of {} for its sessions ({e}); \
                 taking it for idle",
                vm.path.display()
            );
            None
        }
        Err(_) => {
            vmm::to_stderr!(
                "vmctl daemon: the guest agent of {} did not say within {} s whether \
                 sessions are under way; taking it for idle",
                vm.path.display(),
                SESSIONS_ANSWER_TIMEOUT.as_secs()
            );
            None
        }
    }
}

/// Whether `vm` is still idle since `generation` and runs as adopted (not for longer
/// than [`ADOPTED_SESSIONS_TRUSTED`]), so that sessions without leases may be under
/// way in it.
fn asks_guest_for_sessions(vms: &HashMap<PathBuf, Tracked>, vm: &VmDir, generation: u64) -> bool {
    let adopted = vms.get(&vm.path).and_then(|tracked| tracked.adopted);
    is_still_idle(vms, &vm.path, generation)
        && adopted.is_some_and(|run| {
            vm.running_pid() == Some(run.pid) && run.at.elapsed() < ADOPTED_SESSIONS_TRUSTED
        })
}

/// Whether no lease, pin or new idle timer came for the VM since `generation`.
fn is_still_idle(vms: &HashMap<PathBuf, Tracked>, vm_dir: &Path, generation: u64) -> bool {
    vms.get(vm_dir).is_some_and(|t| t.generation == generation)
}

/// The idle timeout from the user's config (`idle_timeout_s`), read each time so a
/// change applies without restarting the daemon.
fn idle_timeout_s() -> u64 {
    idle_timeout_from(crate::user_config::UserConfig::load_idle_timeout())
}

/// The default timeout stands in for a config the daemon cannot read (its VMs must
/// still stop), and its log says why the file's is not used.
fn idle_timeout_from(configured: Result<Option<u64>, crate::user_config::UserConfigError>) -> u64 {
    match configured {
        Ok(timeout) => timeout.unwrap_or(DEFAULT_IDLE_TIMEOUT_S),
        Err(e) => {
            tracing::warn!("{e}; stopping idle VMs after the default {DEFAULT_IDLE_TIMEOUT_S} s");
            DEFAULT_IDLE_TIMEOUT_S
        }
    }
}

fn status(daemon: &Daemon) -> Vec<VmStatus> {
    let now = Instant::now();
    let mut vms: Vec<VmStatus> = daemon
        .vms()
        .iter()
        .map(|(vm_dir, tracked)| VmStatus {
            vm_dir: vm_dir.clone(),
            pinned: tracked.pinned,
            leases: tracked.leases.values().cloned().collect(),
            stops_in_s: tracked
                .idle_deadline
                .map(|deadline| deadline.saturating_duration_since(now).as_secs()),
        })
        .collect();
    vms.sort_by(|a, b| a.vm_dir.cmp(&b.vm_dir));
    vms
}

/// Forgets VMs that stopped by other means and have no leases (a VM still starting,
/// pinned by `vmctl up` before it runs, is kept); stops the daemon once
/// its state directory is gone and nothing is left to track, as when a test or a user
/// removes a whole state directory: no VM can start there any more, and a daemon per
/// removed directory would otherwise live on for good.
async fn reap_stopped_vms(daemon: Arc<Daemon>, vms_dir: PathBuf) {
    loop {
        tokio::time::sleep(REAP_INTERVAL).await;
        adopt_untracked_vms(&daemon, VmDir::all());
        let mut vms = daemon.vms();
        forget_ended_vms(&mut vms);
        if vms.is_empty() && removed(&vms_dir) {
            vmm::to_stderr!(
                "vmctl daemon: {} was removed; nothing left to serve",
                vms_dir.display()
            );
            daemon.shutdown.notify_one();
            return;
        }
    }
}

/// Forgets the VMs [`forgettable`] says the daemon may; a pinned one's pin goes too
/// unless a new run of it is about to start.
fn forget_ended_vms(vms: &mut HashMap<PathBuf, Tracked>) {
    vms.retain(|vm_dir, tracked| {
        let forget = forgettable(tracked, vm_dir);
        if forget && tracked.pinned {
            pin_is_current(&VmDir {
                path: vm_dir.to_path_buf(),
            });
        }
        !forget
    });
}

/// Whether the daemon may forget `tracked`: nothing holds it and it neither runs nor
/// is being started.
fn forgettable(tracked: &Tracked, vm_dir: &Path) -> bool {
    let vm = VmDir {
        path: vm_dir.to_path_buf(),
    };
    tracked.leases.is_empty() && vm.running_pid().is_none() && !crate::vm::lifecycle_lock_held(&vm)
}

fn removed(path: &Path) -> bool {
    matches!(
        std::fs::symlink_metadata(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound
    )
}

/// Stops those of `vms` that run, in parallel.
fn stop_every_vm(vms: Vec<VmDir>) {
    stop_each(vms, START_WAIT_AT_SHUTDOWN, |vm| {
        crate::vm::stop_vm(vm, "the daemon stopped, and every VM with it");
    });
}

/// `stop`s those of `vms` that run or are being started, in parallel, each with its
/// lifecycle lock held, as the idle stop does: a session that comes meanwhile waits in
/// its start, then boots a fresh VM, instead of attaching to one going down. (The lock
/// is waited for while a start holds it, but no longer than `vmctl stop` waits for a
/// start on a running VM.) A VM whose start is under way is stopped once its supervisor
/// runs, if that is within `start_wait`: left alone, it would come up after the daemon
/// that should have stopped it. A start that takes longer (a root filesystem built
/// first, a sudo prompt, a start stopped with Ctrl-Z) is left to the next daemon, which
/// adopts its VM, rather than holding this one's end past what its clients wait.
fn stop_each(vms: Vec<VmDir>, start_wait: Duration, stop: impl Fn(&VmDir) + Sync) {
    let running = vms
        .into_iter()
        .filter(|vm| vm.running_pid().is_some() || crate::vm::lifecycle_lock_held(vm));
    std::thread::scope(|scope| {
        for vm in running {
            let stop = &stop;
            scope.spawn(move || {
                if !supervisor_runs_within(&vm, start_wait) {
                    return;
                }
                let _lifecycle_lock = crate::vm::lock_to_stop(&vm, crate::vm::LockHolder::Stopping)
                    .inspect_err(|e| tracing::warn!("stopping it without its start lock: {e}"));
                stop(&vm);
            });
        }
    });
}

/// Whether `vm`'s supervisor runs, now or within `wait` while a start of it is under
/// way; says so when a start outlasts `wait`.
fn supervisor_runs_within(vm: &VmDir, wait: Duration) -> bool {
    let deadline = std::time::Instant::now() + wait;
    loop {
        if vm.running_pid().is_some() {
            return true;
        }
        if !crate::vm::lifecycle_lock_held(vm) {
            // The start failed (or was given up): nothing to stop.
            return vm.running_pid().is_some();
        }
        if std::time::Instant::now() >= deadline {
            vmm::to_stderr!(
                "vmctl daemon: the start of {} is still under way after {} s; leaving its \
                 VM to the next daemon, which adopts it (`vmctl stop` stops it)",
                vm.path.display(),
                wait.as_secs()
            );
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// How long a stopping daemon waits for a start under way to run its VM's supervisor:
/// with the 10 s `vmctl stop` then waits for the start and the 45 s of the stop, within
/// the 90 s its clients wait for it to be gone.
const START_WAIT_AT_SHUTDOWN: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_the_daemon_cannot_read_is_logged_with_its_file() {
        #[derive(Clone, Default)]
        struct Log(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Log {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let log = Log::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let error = crate::user_config::UserConfigError::Parse {
            path: "/home/me/.config/vmctl/config.toml".into(),
            line: Some(2),
            message: "invalid type: string \"60\", expected u64".into(),
        };
        let timeout =
            tracing::subscriber::with_default(subscriber, || idle_timeout_from(Err(error)));
        assert_eq!(timeout, DEFAULT_IDLE_TIMEOUT_S);
        let logged = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        assert!(logged.contains("WARN"), "{logged}");
        assert!(
            logged.contains("config.toml, line 2: invalid type"),
            "{logged}"
        );
    }

    #[test]
    fn a_second_daemon_does_not_start_while_the_first_holds_the_lock() {
        let _locks_free_when_dropped = crate::state::no_forks_meanwhile();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("run/vmctl/daemon-x.sock");
        // The first daemon took the lock and has not bound its socket yet: nothing
        // listens, and still the second must not start.
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        let first = take_lock(&socket.with_extension("lock"), &socket).unwrap();
        assert!(matches!(
            bind(&socket),
            Err(DaemonError::AlreadyRunning(path)) if path == socket
        ));
        assert!(!socket.exists(), "the second daemon bound the socket");
        // Once it is gone (its lock with it), a daemon starts, and holds it in turn.
        drop(first);
        let bound = bind(&socket).unwrap();
        assert!(std::os::unix::net::UnixStream::connect(&socket).is_ok());
        assert!(matches!(bind(&socket), Err(DaemonError::AlreadyRunning(_))));
        drop(bound);
    }

    /// A stopping daemon unlinks its lock file while it still holds it. A daemon that
    /// opened that file just before, and locks it once it is let go, must not take it
    /// for the lock: a third one would take the path's new file, and both would run.
    #[test]
    fn a_lock_on_a_lock_file_unlinked_meanwhile_is_not_the_lock() {
        let _locks_free_when_dropped = crate::state::no_forks_meanwhile();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("daemon-x.sock");
        let path = socket.with_extension("lock");
        let stopping = take_lock(&path, &socket).unwrap();
        let opened_before_the_unlink = crate::state::open_lock_file(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        drop(stopping);
        assert!(
            lock_if_current(opened_before_the_unlink, &path, &socket)
                .unwrap()
                .is_none(),
            "took the lock of an unlinked file"
        );
        // The next daemon takes the path's own (new) file, and holds the only lock.
        let next = take_lock(&path, &socket).unwrap();
        assert!(is_linked_at(&next, &path).unwrap());
        assert!(matches!(
            take_lock(&path, &socket),
            Err(DaemonError::AlreadyRunning(_))
        ));
        drop(next);
    }

    /// The user's runtime directory is theirs: the daemon makes its own directory in
    /// it, private, and leaves the runtime directory as it was.
    #[test]
    fn the_daemon_leaves_the_runtime_directory_as_it_is() {
        use std::os::unix::fs::PermissionsExt;
        let _locks_free_when_dropped = crate::state::no_forks_meanwhile();
        let dir = tempfile::tempdir().unwrap();
        let runtime = dir.path().join("run");
        std::fs::create_dir(&runtime).unwrap();
        std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o755)).unwrap();
        let socket = runtime.join("vmctl/daemon-x.sock");
        let bound = bind(&socket).unwrap();
        let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&runtime), 0o755, "the runtime directory was changed");
        assert_eq!(mode(socket.parent().unwrap()), 0o700);
        drop(bound);
    }

    /// A session that comes while the daemon stops its VM must not attach to it: the
    /// daemon holds each VM's lifecycle lock while it stops it.
    #[test]
    fn the_daemon_stops_each_vm_with_its_lifecycle_lock_held() {
        let dir = tempfile::tempdir().unwrap();
        let vms = vm_dirs_in(dir.path(), &["one", "two", "stopped"]);
        let _running: Vec<_> = vms[..2].iter().map(FakeSupervisor::start).collect();
        let (stopped, stops) = std::sync::mpsc::channel();
        let stopped = Mutex::new(stopped);
        stop_each(vms.clone(), START_WAIT_AT_SHUTDOWN, |vm| {
            // Another open file's lock, as a session's start takes it.
            let held = crate::vm::lifecycle_lock_held(vm);
            let _ = stopped.lock().unwrap().send((vm.path.clone(), held));
        });
        let mut seen: Vec<(PathBuf, bool)> = stops.try_iter().collect();
        seen.sort();
        assert_eq!(
            seen,
            vec![(vms[0].path.clone(), true), (vms[1].path.clone(), true)],
            "stopped without the lifecycle lock, or a VM that does not run"
        );
    }

    /// A VM whose start is under way as the daemon stops (its lifecycle lock held, its
    /// supervisor not running yet) is stopped once the start is done, not left to come
    /// up after the daemon; one whose start fails is left alone.
    #[test]
    fn the_daemon_stops_a_vm_whose_start_is_under_way_once_it_is_up() {
        let dir = tempfile::tempdir().unwrap();
        let vms = vm_dirs_in(dir.path(), &["coming-up", "failing"]);
        let starts: Vec<std::fs::File> = vms
            .iter()
            .map(|vm| {
                crate::vm::try_lock_lifecycle(vm)
                    .unwrap()
                    .expect("the lock")
            })
            .collect();
        let (stopped, stops) = std::sync::mpsc::channel();
        let stopped = Mutex::new(stopped);
        let supervisor = std::thread::scope(|scope| {
            let stopping = scope.spawn(|| {
                stop_each(vms.clone(), START_WAIT_AT_SHUTDOWN, |vm| {
                    let running = vm.running_pid().is_some();
                    let _ = stopped.lock().unwrap().send((vm.path.clone(), running));
                })
            });
            std::thread::sleep(Duration::from_millis(300));
            assert!(
                stops.try_recv().is_err(),
                "stopped before the start was done"
            );
            // One start brings its VM up, the other fails; both let go of the lock.
            let supervisor = FakeSupervisor::start(&vms[0]);
            drop(starts);
            stopping.join().unwrap();
            supervisor
        });
        drop(supervisor);
        let seen: Vec<(PathBuf, bool)> = stops.try_iter().collect();
        assert_eq!(seen, vec![(vms[0].path.clone(), true)]);

        // A start that outlasts the wait is left to the next daemon: the stop ends.
        let stuck = crate::vm::try_lock_lifecycle(&vms[1])
            .unwrap()
            .expect("the lock");
        let began = std::time::Instant::now();
        stop_each(vms[1..].to_vec(), Duration::from_millis(300), |vm| {
            panic!("stopped {}, which never came up", vm.path.display())
        });
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "waited past its bound"
        );
        drop(stuck);
    }

    /// A client of a daemon that is stopping is told so, but for `vmctl daemon
    /// --stop`, which is told yes and then waits for the daemon to end.
    #[tokio::test]
    async fn a_daemon_that_is_stopping_says_so() {
        let ask = |request: Request| async move {
            let (client, server) = UnixStream::pair().unwrap();
            let serving = tokio::spawn(answer_stopping(server));
            let (reader, mut writer) = client.into_split();
            let mut line = serde_json::to_vec(&request).unwrap();
            line.push(b'\n');
            writer.write_all(&line).await.unwrap();
            let mut answer = String::new();
            BufReader::new(reader).read_line(&mut answer).await.unwrap();
            serving.await.unwrap();
            serde_json::from_str::<Response>(&answer).unwrap()
        };
        let lease = Request::Lease {
            vm_dir: "/vms/one".into(),
            purpose: "exec".into(),
            pid: 1,
        };
        assert_eq!(ask(lease).await, Response::Stopping);
        assert_eq!(ask(Request::Status).await, Response::Stopping);
        assert_eq!(ask(Request::Shutdown).await, Response::Ok);
    }

    fn daemon() -> Arc<Daemon> {
        Arc::new(Daemon {
            vms: Mutex::new(HashMap::new()),
            next_lease: AtomicU64::new(1),
            next_generation: AtomicU64::new(1),
            shutdown: Notify::new(),
            // Whatever the config file of whoever runs the tests says.
            idle_timeout_s: Some(DEFAULT_IDLE_TIMEOUT_S),
        })
    }

    /// A stand-in for `vm`'s supervisor (what `running_pid` takes for one) that exits
    /// on SIGTERM; dropping it kills it.
    /// VM directories named `names`, made in `parent`.
    fn vm_dirs_in(parent: &Path, names: &[&str]) -> Vec<VmDir> {
        names
            .iter()
            .map(|name| {
                let vm = VmDir {
                    path: parent.join(name),
                };
                std::fs::create_dir_all(&vm.path).unwrap();
                vm
            })
            .collect()
    }

    struct FakeSupervisor(crate::state::FakeSupervisor);

    impl FakeSupervisor {
        fn start(vm: &VmDir) -> Self {
            Self(crate::state::fake_supervisor(
                vm,
                "trap 'exit 0' TERM; while :; do sleep 0.05; done",
            ))
        }

        fn stopped(&mut self) -> bool {
            self.0 .0.try_wait().unwrap().is_some()
        }
    }

    fn age_file(path: &Path, by: Duration) {
        let file = std::fs::File::options().write(true).open(path).unwrap();
        file.set_modified(std::time::SystemTime::now() - by)
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_timer_of_an_earlier_run_does_not_stop_the_vm_up_pinned_since() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let daemon = daemon();
        // A VM runs; an exec session on it ends: its idle timer starts.
        let first = FakeSupervisor::start(&vm);
        take_lease(&daemon, &vm.path, 1, "exec (pid 1)".into());
        release_lease(&daemon, &vm.path, 1);
        tokio::time::sleep(Duration::from_secs(5)).await;
        // `vmctl stop`; the reaper forgets the VM.
        set_pinned(&daemon, &vm.path, false);
        drop(first);
        forget_ended_vms(&mut daemon.vms());
        assert!(status(&daemon).is_empty());
        // `vmctl up` pins it and starts it again; a short `vmctl exec` on it.
        set_pinned(&daemon, &vm.path, true);
        let mut second = FakeSupervisor::start(&vm);
        take_lease(&daemon, &vm.path, 2, "exec (pid 2)".into());
        release_lease(&daemon, &vm.path, 2);
        // The first run's timer comes due.
        tokio::time::sleep(Duration::from_secs(30)).await;
        tokio::task::yield_now().await;
        assert!(!second.stopped(), "the pinned VM was stopped as idle");
        assert!(status(&daemon)[0].pinned);
    }

    #[tokio::test]
    async fn a_pin_whose_run_ended_by_itself_does_not_pin_the_next_run() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let daemon = daemon();
        set_pinned(&daemon, &vm.path, true);
        let run = FakeSupervisor::start(&vm);
        // Within its grace a pin waits for its VM to start, even if the reaper runs.
        forget_ended_vms(&mut daemon.vms());
        assert!(status(&daemon)[0].pinned);
        // The VM powers off by itself, a while later; the reaper forgets it.
        drop(run);
        age_file(&vm.pin_file(), PIN_GRACE * 2);
        forget_ended_vms(&mut daemon.vms());
        assert!(status(&daemon).is_empty());
        assert!(!vm.pin_file().exists(), "the ended run's pin is left");
        // A plain `vmctl exec` later: its VM stops when idle.
        take_lease(&daemon, &vm.path, 7, "exec (pid 7)".into());
        release_lease(&daemon, &vm.path, 7);
        let after = status(&daemon);
        assert!(!after[0].pinned && after[0].stops_in_s.is_some());

        // The same when the daemon itself was gone meanwhile (a host reboot): the
        // next daemon finds the file, and the run it pinned is over.
        let daemon = super::tests::daemon();
        std::fs::write(vm.pin_file(), b"pinned by vmctl up\n").unwrap();
        age_file(&vm.pin_file(), PIN_GRACE * 2);
        take_lease(&daemon, &vm.path, 1, "exec (pid 1)".into());
        release_lease(&daemon, &vm.path, 1);
        assert!(!status(&daemon)[0].pinned);
        assert!(!vm.pin_file().exists());
    }

    #[tokio::test]
    async fn a_session_on_a_vm_pinned_by_up_leaves_it_pinned() {
        // `vmctl up` pinned the VM, and the daemon has since forgotten it (it was
        // restarted, or reaped the VM while it booted): the pin file still holds.
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        std::fs::write(vm.pin_file(), b"pinned by vmctl up\n").unwrap();
        let daemon = daemon();
        take_lease(&daemon, &vm.path, 1, "exec (pid 1)".into());
        release_lease(&daemon, &vm.path, 1);
        let after_session = status(&daemon);
        assert_eq!(after_session.len(), 1);
        assert!(after_session[0].pinned, "the session unpinned it");
        assert_eq!(after_session[0].stops_in_s, None, "it would stop when idle");

        // Unpinned (`vmctl stop`), a session's end makes it idle as before.
        set_pinned(&daemon, &vm.path, false);
        take_lease(&daemon, &vm.path, 2, "exec (pid 2)".into());
        release_lease(&daemon, &vm.path, 2);
        assert!(status(&daemon)[0].stops_in_s.is_some());
    }

    #[tokio::test(start_paused = true)]
    // The guard is held across the awaits on purpose: this test's whole run (a moment
    // of real time) needs its lifecycle lock free the moment it drops it.
    #[allow(clippy::await_holding_lock)]
    async fn an_idle_stop_waits_for_a_session_attaching_to_the_vm() {
        let _locks_free_when_dropped = crate::state::no_forks_meanwhile();
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        let timeout = Duration::from_secs(DEFAULT_IDLE_TIMEOUT_S);
        let daemon = daemon();
        take_lease(&daemon, &vm.path, 1, "exec (pid 1)".into());
        release_lease(&daemon, &vm.path, 1);
        // The next session is attaching to the VM as its idle timeout ends.
        let attaching = crate::vm::try_lock_lifecycle(&vm)
            .unwrap()
            .expect("a free lock");
        tokio::time::sleep(timeout + Duration::from_secs(1)).await;
        let waiting = status(&daemon);
        assert_eq!(waiting.len(), 1, "stopped under a session attaching to it");
        assert!(waiting[0].stops_in_s.is_some(), "no longer stops when idle");
        // Its lease comes: the VM stays for it.
        take_lease(&daemon, &vm.path, 2, "exec (pid 2)".into());
        drop(attaching);
        tokio::time::sleep(timeout * 2).await;
        assert_eq!(status(&daemon).len(), 1, "stopped under a session");
        // That session ends and none comes: the VM is stopped (and forgotten).
        release_lease(&daemon, &vm.path, 2);
        tokio::time::sleep(timeout + Duration::from_secs(1)).await;
        assert!(status(&daemon).is_empty(), "an idle VM was not stopped");
    }

    /// The directory of a VM named `name` in `dir`, made.
    fn vm_dir_in(dir: &Path, name: &str) -> VmDir {
        let vm = VmDir {
            path: dir.join(name),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        vm
    }

    /// Only the run of a VM found going when the daemon started may have sessions
    /// without leases, for a day at most; any other's guest is not asked, so it cannot
    /// keep its VM up by saying it has some.
    #[tokio::test(start_paused = true)]
    async fn only_adopted_runs_ask_their_guest_for_sessions() {
        let dir = tempfile::tempdir().unwrap();
        let daemon = daemon();
        let vm = |name: &str| vm_dir_in(dir.path(), name);
        let idle = |vm: &VmDir, adopted: Option<AdoptedRun>| {
            let mut vms = daemon.vms();
            let tracked = track(&mut vms, &vm.path);
            tracked.adopted = adopted;
            tracked.generation = daemon.new_generation();
            tracked.generation
        };
        let leased = vm("leased");
        let _leased_run = FakeSupervisor::start(&leased);
        let generation = idle(&leased, None);
        assert!(!asks_guest_for_sessions(&daemon.vms(), &leased, generation));

        let adopted = vm("adopted");
        let run = FakeSupervisor::start(&adopted);
        let pid = adopted.running_pid().unwrap();
        let at = tokio::time::Instant::now();
        let generation = idle(&adopted, Some(AdoptedRun { pid, at }));
        assert!(asks_guest_for_sessions(&daemon.vms(), &adopted, generation));
        assert!(
            !asks_guest_for_sessions(&daemon.vms(), &adopted, generation + 1),
            "a lease came since"
        );
        tokio::time::advance(ADOPTED_SESSIONS_TRUSTED).await;
        assert!(
            !asks_guest_for_sessions(&daemon.vms(), &adopted, generation),
            "believed for longer than a day"
        );

        // A later run of the VM is not the one adopted.
        drop(run);
        let _next_run = FakeSupervisor::start(&adopted);
        let generation = idle(
            &adopted,
            Some(AdoptedRun {
                pid,
                at: tokio::time::Instant::now(),
            }),
        );
        assert!(!asks_guest_for_sessions(
            &daemon.vms(),
            &adopted,
            generation
        ));
    }

    /// A running VM the daemon does not track (its session's lease went to a daemon
    /// that died as it booted) is adopted by the next look, and so stops once idle;
    /// one tracked keeps how it is tracked.
    #[tokio::test(start_paused = true)]
    async fn running_vms_the_daemon_does_not_track_are_adopted() {
        let dir = tempfile::tempdir().unwrap();
        let daemon = daemon();
        let vm = |name: &str| vm_dir_in(dir.path(), name);
        let (untracked, leased, stopped) = (vm("untracked"), vm("leased"), vm("stopped"));
        let stopping = vm("stopping");
        let _untracked_run = FakeSupervisor::start(&untracked);
        let _leased_run = FakeSupervisor::start(&leased);
        let _stopping_run = FakeSupervisor::start(&stopping);
        // The idle stop's hold: untracked, its lock noted as a stop's.
        let stop_lock = crate::vm::try_lock_lifecycle(&stopping).unwrap().unwrap();
        crate::vm::note_lock_holder(&stop_lock, crate::vm::LockHolder::Stopping);
        take_lease(&daemon, &leased.path, 2, "exec (pid 2)".into());
        adopt_untracked_vms(
            &daemon,
            vec![
                untracked.clone(),
                leased.clone(),
                stopped.clone(),
                stopping.clone(),
            ],
        );
        let vms = daemon.vms();
        let adopted = vms.get(&untracked.path).and_then(|tracked| tracked.adopted);
        assert_eq!(
            adopted.map(|run| run.pid),
            untracked.running_pid(),
            "not adopted"
        );
        assert!(
            vms[&leased.path].adopted.is_none(),
            "a leased VM was adopted"
        );
        assert!(!vms.contains_key(&stopped.path), "a stopped VM was tracked");
        assert!(
            !vms.contains_key(&stopping.path),
            "a VM being stopped was adopted"
        );
        drop(stop_lock);
    }

    #[test]
    fn a_vm_being_started_is_not_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let untracked = Tracked::default();
        assert!(
            forgettable(&untracked, dir.path()),
            "neither running nor starting"
        );

        let lifecycle_lock =
            crate::state::open_lock_file(&dir.path().join(crate::vm::LIFECYCLE_LOCK)).unwrap();
        lifecycle_lock.lock().unwrap();
        assert!(
            !forgettable(&untracked, dir.path()),
            "forgotten while it starts"
        );
        drop(lifecycle_lock);
        assert!(
            forgettable(&untracked, dir.path()),
            "a start that ended (or failed)"
        );

        let mut leased = Tracked::default();
        leased.leases.insert(1, "exec (pid 1)".into());
        assert!(!forgettable(&leased, dir.path()));
    }
}
