//! The later boot end points, per guest configuration: a cold `vmctl exec -- echo`
//! on a fresh workspace, timed from the spawn of `vmctl` to the guest agent's first
//! answer (`cold_agent_ready`) and to the command's first byte on stdout
//! (`cold_first_exec_output`). With the VM up, virtiofsd's memory: the RSS of every
//! virtiofsd the VM's supervisor runs (`virtiofsd_rss`).
//!
//! Each configuration gets its own state directory and a config file that sizes the
//! VM (`cpus`, `memory_min_mib` with `memory_percent = 0`). QEMU has no counterpart:
//! no ratio.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::agent::kib_field;
use crate::boot::{say, TempDir};
use crate::process::run_command;
use crate::report::{BootConfig, Figure};
use crate::scan::tail;
use crate::workspace::{figure, write_vmctl_config, GuestArtifacts, Vmctl};

/// What vmctl logs (at info, target `vmctl::vm`) when a VM's agent first answers;
/// the same text as vmctl's `AGENT_READY_LOG`.
pub const AGENT_READY_LOG: &str = "guest agent ready";
/// The log filter that makes vmctl print that line and nothing else new.
const LOG_FILTER: &str = "warn,vmctl::vm=info";
/// What the first exec prints.
const EXEC_MARKER: &str = "BENCH-FIRST-EXEC";
/// Targets on hardware KVM (the project's goals), printed beside the figures.
pub const AGENT_READY_TARGET_MS: f64 = 250.0;

/// What to measure and with what.
#[derive(Debug, Clone)]
pub struct ColdStartBench {
    /// vmctl and the guest it boots.
    pub artifacts: GuestArtifacts,
    pub configs: Vec<BootConfig>,
    /// Cold starts per configuration.
    pub runs: usize,
    /// Per `vmctl` command.
    pub timeout: Duration,
}

/// One cold start.
#[derive(Debug, Clone, PartialEq)]
pub struct ColdRun {
    pub agent_ready_ms: f64,
    pub first_output_ms: f64,
    pub exit_ms: f64,
    pub virtiofsd_rss_kib: u64,
    pub virtiofsd_processes: usize,
}

/// The figures, in configuration order (the first configuration's with plain names).
pub fn measure(b: &ColdStartBench) -> Result<Vec<Figure>, String> {
    if b.runs == 0 || b.configs.is_empty() {
        return Err("cold start: at least one run and one configuration".into());
    }
    let tmp = TempDir::unique("-cold");
    say(format!(
        "cold start: {} cold vmctl exec per configuration ({})",
        b.runs,
        BootConfig::labels(&b.configs)
    ));
    let mut figures = Vec::new();
    let mut virtiofsd = Vec::new();
    for (k, &config) in b.configs.iter().enumerate() {
        let runs = measure_config(b, &tmp.0, k, config)?;
        let name = |base: &str| config.figure_name(base, k == 0);
        let samples = |f: fn(&ColdRun) -> f64| runs.iter().map(f).collect::<Vec<_>>();
        figures.push(
            figure(
                &name("cold_agent_ready"),
                "ms",
                samples(|r| r.agent_ready_ms),
            )?
            .with_hardware_target(AGENT_READY_TARGET_MS),
        );
        figures.push(figure(
            &name("cold_first_exec_output"),
            "ms",
            samples(|r| r.first_output_ms),
        )?);
        virtiofsd.extend(runs.iter().map(|r| r.virtiofsd_rss_kib as f64 / 1024.0));
    }
    figures.push(figure("virtiofsd_rss", "MiB", virtiofsd)?);
    Ok(figures)
}

fn measure_config(
    b: &ColdStartBench,
    tmp: &Path,
    index: usize,
    config: BootConfig,
) -> Result<Vec<ColdRun>, String> {
    let dir = tmp.join(format!("config-{index}"));
    let state = dir.join("state");
    fs::create_dir_all(&state).map_err(|e| format!("create {}: {e}", state.display()))?;
    let config_file = write_vmctl_config(&dir, config)?;
    let mut vmctl = Vmctl::new(&b.artifacts, state, Some(&config_file), b.timeout);
    let mut runs = Vec::new();
    for i in 0..b.runs {
        let ws = dir.join(format!("ws-{}", i + 1));
        fs::create_dir_all(&ws).map_err(|e| format!("create {}: {e}", ws.display()))?;
        let run = cold_exec(&mut vmctl, &ws)?;
        say(format!(
            "[cold {}/{}, {}] agent ready {:.0} ms, first exec output {:.0} ms, exit {:.0} ms; \
             virtiofsd RSS {:.2} MiB ({} process(es))",
            i + 1,
            b.runs,
            config.label(),
            run.agent_ready_ms,
            run.first_output_ms,
            run.exit_ms,
            run.virtiofsd_rss_kib as f64 / 1024.0,
            run.virtiofsd_processes
        ));
        vmctl.rm(&ws)?;
        runs.push(run);
    }
    Ok(runs)
}

/// `vmctl exec --workspace WS -- echo MARKER` on a workspace with no VM yet, checked
/// and timed; then virtiofsd's memory while the VM is up.
fn cold_exec(vmctl: &mut Vmctl, ws: &Path) -> Result<ColdRun, String> {
    let argv = vmctl.exec_argv(ws, None, &["echo", EXEC_MARKER]);
    let line = argv.join(" ");
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .envs(vmctl.env.iter().map(|(k, v)| (k, v)))
        .env("VMCTL_LOG", LOG_FILTER)
        .env("NO_COLOR", "1");
    vmctl.live.push(ws.to_path_buf());
    let ran = run_command(cmd, &line, vmctl.timeout, false)
        .map_err(|e| format!("{e}{}", vmctl.logs()))?;
    let fail = |why: &str| {
        format!(
            "{line}: {why} ({})\n--- stdout (tail) ---\n{}\n--- stderr (tail) ---\n{}{}",
            ran.status,
            tail(&ran.stdout, 1500),
            tail(&ran.stderr, 3000),
            vmctl.logs()
        )
    };
    if !ran.status.success() || !ran.stdout.contains(EXEC_MARKER) {
        return Err(fail("failed, or printed no marker"));
    }
    let ready = ran
        .stderr_line_at(AGENT_READY_LOG)
        .ok_or_else(|| fail(&format!("no {AGENT_READY_LOG:?} line on stderr")))?;
    let first = ran
        .first_stdout
        .ok_or_else(|| fail("no output on stdout"))?;
    let (vm_dir, _) = vmctl.vm_dir(ws)?;
    let supervisor = fs::read_to_string(vm_dir.join("supervisor.pid"))
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
        .ok_or_else(|| format!("no supervisor pid in {}", vm_dir.display()))?;
    let daemons = descendants_named(Path::new("/proc"), supervisor, "virtiofsd");
    if daemons.is_empty() {
        return Err(format!(
            "the VM of {} runs no virtiofsd under its supervisor (pid {supervisor})",
            ws.display()
        ));
    }
    let rss: u64 = daemons
        .iter()
        .filter_map(|pid| rss_kib(Path::new("/proc"), *pid))
        .sum();
    Ok(ColdRun {
        agent_ready_ms: ready.as_secs_f64() * 1000.0,
        first_output_ms: first.as_secs_f64() * 1000.0,
        exit_ms: ran.elapsed.as_secs_f64() * 1000.0,
        virtiofsd_rss_kib: rss,
        virtiofsd_processes: daemons.len(),
    })
}

/// The pid and parent pid of every process under `proc`, with its name.
fn processes(proc: &Path) -> Vec<(u32, u32, String)> {
    let Ok(entries) = fs::read_dir(proc) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = fs::read_to_string(e.path().join("stat")).ok()?;
            // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            let open = stat.find('(')?;
            let close = stat.rfind(')')?;
            let name = stat.get(open + 1..close)?.to_string();
            let ppid = stat.get(close + 2..)?.split(' ').nth(1)?.parse().ok()?;
            Some((pid, ppid, name))
        })
        .collect()
}

/// Every process below `root` (children, their children, ...) called `name`.
pub fn descendants_named(proc: &Path, root: u32, name: &str) -> Vec<u32> {
    let all = processes(proc);
    let mut below = vec![root];
    let mut i = 0;
    while i < below.len() {
        let parent = below[i];
        below.extend(
            all.iter()
                .filter(|(_, ppid, _)| *ppid == parent)
                .map(|(pid, _, _)| *pid),
        );
        i += 1;
    }
    all.iter()
        .filter(|(pid, _, n)| *pid != root && n == name && below.contains(pid))
        .map(|(pid, _, _)| *pid)
        .collect()
}

/// `VmRSS` of `pid`, in KiB.
fn rss_kib(proc: &Path, pid: u32) -> Option<u64> {
    let status = fs::read_to_string(proc.join(pid.to_string()).join("status")).ok()?;
    kib_field(&status, "VmRSS").ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_proc(dir: &Path, pid: u32, ppid: u32, name: &str, rss: u64) {
        let p = dir.join(pid.to_string());
        fs::create_dir_all(&p).unwrap();
        fs::write(
            p.join("stat"),
            format!("{pid} ({name}) S {ppid} {pid} {pid} 0 -1 4194560"),
        )
        .unwrap();
        fs::write(
            p.join("status"),
            format!("Name:\t{name}\nVmRSS:\t    {rss} kB\nThreads:\t3\n"),
        )
        .unwrap();
    }

    #[test]
    fn finds_virtiofsd_below_the_supervisor_only() {
        let tmp = TempDir::unique("-cold-test");
        let proc = tmp.0.join("proc");
        fake_proc(&proc, 100, 1, "vmctl", 5000);
        fake_proc(&proc, 101, 100, "virtiofsd", 3000);
        fake_proc(&proc, 102, 101, "virtiofsd", 2000); // its sandboxed child
        fake_proc(&proc, 103, 100, "vmctl (vmm) x", 9000);
        fake_proc(&proc, 200, 1, "virtiofsd", 7000); // another VM's
        let mut found = descendants_named(&proc, 100, "virtiofsd");
        found.sort();
        assert_eq!(found, vec![101, 102]);
        let rss: u64 = found.iter().filter_map(|p| rss_kib(&proc, *p)).sum();
        assert_eq!(rss, 5000);
        assert!(descendants_named(&proc, 999, "virtiofsd").is_empty());
        assert_eq!(rss_kib(&proc, 103), Some(9000));
        assert_eq!(rss_kib(&proc, 555), None);
    }
}
