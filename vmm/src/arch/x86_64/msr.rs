//! Model-specific registers set at boot: the syscall MSRs cleared, the TSC at zero,
//! fast strings on, and MTRRs enabled with write-back as the default memory type
//! (without that, a guest that honours MTRRs would run uncached).

use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::VcpuFd;

pub const MSR_IA32_TSC: u32 = 0x0000_0010;
pub const MSR_IA32_SYSENTER_CS: u32 = 0x0000_0174;
pub const MSR_IA32_SYSENTER_ESP: u32 = 0x0000_0175;
pub const MSR_IA32_SYSENTER_EIP: u32 = 0x0000_0176;
pub const MSR_IA32_MISC_ENABLE: u32 = 0x0000_01a0;
pub const MSR_MTRR_DEF_TYPE: u32 = 0x0000_02ff;
pub const MSR_STAR: u32 = 0xc000_0081;
pub const MSR_LSTAR: u32 = 0xc000_0082;
pub const MSR_CSTAR: u32 = 0xc000_0083;
pub const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;

/// IA32_MISC_ENABLE bit 0: fast-string operations (`rep movs`/`stos`).
pub const MISC_ENABLE_FAST_STRING: u64 = 1 << 0;
/// IA32_MTRR_DEF_TYPE bit 11: MTRRs enabled.
pub const MTRR_ENABLE: u64 = 1 << 11;
/// IA32_MTRR_DEF_TYPE bits 7:0: default memory type; 6 = write-back.
pub const MTRR_MEM_TYPE_WB: u64 = 0x6;

#[derive(Debug, thiserror::Error)]
pub enum MsrError {
    #[error("cannot build the list of {count} boot MSRs: {source}")]
    Build {
        count: usize,
        source: vmm_sys_util::fam::Error,
    },
    #[error("cannot set the {count} boot MSRs: {source}")]
    SetMsrs {
        count: usize,
        source: kvm_ioctls::Error,
    },
    #[error(
        "KVM set only {set} of {count} boot MSRs: {name} ({index:#x}) = {value:#x} was rejected"
    )]
    NotAllSet {
        set: usize,
        count: usize,
        index: u32,
        name: &'static str,
        value: u64,
    },
}

/// The name of a boot MSR, for error messages.
pub fn msr_name(index: u32) -> &'static str {
    match index {
        MSR_IA32_TSC => "IA32_TSC",
        MSR_IA32_SYSENTER_CS => "IA32_SYSENTER_CS",
        MSR_IA32_SYSENTER_ESP => "IA32_SYSENTER_ESP",
        MSR_IA32_SYSENTER_EIP => "IA32_SYSENTER_EIP",
        MSR_IA32_MISC_ENABLE => "IA32_MISC_ENABLE",
        MSR_MTRR_DEF_TYPE => "IA32_MTRR_DEF_TYPE",
        MSR_STAR => "STAR",
        MSR_LSTAR => "LSTAR",
        MSR_CSTAR => "CSTAR",
        MSR_SYSCALL_MASK => "SYSCALL_MASK",
        MSR_KERNEL_GS_BASE => "KERNEL_GS_BASE",
        _ => "unknown MSR",
    }
}

fn msr(index: u32, data: u64) -> kvm_msr_entry {
    kvm_msr_entry {
        index,
        data,
        ..Default::default()
    }
}

/// The MSRs (and values) every vCPU gets at boot.
pub fn boot_msr_entries() -> Vec<kvm_msr_entry> {
    vec![
        msr(MSR_IA32_SYSENTER_CS, 0),
        msr(MSR_IA32_SYSENTER_ESP, 0),
        msr(MSR_IA32_SYSENTER_EIP, 0),
        msr(MSR_STAR, 0),
        msr(MSR_CSTAR, 0),
        msr(MSR_KERNEL_GS_BASE, 0),
        msr(MSR_SYSCALL_MASK, 0),
        msr(MSR_LSTAR, 0),
        msr(MSR_IA32_TSC, 0),
        msr(MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        msr(MSR_MTRR_DEF_TYPE, MTRR_ENABLE | MTRR_MEM_TYPE_WB),
    ]
}

/// Checks KVM_SET_MSRS's return value (how many entries it set, in order).
fn check_all_set(entries: &[kvm_msr_entry], set: usize) -> Result<(), MsrError> {
    match entries.get(set) {
        None => Ok(()),
        Some(failed) => Err(MsrError::NotAllSet {
            set,
            count: entries.len(),
            index: failed.index,
            name: msr_name(failed.index),
            value: failed.data,
        }),
    }
}

/// Sets [`boot_msr_entries`] on `vcpu`; fails naming the first MSR KVM rejected.
pub fn setup_msrs(vcpu: &VcpuFd) -> Result<(), MsrError> {
    let entries = boot_msr_entries();
    let count = entries.len();
    let msrs = Msrs::from_entries(&entries).map_err(|source| MsrError::Build { count, source })?;
    let set = vcpu
        .set_msrs(&msrs)
        .map_err(|source| MsrError::SetMsrs { count, source })?;
    check_all_set(&entries, set)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value_of(index: u32) -> u64 {
        boot_msr_entries()
            .iter()
            .find(|e| e.index == index)
            .unwrap_or_else(|| panic!("{} missing", msr_name(index)))
            .data
    }

    #[test]
    fn boot_values() {
        for index in [
            MSR_IA32_SYSENTER_CS,
            MSR_IA32_SYSENTER_ESP,
            MSR_IA32_SYSENTER_EIP,
            MSR_STAR,
            MSR_CSTAR,
            MSR_KERNEL_GS_BASE,
            MSR_SYSCALL_MASK,
            MSR_LSTAR,
            MSR_IA32_TSC,
        ] {
            assert_eq!(value_of(index), 0, "{}", msr_name(index));
        }
        assert_eq!(value_of(MSR_IA32_MISC_ENABLE) & 1, 1);
        assert_eq!(value_of(MSR_MTRR_DEF_TYPE), 0x806);
    }

    #[test]
    fn entries_are_unique_and_named() {
        let entries = boot_msr_entries();
        for (i, e) in entries.iter().enumerate() {
            assert_ne!(msr_name(e.index), "unknown MSR");
            assert!(entries[i + 1..].iter().all(|o| o.index != e.index));
        }
        assert!(Msrs::from_entries(&entries).is_ok());
    }

    #[test]
    fn partial_set_names_first_failure() {
        let entries = boot_msr_entries();
        assert!(check_all_set(&entries, entries.len()).is_ok());
        let err = check_all_set(&entries, 9).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("IA32_MISC_ENABLE") && msg.contains("0x1a0"),
            "{msg}"
        );
        assert!(msg.contains("9 of 11"), "{msg}");
        let err = check_all_set(&entries, 0).unwrap_err();
        assert!(err.to_string().contains("IA32_SYSENTER_CS"));
    }

    /// Runs the ioctl on a real vCPU when /dev/kvm is usable; skips otherwise.
    #[test]
    fn setup_msrs_with_kvm_if_available() {
        let Some((_kvm, _vm, vcpu)) = crate::arch::x86_64::test_vcpu(false) else {
            return;
        };
        setup_msrs(&vcpu).unwrap();
    }
}
