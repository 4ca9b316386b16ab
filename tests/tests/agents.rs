//! Agents launched into VMs the way Paseo launches them, and the daemon that owns the
//! VMs' lifetimes.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use vm_tests::watchdog::{output_within, wait_within, Watchdog};
use vm_tests::{assert_ok, stdout, upstream, Workspace};

const STANDIN: &str = include_str!("../guest/standin_agent.py");

/// Puts the stand-in CLI in the workspace as `bin/claude` and makes the agents find it
/// first, through the user's env file (forwarded to agents).
fn install_standin(ws: &Workspace) {
    let bin = ws.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let claude = bin.join("claude");
    std::fs::write(&claude, STANDIN).unwrap();
    std::fs::set_permissions(&claude, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir_all(ws.config_dir()).unwrap();
    std::fs::write(
        ws.config_dir().join("env"),
        format!(
            "PATH={}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nFORWARDED=yes\n",
            bin.display()
        ),
    )
    .unwrap();
}

/// Runs `argv` (a provider command plus the CLI's arguments) as Paseo does: in the
/// workspace, stdin piped, with `input` written then closed.
fn run_provider(ws: &Workspace, argv: &[String], input: &[u8]) -> Output {
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .current_dir(ws.path())
        .env("XDG_STATE_HOME", ws.state())
        .env("VMCTL_CONFIG", ws.config_dir().join("config.toml"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {argv:?}: {e}"));
    let bounded = Watchdog::new(&child, &format!("{argv:?}"));
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input).expect("write stdin");
    drop(stdin);
    let output = child.wait_with_output().expect("provider command");
    drop(bounded);
    eprintln!(
        "{argv:?} -> {:?}\nstdout: {}\nstderr: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

#[test]
fn paseo_providers_run_agents_in_the_workspace_vm() {
    vm_tests::vm_scenario(
        "agents::paseo_providers_run_agents_in_the_workspace_vm",
        provider_scenario,
    );
}

fn provider_scenario() {
    let ws = Workspace::new("agents");
    let root = ws.path().canonicalize().unwrap();
    let paseo = ws.dir.join("paseo/config.json");
    std::fs::create_dir_all(paseo.parent().unwrap()).unwrap();
    std::fs::write(&paseo, "{\n  \"daemon\": {\"port\": 6767}\n}\n").unwrap();
    let install = ws.run(&["paseo", "install", "--config", paseo.to_str().unwrap()]);
    assert_ok(&install, "vmctl paseo install");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&paseo).unwrap()).unwrap();
    assert_eq!(
        config["daemon"]["port"], 6767,
        "the rest of the config was kept"
    );
    let command = |provider: &str| -> Vec<String> {
        config["agents"]["providers"][provider]["command"]
            .as_array()
            .unwrap_or_else(|| panic!("no command for {provider}: {config}"))
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    let (claude, codex) = (command("claude-vm"), command("codex-vm"));
    assert_eq!(
        config["agents"]["providers"]["claude-vm"]["extends"],
        "claude"
    );

    // The real CLIs answer through the provider path.
    for (provider, name) in [(&claude, "Claude Code"), (&codex, "codex")] {
        let argv = [provider.clone(), vec!["--version".into()]].concat();
        let version = run_provider(&ws, &argv, b"");
        assert_ok(&version, &format!("{name} --version"));
        assert!(
            stdout(&version)
                .to_lowercase()
                .contains(&name.to_lowercase()),
            "{}",
            stdout(&version)
        );
    }

    // What Claude's SDK passes, with an MCP server on the host's loopback; the
    // stand-in answers in place of a model.
    let mcp = upstream::start(None);
    let mcp_config = format!(
        r#"{{"mcpServers":{{"paseo":{{"type":"http","url":"http://127.0.0.1:{}/mcp/agents?agent=a1","headers":{{"Authorization":"Bearer test-token"}}}}}}}}"#,
        mcp.addr.port()
    );
    install_standin(&ws);
    let sdk_args: Vec<String> = [
        "--output-format",
        "stream-json",
        "--verbose",
        "--input-format",
        "stream-json",
        "--mcp-config",
        &mcp_config,
        "--permission-mode",
        "default",
        "--exit-with",
        "7",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let lines = concat!(
        r#"{"type":"user","message":{"role":"user","content":"héllo \u00e9 \"quoted\""}}"#,
        "\n",
        r#"{"type":"control_request","request_id":"r1","request":{"subtype":"interrupt"}}"#,
        "\n",
    );
    let run = run_provider(
        &ws,
        &[claude.clone(), sdk_args.clone()].concat(),
        lines.as_bytes(),
    );
    assert_eq!(run.status.code(), Some(7), "the exit code is passed on");
    assert_eq!(
        run.stdout,
        lines.as_bytes(),
        "stdio must round-trip byte for byte"
    );

    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("standin.json")).unwrap()).unwrap();
    let argv: Vec<&str> = record["argv"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(argv, sdk_args, "the CLI got its arguments unchanged");
    assert_eq!(record["cwd"], root.display().to_string());
    assert_eq!(record["stdin_is_tty"], false);
    assert_eq!(record["env"]["FORWARDED"], "yes");
    assert_eq!(
        record["env"]["IS_SANDBOX"], "1",
        "Claude must know the VM is its sandbox"
    );
    assert!(record["env"]["CLAUDE_CONFIG_DIR"].is_string(), "{record}");
    assert_eq!(
        record["mcp"][0]["status"], 200,
        "MCP not reachable: {record}"
    );
    assert!(mcp
        .seen
        .requests()
        .iter()
        .any(|r| r.starts_with("GET /mcp/agents?agent=a1")));

    // Isolation: a subdirectory of the workspace (a git repository) uses its VM; with
    // --isolation directory it gets a VM of its own.
    std::fs::create_dir_all(root.join(".git")).unwrap();
    let sub = root.join("sub");
    std::fs::create_dir_all(&sub).unwrap();
    let in_sub = |args: &[&str]| {
        let output = output_within(
            ws.command(args).current_dir(&sub),
            &format!("vmctl {args:?} in sub/"),
        );
        assert_ok(&output, &format!("vmctl {args:?} in sub/"));
        stdout(&output)
    };
    assert_eq!(
        in_sub(&["exec", "--", "pwd"]).trim(),
        sub.display().to_string()
    );
    let running = |table: String| table.matches(" running ").count();
    assert_eq!(running(ps(&ws)), 1, "sub/ must share the workspace's VM");
    assert_eq!(
        in_sub(&["exec", "--isolation", "directory", "--", "pwd"]).trim(),
        sub.display().to_string()
    );
    assert_eq!(running(ps(&ws)), 2, "--isolation directory gets its own VM");
    // Its directory removed, `ps` says so, and the VM can still be named by the path
    // it had.
    std::fs::remove_dir_all(&sub).unwrap();
    let table = ps(&ws);
    assert!(
        table.contains(&format!("{} (removed)", sub.display()))
            && table.contains("1 VM(s) of directories since removed"),
        "{table}"
    );
    // `vmctl prune` leaves it while it runs, and says so.
    let prune = ws.run(&["prune"]);
    assert_ok(&prune, "vmctl prune");
    let said = String::from_utf8_lossy(&prune.stderr);
    assert!(said.contains("(removed) still runs"), "{said}");
    assert_eq!(running(ps(&ws)), 2, "prune stopped a running VM");
    assert_ok(
        &ws.run(&["rm", sub.to_str().unwrap()]),
        "vmctl rm of removed sub/",
    );
    assert_eq!(running(ps(&ws)), 1, "the removed directory's VM still runs");

    let uninstall = ws.run(&["paseo", "uninstall", "--config", paseo.to_str().unwrap()]);
    assert_ok(&uninstall, "vmctl paseo uninstall");
    let after: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&paseo).unwrap()).unwrap();
    assert_eq!(after, serde_json::json!({"daemon": {"port": 6767}}));
}

#[test]
fn vms_start_on_first_use_and_stop_when_idle() {
    vm_tests::vm_scenario(
        "agents::vms_start_on_first_use_and_stop_when_idle",
        lifecycle_scenario,
    );
}

/// `vmctl ps` output.
fn ps(ws: &Workspace) -> String {
    let output = ws.run(&["ps"]);
    assert_ok(&output, "vmctl ps");
    stdout(&output)
}

fn wait_for(ws: &Workspace, what: &str, timeout: Duration, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let table = ps(ws);
        if done(&table) {
            return table;
        }
        // Not "timed out", which would have the scenario retried as a VM the nested
        // host lost: what this waits for is the daemon's doing.
        assert!(
            Instant::now() < deadline,
            "still waiting after {timeout:?} for {what}:\n{table}\n{}",
            daemon_log_tail(ws)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The last lines of the workspace's daemon log: what the daemon decided (leases,
/// idle timers, the guest's sessions, stops) when a wait on it times out.
fn daemon_log_tail(ws: &Workspace) -> String {
    const LINES: usize = 40;
    let path = ws.state().join("vmctl/daemon.log");
    match std::fs::read_to_string(&path) {
        Ok(log) => {
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(LINES)..].join("\n");
            format!("{} (last {LINES} lines):\n{tail}", path.display())
        }
        Err(e) => format!("no daemon log at {}: {e}", path.display()),
    }
}

fn lifecycle_scenario() {
    let ws = Workspace::new("lifecycle");
    ws.write_config("idle_timeout_s = 5\n");
    install_standin(&ws);
    assert!(!ps(&ws).contains("running"), "no VM before the first use");

    // Two agents at once share one VM, started by the first.
    let spawn_agent = || {
        ws.command(&["agent", "claude", "--output-format", "stream-json"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("vmctl agent")
    };
    let mut first = spawn_agent();
    let mut second = spawn_agent();
    let table = wait_for(&ws, "two agents on one VM", vm_tests::vm_timeout(), |t| {
        t.matches("agent claude").count() == 2
    });
    assert_eq!(table.matches(" running ").count(), 1, "{table}");
    for agent in [&mut first, &mut second] {
        drop(agent.stdin.take());
        let status = wait_within(agent, "vmctl agent claude");
        assert!(status.success(), "{status:?}");
    }

    // Idle: it stops on its own, after the timeout, not at once.
    let ended = Instant::now();
    let table = ps(&ws);
    assert!(table.contains(" running "), "stopped at once:\n{table}");
    wait_for(&ws, "the idle VM to stop", Duration::from_secs(60), |t| {
        t.contains(" stopped ")
    });
    assert!(
        ended.elapsed() >= Duration::from_secs(4),
        "stopped before the idle timeout"
    );
    // And by the configured timeout, not the daemon's default (30 s), which a daemon
    // that missed the test's config would use: the checks below that the daemon does
    // not stop a VM too soon are worth something only with a timeout this short. Told
    // by the daemon's log, not by the clock: the stop itself may take a nested VM under
    // load more than the 25 s between the two timeouts (see `exited`).
    let log = std::fs::read_to_string(ws.state().join("vmctl/daemon.log")).unwrap_or_default();
    assert!(
        log.contains(" idle for 5s; stopping it"),
        "the daemon did not stop the VM after the configured idle_timeout_s = 5\n{}",
        daemon_log_tail(&ws)
    );

    // A `vmctl run` killed outright does not leave its throwaway VM running for good:
    // its lease ends with it, so the VM stops once idle; `vmctl prune` forgets it.
    let mut run = ws
        .command(&["run", "--", "sleep", "600"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("vmctl run");
    let throwaway_in = |table: &str, state: &str| {
        table
            .lines()
            .any(|line| line.contains("-run") && line.contains(&format!(" {state} ")))
    };
    wait_for(
        &ws,
        "the throwaway VM to run",
        Duration::from_secs(240),
        |t| throwaway_in(t, "running"),
    );
    run.kill().expect("SIGKILL vmctl run");
    let _ = run.wait();
    // Stopped, not only no longer running: while the idle stop holds its start lock
    // (`ps` says "stopping"), prune leaves it alone.
    wait_for(
        &ws,
        "the orphaned throwaway VM to stop",
        Duration::from_secs(90),
        |t| throwaway_in(t, "stopped"),
    );
    let prune = ws.run(&["prune"]);
    assert_ok(&prune, "vmctl prune");
    let said = String::from_utf8_lossy(&prune.stderr);
    assert!(said.contains("forgot the throwaway VM of"), "{said}");
    let table = ps(&ws);
    assert!(
        !table.contains("-run"),
        "prune left the throwaway VM:\n{table}"
    );

    // A daemon that dies (killed, crashed) loses its leases, and the one started next
    // adopts the VM without them: the session still under way keeps it running, as
    // the guest agent tells, and once the session ends the VM stops when idle.
    let mut sleeper = ws
        .command(&["exec", "--", "sleep", "600"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("vmctl exec");
    wait_for(&ws, "the session's VM", vm_tests::vm_timeout(), |t| {
        t.contains(" running ") && t.contains("exec")
    });
    let daemon = std::fs::read_to_string(ws.state().join("vmctl/daemon.pid"))
        .expect("the daemon's pid file");
    let daemon_pid = daemon.lines().next().expect("a pid").trim().to_string();
    let kill = Command::new("kill")
        .args(["-KILL", &daemon_pid])
        .status()
        .expect("kill");
    assert!(kill.success(), "kill -KILL {daemon_pid}");
    assert!(exited(&daemon_pid), "the daemon still runs");
    // A new daemon, started by the next session, adopts the VM.
    assert_ok(
        &ws.run(&["exec", "--", "true"]),
        "vmctl exec after the daemon died",
    );
    std::thread::sleep(Duration::from_secs(10));
    let table = ps(&ws);
    assert!(
        table.contains(" running ") && sleeper.try_wait().expect("vmctl exec").is_none(),
        "the new daemon stopped the VM under a session it held no lease for:\n{table}"
    );
    sleeper.kill().expect("SIGKILL vmctl exec");
    let _ = sleeper.wait();
    wait_for(
        &ws,
        "the VM to stop once its last session ended",
        Duration::from_secs(90),
        |t| t.contains(" stopped "),
    );

    // `vmctl up` pins the VM before its start begins; a start that takes a while
    // (here: another one holds the start lock for longer than the daemon takes to
    // forget VMs that do not run) must not lose the pin.
    let vm_dir = vm_tests::find_vm_dir(&ws.state()).expect("the VM's directory");
    let start_lock = std::fs::File::create(vm_dir.join("start.lock")).unwrap();
    start_lock.lock().unwrap();
    let mut up = ws.command(&["up"]).spawn().expect("vmctl up");
    std::thread::sleep(Duration::from_secs(7));
    drop(start_lock);
    assert!(wait_within(&mut up, "vmctl up").success(), "vmctl up");
    assert!(ps(&ws).contains("vmctl up"), "{}", ps(&ws));
    // A session on it does not undo the pin: past the idle timeout after the session
    // ended, it still runs, kept by `vmctl up`.
    assert_ok(
        &ws.run(&["exec", "--", "true"]),
        "vmctl exec on the pinned VM",
    );
    std::thread::sleep(Duration::from_secs(8));
    let table = ps(&ws);
    assert!(
        table.contains(" running ") && table.contains("vmctl up"),
        "the VM pinned by `vmctl up` stopped for idleness after a session:\n{table}"
    );
    // The daemon stopping stops every VM and leaves nothing behind.
    let daemon = std::fs::read_to_string(ws.state().join("vmctl/daemon.pid"))
        .expect("the daemon's pid file");
    let (daemon_pid, daemon_socket) = daemon.trim().split_once('\n').expect("pid and socket");
    assert_ok(&ws.run(&["daemon", "--stop"]), "vmctl daemon --stop");
    assert!(exited(daemon_pid.trim()), "the daemon still runs");
    assert!(
        !std::path::Path::new(daemon_socket).exists(),
        "its socket is left"
    );
    let daemon_lock = std::path::Path::new(daemon_socket).with_extension("lock");
    assert!(
        !daemon_lock.exists(),
        "its lock file {} is left",
        daemon_lock.display()
    );
    let table = ps(&ws);
    assert!(!table.contains(" running "), "{table}");
    let state = ws.state().display().to_string();
    let leftovers: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|p| std::fs::read(p.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&state))
        .collect();
    assert!(leftovers.is_empty(), "processes left behind: {leftovers:?}");
    let sockets: Vec<_> = walk(&ws.state())
        .into_iter()
        .filter(|p| {
            p.extension().is_some_and(|e| e == "sock") || p.to_string_lossy().contains(".sock_")
        })
        .collect();
    assert!(sockets.is_empty(), "sockets left behind: {sockets:?}");
}

/// Whether `pid` is gone (or a zombie nobody reaped yet) within 90 s.
fn exited(pid: &str) -> bool {
    // The daemon exits once every VM has stopped, which `vmctl stop` allows 10 s for
    // the agent's shutdown, 30 s for the VM to end and 2 s after SIGTERM: a nested
    // VM under load can take more than 10 s (seen in CI), and one the nested host
    // stalled takes that whole path, 42 s, before the nested host's own teardown
    // (CI once missed a 45 s bound).
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next());
        if stat.is_empty() || state == Some("Z") {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                found.extend(walk(&path));
            } else {
                found.push(path);
            }
        }
    }
    found
}
