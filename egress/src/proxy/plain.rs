//! Plain HTTP in absolute form (`GET http://host/path`), forwarded without secrets.

use std::sync::Arc;

use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use super::headers::{
    check_claims, claimed_authorities, display_target, host_header, normalize_host, wants_upgrade,
};
use super::kept::KeptUpstream;
use super::upstream::{
    connect_tcp, http1_client, prepare_request, relay_response, request_body, vetted_addresses, Ask,
};
use super::{InFlight, ProxyBody, ProxyError};
use crate::log::Refusal;

pub(super) async fn plain_http(
    mut req: Request<Incoming>,
    in_flight: &Arc<InFlight>,
    kept: &KeptUpstream,
) -> Result<Response<ProxyBody>, ProxyError> {
    let config = &in_flight.config;
    let (host, port) = absolute_target(req.uri())?;
    let target = display_target(&host, port);
    let expected = format!("the request URI's {target}");
    let ask = Ask {
        host: host.clone(),
        port,
        kind: "http",
        method: req.method().to_string(),
        what: format!("{} http://{target}", req.method()),
    };
    // The URI names the target; Host headers (optional in HTTP/1.0) must agree.
    let claims = claimed_authorities(None, req.headers())?;
    if let Err(e) = check_claims(claims, &host, port, 80, &expected) {
        return Err(ask.refuse(config, Refusal::HostMismatch, &e.to_string(), e));
    }
    let decision = ask.decide(config)?;
    // Looked up for a new upstream connection only: a kept one's were when it was made,
    // and a lookup for each request of a kept-alive connection (apt's) spent the lookup
    // rate. (One that closes meanwhile looks them up as it connects again.)
    let addrs = match kept.goes_to(&target).await {
        true => None,
        false => Some(vetted_addresses(config, &ask, &decision).await?),
    };
    let mut entry = ask.entry(true, &decision.rule, None);
    if let Some(injection) = config.rules.injection(&host, port) {
        // A secret in clear text could be read on the way; it goes only over TLS.
        entry.rule = format!(
            "{}; secret {} not sent over plain HTTP",
            decision.rule, injection.secret
        );
    }
    config.log.record(&entry);

    let guest_upgrade = wants_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    prepare_request(&mut parts, host_header(&host, port, 80));
    let connect = || async {
        let addrs = match &addrs {
            Some(addrs) => addrs.clone(),
            None => vetted_addresses(config, &ask, &decision).await?,
        };
        let tcp = connect_tcp(config, &addrs, &target).await?;
        http1_client(TokioIo::new(tcp), &target).await
    };
    let req = Request::from_parts(parts, request_body(body, &ask, config));
    let response = kept.send(&target, req, connect).await?;
    relay_response(response, guest_upgrade, None, ask, in_flight)
}

/// `host:port` of an absolute-form `http://` request, normalised.
pub(super) fn absolute_target(uri: &Uri) -> Result<(String, u16), ProxyError> {
    let Some(authority) = uri.authority() else {
        return Err(ProxyError::BadRequest(
            "this is an HTTP proxy: send requests in absolute form (GET http://host/path) \
             or open a tunnel with CONNECT host:port"
                .into(),
        ));
    };
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(ProxyError::BadRequest(
                "https:// URLs go through a tunnel: CONNECT host:443".into(),
            ))
        }
        other => {
            return Err(ProxyError::BadRequest(format!(
                "unsupported scheme {other:?}: this proxy forwards http:// requests and CONNECT"
            )))
        }
    }
    Ok((
        normalize_host(authority.host())?,
        authority.port_u16().unwrap_or(80),
    ))
}
