//! What `/proc` says about a VM's processes.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;

/// The proportional set size (KiB) of `pid` and all its descendants: the VMM or the
/// nested host's QEMU, and the virtiofsd daemons. PSS splits the guest memory they
/// share (the memfd virtiofsd maps too) instead of counting it once per process.
pub fn tree_pss_kib(pid: i32) -> Option<u64> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if let Some(parent) = parent_of(child) {
            children.entry(parent).or_default().push(child);
        }
    }
    let mut total = pss_kib(pid)?;
    let mut pending = children.get(&pid).cloned().unwrap_or_default();
    while let Some(next) = pending.pop() {
        total += pss_kib(next).unwrap_or(0);
        pending.extend(children.get(&next).cloned().unwrap_or_default());
    }
    Some(total)
}

/// The parent pid from `/proc/PID/stat` (after the command name, which may contain
/// spaces and parentheses).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_parent(&stat)
}

fn parse_parent(stat: &str) -> Option<i32> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(1)?.parse().ok()
}

fn pss_kib(pid: i32) -> Option<u64> {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    rollup
        .lines()
        .find_map(|line| line.strip_prefix("Pss:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// When process `pid` started, in clock ticks since the host booted: with the pid, it
/// names one process for good (a pid alone may be reused).
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command's name, in parentheses (which may hold anything), field 22 is
    // the 20th.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// Whether process `pid` runs another program than this one: not the same file, nor a
/// copy of it byte for byte (two installs of one build); false when its program cannot
/// be read. A program replaced since the process started (`cargo build` after a pull)
/// is still the one it runs: `/proc/PID/exe` leads to it, deleted or not.
pub fn runs_another_program(pid: i32) -> bool {
    let theirs = std::path::PathBuf::from(format!("/proc/{pid}/exe"));
    pid > 0 && same_file_contents(&theirs, std::path::Path::new("/proc/self/exe")) == Some(false)
}

fn same_file_contents(a: &std::path::Path, b: &std::path::Path) -> Option<bool> {
    let (meta_a, meta_b) = (std::fs::metadata(a).ok()?, std::fs::metadata(b).ok()?);
    if (meta_a.dev(), meta_a.ino()) == (meta_b.dev(), meta_b.ino()) {
        return Some(true);
    }
    if meta_a.len() != meta_b.len() {
        return Some(false);
    }
    let (mut file_a, mut file_b) = (std::fs::File::open(a).ok()?, std::fs::File::open(b).ok()?);
    let (mut chunk_a, mut chunk_b) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    loop {
        let read = file_a.read(&mut chunk_a).ok()?;
        if read == 0 {
            return Some(true);
        }
        file_b.read_exact(&mut chunk_b[..read]).ok()?;
        if chunk_a[..read] != chunk_b[..read] {
            return Some(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_start_time_is_its_own() {
        let ours = start_time(std::process::id() as i32).expect("our own start time");
        let mut child = crate::state::spawn_in_test(std::process::Command::new("sleep").arg("5"));
        let theirs = start_time(child.id() as i32).expect("a child's start time");
        assert!(theirs >= ours, "{theirs} < {ours}");
        assert_eq!(start_time(child.id() as i32), Some(theirs), "stable");
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(start_time(child.id() as i32), None, "reaped");
        assert_eq!(start_time(-1), None);
    }

    #[test]
    fn a_program_is_told_from_a_copy_and_from_another() {
        assert!(!runs_another_program(std::process::id() as i32));
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, bytes: &[u8]| {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            path
        };
        let build = write("vmctl", &[7u8; 200_000]);
        let copy = write("copy", &[7u8; 200_000]);
        let mut changed_at_the_end = vec![7u8; 200_000];
        changed_at_the_end[199_999] = 8;
        let rebuilt = write("rebuilt", &changed_at_the_end);
        let longer = write("longer", &[7u8; 200_001]);
        assert_eq!(same_file_contents(&build, &build), Some(true));
        assert_eq!(same_file_contents(&build, &copy), Some(true));
        assert_eq!(same_file_contents(&build, &rebuilt), Some(false));
        assert_eq!(same_file_contents(&build, &longer), Some(false));
        assert_eq!(same_file_contents(&build, &dir.path().join("gone")), None);
    }

    #[test]
    fn parent_pids_survive_odd_command_names() {
        assert_eq!(parse_parent("42 (a) b) S 7 42 42 0"), Some(7));
        assert_eq!(parse_parent("1 (init) S 0 1 1"), Some(0));
        assert_eq!(parse_parent("garbage"), None);
    }

    #[test]
    fn this_process_holds_memory() {
        let me = std::process::id() as i32;
        assert!(tree_pss_kib(me).is_some_and(|kib| kib > 0));
    }
}
