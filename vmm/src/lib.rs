//! A minimal KVM virtual machine monitor built on the rust-vmm crates.
//!
//! - [`vstate`]: the KVM VM and vCPU file descriptors and their run loops.
//! - [`memory`]: guest memory, a memfd mapped shared for vhost-user backends.
//! - [`arch::x86_64`]: boot details (layout, boot_params/e820, page tables, GDT,
//!   CPUID, MSRs, MP table).
//! - [`devices`]: the port-I/O and MMIO buses, legacy devices (serial, i8042, boot
//!   timer) and the virtio devices with their MMIO transport.
//! - [`event_loop`]: the thread that serves queue notifications, stdin and signals.
//! - [`builder`]: composes all of the above from a [`config::VmConfig`] and runs it.
//! - [`process`]: the `vmctl-vmm` process that runs one VM, and what it reports.

pub mod arch;
pub mod builder;
pub mod config;
pub mod devices;
pub mod event_loop;
pub mod memory;
pub mod process;
pub mod vstate;
