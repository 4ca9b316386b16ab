//! What git on the host runs from a repository the guest can write: the hooks in its
//! git directory, and the commands its config names (`core.fsmonitor`,
//! `core.hooksPath`, filters, `credential.helper`, ...). An agent in the VM can
//! change them, and neither `git status` nor `git diff` shows that; git on the host
//! then runs them as the host's user. The guest's git needs its git directory
//! writable, so vmctl cannot forbid this: it looks before and after each session and
//! says what changed.
//!
//! It looks at the git directories of the VM's writable shares: `SHARE/.git`, and a
//! share that is itself a git directory (a worktree's repository). Repositories
//! deeper inside a share, and changes made while no session runs, are not seen.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::shares::Share;
use crate::state::VmDir;

/// Config keys (lower case; `*` one subsection) that only hold data, never a command
/// or a path git runs or reads more config from. Every other key is reported.
const PLAIN_KEYS: &[&str] = &[
    "core.repositoryformatversion",
    "core.filemode",
    "core.bare",
    "core.logallrefupdates",
    "core.ignorecase",
    "core.precomposeunicode",
    "core.symlinks",
    "core.autocrlf",
    "core.eol",
    "core.safecrlf",
    "core.quotepath",
    "core.untrackedcache",
    "core.sparsecheckout",
    "core.sparsecheckoutcone",
    "core.abbrev",
    "user.name",
    "user.email",
    "user.signingkey",
    "author.name",
    "author.email",
    "committer.name",
    "committer.email",
    "init.defaultbranch",
    "pull.rebase",
    "pull.ff",
    "push.default",
    "push.autosetupremote",
    "fetch.prune",
    "branch.*.remote",
    "branch.*.merge",
    "branch.*.rebase",
    "branch.*.pushremote",
    "branch.*.description",
    "remote.*.url",
    "remote.*.pushurl",
    "remote.*.fetch",
    "remote.*.push",
    "remote.*.tagopt",
    "remote.*.prune",
    "remote.*.promisor",
    "remote.*.partialclonefilter",
    "submodule.*.url",
    "submodule.*.active",
    "extensions.objectformat",
    "extensions.worktreeconfig",
    "extensions.partialclone",
    "extensions.preciousobjects",
    "gc.auto",
    "index.version",
    "lfs.repositoryformatversion",
];

/// The hooks git runs (githooks(5)); other files in `hooks/` are never run.
const HOOKS: &[&str] = &[
    "applypatch-msg",
    "pre-applypatch",
    "post-applypatch",
    "pre-commit",
    "pre-merge-commit",
    "prepare-commit-msg",
    "commit-msg",
    "post-commit",
    "pre-rebase",
    "post-checkout",
    "post-merge",
    "pre-push",
    "pre-receive",
    "update",
    "proc-receive",
    "post-receive",
    "post-update",
    "reference-transaction",
    "push-to-checkout",
    "pre-auto-gc",
    "post-rewrite",
    "sendemail-validate",
    "fsmonitor-watchman",
    "p4-changelist",
    "p4-prepare-changelist",
    "p4-post-changelist",
    "p4-pre-submit",
    "post-index-change",
];

/// Largest config file read; a larger one is reported whenever it changes.
const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// A change the guest may have made to what git on the host runs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Runnable {
    /// The git directory it belongs to.
    pub git_dir: PathBuf,
    /// `hook pre-commit`, `config core.fsmonitor=...`.
    pub what: String,
}

/// What git on the host would run from the repositories of `shares`, as found now.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Snapshot(BTreeSet<(Runnable, String)>);

impl Snapshot {
    pub fn of(shares: &[Share]) -> Snapshot {
        let mut found = BTreeSet::new();
        for git_dir in git_dirs(shares) {
            for (what, fingerprint) in hooks(&git_dir).into_iter().chain(commands(&git_dir)) {
                let runnable = Runnable {
                    git_dir: git_dir.clone(),
                    what,
                };
                found.insert((runnable, fingerprint));
            }
        }
        Snapshot(found)
    }

    /// What is new or changed in `self` since `before` (a hook or command gone is
    /// no danger).
    pub fn changed_since(&self, before: &Snapshot) -> Vec<Runnable> {
        let mut changed: Vec<Runnable> = self
            .0
            .difference(&before.0)
            .map(|(runnable, _)| runnable.clone())
            .collect();
        changed.dedup();
        changed
    }
}

/// The git directories of the writable shares.
fn git_dirs(shares: &[Share]) -> Vec<PathBuf> {
    let mut dirs = BTreeSet::new();
    for share in shares.iter().filter(|s| !s.read_only) {
        let dot_git = share.host.join(".git");
        if dot_git.is_dir() {
            dirs.insert(dot_git);
        } else if share.host.join("HEAD").is_file() && share.host.join("objects").is_dir() {
            dirs.insert(share.host.clone());
        }
    }
    dirs.into_iter().collect()
}

/// The hooks git would run, each with what changes when it is rewritten, replaced
/// or made executable. The ctime is the host kernel's, which the guest cannot set
/// back; a link is followed, as git does.
fn hooks(git_dir: &Path) -> Vec<(String, String)> {
    let hooks_dir = git_dir.join("hooks");
    HOOKS
        .iter()
        .filter_map(|name| {
            let path = hooks_dir.join(name);
            let fingerprint = fingerprint(&path)?;
            Some((format!("hook {name}"), fingerprint))
        })
        .collect()
}

/// What changes when the file at `path` (a link followed) is rewritten, replaced or
/// chmod-ed; None when there is nothing there.
fn fingerprint(path: &Path) -> Option<String> {
    let link = std::fs::read_link(path).ok();
    match std::fs::metadata(path) {
        Ok(m) => Some(format!(
            "{}:{}:{}.{}:{:o}:{link:?}",
            m.ino(),
            m.len(),
            m.ctime(),
            m.ctime_nsec(),
            m.mode()
        )),
        // A dangling link: git runs nothing, yet its target may appear later.
        Err(_) => link.map(|link| format!("{link:?}")),
    }
}

/// The entries of the git directory's config files that are not [`PLAIN_KEYS`], as
/// `config KEY=VALUE` (the fingerprint is the entry itself). Read with `git config
/// --file`, which runs nothing and follows no includes; without git on the host
/// there is nothing to run them.
fn commands(git_dir: &Path) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for file in ["config", "config.worktree"] {
        let path = git_dir.join(file);
        let Ok(metadata) = std::fs::metadata(&path) else {
            continue;
        };
        if metadata.len() > MAX_CONFIG_BYTES {
            let what = format!("{file} (over {MAX_CONFIG_BYTES} bytes, not read)");
            found.extend(fingerprint(&path).map(|fingerprint| (what, fingerprint)));
            continue;
        }
        let output = Command::new("git")
            .args(["config", "--no-includes", "--null", "--list", "--file"])
            .arg(&path)
            .current_dir("/")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output();
        let Ok(output) = output else { continue };
        for entry in output.stdout.split(|b| *b == 0).filter(|e| !e.is_empty()) {
            let entry = String::from_utf8_lossy(entry);
            let (key, value) = entry.split_once('\n').unwrap_or((&entry, ""));
            if !is_plain(key) {
                let what = format!("config {key}={value}");
                found.push((what.clone(), what));
            }
        }
    }
    found
}

/// Whether `key` (`section.key` or `section.subsection.key`, as git lists it: section
/// and key in lower case) is one of [`PLAIN_KEYS`].
fn is_plain(key: &str) -> bool {
    let key_lower = key.to_ascii_lowercase();
    PLAIN_KEYS
        .iter()
        .any(|plain| match plain.split_once(".*.") {
            None => key_lower == *plain,
            Some((section, name)) => key_lower
                .strip_prefix(section)
                .and_then(|rest| rest.strip_prefix('.'))
                .and_then(|rest| rest.rsplit_once('.'))
                .is_some_and(|(subsection, last)| !subsection.is_empty() && last == name),
        })
}

/// Runs `session` in `vm`, then says what it changed of what git on the host runs.
pub fn watch<T>(vm: &VmDir, session: impl FnOnce() -> T) -> T {
    let shares = vm
        .read_record()
        .ok()
        .and_then(|record| record.shares)
        .map(|set| set.shares)
        .unwrap_or_default();
    let before = Snapshot::of(&shares);
    let outcome = session();
    report(&Snapshot::of(&shares).changed_since(&before));
    outcome
}

/// Tells the user, on stderr, what a session changed; nothing when nothing did.
pub fn report(changed: &[Runnable]) {
    let Some(first) = changed.first() else {
        return;
    };
    let mut lines = vec![String::from(
        "vmctl: warning: the VM changed what git on the host runs (hooks, commands in \
         its config), which git status and git diff do not show; review before running \
         git there on the host:",
    )];
    for runnable in changed {
        let what: String = runnable.what.chars().take(200).collect();
        lines.push(format!("vmctl:   {}: {what}", runnable.git_dir.display()));
    }
    lines.push(format!(
        "vmctl:   (see `ls -l {0}/hooks` and `git config --file {0}/config --list`)",
        first.git_dir.display()
    ));
    eprintln!("{}", crate::terminal::printable(&lines.join("\n")));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn git(dir: &Path, args: &[&str]) {
        let status = Command::new("git")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "git {args:?}");
    }

    fn share(path: &Path) -> Share {
        Share {
            host: path.to_path_buf(),
            guest: path.to_path_buf(),
            read_only: false,
        }
    }

    #[test]
    fn plain_keys_and_the_rest() {
        for plain in [
            "core.filemode",
            "user.name",
            "branch.main.remote",
            "branch.feature/x.y.merge",
            "remote.origin.url",
        ] {
            assert!(is_plain(plain), "{plain}");
        }
        for command in [
            "core.fsmonitor",
            "core.hookspath",
            "core.sshcommand",
            "filter.lfs.smudge",
            "remote.origin.uploadpack",
            "branch.remote",
            "branch..remote",
            "credential.helper",
            "include.path",
            "alias.st",
            "submodule.x.update",
        ] {
            assert!(!is_plain(command), "{command}");
        }
    }

    #[test]
    fn new_hooks_and_commands_are_seen_and_plain_settings_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path();
        git(repo, &["init", "-q"]);
        let shares = [share(repo)];
        let before = Snapshot::of(&shares);
        assert!(Snapshot::of(&shares).changed_since(&before).is_empty());

        // What an agent does every day changes nothing that runs.
        git(repo, &["config", "user.name", "Agent"]);
        git(
            repo,
            &["remote", "add", "origin", "https://example.com/r.git"],
        );
        git(repo, &["config", "branch.main.remote", "origin"]);
        std::fs::write(repo.join(".git/hooks/pre-commit.sample"), "#!/bin/sh\n").unwrap();
        std::fs::write(repo.join(".git/hooks/notes.txt"), "not a hook\n").unwrap();
        assert_eq!(Snapshot::of(&shares).changed_since(&before), vec![]);

        std::fs::write(repo.join(".git/hooks/pre-commit"), "#!/bin/sh\ntouch /x\n").unwrap();
        git(repo, &["config", "core.fsmonitor", "touch /y"]);
        let changed = Snapshot::of(&shares).changed_since(&before);
        let what: Vec<&str> = changed.iter().map(|r| r.what.as_str()).collect();
        assert_eq!(what, ["config core.fsmonitor=touch /y", "hook pre-commit"]);
        assert!(changed.iter().all(|r| r.git_dir == repo.join(".git")));
    }

    #[test]
    fn a_rewritten_hook_is_seen_and_a_removed_one_is_no_danger() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path();
        git(repo, &["init", "-q"]);
        let hook = repo.join(".git/hooks/post-checkout");
        std::fs::write(&hook, "#!/bin/sh\ntrue\n").unwrap();
        let shares = [share(repo)];
        let before = Snapshot::of(&shares);
        // Same length, same mtime: still a change (its ctime moved).
        let mtime = std::fs::metadata(&hook).unwrap().modified().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&hook, "#!/bin/sh\nevil\n").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&hook)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        let changed = Snapshot::of(&shares).changed_since(&before);
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert_eq!(changed[0].what, "hook post-checkout");

        let before = Snapshot::of(&shares);
        std::fs::remove_file(&hook).unwrap();
        assert!(Snapshot::of(&shares).changed_since(&before).is_empty());
    }

    #[test]
    fn an_oversized_config_is_reported_unread() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path();
        git(repo, &["init", "-q"]);
        let shares = [share(repo)];
        let before = Snapshot::of(&shares);
        let mut config = std::fs::read_to_string(repo.join(".git/config")).unwrap();
        config.push_str(&format!("# {}\n", "x".repeat(MAX_CONFIG_BYTES as usize)));
        std::fs::write(repo.join(".git/config"), config).unwrap();
        let changed = Snapshot::of(&shares).changed_since(&before);
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert!(changed[0].what.starts_with("config (over"), "{changed:?}");
        let after = Snapshot::of(&shares);
        assert!(Snapshot::of(&shares).changed_since(&after).is_empty());
    }

    #[test]
    fn a_worktrees_git_directory_share_and_read_only_shares() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        std::fs::create_dir(&repo).unwrap();
        git(&repo, &["init", "-q"]);
        // The repository's git directory, shared as itself (a worktree's VM).
        let shares = [share(&repo.join(".git"))];
        let before = Snapshot::of(&shares);
        std::fs::write(repo.join(".git/hooks/pre-push"), "#!/bin/sh\n").unwrap();
        assert_eq!(Snapshot::of(&shares).changed_since(&before).len(), 1);

        // The guest cannot write a read-only share: not looked at.
        let read_only = [Share {
            read_only: true,
            ..share(&repo)
        }];
        assert_eq!(Snapshot::of(&read_only), Snapshot::default());
    }
}
