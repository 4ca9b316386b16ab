//! The host user's git identity in the guest. `git commit` there needs `user.name` and
//! `user.email`, which the host keeps in `~/.gitconfig`, a file that may also hold
//! credentials (URL rewrites with tokens, credential helpers) and host paths: it is
//! not copied. Only [`KEYS`] are, at each session, into a file in the VM's agent home
//! that git in the guest reads as its system config (`GIT_CONFIG_SYSTEM`), the lowest
//! precedence: a repository's own identity, and the guest's own `~/.gitconfig`, win.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::agent::{agent_home_dir, GUEST_AGENT_HOME};
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

/// Refreshes `vm`'s copy of the host user's git identity; the variable that points
/// the guest's git at it, or None when the host has none (or it cannot be written,
/// which is said).
pub fn guest_env(vm: &VmDir) -> Option<(String, String)> {
    let text = config_text(&host_values())?;
    let homes = agent_home_dir(vm);
    let written = std::fs::create_dir_all(&homes)
        .and_then(|()| guest_writable::open_dir(&homes))
        .and_then(|dir| guest_writable::write_read_only(dir, FILE, text.as_bytes()));
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
        format!("{GUEST_AGENT_HOME}/{FILE}"),
    ))
}

/// The host user's global values of [`KEYS`] that are set, as (section, key, value),
/// read by one `git config` (none when git is not there).
fn host_values() -> Vec<(&'static str, &'static str, String)> {
    values_in(&["--global", "--includes"])
}

/// The values of [`KEYS`] in the git config that `scope` selects (`--global`,
/// `--file PATH`).
fn values_in(scope: &[&str]) -> Vec<(&'static str, &'static str, String)> {
    let pattern = KEYS
        .iter()
        .map(|(section, key)| format!("{section}\\.{}", key.to_lowercase()))
        .collect::<Vec<_>>()
        .join("|");
    let output = Command::new("git")
        .arg("config")
        .args(scope)
        .args(["-z", "--get-regexp"])
        .arg(format!("^({pattern})$"))
        .current_dir(Path::new("/"))
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output();
    match output {
        Ok(output) => values_of(&output.stdout),
        Err(_) => Vec::new(),
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
            values_in(&["--file", file.to_str().unwrap()]),
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
        assert_eq!(config_text(&[]), None);
    }
}
