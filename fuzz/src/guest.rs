//! The guest's side: a small guest memory with a hole in it (so that ranges across
//! the hole, past the end, or wrapping around are all one byte away), the fuzzer's
//! bytes as its contents, and virtio queues wherever the "driver" puts them.

use vm_memory::{Bytes, GuestAddress};
use vmm::memory::GuestMemoryMmap;

use crate::input::Reader;

/// Two RAM regions with a hole between them: [0, 32 KiB) and [64 KiB, 96 KiB).
pub const REGIONS: [(u64, usize); 2] = [(0, 0x8000), (0x1_0000, 0x8000)];

/// The fuzzer's addresses keep 17 bits: both regions, the hole, and past the end.
pub fn near_memory(v: u32) -> u32 {
    v & 0x1_ffff
}

/// Guest memory holding `image` from address 0 on, continued in the second region
/// (the rest is zeros).
pub fn memory(image: &[u8]) -> GuestMemoryMmap {
    let ranges: Vec<(GuestAddress, usize)> = REGIONS
        .iter()
        .map(|&(start, len)| (GuestAddress(start), len))
        .collect();
    let memory = GuestMemoryMmap::from_ranges(&ranges).expect("a few KiB of anonymous memory");
    let mut rest = image;
    for (start, len) in REGIONS {
        let (here, later) = rest.split_at(rest.len().min(len));
        memory
            .write_slice(here, GuestAddress(start))
            .expect("within the region");
        rest = later;
    }
    memory
}

/// Writes what fits of `bytes` at `addr`, skipping what falls in no region, as a
/// guest's other vCPU might change its rings at any time.
pub fn poke(memory: &GuestMemoryMmap, addr: u64, bytes: &[u8]) {
    for (i, byte) in bytes.iter().enumerate() {
        let _ = memory.write_obj(*byte, GuestAddress(addr.wrapping_add(i as u64)));
    }
}

/// In a layout's size byte (whose low four bits are the size's power of two): the
/// driver negotiated EVENT_IDX.
const EVENT_IDX_BIT: u8 = 0x10;

/// Where a driver put one queue, how large it made it, and whether with EVENT_IDX.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLayout {
    pub size: u16,
    /// Whether the driver negotiated VIRTIO_RING_F_EVENT_IDX, for a harness that
    /// hands the queue to the device itself (the `mmio` harness negotiates through
    /// the transport's registers instead).
    pub event_idx: bool,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
}

impl QueueLayout {
    /// Addresses in or near guest memory ([`near_memory`]), and a power of two for
    /// the size (other sizes only make the transport refuse the queue, which the
    /// `mmio` harness's register writes cover).
    pub fn read(r: &mut Reader) -> QueueLayout {
        let near = |v: u32| u64::from(near_memory(v));
        let size_byte = r.u8();
        QueueLayout {
            size: 1 << (size_byte % 16),
            event_idx: size_byte & EVENT_IDX_BIT != 0,
            desc: near(r.u32()),
            avail: near(r.u32()),
            used: near(r.u32()),
        }
    }

    pub fn write(&self, w: &mut crate::input::Writer) {
        let event_idx = if self.event_idx { EVENT_IDX_BIT } else { 0 };
        w.u8(self.size.trailing_zeros() as u8 | event_idx)
            .u32(self.desc as u32)
            .u32(self.avail as u32)
            .u32(self.used as u32);
    }

    /// The queue as a device would get it at activation, or None where the transport
    /// would refuse to activate: a value the queue rejects (a size that is not a
    /// power of two or above `max_size`, a misaligned ring), rings outside memory.
    pub fn queue(&self, max_size: u16, memory: &GuestMemoryMmap) -> Option<virtio_queue::Queue> {
        use virtio_queue::QueueT;
        let mut queue = virtio_queue::Queue::new(max_size).ok()?;
        queue.try_set_size(self.size).ok()?;
        queue
            .try_set_desc_table_address(GuestAddress(self.desc))
            .ok()?;
        queue
            .try_set_avail_ring_address(GuestAddress(self.avail))
            .ok()?;
        queue
            .try_set_used_ring_address(GuestAddress(self.used))
            .ok()?;
        queue.set_ready(true);
        queue.set_event_idx(self.event_idx);
        queue.is_valid(memory).then_some(queue)
    }
}

/// A descriptor (virtio 1.2, 2.7.5), as it sits in the table.
pub fn descriptor(addr: u64, len: u32, flags: u16, next: u16) -> Vec<u8> {
    let mut raw = Vec::with_capacity(16);
    raw.extend_from_slice(&addr.to_le_bytes());
    raw.extend_from_slice(&len.to_le_bytes());
    raw.extend_from_slice(&flags.to_le_bytes());
    raw.extend_from_slice(&next.to_le_bytes());
    raw
}

/// An available ring offering `heads` (flags 0: the device interrupts).
pub fn avail_ring(heads: &[u16]) -> Vec<u8> {
    let mut raw = vec![0, 0];
    raw.extend_from_slice(&(heads.len() as u16).to_le_bytes());
    for head in heads {
        raw.extend_from_slice(&head.to_le_bytes());
    }
    raw
}

/// The used ring's index.
pub fn used_index(memory: &GuestMemoryMmap, used: u64) -> u16 {
    memory.read_obj(GuestAddress(used + 2)).unwrap_or(0)
}

/// The used ring's element `i`: (descriptor id, length written).
pub fn used_element(memory: &GuestMemoryMmap, used: u64, i: u16) -> (u32, u32) {
    let at = used + 4 + 8 * u64::from(i);
    let read = |at: u64| memory.read_obj::<u32>(GuestAddress(at)).unwrap_or(0);
    (read(at), read(at + 4))
}

/// Descriptor flags.
pub const NEXT: u16 = 1;
pub const WRITE: u16 = 2;
