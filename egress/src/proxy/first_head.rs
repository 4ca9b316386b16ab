//! The connection's first request head, read before hyper parses it, so that the
//! commonest mistakes get an answer that says what was wrong.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::timeout;

use super::{Limits, ProxyError};

/// Reads the connection's first request head before hyper does, so that the
/// commonest failures (a client that is no HTTP proxy client, oversized or slow
/// headers) get an answer saying what was wrong: hyper's own are empty, or none
/// for a timeout. hyper then parses the head again from the returned bytes (which
/// may include more than the head). `None`: closed, or silent until the timeout or
/// until `displaced` (by a newer connection, past the bound on waiting ones).
pub(super) async fn read_first_head<S>(
    stream: &mut S,
    limits: &Limits,
    displaced: impl Future<Output = ()>,
) -> Result<Option<Vec<u8>>, ProxyError>
where
    S: AsyncRead + Unpin,
{
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    let read_head = async {
        loop {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return io::Result::Ok(false);
            }
            let searched = buf.len().saturating_sub(3);
            buf.extend_from_slice(&chunk[..n]);
            if head_end(&buf, searched).is_some() || buf.len() > limits.max_header_bytes {
                return Ok(true);
            }
        }
    };
    let cut_off = tokio::select! {
        read = timeout(limits.header_timeout, read_head) => match read {
            Ok(Ok(true)) => None,
            Ok(Ok(false)) | Ok(Err(_)) => return Ok(None),
            Err(_) => Some(ProxyError::HeadTimeout {
                after: limits.header_timeout,
            }),
        },
        () = displaced => Some(ProxyError::Displaced {
            limit: limits.max_waiting_connections,
        }),
    };
    match cut_off {
        // A connection that said nothing is just closed: there may be no HTTP client
        // at its end to read an answer.
        Some(_) if buf.is_empty() => return Ok(None),
        Some(err) => return Err(err),
        None => {}
    }
    match head_end(&buf, 0) {
        Some(end) if end <= limits.max_header_bytes => {
            check_request_line(&buf[..end])?;
            Ok(Some(buf))
        }
        _ => Err(ProxyError::HeadTooLarge {
            max: limits.max_header_bytes,
        }),
    }
}

/// Where the head in `buf` ends (after its empty line), looking from `from` on.
pub(super) fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    (from..buf.len()).find_map(|i| {
        let rest = &buf[i..];
        if rest.starts_with(b"\n\r\n") {
            Some(i + 3)
        } else if rest.starts_with(b"\n\n") {
            Some(i + 2)
        } else {
            None
        }
    })
}

/// Refuses a request line that is not `METHOD TARGET HTTP/1.x`.
pub(super) fn check_request_line(head: &[u8]) -> Result<(), ProxyError> {
    // Empty lines before a request are allowed (RFC 9112, 2.2).
    let start = head
        .iter()
        .position(|b| !matches!(b, b'\r' | b'\n'))
        .unwrap_or(head.len());
    let line = head[start..]
        .split(|b| *b == b'\n')
        .next()
        .unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let parts: Vec<&[u8]> = line.split(|b| *b == b' ').collect();
    let valid = match parts[..] {
        [method, target, version] => {
            !method.is_empty()
                && method
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b))
                && !target.is_empty()
                && target.iter().all(|b| b.is_ascii_graphic() || *b >= 0x80)
                && (version == b"HTTP/1.1" || version == b"HTTP/1.0")
        }
        _ => false,
    };
    if valid {
        return Ok(());
    }
    let mut shown = String::from_utf8_lossy(line).into_owned();
    if shown.len() > 100 {
        let cut = (0..=100)
            .rev()
            .find(|i| shown.is_char_boundary(*i))
            .unwrap_or(0);
        shown.truncate(cut);
        shown.push_str("...");
    }
    Err(ProxyError::MalformedRequestLine { line: shown })
}

/// Answers `err` on a connection hyper does not serve, then closes it.
pub(super) async fn answer_and_close<S>(mut stream: S, err: &ProxyError)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    tracing::debug!("egress proxy: {err}");
    let status = err.status();
    let body = format!("vmctl egress: {err}\n");
    let response = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    );
    let answer = async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await?;
        // Read (a bounded amount of) what the client sent: closing with unread data
        // would reset the connection, and the client might lose the answer.
        let mut sink = [0u8; 4096];
        let mut total = 0;
        while total < 64 * 1024 {
            let n = stream.read(&mut sink).await?;
            if n == 0 {
                break;
            }
            total += n;
        }
        io::Result::Ok(())
    };
    let _ = timeout(Duration::from_secs(1), answer).await;
}

/// A stream that first yields `prefix` (bytes already read from `inner`).
pub(super) struct Prefixed<S> {
    pub(super) prefix: Bytes,
    pub(super) inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.prefix.is_empty() {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        let n = self.prefix.len().min(buf.remaining());
        let taken = self.prefix.split_to(n);
        buf.put_slice(&taken);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
