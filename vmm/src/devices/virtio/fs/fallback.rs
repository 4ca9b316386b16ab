//! Answers FUSE requests with EIO once the backend is gone, so guest processes get an
//! error instead of waiting forever on a share that no longer has a server.

use std::num::Wrapping;
use std::sync::atomic::Ordering;

use virtio_queue::{Queue, QueueT};
use vm_memory::{ByteValued, Bytes, GuestAddress};

use crate::memory::GuestMemoryMmap;

/// struct fuse_in_header, the part we need: total length, opcode, request id.
#[derive(Clone, Copy, Default, Debug)]
#[repr(C)]
struct InHeaderStart {
    len: u32,
    opcode: u32,
    unique: u64,
}
// SAFETY: plain integers, no padding, any bit pattern is valid.
unsafe impl ByteValued for InHeaderStart {}

/// struct fuse_out_header.
#[derive(Clone, Copy, Default, Debug)]
#[repr(C)]
struct OutHeader {
    len: u32,
    error: i32,
    unique: u64,
}
// SAFETY: plain integers, no padding, any bit pattern is valid.
unsafe impl ByteValued for OutHeader {}

/// Continues the queue where the backend's replies stopped. virtiofsd runs with one
/// thread (`--thread-pool-size 0`) and so completes requests in order: everything
/// before the used index was answered, everything from it on was not.
pub fn take_over(queue: &mut Queue, memory: &GuestMemoryMmap) {
    let used = queue
        .used_idx(memory, Ordering::Acquire)
        .unwrap_or(Wrapping(0));
    queue.set_next_avail(used.0);
    queue.set_next_used(used.0);
}

/// Most requests one call answers before it lets the worker see its other events (a
/// stop, the other queue). A driver has at most a queue's worth outstanding (1,024
/// for ours); a guest whose rings the replies themselves keep refilling (a reply or
/// used entry written over its available index) would otherwise keep the call going.
const MAX_ANSWERS_PER_CALL: usize = 4 * 1024;

/// What one call of [`fail_requests`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answered {
    /// The driver wants an interrupt.
    pub notify: bool,
    /// It stopped at its limit with requests left: call again (after other events).
    pub more: bool,
    /// The ring cannot be served (requests that cannot be taken, or a head that
    /// cannot be returned): the device needs a reset (DEVICE_NEEDS_RESET).
    pub needs_reset: bool,
}

/// Answers the available requests with EIO.
pub fn fail_requests(queue: &mut Queue, memory: &GuestMemoryMmap) -> Answered {
    fail_at_most(queue, memory, MAX_ANSWERS_PER_CALL)
}

fn fail_at_most(queue: &mut Queue, memory: &GuestMemoryMmap, max: usize) -> Answered {
    let mut answered = 0;
    // Rounds in a row that took nothing although the ring's index promised more.
    let mut empty_rounds = 0;
    // (More left, the device needs a reset.)
    let (more, needs_reset) = 'answering: loop {
        let mut popped_any = false;
        while let Some(chain) = queue.pop_descriptor_chain(memory) {
            let head = chain.head_index();
            let written = answer_with_eio(chain, memory, usize::from(queue.size()));
            if let Err(e) = queue.add_used(memory, head, written) {
                guest_log::guest_warn!(
                    "virtio-fs: cannot return descriptor {head}: {e}; the device needs a \
                     reset (DEVICE_NEEDS_RESET)"
                );
                break 'answering (false, true);
            }
            popped_any = true;
            answered += 1;
            if answered == max {
                break 'answering (true, false);
            }
        }
        // Re-arm notifications and catch requests that raced with it. A ring whose
        // index promises requests that twice in a row do not pop is broken, not
        // racing: the index out of range, or the ring where virtio-queue refuses it
        // (address 0).
        empty_rounds = if popped_any { 0 } else { empty_rounds + 1 };
        match queue.enable_notification(memory) {
            Ok(true) if empty_rounds < 2 => continue,
            Ok(true) => {
                warn_unusable_ring(queue, memory);
                break (false, true);
            }
            Ok(false) => break (false, false),
            Err(e) => {
                guest_log::guest_warn!(
                    "virtio-fs: cannot re-arm the driver's notifications ({e}); the device \
                     needs a reset (DEVICE_NEEDS_RESET)"
                );
                break (false, true);
            }
        }
    };
    Answered {
        notify: answered > 0 && queue.needs_notification(memory).unwrap_or(true),
        more,
        needs_reset,
    }
}

/// The driver's available ring says there are requests, but none can be taken: its
/// requests stay unanswered until it resets the device.
fn warn_unusable_ring(queue: &Queue, memory: &GuestMemoryMmap) {
    let avail = queue
        .avail_idx(memory, Ordering::Acquire)
        .map_or_else(|e| e.to_string(), |idx| idx.0.to_string());
    guest_log::guest_warn!(
        "virtio-fs: the driver's available ring (at {:#x}, index {avail}, next request {}, \
         queue size {}) offers requests that cannot be taken; they are no longer answered, \
         and the device needs a reset (DEVICE_NEEDS_RESET)",
        queue.avail_ring(),
        queue.next_avail(),
        queue.size()
    );
}

/// Writes a fuse_out_header carrying -EIO; returns the bytes written (0 for requests
/// that expect no reply, such as FORGET, or that are malformed).
///
/// Only the first `max_descriptors` of the chain are looked at (the queue's size: an
/// indirect table can hold 65,535, Linux keeps a request within the queue's size),
/// and the walk ends once the request's header and its reply buffer are found.
fn answer_with_eio(
    chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
    memory: &GuestMemoryMmap,
    max_descriptors: usize,
) -> u32 {
    let mut input = None;
    let mut output = None;
    for desc in chain.take(max_descriptors) {
        let first = if desc.is_write_only() {
            &mut output
        } else {
            &mut input
        };
        first.get_or_insert(desc);
        if input.is_some() && output.is_some() {
            break;
        }
    }
    let (Some(input), Some(output)) = (input, output) else {
        return 0;
    };
    let header_len = std::mem::size_of::<OutHeader>() as u32;
    if (input.len() as usize) < std::mem::size_of::<InHeaderStart>() || output.len() < header_len {
        return 0;
    }
    let Ok(request) = memory.read_obj::<InHeaderStart>(GuestAddress(input.addr().0)) else {
        return 0;
    };
    let reply = OutHeader {
        len: header_len,
        error: -libc::EIO,
        unique: request.unique,
    };
    match memory.write_obj(reply, GuestAddress(output.addr().0)) {
        Ok(()) => header_len,
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::GuestAddress;

    const WRITE: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16;
    const NEXT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    /// `count` LOOKUPs with a reply buffer each, on a mock queue of 16.
    fn lookups(memory: &GuestMemoryMmap, count: u16) -> Queue {
        let vq = MockSplitQueue::new(memory, 16);
        let mut chains = Vec::new();
        for i in 0..count {
            let request = 0x8_0000 + 0x100 * u64::from(i);
            let header = InHeaderStart {
                len: 40,
                opcode: 1,
                unique: 100 + u64::from(i),
            };
            memory.write_obj(header, GuestAddress(request)).unwrap();
            let next = 2 * i + 1;
            chains.push(RawDescriptor::from(Descriptor::new(
                request, 40, NEXT, next,
            )));
            chains.push(RawDescriptor::from(Descriptor::new(
                request + 0x80,
                16,
                WRITE,
                0,
            )));
        }
        vq.add_desc_chains(&chains, 0).unwrap();
        vq.create_queue().unwrap()
    }

    fn reply(memory: &GuestMemoryMmap, i: u64) -> OutHeader {
        memory
            .read_obj(GuestAddress(0x8_0000 + 0x100 * i + 0x80))
            .unwrap()
    }

    /// A request through an indirect table (the feature is offered) is looked at up to
    /// the queue's size in descriptors (16 here): its reply buffer after 16 readable
    /// ones is not found, and the request is returned unanswered.
    #[test]
    fn a_request_is_looked_at_no_further_than_the_queue_size() {
        const INDIRECT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
        const TABLE: u64 = 0x4_0000;
        const REQUEST: u64 = 0x8_0000;
        const REPLY: u64 = 0x9_0000;
        let memory = memory();
        let header = InHeaderStart {
            len: 40,
            opcode: 16, // WRITE
            unique: 7,
        };
        memory.write_obj(header, GuestAddress(REQUEST)).unwrap();
        // The header, `payload` readable descriptors, the reply buffer.
        for (payload, answered) in [(14u16, true), (15, false)] {
            memory
                .write_obj(OutHeader::default(), GuestAddress(REPLY))
                .unwrap();
            let mut table = vec![Descriptor::new(REQUEST, 40, NEXT, 1)];
            for i in 1..=payload {
                table.push(Descriptor::new(REQUEST + 0x100, 512, NEXT, i + 1));
            }
            table.push(Descriptor::new(REPLY, 16, WRITE, 0));
            for (i, desc) in table.iter().enumerate() {
                let at = GuestAddress(TABLE + 16 * i as u64);
                memory.write_obj(RawDescriptor::from(*desc), at).unwrap();
            }
            let vq = MockSplitQueue::new(&memory, 16);
            let len = 16 * table.len() as u32;
            let head = RawDescriptor::from(Descriptor::new(TABLE, len, INDIRECT, 0));
            vq.add_desc_chains(&[head], 0).unwrap();
            let mut queue: Queue = vq.create_queue().unwrap();
            let _ = fail_requests(&mut queue, &memory);
            let used = vq.used().ring().ref_at(0).unwrap().load();
            let reply: OutHeader = memory.read_obj(GuestAddress(REPLY)).unwrap();
            let got = (used.len(), reply.unique, reply.error);
            let expected = if answered {
                (16, 7, -libc::EIO)
            } else {
                (0, 0, 0)
            };
            assert_eq!(
                got, expected,
                "{payload} readable descriptors after the header"
            );
        }
    }

    #[test]
    fn a_call_stops_at_its_limit_and_says_more_remain() {
        let memory = memory();
        let mut queue = lookups(&memory, 3);
        assert!(fail_at_most(&mut queue, &memory, 2).more);
        assert_eq!(
            reply(&memory, 2).unique,
            0,
            "the third waits for the next call"
        );
        let last = fail_at_most(&mut queue, &memory, 2);
        assert!(!last.more && !last.needs_reset);
        assert_eq!(reply(&memory, 2).unique, 102);
    }
}
