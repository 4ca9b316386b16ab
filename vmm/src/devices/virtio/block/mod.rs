//! virtio-blk (virtio 1.2, section 5.2) over a raw disk image.
//!
//! - [`request`]: parsing and checking of request descriptor chains.
//! - `device`: the [`Block`] device, which executes requests with positional I/O
//!   straight between the image file and guest memory.

mod device;
pub mod request;

pub use device::{Block, BlockError};

/// Sector size of the virtio-blk protocol (independent of the disk's block size).
pub const SECTOR_SIZE: u64 = 512;
/// Size of the only request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Length of the device ID returned by VIRTIO_BLK_T_GET_ID.
pub const VIRTIO_BLK_ID_LEN: usize = 20;
