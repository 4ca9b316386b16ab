//! Running a command under a time limit, timing its exit, its first byte on stdout
//! and each line on stderr.
//!
//! The waits never depend on anything but our own clock: a command killed at its
//! deadline, or one whose descendants keep its pipes open after it exited, still
//! returns (with the output read so far) instead of hanging the benchmark.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::scan::tail;

/// How long the output is waited for once the command exited (or was killed): a
/// descendant that inherited its stdout or stderr may hold it open for ever.
const PIPE_GRACE: Duration = Duration::from_secs(5);

/// A finished command.
pub(crate) struct Ran {
    /// Spawn to exit.
    pub(crate) elapsed: Duration,
    pub(crate) status: ExitStatus,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
    /// Spawn to the first byte on stdout, if there was one.
    pub(crate) first_stdout: Option<Duration>,
    /// Each complete stderr line with the time it arrived (since spawn).
    pub(crate) stderr_lines: Vec<(Duration, String)>,
}

impl Ran {
    /// When the first stderr line containing `needle` arrived.
    pub(crate) fn stderr_line_at(&self, needle: &str) -> Option<Duration> {
        self.stderr_lines
            .iter()
            .find(|(_, line)| line.contains(needle))
            .map(|(at, _)| *at)
    }
}

/// What a reader thread has seen so far; shared, so a reader stuck on a pipe that
/// never closes still gives up what it read.
#[derive(Default)]
pub(crate) struct Seen {
    bytes: Vec<u8>,
    first: Option<Instant>,
    lines: Vec<(Instant, String)>,
    /// Bytes of `bytes` already split into `lines`.
    lined: usize,
}

/// Reads `pipe` to its end on a thread of its own, into what it returns.
pub(crate) fn reader(mut pipe: impl Read + Send + 'static, split_lines: bool) -> Arc<Mutex<Seen>> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let shared = Arc::clone(&seen);
    thread::spawn(move || {
        let mut buf = [0u8; 8192];
        loop {
            let n = match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            let now = Instant::now();
            let Ok(mut s) = shared.lock() else { break };
            s.first.get_or_insert(now);
            s.bytes.extend_from_slice(&buf[..n]);
            if !split_lines {
                continue;
            }
            while let Some(end) = s.bytes[s.lined..].iter().position(|b| *b == b'\n') {
                let line = String::from_utf8_lossy(&s.bytes[s.lined..s.lined + end]).into_owned();
                s.lined += end + 1;
                s.lines.push((now, line));
            }
        }
    });
    seen
}

/// The text `seen` holds so far.
pub(crate) fn text_so_far(seen: &Mutex<Seen>) -> String {
    seen.lock()
        .map(|s| String::from_utf8_lossy(&s.bytes).into_owned())
        .unwrap_or_default()
}

/// How [`run_command`]'s error for a command it had to kill begins, after its name.
pub(crate) const TIMED_OUT: &str = "did not finish within";

/// Runs `cmd` (stdin `/dev/null`, stdout and stderr captured) and times it from spawn
/// to exit; after `timeout` it is killed, with its whole process group if `own_group`
/// (which puts it in a group of its own), and that is an error carrying the output
/// so far. `line` names it in errors.
pub(crate) fn run_command(
    mut cmd: Command,
    line: &str,
    timeout: Duration,
    own_group: bool,
) -> Result<Ran, String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if own_group {
        cmd.process_group(0);
    }
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("cannot run {line}: {e}"))?;
    let pid = child.id();
    let out = reader(child.stdout.take().expect("piped"), false);
    let err = reader(child.stderr.take().expect("piped"), true);
    // Waiting on a thread gives the exit time exactly (no polling interval).
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let status = child.wait();
        let _ = tx.send((status, Instant::now()));
    });
    let finished = rx.recv_timeout(timeout);
    if matches!(
        finished,
        Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected)
    ) {
        let target = if own_group {
            format!("-{pid}")
        } else {
            pid.to_string()
        };
        let _ = Command::new("kill")
            .args(["-KILL", "--", &target])
            .stderr(Stdio::null())
            .status();
    }
    // The readers get a moment to drain what is left, bounded by our clock alone.
    let drained = Instant::now() + PIPE_GRACE;
    while Instant::now() < drained
        && !(Arc::strong_count(&out) == 1 && Arc::strong_count(&err) == 1)
    {
        thread::sleep(Duration::from_millis(5));
    }
    let take = |seen: &Arc<Mutex<Seen>>| match seen.lock() {
        Ok(s) => (
            String::from_utf8_lossy(&s.bytes).into_owned(),
            s.first,
            s.lines.clone(),
        ),
        Err(_) => (String::new(), None, Vec::new()),
    };
    let (stdout, first, _) = take(&out);
    let (stderr, _, lines) = take(&err);
    let (status, ended) = match finished {
        Ok((status, ended)) => (status.map_err(|e| format!("{line}: wait: {e}"))?, ended),
        Err(_) => {
            return Err(format!(
                "{line} {TIMED_OUT} {} s: killed\n--- its stdout (tail) ---\n{}\n\
                 --- its stderr (tail) ---\n{}",
                timeout.as_secs(),
                tail(&stdout, 1500),
                tail(&stderr, 3000)
            ))
        }
    };
    let since = |t: Instant| t.saturating_duration_since(start);
    Ok(Ran {
        elapsed: ended - start,
        status,
        stdout,
        stderr,
        // Each thread takes its time when it gets to run: when the output comes just
        // before the exit, the reader may get there second. The bytes were written
        // before the exit, so that is the bound.
        first_stdout: first.map(|t| since(t.min(ended))),
        stderr_lines: lines
            .into_iter()
            .map(|(t, l)| (since(t.min(ended)), l))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]);
        cmd
    }

    #[test]
    fn times_exit_first_byte_and_stderr_lines() {
        let ran = run_command(
            sh("sleep 0.2; echo out; echo one >&2; sleep 0.3; echo two >&2; exit 3"),
            "sh",
            Duration::from_secs(10),
            false,
        )
        .unwrap();
        assert_eq!(ran.status.code(), Some(3));
        assert_eq!(ran.stdout, "out\n");
        assert_eq!(ran.stderr, "one\ntwo\n");
        let first = ran.first_stdout.unwrap();
        assert!(first >= Duration::from_millis(200), "{first:?}");
        let one = ran.stderr_line_at("one").unwrap();
        let two = ran.stderr_line_at("two").unwrap();
        assert!(two >= one + Duration::from_millis(250), "{one:?} {two:?}");
        assert!(ran.elapsed >= two, "{:?} {two:?}", ran.elapsed);
        assert_eq!(ran.stderr_line_at("three"), None);
    }

    #[test]
    fn a_command_past_its_deadline_is_killed_with_its_group() {
        let started = Instant::now();
        let e = run_command(
            sh("echo partial; sleep 30 & sleep 30"),
            "sleeper",
            Duration::from_millis(500),
            true,
        )
        .map(|r| r.status)
        .unwrap_err();
        assert!(e.contains("did not finish within 0 s"), "{e}");
        assert!(e.contains("partial"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_descendant_holding_the_pipes_does_not_hang_the_wait() {
        // The shell exits at once; its background sleep keeps stdout and stderr open.
        let started = Instant::now();
        let ran = run_command(
            sh("echo before; sleep 30 &"),
            "leaver",
            Duration::from_secs(10),
            false,
        )
        .unwrap();
        assert!(ran.status.success());
        assert_eq!(ran.stdout, "before\n");
        assert!(started.elapsed() < PIPE_GRACE + Duration::from_secs(3));
    }
}
