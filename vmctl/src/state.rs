//! Where a workspace's VM keeps its state: one directory per workspace under the XDG
//! state dir, holding its record and its logs, and its sockets unless their paths
//! would be too long ([`VmDir::sockets_dir`], then under /tmp). Nothing is written
//! into the workspace.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::shares::ShareSet;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(
        "workspace {}: {source}; name an existing directory, or run vmctl from one",
        .path.display()
    )]
    Workspace {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot use {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: unreadable VM record ({reason}); {removal}", .path.display())]
    Corrupt {
        path: PathBuf,
        reason: String,
        /// How to remove the VM, whose workspace the record no longer says.
        removal: String,
    },
}

/// What `vmctl up` decided for a workspace's VM; read by the supervisor and by `ps`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    pub workspace: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub rootfs: PathBuf,
    pub cpus: u32,
    pub memory_mib: u64,
    pub nested: bool,
    /// The nested host's kernel, for a VM that runs in the nested host (`nested`):
    /// built by `vmctl up` with the guest's files, before the VM's boot is timed.
    /// (None in the records of older vmctl; the supervisor then finds it itself.)
    #[serde(default)]
    pub nested_host_kernel: Option<PathBuf>,
    /// Kernel arguments for the guest agent (`vmctl.*`).
    pub agent_cmdline: String,
    /// Seconds since the epoch when the VM was started.
    pub started_at: u64,
    /// The workspace and any extra directory shares, served over virtio-fs.
    #[serde(default)]
    pub shares: Option<ShareSet>,
    /// Host loopback ports relayed into the guest at boot.
    #[serde(default)]
    pub relay_ports: Vec<u16>,
    /// Test-only settings of the egress proxy.
    #[serde(default)]
    pub egress: EgressTestOptions,
    /// Where the VM's hybrid-vsock socket is ([`VmDir::vsock_socket`]), for other
    /// programs (the benchmark harness): not always in the VM's directory. Written,
    /// never read by vmctl, which works it out.
    #[serde(default)]
    pub vsock_socket: Option<PathBuf>,
    /// Whether the guest gives the memory it frees back to the host (the config
    /// file's `free_page_reporting`). Records of older vmctl lack it: true, as then.
    #[serde(default = "reports_free_pages")]
    pub free_page_reporting: bool,
    /// The mount point of the file system the workspace was on when the VM started,
    /// so `vmctl prune` can tell a workspace on a volume no longer mounted from a
    /// removed one. None in the records of older vmctl.
    #[serde(default)]
    pub workspace_mount: Option<PathBuf>,
}

/// A record's `free_page_reporting` when it does not say.
fn reports_free_pages() -> bool {
    true
}

/// Settings that let tests point the egress proxy at a local test upstream. Each is
/// given explicitly on `vmctl up`; none is ever inferred.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressTestOptions {
    /// PEM CAs trusted for upstream TLS besides the host's roots.
    #[serde(default)]
    pub extra_ca: Option<PathBuf>,
    /// `host:port` → address to connect to instead of resolving (skips the
    /// private-address check, not the policy).
    #[serde(default)]
    pub resolve: Vec<(String, std::net::SocketAddr)>,
}

/// What a throwaway VM's directory name has after its workspace's, before the pid of
/// the `vmctl run` that made it.
const THROWAWAY_SUFFIX: &str = "-run";

/// A workspace's VM directory.
#[derive(Debug, Clone)]
pub struct VmDir {
    pub path: PathBuf,
}

impl VmDir {
    /// The VM directory of `workspace` (canonicalized), created if missing.
    pub fn for_workspace(workspace: &Path) -> Result<(PathBuf, VmDir), StateError> {
        Self::create(workspace, "")
    }

    /// The VM directory `workspace` has or would have; nothing is created. A workspace
    /// directory that is gone is taken at its absolute path, with the part that still
    /// exists canonicalized, so that the VM of a removed directory can still be
    /// stopped and removed however its path is spelled (`../feat`, `feat/`, through
    /// a link to a parent): the VM was named after the canonical path.
    pub fn lookup(workspace: &Path) -> Result<(PathBuf, VmDir), StateError> {
        let workspace = match workspace.canonicalize() {
            Ok(canonical) => canonical,
            Err(source) if source.kind() == std::io::ErrorKind::NotFound => {
                let absolute =
                    std::path::absolute(workspace).map_err(|_| StateError::Workspace {
                        path: workspace.to_path_buf(),
                        source,
                    })?;
                resolve_existing_part(&absolute)
            }
            Err(source) => {
                return Err(StateError::Workspace {
                    path: workspace.to_path_buf(),
                    source,
                })
            }
        };
        let dir = vms_dir().join(vm_name(&workspace));
        Ok((workspace, VmDir { path: dir }))
    }

    /// A fresh directory for a throwaway VM of `workspace`.
    pub fn throwaway(workspace: &Path) -> Result<(PathBuf, VmDir), StateError> {
        Self::create(
            workspace,
            &format!("{THROWAWAY_SUFFIX}{}", std::process::id()),
        )
    }

    /// Whether this is a throwaway VM's directory ([`VmDir::throwaway`]: its name ends
    /// in `-run<pid>`), which nothing reuses once the VM stopped.
    pub fn is_throwaway(&self) -> bool {
        self.path
            .file_name()
            .and_then(|name| name.to_str())
            .and_then(|name| name.rsplit_once(THROWAWAY_SUFFIX))
            .is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
    }

    fn create(workspace: &Path, suffix: &str) -> Result<(PathBuf, VmDir), StateError> {
        let named = workspace;
        let workspace = workspace
            .canonicalize()
            .map_err(|source| StateError::Workspace {
                path: named.to_path_buf(),
                source,
            })?;
        if !workspace.is_dir() {
            return Err(StateError::Workspace {
                path: named.to_path_buf(),
                source: std::io::Error::from(std::io::ErrorKind::NotADirectory),
            });
        }
        let dir = create_state_dir()?.join(format!("{}{suffix}", vm_name(&workspace)));
        std::fs::create_dir_all(&dir).map_err(|source| StateError::Io {
            path: dir.clone(),
            source,
        })?;
        Ok((workspace, VmDir { path: dir }))
    }

    /// Every VM directory there is.
    pub fn all() -> Vec<VmDir> {
        let mut dirs: Vec<VmDir> = std::fs::read_dir(vms_dir())
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| VmDir { path: e.path() })
                    .collect()
            })
            .unwrap_or_default();
        dirs.sort_by(|a, b| a.path.cmp(&b.path));
        dirs
    }

    pub fn record_path(&self) -> PathBuf {
        self.path.join("vm.json")
    }
    pub fn vsock_socket(&self) -> PathBuf {
        self.vsock_dir().join(VSOCK_SOCKET_NAME)
    }

    /// The directory of the VM's vsock socket and of the sockets the guest reaches
    /// host ports through (`vsock.sock_<port>`), and nothing else: the VMM's jail shows
    /// it this one directory, so the supervisor's control socket, the logs and the
    /// egress CA's key stay out of a compromised VMM's sight.
    pub fn vsock_dir(&self) -> PathBuf {
        self.sockets_dir().join(VSOCK_DIR_NAME)
    }

    /// Where the VM's Unix sockets live: its directory, unless that makes a socket
    /// path longer than the kernel allows (108 bytes, with the `_<port>` suffix the
    /// hybrid vsock adds); then a private directory under /tmp named after it.
    pub fn sockets_dir(&self) -> PathBuf {
        let socket = self.path.join(VSOCK_DIR_NAME).join(VSOCK_SOCKET_NAME);
        if socket.as_os_str().len() + LONGEST_PORT_SUFFIX.len() < SUN_PATH_MAX {
            return self.path.clone();
        }
        private_tmp_dir().join(format!(
            "vm-{}",
            short_hash(self.path.as_os_str().as_encoded_bytes())
        ))
    }

    /// Creates [`Self::sockets_dir`] (when it is not the VM's own directory) and
    /// [`Self::vsock_dir`] in it, refusing a directory someone else could have
    /// prepared.
    pub fn create_sockets_dir(&self) -> Result<(), StateError> {
        let dir = self.sockets_dir();
        if dir != self.path {
            for level in [dir.parent(), Some(dir.as_path())].into_iter().flatten() {
                ensure_private_dir(level)?;
            }
        }
        ensure_private_dir(&self.vsock_dir())
    }

    /// Whether the VM's supervisor is an older vmctl's, which put the vsock socket
    /// straight in [`Self::sockets_dir`] (before it had a directory of its own): this
    /// vmctl cannot reach that VM's agent.
    pub fn runs_an_older_layout(&self) -> bool {
        !self.vsock_socket().exists() && self.older_layout_vsock_socket().exists()
    }

    /// Where an older vmctl's VM has its vsock socket ([`Self::runs_an_older_layout`]).
    pub fn older_layout_vsock_socket(&self) -> PathBuf {
        self.sockets_dir().join(VSOCK_SOCKET_NAME)
    }

    /// Removes the sockets a finished VM leaves and the directories
    /// [`Self::create_sockets_dir`] made (best effort: a missing one is not an
    /// error, and a directory someone put other files in stays).
    pub fn remove_sockets(&self) {
        let vsock = self.vsock_socket();
        for socket in [
            crate::network::services::service_socket(&vsock),
            vsock,
            self.control_socket(),
        ] {
            let _ = std::fs::remove_file(socket);
        }
        let _ = std::fs::remove_dir(self.vsock_dir());
        if self.sockets_dir() != self.path {
            let _ = std::fs::remove_dir(self.sockets_dir());
        }
    }
    pub fn pid_file(&self) -> PathBuf {
        self.path.join("supervisor.pid")
    }

    /// Records `pid` as the VM's supervisor's. Written whole or not at all (a file of
    /// its own, renamed over the old one), as the starting vmctl and the supervisor
    /// both write it, each the supervisor's pid.
    pub fn write_pid(&self, pid: u32) -> Result<(), StateError> {
        let path = self.pid_file();
        replace_file(&path, pid.to_string().as_bytes())
            .map_err(|source| StateError::Io { path, source })
    }
    /// One line per virtiofsd that died while the VM ran. In a directory of its own:
    /// a nested host records its virtiofsd's there, and is given that directory alone
    /// of the VM's (never its record, logs or sockets, which a nested host the guest
    /// took over could otherwise rewrite or plant links among).
    pub fn share_failures(&self) -> PathBuf {
        self.path.join("share-failures").join("failures.log")
    }

    /// What `share_failures` recorded (empty when all is well): its last 64 KiB, of a
    /// regular file only, as the nested host writes there (a FIFO or a link to
    /// `/dev/zero` must not hang or swell `vmctl ps`).
    pub fn read_share_failures(&self) -> Vec<String> {
        const MAX: usize = 64 << 10;
        let Some(text) = crate::log_keeper::read_tail(&self.share_failures(), MAX as u64) else {
            return Vec::new();
        };
        // A tail cut from a longer file starts mid-line: that part is no line.
        let skip = usize::from(text.len() >= MAX);
        String::from_utf8_lossy(&text)
            .lines()
            .skip(skip)
            .map(str::to_string)
            .collect()
    }

    /// Why the VM's last run ended in a crash, one line: written by its supervisor,
    /// removed when the VM starts again.
    pub fn crash_file(&self) -> PathBuf {
        self.path.join("crashed")
    }

    /// What `crash_file` recorded, if the VM's last run crashed, fit for a terminal
    /// (it may quote the guest's console: [`crate::terminal::printable`]).
    pub fn read_crash(&self) -> Option<String> {
        std::fs::read_to_string(self.crash_file())
            .ok()
            .map(|text| crate::terminal::printable(text.trim()).into_owned())
            .filter(|text| !text.is_empty())
    }

    pub fn console_log(&self) -> PathBuf {
        self.path.join("console.log")
    }
    pub fn supervisor_log(&self) -> PathBuf {
        self.path.join("supervisor.log")
    }
    /// Present while `vmctl up` pins the VM (it then never stops for idleness).
    pub fn pin_file(&self) -> PathBuf {
        self.path.join("pinned")
    }
    /// The supervisor's control socket (network setup, published ports).
    pub fn control_socket(&self) -> PathBuf {
        self.sockets_dir().join("control.sock")
    }
    /// The sandbox's egress CA (certificate and key; the key never leaves the host).
    pub fn egress_ca_dir(&self) -> PathBuf {
        self.path.join("egress-ca")
    }
    /// The egress proxy's decisions (`vmctl policy log`).
    /// Where the egress proxy keeps, per secret, the probes for it it saw (kept across
    /// runs, gone with `vmctl rm`).
    pub fn egress_probes(&self) -> PathBuf {
        self.path.join("egress-probes")
    }

    pub fn egress_log(&self) -> PathBuf {
        self.path.join("egress.log")
    }

    pub fn read_record(&self) -> Result<VmRecord, StateError> {
        let path = self.record_path();
        let text = std::fs::read(&path).map_err(|source| StateError::Io {
            path: path.clone(),
            source,
        })?;
        serde_json::from_slice(&text).map_err(|e| StateError::Corrupt {
            path,
            reason: e.to_string(),
            removal: self.removal_without_record(),
        })
    }

    /// How to remove this VM when its record cannot say its workspace (`vmctl rm`
    /// finds a VM by its workspace): the workspace its supervisor's log names, else
    /// the directory itself.
    fn removal_without_record(&self) -> String {
        use crate::supervisor::{LOG_TAIL_BYTES, RUN_STARTS};
        let workspace = crate::log_keeper::read_tail(&self.supervisor_log(), LOG_TAIL_BYTES)
            .and_then(|tail| {
                let log = String::from_utf8_lossy(&tail).into_owned();
                let line = log.lines().rev().find_map(|l| l.strip_prefix(RUN_STARTS))?;
                Some(line.trim().to_owned())
            });
        match workspace {
            Some(workspace) => format!(
                "remove it with `vmctl rm {}`",
                crate::vm::shell_word(Path::new(&workspace))
            ),
            None => format!(
                "once 'vmctl ps' shows it stopped, delete {}",
                self.path.display()
            ),
        }
    }

    pub fn write_record(&self, record: &VmRecord) -> Result<(), StateError> {
        let path = self.record_path();
        let io = |source| StateError::Io {
            path: path.clone(),
            source,
        };
        let text = serde_json::to_vec_pretty(record).map_err(|e| io(e.into()))?;
        let tmp = path.with_extension("json.tmp");
        // Synced before the rename: after a crash the record is the old one or the
        // new one, never a truncated one `ps` can only call broken.
        let mut file = std::fs::File::create(&tmp).map_err(io)?;
        std::io::Write::write_all(&mut file, &text).map_err(io)?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)
    }

    /// The supervisor's pid while it runs. The pid file outlives a supervisor that was
    /// killed, or a host that rebooted, and its pid may then be another process's: only
    /// a process that is this VM's supervisor (`vmctl __supervise DIR`) counts, so that
    /// `vmctl stop` never signals anything else.
    pub fn running_pid(&self) -> Option<i32> {
        let pid: i32 = std::fs::read_to_string(self.pid_file())
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        supervises(&cmdline, &self.path).then_some(pid)
    }
}

/// Whether a process's command line (`/proc/PID/cmdline`) is the supervisor of `dir`:
/// named as `dir` is, or another way to the same place (a supervisor started before
/// the state directory was resolved through links, by an older vmctl).
fn supervises(cmdline: &[u8], dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    args.windows(2).any(|pair| {
        let named = Path::new(std::ffi::OsStr::from_bytes(pair[1]));
        pair[0] == b"__supervise"
            && (named == dir || resolve_existing_part(named) == resolve_existing_part(dir))
    })
}

/// Where a log of the VM's previous run is kept: `console.log` → `console.log.previous`.
pub fn previous_run(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(".previous");
    PathBuf::from(name)
}

/// `sun_path` of `sockaddr_un`, its terminating NUL included.
const SUN_PATH_MAX: usize = 108;
const VSOCK_DIR_NAME: &str = "vsock";
const VSOCK_SOCKET_NAME: &str = "vsock.sock";
/// What the hybrid vsock adds to the socket's path for a host port (the largest).
const LONGEST_PORT_SUFFIX: &str = "_4294967295";

/// Opens `path` for an `flock` (created if missing, never truncated).
pub fn open_lock_file(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
}

/// An exclusive `flock` on `path` (created if missing), waited for and held until the
/// file drops.
pub fn lock_file(path: &Path) -> std::io::Result<std::fs::File> {
    let file = open_lock_file(path)?;
    file.lock()?;
    Ok(file)
}

/// Creates `dir` (mode 0700) or checks that the existing one is ours and private.
pub fn ensure_private_dir(dir: &Path) -> Result<(), StateError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let io = |source| StateError::Io {
        path: dir.to_path_buf(),
        source,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(e)),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(io)?;
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    if let Some(problem) = not_ours(dir, meta.is_dir(), meta.uid(), uid) {
        return Err(io(std::io::Error::other(problem)));
    }
    // Ours but open to others (e.g. made by an older vmctl): close it.
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(io)?;
    }
    Ok(())
}

/// What keeps `dir` (a directory, or not; of `owner`) from being one of ours, `uid`'s,
/// and how to make it one.
fn not_ours(dir: &Path, is_dir: bool, owner: u32, uid: u32) -> Option<String> {
    if !is_dir {
        Some("it exists but is not a directory; remove it".to_string())
    } else if owner != uid {
        // SAFETY: getgid cannot fail.
        let gid = unsafe { libc::getgid() };
        Some(format!(
            "it belongs to uid {owner}, not to you (uid {uid}), so someone else could have \
             prepared it; remove it (sudo rm -r {dir}), or if it is yours to keep, make it \
             yours: sudo chown -R {uid}:{gid} {dir}",
            dir = dir.display()
        ))
    } else {
        None
    }
}

/// `$XDG_STATE_HOME/vmctl/vms` (default `~/.local/state/vmctl/vms`).
pub fn vms_dir() -> PathBuf {
    state_dir().join("vms")
}

/// `$XDG_STATE_HOME/vmctl` (default `~/.local/state/vmctl`; without a home, in
/// [`private_tmp_dir`]), with symlinks resolved.
pub fn state_dir() -> PathBuf {
    state_dir_from(std::env::var_os("XDG_STATE_HOME"), std::env::var_os("HOME"))
}

/// Resolved because a VM's directory path is its identity: the supervisor is found by
/// it in /proc, and long socket paths are named after its hash. A home reached through
/// a symlink, spelled one way by one shell and the other way by another, would
/// otherwise see a running VM as stopped and start a second one on the same disk.
fn state_dir_from(xdg_state_home: Option<OsString>, home: Option<OsString>) -> PathBuf {
    let xdg = xdg_state_home
        .map(PathBuf::from)
        .filter(|p| p.is_absolute());
    let home = home.map(PathBuf::from).filter(|p| p.is_absolute());
    let dir = match (xdg, home) {
        (Some(state), _) => state.join("vmctl"),
        (None, Some(home)) => home.join(".local/state/vmctl"),
        (None, None) => private_tmp_dir().join("state"),
    };
    resolve_existing_part(&dir)
}

/// `path` with its longest existing ancestor canonicalized and the rest (not created
/// yet) appended as given.
pub fn resolve_existing_part(path: &Path) -> PathBuf {
    let mut rest = Vec::new();
    let mut ancestor = path;
    loop {
        if let Ok(resolved) = ancestor.canonicalize() {
            return rest.iter().rev().fold(resolved, |dir, part| dir.join(part));
        }
        match (ancestor.parent(), ancestor.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                ancestor = parent;
            }
            _ => return path.to_path_buf(),
        }
    }
}

/// Whether `dir` is a directory this user owns that no one else may write to (a
/// runtime directory to put ours in: as root through `su` or `sudo -E`,
/// `XDG_RUNTIME_DIR` is still the user's).
pub fn is_ours_alone(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    std::fs::metadata(dir)
        .is_ok_and(|meta| meta.is_dir() && meta.uid() == uid && meta.mode() & 0o022 == 0)
}

/// `/tmp/vmctl-<uid>`: this user's directory in /tmp, for what has no better place.
/// Anyone may create it first; [`ensure_private_dir`] refuses one that is not ours.
pub fn private_tmp_dir() -> PathBuf {
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    PathBuf::from(format!("/tmp/vmctl-{uid}"))
}

/// Creates the state directory (and [`vms_dir`] in it), private: the VMs' records,
/// logs, sockets and agent transcripts are nobody else's to read, and no one else
/// may have prepared any of it. Returns [`vms_dir`].
pub fn create_state_dir() -> Result<PathBuf, StateError> {
    let state = state_dir();
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| StateError::Io { path, source }
    };
    let tmp = private_tmp_dir();
    if state.starts_with(&tmp) {
        ensure_private_dir(&tmp)?;
    } else if let Some(parent) = state.parent() {
        std::fs::create_dir_all(parent).map_err(io(parent))?;
    }
    ensure_private_dir(&state)?;
    let vms = vms_dir();
    std::fs::create_dir_all(&vms).map_err(io(&vms))?;
    Ok(vms)
}

/// A readable, unique, stable name: the workspace's last component and a hash of
/// its full path.
pub fn vm_name(workspace: &Path) -> String {
    let base: String = workspace
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "root".into())
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(32)
        .collect();
    format!(
        "{base}-{}",
        short_hash(workspace.as_os_str().as_encoded_bytes())
    )
}

/// Eight hex digits of FNV-1a: stable across builds, unlike std's hasher.
pub fn short_hash(bytes: &[u8]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:08x}", hash as u32)
}

/// Replaces `path` with `contents` whole or not at all, for files other processes read
/// any time: written to a file of this process's own beside it, then renamed over it.
pub(crate) fn replace_file(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    std::fs::write(&tmp, contents)
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// Held by a test whose `flock`s must come free the moment it drops them, and by the
/// tests' spawns of processes: a child forked meanwhile shares the test's open files,
/// locks included, until it execs.
#[cfg(test)]
pub(crate) fn no_forks_meanwhile() -> std::sync::MutexGuard<'static, ()> {
    static FORKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    FORKING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `command` spawned by a test, while no test that needs its locks to come free holds
/// them ([`no_forks_meanwhile`]).
#[cfg(test)]
pub(crate) fn spawn_in_test(command: &mut std::process::Command) -> std::process::Child {
    let _forking = no_forks_meanwhile();
    command
        .spawn()
        .unwrap_or_else(|e| panic!("cannot spawn {command:?}: {e}"))
}

/// A stand-in for `vm`'s supervisor, running `script` (`sh -c`), that vmctl takes for
/// one (`running_pid`): its pid file written, its command line `__supervise DIR`.
#[cfg(test)]
pub(crate) fn fake_supervisor(vm: &VmDir, script: &str) -> FakeSupervisor {
    let _forking = no_forks_meanwhile();
    let child = std::process::Command::new("sh")
        .args(["-c", script, "__supervise"])
        .arg(&vm.path)
        .spawn()
        .expect("start a stand-in supervisor");
    let cmdline = format!("/proc/{}/cmdline", child.id());
    while !std::fs::read(&cmdline).is_ok_and(|c| c.starts_with(b"sh\0")) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::fs::write(vm.pid_file(), child.id().to_string()).expect("write its pid file");
    let supervisor = FakeSupervisor(child);
    assert!(
        vm.running_pid().is_some(),
        "vmctl does not take it for a VM"
    );
    supervisor
}

/// A [`fake_supervisor`], killed when dropped: a test that fails midway leaves no
/// process behind.
#[cfg(test)]
pub(crate) struct FakeSupervisor(pub(crate) std::process::Child);

#[cfg(test)]
impl Drop for FakeSupervisor {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A record of `vm`, a VM of `workspace`, with a value in every field.
#[cfg(test)]
pub(crate) fn test_record(vm: &VmDir, workspace: &Path) -> VmRecord {
    VmRecord {
        workspace: workspace.into(),
        kernel: "/k".into(),
        initrd: "/i".into(),
        rootfs: "/r".into(),
        cpus: 2,
        memory_mib: 512,
        free_page_reporting: false,
        nested: true,
        nested_host_kernel: Some("/n".into()),
        agent_cmdline: "vmctl.root=/dev/vda".into(),
        started_at: 1,
        shares: Some(ShareSet {
            shares: vec![crate::shares::workspace_share(workspace).unwrap()],
            virtiofsd: "/usr/bin/virtiofsd".into(),
            failure_file: Some(vm.share_failures()),
            cache: crate::virtiofsd::CachePolicy {
                cache: crate::virtiofsd::cache::Cache::Never,
                writeback: true,
            },
        }),
        relay_ports: vec![6767],
        vsock_socket: Some(vm.vsock_socket()),
        workspace_mount: None,
        egress: EgressTestOptions {
            extra_ca: Some("/tmp/ca.pem".into()),
            resolve: vec![("api.test:443".into(), "127.0.0.1:8443".parse().unwrap())],
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The share failures are read as a log's tail: lines of a regular file, nothing
    /// of a FIFO (not waited on) or a link (to `/dev/zero`, not read for ever).
    #[test]
    fn share_failures_are_read_from_a_regular_file_only_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        let log = vm.share_failures();
        std::fs::create_dir_all(log.parent().unwrap()).unwrap();
        assert!(vm.read_share_failures().is_empty());
        std::fs::write(
            &log,
            format!("{}\nfs0 died\nfs1 died\n", "x".repeat(100 << 10)),
        )
        .unwrap();
        assert_eq!(vm.read_share_failures(), ["fs0 died", "fs1 died"]);
        std::fs::remove_file(&log).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &log).unwrap();
        assert!(vm.read_share_failures().is_empty());
        std::fs::remove_file(&log).unwrap();
        crate::guest_writable::make_fifo(&log);
        assert!(vm.read_share_failures().is_empty());
    }

    #[test]
    fn a_directory_of_someone_else_is_refused_with_its_owner_and_the_ways_out() {
        let dir = Path::new("/home/me/.local/state/vmctl");
        let problem = not_ours(dir, true, 4242, 1000).unwrap();
        assert!(problem.contains("belongs to uid 4242"), "{problem}");
        assert!(
            problem.contains("sudo rm -r /home/me/.local/state/vmctl"),
            "{problem}"
        );
        assert!(problem.contains("sudo chown -R 1000:"), "{problem}");
        assert!(not_ours(dir, false, 1000, 1000)
            .unwrap()
            .contains("not a directory"));
        assert_eq!(not_ours(dir, true, 1000, 1000), None);
    }

    #[test]
    fn ensure_private_dir_names_the_owner_of_a_foreign_directory() {
        // Only root can give a directory away.
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            vm_tests::not_run(
                "state::tests::ensure_private_dir_names_the_owner_of_a_foreign_directory",
                "giving a directory to another user needs root",
            );
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::chown(&dir, Some(4242), Some(4242)).unwrap();
        let error = ensure_private_dir(&dir).unwrap_err().to_string();
        assert!(error.contains("belongs to uid 4242"), "{error}");
        assert!(error.contains("chown -R 0:"), "{error}");
    }

    #[test]
    fn the_state_dir_is_the_same_whichever_way_home_is_spelled() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().canonicalize().unwrap().join("real-home");
        std::fs::create_dir(&real).unwrap();
        let link = tmp.path().join("home-link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let home = |path: &Path| state_dir_from(None, Some(path.as_os_str().to_owned()));
        let expected = real.join(".local/state/vmctl");
        assert_eq!(home(&real), expected, "not created yet");
        assert_eq!(home(&link), expected, "not created yet, through the link");
        std::fs::create_dir_all(&expected).unwrap();
        assert_eq!(home(&link), expected, "created");
        let xdg = state_dir_from(Some(link.join("state").into()), None);
        assert_eq!(xdg, real.join("state/vmctl"));
        assert_eq!(
            state_dir_from(Some("relative".into()), Some("/nonexistent-home".into())),
            Path::new("/nonexistent-home/.local/state/vmctl"),
            "a relative XDG_STATE_HOME is ignored; a home that is not there is taken as given"
        );
    }

    /// A pid file left by a supervisor that did not exit cleanly (a reboot) names
    /// whatever process has that pid now: it is not the VM's, and not to be signalled.
    #[test]
    fn only_the_vms_own_supervisor_counts_as_running() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("vm"),
        };
        std::fs::create_dir_all(&vm.path).unwrap();
        std::fs::write(vm.pid_file(), std::process::id().to_string()).unwrap();
        assert_eq!(vm.running_pid(), None, "the test process is no supervisor");

        let mut supervisor = spawn_in_test(
            std::process::Command::new("sh")
                .args(["-c", "sleep 30; true", "__supervise"])
                .arg(&vm.path),
        );
        // As the real supervisor, which writes its pid file once it runs: spawn() may
        // return while the exec is still setting up the new command line.
        let cmdline = format!("/proc/{}/cmdline", supervisor.id());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !std::fs::read(&cmdline).is_ok_and(|c| c.starts_with(b"sh\0")) {
            assert!(std::time::Instant::now() < deadline, "sh never started");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        std::fs::write(vm.pid_file(), supervisor.id().to_string()).unwrap();
        assert_eq!(vm.running_pid(), Some(supervisor.id() as i32));
        let other = VmDir {
            path: dir.path().join("other"),
        };
        std::fs::create_dir_all(&other.path).unwrap();
        std::fs::copy(vm.pid_file(), other.pid_file()).unwrap();
        assert_eq!(other.running_pid(), None, "another VM's supervisor");
        supervisor.kill().unwrap();
        supervisor.wait().unwrap();
        assert_eq!(vm.running_pid(), None);
    }

    /// A supervisor an older vmctl started names its directory through the link
    /// the state directory was reached by then: it is still this VM's.
    #[test]
    fn a_supervisor_named_through_a_link_is_the_vms() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().canonicalize().unwrap().join("vms/one");
        std::fs::create_dir_all(&real).unwrap();
        std::os::unix::fs::symlink(real.parent().unwrap(), tmp.path().join("link")).unwrap();
        let cmdline = |dir: &Path| {
            let mut line = b"vmctl\0__supervise\0".to_vec();
            line.extend_from_slice(dir.as_os_str().as_encoded_bytes());
            line.push(0);
            line
        };
        let through_link = tmp.path().join("link/one");
        assert!(supervises(&cmdline(&through_link), &real));
        assert!(supervises(&cmdline(&real), &real));
        assert!(!supervises(&cmdline(&tmp.path().join("link/two")), &real));
        let mut not_a_supervisor = cmdline(&real);
        not_a_supervisor.splice(6..17, b"__superviseX".iter().copied());
        assert!(!supervises(&not_a_supervisor, &real));
    }

    /// The crash line may quote the guest's console: it is read back escaped, for
    /// `vmctl ps`, `up` and `exec`, which print it.
    #[test]
    fn a_recorded_crash_is_read_back_fit_for_a_terminal() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        assert_eq!(vm.read_crash(), None);
        std::fs::write(vm.crash_file(), "Kernel panic \u{1b}]0;owned\u{7}\n").unwrap();
        assert_eq!(
            vm.read_crash().as_deref(),
            Some("Kernel panic \\u{1b}]0;owned\\u{7}")
        );
    }

    #[test]
    fn sockets_move_out_of_directories_too_deep_for_them() {
        let short = VmDir {
            path: "/home/u/.local/state/vmctl/vms/p-1234abcd".into(),
        };
        assert_eq!(short.sockets_dir(), short.path);
        let deep = VmDir {
            path: PathBuf::from(format!("/tmp/{}/vmctl/vms/p-1234abcd", "x".repeat(80))),
        };
        let dir = deep.sockets_dir();
        assert!(
            dir.to_string_lossy().starts_with("/tmp/vmctl-"),
            "{}",
            dir.display()
        );
        let longest = format!("{}{LONGEST_PORT_SUFFIX}", deep.vsock_socket().display());
        assert!(longest.len() < SUN_PATH_MAX, "{longest}");
        assert_eq!(dir, deep.sockets_dir(), "stable");
    }

    #[test]
    fn the_vsock_directory_holds_the_vsock_sockets_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: tmp.path().join("vm"),
        };
        std::fs::create_dir(&vm.path).unwrap();
        vm.create_sockets_dir().unwrap();
        let vsock_dir = vm.vsock_dir();
        assert!(vsock_dir.is_dir());
        assert_eq!(vm.vsock_socket().parent(), Some(vsock_dir.as_path()));
        let failures_dir = vm.share_failures().parent().unwrap().to_path_buf();
        // What the VMM's jail must not show it.
        for other in [
            vm.control_socket(),
            vm.record_path(),
            vm.console_log(),
            vm.supervisor_log(),
            vm.egress_ca_dir(),
            vm.egress_log(),
            vm.pid_file(),
            vm.share_failures(),
            vm.crash_file(),
            vm.pin_file(),
            crate::agent::agent_home_dir(&vm),
        ] {
            assert!(!other.starts_with(&vsock_dir), "{}", other.display());
            // Nor what a nested host is given of it: the failures' directory.
            assert!(
                other == vm.share_failures() || !other.starts_with(&failures_dir),
                "{}",
                other.display()
            );
        }
        assert!(!vm.vsock_socket().starts_with(&failures_dir));

        let service = crate::network::services::service_socket(&vm.vsock_socket());
        for socket in [vm.vsock_socket(), service, vm.control_socket()] {
            std::fs::write(&socket, "").unwrap();
        }
        assert!(!vm.runs_an_older_layout());
        vm.remove_sockets();
        assert!(!vsock_dir.exists(), "removed once empty");
        std::fs::write(vm.path.join("vsock.sock"), "").unwrap();
        assert!(vm.runs_an_older_layout(), "an older vmctl's socket");
        assert!(!vm.control_socket().exists());
        assert!(vm.path.is_dir(), "the VM's own directory stays");
    }

    #[test]
    fn private_dirs_are_created_or_checked() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("d");
        ensure_private_dir(&dir).unwrap();
        ensure_private_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        ensure_private_dir(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "ours, so made private");
        let file = tmp.path().join("f");
        std::fs::write(&file, "").unwrap();
        assert!(ensure_private_dir(&file).is_err());
    }

    /// The VM of a removed workspace is found by any spelling of its path: through a
    /// link to a parent, with a trailing slash, with `..`. (Review: `vmctl rm ../feat`
    /// after `git worktree remove` said there was no VM, and left it running.)
    #[test]
    fn a_removed_workspace_is_found_by_any_spelling_of_its_path() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().canonicalize().unwrap().join("real");
        std::fs::create_dir_all(real.join("ws")).unwrap();
        std::os::unix::fs::symlink(&real, tmp.path().join("link")).unwrap();
        let (made_under, made) = VmDir::lookup(&real.join("ws")).unwrap();
        std::fs::remove_dir(real.join("ws")).unwrap();
        for spelling in [
            tmp.path().join("link/ws"),
            tmp.path().join("link/ws/"),
            tmp.path().join("real/../link/ws"),
        ] {
            let (found, dir) = VmDir::lookup(&spelling).unwrap();
            assert_eq!(found, made_under, "{spelling:?}");
            assert_eq!(dir.path, made.path, "{spelling:?}");
        }
    }

    #[test]
    fn names_are_stable_readable_and_distinct() {
        let a = vm_name(Path::new("/home/u/src/my project"));
        assert_eq!(a, vm_name(Path::new("/home/u/src/my project")));
        assert!(a.starts_with("my-project-"), "{a}");
        assert_ne!(a, vm_name(Path::new("/home/v/src/my project")));
        assert!(vm_name(Path::new("/")).starts_with("root-"));
    }

    #[test]
    fn record_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        let record = test_record(&vm, Path::new("/w"));
        vm.write_record(&record).unwrap();
        assert_eq!(vm.read_record().unwrap(), record);
        assert_eq!(vm.running_pid(), None);
    }

    /// The record of a VM an older vmctl started, which built the nested host's
    /// kernel in its supervisor, is still read (`vmctl ps` lists that VM).
    #[test]
    fn a_record_without_the_nested_host_kernel_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        let mut json = serde_json::to_value(test_record(&vm, Path::new("/w"))).unwrap();
        json.as_object_mut().unwrap().remove("nested_host_kernel");
        std::fs::write(vm.record_path(), json.to_string()).unwrap();
        assert_eq!(vm.read_record().unwrap().nested_host_kernel, None);
    }

    /// The record of a VM an older vmctl started, before free page reporting, reads
    /// as reporting: what the config's default gives.
    #[test]
    fn a_record_without_free_page_reporting_reads_as_reporting() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        let mut json = serde_json::to_value(test_record(&vm, Path::new("/w"))).unwrap();
        assert_eq!(json["free_page_reporting"], false);
        json.as_object_mut().unwrap().remove("free_page_reporting");
        std::fs::write(vm.record_path(), json.to_string()).unwrap();
        assert!(vm.read_record().unwrap().free_page_reporting);
    }
}
