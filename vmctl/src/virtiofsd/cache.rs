//! How the guest may cache a share: virtiofsd's `--cache` and `--writeback`.

use serde::{Deserialize, Serialize};

use super::VirtiofsdError;

/// How the guest may cache a share (virtiofsd's `--cache`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Cache {
    /// Close-to-open consistency, attributes and names cached for 1 s: host edits are
    /// seen promptly, and shared mmap works. For VMs.
    #[default]
    Auto,
    /// Nothing cached: for the nested host, which only passes the files on to its own
    /// virtiofsd (caching them there too would double the memory and the staleness).
    Never,
    /// Attributes and names cached for a day, data not at all: host edits go unseen
    /// until then. Only for measuring ([`CACHE_ENV`]).
    Metadata,
    /// Everything cached for a day: host edits go unseen. Only for measuring.
    Always,
}

impl Cache {
    const ALL: [Cache; 4] = [Cache::Auto, Cache::Never, Cache::Metadata, Cache::Always];

    pub(super) fn as_arg(self) -> &'static str {
        match self {
            Cache::Auto => "auto",
            Cache::Never => "never",
            Cache::Metadata => "metadata",
            Cache::Always => "always",
        }
    }
}

/// Chooses the guest's caching of a VM's shares when it starts, for measuring the
/// alternatives (`vm-bench --fs-cache`): `auto` (the default), `never`, `metadata` or
/// `always`, each optionally with `+writeback` (virtiofsd's write-back cache: writes
/// reach the host when the guest flushes them, at the latest when the file is closed).
/// Only `auto` and `never` show host edits promptly.
pub const CACHE_ENV: &str = "VMCTL_VIRTIOFS_CACHE";

/// How the guest caches a VM's shares: virtiofsd's `--cache` and `--writeback`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CachePolicy {
    pub cache: Cache,
    pub writeback: bool,
}

impl CachePolicy {
    /// No caching and no write-back, for the nested host's pass-through daemons.
    pub const PASS_THROUGH: CachePolicy = CachePolicy {
        cache: Cache::Never,
        writeback: false,
    };

    /// The policy [`CACHE_ENV`] asks for; the default without it.
    pub fn from_env() -> Result<CachePolicy, VirtiofsdError> {
        match std::env::var(CACHE_ENV) {
            Ok(value) => value.parse(),
            Err(_) => Ok(CachePolicy::default()),
        }
    }
}

impl std::str::FromStr for CachePolicy {
    type Err = VirtiofsdError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let (mode, writeback) = match value.trim().strip_suffix("+writeback") {
            Some(mode) => (mode, true),
            None => (value.trim(), false),
        };
        let cache = Cache::ALL
            .into_iter()
            .find(|cache| cache.as_arg() == mode)
            .ok_or_else(|| VirtiofsdError::BadCachePolicy {
                value: value.to_string(),
            })?;
        Ok(CachePolicy { cache, writeback })
    }
}

impl std::fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.cache.as_arg())?;
        if self.writeback {
            f.write_str("+writeback")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_policy_is_parsed() {
        assert_eq!(
            "auto".parse::<CachePolicy>().unwrap(),
            CachePolicy::default()
        );
        for value in ["auto", "never", "metadata", "always", "never+writeback"] {
            let policy: CachePolicy = value.parse().unwrap();
            assert_eq!(policy.to_string(), value);
        }
        let policy: CachePolicy = "always+writeback".parse().unwrap();
        assert_eq!(
            policy,
            CachePolicy {
                cache: Cache::Always,
                writeback: true
            }
        );
        for bad in ["", "fast", "auto+", "writeback", "auto+writeback+writeback"] {
            let err = bad.parse::<CachePolicy>().unwrap_err().to_string();
            assert!(
                err.contains(CACHE_ENV) && err.contains("auto, never"),
                "{err}"
            );
        }
    }
}
