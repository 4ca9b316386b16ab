//! vmctl's commands that only change host files (no VM): the egress secrets and policy.

use std::io::Write;
use std::process::Stdio;
use vm_tests::watchdog::output_within;
use vm_tests::{stderr, Workspace};

#[test]
fn secrets_set_at_once_are_all_kept() {
    let ws = Workspace::new("secrets-at-once");
    // All waiting for their values, then all given them, so their reads and writes of
    // the store overlap.
    let mut setters: Vec<_> = (0..12)
        .map(|n| {
            ws.command(&["secret", "set", &format!("s{n}")])
                .args(["--host", &format!("api{n}.example.com")])
                .stdin(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("run vmctl secret set")
        })
        .collect();
    for (n, setter) in setters.iter_mut().enumerate() {
        let mut stdin = setter.stdin.take().expect("vmctl's stdin");
        stdin
            .write_all(format!("token-value-{n:04}").as_bytes())
            .expect("write the secret");
    }
    for setter in setters {
        let output = setter.wait_with_output().expect("vmctl secret set");
        assert!(output.status.success(), "{}", stderr(&output));
    }
    let listed = ws
        .command(&["secret", "ls"])
        .output()
        .expect("vmctl secret ls");
    let table = String::from_utf8_lossy(&listed.stdout);
    let kept = (0..12)
        .filter(|n| {
            table
                .lines()
                .any(|line| line.starts_with(&format!("s{n} ")))
        })
        .count();
    assert_eq!(kept, 12, "secrets lost to concurrent sets:\n{table}");
}

#[test]
fn a_secret_set_is_checked_before_its_value_is_read() {
    let ws = Workspace::new("secret-checks");
    // No value comes on stdin: a refusal must name the argument, not the empty value.
    let no_host = ws.set_secret("mine", &[], None);
    assert!(!no_host.status.success());
    assert!(stderr(&no_host).contains("--host"), "{}", stderr(&no_host));
    for host in ["*.com", "*.co.uk", "*.github.io"] {
        let broad = ws.set_secret("mine", &["--host", host], None);
        assert!(!broad.status.success(), "{host}");
        assert!(
            stderr(&broad).contains("where anyone can have one"),
            "{host}: {}",
            stderr(&broad)
        );
    }
    let stored = ws.set_secret("mine", &["--host", "*.example.com"], Some("value-one-1234"));
    assert!(stored.status.success(), "{}", stderr(&stored));
    assert!(
        stderr(&stored).contains("mine stored"),
        "{}",
        stderr(&stored)
    );
    let again = ws.set_secret("mine", &["--host", "*.example.com"], Some("value-two-1234"));
    assert!(
        stderr(&again).contains("mine replaced"),
        "{}",
        stderr(&again)
    );
}

#[test]
fn removing_a_rule_that_is_not_there_fails() {
    let ws = Workspace::new("policy-rm");
    let run = |args: &[&str]| ws.command(args).output().expect("run vmctl policy");
    let missing = run(&["policy", "rm", "nothere.example.com"]);
    assert_eq!(missing.status.code(), Some(1), "{}", stderr(&missing));
    assert!(
        stderr(&missing).contains("policy ls"),
        "{}",
        stderr(&missing)
    );
    assert!(run(&["policy", "allow", "pkg.example.com"])
        .status
        .success());
    let removed = run(&["policy", "rm", "pkg.example.com"]);
    assert!(removed.status.success(), "{}", stderr(&removed));
    assert!(
        stderr(&removed).contains("removed 1 rule"),
        "{}",
        stderr(&removed)
    );
}

#[test]
fn a_bad_mount_in_the_config_file_names_the_file() {
    let ws = Workspace::new("config-mount");
    let config = ws.write_config("mounts = [\"/nonexistent-vmctl-test:/data\"]\n");
    // Refused before anything boots (a kernel that is not there would stop it anyway).
    let up = ws
        .command(&["up"])
        .env("VMCTL_KERNEL", "/nonexistent-vmctl-test/vmlinux")
        .output()
        .expect("run vmctl up");
    assert!(!up.status.success());
    let said = stderr(&up);
    assert!(
        said.contains(&format!("{}: in 'mounts'", config.display()))
            && said.contains("/nonexistent-vmctl-test"),
        "{said}"
    );
}

/// A config file that does not parse is said once, on one line, by a command that
/// would start a VM: not first as a warning while finding the workspace, then again as
/// the start's refusal.
#[test]
fn a_broken_config_file_is_one_error_said_once() {
    let ws = Workspace::new("config-broken");
    let config = ws.write_config("mounts = [\n");
    // (`up` runs no command of the user's, so its own failures are its 1.)
    for (args, code) in [
        (&["exec", "--", "true"][..], 125),
        (&["agent", "claude"], 125),
        (&["up"], 1),
    ] {
        let output = ws
            .command(args)
            .env("VMCTL_KERNEL", "/nonexistent-vmctl-test/vmlinux")
            .output()
            .expect("run vmctl");
        let said = stderr(&output);
        assert_eq!(output.status.code(), Some(code), "{args:?}: {said}");
        let naming = format!("{}, line 2", config.display());
        assert_eq!(said.matches(&naming).count(), 1, "{args:?}: {said}");
        assert_eq!(said.trim_end().lines().count(), 1, "{args:?}: {said}");
    }
}

#[test]
fn a_file_is_no_workspace() {
    let ws = Workspace::new("file-workspace");
    let file = ws.path().join("notes.txt");
    std::fs::write(&file, "x").unwrap();
    let up = ws
        .command(&["up", file.to_str().unwrap()])
        .env("VMCTL_KERNEL", "/nonexistent-vmctl-test/vmlinux")
        .output()
        .expect("run vmctl up");
    assert_eq!(up.status.code(), Some(1));
    assert!(stderr(&up).contains("not a directory"), "{}", stderr(&up));
}

#[test]
fn publishing_from_a_directory_that_is_not_there_says_so() {
    let ws = Workspace::new("publish-missing");
    let missing = ws.path().join("gone");
    let publish = ws
        .command(&["publish", missing.to_str().unwrap(), "8080"])
        .output()
        .expect("run vmctl publish");
    assert_eq!(publish.status.code(), Some(1));
    assert!(
        stderr(&publish).contains("no such directory"),
        "{}",
        stderr(&publish)
    );
}

/// `vmctl policy log` only reads the VM's egress log, and a malformed policy.json is
/// exactly when one wants to read why the proxy refuses everything ("deny everything:
/// the policy file ... is malformed"): the log must not be refused for it.
#[test]
fn the_egress_log_can_be_read_while_the_policy_file_is_malformed() {
    let ws = Workspace::new("policy-log-bad-policy");
    std::fs::create_dir_all(ws.config_dir()).expect("config dir");
    std::fs::write(ws.config_dir().join("policy.json"), "{\"rules\": [")
        .expect("write a malformed policy");
    let workspace = ws.path();
    let log = ws
        .command(&["policy", "log", "--workspace", workspace.to_str().unwrap()])
        .output()
        .expect("run vmctl policy log");
    assert!(
        log.status.success() && !stderr(&log).contains("policy file"),
        "policy log refused over policy.json: {}",
        stderr(&log)
    );
}

/// README, "Workspace VMs": "Where a command takes `[DIR]`, `--workspace DIR` works
/// too". `publish` and `unpublish` take `[DIR]`.
#[test]
fn publish_takes_workspace_dir_as_the_readme_says() {
    let ws = Workspace::new("publish-workspace-flag");
    let workspace = ws.path();
    for args in [
        &[
            "publish",
            "--workspace",
            workspace.to_str().unwrap(),
            "3000",
        ][..],
        &[
            "unpublish",
            "--workspace",
            workspace.to_str().unwrap(),
            "3000",
        ],
    ] {
        let output = ws.command(args).output().expect("run vmctl");
        // Without a VM it must fail for that reason, not refuse the option.
        assert!(
            output.status.code() == Some(1)
                && stderr(&output)
                    .contains(&format!("no VM is running for {}", workspace.display())),
            "{args:?}: {:?} {}",
            output.status.code(),
            stderr(&output)
        );
    }
}

/// Paseo (a desktop app, a systemd user service) runs `vmctl agent claude` with the
/// PATH it has, which need not hold ~/.cargo/bin. Once `scripts/setup.sh` has built
/// and cached the guest agent, starting a VM must not need cargo on PATH (the agent's
/// build script once died with "'cargo' is missing: install Rust" at every start).
#[test]
fn a_vm_starts_without_cargo_on_path_once_set_up() {
    vm_tests::vm_scenario(
        "host_commands::a_vm_starts_without_cargo_on_path_once_set_up",
        start_without_cargo_scenario,
    );
}

fn start_without_cargo_scenario() {
    let ws = Workspace::new("no-cargo-on-path");
    // Without `VMCTL_AGENT_INITRAMFS` (scripts/test.sh sets it), vmctl runs the agent's
    // build script, as it does for Paseo; `CARGO` naming no program stands for a
    // machine whose cargo is nowhere (not even in ~/.cargo/bin, where the script
    // would otherwise find it).
    let output = output_within(
        ws.command(&["exec", "--", "true"])
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .env_remove("VMCTL_AGENT_INITRAMFS")
            .env("CARGO", "/nonexistent/cargo"),
        "vmctl exec -- true, without cargo on PATH",
    );
    ws.run(&["rm", "-f"]);
    let said = stderr(&output);
    assert!(
        output.status.success() && !said.contains("is missing"),
        "{said}"
    );
    assert!(
        said.contains("is not on PATH: packing the agent built before"),
        "the agent's build script did not run without cargo: {said}"
    );
}

/// With the VM already running, `exec` still checks its `--mount` (a typo such as
/// `:RO`) and reads the config file: a broken config.toml that passed silently would
/// fail the next start instead, typically a Paseo agent's after the idle stop, far
/// from the edit.
#[test]
fn a_running_vm_still_reports_bad_mounts_and_a_broken_config() {
    vm_tests::vm_scenario(
        "host_commands::a_running_vm_still_reports_bad_mounts_and_a_broken_config",
        bad_input_on_a_running_vm_scenario,
    );
}

fn bad_input_on_a_running_vm_scenario() {
    let ws = Workspace::new("running-vm-bad-input");
    let data = ws.dir.join("data");
    std::fs::create_dir_all(&data).expect("data dir");
    let up = ws.run(&["exec", "--", "true"]);
    if !up.status.success() {
        ws.run(&["rm", "-f"]);
        panic!("the VM did not start: {}", stderr(&up));
    }
    let typo = format!("{}:/data:RO", data.display());
    let bad_mount = ws.run(&["exec", "--mount", &typo, "--", "true"]);
    ws.write_config("mount = [\"/x\"]\n");
    let bad_config = ws.run(&["exec", "--", "true"]);
    ws.run(&["rm", "-f"]);
    assert!(
        !bad_mount.status.success() && stderr(&bad_mount).contains("unknown option \"RO\""),
        "a bad --mount passed on a running VM: {}",
        stderr(&bad_mount)
    );
    assert!(
        !bad_config.status.success() && stderr(&bad_config).contains("vmctl config "),
        "a broken config.toml passed on a running VM: {}",
        stderr(&bad_config)
    );
}

/// `exec`, `run`, `shell` and `agent` exit with their command's code, so vmctl's own
/// failures (and wrong arguments) must exit with one a command rarely uses, 125 (as
/// docker and podman), or a caller takes "the VM would not start" for the command's 1.
#[test]
fn vmctls_own_failures_are_told_from_the_commands_by_exit_code_125() {
    let ws = Workspace::new("own-failure-code");
    let gone = ws.path().join("gone");
    let gone = gone.to_str().unwrap();
    for args in [
        &["exec", "--workspace", gone, "--", "true"][..],
        &["run", "--workspace", gone, "--", "true"],
        &["shell", gone],
        &["exec"],
        &["agent", "not-an-agent"],
    ] {
        let output = ws.command(args).output().expect("run vmctl");
        assert_eq!(
            output.status.code(),
            Some(125),
            "{args:?}: {}",
            stderr(&output)
        );
    }
    // The other commands keep 1 and clap's 2.
    let logs = ws
        .command(&["logs", gone])
        .output()
        .expect("run vmctl logs");
    let ps = ws
        .command(&["ps", "--bogus"])
        .output()
        .expect("run vmctl ps");
    assert_eq!(
        (logs.status.code(), ps.status.code()),
        (Some(1), Some(2)),
        "{}{}",
        stderr(&logs),
        stderr(&ps)
    );
}
