//! Boots the base hello guest, a guest whose script reboots by itself, and one that
//! triple-faults; the balloon left out; and the VMM's seccomp switch.

use std::ffi::OsStr;
use vm_tests::{base_initramfs, boot_script, vm_scenario, TempDir, Vmctl};

/// Parses `vmctl-vmm: boot time: <a> ms since VMM start, <b> ms since the first vCPU ran`.
fn parse_boot_time(line: &str) -> Option<(f64, f64)> {
    let rest = line.strip_prefix("vmctl-vmm: boot time: ")?;
    let (since_start, rest) = rest.split_once(" ms since VMM start, ")?;
    let since_vcpu = rest.strip_suffix(" ms since the first vCPU ran")?;
    Some((
        since_start.trim().parse().ok()?,
        since_vcpu.trim().parse().ok()?,
    ))
}

#[test]
fn boot_time_line_parses() {
    let line = "vmctl-vmm: boot time: 812.5 ms since VMM start, 790.25 ms since the first vCPU ran";
    assert_eq!(parse_boot_time(line), Some((812.5, 790.25)));
    assert_eq!(parse_boot_time("vmctl-vmm: boot time: soon"), None);
}

#[test]
fn hello_guest_boots_and_reports_boot_time() {
    vm_scenario("boot::hello_guest_boots_and_reports_boot_time", || {
        let run = Vmctl::boot(base_initramfs()).arg("--boot-time").run();
        eprintln!("{}", run.report());
        run.assert_success();

        let hello = run
            .stdout
            .lines()
            .find(|l| l.contains("Hello from the guest: "))
            .unwrap_or_else(|| panic!("no hello line on the serial console\n{}", run.report()));
        assert!(
            hello.contains("Linux 6.1"),
            "unexpected kernel in {hello:?}"
        );
        assert!(
            hello.contains(", 1 CPU(s)"),
            "default should be 1 vCPU: {hello:?}"
        );

        let times: Vec<(f64, f64)> = run
            .stderr
            .lines()
            .filter(|l| l.starts_with("vmctl-vmm: boot time: "))
            .map(|l| {
                parse_boot_time(l.trim_end())
                    .unwrap_or_else(|| panic!("malformed boot-time line {l:?}\n{}", run.report()))
            })
            .collect();
        assert_eq!(
            times.len(),
            1,
            "expected one boot-time line\n{}",
            run.report()
        );
        let (since_start, since_vcpu) = times[0];
        assert!(
            since_start > 0.0 && since_vcpu > 0.0,
            "boot times must be positive: {times:?}"
        );
        assert!(
            since_vcpu <= since_start,
            "the first vCPU cannot run before the VMM starts: {times:?}"
        );
        assert!(
            !run.stderr.contains("boot-timer failed") && !run.stdout.contains("boot-timer failed"),
            "the guest's boot timer write failed\n{}",
            run.report()
        );
    });
}

#[test]
fn guest_script_that_reboots_exits_zero() {
    vm_scenario("boot::guest_script_that_reboots_exits_zero", || {
        let dir = TempDir::new("reboot");
        let marker = vm_tests::random_hex(16);
        let script = format!(
            "echo GUEST_MARKER={marker}\n\
             sync\n\
             reboot -f\n\
             sleep 600\n\
             echo NOT_REBOOTED\n"
        );
        let run = boot_script(
            &dir,
            &script,
            &[OsStr::new("--cmdline"), OsStr::new("vmtest.flag=1")],
        );
        assert_eq!(
            vm_tests::guest_value(&run.stdout, "GUEST_MARKER"),
            Some(marker.as_str())
        );
        assert!(!run.stdout.contains("NOT_REBOOTED"), "{}", run.report());
        assert!(
            !run.stdout.contains("Hello from the guest"),
            "/etc/vmtest.sh should replace the hello line\n{}",
            run.report()
        );
    });
}

/// `vmctl boot` gives the guest the balloon through which it gives back what it frees
/// (virtio device 5) and a virtio console (3), unless `--no-free-page-reporting` and
/// `--no-virtio-console` leave them out, as the boot benchmark does.
#[test]
fn the_balloon_and_the_virtio_console_are_there_unless_left_out() {
    vm_scenario(
        "boot::the_balloon_and_the_virtio_console_are_there_unless_left_out",
        || {
            let dir = TempDir::new("devices");
            let script = "echo VIRTIO_IDS=$(cat /sys/bus/virtio/devices/*/device 2>/dev/null | tr '\\n' ,)\n";
            let ids = |extra: &[&str]| {
                let extra: Vec<&OsStr> = extra.iter().map(OsStr::new).collect();
                let run = boot_script(&dir, script, &extra);
                vm_tests::guest_value(&run.stdout, "VIRTIO_IDS")
                    .unwrap_or_else(|| panic!("no VIRTIO_IDS line\n{}", run.report()))
                    .trim_end()
                    .to_string()
            };
            // virtio-rng (4), the balloon (5), the console (3).
            assert_eq!(
                ids(&[]),
                "0x0004,0x0005,0x0003,",
                "the default boot's virtio devices"
            );
            assert_eq!(
                ids(&["--no-free-page-reporting"]),
                "0x0004,0x0003,",
                "virtio devices with --no-free-page-reporting"
            );
            assert_eq!(
                ids(&["--no-free-page-reporting", "--no-virtio-console"]),
                "0x0004,",
                "virtio devices with --no-free-page-reporting --no-virtio-console"
            );
        },
    );
}

/// `VMCTL_SECCOMP` reaches the VMM wherever it runs (where KVM is not hardware-backed,
/// inside the nested host): `off` boots without the filter and says so; a value it
/// does not know stops the VM with an error that names it.
#[test]
fn the_seccomp_switch_reaches_the_vmm() {
    vm_scenario("boot::the_seccomp_switch_reaches_the_vmm", || {
        let off = Vmctl::boot(base_initramfs())
            .env("VMCTL_SECCOMP", "off")
            .run();
        eprintln!("{}", off.report());
        off.assert_success();
        assert!(
            off.stderr
                .contains("VMCTL_SECCOMP=off: the VMM runs without its seccomp filter"),
            "{}",
            off.report()
        );
        let unknown = Vmctl::boot(base_initramfs())
            .env("VMCTL_SECCOMP", "maybe")
            .run();
        eprintln!("{}", unknown.report());
        assert_eq!(unknown.code, Some(1), "{}", unknown.report());
        assert!(
            unknown
                .stderr
                .contains("VMCTL_SECCOMP=\"maybe\" is not understood"),
            "{}",
            unknown.report()
        );
    });
}

#[test]
fn cmdline_is_appended() {
    vm_scenario("boot::cmdline_is_appended", || {
        let dir = TempDir::new("cmdline");
        let token = format!("vmtest.token={}", vm_tests::random_hex(12));
        let run = boot_script(
            &dir,
            "echo \"CMDLINE=$(cat /proc/cmdline)\"\n",
            &[OsStr::new("--cmdline"), OsStr::new(&token)],
        );
        let cmdline = vm_tests::guest_value(&run.stdout, "CMDLINE")
            .unwrap_or_else(|| panic!("no CMDLINE line\n{}", run.report()));
        let words: Vec<&str> = cmdline.split_whitespace().collect();
        assert!(
            words.contains(&token.as_str()),
            "{token} missing from {cmdline:?}"
        );
        assert!(
            words.len() > 1,
            "--cmdline must append to the default, not replace it: {cmdline:?}"
        );
        assert!(
            words.contains(&"reboot=k"),
            "the default command line should have reboot=k: {cmdline:?}"
        );
    });
}

/// A guest that triple-faults (the kernel's own `reboot=t`: an empty IDT, then `int3`)
/// is reported as crashed, with its vCPU; where it was, on Intel; on AMD, KVM resets
/// the vCPU before it reports the fault, so the report must say the registers are lost
/// rather than pass the reset vector off as the crash site.
#[test]
fn a_guest_that_triple_faults_is_reported_as_crashed() {
    vm_scenario(
        "boot::a_guest_that_triple_faults_is_reported_as_crashed",
        || {
            let dir = TempDir::new("triple-fault");
            let initrd = vm_tests::test_initramfs(
                &dir,
                "echo ABOUT_TO_TRIPLE_FAULT=1\nreboot -f\nsleep 600\necho NOT_REBOOTED\n",
            );
            let run = Vmctl::boot(&initrd).args(["--cmdline", "reboot=t"]).run();
            eprintln!("{}", run.report());
            assert!(!run.timed_out, "vmctl timed out\n{}", run.report());
            // The crash is the point: what follows quotes it, and is no lost VM.
            vm_tests::no_retry_from_here();
            vm_tests::assert_no_panic(&run);
            assert_eq!(
                vm_tests::guest_value(&run.stdout, "ABOUT_TO_TRIPLE_FAULT"),
                Some("1"),
                "the guest's script did not run\n{}",
                run.report()
            );
            assert_ne!(run.code, Some(0), "a crash must fail\n{}", run.report());
            let crash = run
                .stderr
                .lines()
                // From the nested host's vmctl, or from the VMM that `vmctl boot` became.
                .find(|l| {
                    (l.contains("vmctl: error: ") || l.contains("vmctl-vmm: error: "))
                        && l.contains("the guest crashed (triple fault")
                })
                .unwrap_or_else(|| panic!("no triple fault reported\n{}", run.report()));
            assert!(crash.contains("on vCPU 0: "), "{crash}");
            // The nested host's emulated CPU is an AMD one.
            let amd =
                !vm_tests::hardware_kvm() || std::path::Path::new("/sys/module/kvm_amd").exists();
            if amd {
                assert!(crash.contains("its registers are lost"), "{crash}");
                assert!(!crash.contains("rip 0xfff0"), "{crash}");
            } else {
                // The kernel's `int3`, in its text, with paging on.
                assert!(crash.contains("rip 0xffffffff8"), "{crash}");
            }
        },
    );
}
