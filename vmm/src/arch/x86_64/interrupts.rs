//! Local APIC LINT pins wired like a PC in virtual-wire mode: LINT0 receives the
//! legacy PIC's ExtINT, LINT1 receives NMI.

use kvm_bindings::kvm_lapic_state;
use kvm_ioctls::VcpuFd;

/// LVT LINT0 register offset in the LAPIC register page.
pub const APIC_LVT0: usize = 0x350;
/// LVT LINT1 register offset.
pub const APIC_LVT1: usize = 0x360;
/// Delivery mode field of an LVT register: bits 10:8.
pub const APIC_DELIVERY_MODE_SHIFT: u32 = 8;
pub const APIC_DELIVERY_MODE_MASK: u32 = 0x7 << APIC_DELIVERY_MODE_SHIFT;
/// Delivery modes (fixed only in the tests: the LINT pins get NMI and ExtINT).
#[cfg(test)]
const APIC_MODE_FIXED: u32 = 0x0;
pub const APIC_MODE_NMI: u32 = 0x4;
pub const APIC_MODE_EXTINT: u32 = 0x7;

#[derive(Debug, thiserror::Error)]
pub enum InterruptsError {
    #[error("cannot read the local APIC state (KVM_GET_LAPIC): {0}")]
    GetLapic(kvm_ioctls::Error),
    #[error("cannot write the local APIC state (KVM_SET_LAPIC): {0}")]
    SetLapic(kvm_ioctls::Error),
    #[error("local APIC register offset {offset:#x} is outside the {size}-byte register page")]
    BadOffset { offset: usize, size: usize },
}

fn register_bytes(
    lapic: &kvm_lapic_state,
    offset: usize,
) -> Result<std::ops::Range<usize>, InterruptsError> {
    let size = lapic.regs.len();
    match offset.checked_add(4) {
        Some(end) if end <= size => Ok(offset..end),
        _ => Err(InterruptsError::BadOffset { offset, size }),
    }
}

/// Reads the 32-bit LAPIC register at `offset`.
pub fn get_lapic_reg(lapic: &kvm_lapic_state, offset: usize) -> Result<u32, InterruptsError> {
    let range = register_bytes(lapic, offset)?;
    let mut bytes = [0u8; 4];
    for (dst, src) in bytes.iter_mut().zip(&lapic.regs[range]) {
        // c_char -> raw byte.
        *dst = *src as u8;
    }
    Ok(u32::from_le_bytes(bytes))
}

/// Writes the 32-bit LAPIC register at `offset`.
pub fn set_lapic_reg(
    lapic: &mut kvm_lapic_state,
    offset: usize,
    value: u32,
) -> Result<(), InterruptsError> {
    let range = register_bytes(lapic, offset)?;
    for (dst, src) in lapic.regs[range].iter_mut().zip(value.to_le_bytes()) {
        // raw byte -> c_char.
        *dst = src as _;
    }
    Ok(())
}

/// `reg` with its LVT delivery mode replaced by `mode` (other bits, e.g. the mask,
/// are kept).
pub fn with_delivery_mode(reg: u32, mode: u32) -> u32 {
    (reg & !APIC_DELIVERY_MODE_MASK)
        | ((mode << APIC_DELIVERY_MODE_SHIFT) & APIC_DELIVERY_MODE_MASK)
}

/// Sets LINT0 to ExtINT and LINT1 to NMI in a LAPIC state.
pub fn configure_lint(lapic: &mut kvm_lapic_state) -> Result<(), InterruptsError> {
    let lvt0 = get_lapic_reg(lapic, APIC_LVT0)?;
    set_lapic_reg(lapic, APIC_LVT0, with_delivery_mode(lvt0, APIC_MODE_EXTINT))?;
    let lvt1 = get_lapic_reg(lapic, APIC_LVT1)?;
    set_lapic_reg(lapic, APIC_LVT1, with_delivery_mode(lvt1, APIC_MODE_NMI))
}

/// Configures the vCPU's LINT0 as ExtINT and LINT1 as NMI.
pub fn set_lint(vcpu: &VcpuFd) -> Result<(), InterruptsError> {
    let mut lapic = vcpu.get_lapic().map_err(InterruptsError::GetLapic)?;
    configure_lint(&mut lapic)?;
    vcpu.set_lapic(&lapic).map_err(InterruptsError::SetLapic)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_mode_math() {
        // Reset value of an LVT register: masked, fixed.
        assert_eq!(
            with_delivery_mode(0x0001_0000, APIC_MODE_EXTINT),
            0x0001_0700
        );
        assert_eq!(with_delivery_mode(0x0001_0000, APIC_MODE_NMI), 0x0001_0400);
        assert_eq!(with_delivery_mode(0x0000_0700, APIC_MODE_NMI), 0x0000_0400);
        assert_eq!(
            with_delivery_mode(0xffff_ffff, APIC_MODE_FIXED),
            0xffff_f8ff
        );
        // A bogus mode cannot spill into other fields.
        assert_eq!(with_delivery_mode(0, 0xff), 0x700);
    }

    #[test]
    fn register_round_trip() {
        let mut lapic = kvm_lapic_state::default();
        set_lapic_reg(&mut lapic, 0x20, 0xdead_beef).unwrap();
        assert_eq!(get_lapic_reg(&lapic, 0x20).unwrap(), 0xdead_beef);
        assert_eq!(lapic.regs[0x20] as u8, 0xef);
        assert_eq!(lapic.regs[0x23] as u8, 0xde);
        assert_eq!(get_lapic_reg(&lapic, 0x24).unwrap(), 0);
    }

    #[test]
    fn out_of_range_offset_rejected() {
        let mut lapic = kvm_lapic_state::default();
        assert!(get_lapic_reg(&lapic, 0x3fd).is_err());
        assert!(get_lapic_reg(&lapic, 0x3fc).is_ok());
        let err = set_lapic_reg(&mut lapic, usize::MAX, 0).unwrap_err();
        assert!(err.to_string().contains("0xffff"), "{err}");
    }

    #[test]
    fn configures_lint_pins() {
        let mut lapic = kvm_lapic_state::default();
        set_lapic_reg(&mut lapic, APIC_LVT0, 0x0001_0000).unwrap();
        set_lapic_reg(&mut lapic, APIC_LVT1, 0x0001_0000).unwrap();
        set_lapic_reg(&mut lapic, 0x340, 0x1234).unwrap();
        configure_lint(&mut lapic).unwrap();
        assert_eq!(get_lapic_reg(&lapic, APIC_LVT0).unwrap(), 0x0001_0700);
        assert_eq!(get_lapic_reg(&lapic, APIC_LVT1).unwrap(), 0x0001_0400);
        assert_eq!(get_lapic_reg(&lapic, 0x340).unwrap(), 0x1234);
    }

    /// Runs the ioctls on a real vCPU with an in-kernel irqchip when /dev/kvm is
    /// usable; skips otherwise.
    #[test]
    fn set_lint_with_kvm_if_available() {
        let Some((_kvm, _vm, vcpu)) = crate::arch::x86_64::test_vcpu(true) else {
            return;
        };
        set_lint(&vcpu).unwrap();
        let lapic = vcpu.get_lapic().unwrap();
        let lvt0 = get_lapic_reg(&lapic, APIC_LVT0).unwrap();
        assert_eq!(lvt0 & APIC_DELIVERY_MODE_MASK, APIC_MODE_EXTINT << 8);
    }
}
