//! Where virtiofsd is: `$VMCTL_VIRTIOFSD`, PATH, `~/.cargo/bin`, the distributions'
//! places; and whether it is recent enough ([`MIN_VERSION`]).

use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::VirtiofsdError;

/// The oldest virtiofsd vmctl runs. Without its sandbox virtiofsd is given the share
/// as ".", the directory vmctl starts it in (entered by a descriptor): from 1.14.0 on
/// it opens "." at each mount by the guest; older releases made the path absolute as
/// they started and opened that name again at each mount, so a directory on it
/// swapped for a link since (by another VM's guest) changed what they served.
pub(super) const MIN_VERSION: Version = Version(1, 14, 0);

/// How long `virtiofsd --version` may take.
const VERSION_TIMEOUT: Duration = Duration::from_secs(10);

/// A virtiofsd release: major, minor, patch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Version(u32, u32, u32);

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// The release in the Rust virtiofsd's `--version` line (`virtiofsd 1.14.0`); None
/// for anything else (QEMU's older C virtiofsd says `virtiofsd version 7.2.0 ...`).
fn parse_version(line: &str) -> Option<Version> {
    let number = line.trim().strip_prefix("virtiofsd ")?;
    let mut parts = number.splitn(3, '.').map(|part| {
        let digits = part
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(part.len());
        part[..digits].parse::<u32>().ok()
    });
    Some(Version(parts.next()??, parts.next()??, parts.next()??))
}

/// Why `binary` will not do, if it will not: it must say it is the Rust virtiofsd,
/// [`MIN_VERSION`] or later. `version_of` runs it with `--version`.
fn unsuitable(
    binary: &Path,
    version_of: &impl Fn(&Path) -> Result<String, String>,
) -> Option<String> {
    let said = match version_of(binary) {
        Ok(said) => said,
        Err(why) => return Some(format!("{}: {why}", binary.display())),
    };
    match parse_version(&said) {
        Some(version) if version >= MIN_VERSION => None,
        Some(version) => Some(format!("{} is virtiofsd {version}", binary.display())),
        None => Some(format!(
            "{} says {said:?} to --version, which is not the Rust virtiofsd (QEMU's older \
             C virtiofsd, perhaps)",
            binary.display()
        )),
    }
}

/// The first line `binary --version` prints, within [`VERSION_TIMEOUT`].
fn version_line(binary: &Path) -> Result<String, String> {
    let mut child = Command::new(binary)
        .arg("--version")
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // Why it cannot run ("error while loading shared libraries: libseccomp.so.2"
        // after a distribution upgrade) is the one thing worth saying then.
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run it with --version: {e}"))?;
    let deadline = Instant::now() + VERSION_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            // Every VM start waits on this: it answers in a few ms.
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "--version did not answer within {} s",
                    VERSION_TIMEOUT.as_secs()
                ));
            }
            Err(e) => return Err(format!("waiting for its --version: {e}")),
        }
    };
    let mut said = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        // Bounded: a version is a line, and a binary that prints more is not virtiofsd.
        let _ = stdout.by_ref().take(4096).read_to_string(&mut said);
    }
    if !status.success() {
        let mut complaint = String::new();
        if let Some(mut stderr) = child.stderr.take() {
            let _ = stderr.by_ref().take(4096).read_to_string(&mut complaint);
        }
        return Err(
            match complaint.lines().map(str::trim).find(|l| !l.is_empty()) {
                Some(first) => format!("--version failed ({status}: {first}): it cannot run"),
                None => format!("--version failed ({status})"),
            },
        );
    }
    Ok(said.lines().next().unwrap_or_default().trim().to_string())
}

/// Names the virtiofsd binary, overriding the search.
pub(super) const VIRTIOFSD_ENV: &str = "VMCTL_VIRTIOFSD";
/// Where virtiofsd is looked for after PATH and `~/.cargo/bin` (Debian's and
/// Fedora's packages).
const SYSTEM_VIRTIOFSD: [&str; 2] = ["/usr/libexec/virtiofsd", "/usr/lib/qemu/virtiofsd"];

/// Finds virtiofsd: `$VMCTL_VIRTIOFSD`, else PATH, else `~/.cargo/bin` and the
/// distributions' locations.
/// One that is [`MIN_VERSION`] or later: a place that holds an older one is passed
/// over, and named in the error if no place holds a recent one.
pub fn find_virtiofsd() -> Result<PathBuf, VirtiofsdError> {
    find_virtiofsd_in(
        std::env::var_os(VIRTIOFSD_ENV),
        std::env::var_os("PATH"),
        std::env::var_os("HOME"),
        is_executable_file,
        version_line,
    )
}

fn find_virtiofsd_in(
    explicit: Option<OsString>,
    path_var: Option<OsString>,
    home: Option<OsString>,
    is_executable: impl Fn(&Path) -> bool,
    version_of: impl Fn(&Path) -> Result<String, String>,
) -> Result<PathBuf, VirtiofsdError> {
    if let Some(explicit) = explicit.filter(|p| !p.is_empty()).map(PathBuf::from) {
        // A binary the user named is used or refused, never silently replaced.
        if !is_executable(&explicit) {
            return Err(VirtiofsdError::OverrideNotExecutable(explicit));
        }
        return match unsuitable(&explicit, &version_of) {
            None => Ok(explicit),
            Some(found) => Err(VirtiofsdError::TooOld { found }),
        };
    }
    let candidates = virtiofsd_candidates(path_var.as_deref(), home.as_deref());
    let mut passed_over = Vec::new();
    for candidate in candidates.iter().filter(|c| is_executable(c)) {
        match unsuitable(candidate, &version_of) {
            None => return Ok(candidate.clone()),
            Some(found) => passed_over.push(found),
        }
    }
    if !passed_over.is_empty() {
        return Err(VirtiofsdError::TooOld {
            found: passed_over.join("; "),
        });
    }
    Err(VirtiofsdError::NotFound {
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
        let recent = |_: &Path| Ok("virtiofsd 1.14.0".to_string());
        assert_eq!(
            find_virtiofsd_in(None, os("/a:/b"), os("/h"), only("/b/virtiofsd"), recent).unwrap(),
            PathBuf::from("/b/virtiofsd")
        );
        assert_eq!(
            find_virtiofsd_in(
                None,
                os("/a"),
                os("/h"),
                only("/h/.cargo/bin/virtiofsd"),
                recent
            )
            .unwrap(),
            PathBuf::from("/h/.cargo/bin/virtiofsd")
        );
        assert_eq!(
            find_virtiofsd_in(os("/x/vfs"), os("/a"), None, only("/x/vfs"), recent).unwrap(),
            PathBuf::from("/x/vfs")
        );
        // A named binary that is missing is an error, not a reason to look elsewhere.
        assert!(matches!(
            find_virtiofsd_in(os("/x/vfs"), os("/a"), None, only("/a/virtiofsd"), recent),
            Err(VirtiofsdError::OverrideNotExecutable(_))
        ));
        let error = find_virtiofsd_in(None, os("/a"), None, |_| false, recent)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("/a/virtiofsd") && error.contains("cargo install virtiofsd"),
            "{error}"
        );
    }

    #[test]
    fn versions_are_read_from_the_rust_virtiofsds_line() {
        assert_eq!(parse_version("virtiofsd 1.14.0\n"), Some(Version(1, 14, 0)));
        assert_eq!(parse_version("virtiofsd 1.13.3"), Some(Version(1, 13, 3)));
        assert_eq!(parse_version("virtiofsd 2.0.0-rc1"), Some(Version(2, 0, 0)));
        for other in [
            "virtiofsd version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)",
            "virtiofsd 1.14",
            "virtiofsd x.y.z",
            "",
        ] {
            assert_eq!(parse_version(other), None, "{other:?}");
        }
        assert!(Version(1, 14, 0) >= MIN_VERSION && Version(1, 13, 9) < MIN_VERSION);
        assert!(Version(2, 0, 0) > Version(1, 99, 99));
    }

    /// A virtiofsd older than [`MIN_VERSION`] (or QEMU's C one) is passed over for a
    /// recent one further down the search, and refused, saying what to install, when
    /// it is the only one or the one named.
    #[test]
    fn an_old_virtiofsd_is_passed_over_or_refused() {
        let os = |s: &str| Some(OsString::from(s));
        let versions = |p: &Path| match p.to_str() {
            Some("/a/virtiofsd") => Ok("virtiofsd 1.13.2".to_string()),
            Some("/usr/libexec/virtiofsd") => Ok("virtiofsd version 7.2.22 (Debian)".into()),
            Some("/h/.cargo/bin/virtiofsd") => Ok("virtiofsd 1.14.0".to_string()),
            _ => Err("cannot run it with --version: No such file".to_string()),
        };
        let exists = |p: &Path| {
            [
                "/a/virtiofsd",
                "/usr/libexec/virtiofsd",
                "/h/.cargo/bin/virtiofsd",
            ]
            .contains(&p.to_str().unwrap_or_default())
        };
        assert_eq!(
            find_virtiofsd_in(None, os("/a"), os("/h"), exists, versions).unwrap(),
            PathBuf::from("/h/.cargo/bin/virtiofsd")
        );
        let error = find_virtiofsd_in(None, os("/a"), os("/nowhere"), exists, versions)
            .unwrap_err()
            .to_string();
        for needed in [
            "/a/virtiofsd is virtiofsd 1.13.2",
            "/usr/libexec/virtiofsd says",
            "not the Rust virtiofsd",
            "1.14.0 or later",
            "cargo install",
            VIRTIOFSD_ENV,
        ] {
            assert!(error.contains(needed), "{needed}: {error}");
        }
        let named = find_virtiofsd_in(os("/a/virtiofsd"), None, os("/h"), exists, versions);
        assert!(
            matches!(&named, Err(VirtiofsdError::TooOld { found }) if found.contains("1.13.2")),
            "{named:?}"
        );
    }

    /// The version is asked of the binary itself.
    #[test]
    fn the_version_is_what_the_binary_says() {
        let dir = tempfile::tempdir().unwrap();
        let script = |name: &str, body: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            path
        };
        let fake = script(
            "virtiofsd",
            "[ \"$1\" = --version ] && echo 'virtiofsd 1.14.2'",
        );
        assert_eq!(version_line(&fake).unwrap(), "virtiofsd 1.14.2");
        let failing = script("failing", "exit 3");
        assert!(version_line(&failing)
            .unwrap_err()
            .contains("exit status: 3"));
        // One that cannot run says why (a shared library gone after an upgrade).
        let broken = script(
            "broken",
            "echo 'virtiofsd: error while loading shared libraries: libseccomp.so.2' >&2\nexit 127",
        );
        let why = version_line(&broken).unwrap_err();
        assert!(why.contains("exit status: 127: virtiofsd: error while loading shared libraries: libseccomp.so.2"), "{why}");
    }
}
