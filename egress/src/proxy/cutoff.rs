//! Bodies that end early: once what let a stream begin no longer holds (the policy
//! now refuses its host, or the secret it carries was removed), a body that may last
//! for hours (server-sent events, a long upload) ends with an error, as a tunnel
//! closes, rather than going on to its end.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use super::{BoxError, ProxyBody};

/// What ends a body, once ready, with the reason it gives.
type Cutoff = Pin<Box<dyn Future<Output = &'static str> + Send>>;

/// `inner`, ended with an error (the reason `cutoff` gives) once `cutoff` is ready.
pub(super) fn cut_off(
    inner: ProxyBody,
    cutoff: impl Future<Output = &'static str> + Send + 'static,
) -> ProxyBody {
    http_body_util::BodyExt::boxed(CutOffBody {
        inner,
        cutoff: Mutex::new(Box::pin(cutoff)),
        refused: None,
        cut: false,
    })
}

struct CutOffBody {
    inner: ProxyBody,
    /// In a mutex, which no one locks, for the Sync a boxed body needs.
    cutoff: Mutex<Cutoff>,
    /// The cutoff's reason, once it was ready (a finished future is not polled again).
    refused: Option<&'static str>,
    cut: bool,
}

impl Body for CutOffBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.cut {
            return Poll::Ready(None);
        }
        if this.refused.is_none() {
            let cutoff = this
                .cutoff
                .get_mut()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Poll::Ready(why) = cutoff.as_mut().poll(cx) {
                this.refused = Some(why);
            }
        }
        let frame = Pin::new(&mut this.inner).poll_frame(cx);
        let Some(why) = this.refused else {
            return frame;
        };
        // A body at its end is not cut off: all of it went through already. Whether
        // it is at its end only a poll tells: a chunked body knows it at its last
        // chunk, and trailers come after the data.
        match frame {
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Ready(Some(Ok(trailers))) if trailers.is_trailers() => {
                Poll::Ready(Some(Ok(trailers)))
            }
            Poll::Ready(Some(Err(error))) => {
                this.cut = true;
                Poll::Ready(Some(Err(error)))
            }
            Poll::Ready(Some(Ok(_))) | Poll::Pending => {
                this.cut = true;
                Poll::Ready(Some(Err(why.into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.cut || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A body whose frames come from a channel, never ending while its sender lives,
    /// and not knowing it has ended until a poll finds the sender gone, as a chunked
    /// body from hyper.
    struct Streamed(tokio::sync::mpsc::Receiver<Frame<Bytes>>);

    impl Body for Streamed {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.0.poll_recv(cx).map(|frame| frame.map(Ok))
        }
    }

    const REASON: &str = "the policy now refuses it";

    /// `inner`, cut off once the returned sender sends.
    fn with_cutoff(inner: ProxyBody) -> (tokio::sync::oneshot::Sender<()>, ProxyBody) {
        let (cut, cut_now) = tokio::sync::oneshot::channel::<()>();
        let body = cut_off(inner, async move {
            let _ = cut_now.await;
            REASON
        });
        (cut, body)
    }

    /// A [`Streamed`] body's sender, its cutoff's, and the body cut off.
    fn streamed_with_cutoff() -> (
        tokio::sync::mpsc::Sender<Frame<Bytes>>,
        tokio::sync::oneshot::Sender<()>,
        ProxyBody,
    ) {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let (cut, body) = with_cutoff(Streamed(rx).boxed());
        (tx, cut, body)
    }

    fn data(bytes: &'static [u8]) -> Frame<Bytes> {
        Frame::data(Bytes::from_static(bytes))
    }

    #[tokio::test]
    async fn a_body_goes_on_until_its_cutoff_then_ends_with_its_reason() {
        let (tx, cut, mut body) = streamed_with_cutoff();
        tx.send(data(b"first")).await.unwrap();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "first");
        cut.send(()).unwrap();
        tx.send(data(b"after the cutoff")).await.unwrap();
        let ended = body.frame().await.expect("an error frame");
        assert_eq!(ended.err().map(|e| e.to_string()).as_deref(), Some(REASON));
        assert!(body.frame().await.is_none(), "frames after the cutoff");
        assert!(body.is_end_stream());
    }

    /// A body whose last bytes have gone ends as it would have, cutoff or not.
    #[tokio::test]
    async fn a_body_at_its_end_is_not_cut_off() {
        let whole = http_body_util::Full::new(Bytes::from_static(b"all of it"))
            .map_err(|never| match never {})
            .boxed();
        let (cut, mut body) = with_cutoff(whole);
        let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(data, "all of it");
        cut.send(()).unwrap();
        assert!(body.frame().await.is_none(), "cut off at its end");
    }

    /// A chunked body learns it has ended only when polled after its last chunk:
    /// a cutoff ready by then does not turn that end into an error.
    #[tokio::test]
    async fn a_streamed_body_whose_last_chunk_went_is_not_cut_off() {
        let (tx, cut, mut body) = streamed_with_cutoff();
        tx.send(data(b"last")).await.unwrap();
        drop(tx);
        let last = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(last, "last");
        cut.send(()).unwrap();
        assert!(body.frame().await.is_none(), "cut off at its end");
    }

    /// Trailers come after all the data: a cutoff ready before them lets them through.
    #[tokio::test]
    async fn trailers_after_the_last_chunk_are_not_cut_off() {
        let (tx, cut, mut body) = streamed_with_cutoff();
        tx.send(data(b"last")).await.unwrap();
        let mut trailers = hyper::HeaderMap::new();
        trailers.insert("grpc-status", hyper::header::HeaderValue::from_static("0"));
        tx.send(Frame::trailers(trailers)).await.unwrap();
        drop(tx);
        body.frame().await.unwrap().unwrap();
        cut.send(()).unwrap();
        let frame = body
            .frame()
            .await
            .expect("the trailers")
            .expect("not an error");
        assert_eq!(
            frame.trailers_ref().and_then(|t| t.get("grpc-status")),
            Some(&hyper::header::HeaderValue::from_static("0"))
        );
        assert!(body.frame().await.is_none());
    }
}
