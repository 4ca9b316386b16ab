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
}

/// Answers the available requests with EIO.
pub fn fail_requests(queue: &mut Queue, memory: &GuestMemoryMmap) -> Answered {
    fail_at_most(queue, memory, MAX_ANSWERS_PER_CALL)
}

fn fail_at_most(queue: &mut Queue, memory: &GuestMemoryMmap, max: usize) -> Answered {
    let mut answered = 0;
    // Rounds in a row that took nothing although the ring's index promised more.
    let mut empty_rounds = 0;
    let more = 'answering: loop {
        let mut popped_any = false;
        while let Some(chain) = queue.pop_descriptor_chain(memory) {
            let head = chain.head_index();
            let written = answer_with_eio(chain, memory);
            if let Err(e) = queue.add_used(memory, head, written) {
                guest_log::guest_warn!("virtio-fs: cannot return descriptor {head}: {e}");
                break 'answering false;
            }
            popped_any = true;
            answered += 1;
            if answered == max {
                break 'answering true;
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
                break false;
            }
            _ => break false,
        }
    };
    Answered {
        notify: answered > 0 && queue.needs_notification(memory).unwrap_or(true),
        more,
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
         queue size {}) offers requests that cannot be taken; they are no longer answered",
        queue.avail_ring(),
        queue.next_avail(),
        queue.size()
    );
}

/// Writes a fuse_out_header carrying -EIO; returns the bytes written (0 for requests
/// that expect no reply, such as FORGET, or that are malformed).
fn answer_with_eio(
    chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
    memory: &GuestMemoryMmap,
) -> u32 {
    let descriptors: Vec<_> = chain.collect();
    let Some(input) = descriptors.iter().find(|d| !d.is_write_only()) else {
        return 0;
    };
    let Some(output) = descriptors.iter().find(|d| d.is_write_only()) else {
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
        assert!(!fail_at_most(&mut queue, &memory, 2).more);
        assert_eq!(reply(&memory, 2).unique, 102);
    }
}
