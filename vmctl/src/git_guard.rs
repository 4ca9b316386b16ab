//! What git on the host runs from a repository the guest can write: the hooks in its
//! git directory, and the commands its config names (`core.fsmonitor`,
//! `core.hooksPath`, filters, `credential.helper`, ...). An agent in the VM can
//! change them, and neither `git status` nor `git diff` shows that; git on the host
//! then runs them as the host's user. The guest's git needs its git directory
//! writable, so vmctl cannot forbid this: it looks before and after each session and
//! says what changed.
//!
//! It also says when the guest registered a worktree outside every share (`git
//! worktree add /tmp/wt`): the worktree's files then live in the guest's memory and
//! are lost when the VM stops, which nothing else would tell.
//!
//! It looks at the git directories of the VM's writable shares: `SHARE/.git`, and a
//! share that is itself a git directory (a worktree's repository); with each, its
//! submodules' git directories (`modules/...`) and its worktrees' `config.worktree`.
//! Repositories deeper inside a share, and changes made while no session runs, are
//! not seen.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::guest_writable::read_file;
use crate::shares::Share;
use crate::state::VmDir;
use crate::worktree::read_link_file;

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

/// What one snapshot reads of config files, all together: the guest can make a
/// thousand worktrees in each of a thousand submodules, each with a config file
/// (links to one file, even), and each entry is kept. Past either, a file is reported
/// unread whenever it changes, as a file too large is.
const SNAPSHOT_CONFIG_BYTES: u64 = 4 * MAX_CONFIG_BYTES;
const SNAPSHOT_CONFIG_FILES: usize = 2 * MAX_ENTRIES;

/// Entries of one config file kept (those that are more than plain settings); past
/// it, the file is one entry saying so, reported whenever the file changes.
const MAX_CONFIG_ENTRIES: usize = 256;

/// A change the guest may have made to what git on the host runs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Runnable {
    /// The git directory it belongs to.
    pub git_dir: PathBuf,
    /// `hook pre-commit`, `config core.fsmonitor=...`.
    pub what: String,
}

/// A worktree of a shared repository whose directory is in the guest's own
/// filesystem, outside every share: its files are gone when the VM stops.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct VmOnlyWorktree {
    /// The git directory (on the host) that registers it.
    pub git_dir: PathBuf,
    /// Its directory, a guest path.
    pub path: PathBuf,
    /// What it has checked out: `branch NAME` or `detached`.
    pub head: String,
}

/// What a session changed that git on the host does not show.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub runnables: Vec<Runnable>,
    pub vm_only_worktrees: Vec<VmOnlyWorktree>,
}

/// What git on the host would run from the repositories of `shares`, and the
/// worktrees they have in the guest only, as found now.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    runnables: BTreeSet<(Runnable, String)>,
    vm_only_worktrees: BTreeSet<VmOnlyWorktree>,
    /// Each config file read, by its fingerprint, with the entries found in it: a file
    /// unchanged since the last snapshot is not read again.
    configs: BTreeMap<PathBuf, ConfigReading>,
}

impl Snapshot {
    pub fn of(shares: &[Share]) -> Snapshot {
        Self::take(shares, None)
    }

    /// A snapshot of the same shares taken later, reusing what is unchanged.
    pub fn retake(&self, shares: &[Share]) -> Snapshot {
        Self::take(shares, Some(self))
    }

    fn take(shares: &[Share], earlier: Option<&Snapshot>) -> Snapshot {
        let mut snapshot = Snapshot::default();
        let mut budget = ConfigBudget {
            bytes_left: SNAPSHOT_CONFIG_BYTES,
            files_left: SNAPSHOT_CONFIG_FILES,
        };
        snapshot.runnables.extend(redirects(shares));
        let mut dirs = Vec::new();
        for git_dir in git_dirs(shares) {
            let (with_modules, all_modules) = with_submodules(&git_dir);
            if !all_modules {
                // Too many to look at is reported once, as a change of its own.
                let what = format!("modules (over {MAX_ENTRIES} directories, not all looked at)");
                let runnable = Runnable {
                    git_dir: git_dir.host,
                    what,
                };
                snapshot.runnables.insert((runnable, String::new()));
            }
            dirs.extend(with_modules);
        }
        for GitDir { host, guest } in dirs {
            let mut found = hooks(&host);
            // Config and hooks come from there instead (a worktree's, or the guest's
            // copy of the git directory with its own config).
            if let Some(fingerprint) = fingerprint(&host.join("commondir")) {
                let what = "commondir, which names the directory git takes its config and \
                            hooks from";
                found.push((what.into(), fingerprint));
            }
            let (files, all_files) = config_files(&host);
            if !all_files {
                found.push((
                    format!("worktrees (over {MAX_ENTRIES}, not all their config read)"),
                    String::new(),
                ));
            }
            for file in files {
                let path = host.join(&file);
                let reused = earlier.and_then(|earlier| earlier.configs.get(&path));
                if let Some(reading) = commands(&host, &file, reused, &mut budget) {
                    found.extend(reading.1.iter().cloned());
                    snapshot.configs.insert(path, reading);
                }
            }
            snapshot
                .runnables
                .extend(found.into_iter().map(|(what, fingerprint)| {
                    let git_dir = host.clone();
                    (Runnable { git_dir, what }, fingerprint)
                }));
            snapshot
                .vm_only_worktrees
                .extend(vm_only_worktrees(&host, &guest, shares));
        }
        snapshot
    }

    /// What is new or changed in `self` since `before` (a hook, a command or a
    /// worktree gone is no danger).
    pub fn changed_since(&self, before: &Snapshot) -> Changes {
        let mut runnables: Vec<Runnable> = self
            .runnables
            .difference(&before.runnables)
            .map(|(runnable, _)| runnable.clone())
            .collect();
        runnables.dedup();
        let vm_only_worktrees = self
            .vm_only_worktrees
            .difference(&before.vm_only_worktrees)
            .cloned()
            .collect();
        Changes {
            runnables,
            vm_only_worktrees,
        }
    }
}

/// A git directory in a share, at its host and guest paths.
struct GitDir {
    host: PathBuf,
    guest: PathBuf,
}

/// The git directories of the writable shares.
fn git_dirs(shares: &[Share]) -> Vec<GitDir> {
    let mut dirs = BTreeMap::new();
    for share in shares.iter().filter(|s| !s.read_only) {
        let dot_git = share.host.join(".git");
        if dot_git.is_dir() {
            dirs.insert(dot_git, share.guest.join(".git"));
        } else if is_git_dir(&share.host) {
            dirs.insert(share.host.clone(), share.guest.clone());
        }
    }
    dirs.into_iter()
        .map(|(host, guest)| GitDir { host, guest })
        .collect()
}

/// A share's `.git` that is not a directory: a file naming the git directory git on
/// the host uses (a worktree's), or a link. The guest can point it at a copy of the repository's
/// git directory with config and hooks of its own, which the snapshot of the share's
/// `.git` would never see: its change is reported, as that of a hook.
fn redirects(shares: &[Share]) -> Vec<(Runnable, String)> {
    shares
        .iter()
        .filter(|share| !share.read_only)
        .map(|share| share.host.join(".git"))
        // A link counts, even to a directory: to another repository's, say.
        .filter(|dot_git| std::fs::symlink_metadata(dot_git).is_ok_and(|m| !m.is_dir()))
        .filter_map(|dot_git| {
            let fingerprint = fingerprint(&dot_git)?;
            let what = ".git (a file or a link), which names the git directory git uses".into();
            Some((
                Runnable {
                    git_dir: dot_git,
                    what,
                },
                fingerprint,
            ))
        })
        .collect()
}

fn is_git_dir(dir: &Path) -> bool {
    dir.join("HEAD").is_file() && dir.join("objects").is_dir()
}

/// How deep submodules' git directories are looked for, and how many directories
/// under `modules`, or entries under `worktrees`, are looked at (the guest could
/// make any number).
const MAX_MODULE_DEPTH: usize = 8;
const MAX_ENTRIES: usize = 1024;

/// `git_dir` and its submodules' git directories (`modules/NAME`, where NAME may hold
/// slashes, and theirs in turn): git on the host runs their hooks and config in the
/// submodules' checkouts. Past [`MAX_ENTRIES`] directories the rest is left; and
/// whether none was.
fn with_submodules(git_dir: &GitDir) -> (Vec<GitDir>, bool) {
    let mut found = vec![GitDir {
        host: git_dir.host.clone(),
        guest: git_dir.guest.clone(),
    }];
    let mut pending = vec![(
        git_dir.host.join("modules"),
        git_dir.guest.join("modules"),
        0,
    )];
    // Each directory found counts, looked into or not.
    let mut seen = 0;
    while let Some((host, guest, depth)) = pending.pop() {
        if depth > MAX_MODULE_DEPTH {
            continue;
        }
        let Some(entries) = real_dir_entries(&host) else {
            continue;
        };
        for entry in entries.flatten() {
            // Not through links: only what is really there.
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            seen += 1;
            if seen > MAX_ENTRIES {
                return (found, false);
            }
            let (host, guest) = (entry.path(), guest.join(entry.file_name()));
            if is_git_dir(&host) {
                pending.push((host.join("modules"), guest.join("modules"), depth + 1));
                found.push(GitDir { host, guest });
            } else {
                // A name with a slash: `modules/libs/foo`.
                pending.push((host, guest, depth + 1));
            }
        }
    }
    (found, true)
}

/// The config files of `git_dir` that git reads, relative to it: its own, and each
/// worktree's `config.worktree` (read by git working in that worktree, such as one
/// the host made), of the first [`MAX_ENTRIES`] worktrees; and whether that was
/// all of them.
fn config_files(git_dir: &Path) -> (Vec<PathBuf>, bool) {
    let mut files = vec![PathBuf::from("config"), PathBuf::from("config.worktree")];
    let Some(entries) = real_dir_entries(&git_dir.join("worktrees")) else {
        return (files, true);
    };
    for entry in entries.flatten() {
        if files.len() >= MAX_ENTRIES {
            return (files, false);
        }
        let name = entry.file_name();
        files.push(Path::new("worktrees").join(name).join("config.worktree"));
    }
    (files, true)
}

/// The worktrees `git_dir` registers (`worktrees/NAME/gitdir`, which names the
/// worktree's `.git` file) whose directory is outside every share, as seen from the
/// guest, and not on the host either (a worktree the host made elsewhere, as Paseo
/// does, is the host's).
fn vm_only_worktrees(
    git_dir: &Path,
    guest_git_dir: &Path,
    shares: &[Share],
) -> Vec<VmOnlyWorktree> {
    let Some(entries) = real_dir_entries(&git_dir.join("worktrees")) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten().take(MAX_ENTRIES) {
        let admin = entry.path();
        let Some(dot_git) = read_link_file(&admin.join("gitdir"), "") else {
            continue;
        };
        // `worktree.useRelativePaths` writes it relative to the entry's directory.
        let guest_admin = guest_git_dir.join("worktrees").join(entry.file_name());
        let dot_git = crate::shares::normalize_absolute(&guest_admin.join(dot_git));
        let Some(path) = dot_git.parent().map(Path::to_path_buf) else {
            continue;
        };
        let shared = shares.iter().any(|share| path.starts_with(&share.guest));
        if shared || names_back(&dot_git, &admin) {
            continue;
        }
        let head = read_link_file(&admin.join("HEAD"), "ref: refs/heads/")
            .map(|branch| format!("branch {}", branch.display()))
            .unwrap_or_else(|| "detached".into());
        found.push(VmOnlyWorktree {
            git_dir: git_dir.to_path_buf(),
            path,
            head,
        });
    }
    found
}

/// Whether the host has a worktree's `.git` file at `dot_git` that names `admin`, its
/// entry in the git directory, back: a worktree the host made.
fn names_back(dot_git: &Path, admin: &Path) -> bool {
    let (Some(named), Some(worktree)) = (read_link_file(dot_git, "gitdir: "), dot_git.parent())
    else {
        return false;
    };
    crate::shares::normalize_absolute(&worktree.join(named)) == admin
}

/// The entries of the directory at `path`, unless it is missing or a link: the
/// guest's link to elsewhere on the host is not looked through.
fn real_dir_entries(path: &Path) -> Option<std::fs::ReadDir> {
    let is_dir = std::fs::symlink_metadata(path).ok()?.is_dir();
    is_dir.then(|| std::fs::read_dir(path).ok()).flatten()
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

/// What a config file of `git_dir` (`file`, relative to it) holds of what git runs:
/// the file's fingerprint, and each entry that is not one of [`PLAIN_KEYS`] as `FILE
/// KEY=VALUE` with its own fingerprint (the entry itself). None when there is no
/// file; a file too large or not a regular one (a FIFO, a link to a device) is one
/// entry saying so. Parsed by `git config --file -`, which runs nothing and follows
/// no includes (without git on the host there is nothing to run them), unless
/// `earlier`, an earlier reading, has the same fingerprint.
fn commands(
    git_dir: &Path,
    file: &Path,
    earlier: Option<&ConfigReading>,
    budget: &mut ConfigBudget,
) -> Option<ConfigReading> {
    let path = git_dir.join(file);
    let fingerprint = fingerprint(&path)?;
    let file = file.display();
    let unread = |why: &str| {
        let what = format!("{file} ({why}, not read)");
        Some((fingerprint.clone(), vec![(what, fingerprint.clone())]))
    };
    if budget.files_left == 0 {
        return unread(&format!(
            "over {SNAPSHOT_CONFIG_FILES} config files in the shares"
        ));
    }
    budget.files_left -= 1;
    if let Some(earlier) = earlier.filter(|earlier| earlier.0 == fingerprint) {
        return Some(earlier.clone());
    }
    // Read here, once, and handed to git on its stdin: git never opens what the
    // guest may have swapped in since.
    let text = match read_file(&path, true, MAX_CONFIG_BYTES) {
        Ok(text) => text,
        Err(e) if e.kind() == ErrorKind::FileTooLarge => {
            return unread(&format!("over {MAX_CONFIG_BYTES} bytes"))
        }
        Err(e) if e.kind() == ErrorKind::InvalidData => return unread("not a regular file"),
        Err(_) => return None,
    };
    let Some(bytes_left) = budget.bytes_left.checked_sub(text.len() as u64) else {
        budget.bytes_left = 0;
        return unread(&format!(
            "over the {SNAPSHOT_CONFIG_BYTES} bytes of config files in the shares"
        ));
    };
    budget.bytes_left = bytes_left;
    let entries = list_config(&text)?;
    let mut found = Vec::new();
    for entry in entries.split(|b| *b == 0).filter(|e| !e.is_empty()) {
        let entry = String::from_utf8_lossy(entry);
        let (key, value) = entry.split_once('\n').unwrap_or((&entry, ""));
        if !is_plain(key) {
            if found.len() == MAX_CONFIG_ENTRIES {
                return unread(&format!(
                    "over {MAX_CONFIG_ENTRIES} entries that are more than plain settings"
                ));
            }
            let what = format!("{file} {key}={value}");
            found.push((what.clone(), what));
        }
    }
    Some((fingerprint, found))
}

/// What is left of what one snapshot reads of config files ([`SNAPSHOT_CONFIG_BYTES`],
/// [`SNAPSHOT_CONFIG_FILES`]).
struct ConfigBudget {
    bytes_left: u64,
    files_left: usize,
}

/// `git config --list` of the config file `text`, NUL-separated; None without git.
fn list_config(text: &[u8]) -> Option<Vec<u8>> {
    let mut git = Command::new("git")
        .args(["config", "--no-includes", "--null", "--list", "--file", "-"])
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut stdin = git.stdin.take()?;
    // Written beside the reading, so neither pipe can fill up and stall the other.
    let output = std::thread::scope(|scope| {
        scope.spawn(move || stdin.write_all(text));
        git.wait_with_output()
    });
    Some(output.ok()?.stdout)
}

/// A config file's fingerprint and what [`commands`] found in it.
type ConfigReading = (String, Vec<(String, String)>);

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
    report(&before.retake(&shares).changed_since(&before));
    outcome
}

/// Tells the user, on stderr, what a session changed; nothing when nothing did.
pub fn report(changes: &Changes) {
    if let Some(warning) = warning(changes) {
        vmm::to_stderr!("{warning}");
    }
}

/// At most 200 characters of `text`, on one line: a config value the guest wrote may
/// hold line breaks, which would print lines of their own that look like vmctl's.
fn one_line(text: &str) -> String {
    let cut: String = text.chars().take(200).collect();
    crate::terminal::one_line(&cut).into_owned()
}

/// `path` on one line, whole: the guest names some of the directories the warning
/// gives (a submodule's under `modules/`, a worktree it registered), and the warning
/// says where to look.
fn path_on_one_line(path: &Path) -> String {
    crate::terminal::one_line(&path.display().to_string()).into_owned()
}

/// The warning [`report`] prints, if any.
fn warning(changes: &Changes) -> Option<String> {
    let mut lines = Vec::new();
    if let Some(first) = changes.runnables.first() {
        lines.push(String::from(
            "vmctl: warning: the VM changed what git on the host runs (hooks, commands in \
             its config), which git status and git diff do not show; review before running \
             git there on the host:",
        ));
        for runnable in &changes.runnables {
            let what = one_line(&runnable.what);
            let git_dir = path_on_one_line(&runnable.git_dir);
            lines.push(format!("vmctl:   {git_dir}: {what}"));
        }
        lines.push(format!(
            "vmctl:   (see `ls -l {0}/hooks` and `git config --file {0}/config --list`)",
            path_on_one_line(&first.git_dir)
        ));
    }
    if !changes.vm_only_worktrees.is_empty() {
        lines.push(String::from(
            "vmctl: warning: the VM made git worktrees outside its shares, in its own \
             memory: their files are lost when the VM stops (what is committed there stays \
             in the repository). Commit before then, or make worktrees inside the \
             workspace:",
        ));
        for worktree in &changes.vm_only_worktrees {
            let head = one_line(&worktree.head);
            lines.push(format!(
                "vmctl:   {} ({head}), of {}",
                path_on_one_line(&worktree.path),
                path_on_one_line(&worktree.git_dir)
            ));
        }
        lines.push(String::from(
            "vmctl:   (once the VM has stopped, `git worktree prune` on the host forgets \
             them and frees their branches)",
        ));
    }
    (!lines.is_empty()).then(|| lines.join("\n"))
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

    /// A new repository, shared writable.
    fn new_repo() -> (tempfile::TempDir, [Share; 1]) {
        let dir = tempfile::tempdir().unwrap();
        git(dir.path(), &["init", "-q"]);
        let shares = [share(dir.path())];
        (dir, shares)
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

    /// The guest points git elsewhere, at a copy of the git directory with config of
    /// its own: through `.git` made a file (`gitdir:`), or through `commondir`.
    #[test]
    fn a_git_directory_redirected_elsewhere_is_seen() {
        let (dir, shares) = new_repo();
        let repo = dir.path();
        let before = Snapshot::of(&shares);
        std::fs::write(repo.join(".git/commondir"), "../.evil\n").unwrap();
        let changed = Snapshot::of(&shares).changed_since(&before).runnables;
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert!(changed[0].what.starts_with("commondir"), "{changed:?}");

        let assert_redirected = |changed: &[Runnable]| {
            let redirect = |r: &Runnable| {
                r.git_dir == repo.join(".git") && r.what.starts_with(".git (a file or a link)")
            };
            assert!(changed.iter().any(redirect), "{changed:?}");
        };
        std::fs::rename(repo.join(".git"), repo.join(".evil")).unwrap();
        std::fs::write(repo.join(".git"), "gitdir: .evil\n").unwrap();
        assert_redirected(&Snapshot::of(&shares).changed_since(&before).runnables);
        // A link to another repository's git directory: a change too.
        let other = tempfile::tempdir().unwrap();
        git(other.path(), &["init", "-q"]);
        std::fs::remove_file(repo.join(".git")).unwrap();
        std::os::unix::fs::symlink(other.path().join(".git"), repo.join(".git")).unwrap();
        assert_redirected(&Snapshot::of(&shares).changed_since(&before).runnables);
        std::fs::remove_file(repo.join(".git")).unwrap();
        std::fs::write(repo.join(".git"), "gitdir: .evil\n").unwrap();
        // Pointed elsewhere again: a change too.
        let pointing = Snapshot::of(&shares);
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(repo.join(".git"), "gitdir: .other\n").unwrap();
        assert_eq!(
            Snapshot::of(&shares)
                .changed_since(&pointing)
                .runnables
                .len(),
            1
        );
    }

    #[test]
    fn a_value_with_line_breaks_is_reported_on_one_line() {
        let changes = Changes {
            runnables: vec![Runnable {
                git_dir: PathBuf::from("/w/.git"),
                what: "config core.fsmonitor=x\nvmctl: all is well\r".into(),
            }],
            vm_only_worktrees: vec![],
        };
        let warning = warning(&changes).unwrap();
        assert!(
            warning
                .lines()
                .all(|line| !line.starts_with("vmctl: all is well")),
            "{warning}"
        );
        assert!(warning.contains("x\\nvmctl: all is well\\r"), "{warning}");
    }

    /// The git directories and worktree paths the warning names may be the guest's own
    /// (a submodule's under `modules/`, a worktree it registered): on one line too.
    #[test]
    fn directories_the_guest_named_are_reported_on_one_line() {
        let forged = "/w/.git/modules/x\nvmctl: all is well";
        let changes = Changes {
            runnables: vec![Runnable {
                git_dir: PathBuf::from(forged),
                what: "hook pre-commit".into(),
            }],
            vm_only_worktrees: vec![VmOnlyWorktree {
                git_dir: PathBuf::from(forged),
                path: PathBuf::from("/tmp/wt\nvmctl: nothing to do"),
                head: "detached".into(),
            }],
        };
        let warning = warning(&changes).unwrap();
        assert!(
            warning.lines().all(|line| line.starts_with("vmctl: ")
                && !line.starts_with("vmctl: all is well")
                && !line.starts_with("vmctl: nothing to do")),
            "{warning}"
        );
        assert!(warning.contains("x\\nvmctl: all is well"), "{warning}");
        assert!(
            warning.contains("/tmp/wt\\nvmctl: nothing to do"),
            "{warning}"
        );
    }

    #[test]
    fn new_hooks_and_commands_are_seen_and_plain_settings_are_not() {
        let (dir, shares) = new_repo();
        let repo = dir.path();
        let before = Snapshot::of(&shares);
        assert!(Snapshot::of(&shares)
            .changed_since(&before)
            .runnables
            .is_empty());

        // What an agent does every day changes nothing that runs.
        git(repo, &["config", "user.name", "Agent"]);
        git(
            repo,
            &["remote", "add", "origin", "https://example.com/r.git"],
        );
        git(repo, &["config", "branch.main.remote", "origin"]);
        std::fs::write(repo.join(".git/hooks/pre-commit.sample"), "#!/bin/sh\n").unwrap();
        std::fs::write(repo.join(".git/hooks/notes.txt"), "not a hook\n").unwrap();
        assert_eq!(
            Snapshot::of(&shares).changed_since(&before).runnables,
            vec![]
        );

        std::fs::write(repo.join(".git/hooks/pre-commit"), "#!/bin/sh\ntouch /x\n").unwrap();
        git(repo, &["config", "core.fsmonitor", "touch /y"]);
        let changed = Snapshot::of(&shares).changed_since(&before).runnables;
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
        let changed = Snapshot::of(&shares).changed_since(&before).runnables;
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert_eq!(changed[0].what, "hook post-checkout");

        let before = Snapshot::of(&shares);
        std::fs::remove_file(&hook).unwrap();
        assert!(Snapshot::of(&shares)
            .changed_since(&before)
            .runnables
            .is_empty());
    }

    #[test]
    fn an_oversized_config_is_reported_unread() {
        let (dir, shares) = new_repo();
        let repo = dir.path();
        let before = Snapshot::of(&shares);
        let mut config = std::fs::read_to_string(repo.join(".git/config")).unwrap();
        config.push_str(&format!("# {}\n", "x".repeat(MAX_CONFIG_BYTES as usize)));
        std::fs::write(repo.join(".git/config"), config).unwrap();
        let changed = Snapshot::of(&shares).changed_since(&before).runnables;
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert!(changed[0].what.starts_with("config (over"), "{changed:?}");
        let after = Snapshot::of(&shares);
        assert!(Snapshot::of(&shares)
            .changed_since(&after)
            .runnables
            .is_empty());
    }

    /// What a snapshot reads and keeps of config files is bounded, all files together
    /// (links to one large file in every worktree's entry) and each file's entries;
    /// past a bound a file is one entry saying so, reported whenever the file changes.
    /// (Review: a thousand links to a 1 MiB file of half a million entries each kept
    /// tens of GB in every session's first snapshot.)
    #[test]
    fn what_a_snapshot_reads_of_config_files_is_bounded() {
        let (dir, shares) = new_repo();
        let repo = dir.path();
        let many = (0..MAX_CONFIG_ENTRIES + 1)
            .map(|i| format!("[alias]\n\ta{i} = status\n"))
            .collect::<String>();
        std::fs::write(repo.join("many"), &many).unwrap();
        let large = format!("[alias]\n\tst = status\n# {}\n", "x".repeat(900 << 10));
        std::fs::write(repo.join("large"), &large).unwrap();
        let worktrees = repo.join(".git/worktrees");
        for i in 0..6 {
            std::fs::create_dir_all(worktrees.join(format!("w{i}"))).unwrap();
            let target = if i == 0 { "many" } else { "large" };
            std::fs::hard_link(
                repo.join(target),
                worktrees.join(format!("w{i}/config.worktree")),
            )
            .unwrap();
        }
        let snapshot = Snapshot::of(&shares);
        let found: Vec<&str> = snapshot
            .runnables
            .iter()
            .map(|(runnable, _)| runnable.what.as_str())
            .collect();
        assert!(
            found.contains(&"worktrees/w0/config.worktree (over 256 entries that are more than plain settings, not read)"),
            "{found:?}"
        );
        // 4 MiB: four of the 900 KiB files are read, the fifth is not.
        let read = found
            .iter()
            .filter(|what| what.ends_with("alias.st=status"))
            .count();
        let unread = found
            .iter()
            .filter(|what| what.contains("bytes of config files in the shares"))
            .count();
        assert_eq!((read, unread), (4, 1), "{found:?}");
        assert!(snapshot
            .configs
            .values()
            .all(|(_, entries)| entries.len() <= MAX_CONFIG_ENTRIES));

        // Past the number of files, a file is not read at all.
        let mut no_files_left = ConfigBudget {
            bytes_left: SNAPSHOT_CONFIG_BYTES,
            files_left: 0,
        };
        let (_, entries) = commands(
            &repo.join(".git"),
            Path::new("config"),
            None,
            &mut no_files_left,
        )
        .unwrap();
        assert_eq!(entries.len(), 1);
        assert!(
            entries[0].0.starts_with("config (over 2048 config files"),
            "{entries:?}"
        );
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
        assert_eq!(
            Snapshot::of(&shares).changed_since(&before).runnables.len(),
            1
        );

        // The guest cannot write a read-only share: not looked at.
        let read_only = [Share {
            read_only: true,
            ..share(&repo)
        }];
        assert_eq!(Snapshot::of(&read_only), Snapshot::default());
    }

    #[test]
    fn a_worktree_the_vm_made_outside_the_shares_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&repo).unwrap();
        git(&repo, &["init", "-q"]);
        git(
            &repo,
            &[
                "-c",
                "user.name=a",
                "-c",
                "user.email=a@example.com",
                "commit",
                "-q",
                "--allow-empty",
                "-m",
                "base",
            ],
        );
        let shares = [share(&repo)];
        let before = Snapshot::of(&shares);

        // Inside the share: its files are the host's.
        git(&repo, &["worktree", "add", "-q", "inside", "-b", "inside"]);
        // Outside, made by the host (as Paseo does): the host's too.
        let host_made = outside.join("host-made");
        git(
            &repo,
            &[
                "worktree",
                "add",
                "-q",
                host_made.to_str().unwrap(),
                "-b",
                "host",
            ],
        );
        assert_eq!(
            before.retake(&shares).changed_since(&before),
            Changes::default()
        );

        // Outside, in the guest only: what the host sees of a guest's `git worktree add
        // /tmp/wt` is its entry, naming a directory it does not have.
        let vm_made = outside.join("vm-made");
        git(
            &repo,
            &[
                "worktree",
                "add",
                "-q",
                vm_made.to_str().unwrap(),
                "-b",
                "feature",
            ],
        );
        std::fs::remove_dir_all(&vm_made).unwrap();
        // Written relative to its entry (`worktree.useRelativePaths`), detached.
        let relative = repo.join(".git/worktrees/relative");
        std::fs::create_dir_all(&relative).unwrap();
        std::fs::write(
            relative.join("gitdir"),
            "../../../../outside/relative/.git\n",
        )
        .unwrap();
        std::fs::write(
            relative.join("HEAD"),
            "0123456789012345678901234567890123456789\n",
        )
        .unwrap();

        let changes = before.retake(&shares).changed_since(&before);
        assert!(changes.runnables.is_empty(), "{changes:?}");
        let found: Vec<(&Path, &str)> = changes
            .vm_only_worktrees
            .iter()
            .map(|w| (w.path.as_path(), w.head.as_str()))
            .collect();
        let relative_path = outside.join("relative");
        assert_eq!(
            found,
            [
                (relative_path.as_path(), "detached"),
                (vm_made.as_path(), "branch feature")
            ]
        );
        assert!(changes
            .vm_only_worktrees
            .iter()
            .all(|w| w.git_dir == repo.join(".git")));
        let said = warning(&changes).unwrap();
        assert!(
            said.contains(&format!(
                "{} (branch feature), of {}",
                vm_made.display(),
                repo.join(".git").display()
            )),
            "{said}"
        );
        assert!(
            !said.contains("changed what git on the host runs"),
            "{said}"
        );

        // Said once: the next session did not make it.
        let after = Snapshot::of(&shares);
        assert_eq!(
            after.retake(&shares).changed_since(&after),
            Changes::default()
        );
        assert_eq!(warning(&Changes::default()), None);
    }

    #[test]
    fn an_unchanged_config_is_not_read_again() {
        let (dir, shares) = new_repo();
        let repo = dir.path();
        let mut before = Snapshot::of(&shares);
        // Mark the reading: a retake that keeps the mark did not run git again.
        let config = repo.join(".git/config");
        let marked = ("config marked.by=test".to_string(), "mark".to_string());
        before
            .configs
            .get_mut(&config)
            .unwrap()
            .1
            .push(marked.clone());
        let again = before.retake(&shares);
        assert!(again.configs[&config].1.contains(&marked));

        git(repo, &["config", "core.pager", "less"]);
        let changed = before.retake(&shares);
        assert!(!changed.configs[&config].1.contains(&marked));
        let what: Vec<String> = changed
            .changed_since(&before)
            .runnables
            .into_iter()
            .map(|r| r.what)
            .collect();
        assert_eq!(what, ["config core.pager=less"]);
    }

    #[test]
    fn submodules_and_worktrees_config_are_looked_at() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path();
        git(repo, &["init", "-q"]);
        git(
            repo,
            &[
                "-c",
                "user.name=a",
                "-c",
                "user.email=a@example.com",
                "commit",
                "-q",
                "--allow-empty",
                "-m",
                "base",
            ],
        );
        let module = repo.join(".git/modules/libs/foo");
        std::fs::create_dir_all(&module).unwrap();
        git(&module, &["init", "-q", "--bare"]);
        git(repo, &["worktree", "add", "-q", "wt"]);
        let shares = [share(repo)];
        let before = Snapshot::of(&shares);

        std::fs::write(module.join("hooks/post-checkout"), "#!/bin/sh\n").unwrap();
        git(&module, &["config", "core.sshCommand", "evil"]);
        std::fs::write(
            repo.join(".git/worktrees/wt/config.worktree"),
            "[core]\n\tfsmonitor = evil\n",
        )
        .unwrap();
        let mut changed: Vec<(PathBuf, String)> = before
            .retake(&shares)
            .changed_since(&before)
            .runnables
            .into_iter()
            .map(|r| (r.git_dir, r.what))
            .collect();
        changed.sort();
        assert_eq!(
            changed,
            [
                (
                    repo.join(".git"),
                    "worktrees/wt/config.worktree core.fsmonitor=evil".to_string()
                ),
                (module.clone(), "config core.sshcommand=evil".to_string()),
                (module.clone(), "hook post-checkout".to_string()),
            ]
        );
    }

    #[test]
    fn too_many_submodule_directories_are_reported_not_all_read() {
        let (dir, shares) = new_repo();
        let repo = dir.path();
        let before = Snapshot::of(&shares);
        for i in 0..=MAX_ENTRIES {
            std::fs::create_dir_all(repo.join(format!(".git/modules/decoy{i}"))).unwrap();
        }
        let changed = before.retake(&shares).changed_since(&before).runnables;
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert!(
            changed[0].what.starts_with("modules (over 1024"),
            "{changed:?}"
        );
        let after = Snapshot::of(&shares);
        assert!(after
            .retake(&shares)
            .changed_since(&after)
            .runnables
            .is_empty());
    }

    /// The guest can put a FIFO (whose open waits for a writer) where vmctl reads:
    /// reported, never waited on.
    #[test]
    fn fifos_where_files_belong_do_not_block() {
        let (dir, shares) = new_repo();
        let repo = dir.path();
        let before = Snapshot::of(&shares);
        let mkfifo = crate::guest_writable::make_fifo;
        std::fs::remove_file(repo.join(".git/config")).unwrap();
        mkfifo(&repo.join(".git/config"));
        std::fs::create_dir_all(repo.join(".git/worktrees/w")).unwrap();
        mkfifo(&repo.join(".git/worktrees/w/gitdir"));
        mkfifo(&repo.join(".git/worktrees/w/config.worktree"));
        let changes = before.retake(&shares).changed_since(&before);
        let what: Vec<&str> = changes.runnables.iter().map(|r| r.what.as_str()).collect();
        assert_eq!(
            what,
            [
                "config (not a regular file, not read)",
                "worktrees/w/config.worktree (not a regular file, not read)"
            ]
        );
        assert!(changes.vm_only_worktrees.is_empty());
    }
}
