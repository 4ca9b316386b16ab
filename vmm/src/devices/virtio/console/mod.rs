//! virtio-console (virtio 1.2, section 5.3), output only: the guest's hvc0, for what
//! it writes often. Each line through the 8250 costs a VM exit per byte (12 ms for a
//! 100-byte line in the nested host); here a whole buffer costs one notification (2 ms
//! there, docs/benchmarks.md). The guest agent writes its log here when the device is
//! there; the kernel keeps ttyS0 (it is up before any virtio device, and for a panic).
//!
//! No console features (only the transport's EVENT_IDX): one port, no multiport
//! control queue, no size, no emergency write. The receive queue is never filled
//! (host input goes to the 8250), so it is kept small: Linux gives it a page per
//! descriptor.

use virtio_queue::desc::split::Descriptor;
use virtio_queue::Queue;

use super::{
    queues_of, write_from_guest, ActivateError, ActiveQueue, InterruptTrigger, QueueProgress,
    VirtioDevice, DEVICE_ID_CONSOLE, FEATURE_EVENT_IDX, FEATURE_VERSION_1,
};
use crate::devices::console_output::ConsoleQueue;
use crate::memory::GuestMemoryMmap;

const NAME: &str = "virtio-console";
/// receiveq0 and transmitq0 (port 0; no control queues without MULTIPORT).
const RECEIVE_QUEUE: usize = 0;
const TRANSMIT_QUEUE: usize = 1;
/// The receive queue holds buffers nobody fills: the fewest a ring may have.
const RECEIVE_QUEUE_SIZE: u16 = 2;
/// Linux sends one buffer at a time on a console port and waits for it to come back.
const TRANSMIT_QUEUE_SIZE: u16 = 64;
/// Most bytes taken from one chain: Linux's hvc sends at most a page per buffer.
pub const MAX_BYTES_PER_CHAIN: u32 = 64 * 1024;

/// The output-only console device.
pub struct Console {
    queue_max_sizes: [u16; 2],
    output: ConsoleQueue,
    transmit: Option<ActiveQueue>,
}

impl Console {
    /// A console whose output goes to `output`, where the 8250's goes too.
    pub fn new(output: ConsoleQueue) -> Self {
        Self {
            queue_max_sizes: [RECEIVE_QUEUE_SIZE, TRANSMIT_QUEUE_SIZE],
            output,
            transmit: None,
        }
    }
}

/// The guest's bytes in one transmit chain, read from its device-readable
/// descriptors in order, up to [`MAX_BYTES_PER_CHAIN`]; a descriptor outside guest
/// memory ends the chain's output there (reported).
fn chain_bytes(descs: &[Descriptor], memory: &GuestMemoryMmap) -> Vec<u8> {
    let mut bytes = Vec::new();
    for desc in descs.iter().filter(|d| !d.is_write_only()) {
        let room = MAX_BYTES_PER_CHAIN as usize - bytes.len();
        if room == 0 {
            break;
        }
        let len = (desc.len() as usize).min(room);
        if let Err(e) = write_from_guest(memory, desc.addr(), len, &mut bytes) {
            guest_log::guest_warn!("{NAME}: output buffer: {e}");
            break;
        }
    }
    bytes
}

impl VirtioDevice for Console {
    fn device_type(&self) -> u32 {
        DEVICE_ID_CONSOLE
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_max_sizes
    }

    fn avail_features(&self) -> u64 {
        FEATURE_VERSION_1 | FEATURE_EVENT_IDX
    }

    // The config space's fields (cols, rows, max_nr_ports, emerg_wr) only mean
    // something with features this device does not offer: it reads as zeros, the
    // trait's default.

    fn activate(
        &mut self,
        memory: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: InterruptTrigger,
    ) -> Result<(), ActivateError> {
        let [_receive, transmit] = queues_of(queues)?;
        self.transmit = Some(ActiveQueue::for_queue(
            memory,
            transmit,
            TRANSMIT_QUEUE,
            interrupt,
        )?);
        Ok(())
    }

    /// The receive queue's buffers wait for input that never comes; every transmit
    /// chain goes back as it is served.
    fn holds_chains(&self, index: usize) -> bool {
        index == RECEIVE_QUEUE
    }

    fn process_queue(&mut self, index: usize) -> QueueProgress {
        let Some(transmit) = self.transmit.as_mut() else {
            tracing::debug!("{NAME}: queue {index} notified before activation");
            return QueueProgress::Done;
        };
        match index {
            // Buffers for input that never comes: they stay with the device.
            RECEIVE_QUEUE => QueueProgress::Done,
            TRANSMIT_QUEUE => {
                let output = &self.output;
                transmit.serve(NAME, |descs, memory| {
                    output.queue_or_drop(&chain_bytes(descs, memory));
                    0u32
                })
            }
            _ => {
                guest_log::guest_warn!("{NAME}: notification for nonexistent queue {index}");
                QueueProgress::Done
            }
        }
    }

    fn reset(&mut self) {
        self.transmit = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::console_output::testing::SharedBuf;
    use crate::devices::console_output::ConsoleOutput;
    use std::sync::Arc;
    use std::time::Duration;

    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    const W: u16 = VRING_DESC_F_WRITE as u16;
    const N: u16 = VRING_DESC_F_NEXT as u16;

    fn raw(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, len, flags, next))
    }

    /// Runs `descs` through the transmit queue; returns what reached the output and
    /// the used entries.
    fn transmit(mem: &GuestMemoryMmap, descs: &[RawDescriptor]) -> (Vec<u8>, Vec<(u32, u32)>) {
        let sink = SharedBuf::default();
        let mut output = ConsoleOutput::new(Box::new(sink.clone()));
        output.start_writing().unwrap();
        let receive = MockSplitQueue::new(mem, RECEIVE_QUEUE_SIZE);
        let vq = MockSplitQueue::create(mem, GuestAddress(0x1_0000), 16);
        vq.add_desc_chains(descs, 0).unwrap();
        let mut console = Console::new(output.queue());
        console
            .activate(
                mem.clone(),
                vec![receive.create_queue().unwrap(), vq.create_queue().unwrap()],
                InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap())),
            )
            .unwrap();
        assert_eq!(console.process_queue(RECEIVE_QUEUE), QueueProgress::Done);
        assert_eq!(console.process_queue(TRANSMIT_QUEUE), QueueProgress::Done);
        assert!(output.finish(Duration::from_secs(10)));
        let used = (0..vq.used().idx().load())
            .map(|i| {
                let e = vq.used().ring().ref_at(i as usize).unwrap().load();
                (e.id(), e.len())
            })
            .collect();
        let written = sink.0.lock().unwrap().clone();
        (written, used)
    }

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap()
    }

    #[test]
    fn the_guests_buffers_reach_the_output_in_order_and_come_back() {
        let mem = memory();
        mem.write_slice(b"guest-agent: ", GuestAddress(0x8_0000))
            .unwrap();
        mem.write_slice(b"hello\n", GuestAddress(0x9_0000)).unwrap();
        mem.write_slice(b"second\n", GuestAddress(0xa_0000))
            .unwrap();
        let (written, used) = transmit(
            &mem,
            &[
                raw(0x8_0000, 13, N, 1),
                raw(0x9_0000, 6, 0, 0),
                raw(0xa_0000, 7, 0, 0),
            ],
        );
        assert_eq!(written, b"guest-agent: hello\nsecond\n");
        assert_eq!(used, [(0, 0), (2, 0)]);
    }

    /// The guest is untrusted: a buffer past its memory ends that chain's output, a
    /// device-writable one is not read, a huge one is capped, and every chain comes
    /// back.
    #[test]
    fn bad_buffers_are_bounded_and_still_returned() {
        let mem = memory();
        mem.write_slice(b"ok", GuestAddress(0x8_0000)).unwrap();
        mem.write_slice(b"SECRET", GuestAddress(0x9_0000)).unwrap();
        let (written, used) = transmit(
            &mem,
            &[
                raw(0x8_0000, 2, N, 1),
                raw(0x3f_fff0, 0x100, 0, 0),
                raw(0x9_0000, 6, W, 0),
                raw(0x10_0000, u32::MAX, 0, 0),
            ],
        );
        assert_eq!(&written[..2], b"ok");
        assert!(!written.windows(6).any(|w| w == b"SECRET"));
        assert_eq!(written.len(), 2 + MAX_BYTES_PER_CHAIN as usize);
        assert_eq!(used.len(), 3);
    }

    #[test]
    fn offers_no_console_features_and_resets() {
        let sink = SharedBuf::default();
        let output = ConsoleOutput::new(Box::new(sink));
        let mut console = Console::new(output.queue());
        assert_eq!(
            console.avail_features(),
            FEATURE_VERSION_1 | FEATURE_EVENT_IDX
        );
        let mut config = [0xff; 12];
        console.read_config(0, &mut config);
        assert_eq!(config, [0; 12]);
        assert_eq!(console.queue_max_sizes(), [2, 64]);
        console.reset();
        assert_eq!(console.process_queue(TRANSMIT_QUEUE), QueueProgress::Done);
        assert!(output.finish(Duration::from_secs(10)));
    }
}
