//! Directory shares of a workspace VM: which host directories the guest sees, where,
//! and whether it may write them. Each share becomes one virtio-fs device.
//!
//! The CLI and the user's config write a share as `HOST[:GUEST][:ro]`.

mod kept_out;
pub mod mounts;
mod program_dirs;
mod pseudo_fs;

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use kept_out::{kept_out_remedy, MAX_LINKS};
use program_dirs::{program_dir_place, program_dir_remedy};
use pseudo_fs::{pseudo_place, HOST_DEVICES};

pub use kept_out::{check_kept_out, kept_out_of_the_guest};
pub use program_dirs::{check_not_program_dir, host_program_dirs, HostProgramDir};
pub use pseudo_fs::check_not_pseudo_filesystem;

/// The syntax, for error messages.
const SYNTAX: &str = "HOST[:GUEST][:ro]";

/// Guest directories a share must not cover: the guest's kernel owns them, and a
/// share there would hide what the guest needs to run.
const RESERVED_GUEST_DIRS: [&str; 3] = ["/proc", "/sys", "/dev"];

/// The guest's system directories: a share there, or at one of their parents, would
/// hide the programs, libraries or accounts the guest runs on. (Below them is fine:
/// `/etc/myapp`, `/usr/local/src`.)
const SYSTEM_GUEST_DIRS: [&str; 10] = [
    "/bin",
    "/etc",
    "/lib",
    "/lib64",
    "/sbin",
    "/usr/bin",
    "/usr/lib",
    "/usr/sbin",
    "/usr/share",
    "/var/lib",
];

#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    #[error("mount {spec:?}: {problem}; write it as {SYNTAX} (paths containing ':' cannot be written in this syntax)")]
    Syntax { spec: String, problem: &'static str },
    #[error("mount {spec:?}: unknown option {option:?}; the last part may be ro (read-only) or rw, lower-case")]
    UnknownOption { spec: String, option: String },
    #[error("mount {spec:?}: cannot expand '~': HOME is not set; write the full host path")]
    NoHome { spec: String },
    #[error("mount {spec:?}: host directory {}: {source}{hint}", .path.display())]
    HostMissing {
        spec: String,
        path: PathBuf,
        source: std::io::Error,
        hint: &'static str,
    },
    #[error("mount {spec:?}: {} is not a directory; only directories can be shared", .path.display())]
    NotADirectory { spec: String, path: PathBuf },
    #[error("mount {spec:?}: guest path {} is not absolute; write HOST:/GUEST/PATH{hint}", .guest.display())]
    GuestNotAbsolute {
        spec: String,
        guest: PathBuf,
        hint: &'static str,
    },
    #[error("mount {spec:?}: guest path {}: {conflict}; choose another guest path with HOST:GUEST", .guest.display())]
    GuestConflict {
        spec: String,
        guest: PathBuf,
        conflict: GuestConflict,
    },
    #[error("the workspace {} cannot be shared at its own path in the guest: {conflict}; {}", .workspace.display(), .naming.another_workspace())]
    WorkspaceConflict {
        workspace: PathBuf,
        conflict: GuestConflict,
        naming: Naming,
    },
    #[error("mount {spec:?}: {} is a symlink in {}, which a VM can write: its guest could point it at any directory of this host, so it is not followed; name the directory it points to instead", .link.display(), .share.display())]
    ThroughGuestSymlink {
        spec: String,
        link: PathBuf,
        share: PathBuf,
    },
    #[error("the workspace {} is reached through {}, a symlink in {}, which a VM can write: its guest could point it at any directory of this host, so it is not followed; name the directory it points to instead", .way.display(), .link.display(), .share.display())]
    WorkspaceThroughGuestSymlink {
        way: PathBuf,
        link: PathBuf,
        share: PathBuf,
    },
    #[error("{} cannot be shared with the guest: it {relation} {what} {}, which must stay out of the VM; {}", .host.display(), .kept_out.display(), kept_out_remedy(*.instead, *.naming))]
    KeptOut {
        host: PathBuf,
        relation: Relation,
        what: &'static str,
        kept_out: PathBuf,
        /// What gives the VM what the user likely shared it for, if anything does.
        instead: Option<&'static str>,
        naming: Naming,
    },
    #[error("guest path {} is used by two mounts, of {} and of {}; give one of them another guest path with HOST:GUEST", .guest.display(), .first_host.display(), .second_host.display())]
    DuplicateGuest {
        guest: PathBuf,
        first_host: PathBuf,
        second_host: PathBuf,
    },
    #[error("the read-only mount of {} {} {}, which the VM can write (at {} in the guest): its guest could change those files there, so read-only would not hold; mount it without :ro, or share read-only a directory outside {}", .read_only.display(), if *.same { "is" } else { "lies inside" }, .writable.display(), .writable_guest.display(), .writable.display())]
    ReadOnlyInsideWritable {
        read_only: PathBuf,
        /// The same directory, not one inside.
        same: bool,
        writable: PathBuf,
        writable_guest: PathBuf,
    },
    #[error("guest path {} lies in the share of {} (mounted at {}), so the guest mounts it on {} of the host, which {}; {}, or choose a guest path outside {}", .0.guest.display(), .0.parent_host.display(), .0.parent_guest.display(), .0.mount_point.display(), .0.problem, .0.problem.remedy(), .0.parent_guest.display())]
    MountPointInShare(Box<MountPointInShare>),
    /// A writable share the user added (`--mount`, the config file's `mounts`) that is
    /// or holds a directory whose programs the host user runs, or lies inside a
    /// toolchain or version manager's ([`ProgramDir`](program_dirs::ProgramDir)): the
    /// guest could put a program there that the host later runs, outside the VM.
    /// Read-only, it is fine. The workspace itself (and a worktree's repository) is
    /// never refused for this: a project often holds a directory on PATH (an
    /// activated `.venv/bin`, `node_modules/.bin` named by its absolute path), and
    /// refusing its own workspace would leave it no VM; the guest writing a project's
    /// tools is what working in it means.
    #[error("mount {:?}: {}{}, and a guest that could write it {}", .0.spec, program_dir_place(&.0.host, .0.relation, &.0.program_dir), .0.what, program_dir_remedy(.0.cache, &.0.read_only_spec))]
    HostProgramDir(Box<HostProgramDir>),
    #[error("{} cannot be shared with the guest: {}, the host kernel's own view of its processes, devices or settings, not a directory of files (a guest that could write there could take over the host); share a project's directory instead ({})", .host.display(), pseudo_place(.host, .mount, .fs), .naming.another_share())]
    PseudoFilesystem {
        host: PathBuf,
        /// The file system's name.
        fs: String,
        /// Where it is mounted: the share's own file system, or one mounted inside it.
        mount: PathBuf,
        naming: Naming,
    },
    #[error("{} cannot be shared with the guest: it lies under {HOST_DEVICES}, where the host keeps its device nodes and the memory its programs share (/dev/shm){}, not a project's files: a guest that could write there could change what the host's programs read; share a project's directory instead ({})", .host.display(), .fs.as_ref().map(|(fs, mount)| format!(" (here {fs}, mounted at {})", mount.display())).unwrap_or_default(), .naming.another_share())]
    HostDevices {
        host: PathBuf,
        /// The file system it is on, and where that is mounted, when known.
        fs: Option<(String, PathBuf)>,
        naming: Naming,
    },
}

/// How a refused share stands to a directory kept out of the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Relation {
    Is,
    Holds,
    IsInside,
}

impl std::fmt::Display for Relation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Relation::Is => "is",
            Relation::Holds => "holds",
            Relation::IsInside => "is inside",
        })
    }
}

/// A share nested in another whose mount point is not a directory there on the host.
#[derive(Debug)]
pub struct MountPointInShare {
    pub guest: PathBuf,
    pub parent_host: PathBuf,
    pub parent_guest: PathBuf,
    pub mount_point: PathBuf,
    pub problem: MountPointProblem,
}

/// What is wrong with a nested share's mount point in its parent share, on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountPointProblem {
    Missing,
    /// A file, or anything else that is not a directory.
    NotADirectory,
    Symlink,
    /// It cannot be looked at (the error).
    Unreadable(String),
}

impl std::fmt::Display for MountPointProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Missing => f.write_str("does not exist"),
            Self::NotADirectory => f.write_str("is not a directory"),
            Self::Symlink => {
                f.write_str("is a symlink (which the guest would follow in its own files)")
            }
            Self::Unreadable(error) => write!(f, "cannot be looked at ({error})"),
        }
    }
}

impl MountPointProblem {
    /// What makes the mount point a directory of the parent share.
    fn remedy(&self) -> &'static str {
        match self {
            Self::Missing => "create that directory on the host (mkdir -p)",
            Self::NotADirectory => {
                "move what is there out of the way and create a directory in its place"
            }
            // mkdir -p would find the link's target and leave the link.
            Self::Symlink => "replace the link there with a directory (rm the link, then mkdir)",
            Self::Unreadable(_) => "make it a directory this user can look at",
        }
    }
}

/// How the command that met a refused share lets its user name other directories, for
/// the remedy its error gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// `exec`, `run`, `shell`, `up`: `--workspace DIR` and `--mount`.
    Options,
    /// `vmctl agent`: the current directory's workspace only (a Paseo provider runs it
    /// in the agent's directory), other shares in the config file.
    CurrentDirectory,
}

impl Naming {
    fn another_workspace(self) -> &'static str {
        match self {
            Naming::Options => {
                "run vmctl from a project's directory, or name one with --workspace DIR"
            }
            Naming::CurrentDirectory => "run `vmctl agent` from a project's directory",
        }
    }

    fn another_share(self) -> &'static str {
        match self {
            Naming::Options => "run vmctl from one, or name it with --workspace DIR or --mount",
            Naming::CurrentDirectory => {
                "run `vmctl agent` from one; other directories are shared with `mounts` in \
                 the config file"
            }
        }
    }
}

impl ShareError {
    /// The error as `vmctl agent` gives it: its remedies name no option it lacks.
    pub fn for_agent(self) -> ShareError {
        match self {
            ShareError::WorkspaceConflict {
                workspace,
                conflict,
                ..
            } => ShareError::WorkspaceConflict {
                workspace,
                conflict,
                naming: Naming::CurrentDirectory,
            },
            ShareError::KeptOut {
                host,
                relation,
                what,
                kept_out,
                instead,
                ..
            } => ShareError::KeptOut {
                host,
                relation,
                what,
                kept_out,
                instead,
                naming: Naming::CurrentDirectory,
            },
            ShareError::PseudoFilesystem {
                host, fs, mount, ..
            } => ShareError::PseudoFilesystem {
                host,
                fs,
                mount,
                naming: Naming::CurrentDirectory,
            },
            ShareError::HostDevices { host, fs, .. } => ShareError::HostDevices {
                host,
                fs,
                naming: Naming::CurrentDirectory,
            },
            other => other,
        }
    }
}

/// Shown when a spec with ':' went wrong: the user may have meant a path with ':'.
const COLON_HINT: &str =
    " (':' separates HOST, GUEST and ro; paths containing ':' cannot be written in this syntax)";

/// One host directory shared with the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Share {
    /// Canonical host directory.
    pub host: PathBuf,
    /// Absolute, normalized guest path where it is mounted.
    pub guest: PathBuf,
    pub read_only: bool,
}

/// A VM's shares and the virtiofsd binary that serves them: what a VMM, direct or in
/// the nested host, needs to start the daemons.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareSet {
    pub shares: Vec<Share>,
    pub virtiofsd: PathBuf,
    /// Where a virtiofsd that dies while the VM runs is recorded, one line each (for
    /// `vmctl ps` and `exec`).
    #[serde(default)]
    pub failure_file: Option<PathBuf>,
    /// How the guest caches the shares (virtiofsd's `--cache`, `--writeback`).
    #[serde(default)]
    pub cache: crate::virtiofsd::CachePolicy,
}

impl ShareSet {
    /// Where the guest sees the host directory `host`: under the share that holds it
    /// (the innermost, should shares nest), at that share's guest path.
    pub fn guest_path_of(&self, host: &Path) -> Option<PathBuf> {
        self.shares
            .iter()
            .filter_map(|share| Some((share, host.strip_prefix(&share.host).ok()?)))
            .max_by_key(|(share, _)| share.host.components().count())
            .map(|(share, within)| match within.as_os_str().is_empty() {
                true => share.guest.clone(),
                false => share.guest.join(within),
            })
    }
}

/// [`parse_mount_as_written`], the share alone.
#[cfg(test)]
fn parse_mount(spec: &str, base: &Path) -> Result<Share, ShareError> {
    parse_mount_as_written(spec, base).map(|mount| mount.share)
}

/// A mount as the user wrote it and as it resolved.
#[derive(Debug)]
pub struct WrittenMount {
    pub spec: String,
    /// The host path as written (`~` and relative paths expanded), before symlinks.
    pub written_host: PathBuf,
    pub share: Share,
}

/// Parses `HOST[:GUEST][:ro]` (a trailing `:rw` is accepted too). HOST may start with
/// `~/` or be relative to `base`; it must be an existing directory. GUEST defaults to
/// the canonical host path. The host path as written is kept for
/// [`check_no_guest_symlinks`].
pub fn parse_mount_as_written(spec: &str, base: &Path) -> Result<WrittenMount, ShareError> {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    parse_mount_with_home(spec, base, home.as_deref())
}

fn parse_mount_with_home(
    spec: &str,
    base: &Path,
    home: Option<&Path>,
) -> Result<WrittenMount, ShareError> {
    let syntax = |problem| ShareError::Syntax {
        spec: spec.to_string(),
        problem,
    };
    let hint = if spec.contains(':') { COLON_HINT } else { "" };
    let mut parts: Vec<&str> = spec.split(':').collect();
    let read_only = match parts.last() {
        Some(&"ro") if parts.len() > 1 => Some(true),
        Some(&"rw") if parts.len() > 1 => Some(false),
        _ => None,
    };
    if read_only.is_some() {
        parts.pop();
    }
    let (host, guest) = match parts.as_slice() {
        [host] => (*host, None),
        [host, guest] => (*host, Some(*guest)),
        [.., option] if read_only.is_none() && !option.starts_with('/') => {
            return Err(ShareError::UnknownOption {
                spec: spec.to_string(),
                option: option.to_string(),
            })
        }
        _ => return Err(syntax("too many ':'")),
    };
    if host.is_empty() {
        return Err(syntax("the host path is empty"));
    }
    if guest == Some("") {
        return Err(syntax("the guest path is empty"));
    }

    let host_path = expand_host(spec, host, base, home)?;
    let host = host_path
        .canonicalize()
        .map_err(|source| ShareError::HostMissing {
            spec: spec.to_string(),
            path: host_path.clone(),
            source,
            hint,
        })?;
    if !host.is_dir() {
        return Err(ShareError::NotADirectory {
            spec: spec.to_string(),
            path: host,
        });
    }

    let guest = match guest {
        Some(guest) => PathBuf::from(guest),
        None => host.clone(),
    };
    if !guest.is_absolute() {
        return Err(ShareError::GuestNotAbsolute {
            spec: spec.to_string(),
            guest,
            hint,
        });
    }
    let guest = normalize_absolute(&guest);
    if let Some(conflict) = guest_conflict(&guest) {
        return Err(ShareError::GuestConflict {
            spec: spec.to_string(),
            guest,
            conflict,
        });
    }
    Ok(WrittenMount {
        spec: spec.to_string(),
        written_host: host_path,
        share: Share {
            host,
            guest,
            read_only: read_only.unwrap_or(false),
        },
    })
}

/// Refuses a mount whose host path, as written, passes through a symlink inside a
/// read-write share (of this VM, or of any other: each guest can replace any entry in
/// its shares with a link to any host directory, which the next start would share,
/// with the mount's access). A mount of `./data` in the workspace must not become the
/// user's `~/.ssh`.
pub fn check_no_guest_symlinks(
    mounts: &[WrittenMount],
    shares: &[Share],
) -> Result<(), ShareError> {
    let writable: Vec<&Path> = shares
        .iter()
        .filter(|share| !share.read_only)
        .map(|share| share.host.as_path())
        .collect();
    for mount in mounts {
        if let Some((link, share)) = symlink_in_writable(&mount.written_host, &writable) {
            return Err(ShareError::ThroughGuestSymlink {
                spec: mount.spec.clone(),
                link,
                share: share.to_path_buf(),
            });
        }
    }
    Ok(())
}

/// Refuses a workspace reached on `way` (an absolute path, as the user named it or
/// their shell stands in it) through a symlink in a read-write share of any VM, unless
/// that share holds the workspace anyway: its guest could have pointed the link at any
/// host directory (`~/.aws`), which would become this VM's writable workspace. A link
/// within the share that holds the workspace leads nowhere its guest cannot reach.
pub fn check_workspace_way(way: &Path, shares: &[Share]) -> Result<(), ShareError> {
    let Ok(workspace) = way.canonicalize() else {
        // A missing workspace is refused, with its path, where it is opened.
        return Ok(());
    };
    let writable: Vec<&Path> = shares
        .iter()
        .filter(|share| !share.read_only && !workspace.starts_with(&share.host))
        .map(|share| share.host.as_path())
        .collect();
    match symlink_in_writable(way, &writable) {
        Some((link, share)) => Err(ShareError::WorkspaceThroughGuestSymlink {
            way: way.to_path_buf(),
            link,
            share: share.to_path_buf(),
        }),
        None => Ok(()),
    }
}

/// The first symlink on the way to `path` (absolute) that lies in one of `writable`
/// (canonical directories), with that directory. Links are followed as the kernel
/// follows them, one at a time, so a link of the user's own that leads on through a
/// guest's link is caught at the guest's.
fn symlink_in_writable<'a>(path: &Path, writable: &[&'a Path]) -> Option<(PathBuf, &'a Path)> {
    // What is left to walk, last component first.
    let reversed = |path: &Path| -> Vec<std::ffi::OsString> {
        path.components()
            .filter_map(|component| match component {
                Component::Normal(name) => Some(name.to_owned()),
                Component::ParentDir => Some("..".into()),
                Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
            })
            .rev()
            .collect()
    };
    let mut left = reversed(path);
    // Always without links: each one met is replaced by its target's components.
    let mut current = PathBuf::from("/");
    let mut links = 0;
    while let Some(name) = left.pop() {
        if name == ".." {
            current.pop();
            continue;
        }
        let next = current.join(&name);
        let is_link =
            std::fs::symlink_metadata(&next).is_ok_and(|meta| meta.file_type().is_symlink());
        if !is_link {
            current = next;
            continue;
        }
        if let Some(share) = writable.iter().find(|share| current.starts_with(share)) {
            return Some((next, share));
        }
        links += 1;
        let target = std::fs::read_link(&next).ok()?;
        if links > MAX_LINKS {
            return None;
        }
        if target.is_absolute() {
            current = PathBuf::from("/");
        }
        left.extend(reversed(&target));
    }
    None
}

/// `~` and `~/...` from `home`, relative paths from `base`.
fn expand_host(
    spec: &str,
    host: &str,
    base: &Path,
    home: Option<&Path>,
) -> Result<PathBuf, ShareError> {
    let below_home = if host == "~" {
        Some("")
    } else {
        host.strip_prefix("~/")
    };
    match below_home {
        Some(rest) => home.map(|home| home.join(rest)).ok_or(ShareError::NoHome {
            spec: spec.to_string(),
        }),
        None => Ok(base.join(host)),
    }
}

/// Removes `.` and resolves `..` without touching the filesystem: the path is a guest
/// path, so the host's symlinks mean nothing for it. `..` never climbs above `/`.
pub(crate) fn normalize_absolute(path: &Path) -> PathBuf {
    let mut normalized = PathBuf::from("/");
    for component in path.components() {
        match component {
            Component::Normal(name) => normalized.push(name),
            Component::ParentDir => {
                normalized.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    normalized
}

/// The workspace itself, at the same path in the guest, writable.
pub fn workspace_share(workspace: &Path) -> Result<Share, ShareError> {
    // The callers pass an already canonical workspace; if it vanished meanwhile the
    // daemon reports that when it starts.
    let host = workspace
        .canonicalize()
        .unwrap_or_else(|_| workspace.to_path_buf());
    if let Some(conflict) = guest_conflict(&host) {
        return Err(ShareError::WorkspaceConflict {
            workspace: host,
            conflict,
            naming: Naming::Options,
        });
    }
    Ok(Share {
        guest: host.clone(),
        host,
        read_only: false,
    })
}

/// Why no share may be mounted at a guest path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GuestConflict {
    #[error("it is the guest's root '/'")]
    Root,
    #[error("it is under {0}, which the guest's kernel owns")]
    KernelOwned(&'static str),
    #[error("a share there would hide the guest's {0}, which it runs on")]
    SystemDirectory(&'static str),
}

/// What is wrong with mounting a share at `guest` (absolute, normalized), if anything.
pub(crate) fn guest_conflict(guest: &Path) -> Option<GuestConflict> {
    if guest == Path::new("/") {
        return Some(GuestConflict::Root);
    }
    if let Some(reserved) = RESERVED_GUEST_DIRS
        .iter()
        .find(|dir| guest.starts_with(dir))
    {
        return Some(GuestConflict::KernelOwned(reserved));
    }
    SYSTEM_GUEST_DIRS
        .iter()
        .find(|dir| Path::new(dir).starts_with(guest))
        .map(|dir| GuestConflict::SystemDirectory(dir))
}

/// Refuses two shares at the same guest path (the second would hide the first), and a
/// read-only share of files another share lets the guest write: the same directory,
/// or one inside it (`--mount ./vendor:/vendor:ro` in the writable workspace), where
/// `:ro` would promise what does not hold.
pub fn check_shares(shares: &[Share]) -> Result<(), ShareError> {
    let mut by_guest: HashMap<&Path, &Path> = HashMap::new();
    for share in shares {
        if let Some(first_host) = by_guest.insert(&share.guest, &share.host) {
            return Err(ShareError::DuplicateGuest {
                guest: share.guest.clone(),
                first_host: first_host.to_path_buf(),
                second_host: share.host.clone(),
            });
        }
    }
    for read_only in shares.iter().filter(|share| share.read_only) {
        let writable = shares
            .iter()
            .find(|share| !share.read_only && read_only.host.starts_with(&share.host));
        if let Some(writable) = writable {
            return Err(ShareError::ReadOnlyInsideWritable {
                read_only: read_only.host.clone(),
                same: read_only.host == writable.host,
                writable: writable.host.clone(),
                writable_guest: writable.guest.clone(),
            });
        }
    }
    Ok(())
}

/// Refuses a share whose guest path lies inside another share (the innermost, which
/// the guest mounts first) unless its mount point is already a directory there on the
/// host, reached without links. Otherwise the guest would have to make it: it cannot
/// in a read-only share, and its init's failure to mount would power the VM off at
/// every boot with the reason only on the console; in a writable one it would make
/// it on the host, unasked.
pub fn check_mount_points(shares: &[Share]) -> Result<(), ShareError> {
    for share in shares {
        let parent = shares
            .iter()
            .filter(|other| other.guest != share.guest && share.guest.starts_with(&other.guest))
            .max_by_key(|other| other.guest.components().count());
        let Some(parent) = parent else {
            continue;
        };
        let Ok(below) = share.guest.strip_prefix(&parent.guest) else {
            continue;
        };
        let mut mount_point = parent.host.clone();
        for component in below.components() {
            mount_point.push(component);
            let problem = match std::fs::symlink_metadata(&mount_point) {
                Ok(meta) if meta.is_dir() => continue,
                Ok(meta) if meta.file_type().is_symlink() => MountPointProblem::Symlink,
                Ok(_) => MountPointProblem::NotADirectory,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => MountPointProblem::Missing,
                Err(e) => MountPointProblem::Unreadable(e.to_string()),
            };
            return Err(ShareError::MountPointInShare(Box::new(MountPointInShare {
                guest: share.guest.clone(),
                parent_host: parent.host.clone(),
                parent_guest: parent.guest.clone(),
                mount_point,
                problem,
            })));
        }
    }
    Ok(())
}

/// The order to mount in: parents before the shares nested in them (a parent mounted
/// later would hide its children). Otherwise the given order is kept.
pub fn mount_order(mut shares: Vec<Share>) -> Vec<Share> {
    shares.sort_by_key(|share| share.guest.components().count());
    shares
}

/// The virtio-fs tag of the share at `index`, by which the guest mounts it.
pub fn tag(index: usize) -> String {
    format!("vmctl{index}")
}

#[cfg(test)]
mod tests {
    use super::kept_out::KeptOut;
    use super::*;

    pub(super) fn share(host: &str, guest: &str) -> Share {
        Share {
            host: host.into(),
            guest: guest.into(),
            read_only: false,
        }
    }

    #[test]
    fn a_host_directory_is_found_under_the_innermost_share_that_holds_it() {
        let set = ShareSet {
            shares: vec![
                share("/home/me/project", "/home/me/project"),
                share("/home/me/project/data", "/data"),
                share("/srv/cache", "/cache"),
            ],
            virtiofsd: "virtiofsd".into(),
            failure_file: None,
            cache: Default::default(),
        };
        let guest = |host: &str| set.guest_path_of(Path::new(host));
        assert_eq!(guest("/home/me/project"), Some("/home/me/project".into()));
        assert_eq!(
            guest("/home/me/project/src"),
            Some("/home/me/project/src".into())
        );
        assert_eq!(guest("/home/me/project/data/x"), Some("/data/x".into()));
        assert_eq!(guest("/srv/cache"), Some("/cache".into()));
        assert_eq!(guest("/home/me/project2"), None);
        assert_eq!(guest("/home/me"), None);
        assert_eq!(guest("/tmp"), None);
    }

    #[test]
    fn host_only_mounts_at_the_same_path_read_write() {
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().canonicalize().unwrap();
        let spec = host.to_str().unwrap();
        assert_eq!(
            parse_mount(spec, Path::new("/")).unwrap(),
            Share {
                host: host.clone(),
                guest: host.clone(),
                read_only: false
            }
        );
        let read_only = parse_mount(&format!("{spec}:ro"), Path::new("/")).unwrap();
        assert!(read_only.read_only);
        assert_eq!(read_only.guest, host);
        assert!(
            !parse_mount(&format!("{spec}:rw"), Path::new("/"))
                .unwrap()
                .read_only
        );
    }

    #[test]
    fn guest_paths_are_normalized() {
        let dir = tempfile::tempdir().unwrap();
        let spec = format!("{}:/data/./x/../y/:ro", dir.path().display());
        let share = parse_mount(&spec, Path::new("/")).unwrap();
        assert_eq!(share.guest, PathBuf::from("/data/y"));
        assert!(share.read_only);
        assert_eq!(
            normalize_absolute(Path::new("/../../srv")),
            PathBuf::from("/srv")
        );
    }

    #[test]
    fn relative_and_home_hosts_are_expanded_and_canonicalized() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("a/b")).unwrap();
        let canonical = dir.path().canonicalize().unwrap().join("a/b");
        let relative = parse_mount_with_home("a/./b", dir.path(), None)
            .unwrap()
            .share;
        assert_eq!(relative.host, canonical);
        let from_home = parse_mount_with_home("~/a/b:/b", Path::new("/"), Some(dir.path()))
            .unwrap()
            .share;
        assert_eq!(from_home.host, canonical);
        assert_eq!(from_home.guest, PathBuf::from("/b"));
        let home_itself =
            parse_mount_with_home("~:/h", Path::new("/"), Some(&dir.path().join("a")))
                .unwrap()
                .share;
        assert_eq!(home_itself.host, canonical.parent().unwrap());
        assert!(matches!(
            parse_mount_with_home("~/a", Path::new("/"), None),
            Err(ShareError::NoHome { .. })
        ));
    }

    /// A mount through a symlink the guest could have made (in a read-write share) is
    /// refused; through a link elsewhere, or in a read-only share, it is followed.
    #[test]
    fn a_mount_is_not_led_anywhere_by_a_symlink_in_a_writable_share() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (workspace, secret) = (root.join("ws"), root.join("secret"));
        std::fs::create_dir_all(workspace.join("real")).unwrap();
        std::fs::create_dir_all(&secret).unwrap();
        std::os::unix::fs::symlink(&secret, workspace.join("data")).unwrap();
        std::os::unix::fs::symlink(&workspace, root.join("ws-link")).unwrap();
        let workspace_share = |read_only| Share {
            host: workspace.clone(),
            guest: workspace.clone(),
            read_only,
        };
        let check = |spec: &str, read_only| {
            let mount = parse_mount_as_written(spec, &workspace).unwrap();
            check_no_guest_symlinks(&[mount], &[workspace_share(read_only)])
        };
        let err = check("data:/data:ro", false).unwrap_err();
        assert!(
            matches!(err, ShareError::ThroughGuestSymlink { .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains("name the directory it points to"),
            "{err}"
        );
        assert!(check("data:/data:ro", true).is_ok());
        assert!(check("real:/real", false).is_ok());
        // The host's own link to the workspace is followed; the guest's inside it not.
        let through = format!("{}/data:/data", root.join("ws-link").display());
        assert!(check(&through, false).is_err());
        let fine = format!("{}/real:/real", root.join("ws-link").display());
        assert!(check(&fine, false).is_ok());
        // A link of the host's own whose target leads on through the guest's link is
        // followed a link at a time, and so stopped at the guest's.
        std::os::unix::fs::symlink(workspace.join("data"), root.join("current")).unwrap();
        std::os::unix::fs::symlink("ws/data", root.join("current-relative")).unwrap();
        std::os::unix::fs::symlink("ws/./real/../real", root.join("real-link")).unwrap();
        for via_guest_link in ["current", "current-relative"] {
            let spec = format!("{}:/out", root.join(via_guest_link).display());
            let err = check(&spec, false).unwrap_err();
            assert!(
                matches!(err, ShareError::ThroughGuestSymlink { ref link, .. } if *link == workspace.join("data")),
                "{via_guest_link}: {err}"
            );
        }
        let spec = format!("{}:/out", root.join("real-link").display());
        assert!(
            check(&spec, false).is_ok(),
            "a host link to a real directory"
        );
    }

    #[test]
    fn a_workspace_reached_through_a_guests_link_elsewhere_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (project, secret) = (root.join("proj"), root.join("dot-aws"));
        std::fs::create_dir_all(project.join("packages/web")).unwrap();
        std::fs::create_dir_all(&secret).unwrap();
        std::os::unix::fs::symlink(&secret, project.join("sub")).unwrap();
        std::os::unix::fs::symlink("packages/web", project.join("web")).unwrap();
        let writable = |read_only| {
            [Share {
                host: project.clone(),
                guest: project.clone(),
                read_only,
            }]
        };
        let err = check_workspace_way(&project.join("sub"), &writable(false)).unwrap_err();
        assert!(
            matches!(err, ShareError::WorkspaceThroughGuestSymlink { ref link, .. } if *link == project.join("sub")),
            "{err}"
        );
        assert!(
            err.to_string().contains("name the directory it points to"),
            "{err}"
        );
        // Through a read-only share, or a link that stays within the share that holds
        // the workspace, or straight: fine.
        check_workspace_way(&project.join("sub"), &writable(true)).unwrap();
        check_workspace_way(&project.join("web"), &writable(false)).unwrap();
        check_workspace_way(&secret, &writable(false)).unwrap();
    }

    #[test]
    fn bad_hosts_are_refused_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let error = parse_mount(missing.to_str().unwrap(), Path::new("/")).unwrap_err();
        assert!(matches!(error, ShareError::HostMissing { .. }));
        assert!(error.to_string().contains("missing"), "{error}");
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let error = parse_mount(file.to_str().unwrap(), Path::new("/")).unwrap_err();
        assert!(matches!(error, ShareError::NotADirectory { .. }), "{error}");
    }

    #[test]
    fn bad_guest_paths_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().display().to_string();
        let parse = |guest: &str| parse_mount(&format!("{host}:{guest}"), Path::new("/"));
        assert!(matches!(
            parse("relative"),
            Err(ShareError::GuestNotAbsolute { .. })
        ));
        let conflict = |guest: &str| match parse(guest) {
            Err(ShareError::GuestConflict { conflict, .. }) => Some(conflict),
            _ => None,
        };
        assert_eq!(conflict("/"), Some(GuestConflict::Root));
        assert_eq!(conflict("/x/.."), Some(GuestConflict::Root));
        for reserved in ["/proc", "/sys/fs", "/dev/shm", "/x/../proc/1"] {
            assert!(
                matches!(conflict(reserved), Some(GuestConflict::KernelOwned(_))),
                "{reserved}"
            );
        }
        for system in ["/usr", "/usr/bin", "/etc", "/var", "/lib/"] {
            assert!(
                matches!(conflict(system), Some(GuestConflict::SystemDirectory(_))),
                "{system}"
            );
        }
        let message = parse("/usr/bin").unwrap_err().to_string();
        assert!(
            message.contains("guest path /usr/bin: a share there would hide the guest's /usr/bin"),
            "{message}"
        );
        assert!(parse("/procfs").is_ok());
        assert!(parse("/tmp/data").is_ok());
        assert!(parse("/etc/myapp").is_ok());
        assert!(parse("/usr/local/src").is_ok());
        assert!(parse("/var/tmp/x").is_ok());
    }

    #[test]
    fn colons_in_paths_are_explained() {
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().display();
        for spec in [format!("{host}:/a:/b"), format!("{host}:/a:/b:ro")] {
            let error = parse_mount(&spec, Path::new("/")).unwrap_err();
            assert!(error.to_string().contains("containing ':'"), "{error}");
        }
        for (spec, option) in [
            (format!("{host}:/a:rx"), "rx"),
            (format!("{host}:/a:RO"), "RO"),
        ] {
            let error = parse_mount(&spec, Path::new("/")).unwrap_err().to_string();
            assert!(
                error.contains(&format!("unknown option {option:?}")) && error.contains("ro"),
                "{error}"
            );
        }
        let error = parse_mount(&format!("{host}:x"), Path::new("/")).unwrap_err();
        assert!(error.to_string().contains("containing ':'"), "{error}");
        for spec in [":/a", "", ":ro", &format!("{host}::ro")] {
            assert!(
                matches!(
                    parse_mount(spec, Path::new("/")),
                    Err(ShareError::Syntax { .. })
                ),
                "{spec:?}"
            );
        }
    }

    #[test]
    fn the_workspace_is_shared_writable_at_its_own_path() {
        let dir = tempfile::tempdir().unwrap();
        let canonical = dir.path().canonicalize().unwrap();
        assert_eq!(workspace_share(dir.path()).unwrap(), share_of(&canonical));
        // A workspace where no share may go is refused, not mounted over the guest's
        // own directories (or, for '/', left out by the guest without a word).
        for (workspace, conflict) in [
            ("/", GuestConflict::Root),
            ("/etc", GuestConflict::SystemDirectory("/etc")),
            ("/usr", GuestConflict::SystemDirectory("/usr/bin")),
        ] {
            let error = workspace_share(Path::new(workspace)).unwrap_err();
            assert!(
                matches!(&error, ShareError::WorkspaceConflict { conflict: c, .. } if *c == conflict),
                "{workspace}: {error}"
            );
            assert!(error.to_string().contains("--workspace DIR"), "{error}");
        }
    }

    /// `vmctl agent` takes neither --workspace nor --mount: its refusals must not
    /// tell its user to use them.
    #[test]
    fn an_agents_refusals_name_no_option_it_lacks() {
        let root = tempfile::tempdir().unwrap();
        let kept_out = [KeptOut {
            dir: root.path().to_path_buf(),
            what: "your home directory",
            inside_too: false,
            instead: None,
        }];
        let share = share(root.path().to_str().unwrap(), "/x");
        let errors = [
            workspace_share(Path::new("/etc")).unwrap_err(),
            check_kept_out(&share, &kept_out).unwrap_err(),
        ];
        for error in errors {
            let (for_exec, for_agent) = (error.to_string(), error.for_agent().to_string());
            assert!(for_exec.contains("--workspace DIR"), "{for_exec}");
            assert!(
                !for_agent.contains("--workspace") && !for_agent.contains("--mount"),
                "{for_agent}"
            );
            assert!(for_agent.contains("run `vmctl agent` from"), "{for_agent}");
        }
    }

    fn share_of(path: &Path) -> Share {
        Share {
            host: path.to_path_buf(),
            guest: path.to_path_buf(),
            read_only: false,
        }
    }

    #[test]
    fn duplicate_guest_paths_name_both_hosts() {
        assert!(check_shares(&[share("/a", "/x"), share("/b", "/y")]).is_ok());
        let error = check_shares(&[share("/a", "/x"), share("/b", "/y"), share("/c", "/x")])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("/x") && error.contains("/a") && error.contains("/c"),
            "{error}"
        );
    }

    #[test]
    fn parents_are_mounted_before_children_and_order_is_otherwise_kept() {
        let ordered = mount_order(vec![
            share("/1", "/w/a/b"),
            share("/2", "/z"),
            share("/3", "/w/a"),
            share("/4", "/a"),
        ]);
        let hosts: Vec<_> = ordered.iter().map(|s| s.host.clone()).collect();
        assert_eq!(hosts, ["/2", "/4", "/3", "/1"].map(PathBuf::from));
    }

    fn read_only(host: &str, guest: &str) -> Share {
        Share {
            read_only: true,
            ..share(host, guest)
        }
    }

    /// `:ro` must hold: a read-only share of files the guest can write through another
    /// share (the same directory, or one inside it) is refused, naming both. A
    /// writable share inside a read-only one, or a read-only one beside, is fine.
    #[test]
    fn a_read_only_share_inside_a_writable_one_is_refused() {
        let workspace = share("/home/me/project", "/home/me/project");
        for (inner, relation) in [
            (
                read_only("/home/me/project/vendor", "/vendor"),
                "lies inside",
            ),
            (read_only("/home/me/project", "/ro"), "is"),
        ] {
            let error = check_shares(&[workspace.clone(), inner.clone()]).unwrap_err();
            assert!(
                matches!(error, ShareError::ReadOnlyInsideWritable { same, .. } if same == (relation == "is")),
                "{error}"
            );
            let message = error.to_string();
            assert!(
                message.starts_with(&format!(
                    "the read-only mount of {} {relation} /home/me/project, which the VM can write",
                    inner.host.display()
                )),
                "{message}"
            );
        }
        assert!(check_shares(&[
            workspace.clone(),
            read_only("/home/me/project-data", "/data"),
            read_only("/srv", "/srv"),
            share("/srv/out", "/out"),
        ])
        .is_ok());
    }

    /// A share mounted inside another is mounted on a directory the guest would have
    /// to make in that share: refused before the VM starts unless it is there on the
    /// host, as a directory (not a link).
    #[test]
    fn a_nested_mount_point_must_exist_in_the_parent_share() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (parent, child) = (root.join("d"), root.join("e"));
        std::fs::create_dir_all(parent.join("there/deeper")).unwrap();
        std::fs::create_dir_all(&child).unwrap();
        std::fs::write(parent.join("file"), "").unwrap();
        std::os::unix::fs::symlink(root.join("e"), parent.join("link")).unwrap();
        let host = |path: &Path| path.to_str().unwrap().to_string();
        for parent_share in [read_only(&host(&parent), "/x"), share(&host(&parent), "/x")] {
            let check = |guest: &str| {
                check_mount_points(&[parent_share.clone(), share(&host(&child), guest)])
            };
            assert!(check("/x/there").is_ok());
            assert!(check("/x/there/deeper").is_ok());
            assert!(check("/elsewhere").is_ok(), "not nested");
            // Each problem with the remedy that fixes it: mkdir -p would change nothing
            // at a link (it follows it) or a file (it fails).
            for (guest, problem, remedy) in [
                ("/x/y", "does not exist", "mkdir -p"),
                ("/x/there/y", "does not exist", "mkdir -p"),
                (
                    "/x/file",
                    "is not a directory",
                    "move what is there out of the way",
                ),
                (
                    "/x/link",
                    "is a symlink",
                    "replace the link there with a directory",
                ),
                (
                    "/x/link/sub",
                    "is a symlink",
                    "replace the link there with a directory",
                ),
            ] {
                let error = check(guest).unwrap_err();
                let message = error.to_string();
                assert!(
                    matches!(error, ShareError::MountPointInShare(_))
                        && message.contains(problem)
                        && message.contains(&format!(
                            "guest path {guest} lies in the share of {}",
                            parent.display()
                        ))
                        && message.contains(remedy),
                    "{guest}: {message}"
                );
                assert_eq!(
                    message.contains("mkdir -p"),
                    remedy == "mkdir -p",
                    "{guest}: {message}"
                );
            }
        }
        // The innermost share is the one the mount point must be in.
        let inner = root.join("inner");
        std::fs::create_dir_all(inner.join("z")).unwrap();
        let shares = [
            share(&host(&parent), "/x"),
            share(&host(&inner), "/x/there"),
            share(&host(&child), "/x/there/z"),
        ];
        assert!(check_mount_points(&shares).is_ok());
    }

    #[test]
    fn tags_are_numbered() {
        assert_eq!(tag(0), "vmctl0");
        assert_eq!(tag(12), "vmctl12");
    }
}
