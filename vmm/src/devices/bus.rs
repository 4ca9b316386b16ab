//! Dispatch of port I/O and MMIO exits to the device that owns the address.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device reached through a range of I/O ports or MMIO addresses. `offset` is
/// relative to the start of the range the device was inserted at.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("bus range {base:#x}+{len:#x} is empty or overlaps another device")]
    Overlap { base: u64, len: u64 },
}

#[derive(Clone)]
struct BusRange {
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// An address space (port I/O or MMIO) made of non-overlapping device ranges.
#[derive(Clone, Default)]
pub struct Bus {
    ranges: BTreeMap<u64, BusRange>,
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(
        &mut self,
        device: Arc<Mutex<dyn BusDevice>>,
        base: u64,
        len: u64,
    ) -> Result<(), BusError> {
        let end = base.checked_add(len).filter(|_| len > 0);
        let overlaps = |end: u64| {
            self.ranges
                .range(..end)
                .next_back()
                .is_some_and(|(start, r)| start + r.len > base)
        };
        match end {
            Some(end) if !overlaps(end) => {
                self.ranges.insert(base, BusRange { len, device });
                Ok(())
            }
            _ => Err(BusError::Overlap { base, len }),
        }
    }

    fn resolve(&self, addr: u64) -> Option<(u64, &BusRange)> {
        let (start, range) = self.ranges.range(..=addr).next_back()?;
        let offset = addr - start;
        (offset < range.len).then_some((offset, range))
    }

    /// Reads from the device at `addr`; returns false when no device is there (the
    /// caller then leaves `data` as all-ones, like an open bus).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.resolve(addr) {
            Some((offset, range)) => {
                lock_device(&range.device).read(offset, data);
                true
            }
            None => false,
        }
    }

    /// Writes to the device at `addr`; returns false when no device is there.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.resolve(addr) {
            Some((offset, range)) => {
                lock_device(&range.device).write(offset, data);
                true
            }
            None => false,
        }
    }
}

/// A device whose lock was poisoned panicked while handling an exit; the VMM keeps
/// going with its state as it was rather than taking every vCPU down with it.
fn lock_device<'a>(
    device: &'a Mutex<dyn BusDevice + 'static>,
) -> std::sync::MutexGuard<'a, dyn BusDevice + 'static> {
    device
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Recorder(Vec<(u64, Vec<u8>)>);
    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn dispatches_by_offset_within_range() {
        let dev = Arc::new(Mutex::new(Recorder(vec![])));
        let mut bus = Bus::new();
        bus.insert(dev.clone(), 0x100, 0x10).unwrap();
        let mut data = [0u8; 1];
        assert!(bus.read(0x105, &mut data));
        assert_eq!(data, [5]);
        assert!(bus.write(0x10f, &[7]));
        assert!(!bus.write(0x110, &[7]));
        assert!(!bus.read(0xff, &mut data));
        assert_eq!(dev.lock().unwrap().0, vec![(0xf, vec![7])]);
    }

    #[test]
    fn rejects_overlaps_and_empty_ranges() {
        let dev = Arc::new(Mutex::new(Recorder(vec![])));
        let mut bus = Bus::new();
        bus.insert(dev.clone(), 0x100, 0x10).unwrap();
        assert!(bus.insert(dev.clone(), 0x108, 0x10).is_err());
        assert!(bus.insert(dev.clone(), 0xf8, 0x10).is_err());
        assert!(bus.insert(dev.clone(), 0x200, 0).is_err());
        assert!(bus.insert(dev.clone(), u64::MAX, 2).is_err());
        bus.insert(dev, 0x110, 0x10).unwrap();
    }
}
