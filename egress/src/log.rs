//! The decision log behind `vmctl policy log`: one JSON line per decision the proxy
//! made (a CONNECT, a plain HTTP request, a request inside terminated TLS), with the
//! rule that decided and the NAME of any secret injected. Never a header value.
//!
//! Two files, each rotated to `<name>.1` once it passes 1 MiB, so they stay bounded:
//! `<path>` for most decisions, and `<path>.secret-decisions` for those that concern
//! a secret (a request it was set on, anything inside TLS terminated for a host it is
//! bound to, its withdrawal). A guest can make cheap refusals by the thousand; they
//! must not rotate the record of what it did with a secret out of the log. A refusal
//! repeated without pause is written once and then counted ([`LogEntry::repeated`]),
//! so that a program retrying in a loop does not fill the log either.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

const MAX_LOG_BYTES: u64 = 1024 * 1024;
/// A refusal the same as the one before, within this long of it, is counted rather
/// than written again.
const REPEAT_WINDOW_MS: u64 = 60_000;
/// Longest host, rule or method a line keeps (the guest chooses them: a method of 60
/// KiB would make a few requests fill the log).
const MAX_FIELD_BYTES: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("cannot read the decision log {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
}

/// One decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    pub time_unix_ms: u64,
    pub host: String,
    pub port: u16,
    pub allowed: bool,
    /// The deciding rule, or why the proxy refused despite it (e.g. the address).
    pub rule: String,
    /// `connect`, `http` or `tls-request`.
    pub kind: String,
    pub method: Option<String>,
    /// The name of the secret injected, never its value.
    pub secret: Option<String>,
    /// On a refusal: how many times in a row it was made again, at most a minute
    /// apart, up to this entry's time (the entry before with the same decision was
    /// its first, or an earlier count). Counts are written at 1, 2, 4, 8... and when
    /// another entry comes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeated: Option<u64>,
}

impl LogEntry {
    /// An entry stamped now, without method or secret.
    pub fn new(host: &str, port: u16, allowed: bool, rule: &str, kind: &str) -> Self {
        let time_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or_default();
        Self {
            time_unix_ms,
            host: host.to_string(),
            port,
            allowed,
            rule: rule.to_string(),
            kind: kind.to_string(),
            method: None,
            secret: None,
            repeated: None,
        }
    }

    /// Whether the entry concerns a secret: one was set on the request, or it was
    /// made inside TLS terminated for a host a secret is bound to (where the
    /// secret's withdrawal is logged, and so are requests for another host).
    pub fn concerns_a_secret(&self) -> bool {
        self.secret.is_some() || self.kind == "tls-request"
    }

    /// Whether `other` is the same decision (its time and count aside).
    fn same_decision(&self, other: &LogEntry) -> bool {
        (&self.host, self.port, self.allowed, &self.rule, &self.kind)
            == (
                &other.host,
                other.port,
                other.allowed,
                &other.rule,
                &other.kind,
            )
            && (&self.method, &self.secret) == (&other.method, &other.secret)
    }
}

/// `field`, cut to [`MAX_FIELD_BYTES`] (at a character) with `...` to say so.
fn bounded(field: &str) -> String {
    if field.len() <= MAX_FIELD_BYTES {
        return field.to_string();
    }
    let mut end = MAX_FIELD_BYTES;
    while !field.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &field[..end])
}

/// An append-only, rotating JSON-lines log in two files ([the module](self)). Appends
/// are small and go through a std mutex: brief enough to do from async code.
#[derive(Debug)]
pub struct DecisionLog {
    path: PathBuf,
    max_bytes: u64,
    state: Mutex<LogState>,
}

#[derive(Debug, Default)]
struct LogState {
    general: Option<OpenLog>,
    secret_decisions: Option<OpenLog>,
    /// The last refusal written, while it is being repeated.
    repeating: Option<Repeating>,
}

#[derive(Debug)]
struct Repeating {
    /// As last written, or as it would be written now: its time is the last repeat's.
    entry: LogEntry,
    /// Repeats so far, and how many of them a written line counted.
    count: u64,
    written: u64,
}

#[derive(Debug)]
struct OpenLog {
    file: File,
    len: u64,
}

impl DecisionLog {
    /// A log appending to `path` (and the file beside it, [the module](self)). A
    /// file is opened on its first entry (and again after a failure), so a log that
    /// cannot be written never stops the proxy: the entries still reach `tracing`.
    pub fn open(path: impl Into<PathBuf>) -> DecisionLog {
        Self::with_max_bytes(path.into(), MAX_LOG_BYTES)
    }

    fn with_max_bytes(path: PathBuf, max_bytes: u64) -> DecisionLog {
        DecisionLog {
            path,
            max_bytes,
            state: Mutex::new(LogState::default()),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records `entry`: a line in a file (or a count, for a repeated refusal) and a
    /// `tracing` line (info if allowed, warn if refused). The guest decides how many
    /// requests it makes, so the `tracing` lines are rate-limited ([`guest_log`]).
    pub fn record(&self, entry: &LogEntry) {
        trace_entry(entry);
        if let Err(e) = self.append(entry) {
            guest_log::guest_warn!(path = %self.path.display(), "cannot write the decision log: {e}");
        }
    }

    fn append(&self, entry: &LogEntry) -> io::Result<()> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(repeating) = &mut state.repeating {
            let since_last = entry
                .time_unix_ms
                .saturating_sub(repeating.entry.time_unix_ms);
            if repeating.entry.same_decision(entry) && since_last <= REPEAT_WINDOW_MS {
                repeating.count += 1;
                repeating.entry.time_unix_ms = entry.time_unix_ms;
                if !repeating.count.is_power_of_two() {
                    return Ok(());
                }
                let count = repeating.count;
                let line = LogEntry {
                    repeated: Some(count),
                    ..repeating.entry.clone()
                };
                repeating.written = count;
                return self.write(&mut state, &line);
            }
        }
        self.write_repeats(&mut state)?;
        state.repeating = (!entry.allowed).then(|| Repeating {
            entry: entry.clone(),
            count: 0,
            written: 0,
        });
        self.write(&mut state, entry)
    }

    /// Writes the count of the refusal being repeated, if a line has not yet.
    fn write_repeats(&self, state: &mut LogState) -> io::Result<()> {
        let Some(repeating) = state.repeating.take() else {
            return Ok(());
        };
        if repeating.count == repeating.written {
            return Ok(());
        }
        let line = LogEntry {
            repeated: Some(repeating.count),
            ..repeating.entry
        };
        self.write(state, &line)
    }

    fn write(&self, state: &mut LogState, entry: &LogEntry) -> io::Result<()> {
        let bounded = LogEntry {
            host: bounded(&entry.host),
            rule: bounded(&entry.rule),
            method: entry.method.as_deref().map(bounded),
            ..entry.clone()
        };
        let mut line = serde_json::to_vec(&bounded).map_err(io::Error::other)?;
        line.push(b'\n');
        let (slot, path) = if entry.concerns_a_secret() {
            (&mut state.secret_decisions, secret_decisions(&self.path))
        } else {
            (&mut state.general, self.path.clone())
        };
        if slot.as_ref().is_some_and(|log| log.len >= self.max_bytes) {
            *slot = None;
            fs::rename(&path, rotated(&path))?;
        }
        let log = match slot {
            Some(log) => log,
            None => slot.insert(open_file(&path)?),
        };
        // On error the file is reopened next time (it may have been removed).
        let written = log.file.write_all(&line);
        if written.is_err() {
            *slot = None;
            return written;
        }
        log.len += line.len() as u64;
        Ok(())
    }
}

impl Drop for DecisionLog {
    /// Writes the count of a refusal still being repeated.
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let mut state = std::mem::take(state);
        if let Err(e) = self.write_repeats(&mut state) {
            guest_log::guest_warn!(path = %self.path.display(), "cannot write the decision log: {e}");
        }
    }
}

fn open_file(path: &Path) -> io::Result<OpenLog> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    let file = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)?;
    let len = file.metadata()?.len();
    Ok(OpenLog { file, len })
}

fn trace_entry(e: &LogEntry) {
    let method = e.method.as_deref().unwrap_or("");
    let secret = e.secret.as_deref().unwrap_or("");
    if e.allowed {
        guest_log::guest_info!(host = %e.host, port = e.port, kind = %e.kind, method, secret, rule = %e.rule, "egress allowed");
    } else {
        guest_log::guest_warn!(host = %e.host, port = e.port, kind = %e.kind, method, rule = %e.rule, "egress refused");
    }
}

fn rotated(path: &Path) -> PathBuf {
    with_suffix(path, ".1")
}

/// The file of the decisions that concern a secret, beside the log at `path`.
fn secret_decisions(path: &Path) -> PathBuf {
    with_suffix(path, ".secret-decisions")
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// The last `n` entries of the log at `path` (both its files, and their rotated
/// predecessors), oldest first. A missing file is empty; lines that do not parse
/// (e.g. one cut short by a crash) are skipped.
pub fn read_recent(path: &Path, n: usize) -> Result<Vec<LogEntry>, LogError> {
    let mut entries = Vec::new();
    for file in [path.to_path_buf(), secret_decisions(path)] {
        let mut current = read_entries(&file)?;
        if current.len() < n {
            entries.append(&mut read_entries(&rotated(&file))?);
        }
        entries.append(&mut current);
    }
    // Stable: a file's entries keep their order where their times are the same.
    entries.sort_by_key(|entry| entry.time_unix_ms);
    let skip = entries.len().saturating_sub(n);
    entries.drain(..skip);
    Ok(entries)
}

fn read_entries(path: &Path) -> Result<Vec<LogEntry>, LogError> {
    let text = match fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(LogError::Read {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    Ok(text
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decision about no secret, for a host of its own (so none repeats another).
    fn entry(i: usize) -> LogEntry {
        let mut e = LogEntry::new(
            &format!("host{i}.example.com"),
            443,
            i.is_multiple_of(2),
            "allow * (test)",
            "connect",
        );
        e.method = Some("GET".into());
        e
    }

    /// A request a secret was set on.
    fn secret_entry(i: usize) -> LogEntry {
        let mut e = LogEntry::new(
            "api.example.com",
            443,
            true,
            "allow api (test)",
            "tls-request",
        );
        e.method = Some("POST".into());
        e.secret = Some(format!("secret{i}"));
        e
    }

    fn lines(path: &Path) -> Vec<LogEntry> {
        read_entries(path).unwrap()
    }

    #[test]
    fn what_the_guest_chooses_is_cut_so_a_few_requests_cannot_fill_the_log() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::open(&path);
        let mut long = entry(0);
        long.method = Some("X".repeat(60 * 1024));
        long.rule = format!("Host {} disagrees", "é".repeat(1000));
        log.record(&long);
        let back = read_recent(&path, 1).unwrap();
        assert_eq!(back[0].method.as_deref().map(str::len), Some(256 + 3));
        assert!(back[0].rule.len() <= 256 + 3 && back[0].rule.ends_with("..."));
        assert!(std::fs::metadata(&path).unwrap().len() < 1024);
    }

    #[test]
    fn entries_are_read_back_from_both_files_in_time_order() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("logs/egress.jsonl");
        let log = DecisionLog::open(&path);
        for i in 0..5 {
            let mut e = if i % 2 == 0 {
                entry(i)
            } else {
                secret_entry(i)
            };
            e.time_unix_ms = 1000 + i as u64;
            log.record(&e);
        }
        assert_eq!(lines(&path).len(), 3);
        assert_eq!(lines(&secret_decisions(&path)).len(), 2);
        let back = read_recent(&path, 3).unwrap();
        let times: Vec<u64> = back.iter().map(|e| e.time_unix_ms).collect();
        assert_eq!(times, [1002, 1003, 1004]);
        assert_eq!(back[1].secret.as_deref(), Some("secret3"));
        assert_eq!(read_recent(&path, 100).unwrap().len(), 5);
        assert!(read_recent(&tmp.path().join("none"), 10)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn rotates_and_reads_across_the_rotation() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::with_max_bytes(path.clone(), 2000);
        for i in 0..100 {
            log.record(&entry(i));
        }
        let current = fs::metadata(&path).unwrap().len();
        let old = fs::metadata(rotated(&path)).unwrap().len();
        // One entry may push a file past the limit before it rotates.
        assert!(current <= 2000 + 300, "{current}");
        assert!(old <= 2000 + 300, "{old}");
        let recent = read_recent(&path, 15).unwrap();
        assert_eq!(recent.len(), 15);
        assert_eq!(recent[14].host, "host99.example.com");
        assert_eq!(recent[0].host, "host85.example.com");
    }

    /// A guest can make refusals by the thousand, each for another host; they rotate
    /// the general file, not the record of what was done with a secret.
    #[test]
    fn a_flood_of_refusals_leaves_the_decisions_about_secrets() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::with_max_bytes(path.clone(), 2000);
        log.record(&secret_entry(1));
        let withdrawn = LogEntry::new(
            "api.example.com",
            443,
            false,
            "secret secret1 withdrawn",
            "tls-request",
        );
        log.record(&withdrawn);
        for i in 0..2000 {
            let mut refusal = entry(2 * i + 1);
            refusal.rule = "deny * (default)".into();
            log.record(&refusal);
        }
        let all = read_recent(&path, usize::MAX).unwrap();
        assert_eq!(all[0].secret.as_deref(), Some("secret1"));
        assert_eq!(all[1].rule, "secret secret1 withdrawn");
        // Bounded all the same: the general file and its predecessor.
        assert!(all.len() < 100, "{} entries kept", all.len());
        assert!(fs::metadata(&path).unwrap().len() <= 2000 + 300);
    }

    #[test]
    fn a_refusal_repeated_is_counted_not_written_again() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::open(&path);
        let mut refusal = entry(1);
        for _ in 0..1000 {
            refusal.time_unix_ms += 10;
            log.record(&refusal);
        }
        log.record(&entry(2));
        let written = lines(&path);
        let counts: Vec<Option<u64>> = written.iter().map(|e| e.repeated).collect();
        let mut expected = vec![None];
        expected.extend((0..10).map(|k| Some(1 << k)));
        expected.extend([Some(999), None]);
        assert_eq!(counts, expected);
        // The count's line has the last repeat's time; the entries are the refusal's.
        assert_eq!(written[11].time_unix_ms, refusal.time_unix_ms);
        assert!(written[..12].iter().all(|e| e.same_decision(&refusal)));
        assert_eq!(written[12].host, "host2.example.com");
    }

    #[test]
    fn only_refusals_made_again_without_pause_are_counted() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::open(&path);
        // A refusal made again after more than the window is written again.
        let mut refusal = entry(1);
        log.record(&refusal);
        refusal.time_unix_ms += REPEAT_WINDOW_MS + 1;
        log.record(&refusal);
        // Allowed requests are each written.
        let allowed = entry(2);
        log.record(&allowed);
        log.record(&allowed);
        // A refusal still being counted when the log closes gets its count written.
        let mut other = entry(3);
        other.rule = "deny other (test)".into();
        for _ in 0..3 {
            log.record(&other);
        }
        drop(log);
        let counts: Vec<(String, Option<u64>)> = lines(&path)
            .into_iter()
            .map(|e| (e.host, e.repeated))
            .collect();
        let host = |i: usize| format!("host{i}.example.com");
        assert_eq!(
            counts,
            [
                (host(1), None),
                (host(1), None),
                (host(2), None),
                (host(2), None),
                (host(3), None),
                (host(3), Some(1)),
                (host(3), Some(2)),
            ]
        );
    }

    #[test]
    fn the_real_limit_is_one_mib() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::open(&path);
        let line_len = serde_json::to_vec(&entry(0)).unwrap().len() as u64 + 1;
        let lines = MAX_LOG_BYTES / line_len + 10;
        for i in 0..lines as usize {
            log.record(&entry(i));
        }
        assert!(rotated(&path).exists());
        assert!(fs::metadata(&path).unwrap().len() < MAX_LOG_BYTES);
    }
}
