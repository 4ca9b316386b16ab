//! A cgroup (v2) for each command, so that everything it started can be killed at
//! once (`cgroup.kill`) when its client goes away: also the processes that left its
//! process group (`setsid`, a shell's jobs in groups of their own), which a signal to
//! the group does not reach.
//!
//! The cgroups are numbered directories of one parent ([`GUEST_DIR`] in the VM). A
//! command's cgroup is removed when its session ends, or, when processes it left
//! behind still run there, by the first command started after they are gone; with
//! the cgroups a command (as root) made under it, once nothing runs in any of them.

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
    /// The numbers of the cgroups whose sessions still run, and of those being made:
    /// never swept, even while empty (a command about to join its cgroup). A number
    /// is taken here (from `next`) before its directory exists, under this lock; a
    /// sweep takes, under it, this set and `next`, and removes only numbers below
    /// that: so no sweep, however concurrent, removes a cgroup a command is about to
    /// join, and none holds the lock through its removals.
    in_use: Mutex<HashSet<u64>>,
    /// Run by [`ExecCgroups::create`] once the new cgroup's directory exists: the
    /// tests' stand-in for another command's `create` that sweeps just then.
    #[cfg(test)]
    after_mkdir: Option<fn(&ExecCgroups)>,
    /// Run by a sweep before each removal it tries.
    #[cfg(test)]
    before_removal: Option<fn(&ExecCgroups)>,
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
            #[cfg(test)]
            after_mkdir: None,
            #[cfg(test)]
            before_removal: None,
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
    /// empty by now are removed first. A parent that root removed while it was empty
    /// is made again.
    pub fn create(self: &Arc<Self>) -> Result<ExecCgroup, CgroupError> {
        self.sweep();
        let mut parent_made_again = false;
        loop {
            let id = self.reserve();
            let path = self.dir.join(id.to_string());
            let procs = path.join("cgroup.procs");
            let Ok(procs) = CString::new(procs.as_os_str().as_bytes()) else {
                self.release(id);
                return Err(CgroupError::Nul { path: procs });
            };
            match std::fs::create_dir(&path) {
                Ok(()) => {}
                // Left by an earlier agent that served from the same parent (a test
                // agent on a host): take the next number.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    self.release(id);
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound && !parent_made_again => {
                    self.release(id);
                    parent_made_again = true;
                    self.make_parent_again()?;
                    continue;
                }
                Err(source) => {
                    self.release(id);
                    return Err(CgroupError::Create { path, source });
                }
            }
            #[cfg(test)]
            if let Some(after_mkdir) = self.after_mkdir {
                after_mkdir(self);
            }
            return Ok(ExecCgroup {
                owner: self.clone(),
                id,
                path,
                procs,
            });
        }
    }

    /// A number of a cgroup no sweep removes from now on (see `in_use`).
    fn reserve(&self) -> u64 {
        let mut in_use = self.in_use();
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        in_use.insert(id);
        id
    }

    fn release(&self, id: u64) {
        self.in_use().remove(&id);
    }

    /// Makes the parent again (root removed it: `rmdir /sys/fs/cgroup/vmctl-exec`
    /// works while it is empty), so that every later command is not left without a
    /// cgroup, and warned of.
    fn make_parent_again(&self) -> Result<(), CgroupError> {
        match std::fs::create_dir(&self.dir) {
            Ok(()) => {
                tracing::warn!(
                    "{} was removed; made again for the commands' cgroups",
                    self.dir.display()
                );
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(source) => Err(CgroupError::Create {
                path: self.dir.clone(),
                source,
            }),
        }
    }

    /// Removes the cgroups no session uses that nothing runs in any more, with the
    /// cgroups made under them (the kernel refuses to remove the others: `EBUSY`).
    fn sweep(&self) {
        // Numbers from `reserved_below` on are taken after this: their cgroups, made
        // or being made, are not this sweep's to judge. The lock is not held through
        // the removals, which a session ending meanwhile would wait for on the agent's
        // one runtime thread.
        let (in_use, reserved_below) = {
            let in_use = self.in_use();
            (in_use.clone(), self.next.load(Ordering::Relaxed))
        };
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(|n| n.parse::<u64>().ok()) else {
                continue;
            };
            if id < reserved_below && !in_use.contains(&id) {
                #[cfg(test)]
                if let Some(before_removal) = self.before_removal {
                    before_removal(self);
                }
                let _ = remove_unless_populated(&entry.path());
            }
        }
    }
}

/// Removes the cgroup `path` unless a process runs in it or below it, with the cgroups
/// below it (made by a command that ran as root: a container runtime, `systemd-run`),
/// which the kernel wants removed first. `Ok` when it is gone.
fn remove_unless_populated(path: &Path) -> io::Result<()> {
    match std::fs::remove_dir(path) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        // EBUSY: processes run in it, or it has children.
        Err(e) if e.raw_os_error() != Some(libc::EBUSY) => return Err(e),
        Err(e) if populated(path) != Some(false) => return Err(e),
        Err(_) => {}
    }
    remove_tree(path)
}

/// Whether any process runs in the cgroup `path` or below it (`populated` of its
/// `cgroup.events`); `None` when that cannot be read.
fn populated(path: &Path) -> Option<bool> {
    let events = std::fs::read_to_string(path.join("cgroup.events")).ok()?;
    events.lines().find_map(|line| match line {
        "populated 1" => Some(true),
        "populated 0" => Some(false),
        _ => None,
    })
}

/// Removes the cgroup `root` and every cgroup below it, each after its children
/// (their interface files go with them). Without recursion: a command may nest
/// cgroups deeper than the agent's stack would allow.
fn remove_tree(root: &Path) -> io::Result<()> {
    let mut pending = vec![(root.to_path_buf(), false)];
    while let Some((dir, children_pending)) = pending.pop() {
        if children_pending {
            match std::fs::remove_dir(&dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => continue,
            }
        }
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        pending.push((dir, true));
        for entry in entries {
            let entry = entry?;
            if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                pending.push((entry.path(), false));
            }
        }
    }
    Ok(())
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
        populated(&self.path) == Some(true)
    }

    /// Whether the process `pid` (a zombie too) is in this cgroup, as its
    /// `/proc/PID/cgroup` says: the parent's check that its child joined.
    pub fn holds(&self, pid: u32) -> io::Result<bool> {
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
        Ok(names_cgroup(&cgroups, &self.path))
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
        // Fails while processes the command left behind still run there.
        let _ = remove_unless_populated(&self.path);
        self.owner.release(self.id);
    }
}

/// Whether the cgroup v2 line (`0::PATH`) of a `/proc/PID/cgroup` names the cgroup
/// directory `dir` (`PATH` is `dir` under the hierarchy's mount point). A removed
/// cgroup's path has ` (deleted)` after it: not `dir` any more.
fn names_cgroup(proc_cgroup: &str, dir: &Path) -> bool {
    let Some(path) = proc_cgroup
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
    else {
        return false;
    };
    let path = path.trim_start_matches('/');
    // "/", the root, would match any directory.
    !path.is_empty() && dir.ends_with(path)
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

/// What the tests of the agent that need real cgroups share.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use std::io::Write;
    use std::time::{Duration, Instant};

    /// A writable cgroup v2 directory with cgroup.kill for the test `test`, removed
    /// with what runs there when the guard drops; `None` where this machine has none
    /// (see [`not_run`]).
    pub(crate) fn test_parent(test: &str) -> Option<TestParent> {
        let Some(own) = own_cgroup_dir() else {
            not_run(test, "this process is in no cgroup v2 hierarchy");
            return None;
        };
        let dir = own.join(format!("guest-agent-{test}-{}", std::process::id()));
        match ExecCgroups::open(&dir) {
            Ok(cgroups) => Some(TestParent { cgroups }),
            Err(e) => {
                not_run(test, &e.to_string());
                None
            }
        }
    }

    /// [`crate::not_run`] for want of a writable cgroup v2, which CI's machines have.
    fn not_run(test: &str, why: &str) {
        crate::not_run(
            test,
            &format!("it needs a writable cgroup v2 directory, and there is none here ({why})"),
        );
    }

    pub(crate) struct TestParent {
        pub(crate) cgroups: Arc<ExecCgroups>,
    }

    impl Drop for TestParent {
        fn drop(&mut self) {
            let dir = self.cgroups.dir();
            let deadline = Instant::now() + Duration::from_secs(5);
            let entries = std::fs::read_dir(dir).into_iter().flatten().flatten();
            for entry in entries.filter(|entry| entry.file_type().is_ok_and(|t| t.is_dir())) {
                // Whatever a failed test left running there.
                let _ = std::fs::write(entry.path().join("cgroup.kill"), "1");
                while remove_unless_populated(&entry.path()).is_err() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            if let Err(e) = std::fs::remove_dir(dir) {
                let _ = writeln!(
                    std::io::stderr(),
                    "cannot remove the test's cgroup {}: {e}",
                    dir.display()
                );
            }
        }
    }

    pub(crate) fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

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

    use test_support::{test_parent, wait_until};

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

    /// A child of `sleep 1000` that joined `cgroup` before exec.
    fn sleeper_in(cgroup: &ExecCgroup) -> std::process::Child {
        let joiner = cgroup.joiner();
        let mut sleep = std::process::Command::new("sleep");
        sleep.arg("1000");
        // SAFETY: join is async-signal-safe.
        unsafe { sleep.pre_exec(move || joiner.join()) };
        sleep.spawn().unwrap()
    }

    /// Another command's `create` sweeps just after this one made its cgroup and
    /// before its command joined: the cgroup stays. (Review: the number was taken
    /// after the directory was made, so that sweep removed it, and the command ran
    /// outside any cgroup unnoticed.)
    #[test]
    fn a_concurrent_sweep_leaves_a_cgroup_that_is_being_made() {
        let Some(mut parent) = test_parent("concurrent-sweep") else {
            return;
        };
        let Some(cgroups) = Arc::get_mut(&mut parent.cgroups) else {
            panic!("the test's cgroups are shared already");
        };
        cgroups.after_mkdir = Some(|cgroups| {
            std::thread::scope(|scope| {
                scope.spawn(|| cgroups.sweep());
            })
        });
        let cgroup = parent.cgroups.create().unwrap();
        assert!(
            cgroup.path().is_dir(),
            "a sweep removed {} before its command could join it",
            cgroup.path().display()
        );
        let mut child = sleeper_in(&cgroup);
        assert!(cgroup.holds(child.id()).unwrap());
        cgroup.kill().unwrap();
        child.wait().unwrap();
    }

    /// A sweep's removals run without the lock a command's `create` and a session's
    /// end take (review: a slow sweep made every session ending meanwhile wait).
    #[test]
    fn a_sweep_removes_without_holding_the_lock() {
        let Some(mut parent) = test_parent("sweep-unlocked") else {
            return;
        };
        let Some(cgroups) = Arc::get_mut(&mut parent.cgroups) else {
            panic!("the test's cgroups are shared already");
        };
        cgroups.before_removal = Some(|cgroups| {
            assert!(
                cgroups.in_use.try_lock().is_ok(),
                "the sweep holds the lock through its removals"
            );
        });
        let ended = parent.cgroups.create().unwrap();
        let (ended_id, ended_path) = (ended.id, ended.path().to_path_buf());
        // Left behind as by a session whose processes outlived it: the sweep's to remove.
        std::mem::forget(ended);
        parent.cgroups.release(ended_id);
        let _next = parent.cgroups.create().unwrap();
        assert!(
            !ended_path.exists(),
            "{} was not swept",
            ended_path.display()
        );
    }

    /// The parent's check after spawn: a child that joined is in the cgroup, zombie
    /// or not; one that did not is not.
    #[test]
    fn holds_tells_whether_a_child_joined() {
        let Some(parent) = test_parent("holds") else {
            return;
        };
        let cgroup = parent.cgroups.create().unwrap();
        let mut joined = sleeper_in(&cgroup);
        let mut outside = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        assert!(cgroup.holds(joined.id()).unwrap());
        assert!(!cgroup.holds(outside.id()).unwrap());
        cgroup.kill().unwrap();
        wait_until("the joined child is a zombie", || {
            std::fs::read_to_string(format!("/proc/{}/stat", joined.id())).is_ok_and(|stat| {
                stat.rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with('Z'))
            })
        });
        assert!(
            cgroup.holds(joined.id()).unwrap(),
            "a zombie left its cgroup"
        );
        joined.wait().unwrap();
        outside.kill().unwrap();
        outside.wait().unwrap();
    }

    #[test]
    fn the_cgroup_v2_line_names_the_directory_under_the_mount_point() {
        let dir = Path::new("/sys/fs/cgroup/vmctl-exec/7");
        assert!(names_cgroup("0::/vmctl-exec/7\n", dir));
        assert!(names_cgroup("1:name=systemd:/\n0::/vmctl-exec/7\n", dir));
        assert!(!names_cgroup("0::/vmctl-exec/17\n", dir));
        assert!(!names_cgroup("0::/vmctl-exec/7/inner\n", dir));
        assert!(!names_cgroup("0::/\n", dir), "the root");
        assert!(!names_cgroup("0::/vmctl-exec/7 (deleted)\n", dir));
        assert!(
            !names_cgroup("1:name=systemd:/vmctl-exec/7\n", dir),
            "a v1 line"
        );
    }

    /// A root command made cgroups under its own (a container runtime would): once
    /// nothing runs in any of them, they go, deepest first, and the command's with
    /// them; not while something still runs in the deepest.
    #[test]
    fn cgroups_made_under_a_commands_go_once_nothing_runs_there() {
        let Some(parent) = test_parent("nested") else {
            return;
        };
        let cgroups = &parent.cgroups;
        let cgroup = cgroups.create().unwrap();
        let path = cgroup.path().to_path_buf();
        let deepest = path.join("runtime/container/init");
        std::fs::create_dir_all(&deepest).unwrap();
        std::fs::create_dir(path.join("other")).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        std::fs::write(deepest.join("cgroup.procs"), child.id().to_string()).unwrap();
        assert!(cgroup.is_populated());

        drop(cgroup);
        let next = cgroups.create().unwrap();
        assert!(deepest.is_dir(), "removed while a process ran there");
        assert!(
            path.join("other").is_dir(),
            "removed while a process ran in its sibling"
        );

        child.kill().unwrap();
        child.wait().unwrap();
        wait_until("nothing runs there", || populated(&path) == Some(false));
        drop(next);
        let last = cgroups.create().unwrap();
        assert!(
            !path.exists(),
            "a cgroup with children nothing runs in was not swept"
        );
        let last_path = last.path().to_path_buf();
        std::fs::create_dir_all(last_path.join("a/b")).unwrap();
        drop(last);
        assert!(
            !last_path.exists(),
            "an ended session's cgroup with children stayed"
        );
    }

    /// Root removed the parent while it was empty: the next command's cgroup is made
    /// in it all the same, made again.
    #[test]
    fn a_removed_parent_is_made_again() {
        let Some(parent) = test_parent("parent-removed") else {
            return;
        };
        let cgroups = &parent.cgroups;
        drop(cgroups.create().unwrap());
        std::fs::remove_dir(cgroups.dir()).unwrap();
        let cgroup = cgroups.create().unwrap();
        assert!(cgroup.path().is_dir());
        let mut child = sleeper_in(&cgroup);
        assert!(cgroup.holds(child.id()).unwrap());
        cgroup.kill().unwrap();
        child.wait().unwrap();
    }
}
