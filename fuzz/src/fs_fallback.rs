//! A guest whose virtio-fs backend died: the VMM answers the requests on its queues
//! with EIO itself ([`vmm::devices::virtio::fs::fallback`]), reading FUSE headers and
//! descriptors the guest wrote, with any contents.

use vmm::devices::virtio::fs::fallback;

use crate::guest::{self, QueueLayout};
use crate::input::{Reader, Writer};

const QUEUE_MAX: u16 = 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// The backend went away: continue where its replies stopped.
    TakeOver,
    /// A kick: answer what is available.
    Kick,
    Poke {
        addr: u32,
        bytes: Vec<u8>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Input {
    pub queue: QueueLayout,
    pub image: Vec<u8>,
    pub ops: Vec<Op>,
}

impl Op {
    fn read(r: &mut Reader) -> Op {
        match r.u8() % 3 {
            0 => Op::TakeOver,
            1 => Op::Kick,
            _ => {
                let (addr, bytes) = r.poke();
                Op::Poke { addr, bytes }
            }
        }
    }
}

impl Input {
    pub fn decode(data: &[u8]) -> Input {
        let mut r = Reader::new(data);
        let queue = QueueLayout::read(&mut r);
        let (image, ops) = r.image_and_ops(Op::read);
        Input { queue, image, ops }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        self.queue.write(&mut w);
        w.image(&self.image);
        for op in &self.ops {
            match op {
                Op::TakeOver => w.u8(0),
                Op::Kick => w.u8(1),
                Op::Poke { addr, bytes } => w.u8(2).poke(*addr, bytes),
            };
        }
        w.data
    }
}

/// The fuzz target: any bytes.
pub fn run(data: &[u8]) {
    let _ = run_input(&Input::decode(data));
}

/// Runs `input`; the guest's memory afterwards is returned for checks (None where
/// the queue would not have been accepted).
pub fn run_input(input: &Input) -> Option<vmm::memory::GuestMemoryMmap> {
    let memory = guest::memory(&input.image);
    let mut queue = input.queue.queue(QUEUE_MAX, &memory)?;
    for op in &input.ops {
        match op {
            Op::TakeOver => fallback::take_over(&mut queue, &memory),
            Op::Kick => {
                fallback::fail_requests(&mut queue, &memory);
            }
            Op::Poke { addr, bytes } => guest::poke(&memory, u64::from(*addr), bytes),
        }
    }
    Some(memory)
}
