//! `vmctl ports`, `publish` and `unpublish`: the VM's listening ports, and host
//! ports that forward to them.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use guest_agent::protocol::{ListeningPort, EGRESS_PROXY_PORT};

use crate::network::control::{self, ControlError, ControlRequest, ControlResponse, PublishedPort};
use crate::state::VmDir;

#[derive(Debug, thiserror::Error)]
pub enum PortsError {
    #[error("no VM is running for {}; start it with 'vmctl up'", .0.display())]
    NotRunning(std::path::PathBuf),
    #[error("{}: no such directory, and no VM of one that was there", .0.display())]
    NoWorkspace(std::path::PathBuf),
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("cannot list the VM's ports: {0}")]
    Agent(String),
    #[error("unexpected answer from the VM's supervisor: {0}")]
    Unexpected(String),
}

fn running_vm(workspace: &Path) -> Result<VmDir, PortsError> {
    let (workspace, vm) = VmDir::lookup(workspace)?;
    match vm.running_pid() {
        Some(_) => Ok(vm),
        None if !workspace.exists() && !vm.path.exists() => Err(PortsError::NoWorkspace(workspace)),
        None => Err(PortsError::NotRunning(workspace)),
    }
}

/// Prints the VM's listening ports, with where each is published.
pub fn list(workspace: &Path) -> Result<(), PortsError> {
    let vm = running_vm(workspace)?;
    let listening = guest_ports(&vm)?;
    let (published, mut relays, failed_relays, refused) =
        match control::request(&vm.control_socket(), &ControlRequest::ListPublished)? {
            ControlResponse::PublishedList {
                ports,
                relays,
                failed_relays,
                refused_at_limit,
                last_refused_at_limit,
            } => (
                ports,
                relays,
                failed_relays,
                RefusedAtLimit {
                    count: refused_at_limit,
                    last_unix_s: last_refused_at_limit,
                },
            ),
            other => return Err(PortsError::Unexpected(format!("{other:?}"))),
        };
    // Those the VM started with, for a supervisor that does not say (an older one).
    relays.extend(
        vm.read_record()
            .map(|record| record.relay_ports)
            .unwrap_or_default(),
    );
    crate::terminal::print_out(format_args!(
        "{}",
        format_table(&listening, &published, &relays, &failed_relays)
    ));
    let now_unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    if let Some(warning) = limit_warning(&refused, now_unix_s) {
        vmm::to_stderr!("{warning}");
    }
    Ok(())
}

/// The guest's connections to the host services refused past its limit, as the
/// supervisor counts them.
struct RefusedAtLimit {
    /// Since the supervisor started.
    count: u64,
    /// When the last was (Unix time, seconds); none from a supervisor that does not
    /// say.
    last_unix_s: Option<u64>,
}

/// How long after the last connection refused at the limit `vmctl ports` warns of it:
/// a burst long over is no news at every listing.
const LIMIT_WARNING_FOR_S: u64 = 60 * 60;

/// What to say of the connections the guest opened to the host services past its
/// limit, if the last was refused lately: the guest's clients saw only resets, and
/// the supervisor's log is seldom read.
fn limit_warning(refused: &RefusedAtLimit, now_unix_s: u64) -> Option<String> {
    if refused.count == 0 {
        return None;
    }
    let when = match refused.last_unix_s {
        Some(last) => {
            let ago = now_unix_s.saturating_sub(last);
            if ago > LIMIT_WARNING_FOR_S {
                return None;
            }
            if ago < 120 {
                format!("last {ago} s ago")
            } else {
                format!("last {} min ago", ago / 60)
            }
        }
        None => "at some time since it started".to_string(),
    };
    Some(format!(
        "vmctl: warning: the VM reached its limit of {} connections to the host services \
         (egress proxy and relays) at once ({when}): its connections past it \
         were refused (reset in the VM), {} since the VM started; a program in it may leave \
         its connections open ('vmctl exec ss -tnp' lists them)",
        crate::network::services::MAX_GUEST_SERVICE_CONNECTIONS,
        refused.count
    ))
}

fn guest_ports(vm: &VmDir) -> Result<Vec<ListeningPort>, PortsError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| PortsError::Agent(e.to_string()))?;
    runtime.block_on(ask_guest_ports(&vm.vsock_socket()))
}

/// The guest agent's listening ports, through the VM's vsock socket; a stuck agent is
/// given up on after [`crate::exec::AGENT_TIMEOUT`].
async fn ask_guest_ports(vsock: &std::path::Path) -> Result<Vec<ListeningPort>, PortsError> {
    crate::exec::call_agent(vsock, |connection| connection.list_ports())
        .await
        .map_err(|e| PortsError::Agent(e.describe("no answer")))
}

/// One line per guest port (a port bound on IPv4 and IPv6 shows both addresses), and
/// per published one nothing listens on. Of `relays`, those in `failed_relays` are
/// not relayed: what listens there is the VM's own.
fn format_table(
    listening: &[ListeningPort],
    published: &[PublishedPort],
    relays: &[u16],
    failed_relays: &[u16],
) -> String {
    let mut by_port: BTreeMap<u16, Vec<String>> = BTreeMap::new();
    // In linear time, whatever the guest's list holds.
    let mut seen = std::collections::HashSet::new();
    for port in listening {
        let addresses = by_port.entry(port.port).or_default();
        if seen.insert((port.port, port.address)) {
            addresses.push(port.address.to_string());
        }
    }
    // Publishing comes before the server listens (publish, then start it), or outlives
    // it: the table is where the user finds the host address again.
    for port in published {
        by_port.entry(port.guest_port).or_default();
    }
    let mut out = format!("{:<7} {:<28} {:<22} NOTE\n", "PORT", "ADDRESS", "PUBLISHED");
    for (port, addresses) in by_port {
        let published_at = published
            .iter()
            .find(|p| p.guest_port == port)
            .map(|p| p.host.to_string())
            .unwrap_or_else(|| "-".into());
        let note = if port == EGRESS_PROXY_PORT {
            "vmctl egress proxy"
        } else if failed_relays.contains(&port) && !addresses.is_empty() {
            "relay from the host failed: a server in the VM holds the port"
        } else if failed_relays.contains(&port) {
            "relay from the host failed; tried again when a session starts"
        } else if relays.contains(&port) {
            "relayed from the host"
        } else if addresses.is_empty() {
            "nothing listens on it in the VM (yet)"
        } else {
            ""
        };
        let address = if addresses.is_empty() {
            "-".to_string()
        } else {
            addresses.join(",")
        };
        let line = format!("{port:<7} {address:<28} {published_at:<22} {note}");
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Publishes `guest_port` on the host and prints where.
pub fn publish(
    workspace: &Path,
    guest_port: u16,
    host_port: Option<u16>,
    address: std::net::IpAddr,
) -> Result<SocketAddr, PortsError> {
    let vm = running_vm(workspace)?;
    let request = ControlRequest::Publish {
        guest_port,
        host_port: host_port.unwrap_or(0),
        address,
    };
    match control::request(&vm.control_socket(), &request)? {
        ControlResponse::Published(port) => Ok(port.host),
        other => Err(PortsError::Unexpected(format!("{other:?}"))),
    }
}

pub fn unpublish(workspace: &Path, guest_port: u16) -> Result<SocketAddr, PortsError> {
    let vm = running_vm(workspace)?;
    match control::request(
        &vm.control_socket(),
        &ControlRequest::Unpublish { guest_port },
    )? {
        ControlResponse::Unpublished { host } => Ok(host),
        other => Err(PortsError::Unexpected(format!("{other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A VM whose vsock accepts but whose agent never answers: `vmctl ports` gives up
    /// with a remedy instead of waiting forever.
    #[tokio::test(start_paused = true)]
    async fn an_agent_that_never_answers_is_given_up_on() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock");
        let _silent = tokio::net::UnixListener::bind(&socket).unwrap();
        let error = tokio::time::timeout(crate::exec::AGENT_TIMEOUT * 2, ask_guest_ports(&socket))
            .await
            .expect("still waiting for the agent after twice the bound")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("no answer within 60 s") && error.contains("vmctl stop"),
            "{error}"
        );
    }

    /// `vmctl publish 3000` before the dev server listens (the usual order: publish,
    /// then start it) is still a publication: `vmctl ports` must show where it is on
    /// the host, or the user cannot find the address again.
    #[test]
    fn a_published_port_nothing_listens_on_yet_is_listed() {
        let published = [PublishedPort {
            guest_port: 8080,
            host: "127.0.0.1:41000".parse().unwrap(),
        }];
        let table = format_table(&[], &published, &[], &[]);
        assert!(
            table.contains("8080") && table.contains("127.0.0.1:41000"),
            "the publication is missing from the table:\n{table}"
        );
        assert!(table.contains("nothing listens"), "{table}");
    }

    /// A guest server that holds a port to be relayed from the host (so the relay
    /// failed) is the VM's own, not called the host's.
    #[test]
    fn a_relay_that_failed_is_not_listed_as_relayed() {
        let listening = [ListeningPort {
            port: 5432,
            address: "127.0.0.1".parse().unwrap(),
            ipv6: false,
        }];
        let table = format_table(&listening, &[], &[5432, 6767], &[5432]);
        let line = table.lines().find(|l| l.starts_with("5432")).unwrap();
        assert!(
            line.contains("relay from the host failed") && !line.contains("relayed from"),
            "{table}"
        );
    }

    /// Warned of while the last refusal is recent, with when it was; not at every
    /// listing for the rest of the VM's life.
    #[test]
    fn connections_refused_at_the_limit_are_warned_of_while_recent() {
        let refused = |count, last_unix_s| RefusedAtLimit { count, last_unix_s };
        let now = 1_000_000;
        assert_eq!(limit_warning(&refused(0, None), now), None);
        let warning = limit_warning(&refused(3, Some(now - 30)), now).unwrap();
        assert!(
            warning.contains("768 connections")
                && warning.contains("(last 30 s ago)")
                && warning.contains("3 since the VM started"),
            "{warning}"
        );
        let warning = limit_warning(&refused(3, Some(now - 600)), now).unwrap();
        assert!(warning.contains("(last 10 min ago)"), "{warning}");
        // A burst over an hour ago is no longer news.
        let old = refused(3, Some(now - LIMIT_WARNING_FOR_S - 1));
        assert_eq!(limit_warning(&old, now), None);
        // A supervisor that does not say when: the count alone.
        let warning = limit_warning(&refused(3, None), now).unwrap();
        assert!(
            warning.contains("(at some time since it started)"),
            "{warning}"
        );
    }

    #[test]
    fn table_merges_addresses_and_marks_published_and_ours() {
        let port = |port: u16, address: &str| ListeningPort {
            port,
            address: address.parse().unwrap(),
            ipv6: address.contains(':'),
        };
        let listening = [
            port(3128, "127.0.0.1"),
            port(6767, "127.0.0.1"),
            port(8080, "127.0.0.1"),
            port(8080, "::1"),
        ];
        let published = [PublishedPort {
            guest_port: 8080,
            host: "127.0.0.1:41000".parse().unwrap(),
        }];
        let table = format_table(&listening, &published, &[6767], &[]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4, "{table}");
        assert!(lines[1].starts_with("3128") && lines[1].ends_with("vmctl egress proxy"));
        assert!(lines[2].ends_with("relayed from the host"));
        assert!(lines[3].contains("127.0.0.1,::1") && lines[3].contains("127.0.0.1:41000"));
        assert!(!lines[3].ends_with(' '));
    }
}
