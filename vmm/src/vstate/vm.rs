//! The KVM VM: capabilities, memory slots, in-kernel irqchip and PIT.

use std::path::{Path, PathBuf};

use kvm_bindings::{
    kvm_enable_cap, kvm_pit_config, kvm_userspace_memory_region, KVM_CAP_PMU_CAPABILITY,
    KVM_PIT_SPEAKER_DUMMY, KVM_PMU_CAP_DISABLE,
};
use kvm_ioctls::{Cap, Kvm, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::memory::GuestMemoryMmap;

/// Addresses in the MMIO gap that Intel VMX needs for real-mode emulation.
const KVM_TSS_ADDRESS: usize = 0xfffb_d000;
const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("{}: KVM device missing: is this a Linux host with KVM? (load kvm_intel or kvm_amd)", .0.display())]
    KvmMissing(PathBuf),
    #[error("{}: permission denied: add your user to the 'kvm' group or run as root", .0.display())]
    KvmPermission(PathBuf),
    #[error("cannot open {}: {source}", .path.display())]
    KvmOpen {
        path: PathBuf,
        source: kvm_ioctls::Error,
    },
    #[error("KVM lacks a capability the VMM needs: {0}")]
    MissingCapability(&'static str),
    #[error("cannot create the VM: {0}")]
    CreateVm(kvm_ioctls::Error),
    #[error("cannot set up the VM ({step}): {source}")]
    Setup {
        step: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("{requested} vCPUs requested, but this host's KVM allows at most {max}")]
    TooManyVcpus { requested: usize, max: usize },
}

/// Opens the KVM device, turning the common failures into actionable errors.
pub fn open_kvm(path: &Path) -> Result<Kvm, VmError> {
    Kvm::new_with_path(path_to_cstring(path)?).map_err(|source| match source.errno() {
        libc::ENOENT | libc::ENODEV | libc::ENXIO => VmError::KvmMissing(path.to_path_buf()),
        libc::EACCES | libc::EPERM => VmError::KvmPermission(path.to_path_buf()),
        _ => VmError::KvmOpen {
            path: path.to_path_buf(),
            source,
        },
    })
}

fn path_to_cstring(path: &Path) -> Result<std::ffi::CString, VmError> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| VmError::KvmMissing(path.to_path_buf()))
}

/// The most vCPUs this KVM lets one VM have.
pub fn max_vcpus(kvm: &Kvm) -> usize {
    kvm.get_max_vcpus()
}

/// Turns KVM's vPMU off for the VM (before any vCPU exists, as KVM requires): the
/// guest then finds no performance counters. CPUID hides Intel's architectural PMU
/// (leaf 0xA is zeroed), but AMD's legacy counters have no CPUID bit, and KVM serves
/// their MSRs whatever CPUID says. A guest's counters would make the host switch perf
/// state around its runs and let it count the host CPU's events. Where KVM cannot
/// (before Linux 5.18, or its vPMU off already), the VM goes on without: a debug
/// line, since the guest's counters are then as KVM offers them.
fn disable_pmu(kvm: &Kvm, vm: &VmFd) {
    let supported = kvm.check_extension_raw(u64::from(KVM_CAP_PMU_CAPABILITY));
    if supported & KVM_PMU_CAP_DISABLE as i32 == 0 {
        tracing::debug!(
            "KVM cannot turn its vPMU off for a VM (KVM_CAP_PMU_CAPABILITY: {supported})"
        );
        return;
    }
    let mut cap = kvm_enable_cap {
        cap: KVM_CAP_PMU_CAPABILITY,
        ..Default::default()
    };
    cap.args[0] = u64::from(KVM_PMU_CAP_DISABLE);
    if let Err(e) = vm.enable_cap(&cap) {
        tracing::warn!(
            "cannot turn KVM's vPMU off for the VM: {e}; the guest may count performance events"
        );
    }
}

/// A KVM VM with its guest memory registered and its interrupt controllers created.
pub struct Vm {
    fd: VmFd,
}

impl Vm {
    pub fn new(kvm: &Kvm, vcpu_count: usize) -> Result<Self, VmError> {
        for (cap, name) in [
            (Cap::Irqchip, "in-kernel irqchip (KVM_CAP_IRQCHIP)"),
            (Cap::Ioeventfd, "ioeventfd (KVM_CAP_IOEVENTFD)"),
            (Cap::Irqfd, "irqfd (KVM_CAP_IRQFD)"),
            (Cap::UserMemory, "user memory (KVM_CAP_USER_MEMORY)"),
            (Cap::Pit2, "in-kernel PIT (KVM_CAP_PIT2)"),
        ] {
            if !kvm.check_extension(cap) {
                return Err(VmError::MissingCapability(name));
            }
        }
        let max = max_vcpus(kvm);
        if vcpu_count > max {
            return Err(VmError::TooManyVcpus {
                requested: vcpu_count,
                max,
            });
        }
        let fd = kvm.create_vm().map_err(VmError::CreateVm)?;
        disable_pmu(kvm, &fd);
        let setup = |step| move |source| VmError::Setup { step, source };
        fd.set_tss_address(KVM_TSS_ADDRESS)
            .map_err(setup("TSS address"))?;
        fd.set_identity_map_address(KVM_IDENTITY_MAP_ADDRESS)
            .map_err(setup("identity map address"))?;
        fd.create_irq_chip().map_err(setup("in-kernel irqchip"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        fd.create_pit2(pit).map_err(setup("in-kernel PIT"))?;
        Ok(Self { fd })
    }

    /// Registers every region of `memory` as a KVM memory slot.
    pub fn register_memory(&self, memory: &GuestMemoryMmap) -> Result<(), VmError> {
        for (slot, region) in memory.iter().enumerate() {
            let region_desc = kvm_userspace_memory_region {
                slot: slot as u32,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
                flags: 0,
            };
            // SAFETY: the region is a live mapping owned by `memory`, which the
            // caller keeps alive for as long as the VM exists (the builder holds both
            // until every vCPU has stopped), and slots do not overlap because
            // GuestMemoryMmap's regions do not.
            unsafe { self.fd.set_user_memory_region(region_desc) }.map_err(|source| {
                VmError::Setup {
                    step: "memory slot",
                    source,
                }
            })?;
        }
        Ok(())
    }

    pub fn fd(&self) -> &VmFd {
        &self.fd
    }
}
