//! The virtiofsd daemons that serve a VM's shares: one per share, started before the
//! VMM connects to their vhost-user sockets, watched while the VM runs, and stopped
//! with it.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm::config::FsConfig;

mod binary;
pub mod cache;
mod daemon;

pub use self::binary::find_virtiofsd;
use self::binary::{MIN_VERSION, VIRTIOFSD_ENV};
pub use self::cache::{CachePolicy, CACHE_ENV};
use self::daemon::{spawn_daemon, wait_started, Daemon, GivenUp, Sandbox, StartOutcome};
use crate::share_root::{self, Root};
use crate::shares::{self, Share};

/// How long a daemon may take to create its socket.
/// Generous: a loaded machine (or the nested host, under emulation) can take seconds.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Every poll is a stat or a readlink: often, as every VM start waits on these.
const START_POLL: Duration = Duration::from_millis(2);
/// virtiofsd creates its socket before it enters its sandbox, so a daemon whose
/// sandbox fails exits just after its socket appeared. In a namespace sandbox,
/// [`confirm_root`] waits for the pivot into the share, which a failing one never
/// makes; a daemon without one must live this long past its socket to count as
/// started.
const SETTLE_TIME: Duration = Duration::from_millis(100);
/// How often the watcher looks for dead daemons.
const WATCH_POLL: Duration = Duration::from_millis(200);
/// How long the VMM may take to end after a daemon exited cleanly (which it does as
/// the VMM disconnects) before the daemon counts as lost while the VM runs. The VMM
/// closes its sockets as its VM ends, just before it exits: this only covers a loaded
/// host.
const CLEAN_EXIT_GRACE: Duration = Duration::from_secs(2);
/// How long daemons get to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// How long a daemon killed as the VM stops has to end, with what it forked, before
/// vmctl says it is still there and goes on without it: one stuck in the kernel (a
/// hung NFS mount) would otherwise hold up `vmctl stop` for ever.
const STOP_KILL_WAIT: Duration = Duration::from_secs(3);
/// How long a daemon the VMM gave up on has, once killed, to end with what it forked.
/// SIGKILL ends a process at once, unless it is stuck in the kernel (a hard NFS mount,
/// a FUSE server that stopped): then it waits for that, and so do the guest's requests.
const KILL_WAIT: Duration = Duration::from_secs(3);
/// How often [`terminate`] looks whether the daemons it killed are gone: each look
/// reads every process's `/proc/PID/stat`.
const KILL_POLL: Duration = Duration::from_millis(50);
/// Lines of a daemon's log quoted when it fails to start.
const LOG_TAIL_LINES: usize = 10;
/// `sun_path` holds 108 bytes, with the terminating NUL.
const MAX_SOCKET_PATH: usize = 107;

#[derive(Debug, thiserror::Error)]
pub enum VirtiofsdError {
    #[error("{CACHE_ENV}={value:?}: expected auto, never, metadata or always, optionally followed by +writeback")]
    BadCachePolicy { value: String },
    #[error("virtiofsd not found (looked for {searched}); run scripts/setup.sh, or 'cargo install virtiofsd' (it needs the Debian packages libcap-ng-dev and libseccomp-dev), or set {VIRTIOFSD_ENV} to its path")]
    NotFound { searched: String },
    #[error("{VIRTIOFSD_ENV}={}: not an executable file; point it at the virtiofsd binary or unset it", .0.display())]
    OverrideNotExecutable(PathBuf),
    #[error("no virtiofsd recent enough: {found}. vmctl needs the Rust virtiofsd {MIN_VERSION} or later (older ones open a share again by its path at each mount by the guest, where a link could have been swapped in since); run scripts/setup.sh, or 'cargo install --locked virtiofsd' (it needs the Debian packages libcap-ng-dev and libseccomp-dev), or set {VIRTIOFSD_ENV} to one that is")]
    TooOld { found: String },
    #[error("virtiofsd socket path {} is {len} bytes, longer than the {MAX_SOCKET_PATH} a Unix socket allows; use a shorter XDG_STATE_HOME", .path.display())]
    SocketPathTooLong { path: PathBuf, len: usize },
    #[error("the share {} is not valid UTF-8, which virtiofsd cannot take as its directory; rename the directory (or the one on its path whose name is not UTF-8)", .0.display())]
    ShareNotUtf8(PathBuf),
    #[error("virtiofsd socket path {} is not valid UTF-8, which virtiofsd cannot take; use an XDG_STATE_HOME that is", .0.display())]
    SocketPathNotUtf8(PathBuf),
    #[error("cannot prepare {} for virtiofsd: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot run {} for the share {}: {source}", .binary.display(), .host.display())]
    Spawn {
        binary: PathBuf,
        host: PathBuf,
        source: std::io::Error,
    },
    #[error("the share {} now leads to {}: a directory on its way was replaced since the VM was set up, perhaps by a link a guest made; not serving it (check the path, then start the VM again)", .host.display(), .now.display())]
    ShareMoved { host: PathBuf, now: PathBuf },
    #[error("cannot open the share {} without following links: {source}; a directory on its way is missing, or was replaced by a link (perhaps by a guest); not serving it (check the path, then start the VM again)", .host.display())]
    ShareUnreachable {
        host: PathBuf,
        source: std::io::Error,
    },
    #[error("virtiofsd for the share {} got another directory: one on the share's path was swapped for a link as it started (perhaps by another VM's guest, in its own share); not serving it (check the path, then start the VM again)", .host.display())]
    ShareSwapped { host: PathBuf },
    #[error("virtiofsd for the share {} did not enter its sandbox within {} s; the end of its log {}:\n{tail}", .host.display(), START_TIMEOUT.as_secs(), .log.display())]
    NoSandbox {
        host: PathBuf,
        log: PathBuf,
        tail: String,
    },
    #[error("virtiofsd for the share {} exited while starting ({status}); the end of its log {}:\n{tail}{hint}", .host.display(), .log.display())]
    Exited {
        host: PathBuf,
        status: String,
        log: PathBuf,
        tail: String,
        /// What to do if its namespace sandbox is what failed (empty without one).
        hint: String,
    },
    #[error("{SANDBOX_ENV}={value:?}: expected namespace (the default) or none")]
    BadSandbox { value: String },
    #[error("virtiofsd for the share {} did not create its socket {} within {} s; the end of its log {}:\n{tail}", .host.display(), .socket.display(), START_TIMEOUT.as_secs(), .log.display())]
    Timeout {
        host: PathBuf,
        socket: PathBuf,
        log: PathBuf,
        tail: String,
    },
}

const UNPRIVILEGED_NOTE: &str = "vmctl: note: virtiofsd runs as this user, in a user \
     namespace that maps only this user: files any guest user creates are this user's, \
     a guest chown to another user fails, other users' files show as nobody (the README's \
     \"Ownership\")";

const NO_SANDBOX_WARNING: &str = "vmctl: warning: virtiofsd runs without its sandbox because \
     user namespaces are unavailable to this user: a guest that exploits symlink races could \
     reach host files outside its shares";

const NO_SANDBOX_ASKED_WARNING: &str = "vmctl: warning: virtiofsd runs without its sandbox, as \
     VMCTL_VIRTIOFSD_SANDBOX=none asks: a guest that exploits symlink races could reach host \
     files outside its shares";

/// Chooses virtiofsd's sandbox: `namespace` (the default: the namespace sandbox
/// wherever this user may have one) or `none`, for a host where the namespace sandbox
/// fails although user namespaces are there (a container, an AppArmor rule).
pub const SANDBOX_ENV: &str = "VMCTL_VIRTIOFSD_SANDBOX";

const SANDBOX_HINT: &str = "\n(if it is virtiofsd's namespace sandbox that cannot work on \
     this host, VMCTL_VIRTIOFSD_SANDBOX=none runs it without one, which is less safe: see the \
     README's \"Workspace files (virtio-fs)\")";

/// The sandbox for this start's daemons, and what to add to the error of one that
/// fails to start in it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SandboxChoice {
    sandbox: Sandbox,
    hint: String,
}

/// What this user may do with the namespaces virtiofsd's sandbox makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Namespaces {
    /// A user namespace, and mount, PID and network namespaces inside it.
    Available,
    /// No user namespace at all (`kernel.unprivileged_userns_clone=0`,
    /// `user.max_user_namespaces=0`).
    NoUserNamespace,
    /// A user namespace, but none of the others inside it (the errno): what Ubuntu's
    /// `kernel.apparmor_restrict_unprivileged_userns=1` does to a program without an
    /// AppArmor profile that allows it. virtiofsd may have such a profile (vmctl, which
    /// probed, may not), so its sandbox is still tried.
    RestrictedInside(i32),
    /// The probe failed for a reason of its own (no process to spare).
    Unknown,
}

/// The sandbox for this start's daemons: the namespace sandbox, unless [`SANDBOX_ENV`]
/// says none or this user cannot make a user namespace at all. Decided once, before
/// any daemon starts: a daemon that fails in its sandbox is an error, never a reason
/// to try again without (a guest can make a start fail, by moving a directory on a
/// share's path at the right moment). `probe` is asked only when it matters.
fn choose_sandbox(
    is_root: bool,
    asked: Option<&str>,
    probe: impl FnOnce() -> Namespaces,
) -> Result<SandboxChoice, VirtiofsdError> {
    let namespace = |hint: String| SandboxChoice {
        sandbox: Sandbox::Namespace,
        hint,
    };
    match asked.map(str::trim) {
        None | Some("" | "namespace") => {}
        Some("none") => {
            vmm::to_stderr!("{NO_SANDBOX_ASKED_WARNING}");
            return Ok(SandboxChoice {
                sandbox: Sandbox::None,
                hint: String::new(),
            });
        }
        Some(value) => {
            return Err(VirtiofsdError::BadSandbox {
                value: value.to_string(),
            })
        }
    }
    if is_root {
        return Ok(namespace(SANDBOX_HINT.into()));
    }
    match probe() {
        Namespaces::Available | Namespaces::Unknown => Ok(namespace(SANDBOX_HINT.into())),
        Namespaces::RestrictedInside(errno) => Ok(namespace(restricted_hint(errno))),
        Namespaces::NoUserNamespace => {
            vmm::to_stderr!("{NO_SANDBOX_WARNING}");
            Ok(SandboxChoice {
                sandbox: Sandbox::None,
                hint: String::new(),
            })
        }
    }
}

/// Why a daemon failed in its sandbox where this user may make a user namespace but
/// nothing inside it, and the two ways out.
fn restricted_hint(errno: i32) -> String {
    format!(
        "\n(this user may make a user namespace, but not the mount, PID and network \
         namespaces virtiofsd's sandbox makes inside it: {}. On Ubuntu 23.10 and later \
         AppArmor does this (kernel.apparmor_restrict_unprivileged_userns=1). Either give \
         virtiofsd an AppArmor profile that allows user namespaces (the README's \
         \"Workspace files (virtio-fs)\" shows one), or set {SANDBOX_ENV}=none to run it \
         without its sandbox, which is less safe)",
        std::io::Error::from_raw_os_error(errno)
    )
}

/// What this user may do with namespaces: a user namespace, then the namespaces
/// virtiofsd makes inside one, each tried in a child (a threaded process may not make
/// a user namespace). Only a refusal by the kernel says no.
fn probe_namespaces() -> Namespaces {
    const INSIDE: libc::c_int = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWNET;
    match unshare_in_child(&[libc::CLONE_NEWUSER]) {
        Ok(()) => {}
        Err(e) if refuses_namespaces(&e) => return Namespaces::NoUserNamespace,
        Err(_) => return Namespaces::Unknown,
    }
    match unshare_in_child(&[libc::CLONE_NEWUSER, INSIDE]) {
        Ok(()) => Namespaces::Available,
        Err(e) if refuses_namespaces(&e) => {
            Namespaces::RestrictedInside(e.raw_os_error().unwrap_or(libc::EPERM))
        }
        Err(_) => Namespaces::Unknown,
    }
}

/// Runs `/bin/true` after unsharing each of `steps` in turn; the error of the first
/// step refused.
fn unshare_in_child(steps: &'static [libc::c_int]) -> std::io::Result<()> {
    use std::os::unix::process::CommandExt;
    let mut probe = std::process::Command::new("/bin/true");
    probe
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: the closure runs in the child between fork and exec and only calls
    // unshare, which is async-signal-safe.
    unsafe {
        probe.pre_exec(move || {
            for &flags in steps {
                if libc::unshare(flags) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    match probe.status() {
        Ok(_) => Ok(()),
        Err(e) => {
            tracing::info!("probing for namespaces ({steps:#x?}): {e}");
            Err(e)
        }
    }
}

/// Whether `error` (from unshare) is the kernel refusing the namespaces, rather than
/// the probe failing for a reason of its own.
fn refuses_namespaces(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EPERM | libc::EINVAL | libc::ENOSPC | libc::EUSERS | libc::EACCES)
    )
}

/// Refuses a share whose (canonical) host path no longer resolves to itself: the path
/// was checked when the VM was set up, and a component swapped for a link since (by
/// another VM's guest, in its own share) would hand virtiofsd another directory. A
/// path gone altogether is left to virtiofsd, which says so.
fn check_unmoved(share: &Share) -> Result<(), VirtiofsdError> {
    match share.host.canonicalize() {
        Ok(now) if now != share.host => Err(VirtiofsdError::ShareMoved {
            host: share.host.clone(),
            now,
        }),
        _ => Ok(()),
    }
}

/// Where the virtiofsd of share `index` logs, in the directory given to [`start`].
pub fn log_path(log_dir: &Path, index: usize) -> PathBuf {
    log_dir.join(format!("virtiofsd-{index}.log"))
}

/// virtiofsd's arguments for `share` on `socket`.
/// What the watcher and `stop` share.
struct Watched {
    daemons: Vec<Daemon>,
    failures: Vec<String>,
    stopping: bool,
    /// Also appends each failure here.
    failure_file: Option<PathBuf>,
    /// Whether the VM's VMM still runs ([`crate::vmm_process::vmm_running`]): a
    /// daemon that exits cleanly before it ends lost its session with a running VM.
    /// (Never where the frontend is not vmctl's VMM, such as the nested host's QEMU:
    /// there a clean exit is taken for the VM's end, as it mostly is.)
    vmm_running: fn() -> bool,
    /// Whether a process of the given process group still runs
    /// ([`process_group_alive`]; tests stand in for a process stuck in the kernel).
    group_alive: fn(libc::pid_t) -> bool,
}

struct Shared {
    state: Mutex<Watched>,
    /// Wakes the watcher when stopping.
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Watched> {
        // A panic elsewhere must not keep us from stopping the daemons.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The running daemons of a VM's shares. Dropping it (or [`FsDaemons::stop`]) stops
/// them.
pub struct FsDaemons {
    shared: Arc<Shared>,
    watcher: Option<JoinHandle<()>>,
    /// The threads that wait for the daemons given up on to end, and report it:
    /// stopping waits for them, so that no report is cut short or comes after the
    /// VM's end is said.
    give_ups: Mutex<Vec<JoinHandle<()>>>,
}

/// Starts one virtiofsd per share: share `i` on `socket_dir/fs{i}.sock` with tag
/// [`shares::tag`]`(i)`, its output appended to `log_dir/virtiofsd-{i}.log`. Returns
/// once every socket exists, with the devices for the VMM.
///
/// Call it from a thread that lives as long as the VM: the daemons get SIGTERM when
/// that thread ends. Nothing else in the process may reap them (`waitpid(-1)`).
pub fn start(
    binary: &Path,
    shares: &[Share],
    socket_dir: &Path,
    log_dir: &Path,
    policy: CachePolicy,
) -> Result<(FsDaemons, Vec<FsConfig>), VirtiofsdError> {
    // SAFETY: geteuid cannot fail.
    let is_root = unsafe { libc::geteuid() } == 0;
    let asked = std::env::var(SANDBOX_ENV).ok();
    start_as(
        binary,
        shares,
        socket_dir,
        log_dir,
        is_root,
        asked.as_deref(),
        policy,
    )
}

fn start_as(
    binary: &Path,
    shares: &[Share],
    socket_dir: &Path,
    log_dir: &Path,
    is_root: bool,
    sandbox_asked: Option<&str>,
    policy: CachePolicy,
) -> Result<(FsDaemons, Vec<FsConfig>), VirtiofsdError> {
    let SandboxChoice { sandbox, hint } = match shares.is_empty() {
        true => SandboxChoice {
            sandbox: Sandbox::Namespace,
            hint: String::new(),
        },
        false => choose_sandbox(is_root, sandbox_asked, probe_namespaces)?,
    };
    if !is_root && !shares.is_empty() && sandbox == Sandbox::Namespace {
        // Not a weaker sandbox but other ownership. (In a VM's supervisor log, which
        // `vmctl logs --supervisor` shows; not on the user's terminal at each start.)
        vmm::to_stderr!("{UNPRIVILEGED_NOTE}");
    }
    let mut daemons = Vec::with_capacity(shares.len());
    if let Err(e) = start_all(
        binary,
        shares,
        socket_dir,
        log_dir,
        SandboxChoice { sandbox, hint },
        policy,
        &mut daemons,
    ) {
        for index in terminate(&mut daemons, process_group_alive) {
            say_still_there(&daemons[index]);
        }
        return Err(e);
    }
    let devices = daemons
        .iter()
        .enumerate()
        .map(|(index, daemon)| FsConfig {
            socket_path: daemon.socket.clone(),
            tag: shares::tag(index),
        })
        .collect();
    let shared = Arc::new(Shared {
        state: Mutex::new(Watched {
            daemons,
            failures: Vec::new(),
            stopping: false,
            failure_file: None,
            vmm_running: crate::vmm_process::vmm_running,
            group_alive: process_group_alive,
        }),
        wake: Condvar::new(),
    });
    let watcher = {
        let shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("virtiofsd-watch".into())
            .spawn(move || watch(&shared))
            .map_err(|source| VirtiofsdError::Io {
                path: socket_dir.to_path_buf(),
                source,
            })
    };
    // Built before checking the watcher so that a failure still stops the daemons.
    let mut fs_daemons = FsDaemons {
        shared,
        watcher: None,
        give_ups: Mutex::new(Vec::new()),
    };
    fs_daemons.watcher = Some(watcher?);
    Ok((fs_daemons, devices))
}

/// Starts the daemons into `daemons` (index = share index) and waits for them; on
/// error the caller stops what is in `daemons`.
fn start_all(
    binary: &Path,
    shares: &[Share],
    socket_dir: &Path,
    log_dir: &Path,
    SandboxChoice { sandbox, hint }: SandboxChoice,
    policy: CachePolicy,
    daemons: &mut Vec<Daemon>,
) -> Result<(), VirtiofsdError> {
    let socket_of = |index: usize| socket_dir.join(format!("fs{index}.sock"));
    let log_of = |index: usize| log_path(log_dir, index);
    for index in 0..shares.len() {
        let socket = socket_of(index);
        let len = socket.as_os_str().len();
        if len > MAX_SOCKET_PATH {
            return Err(VirtiofsdError::SocketPathTooLong { path: socket, len });
        }
        // virtiofsd takes its paths as UTF-8 text and exits 2 otherwise, which would
        // pass for its sandbox failing. Without the sandbox it is given "." instead.
        if socket.to_str().is_none() {
            return Err(VirtiofsdError::SocketPathNotUtf8(socket));
        }
    }
    if sandbox == Sandbox::Namespace {
        if let Some(share) = shares.iter().find(|share| share.host.to_str().is_none()) {
            return Err(VirtiofsdError::ShareNotUtf8(share.host.clone()));
        }
    }
    for (index, share) in shares.iter().enumerate() {
        check_unmoved(share)?;
        daemons.push(spawn_daemon(
            binary,
            share,
            &socket_of(index),
            &log_of(index),
            sandbox,
            policy,
        )?);
    }
    let outcomes = wait_started(&mut daemons.iter_mut().collect::<Vec<_>>());
    for (daemon, outcome) in daemons.iter().zip(outcomes) {
        match outcome {
            StartOutcome::Ready => {}
            StartOutcome::Exited(status) => return Err(exited(daemon, status, &hint)),
            StartOutcome::TimedOut => {
                return Err(VirtiofsdError::Timeout {
                    host: daemon.host.clone(),
                    socket: daemon.socket.clone(),
                    log: daemon.log.clone(),
                    tail: daemon.log_tail(),
                });
            }
        }
    }
    for daemon in daemons.iter_mut() {
        confirm_root(daemon, &hint)?;
    }
    // One that failed just after its pivot (dropping capabilities, seccomp) and is
    // gone already; a later death is the watcher's to report.
    for daemon in daemons.iter_mut() {
        if let Ok(Some(status)) = daemon.poll_exit() {
            return Err(exited(daemon, status, &hint));
        }
    }
    Ok(())
}

fn exited(daemon: &Daemon, status: std::process::ExitStatus, hint: &str) -> VirtiofsdError {
    VirtiofsdError::Exited {
        host: daemon.host.clone(),
        status: status.to_string(),
        log: daemon.log.clone(),
        tail: daemon.log_tail(),
        hint: hint.to_string(),
    }
}

/// Makes sure `daemon` serves its share: the root its namespace sandbox pivoted into
/// is the directory found on the share's path before it started ([`share_root`]).
/// Without the sandbox there is no root to compare: the daemon serves the directory it
/// was started in, entered by a descriptor ([`daemon::spawn_daemon`]). `hint` goes with
/// an exit, as with one while starting.
fn confirm_root(daemon: &mut Daemon, hint: &str) -> Result<(), VirtiofsdError> {
    if daemon.sandbox != Sandbox::Namespace {
        return Ok(());
    }
    // It creates its socket just before it pivots; this rarely waits.
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        match share_root::root_of(daemon.child.id(), daemon.expected_root) {
            Ok(Root::Expected) => return Ok(()),
            Ok(Root::Ours) if Instant::now() < deadline => std::thread::sleep(START_POLL),
            Ok(Root::Ours) => {
                return Err(VirtiofsdError::NoSandbox {
                    host: daemon.host.clone(),
                    log: daemon.log.clone(),
                    tail: daemon.log_tail(),
                })
            }
            Ok(Root::Other) => {
                return Err(VirtiofsdError::ShareSwapped {
                    host: daemon.host.clone(),
                })
            }
            Err(e) => {
                if let Ok(Some(status)) = daemon.poll_exit() {
                    return Err(exited(daemon, status, hint));
                }
                // Not ours to see (an unusual /proc): the check is lost, not the share.
                tracing::warn!(host = %daemon.host.display(), "cannot see virtiofsd's root: {e}");
                vmm::to_stderr!(
                    "vmctl: warning: cannot confirm which directory virtiofsd serves for {} \
                     (its /proc/PID/root: {e})",
                    daemon.host.display()
                );
                return Ok(());
            }
        }
    }
}

fn record_failure(file: &Path, failure: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    // Never through a link: a nested host writes in the same directory.
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(file)
        .and_then(|mut f| writeln!(f, "{failure}"));
    if let Err(e) = appended {
        tracing::warn!("cannot record the failure in {}: {e}", file.display());
    }
}

/// What is said of a daemon that died while the VM ran.
fn failure(daemon: &Daemon, status: &str) -> String {
    format!(
        "virtiofsd for {} exited unexpectedly ({status}); the VM can no longer use that \
         share (its files on the host are untouched); stop the VM with 'vmctl stop', then \
         start it again to get the share back",
        daemon.host.display()
    )
}

/// How a daemon the VMM gave up on ended, once vmctl killed it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ending {
    /// It ended, with what it forked; its status.
    Ended(ExitStatus),
    /// It ended, reaped by someone else (its status unknown).
    EndedUnseen(String),
    /// It, or what it forked, still ran [`KILL_WAIT`] after SIGKILL: stuck in the
    /// kernel, it still holds the share's session. Its process group.
    Stuck(libc::pid_t),
}

/// What is said of a daemon the VMM gave up on, and vmctl killed: as it ended, or
/// that it did not.
fn given_up_failure(daemon: &Daemon, reason: &str, ending: &Ending) -> String {
    use std::os::unix::process::ExitStatusExt;
    let host = daemon.host.display();
    let how = match ending {
        Ending::Ended(status) if status.signal() == Some(libc::SIGKILL) => {
            "vmctl ended it".to_string()
        }
        // It ended on its own as vmctl came to kill it.
        Ending::Ended(status) => format!("it ended ({status})"),
        Ending::EndedUnseen(why) => format!("it ended (status unknown: {why})"),
        Ending::Stuck(group) => {
            return format!(
                "the VMM gave up on virtiofsd for {host}: {reason}; vmctl sent it SIGKILL, \
                 but it (or a process it forked) has not ended {} s later: it is stuck in \
                 the kernel, most likely on the file system it serves (a hard NFS mount, a \
                 FUSE server that stopped). The guest's requests to that share wait until \
                 it ends, and only then fail with EIO (its files on the host are untouched); \
                 'ps -o pid,stat,wchan:32,cmd -g {group}' shows it (stat D: waiting in the \
                 kernel). Stop the VM with 'vmctl stop', then start it again once that \
                 process has ended to get the share back",
                KILL_WAIT.as_secs()
            );
        }
    };
    format!(
        "the VMM gave up on virtiofsd for {host}: {reason}; {how}, and the VM can no \
         longer use that share (its files on the host are untouched; the guest's requests \
         to it fail with EIO); stop the VM with 'vmctl stop', then start it again to get \
         the share back"
    )
}

/// What is said of a daemon given up on that outlived SIGKILL ([`Ending::Stuck`]),
/// once it has ended with what it forked: while the VM runs, or (`as_vm_stopped`)
/// found as it stopped.
fn late_end_failure(daemon: &Daemon, as_vm_stopped: bool) -> String {
    let host = daemon.host.display();
    let status = daemon
        .status
        .map_or_else(|| "status unknown".to_string(), |status| status.to_string());
    if as_vm_stopped {
        return format!(
            "virtiofsd for {host}, which the VMM gave up on and which outlived vmctl's \
             SIGKILL, has ended as the VM stopped ({status})"
        );
    }
    format!(
        "virtiofsd for {host}, which the VMM gave up on and which outlived vmctl's SIGKILL, \
         has now ended ({status}): the guest's requests to that share no longer wait, they \
         fail with EIO (its files on the host are untouched); stop the VM with 'vmctl \
         stop', then start it again to get the share back"
    )
}

/// What is said of a daemon that [`terminate`] killed (or that was killed when the
/// VMM gave up on it) and that is still there.
fn still_there_message(daemon: &Daemon) -> String {
    let group = group_of(daemon);
    let host = daemon.host.display();
    let what = if daemon.given_up != GivenUp::No {
        // Its SIGKILL came when the VMM gave up on it, and it was said then not to
        // have ended.
        format!(
            "virtiofsd (pid {group}) for {host}, which the VMM gave up on and which \
             outlived vmctl's SIGKILL then, is still there as the VM stops: it (or a \
             process it forked) is stuck in the kernel"
        )
    } else if daemon.status.is_some() {
        format!(
            "virtiofsd (pid {group}) for {host} has ended, but a process it forked has \
             not, {} s after SIGKILL: it is stuck in the kernel",
            STOP_KILL_WAIT.as_secs()
        )
    } else {
        format!(
            "virtiofsd (pid {group}) for {host} has not ended {} s after SIGKILL: it (or \
             a process it forked) is stuck in the kernel",
            STOP_KILL_WAIT.as_secs()
        )
    };
    format!(
        "{what}, most likely on the file system it serves (a hard NFS mount, a FUSE \
         server that stopped), and vmctl goes on without it; 'ps -o \
         pid,stat,wchan:32,cmd -g {group}' shows it (stat D: waiting in the kernel). It \
         ends once that file system answers"
    )
}

fn say_still_there(daemon: &Daemon) {
    let message = still_there_message(daemon);
    tracing::warn!("{message}");
    vmm::to_stderr!("vmctl: warning: {message}");
}

/// The daemon's pid, which is also its process group's id ([`spawn_daemon`] makes it
/// a group of its own).
fn group_of(daemon: &Daemon) -> libc::pid_t {
    // A pid fits a pid_t: the kernel's pid_max is far below i32::MAX.
    daemon.child.id() as libc::pid_t
}

/// Whether `daemon`, killed, has ended with what it forked: reaped (here, or by
/// someone else) and no process of its group left, which could hold the share's
/// session.
fn has_ended(daemon: &mut Daemon, group_alive: fn(libc::pid_t) -> bool) -> bool {
    let reaped = !matches!(daemon.poll_exit(), Ok(None));
    reaped && !group_alive(group_of(daemon))
}

/// Whether a process of the process group `group` still runs. A zombie does not count:
/// it closed its files (the share's session among them) as it died. Read from /proc;
/// where that cannot be read, any member counts.
fn process_group_alive(group: libc::pid_t) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        // SAFETY: signal 0 sends nothing; it only asks whether the group has a member.
        return unsafe { libc::kill(-group, 0) } == 0;
    };
    entries.flatten().any(|entry| {
        let is_process = entry
            .file_name()
            .to_str()
            .is_some_and(|name| name.bytes().all(|b| b.is_ascii_digit()));
        is_process
            && std::fs::read_to_string(entry.path().join("stat"))
                .is_ok_and(|stat| is_live_member(&stat, group))
    })
}

/// Whether the process whose `/proc/PID/stat` is `stat` is in process group `group`
/// and not yet dead (a zombie, or being reaped).
fn is_live_member(stat: &str, group: libc::pid_t) -> bool {
    // The command name, in parentheses, may hold anything; after it: state, ppid, pgrp.
    let Some((_, after_name)) = stat.rsplit_once(") ") else {
        return false;
    };
    let mut fields = after_name.split_whitespace();
    let state = fields.next();
    let pgrp = fields
        .nth(1)
        .and_then(|field| field.parse::<libc::pid_t>().ok());
    pgrp == Some(group) && !matches!(state, Some("Z" | "X" | "x") | None)
}

/// Says each of `failures` (stderr, the log, the failure file) and keeps them.
fn report_failures(state: &mut Watched, failures: Vec<String>) {
    for failure in &failures {
        tracing::error!("{failure}");
        vmm::to_stderr!("vmctl: {failure}");
        if let Some(file) = &state.failure_file {
            record_failure(file, failure);
        }
    }
    state.failures.extend(failures);
}

/// The watcher thread: reports daemons that die while the VM runs.
fn watch(shared: &Shared) {
    let mut state = shared.lock();
    // When each daemon that exited cleanly while the VMM ran did so: undecided until
    // the VMM ends (the VM going away) or CLEAN_EXIT_GRACE passes (a lost share).
    let mut clean_exits: Vec<Option<Instant>> = vec![None; state.daemons.len()];
    while !state.stopping {
        let mut new_failures = Vec::new();
        let vmm_running = state.vmm_running;
        let group_alive = state.group_alive;
        for (daemon, clean_exit) in state.daemons.iter_mut().zip(&mut clean_exits) {
            match daemon.given_up {
                GivenUp::No => {}
                // Reported when it was given up on, or about to be.
                GivenUp::Killing | GivenUp::Reported => {
                    *clean_exit = None;
                    continue;
                }
                // Said to be still there: its end is news to the user.
                GivenUp::Stuck => {
                    *clean_exit = None;
                    if has_ended(daemon, group_alive) {
                        daemon.given_up = GivenUp::Reported;
                        new_failures.push(late_end_failure(daemon, false));
                    }
                    continue;
                }
            }
            if let Some(since) = *clean_exit {
                if !vmm_running() {
                    *clean_exit = None;
                    tracing::info!(host = %daemon.host.display(), "virtiofsd exited: its VMM disconnected");
                } else if since.elapsed() >= CLEAN_EXIT_GRACE {
                    *clean_exit = None;
                    // The VMM gave up on it (no answer in time), or it refused a
                    // request (virtiofsd exits 0 then too).
                    let status = format!(
                        "exit status: 0, its session with the running VM over; its log {}",
                        daemon.log.display()
                    );
                    new_failures.push(failure(daemon, &status));
                }
                continue;
            }
            if daemon.status.is_some() {
                continue;
            }
            let status = match daemon.poll_exit() {
                Ok(None) => continue,
                Ok(Some(status)) if status.success() => {
                    // virtiofsd exits cleanly when its VMM disconnects: as the VM goes
                    // away, which is not a failure, or as the VMM gives up on it.
                    *clean_exit = Some(Instant::now());
                    continue;
                }
                Ok(Some(status)) => status.to_string(),
                Err(e) => {
                    // Someone else reaped it; do not look at that pid again.
                    daemon.status = Some(ExitStatus::default());
                    format!("status unknown: {e}")
                }
            };
            new_failures.push(failure(daemon, &status));
        }
        report_failures(&mut state, new_failures);
        state = shared
            .wake
            .wait_timeout(state, WATCH_POLL)
            .map(|(guard, _)| guard)
            .unwrap_or_else(|e| e.into_inner().0);
    }
}

impl FsDaemons {
    /// The daemons that died while the VM ran, one message each (without a `vmctl:`
    /// prefix; each was printed to stderr when it happened).
    #[cfg(test)]
    pub fn failures(&self) -> Vec<String> {
        self.shared.lock().failures.clone()
    }

    /// Ends the daemon of the share tagged `tag`, which the VMM gave up on for
    /// `reason` (it left a request unanswered, or refused one): such a daemon may
    /// still run with the guest's memory mapped, and the VMM answers the share's
    /// requests itself only once it is gone. The share is reported lost, as when its
    /// daemon dies, saying whether it ended: a thread of its own waits up to
    /// [`KILL_WAIT`] for that, so that the caller (the thread that reads the VMM's
    /// events) goes on at once; stopping waits for that thread. One still there then
    /// is reported again once it has ended. A daemon that had ended already is left to
    /// the watcher, which says how.
    pub fn give_up(&self, tag: &str, reason: &str) {
        let Some((index, group)) = kill_given_up(&self.shared, tag, reason) else {
            return;
        };
        let shared = Arc::clone(&self.shared);
        let owned_reason = reason.to_string();
        let waiter = std::thread::Builder::new()
            .name("virtiofsd-give-up".into())
            .spawn(move || report_given_up(&shared, index, group, &owned_reason));
        match waiter {
            Ok(waiter) => self
                .give_ups
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(waiter),
            Err(e) => {
                // The report matters more than the wait it costs here.
                tracing::warn!("cannot start a thread to wait for virtiofsd's end: {e}");
                report_given_up(&self.shared, index, group, reason);
            }
        }
    }

    /// Appends each later failure to `file` as a line (besides printing it).
    pub fn record_failures_in(&self, file: PathBuf) {
        self.shared.lock().failure_file = Some(file);
    }

    /// Stops the daemons (as dropping does).
    pub fn stop(self) {}

    fn shutdown(&mut self) {
        // First the reports of the daemons given up on, each within KILL_WAIT of its
        // start: they are said before the VM's end is, with their daemons still here.
        let give_ups =
            std::mem::take(&mut *self.give_ups.lock().unwrap_or_else(|e| e.into_inner()));
        for waiter in give_ups {
            if waiter.join().is_err() {
                tracing::error!("a thread waiting for a virtiofsd given up on panicked");
            }
        }
        self.shared.lock().stopping = true;
        self.shared.wake.notify_all();
        if let Some(watcher) = self.watcher.take() {
            if watcher.join().is_err() {
                tracing::error!("the virtiofsd watcher panicked");
            }
        }
        let (mut daemons, group_alive) = {
            let mut state = self.shared.lock();
            (std::mem::take(&mut state.daemons), state.group_alive)
        };
        let still_there = terminate(&mut daemons, group_alive);
        // One given up on and said to be still there that has ended since, unseen by
        // the watcher, is said to have ended, as the watcher would have.
        let late_ends = daemons
            .iter()
            .enumerate()
            .filter(|(index, daemon)| {
                daemon.given_up == GivenUp::Stuck && !still_there.contains(index)
            })
            .map(|(_, daemon)| late_end_failure(daemon, true))
            .collect();
        report_failures(&mut self.shared.lock(), late_ends);
        for index in still_there {
            say_still_there(&daemons[index]);
        }
    }
}

/// Marks the daemon of the share tagged `tag` given up on, for `reason`, and kills it
/// with what it forked; its index and process group. None when there is nothing to
/// kill: not one of ours, given up on already, or ended already.
fn kill_given_up(shared: &Shared, tag: &str, reason: &str) -> Option<(usize, libc::pid_t)> {
    let mut state = shared.lock();
    let index = (0..state.daemons.len()).find(|index| shares::tag(*index) == tag);
    let Some((index, daemon)) = index.map(|i| (i, &mut state.daemons[i])) else {
        tracing::warn!("the VMM gave up on the virtio-fs backend {tag:?}, not one of ours");
        return None;
    };
    if daemon.given_up != GivenUp::No {
        return None;
    }
    if !matches!(daemon.poll_exit(), Ok(None)) {
        // Its session broke as it died: the VMM's "giving up" is only that.
        tracing::info!(
            host = %daemon.host.display(),
            "the VMM gave up on virtiofsd, which had ended: {reason}"
        );
        return None;
    }
    daemon.given_up = GivenUp::Killing;
    daemon.kill_group();
    Some((index, group_of(daemon)))
}

/// Waits for the daemon at `index`, killed as given up on for `reason`, to end with
/// its process group `group`, then reports the share lost, saying how it ended.
fn report_given_up(shared: &Shared, index: usize, group: libc::pid_t, reason: &str) {
    // Without the lock, which the watcher and `stop` need meanwhile.
    let ending = wait_for_end(shared, index, group);
    let mut state = shared.lock();
    let Some(daemon) = state.daemons.get_mut(index) else {
        return;
    };
    daemon.given_up = match ending {
        Ending::Stuck(_) => GivenUp::Stuck,
        Ending::Ended(_) | Ending::EndedUnseen(_) => GivenUp::Reported,
    };
    let failure = given_up_failure(daemon, reason, &ending);
    report_failures(&mut state, vec![failure]);
}

/// Waits up to [`KILL_WAIT`] for the daemon at `index`, killed, to be reaped and its
/// process group `group` (what it forked) to be gone.
fn wait_for_end(shared: &Shared, index: usize, group: libc::pid_t) -> Ending {
    let deadline = Instant::now() + KILL_WAIT;
    loop {
        let (exited, group_alive) = {
            let mut state = shared.lock();
            let group_alive = state.group_alive;
            match state.daemons.get_mut(index).map(Daemon::poll_exit) {
                Some(Ok(Some(status))) => (Some(Ending::Ended(status)), group_alive),
                Some(Ok(None)) => (None, group_alive),
                Some(Err(e)) => (Some(Ending::EndedUnseen(e.to_string())), group_alive),
                // Stopped meanwhile: `stop` reaps it.
                None => return Ending::EndedUnseen("stopped with the VM".into()),
            }
        };
        if let Some(ending) = exited.filter(|_| !group_alive(group)) {
            return ending;
        }
        if Instant::now() >= deadline {
            return Ending::Stuck(group);
        }
        std::thread::sleep(START_POLL);
    }
}

impl Drop for FsDaemons {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Stops `daemons`: SIGTERM, up to [`STOP_GRACE`] for each to exit with what it
/// forked, then SIGKILL to the process group of each still running, or whose forked
/// processes outlived it (in its sandbox the server is the daemon's child, which the
/// daemon's death only sends SIGTERM: one stuck in the kernel stays), and up to
/// [`STOP_KILL_WAIT`] for those (and for any given up on that outlived its SIGKILL
/// before) to end with what they forked. It waits no longer: a daemon stuck in the
/// kernel (a hung NFS mount) must not hold up the VM's stop for ever. Removes every
/// socket. Returns the indexes of the daemons still there, for the caller to say so
/// ([`say_still_there`]).
fn terminate(daemons: &mut [Daemon], group_alive: fn(libc::pid_t) -> bool) -> Vec<usize> {
    let running = |daemon: &mut Daemon| matches!(daemon.poll_exit(), Ok(None));
    // One given up on had SIGKILL already: SIGTERM would change nothing.
    let asked = |daemon: &Daemon| daemon.given_up == GivenUp::No;
    for daemon in daemons.iter_mut() {
        if asked(daemon) && running(daemon) {
            // SAFETY: the child is not reaped yet, so the pid is still its own.
            unsafe { libc::kill(group_of(daemon), libc::SIGTERM) };
        }
    }
    // Its group is looked at only once it has ended: reading every process's stat
    // at each poll while daemons still run would be wasted.
    let lingers =
        |daemon: &mut Daemon| asked(daemon) && (running(daemon) || group_alive(group_of(daemon)));
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline && daemons.iter_mut().any(&lingers) {
        std::thread::sleep(START_POLL);
    }
    let mut killed = Vec::new();
    for (index, daemon) in daemons.iter_mut().enumerate() {
        let killed_before = matches!(daemon.given_up, GivenUp::Stuck | GivenUp::Killing);
        if running(daemon) {
            if asked(daemon) {
                tracing::warn!(host = %daemon.host.display(), "virtiofsd ignored SIGTERM; killing it");
            }
            daemon.kill_group();
            killed.push(index);
        } else if killed_before {
            killed.push(index);
        } else if group_alive(group_of(daemon)) {
            tracing::warn!(
                host = %daemon.host.display(),
                "virtiofsd ended, but a process it forked did not; killing it"
            );
            daemon.kill_group_left();
            killed.push(index);
        }
    }
    let deadline = Instant::now() + STOP_KILL_WAIT;
    loop {
        killed.retain(|&index| !has_ended(&mut daemons[index], group_alive));
        if killed.is_empty() || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(KILL_POLL);
    }
    for daemon in daemons.iter() {
        // virtiofsd keeps a pid file beside its socket.
        let mut pid_file = daemon.socket.clone().into_os_string();
        pid_file.push(".pid");
        for path in [daemon.socket.clone(), PathBuf::from(pid_file)] {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!(path = %path.display(), "cannot remove: {e}");
                }
                _ => {}
            }
        }
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A link planted where the failures are recorded (a nested host writes in that
    /// directory) is not written through.
    #[test]
    fn a_failure_is_not_recorded_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("bashrc");
        std::fs::write(&target, "kept\n").unwrap();
        let file = dir.path().join("failures.log");
        std::os::unix::fs::symlink(&target, &file).unwrap();
        record_failure(&file, "virtiofsd for /w exited");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "kept\n");
        std::fs::remove_file(&file).unwrap();
        record_failure(&file, "virtiofsd for /w exited");
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "virtiofsd for /w exited\n"
        );
    }

    /// The virtiofsd vmctl would use; None, said loudly, where there is none (CI
    /// installs it, so there these tests always run).
    fn installed_virtiofsd() -> Option<PathBuf> {
        find_virtiofsd()
            .inspect_err(|e| vmm::to_stderr!("SKIPPED: virtiofsd not installed ({e})"))
            .ok()
    }

    /// A share of `host` (at a guest path no test looks at).
    pub(super) fn share(host: &Path, read_only: bool) -> Share {
        Share {
            host: host.to_path_buf(),
            guest: "/g".into(),
            read_only,
        }
    }

    /// A stand-in for virtiofsd: creates its "socket", then fails when asked for the
    /// namespace sandbox (as where user namespaces are disabled), else waits.
    fn fake_virtiofsd(dir: &Path, namespace_behaviour: &str) -> PathBuf {
        fake_virtiofsd_then(dir, namespace_behaviour, "exec sleep 600")
    }

    /// The same, running `then` once its socket is there (and the sandbox behaved).
    fn fake_virtiofsd_then(dir: &Path, namespace_behaviour: &str, then: &str) -> PathBuf {
        let path = dir.join("fake-virtiofsd");
        let script = format!(
            "#!/bin/sh\n\
             while [ $# -gt 0 ]; do\n\
               case \"$1\" in\n\
                 --socket-path) socket=\"$2\"; shift;;\n\
                 --sandbox) sandbox=\"$2\"; shift;;\n\
               esac\n\
               shift\n\
             done\n\
             : > \"$socket\"\n\
             if [ \"$sandbox\" = namespace ]; then {namespace_behaviour}; fi\n\
             {then}\n"
        );
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// Starts `binary` for `shares` without the sandbox, as an unprivileged user asking
    /// for none would, with the sockets and logs in `state`.
    fn start_unsandboxed(
        binary: &Path,
        shares: &[Share],
        state: &Path,
    ) -> (FsDaemons, Vec<FsConfig>) {
        start_as(
            binary,
            shares,
            state,
            state,
            false,
            Some("none"),
            CachePolicy::default(),
        )
        .unwrap()
    }

    fn wait_for_failure(daemons: &FsDaemons) -> Vec<String> {
        wait_for_failure_within(daemons, Duration::from_secs(5))
    }

    fn wait_for_failure_within(daemons: &FsDaemons, within: Duration) -> Vec<String> {
        let deadline = Instant::now() + within;
        while daemons.failures().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        daemons.failures()
    }

    fn daemon_pids(daemons: &FsDaemons) -> Vec<libc::pid_t> {
        daemons
            .shared
            .lock()
            .daemons
            .iter()
            .map(|d| d.child.id() as libc::pid_t)
            .collect()
    }

    fn is_reaped(pid: libc::pid_t) -> bool {
        // SAFETY: signal 0 only checks whether the pid exists.
        unsafe { libc::kill(pid, 0) != 0 }
    }

    /// Only the kernel's refusal of the namespaces means none; a probe that could not
    /// run (no process to spare, no /bin/true) leaves the sandbox on.
    #[test]
    fn only_a_refusal_of_the_namespaces_drops_the_sandbox() {
        let errno = std::io::Error::from_raw_os_error;
        for refusal in [libc::EPERM, libc::EINVAL, libc::ENOSPC, libc::EUSERS] {
            assert!(refuses_namespaces(&errno(refusal)), "{refusal}");
        }
        for other in [libc::EAGAIN, libc::ENOMEM, libc::ENOENT] {
            assert!(!refuses_namespaces(&errno(other)), "{other}");
        }
        // This test runs where namespaces work (as root, or with user namespaces).
        assert_eq!(probe_namespaces(), Namespaces::Available);
    }

    /// Where a user namespace can be made but nothing inside it (Ubuntu's AppArmor
    /// restriction), the sandbox is kept: virtiofsd may have a profile that lets it
    /// work, and if not, its failure says why and what to do. Only where there are no
    /// user namespaces at all does virtiofsd run without, saying so.
    #[test]
    fn a_user_namespace_restricted_inside_keeps_the_sandbox_and_explains_its_failure() {
        let choose = |is_root, probed| choose_sandbox(is_root, None, || probed).unwrap();
        let restricted = choose(false, Namespaces::RestrictedInside(libc::EPERM));
        assert_eq!(restricted.sandbox, Sandbox::Namespace);
        for needed in [
            "apparmor_restrict_unprivileged_userns",
            "AppArmor profile",
            "VMCTL_VIRTIOFSD_SANDBOX=none",
            &std::io::Error::from_raw_os_error(libc::EPERM).to_string(),
        ] {
            assert!(
                restricted.hint.contains(needed),
                "{needed}: {}",
                restricted.hint
            );
        }
        for probed in [Namespaces::Available, Namespaces::Unknown] {
            assert_eq!(choose(false, probed).sandbox, Sandbox::Namespace);
            assert_eq!(choose(false, probed).hint, SANDBOX_HINT);
        }
        assert_eq!(
            choose(false, Namespaces::NoUserNamespace).sandbox,
            Sandbox::None
        );
        assert_eq!(
            choose(true, Namespaces::NoUserNamespace).sandbox,
            Sandbox::Namespace,
            "root needs no user namespace"
        );
        let asked_none = choose_sandbox(false, Some("none"), || {
            panic!("probed although the sandbox was turned off")
        });
        assert_eq!(asked_none.unwrap().sandbox, Sandbox::None);
        // The daemon's failure in its sandbox carries the explanation.
        let error = VirtiofsdError::Exited {
            host: "/w".into(),
            status: "exit status: 1".into(),
            log: "/l".into(),
            tail: "  Error entering sandbox: Unshare(Os { code: 1 })".into(),
            hint: restricted.hint,
        }
        .to_string();
        assert!(
            error.contains("Unshare") && error.contains("apparmor_restrict"),
            "{error}"
        );
    }

    /// A namespace sandbox that fails is an error that says what to do, never a reason
    /// to start again without: a guest can make a start fail (by moving a directory on
    /// a share's path at the right moment), and must not get the weaker daemon by it.
    #[test]
    fn a_failed_namespace_sandbox_is_reported_not_retried_without() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd(dir.path(), "echo 'fake: cannot unshare' >&2; exit 1");
        for is_root in [false, true] {
            let error = start_as(
                &fake,
                &[share(dir.path(), false)],
                dir.path(),
                dir.path(),
                is_root,
                None,
                CachePolicy::default(),
            )
            .err()
            .expect("the start is refused")
            .to_string();
            assert!(error.contains("fake: cannot unshare"), "{error}");
            assert!(error.contains("VMCTL_VIRTIOFSD_SANDBOX=none"), "{error}");
        }
        let bad = start_as(
            &fake,
            &[share(dir.path(), false)],
            dir.path(),
            dir.path(),
            false,
            Some("off"),
            CachePolicy::default(),
        );
        assert!(
            matches!(bad, Err(VirtiofsdError::BadSandbox { .. })),
            "{:?}",
            bad.err()
        );
    }

    #[test]
    fn without_the_sandbox_as_asked_deaths_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd(dir.path(), "exit 1");
        let shared = [share(dir.path(), false), share(dir.path(), true)];
        let (daemons, devices) = start_unsandboxed(&fake, &shared, dir.path());
        assert_eq!(
            devices,
            [0, 1].map(|i| FsConfig {
                socket_path: dir.path().join(format!("fs{i}.sock")),
                tag: format!("vmctl{i}"),
            })
        );
        assert!(daemons
            .shared
            .lock()
            .daemons
            .iter()
            .all(|d| d.sandbox == Sandbox::None));
        assert!(daemons.failures().is_empty());

        let pids = daemon_pids(&daemons);
        // SAFETY: the daemon is our unreaped child.
        unsafe { libc::kill(pids[1], libc::SIGKILL) };
        let failures = wait_for_failure(&daemons);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains(&dir.path().display().to_string()));
        assert!(failures[0].contains("SIGKILL"), "{}", failures[0]);
        // Stopping alone does not bring the share back.
        assert!(
            failures[0].contains("'vmctl stop', then start it again"),
            "{}",
            failures[0]
        );
        daemons.stop();
        assert!(pids.into_iter().all(is_reaped));
        assert!(!dir.path().join("fs0.sock").exists());
    }

    /// A daemon the VMM gave up on is killed, with what it forked (its sandbox's
    /// server), and reported once, with the VMM's reason, however it then exits.
    #[test]
    fn a_daemon_the_vmm_gave_up_on_is_killed_and_reported() {
        let dir = tempfile::tempdir().unwrap();
        let forked = dir.path().join("forked.pid");
        let fake = fake_virtiofsd_then(
            dir.path(),
            ":",
            &format!("sleep 600 & echo $! > '{}'; wait", forked.display()),
        );
        let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !forked.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let forked: libc::pid_t = std::fs::read_to_string(&forked)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let group = daemon_pids(&daemons)[0];
        daemons.give_up("vmctl7", "not ours");
        assert!(daemons.failures().is_empty());
        let reason = "the backend did not answer GET_VRING_BASE within 30 s";
        daemons.give_up("vmctl0", reason);
        daemons.give_up("vmctl0", reason);
        let failures = wait_for_failure(&daemons);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(
            failures[0].contains(reason)
                && failures[0].contains(&dir.path().display().to_string())
                && failures[0].contains("vmctl ended it")
                && failures[0].contains("fail with EIO")
                && failures[0].contains("then start it again"),
            "{}",
            failures[0]
        );
        // Reported only once it had ended, with what it forked (dead, if perhaps not
        // yet reaped by init, which inherited it).
        let forked_runs = std::fs::read_to_string(format!("/proc/{forked}/stat"))
            .is_ok_and(|stat| is_live_member(&stat, group));
        assert!(!forked_runs, "what the daemon forked still runs");
        // Its death by SIGKILL is not reported a second time.
        std::thread::sleep(3 * WATCH_POLL);
        assert_eq!(daemons.failures().len(), 1, "{:?}", daemons.failures());
        daemons.stop();
    }

    /// A daemon that SIGKILL does not end (stuck in the kernel, here a stand-in that
    /// says its group still runs) is reported as such: the share's requests wait, they
    /// do not fail with EIO. The wait for its end is not the caller's (the thread that
    /// reads the VMM's events, whose later events would wait), and stopping waits for
    /// the report, which comes before the VM's end is said.
    #[test]
    fn a_daemon_given_up_on_that_does_not_end_is_reported_as_still_there() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd(dir.path(), ":");
        let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        daemons.shared.lock().group_alive = |_| true;
        let recorded = dir.path().join("failures.log");
        daemons.record_failures_in(recorded.clone());
        let group = daemon_pids(&daemons)[0];
        let started = Instant::now();
        daemons.give_up(
            "vmctl0",
            "the backend did not answer GET_VRING_BASE within 30 s",
        );
        assert!(
            started.elapsed() < KILL_WAIT / 3,
            "giving up waited for the daemon's end: {:?}",
            started.elapsed()
        );
        assert!(daemons.failures().is_empty(), "{:?}", daemons.failures());
        daemons.stop();
        assert!(
            started.elapsed() >= KILL_WAIT,
            "it did not wait for the end"
        );
        let failures = std::fs::read_to_string(&recorded).unwrap();
        let failures: Vec<&str> = failures.lines().collect();
        assert_eq!(failures.len(), 1, "{failures:?}");
        for needed in [
            "has not ended",
            "requests to that share wait until it ends",
            &format!("-g {group}"),
        ] {
            assert!(failures[0].contains(needed), "{needed}: {}", failures[0]);
        }
        assert!(!failures[0].contains("vmctl ended it"), "{}", failures[0]);
    }

    /// A daemon given up on that outlived its SIGKILL is reported once more when it
    /// ends at last, while the VM runs: the share's requests no longer wait.
    #[test]
    fn a_daemon_given_up_on_that_ends_later_is_reported_when_it_ends() {
        static STUCK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
        use std::sync::atomic::Ordering::SeqCst;
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd(dir.path(), ":");
        let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        daemons.shared.lock().group_alive = |_| STUCK.load(SeqCst);
        let recorded = dir.path().join("failures.log");
        daemons.record_failures_in(recorded.clone());
        daemons.give_up("vmctl0", "the backend refused SET_VRING_BASE");
        let failures = wait_for_failure_within(&daemons, 2 * KILL_WAIT);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains("has not ended"), "{}", failures[0]);
        // What it forked (here, by the stand-in's word) ends at last.
        STUCK.store(false, SeqCst);
        let deadline = Instant::now() + Duration::from_secs(5);
        while daemons.failures().len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let failures = daemons.failures();
        assert_eq!(failures.len(), 2, "{failures:?}");
        for needed in [
            &dir.path().display().to_string(),
            "has now ended (signal: 9",
            "fail with EIO",
            "then start it again",
        ] {
            assert!(failures[1].contains(needed), "{needed}: {}", failures[1]);
        }
        std::thread::sleep(3 * WATCH_POLL);
        daemons.stop();
        let recorded = std::fs::read_to_string(&recorded).unwrap();
        assert_eq!(recorded.lines().count(), 2, "said again: {recorded}");
    }

    /// A daemon given up on that outlived its SIGKILL and has ended by the time the VM
    /// stops, unseen by the watcher, is said to have ended then.
    #[test]
    fn a_daemon_given_up_on_that_ended_unseen_is_reported_as_the_vm_stops() {
        static STUCK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
        use std::sync::atomic::Ordering::SeqCst;
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd(dir.path(), ":");
        let (mut daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        daemons.shared.lock().group_alive = |_| STUCK.load(SeqCst);
        let recorded = dir.path().join("failures.log");
        daemons.record_failures_in(recorded.clone());
        daemons.give_up("vmctl0", "the backend refused SET_VRING_BASE");
        assert_eq!(wait_for_failure_within(&daemons, 2 * KILL_WAIT).len(), 1);
        // The watcher sees no more.
        daemons.shared.lock().stopping = true;
        daemons.shared.wake.notify_all();
        daemons.watcher.take().unwrap().join().unwrap();
        STUCK.store(false, SeqCst);
        daemons.stop();
        let recorded = std::fs::read_to_string(&recorded).unwrap();
        let lines: Vec<&str> = recorded.lines().collect();
        assert_eq!(lines.len(), 2, "{recorded}");
        assert!(
            lines[1].contains("outlived vmctl's SIGKILL, has ended as the VM stopped"),
            "{}",
            lines[1]
        );
    }

    /// Stopping waits for a daemon a bounded time: one that ignores SIGTERM gets
    /// SIGKILL, and one that outlives that too (stuck in the kernel: here a stand-in
    /// that says its group still runs) is said to be still there, and left.
    #[test]
    fn stopping_a_daemon_that_does_not_end_is_bounded_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd_then(dir.path(), ":", "trap '' TERM; exec sleep 600");
        for stuck in [false, true] {
            let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
            let pid = daemon_pids(&daemons)[0];
            let mut taken = std::mem::take(&mut daemons.shared.lock().daemons);
            // What is said of one still there whose own process SIGKILL did not end
            // (not reaped yet, as here before it gets SIGKILL).
            let said = still_there_message(&taken[0]);
            for needed in [
                &format!("virtiofsd (pid {pid}) for {}", dir.path().display()),
                "has not ended 3 s after SIGKILL: it (or a process it forked)",
                &format!("-g {pid}"),
            ] {
                assert!(said.contains(needed), "{needed}: {said}");
            }
            let group_alive = if stuck { |_| true } else { process_group_alive };
            let started = Instant::now();
            let still_there = terminate(&mut taken, group_alive);
            let took = started.elapsed();
            assert!(
                took < STOP_GRACE + STOP_KILL_WAIT + Duration::from_secs(1),
                "took {took:?}"
            );
            assert!(
                took >= STOP_GRACE,
                "SIGTERM was not given its time: {took:?}"
            );
            assert!(is_reaped(pid), "SIGKILL did not end it");
            assert!(!dir.path().join("fs0.sock").exists());
            if stuck {
                assert_eq!(still_there, [0]);
                // It was reaped: what the stand-in says still runs is what it forked.
                let said = still_there_message(&taken[0]);
                assert!(said.contains("a process it forked has not"), "{said}");
            } else {
                assert!(still_there.is_empty(), "{still_there:?}");
            }
            daemons.stop();
        }
    }

    /// Waits for the stand-in's forked process to write its pid to `file`; that pid.
    fn forked_pid(file: &Path) -> libc::pid_t {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !file.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        std::fs::read_to_string(file)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// Kills a test's stray process should the test fail before it is dead.
    struct KillOnDrop {
        pid: libc::pid_t,
        group: libc::pid_t,
    }

    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid));
            if stat.is_ok_and(|stat| is_live_member(&stat, self.group)) {
                // SAFETY: kill only sends a signal, to the test's own process, still
                // in the group it was started in.
                unsafe { libc::kill(self.pid, libc::SIGKILL) };
            }
        }
    }

    /// A daemon that ends on SIGTERM but leaves a process it forked running (its
    /// sandbox's server, which its death sends only SIGTERM, stuck in the kernel on a
    /// hung NFS mount; here one that does not heed the daemon's death) has that
    /// process killed once SIGTERM's time is up, and, if that does not end it either
    /// (a stand-in says its group still runs), is said to be still there, as the
    /// process it forked.
    #[test]
    fn stopping_kills_what_a_daemon_forked_that_outlived_it() {
        let dir = tempfile::tempdir().unwrap();
        let forked_file = dir.path().join("forked.pid");
        let fake = fake_virtiofsd_then(
            dir.path(),
            ":",
            &format!("sleep 600 & echo $! > '{}'; wait", forked_file.display()),
        );
        for stuck in [false, true] {
            let _ = std::fs::remove_file(&forked_file);
            let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
            let group = daemon_pids(&daemons)[0];
            let forked = forked_pid(&forked_file);
            let _cleanup = KillOnDrop { pid: forked, group };
            let mut taken = std::mem::take(&mut daemons.shared.lock().daemons);
            let group_alive = if stuck { |_| true } else { process_group_alive };
            let started = Instant::now();
            let still_there = terminate(&mut taken, group_alive);
            let took = started.elapsed();
            assert!(
                took >= STOP_GRACE,
                "what it forked was not given SIGTERM's time: {took:?}"
            );
            assert!(
                took < STOP_GRACE + STOP_KILL_WAIT + Duration::from_secs(1),
                "took {took:?}"
            );
            assert!(
                taken[0].status.is_some(),
                "the daemon did not end on SIGTERM"
            );
            // Dead, if perhaps not yet reaped by init, which inherited it.
            let forked_runs = std::fs::read_to_string(format!("/proc/{forked}/stat"))
                .is_ok_and(|stat| is_live_member(&stat, group));
            assert!(!forked_runs, "what the daemon forked still runs");
            if stuck {
                assert_eq!(still_there, [0]);
                let said = still_there_message(&taken[0]);
                for needed in [
                    &format!("virtiofsd (pid {group}) for {}", dir.path().display()),
                    "has ended, but a process it forked has not, 3 s after SIGKILL",
                    &format!("-g {group}"),
                ] {
                    assert!(said.contains(needed), "{needed}: {said}");
                }
            } else {
                assert!(still_there.is_empty(), "{still_there:?}");
            }
            daemons.stop();
        }
    }

    /// A daemon given up on that outlived its SIGKILL then and is still there as the
    /// VM stops is said to be so as such: not as one that got its SIGKILL 3 s ago.
    #[test]
    fn a_daemon_given_up_on_still_there_as_the_vm_stops_is_said_to_be_so() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd(dir.path(), ":");
        let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        daemons.shared.lock().group_alive = |_| true;
        let group = daemon_pids(&daemons)[0];
        daemons.give_up("vmctl0", "the backend refused SET_VRING_BASE");
        let failures = wait_for_failure_within(&daemons, 2 * KILL_WAIT);
        assert!(failures[0].contains("has not ended"), "{failures:?}");
        let mut taken = std::mem::take(&mut daemons.shared.lock().daemons);
        let started = Instant::now();
        let still_there = terminate(&mut taken, |_| true);
        assert!(
            started.elapsed() < STOP_KILL_WAIT + Duration::from_secs(1),
            "SIGTERM's time was waited for one that had SIGKILL: {:?}",
            started.elapsed()
        );
        assert_eq!(still_there, [0]);
        let said = still_there_message(&taken[0]);
        for needed in [
            &format!("virtiofsd (pid {group}) for {}", dir.path().display()),
            "which the VMM gave up on and which outlived vmctl's SIGKILL then, is still \
             there as the VM stops",
            &format!("-g {group}"),
        ] {
            assert!(said.contains(needed), "{needed}: {said}");
        }
        assert!(!said.contains("s after SIGKILL"), "{said}");
        daemons.stop();
    }

    /// A daemon that died on its own before the VMM's word of it came (its session
    /// broke as it died) is not said to have been given up on and ended by vmctl: the
    /// watcher reports how it ended.
    #[test]
    fn a_daemon_that_ended_before_the_vmm_gave_up_on_it_is_reported_as_it_ended() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd_then(dir.path(), ":", "sleep 0.3; exit 0");
        let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        daemons.shared.lock().vmm_running = || true;
        let deadline = Instant::now() + Duration::from_secs(5);
        while daemons.shared.lock().daemons[0].status.is_none() {
            assert!(Instant::now() < deadline, "the stand-in did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
        daemons.give_up("vmctl0", "the backend refused SET_FEATURES: broken pipe");
        let failures = wait_for_failure_within(&daemons, 2 * CLEAN_EXIT_GRACE);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(
            failures[0].contains("exit status: 0") && !failures[0].contains("gave up"),
            "{}",
            failures[0]
        );
        daemons.stop();
    }

    #[test]
    fn a_process_group_member_counts_until_it_is_dead() {
        let stat = |state: &str| format!("42 (a) b) {state} 1 77 77 0 -1 4194560");
        assert!(is_live_member(&stat("S"), 77));
        assert!(is_live_member(&stat("D"), 77));
        assert!(!is_live_member(&stat("Z"), 77));
        assert!(!is_live_member(&stat("S"), 78));
        assert!(!is_live_member("garbage", 77));
        // SAFETY: getpgrp cannot fail.
        let ours = unsafe { libc::getpgrp() };
        assert!(process_group_alive(ours), "this test's own group");
    }

    /// A daemon that exits cleanly (virtiofsd does when its VMM hangs up, or when it
    /// refused a request) while the VMM runs lost the share: reported, once the VMM
    /// has had its time to end. One that does as the VMM ends is not.
    #[test]
    fn a_clean_exit_while_the_vmm_runs_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd_then(dir.path(), ":", "sleep 1; exit 0");
        for vmm_running in [false, true] {
            let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
            daemons.shared.lock().vmm_running = if vmm_running { || true } else { || false };
            let within = Duration::from_secs(1) + 2 * CLEAN_EXIT_GRACE;
            let failures = wait_for_failure_within(&daemons, within);
            if vmm_running {
                assert_eq!(failures.len(), 1, "{failures:?}");
                assert!(failures[0].contains("exit status: 0"), "{}", failures[0]);
                assert!(
                    failures[0].contains("then start it again"),
                    "{}",
                    failures[0]
                );
            } else {
                assert!(failures.is_empty(), "{failures:?}");
            }
        }
    }

    /// virtiofsd takes its shared directory as UTF-8 text only (else it exits 2, which
    /// looks like its sandbox failing): such a share is refused up front, saying so,
    /// with no word of the sandbox. Without the sandbox virtiofsd is given "." and
    /// serves it.
    #[test]
    fn a_share_whose_path_is_not_utf8_is_refused_up_front() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let fake = fake_virtiofsd(&root, "echo 'invalid UTF-8' >&2; exit 2");
        let host = root.join(std::ffi::OsStr::from_bytes(b"caf\xe9"));
        std::fs::create_dir(&host).unwrap();
        let error = refused_start(&fake, &host, &root);
        assert!(
            error.starts_with(&format!("the share {} is not valid UTF-8", host.display())),
            "{error}"
        );
        assert!(!error.contains(SANDBOX_ENV), "{error}");
        let (daemons, _) = start_unsandboxed(&fake, &[share(&host, false)], &root);
        daemons.stop();
        let socket_dir = root.join(std::ffi::OsStr::from_bytes(b"st\xe9"));
        std::fs::create_dir(&socket_dir).unwrap();
        let error = refused_start(&fake, &root, &socket_dir);
        assert!(error.contains("is not valid UTF-8"), "{error}");
        assert!(!error.contains(SANDBOX_ENV), "{error}");
    }

    /// In `root`: `workspace/sub/project`, `elsewhere/project`, and a wrapper of
    /// `binary` that notes its arguments in `args`, then, as a guest that can write
    /// `workspace` would, swaps `workspace/sub` for a link to `elsewhere` and runs
    /// `binary`. Returns the wrapper and the share's path (`workspace/sub/project`).
    fn swapping_wrapper(root: &Path, binary: &Path) -> (PathBuf, PathBuf) {
        let workspace = root.join("workspace");
        std::fs::create_dir_all(workspace.join("sub/project")).unwrap();
        std::fs::create_dir_all(root.join("elsewhere/project")).unwrap();
        let wrapper = root.join("racer.sh");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\necho \"$@\" > '{r}/args'\n\
                 mv '{w}/sub' '{w}/sub.orig' && ln -s '{s}' '{w}/sub' && exec '{b}' \"$@\"\n",
                r = root.display(),
                w = workspace.display(),
                s = root.join("elsewhere").display(),
                b = binary.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
        (wrapper, workspace.join("sub/project"))
    }

    /// Without its sandbox, virtiofsd serves the directory it starts in ("."), which
    /// vmctl enters by a descriptor: a directory on the share's path swapped for a link
    /// as it starts (as by another VM's guest) changes nothing, at its start or at any
    /// later mount, when virtiofsd opens its root again by that name.
    #[test]
    fn without_the_sandbox_a_swapped_path_does_not_change_the_served_directory() {
        let Some(binary) = installed_virtiofsd() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (racer, project) = swapping_wrapper(&root, &binary);
        let original = share_root::dir_id_without_links(&project).unwrap();
        let state = root.join("state");
        std::fs::create_dir(&state).unwrap();
        let (daemons, _) = start_unsandboxed(&racer, &[share(&project, false)], &state);
        let args = std::fs::read_to_string(root.join("args")).unwrap();
        assert!(args.starts_with("--shared-dir . "), "{args}");
        let pid = daemon_pids(&daemons)[0];
        let cwd = share_root::dir_id_without_links(
            &std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            cwd, original,
            "virtiofsd does not stand in the share it was given"
        );
        daemons.stop();
    }

    /// A FUSE client of a real virtiofsd, through the VMM's virtio-fs device, without
    /// a guest: the test writes requests into guest memory (the memfd virtiofsd maps)
    /// on the request queue, kicks it, and reads the replies.
    mod fuse_client {
        use std::os::unix::fs::FileExt;
        use std::path::Path;
        use std::sync::Arc;
        use std::time::{Duration, Instant};

        use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
        use virtio_queue::desc::{split::Descriptor, RawDescriptor};
        use virtio_queue::mock::MockSplitQueue;
        use virtio_queue::Queue;
        use vm_memory::GuestAddress;
        use vmm::devices::virtio::fs::VhostUserFs;
        use vmm::devices::virtio::{InterruptTrigger, VirtioDevice, FEATURE_VERSION_1};
        use vmm::memory::{GuestMemoryMmap, GuestRam};
        use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

        const QUEUE_SIZE: u16 = 16;
        /// The request queue (queue 0 is the high-priority one).
        const REQUESTS: usize = 1;
        const FUSE_GETATTR: u32 = 3;
        const FUSE_INIT: u32 = 26;
        const ROOT_NODE: u64 = 1;
        /// Where request `n`'s header and reply go.
        const REQUEST_AT: u64 = 0x10_0000;
        const REPLY_AT: u64 = 0x18_0000;
        const SLOT: u64 = 0x1000;

        /// The device over `ram`, which the caller keeps: the queues' rings are in it.
        pub struct Client<'a> {
            device: VhostUserFs,
            ram: &'a GuestRam,
            queues: Vec<MockSplitQueue<'a, GuestMemoryMmap>>,
            kicks: Vec<EventFd>,
            sent: u16,
        }

        impl<'a> Client<'a> {
            /// Connects to the virtiofsd on `socket` and starts the device over `ram`,
            /// as a guest's driver would.
            pub fn connect(socket: &Path, ram: &'a GuestRam) -> Self {
                let events: vmm::process::EventSink =
                    Arc::new(|event| panic!("the VMM gave up on virtiofsd: {event:?}"));
                let mut device = VhostUserFs::connect(socket, "test", events).unwrap();
                let kicks: Vec<EventFd> = (0..2)
                    .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
                    .collect();
                device.attach_queue_events(&kicks).unwrap();
                device.set_acked_features(FEATURE_VERSION_1);
                let queues: Vec<_> = (0..2u64)
                    .map(|index| {
                        let rings = GuestAddress(0x1_0000 * (index + 1));
                        MockSplitQueue::create(&ram.memory, rings, QUEUE_SIZE)
                    })
                    .collect();
                let ready = queues
                    .iter()
                    .map(|queue| queue.create_queue::<Queue>().unwrap())
                    .collect();
                let interrupt =
                    InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
                device
                    .activate(ram.memory.clone(), ready, interrupt)
                    .unwrap();
                Self {
                    device,
                    ram,
                    queues,
                    kicks,
                    sent: 0,
                }
            }

            fn write(&self, at: u64, bytes: &[u8]) {
                // Guest RAM starts at the memfd's start.
                self.ram.backing_file.write_all_at(bytes, at).unwrap();
            }

            fn read(&self, at: u64, len: usize) -> Vec<u8> {
                let mut bytes = vec![0; len];
                self.ram.backing_file.read_exact_at(&mut bytes, at).unwrap();
                bytes
            }

            /// Sends FUSE request `opcode` on `node` with `body`; returns the reply
            /// (its header included) once virtiofsd has put it in the used ring.
            fn request(&mut self, opcode: u32, node: u64, body: &[u8]) -> Vec<u8> {
                let n = u64::from(self.sent);
                let (request, reply) = (REQUEST_AT + SLOT * n, REPLY_AT + SLOT * n);
                let mut header = Vec::new();
                header.extend_from_slice(&(40 + body.len() as u32).to_le_bytes());
                header.extend_from_slice(&opcode.to_le_bytes());
                header.extend_from_slice(&(n + 1).to_le_bytes()); // unique
                header.extend_from_slice(&node.to_le_bytes());
                header.extend_from_slice(&[0; 16]); // uid, gid, pid, extlen, padding
                header.extend_from_slice(body);
                self.write(request, &header);
                // Two descriptors: the request, then the reply buffer (device-written).
                let first = 2 * (self.sent % (QUEUE_SIZE / 2));
                let (next, write) = (VRING_DESC_F_NEXT as u16, VRING_DESC_F_WRITE as u16);
                let chain = [
                    Descriptor::new(request, header.len() as u32, next, first + 1),
                    Descriptor::new(reply, 0x400, write, 0),
                ]
                .map(RawDescriptor::from);
                let queue = &self.queues[REQUESTS];
                queue.add_desc_chains(&chain, first).unwrap();
                self.sent += 1;
                self.kicks[REQUESTS].write(1).unwrap();
                let deadline = Instant::now() + Duration::from_secs(10);
                while queue.used().idx().load() != self.sent {
                    assert!(
                        Instant::now() < deadline,
                        "virtiofsd did not answer {opcode}"
                    );
                    std::thread::sleep(Duration::from_millis(5));
                }
                let reply = self.read(reply, 0x400);
                let error = i32::from_le_bytes(reply[4..8].try_into().unwrap());
                assert_eq!(error, 0, "virtiofsd refused request {opcode}");
                reply
            }

            /// FUSE_INIT, as the guest sends it when it mounts the share.
            pub fn mount(&mut self) {
                let mut init = Vec::new();
                for word in [7u32, 31, 0x2_0000, 0] {
                    init.extend_from_slice(&word.to_le_bytes());
                }
                self.request(FUSE_INIT, 0, &init);
            }

            /// The inode number of the served root, as the guest sees it.
            pub fn root_inode(&mut self) -> u64 {
                let reply = self.request(FUSE_GETATTR, ROOT_NODE, &[0; 16]);
                // fuse_out_header (16), attr_valid and its nanoseconds (16), then
                // fuse_attr, which starts with the inode number.
                u64::from_le_bytes(reply[32..40].try_into().unwrap())
            }
        }

        impl Drop for Client<'_> {
            fn drop(&mut self) {
                self.device.reset();
            }
        }
    }

    /// What the "." defence is for, asked of the virtiofsd vmctl would use: without
    /// its sandbox, a directory on the share's path swapped for a link after virtiofsd
    /// started (by another VM's guest) must not change what the guest mounts. A
    /// virtiofsd that took the path by name at its start (older than 1.14) and opened
    /// it again at the mount serves the link's target, and fails this.
    #[test]
    fn without_the_sandbox_a_path_swapped_after_the_start_is_not_what_a_mount_serves() {
        use std::os::unix::fs::MetadataExt;
        let Some(binary) = installed_virtiofsd() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let workspace = root.join("workspace");
        let project = workspace.join("sub/project");
        std::fs::create_dir_all(&project).unwrap();
        std::fs::create_dir_all(root.join("elsewhere/project")).unwrap();
        let inode = |path: &Path| std::fs::metadata(path).unwrap().ino();
        let (original, other) = (inode(&project), inode(&root.join("elsewhere/project")));
        let state = root.join("state");
        std::fs::create_dir(&state).unwrap();
        let (daemons, devices) = start_unsandboxed(&binary, &[share(&project, false)], &state);
        // As a guest that can write `workspace` would, once virtiofsd runs.
        std::fs::rename(workspace.join("sub"), workspace.join("sub.orig")).unwrap();
        std::os::unix::fs::symlink(root.join("elsewhere"), workspace.join("sub")).unwrap();
        assert_eq!(inode(&project), other, "the swap did not take");
        let ram = vmm::memory::create_guest_ram(16 << 20).unwrap();
        let mut client = fuse_client::Client::connect(&devices[0].socket_path, &ram);
        client.mount();
        let served = client.root_inode();
        assert_eq!(
            served, original,
            "virtiofsd serves what the share's path leads to now ({other}), not the \
             directory it started in ({original})"
        );
        drop(client);
        daemons.stop();
    }

    /// Starts `binary` as root for the one share at `path`, with its socket and log in
    /// `dir`; the start must be refused, leaving no socket. Returns the error.
    fn refused_start(binary: &Path, path: &Path, dir: &Path) -> String {
        let error = start_as(
            binary,
            &[share(path, false)],
            dir,
            dir,
            true,
            None,
            CachePolicy::default(),
        )
        .err()
        .expect("the start is refused")
        .to_string();
        assert!(!dir.join("fs0.sock").exists(), "a daemon was left running");
        error
    }

    /// A share whose path now passes through a link is not served: no virtiofsd starts.
    #[test]
    fn a_share_whose_path_became_a_link_is_not_served() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let fake = fake_virtiofsd(&root, "exit 3");
        std::fs::create_dir(root.join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(root.join("elsewhere"), root.join("data")).unwrap();
        let error = refused_start(&fake, &root.join("data"), &root);
        assert!(
            error.starts_with(&format!(
                "the share {} now leads to {}",
                root.join("data").display(),
                root.join("elsewhere").display()
            )),
            "{error}"
        );
    }

    #[test]
    fn a_daemon_that_fails_to_start_is_reported_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd(dir.path(), "echo 'fake: boom' >&2; exit 3");
        let error = refused_start(&fake, dir.path(), dir.path());
        assert!(error.contains("exit status: 3"), "{error}");
        assert!(error.contains("fake: boom"), "{error}");
        assert!(error.contains(&dir.path().display().to_string()), "{error}");
    }

    #[test]
    fn real_virtiofsd_serves_a_share_and_its_death_is_reported() {
        let Some(binary) = installed_virtiofsd() else {
            return;
        };
        let share_dir = tempfile::tempdir().unwrap();
        let state_dir = tempfile::tempdir().unwrap();
        let (daemons, devices) = start(
            &binary,
            &[shares::workspace_share(share_dir.path()).unwrap()],
            state_dir.path(),
            state_dir.path(),
            CachePolicy::default(),
        )
        .unwrap();
        let socket = &devices[0].socket_path;
        assert!(socket.exists());
        assert!(daemons.failures().is_empty());
        let pids = daemon_pids(&daemons);
        // SAFETY: the daemon is our unreaped child.
        unsafe { libc::kill(pids[0], libc::SIGKILL) };
        let failures = wait_for_failure(&daemons);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains("exited unexpectedly"));
        drop(daemons);
        assert!(is_reaped(pids[0]));
        assert!(!socket.exists());
    }

    /// The race a guest that can write a directory on a share's path would run: the
    /// path checked, then that directory swapped for a link as virtiofsd resolves it
    /// (here the swap always wins). The daemon is stopped, the share not served.
    /// (virtiofsd itself refuses a share that is a link; one on the way it follows.)
    #[test]
    fn a_share_swapped_for_a_link_as_virtiofsd_starts_is_not_served() {
        let Some(binary) = installed_virtiofsd() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (racer, project) = swapping_wrapper(&root, &binary);
        let state = root.join("state");
        std::fs::create_dir(&state).unwrap();
        let error = refused_start(&racer, &project, &state);
        assert!(
            error.starts_with(&format!(
                "virtiofsd for the share {} got another directory",
                project.display()
            )),
            "{error}"
        );
    }
}
