//! Keeps a VM's logs bounded. The guest writes its console as fast as it likes, and can
//! make the supervisor log warnings (refused egress requests, relays nobody serves)
//! just as fast: left alone, either would fill the host's disk. A log grown past
//! [`MAX_LOG_BYTES`] keeps its last [`KEPT_TAIL_BYTES`] (what says how a VM ended is at
//! the end), after a line that says how much was dropped.
//!
//! The logs' writers (the supervisor's stdout and stderr) must append (`O_APPEND`), so
//! that their next write lands after the kept tail, not at their old offset.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const MAX_LOG_BYTES: u64 = 16 << 20;
const KEPT_TAIL_BYTES: u64 = 1 << 20;
const CHECK_EVERY: Duration = Duration::from_secs(2);

/// Opens (creates) a log for a writer that appends.
pub fn create_appending(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// Checks `logs` every few seconds for as long as the process runs.
pub fn keep_bounded(logs: Vec<PathBuf>) {
    let spawned = std::thread::Builder::new()
        .name("log-keeper".into())
        .spawn(move || loop {
            for log in &logs {
                if let Err(e) = shrink_if_larger(log, MAX_LOG_BYTES, KEPT_TAIL_BYTES) {
                    tracing::debug!("cannot shrink {}: {e}", log.display());
                }
            }
            std::thread::sleep(CHECK_EVERY);
        });
    if let Err(e) = spawned {
        tracing::warn!("the VM's logs will not be kept bounded: cannot start a thread: {e}");
    }
}

/// The last `max` bytes of a regular file (a log the guest can make grow without
/// bound). Never through a link, never a FIFO or device, never more than `max` bytes
/// however the file grows meanwhile: some logs lie in a directory the nested host can
/// write (`status.json -> /dev/zero` would otherwise be read until memory runs out).
pub fn read_tail(path: &Path, max: u64) -> Option<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let metadata = file.metadata().ok()?;
    if !metadata.is_file() {
        return None;
    }
    file.seek(SeekFrom::Start(metadata.len().saturating_sub(max)))
        .ok()?;
    let mut tail = Vec::new();
    file.take(max).read_to_end(&mut tail).ok()?;
    Some(tail)
}

/// Cuts `log` down to its last `tail` bytes (from a line's start) when it is larger than
/// `max`; true if it did.
fn shrink_if_larger(log: &Path, max: u64, tail: u64) -> io::Result<bool> {
    let len = std::fs::metadata(log)?.len();
    if len <= max {
        return Ok(false);
    }
    let kept = read_tail(log, tail).unwrap_or_default();
    let kept = match kept.iter().position(|&b| b == b'\n') {
        Some(end) => &kept[end + 1..],
        None => &kept[..],
    };
    let file = OpenOptions::new().append(true).open(log)?;
    file.set_len(0)?;
    let dropped = len - kept.len() as u64;
    let mut out = &file;
    writeln!(
        out,
        "[vmctl: {dropped} bytes of this log dropped, to keep it under {max} bytes]"
    )?;
    out.write_all(kept)?;
    Ok(true)
}

/// The last `count` lines of a log that are not blank, from its last `max_bytes`.
/// Its end only, and a byte that is not UTF-8 (a guest's words quoted) does not cost
/// the rest.
pub fn last_lines(path: &Path, max_bytes: u64, count: usize) -> Vec<String> {
    let tail = read_tail(path, max_bytes).unwrap_or_default();
    let text = String::from_utf8_lossy(&tail);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(count)..]
        .iter()
        .map(|line| line.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a regular file's tail, at most `max` bytes: a link, a FIFO or a device
    /// in its place is not read (one to /dev/zero would be read for ever).
    #[test]
    fn a_tail_is_read_only_from_a_regular_file_and_only_so_far() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log");
        std::fs::write(&log, "0123456789").unwrap();
        assert_eq!(read_tail(&log, 4).unwrap(), b"6789");
        let link = dir.path().join("status.json");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        assert_eq!(read_tail(&link, 4), None);
        let fifo = dir.path().join("fifo");
        crate::guest_writable::make_fifo(&fifo);
        assert_eq!(
            read_tail(&fifo, 4),
            None,
            "and without waiting for a writer"
        );
    }

    #[test]
    fn a_log_past_its_limit_keeps_its_last_lines_and_its_writer_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("console.log");
        let mut writer = create_appending(&log).unwrap();
        for i in 0..1000 {
            writeln!(writer, "line {i:04}").unwrap();
        }
        assert!(!shrink_if_larger(&log, 20_000, 100).unwrap());
        assert!(shrink_if_larger(&log, 5_000, 100).unwrap());
        writeln!(writer, "after").unwrap();
        let text = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("[vmctl: "), "{text}");
        assert!(lines[0].contains("dropped"), "{text}");
        // Whole lines only: the tail's first line, perhaps cut, is dropped.
        assert_eq!(lines[1..].len(), 10, "{text}");
        assert_eq!(lines[1], "line 0991");
        assert_eq!(lines.last(), Some(&"after"));
        assert!(!text.contains('\0'), "the writer wrote at its old offset");
    }
}
