//! Directory shares of a workspace VM: which host directories the guest sees, where,
//! and whether it may write them. Each share becomes one virtio-fs device.
//!
//! The CLI and the user's config write a share as `HOST[:GUEST][:ro]`.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

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
    /// toolchain or version manager's ([`ProgramDir`]): the
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

/// What to do instead of sharing a directory kept out of the guest.
fn kept_out_remedy(instead: Option<&str>, naming: Naming) -> String {
    let another = naming.another_share();
    match instead {
        Some(instead) => {
            format!("{instead}. To share files, share a project's directory ({another})")
        }
        None => format!("share a project's directory instead ({another})"),
    }
}

/// A writable mount refused as [`ShareError::HostProgramDir`].
#[derive(Debug)]
pub struct HostProgramDir {
    pub spec: String,
    pub host: PathBuf,
    pub relation: Relation,
    pub program_dir: PathBuf,
    pub what: &'static str,
    /// The same mount, read-only.
    pub read_only_spec: String,
    /// Whether the directory is a build tool's cache (see [`ProgramDir::cache`]).
    pub cache: bool,
}

/// What a guest could do with a writable share of a directory of the user's programs
/// (or a build tool's cache: `cache`), and what to do instead.
fn program_dir_remedy(cache: bool, read_only_spec: &str) -> String {
    if cache {
        format!(
            "could change what your next build or install on this host runs; mount it \
             read-only ({read_only_spec:?}), or leave it out (the guest keeps a cache of its \
             own)"
        )
    } else {
        format!(
            "could put a program there that you then run on this host; mount it read-only \
             ({read_only_spec:?}), or share a directory that holds none of your programs"
        )
    }
}

/// How a refused share stands to a directory of the user's programs, for
/// [`ShareError::HostProgramDir`].
fn program_dir_place(host: &Path, relation: Relation, program_dir: &Path) -> String {
    match relation {
        Relation::Is => format!("{} is ", host.display()),
        Relation::Holds | Relation::IsInside => {
            format!("{} {relation} {}, ", host.display(), program_dir.display())
        }
    }
}

/// `spec` (`HOST[:GUEST][:ro|:rw]`) made read-only.
fn read_only_spec(spec: &str) -> String {
    let writable = spec.strip_suffix(":rw").unwrap_or(spec);
    format!("{writable}:ro")
}

/// Where a pseudo file system is, for [`ShareError::PseudoFilesystem`].
fn pseudo_place(host: &Path, mount: &Path, fs: &str) -> String {
    if host.starts_with(mount) {
        format!("it is on {fs}")
    } else {
        format!(
            "{} inside it is a mount of {fs} (virtiofsd serves what is mounted inside a \
             share too)",
            mount.display()
        )
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

/// A host directory the guest must never reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptOut {
    pub dir: PathBuf,
    pub what: &'static str,
    /// Whether a share inside it is refused too, not only one that is it or holds it.
    pub inside_too: bool,
    /// What gives the VM what it would be shared for, if anything does (a refusal
    /// says it).
    pub instead: Option<&'static str>,
}

impl KeptOut {
    /// `dir` kept out, resolved as far as it exists: a directory not made yet may still
    /// lie behind a link (`~/.config` into a dotfiles repository), where a guest could
    /// make it.
    fn resolved(dir: &Path, what: &'static str, inside_too: bool) -> KeptOut {
        KeptOut {
            dir: crate::state::resolve_existing_part(dir),
            what,
            inside_too,
            instead: None,
        }
    }
}

/// What no share may be or hold: the home directory (its `.ssh`, the agents' sign-ins,
/// cloud credentials: the host's secrets, which the VM must not have), the
/// directories in it that hold those credentials ([`CREDENTIAL_DIRS`], and where
/// `CLAUDE_CONFIG_DIR` and `CODEX_HOME` move the agents' sign-ins), and vmctl's own
/// config, state and cache directories, which no share may be inside either (the
/// secrets the egress proxy adds and the policy it enforces, which a guest that could
/// write them would rewrite; every VM's state, the egress CAs' keys among it; the
/// kernels, images and guest agent every VM boots).
pub fn kept_out_of_the_guest() -> Vec<KeptOut> {
    let (home, account_home) = homes();
    let config_file = crate::user_config::config_path();
    let config = config_file
        .as_deref()
        .and_then(Path::parent)
        .map(Path::to_path_buf);
    let account_config = account_home.as_ref().map(|home| home.join(".config/vmctl"));
    let homes: Vec<PathBuf> = home.into_iter().chain(account_home).collect();
    let configs: Vec<PathBuf> = config.into_iter().chain(account_config).collect();
    let egress = crate::network::guest_setup::EgressFiles::locate();
    let config_files: Vec<PathBuf> = config_file
        .into_iter()
        .chain(
            egress
                .into_iter()
                .flat_map(|files| [files.policy, files.secrets]),
        )
        .chain([crate::agent::env_file()])
        .collect();
    let mut kept_out = kept_out_from(
        &homes,
        &configs,
        &config_files,
        crate::state::state_dir(),
        crate::artifacts::cache_dir(),
    );
    kept_out.extend(sign_in_dirs_moved());
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    // A runtime directory that is not the user's alone (`XDG_RUNTIME_DIR=/tmp`) is a
    // temporary directory, kept out as such.
    let runtime: Vec<PathBuf> = [
        Some(PathBuf::from(format!("/run/user/{uid}"))),
        std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from),
    ]
    .into_iter()
    .flatten()
    .filter(|dir| dir.is_absolute() && crate::state::is_ours_alone(dir))
    .collect();
    kept_out.extend(session_dirs_kept_out(
        &[PathBuf::from("/tmp"), std::env::temp_dir()],
        &runtime,
        crate::state::private_tmp_dir(),
    ));
    kept_out
}

/// The directories every program of the user's session shares, which no share may be
/// or hold: the temporary directories (`tmp`: Kerberos tickets, other programs' files,
/// the jobs of `vmctl nested-exec` with their whole environment) and the user's
/// runtime directories (`runtime`, nothing inside them either: podman's registry
/// sign-in, keyring and agent sockets; but for one that holds a temporary directory,
/// `TMPDIR=/run/user/1000/tmp`, whose projects may be shared: then only its `vmctl`
/// and `containers` are kept out from inside). Both also hold vmctl's own sockets:
/// the daemon's, and the VMs' where a VM's own directory makes their paths too long
/// (`private`, nothing inside it either): a guest that could write there would point
/// the VMM's sockets elsewhere with a link (its own guest agent, another VM's, the
/// host's Docker socket).
fn session_dirs_kept_out(tmp: &[PathBuf], runtime: &[PathBuf], private: PathBuf) -> Vec<KeptOut> {
    const RUNTIME: &str =
        "your runtime directory (your session's sockets and credentials, vmctl's sockets)";
    let tmp: Vec<KeptOut> = tmp
        .iter()
        .map(|dir| {
            KeptOut::resolved(
                dir,
                "a temporary directory every program shares (their files and tickets, \
                 vmctl's sockets)",
                false,
            )
        })
        .collect();
    let runtime: Vec<KeptOut> = runtime
        .iter()
        .flat_map(|dir| {
            let whole = KeptOut::resolved(dir, RUNTIME, true);
            if !tmp.iter().any(|tmp| tmp.dir.starts_with(&whole.dir)) {
                return vec![whole];
            }
            let inside = ["vmctl", "containers"]
                .map(|inside| KeptOut::resolved(&dir.join(inside), RUNTIME, true));
            let whole = KeptOut {
                inside_too: false,
                ..whole
            };
            [whole].into_iter().chain(inside).collect()
        })
        .collect();
    let private = KeptOut::resolved(
        &private,
        "vmctl's own directory for sockets (the VMs' and the daemon's)",
        true,
    );
    // The first that a share meets is what it is told; the same directory twice
    // (TMPDIR unset, XDG_RUNTIME_DIR the usual one) would never be met.
    let mut kept_out: Vec<KeptOut> = Vec::new();
    for candidate in runtime.into_iter().chain(tmp).chain([private]) {
        if !kept_out.iter().any(|k| k.dir == candidate.dir) {
            kept_out.push(candidate);
        }
    }
    kept_out
}

/// `HOME`, and the account's own home from the password database. HOME may be unset,
/// or point elsewhere (a service's, a test's): what is in the account's own home is
/// kept from the guest all the same.
fn homes() -> (Option<PathBuf>, Option<PathBuf>) {
    let home = std::env::var_os("HOME")
        .filter(|home| !home.is_empty())
        .map(PathBuf::from);
    // SAFETY: getuid cannot fail.
    let account_home = crate::guest_account::password_entry(unsafe { libc::getuid() })
        .map(|(_, home)| PathBuf::from(home))
        .filter(|home| home.is_absolute() && home != Path::new("/"));
    (home, account_home)
}

/// A directory whose programs the host user runs: a guest that could write it could
/// plant a program there that runs on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgramDir {
    /// Resolved as far as it exists: one not made yet is where a guest could make it.
    pub dir: PathBuf,
    pub what: &'static str,
    /// Whether a share inside it is refused too: so for a toolchain or version
    /// manager's directory, whose programs lie anywhere below
    /// (`~/.rustup/toolchains/*/bin`); a directory on PATH holds its programs at its
    /// top.
    pub inside_too: bool,
    /// Whether it is a build tool's cache or home (cargo's registry, Go's modules,
    /// npm's cache...), which the guest can do without, rather than where programs are.
    pub cache: bool,
}

/// The directories under a home that login shells and installers put on PATH, whether
/// or not vmctl's own PATH has them (a desktop app's or a service's has not), with
/// what each is.
const USUAL_PROGRAM_DIRS: [(&str, &str); 4] = [
    (
        "bin",
        "your own programs' directory, which login shells put on PATH",
    ),
    (
        ".local/bin",
        "where pip, pipx and others install your programs, which login shells put on PATH",
    ),
    (
        ".cargo/bin",
        "where cargo install and rustup put your programs, on your PATH",
    ),
    (
        "go/bin",
        "where go install puts your programs, which you put on PATH",
    ),
];

/// The directories of the toolchain and version managers that the programs on PATH
/// lead into: rustup's proxies in `~/.cargo/bin` run the toolchains in `~/.rustup`,
/// pyenv's, rbenv's, asdf's and Volta's shims run the versions in their own
/// directories, pipx's programs in `~/.local/bin` are links into its environments, and
/// nvm and Bun put directories of their own on PATH. Each with the variable that moves
/// it, where it is under the home otherwise, and what it is.
const MANAGER_DIRS: [(&[&str], &str, &str); 8] = [
    (
        &["RUSTUP_HOME"],
        ".rustup",
        "rustup's home, whose toolchains the cargo and rustc you run are",
    ),
    (
        &["PYENV_ROOT"],
        ".pyenv",
        "pyenv's root, whose Python versions its shims on your PATH run",
    ),
    (
        &["RBENV_ROOT"],
        ".rbenv",
        "rbenv's root, whose Ruby versions its shims on your PATH run",
    ),
    (
        &["ASDF_DATA_DIR"],
        ".asdf",
        "asdf's data directory, whose tool versions its shims on your PATH run",
    ),
    (
        &["NVM_DIR"],
        ".nvm",
        "nvm's directory, whose Node versions your shell puts on PATH",
    ),
    (
        &["PIPX_HOME"],
        ".local/share/pipx",
        "pipx's home, whose environments the programs it puts in ~/.local/bin run",
    ),
    (
        &["VOLTA_HOME"],
        ".volta",
        "Volta's home, whose Node tools its shims on your PATH run",
    ),
    (
        &["BUN_INSTALL"],
        ".bun",
        "Bun's home, whose programs your shell puts on PATH",
    ),
];

/// Cargo's sources of the crates it builds, under `$CARGO_HOME`: cargo does not check
/// an unpacked crate again, so a build script or proc macro changed there runs at the
/// host's next `cargo build`. Shared read-only they are safe (and save the guest the
/// downloads).
const CARGO_SOURCE_DIRS: [(&str, &str); 2] = [
    (
        "registry",
        "cargo's registry, whose unpacked crates' build scripts and proc macros your cargo build runs",
    ),
    (
        "git",
        "cargo's git checkouts, whose crates' build scripts and proc macros your cargo build runs",
    ),
];

/// Package managers' and build tools' caches and homes whose contents the host's next
/// build or install uses without checking them again (or, like Gradle's `init.d`,
/// runs at every build): a guest that could write them would choose what runs on the
/// host. Each with the variable that moves it (if any), where it is under the home
/// otherwise, and what it is. npm's, pnpm's and Yarn's caches check a package against
/// the checksum their index holds, which sits in the same cache; pip installs a wheel
/// it built before as it finds it. Shared read-only they are safe.
const BUILD_CACHE_DIRS: [(&[&str], &str, &str); 9] = [
    (
        &["GRADLE_USER_HOME"],
        ".gradle",
        "Gradle's home, whose init scripts, plugins and libraries your Gradle builds run",
    ),
    (
        &[],
        ".m2",
        "Maven's directory, whose settings, plugins and libraries your Maven builds run",
    ),
    (&["GOMODCACHE"], "go/pkg/mod", GO_MODULES),
    (
        &["GOCACHE"],
        ".cache/go-build",
        "Go's build cache, whose compiled packages your go builds link without checking them again",
    ),
    (
        &["PIP_CACHE_DIR"],
        ".cache/pip",
        "pip's cache, whose wheels pip installs without checking them again",
    ),
    (
        &["npm_config_cache", "NPM_CONFIG_CACHE"],
        ".npm",
        "npm's cache, whose packages (and the checksums they are checked against) npm installs",
    ),
    (
        &["PNPM_HOME"],
        ".local/share/pnpm",
        "pnpm's home, whose store and global programs your pnpm installs and PATH use",
    ),
    (
        &["YARN_CACHE_FOLDER"],
        ".cache/yarn",
        "Yarn's cache, whose packages (and the checksums they are checked against) yarn installs",
    ),
    (
        &["UV_CACHE_DIR"],
        ".cache/uv",
        "uv's cache, whose wheels and Python environments uv installs without checking them again",
    ),
];

const GO_MODULES: &str =
    "Go's module cache, whose modules your go builds compile without checking them again";

/// Where the XDG variables move what is under the home by default: a table entry
/// under `.cache` is also looked for under `$XDG_CACHE_HOME`, one under
/// `.local/share` under `$XDG_DATA_HOME` (where the tools follow them: Go's build
/// cache, pip, Yarn, uv, pnpm).
const XDG_BASES: [(&str, &str); 2] = [
    ("XDG_CACHE_HOME", ".cache"),
    ("XDG_DATA_HOME", ".local/share"),
];

const ON_PATH: &str = "a directory on your PATH";

/// A directory on PATH outside the homes, which counts only where the user can write
/// it (Linuxbrew's `/home/linuxbrew/.linuxbrew/bin`, a `/opt/TOOL/bin` of one's own).
const ON_PATH_WRITABLE: &str = "a directory on your PATH that you can write";

/// The directories whose programs the host user runs:
/// - under a home (made yet or not): each absolute entry of this process's `PATH` that
///   lies there, the usual ones (`~/bin`, `~/.local/bin`, `~/.cargo/bin`, `~/go/bin`),
///   `$CARGO_HOME/bin`, `bin` and `pkg/mod` of each `$GOPATH` entry, `$GOBIN`, and the
///   toolchain and version managers' directories
///   ([`MANAGER_DIRS`]: `$RUSTUP_HOME`, `$PYENV_ROOT`, `~/.rbenv`, `$ASDF_DATA_DIR`,
///   `~/.nvm`, pipx's `~/.local/share/pipx`, `~/.volta`, `~/.bun`), and the build
///   tools' caches whose contents the host's builds use unchecked
///   ([`BUILD_CACHE_DIRS`]: Gradle's, Maven's, Go's, pip's, npm's, pnpm's, Yarn's,
///   uv's);
/// - outside the homes, the same where the user can write them, or make them
///   ([`user_can_write`]): Linuxbrew's bin, a `RUSTUP_HOME` in `/opt`.
///
/// A relative entry (`node_modules/.bin`) names no directory of its own and is left
/// out. Where each program on PATH leads (its link's target, the directory a shim
/// runs from) is not followed: that would read every program at each start, and could
/// change under us; the managers' directories cover the common places instead, and a
/// program linked elsewhere is not seen.
pub fn host_program_dirs() -> Vec<ProgramDir> {
    let (home, account_home) = homes();
    let homes: Vec<PathBuf> = home.into_iter().chain(account_home).collect();
    program_dirs_from(
        std::env::var_os("PATH").as_deref(),
        &homes,
        set_variable,
        user_can_write,
    )
}

/// Whether this user may write `dir`, or make it where it is not made yet: write
/// access to it or to the nearest directory above it that exists, or owning that
/// directory (its owner may give itself write access).
fn user_can_write(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some((existing, meta)) = dir
        .ancestors()
        .find_map(|dir| std::fs::metadata(dir).ok().map(|meta| (dir, meta)))
    else {
        return false;
    };
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    meta.uid() == uid || rustix::fs::access(existing, rustix::fs::Access::WRITE_OK).is_ok()
}

/// A place that may hold programs the user runs, before it is resolved and judged.
struct Candidate {
    dir: PathBuf,
    what: &'static str,
    /// What it is when it lies outside the homes.
    what_outside: &'static str,
    inside_too: bool,
    cache: bool,
}

impl Candidate {
    /// A directory of programs (`inside_too`: anywhere below it too), the same
    /// whether under a home or not.
    fn programs(dir: PathBuf, what: &'static str, inside_too: bool) -> Candidate {
        Candidate {
            dir,
            what,
            what_outside: what,
            inside_too,
            cache: false,
        }
    }

    /// A build tool's cache or home: what lies anywhere below it counts.
    fn cache(dir: PathBuf, what: &'static str) -> Candidate {
        Candidate {
            cache: true,
            ..Candidate::programs(dir, what, true)
        }
    }
}

fn program_dirs_from(
    path: Option<&std::ffi::OsStr>,
    homes: &[PathBuf],
    var: impl Fn(&str) -> Option<std::ffi::OsString>,
    can_write: impl Fn(&Path) -> bool,
) -> Vec<ProgramDir> {
    let on_path = path
        .map(|path| std::env::split_paths(path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|dir| Candidate {
            what_outside: ON_PATH_WRITABLE,
            ..Candidate::programs(dir, ON_PATH, false)
        });
    let usual = homes.iter().flat_map(|home| {
        USUAL_PROGRAM_DIRS
            .iter()
            .map(|(dir, what)| Candidate::programs(home.join(dir), what, false))
    });
    let cargo_what = USUAL_PROGRAM_DIRS[2].1;
    let cargo = var("CARGO_HOME")
        .map(|cargo| Candidate::programs(PathBuf::from(cargo).join("bin"), cargo_what, false));
    let cargo_homes: Vec<PathBuf> = var("CARGO_HOME")
        .map(PathBuf::from)
        .into_iter()
        .chain(homes.iter().map(|home| home.join(".cargo")))
        .collect();
    let cargo_sources = cargo_homes.into_iter().flat_map(|cargo_home| {
        CARGO_SOURCE_DIRS
            .iter()
            .map(move |(dir, what)| Candidate::cache(cargo_home.join(dir), what))
    });
    let managers_and_caches = MANAGER_DIRS
        .iter()
        .map(|dir| (dir, false))
        .chain(BUILD_CACHE_DIRS.iter().map(|dir| (dir, true)))
        .flat_map(|(&(variables, under_home, what), cache)| {
            let moved = variables.iter().filter_map(|v| var(v)).map(PathBuf::from);
            let xdg_moved = XDG_BASES.iter().filter_map(|(variable, default)| {
                let rest = Path::new(under_home).strip_prefix(default).ok()?;
                Some(PathBuf::from(var(variable)?).join(rest))
            });
            // Where it is by default too: a variable set for vmctl may not be the shells'.
            let defaults = homes.iter().map(|home| home.join(under_home));
            moved
                .chain(xdg_moved)
                .chain(defaults)
                .map(|dir| {
                    if cache {
                        Candidate::cache(dir, what)
                    } else {
                        Candidate::programs(dir, what, true)
                    }
                })
                .collect::<Vec<_>>()
        });
    // GOPATH is a list; `go install` puts programs in its first entry's bin (or
    // GOBIN), modules in its first entry's pkg/mod (or GOMODCACHE): each entry counts.
    let go_paths: Vec<PathBuf> = var("GOPATH")
        .map(|paths| std::env::split_paths(&paths).collect())
        .unwrap_or_default();
    let go_bin_what = USUAL_PROGRAM_DIRS[3].1;
    let go = go_paths
        .iter()
        .flat_map(|go_path| {
            [
                Candidate::programs(go_path.join("bin"), go_bin_what, false),
                Candidate::cache(go_path.join("pkg/mod"), GO_MODULES),
            ]
        })
        .chain(var("GOBIN").map(|bin| Candidate::programs(PathBuf::from(bin), go_bin_what, false)))
        .collect::<Vec<_>>();
    let resolved_homes: Vec<PathBuf> = homes
        .iter()
        .map(|home| crate::state::resolve_existing_part(home))
        .collect();
    let mut dirs: Vec<ProgramDir> = Vec::new();
    for candidate in on_path
        .chain(usual)
        .chain(cargo)
        .chain(cargo_sources)
        .chain(managers_and_caches)
        .chain(go)
    {
        if !candidate.dir.is_absolute() {
            continue;
        }
        let resolved = crate::state::resolve_existing_part(&candidate.dir);
        // Under a home as named, or where it leads (`~/bin` a link into dotfiles
        // elsewhere is still the user's).
        let under_home = homes.iter().any(|home| candidate.dir.starts_with(home))
            || resolved_homes.iter().any(|home| resolved.starts_with(home));
        let what = if under_home {
            candidate.what
        } else if can_write(&resolved) {
            candidate.what_outside
        } else {
            continue;
        };
        match dirs.iter_mut().find(|known| known.dir == resolved) {
            Some(known) => known.inside_too |= candidate.inside_too,
            None => dirs.push(ProgramDir {
                dir: resolved,
                what,
                inside_too: candidate.inside_too,
                cache: candidate.cache,
            }),
        }
    }
    dirs
}

/// Refuses a writable `mount` that is, or holds, one of `program_dirs`, or lies inside
/// one whose programs lie anywhere below ([`ShareError::HostProgramDir`]). For the shares the user adds only: see there why
/// not the workspace.
pub fn check_not_program_dir(
    mount: &WrittenMount,
    program_dirs: &[ProgramDir],
) -> Result<(), ShareError> {
    let share = &mount.share;
    if share.read_only {
        return Ok(());
    }
    for program_dir in program_dirs {
        let relation = if share.host == program_dir.dir {
            Relation::Is
        } else if program_dir.dir.starts_with(&share.host) {
            Relation::Holds
        } else if program_dir.inside_too && share.host.starts_with(&program_dir.dir) {
            Relation::IsInside
        } else {
            continue;
        };
        return Err(ShareError::HostProgramDir(Box::new(HostProgramDir {
            spec: mount.spec.clone(),
            host: share.host.clone(),
            relation,
            program_dir: program_dir.dir.clone(),
            what: program_dir.what,
            read_only_spec: read_only_spec(&mount.spec),
            cache: program_dir.cache,
        })));
    }
    Ok(())
}

/// A directory under a home that holds credentials (keys, tokens, sign-ins). Sharing
/// one would hand the VM the secrets vmctl otherwise keeps on the host (the agents'
/// and GitHub's tokens go to the egress proxy, never into the VM).
pub struct CredentialDir {
    /// Its path under the home.
    pub dir: &'static str,
    pub what: &'static str,
    /// Whether a directory inside it is kept out too: so it is where the secrets may
    /// lie anywhere below (`~/.ssh/work/id_ed25519`); the agents' directories and
    /// Cargo's keep theirs at the top (`~/.claude/.credentials.json`,
    /// `~/.codex/auth.json`, `~/.cargo/credentials.toml`) and hold what may be shared
    /// below (the agents' projects and worktrees, Cargo's download cache).
    pub inside_too: bool,
    /// What gives the VM what it is likely shared for, without the secret.
    pub instead: Option<&'static str>,
}

/// What gives git and gh in the VM their access to GitHub, for `~/.ssh` and
/// `~/.config/gh`.
const GITHUB_INSTEAD: &str = "for git push and gh in the VM, store a GitHub token with \
     `vmctl secret set github` (on stdin: `gh auth token | vmctl secret set github`): it \
     stays on the host, and the egress proxy adds it to the VM's requests to GitHub (git \
     over HTTPS; an SSH remote would need the key itself)";

pub const CREDENTIAL_DIRS: [CredentialDir; 20] = [
    CredentialDir {
        dir: ".ssh",
        what: "your SSH keys' directory",
        inside_too: true,
        instead: Some(GITHUB_INSTEAD),
    },
    CredentialDir {
        dir: ".gnupg",
        what: "your GnuPG keys' directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".aws",
        what: "the AWS CLI's credentials directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".azure",
        what: "the Azure CLI's sign-in directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".config/gcloud",
        what: "the Google Cloud CLI's sign-in directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".kube",
        what: "kubectl's credentials directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".docker",
        what: "Docker's registry sign-in directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".config/gh",
        what: "the GitHub CLI's sign-in directory",
        inside_too: true,
        instead: Some(GITHUB_INSTEAD),
    },
    CredentialDir {
        dir: ".password-store",
        what: "your pass password store",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".local/share/keyrings",
        what: "your desktop keyrings' directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".config/git",
        what: "git's own config directory (its credential store among it)",
        inside_too: true,
        instead: Some(GITHUB_INSTEAD),
    },
    CredentialDir {
        dir: ".config/containers",
        what: "podman's config directory (its registry sign-in)",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".terraform.d",
        what: "Terraform's credentials directory",
        inside_too: true,
        instead: None,
    },
    CredentialDir {
        dir: ".config/rclone",
        what: "rclone's config directory (its cloud storage tokens)",
        inside_too: true,
        instead: None,
    },
    // Their tops hold the repositories' passwords (`gradle.properties`, Maven's
    // `settings.xml` and `settings-security.xml`), which read-only would hand the guest
    // just the same; the caches below may be shared read-only (writable, they are
    // refused as the host's builds use them unchecked: [`BUILD_CACHE_DIRS`]).
    CredentialDir {
        dir: ".gradle",
        what: "Gradle's home (gradle.properties holds your repositories' passwords)",
        inside_too: false,
        instead: Some("share the dependency cache in it (`caches`) read-only instead"),
    },
    CredentialDir {
        dir: ".m2",
        what: "Maven's home (settings.xml holds your repositories' passwords)",
        inside_too: false,
        instead: Some("share the repository in it (`repository`) read-only instead"),
    },
    CredentialDir {
        dir: ".claude",
        what: "Claude Code's sign-in directory",
        inside_too: false,
        instead: Some(CLAUDE_INSTEAD),
    },
    CredentialDir {
        dir: ".codex",
        what: "Codex's sign-in directory",
        inside_too: false,
        instead: Some(CODEX_INSTEAD),
    },
    CredentialDir {
        dir: ".gemini",
        what: "the Gemini CLI's sign-in directory",
        inside_too: false,
        instead: None,
    },
    // Its top holds the crates.io token (`cargo publish`); below, the toolchain's
    // proxies and the download cache hold none, and are left shareable: refusing what
    // is inside would take the cache from a VM's builds to keep out no secret. (Its
    // `bin`, which the host runs, is refused writable: [`ProgramDir`].)
    CredentialDir {
        dir: ".cargo",
        what: "Cargo's home and crates.io token directory",
        inside_too: false,
        instead: Some(CARGO_INSTEAD),
    },
];

const CLAUDE_INSTEAD: &str = "Claude Code in the VM signs in through the egress proxy \
     instead: `vmctl secret set anthropic` (an API key or OAuth token, on stdin), which stays \
     on the host";

const CODEX_INSTEAD: &str = "Codex in the VM signs in through the egress proxy instead: \
     `vmctl secret set openai` (an API key, on stdin), which stays on the host";

const CARGO_INSTEAD: &str = "the directories inside it hold no token and may be shared \
     (its download cache read-only, say: `--mount ~/.cargo/registry:ro`)";

/// The variables that move a credential directory, the directory ([`CREDENTIAL_DIRS`])
/// they move, and what it is then: the variable is named, since unsetting it for
/// vmctl is what lifts a refusal of a project that keeps it (direnv, CI setups).
const CREDENTIAL_DIR_VARIABLES: [(&str, &str, &str); 10] = [
    (
        "CLAUDE_CONFIG_DIR",
        ".claude",
        "Claude Code's sign-in directory (CLAUDE_CONFIG_DIR)",
    ),
    (
        "CODEX_HOME",
        ".codex",
        "Codex's sign-in directory (CODEX_HOME)",
    ),
    (
        "CARGO_HOME",
        ".cargo",
        "Cargo's home and crates.io token directory (CARGO_HOME)",
    ),
    (
        "GNUPGHOME",
        ".gnupg",
        "your GnuPG keys' directory (GNUPGHOME)",
    ),
    (
        "DOCKER_CONFIG",
        ".docker",
        "Docker's registry sign-in directory (DOCKER_CONFIG)",
    ),
    (
        "GH_CONFIG_DIR",
        ".config/gh",
        "the GitHub CLI's sign-in directory (GH_CONFIG_DIR)",
    ),
    (
        "PASSWORD_STORE_DIR",
        ".password-store",
        "your pass password store (PASSWORD_STORE_DIR)",
    ),
    (
        "CLOUDSDK_CONFIG",
        ".config/gcloud",
        "the Google Cloud CLI's sign-in directory (CLOUDSDK_CONFIG)",
    ),
    (
        "GRADLE_USER_HOME",
        ".gradle",
        "Gradle's home (GRADLE_USER_HOME; gradle.properties holds your repositories' passwords)",
    ),
    (
        "TF_CLI_CONFIG_DIR",
        ".terraform.d",
        "Terraform's credentials directory (TF_CLI_CONFIG_DIR)",
    ),
];

/// Where [`CREDENTIAL_DIR_VARIABLES`] move the credential directories, and the files
/// `KUBECONFIG` names (kubectl's cluster credentials, which may lie in a project:
/// that project is then refused, as it holds them).
fn sign_in_dirs_moved() -> Vec<KeptOut> {
    sign_in_dirs_moved_by(set_variable)
}

/// The environment variable `name`'s value, unless it is unset or empty (as tools take
/// an empty one).
fn set_variable(name: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(name).filter(|value| !value.is_empty())
}

fn sign_in_dirs_moved_by(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Vec<KeptOut> {
    let kube_configs = var("KUBECONFIG")
        .map(|list| std::env::split_paths(&list).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .filter(|file| file.is_absolute())
        .map(|file| KeptOut::resolved(&file, "kubectl's credentials file (KUBECONFIG)", false));
    CREDENTIAL_DIR_VARIABLES
        .into_iter()
        .filter_map(|(variable, default, what)| {
            let dir = PathBuf::from(var(variable)?);
            let usual = CREDENTIAL_DIRS.iter().find(|c| c.dir == default)?;
            dir.is_absolute().then(|| KeptOut {
                instead: usual.instead,
                ..KeptOut::resolved(&dir, what, usual.inside_too)
            })
        })
        .chain(kube_configs)
        .collect()
}

fn kept_out_from(
    homes: &[PathBuf],
    configs: &[PathBuf],
    config_files: &[PathBuf],
    state: PathBuf,
    cache: Option<PathBuf>,
) -> Vec<KeptOut> {
    // The files vmctl reads may be links (GNU stow, chezmoi): the directory of each
    // link on the way is kept out as well, where a guest could change where it leads.
    let linked_config_files: Vec<KeptOut> = config_files
        .iter()
        .flat_map(|file| directories_of_links(file))
        .map(|dir| {
            KeptOut::resolved(
                &dir,
                "the directory a link to a file vmctl reads leads into",
                true,
            )
        })
        .collect();
    let credentials: Vec<KeptOut> = homes
        .iter()
        .flat_map(|home| {
            CREDENTIAL_DIRS.iter().map(|credentials| KeptOut {
                instead: credentials.instead,
                ..KeptOut::resolved(
                    &home.join(credentials.dir),
                    credentials.what,
                    credentials.inside_too,
                )
            })
        })
        .collect();
    let homes = homes
        .iter()
        .map(|dir| KeptOut::resolved(dir, "your home directory", false));
    let configs = configs.iter().map(|dir| {
        KeptOut::resolved(
            dir,
            "vmctl's config directory (secrets, egress policy)",
            true,
        )
    });
    let others = [
        Some(KeptOut::resolved(
            &state,
            "vmctl's state directory (every VM's state)",
            true,
        )),
        cache.map(|dir| {
            KeptOut::resolved(
                &dir,
                "vmctl's cache (the kernels, images and guest agent every VM boots)",
                true,
            )
        }),
    ]
    .into_iter()
    .flatten();
    // In this order: the first a share meets is what it is told.
    homes
        .chain(configs)
        .chain(credentials)
        .chain(others)
        .chain(linked_config_files)
        .collect()
}

/// The kernel's own bound on links in one lookup (MAXSYMLINKS): past it a lookup fails
/// (ELOOP), and so would what vmctl looks up, elsewhere.
const MAX_LINKS: usize = 40;

/// Where each link from `file` on leads, one link at a time: the directories of the
/// links' targets (not `file`'s own), as far as they exist.
fn directories_of_links(file: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut link = file.to_path_buf();
    while dirs.len() < MAX_LINKS {
        let Ok(target) = std::fs::read_link(&link) else {
            break;
        };
        // A relative target is followed from the link's own directory.
        let Some(next) = link.parent().map(|parent| parent.join(target)) else {
            break;
        };
        let (Some(dir), Some(name)) = (next.parent(), next.file_name()) else {
            break;
        };
        let dir = crate::state::resolve_existing_part(dir);
        link = dir.join(name);
        dirs.push(dir);
    }
    dirs
}

/// Refuses `share` if it is, holds or (where that counts) lies inside a directory that
/// is kept out of the guest.
pub fn check_kept_out(share: &Share, kept_out: &[KeptOut]) -> Result<(), ShareError> {
    for kept in kept_out {
        let relation = if share.host == kept.dir {
            Relation::Is
        } else if kept.dir.starts_with(&share.host) {
            Relation::Holds
        } else if kept.inside_too && share.host.starts_with(&kept.dir) {
            Relation::IsInside
        } else {
            continue;
        };
        return Err(ShareError::KeptOut {
            host: share.host.clone(),
            relation,
            what: kept.what,
            kept_out: kept.dir.clone(),
            instead: kept.instead,
            naming: Naming::Options,
        });
    }
    Ok(())
}

/// File systems that are the kernel's view of the host rather than files, by
/// `statfs`'s `f_type` and by the name `/proc/self/mountinfo` gives them.
const PSEUDO_FILESYSTEMS: [(u32, &str); 18] = [
    (0x0000_9fa0, "proc"),
    (0x6265_6572, "sysfs"),
    (0x6462_6720, "debugfs"),
    (0x7472_6163, "tracefs"),
    (0x7363_6673, "securityfs"),
    (0x0027_e0eb, "cgroup"),
    (0x6367_7270, "cgroup2"),
    (0xcafe_4a11, "bpf"),
    (0x0000_1cd1, "devpts"),
    (0x6165_676c, "pstore"),
    (0xde5e_81e4, "efivarfs"),
    (0x6265_6570, "configfs"),
    (0x6573_5543, "fusectl"),
    (0x4249_4e4d, "binfmt_misc"),
    (0x1980_0202, "mqueue"),
    (0x6e73_6673, "nsfs"),
    (0xf97c_ff8c, "selinuxfs"),
    (0x4341_5d53, "smackfs"),
];

/// The host's device nodes: a pseudo file system that `statfs` cannot tell from a
/// tmpfs (they share a magic number), known by its name only.
const DEVTMPFS: &str = "devtmpfs";

/// Where the host's device nodes are, and the memory its programs share (`/dev/shm`).
const HOST_DEVICES: &str = "/dev";

/// One line of `/proc/self/mountinfo`: where a file system is mounted, and its type.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    point: PathBuf,
    fs: String,
}

/// This process's mounts, in the order they were made (a later one over an earlier);
/// None if they cannot be read.
fn mounts() -> Option<Vec<Mount>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    Some(text.lines().filter_map(parse_mountinfo_line).collect())
}

/// `ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER_OPTIONS`,
/// with space, tab, newline and backslash in paths written as octal escapes.
fn parse_mountinfo_line(line: &str) -> Option<Mount> {
    let mut fields = line.split(' ');
    let point = fields.nth(4)?;
    let fs = fields.skip_while(|field| *field != "-").nth(1)?;
    Some(Mount {
        point: PathBuf::from(std::ffi::OsString::from(
            <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&unescape_octal(point)),
        )),
        fs: fs.to_string(),
    })
}

/// `text` with each `\NNN` (three octal digits) replaced by that byte.
fn unescape_octal(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let digits = bytes.get(i + 1..i + 4);
        let value = digits
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)))
            .and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        match value {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    out
}

/// Whether `fs` (a name from mountinfo) is the kernel's view of the host.
fn is_pseudo(fs: &str) -> bool {
    fs == DEVTMPFS || PSEUDO_FILESYSTEMS.iter().any(|(_, name)| *name == fs)
}

/// Refuses a share on a pseudo file system ([`PSEUDO_FILESYSTEMS`], devtmpfs), one
/// with such a file system mounted inside it (virtiofsd serves the mounts inside a
/// share: `/srv/chroot` with the host's proc at `/srv/chroot/proc`), and anything
/// under `/dev`: as root, a guest that could write the host's
/// `/proc/sys/kernel/core_pattern` would run what it likes on the host. A share whose
/// file system cannot be looked at is left to virtiofsd, which says what is wrong
/// with it; where the mounts cannot be read, only the share's own file system is
/// looked at.
pub fn check_not_pseudo_filesystem(share: &Share) -> Result<(), ShareError> {
    check_not_pseudo_in(
        &share.host,
        filesystem_type(&share.host),
        &mounts().unwrap_or_default(),
    )
}

/// [`check_not_pseudo_filesystem`] of the directory `host`, whose file system's
/// `statfs` type is `f_type`, among `mounts`.
fn check_not_pseudo_in(
    host: &Path,
    f_type: Option<u32>,
    mounts: &[Mount],
) -> Result<(), ShareError> {
    let pseudo = |fs: &str, mount: &Path| ShareError::PseudoFilesystem {
        host: host.to_path_buf(),
        fs: fs.to_string(),
        mount: mount.to_path_buf(),
        naming: Naming::Options,
    };
    // The mount the share is on: the last made whose mount point holds it.
    let own = mounts.iter().rev().find(|m| host.starts_with(&m.point));
    let by_magic = f_type.and_then(|f_type| {
        PSEUDO_FILESYSTEMS
            .iter()
            .find(|(magic, _)| *magic == f_type)
            .map(|(_, name)| *name)
    });
    if let Some(name) = by_magic {
        let point = own.map_or(host, |m| m.point.as_path());
        return Err(pseudo(name, point));
    }
    if let Some(own) = own.filter(|m| is_pseudo(&m.fs)) {
        return Err(pseudo(&own.fs, &own.point));
    }
    if host.starts_with(HOST_DEVICES) {
        return Err(ShareError::HostDevices {
            host: host.to_path_buf(),
            fs: own.map(|m| (m.fs.clone(), m.point.clone())),
            naming: Naming::Options,
        });
    }
    match mounts
        .iter()
        .find(|m| m.point != host && m.point.starts_with(host) && is_pseudo(&m.fs))
    {
        Some(inside) => Err(pseudo(&inside.fs, &inside.point)),
        None => Ok(()),
    }
}

/// `statfs(2)`'s `f_type` of the file system `path` is on (magic numbers are 32 bits).
fn filesystem_type(path: &Path) -> Option<u32> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut info = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `path` is NUL-terminated and `info` is a writable statfs buffer, which
    // the call fills when it returns 0.
    if unsafe { libc::statfs(path.as_ptr(), info.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statfs returned 0, so it filled `info`.
    let info = unsafe { info.assume_init() };
    // The kernel's magic numbers fit in 32 bits; f_type's width varies by platform.
    Some(info.f_type as u32)
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
    use super::*;

    fn share(host: &str, guest: &str) -> Share {
        Share {
            host: host.into(),
            guest: guest.into(),
            read_only: false,
        }
    }

    #[test]
    fn the_cache_every_vm_boots_from_is_kept_out_of_the_guest() {
        let cache = crate::artifacts::cache_dir().expect("HOME is set in tests");
        let cache = cache.canonicalize().unwrap_or(cache);
        let kept = kept_out_of_the_guest();
        let entry = kept.iter().find(|k| k.dir == cache).expect("the cache");
        assert!(entry.inside_too, "a share inside the cache is allowed");
    }

    /// vmctl's config directory is kept out where it will be, before it exists, and so
    /// is where its files lead when they are links (a dotfiles repository): a guest
    /// that could write them would widen every later VM's shares and its own egress.
    #[test]
    fn the_config_is_kept_out_behind_links_and_before_it_exists() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let dotfiles = root.join("dotfiles");
        std::fs::create_dir_all(dotfiles.join(".config")).unwrap();
        std::fs::create_dir_all(dotfiles.join("vmctl")).unwrap();
        std::fs::write(dotfiles.join("vmctl/config.toml"), "").unwrap();
        std::os::unix::fs::symlink(dotfiles.join(".config"), root.join("xdg")).unwrap();
        let shared_dotfiles = share(dotfiles.to_str().unwrap(), "/d");
        let state = root.join("state");

        // ~/.config is a link into the dotfiles; ~/.config/vmctl is not made yet.
        let config_file = root.join("xdg/vmctl/config.toml");
        let kept = kept_out_from(
            &[],
            &[root.join("xdg/vmctl")],
            std::slice::from_ref(&config_file),
            state.clone(),
            None,
        );
        assert!(
            kept.iter().any(|k| k.dir == dotfiles.join(".config/vmctl")),
            "{kept:?}"
        );
        assert!(check_kept_out(&shared_dotfiles, &kept).is_err());

        // The config file is a link into the dotfiles (GNU stow).
        let config = root.join("cfg/vmctl");
        std::fs::create_dir_all(&config).unwrap();
        std::os::unix::fs::symlink(
            "../../dotfiles/vmctl/config.toml",
            config.join("config.toml"),
        )
        .unwrap();
        let kept = kept_out_from(
            &[],
            std::slice::from_ref(&config),
            &[config.join("config.toml")],
            state,
            None,
        );
        assert!(
            kept.iter().any(|k| k.dir == dotfiles.join("vmctl")),
            "{kept:?}"
        );
        assert!(check_kept_out(&shared_dotfiles, &kept).is_err());
        assert!(check_kept_out(&share(root.join("cfg").to_str().unwrap(), "/c"), &kept).is_err());
        assert!(check_kept_out(
            &share(root.join("elsewhere").to_str().unwrap(), "/e"),
            &kept
        )
        .is_ok());

        // A config file named elsewhere ($VMCTL_CONFIG), a link into a chain of links:
        // the directory of each link on the way is kept out, as a guest that could
        // write one could point the chain elsewhere.
        std::fs::create_dir_all(root.join("hop")).unwrap();
        std::os::unix::fs::symlink(
            dotfiles.join("vmctl/config.toml"),
            root.join("hop/work.toml"),
        )
        .unwrap();
        std::os::unix::fs::symlink(root.join("hop/work.toml"), root.join("work.toml")).unwrap();
        let named = root.join("work.toml");
        let kept = kept_out_from(
            &[],
            std::slice::from_ref(&root),
            &[named],
            root.join("state"),
            None,
        );
        for dir in [root.join("hop"), dotfiles.join("vmctl")] {
            assert!(kept.iter().any(|k| k.dir == dir), "{dir:?} in {kept:?}");
        }
    }

    /// In `root`: a home with `.local/bin`, `.local/share`, `.cargo/bin`,
    /// `.cargo/registry/src` and `project/.venv/bin`, its `bin` a link into `dotfiles`.
    /// Returns the home and a PATH naming some of them, a system directory, a
    /// relative and an empty entry, and a directory outside the home.
    fn home_with_programs(root: &Path) -> (PathBuf, std::ffi::OsString) {
        let home = root.join("home");
        for dir in [
            ".local/bin",
            ".local/share",
            ".cargo/bin",
            ".cargo/registry/src",
            "project/.venv/bin",
        ] {
            std::fs::create_dir_all(home.join(dir)).unwrap();
        }
        std::fs::create_dir_all(root.join("dotfiles/bin")).unwrap();
        std::fs::create_dir_all(root.join("elsewhere/bin")).unwrap();
        std::os::unix::fs::symlink(root.join("dotfiles/bin"), home.join("bin")).unwrap();
        let path = std::env::join_paths([
            home.join(".local/bin"),
            "/usr/bin".into(),
            "node_modules/.bin".into(),
            "".into(),
            home.join("project/.venv/bin"),
            root.join("elsewhere/bin"),
        ])
        .unwrap();
        (home, path)
    }

    /// No variable set.
    fn unset(_: &str) -> Option<std::ffi::OsString> {
        None
    }

    /// Nothing outside the home writable (as for a user other than root).
    fn nothing_writable(_: &Path) -> bool {
        false
    }

    /// The directories whose programs the user runs: PATH's absolute entries under the
    /// home (no relative one, none elsewhere that the user cannot write), and the
    /// usual ones whether on PATH or not, made yet or not, taken through links.
    #[test]
    fn program_dirs_are_the_path_entries_under_the_home_and_the_usual_ones() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (home, path) = home_with_programs(&root);
        let cargo_home = |name: &str| (name == "CARGO_HOME").then(|| root.join("opt-cargo").into());
        let dirs = program_dirs_from(
            Some(&path),
            std::slice::from_ref(&home),
            cargo_home,
            nothing_writable,
        );
        let found: Vec<(&Path, &str)> = dirs
            .iter()
            .filter(|d| !d.inside_too)
            .map(|d| (d.dir.as_path(), d.what))
            .collect();
        assert_eq!(
            found,
            [
                (home.join(".local/bin").as_path(), ON_PATH),
                (home.join("project/.venv/bin").as_path(), ON_PATH),
                (root.join("dotfiles/bin").as_path(), USUAL_PROGRAM_DIRS[0].1),
                (home.join(".cargo/bin").as_path(), USUAL_PROGRAM_DIRS[2].1),
                (home.join("go/bin").as_path(), USUAL_PROGRAM_DIRS[3].1),
            ]
        );
        // A CARGO_HOME under the home counts, not made yet.
        let cargo_home = |name: &str| (name == "CARGO_HOME").then(|| home.join("c").into());
        let dirs = program_dirs_from(
            None,
            std::slice::from_ref(&home),
            cargo_home,
            nothing_writable,
        );
        assert!(dirs.iter().any(|d| d.dir == home.join("c/bin")), "{dirs:?}");
    }

    /// The toolchain and version managers' directories, which the programs on PATH
    /// lead into, count whole (what is inside them too), made yet or not, where their
    /// variables put them as well as where they are by default.
    #[test]
    fn the_managers_directories_are_program_dirs() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (home, path) = home_with_programs(&root);
        let moved = |name: &str| match name {
            "RUSTUP_HOME" => Some(home.join("toolchains/rustup").into()),
            "GOMODCACHE" => Some(home.join("src/go-modules").into()),
            "NPM_CONFIG_CACHE" => Some(home.join("npm-cache").into()),
            "XDG_CACHE_HOME" => Some(home.join("xdg-cache").into()),
            "GOPATH" => std::env::join_paths([home.join("code/go"), home.join("vendor-go")]).ok(),
            "GOBIN" => Some(home.join("go-programs").into()),
            // Outside the home, where this user cannot write: not theirs to fear for.
            "PYENV_ROOT" => Some(root.join("system-pyenv").into()),
            _ => None,
        };
        let dirs = program_dirs_from(
            Some(&path),
            std::slice::from_ref(&home),
            moved,
            nothing_writable,
        );
        let cargo_sources: Vec<&str> = CARGO_SOURCE_DIRS.iter().map(|(_, what)| *what).collect();
        let managers: Vec<(PathBuf, &str)> = dirs
            .iter()
            .filter(|d| d.inside_too && !cargo_sources.contains(&d.what))
            .map(|d| (d.dir.clone(), d.what))
            .collect();
        let sources: Vec<PathBuf> = dirs
            .iter()
            .filter(|d| d.inside_too && cargo_sources.contains(&d.what))
            .map(|d| d.dir.clone())
            .collect();
        assert_eq!(
            sources,
            vec![home.join(".cargo/registry"), home.join(".cargo/git")]
        );
        let mut expected = vec![(home.join("toolchains/rustup"), MANAGER_DIRS[0].2)];
        expected.extend(
            MANAGER_DIRS
                .iter()
                .map(|(_, under_home, what)| (home.join(under_home), *what)),
        );
        for (variables, under_home, what) in BUILD_CACHE_DIRS {
            if variables.contains(&"GOMODCACHE") {
                expected.push((home.join("src/go-modules"), what));
            }
            if variables.contains(&"NPM_CONFIG_CACHE") {
                expected.push((home.join("npm-cache"), what));
            }
            if let Ok(rest) = Path::new(under_home).strip_prefix(".cache") {
                expected.push((home.join("xdg-cache").join(rest), what));
            }
            expected.push((home.join(under_home), what));
        }
        // Each GOPATH entry's module cache.
        expected.push((home.join("code/go/pkg/mod"), GO_MODULES));
        expected.push((home.join("vendor-go/pkg/mod"), GO_MODULES));
        assert_eq!(managers, expected);
        // And its programs, and GOBIN's.
        for bin in ["code/go/bin", "vendor-go/bin", "go-programs"] {
            assert!(
                dirs.iter()
                    .any(|d| d.dir == home.join(bin) && !d.inside_too),
                "{bin}: {dirs:?}"
            );
        }
        // None of them made yet.
        assert!(expected.iter().all(|(dir, _)| !dir.exists()));
    }

    /// PATH's entries, and the managers' directories, outside the home count where the
    /// user can write them (Linuxbrew's, one in /opt of the user's own), or make them.
    #[test]
    fn writable_program_dirs_outside_the_home_count() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (home, path) = home_with_programs(&root);
        let brew = root.join("linuxbrew/.linuxbrew/bin");
        std::fs::create_dir_all(&brew).unwrap();
        let mut entries: Vec<PathBuf> = std::env::split_paths(&path).collect();
        entries.push(brew.clone());
        let path = std::env::join_paths(entries).unwrap();
        let rustup = root.join("opt/rustup");
        let moved = |name: &str| (name == "RUSTUP_HOME").then(|| rustup.clone().into());
        // The user's own: everything below `linuxbrew` and `opt` (not made yet).
        let ours = |dir: &Path| {
            dir.starts_with(root.join("linuxbrew")) || dir.starts_with(root.join("opt"))
        };
        let dirs = program_dirs_from(Some(&path), std::slice::from_ref(&home), moved, ours);
        let outside: Vec<(&Path, &str, bool)> = dirs
            .iter()
            .filter(|d| !d.dir.starts_with(&home) && d.dir != root.join("dotfiles/bin"))
            .map(|d| (d.dir.as_path(), d.what, d.inside_too))
            .collect();
        assert_eq!(
            outside,
            [
                (brew.as_path(), ON_PATH_WRITABLE, false),
                (rustup.as_path(), MANAGER_DIRS[0].2, true),
            ]
        );
    }

    /// This user can write a directory of theirs, and make one in it; not one that
    /// only another user may write (where the tests do not run as root, who may).
    #[test]
    fn what_the_user_can_write_is_found() {
        let dir = tempfile::tempdir().unwrap();
        assert!(user_can_write(dir.path()));
        assert!(user_can_write(&dir.path().join("not/made/yet")));
        // SAFETY: getuid cannot fail.
        if unsafe { libc::getuid() } != 0 {
            assert!(!user_can_write(Path::new("/usr/bin")));
            assert!(!user_can_write(Path::new("/usr/not-made-yet/bin")));
        }
    }

    /// A writable share the user adds that is or holds a directory of the user's
    /// programs, or lies inside a manager's, is refused, saying what to do; read-only
    /// it is fine, and so are the directories beside them (`~/.local/share/fonts`,
    /// Cargo's download cache).
    #[test]
    fn a_writable_mount_of_a_directory_of_the_users_programs_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let (home, path) = home_with_programs(&root);
        for made in [
            ".rustup/toolchains/stable-x86_64-unknown-linux-gnu",
            ".local/share/pipx/venvs/black",
            ".local/share/fonts",
            ".gradle/caches",
            ".m2",
            ".cache/ms-playwright",
            "go",
            ".npm",
        ] {
            std::fs::create_dir_all(home.join(made)).unwrap();
        }
        let dirs = program_dirs_from(
            Some(&path),
            std::slice::from_ref(&home),
            unset,
            nothing_writable,
        );
        let check = |spec: &str| {
            let mount = parse_mount_with_home(spec, &root, Some(&home)).unwrap();
            check_not_program_dir(&mount, &dirs)
        };
        let refusal = |spec: &str| match check(spec) {
            Err(ShareError::HostProgramDir(refused)) => {
                format!("{} {}", refused.relation, refused.program_dir.display())
            }
            other => panic!("{spec}: {other:?}"),
        };
        assert_eq!(
            refusal("~/.local/bin"),
            format!("is {}", home.join(".local/bin").display())
        );
        assert_eq!(
            refusal("~/.local:/l:rw"),
            format!("holds {}", home.join(".local/bin").display())
        );
        assert_eq!(
            refusal("~/project:/p"),
            format!("holds {}", home.join("project/.venv/bin").display())
        );
        assert_eq!(
            refusal("~/.cargo/bin"),
            format!("is {}", home.join(".cargo/bin").display())
        );
        assert_eq!(
            refusal("~/bin"),
            format!("is {}", root.join("dotfiles/bin").display())
        );
        assert_eq!(
            refusal(root.join("dotfiles").to_str().unwrap()),
            format!("holds {}", root.join("dotfiles/bin").display())
        );
        // A manager's directory, what holds it, and what is inside it: its programs
        // lie anywhere below (rustup's toolchains, pipx's environments).
        assert_eq!(
            refusal("~/.rustup"),
            format!("is {}", home.join(".rustup").display())
        );
        assert_eq!(
            refusal("~/.rustup/toolchains/stable-x86_64-unknown-linux-gnu"),
            format!("is inside {}", home.join(".rustup").display())
        );
        assert_eq!(
            refusal("~/.local/share"),
            format!("holds {}", home.join(".local/share/pipx").display())
        );
        assert_eq!(
            refusal("~/.local/share/pipx/venvs/black"),
            format!("is inside {}", home.join(".local/share/pipx").display())
        );
        for allowed in [
            "~/.local/bin:ro",
            "~/.local:/l:ro",
            "~/.rustup:ro",
            "~/.local/share/fonts",
            "~/.cargo/registry:ro",
            "elsewhere",
        ] {
            assert!(check(allowed).is_ok(), "{allowed}: {:?}", check(allowed));
        }
        // Cargo's unpacked crates: their build scripts run at the host's next build.
        assert_eq!(
            refusal("~/.cargo/registry"),
            format!("is {}", home.join(".cargo/registry").display())
        );
        assert_eq!(
            refusal("~/.cargo/registry/src"),
            format!("is inside {}", home.join(".cargo/registry").display())
        );
        // Build tools' caches and homes whose contents the host's builds use unchecked.
        assert_eq!(
            refusal("~/.gradle/caches"),
            format!("is inside {}", home.join(".gradle").display())
        );
        assert_eq!(
            refusal("~/.m2"),
            format!("is {}", home.join(".m2").display())
        );
        assert_eq!(
            refusal("~/.cache:/c"),
            format!("holds {}", home.join(".cache/go-build").display())
        );
        assert_eq!(
            refusal("~/go"),
            format!("holds {}", home.join("go/bin").display())
        );
        for allowed in ["~/.cache:/c:ro", "~/.npm:ro", "~/.cache/ms-playwright"] {
            assert!(check(allowed).is_ok(), "{allowed}: {:?}", check(allowed));
        }
        let message = check("~/.local:/l:rw").unwrap_err().to_string();
        assert!(
            message.starts_with(&format!(
                "mount \"~/.local:/l:rw\": {} holds {}, a directory on your PATH, and a \
                 guest that could write it could put a program there that you then run on \
                 this host; mount it read-only (\"~/.local:/l:ro\")",
                home.join(".local").display(),
                home.join(".local/bin").display()
            )),
            "{message}"
        );
        let message = check("~/.rustup/toolchains").unwrap_err().to_string();
        assert!(
            message.starts_with(&format!(
                "mount \"~/.rustup/toolchains\": {} is inside {}, rustup's home, whose \
                 toolchains the cargo and rustc you run are, and a guest that could write \
                 it could put a program there",
                home.join(".rustup/toolchains").display(),
                home.join(".rustup").display()
            )),
            "{message}"
        );
        // A cache the guest can do without is said to be one.
        let message = check("~/.npm").unwrap_err().to_string();
        assert_eq!(
            message,
            format!(
                "mount \"~/.npm\": {} is npm's cache, whose packages (and the checksums they \
                 are checked against) npm installs, and a guest that could write it could \
                 change what your next build or install on this host runs; mount it \
                 read-only (\"~/.npm:ro\"), or leave it out (the guest keeps a cache of its \
                 own)",
                home.join(".npm").display()
            )
        );
        let message = check("~/.cargo/bin").unwrap_err().to_string();
        assert!(
            message.starts_with(&format!(
                "mount \"~/.cargo/bin\": {} is where cargo install and rustup put your \
                 programs",
                home.join(".cargo/bin").display()
            )),
            "{message}"
        );
    }

    #[test]
    fn no_share_is_holds_or_lies_in_what_is_kept_out_of_the_guest() {
        let kept_out = [
            KeptOut {
                dir: "/home/me".into(),
                what: "your home directory",
                inside_too: false,
                instead: None,
            },
            KeptOut {
                dir: "/home/me/.config/vmctl".into(),
                what: "vmctl's config directory",
                inside_too: true,
                instead: None,
            },
        ];
        let refusal = |host: &str| match check_kept_out(&share(host, "/x"), &kept_out) {
            Ok(()) => None,
            Err(ShareError::KeptOut {
                relation, kept_out, ..
            }) => Some(format!("{relation} {}", kept_out.display())),
            Err(other) => panic!("{other}"),
        };
        assert_eq!(refusal("/home/me/project"), None);
        assert_eq!(refusal("/home/me/.config/other"), None);
        assert_eq!(refusal("/home/me2"), None);
        assert_eq!(refusal("/srv"), None);
        assert_eq!(refusal("/home/me").as_deref(), Some("is /home/me"));
        assert_eq!(refusal("/home").as_deref(), Some("holds /home/me"));
        assert_eq!(
            refusal("/home/me/.config").as_deref(),
            Some("holds /home/me/.config/vmctl")
        );
        assert_eq!(
            refusal("/home/me/.config/vmctl/sub").as_deref(),
            Some("is inside /home/me/.config/vmctl")
        );
        let message = check_kept_out(&share("/home/me", "/home/me"), &kept_out)
            .unwrap_err()
            .to_string();
        assert!(
            message.starts_with(
                "/home/me cannot be shared with the guest: it is your home directory \
                 /home/me, which must stay out of the VM"
            ),
            "{message}"
        );
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

    /// What is kept out of the guest for a user whose home is `home`, with vmctl's own
    /// config, state and cache elsewhere.
    fn kept_out_of_home(home: &Path) -> Vec<KeptOut> {
        kept_out_from(
            &[home.to_path_buf()],
            &[],
            &[],
            PathBuf::from("/nonexistent-state"),
            None,
        )
    }

    /// The session's shared directories: none may be shared or held by a share, and
    /// nothing inside the runtime directory or vmctl's socket directory; a project
    /// inside /tmp may. (Review: `cd /tmp && vmctl run` gave the guest vmctl's
    /// relocated socket directories, where a link made the VMM connect the guest to
    /// its own agent or the host's Docker socket.)
    #[test]
    fn the_sessions_temporary_and_runtime_directories_are_kept_out() {
        let kept_out = session_dirs_kept_out(
            &["/nonexistent/tmp".into(), "/nonexistent/tmp".into()],
            &["/nonexistent/run/user/1000".into()],
            "/nonexistent/tmp/vmctl-1000".into(),
        );
        assert_eq!(kept_out.len(), 3, "the same directory is kept out once");
        let refusal = |host: &str| match check_kept_out(&share(host, "/x"), &kept_out) {
            Ok(()) => None,
            Err(error @ ShareError::KeptOut { .. }) => Some(error.to_string()),
            Err(other) => panic!("{other}"),
        };
        assert_eq!(refusal("/nonexistent/tmp/project"), None);
        assert_eq!(refusal("/nonexistent/srv"), None);
        for (host, says) in [
            (
                "/nonexistent/tmp",
                "a temporary directory every program shares",
            ),
            ("/nonexistent", "your runtime directory"),
            ("/nonexistent/run/user", "your runtime directory"),
            (
                "/nonexistent/run/user/1000/containers",
                "your runtime directory",
            ),
            (
                "/nonexistent/tmp/vmctl-1000",
                "vmctl's own directory for sockets",
            ),
            (
                "/nonexistent/tmp/vmctl-1000/vm-1234/vsock",
                "vmctl's own directory for sockets",
            ),
        ] {
            let refusal = refusal(host).unwrap_or_else(|| panic!("{host} was shared"));
            assert!(refusal.contains(says), "{host}: {refusal}");
        }
    }

    /// A runtime directory that holds the temporary one (`TMPDIR=/run/user/1000/tmp`,
    /// or `TMPDIR=$XDG_RUNTIME_DIR`) leaves the projects there shareable; vmctl's own
    /// sockets and podman's sign-in in it stay out. (Review: every share in the
    /// temporary directory was refused as the runtime directory.)
    #[test]
    fn a_runtime_directory_that_holds_the_temporary_one_leaves_its_projects_shareable() {
        for tmp in [
            "/nonexistent/run/user/1000/tmp",
            "/nonexistent/run/user/1000",
        ] {
            let kept_out = session_dirs_kept_out(
                &["/nonexistent/tmp".into(), tmp.into()],
                &["/nonexistent/run/user/1000".into()],
                "/nonexistent/tmp/vmctl-1000".into(),
            );
            let refused = |host: &str| check_kept_out(&share(host, "/x"), &kept_out).is_err();
            assert!(!refused(&format!("{tmp}/project")), "{tmp}");
            assert!(!refused("/nonexistent/tmp/project"), "{tmp}");
            for host in [
                "/nonexistent/run/user/1000",
                "/nonexistent/run/user/1000/vmctl",
                "/nonexistent/run/user/1000/containers/auth",
                "/nonexistent/tmp",
                tmp,
            ] {
                assert!(refused(host), "{tmp}: {host} was shared");
            }
        }
    }

    /// The credential directories in a home are kept out, and anything inside them;
    /// the home's other directories are not.
    #[test]
    fn credential_directories_are_kept_out_of_the_guest() {
        let home = PathBuf::from("/nonexistent-home/me");
        let kept_out = kept_out_of_home(&home);
        let refusal = |host: &str| {
            check_kept_out(&share(host, "/x"), &kept_out)
                .err()
                .map(|e| e.to_string())
        };
        for (secret, inside_too) in [
            (".ssh", true),
            (".aws", true),
            (".gnupg", true),
            (".config/gcloud", true),
            (".config/gh", true),
            (".docker", true),
            (".kube", true),
            (".config/git", true),
            (".config/containers", true),
            (".terraform.d", true),
            (".config/rclone", true),
            // Their passwords are at the top; the caches below may be shared read-only.
            (".gradle", false),
            (".m2", false),
            // The agents' sign-in is at the top; their worktrees below may be shared.
            (".claude", false),
            (".codex", false),
            // So is Cargo's token; its download cache below may be shared.
            (".cargo", false),
        ] {
            let dir = home.join(secret);
            let message = refusal(dir.to_str().unwrap()).unwrap_or_default();
            assert!(
                message.contains("it is ") && message.contains("must stay out of the VM"),
                "{secret}: {message:?}"
            );
            let inside = refusal(dir.join("sub").to_str().unwrap());
            assert_eq!(
                inside.as_deref().is_some_and(|m| m.contains("is inside")),
                inside_too,
                "{secret}: {inside:?}"
            );
        }
        assert!(refusal("/nonexistent-home/me/.claude")
            .unwrap()
            .contains("Claude Code's sign-in directory"));
        assert_eq!(refusal("/nonexistent-home/me/project"), None);
        assert_eq!(refusal("/nonexistent-home/me/.sshfs"), None);
    }

    /// Where the tools' variables move their credentials is kept out as their usual
    /// directory is, and so is each file KUBECONFIG names (with what holds it: a
    /// project that keeps one). Relative values move nothing.
    #[test]
    fn credentials_moved_by_variables_are_kept_out() {
        let kept_out = sign_in_dirs_moved_by(|name| {
            match name {
                "GNUPGHOME" => Some("/nonexistent/keys/gpg"),
                "DOCKER_CONFIG" => Some("relative/docker"),
                "KUBECONFIG" => {
                    Some("/nonexistent/project/kubeconfig:relative:/nonexistent/k8s/admin.conf")
                }
                "GRADLE_USER_HOME" => Some("/nonexistent/gradle"),
                _ => None,
            }
            .map(Into::into)
        });
        let refusal = |host: &str| {
            check_kept_out(&share(host, "/x"), &kept_out)
                .err()
                .map(|e| e.to_string())
        };
        for (host, says) in [
            ("/nonexistent/keys/gpg", "GnuPG keys' directory (GNUPGHOME)"),
            ("/nonexistent/keys/gpg/private-keys-v1.d", "(GNUPGHOME)"),
            (
                "/nonexistent/project",
                "kubectl's credentials file (KUBECONFIG)",
            ),
            (
                "/nonexistent/k8s",
                "kubectl's credentials file (KUBECONFIG)",
            ),
            ("/nonexistent/gradle", "Gradle's home (GRADLE_USER_HOME"),
        ] {
            let refusal = refusal(host).unwrap_or_else(|| panic!("{host} was shared"));
            assert!(refusal.contains(says), "{host}: {refusal}");
        }
        assert_eq!(refusal("/nonexistent/gradle/caches"), None);
        assert_eq!(refusal("/nonexistent/elsewhere"), None);
        assert_eq!(
            kept_out.len(),
            4,
            "{:?}",
            kept_out.iter().map(|k| &k.dir).collect::<Vec<_>>()
        );
    }

    /// A refusal of a directory shared for a sign-in names what gives the VM that
    /// sign-in without its secret: a GitHub token the proxy adds for `~/.ssh` and
    /// `~/.config/gh`, the agents' secrets for theirs; the others say to share a
    /// project.
    #[test]
    fn credential_refusals_name_what_to_do_instead() {
        let home = PathBuf::from("/nonexistent-home/me");
        let kept_out = kept_out_of_home(&home);
        let refusal = |dir: &str| {
            check_kept_out(&share(home.join(dir).to_str().unwrap(), "/x"), &kept_out).unwrap_err()
        };
        for (dir, instead) in [
            (".ssh", "vmctl secret set github"),
            (".ssh/work", "vmctl secret set github"),
            (".config/gh", "vmctl secret set github"),
            (".claude", "vmctl secret set anthropic"),
            (".codex", "vmctl secret set openai"),
            (
                ".cargo",
                "directories inside it hold no token and may be shared",
            ),
            (".aws", "share a project's directory instead"),
        ] {
            let error = refusal(dir);
            for message in [error.to_string(), error.for_agent().to_string()] {
                assert!(message.contains(instead), "{dir}: {message}");
                assert!(message.contains("share a project's directory"), "{message}");
            }
        }
    }

    /// The kernel's views of the host (proc, sysfs, the device nodes) are no directory
    /// of files to share; a directory of files is.
    #[test]
    fn pseudo_filesystems_are_not_shared() {
        for (host, fs) in [("/proc", "proc"), ("/proc/sys", "proc"), ("/sys", "sysfs")] {
            let error = check_not_pseudo_filesystem(&share(host, "/x")).unwrap_err();
            let message = error.to_string();
            assert!(
                message.starts_with(&format!(
                    "{host} cannot be shared with the guest: it is on {fs}"
                )),
                "{message}"
            );
            assert!(!error.for_agent().to_string().contains("--mount"));
        }
        let error = check_not_pseudo_filesystem(&share("/dev", "/x")).unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("/dev cannot be shared with the guest: it "),
            "{error}"
        );
        assert!(!error.for_agent().to_string().contains("--mount"));
        let dir = tempfile::tempdir().unwrap();
        check_not_pseudo_filesystem(&share(dir.path().to_str().unwrap(), "/x")).unwrap();
    }

    fn mount(point: &str, fs: &str) -> Mount {
        Mount {
            point: point.into(),
            fs: fs.into(),
        }
    }

    /// virtiofsd serves what is mounted inside a share: a pseudo file system mounted
    /// anywhere inside one (a chroot's proc) is refused, named; a share beside it, or
    /// holding only ordinary mounts, is not.
    #[test]
    fn a_pseudo_filesystem_mounted_inside_a_share_is_refused() {
        const EXT4: u32 = 0xef53;
        let mounts = [
            mount("/", "ext4"),
            mount("/proc", "proc"),
            mount("/dev", "devtmpfs"),
            mount("/dev/shm", "tmpfs"),
            mount("/srv/chroot/proc", "proc"),
            mount("/srv/chroot/data", "xfs"),
            mount("/srv/jail/dev", "devtmpfs"),
        ];
        let check = |host: &str| check_not_pseudo_in(Path::new(host), Some(EXT4), &mounts);
        for (host, inside, fs) in [
            ("/srv", "/srv/chroot/proc", "proc"),
            ("/srv/chroot", "/srv/chroot/proc", "proc"),
            ("/srv/jail", "/srv/jail/dev", "devtmpfs"),
        ] {
            let message = check(host).unwrap_err().to_string();
            assert!(
                message.starts_with(&format!(
                    "{host} cannot be shared with the guest: {inside} inside it is a mount \
                     of {fs}"
                )),
                "{message}"
            );
        }
        assert!(check("/srv/chroot/data").is_ok());
        assert!(check("/srv/other").is_ok());
        assert!(
            check("/srv/chroot/procs").is_ok(),
            "a sibling's name, not inside"
        );
        // The share's own mount is known by its name where statfs cannot tell it.
        let message = check("/dev/input").unwrap_err().to_string();
        assert!(message.contains("it is on devtmpfs"), "{message}");
    }

    /// /dev/shm is a tmpfs, not the device nodes: it is refused for what it is.
    #[test]
    fn the_hosts_shared_memory_is_refused_for_what_it_is() {
        const TMPFS: u32 = 0x0102_1994;
        let mounts = [
            mount("/", "ext4"),
            mount("/dev", "devtmpfs"),
            mount("/dev/shm", "tmpfs"),
        ];
        let message = check_not_pseudo_in(Path::new("/dev/shm"), Some(TMPFS), &mounts)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("memory its programs share")
                && message.contains("here tmpfs, mounted at /dev/shm")
                && !message.contains("devtmpfs"),
            "{message}"
        );
    }

    #[test]
    fn mountinfo_lines_give_the_mount_point_and_type() {
        assert_eq!(
            parse_mountinfo_line(
                "36 35 98:0 /mnt1 /mnt/my\\040dir rw,noatime master:1 shared:2 - proc proc rw"
            ),
            Some(mount("/mnt/my dir", "proc"))
        );
        assert_eq!(
            parse_mountinfo_line("25 1 0:22 / /sys rw,nosuid - sysfs sysfs rw"),
            Some(mount("/sys", "sysfs"))
        );
        assert_eq!(parse_mountinfo_line("garbage"), None);
        assert_eq!(unescape_octal("a\\134b\\01"), b"a\\b\\01");
    }

    #[test]
    fn tags_are_numbered() {
        assert_eq!(tag(0), "vmctl0");
        assert_eq!(tag(12), "vmctl12");
    }
}
