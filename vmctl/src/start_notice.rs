//! What a person at a terminal sees while vmctl boots a VM (`up`, `exec`, `shell`,
//! `agent`), which would otherwise be a silent wait: one line that counts the seconds,
//! shown once the boot takes longer than a moment and erased when it ends, so that
//! what follows (a command's own output) starts on a clean line. Never shown when
//! stderr is not a terminal (Paseo, scripts, logs).

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Duration;

/// A boot shorter than this (hardware KVM) shows nothing.
const SHOW_AFTER: Duration = Duration::from_secs(1);
/// Erases the current terminal line and returns to its start.
const ERASE_LINE: &str = "\r\x1b[K";

pub struct StartNotice<W: Write> {
    out: Option<W>,
    /// The seconds last shown; `None` while nothing is on the line.
    shown: Option<u64>,
}

impl StartNotice<std::io::Stderr> {
    /// A notice on stderr if it is a terminal; else one that shows nothing.
    pub fn on_terminal() -> Self {
        let stderr = std::io::stderr();
        let wanted = stderr.is_terminal();
        StartNotice::new(wanted.then_some(stderr))
    }
}

impl<W: Write> StartNotice<W> {
    fn new(out: Option<W>) -> Self {
        StartNotice { out, shown: None }
    }

    /// Shows (or updates) the line for a boot `elapsed` long.
    pub fn update(&mut self, workspace: &Path, elapsed: Duration) {
        let Some(out) = self.out.as_mut() else {
            return;
        };
        let seconds = elapsed.as_secs();
        if elapsed < SHOW_AFTER || self.shown == Some(seconds) {
            return;
        }
        // Best effort: a terminal that cannot be written only loses the notice.
        let _ = write!(
            out,
            "{ERASE_LINE}vmctl: starting the VM of {} ... {seconds} s",
            crate::terminal::printable(&workspace.display().to_string())
        )
        .and_then(|()| out.flush());
        self.shown = Some(seconds);
    }

    /// Erases the line, if one is shown.
    pub fn clear(&mut self) {
        if let (Some(out), Some(_)) = (self.out.as_mut(), self.shown.take()) {
            let _ = write!(out, "{ERASE_LINE}").and_then(|()| out.flush());
        }
    }
}

impl<W: Write> Drop for StartNotice<W> {
    /// A start that fails erases it too, before its error is printed.
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(notice: &StartNotice<Vec<u8>>) -> String {
        String::from_utf8_lossy(notice.out.as_deref().unwrap_or_default()).into_owned()
    }

    #[test]
    fn a_slow_start_counts_seconds_on_one_line_then_erases_it() {
        let workspace = Path::new("/home/me/project");
        let mut notice = StartNotice::new(Some(Vec::new()));
        notice.update(workspace, Duration::from_millis(400));
        assert_eq!(shown(&notice), "", "a quick start shows nothing");
        notice.update(workspace, Duration::from_millis(1200));
        notice.update(workspace, Duration::from_millis(1700));
        notice.update(workspace, Duration::from_millis(2100));
        notice.clear();
        assert_eq!(
            shown(&notice),
            "\r\x1b[Kvmctl: starting the VM of /home/me/project ... 1 s\
             \r\x1b[Kvmctl: starting the VM of /home/me/project ... 2 s\
             \r\x1b[K"
        );
        notice.clear();
        assert!(shown(&notice).ends_with("2 s\r\x1b[K"), "erased twice");
    }

    #[test]
    fn a_quick_start_leaves_the_terminal_alone() {
        let mut notice = StartNotice::new(Some(Vec::new()));
        notice.update(Path::new("/w"), Duration::from_millis(900));
        notice.clear();
        assert_eq!(shown(&notice), "");
    }

    #[test]
    fn a_workspace_path_cannot_drive_the_terminal() {
        let mut notice = StartNotice::new(Some(Vec::new()));
        notice.update(Path::new("/w/\x1b[2Jx"), Duration::from_secs(3));
        assert!(!shown(&notice)["\r\x1b[K".len()..].contains('\x1b'));
    }
}
