//! Child processes that must not outlive the process that starts them (the VMM under
//! vmctl's supervisor, virtiofsd, QEMU's nested host, the benchmark's nested run).

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes `command`'s process get SIGTERM when the thread that spawns it ends
/// (PR_SET_PDEATHSIG follows that thread, not the whole process), so that a parent
/// that dies, even by SIGKILL, leaves no orphan running. A parent already gone by the
/// time the child asks fails the spawn instead, as the signal would never come.
pub fn stop_with_parent(command: &mut Command) {
    end_with_parent(command, libc::SIGTERM);
}

/// As [`stop_with_parent`], but with SIGKILL: for a child that may be past acting on
/// SIGTERM (the VMM, which its parent has already passed a stop signal that it is
/// stuck in), so that the parent's death ends it whatever state it is in.
pub fn kill_with_parent(command: &mut Command) {
    end_with_parent(command, libc::SIGKILL);
}

fn end_with_parent(command: &mut Command, signal: libc::c_int) {
    let parent = std::process::id();
    // SAFETY: the closure runs in the child between fork and exec; it only calls
    // prctl(2) and getppid(2), which are async-signal-safe, and allocates nothing
    // unless it fails.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if u32::try_from(libc::getppid()).ok() != Some(parent) {
                return Err(std::io::Error::other(
                    "the process starting it ended before it started",
                ));
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn a_child_gets_sigterm_when_the_thread_that_started_it_ends() {
        let mut child = std::thread::spawn(|| {
            let mut command = Command::new("sleep");
            command.arg("30");
            stop_with_parent(&mut command);
            command.spawn().expect("spawn sleep")
        })
        .join()
        .unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGTERM), "{status}");
    }

    #[test]
    fn a_child_gets_sigkill_when_the_thread_that_started_it_ends() {
        let mut child = std::thread::spawn(|| {
            // A sleep that ignores SIGTERM (ignored signals stay so across exec):
            // only SIGKILL ends it before its 30 s.
            let mut command = Command::new("sh");
            command.args(["-c", "trap '' TERM; exec sleep 30"]);
            kill_with_parent(&mut command);
            command.spawn().expect("spawn sh")
        })
        .join()
        .unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
    }
}
