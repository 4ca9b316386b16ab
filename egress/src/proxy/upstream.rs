//! Shared by CONNECT and plain HTTP: the policy's question, the vetted upstream
//! connection, and what goes back to the guest.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::{Response, StatusCode, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::http1 as client_http1;
use hyper::ext::ReasonPhrase;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::timeout;

use super::addresses::forbidden_destination;
use super::cutoff::cut_off;
use super::decode::{
    content_codings, decoding_for, headers_for_decoded, transfer_codings, DecodedBody,
};
use super::headers::{display_target, ends_in_chunked, has_token, strip_hop_by_hop, wants_upgrade};
use super::redact::{copy_redacted, RedactedBody, Redactor, SECRET_GONE};
use super::tunnels::relay_while_allowed;
use super::{boxed, InFlight, ProxyBody, ProxyConfig, ProxyError, Upstream};
use crate::log::{LogEntry, Refusal};
use crate::rules::{Decision, Injection};

/// One thing the guest asked for, as the policy checks and the log need it. A
/// tunnel or an upgraded connection keeps its own, to ask again while it lasts.
#[derive(Clone)]
pub(super) struct Ask {
    pub(super) host: String,
    pub(super) port: u16,
    /// `connect`, `http` or `tls-request`.
    pub(super) kind: &'static str,
    pub(super) method: String,
    /// How messages name it, e.g. `CONNECT api.example.com:443`.
    pub(super) what: String,
}

impl Ask {
    /// Asks the policy; a refusal is logged and becomes a 403 naming the rule.
    pub(super) fn decide(&self, config: &ProxyConfig) -> Result<Decision, ProxyError> {
        let decision = config.rules.decide(&self.host, self.port);
        if decision.allowed {
            return Ok(decision);
        }
        let refused = ProxyError::Refused {
            what: self.what.clone(),
            rule: decision.rule.clone(),
        };
        Err(self.refuse(config, Refusal::Policy, &decision.rule, refused))
    }

    /// Logs a refusal of kind `why` for `rule` (the reason in words) and passes `err`
    /// on.
    pub(super) fn refuse(
        &self,
        config: &ProxyConfig,
        why: Refusal,
        rule: &str,
        err: ProxyError,
    ) -> ProxyError {
        config.log.record(&self.refusal(why, rule));
        err
    }

    /// The log entry of a refusal of kind `why`.
    pub(super) fn refusal(&self, why: Refusal, rule: &str) -> LogEntry {
        let mut entry = self.entry(false, rule, None);
        entry.refusal = Some(why);
        entry
    }

    /// A log entry; with the secret's name (never its value) if one is injected.
    pub(super) fn entry(
        &self,
        allowed: bool,
        rule: &str,
        injection: Option<&Injection>,
    ) -> LogEntry {
        let mut entry = LogEntry::new(&self.host, self.port, allowed, rule, self.kind);
        entry.method = Some(self.method.clone());
        entry.secret = injection.map(|i| i.secret.clone());
        entry
    }

    /// A log entry for the refusal that records `secret`'s withdrawal: without the
    /// method, which the guest chooses, so that its retries repeat it exactly and
    /// are counted rather than written ([`crate::log`]).
    pub(super) fn withdrawal(&self, secret: &str, rule: &str) -> LogEntry {
        let mut entry = LogEntry::new(&self.host, self.port, false, rule, self.kind);
        entry.withdrawn_secret = Some(secret.to_owned());
        entry.refusal = Some(Refusal::SecretWithdrawn);
        entry
    }

    pub(super) fn target(&self) -> String {
        display_target(&self.host, self.port)
    }

    /// Returns once the policy refuses what was asked for (the refusal logged), asked
    /// every [`Limits::policy_recheck`]; never while it allows it.
    pub(super) async fn until_refused(&self, config: &ProxyConfig) {
        let mut tick = recheck_ticks(config).await;
        loop {
            tick.tick().await;
            if let Err(e) = self.decide(config) {
                tracing::info!("{e}; closing the open connection");
                return;
            }
        }
    }

    /// Returns once the secret `redactor` redacts is no longer the one bound to what
    /// was asked for (removed or replaced with `vmctl secret`, or withdrawn after
    /// probes), checked as often as the policy: a connection it authenticated closes.
    pub(super) async fn until_secret_withdrawn(&self, config: &ProxyConfig, redactor: &Redactor) {
        let mut tick = recheck_ticks(config).await;
        loop {
            tick.tick().await;
            let still_bound = config
                .rules
                .injection(&self.host, self.port)
                .is_some_and(|injection| redactor.redacts_value(injection.value.as_bytes()));
            if !still_bound || redactor.withdrawn() {
                let rule = "the secret it was opened with is no longer bound to it";
                let entry = match redactor.secret_name() {
                    Some(secret) => self.withdrawal(secret, rule),
                    None => self.refusal(Refusal::SecretWithdrawn, rule),
                };
                config.log.record(&entry);
                tracing::info!("{}: {rule}; closing the open connection", self.target());
                return;
            }
        }
    }

    /// Ready, with why, once what was asked for may no longer go on: the policy
    /// refuses it, or the secret `redactor` redacts (the one it carries) is no longer
    /// bound to it. What a body that outlives that is cut off with ([`cut_off`]).
    pub(super) async fn no_longer_allowed(
        self,
        config: Arc<ProxyConfig>,
        redactor: Option<Redactor>,
    ) -> &'static str {
        match redactor {
            None => {
                self.until_refused(&config).await;
                POLICY_REFUSES
            }
            Some(redactor) => tokio::select! {
                () = self.until_refused(&config) => POLICY_REFUSES,
                () = self.until_secret_withdrawn(&config, &redactor) => SECRET_GONE,
            },
        }
    }
}

/// The guest's request `body` for what `ask` asked, cut off once the policy refuses
/// its host: an upload may last long enough for the host to be refused meanwhile.
pub(super) fn request_body(body: Incoming, ask: &Ask, config: &Arc<ProxyConfig>) -> ProxyBody {
    cut_off(
        boxed(body),
        ask.clone().no_longer_allowed(config.clone(), None),
    )
}

/// Why a body ends once the policy refuses its host.
const POLICY_REFUSES: &str = "the policy no longer allows this host";

/// Ticks every [`Limits::policy_recheck`](super::Limits), the first one already gone:
/// what was allowed a moment ago needs no check at once.
async fn recheck_ticks(config: &ProxyConfig) -> tokio::time::Interval {
    // A zero period would make `interval` panic.
    let period = config.limits.policy_recheck.max(Duration::from_millis(10));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    tick
}

/// The addresses `host:port` resolves to, refused (and logged) if any of them is
/// local, private or otherwise forbidden: a name the guest controls must not reach
/// the host's or the cloud's internal services.
pub(super) async fn vetted_addresses(
    config: &ProxyConfig,
    ask: &Ask,
    decision: &Decision,
) -> Result<Vec<SocketAddr>, ProxyError> {
    let (host, port) = (ask.host.as_str(), ask.port);
    let target = display_target(host, port);
    if let Some(addr) = config.resolve_overrides.get(&target) {
        // It stands in for a lookup, and is counted as one.
        config.take_lookup(&target)?;
        return Ok(vec![*addr]);
    }
    let addrs = resolve(config, host, port, &target).await?;
    if addrs.is_empty() {
        return Err(ProxyError::NoAddress { target });
    }
    // Failing closed: without the host's networks, none can be told from another's.
    let host_networks = config
        .host_networks
        .get()
        .map_err(|source| ProxyError::HostAddresses {
            target: target.clone(),
            source,
        })?;
    let forbidden = addrs.iter().find_map(|addr| {
        forbidden_destination(addr.ip(), &host_networks).map(|reason| (addr.ip(), reason))
    });
    if let Some((ip, reason)) = forbidden {
        let rule = format!("{}, but {ip} is {reason}", decision.rule);
        let err = ProxyError::ForbiddenAddress {
            what: ask.what.clone(),
            target,
            ip,
            reason,
        };
        return Err(ask.refuse(config, Refusal::ForbiddenAddress, &rule, err));
    }
    Ok(addrs)
}

/// What `host` resolves to, within the limits' rate and number of lookups at once.
/// The lookup runs on a blocking thread (getaddrinfo), which holds its place among
/// `max_lookups` until the resolver answers, after `connect_timeout` too: a guest
/// asking for names nobody answers must not pile up threads.
async fn resolve(
    config: &ProxyConfig,
    host: &str,
    port: u16,
    target: &str,
) -> Result<Vec<SocketAddr>, ProxyError> {
    config.take_lookup(target)?;
    let host = host.to_owned();
    let limit = config.limits.connect_timeout;
    let looked_up = blocking_within(Arc::clone(config.lookups()), limit, move || {
        std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), port))
            .map(Iterator::collect::<Vec<SocketAddr>>)
    });
    match looked_up.await {
        Err(_) => Err(ProxyError::Timeout {
            what: "resolving",
            target: target.to_owned(),
            after: limit,
        }),
        Ok(Err(source)) => Err(ProxyError::Resolve {
            target: target.to_owned(),
            source,
        }),
        Ok(Ok(addrs)) => Ok(addrs),
    }
}

/// Runs `work` on a blocking thread once one of `places` is free, waiting at most
/// `limit` for both. The place is the thread's until `work` returns, however long
/// after `limit` that is.
pub(super) async fn blocking_within<T: Send + 'static>(
    places: Arc<tokio::sync::Semaphore>,
    limit: Duration,
    work: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> Result<io::Result<T>, tokio::time::error::Elapsed> {
    let run = async move {
        let Ok(place) = places.acquire_owned().await else {
            return Err(io::Error::other("no more places for blocking work"));
        };
        let done = tokio::task::spawn_blocking(move || {
            let _place = place;
            work()
        });
        done.await.map_err(io::Error::other)?
    };
    timeout(limit, run).await
}

/// The first of `addrs` that accepts a connection, within the limits' time and rate
/// of new connections.
pub(super) async fn connect_tcp(
    config: &ProxyConfig,
    addrs: &[SocketAddr],
    target: &str,
) -> Result<TcpStream, ProxyError> {
    config.take_connect(target)?;
    let limit = config.limits.connect_timeout;
    let mut last = ProxyError::NoAddress {
        target: target.to_string(),
    };
    for addr in addrs {
        match timeout(limit, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => {
                // Small writes (SSE events, keystrokes) must not wait for more.
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Ok(Err(source)) => {
                last = ProxyError::Connect {
                    target: target.to_string(),
                    source,
                }
            }
            Err(_) => {
                last = ProxyError::Timeout {
                    what: "connecting to",
                    target: target.to_string(),
                    after: limit,
                }
            }
        }
    }
    Err(last)
}

/// An HTTP/1.1 client on `io`, its connection driven by a task of its own.
pub(super) async fn http1_client<I>(io: I, target: &str) -> Result<Upstream, ProxyError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, connection) =
        client_http1::handshake(io)
            .await
            .map_err(|source| ProxyError::Upstream {
                target: target.to_string(),
                source,
            })?;
    let target = target.to_string();
    tokio::spawn(async move {
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!("upstream connection to {target} ended: {e}");
        }
    });
    Ok(sender)
}

/// Makes a guest request fit to send upstream: no hop-by-hop or proxy headers,
/// origin-form URI, a Host header.
pub(super) fn prepare_request(parts: &mut http::request::Parts, host: HeaderValue) {
    let upgrade = wants_upgrade(&parts.headers);
    // A chunked body goes on with all the guest's transfer codings: hyper took off
    // the final chunked and puts its own back, and those under it (`gzip, chunked`)
    // are still on the bytes, which the upstream must undo. Without the header, hyper
    // would send a GET's or HEAD's body of unknown length as none at all. (A request
    // whose codings end otherwise, hyper refused with 400, as RFC 9112 6.3 says.)
    let codings: Vec<HeaderValue> = if ends_in_chunked(&parts.headers) {
        parts
            .headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .cloned()
            .collect()
    } else {
        Vec::new()
    };
    // TE is hop-by-hop, but a guest that accepts trailers gets them only if this hop
    // asks for them too: hyper sends trailers only to a peer that said `TE: trailers`.
    let accepts_trailers = has_token(&parts.headers, header::TE, "trailers");
    strip_hop_by_hop(&mut parts.headers, upgrade);
    for coding in codings {
        parts.headers.append(header::TRANSFER_ENCODING, coding);
    }
    if accepts_trailers {
        parts
            .headers
            .insert(header::TE, HeaderValue::from_static("trailers"));
        // A sender of TE lists it in Connection too (RFC 9110, 10.1.4).
        parts
            .headers
            .append(header::CONNECTION, HeaderValue::from_static("te"));
    }
    let origin = parts
        .uri
        .path_and_query()
        .map_or("/", |path| path.as_str())
        .parse()
        .unwrap_or_else(|_| Uri::from_static("/"));
    parts.uri = origin;
    parts.version = Version::HTTP_11;
    // Ours, whatever the guest wrote (`API.TEST.:443` named the same host to the
    // policy, but an upstream may route it to another).
    parts.headers.insert(header::HOST, host);
}

/// Turns the upstream's response into the guest's: hop-by-hop headers removed, the
/// secret redacted, and for a 101 the two upgraded connections spliced together.
pub(super) fn relay_response(
    mut response: Response<Incoming>,
    guest_upgrade: Option<OnUpgrade>,
    redactor: Option<Redactor>,
    ask: Ask,
    in_flight: &Arc<InFlight>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let switching = response.status() == StatusCode::SWITCHING_PROTOCOLS;
    // The upgraded connection's splice watches the secret itself; a body does here.
    let body_ask = if switching {
        let Some(guest) = guest_upgrade else {
            return Err(ProxyError::UnaskedUpgrade {
                target: ask.target(),
            });
        };
        let upstream = hyper::upgrade::on(&mut response);
        tokio::spawn(splice(
            guest,
            upstream,
            redactor.clone(),
            in_flight.clone(),
            ask,
        ));
        None
    } else {
        Some(ask)
    };
    // First, so that nothing below, the host's log included, sees the secret in a
    // header an upstream quoted it in.
    if let Some(redactor) = &redactor {
        redactor.redact_headers(response.headers_mut());
    }
    // A response without a body has nothing to decode, whatever its coding.
    let bodiless = |ask: &Ask| {
        ask.method == "HEAD"
            || matches!(
                response.status(),
                StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED
            )
    };
    let (decoding, content_decoded) = match &body_ask {
        Some(ask) if !bodiless(ask) => {
            // A body the redactor reads must be plain bytes: one compressed anyway is
            // decoded. Otherwise the guest undoes the content codings itself.
            let content = match redactor {
                Some(_) => content_codings(response.headers()),
                None => Vec::new(),
            };
            let codings = [content.as_slice(), &transfer_codings(response.headers())].concat();
            let decoding = decoding_for(&codings).map_err(|named| {
                let target = ask.target();
                // The upstream chose this text: the guest is not shown it (the secret
                // may be in it, redacted or cut), the host's log is, escaped.
                guest_log::guest_warn!(
                    target = %target,
                    codings = ?bounded_text(&named),
                    "egress proxy: an upstream's response is in codings the proxy cannot decode"
                );
                ProxyError::UndecodableResponse {
                    target,
                    why: if redactor.is_some() {
                        "a response it cannot search for the secret is not passed on"
                    } else {
                        "a transfer coding the guest did not ask for would reach it unnamed"
                    },
                }
            })?;
            (decoding, !content.is_empty())
        }
        _ => (None, false),
    };
    // A Content-Length beside a Transfer-Encoding does not frame the body (RFC 9112,
    // 6.3), which hyper read as the coding says: passed on, it would cut the body the
    // guest's hop frames anew, or leave the guest waiting for more.
    if response.headers().contains_key(header::TRANSFER_ENCODING) {
        response.headers_mut().remove(header::CONTENT_LENGTH);
    }
    strip_hop_by_hop(response.headers_mut(), switching);
    if content_decoded {
        headers_for_decoded(response.headers_mut());
    } else if decoding.is_some() {
        // Only this hop's coding is undone: the representation, and so its
        // validators, are the same; its length in transfer is not known.
        response.headers_mut().remove(header::CONTENT_LENGTH);
    }
    let plain = move |inner: Incoming| match decoding {
        Some(coding) => DecodedBody::new(inner, coding).boxed(),
        None => boxed(inner),
    };
    if redactor.is_some() {
        // An upstream's own reason phrase could quote the secret: the guest gets the
        // standard one for the status.
        response.extensions_mut().remove::<ReasonPhrase>();
    }
    let cutoff =
        body_ask.map(|ask| ask.no_longer_allowed(in_flight.config.clone(), redactor.clone()));
    let body = move |inner: Incoming| match redactor {
        Some(redactor) => RedactedBody::new(plain(inner), redactor).boxed(),
        None => plain(inner),
    };
    Ok(match cutoff {
        Some(cutoff) => response.map(|inner| cut_off(body(inner), cutoff)),
        None => response.map(body),
    })
}

/// `text`, cut to a length fit for a log line.
fn bounded_text(text: &str) -> &str {
    const MAX: usize = 256;
    let mut end = text.len().min(MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Copies between the upgraded guest and upstream connections (a WebSocket, say),
/// redacting the secret from what flows to the guest when there is one.
pub(super) async fn splice(
    guest: OnUpgrade,
    upstream: OnUpgrade,
    redactor: Option<Redactor>,
    in_flight: Arc<InFlight>,
    ask: Ask,
) {
    let (guest, upstream) = match tokio::try_join!(guest, upstream) {
        Ok(both) => both,
        Err(e) => return tracing::debug!("upgrade failed: {e}"),
    };
    let guest = TokioIo::new(guest);
    let upstream = TokioIo::new(upstream);
    let watch = redactor.clone();
    let relay = async {
        match redactor {
            None => byte_relay::both_ways(guest, upstream).await,
            Some(redactor) => {
                let (guest_rx, guest_tx) = tokio::io::split(guest);
                let (upstream_rx, upstream_tx) = tokio::io::split(upstream);
                let (a_to_b, b_to_a) = tokio::join!(
                    byte_relay::one_way(guest_rx, upstream_tx),
                    copy_redacted(upstream_rx, guest_tx, redactor)
                );
                byte_relay::Relayed { a_to_b, b_to_a }
            }
        }
    };
    match watch {
        Some(redactor) => tokio::select! {
            () = relay_while_allowed(relay, &ask, &in_flight.config, "upgraded connection") => {}
            () = ask.until_secret_withdrawn(&in_flight.config, &redactor) => {}
        },
        None => relay_while_allowed(relay, &ask, &in_flight.config, "upgraded connection").await,
    }
}
