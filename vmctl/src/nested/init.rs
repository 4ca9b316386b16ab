//! vmctl as PID 1 of the nested host. Mounts what the VMM needs, runs
//! the VM described by the job file, writes the exit status back to the job directory
//! and resets the nested host (which ends QEMU).

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use std::os::unix::process::ExitStatusExt;

use super::job::{self, CommandJob, NestedJob, NestedStatus, VmJob, Work};
use super::mux::{Mux, Opener, VSOCK_PORT};
use crate::terminal;
use std::sync::Arc;
use vmm::process::VCPU_CPUS_ENV;

#[derive(Debug, thiserror::Error)]
pub enum NestedInitError {
    #[error("the nested-host mode only runs as the nested host's init (PID 1)")]
    NotInit,
    #[error("cannot mount {what} on {target}: {source}")]
    Mount {
        what: String,
        target: String,
        source: std::io::Error,
    },
    #[error("cannot read the job file {path}: {reason}")]
    Job { path: String, reason: String },
}

/// The job file, when this process is the nested host's init.
pub fn job_from_environment() -> Option<PathBuf> {
    if std::process::id() != 1 {
        return None;
    }
    std::env::var_os(job::JOB_ENV).map(PathBuf::from)
}

pub fn run(spec: &Path) -> Result<u8, NestedInitError> {
    if std::process::id() != 1 {
        return Err(NestedInitError::NotInit);
    }
    crate::supervisor::raise_open_files_limit();
    let exit_code = match prepare_and_run(spec) {
        Ok(code) => code,
        Err(message) => {
            vmm::to_stderr!("vmctl: error: {message}");
            1
        }
    };
    let status = NestedStatus { exit_code };
    let status_path = Path::new(job::GUEST_JOB_DIR).join(job::STATUS_FILE);
    if let Ok(text) = serde_json::to_vec(&status) {
        if let Err(e) = std::fs::write(&status_path, text) {
            vmm::to_stderr!("vmctl: error: cannot write {}: {e}", status_path.display());
        }
    }
    // Let the consoles drain before the reset cuts them off.
    // SAFETY: tcdrain and sync have no memory-safety preconditions.
    unsafe {
        libc::tcdrain(1);
        libc::tcdrain(2);
        libc::sync();
        libc::reboot(libc::RB_AUTOBOOT);
    }
    // PID 1 must never exit (the kernel would panic); the reset above ends us.
    loop {
        // SAFETY: pause has no preconditions.
        unsafe { libc::pause() };
    }
}

fn prepare_and_run(spec: &Path) -> Result<u8, String> {
    tracing::debug!("nested host: mounting /proc, /sys, /dev, /run and the job directory");
    mount_basics().map_err(|e| e.to_string())?;
    report_smaller_free_blocks();
    if let Err(e) = set_clock_from_host() {
        vmm::to_stderr!("vmctl: warning: cannot set the nested host's clock from the host's: {e}; the guest's clock may lag the host's by a second or more");
    }
    // Commands run here (benchmarks, `vmctl` itself with its relays and egress
    // proxy) need 127.0.0.1.
    if let Err(e) = guest_agent::init::loopback_up() {
        vmm::to_stderr!("vmctl: warning: the nested host has no loopback interface: {e}");
    }
    tracing::debug!("nested host: sending stderr to the host");
    redirect_stderr_to_host();
    // The console carries the guest's serial bytes to the host's stdout unchanged.
    if let Err(e) = terminal::make_raw(&std::io::stdout()) {
        vmm::to_stderr!("vmctl: warning: cannot put the nested console in raw mode: {e}");
    }
    let job = read_job(spec).map_err(|e| e.to_string())?;
    tracing::debug!("nested host: running {job:?}");
    if matches!(job.work, Work::Command(_)) {
        writable_tmp().map_err(|e| e.to_string())?;
    }
    for (index, dir) in job.shared_dirs.iter().enumerate() {
        // A directory under the scratch /tmp must be recreated to mount on; elsewhere
        // it exists already on the read-only root.
        let _ = std::fs::create_dir_all(&dir.path);
        mount_9p(&job::shared_dir_tag(index), &dir.path, dir.read_only)
            .map_err(|e| e.to_string())?;
    }
    for dir in &job.fs_dirs {
        let share = guest_agent::shares::ShareMount {
            tag: dir.tag.clone(),
            path: dir.path.clone(),
            read_only: dir.read_only,
        };
        // The nested host has no user of its own: its directories are root's.
        guest_agent::shares::mount_share(&share, None).map_err(|e| e.to_string())?;
    }
    let guest_cpus =
        vcpu_cpus_off_cpu_0(std::thread::available_parallelism().map_or(1, usize::from));
    if let Work::Vm(vm) = &job.work {
        // Before this process starts any thread: the VMM, its child, inherits them.
        // (The host's VMCTL_VCPU_CPUS is never among them: job::vmm_env.)
        for (name, value) in &vm.vmm_env {
            std::env::set_var(name, value);
        }
        if let Some(cpus) = &guest_cpus {
            std::env::set_var(VCPU_CPUS_ENV, cpus);
        }
    }
    match &job.work {
        Work::Vm(vm) if vm.vsock => run_vmm_with_relay(vm),
        Work::Vm(vm) => {
            std::fs::create_dir_all(SHARE_SOCKET_DIR)
                .map_err(|e| format!("{SHARE_SOCKET_DIR}: {e}"))?;
            crate::vmm_process::run_with_shares(
                &vm.vm_config(),
                vm.shares.as_ref(),
                Path::new(SHARE_SOCKET_DIR),
                Path::new(SHARE_SOCKET_DIR),
                vm.report_boot_time,
            )
            .map_err(|e| e.to_string())
        }
        Work::Command(command) => {
            // Every VMM the command starts inherits it (the host's is never in the
            // job: job::command_env).
            let mut command = command.clone();
            if let Some(cpus) = guest_cpus {
                command.env.push((VCPU_CPUS_ENV.to_string(), cpus));
            }
            run_command(&command)
        }
    }
}

/// The sysfs knob of the smallest free block Linux reports to a free page reporting
/// device (as a buddy order), and what the nested host sets it to.
const PAGE_REPORTING_ORDER: &str = "/sys/module/page_reporting/parameters/page_reporting_order";
const NESTED_PAGE_REPORTING_ORDER: &str = "6";

/// Has the nested host's kernel report free blocks of 256 KiB, not its default 4 MiB
/// (its pageblock order; Linux 6.1 overrides a command-line value when the balloon
/// registers, so it is set here): the guest memory our VMM gives back leaves one page
/// in use in every 4 MiB block here (KVM's), so none of it would ever be reported to
/// QEMU, and the host would keep the nested host's high-water mark (seen in
/// /proc/buddyinfo: 1 GiB free, none of it in 4 MiB blocks). With 256 KiB blocks some
/// 94% of it comes back.
fn report_smaller_free_blocks() {
    if let Err(e) = std::fs::write(PAGE_REPORTING_ORDER, NESTED_PAGE_REPORTING_ORDER) {
        tracing::debug!("nested host: cannot set {PAGE_REPORTING_ORDER}: {e}");
    }
}

/// The vCPU threads' CPUs for the VMMs of this nested host of `host_cpus` CPUs: every
/// CPU but 0 (a command may still set `VMCTL_VCPU_CPUS` for what it starts). While a
/// guest runs on the nested host's CPU 0, the emulation now and then stops delivering
/// that CPU's interrupts, or delivers one while its interrupts are disabled, and the
/// nested host hangs for good; with no guest there, neither was seen
/// (docs/nested-host.md).
fn vcpu_cpus_off_cpu_0(host_cpus: usize) -> Option<String> {
    (host_cpus >= 2).then(|| format!("1-{}", host_cpus - 1))
}

/// Where the virtiofsd daemons of the VM's shares listen, inside the nested host.
const SHARE_SOCKET_DIR: &str = "/run/vmctl";

/// Runs the VMM on its own thread while this one relays the host's connections from
/// the mux port to the VM's hybrid-vsock socket.
fn run_vmm_with_relay(vm: &VmJob) -> Result<u8, String> {
    let vsock_dir = Path::new(job::GUEST_VSOCK_SOCKET)
        .parent()
        .unwrap_or(Path::new(SHARE_SOCKET_DIR));
    std::fs::create_dir_all(vsock_dir).map_err(|e| format!("{}: {e}", vsock_dir.display()))?;
    let port = find_virtio_port(job::MUX_PORT_NAME)?;
    let config = vm.vm_config();
    let report_boot_time = vm.report_boot_time;
    let shares = vm.shares.clone();
    // The VMM's thread also starts the virtiofsd daemons, which die with their
    // parent thread.
    let vmm = std::thread::spawn(move || {
        crate::vmm_process::run_with_shares(
            &config,
            shares.as_ref(),
            Path::new(SHARE_SOCKET_DIR),
            Path::new(SHARE_SOCKET_DIR),
            report_boot_time,
        )
        .map_err(|e| e.to_string())
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the relay: {e}"))?;
    // The current-thread runtime only runs while blocked on: serve the link until
    // the VMM's thread ends.
    let outcome = runtime.block_on(async {
        let reader = std::fs::File::options()
            .read(true)
            .write(true)
            .open(&port)
            .map_err(|e| format!("{}: {e}", port.display()))?;
        let writer = reader
            .try_clone()
            .map_err(|e| format!("{}: {e}", port.display()))?;
        let opener: Opener = Arc::new(|port| {
            Box::pin(async move {
                if port == VSOCK_PORT {
                    tokio::net::UnixStream::connect(job::GUEST_VSOCK_SOCKET).await
                } else {
                    Err(std::io::ErrorKind::ConnectionRefused.into())
                }
            })
        });
        let (mux, _link) = Mux::start(
            tokio::fs::File::from_std(reader),
            tokio::fs::File::from_std(writer),
            false,
            opener,
        );
        forward_guest_connections_to_host(mux)?;
        tokio::task::spawn_blocking(move || vmm.join())
            .await
            .map_err(|_| "the VMM thread was lost".to_string())?
            .map_err(|_| "the VMM thread panicked".to_string())?
    });
    // A read of the mux port may still be pending on a blocking thread: do not wait
    // for it (a plain drop would, forever).
    runtime.shutdown_background();
    outcome
}

/// The guest's connections to the host's service port arrive at the VMM's
/// `<vsock>_<port>` socket here in the nested host: each becomes a stream of the mux,
/// which the host side connects to the same socket name beside the VM's host vsock.
fn forward_guest_connections_to_host(mux: Arc<Mux>) -> Result<(), String> {
    let path = crate::network::services::service_socket(Path::new(job::GUEST_VSOCK_SOCKET));
    let _ = std::fs::remove_file(&path);
    let listener = tokio::net::UnixListener::bind(&path)
        .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    tokio::spawn(async move {
        loop {
            let stream = crate::network::accept_again_and_again(
                &listener,
                "a guest connection to the host's services",
            )
            .await;
            let mux = mux.clone();
            tokio::spawn(async move {
                mux.open(guest_agent::protocol::HOST_SERVICE_PORT, stream)
                    .await
            });
        }
    });
    Ok(())
}

/// The device node of the virtio-serial port called `name` (no udev here, so look it
/// up in sysfs).
fn find_virtio_port(name: &str) -> Result<PathBuf, String> {
    let ports = std::fs::read_dir("/sys/class/virtio-ports")
        .map_err(|e| format!("no virtio ports in the nested host: {e}"))?;
    for port in ports.flatten() {
        let port_name = std::fs::read_to_string(port.path().join("name")).unwrap_or_default();
        if port_name.trim() == name {
            return Ok(Path::new("/dev").join(port.file_name()));
        }
    }
    Err(format!("the nested host has no virtio port named {name}"))
}

/// Runs the command with our stdout (the host's stdout) and stderr (the host's
/// stderr), and returns its exit code (128 + signal when it was killed).
fn run_command(command: &CommandJob) -> Result<u8, String> {
    let (program, args) = command
        .argv
        .split_first()
        .ok_or_else(|| "the nested command is empty".to_string())?;
    let status = std::process::Command::new(program)
        .args(args)
        .env_clear()
        .envs(command.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&command.cwd)
        .stdin(std::process::Stdio::null())
        .status()
        .map_err(|e| format!("cannot run {program} in the nested host: {e}"))?;
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => code.clamp(0, 255) as u8,
        (None, Some(signal)) => 128u8.saturating_add(signal as u8),
        (None, None) => 1,
    })
}

fn mount_basics() -> Result<(), NestedInitError> {
    mount("proc", "/proc", "proc", 0, "")?;
    mount("sysfs", "/sys", "sysfs", 0, "")?;
    // The kernel may have mounted devtmpfs already (DEVTMPFS_MOUNT).
    match mount("devtmpfs", "/dev", "devtmpfs", 0, "") {
        Err(NestedInitError::Mount { source, .. })
            if source.raw_os_error() == Some(libc::EBUSY) => {}
        other => other?,
    }
    mount("tmpfs", "/run", "tmpfs", 0, "mode=0755")?;
    std::fs::create_dir_all(job::GUEST_JOB_DIR).map_err(|source| NestedInitError::Mount {
        what: job::JOB_TAG.into(),
        target: job::GUEST_JOB_DIR.into(),
        source,
    })?;
    mount_9p(job::JOB_TAG, Path::new(job::GUEST_JOB_DIR), false)
}

/// Sets this nested host's wall clock to the host's. It starts from the emulated RTC,
/// whole seconds read during boot, so it lags the host by up to a second or two; the
/// guest's kvmclock inherits the lag, while the files it writes through virtiofsd get
/// the host's time: `make` and `ls` would see them in the future. A file created in
/// the job directory (9p) gets its mtime from the host's clock, which is the clock to
/// take; half the round trip is added for the time the answer took.
fn set_clock_from_host() -> std::io::Result<()> {
    let probe = Path::new(job::GUEST_JOB_DIR).join(".clock");
    let sent = Instant::now();
    File::create(&probe)?;
    let host_time = std::fs::metadata(&probe)?.modified()?;
    let now = host_time + sent.elapsed() / 2;
    let _ = std::fs::remove_file(&probe);
    let since_epoch = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| std::io::Error::other(format!("the host's clock is before 1970: {e}")))?;
    let before = std::time::SystemTime::now();
    let time = libc::timespec {
        tv_sec: since_epoch.as_secs() as libc::time_t,
        tv_nsec: since_epoch.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `time` is a valid timespec that outlives the call.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &time) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let step_ms = match now.duration_since(before) {
        Ok(ahead) => ahead.as_secs_f64() * 1e3,
        Err(behind) => -behind.duration().as_secs_f64() * 1e3,
    };
    tracing::debug!("nested host: clock stepped by {step_ms:.1} ms to the host's");
    Ok(())
}

/// Commands get a writable /tmp that still shows the host's (read-only) /tmp, where
/// their binaries, working directory or inputs may live: an overlay with a tmpfs upper
/// layer. Writes stay in the nested host.
fn writable_tmp() -> Result<(), NestedInitError> {
    const SCRATCH: &str = "/run/vmctl-tmp";
    let error = |source| NestedInitError::Mount {
        what: "scratch directories".into(),
        target: SCRATCH.into(),
        source,
    };
    for dir in ["upper", "work"] {
        std::fs::create_dir_all(Path::new(SCRATCH).join(dir)).map_err(error)?;
    }
    std::fs::set_permissions(
        Path::new(SCRATCH).join("upper"),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .map_err(error)?;
    mount(
        "overlay",
        "/tmp",
        "overlay",
        0,
        &format!("lowerdir=/tmp,upperdir={SCRATCH}/upper,workdir={SCRATCH}/work"),
    )
}

fn mount_9p(tag: &str, target: &Path, read_only: bool) -> Result<(), NestedInitError> {
    let flags = if read_only { libc::MS_RDONLY } else { 0 };
    mount(
        tag,
        &target.display().to_string(),
        "9p",
        flags,
        "trans=virtio,version=9p2000.L,msize=262144",
    )
}

fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), NestedInitError> {
    let error = |source_err: std::io::Error| NestedInitError::Mount {
        what: format!("{fstype} ({source})"),
        target: target.into(),
        source: source_err,
    };
    let invalid = || error(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    let c_source = CString::new(source).map_err(|_| invalid())?;
    let c_target = CString::new(target).map_err(|_| invalid())?;
    let c_fstype = CString::new(fstype).map_err(|_| invalid())?;
    let c_data = CString::new(data).map_err(|_| invalid())?;
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c_source.as_ptr(),
            c_target.as_ptr(),
            c_fstype.as_ptr(),
            flags,
            c_data.as_ptr().cast(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(error(std::io::Error::last_os_error()))
    }
}

/// The VMM's stderr goes to the nested host's virtio console, which the outer vmctl
/// copies to the host's stderr; its stdout (the guest's serial console) stays on the
/// nested host's serial console, which QEMU puts on the host's stdout.
fn redirect_stderr_to_host() {
    match File::options().write(true).open("/dev/hvc0") {
        Ok(console) => {
            // SAFETY: both descriptors are valid; dup2 atomically replaces fd 2.
            unsafe { libc::dup2(console.as_raw_fd(), 2) };
        }
        Err(e) => vmm::to_stderr!("vmctl: warning: no stderr channel to the host (/dev/hvc0: {e})"),
    }
}

fn read_job(spec: &Path) -> Result<NestedJob, NestedInitError> {
    let error = |reason: String| NestedInitError::Job {
        path: spec.display().to_string(),
        reason,
    };
    let text = std::fs::read(spec).map_err(|e| error(e.to_string()))?;
    serde_json::from_slice(&text).map_err(|e| error(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_runs_on_every_cpu_of_the_nested_host_but_0() {
        assert_eq!(vcpu_cpus_off_cpu_0(3).as_deref(), Some("1-2"));
        assert_eq!(vcpu_cpus_off_cpu_0(2).as_deref(), Some("1-1"));
        assert_eq!(vcpu_cpus_off_cpu_0(1), None, "CPU 0 is all there is");
    }
}
