//! The virtio-mmio transport, version 2 ("modern"; virtio 1.2, section 4.2.2).
//!
//! [`MmioTransport`] owns a [`VirtioDevice`] and its queues while the driver sets them
//! up through the register window, negotiates features, walks the device status state
//! machine and, on DRIVER_OK, hands checked copies of the queues to the device.
//!
//! A notification that comes before DRIVER_OK is held, not dropped, and delivered
//! at activation: the chains it announced would otherwise wait for a notification
//! the driver has no reason to send again (Linux drivers spin or sleep on their
//! buffers' return). For the same reason, a notification that never arrived is
//! made up for ([`super::missed_notification`]), as a missed interrupt is
//! ([`super::missed_interrupt`]).
//!
//! Everything written here comes from the guest: malformed accesses are logged and
//! ignored (reads return 0), never a panic.

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::EventFd;

use super::missed_interrupt::{self, Look, Missed, MissedInterruptWatch, UsedProgress};
use super::missed_notification::{self, MissedNotificationWatch, RingIndexes};
use super::{
    ActivateError, InterruptTrigger, QueueProgress, VirtioDevice, FEATURE_EVENT_IDX,
    FEATURE_VERSION_1,
};
use crate::devices::bus::BusDevice;
use crate::memory::GuestMemoryMmap;

/// Size of the register window of one device.
pub const MMIO_WINDOW_SIZE: u64 = 0x1000;
/// "virt" in little endian.
pub const MMIO_MAGIC_VALUE: u32 = 0x7472_6976;
/// virtio-mmio version 2 (the non-legacy interface).
pub const MMIO_VERSION: u32 = 2;
/// VendorID reported to the driver.
pub const MMIO_VENDOR_ID: u32 = 0;
/// Offset of the QueueNotify register: the builder registers an ioeventfd at
/// `base + QUEUE_NOTIFY_OFFSET` with datamatch = queue index (32-bit write).
pub const QUEUE_NOTIFY_OFFSET: u64 = 0x50;
/// Offset of the device-specific configuration space.
pub const CONFIG_SPACE_OFFSET: u64 = 0x100;

// Register offsets (virtio 1.2, table 4.1).
const REG_MAGIC_VALUE: u64 = 0x000;
const REG_VERSION: u64 = 0x004;
const REG_DEVICE_ID: u64 = 0x008;
const REG_VENDOR_ID: u64 = 0x00c;
const REG_DEVICE_FEATURES: u64 = 0x010;
const REG_DEVICE_FEATURES_SEL: u64 = 0x014;
const REG_DRIVER_FEATURES: u64 = 0x020;
const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
const REG_QUEUE_SEL: u64 = 0x030;
const REG_QUEUE_NUM_MAX: u64 = 0x034;
const REG_QUEUE_NUM: u64 = 0x038;
const REG_QUEUE_READY: u64 = 0x044;
const REG_QUEUE_NOTIFY: u64 = QUEUE_NOTIFY_OFFSET;
const REG_INTERRUPT_STATUS: u64 = 0x060;
const REG_INTERRUPT_ACK: u64 = 0x064;
const REG_STATUS: u64 = 0x070;
const REG_QUEUE_DESC_LOW: u64 = 0x080;
const REG_QUEUE_DESC_HIGH: u64 = 0x084;
const REG_QUEUE_DRIVER_LOW: u64 = 0x090;
const REG_QUEUE_DRIVER_HIGH: u64 = 0x094;
const REG_QUEUE_DEVICE_LOW: u64 = 0x0a0;
const REG_QUEUE_DEVICE_HIGH: u64 = 0x0a4;
const REG_SHM_SEL: u64 = 0x0ac;
const REG_SHM_LEN_LOW: u64 = 0x0b0;
const REG_SHM_LEN_HIGH: u64 = 0x0b4;
const REG_SHM_BASE_LOW: u64 = 0x0b8;
const REG_SHM_BASE_HIGH: u64 = 0x0bc;
const REG_CONFIG_GENERATION: u64 = 0x0fc;

const S_ACKNOWLEDGE: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE;
const S_DRIVER: u32 = VIRTIO_CONFIG_S_DRIVER;
const S_FEATURES_OK: u32 = VIRTIO_CONFIG_S_FEATURES_OK;
const S_DRIVER_OK: u32 = VIRTIO_CONFIG_S_DRIVER_OK;
const S_NEEDS_RESET: u32 = VIRTIO_CONFIG_S_NEEDS_RESET;
const S_FAILED: u32 = VIRTIO_CONFIG_S_FAILED;

/// Largest queue size virtio allows (and virtio-queue accepts).
const MAX_QUEUE_SIZE: u16 = 32768;

// Bits of `QueueSetup::bad_fields`: the driver wrote a value the queue rejected.
const BAD_SIZE: u8 = 1 << 0;
const BAD_DESC: u8 = 1 << 1;
const BAD_DRIVER: u8 = 1 << 2;
const BAD_DEVICE: u8 = 1 << 3;

/// Why a driver request was refused; logged, never returned to the guest.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MmioError {
    #[error("status transition {from:#x} -> {to:#x} is not allowed")]
    IllegalStatus { from: u32, to: u32 },
    #[error("driver accepted features {unoffered:#x} the device does not offer")]
    UnofferedFeatures { unoffered: u64 },
    #[error("driver did not accept VIRTIO_F_VERSION_1 (features {features:#x})")]
    NoVersion1 { features: u64 },
    #[error("queue {index} does not exist (the device has {count})")]
    NoSuchQueue { index: u32, count: usize },
    #[error("queue {index} cannot be set up now (status {status:#x}, ready {ready})")]
    QueueLocked {
        index: u32,
        status: u32,
        ready: bool,
    },
    #[error("queue {index}: invalid size {size} (max {max}, must be a power of two)")]
    QueueSize { index: u32, size: u32, max: u16 },
    #[error("queue {index}: {what} address {addr:#x} breaks the alignment rules")]
    QueueAlign {
        index: u32,
        what: &'static str,
        addr: u64,
    },
    #[error("queue {index} cannot become ready: an earlier setup value was invalid")]
    QueueMisconfigured { index: u32 },
}

/// A queue as the driver configures it, with the values it wrote that were refused.
struct QueueSetup {
    queue: Queue,
    /// `BAD_*` bits: a field holds an invalid driver value, so the queue must not
    /// become ready until the driver writes a valid one.
    bad_fields: u8,
    /// The addresses as the driver wrote them, both halves, indexed by [`QueueAddr`]:
    /// each write completes its address from these, not from the queue's, which keeps
    /// the last accepted value when one is refused.
    written_addrs: [u64; 3],
}

/// Which address of a queue a register pair sets.
#[derive(Clone, Copy)]
enum QueueAddr {
    Desc,
    Driver,
    Device,
}

impl QueueAddr {
    fn name(self) -> &'static str {
        match self {
            QueueAddr::Desc => "descriptor table",
            QueueAddr::Driver => "driver (available) ring",
            QueueAddr::Device => "device (used) ring",
        }
    }

    fn slot(self) -> usize {
        match self {
            QueueAddr::Desc => 0,
            QueueAddr::Driver => 1,
            QueueAddr::Device => 2,
        }
    }

    fn bad_bit(self) -> u8 {
        match self {
            QueueAddr::Desc => BAD_DESC,
            QueueAddr::Driver => BAD_DRIVER,
            QueueAddr::Device => BAD_DEVICE,
        }
    }
}

/// The virtio-mmio register window of one device.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    memory: GuestMemoryMmap,
    interrupt: InterruptTrigger,
    queues: Vec<QueueSetup>,
    /// The status bits the driver set. DEVICE_NEEDS_RESET is the device's own and
    /// lives in `interrupt`, which the device shares (see [`Self::device_status`]).
    device_status: u32,
    device_activated: bool,
    /// The queues notified before activation, by index (see the module doc).
    held_notifications: Vec<bool>,
    /// The queues' ioeventfds, when the builder gave them
    /// ([`Self::deliver_through`]): the notifications the transport delivers on the
    /// driver's behalf (held ones, missed ones) are signalled there, so the event loop
    /// serves them as it serves any other.
    queue_events: Vec<EventFd>,
    device_features_sel: u32,
    driver_features_sel: u32,
    /// Exactly what the driver wrote to DriverFeatures (both halves).
    driver_features: u64,
    queue_sel: u32,
    config_generation: u32,
    missed_interrupts: MissedInterruptWatch,
    /// Interrupts raised again for a driver that missed one, since the VM started.
    interrupts_raised_again: u64,
    missed_notifications: MissedNotificationWatch,
    /// Queues served for a notification that never came, since the VM started.
    notifications_made_up: u64,
}

/// Which missed interrupts are said: each of the first ten, then one at every
/// tenfold count.
fn said_on_the_log(count: u64) -> bool {
    let mut n = count;
    while n >= 10 && n.is_multiple_of(10) {
        n /= 10;
    }
    count <= 10 || n == 1
}

/// A queue with the largest valid maximum size not above `max` (virtio-queue
/// requires a power of two in 1..=32768).
fn new_queue(max: u16) -> Queue {
    let valid = match max {
        0 => 1,
        m => {
            let m = m.min(MAX_QUEUE_SIZE);
            1u16 << (15 - m.leading_zeros().min(15))
        }
    };
    if valid != max {
        tracing::error!("virtio device queue maximum size {max} is invalid; using {valid}");
    }
    match Queue::new(valid) {
        Ok(queue) => queue,
        // Unreachable: `valid` is a power of two within the limits checked by new().
        Err(e) => {
            tracing::error!("cannot create a virtio queue of size {valid}: {e}");
            Queue::default()
        }
    }
}

impl MmioTransport {
    pub fn new(
        device: Box<dyn VirtioDevice>,
        memory: GuestMemoryMmap,
        interrupt: InterruptTrigger,
    ) -> Self {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&max| QueueSetup {
                queue: new_queue(max),
                bad_fields: 0,
                written_addrs: [0; 3],
            })
            .collect::<Vec<_>>();
        Self {
            device,
            memory,
            interrupt,
            held_notifications: vec![false; queues.len()],
            queues,
            device_status: 0,
            device_activated: false,
            queue_events: Vec::new(),
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            config_generation: 0,
            missed_interrupts: MissedInterruptWatch::default(),
            interrupts_raised_again: 0,
            missed_notifications: MissedNotificationWatch::default(),
            notifications_made_up: 0,
        }
    }

    /// Delivers the notifications the transport gives on the driver's behalf (those
    /// held until activation, those that never came) through the queues' ioeventfds
    /// (clones of those the event loop watches), so they are served in the event
    /// loop, as far as it takes, rather than once on the thread that found them.
    pub fn deliver_through(&mut self, queue_events: Vec<EventFd>) {
        self.queue_events = queue_events;
    }

    /// Called about every half second: raises the device's interrupt again when the
    /// driver missed one that was waiting for it at the previous call already (see
    /// [`super::missed_interrupt`]). Said on the log each of the first ten times, then
    /// at every tenfold count (a guest stuck for good is raised again for ever).
    pub fn raise_missed_interrupt(&mut self) {
        if !self.device_activated {
            return;
        }
        let queues = if self.event_idx_negotiated() {
            self.queues
                .iter()
                .map(|setup| UsedProgress::read(&setup.queue, &self.memory))
                .collect()
        } else {
            Vec::new()
        };
        let look = Look {
            unacknowledged: self.interrupt.unacknowledged(),
            queues,
        };
        let Some(missed) = self.missed_interrupts.missed(look) else {
            return;
        };
        self.interrupts_raised_again += 1;
        let count = self.interrupts_raised_again;
        if said_on_the_log(count) {
            let what = match missed {
                Missed::Unacknowledged => "left its interrupt unacknowledged",
                Missed::UsedBuffersUntaken => "left used buffers untaken past their interrupt",
            };
            tracing::warn!(
                "virtio device type {}: the driver {what} for half a second: interrupt raised \
                 again {} {count} so far)",
                self.device.device_type(),
                missed_interrupt::LOG_MARK
            );
        }
        match missed {
            Missed::Unacknowledged => self.interrupt.raise(),
            Missed::UsedBuffersUntaken => self.interrupt.signal_used_queue(),
        }
    }

    /// How many times [`Self::raise_missed_interrupt`] raised the interrupt again.
    pub fn interrupts_raised_again(&self) -> u64 {
        self.interrupts_raised_again
    }

    /// Called about every half second, with [`Self::raise_missed_interrupt`]: has the
    /// device serve each queue whose chains waited, unmoved, since the previous call
    /// for a notification that never came (see [`super::missed_notification`]).
    /// Said on the log as missed interrupts are.
    pub fn serve_missed_notifications(&mut self) {
        if !self.device_activated || self.interrupt.needs_reset() {
            return;
        }
        let look = self
            .queues
            .iter()
            .enumerate()
            .map(|(index, setup)| {
                (!self.device.holds_chains(index))
                    .then(|| RingIndexes::read(&setup.queue, &self.memory))
                    .flatten()
            })
            .collect();
        for index in self.missed_notifications.missed(look) {
            self.notifications_made_up += 1;
            let count = self.notifications_made_up;
            if said_on_the_log(count) {
                tracing::warn!(
                    "virtio device type {}: chains on queue {index} waited half a second \
                     for a notification that did not come: served {}, or a driver held up \
                     before it notified; {count} so far)",
                    self.device.device_type(),
                    missed_notification::LOG_MARK
                );
            }
            self.deliver_notification(index);
        }
    }

    /// How many times [`Self::serve_missed_notifications`] served a queue.
    pub fn notifications_made_up(&self) -> u64 {
        self.notifications_made_up
    }

    /// Number of queues of the device (valid QueueNotify values are `0..queue_count()`).
    #[cfg(test)]
    fn queue_count(&self) -> usize {
        self.queues.len()
    }

    /// The queues as the driver configured them (the device works on copies taken
    /// at DRIVER_OK).
    pub fn queues(&self) -> impl Iterator<Item = &Queue> {
        self.queues.iter().map(|q| &q.queue)
    }

    /// The device status register: what the driver set, and DEVICE_NEEDS_RESET when
    /// the device (or its activation) failed.
    pub fn device_status(&self) -> u32 {
        let needs_reset = if self.interrupt.needs_reset() {
            S_NEEDS_RESET
        } else {
            0
        };
        self.device_status | needs_reset
    }

    /// Whether the device was activated (DRIVER_OK accepted and activation succeeded).
    #[cfg(test)]
    fn is_activated(&self) -> bool {
        self.device_activated
    }

    /// The driver notified queue `index` (ioeventfd or a trapped QueueNotify write).
    pub fn notify_queue(&mut self, index: u32) -> QueueProgress {
        if !self.device_activated {
            let held = usize::try_from(index)
                .ok()
                .and_then(|i| self.held_notifications.get_mut(i));
            if let Some(held) = held {
                *held = true;
            }
            tracing::debug!(
                "virtio-mmio: notification for queue {index} before activation: held until \
                 DRIVER_OK"
            );
            return QueueProgress::Done;
        }
        if self.interrupt.needs_reset() {
            // The device said why when it set the bit; only a reset gets it going.
            tracing::debug!("virtio-mmio: notification for queue {index} ignored until reset");
            return QueueProgress::Done;
        }
        match usize::try_from(index) {
            Ok(i) if i < self.queues.len() => self.device.process_queue(i),
            _ => {
                guest_log::guest_warn!(
                    "virtio-mmio: {}",
                    MmioError::NoSuchQueue {
                        index,
                        count: self.queues.len()
                    }
                );
                QueueProgress::Done
            }
        }
    }

    fn selected_queue(&self) -> Option<&QueueSetup> {
        self.queues.get(usize::try_from(self.queue_sel).ok()?)
    }

    /// The selected queue if the driver may change its setup now: after FEATURES_OK,
    /// before DRIVER_OK, while the queue is not ready.
    fn configurable_queue(&mut self) -> Result<&mut QueueSetup, MmioError> {
        let index = self.queue_sel;
        let count = self.queues.len();
        let status = self.device_status;
        let setup = usize::try_from(index)
            .ok()
            .and_then(|i| self.queues.get_mut(i))
            .ok_or(MmioError::NoSuchQueue { index, count })?;
        let phase_ok = status & (S_FEATURES_OK | S_DRIVER_OK | S_FAILED) == S_FEATURES_OK;
        if !phase_ok || setup.queue.ready() {
            return Err(MmioError::QueueLocked {
                index,
                status,
                ready: setup.queue.ready(),
            });
        }
        Ok(setup)
    }

    fn set_queue_size(&mut self, size: u32) -> Result<(), MmioError> {
        let index = self.queue_sel;
        let setup = self.configurable_queue()?;
        let max = setup.queue.max_size();
        // try_set_size leaves the old size in place on error; the bad bit keeps the
        // queue from becoming ready with a size the driver did not ask for.
        match u16::try_from(size)
            .ok()
            .filter(|&s| setup.queue.try_set_size(s).is_ok())
        {
            Some(_) => {
                setup.bad_fields &= !BAD_SIZE;
                Ok(())
            }
            None => {
                setup.bad_fields |= BAD_SIZE;
                Err(MmioError::QueueSize { index, size, max })
            }
        }
    }

    fn set_queue_addr(
        &mut self,
        which: QueueAddr,
        high: bool,
        value: u32,
    ) -> Result<(), MmioError> {
        let index = self.queue_sel;
        let setup = self.configurable_queue()?;
        // The other half is the one the driver wrote last, even if it was refused: a
        // refused low half followed by the high half must not give an address built
        // from the last accepted low half, one the driver never asked for.
        let written = &mut setup.written_addrs[which.slot()];
        *written = if high {
            (*written & 0xffff_ffff) | (u64::from(value) << 32)
        } else {
            (*written & !0xffff_ffff) | u64::from(value)
        };
        let new = *written;
        let q = &mut setup.queue;
        let result = match which {
            QueueAddr::Desc => q.try_set_desc_table_address(GuestAddress(new)),
            QueueAddr::Driver => q.try_set_avail_ring_address(GuestAddress(new)),
            QueueAddr::Device => q.try_set_used_ring_address(GuestAddress(new)),
        };
        match result {
            Ok(()) => {
                setup.bad_fields &= !which.bad_bit();
                Ok(())
            }
            Err(_) => {
                setup.bad_fields |= which.bad_bit();
                Err(MmioError::QueueAlign {
                    index,
                    what: which.name(),
                    addr: new,
                })
            }
        }
    }

    fn set_queue_ready(&mut self, value: u32) -> Result<(), MmioError> {
        let index = self.queue_sel;
        let count = self.queues.len();
        let status = self.device_status;
        let setup = usize::try_from(index)
            .ok()
            .and_then(|i| self.queues.get_mut(i))
            .ok_or(MmioError::NoSuchQueue { index, count })?;
        // Linux's vm_del_vq writes 0 to each queue's QueueReady as it unbinds the
        // driver, after the reset: not a fault, and nothing to do.
        if value == 0 && !setup.queue.ready() {
            return Ok(());
        }
        if status & (S_FEATURES_OK | S_DRIVER_OK | S_FAILED) != S_FEATURES_OK {
            return Err(MmioError::QueueLocked {
                index,
                status,
                ready: setup.queue.ready(),
            });
        }
        let ready = value == 1;
        if ready && setup.bad_fields != 0 {
            return Err(MmioError::QueueMisconfigured { index });
        }
        setup.queue.set_ready(ready);
        Ok(())
    }

    fn write_driver_features(&mut self, value: u32) {
        // Features may only be written between DRIVER and FEATURES_OK.
        if self.device_status & (S_DRIVER | S_FEATURES_OK | S_FAILED) != S_DRIVER {
            guest_log::guest_warn!(
                "virtio-mmio: DriverFeatures write in status {:#x} ignored",
                self.device_status
            );
            return;
        }
        let value = u64::from(value);
        match self.driver_features_sel {
            0 => self.driver_features = (self.driver_features & !0xffff_ffff) | value,
            1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (value << 32),
            sel => {
                // Features beyond 64 bits do not exist; the driver must write 0 there.
                if value != 0 {
                    guest_log::guest_warn!(
                        "virtio-mmio: driver accepted features {value:#x} in unknown bank {sel}"
                    );
                }
            }
        }
    }

    fn device_features_word(&self) -> u32 {
        let features = self.device.avail_features();
        match self.device_features_sel {
            0 => features as u32,
            1 => (features >> 32) as u32,
            _ => 0,
        }
    }

    /// Checks the driver's feature choice on FEATURES_OK and passes it to the device.
    fn accept_features(&mut self) -> Result<(), MmioError> {
        let offered = self.device.avail_features();
        let unoffered = self.driver_features & !offered;
        if unoffered != 0 {
            return Err(MmioError::UnofferedFeatures { unoffered });
        }
        if self.driver_features & FEATURE_VERSION_1 == 0 {
            return Err(MmioError::NoVersion1 {
                features: self.driver_features,
            });
        }
        self.device
            .set_acked_features(self.driver_features & offered);
        Ok(())
    }

    fn acked_features(&self) -> u64 {
        self.driver_features & self.device.avail_features()
    }

    fn event_idx_negotiated(&self) -> bool {
        self.acked_features() & FEATURE_EVENT_IDX != 0
    }

    /// Copies of the queues for the device, after checking the ready ones against
    /// guest memory.
    fn queues_for_activation(&self) -> Result<Vec<Queue>, ActivateError> {
        let event_idx = self.event_idx_negotiated();
        self.queues
            .iter()
            .enumerate()
            .map(|(index, setup)| {
                let q = &setup.queue;
                if q.ready() && (setup.bad_fields != 0 || !q.is_valid(&self.memory)) {
                    return Err(ActivateError::InvalidQueue { index });
                }
                let mut copy = Queue::try_from(q.state())
                    .map_err(|_| ActivateError::InvalidQueue { index })?;
                copy.set_event_idx(event_idx);
                Ok(copy)
            })
            .collect()
    }

    fn activate(&mut self) -> Result<(), ActivateError> {
        let queues = self.queues_for_activation()?;
        self.device
            .activate(self.memory.clone(), queues, self.interrupt.clone())
    }

    /// Delivers the notifications that came before activation, for the queues the
    /// driver made ready.
    fn deliver_held_notifications(&mut self) {
        for index in 0..self.held_notifications.len() {
            let held = std::mem::take(&mut self.held_notifications[index]);
            if held && self.queues[index].queue.ready() {
                self.deliver_notification(index);
            }
        }
    }

    /// Notifies queue `index` on the driver's behalf: through its ioeventfd, for the
    /// event loop to serve it as far as it takes; without one (tests), the device
    /// serves it here, once, as it serves a trapped QUEUE_NOTIFY write.
    fn deliver_notification(&mut self, index: usize) {
        match self.queue_events.get(index) {
            Some(event) => {
                if let Err(e) = event.write(1) {
                    tracing::error!(
                        "virtio device type {}: cannot notify queue {index} on the driver's \
                         behalf: {e}",
                        self.device.device_type()
                    );
                }
            }
            None => {
                let _ = self.device.process_queue(index);
            }
        }
    }

    /// Device reset (Status = 0): the device and every transport register return to
    /// their initial values.
    fn reset(&mut self) {
        self.device.reset();
        for setup in &mut self.queues {
            setup.queue.reset();
            setup.bad_fields = 0;
            setup.written_addrs = [0; 3];
        }
        self.device_status = 0;
        self.device_activated = false;
        self.held_notifications.fill(false);
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.queue_sel = 0;
        self.interrupt.clear();
        self.missed_interrupts.clear();
        self.missed_notifications.clear();
    }

    fn write_status(&mut self, value: u32) {
        if value == 0 {
            tracing::debug!("virtio-mmio: device reset by the driver");
            self.reset();
            return;
        }
        // NEEDS_RESET belongs to the device (kept apart, see `device_status()`);
        // drivers write back what they read.
        let old = self.device_status;
        let new = value & !S_NEEDS_RESET;
        if new == old {
            return;
        }
        let added = new & !old;
        if old & !new != 0 {
            // Only a reset may clear bits.
            guest_log::guest_warn!(
                "virtio-mmio: {}",
                MmioError::IllegalStatus { from: old, to: new }
            );
            return;
        }
        if added == S_FAILED {
            guest_log::guest_warn!("virtio-mmio: the driver gave up on the device (FAILED)");
            self.device_status |= S_FAILED;
            return;
        }
        match (old, added) {
            (0, S_ACKNOWLEDGE) | (S_ACKNOWLEDGE, S_DRIVER) => self.device_status |= added,
            (o, S_FEATURES_OK) if o == S_ACKNOWLEDGE | S_DRIVER => match self.accept_features() {
                Ok(()) => self.device_status |= S_FEATURES_OK,
                // FEATURES_OK stays clear: the driver reads it back and gives up.
                Err(e) => guest_log::guest_warn!("virtio-mmio: FEATURES_OK refused: {e}"),
            },
            (o, S_DRIVER_OK) if o == S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK => {
                self.device_status |= S_DRIVER_OK;
                match self.activate() {
                    Ok(()) => {
                        self.device_activated = true;
                        self.deliver_held_notifications();
                    }
                    Err(e) => {
                        // Mostly the guest's doing (rings outside its memory), and
                        // it can retry at will: rate-limited.
                        guest_log::guest_warn!(
                            "virtio-mmio: activating device type {} failed: {e}",
                            self.device.device_type()
                        );
                        self.interrupt.signal_needs_reset();
                    }
                }
            }
            _ => guest_log::guest_warn!(
                "virtio-mmio: {}",
                MmioError::IllegalStatus { from: old, to: new }
            ),
        }
    }

    fn read_register(&self, offset: u64) -> Option<u32> {
        let value = match offset {
            REG_MAGIC_VALUE => MMIO_MAGIC_VALUE,
            REG_VERSION => MMIO_VERSION,
            REG_DEVICE_ID => self.device.device_type(),
            REG_VENDOR_ID => MMIO_VENDOR_ID,
            REG_DEVICE_FEATURES => self.device_features_word(),
            // 0 tells the driver the selected queue does not exist.
            REG_QUEUE_NUM_MAX => self
                .selected_queue()
                .map_or(0, |q| u32::from(q.queue.max_size())),
            REG_QUEUE_READY => self
                .selected_queue()
                .map_or(0, |q| u32::from(q.queue.ready())),
            REG_INTERRUPT_STATUS => self.interrupt.status(),
            REG_STATUS => self.device_status(),
            // No shared memory regions: length reads as all-ones (-1).
            REG_SHM_LEN_LOW | REG_SHM_LEN_HIGH => u32::MAX,
            REG_SHM_BASE_LOW | REG_SHM_BASE_HIGH => u32::MAX,
            REG_CONFIG_GENERATION => self.config_generation,
            _ => return None,
        };
        Some(value)
    }

    fn write_register(&mut self, offset: u64, value: u32) {
        let result = match offset {
            REG_DEVICE_FEATURES_SEL => {
                self.device_features_sel = value;
                Ok(())
            }
            REG_DRIVER_FEATURES => {
                self.write_driver_features(value);
                Ok(())
            }
            REG_DRIVER_FEATURES_SEL => {
                self.driver_features_sel = value;
                Ok(())
            }
            REG_QUEUE_SEL => {
                self.queue_sel = value;
                Ok(())
            }
            REG_QUEUE_NUM => self.set_queue_size(value),
            REG_QUEUE_READY => self.set_queue_ready(value),
            REG_QUEUE_NOTIFY => {
                // Only a write no queue's ioeventfd matched traps here (the builder
                // registers one for every queue), so it names no queue; a transport
                // without ioeventfds (tests) leaves the rest for the next notification.
                let _ = self.notify_queue(value);
                Ok(())
            }
            REG_INTERRUPT_ACK => {
                self.interrupt.acknowledge(value);
                Ok(())
            }
            REG_STATUS => {
                self.write_status(value);
                Ok(())
            }
            REG_QUEUE_DESC_LOW => self.set_queue_addr(QueueAddr::Desc, false, value),
            REG_QUEUE_DESC_HIGH => self.set_queue_addr(QueueAddr::Desc, true, value),
            REG_QUEUE_DRIVER_LOW => self.set_queue_addr(QueueAddr::Driver, false, value),
            REG_QUEUE_DRIVER_HIGH => self.set_queue_addr(QueueAddr::Driver, true, value),
            REG_QUEUE_DEVICE_LOW => self.set_queue_addr(QueueAddr::Device, false, value),
            REG_QUEUE_DEVICE_HIGH => self.set_queue_addr(QueueAddr::Device, true, value),
            REG_SHM_SEL => Ok(()),
            _ => {
                tracing::debug!(
                    "virtio-mmio: write of {value:#x} to unknown register {offset:#x} ignored"
                );
                Ok(())
            }
        };
        if let Err(e) = result {
            guest_log::guest_warn!("virtio-mmio: write of {value:#x} at {offset:#x} ignored: {e}");
        }
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if (CONFIG_SPACE_OFFSET..MMIO_WINDOW_SIZE).contains(&offset) {
            let end = offset.saturating_add(data.len() as u64);
            if end > MMIO_WINDOW_SIZE {
                guest_log::guest_warn!(
                    "virtio-mmio: config read {offset:#x}+{} crosses the window",
                    data.len()
                );
                data.fill(0);
                return;
            }
            self.device.read_config(offset - CONFIG_SPACE_OFFSET, data);
            return;
        }
        data.fill(0);
        if data.len() != 4 {
            guest_log::guest_warn!(
                "virtio-mmio: {}-byte read at register {offset:#x} ignored",
                data.len()
            );
            return;
        }
        match self.read_register(offset) {
            Some(value) => data.copy_from_slice(&value.to_le_bytes()),
            None => tracing::debug!("virtio-mmio: read of unknown register {offset:#x}"),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if (CONFIG_SPACE_OFFSET..MMIO_WINDOW_SIZE).contains(&offset) {
            let end = offset.saturating_add(data.len() as u64);
            if end > MMIO_WINDOW_SIZE {
                guest_log::guest_warn!(
                    "virtio-mmio: config write {offset:#x}+{} crosses the window",
                    data.len()
                );
                return;
            }
            self.device.write_config(offset - CONFIG_SPACE_OFFSET, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            guest_log::guest_warn!(
                "virtio-mmio: {}-byte write at register {offset:#x} ignored",
                data.len()
            );
            return;
        };
        self.write_register(offset, u32::from_le_bytes(bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    use crate::devices::virtio::{INTERRUPT_CONFIG_CHANGE, INTERRUPT_USED_BUFFER};
    use vm_memory::Bytes;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    const ACK: u32 = S_ACKNOWLEDGE;
    const DRV: u32 = S_DRIVER;
    const FOK: u32 = S_FEATURES_OK;
    const DOK: u32 = S_DRIVER_OK;
    const OFFERED: u64 = FEATURE_VERSION_1 | (1 << 33) | 0b101;

    /// (ready, size, desc table, avail ring, used ring) of a queue.
    type QueueSummary = (bool, u16, u64, u64, u64);

    #[derive(Default)]
    struct Record {
        acked: Option<u64>,
        activated_with: Option<Vec<QueueSummary>>,
        processed: Vec<usize>,
        resets: usize,
        config_writes: Vec<(u64, Vec<u8>)>,
        fail_activation: bool,
    }

    struct TestDevice {
        record: Arc<Mutex<Record>>,
        sizes: Vec<u16>,
        offered: u64,
    }

    impl VirtioDevice for TestDevice {
        fn device_type(&self) -> u32 {
            42
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &self.sizes
        }
        fn avail_features(&self) -> u64 {
            self.offered
        }
        fn set_acked_features(&mut self, features: u64) {
            self.record.lock().unwrap().acked = Some(features);
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = (offset as u8).wrapping_add(i as u8);
            }
        }
        fn write_config(&mut self, offset: u64, data: &[u8]) {
            self.record
                .lock()
                .unwrap()
                .config_writes
                .push((offset, data.to_vec()));
        }
        fn activate(
            &mut self,
            _memory: GuestMemoryMmap,
            queues: Vec<Queue>,
            _interrupt: InterruptTrigger,
        ) -> Result<(), ActivateError> {
            let mut r = self.record.lock().unwrap();
            if r.fail_activation {
                return Err(ActivateError::Device("refused".into()));
            }
            r.activated_with = Some(
                queues
                    .iter()
                    .map(|q| {
                        (
                            q.ready(),
                            q.size(),
                            q.desc_table(),
                            q.avail_ring(),
                            q.used_ring(),
                        )
                    })
                    .collect(),
            );
            Ok(())
        }
        fn process_queue(&mut self, index: usize) -> QueueProgress {
            self.record.lock().unwrap().processed.push(index);
            QueueProgress::Done
        }
        fn reset(&mut self) {
            self.record.lock().unwrap().resets += 1;
        }
    }

    struct Harness {
        t: MmioTransport,
        record: Arc<Mutex<Record>>,
        interrupt: InterruptTrigger,
    }

    fn harness_with(sizes: Vec<u16>) -> Harness {
        harness_offering(sizes, OFFERED)
    }

    fn harness_offering(sizes: Vec<u16>, offered: u64) -> Harness {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let record = Arc::new(Mutex::new(Record::default()));
        let interrupt = InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        let device = TestDevice {
            record: record.clone(),
            sizes,
            offered,
        };
        Harness {
            t: MmioTransport::new(Box::new(device), memory, interrupt.clone()),
            record,
            interrupt,
        }
    }

    fn harness() -> Harness {
        harness_with(vec![256, 16])
    }

    impl Harness {
        fn r(&mut self, offset: u64) -> u32 {
            let mut data = [0xffu8; 4];
            self.t.read(offset, &mut data);
            u32::from_le_bytes(data)
        }

        fn w(&mut self, offset: u64, value: u32) {
            self.t.write(offset, &value.to_le_bytes());
        }

        fn status(&mut self) -> u32 {
            self.r(REG_STATUS)
        }

        fn set_status(&mut self, bit: u32) {
            let s = self.status();
            self.w(REG_STATUS, s | bit);
        }

        fn write_features(&mut self, features: u64) {
            self.w(REG_DRIVER_FEATURES_SEL, 0);
            self.w(REG_DRIVER_FEATURES, features as u32);
            self.w(REG_DRIVER_FEATURES_SEL, 1);
            self.w(REG_DRIVER_FEATURES, (features >> 32) as u32);
        }

        /// ACKNOWLEDGE, DRIVER, features, FEATURES_OK.
        fn negotiate(&mut self, features: u64) {
            self.set_status(ACK);
            self.set_status(DRV);
            self.write_features(features);
            self.set_status(FOK);
        }

        /// Sets up queue `index` at `base` (desc table, then avail, then used).
        fn setup_queue(&mut self, index: u32, size: u32, base: u64) {
            self.w(REG_QUEUE_SEL, index);
            self.w(REG_QUEUE_NUM, size);
            let avail = base + 16 * u64::from(size);
            let used = (avail + 6 + 2 * u64::from(size) + 3) & !3;
            for (low, addr) in [
                (REG_QUEUE_DESC_LOW, base),
                (REG_QUEUE_DRIVER_LOW, avail),
                (REG_QUEUE_DEVICE_LOW, used),
            ] {
                self.w(low, addr as u32);
                self.w(low + 4, (addr >> 32) as u32);
            }
            self.w(REG_QUEUE_READY, 1);
        }

        /// Guest memory, and where queue 0's available and used indexes are in it.
        fn queue_0_indexes(&self) -> (GuestMemoryMmap, GuestAddress, GuestAddress) {
            let queue = self.t.queues().next().unwrap();
            (
                self.t.memory.clone(),
                GuestAddress(queue.avail_ring() + 2),
                GuestAddress(queue.used_ring() + 2),
            )
        }

        fn bring_up(&mut self) {
            self.negotiate(FEATURE_VERSION_1);
            self.setup_queue(0, 256, 0x1000);
            self.setup_queue(1, 16, 0x8000);
            self.set_status(DOK);
        }
    }

    #[test]
    fn identification_registers() {
        let mut h = harness();
        assert_eq!(h.r(REG_MAGIC_VALUE), 0x7472_6976);
        assert_eq!(h.r(REG_VERSION), 2);
        assert_eq!(h.r(REG_DEVICE_ID), 42);
        assert_eq!(h.r(REG_VENDOR_ID), MMIO_VENDOR_ID);
        assert_eq!(h.r(REG_CONFIG_GENERATION), 0);
        assert_eq!(h.r(REG_SHM_LEN_LOW), u32::MAX);
        assert_eq!(h.t.queue_count(), 2);
        assert_eq!(QUEUE_NOTIFY_OFFSET, 0x50);
    }

    #[test]
    fn device_features_in_two_halves() {
        let mut h = harness();
        h.w(REG_DEVICE_FEATURES_SEL, 0);
        assert_eq!(h.r(REG_DEVICE_FEATURES), OFFERED as u32);
        h.w(REG_DEVICE_FEATURES_SEL, 1);
        assert_eq!(h.r(REG_DEVICE_FEATURES), (OFFERED >> 32) as u32);
        h.w(REG_DEVICE_FEATURES_SEL, 2);
        assert_eq!(h.r(REG_DEVICE_FEATURES), 0);
        h.w(REG_DEVICE_FEATURES_SEL, u32::MAX);
        assert_eq!(h.r(REG_DEVICE_FEATURES), 0);
    }

    #[test]
    fn driver_features_negotiation() {
        let mut h = harness();
        // Before DRIVER, feature writes are ignored.
        h.set_status(ACK);
        h.write_features(OFFERED);
        h.set_status(DRV);
        h.set_status(FOK);
        assert_eq!(h.status(), ACK | DRV, "no VERSION_1 was written yet");
        assert_eq!(h.record.lock().unwrap().acked, None);

        // Both halves, a subset of the offer.
        h.write_features(FEATURE_VERSION_1 | 0b1);
        h.w(REG_DRIVER_FEATURES_SEL, 7);
        h.w(REG_DRIVER_FEATURES, 0xffff_ffff); // nonexistent bank: ignored
        h.set_status(FOK);
        assert_eq!(h.status(), ACK | DRV | FOK);
        assert_eq!(h.record.lock().unwrap().acked, Some(FEATURE_VERSION_1 | 1));

        // After FEATURES_OK the features are frozen.
        h.write_features(OFFERED);
        h.set_status(DOK);
        assert_eq!(h.record.lock().unwrap().acked, Some(FEATURE_VERSION_1 | 1));
    }

    #[test]
    fn features_ok_refused_for_bad_feature_sets() {
        // Without VERSION_1.
        let mut h = harness();
        h.negotiate(0b101);
        assert_eq!(h.status(), ACK | DRV);
        assert_eq!(h.record.lock().unwrap().acked, None);
        // DRIVER_OK cannot follow.
        h.set_status(DOK);
        assert_eq!(h.status(), ACK | DRV);

        // With a feature the device does not offer.
        let mut h = harness();
        h.negotiate(FEATURE_VERSION_1 | (1 << 40));
        assert_eq!(h.status(), ACK | DRV);
        assert_eq!(h.record.lock().unwrap().acked, None);
        // Fixing the choice makes FEATURES_OK stick.
        h.write_features(FEATURE_VERSION_1 | (1 << 33));
        h.set_status(FOK);
        assert_eq!(h.status(), ACK | DRV | FOK);
        assert_eq!(
            h.record.lock().unwrap().acked,
            Some(FEATURE_VERSION_1 | (1 << 33))
        );
    }

    #[test]
    fn status_state_machine_rejects_illegal_orders() {
        let mut h = harness();
        // Skipping steps.
        for s in [DRV, FOK, DOK, ACK | DRV, ACK | DRV | FOK | DOK] {
            h.w(REG_STATUS, s);
            assert_eq!(h.status(), 0, "from 0 to {s:#x}");
        }
        h.set_status(ACK);
        h.w(REG_STATUS, ACK | FOK);
        h.w(REG_STATUS, ACK | DOK);
        assert_eq!(h.status(), ACK);
        h.set_status(DRV);
        h.write_features(FEATURE_VERSION_1);
        h.w(REG_STATUS, ACK | DRV | DOK);
        assert_eq!(h.status(), ACK | DRV);
        // Clearing bits is not allowed (only a full reset).
        h.w(REG_STATUS, ACK);
        assert_eq!(h.status(), ACK | DRV);
        h.set_status(FOK);
        h.set_status(DOK);
        assert_eq!(h.status(), ACK | DRV | FOK | DOK);
        assert!(h.t.is_activated());
        // FAILED can be set at any time and blocks nothing but further progress.
        h.set_status(S_FAILED);
        assert_eq!(h.status(), ACK | DRV | FOK | DOK | S_FAILED);

        let mut h = harness();
        h.set_status(ACK);
        h.set_status(S_FAILED);
        h.set_status(DRV);
        assert_eq!(h.status(), ACK | S_FAILED);
    }

    /// Linux unbinding a driver resets the device, then writes 0 to each queue's
    /// QueueReady: no fault to report. Taking a live queue down stays refused.
    #[test]
    fn clearing_the_ready_bit_of_a_queue_not_ready_is_no_fault() {
        let mut h = harness();
        h.w(REG_QUEUE_SEL, 0);
        assert!(h.t.set_queue_ready(0).is_ok(), "after a reset, status 0");
        h.set_status(ACK);
        h.set_status(DRV);
        h.write_features(FEATURE_VERSION_1);
        h.set_status(FOK);
        h.setup_queue(0, 128, 0x1_0000);
        h.set_status(DOK);
        h.w(REG_QUEUE_SEL, 0);
        assert!(matches!(
            h.t.set_queue_ready(0),
            Err(MmioError::QueueLocked { ready: true, .. })
        ));
        assert_eq!(h.r(REG_QUEUE_READY), 1);
        h.w(REG_QUEUE_SEL, 1);
        assert!(
            h.t.set_queue_ready(0).is_ok(),
            "a queue the driver never set up"
        );
    }

    #[test]
    fn queue_setup_and_activation() {
        let mut h = harness();
        h.w(REG_QUEUE_SEL, 1);
        assert_eq!(h.r(REG_QUEUE_NUM_MAX), 16);
        h.w(REG_QUEUE_SEL, 0);
        assert_eq!(h.r(REG_QUEUE_NUM_MAX), 256);
        h.w(REG_QUEUE_SEL, 2);
        assert_eq!(h.r(REG_QUEUE_NUM_MAX), 0, "nonexistent queue");
        assert_eq!(h.r(REG_QUEUE_READY), 0);

        // Queue setup before FEATURES_OK is ignored.
        h.set_status(ACK);
        h.set_status(DRV);
        h.w(REG_QUEUE_SEL, 0);
        h.w(REG_QUEUE_NUM, 64);
        h.w(REG_QUEUE_READY, 1);
        assert_eq!(h.r(REG_QUEUE_READY), 0);
        assert_eq!(h.t.queues().next().unwrap().size(), 256);

        h.write_features(FEATURE_VERSION_1);
        h.set_status(FOK);
        h.setup_queue(0, 128, 0x1_0000);
        h.setup_queue(1, 16, 0x2_0000);
        h.w(REG_QUEUE_SEL, 1);
        assert_eq!(h.r(REG_QUEUE_READY), 1);
        // A ready queue can no longer be changed.
        h.w(REG_QUEUE_NUM, 8);
        h.w(REG_QUEUE_DESC_LOW, 0x3_0000);
        assert_eq!(h.t.queues().nth(1).unwrap().size(), 16);
        assert_eq!(h.t.queues().nth(1).unwrap().desc_table(), 0x2_0000);

        h.set_status(DOK);
        assert_eq!(h.status(), ACK | DRV | FOK | DOK);
        let activated = h.record.lock().unwrap().activated_with.clone().unwrap();
        assert_eq!(activated.len(), 2);
        assert_eq!(activated[0], (true, 128, 0x1_0000, 0x1_0800, 0x1_0908));
        assert_eq!(activated[1].1, 16);
        assert_eq!(activated[1].2, 0x2_0000);

        // Notifications reach the device, by register or by notify_queue.
        h.w(QUEUE_NOTIFY_OFFSET, 1);
        assert_eq!(h.t.notify_queue(0), QueueProgress::Done);
        assert_eq!(h.t.notify_queue(5), QueueProgress::Done);
        assert_eq!(h.t.notify_queue(u32::MAX), QueueProgress::Done);
        assert_eq!(h.record.lock().unwrap().processed, vec![1, 0]);
    }

    #[test]
    fn invalid_queue_sizes_and_alignment_never_go_live() {
        let mut h = harness();
        h.negotiate(FEATURE_VERSION_1);
        h.w(REG_QUEUE_SEL, 0);
        for bad in [0, 3, 100, 512, 0x1_0000, u32::MAX] {
            h.w(REG_QUEUE_NUM, bad);
            h.w(REG_QUEUE_READY, 1);
            assert_eq!(h.r(REG_QUEUE_READY), 0, "size {bad}");
            assert_eq!(h.t.queues().next().unwrap().size(), 256);
        }
        // A valid size makes the queue usable again.
        h.w(REG_QUEUE_NUM, 64);
        // A misaligned descriptor table blocks readiness until fixed.
        h.w(REG_QUEUE_DESC_LOW, 0x1008);
        h.w(REG_QUEUE_READY, 1);
        assert_eq!(h.r(REG_QUEUE_READY), 0);
        h.w(REG_QUEUE_DESC_LOW, 0x1000);
        // A 64-bit address is composed from both halves.
        h.w(REG_QUEUE_DESC_HIGH, 0x1);
        assert_eq!(h.t.queues().next().unwrap().desc_table(), 0x1_0000_1000);
        h.w(REG_QUEUE_DESC_HIGH, 0);
        h.w(REG_QUEUE_DRIVER_LOW, 0x1401);
        h.w(REG_QUEUE_READY, 1);
        assert_eq!(h.r(REG_QUEUE_READY), 0);
        h.w(REG_QUEUE_DRIVER_LOW, 0x1400);
        h.w(REG_QUEUE_DEVICE_LOW, 0x1802);
        h.w(REG_QUEUE_READY, 1);
        assert_eq!(h.r(REG_QUEUE_READY), 0);
        h.w(REG_QUEUE_DEVICE_LOW, 0x1800);
        h.w(REG_QUEUE_READY, 1);
        assert_eq!(h.r(REG_QUEUE_READY), 1);
        assert_eq!(h.t.queues().next().unwrap().size(), 64);
    }

    /// Linux writes each address as its low half, then its high half. A refused
    /// (misaligned) low half keeps the queue from going live after the high half too:
    /// the address would be the queue's last accepted one, which the driver never
    /// gave. The next valid low half completes the address with that high half.
    #[test]
    fn a_refused_low_half_stays_refused_after_the_high_half() {
        let mut h = harness();
        h.negotiate(FEATURE_VERSION_1);
        h.w(REG_QUEUE_SEL, 0);
        h.w(REG_QUEUE_NUM, 64);
        h.w(REG_QUEUE_DESC_LOW, 0x1000);
        h.w(REG_QUEUE_DESC_HIGH, 0);
        h.w(REG_QUEUE_DESC_LOW, 0x1008); // misaligned: refused
        h.w(REG_QUEUE_DESC_HIGH, 0); // the high half, as Linux writes it next
        h.w(REG_QUEUE_DRIVER_LOW, 0x2000);
        h.w(REG_QUEUE_DRIVER_HIGH, 0);
        h.w(REG_QUEUE_DEVICE_LOW, 0x3000);
        h.w(REG_QUEUE_DEVICE_HIGH, 0);
        h.w(REG_QUEUE_READY, 1);
        let desc = h.t.queues().next().unwrap().desc_table();
        assert_eq!(
            h.r(REG_QUEUE_READY),
            0,
            "queue went live with descriptor table {desc:#x}, the driver wrote 0x1008"
        );
        // The high half written last is kept: a valid low half completes it.
        h.w(REG_QUEUE_DESC_HIGH, 0x1);
        h.w(REG_QUEUE_DESC_LOW, 0x4000);
        assert_eq!(h.t.queues().next().unwrap().desc_table(), 0x1_0000_4000);
        h.w(REG_QUEUE_DESC_HIGH, 0);
        h.w(REG_QUEUE_READY, 1);
        assert_eq!(h.r(REG_QUEUE_READY), 1);
        assert_eq!(h.t.queues().next().unwrap().desc_table(), 0x4000);
    }

    /// A reset forgets the halves the driver wrote: an address written after it has
    /// 0 for the half not written again.
    #[test]
    fn a_reset_forgets_the_written_address_halves() {
        let mut h = harness();
        h.negotiate(FEATURE_VERSION_1);
        h.w(REG_QUEUE_SEL, 0);
        h.w(REG_QUEUE_DESC_HIGH, 0x1);
        h.w(REG_STATUS, 0);
        h.negotiate(FEATURE_VERSION_1);
        h.w(REG_QUEUE_SEL, 0);
        h.w(REG_QUEUE_DESC_LOW, 0x1000);
        assert_eq!(h.t.queues().next().unwrap().desc_table(), 0x1000);
    }

    #[test]
    fn writes_after_driver_ok_are_ignored() {
        let mut h = harness();
        h.bring_up();
        assert!(h.t.is_activated());
        h.w(REG_QUEUE_SEL, 0);
        h.w(REG_QUEUE_READY, 0);
        h.w(REG_QUEUE_NUM, 8);
        h.w(REG_QUEUE_DESC_LOW, 0x4_0000);
        h.w(REG_QUEUE_DESC_HIGH, 1);
        h.write_features(OFFERED);
        h.w(REG_STATUS, ACK | DRV | FOK);
        let q = h.t.queues().next().unwrap();
        assert!(q.ready());
        assert_eq!(q.size(), 256);
        assert_eq!(q.desc_table(), 0x1000);
        assert_eq!(h.status(), ACK | DRV | FOK | DOK);
        assert_eq!(h.record.lock().unwrap().acked, Some(FEATURE_VERSION_1));
    }

    #[test]
    fn reset_clears_everything() {
        let mut h = harness();
        h.bring_up();
        h.interrupt.signal_used_queue();
        assert_eq!(h.r(REG_INTERRUPT_STATUS), 1);
        h.w(REG_QUEUE_SEL, 1);
        h.w(REG_DEVICE_FEATURES_SEL, 1);
        h.w(REG_STATUS, 0);
        assert_eq!(h.status(), 0);
        assert!(!h.t.is_activated());
        assert_eq!(h.record.lock().unwrap().resets, 1);
        assert_eq!(h.r(REG_INTERRUPT_STATUS), 0);
        assert_eq!(
            h.r(REG_DEVICE_FEATURES),
            OFFERED as u32,
            "selector back to 0"
        );
        assert_eq!(h.r(REG_QUEUE_NUM_MAX), 256, "queue selector back to 0");
        for q in h.t.queues() {
            assert!(!q.ready());
            assert_eq!(q.size(), q.max_size());
            assert_eq!(q.desc_table(), 0);
        }
        // Notifications wait for the next activation.
        assert_eq!(h.t.notify_queue(0), QueueProgress::Done);
        assert!(h.record.lock().unwrap().processed.is_empty());
        // The driver can start over; the old feature choice is gone.
        h.set_status(ACK);
        h.set_status(DRV);
        h.set_status(FOK);
        assert_eq!(h.status(), ACK | DRV);
        h.write_features(FEATURE_VERSION_1);
        h.set_status(FOK);
        h.setup_queue(0, 256, 0x1000);
        h.setup_queue(1, 16, 0x8000);
        h.set_status(DOK);
        assert!(h.t.is_activated());
        assert_eq!(h.record.lock().unwrap().processed, vec![0]);
    }

    /// Notifications before DRIVER_OK reach the device at activation, once each,
    /// for the queues that are ready; nonexistent queues are not remembered.
    #[test]
    fn notifications_before_driver_ok_are_served_at_activation() {
        let mut h = harness_with(vec![256, 16, 8]);
        h.negotiate(FEATURE_VERSION_1);
        h.setup_queue(0, 256, 0x1000);
        h.setup_queue(2, 8, 0xc000);
        for index in [2, 1, 2, 7, u32::MAX] {
            h.w(QUEUE_NOTIFY_OFFSET, index);
        }
        assert!(h.record.lock().unwrap().processed.is_empty());
        h.set_status(DOK);
        assert!(h.t.is_activated());
        // Queue 1 was notified but never made ready.
        assert_eq!(h.record.lock().unwrap().processed, vec![2]);
        h.w(QUEUE_NOTIFY_OFFSET, 0);
        assert_eq!(h.record.lock().unwrap().processed, vec![2, 0]);
    }

    /// With the queues' ioeventfds, a held notification is signalled there, for the
    /// event loop to serve, and the device is not called on the vCPU's thread.
    #[test]
    fn held_notifications_go_through_the_queue_events() {
        let mut h = harness();
        let events: Vec<EventFd> = (0..2)
            .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
            .collect();
        h.t.deliver_through(events.iter().map(|e| e.try_clone().unwrap()).collect());
        h.negotiate(FEATURE_VERSION_1);
        h.setup_queue(0, 256, 0x1000);
        h.setup_queue(1, 16, 0x8000);
        assert_eq!(h.t.notify_queue(1), QueueProgress::Done);
        h.set_status(DOK);
        assert!(h.record.lock().unwrap().processed.is_empty());
        assert!(events[0].read().is_err(), "queue 0 was not notified");
        assert_eq!(events[1].read().unwrap(), 1);
    }

    /// A failed activation delivers nothing, and a reset forgets what was held.
    #[test]
    fn a_reset_forgets_held_notifications() {
        let mut h = harness();
        h.record.lock().unwrap().fail_activation = true;
        h.negotiate(FEATURE_VERSION_1);
        h.setup_queue(0, 256, 0x1000);
        h.setup_queue(1, 16, 0x8000);
        h.w(QUEUE_NOTIFY_OFFSET, 0);
        h.set_status(DOK);
        assert_ne!(h.status() & S_NEEDS_RESET, 0);
        h.w(QUEUE_NOTIFY_OFFSET, 1);
        h.w(REG_STATUS, 0);
        h.record.lock().unwrap().fail_activation = false;
        h.bring_up();
        assert!(h.t.is_activated());
        assert!(h.record.lock().unwrap().processed.is_empty());
    }

    #[test]
    fn interrupt_status_and_ack() {
        let mut h = harness();
        h.interrupt.signal_used_queue();
        h.interrupt.signal_config_change();
        assert_eq!(h.r(REG_INTERRUPT_STATUS), 3);
        h.w(REG_INTERRUPT_ACK, 1);
        assert_eq!(h.r(REG_INTERRUPT_STATUS), 2);
        h.w(REG_INTERRUPT_ACK, 2);
        assert_eq!(h.r(REG_INTERRUPT_STATUS), 0);
    }

    #[test]
    fn a_backend_with_the_irqfd_keeps_the_used_buffer_bit_set_until_reset() {
        let mut h = harness();
        h.bring_up();
        let irqfd = h.interrupt.irqfd_for_backend().unwrap();
        irqfd.write(1).unwrap();
        assert_eq!(h.r(REG_INTERRUPT_STATUS), 1);
        h.w(REG_INTERRUPT_ACK, 1);
        assert_eq!(
            h.r(REG_INTERRUPT_STATUS),
            1,
            "the VMM never sees the signals"
        );
        h.interrupt.signal_config_change();
        h.w(REG_INTERRUPT_ACK, 3);
        assert_eq!(h.r(REG_INTERRUPT_STATUS), 1);
        h.w(REG_STATUS, 0);
        assert_eq!(h.r(REG_INTERRUPT_STATUS), 0);
    }

    /// A lost interrupt: the device used a buffer past the driver's `used_event` and
    /// the driver has not moved for a whole look. Raised again with EVENT_IDX only
    /// (without it the rings do not say what the driver took), never on the first
    /// look after a reset, and no more once the driver takes its buffers.
    #[test]
    fn a_missed_interrupt_is_raised_again_with_event_idx_only() {
        for negotiated in [FEATURE_VERSION_1 | FEATURE_EVENT_IDX, FEATURE_VERSION_1] {
            let with_event_idx = negotiated & FEATURE_EVENT_IDX != 0;
            let mut h = harness_offering(vec![256], OFFERED | FEATURE_EVENT_IDX);
            h.negotiate(negotiated);
            h.setup_queue(0, 256, 0x1000);
            h.set_status(DOK);
            let queue = h.t.queues().next().unwrap();
            let used_idx = GuestAddress(queue.used_ring() + 2);
            let used_event = GuestAddress(queue.avail_ring() + 4 + 2 * 256);
            let memory = h.t.memory.clone();
            let set = |address, value: u16| memory.write_obj(value.to_le(), address).unwrap();
            let look = |h: &mut Harness| {
                h.t.raise_missed_interrupt();
                let raised = h.r(REG_INTERRUPT_STATUS) & INTERRUPT_USED_BUFFER != 0;
                h.w(REG_INTERRUPT_ACK, INTERRUPT_USED_BUFFER);
                raised
            };
            set(used_idx, 6);
            set(used_event, 5);
            assert!(!look(&mut h), "the first look");
            assert_eq!(look(&mut h), with_event_idx, "the second, unmoved");
            assert_eq!(look(&mut h), with_event_idx, "and the third");
            set(used_event, 6);
            assert!(!look(&mut h), "the driver took the buffer");
            assert!(!look(&mut h), "and is idle");
            set(used_event, 5);
            h.w(REG_STATUS, 0);
            h.negotiate(negotiated);
            h.setup_queue(0, 256, 0x1000);
            h.set_status(DOK);
            assert!(!look(&mut h), "the first look after a reset");
            assert_eq!(look(&mut h), with_event_idx, "the next");
            let expected = if with_event_idx { 3 } else { 0 };
            assert_eq!(h.t.interrupts_raised_again(), expected);
        }
    }

    /// A device of the VMM's own signalled, and the driver's handler never ran (no
    /// InterruptACK) for a whole look: the irqfd is signalled again, once per look,
    /// until the driver acknowledges.
    #[test]
    fn an_interrupt_left_unacknowledged_is_raised_again() {
        let mut h = harness();
        h.bring_up();
        let irqfd = h.interrupt.irqfd_for_backend().unwrap();
        h.interrupt.signal_used_queue();
        assert_eq!(irqfd.read().unwrap(), 1);
        h.t.raise_missed_interrupt();
        assert!(irqfd.read().is_err(), "the first look raises nothing");
        h.t.raise_missed_interrupt();
        assert_eq!(irqfd.read().unwrap(), 1, "raised again");
        h.t.raise_missed_interrupt();
        assert_eq!(irqfd.read().unwrap(), 1, "and again");
        h.w(REG_INTERRUPT_ACK, INTERRUPT_USED_BUFFER);
        h.t.raise_missed_interrupt();
        h.t.raise_missed_interrupt();
        assert!(irqfd.read().is_err(), "acknowledged: nothing to raise");
        h.interrupt.signal_used_queue();
        irqfd.read().unwrap();
        h.t.raise_missed_interrupt();
        h.w(REG_INTERRUPT_ACK, INTERRUPT_USED_BUFFER);
        h.interrupt.signal_used_queue();
        irqfd.read().unwrap();
        h.t.raise_missed_interrupt();
        assert!(
            irqfd.read().is_err(),
            "acknowledged between the looks, then signalled anew: not missed"
        );
        assert_eq!(h.t.interrupts_raised_again(), 2);
    }

    #[test]
    fn the_first_ten_missed_interrupts_then_each_tenfold_count_are_said() {
        let said: Vec<u64> = (1..=1000).filter(|&n| said_on_the_log(n)).collect();
        assert_eq!(said, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100, 1000]);
    }

    #[test]
    fn config_space_is_forwarded_at_any_width() {
        let mut h = harness();
        let mut b = [0u8; 1];
        h.t.read(0x105, &mut b);
        assert_eq!(b, [5]);
        let mut q = [0u8; 8];
        h.t.read(0x110, &mut q);
        assert_eq!(q, [0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17]);
        h.t.write(0x102, &[1, 2]);
        // Crossing the end of the window: ignored.
        let mut q = [0xffu8; 8];
        h.t.read(0xffc, &mut q);
        assert_eq!(q, [0; 8]);
        h.t.write(0xffc, &[0; 8]);
        assert_eq!(
            h.record.lock().unwrap().config_writes,
            vec![(2, vec![1, 2])]
        );
    }

    #[test]
    fn unknown_offsets_and_odd_widths_do_not_panic() {
        let mut h = harness();
        for offset in [
            0x1,
            0x18,
            0x28,
            0x3c,
            0x40,
            0x4c,
            0x51,
            0xc0,
            0xfd,
            0x1000,
            u64::MAX,
        ] {
            assert_eq!(h.r(offset), 0, "offset {offset:#x}");
            h.w(offset, 0xffff_ffff);
        }
        for len in [0usize, 1, 2, 3, 5, 8] {
            let mut data = vec![0xffu8; len];
            h.t.read(REG_MAGIC_VALUE, &mut data);
            assert!(data.iter().all(|&b| b == 0), "width {len}");
            h.t.write(REG_STATUS, &data);
            h.t.write(REG_STATUS, &vec![1u8; len]);
        }
        assert_eq!(h.status(), 0);
        let mut empty = [];
        h.t.read(0x100, &mut empty);
        h.t.write(0x100, &empty);
    }

    #[test]
    fn invalid_queue_at_driver_ok_needs_reset() {
        let mut h = harness();
        h.negotiate(FEATURE_VERSION_1);
        // Rings beyond the 1 MiB of guest memory.
        h.setup_queue(0, 256, 0x10_0000);
        h.setup_queue(1, 16, 0x8000);
        h.set_status(DOK);
        assert_eq!(h.status(), ACK | DRV | FOK | DOK | S_NEEDS_RESET);
        assert!(!h.t.is_activated());
        assert!(h.record.lock().unwrap().activated_with.is_none());
        assert_eq!(h.r(REG_INTERRUPT_STATUS) & 2, 2, "config change signalled");
        assert_eq!(h.t.notify_queue(0), QueueProgress::Done);
        assert!(h.record.lock().unwrap().processed.is_empty());
        // The driver writing NEEDS_RESET back does not matter; reset clears it.
        let s = h.status();
        h.w(REG_STATUS, s | S_FAILED);
        assert_eq!(h.status(), s | S_FAILED);
        h.w(REG_STATUS, 0);
        assert_eq!(h.status(), 0);

        // High address half pointing far away.
        let mut h = harness();
        h.negotiate(FEATURE_VERSION_1);
        h.setup_queue(0, 256, 0x1000);
        h.w(REG_QUEUE_SEL, 1);
        h.w(REG_QUEUE_NUM, 16);
        h.w(REG_QUEUE_DESC_HIGH, 0xffff_ffff);
        h.w(REG_QUEUE_READY, 1);
        h.set_status(DOK);
        assert_ne!(h.status() & S_NEEDS_RESET, 0);
    }

    #[test]
    fn device_activation_failure_needs_reset() {
        let mut h = harness();
        h.record.lock().unwrap().fail_activation = true;
        h.bring_up();
        assert_eq!(h.status(), ACK | DRV | FOK | DOK | S_NEEDS_RESET);
        assert!(!h.t.is_activated());
    }

    #[test]
    fn invalid_device_queue_sizes_are_clamped() {
        let mut h = harness_with(vec![0, 300, u16::MAX]);
        let sizes: Vec<u16> = h.t.queues().map(|q| q.max_size()).collect();
        assert_eq!(sizes, vec![1, 256, 32768]);
        h.w(REG_QUEUE_SEL, 1);
        assert_eq!(h.r(REG_QUEUE_NUM_MAX), 256);
    }

    /// The rng device's queue at 0x1000 (256 entries), the driver done.
    /// An rng device, its queue 0 set up at 0x1000, before DRIVER_OK.
    fn rng_before_driver_ok() -> (Harness, Arc<EventFd>) {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let irqfd = Arc::new(EventFd::new(EFD_NONBLOCK).unwrap());
        let interrupt = InterruptTrigger::new(irqfd.clone());
        let mut h = Harness {
            t: MmioTransport::new(
                Box::new(super::super::rng::Rng::new()),
                memory,
                interrupt.clone(),
            ),
            record: Arc::new(Mutex::new(Record::default())),
            interrupt,
        };
        h.negotiate(FEATURE_VERSION_1);
        h.setup_queue(0, 256, 0x1000);
        (h, irqfd)
    }

    fn rng_harness() -> (Harness, Arc<EventFd>) {
        let (mut h, irqfd) = rng_before_driver_ok();
        h.set_status(DOK);
        (h, irqfd)
    }

    /// Makes one 16-byte entropy request (descriptor 0) available on the rng's queue.
    fn offer_entropy_request(memory: &GuestMemoryMmap, avail_idx: GuestAddress) {
        let desc = virtio_queue::desc::split::Descriptor::new(
            0x8_0000,
            16,
            virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16,
            0,
        );
        memory
            .write_obj(
                virtio_queue::desc::RawDescriptor::from(desc),
                GuestAddress(0x1000),
            )
            .unwrap();
        memory.write_obj(1u16.to_le(), avail_idx).unwrap();
    }

    /// A request the driver made available and notified before DRIVER_OK is served
    /// at activation: a driver waiting for it would otherwise wait for ever.
    #[test]
    fn a_request_notified_before_driver_ok_is_served() {
        let (mut h, irqfd) = rng_before_driver_ok();
        let (memory, avail_idx, used_idx) = h.queue_0_indexes();
        offer_entropy_request(&memory, avail_idx);
        h.w(QUEUE_NOTIFY_OFFSET, 0);
        assert_eq!(memory.read_obj::<u16>(used_idx).unwrap(), 0);
        h.set_status(DOK);
        assert_eq!(memory.read_obj::<u16>(used_idx).unwrap(), 1);
        assert_eq!(h.r(REG_INTERRUPT_STATUS), INTERRUPT_USED_BUFFER);
        assert_eq!(irqfd.read().unwrap(), 1);
    }

    /// A device whose available ring cannot be read (its index more than a ring ahead
    /// of what the device took) sets DEVICE_NEEDS_RESET and raises a configuration
    /// change interrupt (virtio 1.x, 2.1.2), once; the driver's reset clears both and
    /// the device works again.
    #[test]
    fn an_unreadable_ring_makes_the_device_need_a_reset() {
        let (mut h, irqfd) = rng_harness();
        let (memory, avail_idx, used_idx) = h.queue_0_indexes();
        memory.write_obj(257u16.to_le(), avail_idx).unwrap();
        h.w(QUEUE_NOTIFY_OFFSET, 0);
        assert_eq!(h.status(), ACK | DRV | FOK | DOK | S_NEEDS_RESET);
        assert_eq!(h.t.device_status() & S_NEEDS_RESET, S_NEEDS_RESET);
        assert_eq!(h.r(REG_INTERRUPT_STATUS), INTERRUPT_CONFIG_CHANGE);
        assert_eq!(irqfd.read().unwrap(), 1);
        // Said once: more notifications raise nothing more.
        h.w(REG_INTERRUPT_ACK, INTERRUPT_CONFIG_CHANGE);
        h.w(QUEUE_NOTIFY_OFFSET, 0);
        assert_eq!(h.r(REG_INTERRUPT_STATUS), 0);
        assert!(irqfd.read().is_err(), "a second interrupt");
        // The driver writing the bit back does not clear it; a reset does.
        let s = h.status();
        h.w(REG_STATUS, s | S_FAILED);
        assert_eq!(h.status(), s | S_FAILED);
        h.w(REG_STATUS, 0);
        assert_eq!(h.status(), 0);
        assert_eq!(h.r(REG_INTERRUPT_STATUS), 0);

        // Brought up again on a sane ring (one entropy request), it serves.
        memory.write_obj(0u16, avail_idx).unwrap();
        memory.write_obj(0u16, used_idx).unwrap();
        h.negotiate(FEATURE_VERSION_1);
        h.setup_queue(0, 256, 0x1000);
        h.set_status(DOK);
        offer_entropy_request(&memory, avail_idx);
        h.w(QUEUE_NOTIFY_OFFSET, 0);
        assert_eq!(h.status(), ACK | DRV | FOK | DOK);
        assert_eq!(memory.read_obj::<u16>(used_idx).unwrap(), 1);
        assert_eq!(h.r(REG_INTERRUPT_STATUS), INTERRUPT_USED_BUFFER);
    }

    /// A request made available without a notification (one lost on its way) is
    /// served at the second look that finds it unmoved, through the queue's
    /// ioeventfd when there is one, and counted.
    #[test]
    fn a_request_whose_notification_never_came_is_served_a_look_later() {
        let (mut h, irqfd) = rng_harness();
        let (memory, avail_idx, used_idx) = h.queue_0_indexes();
        h.t.serve_missed_notifications();
        offer_entropy_request(&memory, avail_idx);
        h.t.serve_missed_notifications();
        assert_eq!(
            memory.read_obj::<u16>(used_idx).unwrap(),
            0,
            "it may yet come"
        );
        h.t.serve_missed_notifications();
        assert_eq!(memory.read_obj::<u16>(used_idx).unwrap(), 1);
        assert_eq!(irqfd.read().unwrap(), 1);
        assert_eq!(h.t.notifications_made_up(), 1);
        h.t.serve_missed_notifications();
        h.t.serve_missed_notifications();
        assert_eq!(h.t.notifications_made_up(), 1, "nothing waits any more");

        // With the queue's ioeventfd, the event loop is told.
        let event = EventFd::new(EFD_NONBLOCK).unwrap();
        h.t.deliver_through(vec![event.try_clone().unwrap()]);
        memory.write_obj(2u16.to_le(), avail_idx).unwrap();
        h.t.serve_missed_notifications();
        h.t.serve_missed_notifications();
        assert_eq!(event.read().unwrap(), 1);
        assert_eq!(
            memory.read_obj::<u16>(used_idx).unwrap(),
            1,
            "left to the event loop"
        );
        assert_eq!(h.t.notifications_made_up(), 2);
    }

    /// Queues whose device may hold chains (the test device's, by the trait's
    /// default) are not watched, nor are those of a device not activated.
    #[test]
    fn queues_that_hold_chains_are_not_watched() {
        let mut h = harness();
        let memory = h.t.memory.clone();
        // Queue 0's available index, once brought up at 0x1000 with 256 entries.
        memory
            .write_obj(3u16.to_le(), GuestAddress(0x1000 + 16 * 256 + 2))
            .unwrap();
        for _ in 0..3 {
            h.t.serve_missed_notifications();
        }
        h.bring_up();
        for _ in 0..3 {
            h.t.serve_missed_notifications();
        }
        assert!(h.record.lock().unwrap().processed.is_empty());
        assert_eq!(h.t.notifications_made_up(), 0);
    }

    #[test]
    fn works_with_the_rng_device() {
        let (mut h, _irqfd) = rng_harness();
        assert_eq!(h.r(REG_DEVICE_ID), super::super::DEVICE_ID_RNG);
        assert_eq!(h.status(), ACK | DRV | FOK | DOK);
        h.w(QUEUE_NOTIFY_OFFSET, 0);
    }
}
