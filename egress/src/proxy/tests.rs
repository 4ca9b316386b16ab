use super::addresses::*;
use super::first_head::*;
use super::headers::*;
use super::redact::*;
use super::session::*;
use super::tunnels::*;
use super::upstream::*;
use super::*;
use crate::rules::Injection;
use http::header::{HeaderMap, HeaderName};
use http::Uri;
use tokio::io::AsyncWriteExt;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn network(address: &str, prefix_len: u32) -> HostNetwork {
    HostNetwork {
        address: ip(address),
        prefix_len,
        point_to_point: false,
    }
}

fn point_to_point(address: &str, prefix_len: u32) -> HostNetwork {
    HostNetwork {
        point_to_point: true,
        ..network(address, prefix_len)
    }
}

/// A public address is refused when it is one of the host's own: through it the
/// guest would reach the host's services that listen on every interface.
#[test]
fn the_hosts_own_addresses_are_forbidden_even_public_ones() {
    let own = [network("203.0.113.5", 32), network("2001:db8::5", 128)];
    for addr in [
        "203.0.113.5",
        "::ffff:203.0.113.5",
        "::ffff:0:203.0.113.5",
        "64:ff9b::203.0.113.5",
        "2002:cb00:7105::1",
        "2001:db8::5",
    ] {
        assert_eq!(
            forbidden_destination(ip(addr), &own),
            Some("an address of this host"),
            "{addr}"
        );
    }
    for addr in ["203.0.113.6", "2001:db8::6", "8.8.8.8"] {
        assert_eq!(forbidden_destination(ip(addr), &own), None, "{addr}");
    }
    // The other reasons come first, and stand without the host's addresses.
    assert_eq!(
        forbidden_destination(ip("10.0.0.1"), &[]),
        Some("a private address")
    );
}

/// Public addresses on the host's own networks (a LAN device's global IPv6 address in
/// the host's /64, a neighbour in a public IPv4 subnet) are the LAN's: refused, as
/// private ones are.
#[test]
fn the_networks_the_host_is_on_are_forbidden() {
    let own = [
        network("198.51.100.20", 24),
        network("2001:db8:1:2::20", 64),
        network("2002:cb00:7105::1", 48),
    ];
    for addr in [
        "198.51.100.1",
        "198.51.100.255",
        "::ffff:198.51.100.7",
        "64:ff9b::198.51.100.7",
        "2001:db8:1:2::1",
        "2001:db8:1:2:ffff:ffff:ffff:ffff",
    ] {
        assert_eq!(
            forbidden_destination(ip(addr), &own),
            Some("on a network this host is attached to"),
            "{addr}"
        );
    }
    // Just outside them; and a 6to4 interface address's network is IPv6's.
    for addr in [
        "198.51.101.1",
        "198.51.99.255",
        "2001:db8:1:3::1",
        "2001:db8:1::1",
        "203.0.113.9",
        "2002:cb00:7106::1",
    ] {
        assert_eq!(forbidden_destination(ip(addr), &own), None, "{addr}");
    }
    // The extremes of a prefix's length: a /0 is no network, only its address.
    assert_eq!(
        forbidden_destination(ip("8.8.8.8"), &[network("1.1.1.1", 0)]),
        None
    );
    assert_eq!(
        forbidden_destination(ip("1.1.1.1"), &[network("1.1.1.1", 0)]),
        Some("an address of this host")
    );
    assert_eq!(
        forbidden_destination(ip("2001:db8::9"), &[network("2001:db8::8", 128)]),
        None
    );
}

/// A prefix shorter than /8 (IPv4) or /32 (IPv6) is no link's: it would refuse half
/// the internet, so only the address itself is refused.
#[test]
fn prefixes_too_short_for_a_link_are_only_their_address() {
    let own = [network("44.0.0.1", 7), network("2600::1", 31)];
    for addr in ["45.1.2.3", "44.0.0.2", "2601::1", "2600::2"] {
        assert_eq!(forbidden_destination(ip(addr), &own), None, "{addr}");
    }
    for addr in ["44.0.0.1", "2600::1"] {
        assert_eq!(
            forbidden_destination(ip(addr), &own),
            Some("an address of this host"),
            "{addr}"
        );
    }
    // The shortest taken as networks.
    let own = [network("44.0.0.1", 8), network("2600::1", 32)];
    for addr in ["44.255.0.1", "2600:0:ffff::1"] {
        assert_eq!(
            forbidden_destination(ip(addr), &own),
            Some("on a network this host is attached to"),
            "{addr}"
        );
    }
}

/// A tun device or WireGuard interface routes its whole prefix into a tunnel: only
/// its own address is the host's, the rest is what the tunnel reaches.
#[test]
fn point_to_point_interfaces_are_only_their_address() {
    let own = [
        point_to_point("203.0.113.1", 24),
        point_to_point("2001:db8:7::1", 64),
    ];
    for addr in ["203.0.113.2", "2001:db8:7::2"] {
        assert_eq!(forbidden_destination(ip(addr), &own), None, "{addr}");
    }
    for addr in ["203.0.113.1", "::ffff:203.0.113.1", "2001:db8:7::1"] {
        assert_eq!(
            forbidden_destination(ip(addr), &own),
            Some("an address of this host"),
            "{addr}"
        );
    }
}

/// A fake-IP DNS proxy (Clash, mihomo in TUN mode) answers every name with an
/// address in 198.18.0.0/15 and sits in that range itself: a network there, even on
/// an interface that is not point-to-point, must not refuse those answers.
#[test]
fn no_network_reaches_into_the_fake_ip_range() {
    let own = [network("198.18.0.1", 16), network("198.0.0.1", 8)];
    for addr in [
        "198.18.0.2",
        "198.18.200.7",
        "198.19.0.5",
        "::ffff:198.18.0.2",
    ] {
        assert_eq!(forbidden_destination(ip(addr), &own), None, "{addr}");
    }
    // The proxy's own address is still the host's; the rest of 198/8 a network.
    assert_eq!(
        forbidden_destination(ip("198.18.0.1"), &own),
        Some("an address of this host")
    );
    assert_eq!(
        forbidden_destination(ip("198.20.0.1"), &own),
        Some("on a network this host is attached to")
    );
}

#[test]
fn the_hosts_addresses_are_read_from_its_interfaces() {
    let own = host_networks().unwrap();
    // Every network namespace has its loopback interface, which holds 127.0.0.1 once
    // it is up (`unshare -n` leaves it down).
    let loopback_up = std::fs::read_to_string("/sys/class/net/lo/operstate")
        .is_ok_and(|state| state.trim() != "down");
    if !loopback_up {
        eprintln!("NOT RUN: the loopback interface is down here");
        return;
    }
    // With its netmask: 127.0.0.1/8, and not point-to-point.
    assert!(own.contains(&network("127.0.0.1", 8)), "{own:?}");
}

/// How many times [`counted_reading`] has read; one counter per test that uses it.
static READINGS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A reading of the host's networks that counts itself, and names the count in its
/// address (10.0.0.N), so a test can tell which reading it was given.
fn counted_reading() -> std::io::Result<Vec<HostNetwork>> {
    let n = READINGS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    Ok(vec![network(&format!("10.0.0.{n}"), 32)])
}

/// The host's addresses are read once per lifetime, for every connection within it,
/// and read again once it is over: an address the host gains is forbidden a lifetime
/// later at the most.
#[test]
fn the_hosts_addresses_are_read_again_once_their_reading_expires() {
    let cache = HostNetworksCache::new(Duration::from_secs(1), counted_reading);
    let start = std::time::Instant::now();
    let at = |ms: u64| start + Duration::from_millis(ms);
    let first = cache.get_at(at(0)).unwrap();
    assert_eq!(&*first, [network("10.0.0.1", 32)]);
    // Within the lifetime: the same reading, without a system call.
    assert_eq!(cache.get_at(at(500)).unwrap(), first);
    assert_eq!(cache.get_at(at(999)).unwrap(), first);
    assert_eq!(READINGS.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Past it: read again, and that reading is kept for a lifetime of its own.
    let second = cache.get_at(at(1000)).unwrap();
    assert_eq!(&*second, [network("10.0.0.2", 32)]);
    assert_eq!(cache.get_at(at(1999)).unwrap(), second);
    assert_eq!(&*cache.get_at(at(2000)).unwrap(), [network("10.0.0.3", 32)]);
    assert_eq!(READINGS.load(std::sync::atomic::Ordering::SeqCst), 3);
}

/// A reading that failed is not kept: each connection tries again, and is refused
/// (fails closed) while it fails.
#[test]
fn a_failed_reading_of_the_hosts_addresses_is_not_kept() {
    fn failing() -> std::io::Result<Vec<HostNetwork>> {
        Err(std::io::Error::other("no netlink"))
    }
    let cache = HostNetworksCache::new(Duration::from_secs(1), failing);
    let now = std::time::Instant::now();
    assert!(cache.get_at(now).is_err());
    assert!(cache.get_at(now).is_err());
}

#[test]
fn forbidden_addresses() {
    for (addr, reason) in [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("10.0.0.1", "private"),
        ("172.16.0.1", "private"),
        ("172.31.255.255", "private"),
        ("192.168.1.1", "private"),
        ("169.254.1.1", "link-local"),
        ("169.254.169.254", "metadata"),
        ("168.63.129.16", "WireServer"),
        ("100.64.0.1", "CGNAT"),
        ("100.127.255.255", "CGNAT"),
        ("224.0.0.1", "multicast"),
        ("::", "unspecified"),
        ("::1", "loopback"),
        ("fc00::1", "unique-local"),
        ("fd12:3456::1", "unique-local"),
        ("fe80::1", "link-local"),
        ("fd00:ec2::254", "metadata"),
        ("ff02::1", "multicast"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:10.1.2.3", "private"),
        ("::ffff:169.254.169.254", "metadata"),
        ("::ffff:168.63.129.16", "WireServer"),
        ("::10.1.2.3", "private"),
        ("::127.0.0.1", "loopback"),
        ("64:ff9b::192.168.0.1", "private"),
        ("::ffff:0:10.0.0.1", "private"),
        ("64:ff9b:1::10.0.0.1", "local-use NAT64"),
        // 127.0.0.1 in bits 48-87 (a /48 prefix), 8.8.8.8 in the last 32.
        ("64:ff9b:1:7f00:0:100:808:808", "local-use NAT64"),
        ("2002:a00:1::1", "private"),
        ("2002:7f00:1::", "loopback"),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"),
        ("100::1", "discard"),
        ("192.0.0.170", "IETF"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
    ] {
        let got = forbidden_address(ip(addr));
        assert!(
            got.is_some_and(|r| r.contains(reason)),
            "{addr}: expected {reason}, got {got:?}"
        );
    }
    for addr in [
        "1.1.1.1",
        "8.8.8.8",
        "172.32.0.1",
        "100.128.0.1",
        "192.169.0.1",
        "2606:4700::1111",
        "::ffff:1.1.1.1",
        "64:ff9b::8.8.8.8",
        "2002:808:808::1",
        "2001:db9::1",
        "198.18.0.1",
        "192.0.1.1",
        "223.255.255.255",
    ] {
        assert_eq!(forbidden_address(ip(addr)), None, "{addr}");
    }
}

#[test]
fn hosts_are_normalised() {
    assert_eq!(
        normalize_host("API.Example.COM.").unwrap(),
        "api.example.com"
    );
    assert_eq!(normalize_host("[::1]").unwrap(), "::1");
    assert_eq!(normalize_host("[2001:DB8::1]").unwrap(), "2001:db8::1");
    assert!(normalize_host("").is_err());
    assert!(normalize_host("a b").is_err());
    assert!(normalize_host("exa%mple").is_err());
    assert!(normalize_host("not:v6").is_err());
    for empty_label in ["a..example.com", "..example.com", ".example.com", "a.."] {
        assert!(normalize_host(empty_label).is_err(), "{empty_label}");
    }
    assert_eq!(
        normalize_host("[::ffff:1.2.3.4]").unwrap(),
        "::ffff:1.2.3.4"
    );
}

/// A request to a bound host: the secret in its header, and nothing that would
/// keep it out of reach of the response's redaction (compression, a range).
#[test]
fn a_bound_request_gets_its_secret_and_loses_what_would_hide_an_echo() {
    let mut headers = HeaderMap::new();
    headers.insert(header::RANGE, HeaderValue::from_static("bytes=1-"));
    headers.insert(header::IF_RANGE, HeaderValue::from_static("\"etag\""));
    headers.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip"));
    headers.insert(
        header::SEC_WEBSOCKET_EXTENSIONS,
        HeaderValue::from_static("permessage-deflate"),
    );
    headers.insert("x-api-key", HeaderValue::from_static("placeholder"));
    let injection = Injection {
        secret: "test".into(),
        header: HeaderName::from_static("x-api-key"),
        value: HeaderValue::from_static("sk-proj-0123456789"),
        secret_value: crate::secrets::read_secret(&b"sk-proj-0123456789"[..]).unwrap(),
        remove: vec![],
    };
    inject(&mut headers, &injection);
    assert_eq!(headers["x-api-key"], "sk-proj-0123456789");
    assert_eq!(headers[header::ACCEPT_ENCODING], "identity");
    assert!(!headers.contains_key(header::RANGE));
    assert!(!headers.contains_key(header::IF_RANGE));
    assert!(!headers.contains_key(header::SEC_WEBSOCKET_EXTENSIONS));
}

/// The upstream gets the Host header the policy judged, not the guest's spelling.
#[test]
fn the_host_header_sent_upstream_is_the_proxys() {
    let (mut parts, ()) = Request::get("https://api.test/v1")
        .header(header::HOST, "API.TEST.:443")
        .header(header::RANGE, "bytes=1-")
        .body(())
        .unwrap()
        .into_parts();
    prepare_request(&mut parts, host_header("api.test", 443, 443));
    let hosts: Vec<_> = parts.headers.get_all(header::HOST).iter().collect();
    assert_eq!(hosts, ["api.test"]);
    assert_eq!(parts.uri, "/v1");
}

/// A chunked body's transfer codings go upstream as the guest listed them (the ones
/// under chunked are still on the body), whatever else the hop-by-hop strip removes.
#[test]
fn a_chunked_bodys_transfer_codings_go_upstream_whole() {
    let codings_sent = |listed: &[&str]| {
        let mut request = Request::post("http://plain.test/up");
        for value in listed {
            request = request.header(header::TRANSFER_ENCODING, *value);
        }
        let (mut parts, ()) = request.body(()).unwrap().into_parts();
        prepare_request(&mut parts, host_header("plain.test", 80, 80));
        let sent: Vec<_> = parts
            .headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .map(|value| value.to_str().unwrap().to_owned())
            .collect();
        sent
    };
    assert_eq!(codings_sent(&["chunked"]), ["chunked"]);
    assert_eq!(codings_sent(&["gzip, chunked"]), ["gzip, chunked"]);
    assert_eq!(codings_sent(&["gzip", "Chunked"]), ["gzip", "Chunked"]);
    assert!(codings_sent(&[]).is_empty());
}

#[test]
fn connect_targets() {
    let uri: Uri = "Example.com.:443".parse().unwrap();
    assert_eq!(connect_target(&uri).unwrap(), ("example.com".into(), 443));
    let uri: Uri = "[::1]:8443".parse().unwrap();
    assert_eq!(connect_target(&uri).unwrap(), ("::1".into(), 8443));
    let uri: Uri = "example.com".parse().unwrap();
    assert!(connect_target(&uri).is_err());
    assert_eq!(display_target("::1", 443), "[::1]:443");
}

#[test]
fn authority_checks() {
    let ok = |claim| authority_names(claim, "api.test", 443, 443);
    assert!(ok("api.test"));
    assert!(ok("API.test."));
    assert!(ok("api.test:443"));
    assert!(!ok("api.test:444"));
    assert!(!ok("evil.test"));
    assert!(!ok("user@api.test"));
    assert!(!ok("api.test.evil.test"));
    assert!(!ok(""));
    assert!(authority_names("api.test:8443", "api.test", 8443, 443));
}

#[test]
fn hop_by_hop_and_proxy_headers_are_removed() {
    let mut headers = HeaderMap::new();
    for (name, value) in [
        ("connection", "keep-alive, x-private"),
        ("keep-alive", "timeout=5"),
        ("x-private", "1"),
        ("proxy-authorization", "Basic abc"),
        ("proxy-connection", "keep-alive"),
        ("te", "trailers"),
        ("x-kept", "yes"),
    ] {
        headers.insert(
            HeaderName::from_static(name),
            HeaderValue::from_static(value),
        );
    }
    strip_hop_by_hop(&mut headers, false);
    let names: Vec<&str> = headers.keys().map(|n| n.as_str()).collect();
    assert_eq!(names, ["x-kept"]);
}

#[test]
fn an_upgrade_keeps_its_headers() {
    let mut headers = HeaderMap::new();
    headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    assert!(wants_upgrade(&headers));
    strip_hop_by_hop(&mut headers, true);
    assert_eq!(headers[header::UPGRADE], "websocket");
    assert_eq!(headers[header::CONNECTION], "upgrade");
}

#[test]
fn request_lines() {
    assert!(check_request_line(b"CONNECT api.test:443 HTTP/1.1\r\n\r\n").is_ok());
    assert!(check_request_line(b"\r\nGET http://x/ HTTP/1.0\r\nA: b\r\n\r\n").is_ok());
    for bad in [
        &b"THIS IS NOT HTTP\r\n\r\n"[..],
        b"GET /\r\n\r\n",
        b"GET  / HTTP/1.1\r\n\r\n",
        b"G\x01T / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/2.0\r\n\r\n",
        b"\r\n\r\n",
    ] {
        let err = check_request_line(bad).unwrap_err();
        assert!(
            matches!(err, ProxyError::MalformedRequestLine { .. }),
            "{err}"
        );
    }
    let long = [b"GET /".as_slice(), &[b'a'; 500], b" HTTP/9\r\n\r\n"].concat();
    assert!(check_request_line(&long).unwrap_err().to_string().len() < 300);
}

#[test]
fn head_ends() {
    assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nbody", 0), Some(24));
    assert_eq!(head_end(b"GET / HTTP/1.1\nA: b\n\nbody", 0), Some(21));
    assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n", 0), None);
}

#[tokio::test]
async fn the_first_head_is_read_within_limits() {
    let limits = Limits {
        max_header_bytes: 100,
        header_timeout: Duration::from_millis(200),
        ..Limits::default()
    };
    let mut input: &[u8] = b"GET http://x/ HTTP/1.1\r\n\r\nextra";
    let head = read_first_head(&mut input, &limits, std::future::pending())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(head, b"GET http://x/ HTTP/1.1\r\n\r\nextra");
    let mut input: &[u8] = &[b'a'; 1000];
    let err = read_first_head(&mut input, &limits, std::future::pending())
        .await
        .unwrap_err();
    assert_eq!(err.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    let mut input: &[u8] = b"";
    assert!(read_first_head(&mut input, &limits, std::future::pending())
        .await
        .unwrap()
        .is_none());
    let (mut silent, _other_end) = tokio::io::duplex(64);
    assert!(
        read_first_head(&mut silent, &limits, std::future::pending())
            .await
            .unwrap()
            .is_none()
    );
    let (mut slow, mut other_end) = tokio::io::duplex(64);
    other_end.write_all(b"GET http://x/").await.unwrap();
    let err = read_first_head(&mut slow, &limits, std::future::pending())
        .await
        .unwrap_err();
    assert_eq!(err.status(), StatusCode::REQUEST_TIMEOUT);
    // Displaced by a newer connection: closed if it said nothing, told if it had begun.
    let (mut silent, _other_end) = tokio::io::duplex(64);
    let displaced = read_first_head(&mut silent, &limits, std::future::ready(())).await;
    assert!(displaced.unwrap().is_none());
    let (mut begun, mut other_end) = tokio::io::duplex(64);
    other_end.write_all(b"GET http://x/").await.unwrap();
    let displaced = async { tokio::time::sleep(Duration::from_millis(50)).await };
    let err = read_first_head(&mut begun, &limits, displaced)
        .await
        .unwrap_err();
    assert_eq!(err.status(), StatusCode::SERVICE_UNAVAILABLE);
}

#[test]
fn past_the_waiting_bound_the_longest_waiting_leaves() {
    let room = WaitingRoom::default();
    let mut entered: Vec<_> = (0..4).map(|_| room.enter(3)).collect();
    let mut displaced = |i: usize| {
        let (_, notice) = &mut entered[i];
        notice.try_recv() != Err(tokio::sync::oneshot::error::TryRecvError::Empty)
    };
    assert!(displaced(0), "the oldest stayed");
    assert!(!displaced(1) && !displaced(2) && !displaced(3));
    // One that leaves (its head arrived) frees its place: the next does not displace.
    let (second, _) = entered.remove(1);
    drop(second);
    entered.push(room.enter(3));
    assert!((1..4)
        .all(|i| entered[i].1.try_recv() == Err(tokio::sync::oneshot::error::TryRecvError::Empty)));
    assert_eq!(room.len(), 3);
}

/// Connections told to leave get a place in grace only while fewer than its bound
/// hold one, and give it up when they close or their request comes.
#[test]
fn places_in_grace_are_bounded() {
    let room = WaitingRoom::default();
    let first = room.grace(2).expect("a first place in grace");
    let second = room.grace(2).expect("a second place in grace");
    assert!(room.grace(2).is_none(), "a third place past a bound of 2");
    drop(first);
    let third = room.grace(2).expect("the place given up, taken again");
    assert!(room.grace(2).is_none());
    drop((second, third));
    assert!(room.grace(0).is_none(), "a bound of 0: no grace at all");
    assert_eq!(room.lock().in_grace, 0);
}

const SECRET: &[u8] = b"Bearer sk-proj-0123456789";
const TOKEN: &[u8] = b"sk-proj-0123456789";

/// A template that wraps the secret without a space (`session={}`): the secret
/// alone is redacted too, as an upstream might quote it without the wrapping.
#[test]
fn the_bare_secret_is_redacted_whatever_wraps_it_in_the_header() {
    let mut redactor = Redactor::for_secret(b"session=abcdefgh12345", b"abcdefgh12345").unwrap();
    let mut out = redactor.feed(b"bad token abcdefgh12345!").to_vec();
    out.extend_from_slice(&redactor.finish());
    assert!(
        !contains(&out, b"abcdefgh12345"),
        "{}",
        String::from_utf8_lossy(&out)
    );
}

fn redact_all(chunks: &[&[u8]]) -> Vec<u8> {
    let mut redactor = Redactor::for_secret(SECRET, TOKEN).unwrap();
    let mut out = Vec::new();
    for chunk in chunks {
        out.extend_from_slice(&redactor.feed(chunk));
    }
    out.extend_from_slice(&redactor.finish());
    out
}

#[test]
fn redaction_keeps_lengths_and_finds_split_secrets() {
    let input = b"a Bearer sk-proj-0123456789 b sk-proj-0123456789 c";
    let out = redact_all(&[input]);
    assert_eq!(out.len(), input.len());
    assert!(
        !contains(&out, b"sk-proj"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    assert!(out.starts_with(b"a [REDACTED]"));
    for split in 1..input.len() {
        let out = redact_all(&[&input[..split], &input[split..]]);
        assert_eq!(out.len(), input.len());
        assert!(!contains(&out, b"0123456789"), "split at {split}");
    }
    let bytewise: Vec<&[u8]> = input.chunks(1).collect();
    assert!(!contains(&redact_all(&bytewise), b"0123456789"));
}

/// A body that ends in all of the secret but its last byte (an echo cut short)
/// does not end in that much of it.
#[test]
fn a_stream_ending_inside_the_secret_does_not_end_in_it() {
    let input = b"key=sk-proj-012345678";
    let out = redact_all(&[input]);
    assert_no_token_piece(&out, input.len(), "cut short");
    assert!(
        out.starts_with(b"key="),
        "{}",
        String::from_utf8_lossy(&out)
    );
    // A short start is too short to say anything and stays as it was.
    assert_eq!(redact_all(&[b"ends in sk-"]), b"ends in sk-");
}

#[test]
fn redaction_holds_back_only_possible_secret_starts() {
    let mut redactor = Redactor::for_secret(SECRET, TOKEN).unwrap();
    assert_eq!(&redactor.feed(b"data: one\n\n")[..], b"data: one\n\n");
    assert!(!redactor.holding());
    assert_eq!(&redactor.feed(b"xx Bear")[..], b"xx ");
    assert!(redactor.holding());
    assert_eq!(&redactor.feed(b"d")[..], b"Beard");
    assert_eq!(
        Redactor::for_secret(b"short", b"short").map(|r| r.needles.len()),
        None
    );
}

/// Feeds `chunks` in turn, each followed by a pause (a flush) where it says so,
/// then ends the stream.
fn redact_paused(chunks: &[(&[u8], bool)]) -> Vec<u8> {
    let mut redactor = Redactor::for_secret(SECRET, TOKEN).unwrap();
    let mut out = Vec::new();
    for (chunk, pause) in chunks {
        out.extend_from_slice(&redactor.feed(chunk));
        if *pause {
            out.extend_from_slice(&redactor.flush_held());
        }
    }
    out.extend_from_slice(&redactor.finish());
    out
}

/// `out` kept the input's length and holds no piece of the token long enough to
/// be redacted.
fn assert_no_token_piece(out: &[u8], input_len: usize, context: &str) {
    let shown = String::from_utf8_lossy(out);
    assert_eq!(out.len(), input_len, "{context}: {shown}");
    for window in TOKEN.windows(MIN_REDACTED_LEN) {
        assert!(!contains(out, window), "{context}: {shown}");
    }
}

/// An interactive stream (an upgraded connection) that pauses inside the secret:
/// the held start goes out masked and the rest, when it comes, redacted, so the
/// guest never gets the secret in two pieces.
#[test]
fn a_pause_inside_the_secret_does_not_let_it_through() {
    let input = b"a Bearer sk-proj-0123456789 b sk-proj-0123456789 c";
    for pause in 1..input.len() {
        let out = redact_paused(&[(&input[..pause], true), (&input[pause..], false)]);
        assert_no_token_piece(&out, input.len(), &format!("pause at {pause}"));
    }
}

/// A pause byte by byte, the worst case: each byte is held, then flushed.
#[test]
fn a_pause_after_every_byte_does_not_let_the_secret_through() {
    let input = b"x Bearer sk-proj-0123456789 y";
    let bytes: Vec<(&[u8], bool)> = input.chunks(1).map(|byte| (byte, true)).collect();
    assert_no_token_piece(&redact_paused(&bytes), input.len(), "byte by byte");
}

/// Seeded random streams: secrets, pieces of them and other bytes, cut into
/// random chunks, with random pauses (flushes). With pauses no secret reaches the
/// guest whole; without, the output is the same however the stream is cut.
#[test]
fn random_streams_cut_and_paused_anywhere_never_carry_the_secret() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n.max(1) as u64) as usize
    };
    for round in 0..2000 {
        let mut input = Vec::new();
        for _ in 0..next(8) {
            match next(4) {
                0 => input.extend_from_slice(TOKEN),
                1 => input.extend_from_slice(SECRET),
                2 => input.extend_from_slice(&TOKEN[..next(TOKEN.len())]),
                _ => input.extend((0..next(12)).map(|_| b"ab sk-Bearer 01"[next(15)])),
            }
        }
        let mut chunks: Vec<(&[u8], bool)> = Vec::new();
        let mut at = 0;
        while at < input.len() {
            let len = 1 + next(input.len() - at);
            chunks.push((&input[at..at + len], next(3) == 0));
            at += len;
        }
        let out_paused = redact_paused(&chunks);
        let steady: Vec<&[u8]> = chunks.iter().map(|(chunk, _)| *chunk).collect();
        let shown = String::from_utf8_lossy(&input);
        assert_eq!(out_paused.len(), input.len(), "round {round}: {shown}");
        assert!(!contains(&out_paused, TOKEN), "round {round}: {shown}");
        assert_eq!(
            redact_all(&steady),
            redact_all(&[&input]),
            "round {round}: {shown}"
        );
    }
}

/// Ordinary text that only looks like a short start of the secret goes out as it
/// is when the stream pauses, and what follows is not touched.
#[test]
fn a_pause_after_a_short_lookalike_changes_nothing() {
    let mut redactor = Redactor::for_secret(SECRET, TOKEN).unwrap();
    assert_eq!(&redactor.feed(b"xx Bear")[..], b"xx ");
    assert_eq!(&redactor.flush_held()[..], b"Bear");
    assert_eq!(&redactor.feed(b"d and sk-")[..], b"d and ");
    assert_eq!(&redactor.flush_held()[..], b"sk-");
    assert_eq!(&redactor.feed(b"stuff")[..], b"stuff");
    assert!(!redactor.holding());
}

#[test]
fn redaction_in_headers() {
    let redactor = Redactor::for_secret(SECRET, TOKEN).unwrap();
    let mut headers = HeaderMap::new();
    headers.insert("x-echo", HeaderValue::from_static("got sk-proj-0123456789"));
    redactor.redact_headers(&mut headers);
    assert_eq!(headers["x-echo"], "got [REDACTED]********");
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    find(haystack, needle).is_some()
}

/// A watched redactor for [`SECRET`], and its tripwire.
fn watched() -> (Redactor, Arc<redact::Tripwire>) {
    watched_for(SECRET, TOKEN)
}

/// A watched redactor for the header `value` that carries `secret`, and its tripwire.
fn watched_for(value: &[u8], secret: &[u8]) -> (Redactor, Arc<redact::Tripwire>) {
    let tripwire = Arc::new(redact::Tripwire::new("test", secret, None));
    let redactor = Redactor::for_secret(value, secret)
        .unwrap()
        .watched_by(tripwire.clone());
    (redactor, tripwire)
}

#[test]
fn text_with_the_secrets_public_start_is_no_probe() {
    let (mut redactor, tripwire) = watched();
    // Documentation quotes the form of a key; a stream pauses right after it.
    redactor.feed(b"set the header to Bearer sk-proj-");
    redactor.flush_held();
    redactor.feed(b"xxxx, or sk-proj-012 (a short start)");
    redactor.finish();
    assert!(!tripwire.tripped());
    // The whole secret, echoed, is redacted and no probe either.
    let (mut redactor, tripwire) = watched();
    redactor.feed(b"you sent sk-proj-0123");
    redactor.flush_held();
    redactor.feed(b"456789 and more");
    redactor.finish();
    for _ in 0..redact::PROBES_TOLERATED {
        let (mut redactor, _) = (redactor.clone(), ());
        redactor.feed(b"sk-proj-0123456789");
        redactor.finish();
    }
    assert!(!tripwire.tripped());
}

#[test]
fn long_starts_of_the_secret_that_end_without_it_are_probes_right_or_wrong() {
    let (redactor, tripwire) = watched();
    // A wrong guess past the public start and four characters (the stream turns away
    // from it), a right one (it ends in it), and one a pause cuts.
    let mut wrong = redactor.clone();
    wrong.feed(b"sk-proj-0123X");
    wrong.finish();
    assert!(!tripwire.tripped());
    let mut right = redactor.clone();
    right.feed(b"sk-proj-01234");
    right.finish();
    assert!(!tripwire.tripped());
    let mut paused = redactor.clone();
    paused.feed(b"sk-proj-012345");
    paused.flush_held();
    assert!(tripwire.tripped());
}

#[test]
fn a_withdrawn_secret_stays_withdrawn_across_runs_until_its_value_changes() {
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("probes/test.json");
    let run = |value: &[u8]| {
        let tripwire = Arc::new(redact::Tripwire::new("test", value, Some(record.clone())));
        let redactor = Redactor::for_secret(value, value)
            .unwrap()
            .watched_by(tripwire.clone());
        (redactor, tripwire)
    };
    let (redactor, tripwire) = run(TOKEN);
    for guess in [&b"sk-proj-0123X"[..], b"sk-proj-0123Y", b"sk-proj-0123Z"] {
        let mut stream = redactor.clone();
        stream.feed(guess);
        stream.finish();
    }
    assert!(tripwire.tripped() && redactor.withdrawn());
    let text = std::fs::read_to_string(&record).unwrap();
    assert!(
        !text.contains("sk-proj"),
        "the record holds the secret: {text}"
    );
    // The next run of the VM's proxy: still withdrawn.
    assert!(run(TOKEN).1.tripped());
    // A new value: a new count.
    assert!(!run(b"sk-proj-9876543210").1.tripped());
}

#[test]
fn an_encoded_credential_counts_probes_from_its_own_characters_only() {
    use base64::Engine;
    let basic = |token: &str| {
        let encoded =
            base64::engine::general_purpose::STANDARD.encode(format!("x-access-token:{token}"));
        format!("Basic {encoded}")
    };
    let ours = "ghp_AAAAbbbbCCCCddddEEEEffffGGGGhhhh1234";
    let theirs = "ghp_ZZZZyyyyXXXXwwwwVVVVuuuuTTTTssss9876";
    let tripwire = Arc::new(redact::Tripwire::new("github", ours.as_bytes(), None));
    let redactor = Redactor::for_secret(basic(ours).as_bytes(), ours.as_bytes())
        .unwrap()
        .watched_by(tripwire.clone());
    // Pages quoting another token's header share the encoding's start with ours.
    for _ in 0..redact::PROBES_TOLERATED {
        let mut page = redactor.clone();
        page.feed(format!("git -c http.extraheader='Authorization: {}'", basic(theirs)).as_bytes());
        page.finish();
    }
    assert!(!tripwire.tripped());
}

#[test]
fn a_start_a_pause_flushed_is_counted_once() {
    let (redactor, tripwire) = watched();
    for _ in 0..redact::PROBES_TOLERATED - 1 {
        let mut stream = redactor.clone();
        stream.feed(b"sk-proj-012345");
        stream.flush_held();
        stream.feed(b"X and more");
        stream.finish();
    }
    assert!(!tripwire.tripped(), "a start was counted twice");
}

// ---- probing for the secret a character at a time ---------------------------------

/// The oracle a guest has when a bound host sends back bytes it chose (an echo, a
/// file it stored there): does a response ending in `guess` come back changed?
fn comes_back_masked(redactor: &Redactor, guess: &[u8]) -> bool {
    let mut stream = redactor.clone();
    let mut out = stream.feed(guess).to_vec();
    out.extend_from_slice(&stream.finish());
    out != guess
}

/// Guesses the needle that starts with `start` a character at a time from `alphabet`
/// through [`comes_back_masked`], until the tripwire trips or nothing matches. Returns
/// what was recovered and whether the tripwire tripped.
fn probe_until_tripped(
    value: &[u8],
    secret: &[u8],
    start: &[u8],
    alphabet: &[u8],
) -> (Vec<u8>, bool) {
    let (redactor, tripwire) = watched_for(value, secret);
    let mut known = start.to_vec();
    loop {
        let mut next = None;
        for &c in alphabet {
            let guess = [known.as_slice(), &[c]].concat();
            let masked = comes_back_masked(&redactor, &guess);
            if tripwire.tripped() {
                return (known, true);
            }
            if masked {
                next = Some(c);
                break;
            }
        }
        match next {
            Some(c) => known.push(c),
            None => return (known, tripwire.tripped()),
        }
    }
}

const BASE64URL: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// A response holding the public form (`sk-ant-api03-`) and four characters more
/// without the rest counts as a probe. Anthropic (and OpenAI) keys are base64url after
/// their public form, so a '-' or '_' often falls early in them: it ends no public
/// form (which once ran to the last one in the first 24 bytes, so the random
/// characters before it were probed for free).
#[test]
fn a_random_underscore_early_in_a_key_is_not_its_public_form() {
    // A key as Anthropic issues them: `sk-ant-api03-` then base64url (here with an
    // `_` as its 8th random character, as ~29% of keys have one in their first 11).
    let key: &[u8] = b"sk-ant-api03-Qw3rTy8_Zx0Lm9Nb7Vc5Xz1As2Df3Gh4Jk5Lp6-Oi7Uy8Tr9Ew0QqAA";
    let (known, tripped) = probe_until_tripped(key, key, b"sk-ant-api03-", BASE64URL);
    assert!(tripped, "the probing never tripped");
    assert!(
        known.len() <= "sk-ant-api03-".len() + 4,
        "the guest recovered {:?} ({} random characters) before the secret was withdrawn",
        String::from_utf8_lossy(&known),
        known.len() - "sk-ant-api03-".len()
    );
}

/// The same for GitHub's `Authorization: Basic base64(x-access-token:TOKEN)`: probes of
/// its base64 count from the character that completes `x-access-token:ghp_` and four
/// more bytes (they once counted from the needle's middle only, so about nine of the
/// token's random characters could be read through its base64 first).
#[test]
fn the_basic_credentials_base64_tells_no_more_than_the_token_would() {
    use base64::Engine;
    let engine = base64::engine::general_purpose::STANDARD;
    let token = "ghp_AAAAbbbbCCCCddddEEEEffffGGGGhhhh1234";
    let value = format!("Basic {}", engine.encode(format!("x-access-token:{token}")));
    // Public: the encoding of `x-access-token:ghp` (18 bytes, 24 characters).
    let start = engine.encode("x-access-token:ghp");
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let (known, tripped) = probe_until_tripped(
        value.as_bytes(),
        token.as_bytes(),
        start.as_bytes(),
        alphabet,
    );
    assert!(tripped, "the probing never tripped");
    // Decode what was recovered (whole 4-character groups).
    let whole = &known[..known.len() / 4 * 4];
    let decoded = engine.decode(whole).unwrap();
    let token_part = &decoded["x-access-token:".len()..];
    assert!(
        token_part.len() <= "ghp_".len() + 4,
        "the guest recovered the token's start {:?} before the secret was withdrawn",
        String::from_utf8_lossy(token_part)
    );
}

/// A header template with text after `{}` and a space (`X-Auth: {} Secure-Session`):
/// its last word is no credential (as the token of "Bearer <token>" is), so ordinary
/// responses that merely begin that word are no probes and do not withdraw the secret.
#[test]
fn a_templates_trailing_word_is_no_credential() {
    let secret: &[u8] = b"Zx81Kq03Lm77Pw55";
    let value: &[u8] = b"Zx81Kq03Lm77Pw55 Secure-Session";
    let (redactor, tripwire) = watched_for(value, secret);
    for _ in 0..redact::PROBES_TOLERATED {
        let mut page = redactor.clone();
        page.feed(b"<p>Open Secure-Settings to turn it on.</p>");
        page.finish();
    }
    assert!(
        !tripwire.tripped(),
        "ordinary pages that say 'Secure-Settings' withdrew the secret"
    );
}

/// A needle that does not hold the secret where it can be found (neither as is nor as
/// the base64 of its last word) counts probes from the shortest start that is masked
/// at all, not from its middle: where the secret's characters begin is unknown.
#[test]
fn a_needle_whose_secret_cannot_be_placed_counts_early() {
    let secret: &[u8] = b"Zx81Kq03Lm77Pw55";
    let value: &[u8] = b"Digest q7Hn2Vb9Rt4Wm6Xc8Lp3Jd5Fs1Gk0";
    let (redactor, tripwire) = watched_for(value, secret);
    for guess in [&b"Digest q7X"[..], b"Digest q7Y", b"Digest q7Z"] {
        let mut stream = redactor.clone();
        stream.feed(guess);
        stream.finish();
    }
    assert!(tripwire.tripped());
}

/// A lookup that outlives its time limit keeps its place until the resolver answers:
/// the next waits for it (a guest asking for names nobody answers piles up no threads).
#[tokio::test]
async fn a_lookup_past_its_time_keeps_its_place_until_it_ends() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let places = Arc::new(tokio::sync::Semaphore::new(1));
    let limit = Duration::from_millis(100);
    let running = Arc::new(AtomicUsize::new(0));
    let slow = |running: Arc<AtomicUsize>| {
        move || {
            running.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(600));
            Ok(())
        }
    };
    let first = upstream::blocking_within(places.clone(), limit, slow(running.clone())).await;
    assert!(first.is_err(), "the first lookup ended within its time");
    let second = upstream::blocking_within(places.clone(), limit, slow(running.clone())).await;
    assert!(second.is_err(), "the second ran beside the first");
    assert_eq!(running.load(Ordering::SeqCst), 1, "two lookups ran at once");
    tokio::time::sleep(Duration::from_millis(600)).await;
    let third = upstream::blocking_within(places, limit, || Ok(7)).await;
    assert_eq!(third.unwrap().unwrap(), 7);
}

/// The connect rate refills at its rate, up to its burst, however long it was idle.
#[test]
fn the_connect_tokens_refill_at_their_rate_up_to_the_burst() {
    let start = std::time::Instant::now();
    let mut tokens = ConnectTokens {
        left: 2.0,
        at: start,
    };
    let took = |tokens: &mut ConnectTokens, after_ms: u64| {
        tokens.take(start + Duration::from_millis(after_ms), 10, 2)
    };
    assert!(took(&mut tokens, 0) && took(&mut tokens, 0));
    assert!(!took(&mut tokens, 0));
    assert!(!took(&mut tokens, 50), "half a token");
    assert!(took(&mut tokens, 100));
    assert!(!took(&mut tokens, 100));
    let hour = 3_600_000;
    assert!(took(&mut tokens, hour) && took(&mut tokens, hour));
    assert!(!took(&mut tokens, hour), "no more than the burst");
}
