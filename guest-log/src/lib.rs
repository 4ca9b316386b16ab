//! Rate limits for what a guest can make the host log at will: a bad register access,
//! a malformed request, a queue that does not exist, a refused egress request. Each
//! call site of [`guest_warn!`] or [`guest_info!`] logs its first
//! [`SHOWN_PER_WINDOW`] events in every [`WINDOW`] and counts the rest, so a
//! misbehaving guest neither floods the VM's log (pushing out how the VM started) nor
//! spends the host's CPU on formatting. The first event of the next window carries
//! the count of those left out (`not_logged_before=N`).

#[doc(hidden)]
pub use tracing;

use std::borrow::Cow;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Characters that are not control characters yet change how a line is laid out:
/// line and paragraph separators, and bidirectional marks, embeddings, overrides and
/// isolates (an override shows what follows it reversed: `curl x | sh` as `hs | x
/// lruc`). Guest text the host shows escapes them with the control characters.
pub fn is_layout_control(c: char) -> bool {
    matches!(
        c,
        '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{061c}'
    ) || ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

/// `text` on one line, shown as written: control characters (line breaks among them)
/// and layout controls escaped, for a guest's words quoted inside a message, where a
/// line of their own could pass for the host's, and an override could disguise them.
pub fn one_line(text: &str) -> Cow<'_, str> {
    escaped(text, |c| c.is_control() || is_layout_control(c))
}

/// `text` with the characters `escape` picks shown escaped (`\x1b`, `\n`), for words
/// of the guest's that the host quotes: an escape sequence in them must not drive the
/// user's terminal, nor a line break start a line that passes for the host's own.
pub fn escaped(text: &str, escape: impl Fn(char) -> bool) -> Cow<'_, str> {
    if !text.chars().any(&escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if escape(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Events logged per call site and window.
pub const SHOWN_PER_WINDOW: u32 = 10;
pub const WINDOW: Duration = Duration::from_secs(10);

/// What to do with one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; `left_out` events of this call site were not logged before it.
    Show {
        left_out: u64,
    },
    Suppress,
}

#[derive(Debug)]
struct Window {
    start: Instant,
    shown: u32,
    left_out: u64,
}

/// One call site's budget (a `static` in [`guest_warn!`] and [`guest_info!`]).
#[derive(Debug)]
pub struct Limiter {
    window: Mutex<Option<Window>>,
}

impl Limiter {
    pub const fn new() -> Limiter {
        Limiter {
            window: Mutex::new(None),
        }
    }

    pub fn check(&self) -> Verdict {
        self.check_at(Instant::now())
    }

    fn check_at(&self, now: Instant) -> Verdict {
        // A panic elsewhere while holding the lock leaves a count, never a broken state.
        let mut window = self
            .window
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(w) = window.as_mut() {
            if now.saturating_duration_since(w.start) < WINDOW {
                if w.shown < SHOWN_PER_WINDOW {
                    w.shown += 1;
                    return Verdict::Show { left_out: 0 };
                }
                w.left_out += 1;
                return Verdict::Suppress;
            }
        }
        let left_out = window.as_ref().map_or(0, |w| w.left_out);
        *window = Some(Window {
            start: now,
            shown: 1,
            left_out: 0,
        });
        Verdict::Show { left_out }
    }
}

impl Default for Limiter {
    fn default() -> Limiter {
        Limiter::new()
    }
}

/// `tracing::warn!` for what the guest controls, rate-limited per call site (see the
/// crate's documentation). Takes what `tracing::warn!` takes: fields, then a format
/// string and its arguments.
#[macro_export]
macro_rules! guest_warn {
    ($($event:tt)+) => { $crate::guest_event!(WARN, $($event)+) };
}

/// `tracing::info!` for what the guest controls, rate-limited like [`guest_warn!`].
#[macro_export]
macro_rules! guest_info {
    ($($event:tt)+) => { $crate::guest_event!(INFO, $($event)+) };
}

#[doc(hidden)]
#[macro_export]
macro_rules! guest_event {
    ($level:ident, $($event:tt)+) => {{
        static LIMITER: $crate::Limiter = $crate::Limiter::new();
        match LIMITER.check() {
            $crate::Verdict::Show { left_out: 0 } => {
                $crate::tracing::event!($crate::tracing::Level::$level, $($event)+)
            }
            $crate::Verdict::Show { left_out } => $crate::tracing::event!(
                $crate::tracing::Level::$level,
                not_logged_before = left_out,
                $($event)+
            ),
            $crate::Verdict::Suppress => {}
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_window_shows_its_budget_then_counts_the_rest() {
        let limiter = Limiter::new();
        let start = Instant::now();
        for _ in 0..SHOWN_PER_WINDOW {
            assert_eq!(limiter.check_at(start), Verdict::Show { left_out: 0 });
        }
        for _ in 0..25 {
            assert_eq!(limiter.check_at(start + WINDOW / 2), Verdict::Suppress);
        }
        // The next window tells how many were left out, once.
        assert_eq!(
            limiter.check_at(start + WINDOW),
            Verdict::Show { left_out: 25 }
        );
        assert_eq!(
            limiter.check_at(start + WINDOW),
            Verdict::Show { left_out: 0 }
        );
    }

    #[test]
    fn a_clock_that_goes_back_stays_in_the_window() {
        let limiter = Limiter::new();
        let start = Instant::now() + WINDOW;
        for _ in 0..SHOWN_PER_WINDOW {
            limiter.check_at(start);
        }
        assert_eq!(limiter.check_at(start - WINDOW), Verdict::Suppress);
    }

    /// A macro's static belongs to its call site: a flood from one site leaves
    /// another's budget whole.
    #[test]
    fn the_macros_log_a_flood_once_per_budget_and_each_site_apart() {
        let logged = Arc::new(Mutex::new(Vec::<u8>::new()));
        let writer = logged.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || SharedWriter(writer.clone()))
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            for i in 0..1000 {
                crate::guest_warn!("flood {i}");
            }
            crate::guest_warn!("other site");
            for _ in 0..100 {
                crate::guest_info!(host = "example.com", port = 443u16, "egress allowed");
            }
        });
        let logged = String::from_utf8(logged.lock().unwrap().clone()).unwrap();
        assert_eq!(
            logged.matches("flood").count(),
            SHOWN_PER_WINDOW as usize,
            "{logged}"
        );
        assert!(logged.contains("flood 9"), "{logged}");
        assert!(logged.contains("other site"), "{logged}");
        assert_eq!(
            logged
                .matches("INFO guest_log::tests: egress allowed host=\"example.com\" port=443")
                .count(),
            SHOWN_PER_WINDOW as usize,
            "{logged}"
        );
    }

    struct SharedWriter(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for SharedWriter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::Error::other("poisoned"))?
                .extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
