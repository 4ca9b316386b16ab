//! The destinations the proxy never connects to, whatever the policy says.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Why the proxy never connects to `ip`, if it is a loopback, private, link-local,
/// shared, metadata, multicast, broadcast, reserved or unspecified address, or one
/// of IPv6's forms of an IPv4 address that is (mapped, compatible, SIIT, NAT64 and
/// 6to4; Teredo, whose IPv4 address is hidden, altogether).
pub fn forbidden_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

/// Why the proxy never connects to `ip`: [`forbidden_address`]'s reasons, or that it
/// is one of `host_addresses` (this host's own, [`host_addresses`]). A public address
/// of the host's (a cloud machine's, a laptop's global IPv6 one) reaches every host
/// service listening on all interfaces, as loopback would.
pub(super) fn forbidden_destination(ip: IpAddr, host_addresses: &[IpAddr]) -> Option<&'static str> {
    forbidden_address(ip).or_else(|| {
        let ip = canonical(ip);
        host_addresses
            .iter()
            .any(|own| canonical(*own) == ip)
            .then_some("an address of this host")
    })
}

/// `ip`, an IPv6 address that carries an IPv4 address as that one ([`embedded_v4`]).
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => embedded_v4(v6).map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The IPv4 address that `ip` carries, and may reach: IPv4-mapped (::ffff:a.b.c.d),
/// IPv4-compatible (::a.b.c.d), SIIT (::ffff:0:a.b.c.d), NAT64 (64:ff9b::a.b.c.d) or
/// 6to4 (2002:a.b.c.d::/48).
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let seg = ip.segments();
    let v4 = |high: u16, low: u16| Ipv4Addr::from((u32::from(high) << 16) | u32::from(low));
    if let Some(mapped) = ip.to_ipv4_mapped() {
        Some(mapped)
    } else if seg[..6] == [0; 6]
        || seg[..6] == [0, 0, 0, 0, 0xffff, 0]
        || seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
    {
        Some(v4(seg[6], seg[7]))
    } else if seg[0] == 0x2002 {
        Some(v4(seg[1], seg[2]))
    } else {
        None
    }
}

/// The addresses of this host's interfaces, read anew for each connection: they come
/// and go (Wi-Fi, a VPN, DHCP).
pub(super) fn host_addresses() -> std::io::Result<Vec<IpAddr>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list it allocated to `list`, freed below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut addresses = Vec::new();
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: `entry` is a node of the list getifaddrs made, not yet freed.
        let node = unsafe { &*entry };
        // SAFETY: a non-null ifa_addr points to a sockaddr of the family it says,
        // which sockaddr_in/sockaddr_in6 describe.
        if let Some(address) = unsafe { node.ifa_addr.as_ref() } {
            match i32::from(address.sa_family) {
                libc::AF_INET => {
                    // SAFETY: see above: the family is AF_INET.
                    let v4 = unsafe { &*(node.ifa_addr as *const libc::sockaddr_in) };
                    addresses.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr))));
                }
                libc::AF_INET6 => {
                    // SAFETY: see above: the family is AF_INET6.
                    let v6 = unsafe { &*(node.ifa_addr as *const libc::sockaddr_in6) };
                    addresses.push(IpAddr::V6(Ipv6Addr::from(v6.sin6_addr.s6_addr)));
                }
                _ => {}
            }
        }
        entry = node.ifa_next;
    }
    // SAFETY: `list` came from getifaddrs and is freed once; no node is used after.
    unsafe { libc::freeifaddrs(list) };
    Ok(addresses)
}

pub(super) fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, ..] = ip.octets();
    if ip == Ipv4Addr::new(169, 254, 169, 254) {
        Some("the cloud metadata address")
    } else if ip.is_loopback() {
        Some("a loopback address")
    } else if a == 0 {
        // 0.0.0.0/8: "this network", which Linux connects to the local host.
        Some("an unspecified address")
    } else if ip.is_private() {
        Some("a private address")
    } else if ip.is_link_local() {
        Some("a link-local address")
    } else if a == 100 && (b & 0xc0) == 64 {
        Some("a shared (CGNAT) address")
    } else if ip.is_multicast() {
        Some("a multicast address")
    } else if a >= 240 {
        // 240.0.0.0/4, the broadcast address among them.
        Some("a reserved address")
    } else if a == 192 && b == 0 && ip.octets()[2] == 0 {
        Some("an IETF protocol address (192.0.0.0/24)")
    } else {
        // Not 198.18.0.0/15 (benchmarking): "fake-IP" DNS proxies on the host
        // (Clash, Surge, sing-box) answer every name with one of those.
        None
    }
}

pub(super) fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let seg = ip.segments();
    if ip == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254) {
        Some("the cloud metadata address")
    } else if ip.is_unspecified() {
        Some("an unspecified address")
    } else if ip.is_loopback() {
        Some("a loopback address")
    } else if seg[..3] == [0x64, 0xff9b, 1] {
        // Local NAT64 (RFC 8215): its operator chooses where in the address the IPv4
        // address goes (RFC 6052 prefix lengths), so it cannot be checked.
        Some("a local-use NAT64 address (its IPv4 address cannot be checked)")
    } else if let Some(v4) = embedded_v4(ip) {
        // The IPv4 address it carries may be a private one.
        forbidden_v4(v4)
    } else if seg[..2] == [0x2001, 0] {
        Some("a Teredo address (its IPv4 address cannot be checked)")
    } else if seg[..4] == [0x100, 0, 0, 0] {
        Some("a discard-only address")
    } else if (seg[0] & 0xfe00) == 0xfc00 {
        Some("a unique-local (private) address")
    } else if (seg[0] & 0xffc0) == 0xfe80 {
        Some("a link-local address")
    } else if (seg[0] & 0xffc0) == 0xfec0 {
        Some("a site-local (private) address")
    } else if ip.is_multicast() {
        Some("a multicast address")
    } else {
        None
    }
}
