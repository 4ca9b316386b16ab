//! The benchmark harness's smoke check: `vm-bench --quick` runs every section against
//! real VMs (through the nested host where KVM is not hardware-backed) and writes a
//! complete report. It checks that the harness works, not the numbers.

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use vm_tests::{find_executable, retry_if_vm_lost, vm_available, TempDir};

const TEST: &str = "quick_smoke::every_section_reports_figures";

/// Our figures every quick run must have, with at least one sample each.
const OUR_FIGURES: [&str; 9] = [
    "boot_to_init_wall",
    "boot_to_init_wall@2cpu-1024mib",
    "boot_timer_since_vmm_start",
    "vmm_overhead_rss",
    "total_wall",
    "cold_agent_ready",
    "cold_first_exec_output",
    "cold_agent_ready@2cpu-1024mib",
    "virtiofsd_rss",
];

#[test]
fn every_section_reports_figures() {
    if !vm_available(TEST) {
        return;
    }
    if find_executable(Path::new("qemu-system-x86_64")).is_none() {
        // The peer every boot figure is measured against.
        vm_tests::record_skip(
            TEST,
            "no qemu-system-x86_64 (apt-get install qemu-system-x86)",
        );
        assert!(
            !vm_tests::vms_required(),
            "VMCTL_REQUIRE_VM=1 but {TEST} needs qemu-system-x86_64"
        );
        return;
    }
    retry_if_vm_lost(TEST, quick_run);
}

fn quick_run() {
    let dir = TempDir::new("bench-quick");
    let out = dir.join("quick.json");
    // The fs scripts' limit bounds how long the harness lets a step stay silent
    // before it takes the nested host for stuck.
    let run = Command::new(env!("CARGO_BIN_EXE_vm-bench"))
        .args(["--quick", "--fs-timeout", "120", "--out"])
        .arg(&out)
        .output()
        .expect("run vm-bench");
    let stderr = String::from_utf8_lossy(&run.stderr);
    let tail = failure_log(&stderr);
    assert!(
        run.status.success(),
        "vm-bench --quick failed ({}); its log without the report:\n{tail}",
        run.status
    );
    let stdout: Value = serde_json::from_slice(&run.stdout)
        .unwrap_or_else(|e| panic!("stdout is not the JSON report: {e}\n{tail}"));
    let written: Value = serde_json::from_str(
        &std::fs::read_to_string(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display())),
    )
    .expect("the written report is JSON");
    assert_eq!(stdout, written, "stdout and {} differ", out.display());
    check_report(&written);
    for name in ["quick.md", "boot_time.png", "memory_per_vm.png"] {
        let path = dir.join(name);
        let len = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{} was not written: {e}", path.display()))
            .len();
        assert!(len > 100, "{} holds only {len} bytes", path.display());
    }
    let markdown = std::fs::read_to_string(dir.join("quick.md")).expect("markdown");
    for needle in [
        "cold_agent_ready",
        "ours/QEMU",
        "virtiofsd_rss",
        "virtio-fs / guest disk",
    ] {
        assert!(markdown.contains(needle), "quick.md lacks {needle:?}");
    }
}

/// What tells why a run failed: the progress log before the Markdown report (which
/// would otherwise fill the tail) and the lines after it, the last 8000 characters.
fn failure_log(stderr: &str) -> String {
    let kept = match stderr.find(REPORT_TITLE) {
        Some(start) => {
            let after_report = stderr[start..]
                .find("\nvm-bench: wrote ")
                .map(|end| &stderr[start + end..])
                .unwrap_or("");
            format!("{}\n[the Markdown report]{after_report}", &stderr[..start])
        }
        None => stderr.to_string(),
    };
    let chars: Vec<char> = kept.chars().collect();
    chars[chars.len().saturating_sub(8000)..].iter().collect()
}

/// The first line of the Markdown report the harness prints on stderr.
const REPORT_TITLE: &str = "\nBoot benchmark, ";

fn check_report(report: &Value) {
    assert_eq!(report["config"]["quick"], true, "{report}");
    assert!(report["incomplete"].is_null(), "{}", report["incomplete"]);
    let mode = report["mode"].as_str().unwrap_or("");
    assert!(mode == "direct" || mode == "nested", "mode {mode:?}");
    let figures = report["figures"].as_array().expect("figures");
    let ours = |name: &str| {
        figures
            .iter()
            .find(|f| f["name"] == name && f["vmm"] == "vmctl")
            .unwrap_or_else(|| panic!("no figure {name} of ours in {report}"))
    };
    for name in OUR_FIGURES {
        let f = ours(name);
        let samples = f["samples"].as_array().expect("samples");
        assert!(!samples.is_empty(), "{name}: no samples");
        assert!(
            f["median"].as_f64().is_some_and(|m| m > 0.0),
            "{name}: median {}",
            f["median"]
        );
        assert_eq!(f["mode"], mode, "{name}: mode");
        assert!(
            f["machine"].as_str().is_some_and(|m| !m.is_empty()),
            "{name}: machine"
        );
    }
    // The first exec's output comes after the agent answered.
    let median = |name: &str| ours(name)["median"].as_f64().unwrap_or(0.0);
    assert!(median("cold_first_exec_output") >= median("cold_agent_ready"));
    let ratios = report["ratios"].as_array().expect("ratios");
    for name in [
        "boot_to_init_wall",
        "vmm_overhead_rss",
        "boot_to_init_wall@2cpu-1024mib",
    ] {
        assert!(
            ratios
                .iter()
                .any(|r| r["name"] == name && r["ours_over_qemu"].as_f64().is_some_and(|v| v > 0.0)),
            "no ratio for {name}: {ratios:?}"
        );
    }
    // Every other section ran, measured something and failed nowhere.
    for section in ["churn", "workspace", "fs", "egress", "agent"] {
        let s = &report[section];
        assert!(s.is_object(), "no {section} section in {report}");
        assert!(s["error"].is_null(), "{section}: {}", s["error"]);
        if let Some(failures) = s["failures"].as_array() {
            assert!(failures.is_empty(), "{section} failures: {failures:?}");
        }
        let figures = s["figures"].as_array().expect("a section's figures");
        assert!(!figures.is_empty(), "{section}: no figures");
        for f in figures {
            assert!(
                f["error"].is_null(),
                "{section} {}: {}",
                f["name"],
                f["error"]
            );
        }
    }
    // The guest disk side (the same workloads in the guest on its own file system)
    // measured every workload, off the share, and its ratio to the share.
    let fs = &report["fs"];
    let sides = fs["sides"].as_array().expect("fs.sides");
    let disk = sides
        .iter()
        .find(|s| s["side"] == "guest_disk")
        .unwrap_or_else(|| panic!("no guest_disk side in fs.sides: {sides:?}"));
    let disk_fs = disk["fs_type"].as_str().unwrap_or("");
    assert!(
        !disk_fs.is_empty() && !["fuse", "fuseblk", "virtiofs"].contains(&disk_fs),
        "the guest disk's file system: {disk}"
    );
    for f in fs["figures"].as_array().expect("fs.figures") {
        let name = &f["name"];
        assert!(
            f["guest_disk_error"].is_null(),
            "fs {name} (guest disk): {}",
            f["guest_disk_error"]
        );
        let n = f["guest_disk"]["samples"].as_array().map_or(0, Vec::len);
        assert!(n > 0, "fs {name}: no guest disk samples: {f}");
        assert!(
            f["virtio_fs_over_guest_disk"]
                .as_f64()
                .is_some_and(|r| r > 0.0),
            "fs {name}: virtio_fs_over_guest_disk {}",
            f["virtio_fs_over_guest_disk"]
        );
    }
    // The host edits' probe answered every round on both sides.
    let edits = &report["fs"]["edits"];
    assert!(edits["errors"].is_null(), "fs edits: {}", edits["errors"]);
    let rounds = edits["rounds"].as_u64().expect("fs.edits.rounds");
    let figures = edits["figures"].as_array().expect("fs.edits.figures");
    assert_eq!(figures.len(), 6, "{edits}");
    for f in figures {
        for side in ["host", "guest"] {
            let n = f[side]["samples"].as_array().map_or(0, Vec::len) as u64;
            assert_eq!(n, rounds, "fs edits {} ({side}): {f}", f["name"]);
        }
    }
}

#[test]
fn failure_log_keeps_the_progress_and_drops_the_report() {
    let stderr = "vm-bench: fs: script failed: timed out\n\nBoot benchmark, nested host, today\n\n\
                  | figure | unit |\n|---|---|\n\nvm-bench: wrote a.json\nvm-bench: error: incomplete\n";
    let log = failure_log(stderr);
    assert!(
        log.starts_with("vm-bench: fs: script failed: timed out\n"),
        "{log}"
    );
    assert!(!log.contains("| figure"), "{log}");
    assert!(
        log.ends_with("vm-bench: wrote a.json\nvm-bench: error: incomplete\n"),
        "{log}"
    );
    assert_eq!(failure_log("no report at all"), "no report at all");
}
