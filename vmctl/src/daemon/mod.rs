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

use std::path::PathBuf;

/// The daemon's socket: in the user's runtime directory, named after the state
/// directory it serves (so separate state directories, e.g. tests', get separate
/// daemons).
pub fn socket_path() -> PathBuf {
    let runtime = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .unwrap_or_else(crate::state::private_tmp_dir);
    let state = crate::state::vms_dir();
    let key = crate::state::short_hash(state.as_os_str().as_encoded_bytes());
    runtime.join("vmctl").join(format!("daemon-{key}.sock"))
}

/// The daemon's log when started on demand: beside the VMs' state.
pub fn log_path() -> PathBuf {
    crate::state::vms_dir().with_file_name("daemon.log")
}

/// The running daemon's pid and socket, one per line (removed when it stops).
pub fn pid_path() -> PathBuf {
    crate::state::vms_dir().with_file_name("daemon.pid")
}
