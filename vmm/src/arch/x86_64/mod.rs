//! x86_64 boot details: memory layout, boot parameters, page tables, GDT, CPUID,
//! MSRs, LAPIC and the MP table.

pub mod boot;
pub mod cpuid;
pub mod gdt;
pub mod interrupts;
pub mod layout;
pub mod mptable;
pub mod msr;
pub mod paging;
pub mod regs;

/// A VM and a vCPU on this host's /dev/kvm, for unit tests that also run the real
/// ioctls. `None` where KVM is unusable (said past the capture, or a failure under CI:
/// see [`kvm_part_not_run`]): those tests then check only the pure computations, which
/// have tests of their own.
#[cfg(test)]
pub(crate) fn test_vcpu(
    with_irqchip: bool,
) -> Option<(kvm_ioctls::Kvm, kvm_ioctls::VmFd, kvm_ioctls::VcpuFd)> {
    let kvm = kvm_ioctls::Kvm::new()
        .map_err(|e| kvm_part_not_run(&format!("/dev/kvm: {e}")))
        .ok()?;
    let vm = kvm
        .create_vm()
        .map_err(|e| kvm_part_not_run(&format!("cannot create a VM: {e}")))
        .ok()?;
    if with_irqchip {
        vm.create_irq_chip()
            .map_err(|e| kvm_part_not_run(&format!("no irqchip: {e}")))
            .ok()?;
    }
    let vcpu = vm
        .create_vcpu(0)
        .map_err(|e| kvm_part_not_run(&format!("cannot create a vCPU: {e}")))
        .ok()?;
    Some((kvm, vm, vcpu))
}

/// Says on the terminal, past the test harness's capture, that the running test's KVM
/// part (its real ioctls) did not run for want of a usable KVM (`why`); fails the test
/// instead under CI (`CI` set, as `.ci/run` sets it), whose machines have KVM (a PVM
/// one, which runs these too): there, a test that passes without its KVM part is a
/// broken machine, not a pass.
#[cfg(test)]
fn kvm_part_not_run(why: &str) {
    use std::io::Write;
    // libtest names a test's thread after the test.
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("this test");
    let ci = std::env::var("CI").unwrap_or_default();
    if !ci.is_empty() && ci != "false" && ci != "0" {
        panic!("{test}: its KVM part must run under CI (CI={ci}), but KVM is unusable: {why}");
    }
    let _ = writeln!(
        std::io::stderr(),
        "NOT RUN: the KVM part of {test}: {why}; it passes on the pure computations alone \
         (with CI set it fails)"
    );
}
