//! What `/proc` says about a VM's processes.

use std::collections::HashMap;

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

#[cfg(test)]
mod tests {
    use super::*;

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
