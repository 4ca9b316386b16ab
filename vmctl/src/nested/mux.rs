//! Many byte streams over one link: how host clients reach a VM that runs inside the
//! nested host. The link is a virtio-serial port of the nested host (a Unix socket on
//! the host); each stream is one host connection to the VM's hybrid-vsock socket.
//!
//! Frames use the guest agent's codec (length prefix + postcard). Every stream has a
//! credit window per direction, so a stream whose reader is slow stops only itself:
//! the link reader never waits for a local socket.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use guest_agent::protocol::{write_frame, FrameReader};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Semaphore};

/// Largest payload of one data frame.
pub const MAX_CHUNK: usize = 32 * 1024;
/// Bytes a sender may have in flight per stream before the receiver grants more.
pub const WINDOW: u32 = 256 * 1024;
/// What each data frame costs of the window besides its payload: what the receiver
/// holds per queued frame. Without it, 1-byte frames would queue some 50 times the
/// window's bytes (a peer that a guest took over, writing to a socket that does not
/// read). Both sides run the same vmctl, so they agree on it.
pub const FRAME_COST: u32 = 256;
/// The port of an `Open` that means "the VM's hybrid-vsock socket".
pub const VSOCK_PORT: u32 = 0;
/// The most streams a link holds at once, as the VMM's vsock holds connections.
pub const MAX_STREAMS: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MuxFrame {
    /// Opens `stream` to `port` on the other side.
    Open { stream: u32, port: u32 },
    Data {
        stream: u32,
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
    },
    /// The receiver wrote `bytes` more to its local socket: the sender may send them.
    Credit { stream: u32, bytes: u32 },
    /// The sender will send no more on `stream` (half close).
    Close { stream: u32 },
    /// Abort `stream` both ways.
    Reset { stream: u32 },
}

/// Connects an `Open` from the other side to a local socket.
pub type Opener = Arc<
    dyn Fn(u32) -> Pin<Box<dyn Future<Output = std::io::Result<UnixStream>> + Send>> + Send + Sync,
>;

enum Inbound {
    Data(Vec<u8>),
    Close,
    Reset,
}

/// How the local-to-link direction of a stream ended.
enum UpEnd {
    /// The local socket reached EOF: a `Close` went out.
    Closed,
    /// A `Reset` went out, or the link is gone.
    Reset,
}

struct StreamEntry {
    inbound: mpsc::UnboundedSender<Inbound>,
    /// The peer closed its direction: a second Close is ignored, not queued.
    peer_closed: bool,
    /// Bytes the peer may still send before our next credit: enforced, since a peer
    /// that ignores the window could make us buffer without bound.
    receive_budget: Arc<AtomicU32>,
    send_window: Arc<Semaphore>,
}

/// One side of a multiplexed link.
pub struct Mux {
    out: mpsc::Sender<MuxFrame>,
    streams: Mutex<HashMap<u32, StreamEntry>>,
    next_stream: AtomicU32,
    /// Resets waiting for room in `out` (see [`Mux::send_reset`]).
    pending_resets: Arc<std::sync::atomic::AtomicUsize>,
}

impl Mux {
    /// Starts serving the link; `odd_ids` must differ between the two sides (streams
    /// each side opens get ids of its own parity). Returns when the link task is
    /// running; the returned handle ends when the link closes.
    pub fn start<R, W>(
        reader: R,
        writer: W,
        odd_ids: bool,
        opener: Opener,
    ) -> (Arc<Mux>, tokio::task::JoinHandle<()>)
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (out, out_rx) = mpsc::channel(256);
        let mux = Arc::new(Mux {
            out,
            streams: Mutex::new(HashMap::new()),
            next_stream: AtomicU32::new(if odd_ids { 1 } else { 2 }),
            pending_resets: Default::default(),
        });
        tokio::spawn(write_link(writer, out_rx));
        let link = tokio::spawn(read_link(mux.clone(), reader, opener));
        (mux, link)
    }

    /// Bridges `local` to `port` on the other side.
    pub async fn open(self: &Arc<Self>, port: u32, local: UnixStream) {
        let stream = self.next_stream.fetch_add(2, Ordering::Relaxed);
        let inbound = self.register(stream);
        if self
            .out
            .send(MuxFrame::Open { stream, port })
            .await
            .is_err()
        {
            self.streams_lock().remove(&stream);
            return;
        }
        self.bridge(stream, local, inbound);
    }

    fn streams_lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, StreamEntry>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register(&self, stream: u32) -> (mpsc::UnboundedReceiver<Inbound>, Arc<Semaphore>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let send_window = Arc::new(Semaphore::new(WINDOW as usize));
        self.streams_lock().insert(
            stream,
            StreamEntry {
                inbound: tx,
                peer_closed: false,
                receive_budget: Arc::new(AtomicU32::new(WINDOW)),
                send_window: send_window.clone(),
            },
        );
        (rx, send_window)
    }

    /// Runs the two directions of `stream` over `local`. The stream, and with it the
    /// local socket, is forgotten once both directions have closed, or either was
    /// reset: a long-lived link carries an unbounded number of streams.
    fn bridge(
        self: &Arc<Self>,
        stream: u32,
        local: UnixStream,
        (mut inbound, send_window): (mpsc::UnboundedReceiver<Inbound>, Arc<Semaphore>),
    ) {
        let (mut local_read, mut local_write) = local.into_split();
        let up_out = self.out.clone();
        let mut up = tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_CHUNK];
            loop {
                let frame = match local_read.read(&mut buf).await {
                    Ok(0) => MuxFrame::Close { stream },
                    Ok(n) => {
                        // Wait for the peer's credit before sending what we read.
                        match send_window.acquire_many(n as u32 + FRAME_COST).await {
                            Ok(permit) => permit.forget(),
                            Err(_) => return UpEnd::Reset,
                        }
                        MuxFrame::Data {
                            stream,
                            bytes: buf[..n].to_vec(),
                        }
                    }
                    Err(_) => MuxFrame::Reset { stream },
                };
                let end = match frame {
                    MuxFrame::Data { .. } => None,
                    MuxFrame::Close { .. } => Some(UpEnd::Closed),
                    _ => Some(UpEnd::Reset),
                };
                if up_out.send(frame).await.is_err() {
                    return UpEnd::Reset;
                }
                if let Some(end) = end {
                    return end;
                }
            }
        });
        let mux = self.clone();
        tokio::spawn(async move {
            let mut up_closed = false;
            let mut down_closed = false;
            // The local socket refused a write (its reader is gone). What it still
            // holds for the peer is read on, and the stream reset only after that: a
            // reset sent at once would overtake that data, and end the stream
            // before the peer has it (a command's exit status, say).
            let mut write_failed = false;
            let how = loop {
                tokio::select! {
                    end = &mut up, if !up_closed => match end {
                        Ok(UpEnd::Closed) if write_failed && !down_closed => {
                            let _ = mux.out.send(MuxFrame::Reset { stream }).await;
                            break "reset by our side (local write failed)";
                        }
                        Ok(UpEnd::Closed) if !down_closed => up_closed = true,
                        Ok(UpEnd::Closed) => break "closed both ways",
                        _ => break "reset by our side (local read failed, or the link is gone)",
                    },
                    message = inbound.recv() => match message {
                        Some(Inbound::Data(bytes)) => {
                            if !write_failed && local_write.write_all(&bytes).await.is_err() {
                                write_failed = true;
                                if up_closed {
                                    let _ = mux.out.send(MuxFrame::Reset { stream }).await;
                                    break "reset by our side (local write failed)";
                                }
                            }
                            // Dropped bytes are granted too, or the peer would stall.
                            mux.grant(stream, bytes.len() as u32 + FRAME_COST).await;
                        }
                        Some(Inbound::Close) => {
                            if !write_failed {
                                let _ = local_write.shutdown().await;
                            }
                            if up_closed {
                                break "closed both ways";
                            }
                            down_closed = true;
                        }
                        Some(Inbound::Reset) | None => break "reset by the peer",
                    },
                }
            };
            tracing::debug!("mux: stream {stream} ended: {how}");
            up.abort();
            mux.streams_lock().remove(&stream);
        });
    }

    /// Gives the peer back `bytes` of window on `stream`.
    async fn grant(&self, stream: u32, bytes: u32) {
        let budget = self
            .streams_lock()
            .get(&stream)
            .map(|e| e.receive_budget.clone());
        if let Some(budget) = budget {
            budget.fetch_add(bytes, Ordering::AcqRel);
            let _ = self.out.send(MuxFrame::Credit { stream, bytes }).await;
        }
    }

    /// Tells the peer `stream` is reset, however full the link's queue is now: a
    /// dropped Reset would leave the stream, and its slot, open on the other side.
    /// False when [`MAX_STREAMS`] resets wait already: a peer that provokes resets
    /// while it reads nothing (a nested host a guest took over) is cut off, not
    /// answered with ever more waiting tasks.
    #[must_use]
    fn send_reset(&self, stream: u32) -> bool {
        if self.pending_resets.fetch_add(1, Ordering::AcqRel) >= MAX_STREAMS {
            self.pending_resets.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        let (out, pending) = (self.out.clone(), self.pending_resets.clone());
        tokio::spawn(async move {
            let _ = out.send(MuxFrame::Reset { stream }).await;
            pending.fetch_sub(1, Ordering::AcqRel);
        });
        true
    }

    /// Handles one frame from the link; false when the link is to end (see
    /// [`Mux::send_reset`]).
    #[must_use]
    fn dispatch(self: &Arc<Self>, frame: MuxFrame, opener: &Opener) -> bool {
        match frame {
            MuxFrame::Open { stream, port } => {
                let ours = self.next_stream.load(Ordering::Relaxed) % 2 == stream % 2;
                if ours || self.streams_lock().contains_key(&stream) {
                    tracing::warn!("mux: peer opened stream {stream}, which is not its to open");
                    return true;
                }
                // Each stream holds a connection on this side: a peer (a nested host
                // the guest took over) must not open them without bound.
                if self.streams_lock().len() >= MAX_STREAMS {
                    tracing::warn!("mux: peer opened stream {stream} past {MAX_STREAMS}; refused");
                    return self.send_reset(stream);
                }
                let inbound = self.register(stream);
                let mux = self.clone();
                let connect = opener(port);
                tokio::spawn(async move {
                    match connect.await {
                        Ok(local) => mux.bridge(stream, local, inbound),
                        Err(e) => {
                            tracing::debug!("mux: stream {stream} to port {port}: {e}");
                            mux.streams_lock().remove(&stream);
                            let _ = mux.out.send(MuxFrame::Reset { stream }).await;
                        }
                    }
                });
            }
            MuxFrame::Data { stream, bytes } => {
                let mut streams = self.streams_lock();
                let Some(entry) = streams.get(&stream) else {
                    return true;
                };
                let len = bytes.len() as u32;
                let within_window = entry
                    .receive_budget
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                        b.checked_sub(len.saturating_add(FRAME_COST))
                    })
                    .is_ok();
                // An empty one costs no window, but a place in the queue all the same.
                if within_window && len > 0 {
                    let _ = entry.inbound.send(Inbound::Data(bytes));
                } else {
                    tracing::warn!(
                        "mux: peer overran the window of stream {stream}, or sent it nothing; \
                         resetting it"
                    );
                    let _ = entry.inbound.send(Inbound::Reset);
                    streams.remove(&stream);
                    return self.send_reset(stream);
                }
            }
            MuxFrame::Credit { stream, bytes } => {
                if let Some(entry) = self.streams_lock().get(&stream) {
                    let room =
                        (WINDOW as usize).saturating_sub(entry.send_window.available_permits());
                    entry.send_window.add_permits((bytes as usize).min(room));
                }
            }
            MuxFrame::Close { stream } => {
                if let Some(entry) = self.streams_lock().get_mut(&stream) {
                    if !std::mem::replace(&mut entry.peer_closed, true) {
                        let _ = entry.inbound.send(Inbound::Close);
                    }
                }
            }
            MuxFrame::Reset { stream } => {
                if let Some(entry) = self.streams_lock().remove(&stream) {
                    let _ = entry.inbound.send(Inbound::Reset);
                }
            }
        }
        true
    }

    /// The link is gone: every stream ends.
    fn reset_all(&self) {
        for (_, entry) in self.streams_lock().drain() {
            let _ = entry.inbound.send(Inbound::Reset);
        }
    }

    /// Number of open streams.
    #[cfg(test)]
    pub fn stream_count(&self) -> usize {
        self.streams_lock().len()
    }
}

async fn write_link<W: AsyncWrite + Unpin>(mut writer: W, mut frames: mpsc::Receiver<MuxFrame>) {
    while let Some(frame) = frames.recv().await {
        if let Err(e) = write_frame(&mut writer, &frame).await {
            tracing::warn!("mux: link write failed: {e}");
            break;
        }
    }
}

async fn read_link<R: AsyncRead + Unpin>(mux: Arc<Mux>, reader: R, opener: Opener) {
    let mut frames = FrameReader::new(reader);
    loop {
        match frames.next::<MuxFrame>().await {
            Ok(Some(frame)) => {
                if !mux.dispatch(frame, &opener) {
                    tracing::warn!(
                        "mux: the peer provokes resets faster than it reads them; link closed"
                    );
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                tracing::warn!("mux: link read failed: {e}");
                break;
            }
        }
    }
    mux.reset_all();
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// Two muxes joined by a socketpair; the far side opens streams to an echo server
    /// (port 0) or to a sink that reads slowly (port 1), or refuses (other ports).
    async fn pair(dir: &std::path::Path) -> (Arc<Mux>, Arc<Mux>) {
        let echo_path = dir.join("echo.sock");
        let echo = UnixListener::bind(&echo_path).unwrap();
        tokio::spawn(async move {
            while let Ok((conn, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = conn.into_split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        let (a, b) = UnixStream::pair().unwrap();
        let (ar, aw) = a.into_split();
        let (br, bw) = b.into_split();
        let refuse: Opener = Arc::new(|_| {
            Box::pin(async { Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)) })
        });
        let to_echo: Opener = Arc::new(move |port| {
            let path = echo_path.clone();
            Box::pin(async move {
                if port == VSOCK_PORT {
                    UnixStream::connect(path).await
                } else {
                    Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
                }
            })
        });
        let (host, _) = Mux::start(ar, aw, true, refuse);
        let (guest, _) = Mux::start(br, bw, false, to_echo);
        (host, guest)
    }

    /// A host-side mux whose peer is the test, writing raw frames on the returned
    /// writer; the frames the mux sends are counted as Resets per stream on the
    /// returned list. Each stream the peer opens connects to a listener that holds it.
    async fn mux_with_raw_peer(
        dir: &std::path::Path,
    ) -> (
        Arc<Mux>,
        tokio::net::unix::OwnedWriteHalf,
        Arc<Mutex<Vec<u32>>>,
    ) {
        let sink_path = dir.join("sink.sock");
        let sink = UnixListener::bind(&sink_path).unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = sink.accept().await {
                held.push(conn);
            }
        });
        let opener: Opener = Arc::new(move |_| {
            let path = sink_path.clone();
            Box::pin(async move { UnixStream::connect(path).await })
        });
        let (a, b) = UnixStream::pair().unwrap();
        let (ar, aw) = a.into_split();
        let (br, bw) = b.into_split();
        let resets = Arc::new(Mutex::new(Vec::new()));
        let seen = resets.clone();
        tokio::spawn(async move {
            let mut frames = FrameReader::new(br);
            while let Ok(Some(frame)) = frames.next::<MuxFrame>().await {
                if let MuxFrame::Reset { stream } = frame {
                    seen.lock().unwrap().push(stream);
                }
            }
        });
        let (mux, _) = Mux::start(ar, aw, true, opener);
        (mux, bw, resets)
    }

    /// Each stream holds a connection on this side: a peer (a nested host the guest
    /// took over) gets no more than MAX_STREAMS of them; the rest are refused.
    #[tokio::test]
    async fn a_peer_cannot_open_streams_without_bound() {
        let dir = tempfile::tempdir().unwrap();
        let (mux, mut peer, resets) = mux_with_raw_peer(dir.path()).await;
        let asked = MAX_STREAMS as u32 + 50;
        for i in 0..asked {
            let open = MuxFrame::Open {
                stream: 2 + 2 * i,
                port: 0,
            };
            write_frame(&mut peer, &open).await.unwrap();
        }
        for _ in 0..100 {
            if resets.lock().unwrap().len() >= 50 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(mux.stream_count() <= MAX_STREAMS, "{}", mux.stream_count());
        assert_eq!(
            resets.lock().unwrap().len(),
            50,
            "the streams past the bound are refused"
        );
    }

    /// An empty Data frame costs no window but a place in the stream's queue, which a
    /// peer could fill without bound: the stream is reset instead.
    #[tokio::test]
    async fn an_empty_data_frame_resets_its_stream() {
        let dir = tempfile::tempdir().unwrap();
        let (mux, mut peer, resets) = mux_with_raw_peer(dir.path()).await;
        write_frame(&mut peer, &MuxFrame::Open { stream: 2, port: 0 })
            .await
            .unwrap();
        let empty = MuxFrame::Data {
            stream: 2,
            bytes: Vec::new(),
        };
        write_frame(&mut peer, &empty).await.unwrap();
        for _ in 0..100 {
            if !resets.lock().unwrap().is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert_eq!(*resets.lock().unwrap(), [2]);
        assert_eq!(mux.stream_count(), 0);
    }

    /// Opens a stream from `mux` and returns our end of it.
    async fn client(mux: &Arc<Mux>, port: u32) -> UnixStream {
        let (ours, theirs) = UnixStream::pair().unwrap();
        mux.open(port, theirs).await;
        ours
    }

    #[tokio::test]
    async fn streams_echo_large_payloads() {
        let dir = tempfile::tempdir().unwrap();
        let (host, _guest) = pair(dir.path()).await;
        let data: Vec<u8> = (0..3 * WINDOW + 12345)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let mut conn = client(&host, VSOCK_PORT).await;
        let (mut r, mut w) = conn.split();
        let expected = data.clone();
        let (_, echoed) = tokio::join!(
            async {
                w.write_all(&data).await.unwrap();
                w.shutdown().await.unwrap();
            },
            async {
                let mut out = Vec::new();
                r.read_to_end(&mut out).await.unwrap();
                out
            }
        );
        assert_eq!(echoed.len(), expected.len());
        assert!(echoed == expected, "echoed bytes differ");
    }

    #[tokio::test]
    async fn many_concurrent_streams() {
        let dir = tempfile::tempdir().unwrap();
        let (host, _guest) = pair(dir.path()).await;
        let mut tasks = Vec::new();
        for i in 0..100u32 {
            let host = host.clone();
            tasks.push(tokio::spawn(async move {
                let mut conn = client(&host, VSOCK_PORT).await;
                let msg = format!("stream {i}");
                conn.write_all(msg.as_bytes()).await.unwrap();
                conn.shutdown().await.unwrap();
                let mut out = String::new();
                conn.read_to_string(&mut out).await.unwrap();
                assert_eq!(out, msg);
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
    }

    /// Waits up to 5 s for both sides to have no streams left.
    async fn until_no_streams(host: &Mux, guest: &Mux) {
        for _ in 0..100 {
            if host.stream_count() == 0 && guest.stream_count() == 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!(
            "streams left open: {} on the host's side, {} on the guest's",
            host.stream_count(),
            guest.stream_count()
        );
    }

    #[tokio::test]
    async fn streams_closed_both_ways_are_forgotten_and_their_sockets_closed() {
        let dir = tempfile::tempdir().unwrap();
        let (host, guest) = pair(dir.path()).await;
        for _ in 0..20 {
            let mut conn = client(&host, VSOCK_PORT).await;
            conn.write_all(b"ping").await.unwrap();
            conn.shutdown().await.unwrap();
            let mut out = Vec::new();
            conn.read_to_end(&mut out).await.unwrap();
            assert_eq!(out, b"ping");
        }
        // Each stream held a socket on both sides: a long-lived VM ran out of them.
        until_no_streams(&host, &guest).await;
    }

    #[tokio::test]
    async fn a_stream_whose_local_socket_fails_is_forgotten_on_both_sides() {
        let dir = tempfile::tempdir().unwrap();
        let (host, guest) = pair(dir.path()).await;
        let mut conn = client(&host, VSOCK_PORT).await;
        conn.write_all(b"xy").await.unwrap();
        let mut one = [0u8; 1];
        conn.read_exact(&mut one).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        // Closed with the echoed "y" unread, so the mux's read of it fails
        // (ECONNRESET): the stream is reset, not closed.
        drop(conn);
        until_no_streams(&host, &guest).await;
    }

    #[tokio::test]
    async fn what_a_socket_said_before_it_closed_arrives_though_a_write_to_it_failed() {
        // The local socket answers more than a window, then closes without reading
        // (the agent's output and exit status, then its socket closed) while the
        // peer still sends: the rest of the answer comes before the reset.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("answers.sock");
        let server = UnixListener::bind(&path).unwrap();
        let answer: Vec<u8> = (0..WINDOW as usize + 5000).map(|i| i as u8).collect();
        let expected = answer.clone();
        let (served_tx, served) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut conn, _) = server.accept().await.unwrap();
            conn.write_all(&answer).await.unwrap();
            drop(conn);
            let _ = served_tx.send(());
        });
        let opener: Opener = Arc::new(move |_| {
            let path = path.clone();
            Box::pin(async move { UnixStream::connect(path).await })
        });
        let (a, b) = UnixStream::pair().unwrap();
        let (ar, aw) = a.into_split();
        let (br, mut bw) = b.into_split();
        let (_mux, _) = Mux::start(ar, aw, true, opener);
        write_frame(&mut bw, &MuxFrame::Open { stream: 2, port: 0 })
            .await
            .unwrap();
        // Frames from the mux, through a channel: reading a frame is not cancel-safe.
        let (frame_tx, mut frames) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut reader = FrameReader::new(br);
            while let Ok(Some(frame)) = reader.next::<MuxFrame>().await {
                if frame_tx.send(frame).is_err() {
                    break;
                }
            }
        });
        // What the window allows comes; the rest waits for credit, the server is gone.
        let mut got = Vec::new();
        served.await.unwrap();
        let quiet = std::time::Duration::from_millis(300);
        while let Ok(frame) = tokio::time::timeout(quiet, frames.recv()).await {
            match frame {
                Some(MuxFrame::Data { bytes, .. }) => got.extend(bytes),
                other => panic!("expected data, got {other:?}"),
            }
        }
        assert!(
            got.len() < expected.len(),
            "the window did not hold the answer back"
        );
        let late = MuxFrame::Data {
            stream: 2,
            bytes: b"too late".to_vec(),
        };
        write_frame(&mut bw, &late).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let credit = MuxFrame::Credit {
            stream: 2,
            bytes: WINDOW,
        };
        write_frame(&mut bw, &credit).await.unwrap();
        let wait = std::time::Duration::from_secs(5);
        let end = loop {
            match tokio::time::timeout(wait, frames.recv())
                .await
                .expect("the stream must end")
            {
                Some(MuxFrame::Data { bytes, .. }) => got.extend(bytes),
                Some(MuxFrame::Credit { .. }) => {}
                other => break other,
            }
        };
        assert_eq!(got.len(), expected.len(), "bytes lost before {end:?}");
        assert!(got == expected);
        assert_eq!(end, Some(MuxFrame::Close { stream: 2 }));
        let reset = tokio::time::timeout(wait, frames.recv())
            .await
            .expect("a reset");
        assert_eq!(reset, Some(MuxFrame::Reset { stream: 2 }));
    }

    #[tokio::test]
    async fn a_stalled_stream_does_not_block_others() {
        let dir = tempfile::tempdir().unwrap();
        let (host, _guest) = pair(dir.path()).await;
        // Fill one stream's window (and the echo's socket buffers) without reading.
        let mut stalled = client(&host, VSOCK_PORT).await;
        let junk = vec![0u8; 4 * WINDOW as usize];
        let writer = tokio::spawn(async move {
            let _ = stalled.write_all(&junk).await;
            stalled
        });
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let mut other = client(&host, VSOCK_PORT).await;
        other.write_all(b"still flowing").await.unwrap();
        let mut buf = [0u8; 13];
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            other.read_exact(&mut buf),
        )
        .await
        .expect("the second stream was blocked by the first")
        .unwrap();
        assert_eq!(&buf, b"still flowing");
        writer.abort();
    }

    #[tokio::test]
    async fn refused_open_closes_the_client() {
        let dir = tempfile::tempdir().unwrap();
        let (host, _guest) = pair(dir.path()).await;
        let mut conn = client(&host, 42).await;
        let mut out = Vec::new();
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            conn.read_to_end(&mut out),
        )
        .await;
        assert!(read.is_ok(), "a refused stream must end");
        assert!(out.is_empty());
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(host.stream_count(), 0);
    }

    /// A mux whose raw peer sends `frame` on stream 2 `count` times (until the link
    /// refuses), into a local socket nobody reads; how many streams it holds after.
    async fn streams_left_after_flooding(frame: MuxFrame, count: usize) -> usize {
        let (a, b) = UnixStream::pair().unwrap();
        let (ar, aw) = a.into_split();
        let (_br, mut bw) = b.into_split();
        let dir = tempfile::tempdir().unwrap();
        let sink_path = dir.path().join("sink.sock");
        let sink = UnixListener::bind(&sink_path).unwrap();
        let opener: Opener = Arc::new(move |_| {
            let path = sink_path.clone();
            Box::pin(async move { UnixStream::connect(path).await })
        });
        let (mux, _) = Mux::start(ar, aw, true, opener);
        write_frame(&mut bw, &MuxFrame::Open { stream: 2, port: 0 })
            .await
            .unwrap();
        let _held = sink.accept().await.unwrap();
        for _ in 0..count {
            if write_frame(&mut bw, &frame).await.is_err() {
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        mux.stream_count()
    }

    #[tokio::test]
    async fn a_peer_that_ignores_the_window_gets_reset() {
        // Far more than the window plus what the unread sink socket can buffer.
        let chunk = MuxFrame::Data {
            stream: 2,
            bytes: vec![0u8; MAX_CHUNK],
        };
        assert_eq!(
            streams_left_after_flooding(chunk, (4 << 20) / MAX_CHUNK).await,
            0,
            "the overrunning stream must be reset"
        );
    }

    /// Each frame costs the window more than its payload: a peer sending 1-byte frames
    /// to a socket that does not read cannot queue 50 times the window's bytes in
    /// frames (20,000 bytes are well within the window; 20,000 frames are not).
    #[tokio::test]
    async fn a_peer_sending_tiny_frames_is_held_to_the_window() {
        let tiny = MuxFrame::Data {
            stream: 2,
            bytes: vec![0],
        };
        assert_eq!(
            streams_left_after_flooding(tiny, 20_000).await,
            0,
            "the stream must be reset"
        );
    }

    #[tokio::test]
    async fn garbage_on_the_link_ends_every_stream_without_panicking() {
        let dir = tempfile::tempdir().unwrap();
        let (host, _guest) = pair(dir.path()).await;
        let mut conn = client(&host, VSOCK_PORT).await;
        conn.write_all(b"x").await.unwrap();
        let mut one = [0u8; 1];
        conn.read_exact(&mut one).await.unwrap();
        // A second mux fed garbage.
        let (a, mut b) = UnixStream::pair().unwrap();
        let (ar, aw) = a.into_split();
        let refuse: Opener =
            Arc::new(|_| Box::pin(async { Err(std::io::ErrorKind::Other.into()) }));
        let (_mux, link) = Mux::start(ar, aw, true, refuse);
        b.write_all(&[5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff])
            .await
            .unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), link)
            .await
            .expect("the link task must end on garbage")
            .unwrap();
    }
}
