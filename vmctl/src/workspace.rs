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
    if let Some(dir) = dir {
        return dir;
    }
    let cwd = current_dir();
    let isolation = isolation
        .or_else(|| {
            crate::user_config::UserConfig::load()
                .ok()
                .and_then(|c| c.isolation)
        })
        .unwrap_or_default();
    match isolation {
        Isolation::Directory => cwd,
        Isolation::Workspace => {
            let home = std::env::var_os("HOME").map(PathBuf::from);
            workspace_root(&cwd, home.as_deref())
        }
    }
}

/// The current directory; when it was removed, the path the shell still has for it
/// (`$PWD`), so that the error that follows names it rather than ".".
pub fn current_dir() -> PathBuf {
    std::env::current_dir()
        .ok()
        .or_else(|| std::env::var_os("PWD").map(PathBuf::from))
        .unwrap_or_else(|| ".".into())
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
}
