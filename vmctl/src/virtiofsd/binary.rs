//! Where virtiofsd is: `$VMCTL_VIRTIOFSD`, PATH, `~/.cargo/bin`, the distributions'
//! places.

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::VirtiofsdError;

/// Names the virtiofsd binary, overriding the search.
pub(super) const VIRTIOFSD_ENV: &str = "VMCTL_VIRTIOFSD";
/// Where virtiofsd is looked for after PATH and `~/.cargo/bin` (Debian's and
/// Fedora's packages).
const SYSTEM_VIRTIOFSD: [&str; 2] = ["/usr/libexec/virtiofsd", "/usr/lib/qemu/virtiofsd"];

/// Finds virtiofsd: `$VMCTL_VIRTIOFSD`, else PATH, else `~/.cargo/bin` and the
/// distributions' locations.
pub fn find_virtiofsd() -> Result<PathBuf, VirtiofsdError> {
    find_virtiofsd_in(
        std::env::var_os(VIRTIOFSD_ENV),
        std::env::var_os("PATH"),
        std::env::var_os("HOME"),
        is_executable_file,
    )
}

fn find_virtiofsd_in(
    explicit: Option<OsString>,
    path_var: Option<OsString>,
    home: Option<OsString>,
    is_executable: impl Fn(&Path) -> bool,
) -> Result<PathBuf, VirtiofsdError> {
    if let Some(explicit) = explicit.filter(|p| !p.is_empty()).map(PathBuf::from) {
        // A binary the user named is used or refused, never silently replaced.
        return if is_executable(&explicit) {
            Ok(explicit)
        } else {
            Err(VirtiofsdError::OverrideNotExecutable(explicit))
        };
    }
    let candidates = virtiofsd_candidates(path_var.as_deref(), home.as_deref());
    candidates
        .iter()
        .find(|candidate| is_executable(candidate))
        .cloned()
        .ok_or_else(|| VirtiofsdError::NotFound {
            searched: candidates
                .iter()
                .map(|c| c.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Where virtiofsd may be, in the order to look.
fn virtiofsd_candidates(path_var: Option<&OsStr>, home: Option<&OsStr>) -> Vec<PathBuf> {
    let mut candidates: Vec<PathBuf> = path_var
        .map(|path| {
            std::env::split_paths(path)
                // An empty or relative PATH entry means the current directory: a
                // workspace must not be able to plant the daemon that serves it.
                .filter(|dir| dir.is_absolute())
                .map(|dir| dir.join("virtiofsd"))
                .collect()
        })
        .unwrap_or_default();
    if let Some(home) = home.filter(|h| !h.is_empty()) {
        candidates.push(Path::new(home).join(".cargo/bin/virtiofsd"));
    }
    candidates.extend(SYSTEM_VIRTIOFSD.iter().map(PathBuf::from));
    candidates
}

fn is_executable_file(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_binary_is_looked_for_in_order() {
        let os = |s: &str| Some(OsString::from(s));
        let candidates = virtiofsd_candidates(
            Some(OsStr::new("/a::relative:/b")),
            Some(OsStr::new("/home/u")),
        );
        assert_eq!(
            candidates,
            [
                "/a/virtiofsd",
                "/b/virtiofsd",
                "/home/u/.cargo/bin/virtiofsd",
                "/usr/libexec/virtiofsd",
                "/usr/lib/qemu/virtiofsd"
            ]
            .map(PathBuf::from)
        );
        let only = |wanted: &'static str| move |p: &Path| p == Path::new(wanted);
        assert_eq!(
            find_virtiofsd_in(None, os("/a:/b"), os("/h"), only("/b/virtiofsd")).unwrap(),
            PathBuf::from("/b/virtiofsd")
        );
        assert_eq!(
            find_virtiofsd_in(None, os("/a"), os("/h"), only("/h/.cargo/bin/virtiofsd")).unwrap(),
            PathBuf::from("/h/.cargo/bin/virtiofsd")
        );
        assert_eq!(
            find_virtiofsd_in(os("/x/vfs"), os("/a"), None, only("/x/vfs")).unwrap(),
            PathBuf::from("/x/vfs")
        );
        // A named binary that is missing is an error, not a reason to look elsewhere.
        assert!(matches!(
            find_virtiofsd_in(os("/x/vfs"), os("/a"), None, only("/a/virtiofsd")),
            Err(VirtiofsdError::OverrideNotExecutable(_))
        ));
        let error = find_virtiofsd_in(None, os("/a"), None, |_| false)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("/a/virtiofsd") && error.contains("cargo install virtiofsd"),
            "{error}"
        );
    }
}
