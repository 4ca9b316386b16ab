//! A watch for queue notifications the device never got: the other half of
//! [`super::missed_interrupt`].
//!
//! A driver that made chains available and notified the device then waits for them
//! to come back, and some wait with interrupts off (Linux's virtio console spins
//! until its buffer returns). A notification lost on its way (emulated hardware
//! virtualization has lost wake-ups) would leave it waiting for ever. Most queues
//! hold no chains: the device returns each as soon as it is notified (a transmit
//! queue, a request queue). On such a queue, chains the driver made available
//! (the available ring's `idx` ahead of the used ring's) with neither index moved
//! between two looks some time apart are chains the device was never told of.
//! Serving the queue then costs the device one look at its ring. (A driver that
//! made chains available and had not yet notified when the look came is served a
//! little early, which the device may always do.) The same look would find a device
//! that held the driver's notifications while it served and never asked for them
//! again (`take_head_or_ask_for_notifications`).

use std::sync::atomic::Ordering;

use virtio_queue::{Queue, QueueT};

use crate::memory::GuestMemoryMmap;

/// Where a queue's rings stood at one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingIndexes {
    /// How many chains the driver has made available (the available ring's `idx`).
    pub avail_idx: u16,
    /// How many the device has returned (the used ring's `idx`).
    pub used_idx: u16,
}

impl RingIndexes {
    /// Reads `queue`'s indexes from guest memory; `None` for a queue that is not
    /// ready or whose rings cannot be read.
    pub fn read(queue: &Queue, memory: &GuestMemoryMmap) -> Option<RingIndexes> {
        if !queue.ready() {
            return None;
        }
        Some(RingIndexes {
            avail_idx: queue.avail_idx(memory, Ordering::Acquire).ok()?.0,
            used_idx: queue.used_idx(memory, Ordering::Acquire).ok()?.0,
        })
    }

    fn chains_waiting(self) -> bool {
        self.avail_idx != self.used_idx
    }
}

/// The previous look at a device's queues.
#[derive(Debug, Default)]
pub struct MissedNotificationWatch {
    last: Vec<Option<RingIndexes>>,
}

impl MissedNotificationWatch {
    /// Takes a look now at each queue (`None`: not watched, as one that holds chains
    /// is not) and says which had chains waiting, unmoved, since the previous look.
    pub fn missed(&mut self, now: Vec<Option<RingIndexes>>) -> Vec<usize> {
        let missed = now
            .iter()
            .zip(&self.last)
            .enumerate()
            .filter_map(|(index, pair)| match pair {
                (Some(now), Some(last)) if now == last && now.chains_waiting() => Some(index),
                _ => None,
            })
            .collect();
        self.last = now;
        missed
    }

    /// Forgets what it saw (a device reset).
    pub fn clear(&mut self) {
        self.last.clear();
    }
}

/// In each line the VMM logs as it serves a queue for a missed notification (the
/// first ten, then every tenfold count), for a reader of the log to find them by.
pub const LOG_MARK: &str = "(a lost notification";

/// What follows the count in the line the VMM logs as the VM ends, for each device
/// that missed notifications ([`summary`]).
const SUMMARY_TAIL: &str = "missed notification(s) served";

/// The line said as the VM ends for the device in virtio-mmio slot `slot`.
pub fn summary(slot: usize, count: u64) -> String {
    format!("virtio-mmio slot {slot}: {count} {SUMMARY_TAIL}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(avail_idx: u16, used_idx: u16) -> Option<RingIndexes> {
        Some(RingIndexes {
            avail_idx,
            used_idx,
        })
    }

    #[test]
    fn only_chains_left_waiting_for_a_whole_look_were_missed() {
        let mut watch = MissedNotificationWatch::default();
        let mut look = |avail, used| watch.missed(vec![at(avail, used)]);
        assert!(look(3, 3).is_empty(), "the first look, nothing waits");
        assert!(look(3, 3).is_empty(), "idle");
        assert!(
            look(5, 3).is_empty(),
            "new chains: their notification may come"
        );
        assert_eq!(look(5, 3), vec![0], "still untaken a whole look later");
        assert_eq!(look(5, 3), vec![0], "and again while it stays so");
        assert!(look(5, 5).is_empty(), "served");
        assert!(look(7, 6).is_empty(), "the device is at work");
        assert!(look(8, 7).is_empty(), "and goes on");
        assert!(look(1, 65535).is_empty(), "across the 16-bit wrap, moving");
        assert_eq!(look(1, 65535), vec![0], "across the wrap, stuck");
    }

    #[test]
    fn unwatched_queues_and_a_reset_are_left_out() {
        let mut watch = MissedNotificationWatch::default();
        let stuck = || vec![None, at(4, 2), at(9, 9)];
        assert!(watch.missed(stuck()).is_empty());
        assert_eq!(watch.missed(stuck()), vec![1]);
        watch.clear();
        assert!(
            watch.missed(stuck()).is_empty(),
            "the first look after a reset"
        );
        assert!(
            watch.missed(vec![at(4, 2), None, None]).is_empty(),
            "newly watched"
        );
    }

    #[test]
    fn the_summary_names_the_slot_and_the_count() {
        assert_eq!(
            summary(2, 7),
            "virtio-mmio slot 2: 7 missed notification(s) served"
        );
    }
}
