//! The benchmark run inside the QEMU-TCG nested host (where this machine's KVM
//! cannot boot Linux), and started again in a fresh one when the nested host is lost.

use std::fs;
use std::io::{self, BufRead, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::report::Report;
use crate::sections::Section;

use super::args::Args;
use super::nested_retry;
use super::tools::Tools;
use super::{command_argv, say, shell_words, TempDir};

/// The guests' vCPUs (two at most) run on all the nested host's CPUs but 0.
const NESTED_HOST_CPUS: &str = "3";
const NESTED_HOST_MEMORY_MIB: &str = "4096";
const INNER_FILE: &str = "boot.inner.json";

/// Measures inside the nested host; where the nested host itself is lost (the
/// emulation's known problem), the sections not measured yet run again in a fresh
/// one ([`nested_retry`]).
pub(super) fn measure_nested(args: &Args, tools: &Tools) -> Result<Report, String> {
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
pub(super) struct NestedRun {
    /// What it measured: all `sections` unless it failed, then those it finished.
    pub(super) report: Option<Report>,
    /// Why it did not finish.
    pub(super) failure: Option<String>,
    /// It lost the nested host itself (a stall, a reset, its kernel's crash), not a
    /// guest in it: worth running again.
    pub(super) nested_host_lost: bool,
}

pub(super) fn run_nested(
    args: &Args,
    tools: &Tools,
    sections: &[Section],
) -> Result<NestedRun, String> {
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
    // Killed on its own (pkill vm-bench), this process would leave the nested host
    // running to its end; vmctl stops it on SIGTERM. This thread, the main one, lives
    // as long as the process.
    vmm::process::child::stop_with_parent(&mut cmd);
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
    let fs_sizes = crate::fs::sizes(
        args.quick,
        true,
        args.fs_mib,
        args.fs_files,
        args.fs_runs,
        args.fs_edit_rounds,
    );
    let fs_runs = fs_sizes.runs;
    let fs_vmm_boots = if args.quick { 0 } else { fs_runs * 2 };
    let fs_edits = crate::fs_edits::time_budget(
        fs_sizes.edit_rounds,
        crate::fs::edit_timeouts(args.fs_timeout),
    );
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
    // The workspace's memory measure: per VM its vmctl commands, each with its own
    // timeout, and the window after the free.
    let memory_return =
        crate::workspace::MemoryReturnSizes::for_run(args.quick, args.free_page_rounds)
            .time_budget(args.timeout);
    let limit = Duration::from_secs(180)
        + args.timeout * (2 * boots + workspace_steps + 2 + 4)
        + memory_return
        + args.fs_timeout * fs_scripts
        + fs_virtiofsd_waits
        + fs_edits
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
pub(super) fn nested_command(
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
    .arg("--agent-initrd")
    .arg(&tools.agent_initrd)
    .arg("--rootfs")
    .arg(&tools.rootfs);
    if let Some(qemu) = &tools.qemu {
        cmd.arg("--qemu").arg(qemu);
    }
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
        ("--fs-edit-rounds", args.fs_edit_rounds.map(|r| r as u64)),
        (
            "--free-page-rounds",
            args.free_page_rounds.map(|r| r as u64),
        ),
    ] {
        if let Some(v) = v {
            cmd.args([flag, &n(v)]);
        }
    }
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::boot::args::parse_args;

    #[test]
    fn the_nested_host_may_write_only_to_its_exchange_directory() {
        let tools = Tools::fake();
        // --out in /tmp itself: its directory must not become the share.
        let a = parse_args(["--out", "/tmp/x.json", "--fs-mib", "4"].map(String::from)).unwrap();
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
            line.starts_with("/v nested-exec --cpus 3 --memory 4096 --writable /tmp/vm-bench-nested-1 -- /b/vm-bench --inner /tmp/vm-bench-nested-1/boot.inner.json "),
            "{line}"
        );
        // Only the sections asked for, and the sizes given.
        assert!(line.contains(" --only fs,agent"), "{line}");
        assert!(line.contains(" --fs-mib 4"), "{line}");
        assert!(!line.contains("--fs-files"), "{line}");
        assert!(!line.contains("--free-page-rounds"), "{line}");
        assert!(!line.contains("/tmp/x.json"), "{line}");
        let a = parse_args(["--quick", "--free-page-rounds", "1"].map(String::from)).unwrap();
        let cmd = nested_command(
            &a,
            &tools,
            &[Section::Workspace],
            Path::new("/b/vm-bench"),
            Path::new("/tmp/vm-bench-nested-1"),
        );
        let line = shell_words(&command_argv(&cmd));
        assert!(line.contains(" --quick "), "{line}");
        assert!(line.contains(" --free-page-rounds 1"), "{line}");
    }
}
