//! The host user's git identity in the guest. `git commit` there needs `user.name` and
//! `user.email`, which the host keeps in `~/.gitconfig`, a file that may also hold
//! credentials (URL rewrites with tokens, credential helpers) and host paths: it is
//! not copied. Only [`KEYS`] are, at each session, into a file in the VM's agent home
//! that git in the guest reads as its system config (`GIT_CONFIG_SYSTEM`), the lowest
//! precedence: a repository's own identity, and the guest's own `~/.gitconfig`, win.
//! The file includes the image's own system config (`/etc/gitconfig`), which the
//! variable would otherwise replace.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::agent::{agent_home_dir, lock_agent_homes, AGENT_HOMES_IN_GUEST};
use crate::guest_writable;
use crate::state::VmDir;

/// The settings copied: who commits, and the branch a new repository starts on.
const KEYS: [(&str, &str); 3] = [
    ("user", "name"),
    ("user", "email"),
    ("init", "defaultBranch"),
];
/// The file's name in the agent home.
const FILE: &str = "gitconfig";
/// Git's variable naming the system config file.
const SYSTEM_CONFIG_VAR: &str = "GIT_CONFIG_SYSTEM";

/// The guest's own system config, which [`FILE`] includes.
const IMAGE_SYSTEM_CONFIG: &str = "/etc/gitconfig";

/// Refreshes `vm`'s copy of the host user's git identity, as git on the host gives it
/// in `dir` (the directory the session starts in: an `includeIf "gitdir:..."` may
/// choose a work identity there); the variable that points the guest's git at it, or
/// None when the host has none (or it cannot be written, which is said).
pub fn guest_env(vm: &VmDir, dir: &Path) -> Option<(String, String)> {
    let text = config_text(&host_values(dir))?;
    let homes = agent_home_dir(vm);
    let written = std::fs::create_dir_all(&homes)
        .and_then(|()| lock_agent_homes(vm))
        .and_then(|_refreshing| {
            let dir = guest_writable::open_dir(&homes)?;
            if guest_writable::holds_read_only(&dir, FILE, text.as_bytes()) {
                return Ok(());
            }
            guest_writable::write_read_only(dir, FILE, text.as_bytes())
        });
    if let Err(e) = written {
        vmm::to_stderr!(
            "vmctl: warning: cannot give the VM your git identity ({}: {e}); git commit \
             there needs `git config user.email`",
            homes.join(FILE).display()
        );
        return None;
    }
    Some((
        SYSTEM_CONFIG_VAR.to_string(),
        format!("{AGENT_HOMES_IN_GUEST}/{FILE}"),
    ))
}

/// The host user's global values of [`KEYS`] that are set in `dir`, as (section, key,
/// value), read by one `git config` (none when git is not there).
fn host_values(dir: &Path) -> Vec<(&'static str, &'static str, String)> {
    const SCOPE: [&str; 2] = ["--global", "--includes"];
    // `dir` may be in a repository the guest can write, whose `.git/HEAD` it can make
    // a FIFO that git waits on for ever, or whose `.git/config` it can break, which
    // git dies on: past the deadline, or after such a failure, the values outside it.
    values_in(&SCOPE, dir)
        .or_else(|| values_in(&SCOPE, Path::new("/")))
        .unwrap_or_default()
}

/// How long one `git config` may take.
const GIT_DEADLINE: Duration = Duration::from_secs(2);

/// The values of [`KEYS`] in the git config that `scope` selects (`--global`,
/// `--file PATH`), as git reads it in `dir` (a directory that is gone reads as `/`);
/// none when git is not there, None when it took longer than [`GIT_DEADLINE`] or
/// failed (a repository's broken config in `dir`).
fn values_in(scope: &[&str], dir: &Path) -> Option<Vec<(&'static str, &'static str, String)>> {
    let pattern = KEYS
        .iter()
        .map(|(section, key)| format!("{section}\\.{}", key.to_lowercase()))
        .collect::<Vec<_>>()
        .join("|");
    let spawned = Command::new("git")
        .arg("config")
        .args(scope)
        .args(["-z", "--get-regexp"])
        .arg(format!("^({pattern})$"))
        .current_dir(if dir.is_dir() { dir } else { Path::new("/") })
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut git) = spawned else {
        return Some(Vec::new());
    };
    // Read as it comes: the end of its output is git's exit, with no poll's delay.
    let mut stdout = git.stdout.take()?;
    let (sender, listing) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut listed = Vec::new();
        let read = stdout.read_to_end(&mut listed).map(|_| listed);
        let _ = sender.send(read);
    });
    let Ok(Ok(listed)) = listing.recv_timeout(GIT_DEADLINE) else {
        // Killed, git's end of the pipe closes and the reader ends too.
        let _ = git.kill();
        let _ = git.wait();
        return None;
    };
    // 1: none of the keys is set.
    match git.wait().map(|status| status.code()) {
        Ok(Some(0 | 1)) => Some(values_of(&listed)),
        _ => None,
    }
}

/// [`KEYS`]' values in `git config -z --get-regexp` output (`key\nvalue\0` entries,
/// keys in lower case; the last of a key's values is the one git uses). Values that
/// span lines or are not UTF-8 are left out.
fn values_of(listed: &[u8]) -> Vec<(&'static str, &'static str, String)> {
    KEYS.iter()
        .filter_map(|&(section, key)| {
            let name = format!("{section}.{}", key.to_lowercase());
            let value = listed.split(|&byte| byte == 0).rev().find_map(|entry| {
                let newline = entry.iter().position(|&byte| byte == b'\n')?;
                (entry[..newline] == *name.as_bytes()).then(|| &entry[newline + 1..])
            })?;
            let value = std::str::from_utf8(value).ok()?;
            (!value.is_empty() && !value.contains('\n')).then(|| (section, key, value.to_string()))
        })
        .collect()
}

/// A git config file setting `values` (section, key, value), None when empty.
fn config_text(values: &[(&str, &str, String)]) -> Option<String> {
    if values.is_empty() {
        return None;
    }
    let mut text = String::from(
        "# Your git identity from the host, copied by vmctl at each session (only these\n\
         # settings). Set your own with `git config --global` in the VM.\n",
    );
    // First, so that the identity below wins over the image's.
    text.push_str(&format!("[include]\n\tpath = {IMAGE_SYSTEM_CONFIG}\n"));
    let mut section = "";
    for (this_section, key, value) in values {
        if *this_section != section {
            section = this_section;
            text.push_str(&format!("[{section}]\n"));
        }
        let quoted = value.replace('\\', "\\\\").replace('"', "\\\"");
        text.push_str(&format!("\t{key} = \"{quoted}\"\n"));
    }
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a repository whose config is broken (the guest can write a workspace's
    /// `.git/config`), git dies: the values are read outside it. (Review: git's
    /// failure read as no values, and the VM got no identity, silently.)
    #[test]
    fn a_broken_repository_config_falls_back_to_the_values_outside_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gitconfig");
        std::fs::write(&file, "[user]\n\temail = ann@example.com\n").unwrap();
        let repo = dir.path().join("repo");
        std::fs::create_dir_all(repo.join(".git")).unwrap();
        let initialized = Command::new("git")
            .args(["init", "-q"])
            .arg(&repo)
            .status()
            .unwrap();
        assert!(initialized.success());
        let config = repo.join(".git/config");
        let mut broken = std::fs::read_to_string(&config).unwrap();
        broken.push_str("[core\n");
        std::fs::write(&config, broken).unwrap();
        let scope = ["--file", file.to_str().unwrap()];
        assert_eq!(
            values_in(&scope, &repo),
            None,
            "git's failure taken for no values"
        );
        assert_eq!(
            values_in(&scope, Path::new("/")).unwrap(),
            [("user", "email", "ann@example.com".to_string())]
        );
    }

    #[test]
    fn git_lists_the_keys_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gitconfig");
        std::fs::write(
            &file,
            "[user]\n\tname = Ann\n\temail = ann@example.com\n\
             [init]\n\tdefaultBranch = trunk\n\
             [url \"https://TOKEN@github.com/\"]\n\tinsteadOf = https://github.com/\n",
        )
        .unwrap();
        assert_eq!(
            values_in(&["--file", file.to_str().unwrap()], Path::new("/")).unwrap(),
            [
                ("user", "name", "Ann".to_string()),
                ("user", "email", "ann@example.com".to_string()),
                ("init", "defaultBranch", "trunk".to_string()),
            ]
        );
    }

    #[test]
    fn one_listing_gives_each_keys_last_single_line_value() {
        let listed = b"user.name\nFirst\0user.email\na@b\0user.name\nLast\0\
                       init.defaultbranch\ntwo\nlines\0core.editor\nvi\0";
        assert_eq!(
            values_of(listed),
            [
                ("user", "name", "Last".to_string()),
                ("user", "email", "a@b".to_string()),
            ]
        );
        assert_eq!(values_of(b""), []);
        assert_eq!(values_of(b"user.email\n\xff\0"), [], "not UTF-8");
    }

    fn init_repository(path: &Path) {
        let init = Command::new("git")
            .args(["init", "-q"])
            .arg(path)
            .status()
            .unwrap();
        assert!(init.success(), "git init {}", path.display());
    }

    /// A work identity chosen by `includeIf "gitdir:..."` is the one given in that
    /// repository, as git on the host gives it there.
    #[test]
    fn the_identity_is_read_where_the_session_starts() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("work");
        let repo = work.join("repo");
        init_repository(&repo);
        let config = dir.path().join("config");
        std::fs::write(
            &config,
            format!(
                "[user]\n\temail = me@home.example\n\
                 [includeIf \"gitdir:{}/\"]\n\tpath = {}/work.inc\n",
                work.display(),
                dir.path().display()
            ),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("work.inc"),
            "[user]\n\temail = me@work.example\n",
        )
        .unwrap();
        let email = |at: &Path| {
            values_in(&["--file", config.to_str().unwrap(), "--includes"], at)
                .unwrap()
                .into_iter()
                .find(|(_, key, _)| *key == "email")
                .map(|(_, _, value)| value)
        };
        assert_eq!(email(&repo).as_deref(), Some("me@work.example"));
        assert_eq!(email(dir.path()).as_deref(), Some("me@home.example"));
    }

    /// A repository whose `.git/HEAD` the guest made a FIFO: git would wait on it for
    /// ever; it is given up on, and the values outside the repository are used.
    #[test]
    fn a_git_that_hangs_in_the_repository_is_given_up_on() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        init_repository(&repo);
        let head = repo.join(".git/HEAD");
        std::fs::remove_file(&head).unwrap();
        crate::guest_writable::make_fifo(&head);
        let started = std::time::Instant::now();
        assert_eq!(values_in(&["--global"], &repo), None);
        assert!(started.elapsed() < GIT_DEADLINE * 3);
        assert!(values_in(&["--global"], Path::new("/")).is_some());
    }

    #[test]
    fn the_file_holds_the_values_quoted_for_git() {
        let values = [
            ("user", "name", r#"Ann "the \ dev" O'Neil"#.to_string()),
            ("user", "email", "ann@example.com".to_string()),
            ("init", "defaultBranch", "main".to_string()),
        ];
        let text = config_text(&values).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("gitconfig");
        std::fs::write(&file, &text).unwrap();
        let git = |key: &str| {
            let output = Command::new("git")
                .args(["config", "--file"])
                .arg(&file)
                .args(["--get", key])
                .output()
                .unwrap();
            String::from_utf8(output.stdout).unwrap()
        };
        assert_eq!(git("user.name"), "Ann \"the \\ dev\" O'Neil\n", "{text}");
        assert_eq!(git("user.email"), "ann@example.com\n");
        assert_eq!(git("init.defaultBranch"), "main\n");
        assert_eq!(
            git("include.path"),
            format!("{IMAGE_SYSTEM_CONFIG}\n"),
            "the image's own system config still applies"
        );
        assert_eq!(config_text(&[]), None);
    }
}
