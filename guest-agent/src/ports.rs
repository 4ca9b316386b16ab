//! Listening TCP sockets, from `/proc/net/tcp` and `/proc/net/tcp6`.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::protocol::ListeningPort;

/// Errors of reading the socket tables.
#[derive(Debug, thiserror::Error)]
pub enum PortsError {
    #[error("cannot read /proc/net/tcp and /proc/net/tcp6: {0}")]
    Read(std::io::Error),
}

/// `st` value of a socket in state TCP_LISTEN.
const TCP_LISTEN: &str = "0A";

/// Parses `ADDR:PORT` of `/proc/net/tcp{,6}`: the address is the in-memory bytes of
/// the network-order address printed as native-endian 32-bit words.
fn parse_addr(field: &str, ipv6: bool) -> Option<(IpAddr, u16)> {
    let (addr, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<u32> = (0..addr.len() / 8)
        .map(|i| {
            addr.get(i * 8..i * 8 + 8)
                .and_then(|w| u32::from_str_radix(w, 16).ok())
        })
        .collect::<Option<_>>()?;
    let mut bytes = Vec::with_capacity(16);
    for w in &words {
        bytes.extend_from_slice(&w.to_ne_bytes());
    }
    let ip = match (ipv6, bytes.len()) {
        (false, 4) => IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3])),
        (true, 16) => {
            let mut b = [0u8; 16];
            b.copy_from_slice(&bytes);
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some((ip, port))
}

/// Listening sockets in the text of one `/proc/net/tcp` or `/proc/net/tcp6` file.
pub fn parse_proc_net_tcp(text: &str, ipv6: bool) -> Vec<ListeningPort> {
    let mut out = Vec::new();
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 4 || fields[3] != TCP_LISTEN {
            continue;
        }
        if let Some((address, port)) = parse_addr(fields[1], ipv6) {
            out.push(ListeningPort {
                port,
                address,
                ipv6,
            });
        }
    }
    out
}

/// All listening TCP sockets (IPv4 and IPv6, loopback-only ones included), sorted
/// and without duplicates (e.g. `SO_REUSEPORT` groups).
pub fn listening_ports() -> Result<Vec<ListeningPort>, PortsError> {
    let mut set = BTreeSet::new();
    let mut any_ok = false;
    let mut last_err = None;
    for (path, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                any_ok = true;
                set.extend(parse_proc_net_tcp(&text, v6));
            }
            Err(e) => last_err = Some(e),
        }
    }
    match (any_ok, last_err) {
        (false, Some(e)) => Err(PortsError::Read(e)),
        _ => Ok(set.into_iter().collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP6: &str = "\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 23456 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:0CEA 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 23457 1 0000000000000000 100 0 0 10 0
   2: 0000000000000000FFFF00000100007F:1538 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 23458 1 0000000000000000 100 0 0 10 0
   3: 00000000000000000000000001000000:0CEA 00000000000000000000000001000000:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 23459 1 0000000000000000 20 4 30 10 -1
   4: B80D0120000000000000000001000000:0050 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 23460 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn parses_tcp6() {
        let ports = parse_proc_net_tcp(TCP6, true);
        let want: Vec<(u16, &str)> = vec![
            (8080, "::"),
            (3306, "::1"),
            (5432, "::ffff:127.0.0.1"),
            (80, "2001:db8::1"),
        ];
        let got: Vec<(u16, String)> = ports
            .iter()
            .map(|p| (p.port, p.address.to_string()))
            .collect();
        let want: Vec<(u16, String)> = want.into_iter().map(|(p, a)| (p, a.to_string())).collect();
        assert_eq!(got, want);
        assert!(ports.iter().all(|p| p.ipv6));
    }

    #[test]
    fn parses_tcp4() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:0277 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0\n\
   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1 0 100 0 0 10 0\n\
   2: 0100007F:0016 0100007F:A000 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0 100 0 0 10 0\n\
   garbage line\n";
        let ports = parse_proc_net_tcp(text, false);
        assert_eq!(ports.len(), 2);
        assert_eq!(
            (ports[0].port, ports[0].address.to_string()),
            (631, "127.0.0.1".into())
        );
        assert_eq!(
            (ports[1].port, ports[1].address.to_string()),
            (22, "0.0.0.0".into())
        );
    }
}
