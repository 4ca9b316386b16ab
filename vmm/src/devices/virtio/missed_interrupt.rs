//! A watch for device interrupts the driver never got.
//!
//! An interrupt can be lost on its way to the guest's driver: an edge-triggered
//! IOAPIC pin drops an edge while the guest has it masked, and emulated hardware
//! virtualization has lost wake-ups too. The driver then waits until some other
//! interrupt of the device comes along (a `git status` in the guest waiting minutes).
//! Two things tell, at two looks some time apart, that the driver missed one:
//!
//! - The VMM's own bits in InterruptStatus stayed set with no InterruptACK in
//!   between: the driver's handler, which acknowledges first thing, did not run.
//! - For a backend that interrupts the guest itself (vhost-user), whose interrupts
//!   the VMM never sees: with EVENT_IDX the driver writes, in each queue's
//!   `used_event`, the used-ring index at which it wants its next interrupt, and
//!   moves it on each time it has taken what the device used. A used index gone past
//!   `used_event`, with neither having moved between the looks, is an interrupt due
//!   and not acted on. (Without EVENT_IDX nothing in the rings says how far the
//!   driver has got.)
//!
//! Raising the interrupt again costs the driver one look at its rings.

use std::sync::atomic::Ordering;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};

use crate::memory::GuestMemoryMmap;

/// virtq_avail's `flags` and `idx` come before its ring; `used_event` follows it.
const AVAIL_RING_HEADER_SIZE: u64 = 4;
const AVAIL_ELEMENT_SIZE: u64 = 2;

/// Where a queue stood at one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsedProgress {
    /// How many buffers the device has used (the used ring's `idx`).
    pub used_idx: u16,
    /// The used index at which the driver asked to be interrupted.
    pub used_event: u16,
    pub queue_size: u16,
}

impl UsedProgress {
    /// Reads `queue`'s progress from guest memory; `None` for a queue that is not
    /// ready or whose rings the guest placed where nothing can be read.
    pub fn read(queue: &Queue, memory: &GuestMemoryMmap) -> Option<UsedProgress> {
        if !queue.ready() {
            return None;
        }
        let used_idx = queue.used_idx(memory, Ordering::Acquire).ok()?.0;
        let offset = AVAIL_RING_HEADER_SIZE + u64::from(queue.size()) * AVAIL_ELEMENT_SIZE;
        let address = GuestAddress(queue.avail_ring()).checked_add(offset)?;
        let used_event = memory
            .load::<u16>(address, Ordering::Acquire)
            .ok()
            .map(u16::from_le)?;
        Some(UsedProgress {
            used_idx,
            used_event,
            queue_size: queue.size(),
        })
    }

    /// Whether the device has written the used entry the driver asked to be
    /// interrupted at (counting modulo 2^16, as the ring does). A `used_event` ahead
    /// of the used index (a driver that wants to hear only after some more) is not.
    fn interrupt_due(self) -> bool {
        let past = self.used_idx.wrapping_sub(self.used_event);
        (1..=self.queue_size).contains(&past)
    }
}

/// What one look saw of a device.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Look {
    /// [`super::InterruptTrigger::unacknowledged`].
    pub unacknowledged: Option<u64>,
    /// Each queue's progress where the driver negotiated EVENT_IDX (`None`: not
    /// watched).
    pub queues: Vec<Option<UsedProgress>>,
}

/// How the driver was seen to miss an interrupt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missed {
    /// InterruptStatus waited a whole look for the driver's acknowledgement.
    Unacknowledged,
    /// Used buffers past the driver's `used_event` stayed untaken a whole look.
    UsedBuffersUntaken,
}

/// The previous look at a device.
#[derive(Debug, Default)]
pub struct MissedInterruptWatch {
    last: Option<Look>,
}

impl MissedInterruptWatch {
    /// Takes a look now and says whether the driver missed an interrupt that was
    /// waiting for it at the previous look already.
    pub fn missed(&mut self, now: Look) -> Option<Missed> {
        let missed = self.last.as_ref().and_then(|last| {
            if now.unacknowledged.is_some() && now.unacknowledged == last.unacknowledged {
                return Some(Missed::Unacknowledged);
            }
            let untaken = |pair: (&Option<UsedProgress>, &Option<UsedProgress>)| match pair {
                (Some(now), Some(last)) => now == last && now.interrupt_due(),
                _ => false,
            };
            now.queues
                .iter()
                .zip(&last.queues)
                .any(untaken)
                .then_some(Missed::UsedBuffersUntaken)
        });
        self.last = Some(now);
        missed
    }

    /// Forgets what it saw (a device reset).
    pub fn clear(&mut self) {
        self.last = None;
    }
}

/// In each line the VMM logs as it raises a missed interrupt again (the first ten,
/// then every tenfold count), for a reader of the log to find them by.
pub const LOG_MARK: &str = "(a lost interrupt;";

/// What follows the count in the line the VMM logs as the VM ends, for each device
/// whose driver missed interrupts ([`summary`]); [`total_in_log`] reads it back.
const SUMMARY_TAIL: &str = "missed interrupt(s) raised again";

/// The line said as the VM ends for the device in virtio-mmio slot `slot`.
pub fn summary(slot: usize, count: u64) -> String {
    format!("virtio-mmio slot {slot}: {count} {SUMMARY_TAIL}")
}

/// The missed interrupts a VMM's log says were raised again, over all its devices.
pub fn total_in_log(log: &str) -> u64 {
    log.lines()
        .filter_map(|line| {
            let before = line.strip_suffix(SUMMARY_TAIL)?.trim_end();
            before.rsplit(' ').next()?.parse::<u64>().ok()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(used_idx: u16, used_event: u16) -> Option<UsedProgress> {
        Some(UsedProgress {
            used_idx,
            used_event,
            queue_size: 256,
        })
    }

    #[test]
    fn an_interrupt_is_due_once_the_device_used_the_entry_the_driver_waits_for() {
        let due = |used_idx, used_event| progress(used_idx, used_event).unwrap().interrupt_due();
        assert!(
            !due(5, 5),
            "the driver took everything and waits for entry 5"
        );
        assert!(due(6, 5));
        assert!(due(261, 5), "a whole queue past it");
        assert!(
            !due(262, 5),
            "more than a queue past: not a value a driver writes"
        );
        assert!(!due(5, 8), "the driver wants to hear only after some more");
        assert!(due(2, 65535), "across the 16-bit wrap");
    }

    fn queues(queues: Vec<Option<UsedProgress>>) -> Look {
        Look {
            unacknowledged: None,
            queues,
        }
    }

    #[test]
    fn only_a_due_interrupt_that_stays_untaken_for_a_whole_look_is_missed() {
        let mut watch = MissedInterruptWatch::default();
        let untaken = Some(Missed::UsedBuffersUntaken);
        let mut look =
            |used_idx, used_event| watch.missed(queues(vec![progress(used_idx, used_event)]));
        assert_eq!(look(6, 5), None, "the first look");
        assert_eq!(look(6, 5), untaken, "the second, unmoved");
        assert_eq!(look(6, 5), untaken, "and again while it stays so");
        assert_eq!(look(6, 6), None, "the driver took it");
        assert_eq!(look(6, 6), None, "idle");
        assert_eq!(look(7, 6), None, "the device moved on");
        assert_eq!(look(8, 6), None, "and on");
        assert_eq!(look(8, 8), None, "the driver took both");
        assert_eq!(look(8, 10), None, "the driver asked for later");
        assert_eq!(look(8, 10), None, "still not due");
    }

    #[test]
    fn any_stalled_queue_counts_and_unwatched_or_reset_queues_do_not() {
        let mut watch = MissedInterruptWatch::default();
        let stalled = || queues(vec![None, progress(3, 3), progress(9, 4)]);
        watch.missed(stalled());
        assert_eq!(watch.missed(stalled()), Some(Missed::UsedBuffersUntaken));
        watch.clear();
        assert_eq!(
            watch.missed(stalled()),
            None,
            "the first look after a reset"
        );
        let moved = queues(vec![progress(9, 4), None, None]);
        assert_eq!(watch.missed(moved), None, "newly watched");
    }

    #[test]
    fn the_summaries_are_read_back_from_a_log() {
        let log = format!(
            "2026-12-05T12:00:00Z  WARN vmm::builder: {}\nother 7 lines\n\
             2026-12-05T12:00:00Z  WARN vmm::builder: {}\n",
            summary(3, 2),
            summary(0, 40)
        );
        assert_eq!(total_in_log(&log), 42);
        assert_eq!(total_in_log("nothing missed\n"), 0);
    }

    #[test]
    fn a_status_left_unacknowledged_for_a_whole_look_is_missed() {
        let mut watch = MissedInterruptWatch::default();
        let missed = Some(Missed::Unacknowledged);
        let mut look = |unacknowledged| {
            watch.missed(Look {
                unacknowledged,
                queues: Vec::new(),
            })
        };
        assert_eq!(look(Some(5)), None, "the first look");
        assert_eq!(look(Some(5)), missed, "no acknowledgement since");
        assert_eq!(
            look(Some(6)),
            None,
            "acknowledged, and a new interrupt since"
        );
        assert_eq!(look(None), None, "acknowledged, nothing new");
        assert_eq!(look(None), None, "idle");
        assert_eq!(look(Some(6)), None, "a new interrupt");
        assert_eq!(look(Some(6)), missed);
    }
}
