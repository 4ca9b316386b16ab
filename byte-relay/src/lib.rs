//! Relays bytes between two streams (a port relay, a proxy's tunnel, the guest's
//! connection to a host service).
//!
//! Each way runs on its own until its source ends, then passes that end on as a
//! half-close. `tokio::io::copy_bidirectional` instead returns at the first error in
//! either way and drops both streams: a server that answers and closes while its
//! client is still sending (an upload refused early, a command that exits before
//! reading all its input) breaks the client's way, and the answer, already read by
//! the relay or waiting in the socket, was lost with it.

use std::io;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

/// How each way of a relay ended: the bytes it carried, or what broke it.
#[derive(Debug)]
pub struct Relayed {
    pub a_to_b: io::Result<u64>,
    pub b_to_a: io::Result<u64>,
}

impl Relayed {
    /// The first way's error, if a way broke.
    pub fn error(&self) -> Option<&io::Error> {
        self.a_to_b.as_ref().err().or(self.b_to_a.as_ref().err())
    }
}

/// Relays `a` and `b` until both ways have ended.
pub async fn both_ways<A, B>(a: A, b: B) -> Relayed
where
    A: AsyncRead + AsyncWrite,
    B: AsyncRead + AsyncWrite,
{
    let (a_reader, a_writer) = tokio::io::split(a);
    let (b_reader, b_writer) = tokio::io::split(b);
    let (a_to_b, b_to_a) = tokio::join!(one_way(a_reader, b_writer), one_way(b_reader, a_writer));
    Relayed { a_to_b, b_to_a }
}

/// Copies `from` to `to` until `from` ends or a side fails, then closes `to`'s
/// sending side: its reader sees the end (after a failure too, so that a peer
/// waiting for more does not wait forever).
pub async fn one_way<R, W>(mut from: R, mut to: W) -> io::Result<u64>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let copied = tokio::io::copy(&mut from, &mut to).await;
    // Fails too when `to` is what broke: nothing is left to tell it.
    let _ = to.shutdown().await;
    copied
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::UnixStream;

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

    /// A way that breaks on its read (the server reset its connection) still ends
    /// the other side's reading: "after a failure too" in [`one_way`] (the tests above
    /// pass without it).
    #[tokio::test]
    async fn a_reset_from_the_server_ends_the_clients_reading() {
        use tokio::net::{TcpListener, TcpStream};
        let (mut client, relay_client_side) = UnixStream::pair().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let relay_server_side = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let relay = tokio::spawn(both_ways(relay_client_side, relay_server_side));
        // Closing with a zero linger sends a reset: the relay's read from it fails.
        server.set_zero_linger().unwrap();
        drop(server);
        // The client sends nothing and keeps its side open: only the relay's
        // shutdown after the failed way can end this read.
        let mut received = Vec::new();
        let ended = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            client.read_to_end(&mut received),
        )
        .await;
        assert!(
            matches!(ended, Ok(Ok(0))),
            "the client's read did not end after the server's reset: {ended:?}"
        );
        drop(client);
        let relayed = relay.await.unwrap();
        assert!(relayed.b_to_a.is_err(), "{relayed:?}");
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
        assert_eq!(relayed.a_to_b.unwrap(), 7);
        assert_eq!(relayed.b_to_a.unwrap(), 6);
    }
}
