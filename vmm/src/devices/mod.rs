//! Devices offered to the guest.

pub mod bus;
pub mod console_output;
pub mod legacy;
pub mod virtio;
