//! The supervisor's control socket (`control.sock` in the VM's sockets directory,
//! [`crate::state::VmDir::control_socket`]): one JSON request and one JSON response
//! per connection.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Longest a request may take: configuring the guest goes through the nested host,
/// which can be slow, and may wait behind another session's setup; each is given up
/// after [`crate::exec::AGENT_TIMEOUT`], so the supervisor's own answer (why it gave
/// up) comes within this.
const REQUEST_TIMEOUT: Duration =
    Duration::from_secs(crate::exec::AGENT_TIMEOUT.as_secs() * 2 + 15);
/// Longest request or response line accepted.
pub const MAX_LINE: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot reach the VM's supervisor at {}: {source}; is the VM running? ('vmctl ps')", .path.display())]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("talking to the VM's supervisor at {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the VM's supervisor at {} did not answer within {} s; if this goes on, \
         'vmctl logs' may say why, and 'vmctl stop' ends the VM",
        .path.display(),
        .after.as_secs()
    )]
    NoAnswer { path: PathBuf, after: Duration },
    #[error("the VM's supervisor at {} answered something unreadable: {reason}", .path.display())]
    BadResponse { path: PathBuf, reason: String },
    #[error("{0}")]
    Refused(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ControlRequest {
    /// (Re)configure the guest's network: CA, variables (placeholders follow the
    /// current secrets), and relay these loopback ports besides those already relayed.
    Configure {
        relay_ports: Vec<u16>,
    },
    /// Listen on `address:host_port` (0: any free port) and forward each connection
    /// to the guest's loopback `guest_port`.
    Publish {
        guest_port: u16,
        host_port: u16,
        address: IpAddr,
    },
    Unpublish {
        guest_port: u16,
    },
    ListPublished,
}

/// One published port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishedPort {
    pub guest_port: u16,
    pub host: SocketAddr,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum ControlResponse {
    Configured {
        relay_ports: Vec<u16>,
        failed_relays: Vec<(u16, String)>,
    },
    Published(PublishedPort),
    Unpublished {
        host: SocketAddr,
    },
    PublishedList {
        ports: Vec<PublishedPort>,
        /// The host loopback ports relayed into the VM now, those added to it while it
        /// runs among them (absent from a supervisor of an older vmctl).
        #[serde(default)]
        relays: Vec<u16>,
        /// Of `relays`, those the guest could not relay when last asked (a server in
        /// the VM holds the port, most often).
        #[serde(default)]
        failed_relays: Vec<u16>,
        /// The guest's connections to the host services refused because it held the
        /// most it may already (`MAX_GUEST_SERVICE_CONNECTIONS`), since the supervisor
        /// started.
        #[serde(default)]
        refused_at_limit: u64,
        /// When the last of those was refused (Unix time, seconds), if one was.
        #[serde(default)]
        last_refused_at_limit: Option<u64>,
    },
    Error {
        message: String,
    },
}

/// Sends one request to the supervisor behind `socket` and waits for its answer; an
/// `Error` answer becomes [`ControlError::Refused`].
pub fn request(socket: &Path, request: &ControlRequest) -> Result<ControlResponse, ControlError> {
    request_within(socket, request, REQUEST_TIMEOUT)
}

fn request_within(
    socket: &Path,
    request: &ControlRequest,
    timeout: Duration,
) -> Result<ControlResponse, ControlError> {
    let io = |source| ControlError::Io {
        path: socket.to_path_buf(),
        source,
    };
    let mut stream =
        crate::own_socket::connect(socket).map_err(|source| ControlError::Connect {
            path: socket.to_path_buf(),
            source,
        })?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    let mut line = serde_json::to_vec(request).map_err(|e| ControlError::BadResponse {
        path: socket.to_path_buf(),
        reason: e.to_string(),
    })?;
    line.push(b'\n');
    stream.write_all(&line).map_err(io)?;
    let mut answer = String::new();
    BufReader::new(std::io::Read::take(stream, MAX_LINE as u64))
        .read_line(&mut answer)
        .map_err(|source| match source.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                ControlError::NoAnswer {
                    path: socket.to_path_buf(),
                    after: timeout,
                }
            }
            _ => io(source),
        })?;
    let response: ControlResponse =
        serde_json::from_str(&answer).map_err(|e| ControlError::BadResponse {
            path: socket.to_path_buf(),
            reason: if answer.is_empty() {
                "no answer (did the supervisor exit?)".into()
            } else {
                e.to_string()
            },
        })?;
    match response {
        ControlResponse::Error { message } => Err(ControlError::Refused(message)),
        other => Ok(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A supervisor that takes the request and never answers is given up on with an
    /// error that says so, not with EAGAIN.
    #[test]
    fn a_supervisor_that_does_not_answer_is_said_to() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("control.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let silent = std::thread::spawn(move || listener.accept().map(|(stream, _)| stream));
        let request = ControlRequest::Configure {
            relay_ports: Vec::new(),
        };
        let err = request_within(&socket, &request, Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, ControlError::NoAnswer { .. }), "{err:?}");
        let message = err.to_string();
        assert!(message.contains("did not answer within"), "{message}");
        assert!(message.contains("vmctl stop"), "{message}");
        drop(silent.join());
    }

    /// A supervisor of an older vmctl lists no relays: read as none, not refused.
    #[test]
    fn a_published_list_without_relays_reads_as_none() {
        let older = r#"{"result":"published_list","ports":[]}"#;
        assert_eq!(
            serde_json::from_str::<ControlResponse>(older).unwrap(),
            ControlResponse::PublishedList {
                ports: Vec::new(),
                relays: Vec::new(),
                failed_relays: Vec::new(),
                refused_at_limit: 0,
                last_refused_at_limit: None,
            }
        );
    }

    #[test]
    fn a_request_waits_longer_than_two_guest_setups() {
        assert!(REQUEST_TIMEOUT > crate::exec::AGENT_TIMEOUT * 2);
    }
}
