//! `vmctl ps --json`, as the VM tests and the benchmarks read it.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The fields of one VM of `vmctl ps --json` that tests and benchmarks read (the
/// others are ignored).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PsRow {
    pub name: String,
    /// running, degraded, starting, stopping, removing, stopped, crashed or broken.
    pub state: String,
    /// Unknown (None) for a VM whose record cannot be read.
    pub workspace: Option<PathBuf>,
    /// The host memory its processes hold, while it runs.
    pub held_mib: Option<u64>,
}

impl PsRow {
    /// Whether it runs (a degraded VM runs without one of its shares).
    pub fn is_up(&self) -> bool {
        matches!(self.state.as_str(), "running" | "degraded")
    }
}

/// The VMs `vmctl ps --json` printed.
pub fn parse(json: &str) -> Result<Vec<PsRow>, String> {
    serde_json::from_str(json)
        .map_err(|e| format!("vmctl ps --json printed no list of VMs ({e}):\n{json}"))
}

/// The one row of the VM of `workspace`.
pub fn row_of<'a>(rows: &'a [PsRow], workspace: &Path) -> Result<&'a PsRow, String> {
    let mut of_workspace = rows
        .iter()
        .filter(|row| row.workspace.as_deref() == Some(workspace));
    let row = of_workspace
        .next()
        .ok_or_else(|| format!("vmctl ps lists no VM of {}: {rows:?}", workspace.display()))?;
    match of_workspace.next() {
        None => Ok(row),
        Some(_) => Err(format!(
            "vmctl ps lists two VMs of {}: {rows:?}",
            workspace.display()
        )),
    }
}

/// The host memory the VM of `workspace` holds, in MiB.
pub fn held_mib(rows: &[PsRow], workspace: &Path) -> Result<u64, String> {
    let row = row_of(rows, workspace)?;
    row.held_mib.ok_or_else(|| {
        format!(
            "vmctl ps: the VM of {} holds no memory (it is {})",
            workspace.display(),
            row.state
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PS: &str = r#"[
      {"name": "idle-1-0123abcd", "state": "running", "vm_dir": "/s/idle-1-0123abcd",
       "workspace": "/tmp/a b/idle-1", "workspace_removed": false, "mode": "direct",
       "cpus": 2, "memory_mib": 1024, "uptime_s": 12, "held_mib": 143,
       "kept_by": {"holders": ["vmctl up"]}, "notes": []},
      {"name": "old-89abcdef", "state": "stopped", "vm_dir": "/s/old-89abcdef",
       "workspace": "/tmp/x/old", "workspace_removed": false, "mode": "direct",
       "cpus": 2, "memory_mib": 1024, "uptime_s": null, "held_mib": null,
       "kept_by": null, "notes": []},
      {"name": "new-00000000", "state": "broken", "vm_dir": "/s/new-00000000",
       "workspace": null, "workspace_removed": false, "mode": null, "cpus": null,
       "memory_mib": null, "uptime_s": null, "held_mib": null, "kept_by": null,
       "notes": ["unreadable VM record"]}
    ]"#;

    #[test]
    fn rows_are_found_by_their_whole_workspace_path() {
        let rows = parse(PS).unwrap();
        assert_eq!(rows.len(), 3);
        let first = row_of(&rows, Path::new("/tmp/a b/idle-1")).unwrap();
        assert_eq!(first.name, "idle-1-0123abcd");
        assert!(first.is_up());
        assert_eq!(held_mib(&rows, Path::new("/tmp/a b/idle-1")), Ok(143));
        let stopped = row_of(&rows, Path::new("/tmp/x/old")).unwrap();
        assert!(!stopped.is_up());
        let e = held_mib(&rows, Path::new("/tmp/x/old")).unwrap_err();
        assert!(e.contains("holds no memory (it is stopped)"), "{e}");
        for elsewhere in ["/tmp/x", "/tmp/x/ol", "/tmp/a b", "idle-1"] {
            let e = row_of(&rows, Path::new(elsewhere)).unwrap_err();
            assert!(e.contains("lists no VM of"), "{elsewhere}: {e}");
        }
    }

    #[test]
    fn two_vms_of_one_workspace_or_no_list_are_errors() {
        let rows = parse(PS).unwrap();
        let twice = [rows[0].clone(), rows[0].clone()];
        let e = row_of(&twice, Path::new("/tmp/a b/idle-1")).unwrap_err();
        assert!(e.contains("lists two VMs of /tmp/a b/idle-1"), "{e}");
        assert_eq!(parse("[]"), Ok(Vec::new()));
        for not_a_list in ["", "NAME STATE\n", "{}", r#"[{"name": "x"}]"#] {
            let e = parse(not_a_list).unwrap_err();
            assert!(e.starts_with("vmctl ps --json printed no list"), "{e}");
        }
    }
}
