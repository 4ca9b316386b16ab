//! Multiple vCPUs: the guest must see exactly what `--cpus` asked for, each with the
//! TSC-deadline timer (which KVM before 6.14 leaves out of its supported CPUID; a
//! guest without it calibrates its LAPIC timer against the PIT, which under the
//! nested host's emulation goes wrong).

use vm_tests::{boot_script, guest_value, vm_scenario, TempDir};

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
