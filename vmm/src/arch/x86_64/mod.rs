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
/// ioctls. `None` (with a note on stderr) where KVM is unusable: those tests then check
/// only the pure computations, which have tests of their own.
#[cfg(test)]
pub(crate) fn test_vcpu(
    with_irqchip: bool,
) -> Option<(kvm_ioctls::Kvm, kvm_ioctls::VmFd, kvm_ioctls::VcpuFd)> {
    let kvm = kvm_ioctls::Kvm::new()
        .map_err(|e| eprintln!("KVM part of this test not run: /dev/kvm: {e}"))
        .ok()?;
    let vm = kvm
        .create_vm()
        .map_err(|e| eprintln!("KVM part of this test not run: cannot create a VM: {e}"))
        .ok()?;
    if with_irqchip {
        vm.create_irq_chip()
            .map_err(|e| eprintln!("KVM part of this test not run: no irqchip: {e}"))
            .ok()?;
    }
    let vcpu = vm
        .create_vcpu(0)
        .map_err(|e| eprintln!("KVM part of this test not run: cannot create a vCPU: {e}"))
        .ok()?;
    Some((kvm, vm, vcpu))
}
