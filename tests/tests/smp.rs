//! Multiple vCPUs: the guest must see exactly what `--cpus` asked for, each with the
//! TSC-deadline timer (which KVM before 6.14 leaves out of its supported CPUID; a
//! guest without it calibrates its LAPIC timer against the PIT, which under the
//! nested host's emulation goes wrong).

use vm_tests::{boot_script, guest_value, test_initramfs, vm_scenario, TempDir, Vmctl};

#[test]
fn two_vcpus_are_online() {
    vm_scenario("smp::two_vcpus_are_online", || {
        let dir = TempDir::new("smp");
        let script = "echo \"NPROC=$(nproc)\"\n\
                      echo \"CPUINFO=$(grep -c '^processor' /proc/cpuinfo)\"\n\
                      echo \"ONLINE=$(cat /sys/devices/system/cpu/online)\"\n\
                      echo \"TSC_DEADLINE=$(grep -c '^flags.* tsc_deadline_timer' /proc/cpuinfo)\"\n";
        let run = boot_script(&dir, script, &["--cpus".as_ref(), "2".as_ref()]);
        let report = run.report();
        assert_eq!(guest_value(&run.stdout, "NPROC"), Some("2"), "{report}");
        assert_eq!(guest_value(&run.stdout, "CPUINFO"), Some("2"), "{report}");
        assert_eq!(guest_value(&run.stdout, "ONLINE"), Some("0-1"), "{report}");
        assert_eq!(
            guest_value(&run.stdout, "TSC_DEADLINE"),
            Some("2"),
            "{report}"
        );
    });
}

/// More vCPUs than the EBDA's KiB describes (37): the MP table runs on into the
/// legacy BIOS hole, and the guest must still find every CPU in it. Only two of them
/// are started (`maxcpus=2`); the kernel marks present every CPU the table lists.
///
/// In the nested host every vCPU makes the start slower (36: some 45 s, against 8 s
/// for 8), with the nested host's kernel long at one instruction with interrupts
/// disabled, which its stall watch would take for the known stall: the watch is off
/// here, and the harness's own timeout stands in for it.
#[test]
fn cpus_listed_past_the_ebda_are_found() {
    vm_scenario("smp::cpus_listed_past_the_ebda_are_found", || {
        let dir = TempDir::new("smp-many");
        let script = "echo \"PRESENT=$(cat /sys/devices/system/cpu/present)\"\n\
                      echo \"ONLINE=$(cat /sys/devices/system/cpu/online)\"\n";
        let initrd = test_initramfs(&dir, script);
        let run = Vmctl::boot(&initrd)
            .args(["--cpus", "40", "--cmdline", "maxcpus=2"])
            .env("VMCTL_NESTED_STALL_WATCH", "off")
            .run();
        let report = run.report();
        eprintln!("{report}");
        run.assert_success();
        assert_eq!(
            guest_value(&run.stdout, "PRESENT"),
            Some("0-39"),
            "{report}"
        );
        assert_eq!(guest_value(&run.stdout, "ONLINE"), Some("0-1"), "{report}");
    });
}

/// The guest gets no performance-monitoring unit: KVM's vPMU (on AMD its legacy
/// counters, which CPUID cannot hide) is turned off for the VM, as Firecracker's
/// guests have none either: the counters would cost every VM exit the host's perf
/// state switches, and let a guest watch the host CPU's events.
#[test]
fn the_guest_has_no_pmu() {
    vm_scenario("smp::the_guest_has_no_pmu", || {
        let dir = TempDir::new("pmu");
        let script = "dmesg | grep -i 'Performance Events' | sed 's/^[^]]*] /PMU=/'\n\
                      echo \"PMU_DONE=1\"\n";
        let run = boot_script(&dir, script, &[]);
        let report = run.report();
        assert_eq!(guest_value(&run.stdout, "PMU_DONE"), Some("1"), "{report}");
        let pmu =
            guest_value(&run.stdout, "PMU").unwrap_or_else(|| panic!("no PMU line\n{report}"));
        assert!(
            pmu.contains("software events only") || pmu.contains("no PMU driver"),
            "the guest found a PMU: {pmu:?}\n{report}"
        );
    });
}
