//! virtio-fs shares: the `vmctl.share=TAG:PATH[:ro]` kernel parameter (built by
//! `vmctl` on the host, parsed by the guest's init) and mounting a share in the guest.
//!
//! - TAG is the virtio-fs tag: 1 to 36 bytes of `[A-Za-z0-9_.-]`.
//! - PATH is the absolute mount point in the guest, percent-encoded over its raw bytes:
//!   every byte outside `[A-Za-z0-9/._+,@=~-]` is written `%XX` (uppercase hex), so
//!   the value never holds a space, a `:` or a `%` of the path itself, and paths need
//!   not be UTF-8.
//! - `:ro` mounts the share read-only.
//!
//! The parameter may be given several times; the guest mounts the shares in order.

use std::ffi::{CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Component, Path, PathBuf};

/// The kernel command-line key of a share.
pub const CMDLINE_KEY: &str = "vmctl.share";

/// The longest tag the virtio-fs configuration space holds.
pub const MAX_TAG_LEN: usize = 36;

/// The suffix that makes a share read-only.
const RO_FLAG: &str = "ro";

/// One virtio-fs share to mount in the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareMount {
    /// The virtio-fs tag of the device.
    pub tag: String,
    /// The absolute mount point in the guest.
    pub path: PathBuf,
    /// Mount read-only.
    pub read_only: bool,
}

/// Errors of parsing or mounting a share.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    #[error("invalid share '{value}': expected TAG:PATH or TAG:PATH:ro")]
    Format { value: String },
    #[error("invalid share '{value}': the option '{option}' is unknown, expected 'ro'")]
    Option { value: String, option: String },
    #[error(
        "invalid share tag '{tag}': expected 1 to {MAX_TAG_LEN} characters of A-Z a-z 0-9 _ . -"
    )]
    Tag { tag: String },
    #[error("invalid share path '{path}': {reason}")]
    Path { path: String, reason: &'static str },
    #[error("cannot create the mount point {path} of virtio-fs tag '{tag}': {source}")]
    MountPoint {
        tag: String,
        path: String,
        source: std::io::Error,
    },
    #[error("cannot mount virtio-fs tag '{tag}' on {path}: {source}")]
    Mount {
        tag: String,
        path: String,
        source: std::io::Error,
    },
}

/// Whether `b` is written as itself in an encoded path.
fn is_plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"/._+,@=~-".contains(&b)
}

/// Percent-encodes the raw bytes of `path` (see the module documentation).
pub fn encode_path(path: &Path) -> String {
    let mut out = String::with_capacity(path.as_os_str().len());
    for &b in path.as_os_str().as_bytes() {
        if is_plain(b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'A'..=b'F' => Some(b - b'A' + 10),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    }
}

/// Decodes a path written by [`encode_path`] and checks it is a usable mount point:
/// absolute, not `/` itself, without `..` components and without NUL bytes.
pub fn decode_path(text: &str) -> Result<PathBuf, ShareError> {
    let err = |reason| ShareError::Path {
        path: text.to_string(),
        reason,
    };
    let src = text.as_bytes();
    let mut bytes = Vec::with_capacity(src.len());
    let mut i = 0;
    while i < src.len() {
        let b = src[i];
        if b == b'%' {
            let hi = src.get(i + 1).copied().and_then(hex_digit);
            let lo = src.get(i + 2).copied().and_then(hex_digit);
            let (Some(hi), Some(lo)) = (hi, lo) else {
                return Err(err("expected two hex digits after each '%'"));
            };
            bytes.push(hi << 4 | lo);
            i += 3;
        } else if is_plain(b) {
            bytes.push(b);
            i += 1;
        } else {
            return Err(err(
                "expected only A-Z a-z 0-9 / . _ + , @ = ~ - and %XX escapes",
            ));
        }
    }
    if bytes.contains(&0) {
        return Err(err("expected a path without NUL bytes (%00)"));
    }
    let path = PathBuf::from(OsStr::from_bytes(&bytes));
    if !path.is_absolute() {
        return Err(err("expected an absolute path"));
    }
    if path.components().any(|c| c == Component::ParentDir) {
        return Err(err("expected a path without '..' components"));
    }
    if path
        .components()
        .all(|c| matches!(c, Component::RootDir | Component::CurDir))
    {
        return Err(err("expected a directory below '/', not '/' itself"));
    }
    Ok(path)
}

fn valid_tag(tag: &str) -> bool {
    (1..=MAX_TAG_LEN).contains(&tag.len())
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

impl ShareMount {
    /// The value of the `vmctl.share=` parameter: `TAG:ENCODED_PATH[:ro]`.
    pub fn to_cmdline_value(&self) -> String {
        let mut value = format!("{}:{}", self.tag, encode_path(&self.path));
        if self.read_only {
            value.push(':');
            value.push_str(RO_FLAG);
        }
        value
    }

    /// Parses the value of a `vmctl.share=` parameter (without the key).
    pub fn parse(value: &str) -> Result<Self, ShareError> {
        // The encoded path never holds a raw ':', so the fields split unambiguously.
        let mut fields = value.split(':');
        let (Some(tag), Some(path)) = (fields.next(), fields.next()) else {
            return Err(ShareError::Format {
                value: value.to_string(),
            });
        };
        let read_only = match (fields.next(), fields.next()) {
            (None, _) => false,
            (Some(RO_FLAG), None) => true,
            (Some(option), None) => {
                return Err(ShareError::Option {
                    value: value.to_string(),
                    option: option.to_string(),
                })
            }
            (Some(_), Some(_)) => {
                return Err(ShareError::Format {
                    value: value.to_string(),
                })
            }
        };
        if !valid_tag(tag) {
            return Err(ShareError::Tag {
                tag: tag.to_string(),
            });
        }
        Ok(Self {
            tag: tag.to_string(),
            path: decode_path(path)?,
            read_only,
        })
    }
}

/// The read-ahead of a share, in KiB. With the kernel's default of 128 KiB, a
/// sequential read costs one FUSE round trip per 128 KiB; a larger window lets the page
/// cache send FUSE's largest requests (1 MiB), several at a time. Measured in the
/// nested host (64 MiB `dd` after dropping the caches): ~70 MiB/s at 128 KiB, ~135 at
/// 1 MiB, ~200 at 4 MiB, little more at 8 or 16 MiB. Reads that are not sequential are
/// unaffected: the kernel grows the window only on sequential hits.
pub const READ_AHEAD_KIB: u32 = 4096;

/// Sets the read-ahead of the file system mounted at `path` (through its backing
/// device's entry in sysfs).
pub fn set_read_ahead(path: &Path, kib: u32) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path)?.dev();
    let setting = format!(
        "/sys/class/bdi/{}:{}/read_ahead_kb",
        libc::major(dev),
        libc::minor(dev)
    );
    std::fs::write(&setting, kib.to_string())
        .map_err(|e| std::io::Error::new(e.kind(), format!("{setting}: {e}")))
}

/// The user whose home the shares' missing parents below it are made for.
#[derive(Debug, Clone, Copy)]
pub struct HomeOwner<'a> {
    pub home: &'a Path,
    pub uid: u32,
    pub gid: u32,
}

/// Makes `path` and its missing parents (mode 0755, like `mkdir -p`); those below
/// `owner`'s home are the owner's, as they would be had the user made them: a
/// workspace at `~/src/proj` left `~/src` root's, and `--mount ~/.cache/x` left
/// `~/.cache` root's, where the user's tools write.
fn make_mount_point(path: &Path, owner: Option<HomeOwner>) -> std::io::Result<()> {
    let missing: Vec<&Path> = path
        .ancestors()
        .take_while(|dir| std::fs::symlink_metadata(dir).is_err())
        .collect();
    for dir in missing.into_iter().rev() {
        match std::fs::DirBuilder::new().mode(0o755).create(dir) {
            Ok(()) => {}
            // Made meanwhile (a share inside another): as good.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
        if let Some(owner) = owner.filter(|owner| dir.starts_with(owner.home) && dir != owner.home)
        {
            std::os::unix::fs::lchown(dir, Some(owner.uid), Some(owner.gid))?;
        }
    }
    if !path.is_dir() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotADirectory,
            "not a directory",
        ));
    }
    Ok(())
}

/// Mounts `share` (in the guest, as root): makes the mount point and its missing
/// parents (mode 0755, like `mkdir -p`; those below `owner`'s home are the owner's),
/// then mounts the virtio-fs tag there with `nodev,nosuid` (and `ro` for a read-only
/// share).
pub fn mount_share(share: &ShareMount, owner: Option<HomeOwner>) -> Result<(), ShareError> {
    let path_text = || share.path.display().to_string();
    make_mount_point(&share.path, owner).map_err(|source| ShareError::MountPoint {
        tag: share.tag.clone(),
        path: path_text(),
        source,
    })?;
    let mount_err = |source| ShareError::Mount {
        tag: share.tag.clone(),
        path: path_text(),
        source,
    };
    let nul = || std::io::Error::from(std::io::ErrorKind::InvalidInput);
    let source = CString::new(share.tag.as_bytes()).map_err(|_| mount_err(nul()))?;
    let target = CString::new(share.path.as_os_str().as_bytes()).map_err(|_| mount_err(nul()))?;
    let fstype = c"virtiofs";
    let mut flags = libc::MS_NODEV | libc::MS_NOSUID;
    if share.read_only {
        flags |= libc::MS_RDONLY;
    }
    // SAFETY: source, target and fstype are NUL-terminated strings that outlive the
    // call; a null data pointer means "no options", which mount(2) accepts.
    let r = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            std::ptr::null(),
        )
    };
    if r < 0 {
        return Err(mount_err(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(tag: &str, path: &[u8], read_only: bool) -> ShareMount {
        ShareMount {
            tag: tag.into(),
            path: PathBuf::from(OsStr::from_bytes(path)),
            read_only,
        }
    }

    #[test]
    fn encodes_only_unsafe_bytes() {
        assert_eq!(
            encode_path(Path::new("/home/a-b/x_y.z+1,2@3=4~5")),
            "/home/a-b/x_y.z+1,2@3=4~5"
        );
        assert_eq!(encode_path(Path::new("/a b:c%d")), "/a%20b%3Ac%25d");
        assert_eq!(
            encode_path(Path::new(OsStr::from_bytes(b"/\xff\n\"'"))),
            "/%FF%0A%22%27"
        );
        assert_eq!(encode_path(Path::new("/é")), "/%C3%A9");
    }

    #[test]
    fn round_trips_odd_paths() {
        let paths: [&[u8]; 8] = [
            b"/home/alice/project",
            b"/home/alice/my project",
            b"/srv/a:b:ro",
            b"/srv/100%/%41%",
            b"/srv/\xff\xfe-not-utf8/\x80",
            "/home/zoë/日本語 ✓".as_bytes(),
            b"/tab\there/new\nline/quote\"/back\\slash/#?&*",
            b"/trailing/",
        ];
        for p in paths {
            let path = Path::new(OsStr::from_bytes(p));
            let enc = encode_path(path);
            assert!(
                enc.bytes().all(|b| is_plain(b) || b == b'%'),
                "{enc} has a raw unsafe byte"
            );
            assert_eq!(decode_path(&enc).unwrap(), path, "{enc}");
            for ro in [false, true] {
                let s = share("ws_1.a-b", p, ro);
                let value = s.to_cmdline_value();
                assert!(!value.contains(char::is_whitespace), "{value}");
                assert_eq!(ShareMount::parse(&value).unwrap(), s, "{value}");
            }
        }
    }

    #[test]
    fn cmdline_value_format() {
        assert_eq!(
            share("ws", b"/home/a b", false).to_cmdline_value(),
            "ws:/home/a%20b"
        );
        assert_eq!(
            share("ws", b"/home/a", true).to_cmdline_value(),
            "ws:/home/a:ro"
        );
    }

    #[test]
    fn parses_ro_flag() {
        assert_eq!(
            ShareMount::parse("ws:/w:ro").unwrap(),
            share("ws", b"/w", true)
        );
        assert_eq!(
            ShareMount::parse("ws:/w").unwrap(),
            share("ws", b"/w", false)
        );
        // A literal ":ro" at the end of the path is encoded; it is not the flag.
        let s = ShareMount::parse("ws:/w%3Aro").unwrap();
        assert_eq!(s, share("ws", b"/w:ro", false));
        assert_eq!(
            ShareMount::parse("ws:/w%3Aro:ro").unwrap(),
            share("ws", b"/w:ro", true)
        );
        assert_eq!(
            share("ws", b"/w:ro", false).to_cmdline_value(),
            "ws:/w%3Aro"
        );
    }

    #[test]
    fn rejects_bad_values() {
        for value in ["", "ws", "ws:/a:ro:ro", "ws:/a:b:c"] {
            assert!(
                matches!(ShareMount::parse(value), Err(ShareError::Format { .. })),
                "{value}"
            );
        }
        for value in ["ws:/a:rw", "ws:/a:RO", "ws:/a:", "ws:/a: ro"] {
            let err = ShareMount::parse(value).unwrap_err();
            assert!(matches!(err, ShareError::Option { .. }), "{value}: {err}");
        }
        let err = ShareMount::parse("ws:/a:rw").unwrap_err().to_string();
        assert!(err.contains("ws:/a:rw") && err.contains("'ro'"), "{err}");
    }

    #[test]
    fn validates_tags() {
        let max = "a".repeat(MAX_TAG_LEN);
        for tag in ["a", "ws", "A-z_0.9", max.as_str()] {
            let value = format!("{tag}:/w");
            assert_eq!(ShareMount::parse(&value).unwrap().tag, tag);
        }
        let long = "a".repeat(MAX_TAG_LEN + 1);
        for tag in ["", "a b", "a/b", "a%20", "ü", "a=b", long.as_str()] {
            let value = format!("{tag}:/w");
            let err = ShareMount::parse(&value).unwrap_err();
            assert!(matches!(err, ShareError::Tag { .. }), "{value}: {err}");
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("'{tag}'")) && msg.contains("expected"),
                "{msg}"
            );
        }
    }

    #[test]
    fn rejects_bad_paths() {
        let cases = [
            ("/a%", "hex digits"),
            ("/a%4", "hex digits"),
            ("/a%G1", "hex digits"),
            ("/a%%41", "hex digits"),
            ("/a b", "expected only"),
            ("/a:b", "expected only"),
            ("/ü", "expected only"),
            ("relative/path", "absolute"),
            ("", "absolute"),
            ("%2Fa%00b", "NUL"),
            ("/a/../b", ".."),
            ("/..", ".."),
            ("/a/%2E%2E", ".."),
            ("/", "'/'"),
            ("//", "'/'"),
            ("/./", "'/'"),
            ("%2F", "'/'"),
        ];
        for (text, why) in cases {
            let err = decode_path(text).unwrap_err();
            assert!(matches!(err, ShareError::Path { .. }), "{text}: {err}");
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("'{text}'")) && msg.contains(why),
                "{text}: {msg}"
            );
            // The same rejection through the parameter parser.
            assert!(ShareMount::parse(&format!("ws:{text}")).is_err(), "{text}");
        }
        // Lowercase escapes and '.' components are accepted.
        assert_eq!(decode_path("/a%3a/./b").unwrap(), Path::new("/a:/./b"));
        assert_eq!(decode_path("/a/..b/").unwrap(), Path::new("/a/..b/"));
    }

    #[test]
    fn mount_share_creates_the_mount_point_and_reports_failure() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("a b/c:d");
        let s = ShareMount {
            // No such device exists, so the mount fails whether or not we are root.
            tag: "vmctl-test-no-such-tag".into(),
            path: target.clone(),
            read_only: true,
        };
        let err = mount_share(&s, None).unwrap_err();
        assert!(target.is_dir(), "the mount point was not created");
        assert!(matches!(err, ShareError::Mount { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("'vmctl-test-no-such-tag'") && msg.contains(&target.display().to_string()),
            "{msg}"
        );
        // An existing directory is fine; a file in the way is not.
        assert!(matches!(
            mount_share(&s, None),
            Err(ShareError::Mount { .. })
        ));
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        let err = mount_share(
            &ShareMount {
                path: file.join("sub"),
                ..s
            },
            None,
        )
        .unwrap_err();
        assert!(matches!(err, ShareError::MountPoint { .. }), "{err}");
        assert!(err.to_string().contains("file/sub"), "{err}");
    }

    /// The parents made below the user's home are the user's; the home itself, and
    /// those outside it, root's.
    #[test]
    fn a_mount_points_parents_in_the_home_are_the_users() {
        use std::os::unix::fs::MetadataExt;
        // SAFETY: geteuid touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            crate::not_run(
                "shares::tests::a_mount_points_parents_in_the_home_are_the_users",
                "handing directories to another user needs root",
            );
            return;
        }
        const USER: u32 = 65534;
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home/alice");
        std::fs::create_dir_all(&home).unwrap();
        let owner = HomeOwner {
            home: &home,
            uid: USER,
            gid: USER,
        };
        make_mount_point(&home.join("src/proj"), Some(owner)).unwrap();
        make_mount_point(&dir.path().join("work/main"), Some(owner)).unwrap();
        let owner_of = |path: &Path| {
            let meta = std::fs::metadata(path).unwrap();
            (meta.uid(), meta.gid())
        };
        assert_eq!(owner_of(&home.join("src")), (USER, USER));
        assert_eq!(owner_of(&home.join("src/proj")), (USER, USER));
        assert_eq!(owner_of(&home), (0, 0));
        assert_eq!(owner_of(&dir.path().join("work")), (0, 0));
        assert_eq!(owner_of(&dir.path().join("work/main")), (0, 0));
    }
}
