//! `vmctl boot`: boot a kernel with the serial console on stdout.

use std::path::{Path, PathBuf};
use std::time::Instant;

use vmm::builder::{BuildError, RunOptions};
use vmm::config::{host_memory_mib, ConfigError, DiskConfig, FsConfig, VmConfig};
use vmm::devices::legacy::BootTimeReport;
use vmm::vstate::exit::ExitReason;

use crate::artifacts::{self, Artifact, ArtifactError};
use crate::cli::{BootArgs, NestedMode};
use crate::host_kvm::KvmKind;
use crate::nested::{self, NestedError};
use crate::shares::ShareSet;
use crate::terminal;
use crate::virtiofsd::{self, VirtiofsdError};

#[derive(Debug, thiserror::Error)]
pub enum BootCommandError {
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Vm(#[from] BuildError),
    #[error(transparent)]
    Nested(#[from] NestedError),
    #[error("the VM stopped: {0}")]
    Fatal(String),
    #[error("cannot open stdout for the guest console: {0}")]
    Stdout(std::io::Error),
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
    let vmm_start = Instant::now();
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
        return Ok(nested::launcher::run_vm(&config, None, args.boot_time)?);
    }
    run_vmm(&config, args.boot_time, vmm_start)
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

/// Runs the VMM in this process with one virtiofsd per share, started here (so inside
/// the nested host when there is one), their sockets in `socket_dir`.
pub fn run_vmm_sharing(
    config: &VmConfig,
    shares: Option<&ShareSet>,
    socket_dir: &Path,
    report_boot_time: bool,
    vmm_start: Instant,
) -> Result<u8, BootCommandError> {
    let Some(set) = shares.filter(|set| !set.shares.is_empty()) else {
        return run_vmm(config, report_boot_time, vmm_start);
    };
    let (daemons, filesystems) = virtiofsd::start(
        &set.virtiofsd,
        &set.shares,
        socket_dir,
        socket_dir,
        set.cache,
    )?;
    if let Some(file) = &set.failure_file {
        daemons.record_failures_in(file.clone());
    }
    let mut config = config.clone();
    config.filesystems = filesystems;
    let outcome = run_vmm(&config, report_boot_time, vmm_start);
    daemons.stop();
    outcome
}

/// Runs the VMM in this process (on the host, or as the nested host's init).
pub fn run_vmm(
    config: &VmConfig,
    report_boot_time: bool,
    vmm_start: Instant,
) -> Result<u8, BootCommandError> {
    let options = RunOptions {
        vmm_start,
        serial_output: Box::new(terminal::unbuffered_stdout().map_err(BootCommandError::Stdout)?),
        console_input: true,
        on_boot_time: Box::new(move |report: BootTimeReport| {
            if report_boot_time {
                eprintln!(
                    "vmctl: boot time: {:.1} ms since VMM start, {:.1} ms since the first vCPU ran",
                    report.since_vmm_start.as_secs_f64() * 1e3,
                    report.since_first_vcpu_run.as_secs_f64() * 1e3
                );
            }
        }),
    };
    match vmm::builder::run(config, options)? {
        ExitReason::GuestShutdown => Ok(0),
        ExitReason::Signal(signal) => {
            eprintln!("vmctl: stopped by signal {signal}; the guest was not shut down cleanly");
            Ok(128u8.saturating_add(signal as u8))
        }
        ExitReason::Fatal(reason) => Err(BootCommandError::Fatal(reason)),
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
