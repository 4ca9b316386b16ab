//! `vmctl __supervise DIR`: the long-lived process behind a workspace VM, started
//! detached by `vmctl up`. It runs the VMM (directly, or in the nested host) with the
//! VM's vsock at `SOCKETS/vsock/vsock.sock`, the guest console in `DIR/console.log`,
//! and the VM's network side ([`crate::network`]): the egress proxy, relays, published
//! ports and the control socket `SOCKETS/control.sock`, where `SOCKETS` is `DIR` or,
//! when that makes the paths too long, a directory under /tmp
//! ([`VmDir::sockets_dir`]); it keeps the guest's clock in step
//! ([`crate::guest_clock`]) and shows the host's edits of the shares to the guest's
//! file watchers ([`crate::host_edits`]).

use std::path::Path;

use vmm::config::{DiskConfig, VmConfig, VsockConfig};

use crate::log_keeper::read_tail;
use crate::state::{VmDir, VmRecord};

pub fn run(dir: &Path) -> Result<u8, String> {
    let vm = VmDir {
        path: dir.to_path_buf(),
    };
    let record = vm.read_record().map_err(|e| e.to_string())?;
    // Written by the vmctl that started this process too, with the same pid.
    vm.write_pid(std::process::id())
        .map_err(|e| e.to_string())?;
    // The last run's crash is no longer what this run ended in, whatever happens
    // next: a start that fails below must not show it in `vmctl ps`.
    let _ = std::fs::remove_file(vm.crash_file());

    let config = vm_config(&vm, &record);
    vmm::to_stderr!("{RUN_STARTS}{}", record.workspace.display());
    // virtiofsd's logs too (the host's, in the nested host's case): what the guest
    // does can make them grow.
    let share_count = record.shares.as_ref().map_or(0, |set| set.shares.len());
    let virtiofsd_logs = (0..share_count).map(|index| crate::virtiofsd::log_path(&vm.path, index));
    crate::log_keeper::keep_bounded(
        [vm.console_log(), vm.supervisor_log()]
            .into_iter()
            .chain(virtiofsd_logs)
            .collect(),
    );
    raise_open_files_limit();
    vm.create_sockets_dir().map_err(|e| e.to_string())?;
    // Without its network side the VM would boot without a way out; better not boot.
    crate::network::services::start(&vm, &record)
        .map_err(|e| format!("cannot serve the VM's network: {e}"))?;
    crate::guest_clock::keep_in_step(vm.vsock_socket());
    crate::host_edits::forward(&vm, record.shares.as_ref());
    if let Some(file) = record.shares.as_ref().and_then(|s| s.failure_file.as_ref()) {
        let _ = std::fs::remove_file(file);
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
        }
    }
    let outcome = if record.nested {
        crate::nested::launcher::run_vm(
            &config,
            record.shares.as_ref(),
            false,
            record.nested_host_kernel.as_deref(),
            Some(&vm.path),
        )
        .map_err(|e| e.to_string())
    } else {
        // The logs beside the VM's others, not with the sockets: a sockets directory
        // in /tmp (a VM directory too deep for socket paths) is removed with its last
        // socket, which it could not be with logs in it.
        crate::vmm_process::run_with_shares(
            &config,
            record.shares.as_ref(),
            &vm.sockets_dir(),
            &vm.path,
            false,
        )
        .map_err(|e| e.to_string())
    };
    vmm::to_stderr!("{RUN_ENDED}{outcome:?}");
    if let Some(crash) = how_it_crashed(&vm, &outcome, record.nested) {
        vmm::to_stderr!(
            "vmctl: error: {crash} (its console: {})",
            vm.console_log().display()
        );
        // For `vmctl ps` and the next start, which would otherwise see a VM that
        // simply stopped.
        if let Err(e) = std::fs::write(vm.crash_file(), format!("{crash}\n")) {
            vmm::to_stderr!(
                "vmctl: warning: cannot record the crash in {}: {e}",
                vm.crash_file().display()
            );
        }
    }
    // Sockets first: the pid file's going is what lets a stopper (`vmctl stop`, the
    // idle stop) drop the lifecycle lock, and a start waiting for it makes its sockets
    // at the same paths, which a removal after that would take from the new VM.
    vm.remove_sockets();
    let _ = std::fs::remove_file(vm.pid_file());
    outcome
}

/// The VM's configuration, but for its virtio-fs devices: those come with the
/// virtiofsd that serve them, started where the VMM runs.
pub fn vm_config(vm: &VmDir, record: &VmRecord) -> VmConfig {
    let mut config = VmConfig::new(record.kernel.clone());
    config.initrd = Some(record.initrd.clone());
    config.disks = vec![DiskConfig {
        path: record.rootfs.clone(),
        read_only: true,
    }];
    config.extra_cmdline = record.agent_cmdline.clone();
    config.vcpus = record.cpus;
    config.memory_mib = record.memory_mib;
    config.free_page_reporting = record.free_page_reporting;
    config.vsock = Some(VsockConfig {
        guest_cid: vmm::devices::virtio::vsock::DEFAULT_GUEST_CID,
        uds_path: vm.vsock_socket(),
    });
    config
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
/// the VMM logged to our stderr (`vmctl exec` quotes it too). `nested`: the VM ran
/// in the nested host, whose own kernel writes to the same console.
fn how_it_crashed(vm: &VmDir, outcome: &Result<u8, String>, nested: bool) -> Option<String> {
    if let Some(panic) = kernel_panic(&vm.console_log()) {
        // A guest that panics resets itself, which the nested host's VMM reports as a
        // clean end (0): the nested host lived on past that panic, so it is the
        // guest's, even where the nested host's lines cut into the guest's and split
        // its timestamp from the panic's words.
        let nested_host_lived_on = matches!(outcome, Ok(0));
        return Some(if nested && !panic.timestamped && !nested_host_lived_on {
            format!(
                "the nested host's kernel crashed (not the guest's): {}",
                panic.report
            )
        } else {
            format!("the guest kernel crashed: {}", panic.report)
        });
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
/// How a run's part of the supervisor's log begins (the workspace follows), and the
/// line it writes as its VM ends (the outcome follows): others read the log by them.
pub const RUN_STARTS: &str = "vmctl: supervising the VM of ";
pub const RUN_ENDED: &str = "vmctl: the VM ended: ";
/// The longest crash report kept (a kernel's panic line and its cause are far
/// shorter).
const MAX_REPORT_CHARS: usize = 500;

/// A kernel panic found on a VM's console.
#[derive(Debug, PartialEq, Eq)]
struct KernelPanic {
    /// The panic line, with the first line of the report that led to it (`BUG:`,
    /// `Oops:`, ...).
    report: String,
    /// Its lines carry the kernel's `[ seconds]` timestamps: the guest kernel's do
    /// (CONFIG_PRINTK_TIME), the nested host's kernel prints none (`printk.time=0`).
    timestamped: bool,
}

/// The last kernel panic in the tail of a console log, if a kernel panicked.
fn kernel_panic(console: &Path) -> Option<KernelPanic> {
    let tail = read_tail(console, LOG_TAIL_BYTES)?;
    let text = String::from_utf8_lossy(&tail);
    let lines: Vec<&str> = text.lines().collect();
    let panic_at = lines
        .iter()
        .rposition(|l| l.contains("Kernel panic - not syncing"))?;
    let (panic, timestamped) = kernel_message(lines[panic_at]);
    // The report is the same kernel's: the two kernels' lines interleave.
    let cause = lines[..panic_at]
        .iter()
        .map(|l| kernel_message(l))
        .filter(|(_, stamped)| *stamped == timestamped)
        .map(|(message, _)| message)
        .find(|m| OOPS_STARTS.iter().any(|start| m.starts_with(start)));
    let report = match cause {
        Some(cause) => format!("{panic}, after \"{cause}\""),
        None => panic,
    };
    // The guest writes its console: a "panic" line may be anything, of any length.
    let report = match report.char_indices().nth(MAX_REPORT_CHARS) {
        Some((cut, _)) => format!("{} [...]", &report[..cut]),
        None => report,
    };
    Some(KernelPanic {
        report,
        timestamped,
    })
}

/// A console line's kernel message, after the kernel's `[ seconds] ` timestamp when
/// it has one (other output may precede it on the line), and whether it had one.
fn kernel_message(line: &str) -> (String, bool) {
    let stamp = line.find("] ").and_then(|end| {
        let start = line[..end].rfind('[')?;
        line[start + 1..end].trim().parse::<f64>().ok().map(|_| end)
    });
    match stamp {
        Some(end) => (line[end + 2..].trim().to_string(), true),
        None => (line.trim().to_string(), false),
    }
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
    fn a_run_that_fails_to_start_leaves_no_older_crash_behind() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        vm.write_record(&crate::state::test_record(&vm, dir.path()))
            .unwrap();
        std::fs::write(
            vm.crash_file(),
            "the guest kernel crashed: Kernel panic (last week)\n",
        )
        .unwrap();
        // Where the sockets' directory goes: the start fails before the VM runs.
        assert_eq!(vm.sockets_dir(), vm.path);
        std::fs::write(vm.vsock_dir(), "").unwrap();
        let outcome = run(&vm.path);
        assert!(outcome.is_err(), "{outcome:?}");
        assert_eq!(
            vm.read_crash(),
            None,
            "the failed start is reported as the older crash"
        );
    }

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
            how_it_crashed(&vm, &Ok(1), false).as_deref(),
            Some("the VM stopped: the guest crashed (triple fault on vCPU 1: rip 0xfff0)")
        );
        // The same VM shut down cleanly: no crash, whatever the log says.
        assert_eq!(how_it_crashed(&vm, &Ok(0), false), None);
        assert_eq!(
            how_it_crashed(&vm, &Err("the nested host stopped".into()), true).as_deref(),
            Some("the nested host stopped")
        );
        let (_dir, quiet) = ended_vm("", "vmctl: the VM ended: Ok(3)\n");
        assert_eq!(
            how_it_crashed(&quiet, &Ok(3), false).as_deref(),
            Some("the VMM exited with code 3")
        );
    }

    #[test]
    fn a_vm_stopped_by_a_signal_did_not_crash() {
        let log = "vmctl: stopped by signal 15; the guest was not shut down cleanly\n\
                   vmctl: the VM ended: Ok(143)\n";
        let (_dir, vm) = ended_vm("guest-agent: booted\n", log);
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            assert_eq!(how_it_crashed(&vm, &Ok(128 + signal as u8), false), None);
        }
        // Exit codes that are no stop signal are still crashes.
        assert!(how_it_crashed(&vm, &Ok(128 + libc::SIGKILL as u8), false).is_some());
        assert!(how_it_crashed(&vm, &Ok(128), false).is_some());
    }

    #[test]
    fn a_guest_panic_is_the_crash_even_after_a_clean_reset() {
        let (_dir, vm) = ended_vm(
            "[    2.1] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000300\n",
            "vmctl: the VM ended: Ok(0)\n",
        );
        let crash = how_it_crashed(&vm, &Ok(0), false).unwrap();
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
            kernel_panic(&path).map(|p| p.report).as_deref(),
            Some(
                "Kernel panic - not syncing: Fatal exception in interrupt, after \
                 \"BUG: #DF stack guard page was hit at 000000009a468f9c\""
            )
        );
    }

    #[test]
    fn a_panic_of_the_nested_hosts_kernel_is_not_the_guests() {
        // The nested host's lines (no timestamps) among the guest's console.
        let console = "[    3.0] virtio_blk virtio1: [vda] 2097152 512-byte logical blocks\n\
                       BUG: unable to handle page fault for address: ffffc900009b3ff8\n\
                       2026-12-02T23:50:48Z  INFO started pid=51 argv=[\"true\"] tty=false\n\
                       [    9.1] BUG: a guest report the nested host's panic did not follow\n\
                       RIP: 0010:exc_page_fault+0x1b/0x560\n\
                       Kernel panic - not syncing: Fatal exception in interrupt\n";
        let (_dir, vm) = ended_vm(console, "vmctl: the VM ended: Ok(1)\n");
        assert_eq!(
            how_it_crashed(&vm, &Ok(1), true).as_deref(),
            Some(
                "the nested host's kernel crashed (not the guest's): Kernel panic - not \
                 syncing: Fatal exception in interrupt, after \"BUG: unable to handle page \
                 fault for address: ffffc900009b3ff8\""
            )
        );
        // Without a nested host, any kernel panic on the console is the guest's.
        assert!(how_it_crashed(&vm, &Ok(1), false)
            .unwrap()
            .starts_with("the guest kernel crashed: Kernel panic"));
        // The guest's panic in the nested host is still the guest's.
        let (_dir, vm) = ended_vm(
            "[    2.1] Kernel panic - not syncing: Attempted to kill init!\n",
            "vmctl: the VM ended: Ok(0)\n",
        );
        assert!(how_it_crashed(&vm, &Ok(0), true)
            .unwrap()
            .starts_with("the guest kernel crashed: Kernel panic"));
        // So is one whose timestamp a line of the nested host's split from its words,
        // the VM having ended as a panicking guest ends it: reset, reported as 0.
        // (Seen in CI, 2026-12-06: taken for the nested host's.)
        let (_dir, vm) = ended_vm(
            "[    2.1] \nkvm: a nested host's line\nKernel panic - not syncing: Attempted to \
             kill init! exitcode=0x00000300\n",
            "vmctl: the VM ended: Ok(0)\n",
        );
        assert!(how_it_crashed(&vm, &Ok(0), true)
            .unwrap()
            .starts_with("the guest kernel crashed: Kernel panic"));
    }

    #[test]
    fn a_panic_without_an_oops_is_reported_alone() {
        let (_dir, path) = console(
            "[    1.0] Run /init as init process\n\
             [    1.2] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100\n",
        );
        assert_eq!(
            kernel_panic(&path).map(|p| p.report).as_deref(),
            Some("Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100")
        );
    }

    /// The guest can write any "panic" line to its console: the report keeps its
    /// start only.
    #[test]
    fn a_panic_line_of_any_length_is_cut_short() {
        let (_dir, path) = console(&format!(
            "[    1.2] Kernel panic - not syncing: {}\n",
            "é".repeat(20_000)
        ));
        let report = kernel_panic(&path).unwrap().report;
        assert!(
            report.starts_with("Kernel panic - not syncing: éé"),
            "{report}"
        );
        assert!(report.ends_with(" [...]"), "{report}");
        assert_eq!(report.chars().count(), MAX_REPORT_CHARS + " [...]".len());
    }

    #[test]
    fn a_clean_console_or_none_is_no_panic() {
        let (_dir, path) = console("[    0.5] reboot: Restarting system\n");
        assert_eq!(kernel_panic(&path), None);
        assert_eq!(kernel_panic(Path::new("/nonexistent/console.log")), None);
    }

    #[test]
    fn only_the_tail_is_read() {
        let mut text = String::from("[ 1.0] Kernel panic - not syncing: old\n");
        text.push_str(&"x".repeat(LOG_TAIL_BYTES as usize));
        let (_dir, path) = console(&text);
        assert_eq!(kernel_panic(&path), None);
    }
}
