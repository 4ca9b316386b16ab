//! Reading a descriptor chain out of guest memory, for the devices that do not offer
//! VIRTIO_RING_F_INDIRECT_DESC (block, rng, vsock; the transport refuses a driver
//! that accepts a feature the device does not offer, so none of their drivers can
//! have negotiated it).
//!
//! virtio-queue's `DescriptorChain` follows an indirect descriptor whether or not the
//! feature was negotiated, and ends a chain that does not end (a loop, a `next` past
//! the table, an unreadable descriptor) without a word, cut where it stopped. Here
//! the chain is walked once, from the head the queue popped, and refused as a whole
//! in either case: a driver must not use a feature it did not negotiate (virtio 1.x,
//! 2.7.5.3.1), and a chain cut short is not the request the driver made.

use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use crate::memory::GuestMemoryMmap;

/// Size of a split-ring descriptor in the table.
const DESCRIPTOR_SIZE: u64 = 16;

/// Why a descriptor chain is refused as a whole (the guest's fault).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChainError {
    #[error(
        "descriptor {index} of the chain at head {head} refers to an indirect table, but \
         VIRTIO_RING_F_INDIRECT_DESC was not negotiated (the device does not offer it)"
    )]
    IndirectNotNegotiated { head: u16, index: u16 },
    #[error(
        "the chain at head {head} does not end within the queue's {size} descriptors (it loops)"
    )]
    Endless { head: u16, size: u16 },
    #[error("the chain at head {head} names descriptor {index}, past the queue's {size}")]
    OutsideTable { head: u16, index: u16, size: u16 },
    #[error(
        "cannot read descriptor {index} of the chain at head {head} from guest address {addr:#x}"
    )]
    Unreadable { head: u16, index: u16, addr: u64 },
}

/// Copies the chain that starts at descriptor `head` of `queue`'s table into
/// `descriptors` (cleared first), each descriptor read from guest memory once: the
/// guest may rewrite them at any time, and what the device checks must be what it
/// uses. At most the queue's size of them, as many as a chain that visits each
/// descriptor once can have.
pub fn read_chain(
    queue: &Queue,
    memory: &GuestMemoryMmap,
    head: u16,
    descriptors: &mut Vec<Descriptor>,
) -> Result<(), ChainError> {
    descriptors.clear();
    let size = queue.size();
    let table = queue.desc_table();
    let mut index = head;
    loop {
        if index >= size {
            return Err(ChainError::OutsideTable { head, index, size });
        }
        if descriptors.len() == usize::from(size) {
            return Err(ChainError::Endless { head, size });
        }
        let offset = u64::from(index) * DESCRIPTOR_SIZE;
        let descriptor = table
            .checked_add(offset)
            .and_then(|addr| memory.read_obj::<Descriptor>(GuestAddress(addr)).ok())
            .ok_or(ChainError::Unreadable {
                head,
                index,
                addr: table.wrapping_add(offset),
            })?;
        if descriptor.refers_to_indirect_table() {
            return Err(ChainError::IndirectNotNegotiated { head, index });
        }
        descriptors.push(descriptor);
        if !descriptor.has_next() {
            return Ok(());
        }
        index = descriptor.next();
    }
}

/// What a device reads its chains with, for one activation: the chain being handled
/// (kept for its allocation), and whether a refused chain was told yet.
#[derive(Debug)]
pub struct ChainReader {
    descriptors: Vec<Descriptor>,
    pub(super) refused_told: bool,
}

impl ChainReader {
    /// Room for chains of up to `capacity` descriptors before it grows.
    pub fn new(capacity: usize) -> ChainReader {
        ChainReader {
            descriptors: Vec::with_capacity(capacity),
            refused_told: false,
        }
    }

    /// The chain that starts at `head` ([`read_chain`]). A refused one is said: the
    /// first time since the device was activated as a guest warning, later ones at
    /// debug level (a driver that sends one such chain usually sends many, and the
    /// first says what is wrong).
    pub fn read(
        &mut self,
        device: &str,
        queue: &Queue,
        memory: &GuestMemoryMmap,
        head: u16,
    ) -> Result<&[Descriptor], ChainError> {
        match read_chain(queue, memory, head, &mut self.descriptors) {
            Ok(()) => Ok(&self.descriptors),
            Err(error) if self.refused_told => {
                tracing::debug!("{device}: descriptor chain refused: {error}");
                Err(error)
            }
            Err(error) => {
                self.refused_told = true;
                guest_log::guest_warn!(
                    "{device}: descriptor chain refused and returned unused: {error} (later \
                     refused chains are logged at debug level only, until the device is reset)"
                );
                Err(error)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT};
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;

    const NEXT: u16 = VRING_DESC_F_NEXT as u16;
    const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    fn raw(addr: u64, flags: u16, next: u16) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, 16, flags, next))
    }

    /// The descriptors at table entries 0.. and the queue over them (16 entries).
    fn queue_with(memory: &GuestMemoryMmap, table: &[RawDescriptor]) -> Queue {
        let ring = MockSplitQueue::new(memory, 16);
        ring.add_desc_chains(table, 0).unwrap();
        ring.create_queue().unwrap()
    }

    fn addresses(descriptors: &[Descriptor]) -> Vec<u64> {
        descriptors.iter().map(|d| d.addr().0).collect()
    }

    #[test]
    fn a_chain_is_read_to_its_end_in_order() {
        let memory = memory();
        let queue = queue_with(
            &memory,
            &[
                raw(0x1000, NEXT, 3),
                raw(0x2000, 0, 0),
                raw(0, 0, 0),
                raw(0x3000, NEXT, 1),
            ],
        );
        let mut descriptors = vec![Descriptor::default(); 3];
        read_chain(&queue, &memory, 0, &mut descriptors).unwrap();
        assert_eq!(addresses(&descriptors), [0x1000, 0x3000, 0x2000]);
        // A chain as long as the queue, each descriptor once, is whole.
        let whole: Vec<RawDescriptor> = (0..16u16)
            .map(|i| {
                let flags = if i < 15 { NEXT } else { 0 };
                raw(0x1000 * u64::from(i), flags, i + 1)
            })
            .collect();
        let queue = queue_with(&memory, &whole);
        read_chain(&queue, &memory, 0, &mut descriptors).unwrap();
        assert_eq!(descriptors.len(), 16);
    }

    /// An indirect descriptor, at the head or after direct ones, refuses the chain:
    /// its table is never read.
    #[test]
    fn an_indirect_descriptor_refuses_the_chain() {
        let memory = memory();
        let queue = queue_with(
            &memory,
            &[
                raw(0x8000, INDIRECT, 0),
                raw(0x1000, NEXT, 2),
                raw(0x8000, INDIRECT, 0),
            ],
        );
        let mut descriptors = Vec::new();
        assert_eq!(
            read_chain(&queue, &memory, 0, &mut descriptors),
            Err(ChainError::IndirectNotNegotiated { head: 0, index: 0 })
        );
        assert_eq!(
            read_chain(&queue, &memory, 1, &mut descriptors),
            Err(ChainError::IndirectNotNegotiated { head: 1, index: 2 })
        );
    }

    /// A chain that loops, or names a descriptor past the table, is refused rather
    /// than handed on cut where it stopped.
    #[test]
    fn a_chain_that_does_not_end_is_refused() {
        let memory = memory();
        let queue = queue_with(
            &memory,
            &[
                raw(0x1000, NEXT, 1),
                raw(0x2000, NEXT, 0),
                raw(0x3000, NEXT, 16),
            ],
        );
        let mut descriptors = Vec::new();
        assert_eq!(
            read_chain(&queue, &memory, 0, &mut descriptors),
            Err(ChainError::Endless { head: 0, size: 16 })
        );
        assert_eq!(
            read_chain(&queue, &memory, 2, &mut descriptors),
            Err(ChainError::OutsideTable {
                head: 2,
                index: 16,
                size: 16
            })
        );
        assert_eq!(
            read_chain(&queue, &memory, 16, &mut descriptors),
            Err(ChainError::OutsideTable {
                head: 16,
                index: 16,
                size: 16
            })
        );
    }

    #[test]
    fn a_table_outside_guest_memory_is_refused() {
        let memory = memory();
        let mut queue = queue_with(&memory, &[raw(0x1000, 0, 0)]);
        queue.set_desc_table_address(Some(0x20_0000), Some(0));
        let mut descriptors = Vec::new();
        assert_eq!(
            read_chain(&queue, &memory, 1, &mut descriptors),
            Err(ChainError::Unreadable {
                head: 1,
                index: 1,
                addr: 0x20_0010
            })
        );
    }
}
