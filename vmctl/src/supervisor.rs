//! `vmctl __supervise DIR`: the long-lived process behind a workspace VM, started
//! detached by `vmctl up`. It runs the VMM (directly, or in the nested host) with the
//! VM's vsock at `DIR/vsock.sock`, the guest console in `DIR/console.log`, and the
//! VM's network side ([`crate::network`]): the egress proxy, relays, published ports
//! and the control socket `DIR/control.sock`; it keeps the guest's clock in step
//! ([`crate::guest_clock`]).

use std::path::Path;
use std::time::Instant;

use vmm::config::{DiskConfig, VmConfig, VsockConfig};

use crate::log_keeper::read_tail;
use crate::state::VmDir;

pub fn run(dir: &Path) -> Result<u8, String> {
    let vm = VmDir {
        path: dir.to_path_buf(),
    };
    let record = vm.read_record().map_err(|e| e.to_string())?;
    std::fs::write(vm.pid_file(), std::process::id().to_string())
        .map_err(|e| format!("{}: {e}", vm.pid_file().display()))?;

    let mut config = VmConfig::new(record.kernel.clone());
    config.initrd = Some(record.initrd.clone());
    config.disks = vec![DiskConfig {
        path: record.rootfs.clone(),
        read_only: true,
    }];
    config.extra_cmdline = record.agent_cmdline.clone();
    config.vcpus = record.cpus;
    config.memory_mib = record.memory_mib;
    config.vsock = Some(VsockConfig {
        guest_cid: vmm::devices::virtio::vsock::DEFAULT_GUEST_CID,
        uds_path: vm.vsock_socket(),
    });
    eprintln!(
        "vmctl: supervising the VM of {}",
        record.workspace.display()
    );
    crate::log_keeper::keep_bounded(vec![vm.console_log(), vm.supervisor_log()]);
    raise_open_files_limit();
    vm.create_sockets_dir().map_err(|e| e.to_string())?;
    // Without its network side the VM would boot without a way out; better not boot.
    crate::network::services::start(&vm, &record)
        .map_err(|e| format!("cannot serve the VM's network: {e}"))?;
    crate::guest_clock::keep_in_step(vm.vsock_socket());
    if let Some(file) = record.shares.as_ref().and_then(|s| s.failure_file.as_ref()) {
        let _ = std::fs::remove_file(file);
    }
    let _ = std::fs::remove_file(vm.crash_file());
    let outcome = if record.nested {
        crate::nested::launcher::run_vm(&config, record.shares.as_ref(), false)
            .map_err(|e| e.to_string())
    } else {
        crate::boot::run_vmm_sharing(
            &config,
            record.shares.as_ref(),
            &vm.sockets_dir(),
            false,
            Instant::now(),
        )
        .map_err(|e| e.to_string())
    };
    eprintln!("vmctl: the VM ended: {outcome:?}");
    if let Some(crash) = how_it_crashed(&vm, &outcome) {
        eprintln!(
            "vmctl: error: {crash} (its console: {})",
            vm.console_log().display()
        );
        // For `vmctl ps` and the next start, which would otherwise see a VM that
        // simply stopped.
        if let Err(e) = std::fs::write(vm.crash_file(), format!("{crash}\n")) {
            eprintln!(
                "vmctl: warning: cannot record the crash in {}: {e}",
                vm.crash_file().display()
            );
        }
    }
    let _ = std::fs::remove_file(vm.pid_file());
    for socket in [
        vm.vsock_socket(),
        vm.control_socket(),
        crate::network::services::service_socket(&vm.vsock_socket()),
    ] {
        let _ = std::fs::remove_file(socket);
    }
    if vm.sockets_dir() != vm.path {
        let _ = std::fs::remove_dir(vm.sockets_dir());
    }
    outcome
}

/// Lifts the soft limit on open files to the hard one: the guest may hold up to 1,024
/// vsock connections to host services, each a descriptor here, on top of the VMM's
/// own, and the usual soft limit is 1,024. The nested host's PID 1 does the same: host
/// clients' connections take two descriptors there (the relay's and the VMM's).
pub(crate) fn raise_open_files_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            tracing::debug!("cannot raise the open files limit: {e}");
        }
    }
}

/// Why the VM ended, if it did not simply shut down. A panicking guest resets itself,
/// which ends the VM like a clean shutdown: only its console tells them apart. A VM
/// that failed (a triple fault, the nested host lost, ...) ended with an error, which
/// the VMM logged to our stderr (`vmctl exec` quotes it too).
fn how_it_crashed(vm: &VmDir, outcome: &Result<u8, String>) -> Option<String> {
    if let Some(panic) = guest_panic(&vm.console_log()) {
        return Some(format!("the guest kernel crashed: {panic}"));
    }
    match outcome {
        Ok(0) => None,
        // Someone stopped it: `vmctl stop` once the guest did not shut down in time
        // (it says so), or a user's kill. Not a crash.
        Ok(code) if stopped_by_signal(*code) => None,
        Ok(code) => Some(
            read_tail(&vm.supervisor_log(), LOG_TAIL_BYTES)
                .and_then(|log| last_error(&String::from_utf8_lossy(&log)))
                .unwrap_or_else(|| format!("the VMM exited with code {code}")),
        ),
        Err(e) => Some(e.clone()),
    }
}

/// Whether `code` is the VMM's exit code for a signal it turns into a stop (128+N,
/// for SIGINT, SIGTERM and SIGHUP).
fn stopped_by_signal(code: u8) -> bool {
    code.checked_sub(128).is_some_and(|signal| {
        [libc::SIGINT, libc::SIGTERM, libc::SIGHUP].contains(&i32::from(signal))
    })
}

/// The message of the last `vmctl: error:` line of a log.
fn last_error(log: &str) -> Option<String> {
    const PREFIX: &str = "vmctl: error: ";
    log.lines()
        .rev()
        .find_map(|line| line.find(PREFIX).map(|at| &line[at + PREFIX.len()..]))
        .map(|message| message.trim().to_string())
}

/// How much of a log's end is searched: of the console for a panic (the oops before
/// it is a few KiB at most), of the supervisor's log for the VMM's last error.
pub const LOG_TAIL_BYTES: u64 = 64 * 1024;

/// The guest kernel's panic line in the tail of its console log, with the first
/// line of the report that led to it (`BUG:`, `Oops:`, ...), if it panicked.
fn guest_panic(console: &Path) -> Option<String> {
    let tail = read_tail(console, LOG_TAIL_BYTES)?;
    let text = String::from_utf8_lossy(&tail);
    // After the kernel's "[ seconds]" timestamp (other output may precede it).
    let message = |line: &str| match line.find("] ") {
        Some(end) if line[..end].contains('[') => line[end + 2..].trim().to_string(),
        _ => line.trim().to_string(),
    };
    let lines: Vec<&str> = text.lines().collect();
    let panic_at = lines
        .iter()
        .rposition(|l| l.contains("Kernel panic - not syncing"))?;
    let panic = message(lines[panic_at]);
    let cause = lines[..panic_at]
        .iter()
        .map(|l| message(l))
        .find(|m| OOPS_STARTS.iter().any(|start| m.starts_with(start)));
    Some(match cause {
        Some(cause) => format!("{panic}, after \"{cause}\""),
        None => panic,
    })
}

/// How the kernel starts the reports that end in a panic.
const OOPS_STARTS: [&str; 5] = [
    "BUG:",
    "Oops:",
    "general protection fault",
    "kernel BUG at",
    "watchdog: BUG:",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_open_files_limit_is_raised_to_the_hard_limit() {
        use rustix::process::{getrlimit, setrlimit, Resource};
        let before = getrlimit(Resource::Nofile);
        let (Some(_), Some(hard)) = (before.current, before.maximum) else {
            return; // unlimited: nothing to raise
        };
        // Just below the hard limit: the tests running beside this one keep their room.
        let mut lowered = before;
        lowered.current = Some(hard.saturating_sub(1));
        setrlimit(Resource::Nofile, lowered).unwrap();
        raise_open_files_limit();
        assert_eq!(getrlimit(Resource::Nofile).current, Some(hard));
    }

    fn console(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    /// A VM directory with this console and supervisor log.
    fn ended_vm(console: &str, log: &str) -> (tempfile::TempDir, VmDir) {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        std::fs::write(vm.console_log(), console).unwrap();
        std::fs::write(vm.supervisor_log(), log).unwrap();
        (dir, vm)
    }

    #[test]
    fn a_vm_that_failed_is_a_crash_in_the_vmms_words() {
        let log = "vmctl: supervising the VM of /ws\n\
                   \x1b[31mERROR\x1b[0m vcpu1: the guest crashed (triple fault): rip 0xfff0\n\
                   vmctl: error: the VM stopped: the guest crashed (triple fault on vCPU 1: rip 0xfff0)\n\
                   vmctl: the VM ended: Ok(1)\n";
        let (_dir, vm) = ended_vm("guest-agent: booted\n", log);
        assert_eq!(
            how_it_crashed(&vm, &Ok(1)).as_deref(),
            Some("the VM stopped: the guest crashed (triple fault on vCPU 1: rip 0xfff0)")
        );
        // The same VM shut down cleanly: no crash, whatever the log says.
        assert_eq!(how_it_crashed(&vm, &Ok(0)), None);
        assert_eq!(
            how_it_crashed(&vm, &Err("the nested host stopped".into())).as_deref(),
            Some("the nested host stopped")
        );
        let (_dir, quiet) = ended_vm("", "vmctl: the VM ended: Ok(3)\n");
        assert_eq!(
            how_it_crashed(&quiet, &Ok(3)).as_deref(),
            Some("the VMM exited with code 3")
        );
    }

    #[test]
    fn a_vm_stopped_by_a_signal_did_not_crash() {
        let log = "vmctl: stopped by signal 15; the guest was not shut down cleanly\n\
                   vmctl: the VM ended: Ok(143)\n";
        let (_dir, vm) = ended_vm("guest-agent: booted\n", log);
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            assert_eq!(how_it_crashed(&vm, &Ok(128 + signal as u8)), None);
        }
        // Exit codes that are no stop signal are still crashes.
        assert!(how_it_crashed(&vm, &Ok(128 + libc::SIGKILL as u8)).is_some());
        assert!(how_it_crashed(&vm, &Ok(128)).is_some());
    }

    #[test]
    fn a_guest_panic_is_the_crash_even_after_a_clean_reset() {
        let (_dir, vm) = ended_vm(
            "[    2.1] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000300\n",
            "vmctl: the VM ended: Ok(0)\n",
        );
        let crash = how_it_crashed(&vm, &Ok(0)).unwrap();
        assert!(
            crash.starts_with(
                "the guest kernel crashed: Kernel panic - not syncing: Attempted to kill init!"
            ),
            "{crash}"
        );
    }

    #[test]
    fn a_panic_is_found_with_the_report_that_caused_it() {
        let (_dir, path) = console(
            "2026-12-01T16:42:58Z  INFO started pid=181 argv=[\"true\"]\n\
             2026-12[    8.740360] BUG: #DF stack guard page was hit at 000000009a468f9c\n\
             [    8.742049] stack guard page: 0000 [#1] SMP\n\
             [    8.742548] RIP: 0010:exc_page_fault+0x6/0x560\n\
             [   10.780855] Kernel panic - not syncing: Fatal exception in interrupt\n\
             [   12.764508] Shutting down cpus with NMI\n",
        );
        assert_eq!(
            guest_panic(&path).as_deref(),
            Some(
                "Kernel panic - not syncing: Fatal exception in interrupt, after \
                 \"BUG: #DF stack guard page was hit at 000000009a468f9c\""
            )
        );
    }

    #[test]
    fn a_panic_without_an_oops_is_reported_alone() {
        let (_dir, path) = console(
            "[    1.0] Run /init as init process\n\
             [    1.2] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100\n",
        );
        assert_eq!(
            guest_panic(&path).as_deref(),
            Some("Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100")
        );
    }

    #[test]
    fn a_clean_console_or_none_is_no_panic() {
        let (_dir, path) = console("[    0.5] reboot: Restarting system\n");
        assert_eq!(guest_panic(&path), None);
        assert_eq!(guest_panic(Path::new("/nonexistent/console.log")), None);
    }

    #[test]
    fn only_the_tail_is_read() {
        let mut text = String::from("[ 1.0] Kernel panic - not syncing: old\n");
        text.push_str(&"x".repeat(LOG_TAIL_BYTES as usize));
        let (_dir, path) = console(&text);
        assert_eq!(guest_panic(&path), None);
    }
}
