//! The project's own build outputs (guest kernel, hello initramfs), built on first use
//! by the scripts in the source tree and cached outside it.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("{}: build script missing; set VMCTL_SOURCE_DIR to the vmctl source tree, or name a prebuilt file with {var}", .script.display())]
    ScriptMissing { script: PathBuf, var: &'static str },
    #[error("{var}={}: no such file; unset {var} to use the cached build", .path.display())]
    OverrideMissing { var: &'static str, path: PathBuf },
    #[error("cannot run {}: {source}", .script.display())]
    Spawn {
        script: PathBuf,
        source: std::io::Error,
    },
    #[error("{} failed ({status}); its messages are above", .script.display())]
    Failed {
        script: PathBuf,
        status: std::process::ExitStatus,
    },
    #[error("{} printed no usable path", .0.display())]
    NoPath(PathBuf),
}

/// What to build.
#[derive(Debug, Clone, Copy)]
pub enum Artifact {
    GuestKernel,
    NestedHostKernel,
    HelloInitramfs,
    /// The guest agent as /init of a small initramfs.
    AgentInitramfs,
    /// The shared read-only root filesystem of workspace VMs.
    RootfsImage,
}

impl Artifact {
    /// An environment variable that names a prebuilt file to use instead.
    fn override_env(self) -> &'static str {
        match self {
            Self::GuestKernel => "VMCTL_KERNEL",
            Self::NestedHostKernel => "VMCTL_NESTED_KERNEL",
            Self::HelloInitramfs => "VMCTL_INITRAMFS",
            Self::AgentInitramfs => "VMCTL_AGENT_INITRAMFS",
            Self::RootfsImage => "VMCTL_ROOTFS",
        }
    }

    fn script_and_args(self) -> (&'static str, &'static [&'static str], &'static str) {
        match self {
            Self::GuestKernel => ("kernel-config/build.sh", &["guest"], "guest kernel"),
            Self::NestedHostKernel => (
                "kernel-config/build.sh",
                &["nested-host"],
                "nested-host kernel",
            ),
            Self::HelloInitramfs => ("rootfs/build-initramfs.sh", &[], "hello initramfs"),
            Self::AgentInitramfs => ("guest-agent/build-initramfs.sh", &[], "guest agent"),
            Self::RootfsImage => ("rootfs/build-rootfs.sh", &[], "guest root filesystem"),
        }
    }
}

/// The source tree: `VMCTL_SOURCE_DIR`, else where this binary was built from.
pub fn source_dir() -> PathBuf {
    std::env::var_os("VMCTL_SOURCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
            dir.canonicalize().unwrap_or(dir)
        })
}

/// Where the build scripts keep what they build (kernels, images, the guest agent):
/// `VMCTL_CACHE_DIR`, else `$XDG_CACHE_HOME/vmctl`, else `~/.cache/vmctl`, as the
/// scripts decide it.
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_in(|name| std::env::var_os(name))
}

fn cache_dir_in(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    let set = |name| var(name).filter(|value| !value.is_empty());
    set("VMCTL_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| set("XDG_CACHE_HOME").map(|dir| PathBuf::from(dir).join("vmctl")))
        .or_else(|| set("HOME").map(|home| PathBuf::from(home).join(".cache/vmctl")))
}

/// Held while a build script may build: a start looks for its files at once, and their
/// builds (each on every CPU, one perhaps asking for sudo's password) go one at a time.
static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_build_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    // A build that panicked left nothing for the next to trust less.
    BUILDING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Returns the artifact's path: the file its override variable names, else the cached
/// build, building it first when needed (the build scripts show their progress).
pub fn ensure(artifact: Artifact) -> Result<PathBuf, ArtifactError> {
    let var = artifact.override_env();
    if let Some(path) = std::env::var_os(var).map(PathBuf::from) {
        if !path.is_file() {
            return Err(ArtifactError::OverrideMissing { var, path });
        }
        return Ok(path);
    }
    let (script, args, what) = artifact.script_and_args();
    let script = source_dir().join(script);
    if !script.is_file() {
        return Err(ArtifactError::ScriptMissing { script, var });
    }
    // The agent's script always runs: cargo decides quickly whether to rebuild.
    if !matches!(artifact, Artifact::AgentInitramfs) {
        let cached = run_script(&script, args, true, Unbuilt::EarlierMonth)?;
        if cached.is_file() {
            mark_used(&cached);
            return Ok(cached);
        }
    }
    let _building = one_build_at_a_time();
    if matches!(artifact, Artifact::AgentInitramfs) {
        // Usually a no-op rebuild check: quiet unless cargo has work to do, or it fails.
        return run_script_quietly(&script, args, |message| vmm::to_stderr!("vmctl: {message}"));
    }
    vmm::to_stderr!(
        "vmctl: building the {what} (first use, or its inputs changed; cached afterwards)"
    );
    run_script(&script, args, false, Unbuilt::EarlierMonth)
}

/// Marks the cache entry that holds `file` as used now: the build scripts remove
/// entries of old keys no start used for 30 days (`scripts/lib/cache.sh`).
fn mark_used(file: &Path) {
    let Some(entry) = file.parent() else { return };
    let marked =
        std::fs::File::open(entry).and_then(|dir| dir.set_modified(std::time::SystemTime::now()));
    if let Err(e) = marked {
        tracing::debug!("cannot mark {} as used: {e}", entry.display());
    }
}

/// A build script's command, told where vmctl's cache is, so that the script (run
/// under sudo, say) never decides otherwise.
fn script_command(script: &Path) -> Command {
    let mut command = Command::new(script);
    if let Some(cache) = cache_dir() {
        command.env("VMCTL_CACHE_DIR", cache);
    }
    command
}

/// Runs the guest agent's build script, its messages kept for a failure. Cargo at work
/// (vmctl's sources changed since the agent was last built, or it never was) takes a
/// minute or more, which would be a silent wait before the VM's boot: `announce` is
/// told so, once. The script's own warnings are passed on.
fn run_script_quietly(
    script: &Path,
    args: &[&str],
    mut announce: impl FnMut(&str),
) -> Result<PathBuf, ArtifactError> {
    let spawn_error = |source| ArtifactError::Spawn {
        script: script.to_path_buf(),
        source,
    };
    let mut child = script_command(script)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_error)?;
    let (Some(mut stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(spawn_error(std::io::Error::other("no pipes to the script")));
    };
    // Read beside stderr: the script blocks once either pipe is full.
    let stdout = std::thread::spawn(move || {
        let mut out = Vec::new();
        stdout.read_to_end(&mut out).map(|_| out)
    });
    let mut messages = String::new();
    let mut announced = false;
    for line in BufReader::new(stderr).split(b'\n') {
        let line = match line {
            Ok(line) => String::from_utf8_lossy(&line).into_owned(),
            Err(_) => break,
        };
        if !announced && cargo_is_at_work(&line) {
            announce(
                "building the guest agent (vmctl's sources changed since it was last \
                 built; this takes a minute or two)",
            );
            announced = true;
        }
        if line.contains(": warning: ") && !line.starts_with(' ') {
            announce(&line);
        }
        messages.push_str(&line);
        messages.push('\n');
    }
    let stdout = stdout.join().unwrap_or_else(|_| Ok(Vec::new()));
    let status = child.wait().map_err(spawn_error)?;
    if !status.success() {
        if !messages.trim().is_empty() {
            vmm::to_stderr!("{}", messages.trim_end());
        }
        return Err(ArtifactError::Failed {
            script: script.to_path_buf(),
            status,
        });
    }
    last_path(script, &stdout.map_err(spawn_error)?)
}

/// Whether a line of cargo's says it builds (or fetches, or waits for another build),
/// rather than finding everything up to date ("Finished" alone).
fn cargo_is_at_work(line: &str) -> bool {
    matches!(
        line.split_whitespace().next(),
        Some("Compiling" | "Downloading" | "Downloaded" | "Updating" | "Locking" | "Blocking")
    )
}

fn last_path(script: &Path, stdout: &[u8]) -> Result<PathBuf, ArtifactError> {
    String::from_utf8_lossy(stdout)
        .lines()
        .last()
        .map(|line| PathBuf::from(line.trim()))
        .filter(|path| path.is_absolute())
        .ok_or_else(|| ArtifactError::NoPath(script.to_path_buf()))
}

/// What a root image build that cannot be made (no root, a mirror down) gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unbuilt {
    /// The recipe's newest image of an earlier month, with a warning: a VM's start,
    /// which had better go on with last month's packages than not at all.
    EarlierMonth,
    /// An error: `vmctl image build`, asked for this month's image.
    Fails,
}

/// The variable that lets `rootfs/build-rootfs.sh` give an earlier month's image.
const ROOTFS_FALLBACK_ENV: &str = "VMCTL_ROOTFS_FALLBACK";

fn run_script(
    script: &Path,
    args: &[&str],
    print_only: bool,
    unbuilt: Unbuilt,
) -> Result<PathBuf, ArtifactError> {
    let mut command = script_command(script);
    command
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit());
    match unbuilt {
        Unbuilt::EarlierMonth => command.env(ROOTFS_FALLBACK_ENV, "1"),
        Unbuilt::Fails => command.env_remove(ROOTFS_FALLBACK_ENV),
    };
    if print_only {
        command.arg("--print-path");
    }
    let output = command.output().map_err(|source| ArtifactError::Spawn {
        script: script.to_path_buf(),
        source,
    })?;
    if !output.status.success() {
        return Err(ArtifactError::Failed {
            script: script.to_path_buf(),
            status: output.status,
        });
    }
    last_path(script, &output.stdout)
}

/// Builds the guest root image described by `recipe` (default: the project's default
/// recipe), showing the build's progress, and returns the image's path (an earlier
/// month's where this month's cannot be built, if `unbuilt` says so).
pub fn build_image(recipe: Option<&Path>, unbuilt: Unbuilt) -> Result<PathBuf, ArtifactError> {
    let script = source_dir().join("rootfs/build-rootfs.sh");
    if !script.is_file() {
        return Err(ArtifactError::ScriptMissing {
            script,
            var: Artifact::RootfsImage.override_env(),
        });
    }
    let recipe = recipe.map(|r| r.display().to_string());
    let args: Vec<&str> = recipe.iter().map(String::as_str).collect();
    let _building = one_build_at_a_time();
    run_script(&script, &args, false, unbuilt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_artifact_found_marks_its_entry_used() {
        let dir = tempfile::tempdir().unwrap();
        let entry = dir.path().join("guest-0123456789abcdef");
        std::fs::create_dir(&entry).unwrap();
        std::fs::write(entry.join("vmlinux"), "x").unwrap();
        let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(90 * 86_400);
        std::fs::File::open(&entry)
            .and_then(|dir| dir.set_modified(long_ago))
            .unwrap();
        mark_used(&entry.join("vmlinux"));
        let age = std::fs::metadata(&entry)
            .unwrap()
            .modified()
            .unwrap()
            .elapsed()
            .unwrap();
        assert!(age.as_secs() < 60, "{age:?}");
    }

    /// A stand-in for guest-agent/build-initramfs.sh that says `stderr` and prints
    /// `/cached/initramfs.cpio.gz`.
    fn fake_build_script(dir: &Path, stderr: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let script = dir.join("build.sh");
        std::fs::write(
            &script,
            format!("#!/bin/sh\nprintf '%s' '{stderr}' >&2\necho /cached/initramfs.cpio.gz\n"),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        script
    }

    #[test]
    fn an_agent_build_that_compiles_says_so_and_an_up_to_date_one_is_quiet() {
        let dir = tempfile::tempdir().unwrap();
        let compiling = "agent-initramfs: [1/3] building the static agent\n   Compiling \
                         guest-agent v0.1.0 (/src)\n   Compiling vmctl v0.1.0\n    Finished \
                         `guest-agent` profile\nagent-initramfs: done\n";
        let mut said = Vec::new();
        let path = run_script_quietly(&fake_build_script(dir.path(), compiling), &[], |m| {
            said.push(m.to_string())
        })
        .unwrap();
        assert_eq!(path, Path::new("/cached/initramfs.cpio.gz"));
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(said[0].starts_with("building the guest agent"), "{said:?}");

        let up_to_date = "agent-initramfs: [1/3] building the static agent\n    Finished \
                          `guest-agent` profile in 0.05s\nagent-initramfs: up to date\n";
        let mut said = Vec::new();
        run_script_quietly(&fake_build_script(dir.path(), up_to_date), &[], |m| {
            said.push(m.to_string())
        })
        .unwrap();
        assert_eq!(said, Vec::<String>::new());
    }

    #[test]
    fn the_agent_scripts_warnings_are_passed_on() {
        let dir = tempfile::tempdir().unwrap();
        let warning = "agent-initramfs: warning: cargo is not on PATH\n";
        let mut said = Vec::new();
        run_script_quietly(&fake_build_script(dir.path(), warning), &[], |m| {
            said.push(m.to_string())
        })
        .unwrap();
        assert_eq!(said, ["agent-initramfs: warning: cargo is not on PATH"]);
    }

    #[test]
    fn the_cache_is_where_the_build_scripts_put_it() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(key, _)| *key == name)
                    .map(|(_, value)| std::ffi::OsString::from(value))
            }
        };
        assert_eq!(
            cache_dir_in(env(&[
                ("VMCTL_CACHE_DIR", "/c"),
                ("XDG_CACHE_HOME", "/x"),
                ("HOME", "/h")
            ])),
            Some("/c".into())
        );
        assert_eq!(
            cache_dir_in(env(&[("VMCTL_CACHE_DIR", ""), ("XDG_CACHE_HOME", "/x")])),
            Some("/x/vmctl".into())
        );
        assert_eq!(
            cache_dir_in(env(&[("HOME", "/h")])),
            Some("/h/.cache/vmctl".into())
        );
        assert_eq!(cache_dir_in(env(&[])), None);
    }
}
