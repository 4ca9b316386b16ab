//! The upstream connection a guest's kept-alive connection goes on using.

use std::future::Future;

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::sync::Mutex;

use super::{ProxyBody, ProxyError, Upstream};

/// The upstream connection of one guest connection (or of one terminated TLS
/// session), kept for its next request to the same target. Without it, each request
/// of a kept-alive guest connection opened an upstream connection of its own: each
/// took a token of the connect rate, and left a port in TIME_WAIT.
#[derive(Default)]
pub(super) struct KeptUpstream {
    /// The target it goes to (`host:port`), and the connection.
    slot: Mutex<Option<(String, Upstream)>>,
}

impl KeptUpstream {
    /// Whether the next request to `target` would go on the kept connection (it goes
    /// there and is open, for now).
    pub(super) async fn goes_to(&self, target: &str) -> bool {
        self.slot
            .lock()
            .await
            .as_ref()
            .is_some_and(|(kept_target, sender)| kept_target == target && !sender.is_closed())
    }

    /// Sends `req` to `target` on the kept connection if it goes there and is open,
    /// else on a new one from `connect`, which is then kept. A request a stale kept
    /// connection did not take is retried once on a new one.
    pub(super) async fn send<C, F>(
        &self,
        target: &str,
        req: Request<ProxyBody>,
        connect: C,
    ) -> Result<Response<Incoming>, ProxyError>
    where
        C: Fn() -> F,
        F: Future<Output = Result<Upstream, ProxyError>>,
    {
        // Held until the response's head has come: a guest connection's requests
        // are served one at a time anyway.
        let mut slot = self.slot.lock().await;
        let kept = slot
            .take()
            .filter(|(kept_target, sender)| kept_target == target && !sender.is_closed())
            .map(|(_, sender)| sender);
        let was_kept = kept.is_some();
        let mut sender = match kept {
            Some(sender) => sender,
            None => connect().await?,
        };
        let upstream_err = |source| ProxyError::Upstream {
            target: target.to_string(),
            source,
        };
        let response = match send_on(&mut sender, req).await {
            Ok(response) => response,
            Err((Some(req), _)) if was_kept => {
                sender = connect().await?;
                send_on(&mut sender, req)
                    .await
                    .map_err(|(_, e)| upstream_err(e))?
            }
            Err((_, e)) => return Err(upstream_err(e)),
        };
        *slot = Some((target.to_string(), sender));
        Ok(response)
    }
}

/// Sends on `sender` once it is ready; on failure, the request back if it was not
/// sent.
async fn send_on(
    sender: &mut Upstream,
    req: Request<ProxyBody>,
) -> Result<Response<Incoming>, (Option<Request<ProxyBody>>, hyper::Error)> {
    if let Err(e) = sender.ready().await {
        return Err((Some(req), e));
    }
    sender
        .try_send_request(req)
        .await
        .map_err(|mut e| (e.take_message(), e.into_error()))
}
