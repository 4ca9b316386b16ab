//! virtio-vsock packets (virtio 1.2, section 5.10.6): the 44-byte little-endian
//! header, and moving whole packets between descriptor chains and host buffers.
//!
//! Everything here treats the guest as hostile: descriptor directions, lengths and
//! addresses are checked, the header's `len` is checked against both the buffer the
//! guest actually supplied and [`MAX_PKT_LEN`], and no allocation depends on a value
//! the guest chose beyond that cap.

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};

use crate::devices::virtio::guest_range_ok;
use crate::memory::GuestMemoryMmap;

/// Size of `struct virtio_vsock_hdr`.
pub const HDR_LEN: usize = 44;
/// Largest payload the device accepts from or hands to the guest in one packet.
pub const MAX_PKT_LEN: u32 = 64 * 1024;
/// Most descriptors one chain may have; longer chains are refused. (The chains come
/// from [`crate::devices::virtio::chain::read_chain`], which already refuses one
/// longer than the queue, 256 too: this stays as a bound of its own.)
pub const MAX_CHAIN_DESCS: usize = 256;

/// The well-known CID of the host.
pub const HOST_CID: u64 = 2;

/// VIRTIO_VSOCK_TYPE_STREAM, the only socket type offered.
pub const TYPE_STREAM: u16 = 1;

/// VIRTIO_VSOCK_SHUTDOWN_F_RECEIVE / _SEND.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;

/// Header field offsets.
const OFF_SRC_CID: usize = 0;
const OFF_DST_CID: usize = 8;
const OFF_SRC_PORT: usize = 16;
const OFF_DST_PORT: usize = 20;
const OFF_LEN: usize = 24;
const OFF_TYPE: usize = 28;
const OFF_OP: usize = 30;
const OFF_FLAGS: usize = 32;
const OFF_BUF_ALLOC: usize = 36;
const OFF_FWD_CNT: usize = 40;

/// VIRTIO_VSOCK_OP_* values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Op {
    Request = 1,
    Response = 2,
    Rst = 3,
    Shutdown = 4,
    Rw = 5,
    CreditUpdate = 6,
    CreditRequest = 7,
}

impl TryFrom<u16> for Op {
    type Error = PacketError;

    fn try_from(op: u16) -> Result<Self, PacketError> {
        Ok(match op {
            1 => Op::Request,
            2 => Op::Response,
            3 => Op::Rst,
            4 => Op::Shutdown,
            5 => Op::Rw,
            6 => Op::CreditUpdate,
            7 => Op::CreditRequest,
            _ => return Err(PacketError::BadOp(op)),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PacketError {
    #[error("descriptor chain has {0} readable bytes, less than a {HDR_LEN}-byte header")]
    ShortHeader(usize),
    #[error("unknown operation {0}")]
    BadOp(u16),
    #[error("unsupported socket type {0}")]
    BadType(u16),
    #[error("payload length {0} exceeds the maximum of {MAX_PKT_LEN}")]
    LenTooLarge(u32),
    #[error("payload length {len} exceeds the {avail} bytes the descriptors hold")]
    LenBeyondBuffer { len: u32, avail: usize },
    #[error("source CID {got} is not the guest's CID {expected}")]
    BadSrcCid { got: u64, expected: u64 },
    #[error("destination CID {0} is not the host (2)")]
    BadDstCid(u64),
    #[error("a transmit descriptor is device-writable")]
    WritableTxDescriptor,
    #[error("a receive descriptor is device-readable")]
    ReadableRxDescriptor,
    #[error("descriptor chain longer than {MAX_CHAIN_DESCS} descriptors")]
    ChainTooLong,
    #[error("descriptor chain does not end (it loops, or a descriptor is unreachable)")]
    UnterminatedChain,
    #[error("descriptor {addr:#x}+{len:#x} is not inside guest memory")]
    OutOfMemory { addr: u64, len: u32 },
    #[error("receive buffer of {capacity} bytes cannot hold a {needed}-byte packet")]
    RxBufferTooSmall { capacity: usize, needed: usize },
    #[error("guest memory access failed: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    #[error(transparent)]
    Chain(crate::devices::virtio::chain::ChainError),
}

/// `struct virtio_vsock_hdr`, host byte order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

fn le_u16(b: &[u8; HDR_LEN], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

fn le_u32(b: &[u8; HDR_LEN], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

fn le_u64(b: &[u8; HDR_LEN], off: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(v)
}

impl Header {
    pub fn from_bytes(b: &[u8; HDR_LEN]) -> Self {
        Self {
            src_cid: le_u64(b, OFF_SRC_CID),
            dst_cid: le_u64(b, OFF_DST_CID),
            src_port: le_u32(b, OFF_SRC_PORT),
            dst_port: le_u32(b, OFF_DST_PORT),
            len: le_u32(b, OFF_LEN),
            type_: le_u16(b, OFF_TYPE),
            op: le_u16(b, OFF_OP),
            flags: le_u32(b, OFF_FLAGS),
            buf_alloc: le_u32(b, OFF_BUF_ALLOC),
            fwd_cnt: le_u32(b, OFF_FWD_CNT),
        }
    }

    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[OFF_SRC_CID..OFF_SRC_CID + 8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[OFF_DST_CID..OFF_DST_CID + 8].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[OFF_SRC_PORT..OFF_SRC_PORT + 4].copy_from_slice(&self.src_port.to_le_bytes());
        b[OFF_DST_PORT..OFF_DST_PORT + 4].copy_from_slice(&self.dst_port.to_le_bytes());
        b[OFF_LEN..OFF_LEN + 4].copy_from_slice(&self.len.to_le_bytes());
        b[OFF_TYPE..OFF_TYPE + 2].copy_from_slice(&self.type_.to_le_bytes());
        b[OFF_OP..OFF_OP + 2].copy_from_slice(&self.op.to_le_bytes());
        b[OFF_FLAGS..OFF_FLAGS + 4].copy_from_slice(&self.flags.to_le_bytes());
        b[OFF_BUF_ALLOC..OFF_BUF_ALLOC + 4].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[OFF_FWD_CNT..OFF_FWD_CNT + 4].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// A host→guest stream header (payload length 0; set `len` for OP_RW).
    pub fn to_guest(guest_cid: u64, src_port: u32, dst_port: u32, op: Op) -> Self {
        Self {
            src_cid: HOST_CID,
            dst_cid: guest_cid,
            src_port,
            dst_port,
            type_: TYPE_STREAM,
            op: op as u16,
            ..Self::default()
        }
    }
}

/// A packet the guest sent, addressed correctly (CIDs checked) but whose type and
/// operation the muxer still has to judge.
#[derive(Debug)]
pub struct TxPacket {
    pub hdr: Header,
    /// Exactly `hdr.len` bytes (only OP_RW carries a payload; others are read anyway
    /// and ignored).
    pub data: Vec<u8>,
}

impl TxPacket {
    /// The operation, or an error for unknown ones and non-stream sockets.
    pub fn op(&self) -> Result<Op, PacketError> {
        if self.hdr.type_ != TYPE_STREAM {
            return Err(PacketError::BadType(self.hdr.type_));
        }
        Op::try_from(self.hdr.op)
    }
}

/// The (address, length) segments of a chain, all in guest memory and all of one
/// direction.
///
/// The chains come whole from [`crate::devices::virtio::chain::read_chain`], which
/// refuses those that loop, leave the table or use an indirect table; a chain whose
/// last descriptor still has NEXT set (cut short) is refused here as well, as a check
/// of its own, rather than parsed from whatever its first descriptors hold.
fn segments<I>(
    descs: I,
    memory: &GuestMemoryMmap,
    writable: bool,
) -> Result<Vec<(GuestAddress, u32)>, PacketError>
where
    I: Iterator<Item = Descriptor>,
{
    let mut segs = Vec::new();
    let mut unterminated = false;
    for (count, desc) in descs.enumerate() {
        // Counts empty descriptors too: they cost a guest memory read each.
        if count == MAX_CHAIN_DESCS {
            return Err(PacketError::ChainTooLong);
        }
        unterminated = desc.has_next();
        if desc.is_write_only() != writable {
            return Err(if writable {
                PacketError::ReadableRxDescriptor
            } else {
                PacketError::WritableTxDescriptor
            });
        }
        if !guest_range_ok(memory, desc.addr(), desc.len() as usize) {
            return Err(PacketError::OutOfMemory {
                addr: desc.addr().0,
                len: desc.len(),
            });
        }
        if desc.len() > 0 {
            segs.push((desc.addr(), desc.len()));
        }
    }
    if unterminated {
        return Err(PacketError::UnterminatedChain);
    }
    Ok(segs)
}

/// Copies `out.len()` bytes starting `skip` bytes into the chain's segments.
fn gather(
    memory: &GuestMemoryMmap,
    segs: &[(GuestAddress, u32)],
    mut skip: usize,
    out: &mut [u8],
) -> Result<(), PacketError> {
    let mut done = 0;
    for &(addr, len) in segs {
        if done == out.len() {
            break;
        }
        let len = len as usize;
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = (len - skip).min(out.len() - done);
        // `skip < len` and the segment is inside guest memory, so this cannot overflow.
        let at = addr.0 + skip as u64;
        memory.read_slice(&mut out[done..done + n], GuestAddress(at))?;
        done += n;
        skip = 0;
    }
    if done != out.len() {
        return Err(PacketError::ShortHeader(done));
    }
    Ok(())
}

/// Reads one packet from a transmit-queue chain.
pub fn read_tx_packet<I>(
    descs: I,
    memory: &GuestMemoryMmap,
    guest_cid: u64,
) -> Result<TxPacket, PacketError>
where
    I: Iterator<Item = Descriptor>,
{
    let segs = segments(descs, memory, false)?;
    let total = segs
        .iter()
        .fold(0usize, |acc, &(_, len)| acc.saturating_add(len as usize));
    if total < HDR_LEN {
        return Err(PacketError::ShortHeader(total));
    }
    let mut raw = [0u8; HDR_LEN];
    gather(memory, &segs, 0, &mut raw)?;
    let hdr = Header::from_bytes(&raw);
    if hdr.src_cid != guest_cid {
        return Err(PacketError::BadSrcCid {
            got: hdr.src_cid,
            expected: guest_cid,
        });
    }
    if hdr.dst_cid != HOST_CID {
        return Err(PacketError::BadDstCid(hdr.dst_cid));
    }
    if hdr.len > MAX_PKT_LEN {
        return Err(PacketError::LenTooLarge(hdr.len));
    }
    let avail = total - HDR_LEN;
    if hdr.len as usize > avail {
        return Err(PacketError::LenBeyondBuffer {
            len: hdr.len,
            avail,
        });
    }
    let mut data = vec![0u8; hdr.len as usize];
    gather(memory, &segs, HDR_LEN, &mut data)?;
    Ok(TxPacket { hdr, data })
}

/// A receive-queue chain: device-writable segments inside guest memory.
pub struct RxBuffer {
    segs: Vec<(GuestAddress, u32)>,
    capacity: usize,
}

impl RxBuffer {
    pub fn from_chain<I>(descs: I, memory: &GuestMemoryMmap) -> Result<Self, PacketError>
    where
        I: Iterator<Item = Descriptor>,
    {
        let segs = segments(descs, memory, true)?;
        let capacity = segs
            .iter()
            .fold(0usize, |acc, &(_, len)| acc.saturating_add(len as usize));
        if capacity < HDR_LEN {
            return Err(PacketError::RxBufferTooSmall {
                capacity,
                needed: HDR_LEN,
            });
        }
        Ok(Self { segs, capacity })
    }

    /// The most payload bytes a packet written here may carry.
    pub fn max_payload(&self) -> usize {
        (self.capacity - HDR_LEN).min(MAX_PKT_LEN as usize)
    }

    /// Writes `hdr` (with `len` set to `data.len()`) followed by `data`; returns the
    /// bytes written (the used length).
    pub fn write_packet(
        &self,
        memory: &GuestMemoryMmap,
        hdr: &Header,
        data: &[u8],
    ) -> Result<u32, PacketError> {
        let needed = HDR_LEN + data.len();
        if data.len() > self.max_payload() {
            return Err(PacketError::RxBufferTooSmall {
                capacity: self.capacity,
                needed,
            });
        }
        let mut hdr = *hdr;
        // max_payload() <= MAX_PKT_LEN, so this fits.
        hdr.len = data.len() as u32;
        let raw = hdr.to_bytes();
        let mut parts: [&[u8]; 2] = [&raw, data];
        let mut part = 0;
        for &(addr, len) in &self.segs {
            let mut off = 0usize;
            while off < len as usize && part < parts.len() {
                let n = (len as usize - off).min(parts[part].len());
                memory.write_slice(&parts[part][..n], GuestAddress(addr.0 + off as u64))?;
                off += n;
                parts[part] = &parts[part][n..];
                if parts[part].is_empty() {
                    part += 1;
                }
            }
            if part == parts.len() {
                break;
            }
        }
        // `needed` <= HDR_LEN + MAX_PKT_LEN.
        Ok(needed as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;

    const GUEST_CID: u64 = 3;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    fn hdr(op: u16, len: u32) -> Header {
        Header {
            src_cid: GUEST_CID,
            dst_cid: HOST_CID,
            src_port: 5000,
            dst_port: 1024,
            len,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: 4096,
            fwd_cnt: 7,
        }
    }

    fn ro(addr: u64, len: u32) -> Descriptor {
        Descriptor::new(addr, len, 0, 0)
    }

    fn wo(addr: u64, len: u32) -> Descriptor {
        Descriptor::new(addr, len, VRING_DESC_F_WRITE as u16, 0)
    }

    fn put(mem: &GuestMemoryMmap, addr: u64, h: &Header, data: &[u8]) {
        mem.write_slice(&h.to_bytes(), GuestAddress(addr)).unwrap();
        mem.write_slice(data, GuestAddress(addr + HDR_LEN as u64))
            .unwrap();
    }

    #[test]
    fn header_roundtrip() {
        let h = hdr(5, 12);
        let b = h.to_bytes();
        assert_eq!(Header::from_bytes(&b), h);
        assert_eq!(b[0], 3);
        assert_eq!(b[8], 2);
        assert_eq!(u16::from_le_bytes([b[30], b[31]]), 5);
    }

    #[test]
    fn reads_packets_split_across_descriptors() {
        let mem = memory();
        put(&mem, 0x1000, &hdr(5, 5), b"hello");
        let pkt = read_tx_packet([ro(0x1000, 49)].into_iter(), &mem, GUEST_CID).unwrap();
        assert_eq!(pkt.data, b"hello");
        assert_eq!(pkt.op().unwrap(), Op::Rw);
        // Header split in the middle, payload in a third descriptor.
        mem.write_slice(&hdr(5, 3).to_bytes(), GuestAddress(0x2000))
            .unwrap();
        mem.write_slice(b"abc", GuestAddress(0x3000)).unwrap();
        let descs = [ro(0x2000, 10), ro(0x200a, 34), ro(0x3000, 3)];
        let pkt = read_tx_packet(descs.into_iter(), &mem, GUEST_CID).unwrap();
        assert_eq!(pkt.hdr, hdr(5, 3));
        assert_eq!(pkt.data, b"abc");
    }

    #[test]
    fn malformed_tx_packets_are_rejected() {
        let mem = memory();
        let check = |h: Header, descs: &[Descriptor]| {
            put(&mem, 0x1000, &h, &[0u8; 64]);
            read_tx_packet(descs.iter().copied(), &mem, GUEST_CID)
        };
        assert!(matches!(
            check(hdr(1, 0), &[ro(0x1000, 43)]),
            Err(PacketError::ShortHeader(43))
        ));
        assert!(matches!(
            check(hdr(5, 100), &[ro(0x1000, 100)]),
            Err(PacketError::LenBeyondBuffer {
                len: 100,
                avail: 56
            })
        ));
        assert!(matches!(
            check(hdr(5, MAX_PKT_LEN + 1), &[ro(0x1000, 100)]),
            Err(PacketError::LenTooLarge(_))
        ));
        assert!(matches!(
            check(hdr(5, u32::MAX), &[ro(0x1000, 100)]),
            Err(PacketError::LenTooLarge(_))
        ));
        let mut h = hdr(1, 0);
        h.src_cid = 4;
        assert!(matches!(
            check(h, &[ro(0x1000, 44)]),
            Err(PacketError::BadSrcCid { got: 4, .. })
        ));
        let mut h = hdr(1, 0);
        h.dst_cid = 1;
        assert!(matches!(
            check(h, &[ro(0x1000, 44)]),
            Err(PacketError::BadDstCid(1))
        ));
        assert!(matches!(
            check(hdr(1, 0), &[wo(0x1000, 44)]),
            Err(PacketError::WritableTxDescriptor)
        ));
        // Header outside guest memory, and one straddling its end.
        assert!(matches!(
            read_tx_packet([ro(0x20_0000, 44)].into_iter(), &mem, GUEST_CID),
            Err(PacketError::OutOfMemory { .. })
        ));
        assert!(matches!(
            read_tx_packet([ro(0xf_fff0, 44)].into_iter(), &mem, GUEST_CID),
            Err(PacketError::OutOfMemory { .. })
        ));
        assert!(matches!(
            read_tx_packet([ro(u64::MAX - 4, 44)].into_iter(), &mem, GUEST_CID),
            Err(PacketError::OutOfMemory { .. })
        ));
        assert!(matches!(
            read_tx_packet(std::iter::empty(), &mem, GUEST_CID),
            Err(PacketError::ShortHeader(0))
        ));
        let long = vec![ro(0x1000, 1); MAX_CHAIN_DESCS + 1];
        assert!(matches!(
            read_tx_packet(long.into_iter(), &mem, GUEST_CID),
            Err(PacketError::ChainTooLong)
        ));
        // Parsed, but the op or type is bad.
        let pkt = check(hdr(99, 0), &[ro(0x1000, 44)]).unwrap();
        assert!(matches!(pkt.op(), Err(PacketError::BadOp(99))));
        let mut h = hdr(5, 0);
        h.type_ = 2;
        let pkt = check(h, &[ro(0x1000, 44)]).unwrap();
        assert!(matches!(pkt.op(), Err(PacketError::BadType(2))));
    }

    #[test]
    fn chains_that_do_not_end_are_rejected() {
        use virtio_bindings::virtio_ring::VRING_DESC_F_NEXT;
        use virtio_queue::desc::RawDescriptor;
        use virtio_queue::mock::MockSplitQueue;
        use virtio_queue::{Queue, QueueT};

        let mem = memory();
        // A well-formed packet, so only the shape of the chains is at fault.
        put(&mem, 0x8000, &hdr(5, 0), &[]);
        let next = VRING_DESC_F_NEXT as u16;
        let desc = |flags, next| RawDescriptor::from(Descriptor::new(0x8000, 44, flags, next));
        let vq = MockSplitQueue::new(&mem, 16);
        // Loops on itself: the iterator gives up after 16 descriptors.
        vq.add_desc_chains(&[desc(next, 0)], 0).unwrap();
        // Points past the descriptor table.
        vq.add_desc_chains(&[desc(next, 40)], 1).unwrap();
        // The same packet, properly terminated.
        vq.add_desc_chains(&[desc(0, 0)], 2).unwrap();
        let mut queue: Queue = vq.create_queue().unwrap();
        let mut pop = || queue.pop_descriptor_chain(&mem).unwrap();
        assert!(matches!(
            read_tx_packet(pop(), &mem, GUEST_CID),
            Err(PacketError::UnterminatedChain)
        ));
        assert!(matches!(
            read_tx_packet(pop(), &mem, GUEST_CID),
            Err(PacketError::UnterminatedChain)
        ));
        assert_eq!(
            read_tx_packet(pop(), &mem, GUEST_CID).unwrap().hdr,
            hdr(5, 0)
        );
        // The same for receive buffers, and for chains handed over as descriptors.
        assert!(matches!(
            RxBuffer::from_chain(
                [wo(0x1000, 100), wo(0x2000, 100)]
                    .map(|mut d| {
                        d.set_flags(d.flags() | next);
                        d
                    })
                    .into_iter(),
                &mem
            ),
            Err(PacketError::UnterminatedChain)
        ));
    }

    #[test]
    fn rx_buffers() {
        let mem = memory();
        assert!(matches!(
            RxBuffer::from_chain([wo(0x1000, 43)].into_iter(), &mem),
            Err(PacketError::RxBufferTooSmall { .. })
        ));
        assert!(matches!(
            RxBuffer::from_chain([ro(0x1000, 100)].into_iter(), &mem),
            Err(PacketError::ReadableRxDescriptor)
        ));
        assert!(matches!(
            RxBuffer::from_chain([wo(0xf_ff00, 0x200)].into_iter(), &mem),
            Err(PacketError::OutOfMemory { .. })
        ));
        // Header split over two descriptors, payload over the rest.
        let descs = [wo(0x1000, 20), wo(0x2000, 30), wo(0x3000, 4)];
        let buf = RxBuffer::from_chain(descs.into_iter(), &mem).unwrap();
        assert_eq!(buf.max_payload(), 10);
        let h = Header::to_guest(GUEST_CID, 1024, 5000, Op::Rw);
        assert!(buf.write_packet(&mem, &h, &[1u8; 11]).is_err());
        assert_eq!(buf.write_packet(&mem, &h, b"0123456789").unwrap(), 54);
        let mut raw = [0u8; HDR_LEN];
        mem.read_slice(&mut raw[..20], GuestAddress(0x1000))
            .unwrap();
        mem.read_slice(&mut raw[20..], GuestAddress(0x2000))
            .unwrap();
        let got = Header::from_bytes(&raw);
        assert_eq!(got.len, 10);
        assert_eq!(got.op, Op::Rw as u16);
        let mut data = [0u8; 10];
        mem.read_slice(&mut data[..6], GuestAddress(0x2000 + 24))
            .unwrap();
        mem.read_slice(&mut data[6..], GuestAddress(0x3000))
            .unwrap();
        assert_eq!(&data, b"0123456789");
    }
}
