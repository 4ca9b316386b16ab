//! Pseudo file systems (proc, sysfs, the device nodes...): the host kernel's view of
//! itself, which no share may be on, hold, or (the device nodes) lie under.

use std::path::Path;

use super::mounts::{mounts, Mount};
use super::{Naming, Share, ShareError};

/// Where a pseudo file system is, for [`ShareError::PseudoFilesystem`].
pub(super) fn pseudo_place(host: &Path, mount: &Path, fs: &str) -> String {
    if host.starts_with(mount) {
        format!("it is on {fs}")
    } else {
        format!(
            "{} inside it is a mount of {fs} (virtiofsd serves what is mounted inside a \
             share too)",
            mount.display()
        )
    }
}

/// File systems that are the kernel's view of the host rather than files, by
/// `statfs`'s `f_type` and by the name `/proc/self/mountinfo` gives them.
const PSEUDO_FILESYSTEMS: [(u32, &str); 18] = [
    (0x0000_9fa0, "proc"),
    (0x6265_6572, "sysfs"),
    (0x6462_6720, "debugfs"),
    (0x7472_6163, "tracefs"),
    (0x7363_6673, "securityfs"),
    (0x0027_e0eb, "cgroup"),
    (0x6367_7270, "cgroup2"),
    (0xcafe_4a11, "bpf"),
    (0x0000_1cd1, "devpts"),
    (0x6165_676c, "pstore"),
    (0xde5e_81e4, "efivarfs"),
    (0x6265_6570, "configfs"),
    (0x6573_5543, "fusectl"),
    (0x4249_4e4d, "binfmt_misc"),
    (0x1980_0202, "mqueue"),
    (0x6e73_6673, "nsfs"),
    (0xf97c_ff8c, "selinuxfs"),
    (0x4341_5d53, "smackfs"),
];

/// The host's device nodes: a pseudo file system that `statfs` cannot tell from a
/// tmpfs (they share a magic number), known by its name only.
const DEVTMPFS: &str = "devtmpfs";

/// Where the host's device nodes are, and the memory its programs share (`/dev/shm`).
pub(super) const HOST_DEVICES: &str = "/dev";

/// Whether `fs` (a name from mountinfo) is the kernel's view of the host.
fn is_pseudo(fs: &str) -> bool {
    fs == DEVTMPFS || PSEUDO_FILESYSTEMS.iter().any(|(_, name)| *name == fs)
}

/// Refuses a share on a pseudo file system ([`PSEUDO_FILESYSTEMS`], devtmpfs), one
/// with such a file system mounted inside it (virtiofsd serves the mounts inside a
/// share: `/srv/chroot` with the host's proc at `/srv/chroot/proc`), and anything
/// under `/dev`: as root, a guest that could write the host's
/// `/proc/sys/kernel/core_pattern` would run what it likes on the host. A share whose
/// file system cannot be looked at is left to virtiofsd, which says what is wrong
/// with it; where the mounts cannot be read, only the share's own file system is
/// looked at.
pub fn check_not_pseudo_filesystem(share: &Share) -> Result<(), ShareError> {
    check_not_pseudo_in(
        &share.host,
        filesystem_type(&share.host),
        &mounts().unwrap_or_default(),
    )
}

/// [`check_not_pseudo_filesystem`] of the directory `host`, whose file system's
/// `statfs` type is `f_type`, among `mounts`.
fn check_not_pseudo_in(
    host: &Path,
    f_type: Option<u32>,
    mounts: &[Mount],
) -> Result<(), ShareError> {
    let pseudo = |fs: &str, mount: &Path| ShareError::PseudoFilesystem {
        host: host.to_path_buf(),
        fs: fs.to_string(),
        mount: mount.to_path_buf(),
        naming: Naming::Options,
    };
    // The mount the share is on: the last made whose mount point holds it.
    let own = mounts.iter().rev().find(|m| host.starts_with(&m.point));
    let by_magic = f_type.and_then(|f_type| {
        PSEUDO_FILESYSTEMS
            .iter()
            .find(|(magic, _)| *magic == f_type)
            .map(|(_, name)| *name)
    });
    if let Some(name) = by_magic {
        let point = own.map_or(host, |m| m.point.as_path());
        return Err(pseudo(name, point));
    }
    if let Some(own) = own.filter(|m| is_pseudo(&m.fs)) {
        return Err(pseudo(&own.fs, &own.point));
    }
    if host.starts_with(HOST_DEVICES) {
        return Err(ShareError::HostDevices {
            host: host.to_path_buf(),
            fs: own.map(|m| (m.fs.clone(), m.point.clone())),
            naming: Naming::Options,
        });
    }
    match mounts
        .iter()
        .find(|m| m.point != host && m.point.starts_with(host) && is_pseudo(&m.fs))
    {
        Some(inside) => Err(pseudo(&inside.fs, &inside.point)),
        None => Ok(()),
    }
}

/// `statfs(2)`'s `f_type` of the file system `path` is on (magic numbers are 32 bits).
fn filesystem_type(path: &Path) -> Option<u32> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut info = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `path` is NUL-terminated and `info` is a writable statfs buffer, which
    // the call fills when it returns 0.
    if unsafe { libc::statfs(path.as_ptr(), info.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statfs returned 0, so it filled `info`.
    let info = unsafe { info.assume_init() };
    // The kernel's magic numbers fit in 32 bits; f_type's width varies by platform.
    Some(info.f_type as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shares::tests::share;

    /// The kernel's views of the host (proc, sysfs, the device nodes) are no directory
    /// of files to share; a directory of files is.
    #[test]
    fn pseudo_filesystems_are_not_shared() {
        for (host, fs) in [("/proc", "proc"), ("/proc/sys", "proc"), ("/sys", "sysfs")] {
            let error = check_not_pseudo_filesystem(&share(host, "/x")).unwrap_err();
            let message = error.to_string();
            assert!(
                message.starts_with(&format!(
                    "{host} cannot be shared with the guest: it is on {fs}"
                )),
                "{message}"
            );
            assert!(!error.for_agent().to_string().contains("--mount"));
        }
        let error = check_not_pseudo_filesystem(&share("/dev", "/x")).unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("/dev cannot be shared with the guest: it "),
            "{error}"
        );
        assert!(!error.for_agent().to_string().contains("--mount"));
        let dir = tempfile::tempdir().unwrap();
        check_not_pseudo_filesystem(&share(dir.path().to_str().unwrap(), "/x")).unwrap();
    }

    fn mount(point: &str, fs: &str) -> Mount {
        Mount {
            point: point.into(),
            fs: fs.into(),
        }
    }

    /// virtiofsd serves what is mounted inside a share: a pseudo file system mounted
    /// anywhere inside one (a chroot's proc) is refused, named; a share beside it, or
    /// holding only ordinary mounts, is not.
    #[test]
    fn a_pseudo_filesystem_mounted_inside_a_share_is_refused() {
        const EXT4: u32 = 0xef53;
        let mounts = [
            mount("/", "ext4"),
            mount("/proc", "proc"),
            mount("/dev", "devtmpfs"),
            mount("/dev/shm", "tmpfs"),
            mount("/srv/chroot/proc", "proc"),
            mount("/srv/chroot/data", "xfs"),
            mount("/srv/jail/dev", "devtmpfs"),
        ];
        let check = |host: &str| check_not_pseudo_in(Path::new(host), Some(EXT4), &mounts);
        for (host, inside, fs) in [
            ("/srv", "/srv/chroot/proc", "proc"),
            ("/srv/chroot", "/srv/chroot/proc", "proc"),
            ("/srv/jail", "/srv/jail/dev", "devtmpfs"),
        ] {
            let message = check(host).unwrap_err().to_string();
            assert!(
                message.starts_with(&format!(
                    "{host} cannot be shared with the guest: {inside} inside it is a mount \
                     of {fs}"
                )),
                "{message}"
            );
        }
        assert!(check("/srv/chroot/data").is_ok());
        assert!(check("/srv/other").is_ok());
        assert!(
            check("/srv/chroot/procs").is_ok(),
            "a sibling's name, not inside"
        );
        // The share's own mount is known by its name where statfs cannot tell it.
        let message = check("/dev/input").unwrap_err().to_string();
        assert!(message.contains("it is on devtmpfs"), "{message}");
    }

    /// /dev/shm is a tmpfs, not the device nodes: it is refused for what it is.
    #[test]
    fn the_hosts_shared_memory_is_refused_for_what_it_is() {
        const TMPFS: u32 = 0x0102_1994;
        let mounts = [
            mount("/", "ext4"),
            mount("/dev", "devtmpfs"),
            mount("/dev/shm", "tmpfs"),
        ];
        let message = check_not_pseudo_in(Path::new("/dev/shm"), Some(TMPFS), &mounts)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("memory its programs share")
                && message.contains("here tmpfs, mounted at /dev/shm")
                && !message.contains("devtmpfs"),
            "{message}"
        );
    }
}
