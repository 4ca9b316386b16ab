//! virtio-rng, the entropy device (virtio 1.2, section 5.4): one queue whose
//! device-writable buffers are filled from the host's getrandom(2).

use virtio_queue::desc::split::Descriptor;
use virtio_queue::Queue;
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{ReadVolatile, VolatileMemoryError, VolatileSlice};

use super::{
    read_into_guest, serve_single_queue, ActivateError, ActiveQueue, GuestIoError,
    InterruptTrigger, QueueProgress, VirtioDevice, DEVICE_ID_RNG, FEATURE_EVENT_IDX,
    FEATURE_VERSION_1,
};
use crate::memory::GuestMemoryMmap;

/// Size of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Most bytes handed out per descriptor chain, so one request cannot keep the event
/// loop in getrandom for long.
pub const MAX_BYTES_PER_CHAIN: u32 = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum RngError {
    #[error("cannot fill guest buffer {addr:#x}+{len:#x} with random bytes: {source}")]
    Fill {
        addr: u64,
        len: u32,
        source: GuestIoError,
    },
}

/// The entropy device.
pub struct Rng {
    queue_max_sizes: [u16; 1],
    active: Option<ActiveQueue>,
}

impl Default for Rng {
    fn default() -> Self {
        Self::new()
    }
}

impl Rng {
    pub fn new() -> Self {
        Self {
            queue_max_sizes: [QUEUE_SIZE],
            active: None,
        }
    }
}

/// getrandom(2) as a byte source for guest memory.
struct GetRandom;

impl ReadVolatile for GetRandom {
    fn read_volatile<B: BitmapSlice>(
        &mut self,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let guard = buf.ptr_guard_mut();
        // SAFETY: `guard` points at `buf.len()` bytes of mapped guest memory that stay
        // mapped while it lives; getrandom writes at most that many bytes there.
        let n = unsafe { libc::getrandom(guard.as_ptr().cast::<libc::c_void>(), buf.len(), 0) };
        if n < 0 {
            return Err(VolatileMemoryError::IOError(std::io::Error::last_os_error()));
        }
        let n = usize::try_from(n)
            .map_err(|_| VolatileMemoryError::IOError(std::io::Error::last_os_error()))?;
        buf.bitmap().mark_dirty(0, n);
        Ok(n)
    }
}

/// Fills the device-writable descriptors of one chain, up to the per-chain cap, and
/// returns the bytes written. Device-readable and empty descriptors are skipped.
fn fill_chain(descs: &[Descriptor], memory: &GuestMemoryMmap) -> u32 {
    let mut written = 0u32;
    for desc in descs.iter().filter(|d| d.is_write_only()) {
        if written == MAX_BYTES_PER_CHAIN {
            break;
        }
        let len = desc.len().min(MAX_BYTES_PER_CHAIN - written);
        if len == 0 {
            continue;
        }
        if let Err(source) = read_into_guest(memory, desc.addr(), len as usize, &mut GetRandom) {
            guest_log::guest_warn!(
                "virtio-rng: {}",
                RngError::Fill {
                    addr: desc.addr().0,
                    len,
                    source
                }
            );
            break;
        }
        written += len;
    }
    written
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        DEVICE_ID_RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_max_sizes
    }

    fn avail_features(&self) -> u64 {
        FEATURE_VERSION_1 | FEATURE_EVENT_IDX
    }

    fn activate(
        &mut self,
        memory: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: InterruptTrigger,
    ) -> Result<(), ActivateError> {
        self.active = Some(ActiveQueue::new(memory, queues, interrupt)?);
        Ok(())
    }

    /// Every chain goes back as it is served.
    fn holds_chains(&self, _index: usize) -> bool {
        false
    }

    fn process_queue(&mut self, index: usize) -> QueueProgress {
        serve_single_queue(self.active.as_mut(), "virtio-rng", index, fill_chain)
    }

    fn reset(&mut self) {
        self.active = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use virtio_queue::QueueT;

    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::split::Descriptor;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    const W: u16 = VRING_DESC_F_WRITE as u16;
    const N: u16 = VRING_DESC_F_NEXT as u16;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap()
    }

    fn raw(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, len, flags, next))
    }

    fn run(mem: &GuestMemoryMmap, descs: &[RawDescriptor]) -> (Vec<(u32, u32)>, Arc<EventFd>) {
        let irq = Arc::new(EventFd::new(EFD_NONBLOCK).unwrap());
        let vq = MockSplitQueue::new(mem, 16);
        vq.add_desc_chains(descs, 0).unwrap();
        let mut rng = Rng::new();
        rng.activate(
            mem.clone(),
            vec![vq.create_queue().unwrap()],
            InterruptTrigger::new(irq.clone()),
        )
        .unwrap();
        assert_eq!(rng.process_queue(0), QueueProgress::Done);
        let used = (0..vq.used().idx().load())
            .map(|i| {
                let e = vq.used().ring().ref_at(i as usize).unwrap().load();
                (e.id(), e.len())
            })
            .collect();
        (used, irq)
    }

    #[test]
    fn fills_writable_buffers_and_skips_readable_ones() {
        let mem = memory();
        mem.write_slice(&[0u8; 4096], GuestAddress(0x10_0000))
            .unwrap();
        mem.write_slice(&[0x77u8; 64], GuestAddress(0x20_0000))
            .unwrap();
        let descs = [
            raw(0x20_0000, 64, N, 1),
            raw(0x10_0000, 2048, W | N, 2),
            raw(0x10_0800, 2048, W, 0),
        ];
        let (used, irq) = run(&mem, &descs);
        assert_eq!(used, vec![(0, 4096)]);
        assert_eq!(irq.read().unwrap(), 1);
        let mut got = vec![0u8; 4096];
        mem.read_slice(&mut got, GuestAddress(0x10_0000)).unwrap();
        // 4 KiB of zeros after getrandom is (practically) impossible.
        assert!(got.iter().filter(|&&b| b != 0).count() > 3000);
        let mut ro = [0u8; 64];
        mem.read_slice(&mut ro, GuestAddress(0x20_0000)).unwrap();
        assert_eq!(ro, [0x77; 64]);
    }

    /// An empty writable buffer is passed over: the ones after it are filled.
    #[test]
    fn empty_writable_buffers_are_skipped() {
        let mem = memory();
        mem.write_slice(&[0u8; 64], GuestAddress(0x10_0000))
            .unwrap();
        let descs = [raw(0x20_0000, 0, W | N, 1), raw(0x10_0000, 64, W, 0)];
        let (used, _) = run(&mem, &descs);
        assert_eq!(used, vec![(0, 64)]);
        let mut got = [0u8; 64];
        mem.read_slice(&mut got, GuestAddress(0x10_0000)).unwrap();
        // 64 bytes of zeros after getrandom is (practically) impossible.
        assert!(got.iter().any(|&b| b != 0));
    }

    /// The cap holds across buffers: the one reaching it is filled in part, the
    /// ones after it not at all.
    #[test]
    fn caps_each_chain_across_buffers() {
        let mem = memory();
        mem.write_slice(&[0u8; 16], GuestAddress(0x30_0000))
            .unwrap();
        let half = MAX_BYTES_PER_CHAIN / 2;
        let descs = [
            raw(0x10_0000, half, W | N, 1),
            raw(0x20_0000, MAX_BYTES_PER_CHAIN, W | N, 2),
            raw(0x30_0000, 16, W, 0),
        ];
        let (used, _) = run(&mem, &descs);
        assert_eq!(used, vec![(0, MAX_BYTES_PER_CHAIN)]);
        let mut last = [0u8; 16];
        mem.read_slice(&mut last, GuestAddress(0x30_0000)).unwrap();
        assert_eq!(last, [0; 16]);
    }

    #[test]
    fn caps_each_chain() {
        let mem = memory();
        let (used, _) = run(&mem, &[raw(0x10_0000, 0x20_0000, W, 0)]);
        assert_eq!(used, vec![(0, MAX_BYTES_PER_CHAIN)]);
    }

    #[test]
    fn stops_at_buffers_outside_memory() {
        let mem = memory();
        let descs = [
            raw(0x10_0000, 512, W | N, 1),
            raw(0x3f_ff00, 512, W, 0), // crosses the end of guest memory
        ];
        let (used, _) = run(&mem, &descs);
        assert_eq!(used, vec![(0, 512)]);
        let (used, _) = run(&mem, &[raw(0x10_0000, 16, 0, 0)]);
        assert_eq!(used, vec![(0, 0)]);
    }

    /// A driver that did not negotiate VIRTIO_RING_F_INDIRECT_DESC (the device does
    /// not offer it) must not use an indirect table: a chain through one gets nothing,
    /// its buffers left as they were.
    #[test]
    fn a_chain_through_an_indirect_table_is_refused() {
        const INDIRECT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
        const TABLE: u64 = 0x30_0000;
        let indirect_desc = 1u64 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;
        assert_eq!(Rng::new().avail_features() & indirect_desc, 0);
        let mem = memory();
        mem.write_slice(&[0u8; 64], GuestAddress(0x10_0000))
            .unwrap();
        mem.write_obj(raw(0x10_0000, 64, W, 0), GuestAddress(TABLE))
            .unwrap();
        let (used, _) = run(&mem, &[raw(TABLE, 16, INDIRECT, 0)]);
        assert_eq!(used, vec![(0, 0)]);
        let mut got = [0xffu8; 64];
        mem.read_slice(&mut got, GuestAddress(0x10_0000)).unwrap();
        assert_eq!(got, [0; 64]);
    }

    /// A chain that does not end (it loops back) is refused whole rather than filled
    /// as far as the queue's size.
    #[test]
    fn a_chain_that_does_not_end_gets_nothing() {
        let mem = memory();
        mem.write_slice(&[0u8; 64], GuestAddress(0x10_0000))
            .unwrap();
        let descs = [raw(0x10_0000, 32, W | N, 1), raw(0x10_0020, 32, W | N, 0)];
        let (used, _) = run(&mem, &descs);
        assert_eq!(used, vec![(0, 0)]);
        let mut got = [0xffu8; 64];
        mem.read_slice(&mut got, GuestAddress(0x10_0000)).unwrap();
        assert_eq!(got, [0; 64]);
    }

    #[test]
    fn reset_and_activation_errors() {
        let mem = memory();
        let irq = InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        let mut rng = Rng::new();
        assert_eq!(rng.device_type(), DEVICE_ID_RNG);
        assert_eq!(rng.queue_max_sizes(), &[256]);
        assert!(rng.activate(mem.clone(), vec![], irq.clone()).is_err());
        assert!(rng
            .activate(mem, vec![Queue::new(16).unwrap()], irq)
            .is_err());
        rng.reset();
        assert_eq!(rng.process_queue(0), QueueProgress::Done);
    }
}
