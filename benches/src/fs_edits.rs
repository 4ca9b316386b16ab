//! How soon the host's edits of the workspace reach a program in the guest: a file
//! watcher (Node's `fs.watch`, as dev servers use), and a reader of a file the host
//! replaces (written elsewhere and renamed over it, as git writes its index), where
//! the host's watch of the share reports the name and where it does not.
//!
//! One Node.js process per side runs [`PROBE_JS`] in a directory of the workspace (the
//! guest's through `vmctl exec`), driven line by line over its stdin and stdout. Each
//! time runs from the host's action (a line sent, a write, a rename) until the host
//! reads the probe's answer, so each carries one trip back through the exec's output;
//! `fs_edits_echo_ms`, a line there and back, is the floor. See `benches/README.md`.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::boot::command_argv;
use crate::process::{reader, text_so_far, Seen};
use crate::report::{fmt_sig, Figure, GUEST, HOST};
use crate::scan::tail;
use crate::stats::ms;

pub const DEFAULT_ROUNDS: usize = 10;
pub const QUICK_ROUNDS: usize = 3;
/// The longest one answer may take: a replaced file the watch does not report is read
/// within the guest's name cache (1 s), plus the emulation's slowness.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(20);

/// Files the host makes before its write in `fs_edits_watch_after_burst_ms`.
pub const BURST_FILES: usize = 100;

/// How long the host waits before each edit, so that each finds vmctl's watch idle
/// (as a user's save does), not still busy with the last one's echo.
const QUIET: Duration = Duration::from_millis(200);

/// The answers waited for per round: the echo; `watching` and `seen` for each of the
/// three watched writes; `polling` and `read` for each of the two replaced files.
const ANSWERS_PER_ROUND: u32 = 1 + 3 * 2 + 2 * 2;
/// The host's pauses per round ([`QUIET`]): before each watched write and each rename.
const PAUSES_PER_ROUND: u32 = 3 + 2;

/// The longest [`measure`] may take with `rounds` and `timeouts`: on each side, the
/// probe's start, every answer of every round (the unmeasured one too), its exit.
pub fn time_budget(rounds: usize, timeouts: Timeouts) -> Duration {
    let rounds = rounds as u32 + 1;
    let side = timeouts.startup
        + timeouts.answer * (ANSWERS_PER_ROUND * rounds + 1)
        + QUIET * PAUSES_PER_ROUND * rounds;
    side * 2
}

/// How long the probe may take to start, and then to give each answer.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub startup: Duration,
    pub answer: Duration,
}

/// The probe: `ping K` answers `pong K`; `watch K` answers `watching K`, then `seen K`
/// once an `fs.watch` event finds `watched.txt` holding `K`; `poll K FILE` has the
/// kernel look FILE up afresh (an exclusive create of the name, which exists: FUSE then
/// revalidates its cached name), so that the kernel holds the name for its whole life
/// (1 s with vmctl's cache), answers `polling K`, then reads FILE every millisecond
/// until it holds `K` and answers `read K` (`gave-up K` after 30 s).
pub const PROBE_JS: &str = r#"// vm-bench fs_edits probe (benches/src/fs_edits.rs)
const fs = require('fs');
const dir = process.argv[2];
const watched = dir + '/watched.txt';
const say = (line) => process.stdout.write(line + '\n');
let want = null;
fs.watch(watched, () => {
  if (want !== null && fs.readFileSync(watched, 'utf8') === want) {
    say('seen ' + want);
    want = null;
  }
});
const poll = (file, k, deadline) => {
  if (fs.readFileSync(file, 'utf8') === k) return say('read ' + k);
  if (Date.now() > deadline) return say('gave-up ' + k);
  setTimeout(poll, 1, file, k, deadline);
};
let pending = '';
process.stdin.setEncoding('utf8');
process.stdin.on('data', (chunk) => {
  pending += chunk;
  for (let nl; (nl = pending.indexOf('\n')) >= 0; ) {
    const [verb, k, file] = pending.slice(0, nl).split(' ');
    pending = pending.slice(nl + 1);
    if (verb === 'ping') say('pong ' + k);
    else if (verb === 'watch') { want = k; say('watching ' + k); }
    else if (verb === 'poll') {
      try { fs.closeSync(fs.openSync(dir + '/' + file, 'wx')); } catch (e) { if (e.code !== 'EEXIST') throw e; }
      fs.readFileSync(dir + '/' + file);
      say('polling ' + k);
      poll(dir + '/' + file, k, Date.now() + 30000);
    }
  }
});
process.stdin.on('end', () => process.exit(0));
say('ready');
"#;

/// The file the host replaces where its watch reports the name.
const REPLACED: &str = "replaced.txt";
/// The same where it does not: the watch leaves git's object store out, as it leaves
/// out read-only shares and VMs with host edits off.
const REPLACED_UNWATCHED: &str = ".git/objects/fs-edits/replaced.txt";

/// The figures, in the report's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Measure {
    Echo,
    Watch,
    WatchAfterBurst,
    WatchAfterRemoval,
    Replace,
    ReplaceUnwatched,
}

impl Measure {
    const ALL: [Measure; 6] = [
        Measure::Echo,
        Measure::Watch,
        Measure::WatchAfterBurst,
        Measure::WatchAfterRemoval,
        Measure::Replace,
        Measure::ReplaceUnwatched,
    ];

    fn name(self) -> &'static str {
        match self {
            Measure::Echo => "fs_edits_echo_ms",
            Measure::Watch => "fs_edits_watch_ms",
            Measure::WatchAfterBurst => "fs_edits_watch_after_burst_ms",
            Measure::WatchAfterRemoval => "fs_edits_watch_after_removal_ms",
            Measure::Replace => "fs_edits_replace_read_ms",
            Measure::ReplaceUnwatched => "fs_edits_replace_read_unwatched_ms",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Measure::Echo => "a line to the probe's stdin and back (the floor)",
            Measure::Watch => "the host writes a file; the probe's fs.watch fires and reads the new content",
            Measure::WatchAfterBurst => "the same, the host first making 100 files in a new directory (all in one batch)",
            Measure::WatchAfterRemoval => "the same, the host first removing that directory (rm -rf)",
            Measure::Replace => "the host renames a new file over one the probe reads every ms; the probe reads the new one",
            Measure::ReplaceUnwatched => "the same in a directory the host's watch leaves out (git's object store): as a read-only share, or host edits off",
        }
    }
}

/// One figure: both sides' samples (ms), and why one stopped short.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EditsFigure {
    pub name: String,
    pub what: String,
    pub host: Option<Figure>,
    pub guest: Option<Figure>,
}

/// The figures, with what ran them.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EditsReport {
    pub rounds: usize,
    /// How each side starts the probe.
    pub commands: Vec<(String, Vec<String>)>,
    pub figures: Vec<EditsFigure>,
    /// Why a side stopped short (its samples so far are kept), as (side, message).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<(String, String)>,
}

/// A side's samples (ms) per [`Measure`], in [`Measure::ALL`]'s order.
type Samples = [Vec<f64>; 6];

/// Runs `rounds` rounds (after one unmeasured) on each of `sides`, given as (name,
/// command, directory) with the names [`HOST`] and [`GUEST`]: each command starts the
/// probe in its directory (distinct directories of the workspace, [`side_dir`]), given
/// the probe's path and that directory as arguments.
pub fn measure(
    sides: [(&str, Command, &Path); 2],
    rounds: usize,
    timeouts: Timeouts,
) -> EditsReport {
    let mut report = EditsReport {
        rounds,
        ..EditsReport::default()
    };
    let mut per_side: Vec<(String, Samples)> = Vec::new();
    for (side, cmd, dir) in sides {
        report.commands.push((side.to_string(), command_argv(&cmd)));
        let mut samples = Samples::default();
        if let Err(e) = measure_side(cmd, dir, rounds, timeouts, &mut samples) {
            crate::boot::say(format!("error: fs_edits ({side}): {e}"));
            report.errors.push((side.to_string(), e));
        }
        per_side.push((side.to_string(), samples));
    }
    let figure = |side: &str, at: usize, m: Measure| {
        let samples = per_side.iter().find(|(s, _)| s == side)?.1[at].clone();
        Figure::new(m.name(), "ms", side, samples)
    };
    report.figures = Measure::ALL
        .iter()
        .enumerate()
        .map(|(at, m)| EditsFigure {
            name: m.name().into(),
            what: m.what().into(),
            host: figure(HOST, at, *m),
            guest: figure(GUEST, at, *m),
        })
        .collect();
    report
}

fn measure_side(
    mut cmd: Command,
    dir: &Path,
    rounds: usize,
    timeouts: Timeouts,
    samples: &mut Samples,
) -> Result<(), String> {
    let unwatched = dir.join(REPLACED_UNWATCHED);
    let unwatched_dir = unwatched.parent().unwrap_or(dir);
    fs::create_dir_all(unwatched_dir)
        .map_err(|e| format!("create {}: {e}", unwatched_dir.display()))?;
    let write = |path: &Path, content: &str| {
        fs::write(path, content).map_err(|e| format!("write {}: {e}", path.display()))
    };
    write(&dir.join("probe.js"), PROBE_JS)?;
    for file in ["watched.txt", REPLACED, REPLACED_UNWATCHED] {
        write(&dir.join(file), "0")?;
    }
    cmd.arg(dir.join("probe.js")).arg(dir);
    let mut probe = Probe::start(cmd)?;
    probe.expect("ready", timeouts.startup)?;
    let answer = timeouts.answer;
    for round in 0..=rounds {
        let k = round.to_string();
        let mut keep = |m: Measure, taken: Duration| {
            // Round 0 warms up (the probe's code, the guest's caches): not kept.
            if round > 0 {
                samples[m as usize].push(ms(taken));
            }
        };
        let sent = probe.send(&format!("ping {k}"))?;
        keep(
            Measure::Echo,
            probe.expect(&format!("pong {k}"), answer)? - sent,
        );

        // A write of `watched.txt` the probe's fs.watch must see, after `before`; the
        // time counts from the start of `before`.
        let mut watched = |want: &str, before: &dyn Fn() -> Result<(), String>| {
            probe.send(&format!("watch {want}"))?;
            probe.expect(&format!("watching {want}"), answer)?;
            thread::sleep(QUIET);
            let started = Instant::now();
            before()?;
            write(&dir.join("watched.txt"), want)?;
            Ok::<_, String>(probe.expect(&format!("seen {want}"), answer)? - started)
        };
        keep(Measure::Watch, watched(&k, &|| Ok(()))?);
        let burst = dir.join(format!("burst-{k}"));
        let make_burst = || {
            fs::create_dir(&burst).map_err(|e| format!("create {}: {e}", burst.display()))?;
            (0..BURST_FILES).try_for_each(|i| write(&burst.join(format!("f{i}")), "x"))
        };
        keep(
            Measure::WatchAfterBurst,
            watched(&format!("{k}b"), &make_burst)?,
        );
        let remove_burst =
            || fs::remove_dir_all(&burst).map_err(|e| format!("remove {}: {e}", burst.display()));
        keep(
            Measure::WatchAfterRemoval,
            watched(&format!("{k}r"), &remove_burst)?,
        );

        for (m, file) in [
            (Measure::Replace, REPLACED),
            (Measure::ReplaceUnwatched, REPLACED_UNWATCHED),
        ] {
            probe.send(&format!("poll {k} {file}"))?;
            probe.expect(&format!("polling {k}"), answer)?;
            thread::sleep(QUIET);
            let path = dir.join(file);
            let temporary = path.with_extension("new");
            let renamed = Instant::now();
            write(&temporary, &k)?;
            fs::rename(&temporary, &path)
                .map_err(|e| format!("rename to {}: {e}", path.display()))?;
            keep(m, probe.expect(&format!("read {k}"), answer)? - renamed);
        }
    }
    probe.finish(answer)
}

/// The probe's process: lines to its stdin, its stdout's lines as they come (each
/// with when it was read), its stderr kept for errors.
struct Probe {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<(Instant, String)>,
    stderr: Arc<Mutex<Seen>>,
    /// Lines read that were not the ones waited for (for errors).
    other: Vec<String>,
}

impl Probe {
    fn start(mut cmd: Command) -> Result<Probe, String> {
        let line = command_argv(&cmd).join(" ");
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|e| format!("cannot run {line}: {e}"))?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(format!("{line}: its pipes were not made"));
        };
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for read in BufReader::new(stdout).lines() {
                let Ok(read) = read else { return };
                if tx.send((Instant::now(), read)).is_err() {
                    return;
                }
            }
        });
        Ok(Probe {
            child,
            stdin: Some(stdin),
            lines,
            stderr: reader(stderr, false),
            other: Vec::new(),
        })
    }

    /// Sends one line; when it was written.
    fn send(&mut self, line: &str) -> Result<Instant, String> {
        let stdin = self.stdin.as_mut().ok_or("the probe's stdin is closed")?;
        let sent = Instant::now();
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|()| stdin.flush())
            .map_err(|e| self.failed(&format!("sending {line:?}: {e}")))?;
        Ok(sent)
    }

    /// Waits for the line `want`; when it was read.
    fn expect(&mut self, want: &str, timeout: Duration) -> Result<Instant, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((at, line)) if line == want => return Ok(at),
                Ok((_, line)) => self.other.push(line),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(self.failed(&format!(
                        "no {want:?} within {:.1} s",
                        timeout.as_secs_f64()
                    )))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.failed(&format!("the probe ended before {want:?}")))
                }
            }
        }
    }

    /// Closes the probe's stdin and waits for it to exit 0.
    fn finish(mut self, timeout: Duration) -> Result<(), String> {
        drop(self.stdin.take());
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => return Err(self.failed(&format!("the probe exited: {status}"))),
                Ok(None) => thread::sleep(Duration::from_millis(20)),
                Err(e) => return Err(format!("waiting for the probe: {e}")),
            }
        }
        Err(self.failed("the probe did not exit once its stdin was closed"))
    }

    /// `what`, with the lines not waited for and the probe's stderr.
    fn failed(&self, what: &str) -> String {
        let stderr = text_so_far(&self.stderr);
        format!(
            "{what}\n--- other lines ---\n{}\n--- stderr (tail) ---\n{}",
            tail(&self.other.join("\n"), 1000),
            tail(&stderr, 2000)
        )
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl EditsReport {
    /// Every error, as (what, message).
    pub fn errors(&self) -> Vec<(String, String)> {
        self.errors
            .iter()
            .map(|(side, e)| (format!("fs_edits ({side})"), e.clone()))
            .collect()
    }

    fn median(&self, m: Measure) -> Option<f64> {
        let figure = self.figures.iter().find(|f| f.name == m.name())?;
        Some(figure.guest.as_ref()?.median)
    }

    pub fn markdown(&self) -> String {
        let mut s = format!(
            "Host edits as the guest sees them: one Node.js probe per side in its own \
             directory of the workspace (the guest's through `vmctl exec`), driven over its \
             stdin and stdout, {} rounds after one unmeasured. Each time runs from the host's \
             action until the host reads the probe's answer.\n\n\
             | figure | what | host median | guest median | guest p90 | guest min–max | n |\n\
             |---|---|---:|---:|---:|---:|---:|\n",
            self.rounds
        );
        let median = |f: &Option<Figure>| f.as_ref().map_or("–".into(), |f| fmt_sig(f.median));
        for f in &self.figures {
            let guest = f.guest.as_ref();
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                f.name,
                f.what,
                median(&f.host),
                median(&f.guest),
                guest.map_or("–".into(), |g| fmt_sig(g.p90)),
                guest.map_or("–".into(), |g| format!(
                    "{}–{}",
                    fmt_sig(g.min),
                    fmt_sig(g.max)
                )),
                guest.map_or(0, |g| g.samples.len()),
            ));
        }
        if let (Some(echo), Some(watch)) = (self.median(Measure::Echo), self.median(Measure::Watch))
        {
            s.push_str(&format!(
                "\nIn the guest, a host write reached `fs.watch` in {} ms, {:.1}x the exec's echo.",
                fmt_sig(watch),
                watch / echo
            ));
        }
        if let (Some(watched), Some(unwatched)) = (
            self.median(Measure::Replace),
            self.median(Measure::ReplaceUnwatched),
        ) {
            s.push_str(&format!(
                " A file the host replaced was read new {} ms after the rename where the host's \
                 watch reports its name, {} ms where it does not ({:.1}x as long).",
                fmt_sig(watched),
                fmt_sig(unwatched),
                unwatched / watched
            ));
        }
        s.push('\n');
        for (side, e) in &self.errors {
            s.push_str(&format!(
                "\n**fs_edits error ({side}):** {} (full message in the JSON report)\n",
                e.lines().next().unwrap_or("")
            ));
        }
        s
    }
}

/// The directory each side's probe works in, inside `workspace`.
pub fn side_dir(workspace: &Path, side: &str) -> PathBuf {
    workspace.join(format!("fs-edits-{side}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> Command {
        Command::new("node")
    }

    /// The probe and the rounds on this machine for both "sides": every figure gets
    /// every sample, each a plausible time. Needs Node.js (scripts/setup.sh's).
    #[test]
    fn both_sides_measure_every_figure() {
        let tmp = crate::boot::TempDir::unique("-fs-edits-test");
        let (host, guest) = (side_dir(&tmp.0, HOST), side_dir(&tmp.0, GUEST));
        let report = measure(
            [(HOST, node(), &host), (GUEST, node(), &guest)],
            3,
            Timeouts {
                startup: Duration::from_secs(30),
                answer: Duration::from_secs(10),
            },
        );
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert_eq!(report.figures.len(), 6);
        for f in &report.figures {
            for side in [&f.host, &f.guest] {
                let side = side
                    .as_ref()
                    .unwrap_or_else(|| panic!("{}: no samples", f.name));
                assert_eq!(side.samples.len(), 3, "{}", f.name);
                assert!(side.max < 10_000.0, "{}: {:?}", f.name, side.samples);
            }
        }
        assert_eq!(fs::read_to_string(host.join(REPLACED)).unwrap(), "3");
        let md = report.markdown();
        assert!(md.contains("| fs_edits_watch_ms |"), "{md}");
        assert!(md.contains("x the exec's echo"), "{md}");
    }

    /// A probe that never answers is an error naming what was waited for, with what
    /// it printed; the other side still measures.
    #[test]
    fn a_probe_that_stops_answering_is_an_error() {
        let tmp = crate::boot::TempDir::unique("-fs-edits-test");
        let (host, guest) = (side_dir(&tmp.0, HOST), side_dir(&tmp.0, GUEST));
        let mut mute = Command::new("sh");
        mute.args([
            "-c",
            "echo ready; echo stray; echo trouble >&2; exec sleep 60",
            "sh",
        ]);
        let report = measure(
            [(HOST, node(), &host), (GUEST, mute, &guest)],
            1,
            Timeouts {
                startup: Duration::from_secs(30),
                answer: Duration::from_millis(500),
            },
        );
        assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
        let (side, e) = &report.errors[0];
        assert_eq!(side, GUEST);
        assert!(e.contains("no \"pong 0\""), "{e}");
        assert!(e.contains("stray") && e.contains("trouble"), "{e}");
        assert!(report
            .figures
            .iter()
            .all(|f| f.host.is_some() && f.guest.is_none()));
    }
}
