//! Device-level tests: a simulated guest driver over mock split queues in real guest
//! memory, the device's worker thread, and real Unix sockets in a temp dir.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::connection::BUF_ALLOC;
use super::packet::{Header, Op, HDR_LEN, HOST_CID, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM};
use super::worker::RX_QUEUE;
use super::*;
use crate::devices::virtio::spread_ring::SpreadRing;

const CID: u64 = 3;
const QSIZE: u16 = QUEUE_SIZE;
const QUEUE_BASE: [u64; 3] = [0x0, 0x1_0000, 0x2_0000];
const RX_BUF_BASE: u64 = 0x10_0000;
const RX_BUF_SIZE: u32 = 4096 + HDR_LEN as u32;
const RX_SLOT: u64 = 0x2000;
const TX_BUF_BASE: u64 = 0x40_0000;
const TX_SLOT: u64 = 0x2000;
/// Guest memory no queue or buffer uses.
const SPARE_BASE: u64 = 0x80_0000;
const MEM_SIZE: usize = 0x100_0000;
const TIMEOUT: Duration = Duration::from_secs(10);
/// The ports of probe packets (see [`Guest::probe`]), used by no test connection.
const PROBE_GUEST_PORT: u32 = u32::MAX;
const PROBE_HOST_PORT: u32 = u32::MAX - 1;

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "vsock-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

type Packet = (Header, Vec<u8>);

/// A simulated guest driver. Like Linux's, it notifies the device only when the
/// device asks (`avail_event` with EVENT_IDX, the used ring's NO_NOTIFY flag
/// without), so a device that forgets to ask again makes these tests wait for ever.
struct Guest {
    mem: GuestMemoryMmap,
    dev: Vsock,
    _dir: TempDir,
    event_idx: bool,
    rx_used: u16,
    tx_used: u16,
    tx_free: Vec<u16>,
    received: VecDeque<Packet>,
    irq: Arc<EventFd>,
    /// Notifications sent, per queue.
    kicks: [u32; 3],
}

const USED_F_NO_NOTIFY: u16 = virtio_bindings::virtio_ring::VRING_USED_F_NO_NOTIFY as u16;

fn raw(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, flags, next))
}

impl Guest {
    /// A guest that negotiated EVENT_IDX, as Linux does, with every receive buffer
    /// posted.
    fn new() -> Self {
        Self::negotiating(true, QSIZE)
    }

    /// A guest with or without EVENT_IDX, that posts `rx_buffers` receive buffers.
    fn negotiating(event_idx: bool, rx_buffers: u16) -> Self {
        let dir = TempDir::new();
        let dev = Vsock::new(CID, &dir.0.join("v.sock")).unwrap();
        Self::start(dir, dev, event_idx, rx_buffers, |_| {})
    }

    fn with_device(dir: TempDir, dev: Vsock) -> Self {
        Self::start(dir, dev, true, QSIZE, |_| {})
    }

    /// Activates `dev` for a new guest; `before` writes what the guest's memory holds
    /// before that.
    fn start(
        dir: TempDir,
        mut dev: Vsock,
        event_idx: bool,
        rx_buffers: u16,
        before: impl FnOnce(&GuestMemoryMmap),
    ) -> Self {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        let irq = Arc::new(EventFd::new(EFD_NONBLOCK).unwrap());
        let mut guest = Self {
            mem,
            dev: Vsock::new(CID, &dir.0.join("unused.sock")).unwrap(),
            _dir: dir,
            event_idx,
            rx_used: 0,
            tx_used: 0,
            tx_free: (0..QSIZE).rev().collect(),
            received: VecDeque::new(),
            irq: irq.clone(),
            kicks: [0; 3],
        };
        let queues: Vec<Queue> = (0..3).map(|q| Self::ring(q).queue(event_idx)).collect();
        for i in 0..rx_buffers {
            guest.post_rx(i);
        }
        before(&guest.mem);
        dev.activate(guest.mem.clone(), queues, InterruptTrigger::new(irq))
            .unwrap();
        guest.dev = dev;
        guest
    }

    /// Queue `q`'s rings, apart (see [`SpreadRing`]).
    fn ring(q: usize) -> SpreadRing {
        SpreadRing::new(QUEUE_BASE[q], QSIZE)
    }

    fn path(&self) -> PathBuf {
        self.dev.uds_path().to_path_buf()
    }

    /// Makes chain `head` (descriptors `head..head+descs.len()`) available.
    fn post(&self, q: usize, head: u16, descs: &[RawDescriptor]) {
        Self::ring(q).offer(&self.mem, head, descs);
    }

    /// The available index of queue `q`: how many chains the guest made available.
    fn avail_idx(&self, q: usize) -> u16 {
        Self::ring(q).avail_idx(&self.mem)
    }

    /// Whether the device asks to be told of queue `q`'s chains made available since
    /// the available index was `old` (Linux's `virtqueue_kick_prepare`).
    fn device_wants_notification(&self, q: usize, old: u16) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        let new = self.avail_idx(q);
        let ring = Self::ring(q);
        if self.event_idx {
            let event = ring.avail_event(&self.mem);
            new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            ring.used_flags(&self.mem) & USED_F_NO_NOTIFY == 0
        }
    }

    /// Notifies the device of queue `q`'s chains made available since its available
    /// index was `old`, if it asks for it.
    fn notify(&mut self, q: usize, old: u16) {
        if self.device_wants_notification(q, old) {
            self.kicks[q] += 1;
            assert_eq!(self.dev.process_queue(q), QueueProgress::Done);
        }
    }

    /// Used element `i` (modulo the size) and the used index of queue `q`.
    fn used(&self, q: usize, i: u16) -> (u16, u32, u32) {
        let ring = Self::ring(q);
        let idx = ring.used_idx(&self.mem);
        let (id, len) = ring.used_elem(&self.mem, i);
        (idx, id, len)
    }

    fn post_rx(&self, i: u16) {
        let addr = RX_BUF_BASE + u64::from(i) * RX_SLOT;
        self.post(
            0,
            i,
            &[raw(addr, RX_BUF_SIZE, VRING_DESC_F_WRITE as u16, 0)],
        );
    }

    fn reclaim_tx(&mut self) {
        let (idx, _, _) = self.used(1, 0);
        while self.tx_used != idx {
            let (_, id, _) = self.used(1, self.tx_used);
            self.tx_free.push(id as u16);
            self.tx_used = self.tx_used.wrapping_add(1);
        }
    }

    /// Sends raw bytes as one single-descriptor tx chain.
    fn send_raw(&mut self, bytes: &[u8]) {
        let old = self.avail_idx(1);
        self.post_tx(bytes);
        self.notify(1, old);
    }

    /// Makes raw bytes available as one single-descriptor tx chain, without a kick.
    fn post_tx(&mut self, bytes: &[u8]) {
        let deadline = Instant::now() + TIMEOUT;
        let slot = loop {
            self.reclaim_tx();
            if let Some(slot) = self.tx_free.pop() {
                break slot;
            }
            assert!(Instant::now() < deadline, "tx queue never drained");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(bytes.len() as u64 <= TX_SLOT);
        let addr = TX_BUF_BASE + u64::from(slot) * TX_SLOT;
        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
        self.post(1, slot, &[raw(addr, bytes.len() as u32, 0, 0)]);
    }

    fn send(&mut self, hdr: Header, data: &[u8]) {
        let mut hdr = hdr;
        hdr.len = data.len() as u32;
        let mut bytes = hdr.to_bytes().to_vec();
        bytes.extend_from_slice(data);
        self.send_raw(&bytes);
    }

    fn send_op(&mut self, src_port: u32, dst_port: u32, op: Op, data: &[u8]) {
        self.send(hdr(src_port, dst_port, op), data);
    }

    /// Moves used rx buffers into `received` and reposts them.
    fn poll_rx(&mut self) {
        let (idx, _, _) = self.used(0, 0);
        let old = self.avail_idx(0);
        let mut reposted = false;
        while self.rx_used != idx {
            let (_, id, used_len) = self.used(0, self.rx_used);
            self.rx_used = self.rx_used.wrapping_add(1);
            let id = id as u16;
            let addr = RX_BUF_BASE + u64::from(id) * RX_SLOT;
            let mut raw_hdr = [0u8; HDR_LEN];
            self.mem
                .read_slice(&mut raw_hdr, GuestAddress(addr))
                .unwrap();
            let h = Header::from_bytes(&raw_hdr);
            assert_eq!(used_len as usize, HDR_LEN + h.len as usize);
            assert!(h.len <= RX_BUF_SIZE - HDR_LEN as u32);
            let mut data = vec![0u8; h.len as usize];
            self.mem
                .read_slice(&mut data, GuestAddress(addr + HDR_LEN as u64))
                .unwrap();
            assert_eq!(
                (h.src_cid, h.dst_cid, h.type_),
                (HOST_CID, CID, TYPE_STREAM)
            );
            self.received.push_back((h, data));
            self.post_rx(id);
            reposted = true;
        }
        if reposted {
            self.notify(0, old);
        }
    }

    fn try_recv(&mut self, wait: Duration) -> Option<Packet> {
        let deadline = Instant::now() + wait;
        loop {
            self.poll_rx();
            if let Some(p) = self.received.pop_front() {
                return Some(p);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn recv(&mut self) -> Packet {
        self.try_recv(TIMEOUT).expect("no packet from the device")
    }

    /// Receives the next packet, which must be `op`.
    fn expect(&mut self, op: Op) -> Packet {
        let p = self.recv();
        assert_eq!(p.0.op, op as u16, "expected {op:?}, got {:?}", p.0);
        p
    }

    /// Sends a packet for a connection that does not exist and returns what arrives
    /// before the device's RST for it. The device acts on tx packets in order, so by
    /// then it has acted on everything the guest sent before the probe.
    fn probe(&mut self) -> Vec<Packet> {
        self.send_op(PROBE_GUEST_PORT, PROBE_HOST_PORT, Op::CreditRequest, &[]);
        let mut before = Vec::new();
        loop {
            let p = self.recv();
            let h = &p.0;
            if h.op == Op::Rst as u16
                && (h.src_port, h.dst_port) == (PROBE_HOST_PORT, PROBE_GUEST_PORT)
            {
                return before;
            }
            before.push(p);
        }
    }

    /// Asserts that the device has nothing to send in answer to what happened so far.
    /// Waits for two probes: RSTs for unknown connections go out ahead of connection
    /// packets, so a connection packet caused by an earlier packet may trail the first
    /// probe's RST, but it is produced in the same pass, before the second probe is
    /// even read.
    fn assert_quiet(&mut self) {
        for _ in 0..2 {
            let before = self.probe();
            assert!(before.is_empty(), "unexpected packets: {before:?}");
        }
    }

    /// Like `expect`, skipping the device's unprompted credit updates.
    fn expect_skip_credit(&mut self, op: Op) -> Packet {
        loop {
            let p = self.recv();
            if p.0.op != Op::CreditUpdate as u16 || op == Op::CreditUpdate {
                assert_eq!(p.0.op, op as u16, "expected {op:?}, got {:?}", p.0);
                return p;
            }
        }
    }

    /// Host client connects to guest port `port`; returns the client and the host
    /// port the device chose.
    fn host_connect(&mut self, port: u32) -> (UnixStream, u32) {
        let mut client = UnixStream::connect(self.path()).unwrap();
        client.set_read_timeout(Some(TIMEOUT)).unwrap();
        writeln!(client, "CONNECT {port}").unwrap();
        let (h, _) = self.expect(Op::Request);
        assert_eq!(h.dst_port, port);
        assert!(h.src_port >= 1024);
        assert_eq!(h.buf_alloc, BUF_ALLOC);
        self.send_op(port, h.src_port, Op::Response, &[]);
        let line = read_line(&mut client);
        assert_eq!(line, format!("OK {}\n", h.src_port));
        (client, h.src_port)
    }
}

fn hdr(src_port: u32, dst_port: u32, op: Op) -> Header {
    Header {
        src_cid: CID,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        len: 0,
        type_: TYPE_STREAM,
        op: op as u16,
        flags: 0,
        buf_alloc: 64 * 1024,
        fwd_cnt: 0,
    }
}

fn read_line(s: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.last() != Some(&b'\n') {
        assert_eq!(s.read(&mut b).unwrap(), 1, "stream closed mid-line");
        line.push(b[0]);
    }
    String::from_utf8(line).unwrap()
}

fn assert_closed(s: &mut UnixStream) {
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
        other => panic!("expected a closed stream, got {other:?}"),
    }
}

#[test]
fn device_basics() {
    let dir = TempDir::new();
    let path = dir.0.join("v.sock");
    // A stale socket is replaced; a regular file is not.
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let mut dev = Vsock::new(0x1234_5678, &path).unwrap();
    assert!(path.exists());
    assert_eq!(dev.device_type(), 19);
    assert_eq!(dev.queue_max_sizes(), &[256, 256, 256]);
    // Only the transmit queue is watched for lost notifications.
    let watched: Vec<bool> = (0..3).map(|q| !dev.holds_chains(q)).collect();
    assert_eq!(watched, [false, true, false]);
    assert_eq!(dev.avail_features(), FEATURE_VERSION_1 | FEATURE_EVENT_IDX);
    let mut cfg = [0xffu8; 12];
    dev.read_config(0, &mut cfg);
    assert_eq!(&cfg[..8], &0x1234_5678u64.to_le_bytes());
    assert_eq!(&cfg[8..], &[0; 4]);
    let mut hi = [0u8; 4];
    dev.read_config(4, &mut hi);
    assert_eq!(u32::from_le_bytes(hi), 0);
    dev.read_config(u64::MAX, &mut hi);
    assert_eq!(hi, [0; 4]);
    dev.write_config(0, &[1, 2, 3]);
    // Activation needs three ready queues.
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let irq = InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
    assert!(matches!(
        dev.activate(mem.clone(), vec![], irq.clone()),
        Err(ActivateError::QueueCount {
            expected: 3,
            got: 0
        })
    ));
    let qs = vec![
        Queue::new(16).unwrap(),
        Queue::new(16).unwrap(),
        Queue::new(16).unwrap(),
    ];
    assert!(matches!(
        dev.activate(mem, qs, irq),
        Err(ActivateError::QueueNotReady { index: 0 })
    ));
    assert_eq!(dev.process_queue(0), QueueProgress::Done);
    dev.reset();
    drop(dev);
    assert!(!path.exists(), "socket file removed on drop");

    std::fs::write(&path, b"not a socket").unwrap();
    assert!(matches!(
        Vsock::new(3, &path),
        Err(VsockError::NotASocket(_))
    ));
    assert!(matches!(
        Vsock::new(2, &dir.0.join("x")),
        Err(VsockError::InvalidCid(2))
    ));
    assert!(matches!(
        Vsock::new(u64::from(u32::MAX), &dir.0.join("x")),
        Err(VsockError::InvalidCid(_))
    ));
}

#[test]
fn host_initiated_connection_and_data() {
    let mut g = Guest::new();
    let (mut client, local) = g.host_connect(52);
    assert_eq!(local, 1024);
    client.write_all(b"ping").unwrap();
    let (h, data) = g.expect(Op::Rw);
    assert_eq!((h.src_port, h.dst_port), (local, 52));
    assert_eq!(data, b"ping");
    g.send_op(52, local, Op::Rw, b"pong");
    let mut buf = [0u8; 4];
    client.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"pong");
    // Data written right behind the CONNECT line is not lost.
    let mut c2 = UnixStream::connect(g.path()).unwrap();
    c2.write_all(b"CONNECT 53\nearly").unwrap();
    let (h, _) = g.expect(Op::Request);
    assert_eq!((h.src_port, h.dst_port), (1025, 53));
    g.send_op(53, 1025, Op::Response, &[]);
    let (h, data) = g.expect(Op::Rw);
    assert_eq!((h.src_port, data.as_slice()), (1025, &b"early"[..]));
    assert!(g.irq.read().unwrap() >= 1);
    assert!(g.dev.is_active());
}

#[test]
fn guest_refusal_closes_the_client_and_bad_lines_are_dropped() {
    let mut g = Guest::new();
    let mut client = UnixStream::connect(g.path()).unwrap();
    client.write_all(b"CONNECT 9\n").unwrap();
    let (h, _) = g.expect(Op::Request);
    g.send_op(9, h.src_port, Op::Rst, &[]);
    assert_closed(&mut client);
    let mut bad = UnixStream::connect(g.path()).unwrap();
    bad.write_all(b"HELLO there\n").unwrap();
    assert_closed(&mut bad);
    let mut long = UnixStream::connect(g.path()).unwrap();
    long.write_all(&[b'A'; 100]).unwrap();
    assert_closed(&mut long);
    g.assert_quiet();
}

/// A guest that never answers a host client's request (neither OP_RESPONSE nor RST)
/// does not keep the client waiting, or its slot taken, for ever.
#[test]
fn a_request_the_guest_leaves_unanswered_expires() {
    let mut g = Guest::new();
    let mut client = UnixStream::connect(g.path()).unwrap();
    let asked = Instant::now();
    client.write_all(b"CONNECT 77\n").unwrap();
    let (request, _) = g.expect(Op::Request);
    assert_closed(&mut client);
    assert!(asked.elapsed() >= super::muxer::REQUEST_TIMEOUT);
    let (rst, _) = g.expect(Op::Rst);
    assert_eq!((rst.src_port, rst.dst_port), (request.src_port, 77));
    // An answer that comes too late is refused.
    g.send_op(77, request.src_port, Op::Response, &[]);
    g.expect(Op::Rst);
    // A request the guest answers in time stays.
    let (mut answered, _) = g.host_connect(78);
    std::thread::sleep(super::muxer::REQUEST_TIMEOUT + Duration::from_millis(300));
    answered.write_all(b"still here").unwrap();
    let (h, data) = g.expect_skip_credit(Op::Rw);
    assert_eq!((h.dst_port, data.as_slice()), (78, &b"still here"[..]));
}

#[test]
fn credit_limits_host_to_guest_data() {
    let mut g = Guest::new();
    let mut client = UnixStream::connect(g.path()).unwrap();
    client.set_read_timeout(Some(TIMEOUT)).unwrap();
    client.write_all(b"CONNECT 77\n").unwrap();
    let (h, _) = g.expect(Op::Request);
    let local = h.src_port;
    let mut resp = hdr(77, local, Op::Response);
    resp.buf_alloc = 1000;
    g.send(resp, &[]);
    assert_eq!(read_line(&mut client), format!("OK {local}\n"));
    client.write_all(&[0x5a; 5000]).unwrap();
    let mut got = 0;
    while got < 1000 {
        let (h, data) = g.expect(Op::Rw);
        assert!(data.iter().all(|&b| b == 0x5a));
        got += data.len();
        assert_eq!(h.fwd_cnt, 0);
    }
    assert_eq!(got, 1000);
    // Nothing beyond the credit.
    g.assert_quiet();
    // The guest consumed everything: 1000 more.
    let mut upd = hdr(77, local, Op::CreditUpdate);
    upd.buf_alloc = 1000;
    upd.fwd_cnt = 1000;
    g.send(upd, &[]);
    let mut more = 0;
    while more < 1000 {
        more += g.expect(Op::Rw).1.len();
    }
    assert_eq!(more, 1000);
    g.assert_quiet();
    // A credit request is answered with our counters.
    let mut req = hdr(77, local, Op::CreditRequest);
    req.buf_alloc = 1000;
    req.fwd_cnt = 1000;
    g.send(req, &[]);
    let (h, _) = g.expect(Op::CreditUpdate);
    assert_eq!((h.buf_alloc, h.fwd_cnt), (BUF_ALLOC, 0));
    // Guest→host data moves fwd_cnt.
    let mut rw = hdr(77, local, Op::Rw);
    rw.buf_alloc = 1000;
    rw.fwd_cnt = 1000;
    g.send(rw, &[1u8; 300]);
    let mut buf = [0u8; 300];
    client.read_exact(&mut buf).unwrap();
    g.send(req, &[]);
    let (h, _) = g.expect(Op::CreditUpdate);
    assert_eq!(h.fwd_cnt, 300);
}

#[test]
fn large_transfer_both_ways() {
    large_transfer(Guest::new());
}

/// The same with a driver that did not negotiate EVENT_IDX, which reads the used
/// ring's NO_NOTIFY flag instead.
#[test]
fn large_transfer_both_ways_without_event_idx() {
    large_transfer(Guest::negotiating(false, QSIZE));
}

/// 1 MiB from the host to the guest, then 1 MiB back, each side honouring the
/// other's credit.
fn large_transfer(mut g: Guest) {
    let (client, local) = g.host_connect(80);
    // Host → guest, 1 MiB, with the guest granting credit as it consumes.
    let payload: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
    let writer = {
        let mut c = client.try_clone().unwrap();
        let p = payload.clone();
        std::thread::spawn(move || c.write_all(&p).unwrap())
    };
    let mut got = Vec::new();
    let mut last_update = 0usize;
    while got.len() < payload.len() {
        let (h, data) = g.expect(Op::Rw);
        assert!(h.len <= 4096);
        got.extend_from_slice(&data);
        if got.len() - last_update >= 16 * 1024 {
            let mut upd = hdr(80, local, Op::CreditUpdate);
            upd.fwd_cnt = got.len() as u32;
            g.send(upd, &[]);
            last_update = got.len();
        }
        assert!(got.len() <= 64 * 1024 + last_update, "credit exceeded");
    }
    assert!(got == payload);
    writer.join().unwrap();
    // Guest → host, 1 MiB in 4 KiB packets, honouring the device's credit.
    let reader = {
        let mut c = client.try_clone().unwrap();
        let n = payload.len();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; n];
            c.read_exact(&mut buf).unwrap();
            buf
        })
    };
    let mut sent = 0usize;
    let mut peer_fwd = 0usize;
    while sent < payload.len() {
        if sent - peer_fwd + 4096 > BUF_ALLOC as usize {
            let mut req = hdr(80, local, Op::CreditRequest);
            req.fwd_cnt = got.len() as u32;
            g.send(req, &[]);
            let deadline = Instant::now() + TIMEOUT;
            loop {
                let (h, _) = g.recv();
                if h.op == Op::CreditUpdate as u16 {
                    peer_fwd = h.fwd_cnt as usize;
                    break;
                }
                assert!(Instant::now() < deadline);
            }
            continue;
        }
        let mut rw = hdr(80, local, Op::Rw);
        rw.fwd_cnt = got.len() as u32;
        g.send(rw, &payload[sent..sent + 4096]);
        sent += 4096;
    }
    assert!(reader.join().unwrap() == payload);
    drop(client);
}

#[test]
fn guest_initiated_connections() {
    let mut g = Guest::new();
    let mut name = g.path().into_os_string();
    name.push("_1234");
    let listener = UnixListener::bind(PathBuf::from(name)).unwrap();
    g.send_op(40000, 1234, Op::Request, &[]);
    let (h, _) = g.expect(Op::Response);
    assert_eq!((h.src_port, h.dst_port), (1234, 40000));
    let (mut server, _) = listener.accept().unwrap();
    server.set_read_timeout(Some(TIMEOUT)).unwrap();
    g.send_op(40000, 1234, Op::Rw, b"hello host");
    let mut buf = [0u8; 10];
    server.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"hello host");
    server.write_all(b"hello guest").unwrap();
    let (h, data) = g.expect(Op::Rw);
    assert_eq!(
        (h.src_port, h.dst_port, data.as_slice()),
        (1234, 40000, &b"hello guest"[..])
    );
    // Guest closes: SHUTDOWN both → RST from the device, host socket closed.
    let mut sd = hdr(40000, 1234, Op::Shutdown);
    sd.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    g.send(sd, &[]);
    g.expect(Op::Rst);
    assert_closed(&mut server);
    // Nobody listens on port 1235.
    g.send_op(40001, 1235, Op::Request, &[]);
    let (h, _) = g.expect(Op::Rst);
    assert_eq!((h.src_port, h.dst_port), (1235, 40001));
    // Packets for unknown connections are reset too, RSTs are not answered.
    g.send_op(40002, 1236, Op::Rw, b"x");
    g.expect(Op::Rst);
    g.send_op(40002, 1236, Op::Rst, &[]);
    g.assert_quiet();
}

/// A guest with or without EVENT_IDX and no receive buffer, the field of its receive
/// ring at `at` set to `preset` (which asks for no notification), and a host client
/// whose connection request waits for a buffer: once the device asked for one, by
/// writing another value there.
fn waiting_for_a_receive_buffer(
    event_idx: bool,
    at: GuestAddress,
    preset: u16,
) -> (Guest, UnixStream) {
    let dir = TempDir::new();
    let dev = Vsock::new(CID, &dir.0.join("v.sock")).unwrap();
    let g = Guest::start(dir, dev, event_idx, 0, |mem| {
        mem.write_obj(preset, at).unwrap();
    });
    let mut client = UnixStream::connect(g.path()).unwrap();
    writeln!(client, "CONNECT 52").unwrap();
    let deadline = Instant::now() + TIMEOUT;
    while g.mem.read_obj::<u16>(at).unwrap() == preset {
        assert!(
            Instant::now() < deadline,
            "the device never asked for a buffer"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    (g, client)
}

/// The driver's new receive buffers are notified only while the device has packets
/// and nowhere to put them: the worker looks at the ring whenever it has something
/// to deliver, and each other notification would be a VM exit for nothing. The
/// guest here starts with no receive buffer at all and an `avail_event` that asks
/// for no notification; a host client's connection then waits for one.
#[test]
fn receive_buffers_are_notified_only_while_the_device_waits_for_one() {
    // An `avail_event` that asks for no notification.
    const NEVER: u16 = 0x8000;
    let at = Guest::ring(RX_QUEUE).avail_event_addr();
    let (mut g, mut client) = waiting_for_a_receive_buffer(true, at, NEVER);
    assert_eq!(g.kicks, [0; 3]);
    // Its first buffer is notified, and takes the connection request.
    g.post_rx(0);
    g.notify(RX_QUEUE, 0);
    assert_eq!(g.kicks[RX_QUEUE], 1);
    let (h, _) = g.expect(Op::Request);
    assert_eq!(h.dst_port, 52);
    // `expect` posted that buffer again; with nothing more to deliver, the device
    // wanted no notification of it, nor of more.
    assert_eq!(g.kicks[RX_QUEUE], 1);
    let old = g.avail_idx(RX_QUEUE);
    for i in 1..8 {
        g.post_rx(i);
    }
    assert!(!g.device_wants_notification(RX_QUEUE, old));
    // The connection goes on: the worker finds the buffers when it has data.
    g.send_op(52, h.src_port, Op::Response, &[]);
    assert_eq!(read_line(&mut client), format!("OK {}\n", h.src_port));
    client.write_all(b"ping").unwrap();
    let (_, data) = g.expect(Op::Rw);
    assert_eq!(data, b"ping");
    assert_eq!(g.kicks[RX_QUEUE], 1, "{:?}", g.kicks);
}

/// Without EVENT_IDX the same is said with the used ring's NO_NOTIFY flag: clear
/// while the device waits for a buffer, set once it has nothing to deliver.
#[test]
fn without_event_idx_no_notify_is_clear_only_while_the_device_waits_for_a_buffer() {
    let flags_at = Guest::ring(RX_QUEUE).used_flags_addr();
    let (mut g, mut client) = waiting_for_a_receive_buffer(false, flags_at, USED_F_NO_NOTIFY);
    g.post_rx(0);
    g.notify(RX_QUEUE, 0);
    let (h, _) = g.expect(Op::Request);
    // The guest's answer wakes the worker, which has nothing for the guest now.
    g.send_op(52, h.src_port, Op::Response, &[]);
    assert_eq!(read_line(&mut client), format!("OK {}\n", h.src_port));
    assert_eq!(g.mem.read_obj::<u16>(flags_at).unwrap(), USED_F_NO_NOTIFY);
    assert_eq!(g.kicks[RX_QUEUE], 1, "{:?}", g.kicks);
}

/// Given the queues' ioeventfds, the worker waits on them itself: a guest's kick,
/// which KVM signals there with no VMM thread in between, is served without the
/// event loop's `process_queue`.
#[test]
fn a_kick_on_a_queues_ioeventfd_reaches_the_worker() {
    let dir = TempDir::new();
    let mut dev = Vsock::new(CID, &dir.0.join("v.sock")).unwrap();
    let kicks: Vec<EventFd> = (0..3)
        .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
        .collect();
    assert!(dev.attach_queue_events(&kicks).unwrap(), "served elsewhere");
    let mut g = Guest::with_device(dir, dev);
    // Nobody listens on port 1235: the answer is a reset.
    let mut request = hdr(40001, 1235, Op::Request);
    request.len = 0;
    g.post_tx(&request.to_bytes());
    kicks[1].write(1).unwrap();
    let (h, _) = g.expect(Op::Rst);
    assert_eq!((h.src_port, h.dst_port), (1235, 40001));
    // Two events are not the device's three queues: the event loop keeps them.
    let mut other = Vsock::new(CID, &g._dir.0.join("w.sock")).unwrap();
    assert!(!other.attach_queue_events(&kicks[..2]).unwrap());
}

/// A host service that does not accept: the guest's connections beyond its backlog
/// are refused, and the device goes on serving (it used to wait inside `connect`).
#[test]
fn a_full_backlog_refuses_the_guest_instead_of_stalling_the_device() {
    let mut g = Guest::new();
    let mut name = g.path().into_os_string();
    name.push("_1234");
    // Dropped before `g` if the test fails, which wakes a worker stuck connecting.
    let listener = UnixListener::bind(PathBuf::from(name)).unwrap();
    // SAFETY: listen(2) again on a listening socket we own only shrinks its backlog;
    // the fd stays valid for the call.
    let shrunk = unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&listener), 0) };
    assert_eq!(shrunk, 0, "{}", std::io::Error::last_os_error());
    g.send_op(40000, 1234, Op::Request, &[]);
    g.expect(Op::Response);
    for port in [40001, 40002] {
        g.send_op(port, 1234, Op::Request, &[]);
        let (h, _) = g.expect(Op::Rst);
        assert_eq!((h.src_port, h.dst_port), (1234, port));
    }
    let (mut server, _) = listener.accept().unwrap();
    server.set_read_timeout(Some(TIMEOUT)).unwrap();
    g.send_op(40000, 1234, Op::Rw, b"still here");
    let mut buf = [0u8; 10];
    server.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"still here");
}

/// Raises this process's open files limit to at least `wanted`, as far as the hard
/// limit allows: a test that holds a thousand connections needs two descriptors each.
fn allow_open_files(wanted: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: both calls get a pointer to a live, properly aligned rlimit.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < wanted {
            limit.rlim_cur = wanted.min(limit.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
}

/// A guest that holds all the connections to host services it may (a CLI leaking
/// keep-alive connections to the egress proxy) is refused more, while host clients
/// (`vmctl exec`, the network setup, `Shutdown`) still get the connections kept for
/// them; a connection the guest closes is its to open again.
#[test]
fn the_guest_cannot_take_the_connections_host_clients_need() {
    use super::muxer::{HOST_RESERVED_CONNECTIONS, MAX_CONNECTIONS, MAX_GUEST_CONNECTIONS};
    allow_open_files(4 * MAX_CONNECTIONS as u64);
    let mut g = Guest::new();
    let mut name = g.path().into_os_string();
    name.push("_1234");
    let listener = UnixListener::bind(PathBuf::from(name)).unwrap();
    let mut held = Vec::new();
    for port in 0..MAX_GUEST_CONNECTIONS as u32 {
        g.send_op(40000 + port, 1234, Op::Request, &[]);
        g.expect(Op::Response);
        // Accepted at once: the service's backlog alone holds far fewer.
        held.push(listener.accept().unwrap().0);
    }
    g.send_op(50000, 1234, Op::Request, &[]);
    let (h, _) = g.expect(Op::Rst);
    assert_eq!((h.src_port, h.dst_port), (1234, 50000));
    listener.set_nonblocking(true).unwrap();
    assert!(
        listener
            .accept()
            .is_err_and(|e| e.kind() == ErrorKind::WouldBlock),
        "the refused request reached the host service"
    );

    let clients: Vec<UnixStream> = (0..HOST_RESERVED_CONNECTIONS as u32)
        .map(|i| g.host_connect(2000 + i).0)
        .collect();
    assert_eq!(held.len() + clients.len(), MAX_CONNECTIONS);

    g.send_op(40000, 1234, Op::Rst, &[]);
    g.send_op(50001, 1234, Op::Request, &[]);
    let (h, _) = g.expect(Op::Response);
    assert_eq!((h.src_port, h.dst_port), (1234, 50001));
}

/// After a first shutdown with `flags`, what a host client's close brings: the end of
/// its stream and its hang-up may be seen apart (a half-close, SEND, then the full
/// shutdown), so more shutdowns may follow, then the RST; both directions end.
fn shutdowns_then_rst(g: &mut Guest, mut flags: u32) {
    loop {
        let (h, _) = g.recv();
        if h.op == Op::Shutdown as u16 {
            flags |= h.flags;
            continue;
        }
        assert_eq!(h.op, Op::Rst as u16, "expected Rst, got {h:?}");
        break;
    }
    assert_eq!(flags, SHUTDOWN_RCV | SHUTDOWN_SEND);
}

#[test]
fn host_close_and_guest_reset() {
    let mut g = Guest::new();
    let (client, local) = g.host_connect(5);
    drop(client);
    let (h, _) = g.expect(Op::Shutdown);
    assert_eq!((h.src_port, h.dst_port), (local, 5));
    shutdowns_then_rst(&mut g, h.flags);
    // Data sent by a client just before closing still arrives first.
    let (mut client, _) = g.host_connect(6);
    client.write_all(b"last words").unwrap();
    drop(client);
    let mut data = Vec::new();
    let shutdown_flags = loop {
        let (h, d) = g.recv();
        if h.op == Op::Rw as u16 {
            data.extend(d);
        } else {
            assert_eq!(h.op, Op::Shutdown as u16);
            break h.flags;
        }
    };
    assert_eq!(data, b"last words");
    shutdowns_then_rst(&mut g, shutdown_flags);
    // The guest resets: the client sees EOF.
    let (mut client, local) = g.host_connect(7);
    g.send_op(7, local, Op::Rst, &[]);
    assert_closed(&mut client);
    // Guest half-close (SEND): the client sees EOF but can still send.
    let (mut client, local) = g.host_connect(8);
    let mut sd = hdr(8, local, Op::Shutdown);
    sd.flags = SHUTDOWN_SEND;
    g.send(sd, &[]);
    assert_closed(&mut client);
    client.write_all(b"still here").unwrap();
    let (_, d) = g.expect(Op::Rw);
    assert_eq!(d, b"still here");
}

#[test]
fn a_host_half_close_leaves_the_guest_able_to_answer() {
    let mut g = Guest::new();
    let (mut client, local) = g.host_connect(9);
    client.write_all(b"request").unwrap();
    client.shutdown(std::net::Shutdown::Write).unwrap();
    let (_, data) = g.expect(Op::Rw);
    assert_eq!(data, b"request");
    let (h, _) = g.expect(Op::Shutdown);
    assert_eq!(
        h.flags, SHUTDOWN_SEND,
        "only the host's sending side is done"
    );
    g.assert_quiet();
    g.send_op(9, local, Op::Rw, b"response");
    let mut answer = [0u8; 8];
    client.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"response");
    // The guest closes too: the connection ends.
    let mut sd = hdr(9, local, Op::Shutdown);
    sd.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    g.send(sd, &[]);
    g.expect(Op::Rst);
    assert_closed(&mut client);

    // A client that closes completely after its half close ends the connection.
    let (client, _) = g.host_connect(10);
    client.shutdown(std::net::Shutdown::Write).unwrap();
    let (h, _) = g.expect(Op::Shutdown);
    assert_eq!(h.flags, SHUTDOWN_SEND);
    drop(client);
    let (h, _) = g.expect(Op::Shutdown);
    assert_eq!(h.flags, SHUTDOWN_RCV | SHUTDOWN_SEND);
    g.expect(Op::Rst);
}

#[test]
fn many_concurrent_connections() {
    const N: u32 = 100;
    let mut g = Guest::new();
    let mut clients = Vec::new();
    for i in 0..N {
        let mut c = UnixStream::connect(g.path()).unwrap();
        c.set_read_timeout(Some(TIMEOUT)).unwrap();
        writeln!(c, "CONNECT {}", 2000 + i).unwrap();
        clients.push(c);
    }
    let mut locals = std::collections::HashMap::new();
    while locals.len() < N as usize {
        let (h, _) = g.expect(Op::Request);
        assert!(locals.insert(h.dst_port, h.src_port).is_none());
        g.send_op(h.dst_port, h.src_port, Op::Response, &[]);
    }
    for (i, c) in clients.iter_mut().enumerate() {
        let port = 2000 + i as u32;
        assert_eq!(read_line(c), format!("OK {}\n", locals[&port]));
        // One write (`write!` makes one per formatted piece), though a stream may
        // reach the guest in any number of packets anyway.
        c.write_all(format!("from client {i}").as_bytes()).unwrap();
    }
    let mut got: std::collections::HashMap<u32, Vec<u8>> = std::collections::HashMap::new();
    let mut complete = 0;
    while complete < N {
        let (h, data) = g.expect(Op::Rw);
        assert_eq!(
            locals.get(&h.dst_port),
            Some(&h.src_port),
            "data on an unknown connection {}:{}",
            h.src_port,
            h.dst_port
        );
        let want = format!("from client {}", h.dst_port - 2000);
        let stream = got.entry(h.dst_port).or_default();
        stream.extend_from_slice(&data);
        assert!(
            want.as_bytes().starts_with(stream),
            "port {}: got {:?}, want {want:?}",
            h.dst_port,
            String::from_utf8_lossy(stream)
        );
        if stream.len() == want.len() {
            complete += 1;
        }
        g.send_op(h.dst_port, h.src_port, Op::Rw, &data);
    }
    for (i, c) in clients.iter_mut().enumerate() {
        let want = format!("from client {i}");
        let mut buf = vec![0u8; want.len()];
        c.read_exact(&mut buf).unwrap();
        assert_eq!(buf, want.as_bytes());
    }
}

#[test]
fn slow_host_reader_does_not_stall_others() {
    let mut g = Guest::new();
    let (slow, slow_port) = g.host_connect(1);
    let (mut fast, fast_port) = g.host_connect(2);
    // The guest fills the slow connection up to the device's credit; the socket
    // buffer takes part, the device buffers the rest without acknowledging it.
    let chunk = vec![9u8; 4000];
    let mut sent = 0usize;
    while sent + chunk.len() <= BUF_ALLOC as usize {
        g.send_op(1, slow_port, Op::Rw, &chunk);
        sent += chunk.len();
    }
    let mut req = hdr(1, slow_port, Op::CreditRequest);
    req.buf_alloc = 64 * 1024;
    g.send(req, &[]);
    let (h, _) = g.expect(Op::CreditUpdate);
    assert!((h.fwd_cnt as usize) < sent, "everything acknowledged?");
    assert_eq!(h.src_port, slow_port);
    // The other stream still flows both ways.
    g.send_op(2, fast_port, Op::Rw, b"through");
    let mut buf = [0u8; 7];
    fast.read_exact(&mut buf).unwrap();
    fast.write_all(b"back").unwrap();
    let (h, d) = g.expect_skip_credit(Op::Rw);
    assert_eq!((h.src_port, d.as_slice()), (fast_port, &b"back"[..]));
    // Exceeding the credit resets the connection.
    let over = vec![0u8; 8000];
    for _ in 0..(BUF_ALLOC as usize / over.len() + 1) {
        g.send_op(1, slow_port, Op::Rw, &over);
    }
    let (h, _) = g.expect_skip_credit(Op::Rst);
    assert_eq!(h.src_port, slow_port);
    drop(slow);
}

#[test]
fn malformed_packets_never_break_the_device() {
    let mut g = Guest::new();
    // Wrong CIDs: dropped silently.
    let mut h = hdr(1, 2, Op::Request);
    h.src_cid = 99;
    g.send(h, &[]);
    let mut h = hdr(1, 2, Op::Request);
    h.dst_cid = 3;
    g.send(h, &[]);
    // Short header, length beyond the buffer, length over the maximum: dropped.
    g.send_raw(&[0u8; 20]);
    let mut h = hdr(1, 2, Op::Rw);
    h.len = 100;
    g.send_raw(&h.to_bytes());
    h.len = u32::MAX;
    g.send_raw(&h.to_bytes());
    g.assert_quiet();
    // Bad op and bad type: reset.
    let mut h = hdr(1, 2, Op::Request);
    h.op = 42;
    g.send(h, &[]);
    let (r, _) = g.expect(Op::Rst);
    assert_eq!((r.src_port, r.dst_port), (2, 1));
    let mut h = hdr(1, 2, Op::Request);
    h.type_ = 2;
    g.send(h, &[]);
    g.expect(Op::Rst);
    // Descriptors outside guest memory, writable tx descriptors, a chain that loops
    // on itself and one that leaves the descriptor table. The buffers hold a packet
    // that would be answered with an RST, so only the chains can be at fault.
    g.mem
        .write_slice(&hdr(1, 2, Op::Rw).to_bytes(), GuestAddress(SPARE_BASE))
        .unwrap();
    let slot = 200;
    g.tx_free.retain(|s| !(slot..slot + 5).contains(s));
    g.post(1, slot, &[raw(MEM_SIZE as u64 - 8, 44, 0, 0)]);
    g.post(1, slot + 1, &[raw(u64::MAX - 10, 44, 0, 0)]);
    g.post(
        1,
        slot + 2,
        &[raw(SPARE_BASE, 44, VRING_DESC_F_WRITE as u16, 0)],
    );
    g.post(
        1,
        slot + 3,
        &[raw(SPARE_BASE, 44, VRING_DESC_F_NEXT as u16, slot + 3)],
    );
    g.post(
        1,
        slot + 4,
        &[raw(SPARE_BASE, 44, VRING_DESC_F_NEXT as u16, QSIZE + 10)],
    );
    assert_eq!(g.dev.process_queue(1), QueueProgress::Done);
    g.assert_quiet();
    // The device still works.
    let (mut client, local) = g.host_connect(11);
    g.send_op(11, local, Op::Rw, b"ok");
    let mut b = [0u8; 2];
    client.read_exact(&mut b).unwrap();
    assert!(g.dev.is_active());
    assert_eq!(g.dev.process_queue(7), QueueProgress::Done);
}

/// xorshift64*, std-only.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn random_tx_packets_never_panic() {
    let mut g = Guest::new();
    // A live connection for random packets to hit.
    let (_client, local) = g.host_connect(3);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for round in 0..3000 {
        let len = rng.below(200) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if len >= HDR_LEN && rng.below(4) != 0 {
            // Mostly well-addressed, so the muxer sees them.
            let mut h = Header::from_bytes(bytes[..HDR_LEN].try_into().unwrap());
            h.src_cid = CID;
            h.dst_cid = HOST_CID;
            if rng.below(2) == 0 {
                h.type_ = TYPE_STREAM;
                h.op = rng.below(9) as u16;
            }
            if rng.below(2) == 0 {
                h.src_port = 3;
                h.dst_port = local;
            } else {
                h.src_port = rng.below(4) as u32;
                h.dst_port = 1234 + rng.below(4) as u32;
            }
            if rng.below(2) == 0 {
                h.len = (len - HDR_LEN) as u32;
            }
            bytes[..HDR_LEN].copy_from_slice(&h.to_bytes());
        }
        g.send_raw(&bytes);
        if round % 64 == 0 {
            g.poll_rx();
            g.received.clear();
        }
    }
    // Also random descriptor chains.
    for _ in 0..200 {
        g.reclaim_tx();
        let Some(slot) = g.tx_free.pop() else {
            break;
        };
        let addr = rng.next() % (MEM_SIZE as u64 * 2);
        let flags = (rng.below(4) as u16) & (VRING_DESC_F_WRITE as u16);
        g.post(
            1,
            slot,
            &[raw(addr, rng.next() as u32 % 0x2_0000, flags, 0)],
        );
        assert_eq!(g.dev.process_queue(1), QueueProgress::Done);
    }
    // The guest drops the live connection (if the random packets left it alive), so
    // the device can only still owe RSTs for the random packets, and those come
    // before the probe's.
    g.send_op(3, local, Op::Rst, &[]);
    g.probe();
    g.assert_quiet();
    assert!(g.dev.is_active(), "the worker died");
    let (mut client, local) = g.host_connect(4);
    g.send_op(4, local, Op::Rw, b"alive");
    let mut b = [0u8; 5];
    client.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"alive");
}

#[test]
fn reset_stops_the_worker_and_closes_connections() {
    let mut g = Guest::new();
    let (mut client, _) = g.host_connect(5);
    g.dev.reset();
    assert!(!g.dev.is_active());
    assert_closed(&mut client);
    // The listener survives for the next activation.
    let path = g.path();
    assert!(path.exists());
    let dir = TempDir::new();
    let dev = std::mem::replace(&mut g.dev, Vsock::new(CID, &dir.0.join("x")).unwrap());
    let mut g2 = Guest::with_device(dir, dev);
    let (_c, _) = g2.host_connect(6);
    drop(g);
}
