//! Dropping the guest's caches once it has been idle. After a build, the page cache
//! and the dentries and inodes the guest keeps hold its memory (and virtiofsd's open
//! files on the host) until the VM stops; the guest gives back only what is free. So
//! when no command has run for a while, the agent drops the clean caches
//! (`drop_caches` 3); free page reporting then returns the memory to the host within
//! seconds. Once per idle spell: the next command starts another. Nothing is synced
//! first: virtio-fs writes go to the host as they are made (no writeback cache) and
//! the root's upper layer is a tmpfs, so there is next to nothing dirty, and a
//! sync(2) would have each share's virtiofsd sync the whole host file system.
//!
//! The cost is a cold cache for the first command after the spell: with virtio-fs's
//! `auto` cache, names and attributes are looked up again after a second anyway, so
//! mostly file contents are read again, from the host's page cache.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// The kernel parameter that sets the idle time in seconds (`0`: never).
pub const CMDLINE_KEY: &str = "vmctl.drop_caches_idle";

/// How often the agent looks whether the guest is idle.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// What the watch counts: commands running now, and commands started so far.
#[derive(Debug, Default)]
pub struct Activity {
    pub running: AtomicU32,
    pub started: AtomicU64,
}

/// Decides, at each look, whether the idle spell has lasted long enough.
#[derive(Debug)]
pub struct IdleWatch {
    after: Duration,
    seen_started: u64,
    idle_for: Duration,
    dropped: bool,
}

impl IdleWatch {
    pub fn new(after: Duration) -> IdleWatch {
        IdleWatch {
            after,
            seen_started: 0,
            idle_for: Duration::ZERO,
            dropped: false,
        }
    }

    /// One look, `elapsed` after the last: true when the caches are to be dropped now.
    /// A command running or started since the last look ends the spell.
    pub fn look(&mut self, running: u32, started: u64, elapsed: Duration) -> bool {
        if running > 0 || started != self.seen_started {
            self.seen_started = started;
            self.idle_for = Duration::ZERO;
            self.dropped = false;
            return false;
        }
        self.idle_for = self.idle_for.saturating_add(elapsed);
        if self.dropped || self.idle_for < self.after {
            return false;
        }
        self.dropped = true;
        true
    }
}

/// Watches `activity` for as long as the agent serves and drops the caches after each
/// idle spell of `after`.
pub async fn watch(activity: std::sync::Arc<Activity>, after: Duration) {
    let mut watch = IdleWatch::new(after);
    let mut tick = tokio::time::interval(CHECK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once; each look counts the interval before it as idle.
    tick.tick().await;
    loop {
        tick.tick().await;
        let running = activity.running.load(Ordering::Relaxed);
        let started = activity.started.load(Ordering::Relaxed);
        if watch.look(running, started, CHECK_INTERVAL) {
            let dropped = tokio::task::spawn_blocking(drop_caches)
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e)));
            match dropped {
                Ok((before, after_drop)) => tracing::info!(
                    "idle for {} s: dropped the guest's caches; free memory {} MiB -> {} MiB",
                    after.as_secs(),
                    before / 1024,
                    after_drop / 1024
                ),
                Err(e) => tracing::warn!("cannot drop the guest's caches: {e}"),
            }
        }
    }
}

/// Drops the clean page cache, dentries and inodes; the free memory before and after,
/// in KiB.
fn drop_caches() -> std::io::Result<(u64, u64)> {
    let before = mem_free_kib()?;
    std::fs::write("/proc/sys/vm/drop_caches", "3\n")?;
    Ok((before, mem_free_kib()?))
}

fn mem_free_kib() -> std::io::Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    Ok(crate::server::read_kib_field(&meminfo, "MemFree:"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOOK: Duration = Duration::from_secs(5);

    #[test]
    fn the_caches_go_once_per_idle_spell() {
        let mut watch = IdleWatch::new(Duration::from_secs(15));
        // A command runs, then ends: the spell starts at its end.
        assert!(!watch.look(1, 1, LOOK));
        assert!(!watch.look(0, 1, LOOK));
        assert!(!watch.look(0, 1, LOOK));
        assert!(watch.look(0, 1, LOOK), "15 s idle");
        assert!(!watch.look(0, 1, LOOK), "once per spell");
        assert!(!watch.look(0, 1, Duration::from_secs(3600)));
        // A command that started and ended between two looks ends the spell too.
        assert!(!watch.look(0, 2, LOOK));
        assert!(!watch.look(0, 2, LOOK));
        assert!(!watch.look(0, 2, LOOK));
        assert!(watch.look(0, 2, LOOK));
        // A command that runs through the looks holds the caches however long.
        for _ in 0..100 {
            assert!(!watch.look(1, 3, LOOK));
        }
    }

    #[test]
    fn an_agent_nobody_used_drops_them_too() {
        let mut watch = IdleWatch::new(Duration::from_secs(10));
        assert!(!watch.look(0, 0, LOOK));
        assert!(watch.look(0, 0, LOOK));
    }
}
