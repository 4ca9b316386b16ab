//! virtio-balloon (virtio 1.2, section 5.5), offered for free page reporting alone
//! (VIRTIO_BALLOON_F_REPORTING): the guest tells the device which blocks of its memory
//! it has freed, and the device drops their pages from the host. Without it a VM holds
//! its guest's high-water mark of memory until it stops, hours for a pinned workspace
//! VM after one large build.
//!
//! The device never asks for memory: its target (`num_pages`) stays 0, so a driver has
//! no reason to inflate, and the chains it puts on the inflate and deflate queues are
//! returned untouched. A reported page reads as zeros when the guest uses it again
//! (the host faults in a new one), which is what a driver that reported it expects.

mod discard;

use virtio_queue::desc::split::Descriptor;
use virtio_queue::Queue;

use super::{
    queues_of, read_config_bytes, ActivateError, ActiveQueue, InterruptTrigger, QueueProgress,
    VirtioDevice, FEATURE_EVENT_IDX, FEATURE_VERSION_1,
};
use crate::memory::GuestMemoryMmap;

pub use discard::{discard_guest_range, DiscardError};

/// virtio device ID of the balloon (virtio 1.2, section 5).
pub const DEVICE_ID_BALLOON: u32 = 5;
/// VIRTIO_BALLOON_F_REPORTING: the driver reports free pages on their own queue.
pub const FEATURE_REPORTING: u64 = 1 << 5;

/// Queues in the order the driver sets them up when only reporting is negotiated
/// (queues of features not negotiated take no index, virtio 1.2, 5.5.2).
const INFLATE_QUEUE: usize = 0;
const DEFLATE_QUEUE: usize = 1;
const REPORTING_QUEUE: usize = 2;
/// Linux refuses a reporting queue smaller than its batch (PAGE_REPORTING_CAPACITY,
/// 32 blocks); the other two are never used for more than a few chains.
const QUEUE_SIZE: u16 = 128;

/// Size of the configuration space: `num_pages`, then `actual` (u32 each, little
/// endian). The fields after them belong to features the device does not offer.
const CONFIG_SIZE: usize = 8;
const ACTUAL_OFFSET: u64 = 4;

const NAME: &str = "virtio-balloon";

/// The balloon: its queues once the driver activated it, and what the guest gave back.
pub struct Balloon {
    acked_features: u64,
    queue_max_sizes: [u16; 3],
    /// Pages the driver says the balloon holds (`actual`); only ever reported back.
    actual_pages: u32,
    active: Option<ActiveBalloon>,
    returned: ReturnedMemory,
}

struct ActiveBalloon {
    inflate: ActiveQueue,
    deflate: ActiveQueue,
    /// Absent when the driver did not negotiate reporting.
    reporting: Option<ActiveQueue>,
}

/// What free page reporting gave back to the host since the device was created.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReturnedMemory {
    /// Reports (descriptor chains) served.
    pub reports: u64,
    /// Bytes whose pages were dropped, counted as the guest reported them (pages the
    /// host had not faulted in yet count too).
    pub bytes: u64,
}

impl Default for Balloon {
    fn default() -> Self {
        Self::new()
    }
}

impl Balloon {
    pub fn new() -> Self {
        Self {
            acked_features: 0,
            queue_max_sizes: [QUEUE_SIZE; 3],
            actual_pages: 0,
            active: None,
            returned: ReturnedMemory::default(),
        }
    }

    pub fn returned(&self) -> ReturnedMemory {
        self.returned
    }

    fn config_space(&self) -> [u8; CONFIG_SIZE] {
        let mut config = [0u8; CONFIG_SIZE];
        // num_pages (bytes 0..4) stays 0: the device never asks the guest for memory.
        config[4..8].copy_from_slice(&self.actual_pages.to_le_bytes());
        config
    }
}

/// Drops the pages of every buffer of one report. A buffer that is not all guest RAM
/// is skipped with a warning (the others are still dropped); nothing is written to
/// the guest, so the used length is 0.
fn discard_report(
    descriptors: &[Descriptor],
    memory: &GuestMemoryMmap,
    returned: &mut ReturnedMemory,
) -> u32 {
    returned.reports += 1;
    let mut dropped = 0u64;
    for desc in descriptors {
        match discard_guest_range(memory, desc.addr(), u64::from(desc.len())) {
            Ok(()) => dropped += u64::from(desc.len()),
            Err(error) => guest_log::guest_warn!("{NAME}: free page report: {error}"),
        }
    }
    returned.bytes += dropped;
    tracing::debug!(
        "{NAME}: the guest reported {} KiB free in {} blocks; {} MiB given back since boot \
         in {} reports; its memory holds {} MiB of the host's",
        dropped >> 10,
        descriptors.len(),
        returned.bytes >> 20,
        returned.reports,
        resident_bytes(memory).map_or_else(|| "?".into(), |bytes| (bytes >> 20).to_string())
    );
    0
}

/// How much of the host's memory the guest's memory file holds (its allocated blocks);
/// `None` for memory that is not one file (tests).
fn resident_bytes(memory: &GuestMemoryMmap) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    let file = memory.iter().next()?.file_offset()?.file();
    Some(file.metadata().ok()?.blocks() * 512)
}

/// Returns a chain of the inflate or deflate queue untouched: the device never asked
/// for memory, so there is nothing to take or give back.
fn return_untouched(descriptors: &[Descriptor], queue: &str) -> u32 {
    tracing::debug!(
        "{NAME}: {} buffers on the {queue} queue returned untouched (the device asks for no memory)",
        descriptors.len()
    );
    0
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        DEVICE_ID_BALLOON
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_max_sizes
    }

    fn avail_features(&self) -> u64 {
        FEATURE_VERSION_1 | FEATURE_EVENT_IDX | FEATURE_REPORTING
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features();
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config_space(), offset, data);
    }

    /// Only `actual` is the driver's to write, and only whole.
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        match <[u8; 4]>::try_from(data) {
            Ok(bytes) if offset == ACTUAL_OFFSET => self.actual_pages = u32::from_le_bytes(bytes),
            _ => tracing::debug!(
                "{NAME}: config write of {} bytes at {offset:#x} ignored",
                data.len()
            ),
        }
    }

    fn activate(
        &mut self,
        memory: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: InterruptTrigger,
    ) -> Result<(), ActivateError> {
        let [inflate, deflate, reporting] = queues_of(queues)?;
        let serve = |queue: Queue, index: usize| {
            ActiveQueue::for_queue(memory.clone(), queue, index, interrupt.clone())
        };
        let reporting = if self.acked_features & FEATURE_REPORTING != 0 {
            Some(serve(reporting, REPORTING_QUEUE)?)
        } else {
            None
        };
        let inflate = serve(inflate, INFLATE_QUEUE)?;
        let deflate = serve(deflate, DEFLATE_QUEUE)?;
        self.active = Some(ActiveBalloon {
            inflate,
            deflate,
            reporting,
        });
        Ok(())
    }

    /// Every chain goes back as it is served.
    fn holds_chains(&self, _index: usize) -> bool {
        false
    }

    fn process_queue(&mut self, index: usize) -> QueueProgress {
        let Some(active) = self.active.as_mut() else {
            tracing::debug!("{NAME}: queue {index} notified before activation");
            return QueueProgress::Done;
        };
        let returned = &mut self.returned;
        match (index, active.reporting.as_mut()) {
            (INFLATE_QUEUE, _) => active
                .inflate
                .serve(NAME, |descs, _| return_untouched(descs, "inflate")),
            (DEFLATE_QUEUE, _) => active
                .deflate
                .serve(NAME, |descs, _| return_untouched(descs, "deflate")),
            (REPORTING_QUEUE, Some(reporting)) => reporting.serve(NAME, |descs, memory| {
                discard_report(descs, memory, returned)
            }),
            _ => {
                guest_log::guest_warn!("{NAME}: notification for nonexistent queue {index}");
                QueueProgress::Done
            }
        }
    }

    fn reset(&mut self) {
        self.active = None;
        self.acked_features = 0;
        self.actual_pages = 0;
    }
}

#[cfg(test)]
mod tests;
