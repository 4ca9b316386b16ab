//! A cgroup (v2) for each command, so that everything it started can be killed at
//! once (`cgroup.kill`) when its client goes away: also the processes that left its
//! process group (`setsid`, a shell's jobs in groups of their own), which a signal to
//! the group does not reach.
//!
//! The cgroups are numbered directories of one parent ([`GUEST_DIR`] in the VM). A
//! command's cgroup is removed when its session ends, or, when processes it left
//! behind still run there, by the first command started after they are gone.

use std::collections::HashSet;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Where the VM's agent makes its commands' cgroups (init mounts cgroup2 on
/// `/sys/fs/cgroup`).
pub const GUEST_DIR: &str = "/sys/fs/cgroup/vmctl-exec";

/// Errors of the commands' cgroups.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cannot create the cgroup {}: {source}", path.display())]
    Create { path: PathBuf, source: io::Error },
    #[error(
        "{} has no cgroup.kill ({source}): it must be a directory of a cgroup v2 \
         hierarchy other than its root, on Linux 5.14 or later",
        path.display()
    )]
    NoKill { path: PathBuf, source: io::Error },
    #[error("the cgroup path {} holds a NUL byte", path.display())]
    Nul { path: PathBuf },
    #[error("cannot kill the processes of the cgroup {}: {source}", path.display())]
    Kill { path: PathBuf, source: io::Error },
}

/// The parent of the commands' cgroups.
#[derive(Debug)]
pub struct ExecCgroups {
    dir: PathBuf,
    next: AtomicU64,
    /// The numbers of the cgroups whose sessions still run: never swept, even while
    /// empty (a command about to join its cgroup).
    in_use: Mutex<HashSet<u64>>,
}

impl ExecCgroups {
    /// Makes `dir` (a directory of a cgroup v2 hierarchy) the commands' cgroups'
    /// parent, creating it if need be.
    pub fn open(dir: &Path) -> Result<Arc<Self>, CgroupError> {
        match std::fs::create_dir(dir) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
                return Err(CgroupError::Create {
                    path: dir.to_path_buf(),
                    source: e,
                })
            }
            _ => {}
        }
        // The kernel adds cgroup.kill to every cgroup but a hierarchy's root since
        // 5.14: without it, the commands' cgroups would be of no use.
        std::fs::metadata(dir.join("cgroup.kill")).map_err(|source| CgroupError::NoKill {
            path: dir.to_path_buf(),
            source,
        })?;
        Ok(Arc::new(Self {
            dir: dir.to_path_buf(),
            next: AtomicU64::new(1),
            in_use: Mutex::new(HashSet::new()),
        }))
    }

    /// The parent directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn in_use(&self) -> MutexGuard<'_, HashSet<u64>> {
        self.in_use.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new, empty cgroup for one command. The cgroups of earlier commands that are
    /// empty by now are removed first.
    pub fn create(self: &Arc<Self>) -> Result<ExecCgroup, CgroupError> {
        self.sweep();
        loop {
            let id = self.next.fetch_add(1, Ordering::Relaxed);
            let path = self.dir.join(id.to_string());
            let procs = path.join("cgroup.procs");
            let procs = CString::new(procs.as_os_str().as_bytes())
                .map_err(|_| CgroupError::Nul { path: procs })?;
            match std::fs::create_dir(&path) {
                Ok(()) => {}
                // Left by an earlier agent that served from the same parent (a test
                // agent on a host): take the next number.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(source) => return Err(CgroupError::Create { path, source }),
            }
            self.in_use().insert(id);
            return Ok(ExecCgroup {
                owner: self.clone(),
                id,
                path,
                procs,
            });
        }
    }

    /// Removes the cgroups no session uses that nothing runs in any more (the kernel
    /// refuses to remove the others: `EBUSY`).
    fn sweep(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let in_use = self.in_use();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(|n| n.parse::<u64>().ok()) else {
                continue;
            };
            if !in_use.contains(&id) {
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }
}

/// One command's cgroup. Dropping it removes it if nothing runs there any more;
/// otherwise a later [`ExecCgroups::create`] does, once the processes are gone.
#[derive(Debug)]
pub struct ExecCgroup {
    owner: Arc<ExecCgroups>,
    id: u64,
    path: PathBuf,
    /// `cgroup.procs`, ready for a forked child, which may not allocate.
    procs: CString,
}

impl ExecCgroup {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What a forked child calls to move into this cgroup before it runs the command.
    pub fn joiner(&self) -> CgroupJoiner {
        CgroupJoiner {
            procs: self.procs.clone(),
        }
    }

    /// Whether any process is in the cgroup (`populated` of `cgroup.events`); false
    /// when that cannot be read.
    pub fn is_populated(&self) -> bool {
        std::fs::read_to_string(self.path.join("cgroup.events"))
            .is_ok_and(|events| events.lines().any(|line| line == "populated 1"))
    }

    /// SIGKILLs every process in the cgroup, wherever it moved in the process tree.
    pub fn kill(&self) -> Result<(), CgroupError> {
        std::fs::write(self.path.join("cgroup.kill"), "1").map_err(|source| CgroupError::Kill {
            path: self.path.clone(),
            source,
        })
    }
}

impl Drop for ExecCgroup {
    fn drop(&mut self) {
        // EBUSY while processes the command left behind still run there.
        let _ = std::fs::remove_dir(&self.path);
        self.owner.in_use().remove(&self.id);
    }
}

/// Moves the calling process into a command's cgroup; see [`CgroupJoiner::join`].
#[derive(Debug, Clone)]
pub struct CgroupJoiner {
    procs: CString,
}

impl CgroupJoiner {
    /// Moves the calling process into the cgroup. Async-signal-safe (it allocates
    /// nothing), so a forked child can call it before exec, as root (before it drops
    /// its ids).
    pub fn join(&self) -> io::Result<()> {
        // SAFETY: open with a valid NUL-terminated path; returns a new descriptor or -1.
        let fd = unsafe { libc::open(self.procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // "0" is the writer itself (cgroup v2's cgroup.procs).
        // SAFETY: writes one byte from a static buffer to the descriptor opened above.
        let written = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
        let result = if written == 1 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        };
        // SAFETY: closes the descriptor opened above, which nothing else uses.
        unsafe { libc::close(fd) };
        result
    }
}

/// The cgroup v2 directory the calling process is in (its `0::` line of
/// `/proc/self/cgroup` under the mount point of its cgroup2 hierarchy), if any.
pub fn own_cgroup_dir() -> Option<PathBuf> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let own = cgroup.lines().find_map(|line| line.strip_prefix("0::"))?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount_point = cgroup2_mount_point(&mountinfo)?;
    Some(mount_point.join(own.trim_start_matches('/')))
}

/// The mount point of the cgroup2 hierarchy in a `/proc/self/mountinfo`, when one is
/// mounted at its root.
fn cgroup2_mount_point(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // ID PARENT MAJ:MIN ROOT MOUNT-POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE ...
        let (fields, fs) = line.split_once(" - ")?;
        let fields: Vec<&str> = fields.split(' ').collect();
        let fstype = fs.split(' ').next()?;
        (fstype == "cgroup2" && fields.get(3) == Some(&"/"))
            .then(|| fields.get(4).map(|m| PathBuf::from(unescape_mountinfo(m))))
            .flatten()
    })
}

/// Undoes mountinfo's octal escapes (`\040` for a space, and so on).
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|digits| {
            let text = std::str::from_utf8(digits).ok()?;
            u8::from_str_radix(text, 8).ok()
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::time::{Duration, Instant};

    #[test]
    fn the_cgroup2_mount_point_is_read_from_mountinfo() {
        let hybrid = "\
31 1 0:27 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
35 31 0:30 / /sys/fs/cgroup/memory rw shared:9 - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:10 - cgroup2 cgroup2 rw
";
        assert_eq!(
            cgroup2_mount_point(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        // A bind mount of a sub-cgroup is not the hierarchy's root.
        let container = "\
50 40 0:38 /docker/abc /sys/fs/cgroup ro - cgroup2 cgroup2 rw
51 40 0:38 / /mnt/cgroup\\040root rw - cgroup2 cgroup2 rw
";
        assert_eq!(
            cgroup2_mount_point(container),
            Some(PathBuf::from("/mnt/cgroup root"))
        );
        assert_eq!(
            cgroup2_mount_point("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"),
            None
        );
    }

    /// A writable cgroup v2 directory with cgroup.kill for this test (removed when the
    /// guard drops), or `None` where this machine has none: the test then says so.
    fn test_parent(test: &str) -> Option<TestParent> {
        let dir = own_cgroup_dir()?.join(format!("guest-agent-{test}-{}", std::process::id()));
        match ExecCgroups::open(&dir) {
            Ok(cgroups) => Some(TestParent { cgroups }),
            Err(e) => {
                eprintln!("{test}: skipped, no writable cgroup v2 here: {e}");
                None
            }
        }
    }

    struct TestParent {
        cgroups: Arc<ExecCgroups>,
    }

    impl Drop for TestParent {
        fn drop(&mut self) {
            self.cgroups.sweep();
            let _ = std::fs::remove_dir(self.cgroups.dir());
        }
    }

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A child that joined its cgroup before exec, and went to another session there,
    /// is killed with the cgroup; the cgroup it left behind is swept by the next
    /// `create`, one still in use is not.
    #[test]
    fn a_joined_command_is_killed_with_its_cgroup_which_is_then_swept() {
        let Some(parent) = test_parent("kill") else {
            return;
        };
        let cgroups = &parent.cgroups;
        let cgroup = cgroups.create().unwrap();
        assert!(!cgroup.is_populated());
        let joiner = cgroup.joiner();
        let mut sleep = std::process::Command::new("sleep");
        sleep.arg("1000");
        // SAFETY: the closure only makes async-signal-safe calls (join allocates
        // nothing, setsid is a plain system call).
        unsafe {
            sleep.pre_exec(move || {
                joiner.join()?;
                libc::setsid();
                Ok(())
            });
        }
        let mut child = sleep.spawn().unwrap();
        let procs = std::fs::read_to_string(cgroup.path().join("cgroup.procs")).unwrap();
        assert_eq!(procs.trim(), child.id().to_string());
        assert!(cgroup.is_populated());

        let path = cgroup.path().to_path_buf();
        drop(cgroup);
        assert!(path.exists(), "a populated cgroup cannot be removed");
        let in_use = cgroups.create().unwrap();
        assert!(path.exists(), "swept while the command still ran there");

        std::fs::write(path.join("cgroup.kill"), "1").unwrap();
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
        wait_until("the cgroup is empty", || {
            std::fs::read_to_string(path.join("cgroup.events"))
                .is_ok_and(|e| e.contains("populated 0"))
        });
        let next = cgroups.create().unwrap();
        assert!(!path.exists(), "an empty cgroup was not swept");
        assert!(in_use.path().exists(), "a cgroup in use was swept");
        for cgroup in [in_use, next] {
            let path = cgroup.path().to_path_buf();
            drop(cgroup);
            assert!(!path.exists(), "an empty cgroup outlived its session");
        }
    }

    #[test]
    fn kill_reaches_every_process_of_the_cgroup() {
        let Some(parent) = test_parent("kill-all") else {
            return;
        };
        let cgroup = parent.cgroups.create().unwrap();
        let joiner = cgroup.joiner();
        let mut sh = std::process::Command::new("sh");
        // A job in a session of its own, and the shell, which waits for it.
        sh.args(["-c", "setsid sleep 1000 & wait"]);
        // SAFETY: join is async-signal-safe.
        unsafe { sh.pre_exec(move || joiner.join()) };
        let mut child = sh.spawn().unwrap();
        wait_until("both processes are in the cgroup", || {
            std::fs::read_to_string(cgroup.path().join("cgroup.procs"))
                .is_ok_and(|p| p.lines().count() == 2)
        });
        cgroup.kill().unwrap();
        child.wait().unwrap();
        wait_until("the cgroup is empty", || !cgroup.is_populated());
    }
}
