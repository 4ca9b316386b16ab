//! Waiting for a VM's guest agent to answer: the agent of a VM another vmctl
//! started (which may still be booting), and that of one this vmctl just booted; the
//! record that a running supervisor's agent answered, which later sessions trust.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::artifacts;
use crate::exec::AGENT_PORT;
use crate::state::VmDir;

use super::{agent_runtime, VmError};

/// How long a VM may take until its guest agent answers.
const BOOT_TIMEOUT_DIRECT: Duration = Duration::from_secs(30);
const BOOT_TIMEOUT_NESTED: Duration = Duration::from_secs(240);
/// How long a start waits, silent, for the agent of a VM already running.
const AGENT_WAIT_NOTICE: Duration = Duration::from_secs(2);
/// How often a booting VM's agent is asked whether it is ready: the interval is
/// added to every cold start, so short where boots take milliseconds.
const READY_POLL_DIRECT: Duration = Duration::from_millis(10);
const READY_POLL_NESTED: Duration = Duration::from_millis(100);

/// How long a VM may take until its guest agent answers.
fn boot_timeout(nested: bool) -> Duration {
    if nested {
        BOOT_TIMEOUT_NESTED
    } else {
        BOOT_TIMEOUT_DIRECT
    }
}

/// Waits for the agent of `vm`, which runs but has not yet answered a start (another
/// vmctl started it, and it may still be booting): until it answers or the VM stops,
/// within [`boot_timeout`].
pub(super) fn wait_for_running_agent(vm: &VmDir, workspace: &Path) -> Result<(), VmError> {
    let nested = vm.read_record().map_or(true, |record| record.nested);
    let boot_timeout = boot_timeout(nested);
    let waiting_since = Instant::now();
    let deadline = waiting_since + boot_timeout;
    let mut said = false;
    loop {
        match agent_state(&vm.vsock_socket()) {
            AgentState::Answers => {
                mark_agent_answered(vm);
                return Ok(());
            }
            AgentState::OtherProtocol(agent_said) => {
                return Err(VmError::OtherAgent {
                    workspace: workspace.to_path_buf(),
                    agent_said,
                })
            }
            AgentState::Silent => {}
        }
        if vm.running_pid().is_none() {
            return Ok(());
        }
        if vm.runs_an_older_layout() {
            return Err(VmError::NotReady {
                workspace: workspace.to_path_buf(),
                reason: "it was started by an older vmctl, which kept its vsock socket \
                         elsewhere ('vmctl stop' it, then start it again)"
                    .into(),
                vm_dir: vm.path.clone(),
            });
        }
        if Instant::now() > deadline {
            return Err(VmError::NotReady {
                workspace: workspace.to_path_buf(),
                reason: format!(
                    "it is running, but its guest agent did not answer within {} s \
                     ('vmctl stop' it, then start it again)",
                    boot_timeout.as_secs()
                ),
                vm_dir: vm.path.clone(),
            });
        }
        if !said && waiting_since.elapsed() >= AGENT_WAIT_NOTICE {
            vmm::to_stderr!(
                "vmctl: the VM of {} runs, but its guest agent does not answer yet \
                 (still booting?); waiting up to {} s",
                workspace.display(),
                boot_timeout.as_secs()
            );
            said = true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until the agent of `vm`, whose `supervisor` was started at `started`,
/// answers, within [`boot_timeout`]; on a terminal, a line counts the seconds
/// meanwhile. A supervisor that exits fails the start; one whose agent does not
/// answer in time, or speaks another protocol, is killed.
pub(super) fn wait_for_new_agent(
    vm: &VmDir,
    workspace: &Path,
    mut supervisor: std::process::Child,
    nested: bool,
    started: Instant,
) -> Result<(), VmError> {
    let mut notice = crate::start_notice::StartNotice::on_terminal();
    let boot_timeout = boot_timeout(nested);
    let deadline = started + boot_timeout;
    loop {
        let not_ready = |reason: String| VmError::NotReady {
            workspace: workspace.to_path_buf(),
            reason,
            vm_dir: vm.path.clone(),
        };
        match agent_state(&vm.vsock_socket()) {
            AgentState::Answers => {
                mark_agent_answered(vm);
                break;
            }
            AgentState::OtherProtocol(agent_said) => {
                let _ = supervisor.kill();
                return Err(not_ready(fresh_agent_mismatch(&agent_said)));
            }
            AgentState::Silent => {}
        }
        if let Ok(Some(status)) = supervisor.try_wait() {
            return Err(not_ready(format!(
                "its supervisor exited ({status}){}",
                log_tail(&vm.supervisor_log())
            )));
        }
        if Instant::now() > deadline {
            let _ = supervisor.kill();
            return Err(not_ready(format!(
                "the guest agent did not answer within {} s{}",
                boot_timeout.as_secs(),
                console_ending(&vm.console_log())
            )));
        }
        notice.update(workspace, started.elapsed());
        std::thread::sleep(if nested {
            READY_POLL_NESTED
        } else {
            READY_POLL_DIRECT
        });
    }
    notice.clear();
    Ok(())
}

/// The file in a VM's directory naming the supervisor (pid and start time) whose guest
/// agent answered a start: a session that finds it still running knows the VM booted,
/// without a round trip to the agent of its own (which every `vmctl exec` paid).
const AGENT_ANSWERED: &str = "agent-answered";

fn supervisor_named(pid: i32) -> Option<String> {
    Some(format!("{pid} {}", crate::procfs::start_time(pid)?))
}

/// Records that the agent of `vm`'s running supervisor answered. Best effort: without
/// the file, the next session asks the agent itself.
fn mark_agent_answered(vm: &VmDir) {
    if let Some(named) = vm.running_pid().and_then(supervisor_named) {
        let _ = std::fs::write(vm.path.join(AGENT_ANSWERED), named);
    }
}

/// Whether the agent of supervisor `pid` answered a start already.
pub(super) fn agent_answered_for(vm: &VmDir, pid: i32) -> bool {
    let recorded = std::fs::read_to_string(vm.path.join(AGENT_ANSWERED));
    recorded.is_ok_and(|recorded| Some(recorded) == supervisor_named(pid))
}

/// The last lines of a log, to quote in an error (empty when there are none).
fn log_tail(path: &Path) -> String {
    let tail = crate::log_keeper::last_lines(path, 64 << 10, 5);
    if tail.is_empty() {
        String::new()
    } else {
        format!(":\n  {}\n", tail.join("\n  "))
    }
}

/// Most characters of a console line quoted in an error.
const QUOTED_LINE_CHARS: usize = 200;

/// How far a guest whose agent never answered got, as its console shows it: the
/// last line, or that there is none. The guest's kernel is quiet, and its agent's
/// first line comes once the guest's file systems are mounted.
fn console_ending(path: &Path) -> String {
    match crate::log_keeper::last_lines(path, 4 << 10, 1)
        .first()
        .map(|line| line.trim())
    {
        Some(line) => {
            let mut quoted: String = line.chars().take(QUOTED_LINE_CHARS).collect();
            if quoted.len() < line.len() {
                quoted.push_str("...");
            }
            // The guest's words: an escape sequence in them must not reach a terminal.
            format!(
                " (the guest's console ends with: {})",
                crate::terminal::one_line(&quoted)
            )
        }
        None => ", and the guest's console is empty: the guest did not get as far as its \
                 agent's first line, which comes once its file systems are mounted"
            .into(),
    }
}

/// Why the guest agent of a VM this vmctl just booted speaks another protocol, and
/// what to do. Its image was built from the sources in [`artifacts::source_dir`], so a
/// newer agent means vmctl itself is older than those sources: a `git pull` without
/// `scripts/setup.sh` rebuilds the agent at the next start, but not vmctl.
fn fresh_agent_mismatch(agent_said: &str) -> String {
    let ours = guest_agent::protocol::PROTOCOL_VERSION;
    let vmctl = std::env::current_exe()
        .map_or_else(|_| "vmctl".to_owned(), |exe| exe.display().to_string());
    match guest_agent::protocol::version_spoken_in(agent_said) {
        Some(theirs) if theirs > ours => format!(
            "its guest agent, built from the sources in {}, speaks protocol {theirs}, and \
             this vmctl ({vmctl}) speaks {ours}: vmctl is older than its sources (pulled \
             but not rebuilt?); rebuild it with scripts/setup.sh",
            artifacts::source_dir().display()
        ),
        Some(theirs) => format!(
            "its guest agent speaks protocol {theirs}, older than this vmctl's {ours}: the \
             agent image is stale (an old VMCTL_AGENT_INITRAMFS?); rebuild it with \
             scripts/setup.sh"
        ),
        None => format!(
            "its guest agent speaks another protocol version ({agent_said}); rebuild it \
             with scripts/setup.sh"
        ),
    }
}

/// Whether a VM's guest agent answers a health check, as [`agent_state`] found it.
#[derive(Debug, PartialEq, Eq)]
enum AgentState {
    Answers,
    /// No answer (yet): the VM is booting, or stuck.
    Silent,
    /// It answers in another protocol version: it is not the agent of this vmctl,
    /// and waiting will not change that. The agent's words.
    OtherProtocol(String),
}

fn agent_state(socket: &Path) -> AgentState {
    if !socket.exists() {
        return AgentState::Silent;
    }
    let Some(runtime) = agent_runtime() else {
        return AgentState::Silent;
    };
    runtime.block_on(async {
        let check = async {
            let connection = guest_agent::client::connect_hybrid(socket, AGENT_PORT).await?;
            connection.health().await
        };
        match tokio::time::timeout(Duration::from_secs(5), check).await {
            Ok(Ok(_)) => AgentState::Answers,
            Ok(Err(guest_agent::client::ClientError::OtherProtocol(message))) => {
                AgentState::OtherProtocol(message)
            }
            _ => AgentState::Silent,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::tests::*;

    /// A session after the start that saw the agent answer skips asking it again, but
    /// only while that very supervisor runs.
    #[test]
    fn a_start_whose_agent_answered_is_known_by_its_supervisor() {
        let dir = tempfile::tempdir().unwrap();
        let (vm, mut supervisor) = silent_supervisor(dir.path());
        let pid = supervisor.id() as i32;
        assert_eq!(vm.running_pid(), Some(pid));
        assert!(!agent_answered_for(&vm, pid), "nothing answered yet");
        mark_agent_answered(&vm);
        let answered = agent_answered_for(&vm, pid);
        // The same pid, another process (a pid reused since).
        std::fs::write(vm.path.join(AGENT_ANSWERED), format!("{pid} 1")).unwrap();
        let reused = agent_answered_for(&vm, pid);
        mark_agent_answered(&vm);
        let _ = supervisor.kill();
        let _ = supervisor.wait();
        assert!(answered);
        assert!(!reused, "another process of that pid counted");
        assert!(!agent_answered_for(&vm, pid), "a supervisor gone counted");
    }

    /// An error quotes the log's last lines even when one is not UTF-8.
    #[test]
    fn a_log_tail_survives_a_byte_that_is_not_text() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("supervisor.log");
        std::fs::write(
            &log,
            b"first\n\nthe guest said \xff\nvmctl: error: the end\n",
        )
        .unwrap();
        assert_eq!(
            log_tail(&log),
            ":\n  first\n  the guest said \u{fffd}\n  vmctl: error: the end\n"
        );
        assert_eq!(log_tail(&dir.path().join("missing")), "");
    }

    /// An agent that never answered is said with how far its guest got: the console's
    /// last line (cut short), or that it is empty.
    #[test]
    fn a_silent_agent_is_said_with_the_consoles_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let console = dir.path().join("console.log");
        std::fs::write(
            &console,
            "guest-agent: booted: root /dev/vda\nINFO agent listening\n\n",
        )
        .unwrap();
        assert_eq!(
            console_ending(&console),
            " (the guest's console ends with: INFO agent listening)"
        );
        std::fs::write(&console, format!("{}\n", "x".repeat(300))).unwrap();
        assert_eq!(
            console_ending(&console),
            format!(" (the guest's console ends with: {}...)", "x".repeat(200))
        );
        for empty in [&b"\n \n"[..], b""] {
            std::fs::write(&console, empty).unwrap();
            assert!(console_ending(&console).contains("console is empty"));
        }
        assert!(console_ending(&dir.path().join("missing")).contains("console is empty"));
        std::fs::write(&console, "\x1b[2Jcleared\n").unwrap();
        assert!(console_ending(&console).ends_with(": \\u{1b}[2Jcleared)"));
    }

    #[test]
    fn an_agent_of_another_protocol_is_told_apart_from_a_silent_one() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock");
        assert_eq!(agent_state(&socket), AgentState::Silent, "no socket yet");
        let said = format!(
            "{} 5 (this agent 0.1.0 speaks 4)",
            guest_agent::protocol::UNSUPPORTED_VERSION
        );
        let agent = fake_agent(
            &socket,
            guest_agent::protocol::AgentMessage::Error {
                message: said.clone(),
            },
        );
        assert_eq!(agent_state(&socket), AgentState::OtherProtocol(said));
        agent.join().unwrap();
    }

    #[test]
    fn a_fresh_agent_newer_than_vmctl_says_vmctl_needs_rebuilding() {
        let said = |version: u32| {
            format!(
                "{} {} (this agent 0.1.0 speaks {version})",
                guest_agent::protocol::UNSUPPORTED_VERSION,
                guest_agent::protocol::PROTOCOL_VERSION
            )
        };
        let ours = guest_agent::protocol::PROTOCOL_VERSION;
        let newer = fresh_agent_mismatch(&said(ours + 1));
        assert!(newer.contains("vmctl is older than its sources"), "{newer}");
        assert!(
            newer.contains(&format!("speaks protocol {}", ours + 1)),
            "{newer}"
        );
        let older = fresh_agent_mismatch(&said(ours - 1));
        assert!(older.contains("agent image is stale"), "{older}");
        let unparsed = fresh_agent_mismatch("unsupported protocol version, oddly");
        assert!(unparsed.contains("oddly"), "{unparsed}");
    }
}
