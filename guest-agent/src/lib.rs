//! The guest agent of the micro-VM runtime, and the host side of its protocol.
//!
//! - [`protocol`]: messages and framing (see `PROTOCOL.md`);
//! - [`client`]: the async client `vmctl` uses;
//! - [`clock`]: the guest's clock follows the host's;
//! - [`cgroups`]: a cgroup for each command, to kill all it started;
//! - [`server`]: the agent's request handling and command execution;
//! - [`init`]: PID-1 duties inside the VM;
//! - [`host_edits`]: host edits of the shares, shown to the guest's file watchers;
//! - [`shares`]: the `vmctl.share=` kernel parameter and mounting virtio-fs shares;
//! - [`network`]: the guest side of networking (egress proxy, port relays, CA);
//! - [`ports`]: the guest's listening TCP ports, from `/proc/net/tcp{,6}`;
//! - [`users`]: account lookup from `/etc/passwd` and `/etc/group`;
//! - [`raw`]: a connection switched from frames to raw bytes.

pub mod cgroups;
pub mod client;
pub mod clock;
pub mod host_edits;
pub mod idle_caches;
pub mod init;
pub mod network;
pub mod ports;
pub mod protocol;
pub mod raw;
pub mod server;
pub mod shares;
pub mod users;

/// Says on the terminal, past the test harness's capture, that the unit test `test`
/// did not run here for want of what `why` says; fails it instead under CI (`CI` set,
/// as `.ci/run` sets it), whose machines (root, a writable cgroup v2) have what the
/// tests need: there, a test that cannot run is a broken machine, not a pass.
#[cfg(test)]
pub(crate) fn not_run(test: &str, why: &str) {
    use std::io::Write;
    let ci = std::env::var("CI").unwrap_or_default();
    if !ci.is_empty() && ci != "false" && ci != "0" {
        panic!("{test} did not run, which it must under CI (CI={ci}): {why}");
    }
    let _ = writeln!(
        std::io::stderr(),
        "NOT RUN: {test}: {why}; it passes without testing anything (with CI set it fails)"
    );
}
