//! The VMM process: `vmctl-vmm` runs one VM, and this is how vmctl starts it and learns
//! how the VM ended.
//!
//! vmctl runs each VM in a process of its own, as Firecracker does: the guest faces
//! only this process, which holds none of the host's secrets in memory (the egress
//! proxy and its tokens stay in vmctl's supervisor), and its resident code is the
//! VMM's alone, not the CLI's, the proxy's and TLS's.
//!
//! Arguments: `--config JSON` (a [`VmConfig`]), `--boot-time` (report the boot timer on
//! stderr), `--outcome-fd N` (write the [`Outcome`] to descriptor N as one JSON line,
//! and leave the reporting of errors to the caller). The guest's serial console is the
//! process's stdin and stdout.

use std::ffi::OsString;

use serde::{Deserialize, Serialize};

use crate::builder::BuildError;
use crate::config::VmConfig;
use crate::vstate::exit::ExitReason;

/// The VMM's executable, built with `vmctl` (`vmctl/src/bin/vmctl-vmm.rs`) and
/// installed beside it.
pub const BINARY: &str = "vmctl-vmm";
const CONFIG_ARG: &str = "--config";
const BOOT_TIME_ARG: &str = "--boot-time";
const OUTCOME_FD_ARG: &str = "--outcome-fd";

pub const USAGE: &str = "usage: vmctl-vmm --config JSON [--boot-time] [--outcome-fd N]

Runs one VM to its end; vmctl starts it (`vmctl boot`, a workspace VM's supervisor).
  --config JSON     the VM: kernel, initrd, disks, vCPUs, memory, vsock, virtio-fs
  --boot-time       print the guest's boot time on stderr once its init runs
  --outcome-fd N    write how the VM ended to descriptor N (one JSON line) instead of
                    printing an error
Exit status: 0 when the guest shut down, 128+N when stopped by signal N, 1 on error.";

/// What the VMM process is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Args {
    pub config: VmConfig,
    pub report_boot_time: bool,
    pub outcome_fd: Option<i32>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgsError {
    #[error("{CONFIG_ARG} is missing")]
    NoConfig,
    #[error("{0} needs a value")]
    NoValue(&'static str),
    #[error("{CONFIG_ARG}: not a VM configuration: {0}")]
    BadConfig(String),
    #[error("{OUTCOME_FD_ARG} {0:?}: not a descriptor number")]
    BadDescriptor(String),
    #[error("unexpected argument {0:?}")]
    Unexpected(String),
    #[error("the VM's configuration cannot be passed on: {0} (paths must be UTF-8)")]
    Unencodable(String),
    /// `--help`: not an error, the caller prints [`USAGE`].
    #[error("help requested")]
    Help,
}

impl Args {
    pub fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Self, ArgsError> {
        let mut args = args.into_iter().map(|a| a.to_string_lossy().into_owned());
        let mut config = None;
        let mut report_boot_time = false;
        let mut outcome_fd = None;
        while let Some(arg) = args.next() {
            match arg.as_str() {
                CONFIG_ARG => {
                    let json = args.next().ok_or(ArgsError::NoValue(CONFIG_ARG))?;
                    config = Some(
                        serde_json::from_str(&json)
                            .map_err(|e| ArgsError::BadConfig(e.to_string()))?,
                    );
                }
                BOOT_TIME_ARG => report_boot_time = true,
                OUTCOME_FD_ARG => {
                    let fd = args.next().ok_or(ArgsError::NoValue(OUTCOME_FD_ARG))?;
                    outcome_fd = Some(
                        fd.parse::<i32>()
                            .ok()
                            .filter(|fd| *fd > 2)
                            .ok_or(ArgsError::BadDescriptor(fd))?,
                    );
                }
                "-h" | "--help" => return Err(ArgsError::Help),
                _ => return Err(ArgsError::Unexpected(arg)),
            }
        }
        Ok(Self {
            config: config.ok_or(ArgsError::NoConfig)?,
            report_boot_time,
            outcome_fd,
        })
    }

    /// The command-line arguments that [`Args::parse`] reads back.
    pub fn to_args(&self) -> Result<Vec<OsString>, ArgsError> {
        let json = serde_json::to_string(&self.config)
            .map_err(|e| ArgsError::Unencodable(e.to_string()))?;
        let mut args = vec![CONFIG_ARG.into(), json.into()];
        if self.report_boot_time {
            args.push(BOOT_TIME_ARG.into());
        }
        if let Some(fd) = self.outcome_fd {
            args.push(OUTCOME_FD_ARG.into());
            args.push(fd.to_string().into());
        }
        Ok(args)
    }
}

/// How a VM run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The guest powered off or rebooted.
    Shutdown,
    /// Stopped by a signal (SIGINT, SIGTERM); the guest was not shut down cleanly.
    Stopped { signal: i32 },
    /// A vCPU hit something the VMM cannot continue from (a triple fault, ...).
    Crashed { reason: String },
    /// The VM could not be built or run (KVM, memory, kernel, a device, ...).
    Failed { error: String },
}

impl Outcome {
    pub fn of(run: Result<ExitReason, BuildError>) -> Self {
        match run {
            Ok(ExitReason::GuestShutdown) => Self::Shutdown,
            Ok(ExitReason::Signal(signal)) => Self::Stopped { signal },
            Ok(ExitReason::Fatal(reason)) => Self::Crashed { reason },
            Err(e) => Self::Failed {
                error: e.to_string(),
            },
        }
    }

    /// The process's exit status for this outcome.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Shutdown => 0,
            Self::Stopped { signal } => 128u8.saturating_add(u8::try_from(*signal).unwrap_or(0)),
            Self::Crashed { .. } | Self::Failed { .. } => 1,
        }
    }

    /// What went wrong, for an error line; `None` when nothing did.
    pub fn error(&self) -> Option<String> {
        match self {
            Self::Shutdown | Self::Stopped { .. } => None,
            Self::Crashed { reason } => Some(format!("the VM stopped: {reason}")),
            Self::Failed { error } => Some(error.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DiskConfig, FsConfig, VsockConfig};

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn arguments_carry_the_whole_configuration_there_and_back() {
        let mut config = VmConfig::new("/k/vmlinux".into());
        config.initrd = Some("/k/initrd".into());
        config.disks = vec![DiskConfig::parse("/d/root.img:ro")];
        config.extra_cmdline = "quiet \"x y\"".into();
        config.vcpus = 2;
        config.memory_mib = 1024;
        config.vsock = Some(VsockConfig {
            guest_cid: 3,
            uds_path: "/run/v.sock".into(),
        });
        config.filesystems = vec![FsConfig {
            socket_path: "/run/fs.sock".into(),
            tag: "ws".into(),
        }];
        let args = Args {
            config,
            report_boot_time: true,
            outcome_fd: Some(7),
        };
        assert_eq!(Args::parse(args.to_args().unwrap()).unwrap(), args);
    }

    #[test]
    fn bad_arguments_are_named() {
        let config = serde_json::to_string(&VmConfig::new("/k".into())).unwrap();
        assert_eq!(Args::parse(os(&[])), Err(ArgsError::NoConfig));
        assert_eq!(
            Args::parse(os(&["--config"])),
            Err(ArgsError::NoValue(CONFIG_ARG))
        );
        assert!(matches!(
            Args::parse(os(&["--config", "{}"])),
            Err(ArgsError::BadConfig(_))
        ));
        for fd in ["x", "-1", "1"] {
            assert_eq!(
                Args::parse(os(&["--config", &config, "--outcome-fd", fd])),
                Err(ArgsError::BadDescriptor(fd.into()))
            );
        }
        assert_eq!(
            Args::parse(os(&["--config", &config, "--memory"])),
            Err(ArgsError::Unexpected("--memory".into()))
        );
        assert_eq!(Args::parse(os(&["--help"])), Err(ArgsError::Help));
    }

    #[test]
    fn outcomes_map_to_exit_codes_and_errors() {
        assert_eq!(Outcome::of(Ok(ExitReason::GuestShutdown)).exit_code(), 0);
        let stopped = Outcome::of(Ok(ExitReason::Signal(libc::SIGTERM)));
        assert_eq!((stopped.exit_code(), stopped.error()), (143, None));
        let crashed = Outcome::of(Ok(ExitReason::Fatal("triple fault".into())));
        assert_eq!(
            (crashed.exit_code(), crashed.error().as_deref()),
            (1, Some("the VM stopped: triple fault"))
        );
        let json = serde_json::to_string(&crashed).unwrap();
        assert_eq!(serde_json::from_str::<Outcome>(&json).unwrap(), crashed);
    }
}
