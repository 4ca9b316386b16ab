//! The benchmark's report: one JSON document (`boot.json`) and a Markdown table
//! (`boot.md`).

use serde::{Deserialize, Serialize};

use crate::stats::{summarize, Summary};

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
    pub samples: Vec<f64>,
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
            samples,
        })
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
}
