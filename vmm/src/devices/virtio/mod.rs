//! virtio devices and their MMIO transport.
//!
//! A device implements [`VirtioDevice`]; [`mmio::MmioTransport`] wraps it and speaks
//! the virtio-mmio (version 2, "modern") register protocol to the guest. Queue
//! notifications arrive on ioeventfds that the event loop watches; it then calls
//! [`mmio::MmioTransport::notify_queue`]. Devices raise interrupts through
//! [`InterruptTrigger`], which sets the transport's InterruptStatus and signals the
//! device's irqfd.

pub mod balloon;
pub mod block;
pub mod chain;
pub mod console;
pub mod fs;
pub mod missed_interrupt;
pub mod missed_notification;
pub mod mmio;
pub mod rng;
#[cfg(test)]
pub(crate) mod spread_ring;
pub mod vsock;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{
    Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryError, ReadVolatile, VolatileMemoryError,
    WriteVolatile,
};
use vmm_sys_util::eventfd::EventFd;

use crate::memory::GuestMemoryMmap;

/// virtio device IDs (virtio 1.2, section 5).
pub const DEVICE_ID_BLOCK: u32 = 2;
pub const DEVICE_ID_CONSOLE: u32 = 3;
pub const DEVICE_ID_RNG: u32 = 4;
pub const DEVICE_ID_VSOCK: u32 = 19;

/// VIRTIO_F_VERSION_1: every device we offer is a modern (1.0+) device.
pub const FEATURE_VERSION_1: u64 = 1 << 32;

/// VIRTIO_RING_F_EVENT_IDX (virtio 1.2, 2.7.10): the driver says at which used index it
/// wants its next interrupt, the device at which available index its next
/// notification; each side skips the rest. Offered by every device: those served
/// through [`ActiveQueue`], and vsock, keep the device's side with
/// `take_head_or_ask_for_notifications`; virtio-fs leaves it to virtiofsd.
pub const FEATURE_EVENT_IDX: u64 = 1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

/// InterruptStatus bits (virtio-mmio).
pub const INTERRUPT_USED_BUFFER: u32 = 1;
pub const INTERRUPT_CONFIG_CHANGE: u32 = 2;

/// Raises the device's interrupt: sets a bit in the transport's InterruptStatus and
/// signals the irqfd wired to the device's IOAPIC pin. Also carries the one status
/// bit a device sets on its own, DEVICE_NEEDS_RESET, which comes with an interrupt.
#[derive(Clone)]
pub struct InterruptTrigger {
    status: Arc<AtomicU32>,
    /// DEVICE_NEEDS_RESET: the device cannot go on until the driver resets it. The
    /// transport's Status register shows it; a reset clears it.
    needs_reset: Arc<AtomicBool>,
    /// Bits that read as set whatever the driver acknowledges, until the next reset:
    /// see [`InterruptTrigger::irqfd_for_backend`].
    always_set: Arc<AtomicU32>,
    /// InterruptACK writes so far: tells a driver that acknowledged and got a new
    /// interrupt apart from one that never ran its handler.
    acknowledgements: Arc<AtomicU64>,
    irqfd: Arc<EventFd>,
}

impl InterruptTrigger {
    pub fn new(irqfd: Arc<EventFd>) -> Self {
        Self {
            status: Arc::new(AtomicU32::new(0)),
            needs_reset: Arc::new(AtomicBool::new(false)),
            always_set: Arc::new(AtomicU32::new(0)),
            acknowledgements: Arc::new(AtomicU64::new(0)),
            irqfd,
        }
    }

    /// The irqfd, for a backend process (vhost-user) to interrupt the guest itself
    /// when it has used buffers, without a hop through a VMM thread per completion.
    /// The VMM never sees those signals, so it cannot set the used-buffer bit before
    /// each: from now until the device is reset, InterruptStatus reads it as set
    /// (Firecracker does the same for its vhost-user devices). The driver then looks
    /// at its used rings on every interrupt of the device, which costs nothing when
    /// they hold nothing new.
    pub fn irqfd_for_backend(&self) -> std::io::Result<EventFd> {
        self.always_set
            .fetch_or(INTERRUPT_USED_BUFFER, Ordering::SeqCst);
        self.irqfd.try_clone()
    }

    /// Tells the driver that used buffers are ready.
    pub fn signal_used_queue(&self) {
        self.signal(INTERRUPT_USED_BUFFER);
    }

    pub fn signal_config_change(&self) {
        self.signal(INTERRUPT_CONFIG_CHANGE);
    }

    /// Sets DEVICE_NEEDS_RESET and tells the driver with a configuration change
    /// interrupt, which virtio 1.x (2.1.2) requires once DRIVER_OK is set: a device
    /// only calls this while active, that is after DRIVER_OK. Once set, the interrupt
    /// is not raised again until a reset clears the bit. Linux's virtio core does not
    /// read the bit (as of 6.x): its drivers go on without the device (virtio-blk
    /// rereads its configuration and logs its unchanged size); the guest warning the
    /// device gives with it is what tells a person.
    pub fn signal_needs_reset(&self) {
        if !self.needs_reset.swap(true, Ordering::SeqCst) {
            self.signal_config_change();
        }
    }

    /// Says why a queue's available ring cannot be read and sets DEVICE_NEEDS_RESET,
    /// once until the driver resets the device: the driver's requests would otherwise
    /// go unanswered without a word to the guest or the host.
    pub fn report_unreadable_ring(&self, device: &str, why: &str) {
        if self.needs_reset() {
            return;
        }
        guest_log::guest_warn!(
            "{device}: the driver's available ring cannot be read ({why}); the device needs \
             a reset (DEVICE_NEEDS_RESET) and answers no request until the driver resets it"
        );
        self.signal_needs_reset();
    }

    /// Says that chain `head`, taken off a queue, cannot be returned to the driver (a
    /// head past the table, a used ring that cannot be written) and sets
    /// DEVICE_NEEDS_RESET: that request can never be answered, nor the ones after it
    /// in order.
    pub fn report_unreturnable_head(
        &self,
        device: &str,
        head: u16,
        error: &impl std::fmt::Display,
    ) {
        guest_log::guest_warn!(
            "{device}: cannot return descriptor {head} to the driver: {error}; the device \
             needs a reset (DEVICE_NEEDS_RESET)"
        );
        self.signal_needs_reset();
    }

    /// Whether the device set DEVICE_NEEDS_RESET since the last reset.
    pub fn needs_reset(&self) -> bool {
        self.needs_reset.load(Ordering::SeqCst)
    }

    fn signal(&self, bit: u32) {
        self.status.fetch_or(bit, Ordering::SeqCst);
        self.raise();
    }

    /// Signals the irqfd again, for a driver that missed the interrupt.
    pub fn raise(&self) {
        if let Err(e) = self.irqfd.write(1) {
            tracing::warn!("cannot signal the device's irqfd: {e}");
        }
    }

    /// While the VMM's own bits in InterruptStatus wait for the driver's InterruptACK,
    /// how many acknowledgements came before (`None` when nothing waits): the same
    /// value at two looks means the driver's handler did not run in between.
    pub fn unacknowledged(&self) -> Option<u64> {
        let acknowledgements = self.acknowledgements.load(Ordering::SeqCst);
        (self.status.load(Ordering::SeqCst) != 0).then_some(acknowledgements)
    }

    /// The current InterruptStatus register value.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst) | self.always_set.load(Ordering::SeqCst)
    }

    /// InterruptACK: clears the acknowledged bits.
    pub fn acknowledge(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
        self.acknowledgements.fetch_add(1, Ordering::SeqCst);
    }

    /// Device reset.
    pub fn clear(&self) {
        self.status.store(0, Ordering::SeqCst);
        self.always_set.store(0, Ordering::SeqCst);
        self.needs_reset.store(false, Ordering::SeqCst);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("the driver set up {got} queues, the device needs {expected}")]
    QueueCount { expected: usize, got: usize },
    #[error("queue {index} is not valid (addresses outside guest memory or bad size)")]
    InvalidQueue { index: usize },
    #[error("queue {index} was not made ready (QueueReady) before DRIVER_OK")]
    QueueNotReady { index: usize },
    #[error("device activation failed: {0}")]
    Device(String),
}

/// Copies `config[offset..]` into `data`; bytes past the end of `config` (or an
/// offset that overflows) read as 0, as the guest may probe any offset.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, byte) in data.iter_mut().enumerate() {
        *byte = offset
            .checked_add(i as u64)
            .and_then(|o| usize::try_from(o).ok())
            .and_then(|o| config.get(o).copied())
            .unwrap_or(0);
    }
}

/// The most bytes [`ActiveQueue::serve`] moves in one call, give or take its last
/// chain (no larger itself: virtio-blk refuses a request of more): some milliseconds
/// of copying, where a ring of requests that each claim a
/// disk's worth would hold the event loop for minutes.
pub const SERVE_BYTES: u64 = 64 << 20;

/// What an activated single-queue device (block, rng) works with.
pub struct ActiveQueue {
    memory: GuestMemoryMmap,
    queue: Queue,
    interrupt: InterruptTrigger,
    chains: chain::ChainReader,
}

impl ActiveQueue {
    pub fn new(
        memory: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: InterruptTrigger,
    ) -> Result<Self, ActivateError> {
        let queue = single_ready_queue(queues)?;
        Ok(Self {
            memory,
            chains: chain::ChainReader::new(usize::from(queue.size())),
            queue,
            interrupt,
        })
    }

    /// Queue `index` of a device with several, served as a single-queue device's; one
    /// the driver left unready is named by its index in the device.
    pub fn for_queue(
        memory: GuestMemoryMmap,
        queue: Queue,
        index: usize,
        interrupt: InterruptTrigger,
    ) -> Result<Self, ActivateError> {
        Self::new(memory, vec![queue], interrupt).map_err(|e| match e {
            ActivateError::QueueNotReady { .. } => ActivateError::QueueNotReady { index },
            other => other,
        })
    }

    /// Hands the available descriptor chains to `handle`, which says how many bytes
    /// it wrote into guest memory (and what else it cost, see [`Served`]); returns the
    /// chains to the driver and interrupts it once if it wants to be told. Serves at
    /// most a ring's worth (the queue's size) per call, and stops once the chains
    /// served cost [`SERVE_BYTES`], and returns whether more are available: a guest can keep the
    /// ring full for ever (its requests can even publish the next ones), each chain can
    /// ask for gigabytes (its descriptors may all name the same buffer), and the event
    /// loop that calls this must get back to its other work (a stop, a vCPU's exit) in
    /// between.
    ///
    /// While it serves, the driver is asked not to notify (it would cost a VM exit
    /// for chains this call takes anyway); a call that found the ring empty asks for
    /// notifications again and then looks once more, as a chain made available just
    /// before the driver saw the request would get none. A call that returns
    /// [`QueueProgress::MoreAvailable`] leaves them off: the caller comes back.
    ///
    /// Each chain is read from guest memory once ([`chain::read_chain`]), and `handle`
    /// is given that copy, the one the budget counted: the guest may rewrite its
    /// descriptors at any time (another vCPU), and a second read could find them grown
    /// to 4 GiB. A chain that uses an indirect table (the devices served here do not
    /// offer VIRTIO_RING_F_INDIRECT_DESC) or does not end within the queue's size is
    /// refused whole: `handle` never sees it, and it goes back to the driver with a
    /// used length of 0 (there is no status byte to write: it would lie past the end
    /// that the chain does not have, or in the table that must not be read).
    pub fn serve<S: Into<Served>>(
        &mut self,
        device: &str,
        mut handle: impl FnMut(&[Descriptor], &GuestMemoryMmap) -> S,
    ) -> QueueProgress {
        let mut used_any = false;
        let mut left = self.queue.size();
        let mut bytes_left = SERVE_BYTES;
        // The ring is looked at again before this call ends: the driver's notifications
        // until then would only cost it VM exits.
        hold_notifications(&mut self.queue, &self.memory, device);
        let progress = loop {
            let Some(head) = take_head_or_ask_for_notifications(
                &mut self.queue,
                &self.memory,
                &self.interrupt,
                device,
            ) else {
                break QueueProgress::Done;
            };
            let (served, asked) = match self.chains.read(device, &self.queue, &self.memory, head) {
                Ok(descriptors) => {
                    // What the guest asked for, counted as it claims it (the handler
                    // checks).
                    let asked: u64 = descriptors.iter().map(|desc| u64::from(desc.len())).sum();
                    (handle(descriptors, &self.memory).into(), asked)
                }
                Err(_) => (Served::from(0), 0),
            };
            if let Err(e) = self.queue.add_used(&self.memory, head, served.used_len) {
                self.interrupt.report_unreturnable_head(device, head, &e);
                break QueueProgress::Done;
            }
            used_any = true;
            left = left.saturating_sub(1);
            bytes_left = bytes_left
                .saturating_sub(asked)
                .saturating_sub(served.extra_cost);
            if left == 0 || bytes_left == 0 {
                break if more_after_budget(&mut self.queue, &self.memory, &self.interrupt, device) {
                    QueueProgress::MoreAvailable
                } else {
                    QueueProgress::Done
                };
            }
        };
        if used_any {
            match driver_wants_interrupt(&mut self.queue, &self.memory) {
                Ok(false) => {}
                Ok(true) => self.interrupt.signal_used_queue(),
                Err(e) => {
                    guest_log::guest_warn!("{device}: cannot check whether to notify: {e}");
                    self.interrupt.signal_used_queue();
                }
            }
        }
        progress
    }
}

/// Asks the driver to hold its notifications of `queue`, for a device about to serve
/// it until it is empty (or its budget is spent): with EVENT_IDX nothing is written,
/// as `avail_event` left where it was asks for none; without, the used ring's
/// NO_NOTIFY flag is set. Failing to write the flag loses nothing: the driver then
/// notifies as before.
pub(crate) fn hold_notifications(queue: &mut Queue, memory: &GuestMemoryMmap, device: &str) {
    if let Err(e) = queue.disable_notification(memory) {
        tracing::debug!("{device}: cannot ask the driver for no notifications: {e}");
    }
}

/// Asks the driver to notify the device of its next chain: with EVENT_IDX,
/// `avail_event` set to the first chain not taken (a driver notifies only when its
/// available index passes it); without, the used ring's NO_NOTIFY flag cleared.
/// Returns whether chains came in the meantime, which the driver may not have
/// notified; false when the rings cannot be reached, reported (a driver that is never
/// asked again would wait for ever).
pub(crate) fn ask_for_notifications(
    queue: &mut Queue,
    memory: &GuestMemoryMmap,
    interrupt: &InterruptTrigger,
    device: &str,
) -> bool {
    queue.enable_notification(memory).unwrap_or_else(|e| {
        interrupt.report_unreadable_ring(device, &e.to_string());
        false
    })
}

/// [`take_head`] for a device that holds the driver's notifications while it serves
/// ([`hold_notifications`]): where the ring looks empty, it asks for them again, then
/// looks once more, for a chain made available just before the driver saw the
/// request. (Only once: a chain gone again, as a guest may flip its index back and
/// forth, will be notified.)
pub(crate) fn take_head_or_ask_for_notifications(
    queue: &mut Queue,
    memory: &GuestMemoryMmap,
    interrupt: &InterruptTrigger,
    device: &str,
) -> Option<u16> {
    match pop_head(queue, memory) {
        Ok(Some(head)) => Some(head),
        Ok(None) if ask_for_notifications(queue, memory, interrupt, device) => {
            take_head(queue, memory, interrupt, device)
        }
        Ok(None) => None,
        Err(why) => {
            interrupt.report_unreadable_ring(device, &why);
            None
        }
    }
}

/// Whether a device that stopped at its budget must come back to `queue`: chains are
/// left, or came as it asked the driver for notifications again (which it does only
/// when none were left: a caller that comes back needs none).
pub(crate) fn more_after_budget(
    queue: &mut Queue,
    memory: &GuestMemoryMmap,
    interrupt: &InterruptTrigger,
    device: &str,
) -> bool {
    has_available(queue, memory) || ask_for_notifications(queue, memory, interrupt, device)
}

/// The head of the next available chain, taken off the ring (as virtio-queue's
/// `pop_descriptor_chain`, whose error it keeps instead of logging it): `Ok(None)` when
/// the ring is empty, `Err` with why when it cannot be read (an index more than the
/// queue's size ahead of what was served, a ring at guest address 0). The ring's index
/// is read once.
fn pop_head(queue: &mut Queue, memory: &GuestMemoryMmap) -> Result<Option<u16>, String> {
    let mut available = queue.iter(memory).map_err(|e| e.to_string())?;
    Ok(available.next().map(|chain| chain.head_index()))
}

/// [`pop_head`] for a device: the head of the next available chain, or `None` when
/// there is none, or when the ring cannot be read, which is reported (DEVICE_NEEDS_RESET).
pub(crate) fn take_head(
    queue: &mut Queue,
    memory: &GuestMemoryMmap,
    interrupt: &InterruptTrigger,
    device: &str,
) -> Option<u16> {
    pop_head(queue, memory).unwrap_or_else(|why| {
        interrupt.report_unreadable_ring(device, &why);
        None
    })
}

/// What a handler of [`ActiveQueue::serve`] did with one chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// The used length returned to the driver: bytes written into guest memory.
    pub used_len: u32,
    /// Work beyond the bytes the chain claims, counted against [`SERVE_BYTES`] like
    /// them: a request that costs the host a disk flush is not the 17 bytes it names.
    pub extra_cost: u64,
}

impl From<u32> for Served {
    fn from(used_len: u32) -> Self {
        Self {
            used_len,
            extra_cost: 0,
        }
    }
}

/// VIRTQ_AVAIL_F_NO_INTERRUPT (virtio 1.2, 2.7.7): the driver needs no interrupt.
const AVAIL_F_NO_INTERRUPT: u16 = 1;

/// Whether the driver wants an interrupt for the chains just put in `queue`'s used
/// ring. virtio-queue answers for VIRTIO_RING_F_EVENT_IDX; without it, it always says
/// yes, so the avail ring's NO_INTERRUPT flag is read here: Linux sets it while its
/// handler is already taking used chains (virtqueue_disable_cb), and each interrupt
/// then is a VM exit for nothing. Reading the flag after the used index was written
/// (a full fence in between) keeps a driver that clears it, then rechecks the used
/// index (virtqueue_enable_cb), from missing what was used.
pub(crate) fn driver_wants_interrupt(
    queue: &mut Queue,
    memory: &GuestMemoryMmap,
) -> Result<bool, virtio_queue::Error> {
    if !queue.needs_notification(memory)? {
        return Ok(false);
    }
    if queue.event_idx_enabled() {
        return Ok(true);
    }
    // The used index was published before; the flag must be read after it (virtio-
    // queue fences inside needs_notification today, but that is its own business).
    std::sync::atomic::fence(Ordering::SeqCst);
    let flags: u16 = memory
        .load(GuestAddress(queue.avail_ring()), Ordering::Acquire)
        .map_err(virtio_queue::Error::GuestMemory)?;
    Ok(u16::from_le(flags) & AVAIL_F_NO_INTERRUPT == 0)
}

/// Whether the driver made chains available that `queue` has not taken yet (an
/// unreadable ring counts as none).
pub(crate) fn has_available(queue: &Queue, memory: &GuestMemoryMmap) -> bool {
    queue
        .avail_idx(memory, Ordering::Acquire)
        .is_ok_and(|avail| avail.0 != queue.next_avail())
}

/// What a call to serve a queue left: nothing, or chains for another call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum QueueProgress {
    Done,
    /// The call stopped at its limit with chains still available: serve the queue
    /// again once other events had their turn.
    MoreAvailable,
}

/// The `process_queue` of a single-queue device: serves queue 0 of `active` with
/// `handle` (see [`ActiveQueue::serve`]); other indexes and notifications before
/// activation are logged and ignored.
pub fn serve_single_queue<S: Into<Served>>(
    active: Option<&mut ActiveQueue>,
    device: &str,
    index: usize,
    handle: impl FnMut(&[Descriptor], &GuestMemoryMmap) -> S,
) -> QueueProgress {
    let Some(active) = active else {
        tracing::debug!("{device}: queue {index} notified before activation");
        return QueueProgress::Done;
    };
    if index != 0 {
        guest_log::guest_warn!("{device}: notification for nonexistent queue {index}");
        return QueueProgress::Done;
    }
    active.serve(device, handle)
}

/// The `N` queues of a device that has `N`.
pub fn queues_of<const N: usize>(queues: Vec<Queue>) -> Result<[Queue; N], ActivateError> {
    let got = queues.len();
    <[Queue; N]>::try_from(queues).map_err(|_| ActivateError::QueueCount { expected: N, got })
}

/// The one queue of a single-queue device, which must be ready.
pub fn single_ready_queue(queues: Vec<Queue>) -> Result<Queue, ActivateError> {
    let [queue] = queues_of(queues)?;
    if !virtio_queue::QueueT::ready(&queue) {
        return Err(ActivateError::QueueNotReady { index: 0 });
    }
    Ok(queue)
}

/// A virtio device behind a transport.
pub trait VirtioDevice: Send {
    /// virtio device ID (`DEVICE_ID_*`).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits the device offers (including `FEATURE_VERSION_1`).
    fn avail_features(&self) -> u64;
    /// Feature bits the driver acknowledged, set before activation. By default they
    /// are not kept: the transport keeps them (and gives the queues EVENT_IDX); a
    /// device whose work depends on them (block's FLUSH, the balloon's REPORTING)
    /// keeps its own copy.
    fn set_acked_features(&mut self, _features: u64) {}
    /// Reads the device-specific configuration space; out-of-range bytes read as 0.
    /// By default the device has none (or none that its features give a meaning):
    /// every byte reads as 0.
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    /// Writes the configuration space; devices ignore writes they do not support. By
    /// default nothing in it is writable.
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        tracing::debug!(
            "virtio device type {}: config write of {} bytes at {offset:#x} ignored",
            self.device_type(),
            data.len()
        );
    }
    /// Offered the queues' ioeventfds at build time. A device served by another
    /// process (vhost-user) keeps clones and returns true: the guest's notifications
    /// then go straight to that process and the event loop does not watch them.
    fn attach_queue_events(&mut self, _events: &[EventFd]) -> Result<bool, std::io::Error> {
        Ok(false)
    }
    /// Called when the driver sets DRIVER_OK: the device takes its queues.
    fn activate(
        &mut self,
        memory: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: InterruptTrigger,
    ) -> Result<(), ActivateError>;
    /// The driver notified queue `index`: process what is available, or as much of
    /// it as one call may (see [`ActiveQueue::serve`]).
    fn process_queue(&mut self, index: usize) -> QueueProgress;
    /// Whether the device may keep chains of queue `index` for a while (a receive
    /// queue's buffers wait for data to come). The transport watches a queue that
    /// holds none for notifications that never came
    /// ([`missed_notification`]); by default none is watched.
    fn holds_chains(&self, _index: usize) -> bool {
        true
    }
    /// The driver reset the device: drop the queues and return to the initial state.
    fn reset(&mut self);
}

/// Failures of moving bytes between guest memory and a host source or sink.
#[derive(Debug, thiserror::Error)]
pub enum GuestIoError {
    #[error("guest range {addr:#x}+{len:#x} is not entirely inside guest memory")]
    OutOfRange { addr: u64, len: usize },
    #[error("cannot map guest range {addr:#x}+{len:#x}: {source}")]
    Memory {
        addr: u64,
        len: usize,
        source: GuestMemoryError,
    },
    #[error("I/O on guest range {addr:#x}+{len:#x} failed: {source}")]
    Io {
        addr: u64,
        len: usize,
        source: VolatileMemoryError,
    },
}

/// True when `addr..addr+len` lies entirely in guest RAM (possibly across regions).
pub(crate) fn guest_range_ok(memory: &GuestMemoryMmap, addr: GuestAddress, len: usize) -> bool {
    GuestMemoryBackend::check_range(memory, addr, len)
}

/// Fills `len` bytes of guest memory at `addr` from `src`, across region boundaries.
/// The whole range is checked first, so nothing is written when part of it is outside
/// guest RAM.
pub(crate) fn read_into_guest<R: ReadVolatile>(
    memory: &GuestMemoryMmap,
    addr: GuestAddress,
    len: usize,
    src: &mut R,
) -> Result<(), GuestIoError> {
    if !guest_range_ok(memory, addr, len) {
        return Err(GuestIoError::OutOfRange { addr: addr.0, len });
    }
    for slice in GuestMemoryBackend::get_slices(memory, addr, len) {
        let mut slice = slice.map_err(|source| GuestIoError::Memory {
            addr: addr.0,
            len,
            source,
        })?;
        src.read_exact_volatile(&mut slice)
            .map_err(|source| GuestIoError::Io {
                addr: addr.0,
                len,
                source,
            })?;
    }
    Ok(())
}

/// Writes `len` bytes of guest memory at `addr` to `dst`, across region boundaries.
/// The whole range is checked first.
pub(crate) fn write_from_guest<W: WriteVolatile>(
    memory: &GuestMemoryMmap,
    addr: GuestAddress,
    len: usize,
    dst: &mut W,
) -> Result<(), GuestIoError> {
    if !guest_range_ok(memory, addr, len) {
        return Err(GuestIoError::OutOfRange { addr: addr.0, len });
    }
    for slice in GuestMemoryBackend::get_slices(memory, addr, len) {
        let slice = slice.map_err(|source| GuestIoError::Memory {
            addr: addr.0,
            len,
            source,
        })?;
        dst.write_all_volatile(&slice)
            .map_err(|source| GuestIoError::Io {
                addr: addr.0,
                len,
                source,
            })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::spread_ring::SpreadRing;
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Address, Bytes};
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    const RING_SIZE: u16 = 16;

    fn buffers(count: u16) -> Vec<RawDescriptor> {
        (0..count)
            .map(|i| {
                let addr = 0x8_0000 + u64::from(i) * 0x100;
                RawDescriptor::from(Descriptor::new(addr, 16, VRING_DESC_F_WRITE as u16, 0))
            })
            .collect()
    }

    fn served_queue<'a>(
        memory: &'a GuestMemoryMmap,
        chains: u16,
    ) -> (MockSplitQueue<'a, GuestMemoryMmap>, ActiveQueue) {
        queue_of(memory, &buffers(chains))
    }

    /// A ring with `chains` (one-descriptor chains, at table entries 0..) available,
    /// and the queue that serves it.
    fn queue_of<'a>(
        memory: &'a GuestMemoryMmap,
        chains: &[RawDescriptor],
    ) -> (MockSplitQueue<'a, GuestMemoryMmap>, ActiveQueue) {
        let ring = MockSplitQueue::new(memory, RING_SIZE);
        ring.add_desc_chains(chains, 0).unwrap();
        let interrupt = InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        let active = ActiveQueue::new(
            memory.clone(),
            vec![ring.create_queue().unwrap()],
            interrupt,
        )
        .unwrap();
        (ring, active)
    }

    /// One-descriptor chains (table entries 0..) on a [`SpreadRing`], with or without
    /// VIRTIO_RING_F_EVENT_IDX negotiated, and the queue that serves them.
    fn queue_negotiated(
        memory: &GuestMemoryMmap,
        chains: &[RawDescriptor],
        event_idx: bool,
    ) -> (SpreadRing, ActiveQueue) {
        let ring = SpreadRing::new(0, RING_SIZE);
        for (head, chain) in (0..).zip(chains) {
            ring.offer(memory, head, &[*chain]);
        }
        let interrupt = InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        let active = ActiveQueue::new(memory.clone(), vec![ring.queue(event_idx)], interrupt);
        (ring, active.unwrap())
    }

    /// Chains that each claim a quarter of [`SERVE_BYTES`].
    fn quarter_budget_chains(count: usize) -> Vec<RawDescriptor> {
        let quarter = u32::try_from(SERVE_BYTES / 4).unwrap();
        vec![RawDescriptor::from(Descriptor::new(0x8_0000, quarter, 0, 0)); count]
    }

    /// `active` hands no chain to its handler, and the device needs a reset, said with
    /// a configuration change interrupt.
    fn serves_nothing_and_needs_a_reset(active: &mut ActiveQueue) {
        let mut served = 0;
        let progress = active.serve("test", |_, _| {
            served += 1;
            0
        });
        assert_eq!((progress, served), (QueueProgress::Done, 0));
        assert!(active.interrupt.needs_reset());
        assert_eq!(active.interrupt.status(), INTERRUPT_CONFIG_CHANGE);
    }

    /// An avail index more than a ring ahead of what was served cannot be right: the
    /// queue stops, and why is told (once); an empty ring is no fault.
    #[test]
    fn an_avail_index_far_ahead_is_told_as_the_reason_nothing_is_served() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let (ring, mut active) = served_queue(&memory, 0);
        assert_eq!(pop_head(&mut active.queue, &memory), Ok(None));
        ring.avail().idx().store(RING_SIZE + 1);
        let why = pop_head(&mut active.queue, &memory).expect_err("a reason");
        assert!(!why.is_empty());
        serves_nothing_and_needs_a_reset(&mut active);
    }

    /// A head past the table can never be returned to the driver (the used ring
    /// names it), nor can the requests after it: the device needs a reset. (Review:
    /// only a warning, and the driver waited for ever.)
    #[test]
    fn a_head_past_the_table_makes_the_device_need_a_reset() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let (ring, mut active) = served_queue(&memory, 1);
        let slot = ring.avail_addr().unchecked_add(4);
        memory.write_obj(RING_SIZE + 3, slot).unwrap();
        serves_nothing_and_needs_a_reset(&mut active);
    }

    /// An empty ring is no fault: nothing to reset, no interrupt.
    #[test]
    fn an_empty_ring_needs_no_reset() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let (_ring, mut active) = served_queue(&memory, 0);
        assert_eq!(active.serve("test", |_, _| 0), QueueProgress::Done);
        assert!(!active.interrupt.needs_reset());
        assert_eq!(active.interrupt.status(), 0);
    }

    #[test]
    fn what_is_available_is_served_in_one_call() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let (ring, mut active) = served_queue(&memory, 3);
        let mut served = 0;
        let progress = active.serve("test", |_, _| {
            served += 1;
            0
        });
        assert_eq!((progress, served), (QueueProgress::Done, 3));
        assert_eq!(ring.used().idx().load(), 3);
    }

    /// A guest whose requests publish the next ones (its own DMA writing the avail
    /// ring) gets a ring's worth per call, and the caller is told that more wait.
    #[test]
    fn a_ring_that_refills_itself_is_served_a_ring_at_a_time() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let (ring, mut active) = served_queue(&memory, 1);
        let avail = ring.avail_addr();
        let mut served = 0;
        let progress = active.serve("test", |_, memory| {
            // The one chain, at table index 0, is published again.
            let idx: u16 = memory.read_obj(avail.unchecked_add(2)).unwrap();
            let slot = avail.unchecked_add(4 + 2 * u64::from(idx % RING_SIZE));
            memory.write_obj(0u16, slot).unwrap();
            memory
                .write_obj(idx.wrapping_add(1), avail.unchecked_add(2))
                .unwrap();
            served += 1;
            0
        });
        assert_eq!(
            (progress, served),
            (QueueProgress::MoreAvailable, RING_SIZE)
        );
        assert_eq!(ring.used().idx().load(), RING_SIZE);
    }

    /// Chains that each claim a quarter of the budget (descriptors may all name the
    /// same buffer): four per call, and the caller is told that more wait.
    #[test]
    fn a_call_stops_at_its_byte_budget() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let (_ring, mut active) = queue_of(&memory, &quarter_budget_chains(6));
        let mut served = 0;
        let progress = active.serve("test", |_, _| {
            served += 1;
            0
        });
        assert_eq!((progress, served), (QueueProgress::MoreAvailable, 4));
        let progress = active.serve("test", |_, _| {
            served += 1;
            0
        });
        assert_eq!((progress, served), (QueueProgress::Done, 6));
    }

    /// A chain whose handling cost more than its bytes (a disk flush) counts that
    /// against the budget too.
    #[test]
    fn a_call_stops_at_its_budget_of_extra_cost() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let (_ring, mut active) = served_queue(&memory, 6);
        let mut served = 0;
        let mut costly = || {
            served += 1;
            Served {
                used_len: 0,
                extra_cost: SERVE_BYTES / 4,
            }
        };
        assert_eq!(
            active.serve("test", |_, _| costly()),
            QueueProgress::MoreAvailable
        );
        assert_eq!(active.serve("test", |_, _| costly()), QueueProgress::Done);
        assert_eq!(served, 6);
    }

    /// A driver that set NO_INTERRUPT in its avail ring (Linux, while its handler
    /// takes used chains) gets none; once it clears the flag, it gets one again.
    #[test]
    fn no_interrupt_is_sent_to_a_driver_that_asked_for_none() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let ring = MockSplitQueue::new(&memory, RING_SIZE);
        ring.add_desc_chains(&buffers(2), 0).unwrap();
        let irqfd = Arc::new(EventFd::new(EFD_NONBLOCK).unwrap());
        let mut active = ActiveQueue::new(
            memory.clone(),
            vec![ring.create_queue().unwrap()],
            InterruptTrigger::new(irqfd.clone()),
        )
        .unwrap();
        let flags = ring.avail_addr();
        memory.write_obj(AVAIL_F_NO_INTERRUPT, flags).unwrap();
        // The mock publishes every chain at once: hold the second one back.
        let avail_idx = flags.unchecked_add(2);
        memory.write_obj(1u16, avail_idx).unwrap();
        assert_eq!(active.serve("test", |_, _| 0), QueueProgress::Done);
        assert!(irqfd.read().is_err(), "an interrupt the driver declined");

        memory.write_obj(0u16, flags).unwrap();
        memory.write_obj(2u16, avail_idx).unwrap();
        assert_eq!(active.serve("test", |_, _| 0), QueueProgress::Done);
        assert_eq!(irqfd.read().unwrap(), 1);
        assert_eq!(ring.used().idx().load(), 2);
    }

    const USED_F_NO_NOTIFY: u16 = virtio_bindings::virtio_ring::VRING_USED_F_NO_NOTIFY as u16;

    /// A fresh guest memory for one queue.
    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    /// Without EVENT_IDX a driver reads the used ring's NO_NOTIFY flag: set while the
    /// device serves (a notification then is a VM exit for a chain it takes anyway),
    /// cleared once it found the ring empty.
    #[test]
    fn the_driver_is_asked_for_no_notifications_while_the_device_serves() {
        let memory = memory();
        let (ring, mut active) = queue_negotiated(&memory, &buffers(2), false);
        let mut flags_seen = Vec::new();
        let progress = active.serve("test", |_, memory| {
            flags_seen.push(ring.used_flags(memory));
            0
        });
        assert_eq!(progress, QueueProgress::Done);
        assert_eq!(flags_seen, [USED_F_NO_NOTIFY; 2]);
        assert_eq!(ring.used_flags(&memory), 0, "asked for again");
    }

    /// A call that stops with chains left leaves notifications off (its caller comes
    /// back to them); one that stops at its budget as the ring runs empty asks for
    /// them again, as one that found the ring empty does.
    #[test]
    fn notifications_stay_off_while_chains_are_left() {
        let memory = memory();
        let (ring, mut active) = queue_negotiated(&memory, &quarter_budget_chains(6), false);
        assert_eq!(active.serve("test", |_, _| 0), QueueProgress::MoreAvailable);
        assert_eq!(ring.used_flags(&memory), USED_F_NO_NOTIFY);
        assert_eq!(active.serve("test", |_, _| 0), QueueProgress::Done);
        assert_eq!(ring.used_flags(&memory), 0);

        let memory = self::memory();
        let (ring, mut active) = queue_negotiated(&memory, &quarter_budget_chains(4), false);
        assert_eq!(active.serve("test", |_, _| 0), QueueProgress::Done);
        assert_eq!(ring.used_idx(&memory), 4);
        assert_eq!(ring.used_flags(&memory), 0, "budget spent, ring empty");
    }

    /// With EVENT_IDX the device asks to be notified at the first chain it has not
    /// served (`avail_event`); while it serves, `avail_event` stays behind, which asks
    /// for nothing, and the flags a driver without EVENT_IDX reads are left alone.
    #[test]
    fn with_event_idx_the_next_notification_is_asked_at_the_first_chain_not_served() {
        let memory = memory();
        let (ring, mut active) = queue_negotiated(&memory, &buffers(3), true);
        let mut events_seen = Vec::new();
        let progress = active.serve("test", |_, memory| {
            events_seen.push(ring.avail_event(memory));
            0
        });
        assert_eq!(progress, QueueProgress::Done);
        assert_eq!(events_seen, [0; 3]);
        assert_eq!(ring.avail_event(&memory), 3);
        assert_eq!(ring.used_flags(&memory), 0);

        let memory = self::memory();
        let (ring, mut active) = queue_negotiated(&memory, &quarter_budget_chains(6), true);
        assert_eq!(active.serve("test", |_, _| 0), QueueProgress::MoreAvailable);
        assert_eq!(ring.avail_event(&memory), 0, "behind while chains wait");
        assert_eq!(active.serve("test", |_, _| 0), QueueProgress::Done);
        assert_eq!(ring.avail_event(&memory), 6);
    }

    /// With EVENT_IDX the driver is interrupted once the used index passes its
    /// `used_event`, not for every call that used chains.
    #[test]
    fn with_event_idx_the_driver_is_interrupted_only_past_its_used_event() {
        let memory = memory();
        let chains = buffers(4);
        let (ring, mut active) = queue_negotiated(&memory, &chains[..2], true);
        let irqfd = active.interrupt.irqfd.clone();
        // The driver wants to hear once the fourth chain (used index 3) is used.
        memory.write_obj(3u16, ring.used_event_addr()).unwrap();
        assert_eq!(active.serve("test", |_, _| 0), QueueProgress::Done);
        assert_eq!(ring.used_idx(&memory), 2);
        assert!(irqfd.read().is_err(), "interrupted before its used_event");

        ring.offer(&memory, 2, &chains[2..3]);
        ring.offer(&memory, 3, &chains[3..4]);
        assert_eq!(active.serve("test", |_, _| 0), QueueProgress::Done);
        assert_eq!(irqfd.read().unwrap(), 1);
    }

    /// A guest can change its descriptors at any time (another vCPU, in a tight
    /// loop). Here it grows each one to a quarter of the budget as soon as the chain
    /// is taken: the handler must be given the descriptors that were counted, so
    /// that one call is never handed more than its budget and its last chain.
    #[test]
    fn the_byte_budget_counts_what_the_handler_is_given() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        // Eight one-descriptor chains (table entries 0..8) that claim nothing when
        // first read.
        let empty: Vec<RawDescriptor> = (0..8)
            .map(|_| RawDescriptor::from(Descriptor::new(0x8_0000, 0, 0, 0)))
            .collect();
        let (ring, mut active) = queue_of(&memory, &empty);
        let table = ring.desc_table_addr();
        let quarter = u32::try_from(SERVE_BYTES / 4).unwrap();
        let mut served: u64 = 0;
        let mut given: u64 = 0;
        let _ = active.serve("test", |descriptors, memory| {
            // The guest grows the chain's descriptor (its length field) once taken.
            let len_at = table.unchecked_add(16 * served + 8);
            memory.write_obj(quarter, len_at).unwrap();
            served += 1;
            for desc in descriptors {
                given += u64::from(desc.len());
            }
            0
        });
        assert!(
            given <= SERVE_BYTES + u64::from(quarter),
            "one call was handed {given} bytes of requests, its budget is {SERVE_BYTES}"
        );
    }

    /// A chain whose head is an indirect descriptor (VIRTIO_RING_F_INDIRECT_DESC is
    /// not offered, but nothing stops a guest) names a table of up to 65,535
    /// descriptors, and one that loops never ends: each is refused whole, never handed
    /// to the handler (not even cut), and goes back to the driver with a used length
    /// of 0. The chains after them are served as usual.
    #[test]
    fn indirect_and_endless_chains_are_refused_whole() {
        const INDIRECT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
        const NEXT: u16 = virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16;
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap();
        let table = 0x10_0000u64;
        let count: u16 = u16::MAX;
        for i in 0..count {
            let next = if i + 1 < count { NEXT } else { 0 };
            let desc = Descriptor::new(0x8_0000, 4096, next, i.wrapping_add(1));
            memory
                .write_obj(
                    RawDescriptor::from(desc),
                    GuestAddress(table + 16 * u64::from(i)),
                )
                .unwrap();
        }
        let indirect =
            RawDescriptor::from(Descriptor::new(table, 16 * u32::from(count), INDIRECT, 0));
        // Table entries: 0-3 indirect heads, 4 a one-descriptor chain, 5 a chain that
        // loops on itself (the mock publishes each entry that follows one without NEXT).
        let mut chains = vec![indirect; 4];
        chains.push(buffers(1)[0]);
        let write = VRING_DESC_F_WRITE as u16;
        chains.push(RawDescriptor::from(Descriptor::new(
            0x8_0000,
            16,
            NEXT | write,
            5,
        )));
        let (ring, mut active) = queue_of(&memory, &chains);
        let mut handed = Vec::new();
        let progress = active.serve("test", |descriptors, _| {
            handed.push(descriptors.len());
            7
        });
        assert_eq!(progress, QueueProgress::Done);
        assert_eq!(handed, vec![1], "only the one well-formed chain");
        let used: Vec<(u32, u32)> = (0..ring.used().idx().load())
            .map(|i| {
                let e = ring.used().ring().ref_at(usize::from(i)).unwrap().load();
                (e.id(), e.len())
            })
            .collect();
        assert_eq!(used, [(0, 0), (1, 0), (2, 0), (3, 0), (4, 7), (5, 0)]);
        assert!(active.chains.refused_told);
    }
}
