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

/// Answers every available request with EIO; true when the driver wants an
/// interrupt.
pub fn fail_requests(queue: &mut Queue, memory: &GuestMemoryMmap) -> bool {
    let mut used_any = false;
    loop {
        while let Some(chain) = queue.pop_descriptor_chain(memory) {
            let head = chain.head_index();
            let written = answer_with_eio(chain, memory);
            if let Err(e) = queue.add_used(memory, head, written) {
                tracing::error!("virtio-fs: cannot return descriptor {head}: {e}");
                return used_any;
            }
            used_any = true;
        }
        // Re-arm notifications and catch requests that raced with it. A driver whose
        // available index is out of range has requests that never pop: not a race.
        match queue.enable_notification(memory) {
            Ok(true) if !avail_index_out_of_range(queue, memory) => continue,
            _ => break,
        }
    }
    used_any && queue.needs_notification(memory).unwrap_or(true)
}

/// Whether the driver's available index is more than a queue's worth ahead of the next
/// request (or unreadable): virtio-queue then refuses to pop anything, and the guest
/// broke its ring. Its requests stay unanswered until it resets the device.
fn avail_index_out_of_range(queue: &Queue, memory: &GuestMemoryMmap) -> bool {
    let Ok(avail) = queue.avail_idx(memory, Ordering::Acquire) else {
        return true;
    };
    let pending = avail - Wrapping(queue.next_avail());
    let out_of_range = pending.0 > queue.size();
    if out_of_range {
        tracing::warn!(
            "virtio-fs: the driver's available index {} is {} requests ahead of the next \
             (queue size {}); its requests are no longer answered",
            avail.0,
            pending.0,
            queue.size()
        );
    }
    out_of_range
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
