//! What a VM test prints when a command it ran in the guest times out, before the
//! command is killed: the guest console's last lines (the agent's log of the commands
//! it started and those that ended, the kernel's warnings), where the guest's
//! processes wait (their kernel stacks, read by a second exec as root whose working
//! directory is on no share, so a stuck share does not stop it), and then whether the
//! hung command finished once that second exec's traffic had gone through. Finishing
//! then points at a lost wake-up on the way (a notification or interrupt that went
//! missing, which any later one makes up for); not finishing, at a request nobody
//! answered or a guest stuck as a whole. The nested host's hangs (README, "Known
//! problem") are otherwise known only by their timeout.

use std::io::Write;
use std::path::Path;
use std::process::{Child, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::Workspace;

/// How long the diagnosing exec may take.
const DIAGNOSIS_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the hung command gets to finish after the diagnosis.
const GRACE_AFTER_DIAGNOSIS: Duration = Duration::from_secs(30);
/// Lines of the guest console shown.
const CONSOLE_LINES: usize = 15;
/// How long the VM's host processes' CPU use is measured.
const CPU_SAMPLE: Duration = Duration::from_secs(2);
/// Clock ticks per second of /proc's CPU times (USER_HZ: 100 on x86).
const TICKS_PER_SECOND: f64 = 100.0;

/// Run in the guest as root: the uptime (whether the guest's clock moves), then every
/// process with a command line, and kernel threads in uninterruptible sleep, with the
/// kernel stack each waits in.
const GUEST_SCRIPT: &str = r#"echo "guest uptime: $(cut -d' ' -f1 /proc/uptime) s"
for d in /proc/[0-9]*; do
  pid=${d#/proc/}
  [ "$pid" = "$$" ] && continue
  comm=$(cat $d/comm 2>/dev/null) || continue
  state=$(sed -n 's/^State:[[:space:]]*//p' $d/status 2>/dev/null)
  args=$(tr '\0' ' ' < $d/cmdline 2>/dev/null | cut -c1-120)
  if [ -n "$args" ] || [ "${state%% *}" = D ]; then
    echo "-- $pid $comm [$state] $args"
    head -n 12 $d/stack 2>/dev/null | sed 's/^\[<0>\] /   /'
  fi
done"#;

/// Guest subcommands of vmctl: a timeout of one of them leaves a running VM to ask.
const GUEST_COMMANDS: [&str; 2] = ["exec", "agent"];

/// The report on `hung`, the `vmctl ARGS` child that outlived its timeout (None when
/// ARGS ran nothing in the guest). `hung` gets `grace` to finish after the diagnosis,
/// and may have finished when this returns.
pub fn diagnose(
    workspace: &Workspace,
    args: &[&str],
    hung: &mut Child,
    grace: Duration,
) -> Option<String> {
    diagnose_with_verdict(workspace, args, hung, grace).map(|(report, _)| report)
}

/// What the diagnosis made of the hung command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Nothing could be asked (the VM was not running).
    NotAsked,
    /// It ended once the diagnosis's traffic went through: a lost wake-up of ours,
    /// unless it was merely about to finish.
    EndedAfterDiagnosis,
    /// It still ran: a request nobody answered, or a guest stuck as a whole.
    StillRunning,
}

fn diagnose_with_verdict(
    workspace: &Workspace,
    args: &[&str],
    hung: &mut Child,
    grace: Duration,
) -> Option<(String, Verdict)> {
    if !runs_in_the_guest(args) {
        return None;
    }
    let mut report = format!("\nHANG REPORT for vmctl {args:?}\n");
    if !vm_is_up(workspace) {
        report.push_str("the workspace's VM is not running: nothing to ask\n");
        return Some((report, Verdict::NotAsked));
    }
    report.push_str(&console_tail(&workspace.state()));
    if let Some(vm_dir) = crate::find_vm_dir(&workspace.state()) {
        report.push_str(&host_side(&vm_dir, CPU_SAMPLE));
    }
    let asked = Instant::now();
    report.push_str(&ask_the_guest(workspace));
    let verdict = match wait_bounded(hung, grace) {
        Some(status) => {
            report.push_str(&format!(
                "verdict: the hung command ended ({status}) {:.1} s after the diagnosis \
                 began: a wake-up lost on the way that the diagnosis's traffic made up for \
                 (unless the command was merely about to finish)\n",
                asked.elapsed().as_secs_f64()
            ));
            Verdict::EndedAfterDiagnosis
        }
        None => {
            report.push_str(&format!(
                "verdict: the hung command was still running {} s after the diagnosis: \
                 see where its processes wait above\n",
                grace.as_secs()
            ));
            Verdict::StillRunning
        }
    };
    Some((report, verdict))
}

/// [`diagnose`], written to the test process's stderr (uncaptured, like a retry, so
/// that CI's log keeps it); returns the verdict, if there was a diagnosis.
pub(crate) fn report(workspace: &Workspace, args: &[&str], hung: &mut Child) -> Option<Verdict> {
    let (report, verdict) = diagnose_with_verdict(workspace, args, hung, GRACE_AFTER_DIAGNOSIS)?;
    let _ = std::io::stderr().write_all(report.as_bytes());
    Some(verdict)
}

fn runs_in_the_guest(args: &[&str]) -> bool {
    args.first()
        .is_some_and(|first| GUEST_COMMANDS.contains(first))
}

fn vm_is_up(workspace: &Workspace) -> bool {
    let Ok(ps) = workspace.command(&["ps", "--json"]).output() else {
        return false;
    };
    crate::ps::parse(&String::from_utf8_lossy(&ps.stdout))
        .and_then(|rows| crate::ps::row_of(&rows, &workspace.path()).map(|row| row.is_up()))
        .unwrap_or(false)
}

/// The guest's answer to [`GUEST_SCRIPT`], or why there is none.
fn ask_the_guest(workspace: &Workspace) -> String {
    let workspace_path = workspace.path();
    let workspace_arg = workspace_path.to_string_lossy();
    let spawned = workspace
        .command(&[
            "exec",
            "--workspace",
            &workspace_arg,
            "--user",
            "root",
            "--",
            "sh",
            "-c",
            GUEST_SCRIPT,
        ])
        .current_dir("/")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut diagnosis = match spawned {
        Ok(child) => child,
        Err(e) => return format!("cannot run the diagnosing exec: {e}\n"),
    };
    let pipes = crate::Pipes::read(&mut diagnosis);
    let started = Instant::now();
    let status = wait_bounded(&mut diagnosis, DIAGNOSIS_TIMEOUT);
    if status.is_none() {
        let _ = diagnosis.kill();
        let _ = diagnosis.wait();
    }
    pipes.ended_within_grace();
    match status {
        Some(status) => format!(
            "the guest's processes, as a second exec saw them ({status}, {:.1} s):\n{}{}",
            started.elapsed().as_secs_f64(),
            pipes.out.text(),
            pipes.err.text(),
        ),
        None => format!(
            "a second exec (working directory on no share) got no answer within {} s \
             either: the guest, or its vsock path, is stuck as a whole\n",
            DIAGNOSIS_TIMEOUT.as_secs()
        ),
    }
}

/// The VM's processes on this host (its supervisor and everything under it: the VMM
/// or the nested host, virtiofsd), with each thread's CPU use over `sample`: for a
/// guest stuck as a whole, idle vCPU threads mean it waits for an event that never
/// came (a lost interrupt), busy ones that it spins.
fn host_side(vm_dir: &Path, sample: Duration) -> String {
    let Some(supervisor) = std::fs::read_to_string(vm_dir.join("supervisor.pid"))
        .ok()
        .and_then(|pid| pid.trim().parse::<u32>().ok())
    else {
        return "no supervisor pid, so no host processes to show\n".into();
    };
    let tree = process_tree(supervisor);
    let before = thread_ticks(&tree);
    thread::sleep(sample);
    let after = thread_ticks(&tree);
    let mut text = format!(
        "the VM's host processes, CPU use over {:.0} s:\n",
        sample.as_secs_f64()
    );
    for &pid in &tree {
        let threads: Vec<&Thread> = after.iter().filter(|t| t.pid == pid).collect();
        let Some(main) = threads.iter().find(|t| t.tid == pid) else {
            continue;
        };
        let percent = |thread: &Thread| {
            let earlier = before
                .iter()
                .find(|b| b.tid == thread.tid)
                .map_or(thread.ticks, |b| b.ticks);
            thread.ticks.saturating_sub(earlier) as f64 / TICKS_PER_SECOND / sample.as_secs_f64()
                * 100.0
        };
        let total: f64 = threads.iter().map(|t| percent(t)).sum();
        text.push_str(&format!(
            "  {pid} {} [{}] {total:.0}%",
            main.comm, main.state
        ));
        let busy: Vec<String> = threads
            .iter()
            .filter(|t| threads.len() > 1 && percent(t) >= 1.0)
            .map(|t| format!("{} {:.0}%", t.comm, percent(t)))
            .collect();
        if !busy.is_empty() {
            text.push_str(&format!(" (busy threads: {})", busy.join(", ")));
        }
        text.push('\n');
    }
    text
}

/// `root` and every process under it.
fn process_tree(root: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, stat_fields(&format!("/proc/{pid}/stat"))?.1)))
        .map(|(pid, fields)| (pid, fields.get(1).and_then(|p| p.parse().ok()).unwrap_or(0)))
        .collect();
    let mut tree = vec![root];
    let mut next = 0;
    while next < tree.len() {
        let parent = tree[next];
        tree.extend(
            parents
                .iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c),
        );
        next += 1;
    }
    tree
}

/// One thread of a process, as /proc/PID/task/TID/stat shows it.
struct Thread {
    pid: u32,
    tid: u32,
    comm: String,
    state: String,
    /// User and system CPU time, in clock ticks.
    ticks: u64,
}

fn thread_ticks(pids: &[u32]) -> Vec<Thread> {
    let mut threads = Vec::new();
    for &pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
                continue;
            };
            let Some((comm, fields)) = stat_fields(&format!("/proc/{pid}/task/{tid}/stat")) else {
                continue;
            };
            let tick = |i: usize| {
                fields
                    .get(i)
                    .and_then(|f| f.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            threads.push(Thread {
                pid,
                tid,
                comm,
                state: fields.first().cloned().unwrap_or_default(),
                ticks: tick(11) + tick(12),
            });
        }
    }
    threads
}

/// A /proc stat file's command name and the fields after it (state first; utime and
/// stime at 11 and 12).
fn stat_fields(path: &str) -> Option<(String, Vec<String>)> {
    let text = std::fs::read_to_string(path).ok()?;
    let (open, close) = (text.find('(')?, text.rfind(')')?);
    let comm = text.get(open + 1..close)?.to_string();
    let fields = text
        .get(close + 1..)?
        .split_whitespace()
        .map(String::from)
        .collect();
    Some((comm, fields))
}

/// The last lines of the console of the VM whose vmctl state is under `state`.
fn console_tail(state: &Path) -> String {
    match crate::find_vm_dir(state) {
        Some(vm_dir) => last_console_lines(&vm_dir.join("console.log"), CONSOLE_LINES),
        None => "no VM directory, so no guest console\n".into(),
    }
}

/// The last `count` lines of a VM's `console`, under a line that names it: the guest
/// agent's log (which commands it started, which ended) and the kernel's warnings
/// (RCU stall reports land there).
pub fn last_console_lines(console: &Path, count: usize) -> String {
    let bytes = match std::fs::read(console) {
        Ok(bytes) => bytes,
        Err(e) => return format!("cannot read {}: {e}\n", console.display()),
    };
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(count)..];
    format!(
        "the guest console's last lines ({}):\n{}\n",
        console.display(),
        tail.join("\n")
    )
}

/// Waits up to `timeout` for `child`; None if it is still running then.
pub fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() > deadline {
            return None;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_console_tail_keeps_the_last_lines() {
        let state = std::env::temp_dir().join(format!("hang-report-{}", std::process::id()));
        let vm_dir = state.join("vmctl/vms/ws-1");
        std::fs::create_dir_all(&vm_dir).unwrap();
        let console: String = (0..40).map(|i| format!("line {i}\n")).collect();
        std::fs::write(vm_dir.join("console.log"), console).unwrap();

        let tail = console_tail(&state);
        let _ = std::fs::remove_dir_all(&state);
        let shown: Vec<&str> = tail.lines().skip(1).collect();
        assert_eq!(shown.len(), CONSOLE_LINES, "{tail}");
        assert_eq!(shown[0], "line 25");
        assert_eq!(shown[CONSOLE_LINES - 1], "line 39");
    }

    #[test]
    fn the_host_side_shows_which_threads_are_busy() {
        let vm_dir = std::env::temp_dir().join(format!("hang-report-host-{}", std::process::id()));
        std::fs::create_dir_all(&vm_dir).unwrap();
        // A "supervisor" with a busy child and an idle one.
        let mut supervisor = std::process::Command::new("sh")
            .args(["-c", "sh -c 'while :; do :; done' & sleep 30 & wait"])
            .spawn()
            .unwrap();
        std::fs::write(
            vm_dir.join("supervisor.pid"),
            format!("{}\n", supervisor.id()),
        )
        .unwrap();
        thread::sleep(Duration::from_millis(300));
        let shown = host_side(&vm_dir, Duration::from_secs(1));
        let _ = std::process::Command::new("pkill")
            .args(["-P", &supervisor.id().to_string()])
            .status();
        let _ = supervisor.kill();
        let _ = supervisor.wait();
        let _ = std::fs::remove_dir_all(&vm_dir);

        let line_of = |comm: &str| {
            shown
                .lines()
                .find(|line| line.contains(&format!(" {comm} [")))
                .unwrap_or_else(|| panic!("no {comm} in:\n{shown}"))
                .to_string()
        };
        let percent = |line: &str| -> f64 {
            let end = line.rfind('%').unwrap();
            let start = line[..end].rfind(' ').unwrap() + 1;
            line[start..end].parse().unwrap()
        };
        let sleeper = line_of("sleep");
        assert!(
            sleeper.contains("[S]") && percent(&sleeper) < 20.0,
            "{shown}"
        );
        let busy = shown
            .lines()
            .filter(|line| line.contains(" sh [R]"))
            .map(percent)
            .fold(0.0, f64::max);
        // Not near 100 %: on two CPUs shared with the nested host's TCG threads a
        // runnable loop gets a third of one at times; a sleeper gets nothing.
        assert!(busy > 25.0, "the busy loop is not shown busy:\n{shown}");
    }

    #[test]
    fn only_commands_run_in_the_guest_get_a_report() {
        assert!(runs_in_the_guest(&["exec", "--", "true"]));
        assert!(runs_in_the_guest(&["agent", "claude"]));
        for other in [&["up"][..], &["ps"], &["bench", "--quick"], &[]] {
            assert!(!runs_in_the_guest(other), "{other:?}");
        }
    }
}
