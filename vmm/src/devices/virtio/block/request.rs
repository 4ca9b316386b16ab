//! Parsing of virtio-blk requests (virtio 1.2, section 5.2.6).
//!
//! A request is a descriptor chain read as one byte stream: a 16-byte device-readable
//! header (`type`, `reserved`, `sector`), the data, and a 1-byte device-writable
//! status, its last byte. How the driver cuts that stream into descriptors is its own
//! choice (virtio 1.x, 2.7.4: the device must not assume a layout): the header may be
//! split, share a descriptor with the data it precedes, and the status may end the
//! last data buffer. Parsing only checks the chain against guest memory and the disk
//! size; it touches no data.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress};

use super::{SECTOR_SIZE, VIRTIO_BLK_ID_LEN};
use crate::devices::virtio::{guest_range_ok, SERVE_BYTES};
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
        "the last descriptor {addr:#x}+{len} is not a device-writable buffer in guest memory that could end with the status byte"
    )]
    BadStatus { addr: u64, len: u32 },
    #[error("descriptor {index} at {addr:#x}+{len:#x} is outside guest memory")]
    OutOfMemory { index: usize, addr: u64, len: u32 },
    #[error("the request header at {addr:#x} is device-writable")]
    HeaderWritable { addr: u64 },
    #[error("the request header has {len} device-readable bytes, expected {HEADER_LEN}")]
    ShortHeader { len: u32 },
    #[error("cannot read the request header at {addr:#x}")]
    HeaderRead { addr: u64 },
    #[error("data descriptor {index} at {addr:#x} has the wrong direction for request type {request_type}")]
    DataDirection {
        index: usize,
        addr: u64,
        request_type: u32,
    },
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
    #[error(
        "request for {len} bytes is larger than the {MAX_REQUEST_BYTES} bytes a request may move"
    )]
    TooLarge { len: u64 },
}

/// The most data one read or write may carry: [`SERVE_BYTES`], so that a request
/// cannot hold the event loop much longer than a ring of them may. Linux's requests are
/// 1.25 MiB by default (`max_sectors_kb`).
pub const MAX_REQUEST_BYTES: u64 = SERVE_BYTES;

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

/// One guest buffer of a request's data: a descriptor, or the part of one that the
/// header or the status does not use.
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

/// Checks that the chain ends with a usable status byte, the last byte of its last
/// descriptor, and returns its address. Without one, nothing can be reported to the
/// driver.
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
    let bad_status = || RequestError::BadStatus {
        addr: last.addr().0,
        len: last.len(),
    };
    if !last.is_write_only() || last.len() == 0 {
        return Err(bad_status());
    }
    let status = last
        .addr()
        .checked_add(u64::from(last.len()) - 1)
        .ok_or_else(bad_status)?;
    if !guest_range_ok(memory, status, 1) {
        return Err(bad_status());
    }
    Ok(status)
}

/// A descriptor's bytes that the request has not used yet.
#[derive(Clone, Copy)]
struct Segment {
    /// The descriptor's place in the chain, for errors.
    index: usize,
    addr: GuestAddress,
    len: u32,
    device_writes: bool,
}

impl Segment {
    /// Takes up to `n` bytes off the front: (their address, their length).
    fn take_front(&mut self, n: u32) -> (GuestAddress, u32) {
        let taken = n.min(self.len);
        let addr = self.addr;
        // `addr + len` is in guest memory (checked), so the sum cannot overflow.
        self.addr = self.addr.unchecked_add(u64::from(taken));
        self.len -= taken;
        (addr, taken)
    }
}

/// The chain's descriptors as segments, each checked to lie in guest memory, without
/// the status byte (the last, checked by [`status_address`]) and empty descriptors.
fn segments(descs: &[Descriptor], memory: &GuestMemoryMmap) -> Result<Vec<Segment>, RequestError> {
    let mut segments = Vec::with_capacity(descs.len());
    for (index, desc) in descs.iter().enumerate() {
        // A u32 always fits in usize on the 64-bit hosts KVM runs on.
        if desc.len() > 0 && !guest_range_ok(memory, desc.addr(), desc.len() as usize) {
            return Err(RequestError::OutOfMemory {
                index,
                addr: desc.addr().0,
                len: desc.len(),
            });
        }
        let is_status = index + 1 == descs.len();
        let len = desc.len() - u32::from(is_status && desc.len() > 0);
        if len > 0 {
            segments.push(Segment {
                index,
                addr: desc.addr(),
                len,
                device_writes: desc.is_write_only(),
            });
        }
    }
    Ok(segments)
}

/// Reads the 16-byte header off the front of `segments`, which must be
/// device-readable; what remains is the data.
fn read_header(
    segments: &mut [Segment],
    memory: &GuestMemoryMmap,
) -> Result<[u8; HEADER_LEN as usize], RequestError> {
    let mut header = [0u8; HEADER_LEN as usize];
    let mut got = 0u32;
    for segment in segments.iter_mut() {
        if got == HEADER_LEN {
            break;
        }
        if segment.device_writes {
            return Err(if got == 0 {
                RequestError::HeaderWritable {
                    addr: segment.addr.0,
                }
            } else {
                RequestError::ShortHeader { len: got }
            });
        }
        let (addr, len) = segment.take_front(HEADER_LEN - got);
        let into = &mut header[got as usize..(got + len) as usize];
        memory
            .read_slice(into, addr)
            .map_err(|_| RequestError::HeaderRead { addr: addr.0 })?;
        got += len;
    }
    if got < HEADER_LEN {
        return Err(RequestError::ShortHeader { len: got });
    }
    Ok(header)
}

impl Request {
    /// Parses a whole chain, its status descriptor included.
    pub fn parse(
        descs: &[Descriptor],
        memory: &GuestMemoryMmap,
        capacity_sectors: u64,
    ) -> Result<Request, RequestError> {
        let mut segments = segments(descs, memory)?;
        let raw = read_header(&mut segments, memory)?;
        // struct virtio_blk_outhdr { le32 type; le32 reserved; le64 sector; }
        let [t0, t1, t2, t3, _, _, _, _, s0, s1, s2, s3, s4, s5, s6, s7] = raw;
        let type_value = u32::from_le_bytes([t0, t1, t2, t3]);
        let sector = u64::from_le_bytes([s0, s1, s2, s3, s4, s5, s6, s7]);
        let request_type = RequestType::from(type_value);

        let mut request = Request {
            request_type,
            sector,
            data: Vec::with_capacity(segments.len()),
            data_len: 0,
        };
        let device_writes = match request_type {
            // Nothing of an unsupported request is looked at beyond its type.
            RequestType::Unsupported(_) => return Ok(request),
            RequestType::In | RequestType::GetId => true,
            RequestType::Out | RequestType::Flush => false,
        };

        for segment in segments.iter().filter(|s| s.len > 0) {
            if segment.device_writes != device_writes {
                return Err(RequestError::DataDirection {
                    index: segment.index,
                    addr: segment.addr.0,
                    request_type: type_value,
                });
            }
            request.data_len = request.data_len.saturating_add(u64::from(segment.len));
            request.data.push(DataBuffer {
                addr: segment.addr,
                len: segment.len,
            });
        }

        match request_type {
            RequestType::In | RequestType::Out => {
                if request.data_len > MAX_REQUEST_BYTES {
                    return Err(RequestError::TooLarge {
                        len: request.data_len,
                    });
                }
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
