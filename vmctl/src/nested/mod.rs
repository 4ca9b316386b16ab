//! The nested host: where this machine's /dev/kvm cannot boot Linux, the VMM runs
//! inside a QEMU-TCG guest whose emulated AMD CPU has SVM, so that guest's kernel has
//! a real KVM. The host's root is shared read-only over 9p, so the same `vmctl`,
//! kernel and images are used at the same paths.
//!
//! - [`launcher`]: on the host, starts QEMU and relays the outcome.
//! - [`init`]: inside, `vmctl` is PID 1 (told so by [`job::JOB_ENV`] in its
//!   environment) and runs the VMM.
//! - [`job`]: the job file between the two.
//! - [`stall`]: on the host, ends a nested host whose vCPU stopped taking interrupts.

pub mod init;
pub mod job;
pub mod launcher;
pub mod mux;
pub mod stall;

pub use launcher::NestedError;
