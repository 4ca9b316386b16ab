//! Puts the VMM in a jail of its own once its VM is built and before the guest runs:
//! new user, mount and network namespaces whose root is an empty tmpfs that holds one
//! directory, at its own path: the one of the VM's vsock socket (the VM's state
//! directory), the only place the VMM still reaches by name (the guest's connections
//! to host ports, `<socket>_<port>`, and the socket's removal at the end). Everything
//! else of the host's files is out of sight, and with it the host's other Unix sockets
//! (an ssh agent's, a container daemon's), which neither Landlock (before Linux's
//! LANDLOCK_ACCESS_FS_RESOLVE_UNIX) nor seccomp can tell apart; the new network
//! namespace hides abstract sockets and every network.
//!
//! It takes user namespaces, which some hosts forbid to unprivileged users; there the
//! VMM goes on without the jail ([`Jail::NotEntered`] says why), still under Landlock
//! and its seccomp filter. Everything the VMM needs from outside is already open.

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Component, Path};

use rustix::mount::{
    mount, mount_bind, mount_change, unmount, MountFlags, MountPropagationFlags, UnmountFlags,
};
use rustix::thread::UnshareFlags;

/// What [`enter`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Jail {
    /// The VMM sees an empty root with only the kept directory in it.
    Entered,
    /// Why the VMM still sees the host's files.
    NotEntered(String),
}

/// Enters the jail, keeping `visible` (the vsock socket's directory, if any) at its
/// path; the tmpfs is mounted over `visible`, else over `kernel`'s directory. Call it
/// while the process has one thread (user namespaces take that) and before Landlock
/// (which forbids mounting).
pub fn enter(visible: Option<&Path>, kernel: &Path) -> Jail {
    match build(visible, kernel) {
        Ok(()) => Jail::Entered,
        Err(reason) => Jail::NotEntered(reason),
    }
}

/// Each step names itself in its error. A failed step leaves the VMM's view of the
/// files the host's (the new root's tmpfs is taken away again), so it goes on working,
/// only unjailed.
fn build(visible: Option<&Path>, kernel: &Path) -> Result<(), String> {
    // The directory is made again in the new root along its path as written, which
    // must therefore lead there from / without a detour.
    let plain = |dir: &Path| {
        dir.components()
            .all(|part| matches!(part, Component::RootDir | Component::Normal(_)))
    };
    if visible.is_some_and(|dir| !dir.is_absolute() || !plain(dir)) {
        return Err("the vsock socket's path is relative or has '.' or '..' in it".into());
    }
    // Where the new root's tmpfs is mounted: any directory of the VM's will do, since
    // the new root leaves it behind.
    let mount_point = visible
        .or_else(|| kernel.parent())
        .and_then(|dir| std::fs::canonicalize(dir).ok())
        .filter(|dir| dir != Path::new("/"))
        .ok_or("no directory of the VM's to stand on")?;
    let (uid, gid) = (rustix::process::geteuid(), rustix::process::getegid());

    // SAFETY: without UnshareFlags::FILES the descriptor table stays shared, and the
    // process has a single thread here (user namespaces refuse otherwise).
    unsafe {
        rustix::thread::unshare_unsafe(
            UnshareFlags::NEWUSER | UnshareFlags::NEWNS | UnshareFlags::NEWNET,
        )
    }
    .map_err(failed("unshare"))?;
    // The same ids inside as outside, so that what the VMM owns stays its own.
    for (file, content) in [
        ("setgroups", "deny".to_string()),
        ("uid_map", format!("{0} {0} 1", uid.as_raw())),
        ("gid_map", format!("{0} {0} 1", gid.as_raw())),
    ] {
        std::fs::write(format!("/proc/self/{file}"), content).map_err(failed(file))?;
    }
    mount_change(
        "/",
        MountPropagationFlags::PRIVATE | MountPropagationFlags::REC,
    )
    .map_err(failed("make the mounts private"))?;
    // Opened in the new mount namespace (a bind mount's source must be in it), before
    // the tmpfs hides it.
    let kept = visible
        .map(|dir| File::open(dir).map(|file| (dir, file)))
        .transpose()
        .map_err(failed("open the directory to keep"))?;
    // Before the mount, whose failure it would otherwise leave in place (a working
    // directory removed meanwhile has none).
    let cwd = std::env::current_dir().map_err(failed("find the working directory"))?;
    mount(
        "tmpfs",
        &mount_point,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        Some(TMPFS_OPTIONS),
    )
    .map_err(failed("mount the new root"))?;
    let pivoted = pivot_into(&mount_point, kept.as_ref().map(|(dir, file)| (*dir, file)));
    if pivoted.is_err() {
        let _ = unmount(&mount_point, UnmountFlags::DETACH);
        let _ = std::env::set_current_dir(cwd);
    }
    pivoted
}

/// Puts `kept` at its own path in the tmpfs at `new_root` and makes that the root.
fn pivot_into(new_root: &Path, kept: Option<(&Path, &File)>) -> Result<(), String> {
    if let Some((dir, file)) = kept {
        let inside = new_root.join(dir.strip_prefix("/").unwrap_or(dir));
        std::fs::create_dir_all(&inside).map_err(failed("make the kept directory's path"))?;
        let source = format!("/proc/self/fd/{}", file.as_raw_fd());
        mount_bind(source.as_str(), &inside).map_err(failed("bind the kept directory"))?;
    }
    std::env::set_current_dir(new_root).map_err(failed("enter the new root"))?;
    rustix::process::pivot_root(".", ".").map_err(failed("pivot_root"))?;
    // The old root now lies over the new one; detaching it leaves the tmpfs.
    unmount(".", UnmountFlags::DETACH).map_err(failed("detach the old root"))?;
    std::env::set_current_dir("/").map_err(failed("chdir /"))
}

fn failed<E: Into<std::io::Error>>(step: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{step}: {}", e.into())
}

/// Small: it holds directories only.
const TMPFS_OPTIONS: &CStr = c"size=64k,nr_inodes=64,mode=0755";

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::process::Command;

    const CHILD_ENV: &str = "VMCTL_VMM_JAIL_TEST_DIR";
    /// Set: the child's working directory is removed before it enters the jail.
    const GONE_CWD_ENV: &str = "VMCTL_VMM_JAIL_TEST_GONE_CWD";
    const THIS_TEST: &str = "jail::tests::the_jailed_vmm_sees_its_directory_and_nothing_else";

    /// The jail needs a process with one thread, and a test binary has several; so a
    /// copy of this test binary forks, and its child, whose only thread is the forking
    /// one, enters the jail and says what it sees.
    #[test]
    fn the_jailed_vmm_sees_its_directory_and_nothing_else() {
        if let Ok(dir) = std::env::var(CHILD_ENV) {
            // SAFETY: the child only allocates and prints (glibc keeps malloc usable
            // across fork; the test harness's other thread holds no lock while it
            // waits for this test) and then exits without returning.
            match unsafe { libc::fork() } {
                0 => {
                    report_from_the_jail(Path::new(&dir));
                    // SAFETY: ends the forked child without running the harness's exit.
                    unsafe { libc::_exit(0) }
                }
                -1 => panic!("fork: {}", std::io::Error::last_os_error()),
                pid => {
                    let mut status = 0;
                    // SAFETY: waits for the child forked above.
                    unsafe { libc::waitpid(pid, &mut status, 0) };
                    std::process::exit(0);
                }
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let _peer = UnixListener::bind(dir.path().join("vsock.sock_1025")).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args([THIS_TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&child.stdout);
        assert!(stdout.contains("peer reachable: true"), "{stdout}");
        let forbidden_here = ["Operation not permitted", "No space left"]
            .iter()
            .any(|reason| stdout.contains(reason));
        if stdout.contains("jail: NotEntered") && forbidden_here {
            vmm::to_stderr!(
                "jail: this host forbids user namespaces: only checked that the VMM says so \
                 and goes on\n{stdout}"
            );
            assert!(stdout.contains("etc visible: true"), "{stdout}");
            return;
        }
        assert!(stdout.contains("jail: Entered"), "{stdout}");
        assert!(stdout.contains("etc visible: false"), "{stdout}");
    }

    /// A step that fails leaves the VMM's view the host's: a working directory removed
    /// before the jail fails it once the new root's tmpfs covered the VM's directory,
    /// which then hid the sockets of the guest's connections to the host.
    #[test]
    fn a_jail_that_fails_leaves_the_vmms_view_the_hosts() {
        let dir = tempfile::tempdir().unwrap();
        let _peer = UnixListener::bind(dir.path().join("vsock.sock_1025")).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args([THIS_TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .env(GONE_CWD_ENV, dir.path().join("gone"))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&child.stdout);
        assert!(stdout.contains("jail: NotEntered"), "{stdout}");
        assert!(stdout.contains("peer reachable: true"), "{stdout}");
        assert!(stdout.contains("etc visible: true"), "{stdout}");
    }

    fn report_from_the_jail(dir: &Path) {
        if let Ok(gone) = std::env::var(GONE_CWD_ENV) {
            std::fs::create_dir(&gone).unwrap();
            std::env::set_current_dir(&gone).unwrap();
            std::fs::remove_dir(&gone).unwrap();
        }
        println!(
            "jail: {:?}",
            enter(Some(dir), Path::new("/nonexistent/vmlinux"))
        );
        let peer = UnixStream::connect(dir.join("vsock.sock_1025")).is_ok();
        println!("peer reachable: {peer}");
        println!("etc visible: {}", Path::new("/etc/passwd").exists());
    }
}
