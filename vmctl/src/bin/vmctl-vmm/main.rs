//! `vmctl-vmm`: the VMM process vmctl starts for each VM (`vmctl boot` becomes it, a
//! workspace VM's supervisor runs it as a child). Its interface is [`vmm::process`].
//! Its arguments are parsed by hand: it is vmctl's, not a user's, command, and its
//! resident code is the VMM's overhead.

mod confine;
mod jail;
mod seccomp;

use std::fs::File;
use std::io::{IsTerminal, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, RawFd};
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use vmm::builder::{BuildError, RunOptions};
use vmm::config::VmConfig;
use vmm::devices::legacy::BootTimeReport;
use vmm::process::cpus::CpuSet;
use vmm::process::{decode_config, Args, ArgsError, Event, EventSink, Outcome, BINARY, USAGE};
use vmm::vstate::exit::ExitReason;

use confine::Confinement;
use jail::Jail;

fn main() -> ExitCode {
    let vmm_start = Instant::now();
    init_logging();
    let args = match Args::parse(std::env::args_os().skip(1)) {
        Ok(args) => args,
        Err(ArgsError::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            vmm::to_stderr!("{BINARY}: error: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    // Taken before the VMM opens anything, so that the numbers are still the caller's.
    let inherited = inherited_file(args.config_fd).and_then(|config| {
        let outcome = args.outcome_fd.map(inherited_file).transpose()?;
        Ok((read_config(config)?, outcome))
    });
    let (config, outcome_file) = match inherited {
        Ok(inherited) => inherited,
        Err(e) => {
            vmm::to_stderr!("{BINARY}: error: {e}");
            return ExitCode::from(2);
        }
    };
    let outcome_fd = outcome_file.as_ref().map(File::as_raw_fd);
    let events = event_sink(outcome_file.as_ref());
    // Read before the VM is built, so that a value it does not know costs no build.
    let wanted = seccomp::wanted()
        .map_err(|e| e.to_string())
        .and_then(|filter| Ok((filter, CpuSet::from_env().map_err(|e| e.to_string())?)));
    let outcome = match wanted {
        Ok((filter, vcpu_cpus)) => Outcome::of(run(
            &config,
            args.report_boot_time,
            vmm_start,
            Privileges {
                seccomp_filter: filter,
                vcpu_cpus,
                outcome_fd,
            },
            events,
        )),
        Err(error) => Outcome::Failed { error },
    };
    if let Outcome::Stopped { signal } = outcome {
        vmm::to_stderr!(
            "{BINARY}: stopped by signal {signal}; the guest was not shut down cleanly"
        );
    }
    let reported = outcome_file.is_some_and(|file| report(file, &outcome));
    if !reported {
        if let Some(error) = outcome.error() {
            vmm::to_stderr!("{BINARY}: error: {error}");
        }
    }
    ExitCode::from(outcome.exit_code())
}

/// What the VMM does just before its vCPUs start.
struct Privileges {
    seccomp_filter: bool,
    /// The host CPUs the vCPU threads run on (`VMCTL_VCPU_CPUS`).
    vcpu_cpus: Option<CpuSet>,
    outcome_fd: Option<RawFd>,
}

fn run(
    config: &VmConfig,
    report_boot_time: bool,
    vmm_start: Instant,
    privileges: Privileges,
    events: EventSink,
) -> Result<ExitReason, BuildError> {
    let options = RunOptions {
        events,
        vmm_start,
        console_output: Box::new(unbuffered_stdout().map_err(|source| BuildError::Open {
            what: "the guest console on",
            path: "stdout".into(),
            source,
        })?),
        console_input: true,
        on_boot_time: Box::new(move |report: BootTimeReport| {
            if report_boot_time {
                vmm::to_stderr!(
                    "{BINARY}: boot time: {:.1} ms since VMM start, {:.1} ms since the first vCPU ran",
                    report.since_vmm_start.as_secs_f64() * 1e3,
                    report.since_first_vcpu_run.as_secs_f64() * 1e3
                );
            }
        }),
        before_vcpus_start: {
            let socket_dir = config
                .vsock
                .as_ref()
                .and_then(|vsock| vsock.uds_path.parent())
                .map(Path::to_path_buf);
            let kernel = config.kernel.clone();
            Box::new(move || {
                // This thread starts the vCPU threads, which inherit its CPUs.
                if let Some(cpus) = &privileges.vcpu_cpus {
                    cpus.pin_this_thread().map_err(|e| e.to_string())?;
                }
                give_up_privileges(
                    socket_dir.as_deref(),
                    &kernel,
                    privileges.seccomp_filter,
                    privileges.outcome_fd,
                )
            })
        },
    };
    vmm::builder::run(config, options)
}

/// What the VMM gives up once the VM is built and before the guest runs: its view of
/// the host's files (the jail), opening files at all (Landlock, which forbids the
/// jail's mounts, so it comes second), then most system calls (seccomp, unless
/// `seccomp_filter` is off). `socket_dir` is its vsock socket's directory, the one it
/// keeps (vmctl gives the socket a directory of its own, and the sockets the guest
/// reaches host ports through); `kernel`'s directory is where the jail stands when
/// there is none.
fn give_up_privileges(
    socket_dir: Option<&Path>,
    kernel: &Path,
    seccomp_filter: bool,
    outcome_fd: Option<RawFd>,
) -> Result<(), String> {
    match jail::enter(socket_dir, kernel) {
        Jail::Entered => {
            tracing::debug!("jailed: its root is an empty tmpfs showing only {socket_dir:?}")
        }
        Jail::NotEntered(reason) => vmm::to_stderr!(
            "{BINARY}: warning: cannot jail the VMM ({reason}): it still sees the host's \
             files, within Landlock's limits, and can connect to the user's Unix sockets \
             (other VMs' agents, an ssh agent) should the guest take it over"
        ),
    }
    let (confinement, held) = confine::confine(socket_dir).map_err(|e| e.to_string())?;
    // Held until the process exits (see HeldPaths).
    std::mem::forget(held);
    if confinement == Confinement::None {
        vmm::to_stderr!(
            "{BINARY}: warning: this kernel has no Landlock: the VMM keeps the user's \
             access to files"
        );
    }
    tracing::debug!("confined to the VM's files: {confinement:?}");
    if !seccomp_filter {
        vmm::to_stderr!(
            "{BINARY}: warning: {}=off: the VMM runs without its seccomp filter",
            seccomp::SWITCH_ENV
        );
        return Ok(());
    }
    seccomp::install(outcome_fd).map_err(|e| e.to_string())?;
    tracing::debug!("system calls limited by the seccomp filter");
    Ok(())
}

/// Where the devices' [`Event`]s go: a line each on the outcome descriptor, for vmctl
/// to act on while the VM runs, each in one write (a line is shorter than a pipe's
/// atomic write, so lines from several threads never mix); stderr without one.
fn event_sink(outcome: Option<&File>) -> EventSink {
    let file = outcome.and_then(|file| {
        file.try_clone()
            .inspect_err(|e| {
                vmm::to_stderr!("{BINARY}: warning: cannot report events to vmctl: {e}")
            })
            .ok()
    });
    std::sync::Arc::new(move |event: Event| {
        let told = file
            .as_ref()
            .map(|mut file| file.write_all(event.to_line().as_bytes()));
        if let Some(Ok(())) = told {
            return;
        }
        match event {
            Event::FsBackendGivenUp { tag, reason } => vmm::to_stderr!(
                "{BINARY}: the virtio-fs backend of {tag:?} was given up on ({reason}); \
                 nothing here stops it: end that virtiofsd, and the guest's requests to \
                 the share then fail with EIO"
            ),
        }
    })
}

/// An unbuffered handle on stdout: the guest's console must not wait for a newline
/// (prompts) or a flush.
fn unbuffered_stdout() -> std::io::Result<File> {
    Ok(File::from(std::io::stdout().as_fd().try_clone_to_owned()?))
}

/// A descriptor the caller handed over, checked to be open.
fn inherited_file(fd: i32) -> Result<File, String> {
    // SAFETY: F_GETFD only reads the descriptor's flags.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(format!(
            "descriptor {fd}: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: the descriptor is open (checked above), was handed to this process for
    // this use alone, and nothing else in it owns the number: it is taken before the
    // VMM opens any file.
    Ok(unsafe { File::from_raw_fd(fd) })
}

fn read_config(mut file: File) -> Result<VmConfig, String> {
    let mut json = Vec::new();
    file.read_to_end(&mut json)
        .map_err(|e| format!("cannot read the VM's configuration: {e}"))?;
    decode_config(&json).map_err(|e| e.to_string())
}

/// Writes the outcome; false when the caller cannot be told (then stderr says it).
fn report(mut file: File, outcome: &Outcome) -> bool {
    let written = serde_json::to_string(outcome)
        .map_err(std::io::Error::from)
        .and_then(|json| writeln!(file, "{json}"));
    match written {
        Ok(()) => true,
        Err(e) => {
            vmm::to_stderr!("{BINARY}: warning: cannot report how the VM ended to vmctl: {e}");
            false
        }
    }
}

/// Warnings and errors on stderr; `VMCTL_LOG` (a tracing filter, as vmctl's) for more.
/// By default none of virtio-queue's: it logs every malformed ring or chain a guest
/// hands it as an error, one line per notification, past the VMM's rate limit for
/// what the guest causes (`guest_log`), and the VMM says what it refused itself.
fn init_logging() {
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colours only for a person: stderr is mostly the VM's supervisor log.
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        // Its report of a failed write is an eprintln!, which would abort the VMM.
        .log_internal_errors(false);
    let filter = tracing_subscriber::EnvFilter::try_from_env("VMCTL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,virtio_queue=off"));
    builder.with_env_filter(filter).init();
}
