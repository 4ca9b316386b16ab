//! A byte stream that first yields bytes already read from it (by a frame reader)
//! before reading on: what a connection becomes once it switches from frames to raw
//! bytes (`ConnectPort` → `Connected`).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `inner`, with `prefix` read before it. Writes go straight to `inner`.
#[derive(Debug)]
pub struct RawStream<S> {
    prefix: Vec<u8>,
    /// How much of `prefix` was already returned.
    pos: usize,
    inner: S,
}

impl<S> RawStream<S> {
    pub fn new(prefix: Vec<u8>, inner: S) -> Self {
        Self {
            prefix,
            pos: 0,
            inner,
        }
    }

    /// The prefix bytes not read yet.
    pub fn buffered(&self) -> &[u8] {
        self.prefix.get(self.pos..).unwrap_or_default()
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The unread prefix bytes and the stream.
    pub fn into_parts(mut self) -> (Vec<u8>, S) {
        self.prefix.drain(..self.pos.min(self.prefix.len()));
        (self.prefix, self.inner)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for RawStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let rest = this.prefix.get(this.pos..).unwrap_or_default();
        if !rest.is_empty() {
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.pos += n;
            if this.pos >= this.prefix.len() {
                // Free the prefix once consumed (it may be a frame reader's buffer).
                this.prefix = Vec::new();
                this.pos = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for RawStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn prefix_comes_first_then_the_stream() {
        let (a, mut b) = tokio::io::duplex(64);
        let mut raw = RawStream::new(b"hello ".to_vec(), a);
        b.write_all(b"world").await.unwrap();
        drop(b);
        let mut small = [0u8; 4];
        raw.read_exact(&mut small).await.unwrap();
        assert_eq!(&small, b"hell");
        assert_eq!(raw.buffered(), b"o ");
        let mut rest = Vec::new();
        raw.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"o world");
    }

    #[tokio::test]
    async fn writes_and_into_parts() {
        let (a, mut b) = tokio::io::duplex(64);
        let mut raw = RawStream::new(b"abc".to_vec(), a);
        raw.write_all(b"out").await.unwrap();
        let mut got = [0u8; 3];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"out");
        let mut one = [0u8; 1];
        raw.read_exact(&mut one).await.unwrap();
        let (rest, _inner) = raw.into_parts();
        assert_eq!(rest, b"bc");
    }
}
