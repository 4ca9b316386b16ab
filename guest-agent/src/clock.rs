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
//! message's transit. A guest ahead is only set back when no transit explains it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A guest clock behind the host's time by more than this is stepped; smaller
/// differences are left alone so that a clock in step is not nudged by every message.
pub const BEHIND_TOLERANCE: Duration = Duration::from_millis(20);
/// A guest clock ahead by more than this is stepped back: a right clock is ahead by
/// the message's transit (vsock, a busy agent), which takes far less.
pub const AHEAD_TOLERANCE: Duration = Duration::from_secs(2);

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

/// Steps the guest's clock to `host_time_ns` (since the Unix epoch) if it is off;
/// returns the step taken.
pub fn follow_host(host_time_ns: u64) -> Result<Option<Step>, ClockError> {
    let guest = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|_| ClockError::BeforeEpoch)?;
    let host = Duration::from_nanos(host_time_ns);
    let Some(step) = step_needed(guest, host) else {
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
}
