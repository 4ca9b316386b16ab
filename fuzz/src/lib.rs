//! What a hostile guest could feed the VMM, as harnesses: register accesses in any
//! order ([`mmio`]), queues anywhere, descriptors and requests with any contents
//! ([`mmio`], [`vsock`], [`fs_fallback`]); and what a host the guest's secret is sent
//! to could send back through the egress proxy ([`redact`]). Each takes any bytes and
//! must neither
//! panic nor break what it checks. libFuzzer runs them (`fuzz/libfuzzer`, see
//! `fuzz/README.md`); `cargo test -p vmm-fuzz` runs hand-written driver sessions that
//! show the harnesses reach the devices' request handling, and a few thousand seeded
//! random inputs.

pub mod fs_fallback;
pub mod guest;
pub mod input;
pub mod mmio;
pub mod redact;
pub mod seeds;
pub mod vsock;
