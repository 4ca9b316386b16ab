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
    let values: Vec<(&str, &str, String)> = KEYS
        .iter()
        .filter_map(|&(section, key)| Some((section, key, host_value(section, key)?)))
        .collect();
    let text = config_text(&values)?;
    let homes = agent_home_dir(vm);
    let written = std::fs::create_dir_all(&homes)
        .and_then(|()| guest_writable::open_dir(&homes))
        .and_then(|dir| guest_writable::write_read_only(dir, FILE, text.as_bytes()));
    if let Err(e) = written {
        eprintln!(
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

/// The host user's global value of `section.key`, if git is there and it is set.
fn host_value(section: &str, key: &str) -> Option<String> {
    let output = Command::new("git")
        .args(["config", "--global", "--includes", "--get"])
        .arg(format!("{section}.{key}"))
        .current_dir(Path::new("/"))
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let value = String::from_utf8(output.stdout).ok()?;
    let value = value.strip_suffix('\n').unwrap_or(&value);
    (output.status.success() && !value.is_empty() && !value.contains('\n'))
        .then(|| value.to_string())
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
