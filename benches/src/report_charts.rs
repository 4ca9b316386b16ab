//! The report's PNG charts: the boot-time distribution of both VMMs and the memory
//! a VM costs, written beside the JSON and linked from the Markdown.

use std::path::{Path, PathBuf};

use crate::charts::{bar_chart, distribution_chart, Bar, Series};
use crate::report::Report;

/// Docker Sandboxes documents about 1 GB of host memory per idle sandbox.
const DOCKER_SANDBOXES_MIB: f64 = 1024.0;
/// The project's target for host memory per idle VM (hardware KVM).
const IDLE_TARGET_MIB: f64 = 64.0;

/// The charts of `report`: (file name, PNG) for each one there is data for.
pub fn render(report: &Report) -> Vec<(String, Vec<u8>)> {
    let mut charts = Vec::new();
    let boot: Vec<Series> = report
        .figures
        .iter()
        .filter(|f| f.name == "boot_to_init_wall")
        .map(|f| Series {
            label: f.vmm.clone(),
            samples: f.samples.clone(),
        })
        .collect();
    let title = format!("Boot to guest init ({} mode, lower is better)", report.mode);
    if let Ok(png) = distribution_chart(&title, "ms", &boot) {
        charts.push(("boot_time.png".to_string(), png));
    }
    let mut bars: Vec<Bar> = report
        .figures
        .iter()
        .filter(|f| f.name == "vmm_overhead_rss")
        .map(|f| Bar {
            label: format!("{} VMM overhead", f.vmm),
            value: f.median,
            reference: None,
        })
        .collect();
    if let Some(memory) = report.agent.as_ref().and_then(|a| a.memory.as_ref()) {
        bars.push(Bar {
            label: "vmctl idle VM (host)".into(),
            value: memory.per_vm_mib,
            reference: Some(IDLE_TARGET_MIB),
        });
        bars.push(Bar {
            label: "Docker Sandboxes (documented)".into(),
            value: DOCKER_SANDBOXES_MIB,
            reference: None,
        });
    }
    let title = format!("Memory per VM ({} mode, lower is better)", report.mode);
    if let Ok(png) = bar_chart(&title, "MiB", &bars) {
        charts.push(("memory_per_vm.png".to_string(), png));
    }
    charts
}

/// Writes the charts into `dir`; returns the Markdown that shows them.
pub fn write(report: &Report, dir: &Path) -> Result<(Vec<PathBuf>, String), String> {
    let mut written = Vec::new();
    let mut markdown = String::new();
    for (name, png) in render(report) {
        let path = dir.join(&name);
        std::fs::write(&path, png).map_err(|e| format!("write {}: {e}", path.display()))?;
        markdown.push_str(&format!("![{name}]({name})\n\n"));
        written.push(path);
    }
    Ok((written, markdown))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(figures: serde_json::Value) -> Report {
        serde_json::from_value(serde_json::json!({
            "benchmark": "boot", "date": "2026-11-29T00:00:00Z", "mode": "nested",
            "note": null, "measured_on": null, "commit": null, "dirty": null,
            "machine": {"hostname": "h", "cpu_model": "c", "cpus": 2, "kernel": "k",
                        "hardware_kvm": false},
            "kernel": "k", "initrd": "i", "vmctl": "v", "qemu": "q", "qemu_version": "7.2",
            "config": {"runs": 3, "quick": true, "vcpus": 1, "memory_mib": 128,
                       "memory_runs": 1, "memory_run_sleep_s": 1, "timeout_s": 60,
                       "marker": "m"},
            "commands": [], "memory_rules": [], "ratios": [],
            "figures": figures,
        }))
        .expect("a report")
    }

    fn figure(name: &str, vmm: &str, samples: &[f64]) -> serde_json::Value {
        serde_json::json!({"name": name, "unit": "ms", "vmm": vmm, "median": samples[0],
            "p90": samples[0], "min": samples[0], "max": samples[0], "samples": samples})
    }

    #[test]
    fn boot_and_memory_charts_come_from_the_figures() {
        let r = report(serde_json::json!([
            figure("boot_to_init_wall", "ours", &[40.0, 42.0, 45.0]),
            figure("boot_to_init_wall", "qemu", &[90.0, 95.0, 99.0]),
            figure("vmm_overhead_rss", "ours", &[3.5]),
            figure("vmm_overhead_rss", "qemu", &[20.0]),
        ]));
        let charts = render(&r);
        let names: Vec<&str> = charts.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["boot_time.png", "memory_per_vm.png"]);
        for (_, png) in &charts {
            assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        }
        let dir = tempfile_dir();
        let (written, markdown) = write(&r, &dir).unwrap();
        assert_eq!(written.len(), 2);
        assert!(markdown.contains("![boot_time.png](boot_time.png)"));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn no_figures_no_charts() {
        assert!(render(&report(serde_json::json!([]))).is_empty());
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vm-bench-charts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
