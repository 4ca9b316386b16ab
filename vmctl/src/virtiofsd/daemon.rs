//! One virtiofsd: its arguments (the sandbox and seccomp as tight as the host
//! allows), its start, and its log.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Instant;

use super::{CachePolicy, VirtiofsdError, LOG_TAIL_LINES, SETTLE_TIME, START_POLL, START_TIMEOUT};
use crate::share_root::{self, DirId};
use crate::shares::Share;

/// How a daemon is confined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sandbox {
    /// Mount, PID and network namespaces (plus a user namespace when not root); the
    /// shared directory is the daemon's whole filesystem.
    Namespace,
    /// None: used only when the namespace sandbox cannot be set up.
    None,
}

impl Sandbox {
    fn as_arg(self) -> &'static str {
        match self {
            Sandbox::Namespace => "namespace",
            Sandbox::None => "none",
        }
    }
}

/// virtiofsd's command line for `share`, listening on `socket`.
fn daemon_args(
    share: &Share,
    socket: &Path,
    sandbox: Sandbox,
    policy: CachePolicy,
) -> Vec<OsString> {
    let shared_dir: OsString = match sandbox {
        Sandbox::Namespace => share.host.clone().into(),
        // Without its sandbox, virtiofsd opens its root by name at every mount by the
        // guest, long after vmctl checked the path. "." is the directory it was started
        // in, which vmctl enters by a descriptor opened without following links
        // ([`spawn_daemon`]): a link swapped onto the share's path later (by another
        // VM's guest, say) changes nothing.
        Sandbox::None => ".".into(),
    };
    let mut args: Vec<OsString> = vec![
        "--shared-dir".into(),
        shared_dir,
        "--socket-path".into(),
        socket.into(),
        "--cache".into(),
        policy.cache.as_arg().into(),
        // No thread pool: replies go out in request order, which the VMM relies on
        // when a daemon dies.
        "--thread-pool-size".into(),
        "0".into(),
        // virtiofsd insists on '=' for this one.
        "--inode-file-handles=never".into(),
        "--log-level".into(),
        "warn".into(),
        "--sandbox".into(),
        sandbox.as_arg().into(),
        // virtiofsd's default, stated so that a changed default cannot weaken it.
        "--seccomp".into(),
        "kill".into(),
        // No device nodes or file capabilities from the guest: as root, virtiofsd
        // would make them on the host (a disk's node, readable by all).
        "--modcaps=-mknod:-setfcap".into(),
    ];
    if policy.writeback {
        args.push("--writeback".into());
    }
    if share.read_only {
        args.push("--readonly".into());
    }
    args
}

/// One running (or exited, not yet forgotten) daemon.
pub(super) struct Daemon {
    pub(super) host: PathBuf,
    pub(super) socket: PathBuf,
    pub(super) log: PathBuf,
    /// The log's length when this daemon started: its own lines come after.
    pub(super) log_start: u64,
    pub(super) sandbox: Sandbox,
    /// The share's directory as found, without following links, just before the
    /// daemon started: what its sandbox must have as its root.
    pub(super) expected_root: DirId,
    pub(super) child: Child,
    /// Set once the child is reaped: its pid may then belong to another process.
    pub(super) status: Option<ExitStatus>,
    /// Whether the VMM gave up on it, and what has been said of that.
    pub(super) given_up: GivenUp,
}

/// Where a daemon stands once the VMM gave up on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GivenUp {
    /// The VMM has not given up on it.
    No,
    /// Killed for it; how it ends is still being waited for, then reported.
    Killing,
    /// Reported as ended: nothing more is said of it.
    Reported,
    /// Reported as still there after SIGKILL (stuck in the kernel): its end, once it
    /// comes, is reported too, so that the user learns the share is gone.
    Stuck,
}

impl Daemon {
    /// Reaps the child if it exited.
    pub(super) fn poll_exit(&mut self) -> std::io::Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child.try_wait()?;
        }
        Ok(self.status)
    }

    pub(super) fn log_tail(&self) -> String {
        log_tail(&self.log, self.log_start)
    }

    /// SIGKILL to the daemon and the processes it forked (its process group), unless
    /// it was reaped already: a stuck daemon may be past acting on SIGTERM, and in its
    /// sandbox the one that serves is its child, which the daemon's death only sends
    /// SIGTERM.
    pub(super) fn kill_group(&self) {
        if self.status.is_some() {
            return;
        }
        let Ok(pid) = libc::pid_t::try_from(self.child.id()) else {
            return;
        };
        // SAFETY: kill only sends a signal. The group is the daemon's own
        // (process_group(0)): its id is the daemon's pid, which stays its own until
        // it is reaped, and it is not (status is None).
        if unsafe { libc::kill(-pid, libc::SIGKILL) } != 0 {
            self.say_not_killed(pid);
        }
    }

    /// SIGKILL to what the daemon forked and left running once it ended itself (in its
    /// sandbox, the server, which the daemon's death only sends SIGTERM, and which may
    /// be stuck in the kernel). Only for a group just found to have a live member
    /// ([`super::process_group_alive`]).
    pub(super) fn kill_group_left(&self) {
        let Ok(pid) = libc::pid_t::try_from(self.child.id()) else {
            return;
        };
        // SAFETY: kill only sends a signal. The daemon is reaped, but its pid stays
        // the group's id while a member lives: the kernel hands out no pid that is
        // still a process group's id, so the group is still the one the daemon made.
        // (Were its last member to die in the moment since it was seen, the pid would
        // have to come round the whole pid space to another group first.)
        if unsafe { libc::kill(-pid, libc::SIGKILL) } != 0 {
            self.say_not_killed(pid);
        }
    }

    fn say_not_killed(&self, group: libc::pid_t) {
        let error = std::io::Error::last_os_error();
        // Gone since it was seen: nothing to kill.
        if error.raw_os_error() != Some(libc::ESRCH) {
            tracing::warn!(
                host = %self.host.display(),
                "cannot kill virtiofsd's process group {group}: {error}"
            );
        }
    }
}

/// The last lines `log` got from `start` on, indented, for an error message.
fn log_tail(log: &Path, start: u64) -> String {
    let mut text = String::new();
    let read = File::open(log).and_then(|mut file| {
        file.seek(SeekFrom::Start(start))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        text = String::from_utf8_lossy(&bytes).into_owned();
        Ok(())
    });
    if let Err(e) = read {
        return format!("  (unreadable: {e})");
    }
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return "  (empty)".into();
    }
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..]
        .iter()
        .map(|line| format!("  {line}"))
        .collect::<Vec<_>>()
        .join("\n")
}

pub(super) fn spawn_daemon(
    binary: &Path,
    share: &Share,
    socket: &Path,
    log: &Path,
    sandbox: Sandbox,
    policy: CachePolicy,
) -> Result<Daemon, VirtiofsdError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| VirtiofsdError::Io { path, source }
    };
    match std::fs::remove_file(socket) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(socket)(e)),
        _ => {}
    }
    let log_file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(io(log))?;
    let log_start = log_file.metadata().map_err(io(log))?.len();
    let stdout = log_file.try_clone().map_err(io(log))?;
    let unreachable = |source| VirtiofsdError::ShareUnreachable {
        host: share.host.clone(),
        source,
    };
    let share_dir = share_root::open_dir_without_links(&share.host).map_err(unreachable)?;
    let expected_root = share_root::dir_id_of(&share_dir).map_err(unreachable)?;
    let args = daemon_args(share, socket, sandbox, policy);
    tracing::info!(binary = %binary.display(), ?args, "starting virtiofsd");
    let mut command = Command::new(binary);
    // It reads none of the user's variables, and holds none of their tokens.
    command
        .env_clear()
        .args(&args)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(log_file);
    // The daemon dies with the thread that spawned it, so a crashed vmctl leaves no
    // daemon behind.
    vmm::process::child::stop_with_parent(&mut command);
    // A group of its own, which its sandbox's server process joins as it forks: what
    // kills it when the VMM gives up on it ([`Daemon::kill_group`]) kills that too.
    command.process_group(0);
    if sandbox == Sandbox::None {
        let dir = share_dir.as_raw_fd();
        // SAFETY: the closure runs in the child between fork and exec and only calls
        // fchdir, which is async-signal-safe; `dir` is open until the exec closes it
        // (CLOEXEC), as `share_dir` outlives the spawn.
        unsafe {
            command.pre_exec(move || match libc::fchdir(dir) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            });
        }
    }
    let child = command.spawn().map_err(|source| VirtiofsdError::Spawn {
        binary: binary.to_path_buf(),
        host: share.host.clone(),
        source,
    })?;
    Ok(Daemon {
        host: share.host.clone(),
        socket: socket.to_path_buf(),
        log: log.to_path_buf(),
        log_start,
        sandbox,
        expected_root,
        child,
        status: None,
        given_up: GivenUp::No,
    })
}

/// How a daemon's start-up ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StartOutcome {
    Ready,
    Exited(ExitStatus),
    TimedOut,
}

/// Waits for each of `daemons` (started together) to create its socket, and one
/// without a namespace sandbox to outlive [`SETTLE_TIME`] too; a daemon that exits
/// meanwhile is reaped.
pub(super) fn wait_started(daemons: &mut [&mut Daemon]) -> Vec<StartOutcome> {
    let deadline = Instant::now() + START_TIMEOUT;
    let mut outcomes: Vec<Option<StartOutcome>> = vec![None; daemons.len()];
    let mut socket_seen = vec![false; daemons.len()];
    loop {
        for (index, daemon) in daemons.iter_mut().enumerate() {
            if outcomes[index].is_some() {
                continue;
            }
            match daemon.poll_exit() {
                Ok(Some(status)) => outcomes[index] = Some(StartOutcome::Exited(status)),
                Ok(None) => socket_seen[index] = daemon.socket.exists(),
                // Reaped elsewhere: it is gone; its status is unknown.
                Err(_) => outcomes[index] = Some(StartOutcome::TimedOut),
            }
        }
        let waiting = (0..daemons.len()).any(|i| outcomes[i].is_none() && !socket_seen[i]);
        if !waiting {
            break;
        }
        if Instant::now() > deadline {
            for (outcome, seen) in outcomes.iter_mut().zip(&socket_seen) {
                if outcome.is_none() && !seen {
                    *outcome = Some(StartOutcome::TimedOut);
                }
            }
            break;
        }
        std::thread::sleep(START_POLL);
    }
    let unsettled = daemons
        .iter()
        .zip(&outcomes)
        .any(|(daemon, outcome)| outcome.is_none() && daemon.sandbox != Sandbox::Namespace);
    if unsettled {
        std::thread::sleep(SETTLE_TIME);
    }
    daemons
        .iter_mut()
        .zip(outcomes)
        .map(|(daemon, outcome)| {
            outcome.unwrap_or_else(|| match daemon.poll_exit() {
                Ok(Some(status)) => StartOutcome::Exited(status),
                Ok(None) => StartOutcome::Ready,
                Err(_) => StartOutcome::TimedOut,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtiofsd::tests::share;

    fn args_of(share: &Share, sandbox: Sandbox, policy: CachePolicy) -> Vec<String> {
        daemon_args(share, Path::new("/s/fs0.sock"), sandbox, policy)
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect()
    }

    #[test]
    fn the_benchmarks_own_virtiofsd_runs_with_vmctls_options() {
        let socket = Path::new("/s/fs0.sock");
        for (root, sandbox, dir) in [
            (true, Sandbox::Namespace, "/h"),
            (false, Sandbox::None, "."),
        ] {
            assert_eq!(
                vm_benches::fs_vmm::virtiofsd_args(Path::new(dir), socket, root),
                args_of(
                    &share(Path::new("/h"), false),
                    sandbox,
                    CachePolicy::default()
                ),
                "benches/src/fs_vmm.rs must start virtiofsd as vmctl does (root: {root})"
            );
        }
    }

    #[test]
    fn arguments_name_the_share_socket_and_sandbox() {
        let args = args_of(
            &share(Path::new("/h"), false),
            Sandbox::Namespace,
            CachePolicy::default(),
        );
        assert_eq!(
            args.join(" "),
            "--shared-dir /h --socket-path /s/fs0.sock --cache auto --thread-pool-size 0 \
             --inode-file-handles=never --log-level warn --sandbox namespace --seccomp kill \
             --modcaps=-mknod:-setfcap"
        );
        let args = args_of(
            &share(Path::new("/h"), true),
            Sandbox::None,
            CachePolicy::default(),
        );
        assert!(args.join(" ").contains("--sandbox none"));
        assert!(
            args.join(" ").starts_with("--shared-dir . "),
            "without the sandbox, the share is the directory it starts in: {args:?}"
        );
        assert_eq!(args.last().map(String::as_str), Some("--readonly"));
    }

    #[test]
    fn the_cache_policy_is_passed_on() {
        let policy: CachePolicy = "always+writeback".parse().unwrap();
        let args = args_of(&share(Path::new("/h"), false), Sandbox::Namespace, policy).join(" ");
        assert!(
            args.contains("--cache always") && args.ends_with("--writeback"),
            "{args}"
        );
    }
}
