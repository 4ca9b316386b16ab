//! Stopping and removing VMs: `vmctl stop`, `rm`, `prune`, and the throwaway VM
//! of `vmctl run`.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::exec::AGENT_PORT;
use crate::state::{StateError, VmDir};

use super::lock::{
    lock_lifecycle_within, lock_to_stop, lock_to_stop_within, LockHolder, LIFECYCLE_LOCK,
    STOP_WAITS_FOR_START,
};
use super::{agent_runtime, VmError};

/// How long `vmctl prune` waits for a VM's lifecycle lock before it takes the VM for
/// one being started: longer than the daemon's idle stop holds it past the VM's end.
const STOP_LOCK_GRACE: Duration = Duration::from_secs(2);

/// Asks the guest to shut down, then waits for the supervisor; forces it after 30 s.
/// A start under way finishes first.
pub fn stop(workspace: &Path) -> Result<bool, VmError> {
    let (_, vm) = VmDir::lookup(workspace)?;
    let _lifecycle_lock = lock_to_stop(&vm, LockHolder::Stopping)?;
    let Some(supervisor) = stop_vm(&vm, "asked to by `vmctl stop`") else {
        return Ok(false);
    };
    stopped(&vm, supervisor)?;
    if let Some(again) = vm.running_pid() {
        // A start that held the lock past the stop's wait (an exec waiting on a hung
        // agent) boots the VM again once its supervisor is gone.
        vmm::to_stderr!(
            "vmctl: another vmctl started the VM in {} again as it stopped (supervisor \
             pid {again}); `vmctl ps` shows it",
            vm.path.display()
        );
    }
    Ok(true)
}

/// Whether `vm`'s supervisor `pid`, told to stop, has: it can outlive even SIGKILL,
/// stuck in the kernel (an uninterruptible wait on a dead network file system, say).
/// One another vmctl started since is not this stop's to judge.
pub fn stopped(vm: &VmDir, pid: i32) -> Result<(), VmError> {
    if vm.running_pid() != Some(pid) {
        return Ok(());
    }
    Err(VmError::NotStopped {
        dir: vm.path.clone(),
        pid,
        log: vm.supervisor_log(),
    })
}

/// How the line that says who shut a VM down begins in its supervisor's log, where a
/// session that loses its VM finds it (and quotes what follows).
pub const SHUTDOWN_REQUESTED: &str = "vmctl: shutting the VM down: ";

/// Stops `vm`, first saying `why` in its supervisor's log; returns the pid of the
/// supervisor it stopped, `None` when it was not running. The guest is asked to shut
/// down (again and again while its agent does not answer yet, as when it still
/// boots); after 30 s its supervisor is told to stop the VMM, and killed if it has not
/// within 10 s more. Returns once that supervisor is gone.
pub fn stop_vm(vm: &VmDir, why: &str) -> Option<i32> {
    stop_vm_within(vm, why, StopTimeouts::DEFAULT)
}

/// How long [`stop_vm`] gives the guest, then its supervisor after SIGTERM, then after
/// SIGKILL.
#[derive(Clone)]
struct StopTimeouts {
    guest: Duration,
    after_term: Duration,
    after_kill: Duration,
}

impl StopTimeouts {
    const DEFAULT: StopTimeouts = StopTimeouts {
        guest: Duration::from_secs(30),
        after_term: Duration::from_secs(10),
        after_kill: Duration::from_secs(5),
    };
}

fn stop_vm_within(vm: &VmDir, why: &str, timeouts: StopTimeouts) -> Option<i32> {
    let pid = vm.running_pid()?;
    let said = std::fs::OpenOptions::new()
        .append(true)
        .open(vm.supervisor_log())
        .and_then(|mut log| writeln!(log, "{SHUTDOWN_REQUESTED}{why}"));
    if let Err(e) = said {
        tracing::debug!("cannot note the shutdown in the supervisor's log: {e}");
    }
    let deadline = Instant::now() + timeouts.guest;
    let mut asked = false;
    while vm.running_pid() == Some(pid) && Instant::now() < deadline {
        if !asked {
            match ask_guest_to_shut_down(vm, deadline.saturating_duration_since(Instant::now())) {
                ShutdownAsked::Yes => asked = true,
                ShutdownAsked::NotYet => {}
                ShutdownAsked::OtherAgent => {
                    // An agent older than the stable messages cannot be asked;
                    // waiting would only delay.
                    vmm::to_stderr!(
                        "vmctl: the VM in {} runs a guest agent too old to be asked to \
                         shut down; stopping its VMM",
                        vm.path.display()
                    );
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(if asked { 100 } else { 500 }));
    }
    if vm.running_pid() != Some(pid) {
        return Some(pid);
    }
    if asked {
        vmm::to_stderr!(
            "vmctl: the VM in {} did not shut down; stopping its VMM",
            vm.path.display()
        );
    }
    for (signal, wait) in [
        (libc::SIGTERM, timeouts.after_term),
        (libc::SIGKILL, timeouts.after_kill),
    ] {
        if vm.running_pid() != Some(pid) {
            break;
        }
        // SAFETY: signalling the supervisor, whose pid `running_pid` has just checked
        // against its command line.
        unsafe { libc::kill(pid, signal) };
        let gone_by = Instant::now() + wait;
        while vm.running_pid() == Some(pid) && Instant::now() < gone_by {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Some(pid)
}

enum ShutdownAsked {
    Yes,
    /// The agent did not answer (yet): the VM may still be booting.
    NotYet,
    /// Its agent speaks a protocol older than the stable messages.
    OtherAgent,
}

/// Asks `vm`'s guest agent to shut the guest down, waiting at most `limit` (and 10 s).
fn ask_guest_to_shut_down(vm: &VmDir, limit: Duration) -> ShutdownAsked {
    let Some(runtime) = agent_runtime() else {
        return ShutdownAsked::NotYet;
    };
    // An older layout's VM is asked where its socket is: waiting for one it never
    // makes would only delay its stop by the whole wait.
    let socket = if vm.runs_an_older_layout() {
        vm.older_layout_vsock_socket()
    } else {
        vm.vsock_socket()
    };
    runtime.block_on(async {
        let shutdown = async {
            // A VM another vmctl started is asked too, in its own protocol: its
            // commands get SIGTERM and the guest syncs, where cutting its power would
            // leave a guest `git`'s index.lock in the workspace.
            guest_agent::client::connect_hybrid_any_protocol(&socket, AGENT_PORT)
                .await?
                .shutdown()
                .await
        };
        match tokio::time::timeout(limit.min(Duration::from_secs(10)), shutdown).await {
            Ok(Ok(_)) => ShutdownAsked::Yes,
            Ok(Err(guest_agent::client::ClientError::OtherProtocol(_))) => {
                ShutdownAsked::OtherAgent
            }
            _ => ShutdownAsked::NotYet,
        }
    })
}

/// Stops the VM and removes its state; false when the workspace has none.
pub fn remove(workspace: &Path) -> Result<bool, VmError> {
    let (_, vm) = VmDir::lookup(workspace)?;
    remove_within(&vm, STOP_WAITS_FOR_START, StopTimeouts::DEFAULT)
}

/// How many times `vmctl rm` stops a VM that a start holding its lock boots again.
const REMOVAL_STOPS: usize = 3;

/// [`remove`] of `vm`, waiting `wait` for a start under way of a running VM (as
/// [`lock_to_stop_within`]), stopping within `timeouts`. The directory is emptied only
/// under the lifecycle lock: a start that held it past `wait` was waiting for the
/// running VM's agent, and once the VM is stopped goes on to boot it again (a `vmctl
/// exec` queued behind a hung VM), writing into the directory the removal empties. So
/// the VM is stopped first without the lock, then the lock waited for again, and
/// whatever that start booted stopped under it.
fn remove_within(vm: &VmDir, wait: Duration, timeouts: StopTimeouts) -> Result<bool, VmError> {
    const WHY: &str = "asked to by `vmctl rm`";
    let mut lock = lock_to_stop_within(vm, LockHolder::Removing, wait)?;
    for _ in 0..REMOVAL_STOPS {
        if lock.is_some() || !vm.path.exists() {
            break;
        }
        stop_vm_within(vm, WHY, timeouts.clone());
        lock = lock_to_stop_within(vm, LockHolder::Removing, wait)?;
    }
    if !vm.path.exists() {
        return Ok(false);
    }
    let Some(_lifecycle_lock) = lock else {
        return Err(VmError::KeptStarting {
            dir: vm.path.clone(),
            times: REMOVAL_STOPS,
        });
    };
    stop_vm_within(vm, WHY, timeouts);
    remove_stopped(vm).map(|()| true)
}

/// Stops `vm` (saying `why`, as [`stop_vm`]) and removes its state; refuses while its
/// supervisor still runs.
pub fn remove_vm(vm: &VmDir, why: &str) -> Result<(), VmError> {
    stop_vm(vm, why);
    remove_stopped(vm)
}

/// Removes the state of `vm`, stopped; refuses while its supervisor still runs.
fn remove_stopped(vm: &VmDir) -> Result<(), VmError> {
    if let Some(pid) = vm.running_pid() {
        return Err(VmError::StillRunning {
            dir: vm.path.clone(),
            pid,
            log: vm.supervisor_log(),
        });
    }
    remove_dir(vm).map_err(|source| {
        VmError::State(StateError::Io {
            path: vm.path.clone(),
            source,
        })
    })
}

/// How the removal of `vmctl run`'s throwaway VM ended.
#[derive(Debug)]
pub enum Teardown {
    Done(Result<(), VmError>),
    /// A second SIGINT or SIGTERM (this one) came first.
    Interrupted(i32),
}

/// Removes `vm`, `vmctl run`'s throwaway VM, minding SIGINT and SIGTERM: the session
/// forwarded them to its command, and their handlers outlive it, so that without this
/// Ctrl-C would do nothing while a guest that does not shut down holds the removal up
/// to 45 s ([`stop_vm`]). A first signal stops the VMM now (SIGTERM to the supervisor,
/// which passes it on); a second ends the wait, leaving the VM to the daemon (it is
/// stopped once idle) and its directory to `vmctl prune`.
pub fn remove_throwaway(vm: &VmDir) -> Teardown {
    let removal = {
        let vm = vm.clone();
        move || remove_vm(&vm, "`vmctl run` removes its throwaway VM")
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::debug!("no runtime to mind signals on ({e}); removing the VM regardless");
            return Teardown::Done(removal());
        }
    };
    let outcome = runtime.block_on(async {
        let (signals, source) = crate::exec::signals_received();
        let outcome = remove_minding(vm, signals, removal).await;
        source.abort();
        outcome
    });
    // An interrupted removal is not waited for: the process ends with it.
    runtime.shutdown_background();
    outcome
}

/// Runs `removal` of `vm` until it is done or the second of `signals` comes; the
/// first has `vm`'s supervisor stop its VMM.
async fn remove_minding(
    vm: &VmDir,
    mut signals: tokio::sync::mpsc::Receiver<i32>,
    removal: impl FnOnce() -> Result<(), VmError> + Send + 'static,
) -> Teardown {
    let mut removal = tokio::task::spawn_blocking(removal);
    let mut stopping = false;
    loop {
        tokio::select! {
            removed = &mut removal => {
                return Teardown::Done(match removed {
                    Ok(removed) => removed,
                    Err(e) => std::panic::resume_unwind(e.into_panic()),
                });
            }
            Some(signal) = signals.recv() => {
                if stopping {
                    return Teardown::Interrupted(signal);
                }
                stopping = true;
                if let Some(pid) = vm.running_pid() {
                    vmm::to_stderr!(
                        "vmctl: stopping the throwaway VM's VMM now (once more, and vmctl \
                         leaves it to the daemon and `vmctl prune`)"
                    );
                    // SAFETY: signalling the supervisor, whose pid `running_pid` has just
                    // checked against its command line.
                    unsafe { libc::kill(pid, libc::SIGTERM) };
                }
            }
        }
    }
}

/// Removes the directory of `vm`, which no VM runs from, and its sockets' directory
/// when that is one of its own in /tmp ([`VmDir::sockets_dir`]).
pub(super) fn remove_dir(vm: &VmDir) -> std::io::Result<()> {
    // The guest wrote parts of it (the agent homes), read-only directories included.
    let removed = match (vm.path.parent(), vm.path.file_name()) {
        (Some(parent), Some(name)) => crate::guest_writable::open_dir(parent)
            .and_then(|parent| crate::guest_writable::remove(parent, name)),
        _ => std::fs::remove_dir_all(&vm.path),
    };
    // Its last run removed its sockets, but an older vmctl kept virtiofsd's logs
    // there too, and so the directory, one more in /tmp at each `vmctl run`.
    let sockets = vm.sockets_dir();
    if sockets != vm.path {
        match std::fs::remove_dir_all(&sockets) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => vmm::to_stderr!(
                "vmctl: warning: cannot remove the VM's sockets directory {}: {e}",
                sockets.display()
            ),
        }
    }
    removed
}

/// `vmctl prune`: removes those of `vms` that are stopped and whose workspace
/// directory is gone, that were throwaway VMs of a `vmctl run` that did not end well,
/// or whose start was refused before the VM was recorded (or, with `dry_run`, lists
/// them), saying what it did; names the running ones of removed directories, which it
/// leaves. Exits 1 if a removal failed.
pub fn prune(vms: &[VmDir], dry_run: bool) -> u8 {
    let mut failed = false;
    let mut forgotten = 0;
    for vm in vms {
        let untouched = untouched_for(vm, UNSTARTED_AGE);
        let modified = std::fs::metadata(&vm.path).and_then(|m| m.modified()).ok();
        let had_lock_file = vm.path.join(LIFECYCLE_LOCK).exists();
        // Held from the check to the removal: a start that comes meanwhile (Paseo
        // making a worktree again at the same path) waits, and is not removed under.
        let Some(_lifecycle_lock) = lock_lifecycle_within(vm, STOP_LOCK_GRACE) else {
            continue;
        };
        // Making the lock's file must not make the directory look fresh to the next
        // prune (or a dry run's to this one).
        if let (false, Some(modified)) = (had_lock_file, modified) {
            let restored = std::fs::File::open(&vm.path).and_then(|dir| dir.set_modified(modified));
            if let Err(e) = restored {
                tracing::debug!("cannot restore {}'s time: {e}", vm.path.display());
            }
        }
        let Some(what) = prunable(vm, untouched) else {
            continue;
        };
        if dry_run {
            vmm::to_stderr!("vmctl: would forget {what} ({})", vm.path.display());
            forgotten += 1;
            continue;
        }
        match remove_vm(vm, "`vmctl prune` forgets it") {
            Ok(()) => {
                forgotten += 1;
                vmm::to_stderr!("vmctl: forgot {what}");
            }
            Err(e) => {
                failed = true;
                vmm::to_stderr!("vmctl: error: {e}");
            }
        }
    }
    if dry_run {
        vmm::to_stderr!("vmctl: {forgotten} VM(s) would be forgotten");
    } else {
        vmm::to_stderr!("vmctl: {forgotten} VM(s) forgotten");
    }
    u8::from(failed)
}

/// What `vmctl prune` would forget `vm` as, if it would.
/// The caller holds `vm`'s lifecycle lock; `untouched`: whether its directory had not
/// changed for [`UNSTARTED_AGE`] before that.
fn prunable(vm: &VmDir, untouched: bool) -> Option<String> {
    let stopped = || vm.running_pid().is_none();
    let record = match vm.read_record() {
        Ok(record) => record,
        // A start refused before it wrote the record (a bad --mount, say) left the
        // directory alone, which `vmctl ps` does not list. A recent one may be a start
        // that has not yet taken its lock.
        Err(_) if !vm.record_path().exists() && stopped() && untouched => {
            return Some("the directory of a VM that never started".into());
        }
        // An unreadable record is kept for whoever looks into it.
        Err(_) => return None,
    };
    let throwaway = vm.is_throwaway();
    let workspace = record.workspace.display();
    if !throwaway {
        match record.workspace.try_exists() {
            Ok(true) => return None,
            Ok(false) => {
                if let Some(point) = unmounted(record.workspace_mount.as_deref()) {
                    vmm::to_stderr!(
                        "vmctl: {workspace} is not there, but neither is the file system \
                         it was on (nothing is mounted on {}): perhaps its volume is not \
                         mounted. Its VM is kept; 'vmctl rm {workspace}' forgets it",
                        point.display()
                    );
                    return None;
                }
            }
            // Perhaps only out of reach (a parent directory not readable, a dead
            // network mount): its agent sessions are kept.
            Err(e) => {
                vmm::to_stderr!(
                    "vmctl: cannot tell whether {workspace} is still there ({e}): its VM \
                     is kept, for a prune once it can be told ({} holds it)",
                    vm.path.display()
                );
                return None;
            }
        }
    }
    if !stopped() {
        if !throwaway {
            vmm::to_stderr!(
                "vmctl: the VM of {workspace} (removed) still runs: 'vmctl rm \
                 {workspace}' stops and forgets it"
            );
        }
        return None;
    }
    Some(if throwaway {
        format!("the throwaway VM of {workspace}")
    } else {
        format!("the VM of {workspace}")
    })
}

/// `point`, the mount point a missing workspace's file system had, if nothing is
/// mounted there now: an unmounted volume's workspace looks removed (its mount point is
/// an empty directory on the file system below), while a removed workspace's file
/// system is still mounted. (A path, not a device number: those of tmpfs, btrfs
/// subvolumes, NFS and FUSE change across reboots.)
fn unmounted(point: Option<&Path>) -> Option<&Path> {
    point.filter(|point| crate::shares::mounts::is_mounted(point) == Some(false))
}

/// How long a VM directory without a record is left alone by `vmctl prune`.
const UNSTARTED_AGE: Duration = Duration::from_secs(60);

/// Whether `vm`'s directory has not changed for `age`.
fn untouched_for(vm: &VmDir, age: Duration) -> bool {
    std::fs::metadata(&vm.path)
        .and_then(|meta| meta.modified())
        .is_ok_and(|modified| modified.elapsed().is_ok_and(|elapsed| elapsed >= age))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::lock::lock_lifecycle;
    use crate::vm::tests::*;

    /// A VM an older vmctl started, its socket where that vmctl kept it, is asked to
    /// shut down there (not waited for at the new place until the stop's time is up).
    #[test]
    fn an_older_layouts_vm_is_asked_to_shut_down_where_its_socket_is() {
        use guest_agent::protocol::AgentMessage;
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let agent = fake_agent_answering(
            &vm.older_layout_vsock_socket(),
            vec![
                AgentMessage::HelloOk {
                    agent_version: "0.0.9".into(),
                    protocol_version: guest_agent::protocol::PROTOCOL_VERSION,
                },
                AgentMessage::Ok,
            ],
        );
        assert!(vm.runs_an_older_layout());
        assert!(matches!(
            ask_guest_to_shut_down(&vm, Duration::from_secs(5)),
            ShutdownAsked::Yes
        ));
        let requests = agent.join().unwrap();
        let shutdown =
            guest_agent::protocol::encode_frame(&guest_agent::protocol::ClientMessage::Shutdown)
                .unwrap();
        assert_eq!(requests[1], shutdown[4..], "not asked to shut down");
    }

    #[test]
    fn prune_forgets_stopped_vms_of_removed_directories_and_refused_starts_only() {
        let dir = tempfile::tempdir().unwrap();
        let kept_workspace = dir.path().join("kept");
        std::fs::create_dir_all(&kept_workspace).unwrap();
        let vm_of = |name: &str, workspace: &Path| {
            let vm = VmDir {
                path: dir.path().join("vms").join(name),
            };
            std::fs::create_dir_all(vm.path.join("agent-home")).unwrap();
            vm.write_record(&crate::state::test_record(&vm, workspace))
                .unwrap();
            vm
        };
        let kept = vm_of("kept", &kept_workspace);
        let gone = vm_of("gone", &dir.path().join("removed-worktree"));
        // Whether its workspace is there cannot be told (a link loop on the way, as an
        // unreadable parent or a dead mount would): kept, with its agent sessions.
        std::os::unix::fs::symlink("loop", dir.path().join("loop")).unwrap();
        let unknown = vm_of("unknown", &dir.path().join("loop/ws"));
        let starting = vm_of("starting", &dir.path().join("removed-too"));
        // A workspace on a volume since unmounted: its mount point, left behind, is on
        // another file system than the one the record names.
        let unmounted = vm_of("unmounted", &dir.path().join("volume/ws"));
        let mut record = unmounted.read_record().unwrap();
        record.workspace_mount = Some(dir.path().join("volume"));
        unmounted.write_record(&record).unwrap();
        // One removed from a file system still mounted.
        let mut record = gone.read_record().unwrap();
        record.workspace_mount = Some("/".into());
        gone.write_record(&record).unwrap();
        // A `vmctl run` whose boot failed left its stopped throwaway VM behind.
        let throwaway = vm_of("kept-1a2b3c4d-run4242", &kept_workspace);
        let lifecycle_lock = lock_exclusive(&starting.path.join(LIFECYCLE_LOCK)).unwrap();
        // A start refused before it wrote a record; and one still going.
        let refused = VmDir {
            path: dir.path().join("vms/refused"),
        };
        std::fs::create_dir_all(refused.path.join("agent-home")).unwrap();
        let a_while_ago = std::time::SystemTime::now() - UNSTARTED_AGE;
        std::fs::File::open(&refused.path)
            .and_then(|dir| dir.set_modified(a_while_ago))
            .unwrap();
        let just_refused = VmDir {
            path: dir.path().join("vms/just-refused"),
        };
        std::fs::create_dir_all(&just_refused.path).unwrap();
        let unrecorded_start = VmDir {
            path: dir.path().join("vms/unrecorded"),
        };
        std::fs::create_dir_all(&unrecorded_start.path).unwrap();
        let unrecorded_lock = lock_exclusive(&unrecorded_start.path.join(LIFECYCLE_LOCK)).unwrap();
        let vms = [
            kept.clone(),
            gone.clone(),
            unknown.clone(),
            unmounted.clone(),
            starting.clone(),
            throwaway.clone(),
            refused.clone(),
            just_refused.clone(),
            unrecorded_start.clone(),
        ];

        assert_eq!(prune(&vms, true), 0);
        assert!(gone.path.exists(), "a dry run removed it");
        assert_eq!(prune(&vms, false), 0);
        assert!(
            !gone.path.exists(),
            "the stopped VM of a removed directory is left"
        );
        assert!(!throwaway.path.exists(), "a stopped throwaway VM is left");
        assert!(
            unknown.path.exists(),
            "a VM whose workspace may be only out of reach was removed"
        );
        assert!(
            unmounted.path.exists(),
            "a VM whose workspace's volume may be only unmounted was removed"
        );
        assert!(
            !refused.path.exists(),
            "a refused start's directory is left"
        );
        assert!(
            unrecorded_start.path.exists(),
            "a start in progress, not yet recorded, was removed"
        );
        assert!(
            just_refused.path.exists(),
            "a fresh directory without a record (a start about to lock it) was removed"
        );
        drop(unrecorded_lock);
        assert!(
            kept.path.exists(),
            "a VM of an existing directory was removed"
        );
        assert!(starting.path.exists(), "a VM being started was removed");
        drop(lifecycle_lock);
    }

    /// A stand-in supervisor of `vm` that ignores SIGTERM, as one stuck in its teardown.
    fn stuck_supervisor(vm: &VmDir) -> crate::state::FakeSupervisor {
        crate::state::fake_supervisor(vm, "trap '' TERM; while :; do sleep 0.05; done")
    }

    #[test]
    fn a_stop_returns_once_the_supervisor_is_gone_killing_it_if_need_be() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let mut supervisor = stuck_supervisor(&vm);
        let quick = StopTimeouts {
            guest: Duration::from_millis(300),
            after_term: Duration::from_millis(300),
            after_kill: Duration::from_secs(5),
        };
        let stopped_pid = stop_vm_within(&vm, "a test", quick).expect("it ran");
        assert!(
            vm.running_pid().is_none(),
            "stop returned before it was gone"
        );
        let status = supervisor.0.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        assert!(stopped(&vm, stopped_pid).is_ok());
        assert!(remove_vm(&vm, "a test").is_ok());
        assert!(!vm.path.exists());
    }

    /// A stop after which the supervisor still runs (stuck in the kernel past SIGKILL)
    /// is an error that names it, not a quiet success.
    #[test]
    fn a_supervisor_still_there_after_a_stop_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let supervisor = stuck_supervisor(&vm);
        let pid = vm.running_pid().expect("the stand-in supervisor runs");
        let error = stopped(&vm, pid).expect_err("a running supervisor taken for stopped");
        assert!(
            matches!(error, VmError::NotStopped { pid: named, .. } if named == pid),
            "{error}"
        );
        assert!(error.to_string().contains("'vmctl stop' again"), "{error}");
        // (Review: a start waiting on the lock boots the VM again once its supervisor
        // is gone; that new supervisor was reported as the old one outliving SIGKILL.)
        assert!(
            stopped(&vm, pid + 1).is_ok(),
            "a supervisor started since taken for the stopped one"
        );
        drop(supervisor);
    }

    /// `vmctl rm` of a hung VM whose lifecycle lock a `vmctl exec` holds while it waits
    /// for the agent: the removal stops the VM without the lock, but empties the
    /// directory only once that start, which goes on to boot the VM again, has let go.
    /// (Review: it emptied the directory while the start wrote its new VM's record
    /// there.)
    #[test]
    fn a_removal_empties_the_directory_only_once_a_start_waiting_on_the_vm_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let _hung = crate::state::fake_supervisor(&vm, "while :; do sleep 0.05; done");
        let (locked, lock_taken) = std::sync::mpsc::channel();
        let starter = {
            let vm = vm.clone();
            std::thread::spawn(move || {
                let _lock = lock_lifecycle(&vm, || {}).unwrap();
                locked.send(()).unwrap();
                while vm.running_pid().is_some() {
                    std::thread::sleep(Duration::from_millis(20));
                }
                // The VM is gone: it boots a new one, writing its record.
                let booted = (0..10).all(|round| {
                    std::thread::sleep(Duration::from_millis(50));
                    std::fs::write(vm.path.join(format!("record-{round}")), "new").is_ok()
                });
                booted && vm.path.exists()
            })
        };
        lock_taken.recv().unwrap();
        let quick = StopTimeouts {
            guest: Duration::from_millis(200),
            after_term: Duration::from_secs(5),
            after_kill: Duration::from_secs(5),
        };
        let removed = remove_within(&vm, Duration::from_millis(200), quick).unwrap();
        assert!(
            starter.join().unwrap(),
            "the start's directory was emptied under it"
        );
        assert!(removed);
        assert!(!vm.path.exists());
    }

    /// `remove_minding` of a VM with this supervisor (`sh -c script`), given `signals`
    /// each after its delay; how it ended and how long it took.
    fn remove_throwaway_with_signals(
        script: &str,
        signals: &[(Duration, i32)],
    ) -> (Teardown, Duration, bool) {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm-run1"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let supervisor = crate::state::fake_supervisor(&vm, script);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let started = Instant::now();
        let outcome = runtime.block_on(async {
            let (sender, received) = tokio::sync::mpsc::channel(4);
            let signals = signals.to_vec();
            tokio::spawn(async move {
                for (delay, signal) in signals {
                    tokio::time::sleep(delay).await;
                    let _ = sender.send(signal).await;
                }
                std::future::pending::<()>().await
            });
            let removal = {
                let vm = vm.clone();
                move || remove_vm(&vm, "a test")
            };
            remove_minding(&vm, received, removal).await
        });
        let took = started.elapsed();
        let left = vm.path.exists();
        // A removal left running ends with its supervisor.
        drop(supervisor);
        runtime.shutdown_background();
        (outcome, took, left)
    }

    /// A guest that does not shut down holds a removal 30 s before its VMM is stopped:
    /// Ctrl-C during `vmctl run`'s removal of its VM stops it at once.
    #[test]
    fn a_signal_during_a_throwaway_vms_removal_stops_its_vmm_now() {
        let (outcome, took, left) = remove_throwaway_with_signals(
            "trap 'exit 0' TERM; while :; do sleep 0.05; done",
            &[(Duration::from_millis(300), libc::SIGINT)],
        );
        assert!(matches!(outcome, Teardown::Done(Ok(()))), "{outcome:?}");
        assert!(took < Duration::from_secs(10), "took {took:?}");
        assert!(!left, "the VM's directory is left");
    }

    /// A supervisor that does not stop either: a second signal ends the wait.
    #[test]
    fn a_second_signal_during_a_throwaway_vms_removal_ends_the_wait() {
        let (outcome, took, left) = remove_throwaway_with_signals(
            "trap '' TERM; while :; do sleep 0.05; done",
            &[
                (Duration::from_millis(300), libc::SIGINT),
                (Duration::from_millis(300), libc::SIGTERM),
            ],
        );
        assert!(
            matches!(outcome, Teardown::Interrupted(libc::SIGTERM)),
            "{outcome:?}"
        );
        assert!(took < Duration::from_secs(10), "took {took:?}");
        assert!(left, "left to `vmctl prune`");
    }

    /// A VM directory too deep for socket paths has its sockets in /tmp: removing the
    /// VM removes that directory too, whatever an older vmctl left in it.
    #[test]
    fn removing_a_vm_removes_its_sockets_directory_in_tmp() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("x".repeat(100)).join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let sockets = vm.sockets_dir();
        assert_ne!(sockets, vm.path, "not deep enough for a directory in /tmp");
        vm.create_sockets_dir().unwrap();
        std::fs::write(crate::virtiofsd::log_path(&sockets, 0), "a log\n").unwrap();
        remove_vm(&vm, "a test").unwrap();
        assert!(!vm.path.exists());
        assert!(!sockets.exists(), "{} is left", sockets.display());
    }
}
