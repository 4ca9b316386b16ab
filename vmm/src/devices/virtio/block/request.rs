//! Parsing of virtio-blk requests (virtio 1.2, section 5.2.6).
//!
//! A request is a descriptor chain: a 16-byte device-readable header
//! (`type`, `reserved`, `sector`), the data buffers, and a 1-byte device-writable
//! status. Parsing only checks the chain against guest memory and the disk size; it
//! touches no data.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};

use super::{SECTOR_SIZE, VIRTIO_BLK_ID_LEN};
use crate::devices::virtio::guest_range_ok;
use crate::memory::GuestMemoryMmap;

/// Size of `struct virtio_blk_outhdr`.
pub const HEADER_LEN: u32 = 16;

/// Why a chain cannot be executed as a request.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    #[error("the descriptor chain is empty")]
    EmptyChain,
    #[error("the descriptor chain is truncated after {count} descriptors (loop, bad next index or too long)")]
    BrokenChain { count: usize },
    #[error(
        "status descriptor {addr:#x}+{len} is not a 1-byte device-writable buffer in guest memory"
    )]
    BadStatus { addr: u64, len: u32 },
    #[error("the chain has no header descriptor before the status descriptor")]
    MissingHeader,
    #[error("request header descriptor has length {len}, expected {HEADER_LEN}")]
    HeaderLength { len: u32 },
    #[error("request header descriptor at {addr:#x} is device-writable")]
    HeaderWritable { addr: u64 },
    #[error("cannot read the request header at {addr:#x}")]
    HeaderRead { addr: u64 },
    #[error("data descriptor {index} at {addr:#x} has the wrong direction for request type {request_type}")]
    DataDirection {
        index: usize,
        addr: u64,
        request_type: u32,
    },
    #[error("data buffer {addr:#x}+{len:#x} is outside guest memory")]
    DataOutOfRange { addr: u64, len: u32 },
    #[error("data length {len} is not a multiple of {SECTOR_SIZE}")]
    DataLength { len: u64 },
    #[error(
        "request for {len} bytes at sector {sector} goes beyond the capacity of {capacity} sectors"
    )]
    OutOfCapacity {
        sector: u64,
        len: u64,
        capacity: u64,
    },
    #[error("request type {request_type} carries {len} data bytes, expected none")]
    UnexpectedData { request_type: u32, len: u64 },
    #[error("get-id request has no data buffer")]
    NoIdBuffer,
}

/// The request types the device implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestType {
    In,
    Out,
    Flush,
    GetId,
    Unsupported(u32),
}

impl From<u32> for RequestType {
    fn from(value: u32) -> Self {
        match value {
            VIRTIO_BLK_T_IN => RequestType::In,
            VIRTIO_BLK_T_OUT => RequestType::Out,
            VIRTIO_BLK_T_FLUSH => RequestType::Flush,
            VIRTIO_BLK_T_GET_ID => RequestType::GetId,
            other => RequestType::Unsupported(other),
        }
    }
}

/// One guest buffer of a request's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataBuffer {
    pub addr: GuestAddress,
    pub len: u32,
}

/// A request checked against guest memory and the disk capacity.
#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    pub request_type: RequestType,
    pub sector: u64,
    pub data: Vec<DataBuffer>,
    /// Sum of the data buffer lengths.
    pub data_len: u64,
}

/// Checks that the last descriptor of `descs` is a usable status byte and returns its
/// address. Without one, nothing can be reported to the driver.
pub fn status_address(
    descs: &[Descriptor],
    memory: &GuestMemoryMmap,
) -> Result<GuestAddress, RequestError> {
    let last = descs.last().ok_or(RequestError::EmptyChain)?;
    if last.has_next() {
        // The iterator stopped early: the chain loops, is too long or points outside
        // the descriptor table. Its "last" descriptor is not the status.
        return Err(RequestError::BrokenChain { count: descs.len() });
    }
    if !last.is_write_only() || last.len() != 1 || !guest_range_ok(memory, last.addr(), 1) {
        return Err(RequestError::BadStatus {
            addr: last.addr().0,
            len: last.len(),
        });
    }
    Ok(last.addr())
}

impl Request {
    /// Parses the descriptors before the status descriptor (`descs` excludes it).
    pub fn parse(
        descs: &[Descriptor],
        memory: &GuestMemoryMmap,
        capacity_sectors: u64,
    ) -> Result<Request, RequestError> {
        let (header, data_descs) = descs.split_first().ok_or(RequestError::MissingHeader)?;
        if header.is_write_only() {
            return Err(RequestError::HeaderWritable {
                addr: header.addr().0,
            });
        }
        if header.len() != HEADER_LEN {
            return Err(RequestError::HeaderLength { len: header.len() });
        }
        let mut raw = [0u8; HEADER_LEN as usize];
        memory
            .read_slice(&mut raw, header.addr())
            .map_err(|_| RequestError::HeaderRead {
                addr: header.addr().0,
            })?;
        // struct virtio_blk_outhdr { le32 type; le32 reserved; le64 sector; }
        let [t0, t1, t2, t3, _, _, _, _, s0, s1, s2, s3, s4, s5, s6, s7] = raw;
        let type_value = u32::from_le_bytes([t0, t1, t2, t3]);
        let sector = u64::from_le_bytes([s0, s1, s2, s3, s4, s5, s6, s7]);
        let request_type = RequestType::from(type_value);

        let mut request = Request {
            request_type,
            sector,
            data: Vec::with_capacity(data_descs.len()),
            data_len: 0,
        };
        let device_writes = match request_type {
            // Nothing of an unsupported request is looked at beyond its type.
            RequestType::Unsupported(_) => return Ok(request),
            RequestType::In | RequestType::GetId => true,
            RequestType::Out | RequestType::Flush => false,
        };

        for (index, desc) in data_descs.iter().enumerate() {
            if desc.is_write_only() != device_writes {
                return Err(RequestError::DataDirection {
                    index,
                    addr: desc.addr().0,
                    request_type: type_value,
                });
            }
            let len = desc.len();
            // A u32 always fits in usize on the 64-bit hosts KVM runs on.
            if !guest_range_ok(memory, desc.addr(), len as usize) {
                return Err(RequestError::DataOutOfRange {
                    addr: desc.addr().0,
                    len,
                });
            }
            request.data_len = request.data_len.saturating_add(u64::from(len));
            request.data.push(DataBuffer {
                addr: desc.addr(),
                len,
            });
        }

        match request_type {
            RequestType::In | RequestType::Out => {
                if !request.data_len.is_multiple_of(SECTOR_SIZE) {
                    return Err(RequestError::DataLength {
                        len: request.data_len,
                    });
                }
                let end = sector
                    .checked_mul(SECTOR_SIZE)
                    .and_then(|start| start.checked_add(request.data_len));
                let capacity_bytes = capacity_sectors.saturating_mul(SECTOR_SIZE);
                if end.is_none_or(|end| end > capacity_bytes) {
                    return Err(RequestError::OutOfCapacity {
                        sector,
                        len: request.data_len,
                        capacity: capacity_sectors,
                    });
                }
            }
            RequestType::Flush => {
                if request.data_len != 0 {
                    return Err(RequestError::UnexpectedData {
                        request_type: type_value,
                        len: request.data_len,
                    });
                }
            }
            RequestType::GetId => {
                if request.data_len == 0 {
                    return Err(RequestError::NoIdBuffer);
                }
            }
            RequestType::Unsupported(_) => {}
        }
        Ok(request)
    }

    /// Bytes of the ID a get-id request receives.
    pub fn id_len(&self) -> usize {
        usize::try_from(self.data_len)
            .unwrap_or(usize::MAX)
            .min(VIRTIO_BLK_ID_LEN)
    }
}
