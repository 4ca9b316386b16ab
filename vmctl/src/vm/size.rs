//! The size of a new VM: its vCPUs and memory, from the config's `cpus`,
//! `memory_percent` and `memory_min_mib`, else the defaults (one vCPU per CPU the VM
//! may run on, a share of the host's RAM).

use vmm::process::cpus::CpuSet;

use crate::user_config::Resources;

/// Defaults for a workspace VM: this share of the host's RAM, at least this much.
pub const DEFAULT_MEMORY_PERCENT: u32 = 10;
pub const DEFAULT_MEMORY_MIN_MIB: u64 = 1024;

/// vCPUs and MiB of a new VM: the config's, else one vCPU per CPU the VM may run on
/// and 10% of the host's RAM (at least 1 GiB).
pub(super) fn vm_size(resources: Resources) -> (u32, u64) {
    let host_cpus = vm_cpu_count();
    let host_mib = vmm::config::host_memory_mib().unwrap_or(0);
    if let Some(asked) = resources.cpus.filter(|&asked| asked > host_cpus) {
        tracing::warn!("the vmctl config asks for {asked} vCPUs, but VMs may run on {host_cpus} CPUs here; the VM gets {}", host_cpus.min(MAX_VCPUS));
    } else if let Some(asked) = resources.cpus.filter(|&asked| asked > MAX_VCPUS) {
        tracing::warn!("the vmctl config asks for {asked} vCPUs, but the VMM gives a VM at most {MAX_VCPUS}; the VM gets {MAX_VCPUS}");
    }
    let minimum = resources.memory_min_mib.unwrap_or(DEFAULT_MEMORY_MIN_MIB);
    if host_mib > 0 && minimum > host_mib {
        tracing::warn!(
            "a VM of at least {minimum} MiB (memory_min_mib) does not fit this host's \
             {host_mib} MiB of RAM; the VM gets {host_mib} MiB (lower memory_min_mib in the \
             vmctl config)"
        );
    }
    size_from(resources, host_cpus, host_mib)
}

/// The most vCPUs the VMM gives a VM (all its MP table describes): a host with more
/// CPUs still gets VMs, of this many.
const MAX_VCPUS: u32 = vmm::config::MAX_VCPUS;

/// How many CPUs a VM may run on: those `VMCTL_VCPU_CPUS` names (the VMM's vCPUs, or
/// the nested host, run there only), else those this process may use. A list the VMM
/// would refuse counts as unset here: the VMM says what is wrong with it.
fn vm_cpu_count() -> u32 {
    match CpuSet::from_env() {
        // At most CPU_SETSIZE (1024) CPUs.
        Ok(Some(set)) => set.cpus().len() as u32,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
    }
}

fn size_from(resources: Resources, host_cpus: u32, host_mib: u64) -> (u32, u64) {
    let cpus = resources
        .cpus
        .unwrap_or(host_cpus)
        .clamp(1, host_cpus.clamp(1, MAX_VCPUS));
    let percent = u64::from(
        resources
            .memory_percent
            .unwrap_or(DEFAULT_MEMORY_PERCENT)
            .min(100),
    );
    let minimum = resources.memory_min_mib.unwrap_or(DEFAULT_MEMORY_MIN_MIB);
    let memory_mib = (host_mib * percent / 100).max(minimum);
    // More than the host has, the VMM refuses (0: the host's size is unknown).
    let fits = if host_mib > 0 { host_mib } else { memory_mib };
    (cpus, memory_mib.min(fits))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_size_is_a_share_of_the_host_with_a_floor() {
        let unset = Resources::default();
        assert_eq!(size_from(unset, 8, 32 * 1024), (8, 3276));
        // A floor above the host's RAM (a config shared with a bigger machine, or the
        // default 1 GiB on a 1 GiB host): all of it, not a VM the VMM refuses.
        let floor = Resources {
            memory_min_mib: Some(16 * 1024),
            ..unset
        };
        assert_eq!(size_from(floor, 4, 7900), (4, 7900));
        assert_eq!(size_from(unset, 1, 970), (1, 970));
        // A host of more CPUs than the VMM gives a VM (a large server).
        assert_eq!(size_from(unset, 64, 32 * 1024).0, 64);
        assert_eq!(size_from(unset, 512, 32 * 1024).0, MAX_VCPUS);
        assert_eq!(size_from(unset, 2, 4 * 1024), (2, 1024));
        let set = Resources {
            cpus: Some(16),
            memory_percent: Some(50),
            memory_min_mib: Some(512),
            free_page_reporting: Some(false),
            drop_caches_after_idle_s: None,
        };
        assert_eq!(size_from(set, 4, 2 * 1024), (4, 1024));
    }
}
