//! The workspace-VM figures: how long `vmctl up` takes until the guest agent answers,
//! the latency of running `true` through the agent (Rust client and CLI), the
//! agent's memory, and the host memory a VM gives back after a burst with free page
//! reporting and without ([`MemoryReturnSizes`]). There is no QEMU peer for these: no
//! comparable figure.
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
use crate::report::{
    BootConfig, Figure, MemoryReturn, MemoryRun, ReadyRun, WorkspaceConfig, WorkspaceReport, OURS,
};
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
    /// The memory given back after a burst.
    pub memory_return: MemoryReturnSizes,
    /// Measuring inside the nested host (`--inner`).
    pub nested: bool,
}

/// The memory measure: `rounds` of two fresh VMs (with free page reporting and
/// without) whose guest fills `fill_mib` of a tmpfs, then frees it; HELD is read every
/// `interval` for `window` after that.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryReturnSizes {
    /// 0: not measured.
    pub rounds: usize,
    pub fill_mib: u64,
    pub window: Duration,
    pub interval: Duration,
}

/// The guest's burst; its tmpfs is a little larger.
pub const FILL_MIB: u64 = 512;
const FILL_TMPFS_EXTRA_MIB: u64 = 64;
/// The guest reports freed memory a couple of seconds after it freed it.
pub const HELD_WINDOW: Duration = Duration::from_secs(30);
pub const HELD_INTERVAL: Duration = Duration::from_secs(2);
/// Settled: within this share of the window's last reading, from then on.
pub const SETTLE_TOLERANCE: f64 = 0.10;
/// Where the guest mounts its tmpfs.
const FILL_DIR: &str = "/run/fill";

impl MemoryReturnSizes {
    /// `rounds` as given, else 1; with `--quick` 0 (not measured: each VM costs a
    /// start, the fill and the 30 s window).
    pub fn for_run(quick: bool, rounds: Option<usize>) -> MemoryReturnSizes {
        MemoryReturnSizes {
            rounds: rounds.unwrap_or(if quick { 0 } else { 1 }),
            fill_mib: FILL_MIB,
            window: HELD_WINDOW,
            interval: HELD_INTERVAL,
        }
    }

    fn tmpfs_mib(&self) -> u64 {
        self.fill_mib + FILL_TMPFS_EXTRA_MIB
    }

    /// HELD readings after the free: at 0, every interval, through the window.
    fn readings(&self) -> u32 {
        match self.interval.as_nanos() {
            0 => 1,
            interval => (self.window.as_nanos() / interval) as u32 + 1,
        }
    }

    /// The longest it may take: per VM `up`, `ps`, fill, `ps`, free, each reading's
    /// `ps` and `rm`, each within `timeout`, and the window.
    pub fn time_budget(&self, timeout: Duration) -> Duration {
        let per_vm = timeout * (6 + self.readings()) + self.window;
        per_vm * 2 * self.rounds as u32
    }

    /// `sh -c` of the fill: a tmpfs of the guest's own, `fill_mib` of zeros in it.
    fn fill_script(&self) -> String {
        format!(
            "mkdir -p {FILL_DIR} && mount -t tmpfs -o size={}M fill {FILL_DIR} && \
             head -c {}M /dev/zero > {FILL_DIR}/zeros",
            self.tmpfs_mib(),
            self.fill_mib
        )
    }
}

/// `sh -c` of the free: the file removed and the tmpfs unmounted.
fn free_script() -> String {
    format!("rm {FILL_DIR}/zeros && umount {FILL_DIR}")
}

/// When `readings` (`[s, MiB]`, in time order) settled: the time of the first one
/// from which on every reading is within `tolerance` (a share) of the last one. For a
/// falling curve that is when it first came that close. No readings, or one that is
/// not a finite number, is an error.
pub(crate) fn settle_time(readings: &[(f64, f64)], tolerance: f64) -> Result<f64, String> {
    let &(_, last) = readings.last().ok_or("no readings to settle")?;
    if let Some((t, v)) = readings
        .iter()
        .find(|(t, v)| !t.is_finite() || !v.is_finite())
    {
        return Err(format!("a reading is not a number: {v} MiB at {t} s"));
    }
    let band = tolerance * last.abs();
    let settled_from = readings
        .iter()
        .rposition(|(_, v)| (v - last).abs() > band)
        .map_or(0, |outside| outside + 1);
    Ok(readings[settled_from].0)
}

/// The config file's section that turns free page reporting off for `workspace` (its
/// canonical path, which vmctl matches).
pub(crate) fn without_reporting_toml(workspace: &Path) -> String {
    format!(
        "\n[workspaces.{:?}]\nfree_page_reporting = false\n",
        workspace.display().to_string()
    )
}

/// Whose memory HELD is, as the note under the figures says.
fn memory_note(vm_nested: bool, bench_nested: bool) -> String {
    if vm_nested {
        "vmctl ran these VMs in a nested host of their own (MODE nested): HELD is that \
         nested host's QEMU's (with virtiofsd), which gives back only what the nested host's \
         kernel in turn reports free of what the VMM dropped; on hardware KVM it is the \
         VMM's."
            .into()
    } else if bench_nested {
        "Measured inside the nested host: HELD is the VMM's (with virtiofsd) there, as on \
         hardware KVM; what the nested host's QEMU gives back in turn to this machine is not \
         in these figures."
            .into()
    } else {
        "HELD is the VMM's (with virtiofsd) on this machine.".into()
    }
}

/// Two workspace directories of the memory measure: with free page reporting
/// (vmctl's default), and without (the config's section for it).
pub(crate) struct MemoryWorkspaces {
    pub(crate) reporting: PathBuf,
    pub(crate) not_reporting: PathBuf,
}

impl MemoryWorkspaces {
    /// Creates them under `dir`, with their canonical paths (vmctl's).
    pub(crate) fn create(dir: &Path) -> Result<MemoryWorkspaces, String> {
        let make = |name: &str| {
            let path = dir.join(name);
            fs::create_dir_all(&path)
                .and_then(|()| path.canonicalize())
                .map_err(|e| format!("create {}: {e}", path.display()))
        };
        Ok(MemoryWorkspaces {
            reporting: make("mem-reporting")?,
            not_reporting: make("mem-not-reporting")?,
        })
    }
}

/// `vmctl exec --workspace DIR --user=root -- sh -c SCRIPT`.
fn guest_root_sh(vmctl: &Vmctl, workspace: &Path, script: &str) -> Vec<String> {
    vmctl.exec_argv(workspace, Some("root"), &["sh", "-c", script])
}

/// HELD of `workspace`'s VM now.
fn held_now(vmctl: &Vmctl, workspace: &Path) -> Result<f64, String> {
    let ps = vmctl.run_ok(&[
        vmctl.bin.display().to_string(),
        "ps".into(),
        "--json".into(),
    ])?;
    vm_tests::ps::held_mib(&vm_tests::ps::parse(&ps.stdout)?, workspace).map(|m| m as f64)
}

/// One VM of the memory measure: up, HELD idle, fill, HELD full, free, HELD over the
/// window, rm.
fn memory_run(
    vmctl: &mut Vmctl,
    sizes: &MemoryReturnSizes,
    workspace: &Path,
    reporting: bool,
    round: usize,
) -> Result<MemoryRun, String> {
    vmctl.up(workspace)?;
    let (_, record) = vmctl.vm_dir(workspace)?;
    // Records of a vmctl before the key read as reporting, as vmctl reads them.
    let recorded = record["free_page_reporting"].as_bool().unwrap_or(true);
    if recorded != reporting {
        return Err(format!(
            "vmctl up {} recorded free_page_reporting = {recorded}, the benchmark's config \
             asked for {reporting}",
            workspace.display()
        ));
    }
    let held_idle_mib = held_now(vmctl, workspace)?;
    vmctl.run_ok(&guest_root_sh(vmctl, workspace, &sizes.fill_script()))?;
    let held_full_mib = held_now(vmctl, workspace)?;
    vmctl.run_ok(&guest_root_sh(vmctl, workspace, &free_script()))?;
    let freed = Instant::now();
    let mut after_free = Vec::new();
    for k in 0..sizes.readings() {
        let due = freed + sizes.interval * k;
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        let at = freed.elapsed().as_secs_f64();
        after_free.push((at, held_now(vmctl, workspace)?));
    }
    vmctl.rm(workspace)?;
    let settle_s = settle_time(&after_free, SETTLE_TOLERANCE)?;
    let held_after_free_mib = after_free.last().map_or(0.0, |r| r.1);
    Ok(MemoryRun {
        round,
        free_page_reporting: reporting,
        vm_nested: record["nested"].as_bool().unwrap_or(false),
        held_idle_mib,
        held_full_mib,
        after_free,
        held_after_free_mib,
        settle_s,
    })
}

/// The memory measure's rounds (each a VM with free page reporting and one without,
/// alternating which goes first) and its figures.
fn measure_memory_return(
    vmctl: &mut Vmctl,
    sizes: &MemoryReturnSizes,
    workspaces: &MemoryWorkspaces,
    bench_nested: bool,
) -> Result<(MemoryReturn, Vec<Figure>), String> {
    let mut runs = Vec::new();
    for round in 1..=sizes.rounds {
        let order = if round % 2 == 1 {
            [true, false]
        } else {
            [false, true]
        };
        for reporting in order {
            let workspace = if reporting {
                &workspaces.reporting
            } else {
                &workspaces.not_reporting
            };
            let run = memory_run(vmctl, sizes, workspace, reporting, round)?;
            say(format!(
                "[memory {round}/{}] free page reporting {}: HELD idle {:.0} MiB, full {:.0}, \
                 {:.0} s after the free {:.0} (settled at {:.1} s)",
                sizes.rounds,
                if reporting { "on" } else { "off" },
                run.held_idle_mib,
                run.held_full_mib,
                run.after_free.last().map_or(0.0, |r| r.0),
                run.held_after_free_mib,
                run.settle_s
            ));
            runs.push(run);
        }
    }
    let figures = memory_figures(&runs)?;
    let w = &workspaces.reporting;
    Ok((
        MemoryReturn {
            rounds: sizes.rounds,
            fill_mib: sizes.fill_mib,
            tmpfs_mib: sizes.tmpfs_mib(),
            interval_s: sizes.interval.as_secs_f64(),
            window_s: sizes.window.as_secs_f64(),
            settle_tolerance: SETTLE_TOLERANCE,
            note: memory_note(runs.iter().any(|r| r.vm_nested), bench_nested),
            commands: vec![
                ("up".into(), vmctl.argv(&["up"], w)),
                (
                    "held".into(),
                    vec![
                        vmctl.bin.display().to_string(),
                        "ps".into(),
                        "--json".into(),
                    ],
                ),
                ("fill".into(), guest_root_sh(vmctl, w, &sizes.fill_script())),
                ("free".into(), guest_root_sh(vmctl, w, &free_script())),
                ("rm".into(), vmctl.argv(&["rm"], w)),
            ],
            config_without_reporting: without_reporting_toml(&workspaces.not_reporting),
            runs,
        },
        figures,
    ))
}

/// The memory measure's figures, per mode: HELD idle, full and after the free, what
/// was given back and when it settled; and per round the ratio of the two modes'
/// HELD after the free.
pub(crate) fn memory_figures(runs: &[MemoryRun]) -> Result<Vec<Figure>, String> {
    let mut figures = Vec::new();
    for (reporting, suffix) in [(true, "reporting"), (false, "not_reporting")] {
        let of: Vec<&MemoryRun> = runs
            .iter()
            .filter(|r| r.free_page_reporting == reporting)
            .collect();
        let values = |f: fn(&MemoryRun) -> f64| of.iter().map(|r| f(r)).collect::<Vec<f64>>();
        figures.extend([
            figure(
                &format!("held_idle_{suffix}"),
                "MiB",
                values(|r| r.held_idle_mib),
            )?,
            figure(
                &format!("held_full_{suffix}"),
                "MiB",
                values(|r| r.held_full_mib),
            )?,
            figure(
                &format!("held_after_free_{suffix}"),
                "MiB",
                values(|r| r.held_after_free_mib),
            )?,
            figure(
                &format!("given_back_{suffix}"),
                "MiB",
                values(|r| r.held_full_mib - r.held_after_free_mib),
            )?,
            figure(&format!("settle_{suffix}"), "s", values(|r| r.settle_s))?,
        ]);
    }
    let mut ratios = Vec::new();
    for on in runs.iter().filter(|r| r.free_page_reporting) {
        let off = runs
            .iter()
            .find(|r| !r.free_page_reporting && r.round == on.round)
            .ok_or_else(|| format!("round {}: no VM without free page reporting", on.round))?;
        if off.held_after_free_mib <= 0.0 {
            return Err(format!(
                "round {}: HELD after the free without free page reporting is {} MiB",
                on.round, off.held_after_free_mib
            ));
        }
        ratios.push(on.held_after_free_mib / off.held_after_free_mib);
    }
    figures.push(figure(
        "held_after_free_reporting_over_not",
        "ratio",
        ratios,
    )?);
    Ok(figures)
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
    write_vmctl_config_text(dir, &vmctl_config_toml(size))
}

/// Writes `text` as [`write_vmctl_config`] writes its config.
fn write_vmctl_config_text(dir: &Path, text: &str) -> Result<PathBuf, String> {
    let config_dir = dir.join("config");
    let file = config_dir.join("config.toml");
    fs::create_dir_all(&config_dir)
        .and_then(|()| fs::write(&file, text))
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

    /// `vmctl exec --workspace WORKSPACE [--user=USER] -- COMMAND...`; with no
    /// `command`, the prefix a caller adds its command to.
    pub(crate) fn exec_argv(
        &self,
        workspace: &Path,
        user: Option<&str>,
        command: &[&str],
    ) -> Vec<String> {
        let mut argv = vec![
            self.bin.display().to_string(),
            "exec".into(),
            "--workspace".into(),
            workspace.display().to_string(),
        ];
        argv.extend(user.map(|user| format!("--user={user}")));
        argv.push("--".into());
        argv.extend(command.iter().map(|word| word.to_string()));
        argv
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
    // The memory measure's VM without free page reporting has a section of its own.
    let memory_workspaces = match b.memory_return.rounds {
        0 => None,
        _ => Some(MemoryWorkspaces::create(&tmp.0)?),
    };
    let mut config_text = vmctl_config_toml(WORKSPACE_VM);
    if let Some(w) = &memory_workspaces {
        config_text.push_str(&without_reporting_toml(&w.not_reporting));
    }
    let config = write_vmctl_config_text(&tmp.0, &config_text)?;
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
        "workspace VM: {} vmctl up, {} client round trips (+{EXEC_WARMUP} warm-up), {} vmctl exec; \
         {}",
        b.ready_runs,
        b.exec_iterations,
        b.cli_iterations,
        match b.memory_return.rounds {
            0 => "memory given back after a burst: not measured (--free-page-rounds 0, the \
                  default of --quick)"
                .to_string(),
            n => format!(
                "then {n} round(s) of the memory given back after a burst of {} MiB, with free \
                 page reporting and without (2 VMs, about {} s each)",
                b.memory_return.fill_mib,
                b.memory_return.window.as_secs() + 15
            ),
        }
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
    let exec_argv = vmctl.exec_argv(&workspace, None, &["true"]);
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

    let mut figures = vec![
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
    // A failure of the memory measure leaves the figures above standing: the report
    // says it, and the run fails (`WorkspaceReport::errors`).
    let mut failures = Vec::new();
    let memory_return = match &memory_workspaces {
        None => None,
        Some(w) => match measure_memory_return(&mut vmctl, &b.memory_return, w, b.nested) {
            Ok((m, memory_figures)) => {
                figures.extend(memory_figures);
                Some(m)
            }
            Err(e) => {
                say(format!("error: workspace VM: memory given back: {e}"));
                failures.push(format!("memory given back: {e}"));
                None
            }
        },
    };
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
            free_page_rounds: b.memory_return.rounds,
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
        memory_return,
        failures,
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
            memory_return: MemoryReturnSizes::for_run(false, None),
            nested: false,
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
        // vmctl up read the section's own config, not the user's: the size, and the
        // section of the memory measure's workspace without free page reporting.
        let seen = fs::read_to_string(dir.join("config-seen.toml")).unwrap();
        let (size, memory) = seen.split_at(vmctl_config_toml(WORKSPACE_VM).len());
        assert_eq!(size, vmctl_config_toml(WORKSPACE_VM));
        assert!(
            memory.starts_with("\n[workspaces.\"/")
                && memory.ends_with("/mem-not-reporting\"]\nfree_page_reporting = false\n"),
            "{seen}"
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
    #[test]
    fn settle_is_when_the_readings_stay_within_the_tolerance_of_the_last() {
        let falling = [
            (0.0, 1018.0),
            (2.0, 1010.0),
            (4.0, 700.0),
            (6.0, 380.0),
            (8.0, 352.0),
            (10.0, 350.0),
        ];
        // 380 is within 10% of 350 (35 MiB), 700 is not.
        assert_eq!(settle_time(&falling, 0.10), Ok(6.0));
        assert_eq!(settle_time(&falling, 0.01), Ok(8.0));
        // Without free page reporting HELD stays where it was: settled at once.
        let flat = [(0.0, 1018.0), (2.0, 1019.0), (4.0, 1018.0)];
        assert_eq!(settle_time(&flat, 0.10), Ok(0.0));
        // A reading close to the end early on does not count: it left the band again.
        let dip = [(0.0, 1000.0), (2.0, 360.0), (4.0, 800.0), (6.0, 350.0)];
        assert_eq!(settle_time(&dip, 0.10), Ok(6.0));
        assert_eq!(settle_time(&[(1.5, 7.0)], 0.10), Ok(1.5));
        assert_eq!(
            settle_time(&[], 0.10),
            Err("no readings to settle".to_string())
        );
        let e = settle_time(&[(0.0, f64::NAN), (2.0, 350.0)], 0.10).unwrap_err();
        assert!(e.starts_with("a reading is not a number"), "{e}");
    }

    fn memory_run(round: usize, reporting: bool, after: f64) -> MemoryRun {
        MemoryRun {
            round,
            free_page_reporting: reporting,
            vm_nested: false,
            held_idle_mib: 300.0,
            held_full_mib: 1000.0,
            after_free: vec![(0.0, 1000.0), (2.0, after)],
            held_after_free_mib: after,
            settle_s: 2.0,
        }
    }

    #[test]
    fn memory_figures_per_mode_and_the_ratio_per_round() {
        let runs = [
            memory_run(1, true, 350.0),
            memory_run(1, false, 1000.0),
            memory_run(2, false, 800.0),
            memory_run(2, true, 400.0),
        ];
        let figures = memory_figures(&runs).unwrap();
        let median = |name: &str| {
            let f = figures
                .iter()
                .find(|f| f.name == name)
                .unwrap_or_else(|| panic!("{name}"));
            (f.median, f.unit.as_str(), f.samples.len())
        };
        assert_eq!(median("held_idle_reporting"), (300.0, "MiB", 2));
        assert_eq!(median("held_full_not_reporting"), (1000.0, "MiB", 2));
        assert_eq!(median("held_after_free_reporting"), (375.0, "MiB", 2));
        assert_eq!(median("held_after_free_not_reporting"), (900.0, "MiB", 2));
        assert_eq!(median("given_back_reporting"), (625.0, "MiB", 2));
        assert_eq!(median("given_back_not_reporting"), (100.0, "MiB", 2));
        assert_eq!(median("settle_reporting"), (2.0, "s", 2));
        // Round 1: 350 / 1000; round 2: 400 / 800.
        assert_eq!(
            median("held_after_free_reporting_over_not"),
            (0.425, "ratio", 2)
        );
        assert_eq!(figures.len(), 11);
        let e = memory_figures(&runs[..1]).unwrap_err();
        assert!(
            e.starts_with("held_idle_not_reporting: no valid samples"),
            "{e}"
        );
        let e = memory_figures(&[runs[0].clone(), runs[2].clone(), runs[3].clone()]).unwrap_err();
        assert_eq!(e, "round 1: no VM without free page reporting");
    }

    #[test]
    fn memory_sizes_and_commands() {
        let full = MemoryReturnSizes::for_run(false, None);
        assert_eq!((full.rounds, full.fill_mib), (1, 512));
        assert_eq!((full.window, full.interval), (HELD_WINDOW, HELD_INTERVAL));
        assert_eq!(full.readings(), 16);
        assert_eq!(MemoryReturnSizes::for_run(true, None).rounds, 0);
        assert_eq!(MemoryReturnSizes::for_run(true, Some(2)).rounds, 2);
        assert_eq!(
            MemoryReturnSizes::for_run(true, None).time_budget(Duration::from_secs(60)),
            Duration::ZERO
        );
        assert_eq!(
            full.time_budget(Duration::from_secs(60)),
            Duration::from_secs(2 * (22 * 60 + 30))
        );
        assert_eq!(
            full.fill_script(),
            "mkdir -p /run/fill && mount -t tmpfs -o size=576M fill /run/fill && \
             head -c 512M /dev/zero > /run/fill/zeros"
        );
        assert_eq!(free_script(), "rm /run/fill/zeros && umount /run/fill");
        assert_eq!(
            without_reporting_toml(Path::new("/tmp/b/mem-not-reporting")),
            "\n[workspaces.\"/tmp/b/mem-not-reporting\"]\nfree_page_reporting = false\n"
        );
        assert!(memory_note(true, true).contains("nested host's QEMU"));
        assert!(memory_note(false, true)
            .starts_with("Measured inside the nested host: HELD is the VMM's"));
        assert!(memory_note(false, false).starts_with("HELD is the VMM's"));
    }

    /// A fake `vmctl` for the memory measure: `up` records free page reporting as the
    /// config's workspace section says; `ps` prints HELD 300 M idle, 1000 M after the
    /// fill and, after the free, 1000 M once more and then 350 M where the VM reports
    /// free pages; every call is logged.
    fn memory_fake(dir: &Path) -> Vmctl {
        let script = dir.join("vmctl");
        fs::write(
            &script,
            format!(
                r#"#!/bin/sh
echo "$*" >> {log}
vms="$XDG_STATE_HOME/vmctl/vms"
case "$1" in
  up)
    d="$vms/x-$(basename "$2")"; mkdir -p "$d"
    fpr=true; grep -qF "[workspaces.\"$2\"]" "$VMCTL_CONFIG" && fpr=false
    printf '{{"workspace":"%s","free_page_reporting":%s}}' "$2" "$fpr" > "$d/vm.json"
    echo 300 > "$d/held";;
  exec)
    d="$vms/x-$(basename "$3")"
    case "$*" in
      *umount*) echo 1000 > "$d/held"; touch "$d/freed";;
      *mount*) echo 1000 > "$d/held";;
    esac;;
  ps)
    [ "$2" = --json ]; sep=; printf '['
    for d in "$vms"/*; do
      [ -f "$d/vm.json" ] || continue
      ws=$(sed 's/.*"workspace":"\([^"]*\)".*/\1/' "$d/vm.json")
      held=$(cat "$d/held")
      if [ -f "$d/freed" ] && grep -q '"free_page_reporting":true' "$d/vm.json"; then
        echo 350 > "$d/held"
      fi
      printf '%s{{"name":"%s","state":"running","workspace":"%s","held_mib":%s}}' "$sep" "$(basename "$d")" "$ws" "$held"
      sep=,
    done
    echo ']';;
  rm) rm -rf "$vms/x-$(basename "$2")";;
esac
"#,
                log = dir.join("calls.log").display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        let state = dir.join("state");
        Vmctl {
            bin: script,
            env: vec![("XDG_STATE_HOME".into(), state.display().to_string())],
            state,
            timeout: Duration::from_secs(5),
            live: Vec::new(),
        }
    }

    #[test]
    fn memory_rounds_alternate_and_measure_both_modes() {
        let dir = TempDir::unique("-memory");
        fs::create_dir_all(&dir.0).unwrap();
        let workspaces = MemoryWorkspaces::create(&dir.0).unwrap();
        let config = write_vmctl_config_text(
            &dir.0,
            &(vmctl_config_toml(WORKSPACE_VM) + &without_reporting_toml(&workspaces.not_reporting)),
        )
        .unwrap();
        let mut vmctl = memory_fake(&dir.0);
        vmctl
            .env
            .push(("VMCTL_CONFIG".into(), config.display().to_string()));
        let sizes = MemoryReturnSizes {
            rounds: 2,
            fill_mib: 8,
            window: Duration::from_millis(150),
            interval: Duration::from_millis(50),
        };
        let (m, figures) = measure_memory_return(&mut vmctl, &sizes, &workspaces, true).unwrap();
        assert!(vmctl.live.is_empty(), "every VM removed: {:?}", vmctl.live);
        let order: Vec<(usize, bool)> = m
            .runs
            .iter()
            .map(|r| (r.round, r.free_page_reporting))
            .collect();
        assert_eq!(order, [(1, true), (1, false), (2, false), (2, true)]);
        for r in &m.runs {
            assert_eq!((r.held_idle_mib, r.held_full_mib), (300.0, 1000.0), "{r:?}");
            let held: Vec<f64> = r.after_free.iter().map(|a| a.1).collect();
            let times: Vec<f64> = r.after_free.iter().map(|a| a.0).collect();
            assert!(times.windows(2).all(|t| t[1] >= t[0] + 0.04), "{times:?}");
            if r.free_page_reporting {
                assert_eq!(held, [1000.0, 350.0, 350.0, 350.0], "{r:?}");
                assert_eq!((r.held_after_free_mib, r.settle_s), (350.0, times[1]));
            } else {
                assert_eq!(held, [1000.0; 4], "{r:?}");
                assert_eq!((r.held_after_free_mib, r.settle_s), (1000.0, times[0]));
            }
        }
        let ratio = figures
            .iter()
            .find(|f| f.name == "held_after_free_reporting_over_not")
            .unwrap();
        assert_eq!(ratio.samples, [0.35, 0.35]);
        assert!(
            m.note.starts_with("Measured inside the nested host"),
            "{}",
            m.note
        );
        assert_eq!((m.fill_mib, m.tmpfs_mib), (8, 72));
        // Per VM: up, ps, fill, ps, free, 4 readings, rm.
        let calls = fs::read_to_string(dir.0.join("calls.log")).unwrap();
        let verbs: Vec<&str> = calls
            .lines()
            .map(|l| l.split(' ').next().unwrap())
            .collect();
        let one = [
            "up", "ps", "exec", "ps", "exec", "ps", "ps", "ps", "ps", "rm",
        ];
        assert_eq!(verbs, one.repeat(4), "{calls}");
        let fill = format!(
            "exec --workspace {} --user=root -- sh -c mkdir -p /run/fill && mount -t tmpfs -o \
             size=72M fill /run/fill && head -c 8M /dev/zero > /run/fill/zeros",
            workspaces.reporting.display()
        );
        assert_eq!(calls.lines().nth(2), Some(fill.as_str()), "{calls}");
        // A VM whose record does not say what the config asked is an error, and is
        // removed with the rest.
        fs::write(&config, vmctl_config_toml(WORKSPACE_VM)).unwrap();
        let e = measure_memory_return(&mut vmctl, &sizes, &workspaces, false).unwrap_err();
        assert!(
            e.ends_with(
                "recorded free_page_reporting = true, the benchmark's config asked for false"
            ),
            "{e}"
        );
        assert_eq!(vmctl.live, std::slice::from_ref(&workspaces.not_reporting));
    }
}
