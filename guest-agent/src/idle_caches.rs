//! Dropping the guest's caches once it has been idle. After a build, the page cache
//! and the dentries and inodes the guest keeps hold its memory (and virtiofsd's open
//! files on the host) until the VM stops; the guest gives back only what is free. So
//! when no command has run for a while, the agent drops the clean caches
//! (`drop_caches` 3); free page reporting then returns the memory to the host within
//! seconds. Once per idle spell: the next command starts another. A program left
//! running at work (a `nohup` build, a dev server answering a published port) counts
//! as a command: the guest's CPUs busier than [`BUSY_CPU_SHARE`] of one over a look
//! end the spell too.
//!
//! Nothing is synced first: virtio-fs writes go to the host as they are made (no
//! writeback cache) and the root's upper layer is a tmpfs, so there is next to
//! nothing dirty, and a sync(2) would have each share's virtiofsd sync the whole host
//! file system.
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

/// The share of one CPU's time, over a look, above which the guest counts as at
/// work though none of its commands runs. An idle guest spends about 1% (the agent,
/// the kernel's threads; 2% measured in the nested host, where everything is slower).
pub const BUSY_CPU_SHARE: f64 = 0.10;

/// The guest's CPU time so far, in clock ticks, summed over its CPUs (`/proc/stat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    /// Time spent running anything (user, nice, system, irq, softirq).
    busy: u64,
    /// All the time accounted, idle and stolen included.
    total: u64,
    cpus: u32,
}

impl CpuTimes {
    /// Reads the `cpu` line of `/proc/stat`'s text, and counts its `cpuN` lines.
    pub fn parse(stat: &str) -> Option<CpuTimes> {
        let mut fields = stat
            .lines()
            .find_map(|line| line.strip_prefix("cpu "))?
            .split_whitespace()
            .map(|field| field.parse::<u64>().ok());
        let mut next = || fields.next().flatten();
        let (user, nice, system, idle) = (next()?, next()?, next()?, next()?);
        // Kernels before 2.6.11 stop there; the rest counts as 0 then.
        let mut rest = || next().unwrap_or(0);
        let (iowait, irq, softirq, steal) = (rest(), rest(), rest(), rest());
        let cpus = stat
            .lines()
            .filter(|line| {
                line.strip_prefix("cpu")
                    .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
            })
            .count();
        let busy = [user, nice, system, irq, softirq]
            .iter()
            .fold(0u64, |sum, ticks| sum.saturating_add(*ticks));
        Some(CpuTimes {
            busy,
            total: [busy, idle, iowait, steal]
                .iter()
                .fold(0u64, |sum, ticks| sum.saturating_add(*ticks)),
            cpus: u32::try_from(cpus.max(1)).unwrap_or(u32::MAX),
        })
    }

    /// The guest's own CPU times now; `None` when `/proc/stat` cannot be read.
    pub fn now() -> Option<CpuTimes> {
        CpuTimes::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// How many CPUs' worth of time was busy between `earlier` and `self` (0.5: half
    /// of one CPU); 0 when no time was accounted in between.
    pub fn busy_share_since(self, earlier: CpuTimes) -> f64 {
        let busy = self.busy.saturating_sub(earlier.busy) as f64;
        let total = self.total.saturating_sub(earlier.total) as f64;
        if total == 0.0 {
            return 0.0;
        }
        busy / total * f64::from(self.cpus)
    }
}

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
    /// A command running or started since the last look ends the spell, as does a
    /// guest `busy` since then (see [`BUSY_CPU_SHARE`]).
    pub fn look(&mut self, running: u32, started: u64, busy: bool, elapsed: Duration) -> bool {
        if running > 0 || started != self.seen_started || busy {
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
    let mut cpu_before = CpuTimes::now();
    loop {
        tick.tick().await;
        let running = activity.running.load(Ordering::Relaxed);
        let started = activity.started.load(Ordering::Relaxed);
        let cpu_now = CpuTimes::now();
        let busy = match (cpu_now, cpu_before) {
            (Some(now), Some(before)) => now.busy_share_since(before) > BUSY_CPU_SHARE,
            _ => false,
        };
        cpu_before = cpu_now;
        if watch.look(running, started, busy, CHECK_INTERVAL) {
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
            // The drop's own work is not the guest at work.
            cpu_before = CpuTimes::now();
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
        assert!(!watch.look(1, 1, false, LOOK));
        assert!(!watch.look(0, 1, false, LOOK));
        assert!(!watch.look(0, 1, false, LOOK));
        assert!(watch.look(0, 1, false, LOOK), "15 s idle");
        assert!(!watch.look(0, 1, false, LOOK), "once per spell");
        assert!(!watch.look(0, 1, false, Duration::from_secs(3600)));
        // A command that started and ended between two looks ends the spell too.
        assert!(!watch.look(0, 2, false, LOOK));
        assert!(!watch.look(0, 2, false, LOOK));
        assert!(!watch.look(0, 2, false, LOOK));
        assert!(watch.look(0, 2, false, LOOK));
        // A command that runs through the looks holds the caches however long.
        for _ in 0..100 {
            assert!(!watch.look(1, 3, false, LOOK));
        }
    }

    #[test]
    fn a_busy_guest_keeps_its_caches_though_no_command_runs() {
        let mut watch = IdleWatch::new(Duration::from_secs(10));
        assert!(!watch.look(0, 0, false, LOOK));
        assert!(
            !watch.look(0, 0, true, LOOK),
            "a program left running at work"
        );
        assert!(!watch.look(0, 0, false, LOOK));
        assert!(watch.look(0, 0, false, LOOK), "10 s idle since it ended");
        assert!(!watch.look(0, 0, true, LOOK));
        assert!(!watch.look(0, 0, false, LOOK));
        assert!(
            watch.look(0, 0, false, LOOK),
            "a new spell after the busy look"
        );
    }

    const STAT: &str = "cpu  100 5 50 1000 20 3 2 7 0 0\n\
                        cpu0 50 5 25 500 10 3 1 4 0 0\n\
                        cpu1 50 0 25 500 10 0 1 3 0 0\n\
                        intr 12345\nctxt 999\n";

    #[test]
    fn cpu_times_are_read_from_proc_stat() {
        let times = CpuTimes::parse(STAT).unwrap();
        assert_eq!(
            times,
            CpuTimes {
                busy: 100 + 5 + 50 + 3 + 2,
                total: 160 + 1000 + 20 + 7,
                cpus: 2
            }
        );
        assert_eq!(
            CpuTimes::parse("cpu  1 2 3 4\ncpu0 1 2 3 4\n").map(|t| (t.busy, t.total)),
            Some((6, 10)),
            "an old kernel's four fields"
        );
        assert_eq!(CpuTimes::parse("cpu  1 2 x 4\n"), None);
        assert_eq!(CpuTimes::parse("intr 5\n"), None);
    }

    #[test]
    fn the_busy_share_is_counted_in_cpus() {
        let at = |busy, total| CpuTimes {
            busy,
            total,
            cpus: 2,
        };
        // Of 2 CPUs over 5 s (1000 ticks), 250 ticks busy: half of one CPU.
        assert_eq!(at(1250, 3000).busy_share_since(at(1000, 2000)), 0.5);
        assert_eq!(at(1000, 2000).busy_share_since(at(1000, 2000)), 0.0);
        assert_eq!(
            at(0, 0).busy_share_since(at(1000, 2000)),
            0.0,
            "counters reset"
        );
        assert!(at(1010, 3000).busy_share_since(at(1000, 2000)) < BUSY_CPU_SHARE);
        assert!(at(1060, 3000).busy_share_since(at(1000, 2000)) > BUSY_CPU_SHARE);
    }

    #[test]
    fn an_agent_nobody_used_drops_them_too() {
        let mut watch = IdleWatch::new(Duration::from_secs(10));
        assert!(!watch.look(0, 0, false, LOOK));
        assert!(watch.look(0, 0, false, LOOK));
    }
}
