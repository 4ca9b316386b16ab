//! Benchmarks of the VMM: boot time and memory overhead, measured side by side with
//! QEMU's microvm machine, as is the churn of create/destroy cycles ([`churn`]), and
//! the workspace VM (`vmctl up`, exec through the guest agent; [`workspace`]), its
//! shared directory over virtio-fs against the host ([`fs`]; how soon the host's
//! edits reach the guest: [`fs_edits`]), its egress path
//! against the host ([`egress`]), and the agent CLI's start, cold and warm, with the
//! host memory of idle VMs ([`agent`]), see `benches/README.md`.
//!
//! The pure parts (statistics, `/proc/<pid>/smaps` accounting, console scanning, the
//! newc writer) are modules of their own with unit tests; [`boot`] runs the VMs.

pub mod agent;
pub mod boot;
pub mod charts;
pub mod churn;
pub mod cold_start;
pub mod egress;
pub mod fs;
pub mod fs_edits;
pub mod fs_vmm;
pub mod process;
pub mod report;
pub mod report_charts;
pub mod scan;
pub mod sections;
pub mod smaps;
pub mod stats;
pub mod workspace;
