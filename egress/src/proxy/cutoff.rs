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
        cut: false,
    })
}

struct CutOffBody {
    inner: ProxyBody,
    /// In a mutex, which no one locks, for the Sync a boxed body needs.
    cutoff: Mutex<Cutoff>,
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
        let cutoff = this
            .cutoff
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // A body at its end is not cut off: it has all gone through already.
        if !this.inner.is_end_stream() {
            if let Poll::Ready(why) = cutoff.as_mut().poll(cx) {
                this.cut = true;
                return Poll::Ready(Some(Err(why.into())));
            }
        }
        Pin::new(&mut this.inner).poll_frame(cx)
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

    /// A body whose frames come from a channel, never ending while its sender lives.
    struct Streamed(tokio::sync::mpsc::Receiver<Bytes>);

    impl Body for Streamed {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.0
                .poll_recv(cx)
                .map(|data| data.map(|data| Ok(Frame::data(data))))
        }
    }

    #[tokio::test]
    async fn a_body_goes_on_until_its_cutoff_then_ends_with_its_reason() {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let (cut, cut_now) = tokio::sync::oneshot::channel::<()>();
        let mut body = cut_off(Streamed(rx).boxed(), async move {
            let _ = cut_now.await;
            "the policy now refuses it"
        });
        tx.send(Bytes::from_static(b"first")).await.unwrap();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "first");
        cut.send(()).unwrap();
        tx.send(Bytes::from_static(b"after the cutoff"))
            .await
            .unwrap();
        let ended = body.frame().await.expect("an error frame");
        assert_eq!(
            ended.err().map(|e| e.to_string()).as_deref(),
            Some("the policy now refuses it")
        );
        assert!(body.frame().await.is_none(), "frames after the cutoff");
        assert!(body.is_end_stream());
    }

    /// A body whose last bytes have gone ends as it would have, cutoff or not.
    #[tokio::test]
    async fn a_body_at_its_end_is_not_cut_off() {
        let (cut, cut_now) = tokio::sync::oneshot::channel::<()>();
        let whole = http_body_util::Full::new(Bytes::from_static(b"all of it"))
            .map_err(|never| match never {})
            .boxed();
        let mut body = cut_off(whole, async move {
            let _ = cut_now.await;
            "the policy now refuses it"
        });
        let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(data, "all of it");
        cut.send(()).unwrap();
        assert!(body.frame().await.is_none(), "cut off at its end");
    }
}
