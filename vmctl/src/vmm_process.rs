//! Starting the VMM process, `vmctl-vmm` (see `vmm::process`): `vmctl boot` becomes
//! it; a workspace VM's supervisor and the nested host's init run it as a child, with
//! a virtiofsd per share ([`run_with_shares`]), pass on their stop signals and read how
//! the VM ended from a pipe.

use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use vmm::config::VmConfig;
use vmm::process::{encode_config, Args, ArgsError, Event, Outcome, BINARY};
use vmm_sys_util::signal::register_signal_handler;

use crate::shares::ShareSet;

/// Names the VMM's executable instead of the one beside vmctl.
const BINARY_ENV: &str = "VMCTL_VMM_BIN";

#[derive(Debug, thiserror::Error)]
pub enum VmmProcessError {
    #[error(
        "the VMM {} is missing: `cargo build --release -p vmctl` builds it beside vmctl \
         (scripts/setup.sh does), or name it in {BINARY_ENV}",
        .0.display()
    )]
    Missing(PathBuf),
    #[error("cannot find vmctl's own executable, beside which the VMM is: {0}")]
    OwnExecutable(std::io::Error),
    #[error(transparent)]
    Args(#[from] ArgsError),
    #[error("cannot start the VMM {}: {source}", .path.display())]
    Start {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot prepare the VMM's start (its configuration, outcome pipe, signals): {0}")]
    Setup(std::io::Error),
    /// How the VM failed, as the VMM reported it.
    #[error("{0}")]
    Vm(String),
    #[error(
        "the VMM (pid {pid}) {how} without saying how the VM ended (its last messages are \
         above; if it was killed, the kernel's log may say why)"
    )]
    Lost { pid: u32, how: String },
}

/// The VMM's executable: `VMCTL_VMM_BIN`, else `vmctl-vmm` beside this executable.
pub fn binary() -> Result<PathBuf, VmmProcessError> {
    match std::env::var_os(BINARY_ENV) {
        Some(path) => existing(PathBuf::from(path)),
        None => existing(
            std::env::current_exe()
                .map_err(VmmProcessError::OwnExecutable)?
                .with_file_name(BINARY),
        ),
    }
}

fn existing(path: PathBuf) -> Result<PathBuf, VmmProcessError> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(VmmProcessError::Missing(path))
    }
}

/// Replaces this process with the VMM running `config`; returns only on failure.
pub fn exec(config: &VmConfig, report_boot_time: bool) -> VmmProcessError {
    let prepared = binary().and_then(|path| Ok((path, config_file(config)?)));
    let (path, config_fd) = match prepared {
        Ok(prepared) => prepared,
        Err(e) => return e,
    };
    let args = Args {
        config_fd: config_fd.as_raw_fd(),
        report_boot_time,
        outcome_fd: None,
    };
    let mut command = vmm_command(&path, args.to_args(), vec![config_fd.as_raw_fd()]);
    let source = command.exec();
    VmmProcessError::Start { path, source }
}

/// Runs `config` in a VMM child process to its end: its exit code (0 after a guest
/// shutdown, 128+N when stopped by signal N), or how it failed. SIGINT and SIGTERM
/// sent to this process are passed on to the VMM, which stops the VM; a VMM that has
/// not ended [`STOP_GRACE`] later is killed (and counts as stopped by that signal).
/// The VMM gets SIGKILL if this thread ends first. `on_event` gets each [`Event`] the
/// VMM reports as it comes, while the VM runs.
pub fn run(
    config: &VmConfig,
    report_boot_time: bool,
    mut on_event: impl FnMut(Event),
) -> Result<u8, VmmProcessError> {
    run_binary(
        &binary()?,
        config,
        report_boot_time,
        STOP_GRACE,
        &mut on_event,
    )
}

/// Why [`run_with_shares`] failed.
#[derive(Debug, thiserror::Error)]
pub enum RunWithSharesError {
    #[error(transparent)]
    Vmm(#[from] VmmProcessError),
    #[error(transparent)]
    Virtiofsd(#[from] crate::virtiofsd::VirtiofsdError),
}

/// Runs the VMM in a child process ([`run`]) with one virtiofsd per share, started
/// here (so inside the nested host when there is one), their sockets in `socket_dir`,
/// their logs in `log_dir`: how a workspace VM's supervisor, and the nested host's
/// init, run its VM.
pub fn run_with_shares(
    config: &VmConfig,
    shares: Option<&ShareSet>,
    socket_dir: &Path,
    log_dir: &Path,
    report_boot_time: bool,
) -> Result<u8, RunWithSharesError> {
    let Some(set) = shares.filter(|set| !set.shares.is_empty()) else {
        // The daemons of `--fs` are the user's: only they can end one.
        return Ok(run(config, report_boot_time, |event| match event {
            Event::FsBackendGivenUp { tag, reason } => vmm::to_stderr!(
                "vmctl: warning: the VMM gave up on the virtio-fs backend of {tag:?} \
                     ({reason}); end that virtiofsd, and the guest's requests to the share \
                     then fail with EIO instead of waiting"
            ),
        })?);
    };
    let (daemons, filesystems) =
        crate::virtiofsd::start(&set.virtiofsd, &set.shares, socket_dir, log_dir, set.cache)?;
    if let Some(file) = &set.failure_file {
        daemons.record_failures_in(file.clone());
    }
    let mut config = config.clone();
    config.filesystems = filesystems;
    let outcome = run(&config, report_boot_time, |event| match event {
        Event::FsBackendGivenUp { tag, reason } => daemons.give_up(&tag, &reason),
    });
    daemons.stop();
    Ok(outcome?)
}

/// How long the VMM has to end after a stop signal was passed on to it, before it is
/// killed. Well within the 10 s `vmctl stop` gives this process after its SIGTERM
/// before it kills it, so that this process still removes what the VM leaves.
const STOP_GRACE: Duration = Duration::from_secs(5);

fn run_binary(
    path: &Path,
    config: &VmConfig,
    report_boot_time: bool,
    stop_grace: Duration,
    on_event: &mut dyn FnMut(Event),
) -> Result<u8, VmmProcessError> {
    let config_fd = config_file(config)?;
    let (mut outcome_reader, outcome_writer) = std::io::pipe().map_err(VmmProcessError::Setup)?;
    let outcome_writer = above_stdio(outcome_writer.into())?;
    let args = Args {
        config_fd: config_fd.as_raw_fd(),
        report_boot_time,
        outcome_fd: Some(outcome_writer.as_raw_fd()),
    };
    forward_stop_signals()?;
    FORWARDED.store(0, Ordering::SeqCst);
    let mut child = spawn(
        path,
        args.to_args(),
        vec![config_fd.as_raw_fd(), outcome_writer.as_raw_fd()],
    )?;
    drop(config_fd);
    let pid = child.id();
    FORWARD_TO.store(child_pid(pid), Ordering::SeqCst);
    forward_pending();
    // Only the child holds the writing end now: end of file is the VMM's exit.
    drop(outcome_writer);
    let (report, killed_after) = read_report(&mut outcome_reader, &mut child, stop_grace, on_event);
    let status = wait(child);
    FORWARD_TO.store(0, Ordering::SeqCst);
    let outcome = report.ok().and_then(|report| outcome_of(&report));
    let stop_signal = status
        .and_then(|s| s.signal())
        .filter(|signal| STOP_SIGNALS.contains(signal))
        .or(killed_after);
    match (outcome, stop_signal) {
        (Some(outcome), _) => match outcome.error() {
            None => Ok(outcome.exit_code()),
            Some(error) => Err(VmmProcessError::Vm(error)),
        },
        // Stopped before it could handle the signal (one passed on as it started), or
        // killed when it did not end in time after it.
        (None, Some(signal)) => Ok(Outcome::Stopped { signal }.exit_code()),
        (None, None) => {
            let mut how = describe(status);
            if status.and_then(|s| s.signal()) == Some(libc::SIGKILL)
                && killed_for_memory(&kernel_log(), pid)
            {
                how.push_str(
                    " by the kernel, which had run out of memory (in the nested host, if \
                     the VM runs there: one whose guest fills its memory leaves it little)",
                );
            }
            Err(VmmProcessError::Lost { pid, how })
        }
    }
}

/// The VMM's report, read until it exits (end of file: only it holds the pipe's
/// writing end); each [`Event`] line in it goes to `on_event` as it comes, and is left
/// out of the report. A VMM that has not exited `grace` after a stop signal was passed on
/// to it is killed, as it would otherwise keep this process waiting, and run on
/// after `vmctl stop` kills this process; then also the signal it was killed after.
fn read_report(
    reader: &mut std::io::PipeReader,
    child: &mut std::process::Child,
    grace: Duration,
    on_event: &mut dyn FnMut(Event),
) -> (std::io::Result<String>, Option<i32>) {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    const AT_MOST: Duration = Duration::from_secs(1);
    let mut report = Vec::new();
    // How much of `report` is whole lines already looked at for events.
    let mut events_end = 0;
    let mut stopping: Option<(i32, Instant)> = None;
    let mut killed_after = None;
    let read = loop {
        // Checked every second at least while the VM runs: the signal may have come
        // to another thread of this process, which does not interrupt the poll.
        let mut nap = AT_MOST;
        if killed_after.is_none() {
            let signal = FORWARDED.load(Ordering::SeqCst);
            match stopping {
                None if signal != 0 => stopping = Some((signal, Instant::now())),
                Some((signal, since)) if since.elapsed() >= grace => {
                    vmm::to_stderr!(
                        "vmctl: the VMM (pid {}) did not stop within {} s of signal {signal}; \
                         killing it",
                        child.id(),
                        grace.as_secs_f64()
                    );
                    // Not reaped before `wait`, so the pid is still the VMM's.
                    let _ = child.kill();
                    killed_after = Some(signal);
                }
                _ => {}
            }
            if let Some((_, since)) = stopping {
                nap = nap.min(grace.saturating_sub(since.elapsed()));
            }
        }
        let timeout = Timespec::try_from(nap).unwrap_or(Timespec {
            tv_sec: 1,
            tv_nsec: 0,
        });
        let mut fds = [PollFd::new(&*reader, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => break Err(e.into()),
        }
        let mut chunk = [0; 4096];
        match reader.read(&mut chunk) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                report.extend_from_slice(&chunk[..n]);
                take_events(&mut report, &mut events_end, on_event);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    let report = read.and_then(|()| String::from_utf8(report).map_err(std::io::Error::other));
    (report, killed_after)
}

/// Hands each whole line of `report` from `looked_at` on that is an [`Event`] to
/// `on_event` and removes it. Of the other lines only the last stays, before
/// `looked_at`: the outcome is the VMM's last line, and one followed by another is an
/// event this vmctl does not know (from a newer VMM), skipped. Blank lines go too.
fn take_events(report: &mut Vec<u8>, looked_at: &mut usize, on_event: &mut dyn FnMut(Event)) {
    while let Some(length) = report[*looked_at..].iter().position(|&b| b == b'\n') {
        let line = *looked_at..*looked_at + length + 1;
        let text = &report[line.clone()];
        if text.trim_ascii().is_empty() {
            report.drain(line);
            continue;
        }
        if let Ok(event) = serde_json::from_slice::<Event>(text) {
            report.drain(line);
            on_event(event);
            continue;
        }
        if *looked_at > 0 {
            tracing::debug!(
                "skipping a line from the VMM that is no event this vmctl knows: {}",
                String::from_utf8_lossy(&report[..*looked_at]).trim_end()
            );
            report.drain(..*looked_at);
        }
        *looked_at = length + 1;
    }
}

/// The VMM's outcome: its report's last line that is not blank (earlier ones are
/// events this vmctl does not know). None if that is no [`Outcome`].
fn outcome_of(report: &str) -> Option<Outcome> {
    let last = report.lines().rev().find(|line| !line.trim().is_empty())?;
    match serde_json::from_str::<Outcome>(last.trim()) {
        Ok(outcome) => Some(outcome),
        Err(e) => {
            tracing::warn!("the VMM's last line is no outcome this vmctl knows ({e}): {last}");
            None
        }
    }
}

/// The VM's configuration in a memory file, read from the start by the VMM.
fn config_file(config: &VmConfig) -> Result<OwnedFd, VmmProcessError> {
    let json = encode_config(config)?;
    let fd = rustix::fs::memfd_create("vmctl-vmm-config", rustix::fs::MemfdFlags::CLOEXEC)
        .map_err(|e| VmmProcessError::Setup(e.into()))?;
    let mut file = File::from(above_stdio(fd)?);
    file.write_all(&json)
        .and_then(|()| file.seek(SeekFrom::Start(0)))
        .map_err(VmmProcessError::Setup)?;
    Ok(file.into())
}

/// `fd`, or a duplicate numbered 3 or above, as the VMM requires (0 to 2 are its
/// console and stderr) even where this process runs with a standard descriptor closed.
fn above_stdio(fd: OwnedFd) -> Result<OwnedFd, VmmProcessError> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    // A duplicate takes the lowest free number from 3 on (F_DUPFD_CLOEXEC).
    fd.try_clone().map_err(VmmProcessError::Setup)
}

/// The VMM at `path` with `args`: its variables alone, and of this process's
/// descriptors only `fds` ([`only_the_vmms_variables`], [`keep_across_exec`]).
fn vmm_command(path: &Path, args: Vec<OsString>, fds: Vec<i32>) -> Command {
    let mut command = Command::new(path);
    command.args(args);
    only_the_vmms_variables(&mut command);
    keep_across_exec(&mut command, fds);
    command
}

/// The variables of this process's environment the VMM reads; it gets no other.
const VMM_VARIABLES: &[&str] = &[
    vmm::process::SECCOMP_SWITCH_ENV,
    vmm::process::VCPU_CPUS_ENV,
    "VMCTL_LOG",
    "RUST_BACKTRACE",
];

/// Clears the VMM's environment but for [`VMM_VARIABLES`]: the user's (a token in
/// `GITHUB_TOKEN`, `SSH_AUTH_SOCK`) would sit in the memory of the process the guest
/// is closest to, where reading it takes no system call a filter could refuse.
fn only_the_vmms_variables(command: &mut Command) {
    command.env_clear();
    for name in VMM_VARIABLES {
        if let Some(value) = std::env::var_os(name) {
            command.env(name, value);
        }
    }
}

/// Clears close-on-exec on `fds` in the child, between fork and exec, and sets it on
/// every other descriptor ([`close_inherited_at_exec`]).
fn keep_across_exec(command: &mut Command, fds: Vec<i32>) {
    // SAFETY: the closure runs in the child between fork and exec (or before this
    // process's own exec) and only makes system calls (close_range, fcntl), which are
    // async-signal-safe.
    unsafe {
        command.pre_exec(move || {
            // The VMM holds what it was given, nothing else.
            close_inherited_at_exec();
            for &fd in &fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// Makes `command`'s process start with standard input, output and error alone of
/// this process's descriptors ([`close_inherited_at_exec`]), for the processes vmctl
/// leaves running (a VM's supervisor, the daemon): one that kept the end of a pipe
/// its caller gave vmctl would keep that caller waiting for the pipe's end of file
/// as long as it runs.
pub(crate) fn start_without_inherited_descriptors(command: &mut Command) {
    // SAFETY: the closure runs in the child between fork and exec, after its standard
    // descriptors are set up, and only makes a system call (close_range), which is
    // async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            close_inherited_at_exec();
            Ok(())
        });
    }
}

/// Sets close-on-exec on every descriptor from 3 on, whatever this process inherited
/// without it (from an IDE, an agent harness). For a child between fork and exec: a
/// system call alone, async-signal-safe. (An old kernel without close_range leaves
/// them as they are.)
fn close_inherited_at_exec() {
    // SAFETY: close_range(2) with CLOSE_RANGE_CLOEXEC only sets a flag on this
    // process's descriptors; it touches no memory.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
    }
}

fn spawn(
    path: &Path,
    args: Vec<OsString>,
    inherited_fds: Vec<i32>,
) -> Result<std::process::Child, VmmProcessError> {
    let mut command = vmm_command(path, args, inherited_fds);
    // SIGKILL, not SIGTERM: when this process dies (`vmctl stop` kills it when the
    // VM did not stop in time) the VMM may be the reason, stuck in the stop a SIGTERM
    // asks for; it must not run on as an orphan. What the VMM would remove at a clean
    // stop, its vsock socket, the next VMM replaces.
    vmm::process::child::kill_with_parent(&mut command);
    command.spawn().map_err(|source| VmmProcessError::Start {
        path: path.to_path_buf(),
        source,
    })
}

fn wait(mut child: std::process::Child) -> Option<ExitStatus> {
    loop {
        match child.wait() {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return None,
            Ok(status) => return Some(status),
        }
    }
}

/// What the kernel's log holds now (`/dev/kmsg`, one record per read), if this
/// process may read it: root may, as the nested host's init is; others where
/// `kernel.dmesg_restrict` is 0.
fn kernel_log() -> String {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(mut kmsg) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
    else {
        return String::new();
    };
    let mut log = String::new();
    let mut record = vec![0u8; 8192];
    // Ends at the log's end (EAGAIN); a record overwritten meanwhile (EPIPE) is
    // skipped. Bounded all the same: the ring holds a few MiB at most.
    for _ in 0..100_000 {
        match kmsg.read(&mut record) {
            Ok(0) => break,
            Ok(n) => {
                log.push_str(&String::from_utf8_lossy(&record[..n]));
                if !log.ends_with('\n') {
                    log.push('\n');
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    log
}

/// Whether the kernel's log says its OOM killer killed process `pid` ("Out of memory:
/// Killed process 55 (vmctl-vmm) ...", or a cgroup's "Memory cgroup out of memory").
fn killed_for_memory(kernel_log: &str, pid: u32) -> bool {
    let killed = format!("Killed process {pid} (");
    kernel_log.lines().any(|line| line.contains(&killed))
}

fn describe(status: Option<ExitStatus>) -> String {
    match status {
        None => "was lost (cannot wait for it)".to_string(),
        Some(status) => match (status.code(), status.signal()) {
            (Some(code), _) => format!("exited with code {code}"),
            (None, Some(libc::SIGSYS)) => format!(
                "was killed by signal {} (SIGSYS: a system call its seccomp filter does not \
                 allow; {}=off runs it without the filter)",
                libc::SIGSYS,
                vmm::process::SECCOMP_SWITCH_ENV
            ),
            (None, Some(signal)) => format!("was killed by signal {signal}"),
            (None, None) => format!("ended ({status})"),
        },
    }
}

/// The pid of the VMM child this process runs now, if any.
pub fn running_vmm_pid() -> Option<u32> {
    u32::try_from(FORWARD_TO.load(Ordering::SeqCst))
        .ok()
        .filter(|&pid| pid != 0)
}

/// Whether the VMM child this process runs is still running: one that exited counts
/// as ended before [`run`] has waited for it.
pub fn vmm_running() -> bool {
    running_vmm_pid().is_some_and(child_running)
}

/// Whether this process's child `pid` has not exited. NOWAIT: looked at, not reaped
/// (its parent thread waits for it).
fn child_running(pid: u32) -> bool {
    use rustix::process::{waitid, Pid, WaitId, WaitIdOptions};
    let Some(pid) = Pid::from_raw(child_pid(pid)) else {
        return false;
    };
    let options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT;
    matches!(waitid(WaitId::Pid(pid), options), Ok(None))
}

fn child_pid(id: u32) -> i32 {
    i32::try_from(id).unwrap_or(0)
}

/// The VMM child that stop signals go to (0: none yet), and a signal not passed on
/// yet. Statics, because a signal handler can reach nothing else: a process runs one
/// VMM child at a time (a supervisor's VM, the nested host's).
static FORWARD_TO: AtomicI32 = AtomicI32::new(0);
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// The last stop signal passed on to the VMM child (0: none yet).
static FORWARDED: AtomicI32 = AtomicI32::new(0);

/// The signals the VMM turns into a stop of the VM.
const STOP_SIGNALS: [i32; 2] = [libc::SIGINT, libc::SIGTERM];

fn forward_stop_signals() -> Result<(), VmmProcessError> {
    for signal in STOP_SIGNALS {
        register_signal_handler(signal, on_stop_signal)
            .map_err(|e| VmmProcessError::Setup(std::io::Error::from_raw_os_error(e.errno())))?;
    }
    Ok(())
}

extern "C" fn on_stop_signal(signal: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    PENDING_SIGNAL.store(signal, Ordering::SeqCst);
    forward_pending();
}

/// Sends the pending signal to the VMM once there is one. Called by the handler and
/// right after the VMM started: whichever sees both the signal and the VMM sends it,
/// once (the swap).
fn forward_pending() {
    let pid = FORWARD_TO.load(Ordering::SeqCst);
    if pid <= 0 {
        return;
    }
    let signal = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
    if signal != 0 {
        // SAFETY: kill(2) is async-signal-safe and only sends a signal.
        unsafe { libc::kill(pid, signal) };
        FORWARDED.store(signal, Ordering::SeqCst);
    }
}

/// The descriptors of the process `spawn` starts that are the writing end of a pipe
/// this process held without close-on-exec as `spawn` ran (as a caller of vmctl may
/// pass one), by their /proc paths; the process is killed then.
#[cfg(test)]
pub(crate) fn inherited_pipe_ends(spawn: impl FnOnce() -> std::process::Child) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let (_reader, writer) = std::io::pipe().unwrap();
    // SAFETY: F_SETFD on a descriptor this function holds.
    assert_eq!(
        unsafe { libc::fcntl(writer.as_raw_fd(), libc::F_SETFD, 0) },
        0
    );
    let pipe = std::fs::metadata(format!("/proc/self/fd/{}", writer.as_raw_fd()))
        .unwrap()
        .ino();
    let mut child = {
        let _forking = crate::state::no_forks_meanwhile();
        spawn()
    };
    drop(writer);
    // The child has exec'd by now (spawn returns once it has).
    let held = std::fs::read_dir(format!("/proc/{}/fd", child.id()))
        .unwrap()
        .flatten()
        .map(|fd| fd.path())
        .filter(|fd| std::fs::metadata(fd).is_ok_and(|m| m.ino() == pipe))
        .collect();
    let _ = child.kill();
    let _ = child.wait();
    held
}

/// Writes an executable shell script.
#[cfg(test)]
pub(crate) fn script(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oom_kill_of_the_vmm_is_found_in_the_kernels_log() {
        let log = "6,1024,5000,-;vmctl-vmm invoked oom-killer: gfp_mask=0x140cca\n\
                   3,1090,5100,-;Out of memory: Killed process 55 (vmctl-vmm) total-vm:5300000kB, anon-rss:1200kB\n";
        assert!(killed_for_memory(log, 55));
        assert!(!killed_for_memory(log, 5), "another pid");
        assert!(!killed_for_memory("3,1,1,-;Killed process 550 (x)\n", 55));
    }

    /// A child that exited counts as ended before it is waited for, and looking
    /// leaves it for `run` to wait for, with its status.
    #[test]
    fn an_exited_child_is_not_running_and_is_left_to_wait_for() {
        let mut child = Command::new("/bin/sh")
            .args(["-c", "read line; exit 3"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        assert!(child_running(child.id()));
        drop(child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while child_running(child.id()) {
            assert!(Instant::now() < deadline, "the child still runs");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(child.wait().unwrap().code(), Some(3));
        assert!(!child_running(child.id()));
    }

    /// The VMM gets the descriptors it is given, and no other this process holds,
    /// close-on-exec or not.
    #[test]
    fn the_vmm_gets_only_the_descriptors_it_is_given() {
        // Far above the lowest free number, which `ls` takes for its own listing of
        // /proc/self/fd and would then list as if it had been passed on.
        let stray = descriptor_at_or_above(100);
        let given = descriptor_at_or_above(200);
        // SAFETY: F_SETFD on a descriptor this test holds.
        assert_eq!(
            unsafe { libc::fcntl(stray.as_raw_fd(), libc::F_SETFD, 0) },
            0
        );
        let mut ls = Command::new("/bin/ls");
        ls.arg("/proc/self/fd");
        keep_across_exec(&mut ls, vec![given.as_raw_fd()]);
        let listed = String::from_utf8(ls.output().unwrap().stdout).unwrap();
        let fds: Vec<&str> = listed.lines().collect();
        assert!(
            fds.contains(&given.as_raw_fd().to_string().as_str()),
            "{fds:?}"
        );
        assert!(
            !fds.contains(&stray.as_raw_fd().to_string().as_str()),
            "{fds:?}"
        );
    }

    fn descriptor_at_or_above(lowest: i32) -> OwnedFd {
        let null = File::open("/dev/null").unwrap();
        // SAFETY: duplicates a descriptor this test holds; the new one is owned by the
        // returned OwnedFd alone.
        let fd = unsafe { libc::fcntl(null.as_raw_fd(), libc::F_DUPFD_CLOEXEC, lowest) };
        assert!(fd >= lowest, "{}", std::io::Error::last_os_error());
        // SAFETY: `fd` was just made by F_DUPFD_CLOEXEC and nothing else owns it.
        unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }
    }

    /// The VMM sees none of the user's variables (PATH and HOME stand for them: any
    /// test run has them), only those it reads.
    #[test]
    fn the_vmm_gets_only_its_own_variables() {
        assert!(std::env::var_os("PATH").is_some());
        let mut env = Command::new("/usr/bin/env");
        only_the_vmms_variables(&mut env);
        let output = env.output().unwrap();
        let listed = String::from_utf8_lossy(&output.stdout);
        for line in listed.lines() {
            let name = line.split('=').next().unwrap_or_default();
            assert!(VMM_VARIABLES.contains(&name), "{line}");
        }
    }

    /// A stand-in for the VMM: a shell script that reports `outcome` on the
    /// descriptor it is given (or nothing when empty), then exits with `code`. The
    /// stand-ins that use a descriptor they are given run in bash: dash redirects
    /// one-digit descriptors only, and the test process may hold ten or more.
    fn stand_in(dir: &Path, outcome: &str, code: i32) -> PathBuf {
        let path = dir.join(BINARY);
        script(
            &path,
            &format!(
                "#!/bin/bash\nwhile [ $# -gt 0 ]; do [ \"$1\" = --outcome-fd ] && fd=$2; shift; done\n\
                 [ -n '{outcome}' ] && echo '{outcome}' >&$fd\nexit {code}\n"
            ),
        );
        path
    }

    fn run_with(path: &Path) -> Result<u8, VmmProcessError> {
        run_with_grace(path, STOP_GRACE)
    }

    fn run_with_grace(path: &Path, stop_grace: Duration) -> Result<u8, VmmProcessError> {
        run_with_events(path, stop_grace, &mut |event| {
            panic!("unexpected event: {event:?}")
        })
    }

    fn run_with_events(
        path: &Path,
        stop_grace: Duration,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<u8, VmmProcessError> {
        // One VMM child at a time per process, as in vmctl (the signal forwarding's
        // statics).
        static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        run_binary(
            path,
            &VmConfig::new("/k/vmlinux".into()),
            false,
            stop_grace,
            on_event,
        )
    }

    /// Waits up to 20 s for `path` to exist.
    fn wait_for_file(path: &Path, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !path.exists() {
            assert!(
                Instant::now() < deadline,
                "{what}: {} never came",
                path.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether `pid` is a process that runs (not gone, nor a zombie left unreaped).
    fn runs(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            !stat
                .rsplit_once(") ")
                .is_some_and(|(_, state)| state.starts_with('Z'))
        })
    }

    /// A stand-in for a VMM stuck in its stop: it writes its pid to `pid_file`, notes
    /// each SIGTERM in `asked` and goes on.
    fn stuck_in_its_stop(dir: &Path, pid_file: &Path, asked: &Path) -> PathBuf {
        let path = dir.join(BINARY);
        script(
            &path,
            &format!(
                "#!/bin/sh\ntrap 'touch {asked}' TERM\n\
                 echo $$ > {pid}.tmp; mv {pid}.tmp {pid}\nwhile :; do sleep 0.1; done\n",
                pid = pid_file.display(),
                asked = asked.display()
            ),
        );
        path
    }

    /// A VMM that does not end after the stop signal passed on to it is killed, and
    /// the VM counts as stopped by that signal (not crashed).
    #[test]
    fn a_vmm_that_does_not_stop_when_told_is_killed() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("vmm.pid");
        let asked = dir.path().join("asked");
        let path = stuck_in_its_stop(dir.path(), &pid_file, &asked);
        let signaller = {
            let pid_file = pid_file.clone();
            std::thread::spawn(move || {
                wait_for_file(&pid_file, "the stand-in's pid");
                // SAFETY: signals this process, whose SIGTERM handler `run_binary`
                // installed before it started the stand-in that wrote its pid.
                unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
            })
        };
        let started = Instant::now();
        assert_eq!(
            run_with_grace(&path, Duration::from_millis(300)).unwrap(),
            128 + 15
        );
        signaller.join().unwrap();
        assert!(asked.exists(), "the stop signal was passed on first");
        assert!(started.elapsed() < Duration::from_secs(15));
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(!runs(pid), "the stand-in (pid {pid}) still runs");
    }

    const AS_SUPERVISOR: &str = "VMCTL_TEST_RUN_AS_SUPERVISOR";

    /// When `vmctl stop` kills the supervisor of a VMM stuck in its stop (before the
    /// supervisor's own grace is over), the VMM goes with it.
    #[test]
    fn a_vmm_stuck_in_its_stop_does_not_outlive_its_killed_supervisor() {
        if let Some(vmm) = std::env::var_os(AS_SUPERVISOR) {
            // The supervisor, in a process of its own: this test run again.
            let _ = run_binary(
                Path::new(&vmm),
                &VmConfig::new("/k/vmlinux".into()),
                false,
                STOP_GRACE,
                &mut |_| {},
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("vmm.pid");
        let asked = dir.path().join("asked");
        let vmm = stuck_in_its_stop(dir.path(), &pid_file, &asked);
        let mut supervisor = {
            let _forking = crate::state::no_forks_meanwhile();
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "vmm_process::tests::a_vmm_stuck_in_its_stop_does_not_outlive_its_killed_supervisor",
                    "--exact",
                    "--test-threads=1",
                ])
                .env(AS_SUPERVISOR, &vmm)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        };
        wait_for_file(&pid_file, "the VMM's pid");
        let vmm_pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // SAFETY: signals our child, not yet reaped.
        unsafe { libc::kill(supervisor.id() as i32, libc::SIGTERM) };
        wait_for_file(&asked, "the VMM's SIGTERM");
        supervisor.kill().unwrap();
        supervisor.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        while runs(vmm_pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let alive = runs(vmm_pid);
        if alive {
            // SAFETY: the stand-in this test started, seen running just now.
            unsafe { libc::kill(vmm_pid, libc::SIGKILL) };
        }
        assert!(
            !alive,
            "the VMM (pid {vmm_pid}) outlived its killed supervisor: an orphan"
        );
    }

    #[test]
    fn a_sigterm_to_vmctl_is_passed_on_to_the_vmm() {
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("ready");
        let path = dir.path().join(BINARY);
        // Reports "stopped by 15" only if it gets SIGTERM; otherwise gives up after
        // 10 s with a shutdown.
        let text = format!(
            "#!/bin/bash\nwhile [ $# -gt 0 ]; do [ \"$1\" = --outcome-fd ] && fd=$2; shift; done\n\
             trap 'echo {{\\\"stopped\\\":{{\\\"signal\\\":15}}}} >&$fd; exit 143' TERM\n\
             touch {}\nfor i in $(seq 100); do sleep 0.1; done\necho '\"shutdown\"' >&$fd\n",
            ready.display()
        );
        script(&path, &text);
        let signaller = std::thread::spawn(move || {
            while !ready.exists() {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            // SAFETY: signals this process, whose SIGTERM handler `run` installed
            // before it started the stand-in that created `ready`.
            unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
        });
        assert_eq!(run_with(&path).unwrap(), 128 + 15);
        signaller.join().unwrap();
    }

    #[test]
    fn the_vmm_s_report_decides_the_result() {
        let dir = tempfile::tempdir().unwrap();
        let shutdown = stand_in(dir.path(), r#""shutdown""#, 0);
        assert_eq!(run_with(&shutdown).unwrap(), 0);
        let stopped = stand_in(dir.path(), r#"{"stopped":{"signal":15}}"#, 143);
        assert_eq!(run_with(&stopped).unwrap(), 143);
        let crashed = stand_in(dir.path(), r#"{"crashed":{"reason":"triple fault"}}"#, 1);
        assert_eq!(
            run_with(&crashed).unwrap_err().to_string(),
            "the VM stopped: triple fault"
        );
    }

    /// An event the VMM reports while the VM runs reaches the caller then, not when
    /// the VMM has ended: the stand-in waits for the caller's answer to it before it
    /// reports its outcome. The event lines are no part of the outcome.
    #[test]
    fn the_vmms_events_are_handed_on_as_they_come() {
        let dir = tempfile::tempdir().unwrap();
        let answer = dir.path().join("answered");
        let path = dir.path().join(BINARY);
        let event = Event::FsBackendGivenUp {
            tag: "vmctl1".into(),
            reason: "it did not answer GET_VRING_BASE".into(),
        };
        let event_file = dir.path().join("event");
        std::fs::write(&event_file, event.to_line()).unwrap();
        script(
            &path,
            &format!(
                "#!/bin/bash\nwhile [ $# -gt 0 ]; do [ \"$1\" = --outcome-fd ] && fd=$2; shift; done\n\
                 cat '{event}' >&$fd\n\
                 for i in $(seq 500); do [ -e '{answer}' ] && break; sleep 0.01; done\n\
                 if [ -e '{answer}' ]; then echo '\"shutdown\"' >&$fd; fi\n",
                event = event_file.display(),
                answer = answer.display()
            ),
        );
        let mut heard = Vec::new();
        let result = run_with_events(&path, STOP_GRACE, &mut |event| {
            std::fs::write(&answer, "").unwrap();
            heard.push(event);
        });
        assert_eq!(result.unwrap(), 0, "the event came only at the end");
        assert_eq!(heard, [event]);
    }

    #[test]
    fn events_are_taken_out_of_the_report_line_by_line() {
        let event = Event::FsBackendGivenUp {
            tag: "vmctl0".into(),
            reason: "refused SET_MEM_TABLE".into(),
        };
        let line = event.to_line();
        let mut heard = Vec::new();
        let mut report = Vec::new();
        let mut looked_at = 0;
        // In pieces, as a pipe may give them: half an event, the rest, the outcome.
        let (first, second) = line.as_bytes().split_at(10);
        for piece in [first, second, b"\"shutdown\"\n"] {
            report.extend_from_slice(piece);
            take_events(&mut report, &mut looked_at, &mut |e| heard.push(e));
        }
        assert_eq!(heard, [event]);
        assert_eq!(report, b"\"shutdown\"\n");
    }

    /// A line this vmctl does not know (an event of a newer VMM) is skipped, as it
    /// comes or at the end, and the last line is still the outcome: the run is not
    /// taken for lost.
    #[test]
    fn unknown_lines_before_the_outcome_are_skipped() {
        let event = Event::FsBackendGivenUp {
            tag: "vmctl0".into(),
            reason: "refused SET_MEM_TABLE".into(),
        };
        let unknown = "{\"balloon_deflated\":{\"pages\":12}}\n";
        let mut heard = Vec::new();
        let mut report = Vec::new();
        let mut looked_at = 0;
        for piece in [
            unknown,
            "\n",
            &event.to_line(),
            unknown,
            "{\"crashed\":{\"reason\":",
            "\"triple fault\"}}",
        ] {
            report.extend_from_slice(piece.as_bytes());
            take_events(&mut report, &mut looked_at, &mut |e| heard.push(e));
        }
        assert_eq!(heard, [event]);
        let report = String::from_utf8(report).unwrap();
        assert_eq!(
            outcome_of(&report),
            Some(Outcome::Crashed {
                reason: "triple fault".into()
            }),
            "{report:?}"
        );
        // The outcome alone is kept of the whole lines once it is followed by nothing.
        let mut report = format!("{unknown}\"shutdown\"\n").into_bytes();
        let mut looked_at = 0;
        take_events(&mut report, &mut looked_at, &mut |e| panic!("{e:?}"));
        assert_eq!(report, b"\"shutdown\"\n");
        assert_eq!(outcome_of("\"shutdown\"\n\n"), Some(Outcome::Shutdown));
        assert_eq!(outcome_of(unknown), None);
        assert_eq!(outcome_of(""), None);
    }

    /// A newer VMM's unknown event before its outcome does not make the run lost.
    #[test]
    fn a_newer_vmms_unknown_event_does_not_lose_the_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(BINARY);
        script(
            &path,
            "#!/bin/bash\nwhile [ $# -gt 0 ]; do [ \"$1\" = --outcome-fd ] && fd=$2; shift; done\n\
             echo '{\"balloon_deflated\":{\"pages\":12}}' >&$fd\necho '\"shutdown\"' >&$fd\n",
        );
        assert_eq!(run_with(&path).unwrap(), 0);
    }

    #[test]
    fn the_vmm_reads_its_configuration_from_its_descriptor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(BINARY);
        let text = "#!/bin/bash\nwhile [ $# -gt 0 ]; do case $1 in --outcome-fd) out=$2;; \
                      --config-fd) cfg=$2;; esac; shift; done\n\
                      eval \"exec 4<&$cfg\"\n\
                      grep -q '\"kernel\":\"/k/vmlinux\"' <&4 && echo '\"shutdown\"' >&$out\n";
        script(&path, text);
        assert_eq!(run_with(&path).unwrap(), 0);
    }

    #[test]
    fn a_vmm_ended_by_a_stop_signal_before_its_report_was_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(BINARY);
        script(&path, "#!/bin/sh\nkill -TERM $$\nsleep 10\n");
        assert_eq!(run_with(&path).unwrap(), 128 + 15);
    }

    #[test]
    fn a_vmm_that_says_nothing_is_reported_lost() {
        let dir = tempfile::tempdir().unwrap();
        let silent = stand_in(dir.path(), "", 0);
        let error = run_with(&silent).unwrap_err().to_string();
        assert!(
            error.contains("exited with code 0 without saying how the VM ended"),
            "{error}"
        );
        let killed = dir.path().join("killed");
        script(&killed, "#!/bin/sh\nkill -KILL $$\n");
        let error = run_with(&killed).unwrap_err().to_string();
        assert!(error.contains("was killed by signal 9 without"), "{error}");
        // What the kernel does to a filtered call made with SIGSYS blocked.
        let filtered = dir.path().join("filtered");
        script(&filtered, "#!/bin/sh\nkill -SYS $$\n");
        let error = run_with(&filtered).unwrap_err().to_string();
        assert!(
            error.contains("signal 31 (SIGSYS: a system call its seccomp filter"),
            "{error}"
        );
    }

    #[test]
    fn a_missing_vmm_says_how_to_build_it() {
        let dir = tempfile::tempdir().unwrap();
        let error = existing(dir.path().join(BINARY)).unwrap_err().to_string();
        assert!(
            error.contains("cargo build --release -p vmctl") && error.contains(BINARY),
            "{error}"
        );
    }
}
