//! Density and churn: how many VMs start per second in a loop of create/destroy, and
//! whether the host's memory returns to its baseline after the loop (no leak across
//! the cycles). Each VMM (ours, then QEMU's microvm as the peer) boots the boot
//! figures' VM C times back to back, one at a time, to its power-off; around each
//! loop the host's used memory is sampled and the VMs' processes are looked for. See
//! `benches/README.md`.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::agent::parse_meminfo;
use crate::boot::{run_vm, say};
use crate::report::{first_line, fmt_sig, ratios, Figure, Ratio, OURS, QEMU};
use crate::stats::median;

/// Create/destroy cycles per VMM: the issue's 100, 10 with `--quick`.
pub const CYCLES: usize = 100;
pub const QUICK_CYCLES: usize = 2;
/// A loop stops after this many failed cycles (each may have waited for a timeout).
pub const MAX_FAILURES: usize = 3;
/// A leak is flagged when the used memory after the loop exceeds the one before by
/// more than this floor or this fraction of the one before, whichever is more.
pub const LEAK_FLOOR_MIB: u64 = 16;
pub const LEAK_FRACTION: f64 = 0.05;
/// The error messages kept per loop (the first ones).
const KEPT_ERRORS: usize = 3;

const NOTE_DIRECT: &str = "Direct: measured on this machine, where the VMs run on hardware KVM; \
the used memory is the whole machine's, so anything else running meanwhile is in it.";
const NOTE_NESTED: &str = "Nested: measured inside the QEMU-TCG nested host, where the VMs run \
on KVM emulated by TCG: the absolute rates and times are TCG-emulated, not hardware figures; the \
ours/QEMU ratios, measured side by side, are what count. The used memory is the nested host's.";

/// The cycles of each loop: `given` (`--churn-cycles`), else the issue's.
pub fn cycles(quick: bool, given: Option<usize>) -> usize {
    given.unwrap_or(if quick { QUICK_CYCLES } else { CYCLES })
}

/// How the host's used memory is sampled around a loop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    /// Samples taken before and after the loop (their median counts), this far apart
    /// (seconds in JSON).
    pub samples: usize,
    #[serde(with = "crate::report::secs")]
    pub interval: Duration,
    /// The wait after the loop before the first sample (seconds in JSON).
    #[serde(with = "crate::report::secs")]
    pub settle: Duration,
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling {
            samples: 3,
            interval: Duration::from_secs(1),
            settle: Duration::from_secs(3),
        }
    }
}

impl Sampling {
    /// `--quick`: one sample each side, a short settle (a smoke check of the loop).
    pub fn quick() -> Sampling {
        Sampling {
            samples: 1,
            interval: Duration::from_secs(1),
            settle: Duration::from_secs(1),
        }
    }

    pub fn for_run(quick: bool) -> Sampling {
        if quick {
            Sampling::quick()
        } else {
            Sampling::default()
        }
    }
}

/// How long a measurement may take at most (for the nested run's time limit): every
/// boot to its marker and to its exit, the sampling, for each VMM.
pub fn time_budget(cycles: usize, vmms: usize, timeout: Duration, s: &Sampling) -> Duration {
    let per_loop = timeout * (2 * cycles as u32)
        + s.settle
        + s.interval * (2 * s.samples as u32)
        + Duration::from_secs(10);
    per_loop * vmms as u32 + Duration::from_secs(30)
}

/// Cycles per second: `cycles` completed in `total`; `None` for none or no time.
pub fn rate(cycles: usize, total: Duration) -> Option<f64> {
    let s = total.as_secs_f64();
    (cycles > 0 && s > 0.0).then(|| cycles as f64 / s)
}

/// The host's used memory before and after a loop, and whether it came back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeakCheck {
    /// Host used memory (MemTotal - MemAvailable, KiB): every sample and their median.
    pub before_samples_kib: Vec<u64>,
    pub before_kib: u64,
    pub after_samples_kib: Vec<u64>,
    pub after_kib: u64,
    /// after - before (negative: less used after), in MiB, and per cycle in KiB.
    pub delta_mib: f64,
    pub per_cycle_kib: f64,
    /// max(LEAK_FLOOR_MIB, LEAK_FRACTION x before), in MiB.
    pub threshold_mib: f64,
    /// `delta_mib > threshold_mib`: a note, not a failure (the machine's noise).
    pub leak: bool,
}

/// The median of `samples` (KiB), rounded down; 0 for none.
fn median_kib(samples: &[u64]) -> u64 {
    if samples.is_empty() {
        return 0;
    }
    let mut sorted: Vec<f64> = samples.iter().map(|&v| v as f64).collect();
    sorted.sort_by(|a, b| a.total_cmp(b));
    median(&sorted) as u64
}

impl LeakCheck {
    /// The check from the samples before and after a loop of `cycles` cycles.
    pub fn new(before_samples_kib: Vec<u64>, after_samples_kib: Vec<u64>, cycles: usize) -> Self {
        let before_kib = median_kib(&before_samples_kib);
        let after_kib = median_kib(&after_samples_kib);
        let delta_kib = after_kib as f64 - before_kib as f64;
        let threshold_kib = ((LEAK_FLOOR_MIB << 10) as f64).max(LEAK_FRACTION * before_kib as f64);
        LeakCheck {
            before_samples_kib,
            before_kib,
            after_samples_kib,
            after_kib,
            delta_mib: delta_kib / 1024.0,
            per_cycle_kib: if cycles > 0 {
                delta_kib / cycles as f64
            } else {
                0.0
            },
            threshold_mib: threshold_kib / 1024.0,
            leak: delta_kib > threshold_kib,
        }
    }
}

/// A process as `/proc/<pid>/stat` and `cmdline` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Process {
    pub pid: u32,
    pub state: String,
    pub pgid: u32,
    pub cmdline: String,
}

/// The state and the process group of `/proc/<pid>/stat` (`pid (comm) S ppid pgrp
/// ...`; comm may contain spaces and parentheses, so the fields follow the last `)`).
pub fn parse_stat(text: &str) -> Option<(String, u32)> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.to_string();
    let _ppid = fields.next()?;
    let pgid = fields.next()?.parse().ok()?;
    Some((state, pgid))
}

/// Every process of `proc` (the `/proc` directory) but this one.
fn processes(proc: &Path) -> Vec<Process> {
    let me = std::process::id();
    let Ok(dir) = fs::read_dir(proc) else {
        return Vec::new();
    };
    let mut v = Vec::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        // A process may be gone by now: skip it.
        let Some((state, pgid)) = fs::read_to_string(e.path().join("stat"))
            .ok()
            .and_then(|s| parse_stat(&s))
        else {
            continue;
        };
        let cmdline = fs::read(e.path().join("cmdline"))
            .map(|b| {
                String::from_utf8_lossy(&b)
                    .split('\0')
                    .filter(|w| !w.is_empty())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default();
        v.push(Process {
            pid,
            state,
            pgid,
            cmdline,
        });
    }
    v.sort_by_key(|p| p.pid);
    v
}

/// What a loop left running: processes that were not there before it, in the process
/// group of one of its VMMs (each VMM leads one), or whose command line contains
/// `needle` (the loop's initramfs path, which every VMM's command line has).
pub fn leftovers(
    before: &[Process],
    after: &[Process],
    groups: &HashSet<u32>,
    needle: &str,
) -> Vec<Process> {
    let old: HashSet<u32> = before.iter().map(|p| p.pid).collect();
    after
        .iter()
        .filter(|p| !old.contains(&p.pid))
        .filter(|p| groups.contains(&p.pgid) || (!needle.is_empty() && p.cmdline.contains(needle)))
        .cloned()
        .collect()
}

/// Open file descriptors of this process.
fn own_fds() -> Option<usize> {
    fs::read_dir("/proc/self/fd").ok().map(|d| d.count())
}

/// Unix sockets of this network namespace (`/proc/net/unix` less its header).
fn unix_sockets() -> Option<usize> {
    fs::read_to_string("/proc/net/unix")
        .ok()
        .map(|t| t.lines().count().saturating_sub(1))
}

/// One VMM's loop.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChurnLoop {
    pub vmm: String,
    /// Planned, tried (fewer when the loop stopped after MAX_FAILURES), completed.
    pub cycles: usize,
    pub attempted: usize,
    pub completed: usize,
    pub failures: usize,
    /// From the first spawn to the last VMM's exit, in seconds.
    pub total_s: f64,
    /// completed / total_s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cycles_per_s: Option<f64>,
    /// Each completed cycle's wall time (spawn to exit, pipes closed), in ms.
    pub cycle_ms: Vec<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<LeakCheck>,
    /// Processes of the loop's VMMs still there after it (killed after counting).
    pub leftover_processes: Vec<Process>,
    /// This process's open fds and the namespace's unix sockets, before and after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub harness_fds: Option<(usize, usize)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unix_sockets: Option<(usize, usize)>,
    /// The first failures' messages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChurnConfig {
    pub cycles: usize,
    pub max_failures: usize,
    pub timeout_s: u64,
    pub marker: String,
    pub sampling: Sampling,
    pub meminfo: String,
    pub leak_floor_mib: u64,
    pub leak_fraction: f64,
}

/// The churn section.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChurnReport {
    pub note: String,
    /// Where the loops ran.
    pub host: String,
    pub nested: bool,
    pub config: ChurnConfig,
    /// Each VMM's command line (one cycle).
    pub commands: Vec<(String, Vec<String>)>,
    /// `churn_cycle_wall_ms` (every completed cycle), `churn_cycles_per_s`,
    /// `churn_memory_delta_mib` and `churn_memory_per_cycle_kib` (one value each), per
    /// VMM.
    pub figures: Vec<Figure>,
    /// ours / QEMU of `churn_cycle_wall_ms` (below 1: ours faster) and of
    /// `churn_cycles_per_s` (above 1: ours faster).
    pub ratios: Vec<Ratio>,
    pub loops: Vec<ChurnLoop>,
    pub notes: Vec<String>,
    /// A loop's failed cycles ("vmctl", "qemu-microvm") and the section's own failure.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failures: Vec<(String, String)>,
}

/// What to measure and with what.
#[derive(Debug, Clone)]
pub struct ChurnBench {
    /// (label, argv of one VM) per VMM, in the order measured.
    pub vmms: Vec<(String, Vec<OsString>)>,
    /// What the guest prints before powering off.
    pub marker: String,
    pub cycles: usize,
    /// Per boot, to the marker and again to the exit.
    pub timeout: Duration,
    pub nested: bool,
    /// `/proc/meminfo` and `/proc` (the tests' are their own).
    pub meminfo: PathBuf,
    pub proc: PathBuf,
    pub sampling: Sampling,
    /// A string every VM's command line contains and no other process's: the loop's
    /// initramfs path.
    pub needle: String,
}

impl ChurnReport {
    /// Every failure, as (what, message).
    pub fn errors(&self) -> Vec<(String, String)> {
        self.failures
            .iter()
            .map(|(what, e)| (format!("churn {what}"), e.clone()))
            .collect()
    }

    pub fn markdown(&self) -> String {
        let c = &self.config;
        let mut s = format!(
            "Churn (create/destroy; host: {}): per VMM, {} cycles back to back, one VM at a time: \
             each boots the boot figures' VM (same command line, kernel and initramfs) until \
             the guest prints {} and powers off, and waits for the VMM's exit. Cycle = spawn to \
             exit; cycles/s = completed cycles / the loop's wall time. Host used memory = \
             MemTotal − MemAvailable ({}): the median of {} samples {} s apart before the loop \
             and, after a {} s settle, after it; a leak is flagged (a note, not a failure) \
             above max({} MiB, {}% of before). Leftover processes: new ones in a VMM's process \
             group or with the loop's initramfs on their command line, {} s after the loop. \
             A loop stops after {} failed cycles. {}\n\n",
            self.host,
            c.cycles,
            c.marker,
            c.meminfo,
            c.sampling.samples,
            c.sampling.interval.as_secs_f64(),
            c.sampling.settle.as_secs_f64(),
            c.leak_floor_mib,
            c.leak_fraction * 100.0,
            c.sampling.settle.as_secs_f64(),
            c.max_failures,
            self.note
        );
        for (what, e) in &self.failures {
            s.push_str(&format!(
                "**{what} error:** {} (full message in the JSON report)\n\n",
                first_line(e)
            ));
        }
        let ratio = |name: &str, vmm: &str| {
            if vmm != OURS {
                return String::new();
            }
            self.ratios
                .iter()
                .find(|r| r.name == name)
                .map(|r| format!("{:.2}", r.ours_over_qemu))
                .unwrap_or_default()
        };
        let walls: Vec<&Figure> = self
            .figures
            .iter()
            .filter(|f| f.name == "churn_cycle_wall_ms")
            .collect();
        if !walls.is_empty() {
            s.push_str("| figure | unit | VMM | median | p90 | min | max | n | ours/QEMU |\n");
            s.push_str("|---|---|---|---:|---:|---:|---:|---:|---:|\n");
            for f in walls {
                s.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    f.name,
                    f.unit,
                    f.vmm,
                    fmt_sig(f.median),
                    fmt_sig(f.p90),
                    fmt_sig(f.min),
                    fmt_sig(f.max),
                    f.samples.len(),
                    ratio(&f.name, &f.vmm)
                ));
            }
            s.push('\n');
        }
        if !self.loops.is_empty() {
            s.push_str(
                "| VMM | cycles ok/planned | failures | cycles/s | ours/QEMU | used before MiB \
                 | used after MiB | Δ MiB | Δ per cycle KiB | leak | leftover processes \
                 | harness fds | unix sockets |\n",
            );
            s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|\n");
            let pair =
                |p: Option<(usize, usize)>| p.map_or("–".into(), |(a, b)| format!("{a} → {b}"));
            for l in &self.loops {
                let (before, after, delta, per_cycle, leak) = match &l.memory {
                    Some(m) => (
                        format!("{:.0}", m.before_kib as f64 / 1024.0),
                        format!("{:.0}", m.after_kib as f64 / 1024.0),
                        format!("{:+.1}", m.delta_mib),
                        format!("{:+.0}", m.per_cycle_kib),
                        format!(
                            "{} (> {:.0} MiB)",
                            if m.leak { "**yes**" } else { "no" },
                            m.threshold_mib
                        ),
                    ),
                    None => ("–".into(), "–".into(), "–".into(), "–".into(), "–".into()),
                };
                s.push_str(&format!(
                    "| {} | {}/{} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    l.vmm,
                    l.completed,
                    l.cycles,
                    l.failures,
                    l.cycles_per_s.map_or("–".into(), fmt_sig),
                    ratio("churn_cycles_per_s", &l.vmm),
                    before,
                    after,
                    delta,
                    per_cycle,
                    leak,
                    l.leftover_processes.len(),
                    pair(l.harness_fds),
                    pair(l.unix_sockets)
                ));
            }
        }
        for n in &self.notes {
            s.push_str(&format!("\n{n}\n"));
        }
        s
    }
}

fn read_used(meminfo: &Path) -> Result<u64, String> {
    let text =
        fs::read_to_string(meminfo).map_err(|e| format!("read {}: {e}", meminfo.display()))?;
    parse_meminfo(&text)
        .map(|m| m.used_kib())
        .map_err(|e| format!("{}: {e}", meminfo.display()))
}

/// `s.samples` samples of the used memory, `s.interval` apart.
fn sample(b: &ChurnBench) -> Result<Vec<u64>, String> {
    let mut v = Vec::new();
    for i in 0..b.sampling.samples.max(1) {
        if i > 0 {
            thread::sleep(b.sampling.interval);
        }
        v.push(read_used(&b.meminfo)?);
    }
    Ok(v)
}

/// Runs one VMM's loop; the failure message when a cycle failed.
fn run_loop(b: &ChurnBench, label: &str, argv: &[OsString]) -> (ChurnLoop, Option<String>) {
    let mut l = ChurnLoop {
        vmm: label.into(),
        cycles: b.cycles,
        attempted: 0,
        completed: 0,
        failures: 0,
        total_s: 0.0,
        cycles_per_s: None,
        cycle_ms: Vec::new(),
        memory: None,
        leftover_processes: Vec::new(),
        harness_fds: None,
        unix_sockets: None,
        errors: Vec::new(),
    };
    let before_processes = processes(&b.proc);
    let fds_before = own_fds();
    let sockets_before = unix_sockets();
    let before = match sample(b) {
        Ok(v) => Some(v),
        Err(e) => {
            say(format!("warning: churn {label}: no memory baseline: {e}"));
            None
        }
    };
    say(format!(
        "churn {label}: {} create/destroy cycles{}",
        b.cycles,
        before
            .as_ref()
            .map(|v| format!(
                "; host used memory before: {:.0} MiB",
                median_kib(v) as f64 / 1024.0
            ))
            .unwrap_or_default()
    ));
    let mut groups = HashSet::new();
    let mut failure = None;
    let start = Instant::now();
    for i in 0..b.cycles {
        if l.failures >= MAX_FAILURES {
            break;
        }
        l.attempted += 1;
        let t = Instant::now();
        match run_vm(label, argv, &b.marker, b.timeout, None) {
            Ok(r) => {
                let ms = t.elapsed().as_secs_f64() * 1000.0;
                groups.insert(r.pid);
                l.cycle_ms.push(ms);
                l.completed += 1;
                // Every tenth cycle, and the last: a hundred lines would drown the log.
                if (i + 1) % 10 == 0 || i + 1 == b.cycles {
                    say(format!(
                        "[churn {}/{}] {label}: cycle {ms:.0} ms, {:.2} cycles/s so far",
                        i + 1,
                        b.cycles,
                        l.completed as f64 / start.elapsed().as_secs_f64()
                    ));
                }
            }
            Err(e) => {
                l.failures += 1;
                say(format!(
                    "error: churn {label}: cycle {}: {}",
                    i + 1,
                    first_line(&e)
                ));
                if l.errors.len() < KEPT_ERRORS {
                    l.errors.push(format!("cycle {}: {e}", i + 1));
                }
            }
        }
    }
    let total = start.elapsed();
    l.total_s = total.as_secs_f64();
    l.cycles_per_s = rate(l.completed, total);
    if l.failures > 0 {
        failure = Some(format!(
            "{} of {} cycle(s) failed{}; first: {}",
            l.failures,
            l.attempted,
            if l.attempted < b.cycles {
                format!(" (stopped after {MAX_FAILURES} failures)")
            } else {
                String::new()
            },
            l.errors.first().map(String::as_str).unwrap_or("")
        ));
    }
    thread::sleep(b.sampling.settle);
    let after = sample(b);
    let after_processes = processes(&b.proc);
    l.leftover_processes = leftovers(&before_processes, &after_processes, &groups, &b.needle);
    for p in &l.leftover_processes {
        say(format!(
            "warning: churn {label}: left running: pid {} ({}) {}; killing it",
            p.pid, p.state, p.cmdline
        ));
        let _ = Command::new("kill")
            .args(["-KILL", &p.pid.to_string()])
            .stderr(Stdio::null())
            .status();
    }
    l.harness_fds = fds_before.zip(own_fds());
    l.unix_sockets = sockets_before.zip(unix_sockets());
    match (before, after) {
        (Some(before), Ok(after)) => {
            let m = LeakCheck::new(before, after, l.completed);
            say(format!(
                "churn {label}: {}/{} cycles in {:.1} s ({} cycles/s); host used memory {:.0} → \
                 {:.0} MiB ({:+.1} MiB, {:+.0} KiB per cycle){}",
                l.completed,
                b.cycles,
                l.total_s,
                l.cycles_per_s.map_or("–".into(), fmt_sig),
                m.before_kib as f64 / 1024.0,
                m.after_kib as f64 / 1024.0,
                m.delta_mib,
                m.per_cycle_kib,
                if m.leak {
                    format!(": above {:.0} MiB, flagged as a leak", m.threshold_mib)
                } else {
                    String::new()
                }
            ));
            l.memory = Some(m);
        }
        (_, Err(e)) => say(format!("warning: churn {label}: no memory after: {e}")),
        (None, Ok(_)) => {}
    }
    (l, failure)
}

/// Measures the section. Never fails as a whole: failures are the report's
/// `failures` (each VMM's loop runs whatever the other's did).
pub fn measure(b: &ChurnBench) -> ChurnReport {
    let str_argv = |v: &[OsString]| -> Vec<String> {
        v.iter().map(|a| a.to_string_lossy().into_owned()).collect()
    };
    let mut report = ChurnReport {
        note: if b.nested { NOTE_NESTED } else { NOTE_DIRECT }.into(),
        host: if b.nested {
            "the QEMU-TCG nested host".into()
        } else {
            "this machine".into()
        },
        nested: b.nested,
        config: ChurnConfig {
            cycles: b.cycles,
            max_failures: MAX_FAILURES,
            timeout_s: b.timeout.as_secs(),
            marker: b.marker.clone(),
            sampling: b.sampling.clone(),
            meminfo: b.meminfo.display().to_string(),
            leak_floor_mib: LEAK_FLOOR_MIB,
            leak_fraction: LEAK_FRACTION,
        },
        commands: b
            .vmms
            .iter()
            .map(|(label, argv)| (label.clone(), str_argv(argv)))
            .collect(),
        figures: Vec::new(),
        ratios: Vec::new(),
        loops: Vec::new(),
        notes: Vec::new(),
        failures: Vec::new(),
    };
    if b.cycles == 0 || b.vmms.is_empty() {
        report
            .failures
            .push(("churn".into(), "no cycles or no VMM to measure".into()));
        return report;
    }
    for (label, argv) in &b.vmms {
        let (l, failure) = run_loop(b, label, argv);
        if let Some(e) = failure {
            report.failures.push((label.clone(), e));
        }
        // Ours must leave nothing running; QEMU's leftovers are only reported.
        if label == OURS && !l.leftover_processes.is_empty() {
            report.failures.push((
                label.clone(),
                format!(
                    "{} process(es) of its VMMs still ran after the loop (killed): {}",
                    l.leftover_processes.len(),
                    l.leftover_processes
                        .iter()
                        .map(|p| format!("pid {} {}", p.pid, first_line(&p.cmdline)))
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            ));
        }
        let one = |v: Option<f64>| v.map(|v| vec![v]).unwrap_or_default();
        let figures = [
            ("churn_cycle_wall_ms", "ms", l.cycle_ms.clone()),
            ("churn_cycles_per_s", "1/s", one(l.cycles_per_s)),
            (
                "churn_memory_delta_mib",
                "MiB",
                one(l.memory.as_ref().map(|m| m.delta_mib)),
            ),
            (
                "churn_memory_per_cycle_kib",
                "KiB",
                one(l.memory.as_ref().map(|m| m.per_cycle_kib)),
            ),
        ];
        for (name, unit, samples) in figures {
            if let Some(f) = Figure::new(name, unit, label, samples) {
                report.figures.push(f);
            }
        }
        if let Some(m) = &l.memory {
            if m.leak {
                report.notes.push(format!(
                    "{label}: the host's used memory was {:.1} MiB higher after the {} cycles \
                     than before ({:+.0} KiB per cycle), above the {:.0} MiB threshold: flagged as \
                     a possible leak (anything else running on the host counts too; not a \
                     failure).",
                    m.delta_mib, l.completed, m.per_cycle_kib, m.threshold_mib
                ));
            }
        }
        if !l.leftover_processes.is_empty() {
            report.notes.push(format!(
                "{label}: {} process(es) of the loop's VMMs were still running {} s after it \
                 (killed after counting): {}",
                l.leftover_processes.len(),
                b.sampling.settle.as_secs_f64(),
                l.leftover_processes
                    .iter()
                    .map(|p| format!("pid {} ({}) {}", p.pid, p.state, p.cmdline))
                    .collect::<Vec<_>>()
                    .join("; ")
            ));
        }
        report.loops.push(l);
    }
    // Memory deltas are noise around zero: their ratio means nothing.
    report.ratios = ratios(&report.figures)
        .into_iter()
        .filter(|r| r.name == "churn_cycle_wall_ms" || r.name == "churn_cycles_per_s")
        .collect();
    if report.loops.iter().any(|l| l.vmm == QEMU) {
        report.notes.push(
            "ours/QEMU: of the per-cycle wall time, below 1 means ours is faster; of cycles/s, \
             above 1 means ours is faster."
                .into(),
        );
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::boot::TempDir;

    #[test]
    fn cycles_and_budget() {
        assert_eq!(cycles(false, None), 100);
        assert_eq!(cycles(true, None), 2);
        assert_eq!(cycles(true, Some(7)), 7);
        let s = Sampling::default();
        assert_eq!(
            time_budget(10, 2, Duration::from_secs(60), &s),
            (Duration::from_secs(60 * 20 + 3 + 6 + 10)) * 2 + Duration::from_secs(30)
        );
    }

    #[test]
    fn rates() {
        assert_eq!(rate(10, Duration::from_secs(4)), Some(2.5));
        assert_eq!(rate(0, Duration::from_secs(4)), None);
        assert_eq!(rate(3, Duration::ZERO), None);
    }

    #[test]
    fn leak_threshold_is_the_floor_or_five_percent() {
        // 1 GiB used: 5% is 51.2 MiB, above the 16 MiB floor.
        let gib = 1 << 20;
        let m = LeakCheck::new(
            vec![gib, gib + 10, gib - 10],
            vec![gib + (50 << 10); 3],
            100,
        );
        assert_eq!(m.before_kib, gib);
        assert!((m.threshold_mib - 51.2).abs() < 1e-9, "{m:?}");
        assert!((m.delta_mib - 50.0).abs() < 1e-9);
        assert!((m.per_cycle_kib - 512.0).abs() < 1e-9);
        assert!(!m.leak);
        let m = LeakCheck::new(vec![gib], vec![gib + (52 << 10)], 100);
        assert!(m.leak, "{m:?}");
        // 100 MiB used: the 16 MiB floor.
        let small = 100 << 10;
        let m = LeakCheck::new(vec![small], vec![small + (16 << 10)], 10);
        assert_eq!(m.threshold_mib, 16.0);
        assert!(!m.leak, "exactly the threshold is no leak");
        assert!(LeakCheck::new(vec![small], vec![small + (17 << 10)], 10).leak);
        // Less used after: negative, no leak.
        let m = LeakCheck::new(vec![small, small, small], vec![small - 2048], 4);
        assert_eq!(
            (m.delta_mib, m.per_cycle_kib, m.leak),
            (-2.0, -512.0, false)
        );
        // Medians of the samples, not means.
        let m = LeakCheck::new(vec![1, 1000, 3], vec![5, 7, 6000], 0);
        assert_eq!((m.before_kib, m.after_kib, m.per_cycle_kib), (3, 7, 0.0));
    }

    #[test]
    fn stat_and_leftovers() {
        assert_eq!(
            parse_stat("4242 (vmctl) S 1 4242 4242 0 -1 4194560 ..."),
            Some(("S".into(), 4242))
        );
        // comm with spaces and parentheses.
        assert_eq!(
            parse_stat("17 (a (b) c) Z 3 15 15 0"),
            Some(("Z".into(), 15))
        );
        assert_eq!(parse_stat("17 (x) S 1"), None);
        assert_eq!(parse_stat("garbage"), None);
        let p = |pid, pgid, cmdline: &str| Process {
            pid,
            state: "S".into(),
            pgid,
            cmdline: cmdline.into(),
        };
        let before = vec![p(1, 1, "init"), p(50, 50, "vmctl boot --initrd /t/i.img")];
        let after = vec![
            p(1, 1, "init"),
            p(50, 50, "vmctl boot --initrd /t/i.img"),
            p(60, 60, "vmctl boot --initrd /t/i.img"),
            p(61, 70, "helper"),
            p(62, 62, "unrelated"),
        ];
        let groups: HashSet<u32> = [70].into();
        let left: Vec<u32> = leftovers(&before, &after, &groups, "/t/i.img")
            .iter()
            .map(|p| p.pid)
            .collect();
        assert_eq!(left, [60, 61]);
        assert!(leftovers(&before, &after, &HashSet::new(), "").is_empty());
        // This machine's /proc parses, without this process.
        let all = processes(Path::new("/proc"));
        assert!(all.iter().any(|p| p.pid == 1), "{all:?}");
        assert!(all.iter().all(|p| p.pid != std::process::id()));
    }

    /// A fake VMM: prints the marker and exits; its calls eat 1 MiB of the fake host's
    /// memory each (`leak` in `dir`: 4 MiB); with `dir/fail` it fails, and with
    /// `dir/linger` it leaves a process behind in its group.
    fn fake_bench(dir: &Path, cycles: usize) -> ChurnBench {
        let meminfo = dir.join("meminfo");
        fs::write(
            &meminfo,
            "MemTotal: 1048576 kB\nMemFree: 100 kB\nMemAvailable: 943718 kB\n",
        )
        .unwrap();
        let script = dir.join("vmm");
        fs::write(
            &script,
            format!(
                r#"#!/bin/bash
set -e
echo "$*" >> {dir}/calls.log
per=1024; [ -e {dir}/leak ] && per=4096
a=$(awk '/MemAvailable/ {{print $2}}' {meminfo})
sed -i "s/^MemAvailable: .*/MemAvailable: $((a - per)) kB/" {meminfo}
[ -e {dir}/fail ] && {{ echo 'no kvm' >&2; exit 1; }}
[ -e {dir}/linger ] && {{ sleep 30 </dev/null >/dev/null 2>&1 & }}
echo booting; echo BENCH-INIT-REACHED; sleep 0.01
"#,
                dir = dir.display(),
                meminfo = meminfo.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        let argv = |who: &str| -> Vec<OsString> {
            vec![
                script.clone().into(),
                who.into(),
                "--initrd".into(),
                dir.join("churn.img").into(),
            ]
        };
        ChurnBench {
            vmms: vec![(OURS.into(), argv("ours")), (QEMU.into(), argv("qemu"))],
            marker: "BENCH-INIT-REACHED".into(),
            cycles,
            timeout: Duration::from_secs(20),
            nested: true,
            meminfo,
            proc: "/proc".into(),
            sampling: Sampling {
                samples: 3,
                interval: Duration::from_millis(10),
                settle: Duration::from_millis(200),
            },
            needle: dir.join("churn.img").display().to_string(),
        }
    }

    #[test]
    fn measures_both_loops_and_checks_memory() {
        let dir = std::env::temp_dir().join(format!("vm-bench-churn-{}", std::process::id()));
        let _tmp = TempDir(dir.clone());
        fs::create_dir_all(&dir).unwrap();
        let b = fake_bench(&dir, 5);
        let r = measure(&b);
        assert!(r.errors().is_empty(), "{:?}", r.errors());
        let names: Vec<(&str, &str)> = r
            .figures
            .iter()
            .map(|f| (f.name.as_str(), f.vmm.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                ("churn_cycle_wall_ms", OURS),
                ("churn_cycles_per_s", OURS),
                ("churn_memory_delta_mib", OURS),
                ("churn_memory_per_cycle_kib", OURS),
                ("churn_cycle_wall_ms", QEMU),
                ("churn_cycles_per_s", QEMU),
                ("churn_memory_delta_mib", QEMU),
                ("churn_memory_per_cycle_kib", QEMU),
            ]
        );
        assert_eq!(r.figures[0].samples.len(), 5);
        let ratio_names: Vec<&str> = r.ratios.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(ratio_names, ["churn_cycle_wall_ms", "churn_cycles_per_s"]);
        for l in &r.loops {
            assert_eq!((l.attempted, l.completed, l.failures), (5, 5, 0), "{l:?}");
            let sum: f64 = l.cycle_ms.iter().sum();
            assert!(sum <= l.total_s * 1000.0 + 1.0, "{l:?}");
            let rate = l.cycles_per_s.unwrap();
            assert!((rate - 5.0 / l.total_s).abs() < 1e-9);
            let m = l.memory.as_ref().unwrap();
            // 5 cycles of 1 MiB each: 5 MiB, below the 16 MiB floor.
            assert!((m.delta_mib - 5.0).abs() < 1e-9, "{m:?}");
            assert!((m.per_cycle_kib - 1024.0).abs() < 1e-9);
            assert!(!m.leak);
            assert!(l.leftover_processes.is_empty(), "{l:?}");
            assert!(l.harness_fds.is_some() && l.unix_sockets.is_some());
        }
        let calls = fs::read_to_string(dir.join("calls.log")).unwrap();
        let calls: Vec<&str> = calls.lines().collect();
        assert_eq!(calls.len(), 10);
        assert!(
            calls[..5].iter().all(|c| c.starts_with("ours ")),
            "{calls:?}"
        );
        assert!(
            calls[5..].iter().all(|c| c.starts_with("qemu ")),
            "{calls:?}"
        );
        let md = r.markdown();
        assert!(md.contains("| churn_cycle_wall_ms | ms | vmctl |"), "{md}");
        assert!(md.contains("| vmctl | 5/5 | 0 |"), "{md}");
        assert!(md.contains("| +5.0 | +1024 | no (> 16 MiB) | 0 |"), "{md}");
        assert!(md.contains("Nested: measured inside"), "{md}");
        assert!(md.contains("above 1 means ours is faster"), "{md}");
        let json = serde_json::to_string(&r).unwrap();
        assert!(
            json.contains(r#""samples":3,"interval":0.01,"settle":0.2"#),
            "{json}"
        );
        let back: ChurnReport = serde_json::from_str(&json).unwrap();
        assert_eq!(back.config.sampling, b.sampling);
        assert_eq!(back.loops[1].cycle_ms.len(), 5);

        // 4 MiB per cycle over 5 cycles: 20 MiB, a leak; and a lingering process.
        fs::write(dir.join("leak"), "").unwrap();
        fs::write(dir.join("linger"), "").unwrap();
        let r = measure(&ChurnBench {
            vmms: b.vmms[..1].to_vec(),
            ..b.clone()
        });
        let errors = r.errors();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0]
                .1
                .starts_with("5 process(es) of its VMMs still ran"),
            "{errors:?}"
        );
        let l = &r.loops[0];
        assert!(l.memory.as_ref().unwrap().leak, "{l:?}");
        assert_eq!(l.leftover_processes.len(), 5, "{l:?}");
        assert!(l
            .leftover_processes
            .iter()
            .all(|p| p.cmdline.contains("sleep 30")));
        assert!(r.ratios.is_empty());
        let md = r.markdown();
        assert!(md.contains("| **yes** (> 16 MiB) | 5 |"), "{md}");
        assert!(md.contains("flagged as a possible leak"), "{md}");
        assert!(md.contains("5 process(es) of the loop's VMMs"), "{md}");
        // They were killed.
        thread::sleep(Duration::from_millis(200));
        let alive = processes(Path::new("/proc"));
        for p in &l.leftover_processes {
            assert!(
                alive
                    .iter()
                    .all(|a| a.pid != p.pid || a.state == "Z" || a.cmdline != p.cmdline),
                "{p:?} still runs"
            );
        }
        fs::remove_file(dir.join("linger")).unwrap();

        // Failing cycles: the loop stops after MAX_FAILURES, and it is an error.
        fs::write(dir.join("fail"), "").unwrap();
        let r = measure(&b);
        let errors = r.errors();
        let what: Vec<&str> = errors.iter().map(|(w, _)| w.as_str()).collect();
        assert_eq!(what, ["churn vmctl", "churn qemu-microvm"], "{errors:?}");
        assert!(
            errors[0]
                .1
                .starts_with("3 of 3 cycle(s) failed (stopped after 3 failures); first: cycle 1:"),
            "{}",
            errors[0].1
        );
        assert!(errors[0].1.contains("no kvm"), "{}", errors[0].1);
        assert_eq!(r.loops[0].errors.len(), 3);
        assert!(r.figures.iter().all(|f| f.name != "churn_cycle_wall_ms"));
        let md = r.markdown();
        assert!(
            md.contains("**vmctl error:** 3 of 3 cycle(s) failed"),
            "{md}"
        );
        assert!(md.contains("| vmctl | 0/5 | 3 | – |"), "{md}");
    }
}
