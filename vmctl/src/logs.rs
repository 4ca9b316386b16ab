//! `vmctl logs`: a VM's console (what its guest agent logs: boots, commands started and
//! ended, clock steps, relays, shutdown, and the kernel's last words) or its supervisor's
//! log (the host side: shares, relays, how the VM ended), as `docker logs` shows a
//! container's.
//!
//! The console is the guest's to write, so every line is shown as
//! [`printable`](crate::terminal::printable) text (an escape sequence from the guest must
//! not drive the terminal, now or when a saved copy is shown later), with the serial
//! line's `\r\n` ends made `\n`.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::state::{previous_run, VmDir};

#[derive(Debug, thiserror::Error)]
pub enum LogsError {
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    #[error("{} has no VM, so no logs: start one with `vmctl up`", .0.display())]
    NoVm(PathBuf),
    #[error("the VM of {} has no {what} yet ({} is missing)", .workspace.display(), .path.display())]
    Missing {
        workspace: PathBuf,
        what: &'static str,
        path: PathBuf,
    },
    #[error("cannot read {}: {source}", .path.display())]
    Read { path: PathBuf, source: io::Error },
}

/// Which log, how much of it, and whether to keep following it.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogsOptions {
    /// The supervisor's log instead of the console.
    pub supervisor: bool,
    /// The previous run's log (`*.previous`).
    pub previous: bool,
    /// Only the last this many lines.
    pub lines: Option<usize>,
    /// Keep printing what the VM logs until it stops.
    pub follow: bool,
}

/// How often a followed log is looked at again.
const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// Prints the chosen log of `workspace`'s VM on stdout.
pub fn show(workspace: &Path, options: LogsOptions) -> Result<(), LogsError> {
    let (workspace, vm) = VmDir::lookup(workspace)?;
    if !vm.path.is_dir() {
        return Err(LogsError::NoVm(workspace));
    }
    let (path, what) = match (options.supervisor, options.previous) {
        (false, false) => (vm.console_log(), "console log"),
        (true, false) => (vm.supervisor_log(), "supervisor log"),
        (false, true) => (
            previous_run(&vm.console_log()),
            "previous run's console log",
        ),
        (true, true) => (
            previous_run(&vm.supervisor_log()),
            "previous run's supervisor log",
        ),
    };
    let read_error = |source| LogsError::Read {
        path: path.clone(),
        source,
    };
    let mut file = match File::open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(LogsError::Missing {
                workspace,
                what,
                path,
            })
        }
        Err(e) => return Err(read_error(e)),
    };
    let start = match options.lines {
        Some(lines) => start_of_last_lines(&mut file, lines).map_err(read_error)?,
        None => 0,
    };
    let mut lines = Lines::default();
    let mut print = |line: &str| crate::terminal::print_out(format_args!("{line}\n"));
    if !options.follow {
        file.seek(SeekFrom::Start(start)).map_err(read_error)?;
        lines
            .read_to_end(&mut file, &mut print)
            .map_err(read_error)?;
        lines.finish(&mut print);
        return Ok(());
    }
    let is_running = || vm.running_pid().is_some();
    let was_running = is_running();
    follow(&path, file, start, is_running, &mut print, FOLLOW_POLL).map_err(read_error)?;
    vmm::to_stderr!(
        "vmctl: the VM of {} {}",
        workspace.display(),
        if was_running {
            "stopped"
        } else {
            "is not running: nothing more to follow"
        }
    );
    Ok(())
}

/// Where the last `count` lines of `file` start (0 when it has fewer), read backwards
/// in blocks so that a long log is not read whole. A last line without its newline
/// counts as a line.
fn start_of_last_lines(file: &mut File, count: usize) -> io::Result<u64> {
    const BLOCK: u64 = 64 << 10;
    let len = file.metadata()?.len();
    if count == 0 {
        return Ok(len);
    }
    let mut block = vec![0u8; BLOCK as usize];
    let mut end = len;
    let mut lines_to_pass = count;
    while end > 0 {
        let start = end.saturating_sub(BLOCK);
        let chunk = &mut block[..(end - start) as usize];
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(chunk)?;
        for (i, &byte) in chunk.iter().enumerate().rev() {
            let at = start + i as u64;
            // The newline that ends the last line starts no line after it.
            if byte != b'\n' || at + 1 == len {
                continue;
            }
            lines_to_pass -= 1;
            if lines_to_pass == 0 {
                return Ok(at + 1);
            }
        }
        end = start;
    }
    Ok(0)
}

/// Cuts what is read into whole lines, each shown printable; a line still being
/// written is held until its newline comes (or [`Lines::finish`]).
#[derive(Default)]
struct Lines {
    partial: Vec<u8>,
}

impl Lines {
    /// Reads `file` from its offset to its end. Returns how many bytes it read.
    fn read_to_end(&mut self, file: &mut File, out: &mut impl FnMut(&str)) -> io::Result<u64> {
        let mut buffer = [0u8; 64 << 10];
        let mut total = 0;
        loop {
            let read = match file.read(&mut buffer) {
                Ok(0) => return Ok(total),
                Ok(read) => read,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            total += read as u64;
            self.push(&buffer[..read], out);
        }
    }

    fn push(&mut self, mut bytes: &[u8], out: &mut impl FnMut(&str)) {
        while let Some(end) = bytes.iter().position(|&b| b == b'\n') {
            self.partial.extend_from_slice(&bytes[..end]);
            out(&shown(&self.partial));
            self.partial.clear();
            bytes = &bytes[end + 1..];
        }
        self.partial.extend_from_slice(bytes);
    }

    /// Shows the line left without its newline, if any.
    fn finish(&mut self, out: &mut impl FnMut(&str)) {
        if !self.partial.is_empty() {
            out(&shown(&self.partial));
            self.partial.clear();
        }
    }
}

/// A log line as the terminal may show it: without the serial line's `\r`, any other
/// control character escaped, bytes that are not UTF-8 replaced.
fn shown(line: &[u8]) -> String {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    crate::terminal::printable(&String::from_utf8_lossy(line)).into_owned()
}

/// Prints `file` (open at `path`) from `offset`, then what is added to it, until
/// `is_running` says the VM stopped (what it wrote last included). Follows the log
/// through what happens to it meanwhile: cut back by the log keeper (read again from
/// its start, which says what was dropped), or moved to `*.previous` by a new run
/// (the old file read to its end, then the new one from its start).
fn follow(
    path: &Path,
    mut file: File,
    offset: u64,
    mut is_running: impl FnMut() -> bool,
    out: &mut impl FnMut(&str),
    poll: Duration,
) -> io::Result<()> {
    let mut lines = Lines::default();
    let mut offset = file.seek(SeekFrom::Start(offset))?;
    loop {
        // Asked before reading, so that what the VM wrote before it stopped is read.
        let running = is_running();
        if file.metadata()?.len() < offset {
            offset = file.seek(SeekFrom::Start(0))?;
            lines = Lines::default();
        }
        offset += lines.read_to_end(&mut file, out)?;
        if let Some(newer) = replaced(path, &file)? {
            lines.finish(out);
            file = newer;
            offset = 0;
            continue;
        }
        if !running {
            lines.finish(out);
            return Ok(());
        }
        std::thread::sleep(poll);
    }
}

/// The file now at `path`, if it is no longer `current` (a new run moved the log).
fn replaced(path: &Path, current: &File) -> io::Result<Option<File>> {
    let now = match std::fs::metadata(path) {
        Ok(now) => now,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let open = current.metadata()?;
    if (now.dev(), now.ino()) == (open.dev(), open.ino()) {
        return Ok(None);
    }
    File::open(path).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    fn log_with(text: &str) -> (tempfile::TempDir, PathBuf, File) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        std::fs::write(&path, text).unwrap();
        let file = File::open(&path).unwrap();
        (dir, path, file)
    }

    fn last_lines(text: &str, count: usize) -> String {
        let (_dir, _path, mut file) = log_with(text);
        let start = start_of_last_lines(&mut file, count).unwrap();
        text[start as usize..].to_string()
    }

    #[test]
    fn the_last_lines_are_found_with_or_without_a_final_newline() {
        assert_eq!(last_lines("a\nb\nc\n", 2), "b\nc\n");
        assert_eq!(last_lines("a\nb\nc", 2), "b\nc");
        assert_eq!(last_lines("a\nb\nc\n", 3), "a\nb\nc\n");
        assert_eq!(last_lines("a\nb\nc\n", 10), "a\nb\nc\n");
        assert_eq!(last_lines("a\nb\nc\n", 0), "");
        assert_eq!(last_lines("", 5), "");
        assert_eq!(last_lines("a\n\n\nb\n", 2), "\nb\n");
    }

    #[test]
    fn the_last_lines_of_a_log_longer_than_a_block_are_found() {
        let text: String = (0..20_000).map(|i| format!("line {i:05}\n")).collect();
        assert_eq!(last_lines(&text, 1), "line 19999\n");
        let tail = last_lines(&text, 15_000);
        assert_eq!(tail.lines().count(), 15_000);
        assert!(tail.starts_with("line 05000\n"), "{}", &tail[..20]);
    }

    fn shown_lines(bytes: &[&[u8]]) -> Vec<String> {
        let mut lines = Lines::default();
        let mut out = Vec::new();
        for chunk in bytes {
            lines.push(chunk, &mut |line| out.push(line.to_string()));
        }
        lines.finish(&mut |line| out.push(line.to_string()));
        out
    }

    #[test]
    fn lines_lose_the_serial_carriage_return_and_the_guests_escapes() {
        assert_eq!(
            shown_lines(&[b"booted\r\nrun \x1b]0;owned\x07 x\r\n"]),
            ["booted", "run \\u{1b}]0;owned\\u{7} x"]
        );
        assert_eq!(shown_lines(&[b"not \xff utf-8\n"]), ["not \u{fffd} utf-8"]);
    }

    #[test]
    fn a_line_split_across_reads_is_shown_once_whole() {
        assert_eq!(
            shown_lines(&[b"half a", b" line\r", b"\nnext", b" unfinished"]),
            ["half a line", "next unfinished"]
        );
    }

    /// Runs [`follow`] on `path` in a thread while `write` changes the log; the VM
    /// "stops" when `write` returns.
    fn followed(path: &Path, write: impl FnOnce()) -> Vec<String> {
        let running = Arc::new(AtomicBool::new(true));
        let file = File::open(path).unwrap();
        let follower = {
            let running = running.clone();
            let path = path.to_path_buf();
            std::thread::spawn(move || {
                let mut out = Vec::new();
                follow(
                    &path,
                    file,
                    0,
                    || running.load(Ordering::SeqCst),
                    &mut |line: &str| out.push(line.to_string()),
                    Duration::from_millis(5),
                )
                .unwrap();
                out
            })
        };
        write();
        std::thread::sleep(Duration::from_millis(50));
        running.store(false, Ordering::SeqCst);
        follower.join().unwrap()
    }

    fn append(path: &Path, text: &str) {
        let mut file = crate::log_keeper::create_appending(path).unwrap();
        file.write_all(text.as_bytes()).unwrap();
        std::thread::sleep(Duration::from_millis(30));
    }

    #[test]
    fn following_prints_what_is_added_until_the_vm_stops() {
        let (_dir, path, _) = log_with("first\n");
        let out = followed(&path, || {
            append(&path, "second\nthird without its end");
        });
        assert_eq!(out, ["first", "second", "third without its end"]);
    }

    #[test]
    fn following_goes_on_through_a_cut_back_log_and_a_new_run() {
        let (_dir, path, _) = log_with("old 1\n");
        let out = followed(&path, || {
            append(&path, "old 2\n");
            // The log keeper cuts it back in place.
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(0)
                .unwrap();
            append(&path, "[dropped]\n");
            append(&path, "old 3\npartial");
            // A new run moves the log aside and starts another.
            std::fs::rename(&path, previous_run(&path)).unwrap();
            append(&path, "new 1\n");
        });
        assert_eq!(
            out,
            ["old 1", "old 2", "[dropped]", "old 3", "partial", "new 1"]
        );
    }
}
