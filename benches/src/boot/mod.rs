//! The boot benchmark: boots our VMM (`vmctl boot --nested never`) and QEMU's microvm
//! side by side, N times each, and reports boot time, total run time and VMM memory
//! overhead. Where this machine's KVM is not hardware-backed, it re-runs itself inside
//! the QEMU-TCG nested host (`vmctl nested-exec ... -- <this binary> ... --inner`),
//! so the same code measures in both places.

use std::ffi::OsString;
use std::fs;
use std::io::{self, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::agent::AgentBench;
use crate::churn::ChurnBench;
use crate::cold_start::ColdStartBench;
use crate::egress::EgressBench;
use crate::fs::FsBench;
use crate::report::{
    hardware_kvm, ratios, utc_now, BootConfig, Config, Figure, Machine, Ratio, Report, NESTED_NOTE,
    OURS, QEMU,
};
use crate::scan::{parse_boot_timer, tail, MarkerScanner};
use crate::sections::Section;
use crate::smaps::{account, parse_smaps, GuestMemoryRule, MemoryUse};
use crate::stats::ms;
use crate::workspace::{MemoryReturnSizes, WorkspaceBench};
use vm_tests::initramfs_with_script;
use vmm::process::cpus::CpuSet;

mod args;
mod nested;
mod nested_retry;
mod tools;

use args::{parse_args, Args, Nested};
use nested::measure_nested;
use tools::{resolve_tools, target_dir, workspace_root, Tools};

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
/// The command line our VMM gives the guest by default, as QEMU gets it (ours appends
/// its virtio-mmio devices: in a boot with only an initrd, the rng's; QEMU's microvm
/// here has none).
pub(crate) const GUEST_CMDLINE: &str = vmm::config::DEFAULT_CMDLINE;
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
            // The outer run found it where a section needs it (resolve_tools).
            qemu: args.qemu.clone(),
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
        // A section that fails after others were measured still leaves their report,
        // written below and marked incomplete with the failure.
        let so_far: std::cell::RefCell<Option<Report>> = std::cell::RefCell::new(None);
        let checkpoint = |report: &Report, done: &str| {
            let mut partial = report.clone();
            partial.incomplete = Some(format!("the run stopped after {done}"));
            *so_far.borrow_mut() = Some(partial);
        };
        match measure(&args, &tools, &checkpoint) {
            Ok(report) => report,
            Err(e) => match so_far.into_inner() {
                Some(mut partial) => {
                    let done = partial.incomplete.take().unwrap_or_default();
                    partial.incomplete = Some(format!("{done}, then failed: {e}"));
                    partial
                }
                None => return Err(e),
            },
        }
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
    let workspace_errors = report
        .workspace
        .as_ref()
        .map(|w| w.errors())
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
        || !workspace_errors.is_empty()
        || !fs_errors.is_empty()
        || !egress_errors.is_empty()
        || !agent_errors.is_empty()
    {
        return Err(format!(
            "{} churn, {} workspace VM, {} virtio-fs, {} egress and {} agent figure(s) failed \
             (the report was written, with the errors):\n{}",
            churn_errors.len(),
            workspace_errors.len(),
            fs_errors.len(),
            egress_errors.len(),
            agent_errors.len(),
            churn_errors
                .iter()
                .chain(&workspace_errors)
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

pub(crate) fn command_argv(cmd: &Command) -> Vec<String> {
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
                // QEMU's microvm gets no balloon and no virtio console either (ours
                // keeps its virtio-rng): the figures stay comparable with those from
                // before them.
                push(&"--no-free-page-reporting");
                push(&"--no-virtio-console");
                push(&"--boot-time");
            }
            Vmm::Qemu => {
                // Run only where resolve_tools found QEMU (the sections that need it).
                push(
                    &tools
                        .qemu
                        .as_deref()
                        .unwrap_or(Path::new(tools::QEMU_PROGRAM)),
                );
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
    pub(crate) stderr: String,
    memory: Option<MemoryUse>,
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
    let mut programs = vec![
        tools.kernel.as_path(),
        tools.initrd.as_path(),
        tools.vmctl.as_path(),
    ];
    programs.extend(tools.qemu.as_deref());
    warm_page_cache(&programs)?;
    let qemu_version = tools.qemu.as_deref().map(version_line).unwrap_or_default();
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
        qemu: tools
            .qemu
            .as_ref()
            .map(|q| q.display().to_string())
            .unwrap_or_default(),
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
            vmm_cpus: vm_cpus()?.map(|cpus| cpus.list().to_string()),
        },
        commands: tools
            .vmms()
            .iter()
            .map(|v| (v.label().to_string(), str_argv(v.argv(tools, &boot_initrd, first))))
            .collect(),
        memory_rules: tools
            .vmms()
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
                memory_return: MemoryReturnSizes::for_run(args.quick, args.free_page_rounds),
                nested,
            })
            .map_err(|e| format!("workspace VM: {e}"))?,
        );
        checkpoint(&report, "the workspace VM");
    }

    // The shared workspace directory, guest against host, in the same environment.
    if wanted(Section::Fs) {
        report.fs = Some(crate::fs::measure(&FsBench {
            artifacts: tools.guest_artifacts(),
            sizes: crate::fs::sizes(
                args.quick,
                nested,
                args.fs_mib,
                args.fs_files,
                args.fs_runs,
                args.fs_edit_rounds,
            ),
            timeout: args.timeout,
            script_timeout: args.fs_timeout,
            cache: args.fs_cache.clone(),
            nested,
            hardware_kvm: hardware_kvm(),
            hypervisor: Machine::this().hypervisor,
            drop_caches: crate::fs::DROP_CACHES_FILE.into(),
            // Not in the smoke run: in the nested host these boots of their own hang
            // far more often than the workspace VMs (benches/README.md).
            compare_with_qemu: if args.quick { None } else { tools.qemu.clone() },
            host_edits: crate::fs::host_edits_forwarded(
                std::env::var(crate::fs::HOST_EDITS_ENV).ok().as_deref(),
            ),
            guest_disk_parent: crate::fs::GUEST_DISK_PARENT.into(),
        }));
        if !args.quick && tools.qemu.is_none() {
            if let Some(fs) = report.fs.as_mut() {
                let why = format!(
                    "The same workloads under each VMM (fs.by_vmm) were not measured: {}.",
                    tools::QEMU_MISSING
                );
                say(format!("virtio-fs: {why}"));
                fs.notes.push(why);
            }
        }
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

/// The CPUs every VM [`run_vm`] boots runs on, ours and QEMU's alike, from its spawn
/// on: `VMCTL_VCPU_CPUS` (our VMM alone would take it only when its vCPUs start, and
/// QEMU not at all). The nested host sets it to keep guests off its CPU 0.
pub(crate) fn vm_cpus() -> Result<Option<CpuSet>, String> {
    CpuSet::from_env().map_err(|e| e.to_string())
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
    let mut command = Command::new(&argv[0]);
    if let Some(cpus) = vm_cpus()? {
        cpus.apply_to_command(&mut command);
    }
    // stdin is a pipe we hold open: vmctl feeds stdin to the guest's serial port and
    // cannot poll /dev/null, and QEMU reads it for -serial stdio.
    let mut child = command
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
        // The memory measure: its rounds as given (0 too: not measured), else by
        // MemoryReturnSizes (1; quick 0).
        assert_eq!((a.free_page_rounds, q.free_page_rounds), (None, None));
        let m = args(&["--quick", "--free-page-rounds", "2"]).unwrap();
        assert_eq!(m.free_page_rounds, Some(2));
        assert_eq!(
            args(&["--free-page-rounds", "0"]).unwrap().free_page_rounds,
            Some(0)
        );
        assert!(args(&["--free-page-rounds", "x"]).is_err());
        assert_eq!((a.fs_mib, a.fs_files, a.fs_runs), (None, None, None));
        assert_eq!(a.fs_timeout, Duration::from_secs(600));
        let f = args(&[
            "--fs-mib",
            "8",
            "--fs-files",
            "50",
            "--fs-runs",
            "2",
            "--fs-edit-rounds",
            "5",
        ])
        .unwrap();
        assert_eq!(
            (f.fs_mib, f.fs_files, f.fs_runs, f.fs_edit_rounds),
            (Some(8), Some(50), Some(2), Some(5))
        );
        assert!(args(&["--fs-edit-rounds", "0"]).is_err());
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
        let tools = Tools::fake();
        let a = args(&[]).unwrap();
        let s = |v: Vec<OsString>| {
            v.iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(
            s(Vmm::Ours.argv(&tools, Path::new("/x"), a.configs[0])),
            "/v boot --nested never --kernel /k --initrd /x --memory 128 --cpus 1 \
             --no-free-page-reporting --no-virtio-console --boot-time"
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
