//! The benchmark's report: one JSON document (`boot.json`) and a Markdown table
//! (`boot.md`).

use serde::{Deserialize, Serialize};

use crate::agent::AgentReport;
use crate::churn::ChurnReport;
use crate::egress::EgressReport;
use crate::fs_vmm::FsVmmReport;
use crate::sections::Section;
use crate::stats::{percentile_nearest_rank, summarize, Summary};

pub const OURS: &str = "vmctl";
pub const QEMU: &str = "qemu-microvm";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    pub hostname: String,
    pub cpu_model: String,
    pub cpus: usize,
    pub kernel: String,
    /// `kvm_intel` / `kvm_amd` loaded: KVM is hardware-backed here.
    pub hardware_kvm: bool,
    /// `/proc/cpuinfo` has the `hypervisor` flag: this machine is itself a VM (a cloud
    /// instance), so its hardware KVM is nested VMX/SVM under the cloud's hypervisor.
    /// `None` where the flags could not be read, and in reports written before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hypervisor: Option<bool>,
}

impl Machine {
    pub fn this() -> Machine {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        let cpuinfo = read("/proc/cpuinfo");
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")?
                    .split_once(':')
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_default();
        Machine {
            hostname: read("/proc/sys/kernel/hostname"),
            cpu_model,
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            kernel: format!(
                "{} {}",
                read("/proc/sys/kernel/osrelease"),
                read("/proc/sys/kernel/version")
            ),
            hardware_kvm: hardware_kvm(),
            hypervisor: cpuinfo_hypervisor_flag(&cpuinfo),
        }
    }

    /// How the Markdown header names where a direct run measured: hardware KVM (in a
    /// VM of its own, where the CPU says so), or KVM that is not hardware-backed.
    pub fn kvm_label(&self) -> &'static str {
        match (self.hardware_kvm, self.hypervisor) {
            (false, _) => {
                "direct, KVM not hardware-backed (no kvm_intel/kvm_amd): not hardware figures"
            }
            (true, Some(true)) => {
                "direct, hardware KVM inside a VM (the CPU has the hypervisor flag: nested \
                 VMX/SVM under the cloud's hypervisor)"
            }
            (true, _) => "direct, hardware KVM",
        }
    }
}

/// Whether the first `flags` line of `/proc/cpuinfo` text has `hypervisor`: the CPU
/// says it runs under a hypervisor. `None` without a `flags` line.
pub fn cpuinfo_hypervisor_flag(cpuinfo: &str) -> Option<bool> {
    cpuinfo.lines().find_map(|line| {
        let (key, flags) = line.split_once(':')?;
        (key.trim() == "flags").then(|| flags.split_whitespace().any(|f| f == "hypervisor"))
    })
}

/// KVM is hardware-backed where `kvm_intel` or `kvm_amd` is loaded (or built in).
pub fn hardware_kvm() -> bool {
    ["/sys/module/kvm_intel", "/sys/module/kvm_amd"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Figure {
    pub name: String,
    pub unit: String,
    pub vmm: String,
    pub median: f64,
    pub p90: f64,
    pub min: f64,
    pub max: f64,
    /// Only for the figures that need it (the exec round trips).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p99: Option<f64>,
    /// The project's goal for this figure, where it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<Target>,
    pub samples: Vec<f64>,
    /// Where and what was measured, filled in once the report is complete (see
    /// [`Report::fill_figure_metadata`]); empty in reports written before these fields.
    /// The machine the benchmark ran on (its hostname).
    #[serde(default)]
    pub machine: String,
    /// The guest kernel (its path).
    #[serde(default)]
    pub kernel: String,
    /// The commit measured (`git rev-parse --short HEAD`), where known.
    #[serde(default)]
    pub commit: Option<String>,
    /// `direct` (this machine's KVM) or `nested` (the QEMU-TCG nested host).
    #[serde(default)]
    pub mode: String,
}

/// A goal: the median should be below `below` (in the figure's unit) on `on`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Target {
    pub below: f64,
    /// Where the target applies: "hardware KVM".
    pub on: String,
}

impl Figure {
    /// `None` for an empty sample (the caller treats that as an error).
    pub fn new(name: &str, unit: &str, vmm: &str, samples: Vec<f64>) -> Option<Figure> {
        let Summary {
            median,
            p90,
            min,
            max,
        } = summarize(&samples)?;
        Some(Figure {
            name: name.into(),
            unit: unit.into(),
            vmm: vmm.into(),
            median,
            p90,
            min,
            max,
            p99: None,
            target: None,
            samples,
            machine: String::new(),
            kernel: String::new(),
            commit: None,
            mode: String::new(),
        })
    }

    /// The target column of a table: the goal and, where the figure was measured
    /// where the goal applies, whether the median met it. `not_comparable` says where
    /// a time was measured instead ("in nested mode"), when not on hardware KVM.
    pub fn target_cell(&self, not_comparable: Option<&str>) -> String {
        match (&self.target, not_comparable) {
            (None, _) => String::new(),
            // Times under emulation say nothing about hardware; a process's memory does.
            (Some(t), Some(where_)) if self.unit != "MiB" => format!(
                "< {} {} (target on {}; not comparable {where_})",
                t.below, self.unit, t.on
            ),
            (Some(t), _) => format!(
                "< {} {} (target on {}): {}",
                t.below,
                self.unit,
                t.on,
                if self.median < t.below {
                    "met"
                } else {
                    "missed"
                }
            ),
        }
    }

    /// Adds the nearest-rank p99 of the samples.
    pub fn with_p99(mut self) -> Figure {
        let mut sorted = self.samples.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        self.p99 = Some(percentile_nearest_rank(&sorted, 99.0));
        self
    }

    /// Adds a target on hardware KVM.
    pub fn with_hardware_target(mut self, below: f64) -> Figure {
        self.target = Some(Target {
            below,
            on: "hardware KVM".into(),
        });
        self
    }
}

/// ours / QEMU, of the medians of a figure measured for both.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Ratio {
    pub name: String,
    pub ours_median: f64,
    pub qemu_median: f64,
    pub ours_over_qemu: f64,
}

/// A table's ours/QEMU cell: on our figure's row, its ratio; else empty.
pub fn ratio_cell(ratios: &[Ratio], f: &Figure) -> String {
    if f.vmm != OURS {
        return String::new();
    }
    ratios
        .iter()
        .find(|r| r.name == f.name)
        .map(|r| format!("{:.2}", r.ours_over_qemu))
        .unwrap_or_default()
}

pub fn ratios(figures: &[Figure]) -> Vec<Ratio> {
    let mut out = Vec::new();
    for ours in figures.iter().filter(|f| f.vmm == OURS) {
        if let Some(qemu) = figures
            .iter()
            .find(|f| f.vmm == QEMU && f.name == ours.name)
        {
            out.push(Ratio {
                name: ours.name.clone(),
                ours_median: ours.median,
                qemu_median: qemu.median,
                ours_over_qemu: if qemu.median != 0.0 {
                    ours.median / qemu.median
                } else {
                    f64::NAN
                },
            });
        }
    }
    out
}

/// One guest configuration the boot figures are measured with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootConfig {
    pub vcpus: u32,
    pub memory_mib: u64,
}

impl BootConfig {
    pub const fn new(vcpus: u32, memory_mib: u64) -> BootConfig {
        BootConfig { vcpus, memory_mib }
    }

    /// `@2cpu-1024mib`: what the names of this configuration's figures end with.
    pub fn suffix(self) -> String {
        format!("@{}cpu-{}mib", self.vcpus, self.memory_mib)
    }

    /// The name of figure `base` measured with this configuration: `base` itself for
    /// the first configuration (the names the single-configuration reports used),
    /// `base@2cpu-1024mib` for the others.
    pub fn figure_name(self, base: &str, first: bool) -> String {
        if first {
            base.to_string()
        } else {
            format!("{base}{}", self.suffix())
        }
    }

    /// `1 vCPU, 128 MiB / 2 vCPUs, 1024 MiB`: the labels of `configs`.
    pub fn labels(configs: &[BootConfig]) -> String {
        configs
            .iter()
            .map(|c| c.label())
            .collect::<Vec<_>>()
            .join(" / ")
    }

    /// `2 vCPUs, 1024 MiB`.
    pub fn label(self) -> String {
        format!(
            "{} vCPU{}, {} MiB",
            self.vcpus,
            if self.vcpus == 1 { "" } else { "s" },
            self.memory_mib
        )
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Config {
    pub runs: usize,
    pub quick: bool,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub memory_runs: usize,
    pub memory_run_sleep_s: u64,
    pub timeout_s: u64,
    pub marker: String,
    /// The configurations the boot figures were measured with, in order: the first
    /// (`vcpus`, `memory_mib`) names its figures plainly, the others with
    /// [`BootConfig::suffix`]. Empty in reports written before the matrix.
    #[serde(default)]
    pub configs: Vec<BootConfig>,
    /// The host CPUs every VM the benchmark boots itself ran on, ours and QEMU's alike,
    /// from spawn to exit (`VMCTL_VCPU_CPUS`, which the nested host sets); none: any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmm_cpus: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub benchmark: String,
    /// Set when the run stopped before its last section: why, and so which
    /// sections are missing (they are `null`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incomplete: Option<String>,
    /// The sections this run measured (`--only`; see [`crate::sections`]); empty in
    /// reports from before there was a choice, which measured them all.
    #[serde(default)]
    pub sections: Vec<Section>,
    /// UTC, ISO 8601.
    pub date: String,
    /// `direct`: measured on this machine's KVM; `nested`: inside the QEMU-TCG
    /// nested host (`vmctl nested-exec`).
    pub mode: String,
    pub note: Option<String>,
    /// Where the benchmark was started.
    pub machine: Machine,
    /// Where it measured, in nested mode (the nested host).
    pub measured_on: Option<Machine>,
    pub commit: Option<String>,
    /// The working tree had uncommitted changes.
    pub dirty: Option<bool>,
    pub kernel: String,
    pub initrd: String,
    pub vmctl: String,
    pub qemu: String,
    pub qemu_version: String,
    pub config: Config,
    /// The command lines measured (with this run's temporary initrd path).
    pub commands: Vec<(String, Vec<String>)>,
    /// How the memory figures were split into guest memory and VMM overhead.
    pub memory_rules: Vec<(String, String)>,
    pub figures: Vec<Figure>,
    pub ratios: Vec<Ratio>,
    /// The workspace-VM figures (`vmctl up`, exec through the guest agent).
    #[serde(default)]
    pub workspace: Option<WorkspaceReport>,
    /// The shared workspace directory (virtio-fs) in the guest against the host.
    #[serde(default)]
    pub fs: Option<FsReport>,
    /// Requests through the guest's egress proxy against the host's direct ones.
    #[serde(default)]
    pub egress: Option<EgressReport>,
    /// `vmctl agent claude --version`, cold and warm, and the host memory of idle VMs.
    #[serde(default)]
    pub agent: Option<AgentReport>,
    /// Create/destroy cycles of both VMMs: cycles per second, and the host's memory
    /// before and after.
    #[serde(default)]
    pub churn: Option<ChurnReport>,
}

/// The workspace VM as `vmctl up` starts it, measured on its own: no QEMU peer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkspaceReport {
    pub note: String,
    pub config: WorkspaceConfig,
    /// The command lines measured (with this run's temporary paths), and the
    /// environment they ran with.
    pub commands: Vec<(String, Vec<String>)>,
    pub environment: Vec<(String, String)>,
    pub figures: Vec<Figure>,
    /// Each `vmctl up`, in order.
    pub ready_runs: Vec<ReadyRun>,
    /// The host memory a VM gives back after a burst, with free page reporting and
    /// without (its figures are among `figures`); `None` where not measured (`--quick`,
    /// a failure) and in reports written before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_return: Option<MemoryReturn>,
    /// What of the section failed while its other figures stand (the memory measure).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<String>,
}

/// Two fresh workspace VMs of the section's size, one with free page reporting
/// (vmctl's default) and one with `free_page_reporting = false`, one after the other
/// (alternating which goes first): HELD of `vmctl ps` idle, after the guest filled a
/// tmpfs of its own, and over a window after it freed it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemoryReturn {
    pub rounds: usize,
    /// The guest writes this much to a tmpfs of `tmpfs_mib`, then frees it.
    pub fill_mib: u64,
    pub tmpfs_mib: u64,
    /// After the free, HELD is read every `interval_s` for `window_s`.
    pub interval_s: f64,
    pub window_s: f64,
    /// Settled: within this share of the window's last reading, from then on.
    pub settle_tolerance: f64,
    /// Whose memory HELD is here (the VMM's, or the nested host's QEMU's).
    pub note: String,
    /// The command lines of one VM, in order (with this run's temporary paths).
    pub commands: Vec<(String, Vec<String>)>,
    /// The config file's section that turns free page reporting off.
    pub config_without_reporting: String,
    /// Each VM, in the order measured.
    pub runs: Vec<MemoryRun>,
}

/// One VM of [`MemoryReturn`]; HELD in MiB.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryRun {
    /// From 1.
    pub round: usize,
    pub free_page_reporting: bool,
    /// vmctl ran it in a nested host of its own (`MODE` nested): HELD is that
    /// nested host's QEMU's.
    pub vm_nested: bool,
    /// Right after `vmctl up`.
    pub held_idle_mib: f64,
    /// Right after the fill.
    pub held_full_mib: f64,
    /// `[s, MiB]`: each reading after the free, timed from the free's exit.
    pub after_free: Vec<(f64, f64)>,
    /// The window's last reading.
    pub held_after_free_mib: f64,
    /// When the readings came within the tolerance of the last one for good.
    pub settle_s: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkspaceConfig {
    pub ready_runs: usize,
    pub exec_iterations: usize,
    /// Unmeasured client round trips before the measured ones.
    pub exec_warmup: usize,
    pub cli_iterations: usize,
    pub kernel: String,
    pub agent_initramfs: String,
    pub rootfs: String,
    /// As `vmctl up` recorded them in the VM's `vm.json`.
    pub vm_cpus: u64,
    pub vm_memory_mib: u64,
    /// `vmctl up` ran the VM in a nested host of its own (it should not: the benchmark
    /// runs where KVM boots Linux).
    pub vm_nested: bool,
    pub timeout_s: u64,
    /// Rounds of the memory measure (`--free-page-rounds`; 0: not measured).
    #[serde(default)]
    pub free_page_rounds: usize,
}

/// One `vmctl up` on a fresh workspace.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReadyRun {
    /// Spawn of `vmctl up` to its exit 0.
    pub wall_ms: f64,
    /// `HealthInfo` of the benchmark's own health check right after `vmctl up` exited.
    pub guest_uptime_ms: u64,
    pub agent_uptime_ms: u64,
    pub agent_rss_bytes: u64,
    /// From `vmctl up`'s exit to that health answer.
    pub health_lag_ms: f64,
}

pub const NESTED_NOTE: &str = "Measured inside the QEMU-TCG nested host (emulated AMD SVM): absolute \
times are TCG-emulated, not hardware figures; the ours/QEMU ratios, measured side by side, are what count.";

fn fmt_num(v: f64, unit: &str) -> String {
    if unit == "MiB" {
        format!("{v:.2}")
    } else {
        format!("{v:.0}")
    }
}

/// Small times keep their decimals (an exec round trip may take a millisecond).
fn fmt_precise(v: f64, unit: &str) -> String {
    match v.abs() {
        _ if unit == "MiB" => format!("{v:.2}"),
        a if a >= 100.0 => format!("{v:.0}"),
        a if a >= 10.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}

impl Report {
    /// Every [`Figure`] of the report, the sections' included.
    pub fn figures_mut(&mut self) -> impl Iterator<Item = &mut Figure> {
        let workspace = self.workspace.iter_mut().flat_map(|w| w.figures.iter_mut());
        let fs = self
            .fs
            .iter_mut()
            .flat_map(|f| f.figures.iter_mut())
            .flat_map(|f| {
                f.host
                    .iter_mut()
                    .chain(f.guest.iter_mut())
                    .chain(f.guest_disk.iter_mut())
            });
        let egress = self
            .egress
            .iter_mut()
            .flat_map(|e| e.figures.iter_mut())
            .flat_map(|f| f.host.iter_mut().chain(f.guest.iter_mut()));
        let agent = self.agent.iter_mut().flat_map(|a| a.figures.iter_mut());
        let churn = self.churn.iter_mut().flat_map(|c| c.figures.iter_mut());
        self.figures
            .iter_mut()
            .chain(workspace)
            .chain(fs)
            .chain(egress)
            .chain(agent)
            .chain(churn)
    }

    /// Copies the report's machine (its hostname), guest kernel, commit and mode into
    /// every figure, so that each figure's JSON object stands on its own. Call it
    /// once `commit` and `mode` are final.
    pub fn fill_figure_metadata(&mut self) {
        let machine = self.machine.hostname.clone();
        let kernel = self.kernel.clone();
        let commit = self.commit.clone();
        let mode = self.mode.clone();
        for f in self.figures_mut() {
            f.machine = machine.clone();
            f.kernel = kernel.clone();
            f.commit = commit.clone();
            f.mode = mode.clone();
        }
    }

    /// A short Markdown summary: header lines and one table.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let where_ = if self.mode == "nested" {
            "nested host (QEMU TCG), not hardware figures"
        } else {
            self.machine.kvm_label()
        };
        s.push_str(&format!("Boot benchmark, {where_}, {}\n\n", self.date));
        if let Some(why) = &self.incomplete {
            s.push_str(&format!(
                "**Incomplete**: {}. The sections it did not reach are missing.\n\n",
                crate::report::first_line(why)
            ));
        }
        if let Some(note) = &self.note {
            s.push_str(&format!("{note}\n\n"));
        }
        let m = self.measured_on.as_ref().unwrap_or(&self.machine);
        let boot_measured = self.measured(Section::Boot);
        s.push_str(&format!(
            "Machine: {} ({}, {} CPUs, Linux {}){}. Commit {}{}. {}\n\n",
            self.machine.hostname,
            self.machine.cpu_model,
            self.machine.cpus,
            self.machine.kernel.split_whitespace().next().unwrap_or(""),
            if self.measured_on.is_some() {
                format!(
                    "; measured in the nested host ({}, {} vCPUs)",
                    m.cpu_model, m.cpus
                )
            } else {
                String::new()
            },
            self.commit.as_deref().unwrap_or("unknown"),
            if self.dirty == Some(true) {
                " (uncommitted changes)"
            } else {
                ""
            },
            if boot_measured {
                format!(
                    "{} boot(s) per VMM, {} vCPU, {} MiB; memory: {} boot(s) per VMM.{}",
                    self.config.runs,
                    self.config.vcpus,
                    self.config.memory_mib,
                    self.config.memory_runs,
                    match &self.config.vmm_cpus {
                        Some(cpus) => format!(
                            " Both VMMs ran on CPUs {cpus} only (`{}`).",
                            vmm::process::VCPU_CPUS_ENV
                        ),
                        None => String::new(),
                    }
                )
            } else {
                format!(
                    "Measured only {} (`--only`): no boot figures.",
                    crate::sections::join(&self.sections, ", ")
                )
            },
        ));
        if boot_measured {
            self.push_boot_table(&mut s);
        }
        if let Some(c) = &self.churn {
            s.push('\n');
            s.push_str(&c.markdown());
        }
        if let Some(w) = &self.workspace {
            s.push('\n');
            s.push_str(&w.markdown(self.targets_not_comparable()));
        }
        if let Some(f) = &self.fs {
            s.push('\n');
            s.push_str(&f.markdown());
        }
        if let Some(e) = &self.egress {
            s.push('\n');
            s.push_str(&e.markdown());
        }
        if let Some(a) = &self.agent {
            s.push('\n');
            s.push_str(&a.markdown());
        }
        s
    }

    /// The boot and memory figures, with the ratios against QEMU.
    fn push_boot_table(&self, s: &mut String) {
        if self.config.configs.len() > 1 {
            s.push_str(&format!(
                "Boot figures for {} configurations, {} boot(s) per VMM each: {}; memory on the \
                 first only.\n\n",
                self.config.configs.len(),
                self.config.runs,
                self.config
                    .configs
                    .iter()
                    .enumerate()
                    .map(|(i, c)| if i == 0 {
                        format!("{} (plain names)", c.label())
                    } else {
                        format!("{} (`{}`)", c.label(), c.suffix())
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        s.push_str("| figure | unit | VMM | median | p90 | min | max | n | ours/QEMU | target |\n");
        s.push_str("|---|---|---|---:|---:|---:|---:|---:|---:|---|\n");
        for f in &self.figures {
            let ratio = ratio_cell(&self.ratios, f);
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                f.name,
                f.unit,
                f.vmm,
                fmt_num(f.median, &f.unit),
                fmt_num(f.p90, &f.unit),
                fmt_num(f.min, &f.unit),
                fmt_num(f.max, &f.unit),
                f.samples.len(),
                ratio,
                f.target_cell(self.targets_not_comparable())
            ));
        }
    }

    /// Where the times were measured when that was not on hardware KVM, so that their
    /// targets are not judged: "in nested mode", or without hardware KVM.
    pub fn targets_not_comparable(&self) -> Option<&'static str> {
        if self.mode == "nested" {
            Some("in nested mode")
        } else if !self.machine.hardware_kvm {
            Some("without hardware KVM")
        } else {
            None
        }
    }

    /// Whether this run measured `section` (reports from before `--only` measured all).
    pub fn measured(&self, section: Section) -> bool {
        self.sections.is_empty() || self.sections.contains(&section)
    }
}

impl WorkspaceReport {
    /// The workspace-VM table; `not_comparable`: where the figures were measured when
    /// that was not on hardware KVM ([`Report::targets_not_comparable`]).
    pub fn markdown(&self, not_comparable: Option<&str>) -> String {
        let c = &self.config;
        let mut s = format!(
            "Workspace VM (`vmctl up`: {} vCPUs, {} MiB, guest agent as PID 1, Debian root image \
             read-only): {} `vmctl up` on fresh workspaces; on the last one, {} round trips of \
             `true` through the Rust client (after {} unmeasured) and {} through `vmctl exec`. \
             {}\n\n",
            c.vm_cpus,
            c.vm_memory_mib,
            c.ready_runs,
            c.exec_iterations,
            c.exec_warmup,
            c.cli_iterations,
            self.note
        );
        s.push_str("| figure | unit | VMM | median | p90 | p99 | min | max | n | target |\n");
        s.push_str("|---|---|---|---:|---:|---:|---:|---:|---:|---|\n");
        for f in &self.figures {
            let target = f.target_cell(not_comparable);
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                f.name,
                f.unit,
                f.vmm,
                fmt_precise(f.median, &f.unit),
                fmt_precise(f.p90, &f.unit),
                f.p99.map(|v| fmt_precise(v, &f.unit)).unwrap_or_default(),
                fmt_precise(f.min, &f.unit),
                fmt_precise(f.max, &f.unit),
                f.samples.len(),
                target
            ));
        }
        s.push('\n');
        s.push_str(&match &self.memory_return {
            Some(m) => m.describe(),
            None if self.failures.is_empty() => format!(
                "Memory given back after a burst: not measured (`--free-page-rounds {}`; 0 is \
                 the default of `--quick`).\n",
                c.free_page_rounds
            ),
            None => String::new(),
        });
        for failure in &self.failures {
            s.push_str(&format!("\n**Failed**: {}\n", first_line(failure)));
        }
        s
    }

    /// What failed while the section's other figures stand, as (what, message).
    pub fn errors(&self) -> Vec<(String, String)> {
        self.failures
            .iter()
            .map(|e| ("workspace VM".to_string(), e.clone()))
            .collect()
    }
}

impl MemoryReturn {
    /// The paragraph that says how the `held_*`, `given_back_*` and `settle_*`
    /// figures of the table were measured.
    pub fn describe(&self) -> String {
        format!(
            "Memory given back after a burst (`held_*`, `given_back_*`, `settle_*`; `_reporting`: \
             free page reporting, vmctl's default; `_not_reporting`: `free_page_reporting = \
             false` in the config's section of that workspace): {} round(s) of two fresh VMs \
             of the section's size, one of each, one after the other (alternating which goes \
             first). HELD is `vmctl ps`'s PSS of the VM's supervisor tree, read after `vmctl \
             up` (`held_idle`), after the guest (as root) wrote {} MiB of zeros to a {} MiB \
             tmpfs of its own (`held_full`), then every {} s for {} s after it removed the file \
             and unmounted the tmpfs: `held_after_free` is the last reading, `given_back` = \
             `held_full - held_after_free`, `settle` when the readings came within {:.0}% of \
             the last one for good; `held_after_free_reporting_over_not` pairs the VMs of a \
             round. {}\n",
            self.rounds,
            self.fill_mib,
            self.tmpfs_mib,
            self.interval_s,
            self.window_s,
            self.settle_tolerance * 100.0,
            self.note
        )
    }
}

/// Which way a figure is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Better {
    /// Times.
    Lower,
    /// Throughputs.
    Higher,
}

/// How many times slower the guest is than the host, from the two medians: guest /
/// host for a time (lower is better), host / guest for a throughput (higher is
/// better), so that above 1 always means the guest is slower. `None` when it is not
/// defined (a zero denominator, a negative or non-finite value).
pub fn guest_slowdown(host: f64, guest: f64, better: Better) -> Option<f64> {
    let (num, den) = match better {
        Better::Lower => (guest, host),
        Better::Higher => (host, guest),
    };
    let r = num / den;
    (den > 0.0 && num >= 0.0 && r.is_finite()).then_some(r)
}

/// The issue's target for a workload: the guest at most `max_slowdown` times slower
/// than the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlowdownTarget {
    pub max_slowdown: f64,
    /// The class of work the target is set for: "metadata" or "sequential I/O".
    pub class: String,
    /// `slowdown <= max_slowdown`; `None` without a slowdown (an error), or when the
    /// verdict is withheld.
    pub met: Option<bool>,
    /// Why there is no verdict although there is a slowdown: the measurement cannot
    /// back one (see [`FsFigure::withhold_verdict`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub withheld: Option<String>,
}

impl SlowdownTarget {
    pub fn evaluate(max_slowdown: f64, class: &str, slowdown: Option<f64>) -> SlowdownTarget {
        SlowdownTarget {
            max_slowdown,
            class: class.into(),
            met: slowdown.map(|s| s <= max_slowdown),
            withheld: None,
        }
    }
}

/// One file-system workload, measured in the guest (through virtio-fs) and on the
/// host, in the same run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FsFigure {
    pub name: String,
    pub unit: String,
    pub better: Better,
    /// The workload's size: the file's MiB (sequential I/O) or the number of files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<u64>,
    /// `vmm` is "host" or "guest"; `None` when no sample was measured.
    pub host: Option<Figure>,
    pub guest: Option<Figure>,
    /// See [`guest_slowdown`]: above 1 the guest is slower. `None` on an error.
    pub guest_slowdown: Option<f64>,
    pub target: SlowdownTarget,
    /// Why the figure is incomplete (a failed script, a missing `ELAPSED_NS` line):
    /// then there is no slowdown, whatever samples were taken before are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The same workload in the same guest on its own file system instead of the
    /// share (`vmm` "guest_disk"); `None` in reports written before, and when no
    /// sample was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_disk: Option<Figure>,
    /// The virtio-fs guest's slowdown against the guest disk, computed as
    /// [`guest_slowdown`] with the guest disk in the host's place: above 1 virtio-fs
    /// is slower. What virtio-fs costs over the guest's native file system, under the
    /// same guest kernel and the same virtualization; informative only, never judged
    /// against the issue's targets (those are `guest_slowdown`'s). `None` when either
    /// the guest's or the guest disk's figure has an error or no samples.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtio_fs_over_guest_disk: Option<f64>,
    /// Why the guest disk's figure is incomplete; kept apart from `error`, so that a
    /// failure there leaves the host-vs-guest figure and its verdict alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_disk_error: Option<String>,
}

pub const HOST: &str = "host";
pub const GUEST: &str = "guest";
/// The guest's own file system (not the share), as a side of the virtio-fs figures.
pub const GUEST_DISK: &str = "guest_disk";

impl FsFigure {
    /// Keeps the figure and its slowdown, without a verdict: `why` the measurement
    /// cannot back one (added to the reasons already given).
    pub fn withhold_verdict(&mut self, why: &str) {
        self.target.met = None;
        self.target.withheld = Some(match self.target.withheld.take() {
            Some(earlier) => format!("{earlier}; {why}"),
            None => why.into(),
        });
    }

    /// The figure from both sides' samples; the slowdown and the target's verdict
    /// only when there is no error and both sides have samples.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: &str,
        unit: &str,
        better: Better,
        (file_mib, files): (Option<u64>, Option<u64>),
        (max_slowdown, class): (f64, &str),
        host: Vec<f64>,
        guest: Vec<f64>,
        mut error: Option<String>,
    ) -> FsFigure {
        let host_n = host.len();
        let guest_n = guest.len();
        let host = Figure::new(name, unit, HOST, host);
        let guest = Figure::new(name, unit, GUEST, guest);
        if error.is_none() && (host.is_none() || guest.is_none()) {
            error = Some(format!(
                "no valid samples (host: {host_n}, guest: {guest_n} taken)"
            ));
        }
        let slowdown = match (&host, &guest, &error) {
            (Some(h), Some(g), None) => guest_slowdown(h.median, g.median, better),
            _ => None,
        };
        FsFigure {
            name: name.into(),
            unit: unit.into(),
            better,
            file_mib,
            files,
            host,
            guest,
            guest_slowdown: slowdown,
            target: SlowdownTarget::evaluate(max_slowdown, class, slowdown),
            error,
            guest_disk: None,
            virtio_fs_over_guest_disk: None,
            guest_disk_error: None,
        }
    }

    /// Adds the guest disk's samples and error (see [`FsFigure::guest_disk`]); the
    /// ratio only when neither the guest's side nor the guest disk's has an error.
    pub fn with_guest_disk(mut self, samples: Vec<f64>, mut error: Option<String>) -> FsFigure {
        let taken = samples.len();
        self.guest_disk = Figure::new(&self.name, &self.unit, GUEST_DISK, samples);
        if error.is_none() && self.guest_disk.is_none() {
            error = Some(format!("no valid samples (guest disk: {taken} taken)"));
        }
        self.virtio_fs_over_guest_disk = match (&self.guest, &self.guest_disk, &self.error, &error)
        {
            (Some(guest), Some(disk), None, None) => {
                guest_slowdown(disk.median, guest.median, self.better)
            }
            _ => None,
        };
        self.guest_disk_error = error;
        self
    }

    /// Whether the guest disk was measured for this figure (or tried and failed):
    /// reports written before have no such side.
    fn has_guest_disk(&self) -> bool {
        self.guest_disk.is_some() || self.guest_disk_error.is_some()
    }

    fn size(&self) -> String {
        match (self.file_mib, self.files) {
            (Some(m), _) => format!("{m} MiB"),
            (None, Some(f)) => format!("{f} files"),
            (None, None) => String::new(),
        }
    }
}

/// What the benchmark saw of one side: where its workspace directory lives and the
/// tools it ran.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FsSide {
    /// "host", "guest" or "guest_disk".
    pub side: String,
    /// `stat -f -c %T` of the workspace directory.
    pub fs_type: String,
    /// `uname -r`.
    pub kernel: String,
    pub bash: String,
    pub git: String,
    pub uid: String,
    /// `command -v node`, or `missing` (then the host edits are not measured); empty
    /// in reports written before.
    #[serde(default)]
    pub node: String,
    /// `echo 3 > /proc/sys/vm/drop_caches` before the reads (the host's also before
    /// the guest's reads): how often it worked and how often it did not.
    pub cache_drops_ok: usize,
    pub cache_drops_failed: usize,
    /// Why this side's caches were not dropped at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_drop_skipped: Option<String>,
    /// The guest disk side only: what holds the guest root overlay's upper layer,
    /// where its files go (`vmctl.upper=` on the guest kernel's command line: `tmpfs`,
    /// or a block device); `None` for the other sides, where the guest does not say,
    /// and in reports written before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_upper: Option<String>,
}

impl FsSide {
    fn caches_dropped(&self) -> String {
        if let Some(why) = &self.cache_drop_skipped {
            return format!("skipped ({why})");
        }
        match (self.cache_drops_ok, self.cache_drops_failed) {
            (0, 0) => "not tried",
            (_, 0) => "yes",
            (0, _) => "no (not writable)",
            _ => "partly",
        }
        .into()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FsConfig {
    /// The sequential file's size, the number of small files (and of the git
    /// repository's files), repetitions per side.
    pub file_mib: u64,
    pub files: u64,
    pub runs: usize,
    /// Where the sizes come from: the issue's (hardware KVM), reduced for the
    /// nested host, --quick, or the --fs-* options.
    pub sizes: String,
    /// Per script; per `vmctl up` / `vmctl rm`.
    pub script_timeout_s: u64,
    pub timeout_s: u64,
    pub workspace: String,
    /// As `vmctl up` recorded them in the VM's `vm.json`.
    pub vm_cpus: u64,
    pub vm_memory_mib: u64,
    pub vm_nested: bool,
    /// The virtiofsd vmctl finds ($VMCTL_VIRTIOFSD, PATH, ~/.cargo/bin, ...) and its
    /// `--version`.
    pub virtiofsd: String,
    /// The guest's caching of the share (`--fs-cache`, vmctl's VMCTL_VIRTIOFS_CACHE).
    #[serde(default)]
    pub guest_cache: String,
    /// The CPUs the host side's scripts ran on (`taskset -c`), as many as the VM's
    /// vCPUs, where this machine has more; none: any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_cpus: Option<String>,
}

/// What the host's reads of its sequential file came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HostRead {
    /// Its page cache was dropped before every read: from disk.
    Cold,
    /// Not dropped (skipped, or not writable) before at least one read: from memory.
    Warm,
}

/// The shared workspace directory, guest against host (and against the guest's own
/// file system).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FsReport {
    pub note: String,
    /// Where the host side ran (the environment the benchmark runs in, where the
    /// VMM runs).
    pub host: String,
    /// `true` when that is the QEMU-TCG nested host.
    pub nested: bool,
    /// Whether KVM where the VMM runs is hardware-backed (`kvm_intel`/`kvm_amd`), and
    /// whether that machine's CPU has the `hypervisor` flag (a cloud VM: its hardware
    /// KVM is nested VMX/SVM). `None` in reports written before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware_kvm: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hypervisor: Option<bool>,
    /// Why no figure gets a verdict: the issue's targets are judged only on hardware
    /// KVM in mode `direct`, with the VM not nested.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdicts_withheld: Option<String>,
    /// Whether the host's sequential reads were cold (its cache dropped before each)
    /// or warm; `None` when no host read was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_read: Option<HostRead>,
    pub config: FsConfig,
    pub sides: Vec<FsSide>,
    /// How each side runs a script (the guest disk's first `cd`s to its directory),
    /// and the scripts (the host's, first repetition; the guest's sides name their
    /// files `-guest` and `-guest_disk` instead of `-host`).
    pub commands: Vec<(String, Vec<String>)>,
    pub scripts: Vec<(String, String)>,
    pub environment: Vec<(String, String)>,
    pub figures: Vec<FsFigure>,
    /// Observations worth knowing when reading the figures.
    pub notes: Vec<String>,
    /// The section failed as a whole (`vmctl up`, the probe, `vmctl rm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// How soon the host's edits reach the guest ([`crate::fs_edits`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edits: Option<crate::fs_edits::EditsReport>,
    /// The same workloads under our VMM and under QEMU's microvm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by_vmm: Option<FsVmmReport>,
}

/// A `Duration` as seconds (a number) in the report.
pub(crate) mod secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(serde::de::Error::custom)
    }
}

/// The first line of a command's output, trimmed (for one-line summaries).
pub(crate) fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("").trim()
}

/// Throughputs and times of very different sizes: three significant digits or so.
pub(crate) fn fmt_sig(v: f64) -> String {
    match v.abs() {
        a if a >= 100.0 => format!("{v:.0}"),
        a if a >= 10.0 => format!("{v:.1}"),
        a if a >= 1.0 => format!("{v:.2}"),
        a if a >= 0.1 => format!("{v:.3}"),
        _ => format!("{v:.4}"),
    }
}

/// A section's errors, as (what, message): the section's own, then each figure's.
pub(crate) fn section_errors<'a>(
    section: &str,
    error: &Option<String>,
    figures: impl Iterator<Item = (&'a String, &'a Option<String>)>,
) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = error
        .iter()
        .map(|e| (section.to_string(), e.clone()))
        .collect();
    v.extend(figures.filter_map(|(name, error)| Some((name.clone(), error.clone()?))));
    v
}

impl FsReport {
    /// Every error: the section's and each figure's, as (what, message).
    pub fn errors(&self) -> Vec<(String, String)> {
        let figures = self.figures.iter().map(|f| (&f.name, &f.error));
        let mut errors = section_errors("virtio-fs", &self.error, figures);
        errors.extend(self.figures.iter().filter_map(|f| {
            let e = f.guest_disk_error.as_ref()?;
            Some((format!("{} ({GUEST_DISK})", f.name), e.clone()))
        }));
        if let Some(edits) = &self.edits {
            errors.extend(edits.errors());
        }
        if let Some(by_vmm) = &self.by_vmm {
            errors.extend(
                by_vmm
                    .errors
                    .iter()
                    .map(|e| ("virtio-fs by VMM".to_string(), e.clone())),
            );
        }
        errors
    }

    pub fn markdown(&self) -> String {
        let c = &self.config;
        let side = |name: &str| self.sides.iter().find(|s| s.side == name);
        let fs = |name: &str| side(name).map_or("unknown".into(), |s| s.fs_type.clone());
        let dropped = |name: &str| side(name).map_or("unknown".into(), |s| s.caches_dropped());
        // Reports written before the guest disk side have neither it nor its columns.
        let with_disk =
            side(GUEST_DISK).is_some() || self.figures.iter().any(|f| f.has_guest_disk());
        let mut s = format!(
            "Shared workspace over virtio-fs (virtiofsd + our vhost-user-fs device, the workspace \
             mounted in the guest at its host path; VM of `vmctl up`: {} vCPUs, {} MiB): each \
             workload is one bash script, run in the workspace directory on the host ({}) with \
             `bash -c` and in the guest with `vmctl exec --workspace WS -- bash -c`, timed inside \
             the script (bash `$EPOCHREALTIME`), so exec overhead is not counted. {} repetition(s), \
             {}. Sizes: {} MiB file, {} files ({}). \
             Workspace file system: host {}, guest {} (virtiofsd cache policy: {}). Caches dropped \
             before each read: host {}, guest {}; the host's reads were {}. Slowdown = guest/host \
             for times, host/guest for throughputs: above 1 the guest is slower. {}\n\n",
            c.vm_cpus,
            c.vm_memory_mib,
            self.host,
            c.runs,
            if with_disk {
                "rotating which side goes first"
            } else {
                "alternating whether host or guest goes first"
            },
            c.file_mib,
            c.files,
            c.sizes,
            fs(HOST),
            fs(GUEST),
            c.guest_cache,
            dropped(HOST),
            dropped(GUEST),
            match self.host_read {
                Some(HostRead::Cold) => "cold",
                Some(HostRead::Warm) => "warm (from memory)",
                None => "not measured",
            },
            self.note
        );
        if with_disk {
            s.push_str(&format!(
                "Guest disk: the same scripts in the same guest, in a directory of its own file \
                 system ({}) instead of the share; caches dropped before each read: {}. \
                 virtio-fs / guest disk = the guest's slowdown on the share against it (the \
                 same formula: above 1 virtio-fs is slower). Informative only, it gets no \
                 verdict: the issue's targets are the guest slowdown's (see the notes).\n\n",
                fs(GUEST_DISK),
                dropped(GUEST_DISK)
            ));
        }
        if let Some(e) = &self.error {
            s.push_str(&format!(
                "**Error:** {}\n\n",
                e.lines().next().unwrap_or("")
            ));
        }
        if self.figures.is_empty() {
            return s;
        }
        let mut columns = vec!["figure", "unit", "size", "host median", "guest median"];
        columns.extend(with_disk.then_some("guest disk median"));
        columns.extend(["host min–max", "guest min–max"]);
        columns.extend(with_disk.then_some("guest disk min–max"));
        columns.extend(["n", "guest slowdown", "target"]);
        columns.extend(with_disk.then_some("virtio-fs / guest disk"));
        s.push_str(&format!("| {} |\n", columns.join(" | ")));
        let align: Vec<&str> = columns
            .iter()
            .map(|c| match *c {
                "figure" | "unit" | "size" | "target" => "---",
                _ => "---:",
            })
            .collect();
        s.push_str(&format!("|{}|\n", align.join("|")));
        let median = |f: &Option<Figure>| f.as_ref().map_or("–".into(), |f| fmt_sig(f.median));
        let range = |f: &Option<Figure>| {
            f.as_ref().map_or("–".into(), |f| {
                format!("{}–{}", fmt_sig(f.min), fmt_sig(f.max))
            })
        };
        let ratio = |r: Option<f64>, error: &Option<String>| match (r, error) {
            (_, Some(_)) => "error".to_string(),
            (Some(r), None) => format!("{r:.2}x"),
            (None, None) => "–".to_string(),
        };
        for f in &self.figures {
            let n = |f: &Option<Figure>| f.as_ref().map_or(0, |f| f.samples.len());
            let mut counts = vec![n(&f.host), n(&f.guest)];
            counts.extend(f.has_guest_disk().then(|| n(&f.guest_disk)));
            let verdict = match (f.target.met, &f.target.withheld) {
                (Some(true), _) => "met",
                (Some(false), _) => "missed",
                (None, Some(_)) => "withheld (see notes)",
                (None, None) => "not evaluated",
            };
            let mut cells = vec![
                f.name.clone(),
                f.unit.clone(),
                f.size(),
                median(&f.host),
                median(&f.guest),
            ];
            cells.extend(with_disk.then(|| median(&f.guest_disk)));
            cells.extend([range(&f.host), range(&f.guest)]);
            cells.extend(with_disk.then(|| range(&f.guest_disk)));
            cells.extend([
                if counts.iter().all(|k| *k == counts[0]) {
                    counts[0].to_string()
                } else {
                    counts
                        .iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join("/")
                },
                ratio(f.guest_slowdown, &f.error),
                format!(
                    "≤ {}x ({}): {verdict}",
                    f.target.max_slowdown, f.target.class
                ),
            ]);
            cells
                .extend(with_disk.then(|| ratio(f.virtio_fs_over_guest_disk, &f.guest_disk_error)));
            s.push_str(&format!("| {} |\n", cells.join(" | ")));
        }
        for f in &self.figures {
            for (what, error) in [("", &f.error), (" (guest disk)", &f.guest_disk_error)] {
                if let Some(e) = error {
                    s.push_str(&format!(
                        "\n**{}{what} error:** {} (full message in the JSON report)\n",
                        f.name,
                        e.lines().next().unwrap_or("")
                    ));
                }
            }
        }
        for n in &self.notes {
            s.push_str(&format!("\n{n}\n"));
        }
        if let Some(edits) = &self.edits {
            s.push('\n');
            s.push_str(&edits.markdown());
        }
        if let Some(by_vmm) = &self.by_vmm {
            s.push('\n');
            s.push_str(&by_vmm.markdown());
        }
        s
    }
}

/// Now as `YYYY-MM-DDTHH:MM:SSZ` (UTC), without a date crate.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    utc_from_unix(secs)
}

pub fn utc_from_unix(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A boot report's JSON with every required field and nothing measured, in `mode`
/// ("direct" or "nested"), for tests to adjust and read back as a [`Report`].
#[cfg(test)]
pub(crate) fn minimal_report_json(mode: &str, hardware_kvm: bool) -> serde_json::Value {
    serde_json::json!({
        "benchmark": "boot", "date": "d", "mode": mode, "note": null,
        "machine": {"hostname": "box", "cpu_model": "c", "cpus": 2, "kernel": "k",
            "hardware_kvm": hardware_kvm},
        "measured_on": null, "commit": null, "dirty": null,
        "kernel": "/k", "initrd": "/i", "vmctl": "/v", "qemu": "", "qemu_version": "",
        "config": {"runs": 1, "quick": false, "vcpus": 1, "memory_mib": 128,
            "memory_runs": 1, "memory_run_sleep_s": 3, "timeout_s": 60, "marker": "M"},
        "commands": [], "memory_rules": [], "figures": [], "ratios": []
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_config_names_and_labels() {
        let first = BootConfig::new(1, 128);
        let big = BootConfig::new(2, 1024);
        assert_eq!(
            first.figure_name("boot_to_init_wall", true),
            "boot_to_init_wall"
        );
        assert_eq!(
            big.figure_name("boot_to_init_wall", false),
            "boot_to_init_wall@2cpu-1024mib"
        );
        assert_eq!(first.suffix(), "@1cpu-128mib");
        assert_eq!(first.label(), "1 vCPU, 128 MiB");
        assert_eq!(big.label(), "2 vCPUs, 1024 MiB");
        // Ratios pair ours and QEMU of the same configuration only.
        let f = |name: &str, vmm: &str, v: f64| Figure::new(name, "ms", vmm, vec![v]).unwrap();
        let r = ratios(&[
            f("boot_to_init_wall", OURS, 10.0),
            f("boot_to_init_wall", QEMU, 20.0),
            f("boot_to_init_wall@2cpu-1024mib", OURS, 30.0),
            f("boot_to_init_wall@2cpu-1024mib", QEMU, 10.0),
        ]);
        let got: Vec<(&str, f64)> = r
            .iter()
            .map(|r| (r.name.as_str(), r.ours_over_qemu))
            .collect();
        assert_eq!(
            got,
            [
                ("boot_to_init_wall", 0.5),
                ("boot_to_init_wall@2cpu-1024mib", 3.0)
            ]
        );
    }

    #[test]
    fn figures_get_the_report_metadata() {
        // A report as older versions wrote it: no metadata on figures, no configs.
        let fig = |name: &str, vmm: &str| {
            serde_json::json!({"name": name, "unit": "ms", "vmm": vmm, "median": 1.0,
                "p90": 1.0, "min": 1.0, "max": 1.0, "samples": [1.0]})
        };
        let mut r: Report = serde_json::from_value(serde_json::json!({
            "benchmark": "boot", "date": "d", "mode": "nested", "note": null,
            "machine": {"hostname": "box", "cpu_model": "c", "cpus": 2, "kernel": "k",
                "hardware_kvm": false},
            "measured_on": null, "commit": "abc1234", "dirty": false,
            "kernel": "/k/bzImage", "initrd": "/i", "vmctl": "/v", "qemu": "/q",
            "qemu_version": "q",
            "config": {"runs": 1, "quick": true, "vcpus": 1, "memory_mib": 128,
                "memory_runs": 1, "memory_run_sleep_s": 3, "timeout_s": 60, "marker": "M"},
            "commands": [], "memory_rules": [],
            "figures": [fig("boot_to_init_wall", OURS), fig("boot_to_init_wall", QEMU)],
            "ratios": []
        }))
        .unwrap();
        assert!(r.config.configs.is_empty());
        assert_eq!(
            (
                r.figures[0].machine.as_str(),
                r.figures[0].commit.as_deref()
            ),
            ("", None)
        );
        assert_eq!(r.incomplete, None);
        assert!(!r.markdown().contains("Incomplete"));
        assert!(!serde_json::to_string(&r).unwrap().contains("incomplete"));
        r.incomplete = Some("the nested run stalled (the run stopped after churn)".into());
        assert!(r
            .markdown()
            .contains("**Incomplete**: the nested run stalled (the run stopped after churn)."));
        let back: Report = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back.incomplete, r.incomplete);
        r.incomplete = None;
        let before = r.markdown();
        r.workspace = Some(WorkspaceReport {
            note: String::new(),
            config: WorkspaceConfig {
                ready_runs: 1,
                exec_iterations: 1,
                exec_warmup: 0,
                cli_iterations: 1,
                kernel: String::new(),
                agent_initramfs: String::new(),
                rootfs: String::new(),
                vm_cpus: 2,
                vm_memory_mib: 1024,
                vm_nested: false,
                timeout_s: 1,
                free_page_rounds: 0,
            },
            commands: vec![],
            environment: vec![],
            figures: vec![Figure::new("ws", "ms", OURS, vec![2.0]).unwrap()],
            ready_runs: vec![],
            memory_return: None,
            failures: vec![],
        });
        r.fill_figure_metadata();
        let n = r.figures_mut().count();
        assert!(n >= 3, "{n}");
        for f in r.figures_mut() {
            assert_eq!(f.machine, "box");
            assert_eq!(f.kernel, "/k/bzImage");
            assert_eq!(f.commit.as_deref(), Some("abc1234"));
            assert_eq!(f.mode, "nested");
        }
        // Every figure object in the JSON carries them.
        let v = serde_json::to_value(&r).unwrap();
        for f in v["figures"]
            .as_array()
            .unwrap()
            .iter()
            .chain(v["workspace"]["figures"].as_array().unwrap())
        {
            assert_eq!(f["machine"], "box");
            assert_eq!(f["kernel"], "/k/bzImage");
            assert_eq!(f["commit"], "abc1234");
            assert_eq!(f["mode"], "nested");
        }
        // The boot table is unchanged by the metadata; a matrix adds its header line.
        r.workspace = None;
        assert_eq!(r.markdown(), before);
        r.config.configs = vec![BootConfig::new(1, 128), BootConfig::new(2, 1024)];
        let md = r.markdown();
        assert!(
            md.contains(
                "Boot figures for 2 configurations, 1 boot(s) per VMM each: 1 vCPU, 128 MiB \
                 (plain names), 2 vCPUs, 1024 MiB (`@2cpu-1024mib`); memory on the first only."
            ),
            "{md}"
        );
    }

    #[test]
    fn a_run_without_the_boot_section_says_so_instead_of_its_table() {
        let mut json = minimal_report_json("direct", true);
        json["config"]["runs"] = 10.into();
        let mut r: Report = serde_json::from_value(json).unwrap();
        // A report from before --only measured every section.
        assert!(r.measured(Section::Boot) && r.measured(Section::Fs));
        assert!(r.markdown().contains("10 boot(s) per VMM"));
        assert!(r.markdown().contains("| figure | unit | VMM |"));
        assert!(!r.markdown().contains("Both VMMs ran on CPUs"));
        r.config.vmm_cpus = Some("1-2".into());
        assert!(r
            .markdown()
            .contains("Both VMMs ran on CPUs 1-2 only (`VMCTL_VCPU_CPUS`)."));

        r.sections = vec![Section::Fs, Section::Egress];
        assert!(!r.measured(Section::Boot) && r.measured(Section::Fs));
        let md = r.markdown();
        assert!(
            md.contains("Measured only fs, egress (`--only`): no boot figures."),
            "{md}"
        );
        assert!(!md.contains("boot(s) per VMM"), "{md}");
        assert!(!md.contains("| figure | unit | VMM |"), "{md}");
    }

    #[test]
    fn the_header_says_whether_kvm_is_hardware_and_in_a_vm() {
        assert_eq!(cpuinfo_hypervisor_flag("model name\t: X\n"), None);
        assert_eq!(
            cpuinfo_hypervisor_flag("processor\t: 0\nflags\t\t: fpu vmx hypervisor lahf_lm\n"),
            Some(true)
        );
        assert_eq!(
            cpuinfo_hypervisor_flag("flags\t\t: fpu vmx\nflags\t\t: hypervisor\n"),
            Some(false)
        );
        assert_eq!(
            cpuinfo_hypervisor_flag("vmx flags\t: hypervisor\nflags\t: svm\n"),
            Some(false)
        );
        let mut json = minimal_report_json("direct", true);
        json["figures"] =
            serde_json::json!([Figure::new("boot_to_init_wall", "ms", OURS, vec![100.0])
                .unwrap()
                .with_hardware_target(125.0)]);
        let mut r: Report = serde_json::from_value(json).unwrap();
        // A report from before the flag was recorded.
        assert_eq!(r.machine.hypervisor, None);
        let md = r.markdown();
        assert!(
            md.starts_with("Boot benchmark, direct, hardware KVM, d"),
            "{md}"
        );
        assert!(md.contains("(target on hardware KVM): met |"), "{md}");
        r.machine.hypervisor = Some(true);
        let md = r.markdown();
        assert!(
            md.starts_with("Boot benchmark, direct, hardware KVM inside a VM (the CPU has the hypervisor flag: nested VMX/SVM"),
            "{md}"
        );
        // `--nested never` where KVM is not hardware-backed: no verdicts on times.
        r.machine.hardware_kvm = false;
        let md = r.markdown();
        assert!(
            md.starts_with("Boot benchmark, direct, KVM not hardware-backed"),
            "{md}"
        );
        assert!(
            md.contains("(target on hardware KVM; not comparable without hardware KVM) |"),
            "{md}"
        );
        assert!(!md.contains(": met |"), "{md}");
        let json = serde_json::to_value(&r.machine).unwrap();
        assert_eq!(json["hypervisor"], true);
    }

    #[test]
    fn withheld_verdicts_keep_every_reason() {
        let mut f = fs_figures().remove(0);
        assert_eq!(f.target.met, Some(false));
        f.withhold_verdict("nested");
        f.withhold_verdict("cache");
        assert_eq!(f.target.met, None);
        assert_eq!(f.target.withheld.as_deref(), Some("nested; cache"));
    }

    #[test]
    fn dates() {
        assert_eq!(utc_from_unix(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_from_unix(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_from_unix(1_700_000_000), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn ratios_pair_figures_by_name() {
        let f = vec![
            Figure::new("boot", "ms", OURS, vec![10.0, 20.0, 30.0]).unwrap(),
            Figure::new("boot", "ms", QEMU, vec![40.0]).unwrap(),
            Figure::new("timer", "ms", OURS, vec![5.0]).unwrap(),
        ];
        let r = ratios(&f);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].name, "boot");
        assert_eq!(r[0].ours_over_qemu, 0.5);
        assert!(Figure::new("x", "ms", OURS, vec![]).is_none());
    }

    #[test]
    fn p99_and_targets() {
        let samples: Vec<f64> = (1..=200).map(f64::from).collect();
        let f = Figure::new("exec", "ms", OURS, samples)
            .unwrap()
            .with_p99()
            .with_hardware_target(2.0);
        assert_eq!(f.p99, Some(198.0));
        assert_eq!(f.p90, 180.0);
        assert_eq!(f.target.as_ref().unwrap().below, 2.0);
        // Figures without them serialize as before.
        let plain = Figure::new("boot", "ms", OURS, vec![1.0]).unwrap();
        let json = serde_json::to_string(&plain).unwrap();
        assert!(!json.contains("p99") && !json.contains("target"), "{json}");
        let back: Figure = serde_json::from_str(&serde_json::to_string(&f).unwrap()).unwrap();
        assert_eq!(back.p99, Some(198.0));
    }

    #[test]
    fn slowdown_above_one_means_the_guest_is_slower() {
        // Times: guest / host.
        assert_eq!(guest_slowdown(2.0, 5.0, Better::Lower), Some(2.5));
        // Throughputs: host / guest.
        assert_eq!(guest_slowdown(400.0, 100.0, Better::Higher), Some(4.0));
        assert_eq!(guest_slowdown(100.0, 200.0, Better::Higher), Some(0.5));
        assert_eq!(guest_slowdown(0.0, 5.0, Better::Lower), None);
        assert_eq!(guest_slowdown(5.0, 0.0, Better::Higher), None);
        assert_eq!(guest_slowdown(f64::NAN, 1.0, Better::Lower), None);
        let t = SlowdownTarget::evaluate(3.0, "metadata", Some(3.0));
        assert_eq!(t.met, Some(true));
        assert_eq!(
            SlowdownTarget::evaluate(2.0, "x", Some(2.01)).met,
            Some(false)
        );
        assert_eq!(SlowdownTarget::evaluate(2.0, "x", None).met, None);
    }

    fn fs_figures() -> Vec<FsFigure> {
        vec![
            FsFigure::new(
                "fs_seq_write_mib_s",
                "MiB/s",
                Better::Higher,
                (Some(16), None),
                (2.0, "sequential I/O"),
                vec![300.0],
                vec![20.0],
                None,
            ),
            FsFigure::new(
                "fs_git_status_s",
                "s",
                Better::Lower,
                (None, Some(200)),
                (3.0, "metadata"),
                vec![0.01, 0.03, 0.02],
                vec![0.05, 0.04, 0.06],
                None,
            ),
            FsFigure::new(
                "fs_stat_files_s",
                "s",
                Better::Lower,
                (None, Some(200)),
                (3.0, "metadata"),
                vec![0.5],
                vec![],
                Some("stat run 1/1 (guest): no ELAPSED_NS line\nmore".into()),
            ),
            FsFigure::new(
                "fs_create_files_s",
                "s",
                Better::Lower,
                (None, Some(200)),
                (3.0, "metadata"),
                vec![0.5],
                vec![],
                None,
            ),
        ]
    }

    #[test]
    fn fs_figures_pair_host_and_guest() {
        let f = fs_figures();
        assert_eq!(f[0].guest_slowdown, Some(15.0));
        assert_eq!(f[0].target.met, Some(false));
        assert_eq!(f[0].host.as_ref().unwrap().vmm, HOST);
        assert_eq!(f[0].guest.as_ref().unwrap().vmm, GUEST);
        let r = f[1].guest_slowdown.unwrap();
        assert!((r - 2.5).abs() < 1e-9, "{r}");
        assert_eq!(f[1].target.met, Some(true));
        // An error: samples kept, no slowdown, no verdict.
        assert!(f[2].host.is_some() && f[2].guest.is_none());
        assert_eq!((f[2].guest_slowdown, f[2].target.met), (None, None));
        // No samples on one side is an error too.
        assert!(f[3].error.as_deref().unwrap().contains("no valid samples"));
        let json = serde_json::to_string(&f[1]).unwrap();
        assert!(
            json.contains("\"better\":\"lower\"") && json.contains("\"files\":200"),
            "{json}"
        );
        assert!(
            !json.contains("file_mib") && !json.contains("error"),
            "{json}"
        );
    }

    #[test]
    fn the_guest_disk_is_a_side_of_its_own() {
        let [write, git, ..] = <[FsFigure; 4]>::try_from(fs_figures()).unwrap();
        // Throughputs: guest disk / guest, so above 1 virtio-fs is slower.
        let write = write.with_guest_disk(vec![80.0], None);
        assert_eq!(write.virtio_fs_over_guest_disk, Some(4.0));
        assert_eq!(write.guest_disk.as_ref().unwrap().vmm, GUEST_DISK);
        // Times: guest / guest disk.
        let r = git
            .clone()
            .with_guest_disk(vec![0.01, 0.02, 0.03], None)
            .virtio_fs_over_guest_disk
            .unwrap();
        assert!((r - 2.5).abs() < 1e-9, "{r}");
        // An error on the guest disk keeps the host-vs-guest figure and its verdict.
        let failed = git
            .clone()
            .with_guest_disk(vec![0.01], Some("guest disk broke".into()));
        assert_eq!(failed.guest_slowdown, git.guest_slowdown);
        assert_eq!(failed.target, git.target);
        assert_eq!(failed.target.met, Some(true));
        assert_eq!(failed.error, None);
        assert!(failed.guest_disk.is_some());
        assert_eq!(failed.virtio_fs_over_guest_disk, None);
        // No samples on the guest disk is its error, not the figure's.
        let empty = git.clone().with_guest_disk(vec![], None);
        let e = empty.guest_disk_error.as_deref().unwrap();
        assert!(e.contains("no valid samples (guest disk: 0 taken)"), "{e}");
        assert_eq!((empty.error, empty.target.met), (None, Some(true)));
        // And the other way: an error of the host-vs-guest figure keeps the guest
        // disk's samples (no ratio: the guest's side of it failed).
        let stat = fs_figures().remove(2).with_guest_disk(vec![0.1], None);
        assert!(stat.error.is_some() && stat.guest_disk_error.is_none());
        assert_eq!(stat.guest_disk.as_ref().unwrap().samples, [0.1]);
        assert_eq!(stat.virtio_fs_over_guest_disk, None);
    }

    #[test]
    fn fs_figures_written_before_the_guest_disk_still_load() {
        let mut json = serde_json::to_value(&fs_figures()[1]).unwrap();
        let object = json.as_object_mut().unwrap();
        for key in [
            "guest_disk",
            "virtio_fs_over_guest_disk",
            "guest_disk_error",
        ] {
            assert!(!object.contains_key(key), "{key} written though None");
        }
        // As an older report has it: without the new keys at all.
        object.remove("error");
        let back: FsFigure = serde_json::from_value(json).unwrap();
        assert!(back.guest_disk.is_none() && back.guest_disk_error.is_none());
        assert_eq!(back.virtio_fs_over_guest_disk, None);
        assert_eq!(back.guest_slowdown, fs_figures()[1].guest_slowdown);
        // With them, they come back.
        let with_disk = fs_figures().remove(1).with_guest_disk(vec![0.02], None);
        let back: FsFigure =
            serde_json::from_str(&serde_json::to_string(&with_disk).unwrap()).unwrap();
        assert_eq!(back.virtio_fs_over_guest_disk, Some(2.5));
        assert_eq!(back.guest_disk.unwrap().samples, [0.02]);
    }

    #[test]
    fn fs_table() {
        let r = FsReport {
            note: "Nested: ratios are the point.".into(),
            host: "the QEMU-TCG nested host, where the VMM runs".into(),
            nested: true,
            hardware_kvm: Some(true),
            hypervisor: Some(true),
            verdicts_withheld: None,
            host_read: Some(HostRead::Warm),
            config: FsConfig {
                file_mib: 16,
                files: 200,
                runs: 3,
                sizes: "--quick sizes".into(),
                script_timeout_s: 600,
                timeout_s: 60,
                workspace: "/tmp/ws".into(),
                vm_cpus: 2,
                vm_memory_mib: 1024,
                vm_nested: false,
                virtiofsd: "/v".into(),
                guest_cache: "never+writeback".into(),
                host_cpus: None,
            },
            sides: vec![
                FsSide {
                    side: HOST.into(),
                    fs_type: "overlayfs".into(),
                    cache_drops_ok: 2,
                    ..FsSide::default()
                },
                FsSide {
                    side: GUEST.into(),
                    fs_type: "fuseblk".into(),
                    cache_drops_ok: 1,
                    cache_drops_failed: 1,
                    ..FsSide::default()
                },
            ],
            commands: vec![],
            scripts: vec![],
            environment: vec![],
            figures: fs_figures(),
            notes: vec!["The git index was not rewritten.".into()],
            error: None,
            edits: None,
            by_vmm: None,
        };
        let md = r.markdown();
        assert!(
            md.contains("| fs_seq_write_mib_s | MiB/s | 16 MiB | 300 | 20.0 | 300–300 | 20.0–20.0 | 1 | 15.00x | ≤ 2x (sequential I/O): missed |"),
            "{md}"
        );
        assert!(
            md.contains("| fs_git_status_s | s | 200 files | 0.0200 | 0.0500 | 0.0100–0.0300 | 0.0400–0.0600 | 3 | 2.50x | ≤ 3x (metadata): met |"),
            "{md}"
        );
        assert!(
            md.contains("| fs_stat_files_s | s | 200 files | 0.500 | – | 0.500–0.500 | – | 1/0 | error | ≤ 3x (metadata): not evaluated |"),
            "{md}"
        );
        assert!(
            md.contains(
                "**fs_stat_files_s error:** stat run 1/1 (guest): no ELAPSED_NS line (full"
            ),
            "{md}"
        );
        assert!(md.contains("host overlayfs, guest fuseblk"), "{md}");
        assert!(
            md.contains("the host's reads were warm (from memory)"),
            "{md}"
        );
        assert!(md.contains("host yes, guest partly"), "{md}");
        assert!(md.contains("Nested: ratios are the point."), "{md}");
        assert!(md.contains("The git index was not rewritten."), "{md}");
        assert_eq!(r.errors().len(), 2);
        let failed = FsReport {
            error: Some("vmctl up: failed\ndetails".into()),
            figures: vec![],
            ..r
        };
        let md = failed.markdown();
        assert!(md.contains("**Error:** vmctl up: failed\n"), "{md}");
        assert!(!md.contains("| figure |"), "{md}");
        assert_eq!(failed.errors()[0].0, "virtio-fs");
    }

    #[test]
    fn fs_table_with_the_guest_disk() {
        let disk_samples = [vec![80.0], vec![0.01, 0.02, 0.03], vec![0.2], vec![]];
        let disk_errors = [None, None, None, Some("mkdir: no space\nmore".to_string())];
        let figures = fs_figures()
            .into_iter()
            .zip(disk_samples.into_iter().zip(disk_errors))
            .map(|(f, (samples, error))| f.with_guest_disk(samples, error))
            .collect();
        let side = |name: &str, fs_type: &str| FsSide {
            side: name.into(),
            fs_type: fs_type.into(),
            cache_drops_ok: 1,
            ..FsSide::default()
        };
        let r = FsReport {
            note: "Nested.".into(),
            host: "the nested host".into(),
            nested: true,
            hardware_kvm: Some(false),
            hypervisor: None,
            verdicts_withheld: None,
            host_read: Some(HostRead::Warm),
            config: FsConfig {
                file_mib: 16,
                files: 200,
                runs: 3,
                sizes: "--quick sizes".into(),
                script_timeout_s: 600,
                timeout_s: 60,
                workspace: "/tmp/ws".into(),
                vm_cpus: 2,
                vm_memory_mib: 1024,
                vm_nested: false,
                virtiofsd: "/v".into(),
                guest_cache: "auto".into(),
                host_cpus: None,
            },
            sides: vec![
                side(HOST, "overlayfs"),
                side(GUEST, "fuseblk"),
                side(GUEST_DISK, "overlayfs"),
            ],
            commands: vec![],
            scripts: vec![],
            environment: vec![],
            figures,
            notes: vec![],
            error: None,
            edits: None,
            by_vmm: None,
        };
        let md = r.markdown();
        assert!(
            md.contains("| figure | unit | size | host median | guest median | guest disk median | host min–max | guest min–max | guest disk min–max | n | guest slowdown | target | virtio-fs / guest disk |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n"),
            "{md}"
        );
        assert!(
            md.contains("| fs_seq_write_mib_s | MiB/s | 16 MiB | 300 | 20.0 | 80.0 | 300–300 | 20.0–20.0 | 80.0–80.0 | 1 | 15.00x | ≤ 2x (sequential I/O): missed | 4.00x |"),
            "{md}"
        );
        assert!(
            md.contains("| fs_git_status_s | s | 200 files | 0.0200 | 0.0500 | 0.0200 | 0.0100–0.0300 | 0.0400–0.0600 | 0.0100–0.0300 | 3 | 2.50x | ≤ 3x (metadata): met | 2.50x |"),
            "{md}"
        );
        // The host-vs-guest error leaves the guest disk's figure; the ratio needs both.
        assert!(
            md.contains("| fs_stat_files_s | s | 200 files | 0.500 | – | 0.200 | 0.500–0.500 | – | 0.200–0.200 | 1/0/1 | error | ≤ 3x (metadata): not evaluated | – |"),
            "{md}"
        );
        // The guest disk's error leaves the host-vs-guest columns alone.
        assert!(
            md.contains("| fs_create_files_s | s | 200 files | 0.500 | – | – | 0.500–0.500 | – | – | 1/0/0 | error | ≤ 3x (metadata): not evaluated | error |"),
            "{md}"
        );
        assert!(
            md.contains("**fs_create_files_s (guest disk) error:** mkdir: no space (full"),
            "{md}"
        );
        assert!(md.contains("rotating which side goes first"), "{md}");
        assert!(
            md.contains("Guest disk: the same scripts in the same guest, in a directory of its own file system (overlayfs)"),
            "{md}"
        );
        assert!(md.contains("it gets no verdict"), "{md}");
        assert!(md.contains("above 1 virtio-fs is slower"), "{md}");
        let errors = r.errors();
        assert!(
            errors
                .iter()
                .any(|(what, e)| what == "fs_create_files_s (guest_disk)" && e.starts_with("mkdir")),
            "{errors:?}"
        );
        // Without the guest disk (an older report), the table is as it was.
        let older = FsReport {
            sides: r.sides[..2].to_vec(),
            figures: fs_figures(),
            ..r
        };
        let md = older.markdown();
        assert!(!md.contains("guest disk"), "{md}");
        assert!(
            md.contains("alternating whether host or guest goes first"),
            "{md}"
        );
    }

    #[test]
    fn workspace_table() {
        let w = WorkspaceReport {
            note: "No QEMU peer.".into(),
            config: WorkspaceConfig {
                ready_runs: 2,
                exec_iterations: 30,
                exec_warmup: 3,
                cli_iterations: 5,
                kernel: "/k".into(),
                agent_initramfs: "/a".into(),
                rootfs: "/r".into(),
                vm_cpus: 2,
                vm_memory_mib: 1024,
                vm_nested: false,
                timeout_s: 60,
                free_page_rounds: 0,
            },
            commands: vec![],
            environment: vec![],
            figures: vec![
                Figure::new("agent_ready", "ms", OURS, vec![5500.0, 5700.0])
                    .unwrap()
                    .with_hardware_target(250.0),
                Figure::new("exec_round_trip", "ms", OURS, vec![1.5, 1.25, 30.0])
                    .unwrap()
                    .with_p99()
                    .with_hardware_target(2.0),
                Figure::new("agent_rss", "MiB", OURS, vec![3.0]).unwrap(),
            ],
            ready_runs: vec![],
            memory_return: None,
            failures: vec![],
        };
        let nested = w.markdown(Some("in nested mode"));
        assert!(
            nested.contains("| agent_ready | ms | vmctl | 5600 | 5700 |  | 5500 | 5700 | 2 | < 250 ms (target on hardware KVM; not comparable in nested mode) |"),
            "{nested}"
        );
        assert!(
            nested.contains(
                "| exec_round_trip | ms | vmctl | 1.50 | 30.0 | 30.0 | 1.25 | 30.0 | 3 |"
            ),
            "{nested}"
        );
        assert!(
            nested.contains("| agent_rss | MiB | vmctl | 3.00 |"),
            "{nested}"
        );
        assert!(nested.contains("No QEMU peer."), "{nested}");
        let direct = w.markdown(None);
        assert!(
            direct.contains("(target on hardware KVM): missed |"),
            "{direct}"
        );
        assert!(
            direct.contains("(target on hardware KVM): met |"),
            "{direct}"
        );
        // Without the memory measure (--quick), the table says so.
        assert!(
            direct.contains(
                "Memory given back after a burst: not measured (`--free-page-rounds 0`; 0 is \
                 the default of `--quick`)."
            ),
            "{direct}"
        );
        assert!(w.errors().is_empty());
        // With it, its figures are in the table and a paragraph says how.
        let mut m = w.clone();
        m.config.free_page_rounds = 1;
        m.figures
            .push(Figure::new("held_after_free_reporting", "MiB", OURS, vec![350.0]).unwrap());
        m.memory_return = Some(MemoryReturn {
            rounds: 1,
            fill_mib: 512,
            tmpfs_mib: 576,
            interval_s: 2.0,
            window_s: 30.0,
            settle_tolerance: 0.1,
            note: "HELD is the VMM's (with virtiofsd) on this machine.".into(),
            commands: vec![],
            config_without_reporting: String::new(),
            runs: vec![],
        });
        let md = m.markdown(None);
        assert!(
            md.contains("| held_after_free_reporting | MiB | vmctl | 350.00 |"),
            "{md}"
        );
        assert!(
            md.contains(
                "Memory given back after a burst (`held_*`, `given_back_*`, `settle_*`; \
                 `_reporting`: free page reporting, vmctl's default; `_not_reporting`: \
                 `free_page_reporting = false` in the config's section of that workspace): 1 \
                 round(s)"
            ),
            "{md}"
        );
        assert!(
            md.contains("wrote 512 MiB of zeros to a 576 MiB tmpfs"),
            "{md}"
        );
        assert!(md.contains("then every 2 s for 30 s after"), "{md}");
        assert!(md.contains("within 10% of the last one for good"), "{md}");
        assert!(
            md.ends_with("round. HELD is the VMM's (with virtiofsd) on this machine.\n"),
            "{md}"
        );
        assert!(!md.contains("not measured"), "{md}");
        // A failed memory measure is said, and is an error of the run.
        m.memory_return = None;
        m.failures = vec!["memory given back: vmctl ps has no row of /w:\nNAME".into()];
        let md = m.markdown(None);
        assert!(
            md.ends_with("\n**Failed**: memory given back: vmctl ps has no row of /w:\n"),
            "{md}"
        );
        assert!(!md.contains("not measured"), "{md}");
        assert_eq!(
            m.errors(),
            [(
                "workspace VM".to_string(),
                "memory given back: vmctl ps has no row of /w:\nNAME".to_string()
            )]
        );
        // The JSON keeps both, and a report from before reads without them.
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(v["failures"].as_array().map(Vec::len), Some(1));
        let mut older = serde_json::to_value(&w).unwrap();
        assert!(older.get("memory_return").is_none() && older.get("failures").is_none());
        older["config"]
            .as_object_mut()
            .unwrap()
            .remove("free_page_rounds");
        let back: WorkspaceReport = serde_json::from_value(older).unwrap();
        assert_eq!(back.config.free_page_rounds, 0);
    }
}
