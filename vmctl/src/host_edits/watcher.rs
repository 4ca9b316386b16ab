//! A recursive inotify watch over host directories, read as batches of changes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{OsStr, OsString};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use guest_agent::protocol::EditKind;
use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags};

/// The events of a watched directory that matter to a guest's file watchers. Each
/// directory is watched through a descriptor opened without following links (see
/// [`open_directory_at`]), so the watch itself is added through `/proc/self/fd`, whose
/// magic link must be followed.
const WATCHED: WatchFlags = WatchFlags::MODIFY
    .union(WatchFlags::CLOSE_WRITE)
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::CREATE)
    .union(WatchFlags::DELETE)
    .union(WatchFlags::MOVED_FROM)
    .union(WatchFlags::MOVED_TO)
    .union(WatchFlags::ONLYDIR)
    .union(WatchFlags::EXCL_UNLINK);

/// The longest path a program can name: a directory past it is not watched.
const PATH_MAX: usize = libc::PATH_MAX as usize;
/// The most bytes of directory paths held: a guest making a deep tree of long names
/// would otherwise grow the supervisor's memory with the square of its depth.
const MAX_PATH_BYTES: usize = 32 << 20;

/// How many levels below its share's root a directory is watched; a deeper one is not
/// (nor are host edits there shown to the guest's watchers). The supervisor's
/// descriptors are not the guest's to use up (a walk holds each level open while the
/// others wait), nor its CPU: a name removed at depth N is looked up again from the
/// root ([`TreeWatcher::is_gone`], N opens), and a guest that made a chain of
/// directories one at a time, down to the path length limit, then churned files at
/// its bottom, had the supervisor open some 2,000 directories for each.
const MAX_WATCH_DEPTH: usize = 128;

/// What changed in one read, by host path and kind.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Each changed path; `true` when only its attributes changed (a chmod, a touch:
    /// what the guest's own touches of host edits look like here too).
    pub edits: BTreeMap<(PathBuf, EditKind), bool>,
    /// The kernel's queue overflowed: changes went unreported.
    pub overflowed: bool,
    /// Entries that appeared (made, or renamed into place): their content needs no
    /// report of its own, as no watcher in the guest can have watched them yet and
    /// their directory's report shows them (a guest creating 1,000 files so costs
    /// 1,000 fewer reports).
    pub(super) arrived: BTreeSet<PathBuf>,
    /// Every name removed or renamed (from or to): the guest checks each again, since
    /// its kernel may still hold it for the file it named before. A name the host
    /// created is not among them: the guest's kernel does not keep a name it found
    /// missing (virtiofsd caches no negative entries; checked with the `always` cache
    /// and host edits off: a file the host made was seen at once), so only a name
    /// removed or renamed away before can be stale, and that was listed then.
    pub names: BTreeSet<PathBuf>,
}

impl Changes {
    fn add(&mut self, path: PathBuf, kind: EditKind, attributes_only: bool) {
        let only = self.edits.entry((path, kind)).or_insert(attributes_only);
        *only &= attributes_only;
    }
}

/// How many directories may be watched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    pub dirs: usize,
    /// Why it is lower than it would be for this VM alone, said with it.
    pub lowered: Option<String>,
}

/// Asked for the [`Limit`] again at each walk of every tree: what the other VMs take
/// of the user's watches changes while this one runs.
pub type LimitSource = Box<dyn FnMut() -> Limit>;

/// Directories watched, each by its inotify watch descriptor.
pub struct TreeWatcher {
    inotify: OwnedFd,
    dirs: WatchedDirs,
    /// [`MAX_PATH_BYTES`] but in tests.
    max_path_bytes: usize,
    /// Each tree's top, opened once: every directory below is reached from it, one
    /// name at a time, never through a link.
    roots: Vec<(PathBuf, OwnedFd)>,
    limit: Limit,
    limit_source: Option<LimitSource>,
    /// Why some directories go unwatched, said once.
    limit_reached: Option<String>,
    /// The queue overflowed since the trees were last walked again.
    rewalk_pending: bool,
    /// When the trees were last walked again (the walk's end), and how long it took.
    last_rewalk: Option<(Instant, Duration)>,
    /// [`REWALK_MIN_GAP`] but in tests.
    rewalk_min_gap: Duration,
    /// The most directories, and bytes of their paths, a walk held waiting at once.
    #[cfg(test)]
    peak_pending: (usize, usize),
}

/// The least time between two walks of every tree after overflows: a host command
/// that makes files faster than inotify reports them (an `npm install`) overflows the
/// queue again and again, and walking a large tree at each 50 ms burst would keep a
/// core busy for as long as it runs.
pub const REWALK_MIN_GAP: Duration = Duration::from_secs(2);
/// A walk that took long is followed by this many times as long without one (counted
/// from its end), so walks take at most a fifth of the time.
const REWALK_GAP_PER_WALK: u32 = 4;

/// The watched directories by watch descriptor, and the bytes of their paths.
#[derive(Debug, Default)]
struct WatchedDirs {
    by_wd: HashMap<i32, PathBuf>,
    path_bytes: usize,
}

impl WatchedDirs {
    fn len(&self) -> usize {
        self.by_wd.len()
    }

    fn get(&self, wd: &i32) -> Option<&PathBuf> {
        self.by_wd.get(wd)
    }

    #[cfg(test)]
    fn values(&self) -> impl Iterator<Item = &PathBuf> {
        self.by_wd.values()
    }

    fn insert(&mut self, wd: i32, dir: PathBuf) {
        self.path_bytes += dir.as_os_str().len();
        if let Some(replaced) = self.by_wd.insert(wd, dir) {
            self.path_bytes -= replaced.as_os_str().len();
        }
    }

    fn remove(&mut self, wd: i32) {
        if let Some(removed) = self.by_wd.remove(&wd) {
            self.path_bytes -= removed.as_os_str().len();
        }
    }

    /// Stops watching `root` and the directories below it.
    fn forget_tree(&mut self, inotify: &OwnedFd, root: &Path) {
        let gone: Vec<i32> = self
            .by_wd
            .iter()
            .filter(|(_, dir)| dir.starts_with(root))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            self.remove(wd);
            let _ = inotify::remove_watch(inotify, wd);
        }
    }
}

/// A directory waiting in a walk: opened already, or to be opened by its name
/// below its parent's descriptor.
enum Next {
    Opened(OwnedFd),
    Below(Rc<OwnedFd>),
}

/// The directories a walk holds waiting, with the bytes of their paths: they count
/// against the limits as they are queued, since one directory of the guest's can
/// have a million subdirectories with long names.
#[derive(Default)]
struct Pending {
    dirs: Vec<(PathBuf, Next, usize)>,
    path_bytes: usize,
}

impl Pending {
    fn push(&mut self, dir: PathBuf, next: Next, depth: usize) {
        self.path_bytes += dir.as_os_str().len();
        self.dirs.push((dir, next, depth));
    }

    fn pop(&mut self) -> Option<(PathBuf, Next, usize)> {
        let popped = self.dirs.pop()?;
        self.path_bytes -= popped.0.as_os_str().len();
        Some(popped)
    }

    fn len(&self) -> usize {
        self.dirs.len()
    }
}

impl TreeWatcher {
    /// A watcher of at most `limit` directories.
    pub fn new(limit: usize) -> io::Result<Self> {
        let inotify = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)?;
        Ok(TreeWatcher {
            inotify,
            dirs: WatchedDirs::default(),
            max_path_bytes: MAX_PATH_BYTES,
            roots: Vec::new(),
            limit: Limit {
                dirs: limit,
                lowered: None,
            },
            limit_source: None,
            limit_reached: None,
            rewalk_pending: false,
            last_rewalk: None,
            rewalk_min_gap: REWALK_MIN_GAP,
            #[cfg(test)]
            peak_pending: (0, 0),
        })
    }

    /// The watcher, its limit taken from `source` now and at each walk of every tree
    /// after an overflow (not at each new directory: `source` may be costly).
    pub fn limited_by(mut self, mut source: LimitSource) -> Self {
        self.limit = source();
        self.limit_source = Some(source);
        self
    }

    /// The limit of the last walk of every tree.
    pub fn limit(&self) -> &Limit {
        &self.limit
    }

    /// How long until the walk that an overflow calls for may run, if one is pending:
    /// the caller waits for events no longer than that, then reads (which walks).
    pub fn rewalk_due_in(&self) -> Option<Duration> {
        if !self.rewalk_pending {
            return None;
        }
        Some(match self.last_rewalk {
            Some((at, took)) => {
                let gap = self.rewalk_min_gap.max(took * REWALK_GAP_PER_WALK);
                gap.saturating_sub(at.elapsed())
            }
            None => Duration::ZERO,
        })
    }

    /// Directories watched now.
    pub fn watched(&self) -> usize {
        self.dirs.len()
    }

    /// Watches `root` and every directory below it, but for those [`Self::left_unwatched`]
    /// (git's object store, what lies below each package in a `node_modules`). Returns
    /// why some went unwatched, the first time that happens, or why `root` cannot be.
    pub fn watch_tree(&mut self, root: &Path) -> Option<String> {
        // A share's path is canonical, yet a directory on it may lie in another VM's
        // writable share, whose guest could swap it for a link (to the home directory)
        // as this opens it: no link is followed on the way.
        let opened = crate::share_root::open_dir_without_links(root).and_then(|path_fd| {
            let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
            Ok(rustix::fs::openat(&path_fd, ".", flags, Mode::empty())?)
        });
        match opened {
            Ok(fd) => self.roots.push((root.to_path_buf(), fd)),
            Err(e) => return Some(format!("cannot watch {}: {e}", root.display())),
        }
        self.watch_tree_noting(root, &mut Vec::new())
    }

    /// [`Self::watch_tree`] of a directory below a root, adding each directory it
    /// watches to `added`. The guest can swap any directory of a writable share for a
    /// link (to `/`, say) at any moment, so nothing is reached by its path: each
    /// directory is opened by name below the one above it, links refused, and watched
    /// and read through that descriptor. Whatever the guest does, only directories
    /// of the share are watched, and only their names are reported to it.
    fn watch_tree_noting(&mut self, top: &Path, added: &mut Vec<PathBuf>) -> Option<String> {
        let found = self.root_of(top)?;
        let root = found.0.clone();
        let below_root = top
            .strip_prefix(&root)
            .map_or(0, |rest| rest.components().count());
        if below_root > MAX_WATCH_DEPTH {
            return None;
        }
        // Gone meanwhile, or reached through a link: nothing to say.
        let top_fd = open_below(found, top)?;
        let mut pending = Pending::default();
        pending.push(top.to_path_buf(), Next::Opened(top_fd), 0);
        // Why no more directories are queued: the limits count those queued, so the
        // queue stays within them however wide a directory is.
        let mut full: Option<String> = None;
        while let Some((dir, next, depth)) = pending.pop() {
            let fd = match next {
                Next::Opened(fd) => fd,
                Next::Below(parent) => {
                    let Some(name) = dir.file_name() else {
                        continue;
                    };
                    match open_directory_at(&parent, name) {
                        Ok(fd) => fd,
                        // Not a directory, a link, gone meanwhile, or unreadable.
                        Err(_) => continue,
                    }
                }
            };
            // Only the top can be past these: what is queued was counted.
            if self.dirs.len() >= self.limit.dirs {
                return self.reached(self.too_many_directories());
            }
            let path_len = dir.as_os_str().len();
            if path_len > PATH_MAX {
                // Nor anything below: no program can name it.
                continue;
            }
            if self.dirs.path_bytes + pending.path_bytes + path_len > self.max_path_bytes {
                return self.reached(self.too_many_path_bytes());
            }
            let by_descriptor = format!("/proc/self/fd/{}", fd.as_raw_fd());
            match inotify::add_watch(&self.inotify, by_descriptor.as_str(), WATCHED) {
                Ok(wd) => {
                    self.dirs.insert(wd, dir.clone());
                    added.push(dir.clone());
                }
                Err(rustix::io::Errno::NOSPC) => {
                    return self.reached(format!(
                        "the host's inotify watch limit is reached (fs.inotify.max_user_watches = {})",
                        std::fs::read_to_string("/proc/sys/fs/inotify/max_user_watches")
                            .map(|limit| limit.trim().to_string())
                            .unwrap_or_else(|_| "?".into())
                    ));
                }
                Err(_) => continue,
            }
            if below_root + depth >= MAX_WATCH_DEPTH || full.is_some() || is_package(&root, &dir) {
                // No deeper than that: each level down holds its directory open while
                // its others wait.
                continue;
            }
            let Ok(names) = possible_subdirectories(&fd) else {
                continue;
            };
            let fd = Rc::new(fd);
            for name in names {
                if is_git_objects(&dir, &name) {
                    continue;
                }
                if self.dirs.len() + pending.len() >= self.limit.dirs {
                    full = Some(self.too_many_directories());
                    break;
                }
                let path = dir.join(name);
                let path_len = path.as_os_str().len();
                if path_len > PATH_MAX {
                    continue;
                }
                if self.dirs.path_bytes + pending.path_bytes + path_len > self.max_path_bytes {
                    full = Some(self.too_many_path_bytes());
                    break;
                }
                pending.push(path, Next::Below(Rc::clone(&fd)), depth + 1);
                #[cfg(test)]
                {
                    self.peak_pending.0 = self.peak_pending.0.max(pending.len());
                    self.peak_pending.1 = self.peak_pending.1.max(pending.path_bytes);
                }
            }
        }
        full.and_then(|why| self.reached(why))
    }

    fn too_many_directories(&self) -> String {
        let lowered = self.limit.lowered.as_ref();
        format!(
            "more than {} directories in the shares{}",
            self.limit.dirs,
            lowered.map_or(String::new(), |why| format!(" ({why})"))
        )
    }

    fn too_many_path_bytes(&self) -> String {
        format!(
            "the shares' directories have more than {} KiB of paths",
            self.max_path_bytes >> 10
        )
    }

    /// Whether the directory `name` in the watched directory `dir` is left
    /// unwatched, with all below it: see [`is_package`] and [`is_git_objects`].
    fn left_unwatched(&self, dir: &Path, name: &OsStr) -> bool {
        is_git_objects(dir, name)
            || self
                .root_of(dir)
                .is_some_and(|(root, _)| is_package(root, dir))
    }

    /// Whether `path` no longer names anything in its share: looked up as the walk
    /// does, from the root, never through a link (a guest that swapped a directory
    /// for a link to a host one must not learn which names exist there).
    pub fn is_gone(&self, path: &Path) -> bool {
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return false;
        };
        let Some(root) = self.root_of(parent) else {
            // A root itself (or no share's): not for the walk to say.
            return false;
        };
        let Some(parent) = open_below(root, parent) else {
            return true;
        };
        rustix::fs::statat(&parent, name, AtFlags::SYMLINK_NOFOLLOW)
            .is_err_and(|e| e == rustix::io::Errno::NOENT)
    }

    /// The innermost root `path` lies below, with its descriptor.
    fn root_of(&self, path: &Path) -> Option<&(PathBuf, OwnedFd)> {
        self.roots
            .iter()
            .filter(|(root, _)| path.starts_with(root))
            .max_by_key(|(root, _)| root.components().count())
    }

    /// After the kernel's queue overflowed: the creations and moves it dropped left
    /// directories unwatched and watched paths stale, so every root is walked again
    /// (a watch added again keeps its descriptor, and takes the path found now). The
    /// directories watched only now go to `added`; the watches of those no longer
    /// found are removed.
    fn watch_all_again(&mut self, added: &mut Vec<PathBuf>) -> Option<String> {
        if let Some(source) = self.limit_source.as_mut() {
            self.limit = source();
        }
        let before = std::mem::take(&mut self.dirs);
        let roots: Vec<PathBuf> = self.roots.iter().map(|(root, _)| root.clone()).collect();
        let mut unwatched = None;
        let mut walked = Vec::new();
        for root in roots {
            unwatched = unwatched.or(self.watch_tree_noting(&root, &mut walked));
        }
        for wd in before.by_wd.keys() {
            if self.dirs.get(wd).is_none() {
                let _ = inotify::remove_watch(&self.inotify, *wd);
            }
        }
        let known: std::collections::HashSet<&PathBuf> = before.by_wd.values().collect();
        added.extend(walked.into_iter().filter(|dir| !known.contains(dir)));
        unwatched
    }

    fn reached(&mut self, why: String) -> Option<String> {
        if self.limit_reached.is_some() {
            return None;
        }
        self.limit_reached = Some(why.clone());
        Some(why)
    }

    /// Waits up to `timeout` (forever with `None`) for changes; whether there are.
    pub fn wait(&self, timeout: Option<Duration>) -> io::Result<bool> {
        let mut fds = [rustix::event::PollFd::new(
            &self.inotify,
            rustix::event::PollFlags::IN,
        )];
        let timeout = timeout
            .map(rustix::event::Timespec::try_from)
            .transpose()
            .map_err(io::Error::other)?;
        loop {
            match rustix::event::poll(&mut fds, timeout.as_ref()) {
                Ok(ready) => return Ok(ready > 0),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Reads every change reported so far into `changes`; a new directory is watched
    /// too, with what is already below it, and each directory so watched counts as
    /// changed entries: what was made in it before its watch was reported by none.
    pub fn read(&mut self, changes: &mut Changes) -> io::Result<Option<String>> {
        let mut buf = [MaybeUninit::<u8>::uninit(); 16 * 1024];
        let mut reader = inotify::Reader::new(self.inotify.as_fd(), &mut buf);
        // A set: a directory renamed back and forth a thousand times is walked once.
        let mut new_dirs = BTreeSet::new();
        let mut overflowed = false;
        loop {
            let event = match reader.next() {
                Ok(event) => event,
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            };
            let flags = event.events();
            if flags.contains(ReadFlags::QUEUE_OVERFLOW) {
                changes.overflowed = true;
                overflowed = true;
                continue;
            }
            if flags.contains(ReadFlags::IGNORED) {
                self.dirs.remove(event.wd());
                continue;
            }
            let Some(dir) = self.dirs.get(&event.wd()).cloned() else {
                continue;
            };
            let path = match event.file_name() {
                Some(name) if !name.is_empty() => dir.join(OsStr::from_bytes(name.to_bytes())),
                _ => dir.clone(),
            };
            let is_dir = flags.contains(ReadFlags::ISDIR);
            let entries =
                ReadFlags::CREATE | ReadFlags::DELETE | ReadFlags::MOVED_FROM | ReadFlags::MOVED_TO;
            if flags.intersects(entries) {
                changes.add(dir.clone(), EditKind::Entries, false);
            }
            if flags.intersects(ReadFlags::DELETE | ReadFlags::MOVED_FROM | ReadFlags::MOVED_TO) {
                changes.names.insert(path.clone());
            }
            if flags.intersects(ReadFlags::CREATE | ReadFlags::MOVED_TO) {
                changes.arrived.insert(path.clone());
            }
            if is_dir && flags.contains(ReadFlags::MOVED_FROM) {
                // Its watches would report under the old name; moved back in, it is
                // watched again under the new one.
                self.dirs.forget_tree(&self.inotify, &path);
            }
            let name = path.file_name().unwrap_or_default();
            if is_dir
                && flags.intersects(ReadFlags::CREATE | ReadFlags::MOVED_TO)
                && !self.left_unwatched(&dir, name)
            {
                new_dirs.insert(path.clone());
            }
            if flags.intersects(ReadFlags::MODIFY | ReadFlags::CLOSE_WRITE) {
                changes.add(path.clone(), EditKind::Content, false);
            }
            if flags.contains(ReadFlags::ATTRIB) {
                changes.add(path, EditKind::Content, true);
            }
        }
        let mut unwatched = None;
        let mut added = Vec::new();
        self.rewalk_pending |= overflowed;
        if self.rewalk_due_in() == Some(Duration::ZERO) {
            let began = Instant::now();
            unwatched = self.watch_all_again(&mut added);
            self.rewalk_pending = false;
            self.last_rewalk = Some((Instant::now(), began.elapsed()));
        } else {
            // Until the walk is due, the directories seen made are walked as always.
            let mut walked: Option<&PathBuf> = None;
            for dir in &new_dirs {
                // In order, so the directories below one come right after it: walked
                // with it.
                if walked.is_some_and(|top| dir.starts_with(top)) {
                    continue;
                }
                walked = Some(dir);
                unwatched = unwatched.or(self.watch_tree_noting(dir, &mut added));
            }
        }
        for dir in added {
            changes.add(dir, EditKind::Entries, false);
        }
        let arrived = &changes.arrived;
        changes
            .edits
            .retain(|(path, kind), _| *kind == EditKind::Entries || !arrived.contains(path));
        Ok(unwatched)
    }
}

/// Git's object store: no file watcher looks at it, and it holds hundreds of
/// directories.
fn is_git_objects(dir: &Path, name: &OsStr) -> bool {
    name == "objects" && dir.file_name().is_some_and(|parent| parent == ".git")
}

/// Whether `dir` is a package in a `node_modules` of the share at `root` (`@scope/pkg`
/// for a scoped one), whose subdirectories go unwatched, as VS Code's default
/// `files.watcherExclude` has it: a `node_modules` holds tens of thousands of
/// directories, which would take the user's inotify watches from the host's editors,
/// and most dev servers' watchers do not look inside them by default either. `node_modules` and
/// its packages themselves are watched, so that a package added or removed is seen.
/// Only names within the share count: a workspace that is itself a package (one
/// opened to debug it) is watched whole.
fn is_package(root: &Path, dir: &Path) -> bool {
    let Ok(within) = dir.strip_prefix(root) else {
        return false;
    };
    let mut up = within.components().rev().map(Component::as_os_str);
    let (Some(name), Some(parent)) = (up.next(), up.next()) else {
        return false;
    };
    let is_scope = |name: &OsStr| name.as_bytes().starts_with(b"@");
    if parent == "node_modules" {
        return !is_scope(name);
    }
    is_scope(parent)
        && up
            .next()
            .is_some_and(|grandparent| grandparent == "node_modules")
}

/// `path`, opened from `root` (which it lies below) one name at a time, refusing links.
fn open_below((root, root_fd): &(PathBuf, OwnedFd), path: &Path) -> Option<OwnedFd> {
    let within = path.strip_prefix(root).ok()?;
    let mut fd = open_directory_at(root_fd, OsStr::new(".")).ok()?;
    for component in within.components() {
        let Component::Normal(name) = component else {
            return None;
        };
        fd = open_directory_at(&fd, name).ok()?;
    }
    Some(fd)
}

/// The directory `name` in `parent`, for reading; a link there is refused, not followed.
fn open_directory_at(parent: &OwnedFd, name: &OsStr) -> rustix::io::Result<OwnedFd> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    rustix::fs::openat(parent, name, flags, Mode::empty())
}

/// The names in the directory `fd` that may be directories (those whose type the
/// file system does not say are too: opening them tells), read as they are taken: a
/// walk stops taking them at its limits.
fn possible_subdirectories(fd: &OwnedFd) -> rustix::io::Result<impl Iterator<Item = OsString>> {
    Ok(Dir::read_from(fd)?.flatten().filter_map(|entry| {
        let name = entry.file_name().to_bytes();
        let possible = name != b"."
            && name != b".."
            && matches!(entry.file_type(), FileType::Directory | FileType::Unknown);
        possible.then(|| OsStr::from_bytes(name).to_os_string())
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads until `want` holds, or fails after 5 s with what was seen.
    fn read_until(watcher: &mut TreeWatcher, want: impl Fn(&Changes) -> bool) -> Changes {
        let mut changes = Changes::default();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !want(&changes) {
            assert!(
                std::time::Instant::now() < deadline,
                "not seen; seen {changes:?}"
            );
            watcher.wait(Some(Duration::from_millis(100))).unwrap();
            watcher.read(&mut changes).unwrap();
        }
        changes
    }

    /// A temporary directory (kept while it lives) holding the paths of a share and
    /// of a host directory outside it, neither made yet.
    fn share_and_outside() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let (root, outside) = (dir.path().join("share"), dir.path().join("outside"));
        (dir, root, outside)
    }

    /// A share's directory swapped for a link (by another VM's guest, whose share
    /// holds it) as the watch starts: the link is not followed, so nothing of where it
    /// led (the home directory, say) is watched, nor its names reported.
    #[test]
    fn a_link_swapped_in_at_a_shares_path_is_not_watched_through() {
        let (dir, root, outside) = share_and_outside();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("users-own-name.txt"), "old").unwrap();
        std::os::unix::fs::symlink(&outside, &root).unwrap();
        let mut watcher = TreeWatcher::new(100).unwrap();
        let why = watcher.watch_tree(&root);
        assert!(why.is_some_and(|why| why.contains("cannot watch")));
        std::fs::remove_file(&root).unwrap();
        std::fs::create_dir(&root).unwrap();
        std::fs::write(outside.join("users-own-name.txt"), "new").unwrap();
        let mut changes = Changes::default();
        for _ in 0..5 {
            watcher.wait(Some(Duration::from_millis(100))).unwrap();
            watcher.read(&mut changes).unwrap();
        }
        assert!(changes.edits.is_empty(), "{changes:?}");
        drop(dir);
    }

    /// Past the kernel's queue, events are dropped, the creation of a directory among
    /// them: after the overflow, the trees are walked again, so that directory is
    /// watched all the same, and reported as new.
    #[test]
    fn a_directory_made_while_the_queue_overflowed_is_watched() {
        let queue = inotify_queue_len();
        let (_dir, root, _) = share_and_outside();
        std::fs::create_dir_all(&root).unwrap();
        let mut watcher = TreeWatcher::new(100).unwrap();
        assert_eq!(watcher.watch_tree(&root), None);
        // Each file is at least two events (created, closed after writing).
        for index in 0..queue / 2 + 1 {
            std::fs::write(root.join(index.to_string()), "").unwrap();
        }
        let late = root.join("late");
        std::fs::create_dir_all(late.join("inner")).unwrap();
        let changes = read_until(&mut watcher, |changes| changes.overflowed);
        assert!(watcher.dirs.values().any(|dir| *dir == late.join("inner")));
        assert!(
            changes
                .edits
                .contains_key(&(late.join("inner"), EditKind::Entries)),
            "{:?}",
            changes
                .edits
                .keys()
                .filter(|(path, _)| path.starts_with(&late))
                .collect::<Vec<_>>()
        );
    }

    /// Overflows again and again (an `npm install` on the host) walk the trees at most
    /// once per gap: an overflow within it leaves the walk pending, done by the first
    /// read once the gap has passed (the caller waits no longer than that).
    #[test]
    fn overflows_in_a_row_walk_the_trees_at_most_once_per_gap() {
        let queue = inotify_queue_len();
        let (_dir, root, _) = share_and_outside();
        std::fs::create_dir_all(&root).unwrap();
        let mut watcher = TreeWatcher::new(100).unwrap();
        watcher.rewalk_min_gap = Duration::from_millis(1500);
        assert_eq!(watcher.watch_tree(&root), None);
        let overflow = |round: usize, made: &Path| {
            for index in 0..queue / 2 + 1 {
                std::fs::write(root.join(format!("{round}-{index}")), "").unwrap();
            }
            std::fs::create_dir_all(made).unwrap();
        };
        assert_eq!(watcher.rewalk_due_in(), None);
        let first = root.join("first");
        let overflowing = std::time::Instant::now();
        overflow(1, &first);
        read_until(&mut watcher, |changes| changes.overflowed);
        // The second overflow must come within the gap, on a busy machine too.
        watcher.rewalk_min_gap = watcher.rewalk_min_gap.max(overflowing.elapsed() * 2);
        assert!(
            watcher.dirs.values().any(|dir| *dir == first),
            "walked at once"
        );
        assert_eq!(watcher.rewalk_due_in(), None);

        let second = root.join("second/inner");
        overflow(2, &second);
        read_until(&mut watcher, |changes| changes.overflowed);
        let due = watcher.rewalk_due_in().expect("a walk pending");
        assert!(due > Duration::ZERO, "due at once, within the gap");
        assert!(
            !watcher.dirs.values().any(|dir| *dir == second),
            "walked again within the gap"
        );
        // The caller's wait ends when the walk is due; the read then walks.
        watcher.wait(watcher.rewalk_due_in()).unwrap();
        std::thread::sleep(watcher.rewalk_due_in().unwrap_or_default());
        let mut changes = Changes::default();
        watcher.read(&mut changes).unwrap();
        assert!(
            watcher.dirs.values().any(|dir| *dir == second),
            "not walked once due"
        );
        assert!(changes
            .edits
            .contains_key(&(second.clone(), EditKind::Entries)));
        assert_eq!(watcher.rewalk_due_in(), None);
    }

    /// How many events the kernel queues per inotify instance before it drops them.
    fn inotify_queue_len() -> usize {
        let queue: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(
            queue <= 1 << 20,
            "a queue of {queue} events is too long to fill here"
        );
        queue
    }

    /// Reads until `dir` is watched, or fails after 5 s.
    fn read_until_watched(watcher: &mut TreeWatcher, dir: &Path) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !watcher.dirs.values().any(|watched| watched == dir) {
            assert!(
                std::time::Instant::now() < deadline,
                "{} not watched",
                dir.display()
            );
            watcher.wait(Some(Duration::from_millis(100))).unwrap();
            watcher.read(&mut Changes::default()).unwrap();
        }
    }

    /// Reads what is still coming (the close after a write).
    fn drain(watcher: &mut TreeWatcher) {
        while watcher.wait(Some(Duration::from_millis(100))).unwrap() {
            watcher.read(&mut Changes::default()).unwrap();
        }
    }

    fn has(changes: &Changes, path: &Path, kind: EditKind, attributes_only: bool) -> bool {
        changes.edits.get(&(path.to_path_buf(), kind)) == Some(&attributes_only)
    }

    #[test]
    fn writes_attributes_and_entries_are_reported_by_path() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        std::fs::create_dir_all(root.join("src/deep")).unwrap();
        std::fs::write(root.join("src/deep/a.js"), "a").unwrap();
        let mut watcher = TreeWatcher::new(100).unwrap();
        assert_eq!(watcher.watch_tree(&root), None);
        assert_eq!(watcher.watched(), 3);

        std::fs::write(root.join("src/deep/a.js"), "b").unwrap();
        let a = root.join("src/deep/a.js");
        read_until(&mut watcher, |c| has(c, &a, EditKind::Content, false));

        drain(&mut watcher);
        let file = std::fs::File::open(&a).unwrap();
        // Both times (as `touch` and the guest agent set them): only mtime would be
        // reported as a modification.
        let now = std::time::SystemTime::now();
        let times = std::fs::FileTimes::new()
            .set_accessed(now)
            .set_modified(now);
        file.set_times(times).unwrap();
        read_until(&mut watcher, |c| has(c, &a, EditKind::Content, true));

        std::fs::remove_file(&a).unwrap();
        read_until(&mut watcher, |c| {
            has(c, &root.join("src/deep"), EditKind::Entries, false)
        });

        // A new directory is watched, with what was made in it meanwhile, and is
        // reported as changed entries (a file made in it before its watch would go
        // unreported otherwise).
        std::fs::create_dir_all(root.join("new/inner")).unwrap();
        read_until(&mut watcher, |c| {
            has(c, &root, EditKind::Entries, false)
                && has(c, &root.join("new"), EditKind::Entries, false)
                && has(c, &root.join("new/inner"), EditKind::Entries, false)
        });
        std::fs::write(root.join("new/inner/b.js"), "b").unwrap();
        let inner = root.join("new/inner");
        read_until(&mut watcher, |c| has(c, &inner, EditKind::Entries, false));
    }

    #[test]
    fn every_name_removed_or_renamed_is_listed_but_no_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        std::fs::create_dir(root.join("old")).unwrap();
        std::fs::write(root.join("gone.txt"), "g").unwrap();
        std::fs::write(root.join("index"), "1").unwrap();
        let mut watcher = TreeWatcher::new(100).unwrap();
        watcher.watch_tree(&root);
        std::fs::write(root.join("made.js"), "m").unwrap();
        std::fs::remove_file(root.join("gone.txt")).unwrap();
        std::fs::rename(root.join("old"), root.join("moved")).unwrap();
        // As git replaces its index.
        std::fs::write(root.join("index.lock"), "2").unwrap();
        std::fs::rename(root.join("index.lock"), root.join("index")).unwrap();
        let want = ["gone.txt", "old", "moved", "index.lock", "index"];
        let changes = read_until(&mut watcher, |c| {
            want.iter().all(|name| c.names.contains(&root.join(name)))
        });
        assert!(
            !changes.names.contains(&root.join("made.js")),
            "{:?}",
            changes.names
        );
    }

    #[test]
    fn a_new_files_content_is_reported_by_its_directory_alone() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let mut watcher = TreeWatcher::new(100).unwrap();
        watcher.watch_tree(&root);
        std::fs::write(root.join("made.js"), "m").unwrap();
        std::fs::write(root.join("temp"), "t").unwrap();
        std::fs::rename(root.join("temp"), root.join("saved.js")).unwrap();
        // Read together, as a batch is: the directory, and no file.
        std::thread::sleep(Duration::from_millis(50));
        let mut changes = Changes::default();
        watcher.read(&mut changes).unwrap();
        let edits: Vec<_> = changes.edits.keys().cloned().collect();
        assert_eq!(edits, [(root.clone(), EditKind::Entries)]);
        // A later write of a file that was there is reported.
        std::fs::write(root.join("made.js"), "again").unwrap();
        let made = root.join("made.js");
        read_until(&mut watcher, |c| has(c, &made, EditKind::Content, false));
    }

    #[test]
    fn a_moved_directory_reports_under_its_new_name() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        std::fs::create_dir_all(root.join("old/inner")).unwrap();
        let mut watcher = TreeWatcher::new(100).unwrap();
        watcher.watch_tree(&root);
        std::fs::rename(root.join("old"), root.join("new")).unwrap();
        read_until(&mut watcher, |c| has(c, &root, EditKind::Entries, false));
        drain(&mut watcher);
        std::fs::write(root.join("new/inner/c.js"), "c").unwrap();
        let inner = root.join("new/inner");
        let changes = read_until(&mut watcher, |c| has(c, &inner, EditKind::Entries, false));
        assert!(changes
            .edits
            .keys()
            .all(|(path, _)| !path.starts_with(root.join("old"))));
        assert_eq!(watcher.watched(), 3);
    }

    /// The guest's race: a directory made in a watched one, whose watched parent is
    /// swapped for a link to a host directory before the watcher reads the event.
    /// Walking by path would watch (and report to the guest) the host directory.
    #[test]
    fn a_directory_swapped_for_a_link_does_not_lead_the_watch_out_of_the_share() {
        let (_dir, root, outside) = share_and_outside();
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::fs::create_dir_all(outside.join("made/deep")).unwrap();
        let mut watcher = TreeWatcher::new(100).unwrap();
        assert_eq!(watcher.watch_tree(&root), None);
        assert_eq!(watcher.watched(), 2);

        std::fs::create_dir(root.join("a/made")).unwrap();
        std::fs::rename(root.join("a"), root.join("b")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("a")).unwrap();
        let b_made = root.join("b/made");
        read_until_watched(&mut watcher, &b_made);
        drain(&mut watcher);
        assert!(
            watcher
                .dirs
                .values()
                .all(|watched| !watched.starts_with(root.join("a"))),
            "{:?}",
            watcher.dirs
        );

        std::fs::write(outside.join("made/deep/secret.txt"), "s").unwrap();
        std::fs::write(root.join("b/made/mine.txt"), "m").unwrap();
        let changes = read_until(&mut watcher, |c| has(c, &b_made, EditKind::Entries, false));
        drain(&mut watcher);
        assert!(
            changes
                .edits
                .keys()
                .all(|(path, _)| !path.starts_with(root.join("a"))),
            "{changes:?}"
        );
    }

    /// A guest's deep tree of long names: nothing past PATH_MAX is watched, and the
    /// paths held stop at their limit, said once.
    #[test]
    fn a_deep_tree_of_long_names_is_watched_within_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("share");
        std::fs::create_dir(&root).unwrap();
        let name = "d".repeat(200);
        let mut fd = rustix::fs::open(&root, OFlags::DIRECTORY, Mode::empty()).unwrap();
        for _ in 0..30 {
            rustix::fs::mkdirat(&fd, name.as_str(), Mode::from_raw_mode(0o755)).unwrap();
            fd = open_directory_at(&fd, OsStr::new(&name)).unwrap();
        }
        let mut watcher = TreeWatcher::new(100).unwrap();
        assert_eq!(watcher.watch_tree(&root), None);
        let levels_within = (PATH_MAX - root.as_os_str().len()) / (name.len() + 1);
        assert_eq!(watcher.watched(), 1 + levels_within);
        assert!(watcher
            .dirs
            .values()
            .all(|path| path.as_os_str().len() <= PATH_MAX));

        let mut small = TreeWatcher::new(100).unwrap();
        small.max_path_bytes = 3 << 10;
        let why = small.watch_tree(&root).unwrap();
        assert!(why.contains("more than 3 KiB of paths"), "{why}");
        assert!(small.dirs.path_bytes <= 3 << 10);
        assert_eq!(small.watch_tree(&root), None, "said twice");
    }

    /// A guest's directory of thousands of subdirectories: the walk queues no more of
    /// them than it may watch, nor more bytes of paths than it may hold.
    #[test]
    fn a_wide_directory_is_queued_within_the_limits() {
        let (_dir, root, _) = share_and_outside();
        let wide = root.join("wide");
        std::fs::create_dir_all(&wide).unwrap();
        let long = "w".repeat(200);
        for index in 0..3000 {
            std::fs::create_dir(wide.join(format!("{long}{index}"))).unwrap();
        }
        let mut watcher = TreeWatcher::new(100).unwrap();
        let why = watcher.watch_tree(&root).unwrap();
        assert!(why.contains("more than 100 directories"), "{why}");
        assert_eq!(watcher.watched(), 100);
        assert!(watcher.peak_pending.0 <= 100, "{:?}", watcher.peak_pending);

        let mut small = TreeWatcher::new(10_000).unwrap();
        small.max_path_bytes = 64 << 10;
        let why = small.watch_tree(&root).unwrap();
        assert!(why.contains("more than 64 KiB of paths"), "{why}");
        assert!(
            small.dirs.path_bytes <= 64 << 10,
            "{}",
            small.dirs.path_bytes
        );
        assert!(small.peak_pending.1 <= 64 << 10, "{:?}", small.peak_pending);
        assert!(small.watched() > 100, "{}", small.watched());
    }

    /// Below a package in a `node_modules` (`@scope/pkg` for a scoped one) nothing is
    /// watched, in the first walk as for directories made later; a workspace that is
    /// itself a package is watched whole.
    #[test]
    fn nothing_below_a_package_in_node_modules_is_watched() {
        let (_dir, root, outside) = share_and_outside();
        for made in [
            "node_modules/a/lib/deep",
            "node_modules/a/node_modules/b",
            "node_modules/@s/b/dist",
            "node_modules/.bin",
            "src/node_modules/c/lib",
        ] {
            std::fs::create_dir_all(root.join(made)).unwrap();
        }
        let mut watcher = TreeWatcher::new(100).unwrap();
        assert_eq!(watcher.watch_tree(&root), None);
        let watched = |watcher: &TreeWatcher| {
            let mut watched: Vec<PathBuf> = watcher
                .dirs
                .values()
                .map(|dir| dir.strip_prefix(&root).unwrap().to_path_buf())
                .collect();
            watched.sort();
            watched
        };
        let paths = |list: &[&str]| list.iter().map(PathBuf::from).collect::<Vec<_>>();
        let first = [
            "",
            "node_modules",
            "node_modules/.bin",
            "node_modules/@s",
            "node_modules/@s/b",
            "node_modules/a",
            "src",
            "src/node_modules",
            "src/node_modules/c",
        ];
        assert_eq!(watched(&watcher), paths(&first));

        // Packages installed later: each seen, nothing below.
        std::fs::create_dir_all(root.join("node_modules/d/lib/deep")).unwrap();
        std::fs::create_dir_all(root.join("node_modules/@t/e/lib")).unwrap();
        std::fs::create_dir(root.join("node_modules/a/later")).unwrap();
        let scoped = root.join("node_modules/@t/e");
        read_until_watched(&mut watcher, &root.join("node_modules/d"));
        read_until_watched(&mut watcher, &scoped);
        std::fs::create_dir(scoped.join("later")).unwrap();
        read_until(&mut watcher, |c| has(c, &scoped, EditKind::Entries, false));
        drain(&mut watcher);
        let mut then = paths(&first);
        then.extend(paths(&[
            "node_modules/@t",
            "node_modules/@t/e",
            "node_modules/d",
        ]));
        then.sort();
        assert_eq!(watched(&watcher), then);

        let package = outside.join("node_modules/pkg");
        std::fs::create_dir_all(package.join("lib")).unwrap();
        let mut watcher = TreeWatcher::new(100).unwrap();
        assert_eq!(watcher.watch_tree(&package), None);
        assert_eq!(watcher.watched(), 2);
    }

    /// What the other VMs watch changes while this one runs: each walk of every tree
    /// takes its limit anew, and says why it is lower.
    #[test]
    fn each_walk_of_every_tree_takes_the_limit_anew() {
        let (_dir, root, _) = share_and_outside();
        for index in 0..5 {
            std::fs::create_dir_all(root.join(index.to_string())).unwrap();
        }
        let limit = Rc::new(std::cell::Cell::new(100));
        let source = Rc::clone(&limit);
        let mut watcher = TreeWatcher::new(1)
            .unwrap()
            .limited_by(Box::new(move || Limit {
                dirs: source.get(),
                lowered: (source.get() < 100).then(|| "others watch more".to_string()),
            }));
        assert_eq!(watcher.watch_tree(&root), None);
        assert_eq!(watcher.watched(), 6);
        limit.set(3);
        let why = watcher.watch_all_again(&mut Vec::new()).unwrap();
        assert!(
            why.contains("more than 3 directories in the shares (others watch more)"),
            "{why}"
        );
        assert_eq!(watcher.watched(), 3);
        assert_eq!(watcher.limit().dirs, 3);
    }

    #[test]
    fn directories_are_watched_so_many_levels_below_the_root() {
        let (_dir, root, _) = share_and_outside();
        let mut deep = root.clone();
        for _ in 0..MAX_WATCH_DEPTH + 5 {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        let mut watcher = TreeWatcher::new(1000).unwrap();
        assert_eq!(watcher.watch_tree(&root), None);
        assert_eq!(watcher.watched(), MAX_WATCH_DEPTH + 1);
        // Made one at a time, as a guest makes a chain, they are not watched deeper
        // either: walked from below, or from the deepest watched one.
        let mut below = root.clone();
        for _ in 0..MAX_WATCH_DEPTH - 2 {
            below.push("d");
        }
        let mut added = Vec::new();
        assert_eq!(watcher.watch_tree_noting(&below, &mut added), None);
        assert_eq!(watcher.watch_tree_noting(&deep, &mut added), None);
        assert_eq!(watcher.watched(), MAX_WATCH_DEPTH + 1);
    }

    #[test]
    fn a_name_is_gone_by_the_shares_own_lookup() {
        let (_dir, root, outside) = share_and_outside();
        std::fs::create_dir_all(root.join("d/x")).unwrap();
        std::fs::create_dir_all(outside.join("x")).unwrap();
        let mut watcher = TreeWatcher::new(100).unwrap();
        assert_eq!(watcher.watch_tree(&root), None);
        assert!(!watcher.is_gone(&root.join("d/x")));
        assert!(watcher.is_gone(&root.join("d/y")));
        // `d` swapped for a link to a host directory that has an `x`: not there.
        std::fs::remove_dir_all(root.join("d")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("d")).unwrap();
        assert!(watcher.is_gone(&root.join("d/x")));
        assert!(
            !watcher.is_gone(&root.join("d")),
            "the link itself is there"
        );
    }

    #[test]
    fn a_root_that_cannot_be_opened_is_said() {
        let dir = tempfile::tempdir().unwrap();
        let mut watcher = TreeWatcher::new(100).unwrap();
        let why = watcher.watch_tree(&dir.path().join("missing")).unwrap();
        assert!(
            why.contains("cannot watch") && why.contains("missing"),
            "{why}"
        );
        assert_eq!(watcher.watched(), 0);
    }

    #[test]
    fn links_git_objects_and_directories_past_the_limit_are_not_watched() {
        let (_dir, root, outside) = share_and_outside();
        std::fs::create_dir_all(root.join(".git/objects/ab")).unwrap();
        std::fs::create_dir_all(root.join(".git/refs")).unwrap();
        std::fs::create_dir_all(outside.join("deep")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        let mut watcher = TreeWatcher::new(100).unwrap();
        assert_eq!(watcher.watch_tree(&root), None);
        let mut watched: Vec<PathBuf> = watcher.dirs.values().cloned().collect();
        watched.sort();
        assert_eq!(
            watched,
            [root.clone(), root.join(".git"), root.join(".git/refs")]
        );

        // Nor a repository's object store made later (`git init`, `git clone`), even
        // when its `.git` is watched first.
        std::fs::create_dir(root.join("later")).unwrap();
        let later = root.join("later");
        read_until_watched(&mut watcher, &later);
        std::fs::create_dir(later.join(".git")).unwrap();
        let later_git = later.join(".git");
        read_until_watched(&mut watcher, &later_git);
        std::fs::create_dir_all(later.join(".git/objects/cd")).unwrap();
        std::fs::create_dir(later.join(".git/refs")).unwrap();
        let later_refs = later.join(".git/refs");
        read_until_watched(&mut watcher, &later_refs);
        assert!(watcher
            .dirs
            .values()
            .all(|dir| !dir.starts_with(later.join(".git/objects"))));

        let mut small = TreeWatcher::new(2).unwrap();
        let why = small.watch_tree(&root).unwrap();
        assert!(why.contains("more than 2 directories"), "{why}");
        assert_eq!(small.watched(), 2);
        // Said once.
        assert_eq!(small.watch_tree(&outside), None);
    }
}
