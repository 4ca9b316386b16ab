//! Confines the VMM to the files of its VM with Landlock, before it opens any: the
//! kernel and initrd (read), the disks (read, or read and write), the KVM device, the
//! directory of its vsock socket (to create and remove the socket) and /proc/meminfo.
//! Anything else of the host's (the user's home, its credentials) is out of reach even
//! if a guest took the VMM over. Connecting to Unix sockets (virtiofsd's, the
//! supervisor's vsock services) is not a file access Landlock restricts here.
//! Best effort: a kernel without Landlock, or with an older ABI, enforces what it can,
//! and [`Confinement`] says which.

use std::path::Path;

use landlock::{
    Access, AccessFs, BitFlags, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetStatus, ABI,
};
use vmm::config::VmConfig;

/// The newest Landlock ABI whose rights this policy was written (and tested) for.
const POLICY_ABI: ABI = ABI::V5;

/// What the kernel enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confinement {
    Full,
    /// An older Landlock: some rights (truncation, device ioctls) are not restricted.
    Partial,
    /// No Landlock in this kernel: the VMM keeps the user's access to files.
    None,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot confine the VMM to its VM's files (Landlock): {0}")]
pub struct ConfineError(#[from] landlock::RulesetError);

/// The paths the rules name, held open for the VMM's lifetime. A rule names an inode;
/// on a filesystem that makes a new inode for every lookup of a name no longer in use
/// (9p without a cache, as the nested host mounts writable disks' directories), a
/// later open of the same path would meet another inode and be refused.
pub struct HeldPaths {
    _open: Vec<PathFd>,
}

/// Restricts this thread and the threads it starts afterwards (call it before the VMM
/// starts any) to `config`'s files; keep the [`HeldPaths`] while the VMM runs.
pub fn confine(config: &VmConfig) -> Result<(Confinement, HeldPaths), ConfineError> {
    let read = AccessFs::ReadFile;
    let read_write = AccessFs::ReadFile | AccessFs::WriteFile;
    let device = read_write | AccessFs::IoctlDev;
    let mut rules: Vec<(&Path, BitFlags<AccessFs>)> = vec![
        (config.kernel.as_path(), read.into()),
        (config.kvm_device.as_path(), device),
        (Path::new(MEMINFO), read.into()),
    ];
    if let Some(initrd) = &config.initrd {
        rules.push((initrd, read.into()));
    }
    for disk in &config.disks {
        let access = if disk.read_only {
            read.into()
        } else {
            read_write
        };
        rules.push((&disk.path, access | AccessFs::IoctlDev));
    }
    if let Some(dir) = config.vsock.as_ref().and_then(|v| v.uds_path.parent()) {
        rules.push((dir, AccessFs::MakeSock | AccessFs::RemoveFile));
    }
    // A path that cannot be opened gets no rule: the VMM then fails on it with its own,
    // clearer error.
    let opened: Vec<(PathFd, BitFlags<AccessFs>)> = rules
        .into_iter()
        .filter_map(|(path, access)| Some((PathFd::new(path).ok()?, access)))
        .collect();
    let status =
        Ruleset::default()
            .handle_access(AccessFs::from_all(POLICY_ABI))?
            .create()?
            .add_rules(opened.iter().map(|(fd, access)| {
                Ok::<_, landlock::RulesetError>(PathBeneath::new(fd, *access))
            }))?
            .restrict_self()?;
    let confinement = match status.ruleset {
        RulesetStatus::FullyEnforced => Confinement::Full,
        RulesetStatus::PartiallyEnforced => Confinement::Partial,
        RulesetStatus::NotEnforced => Confinement::None,
    };
    let held = HeldPaths {
        _open: opened.into_iter().map(|(fd, _)| fd).collect(),
    };
    Ok((confinement, held))
}

/// Read by the VMM's check of the VM's memory against the host's.
const MEMINFO: &str = "/proc/meminfo";

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    /// The highest Landlock ABI this kernel offers (0: none).
    fn kernel_abi() -> i64 {
        // SAFETY: with a null attribute, size 0 and the version flag, the call only
        // returns a number.
        unsafe {
            libc::syscall(
                libc::SYS_landlock_create_ruleset,
                std::ptr::null::<u8>(),
                0usize,
                1u32,
            )
        }
        .max(0)
    }

    #[test]
    fn the_vmm_reaches_its_vms_files_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("vmlinux");
        let elsewhere = dir.path().join("credentials");
        let vsock_dir = dir.path().join("vm");
        std::fs::create_dir(&vsock_dir).unwrap();
        for file in [&kernel, &elsewhere] {
            std::fs::write(file, b"x").unwrap();
        }
        let mut config = VmConfig::new(kernel.clone());
        config.vsock = Some(vmm::config::VsockConfig {
            guest_cid: 3,
            uds_path: vsock_dir.join("vsock.sock"),
        });
        // Landlock applies to the thread that asks and to its future threads only.
        let socket = vsock_dir.join("vsock.sock");
        let (confinement, kernel_read, elsewhere_read, bound) = std::thread::spawn(move || {
            let (confinement, _held) = confine(&config).unwrap();
            let bound = std::os::unix::net::UnixListener::bind(&socket).is_ok();
            (
                confinement,
                File::open(&kernel).is_ok(),
                File::open(&elsewhere).map(|_| ()).map_err(|e| e.kind()),
                bound,
            )
        })
        .join()
        .unwrap();
        assert!(
            kernel_read && bound,
            "the VM's own files must stay reachable"
        );
        if kernel_abi() == 0 {
            eprintln!("confine: this kernel has no Landlock: only checked that the VMM says so");
            assert_eq!(confinement, Confinement::None);
            return;
        }
        assert_ne!(confinement, Confinement::None);
        assert_eq!(elsewhere_read, Err(std::io::ErrorKind::PermissionDenied));
    }
}
