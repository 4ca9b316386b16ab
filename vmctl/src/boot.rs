//! `vmctl boot`: boot a kernel with the serial console on stdout. Where KVM boots
//! Linux, vmctl becomes the VMM process (`vmctl-vmm`); elsewhere it runs the VM in the
//! nested host.

use std::path::{Path, PathBuf};

use vmm::config::{host_memory_mib, ConfigError, DiskConfig, FsConfig, VmConfig};
use vmm::process::Event;
use vmm::vstate::vm::VmError;

use crate::artifacts::{self, Artifact, ArtifactError};
use crate::cli::{BootArgs, NestedMode};
use crate::host_kvm::KvmKind;
use crate::nested::{self, NestedError};
use crate::shares::ShareSet;
use crate::virtiofsd::{self, VirtiofsdError};
use crate::vmm_process::{self, VmmProcessError};

#[derive(Debug, thiserror::Error)]
pub enum BootCommandError {
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Kvm(#[from] VmError),
    #[error(transparent)]
    Nested(#[from] NestedError),
    #[error(transparent)]
    Vmm(#[from] VmmProcessError),
    #[error(transparent)]
    Virtiofsd(#[from] VirtiofsdError),
    #[error("--fs {0:?}: expected TAG:SOCKET (the tag the guest mounts, the backend's socket)")]
    BadFs(String),
    #[error(
        "--fs needs the VMM to run here, and this machine's KVM cannot boot Linux, so the VM \
         would run inside the nested host, where {0} is not reachable; run the backend and \
         `vmctl boot --nested never` inside a host with a working KVM"
    )]
    FsInNestedHost(PathBuf),
}

/// Environment variable that replaces /dev/kvm (tests use it to simulate its absence).
const KVM_DEVICE_ENV: &str = "VMCTL_KVM_DEVICE";

pub fn run(args: BootArgs) -> Result<u8, BootCommandError> {
    let config = resolve_config(&args)?;
    config.validate(host_memory_mib())?;

    let kvm = KvmKind::detect();
    let use_nested = match args.nested {
        NestedMode::Auto => !kvm.boots_linux(),
        NestedMode::Always => true,
        NestedMode::Never => false,
    };
    if use_nested {
        if let Some(fs) = config.filesystems.first() {
            return Err(BootCommandError::FsInNestedHost(fs.socket_path.clone()));
        }
        kvm.announce_nested();
        return Ok(nested::launcher::run_vm(
            &config,
            None,
            args.boot_time,
            None,
            None,
        )?);
    }
    // Here, so that a missing or forbidden /dev/kvm is a `vmctl: error:` like every
    // other problem with the input; the VMM opens it again.
    vmm::vstate::vm::open_kvm(&config.kvm_device)?;
    Err(vmm_process::exec(&config, args.boot_time).into())
}

/// Fills in the defaults: the project's kernel and hello initramfs.
fn resolve_config(args: &BootArgs) -> Result<VmConfig, BootCommandError> {
    let (kernel, initrd) = match &args.kernel {
        Some(kernel) => (kernel.clone(), args.initrd.clone()),
        None => {
            let kernel = artifacts::ensure(Artifact::GuestKernel)?;
            let initrd = match &args.initrd {
                Some(initrd) => initrd.clone(),
                None => artifacts::ensure(Artifact::HelloInitramfs)?,
            };
            (kernel, Some(initrd))
        }
    };
    let mut config = VmConfig::new(kernel);
    config.initrd = initrd;
    config.disks = args.disks.iter().map(|d| DiskConfig::parse(d)).collect();
    config.filesystems = args
        .filesystems
        .iter()
        .map(|fs| parse_fs(fs))
        .collect::<Result<_, _>>()?;
    config.extra_cmdline = args.cmdline.clone();
    config.vcpus = args.cpus;
    config.memory_mib = args.memory;
    if let Some(device) = std::env::var_os(KVM_DEVICE_ENV) {
        config.kvm_device = PathBuf::from(device);
    }
    Ok(config)
}

/// `TAG:SOCKET`: the tag is what precedes the first ':'.
fn parse_fs(value: &str) -> Result<FsConfig, BootCommandError> {
    match value.split_once(':') {
        Some((tag, socket)) if !tag.is_empty() && !socket.is_empty() => Ok(FsConfig {
            tag: tag.to_string(),
            socket_path: socket.into(),
        }),
        _ => Err(BootCommandError::BadFs(value.to_string())),
    }
}

/// Runs the VMM in a child process with one virtiofsd per share, started here (so
/// inside the nested host when there is one), their sockets in `socket_dir`, their
/// logs in `log_dir`.
pub fn run_vmm_sharing(
    config: &VmConfig,
    shares: Option<&ShareSet>,
    socket_dir: &Path,
    log_dir: &Path,
    report_boot_time: bool,
) -> Result<u8, BootCommandError> {
    let Some(set) = shares.filter(|set| !set.shares.is_empty()) else {
        // The daemons of `--fs` are the user's: only they can end one.
        return Ok(vmm_process::run(
            config,
            report_boot_time,
            |event| match event {
                Event::FsBackendGivenUp { tag, reason } => vmm::to_stderr!(
                    "vmctl: warning: the VMM gave up on the virtio-fs backend of {tag:?} \
                     ({reason}); end that virtiofsd, and the guest's requests to the share \
                     then fail with EIO instead of waiting"
                ),
            },
        )?);
    };
    let (daemons, filesystems) =
        virtiofsd::start(&set.virtiofsd, &set.shares, socket_dir, log_dir, set.cache)?;
    if let Some(file) = &set.failure_file {
        daemons.record_failures_in(file.clone());
    }
    let mut config = config.clone();
    config.filesystems = filesystems;
    let outcome = vmm_process::run(&config, report_boot_time, |event| match event {
        Event::FsBackendGivenUp { tag, reason } => daemons.give_up(&tag, &reason),
    });
    daemons.stop();
    Ok(outcome?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fs_devices_are_a_tag_then_a_socket() {
        let fs = parse_fs("ws:/run/fs:0.sock").unwrap();
        assert_eq!(
            (fs.tag.as_str(), fs.socket_path.as_path()),
            ("ws", Path::new("/run/fs:0.sock"))
        );
        for bad in ["ws", "ws:", ":/s.sock", ""] {
            let error = parse_fs(bad).unwrap_err().to_string();
            assert!(
                error.contains(&format!("{bad:?}")) && error.contains("TAG:SOCKET"),
                "{error}"
            );
        }
    }
}
