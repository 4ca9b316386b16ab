//! The VM's lifecycle lock: whoever starts, stops or removes a VM holds it, so
//! that none of these interleave; `vmctl ps` reads what its holder does.

use std::time::{Duration, Instant};

use crate::state::{StateError, VmDir};

use super::VmError;

/// The file in a VM's directory whose `flock` is the VM's lifecycle lock: whoever
/// starts, stops or removes the VM holds it, so that none of these interleave, and
/// notes in it which it does ([`LockHolder`]). Any new operation that must not run
/// beside those takes it too. The name is from when only a start took it; it stays, so
/// that an older vmctl and this one still exclude each other.
pub(crate) const LIFECYCLE_LOCK: &str = "start.lock";

/// Why a `vmctl` holds a VM's lifecycle lock, as it notes in the lock's file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockHolder {
    Starting,
    Stopping,
    Removing,
}

impl LockHolder {
    pub(super) fn note(self) -> &'static str {
        match self {
            LockHolder::Starting => "starting",
            LockHolder::Stopping => "stopping",
            LockHolder::Removing => "removing",
        }
    }

    /// A holder that noted nothing (an older vmctl, or between its lock and its note)
    /// is taken for a start, as before there were notes.
    fn from_note(note: &[u8]) -> LockHolder {
        [LockHolder::Stopping, LockHolder::Removing]
            .into_iter()
            .find(|holder| note.trim_ascii() == holder.note().as_bytes())
            .unwrap_or(LockHolder::Starting)
    }
}

/// Whether a `vmctl` holds `vm`'s lifecycle lock, i.e. is starting, stopping or
/// removing it now ([`lifecycle_lock_held_for`] says which).
pub(crate) fn lifecycle_lock_held(vm: &VmDir) -> bool {
    std::fs::File::open(vm.path.join(LIFECYCLE_LOCK)).is_ok_and(|file| held_by_another(&file))
}

/// What the holder of `vm`'s lifecycle lock does, if someone holds it: `vmctl ps` shows
/// "stopping" for a VM the daemon's idle stop or `vmctl stop` is taking down, not
/// "starting" (nor "running" while it still runs).
pub(super) fn lifecycle_lock_held_for(vm: &VmDir) -> Option<LockHolder> {
    let file = std::fs::File::open(vm.path.join(LIFECYCLE_LOCK)).ok()?;
    let holder = LockHolder::from_note(&read_note(&file));
    held_by_another(&file).then_some(holder)
}

/// [`lifecycle_lock_held_for`] a VM whose supervisor runs, asked without trying its
/// lock unless its note says a stop: trying takes a free lock for a moment, and a start
/// or the idle stop that comes in that moment would wait or put off its stop for
/// nothing (`vmctl ps` in a loop). A running VM's lock is its start's, noted
/// "starting", or a stopper's.
pub(crate) fn running_vm_stopped_by(vm: &VmDir) -> Option<LockHolder> {
    let file = std::fs::File::open(vm.path.join(LIFECYCLE_LOCK)).ok()?;
    let holder = LockHolder::from_note(&read_note(&file));
    (holder != LockHolder::Starting && held_by_another(&file)).then_some(holder)
}

pub(super) fn read_note(file: &std::fs::File) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut said = [0u8; 16];
    let read = file.read_at(&mut said, 0).unwrap_or(0);
    said[..read].to_vec()
}

fn held_by_another(file: &std::fs::File) -> bool {
    matches!(file.try_lock(), Err(std::fs::TryLockError::WouldBlock))
}

/// Notes in `lock`, a held lifecycle lock, what its holder does, for `vmctl ps`; a note
/// that cannot be written only leaves `ps` saying "starting". Written over the last
/// one, then cut to its length, so that a reader never finds the file empty meanwhile.
pub(crate) fn note_lock_holder(lock: &std::fs::File, holder: LockHolder) {
    use std::os::unix::fs::FileExt;
    let note = holder.note().as_bytes();
    let noted = lock
        .write_all_at(note, 0)
        .and_then(|()| lock.set_len(note.len() as u64));
    if let Err(e) = noted {
        tracing::debug!("cannot note the start lock's holder: {e}");
    }
}

/// `vm`'s lifecycle lock if it comes free within `grace`; else a start is in progress,
/// not the daemon's idle stop finishing (which holds the lock until it has seen the VM
/// gone, a moment after `vmctl ps` does).
pub(super) fn lock_lifecycle_within(vm: &VmDir, grace: Duration) -> Option<std::fs::File> {
    let deadline = Instant::now() + grace;
    loop {
        match try_lock_lifecycle(vm) {
            Ok(Some(lock)) => return Some(lock),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(None) => return None,
            Err(e) => {
                tracing::debug!("cannot take {}'s start lock: {e}", vm.path.display());
                return None;
            }
        }
    }
}

/// `vm`'s lifecycle lock, unless someone holds it (`Ok(None)`). While it is held no
/// `vmctl` attaches to the VM or starts it: they wait in `start`.
pub(crate) fn try_lock_lifecycle(vm: &VmDir) -> std::io::Result<Option<std::fs::File>> {
    let file = crate::state::open_lock_file(&vm.path.join(LIFECYCLE_LOCK))?;
    match file.try_lock() {
        Ok(()) => {
            // Not the last holder's note: what this one does, if it says.
            let _ = file.set_len(0);
            Ok(Some(file))
        }
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

/// `vm`'s lifecycle lock, held while a VM is started, stopped or removed, so that none
/// of these interleave. The directory is made if missing; one removed (by `vmctl rm`)
/// while this waited is made again, with a lock of its own: the lock of a removed
/// directory excludes nobody. `on_wait` runs (once) before it waits for another holder:
/// a boot, a kernel rebuild or the daemon's idle stop can take minutes.
pub(super) fn lock_lifecycle(vm: &VmDir, on_wait: impl FnOnce()) -> Result<std::fs::File, VmError> {
    use std::os::unix::fs::MetadataExt;
    let path = vm.path.join(LIFECYCLE_LOCK);
    let io = |source| {
        VmError::State(StateError::Io {
            path: path.clone(),
            source,
        })
    };
    let mut on_wait = Some(on_wait);
    for _ in 0..10 {
        std::fs::create_dir_all(&vm.path).map_err(|source| {
            VmError::State(StateError::Io {
                path: vm.path.clone(),
                source,
            })
        })?;
        let file = crate::state::open_lock_file(&path).map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                if let Some(say) = on_wait.take() {
                    say();
                }
                file.lock().map_err(io)?;
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
        }
        let held = file.metadata().map(|m| (m.dev(), m.ino())).ok();
        let current = std::fs::metadata(&path).map(|m| (m.dev(), m.ino())).ok();
        if held.is_some() && held == current {
            note_lock_holder(&file, LockHolder::Starting);
            return Ok(file);
        }
    }
    Err(VmError::State(StateError::Io {
        path,
        source: std::io::Error::other("it was removed each time it was locked"),
    }))
}

/// `vm`'s lifecycle lock for `vmctl stop` or `rm` (`doing` it), so that no start runs
/// meanwhile: a start under way finishes first, and this says so. A start that still
/// holds the lock after [`STOP_WAITS_FOR_START`] while the VM runs only waits for its
/// agent (which a VM the nested host stalled never sends): the stop goes ahead without
/// the lock (`None`). `None` too when the VM's directory is gone.
pub(crate) fn lock_to_stop(
    vm: &VmDir,
    doing: LockHolder,
) -> Result<Option<std::fs::File>, VmError> {
    lock_to_stop_within(vm, doing, STOP_WAITS_FOR_START)
}

pub(super) fn lock_to_stop_within(
    vm: &VmDir,
    doing: LockHolder,
    wait: Duration,
) -> Result<Option<std::fs::File>, VmError> {
    let deadline = Instant::now() + wait;
    let mut said = false;
    loop {
        if !vm.path.exists() {
            return Ok(None);
        }
        match try_lock_lifecycle(vm) {
            // Locked: unless `vmctl rm` removed the directory meanwhile.
            Ok(Some(lock)) => {
                note_lock_holder(&lock, doing);
                return Ok(vm.path.exists().then_some(lock));
            }
            Ok(None) if vm.running_pid().is_some() && Instant::now() >= deadline => {
                return Ok(None)
            }
            Ok(None) => {
                if !said {
                    vmm::to_stderr!(
                        "vmctl: the VM in {} is being started or stopped (another vmctl \
                         holds its start lock); {} it once that is done",
                        vm.path.display(),
                        doing.note()
                    );
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(VmError::State(StateError::Io {
                    path: vm.path.join(LIFECYCLE_LOCK),
                    source,
                }))
            }
        }
    }
}

/// How long `vmctl stop` or `rm` waits for a start under way of a VM that runs.
pub(super) const STOP_WAITS_FOR_START: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::tests::*;

    #[test]
    fn a_stop_waits_for_a_start_but_not_for_one_stuck_on_a_running_vm() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let wait = Duration::from_millis(300);
        assert!(
            lock_to_stop_within(&vm, LockHolder::Stopping, wait)
                .unwrap()
                .is_none(),
            "no VM"
        );
        assert!(!vm.path.exists(), "the stop made the VM's directory");
        std::fs::create_dir_all(&vm.path).unwrap();
        // A start under way (the VM not running yet) is waited for, however long.
        let starting = lock_lifecycle(&vm, || {}).unwrap();
        let stopper = {
            let vm = vm.clone();
            std::thread::spawn(move || {
                lock_to_stop_within(&vm, LockHolder::Stopping, wait).unwrap()
            })
        };
        std::thread::sleep(wait * 3);
        assert!(
            !stopper.is_finished(),
            "the stop did not wait for the start"
        );
        drop(starting);
        assert!(
            stopper.join().unwrap().is_some(),
            "the stop did not take the lock"
        );
        // One holding the lock while the VM runs (waiting for its agent) is not.
        let _supervisor = crate::state::fake_supervisor(&vm, "while :; do sleep 0.05; done");
        let _attaching = lock_lifecycle(&vm, || {}).unwrap();
        let started = Instant::now();
        assert!(lock_to_stop_within(&vm, LockHolder::Stopping, wait)
            .unwrap()
            .is_none());
        assert!(started.elapsed() < wait * 10);
    }

    /// A start that has to wait for another vmctl's start or stop says so before it
    /// waits, once; one that takes a free lock says nothing.
    #[test]
    fn a_start_waiting_for_the_lifecycle_lock_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let held = lock_lifecycle(&vm, || panic!("the lock was free")).unwrap();
        let (said, heard) = std::sync::mpsc::channel();
        let waiting = {
            let vm = vm.clone();
            std::thread::spawn(move || lock_lifecycle(&vm, move || said.send(()).unwrap()).unwrap())
        };
        heard
            .recv_timeout(Duration::from_secs(10))
            .expect("the waiting start said nothing");
        std::thread::sleep(Duration::from_millis(200));
        assert!(!waiting.is_finished(), "it did not wait for the lock");
        drop(held);
        let _started = waiting.join().unwrap();
        assert!(heard.try_recv().is_err(), "it said so more than once");
    }

    #[test]
    fn a_start_waiting_on_a_removed_vm_locks_the_directory_made_again() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let removing = lock_lifecycle(&vm, || {}).unwrap();
        let waiting = {
            let vm = vm.clone();
            std::thread::spawn(move || lock_lifecycle(&vm, || {}).unwrap())
        };
        std::thread::sleep(Duration::from_millis(200));
        // `vmctl rm` removes the directory, its lock file with it, then lets go.
        std::fs::remove_dir_all(&vm.path).unwrap();
        drop(removing);
        let started = waiting.join().unwrap();
        let held = started.metadata().unwrap().ino();
        let current = std::fs::metadata(vm.path.join(LIFECYCLE_LOCK))
            .unwrap()
            .ino();
        assert_eq!(held, current, "the start holds the lock of a removed file");
        assert!(
            try_lock_lifecycle(&vm).unwrap().is_none(),
            "the lock excludes nobody"
        );
    }

    #[test]
    fn a_start_is_in_progress_only_while_its_lock_is_held() {
        let _locks_free_when_dropped = crate::state::no_forks_meanwhile();
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        assert!(!lifecycle_lock_held(&vm), "no lock file yet");
        let held = lock_exclusive(&vm.path.join(LIFECYCLE_LOCK)).unwrap();
        assert!(lifecycle_lock_held(&vm));
        drop(held);
        assert!(!lifecycle_lock_held(&vm), "a start that ended (or failed)");
    }

    #[test]
    fn prune_waits_out_a_lifecycle_lock_held_a_moment_past_the_vms_end() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        let grace = Duration::from_secs(2);
        // The daemon's idle stop lets go of the lock just after the VM is gone.
        let held = lock_exclusive(&vm.path.join(LIFECYCLE_LOCK)).unwrap();
        let stop_ends = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(held);
        });
        assert!(
            lock_lifecycle_within(&vm, grace).is_some(),
            "the stop's lock taken for a start"
        );
        stop_ends.join().unwrap();
        // A start holds it for longer.
        let _starting = lock_exclusive(&vm.path.join(LIFECYCLE_LOCK)).unwrap();
        assert!(lock_lifecycle_within(&vm, Duration::from_millis(300)).is_none());
    }
}
