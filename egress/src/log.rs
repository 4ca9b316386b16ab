//! The decision log behind `vmctl policy log`: one JSON line per decision the proxy
//! made (a CONNECT, a plain HTTP request, a request inside terminated TLS), with the
//! rule that decided and the NAME of any secret injected. Never a header value.
//!
//! The file is rotated to `<path>.1` once it passes 1 MiB, so it stays bounded.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

const MAX_LOG_BYTES: u64 = 1024 * 1024;
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
        }
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

/// An append-only, rotating JSON-lines log. Appends are small and go through a
/// std mutex: brief enough to do from async code.
#[derive(Debug)]
pub struct DecisionLog {
    path: PathBuf,
    max_bytes: u64,
    file: Mutex<Option<OpenLog>>,
}

#[derive(Debug)]
struct OpenLog {
    file: File,
    len: u64,
}

impl DecisionLog {
    /// A log appending to `path`. The file is opened on the first entry (and again
    /// after a failure), so a log that cannot be written never stops the proxy: the
    /// entries still reach `tracing`.
    pub fn open(path: impl Into<PathBuf>) -> DecisionLog {
        Self::with_max_bytes(path.into(), MAX_LOG_BYTES)
    }

    fn with_max_bytes(path: PathBuf, max_bytes: u64) -> DecisionLog {
        DecisionLog {
            path,
            max_bytes,
            file: Mutex::new(None),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records `entry`: a line in the file and a `tracing` line (info if allowed,
    /// warn if refused). The guest decides how many requests it makes, so the
    /// `tracing` lines are rate-limited ([`guest_log`]); the file has every entry.
    pub fn record(&self, entry: &LogEntry) {
        trace_entry(entry);
        if let Err(e) = self.append(entry) {
            guest_log::guest_warn!(path = %self.path.display(), "cannot write the decision log: {e}");
        }
    }

    fn append(&self, entry: &LogEntry) -> io::Result<()> {
        let bounded = LogEntry {
            host: bounded(&entry.host),
            rule: bounded(&entry.rule),
            method: entry.method.as_deref().map(bounded),
            ..entry.clone()
        };
        let mut line = serde_json::to_vec(&bounded).map_err(io::Error::other)?;
        line.push(b'\n');
        let mut slot = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().is_some_and(|log| log.len >= self.max_bytes) {
            *slot = None;
            fs::rename(&self.path, rotated(&self.path))?;
        }
        let log = match slot.as_mut() {
            Some(log) => log,
            None => slot.insert(self.open_file()?),
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

    fn open_file(&self) -> io::Result<OpenLog> {
        if let Some(parent) = self.path.parent() {
            fs::create_dir_all(parent)?;
        }
        let file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&self.path)?;
        let len = file.metadata()?.len();
        Ok(OpenLog { file, len })
    }
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
    let mut name = path.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// The last `n` entries of the log at `path` (and its rotated predecessor), oldest
/// first. A missing log is empty; lines that do not parse (e.g. one cut short by a
/// crash) are skipped.
pub fn read_recent(path: &Path, n: usize) -> Result<Vec<LogEntry>, LogError> {
    let mut entries = read_entries(path)?;
    if entries.len() < n {
        let mut older = read_entries(&rotated(path))?;
        older.append(&mut entries);
        entries = older;
    }
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

    fn entry(i: usize) -> LogEntry {
        let mut e = LogEntry::new(
            "api.example.com",
            443,
            i.is_multiple_of(2),
            "allow * (test)",
            "connect",
        );
        e.method = Some("GET".into());
        e.secret = Some(format!("secret{i}"));
        e
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
    fn entries_are_read_back() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("logs/egress.jsonl");
        let log = DecisionLog::open(&path);
        for i in 0..5 {
            log.record(&entry(i));
        }
        let back = read_recent(&path, 3).unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(back[0].secret.as_deref(), Some("secret2"));
        assert_eq!(back[2].secret.as_deref(), Some("secret4"));
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
        assert_eq!(recent[14].secret.as_deref(), Some("secret99"));
        assert_eq!(recent[0].secret.as_deref(), Some("secret85"));
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
