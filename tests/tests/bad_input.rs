//! Bad input is rejected on the host, before any VM starts: exit code 1 (125 for the
//! commands that pass their command's code on: `exec`, `run`, ...), exactly one
//! `vmctl: error: ` line naming the problem, never a panic.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use vm_tests::{
    assert_no_panic, base_initramfs, find_executable, kernel, random_bytes, record_skip, vmctl_bin,
    Run, TempDir, Vmctl, BAD_INPUT_TIMEOUT,
};

/// `vmctl boot <args>` with the short timeout for input that must be rejected.
fn vmctl(args: &[&str]) -> Vmctl {
    let mut v = Vmctl::new();
    v.arg("boot").args(args).timeout(BAD_INPUT_TIMEOUT);
    v
}

fn kernel_str() -> &'static str {
    kernel().to_str().expect("kernel path is UTF-8")
}

fn initrd_str() -> &'static str {
    base_initramfs().to_str().expect("initramfs path is UTF-8")
}

/// Asserts a clean rejection whose error line contains one of `needles`
/// (case-insensitive); returns the error line.
fn assert_rejected(run: &Run, needles: &[&str]) -> String {
    let report = run.report();
    assert!(
        !run.timed_out,
        "vmctl did not reject the input (it ran until killed)\n{report}"
    );
    assert_no_panic(run);
    assert_eq!(run.code, Some(1), "expected exit code 1\n{report}");
    let lines: Vec<&str> = run
        .stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    let errors: Vec<&&str> = lines
        .iter()
        .filter(|l| l.starts_with("vmctl: error: "))
        .collect();
    assert_eq!(
        errors.len(),
        1,
        "expected exactly one 'vmctl: error: ' line\n{report}"
    );
    for line in &lines {
        assert!(
            line.starts_with("vmctl: "),
            "unexpected stderr line {line:?}\n{report}"
        );
    }
    let error = errors[0].to_string();
    let lower = error.to_lowercase();
    assert!(
        needles.iter().any(|n| lower.contains(&n.to_lowercase())),
        "the error should mention one of {needles:?}: {error:?}\n{report}"
    );
    assert!(
        !run.stdout.contains("Linux version"),
        "a guest started despite the bad input\n{report}"
    );
    error
}

#[test]
fn missing_kernel() {
    let dir = TempDir::new("bad");
    let missing = dir.join("no-such-vmlinux");
    let run = vmctl(&[
        "--kernel",
        missing.to_str().unwrap(),
        "--initrd",
        initrd_str(),
    ])
    .run();
    assert_rejected(&run, &[missing.to_str().unwrap()]);
}

#[test]
fn directory_as_kernel() {
    let dir = TempDir::new("bad");
    let d = dir.path().to_str().unwrap();
    let run = vmctl(&["--kernel", d, "--initrd", initrd_str()]).run();
    assert_rejected(&run, &[d, "directory"]);
}

#[test]
fn random_bytes_are_not_a_kernel() {
    let dir = TempDir::new("bad");
    let junk = dir.join("junk");
    fs::write(&junk, random_bytes(1 << 20)).unwrap();
    let run = vmctl(&["--kernel", junk.to_str().unwrap(), "--initrd", initrd_str()]).run();
    assert_rejected(&run, &["not a kernel"]);
}

#[test]
fn initrd_larger_than_memory() {
    let dir = TempDir::new("bad");
    let big = dir.join("big-initrd");
    fs::File::create(&big).unwrap().set_len(300 << 20).unwrap(); // sparse
    let run = vmctl(&[
        "--kernel",
        kernel_str(),
        "--initrd",
        big.to_str().unwrap(),
        "--memory",
        "256",
    ])
    .run();
    assert_rejected(&run, &["initrd"]);
}

#[test]
fn kernel_larger_than_memory() {
    // vmlinux is ~20 MiB and loads at 16 MiB physical: it cannot fit in 16 MiB.
    let run = vmctl(&[
        "--kernel",
        kernel_str(),
        "--initrd",
        initrd_str(),
        "--memory",
        "16",
    ])
    .run();
    assert_rejected(&run, &["memory"]);
}

#[test]
fn command_line_too_long() {
    let long = "x".repeat(3000);
    let run = vmctl(&[
        "--kernel",
        kernel_str(),
        "--initrd",
        initrd_str(),
        "--memory",
        "256",
        "--cmdline",
        &long,
    ])
    .run();
    assert_rejected(&run, &["command line"]);
}

#[test]
fn zero_cpus() {
    let run = vmctl(&[
        "--kernel",
        kernel_str(),
        "--initrd",
        initrd_str(),
        "--cpus",
        "0",
    ])
    .run();
    assert_rejected(&run, &["cpu"]);
}

#[test]
fn too_many_cpus() {
    let run = vmctl(&[
        "--kernel",
        kernel_str(),
        "--initrd",
        initrd_str(),
        "--cpus",
        "1000",
    ])
    .run();
    assert_rejected(&run, &["cpu"]);
}

#[test]
fn zero_memory() {
    let run = vmctl(&[
        "--kernel",
        kernel_str(),
        "--initrd",
        initrd_str(),
        "--memory",
        "0",
    ])
    .run();
    assert_rejected(&run, &["memory"]);
}

#[test]
fn absurd_memory() {
    let run = vmctl(&[
        "--kernel",
        kernel_str(),
        "--initrd",
        initrd_str(),
        "--memory",
        "100000000",
    ])
    .run();
    assert_rejected(&run, &["memory"]);
}

#[test]
fn kvm_device_missing() {
    let run = vmctl(&[
        "--kernel",
        kernel_str(),
        "--initrd",
        initrd_str(),
        "--memory",
        "256",
        "--nested",
        "never",
    ])
    .env("VMCTL_KVM_DEVICE", "/nonexistent/kvm")
    .run();
    assert_rejected(&run, &["/nonexistent/kvm"]);
}

#[test]
fn qemu_missing_for_nested_host() {
    let run = vmctl(&[
        "--kernel",
        kernel_str(),
        "--initrd",
        initrd_str(),
        "--memory",
        "256",
        "--nested",
        "always",
    ])
    .env("VMCTL_QEMU", "/nonexistent/qemu-system-x86_64")
    .run();
    assert_rejected(&run, &["qemu-system-x86"]);
}

#[test]
fn kvm_device_not_permitted() {
    const TEST: &str = "bad_input::kvm_device_not_permitted";
    let kvm = Path::new("/dev/kvm");
    let euid = fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(u32::MAX);
    let skip_reason = if euid != 0 {
        Some("needs root to run vmctl as another user".to_string())
    } else if find_executable(Path::new("setpriv")).is_none() {
        Some("setpriv (util-linux) is missing".to_string())
    } else {
        match fs::metadata(kvm) {
            Err(e) => Some(format!("{} is missing ({e})", kvm.display())),
            Ok(m) if m.mode() & 0o006 != 0 => Some(format!(
                "{} is accessible to everyone (mode {:o})",
                kvm.display(),
                m.mode()
            )),
            Ok(_) => None,
        }
    };
    if let Some(reason) = skip_reason {
        record_skip(TEST, &reason);
        return;
    }

    // Everything nobody needs, in a place nobody can read.
    let dir = TempDir::new("perm");
    let copy = |from: &Path, name: &str, mode: u32| {
        let to = dir.join(name);
        fs::copy(from, &to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
        fs::set_permissions(&to, fs::Permissions::from_mode(mode)).unwrap();
        to
    };
    let bin = copy(vmctl_bin(), "vmctl", 0o755);
    copy(&vmctl_bin().with_file_name("vmctl-vmm"), "vmctl-vmm", 0o755);
    let k = copy(kernel(), "vmlinux", 0o644);
    let i = copy(base_initramfs(), "initramfs.cpio.gz", 0o644);
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();

    let run = Vmctl::new()
        .program(&bin)
        .wrapper([
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ])
        .args(["boot", "--kernel"])
        .arg(&k)
        .arg("--initrd")
        .arg(&i)
        .args(["--memory", "256", "--nested", "never"])
        .env("HOME", dir.path())
        .env_remove("VMCTL_KVM_DEVICE")
        .timeout(BAD_INPUT_TIMEOUT + Duration::from_secs(30))
        .run();
    assert_rejected(&run, &["permission"]);
}

/// `program` as a user whose home, config, state and runtime directories are under
/// `home`, with stdin from /dev/null.
fn as_user_of(home: &Path, program: &Path) -> std::process::Command {
    let mut command = std::process::Command::new(program);
    command
        .env("HOME", home)
        .env("XDG_CONFIG_HOME", home.join("config"))
        .env("XDG_STATE_HOME", home.join("state"))
        .env("XDG_RUNTIME_DIR", home.join("run"))
        .stdin(std::process::Stdio::null());
    command
}

/// `vmctl ARGS` in `dir` as [`as_user_of`] `home`: its output and its stderr, which
/// must hold no panic.
fn vmctl_as_user_of(home: &Path, dir: &Path, args: &[&str]) -> (std::process::Output, String) {
    let output = as_user_of(home, vmctl_bin())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run vmctl");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    (output, stderr)
}

/// The home directory of the account running the tests, from the password database
/// (None when there is none, or no `getent` to ask).
fn account_home() -> Option<PathBuf> {
    let output = Command::new("sh")
        .args(["-c", "getent passwd \"$(id -u)\""])
        .output()
        .ok()?;
    let entry = String::from_utf8_lossy(&output.stdout).into_owned();
    let home = entry.trim_end().split(':').nth(5)?;
    (home.starts_with('/') && home != "/").then(|| PathBuf::from(home))
}

/// The names of the VM directories under the state of [`as_user_of`] `home`.
fn vm_dir_names(home: &Path) -> Vec<String> {
    fs::read_dir(home.join("state/vmctl/vms"))
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// vmctl's own output (here `vmctl policy ls`) into a pipe whose reader has gone
/// (`| head -1`) ends it quietly with 141, as SIGPIPE ends other tools; into a full
/// disk, with one error line and 1. Never a panic (println! would abort vmctl).
#[test]
fn output_that_cannot_be_written() {
    let home = TempDir::new("unwritable-output");
    let run = |stdout: std::process::Stdio| {
        let output = as_user_of(home.path(), vmctl_bin())
            .args(["policy", "ls"])
            .current_dir(home.path())
            .stdout(stdout)
            .output()
            .expect("run vmctl policy ls");
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(!stderr.contains("panicked"), "{stderr}");
        (output.status.code(), stderr)
    };

    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let (code, stderr) = run(writer.into());
    assert_eq!(code, Some(141), "{stderr}");
    assert_eq!(stderr, "");

    let full = fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("open /dev/full");
    let (code, stderr) = run(full.into());
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        "vmctl: error: cannot write to standard output: No space left on device (os error 28)"
    );
}

/// vmctl's messages into a stderr that cannot be written (its reader gone with a killed
/// parent, a full disk) are lost, not the end of vmctl: eprintln! would panic, and so
/// abort it (with SIGABRT) halfway through what it was doing. `vmctl rm` of a
/// workspace without a VM says so on stderr and succeeds.
#[test]
fn messages_that_cannot_be_written() {
    let home = TempDir::new("unwritable-stderr");
    let workspace = home.path().join("ws");
    fs::create_dir_all(&workspace).unwrap();
    let run = |stderr: std::process::Stdio| {
        as_user_of(home.path(), vmctl_bin())
            .arg("rm")
            .current_dir(&workspace)
            .stderr(stderr)
            .status()
            .expect("run vmctl rm")
    };
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let status = run(writer.into());
    assert_eq!(status.code(), Some(0), "into a pipe nobody reads: {status}");
    let full = fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("open /dev/full");
    let status = run(full.into());
    assert_eq!(status.code(), Some(0), "into a full disk: {status}");
}

/// A workspace or share refused before the VM starts: one error line, and no ghost
/// left in `vmctl ps` (it listed such a start as "starting" forever).
#[test]
fn refused_starts_leave_no_vm_behind() {
    let home = TempDir::new("refused-start");
    let workspace = home.path().join("ws");
    fs::create_dir_all(&workspace).unwrap();
    fs::create_dir_all(home.path().join("config/vmctl")).unwrap();
    let vmctl = |args: &[&str]| vmctl_as_user_of(home.path(), &workspace, args);
    fs::create_dir_all(home.path().join("data")).unwrap();
    let long_guest_path = format!("~/data:/data{}", "/d".repeat(1100));
    let home_dir = home.path().canonicalize().unwrap().display().to_string();
    // The runtime directory (XDG_RUNTIME_DIR, the user's alone): its sockets and
    // sign-ins stay out, as does anything in it.
    let runtime = home.path().join("run");
    fs::create_dir_all(runtime.join("containers")).unwrap();
    fs::set_permissions(&runtime, fs::Permissions::from_mode(0o700)).unwrap();
    for (args, says) in [
        (
            &["exec", "--mount", "/nonexistent", "--", "true"][..],
            "mount \"/nonexistent\": host directory /nonexistent",
        ),
        (
            &["exec", "--mount", "/tmp:/usr", "--", "true"][..],
            "a share there would hide the guest's /usr/bin",
        ),
        (
            &["exec", "--workspace", "/etc", "--", "true"][..],
            "the workspace /etc cannot be shared at its own path in the guest",
        ),
        (
            &["exec", "--mount", &long_guest_path, "--", "true"][..],
            "the guest paths of the VM's shares do not fit the guest kernel's command line",
        ),
        (
            &["run", "--mount", "/nonexistent", "--", "true"][..],
            "mount \"/nonexistent\": host directory /nonexistent",
        ),
        // The host's secrets stay out: the home directory, vmctl's own config.
        (
            &["exec", "--workspace", &home_dir, "--", "true"][..],
            &format!("{home_dir} cannot be shared with the guest: it is your home directory"),
        ),
        (
            &["exec", "--mount", "~/run/containers:/c:ro", "--", "true"][..],
            &format!("it is inside your runtime directory (your session's sockets and credentials, vmctl's sockets) {home_dir}/run"),
        ),
        (
            &["exec", "--mount", "~/config/vmctl:/cfg:ro", "--", "true"][..],
            &format!(
                "it is vmctl's config directory (secrets, egress policy) {home_dir}/config/vmctl"
            ),
        ),
    ] {
        let (output, stderr) = vmctl(args);
        assert_eq!(output.status.code(), Some(125), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    // HOME points elsewhere (here, to the test's): the account's own home is kept out
    // all the same.
    match account_home().and_then(|home| home.canonicalize().ok()) {
        Some(account_home) => {
            assert_ne!(account_home.display().to_string(), home_dir);
            let account_home = account_home.display().to_string();
            let (output, stderr) = vmctl(&["exec", "--workspace", &account_home, "--", "true"]);
            assert_eq!(output.status.code(), Some(125), "{stderr}");
            assert!(
                stderr.contains(&format!(
                    "{account_home} cannot be shared with the guest: it is your home directory"
                )),
                "{stderr}"
            );
        }
        None => vm_tests::record_check_not_made(
            "bad_input: the account's home kept out of shares",
            "the account running the tests has no home directory that exists, so keeping \
             it out of the guest cannot be tried",
        ),
    }
    let (ps, stderr) = vmctl(&["ps"]);
    assert!(ps.status.success(), "{stderr}");
    let listing = String::from_utf8_lossy(&ps.stdout);
    assert_eq!(listing.lines().count(), 1, "only the header: {listing}");
    // A refused `vmctl run` leaves not even its throwaway VM's directory.
    let left = vm_dir_names(home.path());
    assert!(!left.iter().any(|name| name.contains("-run")), "{left:?}");
    // The state directory is the user's alone (the VMs' logs, records, transcripts).
    let state = fs::metadata(home.path().join("state/vmctl")).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&state.permissions()) & 0o777,
        0o700
    );
}

/// Run from a directory that was removed under it, vmctl names that directory (the
/// shell's `$PWD`) in its one error line, not ".".
#[test]
fn a_removed_working_directory_is_named() {
    let home = TempDir::new("removed-cwd");
    let gone = home.path().join("gone");
    fs::create_dir_all(&gone).unwrap();
    let output = as_user_of(home.path(), Path::new("sh"))
        .args([
            "-c",
            "cd \"$1\" && rmdir \"$1\" && exec \"$2\" exec -- true",
        ])
        .args(["sh", gone.to_str().unwrap(), vmctl_bin().to_str().unwrap()])
        .output()
        .expect("run vmctl from a removed directory");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(125), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        format!(
            "vmctl: error: workspace {}: No such file or directory (os error 2); name an \
             existing directory, or run vmctl from one",
            gone.display()
        )
    );
}

/// Commands about a workspace that has no VM say so, and leave no VM directory behind
/// (they used to create an empty one each).
#[test]
fn commands_on_a_workspace_without_a_vm() {
    let home = TempDir::new("no-vm");
    let workspace = home.path().join("ws");
    fs::create_dir_all(&workspace).unwrap();
    let vmctl = |args: &[&str]| {
        let (output, stderr) = vmctl_as_user_of(home.path(), &workspace, args);
        (output.status.code(), stderr)
    };
    let ws = workspace.display();
    for (args, code, says) in [
        (
            &["stop"][..],
            0,
            format!("vmctl: no VM is running for {ws}"),
        ),
        (&["rm"], 0, format!("vmctl: {ws} has no VM")),
        (
            &["stop", "--workspace", &ws.to_string()],
            0,
            format!("vmctl: no VM is running for {ws}"),
        ),
        (
            &["ports"],
            1,
            format!("vmctl: error: no VM is running for {ws}; start it with 'vmctl up'"),
        ),
        (
            &["policy", "log"],
            0,
            format!("vmctl: the egress proxy of {ws}'s VM has logged nothing (yet)"),
        ),
    ] {
        let (got, stderr) = vmctl(args);
        assert_eq!(got, Some(code), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end(), says, "{args:?}");
    }
    let left = vm_dir_names(home.path());
    assert!(left.is_empty(), "VM directories left behind: {left:?}");
}

/// From a subdirectory of a repository, the commands about its VM and its settings
/// mean the repository's (the workspace `vmctl exec` uses there), not the
/// subdirectory's: a `vmctl policy allow` there used to go to a workspace no VM has.
#[test]
fn commands_from_a_subdirectory_mean_its_workspace() {
    let home = TempDir::new("subdirectory");
    let repo = home.path().join("repo");
    let deep = repo.join("src/deep");
    fs::create_dir_all(&deep).unwrap();
    fs::create_dir_all(repo.join(".git")).unwrap();
    let vmctl = |args: &[&str]| {
        let (output, stderr) = vmctl_as_user_of(home.path(), &deep, args);
        assert!(output.status.success(), "{args:?}: {stderr}");
        (String::from_utf8_lossy(&output.stdout).into_owned(), stderr)
    };
    let (_, stderr) = vmctl(&["stop"]);
    assert_eq!(
        stderr.trim_end(),
        format!("vmctl: no VM is running for {}", repo.display())
    );
    vmctl(&["policy", "allow", "example.com"]);
    let (rules, _) = vmctl(&["policy", "ls", "--workspace", repo.to_str().unwrap()]);
    assert!(
        rules.lines().any(|rule| rule.contains("example.com")),
        "the rule is not the repository's: {rules}"
    );
}

/// `vmctl logs` for a workspace that never had a VM says so, and creates nothing.
#[test]
fn logs_of_a_workspace_without_a_vm() {
    let home = TempDir::new("logs");
    let workspace = home.path().join("ws");
    fs::create_dir_all(&workspace).unwrap();
    let (output, stderr) = vmctl_as_user_of(home.path(), &workspace, &["logs"]);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        format!(
            "vmctl: error: {} has no VM, so no logs: start one with `vmctl up`",
            workspace.display()
        )
    );
    assert!(vm_dir_names(home.path()).is_empty());
    let (output, stderr) =
        vmctl_as_user_of(home.path(), &workspace, &["logs", "--previous", "--follow"]);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot be used with"), "{stderr}");
}

/// Another VM's guest may have left a symlink in its own workspace: a mount through
/// it, for this VM, is refused (it could lead anywhere on the host).
#[test]
fn a_mount_through_a_link_in_another_vms_share_is_refused() {
    let home = TempDir::new("other-vm-link");
    let workspace = home.path().join("ws");
    let other = home.path().join("other");
    let private = home.path().join("private");
    for dir in [&workspace, &other, &private] {
        fs::create_dir_all(dir).unwrap();
    }
    std::os::unix::fs::symlink(&private, other.join("data")).unwrap();
    let other = other.canonicalize().unwrap();
    let record = serde_json::json!({
        "workspace": other,
        "kernel": "/k",
        "initrd": "/i",
        "rootfs": "/r",
        "cpus": 1,
        "memory_mib": 256,
        "nested": false,
        "agent_cmdline": "",
        "started_at": 1,
        "shares": {
            "shares": [{ "host": other, "guest": other, "read_only": false }],
            "virtiofsd": "/usr/bin/virtiofsd"
        }
    });
    let other_vm = home.path().join("state/vmctl/vms/other-0000");
    fs::create_dir_all(&other_vm).unwrap();
    fs::write(other_vm.join("vm.json"), record.to_string()).unwrap();

    let mount = format!("{}:/data", other.join("data").display());
    let (output, stderr) = vmctl_as_user_of(
        home.path(),
        &workspace,
        &["exec", "--mount", &mount, "--", "true"],
    );
    assert_eq!(output.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{} is a symlink in {}, which a VM can write",
            other.join("data").display(),
            other.display()
        )),
        "{stderr}"
    );
}
