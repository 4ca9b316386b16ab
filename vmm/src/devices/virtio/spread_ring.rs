//! A split virtqueue for tests, its three parts laid out apart: virtio-queue's mock
//! puts the used ring over the end of the available ring (it sizes the available ring
//! in entries, not bytes), `used_event` included, which EVENT_IDX reads, and creating
//! one zeroes the rings.

use std::sync::atomic::{fence, Ordering};

use virtio_queue::desc::RawDescriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use crate::memory::GuestMemoryMmap;

/// Where the parts lie from the ring's base: the descriptor table first.
const AVAIL_OFFSET: u64 = 0x1000;
const USED_OFFSET: u64 = 0x2000;

/// A ring of `size` entries (at most 256: each part fits in its 4 KiB) at `base`.
#[derive(Debug, Clone, Copy)]
pub struct SpreadRing {
    pub base: u64,
    pub size: u16,
}

impl SpreadRing {
    pub fn new(base: u64, size: u16) -> SpreadRing {
        assert!(size.is_power_of_two() && size <= 256, "size {size}");
        SpreadRing { base, size }
    }

    /// The queue a driver would set up over it, ready.
    pub fn queue(&self, event_idx: bool) -> Queue {
        let mut queue = Queue::new(self.size).unwrap();
        queue.set_desc_table_address(Some(self.base as u32), Some(0));
        queue.set_avail_ring_address(Some((self.base + AVAIL_OFFSET) as u32), Some(0));
        queue.set_used_ring_address(Some((self.base + USED_OFFSET) as u32), Some(0));
        queue.set_event_idx(event_idx);
        queue.set_ready(true);
        queue
    }

    /// Makes the chain `descs` (table entries `head..`) available.
    pub fn offer(&self, mem: &GuestMemoryMmap, head: u16, descs: &[RawDescriptor]) {
        for (entry, desc) in (head..).zip(descs) {
            mem.write_obj(*desc, GuestAddress(self.base + 16 * u64::from(entry)))
                .unwrap();
        }
        let idx = self.avail_idx(mem);
        let slot = self.avail_addr(4 + 2 * u64::from(idx % self.size));
        mem.write_obj(head, slot).unwrap();
        fence(Ordering::SeqCst);
        mem.write_obj(idx.wrapping_add(1), self.avail_addr(2))
            .unwrap();
    }

    /// How many chains the driver made available (the available ring's `idx`).
    pub fn avail_idx(&self, mem: &GuestMemoryMmap) -> u16 {
        mem.read_obj(self.avail_addr(2)).unwrap()
    }

    /// Where the driver says at which used index it wants its next interrupt.
    pub fn used_event_addr(&self) -> GuestAddress {
        self.avail_addr(4 + 2 * u64::from(self.size))
    }

    /// Where the used ring's `flags` are (NO_NOTIFY asks a driver without EVENT_IDX
    /// for no notifications).
    pub fn used_flags_addr(&self) -> GuestAddress {
        self.used_addr(0)
    }

    pub fn used_flags(&self, mem: &GuestMemoryMmap) -> u16 {
        mem.read_obj(self.used_flags_addr()).unwrap()
    }

    /// How many chains the device returned (the used ring's `idx`).
    pub fn used_idx(&self, mem: &GuestMemoryMmap) -> u16 {
        let idx = mem.read_obj(self.used_addr(2)).unwrap();
        fence(Ordering::SeqCst);
        idx
    }

    /// Used element `i` (modulo the size): the chain's head and the used length.
    pub fn used_elem(&self, mem: &GuestMemoryMmap, i: u16) -> (u32, u32) {
        let at = 4 + 8 * u64::from(i % self.size);
        let id = mem.read_obj(self.used_addr(at)).unwrap();
        let len = mem.read_obj(self.used_addr(at + 4)).unwrap();
        (id, len)
    }

    /// Where the device says at which available index it wants its next
    /// notification.
    pub fn avail_event_addr(&self) -> GuestAddress {
        self.used_addr(4 + 8 * u64::from(self.size))
    }

    pub fn avail_event(&self, mem: &GuestMemoryMmap) -> u16 {
        mem.read_obj(self.avail_event_addr()).unwrap()
    }

    fn avail_addr(&self, offset: u64) -> GuestAddress {
        GuestAddress(self.base + AVAIL_OFFSET + offset)
    }

    fn used_addr(&self, offset: u64) -> GuestAddress {
        GuestAddress(self.base + USED_OFFSET + offset)
    }
}
