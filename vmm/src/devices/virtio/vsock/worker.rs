//! The vsock worker thread: owns guest memory, the three queues and the muxer, and
//! waits in epoll on the host sockets and on the event fds through which the
//! device's `process_queue` and `reset` reach it.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::thread::JoinHandle;

use virtio_queue::{Queue, QueueT};
use vmm_sys_util::epoll::{ControlOperation, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::muxer::Muxer;
use super::packet::{read_tx_packet, PacketError, RxBuffer, MAX_CHAIN_DESCS, MAX_PKT_LEN};
use crate::devices::virtio::chain::ChainReader;
use crate::devices::virtio::{
    hold_notifications, more_after_budget, take_head_or_ask_for_notifications, InterruptTrigger,
};
use crate::memory::GuestMemoryMmap;

pub const RX_QUEUE: usize = 0;
pub const TX_QUEUE: usize = 1;
pub const EVENT_QUEUE: usize = 2;
pub const NUM_QUEUES: usize = 3;

/// epoll tokens of the worker's own fds (below the muxer's).
const STOP_TOKEN: u64 = 0;
const QUEUE_TOKEN_BASE: u64 = 1;

const MAX_EVENTS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("cannot register an eventfd with epoll: {0}")]
    Register(std::io::Error),
    #[error("cannot start the vsock worker thread: {0}")]
    Spawn(std::io::Error),
}

/// The device's end: wake-ups for the worker, and the thread to join.
pub struct WorkerHandle {
    queue_evts: [Arc<EventFd>; NUM_QUEUES],
    stop: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
}

impl WorkerHandle {
    /// Wakes the worker for queue `index` (ignored when out of range).
    pub fn notify(&self, index: usize) {
        if let Some(evt) = self.queue_evts.get(index) {
            if let Err(e) = evt.write(1) {
                tracing::warn!("vsock: cannot wake the worker: {e}");
            }
        }
    }

    /// Stops the worker and waits for it; connections close with it.
    pub fn stop(&mut self) {
        if let Err(e) = self.stop.write(1) {
            tracing::error!("vsock: cannot signal the worker to stop: {e}");
        }
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("vsock: the worker thread panicked");
            }
        }
    }

    /// Whether the thread is still running (false after a panic or stop).
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Worker {
    datapath: Datapath,
    queue_evts: [Arc<EventFd>; NUM_QUEUES],
    stop: Arc<EventFd>,
}

/// What the guest's queues carry, moved through the muxer: packets the guest sent
/// are taken off the tx queue, packets for it fill the rx queue's buffers. Everything
/// here is driven by the guest's descriptors and memory, and checked.
pub struct Datapath {
    memory: GuestMemoryMmap,
    queues: [Queue; NUM_QUEUES],
    /// Also how a ring the device cannot go on with is told (DEVICE_NEEDS_RESET).
    interrupt: InterruptTrigger,
    pub muxer: Muxer,
    guest_cid: u64,
    scratch: Vec<u8>,
    chains: ChainReader,
}

/// Starts the worker thread, woken for the queues by `kicks` (the queues' ioeventfds)
/// or, without them, by eventfds of its own that [`WorkerHandle::notify`] writes.
pub fn spawn(
    memory: GuestMemoryMmap,
    queues: [Queue; NUM_QUEUES],
    interrupt: InterruptTrigger,
    muxer: Muxer,
    guest_cid: u64,
    kicks: Option<[Arc<EventFd>; NUM_QUEUES]>,
) -> Result<WorkerHandle, WorkerError> {
    let new_evt = || {
        EventFd::new(EFD_NONBLOCK)
            .map(Arc::new)
            .map_err(WorkerError::EventFd)
    };
    let queue_evts = match kicks {
        Some(kicks) => kicks,
        None => [new_evt()?, new_evt()?, new_evt()?],
    };
    let stop = new_evt()?;
    let datapath = Datapath::new(memory, queues, interrupt, muxer, guest_cid);
    let epoll = datapath.muxer.epoll();
    epoll
        .ctl(
            ControlOperation::Add,
            stop.as_raw_fd(),
            EpollEvent::new(EventSet::IN, STOP_TOKEN),
        )
        .map_err(WorkerError::Register)?;
    for (i, evt) in queue_evts.iter().enumerate() {
        epoll
            .ctl(
                ControlOperation::Add,
                evt.as_raw_fd(),
                EpollEvent::new(EventSet::IN, QUEUE_TOKEN_BASE + i as u64),
            )
            .map_err(WorkerError::Register)?;
    }
    let worker = Worker {
        datapath,
        queue_evts: queue_evts.clone(),
        stop: stop.clone(),
    };
    let thread = std::thread::Builder::new()
        .name("vsock".into())
        .spawn(move || worker.run())
        .map_err(WorkerError::Spawn)?;
    Ok(WorkerHandle {
        queue_evts,
        stop,
        thread: Some(thread),
    })
}

impl Worker {
    fn run(mut self) {
        let mut events = vec![EpollEvent::default(); MAX_EVENTS];
        // Packets may already be waiting when the driver sets DRIVER_OK.
        let mut more = self.process();
        loop {
            // With chains left over from the last round, only look at what else is
            // ready (a stop, a host socket) before the next.
            let timeout = if more {
                0
            } else {
                self.datapath.muxer.poll_timeout_ms()
            };
            let n = match self.datapath.muxer.epoll().wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("vsock: epoll_wait failed, worker stops: {e}");
                    return;
                }
            };
            for event in &events[..n] {
                let token = event.data();
                if token == STOP_TOKEN {
                    return;
                }
                if (QUEUE_TOKEN_BASE..QUEUE_TOKEN_BASE + NUM_QUEUES as u64).contains(&token) {
                    let index = (token - QUEUE_TOKEN_BASE) as usize;
                    // Clears the counter; the queue itself is scanned below.
                    let _ = self.queue_evts[index].read();
                    continue;
                }
                self.datapath.muxer.handle_event(token, event.event_set());
            }
            if self.stop.read().is_ok() {
                return;
            }
            self.datapath.muxer.resume_accepting_if_due();
            self.datapath.muxer.expire_overdue();
            more = self.process();
        }
    }

    /// Takes what the guest sent, then fills receive buffers, a ring's worth of each at
    /// most; returns whether either queue has more for the next round.
    fn process(&mut self) -> bool {
        let tx = self.datapath.process_tx();
        let rx = self.datapath.process_rx();
        if tx.used {
            self.notify(TX_QUEUE);
        }
        if rx.used {
            self.notify(RX_QUEUE);
        }
        tx.more || rx.more
    }

    fn notify(&mut self, index: usize) {
        match self.datapath.needs_notification(index) {
            Ok(false) => {}
            Ok(true) => self.datapath.interrupt.signal_used_queue(),
            Err(e) => {
                tracing::warn!("vsock: cannot check whether to notify: {e}");
                self.datapath.interrupt.signal_used_queue();
            }
        }
    }
}

impl Datapath {
    pub fn new(
        memory: GuestMemoryMmap,
        queues: [Queue; NUM_QUEUES],
        interrupt: InterruptTrigger,
        muxer: Muxer,
        guest_cid: u64,
    ) -> Datapath {
        Datapath {
            memory,
            queues,
            interrupt,
            muxer,
            guest_cid,
            scratch: vec![0u8; MAX_PKT_LEN as usize],
            chains: ChainReader::new(MAX_CHAIN_DESCS),
        }
    }

    /// Whether the driver wants an interrupt for what was just used in queue `index`.
    fn needs_notification(&mut self, index: usize) -> Result<bool, virtio_queue::Error> {
        crate::devices::virtio::driver_wants_interrupt(&mut self.queues[index], &self.memory)
    }

    /// Hands the packets the guest sent to the muxer, a ring's worth at most (the
    /// guest can keep the ring full for ever, and the worker must get to a stop). The
    /// driver is asked for no notifications meanwhile, and for them again once the
    /// ring is empty, as [`crate::devices::virtio::ActiveQueue::serve`] does.
    pub fn process_tx(&mut self) -> Round {
        let mut round = Round::default();
        let queue = &mut self.queues[TX_QUEUE];
        let mut left = queue.size();
        hold_notifications(queue, &self.memory, "vsock tx");
        while let Some(head) =
            take_head_or_ask_for_notifications(queue, &self.memory, &self.interrupt, "vsock tx")
        {
            let result = match self.chains.read("vsock", queue, &self.memory, head) {
                Ok(descriptors) => {
                    read_tx_packet(descriptors.iter().copied(), &self.memory, self.guest_cid)
                }
                Err(e) => Err(PacketError::Chain(e)),
            };
            if let Err(e) = queue.add_used(&self.memory, head, 0) {
                self.interrupt
                    .report_unreturnable_head("vsock tx", head, &e);
                break;
            }
            round.used = true;
            match result {
                Ok(pkt) => self.muxer.handle_guest_packet(pkt),
                Err(e) => {
                    self.muxer.stats.bad_packets += 1;
                    tracing::debug!("vsock: dropping a tx packet: {e}");
                }
            }
            left = left.saturating_sub(1);
            if left == 0 {
                round.more = more_after_budget(queue, &self.memory, &self.interrupt, "vsock tx");
                break;
            }
        }
        round
    }

    /// Fills the guest's receive buffers with what the muxer has for it, a ring's
    /// worth at most. The driver's notifications of new receive buffers are wanted
    /// only while the muxer has packets and no buffer to put them in: the worker
    /// looks at the ring whenever it has something to deliver, so each other
    /// notification would be a VM exit for nothing.
    pub fn process_rx(&mut self) -> Round {
        let mut round = Round::default();
        let queue = &mut self.queues[RX_QUEUE];
        let mut left = queue.size();
        hold_notifications(queue, &self.memory, "vsock rx");
        while self.muxer.has_pending_rx() {
            if left == 0 {
                // Packets wait: with no buffer left for them either, the next ones
                // must be notified.
                round.more = more_after_budget(queue, &self.memory, &self.interrupt, "vsock rx");
                break;
            }
            left -= 1;
            let Some(head) = take_head_or_ask_for_notifications(
                queue,
                &self.memory,
                &self.interrupt,
                "vsock rx",
            ) else {
                break;
            };
            let buffer = match self.chains.read("vsock", queue, &self.memory, head) {
                Ok(descriptors) => RxBuffer::from_chain(descriptors.iter().copied(), &self.memory),
                Err(e) => Err(PacketError::Chain(e)),
            };
            let len = match buffer {
                Ok(buf) => {
                    let max = buf.max_payload();
                    match self.muxer.next_rx_packet(&mut self.scratch[..max]) {
                        Some((hdr, n)) => {
                            match buf.write_packet(&self.memory, &hdr, &self.scratch[..n]) {
                                Ok(len) => len,
                                Err(e) => {
                                    tracing::debug!("vsock: cannot deliver a packet: {e}");
                                    self.muxer.delivery_failed(&hdr);
                                    0
                                }
                            }
                        }
                        None => {
                            // Nothing to say after all: give the buffer back.
                            queue.set_next_avail(queue.next_avail().wrapping_sub(1));
                            break;
                        }
                    }
                }
                Err(e) => {
                    self.muxer.stats.bad_packets += 1;
                    tracing::debug!("vsock: unusable rx buffer: {e}");
                    0
                }
            };
            if let Err(e) = queue.add_used(&self.memory, head, len) {
                self.interrupt
                    .report_unreturnable_head("vsock rx", head, &e);
                break;
            }
            round.used = true;
        }
        round
    }
}

/// What a round over a queue did: whether it used buffers (the driver may want an
/// interrupt), and whether it stopped at its limit with chains still available.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Round {
    pub used: bool,
    pub more: bool,
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use virtio_bindings::virtio_ring::{
        VIRTIO_RING_F_INDIRECT_DESC, VRING_DESC_F_INDIRECT, VRING_DESC_F_WRITE,
    };
    use virtio_queue::desc::split::Descriptor;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Address, Bytes, GuestAddress};

    use super::super::packet::{Header, Op, HDR_LEN, HOST_CID, TYPE_STREAM};
    use super::super::Vsock;
    use super::*;
    use crate::devices::virtio::spread_ring::SpreadRing;
    use crate::devices::virtio::{VirtioDevice, INTERRUPT_CONFIG_CHANGE};

    const CID: u64 = 3;
    const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;
    const W: u16 = VRING_DESC_F_WRITE as u16;

    fn raw(addr: u64, len: u32, flags: u16) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, len, flags, 0))
    }

    fn used(ring: &MockSplitQueue<'_, GuestMemoryMmap>) -> Vec<(u32, u32)> {
        (0..ring.used().idx().load())
            .map(|i| {
                let e = ring.used().ring().ref_at(usize::from(i)).unwrap().load();
                (e.id(), e.len())
            })
            .collect()
    }

    /// A datapath over the rings (rx, tx, event), its muxer listening at `path`.
    fn datapath_over(
        mem: &GuestMemoryMmap,
        rings: [&MockSplitQueue<'_, GuestMemoryMmap>; NUM_QUEUES],
        path: &std::path::Path,
    ) -> Datapath {
        let listener = Arc::new(UnixListener::bind(path).unwrap());
        let muxer = Muxer::new(CID, path, listener).unwrap();
        let queues = rings.map(|ring| ring.create_queue().unwrap());
        let interrupt = InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        Datapath::new(mem.clone(), queues, interrupt, muxer, CID)
    }

    /// A vsock datapath over 16-entry rings and a fresh socket directory.
    fn small_datapath<'a>(
        mem: &'a GuestMemoryMmap,
        dir: &std::path::Path,
    ) -> ([MockSplitQueue<'a, GuestMemoryMmap>; NUM_QUEUES], Datapath) {
        let rings =
            [0x0, 0x1_0000, 0x2_0000].map(|at| MockSplitQueue::create(mem, GuestAddress(at), 16));
        let datapath = datapath_over(mem, [&rings[0], &rings[1], &rings[2]], &dir.join("v.sock"));
        (rings, datapath)
    }

    /// Writes, at guest address `at`, a packet of an unknown operation, which the
    /// device answers with a RST.
    fn write_unknown_op_packet(mem: &GuestMemoryMmap, at: u64) {
        let packet = Header {
            src_cid: CID,
            dst_cid: HOST_CID,
            src_port: 1,
            dst_port: 2,
            type_: TYPE_STREAM,
            op: 42,
            ..Header::default()
        };
        mem.write_slice(&packet.to_bytes(), GuestAddress(at))
            .unwrap();
    }

    /// A round that fills the last receive buffer with the last packet of its ring's
    /// worth, packets still waiting, must ask for the next buffers too: the guest's
    /// refill would otherwise go unnotified, and the packets wait for ever.
    #[test]
    fn a_round_that_fills_every_buffer_with_packets_left_asks_for_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        const SIZE: u16 = 16;
        let rings = [0x0, 0x1_0000, 0x2_0000].map(|base| SpreadRing::new(base, SIZE));
        let path = dir.path().join("v.sock");
        let listener = Arc::new(UnixListener::bind(&path).unwrap());
        let muxer = Muxer::new(CID, &path, listener).unwrap();
        let interrupt = InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        let queues = rings.map(|ring| ring.queue(true));
        let mut datapath = Datapath::new(mem.clone(), queues, interrupt, muxer, CID);
        // 18 packets the device answers with a reset each: a ring's worth, then two.
        const PACKET: u64 = 0x9_0000;
        write_unknown_op_packet(&mem, PACKET);
        for count in [SIZE, 2] {
            for entry in 0..count {
                rings[TX_QUEUE].offer(&mem, entry, &[raw(PACKET, HDR_LEN as u32, 0)]);
            }
            assert!(datapath.process_tx().used);
        }
        for entry in 0..SIZE {
            let buffer = 0xa_0000 + 0x1000 * u64::from(entry);
            rings[RX_QUEUE].offer(&mem, entry, &[raw(buffer, 4096, W)]);
        }
        let round = datapath.process_rx();
        assert!(round.used && !round.more, "{round:?}");
        assert!(datapath.muxer.has_pending_rx(), "two resets left");
        assert_eq!(
            rings[RX_QUEUE].avail_event(&mem),
            SIZE,
            "the guest's next buffer must be notified"
        );
    }

    /// A tx ring whose available index is more than a ring ahead cannot be read: the
    /// device needs a reset, said once with a configuration change interrupt, and
    /// nothing is taken. (Before: virtio-queue logged it on every kick, and the
    /// driver waited for ever.)
    #[test]
    fn an_unreadable_tx_ring_makes_the_device_need_a_reset() {
        let dir = tempfile::tempdir().unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let (rings, mut datapath) = small_datapath(&mem, dir.path());
        assert_eq!(datapath.process_tx(), Round::default());
        assert!(
            !datapath.interrupt.needs_reset(),
            "an empty ring is no fault"
        );
        rings[TX_QUEUE].avail().idx().store(16 + 1);
        assert_eq!(datapath.process_tx(), Round::default());
        assert!(datapath.interrupt.needs_reset());
        assert_eq!(datapath.interrupt.status(), INTERRUPT_CONFIG_CHANGE);
    }

    /// A receive buffer whose head lies past the table can never be returned: the
    /// device needs a reset. The same for an unreadable rx ring.
    #[test]
    fn rx_rings_the_device_cannot_go_on_with_make_it_need_a_reset() {
        for break_ring in [
            |ring: &MockSplitQueue<'_, GuestMemoryMmap>, mem: &GuestMemoryMmap| {
                ring.add_desc_chains(&[raw(0x8_0000, 4096, W)], 0).unwrap();
                mem.write_obj(16u16 + 3, ring.avail_addr().unchecked_add(4))
                    .unwrap();
            },
            |ring: &MockSplitQueue<'_, GuestMemoryMmap>, _: &GuestMemoryMmap| {
                ring.avail().idx().store(16 + 1);
            },
        ] {
            let dir = tempfile::tempdir().unwrap();
            let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
            let (rings, mut datapath) = small_datapath(&mem, dir.path());
            // Something for the guest: the RST that answers the packet.
            write_unknown_op_packet(&mem, 0x9_0000);
            rings[TX_QUEUE]
                .add_desc_chains(&[raw(0x9_0000, HDR_LEN as u32, 0)], 0)
                .unwrap();
            datapath.process_tx();
            assert!(datapath.muxer.has_pending_rx());
            assert!(!datapath.interrupt.needs_reset());

            break_ring(&rings[RX_QUEUE], &mem);
            assert!(!datapath.process_rx().used);
            assert!(datapath.interrupt.needs_reset());
            assert_eq!(datapath.interrupt.status(), INTERRUPT_CONFIG_CHANGE);
        }
    }

    /// A driver that did not negotiate VIRTIO_RING_F_INDIRECT_DESC (the device does
    /// not offer it) must not use an indirect table: a packet sent through one is not
    /// read, and a receive buffer given through one is not written; both go back to
    /// the driver with a used length of 0.
    #[test]
    fn chains_through_an_indirect_table_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let offered = Vsock::new(CID, &dir.path().join("device.sock"))
            .unwrap()
            .avail_features();
        assert_eq!(offered & (1 << VIRTIO_RING_F_INDIRECT_DESC), 0);

        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let (rings, mut datapath) = small_datapath(&mem, dir.path());
        let [rx, tx, _event] = &rings;
        const PACKET: u64 = 0x8_0000;
        write_unknown_op_packet(&mem, PACKET);
        // One-entry indirect tables: the packet, and a receive buffer.
        const TX_TABLE: u64 = 0x9_0000;
        const RX_TABLE: u64 = 0x9_1000;
        const TABLE_BUFFER: u64 = 0xa_0000;
        const DIRECT_BUFFER: u64 = 0xb_0000;
        mem.write_obj(raw(PACKET, HDR_LEN as u32, 0), GuestAddress(TX_TABLE))
            .unwrap();
        mem.write_obj(raw(TABLE_BUFFER, 4096, W), GuestAddress(RX_TABLE))
            .unwrap();
        mem.write_slice(&[0xee; HDR_LEN], GuestAddress(TABLE_BUFFER))
            .unwrap();
        tx.add_desc_chains(&[raw(TX_TABLE, 16, INDIRECT)], 0)
            .unwrap();
        rx.add_desc_chains(
            &[raw(RX_TABLE, 16, INDIRECT), raw(DIRECT_BUFFER, 4096, W)],
            0,
        )
        .unwrap();

        assert!(datapath.process_tx().used);
        assert_eq!(used(tx), [(0, 0)]);
        assert!(!datapath.muxer.has_pending_rx(), "the packet was read");
        assert_eq!(datapath.muxer.stats.bad_packets, 1);

        // The same packet sent directly is answered: the RST goes to the second
        // receive buffer, the first (through a table) refused.
        tx.add_desc_chains(&[raw(PACKET, HDR_LEN as u32, 0)], 1)
            .unwrap();
        datapath.process_tx();
        assert!(datapath.muxer.has_pending_rx());
        assert!(datapath.process_rx().used);
        assert_eq!(used(rx), [(0, 0), (1, HDR_LEN as u32)]);
        let mut untouched = [0u8; HDR_LEN];
        mem.read_slice(&mut untouched, GuestAddress(TABLE_BUFFER))
            .unwrap();
        assert_eq!(untouched, [0xee; HDR_LEN]);
        let mut answer = [0u8; HDR_LEN];
        mem.read_slice(&mut answer, GuestAddress(DIRECT_BUFFER))
            .unwrap();
        assert_eq!(Header::from_bytes(&answer).op, Op::Rst as u16);
    }
}
