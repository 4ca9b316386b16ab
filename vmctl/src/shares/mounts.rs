//! This process's mounts, as `/proc/self/mountinfo` gives them: which file systems
//! are where (the shares' checks), and whether a workspace's volume is still mounted
//! (`vmctl prune`).

use std::path::{Path, PathBuf};

/// One line of `/proc/self/mountinfo`: where a file system is mounted, and its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Mount {
    pub(super) point: PathBuf,
    pub(super) fs: String,
}

/// This process's mounts, in the order they were made (a later one over an earlier);
/// None if they cannot be read.
pub(super) fn mounts() -> Option<Vec<Mount>> {
    // Bytes, not text: a mount point or source need not be UTF-8 (a Latin-1 label
    // under /media), and one such line must not hide all the others.
    let table = std::fs::read("/proc/self/mountinfo").ok()?;
    Some(
        table
            .split(|byte| *byte == b'\n')
            .filter_map(parse_mountinfo_line)
            .collect(),
    )
}

/// `ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER_OPTIONS`,
/// with space, tab, newline and backslash in paths written as octal escapes.
fn parse_mountinfo_line(line: &[u8]) -> Option<Mount> {
    let mut fields = line.split(|byte| *byte == b' ');
    let point = fields.nth(4)?;
    let fs = fields.skip_while(|field| *field != b"-").nth(1)?;
    Some(Mount {
        point: PathBuf::from(std::ffi::OsString::from(
            <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&unescape_octal(point)),
        )),
        fs: String::from_utf8_lossy(fs).into_owned(),
    })
}

/// `bytes` with each `\NNN` (three octal digits) replaced by that byte.
fn unescape_octal(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let digits = bytes.get(i + 1..i + 4);
        let value = digits
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)))
            .and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        match value {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    out
}

/// The mount point of the file system `path` (absolute, links resolved) is on: the
/// longest mount point it lies under. None if the mounts cannot be read.
pub fn mount_point_of(path: &Path) -> Option<PathBuf> {
    longest_mount_point(path, &mounts()?)
}

fn longest_mount_point(path: &Path, mounts: &[Mount]) -> Option<PathBuf> {
    mounts
        .iter()
        .map(|mount| &mount.point)
        .filter(|point| path.starts_with(point))
        .max_by_key(|point| point.components().count())
        .cloned()
}

/// Whether something is mounted on `point`; None if the mounts cannot be read.
pub fn is_mounted(point: &Path) -> Option<bool> {
    Some(mounts()?.iter().any(|mount| mount.point == point))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(point: &str, fs: &str) -> Mount {
        Mount {
            point: point.into(),
            fs: fs.into(),
        }
    }

    #[test]
    fn mountinfo_lines_give_the_mount_point_and_type() {
        assert_eq!(
            parse_mountinfo_line(
                b"36 35 98:0 /mnt1 /mnt/my\\040dir rw,noatime master:1 shared:2 - proc proc rw"
            ),
            Some(mount("/mnt/my dir", "proc"))
        );
        assert_eq!(
            parse_mountinfo_line(b"25 1 0:22 / /sys rw,nosuid - sysfs sysfs rw"),
            Some(mount("/sys", "sysfs"))
        );
        // (Review: the table was read as text, so one such line hid every mount.)
        let latin1 = parse_mountinfo_line(b"40 1 8:17 / /media/caf\xe9 rw - vfat /dev/sdb1 rw")
            .expect("a mount point that is not UTF-8");
        assert_eq!(
            std::os::unix::ffi::OsStrExt::as_bytes(latin1.point.as_os_str()),
            b"/media/caf\xe9"
        );
        assert_eq!(parse_mountinfo_line(b"garbage"), None);
        assert_eq!(unescape_octal(b"a\\134b\\01"), b"a\\b\\01");
    }

    #[test]
    fn a_path_is_on_the_longest_mount_point_above_it() {
        let mounts = [
            mount("/", "ext4"),
            mount("/mnt/usb", "vfat"),
            mount("/mnt", "tmpfs"),
        ];
        let on = |path: &str| longest_mount_point(Path::new(path), &mounts);
        assert_eq!(on("/mnt/usb/work/ws"), Some("/mnt/usb".into()));
        assert_eq!(
            on("/mnt/usbkey/ws"),
            Some("/mnt".into()),
            "not a path prefix"
        );
        assert_eq!(on("/home/u/ws"), Some("/".into()));
    }

    /// This process's root is mounted, and a directory made here is not a mount point.
    #[test]
    fn the_mounts_know_the_root() {
        assert_eq!(is_mounted(Path::new("/")), Some(true));
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(is_mounted(dir.path()), Some(false));
    }
}
