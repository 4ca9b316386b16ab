//! The workspace-VM figures: how long `vmctl up` takes until the guest agent answers,
//! the latency of running `true` through the agent (Rust client and CLI), and the
//! agent's memory. There is no QEMU peer for these: no comparable figure.
//!
//! Every VM lives under a temporary `XDG_STATE_HOME` (the user's VMs are never
//! touched) and is removed with `vmctl rm`, also when a step fails.

use crate::boot::{say, warm_page_cache, TempDir};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use guest_agent::client::connect_hybrid;
use guest_agent::protocol::{ExecRequest, HealthInfo};

use crate::process::{run_command, Ran};
use crate::report::{BootConfig, Figure, ReadyRun, WorkspaceConfig, WorkspaceReport, OURS};
use crate::scan::tail;
use crate::stats::ms;

/// The vsock port the guest agent listens on.
pub const AGENT_PORT: u32 = 1024;
/// A workspace VM's hybrid-vsock socket in its state directory, where a record of an
/// older vmctl (without `vsock_socket`) has it.
const VSOCK_SOCKET: &str = "vsock/vsock.sock";

/// The VM's hybrid-vsock socket as its record says: vmctl moves it out of the VM's
/// directory when that makes its path too long for a Unix socket (a long TMPDIR).
fn vsock_socket_of(vm_dir: &Path, record: &serde_json::Value) -> PathBuf {
    record["vsock_socket"]
        .as_str()
        .map_or_else(|| vm_dir.join(VSOCK_SOCKET), PathBuf::from)
}
/// Targets on hardware KVM (the project's goals), printed beside the figures.
pub const AGENT_READY_TARGET_MS: f64 = 250.0;
pub const EXEC_ROUND_TRIP_TARGET_MS: f64 = 2.0;
/// The workspace VM's size in this section and the virtio-fs one (and the guest of the
/// virtio-fs comparison by VMM), set by their own vmctl config file: vmctl's default
/// would size it by the host (every CPU, 10% of RAM).
pub const WORKSPACE_VM: BootConfig = BootConfig::new(2, 1024);
/// Client round trips run, unmeasured, before the measured ones (the first `true`
/// is read from the root image; later ones come from the guest's page cache).
pub const EXEC_WARMUP: usize = 3;

pub const NOTE: &str = "No QEMU peer: no comparable figure (QEMU has no workspace VM or guest \
agent of ours).";

/// What to measure and with what.
#[derive(Debug, Clone)]
pub struct WorkspaceBench {
    /// vmctl and the guest it boots.
    pub artifacts: GuestArtifacts,
    pub ready_runs: usize,
    pub exec_iterations: usize,
    pub cli_iterations: usize,
    /// For each `vmctl` command and each client round trip.
    pub timeout: Duration,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The vmctl a section runs, and the guest it points vmctl at.
#[derive(Debug, Clone)]
pub struct GuestArtifacts {
    pub vmctl: PathBuf,
    pub kernel: PathBuf,
    pub agent_initramfs: PathBuf,
    pub rootfs: PathBuf,
}

impl GuestArtifacts {
    /// The guest artifacts as vmctl's variables.
    fn vars(&self) -> [(&'static str, &Path); 3] {
        [
            ("VMCTL_KERNEL", &self.kernel),
            ("VMCTL_AGENT_INITRAMFS", &self.agent_initramfs),
            ("VMCTL_ROOTFS", &self.rootfs),
        ]
    }
}

/// The vmctl config that gives every new VM exactly `size` (and keeps it up until the
/// benchmark removes it). Nothing else: the user's config (size, mounts, ports) is not
/// read by a vmctl pointed at this one.
pub(crate) fn vmctl_config_toml(size: BootConfig) -> String {
    format!(
        "cpus = {}\nmemory_percent = 0\nmemory_min_mib = {}\nidle_timeout_s = 3600\n",
        size.vcpus, size.memory_mib
    )
}

/// Writes [`vmctl_config_toml`] to `dir/config/config.toml` and returns its path: a
/// directory beside the workspaces, not around them, as vmctl shares no directory
/// that holds its config (and the secrets beside it).
pub(crate) fn write_vmctl_config(dir: &Path, size: BootConfig) -> Result<PathBuf, String> {
    let config_dir = dir.join("config");
    let file = config_dir.join("config.toml");
    fs::create_dir_all(&config_dir)
        .and_then(|()| fs::write(&file, vmctl_config_toml(size)))
        .map_err(|e| format!("write {}: {e}", file.display()))?;
    Ok(file)
}

/// `vmctl` with the benchmark's state directory and artifacts; remembers every
/// workspace it started and removes the ones still there when dropped.
pub(crate) struct Vmctl {
    pub(crate) bin: PathBuf,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) state: PathBuf,
    pub(crate) timeout: Duration,
    pub(crate) live: Vec<PathBuf>,
}

impl Vmctl {
    /// `artifacts.vmctl` with its own state directory (`XDG_STATE_HOME`), pointed at
    /// the guest artifacts and, when given, its own config file (`VMCTL_CONFIG`).
    pub(crate) fn new(
        artifacts: &GuestArtifacts,
        state: PathBuf,
        config: Option<&Path>,
        timeout: Duration,
    ) -> Vmctl {
        let mut vars = vec![("XDG_STATE_HOME", state.as_path())];
        vars.extend(config.map(|c| ("VMCTL_CONFIG", c)));
        vars.extend(artifacts.vars());
        let env = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.display().to_string()))
            .collect();
        Vmctl {
            bin: artifacts.vmctl.clone(),
            env,
            state,
            timeout,
            live: Vec::new(),
        }
    }

    pub(crate) fn argv(&self, args: &[&str], dir: &Path) -> Vec<String> {
        let mut v = vec![self.bin.display().to_string()];
        v.extend(args.iter().map(|a| a.to_string()));
        v.push(dir.display().to_string());
        v
    }

    /// Runs `vmctl ARGS`, waits (at most the timeout, then kills it) and times it
    /// from spawn to exit.
    pub(crate) fn run(&self, argv: &[String]) -> Result<Ran, String> {
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        run_command(cmd, &argv.join(" "), self.timeout, false)
    }

    /// Runs `vmctl ARGS` and requires exit 0; the error carries its output and the
    /// VMs' logs.
    pub(crate) fn run_ok(&self, argv: &[String]) -> Result<Ran, String> {
        let ran = self.run(argv).map_err(|e| format!("{e}{}", self.logs()))?;
        if !ran.status.success() {
            return Err(format!(
                "{} failed ({})\n--- stdout (tail) ---\n{}\n--- stderr (tail) ---\n{}{}",
                argv.join(" "),
                ran.status,
                tail(&ran.stdout, 2000),
                tail(&ran.stderr, 3000),
                self.logs()
            ));
        }
        Ok(ran)
    }

    pub(crate) fn vms_dir(&self) -> PathBuf {
        self.state.join("vmctl").join("vms")
    }

    /// The tails of every VM's console and supervisor logs, for error messages.
    pub(crate) fn logs(&self) -> String {
        let mut s = String::new();
        let mut dirs: Vec<PathBuf> = fs::read_dir(self.vms_dir())
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        dirs.sort();
        for dir in dirs {
            for log in ["supervisor.log", "console.log"] {
                let path = dir.join(log);
                if let Ok(text) = fs::read_to_string(&path) {
                    s.push_str(&format!(
                        "\n--- {} (tail) ---\n{}",
                        path.display(),
                        tail(&text, 2500)
                    ));
                }
            }
        }
        s
    }

    /// The state directory `vmctl up` made for `workspace`, found by its record.
    pub(crate) fn vm_dir(&self, workspace: &Path) -> Result<(PathBuf, serde_json::Value), String> {
        let workspace = workspace
            .canonicalize()
            .map_err(|e| format!("{}: {e}", workspace.display()))?;
        for entry in fs::read_dir(self.vms_dir())
            .map_err(|e| format!("{}: {e}", self.vms_dir().display()))?
            .flatten()
        {
            let Ok(text) = fs::read_to_string(entry.path().join("vm.json")) else {
                continue;
            };
            let Ok(record) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            if record["workspace"].as_str() == Some(&*workspace.to_string_lossy()) {
                return Ok((entry.path(), record));
            }
        }
        Err(format!(
            "no VM record for {} under {} after vmctl up",
            workspace.display(),
            self.vms_dir().display()
        ))
    }

    /// `vmctl up DIR`: the command's wall time; DIR is removed again on drop from here on.
    pub(crate) fn up(&mut self, workspace: &Path) -> Result<Ran, String> {
        self.live.push(workspace.to_path_buf());
        self.run_ok(&self.argv(&["up"], workspace))
    }

    /// `vmctl rm DIR`, checked: its state directory is gone and its supervisor ended.
    pub(crate) fn rm(&mut self, workspace: &Path) -> Result<(), String> {
        let dir = self.vm_dir(workspace).ok().map(|(d, _)| d);
        let supervisor = dir
            .as_ref()
            .and_then(|d| fs::read_to_string(d.join("supervisor.pid")).ok())
            .and_then(|p| p.trim().parse::<u32>().ok());
        self.run_ok(&self.argv(&["rm"], workspace))?;
        self.live.retain(|w| w != workspace);
        if let Some(dir) = dir.filter(|d| d.exists()) {
            return Err(format!(
                "vmctl rm {} exited 0 but left {}",
                workspace.display(),
                dir.display()
            ));
        }
        if let Some(pid) = supervisor.filter(|p| is_supervisor(*p)) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            return Err(format!(
                "vmctl rm {} exited 0 but its VM's supervisor (pid {pid}) still ran: killed it",
                workspace.display()
            ));
        }
        Ok(())
    }
}

/// Whether `pid` is a `vmctl __supervise` process.
fn is_supervisor(pid: u32) -> bool {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| c.split(|b| *b == 0).any(|a| a == b"__supervise"))
        .unwrap_or(false)
}

impl Drop for Vmctl {
    fn drop(&mut self) {
        for workspace in std::mem::take(&mut self.live) {
            say(format!("cleaning up: vmctl rm {}", workspace.display()));
            let argv = self.argv(&["rm"], &workspace);
            match self.run(&argv) {
                Ok(r) if r.status.success() => {}
                Ok(r) => say(format!(
                    "error: cleanup failed: {} ({}): {}",
                    argv.join(" "),
                    r.status,
                    tail(&r.stderr, 2000)
                )),
                Err(e) => say(format!("error: cleanup failed: {e}")),
            }
        }
        // Sessions start vmctl's daemon on demand; it must not outlive the bench.
        let stop = vec![
            self.bin.display().to_string(),
            "daemon".into(),
            "--stop".into(),
        ];
        if let Err(e) = self.run(&stop) {
            say(format!("error: cleanup failed: {e}"));
        }
    }
}

async fn health(socket: &Path) -> Result<HealthInfo, String> {
    let conn = connect_hybrid(socket, AGENT_PORT)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    conn.health().await.map_err(|e| format!("health: {e}"))
}

/// One round trip: connect, exec `true`, wait for its exit (status 0 required).
pub async fn exec_true(socket: &Path) -> Result<(), String> {
    let conn = connect_hybrid(socket, AGENT_PORT)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let session = conn
        .exec(ExecRequest {
            argv: vec!["true".into()],
            ..Default::default()
        })
        .await
        .map_err(|e| format!("exec: {e}"))?;
    let out = session
        .output(b"")
        .await
        .map_err(|e| format!("output: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`true` ended with {:?}; stderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// Runs `f` to completion, within `timeout`.
fn block_on_within<T>(
    runtime: &tokio::runtime::Runtime,
    timeout: Duration,
    what: &str,
    f: impl std::future::Future<Output = Result<T, String>>,
) -> Result<T, String> {
    runtime
        .block_on(async { tokio::time::timeout(timeout, f).await })
        .map_err(|_| format!("{what}: no answer within {} s", timeout.as_secs()))?
        .map_err(|e| format!("{what}: {e}"))
}

/// `error`, and if the VM of `vm_dir` ended under it, how: its supervisor's last
/// lines (a crashed guest kernel is reported there). The supervisor writes them
/// once the VMM is gone, so they are waited for, at most `wait`.
pub(crate) fn with_vm_end(vm_dir: &Path, error: String, wait: Duration) -> String {
    const ENDED: &str = "vmctl: the VM ended";
    let log = vm_dir.join("supervisor.log");
    let deadline = Instant::now() + wait;
    let mut text = fs::read_to_string(&log).unwrap_or_default();
    while !text.contains(ENDED) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        text = fs::read_to_string(&log).unwrap_or_default();
    }
    match text.find(ENDED) {
        Some(at) => {
            let end: Vec<&str> = text[at..].lines().map(str::trim).collect();
            format!("{error}; {}", end.join("; "))
        }
        None => error,
    }
}

/// A figure of ours (no QEMU peer); an empty sample is an error.
pub(crate) fn figure(name: &str, unit: &str, samples: Vec<f64>) -> Result<Figure, String> {
    let n = samples.len();
    Figure::new(name, unit, OURS, samples)
        .ok_or_else(|| format!("{name}: no valid samples out of {n}"))
}

/// Measures the workspace VM figures.
pub fn measure(b: &WorkspaceBench) -> Result<WorkspaceReport, String> {
    if b.ready_runs == 0 || b.exec_iterations == 0 || b.cli_iterations == 0 {
        return Err("the workspace runs and iterations must be at least 1".into());
    }
    let tmp = TempDir::unique("-ws");
    let state = tmp.0.join("state");
    fs::create_dir_all(&state).map_err(|e| format!("create {}: {e}", state.display()))?;
    let config = write_vmctl_config(&tmp.0, WORKSPACE_VM)?;
    // Declared after `tmp`, so dropped (VMs removed) before the directory goes.
    let mut vmctl = Vmctl::new(&b.artifacts, state, Some(&config), b.timeout);
    let env = vmctl.env.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    warm_page_cache(&[
        &b.artifacts.kernel,
        &b.artifacts.agent_initramfs,
        &b.artifacts.vmctl,
    ])?;
    fs::metadata(&b.artifacts.rootfs)
        .map_err(|e| format!("{}: {e}", b.artifacts.rootfs.display()))?;
    say(format!(
        "workspace VM: {} vmctl up, {} client round trips (+{EXEC_WARMUP} warm-up), {} vmctl exec",
        b.ready_runs, b.exec_iterations, b.cli_iterations
    ));

    let mut ready_runs = Vec::new();
    let mut last = None;
    for i in 0..b.ready_runs {
        let workspace = tmp.0.join(format!("ws-{}", i + 1));
        fs::create_dir_all(&workspace)
            .map_err(|e| format!("create {}: {e}", workspace.display()))?;
        let ran = vmctl.up(&workspace)?;
        let exited = Instant::now();
        let (dir, record) = vmctl.vm_dir(&workspace)?;
        let socket = vsock_socket_of(&dir, &record);
        let h = block_on_within(
            &runtime,
            b.timeout,
            &format!("health check of {} after vmctl up", socket.display()),
            health(&socket),
        )?;
        let lag = exited.elapsed();
        let run = ReadyRun {
            wall_ms: ms(ran.elapsed),
            guest_uptime_ms: h.uptime_ms,
            agent_uptime_ms: h.agent_uptime_ms,
            agent_rss_bytes: h.agent_rss_bytes,
            health_lag_ms: ms(lag),
        };
        say(format!(
            "[up {}/{}] agent ready {:.0} ms (vmctl up); guest then: uptime {} ms, agent up {} ms, \
             agent RSS {:.2} MiB (health answered {:.1} ms after vmctl up exited)",
            i + 1,
            b.ready_runs,
            run.wall_ms,
            run.guest_uptime_ms,
            run.agent_uptime_ms,
            mib(run.agent_rss_bytes),
            run.health_lag_ms
        ));
        ready_runs.push(run);
        if i + 1 < b.ready_runs {
            vmctl.rm(&workspace)?;
        } else {
            last = Some((workspace, socket, record));
        }
    }
    let (workspace, socket, record) = last.expect("at least one run");
    let vm_nested = record["nested"].as_bool().unwrap_or(false);
    if vm_nested {
        say("warning: vmctl up ran the VM in a nested host of its own: these are not this machine's figures");
    }

    // The last VM stays up for the round trips. A failed one says whether the VM
    // ended under it, and why.
    let vm_dir = socket.parent().map(Path::to_path_buf).unwrap_or_default();
    let explain = |error: String| with_vm_end(&vm_dir, error, Duration::from_secs(2));
    for i in 0..EXEC_WARMUP {
        block_on_within(
            &runtime,
            b.timeout,
            &format!("warm-up exec {} of true", i + 1),
            exec_true(&socket),
        )
        .map_err(explain)?;
    }
    let mut client = Vec::with_capacity(b.exec_iterations);
    for i in 0..b.exec_iterations {
        let start = Instant::now();
        block_on_within(
            &runtime,
            b.timeout,
            &format!(
                "exec round trip {}/{} of true through {}",
                i + 1,
                b.exec_iterations,
                socket.display()
            ),
            exec_true(&socket),
        )
        .map_err(explain)?;
        client.push(ms(start.elapsed()));
    }
    let exec_argv = vec![
        b.artifacts.vmctl.display().to_string(),
        "exec".into(),
        "--workspace".into(),
        workspace.display().to_string(),
        "--".into(),
        "true".into(),
    ];
    let mut cli = Vec::with_capacity(b.cli_iterations);
    for _ in 0..b.cli_iterations {
        cli.push(ms(vmctl.run_ok(&exec_argv)?.elapsed));
    }
    let h = block_on_within(
        &runtime,
        b.timeout,
        &format!("health check of {} after the round trips", socket.display()),
        health(&socket),
    )
    .map_err(explain)?;
    let summary = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        format!(
            "median {:.2} ms, min {:.2}, max {:.2}",
            crate::stats::median(&s),
            s[0],
            s[s.len() - 1]
        )
    };
    say(format!(
        "[exec] client: {}; vmctl exec: {}; agent RSS after: {:.2} MiB ({} active execs)",
        summary(&client),
        summary(&cli),
        mib(h.agent_rss_bytes),
        h.active_execs
    ));
    if h.active_execs != 0 {
        return Err(format!(
            "the agent still reports {} active exec(s) after every round trip ended",
            h.active_execs
        ));
    }
    let up_argv = vmctl.argv(&["up"], &workspace);
    let rm_argv = vmctl.argv(&["rm"], &workspace);
    vmctl.rm(&workspace)?;

    let figures = vec![
        figure(
            "agent_ready",
            "ms",
            ready_runs.iter().map(|r| r.wall_ms).collect(),
        )?
        .with_hardware_target(AGENT_READY_TARGET_MS),
        figure(
            "agent_ready_guest_uptime",
            "ms",
            ready_runs
                .iter()
                .map(|r| r.guest_uptime_ms as f64)
                .collect(),
        )?,
        figure(
            "agent_start_guest_uptime",
            "ms",
            ready_runs
                .iter()
                .map(|r| r.guest_uptime_ms.saturating_sub(r.agent_uptime_ms) as f64)
                .collect(),
        )?,
        figure("exec_round_trip", "ms", client)?
            .with_p99()
            .with_hardware_target(EXEC_ROUND_TRIP_TARGET_MS),
        figure("exec_round_trip_cli", "ms", cli)?.with_p99(),
        figure(
            "agent_rss_at_ready",
            "MiB",
            ready_runs.iter().map(|r| mib(r.agent_rss_bytes)).collect(),
        )?,
        figure("agent_rss", "MiB", vec![mib(h.agent_rss_bytes)])?,
    ];
    Ok(WorkspaceReport {
        note: NOTE.into(),
        config: WorkspaceConfig {
            ready_runs: b.ready_runs,
            exec_iterations: b.exec_iterations,
            exec_warmup: EXEC_WARMUP,
            cli_iterations: b.cli_iterations,
            kernel: b.artifacts.kernel.display().to_string(),
            agent_initramfs: b.artifacts.agent_initramfs.display().to_string(),
            rootfs: b.artifacts.rootfs.display().to_string(),
            vm_cpus: record["cpus"].as_u64().unwrap_or(0),
            vm_memory_mib: record["memory_mib"].as_u64().unwrap_or(0),
            vm_nested,
            timeout_s: b.timeout.as_secs(),
        },
        commands: vec![
            ("up".into(), up_argv),
            (
                "exec_round_trip".into(),
                vec![format!(
                    "guest_agent::client::connect_hybrid({}, {AGENT_PORT}) + exec([\"true\"]) + output()",
                    socket.display()
                )],
            ),
            ("exec_round_trip_cli".into(), exec_argv),
            ("rm".into(), rm_argv),
        ],
        environment: env,
        figures,
        ready_runs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vsock_socket_is_where_the_record_says() {
        let vm = Path::new("/state/vms/ws-1");
        let moved = serde_json::json!({"vsock_socket": "/tmp/vmctl-0/vm-ab12/vsock/vsock.sock"});
        assert_eq!(
            vsock_socket_of(vm, &moved),
            Path::new("/tmp/vmctl-0/vm-ab12/vsock/vsock.sock")
        );
        let older = serde_json::json!({"workspace": "/w"});
        assert_eq!(
            vsock_socket_of(vm, &older),
            Path::new("/state/vms/ws-1/vsock/vsock.sock")
        );
    }

    #[test]
    fn a_failure_says_how_the_vm_ended() {
        let dir = TempDir::unique("-vm-end");
        fs::create_dir_all(&dir.0).unwrap();
        fs::write(
            dir.0.join("supervisor.log"),
            "vmctl: supervising the VM of /w\n\u{1b}[2m...\u{1b}[0m INFO guest reset\n\
             vmctl: the VM ended: Ok(0)\n\
             vmctl: error: the guest kernel crashed: Kernel panic - not syncing: Fatal exception\n",
        )
        .unwrap();
        assert_eq!(
            with_vm_end(&dir.0, "connect: closed".into(), Duration::ZERO),
            "connect: closed; vmctl: the VM ended: Ok(0); vmctl: error: the guest kernel \
             crashed: Kernel panic - not syncing: Fatal exception"
        );
    }

    #[test]
    fn a_failure_of_a_running_vm_is_left_alone() {
        let dir = TempDir::unique("-vm-up");
        fs::create_dir_all(&dir.0).unwrap();
        fs::write(
            dir.0.join("supervisor.log"),
            "vmctl: supervising the VM of /w\n",
        )
        .unwrap();
        assert_eq!(
            with_vm_end(&dir.0, "exec: timed out".into(), Duration::ZERO),
            "exec: timed out"
        );
        let none = dir.0.join("missing");
        assert_eq!(with_vm_end(&none, "e".into(), Duration::ZERO), "e");
    }

    #[test]
    fn the_config_sizes_the_vm_exactly() {
        let toml = vmctl_config_toml(BootConfig::new(2, 128));
        assert!(toml.contains("cpus = 2\n"), "{toml}");
        assert!(toml.contains("memory_percent = 0\n"), "{toml}");
        assert!(toml.contains("memory_min_mib = 128\n"), "{toml}");
        assert_eq!((WORKSPACE_VM.vcpus, WORKSPACE_VM.memory_mib), (2, 1024));
    }

    /// A fake `vmctl` that logs its arguments, and the config its `up` was given;
    /// `up` fails for the second workspace.
    fn fake(dir: &Path) -> WorkspaceBench {
        let log = dir.join("calls.log");
        let script = dir.join("vmctl");
        fs::write(
            &script,
            format!(
                "#!/bin/sh\necho \"$*\" >> {log}\ncase \"$1 $2\" in\n  \
                 up*ws-2) echo 'no kvm here' >&2; exit 1;;\n  \
                 up*) cat \"$VMCTL_CONFIG\" > {config_seen} 2>/dev/null; \
                 d=\"$XDG_STATE_HOME/vmctl/vms/x-$(basename $2)\"; mkdir -p \"$d\"; \
                 printf '{{\"workspace\":\"%s\"}}' \"$2\" > \"$d/vm.json\"; \
                 echo 'booting' > \"$d/console.log\";;\n  \
                 rm*) rm -rf \"$XDG_STATE_HOME/vmctl/vms/x-$(basename $2)\";;\nesac\n",
                log = log.display(),
                config_seen = dir.join("config-seen.toml").display(),
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        for f in ["kernel", "initrd", "rootfs"] {
            fs::write(dir.join(f), "x").unwrap();
        }
        WorkspaceBench {
            artifacts: GuestArtifacts {
                vmctl: script,
                kernel: dir.join("kernel"),
                agent_initramfs: dir.join("initrd"),
                rootfs: dir.join("rootfs"),
            },
            ready_runs: 3,
            exec_iterations: 1,
            cli_iterations: 1,
            timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn failures_are_reported_and_vms_removed() {
        let dir = std::env::temp_dir().join(format!("vm-bench-test-{}", std::process::id()));
        let _tmp = TempDir(dir.clone());
        fs::create_dir_all(&dir).unwrap();
        let bench = fake(&dir);
        // The first up "succeeds" but nothing answers on its vsock socket.
        let e = measure(&bench).unwrap_err();
        assert!(e.contains("health check of"), "{e}");
        // vmctl up read the section's own config, not the user's.
        assert_eq!(
            fs::read_to_string(dir.join("config-seen.toml")).unwrap(),
            vmctl_config_toml(WORKSPACE_VM)
        );
        let calls = fs::read_to_string(dir.join("calls.log")).unwrap();
        let mut lines: Vec<&str> = calls.lines().collect();
        // The cleanup stops the daemon that the sessions started, last.
        assert!(
            lines.pop().is_some_and(|l| l.starts_with("daemon")),
            "{calls}"
        );
        assert_eq!(lines.len(), 2, "{calls}");
        assert!(
            lines[0].starts_with("up ") && lines[1].starts_with("rm "),
            "{calls}"
        );
        assert_eq!(lines[0][3..], lines[1][3..], "{calls}");
        // A failing vmctl up: its message and the VM's logs are in the error, and
        // the workspace is removed.
        fs::remove_file(dir.join("calls.log")).unwrap();
        let mut v = Vmctl {
            bin: bench.artifacts.vmctl.clone(),
            env: vec![(
                "XDG_STATE_HOME".into(),
                dir.join("state").display().to_string(),
            )],
            state: dir.join("state"),
            timeout: Duration::from_secs(5),
            live: Vec::new(),
        };
        let ws1 = dir.join("ws-1");
        let ws2 = dir.join("ws-2");
        fs::create_dir_all(&ws1).unwrap();
        fs::create_dir_all(&ws2).unwrap();
        v.up(&ws1).unwrap();
        let e = v.up(&ws2).err().unwrap();
        assert!(
            e.contains("up") && e.contains("failed (exit status: 1)"),
            "{e}"
        );
        assert!(e.contains("no kvm here"), "{e}");
        assert!(e.contains("console.log (tail) ---\nbooting"), "{e}");
        drop(v);
        let calls = fs::read_to_string(dir.join("calls.log")).unwrap();
        assert!(calls.contains(&format!("rm {}", ws1.display())), "{calls}");
        assert!(calls.contains(&format!("rm {}", ws2.display())), "{calls}");
    }
}
