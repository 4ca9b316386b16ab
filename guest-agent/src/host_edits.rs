//! Host edits, made visible to the guest's file watchers.
//!
//! virtio-fs gives the guest's kernel no word of what the host changes in a share, so
//! inotify in the guest (Node's `fs.watch`, chokidar, watchpack, Python's watchdog)
//! never fires for a host edit, and a dev server in the VM misses what the user saves
//! in the host's editor. vmctl's supervisor watches the writable shares on the host
//! and sends each change here ([`HostEdit`]); the agent then touches the path (sets its
//! times to now), which raises `IN_ATTRIB` for the guest's watchers of the file and of
//! its directory. A touch never changes content, and it moves the times only forward
//! (to the host's clock: virtiofsd sets them with `UTIME_NOW`).
//!
//! The host also sees the guest's own writes, through virtiofsd. Touching those would
//! make every edit of the guest reach its dev server twice, so the agent remembers for
//! a few seconds what guest processes wrote and leaves those paths alone. It learns
//! that from inotify in the guest, which sees the guest's changes and never the
//! host's, on each directory the host has reported a change in ([`GuestWrites`]):
//! the first guest edit in a directory may still be shown twice, the next ones are
//! not. (fanotify would see every directory at once, but the kernel opens each file
//! it reports for the listener: over virtio-fs, an open, a flush and a release sent
//! to virtiofsd for every guest write.)

use std::collections::HashMap;
use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::protocol::{EditKind, EditsShown, HostEdit};

/// How long a guest write keeps the host's report of it from being touched: the host
/// reports within a fraction of a second; the nested host's emulation is slower.
pub const GUEST_WRITE_MEMORY: Duration = Duration::from_secs(3);
/// Paths remembered at most; past that (a guest writing thousands of files a second),
/// every report counts as the guest's own for [`GUEST_WRITE_MEMORY`]: a host edit
/// missed then costs no more than without this module, a guest edit shown twice would.
const MAX_REMEMBERED: usize = 16 * 1024;
/// Directories watched at most for the guest's writes (each pins an inode in the
/// guest's memory); past that, edits in others may show twice.
const MAX_WATCHED_DIRS: usize = 8 * 1024;
/// What the guest does to a watched directory that the host will report back: file
/// writes and new, removed or renamed entries (not attribute changes: the agent's own
/// touches are those).
const GUEST_WRITE_EVENTS: u32 = libc::IN_MODIFY
    | libc::IN_CLOSE_WRITE
    | libc::IN_CREATE
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO;
const ENTRY_EVENTS: u32 =
    libc::IN_CREATE | libc::IN_DELETE | libc::IN_MOVED_FROM | libc::IN_MOVED_TO;

/// What guest processes wrote lately, by path and kind.
#[derive(Debug, Default)]
pub struct RecentWrites {
    seen: HashMap<(PathBuf, EditKind), Instant>,
    /// Until then every report counts as the guest's own (writes went unrecorded).
    all_until: Option<Instant>,
}

impl RecentWrites {
    /// Notes that a guest process changed `path` (a file's content, or a directory's
    /// entries) at `now`.
    pub fn record(&mut self, path: &Path, kind: EditKind, now: Instant) {
        if self.seen.len() >= MAX_REMEMBERED {
            self.seen
                .retain(|_, at| now.saturating_duration_since(*at) < GUEST_WRITE_MEMORY);
            if self.seen.len() >= MAX_REMEMBERED {
                self.seen.clear();
                self.lost(now);
                return;
            }
        }
        self.seen.insert((path.to_path_buf(), kind), now);
    }

    /// Notes that writes of the guest went unrecorded at `now` (a full queue).
    pub fn lost(&mut self, now: Instant) {
        self.all_until = Some(now + GUEST_WRITE_MEMORY);
    }

    /// Whether the host's report of `path` most likely is the guest's own write.
    pub fn wrote(&self, path: &Path, kind: EditKind, now: Instant) -> bool {
        if self.all_until.is_some_and(|until| now < until) {
            return true;
        }
        self.seen
            .get(&(path.to_path_buf(), kind))
            .is_some_and(|at| now.saturating_duration_since(*at) < GUEST_WRITE_MEMORY)
    }
}

/// The guest's writes in the directories it watches (inotify, read by a thread of its
/// own).
#[derive(Debug)]
pub struct GuestWrites {
    inotify: OwnedFd,
    state: Mutex<WatchState>,
}

#[derive(Debug, Default)]
struct WatchState {
    recent: RecentWrites,
    /// Each watch's directory, and when the host last reported a change in it (a
    /// count of reports, for the least recently reported to go at the limit).
    dirs: HashMap<i32, (PathBuf, u64)>,
    watched: HashMap<PathBuf, i32>,
    reports: u64,
}

impl WatchState {
    /// Notes that `dir` is watched as `wd` (a path may now lead to another directory,
    /// and a directory be known by another path: the host recreated or renamed it),
    /// and returns a watch that no path leads to any more, to remove.
    fn watching(&mut self, dir: &Path, wd: i32) -> Option<i32> {
        self.reports += 1;
        let stale = self
            .watched
            .insert(dir.to_path_buf(), wd)
            .filter(|&old| old != wd);
        if let Some(old) = stale {
            self.dirs.remove(&old);
        }
        if let Some((old_path, _)) = self.dirs.insert(wd, (dir.to_path_buf(), self.reports)) {
            if old_path != dir && self.watched.get(&old_path) == Some(&wd) {
                self.watched.remove(&old_path);
            }
        }
        stale
    }

    /// The watch the host reported a change in least recently, taken out of the
    /// tables, to make room for another.
    fn least_recently_reported(&mut self) -> Option<i32> {
        let (&wd, (path, _)) = self.dirs.iter().min_by_key(|(_, (_, at))| *at)?;
        let path = path.clone();
        self.dirs.remove(&wd);
        if self.watched.get(&path) == Some(&wd) {
            self.watched.remove(&path);
        }
        Some(wd)
    }
}

impl GuestWrites {
    /// Starts the reader thread; no directory is watched yet.
    pub fn start() -> io::Result<Arc<GuestWrites>> {
        // SAFETY: inotify_init1 takes no pointers; its result is checked below.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: inotify_init1 just returned this descriptor, which nothing else owns.
        let inotify = unsafe { OwnedFd::from_raw_fd(fd) };
        let writes = Arc::new(GuestWrites {
            inotify,
            state: Mutex::new(WatchState::default()),
        });
        let reader = writes.clone();
        std::thread::Builder::new()
            .name("guest-writes".into())
            .spawn(move || reader.record_writes())?;
        Ok(writes)
    }

    /// Watches `dir` from now on: the directory its path leads to now, which the host
    /// may have removed and made again (a `git checkout` there) since it was last
    /// reported. The kernel gives a directory already watched its watch again. At the
    /// limit, the directory reported least recently makes room: a deleted directory's
    /// watch never ends by itself (the guest holds it), and must not fill the table.
    pub fn watch(&self, dir: &Path) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        let Ok(path) = CString::new(dir.as_os_str().as_bytes()) else {
            return;
        };
        if !state.watched.contains_key(dir) && state.dirs.len() >= MAX_WATCHED_DIRS {
            if let Some(wd) = state.least_recently_reported() {
                self.remove_watch(wd);
            }
        }
        let mask =
            GUEST_WRITE_EVENTS | libc::IN_ONLYDIR | libc::IN_DONT_FOLLOW | libc::IN_EXCL_UNLINK;
        // SAFETY: `path` is NUL-terminated and lives through the call.
        let wd = unsafe { libc::inotify_add_watch(self.inotify.as_raw_fd(), path.as_ptr(), mask) };
        if wd < 0 {
            return;
        }
        if let Some(stale) = state.watching(dir, wd) {
            self.remove_watch(stale);
        }
    }

    fn remove_watch(&self, wd: i32) {
        // SAFETY: plain integers; a watch already gone only makes it fail (EINVAL).
        unsafe { libc::inotify_rm_watch(self.inotify.as_raw_fd(), wd) };
    }

    /// Whether the guest itself made the change the host reports at `path`.
    pub fn wrote(&self, path: &Path, kind: EditKind, now: Instant) -> bool {
        self.state
            .lock()
            .is_ok_and(|state| state.recent.wrote(path, kind, now))
    }

    fn record_writes(&self) {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: `buf` is writable for its whole length.
            let n =
                unsafe { libc::read(self.inotify.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            let Ok(n) = usize::try_from(n) else {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::warn!("the guest's writes are no longer watched: {e}");
                return;
            };
            let now = Instant::now();
            let Ok(mut state) = self.state.lock() else {
                return;
            };
            for event in parse_events(&buf[..n]) {
                state.note(event, now);
            }
        }
    }
}

impl WatchState {
    fn note(&mut self, event: InotifyEvent<'_>, now: Instant) {
        if event.mask & libc::IN_Q_OVERFLOW != 0 {
            self.recent.lost(now);
            return;
        }
        if event.mask & libc::IN_IGNORED != 0 {
            if let Some((dir, _)) = self.dirs.remove(&event.wd) {
                if self.watched.get(&dir) == Some(&event.wd) {
                    self.watched.remove(&dir);
                }
            }
            return;
        }
        let Some((dir, _)) = self.dirs.get(&event.wd) else {
            return;
        };
        if event.mask & ENTRY_EVENTS != 0 {
            self.recent.record(dir, EditKind::Entries, now);
        }
        if event.mask & (libc::IN_MODIFY | libc::IN_CLOSE_WRITE) != 0 && !event.name.is_empty() {
            let file = dir.join(OsStr::from_bytes(event.name));
            self.recent.record(&file, EditKind::Content, now);
        }
    }
}

/// One inotify event; `name` is empty for an event of the directory itself.
#[derive(Debug, PartialEq, Eq)]
struct InotifyEvent<'a> {
    wd: i32,
    mask: u32,
    name: &'a [u8],
}

/// Splits what one read of an inotify descriptor gave into events; a malformed tail
/// (never written by the kernel) ends the list.
fn parse_events(buf: &[u8]) -> Vec<InotifyEvent<'_>> {
    let header = std::mem::size_of::<libc::inotify_event>();
    let mut events = Vec::new();
    let mut rest = buf;
    while rest.len() >= header {
        // SAFETY: `rest` holds at least `header` bytes; the struct is plain integers,
        // valid for any bits, and read unaligned.
        let event: libc::inotify_event = unsafe { std::ptr::read_unaligned(rest.as_ptr().cast()) };
        let Some(name) = rest.get(header..header + event.len as usize) else {
            break;
        };
        let name = name.split(|b| *b == 0).next().unwrap_or_default();
        events.push(InotifyEvent {
            wd: event.wd,
            mask: event.mask,
            name,
        });
        rest = &rest[header + event.len as usize..];
    }
    events
}

/// The guest side of host edits: the writable shares' mount points, what the guest
/// wrote there lately, and each share's read-only view (see [`HostEditTarget::recheck`]).
#[derive(Debug, Default)]
pub struct HostEditTarget {
    roots: Vec<PathBuf>,
    writes: Option<Arc<GuestWrites>>,
    /// A read-only bind mount of each root (same order), where names are checked
    /// again; `None` where there is none.
    views: Vec<Option<PathBuf>>,
}

impl HostEditTarget {
    /// Touches edits below `roots` only; `writes`, when given, spares the guest's own.
    pub fn new(roots: Vec<PathBuf>, writes: Option<Arc<GuestWrites>>) -> Self {
        HostEditTarget {
            roots,
            writes,
            views: Vec::new(),
        }
    }

    /// With `views[i]`, a read-only bind mount of `roots[i]`, where the names the host
    /// removed or renamed (from or over) are checked again.
    pub fn with_views(mut self, views: Vec<Option<PathBuf>>) -> Self {
        self.views = views;
        self
    }

    /// The target for the writable shares mounted at `roots`; a guest that cannot
    /// watch its own writes still gets the touches (its own edits may then show
    /// twice), which is said.
    pub fn for_shares(roots: Vec<PathBuf>) -> Self {
        if roots.is_empty() {
            return HostEditTarget::default();
        }
        let writes = match GuestWrites::start() {
            Ok(writes) => Some(writes),
            Err(e) => {
                tracing::warn!(
                    "the guest's own writes to its shares cannot be told from the host's ({e}); file watchers in the guest may see the guest's edits twice"
                );
                None
            }
        };
        HostEditTarget::new(roots, writes)
    }

    /// Touches each edit's path unless the guest wrote it itself, and watches the
    /// directories named for the guest's writes from now on.
    pub fn show(&self, edits: &[HostEdit]) -> EditsShown {
        let now = Instant::now();
        let mut shown = EditsShown::default();
        for edit in edits.iter().filter(|edit| edit.kind == EditKind::Name) {
            self.recheck(edit.path());
        }
        for edit in edits.iter().filter(|edit| edit.kind != EditKind::Name) {
            let path = edit.path();
            let Some(located) = self.within_roots(path) else {
                shown.failed += 1;
                continue;
            };
            if let Some(writes) = &self.writes {
                if writes.wrote(path, edit.kind, now) {
                    shown.guest_own += 1;
                    continue;
                }
                let dir = match edit.kind {
                    EditKind::Entries => Some(path),
                    _ => path.parent(),
                };
                if let Some(dir) = dir.filter(|dir| dir.starts_with(located.0)) {
                    writes.watch(dir);
                }
            }
            match touch(located) {
                Ok(()) => shown.shown += 1,
                Err(e) => {
                    tracing::debug!("host edit of {}: not shown: {e}", path.display());
                    shown.failed += 1;
                }
            }
        }
        shown
    }

    /// Makes the guest's kernel ask virtiofsd about the name `path` again. virtio-fs
    /// keeps a name for a second (`auto` cache; a day with `always`): a file the host
    /// replaced (git's index, an editor's save, both written elsewhere and renamed
    /// over) would be the old one until then, and a guest git command could write back
    /// what it read there. `open(O_CREAT | O_EXCL)` has the kernel check the cached
    /// name with virtiofsd whatever its age; through the share's read-only view it can
    /// create nothing (EEXIST when the name is there, EROFS when it is gone).
    pub fn recheck(&self, path: &Path) {
        let Some(at) = self.index_within(path) else {
            return;
        };
        let (Some(Some(view)), within) = (self.views.get(at.0), at.1) else {
            return;
        };
        if within.as_os_str().is_empty() {
            return;
        }
        let checked = open_view(view).and_then(|view| {
            open_how(
                view.as_raw_fd(),
                within,
                libc::O_CREAT | libc::O_EXCL | libc::O_RDONLY | libc::O_CLOEXEC,
                libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_BENEATH,
            )
        });
        match checked {
            Ok(_) => tracing::warn!(
                "{}: checking the name again created it: the share's view is not read-only",
                path.display()
            ),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST | libc::EROFS)) => {}
            Err(e) => tracing::debug!("{}: name not checked again: {e}", path.display()),
        }
    }

    /// The writable share holding `path` (the innermost), and the plain relative path
    /// within it; `None` outside the shares or with `..` in it.
    fn within_roots<'a>(&'a self, path: &'a Path) -> Option<(&'a Path, &'a Path)> {
        let (at, within) = self.index_within(path)?;
        Some((self.roots[at].as_path(), within))
    }

    /// [`HostEditTarget::within_roots`], with the share's index.
    fn index_within<'a>(&self, path: &'a Path) -> Option<(usize, &'a Path)> {
        let (at, within) = self
            .roots
            .iter()
            .enumerate()
            .filter_map(|(at, root)| Some((at, path.strip_prefix(root).ok()?)))
            .max_by_key(|(at, _)| self.roots[*at].as_os_str().len())?;
        within
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
            .then_some((at, within))
    }
}

fn open_view(view: &Path) -> io::Result<OwnedFd> {
    open_path(libc::AT_FDCWD, view, 0)
}

/// Sets the times of `within` (below the share `root`) to now, through no symlink: the
/// host names paths, but the guest's users make the links in a share.
fn touch((root, within): (&Path, &Path)) -> io::Result<()> {
    let root = open_path(libc::AT_FDCWD, root, 0)?;
    let target = match within.as_os_str().is_empty() {
        true => root,
        false => open_path(
            root.as_raw_fd(),
            within,
            libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_BENEATH,
        )?,
    };
    let by_fd =
        CString::new(format!("/proc/self/fd/{}", target.as_raw_fd())).map_err(io::Error::other)?;
    // SAFETY: `by_fd` is a NUL-terminated path that lives through the call; a null
    // `times` means "now" and is allowed.
    let done = unsafe { libc::utimensat(libc::AT_FDCWD, by_fd.as_ptr(), std::ptr::null(), 0) };
    match done {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// openat2's `struct open_how` (libc's cannot be built outside libc).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Opens `path` (relative to `dir`) as `O_PATH`: nothing of the file is run or read.
/// `resolve` is openat2's; the root of a share is opened as named.
fn open_path(dir: RawFd, path: &Path, resolve: u64) -> io::Result<OwnedFd> {
    // Without O_NOFOLLOW: RESOLVE_NO_SYMLINKS then refuses a link at the end too.
    open_how(dir, path, libc::O_PATH | libc::O_CLOEXEC, resolve)
}

/// openat2(`dir`, `path`) with `flags` (mode 0) and `resolve`.
fn open_how(dir: RawFd, path: &Path, flags: libc::c_int, resolve: u64) -> io::Result<OwnedFd> {
    let path = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let how = OpenHow {
        flags: flags as u64,
        mode: 0,
        resolve,
    };
    // SAFETY: `path` and `how` live through the call and `how`'s size is passed;
    // the kernel returns a new descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir,
            path.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = RawFd::try_from(fd).map_err(io::Error::other)?;
    // SAFETY: openat2 just returned this descriptor, which nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_guest_write_is_its_own_for_a_while() {
        let mut recent = RecentWrites::default();
        let at = Instant::now();
        recent.record(Path::new("/w/src/a.js"), EditKind::Content, at);
        recent.record(Path::new("/w/src"), EditKind::Entries, at);
        assert!(recent.wrote(Path::new("/w/src/a.js"), EditKind::Content, at));
        assert!(recent.wrote(Path::new("/w/src"), EditKind::Entries, at));
        // Another file, and the directory's attributes, are not.
        assert!(!recent.wrote(Path::new("/w/src/b.js"), EditKind::Content, at));
        assert!(!recent.wrote(Path::new("/w/src"), EditKind::Content, at));
        let after = at + GUEST_WRITE_MEMORY;
        assert!(!recent.wrote(Path::new("/w/src/a.js"), EditKind::Content, after));
        assert!(!recent.wrote(Path::new("/w/src"), EditKind::Entries, after));
    }

    #[test]
    fn too_many_writes_count_every_report_as_the_guests() {
        let mut recent = RecentWrites::default();
        let at = Instant::now();
        let file = |i: usize| PathBuf::from(format!("/w/{i}"));
        for i in 0..MAX_REMEMBERED {
            recent.record(&file(i), EditKind::Content, at);
        }
        assert!(!recent.wrote(Path::new("/w/elsewhere"), EditKind::Content, at));
        recent.record(Path::new("/w/one-more"), EditKind::Content, at);
        assert!(recent.wrote(Path::new("/w/elsewhere"), EditKind::Content, at));
        assert!(recent.seen.is_empty());
        let after = at + GUEST_WRITE_MEMORY;
        assert!(!recent.wrote(Path::new("/w/elsewhere"), EditKind::Content, after));
        // Old entries make room instead when they can.
        for i in 0..MAX_REMEMBERED {
            recent.record(&file(i), EditKind::Content, at);
        }
        recent.record(Path::new("/w/new"), EditKind::Content, after);
        assert_eq!(recent.seen.len(), 1);
        assert!(recent.wrote(Path::new("/w/new"), EditKind::Content, after));
    }

    /// A directory the host removed and made again (a `git checkout` there) is
    /// watched anew: the guest's writes in it are told from the host's again.
    #[test]
    fn a_directory_made_again_is_watched_again() {
        let dir = tempfile::tempdir().unwrap();
        let feature = dir.path().join("feature");
        std::fs::create_dir(&feature).unwrap();
        let writes = GuestWrites::start().unwrap();
        writes.watch(&feature);
        std::fs::remove_dir(&feature).unwrap();
        std::fs::create_dir(&feature).unwrap();
        writes.watch(&feature);
        let file = feature.join("a.js");
        std::fs::write(&file, "guest\n").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !writes.wrote(&file, EditKind::Content, Instant::now()) {
            assert!(Instant::now() < deadline, "the guest's write went unseen");
            std::thread::sleep(Duration::from_millis(10));
        }
        let state = writes.state.lock().unwrap();
        assert_eq!(state.dirs.len(), 1, "{:?}", state.dirs);
        assert_eq!(state.watched.len(), 1, "{:?}", state.watched);
    }

    #[test]
    fn watches_follow_their_directories_and_the_least_recent_makes_room() {
        let mut state = WatchState::default();
        let (a, b) = (Path::new("/w/a"), Path::new("/w/b"));
        assert_eq!(state.watching(a, 1), None);
        // Made again: another watch for the path; the old one is to go.
        assert_eq!(state.watching(a, 2), Some(1));
        assert_eq!(state.dirs.keys().copied().collect::<Vec<_>>(), [2]);
        // Renamed: the same watch under its new path only.
        assert_eq!(state.watching(b, 2), None);
        assert_eq!(state.watched.get(b), Some(&2));
        assert!(!state.watched.contains_key(a));
        assert_eq!(state.watching(a, 3), None);
        // b, reported again, is now the more recent: a makes room first.
        assert_eq!(state.watching(b, 2), None);
        assert_eq!(state.least_recently_reported(), Some(3));
        assert_eq!(state.least_recently_reported(), Some(2));
        assert_eq!(state.least_recently_reported(), None);
        assert!(state.watched.is_empty());
    }

    fn raw_event(wd: i32, mask: u32, name: &[u8], padded_to: usize) -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend(wd.to_ne_bytes());
        bytes.extend(mask.to_ne_bytes());
        bytes.extend(0u32.to_ne_bytes());
        bytes.extend((padded_to as u32).to_ne_bytes());
        let mut name = name.to_vec();
        name.resize(padded_to, 0);
        bytes.extend(name);
        bytes
    }

    #[test]
    fn inotify_events_are_parsed_and_a_bad_tail_is_dropped() {
        let mut buf = raw_event(1, libc::IN_MODIFY, b"a.js", 16);
        buf.extend(raw_event(2, libc::IN_IGNORED, b"", 0));
        buf.extend(raw_event(3, libc::IN_CREATE, b"cut", 64));
        buf.truncate(buf.len() - 10);
        let events = parse_events(&buf);
        assert_eq!(
            events,
            [
                InotifyEvent {
                    wd: 1,
                    mask: libc::IN_MODIFY,
                    name: b"a.js"
                },
                InotifyEvent {
                    wd: 2,
                    mask: libc::IN_IGNORED,
                    name: b""
                },
            ]
        );
    }

    fn old_times(path: &Path) {
        let c = CString::new(path.as_os_str().as_bytes()).unwrap();
        let times = [libc::timespec {
            tv_sec: 1_000_000_000,
            tv_nsec: 0,
        }; 2];
        // SAFETY: `c` and `times` live through the call.
        let done = unsafe {
            libc::utimensat(
                libc::AT_FDCWD,
                c.as_ptr(),
                times.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        assert_eq!(done, 0, "{}", io::Error::last_os_error());
    }

    fn mtime(path: &Path) -> i64 {
        std::fs::symlink_metadata(path).unwrap().mtime()
    }

    #[test]
    fn host_edits_are_touched_but_not_through_links_or_outside_the_shares() {
        let dir = tempfile::tempdir().unwrap();
        let share = dir.path().join("share");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(share.join("src")).unwrap();
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(share.join("src/a.js"), "a").unwrap();
        std::fs::write(outside.join("secret"), "s").unwrap();
        std::os::unix::fs::symlink(&outside, share.join("link")).unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), share.join("file-link")).unwrap();
        for path in [
            share.join("src/a.js"),
            share.join("src"),
            outside.join("secret"),
        ] {
            old_times(&path);
        }
        let target = HostEditTarget::new(vec![share.clone()], None);
        let shown = target.show(&[
            HostEdit::new(&share.join("src/a.js"), EditKind::Content),
            HostEdit::new(&share.join("src"), EditKind::Entries),
            HostEdit::new(&share.join("link/secret"), EditKind::Content),
            HostEdit::new(&share.join("file-link"), EditKind::Content),
            HostEdit::new(&share.join("src/../../outside/secret"), EditKind::Content),
            HostEdit::new(&outside.join("secret"), EditKind::Content),
            HostEdit::new(&share.join("src/gone.js"), EditKind::Content),
        ]);
        assert_eq!(
            shown,
            EditsShown {
                shown: 2,
                guest_own: 0,
                failed: 5
            }
        );
        assert!(mtime(&share.join("src/a.js")) > 1_000_000_000);
        assert!(mtime(&share.join("src")) > 1_000_000_000);
        assert_eq!(mtime(&outside.join("secret")), 1_000_000_000);
    }

    /// Waits until the guest-writes thread has seen `path` change as `kind`.
    fn until_recorded(writes: &GuestWrites, path: &Path, kind: EditKind) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !writes.wrote(path, kind, Instant::now()) {
            assert!(
                Instant::now() < deadline,
                "{} was not recorded",
                path.display()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn the_guests_own_writes_in_a_reported_directory_are_not_touched() {
        let dir = tempfile::tempdir().unwrap();
        let share = dir.path().to_path_buf();
        std::fs::create_dir(share.join("src")).unwrap();
        std::fs::write(share.join("src/app.js"), "v1").unwrap();
        let writes = GuestWrites::start().unwrap();
        let target = HostEditTarget::new(vec![share.clone()], Some(writes.clone()));
        // The host's first report from src/ is shown, and src/ is watched from then on.
        let first = target.show(&[HostEdit::new(&share.join("src/app.js"), EditKind::Content)]);
        assert_eq!(first.shown, 1);
        // The guest writes there (this process stands for it): not touched again.
        std::fs::write(share.join("src/app.js"), "v2").unwrap();
        std::fs::write(share.join("src/new.js"), "new").unwrap();
        until_recorded(&writes, &share.join("src/app.js"), EditKind::Content);
        until_recorded(&writes, &share.join("src/new.js"), EditKind::Content);
        until_recorded(&writes, &share.join("src"), EditKind::Entries);
        old_times(&share.join("src/app.js"));
        let echo = target.show(&[
            HostEdit::new(&share.join("src/app.js"), EditKind::Content),
            HostEdit::new(&share.join("src"), EditKind::Entries),
            HostEdit::new(&share.join("src/new.js"), EditKind::Content),
        ]);
        assert_eq!(
            echo,
            EditsShown {
                shown: 0,
                guest_own: 3,
                failed: 0
            }
        );
        assert_eq!(mtime(&share.join("src/app.js")), 1_000_000_000);
        // The agent's own touches are no guest writes: the next host edit is shown.
        std::thread::sleep(GUEST_WRITE_MEMORY);
        let next = target.show(&[HostEdit::new(&share.join("src/app.js"), EditKind::Content)]);
        assert_eq!(next.shown, 1);
        // A directory never reported is not watched: its writes are not known.
        std::fs::create_dir(share.join("other")).unwrap();
        std::fs::write(share.join("other/x.js"), "x").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!writes.wrote(&share.join("other/x.js"), EditKind::Content, Instant::now()));
    }
}
