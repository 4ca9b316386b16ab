//! Host-side writes into a directory the guest can write too (a share it mounts
//! read-write, such as the VM's agent homes), and reads of files the guest wrote.
//!
//! A path into such a directory is the guest's to redirect: a symlink put where the
//! host expects a directory (to the user's `~/.claude`, say), or swapped in between a
//! check and a write, would lead the host's removals, chmods and copies into the user's
//! own files. So every step here works on directory descriptors opened without
//! following symlinks, and creates with `O_EXCL`/`O_NOFOLLOW`: whatever the guest does,
//! the host only touches entries inside the directory it opened. Likewise a file the
//! host reads may be a FIFO (whose open waits for a writer) or a link to a device
//! (whose open may act: a watchdog starts): [`read_file`] opens only regular files.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags};

/// How deep the removal of a tree recurses: the guest can nest directories far deeper
/// than a recursion should follow (each level holds two descriptors open).
const MAX_DEPTH: usize = 128;

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// Opens the directory at `path`, the host's own (such as the share's root in the VM's
/// state directory): the guest can change what is inside, not where it is.
pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    Ok(rustix::fs::open(path, flags, Mode::empty())?)
}

/// Whether the directory reached from `dir` by `names`, one directory at a time and
/// no link followed, holds any entry.
pub fn holds_entries(dir: impl AsFd, names: &[&str]) -> bool {
    let mut below: Option<OwnedFd> = None;
    for name in names {
        let parent = below.as_ref().map_or(dir.as_fd(), |fd| fd.as_fd());
        match rustix::fs::openat(parent, *name, dir_flags(), Mode::empty()) {
            Ok(fd) => below = Some(fd),
            Err(_) => return false,
        }
    }
    let Some(Ok(entries)) = below.as_ref().map(rustix::fs::Dir::read_from) else {
        return false;
    };
    entries
        .flatten()
        .any(|entry| !matches!(entry.file_name().to_bytes(), b"." | b".."))
}

/// The directory `name` in `parent`, created if missing, writable by its owner (the
/// guest may have made it read-only); anything else the guest put there under that
/// name (a symlink, a file) is removed first.
pub fn ensure_dir(parent: impl AsFd, name: impl AsRef<OsStr>) -> io::Result<OwnedFd> {
    let (parent, name) = (parent.as_fd(), name.as_ref());
    for _ in 0..2 {
        match rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
        match rustix::fs::openat(parent, name, dir_flags(), Mode::empty()) {
            Ok(dir) => {
                rustix::fs::fchmod(&dir, Mode::from_raw_mode(0o755))?;
                return Ok(dir);
            }
            Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => remove(parent, name)?,
            Err(e) => return Err(e.into()),
        }
    }
    Err(io::Error::other(format!(
        "{} keeps being replaced by something other than a directory",
        name.to_string_lossy()
    )))
}

/// The contents of the regular file at `path`, of at most `max` bytes. Anything else
/// there is an error (`InvalidData`: not a regular file; `FileTooLarge`), found
/// without opening it for reading; so is a link, unless `follow_links`.
pub fn read_file(path: &Path, follow_links: bool, max: u64) -> io::Result<Vec<u8>> {
    let mut flags = OFlags::PATH | OFlags::CLOEXEC;
    if !follow_links {
        flags |= OFlags::NOFOLLOW;
    }
    let found = rustix::fs::open(path, flags, Mode::empty())?;
    read_found(&found, path, max).map(|(bytes, _)| bytes)
}

/// A file as the kernel knows it: device and inode.
pub type FileId = (u64, u64);

/// The identity of what `path` leads to (links followed), if anything.
pub fn file_id(path: &Path) -> Option<FileId> {
    let stat = rustix::fs::stat(path).ok()?;
    Some((stat.st_dev, stat.st_ino))
}

/// [`read_file`] of the entry `name` of the directory `dir`, never through a link,
/// with the identity of the file read: what a path read again later leads to can be
/// compared with it.
pub fn read_file_in(dir: impl AsFd, name: &Path, max: u64) -> io::Result<(Vec<u8>, FileId)> {
    let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let found = rustix::fs::openat(dir, name, flags, Mode::empty())?;
    read_found(&found, name, max)
}

/// The contents and identity of the file `found` (an `O_PATH` descriptor) if it is a
/// regular file of at most `max` bytes; `shown` names it in errors.
fn read_found(found: &OwnedFd, shown: &Path, max: u64) -> io::Result<(Vec<u8>, FileId)> {
    let stat = rustix::fs::fstat(found)?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: not a regular file", shown.display()),
        ));
    }
    let too_large = || {
        io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("{}: larger than {max} bytes", shown.display()),
        )
    };
    if u64::try_from(stat.st_size).map_or(true, |size| size > max) {
        return Err(too_large());
    }
    // Opened through the descriptor: the file just looked at, whatever the path leads
    // to by now.
    let reopened = format!("/proc/self/fd/{}", found.as_raw_fd());
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let file = File::from(rustix::fs::open(reopened.as_str(), flags, Mode::empty())?);
    let mut bytes = Vec::new();
    file.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(too_large());
    }
    Ok((bytes, (stat.st_dev, stat.st_ino)))
}

/// Removes the entry `name` of `parent`, a whole tree if it is a directory (even one
/// made read-only); a missing entry is not an error. A symlink is removed, never
/// followed. A tree deeper than [`MAX_DEPTH`] (the guest's to make) is not recursed
/// into past it: what lies deeper is moved up, into the directory being removed, and
/// removed in a later pass.
pub fn remove(parent: impl AsFd, name: impl AsRef<OsStr>) -> io::Result<()> {
    remove_at_depth(parent.as_fd(), name.as_ref(), 0, None, &mut 0)
}

/// Passes over a directory being removed before giving up: each moves what lies
/// [`MAX_DEPTH`] levels deeper up, so a tree of any depth the file system allows is
/// gone in this many.
const MAX_PASSES: usize = 4096;

/// `moved`: how many names [`move_up`] has used so far in this removal.
fn remove_at_depth(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    depth: usize,
    top: Option<BorrowedFd<'_>>,
    moved: &mut u64,
) -> io::Result<()> {
    match rustix::fs::unlinkat(parent, name, AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => return Ok(()),
        // A directory (EISDIR, or EPERM from some filesystems): empty it first.
        Err(rustix::io::Errno::ISDIR | rustix::io::Errno::PERM) => {}
        Err(e) => return Err(e.into()),
    }
    if let Some(top) = top.filter(|_| depth >= MAX_DEPTH) {
        return move_up(parent, name, top, moved);
    }
    let dir = match rustix::fs::openat(parent, name, dir_flags(), Mode::empty()) {
        Ok(dir) => dir,
        // Replaced by a symlink or file meanwhile: remove that instead.
        Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => {
            return remove_at_depth(parent, name, depth + 1, top, moved);
        }
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    // Our earlier copies are read-only; removing their entries needs write access.
    rustix::fs::fchmod(&dir, Mode::from_raw_mode(0o700))?;
    // The directory being removed takes in what lies too deep below it.
    let top = top.unwrap_or(dir.as_fd());
    for _ in 0..MAX_PASSES {
        for_each_entry(&dir, |child| {
            remove_at_depth(dir.as_fd(), child, depth + 1, Some(top), moved)
        })?;
        match rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => return Ok(()),
            // What was moved up into it, after its listing had gone past.
            Err(rustix::io::Errno::NOTEMPTY) if depth == 0 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Err(io::Error::other(format!(
        "{}: still not empty after {MAX_PASSES} passes (is something still writing there?)",
        name.to_string_lossy()
    )))
}

/// Calls `each` with the name of every entry of the directory `dir` but `.` and `..`,
/// as it is (bytes not UTF-8 included: the guest chose it), until one fails.
fn for_each_entry(dir: &OwnedFd, mut each: impl FnMut(&OsStr) -> io::Result<()>) -> io::Result<()> {
    for entry in rustix::fs::Dir::read_from(dir)? {
        let entry = entry?;
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        if name != "." && name != ".." {
            each(name)?;
        }
    }
    Ok(())
}

/// Moves the directory `name` of `parent` into `top`, under a name of its own: the
/// next of this removal's (`moved` counts them), so each move costs one rename
/// whatever the number before it (a name the guest took is passed over).
fn move_up(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    top: BorrowedFd<'_>,
    moved: &mut u64,
) -> io::Result<()> {
    loop {
        let to = format!(".vmctl-removing-{moved}");
        *moved += 1;
        match rustix::fs::renameat_with(parent, name, top, to.as_str(), RenameFlags::NOREPLACE) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => return Ok(()),
            Err(rustix::io::Errno::EXIST) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Bounds on a copy from where a guest may write: it can make the tree as large or as
/// deep as it likes, and the copy lands on the host's disk.
#[derive(Debug, Clone, Copy)]
pub struct CopyLimits {
    /// Bytes of file contents, all files together.
    pub bytes: u64,
    /// Entries (files, links, directories), all together.
    pub entries: u64,
}

/// What a copy left out of what it found: how many entries, and why for the first
/// few ([`LeftOut::REASONS_KEPT`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LeftOut {
    pub count: u64,
    pub reasons: Vec<String>,
}

impl LeftOut {
    pub const REASONS_KEPT: usize = 3;

    fn add(&mut self, name: &OsStr, why: impl std::fmt::Display) {
        self.count += 1;
        if self.reasons.len() < Self::REASONS_KEPT {
            // The name is the guest's when the directory is in a share: on one line.
            let name = crate::terminal::one_line(&name.to_string_lossy()).into_owned();
            self.reasons.push(format!("{name}: {why}"));
        }
    }
}

/// Copies `from` (a file, a symlink or a directory tree, whose symlinks are copied as
/// links, never followed) to the new entry `name` of `parent`, read-only: files 0444,
/// directories 0555, within `limits`. `name` must not exist yet ([`remove`]).
///
/// The source may lie where a guest can write too (the user's skills directory shared
/// into some VM), so it is read as the target is written: from the directory holding
/// `from` (the user's own path) down, one directory descriptor at a time, no link
/// followed. A guest that swaps a directory for a link to `~/.ssh` between its
/// listing and its copy gets nothing copied for it: an entry that is no longer what
/// it was listed as, or vanished, is skipped. What such a guest can make unreadable or
/// too large (no permission, a socket swapped in, past [`MAX_DEPTH`] or `limits`) is
/// left out and told in the result, never an error: that guest must not be able to
/// stop the copies of every VM. Sockets, FIFOs and devices are not instructions:
/// skipped. Errors are the host's own (the source's top, the target).
pub fn copy_read_only(
    from: &Path,
    parent: impl AsFd,
    name: impl AsRef<OsStr>,
    limits: CopyLimits,
) -> io::Result<LeftOut> {
    let (Some(source_dir), Some(source_name)) = (from.parent(), from.file_name()) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: not a file or directory to copy", from.display()),
        ));
    };
    let source_dir = open_dir(source_dir)?;
    copy_read_only_at(source_dir.as_fd(), source_name, parent, name, limits)
}

/// [`copy_read_only`] of the entry `source_name` of the directory `source_dir`.
pub fn copy_read_only_at(
    source_dir: BorrowedFd<'_>,
    source_name: &OsStr,
    parent: impl AsFd,
    name: impl AsRef<OsStr>,
    limits: CopyLimits,
) -> io::Result<LeftOut> {
    let source = Entry {
        dir: source_dir,
        name: source_name,
    };
    let mut copy = Copy {
        bytes_left: limits.bytes,
        entries_left: limits.entries,
        left_out: LeftOut::default(),
    };
    copy.entry(source, parent.as_fd(), name.as_ref(), 0)?;
    Ok(copy.left_out)
}

/// Where the link `link` leads, one step: the directory holding its target, opened
/// without following any link on the way there, and the target's name in it. For the
/// user's own links to their dotfiles (`~/.claude/CLAUDE.md` made by stow), whose
/// target a guest may be able to write: a link the guest put on the way (to
/// `~/.ssh`) fails the open with `ELOOP` rather than be followed, and the target
/// itself, if a link, is for the caller to take as one. `Ok(None)`: `link` is no
/// link.
pub fn open_link_target(link: &Path) -> io::Result<Option<(OwnedFd, std::ffi::OsString)>> {
    let (Some(dir), Some(name)) = (link.parent(), link.file_name()) else {
        return Ok(None);
    };
    let dir = open_dir(dir)?;
    let target = match rustix::fs::readlinkat(&dir, name, Vec::new()) {
        Ok(target) => target,
        Err(rustix::io::Errno::INVAL) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let target = Path::new(OsStr::from_bytes(target.as_bytes()));
    let Some(target_name) = target.file_name() else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("it leads to {}, which names no file", target.display()),
        ));
    };
    let target_dir = match target.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let opened = rustix::fs::openat2(
        &dir,
        target_dir,
        dir_flags(),
        Mode::empty(),
        rustix::fs::ResolveFlags::NO_SYMLINKS,
    )?;
    Ok(Some((opened, target_name.to_owned())))
}

/// An entry of a directory the host holds open.
#[derive(Clone, Copy)]
struct Entry<'a> {
    dir: BorrowedFd<'a>,
    name: &'a OsStr,
}

/// A copy under way: what is left of its limits, what it left out.
struct Copy {
    bytes_left: u64,
    entries_left: u64,
    left_out: LeftOut,
}

impl Copy {
    /// What reading the source entry `name` gave, if it gave something: `None` when it
    /// is gone or no longer of the kind listed (skipped without a word), or when the
    /// guest made it unreadable (no permission, a socket swapped in: left out, told).
    fn source<T>(&mut self, name: &OsStr, result: rustix::io::Result<T>) -> io::Result<Option<T>> {
        use rustix::io::Errno;
        match result {
            Ok(value) => Ok(Some(value)),
            Err(Errno::NOENT | Errno::LOOP | Errno::NOTDIR | Errno::INVAL) => Ok(None),
            Err(e @ (Errno::ACCESS | Errno::PERM | Errno::NXIO)) => {
                self.left_out.add(name, e);
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn entry(
        &mut self,
        source: Entry<'_>,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        depth: usize,
    ) -> io::Result<()> {
        if self.entries_left == 0 {
            self.left_out.add(name, "past the copy's limit on entries");
            return Ok(());
        }
        self.entries_left -= 1;
        let found = rustix::fs::statat(source.dir, source.name, AtFlags::SYMLINK_NOFOLLOW);
        let Some(stat) = self.source(name, found)? else {
            return Ok(());
        };
        match FileType::from_raw_mode(stat.st_mode) {
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(source.dir, source.name, Vec::new());
                let Some(target) = self.source(name, target)? else {
                    return Ok(());
                };
                rustix::fs::symlinkat(OsStr::from_bytes(target.as_bytes()), parent, name)?;
            }
            FileType::Directory => {
                if depth >= MAX_DEPTH {
                    self.left_out.add(
                        name,
                        format_args!("nested deeper than {MAX_DEPTH} directories"),
                    );
                    return Ok(());
                }
                let opened =
                    rustix::fs::openat(source.dir, source.name, dir_flags(), Mode::empty());
                let Some(listed) = self.source(name, opened)? else {
                    return Ok(());
                };
                rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o700))?;
                let copy = rustix::fs::openat(parent, name, dir_flags(), Mode::empty())?;
                for_each_entry(&listed, |child| {
                    let source = Entry {
                        dir: listed.as_fd(),
                        name: child,
                    };
                    self.entry(source, copy.as_fd(), child, depth + 1)
                })?;
                rustix::fs::fchmod(&copy, Mode::from_raw_mode(0o555))?;
            }
            FileType::RegularFile => {
                // Non-blocking: a FIFO swapped in meanwhile must not hold the copy up
                // (it is then skipped, as what is open is no regular file).
                let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
                let opened = rustix::fs::openat(source.dir, source.name, flags, Mode::empty());
                let Some(file) = self.source(name, opened)?.map(File::from) else {
                    return Ok(());
                };
                let stat = rustix::fs::fstat(&file)?;
                if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
                    return Ok(());
                }
                // The size looked at, not what the file grows to while it is copied.
                let size = u64::try_from(stat.st_size).unwrap_or(0);
                if size > self.bytes_left {
                    self.left_out.add(
                        name,
                        format_args!("{size} bytes, past the copy's limit on bytes"),
                    );
                    return Ok(());
                }
                let mut copied = 0;
                create_read_only(parent, name, |to| {
                    copied = io::copy(&mut (&file).take(size), to)?;
                    Ok(())
                })?;
                self.bytes_left -= copied;
            }
            _ => {}
        }
        Ok(())
    }
}

/// Writes `bytes` as the file `name` of `parent`, read-only (0444), replacing
/// whatever the guest put there under that name (a symlink is removed, not followed).
pub fn write_read_only(parent: impl AsFd, name: impl AsRef<OsStr>, bytes: &[u8]) -> io::Result<()> {
    let (parent, name) = (parent.as_fd(), name.as_ref());
    remove(parent, name)?;
    create_read_only(parent, name, |file| io::Write::write_all(file, bytes))
}

/// Whether `name` of `parent` is already what [`write_read_only`] of `bytes` would
/// leave: a read-only (0444) regular file holding exactly them. Writing it again would
/// only make the guest see an edit (and git, for a moment, no such file).
pub fn holds_read_only(parent: impl AsFd, name: impl AsRef<OsStr>, bytes: &[u8]) -> bool {
    let (parent, name) = (parent.as_fd(), name.as_ref());
    let read_only = rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW)
        .is_ok_and(|stat| stat.st_mode & 0o7777 == 0o444);
    read_only
        && read_file_in(parent, Path::new(name), bytes.len() as u64)
            .is_ok_and(|(held, _)| held == bytes)
}

/// Creates the new file `name` of `parent` (never through a symlink: `O_EXCL`), lets
/// `fill` write it, then makes it read-only (0444).
fn create_read_only(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    fill: impl FnOnce(&mut &File) -> io::Result<()>,
) -> io::Result<()> {
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let file = File::from(rustix::fs::openat(
        parent,
        name,
        flags,
        Mode::from_raw_mode(0o600),
    )?);
    fill(&mut &file)?;
    rustix::fs::fchmod(&file, Mode::from_raw_mode(0o444))?;
    Ok(())
}

/// Whether the entry `name` of `dir` looks like a copy [`copy_read_only`] made: a link,
/// or without write permission for anyone (never followed; false when not there).
pub fn looks_copied(dir: impl AsFd, name: impl AsRef<OsStr>) -> bool {
    rustix::fs::statat(dir.as_fd(), name.as_ref(), AtFlags::SYMLINK_NOFOLLOW).is_ok_and(|stat| {
        FileType::from_raw_mode(stat.st_mode) == FileType::Symlink || stat.st_mode & 0o222 == 0
    })
}

/// Makes a FIFO at `path`: what a guest can put where the host expects a file.
#[cfg(test)]
pub(crate) fn make_fifo(path: &Path) {
    let mode = Mode::from_raw_mode(0o600);
    rustix::fs::mknodat(rustix::fs::CWD, path, FileType::Fifo, mode, 0).expect("mkfifo");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, FileTypeExt, PermissionsExt};

    #[test]
    fn only_regular_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, "text").unwrap();
        assert_eq!(read_file(&file, false, 4).unwrap(), b"text");
        let kind =
            |path: &Path, follow: bool, max: u64| read_file(path, follow, max).unwrap_err().kind();
        assert_eq!(kind(&file, false, 3), io::ErrorKind::FileTooLarge);

        let link = dir.path().join("link");
        symlink(&file, &link).unwrap();
        assert_eq!(read_file(&link, true, 4).unwrap(), b"text");
        assert_eq!(kind(&link, false, 4), io::ErrorKind::InvalidData);

        // Neither waits for a writer nor opens a device for reading.
        let fifo = dir.path().join("fifo");
        make_fifo(&fifo);
        let device = dir.path().join("device");
        symlink("/dev/null", &device).unwrap();
        for odd in [&fifo, &device, &dir.path().to_path_buf()] {
            assert_eq!(kind(odd, true, 4096), io::ErrorKind::InvalidData, "{odd:?}");
        }
        assert_eq!(
            kind(&dir.path().join("missing"), true, 4),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn a_written_file_replaces_a_guests_symlink_without_following_it() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "the user's own\n").unwrap();
        let shared = dir.path().join("shared");
        std::fs::create_dir_all(&shared).unwrap();
        symlink(&victim, shared.join("gitconfig")).unwrap();

        write_read_only(open_dir(&shared).unwrap(), "gitconfig", b"[user]\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            "the user's own\n"
        );
        let written = shared.join("gitconfig");
        assert!(!written.is_symlink());
        assert_eq!(std::fs::read_to_string(&written).unwrap(), "[user]\n");
        // Written again over its own read-only copy.
        write_read_only(open_dir(&shared).unwrap(), "gitconfig", b"[init]\n").unwrap();
        assert_eq!(std::fs::read_to_string(&written).unwrap(), "[init]\n");
    }

    #[test]
    fn only_the_very_file_written_counts_as_held() {
        let dir = tempfile::tempdir().unwrap();
        let shared = open_dir(dir.path()).unwrap();
        assert!(
            !holds_read_only(&shared, "gitconfig", b"[user]\n"),
            "none yet"
        );
        write_read_only(&shared, "gitconfig", b"[user]\n").unwrap();
        assert!(holds_read_only(&shared, "gitconfig", b"[user]\n"));
        assert!(
            !holds_read_only(&shared, "gitconfig", b"[user]\n\n"),
            "longer"
        );
        assert!(
            !holds_read_only(&shared, "gitconfig", b"[init]\n"),
            "other bytes"
        );
        let path = dir.path().join("gitconfig");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(
            !holds_read_only(&shared, "gitconfig", b"[user]\n"),
            "made writable"
        );
        std::fs::remove_file(&path).unwrap();
        std::fs::write(dir.path().join("elsewhere"), "[user]\n").unwrap();
        std::fs::set_permissions(
            dir.path().join("elsewhere"),
            std::fs::Permissions::from_mode(0o444),
        )
        .unwrap();
        symlink(dir.path().join("elsewhere"), &path).unwrap();
        assert!(
            !holds_read_only(&shared, "gitconfig", b"[user]\n"),
            "a link"
        );
    }

    fn mode(path: &Path) -> u32 {
        std::fs::symlink_metadata(path)
            .unwrap()
            .permissions()
            .mode()
            & 0o777
    }

    const NO_LIMITS: CopyLimits = CopyLimits {
        bytes: u64::MAX,
        entries: u64::MAX,
    };

    /// What a guest can make of a source it writes (too large, too many entries, too
    /// deep) is left out and told, never an error, and never copied past the limits.
    #[test]
    fn a_copy_keeps_to_its_limits_and_tells_what_it_left_out() {
        let tmp = tempfile::tempdir().unwrap();
        let from = tmp.path().join("from");
        std::fs::create_dir(&from).unwrap();
        std::fs::write(from.join("small"), "1234").unwrap();
        std::fs::write(from.join("large"), vec![b'x'; 4096]).unwrap();
        let to = tmp.path().join("to");
        std::fs::create_dir(&to).unwrap();
        let copy = |name: &str, limits| copy_read_only(&from, open_dir(&to).unwrap(), name, limits);

        let left_out = copy(
            "bytes",
            CopyLimits {
                bytes: 100,
                entries: 10,
            },
        )
        .unwrap();
        assert_eq!(left_out.count, 1);
        assert!(
            left_out.reasons[0].starts_with("large: 4096 bytes"),
            "{left_out:?}"
        );
        assert_eq!(std::fs::read(to.join("bytes/small")).unwrap(), b"1234");
        assert!(!to.join("bytes/large").exists());

        // A name the guest chose (the directory may be in a share) is told on one line.
        let forged = tmp.path().join("forged");
        std::fs::create_dir(&forged).unwrap();
        std::fs::write(forged.join("x\nvmctl: all is well"), vec![b'x'; 4096]).unwrap();
        let limits = CopyLimits {
            bytes: 100,
            entries: 10,
        };
        let left_out = copy_read_only(&forged, open_dir(&to).unwrap(), "forged", limits).unwrap();
        assert_eq!(left_out.reasons.len(), 1, "{left_out:?}");
        assert!(
            left_out.reasons[0].starts_with("x\\nvmctl: all is well: 4096 bytes"),
            "{left_out:?}"
        );

        // The directory itself and one file.
        let left_out = copy(
            "entries",
            CopyLimits {
                bytes: u64::MAX,
                entries: 2,
            },
        )
        .unwrap();
        assert_eq!(left_out.count, 1, "{left_out:?}");
        assert_eq!(std::fs::read_dir(to.join("entries")).unwrap().count(), 1);

        let mut deep = from.clone();
        for _ in 0..MAX_DEPTH + 5 {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        let left_out = copy("deep", NO_LIMITS).unwrap();
        assert_eq!(left_out.count, 1, "{left_out:?}");
        assert!(
            left_out.reasons[0].contains("nested deeper than"),
            "{left_out:?}"
        );
        assert_eq!(std::fs::read(to.join("deep/small")).unwrap(), b"1234");
    }

    /// Sockets and FIFOs are not instructions: skipped, not waited on, not told.
    #[test]
    fn sockets_and_fifos_are_skipped() {
        let tmp = tempfile::tempdir().unwrap();
        let from = tmp.path().join("from");
        std::fs::create_dir(&from).unwrap();
        make_fifo(&from.join("fifo"));
        let _listener = std::os::unix::net::UnixListener::bind(from.join("socket")).unwrap();
        std::fs::write(from.join("file"), "text").unwrap();
        let to = tmp.path().join("to");
        std::fs::create_dir(&to).unwrap();
        let left_out = copy_read_only(&from, open_dir(&to).unwrap(), "copy", NO_LIMITS).unwrap();
        assert_eq!(left_out, LeftOut::default());
        let names: Vec<_> = std::fs::read_dir(to.join("copy"))
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(names, ["file"]);
    }

    #[test]
    fn a_tree_is_copied_read_only_with_its_links_as_links() {
        let tmp = tempfile::tempdir().unwrap();
        let from = tmp.path().join("from");
        std::fs::create_dir_all(from.join("sub")).unwrap();
        std::fs::write(from.join("sub/file"), "text").unwrap();
        symlink("/etc/hostname", from.join("link")).unwrap();
        let to = tmp.path().join("to");
        std::fs::create_dir(&to).unwrap();
        let left_out = copy_read_only(&from, open_dir(&to).unwrap(), "copy", NO_LIMITS).unwrap();
        assert_eq!(left_out, LeftOut::default());
        let copy = to.join("copy");
        assert_eq!(
            std::fs::read_to_string(copy.join("sub/file")).unwrap(),
            "text"
        );
        assert_eq!(
            std::fs::read_link(copy.join("link")).unwrap(),
            Path::new("/etc/hostname")
        );
        assert_eq!(mode(&copy), 0o555);
        assert_eq!(mode(&copy.join("sub")), 0o555);
        assert_eq!(mode(&copy.join("sub/file")), 0o444);
        // And removed again, read-only as it is.
        remove(open_dir(&to).unwrap(), "copy").unwrap();
        assert!(!copy.exists());
        remove(open_dir(&to).unwrap(), "copy").unwrap();
    }

    /// A source a guest can write into (the user's skills shared into a VM) is read
    /// without following a link it swaps in: while a directory of it keeps turning into
    /// a link to the user's keys and back, no copy ever holds a key. (Review: each
    /// entry was looked up again by its whole path, so a directory listed before the
    /// swap was read through the link after it.) FIFOs are left out, never waited on.
    #[test]
    fn a_source_the_guest_swaps_links_into_never_gives_it_what_they_lead_to() {
        use std::sync::atomic::{AtomicBool, Ordering};
        const KEY: &str = "-----BEGIN OPENSSH PRIVATE KEY-----";
        let tmp = tempfile::tempdir().unwrap();
        let keys = tmp.path().join("ssh");
        std::fs::create_dir(&keys).unwrap();
        let skills = tmp.path().join("skills");
        let swapped = skills.join("x");
        std::fs::create_dir_all(&swapped).unwrap();
        for i in 0..300 {
            std::fs::write(keys.join(format!("id_{i}")), KEY).unwrap();
            std::fs::write(swapped.join(format!("id_{i}")), "a skill").unwrap();
        }
        make_fifo(&skills.join("fifo"));
        let to = tmp.path().join("to");
        std::fs::create_dir(&to).unwrap();

        // Set however the copies end (a failed assertion too), or the swapping thread
        // would keep the scope from ever ending.
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let aside = skills.join("x.aside");
                while !stop.load(Ordering::Relaxed) {
                    std::fs::rename(&swapped, &aside).unwrap();
                    symlink(&keys, &swapped).unwrap();
                    std::thread::yield_now();
                    std::fs::remove_file(&swapped).unwrap();
                    std::fs::rename(&aside, &swapped).unwrap();
                }
            });
            let _stop = StopOnDrop(&stop);
            for round in 0..200 {
                let name = format!("copy{round}");
                let left_out =
                    copy_read_only(&skills, open_dir(&to).unwrap(), &name, NO_LIMITS).unwrap();
                assert_eq!(
                    left_out,
                    LeftOut::default(),
                    "what changed is skipped, not told"
                );
                for entry in walk(&to.join(&name)) {
                    let meta = std::fs::symlink_metadata(&entry).unwrap();
                    assert!(!meta.file_type().is_fifo(), "{}", entry.display());
                    if meta.is_file() {
                        let text = std::fs::read_to_string(&entry).unwrap();
                        assert_ne!(text, KEY, "{} holds a key", entry.display());
                    }
                }
            }
        });
    }

    /// Every path below `dir`, links not followed.
    fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if std::fs::symlink_metadata(&path).unwrap().is_dir() {
                found.extend(walk(&path));
            }
            found.push(path);
        }
        found
    }

    /// The guest's symlinks lead nowhere: removing one removes the link, a directory
    /// expected where it points is made in its place, and a copy does not write
    /// through one.
    #[test]
    fn the_guests_symlinks_are_never_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let users = tmp.path().join("users-dir");
        std::fs::create_dir(&users).unwrap();
        let users_mode = mode(&users);
        std::fs::write(users.join("precious"), "keep").unwrap();
        let shared = tmp.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        symlink(&users, shared.join("home")).unwrap();
        symlink(users.join("precious"), shared.join("file")).unwrap();

        let root = open_dir(&shared).unwrap();
        std::fs::create_dir(shared.join("locked")).unwrap();
        std::fs::set_permissions(shared.join("locked"), PermissionsExt::from_mode(0o500)).unwrap();
        ensure_dir(&root, "locked").unwrap();
        assert_eq!(mode(&shared.join("locked")), 0o755);
        let home = ensure_dir(&root, "home").unwrap();
        assert!(std::fs::symlink_metadata(shared.join("home"))
            .unwrap()
            .is_dir());
        remove(&home, "precious").unwrap();
        let source = tmp.path().join("source");
        std::fs::write(&source, "seeded").unwrap();
        assert!(copy_read_only(&source, &root, "file", NO_LIMITS).is_err());
        remove(&root, "file").unwrap();
        copy_read_only(&source, &root, "file", NO_LIMITS).unwrap();

        assert_eq!(
            std::fs::read_to_string(users.join("precious")).unwrap(),
            "keep"
        );
        assert_eq!(mode(&users), users_mode);
        assert_eq!(
            std::fs::read_to_string(shared.join("file")).unwrap(),
            "seeded"
        );
        assert!(open_dir(&shared.join("file")).is_err());
    }

    /// A name that is not UTF-8 (the guest's to choose) is removed like any other.
    #[test]
    fn names_that_are_not_utf8_are_removed_too() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("dir");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join(OsStr::from_bytes(b"bad\xff\xfe")), "x").unwrap();
        remove(open_dir(tmp.path()).unwrap(), "dir").unwrap();
        assert!(!dir.exists());
    }

    /// A tree several times deeper than the recursion goes (read-only, as the guest
    /// can leave it) is removed all the same.
    #[test]
    fn a_tree_nested_deeper_than_the_recursion_is_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let mut deep = tmp.path().join("deep");
        for _ in 0..3 * MAX_DEPTH + 5 {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("leaf"), "x").unwrap();
        std::fs::set_permissions(
            deep.parent().unwrap(),
            std::fs::Permissions::from_mode(0o555),
        )
        .unwrap();
        remove(open_dir(tmp.path()).unwrap(), "deep").unwrap();
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    /// Each directory moved up takes the removal's next name, one rename, whatever the
    /// number moved before. (Review: each
    /// move tried every name from the first again, and 100,000 directories at the
    /// depth limit took billions of renames.)
    #[test]
    fn each_directory_moved_up_costs_one_name() {
        let tmp = tempfile::tempdir().unwrap();
        let top = tmp.path().join("top");
        let mut deep = top.clone();
        for _ in 0..MAX_DEPTH - 1 {
            deep.push("d");
        }
        const SIBLINGS: u64 = 300;
        for i in 0..SIBLINGS {
            std::fs::create_dir_all(deep.join(format!("s{i}"))).unwrap();
        }
        let mut moved = 0;
        remove_at_depth(
            open_dir(tmp.path()).unwrap().as_fd(),
            OsStr::new("top"),
            0,
            None,
            &mut moved,
        )
        .unwrap();
        assert!(!top.exists());
        assert_eq!(moved, SIBLINGS, "one name each");
    }
}
