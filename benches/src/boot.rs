//! The boot benchmark: boots our VMM (`vmctl boot --nested never`) and QEMU's microvm
//! side by side, N times each, and reports boot time, total run time and VMM memory
//! overhead. Where this machine's KVM is not hardware-backed, it re-runs itself inside
//! the QEMU-TCG nested host (`vmctl nested-exec ... -- <this binary> ... --inner`),
//! so the same code measures in both places.

use std::ffi::OsString;
use std::fs;
use std::io::{self, BufRead, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::agent::AgentBench;
use crate::churn::ChurnBench;
use crate::cold_start::ColdStartBench;
use crate::egress::EgressBench;
use crate::fs::FsBench;
use crate::nested_retry;
use crate::report::{
    hardware_kvm, ratios, utc_now, BootConfig, Config, Figure, Machine, Ratio, Report, NESTED_NOTE,
    OURS, QEMU,
};
use crate::scan::{parse_boot_timer, tail, MarkerScanner};
use crate::sections::Section;
use crate::smaps::{account, parse_smaps, GuestMemoryRule, MemoryUse};
use crate::workspace::{GuestArtifacts, WorkspaceBench};
use vm_tests::initramfs_with_script;

/// Printed by the guest's `/etc/vmtest.sh` right after `/init` wrote the boot timer.
pub const BOOT_MARKER: &str = "BENCH-INIT-REACHED";
/// Printed by the memory runs' guest, which then sleeps so the VMM can be inspected.
pub const MEMORY_MARKER: &str = "BENCH-MEM-READY";
/// The name our VMM gives the memfd behind guest memory.
pub const OUR_GUEST_RAM: &str = "memfd:vmm-guest-ram";
/// QEMU's microvm machine, as close as QEMU 7.2 gets to our VMM's device model: no
/// ACPI, no option ROMs, legacy PIC/PIT, an ISA serial port, no RTC, and an i8042 so
/// that the guest's `reboot=k` resets the machine (microvm has none by default; with
/// `-no-reboot` the reset ends QEMU, as it ends our VMM).
pub(crate) const QEMU_MACHINE: &str =
    "microvm,acpi=off,x-option-roms=off,isa-serial=on,pit=on,pic=on,rtc=off";
/// QEMU's devices and console, as our VMM's: only the serial port on stdio (and the
/// i8042 that resets), and a reset ends QEMU.
pub(crate) const QEMU_DEVICES: [&str; 8] = [
    "-nodefaults",
    "-no-user-config",
    "-nographic",
    "-serial",
    "stdio",
    "-device",
    "i8042",
    "-no-reboot",
];
/// The command line our VMM gives the guest by default (it appends its virtio-mmio
/// devices, of which a boot with only an initrd has none).
pub(crate) const GUEST_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 quiet";
const NESTED_HOST_CPUS: &str = "2";
const NESTED_HOST_MEMORY_MIB: &str = "4096";
const INNER_FILE: &str = "boot.inner.json";
/// The boot figures' configurations (the issue's 1 and 2 vCPUs, 128 MiB and 1 GiB):
/// the first names its figures plainly, the others with a suffix.
pub const BOOT_CONFIGS: [BootConfig; 4] = [
    BootConfig::new(1, 128),
    BootConfig::new(2, 128),
    BootConfig::new(1, 1024),
    BootConfig::new(2, 1024),
];

/// The configurations to boot: the one `--cpus`/`--memory` select where either is
/// given (the other at its default, 1 vCPU or 128 MiB); else all of
/// [`BOOT_CONFIGS`], or with `--quick` only the first and the last.
pub fn boot_configs(quick: bool, cpus: Option<u32>, memory_mib: Option<u64>) -> Vec<BootConfig> {
    if cpus.is_some() || memory_mib.is_some() {
        let first = BOOT_CONFIGS[0];
        return vec![BootConfig::new(
            cpus.unwrap_or(first.vcpus),
            memory_mib.unwrap_or(first.memory_mib),
        )];
    }
    if quick {
        vec![BOOT_CONFIGS[0], BOOT_CONFIGS[BOOT_CONFIGS.len() - 1]]
    } else {
        BOOT_CONFIGS.to_vec()
    }
}

/// How long the memory runs' guest sleeps after its marker (while the VMM is measured).
const MEMORY_RUN_SLEEP_S: u64 = 3;

/// Targets on hardware KVM (the project's goals), printed beside the figures.
pub const BOOT_TO_INIT_TARGET_MS: f64 = 125.0;
pub const VMM_OVERHEAD_TARGET_MIB: f64 = 5.0;

const USAGE: &str = "\
usage: cargo bench -p vm-benches -- [OPTIONS]
       vm-bench [OPTIONS]

Boots our VMM and QEMU's microvm side by side and reports boot time and memory,
and how many VMs each starts per second in a loop of create/destroy (and whether
the host's memory comes back after it); then measures the workspace VM (vmctl
up, exec through the guest agent), its shared workspace directory over
virtio-fs against the host, requests through its egress proxy against the same
requests from the host, and `vmctl agent claude --version` cold and warm with
the host memory of idle VMs.

  --quick              a smoke run (about 2 minutes in the nested host, far
                       less on hardware KVM; checks the harness, not the
                       numbers): 1 boot per VMM and configuration (default
                       10), 1 memory run (3); boots
                       with 1 vCPU/128 MiB and 2 vCPUs/1024 MiB only (default:
                       also 2/128 and 1/1024); 1 cold exec per configuration
                       (3); 1 vmctl up, 20 client and 3 CLI exec round trips
                       (5, 200, 20); virtio-fs 8 MiB and 100 files once;
                       egress: 10 requests per curl call and 2 downloads of
                       16 MiB per side (50, and 3 of 64 MiB); agent: 1 cold
                       and 3 warm runs (3, 10), 1 idle VM in the nested host
                       (3; 10 on hardware KVM, where memory allows); churn: 2
                       create/destroy cycles per VMM (100)
  --only SECTIONS      measure only these sections (comma-separated, or the
                       option repeated): boot (boot time, memory and cold exec
                       against QEMU), churn, workspace, fs (virtio-fs against
                       the host), egress, agent; default: all of them
  --runs N             boots per VMM
  --memory-runs N      memory-measuring boots per VMM
  --ready-runs N       vmctl up on fresh workspaces
  --cold-runs N        cold `vmctl exec` per boot configuration (default 3;
                       quick 1): to the agent's answer and the first output
  --exec-iterations N  round trips of `true` through the guest agent's Rust client
  --cli-iterations N   round trips of `vmctl exec -- true`
  --churn-cycles N     churn: create/destroy cycles per VMM
  --fs-mib N           virtio-fs: the sequential file's size in MiB (default 256
                       on hardware KVM, 64 in the nested host, 16 with --quick)
  --fs-files N         virtio-fs: small files created and stat-ed, and the git
                       repository's files (default 10000; nested 1000; quick 200)
  --fs-runs N          virtio-fs: repetitions per side (default 3; quick 1)
  --fs-timeout SECS    virtio-fs: per script (default 600)
  --fs-cache POLICY    virtio-fs: the guest's caching, as vmctl's
                       VMCTL_VIRTIOFS_CACHE: auto (vmctl's default), never,
                       metadata or always, each optionally +writeback; to compare
                       them (only auto and never show host edits promptly)
  --out PATH           JSON report (default: target/bench/boot.json; Markdown next to it)
  --kernel PATH        guest kernel (default: kernel-config/build.sh guest)
  --initrd PATH        base initramfs (default: rootfs/build-initramfs.sh)
  --agent-initrd PATH  the workspace VM's agent initramfs
                       (default: guest-agent/build-initramfs.sh)
  --rootfs PATH        the workspace VM's root image (default: rootfs/build-rootfs.sh)
  --vmctl PATH         vmctl binary (default: $VMCTL_BIN or target/release/vmctl)
  --qemu PATH          QEMU binary (default: qemu-system-x86_64 from $PATH)
  --cpus N             guest vCPUs: boot this one configuration only (default:
                       the matrix of 1 and 2 vCPUs, 128 and 1024 MiB)
  --memory MIB         guest memory: likewise (with one of --cpus/--memory, the
                       other is 1 vCPU or 128 MiB)
  --timeout SECS       per boot, to the marker and again to exit; per vmctl
                       command and exec round trip (default 60)
  --nested auto|always|never
                       measure inside the nested host: where KVM is not
                       hardware-backed (auto, default), always, or never
";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Nested {
    Auto,
    Always,
    Never,
}

#[derive(Debug, Clone)]
struct Args {
    quick: bool,
    /// The sections to measure, in run order (`--only`; default: all).
    sections: Vec<Section>,
    runs: usize,
    memory_runs: usize,
    ready_runs: usize,
    /// Cold `vmctl exec` per boot configuration.
    cold_runs: usize,
    exec_iterations: usize,
    cli_iterations: usize,
    /// Churn: create/destroy cycles per VMM.
    churn_cycles: usize,
    /// The virtio-fs sizes given on the command line (defaults: [`crate::fs::sizes`]).
    fs_mib: Option<u64>,
    fs_files: Option<u64>,
    fs_runs: Option<usize>,
    fs_timeout: Duration,
    /// `--fs-cache`: vmctl's VMCTL_VIRTIOFS_CACHE for the virtio-fs VM.
    fs_cache: Option<String>,
    out: Option<PathBuf>,
    kernel: Option<PathBuf>,
    initrd: Option<PathBuf>,
    agent_initrd: Option<PathBuf>,
    rootfs: Option<PathBuf>,
    vmctl: Option<PathBuf>,
    qemu: Option<PathBuf>,
    /// The first boot configuration's (also the memory runs' and churn's).
    cpus: u32,
    memory_mib: u64,
    /// What `--cpus` / `--memory` said (passed on to the nested run as given).
    cpus_given: Option<u32>,
    memory_given: Option<u64>,
    /// The boot figures' configurations; `configs[0]` is (`cpus`, `memory_mib`).
    configs: Vec<BootConfig>,
    timeout: Duration,
    nested: Nested,
    /// Running inside the nested host: measure and write the report to this file.
    inner: Option<PathBuf>,
}

fn parse_args(argv: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        quick: false,
        sections: Vec::new(),
        runs: 0,
        memory_runs: 0,
        ready_runs: 0,
        cold_runs: 0,
        exec_iterations: 0,
        cli_iterations: 0,
        churn_cycles: 0,
        fs_mib: None,
        fs_files: None,
        fs_runs: None,
        fs_timeout: Duration::from_secs(600),
        fs_cache: None,
        out: None,
        kernel: None,
        initrd: None,
        agent_initrd: None,
        rootfs: None,
        vmctl: None,
        qemu: None,
        cpus: 1,
        memory_mib: 128,
        cpus_given: None,
        memory_given: None,
        configs: Vec::new(),
        timeout: Duration::from_secs(60),
        nested: Nested::Auto,
        inner: None,
    };
    let (mut runs, mut memory_runs) = (None, None);
    let (mut ready_runs, mut exec_iterations, mut cli_iterations) = (None, None, None);
    let mut cold_runs = None;
    let mut churn_cycles = None;
    let mut it = argv.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n\n{USAGE}"))
        };
        let number = |name: &str, v: String| {
            v.parse::<u64>()
                .map_err(|_| format!("{name}: not a number: {v:?}"))
        };
        match arg.as_str() {
            // cargo passes --bench to harness = false bench targets.
            "--bench" => {}
            "--quick" => a.quick = true,
            "--only" => crate::sections::add_named(&mut a.sections, &value("--only")?)?,
            "--runs" => runs = Some(number("--runs", value("--runs")?)? as usize),
            "--memory-runs" => {
                memory_runs = Some(number("--memory-runs", value("--memory-runs")?)? as usize)
            }
            "--ready-runs" => {
                ready_runs = Some(number("--ready-runs", value("--ready-runs")?)? as usize)
            }
            "--cold-runs" => {
                cold_runs = Some(number("--cold-runs", value("--cold-runs")?)? as usize)
            }
            "--exec-iterations" => {
                exec_iterations =
                    Some(number("--exec-iterations", value("--exec-iterations")?)? as usize)
            }
            "--cli-iterations" => {
                cli_iterations =
                    Some(number("--cli-iterations", value("--cli-iterations")?)? as usize)
            }
            "--churn-cycles" => {
                churn_cycles = Some(number("--churn-cycles", value("--churn-cycles")?)? as usize)
            }
            "--fs-mib" => a.fs_mib = Some(number("--fs-mib", value("--fs-mib")?)?),
            "--fs-files" => a.fs_files = Some(number("--fs-files", value("--fs-files")?)?),
            "--fs-runs" => a.fs_runs = Some(number("--fs-runs", value("--fs-runs")?)? as usize),
            "--fs-timeout" => {
                a.fs_timeout = Duration::from_secs(number("--fs-timeout", value("--fs-timeout")?)?)
            }
            "--fs-cache" => a.fs_cache = Some(value("--fs-cache")?),
            "--agent-initrd" => a.agent_initrd = Some(value("--agent-initrd")?.into()),
            "--rootfs" => a.rootfs = Some(value("--rootfs")?.into()),
            "--out" => a.out = Some(value("--out")?.into()),
            "--kernel" => a.kernel = Some(value("--kernel")?.into()),
            "--initrd" => a.initrd = Some(value("--initrd")?.into()),
            "--vmctl" => a.vmctl = Some(value("--vmctl")?.into()),
            "--qemu" => a.qemu = Some(value("--qemu")?.into()),
            "--cpus" => a.cpus_given = Some(number("--cpus", value("--cpus")?)? as u32),
            "--memory" => a.memory_given = Some(number("--memory", value("--memory")?)?),
            "--timeout" => {
                a.timeout = Duration::from_secs(number("--timeout", value("--timeout")?)?)
            }
            "--nested" => {
                a.nested = match value("--nested")?.as_str() {
                    "auto" => Nested::Auto,
                    "always" => Nested::Always,
                    "never" => Nested::Never,
                    v => {
                        return Err(format!(
                            "--nested: expected auto, always or never, not {v:?}"
                        ))
                    }
                }
            }
            "--inner" => a.inner = Some(value("--inner")?.into()),
            "-h" | "--help" => return Err(USAGE.to_string()),
            other => return Err(format!("unknown argument {other:?}\n\n{USAGE}")),
        }
    }
    if a.sections.is_empty() {
        a.sections = Section::ALL.to_vec();
    }
    a.runs = runs.unwrap_or(if a.quick { 1 } else { 10 });
    a.memory_runs = memory_runs.unwrap_or(if a.quick { 1 } else { 3 });
    a.ready_runs = ready_runs.unwrap_or(if a.quick { 1 } else { 5 });
    a.cold_runs = cold_runs.unwrap_or(if a.quick { 1 } else { 3 });
    a.exec_iterations = exec_iterations.unwrap_or(if a.quick { 20 } else { 200 });
    a.cli_iterations = cli_iterations.unwrap_or(if a.quick { 3 } else { 20 });
    a.churn_cycles = crate::churn::cycles(a.quick, churn_cycles);
    a.configs = boot_configs(a.quick, a.cpus_given, a.memory_given);
    (a.cpus, a.memory_mib) = (a.configs[0].vcpus, a.configs[0].memory_mib);
    if [
        a.runs,
        a.memory_runs,
        a.ready_runs,
        a.cold_runs,
        a.exec_iterations,
        a.cli_iterations,
        a.churn_cycles,
        a.cpus as usize,
        a.memory_mib as usize,
        a.fs_mib.unwrap_or(1) as usize,
        a.fs_files.unwrap_or(1) as usize,
        a.fs_runs.unwrap_or(1),
        a.fs_timeout.as_secs() as usize,
    ]
    .contains(&0)
    {
        return Err(
            "--runs, --memory-runs, --ready-runs, --cold-runs, --exec-iterations, --cli-iterations, \
                    --churn-cycles, --cpus, --memory, --fs-mib, --fs-files, --fs-runs and \
                    --fs-timeout must be at least 1"
                .into(),
        );
    }
    Ok(a)
}

/// The command-line entry point (bench target and `vm-bench` binary); the exit code.
pub fn main() -> i32 {
    match run(std::env::args().skip(1)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("vm-bench: error: {e}");
            1
        }
    }
}

/// A progress line on stderr.
pub(crate) fn say(msg: impl AsRef<str>) {
    eprintln!("vm-bench: {}", msg.as_ref());
}

fn run(argv: impl IntoIterator<Item = String>) -> Result<(), String> {
    let args = parse_args(argv)?;
    if let Some(inner_out) = &args.inner {
        // Inside the nested host: everything was resolved by the outer run.
        let tools = Tools {
            kernel: args.kernel.clone().ok_or("--inner needs --kernel")?,
            initrd: args.initrd.clone().ok_or("--inner needs --initrd")?,
            vmctl: args.vmctl.clone().ok_or("--inner needs --vmctl")?,
            qemu: args.qemu.clone().ok_or("--inner needs --qemu")?,
            agent_initrd: args
                .agent_initrd
                .clone()
                .ok_or("--inner needs --agent-initrd")?,
            rootfs: args.rootfs.clone().ok_or("--inner needs --rootfs")?,
        };
        let save = |report: &Report| {
            serde_json::to_string_pretty(report)
                .map_err(|e| e.to_string())
                .and_then(|json| {
                    fs::write(inner_out, json)
                        .map_err(|e| format!("write {}: {e}", inner_out.display()))
                })
        };
        // Each section's report so far, marked incomplete until the last one: what
        // the outer run salvages if this one never finishes.
        let checkpoint = |report: &Report, done: &str| {
            let mut partial = report.clone();
            partial.incomplete = Some(format!("the run stopped after {done}"));
            if let Err(e) = save(&partial) {
                say(format!("warning: cannot save the report so far: {e}"));
            }
        };
        return save(&measure(&args, &tools, &checkpoint)?);
    }

    let out = match &args.out {
        Some(p) => p.clone(),
        None => target_dir().join("bench").join("boot.json"),
    };
    let out_dir = out
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    fs::create_dir_all(&out_dir).map_err(|e| format!("create {}: {e}", out_dir.display()))?;
    let out_dir = out_dir
        .canonicalize()
        .map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let tools = resolve_tools(&args)?;

    // Before measuring: others may commit while the benchmark runs.
    let (commit, dirty) = git_commit();
    let nested = match args.nested {
        Nested::Auto => !hardware_kvm(),
        Nested::Always => true,
        Nested::Never => false,
    };
    let mut report = if nested {
        say(if hardware_kvm() {
            "--nested always: measuring inside the QEMU-TCG nested host (vmctl nested-exec)"
                .to_string()
        } else {
            "this machine's KVM is not hardware-backed (no kvm_intel/kvm_amd module): measuring inside \
             the QEMU-TCG nested host (vmctl nested-exec); absolute times are TCG-emulated, ratios are \
             what count"
                .to_string()
        });
        let mut inner = measure_nested(&args, &tools)?;
        inner.mode = "nested".into();
        inner.note = Some(NESTED_NOTE.into());
        inner.measured_on = Some(inner.machine.clone());
        inner.machine = Machine::this();
        inner
    } else {
        say(if hardware_kvm() {
            "KVM is hardware-backed here: measuring directly"
        } else {
            "--nested never: measuring directly on this machine's KVM"
        });
        measure(&args, &tools, &|_, _| {})?
    };
    report.commit = commit;
    report.dirty = dirty;
    report.fill_figure_metadata();
    // A virtio-fs or egress figure that failed is in the report, which is written;
    // the run still fails.
    let fs_errors = report.fs.as_ref().map(|f| f.errors()).unwrap_or_default();
    let egress_errors = report
        .egress
        .as_ref()
        .map(|e| e.errors())
        .unwrap_or_default();
    let agent_errors = report
        .agent
        .as_ref()
        .map(|a| a.errors())
        .unwrap_or_default();
    let churn_errors = report
        .churn
        .as_ref()
        .map(|c| c.errors())
        .unwrap_or_default();

    let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    let md_path = out.with_extension("md");
    let (charts, chart_links) = crate::report_charts::write(&report, &out_dir)?;
    let md = format!("{}\n{chart_links}", report.markdown());
    fs::write(&out, format!("{json}\n")).map_err(|e| format!("write {}: {e}", out.display()))?;
    fs::write(&md_path, &md).map_err(|e| format!("write {}: {e}", md_path.display()))?;
    println!("{json}");
    eprintln!("\n{md}");
    say(format!(
        "wrote {}, {} and {} chart(s) ({})",
        out.display(),
        md_path.display(),
        charts.len(),
        charts
            .iter()
            .map(|c| c.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    if let Some(why) = &report.incomplete {
        return Err(format!(
            "the report is incomplete (written with the sections measured): {why}"
        ));
    }
    if !churn_errors.is_empty()
        || !fs_errors.is_empty()
        || !egress_errors.is_empty()
        || !agent_errors.is_empty()
    {
        return Err(format!(
            "{} churn, {} virtio-fs, {} egress and {} agent figure(s) failed (the report was \
             written, with the errors):\n{}",
            churn_errors.len(),
            fs_errors.len(),
            egress_errors.len(),
            agent_errors.len(),
            churn_errors
                .iter()
                .chain(&fs_errors)
                .chain(&egress_errors)
                .chain(&agent_errors)
                .map(|(what, e)| format!("{what}: {e}"))
                .collect::<Vec<_>>()
                .join("\n")
        ));
    }
    Ok(())
}

/// The programs and images the benchmark runs.
#[derive(Debug, Clone)]
struct Tools {
    kernel: PathBuf,
    initrd: PathBuf,
    vmctl: PathBuf,
    qemu: PathBuf,
    /// The workspace VM's agent initramfs and root image.
    agent_initrd: PathBuf,
    rootfs: PathBuf,
}

impl Tools {
    /// What the workspace-VM sections run: vmctl and the guest it boots.
    fn guest_artifacts(&self) -> GuestArtifacts {
        GuestArtifacts {
            vmctl: self.vmctl.clone(),
            kernel: self.kernel.clone(),
            agent_initramfs: self.agent_initrd.clone(),
            rootfs: self.rootfs.clone(),
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("benches/ has a parent")
        .to_path_buf()
}

fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if Path::new(&d).is_absolute() => PathBuf::from(d),
        Some(d) => workspace_root().join(d),
        None => workspace_root().join("target"),
    }
}

/// Runs a build script of the workspace that prints an artifact path as its last line.
fn build_artifact(script: &str, args: &[&str]) -> Result<PathBuf, String> {
    let path = workspace_root().join(script);
    let out = Command::new(&path)
        .args(args)
        .current_dir(workspace_root())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("run {}: {e}", path.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} {} failed ({})",
            path.display(),
            args.join(" "),
            out.status
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    let artifact = PathBuf::from(last);
    if !artifact.is_file() {
        return Err(format!("{script} printed {last:?}, which is not a file"));
    }
    Ok(artifact)
}

fn find_in_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

fn newest_mtime(dir: &Path) -> Option<std::time::SystemTime> {
    let mut newest = None;
    for e in fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        let t = if p.is_dir() {
            newest_mtime(&p)
        } else {
            e.metadata().ok()?.modified().ok()
        };
        newest = newest.max(t);
    }
    newest
}

fn resolve_tools(args: &Args) -> Result<Tools, String> {
    let kernel = match &args.kernel {
        Some(k) => k.clone(),
        None => build_artifact("kernel-config/build.sh", &["guest"])?,
    };
    let initrd = match &args.initrd {
        Some(i) => i.clone(),
        None => build_artifact("rootfs/build-initramfs.sh", &[])?,
    };
    // The scripts vmctl up would run; cached builds make them quick.
    let agent_initrd = match &args.agent_initrd {
        Some(i) => i.clone(),
        None => build_artifact("guest-agent/build-initramfs.sh", &[])?,
    };
    let rootfs = match &args.rootfs {
        Some(r) => r.clone(),
        None => build_artifact("rootfs/build-rootfs.sh", &[])?,
    };
    let vmctl = match (&args.vmctl, std::env::var_os("VMCTL_BIN")) {
        (Some(v), _) => v.clone(),
        (None, Some(v)) => PathBuf::from(v),
        (None, None) => target_dir().join("release").join("vmctl"),
    };
    if !vmctl.is_file() {
        return Err(format!(
            "{} does not exist: build it first with 'cargo build --release -p vmctl' \
             (cargo bench does not build other packages' binaries)",
            vmctl.display()
        ));
    }
    // A stale vmctl would benchmark old code (or lack nested-exec): say so loudly.
    if let Ok(built) = fs::metadata(&vmctl).and_then(|m| m.modified()) {
        let ws = workspace_root();
        let newest = [
            ws.join("vmm/src"),
            ws.join("vmctl/src"),
            ws.join("guest-agent/src"),
        ]
        .iter()
        .filter_map(|d| newest_mtime(d))
        .max();
        if newest.is_some_and(|n| n > built) {
            say(format!(
                "warning: {} is older than the vmm/vmctl/guest-agent sources; run 'cargo build --release -p vmctl' \
                 to benchmark the current code",
                vmctl.display()
            ));
        }
    }
    let qemu = match &args.qemu {
        Some(q) => q.clone(),
        None => find_in_path("qemu-system-x86_64").ok_or(
            "qemu-system-x86_64 is not in PATH (apt-get install qemu-system-x86): the benchmark \
             compares against QEMU's microvm",
        )?,
    };
    let abs = |p: PathBuf| {
        p.canonicalize()
            .map_err(|e| format!("{}: {e}", p.display()))
    };
    Ok(Tools {
        kernel: abs(kernel)?,
        initrd: abs(initrd)?,
        vmctl: abs(vmctl)?,
        qemu: abs(qemu)?,
        agent_initrd: abs(agent_initrd)?,
        rootfs: abs(rootfs)?,
    })
}

fn git_commit() -> (Option<String>, Option<bool>) {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(workspace_root())
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"]).filter(|c| !c.is_empty());
    let dirty = commit
        .as_ref()
        .and(git(&["status", "--porcelain", "--untracked-files=no"]))
        .map(|s| !s.is_empty());
    (commit, dirty)
}

/// The project's goal for our figure `name` (any configuration), on hardware KVM.
fn hardware_target(name: &str) -> Option<f64> {
    match name.split('@').next()? {
        "boot_to_init_wall" => Some(BOOT_TO_INIT_TARGET_MS),
        "vmm_overhead_rss" => Some(VMM_OVERHEAD_TARGET_MIB),
        _ => None,
    }
}

/// Re-runs this binary inside a fresh nested host and returns the report it wrote.
/// Measures inside the nested host; where the nested host itself is lost (the
/// emulation's known problem), the sections not measured yet run again in a fresh
/// one ([`crate::nested_retry`]).
fn measure_nested(args: &Args, tools: &Tools) -> Result<Report, String> {
    let mut merged: Option<Report> = None;
    let mut sections = args.sections.clone();
    for attempt in 1..=nested_retry::ATTEMPTS {
        let run = run_nested(args, tools, &sections)?;
        if let Some(report) = run.report {
            match &mut merged {
                Some(merged) => nested_retry::merge(merged, report),
                None => merged = Some(report),
            }
        }
        sections = nested_retry::missing(&args.sections, merged.as_ref());
        let Some(why) = run.failure else { break };
        if sections.is_empty() {
            break;
        }
        if !run.nested_host_lost || attempt == nested_retry::ATTEMPTS {
            let note = nested_retry::incomplete_note(&why, &sections, attempt);
            return match merged {
                Some(mut report) => {
                    say(format!("error: {note}; keeping what was measured"));
                    report.incomplete = Some(note);
                    Ok(report)
                }
                None => Err(note),
            };
        }
        say(format!(
            "the nested host was lost ({why}); measuring {} again in a fresh one (nested \
             host {} of at most {})",
            crate::sections::join(&sections, ", "),
            attempt + 1,
            nested_retry::ATTEMPTS
        ));
    }
    let mut report = merged.ok_or("the nested run left no report")?;
    report.incomplete = None;
    Ok(report)
}

/// One run inside a nested host.
struct NestedRun {
    /// What it measured: all `sections` unless it failed, then those it finished.
    report: Option<Report>,
    /// Why it did not finish.
    failure: Option<String>,
    /// It lost the nested host itself (a stall, a reset, its kernel's crash), not a
    /// guest in it: worth running again.
    nested_host_lost: bool,
}

fn run_nested(args: &Args, tools: &Tools, sections: &[Section]) -> Result<NestedRun, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    // The only directory the nested host may write to, and one of its own: sharing
    // `--out`'s directory instead would make all of it a share there, `/tmp` too,
    // where the inner run's sockets could then not be bound.
    let exchange = TempDir::unique("-nested");
    fs::create_dir_all(&exchange.0).map_err(|e| format!("create {}: {e}", exchange.0.display()))?;
    let inner_file = exchange.0.join(INNER_FILE);
    let mut cmd = nested_command(args, tools, sections, &exe, &exchange.0);
    // Our stdout carries only the JSON: anything the nested host prints goes to stderr.
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    say(format!("running: {}", shell_words(&command_argv(&cmd))));
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("run {}: {e}", tools.vmctl.display()))?;
    // Relayed to our stderr; the time of the last line tells a nested host that
    // stopped making progress (whose own timeouts then never fire) from a slow one.
    let last_output = Arc::new(Mutex::new(Instant::now()));
    let nested_host_lost = Arc::new(AtomicBool::new(false));
    let mut relays = Vec::new();
    for pipe in [
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let last_output = Arc::clone(&last_output);
        let nested_host_lost = Arc::clone(&nested_host_lost);
        relays.push(thread::spawn(move || {
            for line in io::BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if let Ok(mut t) = last_output.lock() {
                    *t = Instant::now();
                }
                if nested_retry::says_nested_host_lost(&line) {
                    nested_host_lost.store(true, Ordering::Relaxed);
                }
                eprintln!("{line}");
            }
        }));
    }
    // The longest any one step may stay silent, with a margin.
    let silence_limit = [
        args.timeout,
        args.fs_timeout,
        crate::agent::AGENT_TIMEOUT,
        crate::egress::COMMAND_TIMEOUT,
    ]
    .into_iter()
    .max()
    .unwrap_or(args.timeout)
        + Duration::from_secs(120);
    // Every boot has its own timeouts inside; this only guards against a stuck nested host.
    let boots = (args.runs * args.configs.len() + args.memory_runs) as u32 * 2;
    // Each vmctl up, its rm, and the exec phase have their own timeouts too; so has
    // each cold exec and its rm.
    let workspace_steps =
        (args.ready_runs * 2 + 3 + args.cold_runs * args.configs.len() * 2) as u32;
    // virtio-fs: vmctl up and rm; per script its own timeout (probes, git setup and
    // warm-ups; per repetition 5 workloads on 2 sides and a host cache drop); then,
    // but in quick runs, the comparison of VMMs: its git setup, and per repetition a
    // boot of each VMM (with the waits for its virtiofsd).
    let fs_runs = crate::fs::sizes(args.quick, true, args.fs_mib, args.fs_files, args.fs_runs).runs;
    let fs_vmm_boots = if args.quick { 0 } else { fs_runs * 2 };
    let fs_scripts = (5 + fs_runs * 11 + 1 + fs_vmm_boots) as u32;
    let fs_virtiofsd_waits = crate::fs_vmm::VIRTIOFSD_WAIT * 2 * fs_vmm_boots as u32;
    // egress: policy, secret, vmctl up and rm; each curl call its own timeout.
    let egress_calls = crate::egress::sizes(args.quick).calls() as u32;
    // agent: every agent run, vmctl command and the idle VMs' settling.
    let agent = crate::agent::time_budget(
        &crate::agent::sizes(args.quick, true),
        args.timeout,
        &crate::agent::Settle::for_run(true, args.quick),
    );
    // churn: every cycle's boot of both VMMs, the sampling around each loop.
    let churn = crate::churn::time_budget(
        args.churn_cycles,
        2,
        args.timeout,
        &crate::churn::Sampling::for_run(args.quick),
    );
    let limit = Duration::from_secs(180)
        + args.timeout * (2 * boots + workspace_steps + 2 + 4)
        + args.fs_timeout * fs_scripts
        + fs_virtiofsd_waits
        + crate::egress::COMMAND_TIMEOUT * egress_calls
        + agent
        + churn;
    let started = Instant::now();
    // What the nested run saved (after each section) and why it stopped.
    let failed = |why: String, lost: bool| -> NestedRun {
        let report = fs::read_to_string(&inner_file)
            .ok()
            .and_then(|text| serde_json::from_str::<Report>(&text).ok());
        let done = report
            .as_ref()
            .and_then(|r| r.incomplete.clone())
            .unwrap_or_else(|| "it saved nothing".into());
        say(format!("error: {why} ({done})"));
        NestedRun {
            report,
            failure: Some(why),
            nested_host_lost: lost,
        }
    };
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        let silent = last_output.lock().map(|t| t.elapsed()).unwrap_or_default();
        // Stopped making progress is the nested host lost; running over the time
        // budget may be a slow step, which a second run would repeat.
        let stuck = if started.elapsed() > limit {
            Some((
                format!("did not finish within {} s", limit.as_secs()),
                false,
            ))
        } else if silent > silence_limit {
            Some((
                format!(
                    "printed nothing for {} s, longer than any step may take: the nested host \
                     stopped making progress (README: known problem; scripts/nested-monitor shows \
                     its vCPUs while it runs)",
                    silent.as_secs()
                ),
                true,
            ))
        } else {
            None
        };
        if let Some((why, lost)) = stuck {
            // SIGTERM first: vmctl then stops its QEMU.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            thread::sleep(Duration::from_secs(10));
            let _ = child.kill();
            let _ = child.wait();
            return Ok(failed(format!("the nested run {why}; killed"), lost));
        }
        thread::sleep(Duration::from_millis(100));
    };
    // vmctl's last lines, which say whether it lost the nested host, may still be on
    // their way through the relays.
    let relayed_by = Instant::now() + Duration::from_secs(5);
    while relays.iter().any(|r| !r.is_finished()) && Instant::now() < relayed_by {
        thread::sleep(Duration::from_millis(20));
    }
    if !status.success() {
        return Ok(failed(
            format!("the benchmark failed inside the nested host ({status}); see above"),
            nested_host_lost.load(Ordering::Relaxed),
        ));
    }
    let text = fs::read_to_string(&inner_file).map_err(|e| {
        format!(
            "the nested run left no report at {}: {e}",
            inner_file.display()
        )
    })?;
    let report = serde_json::from_str(&text)
        .map_err(|e| format!("{}: bad report: {e}", inner_file.display()))?;
    Ok(NestedRun {
        report: Some(report),
        failure: None,
        nested_host_lost: false,
    })
}

/// `vmctl nested-exec` running this binary (`exe`) for `sections`, with the only
/// writable share `exchange`, where the inner run leaves its report.
fn nested_command(
    args: &Args,
    tools: &Tools,
    sections: &[Section],
    exe: &Path,
    exchange: &Path,
) -> Command {
    let mut cmd = Command::new(&tools.vmctl);
    cmd.args([
        "nested-exec",
        "--cpus",
        NESTED_HOST_CPUS,
        "--memory",
        NESTED_HOST_MEMORY_MIB,
        "--writable",
    ])
    .arg(exchange)
    .arg("--")
    .arg(exe)
    .arg("--inner")
    .arg(exchange.join(INNER_FILE));
    let n = |v: u64| v.to_string();
    cmd.args([
        "--runs",
        &n(args.runs as u64),
        "--memory-runs",
        &n(args.memory_runs as u64),
    ])
    .args(["--timeout", &n(args.timeout.as_secs())])
    .args([
        "--ready-runs",
        &n(args.ready_runs as u64),
        "--cold-runs",
        &n(args.cold_runs as u64),
        "--exec-iterations",
        &n(args.exec_iterations as u64),
        "--cli-iterations",
        &n(args.cli_iterations as u64),
        "--churn-cycles",
        &n(args.churn_cycles as u64),
        "--fs-timeout",
        &n(args.fs_timeout.as_secs()),
    ])
    .arg("--kernel")
    .arg(&tools.kernel)
    .arg("--initrd")
    .arg(&tools.initrd)
    .arg("--vmctl")
    .arg(&tools.vmctl)
    .arg("--qemu")
    .arg(&tools.qemu)
    .arg("--agent-initrd")
    .arg(&tools.agent_initrd)
    .arg("--rootfs")
    .arg(&tools.rootfs);
    if args.quick {
        cmd.arg("--quick");
    }
    cmd.args(["--only", &crate::sections::to_arg(sections)]);
    if let Some(policy) = &args.fs_cache {
        cmd.args(["--fs-cache", policy]);
    }
    // Only the sizes given: the inner run picks the nested host's defaults (and the
    // same boot configurations as this run).
    for (flag, v) in [
        ("--cpus", args.cpus_given.map(u64::from)),
        ("--memory", args.memory_given),
        ("--fs-mib", args.fs_mib),
        ("--fs-files", args.fs_files),
        ("--fs-runs", args.fs_runs.map(|r| r as u64)),
    ] {
        if let Some(v) = v {
            cmd.args([flag, &n(v)]);
        }
    }
    cmd
}

fn command_argv(cmd: &Command) -> Vec<String> {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

pub(crate) fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Vmm {
    Ours,
    Qemu,
}

impl Vmm {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Vmm::Ours => OURS,
            Vmm::Qemu => QEMU,
        }
    }

    fn argv(self, tools: &Tools, initrd: &Path, config: BootConfig) -> Vec<OsString> {
        let mut v: Vec<OsString> = Vec::new();
        let mut push = |s: &dyn AsRef<std::ffi::OsStr>| v.push(s.as_ref().to_os_string());
        match self {
            Vmm::Ours => {
                push(&tools.vmctl);
                for a in ["boot", "--nested", "never", "--kernel"] {
                    push(&a);
                }
                push(&tools.kernel);
                push(&"--initrd");
                push(&initrd);
                push(&"--memory");
                push(&config.memory_mib.to_string());
                push(&"--cpus");
                push(&config.vcpus.to_string());
                push(&"--boot-time");
            }
            Vmm::Qemu => {
                push(&tools.qemu);
                for a in ["-M", QEMU_MACHINE, "-enable-kvm", "-cpu", "host", "-m"] {
                    push(&a);
                }
                push(&config.memory_mib.to_string());
                push(&"-smp");
                push(&config.vcpus.to_string());
                for a in QEMU_DEVICES {
                    push(&a);
                }
                push(&"-kernel");
                push(&tools.kernel);
                push(&"-initrd");
                push(&initrd);
                push(&"-append");
                push(&GUEST_CMDLINE);
            }
        }
        v
    }

    fn memory_rule(self, memory_mib: u64) -> GuestMemoryRule {
        match self {
            Vmm::Ours => GuestMemoryRule::NameContains(OUR_GUEST_RAM.into()),
            Vmm::Qemu => GuestMemoryRule::AnonymousAtLeast(memory_mib << 20),
        }
    }
}

/// One boot, measured.
#[derive(Debug)]
pub(crate) struct VmRun {
    /// The VMM's pid, which is also its process group's id.
    pub(crate) pid: u32,
    /// From spawning the process to the marker on its stdout.
    to_marker: Duration,
    /// From spawning the process to its exit.
    pub(crate) to_exit: Duration,
    stderr: String,
    memory: Option<MemoryUse>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Both VMMs, alternating which goes first so neither always runs on a warmer (or
/// busier) machine.
pub(crate) fn order(i: usize) -> [Vmm; 2] {
    if i.is_multiple_of(2) {
        [Vmm::Ours, Vmm::Qemu]
    } else {
        [Vmm::Qemu, Vmm::Ours]
    }
}

/// A temporary directory of the benchmark, removed whatever happens. Where a
/// `workspace::Vmctl` keeps its state in it, declare the `TempDir` first, so the VM's
/// cleanup runs before the directory goes.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    /// A fresh path `<tmp>/vm-bench<suffix>-<pid>-<nanos>` (not created yet).
    pub(crate) fn unique(suffix: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        TempDir(
            std::env::temp_dir().join(format!("vm-bench{suffix}-{}-{nanos}", std::process::id())),
        )
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Reads `files` once, so the first boot does not pay for loading them (over 9p in
/// the nested host) and is not special.
pub(crate) fn warm_page_cache(files: &[&Path]) -> Result<(), String> {
    for path in files {
        let mut f = fs::File::open(path).map_err(|e| format!("open {}: {e}", path.display()))?;
        io::copy(&mut f, &mut io::sink()).map_err(|e| format!("read {}: {e}", path.display()))?;
    }
    Ok(())
}

/// The first line `PROGRAM --version` prints (empty when it prints nothing).
pub(crate) fn version_line(program: &Path) -> String {
    Command::new(program)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(|l| l.trim().to_string())
        })
        .unwrap_or_default()
}

/// Measures on this machine's KVM. `checkpoint` gets the report so far after each
/// section, with what was done last.
fn measure(
    args: &Args,
    tools: &Tools,
    checkpoint: &dyn Fn(&Report, &str),
) -> Result<Report, String> {
    if !Path::new("/dev/kvm").exists() {
        return Err("/dev/kvm does not exist".into());
    }
    if !hardware_kvm() {
        say("warning: KVM is not hardware-backed here (no kvm_intel/kvm_amd); guests will likely fail to boot");
    }
    let tmp = TempDir::unique("");
    fs::create_dir_all(&tmp.0).map_err(|e| format!("create {}: {e}", tmp.0.display()))?;
    let base =
        fs::read(&tools.initrd).map_err(|e| format!("read {}: {e}", tools.initrd.display()))?;
    let sleep_s = MEMORY_RUN_SLEEP_S;
    let boot_initrd = tmp.0.join("boot-initrd.img");
    let memory_initrd = tmp.0.join("memory-initrd.img");
    let write = |path: &Path, script: &str| {
        fs::write(path, initramfs_with_script(&base, script))
            .map_err(|e| format!("write {}: {e}", path.display()))
    };
    write(&boot_initrd, &format!("echo {BOOT_MARKER}\n"))?;
    write(
        &memory_initrd,
        &format!("echo {MEMORY_MARKER}\nsleep {sleep_s}\n"),
    )?;
    warm_page_cache(&[&tools.kernel, &tools.initrd, &tools.vmctl, &tools.qemu])?;
    let qemu_version = version_line(&tools.qemu);
    let first = args.configs[0];
    let wanted = |section| args.sections.contains(&section);
    let (figures, ratios) = if wanted(Section::Boot) {
        measure_boot(args, tools, &memory_initrd, &boot_initrd)?
    } else {
        (Vec::new(), Vec::new())
    };

    let str_argv = |v: Vec<OsString>| {
        v.into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    };
    // The boot figures are in: from here on, each section is added when it is done,
    // and the report so far is saved (a nested host that stalls loses only the rest).
    let mut report = Report {
        benchmark: "boot".into(),
        incomplete: None,
        sections: args.sections.clone(),
        date: utc_now(),
        mode: "direct".into(),
        note: None,
        machine: Machine::this(),
        measured_on: None,
        commit: None,
        dirty: None,
        kernel: tools.kernel.display().to_string(),
        initrd: tools.initrd.display().to_string(),
        vmctl: tools.vmctl.display().to_string(),
        qemu: tools.qemu.display().to_string(),
        qemu_version,
        config: Config {
            runs: args.runs,
            quick: args.quick,
            vcpus: args.cpus,
            memory_mib: args.memory_mib,
            memory_runs: args.memory_runs,
            memory_run_sleep_s: sleep_s,
            timeout_s: args.timeout.as_secs(),
            marker: BOOT_MARKER.into(),
            configs: args.configs.clone(),
        },
        commands: [Vmm::Ours, Vmm::Qemu]
            .iter()
            .map(|v| (v.label().to_string(), str_argv(v.argv(tools, &boot_initrd, first))))
            .collect(),
        memory_rules: [Vmm::Ours, Vmm::Qemu]
            .iter()
            .map(|v| {
                (
                    v.label().to_string(),
                    format!(
                        "guest memory = {}; overhead = Rss of every other mapping of the VMM process \
                         (/proc/<pid>/smaps, read when the guest printed {MEMORY_MARKER})",
                        v.memory_rule(first.memory_mib).describe()
                    ),
                )
            })
            .collect(),
        figures,
        ratios,
        workspace: None,
        fs: None,
        egress: None,
        agent: None,
        churn: None,
    };
    checkpoint(
        &report,
        if wanted(Section::Boot) {
            "the boot figures"
        } else {
            "its start"
        },
    );

    // Churn: the same VM created and destroyed in a loop, ours then QEMU, right after
    // the boots (before the workspace VMs, whose daemons could still be settling).
    // Measuring inside the nested host is what --inner means.
    let nested = args.inner.is_some();
    if wanted(Section::Churn) {
        report.churn = Some(crate::churn::measure(&ChurnBench {
            vmms: [Vmm::Ours, Vmm::Qemu]
                .iter()
                .map(|v| (v.label().to_string(), v.argv(tools, &boot_initrd, first)))
                .collect(),
            marker: BOOT_MARKER.into(),
            cycles: args.churn_cycles,
            timeout: args.timeout,
            nested,
            meminfo: "/proc/meminfo".into(),
            proc: "/proc".into(),
            sampling: crate::churn::Sampling::for_run(args.quick),
            needle: boot_initrd.display().to_string(),
        }));
        checkpoint(&report, "churn");
    }

    // The workspace VM, in the same environment (no QEMU peer).
    if wanted(Section::Workspace) {
        report.workspace = Some(
            crate::workspace::measure(&WorkspaceBench {
                artifacts: tools.guest_artifacts(),
                ready_runs: args.ready_runs,
                exec_iterations: args.exec_iterations,
                cli_iterations: args.cli_iterations,
                timeout: args.timeout,
            })
            .map_err(|e| format!("workspace VM: {e}"))?,
        );
        checkpoint(&report, "the workspace VM");
    }

    // The shared workspace directory, guest against host, in the same environment.
    if wanted(Section::Fs) {
        report.fs = Some(crate::fs::measure(&FsBench {
            artifacts: tools.guest_artifacts(),
            sizes: crate::fs::sizes(args.quick, nested, args.fs_mib, args.fs_files, args.fs_runs),
            timeout: args.timeout,
            script_timeout: args.fs_timeout,
            cache: args.fs_cache.clone(),
            nested,
            drop_caches: crate::fs::DROP_CACHES_FILE.into(),
            // Not in the smoke run: in the nested host these boots of their own hang
            // far more often than the workspace VMs (benches/README.md).
            compare_with_qemu: (!args.quick).then(|| tools.qemu.clone()),
        }));
        checkpoint(&report, "virtio-fs");
    }
    // The egress path, guest against host, in the same environment.
    if wanted(Section::Egress) {
        report.egress = Some(crate::egress::measure(&EgressBench {
            artifacts: tools.guest_artifacts(),
            sizes: crate::egress::sizes(args.quick),
            timeout: args.timeout,
            command_timeout: crate::egress::COMMAND_TIMEOUT,
            nested,
            curl: "curl".into(),
        }));
        checkpoint(&report, "egress");
    }
    // The agent CLI's start, cold and warm, and idle VMs' memory, in the same
    // environment.
    if wanted(Section::Agent) {
        report.agent = Some(crate::agent::measure(&AgentBench {
            artifacts: tools.guest_artifacts(),
            sizes: crate::agent::sizes(args.quick, nested),
            timeout: args.timeout,
            agent_timeout: crate::agent::AGENT_TIMEOUT,
            nested,
            meminfo: "/proc/meminfo".into(),
            settle: crate::agent::Settle::for_run(nested, args.quick),
        }));
    }
    Ok(report)
}

/// The boot section: memory and boot runs of both VMMs on the test initramfs, their
/// figures and ratios, then the cold `vmctl exec` end points per configuration.
fn measure_boot(
    args: &Args,
    tools: &Tools,
    memory_initrd: &Path,
    boot_initrd: &Path,
) -> Result<(Vec<Figure>, Vec<Ratio>), String> {
    let first = args.configs[0];
    say(format!(
        "{} boot(s) per VMM with each of {}; {} memory run(s) per VMM with {}; on {} ({})",
        args.runs,
        BootConfig::labels(&args.configs),
        args.memory_runs,
        first.label(),
        Machine::this().hostname,
        Machine::this().cpu_model
    ));

    // Memory first: these boots also warm everything up before the timed ones.
    let mut memory: Vec<(Vmm, MemoryUse)> = Vec::new();
    for i in 0..args.memory_runs {
        for vmm in order(i) {
            let argv = vmm.argv(tools, memory_initrd, first);
            let rule = vmm.memory_rule(first.memory_mib);
            let r = run_vm(vmm.label(), &argv, MEMORY_MARKER, args.timeout, Some(&rule))?;
            let m = r.memory.expect("memory measured");
            say(format!(
                "[memory {}/{}] {:>12}: overhead {:.2} MiB, total RSS {:.2} MiB, guest {:.2} MiB \
                 ({} mapping(s), {} MiB mapped)",
                i + 1,
                args.memory_runs,
                vmm.label(),
                mib(m.overhead_rss_kib),
                mib(m.total_rss_kib),
                mib(m.guest_rss_kib),
                m.guest_mappings,
                m.guest_mapped_kib >> 10
            ));
            memory.push((vmm, m));
        }
    }

    let mut boots: Vec<(BootConfig, Vmm, VmRun)> = Vec::new();
    for &config in &args.configs {
        for i in 0..args.runs {
            for vmm in order(i) {
                let argv = vmm.argv(tools, boot_initrd, config);
                let r = run_vm(vmm.label(), &argv, BOOT_MARKER, args.timeout, None)?;
                let timer = match vmm {
                    Vmm::Ours => {
                        let t = parse_boot_timer(&r.stderr).ok_or_else(|| {
                            format!(
                                "{OURS} printed no boot-timer line on stderr (--boot-time):\n{}",
                                tail(&r.stderr, 2000)
                            )
                        })?;
                        format!(
                            ", boot timer {:.0} ms (VMM start) / {:.0} ms (first vCPU)",
                            t.since_vmm_start_ms, t.since_first_vcpu_ms
                        )
                    }
                    Vmm::Qemu => String::new(),
                };
                say(format!(
                    "[boot {}/{}, {}] {:>12}: init {:.0} ms, exit {:.0} ms{timer}",
                    i + 1,
                    args.runs,
                    config.label(),
                    vmm.label(),
                    ms(r.to_marker),
                    ms(r.to_exit)
                ));
                boots.push((config, vmm, r));
            }
        }
    }

    let boot_samples = |config: BootConfig, vmm: Vmm, f: &dyn Fn(&VmRun) -> f64| -> Vec<f64> {
        boots
            .iter()
            .filter(|(c, v, _)| *c == config && *v == vmm)
            .map(|(_, _, r)| f(r))
            .collect()
    };
    let memory_samples = |vmm: Vmm, f: &dyn Fn(&MemoryUse) -> f64| -> Vec<f64> {
        memory
            .iter()
            .filter(|(v, _)| *v == vmm)
            .map(|(_, m)| f(m))
            .collect()
    };
    let timer = |f: fn(&crate::scan::BootTimer) -> f64| {
        move |r: &VmRun| parse_boot_timer(&r.stderr).map_or(f64::NAN, |t| f(&t))
    };
    // The boot figures of each configuration (in order: the first one's keep the
    // plain names), then the memory figures (the first configuration's).
    let mut specs: Vec<(String, &str, Vmm, Vec<f64>)> = Vec::new();
    for (k, &config) in args.configs.iter().enumerate() {
        let name = |base: &str| config.figure_name(base, k == 0);
        for vmm in [Vmm::Ours, Vmm::Qemu] {
            specs.push((
                name("boot_to_init_wall"),
                "ms",
                vmm,
                boot_samples(config, vmm, &|r| ms(r.to_marker)),
            ));
        }
        specs.push((
            name("boot_timer_since_vmm_start"),
            "ms",
            Vmm::Ours,
            boot_samples(config, Vmm::Ours, &timer(|t| t.since_vmm_start_ms)),
        ));
        specs.push((
            name("boot_timer_since_first_vcpu"),
            "ms",
            Vmm::Ours,
            boot_samples(config, Vmm::Ours, &timer(|t| t.since_first_vcpu_ms)),
        ));
        for vmm in [Vmm::Ours, Vmm::Qemu] {
            specs.push((
                name("total_wall"),
                "ms",
                vmm,
                boot_samples(config, vmm, &|r| ms(r.to_exit)),
            ));
        }
    }
    for vmm in [Vmm::Ours, Vmm::Qemu] {
        specs.push((
            "vmm_overhead_rss".into(),
            "MiB",
            vmm,
            memory_samples(vmm, &|m| mib(m.overhead_rss_kib)),
        ));
    }
    for vmm in [Vmm::Ours, Vmm::Qemu] {
        specs.push((
            "total_rss".into(),
            "MiB",
            vmm,
            memory_samples(vmm, &|m| mib(m.total_rss_kib)),
        ));
    }
    for vmm in [Vmm::Ours, Vmm::Qemu] {
        specs.push((
            "guest_memory_rss".into(),
            "MiB",
            vmm,
            memory_samples(vmm, &|m| mib(m.guest_rss_kib)),
        ));
    }
    let mut figures = Vec::new();
    for (name, unit, vmm, samples) in specs {
        let n = samples.len();
        let figure = Figure::new(&name, unit, vmm.label(), samples)
            .ok_or_else(|| format!("{name} ({}): no valid samples out of {n}", vmm.label()))?;
        figures.push(match (vmm, hardware_target(&name)) {
            (Vmm::Ours, Some(below)) => figure.with_hardware_target(below),
            _ => figure,
        });
    }
    let ratios = ratios(&figures);

    // The later boot end points (agent ready, first exec output) per configuration.
    figures.extend(
        crate::cold_start::measure(&ColdStartBench {
            artifacts: tools.guest_artifacts(),
            configs: args.configs.clone(),
            runs: args.cold_runs,
            timeout: args.timeout,
        })
        .map_err(|e| format!("cold start: {e}"))?,
    );
    Ok((figures, ratios))
}

/// Reads a pipe to its end on a thread.
fn drain(mut pipe: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut all = Vec::new();
        let _ = pipe.read_to_end(&mut all);
        all
    })
}

/// Boots one VM: spawns `argv`, waits for `marker` on its stdout (reading
/// `/proc/<pid>/smaps` then, if `memory` is given), then for its exit. A VM that does
/// not print the marker, or exit, within `timeout` each, or that exits with an error,
/// is killed and is an error.
pub(crate) fn run_vm(
    label: &str,
    argv: &[OsString],
    marker: &str,
    timeout: Duration,
    memory: Option<&GuestMemoryRule>,
) -> Result<VmRun, String> {
    let command_line = shell_words(
        &argv
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>(),
    );
    let start = Instant::now();
    // stdin is a pipe we hold open: vmctl feeds stdin to the guest's serial port and
    // cannot poll /dev/null, and QEMU reads it for -serial stdio.
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("{label}: cannot run {command_line}: {e}"))?;
    let pid = child.id();
    let stdin = child.stdin.take();
    let mut stdout = child.stdout.take().expect("piped");
    let stderr = drain(child.stderr.take().expect("piped"));
    let (tx, rx) = mpsc::channel();
    let scanner_marker = marker.to_string();
    let stdout = thread::spawn(move || {
        let mut scanner = MarkerScanner::new(&scanner_marker);
        let mut all = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match stdout.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let seen = scanner.found();
                    if scanner.feed(&buf[..n]) && !seen {
                        let _ = tx.send(Instant::now());
                    }
                    all.extend_from_slice(&buf[..n]);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        all
    });

    let fail = |mut child: Child,
                why: String,
                stdout: JoinHandle<Vec<u8>>,
                stderr: JoinHandle<Vec<u8>>| {
        // The whole process group: a VMM's helpers must not keep its pipes open.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", child.id())])
            .stderr(Stdio::null())
            .status();
        let _ = child.kill();
        let status = child.wait();
        let out = String::from_utf8_lossy(&stdout.join().unwrap_or_default()).into_owned();
        let err = String::from_utf8_lossy(&stderr.join().unwrap_or_default()).into_owned();
        // Said first, in the words the VM tests' retries look for.
        let why = match crate::scan::guest_kernel_crash(&out) {
            Some(report) if crate::scan::has_kernel_timestamp(report) => {
                format!("the guest kernel crashed ({report}); {why}")
            }
            Some(report) => format!("the nested host's kernel crashed ({report}); {why}"),
            None => why,
        };
        format!(
            "{label}: {why}\n  command: {command_line}\n  status: {}\n--- stdout (tail) ---\n{}\n--- stderr \
             (tail) ---\n{}",
            status.map_or_else(|e| e.to_string(), |s| s.to_string()),
            tail(&out, 3000),
            tail(&err, 3000)
        )
    };

    let marker_at = match rx.recv_timeout(timeout) {
        Ok(t) => t,
        Err(RecvTimeoutError::Timeout) => {
            let why = format!(
                "the guest did not print {marker} within {} s: killed",
                timeout.as_secs()
            );
            return Err(fail(child, why, stdout, stderr));
        }
        Err(RecvTimeoutError::Disconnected) => {
            // stdout closed without the marker: the VMM exited (or closed it).
            let _ = wait_until(&mut child, start + timeout);
            let why = format!("stdout closed before the guest printed {marker}");
            return Err(fail(child, why, stdout, stderr));
        }
    };
    let memory = match memory {
        None => None,
        Some(rule) => {
            let path = format!("/proc/{}/smaps", child.id());
            let read = fs::read_to_string(&path)
                .map_err(|e| format!("read {path}: {e}"))
                .and_then(|text| parse_smaps(&text).map_err(|e| format!("{path}: {e}")));
            match read {
                Ok(maps) => {
                    let m = account(&maps, rule);
                    if m.guest_mappings == 0 {
                        let why =
                            format!("no guest memory mapping in {path} ({})", rule.describe());
                        return Err(fail(child, why, stdout, stderr));
                    }
                    Some(m)
                }
                Err(why) => return Err(fail(child, why, stdout, stderr)),
            }
        }
    };
    let status = match wait_until(&mut child, marker_at + timeout) {
        Ok(Some(s)) => s,
        Ok(None) => {
            let why = format!(
                "the guest printed {marker} but the VMM did not exit within {} s after: killed",
                timeout.as_secs()
            );
            return Err(fail(child, why, stdout, stderr));
        }
        Err(e) => return Err(fail(child, format!("wait: {e}"), stdout, stderr)),
    };
    let exit_at = Instant::now();
    drop(stdin);
    let out = stdout.join().unwrap_or_default();
    let err = String::from_utf8_lossy(&stderr.join().unwrap_or_default()).into_owned();
    if !status.success() {
        return Err(format!(
            "{label}: exited with {status}\n  command: {command_line}\n--- stdout (tail) ---\n{}\n--- stderr \
             (tail) ---\n{}",
            tail(&String::from_utf8_lossy(&out), 3000),
            tail(&err, 3000)
        ));
    }
    Ok(VmRun {
        pid,
        to_marker: marker_at - start,
        to_exit: exit_at - start,
        stderr: err,
        memory,
    })
}

/// Polls `child` (every 2 ms) until it exits or `deadline` passes (`Ok(None)`).
fn wait_until(child: &mut Child, deadline: Instant) -> io::Result<Option<ExitStatus>> {
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(Some(s));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        thread::sleep(Duration::from_millis(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Result<Args, String> {
        parse_args(v.iter().map(|s| s.to_string()))
    }

    #[test]
    fn quick_and_defaults() {
        let a = args(&["--bench"]).unwrap();
        assert_eq!((a.runs, a.memory_runs, a.quick), (10, 3, false));
        assert_eq!((a.cpus, a.memory_mib), (1, 128));
        let q = args(&["--quick", "--bench"]).unwrap();
        assert_eq!((q.runs, q.memory_runs, q.cold_runs), (1, 1, 1));
        assert_eq!(a.cold_runs, 3);
        assert_eq!(
            (a.ready_runs, a.exec_iterations, a.cli_iterations),
            (5, 200, 20)
        );
        assert_eq!(
            (q.ready_runs, q.exec_iterations, q.cli_iterations),
            (1, 20, 3)
        );
        let r = args(&["--quick", "--runs", "5"]).unwrap();
        assert_eq!(r.runs, 5);
        let w = args(&["--ready-runs", "1", "--exec-iterations", "7"]).unwrap();
        assert_eq!((w.ready_runs, w.exec_iterations), (1, 7));
        assert!(args(&["--cli-iterations", "0"]).is_err());
        assert_eq!((a.churn_cycles, q.churn_cycles), (100, 2));
        assert_eq!(
            args(&["--quick", "--churn-cycles", "4"])
                .unwrap()
                .churn_cycles,
            4
        );
        assert!(args(&["--churn-cycles", "0"]).is_err());
        assert_eq!((a.fs_mib, a.fs_files, a.fs_runs), (None, None, None));
        assert_eq!(a.fs_timeout, Duration::from_secs(600));
        let f = args(&["--fs-mib", "8", "--fs-files", "50", "--fs-runs", "2"]).unwrap();
        assert_eq!(
            (f.fs_mib, f.fs_files, f.fs_runs),
            (Some(8), Some(50), Some(2))
        );
        assert!(args(&["--fs-files", "0"]).is_err());
        assert!(args(&["--fs-runs", "0"]).is_err());
        assert_eq!(a.fs_cache, None);
        assert_eq!(
            args(&["--fs-cache", "always+writeback"]).unwrap().fs_cache,
            Some("always+writeback".into())
        );
        assert!(args(&["--runs", "0"]).is_err());
        assert!(args(&["--frobnicate"]).is_err());
        assert!(args(&["--nested", "sometimes"]).is_err());
        assert_eq!(
            args(&["--nested", "always"]).unwrap().nested,
            Nested::Always
        );
        assert_eq!(a.sections, Section::ALL);
        assert_eq!(
            args(&["--only", "egress,fs", "--only", "boot"])
                .unwrap()
                .sections,
            [Section::Boot, Section::Fs, Section::Egress]
        );
        assert!(args(&["--only", "disks"]).is_err());
        assert!(args(&["--only"]).is_err());
    }

    #[test]
    fn commands_match_the_documented_ones() {
        let tools = Tools {
            kernel: "/k".into(),
            initrd: "/i".into(),
            vmctl: "/v".into(),
            qemu: "/q".into(),
            agent_initrd: "/a".into(),
            rootfs: "/r".into(),
        };
        let a = args(&[]).unwrap();
        let s = |v: Vec<OsString>| {
            v.iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(
            s(Vmm::Ours.argv(&tools, Path::new("/x"), a.configs[0])),
            "/v boot --nested never --kernel /k --initrd /x --memory 128 --cpus 1 --boot-time"
        );
        let q = s(Vmm::Qemu.argv(&tools, Path::new("/x"), a.configs[0]));
        assert!(q.starts_with("/q -M microvm,acpi=off"), "{q}");
        assert!(q.contains("-m 128 -smp 1"), "{q}");
        assert!(
            q.contains("-no-reboot -kernel /k -initrd /x -append"),
            "{q}"
        );
        assert!(q.ends_with(GUEST_CMDLINE), "{q}");
        let big = BootConfig::new(2, 1024);
        assert!(s(Vmm::Ours.argv(&tools, Path::new("/x"), big)).contains("--memory 1024 --cpus 2"));
        assert!(s(Vmm::Qemu.argv(&tools, Path::new("/x"), big)).contains("-m 1024 -smp 2"));
    }

    #[test]
    fn the_nested_host_may_write_only_to_its_exchange_directory() {
        let tools = Tools {
            kernel: "/k".into(),
            initrd: "/i".into(),
            vmctl: "/v".into(),
            qemu: "/q".into(),
            agent_initrd: "/a".into(),
            rootfs: "/r".into(),
        };
        // --out in /tmp itself: its directory must not become the share.
        let a = args(&["--out", "/tmp/x.json", "--fs-mib", "4"]).unwrap();
        let cmd = nested_command(
            &a,
            &tools,
            &[Section::Fs, Section::Agent],
            Path::new("/b/vm-bench"),
            Path::new("/tmp/vm-bench-nested-1"),
        );
        let argv = command_argv(&cmd);
        let writable: Vec<&str> = argv
            .windows(2)
            .filter(|w| w[0] == "--writable")
            .map(|w| w[1].as_str())
            .collect();
        assert_eq!(writable, ["/tmp/vm-bench-nested-1"], "{argv:?}");
        let line = shell_words(&argv);
        assert!(
            line.starts_with("/v nested-exec --cpus 2 --memory 4096 --writable /tmp/vm-bench-nested-1 -- /b/vm-bench --inner /tmp/vm-bench-nested-1/boot.inner.json "),
            "{line}"
        );
        // Only the sections asked for, and the sizes given.
        assert!(line.contains(" --only fs,agent"), "{line}");
        assert!(line.contains(" --fs-mib 4"), "{line}");
        assert!(!line.contains("--fs-files"), "{line}");
        assert!(!line.contains("/tmp/x.json"), "{line}");
    }

    #[test]
    fn targets_apply_to_every_configuration() {
        assert_eq!(hardware_target("boot_to_init_wall"), Some(125.0));
        assert_eq!(
            hardware_target("boot_to_init_wall@2cpu-1024mib"),
            Some(125.0)
        );
        assert_eq!(hardware_target("vmm_overhead_rss"), Some(5.0));
        assert_eq!(hardware_target("total_wall"), None);
    }

    #[test]
    fn boot_configurations() {
        let c = |v: u32, m: u64| BootConfig::new(v, m);
        // Full: the whole matrix, the former single configuration first.
        assert_eq!(
            boot_configs(false, None, None),
            [c(1, 128), c(2, 128), c(1, 1024), c(2, 1024)]
        );
        // Quick: the first and the last.
        assert_eq!(boot_configs(true, None, None), [c(1, 128), c(2, 1024)]);
        // Explicit: one configuration, the other value at its default, quick or not.
        assert_eq!(boot_configs(false, Some(2), Some(512)), [c(2, 512)]);
        assert_eq!(boot_configs(true, Some(2), None), [c(2, 128)]);
        assert_eq!(boot_configs(false, None, Some(1024)), [c(1, 1024)]);

        let a = args(&[]).unwrap();
        assert_eq!(a.configs.len(), 4);
        assert_eq!((a.cpus, a.memory_mib), (1, 128));
        assert_eq!((a.cpus_given, a.memory_given), (None, None));
        let q = args(&["--quick"]).unwrap();
        assert_eq!(q.configs, [c(1, 128), c(2, 1024)]);
        let e = args(&["--cpus", "2", "--memory", "256"]).unwrap();
        assert_eq!(e.configs, [c(2, 256)]);
        assert_eq!((e.cpus, e.memory_mib), (2, 256));
        assert_eq!((e.cpus_given, e.memory_given), (Some(2), Some(256)));
        assert!(args(&["--cpus", "0"]).is_err());
        assert!(args(&["--memory", "0"]).is_err());
    }

    fn sh(script: &str) -> Vec<OsString> {
        vec!["sh".into(), "-c".into(), script.into()]
    }

    #[test]
    fn run_vm_times_marker_and_exit() {
        let r = run_vm(
            "sh",
            &sh("echo hi; echo MARK-X; sleep 0.2"),
            "MARK-X",
            Duration::from_secs(10),
            None,
        )
        .unwrap();
        assert!(r.to_marker < r.to_exit, "{r:?}");
        assert!(r.pid > 0, "{r:?}");
        assert!(
            r.to_exit - r.to_marker >= Duration::from_millis(150),
            "{r:?}"
        );
    }

    #[test]
    fn run_vm_kills_a_vm_without_marker() {
        let started = Instant::now();
        let e = run_vm(
            "sh",
            &sh("echo booting; sleep 30"),
            "MARK-X",
            Duration::from_secs(1),
            None,
        )
        .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(e.contains("did not print MARK-X within 1 s: killed"), "{e}");
        assert!(e.contains("booting"), "{e}");
    }

    #[test]
    fn run_vm_reports_failures() {
        let e = run_vm(
            "sh",
            &sh("echo '[ 1.6] BUG: kernel NULL pointer dereference'; exit 0"),
            "MARK-X",
            Duration::from_secs(10),
            None,
        )
        .unwrap_err();
        assert!(
            e.contains(
                "the guest kernel crashed ([ 1.6] BUG: kernel NULL pointer dereference); \
                 stdout closed before"
            ),
            "{e}"
        );
        let e = run_vm(
            "sh",
            &sh("echo oops >&2; exit 3"),
            "MARK-X",
            Duration::from_secs(10),
            None,
        )
        .unwrap_err();
        assert!(
            e.contains("stdout closed before") && e.contains("oops"),
            "{e}"
        );
        let e = run_vm(
            "sh",
            &sh("echo MARK-X; exit 2"),
            "MARK-X",
            Duration::from_secs(10),
            None,
        )
        .unwrap_err();
        assert!(e.contains("exited with exit status: 2"), "{e}");
        let e = run_vm(
            "sh",
            &sh("echo MARK-X; sleep 30"),
            "MARK-X",
            Duration::from_secs(1),
            None,
        )
        .unwrap_err();
        assert!(e.contains("did not exit within 1 s"), "{e}");
    }

    #[test]
    fn shell_words_quotes() {
        assert_eq!(
            shell_words(&["a".into(), "b c".into(), "it's".into()]),
            r"a 'b c' 'it'\''s'"
        );
    }
}
