//! A bound on a child process the test waits on or reads from in ways that have no
//! timeout of their own (`wait`, `wait_with_output`, `read_to_end`, `read_line`): a
//! guest that hangs must fail the test, not hang `cargo test`.

use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Kills the watched child's process tree once its time is up, unless dropped
/// before. Dropped after firing, it panics with "timed out" (the sign of a VM lost to
/// the nested host, which has the scenario tried again), or, when the test already
/// panics over what the kill caused (a pipe's early end), marks the VM lost.
pub struct Watchdog {
    disarm: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    fired: Arc<AtomicBool>,
    what: String,
    timeout: Duration,
}

impl Watchdog {
    /// Watches `child`, described by `what` in the failure, for [`crate::vm_timeout`].
    pub fn new(child: &Child, what: &str) -> Watchdog {
        Watchdog::with_timeout(child, what, crate::vm_timeout())
    }

    pub fn with_timeout(child: &Child, what: &str, timeout: Duration) -> Watchdog {
        let (disarm, disarmed) = mpsc::channel::<()>();
        let fired = Arc::new(AtomicBool::new(false));
        let pid = child.id();
        let thread = thread::spawn({
            let fired = fired.clone();
            move || {
                if let Err(mpsc::RecvTimeoutError::Timeout) = disarmed.recv_timeout(timeout) {
                    fired.store(true, Ordering::SeqCst);
                    crate::kill_tree(pid);
                }
            }
        });
        Watchdog {
            disarm: Some(disarm),
            thread: Some(thread),
            fired,
            what: what.to_string(),
            timeout,
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.disarm.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        if self.fired.load(Ordering::SeqCst) {
            crate::mark_vm_lost();
            if !thread::panicking() {
                panic!("{} timed out after {:?}", self.what, self.timeout);
            }
        }
    }
}

/// `command`'s output, its stdout and stderr captured, within [`crate::vm_timeout`]
/// (else the panic of [`Watchdog`]); panics too when a process it left behind still
/// holds its stdout or stderr 5 s after it exited (the watchdog, which kills by
/// process group and parentage, would not find one in a session of its own).
pub fn output_within(command: &mut Command, what: &str) -> Output {
    output_within_timeout(command, what, crate::vm_timeout())
}

/// [`output_within`] for a command that may take longer than one VM's timeout.
pub fn output_within_timeout(command: &mut Command, what: &str, timeout: Duration) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let pipes = crate::Pipes::read(&mut child);
    let watchdog = Watchdog::with_timeout(&child, what, timeout);
    let status = child
        .wait()
        .unwrap_or_else(|e| panic!("waiting for {what}: {e}"));
    drop(watchdog);
    pipes.output(status, what, "its")
}

/// Waits for `child` within [`crate::vm_timeout`] (else the panic of [`Watchdog`]).
pub fn wait_within(child: &mut Child, what: &str) -> std::process::ExitStatus {
    let watchdog = Watchdog::new(child, what);
    let status = child
        .wait()
        .unwrap_or_else(|e| panic!("waiting for {what}: {e}"));
    drop(watchdog);
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_past_its_time_is_killed_and_the_wait_fails_as_timed_out() {
        let mut child = Command::new("sleep").arg("60").spawn().unwrap();
        let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _watchdog = Watchdog::with_timeout(&child, "sleep 60", Duration::from_millis(200));
            child.wait().unwrap()
        }));
        let panic = waited.expect_err("the wait outlived its watchdog");
        let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(message.contains("sleep 60 timed out after"), "{message}");
    }

    #[test]
    fn a_child_within_its_time_is_left_alone() {
        let mut child = Command::new("true").spawn().unwrap();
        let watchdog = Watchdog::with_timeout(&child, "true", Duration::from_secs(60));
        assert!(child.wait().unwrap().success());
        drop(watchdog);
    }
}
