//! The virtiofsd daemons that serve a VM's shares: one per share, started before the
//! VMM connects to their vhost-user sockets, watched while the VM runs, and stopped
//! with it. The choice of their sandbox is in [`sandbox`]; watching them, ending one
//! the VMM gave up on, and stopping them (the methods of [`FsDaemons`]) in [`watch`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm::config::FsConfig;

mod binary;
pub mod cache;
mod daemon;
mod sandbox;
mod watch;

pub use self::binary::find_virtiofsd;
use self::binary::{MIN_VERSION, VIRTIOFSD_ENV};
pub use self::cache::{CachePolicy, CACHE_ENV};
use self::daemon::{spawn_daemon, wait_started, Daemon, Sandbox, StartOutcome};
pub use self::sandbox::SANDBOX_ENV;
use self::sandbox::{choose_sandbox, probe_namespaces, SandboxChoice};
use self::watch::{
    process_group_alive, say_still_there, terminate, watch_daemons, Shared, Watched,
};
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
            .spawn(move || watch_daemons(&shared))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

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
    pub(super) fn fake_virtiofsd(dir: &Path, namespace_behaviour: &str) -> PathBuf {
        fake_virtiofsd_then(dir, namespace_behaviour, "exec sleep 600")
    }

    /// The same, running `then` once its socket is there (and the sandbox behaved).
    pub(super) fn fake_virtiofsd_then(
        dir: &Path,
        namespace_behaviour: &str,
        then: &str,
    ) -> PathBuf {
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
    pub(super) fn start_unsandboxed(
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

    pub(super) fn wait_for_failure(daemons: &FsDaemons) -> Vec<String> {
        wait_for_failure_within(daemons, Duration::from_secs(5))
    }

    pub(super) fn wait_for_failure_within(daemons: &FsDaemons, within: Duration) -> Vec<String> {
        let deadline = Instant::now() + within;
        while daemons.failures().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        daemons.failures()
    }

    pub(super) fn daemon_pids(daemons: &FsDaemons) -> Vec<libc::pid_t> {
        daemons
            .shared
            .lock()
            .daemons
            .iter()
            .map(|d| d.child.id() as libc::pid_t)
            .collect()
    }

    pub(super) fn is_reaped(pid: libc::pid_t) -> bool {
        // SAFETY: signal 0 only checks whether the pid exists.
        unsafe { libc::kill(pid, 0) != 0 }
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
