//! The CPUID each vCPU sees: KVM's supported CPUID, adjusted so the guest gets a
//! consistent topology (one package, `count` cores, one thread per core, APIC ID =
//! vCPU index), knows it runs under a hypervisor, and is not offered features this
//! VMM does not back (nested virtualisation, Intel's architectural vPMU, power
//! management; AMD's legacy PMU counters, which no CPUID bit hides, go with KVM's
//! vPMU, turned off for the whole VM in `vstate::vm`) or that would make a running
//! guest look powered off (KVM's PV_UNHALT).

use kvm_bindings::{CpuId, KVM_CPUID_FLAG_SIGNIFCANT_INDEX, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Cap, Kvm, VcpuFd};

// Leaf 1.
/// EBX[15:8]: CLFLUSH line size in 8-byte units.
const LEAF1_EBX_CLFLUSH_SHIFT: u32 = 8;
/// 64-byte cache lines.
const CLFLUSH_LINE_SIZE_QWORDS: u32 = 8;
/// EBX[23:16]: addressable logical processor IDs in the package.
const LEAF1_EBX_CPU_COUNT_SHIFT: u32 = 16;
/// EBX[31:24]: initial APIC ID.
const LEAF1_EBX_APIC_ID_SHIFT: u32 = 24;
/// ECX bit 5: VMX.
pub const LEAF1_ECX_VMX: u32 = 1 << 5;
/// ECX bit 24: TSC-deadline timer. KVM's in-kernel LAPIC backs it, but kernels before
/// 6.14 leave it out of their supported CPUID (it depends on the irqchip) and report it
/// as `KVM_CAP_TSC_DEADLINE_TIMER`: [`setup_cpuid`] adds it then. A guest without it
/// calibrates the LAPIC timer against the PIT at boot instead.
pub const LEAF1_ECX_TSC_DEADLINE: u32 = 1 << 24;
/// ECX bit 31: running under a hypervisor.
pub const LEAF1_ECX_HYPERVISOR: u32 = 1 << 31;
/// EDX bit 28: HTT (`EBX[23:16]` is valid / more than one logical processor).
pub const LEAF1_EDX_HTT: u32 = 1 << 28;

// Leaf 4 (and AMD 0x8000_001d, which has the same layout for these fields).
/// EAX[4:0]: cache type, 0 = no more caches.
const CACHE_TYPE_MASK: u32 = 0x1f;
/// EAX[7:5]: cache level.
const CACHE_LEVEL_SHIFT: u32 = 5;
/// EAX[25:14]: logical processors sharing this cache, minus one.
const CACHE_SHARING_SHIFT: u32 = 14;
const CACHE_SHARING_MASK: u32 = 0xfff;
/// EAX[31:26]: cores in the package, minus one.
const LEAF4_CORES_SHIFT: u32 = 26;
const LEAF4_CORES_MASK: u32 = 0x3f;

// Leaf 6.
/// EAX bit 2: APIC timer always running (ARAT); the only thing KVM backs here.
pub const LEAF6_EAX_ARAT: u32 = 1 << 2;
/// ECX bit 0: APERF/MPERF MSRs.
pub const LEAF6_ECX_APERFMPERF: u32 = 1 << 0;
/// ECX bit 3: energy/performance bias MSR.
pub const LEAF6_ECX_EPB: u32 = 1 << 3;

// Leaves 0xb / 0x1f.
/// ECX[15:8] level types.
const TOPO_LEVEL_INVALID: u32 = 0;
const TOPO_LEVEL_SMT: u32 = 1;
const TOPO_LEVEL_CORE: u32 = 2;

// Leaf 0x4000_0001: KVM's paravirtual features.
/// EAX bit 7: KVM_FEATURE_PV_UNHALT. With it, a guest kernel built with paravirtual
/// spinlocks waits for a contended lock by halting with interrupts off until another
/// vCPU kicks it: on the boot vCPU, what this VMM takes for a power-off (see
/// `Vcpu::is_powered_off`). Without it, the kernel spins as on bare metal.
pub const KVM_FEATURE_PV_UNHALT: u32 = 1 << 7;

// Leaf 0x8000_0001.
/// ECX bit 2: SVM.
pub const LEAF_8000_0001_ECX_SVM: u32 = 1 << 2;

// Leaf 0x8000_0008 (AMD): ECX[7:0] cores - 1, ECX[15:12] APIC ID core bits.
const LEAF_8000_0008_ECX_NC_MASK: u32 = 0xff;
const LEAF_8000_0008_ECX_APIC_ID_SIZE_SHIFT: u32 = 12;
const LEAF_8000_0008_ECX_APIC_ID_SIZE_MASK: u32 = 0xf;

#[derive(Debug, thiserror::Error)]
pub enum CpuidError {
    #[error("cannot get KVM's supported CPUID (up to {max} entries): {source}")]
    GetSupported {
        max: usize,
        source: kvm_ioctls::Error,
    },
    #[error("cannot set the CPUID of vCPU {index} ({entries} entries): {source}")]
    SetCpuid {
        index: u8,
        entries: usize,
        source: kvm_ioctls::Error,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Vendor {
    Intel,
    Amd,
    Other,
}

fn vendor_of(cpuid: &CpuId) -> Vendor {
    let Some(leaf0) = cpuid.as_slice().iter().find(|e| e.function == 0) else {
        return Vendor::Other;
    };
    let mut id = [0u8; 12];
    id[0..4].copy_from_slice(&leaf0.ebx.to_le_bytes());
    id[4..8].copy_from_slice(&leaf0.edx.to_le_bytes());
    id[8..12].copy_from_slice(&leaf0.ecx.to_le_bytes());
    match &id {
        b"GenuineIntel" => Vendor::Intel,
        b"AuthenticAMD" | b"HygonGenuine" => Vendor::Amd,
        _ => Vendor::Other,
    }
}

/// Bits needed to number `count` cores: the APIC-ID shift of the package level.
fn core_id_bits(count: u8) -> u32 {
    if count <= 1 {
        0
    } else {
        u8::BITS - (count - 1).leading_zeros()
    }
}

/// The topology this VMM presents.
#[derive(Clone, Copy, Debug)]
struct Topology {
    apic_id: u32,
    /// Cores in the (single) package; one thread per core.
    cores: u32,
    core_bits: u32,
}

fn set_field(reg: u32, shift: u32, mask: u32, value: u32) -> u32 {
    (reg & !(mask << shift)) | ((value.min(mask)) << shift)
}

/// Threads sharing a cache of `level`, minus one: L1/L2 are per core, the rest per
/// package.
fn cache_sharing(level: u32, topo: Topology) -> u32 {
    if level <= 2 {
        0
    } else {
        topo.cores - 1
    }
}

fn filter_cache_leaf(eax: u32, topo: Topology, set_cores: bool) -> u32 {
    if eax & CACHE_TYPE_MASK == 0 {
        return eax;
    }
    let level = (eax >> CACHE_LEVEL_SHIFT) & 0x7;
    let mut eax = set_field(
        eax,
        CACHE_SHARING_SHIFT,
        CACHE_SHARING_MASK,
        cache_sharing(level, topo),
    );
    if set_cores {
        eax = set_field(eax, LEAF4_CORES_SHIFT, LEAF4_CORES_MASK, topo.cores - 1);
    }
    eax
}

/// The leaf 0xb / 0x1f registers (eax, ebx, ecx, edx) for sub-leaf `index`.
fn topology_subleaf(index: u32, topo: Topology) -> (u32, u32, u32, u32) {
    match index {
        // SMT level: one thread per core, so no APIC-ID bits for it.
        0 => (0, 1, (TOPO_LEVEL_SMT << 8), topo.apic_id),
        // Core level: all cores of the package.
        1 => (
            topo.core_bits,
            topo.cores,
            (TOPO_LEVEL_CORE << 8) | 1,
            topo.apic_id,
        ),
        n => (0, 0, (TOPO_LEVEL_INVALID << 8) | (n & 0xff), topo.apic_id),
    }
}

/// Makes sure leaf 0xb has sub-leaves 0 (SMT), 1 (core) and 2 (terminator) when KVM
/// reports the leaf at all.
fn add_missing_topology_subleaves(cpuid: &mut CpuId) {
    let Some(template) = cpuid.as_slice().iter().find(|e| e.function == 0xb).copied() else {
        return;
    };
    for index in 0..3 {
        let present = cpuid
            .as_slice()
            .iter()
            .any(|e| e.function == 0xb && e.index == index);
        if present {
            continue;
        }
        let entry = kvm_bindings::kvm_cpuid_entry2 {
            function: 0xb,
            index,
            flags: template.flags | KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
            ..Default::default()
        };
        if cpuid.push(entry).is_err() {
            tracing::warn!(
                "CPUID table full: cannot add leaf 0xb sub-leaf {index}; the guest topology may be incomplete"
            );
        }
    }
}

/// Adjusts KVM's supported CPUID for vCPU `vcpu_index` of `vcpu_count`.
///
/// Leaves that are not mentioned are left as KVM reports them (e.g. the KVM
/// paravirtual leaves 0x4000_00xx but for PV_UNHALT).
pub fn filter_cpuid(cpuid: &mut CpuId, vcpu_index: u8, vcpu_count: u8) {
    let count = vcpu_count.max(1);
    let topo = Topology {
        apic_id: u32::from(vcpu_index),
        cores: u32::from(count),
        core_bits: core_id_bits(count),
    };
    let vendor = vendor_of(cpuid);
    add_missing_topology_subleaves(cpuid);

    for entry in cpuid.as_mut_slice() {
        match entry.function {
            0x1 => {
                entry.ebx = set_field(
                    entry.ebx,
                    LEAF1_EBX_CLFLUSH_SHIFT,
                    0xff,
                    CLFLUSH_LINE_SIZE_QWORDS,
                );
                entry.ebx = set_field(entry.ebx, LEAF1_EBX_CPU_COUNT_SHIFT, 0xff, topo.cores);
                entry.ebx = set_field(entry.ebx, LEAF1_EBX_APIC_ID_SHIFT, 0xff, topo.apic_id);
                entry.ecx |= LEAF1_ECX_HYPERVISOR;
                entry.ecx &= !LEAF1_ECX_VMX;
                if count > 1 {
                    entry.edx |= LEAF1_EDX_HTT;
                } else {
                    entry.edx &= !LEAF1_EDX_HTT;
                }
            }
            0x4 => entry.eax = filter_cache_leaf(entry.eax, topo, true),
            0x6 => {
                entry.eax &= LEAF6_EAX_ARAT;
                entry.ebx = 0;
                entry.ecx &= !(LEAF6_ECX_APERFMPERF | LEAF6_ECX_EPB);
                entry.edx = 0;
            }
            0xa => {
                entry.eax = 0;
                entry.ebx = 0;
                entry.ecx = 0;
                entry.edx = 0;
            }
            0xb | 0x1f => {
                let (eax, ebx, ecx, edx) = topology_subleaf(entry.index, topo);
                entry.eax = eax;
                entry.ebx = ebx;
                entry.ecx = ecx;
                entry.edx = edx;
            }
            0x4000_0001 => entry.eax &= !KVM_FEATURE_PV_UNHALT,
            0x8000_0001 => entry.ecx &= !LEAF_8000_0001_ECX_SVM,
            0x8000_0008 if vendor == Vendor::Amd => {
                entry.ecx = set_field(entry.ecx, 0, LEAF_8000_0008_ECX_NC_MASK, topo.cores - 1);
                entry.ecx = set_field(
                    entry.ecx,
                    LEAF_8000_0008_ECX_APIC_ID_SIZE_SHIFT,
                    LEAF_8000_0008_ECX_APIC_ID_SIZE_MASK,
                    topo.core_bits,
                );
            }
            0x8000_001d if vendor == Vendor::Amd => {
                entry.eax = filter_cache_leaf(entry.eax, topo, false);
            }
            0x8000_001e if vendor == Vendor::Amd => {
                // Extended APIC ID; core ID with one thread per core; node 0 of 1.
                entry.eax = topo.apic_id;
                entry.ebx = topo.apic_id & 0xff;
                entry.ecx = 0;
                entry.edx = 0;
            }
            _ => {}
        }
    }
}

/// Offers the TSC-deadline timer in leaf 1 (see [`LEAF1_ECX_TSC_DEADLINE`]).
pub fn offer_tsc_deadline_timer(cpuid: &mut CpuId) {
    for entry in cpuid.as_mut_slice() {
        if entry.function == 0x1 {
            entry.ecx |= LEAF1_ECX_TSC_DEADLINE;
        }
    }
}

/// Gets KVM's supported CPUID, filters it for vCPU `index` of `count`, adds what KVM
/// backs but does not list there, and sets it on `vcpu`. The VM's in-kernel irqchip
/// must exist.
pub fn setup_cpuid(kvm: &Kvm, vcpu: &VcpuFd, index: u8, count: u8) -> Result<(), CpuidError> {
    let mut cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|source| CpuidError::GetSupported {
            max: KVM_MAX_CPUID_ENTRIES,
            source,
        })?;
    filter_cpuid(&mut cpuid, index, count);
    if kvm.check_extension(Cap::TscDeadlineTimer) {
        offer_tsc_deadline_timer(&mut cpuid);
    }
    vcpu.set_cpuid2(&cpuid)
        .map_err(|source| CpuidError::SetCpuid {
            index,
            entries: cpuid.as_slice().len(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn entry(function: u32, index: u32, regs: [u32; 4]) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            flags: if matches!(function, 0x4 | 0xb | 0x1f | 0x8000_001d) {
                KVM_CPUID_FLAG_SIGNIFCANT_INDEX
            } else {
                0
            },
            eax: regs[0],
            ebx: regs[1],
            ecx: regs[2],
            edx: regs[3],
            ..Default::default()
        }
    }

    fn vendor_regs(id: &[u8; 12], max_leaf: u32) -> [u32; 4] {
        let word = |i: usize| u32::from_le_bytes([id[i], id[i + 1], id[i + 2], id[i + 3]]);
        [max_leaf, word(0), word(8), word(4)]
    }

    /// Roughly what KVM reports on an 8-thread Intel host.
    fn intel_cpuid() -> CpuId {
        CpuId::from_entries(&[
            entry(0x0, 0, vendor_regs(b"GenuineIntel", 0x1f)),
            // Host APIC ID 7, 16 logical CPUs, CLFLUSH 0, VMX + TSC-deadline on, no HTT.
            entry(
                0x1,
                0,
                [
                    0x000906ea,
                    0x0710_0000,
                    LEAF1_ECX_VMX | LEAF1_ECX_TSC_DEADLINE | 1,
                    0x0783_fbff & !LEAF1_EDX_HTT,
                ],
            ),
            // L1d, L1i, L2 (shared by 2 threads), L3 (shared by 16), terminator.
            entry(0x4, 0, [0x1c00_4121, 0x01c0_003f, 0x3f, 0]),
            entry(0x4, 1, [0x1c00_4122, 0x01c0_003f, 0x3f, 0]),
            entry(0x4, 2, [0x1c00_4143, 0x00c0_003f, 0x3ff, 0]),
            entry(0x4, 3, [0x1c03_c163, 0x03c0_003f, 0x2fff, 6]),
            entry(0x4, 4, [0, 0, 0, 0]),
            entry(0x6, 0, [0x77 | LEAF6_EAX_ARAT, 2, 0x9, 0]),
            entry(0xa, 0, [0x0760_4104, 0, 0, 0x603]),
            entry(0xb, 0, [1, 2, 0x100, 7]),
            entry(0xb, 1, [4, 16, 0x201, 7]),
            entry(0x4000_0001, 0, [0x0100_7afb, 0, 0, 0]),
            entry(
                0x8000_0001,
                0,
                [0, 0, 0x121 | LEAF_8000_0001_ECX_SVM, 0x2c10_0800],
            ),
            entry(0x8000_0008, 0, [0x3027, 0, 0, 0]),
        ])
        .unwrap()
    }

    fn find(cpuid: &CpuId, function: u32, index: u32) -> kvm_cpuid_entry2 {
        *cpuid
            .as_slice()
            .iter()
            .find(|e| e.function == function && e.index == index)
            .unwrap_or_else(|| panic!("leaf {function:#x}.{index} missing"))
    }

    /// Changes leaf 1 as KVM might have reported it.
    fn edit_leaf1(cpuid: &mut CpuId, edit: impl Fn(&mut kvm_cpuid_entry2)) {
        cpuid
            .as_mut_slice()
            .iter_mut()
            .filter(|e| e.function == 1)
            .for_each(edit);
    }

    fn filtered(index: u8, count: u8) -> CpuId {
        let mut cpuid = intel_cpuid();
        filter_cpuid(&mut cpuid, index, count);
        cpuid
    }

    #[test]
    fn core_bits() {
        assert_eq!(core_id_bits(0), 0);
        assert_eq!(core_id_bits(1), 0);
        assert_eq!(core_id_bits(2), 1);
        assert_eq!(core_id_bits(3), 2);
        assert_eq!(core_id_bits(4), 2);
        assert_eq!(core_id_bits(5), 3);
        assert_eq!(core_id_bits(128), 7);
        assert_eq!(core_id_bits(129), 8);
        assert_eq!(core_id_bits(255), 8);
    }

    #[test]
    fn vendor_detection() {
        assert_eq!(vendor_of(&intel_cpuid()), Vendor::Intel);
        let amd = CpuId::from_entries(&[entry(0, 0, vendor_regs(b"AuthenticAMD", 0x10))]).unwrap();
        assert_eq!(vendor_of(&amd), Vendor::Amd);
        let hygon =
            CpuId::from_entries(&[entry(0, 0, vendor_regs(b"HygonGenuine", 0x10))]).unwrap();
        assert_eq!(vendor_of(&hygon), Vendor::Amd);
        let none = CpuId::from_entries(&[]).unwrap();
        assert_eq!(vendor_of(&none), Vendor::Other);
    }

    #[test]
    fn leaf1_topology_and_features() {
        let cpuid = filtered(2, 4);
        let leaf1 = find(&cpuid, 1, 0);
        assert_eq!(leaf1.ebx >> 24, 2, "initial APIC ID");
        assert_eq!((leaf1.ebx >> 16) & 0xff, 4, "logical processor count");
        assert_eq!((leaf1.ebx >> 8) & 0xff, 8, "CLFLUSH line size");
        assert_ne!(leaf1.ecx & LEAF1_ECX_HYPERVISOR, 0);
        assert_eq!(leaf1.ecx & LEAF1_ECX_VMX, 0);
        assert_ne!(leaf1.ecx & LEAF1_ECX_TSC_DEADLINE, 0, "TSC deadline stays");
        assert_ne!(leaf1.ecx & 1, 0, "other features untouched");
        assert_ne!(leaf1.edx & LEAF1_EDX_HTT, 0);
        assert_eq!(leaf1.eax, 0x000906ea);
    }

    /// What KVM before 6.14 reports: leaf 1 without the TSC-deadline timer.
    #[test]
    fn the_tsc_deadline_timer_is_offered_where_kvm_leaves_it_out() {
        let mut cpuid = intel_cpuid();
        edit_leaf1(&mut cpuid, |leaf1| leaf1.ecx &= !LEAF1_ECX_TSC_DEADLINE);
        filter_cpuid(&mut cpuid, 0, 2);
        let before = find(&cpuid, 1, 0);
        assert_eq!(before.ecx & LEAF1_ECX_TSC_DEADLINE, 0);
        offer_tsc_deadline_timer(&mut cpuid);
        let after = find(&cpuid, 1, 0);
        assert_eq!(after.ecx, before.ecx | LEAF1_ECX_TSC_DEADLINE);
        assert_eq!(
            (after.eax, after.ebx, after.edx),
            (before.eax, before.ebx, before.edx)
        );
    }

    #[test]
    fn leaf1_single_cpu_has_no_htt() {
        let mut cpuid = intel_cpuid();
        edit_leaf1(&mut cpuid, |leaf1| leaf1.edx |= LEAF1_EDX_HTT);
        filter_cpuid(&mut cpuid, 0, 1);
        let leaf1 = find(&cpuid, 1, 0);
        assert_eq!(leaf1.edx & LEAF1_EDX_HTT, 0);
        assert_eq!(leaf1.ebx >> 24, 0);
        assert_eq!((leaf1.ebx >> 16) & 0xff, 1);
    }

    #[test]
    fn zero_count_is_treated_as_one() {
        let cpuid = filtered(0, 0);
        assert_eq!((find(&cpuid, 1, 0).ebx >> 16) & 0xff, 1);
        assert_eq!(find(&cpuid, 0xb, 1).ebx, 1);
    }

    #[test]
    fn leaf4_cores_and_cache_sharing() {
        let cpuid = filtered(1, 6);
        for (sub, level) in [(0, 1), (1, 1), (2, 2), (3, 3)] {
            let eax = find(&cpuid, 4, sub).eax;
            assert_eq!((eax >> 5) & 7, level);
            assert_eq!(eax >> 26, 5, "cores per package - 1 in sub-leaf {sub}");
            let sharing = (eax >> 14) & 0xfff;
            let expected = if level <= 2 { 0 } else { 5 };
            assert_eq!(sharing, expected, "sharing of sub-leaf {sub}");
            // Cache type/level and the other low bits are kept.
            assert_eq!(eax & 0x3fff, find(&intel_cpuid(), 4, sub).eax & 0x3fff);
        }
        // The terminator stays empty.
        assert_eq!(find(&cpuid, 4, 4).eax, 0);
        // Other registers untouched.
        assert_eq!(find(&cpuid, 4, 3).ebx, 0x03c0_003f);
    }

    #[test]
    fn leaf4_cores_field_saturates() {
        let cpuid = filtered(0, 200);
        assert_eq!(find(&cpuid, 4, 0).eax >> 26, 63);
        assert_eq!((find(&cpuid, 4, 3).eax >> 14) & 0xfff, 199);
    }

    #[test]
    fn leaf6_power_management_cleared() {
        let leaf6 = find(&filtered(0, 2), 6, 0);
        assert_eq!(leaf6.eax, LEAF6_EAX_ARAT);
        assert_eq!(leaf6.ecx & LEAF6_ECX_EPB, 0);
        assert_eq!(leaf6.ecx & LEAF6_ECX_APERFMPERF, 0);
        assert_eq!(leaf6.ebx, 0);
    }

    /// A guest with PV_UNHALT halts with interrupts off while it waits for a lock,
    /// which looks like a power-off; KVM's other paravirtual features stay.
    #[test]
    fn pv_unhalt_is_not_offered() {
        let kvm_features = find(&filtered(0, 2), 0x4000_0001, 0).eax;
        assert_eq!(kvm_features & KVM_FEATURE_PV_UNHALT, 0);
        assert_eq!(kvm_features, 0x0100_7afb & !KVM_FEATURE_PV_UNHALT);
    }

    #[test]
    fn pmu_leaf_zeroed() {
        let leaf = find(&filtered(0, 2), 0xa, 0);
        assert_eq!((leaf.eax, leaf.ebx, leaf.ecx, leaf.edx), (0, 0, 0, 0));
    }

    #[test]
    fn extended_topology() {
        let cpuid = filtered(5, 6);
        let smt = find(&cpuid, 0xb, 0);
        assert_eq!(smt.eax & 0x1f, 0);
        assert_eq!(smt.ebx & 0xffff, 1);
        assert_eq!((smt.ecx >> 8) & 0xff, 1);
        assert_eq!(smt.ecx & 0xff, 0);
        assert_eq!(smt.edx, 5);

        let core = find(&cpuid, 0xb, 1);
        assert_eq!(core.eax & 0x1f, 3, "6 cores need 3 APIC-ID bits");
        assert_eq!(core.ebx & 0xffff, 6);
        assert_eq!((core.ecx >> 8) & 0xff, 2);
        assert_eq!(core.ecx & 0xff, 1);
        assert_eq!(core.edx, 5);

        // The terminating sub-leaf was added.
        let end = find(&cpuid, 0xb, 2);
        assert_eq!((end.ecx >> 8) & 0xff, 0);
        assert_eq!(end.ecx & 0xff, 2);
        assert_eq!(end.ebx, 0);
        assert_eq!(end.edx, 5);
        assert_ne!(end.flags & KVM_CPUID_FLAG_SIGNIFCANT_INDEX, 0);
        assert_eq!(
            cpuid
                .as_slice()
                .iter()
                .filter(|e| e.function == 0xb)
                .count(),
            3
        );
    }

    #[test]
    fn missing_topology_leaf_is_not_invented() {
        let mut cpuid = CpuId::from_entries(&[entry(0x1, 0, [0; 4])]).unwrap();
        filter_cpuid(&mut cpuid, 0, 2);
        assert_eq!(cpuid.as_slice().len(), 1);
    }

    #[test]
    fn svm_cleared() {
        let cpuid = filtered(0, 2);
        let ext = find(&cpuid, 0x8000_0001, 0);
        assert_eq!(ext.ecx & LEAF_8000_0001_ECX_SVM, 0);
        assert_eq!(ext.ecx, 0x121);
        // Intel: 0x8000_0008 ECX is reserved and left alone.
        assert_eq!(find(&cpuid, 0x8000_0008, 0).ecx, 0);
    }

    #[test]
    fn amd_topology_leaves() {
        let mut cpuid = CpuId::from_entries(&[
            entry(0x0, 0, vendor_regs(b"AuthenticAMD", 0x10)),
            entry(0x1, 0, [0x00a20f10, 0x0310_0800, 0, 0]),
            entry(0x8000_0001, 0, [0, 0, 0x75c2_37ff, 0]),
            entry(0x8000_0008, 0, [0x3030, 0, 0x0003_700f, 0]),
            entry(0x8000_001d, 0, [0x0000_4121, 0x01c0_003f, 0x3f, 0]),
            entry(0x8000_001d, 1, [0x0000_4143, 0x01c0_003f, 0x3ff, 2]),
            entry(0x8000_001d, 2, [0x0003_c163, 0x03c0_003f, 0x7fff, 1]),
            entry(0x8000_001d, 3, [0, 0, 0, 0]),
            entry(0x8000_001e, 0, [0x13, 0x0109, 0x0300, 0]),
        ])
        .unwrap();
        filter_cpuid(&mut cpuid, 3, 4);

        assert_eq!(find(&cpuid, 0x8000_0001, 0).ecx & LEAF_8000_0001_ECX_SVM, 0);
        let sizes = find(&cpuid, 0x8000_0008, 0);
        assert_eq!(sizes.ecx & 0xff, 3, "cores - 1");
        assert_eq!((sizes.ecx >> 12) & 0xf, 2, "APIC ID core bits");
        assert_eq!(sizes.ecx >> 16, 0x3, "PerfTscSize kept");
        assert_eq!(sizes.eax, 0x3030);

        assert_eq!((find(&cpuid, 0x8000_001d, 0).eax >> 14) & 0xfff, 0);
        assert_eq!((find(&cpuid, 0x8000_001d, 1).eax >> 14) & 0xfff, 0);
        assert_eq!((find(&cpuid, 0x8000_001d, 2).eax >> 14) & 0xfff, 3);
        // No cores field in the AMD leaf.
        assert_eq!(find(&cpuid, 0x8000_001d, 2).eax >> 26, 0);
        assert_eq!(find(&cpuid, 0x8000_001d, 3).eax, 0);

        let ext_apic = find(&cpuid, 0x8000_001e, 0);
        assert_eq!(ext_apic.eax, 3);
        assert_eq!(ext_apic.ebx, 3, "core 3, one thread per core");
        assert_eq!(ext_apic.ecx, 0, "node 0 of 1");
    }

    #[test]
    fn every_vcpu_gets_its_own_apic_id() {
        for index in 0..4 {
            let cpuid = filtered(index, 4);
            assert_eq!(find(&cpuid, 1, 0).ebx >> 24, u32::from(index));
            assert_eq!(find(&cpuid, 0xb, 0).edx, u32::from(index));
            assert_eq!(find(&cpuid, 0xb, 1).edx, u32::from(index));
        }
    }

    /// Runs the ioctls on a real vCPU when /dev/kvm is usable; skips otherwise.
    #[test]
    fn setup_cpuid_with_kvm_if_available() {
        let Some((kvm, _vm, vcpu)) = crate::arch::x86_64::test_vcpu(true) else {
            return;
        };
        setup_cpuid(&kvm, &vcpu, 0, 2).unwrap();
        let got = vcpu.get_cpuid2(KVM_MAX_CPUID_ENTRIES).unwrap();
        let leaf1 = find(&got, 1, 0);
        assert_ne!(leaf1.ecx & LEAF1_ECX_HYPERVISOR, 0);
        assert_eq!(leaf1.ecx & LEAF1_ECX_VMX, 0);
        assert_eq!(
            leaf1.ecx & LEAF1_ECX_TSC_DEADLINE != 0,
            kvm.check_extension(Cap::TscDeadlineTimer)
        );
    }
}
