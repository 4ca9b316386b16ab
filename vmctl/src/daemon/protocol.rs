//! Daemon requests and answers: one JSON line each way per connection.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Keep the VM in `vm_dir` running while this connection stays open. `purpose`
    /// says what for (`agent claude`, `exec`, `shell`), for `vmctl ps`.
    Lease {
        vm_dir: PathBuf,
        purpose: String,
        pid: u32,
    },
    /// Keep the VM running until `Unpin` (`vmctl up` … `vmctl stop`).
    Pin {
        vm_dir: PathBuf,
    },
    Unpin {
        vm_dir: PathBuf,
    },
    /// What keeps each VM running.
    Status,
    /// Stop every VM, then the daemon.
    Shutdown,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Response {
    Ok,
    Status {
        vms: Vec<VmStatus>,
    },
    Error {
        message: String,
    },
    /// The daemon is stopping every VM, then itself: ask the next one, once this one is
    /// gone (its socket with it).
    Stopping,
}

/// One VM the daemon knows about.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmStatus {
    pub vm_dir: PathBuf,
    pub pinned: bool,
    /// `purpose (pid N)` of each lease.
    pub leases: Vec<String>,
    /// Seconds until it stops for idleness, when it will.
    pub stops_in_s: Option<u64>,
}
