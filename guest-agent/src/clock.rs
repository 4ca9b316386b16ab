//! The guest's wall clock follows the host's.
//!
//! At boot, kvmclock gives the guest the host's time; after that nothing does. A host
//! that suspends (a laptop lid) or steps its clock (NTP after a long sleep) leaves a
//! long-lived VM behind or ahead, and then the files the guest writes in the shared
//! workspace, stamped by the host, are in the guest's past or future: `make` rebuilds
//! wrongly or warns, `git` and TLS see the wrong date. So every connection's `Hello`
//! carries the host's time when it was sent, and the agent (as the VM's init) steps
//! the guest's clock to it when the guest is clearly off.
//!
//! A correct guest clock reads at least the `Hello`'s time when the agent reads it
//! (the message left the host earlier), so any clock behind it is wrong, and setting
//! it to that time never puts it ahead of the truth: it stays behind by at most the
//! message's transit. A guest ahead is only set back when no transit explains it:
//! by more than any client waits for its answer, at once; by less, only when a later
//! `Hello` finds it ahead by as much. One read long after it was sent (an agent
//! starved of CPU, a stalled nested host) makes a right clock look ahead, but the
//! next one, sent and read later, does not agree with it.

use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A guest clock behind the host's time by more than this is stepped; smaller
/// differences are left alone so that a clock in step is not nudged by every message.
pub const BEHIND_TOLERANCE: Duration = Duration::from_millis(20);
/// A guest clock ahead by more than this is stepped back (by up to
/// `STALE_HELLO_MAX`, once a second `Hello` agrees): a right clock is ahead by the
/// message's transit (vsock, a busy agent), which takes far less.
pub const AHEAD_TOLERANCE: Duration = Duration::from_secs(2);
/// A clock ahead by more than this is stepped back at the first `Hello`: no client
/// waits that long for the agent's answer (vmctl's longest wait is 60 s), so no
/// `Hello` read that late explains it.
const STALE_HELLO_MAX: Duration = Duration::from_secs(120);
/// Two `Hello`s that find the clock ahead agree when their offsets differ by less
/// than this...
const AHEAD_AGREEMENT: Duration = Duration::from_millis(500);
/// ...and were sent at least this far apart: stale `Hello`s queued behind a stalled
/// agent are read in a burst, and their offsets disagree by how far apart they were
/// sent.
const AHEAD_CONFIRMATION_GAP: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum ClockError {
    #[error("the guest's clock reads before 1970")]
    BeforeEpoch,
    #[error("cannot set the guest's clock to the host's: {0}")]
    Set(std::io::Error),
}

/// How far the guest's clock is off the host's, when it must be stepped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Forward(Duration),
    Back(Duration),
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Step::Forward(by) => write!(
                f,
                "was {:.3} s behind the host's; stepped forward",
                by.as_secs_f64()
            ),
            Step::Back(by) => write!(
                f,
                "was {:.3} s ahead of the host's; stepped back",
                by.as_secs_f64()
            ),
        }
    }
}

/// Whether a guest reading `guest` when it receives a message the host sent at
/// `host` must step its clock to `host`.
pub fn step_needed(guest: Duration, host: Duration) -> Option<Step> {
    if guest + BEHIND_TOLERANCE < host {
        Some(Step::Forward(host - guest))
    } else if guest > host + AHEAD_TOLERANCE {
        Some(Step::Back(guest - host))
    } else {
        None
    }
}

/// The last `Hello` that found the guest's clock ahead: when the host sent it, and by
/// how much the clock was ahead.
#[derive(Debug, Default)]
pub struct AheadSeen(Mutex<Option<(Duration, Duration)>>);

impl AheadSeen {
    /// Whether the clock, found ahead by `ahead` by a `Hello` the host sent at `host`,
    /// is to be stepped back now: when the last `Hello` found it ahead by as much.
    /// Otherwise this one is kept for the next to confirm.
    fn confirms(&self, host: Duration, ahead: Duration) -> bool {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let confirmed = seen.is_some_and(|(then, ahead_then)| {
            host.checked_sub(then)
                .is_some_and(|gap| gap >= AHEAD_CONFIRMATION_GAP)
                && ahead.abs_diff(ahead_then) < AHEAD_AGREEMENT
        });
        *seen = if confirmed { None } else { Some((host, ahead)) };
        confirmed
    }

    fn forget(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// The step to take now, if any, for a guest reading `guest` at a `Hello` the host
/// sent at `host` ([`step_needed`], a step back of less than [`STALE_HELLO_MAX`]
/// confirmed by a later `Hello` first).
fn step_to_take(guest: Duration, host: Duration, ahead_seen: &AheadSeen) -> Option<Step> {
    let step = step_needed(guest, host);
    match step {
        Some(Step::Back(ahead)) if ahead <= STALE_HELLO_MAX => ahead_seen
            .confirms(host, ahead)
            .then_some(Step::Back(ahead)),
        Some(Step::Back(_)) => {
            // Stepped now: an earlier finding confirms nothing after it.
            ahead_seen.forget();
            step
        }
        _ => {
            ahead_seen.forget();
            step
        }
    }
}

/// Steps the guest's clock to `host_time_ns` (since the Unix epoch) if it is off;
/// returns the step taken. A step back waits for a second `Hello` to agree
/// (`ahead_seen` keeps the first).
pub fn follow_host(host_time_ns: u64, ahead_seen: &AheadSeen) -> Result<Option<Step>, ClockError> {
    let guest = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|_| ClockError::BeforeEpoch)?;
    let host = Duration::from_nanos(host_time_ns);
    let Some(step) = step_to_take(guest, host, ahead_seen) else {
        return Ok(None);
    };
    let time = libc::timespec {
        tv_sec: host.as_secs() as libc::time_t,
        tv_nsec: host.subsec_nanos().into(),
    };
    // SAFETY: clock_settime only reads the timespec, a valid local.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &time) } != 0 {
        return Err(ClockError::Set(std::io::Error::last_os_error()));
    }
    Ok(Some(step))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    fn ms(millis: u64) -> Duration {
        Duration::from_millis(millis)
    }

    #[test]
    fn a_clock_behind_the_host_is_stepped_forward() {
        let host = s(1_800_000_000);
        assert_eq!(
            step_needed(host - s(3600), host),
            Some(Step::Forward(s(3600)))
        );
        assert_eq!(
            step_needed(host - ms(21), host),
            Some(Step::Forward(ms(21)))
        );
        assert_eq!(step_needed(host - ms(20), host), None, "within tolerance");
    }

    #[test]
    fn a_clock_ahead_is_stepped_back_only_beyond_any_transit() {
        let host = s(1_800_000_000);
        assert_eq!(step_needed(host, host), None);
        assert_eq!(step_needed(host + ms(300), host), None, "a slow message");
        assert_eq!(step_needed(host + AHEAD_TOLERANCE, host), None);
        assert_eq!(step_needed(host + s(3600), host), Some(Step::Back(s(3600))));
    }

    /// A host clock stepped back is followed once a second `Hello`, sent later,
    /// finds the guest ahead by as much.
    #[test]
    fn a_step_back_waits_for_a_later_hello_that_agrees() {
        let seen = AheadSeen::default();
        let host = s(1_800_000_000);
        assert!(!seen.confirms(host, s(3600)));
        assert!(seen.confirms(host + s(30), s(3600) + ms(5)));
        // Confirmed, and forgotten: the next finding starts over.
        assert!(!seen.confirms(host + s(60), s(3600)));
    }

    /// An hour ahead is stepped back at once: no `Hello` is read that late. A few
    /// seconds ahead waits for a second `Hello`; one that finds the clock right in
    /// between starts over.
    #[test]
    fn how_far_ahead_decides_whether_a_step_back_waits() {
        let seen = AheadSeen::default();
        let host = s(1_800_000_000);
        assert_eq!(
            step_to_take(host + s(3600), host, &seen),
            Some(Step::Back(s(3600)))
        );
        assert_eq!(step_to_take(host + s(10), host, &seen), None);
        assert_eq!(step_to_take(host + s(30), host + s(30), &seen), None);
        assert_eq!(step_to_take(host + s(70), host + s(60), &seen), None);
        assert_eq!(
            step_to_take(host + s(100), host + s(90), &seen),
            Some(Step::Back(s(10)))
        );
        assert_eq!(
            step_to_take(host, host + s(60), &seen),
            Some(Step::Forward(s(60)))
        );
    }

    /// `Hello`s queued behind a stalled agent and read in a burst: each looks ahead,
    /// by as much less as it was sent later, so none confirms another.
    #[test]
    fn stale_hellos_read_in_a_burst_do_not_step_a_right_clock_back() {
        let seen = AheadSeen::default();
        let host = s(1_800_000_000);
        assert!(!seen.confirms(host, s(9)));
        assert!(!seen.confirms(host + s(3), s(6)));
        assert!(!seen.confirms(host + s(6), s(3)));
        // Nor do two sent at almost the same time.
        assert!(!seen.confirms(host + s(6) + ms(100), s(3)));
    }
}
