//! Why a session's VM went away, for the error of a session (`exec`, `run`, `shell`,
//! `agent`) whose connection to the guest agent broke.

use crate::exec::ExecError;
use crate::state::VmDir;
use crate::supervisor::{RUN_ENDED, RUN_STARTS};

/// How long a session whose connection broke waits for its VM's supervisor to exit
/// before it reports the error without saying why the VM went away.
const LOST_VM_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// A session's error, as said to the user: one that failed because its VM went away
/// (its connection to the agent broke, [`ExecError::is_connection_lost`]) says why the
/// VM went away.
pub fn explain(vm: &VmDir, error: &ExecError) -> String {
    let lost = error.is_connection_lost();
    let error = error.to_string();
    if !lost {
        return error;
    }
    // Give the supervisor a moment to record the end and exit: in the nested host that
    // waits for the nested host to shut down too, which under load takes seconds.
    let deadline = std::time::Instant::now() + LOST_VM_WAIT;
    while vm.running_pid().is_some() {
        if std::time::Instant::now() > deadline {
            return error;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    why_the_vm_stopped(vm, error)
}

/// `error`, with why its VM, no longer running, stopped: the crash its supervisor
/// recorded (a guest panic, a triple fault, ...), else the last error in the
/// supervisor's log (a supervisor killed before it could record one), else that the
/// VM was removed, when its log is gone.
fn why_the_vm_stopped(vm: &VmDir, error: String) -> String {
    const STOPPED: &str = "the VM stopped: ";
    if let Some(crash) = vm.read_crash() {
        // The VMM's own errors already begin so.
        let why = crash.strip_prefix(STOPPED).unwrap_or(&crash);
        return format!("{error}; {STOPPED}{why}");
    }
    // Every run's supervisor writes to its log: one that is not there went with the
    // VM's directory, which `vmctl rm` removes the moment the VM has stopped.
    let Some(tail) =
        crate::log_keeper::read_tail(&vm.supervisor_log(), crate::supervisor::LOG_TAIL_BYTES)
    else {
        return format!("{error}; the VM was removed (`vmctl rm`), its logs with it");
    };
    let log = String::from_utf8_lossy(&tail);
    // This run's part: an earlier run's errors are not this one's.
    let run = log
        .rfind(RUN_STARTS)
        .map_or(log.as_ref(), |start| &log[start..]);
    // vmctl's own errors only: warnings quoting an `io::Error` ("os error 111", a
    // relay the guest asked for) say "error" without being why the VM stopped.
    let last_word = run
        .lines()
        .rev()
        .find(|l| l.starts_with("vmctl: error: ") || l.starts_with(crate::vm::SHUTDOWN_REQUESTED));
    match last_word {
        Some(line) => match line.strip_prefix(crate::vm::SHUTDOWN_REQUESTED) {
            Some(who) => format!("{error}; the VM was shut down, {}", who.trim()),
            None => format!("{error}; {STOPPED}{}", line.trim()),
        },
        None if !run.contains(RUN_ENDED) => format!(
            "{error}; the VM's supervisor ended without recording why (killed, or vmctl \
             crashed: the end of {} may say)",
            vm.supervisor_log().display()
        ),
        None => format!(
            "{error}; the VM stopped (see {})",
            vm.supervisor_log().display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_lost_vm_is_explained_by_its_crash_else_by_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        let error = || "the agent closed the connection".to_string();
        std::fs::write(
            vm.supervisor_log(),
            "vmctl: supervising the VM of /w\nvmctl: the VM ended: Ok(0)\n",
        )
        .unwrap();
        assert_eq!(
            why_the_vm_stopped(&vm, error()),
            format!(
                "the agent closed the connection; the VM stopped (see {})",
                vm.supervisor_log().display()
            )
        );
        // Killed before it could say how the VM ended; the warning's "os error" and the
        // earlier run's error are not why.
        std::fs::write(
            vm.supervisor_log(),
            "vmctl: supervising the VM of /w\nvmctl: error: an earlier run's\n\
             vmctl: the VM ended: Ok(1)\nvmctl: supervising the VM of /w\n\
             2026-12-06T23:00:00Z WARN the guest's connection to the host's loopback port \
             6767 is refused: Connection refused (os error 111)\n",
        )
        .unwrap();
        let killed = why_the_vm_stopped(&vm, error());
        assert!(
            killed.contains("the VM's supervisor ended without recording why"),
            "{killed}"
        );
        std::fs::write(
            vm.supervisor_log(),
            "vmctl: supervising the VM of /w\nvmctl: error: the VM stopped: triple fault\nvmctl: the VM ended: Ok(1)\n",
        )
        .unwrap();
        assert_eq!(
            why_the_vm_stopped(&vm, error()),
            "the agent closed the connection; the VM stopped: vmctl: error: the VM stopped: \
             triple fault"
        );
        // A shutdown someone asked for, after that: the last word counts.
        let mut log = std::fs::OpenOptions::new()
            .append(true)
            .open(vm.supervisor_log())
            .unwrap();
        writeln!(
            log,
            "{}asked to by `vmctl stop`",
            crate::vm::SHUTDOWN_REQUESTED
        )
        .unwrap();
        assert_eq!(
            why_the_vm_stopped(&vm, error()),
            "the agent closed the connection; the VM was shut down, asked to by `vmctl stop`"
        );
        std::fs::write(
            vm.crash_file(),
            "the guest kernel crashed: Kernel panic - not syncing: Fatal exception\n",
        )
        .unwrap();
        assert_eq!(
            why_the_vm_stopped(&vm, error()),
            "the agent closed the connection; the VM stopped: the guest kernel crashed: \
             Kernel panic - not syncing: Fatal exception"
        );
        std::fs::write(
            vm.crash_file(),
            "the VM stopped: the guest crashed (triple fault on vCPU 1)\n",
        )
        .unwrap();
        assert_eq!(
            why_the_vm_stopped(&vm, error()),
            "the agent closed the connection; the VM stopped: the guest crashed (triple fault \
             on vCPU 1)"
        );
    }
    /// Whether a session's error is explained depends on what the error is, not on its
    /// words: a lost connection is, whatever `guest_agent::client` calls it; the agent's
    /// own words are not, even when they say the same.
    #[test]
    fn only_a_lost_connection_is_explained() {
        use guest_agent::client::ClientError;
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let removed = "; the VM was removed (`vmctl rm`), its logs with it";
        for lost in [
            ExecError::Session(ClientError::Closed),
            ExecError::Connect {
                socket: "/s/vsock.sock".into(),
                reason: ClientError::HybridClosed {
                    received: String::new(),
                    port: 1024,
                },
            },
            ExecError::Session(ClientError::Io(std::io::ErrorKind::ConnectionReset.into())),
        ] {
            assert_eq!(explain(&vm, &lost), format!("{lost}{removed}"));
        }
        let refused =
            ExecError::Session(ClientError::Agent("the agent closed the connection".into()));
        assert_eq!(explain(&vm, &refused), refused.to_string());
    }

    /// `vmctl rm` removes the VM's directory right after the VM stopped: the session
    /// says so, not "see" a log that is gone.
    #[test]
    fn a_vm_removed_under_its_session_is_said_to_be() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        let removed = "the agent closed the connection; the VM was removed (`vmctl rm`), its \
                       logs with it";
        assert_eq!(
            why_the_vm_stopped(&vm, "the agent closed the connection".into()),
            removed
        );
        // Or while it goes: its log first, the directory after.
        std::fs::create_dir(&vm.path).unwrap();
        assert_eq!(
            why_the_vm_stopped(&vm, "the agent closed the connection".into()),
            removed
        );
    }
}
