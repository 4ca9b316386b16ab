//! A workspace that is a git worktree (`git worktree add`, as Paseo makes one per
//! agent) keeps its repository elsewhere: its `.git` is a file naming the worktree's
//! own directory in the main repository's git directory, `<repo>/.git/worktrees/<name>`,
//! and git needs that whole git directory (objects, refs, config) to work in it. This
//! finds it so that the VM gets it too, at its own path.
//!
//! The `.git` file is written by whoever writes the workspace, the guest included, so
//! what it names is believed only when git's own back-link agrees: the worktree's
//! directory holds a `gitdir` file naming this workspace's `.git`. The guest cannot
//! plant that file outside what it can already write, so it cannot make vmctl share
//! any other host directory.

use std::path::{Path, PathBuf};

use crate::shares::Share;

/// Longest `.git` or `gitdir` file read (git writes one short line).
const MAX_LINK_FILE: u64 = 4096;

/// What a workspace's `.git` says about where its repository is.
#[derive(Debug, PartialEq, Eq)]
pub enum GitDir {
    /// Not a worktree (a plain repository, a submodule, no repository at all):
    /// nothing to add.
    NotAWorktree,
    /// A worktree whose repository's git directory is this (canonical).
    Common(PathBuf),
    /// It looks like a worktree, but what it names does not hold up; why.
    Unusable(String),
}

/// Where the repository of the worktree at `workspace` (canonical) keeps its git
/// directory. The `.git` read is the one in `workspace` itself, reached without
/// following links, and the back-link must lead to that very file (device and inode):
/// a guest that swaps `.git`, or the workspace, between a file and a link to another
/// worktree's as they are read cannot borrow that worktree's repository.
pub fn common_git_dir(workspace: &Path) -> GitDir {
    let Ok(dir) = crate::share_root::open_dir_without_links(workspace) else {
        return GitDir::NotAWorktree;
    };
    let Ok((bytes, dot_git)) =
        crate::guest_writable::read_file_in(&dir, Path::new(".git"), MAX_LINK_FILE)
    else {
        return GitDir::NotAWorktree;
    };
    let Some(named) = link_line(bytes, "gitdir: ") else {
        return GitDir::NotAWorktree;
    };
    let named = workspace.join(named);
    let Ok(worktree_dir) = named.canonicalize() else {
        return GitDir::Unusable(format!(
            "its .git file names {}, which does not exist (was the repository moved? \
             `git worktree repair` in it mends the link)",
            named.display()
        ));
    };
    let Some(common) = worktree_dir
        .parent()
        .filter(|parent| parent.file_name().is_some_and(|name| name == "worktrees"))
        .and_then(Path::parent)
    else {
        return GitDir::NotAWorktree;
    };
    let back_link = read_link_file(&worktree_dir.join("gitdir"), "")
        .map(|link| worktree_dir.join(link))
        .and_then(|link| crate::guest_writable::file_id(&link));
    if back_link != Some(dot_git) {
        return GitDir::Unusable(format!(
            "{} does not name it back (its gitdir file names another worktree)",
            worktree_dir.display()
        ));
    }
    if !common.join("HEAD").is_file() || !common.join("objects").is_dir() {
        return GitDir::Unusable(format!(
            "{} is not a git directory (no HEAD or objects)",
            common.display()
        ));
    }
    GitDir::Common(common.to_path_buf())
}

/// The share that gives the guest the repository of the worktree at `workspace`
/// (canonical), given the VM's other `shares`: None when it needs none (not a
/// worktree, or the repository is already visible at its path); Err(why) when it is
/// a worktree whose repository cannot be shared, which git in the guest will then not
/// find.
pub fn repository_share(workspace: &Path, shares: &[Share]) -> Result<Option<Share>, String> {
    let common = match common_git_dir(workspace) {
        GitDir::NotAWorktree => return Ok(None),
        GitDir::Unusable(why) => return Err(why),
        GitDir::Common(common) => common,
    };
    let visible_at_its_path = shares.iter().any(|share| {
        common
            .strip_prefix(&share.host)
            .is_ok_and(|below| share.guest.join(below) == common)
    });
    if visible_at_its_path {
        return Ok(None);
    }
    // Such a directory was not named back by a worktree the user made: sharing it
    // would widen a share instead of adding a repository.
    if let Some(share) = shares.iter().find(|share| share.host.starts_with(&common)) {
        return Err(format!(
            "its repository's git directory {} would contain the share of {}",
            common.display(),
            share.host.display()
        ));
    }
    // One a guest can write (another VM's, through a share mounted elsewhere) could
    // be swapped for a symlink between this check and virtiofsd's opening it.
    if let Some(share) = shares
        .iter()
        .find(|share| !share.read_only && common.starts_with(&share.host))
    {
        return Err(format!(
            "its repository's git directory {} lies in the share of {}, which the guest \
             can write; share the repository at its own path with --mount instead",
            common.display(),
            share.host.display()
        ));
    }
    if let Some(share) = shares.iter().find(|share| share.guest == common) {
        return Err(format!(
            "the guest path of its repository's git directory {} is taken by the share of {}",
            common.display(),
            share.host.display()
        ));
    }
    if let Some(conflict) = crate::shares::guest_conflict(&common) {
        return Err(format!(
            "its repository's git directory {} cannot be shared at its own path in the \
             guest: {conflict}",
            common.display()
        ));
    }
    Ok(Some(Share {
        guest: common.clone(),
        host: common,
        read_only: false,
    }))
}

/// The one line of a regular file (never a symlink) at `path` that starts with
/// `prefix`, without it; None if there is no such file or line. The guest can swap
/// the path for a link or a FIFO at any moment: [`crate::guest_writable::read_file`].
pub(crate) fn read_link_file(path: &Path, prefix: &str) -> Option<PathBuf> {
    let bytes = crate::guest_writable::read_file(path, false, MAX_LINK_FILE).ok()?;
    link_line(bytes, prefix)
}

/// The path on the first line of a link file's `bytes`, after `prefix`.
fn link_line(bytes: Vec<u8>, prefix: &str) -> Option<PathBuf> {
    let text = String::from_utf8(bytes).ok()?;
    let line = text.lines().next()?.strip_prefix(prefix)?.trim();
    (!line.is_empty()).then(|| PathBuf::from(line))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// The guest can put anything at a worktree's `.git`: only a regular file is
    /// read, and a FIFO (whose plain open would wait for a writer) does not block.
    #[test]
    fn only_a_regular_file_is_read_as_a_link_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, "gitdir: /repo/.git/worktrees/w\n").unwrap();
        assert_eq!(
            read_link_file(&file, "gitdir: "),
            Some(PathBuf::from("/repo/.git/worktrees/w"))
        );
        assert_eq!(read_link_file(&file, "other: "), None);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read_link_file(&link, "gitdir: "), None);
        let fifo = dir.path().join("fifo");
        crate::guest_writable::make_fifo(&fifo);
        assert_eq!(read_link_file(&fifo, "gitdir: "), None);
        assert_eq!(read_link_file(&dir.path().join("missing"), ""), None);
    }

    fn git(dir: &Path, args: &[&str]) {
        let status = Command::new("git")
            .args(["-c", "user.email=t@t", "-c", "user.name=t"])
            .args(args)
            .current_dir(dir)
            .status()
            .expect("git");
        assert!(status.success(), "git {args:?}");
    }

    /// A repository at `root/repo` with one commit and a worktree at `root/wt`.
    fn repo_with_worktree(root: &Path) -> (PathBuf, PathBuf) {
        let repo = root.join("repo");
        std::fs::create_dir_all(&repo).unwrap();
        git(&repo, &["init", "-q"]);
        std::fs::write(repo.join("f"), "f\n").unwrap();
        git(&repo, &["add", "f"]);
        git(&repo, &["commit", "-qm", "one"]);
        git(&repo, &["worktree", "add", "-q", "../wt"]);
        (repo, root.join("wt"))
    }

    fn share(host: &Path, guest: &Path) -> Share {
        Share {
            host: host.to_path_buf(),
            guest: guest.to_path_buf(),
            read_only: false,
        }
    }

    /// A guest that can write a workspace swaps its `.git` between a file naming
    /// another worktree's directory in an unrelated repository and a link to that
    /// worktree's own `.git`, which the back-link names: read one way, checked the
    /// other, that repository's git directory would be shared. However the reads fall,
    /// it never is.
    #[test]
    fn a_git_file_swapped_for_a_link_cannot_name_another_repository() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let (other_repo, other_worktree) = repo_with_worktree(&root.join("other"));
        let workspace = root.join("hostile");
        std::fs::create_dir_all(&workspace).unwrap();
        let file_text = format!("gitdir: {}/.git/worktrees/wt\n", other_repo.display());
        std::fs::write(workspace.join(".git"), &file_text).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let swapper = {
            let (stop, workspace) = (Arc::clone(&stop), workspace.clone());
            let link_target = other_worktree.join(".git");
            std::thread::spawn(move || {
                let (file, link) = (workspace.join(".f"), workspace.join(".l"));
                while !stop.load(Ordering::Relaxed) {
                    std::fs::write(&file, &file_text).unwrap();
                    std::fs::rename(&file, workspace.join(".git")).unwrap();
                    let _ = std::fs::remove_file(&link);
                    std::os::unix::fs::symlink(&link_target, &link).unwrap();
                    std::fs::rename(&link, workspace.join(".git")).unwrap();
                }
            })
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let mut taken = None;
        while taken.is_none() && std::time::Instant::now() < deadline {
            if let GitDir::Common(common) = common_git_dir(&workspace) {
                taken = Some(common);
            }
        }
        stop.store(true, Ordering::Relaxed);
        swapper.join().unwrap();
        assert_eq!(taken, None, "another repository's git directory was taken");
    }

    #[test]
    fn a_worktrees_repository_is_shared_at_its_path_unless_the_guest_sees_it() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let (repo, worktree) = repo_with_worktree(&root);
        let git_dir = repo.join(".git");
        let mut shares = vec![share(&worktree, &worktree)];
        assert_eq!(
            repository_share(&worktree, &shares),
            Ok(Some(share(&git_dir, &git_dir)))
        );
        // The repository shared elsewhere in the guest does not count: read-only, it
        // is shared again at its path; writable, it is refused (the guest could swap
        // it for a symlink before virtiofsd opens it). At its path, it needs nothing.
        let mut elsewhere = share(&repo, Path::new("/src/repo"));
        elsewhere.read_only = true;
        shares.push(elsewhere.clone());
        assert!(repository_share(&worktree, &shares).unwrap().is_some());
        shares.pop();
        elsewhere.read_only = false;
        shares.push(elsewhere);
        let refused = repository_share(&worktree, &shares).unwrap_err();
        assert!(refused.contains("which the guest can write"), "{refused}");
        shares.push(share(&repo, &repo));
        assert_eq!(repository_share(&worktree, &shares), Ok(None));
        assert_eq!(repository_share(&repo, &shares), Ok(None), "not a worktree");
    }

    #[test]
    fn a_git_directory_around_a_share_is_not_shared() {
        // A worktree directory made where the guest can write, in a share named
        // `worktrees`, would make that share's parent the "repository"; it is refused
        // even when that parent looks like a git directory.
        let tmp = tempfile::tempdir().unwrap();
        let parent = tmp.path().canonicalize().unwrap();
        std::fs::write(parent.join("HEAD"), "ref: refs/heads/main\n").unwrap();
        std::fs::create_dir_all(parent.join("objects")).unwrap();
        let writable = parent.join("worktrees");
        let workspace = parent.join("ws");
        std::fs::create_dir_all(writable.join("x")).unwrap();
        std::fs::create_dir_all(&workspace).unwrap();
        std::fs::write(
            writable.join("x/gitdir"),
            format!("{}/.git\n", workspace.display()),
        )
        .unwrap();
        std::fs::write(
            workspace.join(".git"),
            format!("gitdir: {}/x\n", writable.display()),
        )
        .unwrap();
        let shares = [
            share(&workspace, &workspace),
            share(&writable, Path::new("/data")),
        ];
        let refused = repository_share(&workspace, &shares).unwrap_err();
        assert!(refused.contains("would contain the share of"), "{refused}");
    }

    #[test]
    fn a_worktree_finds_its_repositorys_git_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let (repo, worktree) = repo_with_worktree(&root);
        assert_eq!(common_git_dir(&worktree), GitDir::Common(repo.join(".git")));
        // A worktree git wrote with relative paths (`worktree.useRelativePaths`).
        std::fs::write(worktree.join(".git"), "gitdir: ../repo/.git/worktrees/wt\n").unwrap();
        std::fs::write(
            repo.join(".git/worktrees/wt/gitdir"),
            "../../../../wt/.git\n",
        )
        .unwrap();
        assert_eq!(common_git_dir(&worktree), GitDir::Common(repo.join(".git")));
    }

    #[test]
    fn plain_repositories_and_other_directories_are_not_worktrees() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let (repo, _) = repo_with_worktree(&root);
        assert_eq!(common_git_dir(&repo), GitDir::NotAWorktree);
        assert_eq!(common_git_dir(&root), GitDir::NotAWorktree);
        // A submodule's .git names `.git/modules/<name>`: not a worktree's.
        let sub = root.join("sub");
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::write(sub.join(".git"), "gitdir: ../repo/.git/modules/sub\n").unwrap();
        std::fs::create_dir_all(repo.join(".git/modules/sub")).unwrap();
        assert_eq!(common_git_dir(&sub), GitDir::NotAWorktree);
    }

    #[test]
    fn a_git_file_written_in_the_workspace_cannot_name_another_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let (repo, worktree) = repo_with_worktree(&root);
        // Another repository's worktree directory, which names another worktree back.
        let (other_repo, _) = repo_with_worktree(&root.join("other"));
        std::fs::write(
            worktree.join(".git"),
            format!("gitdir: {}/.git/worktrees/wt\n", other_repo.display()),
        )
        .unwrap();
        assert!(
            matches!(common_git_dir(&worktree), GitDir::Unusable(why) if why.contains("does not name it back"))
        );
        // A made-up worktree directory in a place the guest can write (the workspace),
        // naming it back: its "repository" would be the workspace itself, which holds
        // no git directory.
        let fake = worktree.join("worktrees/x");
        std::fs::create_dir_all(&fake).unwrap();
        std::fs::write(
            fake.join("gitdir"),
            format!("{}/.git\n", worktree.display()),
        )
        .unwrap();
        std::fs::write(worktree.join(".git"), "gitdir: worktrees/x\n").unwrap();
        assert!(
            matches!(common_git_dir(&worktree), GitDir::Unusable(why) if why.contains("not a git directory"))
        );
        // Nowhere at all.
        std::fs::write(
            worktree.join(".git"),
            "gitdir: /nonexistent/.git/worktrees/wt\n",
        )
        .unwrap();
        assert!(
            matches!(common_git_dir(&worktree), GitDir::Unusable(why) if why.contains("does not exist"))
        );
        // The same, with the git directory the guest could add to the workspace: its
        // "repository" is the workspace itself, which the guest sees already.
        std::fs::write(worktree.join(".git"), "gitdir: worktrees/x\n").unwrap();
        std::fs::write(worktree.join("HEAD"), "ref: refs/heads/main\n").unwrap();
        std::fs::create_dir_all(worktree.join("objects")).unwrap();
        assert_eq!(common_git_dir(&worktree), GitDir::Common(worktree.clone()));
        let workspace = vec![share(&worktree, &worktree)];
        assert_eq!(repository_share(&worktree, &workspace), Ok(None));
        // A symlink as .git is not followed.
        std::fs::remove_file(worktree.join(".git")).unwrap();
        std::os::unix::fs::symlink(repo.join(".git"), worktree.join(".git")).unwrap();
        assert_eq!(common_git_dir(&worktree), GitDir::NotAWorktree);
    }
}
