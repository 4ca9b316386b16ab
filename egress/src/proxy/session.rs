//! TLS terminated for a destination with a secret: each request forwarded over
//! verified TLS with the secret set on the way out.

use std::net::SocketAddr;
use std::sync::Arc;

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::time::timeout;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::headers::{check_claims, claimed_authorities, host_header, path_of, wants_upgrade};
use super::kept::KeptUpstream;
use super::redact::Redactor;
use super::upstream::{
    connect_tcp, http1_client, prepare_request, relay_response, request_body, Ask,
};
use super::{
    error_response, serve_requests, InFlight, ProxyBody, ProxyConfig, ProxyError, Upstream,
};
use crate::log::Refusal;
use crate::rules::Injection;

/// The guest's side of a CONNECT whose TLS the proxy terminates, and the upstream
/// connection its requests go out on.
pub(super) struct Session {
    pub(super) config: Arc<ProxyConfig>,
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) target: String,
    /// Vetted at CONNECT time; reconnections use them rather than resolve again
    /// (a second lookup could answer a private address).
    pub(super) addrs: Vec<SocketAddr>,
    pub(super) upstream: KeptUpstream,
}

impl Session {
    /// Serves the guest's side once the CONNECT (`connect`, whose slot is held until
    /// the TLS handshake is done) is upgraded; each request inside takes a slot of
    /// its own ([`serve_requests`]).
    pub(super) async fn serve(
        self: Arc<Self>,
        on_upgrade: OnUpgrade,
        tls: Arc<rustls::ServerConfig>,
        connect: Arc<InFlight>,
    ) {
        let limits = self.config.limits.clone();
        let upgraded = match on_upgrade.await {
            Ok(upgraded) => upgraded,
            Err(e) => return tracing::debug!("CONNECT was not upgraded: {e}"),
        };
        let accept = TlsAcceptor::from(tls).accept(TokioIo::new(upgraded));
        let stream = match timeout(limits.header_timeout, accept).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                return tracing::debug!(
                    "TLS handshake with the guest for {} failed: {e}",
                    self.target
                )
            }
            Err(_) => {
                return tracing::debug!(
                    "TLS handshake with the guest for {} timed out",
                    self.target
                )
            }
        };
        drop(connect);
        let session = self.clone();
        let handler = move |req, in_flight: Arc<InFlight>| {
            let session = session.clone();
            async move {
                let response = session.forward(req, &in_flight).await;
                response.unwrap_or_else(|e| error_response(&e))
            }
        };
        let served = serve_requests(TokioIo::new(stream), self.config.clone(), None, handler).await;
        if let Err(e) = served {
            tracing::debug!("terminated TLS connection for {} ended: {e}", self.target);
        }
    }

    /// Forwards one request from inside the terminated TLS, with the secret set.
    pub(super) async fn forward(
        &self,
        mut req: Request<Incoming>,
        in_flight: &Arc<InFlight>,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let config = &self.config;
        if req.method() == Method::CONNECT {
            return Err(ProxyError::BadRequest(
                "CONNECT inside a CONNECT tunnel is not supported".into(),
            ));
        }
        let ask = Ask {
            host: self.host.clone(),
            port: self.port,
            kind: "tls-request",
            method: req.method().to_string(),
            what: format!(
                "{} https://{}{}",
                req.method(),
                self.target,
                path_of(req.uri())
            ),
        };
        let claims = claimed_authorities(Some(req.uri()), req.headers())?;
        if claims.is_empty() {
            return Err(ProxyError::BadRequest(
                "the request has no Host header".into(),
            ));
        }
        let expected = format!("CONNECT target {}", self.target);
        if let Err(e) = check_claims(claims, &self.host, self.port, 443, &expected) {
            return Err(ask.refuse(config, Refusal::HostMismatch, &e.to_string(), e));
        }
        // The policy may have changed since the CONNECT; the secret may have too.
        let decision = ask.decide(config)?;
        let injection = config.rules.injection(&self.host, self.port);
        let tripwire = injection.as_ref().map(|injection| {
            config.tripwire(
                &injection.secret,
                injection.secret_value.expose().as_bytes(),
            )
        });
        if let (Some(injection), Some(tripwire)) = (&injection, &tripwire) {
            if tripwire.tripped() {
                let rule = format!(
                    "secret {} withdrawn: responses held starts of it without the rest {} \
                     times, as when the guest probes for it (set it anew, with a new value, \
                     to send it again)",
                    injection.secret,
                    super::redact::PROBES_TOLERATED
                );
                config.log.record(&ask.withdrawal(&injection.secret, &rule));
                return Err(ProxyError::Refused {
                    what: ask.what.clone(),
                    rule,
                });
            }
        }
        config
            .log
            .record(&ask.entry(true, &decision.rule, injection.as_ref()));

        let guest_upgrade = wants_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        prepare_request(&mut parts, host_header(&self.host, self.port, 443));
        let redactor = injection.as_ref().and_then(|injection| {
            inject(&mut parts.headers, injection);
            Redactor::for_secret(
                injection.value.as_bytes(),
                injection.secret_value.expose().as_bytes(),
            )
            .map(|redactor| match &tripwire {
                Some(tripwire) => redactor.watched_by(tripwire.clone()),
                None => redactor,
            })
        });
        let req = Request::from_parts(parts, request_body(body, &ask, config));
        let response = (self.upstream)
            .send(&self.target, req, || self.connect_upstream())
            .await?;
        relay_response(response, guest_upgrade, redactor, ask, in_flight)
    }

    /// A verified TLS connection to the destination, SNI = the CONNECT host.
    pub(super) async fn connect_upstream(&self) -> Result<Upstream, ProxyError> {
        let config = &self.config;
        let limit = config.limits.connect_timeout;
        let tcp = connect_tcp(config, &self.addrs, &self.target).await?;
        let name = ServerName::try_from(self.host.clone()).map_err(|e| {
            ProxyError::BadRequest(format!("{} is not a TLS server name: {e}", self.host))
        })?;
        let handshake = TlsConnector::from(config.upstream_tls.clone()).connect(name, tcp);
        let tls = timeout(limit, handshake)
            .await
            .map_err(|_| ProxyError::Timeout {
                what: "the TLS handshake with",
                target: self.target.clone(),
                after: limit,
            })?
            .map_err(|source| ProxyError::UpstreamTls {
                target: self.target.clone(),
                source,
            })?;
        http1_client(TokioIo::new(tls), &self.target).await
    }
}

/// Sets the secret's header (replacing what the guest sent) and removes the headers
/// the binding says to. Nothing else, and never anything in the body.
pub(super) fn inject(headers: &mut HeaderMap, injection: &Injection) {
    for name in &injection.remove {
        headers.remove(name);
    }
    let mut value = injection.value.clone();
    value.set_sensitive(true);
    headers.insert(injection.header.clone(), value);
    // The response is searched for the secret; a compressed one would hide it, and
    // so would a range that starts inside it (an echo of the request, from byte 1).
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    headers.remove(header::RANGE);
    headers.remove(header::IF_RANGE);
    // A WebSocket's compression (permessage-deflate) would hide it on the upgraded
    // connection the same way.
    headers.remove(header::SEC_WEBSOCKET_EXTENSIONS);
}
