//! [`EgressRules`] over the policy and secret files, re-read when they change, so
//! `vmctl policy allow` or `vmctl secret set` applies to the next request without
//! restarting the proxy.
//!
//! Every call stats both files (cheap) and re-reads one only when its identity, size,
//! mtime, ctime or mode changed; a `chmod 600` that fixes the secret file is picked up
//! too. If either file cannot be used, the rules fail closed: every destination is
//! refused, with a rule naming the broken file, and nothing is injected. The failure
//! is logged once per change of the file.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::policy::{Policy, PolicyStore};
use crate::rules::{Decision, EgressRules, Injection};
use crate::secrets::SecretStore;

/// The rules of one workspace's proxy, read from the files `vmctl policy` and
/// `vmctl secret` write.
#[derive(Debug)]
pub struct FileRules {
    policy_path: PathBuf,
    secrets_path: PathBuf,
    /// The workspace whose scope applies: the same (canonical) path vmctl stores its
    /// policy under.
    workspace: PathBuf,
    cache: Mutex<Cache>,
}

#[derive(Debug, Default)]
struct Cache {
    policy: Option<Loaded<Policy>>,
    secrets: Option<Loaded<SecretStore>>,
}

/// What a file held when it had the stamp.
#[derive(Debug)]
struct Loaded<T> {
    stamp: Stamp,
    /// The parsed file, or the error that says why it cannot be used.
    value: Result<T, String>,
}

/// What identifies a version of a file without reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stamp {
    Missing,
    Present {
        dev: u64,
        ino: u64,
        size: u64,
        mtime: (i64, i64),
        ctime: (i64, i64),
        mode: u32,
        uid: u32,
    },
    /// `stat` failed otherwise; reading will fail and say why.
    Unknown(io::ErrorKind),
}

impl Stamp {
    fn of(path: &Path) -> Stamp {
        match std::fs::metadata(path) {
            Ok(m) => Stamp::Present {
                dev: m.dev(),
                ino: m.ino(),
                size: m.size(),
                mtime: (m.mtime(), m.mtime_nsec()),
                ctime: (m.ctime(), m.ctime_nsec()),
                mode: m.mode(),
                uid: m.uid(),
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => Stamp::Missing,
            Err(e) => Stamp::Unknown(e.kind()),
        }
    }
}

/// Re-reads `path` into `slot` if its stamp changed; logs a failure once per change.
fn refresh<T>(
    slot: &mut Option<Loaded<T>>,
    path: &Path,
    what: &str,
    load: impl FnOnce(&Path) -> Result<T, String>,
) {
    // Stat before reading: a change during the read shows as a new stamp next time.
    let stamp = Stamp::of(path);
    if slot.as_ref().is_some_and(|loaded| loaded.stamp == stamp) {
        return;
    }
    let was_broken = slot.as_ref().is_some_and(|loaded| loaded.value.is_err());
    let value = load(path);
    match &value {
        Err(e) => tracing::warn!("{e}; refusing all egress until it is fixed"),
        Ok(_) if was_broken => tracing::info!("{what} {} is usable again", path.display()),
        Ok(_) => tracing::debug!("read {what} {}", path.display()),
    }
    *slot = Some(Loaded { stamp, value });
}

impl FileRules {
    /// Rules for `workspace` from the policy file and the secret file (either may be
    /// missing: no rules of that kind). Nothing is read until the first request.
    pub fn new(
        policy_path: impl Into<PathBuf>,
        secrets_path: impl Into<PathBuf>,
        workspace: impl Into<PathBuf>,
    ) -> FileRules {
        FileRules {
            policy_path: policy_path.into(),
            secrets_path: secrets_path.into(),
            workspace: workspace.into(),
            cache: Mutex::new(Cache::default()),
        }
    }

    /// Runs `f` on the current policy and secrets, or on the error of the first file
    /// that cannot be used.
    fn with_current<R>(&self, f: impl FnOnce(Result<(&Policy, &SecretStore), &str>) -> R) -> R {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let Cache { policy, secrets } = &mut *cache;
        refresh(policy, &self.policy_path, "policy file", |path| {
            PolicyStore::load(path)
                .map(|store| store.policy(&self.workspace))
                .map_err(|e| e.to_string())
        });
        refresh(secrets, &self.secrets_path, "secret file", |path| {
            SecretStore::load(path).map_err(|e| e.to_string())
        });
        let policy = policy.as_ref().map(|l| l.value.as_ref());
        let secrets = secrets.as_ref().map(|l| l.value.as_ref());
        match (policy, secrets) {
            (Some(Ok(policy)), Some(Ok(secrets))) => f(Ok((policy, secrets))),
            (Some(Err(e)), _) | (_, Some(Err(e))) => f(Err(e)),
            // Both slots were just filled.
            (None, _) | (_, None) => f(Err("the rules were not loaded")),
        }
    }
}

impl EgressRules for FileRules {
    fn decide(&self, host: &str, port: u16) -> Decision {
        self.with_current(|current| match current {
            Ok((policy, _)) => policy.decide(host, port),
            Err(e) => Decision {
                allowed: false,
                rule: format!("deny everything: {e}"),
            },
        })
    }

    fn injection(&self, host: &str, port: u16) -> Option<Injection> {
        self.with_current(|current| {
            current
                .ok()
                .and_then(|(_, secrets)| secrets.injection_for(host, port))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Pattern, Scope};
    use crate::secrets::read_secret;
    use std::os::unix::fs::PermissionsExt;

    struct Setup {
        _dir: tempfile::TempDir,
        policy: PathBuf,
        secrets: PathBuf,
        workspace: PathBuf,
        rules: FileRules,
    }

    fn setup() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let policy = dir.path().join("vmctl/policy.json");
        let secrets = dir.path().join("vmctl/secrets.json");
        let workspace = PathBuf::from("/home/me/project");
        let rules = FileRules::new(&policy, &secrets, &workspace);
        Setup {
            _dir: dir,
            policy,
            secrets,
            workspace,
            rules,
        }
    }

    fn pattern(text: &str) -> Pattern {
        text.parse().unwrap()
    }

    #[test]
    fn missing_files_mean_defaults_and_no_secrets() {
        let s = setup();
        let d = s.rules.decide("api.anthropic.com", 443);
        assert!(d.allowed, "{d:?}");
        assert_eq!(d.rule, "allow api.anthropic.com:443 (default)");
        assert!(!s.rules.decide("example.org", 443).allowed);
        assert!(s.rules.injection("api.anthropic.com", 443).is_none());
    }

    #[test]
    fn picks_up_changes_without_a_restart() {
        let s = setup();
        assert!(!s.rules.decide("example.org", 443).allowed);

        let mut policy = PolicyStore::load(&s.policy).unwrap();
        policy
            .allow(
                &Scope::Workspace(s.workspace.clone()),
                &[pattern("example.org")],
            )
            .unwrap();
        policy.save().unwrap();
        let d = s.rules.decide("example.org", 443);
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (true, "allow example.org (workspace)")
        );

        policy
            .deny(&Scope::Global, &[pattern("example.org")])
            .unwrap();
        policy.save().unwrap();
        let d = s.rules.decide("example.org", 443);
        assert_eq!(
            (d.allowed, d.rule.as_str()),
            (false, "deny example.org (global)")
        );

        let mut secrets = SecretStore::load(&s.secrets).unwrap();
        secrets
            .set("openai", read_secret(&b"sk-1\n"[..]).unwrap(), vec![], None)
            .unwrap();
        secrets.save().unwrap();
        let i = s.rules.injection("api.openai.com", 443).unwrap();
        assert_eq!(i.value.to_str().unwrap(), "Bearer sk-1");

        secrets
            .set("openai", read_secret(&b"sk-2\n"[..]).unwrap(), vec![], None)
            .unwrap();
        secrets.save().unwrap();
        let i = s.rules.injection("api.openai.com", 443).unwrap();
        assert_eq!(i.value.to_str().unwrap(), "Bearer sk-2");

        assert!(secrets.remove("openai"));
        secrets.save().unwrap();
        assert!(s.rules.injection("api.openai.com", 443).is_none());
    }

    #[test]
    fn broken_policy_file_fails_closed_until_fixed() {
        let s = setup();
        let mut secrets = SecretStore::load(&s.secrets).unwrap();
        secrets
            .set("openai", read_secret(&b"sk-1"[..]).unwrap(), vec![], None)
            .unwrap();
        secrets.save().unwrap();
        assert!(s.rules.decide("api.openai.com", 443).allowed);

        std::fs::write(&s.policy, "{not json").unwrap();
        let d = s.rules.decide("api.openai.com", 443);
        assert!(!d.allowed);
        assert!(d.rule.starts_with("deny everything: "), "{}", d.rule);
        assert!(
            d.rule.contains(&s.policy.display().to_string()),
            "{}",
            d.rule
        );
        assert!(s.rules.injection("api.openai.com", 443).is_none());
        // Asking again neither re-reads nor changes the answer.
        assert_eq!(s.rules.decide("api.openai.com", 443), d);

        std::fs::remove_file(&s.policy).unwrap();
        assert!(s.rules.decide("api.openai.com", 443).allowed);
        assert!(s.rules.injection("api.openai.com", 443).is_some());
    }

    #[test]
    fn unsafe_secret_file_fails_closed_until_chmod() {
        let s = setup();
        let mut secrets = SecretStore::load(&s.secrets).unwrap();
        secrets
            .set("openai", read_secret(&b"sk-1"[..]).unwrap(), vec![], None)
            .unwrap();
        secrets.save().unwrap();
        assert!(s.rules.injection("api.openai.com", 443).is_some());

        std::fs::set_permissions(&s.secrets, std::fs::Permissions::from_mode(0o644)).unwrap();
        let d = s.rules.decide("api.openai.com", 443);
        assert!(!d.allowed);
        assert!(
            d.rule
                .contains(&format!("chmod 600 {}", s.secrets.display())),
            "{}",
            d.rule
        );
        assert!(s.rules.injection("api.openai.com", 443).is_none());

        std::fs::set_permissions(&s.secrets, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(s.rules.decide("api.openai.com", 443).allowed);
        assert!(s.rules.injection("api.openai.com", 443).is_some());
    }
}
