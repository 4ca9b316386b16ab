//! A VM's network, host side: everything the supervisor serves besides the VMM.
//!
//! - [`services`]: connections the guest opens (the egress proxy, loopback relays).
//! - [`published`]: host ports published to guest loopback ports.
//! - [`control`]: the supervisor's control socket, through which `vmctl` configures
//!   the guest's network, relays and published ports of a running VM.
//! - [`guest_setup`]: what the guest is told: proxy variables, CA, placeholders.

pub mod control;
pub mod guest_setup;
pub mod published;
pub mod services;

/// Paseo's daemon port, relayed into every VM so its MCP URLs work unchanged.
pub const PASEO_PORT: u16 = 6767;
