//! Devices offered to the guest.

pub mod bus;
pub mod legacy;
pub mod virtio;
