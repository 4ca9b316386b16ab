//! `vmctl nested-exec`: a command inside a fresh nested host, which has a real KVM.
//! Also covers the VMM's direct path (`--nested never`) with stdin at /dev/null, the
//! way it runs on hardware-KVM hosts in CI.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vm_tests::{base_initramfs, kernel, nested_host_available, vmctl_bin, TempDir, Vmctl};

#[test]
fn command_runs_with_kvm_and_its_exit_code_comes_back() {
    if !nested_host_available("nested_exec::command_runs_with_kvm_and_its_exit_code_comes_back") {
        return;
    }
    let dir = TempDir::new("nested-exec");
    let script = "test -c /dev/kvm && echo KVM=yes; echo CWD=$(pwd); \
                  echo written > \"$OUT/out.txt\"; echo to-stderr >&2; exit 7";
    let run = Vmctl::new()
        .args([
            "nested-exec",
            "--cpus",
            "1",
            "--memory",
            "1024",
            "--writable",
        ])
        .arg(dir.path())
        .args(["--", "sh", "-c", script])
        .env("OUT", dir.path())
        .run();
    eprintln!("{}", run.report());
    assert_eq!(run.code, Some(7), "{}", run.report());
    assert_eq!(vm_tests::guest_value(&run.stdout, "KVM"), Some("yes"));
    let cwd = std::env::current_dir().unwrap();
    assert_eq!(vm_tests::guest_value(&run.stdout, "CWD"), cwd.to_str());
    assert!(run.stderr.contains("to-stderr"), "{}", run.report());
    let written = std::fs::read_to_string(dir.join("out.txt")).unwrap_or_default();
    assert_eq!(
        written, "written\n",
        "the writable share did not reach the host"
    );
}

/// The launcher reads every vCPU of a real nested host through QEMU's monitor (the
/// stall watch: README, "Known problem"), and finds none stuck in a healthy one: a
/// sample may catch a vCPU with its interrupts off, or halted with an interrupt on
/// its way, in passing (the kernel does both all the time; one of two rounds in a CI
/// run caught both vCPUs so), but a stuck one stays so: each vCPU must be seen halted
/// or running in some round.
#[test]
fn the_stall_watch_reads_every_vcpu_of_a_healthy_nested_host() {
    if !nested_host_available(
        "nested_exec::the_stall_watch_reads_every_vcpu_of_a_healthy_nested_host",
    ) {
        return;
    }
    let run = Vmctl::new()
        .args(["nested-exec", "--cpus", "2", "--memory", "1024", "--"])
        .args(["sleep", "12"])
        .env("VMCTL_LOG", "vmctl::nested::stall=debug")
        .run();
    eprintln!("{}", run.report());
    run.assert_success();
    let rounds: Vec<&str> = run
        .stderr
        .lines()
        .filter_map(|line| {
            line.split_once("the nested host's vCPUs: ")
                .map(|(_, vcpus)| vcpus)
        })
        .collect();
    assert!(
        !rounds.is_empty(),
        "the watch sampled nothing\n{}",
        run.report()
    );
    let mut settled = [0usize; 2];
    for round in &rounds {
        let vcpus: Vec<&str> = round.split(", ").collect();
        assert_eq!(vcpus.len(), 2, "{round}");
        for (cpu, vcpu) in vcpus.iter().enumerate() {
            let state = vcpu
                .strip_prefix(&format!("{cpu} "))
                .unwrap_or_else(|| panic!("vCPU {cpu} read as {vcpu:?} in {round:?}"));
            match state {
                "halted" | "running" => settled[cpu] += 1,
                _ if state.starts_with("interrupts off at 0x") || state.starts_with("stuck [") => {}
                _ => panic!("vCPU {cpu} read as {vcpu:?} in {round:?}"),
            }
        }
    }
    for (cpu, settled) in settled.iter().enumerate() {
        assert!(
            *settled > 0,
            "vCPU {cpu} was never seen halted or running in {} samples: {rounds:#?}",
            rounds.len()
        );
    }
}

#[test]
fn direct_vmm_boots_on_the_nested_hosts_kvm() {
    if !nested_host_available("nested_exec::direct_vmm_boots_on_the_nested_hosts_kvm") {
        return;
    }
    let run = Vmctl::new()
        .args(["nested-exec", "--cpus", "1", "--memory", "1024", "--"])
        .arg(vmctl_bin())
        .args([
            "boot",
            "--nested",
            "never",
            "--boot-time",
            "--memory",
            "256",
            "--kernel",
        ])
        .arg(kernel())
        .arg("--initrd")
        .arg(base_initramfs())
        .env("VMCTL_LOG", "vmctl_vmm=debug")
        .run();
    eprintln!("{}", run.report());
    run.assert_success();
    assert!(
        run.stdout.contains("Hello from the guest"),
        "{}",
        run.report()
    );
    assert!(
        run.stderr.contains("vmctl-vmm: boot time: "),
        "{}",
        run.report()
    );
    // The nested host's kernel has Landlock (kernel-config/guest.config): the VMM ran
    // confined...
    let confined = ["Full", "Partial"].iter().any(|how| {
        run.stderr
            .contains(&format!("confined to the VM's files: {how}"))
    });
    assert!(confined, "the VMM was not confined\n{}", run.report());
    // ...jailed (the nested host's kernel has user namespaces)...
    assert!(
        run.stderr.contains("jailed: its root is an empty tmpfs"),
        "the VMM was not jailed\n{}",
        run.report()
    );
    // ...and its system calls were limited (every VM test runs under the filter; this
    // one checks that the filter is there).
    assert!(
        run.stderr
            .contains("system calls limited by the seccomp filter"),
        "the VMM ran without its seccomp filter\n{}",
        run.report()
    );
    assert!(
        !run.stderr.contains("nested host"),
        "--nested never must not nest again\n{}",
        run.report()
    );
}

/// A job directory of `vmctl nested-exec` under `runtime_dir` (its `XDG_RUNTIME_DIR`)
/// once QEMU has opened its monitor there, within `within`.
fn wait_for_nested_host(runtime_dir: &Path, within: Duration) -> Option<PathBuf> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let started = std::fs::read_dir(runtime_dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.path())
            .find(|dir| dir.join("monitor.sock").exists());
        if started.is_some() {
            return started;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    None
}

/// Stopped by SIGTERM after whatever read its stderr went away (vm-bench killed, a
/// closed terminal), vmctl still stops the nested host, says it was stopped (to a
/// stderr that is gone: that must not abort it) and removes its job directory, which
/// holds the command's environment.
#[test]
fn stopped_after_its_stderr_is_gone_it_still_cleans_up() {
    if !nested_host_available("nested_exec::stopped_after_its_stderr_is_gone_it_still_cleans_up") {
        return;
    }
    let runtime = TempDir::new("nested-exec-runtime");
    let mut child = Command::new(vmctl_bin())
        .args(["nested-exec", "--cpus", "1", "--memory", "512", "--"])
        .args(["sleep", "300"])
        .env("XDG_RUNTIME_DIR", runtime.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run vmctl nested-exec");
    let job_dir = wait_for_nested_host(runtime.path(), Duration::from_secs(120));
    drop(child.stderr.take());
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = child.wait().expect("wait for vmctl");
    let job_dir = job_dir.expect("the nested host did not start within 120 s");
    assert!(killed.is_ok_and(|s| s.success()), "kill -TERM failed");
    assert_eq!(
        status.code(),
        Some(128 + 15),
        "vmctl did not end as stopped by SIGTERM: {status}"
    );
    assert!(
        !job_dir.exists(),
        "{} was left behind: {:?}",
        job_dir.display(),
        std::fs::read_dir(&job_dir).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
}

/// The CPUs the threads of process `pid` may run on, as /proc shows them (`0-1`).
fn threads_cpu_lists(pid: u32) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten();
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .filter_map(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
                .map(|list| list.trim().to_string())
        })
        .collect()
}

/// `VMCTL_VCPU_CPUS` on the host holds the whole nested host, QEMU's every thread, on
/// those host CPUs; inside, where CPU numbers are the nested host's, the command gets
/// the nested host's own choice (every CPU but 0), not the host's list.
#[test]
fn the_host_cpu_list_holds_the_nested_host_and_stays_out_of_it() {
    if !nested_host_available(
        "nested_exec::the_host_cpu_list_holds_the_nested_host_and_stays_out_of_it",
    ) {
        return;
    }
    // The last CPU this test may use: not CPU 0 where there are others, so that the
    // nested host's "1-1" could not be the host's list by chance.
    let allowed = threads_cpu_lists(std::process::id());
    let cpu = cpu_list_last(&allowed[0]);
    let runtime = TempDir::new("nested-exec-cpus");
    let child = Command::new(vmctl_bin())
        .args(["nested-exec", "--cpus", "2", "--memory", "512", "--"])
        .args(["sh", "-c", "echo CPUS=$VMCTL_VCPU_CPUS; sleep 15"])
        .env("VMCTL_VCPU_CPUS", cpu.to_string())
        .env("XDG_RUNTIME_DIR", runtime.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run vmctl nested-exec");
    let started = wait_for_nested_host(runtime.path(), Duration::from_secs(120));
    let qemu =
        std::fs::read_to_string(format!("/proc/{}/task/{}/children", child.id(), child.id()))
            .unwrap_or_default();
    let qemu_cpus: Vec<Vec<String>> = qemu
        .split_whitespace()
        .filter_map(|pid| pid.parse().ok())
        .map(threads_cpu_lists)
        .collect();
    let output = child.wait_with_output().expect("wait for vmctl");
    let report = format!(
        "{}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(started.is_some(), "the nested host did not start\n{report}");
    assert!(output.status.success(), "{report}");
    assert_eq!(
        qemu_cpus.len(),
        1,
        "QEMU among vmctl's children: {qemu:?}\n{report}"
    );
    assert!(
        qemu_cpus[0].len() > 1 && qemu_cpus[0].iter().all(|list| *list == cpu.to_string()),
        "QEMU's threads may run on {:?}, not only CPU {cpu}\n{report}",
        qemu_cpus[0]
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        vm_tests::guest_value(&stdout, "CPUS"),
        Some("1-1"),
        "{report}"
    );
}

/// The last CPU of a list as /proc shows it (`0-1,4` gives 4).
fn cpu_list_last(list: &str) -> usize {
    let last = list.rsplit([',', '-']).next().unwrap_or("0");
    last.trim().parse().expect("a CPU list from /proc")
}
