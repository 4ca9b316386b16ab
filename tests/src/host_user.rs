//! Running `vmctl` as a normal (non-root) user, the way people run it, when the tests
//! themselves run as root (as on our CI machines).
//!
//! As root, the tests use a system user `vmctl-test`, created on first use (in the
//! `kvm` group where there is one, for hardware KVM). vmctl then cannot read root's
//! build cache (`~/.cache/vmctl` under a private `/root`), so the artifacts it needs are
//! handed to it through its override variables, hard-linked (or copied) into a
//! directory the user can read. As any other user, the tests run as that user.

use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use crate::TempDir;

/// The user the tests create when they run as root.
pub const TEST_USER: &str = "vmctl-test";

/// A host user that `vmctl` runs as.
#[derive(Debug, Clone)]
pub struct HostUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

impl HostUser {
    /// Whether this is the user the tests run as (no switch needed).
    pub fn is_current(&self) -> bool {
        self.uid == current_uid()
    }
}

/// The effective uid of this process (the owner of its /proc entry).
pub fn current_uid() -> u32 {
    fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or_else(|e| panic!("cannot stat /proc/self to learn this process's uid: {e}"))
}

/// A user without root's privileges: this process's user if it is not root, else
/// [`TEST_USER`], created on first use.
pub fn unprivileged_user() -> &'static HostUser {
    static USER: OnceLock<HostUser> = OnceLock::new();
    USER.get_or_init(|| {
        if current_uid() != 0 {
            let name = command_output("id", &["-un"]);
            return HostUser {
                name,
                uid: current_uid(),
                gid: parse_id(&command_output("id", &["-g"])),
            };
        }
        if !Command::new("id")
            .args(["-u", TEST_USER])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            create_test_user();
        }
        HostUser {
            name: TEST_USER.to_string(),
            uid: parse_id(&command_output("id", &["-u", TEST_USER])),
            gid: parse_id(&command_output("id", &["-g", TEST_USER])),
        }
    })
}

fn create_test_user() {
    eprintln!("vm-tests: creating the system user {TEST_USER} to run vmctl as a normal user");
    let mut useradd = Command::new("useradd");
    useradd.args([
        "--system",
        "--user-group",
        "--no-create-home",
        "--shell",
        "/usr/sbin/nologin",
    ]);
    let has_kvm_group = fs::read_to_string("/etc/group")
        .is_ok_and(|groups| groups.lines().any(|line| line.starts_with("kvm:")));
    if has_kvm_group {
        useradd.args(["--groups", "kvm"]);
    }
    let status = useradd
        .arg(TEST_USER)
        .status()
        .unwrap_or_else(|e| panic!("cannot run useradd to create {TEST_USER}: {e}"));
    // Another test process may have created it meanwhile (exit code 9: name in use).
    assert!(
        status.success() || status.code() == Some(9),
        "useradd {TEST_USER} failed ({status}); create the user by hand or run the tests as a non-root user"
    );
}

fn command_output(program: &str, args: &[&str]) -> String {
    crate::host_output(program, args, None).trim().to_string()
}

fn parse_id(text: &str) -> u32 {
    text.parse()
        .unwrap_or_else(|e| panic!("id printed {text:?}, not a number: {e}"))
}

/// Gives `path` (recursively) to `user`.
pub fn give_to(path: &Path, user: &HostUser) {
    let status = Command::new("chown")
        .arg("-R")
        .arg(format!("{}:{}", user.uid, user.gid))
        .arg(path)
        .status()
        .unwrap_or_else(|e| panic!("cannot run chown: {e}"));
    assert!(status.success(), "chown -R {} failed", path.display());
}

/// The command that runs `program` as `user`, with the user's groups: through
/// `setpriv` (util-linux) when that is another user.
pub fn command_as(user: &HostUser, program: &Path) -> Command {
    if user.is_current() {
        return Command::new(program);
    }
    let mut command = Command::new("setpriv");
    command
        .arg(format!("--reuid={}", user.uid))
        .arg(format!("--regid={}", user.gid))
        .arg("--init-groups")
        .arg("--")
        .arg(program);
    command
}

/// The override variables (`VMCTL_KERNEL`, ...) that let `user` run `vmctl` with this
/// process's artifacts, hard-linked into `dir` where the user can read them. Empty for
/// this process's own user, whose cache vmctl finds by itself.
pub fn artifact_env(user: &HostUser, dir: &TempDir) -> Vec<(&'static str, PathBuf)> {
    if user.is_current() {
        return Vec::new();
    }
    // What scripts/test.sh resolved, else the build scripts' (cached) outputs.
    let resolved = |variable: &str, script: &str, args: &[&str]| {
        crate::env_path(variable).unwrap_or_else(|| crate::build_artifact(script, args))
    };
    let mut artifacts = vec![
        ("VMCTL_KERNEL", crate::kernel().to_path_buf()),
        (
            "VMCTL_AGENT_INITRAMFS",
            resolved(
                "VMCTL_AGENT_INITRAMFS",
                "guest-agent/build-initramfs.sh",
                &[],
            ),
        ),
        (
            "VMCTL_ROOTFS",
            resolved("VMCTL_ROOTFS", "rootfs/build-rootfs.sh", &[]),
        ),
        ("VMCTL_VIRTIOFSD", find_virtiofsd()),
    ];
    if !crate::hardware_kvm() {
        artifacts.push((
            "VMCTL_NESTED_KERNEL",
            resolved(
                "VMCTL_NESTED_KERNEL",
                "kernel-config/build.sh",
                &["nested-host"],
            ),
        ));
    }
    artifacts
        .into_iter()
        .map(|(variable, source)| {
            let name = source.file_name().unwrap_or_default();
            let shared = dir.join(format!("{variable}-{}", name.to_string_lossy()));
            link_or_copy(&source, &shared);
            (variable, shared)
        })
        .collect()
}

/// virtiofsd as vmctl would find it for this process: `VMCTL_VIRTIOFSD`, PATH, then
/// `~/.cargo/bin`.
fn find_virtiofsd() -> PathBuf {
    if let Some(explicit) = std::env::var_os("VMCTL_VIRTIOFSD").filter(|v| !v.is_empty()) {
        return PathBuf::from(explicit);
    }
    let cargo_bin = std::env::var_os("HOME")
        .map(|home| Path::new(&home).join(".cargo/bin/virtiofsd"))
        .unwrap_or_default();
    crate::find_executable(Path::new("virtiofsd"))
        .or_else(|| cargo_bin.is_file().then_some(cargo_bin))
        .unwrap_or_else(|| {
            panic!("virtiofsd not found on PATH or in ~/.cargo/bin; run scripts/setup.sh")
        })
}

/// A hard link where possible (same filesystem: instant, no space); else a copy.
fn link_or_copy(source: &Path, target: &Path) {
    if fs::hard_link(source, target).is_ok() {
        return;
    }
    eprintln!(
        "vm-tests: copying {} for the test user (it cannot be hard-linked into {})",
        source.display(),
        target.display()
    );
    fs::copy(source, target).unwrap_or_else(|e| {
        panic!(
            "cannot copy {} to {}: {e}",
            source.display(),
            target.display()
        )
    });
}

/// The environment a login of `user` would have, for what vmctl reads from it.
pub fn login_env(user: &HostUser, home: &Path) -> Vec<(&'static str, OsString)> {
    vec![
        ("HOME", home.as_os_str().to_owned()),
        ("USER", user.name.clone().into()),
        ("LOGNAME", user.name.clone().into()),
    ]
}
