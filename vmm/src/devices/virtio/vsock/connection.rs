//! One vsock stream between a guest port and a host Unix socket: the connection
//! state machine and credit-based flow control (virtio 1.2, 5.10.6.3).
//!
//! Counters (all wrapping `u32`, as in the spec):
//! - `rx_cnt`: payload bytes sent to the guest; with the guest's `buf_alloc` and
//!   `fwd_cnt` it bounds what we may still send.
//! - `recv_cnt`: payload bytes received from the guest.
//! - `fwd_cnt`: of those, bytes written to the Unix socket. The guest may have at
//!   most `BUF_ALLOC` bytes outstanding (`recv_cnt - fwd_cnt`), so the per-connection
//!   host buffer is bounded, and while the socket is not writable `fwd_cnt` stops
//!   moving and the guest runs out of credit.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use vmm_sys_util::epoll::EventSet;

use super::packet::{Header, Op, TxPacket, SHUTDOWN_RCV, SHUTDOWN_SEND};

/// The receive buffer we advertise to the guest: the most guest→host bytes buffered
/// per connection.
pub const BUF_ALLOC: u32 = 256 * 1024;
/// The host-bound buffer's capacity a connection keeps once it is drained.
const TX_BUF_KEPT: usize = 16 * 1024;
/// Forwarded bytes after which we tell the guest about the freed space unprompted.
pub const CREDIT_UPDATE_THRESHOLD: u32 = BUF_ALLOC / 4;

const PENDING_RST: u8 = 1;
const PENDING_REQUEST: u8 = 2;
const PENDING_RESPONSE: u8 = 4;
const PENDING_SHUTDOWN: u8 = 8;
const PENDING_CREDIT_UPDATE: u8 = 16;
const PENDING_SHUTDOWN_SEND: u8 = 32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConnectionError {
    #[error("guest sent {len} bytes with only {free} bytes of credit")]
    CreditExceeded { len: u32, free: u32 },
    #[error("unexpected {op:?} in state {state:?}")]
    UnexpectedOp { op: Op, state: State },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// The host asked the guest to connect (OP_REQUEST) and awaits OP_RESPONSE.
    LocalInit,
    /// Data flows.
    Established,
    /// An RST or SHUTDOWN+RST is on its way to the guest; then the connection dies.
    Closing,
}

pub struct Connection {
    pub local_port: u32,
    pub peer_port: u32,
    pub stream: UnixStream,
    /// The epoll token of `stream`.
    pub token: u64,
    state: State,
    guest_cid: u64,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    rx_cnt: Wrapping<u32>,
    recv_cnt: Wrapping<u32>,
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,
    /// Bytes waiting for the Unix socket: first `prefix` bytes the device made up
    /// (the `OK <port>\n` line), then guest payload.
    tx_buf: VecDeque<u8>,
    prefix: usize,
    pending: u8,
    peer_shutdown: u32,
    write_shut: bool,
    /// The host shut down its sending side (read returned 0 without a hang-up): the
    /// guest is told it gets no more, and may still send.
    host_eof: bool,
    /// epoll said the socket is readable (or hung up) and we have not drained it.
    pub readable: bool,
    /// The socket hung up: it was taken out of epoll, reads continue until EOF.
    pub hup: bool,
    /// In the muxer's ready list.
    pub in_rx_ready: bool,
    /// The interest currently registered with epoll (None: not registered).
    pub registered: Option<EventSet>,
    /// The final RST went out: remove the connection.
    pub dead: bool,
    /// The guest opened it (to a host service), not a host client.
    pub opened_by_guest: bool,
}

impl Connection {
    fn new(
        guest_cid: u64,
        local_port: u32,
        peer_port: u32,
        stream: UnixStream,
        token: u64,
        state: State,
        pending: u8,
    ) -> Self {
        Self {
            local_port,
            peer_port,
            stream,
            token,
            state,
            guest_cid,
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            rx_cnt: Wrapping(0),
            recv_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            tx_buf: VecDeque::new(),
            prefix: 0,
            pending,
            peer_shutdown: 0,
            write_shut: false,
            host_eof: false,
            readable: false,
            hup: false,
            in_rx_ready: false,
            registered: None,
            dead: false,
            opened_by_guest: false,
        }
    }

    /// A host client asked for guest port `peer_port`: send OP_REQUEST.
    pub fn new_local(
        guest_cid: u64,
        local_port: u32,
        peer_port: u32,
        stream: UnixStream,
        token: u64,
    ) -> Self {
        Self::new(
            guest_cid,
            local_port,
            peer_port,
            stream,
            token,
            State::LocalInit,
            PENDING_REQUEST,
        )
    }

    /// The guest connected (OP_REQUEST `req`) and the host socket is open: answer
    /// OP_RESPONSE.
    pub fn new_peer(guest_cid: u64, req: &Header, stream: UnixStream, token: u64) -> Self {
        let mut conn = Self::new(
            guest_cid,
            req.dst_port,
            req.src_port,
            stream,
            token,
            State::Established,
            PENDING_RESPONSE,
        );
        conn.peer_buf_alloc = req.buf_alloc;
        conn.peer_fwd_cnt = Wrapping(req.fwd_cnt);
        conn.opened_by_guest = true;
        conn
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// Bytes from the guest not yet written to the host socket.
    pub fn unwritten(&self) -> usize {
        self.tx_buf.len() - self.prefix
    }

    /// Bytes the guest can still take.
    pub fn peer_free(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn can_send_data(&self) -> bool {
        self.state == State::Established
            && !self.host_eof
            && self.peer_shutdown & SHUTDOWN_RCV == 0
            && self.peer_free() > 0
    }

    /// Something to put in the guest's rx queue.
    pub fn wants_rx(&self) -> bool {
        self.pending != 0 || (self.readable && self.can_send_data())
    }

    /// What to poll the socket for.
    pub fn desired_interest(&self) -> EventSet {
        let mut set = EventSet::empty();
        if !self.readable && self.can_send_data() {
            set |= EventSet::IN;
        }
        if !self.tx_buf.is_empty() {
            set |= EventSet::OUT;
        }
        set
    }

    /// Resets the connection: only an RST goes to the guest, then it dies.
    pub fn reset(&mut self) {
        self.state = State::Closing;
        self.pending = PENDING_RST;
    }

    /// epoll says the host socket hung up. After a half close that is the end (the
    /// data before it was read); otherwise what is left is read first, up to EOF.
    pub fn hung_up(&mut self) {
        self.hup = true;
        self.readable = true;
        self.close_if_drained();
    }

    /// After a hang-up, what is left is read up to EOF; once there is nothing more
    /// the guest can be given (EOF was read, or the guest shut its receiving side),
    /// the connection closes. Without this, a socket out of epoll that is never read
    /// again would hold its connection until the guest closed it.
    fn close_if_drained(&mut self) {
        if self.hup && (self.host_eof || self.peer_shutdown & SHUTDOWN_RCV != 0) {
            self.host_closed();
        }
    }

    /// The host socket takes no more (its reader is gone): what the guest sent, and
    /// sends from now on, is dropped, its credit given back. What the host wrote
    /// before it went is still in the socket, so this is a hang-up, not the end: an
    /// answer written just before the host closed still reaches the guest.
    fn host_stopped_reading(&mut self) {
        let dropped = self.unwritten();
        tracing::debug!(
            "vsock: {}:{}: the host socket takes no more ({dropped} bytes from the guest dropped)",
            self.local_port,
            self.peer_port,
        );
        // At most BUF_ALLOC.
        self.fwd_cnt += dropped as u32;
        self.tx_buf.clear();
        self.prefix = 0;
        self.hung_up();
        // Nothing left to read: the end, at once. (Something left, for a guest that
        // takes nothing now: it comes once the guest reads, then the end.)
        if self.state != State::Closing && at_end_of_stream(&self.stream) {
            self.host_closed();
        }
    }

    /// The host shut down its sending side (a hang-up says when it closes for good):
    /// SHUTDOWN(SEND) tells the guest, whose answers still reach the host.
    fn host_half_closed(&mut self) {
        self.host_eof = true;
        self.readable = false;
        if self.state != State::Closing {
            self.pending |= PENDING_SHUTDOWN_SEND;
        }
    }

    /// The host side went away: tell the guest with SHUTDOWN, then RST.
    fn host_closed(&mut self) {
        tracing::debug!(
            "vsock: {}:{}: the host socket closed ({} bytes from the guest unwritten)",
            self.local_port,
            self.peer_port,
            self.unwritten()
        );
        if self.state != State::Closing {
            self.state = State::Closing;
            self.pending = PENDING_SHUTDOWN | PENDING_RST;
        }
        self.readable = false;
        self.tx_buf.clear();
        self.prefix = 0;
    }

    /// A packet from the guest for this connection (RST is handled by the muxer).
    pub fn handle_guest(&mut self, pkt: &TxPacket, op: Op) -> Result<(), ConnectionError> {
        if self.state == State::Closing {
            return Ok(());
        }
        self.peer_buf_alloc = pkt.hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(pkt.hdr.fwd_cnt);
        let unexpected = |state| Err(ConnectionError::UnexpectedOp { op, state });
        match (self.state, op) {
            (State::LocalInit, Op::Response) => {
                self.state = State::Established;
                let line = format!("OK {}\n", self.local_port);
                self.prefix = line.len();
                self.tx_buf.extend(line.as_bytes());
                self.flush_tx();
                Ok(())
            }
            (State::Established, Op::Rw) => {
                if self.peer_shutdown & SHUTDOWN_SEND != 0 {
                    return unexpected(self.state);
                }
                let outstanding = (self.recv_cnt - self.fwd_cnt).0;
                let free = BUF_ALLOC.saturating_sub(outstanding);
                if pkt.hdr.len > free {
                    return Err(ConnectionError::CreditExceeded {
                        len: pkt.hdr.len,
                        free,
                    });
                }
                self.reserve_tx(pkt.data.len());
                self.tx_buf.extend(&pkt.data);
                self.recv_cnt += pkt.hdr.len;
                self.flush_tx();
                Ok(())
            }
            (State::Established, Op::CreditUpdate) => Ok(()),
            (State::Established, Op::CreditRequest) => {
                self.pending |= PENDING_CREDIT_UPDATE;
                Ok(())
            }
            (State::Established, Op::Shutdown) => {
                self.peer_shutdown |= pkt.hdr.flags & (SHUTDOWN_RCV | SHUTDOWN_SEND);
                self.check_shutdown();
                self.close_if_drained();
                Ok(())
            }
            (state, _) => unexpected(state),
        }
    }

    /// Acts on the guest's shutdown flags once everything it sent reached the host.
    fn check_shutdown(&mut self) {
        if !self.tx_buf.is_empty() || self.state != State::Established {
            return;
        }
        if self.peer_shutdown == SHUTDOWN_RCV | SHUTDOWN_SEND {
            // The guest is closing; it waits for our RST.
            self.state = State::Closing;
            self.pending = PENDING_RST;
        } else if self.peer_shutdown & SHUTDOWN_SEND != 0 && !self.write_shut {
            self.write_shut = true;
            if let Err(e) = self.stream.shutdown(Shutdown::Write) {
                tracing::debug!("vsock: shutdown of host socket failed: {e}");
            }
        }
    }

    /// Makes room for `more` host-bound bytes, doubling as `VecDeque` would but never
    /// past what the credit lets the guest send (`BUF_ALLOC`, and the "OK" line before
    /// it): doubling alone takes a full buffer to twice that, which the guest can have
    /// every connection hold while the host side does not read.
    fn reserve_tx(&mut self, more: usize) {
        let (len, capacity) = (self.tx_buf.len(), self.tx_buf.capacity());
        let needed = len + more;
        if needed <= capacity {
            return;
        }
        let most = BUF_ALLOC as usize + self.prefix;
        let target = needed.max(capacity.saturating_mul(2).min(most));
        self.tx_buf.reserve_exact(target - len);
    }

    /// Writes as much of the host-bound buffer as the socket takes.
    pub fn flush_tx(&mut self) {
        while !self.tx_buf.is_empty() {
            let (front, _) = self.tx_buf.as_slices();
            match self.stream.write(front) {
                Ok(0) => {
                    self.host_stopped_reading();
                    break;
                }
                Ok(n) => {
                    self.tx_buf.drain(..n);
                    let from_prefix = n.min(self.prefix);
                    self.prefix -= from_prefix;
                    // n - from_prefix <= BUF_ALLOC.
                    self.fwd_cnt += (n - from_prefix) as u32;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!("vsock: write to host socket failed: {e}");
                    self.host_stopped_reading();
                    break;
                }
            }
        }
        if self.tx_buf.is_empty() && self.tx_buf.capacity() > TX_BUF_KEPT {
            // A burst's buffer (up to BUF_ALLOC and the reply line) is not kept for a
            // connection's whole life: 1024 idle connections would hold 256 MiB.
            self.tx_buf = VecDeque::new();
        }
        if (self.fwd_cnt - self.last_fwd_cnt_sent).0 >= CREDIT_UPDATE_THRESHOLD {
            self.pending |= PENDING_CREDIT_UPDATE;
        }
        self.check_shutdown();
    }

    fn header(&mut self, op: Op) -> Header {
        let mut hdr = Header::to_guest(self.guest_cid, self.local_port, self.peer_port, op);
        hdr.buf_alloc = BUF_ALLOC;
        hdr.fwd_cnt = self.fwd_cnt.0;
        self.last_fwd_cnt_sent = self.fwd_cnt;
        self.pending &= !PENDING_CREDIT_UPDATE;
        hdr
    }

    /// The next packet for the guest: a control packet, or data read from the socket
    /// into `buf` (at most the guest's credit). Returns the header and payload length.
    pub fn produce(&mut self, buf: &mut [u8]) -> Option<(Header, usize)> {
        if self.pending & PENDING_SHUTDOWN != 0 {
            self.pending &= !(PENDING_SHUTDOWN | PENDING_SHUTDOWN_SEND);
            let mut hdr = self.header(Op::Shutdown);
            hdr.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
            return Some((hdr, 0));
        }
        if self.pending & PENDING_RST != 0 {
            self.pending = 0;
            self.dead = true;
            return Some((self.header(Op::Rst), 0));
        }
        if self.pending & PENDING_REQUEST != 0 {
            self.pending &= !PENDING_REQUEST;
            return Some((self.header(Op::Request), 0));
        }
        if self.pending & PENDING_RESPONSE != 0 {
            self.pending &= !PENDING_RESPONSE;
            return Some((self.header(Op::Response), 0));
        }
        if self.readable && self.can_send_data() {
            let n = buf.len().min(self.peer_free() as usize);
            if n > 0 {
                match self.stream.read(&mut buf[..n]) {
                    Ok(0) if self.hup => {
                        self.host_closed();
                        return self.produce(buf);
                    }
                    Ok(0) => {
                        self.host_half_closed();
                        return self.produce(buf);
                    }
                    Ok(k) => {
                        // k <= n <= peer_free, a u32.
                        self.rx_cnt += k as u32;
                        return Some((self.header(Op::Rw), k));
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if self.hup {
                            // A hung-up socket with nothing to read is closed.
                            self.host_closed();
                            return self.produce(buf);
                        }
                        self.readable = false;
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::debug!("vsock: read from host socket failed: {e}");
                        self.host_closed();
                        return self.produce(buf);
                    }
                }
            }
        }
        if self.pending & PENDING_SHUTDOWN_SEND != 0 {
            self.pending &= !PENDING_SHUTDOWN_SEND;
            let mut hdr = self.header(Op::Shutdown);
            hdr.flags = SHUTDOWN_SEND;
            return Some((hdr, 0));
        }
        if self.pending & PENDING_CREDIT_UPDATE != 0 {
            return Some((self.header(Op::CreditUpdate), 0));
        }
        None
    }
}

/// Whether the non-blocking `stream` holds nothing more to read and its writer is
/// gone: a peek (recvfrom, which the VMM's seccomp filter allows; FIONREAD it does
/// not) reads 0.
fn at_end_of_stream(stream: &UnixStream) -> bool {
    let mut byte = 0u8;
    // SAFETY: recv writes at most one byte, into a live local; MSG_PEEK leaves it in
    // the socket, MSG_DONTWAIT keeps the call from blocking.
    let read = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            std::ptr::from_mut(&mut byte).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    read == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::vsock::packet::{HOST_CID, TYPE_STREAM};

    fn pkt(op: Op, flags: u32, data: &[u8], buf_alloc: u32, fwd_cnt: u32) -> TxPacket {
        TxPacket {
            hdr: Header {
                src_cid: 3,
                dst_cid: HOST_CID,
                src_port: 52,
                dst_port: 1024,
                len: data.len() as u32,
                type_: TYPE_STREAM,
                op: op as u16,
                flags,
                buf_alloc,
                fwd_cnt,
            },
            data: data.to_vec(),
        }
    }

    fn established(peer_buf: u32) -> (Connection, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut c = Connection::new_local(3, 1024, 52, a, 7);
        let mut buf = [0u8; 16];
        let (h, _) = c.produce(&mut buf).unwrap();
        assert_eq!(h.op, Op::Request as u16);
        c.handle_guest(&pkt(Op::Response, 0, &[], peer_buf, 0), Op::Response)
            .unwrap();
        let mut line = [0u8; 8];
        (&b).read_exact(&mut line).unwrap();
        assert_eq!(&line, b"OK 1024\n");
        (c, b)
    }

    #[test]
    fn credit_bounds_host_to_guest_data() {
        let (mut c, mut b) = established(10);
        b.write_all(&[7u8; 100]).unwrap();
        c.readable = true;
        let mut buf = [0u8; 64];
        let (h, n) = c.produce(&mut buf).unwrap();
        assert_eq!((h.op, n), (Op::Rw as u16, 10));
        assert_eq!(c.peer_free(), 0);
        assert!(!c.wants_rx());
        assert!(!c.desired_interest().contains(EventSet::IN));
        // The guest consumed 10 and grows its buffer.
        c.handle_guest(&pkt(Op::CreditUpdate, 0, &[], 30, 10), Op::CreditUpdate)
            .unwrap();
        assert_eq!(c.peer_free(), 30);
        assert!(c.wants_rx());
        let (_, n) = c.produce(&mut buf).unwrap();
        assert_eq!(n, 30);
        // A lying fwd_cnt beyond what we sent gives no credit.
        c.handle_guest(&pkt(Op::CreditUpdate, 0, &[], 30, 1000), Op::CreditUpdate)
            .unwrap();
        assert_eq!(c.peer_free(), 0);
    }

    #[test]
    fn guest_data_is_bounded_and_acknowledged_only_when_forwarded() {
        let (mut c, b) = established(4096);
        let chunk = vec![1u8; 64 * 1024];
        let mut sent = 0u32;
        // The socket buffer fills up, then our buffer; fwd_cnt only counts what the
        // socket took.
        while sent + chunk.len() as u32 <= BUF_ALLOC {
            c.handle_guest(&pkt(Op::Rw, 0, &chunk, 4096, 0), Op::Rw)
                .unwrap();
            sent += chunk.len() as u32;
        }
        let mut buf = [0u8; 16];
        // Whatever credit update is pending reports only forwarded bytes.
        while let Some((h, _)) = c.produce(&mut buf) {
            assert!(h.fwd_cnt <= sent);
        }
        let buffered = (c.recv_cnt - c.fwd_cnt).0;
        assert!(buffered as usize == c.tx_buf.len());
        assert!(c.tx_buf.len() <= BUF_ALLOC as usize);
        if buffered > 0 {
            assert!(c.desired_interest().contains(EventSet::OUT));
            // Sending beyond the credit is refused.
            let over = vec![0u8; (BUF_ALLOC - buffered + 1) as usize];
            assert!(matches!(
                c.handle_guest(&pkt(Op::Rw, 0, &over, 4096, 0), Op::Rw),
                Err(ConnectionError::CreditExceeded { .. })
            ));
        }
        drop(b);
    }

    /// While the host side reads nothing, the guest may fill a connection's buffer to
    /// its credit, in packets of any size: the buffer's room stays within the credit
    /// (doubling from 3 KiB steps had it at 385 KiB for 255 KiB held).
    #[test]
    fn a_full_buffer_takes_no_more_room_than_the_credit() {
        let (a, _b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        while (&a).write(&[0u8; 4096]).is_ok() {}
        let mut c = Connection::new_local(3, 1024, 52, a, 7);
        let mut buf = [0u8; 16];
        c.produce(&mut buf).unwrap();
        c.handle_guest(&pkt(Op::Response, 0, &[], 4096, 0), Op::Response)
            .unwrap();
        let chunk = vec![1u8; 3 * 1024];
        for _ in 0..BUF_ALLOC as usize / chunk.len() {
            c.handle_guest(&pkt(Op::Rw, 0, &chunk, 4096, 0), Op::Rw)
                .unwrap();
        }
        let most = BUF_ALLOC as usize + c.prefix;
        assert!(c.tx_buf.len() > most - chunk.len(), "{}", c.tx_buf.len());
        assert!(
            c.tx_buf.capacity() <= most,
            "{} bytes of room for at most {most}",
            c.tx_buf.capacity()
        );
    }

    /// A burst the host socket could not take at once is buffered, and the buffer
    /// goes once the socket took it all.
    #[test]
    fn a_drained_burst_does_not_keep_its_buffer() {
        let (mut c, mut b) = established(4096);
        let chunk = vec![1u8; 64 * 1024];
        for _ in 0..4 {
            c.handle_guest(&pkt(Op::Rw, 0, &chunk, 4096, 0), Op::Rw)
                .unwrap();
        }
        assert!(
            !c.tx_buf.is_empty(),
            "the socket took the whole burst at once"
        );
        assert!(c.tx_buf.capacity() > TX_BUF_KEPT);
        let most = BUF_ALLOC as usize + c.prefix;
        assert!(
            c.tx_buf.capacity() <= most,
            "a full buffer holds {} bytes of room, past the {most} the credit allows",
            c.tx_buf.capacity()
        );
        let mut received = vec![0u8; 4 * chunk.len()];
        let reader = std::thread::spawn(move || {
            b.read_exact(&mut received).unwrap();
            b
        });
        while !c.tx_buf.is_empty() {
            c.flush_tx();
            std::thread::yield_now();
        }
        let _b = reader.join().unwrap();
        assert!(
            c.tx_buf.capacity() <= TX_BUF_KEPT,
            "{}",
            c.tx_buf.capacity()
        );
    }

    #[test]
    fn shutdown_and_credit_request() {
        let (mut c, b) = established(4096);
        let mut buf = [0u8; 16];
        c.handle_guest(&pkt(Op::CreditRequest, 0, &[], 4096, 0), Op::CreditRequest)
            .unwrap();
        let (h, _) = c.produce(&mut buf).unwrap();
        assert_eq!(h.op, Op::CreditUpdate as u16);
        assert_eq!(h.buf_alloc, BUF_ALLOC);
        c.handle_guest(
            &pkt(Op::Shutdown, SHUTDOWN_RCV | SHUTDOWN_SEND, &[], 4096, 0),
            Op::Shutdown,
        )
        .unwrap();
        let (h, _) = c.produce(&mut buf).unwrap();
        assert_eq!(h.op, Op::Rst as u16);
        assert!(c.dead);
        drop(b);
    }

    #[test]
    fn a_host_hang_up_gives_shutdown_then_rst() {
        let (mut c, b) = established(4096);
        drop(b);
        c.hung_up();
        let mut buf = [0u8; 16];
        let (h, _) = c.produce(&mut buf).unwrap();
        assert_eq!(h.op, Op::Shutdown as u16);
        assert_eq!(h.flags, SHUTDOWN_RCV | SHUTDOWN_SEND);
        let (h, _) = c.produce(&mut buf).unwrap();
        assert_eq!(h.op, Op::Rst as u16);
        assert!(c.dead);
        assert!(c.produce(&mut buf).is_none());
    }

    /// The host answers and closes while the guest is still sending: the guest's
    /// bytes cannot be written any more, but the answer must still reach it, before
    /// the SHUTDOWN and RST, and the dropped bytes' credit is given back.
    #[test]
    fn an_answer_written_before_the_host_closed_reaches_a_guest_still_sending() {
        let (mut c, mut b) = established(4096);
        b.write_all(b"answer").unwrap();
        drop(b);
        c.handle_guest(&pkt(Op::Rw, 0, b"more", 4096, 0), Op::Rw)
            .unwrap();
        assert_eq!(c.unwritten(), 0);
        let mut buf = [0u8; 16];
        let (h, n) = c.produce(&mut buf).unwrap();
        assert_eq!((h.op, &buf[..n]), (Op::Rw as u16, &b"answer"[..]));
        assert_eq!(h.fwd_cnt, 4, "the dropped bytes' credit");
        let (h, _) = c.produce(&mut buf).unwrap();
        assert_eq!(h.op, Op::Shutdown as u16);
        let (h, _) = c.produce(&mut buf).unwrap();
        assert_eq!(h.op, Op::Rst as u16);
        assert!(c.dead);
    }

    /// A guest that takes nothing now (no credit) and keeps sending to a host that
    /// closed with nothing more to say is told at once: no answer waits for it.
    #[test]
    fn a_guest_without_credit_learns_at_once_that_the_host_closed() {
        let (mut c, b) = established(0);
        drop(b);
        c.handle_guest(&pkt(Op::Rw, 0, b"more", 0, 0), Op::Rw)
            .unwrap();
        let mut buf = [0u8; 16];
        let (h, _) = c.produce(&mut buf).unwrap();
        assert_eq!(h.op, Op::Shutdown as u16);
        let (h, _) = c.produce(&mut buf).unwrap();
        assert_eq!(h.op, Op::Rst as u16);
    }

    /// A guest that shut its receiving side is given nothing more, so a host hang-up,
    /// before or after that, ends the connection at once.
    #[test]
    fn a_host_hang_up_ends_a_connection_whose_guest_takes_nothing() {
        for hang_up_first in [false, true] {
            let (mut c, b) = established(4096);
            drop(b);
            let shut_receiving = pkt(Op::Shutdown, SHUTDOWN_RCV, &[], 4096, 0);
            if hang_up_first {
                c.hung_up();
                c.handle_guest(&shut_receiving, Op::Shutdown).unwrap();
            } else {
                c.handle_guest(&shut_receiving, Op::Shutdown).unwrap();
                c.hung_up();
            }
            let mut buf = [0u8; 16];
            let (h, _) = c.produce(&mut buf).unwrap();
            assert_eq!(h.op, Op::Shutdown as u16, "hang-up first: {hang_up_first}");
            let (h, _) = c.produce(&mut buf).unwrap();
            assert_eq!(h.op, Op::Rst as u16, "hang-up first: {hang_up_first}");
        }
    }

    #[test]
    fn unexpected_ops() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut c = Connection::new_local(3, 1024, 52, a, 7);
        assert!(c
            .handle_guest(&pkt(Op::Rw, 0, b"x", 4096, 0), Op::Rw)
            .is_err());
        let (mut c, _b) = established(4096);
        assert!(c
            .handle_guest(&pkt(Op::Request, 0, &[], 4096, 0), Op::Request)
            .is_err());
    }
}
