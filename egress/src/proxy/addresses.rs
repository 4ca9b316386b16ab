//! The destinations the proxy never connects to, whatever the policy says.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Why the proxy never connects to `ip`, if it is a loopback, private, link-local,
/// shared, metadata (Azure's public-looking WireServer too), multicast, broadcast,
/// reserved or unspecified address, or one
/// of IPv6's forms of an IPv4 address that is (mapped, compatible, SIIT, NAT64 and
/// 6to4; Teredo, whose IPv4 address is hidden, altogether).
pub fn forbidden_address(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

/// An address of one of this host's interfaces, the length of its on-link prefix (its
/// netmask's), and whether the interface is point-to-point: the network it reaches
/// without a router, if it has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct HostNetwork {
    pub(super) address: IpAddr,
    pub(super) prefix_len: u32,
    /// A point-to-point or NOARP interface (a tun device, WireGuard): its netmask
    /// names what is routed into it (all of a VPN's or a fake-IP proxy's range), not
    /// neighbours on a link, so only its own address is the host's.
    pub(super) point_to_point: bool,
}

/// The shortest IPv4 on-link prefix taken as a network. A shorter one (a /0 a VPN or
/// a misconfiguration gives an interface) would refuse most of the internet, so only
/// the address itself is taken.
const SHORTEST_V4_NETWORK: u32 = 8;
/// The shortest IPv6 on-link prefix taken as a network, as [`SHORTEST_V4_NETWORK`];
/// /32 is a whole provider's allocation.
const SHORTEST_V6_NETWORK: u32 = 32;

impl HostNetwork {
    /// Whether `ip` is on this network (the host's own address aside); an IPv4
    /// network holds the IPv4 address an IPv6 form carries ([`canonical`]) too.
    /// Never on a point-to-point interface, nor on a prefix too short to be a link
    /// ([`SHORTEST_V4_NETWORK`]); never in 198.18.0.0/15, which [`forbidden_v4`]
    /// allows for fake-IP DNS proxies, whose TUN interface sits in that range.
    fn holds(&self, ip: IpAddr) -> bool {
        if self.point_to_point {
            return false;
        }
        let v4_bits = |v4: Ipv4Addr| u128::from(u32::from(v4)) << 96;
        match (self.address, ip, canonical(ip)) {
            (IpAddr::V4(own), _, IpAddr::V4(ip)) => {
                self.prefix_len >= SHORTEST_V4_NETWORK
                    && !is_fake_ip_range(ip)
                    && same_prefix(v4_bits(own), v4_bits(ip), self.prefix_len)
            }
            (IpAddr::V6(own), IpAddr::V6(ip), _) => {
                self.prefix_len >= SHORTEST_V6_NETWORK
                    && same_prefix(u128::from(own), u128::from(ip), self.prefix_len)
            }
            _ => false,
        }
    }
}

/// Whether `ip` is in 198.18.0.0/15 (benchmarking), the range fake-IP DNS proxies on
/// the host (Clash, mihomo, Surge, sing-box) answer every name with.
fn is_fake_ip_range(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    a == 198 && (b & 0xfe) == 18
}

/// Whether `a` and `b` agree in their first `len` bits.
fn same_prefix(a: u128, b: u128, len: u32) -> bool {
    let mask = u128::MAX.checked_shl(128 - len.min(128)).unwrap_or(0);
    a & mask == b & mask
}

/// Why the proxy never connects to `ip`: [`forbidden_address`]'s reasons, or that it
/// is an address of this host's or on one of its networks ([`host_networks`]). A
/// public address of the host's (a cloud machine's, a laptop's global IPv6 one)
/// reaches every host service listening on all interfaces, as loopback would; a
/// public one next to it (a LAN device's global IPv6 address, a neighbour in a
/// cloud's public subnet) is the LAN's, which private addresses are refused to keep
/// out of reach. (A public address the host is reached at through NAT, a cloud's
/// elastic IP, is on none of its interfaces, so it cannot be told from another's:
/// through it the guest reaches what the internet does.)
pub(super) fn forbidden_destination(ip: IpAddr, networks: &[HostNetwork]) -> Option<&'static str> {
    forbidden_address(ip).or_else(|| {
        if networks
            .iter()
            .any(|own| canonical(own.address) == canonical(ip))
        {
            Some("an address of this host")
        } else if networks.iter().any(|own| own.holds(ip)) {
            Some("on a network this host is attached to")
        } else {
            None
        }
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

/// How long a reading of the host's addresses ([`host_networks`]) is used before it
/// is read again. Reading them is a netlink dump of every interface, too dear for each
/// connection a guest opens; a second is still too short for an address the host has
/// just been given (a VPN coming up, DHCP) to be reached through the proxy in earnest.
pub(super) const HOST_NETWORKS_LIFETIME: Duration = Duration::from_secs(1);

/// The host's addresses and networks ([`host_networks`]), read at most once per
/// `lifetime`, shared by all the proxy's connections. A failed reading is not kept:
/// the next connection reads again, and is refused if that fails too.
pub(super) struct HostNetworksCache {
    lifetime: Duration,
    read: fn() -> std::io::Result<Vec<HostNetwork>>,
    last: Mutex<Option<(Instant, Arc<[HostNetwork]>)>>,
}

impl Default for HostNetworksCache {
    fn default() -> Self {
        Self::new(HOST_NETWORKS_LIFETIME, host_networks)
    }
}

impl HostNetworksCache {
    pub(super) fn new(lifetime: Duration, read: fn() -> std::io::Result<Vec<HostNetwork>>) -> Self {
        Self {
            lifetime,
            read,
            last: Mutex::new(None),
        }
    }

    /// The host's networks, as read less than the lifetime ago, or read now.
    pub(super) fn get(&self) -> std::io::Result<Arc<[HostNetwork]>> {
        self.get_at(Instant::now())
    }

    pub(super) fn get_at(&self, now: Instant) -> std::io::Result<Arc<[HostNetwork]>> {
        if let Some((read_at, networks)) = &*self.lock() {
            // A reading from after `now` (another connection's, a moment later) is
            // fresher still.
            if now.saturating_duration_since(*read_at) < self.lifetime {
                return Ok(networks.clone());
            }
        }
        // Read without the lock: connections that find the reading stale together
        // each read (as each did before there was a cache) rather than queue behind
        // one another's system call.
        let networks: Arc<[HostNetwork]> = (self.read)()?.into();
        let mut last = self.lock();
        let newer_kept = last.as_ref().is_some_and(|(read_at, _)| *read_at > now);
        if !newer_kept {
            *last = Some((now, networks.clone()));
        }
        Ok(networks)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(Instant, Arc<[HostNetwork]>)>> {
        self.last
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The addresses of this host's interfaces and their networks, as they are now: they
/// come and go (Wi-Fi, a VPN, DHCP). The proxy reads them through its
/// [`HostNetworksCache`].
pub(super) fn host_networks() -> std::io::Result<Vec<HostNetwork>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list it allocated to `list`, freed below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let point_to_point_flags = (libc::IFF_POINTOPOINT | libc::IFF_NOARP) as libc::c_uint;
    let mut networks = Vec::new();
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: `entry` is a node of the list getifaddrs made, not yet freed.
        let node = unsafe { &*entry };
        // SAFETY: ifa_addr is null or points to a sockaddr the list owns.
        if let Some(address) = unsafe { socket_address(node.ifa_addr) } {
            // SAFETY: ifa_netmask is null or points to a sockaddr the list owns.
            let prefix_len = match unsafe { socket_address(node.ifa_netmask) } {
                Some(IpAddr::V4(mask)) if address.is_ipv4() => u32::from(mask).leading_ones(),
                Some(IpAddr::V6(mask)) if address.is_ipv6() => u128::from(mask).leading_ones(),
                // Without a netmask, the address alone.
                _ => match address {
                    IpAddr::V4(_) => 32,
                    IpAddr::V6(_) => 128,
                },
            };
            networks.push(HostNetwork {
                address,
                prefix_len,
                point_to_point: node.ifa_flags & point_to_point_flags != 0,
            });
        }
        entry = node.ifa_next;
    }
    // SAFETY: `list` came from getifaddrs and is freed once; no node is used after.
    unsafe { libc::freeifaddrs(list) };
    Ok(networks)
}

/// The IP address in `address`, if it holds one.
///
/// # Safety
/// `address` is null or points to a valid sockaddr of the family it names (as
/// getifaddrs's nodes do, while their list is not freed).
unsafe fn socket_address(address: *const libc::sockaddr) -> Option<IpAddr> {
    // SAFETY: the caller's promise: null or a valid sockaddr.
    let family = i32::from(unsafe { address.as_ref() }?.sa_family);
    match family {
        libc::AF_INET => {
            // SAFETY: the family is AF_INET, which sockaddr_in describes.
            let v4 = unsafe { &*(address as *const libc::sockaddr_in) };
            Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family is AF_INET6, which sockaddr_in6 describes.
            let v6 = unsafe { &*(address as *const libc::sockaddr_in6) };
            Some(IpAddr::V6(Ipv6Addr::from(v6.sin6_addr.s6_addr)))
        }
        _ => None,
    }
}

pub(super) fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, ..] = ip.octets();
    if ip == Ipv4Addr::new(169, 254, 169, 254) {
        Some("the cloud metadata address")
    } else if ip == Ipv4Addr::new(168, 63, 129, 16) {
        // Public by its number, yet reached only from inside Azure: its host's
        // provisioning agent, DNS and health probes.
        Some("Azure's host address (WireServer)")
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
        // Not 198.18.0.0/15 ([`is_fake_ip_range`]): "fake-IP" DNS proxies on the
        // host answer every name with one of those.
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
