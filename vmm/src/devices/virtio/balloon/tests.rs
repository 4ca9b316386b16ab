use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::memory::create_guest_ram;

const W: u16 = VRING_DESC_F_WRITE as u16;
const N: u16 = VRING_DESC_F_NEXT as u16;
const MIB: u64 = 1 << 20;
/// Where the three mock queues live: below the memory the tests fill and report.
const QUEUE_BASES: [u64; 3] = [0, 0x1_0000, 0x2_0000];

fn raw(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, flags, next))
}

fn fill(memory: &GuestMemoryMmap, addr: u64, len: u64, byte: u8) {
    memory
        .write_slice(&vec![byte; len as usize], GuestAddress(addr))
        .unwrap();
}

fn read(memory: &GuestMemoryMmap, addr: u64, len: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len as usize];
    memory.read_slice(&mut bytes, GuestAddress(addr)).unwrap();
    bytes
}

/// Three mock queues in `memory`, and the device's copies of them; `ready[i]` says
/// whether queue `i` was made ready.
fn mock_queues(
    memory: &GuestMemoryMmap,
    ready: [bool; 3],
) -> (Vec<MockSplitQueue<'_, GuestMemoryMmap>>, Vec<Queue>) {
    let mocks: Vec<_> = QUEUE_BASES
        .iter()
        .map(|&base| MockSplitQueue::create(memory, GuestAddress(base), 16))
        .collect();
    let queues = mocks
        .iter()
        .zip(ready)
        .map(|(mock, ready)| {
            let mut queue: Queue = mock.create_queue().unwrap();
            queue.set_ready(ready);
            queue
        })
        .collect();
    (mocks, queues)
}

fn activate(
    memory: &GuestMemoryMmap,
    features: u64,
    ready: [bool; 3],
) -> (Balloon, Result<(), ActivateError>) {
    let (_, queues) = mock_queues(memory, ready);
    let mut balloon = Balloon::new();
    balloon.set_acked_features(features);
    let irq = InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    let result = balloon.activate(memory.clone(), queues, irq);
    (balloon, result)
}

/// A balloon that negotiated reporting, activated on three mock queues.
struct Harness<'a> {
    queues: Vec<MockSplitQueue<'a, GuestMemoryMmap>>,
    balloon: Balloon,
    irq: Arc<EventFd>,
}

impl<'a> Harness<'a> {
    fn new(memory: &'a GuestMemoryMmap) -> Self {
        let (mocks, queues) = mock_queues(memory, [true; 3]);
        let irq = Arc::new(EventFd::new(EFD_NONBLOCK).unwrap());
        let mut balloon = Balloon::new();
        balloon.set_acked_features(FEATURE_VERSION_1 | FEATURE_REPORTING);
        balloon
            .activate(memory.clone(), queues, InterruptTrigger::new(irq.clone()))
            .unwrap();
        Self {
            queues: mocks,
            balloon,
            irq,
        }
    }

    /// Puts `descs` on queue `index`, notifies it, and returns the used ring's
    /// (id, len) entries.
    fn run(&mut self, index: usize, descs: &[RawDescriptor]) -> Vec<(u32, u32)> {
        let queue = &self.queues[index];
        queue.add_desc_chains(descs, 0).unwrap();
        assert_eq!(self.balloon.process_queue(index), QueueProgress::Done);
        (0..queue.used().idx().load())
            .map(|i| {
                let entry = queue.used().ring().ref_at(i as usize).unwrap().load();
                (entry.id(), entry.len())
            })
            .collect()
    }
}

/// Bytes of the memory file that hold pages (st_blocks counts 512-byte units).
fn allocated(ram: &crate::memory::GuestRam) -> u64 {
    ram.backing_file.metadata().unwrap().blocks() * 512
}

#[test]
fn a_reported_block_leaves_the_memory_file_and_reads_as_zeros() {
    let ram = create_guest_ram(16 * MIB).unwrap();
    let memory = &ram.memory;
    fill(memory, 2 * MIB, 4 * MIB, 0xab);
    fill(memory, 6 * MIB, MIB, 0xcd);
    let mut harness = Harness::new(memory);
    let before = allocated(&ram);
    assert!(before >= 5 * MIB, "{before}");
    let used = harness.run(REPORTING_QUEUE, &[raw(2 * MIB, 4 * MIB as u32, W, 0)]);

    // Measured before the reads below: reading a hole of a shared memory file
    // faults a page back in.
    let after = allocated(&ram);
    assert_eq!(used, vec![(0, 0)]);
    assert_eq!(harness.irq.read().unwrap(), 1);
    assert!(
        before.saturating_sub(after) >= 4 * MIB,
        "the file held {before} bytes before the report and {after} after"
    );
    assert!(read(memory, 2 * MIB, 4 * MIB).iter().all(|&b| b == 0));
    assert!(read(memory, 6 * MIB, MIB).iter().all(|&b| b == 0xcd));
    assert_eq!(
        harness.balloon.returned(),
        ReturnedMemory {
            reports: 1,
            bytes: 4 * MIB
        }
    );
}

/// A report of several buffers drops each; one outside guest RAM is passed over, the
/// others are still dropped.
#[test]
fn a_buffer_outside_guest_ram_is_passed_over() {
    let ram = create_guest_ram(8 * MIB).unwrap();
    let memory = &ram.memory;
    fill(memory, MIB, 2 * MIB, 0x11);
    let mut harness = Harness::new(memory);
    let descs = [
        raw(MIB, MIB as u32, W | N, 1),
        raw(7 * MIB, 2 * MIB as u32, W | N, 2), // runs past the end of guest RAM
        raw(2 * MIB, MIB as u32, W, 0),
    ];
    let used = harness.run(REPORTING_QUEUE, &descs);
    assert_eq!(used, vec![(0, 0)]);
    assert!(read(memory, MIB, 2 * MIB).iter().all(|&b| b == 0));
    assert_eq!(harness.balloon.returned().bytes, 2 * MIB);
}

/// Only whole pages inside a range go: the bytes of a page it covers in part stay.
#[test]
fn pages_a_range_covers_in_part_are_kept() {
    let ram = create_guest_ram(4 * MIB).unwrap();
    let memory = &ram.memory;
    fill(memory, MIB, 0x4000, 0x5a);
    discard_guest_range(memory, GuestAddress(MIB + 0x800), 0x2000).unwrap();
    assert!(read(memory, MIB, 0x1000).iter().all(|&b| b == 0x5a));
    assert!(read(memory, MIB + 0x1000, 0x1000).iter().all(|&b| b == 0));
    assert!(read(memory, MIB + 0x2000, 0x2000)
        .iter()
        .all(|&b| b == 0x5a));
}

/// A range over two regions that meet is dropped in both; anonymous memory (no file)
/// is dropped too.
#[test]
fn a_range_across_regions_is_dropped_in_each() {
    let memory = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), MIB as usize),
        (GuestAddress(MIB), MIB as usize),
    ])
    .unwrap();
    fill(&memory, 0, 2 * MIB, 0x77);
    discard_guest_range(&memory, GuestAddress(MIB / 2), MIB).unwrap();
    assert!(read(&memory, 0, MIB / 2).iter().all(|&b| b == 0x77));
    assert!(read(&memory, MIB / 2, MIB).iter().all(|&b| b == 0));
    assert!(read(&memory, 3 * MIB / 2, MIB / 2)
        .iter()
        .all(|&b| b == 0x77));
}

#[test]
fn ranges_that_are_not_all_guest_ram_are_refused_whole() {
    let memory = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), MIB as usize),
        (GuestAddress(2 * MIB), MIB as usize),
    ])
    .unwrap();
    fill(&memory, 0, MIB, 0x33);
    for (addr, len) in [
        (MIB / 2, MIB),             // into the hole
        (3 * MIB, 0x1000),          // past the end
        (u64::MAX - 0xfff, 0x2000), // wraps around
        (0, u64::MAX),
    ] {
        assert_eq!(
            discard_guest_range(&memory, GuestAddress(addr), len),
            Err(DiscardError::OutOfRange { addr, len })
        );
    }
    assert!(read(&memory, 0, MIB).iter().all(|&b| b == 0x33));
    assert_eq!(discard_guest_range(&memory, GuestAddress(0), 0), Ok(()));
}

/// The device asks for no memory, so buffers on the inflate and deflate queues go
/// back untouched.
#[test]
fn inflate_and_deflate_buffers_are_returned_untouched() {
    let ram = create_guest_ram(4 * MIB).unwrap();
    let memory = &ram.memory;
    fill(memory, MIB, 0x1000, 0x42);
    let mut harness = Harness::new(memory);
    for queue in [INFLATE_QUEUE, DEFLATE_QUEUE] {
        let used = harness.run(queue, &[raw(MIB, 0x1000, 0, 0)]);
        assert_eq!(used, vec![(0, 0)]);
    }
    assert!(read(memory, MIB, 0x1000).iter().all(|&b| b == 0x42));
    assert_eq!(harness.balloon.returned(), ReturnedMemory::default());
}

#[test]
fn the_target_is_zero_and_only_actual_is_written() {
    let mut balloon = Balloon::new();
    assert_eq!(balloon.device_type(), DEVICE_ID_BALLOON);
    assert_eq!(
        balloon.avail_features(),
        FEATURE_VERSION_1 | FEATURE_EVENT_IDX | FEATURE_REPORTING
    );
    balloon.write_config(ACTUAL_OFFSET, &7u32.to_le_bytes());
    balloon.write_config(0, &9u32.to_le_bytes()); // num_pages is the device's
    balloon.write_config(ACTUAL_OFFSET, &[1, 2]); // part of a field
    let mut config = [0xffu8; 12];
    balloon.read_config(0, &mut config);
    assert_eq!(config, [0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0]);
    balloon.reset();
    balloon.read_config(ACTUAL_OFFSET, &mut config[..4]);
    assert_eq!(config[..4], [0, 0, 0, 0]);
}

#[test]
fn activation_needs_the_queues_the_features_call_for() {
    let ram = create_guest_ram(MIB).unwrap();
    let memory = &ram.memory;
    let reporting = FEATURE_VERSION_1 | FEATURE_REPORTING;

    let (_, result) = activate(memory, reporting, [true, true, false]);
    assert!(matches!(
        result,
        Err(ActivateError::QueueNotReady { index: 2 })
    ));
    let (_, result) = activate(memory, reporting, [false, true, true]);
    assert!(matches!(
        result,
        Err(ActivateError::QueueNotReady { index: 0 })
    ));
    let (_, result) = activate(memory, reporting, [true, false, true]);
    assert!(matches!(
        result,
        Err(ActivateError::QueueNotReady { index: 1 })
    ));

    // Without reporting the driver sets up two queues; the third, a notification for
    // it included, is nothing.
    let (mut balloon, result) = activate(memory, FEATURE_VERSION_1, [true, true, false]);
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(balloon.process_queue(REPORTING_QUEUE), QueueProgress::Done);
    assert_eq!(balloon.process_queue(7), QueueProgress::Done);
}
