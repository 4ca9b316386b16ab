//! Workspace VMs: `vmctl up`, `ps`, `stop`, `rm`, and what `exec`/`shell` need to
//! find (or start) a workspace's VM. `start.rs` starts one, with `size.rs` (the VM's
//! vCPUs and memory), `launch.rs` (its boot files, its kernel command line and its
//! supervisor's start) and `agent_wait.rs` (the wait for its guest agent);
//! `stop.rs` stops and removes them (`prune` too), `list.rs` is `vmctl ps`, and
//! `lock.rs` holds the VM's lifecycle lock, which all but `ps` take.

mod agent_wait;
mod launch;
mod list;
mod lock;
mod size;
mod start;
mod stop;

pub use list::{list, table};
#[cfg(test)]
pub(crate) use lock::LIFECYCLE_LOCK;
pub(crate) use lock::{
    lifecycle_lock_held, lock_to_stop, note_lock_holder, running_vm_stopped_by, try_lock_lifecycle,
    LockHolder,
};
pub use start::{check_workspace_ways, guest_writable_dirs, up, up_throwaway, StartOptions};
pub use stop::{
    prune, remove, remove_throwaway, stop, stop_vm, stopped, Teardown, SHUTDOWN_REQUESTED,
};

use std::path::{Path, PathBuf};

use crate::artifacts::ArtifactError;
use crate::network::control::ControlError;
use crate::shares::ShareError;
use crate::state::{StateError, VmDir};
use crate::user_config::UserConfigError;
use crate::virtiofsd::VirtiofsdError;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error(
        "the VM in {} still runs after it was told to stop (its supervisor, pid {pid}, \
         outlived SIGKILL, or started since); its directory is kept. Once that process is \
         gone (`ps -o pid,stat,wchan -p {pid}` shows where it is stuck; its log: {}), \
         'vmctl rm' again",
        .dir.display(),
        .log.display()
    )]
    StillRunning {
        dir: PathBuf,
        pid: i32,
        log: PathBuf,
    },
    #[error(
        "the VM in {} still runs: its supervisor, pid {pid}, outlived SIGKILL (`ps -o \
         pid,stat,wchan -p {pid}` shows where in the kernel it is stuck; its log: {}). \
         'vmctl stop' again once that process is gone",
        .dir.display(),
        .log.display()
    )]
    NotStopped {
        dir: PathBuf,
        pid: i32,
        log: PathBuf,
    },
    #[error(
        "another vmctl started the VM in {} again each time `vmctl rm` stopped it ({times} \
         times); stop that vmctl (`vmctl ps` shows the VM starting), then 'vmctl rm' again",
        .dir.display()
    )]
    KeptStarting { dir: PathBuf, times: usize },
    #[error("cannot start the VM's supervisor: {0}")]
    Spawn(std::io::Error),
    #[error(transparent)]
    Share(#[from] ShareError),
    #[error("{}: in 'mounts': {source}; fix the file (or remove the line)", .config.display())]
    ConfigMount { config: PathBuf, source: ShareError },
    #[error(transparent)]
    UserConfig(#[from] UserConfigError),
    #[error(transparent)]
    Virtiofsd(#[from] VirtiofsdError),
    #[error("the VM's network setup failed: {0}")]
    Network(#[from] ControlError),
    #[error(
        "the VM of {} did not come up: {reason}; {}",
        .workspace.display(),
        how_to_read_logs(.workspace, .vm_dir)
    )]
    NotReady {
        workspace: PathBuf,
        reason: String,
        /// The VM's directory, which holds its logs.
        vm_dir: PathBuf,
    },
    #[error(
        "the VM of {} runs a guest agent of another protocol version ({agent_said}). {}",
        .workspace.display(),
        guest_agent::client::other_protocol_advice(.agent_said)
    )]
    OtherAgent {
        workspace: PathBuf,
        agent_said: String,
    },
    #[error(
        "the guest paths of the VM's shares do not fit the guest kernel's command line, \
         which carries them ({len} bytes; at most {max}): share fewer directories, mount \
         them at shorter guest paths (--mount HOST:GUEST), or use a workspace at a \
         shorter path"
    )]
    SharePathsTooLong { len: usize, max: usize },
    #[error(
        "the VM's {shares} shares (the workspace, the agent's home, the --mount and config \
         mounts) and its other devices need {devices} virtio devices, and a VM has {max}: \
         share {} fewer{}",
        devices - max,
        if *free_page_reporting {
            ", or set free_page_reporting = false for this workspace in the config file \
             (its balloon takes one)"
        } else {
            ""
        }
    )]
    TooManyShares {
        shares: usize,
        devices: usize,
        max: usize,
        free_page_reporting: bool,
    },
    #[error("recipe {}: {source}; name an existing recipe file (see rootfs/README.md)", .path.display())]
    Recipe {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    GuestAccount(#[from] crate::guest_account::GuestAccountError),
}

/// How to read the logs of the VM in `vm_dir`, the VM of `workspace`, for an error:
/// `vmctl logs` finds a workspace's own VM, but not `vmctl run`'s throwaway one, whose
/// files are named instead.
fn how_to_read_logs(workspace: &Path, vm_dir: &Path) -> String {
    let vm = VmDir {
        path: vm_dir.to_path_buf(),
    };
    if vm.is_throwaway() {
        format!(
            "its logs: {} (the host side) and {} (the guest's console); `vmctl prune` \
             removes them",
            vm.supervisor_log().display(),
            vm.console_log().display()
        )
    } else {
        let workspace = shell_word(workspace);
        format!(
            "see `vmctl logs --supervisor {workspace}` (the host side) and `vmctl logs \
             {workspace}` (the guest's console), in {}",
            vm_dir.display()
        )
    }
}

/// `path` as one word of a shell command: quoted unless it holds only characters no
/// shell reads specially.
pub(crate) fn shell_word(path: &Path) -> String {
    let text = path.display().to_string();
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+,:@%=".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        text
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
}

/// One runtime for the agent calls of this process (`up` polls the agent every
/// 100 ms; building a runtime per poll is wasted start-up work).
fn agent_runtime() -> Option<&'static tokio::runtime::Runtime> {
    static RUNTIME: std::sync::OnceLock<Option<tokio::runtime::Runtime>> =
        std::sync::OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()
        })
        .as_ref()
}

#[cfg(test)]
mod tests {
    use super::launch::spawn_supervisor_from;
    use super::*;

    /// An exclusive `flock` on `path` (created if missing), held until the file drops:
    /// another vmctl's lifecycle lock, without the directory checks of
    /// [`lock_lifecycle`].
    pub(super) fn lock_exclusive(path: &Path) -> std::io::Result<std::fs::File> {
        crate::state::lock_file(path)
    }

    /// Serves one hybrid-vsock connection on `socket` as a guest agent that answers
    /// every Hello with `reply`.
    pub(super) fn fake_agent(
        socket: &Path,
        reply: guest_agent::protocol::AgentMessage,
    ) -> std::thread::JoinHandle<Vec<Vec<u8>>> {
        fake_agent_answering(socket, vec![reply])
    }

    /// Serves one hybrid-vsock connection on `socket` as a guest agent that answers
    /// the frames it is sent with `replies`, one each, in order; returns those frames'
    /// payloads.
    pub(super) fn fake_agent_answering(
        socket: &Path,
        replies: Vec<guest_agent::protocol::AgentMessage>,
    ) -> std::thread::JoinHandle<Vec<Vec<u8>>> {
        use std::io::{BufRead, Read, Write};
        let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
        std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
            let mut connect = String::new();
            reader.read_line(&mut connect).unwrap();
            let mut writer = stream;
            writer.write_all(b"OK 1\n").unwrap();
            let mut requests = Vec::new();
            for reply in replies {
                let mut length = [0u8; 4];
                reader.read_exact(&mut length).unwrap();
                let mut frame = vec![0u8; u32::from_le_bytes(length) as usize];
                reader.read_exact(&mut frame).unwrap();
                requests.push(frame);
                let frame = guest_agent::protocol::encode_frame(&reply).unwrap();
                writer.write_all(&frame).unwrap();
            }
            requests
        })
    }

    /// A VM directory in `dir` and its supervisor, started as vmctl starts one: a
    /// stand-in that runs until killed and never writes its pid file itself.
    pub(super) fn silent_supervisor(dir: &Path) -> (VmDir, std::process::Child) {
        let vm = VmDir {
            path: dir.join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        let exe = dir.join("vmctl");
        crate::vmm_process::script(&exe, "#!/bin/sh\nwhile :; do sleep 0.1; done\n");
        let supervisor = {
            let _forking = crate::state::no_forks_meanwhile();
            spawn_supervisor_from(&exe, &vm).unwrap()
        };
        (vm, supervisor)
    }

    /// `vmctl ps` shows no pid: the error must, and where to read why.
    #[test]
    fn a_vm_that_outlives_its_stop_is_named_by_its_supervisors_pid() {
        let vm = VmDir {
            path: "/state/vms/w-1234abcd".into(),
        };
        let error = VmError::StillRunning {
            dir: vm.path.clone(),
            pid: 4242,
            log: vm.supervisor_log(),
        }
        .to_string();
        assert!(error.contains("pid 4242,"), "{error}");
        assert!(error.contains("-p 4242"), "{error}");
        assert!(
            error.contains("/state/vms/w-1234abcd/supervisor.log"),
            "{error}"
        );
        assert!(!error.contains("vmctl ps"), "{error}");
    }

    /// A VM that did not come up is followed by the commands that show its logs; a
    /// throwaway one (`vmctl run`), which `vmctl logs` does not reach, by its files.
    #[test]
    fn a_start_that_failed_says_how_to_read_the_vms_logs() {
        let error = |workspace: &str, vm_dir: &str| {
            VmError::NotReady {
                workspace: workspace.into(),
                reason: "the guest agent did not answer within 30 s".into(),
                vm_dir: vm_dir.into(),
            }
            .to_string()
        };
        let own = error("/src/app", "/state/vms/app-1234abcd");
        assert_eq!(
            own,
            "the VM of /src/app did not come up: the guest agent did not answer within 30 s; \
             see `vmctl logs --supervisor /src/app` (the host side) and `vmctl logs /src/app` \
             (the guest's console), in /state/vms/app-1234abcd"
        );
        let spaced = error("/src/it's mine", "/state/vms/it-s-mine-1234abcd");
        assert!(
            spaced.contains("`vmctl logs '/src/it'\\''s mine'`"),
            "{spaced}"
        );
        let throwaway = error("/src/app", "/state/vms/app-1234abcd-run4242");
        assert!(!throwaway.contains("vmctl logs"), "{throwaway}");
        assert!(
            throwaway.contains(
                "its logs: /state/vms/app-1234abcd-run4242/supervisor.log (the host side) and \
                 /state/vms/app-1234abcd-run4242/console.log"
            ),
            "{throwaway}"
        );
    }
}
