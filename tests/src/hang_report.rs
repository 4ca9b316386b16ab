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
    if !runs_in_the_guest(args) {
        return None;
    }
    let mut report = format!("\nHANG REPORT for vmctl {args:?}\n");
    if !vm_is_up(workspace) {
        report.push_str("the workspace's VM is not running: nothing to ask\n");
        return Some(report);
    }
    report.push_str(&console_tail(&workspace.state()));
    let asked = Instant::now();
    report.push_str(&ask_the_guest(workspace));
    report.push_str(&match wait_bounded(hung, grace) {
        Some(status) => format!(
            "verdict: the hung command ended ({status}) {:.1} s after the diagnosis began: \
             a wake-up lost on the way that the diagnosis's traffic made up for (unless \
             the command was merely about to finish)\n",
            asked.elapsed().as_secs_f64()
        ),
        None => format!(
            "verdict: the hung command was still running {} s after the diagnosis: \
             see where its processes wait above\n",
            grace.as_secs()
        ),
    });
    Some(report)
}

/// [`diagnose`], written to the test process's stderr (uncaptured, like a retry, so
/// that CI's log keeps it).
pub(crate) fn report(workspace: &Workspace, args: &[&str], hung: &mut Child) {
    if let Some(report) = diagnose(workspace, args, hung, GRACE_AFTER_DIAGNOSIS) {
        let _ = std::io::stderr().write_all(report.as_bytes());
    }
}

fn runs_in_the_guest(args: &[&str]) -> bool {
    args.first()
        .is_some_and(|first| GUEST_COMMANDS.contains(first))
}

fn vm_is_up(workspace: &Workspace) -> bool {
    let Ok(ps) = workspace.command(&["ps"]).output() else {
        return false;
    };
    let workspace_path = workspace.path();
    let workspace_path = workspace_path.to_string_lossy();
    String::from_utf8_lossy(&ps.stdout).lines().any(|line| {
        line.ends_with(workspace_path.as_ref())
            && line
                .split_whitespace()
                .nth(1)
                .is_some_and(|state| matches!(state, "running" | "degraded"))
    })
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
    let (mut out, mut err) = (diagnosis.stdout.take(), diagnosis.stderr.take());
    let out_reader = thread::spawn(move || crate::read_all(out.as_mut()));
    let err_reader = thread::spawn(move || crate::read_all(err.as_mut()));
    let started = Instant::now();
    let status = wait_bounded(&mut diagnosis, DIAGNOSIS_TIMEOUT);
    if status.is_none() {
        let _ = diagnosis.kill();
        let _ = diagnosis.wait();
    }
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    match status {
        Some(status) => format!(
            "the guest's processes, as a second exec saw them ({status}, {:.1} s):\n{}{}",
            started.elapsed().as_secs_f64(),
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr),
        ),
        None => format!(
            "a second exec (working directory on no share) got no answer within {} s \
             either: the guest, or its vsock path, is stuck as a whole\n",
            DIAGNOSIS_TIMEOUT.as_secs()
        ),
    }
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
    fn only_commands_run_in_the_guest_get_a_report() {
        assert!(runs_in_the_guest(&["exec", "--", "true"]));
        assert!(runs_in_the_guest(&["agent", "claude"]));
        for other in [&["up"][..], &["ps"], &["bench", "--quick"], &[]] {
            assert!(!runs_in_the_guest(other), "{other:?}");
        }
    }
}
