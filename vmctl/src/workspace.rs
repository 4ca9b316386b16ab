//! Which workspace (and so which VM) a directory belongs to.

use std::path::{Path, PathBuf};

/// One VM per workspace, or per directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// The nearest enclosing git repository or worktree (else the directory).
    #[default]
    Workspace,
    /// The directory itself.
    Directory,
}

/// The workspace of a command: `dir` when one is named; else, from the current
/// directory, per `isolation` (the option, else the config file's, else workspace).
pub fn resolve(dir: Option<PathBuf>, isolation: Option<Isolation>) -> PathBuf {
    if dir.is_some() || isolation.is_some() {
        return resolve_with(dir, isolation);
    }
    let configured = configured_isolation(crate::user_config::UserConfig::load(), |warning| {
        vmm::to_stderr!("vmctl: warning: {warning}")
    });
    resolve_with(None, configured)
}

/// The workspace of a command that starts a VM, as [`resolve`] finds it; but a config
/// file that cannot be read is the command's error, said once, rather than a warning
/// followed by the start's refusal of the same file.
pub fn resolve_to_start(
    dir: Option<PathBuf>,
    isolation: Option<Isolation>,
) -> Result<PathBuf, crate::user_config::UserConfigError> {
    let config = crate::user_config::UserConfig::load()?;
    Ok(resolve_with(dir, isolation.or(config.isolation)))
}

fn resolve_with(dir: Option<PathBuf>, isolation: Option<Isolation>) -> PathBuf {
    if let Some(dir) = dir {
        return dir;
    }
    let cwd = current_dir();
    match isolation.unwrap_or_default() {
        Isolation::Directory => cwd,
        Isolation::Workspace => {
            let home = std::env::var_os("HOME").map(PathBuf::from);
            workspace_root(&cwd, home.as_deref())
        }
    }
}

/// The config's `isolation`. A config that cannot be read is said on stderr, not
/// passed over: which VM a directory belongs to then is the default's. (A command
/// that starts a VM refuses it too, where it reads the rest of the file.)
fn configured_isolation(
    config: Result<crate::user_config::UserConfig, crate::user_config::UserConfigError>,
    warn: impl FnOnce(String),
) -> Option<Isolation> {
    match config {
        Ok(config) => config.isolation,
        Err(e) => {
            warn(format!(
                "{e}; until then each directory belongs to the VM of its git repository \
                 (isolation = \"workspace\", the default)"
            ));
            None
        }
    }
}

/// The workspace a command about an existing VM or a workspace's settings means
/// (`vmctl stop`, `rm`, `logs`, `ports`, `publish`, `policy`): `dir` when one is named; else
/// the nearest directory, from the current one up to its workspace ([`resolve`]),
/// that has a VM (one started with `--isolation directory` or `vmctl up SUBDIR` is
/// found from inside it); else that workspace, the one `vmctl exec` would use here.
pub fn of_vm(dir: Option<PathBuf>) -> PathBuf {
    if let Some(dir) = dir {
        return dir;
    }
    let workspace = resolve(None, None);
    nearest_with_vm(&current_dir(), &workspace, |dir| {
        crate::state::VmDir::lookup(dir).is_ok_and(|(_, vm)| vm.record_path().exists())
    })
    .unwrap_or(workspace)
}

/// The nearest directory from `dir` up to `workspace` (both included) for which
/// `has_vm` holds.
fn nearest_with_vm(
    dir: &Path,
    workspace: &Path,
    has_vm: impl Fn(&Path) -> bool,
) -> Option<PathBuf> {
    let canonical = |path: &Path| path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let (dir, workspace) = (canonical(dir), canonical(workspace));
    dir.ancestors()
        .take_while(|candidate| candidate.starts_with(&workspace))
        .find(|candidate| has_vm(candidate))
        .map(Path::to_path_buf)
}

/// The current directory; when it was removed, the path the shell still has for it
/// (`$PWD`), so that the error that follows names it rather than ".".
pub fn current_dir() -> PathBuf {
    std::env::current_dir()
        .ok()
        .or_else(|| std::env::var_os("PWD").map(PathBuf::from))
        .unwrap_or_else(|| ".".into())
}

/// The current directory as the shell reached it (`$PWD`, which keeps the links it
/// went through) when that is where we are; else [`current_dir`].
pub fn logical_current_dir() -> PathBuf {
    let physical = current_dir();
    std::env::var_os("PWD")
        .map(PathBuf::from)
        .filter(|pwd| pwd.is_absolute())
        .filter(|pwd| pwd.canonicalize().ok() == physical.canonicalize().ok())
        .unwrap_or(physical)
}

/// The nearest directory from `dir` up that holds `.git` (a repository, or a
/// worktree's `.git` file), never the home directory or `/` themselves (a dotfiles
/// repository must not make the whole home one workspace), and never a submodule (its
/// repository lives in the enclosing one's git directory, so the workspace is the
/// enclosing one); else `dir`.
fn workspace_root(dir: &Path, home: Option<&Path>) -> PathBuf {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let home = home.and_then(|h| h.canonicalize().ok());
    for candidate in dir.ancestors() {
        if candidate.parent().is_none() || Some(candidate) == home.as_deref() {
            break;
        }
        if candidate.join(".git").exists() && !is_submodule(candidate) {
            return candidate.to_path_buf();
        }
    }
    dir
}

/// Whether `dir`'s `.git` is a file naming a git directory in an enclosing
/// repository's (`<super>/.git/modules/...`), as a submodule's does.
fn is_submodule(dir: &Path) -> bool {
    let Some(named) = crate::worktree::read_link_file(&dir.join(".git"), "gitdir: ") else {
        return false;
    };
    let Ok(git_dir) = dir.join(named).canonicalize() else {
        return false;
    };
    dir.ancestors()
        .skip(1)
        .any(|outer| git_dir.starts_with(outer.join(".git/modules")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_that_cannot_be_read_is_said_not_passed_over() {
        let error = crate::user_config::UserConfigError::Parse {
            path: "/home/me/.config/vmctl/config.toml".into(),
            line: Some(1),
            message: "unknown field `isolaton`".into(),
        };
        let mut warnings = Vec::new();
        let isolation = configured_isolation(Err(error), |warning| warnings.push(warning));
        assert_eq!(isolation, None);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("config.toml, line 1: unknown field `isolaton`"),
            "{warnings:?}"
        );
        let quiet = configured_isolation(Ok(Default::default()), |w| panic!("warned: {w}"));
        assert_eq!(quiet, None);
    }

    #[test]
    fn the_workspace_is_the_enclosing_repository_but_never_home() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let home = root.join("home");
        let repo = home.join("src/repo");
        let deep = repo.join("crates/a");
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::create_dir_all(repo.join(".git")).unwrap();
        assert_eq!(workspace_root(&deep, Some(&home)), repo);
        assert_eq!(workspace_root(&repo, Some(&home)), repo);
        // A worktree has a .git file.
        let worktree = home.join("src/wt");
        std::fs::create_dir_all(worktree.join("sub")).unwrap();
        std::fs::write(worktree.join(".git"), "gitdir: ../repo/.git/worktrees/wt\n").unwrap();
        assert_eq!(workspace_root(&worktree.join("sub"), Some(&home)), worktree);
        // A submodule (nested in another) belongs to the repository around it, whose
        // git directory holds its own.
        let nested = repo.join("libs/sub/inner");
        std::fs::create_dir_all(nested.join("src")).unwrap();
        std::fs::create_dir_all(repo.join(".git/modules/libs/sub/modules/inner")).unwrap();
        std::fs::write(
            repo.join("libs/sub/.git"),
            "gitdir: ../../.git/modules/libs/sub\n",
        )
        .unwrap();
        std::fs::write(
            nested.join(".git"),
            format!(
                "gitdir: {}/.git/modules/libs/sub/modules/inner\n",
                repo.display()
            ),
        )
        .unwrap();
        assert_eq!(workspace_root(&nested.join("src"), Some(&home)), repo);
        assert_eq!(workspace_root(&repo.join("libs/sub"), Some(&home)), repo);
        // A dotfiles repository in home does not swallow everything under it.
        std::fs::create_dir_all(home.join(".git")).unwrap();
        let plain = home.join("notes");
        std::fs::create_dir_all(&plain).unwrap();
        assert_eq!(workspace_root(&plain, Some(&home)), plain);
    }

    #[test]
    fn a_vm_is_found_from_the_current_directory_up_to_its_workspace() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let repo = root.join("repo");
        let deep = repo.join("src/a");
        std::fs::create_dir_all(&deep).unwrap();
        let with_vm = |dirs: &'static [&'static str]| {
            let root = root.clone();
            move |dir: &Path| dirs.iter().any(|d| dir == root.join(d))
        };
        // The workspace's VM, from deep inside it.
        assert_eq!(
            nearest_with_vm(&deep, &repo, with_vm(&["repo"])),
            Some(repo.clone())
        );
        // A VM of a subdirectory (`--isolation directory`) is nearer.
        assert_eq!(
            nearest_with_vm(&deep, &repo, with_vm(&["repo", "repo/src"])),
            Some(repo.join("src"))
        );
        // Nothing above the workspace counts, nor does a directory beside the path.
        assert_eq!(
            nearest_with_vm(&deep, &repo, with_vm(&["", "repo/b"])),
            None
        );
        // A current directory outside the workspace (it was named) finds nothing.
        assert_eq!(nearest_with_vm(&root, &repo, with_vm(&[""])), None);
    }
}
