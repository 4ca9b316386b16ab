//! Confines the VMM with Landlock once its VM is built (files open, memory mapped,
//! devices connected) and before the guest runs: from then on it opens no file by
//! name, and may only remove files in the directory of its vsock socket (the socket
//! itself, when the VM ends). Whatever it already holds keeps working; anything else
//! of the host's (the user's home, its credentials) is out of reach even if a guest
//! took the VMM over, jailed or not (see `jail`). Connecting to Unix sockets by path
//! (the supervisor's vsock services) is not a file access Landlock restricts here;
//! connecting to abstract ones made outside the VMM (a desktop session's, which an
//! unjailed VMM shares the network namespace of) is refused, and so is signalling
//! other processes. Best effort: a kernel without Landlock, or with an older ABI,
//! enforces what it can, and [`Confinement`] says which.

use std::path::Path;

use landlock::{
    Access, AccessFs, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus,
    Scope, ABI,
};

/// The newest Landlock ABI whose rights this policy was written (and tested) for: 6
/// (Linux 6.12) scopes abstract Unix sockets and signals.
const POLICY_ABI: ABI = ABI::V6;

/// What the kernel enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confinement {
    Full,
    /// An older Landlock: some rights (truncation, device ioctls, abstract Unix
    /// sockets, signals) are not restricted.
    Partial,
    /// No Landlock in this kernel: the VMM keeps the user's access to files.
    None,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot confine the VMM to its VM's files (Landlock): {0}")]
pub struct ConfineError(#[from] landlock::RulesetError);

/// The paths the rules name, held open for the VMM's lifetime. A rule names an inode;
/// on a filesystem that makes a new inode for every lookup of a name no longer in use
/// (9p without a cache, as the nested host mounts some host directories), a later
/// lookup of the same path would meet another inode, outside the rule.
pub struct HeldPaths {
    _open: Vec<PathFd>,
}

/// Restricts this thread and the threads it starts afterwards (call it before the VMM
/// starts any) to removing files in `socket_dir`, its vsock socket's directory; keep
/// the [`HeldPaths`] while the VMM runs.
pub fn confine(socket_dir: Option<&Path>) -> Result<(Confinement, HeldPaths), ConfineError> {
    // A directory that cannot be opened gets no rule: removing the socket then fails,
    // which the VMM only logs.
    let opened: Vec<PathFd> = socket_dir
        .and_then(|dir| PathFd::new(dir).ok())
        .into_iter()
        .collect();
    let status =
        Ruleset::default()
            .handle_access(AccessFs::from_all(POLICY_ABI))?
            .scope(Scope::from_all(POLICY_ABI))?
            .create()?
            .add_rules(opened.iter().map(|fd| {
                Ok::<_, landlock::RulesetError>(PathBeneath::new(fd, AccessFs::RemoveFile))
            }))?
            .restrict_self()?;
    let confinement = match status.ruleset {
        RulesetStatus::FullyEnforced => Confinement::Full,
        RulesetStatus::PartiallyEnforced => Confinement::Partial,
        RulesetStatus::NotEnforced => Confinement::None,
    };
    Ok((confinement, HeldPaths { _open: opened }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Read;

    /// The highest Landlock ABI this kernel offers (0: none).
    fn kernel_abi() -> i64 {
        // SAFETY: with a null attribute, size 0 and the version flag, the call only
        // returns a number.
        unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                std::ptr::null::<u8>(),
                0usize,
                1u32,
            )
        }
        .max(0)
    }

    #[test]
    fn the_vmm_keeps_what_it_holds_and_reaches_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("vmlinux");
        let vsock_dir = dir.path().join("vm");
        std::fs::create_dir(&vsock_dir).unwrap();
        let socket = vsock_dir.join("vsock.sock");
        for file in [&kernel, &socket] {
            std::fs::write(file, b"x").unwrap();
        }
        // Landlock applies to the thread that asks and to its future threads only.
        let (confinement, held_read, kernel_open, created, removed) =
            std::thread::spawn(move || {
                let mut held = File::open(&kernel).unwrap();
                let (confinement, _held) = confine(Some(&vsock_dir)).unwrap();
                let mut contents = String::new();
                let held_read = held.read_to_string(&mut contents).is_ok();
                let kind = |result: std::io::Result<File>| result.map(|_| ()).map_err(|e| e.kind());
                (
                    confinement,
                    held_read,
                    kind(File::open(&kernel)),
                    kind(File::create(socket.with_file_name("new"))),
                    std::fs::remove_file(&socket).is_ok(),
                )
            })
            .join()
            .unwrap();
        assert!(
            held_read && removed,
            "what the VMM holds, and removing its socket, must keep working"
        );
        if kernel_abi() == 0 {
            vmm::to_stderr!(
                "confine: this kernel has no Landlock: only checked that the VMM says so"
            );
            assert_eq!(confinement, Confinement::None);
            return;
        }
        assert_ne!(confinement, Confinement::None);
        let denied = Err(std::io::ErrorKind::PermissionDenied);
        assert_eq!((kernel_open, created), (denied, denied));
    }

    /// The VMM's own threads, all started after it is confined, still signal each
    /// other (the event loop kicks the vCPUs out of KVM_RUN); another process it
    /// cannot signal, where the kernel's Landlock scopes signals (ABI 6).
    #[test]
    fn the_vmm_signals_its_own_threads_and_no_other_process() {
        let mut other = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let other_pid = other.id() as libc::pid_t;
        let (own_thread, other_process) = std::thread::spawn(move || {
            let (_confinement, _held) = confine(None).unwrap();
            let (parked_tx, parked_rx) = std::sync::mpsc::channel();
            let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
            let vcpu = std::thread::spawn(move || {
                // SAFETY: pthread_self has no preconditions.
                let _ = parked_tx.send(unsafe { libc::pthread_self() });
                let _ = done_rx.recv();
            });
            let vcpu_thread = parked_rx.recv().unwrap();
            // Signal 0: the permission check alone, Landlock's included.
            // SAFETY: the thread is alive (it waits for `done_tx`), so its handle is valid.
            let own_thread = unsafe { libc::pthread_kill(vcpu_thread, 0) };
            // SAFETY: kill with signal 0 only checks.
            let other_process = if unsafe { libc::kill(other_pid, 0) } == 0 {
                0
            } else {
                std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
            };
            drop(done_tx);
            vcpu.join().unwrap();
            (own_thread, other_process)
        })
        .join()
        .unwrap();
        let _ = other.kill();
        let _ = other.wait();
        assert_eq!(
            own_thread, 0,
            "a confined VMM could not signal its own thread"
        );
        if kernel_abi() >= 6 {
            assert_eq!(
                other_process,
                libc::EPERM,
                "a confined VMM could signal another process"
            );
        }
    }

    /// An abstract Unix socket made outside the VMM (a desktop session's, reachable
    /// from an unjailed VMM's network namespace) cannot be connected to once it is
    /// confined, where the kernel's Landlock scopes them (ABI 6).
    #[test]
    fn the_vmm_cannot_reach_abstract_sockets_made_outside_it() {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
        let name = format!("vmctl-confine-test-{}", std::process::id());
        let address = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let _listener = UnixListener::bind_addr(&address).unwrap();
        assert!(
            UnixStream::connect_addr(&address).is_ok(),
            "a socket to reach"
        );
        let (confinement, connected) = std::thread::spawn(move || {
            let (confinement, _held) = confine(None).unwrap();
            (confinement, UnixStream::connect_addr(&address).map(drop))
        })
        .join()
        .unwrap();
        if kernel_abi() < 6 {
            vmm::to_stderr!(
                "confine: this kernel's Landlock (ABI {}) does not scope abstract sockets: \
                 only checked that the VMM says it is confined in part at most",
                kernel_abi()
            );
            assert_ne!(confinement, Confinement::Full);
            return;
        }
        assert_eq!(confinement, Confinement::Full);
        assert_eq!(
            connected.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::PermissionDenied)
        );
    }
}
