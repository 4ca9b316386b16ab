//! `vmctl ps`: one line per VM.

use crate::state::{StateError, VmDir};

use super::lock::{
    lifecycle_lock_held, lifecycle_lock_held_for, running_vm_stopped_by, LockHolder,
};

/// `vmctl ps`: one line per VM, with what it holds and what keeps it running.
pub fn list() -> Vec<String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let daemon = crate::daemon::client::status();
    let mut lines = vec![format!(
        "{:<28} {:<8} {:>8} {:<6} {:>4} {:>7} {:>7}  {:<30} WORKSPACE",
        "NAME", "STATE", "UPTIME", "MODE", "CPUS", "MEMORY", "HELD", "KEPT BY"
    )];
    // Why crashed VMs crashed, and why broken ones are, after the table.
    let mut notes = Vec::new();
    let mut of_removed_directories = 0;
    for vm in VmDir::all() {
        let name = vm
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let record = match vm.read_record() {
            Ok(record) => record,
            Err(error) => {
                if let Some((line, note)) = row_without_record(&vm, &name, &error) {
                    lines.push(line);
                    notes.extend(note);
                }
                continue;
            }
        };
        let pid = vm.running_pid();
        let uptime = match pid {
            Some(_) => format_duration(now.saturating_sub(record.started_at)),
            None => "-".into(),
        };
        let (state, crash) = run_state(&vm, pid);
        let held = pid
            .and_then(crate::procfs::tree_pss_kib)
            .map(|kib| format!("{}M", kib / 1024))
            .unwrap_or_else(|| "-".into());
        let kept_by = match (pid, &daemon) {
            (None, _) => "-".to_string(),
            (Some(_), None) => "no daemon".to_string(),
            (Some(_), Some(vms)) => kept_by(vms.iter().find(|v| v.vm_dir == vm.path)),
        };
        // Worktrees come and go (Paseo removes them): their VMs' state stays behind.
        let removed = !record.workspace.exists();
        of_removed_directories += usize::from(removed);
        lines.push(format!(
            "{name:<28} {state:<8} {uptime:>8} {:<6} {:>4} {:>7} {held:>7}  {kept_by:<30} {}{}",
            if record.nested { "nested" } else { "direct" },
            record.cpus,
            format!("{}M", record.memory_mib),
            record.workspace.display(),
            if removed { " (removed)" } else { "" }
        ));
        if let Some(crash) = crash {
            notes.push(format!("{name}: {crash} (its logs: {})", vm.path.display()));
        }
        if let Some(note) = pid.and_then(|pid| another_builds_vm(&name, pid)) {
            notes.push(note);
        }
    }
    if !notes.is_empty() {
        lines.push(String::new());
        lines.extend(notes);
    }
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

/// `vmctl ps`'s note for the VM `name` whose supervisor, `pid`, runs another build of
/// vmctl than this one (started before an upgrade): it keeps that build's ways, its
/// guest agent's protocol among them, until it is started again.
fn another_builds_vm(name: &str, pid: i32) -> Option<String> {
    crate::procfs::runs_another_program(pid).then(|| {
        format!(
            "{name}: started by another build of vmctl (before an upgrade?), whose ways it \
             keeps: `vmctl stop` it and start it again to run this one's"
        )
    })
}

/// `vmctl ps`'s line for `vm`, named `name`, whose record could not be read
/// (`error`), and the note under the table that says why and what to do; no line for
/// a directory without a record and no start under way (`vmctl up` creates the
/// directory, then writes the record: a start refused before that, say for a bad
/// `--mount`, leaves no VM to list).
fn row_without_record(
    vm: &VmDir,
    name: &str,
    error: &StateError,
) -> Option<(String, Option<String>)> {
    if vm.record_path().exists() {
        Some((
            format!("{name:<28} broken"),
            Some(format!("{name}: {error}")),
        ))
    } else if lifecycle_lock_held(vm) {
        Some((format!("{name:<28} starting"), None))
    } else {
        None
    }
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

/// What keeps a VM running, as the daemon sees it.
fn kept_by(status: Option<&crate::daemon::protocol::VmStatus>) -> String {
    let Some(status) = status else {
        return "untracked".into();
    };
    let mut reasons = status.leases.clone();
    if status.pinned {
        reasons.insert(0, "vmctl up".into());
    }
    match (reasons.is_empty(), status.stops_in_s) {
        (false, _) => reasons.join(", "),
        (true, Some(s)) => format!("idle, stops in {s}s"),
        (true, None) => "idle".into(),
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
        assert_eq!(another_builds_vm("app", std::process::id() as i32), None);
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let note = another_builds_vm("app", other.id() as i32);
        let _ = other.kill();
        let _ = other.wait();
        let note = note.expect("a note for a VM of another build");
        assert!(
            note.starts_with("app: started by another build of vmctl"),
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
        let (line, note) = row_without_record(&vm, "app-1234abcd", &error).unwrap();
        assert_eq!(
            line.split_whitespace().collect::<Vec<_>>(),
            ["app-1234abcd", "broken"]
        );
        let note = note.expect("a note under the table");
        assert!(
            note.starts_with("app-1234abcd: ")
                && note.contains(&vm.record_path().display().to_string())
                && note.contains("unreadable VM record")
                && note.contains(&format!("delete {}", vm.path.display())),
            "{note}"
        );
        // The workspace `vmctl rm` needs, from the supervisor's log.
        std::fs::write(
            vm.supervisor_log(),
            "vmctl: supervising the VM of /home/u/app\nvmctl: the VM ended: Ok(0)\n",
        )
        .unwrap();
        let error = vm.read_record().unwrap_err();
        let (_, note) = row_without_record(&vm, "app-1234abcd", &error).unwrap();
        let note = note.unwrap();
        assert!(
            note.contains("remove it with `vmctl rm /home/u/app`"),
            "{note}"
        );
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(format_duration(5), "5s");
        assert_eq!(format_duration(125), "2m05s");
        assert_eq!(format_duration(7260), "2h01m");
    }
}
