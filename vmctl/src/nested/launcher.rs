//! Starts the nested host (QEMU TCG with emulated SVM) for one VM run and relays its
//! outcome: the guest's console on stdout, the VMM's messages on stderr, its exit
//! code as ours.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use vmm::config::VmConfig;
use vmm::process::cpus::{CpuSet, CpusError};
use vmm::process::VCPU_CPUS_ENV;
use vmm_sys_util::signal::register_signal_handler;

use super::job::{self, CommandJob, NestedJob, NestedStatus, Work};
use super::mux::{Mux, Opener, VSOCK_PORT};
use super::stall::{Stall, StallWatch, WATCH_ENV};
use crate::artifacts::{self, Artifact, ArtifactError};
use crate::shares::ShareSet;
use crate::virtiofsd::{self, FsDaemons, VirtiofsdError};
use std::sync::Arc;
use vmm::config::FsConfig;

const QEMU_ENV: &str = "VMCTL_QEMU";
const QEMU_BINARY: &str = "qemu-system-x86_64";
const LOG_ENV: &str = "VMCTL_LOG";
/// Extra kernel arguments for the nested host (diagnosis: `kvm_amd.npt=1`, ...).
const KERNEL_ARGS_ENV: &str = "VMCTL_NESTED_KERNEL_ARGS";
/// The nested host's KVM uses shadow paging, not the emulated CPU's nested paging:
/// with nested paging its guests crashed or hung within a few hundred to a few
/// thousand exec round trips (`scripts/exec-stress 1000`: 0 of 4 runs clean), with
/// shadow paging none did (7 of 7 clean, alternating in one session), at about 40%
/// more time per round trip (README, "Known problem").
const NESTED_KVM_ARGS: &str = "kvm_amd.npt=0";
/// QEMU's human monitor of a nested host, in its job directory
/// (`/tmp/vmctl-nested-<vmctl pid>-<n>/`).
const MONITOR_SOCKET: &str = "monitor.sock";

#[derive(Debug, thiserror::Error)]
pub enum NestedError {
    #[error("{0}: QEMU not found; the nested host needs it: install the 'qemu-system-x86' package (apt-get install qemu-system-x86)")]
    QemuMissing(String),
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error("cannot find the vmctl binary to run in the nested host: {0}")]
    CurrentExe(std::io::Error),
    #[error("{}: the nested host cannot use a path with spaces or non-ASCII characters; move it", .0.display())]
    UnusablePath(PathBuf),
    #[error("cannot prepare the nested host's job directory {}: {source}", .path.display())]
    JobDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start QEMU ({qemu}): {source}")]
    Spawn {
        qemu: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Virtiofsd(#[from] VirtiofsdError),
    #[error(transparent)]
    Cpus(#[from] CpusError),
    #[error("the nested host stopped before the VM finished (QEMU {status}); QEMU said: {log}")]
    Died { status: String, log: String },
    #[error("the nested host stalled, so vmctl stopped it: {0}; the emulation's known problem (README), not the guest's; what ran in it is lost, run it again ({WATCH_ENV}=off leaves such a nested host running, for a look inside with scripts/nested-monitor)")]
    Stalled(Stall),
    #[error("the nested host stopped before the VM finished: it reset without a word (its kernel triple-faulted or rebooted; QEMU exited 0), the nested host's known problem (README), not the guest's; VMCTL_LOG=debug shows its kernel's messages")]
    Reset,
}

/// The job directory, shared with the nested host and removed afterwards.
struct JobDir {
    path: PathBuf,
    /// Its lock, held while this launcher runs.
    _lock: std::fs::File,
}

impl JobDir {
    fn create() -> Result<Self, NestedError> {
        // Not another user's runtime directory (root through `sudo -E`): the job
        // directory is private and made anew, so the shared temporary one serves.
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|dir| dir.is_absolute() && crate::state::is_ours_alone(dir))
            .unwrap_or_else(std::env::temp_dir);
        remove_stale_job_dirs(&base);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path = base.join(format!("{JOB_DIR_PREFIX}{}-{nanos}", std::process::id()));
        // Private: it holds the job (a nested-exec's environment) and the sockets of
        // the nested host's monitor and relays. Created, never taken over: a directory
        // someone else made at this name first is an error.
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(&path)
            .map_err(|source| NestedError::JobDir {
                path: path.clone(),
                source,
            })?;
        // Held while this launcher runs, in whatever PID namespace: a sweep by another
        // launcher leaves the directory alone while it is taken. Taken under another
        // name, then put in place: a sweep must never find it there untaken.
        let job_dir_error = |source| NestedError::JobDir {
            path: path.clone(),
            source,
        };
        let taking = path.join(format!("{JOB_DIR_LOCK}.new"));
        let lock = crate::state::lock_file(&taking).map_err(job_dir_error)?;
        std::fs::rename(&taking, path.join(JOB_DIR_LOCK)).map_err(job_dir_error)?;
        Ok(Self { path, _lock: lock })
    }

    fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for JobDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            tracing::warn!("cannot remove {}: {e}", self.path.display());
        }
    }
}

const JOB_DIR_PREFIX: &str = "vmctl-nested-";
const JOB_DIR_LOCK: &str = "launcher.lock";

/// Removes the job directories of launchers that are gone without removing their own
/// (SIGKILL, a crash): those of ours whose lock nobody holds. One without a lock (its
/// launcher has not taken it yet, or is an older vmctl) goes when its pid is no
/// process now; one whose pid was reused meanwhile stays until that process ends too.
fn remove_stale_job_dirs(base: &Path) {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid cannot fail.
    let uid = unsafe { libc::geteuid() };
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix(JOB_DIR_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<i32>().ok())
            .filter(|&pid| pid > 0)
        else {
            continue;
        };
        let ours = entry
            .metadata()
            .is_ok_and(|meta| meta.is_dir() && meta.uid() == uid);
        let pid_gone = || {
            // SAFETY: signal 0 only asks whether the process exists.
            let alive = unsafe { libc::kill(pid, 0) } == 0;
            !alive && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
        };
        let gone = match std::fs::File::open(entry.path().join(JOB_DIR_LOCK)) {
            Ok(lock) => lock.try_lock().is_ok(),
            Err(_) => pid_gone(),
        };
        if ours && gone {
            tracing::debug!(
                "removing {}, left by a launcher that is gone",
                name.to_string_lossy()
            );
            if let Err(e) = std::fs::remove_dir_all(entry.path()) {
                tracing::warn!("cannot remove {}: {e}", entry.path().display());
            }
        }
    }
}

static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn remember_stop_signal(
    signal: libc::c_int,
    _: *mut libc::siginfo_t,
    _: *mut libc::c_void,
) {
    STOP_SIGNAL.store(signal, Ordering::SeqCst);
}

/// Runs `config` in a fresh nested host; returns the VMM's exit code. `kernel`: the
/// nested host's, if the caller has it (else it is built here if not in the cache).
/// `log_dir`: where the host's virtiofsd daemons log (the VM's directory, whose logs
/// its supervisor keeps bounded), else the job directory, which goes with the run.
pub fn run_vm(
    config: &VmConfig,
    shares: Option<&ShareSet>,
    report_boot_time: bool,
    kernel: Option<&Path>,
    log_dir: Option<&Path>,
) -> Result<u8, NestedError> {
    let host_vsock = config.vsock.as_ref().map(|v| v.uds_path.as_path());
    run(
        &NestedJob::for_vm(config, shares, report_boot_time),
        host_vsock,
        kernel,
        log_dir,
    )
}

/// Runs `argv` in a fresh nested host with this process's environment and working
/// directory; returns its exit code.
pub fn run_command(
    argv: Vec<String>,
    vcpus: u32,
    memory_mib: u64,
    writable: &[PathBuf],
) -> Result<u8, NestedError> {
    let cwd = std::env::current_dir().map_err(|source| NestedError::JobDir {
        path: PathBuf::from("."),
        source,
    })?;
    let env = job::command_env(std::env::vars_os());
    run(
        &NestedJob::for_command(CommandJob { argv, cwd, env }, vcpus, memory_mib, writable),
        None,
        None,
        None,
    )
}

/// Runs `job` in a fresh nested host; returns its exit code. `host_vsock` is where
/// host clients connect to reach the VM's vsock (relayed over the multiplexed link).
fn run(
    job: &NestedJob,
    host_vsock: Option<&Path>,
    kernel: Option<&Path>,
    log_dir: Option<&Path>,
) -> Result<u8, NestedError> {
    let qemu = find_qemu()?;
    let host_cpus = CpuSet::from_env()?;
    let kernel = host_kernel(kernel, artifacts::ensure)?;
    let vmctl = std::env::current_exe().map_err(NestedError::CurrentExe)?;
    for path in [&vmctl, &kernel] {
        if !path
            .to_str()
            .is_some_and(|s| s.is_ascii() && !s.contains(char::is_whitespace))
        {
            return Err(NestedError::UnusablePath(path.clone()));
        }
    }

    let job_dir = JobDir::create()?;
    let spec_path = job_dir.file(job::SPEC_FILE);
    let job_dir_error = |source| NestedError::JobDir {
        path: job_dir.path.clone(),
        source,
    };
    let spec = serde_json::to_vec_pretty(job).map_err(|e| job_dir_error(e.into()))?;
    std::fs::write(&spec_path, spec).map_err(job_dir_error)?;
    let stderr_socket = job_dir.file("stderr.sock");
    let listener = UnixListener::bind(&stderr_socket).map_err(job_dir_error)?;
    let relay = std::thread::spawn(move || relay_stderr(listener));
    let qemu_log = File::create(job_dir.file("qemu.log")).map_err(job_dir_error)?;

    let mux_socket = job_dir.file("mux.sock");
    let _relay = match (job.needs_mux(), host_vsock) {
        (true, Some(host_vsock)) => Some(start_vsock_relay(&mux_socket, host_vsock)?),
        _ => None,
    };
    // Kept until QEMU is gone.
    // The job directory is the nested host's to write too: logs kept bounded outside
    // it, where it cannot put a link in their place.
    let log_dir = log_dir.unwrap_or(&job_dir.path);
    let (_host_daemons, host_filesystems) = start_host_shares(job, &job_dir.path, log_dir)?;
    let mut command = qemu_command(&qemu, &kernel, &vmctl, &job_dir.path, &stderr_socket, job);
    add_filesystems(&mut command, &host_filesystems, job.host_memory_mib);
    if job.free_page_reporting() {
        add_free_page_reporting(&mut command);
    }
    if let Some(cpus) = &host_cpus {
        tracing::info!(
            "the nested host runs on host CPUs {} ({VCPU_CPUS_ENV})",
            cpus.list()
        );
        cpus.apply_to_command(&mut command);
    }
    if job.needs_mux() {
        command
            .arg("-chardev")
            .arg(format!(
                "socket,id=mux,path={}",
                qemu_option_path(&mux_socket)
            ))
            .arg("-device")
            .arg(format!(
                "virtserialport,chardev=mux,name={}",
                job::MUX_PORT_NAME
            ));
    }
    command
        .stdin(stdin_for_qemu())
        .stdout(Stdio::inherit())
        .stderr(qemu_log);
    // If vmctl dies without stopping QEMU, QEMU gets SIGTERM (and restores the
    // terminal) instead of living on as an orphan.
    vmm::process::child::stop_with_parent(&mut command);
    tracing::debug!(
        "starting the nested host (monitor: {}): {command:?}",
        job_dir.file(MONITOR_SOCKET).display()
    );
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        if let Err(e) = register_signal_handler(signal, remember_stop_signal) {
            tracing::warn!("cannot handle signal {signal}: {e}");
        }
    }
    let mut child = command.spawn().map_err(|source| NestedError::Spawn {
        qemu: qemu.clone(),
        source,
    })?;
    let watch = StallWatch::start(job_dir.file(MONITOR_SOCKET), job.host_vcpus);
    let status = wait_or_stop(&mut child, &watch);
    let stopped_by = STOP_SIGNAL.load(Ordering::SeqCst);

    // The socket closes when QEMU exits; give the relay a moment to drain it.
    let deadline = Instant::now() + Duration::from_secs(2);
    while !relay.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    if stopped_by != 0 {
        // Often to a stderr that is gone, with a parent that died: to_stderr! does not
        // abort there, so the job directory is still removed.
        vmm::to_stderr!(
            "vmctl: stopped by signal {stopped_by}; the guest was not shut down cleanly"
        );
        return Ok(128u8.saturating_add(stopped_by as u8));
    }
    if let Some(stall) = watch.stall() {
        return Err(NestedError::Stalled(stall));
    }
    // Both in a directory the nested host can write: read no more than they can hold.
    let status_file = crate::log_keeper::read_tail(&job_dir.file(job::STATUS_FILE), 64 << 10);
    match status_file.and_then(|s| serde_json::from_slice::<NestedStatus>(&s).ok()) {
        Some(status) => Ok(status.exit_code),
        None => {
            let log = crate::log_keeper::read_tail(&job_dir.file("qemu.log"), 1 << 20)
                .unwrap_or_default();
            Err(died_early(status, &String::from_utf8_lossy(&log)))
        }
    }
}

/// The nested host's kernel: `given` (`vmctl up` built it before the VM's boot was
/// timed), else `ensure`'s ([`artifacts::ensure`]: built now if not in the cache), as
/// for `vmctl boot` and `vmctl nested-exec`, whose caller waits for them anyway.
fn host_kernel(
    given: Option<&Path>,
    ensure: impl FnOnce(Artifact) -> Result<PathBuf, ArtifactError>,
) -> Result<PathBuf, NestedError> {
    match given {
        Some(kernel) => Ok(kernel.to_path_buf()),
        None => Ok(ensure(Artifact::NestedHostKernel)?),
    }
}

/// Why the nested host ended without the VM's exit status. QEMU exits 0 without a
/// word when the nested host's CPU resets (`-no-reboot`): the way its init ends, and
/// otherwise a triple fault or a reboot of its kernel that left no message.
fn died_early(status: Option<std::process::ExitStatus>, qemu_log: &str) -> NestedError {
    let log = qemu_log.trim();
    if log.is_empty() && status.is_some_and(|s| s.success()) {
        return NestedError::Reset;
    }
    NestedError::Died {
        status: status.map_or_else(|| "did not exit".into(), |s| s.to_string()),
        log: if log.is_empty() {
            "nothing; rerun with VMCTL_LOG=debug".into()
        } else {
            let last: Vec<&str> = log.lines().rev().take(5).collect();
            last.into_iter().rev().collect::<Vec<_>>().join(" | ")
        },
    }
}

/// Starts the host's virtiofsd for each directory the nested host mounts over
/// virtio-fs (`NestedJob::fs_dirs`).
fn start_host_shares(
    job: &NestedJob,
    job_dir: &Path,
    log_dir: &Path,
) -> Result<(Option<FsDaemons>, Vec<FsConfig>), NestedError> {
    let Work::Vm(job::VmJob {
        shares: Some(set), ..
    }) = &job.work
    else {
        return Ok((None, Vec::new()));
    };
    if job.fs_dirs.is_empty() {
        return Ok((None, Vec::new()));
    }
    let shares = job::nested_host_shares(set);
    let (daemons, filesystems) = virtiofsd::start(
        &set.virtiofsd,
        &shares,
        job_dir,
        log_dir,
        virtiofsd::CachePolicy::PASS_THROUGH,
    )?;
    if let Some(file) = &set.failure_file {
        daemons.record_failures_in(file.clone());
    }
    Ok((Some(daemons), filesystems))
}

/// vhost-user-fs devices for the nested host; their backends map its RAM, so the RAM
/// becomes a shared memfd.
fn add_filesystems(command: &mut Command, filesystems: &[FsConfig], memory_mib: u64) {
    if filesystems.is_empty() {
        return;
    }
    command
        .arg("-object")
        .arg(format!(
            "memory-backend-memfd,id=ram,size={memory_mib}M,share=on"
        ))
        .args(["-M", "memory-backend=ram"]);
    for (index, fs) in filesystems.iter().enumerate() {
        command
            .arg("-chardev")
            .arg(format!(
                "socket,id=fs{index},path={}",
                qemu_option_path(&fs.socket_path)
            ))
            .arg("-device")
            .arg(format!(
                "vhost-user-fs-device,chardev=fs{index},tag={}",
                fs.tag
            ));
    }
}

/// The virtio-mmio transports of QEMU's microvm without ACPI (its `ioapic2` is off).
const MICROVM_TRANSPORTS: usize = 8;

/// The virtio-mmio devices `command` gives the nested host so far: each `-device` of a
/// `*-device` type (virtio-9p-device, vhost-user-fs-device, ...) takes a transport; a
/// port on virtio-serial (virtserialport) does not.
fn virtio_mmio_devices(command: &Command) -> usize {
    command
        .get_args()
        .zip(command.get_args().skip(1))
        .filter(|(option, value)| {
            *option == "-device"
                && value
                    .to_str()
                    .and_then(|value| value.split(',').next())
                    .is_some_and(|kind| kind.ends_with("-device"))
        })
        .count()
}

/// A virtio-balloon for free page reporting, when a transport is left after the
/// devices `command` has: the nested host's kernel then hands back to this host the
/// memory it frees, that of a guest's freed memory, which our VMM dropped, among it.
/// Without it the nested host holds its high-water mark until it stops.
fn add_free_page_reporting(command: &mut Command) {
    let devices = virtio_mmio_devices(command);
    if devices >= MICROVM_TRANSPORTS {
        tracing::info!(
            "the nested host has {devices} virtio devices, QEMU's microvm {MICROVM_TRANSPORTS}: \
             none is left for free page reporting, so the nested host keeps the memory its \
             guest frees until it stops"
        );
        return;
    }
    command
        .arg("-device")
        .arg("virtio-balloon-device,free-page-reporting=on");
}

fn find_qemu() -> Result<String, NestedError> {
    if let Some(qemu) = std::env::var_os(QEMU_ENV) {
        let qemu = PathBuf::from(qemu);
        return if qemu.is_file() {
            Ok(qemu.display().to_string())
        } else {
            Err(NestedError::QemuMissing(qemu.display().to_string()))
        };
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(QEMU_BINARY))
            .find(|candidate| candidate.is_file())
    });
    on_path
        .map(|p| p.display().to_string())
        .ok_or_else(|| NestedError::QemuMissing(QEMU_BINARY.into()))
}

/// Relays host connections on `host_vsock` to the VM's vsock inside the nested host:
/// QEMU connects the nested host's mux port to `mux_socket`, and every host client
/// becomes one stream of the multiplexed link. Runs on its own thread until the
/// process ends.
fn start_vsock_relay(
    mux_socket: &Path,
    host_vsock: &Path,
) -> Result<std::thread::JoinHandle<()>, NestedError> {
    let bind_error = |path: &Path| {
        let path = path.to_path_buf();
        move |source| NestedError::JobDir { path, source }
    };
    let _ = std::fs::remove_file(host_vsock);
    let mux_listener =
        std::os::unix::net::UnixListener::bind(mux_socket).map_err(bind_error(mux_socket))?;
    let client_listener =
        std::os::unix::net::UnixListener::bind(host_vsock).map_err(bind_error(host_vsock))?;
    for listener in [&mux_listener, &client_listener] {
        listener
            .set_nonblocking(true)
            .map_err(bind_error(mux_socket))?;
    }
    let host_vsock = host_vsock.to_path_buf();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(bind_error(mux_socket))?;
    Ok(std::thread::spawn(move || {
        runtime.block_on(async move {
            let (Ok(mux_listener), Ok(client_listener)) = (
                tokio::net::UnixListener::from_std(mux_listener),
                tokio::net::UnixListener::from_std(client_listener),
            ) else {
                tracing::error!("cannot serve the vsock relay sockets");
                return;
            };
            let Ok((link, _)) = mux_listener.accept().await else {
                tracing::error!("the nested host never connected its mux port");
                return;
            };
            let (reader, writer) = link.into_split();
            let opener = host_service_opener(host_vsock);
            let (mux, _link) = Mux::start(reader, writer, true, opener);
            loop {
                let client = crate::network::accept_again_and_again(
                    &client_listener,
                    "a connection to the nested VM's vsock",
                )
                .await;
                let mux = mux.clone();
                tokio::spawn(async move { mux.open(VSOCK_PORT, client).await });
            }
        });
    }))
}

/// Opens the nested guest's connections to the host: to port N goes to `<host
/// socket>_N`, as for a VM that runs directly. The host serves one port, and a nested
/// host the guest took over gets no other socket of the host's by naming a port.
fn host_service_opener(host_vsock: PathBuf) -> Opener {
    Arc::new(move |port| {
        let target = PathBuf::from(format!("{}_{port}", host_vsock.display()));
        Box::pin(async move {
            if port != guest_agent::protocol::HOST_SERVICE_PORT {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    format!("the host serves no vsock port {port}"),
                ));
            }
            tokio::net::UnixStream::connect(target).await
        })
    })
}

/// QEMU reads the guest console's input from stdin; a closed stdin would make it
/// reuse descriptor 0 for something else.
fn stdin_for_qemu() -> Stdio {
    // SAFETY: F_GETFD only queries descriptor flags.
    if unsafe { libc::fcntl(0, libc::F_GETFD) } >= 0 {
        Stdio::inherit()
    } else {
        Stdio::null()
    }
}

fn qemu_command(
    qemu: &str,
    kernel: &Path,
    vmctl: &Path,
    job_dir: &Path,
    stderr_socket: &Path,
    job: &NestedJob,
) -> Command {
    let mut command = Command::new(qemu);
    // QEMU reads none of the user's variables (the job carries what the nested host
    // needs), and holds none of their tokens.
    command.env_clear();
    let memory = job.host_memory_mib;
    let guest_job_spec = format!("{}/{}", job::GUEST_JOB_DIR, job::SPEC_FILE);
    let log_filter = std::env::var(LOG_ENV).ok();
    let extra = std::env::var(KERNEL_ARGS_ENV).ok();
    let tsc_khz = host_tsc_khz();
    if tsc_khz.is_none() {
        tracing::warn!("cannot read the host's TSC frequency; the nested host may hang");
    }
    if let Some(extra) = extra.as_deref().map(str::trim).filter(|e| !e.is_empty()) {
        tracing::info!("nested host kernel arguments added from {KERNEL_ARGS_ENV}: {extra}");
    }
    let cmdline = nested_kernel_cmdline(
        vmctl,
        &guest_job_spec,
        tsc_khz,
        extra.as_deref(),
        log_filter.as_deref(),
    );
    command
        .args([
            "-accel",
            "tcg",
            "-M",
            "microvm,acpi=off",
            "-cpu",
            "max,+svm,+npt",
        ])
        .args([
            "-m",
            &memory.to_string(),
            "-smp",
            &job.host_vcpus.to_string(),
        ])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        .arg("-kernel")
        .arg(kernel)
        .args(["-append", &cmdline])
        .args(["-serial", "stdio"]);
    // A monitor socket costs nothing and is the only way to look inside a nested host
    // that stopped making progress (`info lapic`, `info registers -a`, `info cpus`).
    command.arg("-monitor").arg(format!(
        "unix:{},server=on,wait=off",
        qemu_option_path(&job_dir.join(MONITOR_SOCKET))
    ));
    let mut share = |id: &str, path: &Path, tag: &str, read_only: bool| {
        command
            .arg("-fsdev")
            .arg(format!(
                "local,id={id},path={},security_model=none,multidevs=remap{}",
                qemu_option_path(path),
                if read_only { ",readonly=on" } else { "" }
            ))
            .arg("-device")
            .arg(format!("virtio-9p-device,fsdev={id},mount_tag={tag}"));
    };
    share("root", Path::new("/"), job::ROOT_TAG, true);
    share("job", job_dir, job::JOB_TAG, false);
    for (index, dir) in job.shared_dirs.iter().enumerate() {
        share(
            &format!("rw{index}"),
            &dir.path,
            &job::shared_dir_tag(index),
            dir.read_only,
        );
    }
    command
        .arg("-chardev")
        .arg(format!(
            "socket,id=vmmerr,path={}",
            qemu_option_path(stderr_socket)
        ))
        .args([
            "-device",
            "virtio-serial-device",
            "-device",
            "virtconsole,chardev=vmmerr",
        ]);
    command
}

/// The nested host kernel's command line. `extra` (from `VMCTL_NESTED_KERNEL_ARGS`)
/// comes after our own arguments, so a module parameter given there overrides ours.
fn nested_kernel_cmdline(
    vmctl: &Path,
    guest_job_spec: &str,
    tsc_khz: Option<u64>,
    extra: Option<&str>,
    log_filter: Option<&str>,
) -> String {
    // reboot=t: the nested host's init resets with a triple fault, and -no-reboot
    // turns that into QEMU exiting. Its kernel stays silent on our stdout (which is
    // the guest's console) unless debug logging is on or it oopses, and prints no
    // timestamps there, so that its lines are told from the guest kernel's (a crash
    // of its own is not reported as the guest's).
    let debug = log_filter.is_some_and(|f| f.contains("debug") || f.contains("trace"));
    let mut cmdline = format!(
        "console=ttyS0 loglevel={loglevel} printk.time=0 reboot=t panic=-1 \
         root={root} rootfstype=9p \
         rootflags=trans=virtio,version=9p2000.L,msize=262144,cache=loose ro \
         init={vmctl} {job_env}={guest_job_spec} {NESTED_KVM_ARGS}",
        job_env = job::JOB_ENV,
        loglevel = if debug { 7 } else { 0 },
        root = job::ROOT_TAG,
        vmctl = vmctl.display(),
    );
    // TCG's TSC is the host's, but the nested host's kernel cannot calibrate it under
    // emulation; without a TSC frequency its KVM never enters a guest (it keeps
    // retrying the guest's clock update). Tell it the host's frequency.
    if let Some(khz) = tsc_khz {
        cmdline.push_str(&format!(" tsc_early_khz={khz} tsc=reliable"));
    }
    if let Some(extra) = extra.map(str::trim).filter(|e| !e.is_empty()) {
        cmdline.push(' ');
        cmdline.push_str(extra);
    }
    // Logging settings travel as kernel arguments too (init gets them as environment).
    if let Some(filter) = log_filter {
        if !filter.is_empty() && filter.bytes().all(|b| b.is_ascii_graphic() && b != b'"') {
            cmdline.push_str(&format!(" {LOG_ENV}={filter}"));
        }
    }
    cmdline
}

/// The host's TSC frequency in kHz, from /proc/cpuinfo's "cpu MHz" (the TSC
/// frequency on x86 hosts with a constant TSC).
fn host_tsc_khz() -> Option<u64> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    parse_cpu_mhz(&cpuinfo).map(|mhz| (mhz * 1000.0).round() as u64)
}

fn parse_cpu_mhz(cpuinfo: &str) -> Option<f64> {
    let line = cpuinfo.lines().find(|l| l.starts_with("cpu MHz"))?;
    let mhz: f64 = line.split(':').nth(1)?.trim().parse().ok()?;
    (mhz > 0.0).then_some(mhz)
}

/// Copies what the nested VMM writes to its stderr (a virtio console in the nested
/// host, a Unix socket here) to our stderr.
fn relay_stderr(listener: UnixListener) {
    let Ok((mut stream, _)) = listener.accept() else {
        return;
    };
    let mut stderr = std::io::stderr();
    let mut buf = [0u8; 4096];
    while let Ok(n) = stream.read(&mut buf) {
        if n == 0 || stderr.write_all(&buf[..n]).is_err() {
            break;
        }
    }
}

/// Waits for QEMU; on SIGINT/SIGTERM/SIGHUP asks it to stop (QEMU then restores the
/// terminal), and kills it if it does not within two seconds. Kills it at once when
/// `watch` finds it stalled: nothing would come of it any more.
fn wait_or_stop(child: &mut Child, watch: &StallWatch) -> Option<std::process::ExitStatus> {
    let mut asked_at: Option<Instant> = None;
    let mut killed_for_stall = false;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) => {}
            Err(e) => {
                tracing::error!("cannot wait for QEMU: {e}");
                return None;
            }
        }
        if !killed_for_stall && watch.stall().is_some() {
            let _ = child.kill();
            killed_for_stall = true;
        }
        if STOP_SIGNAL.load(Ordering::SeqCst) != 0 {
            match asked_at {
                None => {
                    // SAFETY: kill(2) on our own child's pid, which has not been
                    // reaped yet (try_wait returned None), so it cannot be reused.
                    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                    asked_at = Some(Instant::now());
                }
                Some(at) if at.elapsed() > Duration::from_secs(2) => {
                    let _ = child.kill();
                }
                Some(_) => {}
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `path` as a QEMU option value: a comma there would end the value (QEMU escapes
/// one by doubling it), and a `$TMPDIR` may hold one.
fn qemu_option_path(path: &Path) -> String {
    path.display().to_string().replace(',', ",,")
}

#[cfg(test)]
mod tests {

    #[test]
    fn commas_in_a_path_are_doubled_for_qemu() {
        assert_eq!(
            qemu_option_path(Path::new("/tmp/a,b/m.sock")),
            "/tmp/a,,b/m.sock"
        );
        assert_eq!(qemu_option_path(Path::new("/plain")), "/plain");
    }
    use super::*;
    use crate::nested::stall::Stuck;

    /// The balloon takes a transport only while one is left; a virtserialport is a
    /// port on virtio-serial, not a transport.
    #[test]
    fn the_balloon_comes_while_a_virtio_transport_is_left() {
        let balloons = |command: &Command| {
            command
                .get_args()
                .filter(|arg| {
                    arg.to_str()
                        .is_some_and(|a| a.starts_with("virtio-balloon"))
                })
                .count()
        };
        let mut command = Command::new("qemu");
        command.args([
            "-device",
            "virtio-serial-device",
            "-device",
            "virtconsole,chardev=e",
        ]);
        for index in 0..6 {
            command.args(["-device", &format!("virtio-9p-device,fsdev=rw{index}")]);
        }
        command.args(["-device", "virtserialport,chardev=mux"]);
        assert_eq!(virtio_mmio_devices(&command), 7);
        add_free_page_reporting(&mut command);
        assert_eq!(balloons(&command), 1);
        assert_eq!(virtio_mmio_devices(&command), 8);
        add_free_page_reporting(&mut command);
        assert_eq!(
            balloons(&command),
            1,
            "no transport was left for a second one"
        );
    }

    #[test]
    fn the_nested_host_kernel_given_is_used_without_a_build() {
        let given = Path::new("/cache/nested-host/vmlinux");
        let kernel = host_kernel(Some(given), |artifact| {
            panic!("{artifact:?} built though given")
        });
        assert_eq!(kernel.unwrap(), given);
        // None given (`vmctl boot`, `vmctl nested-exec`): built or found here.
        let kernel = host_kernel(None, |artifact| {
            assert!(
                matches!(artifact, Artifact::NestedHostKernel),
                "{artifact:?}"
            );
            Ok(PathBuf::from("/built/vmlinux"))
        });
        assert_eq!(kernel.unwrap(), Path::new("/built/vmlinux"));
    }

    const ACCEPT_ERROR_CHILD: &str = "VMCTL_TEST_ACCEPT_ERROR_CHILD";

    /// A failed accept (out of descriptors: a nested host the guest took over can
    /// open streams until then) does not end the relay of the nested VM's vsock:
    /// once descriptors are free again, `vmctl exec` reaches the VM. Run in a process
    /// of its own, whose descriptor limit it lowers.
    #[test]
    fn an_accept_error_does_not_end_the_vsock_relay() {
        if std::env::var_os(ACCEPT_ERROR_CHILD).is_some() {
            return accept_error_scenario();
        }
        let output = {
            let _forking = crate::state::no_forks_meanwhile();
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "nested::launcher::tests::an_accept_error_does_not_end_the_vsock_relay",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(ACCEPT_ERROR_CHILD, "1")
                .output()
                .unwrap()
        };
        let report = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && report.contains("1 passed"),
            "the scenario failed in its own process: {report}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    fn accept_error_scenario() {
        use std::io::Read;
        let dir = tempfile::tempdir().unwrap();
        let mux_socket = dir.path().join("mux.sock");
        let host_vsock = dir.path().join("vsock.sock");
        let _relay = start_vsock_relay(&mux_socket, &host_vsock).unwrap();
        let mut link = std::os::unix::net::UnixStream::connect(&mux_socket).unwrap();
        link.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        // A host client's connection becomes a frame on the link: the relay works.
        let next_frame = |link: &mut std::os::unix::net::UnixStream| {
            let mut header = [0u8; 4];
            link.read_exact(&mut header)?;
            let mut payload = vec![0u8; u32::from_le_bytes(header) as usize];
            link.read_exact(&mut payload)
        };
        let _before = std::os::unix::net::UnixStream::connect(&host_vsock).unwrap();
        next_frame(&mut link).expect("the relay works at first");
        let open_now = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        // SAFETY: plain libc calls on a local struct; this process is the test's own.
        unsafe {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
            limit.rlim_cur = open_now + 32;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
        let mut filler = Vec::new();
        while let Ok(file) = std::fs::File::open("/dev/null") {
            filler.push(file);
        }
        // Room for the client's own socket, none for the relay's accept.
        filler.pop();
        let _refused = std::os::unix::net::UnixStream::connect(&host_vsock).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(500));
        drop(filler);
        let _after = std::os::unix::net::UnixStream::connect(&host_vsock)
            .expect("the relay no longer listens for host clients (vmctl exec)");
        next_frame(&mut link).expect("no frame for a host client: the relay stopped serving");
    }

    #[test]
    fn job_dirs_of_launchers_that_are_gone_are_removed() {
        let base = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = child.id();
        child.wait().unwrap();
        let dir = |name: String| {
            let path = base.path().join(name);
            std::fs::create_dir(&path).unwrap();
            std::fs::write(path.join("spec"), "job").unwrap();
            path
        };
        let stale = dir(format!("{JOB_DIR_PREFIX}{dead_pid}-12"));
        let live = dir(format!("{JOB_DIR_PREFIX}{}-34", std::process::id()));
        let other = dir(format!("vmctl-other-{dead_pid}-56"));
        // A launcher in another PID namespace: its pid means nothing here, its lock does.
        let elsewhere = dir(format!("{JOB_DIR_PREFIX}{dead_pid}-78"));
        let _held = crate::state::lock_file(&elsewhere.join(JOB_DIR_LOCK)).unwrap();
        let released = dir(format!("{JOB_DIR_PREFIX}{}-90", std::process::id()));
        drop(crate::state::lock_file(&released.join(JOB_DIR_LOCK)).unwrap());
        remove_stale_job_dirs(base.path());
        assert!(
            elsewhere.join("spec").exists(),
            "a launcher holding its lock keeps it"
        );
        assert!(!released.exists(), "a lock nobody holds is a launcher gone");
        assert!(!stale.exists(), "the dead launcher's directory is removed");
        assert!(live.join("spec").exists(), "a running launcher's stays");
        assert!(other.exists(), "what is not a job directory stays");
    }

    /// A nested host asks for host vsock ports: the host services' one is connected,
    /// any other refused, even where a socket (or a link to one) waits under its name.
    #[tokio::test]
    async fn a_nested_host_reaches_the_host_service_port_alone() {
        let dir = tempfile::tempdir().unwrap();
        let host_vsock = dir.path().join("vsock.sock");
        let service = format!(
            "{}_{}",
            host_vsock.display(),
            guest_agent::protocol::HOST_SERVICE_PORT
        );
        let other = format!("{}_77", host_vsock.display());
        let _service = tokio::net::UnixListener::bind(&service).unwrap();
        let _other = tokio::net::UnixListener::bind(&other).unwrap();
        let open = host_service_opener(host_vsock);
        assert!(open(guest_agent::protocol::HOST_SERVICE_PORT).await.is_ok());
        let refused = open(77).await.unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    }

    #[test]
    fn the_nested_host_uses_shadow_paging_unless_told_otherwise() {
        let vmctl = Path::new("/usr/bin/vmctl");
        let default = nested_kernel_cmdline(vmctl, "/job/spec", Some(2_000_000), None, None);
        assert!(default.contains(" kvm_amd.npt=0"), "{default}");
        assert!(default.contains("init=/usr/bin/vmctl "), "{default}");
        assert!(
            default.ends_with(" tsc_early_khz=2000000 tsc=reliable"),
            "{default}"
        );
        // The last value of a built-in module's parameter wins.
        let told = nested_kernel_cmdline(vmctl, "/job/spec", None, Some(" kvm_amd.npt=1 "), None);
        let on = told.find("kvm_amd.npt=1").expect("the override is passed");
        let off = told.find("kvm_amd.npt=0").expect("the default is kept");
        assert!(on > off, "{told}");
        assert!(!told.contains("tsc_early_khz"), "{told}");
    }

    #[test]
    fn a_stall_says_what_stalled_and_how_to_keep_one_for_a_look() {
        for stuck in [
            Stuck::Halted {
                pending: vec![236, 251],
            },
            Stuck::Spinning {
                rip: 0xffff_ffff_8158_9223,
            },
        ] {
            let stall = Stall {
                cpu: 0,
                stuck,
                seconds: 20,
            };
            let said = NestedError::Stalled(stall).to_string();
            // What the VM tests and `vmctl exec` users recognise a lost VM by.
            assert!(
                said.starts_with("the nested host stalled, so vmctl stopped it: its vCPU 0 s"),
                "{said}"
            );
            assert!(said.contains("run it again"), "{said}");
            assert!(said.contains("VMCTL_NESTED_STALL_WATCH=off"), "{said}");
        }
    }

    #[test]
    fn a_silent_exit_without_the_vms_status_is_named_a_reset_of_the_nested_host() {
        use std::os::unix::process::ExitStatusExt;
        let exited = |code: i32| Some(std::process::ExitStatus::from_raw(code << 8));
        let reset = died_early(exited(0), " \n").to_string();
        assert!(reset.contains("it reset without a word"), "{reset}");
        // What the VM tests and the benchmark recognise as a lost VM.
        assert!(
            reset.starts_with("the nested host stopped before the VM finished"),
            "{reset}"
        );
        let lines: String = (1..=7).map(|n| format!("line {n}\n")).collect();
        let failed = died_early(exited(1), &lines).to_string();
        assert!(failed.contains("exit status: 1"), "{failed}");
        assert!(
            failed.ends_with("QEMU said: line 3 | line 4 | line 5 | line 6 | line 7"),
            "{failed}"
        );
        let said = died_early(exited(0), "qemu: terminating on signal 15").to_string();
        assert!(!said.contains("reset without a word"), "{said}");
        let vanished = died_early(None, "").to_string();
        assert!(vanished.contains("(QEMU did not exit)"), "{vanished}");
        assert!(
            vanished.contains("rerun with VMCTL_LOG=debug"),
            "{vanished}"
        );
    }

    #[test]
    fn the_nested_hosts_kernel_prints_no_timestamps() {
        // What tells its lines on the guest's console from the guest kernel's.
        let cmdline = nested_kernel_cmdline(Path::new("/v"), "/j", None, None, Some("debug"));
        assert!(cmdline.contains(" printk.time=0 "), "{cmdline}");
    }

    #[test]
    fn passes_the_log_filter_only_when_it_is_a_plain_word() {
        let vmctl = Path::new("/usr/bin/vmctl");
        let debug = nested_kernel_cmdline(vmctl, "/j", None, None, Some("vmm=debug"));
        assert!(
            debug.contains("loglevel=7") && debug.ends_with(" VMCTL_LOG=vmm=debug"),
            "{debug}"
        );
        let quoted = nested_kernel_cmdline(vmctl, "/j", None, None, Some("a\"b"));
        assert!(
            quoted.contains("loglevel=0") && !quoted.contains("VMCTL_LOG"),
            "{quoted}"
        );
    }

    #[test]
    fn reads_the_cpu_frequency() {
        let cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu MHz\t\t: 2100.000\n";
        assert_eq!(parse_cpu_mhz(cpuinfo), Some(2100.0));
        assert_eq!(parse_cpu_mhz("cpu MHz : 0\n"), None);
        assert_eq!(parse_cpu_mhz("nothing"), None);
    }
}
