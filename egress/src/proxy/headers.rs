//! Headers and authorities: hop-by-hop headers, the authorities a request claims,
//! and host names as the policy and the log see them.

use std::net::Ipv6Addr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::Authority;
use http::Uri;

use super::ProxyError;

/// (`Trailer` is not one: it declares the trailer fields, which hyper sends only when
/// declared.)
pub(super) const HOP_BY_HOP: [HeaderName; 5] = [
    header::CONNECTION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    HeaderName::from_static("keep-alive"),
];

/// Removes the headers that concern only one hop: the standard ones, those the
/// Connection header lists, and every `proxy-*` header. An upgrade keeps its
/// `Upgrade` and `Connection: upgrade`, which the next hop needs.
pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    let upgrade = headers.get(header::UPGRADE).cloned();
    let listed: Vec<HeaderName> = list_tokens(headers, header::CONNECTION)
        .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
        .collect();
    let proxy: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for name in listed.iter().chain(&HOP_BY_HOP).chain(&proxy) {
        headers.remove(name);
    }
    if let (true, Some(upgrade)) = (keep_upgrade, upgrade) {
        headers.insert(header::UPGRADE, upgrade);
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
}

/// Does the request ask to switch protocols (`Connection: upgrade` and `Upgrade`)?
pub(super) fn wants_upgrade(headers: &HeaderMap) -> bool {
    has_token(headers, header::CONNECTION, "upgrade") && headers.contains_key(header::UPGRADE)
}

/// The comma-separated tokens of every `name` header (`Connection: close, te`), trimmed.
pub(super) fn list_tokens(headers: &HeaderMap, name: HeaderName) -> impl Iterator<Item = &str> {
    headers
        .get_all(name)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
}

/// Whether a `name` header lists `token` (case aside).
pub(super) fn has_token(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    list_tokens(headers, name).any(|listed| listed.eq_ignore_ascii_case(token))
}

/// Whether the message's transfer codings end in chunked, which frames its body (RFC
/// 9112, 6.1: the codings before it, `gzip, chunked`, are the body's own).
pub(super) fn ends_in_chunked(headers: &HeaderMap) -> bool {
    list_tokens(headers, header::TRANSFER_ENCODING)
        .last()
        .is_some_and(|coding| coding.eq_ignore_ascii_case("chunked"))
}

/// The authorities a request names: its URI's (absolute form, when `uri` is given)
/// and its Host headers.
pub(super) fn claimed_authorities(
    uri: Option<&Uri>,
    headers: &HeaderMap,
) -> Result<Vec<String>, ProxyError> {
    let mut claims: Vec<String> = uri
        .and_then(Uri::authority)
        .map(|authority| authority.as_str().to_string())
        .into_iter()
        .collect();
    for value in headers.get_all(header::HOST) {
        let value = value
            .to_str()
            .map_err(|_| ProxyError::BadRequest("the Host header is not text".into()))?;
        claims.push(value.to_string());
    }
    Ok(claims)
}

/// Checks that every claimed authority is `host`, with `port` or `default_port` if
/// it names a port. Otherwise the request would reach `host` while meant for
/// another (virtual) host, which could carry the secret where it is not bound.
pub(super) fn check_claims(
    claims: Vec<String>,
    host: &str,
    port: u16,
    default_port: u16,
    expected: &str,
) -> Result<(), ProxyError> {
    match claims
        .into_iter()
        .find(|claim| !authority_names(claim, host, port, default_port))
    {
        Some(claimed) => Err(ProxyError::HostMismatch {
            claimed,
            expected: expected.to_string(),
        }),
        None => Ok(()),
    }
}

pub(super) fn authority_names(claim: &str, host: &str, port: u16, default_port: u16) -> bool {
    let Ok(authority) = claim.parse::<Authority>() else {
        return false;
    };
    let same_host = !claim.contains('@')
        && normalize_host(authority.host()).is_ok_and(|claimed| claimed == host);
    let same_port = authority
        .port_u16()
        .is_none_or(|claimed| claimed == port || claimed == default_port);
    same_host && same_port
}

/// Lower case, no trailing dot, no IPv6 brackets; refuses what is no host name.
pub(super) fn normalize_host(raw: &str) -> Result<String, ProxyError> {
    let host = raw
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(raw);
    let host = host.strip_suffix('.').unwrap_or(host);
    let valid_chars = host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b':'));
    let valid = !host.is_empty()
        && host.len() <= 253
        && valid_chars
        // `a..example.com` would match `*.example.com`, yet no rule could name it.
        && !host.split('.').any(str::is_empty)
        && (!host.contains(':') || host.parse::<Ipv6Addr>().is_ok());
    if !valid {
        return Err(ProxyError::BadRequest(format!(
            "{raw:?} is not a host name"
        )));
    }
    Ok(host.to_ascii_lowercase())
}

/// `host:port`, IPv6 literals in brackets.
pub(super) fn display_target(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The Host header for a request that came without one.
pub(super) fn host_header(host: &str, port: u16, default_port: u16) -> HeaderValue {
    let text = if port == default_port {
        if host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_string()
        }
    } else {
        display_target(host, port)
    };
    // The host was validated by normalize_host, so this cannot fail in practice.
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

pub(super) fn path_of(uri: &Uri) -> &str {
    uri.path_and_query().map_or("/", |path| path.as_str())
}
