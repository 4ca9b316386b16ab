//! Account lookup from `/etc/passwd` and `/etc/group`, parsed directly: the agent is
//! a static binary, where glibc's NSS-based `getpwnam`/`initgroups` do not work.

use std::path::{Path, PathBuf};

/// Errors of account lookup.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no user named '{0}' in /etc/passwd")]
    UnknownUser(String),
}

/// One resolved account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    pub shell: String,
    /// Supplementary groups (including the primary group).
    pub groups: Vec<u32>,
}

/// A passwd entry: `name:x:uid:gid:gecos:home:shell`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PasswdEntry {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    pub shell: String,
}

pub fn parse_passwd_line(line: &str) -> Option<PasswdEntry> {
    let f: Vec<&str> = line.split(':').collect();
    if f.len() < 7 || f[0].is_empty() || f[0].starts_with('#') {
        return None;
    }
    Some(PasswdEntry {
        name: f[0].to_string(),
        uid: f[2].parse().ok()?,
        gid: f[3].parse().ok()?,
        home: f[5].to_string(),
        shell: f[6].to_string(),
    })
}

/// Groups (`name:x:gid:member,member`) that list `user` as a member, plus `primary`.
pub fn groups_of(group_text: &str, user: &str, primary: u32) -> Vec<u32> {
    let mut out = vec![primary];
    for line in group_text.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 4 {
            continue;
        }
        let Ok(gid) = f[2].parse::<u32>() else {
            continue;
        };
        if f[3].split(',').any(|m| m.trim() == user) && !out.contains(&gid) {
            out.push(gid);
        }
    }
    out
}

/// The id of the group `name` in `group_text` (`/etc/group`'s lines).
pub fn group_id_in(group_text: &str, name: &str) -> Option<u32> {
    group_text.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        (f.len() >= 3 && f[0] == name)
            .then(|| f[2].parse().ok())
            .flatten()
    })
}

/// The id of the group `name` in `/etc/group`.
pub fn group_id(name: &str) -> Option<u32> {
    group_id_in(&std::fs::read_to_string("/etc/group").ok()?, name)
}

fn read(path: &Path) -> Result<String, UserError> {
    std::fs::read_to_string(path).map_err(|source| UserError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Looks `name` up in `<root>/etc/passwd` and `<root>/etc/group`.
pub fn lookup_in(root: &Path, name: &str) -> Result<Account, UserError> {
    let passwd = read(&root.join("etc/passwd"))?;
    let entry = passwd
        .lines()
        .filter_map(parse_passwd_line)
        .find(|e| e.name == name)
        .ok_or_else(|| UserError::UnknownUser(name.to_string()))?;
    let groups = match std::fs::read_to_string(root.join("etc/group")) {
        Ok(text) => groups_of(&text, name, entry.gid),
        Err(_) => vec![entry.gid],
    };
    Ok(Account {
        name: entry.name,
        uid: entry.uid,
        gid: entry.gid,
        home: entry.home,
        shell: entry.shell,
        groups,
    })
}

pub fn lookup(name: &str) -> Result<Account, UserError> {
    lookup_in(Path::new("/"), name)
}

/// Root's account, from `/etc/passwd` when possible.
pub fn root() -> Account {
    lookup("root").unwrap_or_else(|_| Account {
        name: "root".into(),
        uid: 0,
        gid: 0,
        home: "/root".into(),
        shell: "/bin/sh".into(),
        groups: vec![0],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_passwd_and_groups() {
        let e = parse_passwd_line("dev:x:1000:1001:Dev,,,:/home/dev:/bin/bash").unwrap();
        assert_eq!(
            (e.uid, e.gid, e.home.as_str(), e.shell.as_str()),
            (1000, 1001, "/home/dev", "/bin/bash")
        );
        assert!(parse_passwd_line("bad:x:abc:1:::").is_none());
        assert!(parse_passwd_line("").is_none());
        let groups = "root:x:0:\nsudo:x:27:dev,other\nusers:x:100:other\ndocker:x:999:dev\n";
        assert_eq!(groups_of(groups, "dev", 1001), vec![1001, 27, 999]);
    }

    #[test]
    fn looks_up_in_a_root() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("etc")).unwrap();
        std::fs::write(
            dir.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nu:x:5:6::/h:/bin/zsh\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("etc/group"), "g:x:7:u\n").unwrap();
        let a = lookup_in(dir.path(), "u").unwrap();
        assert_eq!(a.groups, vec![6, 7]);
        assert!(matches!(
            lookup_in(dir.path(), "nobody"),
            Err(UserError::UnknownUser(_))
        ));
    }

    #[test]
    fn a_group_id_is_found_by_name() {
        let text = "root:x:0:\ntty:x:5:\n# a comment\nbroken:x:nope:\n";
        assert_eq!(group_id_in(text, "tty"), Some(5));
        assert_eq!(group_id_in(text, "root"), Some(0));
        assert_eq!(group_id_in(text, "broken"), None);
        assert_eq!(group_id_in(text, "ttyx"), None);
    }
}
