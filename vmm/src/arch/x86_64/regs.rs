//! Boot-time vCPU registers for the Linux 64-bit boot protocol: long mode with
//! paging on, flat segments, `rsi` pointing at the zero page.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_sregs};
use kvm_ioctls::VcpuFd;

use super::gdt::{self, GdtError};
use super::layout::{BOOT_GDT_START, BOOT_IDT_START, BOOT_STACK_POINTER, ZERO_PAGE_START};
use super::paging::{self, PagingError};
use crate::memory::GuestMemoryMmap;

/// CR0: protected mode enable.
pub const X86_CR0_PE: u64 = 1 << 0;
/// CR0: extension type (always 1 on modern CPUs).
pub const X86_CR0_ET: u64 = 1 << 4;
/// CR0: not write-through.
pub const X86_CR0_NW: u64 = 1 << 29;
/// CR0: cache disable.
pub const X86_CR0_CD: u64 = 1 << 30;
/// CR0: paging enable.
pub const X86_CR0_PG: u64 = 1 << 31;
/// CR4: physical address extension (required for long mode).
pub const X86_CR4_PAE: u64 = 1 << 5;
/// EFER: long mode enable.
pub const EFER_LME: u64 = 1 << 8;
/// EFER: long mode active.
pub const EFER_LMA: u64 = 1 << 10;

/// RFLAGS at entry: only the always-one bit 1; interrupts disabled.
pub const BOOT_RFLAGS: u64 = 0x2;
/// x87 control word after FNINIT: all exceptions masked, 64-bit precision.
pub const BOOT_FCW: u16 = 0x37f;
/// MXCSR reset value: all SSE exceptions masked.
pub const BOOT_MXCSR: u32 = 0x1f80;

#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("cannot set the general-purpose registers (entry {entry:#x}): {source}")]
    SetRegs {
        entry: u64,
        source: kvm_ioctls::Error,
    },
    #[error("cannot read the special registers: {0}")]
    GetSregs(kvm_ioctls::Error),
    #[error("cannot set the special registers (CR3 {cr3:#x}): {source}")]
    SetSregs { cr3: u64, source: kvm_ioctls::Error },
    #[error("cannot set the FPU registers: {0}")]
    SetFpu(kvm_ioctls::Error),
    #[error(transparent)]
    Gdt(#[from] GdtError),
    #[error(transparent)]
    Paging(#[from] PagingError),
}

/// The general-purpose registers at the 64-bit entry point `entry`.
pub fn boot_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rflags: BOOT_RFLAGS,
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    }
}

/// Sets `rip` to `entry`, the stack, and `rsi` to the zero page.
pub fn setup_regs(vcpu: &VcpuFd, entry: u64) -> Result<(), RegsError> {
    vcpu.set_regs(&boot_regs(entry))
        .map_err(|source| RegsError::SetRegs { entry, source })
}

/// The x87/SSE state at entry.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: BOOT_FCW,
        mxcsr: BOOT_MXCSR,
        ..Default::default()
    }
}

/// Sets the x87 control word and MXCSR to their reset values.
pub fn setup_fpu(vcpu: &VcpuFd) -> Result<(), RegsError> {
    vcpu.set_fpu(&boot_fpu()).map_err(RegsError::SetFpu)
}

/// Computes the long-mode special registers from the vCPU's current ones (which
/// keep e.g. the APIC base and the pending-interrupt bitmap): boot GDT/IDT, flat
/// segments, paging through the page tables at `cr3`.
pub fn boot_sregs(current: &kvm_sregs, cr3: u64) -> kvm_sregs {
    let mut sregs = *current;

    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = gdt::BOOT_GDT_LIMIT;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = gdt::BOOT_IDT_LIMIT;

    let code = gdt::code_segment();
    let data = gdt::data_segment();
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = gdt::tss_segment();

    sregs.cr3 = cr3;
    sregs.cr4 |= X86_CR4_PAE;
    // Caches on (a fresh vCPU has CD and NW set), protection and paging on.
    sregs.cr0 = (sregs.cr0 & !(X86_CR0_CD | X86_CR0_NW)) | X86_CR0_PE | X86_CR0_ET | X86_CR0_PG;
    sregs.efer |= EFER_LME | EFER_LMA;
    sregs
}

/// Writes the boot GDT, IDT and identity page tables to guest memory and puts the
/// vCPU in long mode using them.
pub fn setup_sregs(mem: &GuestMemoryMmap, vcpu: &VcpuFd) -> Result<(), RegsError> {
    gdt::write_gdt_and_idt(mem)?;
    let cr3 = paging::write_identity_page_tables(mem)?;
    let current = vcpu.get_sregs().map_err(RegsError::GetSregs)?;
    let sregs = boot_sregs(&current, cr3);
    vcpu.set_sregs(&sregs)
        .map_err(|source| RegsError::SetSregs { cr3, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::PML4_START;

    #[test]
    fn regs_point_at_entry_stack_and_zero_page() {
        let regs = boot_regs(0x100_0000);
        assert_eq!(regs.rip, 0x100_0000);
        assert_eq!(regs.rsp, BOOT_STACK_POINTER);
        assert_eq!(regs.rbp, BOOT_STACK_POINTER);
        assert_eq!(regs.rsi, ZERO_PAGE_START);
        assert_eq!(regs.rflags, 0x2);
        assert_eq!(regs.rax, 0);
    }

    #[test]
    fn fpu_reset_values() {
        let fpu = boot_fpu();
        assert_eq!(fpu.fcw, 0x37f);
        assert_eq!(fpu.mxcsr, 0x1f80);
    }

    #[test]
    fn sregs_enter_long_mode() {
        // What KVM reports for a freshly created vCPU.
        let current = kvm_sregs {
            cr0: 0x6000_0010,
            apic_base: 0xfee0_0900,
            ..Default::default()
        };
        let sregs = boot_sregs(&current, PML4_START);

        assert_eq!(sregs.cr0, X86_CR0_PE | X86_CR0_ET | X86_CR0_PG);
        assert_eq!(sregs.cr3, PML4_START);
        assert_ne!(sregs.cr4 & X86_CR4_PAE, 0);
        assert_eq!(sregs.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        // Untouched state is kept.
        assert_eq!(sregs.apic_base, 0xfee0_0900);

        assert_eq!(sregs.gdt.base, BOOT_GDT_START);
        assert_eq!(sregs.gdt.limit, 31);
        assert_eq!(sregs.idt.base, BOOT_IDT_START);
        assert_eq!(sregs.idt.limit, 7);

        assert_eq!(sregs.cs.selector, 0x08);
        assert_eq!(sregs.cs.l, 1);
        for seg in [sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss] {
            assert_eq!(seg.selector, 0x10);
            assert_eq!(seg.present, 1);
            assert_eq!(seg.limit, 0xffff_ffff);
        }
        assert_eq!(sregs.tr.selector, 0x18);
    }

    #[test]
    fn sregs_keep_other_cr_bits() {
        let current = kvm_sregs {
            cr4: 1 << 7, // PGE
            efer: 1,     // SCE
            ..Default::default()
        };
        let sregs = boot_sregs(&current, PML4_START);
        assert_eq!(sregs.cr4, (1 << 7) | X86_CR4_PAE);
        assert_eq!(sregs.efer, 1 | EFER_LME | EFER_LMA);
    }

    /// Runs the ioctls on a real vCPU when /dev/kvm is usable; skips otherwise.
    #[test]
    fn ioctls_with_kvm_if_available() {
        let Some((_kvm, _vm, vcpu)) = crate::arch::x86_64::test_vcpu(false) else {
            return;
        };
        let mem = GuestMemoryMmap::from_ranges(&[(vm_memory::GuestAddress(0), 0x10_0000)]).unwrap();
        setup_regs(&vcpu, 0x10_0000).unwrap();
        setup_fpu(&vcpu).unwrap();
        setup_sregs(&mem, &vcpu).unwrap();
        let regs = vcpu.get_regs().unwrap();
        assert_eq!(regs.rip, 0x10_0000);
        let sregs = vcpu.get_sregs().unwrap();
        assert_eq!(sregs.cr3, PML4_START);
        assert_ne!(sregs.efer & EFER_LMA, 0);
    }
}
