//! How a VM ends: guest power-off, and SIGTERM to vmctl.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vm_tests::{boot_script, kernel, test_initramfs, vm_scenario, vmctl_bin, TempDir};

#[test]
fn guest_poweroff_ends_the_vm_with_exit_zero() {
    vm_scenario(
        "lifecycle::guest_poweroff_ends_the_vm_with_exit_zero",
        || {
            let dir = TempDir::new("poweroff");
            // Without ACPI a power-off only halts the CPU; the VMM must notice.
            let run = boot_script(
                &dir,
                "echo POWEROFF_MARKER=1\nsync\npoweroff -f\nsleep 600\necho NOT_POWERED_OFF\n",
                &[],
            );
            assert_eq!(
                vm_tests::guest_value(&run.stdout, "POWEROFF_MARKER"),
                Some("1")
            );
            assert!(!run.stdout.contains("NOT_POWERED_OFF"), "{}", run.report());
        },
    );
}

/// Sends signal `name` (e.g. "TERM", or "0" to probe) to `pid` (negative: a group).
fn signal(pid: i32, name: &str) -> bool {
    Command::new("kill")
        .args(["-s", name, "--"])
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn sigterm_stops_the_vm_and_exits_non_zero() {
    vm_scenario("lifecycle::sigterm_stops_the_vm_and_exits_non_zero", || {
        let dir = TempDir::new("sigterm");
        let initrd = test_initramfs(&dir, "echo GUEST_WAITING=1\nsleep 600\necho NOT_STOPPED\n");
        let mut command = Command::new(vmctl_bin());
        command
            .args(["boot", "--memory", "256", "--kernel"])
            .arg(kernel())
            .arg("--initrd")
            .arg(&initrd)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let mut child = command.spawn().expect("spawn vmctl");
        let pid = child.id() as i32;
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        let stderr_reader = std::thread::spawn(move || {
            let mut text = String::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                text.push_str(&line);
                text.push('\n');
            }
            text
        });

        let (seen_tx, seen_rx) = std::sync::mpsc::channel();
        let stdout_reader = std::thread::spawn(move || {
            let mut text = String::new();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.contains("GUEST_WAITING=1") {
                    let _ = seen_tx.send(());
                }
                text.push_str(&line);
                text.push('\n');
            }
            text
        });
        let waited = seen_rx.recv_timeout(vm_tests::vm_timeout());
        if waited.is_err() {
            signal(-pid, "KILL");
            let _ = child.wait();
            panic!(
                "the guest never reached its script\nstdout: {}\nstderr: {}",
                stdout_reader.join().unwrap_or_default(),
                stderr_reader.join().unwrap_or_default()
            );
        }

        assert!(signal(pid, "TERM"), "cannot send SIGTERM to vmctl");
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for vmctl") {
                break status;
            }
            if Instant::now() > deadline {
                signal(-pid, "KILL");
                panic!("vmctl did not stop within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let stdout = stdout_reader.join().unwrap_or_default();
        let stderr = stderr_reader.join().unwrap_or_default();
        let report = format!("exit: {status:?}\nstdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(
            !status.success(),
            "SIGTERM must give a non-zero exit\n{report}"
        );
        assert_eq!(status.code(), Some(128 + 15), "{report}");
        assert!(stderr.contains("stopped by signal 15"), "{report}");
        assert!(!stdout.contains("NOT_STOPPED"), "{report}");
        assert!(!stderr.contains("panicked"), "{report}");

        // Nothing vmctl started (QEMU in the nested case) may outlive it.
        let deadline = Instant::now() + Duration::from_secs(10);
        while signal(-pid, "0") {
            assert!(
                Instant::now() < deadline,
                "processes of vmctl's group are still running 10 s after it exited\n{report}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    });
}
