//! Host edits of a VM's writable shares, shown to the file watchers in its guest.
//!
//! virtio-fs tells the guest's kernel nothing of what the host changes, so a dev
//! server in the VM would never see the user save a file in the host's editor. The
//! supervisor watches the writable shares (inotify, every directory but git's object
//! store and what lies below each package in a `node_modules`) and sends what
//! changed, by guest path, to the guest agent, which touches each path so that the
//! guest's watchers see it (`guest_agent::host_edits`).
//!
//! The user's inotify watches are shared by all of the user's processes: the user's
//! VMs together take at most a quarter of them, each publishing in its VM directory
//! how many it holds ([`watch_limit`]).
//!
//! It also sends every name the host removed or renamed (from or to): the guest's kernel
//! keeps names for a second, and would show the old file where the host renamed a new
//! one over it (git's index, an editor's save) until the agent has it look again.
//!
//! Two kinds of echo are kept out:
//! - the agent's touch reaches the host as an attribute change of the same path: an
//!   attribute-only change of a path sent within [`ECHO_WINDOW`] is not sent again;
//! - the guest's own writes reach the host through virtiofsd: the agent knows those
//!   and leaves them alone.

mod watcher;

use std::collections::{BTreeSet, HashMap};
use std::io::Read;
use std::ops::Bound;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use guest_agent::client::Connection;
use guest_agent::protocol::{EditKind, HostEdit};
use tokio::net::UnixStream;

use crate::shares::ShareSet;
use crate::state::VmDir;
use watcher::{Changes, Limit, TreeWatcher};

/// `0` or `off` turns the forwarding off (for a VM started with it in the environment).
pub const HOST_EDITS_VAR: &str = "VMCTL_HOST_EDITS";
/// Directories watched at most per VM: a watch pins a directory's inode in the host's
/// memory, and the user's watches (`fs.inotify.max_user_watches`) are shared with the
/// editor's: the user's VMs take at most a quarter of them (see [`watch_limit`]).
pub const MAX_WATCHED_DIRS: usize = 65_536;
/// Directories a VM may watch whatever the user's other VMs take: one started while
/// they hold the whole quarter still shows its top directories' edits.
const MIN_WATCHED_DIRS: usize = 256;
/// The file in a VM's directory where its supervisor publishes how many directories
/// it watches (a decimal number), for the other VMs' [`watch_limit`].
const WATCHED_FILE: &str = "host-edits-watched";
/// How often at most the count is published again while it changes: each time writes
/// and renames a file, and a host `npm install` changes it at every burst.
const PUBLISH_GAP: Duration = Duration::from_secs(1);

/// How many directories this VM watches at most: [`MAX_WATCHED_DIRS`], or less to keep
/// the user's VMs together within a quarter of the user's inotify watches (`others`:
/// what the user's other running VMs watch), so that guests making directories leave
/// the host's editors, dev servers and `tail -f` theirs; but never less than
/// [`MIN_WATCHED_DIRS`] (or the quarter, if that is less).
fn watch_limit(max_user_watches: Option<usize>, others: usize) -> Limit {
    let Some(quarter) = max_user_watches.map(|watches| watches / 4) else {
        return Limit {
            dirs: MAX_WATCHED_DIRS,
            lowered: None,
        };
    };
    let alone = MAX_WATCHED_DIRS.min(quarter).max(1);
    let dirs = alone
        .min(quarter.saturating_sub(others))
        .max(MIN_WATCHED_DIRS.min(alone));
    Limit {
        dirs,
        lowered: (dirs < alone).then(|| {
            format!(
                "the user's other running VMs watch {others} of the {quarter} directories \
                 the VMs may watch together, a quarter of fs.inotify.max_user_watches"
            )
        }),
    }
}

/// What the user's other running VMs watch (`vms`: all of the user's; `own`: this
/// supervisor's pid), as their supervisors last published it. A stopped VM's count
/// is left behind in its directory, so only a running supervisor's counts. Two VMs
/// that start at once may each walk before the other published, and so together take
/// more than the quarter: accepted, as it takes two starts within one walk's time, and
/// each still keeps to [`MAX_WATCHED_DIRS`].
fn watched_by_others(vms: &[VmDir], own: u32) -> usize {
    vms.iter()
        .filter(|vm| {
            vm.running_pid()
                .is_some_and(|pid| u32::try_from(pid) != Ok(own))
        })
        .map(|vm| read_watched(&vm.path.join(WATCHED_FILE)))
        .fold(0, usize::saturating_add)
}

/// A count published at `path`; 0 if there is none (a VM with host edits off, or
/// started by an older vmctl). The user's own file, yet read without following a
/// link or waiting on a FIFO, and bounded, as a supervisor must not hang on it.
fn read_watched(path: &Path) -> usize {
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path);
    let Ok(file) = opened else {
        return 0;
    };
    if !file.metadata().is_ok_and(|meta| meta.is_file()) {
        return 0;
    }
    let mut text = String::new();
    if file.take(32).read_to_string(&mut text).is_err() {
        return 0;
    }
    text.trim()
        .parse::<usize>()
        .map_or(0, |count| count.min(MAX_WATCHED_DIRS))
}

/// This VM's count of watched directories as the other VMs read it: published after
/// the first walk, then whenever it changed, at most once per [`PUBLISH_GAP`].
#[derive(Debug)]
struct Publication {
    file: PathBuf,
    count: Option<usize>,
    at: Option<Instant>,
}

impl Publication {
    fn new(vm: &VmDir) -> Self {
        Publication {
            file: vm.path.join(WATCHED_FILE),
            count: None,
            at: None,
        }
    }

    /// How long until `watched` is to be published; `None` if it is already.
    fn due_in(&self, watched: usize, now: Instant) -> Option<Duration> {
        if self.count == Some(watched) {
            return None;
        }
        Some(self.at.map_or(Duration::ZERO, |at| {
            PUBLISH_GAP.saturating_sub(now.saturating_duration_since(at))
        }))
    }

    /// Publishes `watched` if it is due: written whole or not at all (a file of its
    /// own, renamed over the old one), as other supervisors read it any time.
    fn publish_if_due(&mut self, watched: usize, now: Instant) {
        if self.due_in(watched, now) != Some(Duration::ZERO) {
            return;
        }
        if let Err(e) = crate::state::replace_file(&self.file, format!("{watched}\n").as_bytes()) {
            // Tried again at the next change: the others then count this VM short.
            tracing::debug!("host edits: cannot publish the watched directories: {e}");
        }
        self.count = Some(watched);
        self.at = Some(now);
    }
}

/// What the supervisor's log says once the shares are first walked.
fn watched_line(watched: usize, limit: &Limit) -> String {
    let lowered = limit.lowered.as_ref();
    format!(
        "vmctl: host edits of the writable shares reach the guest's file watchers \
         ({watched} directories watched{})",
        lowered.map_or(String::new(), |why| format!(
            "; at most {}, as {why}",
            limit.dirs
        ))
    )
}

fn max_user_watches() -> Option<usize> {
    std::fs::read_to_string("/proc/sys/fs/inotify/max_user_watches")
        .ok()?
        .trim()
        .parse()
        .ok()
}
/// A burst of events (an editor's save: write, close, rename) becomes one batch: it
/// ends once no event came for [`BURST_GAP`], or [`BURST_MAX`] after its first. A
/// fixed wait of 50 ms instead was half of a host edit's way to the guest's watchers
/// (measured in the nested host: 95-100 ms against 47-51; docs/bench/experiments.md).
const BURST_GAP: Duration = Duration::from_millis(10);
const BURST_MAX: Duration = Duration::from_millis(50);
/// How long the attribute change that the agent's touch causes counts as an echo.
/// Longer than any touch takes, even in the nested host's emulation; a host `chmod`
/// of the same path within it is not sent (its content is, always).
const ECHO_WINDOW: Duration = Duration::from_secs(10);
/// Edits per batch at most, so that a frame stays far below the protocol's limit
/// even with paths of 4 KiB.
const MAX_BATCH: usize = 128;
/// An agent that does not take a batch within this is given up on (and connected to
/// again with the next one).
const AGENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether [`HOST_EDITS_VAR`]'s value turns the forwarding off.
pub fn turned_off(value: Option<&str>) -> bool {
    value.is_some_and(|value| matches!(value.trim(), "0" | "off" | "false" | "no"))
}

/// Starts forwarding the host's edits of the writable `shares` to the guest agent
/// of `vm`, on a thread that lives as long as the supervisor. Problems are said in the
/// supervisor's log; the VM runs regardless.
pub fn forward(vm: &VmDir, shares: Option<&ShareSet>) {
    // The count of the VM's last run, which the other VMs would take for this one's
    // while it walks, or all along with host edits off.
    let _ = std::fs::remove_file(vm.path.join(WATCHED_FILE));
    if turned_off(std::env::var(HOST_EDITS_VAR).ok().as_deref()) {
        return;
    }
    let Some(shares) = shares.filter(|set| set.shares.iter().any(|share| !share.read_only)) else {
        return;
    };
    let shares = shares.clone();
    let vm = vm.clone();
    let spawned = std::thread::Builder::new()
        .name("vmctl-host-edits".into())
        .spawn(move || {
            if let Err(e) = run(&vm, shares) {
                vmm::to_stderr!(
                    "vmctl: warning: host edits no longer reach the guest's file watchers: {e}"
                );
            }
        });
    if let Err(e) = spawned {
        vmm::to_stderr!("vmctl: warning: host edits will not reach the guest's file watchers: {e}");
    }
}

fn run(vm: &VmDir, shares: ShareSet) -> std::io::Result<()> {
    let vsock = vm.vsock_socket();
    let own = std::process::id();
    let mut watcher = TreeWatcher::new(MAX_WATCHED_DIRS)?.limited_by(Box::new(move || {
        watch_limit(max_user_watches(), watched_by_others(&VmDir::all(), own))
    }));
    for share in shares.shares.iter().filter(|share| !share.read_only) {
        say_unwatched(watcher.watch_tree(&share.host));
    }
    vmm::to_stderr!("{}", watched_line(watcher.watched(), watcher.limit()));
    let mut publication = Publication::new(vm);
    publication.publish_if_due(watcher.watched(), Instant::now());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut echoes = Echoes::default();
    let mut agent: Option<Connection<UnixStream>> = None;
    let mut overflow_warning = OverflowWarning::default();
    loop {
        // Not for ever while an overflow's walk waits its turn (it is done by a read),
        // nor while a count waits to be published.
        let unpublished = publication.due_in(watcher.watched(), Instant::now());
        let timeout = [watcher.rewalk_due_in(), unpublished]
            .into_iter()
            .flatten()
            .min();
        watcher.wait(timeout)?;
        let burst_ends = Instant::now() + BURST_MAX;
        let mut changes = Changes::default();
        loop {
            say_unwatched(watcher.read(&mut changes)?);
            let left = burst_ends.saturating_duration_since(Instant::now());
            if left.is_zero() || !watcher.wait(Some(BURST_GAP.min(left)))? {
                break;
            }
        }
        publication.publish_if_due(watcher.watched(), Instant::now());
        if changes.overflowed {
            if let Some(times) = overflow_warning.due(Instant::now()) {
                vmm::to_stderr!(
                    "vmctl: warning: the host changed more in the shares than inotify could \
                     report{}; some changes do not reach the guest's file watchers (the shares \
                     are walked again, at most every {} s, to watch what was made meanwhile)",
                    if times > 1 {
                        format!(" ({times} times since the last warning)")
                    } else {
                        String::new()
                    },
                    watcher::REWALK_MIN_GAP.as_secs()
                );
            }
        }
        let names = std::mem::take(&mut changes.names);
        let edits = echoes.without_echoes(changes, Instant::now());
        let (names, mut edits) = within_gone_left_out(names, edits, |path| watcher.is_gone(path));
        // The names first: the guest then sees the new files when it is shown them.
        let names = names.into_iter().map(|name| (name, EditKind::Name));
        edits.splice(0..0, names);
        let edits: Vec<HostEdit> = edits
            .into_iter()
            .filter_map(|(host, kind)| Some(HostEdit::new(&shares.guest_path_of(&host)?, kind)))
            .collect();
        for batch in edits.chunks(MAX_BATCH) {
            runtime.block_on(send(&vsock, &mut agent, batch.to_vec()));
        }
    }
}

/// How often the overflow warning may be said: a host command that overflows the
/// queue at every burst must not fill the supervisor's log.
const OVERFLOW_WARNING_GAP: Duration = Duration::from_secs(60);

/// The overflows since the warning was last said, and when that was.
#[derive(Debug, Default)]
struct OverflowWarning {
    said_at: Option<Instant>,
    unsaid: u64,
}

impl OverflowWarning {
    /// Counts an overflow at `now`; how many to say, when the warning is due.
    fn due(&mut self, now: Instant) -> Option<u64> {
        self.unsaid += 1;
        if self
            .said_at
            .is_some_and(|at| now.saturating_duration_since(at) < OVERFLOW_WARNING_GAP)
        {
            return None;
        }
        self.said_at = Some(now);
        Some(std::mem::take(&mut self.unsaid))
    }
}

fn say_unwatched(why: Option<String>) {
    if let Some(why) = why {
        vmm::to_stderr!("vmctl: warning: {why}: edits the host makes in the directories left unwatched do not reach the guest's file watchers");
    }
}

/// Sends one batch, connecting first when needed. A guest that is not up yet, or no
/// longer, simply misses it: there is nobody watching there.
async fn send(
    vsock: &std::path::Path,
    agent: &mut Option<Connection<UnixStream>>,
    batch: Vec<HostEdit>,
) {
    tracing::debug!(
        "host edits: {:?}",
        batch
            .iter()
            .map(|edit| (edit.path().display().to_string(), edit.kind))
            .collect::<Vec<_>>()
    );
    let sent = tokio::time::timeout(AGENT_TIMEOUT, async {
        if agent.is_none() {
            *agent =
                Some(guest_agent::client::connect_hybrid(vsock, crate::exec::AGENT_PORT).await?);
        }
        match agent.as_mut() {
            Some(connection) => connection.show_host_edits(batch).await,
            None => Err(guest_agent::client::ClientError::Closed),
        }
    })
    .await;
    match sent {
        Ok(Ok(shown)) => tracing::debug!("host edits: {shown:?}"),
        Ok(Err(e)) => {
            tracing::debug!("host edits not shown: {e}");
            *agent = None;
        }
        Err(_) => {
            tracing::debug!("host edits not shown: no answer within {AGENT_TIMEOUT:?}");
            *agent = None;
        }
    }
}

/// Leaves out what lies below a removed or renamed name that is gone from the host
/// (`is_gone`): the guest's check of that name finds it gone and drops all its kernel
/// held below it, and touching a path there fails; so a host `rm -rf` of a tree costs
/// the guest one lookup, not one per file. Returns the names (in order: each before
/// what lies below it) and the edits left.
fn within_gone_left_out(
    names: BTreeSet<PathBuf>,
    edits: Vec<(PathBuf, EditKind)>,
    is_gone: impl Fn(&Path) -> bool,
) -> (Vec<PathBuf>, Vec<(PathBuf, EditKind)>) {
    // A path's descendants follow it directly in the set's (component-wise) order.
    let mut gone: BTreeSet<PathBuf> = BTreeSet::new();
    let mut kept = Vec::new();
    for name in names {
        // Names come in order, so the last gone one is the only one `name` can be in.
        if gone.last().is_some_and(|dir| name.starts_with(dir)) {
            continue;
        }
        if is_gone(&name) {
            gone.insert(name.clone());
        }
        kept.push(name);
    }
    let within_gone = |path: &Path| {
        gone.range::<Path, _>((Bound::Unbounded, Bound::Included(path)))
            .next_back()
            .is_some_and(|dir| path.starts_with(dir))
    };
    let edits = edits
        .into_iter()
        .filter(|(path, _)| !within_gone(path))
        .collect();
    (kept, edits)
}

/// The paths sent lately, to tell the agent's touches from the host's own changes.
#[derive(Debug, Default)]
struct Echoes {
    sent: HashMap<PathBuf, Instant>,
}

impl Echoes {
    /// The changes to send: all but attribute-only changes of paths sent within
    /// [`ECHO_WINDOW`]. Those to send are remembered as sent at `now`.
    fn without_echoes(&mut self, changes: Changes, now: Instant) -> Vec<(PathBuf, EditKind)> {
        self.sent
            .retain(|_, at| now.saturating_duration_since(*at) < ECHO_WINDOW);
        let to_send: Vec<(PathBuf, EditKind)> = changes
            .edits
            .into_iter()
            .filter(|((path, _), attributes_only)| {
                !(*attributes_only && self.sent.contains_key(path))
            })
            .map(|(key, _)| key)
            .collect();
        for (path, _) in &to_send {
            self.sent.insert(path.clone(), now);
        }
        to_send
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Said at the first overflow, then at most once a minute, with how many there were.
    #[test]
    fn the_overflow_warning_is_said_at_most_once_a_minute_with_a_count() {
        let mut warning = OverflowWarning::default();
        let start = Instant::now();
        assert_eq!(warning.due(start), Some(1));
        for second in 1..60 {
            assert_eq!(warning.due(start + Duration::from_secs(second)), None);
        }
        assert_eq!(warning.due(start + Duration::from_secs(60)), Some(60));
        assert_eq!(warning.due(start + Duration::from_secs(61)), None);
        assert_eq!(warning.due(start + Duration::from_secs(200)), Some(2));
    }

    #[test]
    fn the_users_vms_share_a_quarter_of_the_users_watches() {
        let alone = |dirs| Limit {
            dirs,
            lowered: None,
        };
        assert_eq!(watch_limit(Some(8192), 0), alone(2048));
        assert_eq!(watch_limit(Some(10_000_000), 0), alone(MAX_WATCHED_DIRS));
        assert_eq!(watch_limit(None, 5000), alone(MAX_WATCHED_DIRS));
        assert_eq!(watch_limit(Some(0), 0), alone(1));
        // What the others leave of the quarter.
        let limit = watch_limit(Some(8192), 1000);
        assert_eq!(limit.dirs, 1048);
        let why = limit.lowered.unwrap();
        assert!(why.contains("watch 1000 of the 2048 directories"), "{why}");
        // Where the quarter is more than one VM may watch: what is left of it.
        assert_eq!(watch_limit(Some(1 << 20), 100_000), alone(MAX_WATCHED_DIRS));
        assert_eq!(watch_limit(Some(1 << 20), 200_000).dirs, 62_144);
        // Never nothing, nor more than the quarter.
        assert_eq!(watch_limit(Some(8192), 2000).dirs, MIN_WATCHED_DIRS);
        assert_eq!(watch_limit(Some(8192), usize::MAX).dirs, MIN_WATCHED_DIRS);
        assert_eq!(watch_limit(Some(400), 50), alone(100));
    }

    #[test]
    fn only_the_other_running_vms_counts_are_taken() {
        let dir = tempfile::tempdir().unwrap();
        let vm = |name: &str, count: Option<&str>| {
            let vm = VmDir {
                path: dir.path().join(name),
            };
            std::fs::create_dir(&vm.path).unwrap();
            if let Some(count) = count {
                std::fs::write(vm.path.join(WATCHED_FILE), count).unwrap();
            }
            vm
        };
        let running = "while :; do sleep 0.05; done";
        let other = vm("other", Some("1000\n"));
        let _other = crate::state::fake_supervisor(&other, running);
        let own = vm("own", Some("7000\n"));
        let own_supervisor = crate::state::fake_supervisor(&own, running);
        let garbled = vm("garbled", Some("many"));
        let _garbled = crate::state::fake_supervisor(&garbled, running);
        let huge = vm("huge", Some("99999999999"));
        let _huge = crate::state::fake_supervisor(&huge, running);
        let unpublished = vm("unpublished", None);
        let _unpublished = crate::state::fake_supervisor(&unpublished, running);
        let stopped = vm("stopped", Some("5000\n"));
        std::fs::write(stopped.pid_file(), std::process::id().to_string()).unwrap();
        let vms = [other, own, garbled, huge, unpublished, stopped];
        assert_eq!(
            watched_by_others(&vms, own_supervisor.0.id()),
            1000 + MAX_WATCHED_DIRS
        );
    }

    #[test]
    fn the_count_is_published_at_once_then_at_most_once_a_gap() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        let file = vm.path.join(WATCHED_FILE);
        let mut publication = Publication::new(&vm);
        let start = Instant::now();
        assert_eq!(publication.due_in(10, start), Some(Duration::ZERO));
        publication.publish_if_due(10, start);
        assert_eq!(read_watched(&file), 10);
        assert_eq!(publication.due_in(10, start), None);

        let soon = start + PUBLISH_GAP / 4;
        publication.publish_if_due(20, soon);
        assert_eq!(read_watched(&file), 10, "published again within the gap");
        assert_eq!(publication.due_in(20, soon), Some(PUBLISH_GAP * 3 / 4));
        publication.publish_if_due(20, start + PUBLISH_GAP);
        assert_eq!(read_watched(&file), 20);
        let names: Vec<_> = std::fs::read_dir(&vm.path).unwrap().flatten().collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    /// A VM started again with host edits off is not counted as watching what it
    /// watched in its last run.
    #[test]
    fn the_last_runs_count_is_removed_at_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        std::fs::write(vm.path.join(WATCHED_FILE), "5000\n").unwrap();
        forward(&vm, None);
        assert!(!vm.path.join(WATCHED_FILE).exists());
    }

    #[test]
    fn the_log_says_when_the_other_vms_lowered_the_limit() {
        let line = watched_line(3, &watch_limit(Some(8192), 0));
        assert!(line.ends_with("(3 directories watched)"), "{line}");
        let line = watched_line(3, &watch_limit(Some(8192), 2000));
        assert!(
            line.contains("3 directories watched; at most 256, as the user's other running VMs watch 2000 of the 2048"),
            "{line}"
        );
    }

    fn changes(edits: &[(&str, EditKind, bool)]) -> Changes {
        Changes {
            edits: edits
                .iter()
                .map(|(path, kind, only)| ((PathBuf::from(path), *kind), *only))
                .collect(),
            ..Changes::default()
        }
    }

    #[test]
    fn what_lies_below_a_gone_name_is_left_out() {
        let paths = |list: &[&str]| list.iter().map(PathBuf::from).collect::<Vec<_>>();
        // `rm -rf /w/a`, and `/w/a.txt` and `/w/b/x` removed; `/w/c` renamed away and
        // another made in its place.
        let names: BTreeSet<PathBuf> = paths(&[
            "/w/a/b/x", "/w/a", "/w/a/b", "/w/a/y", "/w/a.txt", "/w/b/x", "/w/c", "/w/c/z",
        ])
        .into_iter()
        .collect();
        let edits: Vec<(PathBuf, EditKind)> = [
            ("/w", EditKind::Entries),
            ("/w/a", EditKind::Entries),
            ("/w/a/b", EditKind::Entries),
            ("/w/ab", EditKind::Entries),
            ("/w/b", EditKind::Entries),
            ("/w/c", EditKind::Entries),
        ]
        .into_iter()
        .map(|(path, kind)| (PathBuf::from(path), kind))
        .collect();
        let gone = paths(&["/w/a", "/w/a/b", "/w/a/b/x", "/w/a/y", "/w/a.txt", "/w/b/x"]);
        let (names, edits) =
            within_gone_left_out(names, edits, |path| gone.iter().any(|g| g == path));
        // `/w/c` is there again: what was below the old one is checked one by one.
        assert_eq!(
            names,
            paths(&["/w/a", "/w/a.txt", "/w/b/x", "/w/c", "/w/c/z"])
        );
        let edits: Vec<&str> = edits.iter().map(|(p, _)| p.to_str().unwrap()).collect();
        assert_eq!(edits, ["/w", "/w/ab", "/w/b", "/w/c"]);
    }

    #[test]
    fn the_touch_of_a_sent_path_is_not_sent_back() {
        let mut echoes = Echoes::default();
        let at = Instant::now();
        let sent = echoes.without_echoes(
            changes(&[
                ("/w/a.js", EditKind::Content, false),
                ("/w", EditKind::Entries, false),
                ("/w/b.js", EditKind::Content, true),
            ]),
            at,
        );
        assert_eq!(sent.len(), 3, "a first chmod is the host's: {sent:?}");
        // The agent's touches come back as attribute changes: not sent again.
        let echo = changes(&[
            ("/w/a.js", EditKind::Content, true),
            ("/w", EditKind::Content, true),
            ("/w/b.js", EditKind::Content, true),
        ]);
        assert!(echoes
            .without_echoes(echo, at + Duration::from_secs(1))
            .is_empty());
        // A new write of a sent path is sent.
        let write = changes(&[("/w/a.js", EditKind::Content, false)]);
        assert_eq!(
            echoes.without_echoes(write, at + Duration::from_secs(2)),
            [(PathBuf::from("/w/a.js"), EditKind::Content)]
        );
        // After the window, a chmod is the host's again.
        let later = at + Duration::from_secs(2) + ECHO_WINDOW;
        let chmod = changes(&[("/w/a.js", EditKind::Content, true)]);
        assert_eq!(echoes.without_echoes(chmod, later).len(), 1);
        assert_eq!(echoes.sent.len(), 1, "old entries are dropped");
    }

    #[test]
    fn the_variable_turns_it_off() {
        assert!(!turned_off(None));
        assert!(!turned_off(Some("1")));
        for off in ["0", "off", " no ", "false"] {
            assert!(turned_off(Some(off)), "{off}");
        }
    }
}
