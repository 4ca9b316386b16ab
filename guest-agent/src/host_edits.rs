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
//! a few seconds what guest processes wrote (fanotify on the share mounts, see
//! [`watch_guest_writes`]) and leaves those paths alone.

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
/// Files remembered at most; past that (a guest writing thousands of files a second),
/// every report counts as the guest's own for [`GUEST_WRITE_MEMORY`]: a host edit
/// missed then costs no more than without this module, a guest edit shown twice would.
const MAX_REMEMBERED: usize = 16 * 1024;

/// What guest processes wrote lately, by path.
#[derive(Debug, Default)]
pub struct RecentWrites {
    files: HashMap<PathBuf, Instant>,
    /// The directories of those files: a host report of new entries there is most
    /// likely the guest's own file creation.
    dirs: HashMap<PathBuf, Instant>,
    /// Until then every report counts as the guest's own (writes went unrecorded).
    all_until: Option<Instant>,
}

impl RecentWrites {
    /// Notes that a guest process wrote `file` at `now`.
    pub fn record(&mut self, file: &Path, now: Instant) {
        if self.files.len() >= MAX_REMEMBERED {
            self.forget_older_than(now);
            if self.files.len() >= MAX_REMEMBERED {
                self.files.clear();
                self.dirs.clear();
                self.lost(now);
                return;
            }
        }
        self.files.insert(file.to_path_buf(), now);
        if let Some(dir) = file.parent() {
            self.dirs.insert(dir.to_path_buf(), now);
        }
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
        let seen = match kind {
            EditKind::Content => &self.files,
            EditKind::Entries => &self.dirs,
        };
        seen.get(path)
            .is_some_and(|at| now.saturating_duration_since(*at) < GUEST_WRITE_MEMORY)
    }

    fn forget_older_than(&mut self, now: Instant) {
        let fresh = |at: &mut Instant| now.saturating_duration_since(*at) < GUEST_WRITE_MEMORY;
        self.files.retain(|_, at| fresh(at));
        self.dirs.retain(|_, at| fresh(at));
    }
}

/// The guest side of host edits: the writable shares' mount points, and what the
/// guest wrote there lately.
#[derive(Debug, Default)]
pub struct HostEditTarget {
    roots: Vec<PathBuf>,
    recent: Option<Arc<Mutex<RecentWrites>>>,
}

impl HostEditTarget {
    /// Touches edits below `roots` only; `recent` (from [`watch_guest_writes`]), when
    /// given, spares the guest's own writes.
    pub fn new(roots: Vec<PathBuf>, recent: Option<Arc<Mutex<RecentWrites>>>) -> Self {
        HostEditTarget { roots, recent }
    }

    /// The target for the writable shares mounted at `roots`, with the guest's own
    /// writes watched there; a guest whose kernel cannot watch them still gets the
    /// touches (its own edits then show twice), which is said.
    pub fn for_shares(roots: Vec<PathBuf>) -> Self {
        if roots.is_empty() {
            return HostEditTarget::default();
        }
        let recent = match watch_guest_writes(&roots) {
            Ok(recent) => Some(recent),
            Err(e) => {
                tracing::warn!(
                    "the guest's own writes to its shares cannot be told from the host's ({e}); file watchers in the guest may see the guest's edits twice"
                );
                None
            }
        };
        HostEditTarget::new(roots, recent)
    }

    /// Touches each edit's path unless the guest wrote it itself.
    pub fn show(&self, edits: &[HostEdit]) -> EditsShown {
        let now = Instant::now();
        let recent = self.recent.as_ref().and_then(|recent| recent.lock().ok());
        let mut shown = EditsShown::default();
        let mut to_touch = Vec::new();
        for edit in edits {
            let path = Path::new(OsStr::from_bytes(&edit.path));
            if recent
                .as_ref()
                .is_some_and(|recent| recent.wrote(path, edit.kind, now))
            {
                shown.guest_own += 1;
            } else {
                to_touch.push(path);
            }
        }
        // Not held while touching: the guest's writes are recorded meanwhile.
        drop(recent);
        for path in to_touch {
            match self.touch(path) {
                Ok(()) => shown.shown += 1,
                Err(e) => {
                    tracing::debug!("host edit of {}: not shown: {e}", path.display());
                    shown.failed += 1;
                }
            }
        }
        shown
    }

    /// Sets `path`'s times to now, through no symlink: the host names paths, but the
    /// guest's users make the links in a share.
    fn touch(&self, path: &Path) -> io::Result<()> {
        let (root, within) = self
            .roots
            .iter()
            .filter_map(|root| Some((root, path.strip_prefix(root).ok()?)))
            .max_by_key(|(root, _)| root.as_os_str().len())
            .ok_or_else(|| io::Error::other("not in a writable share"))?;
        if within
            .components()
            .any(|c| !matches!(c, Component::Normal(_)))
        {
            return Err(io::Error::other("not a plain path"));
        }
        let root = open_path(libc::AT_FDCWD, root, 0)?;
        let target = match within.as_os_str().is_empty() {
            true => root,
            false => open_path(
                root.as_raw_fd(),
                within,
                libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_BENEATH,
            )?,
        };
        let by_fd = CString::new(format!("/proc/self/fd/{}", target.as_raw_fd()))
            .map_err(io::Error::other)?;
        // SAFETY: `by_fd` is a NUL-terminated path that lives through the call; a null
        // `times` means "now" and is allowed.
        let done = unsafe { libc::utimensat(libc::AT_FDCWD, by_fd.as_ptr(), std::ptr::null(), 0) };
        match done {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
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
    let path = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let how = OpenHow {
        // Without O_NOFOLLOW: RESOLVE_NO_SYMLINKS then refuses a link at the end too.
        flags: (libc::O_PATH | libc::O_CLOEXEC) as u64,
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

/// Starts remembering what guest processes write below `mounts` (fanotify, one mark
/// per mount, read by a thread of its own).
pub fn watch_guest_writes(mounts: &[PathBuf]) -> io::Result<Arc<Mutex<RecentWrites>>> {
    let event_flags = libc::O_RDONLY | libc::O_LARGEFILE | libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: fanotify_init takes no pointers; its result is checked below.
    let fd = unsafe {
        libc::fanotify_init(
            libc::FAN_CLASS_NOTIF | libc::FAN_CLOEXEC,
            event_flags as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fanotify_init just returned this descriptor, which nothing else owns.
    let fanotify = unsafe { OwnedFd::from_raw_fd(fd) };
    for mount in mounts {
        let path = CString::new(mount.as_os_str().as_bytes()).map_err(io::Error::other)?;
        // SAFETY: `path` is NUL-terminated and lives through the call.
        let marked = unsafe {
            libc::fanotify_mark(
                fanotify.as_raw_fd(),
                libc::FAN_MARK_ADD | libc::FAN_MARK_MOUNT,
                libc::FAN_MODIFY | libc::FAN_CLOSE_WRITE,
                libc::AT_FDCWD,
                path.as_ptr(),
            )
        };
        if marked != 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("{}: {e}", mount.display()),
            ));
        }
    }
    let recent = Arc::new(Mutex::new(RecentWrites::default()));
    let recorded = recent.clone();
    std::thread::Builder::new()
        .name("guest-writes".into())
        .spawn(move || record_writes(fanotify, recorded))?;
    Ok(recent)
}

fn record_writes(fanotify: OwnedFd, recent: Arc<Mutex<RecentWrites>>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: `buf` is writable for its whole length.
        let n = unsafe { libc::read(fanotify.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        let Ok(n) = usize::try_from(n) else {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::warn!("the guest's writes are no longer watched: {e}");
            return;
        };
        let now = Instant::now();
        let events = parse_events(&buf[..n]);
        let paths: Vec<Option<PathBuf>> = events
            .iter()
            .map(|event| event.fd.as_ref().map(path_of))
            .collect();
        let Ok(mut recent) = recent.lock() else {
            return;
        };
        for (event, path) in events.iter().zip(paths) {
            if event.overflow {
                recent.lost(now);
            }
            if let Some(path) = path {
                recent.record(&path, now);
            }
        }
    }
}

/// One fanotify event: the descriptor the kernel opened for it (which the reader
/// owns), and whether events were lost.
#[derive(Debug)]
struct FanotifyEvent {
    fd: Option<OwnedFd>,
    overflow: bool,
}

/// Splits what one read of a fanotify descriptor gave into events; a malformed tail
/// (never written by a kernel of this version) ends the list.
fn parse_events(buf: &[u8]) -> Vec<FanotifyEvent> {
    let header = std::mem::size_of::<libc::fanotify_event_metadata>();
    let mut events = Vec::new();
    let mut rest = buf;
    while rest.len() >= header {
        // SAFETY: `rest` holds at least `header` bytes; the struct is plain integers,
        // valid for any bits, and read unaligned.
        let meta: libc::fanotify_event_metadata =
            unsafe { std::ptr::read_unaligned(rest.as_ptr().cast()) };
        let len = meta.event_len as usize;
        if meta.vers != libc::FANOTIFY_METADATA_VERSION || len < header || len > rest.len() {
            break;
        }
        let fd = (meta.fd >= 0).then(|| {
            // SAFETY: the kernel opened this descriptor for us with the event; nothing
            // else owns it, and the OwnedFd closes it.
            unsafe { OwnedFd::from_raw_fd(meta.fd) }
        });
        events.push(FanotifyEvent {
            fd,
            overflow: meta.mask & libc::FAN_Q_OVERFLOW != 0,
        });
        rest = &rest[len..];
    }
    events
}

fn path_of(fd: &OwnedFd) -> PathBuf {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn later(at: Instant, by: Duration) -> Instant {
        at + by
    }

    #[test]
    fn a_guest_write_is_its_own_for_a_while() {
        let mut recent = RecentWrites::default();
        let at = Instant::now();
        recent.record(Path::new("/w/src/a.js"), at);
        assert!(recent.wrote(Path::new("/w/src/a.js"), EditKind::Content, at));
        assert!(recent.wrote(Path::new("/w/src"), EditKind::Entries, at));
        // Another file of the same directory, and the directory's attributes, are not.
        assert!(!recent.wrote(Path::new("/w/src/b.js"), EditKind::Content, at));
        assert!(!recent.wrote(Path::new("/w/src"), EditKind::Content, at));
        let after = later(at, GUEST_WRITE_MEMORY);
        assert!(!recent.wrote(Path::new("/w/src/a.js"), EditKind::Content, after));
        assert!(!recent.wrote(Path::new("/w/src"), EditKind::Entries, after));
    }

    #[test]
    fn too_many_writes_count_every_report_as_the_guests() {
        let mut recent = RecentWrites::default();
        let at = Instant::now();
        for i in 0..MAX_REMEMBERED {
            recent.record(Path::new(&format!("/w/{i}")), at);
        }
        assert!(!recent.wrote(Path::new("/w/elsewhere"), EditKind::Content, at));
        recent.record(Path::new("/w/one-more"), at);
        assert!(recent.wrote(Path::new("/w/elsewhere"), EditKind::Content, at));
        assert!(recent.files.is_empty());
        let after = later(at, GUEST_WRITE_MEMORY);
        assert!(!recent.wrote(Path::new("/w/elsewhere"), EditKind::Content, after));
        // Old entries make room instead when they can.
        for i in 0..MAX_REMEMBERED {
            recent.record(Path::new(&format!("/w/{i}")), at);
        }
        recent.record(Path::new("/w/new"), after);
        assert_eq!(recent.files.len(), 1);
        assert!(recent.wrote(Path::new("/w/new"), EditKind::Content, after));
    }

    fn metadata_event(fd: i32, mask: u64) -> Vec<u8> {
        let meta = libc::fanotify_event_metadata {
            event_len: std::mem::size_of::<libc::fanotify_event_metadata>() as u32,
            vers: libc::FANOTIFY_METADATA_VERSION,
            reserved: 0,
            metadata_len: std::mem::size_of::<libc::fanotify_event_metadata>() as u16,
            mask,
            fd,
            pid: 1,
        };
        // SAFETY: the struct is plain integers; viewing it as bytes reads only them
        // (it has no padding: 4 + 1 + 1 + 2 + 8 + 4 + 4).
        unsafe {
            std::slice::from_raw_parts(
                (&meta as *const libc::fanotify_event_metadata).cast::<u8>(),
                std::mem::size_of_val(&meta),
            )
        }
        .to_vec()
    }

    #[test]
    fn fanotify_events_are_parsed_and_a_bad_tail_is_dropped() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let fd = std::os::fd::IntoRawFd::into_raw_fd(file);
        let mut buf = metadata_event(fd, libc::FAN_MODIFY);
        buf.extend(metadata_event(libc::FAN_NOFD, libc::FAN_Q_OVERFLOW));
        let mut bad = metadata_event(5, libc::FAN_MODIFY);
        bad[4] = libc::FANOTIFY_METADATA_VERSION + 1;
        buf.extend(bad);
        buf.extend([0u8; 3]);
        let events = parse_events(&buf);
        assert_eq!(events.len(), 2);
        assert_eq!(
            path_of(events[0].fd.as_ref().unwrap()),
            Path::new("/dev/null")
        );
        assert!(!events[0].overflow);
        assert!(events[1].fd.is_none() && events[1].overflow);
        // A length past the buffer ends the list too.
        let mut long = metadata_event(libc::FAN_NOFD, libc::FAN_MODIFY);
        long[0] = 200;
        assert!(parse_events(&long).is_empty());
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

    fn edit(path: &Path, kind: EditKind) -> HostEdit {
        HostEdit {
            path: path.as_os_str().as_bytes().to_vec(),
            kind,
        }
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
            edit(&share.join("src/a.js"), EditKind::Content),
            edit(&share.join("src"), EditKind::Entries),
            edit(&share.join("link/secret"), EditKind::Content),
            edit(&share.join("file-link"), EditKind::Content),
            edit(&share.join("src/../../outside/secret"), EditKind::Content),
            edit(&outside.join("secret"), EditKind::Content),
            edit(&share.join("src/gone.js"), EditKind::Content),
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

    #[test]
    fn the_guests_own_writes_are_not_touched() {
        let dir = tempfile::tempdir().unwrap();
        let share = dir.path().to_path_buf();
        std::fs::write(share.join("mine.js"), "m").unwrap();
        std::fs::write(share.join("host.js"), "h").unwrap();
        old_times(&share.join("mine.js"));
        old_times(&share.join("host.js"));
        let recent = Arc::new(Mutex::new(RecentWrites::default()));
        recent
            .lock()
            .unwrap()
            .record(&share.join("mine.js"), Instant::now());
        let target = HostEditTarget::new(vec![share.clone()], Some(recent));
        let shown = target.show(&[
            edit(&share.join("mine.js"), EditKind::Content),
            edit(&share, EditKind::Entries),
            edit(&share.join("host.js"), EditKind::Content),
        ]);
        assert_eq!(
            shown,
            EditsShown {
                shown: 1,
                guest_own: 2,
                failed: 0
            }
        );
        assert_eq!(mtime(&share.join("mine.js")), 1_000_000_000);
        assert!(mtime(&share.join("host.js")) > 1_000_000_000);
    }

    #[test]
    fn fanotify_records_the_writes_below_a_mount() {
        let dir = tempfile::tempdir().unwrap();
        let recent = match watch_guest_writes(&[dir.path().to_path_buf()]) {
            Ok(recent) => recent,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                eprintln!("SKIPPED: fanotify needs CAP_SYS_ADMIN ({e}); the VM tests cover it");
                return;
            }
            Err(e) => panic!("fanotify: {e}"),
        };
        let file = dir.path().join("written.txt");
        std::fs::write(&file, "w").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !recent
            .lock()
            .unwrap()
            .wrote(&file, EditKind::Content, Instant::now())
        {
            assert!(Instant::now() < deadline, "the write was not recorded");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(recent
            .lock()
            .unwrap()
            .wrote(dir.path(), EditKind::Entries, Instant::now()));
    }
}
