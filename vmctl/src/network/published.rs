//! Host ports published to guest loopback ports (`vmctl publish`): each host
//! connection becomes a `ConnectPort` connection to the guest agent.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Semaphore};
use tokio::task::{JoinHandle, JoinSet};

use super::control::PublishedPort;
use super::services::MAX_GUEST_SERVICE_CONNECTIONS;

/// The most connections a VM's published ports forward at once, all of them
/// together. Each holds one of the VMM's vsock connections, as each connection the
/// guest makes does: with both at their limits, the VMM must still have some for
/// vmctl's own calls into the guest (`exec`, the network setup, `stop`), whoever
/// reaches a published address and however often. The guest's own limit there is
/// the VMM's (not the host services' [`MAX_GUEST_SERVICE_CONNECTIONS`]: a connection
/// beyond those holds its vsock connection until its preamble times out), so these
/// must fit in the VMM's reserve for host clients, with room to spare.
pub const MAX_PUBLISHED_CONNECTIONS: usize = 64;
const _: () = {
    use vmm::devices::virtio::vsock::muxer::{HOST_RESERVED_CONNECTIONS, MAX_GUEST_CONNECTIONS};
    assert!(MAX_GUEST_SERVICE_CONNECTIONS <= MAX_GUEST_CONNECTIONS);
    assert!(MAX_PUBLISHED_CONNECTIONS * 2 <= HOST_RESERVED_CONNECTIONS);
};

/// Why `host` cannot be listened on, and what to do: a port another program holds
/// (the host's own dev server on 3000) or one only root may take.
fn cannot_listen(host: SocketAddr, error: &std::io::Error) -> String {
    let advice = match error.kind() {
        std::io::ErrorKind::AddrInUse => {
            "another program listens there: pick another --host-port, or leave it out for a \
             free one"
        }
        std::io::ErrorKind::PermissionDenied if host.port() < 1024 => {
            "a port below 1024 needs root: pick one above 1023, or leave --host-port out for \
             a free one"
        }
        std::io::ErrorKind::AddrNotAvailable => {
            "no interface of this host has that address: give --address one it has \
             (127.0.0.1 by default)"
        }
        _ => return format!("cannot listen on {host}: {error}"),
    };
    format!("cannot listen on {host} ({error}): {advice}")
}

/// The answer to publishing `guest_port` at `asked` when it is published at
/// `existing`: that address if it is as asked, else an error that says what to do.
fn already_published(
    guest_port: u16,
    existing: SocketAddr,
    asked: SocketAddr,
) -> Result<PublishedPort, String> {
    let as_asked =
        existing.ip() == asked.ip() && (asked.port() == 0 || asked.port() == existing.port());
    if as_asked {
        return Ok(PublishedPort {
            guest_port,
            host: existing,
        });
    }
    Err(format!(
        "guest port {guest_port} is already published at {existing}; \
         'vmctl unpublish {guest_port}' first"
    ))
}

/// The published ports of one VM, by guest port.
pub struct Published {
    ports: Mutex<BTreeMap<u16, Publication>>,
    /// The connections its publications forward, together
    /// ([`MAX_PUBLISHED_CONNECTIONS`]).
    connections: Arc<Semaphore>,
}

impl Default for Published {
    fn default() -> Published {
        Published::with_limit(MAX_PUBLISHED_CONNECTIONS)
    }
}

/// One published port: where it listens, and the task that serves it, which ends
/// (its connections with it) once `stop` is sent or dropped.
struct Publication {
    host: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Published {
    /// Publications that forward at most `limit` connections at once, together.
    fn with_limit(limit: usize) -> Published {
        Published {
            ports: Mutex::new(BTreeMap::new()),
            connections: Arc::new(Semaphore::new(limit)),
        }
    }

    /// Listens on `host` (port 0: a free one) and forwards its connections to the
    /// guest's `guest_port`; returns the address it listens on. Asked again for a
    /// port already published as asked, it answers with that address, so that a
    /// script can publish without first asking whether it did. `refuse` says why the
    /// port must not be published, if it must not; it is asked again, with the
    /// publications held still, right before the publication is made (see
    /// [`Published::while_unchanged`]).
    pub async fn publish(
        &self,
        vsock: PathBuf,
        guest_port: u16,
        host: SocketAddr,
        refuse: impl Fn() -> Option<String>,
    ) -> Result<PublishedPort, String> {
        if let Some(existing) = self.address_of(guest_port) {
            return already_published(guest_port, existing, host);
        }
        if let Some(why) = refuse() {
            return Err(why);
        }
        let listener = TcpListener::bind(host)
            .await
            .map_err(|e| cannot_listen(host, &e))?;
        let asked = host;
        let host = listener
            .local_addr()
            .map_err(|e| format!("cannot listen on {host}: {e}"))?;
        let mut ports = self.ports.lock().map_err(|_| poisoned())?;
        // Another `vmctl publish` of the same port may have got here first while this
        // one was binding: its listener stays, this one goes.
        if let Some(existing) = ports.get(&guest_port) {
            return already_published(guest_port, existing.host, asked);
        }
        // What `refuse` checks (the relays) may have changed while this one was
        // binding.
        if let Some(why) = refuse() {
            return Err(why);
        }
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(serve(
            listener,
            Arc::new(vsock),
            guest_port,
            self.connections.clone(),
            stopped,
        ));
        ports.insert(guest_port, Publication { host, stop, task });
        Ok(PublishedPort { guest_port, host })
    }

    /// Stops publishing `guest_port`, and answers once its address is free again and
    /// the connections it forwarded are closed (left open, a publication made by
    /// mistake would go on serving whoever got in); returns the host address it had.
    pub async fn unpublish(&self, guest_port: u16) -> Result<SocketAddr, String> {
        let publication = self
            .ports
            .lock()
            .map_err(|_| poisoned())?
            .remove(&guest_port)
            .ok_or_else(|| format!("guest port {guest_port} is not published"))?;
        let _ = publication.stop.send(());
        if let Err(e) = publication.task.await {
            tracing::warn!(
                "published port {}: its task ended badly: {e}",
                publication.host
            );
        }
        Ok(publication.host)
    }

    /// Runs `decide` on the guest ports published now, with none published or
    /// unpublished until it returns: a decision about them (a relay to add) and a
    /// publication's `refuse` never both pass on what the other is about to change.
    pub fn while_unchanged<R>(
        &self,
        decide: impl FnOnce(&BTreeSet<u16>) -> R,
    ) -> Result<R, String> {
        let ports = self.ports.lock().map_err(|_| poisoned())?;
        let published = ports.keys().copied().collect();
        Ok(decide(&published))
    }

    pub fn list(&self) -> Vec<PublishedPort> {
        self.ports
            .lock()
            .map(|ports| {
                ports
                    .iter()
                    .map(|(&guest_port, publication)| PublishedPort {
                        guest_port,
                        host: publication.host,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    fn address_of(&self, guest_port: u16) -> Option<SocketAddr> {
        let ports = self.ports.lock().ok()?;
        ports.get(&guest_port).map(|publication| publication.host)
    }
}

/// Forwards each connection to `listener` to the guest's `guest_port`, while one of
/// `slots` is free, until `stopped`; then closes the listener, ends the connections,
/// and returns once they have ended. A connection with no slot free is reset.
async fn serve(
    listener: TcpListener,
    vsock: Arc<PathBuf>,
    guest_port: u16,
    slots: Arc<Semaphore>,
    mut stopped: oneshot::Receiver<()>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            // Ended connections are reaped, or the set would grow with each.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((client, peer)) => match slots.clone().try_acquire_owned() {
                    Ok(slot) => {
                        connections.spawn(forward(client, peer, vsock.clone(), guest_port, slot));
                    }
                    Err(_) => {
                        // Rate-limited: whoever reaches the address connects at will.
                        guest_log::guest_warn!(
                            "published port {guest_port}: the connection from {peer} is \
                             refused (reset): the VM's published ports forward \
                             {MAX_PUBLISHED_CONNECTIONS} connections already, the most \
                             they may at once"
                        );
                        reset_on_close(&client);
                    }
                },
                Err(e) => {
                    tracing::warn!("published guest port {guest_port}: accepting: {e}");
                    // Out of descriptors, most likely: let some connections end.
                    tokio::select! {
                        _ = &mut stopped => break,
                        () = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
                    }
                }
            },
        }
    }
    drop(listener);
    connections.shutdown().await;
}

fn poisoned() -> String {
    "the published-port table is unusable (a thread panicked)".into()
}

/// Relays one host connection to the guest's `guest_port`. The agent has
/// [`crate::exec::AGENT_TIMEOUT`] to connect it, as for any call: one that takes the
/// connection and never answers must not hold this task and both sockets forever.
/// A connection the guest does not take (nothing listens on the port) is reset, as
/// is one whose guest side breaks (unless the guest's answer is still queued for the
/// client, [`byte_relay::pass_on_break`]): its client learns that, not that the
/// stream ended. One the guest stopped taking while its client still sent gets the
/// guest's answer and an end of stream ([`byte_relay::end_after_unread`]). (The VMM
/// ends the vsock stream of a guest server that reset its connection as an ordinary
/// end, though: that client sees an end of stream.) `slot` goes with the guest's
/// connection, before the client's end, which can take [`byte_relay::DRAIN_TIMEOUT`].
async fn forward(
    mut client: TcpStream,
    peer: SocketAddr,
    vsock: Arc<PathBuf>,
    guest_port: u16,
    slot: tokio::sync::OwnedSemaphorePermit,
) {
    let connected =
        crate::exec::call_agent(&vsock, |connection| connection.connect_port(guest_port)).await;
    match connected {
        Ok(guest) => {
            let relayed = byte_relay::both_ways(&mut client, guest).await;
            drop(slot);
            byte_relay::end_side(client, byte_relay::Side::A, &relayed).await;
        }
        Err(e) => {
            // Rate-limited: whoever reaches the published address can make it fail
            // as often as they connect.
            guest_log::guest_warn!(
                "published port {guest_port}: the connection from {peer} is refused: {}",
                e.describe("the guest agent did not connect it")
            );
            reset_on_close(&client);
        }
    }
}

/// Makes closing `client` reset its connection.
fn reset_on_close(client: &TcpStream) {
    if let Err(e) = client.set_zero_linger() {
        tracing::debug!("cannot make a published connection's close a reset: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use guest_agent::protocol::{write_frame, AgentMessage, ClientMessage, FrameReader};
    use std::path::Path;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A free port on the loopback address, chosen as the publication binds.
    const ANY_LOOPBACK_PORT: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
        std::net::Ipv4Addr::LOCALHOST,
        0,
    ));

    /// Publishes `guest_port` of the VM whose agent listens on `vsock` at a free
    /// loopback port, refusing nothing; returns the host address it is published at.
    async fn publish_on_any_port(
        published: &Published,
        vsock: &Path,
        guest_port: u16,
    ) -> SocketAddr {
        published
            .publish(vsock.to_path_buf(), guest_port, ANY_LOOPBACK_PORT, || None)
            .await
            .unwrap()
            .host
    }

    /// A host port another program holds is refused saying so, and what to do.
    #[tokio::test]
    async fn a_host_port_in_use_says_to_pick_another() {
        let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = holder.local_addr().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let refused = Published::default()
            .publish(dir.path().join("vsock.sock"), 3000, taken, || None)
            .await
            .map(|port| port.host)
            .unwrap_err();
        assert!(
            refused.contains(&format!("cannot listen on {taken}")),
            "{refused}"
        );
        assert!(refused.contains("pick another --host-port"), "{refused}");
    }

    /// A guest agent that takes the connection and never answers: the host
    /// connection to the published port ends once the agent had its time to answer.
    #[tokio::test(start_paused = true)]
    async fn a_silent_agent_does_not_hold_a_published_connection_forever() {
        let dir = tempfile::tempdir().unwrap();
        let vsock = dir.path().join("vsock.sock");
        let silent = tokio::net::UnixListener::bind(&vsock).unwrap();
        let published = Published::default();
        let at = publish_on_any_port(&published, &vsock, 8080).await;
        let mut client = TcpStream::connect(at).await.unwrap();
        let (_held, _) = silent.accept().await.unwrap();
        let mut byte = [0u8; 1];
        let ended =
            tokio::time::timeout(crate::exec::AGENT_TIMEOUT * 2, client.read(&mut byte)).await;
        assert!(
            matches!(ended, Ok(Ok(0)) | Ok(Err(_))),
            "still open: {ended:?}"
        );
    }

    /// Takes the next connection to a fake guest agent at `listener` through the
    /// VMM's hybrid handshake, `Hello` and a `ConnectPort`, and answers that with
    /// `answer`.
    async fn take_connect_port(
        listener: &tokio::net::UnixListener,
        answer: &AgentMessage,
    ) -> Option<tokio::net::UnixStream> {
        let (mut stream, _) = listener.accept().await.ok()?;
        let mut line = Vec::new();
        while line.last() != Some(&b'\n') {
            line.push(stream.read_u8().await.unwrap());
        }
        stream.write_all(b"OK 1024\n").await.unwrap();
        let hello = FrameReader::new(&mut stream).next::<ClientMessage>().await;
        assert!(
            matches!(hello, Ok(Some(ClientMessage::Hello(_)))),
            "{hello:?}"
        );
        let hello_ok = AgentMessage::HelloOk {
            agent_version: "test".into(),
            protocol_version: guest_agent::protocol::PROTOCOL_VERSION,
        };
        write_frame(&mut stream, &hello_ok).await.unwrap();
        let request = FrameReader::new(&mut stream).next::<ClientMessage>().await;
        assert!(
            matches!(request, Ok(Some(ClientMessage::ConnectPort(_)))),
            "{request:?}"
        );
        write_frame(&mut stream, answer).await.unwrap();
        Some(stream)
    }

    /// A guest agent listening on `vsock` (behind the VMM's hybrid handshake) that
    /// answers each `ConnectPort` with `answer`, and keeps the connection open; each
    /// answer is reported on the channel returned.
    fn fake_agent(
        vsock: &std::path::Path,
        answer: AgentMessage,
    ) -> tokio::sync::mpsc::UnboundedReceiver<()> {
        let listener = tokio::net::UnixListener::bind(vsock).unwrap();
        let (answered_tx, answered) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Some(stream) = take_connect_port(&listener, &answer).await {
                held.push(stream);
                let _ = answered_tx.send(());
            }
        });
        answered
    }

    /// A guest server answers an upload it does not read (a 413) and hangs up, and
    /// the VMM closes the vsock stream with the upload unread, which the relay reads
    /// as a break: the answer still queued for the client (it reads only once it has
    /// sent all) reaches it whole, not thrown away by a reset.
    #[tokio::test]
    async fn an_answer_queued_for_the_client_survives_the_guest_side_breaking() {
        let dir = tempfile::tempdir().unwrap();
        let vsock = dir.path().join("vsock.sock");
        let agent = tokio::net::UnixListener::bind(&vsock).unwrap();
        let published = Published::default();
        let at = publish_on_any_port(&published, &vsock, 8080).await;
        // A small receive buffer: most of the answer stays queued on the host side.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut client = socket.connect(at).await.unwrap();
        client.write_all(&[1u8; 16 * 1024]).await.unwrap();
        let answer: Vec<u8> = (0..12 * 1024).map(|i| (i % 251) as u8).collect();
        let mut guest = take_connect_port(&agent, &AgentMessage::Connected)
            .await
            .unwrap();
        guest.write_all(&answer).await.unwrap();
        // The upload reaches the guest's side, unread; closing it then is a break.
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(guest);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut received = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), client.read_to_end(&mut received))
            .await
            .expect("the client's connection was held");
        assert!(
            received == answer,
            "the client got {} of the answer's {} bytes, then {read:?}",
            received.len(),
            answer.len()
        );
    }

    /// A port relayed while its publication was binding (a `vmctl agent` start with
    /// an MCP URL on that port) is not published: `refuse` is asked again, with the
    /// publications held still, before the publication is made.
    #[tokio::test]
    async fn a_port_relayed_while_its_publication_binds_is_not_published() {
        let published = Published::default();
        let vsock = PathBuf::from("/nonexistent/vsock.sock");
        let asked = std::sync::atomic::AtomicUsize::new(0);
        // Allowed before the bind, relayed by the time it is done.
        let relayed_meanwhile = || {
            (asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0)
                .then(|| "relayed from the host".to_string())
        };
        let refused = published
            .publish(vsock, 5432, ANY_LOOPBACK_PORT, relayed_meanwhile)
            .await;
        assert_eq!(refused, Err("relayed from the host".to_string()));
        assert!(published.list().is_empty());
        let held_still = published.while_unchanged(|ports| ports.contains(&5432));
        assert_eq!(held_still, Ok(false));
    }

    /// A publication ended by mistake's fix: its open connections close with it, and
    /// its address is free when `unpublish` answers, for a publication there again.
    #[tokio::test]
    async fn unpublishing_closes_the_connections_and_frees_the_address() {
        let dir = tempfile::tempdir().unwrap();
        let vsock = dir.path().join("vsock.sock");
        let mut connected = fake_agent(&vsock, AgentMessage::Connected);
        let published = Published::default();
        let at = publish_on_any_port(&published, &vsock, 8080).await;
        let mut client = TcpStream::connect(at).await.unwrap();
        connected.recv().await.unwrap();

        assert_eq!(published.unpublish(8080).await.unwrap(), at);
        assert!(published.list().is_empty());
        let again = std::net::TcpListener::bind(at);
        assert!(again.is_ok(), "{at} is not free: {again:?}");
        let mut got = Vec::new();
        let ended = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut got))
            .await
            .expect("the connection outlived its publication");
        assert!(got.is_empty(), "{ended:?}");
        assert!(published.unpublish(8080).await.is_err());
    }

    /// Nothing in the VM listens on the published port: its client is reset, not
    /// given an empty answer it could take for the server's.
    #[tokio::test]
    async fn a_connection_nothing_in_the_vm_takes_is_reset() {
        let dir = tempfile::tempdir().unwrap();
        let vsock = dir.path().join("vsock.sock");
        let refusal = AgentMessage::Error {
            message: "cannot connect to guest port 8080: connection refused".into(),
        };
        let _answered = fake_agent(&vsock, refusal);
        let published = Published::default();
        let at = publish_on_any_port(&published, &vsock, 8080).await;
        let mut client = TcpStream::connect(at).await.unwrap();
        let mut got = Vec::new();
        let ended = tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut got))
            .await
            .expect("the refused connection was held");
        assert!(
            ended
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
            "not reset: {ended:?}"
        );
    }

    /// Past the limit, a connection is reset at once, whatever publication it came
    /// to; one is taken again once a connection ends.
    #[tokio::test]
    async fn connections_past_the_limit_are_reset() {
        let dir = tempfile::tempdir().unwrap();
        let vsock = dir.path().join("vsock.sock");
        let agent = tokio::net::UnixListener::bind(&vsock).unwrap();
        let connected = AgentMessage::Connected;
        let published = Published::with_limit(2);
        let first = publish_on_any_port(&published, &vsock, 8080).await;
        let second = publish_on_any_port(&published, &vsock, 8081).await;
        let held = TcpStream::connect(first).await.unwrap();
        let guest_side = take_connect_port(&agent, &connected).await.unwrap();
        let _held_too = TcpStream::connect(second).await.unwrap();
        let _guest_side_too = take_connect_port(&agent, &connected).await.unwrap();
        for at in [first, second] {
            let mut refused = TcpStream::connect(at).await.unwrap();
            let ended = tokio::time::timeout(Duration::from_secs(10), refused.read(&mut [0u8; 1]))
                .await
                .expect("a connection past the limit was held");
            assert!(
                ended.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
                "not reset"
            );
        }
        // One ends, both its sides: its slot is free for the next.
        drop(held);
        drop(guest_side);
        let taken = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let _next = TcpStream::connect(first).await.unwrap();
                tokio::select! {
                    taken = take_connect_port(&agent, &connected) => return taken,
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        })
        .await;
        assert!(
            taken.is_ok_and(|stream| stream.is_some()),
            "no connection was forwarded after one ended"
        );
    }

    #[tokio::test]
    async fn publishing_again_as_asked_answers_with_the_same_address() {
        let published = Published::default();
        let vsock = PathBuf::from("/nonexistent/vsock.sock");
        let first = publish_on_any_port(&published, &vsock, 8123).await;
        let again = publish_on_any_port(&published, &vsock, 8123).await;
        assert_eq!(again, first);
        let same_port = published
            .publish(vsock.clone(), 8123, first, || None)
            .await
            .unwrap();
        assert_eq!(same_port.host, first);
        assert_eq!(published.list().len(), 1);

        // Asked for another host port or address, it says where it is published.
        let mut other_port = first;
        other_port.set_port(first.port().wrapping_add(1).max(1));
        let refused = published
            .publish(vsock.clone(), 8123, other_port, || None)
            .await;
        assert!(refused.is_err_and(|e| e.contains("already published at")));
        let other_address: SocketAddr = "0.0.0.0:0".parse().unwrap();
        assert!(published
            .publish(vsock, 8123, other_address, || None)
            .await
            .is_err());
    }
}
