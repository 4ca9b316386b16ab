//! Relays bytes between two streams (a port relay, a proxy's tunnel, the guest's
//! connection to a host service).
//!
//! Each way runs on its own until its source ends, then passes that end on as a
//! half-close. `tokio::io::copy_bidirectional` instead returns at the first error in
//! either way and drops both streams: a server that answers and closes while its
//! client is still sending (an upload refused early, a command that exits before
//! reading all its input) breaks the client's way, and the answer, already read by
//! the relay or waiting in the socket, was lost with it.
//!
//! A source that fails under a read (a reset, most often) is not an end of stream:
//! passed on as one, a response cut short by a crashed server would look complete to
//! the client. [`both_ways`] then stops both ways at once without closing anything,
//! and [`Relayed::broken`] says which side broke, so that a caller that owns the
//! other side's socket can pass that on ([`pass_on_break`]: a reset, unless what the
//! relay wrote is still queued for its peer).

use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// How long [`pass_on_break`] waits, after its end of stream, for the peer to take
/// what is queued for it and close.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// How [`pass_on_break`] ended a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// With a reset: nothing was queued for the peer.
    Reset,
    /// With an ordinary end of stream after what was queued for the peer, which a
    /// reset would have thrown away (an answer the server sent before it broke off).
    EndAfterQueued,
}

/// Ends `stream`, one side of a relay whose other side broke ([`Relayed::broken`]),
/// so that its peer learns that the stream broke: with a reset (`SO_LINGER` 0, then
/// the close), when nothing the relay wrote to it is still queued for its peer
/// (`TIOCOUTQ` 0, or unknown). A reset throws away what is queued, though: an answer
/// the server sent before it broke off (a `413` to an upload it did not read) would
/// be lost. Then the stream ends as an ordinary end of stream after what is queued,
/// and what the peer still sends is read and dropped until it closes, for at most
/// [`DRAIN_TIMEOUT`]: a close with unread data would itself send a reset.
pub async fn pass_on_break(stream: TcpStream) -> Ending {
    if queued_for_peer(&stream).unwrap_or(0) == 0 {
        // The close below is then a reset.
        let _ = stream.set_zero_linger();
        return Ending::Reset;
    }
    end_after_unread(stream).await;
    Ending::EndAfterQueued
}

/// Ends `stream` with an ordinary end of stream after what is queued for its peer,
/// then reads and drops what the peer still sends until it closes, for at most
/// [`DRAIN_TIMEOUT`]. For a side of a relay whose peer was still sending when the
/// other side stopped taking it ([`Relayed::unread`]: a server that answered an
/// upload early and closed): a TCP stream closed with unread data resets its
/// connection, and the reset can throw away what was still queued for the peer, that
/// answer.
pub async fn end_after_unread<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S) {
    // Queues the end of stream after the data (done already if the relay ended this
    // way: then it fails, harmlessly).
    let _ = stream.shutdown().await;
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, drain(&mut stream)).await;
}

/// Ends `stream`, the side `side` of the relay that ended as `relayed` (a TCP socket
/// its caller lent it), so that its peer learns what happened: [`pass_on_break`] if
/// the other side broke, [`end_after_unread`] if `stream` still holds what its peer
/// sent; else the relay ended it already, and it is only closed.
pub async fn end_side(stream: TcpStream, side: Side, relayed: &Relayed) {
    if relayed.broken() == Some(side.other()) {
        pass_on_break(stream).await;
    } else if relayed.broken().is_none() && relayed.unread() == Some(side) {
        end_after_unread(stream).await;
    }
}

/// How many bytes written to `stream` its peer has not acknowledged yet (`TIOCOUTQ`).
fn queued_for_peer(stream: &TcpStream) -> io::Result<usize> {
    let mut queued: libc::c_int = 0;
    // SAFETY: TIOCOUTQ on a TCP socket writes one int to the pointer, which points to
    // `queued`, alive for the call; the descriptor is `stream`'s, open while borrowed.
    let done = unsafe { libc::ioctl(stream.as_raw_fd(), libc::TIOCOUTQ, &mut queued) };
    if done != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(queued).unwrap_or(0))
}

/// What each way copies at a time: the most a relay holds per way.
const CHUNK: usize = 8 * 1024;

/// Why a way ended other than by its source's end, as the payload of its
/// [`io::Error`] (whose kind is that of the failure itself).
#[derive(Debug, thiserror::Error)]
pub enum WayError {
    /// Reading the way's source failed: that side's stream is broken.
    #[error("reading: {0}")]
    Read(io::Error),
    /// The other way's source failed, which stopped this way too.
    #[error("stopped: the other side's stream broke")]
    Stopped,
}

/// One of the two streams given to [`both_ways`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    A,
    B,
}

impl Side {
    fn other(self) -> Side {
        match self {
            Side::A => Side::B,
            Side::B => Side::A,
        }
    }
}

/// How each way of a relay ended: the bytes it carried, or what broke it.
#[derive(Debug)]
pub struct Relayed {
    pub a_to_b: io::Result<u64>,
    pub b_to_a: io::Result<u64>,
}

impl Relayed {
    /// What broke the relay, if a way broke: a side's broken stream first, for the
    /// way it stopped says only that.
    pub fn error(&self) -> Option<&io::Error> {
        let a_to_b = self.a_to_b.as_ref().err();
        let b_to_a = self.b_to_a.as_ref().err();
        let read_failure = |e: &&io::Error| is_read_failure(e);
        a_to_b
            .filter(read_failure)
            .or(b_to_a.filter(read_failure))
            .or(a_to_b)
            .or(b_to_a)
    }

    /// The side whose stream failed under a read (a reset, most often), if one did:
    /// the relay then did not tell the other side the stream ended. Closing the other
    /// side would tell its peer just that; a caller that owns that socket resets it
    /// instead, so the peer learns the stream broke.
    pub fn broken(&self) -> Option<Side> {
        if source_failed(&self.a_to_b) {
            Some(Side::A)
        } else if source_failed(&self.b_to_a) {
            Some(Side::B)
        } else {
            None
        }
    }

    /// The side whose way stopped because the other side took no more (a write
    /// failed: a server that answered and closed while its client still sent), if
    /// one did: its stream may still hold what its peer sent, unread. Closed so, a TCP
    /// stream resets its connection, which can throw away the answer the relay wrote
    /// to it last; a caller that owns it ends it with [`end_after_unread`].
    pub fn unread(&self) -> Option<Side> {
        if write_failed(&self.a_to_b) {
            Some(Side::A)
        } else if write_failed(&self.b_to_a) {
            Some(Side::B)
        } else {
            None
        }
    }
}

/// Whether `way` ended because writing to its destination failed.
fn write_failed(way: &io::Result<u64>) -> bool {
    way.as_ref().err().is_some_and(|e| {
        e.get_ref()
            .is_none_or(|inner| inner.downcast_ref::<WayError>().is_none())
    })
}

fn is_read_failure(error: &io::Error) -> bool {
    error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<WayError>())
        .is_some_and(|e| matches!(e, WayError::Read(_)))
}

fn read_failed(error: io::Error) -> io::Error {
    io::Error::new(error.kind(), WayError::Read(error))
}

fn stopped() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, WayError::Stopped)
}

/// Whether `way` ended because its source failed.
fn source_failed(way: &io::Result<u64>) -> bool {
    way.as_ref().err().is_some_and(is_read_failure)
}

/// Relays `a` and `b` until both ways have ended, or until either side's stream
/// fails under a read: then both ways stop at once, and neither side is told the
/// stream ended (see [`Relayed::broken`]). Pass `&mut stream` to keep a stream for
/// that.
pub async fn both_ways<A, B>(a: A, b: B) -> Relayed
where
    A: AsyncRead + AsyncWrite,
    B: AsyncRead + AsyncWrite,
{
    let (a_reader, a_writer) = tokio::io::split(a);
    let (b_reader, b_writer) = tokio::io::split(b);
    // Each way's end, for the other: a way whose destination took no more drains its
    // source until then (see `way`).
    let (a_to_b_done, b_to_a_done) = (Notify::new(), Notify::new());
    let a_to_b = way(a_reader, b_writer, b_to_a_done.notified());
    let b_to_a = way(b_reader, a_writer, a_to_b_done.notified());
    tokio::pin!(a_to_b, b_to_a);
    let (mut a_to_b_ended, mut b_to_a_ended) = (None, None);
    loop {
        tokio::select! {
            ended = &mut a_to_b, if a_to_b_ended.is_none() => {
                if source_failed(&ended) {
                    return Relayed {
                        a_to_b: ended,
                        b_to_a: b_to_a_ended.unwrap_or_else(|| Err(stopped())),
                    };
                }
                a_to_b_done.notify_one();
                a_to_b_ended = Some(ended);
            }
            ended = &mut b_to_a, if b_to_a_ended.is_none() => {
                if source_failed(&ended) {
                    return Relayed {
                        a_to_b: a_to_b_ended.unwrap_or_else(|| Err(stopped())),
                        b_to_a: ended,
                    };
                }
                b_to_a_done.notify_one();
                b_to_a_ended = Some(ended);
            }
        }
        match (a_to_b_ended, b_to_a_ended) {
            (Some(a_to_b), Some(b_to_a)) => return Relayed { a_to_b, b_to_a },
            unfinished => (a_to_b_ended, b_to_a_ended) = unfinished,
        }
    }
}

/// One way of [`both_ways`]: copies `from` to `to` until `from` ends or a side fails,
/// then closes `to`'s sending side, unless `from` failed (see [`both_ways`]). Where
/// `to` took no more (a server that answered an upload early and closed), what
/// `from` still sends is read and dropped until `other_way_ended`: a client that
/// sends all its upload before it reads the answer would otherwise wait on its
/// write while the other way waits on writing it the answer, for good.
async fn way<R, W>(
    mut from: R,
    mut to: W,
    other_way_ended: impl std::future::Future<Output = ()>,
) -> io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let copied = copy(&mut from, &mut to).await;
    if !source_failed(&copied) {
        // Fails too when `to` is what broke: nothing is left to tell it.
        let _ = to.shutdown().await;
    }
    if write_failed(&copied) {
        tokio::select! {
            () = drain(&mut from) => {}
            () = other_way_ended => {}
        }
    }
    copied
}

/// Reads and drops what `from` sends until it ends or fails.
async fn drain(from: &mut (impl AsyncRead + Unpin)) {
    let mut sink = [0u8; 4096];
    loop {
        match from.read(&mut sink).await {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Copies `from` to `to` until `from` ends or a side fails, then closes `to`'s
/// sending side: its reader sees the end (after a failure too, so that a peer
/// waiting for more does not wait forever). A failed read's error carries
/// [`WayError::Read`].
pub async fn one_way<R, W>(mut from: R, mut to: W) -> io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let copied = copy(&mut from, &mut to).await;
    // Fails too when `to` is what broke: nothing is left to tell it.
    let _ = to.shutdown().await;
    copied
}

/// Copies until `from` ends; what it read is written out before it reads again, so a
/// read that fails loses nothing read before it (`tokio::io::copy` reads ahead and
/// drops what it holds when a read fails).
async fn copy<R, W>(from: &mut R, to: &mut W) -> io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut chunk = vec![0u8; CHUNK];
    let mut copied = 0u64;
    loop {
        let read = match from.read(&mut chunk).await {
            Ok(0) => return Ok(copied),
            Ok(read) => read,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(read_failed(e)),
        };
        to.write_all(&chunk[..read]).await?;
        // A writer that buffers (TLS) must not sit on the chunk while the source is
        // quiet: its peer may be waiting for it to answer.
        to.flush().await?;
        copied += read as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::UnixStream;

    /// How long a test waits for a stream the relay should end to end.
    const END_WAIT: Duration = Duration::from_secs(10);

    /// A TCP connection pair: the relay's end first, then its peer's.
    async fn tcp_pair() -> (TcpStream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let near = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (far, _) = listener.accept().await.unwrap();
        (near, far)
    }

    /// Reads `stream` to its end into `received`, giving up (`Err`) after
    /// [`END_WAIT`].
    async fn read_to_end_in_time(
        stream: &mut (impl AsyncRead + Unpin),
        received: &mut Vec<u8>,
    ) -> Result<io::Result<usize>, tokio::time::error::Elapsed> {
        tokio::time::timeout(END_WAIT, stream.read_to_end(received)).await
    }

    /// Relays between `client_side` and `server_side` in a task, as a caller that
    /// owns both sockets does: the side opposite the one that broke is reset in turn.
    fn relay_passing_on_resets(
        mut client_side: TcpStream,
        mut server_side: TcpStream,
    ) -> tokio::task::JoinHandle<Relayed> {
        tokio::spawn(async move {
            let relayed = both_ways(&mut client_side, &mut server_side).await;
            match relayed.broken() {
                Some(Side::A) => server_side.set_zero_linger().unwrap(),
                Some(Side::B) => client_side.set_zero_linger().unwrap(),
                None => {}
            }
            relayed
        })
    }

    /// A server that answers and hangs up without reading its client's request: the
    /// relay's write to it breaks, and its answer must still reach the client.
    #[tokio::test]
    async fn an_answer_sent_before_a_hang_up_reaches_the_client() {
        let (mut client, relay_client_side) = UnixStream::pair().unwrap();
        let (relay_server_side, mut server) = UnixStream::pair().unwrap();
        let answer = vec![7u8; 32 * 1024];
        // All of it is waiting before the relay starts, so its first turn meets both
        // the request (whose write to the gone server breaks) and the answer.
        client.write_all(&[1u8; 1024]).await.unwrap();
        server.write_all(&answer).await.unwrap();
        drop(server);

        let relay = tokio::spawn(both_ways(relay_client_side, relay_server_side));
        let mut received = Vec::new();
        client.read_to_end(&mut received).await.unwrap();
        assert_eq!(received.len(), answer.len());
        assert!(received == answer);
        let relayed = relay.await.unwrap();
        assert!(relayed.a_to_b.is_err(), "the request met a closed server");
        assert!(relayed.error().is_some());
    }

    /// A way that breaks on its read (the server reset its connection) ends the
    /// relay at once, both ways: the client's reading ends too, though it keeps its
    /// side open and sends nothing, with nothing passed on as an end of stream.
    #[tokio::test]
    async fn a_reset_from_the_server_ends_the_clients_reading() {
        let (mut client, relay_client_side) = UnixStream::pair().unwrap();
        let (relay_server_side, server) = tcp_pair().await;
        let relay = tokio::spawn(both_ways(relay_client_side, relay_server_side));
        // Closing with a zero linger sends a reset: the relay's read from it fails.
        server.set_zero_linger().unwrap();
        drop(server);
        let mut received = Vec::new();
        let ended = read_to_end_in_time(&mut client, &mut received).await;
        assert!(
            matches!(ended, Ok(Ok(0))),
            "the client's read did not end after the server's reset: {ended:?}"
        );
        let relayed = relay.await.unwrap();
        assert_eq!(relayed.broken(), Some(Side::B), "{relayed:?}");
        assert!(relayed.b_to_a.is_err(), "{relayed:?}");
        assert!(
            relayed
                .error()
                .is_some_and(|e| e.to_string().starts_with("reading: ")),
            "the stopped way's error was given as the cause: {relayed:?}"
        );
    }

    /// The server resets its connection: a caller that owns the client's socket can
    /// reset it in turn, and the client reads a reset, not an ordinary end (after
    /// which a response cut short would look complete).
    #[tokio::test]
    async fn a_reset_is_passed_on_as_a_reset_by_a_caller_that_owns_the_socket() {
        let (relay_client_side, mut client) = tcp_pair().await;
        let (relay_server_side, server) = tcp_pair().await;
        let relay = relay_passing_on_resets(relay_client_side, relay_server_side);
        server.set_zero_linger().unwrap();
        drop(server);
        let mut received = Vec::new();
        let ended = read_to_end_in_time(&mut client, &mut received)
            .await
            .expect("the client's read did not end after the server's reset");
        assert!(
            ended
                .as_ref()
                .is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset),
            "the client read {ended:?}, not a reset"
        );
        let relayed = relay.await.unwrap();
        assert!(
            relayed
                .a_to_b
                .as_ref()
                .is_err_and(|e| e.kind() == io::ErrorKind::ConnectionAborted),
            "the client's way was not stopped: {relayed:?}"
        );
    }

    /// A client that breaks off its upload: the server learns of it at once, not as
    /// an end of the upload it would take for whole.
    #[tokio::test]
    async fn a_reset_from_the_client_is_reported_for_its_side() {
        let (relay_client_side, client) = tcp_pair().await;
        let (relay_server_side, mut server) = tcp_pair().await;
        let relay = relay_passing_on_resets(relay_client_side, relay_server_side);
        client.set_zero_linger().unwrap();
        drop(client);
        let mut received = Vec::new();
        let ended = read_to_end_in_time(&mut server, &mut received)
            .await
            .expect("the server's read did not end after the client's reset");
        assert!(
            ended.is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset),
            "the server did not read a reset"
        );
        assert_eq!(relay.await.unwrap().broken(), Some(Side::A));
    }

    /// The peer has all the relay wrote: the break is passed on as a reset.
    #[tokio::test]
    async fn a_break_with_nothing_queued_is_passed_on_as_a_reset() {
        let (mut near, mut far) = tcp_pair().await;
        near.write_all(b"answer").await.unwrap();
        let mut answer = [0u8; 6];
        far.read_exact(&mut answer).await.unwrap();
        assert_eq!(pass_on_break(near).await, Ending::Reset);
        let ended = read_to_end_in_time(&mut far, &mut Vec::new())
            .await
            .expect("the peer's read did not end");
        assert!(
            ended.is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset),
            "the peer did not read a reset"
        );
    }

    /// An answer the peer has not taken yet (it is still uploading, and reads only
    /// after) reaches it whole, then an end of stream: a reset would have thrown the
    /// queued part away.
    #[tokio::test]
    async fn a_break_with_an_answer_queued_delivers_the_answer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        // A small receive buffer, so that most of the answer stays queued.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut far = socket
            .connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (near, _) = listener.accept().await.unwrap();
        // An upload the near side never reads.
        far.write_all(&[1u8; 16 * 1024]).await.unwrap();
        let answer: Vec<u8> = (0..256 * 1024).map(|i| (i % 251) as u8).collect();
        let mut written = 0;
        while written < answer.len() {
            match near.try_write(&answer[written..]) {
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        let answer = &answer[..written];
        assert!(queued_for_peer(&near).unwrap() > 0);
        let ended = tokio::spawn(pass_on_break(near));
        // More of the upload, once the near side has ended its stream: a closed
        // socket would answer it with a reset.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        far.write_all(&[2u8; 1024]).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let mut received = Vec::new();
        let read = read_to_end_in_time(&mut far, &mut received)
            .await
            .expect("the peer's read did not end");
        assert!(
            read.is_ok(),
            "the peer read {read:?} after {} bytes",
            received.len()
        );
        assert!(
            received == answer,
            "{} of {} bytes",
            received.len(),
            answer.len()
        );
        drop(far);
        assert_eq!(ended.await.unwrap(), Ending::EndAfterQueued);
    }

    #[tokio::test]
    async fn each_end_is_passed_on_as_a_half_close() {
        let (mut client, relay_client_side) = UnixStream::pair().unwrap();
        let (relay_server_side, mut server) = UnixStream::pair().unwrap();
        let relay = tokio::spawn(both_ways(relay_client_side, relay_server_side));

        client.write_all(b"request").await.unwrap();
        client.shutdown().await.unwrap();
        let mut request = Vec::new();
        server.read_to_end(&mut request).await.unwrap();
        assert_eq!(request, b"request");
        // The client's end did not end the other way.
        server.write_all(b"answer").await.unwrap();
        server.shutdown().await.unwrap();
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"answer");

        let relayed = relay.await.unwrap();
        assert_eq!(relayed.broken(), None);
        assert_eq!(relayed.a_to_b.unwrap(), 7);
        assert_eq!(relayed.b_to_a.unwrap(), 6);
    }

    /// A way whose destination takes no more (its server closed) leaves its source
    /// unread: [`Relayed::unread`] names that side, and not a broken one.
    #[tokio::test]
    async fn a_destination_that_takes_no_more_leaves_its_source_unread() {
        let (mut client, relay_client_side) = tokio::io::duplex(64);
        let (relay_server_side, server) = tokio::io::duplex(64);
        drop(server);
        client
            .write_all(b"an upload the server never reads")
            .await
            .unwrap();
        client.shutdown().await.unwrap();
        let relayed = both_ways(relay_client_side, relay_server_side).await;
        assert_eq!(relayed.broken(), None, "{relayed:?}");
        assert_eq!(relayed.unread(), Some(Side::A), "{relayed:?}");
    }

    /// The client's side of a relay whose server answered its upload early and
    /// closed: ended by [`end_side`], the client reads the whole answer and an end of
    /// stream, though it had sent more than was read. (Review: the callers dropped
    /// the socket with that unread, and the reset could throw the answer away.)
    #[tokio::test]
    async fn a_side_left_unread_ends_after_its_answer_without_a_reset() {
        let (relay_side, mut client) = tcp_pair().await;
        client.write_all(&[1u8; 64 * 1024]).await.unwrap();
        let answer = vec![7u8; 16 * 1024];
        let mut relay_side = relay_side;
        relay_side.write_all(&answer).await.unwrap();
        let relayed = Relayed {
            a_to_b: Err(io::Error::from(io::ErrorKind::BrokenPipe)),
            b_to_a: Ok(answer.len() as u64),
        };
        let ended = tokio::spawn(async move { end_side(relay_side, Side::A, &relayed).await });
        // The client reads only once the relay's side is ending, as one still
        // sending would.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut received = Vec::new();
        let read = read_to_end_in_time(&mut client, &mut received)
            .await
            .expect("the client's stream never ended");
        assert!(read.is_ok(), "{read:?} after {} bytes", received.len());
        assert!(received == answer, "{} bytes of the answer", received.len());
        drop(client);
        tokio::time::timeout(END_WAIT, ended)
            .await
            .expect("the drain outlived its client")
            .unwrap();
    }

    /// A server that answers an upload early (a 413 with a long page), stops reading
    /// and closes, to a client that sends its whole upload before it reads (Python's
    /// `http.client`): the client's upload is read and dropped, so it gets to read the
    /// whole answer. (Review: nobody read the client's side once the server took no
    /// more, so the client waited on its write, the relay on writing it the answer,
    /// for good.)
    #[tokio::test]
    async fn a_client_still_uploading_when_the_server_stops_reading_gets_the_answer() {
        let (relay_side, mut client) = tcp_pair().await;
        let (relay_server_side, server) = std::os::unix::net::UnixStream::pair().unwrap();
        relay_server_side.set_nonblocking(true).unwrap();
        let relay_server_side = UnixStream::from_std(relay_server_side).unwrap();
        // More than loopback's buffers hold both ways, so that each side waits.
        let answer: Vec<u8> = (0..24 << 20).map(|i| (i % 251) as u8).collect();
        let server = std::thread::spawn({
            let answer = answer.clone();
            move || {
                use std::io::{Read, Write};
                let mut server = server;
                let mut first = [0u8; 1024];
                server.read_exact(&mut first).unwrap();
                // No more reading: the relay's writes to it fail (EPIPE).
                server.shutdown(std::net::Shutdown::Read).unwrap();
                server.write_all(&answer).unwrap();
                // What came before the shutdown, taken: a Unix socket closed with
                // data unread ends its peer's reads with a reset.
                let mut before = Vec::new();
                server.read_to_end(&mut before).unwrap();
            }
        });
        let relay = tokio::spawn(both_ways(relay_side, relay_server_side));
        let upload = vec![1u8; 64 << 20];
        let client_done = async {
            client.write_all(&upload).await?;
            let mut received = Vec::new();
            client.read_to_end(&mut received).await?;
            io::Result::Ok(received)
        };
        let received = tokio::time::timeout(Duration::from_secs(30), client_done)
            .await
            .expect("the client and the relay waited on each other")
            .unwrap();
        assert!(received == answer, "{} bytes of the answer", received.len());
        let relayed = tokio::time::timeout(END_WAIT, relay)
            .await
            .expect("the relay never ended")
            .unwrap();
        assert_eq!(relayed.unread(), Some(Side::A), "{relayed:?}");
        server.join().unwrap();
    }
}
