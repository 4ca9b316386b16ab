//! A guest driving a virtio-mmio device: register reads and writes at any offset, of
//! any size, in any order; queues wherever it likes; notifications for any queue; and
//! its memory (rings, descriptors, requests) changing between them. The devices are
//! the VMM's own (block on a scratch disk, rng, the free page reporting balloon, the
//! output-only console), behind the VMM's own transport.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm::devices::bus::BusDevice;
use vmm::devices::console_output::ConsoleOutput;
use vmm::devices::virtio::balloon::Balloon;
use vmm::devices::virtio::block::Block;
use vmm::devices::virtio::console::Console;
use vmm::devices::virtio::mmio::MmioTransport;
use vmm::devices::virtio::rng::Rng;
use vmm::devices::virtio::{InterruptTrigger, QueueProgress, VirtioDevice};
use vmm::memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::guest::{self, QueueLayout};
use crate::input::{Reader, Writer};

/// How many times one notification is served while chains remain.
const NOTIFY_ROUNDS: usize = 4;

/// virtio-mmio registers (virtio 1.2, 4.2.2) the well-behaved set-up writes. Taken
/// from the spec, not from the VMM: an offset wrong there must fail the sessions here.
pub mod reg {
    pub const DEVICE_FEATURES: u64 = 0x10;
    pub const DEVICE_FEATURES_SEL: u64 = 0x14;
    pub const DRIVER_FEATURES: u64 = 0x20;
    pub const DRIVER_FEATURES_SEL: u64 = 0x24;
    pub const QUEUE_SEL: u64 = 0x30;
    pub const QUEUE_NUM: u64 = 0x38;
    pub const QUEUE_READY: u64 = 0x44;
    pub const STATUS: u64 = 0x70;
    pub const QUEUE_DESC: u64 = 0x80;
    pub const QUEUE_DRIVER: u64 = 0x90;
    pub const QUEUE_DEVICE: u64 = 0xa0;
}

/// Status bits.
const ACKNOWLEDGE: u32 = 1;
const DRIVER: u32 = 2;
const DRIVER_OK: u32 = 4;
const FEATURES_OK: u32 = 8;

/// The scratch disk: 64 KiB (128 sectors) with a pattern, so that reads are checkable.
pub const DISK_BYTES: usize = 64 * 1024;

pub fn disk_pattern() -> Vec<u8> {
    (0..DISK_BYTES).map(|i| (i / 512 + i) as u8).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Disk {
        read_only: bool,
    },
    Rng,
    /// Reports free ranges of guest memory, whose pages it drops.
    Balloon,
    /// Takes what the guest writes, for the VMM's output.
    Console,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// A register write of `size` (0 to 8) bytes of `value`: KVM reports accesses of
    /// any such length, not only the aligned ones.
    Write {
        offset: u16,
        size: u8,
        value: u64,
    },
    Read {
        offset: u16,
        size: u8,
    },
    /// What the ioeventfd of QueueNotify delivers.
    Notify {
        queue: u32,
    },
    /// A well-behaved driver's set-up: reset, accept every offered feature, lay the
    /// queues out as given, DRIVER_OK.
    Setup {
        queues: Vec<QueueLayout>,
    },
    /// The guest changes its memory.
    Poke {
        addr: u32,
        bytes: Vec<u8>,
    },
}

impl Op {
    fn read(r: &mut Reader) -> Op {
        match r.u8() % 5 {
            0 => Op::Write {
                offset: r.u16() & 0x1ff,
                size: r.u8() % 9,
                value: r.u64(),
            },
            1 => Op::Read {
                offset: r.u16() & 0x1ff,
                size: r.u8() % 9,
            },
            2 => Op::Notify {
                queue: u32::from(r.u8()),
            },
            3 => Op::Setup {
                queues: (0..r.u8() % 3).map(|_| QueueLayout::read(r)).collect(),
            },
            _ => {
                let (addr, bytes) = r.poke();
                Op::Poke { addr, bytes }
            }
        }
    }

    fn write(&self, w: &mut Writer) {
        match self {
            Op::Write {
                offset,
                size,
                value,
            } => {
                w.u8(0).u16(*offset).u8(*size).u64(*value);
            }
            Op::Read { offset, size } => {
                w.u8(1).u16(*offset).u8(*size);
            }
            Op::Notify { queue } => {
                w.u8(2).u8(*queue as u8);
            }
            Op::Setup { queues } => {
                w.u8(3).u8(queues.len() as u8);
                for q in queues {
                    q.write(w);
                }
            }
            Op::Poke { addr, bytes } => {
                w.u8(4).poke(*addr, bytes);
            }
        }
    }
}

/// One fuzz input: the device, the guest's memory image, then what the driver does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Input {
    pub device: DeviceKind,
    pub image: Vec<u8>,
    pub ops: Vec<Op>,
}

impl Input {
    pub fn decode(data: &[u8]) -> Input {
        let mut r = Reader::new(data);
        let device = match r.u8() % 5 {
            0 => DeviceKind::Disk { read_only: false },
            1 => DeviceKind::Disk { read_only: true },
            2 => DeviceKind::Rng,
            3 => DeviceKind::Balloon,
            _ => DeviceKind::Console,
        };
        let (image, ops) = r.image_and_ops(Op::read);
        Input { device, image, ops }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u8(match self.device {
            DeviceKind::Disk { read_only: false } => 0,
            DeviceKind::Disk { read_only: true } => 1,
            DeviceKind::Rng => 2,
            DeviceKind::Balloon => 3,
            DeviceKind::Console => 4,
        });
        w.image(&self.image);
        for op in &self.ops {
            op.write(&mut w);
        }
        w.data
    }
}

/// A device behind its transport, as the VMM builds it, and the guest around it.
pub struct Session {
    pub transport: MmioTransport,
    pub memory: GuestMemoryMmap,
    pub device: DeviceKind,
    pub disk: Option<File>,
    /// The console's output, written out as the session ends, and what it wrote.
    pub console_output: Option<(ConsoleOutput, SharedOutput)>,
}

/// What the console wrote out, kept for the sessions' checks.
#[derive(Clone, Default)]
pub struct SharedOutput(Arc<Mutex<Vec<u8>>>);

impl Write for SharedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Session {
    pub fn new(device: DeviceKind, image: &[u8]) -> Session {
        let memory = guest::memory(image);
        let irqfd = Arc::new(EventFd::new(EFD_NONBLOCK).expect("an eventfd"));
        let mut console_output = None;
        let (virtio, disk): (Box<dyn VirtioDevice>, _) = match device {
            DeviceKind::Disk { read_only } => {
                let mut file = tempfile::tempfile().expect("a scratch disk");
                file.write_all(&disk_pattern())
                    .expect("writing the scratch disk");
                let clone = file.try_clone().expect("a second descriptor of the disk");
                let block = Block::new(clone, read_only, "fuzz".into()).expect("a block device");
                (Box::new(block), Some(file))
            }
            DeviceKind::Rng => (Box::new(Rng::new()), None),
            DeviceKind::Balloon => (Box::new(Balloon::new()), None),
            DeviceKind::Console => {
                let written = SharedOutput::default();
                // Written out as the session ends (no thread per input).
                let output = ConsoleOutput::new(Box::new(written.clone()));
                let console = Console::new(output.queue());
                console_output = Some((output, written));
                (Box::new(console), None)
            }
        };
        let transport = MmioTransport::new(virtio, memory.clone(), InterruptTrigger::new(irqfd));
        Session {
            transport,
            memory,
            device,
            disk,
            console_output,
        }
    }

    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::Write {
                offset,
                size,
                value,
            } => {
                let bytes = value.to_le_bytes();
                self.transport
                    .write(u64::from(*offset), &bytes[..usize::from(*size).min(8)]);
            }
            Op::Read { offset, size } => {
                let mut data = [0u8; 8];
                self.transport
                    .read(u64::from(*offset), &mut data[..usize::from(*size).min(8)]);
            }
            Op::Notify { queue } => {
                // Served again while chains remain, as the event loop does, for a few
                // rounds: a ring whose requests publish the next ones never ends.
                for _ in 0..NOTIFY_ROUNDS {
                    if self.transport.notify_queue(*queue) == QueueProgress::Done {
                        break;
                    }
                }
            }
            Op::Setup { queues } => self.set_up(queues),
            Op::Poke { addr, bytes } => guest::poke(&self.memory, u64::from(*addr), bytes),
        }
        // The event loop's looks for missed interrupts and notifications may come
        // between any two of the driver's steps, and read the rings wherever the guest
        // put them (the second serves a queue left waiting since the previous look).
        self.transport.raise_missed_interrupt();
        self.transport.serve_missed_notifications();
    }

    fn write32(&mut self, offset: u64, value: u32) {
        self.transport.write(offset, &value.to_le_bytes());
    }

    fn read32(&mut self, offset: u64) -> u32 {
        let mut data = [0u8; 4];
        self.transport.read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    fn set_up(&mut self, queues: &[QueueLayout]) {
        self.write32(reg::STATUS, 0);
        self.write32(reg::STATUS, ACKNOWLEDGE);
        self.write32(reg::STATUS, ACKNOWLEDGE | DRIVER);
        for bank in 0..2 {
            self.write32(reg::DEVICE_FEATURES_SEL, bank);
            let offered = self.read32(reg::DEVICE_FEATURES);
            self.write32(reg::DRIVER_FEATURES_SEL, bank);
            self.write32(reg::DRIVER_FEATURES, offered);
        }
        self.write32(reg::STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
        for (index, q) in queues.iter().enumerate() {
            self.write32(reg::QUEUE_SEL, index as u32);
            self.write32(reg::QUEUE_NUM, u32::from(q.size));
            for (register, addr) in [
                (reg::QUEUE_DESC, q.desc),
                (reg::QUEUE_DRIVER, q.avail),
                (reg::QUEUE_DEVICE, q.used),
            ] {
                self.write32(register, addr as u32);
                self.write32(register + 4, (addr >> 32) as u32);
            }
            self.write32(reg::QUEUE_READY, 1);
        }
        self.write32(reg::STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK);
    }

    /// The scratch disk's whole content (None for the other devices).
    /// What the console wrote out, once all of it is (None for other devices).
    pub fn console_written(&mut self) -> Option<Vec<u8>> {
        let (output, written) = self.console_output.take()?;
        assert!(
            output.finish(Duration::from_secs(10)),
            "the console's output was not written out"
        );
        let bytes = written.0.lock().expect("the output's lock").clone();
        Some(bytes)
    }

    pub fn disk_content(&mut self) -> Option<Vec<u8>> {
        let disk = self.disk.as_mut()?;
        let mut content = Vec::new();
        disk.seek(SeekFrom::Start(0))
            .expect("seek the scratch disk");
        disk.read_to_end(&mut content)
            .expect("read the scratch disk");
        Some(content)
    }

    /// What must hold whatever the guest did: a read-only disk is unchanged, and no
    /// disk grew or shrank.
    pub fn check(&mut self) {
        let DeviceKind::Disk { read_only } = self.device else {
            return;
        };
        let content = self.disk_content().expect("a disk session has its disk");
        assert_eq!(content.len(), DISK_BYTES, "the guest resized its disk");
        if read_only {
            assert!(
                content == disk_pattern(),
                "the guest wrote to a read-only disk"
            );
        }
    }
}

/// The fuzz target: any bytes.
pub fn run(data: &[u8]) {
    let _ = run_input(&Input::decode(data));
}

/// Runs `input` and checks what must hold; the session is returned for more checks.
pub fn run_input(input: &Input) -> Session {
    let mut session = Session::new(input.device, &input.image);
    for op in &input.ops {
        session.apply(op);
    }
    session.check();
    session
}
