//! Benchmarks of the VMM: boot time and memory overhead, measured side by side with
//! QEMU's microvm machine, and the workspace VM (`vmctl up`, exec through the guest
//! agent; [`workspace`]), its shared directory over virtio-fs against the host
//! ([`fs`]) and its egress path against the host ([`egress`]), see
//! `benches/README.md`.
//!
//! The pure parts (statistics, `/proc/<pid>/smaps` accounting, console scanning, the
//! newc writer) are modules of their own with unit tests; [`boot`] runs the VMs.

pub mod boot;
pub mod egress;
pub mod fs;
pub mod report;
pub mod scan;
pub mod smaps;
pub mod stats;
pub mod workspace;
