//! Which directory a virtiofsd really serves. virtiofsd is given its share by path,
//! and a directory on that path may lie in another VM's writable share, whose guest
//! can swap it for a link to anywhere (`/`, the home directory) just as virtiofsd
//! resolves it, and back. vmctl takes the share's identity without following links
//! before virtiofsd starts, and afterwards compares it with the root virtiofsd's
//! namespace sandbox pivoted into, before any guest is connected.

use std::io;
use std::os::fd::OwnedFd;
use std::path::{Component, Path};

use rustix::fs::{Mode, OFlags};

/// A directory as the kernel knows it: device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirId {
    dev: u64,
    ino: u64,
}

impl DirId {
    fn of(stat: &rustix::fs::Stat) -> DirId {
        DirId {
            dev: stat.st_dev,
            ino: stat.st_ino,
        }
    }
}

/// The identity of the directory at `path`, as [`open_dir_without_links`] finds it.
#[cfg(test)]
pub fn dir_id_without_links(path: &Path) -> io::Result<DirId> {
    dir_id_of(&open_dir_without_links(path)?)
}

/// The identity of the directory `dir` is open on.
pub fn dir_id_of(dir: &OwnedFd) -> io::Result<DirId> {
    Ok(DirId::of(&rustix::fs::fstat(dir)?))
}

/// Opens (`O_PATH`) the directory at `path` (absolute, without `.` or `..`), reached
/// without following any link: a link anywhere on the way fails (ENOTDIR), so does
/// `.` or `..`.
pub fn open_dir_without_links(path: &Path) -> io::Result<OwnedFd> {
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut components = path.components();
    if components.next() != Some(Component::RootDir) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not an absolute path",
        ));
    }
    let mut dir = rustix::fs::open("/", flags, Mode::empty())?;
    for component in components {
        let Component::Normal(name) = component else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a canonical path",
            ));
        };
        dir = rustix::fs::openat(&dir, name, flags, Mode::empty())?;
    }
    Ok(dir)
}

/// Where a process and its children stand, seen from here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Root {
    /// In `expected`.
    Expected,
    /// Still in our root: it has not entered its sandbox yet.
    Ours,
    /// Somewhere else.
    Other,
}

/// Whether process `pid` (or a child of it: which of them pivots into the sandbox
/// differs between virtiofsd's versions) has `expected` as its root directory. One
/// anywhere else is [`Root::Other`], whatever the rest.
pub fn root_of(pid: u32, expected: DirId) -> io::Result<Root> {
    let stat = |path: &str| rustix::fs::stat(path).map(|s| DirId::of(&s));
    let ours = stat("/proc/self/root")?;
    let mut found = Root::Ours;
    for (index, pid) in std::iter::once(pid).chain(children(pid)).enumerate() {
        let theirs = match stat(&format!("/proc/{pid}/root")) {
            Ok(theirs) => theirs,
            // A child may be gone meanwhile; the process itself must be there.
            Err(_) if index > 0 => continue,
            Err(e) => return Err(e.into()),
        };
        if theirs == expected {
            found = Root::Expected;
        } else if theirs != ours {
            return Ok(Root::Other);
        }
    }
    Ok(found)
}

/// The children of process `pid`, from each of its threads (none where the kernel
/// does not list them).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .filter_map(|pid| pid.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn a_link_on_the_way_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::create_dir_all(root.join("real/share")).unwrap();
        std::os::unix::fs::symlink(root.join("real"), root.join("link")).unwrap();
        let real = dir_id_without_links(&root.join("real/share")).unwrap();
        let meta = std::fs::metadata(root.join("real/share")).unwrap();
        assert_eq!((real.dev, real.ino), (meta.dev(), meta.ino()));
        for through_a_link in [root.join("link/share"), root.join("link")] {
            let error = dir_id_without_links(&through_a_link).unwrap_err();
            assert_eq!(
                error.raw_os_error(),
                Some(libc::ENOTDIR),
                "{through_a_link:?}"
            );
        }
        for not_canonical in [root.join("real/../real/share"), PathBuf::from("real")] {
            assert!(
                dir_id_without_links(&not_canonical).is_err(),
                "{not_canonical:?}"
            );
        }
    }

    #[test]
    fn a_process_root_is_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir_id_without_links(&dir.path().canonicalize().unwrap()).unwrap();
        let slash = dir_id_without_links(Path::new("/")).unwrap();
        let me = std::process::id();
        assert_eq!(root_of(me, slash).unwrap(), Root::Expected);
        assert_eq!(root_of(me, elsewhere).unwrap(), Root::Ours);
        // Children are looked at too.
        let mut child = crate::state::spawn_in_test(std::process::Command::new("sleep").arg("10"));
        assert!(children(me).contains(&child.id()), "{:?}", children(me));
        assert_eq!(root_of(me, slash).unwrap(), Root::Expected);
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
