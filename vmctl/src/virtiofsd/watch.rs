//! The daemons once started: the watcher that reports those that die while the VM
//! runs, the end of one the VMM gave up on, and their stop with the VM.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::daemon::{Daemon, GivenUp};
use super::{FsDaemons, START_POLL};
use crate::shares;

/// How often the watcher looks for dead daemons.
const WATCH_POLL: Duration = Duration::from_millis(200);
/// How long the VMM may take to end after a daemon exited cleanly (which it does as
/// the VMM disconnects) before the daemon counts as lost while the VM runs. The VMM
/// closes its sockets as its VM ends, just before it exits: this only covers a loaded
/// host.
const CLEAN_EXIT_GRACE: Duration = Duration::from_secs(2);
/// How long daemons get to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// How long a daemon killed as the VM stops has to end, with what it forked, before
/// vmctl says it is still there and goes on without it: one stuck in the kernel (a
/// hung NFS mount) would otherwise hold up `vmctl stop` for ever.
const STOP_KILL_WAIT: Duration = Duration::from_secs(3);
/// How long a daemon the VMM gave up on has, once killed, to end with what it forked.
/// SIGKILL ends a process at once, unless it is stuck in the kernel (a hard NFS mount,
/// a FUSE server that stopped): then it waits for that, and so do the guest's requests.
const KILL_WAIT: Duration = Duration::from_secs(3);
/// How often [`terminate`] looks whether the daemons it killed are gone: each look
/// reads every process's `/proc/PID/stat`.
const KILL_POLL: Duration = Duration::from_millis(50);

/// What the watcher and `stop` share.
pub(super) struct Watched {
    pub(super) daemons: Vec<Daemon>,
    pub(super) failures: Vec<String>,
    pub(super) stopping: bool,
    /// Also appends each failure here.
    pub(super) failure_file: Option<PathBuf>,
    /// Whether the VM's VMM still runs ([`crate::vmm_process::vmm_running`]): a
    /// daemon that exits cleanly before it ends lost its session with a running VM.
    /// (Never where the frontend is not vmctl's VMM, such as the nested host's QEMU:
    /// there a clean exit is taken for the VM's end, as it mostly is.)
    pub(super) vmm_running: fn() -> bool,
    /// Whether a process of the given process group still runs
    /// ([`process_group_alive`]; tests stand in for a process stuck in the kernel).
    pub(super) group_alive: fn(libc::pid_t) -> bool,
}

pub(super) struct Shared {
    pub(super) state: Mutex<Watched>,
    /// Wakes the watcher when stopping.
    pub(super) wake: Condvar,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, Watched> {
        // A panic elsewhere must not keep us from stopping the daemons.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn record_failure(file: &Path, failure: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    // Never through a link: a nested host writes in the same directory.
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(file)
        .and_then(|mut f| writeln!(f, "{failure}"));
    if let Err(e) = appended {
        tracing::warn!("cannot record the failure in {}: {e}", file.display());
    }
}

/// What is said of a daemon that died while the VM ran.
fn failure(daemon: &Daemon, status: &str) -> String {
    format!(
        "virtiofsd for {} exited unexpectedly ({status}); the VM can no longer use that \
         share (its files on the host are untouched); stop the VM with 'vmctl stop', then \
         start it again to get the share back",
        daemon.host.display()
    )
}

/// How a daemon the VMM gave up on ended, once vmctl killed it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ending {
    /// It ended, with what it forked; its status.
    Ended(ExitStatus),
    /// It ended, reaped by someone else (its status unknown).
    EndedUnseen(String),
    /// It, or what it forked, still ran [`KILL_WAIT`] after SIGKILL: stuck in the
    /// kernel, it still holds the share's session. Its process group.
    Stuck(libc::pid_t),
}

/// What is said of a daemon the VMM gave up on, and vmctl killed: as it ended, or
/// that it did not.
fn given_up_failure(daemon: &Daemon, reason: &str, ending: &Ending) -> String {
    use std::os::unix::process::ExitStatusExt;
    let host = daemon.host.display();
    let how = match ending {
        Ending::Ended(status) if status.signal() == Some(libc::SIGKILL) => {
            "vmctl ended it".to_string()
        }
        // It ended on its own as vmctl came to kill it.
        Ending::Ended(status) => format!("it ended ({status})"),
        Ending::EndedUnseen(why) => format!("it ended (status unknown: {why})"),
        Ending::Stuck(group) => {
            return format!(
                "the VMM gave up on virtiofsd for {host}: {reason}; vmctl sent it SIGKILL, \
                 but it (or a process it forked) has not ended {} s later: it is stuck in \
                 the kernel, most likely on the file system it serves (a hard NFS mount, a \
                 FUSE server that stopped). The guest's requests to that share wait until \
                 it ends, and only then fail with EIO (its files on the host are untouched); \
                 'ps -o pid,stat,wchan:32,cmd -g {group}' shows it (stat D: waiting in the \
                 kernel). Stop the VM with 'vmctl stop', then start it again once that \
                 process has ended to get the share back",
                KILL_WAIT.as_secs()
            );
        }
    };
    format!(
        "the VMM gave up on virtiofsd for {host}: {reason}; {how}, and the VM can no \
         longer use that share (its files on the host are untouched; the guest's requests \
         to it fail with EIO); stop the VM with 'vmctl stop', then start it again to get \
         the share back"
    )
}

/// What is said of a daemon given up on that outlived SIGKILL ([`Ending::Stuck`]),
/// once it has ended with what it forked: while the VM runs, or (`as_vm_stopped`)
/// found as it stopped.
fn late_end_failure(daemon: &Daemon, as_vm_stopped: bool) -> String {
    let host = daemon.host.display();
    let status = daemon
        .status
        .map_or_else(|| "status unknown".to_string(), |status| status.to_string());
    if as_vm_stopped {
        return format!(
            "virtiofsd for {host}, which the VMM gave up on and which outlived vmctl's \
             SIGKILL, has ended as the VM stopped ({status})"
        );
    }
    format!(
        "virtiofsd for {host}, which the VMM gave up on and which outlived vmctl's SIGKILL, \
         has now ended ({status}): the guest's requests to that share no longer wait, they \
         fail with EIO (its files on the host are untouched); stop the VM with 'vmctl \
         stop', then start it again to get the share back"
    )
}

/// What is said of a daemon that [`terminate`] killed (or that was killed when the
/// VMM gave up on it) and that is still there.
fn still_there_message(daemon: &Daemon) -> String {
    let group = group_of(daemon);
    let host = daemon.host.display();
    let what = if daemon.given_up != GivenUp::No {
        // Its SIGKILL came when the VMM gave up on it, and it was said then not to
        // have ended.
        format!(
            "virtiofsd (pid {group}) for {host}, which the VMM gave up on and which \
             outlived vmctl's SIGKILL then, is still there as the VM stops: it (or a \
             process it forked) is stuck in the kernel"
        )
    } else if daemon.status.is_some() {
        format!(
            "virtiofsd (pid {group}) for {host} has ended, but a process it forked has \
             not, {} s after SIGKILL: it is stuck in the kernel",
            STOP_KILL_WAIT.as_secs()
        )
    } else {
        format!(
            "virtiofsd (pid {group}) for {host} has not ended {} s after SIGKILL: it (or \
             a process it forked) is stuck in the kernel",
            STOP_KILL_WAIT.as_secs()
        )
    };
    format!(
        "{what}, most likely on the file system it serves (a hard NFS mount, a FUSE \
         server that stopped), and vmctl goes on without it; 'ps -o \
         pid,stat,wchan:32,cmd -g {group}' shows it (stat D: waiting in the kernel). It \
         ends once that file system answers"
    )
}

pub(super) fn say_still_there(daemon: &Daemon) {
    let message = still_there_message(daemon);
    tracing::warn!("{message}");
    vmm::to_stderr!("vmctl: warning: {message}");
}

/// The daemon's pid, which is also its process group's id ([`spawn_daemon`] makes it
/// a group of its own).
///
/// [`spawn_daemon`]: super::daemon::spawn_daemon
fn group_of(daemon: &Daemon) -> libc::pid_t {
    // A pid fits a pid_t: the kernel's pid_max is far below i32::MAX.
    daemon.child.id() as libc::pid_t
}

/// Whether `daemon`, killed, has ended with what it forked: reaped (here, or by
/// someone else) and no process of its group left, which could hold the share's
/// session.
fn has_ended(daemon: &mut Daemon, group_alive: fn(libc::pid_t) -> bool) -> bool {
    let reaped = !matches!(daemon.poll_exit(), Ok(None));
    reaped && !group_alive(group_of(daemon))
}

/// Whether a process of the process group `group` still runs. A zombie does not count:
/// it closed its files (the share's session among them) as it died. Read from /proc;
/// where that cannot be read, any member counts.
pub(super) fn process_group_alive(group: libc::pid_t) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        // SAFETY: signal 0 sends nothing; it only asks whether the group has a member.
        return unsafe { libc::kill(-group, 0) } == 0;
    };
    entries.flatten().any(|entry| {
        let is_process = entry
            .file_name()
            .to_str()
            .is_some_and(|name| name.bytes().all(|b| b.is_ascii_digit()));
        is_process
            && std::fs::read_to_string(entry.path().join("stat"))
                .is_ok_and(|stat| is_live_member(&stat, group))
    })
}

/// Whether the process whose `/proc/PID/stat` is `stat` is in process group `group`
/// and not yet dead (a zombie, or being reaped).
fn is_live_member(stat: &str, group: libc::pid_t) -> bool {
    // The command name, in parentheses, may hold anything; after it: state, ppid, pgrp.
    let Some((_, after_name)) = stat.rsplit_once(") ") else {
        return false;
    };
    let mut fields = after_name.split_whitespace();
    let state = fields.next();
    let pgrp = fields
        .nth(1)
        .and_then(|field| field.parse::<libc::pid_t>().ok());
    pgrp == Some(group) && !matches!(state, Some("Z" | "X" | "x") | None)
}

/// Says each of `failures` (stderr, the log, the failure file) and keeps them.
fn report_failures(state: &mut Watched, failures: Vec<String>) {
    for failure in &failures {
        tracing::error!("{failure}");
        vmm::to_stderr!("vmctl: {failure}");
        if let Some(file) = &state.failure_file {
            record_failure(file, failure);
        }
    }
    state.failures.extend(failures);
}

/// The watcher thread: reports daemons that die while the VM runs.
pub(super) fn watch_daemons(shared: &Shared) {
    let mut state = shared.lock();
    // When each daemon that exited cleanly while the VMM ran did so: undecided until
    // the VMM ends (the VM going away) or CLEAN_EXIT_GRACE passes (a lost share).
    let mut clean_exits: Vec<Option<Instant>> = vec![None; state.daemons.len()];
    while !state.stopping {
        let mut new_failures = Vec::new();
        let vmm_running = state.vmm_running;
        let group_alive = state.group_alive;
        for (daemon, clean_exit) in state.daemons.iter_mut().zip(&mut clean_exits) {
            match daemon.given_up {
                GivenUp::No => {}
                // Reported when it was given up on, or about to be.
                GivenUp::Killing | GivenUp::Reported => {
                    *clean_exit = None;
                    continue;
                }
                // Said to be still there: its end is news to the user.
                GivenUp::Stuck => {
                    *clean_exit = None;
                    if has_ended(daemon, group_alive) {
                        daemon.given_up = GivenUp::Reported;
                        new_failures.push(late_end_failure(daemon, false));
                    }
                    continue;
                }
            }
            if let Some(since) = *clean_exit {
                if !vmm_running() {
                    *clean_exit = None;
                    tracing::info!(host = %daemon.host.display(), "virtiofsd exited: its VMM disconnected");
                } else if since.elapsed() >= CLEAN_EXIT_GRACE {
                    *clean_exit = None;
                    // The VMM gave up on it (no answer in time), or it refused a
                    // request (virtiofsd exits 0 then too).
                    let status = format!(
                        "exit status: 0, its session with the running VM over; its log {}",
                        daemon.log.display()
                    );
                    new_failures.push(failure(daemon, &status));
                }
                continue;
            }
            if daemon.status.is_some() {
                continue;
            }
            let status = match daemon.poll_exit() {
                Ok(None) => continue,
                Ok(Some(status)) if status.success() => {
                    // virtiofsd exits cleanly when its VMM disconnects: as the VM goes
                    // away, which is not a failure, or as the VMM gives up on it.
                    *clean_exit = Some(Instant::now());
                    continue;
                }
                Ok(Some(status)) => status.to_string(),
                Err(e) => {
                    // Someone else reaped it; do not look at that pid again.
                    daemon.status = Some(ExitStatus::default());
                    format!("status unknown: {e}")
                }
            };
            new_failures.push(failure(daemon, &status));
        }
        report_failures(&mut state, new_failures);
        state = shared
            .wake
            .wait_timeout(state, WATCH_POLL)
            .map(|(guard, _)| guard)
            .unwrap_or_else(|e| e.into_inner().0);
    }
}

impl FsDaemons {
    /// The daemons that died while the VM ran, one message each (without a `vmctl:`
    /// prefix; each was printed to stderr when it happened).
    #[cfg(test)]
    pub fn failures(&self) -> Vec<String> {
        self.shared.lock().failures.clone()
    }

    /// Ends the daemon of the share tagged `tag`, which the VMM gave up on for
    /// `reason` (it left a request unanswered, or refused one): such a daemon may
    /// still run with the guest's memory mapped, and the VMM answers the share's
    /// requests itself only once it is gone. The share is reported lost, as when its
    /// daemon dies, saying whether it ended: a thread of its own waits up to
    /// [`KILL_WAIT`] for that, so that the caller (the thread that reads the VMM's
    /// events) goes on at once; stopping waits for that thread. One still there then
    /// is reported again once it has ended. A daemon that had ended already is left to
    /// the watcher, which says how.
    pub fn give_up(&self, tag: &str, reason: &str) {
        let Some((index, group)) = kill_given_up(&self.shared, tag, reason) else {
            return;
        };
        let shared = Arc::clone(&self.shared);
        let owned_reason = reason.to_string();
        let waiter = std::thread::Builder::new()
            .name("virtiofsd-give-up".into())
            .spawn(move || report_given_up(&shared, index, group, &owned_reason));
        match waiter {
            Ok(waiter) => self
                .give_ups
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(waiter),
            Err(e) => {
                // The report matters more than the wait it costs here.
                tracing::warn!("cannot start a thread to wait for virtiofsd's end: {e}");
                report_given_up(&self.shared, index, group, reason);
            }
        }
    }

    /// Appends each later failure to `file` as a line (besides printing it).
    pub fn record_failures_in(&self, file: PathBuf) {
        self.shared.lock().failure_file = Some(file);
    }

    /// Stops the daemons (as dropping does).
    pub fn stop(self) {}

    fn shutdown(&mut self) {
        // First the reports of the daemons given up on, each within KILL_WAIT of its
        // start: they are said before the VM's end is, with their daemons still here.
        let give_ups =
            std::mem::take(&mut *self.give_ups.lock().unwrap_or_else(|e| e.into_inner()));
        for waiter in give_ups {
            if waiter.join().is_err() {
                tracing::error!("a thread waiting for a virtiofsd given up on panicked");
            }
        }
        self.shared.lock().stopping = true;
        self.shared.wake.notify_all();
        if let Some(watcher) = self.watcher.take() {
            if watcher.join().is_err() {
                tracing::error!("the virtiofsd watcher panicked");
            }
        }
        let (mut daemons, group_alive) = {
            let mut state = self.shared.lock();
            (std::mem::take(&mut state.daemons), state.group_alive)
        };
        let still_there = terminate(&mut daemons, group_alive);
        // One given up on and said to be still there that has ended since, unseen by
        // the watcher, is said to have ended, as the watcher would have.
        let late_ends = daemons
            .iter()
            .enumerate()
            .filter(|(index, daemon)| {
                daemon.given_up == GivenUp::Stuck && !still_there.contains(index)
            })
            .map(|(_, daemon)| late_end_failure(daemon, true))
            .collect();
        report_failures(&mut self.shared.lock(), late_ends);
        for index in still_there {
            say_still_there(&daemons[index]);
        }
    }
}

/// Marks the daemon of the share tagged `tag` given up on, for `reason`, and kills it
/// with what it forked; its index and process group. None when there is nothing to
/// kill: not one of ours, given up on already, or ended already.
fn kill_given_up(shared: &Shared, tag: &str, reason: &str) -> Option<(usize, libc::pid_t)> {
    let mut state = shared.lock();
    let index = (0..state.daemons.len()).find(|index| shares::tag(*index) == tag);
    let Some((index, daemon)) = index.map(|i| (i, &mut state.daemons[i])) else {
        tracing::warn!("the VMM gave up on the virtio-fs backend {tag:?}, not one of ours");
        return None;
    };
    if daemon.given_up != GivenUp::No {
        return None;
    }
    if !matches!(daemon.poll_exit(), Ok(None)) {
        // Its session broke as it died: the VMM's "giving up" is only that.
        tracing::info!(
            host = %daemon.host.display(),
            "the VMM gave up on virtiofsd, which had ended: {reason}"
        );
        return None;
    }
    daemon.given_up = GivenUp::Killing;
    daemon.kill_group();
    Some((index, group_of(daemon)))
}

/// Waits for the daemon at `index`, killed as given up on for `reason`, to end with
/// its process group `group`, then reports the share lost, saying how it ended.
fn report_given_up(shared: &Shared, index: usize, group: libc::pid_t, reason: &str) {
    // Without the lock, which the watcher and `stop` need meanwhile.
    let ending = wait_for_end(shared, index, group);
    let mut state = shared.lock();
    let Some(daemon) = state.daemons.get_mut(index) else {
        return;
    };
    daemon.given_up = match ending {
        Ending::Stuck(_) => GivenUp::Stuck,
        Ending::Ended(_) | Ending::EndedUnseen(_) => GivenUp::Reported,
    };
    let failure = given_up_failure(daemon, reason, &ending);
    report_failures(&mut state, vec![failure]);
}

/// Waits up to [`KILL_WAIT`] for the daemon at `index`, killed, to be reaped and its
/// process group `group` (what it forked) to be gone.
fn wait_for_end(shared: &Shared, index: usize, group: libc::pid_t) -> Ending {
    let deadline = Instant::now() + KILL_WAIT;
    loop {
        let (exited, group_alive) = {
            let mut state = shared.lock();
            let group_alive = state.group_alive;
            match state.daemons.get_mut(index).map(Daemon::poll_exit) {
                Some(Ok(Some(status))) => (Some(Ending::Ended(status)), group_alive),
                Some(Ok(None)) => (None, group_alive),
                Some(Err(e)) => (Some(Ending::EndedUnseen(e.to_string())), group_alive),
                // Stopped meanwhile: `stop` reaps it.
                None => return Ending::EndedUnseen("stopped with the VM".into()),
            }
        };
        if let Some(ending) = exited.filter(|_| !group_alive(group)) {
            return ending;
        }
        if Instant::now() >= deadline {
            return Ending::Stuck(group);
        }
        std::thread::sleep(START_POLL);
    }
}

impl Drop for FsDaemons {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Stops `daemons`: SIGTERM, up to [`STOP_GRACE`] for each to exit with what it
/// forked, then SIGKILL to the process group of each still running, or whose forked
/// processes outlived it (in its sandbox the server is the daemon's child, which the
/// daemon's death only sends SIGTERM: one stuck in the kernel stays), and up to
/// [`STOP_KILL_WAIT`] for those (and for any given up on that outlived its SIGKILL
/// before) to end with what they forked. It waits no longer: a daemon stuck in the
/// kernel (a hung NFS mount) must not hold up the VM's stop for ever. Removes every
/// socket. Returns the indexes of the daemons still there, for the caller to say so
/// ([`say_still_there`]).
pub(super) fn terminate(
    daemons: &mut [Daemon],
    group_alive: fn(libc::pid_t) -> bool,
) -> Vec<usize> {
    let running = |daemon: &mut Daemon| matches!(daemon.poll_exit(), Ok(None));
    // One given up on had SIGKILL already: SIGTERM would change nothing.
    let asked = |daemon: &Daemon| daemon.given_up == GivenUp::No;
    for daemon in daemons.iter_mut() {
        if asked(daemon) && running(daemon) {
            // SAFETY: the child is not reaped yet, so the pid is still its own.
            unsafe { libc::kill(group_of(daemon), libc::SIGTERM) };
        }
    }
    // Its group is looked at only once it has ended: reading every process's stat
    // at each poll while daemons still run would be wasted.
    let lingers =
        |daemon: &mut Daemon| asked(daemon) && (running(daemon) || group_alive(group_of(daemon)));
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline && daemons.iter_mut().any(&lingers) {
        std::thread::sleep(START_POLL);
    }
    let mut killed = Vec::new();
    for (index, daemon) in daemons.iter_mut().enumerate() {
        let killed_before = matches!(daemon.given_up, GivenUp::Stuck | GivenUp::Killing);
        if running(daemon) {
            if asked(daemon) {
                tracing::warn!(host = %daemon.host.display(), "virtiofsd ignored SIGTERM; killing it");
            }
            daemon.kill_group();
            killed.push(index);
        } else if killed_before {
            killed.push(index);
        } else if group_alive(group_of(daemon)) {
            tracing::warn!(
                host = %daemon.host.display(),
                "virtiofsd ended, but a process it forked did not; killing it"
            );
            daemon.kill_group_left();
            killed.push(index);
        }
    }
    let deadline = Instant::now() + STOP_KILL_WAIT;
    loop {
        killed.retain(|&index| !has_ended(&mut daemons[index], group_alive));
        if killed.is_empty() || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(KILL_POLL);
    }
    for daemon in daemons.iter() {
        // virtiofsd keeps a pid file beside its socket.
        let mut pid_file = daemon.socket.clone().into_os_string();
        pid_file.push(".pid");
        for path in [daemon.socket.clone(), PathBuf::from(pid_file)] {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!(path = %path.display(), "cannot remove: {e}");
                }
                _ => {}
            }
        }
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtiofsd::tests::{
        daemon_pids, fake_virtiofsd, fake_virtiofsd_then, is_reaped, share, start_unsandboxed,
        wait_for_failure, wait_for_failure_within,
    };

    /// A link planted where the failures are recorded (a nested host writes in that
    /// directory) is not written through.
    #[test]
    fn a_failure_is_not_recorded_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("bashrc");
        std::fs::write(&target, "kept\n").unwrap();
        let file = dir.path().join("failures.log");
        std::os::unix::fs::symlink(&target, &file).unwrap();
        record_failure(&file, "virtiofsd for /w exited");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "kept\n");
        std::fs::remove_file(&file).unwrap();
        record_failure(&file, "virtiofsd for /w exited");
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "virtiofsd for /w exited\n"
        );
    }

    /// A daemon the VMM gave up on is killed, with what it forked (its sandbox's
    /// server), and reported once, with the VMM's reason, however it then exits.
    #[test]
    fn a_daemon_the_vmm_gave_up_on_is_killed_and_reported() {
        let dir = tempfile::tempdir().unwrap();
        let forked = dir.path().join("forked.pid");
        let fake = fake_virtiofsd_then(
            dir.path(),
            ":",
            &format!("sleep 600 & echo $! > '{}'; wait", forked.display()),
        );
        let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !forked.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let forked: libc::pid_t = std::fs::read_to_string(&forked)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let group = daemon_pids(&daemons)[0];
        daemons.give_up("vmctl7", "not ours");
        assert!(daemons.failures().is_empty());
        let reason = "the backend did not answer GET_VRING_BASE within 30 s";
        daemons.give_up("vmctl0", reason);
        daemons.give_up("vmctl0", reason);
        let failures = wait_for_failure(&daemons);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(
            failures[0].contains(reason)
                && failures[0].contains(&dir.path().display().to_string())
                && failures[0].contains("vmctl ended it")
                && failures[0].contains("fail with EIO")
                && failures[0].contains("then start it again"),
            "{}",
            failures[0]
        );
        // Reported only once it had ended, with what it forked (dead, if perhaps not
        // yet reaped by init, which inherited it).
        let forked_runs = std::fs::read_to_string(format!("/proc/{forked}/stat"))
            .is_ok_and(|stat| is_live_member(&stat, group));
        assert!(!forked_runs, "what the daemon forked still runs");
        // Its death by SIGKILL is not reported a second time.
        std::thread::sleep(3 * WATCH_POLL);
        assert_eq!(daemons.failures().len(), 1, "{:?}", daemons.failures());
        daemons.stop();
    }

    /// A daemon that SIGKILL does not end (stuck in the kernel, here a stand-in that
    /// says its group still runs) is reported as such: the share's requests wait, they
    /// do not fail with EIO. The wait for its end is not the caller's (the thread that
    /// reads the VMM's events, whose later events would wait), and stopping waits for
    /// the report, which comes before the VM's end is said.
    #[test]
    fn a_daemon_given_up_on_that_does_not_end_is_reported_as_still_there() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd(dir.path(), ":");
        let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        daemons.shared.lock().group_alive = |_| true;
        let recorded = dir.path().join("failures.log");
        daemons.record_failures_in(recorded.clone());
        let group = daemon_pids(&daemons)[0];
        let started = Instant::now();
        daemons.give_up(
            "vmctl0",
            "the backend did not answer GET_VRING_BASE within 30 s",
        );
        assert!(
            started.elapsed() < KILL_WAIT / 3,
            "giving up waited for the daemon's end: {:?}",
            started.elapsed()
        );
        assert!(daemons.failures().is_empty(), "{:?}", daemons.failures());
        daemons.stop();
        assert!(
            started.elapsed() >= KILL_WAIT,
            "it did not wait for the end"
        );
        let failures = std::fs::read_to_string(&recorded).unwrap();
        let failures: Vec<&str> = failures.lines().collect();
        assert_eq!(failures.len(), 1, "{failures:?}");
        for needed in [
            "has not ended",
            "requests to that share wait until it ends",
            &format!("-g {group}"),
        ] {
            assert!(failures[0].contains(needed), "{needed}: {}", failures[0]);
        }
        assert!(!failures[0].contains("vmctl ended it"), "{}", failures[0]);
    }

    /// A daemon given up on that outlived its SIGKILL is reported once more when it
    /// ends at last, while the VM runs: the share's requests no longer wait.
    #[test]
    fn a_daemon_given_up_on_that_ends_later_is_reported_when_it_ends() {
        static STUCK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
        use std::sync::atomic::Ordering::SeqCst;
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd(dir.path(), ":");
        let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        daemons.shared.lock().group_alive = |_| STUCK.load(SeqCst);
        let recorded = dir.path().join("failures.log");
        daemons.record_failures_in(recorded.clone());
        daemons.give_up("vmctl0", "the backend refused SET_VRING_BASE");
        let failures = wait_for_failure_within(&daemons, 2 * KILL_WAIT);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains("has not ended"), "{}", failures[0]);
        // What it forked (here, by the stand-in's word) ends at last.
        STUCK.store(false, SeqCst);
        let deadline = Instant::now() + Duration::from_secs(5);
        while daemons.failures().len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let failures = daemons.failures();
        assert_eq!(failures.len(), 2, "{failures:?}");
        for needed in [
            &dir.path().display().to_string(),
            "has now ended (signal: 9",
            "fail with EIO",
            "then start it again",
        ] {
            assert!(failures[1].contains(needed), "{needed}: {}", failures[1]);
        }
        std::thread::sleep(3 * WATCH_POLL);
        daemons.stop();
        let recorded = std::fs::read_to_string(&recorded).unwrap();
        assert_eq!(recorded.lines().count(), 2, "said again: {recorded}");
    }

    /// A daemon given up on that outlived its SIGKILL and has ended by the time the VM
    /// stops, unseen by the watcher, is said to have ended then.
    #[test]
    fn a_daemon_given_up_on_that_ended_unseen_is_reported_as_the_vm_stops() {
        static STUCK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
        use std::sync::atomic::Ordering::SeqCst;
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd(dir.path(), ":");
        let (mut daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        daemons.shared.lock().group_alive = |_| STUCK.load(SeqCst);
        let recorded = dir.path().join("failures.log");
        daemons.record_failures_in(recorded.clone());
        daemons.give_up("vmctl0", "the backend refused SET_VRING_BASE");
        assert_eq!(wait_for_failure_within(&daemons, 2 * KILL_WAIT).len(), 1);
        // The watcher sees no more.
        daemons.shared.lock().stopping = true;
        daemons.shared.wake.notify_all();
        daemons.watcher.take().unwrap().join().unwrap();
        STUCK.store(false, SeqCst);
        daemons.stop();
        let recorded = std::fs::read_to_string(&recorded).unwrap();
        let lines: Vec<&str> = recorded.lines().collect();
        assert_eq!(lines.len(), 2, "{recorded}");
        assert!(
            lines[1].contains("outlived vmctl's SIGKILL, has ended as the VM stopped"),
            "{}",
            lines[1]
        );
    }

    /// Stopping waits for a daemon a bounded time: one that ignores SIGTERM gets
    /// SIGKILL, and one that outlives that too (stuck in the kernel: here a stand-in
    /// that says its group still runs) is said to be still there, and left.
    #[test]
    fn stopping_a_daemon_that_does_not_end_is_bounded_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd_then(dir.path(), ":", "trap '' TERM; exec sleep 600");
        for stuck in [false, true] {
            let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
            let pid = daemon_pids(&daemons)[0];
            let mut taken = std::mem::take(&mut daemons.shared.lock().daemons);
            // What is said of one still there whose own process SIGKILL did not end
            // (not reaped yet, as here before it gets SIGKILL).
            let said = still_there_message(&taken[0]);
            for needed in [
                &format!("virtiofsd (pid {pid}) for {}", dir.path().display()),
                "has not ended 3 s after SIGKILL: it (or a process it forked)",
                &format!("-g {pid}"),
            ] {
                assert!(said.contains(needed), "{needed}: {said}");
            }
            let group_alive = if stuck { |_| true } else { process_group_alive };
            let started = Instant::now();
            let still_there = terminate(&mut taken, group_alive);
            let took = started.elapsed();
            assert!(
                took < STOP_GRACE + STOP_KILL_WAIT + Duration::from_secs(1),
                "took {took:?}"
            );
            assert!(
                took >= STOP_GRACE,
                "SIGTERM was not given its time: {took:?}"
            );
            assert!(is_reaped(pid), "SIGKILL did not end it");
            assert!(!dir.path().join("fs0.sock").exists());
            if stuck {
                assert_eq!(still_there, [0]);
                // It was reaped: what the stand-in says still runs is what it forked.
                let said = still_there_message(&taken[0]);
                assert!(said.contains("a process it forked has not"), "{said}");
            } else {
                assert!(still_there.is_empty(), "{still_there:?}");
            }
            daemons.stop();
        }
    }

    /// Waits for the stand-in's forked process to write its pid to `file`; that pid.
    fn forked_pid(file: &Path) -> libc::pid_t {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !file.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        std::fs::read_to_string(file)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// Kills a test's stray process should the test fail before it is dead.
    struct KillOnDrop {
        pid: libc::pid_t,
        group: libc::pid_t,
    }

    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid));
            if stat.is_ok_and(|stat| is_live_member(&stat, self.group)) {
                // SAFETY: kill only sends a signal, to the test's own process, still
                // in the group it was started in.
                unsafe { libc::kill(self.pid, libc::SIGKILL) };
            }
        }
    }

    /// A daemon that ends on SIGTERM but leaves a process it forked running (its
    /// sandbox's server, which its death sends only SIGTERM, stuck in the kernel on a
    /// hung NFS mount; here one that does not heed the daemon's death) has that
    /// process killed once SIGTERM's time is up, and, if that does not end it either
    /// (a stand-in says its group still runs), is said to be still there, as the
    /// process it forked.
    #[test]
    fn stopping_kills_what_a_daemon_forked_that_outlived_it() {
        let dir = tempfile::tempdir().unwrap();
        let forked_file = dir.path().join("forked.pid");
        let fake = fake_virtiofsd_then(
            dir.path(),
            ":",
            &format!("sleep 600 & echo $! > '{}'; wait", forked_file.display()),
        );
        for stuck in [false, true] {
            let _ = std::fs::remove_file(&forked_file);
            let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
            let group = daemon_pids(&daemons)[0];
            let forked = forked_pid(&forked_file);
            let _cleanup = KillOnDrop { pid: forked, group };
            let mut taken = std::mem::take(&mut daemons.shared.lock().daemons);
            let group_alive = if stuck { |_| true } else { process_group_alive };
            let started = Instant::now();
            let still_there = terminate(&mut taken, group_alive);
            let took = started.elapsed();
            assert!(
                took >= STOP_GRACE,
                "what it forked was not given SIGTERM's time: {took:?}"
            );
            assert!(
                took < STOP_GRACE + STOP_KILL_WAIT + Duration::from_secs(1),
                "took {took:?}"
            );
            assert!(
                taken[0].status.is_some(),
                "the daemon did not end on SIGTERM"
            );
            // Dead, if perhaps not yet reaped by init, which inherited it.
            let forked_runs = std::fs::read_to_string(format!("/proc/{forked}/stat"))
                .is_ok_and(|stat| is_live_member(&stat, group));
            assert!(!forked_runs, "what the daemon forked still runs");
            if stuck {
                assert_eq!(still_there, [0]);
                let said = still_there_message(&taken[0]);
                for needed in [
                    &format!("virtiofsd (pid {group}) for {}", dir.path().display()),
                    "has ended, but a process it forked has not, 3 s after SIGKILL",
                    &format!("-g {group}"),
                ] {
                    assert!(said.contains(needed), "{needed}: {said}");
                }
            } else {
                assert!(still_there.is_empty(), "{still_there:?}");
            }
            daemons.stop();
        }
    }

    /// A daemon given up on that outlived its SIGKILL then and is still there as the
    /// VM stops is said to be so as such: not as one that got its SIGKILL 3 s ago.
    #[test]
    fn a_daemon_given_up_on_still_there_as_the_vm_stops_is_said_to_be_so() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd(dir.path(), ":");
        let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        daemons.shared.lock().group_alive = |_| true;
        let group = daemon_pids(&daemons)[0];
        daemons.give_up("vmctl0", "the backend refused SET_VRING_BASE");
        let failures = wait_for_failure_within(&daemons, 2 * KILL_WAIT);
        assert!(failures[0].contains("has not ended"), "{failures:?}");
        let mut taken = std::mem::take(&mut daemons.shared.lock().daemons);
        let started = Instant::now();
        let still_there = terminate(&mut taken, |_| true);
        assert!(
            started.elapsed() < STOP_KILL_WAIT + Duration::from_secs(1),
            "SIGTERM's time was waited for one that had SIGKILL: {:?}",
            started.elapsed()
        );
        assert_eq!(still_there, [0]);
        let said = still_there_message(&taken[0]);
        for needed in [
            &format!("virtiofsd (pid {group}) for {}", dir.path().display()),
            "which the VMM gave up on and which outlived vmctl's SIGKILL then, is still \
             there as the VM stops",
            &format!("-g {group}"),
        ] {
            assert!(said.contains(needed), "{needed}: {said}");
        }
        assert!(!said.contains("s after SIGKILL"), "{said}");
        daemons.stop();
    }

    /// A daemon that died on its own before the VMM's word of it came (its session
    /// broke as it died) is not said to have been given up on and ended by vmctl: the
    /// watcher reports how it ended.
    #[test]
    fn a_daemon_that_ended_before_the_vmm_gave_up_on_it_is_reported_as_it_ended() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd_then(dir.path(), ":", "sleep 0.3; exit 0");
        let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
        daemons.shared.lock().vmm_running = || true;
        let deadline = Instant::now() + Duration::from_secs(5);
        while daemons.shared.lock().daemons[0].status.is_none() {
            assert!(Instant::now() < deadline, "the stand-in did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
        daemons.give_up("vmctl0", "the backend refused SET_FEATURES: broken pipe");
        let failures = wait_for_failure_within(&daemons, 2 * CLEAN_EXIT_GRACE);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(
            failures[0].contains("exit status: 0") && !failures[0].contains("gave up"),
            "{}",
            failures[0]
        );
        daemons.stop();
    }

    #[test]
    fn a_process_group_member_counts_until_it_is_dead() {
        let stat = |state: &str| format!("42 (a) b) {state} 1 77 77 0 -1 4194560");
        assert!(is_live_member(&stat("S"), 77));
        assert!(is_live_member(&stat("D"), 77));
        assert!(!is_live_member(&stat("Z"), 77));
        assert!(!is_live_member(&stat("S"), 78));
        assert!(!is_live_member("garbage", 77));
        // SAFETY: getpgrp cannot fail.
        let ours = unsafe { libc::getpgrp() };
        assert!(process_group_alive(ours), "this test's own group");
    }

    /// A daemon that exits cleanly (virtiofsd does when its VMM hangs up, or when it
    /// refused a request) while the VMM runs lost the share: reported, once the VMM
    /// has had its time to end. One that does as the VMM ends is not.
    #[test]
    fn a_clean_exit_while_the_vmm_runs_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let fake = fake_virtiofsd_then(dir.path(), ":", "sleep 1; exit 0");
        for vmm_running in [false, true] {
            let (daemons, _) = start_unsandboxed(&fake, &[share(dir.path(), false)], dir.path());
            daemons.shared.lock().vmm_running = if vmm_running { || true } else { || false };
            let within = Duration::from_secs(1) + 2 * CLEAN_EXIT_GRACE;
            let failures = wait_for_failure_within(&daemons, within);
            if vmm_running {
                assert_eq!(failures.len(), 1, "{failures:?}");
                assert!(failures[0].contains("exit status: 0"), "{}", failures[0]);
                assert!(
                    failures[0].contains("then start it again"),
                    "{}",
                    failures[0]
                );
            } else {
                assert!(failures.is_empty(), "{failures:?}");
            }
        }
    }
}
