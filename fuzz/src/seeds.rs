//! Hand-written guest sessions that a correct device answers in a known way: the
//! tests check those answers (so the harnesses are known to reach the devices'
//! request handling), and they seed libFuzzer's corpus.

use crate::guest::{avail_ring, descriptor, QueueLayout, NEXT, WRITE};
use crate::input::MAX_POKE;
use crate::redact::{self, Form};
use crate::{fs_fallback, mmio, vsock};

/// Where the sessions put things: one queue's rings, request headers, status bytes,
/// and data in the second memory region.
pub const DESC: u64 = 0x1000;
pub const AVAIL: u64 = 0x2000;
pub const USED: u64 = 0x3000;
pub const HEADER: u64 = 0x4000;
pub const STATUS: u64 = 0x5000;
pub const DATA: u64 = 0x1_0000;

pub const SECTOR: u64 = 512;
/// virtio-blk request types and statuses.
pub const BLK_IN: u32 = 0;
pub const BLK_OUT: u32 = 1;
pub const BLK_OK: u8 = 0;
pub const BLK_IOERR: u8 = 1;

const LAYOUT: QueueLayout = QueueLayout {
    size: 8,
    event_idx: false,
    desc: DESC,
    avail: AVAIL,
    used: USED,
};

/// `bytes` written at `addr`, as the pokes of `Op` ([`MAX_POKE`] bytes each).
fn pokes<Op>(addr: u64, bytes: &[u8], poke: fn(u32, Vec<u8>) -> Op) -> Vec<Op> {
    bytes
        .chunks(MAX_POKE)
        .enumerate()
        .map(|(i, chunk)| poke((addr + (MAX_POKE * i) as u64) as u32, chunk.to_vec()))
        .collect()
}

fn mmio_poke(addr: u64, bytes: &[u8]) -> Vec<mmio::Op> {
    pokes(addr, bytes, |addr, bytes| mmio::Op::Poke { addr, bytes })
}

fn block_header(request_type: u32, sector: u64) -> Vec<u8> {
    let mut header = request_type.to_le_bytes().to_vec();
    header.extend_from_slice(&[0; 4]);
    header.extend_from_slice(&sector.to_le_bytes());
    header
}

/// One block request, header, data at `data` (`data_len` bytes, written by the
/// device for reads) and status, then a notification.
pub fn block_request(
    read_only: bool,
    request_type: u32,
    sector: u64,
    data: u64,
    data_len: u32,
    payload: &[u8],
) -> mmio::Input {
    let data_flags = NEXT | if request_type == BLK_IN { WRITE } else { 0 };
    let mut ops = vec![mmio::Op::Setup {
        queues: vec![LAYOUT],
    }];
    let mut table = descriptor(HEADER, 16, NEXT, 1);
    table.extend(descriptor(data, data_len, data_flags, 2));
    table.extend(descriptor(STATUS, 1, WRITE, 0));
    ops.extend(mmio_poke(DESC, &table));
    ops.extend(mmio_poke(HEADER, &block_header(request_type, sector)));
    ops.extend(mmio_poke(STATUS, &[0xff]));
    ops.extend(mmio_poke(data, payload));
    ops.extend(mmio_poke(AVAIL, &avail_ring(&[0])));
    ops.push(mmio::Op::Notify { queue: 0 });
    mmio::Input {
        device: mmio::DeviceKind::Disk { read_only },
        image: Vec::new(),
        ops,
    }
}

/// The rng fills one 64-byte buffer.
pub fn rng_request() -> mmio::Input {
    let mut ops = vec![mmio::Op::Setup {
        queues: vec![LAYOUT],
    }];
    ops.extend(mmio_poke(DESC, &descriptor(DATA, 64, WRITE, 0)));
    ops.extend(mmio_poke(AVAIL, &avail_ring(&[0])));
    ops.push(mmio::Op::Notify { queue: 0 });
    mmio::Input {
        device: mmio::DeviceKind::Rng,
        image: Vec::new(),
        ops,
    }
}

/// The balloon's queues: inflate, deflate, reporting, laid out as vsock's.
pub fn balloon_layouts() -> [QueueLayout; 3] {
    vsock_layouts()
}

/// The guest reports two pages at [`DATA`] free, which it filled with `0x5a` first.
pub fn balloon_report() -> mmio::Input {
    let layouts = balloon_layouts();
    let reporting = layouts[2];
    let mut ops = vec![mmio::Op::Setup {
        queues: layouts.to_vec(),
    }];
    ops.extend(mmio_poke(DATA, &[0x5a; 0x2000]));
    ops.extend(mmio_poke(
        reporting.desc,
        &descriptor(DATA, 0x2000, WRITE, 0),
    ));
    ops.extend(mmio_poke(reporting.avail, &avail_ring(&[0])));
    ops.push(mmio::Op::Notify { queue: 2 });
    mmio::Input {
        device: mmio::DeviceKind::Balloon,
        image: Vec::new(),
        ops,
    }
}

/// The console's queues: receive (of the 2 descriptors the device allows, laid out
/// as vsock's rx) and transmit (vsock's tx).
pub fn console_layouts() -> [QueueLayout; 2] {
    let [receive, transmit, _] = vsock_layouts();
    [QueueLayout { size: 2, ..receive }, transmit]
}

/// What [`console_write`] writes.
pub const CONSOLE_LINE: &[u8] = b"guest-agent: hello, host\n";

/// The guest writes [`CONSOLE_LINE`] to the console, from [`DATA`].
pub fn console_write() -> mmio::Input {
    let [_, transmit] = console_layouts();
    let mut ops = vec![mmio::Op::Setup {
        queues: console_layouts().to_vec(),
    }];
    ops.extend(mmio_poke(DATA, CONSOLE_LINE));
    ops.extend(mmio_poke(
        transmit.desc,
        &descriptor(DATA, CONSOLE_LINE.len() as u32, 0, 0),
    ));
    ops.extend(mmio_poke(transmit.avail, &avail_ring(&[0])));
    ops.push(mmio::Op::Notify { queue: 1 });
    mmio::Input {
        device: mmio::DeviceKind::Console,
        image: Vec::new(),
        ops,
    }
}

/// vsock's queues: rx, tx, event, each of 8 descriptors, their rings 2 KiB apart, with
/// EVENT_IDX (as Linux negotiates it).
pub fn vsock_layouts() -> [QueueLayout; 3] {
    [0u64, 1, 2].map(|i| QueueLayout {
        size: 8,
        event_idx: true,
        desc: DESC + 0x800 * 3 * i,
        avail: DESC + 0x800 * (3 * i + 1),
        used: DESC + 0x800 * (3 * i + 2),
    })
}

/// vsock op codes.
pub const VSOCK_REQUEST: u16 = 1;
pub const VSOCK_RESPONSE: u16 = 2;
pub const VSOCK_RW: u16 = 5;
pub const GUEST_PORT: u32 = 5000;
/// Where the session's two tx packets and the rx buffer are.
pub const TX_PACKETS: [u64; 2] = [0x6000, 0x6100];
pub const RX_BUFFER: u64 = DATA;

/// A packet the guest sends from [`GUEST_PORT`] to the host service.
pub fn vsock_packet(op: u16, payload: &[u8]) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&vsock::GUEST_CID.to_le_bytes());
    p.extend_from_slice(&2u64.to_le_bytes());
    p.extend_from_slice(&GUEST_PORT.to_le_bytes());
    p.extend_from_slice(&vsock::SERVICE_PORT.to_le_bytes());
    p.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    p.extend_from_slice(&1u16.to_le_bytes());
    p.extend_from_slice(&op.to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(&(64u32 * 1024).to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(payload);
    p
}

/// The guest connects to the host service and, once answered, sends `hello`.
pub fn vsock_connect_and_send() -> vsock::Input {
    let [rx, tx, _] = vsock_layouts();
    let poke =
        |addr: u64, bytes: &[u8]| pokes(addr, bytes, |addr, bytes| vsock::Op::Poke { addr, bytes });
    let request = vsock_packet(VSOCK_REQUEST, &[]);
    let hello = vsock_packet(VSOCK_RW, b"hello");
    let mut tx_table = descriptor(TX_PACKETS[0], request.len() as u32, 0, 0);
    tx_table.extend(descriptor(TX_PACKETS[1], hello.len() as u32, 0, 0));
    let ops = [
        poke(rx.desc, &descriptor(RX_BUFFER, 4096, WRITE, 0)),
        poke(rx.avail, &avail_ring(&[0])),
        poke(TX_PACKETS[0], &request),
        poke(TX_PACKETS[1], &hello),
        poke(tx.desc, &tx_table),
        poke(tx.avail, &avail_ring(&[0])),
        vec![
            vsock::Op::Process,
            vsock::Op::HostEvents,
            vsock::Op::Process,
        ],
        poke(tx.avail, &avail_ring(&[0, 1])),
        vec![vsock::Op::Process, vsock::Op::HostEvents],
    ]
    .concat();
    vsock::Input {
        queues: vsock_layouts(),
        image: Vec::new(),
        ops,
    }
}

/// FUSE opcodes.
pub const FUSE_LOOKUP: u32 = 1;
pub const FUSE_FORGET: u32 = 2;
pub const UNIQUE: u64 = 77;
pub const FUSE_REPLY: u64 = STATUS;

fn fuse_header(opcode: u32, unique: u64) -> Vec<u8> {
    let mut h = 40u32.to_le_bytes().to_vec();
    h.extend_from_slice(&opcode.to_le_bytes());
    h.extend_from_slice(&unique.to_le_bytes());
    h.resize(40, 0);
    h
}

/// After the backend died: a LOOKUP (with a reply buffer) and a FORGET (without).
pub fn fs_requests() -> fs_fallback::Input {
    let poke = |addr: u64, bytes: &[u8]| {
        pokes(addr, bytes, |addr, bytes| fs_fallback::Op::Poke {
            addr,
            bytes,
        })
    };
    let mut table = descriptor(HEADER, 40, NEXT, 1);
    table.extend(descriptor(FUSE_REPLY, 16, WRITE, 0));
    table.extend(descriptor(HEADER + 0x100, 40, 0, 0));
    let mut headers = fuse_header(FUSE_LOOKUP, UNIQUE);
    headers.resize(0x100, 0);
    headers.extend(fuse_header(FUSE_FORGET, UNIQUE + 1));
    fs_fallback::Input {
        queue: LAYOUT,
        image: Vec::new(),
        ops: [
            poke(DESC, &table),
            poke(HEADER, &headers),
            poke(AVAIL, &avail_ring(&[0, 2])),
            vec![fs_fallback::Op::TakeOver, fs_fallback::Op::Kick],
        ]
        .concat(),
    }
}

/// The secret of the redaction sessions.
pub const SECRET: &[u8] = b"sk-ant-api03-abcdefghijklmnop";

/// A redaction session of [`SECRET`] carried in `form`.
fn session(form: Form, watched: bool, ops: Vec<redact::Op>) -> redact::Input {
    redact::Input {
        form,
        watched,
        secret: SECRET.to_vec(),
        ops,
    }
}

/// `text` for the stream.
fn text(bytes: &[u8]) -> redact::Op {
    redact::Op::Bytes(bytes.to_vec())
}

/// Bytes `from..to` of the needle at `index` ([`redact::Input::needles`]: 0 the header
/// value, 1 the secret, 2 the value's last word).
fn piece(index: u8, from: u8, to: u8) -> redact::Op {
    redact::Op::Piece {
        needle: index,
        from,
        to,
    }
}

/// An upstream echoes the request's `Authorization: Bearer` header back, the value
/// split across two chunks, then more text.
pub fn bearer_echo() -> redact::Input {
    session(
        Form::Bearer,
        true,
        vec![
            text(b"{\"headers\": {\"authorization\": \""),
            piece(0, 0, 12),
            redact::Op::Chunk,
            piece(0, 12, u8::MAX),
            text(b"\"}}\n"),
            redact::Op::Chunk,
        ],
    )
}

/// The secret arrives in two parts with a pause between (a slow server-sent event):
/// its first 5 bytes go on unmasked, the rest is masked when it comes.
pub fn pause_inside_the_secret() -> redact::Input {
    session(
        Form::Bare,
        true,
        vec![
            text(b"data: "),
            piece(1, 0, 5),
            redact::Op::Pause,
            piece(1, 5, u8::MAX),
            text(b"\n\n"),
            redact::Op::Chunk,
        ],
    )
}

/// git's Basic credential echoed, its encoded word a byte per chunk.
pub fn git_basic_bytewise() -> redact::Input {
    let mut input = session(Form::GitBasic, false, vec![text(b"auth=")]);
    let word_len = input.needles()[2].len() as u8;
    for at in 0..word_len {
        input.ops.extend([piece(2, at, at + 1), redact::Op::Chunk]);
    }
    input
}

/// A guest probing for the secret: three responses' worth of long starts of it,
/// each turning away, after which the secret is withdrawn.
pub fn probes_for_the_secret() -> redact::Input {
    let mut ops = Vec::new();
    for guess in [b"x", b"y", b"z"] {
        ops.extend([piece(1, 0, 20), text(guess), redact::Op::Chunk]);
    }
    ops.push(text(b"rest"));
    let form = Form::Template {
        prefix: b"token=".to_vec(),
        suffix: b";".to_vec(),
    };
    session(form, true, ops)
}

/// Every session, by target and name, as bytes for libFuzzer's corpus.
pub fn corpus() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let pattern = vec![b'W'; 512];
    vec![
        (
            "mmio",
            "disk-read",
            block_request(true, BLK_IN, 3, DATA, 512, &[]).encode(),
        ),
        (
            "mmio",
            "disk-write",
            block_request(false, BLK_OUT, 5, DATA, 512, &pattern).encode(),
        ),
        ("mmio", "rng", rng_request().encode()),
        ("mmio", "balloon-report", balloon_report().encode()),
        ("mmio", "console-write", console_write().encode()),
        (
            "vsock",
            "connect-and-send",
            vsock_connect_and_send().encode(),
        ),
        ("fs_fallback", "lookup-and-forget", fs_requests().encode()),
        ("redact", "bearer-echo", bearer_echo().encode()),
        (
            "redact",
            "pause-inside-the-secret",
            pause_inside_the_secret().encode(),
        ),
        (
            "redact",
            "git-basic-bytewise",
            git_basic_bytewise().encode(),
        ),
        (
            "redact",
            "probes-for-the-secret",
            probes_for_the_secret().encode(),
        ),
    ]
}
