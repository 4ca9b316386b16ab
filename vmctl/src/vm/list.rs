//! `vmctl ps`: one row per VM, as a table or (`--json`) as JSON.

use std::path::PathBuf;

use serde::Serialize;

use crate::state::{StateError, VmDir};

use super::lock::{
    lifecycle_lock_held, lifecycle_lock_held_for, running_vm_stopped_by, LockHolder,
};

/// One VM as `vmctl ps` sees it; `vmctl ps --json` prints a list of these, so its
/// field names are a format scripts read: add fields, do not rename them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmRow {
    /// The VM's directory's name (the workspace's name and a hash of its path).
    pub name: String,
    /// running, degraded (a share's virtiofsd died), starting, stopping, removing,
    /// stopped, crashed, or broken (its record cannot be read).
    pub state: &'static str,
    /// Where its record and logs are.
    #[serde(serialize_with = "lossy_path")]
    pub vm_dir: PathBuf,
    /// The rest is unknown (null) without a readable record.
    #[serde(serialize_with = "lossy_optional_path")]
    pub workspace: Option<PathBuf>,
    /// The workspace directory no longer exists (a worktree Paseo removed).
    pub workspace_removed: bool,
    /// "direct" (on this host's KVM) or "nested" (inside a QEMU nested host).
    pub mode: Option<&'static str>,
    pub cpus: Option<u32>,
    pub memory_mib: Option<u64>,
    /// Set while it runs.
    pub uptime_s: Option<u64>,
    /// The host memory its processes hold (proportional set size), while it runs.
    pub held_mib: Option<u64>,
    /// What keeps it running, while it runs.
    pub kept_by: Option<KeptBy>,
    /// Why it crashed, why it is broken and what to do, or that another build of
    /// vmctl runs it.
    pub notes: Vec<String>,
}

/// What keeps a running VM running, as the daemon sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KeptBy {
    /// No daemon answered, so nothing stops it for idleness.
    NoDaemon,
    /// The daemon does not know it.
    Untracked,
    /// `vmctl up` (a pin) and the sessions' leases, `purpose (pid N)`.
    Holders(Vec<String>),
    /// Nothing: it stops in this many seconds (null: it does not stop by itself).
    Idle { stops_in_s: Option<u64> },
}

/// A path as JSON text, whatever its bytes: a directory whose name is not UTF-8 must
/// not make the whole list fail (its odd bytes show as U+FFFD).
fn lossy_path<S: serde::Serializer>(path: &std::path::Path, out: S) -> Result<S::Ok, S::Error> {
    out.serialize_str(&path.to_string_lossy())
}

fn lossy_optional_path<S: serde::Serializer>(
    path: &Option<PathBuf>,
    out: S,
) -> Result<S::Ok, S::Error> {
    match path {
        Some(path) => lossy_path(path, out),
        None => out.serialize_none(),
    }
}

/// `vmctl ps`: a row per VM, with what it holds and what keeps it running.
pub fn list() -> Vec<VmRow> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let daemon = crate::daemon::client::status();
    let mut rows = Vec::new();
    for vm in VmDir::all() {
        let name = vm
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let record = match vm.read_record() {
            Ok(record) => record,
            Err(error) => {
                rows.extend(row_without_record(&vm, &name, &error));
                continue;
            }
        };
        let pid = vm.running_pid();
        let (state, crash) = run_state(&vm, pid);
        let kept_by = pid.map(|_| match &daemon {
            None => KeptBy::NoDaemon,
            Some(vms) => kept_by(vms.iter().find(|v| v.vm_dir == vm.path)),
        });
        let mut notes = Vec::new();
        if let Some(crash) = crash {
            notes.push(format!("{crash} (its logs: {})", vm.path.display()));
        }
        notes.extend(pid.and_then(another_builds_vm));
        rows.push(VmRow {
            state,
            workspace_removed: !record.workspace.exists(),
            mode: Some(if record.nested { "nested" } else { "direct" }),
            cpus: Some(record.cpus),
            memory_mib: Some(record.memory_mib),
            uptime_s: pid.map(|_| now.saturating_sub(record.started_at)),
            held_mib: pid
                .and_then(crate::procfs::tree_pss_kib)
                .map(|kib| kib / 1024),
            kept_by,
            notes,
            workspace: Some(record.workspace),
            vm_dir: vm.path,
            name,
        });
    }
    rows
}

/// `vmctl ps`'s table of `rows`: a line per VM, then each VM's notes, then what to do
/// about VMs of removed directories.
pub fn table(rows: &[VmRow]) -> Vec<String> {
    let mut lines = vec![format!(
        "{:<28} {:<8} {:>8} {:<6} {:>4} {:>7} {:>7}  {:<30} WORKSPACE",
        "NAME", "STATE", "UPTIME", "MODE", "CPUS", "MEMORY", "HELD", "KEPT BY"
    )];
    let mut notes = Vec::new();
    for row in rows {
        let name = &row.name;
        notes.extend(row.notes.iter().map(|note| format!("{name}: {note}")));
        let Some(workspace) = &row.workspace else {
            lines.push(format!("{name:<28} {}", row.state));
            continue;
        };
        let dash_or = |value: Option<String>| value.unwrap_or_else(|| "-".into());
        lines.push(format!(
            "{name:<28} {:<8} {:>8} {:<6} {:>4} {:>7} {:>7}  {:<30} {}{}",
            row.state,
            dash_or(row.uptime_s.map(format_duration)),
            row.mode.unwrap_or("-"),
            dash_or(row.cpus.map(|cpus| cpus.to_string())),
            dash_or(row.memory_mib.map(|mib| format!("{mib}M"))),
            dash_or(row.held_mib.map(|mib| format!("{mib}M"))),
            dash_or(row.kept_by.as_ref().map(KeptBy::describe)),
            workspace.display(),
            if row.workspace_removed {
                " (removed)"
            } else {
                ""
            }
        ));
    }
    if !notes.is_empty() {
        lines.push(String::new());
        lines.extend(notes);
    }
    let of_removed_directories = rows.iter().filter(|row| row.workspace_removed).count();
    if of_removed_directories > 0 {
        lines.push(String::new());
        lines.push(format!(
            "{of_removed_directories} VM(s) of directories since removed: `vmctl prune` \
             forgets the stopped ones, `vmctl rm DIR` one (its logs and agent transcripts \
             go with it)"
        ));
    }
    lines
}

/// `vmctl ps`'s note for a VM whose supervisor, `pid`, runs another build of vmctl
/// than this one (started before an upgrade): it keeps that build's ways, its guest
/// agent's protocol among them, until it is started again.
fn another_builds_vm(pid: i32) -> Option<String> {
    crate::procfs::runs_another_program(pid).then(|| {
        "started by another build of vmctl (before an upgrade?), whose ways it keeps: \
         `vmctl stop` it and start it again to run this one's"
            .to_string()
    })
}

/// `vmctl ps`'s row for `vm`, named `name`, whose record could not be read (`error`):
/// broken, with a note that says why and what to do; no row for a directory without
/// a record and no start under way (`vmctl up` creates the directory, then writes the
/// record: a start refused before that, say for a bad `--mount`, leaves no VM to
/// list).
fn row_without_record(vm: &VmDir, name: &str, error: &StateError) -> Option<VmRow> {
    let (state, notes) = if vm.record_path().exists() {
        ("broken", vec![error.to_string()])
    } else if lifecycle_lock_held(vm) {
        ("starting", Vec::new())
    } else {
        return None;
    };
    Some(VmRow {
        name: name.to_string(),
        state,
        vm_dir: vm.path.clone(),
        workspace: None,
        workspace_removed: false,
        mode: None,
        cpus: None,
        memory_mib: None,
        uptime_s: None,
        held_mib: None,
        kept_by: None,
        notes,
    })
}

/// What `vmctl ps` says of `vm`, a VM with a record whose supervisor runs as `pid`,
/// and the crash its last run ended in, if that is what it shows.
fn run_state(vm: &VmDir, pid: Option<i32>) -> (&'static str, Option<String>) {
    let lock_holder = match pid {
        Some(_) => running_vm_stopped_by(vm),
        None => lifecycle_lock_held_for(vm),
    };
    match pid {
        // Going down, until its stopper lets go of the lock (the VM gone, or not yet).
        _ if lock_holder.is_some_and(|holder| holder != LockHolder::Starting) => {
            (lock_holder.map_or("stopping", LockHolder::note), None)
        }
        // A restart spends seconds, minutes for a rebuild of the guest agent, before
        // its supervisor runs: neither the stop nor the crash before is what goes on.
        None if lock_holder.is_some() => ("starting", None),
        None => match vm.read_crash() {
            Some(crash) => ("crashed", Some(crash)),
            None => ("stopped", None),
        },
        // A share's virtiofsd died: the VM runs but cannot reach those files.
        Some(_) if !vm.read_share_failures().is_empty() => ("degraded", None),
        Some(_) => ("running", None),
    }
}

/// What keeps a running VM running, from the daemon's `status` of it.
fn kept_by(status: Option<&crate::daemon::protocol::VmStatus>) -> KeptBy {
    let Some(status) = status else {
        return KeptBy::Untracked;
    };
    let mut holders = status.leases.clone();
    if status.pinned {
        holders.insert(0, "vmctl up".into());
    }
    match holders.is_empty() {
        false => KeptBy::Holders(holders),
        true => KeptBy::Idle {
            stops_in_s: status.stops_in_s,
        },
    }
}

impl KeptBy {
    /// As the table's KEPT BY column says it.
    fn describe(&self) -> String {
        match self {
            KeptBy::NoDaemon => "no daemon".into(),
            KeptBy::Untracked => "untracked".into(),
            KeptBy::Holders(holders) => holders.join(", "),
            KeptBy::Idle {
                stops_in_s: Some(s),
            } => format!("idle, stops in {s}s"),
            KeptBy::Idle { stops_in_s: None } => "idle".into(),
        }
    }
}

fn format_duration(seconds: u64) -> String {
    match seconds {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::lock::{
        lock_lifecycle, lock_to_stop_within, note_lock_holder, read_note, try_lock_lifecycle,
        LIFECYCLE_LOCK,
    };
    use crate::vm::tests::*;
    use std::time::Duration;

    /// A VM that crashed, or stopped, and is being started again (its supervisor not
    /// running yet, as while the guest agent is rebuilt) is shown starting.
    #[test]
    fn ps_shows_a_vm_being_restarted_as_starting() {
        let _locks_free_when_dropped = crate::state::no_forks_meanwhile();
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        assert_eq!(run_state(&vm, None), ("stopped", None));
        std::fs::write(vm.crash_file(), "the guest kernel crashed: oops\n").unwrap();
        let crash = Some("the guest kernel crashed: oops".to_string());
        assert_eq!(run_state(&vm, None), ("crashed", crash.clone()));
        let starting = lock_exclusive(&vm.path.join(LIFECYCLE_LOCK)).unwrap();
        assert_eq!(run_state(&vm, None), ("starting", None));
        drop(starting);
        assert_eq!(run_state(&vm, None), ("crashed", crash));
        assert_eq!(run_state(&vm, Some(1)).0, "running");
    }

    /// A VM being stopped (by `vmctl stop`, or the daemon's idle stop) or removed is
    /// shown so while it still runs and until its stopper lets go of the lock; a start
    /// that takes the lock after that is shown starting again.
    #[test]
    fn ps_shows_a_vm_being_stopped_as_stopping_not_starting() {
        let _locks_free_when_dropped = crate::state::no_forks_meanwhile();
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().to_path_buf(),
        };
        let stopping = lock_to_stop_within(&vm, LockHolder::Stopping, Duration::ZERO)
            .unwrap()
            .expect("the lock");
        assert_eq!(run_state(&vm, Some(1)), ("stopping", None));
        assert_eq!(run_state(&vm, None), ("stopping", None));
        drop(stopping);
        assert_eq!(run_state(&vm, None), ("stopped", None));
        let removing = lock_to_stop_within(&vm, LockHolder::Removing, Duration::ZERO)
            .unwrap()
            .expect("the lock");
        assert_eq!(run_state(&vm, Some(1)), ("removing", None));
        drop(removing);
        // The daemon's idle stop notes itself on the lock it takes.
        let idle_stop = try_lock_lifecycle(&vm).unwrap().expect("the lock");
        note_lock_holder(&idle_stop, LockHolder::Stopping);
        assert_eq!(run_state(&vm, Some(1)), ("stopping", None));
        drop(idle_stop);
        // The next holder's note replaces the last one's.
        let starting = lock_lifecycle(&vm, || {}).unwrap();
        assert_eq!(run_state(&vm, None), ("starting", None));
        assert_eq!(run_state(&vm, Some(1)), ("running", None));
        drop(starting);
        // A holder that notes nothing (`vmctl prune`) is not taken for the last
        // holder, a stop.
        let stopping = lock_to_stop_within(&vm, LockHolder::Stopping, Duration::ZERO)
            .unwrap()
            .expect("the lock");
        drop(stopping);
        let pruning = try_lock_lifecycle(&vm).unwrap().expect("the lock");
        assert_eq!(
            run_state(&vm, None),
            ("starting", None),
            "a holder that notes nothing"
        );
        assert_eq!(run_state(&vm, Some(1)), ("running", None));
        drop(pruning);
        // A running VM's free lock is not taken just to look: its start's note
        // ("starting") says no stop is under way.
        let starting = lock_lifecycle(&vm, || {}).unwrap();
        drop(starting);
        let file = std::fs::File::open(vm.path.join(LIFECYCLE_LOCK)).unwrap();
        assert_eq!(read_note(&file), b"starting");
        assert_eq!(run_state(&vm, Some(1)), ("running", None));
    }

    #[test]
    fn ps_points_out_a_vm_another_build_of_vmctl_runs() {
        assert_eq!(another_builds_vm(std::process::id() as i32), None);
        let mut other = crate::state::spawn_in_test(std::process::Command::new("sleep").arg("30"));
        let note = another_builds_vm(other.id() as i32);
        let _ = other.kill();
        let _ = other.wait();
        let note = note.expect("a note for a VM of another build");
        assert!(
            note.starts_with("started by another build of vmctl"),
            "{note}"
        );
    }

    /// A VM whose record cannot be read is listed as broken, with why and what to do
    /// under the table; a directory a refused start left is not listed.
    #[test]
    fn ps_says_why_a_vm_is_broken() {
        let dir = tempfile::tempdir().unwrap();
        let vm = VmDir {
            path: dir.path().join("app-1234abcd"),
        };
        std::fs::create_dir(&vm.path).unwrap();
        assert!(vm.read_record().is_err());
        let error = vm.read_record().unwrap_err();
        assert!(row_without_record(&vm, "app-1234abcd", &error).is_none());
        std::fs::write(vm.record_path(), "{ half a record").unwrap();
        let error = vm.read_record().unwrap_err();
        let row = row_without_record(&vm, "app-1234abcd", &error).unwrap();
        assert_eq!(row.state, "broken");
        assert_eq!(
            table(std::slice::from_ref(&row))[1]
                .split_whitespace()
                .collect::<Vec<_>>(),
            ["app-1234abcd", "broken"]
        );
        let note = &row.notes[0];
        assert!(
            note.contains(&vm.record_path().display().to_string())
                && note.contains("unreadable VM record")
                && note.contains(&format!("delete {}", vm.path.display())),
            "{note}"
        );
        assert!(table(std::slice::from_ref(&row))
            .iter()
            .any(|line| line.starts_with("app-1234abcd: ") && line.ends_with(note.as_str())));
        // The workspace `vmctl rm` needs, from the supervisor's log.
        std::fs::write(
            vm.supervisor_log(),
            "vmctl: supervising the VM of /home/u/app\nvmctl: the VM ended: Ok(0)\n",
        )
        .unwrap();
        let error = vm.read_record().unwrap_err();
        let row = row_without_record(&vm, "app-1234abcd", &error).unwrap();
        let note = &row.notes[0];
        assert!(
            note.contains("remove it with `vmctl rm /home/u/app`"),
            "{note}"
        );
    }

    fn running_row(name: &str, workspace: &str) -> VmRow {
        VmRow {
            name: name.into(),
            state: "running",
            vm_dir: PathBuf::from("/state/vms").join(name),
            workspace: Some(workspace.into()),
            workspace_removed: false,
            mode: Some("nested"),
            cpus: Some(2),
            memory_mib: Some(1024),
            uptime_s: Some(125),
            held_mib: Some(143),
            kept_by: Some(KeptBy::Holders(vec![
                "vmctl up".into(),
                "shell (pid 7)".into(),
            ])),
            notes: Vec::new(),
        }
    }

    /// The table: a line per VM in the header's columns, a dash for what a VM does not
    /// have, each VM's notes under it by name, and what to do with VMs of removed
    /// directories.
    #[test]
    fn the_table_shows_each_row_and_the_notes_under_it() {
        let running = running_row("app-1", "/home/u/a b");
        let mut idle = running_row("web-2", "/home/u/web");
        idle.kept_by = Some(KeptBy::Idle {
            stops_in_s: Some(12),
        });
        let mut crashed = running_row("old-3", "/home/u/gone");
        (crashed.state, crashed.workspace_removed) = ("crashed", true);
        (crashed.uptime_s, crashed.held_mib, crashed.kept_by) = (None, None, None);
        crashed.notes = vec!["the guest kernel crashed: oops".into()];
        let lines = table(&[running, idle, crashed]);
        let words = |line: &str| {
            line.split_whitespace()
                .map(String::from)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            words(&lines[0]),
            [
                "NAME",
                "STATE",
                "UPTIME",
                "MODE",
                "CPUS",
                "MEMORY",
                "HELD",
                "KEPT",
                "BY",
                "WORKSPACE"
            ]
        );
        assert_eq!(
            words(&lines[1]),
            [
                "app-1",
                "running",
                "2m05s",
                "nested",
                "2",
                "1024M",
                "143M",
                "vmctl",
                "up,",
                "shell",
                "(pid",
                "7)",
                "/home/u/a",
                "b"
            ]
        );
        assert!(lines[2].contains(" idle, stops in 12s "), "{}", lines[2]);
        assert_eq!(
            words(&lines[3]),
            [
                "old-3",
                "crashed",
                "-",
                "nested",
                "2",
                "1024M",
                "-",
                "-",
                "/home/u/gone",
                "(removed)"
            ]
        );
        assert_eq!(lines[4], "");
        assert_eq!(lines[5], "old-3: the guest kernel crashed: oops");
        assert_eq!(lines[6], "");
        assert!(lines[7].starts_with("1 VM(s) of directories since removed"));
        assert_eq!(lines.len(), 8);
        assert_eq!(table(&[]).len(), 1, "the header alone");
    }

    /// `vmctl ps --json`'s names are what scripts (the benchmarks, the VM tests) read.
    #[test]
    fn the_json_names_each_field() {
        use std::os::unix::ffi::OsStrExt;
        let row = running_row("app-1", "/home/u/app");
        let json = serde_json::to_value([row]).unwrap();
        assert_eq!(
            json,
            serde_json::json!([{
                "name": "app-1",
                "state": "running",
                "vm_dir": "/state/vms/app-1",
                "workspace": "/home/u/app",
                "workspace_removed": false,
                "mode": "nested",
                "cpus": 2,
                "memory_mib": 1024,
                "uptime_s": 125,
                "held_mib": 143,
                "kept_by": { "holders": ["vmctl up", "shell (pid 7)"] },
                "notes": [],
            }])
        );
        // A workspace whose name is not UTF-8 is listed too.
        let mut odd = running_row("odd-1", "/home/u");
        odd.workspace = Some(PathBuf::from(std::ffi::OsStr::from_bytes(
            b"/home/u/caf\xe9",
        )));
        assert_eq!(
            serde_json::to_value(&odd).unwrap()["workspace"],
            "/home/u/caf\u{fffd}"
        );
        let kept = |kept_by: KeptBy| serde_json::to_value(kept_by).unwrap();
        assert_eq!(kept(KeptBy::NoDaemon), serde_json::json!("no_daemon"));
        assert_eq!(kept(KeptBy::Untracked), serde_json::json!("untracked"));
        assert_eq!(
            kept(KeptBy::Idle { stops_in_s: None }),
            serde_json::json!({ "idle": { "stops_in_s": null } })
        );
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(format_duration(5), "5s");
        assert_eq!(format_duration(125), "2m05s");
        assert_eq!(format_duration(7260), "2h01m");
    }
}
