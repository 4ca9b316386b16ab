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

pub const MAX_OPS: usize = 64;

impl Input {
    pub fn decode(data: &[u8]) -> Input {
        let mut r = Reader::new(data);
        let queue = QueueLayout::read(&mut r);
        let image_len = usize::from(r.u16());
        let image = r.bytes(image_len).to_vec();
        let mut ops = Vec::new();
        while !r.is_empty() && ops.len() < MAX_OPS {
            ops.push(match r.u8() % 3 {
                0 => Op::TakeOver,
                1 => Op::Kick,
                _ => {
                    let addr = r.u32() & 0x1_ffff;
                    let len = usize::from(r.u8());
                    Op::Poke {
                        addr,
                        bytes: r.bytes(len).to_vec(),
                    }
                }
            });
        }
        Input { queue, image, ops }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        self.queue.write(&mut w);
        w.u16(self.image.len() as u16).bytes(&self.image);
        for op in &self.ops {
            match op {
                Op::TakeOver => w.u8(0),
                Op::Kick => w.u8(1),
                Op::Poke { addr, bytes } => w.u8(2).u32(*addr).u8(bytes.len() as u8).bytes(bytes),
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
