//! The per-user daemon that owns the workspace VMs' lifetimes: sessions (`exec`,
//! `shell`, `agent`) hold a lease on their VM for as long as they run; a VM without
//! leases (and not pinned by `vmctl up`) stops after the idle timeout; when the daemon
//! stops, every VM stops.
//!
//! Clients start the VM themselves (so they show its progress), after taking their
//! lease, and start the daemon on demand. The protocol is one JSON request line per
//! connection; a lease lasts as long as its connection.
//!
//! - [`protocol`]: the requests and answers.
//! - [`client`]: what `vmctl` commands use.
//! - [`server`]: `vmctl daemon`.

pub mod client;
pub mod protocol;
pub mod server;

use std::ffi::OsString;
use std::path::PathBuf;

/// The daemon's socket: in the user's runtime directory, named after the state
/// directory it serves (so separate state directories, e.g. tests', get separate
/// daemons).
pub fn socket_path() -> PathBuf {
    let runtime = runtime_dir(std::env::var_os("XDG_RUNTIME_DIR"));
    let state = crate::state::vms_dir();
    let key = crate::state::short_hash(state.as_os_str().as_encoded_bytes());
    runtime.join("vmctl").join(format!("daemon-{key}.sock"))
}

/// `$XDG_RUNTIME_DIR` (`xdg`) when it is a directory of ours that no one else may
/// write to, else [`crate::state::private_tmp_dir`]. The daemon makes only its own
/// directory in it, and never changes or refuses the runtime directory itself: as
/// root through `su` or `sudo -E` it is still the user's (`/run/user/1000`), and
/// `XDG_RUNTIME_DIR=/tmp` is everyone's.
fn runtime_dir(xdg: Option<OsString>) -> PathBuf {
    xdg.map(PathBuf::from)
        .filter(|dir| dir.is_absolute() && crate::state::is_ours_alone(dir))
        .unwrap_or_else(crate::state::private_tmp_dir)
}

/// The daemon's log when started on demand: beside the VMs' state.
pub fn log_path() -> PathBuf {
    crate::state::vms_dir().with_file_name("daemon.log")
}

/// The running daemon's pid and socket, one per line (removed when it stops).
pub fn pid_path() -> PathBuf {
    crate::state::vms_dir().with_file_name("daemon.pid")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_directory_is_used_only_when_ours_alone() {
        use std::os::unix::fs::PermissionsExt;
        let fallback = crate::state::private_tmp_dir();
        assert_eq!(runtime_dir(None), fallback);
        assert_eq!(runtime_dir(Some("run/user/1000".into())), fallback);
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        assert_eq!(runtime_dir(Some(run.clone().into())), fallback, "missing");
        std::fs::create_dir(&run).unwrap();
        for (mode, ours) in [
            (0o700, true),
            (0o755, true),
            (0o775, false),
            (0o1777, false),
        ] {
            std::fs::set_permissions(&run, std::fs::Permissions::from_mode(mode)).unwrap();
            let expected = if ours { &run } else { &fallback };
            assert_eq!(&runtime_dir(Some(run.clone().into())), expected, "{mode:o}");
        }
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
        // As root through sudo -E: the user's runtime directory, which is not root's.
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            vm_tests::not_run(
                "daemon::tests::the_runtime_directory_is_used_only_when_ours_alone, \
                 another user's",
                "giving a directory to another user needs root",
            );
            return;
        }
        std::os::unix::fs::chown(&run, Some(4242), Some(4242)).unwrap();
        assert_eq!(runtime_dir(Some(run.into())), fallback, "another user's");
    }
}
