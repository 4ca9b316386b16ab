//! The benchmark's report: one JSON document (`boot.json`) and a Markdown table
//! (`boot.md`).

use serde::{Deserialize, Serialize};

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
}

impl Machine {
    pub fn this() -> Machine {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        let cpu_model = read("/proc/cpuinfo")
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
        }
    }
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
        })
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
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub benchmark: String,
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
    /// A short Markdown summary: header lines and one table.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let where_ = if self.mode == "nested" {
            "nested host (QEMU TCG), not hardware figures"
        } else {
            "direct, hardware KVM"
        };
        s.push_str(&format!("Boot benchmark, {where_}, {}\n\n", self.date));
        if let Some(note) = &self.note {
            s.push_str(&format!("{note}\n\n"));
        }
        let m = self.measured_on.as_ref().unwrap_or(&self.machine);
        s.push_str(&format!(
            "Machine: {} ({}, {} CPUs, Linux {}){}. Commit {}{}. {} boot(s) per VMM, {} vCPU, {} MiB; \
             memory: {} boot(s) per VMM.\n\n",
            self.machine.hostname,
            self.machine.cpu_model,
            self.machine.cpus,
            self.machine.kernel.split_whitespace().next().unwrap_or(""),
            if self.measured_on.is_some() {
                format!("; measured in the nested host ({}, {} vCPUs)", m.cpu_model, m.cpus)
            } else {
                String::new()
            },
            self.commit.as_deref().unwrap_or("unknown"),
            if self.dirty == Some(true) { " (uncommitted changes)" } else { "" },
            self.config.runs,
            self.config.vcpus,
            self.config.memory_mib,
            self.config.memory_runs,
        ));
        s.push_str("| figure | unit | VMM | median | p90 | min | max | n | ours/QEMU |\n");
        s.push_str("|---|---|---|---:|---:|---:|---:|---:|---:|\n");
        for f in &self.figures {
            let ratio = if f.vmm == OURS {
                self.ratios
                    .iter()
                    .find(|r| r.name == f.name)
                    .map(|r| format!("{:.2}", r.ours_over_qemu))
                    .unwrap_or_default()
            } else {
                String::new()
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                f.name,
                f.unit,
                f.vmm,
                fmt_num(f.median, &f.unit),
                fmt_num(f.p90, &f.unit),
                fmt_num(f.min, &f.unit),
                fmt_num(f.max, &f.unit),
                f.samples.len(),
                ratio
            ));
        }
        if let Some(w) = &self.workspace {
            s.push('\n');
            s.push_str(&w.markdown(self.mode == "nested"));
        }
        s
    }
}

impl WorkspaceReport {
    /// The workspace-VM table; `nested`: the figures were measured in the nested host.
    pub fn markdown(&self, nested: bool) -> String {
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
            let target = match &f.target {
                None => String::new(),
                Some(t) if nested => format!(
                    "< {} {} (target on {}; not comparable in nested mode)",
                    t.below, f.unit, t.on
                ),
                Some(t) => format!(
                    "< {} {} (target on {}): {}",
                    t.below,
                    f.unit,
                    t.on,
                    if f.median < t.below { "met" } else { "missed" }
                ),
            };
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

#[cfg(test)]
mod tests {
    use super::*;

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
        };
        let nested = w.markdown(true);
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
        let direct = w.markdown(false);
        assert!(
            direct.contains("(target on hardware KVM): missed |"),
            "{direct}"
        );
        assert!(
            direct.contains("(target on hardware KVM): met |"),
            "{direct}"
        );
    }
}
