//! The VMM process: `vmctl-vmm` runs one VM, and this is how vmctl starts it and learns
//! how the VM ended.
//!
//! vmctl runs each VM in a process of its own, as Firecracker does: the guest faces
//! only this process, which holds none of the host's secrets in memory (the egress
//! proxy and its tokens stay in vmctl's supervisor) and, before the guest runs, jails
//! itself (namespaces), confines itself (Landlock) and limits its system calls
//! (seccomp); its resident code is the VMM's alone, not the CLI's, the proxy's and
//! TLS's.
//!
//! Arguments: `--config-fd N` (descriptor N holds a [`VmConfig`] as JSON: short
//! command lines in `ps`, `3<config.json` by hand), `--boot-time` (report the boot
//! timer on stderr), `--outcome-fd N` (write the [`Outcome`] to descriptor N as one
//! JSON line, after an [`Event`] line for each thing the caller must act on while the
//! VM runs, and leave the reporting of errors to the caller). The guest's serial
//! console is the process's stdin and stdout.

use std::ffi::OsString;

use serde::{Deserialize, Serialize};

use crate::builder::BuildError;
use crate::config::VmConfig;
use crate::vstate::exit::ExitReason;

pub mod child;
pub mod cpus;

/// `eprintln!` that cannot panic, and that escapes control characters. vmctl and its VMM are built with `panic = "abort"`,
/// and `eprintln!` panics when stderr cannot be written (its reader gone with a killed
/// parent, a full disk): a message must not end the process halfway through its
/// clean-up. A message that cannot be written is lost; the exit code still tells.
///
/// Whatever the message quotes (a path, the guest's words) reaches the terminal
/// [`printable`]: no escape sequence in it drives the user's terminal.
#[macro_export]
macro_rules! to_stderr {
    ($($arg:tt)*) => {{
        use ::std::io::Write as _;
        let text = ::std::format!($($arg)*);
        let _ = ::std::writeln!(::std::io::stderr(), "{}", $crate::process::printable(&text));
    }};
}

/// `text` fit for the host's terminal: control characters other than newline and tab
/// shown escaped (`\x1b`), and the characters that change a line's layout
/// ([`guest_log::is_layout_control`]: a bidi override). Messages may quote the guest
/// (its agent's errors, its console's panic line, a config value it wrote), and an
/// escape sequence from it must not drive the terminal, nor an override disguise it.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    guest_log::escaped(text, |c| {
        (c.is_control() && c != '\n' && c != '\t') || guest_log::is_layout_control(c)
    })
}

/// [`printable`], and on one line: line breaks shown escaped too, for a guest's words
/// quoted inside a message, where a line of their own could pass for vmctl's.
pub fn one_line(text: &str) -> std::borrow::Cow<'_, str> {
    guest_log::one_line(text)
}

/// The VMM's executable, built with `vmctl` (`vmctl/src/bin/vmctl-vmm/`) and
/// installed beside it.
pub const BINARY: &str = "vmctl-vmm";

/// `off` in the VMM's environment runs it without its seccomp filter (a stopgap for a
/// host whose C library makes calls the filter does not expect).
pub const SECCOMP_SWITCH_ENV: &str = "VMCTL_SECCOMP";
/// The host CPUs the VMM runs on once its vCPUs start (they, its event loop and the
/// device workers they start), as `taskset -c` takes them (`1-2`, `1,3`); unset or
/// empty: any ([`cpus`]).
pub const VCPU_CPUS_ENV: &str = "VMCTL_VCPU_CPUS";
const CONFIG_FD_ARG: &str = "--config-fd";
const BOOT_TIME_ARG: &str = "--boot-time";
const OUTCOME_FD_ARG: &str = "--outcome-fd";

pub const USAGE: &str = "usage: vmctl-vmm --config-fd N [--boot-time] [--outcome-fd M]

Runs one VM to its end; vmctl starts it (`vmctl boot`, a workspace VM's supervisor).
  --config-fd N     read the VM (kernel, initrd, disks, vCPUs, memory, vsock, virtio-fs)
                    as JSON from descriptor N, e.g. `--config-fd 3 3<vm.json`
  --boot-time       print the guest's boot time on stderr once its init runs
  --outcome-fd M    write how the VM ended to descriptor M (one JSON line) instead of
                    printing an error
Before the guest runs it jails itself (namespaces), gives up opening files (Landlock)
and limits its system calls (seccomp); VMCTL_SECCOMP=off leaves the last out.
VMCTL_VCPU_CPUS=LIST runs the VM (its vCPUs and device threads) only on those host
CPUs (as taskset -c takes them).
Exit status: 0 when the guest shut down, 128+N when stopped by signal N, 1 on error,
2 for wrong arguments or an unreadable configuration.";

/// What the VMM process is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Args {
    pub config_fd: i32,
    pub report_boot_time: bool,
    pub outcome_fd: Option<i32>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgsError {
    #[error("{CONFIG_FD_ARG} is missing")]
    NoConfig,
    #[error("{0} needs a value")]
    NoValue(&'static str),
    #[error("{CONFIG_FD_ARG}: not a VM configuration: {0}")]
    BadConfig(String),
    #[error("{0} {1:?}: not a descriptor number above 2 (0 to 2 are the console and stderr)")]
    BadDescriptor(&'static str, String),
    #[error(
        "{CONFIG_FD_ARG} and {OUTCOME_FD_ARG} are both {0}: they need descriptors of their own"
    )]
    SameDescriptor(i32),
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
        let mut config_fd = None;
        let mut report_boot_time = false;
        let mut outcome_fd = None;
        while let Some(arg) = args.next() {
            match arg.as_str() {
                CONFIG_FD_ARG => config_fd = Some(descriptor(&mut args, CONFIG_FD_ARG)?),
                OUTCOME_FD_ARG => outcome_fd = Some(descriptor(&mut args, OUTCOME_FD_ARG)?),
                BOOT_TIME_ARG => report_boot_time = true,
                "-h" | "--help" => return Err(ArgsError::Help),
                _ => return Err(ArgsError::Unexpected(arg)),
            }
        }
        let config_fd = config_fd.ok_or(ArgsError::NoConfig)?;
        if outcome_fd == Some(config_fd) {
            return Err(ArgsError::SameDescriptor(config_fd));
        }
        Ok(Self {
            config_fd,
            report_boot_time,
            outcome_fd,
        })
    }

    /// The command-line arguments that [`Args::parse`] reads back.
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args = vec![CONFIG_FD_ARG.into(), self.config_fd.to_string().into()];
        if self.report_boot_time {
            args.push(BOOT_TIME_ARG.into());
        }
        if let Some(fd) = self.outcome_fd {
            args.push(OUTCOME_FD_ARG.into());
            args.push(fd.to_string().into());
        }
        args
    }
}

/// The value of a descriptor option: a number above 2.
fn descriptor(
    args: &mut impl Iterator<Item = String>,
    name: &'static str,
) -> Result<i32, ArgsError> {
    let value = args.next().ok_or(ArgsError::NoValue(name))?;
    value
        .parse::<i32>()
        .ok()
        .filter(|fd| *fd > 2)
        .ok_or(ArgsError::BadDescriptor(name, value))
}

/// The configuration as the VMM reads it from its descriptor.
pub fn encode_config(config: &VmConfig) -> Result<Vec<u8>, ArgsError> {
    serde_json::to_vec(config).map_err(|e| ArgsError::Unencodable(e.to_string()))
}

pub fn decode_config(json: &[u8]) -> Result<VmConfig, ArgsError> {
    serde_json::from_slice(json).map_err(|e| ArgsError::BadConfig(e.to_string()))
}

/// What the VMM tells its caller while the VM runs: one JSON line each on the outcome
/// descriptor, before the [`Outcome`]'s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// The VMM gave up on the virtio-fs backend (virtiofsd) of the device tagged `tag`:
    /// it left a request unanswered past its time, or refused one. The VMM stopped
    /// reading from it, but it may still run, with the guest's memory mapped and the
    /// guest's rings in hand: whoever started it must kill it. The guest's requests to
    /// that share are answered with EIO once it is gone, not before.
    FsBackendGivenUp { tag: String, reason: String },
}

impl Event {
    /// The event as its line on the outcome descriptor (newline included).
    pub fn to_line(&self) -> String {
        // A plain enum of strings always serializes.
        let mut line = serde_json::to_string(self).unwrap_or_default();
        line.push('\n');
        line
    }
}

/// Where the VM's devices send [`Event`]s.
pub type EventSink = std::sync::Arc<dyn Fn(Event) + Send + Sync>;

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
    fn the_configuration_and_the_arguments_go_there_and_back() {
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
        assert_eq!(
            decode_config(&encode_config(&config).unwrap()).unwrap(),
            config
        );
        assert!(matches!(decode_config(b"{}"), Err(ArgsError::BadConfig(_))));
        let args = Args {
            config_fd: 3,
            report_boot_time: true,
            outcome_fd: Some(7),
        };
        assert_eq!(Args::parse(args.to_args()).unwrap(), args);
    }

    #[test]
    fn bad_arguments_are_named() {
        assert_eq!(Args::parse(os(&[])), Err(ArgsError::NoConfig));
        assert_eq!(
            Args::parse(os(&["--config-fd"])),
            Err(ArgsError::NoValue(CONFIG_FD_ARG))
        );
        for fd in ["x", "-1", "1"] {
            assert_eq!(
                Args::parse(os(&["--config-fd", "3", "--outcome-fd", fd])),
                Err(ArgsError::BadDescriptor(OUTCOME_FD_ARG, fd.into()))
            );
        }
        assert_eq!(
            Args::parse(os(&["--config-fd", "4", "--outcome-fd", "4"])),
            Err(ArgsError::SameDescriptor(4))
        );
        assert_eq!(
            Args::parse(os(&["--config-fd", "3", "--memory"])),
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
