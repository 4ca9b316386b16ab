//! The guest account commands run as by default (`vmctl.user=NAME:UID:GID:HOME` on
//! the guest agent's command line): the host user, so that files made in the shares
//! are theirs on the host too, or `VMCTL_GUEST_USER`.

use std::ffi::OsStr;

pub const GUEST_USER_ENV: &str = "VMCTL_GUEST_USER";

#[derive(Debug, thiserror::Error)]
pub enum GuestAccountError {
    #[error(
        "{GUEST_USER_ENV}={value:?} is not an account NAME:UID:GID:HOME (a name of \
         letters, digits, '.', '_' and '-'; numeric ids; an absolute home without \
         spaces); fix it, or unset it to run commands as your host user"
    )]
    Invalid { value: String },
}

/// The account for a new VM: `VMCTL_GUEST_USER` when set, else the host user's (none
/// for root: the guest's root serves). A `VMCTL_GUEST_USER` that is not such an
/// account is refused: ignored, it would have the commands run as root in the guest.
/// A host user the guest cannot be given is said through `warn`, for the same reason.
pub fn guest_account(warn: impl FnOnce(String)) -> Result<Option<String>, GuestAccountError> {
    match std::env::var_os(GUEST_USER_ENV) {
        Some(value) => account_from_env(&value).map(Some),
        None => {
            // SAFETY: getuid/getgid cannot fail.
            let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
            let named = |var: &str| std::env::var(var).ok().filter(|value| !value.is_empty());
            let host = HostUser {
                uid,
                gid,
                name: named("USER"),
                home: named("HOME"),
            };
            Ok(host
                .account(|| password_entry(uid))
                .unwrap_or_else(|unusable| {
                    warn(format!(
                        "commands run as root in the VM: your account {unusable:?} cannot be \
                     given to the guest (it needs a name of letters, digits, '.', '_' and \
                     '-', and an absolute home without spaces); set \
                     {GUEST_USER_ENV}=NAME:UID:GID:HOME to choose one"
                    ));
                    None
                }))
        }
    }
}

pub(crate) fn account_from_env(value: &OsStr) -> Result<String, GuestAccountError> {
    match value.to_str() {
        Some(account) if valid_account(account) => Ok(account.to_string()),
        _ => Err(GuestAccountError::Invalid {
            value: value.to_string_lossy().into_owned(),
        }),
    }
}

/// Who runs vmctl, as its environment says.
struct HostUser {
    uid: u32,
    gid: u32,
    name: Option<String>,
    home: Option<String>,
}

impl HostUser {
    /// `NAME:UID:GID:HOME`, or none for root. The name is `password_entry`'s, the
    /// user's (name, home), and the home the environment's; where the environment
    /// names another user (`su -m` keeps USER and HOME, often root's) or gives root's
    /// home (`sudo -E -u`), the entry's home too: the guest must not be told that uid
    /// 1000 is `root`, whose account it would then replace. Without an entry, the
    /// environment's, but never root's name. Err: the account, which the guest
    /// cannot be given.
    fn account(
        self,
        password_entry: impl FnOnce() -> Option<(String, String)>,
    ) -> Result<Option<String>, String> {
        if self.uid == 0 {
            return Ok(None);
        }
        let (name, home) = match (password_entry(), self.name, self.home) {
            (Some((entry_name, entry_home)), name, home) => {
                let anothers = name.is_some_and(|name| name != entry_name);
                let home = home
                    .filter(|home| !anothers && home != ROOTS_HOME)
                    .unwrap_or(entry_home);
                (entry_name, home)
            }
            (None, name, home) => (name.unwrap_or_default(), home.unwrap_or_default()),
        };
        let account = format!("{name}:{}:{}:{home}", self.uid, self.gid);
        if name != "root" && valid_account(&account) {
            Ok(Some(account))
        } else {
            Err(account)
        }
    }
}

/// The home a root shell's environment gives (`HOME`), which `su` and `sudo -E` keep.
const ROOTS_HOME: &str = "/root";

/// `uid`'s name and home from the password database.
pub(crate) fn password_entry(uid: u32) -> Option<(String, String)> {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        // SAFETY: all-zero bytes are a valid `passwd` (null pointers, zero ids).
        let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: `entry`, `buffer` (with its true length) and `found` outlive the
        // call, which writes the entry's strings into `buffer` only.
        let status = unsafe {
            libc::getpwuid_r(
                uid,
                &mut entry,
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                &mut found,
            )
        };
        if status == libc::ERANGE && buffer.len() < 1024 * 1024 {
            buffer.resize(buffer.len() * 4, 0);
            continue;
        }
        if status != 0 || found.is_null() || entry.pw_name.is_null() || entry.pw_dir.is_null() {
            return None;
        }
        // SAFETY: getpwuid_r found the entry: its strings are NUL-terminated, in
        // `buffer`, which is still borrowed here.
        let (name, home) = unsafe {
            (
                std::ffi::CStr::from_ptr(entry.pw_name),
                std::ffi::CStr::from_ptr(entry.pw_dir),
            )
        };
        return Some((
            name.to_string_lossy().into_owned(),
            home.to_string_lossy().into_owned(),
        ));
    }
}

/// `NAME:UID:GID:HOME` as the guest takes it (its own parser decides: a value it
/// refused would leave the commands running as root), with nothing that would break
/// the kernel command line.
fn valid_account(account: &str) -> bool {
    !account.contains(char::is_whitespace) && guest_agent::init::parse_user(account).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_are_checked_before_reaching_the_kernel_command_line() {
        assert!(valid_account("alice:1000:1000:/home/alice"));
        assert!(!valid_account("alice:1000:1000:relative"));
        assert!(!valid_account("al ice:1000:1000:/home/alice"));
        assert!(!valid_account("alice:x:1000:/home/alice"));
        assert!(!valid_account("alice:1:1:/home/a b"));
        assert!(!valid_account("alice:1:1"));
        assert!(!valid_account("alice:1:1:/home/a:b"));
        // The guest's own limits: a name of at most 32 bytes, not an option.
        assert!(valid_account(&format!("{}:1:1:/h", "a".repeat(32))));
        assert!(!valid_account(&format!("{}:1:1:/h", "a".repeat(33))));
        assert!(!valid_account("-alice:1:1:/h"));
    }

    #[test]
    fn an_invalid_guest_user_variable_is_refused_not_run_as_root() {
        let error = account_from_env("alice:1000:1000:~".as_ref()).unwrap_err();
        let message = error.to_string();
        assert!(
            message.contains("VMCTL_GUEST_USER=\"alice:1000:1000:~\""),
            "{message}"
        );
        assert!(message.contains("NAME:UID:GID:HOME"), "{message}");
        let account = account_from_env("alice:1000:1000:/home/alice".as_ref()).unwrap();
        assert_eq!(account, "alice:1000:1000:/home/alice");
    }

    fn user(name: Option<&str>, home: Option<&str>) -> HostUser {
        HostUser {
            uid: 1000,
            gid: 1001,
            name: name.map(String::from),
            home: home.map(String::from),
        }
    }

    #[test]
    fn the_host_users_name_is_the_password_databases_and_home_the_environments() {
        let entry = || Some(("bob".to_string(), "/home/bob".to_string()));
        let alice = || Some(("alice".to_string(), "/home/alice".to_string()));
        assert_eq!(
            user(Some("alice"), Some("/srv/alice")).account(alice),
            Ok(Some("alice:1000:1001:/srv/alice".into())),
            "a home of the user's own choosing"
        );
        assert_eq!(
            user(Some("alice"), Some("/home/alice")).account(|| None),
            Ok(Some("alice:1000:1001:/home/alice".into())),
            "no entry: the environment's"
        );
        // `su -m alice` from root: root's USER and HOME, alice's uid. (Review: the
        // guest was told uid 1000 is root, and replaced root's account with it.)
        assert_eq!(
            user(Some("root"), Some("/root")).account(alice),
            Ok(Some("alice:1000:1001:/home/alice".into()))
        );
        // `sudo -E -u alice` from root: alice's USER, root's HOME.
        assert_eq!(
            user(Some("alice"), Some("/root")).account(alice),
            Ok(Some("alice:1000:1001:/home/alice".into()))
        );
        // cron, systemd, `env -i`: no USER.
        assert_eq!(
            user(None, Some("/srv/home")).account(entry),
            Ok(Some("bob:1000:1001:/srv/home".into()))
        );
        assert_eq!(
            user(None, None).account(entry),
            Ok(Some("bob:1000:1001:/home/bob".into()))
        );
        let root = HostUser {
            uid: 0,
            ..user(Some("root"), Some("/root"))
        };
        assert_eq!(root.account(|| panic!("looked up for root")), Ok(None));
    }

    #[test]
    fn a_host_user_the_guest_cannot_be_given_is_reported() {
        assert_eq!(
            user(Some("alice"), Some("/home/a b")).account(|| None),
            Err("alice:1000:1001:/home/a b".into())
        );
        assert_eq!(user(None, None).account(|| None), Err(":1000:1001:".into()));
        // A uid without an entry whose environment is root's (`docker run -u 1000` of
        // an image that sets USER=root). (Review: given to the guest as root.)
        assert_eq!(
            user(Some("root"), Some("/root")).account(|| None),
            Err("root:1000:1001:/root".into())
        );
    }

    #[test]
    fn the_password_database_knows_the_user_running_the_tests() {
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        let Some((name, home)) = password_entry(uid) else {
            // `docker run --user 1234`, say: a uid without an entry.
            let known = std::fs::read_to_string("/etc/passwd").is_ok_and(|passwd| {
                passwd
                    .lines()
                    .any(|line| line.split(':').nth(2) == Some(&uid.to_string()))
            });
            assert!(
                !known,
                "/etc/passwd has uid {uid}, getpwuid_r did not find it"
            );
            eprintln!("NOT RUN: uid {uid} has no entry in the password database");
            return;
        };
        assert!(!name.is_empty() && home.starts_with('/'), "{name} {home}");
    }
}
