//! The decision log behind `vmctl policy log`: one JSON line per decision the proxy
//! made (a CONNECT, a plain HTTP request, a request inside terminated TLS), with the
//! rule that decided and the NAME of any secret injected. Never a header value.
//!
//! Two files, each rotated to `<name>.1` once it passes 1 MiB, so they stay bounded:
//! `<path>` for most decisions, and `<path>.secret-decisions` for those that concern
//! a secret: a request it was set on, and its withdrawal. A guest can make cheap
//! refusals by the thousand, with a host and method of its choosing; they must not
//! rotate the record of what it did with a secret out of the log, so no refusal goes
//! there but a withdrawal's (which names no method, and so repeats exactly). A refusal
//! repeated without pause is written once and then counted ([`LogEntry::repeated`]),
//! so that a program retrying in a loop does not fill the log either; a count not yet
//! written is written within `REPEAT_WINDOW_MS` ([`DecisionLog::write_due_counts`]).
//! A repeat is the same kind of refusal ([`Refusal`]) of the same destination: what
//! the guest varies from request to request (the method, the Host header a refusal
//! quotes) does not make it another, and the allowed entries written meanwhile (the
//! CONNECT before each refused request inside terminated TLS) do not end the count.
//! Nor do other refusals: each of the last `MAX_REPEATING_REFUSALS` refusals made
//! is counted on its own, so that a program retrying two refused hosts in turn gets
//! two counts, not a line per request.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

const MAX_LOG_BYTES: u64 = 1024 * 1024;
/// A refusal the same as one made within this long is counted rather than written
/// again.
const REPEAT_WINDOW_MS: u64 = 60_000;
/// How many different refusals each file counts at once: the guest names the
/// destinations, so the ones it refers to are not all kept. Past this, the one made
/// least recently is no longer counted (its count is written), and written anew when
/// it comes again.
const MAX_REPEATING_REFUSALS: usize = 64;
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
    /// The name of the secret injected, never its value; on a `connect`, the secret
    /// bound to its host (for which TLS is terminated; none is sent yet).
    pub secret: Option<String>,
    /// The name of the secret whose withdrawal this refusal records: the proxy no
    /// longer sends it (after probes for it), or cut a connection it was sent on
    /// (it was removed, replaced or withdrawn meanwhile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub withdrawn_secret: Option<String>,
    /// On a refusal: how many times it was made again, at most a minute apart (other
    /// refusals between aside), up to this entry's time (the entry before with the
    /// same decision was its first, or an earlier count). The same decision: the
    /// same [`Refusal`] of the same destination (and secret); the repeats' methods and
    /// their rules' details (a Host header) may differ from this entry's. Counts are
    /// written at 1, 2, 4, 8..., when a refusal not being counted comes, and otherwise
    /// within a minute of a repeat not yet counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeated: Option<u64>,
    /// On a refusal: what kind of reason refused it; `None` on entries written before
    /// it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<Refusal>,
}

/// Why the proxy refused a request, as repeats are counted by: the rule's text may
/// quote what the guest sent, which it can vary at will.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Refusal {
    /// The policy's rule (its text is the policy's, and counts: a changed policy
    /// makes a new decision).
    Policy,
    /// A Host header (or an absolute URI) naming another destination than the
    /// request's target.
    HostMismatch,
    /// The destination resolves to an address the proxy never connects to.
    ForbiddenAddress,
    /// The secret bound to the destination was withdrawn, removed or replaced.
    SecretWithdrawn,
}

impl LogEntry {
    /// An entry stamped now, without method or secret.
    pub fn new(host: &str, port: u16, allowed: bool, rule: &str, kind: &str) -> Self {
        Self {
            time_unix_ms: now_unix_ms(),
            host: host.to_string(),
            port,
            allowed,
            rule: rule.to_string(),
            kind: kind.to_string(),
            method: None,
            secret: None,
            withdrawn_secret: None,
            repeated: None,
            refusal: None,
        }
    }

    /// Whether the entry concerns a secret: one was set on the request, or it
    /// records a secret's withdrawal. Not any other refusal, even inside TLS
    /// terminated for a secret's host, nor a CONNECT to that host, which sends no
    /// secret: the guest makes those by the thousand at no cost.
    pub fn concerns_a_secret(&self) -> bool {
        (self.secret.is_some() && self.kind != "connect") || self.withdrawn_secret.is_some()
    }

    /// Whether `other` is the same decision (its time and count aside): the same
    /// kind of refusal of the same destination. Without a [`Refusal`], the same in
    /// every field.
    fn same_decision(&self, other: &LogEntry) -> bool {
        let same_destination = (&self.host, self.port, self.allowed, &self.kind)
            == (&other.host, other.port, other.allowed, &other.kind)
            && (&self.secret, &self.withdrawn_secret) == (&other.secret, &other.withdrawn_secret);
        let same_reason = match (self.refusal, other.refusal) {
            (Some(Refusal::Policy), Some(Refusal::Policy)) => self.rule == other.rule,
            (Some(mine), Some(theirs)) => mine == theirs,
            (None, None) => (&self.rule, &self.method) == (&other.rule, &other.method),
            _ => false,
        };
        same_destination && same_reason
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
    general: LogFile,
    secret_decisions: LogFile,
}

/// One of the two files, and the refusals it is counting. Each file counts its own:
/// refusals in the general one, made between two withdrawal refusals, must not have
/// each of those written anew to the other.
#[derive(Debug, Default)]
struct LogFile {
    open: Option<OpenLog>,
    /// The refusals written, while they are being repeated, the one made least
    /// recently first; at most [`MAX_REPEATING_REFUSALS`].
    repeating: VecDeque<Repeating>,
}

#[derive(Debug)]
struct Repeating {
    /// As last written, or as it would be written now: its time is the last repeat's.
    entry: LogEntry,
    /// Repeats so far, and how many of them a written line counted.
    count: u64,
    written: u64,
    /// The time of the first repeat no written line counted yet.
    unwritten_since_ms: Option<u64>,
}

impl Repeating {
    /// The line that counts the repeats so far, if one has not yet; taken as written.
    fn count_line(&mut self) -> Option<LogEntry> {
        if self.count == self.written {
            return None;
        }
        self.written = self.count;
        self.unwritten_since_ms = None;
        Some(LogEntry {
            repeated: Some(self.count),
            ..self.entry.clone()
        })
    }
}

/// Which of the two files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Which {
    General,
    SecretDecisions,
}

impl LogState {
    fn file(&mut self, which: Which) -> &mut LogFile {
        match which {
            Which::General => &mut self.general,
            Which::SecretDecisions => &mut self.secret_decisions,
        }
    }
}

fn which(entry: &LogEntry) -> Which {
    if entry.concerns_a_secret() {
        Which::SecretDecisions
    } else {
        Which::General
    }
}

/// The time now, as entries are stamped.
fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
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

    /// Writes the counts due: of a refusal no longer repeated (its last repeat more
    /// than `REPEAT_WINDOW_MS` ago), and of repeats not counted in a line for that
    /// long. Called on each entry and by [`keep_counts_current`]: without it, a
    /// count waited for the next entry, hours later, or was lost when the process
    /// was killed.
    pub fn write_due_counts(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = self.write_due(&mut state, now_unix_ms()) {
            guest_log::guest_warn!(path = %self.path.display(), "cannot write the decision log: {e}");
        }
    }

    fn write_due(&self, state: &mut LogState, now_ms: u64) -> io::Result<()> {
        for which in [Which::General, Which::SecretDecisions] {
            let mut due = Vec::new();
            state.file(which).repeating.retain_mut(|repeating| {
                let ended = now_ms.saturating_sub(repeating.entry.time_unix_ms) > REPEAT_WINDOW_MS;
                let overdue = repeating
                    .unwritten_since_ms
                    .is_some_and(|since| now_ms.saturating_sub(since) >= REPEAT_WINDOW_MS);
                if ended || overdue {
                    due.extend(repeating.count_line());
                }
                !ended
            });
            for line in due {
                self.write(state, which, &line)?;
            }
        }
        Ok(())
    }

    fn append(&self, entry: &LogEntry) -> io::Result<()> {
        // Cut before it is kept to count its repeats as well as before it is written:
        // those kept are as many as MAX_REPEATING_REFUSALS, each of the guest's choosing.
        let entry = &LogEntry {
            host: bounded(&entry.host),
            rule: bounded(&entry.rule),
            method: entry.method.as_deref().map(bounded),
            ..entry.clone()
        };
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.write_due(&mut state, entry.time_unix_ms)?;
        let which = which(entry);
        let file = state.file(which);
        if entry.allowed {
            // Written, and the refusals being counted go on: a guest that retries a
            // refused request inside terminated TLS opens a tunnel (allowed) each time.
            return self.write(&mut state, which, entry);
        }
        let made_before = file
            .repeating
            .iter()
            .position(|repeating| repeating.entry.same_decision(entry));
        let mut lines = Vec::new();
        let (repeating, line) = match made_before.and_then(|at| file.repeating.remove(at)) {
            Some(mut repeating) => {
                repeating.count += 1;
                repeating.entry.time_unix_ms = entry.time_unix_ms;
                let line = if repeating.count.is_power_of_two() {
                    repeating.count_line()
                } else {
                    repeating
                        .unwritten_since_ms
                        .get_or_insert(entry.time_unix_ms);
                    None
                };
                (repeating, line)
            }
            // A refusal not being counted: written whole, and counted from now on, in
            // the place of the one made least recently once all are taken (its count
            // written first).
            None => {
                if file.repeating.len() >= MAX_REPEATING_REFUSALS {
                    lines.extend(
                        file.repeating
                            .pop_front()
                            .and_then(|mut oldest| oldest.count_line()),
                    );
                }
                let first = Repeating {
                    entry: entry.clone(),
                    count: 0,
                    written: 0,
                    unwritten_since_ms: None,
                };
                (first, Some(entry.clone()))
            }
        };
        if let Some(line) = line {
            // The others' counts not yet written are older: they go first, so that the
            // file reads in order (their refusals are still counted after it).
            lines.extend(file.repeating.iter_mut().filter_map(Repeating::count_line));
            lines.push(line);
        }
        // Now the one made most recently.
        file.repeating.push_back(repeating);
        for line in &lines {
            self.write(&mut state, which, line)?;
        }
        Ok(())
    }

    /// Writes `entry` to its file; its fields were cut ([`bounded`]) by [`Self::append`].
    fn write(&self, state: &mut LogState, which: Which, entry: &LogEntry) -> io::Result<()> {
        let mut line = serde_json::to_vec(entry).map_err(io::Error::other)?;
        line.push(b'\n');
        let path = match which {
            Which::General => self.path.clone(),
            Which::SecretDecisions => secret_decisions(&self.path),
        };
        let slot = &mut state.file(which).open;
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

/// Writes the counts of repeated refusals as they fall due
/// ([`DecisionLog::write_due_counts`]) while the log is in use: run it beside the
/// proxy. It ends once the log is dropped.
pub async fn keep_counts_current(log: std::sync::Weak<DecisionLog>) {
    // Often enough that a count is written at most a few seconds past its due time.
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(REPEAT_WINDOW_MS / 12));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(log) = log.upgrade() else {
            return;
        };
        log.write_due_counts();
    }
}

impl Drop for DecisionLog {
    /// Writes the counts of the refusals still being repeated.
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let mut state = std::mem::take(state);
        for which in [Which::General, Which::SecretDecisions] {
            let repeating = std::mem::take(&mut state.file(which).repeating);
            for mut ended in repeating {
                let Some(line) = ended.count_line() else {
                    continue;
                };
                if let Err(e) = self.write(&mut state, which, &line) {
                    guest_log::guest_warn!(path = %self.path.display(), "cannot write the decision log: {e}");
                    break;
                }
            }
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

    /// The refusal that records `secret1`'s withdrawal.
    fn withdrawal() -> LogEntry {
        let mut withdrawn = LogEntry::new(
            "api.example.com",
            443,
            false,
            "secret secret1 withdrawn",
            "tls-request",
        );
        withdrawn.withdrawn_secret = Some("secret1".into());
        withdrawn
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
        log.record(&withdrawal());
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

    /// Inside TLS terminated for a secret's host, the guest chooses the method and
    /// the Host header a refusal names: each refusal differs from the one before. They
    /// go to the general file; the withdrawal's refusals, the same whatever the
    /// method, are counted in the other.
    #[test]
    fn a_flood_of_refusals_inside_terminated_tls_leaves_the_decisions_about_secrets() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::with_max_bytes(path.clone(), 4000);
        log.record(&secret_entry(1));
        for i in 0..2000 {
            // A CONNECT to the secret's host, which sends it nowhere.
            let mut connect =
                LogEntry::new("api.example.com", 443, true, "allow api (test)", "connect");
            connect.secret = Some("secret1".into());
            log.record(&connect);
            let mut refusal = LogEntry::new(
                "api.example.com",
                443,
                false,
                &format!("Host evil{i}.example.com disagrees with the CONNECT target"),
                "tls-request",
            );
            refusal.method = Some(format!("M{i}"));
            log.record(&refusal);
            // The withdrawn secret asked for again and again, in between.
            if i >= 1000 {
                log.record(&withdrawal());
            }
        }
        drop(log);
        let about_secrets = lines(&secret_decisions(&path));
        assert_eq!(about_secrets[0].secret.as_deref(), Some("secret1"));
        assert_eq!(about_secrets[1], withdrawal_written(&about_secrets[1]));
        // The withdrawal once, then its count at 1, 2, 4... 512 and 999.
        assert_eq!(about_secrets.len(), 2 + 10 + 1, "{about_secrets:?}");
        assert_eq!(about_secrets.last().unwrap().repeated, Some(999));
        assert!(!rotated(&secret_decisions(&path)).exists());
        assert!(lines(&path)
            .iter()
            .all(|e| e.kind == "connect" || e.secret.is_none() && e.withdrawn_secret.is_none()));
    }

    /// `entry` if it is [`withdrawal`]'s first line (its time aside).
    fn withdrawal_written(entry: &LogEntry) -> LogEntry {
        LogEntry {
            time_unix_ms: entry.time_unix_ms,
            ..withdrawal()
        }
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
        // An allowed entry is written, and the count goes on; another refusal ends it.
        log.record(&entry(2));
        log.record(&entry(3));
        let written = lines(&path);
        let counts: Vec<Option<u64>> = written.iter().map(|e| e.repeated).collect();
        let mut expected = vec![None];
        expected.extend((0..10).map(|k| Some(1 << k)));
        expected.extend([None, Some(999), None]);
        assert_eq!(counts, expected);
        assert_eq!(written[11].host, "host2.example.com");
        // The count's line has the last repeat's time; the entries are the refusal's.
        assert_eq!(written[12].time_unix_ms, refusal.time_unix_ms);
        assert!(written[..11].iter().all(|e| e.same_decision(&refusal)));
        assert!(written[12].same_decision(&refusal));
        assert_eq!(written[13].host, "host3.example.com");
    }

    /// A refusal of `kind` for api.example.com:443 inside terminated TLS, by a rule
    /// that quotes `detail`, for a request of method `method`.
    fn refusal_of(kind: Refusal, detail: &str, method: &str) -> LogEntry {
        let mut e = LogEntry::new(
            "api.example.com",
            443,
            false,
            &format!("refused for {detail}"),
            "tls-request",
        );
        e.method = Some(method.into());
        e.refusal = Some(kind);
        e
    }

    /// What the guest varies from request to request (the method, the Host header
    /// a refusal quotes) does not make a refusal another; nor does the CONNECT it
    /// makes before each, which is written as every allowed entry is.
    #[test]
    fn refusals_of_one_kind_for_one_destination_are_counted_whatever_their_details() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::open(&path);
        for i in 0..10 {
            let mut connect =
                LogEntry::new("api.example.com", 443, true, "allow api (test)", "connect");
            connect.secret = Some("secret1".into());
            log.record(&connect);
            let detail = format!("Host evil{i}.example.com");
            log.record(&refusal_of(
                Refusal::HostMismatch,
                &detail,
                &format!("M{i}"),
            ));
        }
        drop(log);
        let written = lines(&path);
        let refusals: Vec<(&str, Option<u64>)> = written
            .iter()
            .filter(|e| !e.allowed)
            .map(|e| (e.rule.as_str(), e.repeated))
            .collect();
        let first = "refused for Host evil0.example.com";
        assert_eq!(
            refusals,
            [
                (first, None),
                (first, Some(1)),
                (first, Some(2)),
                (first, Some(4)),
                (first, Some(8)),
                (first, Some(9)),
            ]
        );
        assert_eq!(written.iter().filter(|e| e.allowed).count(), 10);
        assert!(written
            .iter()
            .all(|e| e.allowed || e.refusal == Some(Refusal::HostMismatch)));
    }

    /// Two destinations refused in turn (a program retrying both) are each counted,
    /// not written anew on every request for ending each other's count.
    #[test]
    fn refusals_of_two_destinations_in_turn_are_each_counted() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::open(&path);
        let (mut first, mut second) = (entry(1), entry(3));
        for _ in 0..1000 {
            first.time_unix_ms += 10;
            log.record(&first);
            second.time_unix_ms += 10;
            log.record(&second);
        }
        drop(log);
        let entries = lines(&path);
        // In the order they were made (review: a count waiting to be written came
        // after another's written at once).
        assert!(entries
            .windows(2)
            .all(|pair| pair[0].time_unix_ms <= pair[1].time_unix_ms));
        let written: Vec<(String, Option<u64>)> =
            entries.into_iter().map(|e| (e.host, e.repeated)).collect();
        let (a, b) = (first.host.clone(), second.host.clone());
        let mut expected = vec![(a.clone(), None), (b.clone(), None)];
        for k in 0..10 {
            if k >= 2 {
                // The other's count so far, not yet written, goes before.
                expected.push((b.clone(), Some((1 << k) - 1)));
            }
            expected.extend([(a.clone(), Some(1 << k)), (b.clone(), Some(1 << k))]);
        }
        // Written when the log closes, as they were still being repeated.
        expected.extend([(a, Some(999)), (b, Some(999))]);
        assert_eq!(written, expected);

        // One's count waits (3) when the other's is written (4): the waiting one first.
        let path = tmp.path().join("in-order.jsonl");
        let log = DecisionLog::open(&path);
        let order = [
            &first, &second, &first, &second, &first, &second, &first, &second, &second,
        ];
        for (i, made) in order.into_iter().enumerate() {
            log.record(&LogEntry {
                time_unix_ms: first.time_unix_ms + i as u64,
                ..made.clone()
            });
        }
        drop(log);
        let counts: Vec<(String, Option<u64>)> = lines(&path)
            .into_iter()
            .map(|e| (e.host, e.repeated))
            .filter(|(_, repeated)| repeated.is_some_and(|n| n > 2))
            .collect();
        assert_eq!(
            counts,
            [
                (first.host.clone(), Some(3)),
                (second.host.clone(), Some(4))
            ]
        );
    }

    /// The refusals counted at once are bounded, whatever number of destinations the
    /// guest names: past the bound, the one made least recently gets its count
    /// written and is no longer counted (written anew when it comes again).
    #[test]
    fn the_refusals_being_counted_are_bounded() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::open(&path);
        let oldest = entry(1);
        for _ in 0..3 {
            log.record(&oldest);
        }
        for i in 0..10 * MAX_REPEATING_REFUSALS {
            log.record(&entry(2 * i + 3));
            let state = log.state.lock().unwrap();
            assert!(state.general.repeating.len() <= MAX_REPEATING_REFUSALS);
        }
        log.record(&oldest);
        let of_the_oldest: Vec<Option<u64>> = lines(&path)
            .into_iter()
            .filter(|e| e.host == oldest.host)
            .map(|e| e.repeated)
            .collect();
        assert_eq!(of_the_oldest, [None, Some(1), Some(2), None]);
    }

    /// Another kind of refusal, another destination or (for the policy's refusals)
    /// another rule is another decision.
    #[test]
    fn another_kind_destination_or_policy_rule_is_another_refusal() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::open(&path);
        let deny = |rule: &str, method: &str| refusal_of(Refusal::Policy, rule, method);
        log.record(&deny("deny api", "GET"));
        log.record(&deny("deny api", "POST"));
        log.record(&deny("deny * (changed)", "POST"));
        log.record(&refusal_of(Refusal::ForbiddenAddress, "10.0.0.1", "POST"));
        let mut other_port = refusal_of(Refusal::ForbiddenAddress, "10.0.0.2", "POST");
        other_port.port = 8443;
        log.record(&other_port);
        // Entries without a kind (written before it was recorded) compare whole.
        let mut kindless = refusal_of(Refusal::Policy, "x", "GET");
        kindless.refusal = None;
        log.record(&kindless);
        kindless.method = Some("PUT".into());
        log.record(&kindless);
        drop(log);
        let written: Vec<(String, Option<u64>)> = lines(&path)
            .into_iter()
            .map(|e| (e.rule, e.repeated))
            .collect();
        let line = |rule: &str, repeated| (format!("refused for {rule}"), repeated);
        assert_eq!(
            written,
            [
                line("deny api", None),
                line("deny api", Some(1)),
                line("deny * (changed)", None),
                line("10.0.0.1", None),
                line("10.0.0.2", None),
                line("x", None),
                line("x", None),
            ]
        );
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

    /// A count not yet written is written within a window of its first repeat, with
    /// no other entry to come, and though the repeats go on at less than a window's
    /// pause: `policy log` is never more than a minute behind.
    #[test]
    fn a_pending_count_is_written_when_its_window_closes() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = DecisionLog::open(&path);
        let mut refusal = entry(1);
        let start = refusal.time_unix_ms;
        log.record(&refusal);
        // Repeats every 20 s: 1 and 2 are written at once, 3 waits.
        for _ in 0..3 {
            refusal.time_unix_ms += 20_000;
            log.record(&refusal);
        }
        let counts =
            |path: &Path| -> Vec<Option<u64>> { lines(path).iter().map(|e| e.repeated).collect() };
        assert_eq!(counts(&path), [None, Some(1), Some(2)]);
        // A timer's check before the window closes writes nothing.
        let mut state = log.state.lock().unwrap();
        log.write_due(&mut state, start + 60_000 + REPEAT_WINDOW_MS - 1)
            .unwrap();
        drop(state);
        assert_eq!(counts(&path), [None, Some(1), Some(2)]);
        // Repeats 4 (written, a power of two) and 5..7, every 20 s: 5 waits, and
        // when 8 would come, its window has closed; 6 and 7 go with it.
        for _ in 0..3 {
            refusal.time_unix_ms += 20_000;
            log.record(&refusal);
        }
        assert_eq!(counts(&path), [None, Some(1), Some(2), Some(4)]);
        refusal.time_unix_ms += 20_000;
        log.record(&refusal);
        assert_eq!(counts(&path), [None, Some(1), Some(2), Some(4)]);
        let mut state = log.state.lock().unwrap();
        log.write_due(&mut state, start + 100_000 + REPEAT_WINDOW_MS)
            .unwrap();
        drop(state);
        assert_eq!(counts(&path), [None, Some(1), Some(2), Some(4), Some(7)]);
        // The refusals stop: the run ends, counted, a window after the last, with no
        // entry and no drop to write it.
        refusal.time_unix_ms += 20_000;
        log.record(&refusal);
        let mut state = log.state.lock().unwrap();
        log.write_due(&mut state, refusal.time_unix_ms + REPEAT_WINDOW_MS + 1)
            .unwrap();
        assert!(state.general.repeating.is_empty());
        drop(state);
        let written = lines(&path);
        assert_eq!(written.last().unwrap().repeated, Some(8));
        assert_eq!(written.last().unwrap().time_unix_ms, refusal.time_unix_ms);
        // Nothing more when the log closes.
        drop(log);
        assert_eq!(lines(&path).len(), written.len());
    }

    /// The timer that writes due counts ends with the log.
    #[tokio::test(start_paused = true)]
    async fn the_counts_timer_writes_due_counts_and_ends_with_the_log() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("egress.jsonl");
        let log = std::sync::Arc::new(DecisionLog::open(&path));
        // A refusal repeated 3 times, the last a window and more ago (its run ended).
        let mut refusal = entry(1);
        refusal.time_unix_ms -= 2 * REPEAT_WINDOW_MS;
        for _ in 0..4 {
            log.record(&refusal);
        }
        assert_eq!(lines(&path).len(), 3);
        let timer = tokio::spawn(keep_counts_current(std::sync::Arc::downgrade(&log)));
        tokio::time::sleep(std::time::Duration::from_millis(REPEAT_WINDOW_MS / 6)).await;
        assert_eq!(lines(&path).last().unwrap().repeated, Some(3));
        drop(log);
        tokio::time::timeout(std::time::Duration::from_millis(REPEAT_WINDOW_MS), timer)
            .await
            .expect("the timer ended with the log")
            .unwrap();
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
