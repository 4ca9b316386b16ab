//! `CONNECT host:port`: a tunnel, or TLS terminated for a destination with a secret.

use std::sync::Arc;

use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::ext::ReasonPhrase;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::headers::{display_target, normalize_host};
use super::kept::KeptUpstream;
use super::session::Session;
use super::upstream::{connect_tcp, vetted_addresses, Ask};
use super::{empty, InFlight, ProxyBody, ProxyConfig, ProxyError};

pub(super) async fn connect(
    mut req: Request<Incoming>,
    in_flight: &Arc<InFlight>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let config = &in_flight.config;
    let (host, port) = connect_target(req.uri())?;
    let target = display_target(&host, port);
    let ask = Ask {
        host: host.clone(),
        port,
        kind: "connect",
        method: "CONNECT".into(),
        what: format!("CONNECT {target}"),
    };
    let decision = ask.decide(config)?;
    let addrs = vetted_addresses(config, &ask, &decision).await?;
    let injection = config.rules.injection(&host, port);
    config
        .log
        .record(&ask.entry(true, &decision.rule, injection.as_ref()));
    let on_upgrade = hyper::upgrade::on(&mut req);
    if injection.is_none() {
        // Connect before answering, so a dead upstream is a 502, not a dead tunnel.
        let upstream = connect_tcp(config, &addrs, &target).await?;
        tokio::spawn(tunnel(on_upgrade, upstream, in_flight.clone(), ask));
    } else {
        let tls = config.ca.server_config_for(&host)?;
        let session = Arc::new(Session {
            config: config.clone(),
            host,
            port,
            target,
            addrs,
            upstream: KeptUpstream::default(),
        });
        tokio::spawn(session.serve(on_upgrade, tls, in_flight.clone()));
    }
    let mut response = Response::new(empty());
    response
        .extensions_mut()
        .insert(ReasonPhrase::from_static(b"Connection established"));
    Ok(response)
}

/// Relays raw bytes between the guest and `upstream`: TLS the proxy does not touch.
pub(super) async fn tunnel(
    on_upgrade: OnUpgrade,
    upstream: TcpStream,
    in_flight: Arc<InFlight>,
    ask: Ask,
) {
    match on_upgrade.await {
        Ok(upgraded) => {
            let guest = TokioIo::new(upgraded);
            let relay = byte_relay::both_ways(guest, upstream);
            relay_while_allowed(relay, &ask, &in_flight.config, "tunnel").await;
        }
        Err(e) => tracing::debug!("CONNECT was not upgraded: {e}"),
    }
}

/// Runs `relay` (a tunnel, an upgraded connection: `what`) until it ends, or until
/// the policy no longer allows what `ask` asked for.
pub(super) async fn relay_while_allowed(
    relay: impl std::future::Future<Output = byte_relay::Relayed>,
    ask: &Ask,
    config: &ProxyConfig,
    what: &str,
) {
    tokio::select! {
        relayed = relay => {
            if let Some(e) = relayed.error() {
                tracing::debug!("{what} ended: {e}");
            }
        }
        () = ask.until_refused(config) => {}
    }
}

/// `host:port` of a CONNECT request, normalised.
pub(super) fn connect_target(uri: &Uri) -> Result<(String, u16), ProxyError> {
    let authority = uri
        .authority()
        .ok_or_else(|| ProxyError::BadRequest("CONNECT needs a host:port target".into()))?;
    let port = authority
        .port_u16()
        .filter(|port| *port != 0)
        .ok_or_else(|| {
            ProxyError::BadRequest(format!("CONNECT {authority}: the target needs a port"))
        })?;
    Ok((normalize_host(authority.host())?, port))
}
