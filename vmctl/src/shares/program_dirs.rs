//! The host directories whose programs the user runs (PATH, the toolchain and version
//! managers' directories, build tools' caches), which a share the user adds may not
//! let the guest write.

use std::path::{Path, PathBuf};

use super::kept_out::{homes, set_variable};
use super::{Relation, ShareError, WrittenMount};

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
pub(super) fn program_dir_remedy(cache: bool, read_only_spec: &str) -> String {
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
pub(super) fn program_dir_place(host: &Path, relation: Relation, program_dir: &Path) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shares::parse_mount_with_home;

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
}
