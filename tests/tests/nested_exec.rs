//! `vmctl nested-exec`: a command inside a fresh nested host, which has a real KVM.
//! Also covers the VMM's direct path (`--nested never`) with stdin at /dev/null, the
//! way it runs on hardware-KVM hosts in CI.

use vm_tests::{base_initramfs, find_executable, kernel, record_skip, vmctl_bin, TempDir, Vmctl};

/// Needs QEMU (the nested host), whatever this host's KVM is.
fn nested_host_available(test: &str) -> bool {
    let qemu = std::env::var_os("VMCTL_QEMU").unwrap_or_else(|| "qemu-system-x86_64".into());
    if find_executable(std::path::Path::new(&qemu)).is_some() {
        return true;
    }
    let reason = "no qemu-system-x86_64 for the nested host (apt-get install qemu-system-x86)";
    if std::env::var("VMCTL_REQUIRE_VM").is_ok_and(|v| v == "1") {
        panic!("VMCTL_REQUIRE_VM=1 but {test} cannot run: {reason}");
    }
    record_skip(test, reason);
    false
}

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
/// stall watch: README, "Known problem"), and finds none stuck in a healthy one.
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
    for round in rounds {
        let vcpus: Vec<&str> = round.split(", ").collect();
        assert_eq!(vcpus.len(), 2, "{round}");
        for (cpu, vcpu) in vcpus.iter().enumerate() {
            assert!(
                vcpu.starts_with(&format!("{cpu} "))
                    && (vcpu.ends_with(" halted") || vcpu.ends_with(" running")),
                "vCPU {cpu} read as {vcpu:?} in {round:?}"
            );
        }
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
