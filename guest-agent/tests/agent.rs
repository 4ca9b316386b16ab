//! The agent served over a Unix socket in a temp dir, driven by the client.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use guest_agent::cgroups::ExecCgroups;
use guest_agent::client::{connect_unix, ClientError, Connection, ExecEvent, ExecSession};
use guest_agent::protocol::{
    encode_frame, AgentMessage, ClientMessage, ExecRequest, FrameReader, Hello, OutputStream,
    TtyRequest, User, PROTOCOL_VERSION, STDIN_WINDOW,
};
use guest_agent::server::{self, ListenAddr, ServerConfig};
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

/// The thread the test agent's runtime, and so each of its tasks, runs on.
const AGENT_THREAD: &str = "test-agent";

/// One agent for the whole test binary, on its own current-thread runtime. A panic in
/// any of its tasks aborts the test binary: it is a bug, which costs a session in the
/// guest (and, before the agent's panics unwound, the VM), and tokio, which ends only
/// the task, would let it pass unnoticed here.
fn agent() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            default_hook(info);
            if std::thread::current().name() == Some(AGENT_THREAD) {
                eprintln!("the agent panicked, which in the guest ends the VM: aborting");
                std::process::abort();
            }
        }));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        // A static is never dropped: the directory goes when the test binary exits.
        if let Ok(mut slot) = AGENT_DIR.lock() {
            *slot = Some(dir);
        }
        // SAFETY: registers a function that takes no arguments and only drops a TempDir.
        unsafe { libc::atexit(remove_agent_dir) };
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.clone();
        std::thread::Builder::new()
            .name(AGENT_THREAD.into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let listener = server::Listener::bind(&ListenAddr::Unix(p)).unwrap();
                    tx.send(()).unwrap();
                    server::serve(listener, ServerConfig::default())
                        .await
                        .unwrap();
                });
            })
            .unwrap();
        rx.recv().unwrap();
        path
    })
    .clone()
}

/// The directory of the test agent's socket, removed at exit by [`remove_agent_dir`].
static AGENT_DIR: Mutex<Option<tempfile::TempDir>> = Mutex::new(None);

extern "C" fn remove_agent_dir() {
    if let Ok(mut slot) = AGENT_DIR.lock() {
        slot.take();
    }
}

async fn conn() -> Connection<UnixStream> {
    connect_unix(&agent()).await.unwrap()
}

fn sh(script: &str) -> ExecRequest {
    ExecRequest {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

/// A terminal of 80 columns and 24 rows, of the type `term`.
fn terminal_80x24(term: &str) -> Option<TtyRequest> {
    Some(TtyRequest {
        rows: 24,
        cols: 80,
        term: term.into(),
    })
}

async fn run(req: ExecRequest, stdin: &[u8]) -> guest_agent::client::Output {
    let s = conn().await.exec(req).await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), s.output(stdin))
        .await
        .unwrap()
        .unwrap()
}

/// Reads stdout until `needle` appears.
/// The pid in the command's first line, `LABEL PID`.
async fn said_pid(s: &mut ExecSession<UnixStream>, label: &str) -> i32 {
    let mut seen = String::new();
    read_until(s, "\n", &mut seen).await;
    let line = seen.lines().next().unwrap_or_default();
    line.trim()
        .strip_prefix(label)
        .and_then(|rest| rest.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `{label} PID` line: {seen:?}"))
}

async fn read_until(s: &mut ExecSession<UnixStream>, needle: &str, seen: &mut String) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen.contains(needle) {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {needle:?}; got {seen:?}"
        );
        match tokio::time::timeout(Duration::from_secs(10), s.next_event())
            .await
            .unwrap()
            .unwrap()
        {
            Some(ExecEvent::Stdout(d)) => seen.push_str(&String::from_utf8_lossy(&d)),
            Some(ExecEvent::Stderr(d)) => seen.push_str(&String::from_utf8_lossy(&d)),
            Some(ExecEvent::Exited(st)) => panic!("exited early ({st:?}); output {seen:?}"),
            None => panic!("no more events"),
        }
    }
}

#[tokio::test]
async fn exec_with_pipes() {
    let out = run(sh("echo out; echo err >&2; exit 3"), b"").await;
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.status.code, Some(3));
    assert_eq!(out.status.signal, None);
}

#[tokio::test]
async fn exec_env_cwd_and_user() {
    let mut req = sh("echo \"$FOO|$(pwd)|$HOME|$USER|$(id -u)\"");
    req.env = vec![("FOO".into(), "bar baz".into())];
    req.cwd = Some("/tmp".into());
    let out = run(req.clone(), b"").await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "bar baz|/tmp|/root|root|0\n"
    );
    // A missing cwd falls back to the home directory.
    req.cwd = Some("/does/not/exist".into());
    let out = run(req.clone(), b"").await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "bar baz|/root|/root|root|0\n"
    );
    // Another account: Debian's `nobody`.
    let nobody = guest_agent::users::lookup("nobody").expect("this machine has no 'nobody'");
    req.user = User::Named("nobody".into());
    req.cwd = Some("/".into());
    let out = run(req, b"").await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("bar baz|/|{}|nobody|{}\n", nobody.home, nobody.uid)
    );
}

/// Arguments, an environment value and a working directory that are not UTF-8
/// (Latin-1 names) reach the command byte for byte, as through ssh.
#[tokio::test]
async fn arguments_environment_and_cwd_that_are_not_utf8_reach_the_command() {
    use std::os::unix::ffi::OsStrExt;
    let latin1 = b"caf\xe9 \xff".to_vec();
    let out = run(
        ExecRequest {
            argv: vec!["printf".into(), "%s".into(), latin1.clone()],
            ..Default::default()
        },
        b"",
    )
    .await;
    assert_eq!(
        out.stdout,
        latin1,
        "{:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code, Some(0));

    let top = tempfile::tempdir().unwrap();
    let dir = top.path().join(std::ffi::OsStr::from_bytes(b"d\xe9j\xe0"));
    std::fs::create_dir(&dir).unwrap();
    let mut req = sh("pwd; printf %s \"$NAME\"");
    req.cwd = Some(dir.as_os_str().as_bytes().to_vec());
    req.env = vec![("NAME".into(), b"Jos\xe9".to_vec())];
    let out = run(req, b"").await;
    let mut expected = dir.as_os_str().as_bytes().to_vec();
    expected.extend(b"\nJos\xe9");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&expected)
    );
    assert_eq!(out.stdout, expected);
}

/// Commands start with the usual open files limit, whatever the agent's own (PID 1
/// raises it for its relays).
#[tokio::test]
async fn commands_get_the_usual_open_files_limit() {
    let out = run(sh("ulimit -n"), b"").await;
    let limit: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let mut ours = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into a live local.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut ours) },
        0
    );
    assert_eq!(limit, ours.rlim_cur.min(1024));
}

#[tokio::test]
async fn exec_errors_are_reported() {
    let err = conn()
        .await
        .exec(ExecRequest {
            argv: vec!["/no/such/program".into()],
            ..Default::default()
        })
        .await
        .err()
        .unwrap();
    assert!(
        matches!(&err, ClientError::NotStarted { message, exit_code: 127 }
            if message == "/no/such/program: No such file or directory"),
        "{err}"
    );
    // As a shell says it: a name not found on PATH, a file that is not executable.
    let not_runnable = |argv0: String| async move {
        conn()
            .await
            .exec(ExecRequest {
                argv: vec![argv0.into()],
                ..Default::default()
            })
            .await
            .err()
            .unwrap()
    };
    let err = not_runnable("no-such-program-xyz".into()).await;
    assert!(
        matches!(&err, ClientError::NotStarted { message, exit_code: 127 }
            if message == "no-such-program-xyz: command not found"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let plain_file = dir.path().join("not-executable");
    std::fs::write(&plain_file, "#!/bin/sh\n").unwrap();
    let plain_file = plain_file.display().to_string();
    let err = not_runnable(plain_file.clone()).await;
    assert!(
        matches!(&err, ClientError::NotStarted { message, exit_code: 126 }
            if *message == format!("{plain_file}: Permission denied")),
        "{err}"
    );
    // A script that is there, whose interpreter is not: not "command not found".
    let orphan_script = dir.path().join("no-interpreter");
    std::fs::write(&orphan_script, "#!/no/such/interpreter\n").unwrap();
    std::fs::set_permissions(&orphan_script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let orphan_script = orphan_script.display().to_string();
    // A test beside this one that forks while the script is being written holds it
    // open for writing until its child's exec: exec refuses it meanwhile (ETXTBSY).
    let mut err = not_runnable(orphan_script.clone()).await;
    for _ in 0..10 {
        if !err.to_string().contains("Text file busy") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        err = not_runnable(orphan_script.clone()).await;
    }
    assert!(
        matches!(&err, ClientError::NotStarted { message, exit_code: 127 }
            if message.starts_with(&format!("{orphan_script}: cannot execute: required file not found"))),
        "{err}"
    );
    let err = conn()
        .await
        .exec(ExecRequest::default())
        .await
        .err()
        .unwrap();
    assert!(
        matches!(&err, ClientError::Agent(m) if m.contains("argv")),
        "{err}"
    );
    let mut req = sh("true");
    req.user = User::Named("no-such-user-xyz".into());
    let err = conn().await.exec(req).await.err().unwrap();
    assert!(
        matches!(&err, ClientError::Agent(m) if m.contains("no-such-user-xyz")),
        "{err}"
    );
}

#[tokio::test]
async fn one_mib_of_stdin_through_cat() {
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let data: Vec<u8> = (0..1024 * 1024 + 17)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let out = run(
        ExecRequest {
            argv: vec!["cat".into()],
            ..Default::default()
        },
        &data,
    )
    .await;
    assert_eq!(out.status.code, Some(0));
    assert!(
        out.stdout == data,
        "stdout differs ({} bytes vs {})",
        out.stdout.len(),
        data.len()
    );
}

#[tokio::test]
async fn output_back_pressure() {
    // 16 MiB of output while the client does not read: the command must block
    // (not finish with everything buffered in the agent), then deliver it all.
    let dir = tempfile::tempdir().unwrap();
    let written = dir.path().join("all-written");
    let mut s = conn()
        .await
        .exec(sh(&format!(
            "head -c 16777216 /dev/zero; touch '{}'; echo done >&2",
            written.display()
        )))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !written.exists(),
        "the command wrote all 16 MiB while nobody read: the agent buffered it"
    );
    let mut total = 0usize;
    let mut stderr = Vec::new();
    loop {
        match s.next_event().await.unwrap() {
            Some(ExecEvent::Stdout(d)) => total += d.len(),
            Some(ExecEvent::Stderr(d)) => {
                // Agent-side buffering is bounded, so "done" cannot come before most of stdout.
                assert!(
                    total > 8 * 1024 * 1024,
                    "stderr arrived after only {total} bytes"
                );
                stderr.extend(d);
            }
            Some(ExecEvent::Exited(st)) => {
                assert_eq!(st.code, Some(0));
                break;
            }
            None => break,
        }
    }
    assert_eq!(total, 16 * 1024 * 1024);
    assert_eq!(stderr, b"done\n");
}

/// A process a test left behind, and its group if it leads one: killed when dropped.
struct LeftBehind(i32);

impl Drop for LeftBehind {
    fn drop(&mut self) {
        if self.0 > 0 {
            // SAFETY: kill has no memory-safety preconditions. (The pid is of a job the
            // test started, gone at the soonest a moment before.)
            unsafe {
                libc::kill(-self.0, libc::SIGKILL);
                libc::kill(self.0, libc::SIGKILL);
            }
        }
    }
}

/// Whether `Exited` came within `limit`, what the session printed, and the job the
/// script left behind, whose pid it printed as `job=PID`.
async fn exited_within(req: ExecRequest, limit: Duration) -> (bool, String, LeftBehind) {
    let mut s = conn().await.exec(req).await.unwrap();
    let start = Instant::now();
    let mut seen = String::new();
    let mut exited = false;
    while start.elapsed() < limit {
        match tokio::time::timeout(Duration::from_millis(500), s.next_event()).await {
            Ok(Ok(Some(ExecEvent::Stdout(d)))) => seen.push_str(&String::from_utf8_lossy(&d)),
            Ok(Ok(Some(ExecEvent::Exited(_)))) => {
                exited = true;
                break;
            }
            Ok(Ok(Some(_))) | Err(_) => {}
            Ok(Ok(None)) | Ok(Err(_)) => break,
        }
    }
    let job = seen
        .split_whitespace()
        .find_map(|w| w.strip_prefix("job=").and_then(|p| p.parse().ok()))
        .unwrap_or(0);
    (exited, seen, LeftBehind(job))
}

/// `sh -c 'ticker & exit 0'`: a job left behind that writes more often than the
/// drain's idle gap does not keep the session (and the client) waiting for `Exited`
/// forever; the drain after the exit has a time limit (2 s).
#[tokio::test]
async fn a_job_left_writing_to_the_pipes_does_not_hold_up_exited() {
    let script = "(while :; do echo tick; sleep 0.1; done) & echo job=$!; exit 0";
    let (exited, seen, _job) = exited_within(sh(script), Duration::from_secs(10)).await;
    assert!(exited, "no Exited within 10 s; output {seen:?}");
}

/// A job left behind on the pipes lives on once the session ended: what it writes
/// later is read and dropped, as a terminal nobody watches would take it. (Review:
/// the pipes were closed, and a `npm run dev &` died of SIGPIPE at its next log line.)
#[tokio::test]
async fn a_job_left_on_the_pipes_lives_on_after_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let note = dir.path().join("survived");
    let script = format!(
        "(sleep 3; echo late; echo late >&2; echo survived >'{}') & echo job=$!; exit 0",
        note.display()
    );
    let (exited, seen, _job) = exited_within(sh(&script), Duration::from_secs(10)).await;
    assert!(exited, "no Exited within 10 s; output {seen:?}");
    assert!(!seen.contains("late"), "{seen:?}");
    note_within_10_s(
        &note,
        "the job did not live to write after the session ended",
    )
    .await;
}

/// An interactive shell with job control leaves a job in a process group of its own,
/// which the kernel does not hang up when the shell exits: it does not keep the
/// session going, and the session's end hangs up the terminal as sshd does, so the
/// job's next write there fails (it ends its loop and says so in a file).
#[tokio::test]
async fn a_job_left_writing_to_the_terminal_does_not_hold_up_exited_and_is_hung_up() {
    let dir = tempfile::tempdir().unwrap();
    let note = dir.path().join("hung-up");
    let mut req = sh(&format!(
        "set -m; (while echo tick; do sleep 0.1; done; echo hung up >'{}') & echo job=$!; exit 0",
        note.display()
    ));
    req.tty = terminal_80x24("xterm");
    let (exited, seen, _job) = exited_within(req, Duration::from_secs(10)).await;
    assert!(exited, "no Exited within 10 s; output {seen:?}");
    assert!(seen.contains("tick"), "{seen:?}");
    note_within_10_s(
        &note,
        "the job still writes to its terminal 10 s after the session ended",
    )
    .await;
}

/// Waits up to 10 s for the job left behind to write `note`; fails saying `otherwise`.
async fn note_within_10_s(note: &std::path::Path, otherwise: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !note.exists() {
        assert!(Instant::now() < deadline, "{otherwise}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn pty_size_and_resize() {
    let mut req = sh("stty size; trap 'echo WINCH; stty size; exit 7' WINCH; echo ready; while :; do sleep 0.05; done");
    req.tty = Some(TtyRequest {
        rows: 33,
        cols: 101,
        term: "xterm-256color".into(),
    });
    let mut s = conn().await.exec(req).await.unwrap();
    let mut seen = String::new();
    read_until(&mut s, "ready", &mut seen).await;
    assert!(seen.contains("33 101"), "{seen:?}");
    s.resize(40, 120).await.unwrap();
    read_until(&mut s, "40 120", &mut seen).await;
    assert!(seen.contains("WINCH"), "{seen:?}");
    loop {
        match s.next_event().await.unwrap() {
            Some(ExecEvent::Stderr(_)) => panic!("stderr with a tty"),
            Some(ExecEvent::Exited(st)) => {
                assert_eq!(st.code, Some(7));
                break;
            }
            Some(ExecEvent::Stdout(_)) => {}
            None => panic!("no Exited"),
        }
    }
}

#[tokio::test]
async fn pty_is_a_terminal_with_term() {
    let mut req = sh("test -t 0 && test -t 1 && echo \"tty $TERM\"; read line; echo \"got $line\"");
    req.tty = terminal_80x24("vt100");
    let out = run(req, b"hello\n").await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("tty vt100"), "{text:?}");
    assert!(text.contains("got hello"), "{text:?}");
    assert_eq!(out.status.code, Some(0));
}

/// The end of input that does not end in a newline still ends the command's input:
/// `printf abc | vmctl exec --tty -- cat` must not wait for ever.
#[tokio::test]
async fn terminal_input_without_a_final_newline_still_ends() {
    let mut req = ExecRequest {
        argv: vec!["cat".into()],
        ..Default::default()
    };
    req.tty = terminal_80x24("vt100");
    let out = tokio::time::timeout(Duration::from_secs(10), run(req, b"abc"))
        .await
        .expect("cat never saw the end of its input");
    assert!(String::from_utf8_lossy(&out.stdout).contains("abc"));
    assert_eq!(out.status.code, Some(0));
}

/// A terminal takes UTF-8 input as sshd's does (IUTF8): a backspace erases a whole
/// character.
#[tokio::test]
async fn a_terminal_erases_whole_utf8_characters() {
    let mut req = sh("read line; printf '[%s]' \"$line\"");
    req.tty = terminal_80x24("vt100");
    let out = run(req, "xé\x7f\n".as_bytes()).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("[x]"), "{text:?}");
}

/// The terminal belongs to the command's user, as after a login: one running as
/// another user than the agent's can open it by name (`$(tty)`, as gpg's pinentry
/// and `screen` do).
#[tokio::test]
async fn a_terminal_belongs_to_the_commands_user() {
    let Ok(nobody) = guest_agent::users::lookup("nobody") else {
        panic!("this test needs a `nobody` account");
    };
    assert_eq!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() },
        0,
        "the agent must run as root to start a command as nobody"
    );
    let mut req = sh("stat -c '%u %G %a' \"$(tty)\"; exec 3<>\"$(tty)\" && echo opened");
    req.user = User::Named("nobody".into());
    req.cwd = Some("/".into());
    req.tty = terminal_80x24("vt100");
    let out = run(req, b"").await;
    let text = String::from_utf8_lossy(&out.stdout);
    let owner = match guest_agent::users::group_id("tty") {
        Some(_) => format!("{} tty 620", nobody.uid),
        None => format!("{} {} 600", nobody.uid, nobody.gid),
    };
    assert!(text.contains(&owner), "{text:?}");
    assert!(text.contains("opened"), "{text:?}");
}

/// With a terminal, a signal reaches the job in the foreground too: an interactive
/// shell runs it in a group of its own and ignores SIGTERM itself.
#[tokio::test]
async fn a_signal_reaches_the_foreground_job_of_an_interactive_shell() {
    let mut req = ExecRequest {
        argv: vec![
            "bash".into(),
            "--norc".into(),
            "--noprofile".into(),
            "-i".into(),
        ],
        ..Default::default()
    };
    req.tty = terminal_80x24("dumb");
    let mut s = conn().await.exec(req).await.unwrap();
    // The job says itself that it runs, so it is in the foreground by then (the shell
    // gives it the terminal before it runs it); the shell's echo of the line typed
    // shows `$((1+1))`, not its value.
    s.send_stdin(b"sh -c 'echo up-$((1+1)); exec sleep 77'\n")
        .await
        .unwrap();
    let mut seen = String::new();
    read_until(&mut s, "up-2", &mut seen).await;
    s.signal(libc::SIGTERM).await.unwrap();
    // Typed ahead: runs once `sleep` has ended.
    s.send_stdin(b"echo after-$((2+2)); exit 3\n")
        .await
        .unwrap();
    read_until(&mut s, "after-4", &mut seen).await;
    loop {
        match tokio::time::timeout(Duration::from_secs(10), s.next_event())
            .await
            .expect("the shell did not exit")
            .unwrap()
        {
            Some(ExecEvent::Exited(status)) => {
                assert_eq!(status.code, Some(3), "{seen}");
                break;
            }
            Some(_) => {}
            None => panic!("no Exited"),
        }
    }
}

#[tokio::test]
async fn signal_kills_the_command() {
    let mut s = conn()
        .await
        .exec(sh("echo up; exec sleep 100"))
        .await
        .unwrap();
    let mut seen = String::new();
    read_until(&mut s, "up", &mut seen).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.signal(libc::SIGTERM).await.unwrap();
    loop {
        if let Some(ExecEvent::Exited(st)) = s.next_event().await.unwrap() {
            assert_eq!(st.signal, Some(libc::SIGTERM));
            assert_eq!(st.code, None);
            break;
        }
    }
}

/// A session of `sleep 100`, which reads no stdin, once it runs; and its pid.
async fn sleeping_a_while() -> (ExecSession<UnixStream>, i32) {
    let mut s = conn()
        .await
        .exec(sh("echo up; exec sleep 100"))
        .await
        .unwrap();
    read_until(&mut s, "up", &mut String::new()).await;
    let pid = s.pid() as i32;
    (s, pid)
}

/// The client sends stdin at most a window ahead of what the command takes, so the
/// agent never stops reading the connection: a signal, or the client's going away,
/// reaches a command that reads none of it at once (an agent that waited for the
/// command to read left both queued behind the stdin). What the command reads comes
/// back: three windows go through `wc -c`.
#[tokio::test]
async fn stdin_goes_a_window_ahead_and_never_holds_up_a_signal_or_a_hang_up() {
    let total = 3 * STDIN_WINDOW + 5;
    let out = run(sh("wc -c"), &vec![b'x'; total]).await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        total.to_string()
    );

    let (s, pid) = sleeping_a_while().await;
    let (mut input, mut output) = s.split();
    let window = input.stdin_window();
    input.send_stdin(&vec![0; STDIN_WINDOW]).await.unwrap();
    let events = tokio::spawn(async move {
        loop {
            match output.next_event().await.unwrap() {
                Some(ExecEvent::Exited(status)) => return status,
                Some(_) => {}
                None => panic!("no Exited"),
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A pipe's worth at most went into `sleep`'s stdin.
    let open = tokio::time::timeout(Duration::from_millis(10), window.open())
        .await
        .unwrap_or(0);
    assert!(open < STDIN_WINDOW / 4, "{open} bytes may be sent");
    input.signal(libc::SIGTERM).await.unwrap();
    let status = tokio::time::timeout(Duration::from_secs(5), events)
        .await
        .expect("the signal waited behind stdin")
        .unwrap();
    assert_eq!(status.signal, Some(libc::SIGTERM));
    assert!(!alive(pid));

    let (mut s, pid) = sleeping_a_while().await;
    s.send_stdin(&vec![0; STDIN_WINDOW]).await.unwrap();
    drop(s);
    all_gone_within_5_s(&[pid]).await;
}

/// Stdin that comes after the host closed it (no terminal) is dropped, and its window
/// given back as for any stdin the command does not take: the host may go on sending
/// (before, the window stayed taken for good).
#[tokio::test]
async fn stdin_sent_after_its_end_gives_the_window_back() {
    let (s, pid) = sleeping_a_while().await;
    let (mut input, mut output) = s.split();
    let events = tokio::spawn(async move {
        loop {
            match output.next_event().await.unwrap() {
                Some(ExecEvent::Exited(status)) => return status,
                Some(_) => {}
                None => panic!("no Exited"),
            }
        }
    });
    input.close_stdin().await.unwrap();
    input.send_stdin(&vec![0; STDIN_WINDOW]).await.unwrap();
    let window = input.stdin_window();
    let whole = async {
        while window.open().await < STDIN_WINDOW {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), whole)
        .await
        .expect("the window did not come back within 10 s");
    input.signal(libc::SIGKILL).await.unwrap();
    let status = tokio::time::timeout(Duration::from_secs(10), events)
        .await
        .expect("no Exited within 10 s")
        .unwrap();
    assert_eq!(status.signal, Some(libc::SIGKILL));
    assert!(!alive(pid));
}

/// `vmctl exec -- cmd | head -1`: once the host's reader of an output is gone, the
/// command's next write there fails as on the host (`yes` dies of SIGPIPE), and the
/// command goes on: its other output still arrives and its own exit code is reported.
#[tokio::test]
async fn a_closed_output_fails_the_next_write_there_and_the_command_goes_on() {
    for (closed, other) in [
        (OutputStream::Stdout, OutputStream::Stderr),
        (OutputStream::Stderr, OutputStream::Stdout),
    ] {
        let (to_closed, to_other) = match closed {
            OutputStream::Stdout => ("", ">&2"),
            OutputStream::Stderr => (">&2", ""),
        };
        let script =
            format!("echo up {to_closed}; yes {to_closed}; echo \"yes: $?\" {to_other}; exit 7");
        let mut s = conn().await.exec(sh(&script)).await.unwrap();
        let mut seen = String::new();
        read_until(&mut s, "up", &mut seen).await;
        s.close_output(closed).await.unwrap();
        let mut other_output = String::new();
        let status = loop {
            let event = tokio::time::timeout(Duration::from_secs(30), s.next_event())
                .await
                .unwrap_or_else(|_| panic!("{closed:?} closed: `yes` still runs after 30 s"))
                .unwrap();
            match (event, other) {
                (Some(ExecEvent::Exited(status)), _) => break status,
                (Some(ExecEvent::Stdout(d)), OutputStream::Stdout)
                | (Some(ExecEvent::Stderr(d)), OutputStream::Stderr) => {
                    other_output.push_str(&String::from_utf8_lossy(&d))
                }
                (Some(_), _) => {}
                (None, _) => panic!("no Exited"),
            }
        };
        assert_eq!(other_output, "yes: 141\n", "{closed:?} closed");
        assert_eq!(
            (status.code, status.signal),
            (Some(7), None),
            "{closed:?} closed"
        );
    }
}

#[tokio::test]
async fn twenty_concurrent_execs() {
    // Each waits until all twenty have started: they only finish if all run at once.
    let started = tempfile::tempdir().unwrap();
    let mut tasks = Vec::new();
    for i in 0..20 {
        let dir = started.path().display().to_string();
        tasks.push(tokio::spawn(async move {
            let mut req = sh(&format!(
                "touch {dir}/$0; while [ $(ls {dir} | wc -l) -lt 20 ]; do sleep 0.05; done; \
                 echo \"n=$0\"; cat"
            ));
            req.argv.push(i.to_string().into());
            let out = run(req, format!("in{i}").as_bytes()).await;
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                format!("n={i}\nin{i}")
            );
            assert_eq!(out.status.code, Some(0));
        }));
    }
    let all = async {
        for t in tasks {
            t.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("the twenty execs never all ran at once");
}

fn alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) == 0 }
}

#[tokio::test]
async fn disconnect_kills_the_process_group() {
    // The shell ignores SIGHUP, so the agent has to escalate to SIGKILL; its child
    // `sleep` is in the same process group.
    let mut s = conn()
        .await
        .exec(sh("trap '' HUP; sleep 1000 & echo \"child $!\"; wait"))
        .await
        .unwrap();
    let pid = s.pid() as i32;
    let child = said_pid(&mut s, "child").await;
    assert!(alive(pid) && alive(child));
    drop(s);
    all_gone_within_5_s(&[pid, child]).await;
}

/// Waits until none of `pids` lives, failing after 5 s with which still do.
async fn all_gone_within_5_s(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let alive: Vec<i32> = pids.iter().copied().filter(|&pid| alive(pid)).collect();
        if alive.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still alive 5 s after the client left: {alive:?} (of {pids:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The leader dies of the hang-up at once, and leaves a member of its group that
/// ignores it: the member is killed all the same, when the grace is over. (Review: the
/// agent sent SIGKILL only if the leader was still alive, so `nohup yes &` outlived
/// the client for the VM's life.)
#[tokio::test]
async fn disconnect_kills_the_members_a_leader_that_died_of_the_hang_up_left() {
    let mut s = conn()
        .await
        .exec(sh(
            "(trap '' HUP; exec sleep 1000) & echo \"member $!\"; wait",
        ))
        .await
        .unwrap();
    let leader = s.pid() as i32;
    let member = said_pid(&mut s, "member").await;
    assert!(alive(leader) && alive(member));
    drop(s);
    all_gone_within_5_s(&[leader, member]).await;
}

/// A writable cgroup v2 directory for a test's own agent, or `None` where this
/// machine has none: the test then says so on the terminal, past the harness's
/// capture, or fails under CI (`CI` set, as `.ci/run` sets it), whose machines have
/// one, where a test that cannot run is a broken machine, not a pass.
fn test_exec_cgroups(test: &str) -> Option<std::sync::Arc<ExecCgroups>> {
    let why = match guest_agent::cgroups::own_cgroup_dir() {
        None => "this process is in no cgroup v2 hierarchy".to_string(),
        Some(own) => {
            let dir = own.join(format!("guest-agent-{test}-{}", std::process::id()));
            match ExecCgroups::open(&dir) {
                Ok(cgroups) => return Some(cgroups),
                Err(e) => e.to_string(),
            }
        }
    };
    let ci = std::env::var("CI").unwrap_or_default();
    if !ci.is_empty() && ci != "false" && ci != "0" {
        panic!("{test}: needs a writable cgroup v2 directory, which CI (CI={ci}) must have: {why}");
    }
    let _ = writeln!(
        std::io::stderr(),
        "NOT RUN: {test}: no writable cgroup v2 here ({why}); it passes without testing \
         anything (with CI set it fails)"
    );
    None
}

/// Removes a test's cgroups when dropped, killing what still runs there (a test
/// that failed).
struct TestCgroups(PathBuf);

impl Drop for TestCgroups {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        for entry in std::fs::read_dir(&self.0).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                let _ = std::fs::write(entry.path().join("cgroup.kill"), "1");
                while std::fs::remove_dir(entry.path()).is_err() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        if let Err(e) = std::fs::remove_dir(&self.0) {
            eprintln!("cannot remove the test's cgroup {}: {e}", self.0.display());
        }
    }
}

/// An agent of the test's own with `config`, on its own runtime; its socket's path.
fn own_agent(dir: &std::path::Path, config: ServerConfig) -> PathBuf {
    let path = dir.join("own-agent.sock");
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let agent_path = path.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = server::Listener::bind(&ListenAddr::Unix(agent_path)).unwrap();
            let _ = bound_tx.send(());
            server::serve(l, config).await.unwrap();
        });
    });
    bound_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the test's own agent listens within 10 s");
    path
}

/// A process that moved to a session of its own (`setsid`), which no signal to the
/// command's group reaches, is killed with the command's cgroup when the client goes
/// away.
#[tokio::test]
async fn disconnect_kills_what_left_the_process_group_through_the_commands_cgroup() {
    let Some(cgroups) = test_exec_cgroups("left-the-group") else {
        return;
    };
    let _cleanup = TestCgroups(cgroups.dir().to_path_buf());
    let dir = tempfile::tempdir().unwrap();
    let agent = own_agent(
        dir.path(),
        ServerConfig {
            exec_cgroups: Some(cgroups),
            ..ServerConfig::default()
        },
    );
    // Each command is in a cgroup of its own under the agent's.
    let mut own_cgroups = Vec::new();
    for _ in 0..2 {
        let session = connect_unix(&agent)
            .await
            .unwrap()
            .exec(sh("cat /proc/self/cgroup"))
            .await
            .unwrap();
        let out = tokio::time::timeout(Duration::from_secs(60), session.output(b""))
            .await
            .expect("cat /proc/self/cgroup still runs after 60 s")
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        let own = said
            .lines()
            .find_map(|line| line.strip_prefix("0::"))
            .unwrap_or_else(|| panic!("no cgroup v2 line: {said}"));
        let (parent, number) = own.rsplit_once('/').unwrap_or_else(|| panic!("{said}"));
        assert!(
            parent.ends_with(&format!(
                "/guest-agent-left-the-group-{}",
                std::process::id()
            )) && number.parse::<u64>().is_ok(),
            "not in a cgroup of its own: {said}"
        );
        own_cgroups.push(own.to_string());
    }
    assert_ne!(
        own_cgroups[0], own_cgroups[1],
        "two commands shared a cgroup"
    );

    let connection = connect_unix(&agent).await.unwrap();
    let mut s = connection
        .exec(sh(
            "setsid sh -c 'echo \"moved $$\"; exec sleep 1000' & wait",
        ))
        .await
        .unwrap();
    let leader = s.pid() as i32;
    let moved = said_pid(&mut s, "moved").await;
    // SAFETY: getsid has no memory-safety preconditions.
    let moved_session = unsafe { libc::getsid(moved) };
    assert_eq!(moved_session, moved, "sleep is not in a session of its own");
    drop(s);
    all_gone_within_5_s(&[leader, moved]).await;
    connect_unix(&agent)
        .await
        .unwrap()
        .shutdown()
        .await
        .unwrap();
}

#[tokio::test]
async fn a_client_that_stops_reading_output_ends_the_command() {
    // The host side stops reading while the command writes: the agent's next write
    // fails while its reads still wait. (A command that writes slowly, so that the
    // client's receive buffer never fills: a full one would leave the agent's writer
    // waiting for room that never comes, instead of failing.)
    let (mut r, mut w) = raw_hello().await;
    let exec = ClientMessage::Exec(ExecRequest {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "while :; do echo tick; sleep 0.1; done".into(),
        ],
        ..Default::default()
    });
    w.write_all(&encode_frame(&exec).unwrap()).await.unwrap();
    let Some(AgentMessage::Started { pid }) = r.next::<AgentMessage>().await.unwrap() else {
        panic!("the command did not start")
    };
    let Some(AgentMessage::Stdout(_)) = r.next::<AgentMessage>().await.unwrap() else {
        panic!("no output came")
    };
    let read_half = r.into_inner();
    // SAFETY: shutdown(2) on the descriptor the read half still owns.
    let shut = unsafe { libc::shutdown(read_half.as_ref().as_raw_fd(), libc::SHUT_RD) };
    assert_eq!(shut, 0, "{}", std::io::Error::last_os_error());
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid as i32) {
        assert!(
            Instant::now() < deadline,
            "the command still runs 10 s after its output stopped being read"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(conn().await.health().await.is_ok());
    drop((read_half, w));
}

async fn raw_hello() -> (
    FrameReader<tokio::net::unix::OwnedReadHalf>,
    tokio::net::unix::OwnedWriteHalf,
) {
    let (r, mut w) = UnixStream::connect(agent()).await.unwrap().into_split();
    let hello = ClientMessage::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        client: "raw".into(),
        host_time_ns: None,
    });
    w.write_all(&encode_frame(&hello).unwrap()).await.unwrap();
    let mut r = FrameReader::new(r);
    assert!(matches!(
        r.next::<AgentMessage>().await.unwrap(),
        Some(AgentMessage::HelloOk { .. })
    ));
    (r, w)
}

async fn expect_error_then_close(r: &mut FrameReader<tokio::net::unix::OwnedReadHalf>) -> String {
    let msg = tokio::time::timeout(Duration::from_secs(5), r.next::<AgentMessage>())
        .await
        .unwrap()
        .unwrap();
    let Some(AgentMessage::Error { message }) = msg else {
        panic!("expected Error, got {msg:?}")
    };
    let end = tokio::time::timeout(Duration::from_secs(5), r.next::<AgentMessage>())
        .await
        .unwrap();
    assert!(
        matches!(end, Ok(None) | Err(_)),
        "connection not closed: {end:?}"
    );
    message
}

#[tokio::test]
async fn malformed_frames_only_affect_their_connection() {
    // A long-running exec on another connection.
    let mut other = conn()
        .await
        .exec(sh("read x; echo \"still $x\""))
        .await
        .unwrap();

    // Garbage payload.
    let (mut r, mut w) = raw_hello().await;
    w.write_all(&[3, 0, 0, 0, 0xff, 0xfe, 0xfd]).await.unwrap();
    let m = expect_error_then_close(&mut r).await;
    assert!(m.contains("malformed"), "{m}");

    // Oversized length prefix.
    let (mut r, mut w) = raw_hello().await;
    w.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    let m = expect_error_then_close(&mut r).await;
    assert!(m.contains("exceeds"), "{m}");

    // Garbage in the middle of an exec: error, and the command is killed.
    let (mut r, mut w) = raw_hello().await;
    let exec = ClientMessage::Exec(ExecRequest {
        argv: vec!["sleep".into(), "100".into()],
        ..Default::default()
    });
    w.write_all(&encode_frame(&exec).unwrap()).await.unwrap();
    let Some(AgentMessage::Started { pid }) = r.next::<AgentMessage>().await.unwrap() else {
        panic!()
    };
    w.write_all(&[1, 0, 0, 0, 0xee]).await.unwrap();
    let _ = expect_error_then_close(&mut r).await;
    all_gone_within_5_s(&[pid as i32]).await;

    // No Hello first.
    let (r, mut w) = UnixStream::connect(agent()).await.unwrap().into_split();
    w.write_all(&encode_frame(&ClientMessage::Health).unwrap())
        .await
        .unwrap();
    let mut r = FrameReader::new(r);
    let m = expect_error_then_close(&mut r).await;
    assert!(m.contains("Hello"), "{m}");

    // Wrong protocol version.
    let (r, mut w) = UnixStream::connect(agent()).await.unwrap().into_split();
    let hello = ClientMessage::Hello(Hello {
        protocol_version: 999,
        client: "x".into(),
        host_time_ns: None,
    });
    w.write_all(&encode_frame(&hello).unwrap()).await.unwrap();
    let mut r = FrameReader::new(r);
    let m = expect_error_then_close(&mut r).await;
    assert!(m.contains("version"), "{m}");

    // The other connection and new ones still work.
    other.send_stdin(b"alive\n").await.unwrap();
    let mut seen = String::new();
    read_until(&mut other, "still alive", &mut seen).await;
    assert!(conn().await.health().await.is_ok());
}

#[tokio::test]
async fn list_ports_sees_a_loopback_listener() {
    let l4 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let p4 = l4.local_addr().unwrap().port();
    let l6 = std::net::TcpListener::bind("[::1]:0").ok();
    let ports = conn().await.list_ports().await.unwrap();
    assert!(
        ports
            .iter()
            .any(|p| p.port == p4 && p.address.to_string() == "127.0.0.1" && !p.ipv6),
        "{p4} not in {ports:?}"
    );
    if let Some(l6) = l6 {
        let p6 = l6.local_addr().unwrap().port();
        assert!(ports
            .iter()
            .any(|p| p.port == p6 && p.address.to_string() == "::1" && p.ipv6));
    }
}

#[tokio::test]
async fn health_reports() {
    let c = conn().await;
    assert_eq!(c.agent_version(), env!("CARGO_PKG_VERSION"));
    let h = c.health().await.unwrap();
    assert!(h.agent_rss_bytes > 0);
    assert!(h.uptime_ms > 0);
    assert!(h.mem_total_kib > 0);
}

#[tokio::test]
async fn hybrid_handshake_and_shutdown() {
    // A fake VMM socket: answers the CONNECT line, then relays to the agent.
    let dir = tempfile::tempdir().unwrap();
    let vmm = dir.path().join("vsock.sock");
    let agent_sock = dir.path().join("own-agent.sock");
    let listener = tokio::net::UnixListener::bind(&vmm).unwrap();
    let agent_path = agent_sock.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
    // Its own agent, so Shutdown does not stop the shared one.
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = server::Listener::bind(&ListenAddr::Unix(agent_path)).unwrap();
            // Said once it listens: its socket file exists a moment before that.
            let _ = bound_tx.send(());
            server::serve(l, ServerConfig::default()).await.unwrap();
        });
        let _ = stop_tx.send(());
    });
    tokio::time::timeout(Duration::from_secs(10), bound_rx)
        .await
        .expect("the test's own agent listens within 10 s")
        .unwrap();
    let relay_target = agent_sock.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let target = relay_target.clone();
            tokio::spawn(async move {
                use tokio::io::AsyncBufReadExt;
                let mut line = Vec::new();
                let mut br = tokio::io::BufReader::new(&mut s);
                br.read_until(b'\n', &mut line).await.unwrap();
                assert_eq!(line, b"CONNECT 1024\n");
                s.write_all(b"OK 1234\n").await.unwrap();
                let t = UnixStream::connect(target).await.unwrap();
                // Each way on its own, as the VMM's vsock does: the client's last
                // frame (StdinEof, after the command ended) may find the agent gone,
                // and what the agent sent before must still arrive.
                byte_relay::both_ways(s, t).await;
            });
        }
    });
    let c = guest_agent::client::connect_hybrid(&vmm, 1024)
        .await
        .unwrap();
    let out = c
        .exec(sh("echo via-hybrid"))
        .await
        .unwrap()
        .output(b"")
        .await
        .unwrap();
    assert_eq!(out.stdout, b"via-hybrid\n");
    guest_agent::client::connect_hybrid(&vmm, 1024)
        .await
        .unwrap()
        .shutdown()
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), stop_rx)
        .await
        .unwrap()
        .unwrap();
}

/// A command run as another account gets that account's group ids and no other:
/// not the agent's primary group (root's 0), nor any supplementary group the agent
/// holds. (Review: dropping the `setgid` or the `setgroups` before `setuid` in
/// `server.rs` left every other test passing; `exec_env_cwd_and_user` checks the
/// uid alone.)
#[tokio::test]
async fn a_command_as_another_user_has_that_users_groups_only() {
    let nobody = guest_agent::users::lookup("nobody").expect("this machine has no 'nobody'");
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the agent must run as root");
    // Give the agent (this process; glibc applies setgroups to every thread) a
    // supplementary group the command must not keep: `adm` (4) on Debian.
    let extra: libc::gid_t = 4;
    assert!(!nobody.groups.contains(&extra));
    // SAFETY: one gid from a local array.
    assert_eq!(unsafe { libc::setgroups(1, [extra].as_ptr()) }, 0);
    let mut req = sh("id -g; id -G");
    req.user = User::Named("nobody".into());
    req.cwd = Some("/".into());
    let out = run(req, b"").await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some(nobody.gid.to_string().as_str()),
        "{text:?}"
    );
    let mut got: Vec<u32> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .map(|g| g.parse().unwrap())
        .collect();
    got.sort();
    let mut want = nobody.groups.clone();
    want.sort();
    want.dedup();
    assert_eq!(got, want, "{text:?}");
}

/// A command's environment is the one the agent builds (the account's variables and
/// the request's), nothing of the agent's own. (Review: dropping `env_clear()` in
/// `server.rs` left every other test passing: they look only at the variables they
/// set.)
#[tokio::test]
async fn a_command_gets_none_of_the_agents_own_environment() {
    // Any test run has PATH and HOME; cargo sets CARGO_PKG_NAME on the test binary.
    assert!(std::env::var_os("CARGO_PKG_NAME").is_some());
    let req = ExecRequest {
        argv: vec!["/usr/bin/env".into()],
        env: vec![("FOO".into(), "bar".into())],
        ..Default::default()
    };
    let out = run(req, b"").await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut names: Vec<&str> = text
        .lines()
        .map(|line| line.split('=').next().unwrap_or_default())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["FOO", "HOME", "LANG", "LOGNAME", "PATH", "SHELL", "USER"],
        "{text}"
    );
}

/// A command starts with the umask the request names (the host's), else the agent's.
#[tokio::test]
async fn commands_start_with_the_umask_asked_for() {
    let umask_of = |umask: Option<u32>| async move {
        let req = ExecRequest {
            umask,
            ..sh("umask")
        };
        String::from_utf8_lossy(&run(req, b"").await.stdout).into_owned()
    };
    assert_eq!(umask_of(Some(0o002)).await, "0002\n");
    assert_eq!(umask_of(Some(0o077)).await, "0077\n");
    // SAFETY: umask only sets this process's mask; set back at once.
    let agents = unsafe {
        let mask = libc::umask(0o022);
        libc::umask(mask);
        mask
    };
    assert_eq!(umask_of(None).await, format!("{agents:04o}\n"));
}

/// Commands run in UTF-8 (`LANG=C.UTF-8`, the image's built-in locale), as an ssh
/// session would, unless the request names a locale. (Review: with no LANG at all,
/// `ls` showed `café` as `'caf'$'\303\251'`, and less and vim garbled it.)
#[tokio::test]
async fn commands_run_in_utf8_unless_asked_otherwise() {
    let lang_of = |env: Vec<(String, Vec<u8>)>| async move {
        let req = ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), "echo \"$LANG\"".into()],
            env,
            ..Default::default()
        };
        String::from_utf8_lossy(&run(req, b"").await.stdout).into_owned()
    };
    assert_eq!(lang_of(Vec::new()).await, "C.UTF-8\n");
    assert_eq!(lang_of(vec![("LANG".into(), b"C".to_vec())]).await, "C\n");
}

/// A variable name execve would split or cut (empty, holding `=` or NUL), or a value
/// holding NUL, is refused rather than passed on as some other variable.
#[tokio::test]
async fn an_environment_variable_execve_cannot_carry_is_refused() {
    for (name, value) in [
        ("A=B", b"x".to_vec()),
        ("", b"x".to_vec()),
        ("A\0B", b"x".to_vec()),
        ("A", b"x\0y".to_vec()),
    ] {
        let req = ExecRequest {
            argv: vec!["/usr/bin/env".into()],
            env: vec![(name.into(), value)],
            ..Default::default()
        };
        let refused = conn().await.exec(req).await;
        let Err(error) = refused else {
            panic!("{name:?} was accepted");
        };
        assert!(
            error.to_string().contains("invalid environment variable"),
            "{name:?}: {error}"
        );
    }
}

/// A refusal that quotes what the client sent is cut to fit in a frame: an
/// environment variable's name of 600,000 NULs is quoted as `\0` each (1.2 MB), a
/// program's name of 400,000 bytes that are not UTF-8 as U+FFFD each (1.2 MB), and
/// either reply, over the 1 MiB a frame may hold, was not sent: the client saw the
/// connection close with no word why.
#[tokio::test]
async fn a_refusal_quoting_a_huge_request_still_reaches_the_client() {
    let req = ExecRequest {
        argv: vec!["/usr/bin/env".into()],
        env: vec![("\0".repeat(600_000), b"x".to_vec())],
        ..Default::default()
    };
    let refused = conn().await.exec(req).await.err().unwrap();
    assert!(
        matches!(&refused, ClientError::Agent(m)
            if m.contains("invalid environment variable") && m.len() < 2_000),
        "{}",
        refused.to_string().chars().take(300).collect::<String>()
    );
    let req = ExecRequest {
        argv: vec![vec![0xff; 400_000]],
        ..Default::default()
    };
    let refused = conn().await.exec(req).await.err().unwrap();
    let message = match &refused {
        ClientError::Agent(m) | ClientError::NotStarted { message: m, .. } => m,
        other => panic!(
            "{}",
            other.to_string().chars().take(300).collect::<String>()
        ),
    };
    assert!(
        message.len() < 2_000 && message.contains('\u{fffd}'),
        "{}",
        message.chars().take(300).collect::<String>()
    );
}
