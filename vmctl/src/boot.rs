//! `vmctl boot`: boot a kernel with the serial console on stdout. Where KVM boots
//! Linux, vmctl becomes the VMM process (`vmctl-vmm`); elsewhere it runs the VM in the
//! nested host.

use std::path::PathBuf;

use vmm::config::{host_memory_mib, ConfigError, DiskConfig, FsConfig, VmConfig};
use vmm::vstate::vm::VmError;

use crate::artifacts::{self, Artifact, ArtifactError};
use crate::cli::{BootArgs, NestedMode};
use crate::host_kvm::KvmKind;
use crate::nested::{self, NestedError};
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
    config.validate(host_memory_mib().unwrap_or(u64::MAX))?;

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
    config.free_page_reporting = !args.no_free_page_reporting;
    config.virtio_console = !args.no_virtio_console;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fs_devices_are_a_tag_then_a_socket() {
        let fs = parse_fs("ws:/run/fs:0.sock").unwrap();
        assert_eq!(
            (fs.tag.as_str(), fs.socket_path.as_path()),
            ("ws", std::path::Path::new("/run/fs:0.sock"))
        );
        for bad in ["ws", "ws:", ":/s.sock", ""] {
            let error = parse_fs(bad).unwrap_err().to_string();
            assert!(
                error.contains(&format!("{bad:?}")) && error.contains("TAG:SOCKET"),
                "{error}"
            );
        }
    }

    #[test]
    fn the_balloon_and_the_virtio_console_are_there_unless_left_out() {
        use clap::Parser;
        let config = |extra: &[&str]| {
            let argv = [&["vmctl", "boot", "--kernel", "/k"][..], extra].concat();
            match crate::cli::Cli::try_parse_from(argv).unwrap().command {
                crate::cli::Command::Boot(args) => resolve_config(&args).unwrap(),
                other => panic!("not boot: {other:?}"),
            }
        };
        assert!(config(&[]).free_page_reporting);
        assert!(!config(&["--no-free-page-reporting"]).free_page_reporting);
        assert!(config(&[]).virtio_console);
        assert!(!config(&["--no-virtio-console"]).virtio_console);
    }
}
