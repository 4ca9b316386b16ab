//! The host ↔ guest-agent wire protocol (see `guest-agent/PROTOCOL.md`).
//!
//! Every message travels in a frame: a `u32` little-endian payload length followed by
//! the payload, a [`postcard`]-encoded [`ClientMessage`] (host → agent) or
//! [`AgentMessage`] (agent → host). Frames larger than [`MAX_FRAME_SIZE`] are refused
//! before anything is allocated for them.
//!
//! postcard encodes enum variants by index and struct fields by position, so the
//! wire format changes whenever a variant or a field is added, removed or reordered:
//! any such change must bump [`PROTOCOL_VERSION`].

use std::net::IpAddr;

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The protocol version this crate speaks; sent in [`Hello`], checked by the agent.
pub const PROTOCOL_VERSION: u32 = 12;
/// How the agent's `Error` for a `Hello` of another protocol version begins.
pub const UNSUPPORTED_VERSION: &str = "unsupported protocol version";
/// The protocol version an agent's [`UNSUPPORTED_VERSION`] error says it speaks (its
/// words end "speaks N)"), if they say so.
pub fn version_spoken_in(agent_said: &str) -> Option<u32> {
    let (_, after) = agent_said.rsplit_once("speaks ")?;
    after.trim_end_matches(')').trim().parse().ok()
}
/// The largest payload a frame may carry (the 4-byte length prefix excluded).
pub const MAX_FRAME_SIZE: usize = 1024 * 1024;
/// The vsock port the agent listens on unless `vmctl.port=` says otherwise.
pub const DEFAULT_PORT: u32 = 1024;
/// The largest chunk of stdin/stdout/stderr bytes senders put in one frame.
pub const CHUNK_SIZE: usize = 64 * 1024;
/// Bytes of stdin a host may have sent that the command has not taken yet
/// ([`AgentMessage::StdinTaken`] gives them back). The agent buffers that much, so it
/// never has to stop reading the connection, and sees a `Signal` or the host's
/// going away at once, whatever the command does with its stdin.
pub const STDIN_WINDOW: usize = 1024 * 1024;
/// The host's vsock port for connections the guest opens (egress proxy, loopback
/// relays); each starts with one [`ServiceRequest`] frame, which the host answers
/// with one [`ServiceAnswer`] byte, then carries raw bytes.
pub const HOST_SERVICE_PORT: u32 = 1025;
/// How long the agent waits for the host's [`ServiceAnswer`]. The host answers well
/// within it: its connect to a loopback port takes at most a third of it per address
/// (IPv4, then IPv6).
pub const SERVICE_ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// The guest's HTTP(S) proxy: the agent listens on 127.0.0.1 at this port and
/// relays each connection to the host's egress proxy.
pub const EGRESS_PROXY_PORT: u16 = 3128;
/// The sandbox's egress CA certificate in the guest (PEM).
pub const GUEST_CA_FILE: &str = "/etc/ssl/certs/vmctl-egress.pem";
/// A script for `NODE_OPTIONS=--require=…` that sends Node's `fetch` through the
/// proxy where Node itself ignores the proxy variables (before Node 24).
pub const GUEST_NODE_PRELOAD: &str = "/etc/vmctl/node-proxy.cjs";
/// The guest's system CA bundle, which the agent extends with the egress CA and the
/// host's roots (`NetworkConfig::trusted_roots_pem`).
pub const GUEST_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// The version of this crate, reported by the agent in [`AgentMessage::HelloOk`].
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Errors of framing and encoding.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes exceeds the maximum of {MAX_FRAME_SIZE} bytes")]
    FrameTooLarge(usize),
    #[error("malformed message: {0}")]
    Decode(postcard::Error),
    #[error("cannot encode message: {0}")]
    Encode(postcard::Error),
    #[error("connection closed in the middle of a frame")]
    TruncatedFrame,
}

/// The first message of every connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Must equal the agent's [`PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Free-form name of the client (for the agent's logs), e.g. `vmctl 0.1.0`.
    pub client: String,
    /// The host's wall clock when it sent this, in nanoseconds since the Unix epoch:
    /// the agent keeps the guest's clock in step with it (see [`crate::clock`]).
    pub host_time_ns: Option<u64>,
}

/// Which account a command runs as.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum User {
    /// The host user configured for this VM (`vmctl.user=`), or root if none is.
    #[default]
    Default,
    Root,
    /// An account from the guest's `/etc/passwd`.
    Named(String),
}

/// Ask for a pseudo-terminal of this size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtyRequest {
    pub rows: u16,
    pub cols: u16,
    /// Value of `TERM` in the command's environment (e.g. `xterm-256color`).
    pub term: String,
}

/// Run a command.
///
/// Arguments, environment values and the working directory are raw bytes, as the
/// kernel takes them: they need not be UTF-8 (a file name in Latin-1, say), and pass
/// through unchanged as they do with ssh. Variable names are text.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// Program and arguments; `argv[0]` is looked up in `PATH`.
    #[serde(with = "byte_strings")]
    pub argv: Vec<Vec<u8>>,
    /// Added to (and overriding) the default environment: `PATH`, `HOME`, `USER`,
    /// `LOGNAME`, `SHELL` and, with a tty, `TERM`.
    #[serde(with = "byte_values")]
    pub env: Vec<(String, Vec<u8>)>,
    /// Working directory; the user's home when `None` or when it does not exist.
    #[serde(with = "serde_bytes")]
    pub cwd: Option<Vec<u8>>,
    pub user: User,
    /// `Some` runs the command on a new pseudo-terminal (stdout and stderr merged).
    pub tty: Option<TtyRequest>,
    /// The file mode creation mask the command starts with: the host's, so that what
    /// it makes in the shares gets the modes it would on the host (a 0002 host keeps
    /// group-write). The agent's own (0022) when `None`.
    pub umask: Option<u32>,
}

/// A list of byte strings (`serde_bytes` takes single ones), each encoded as one.
mod byte_strings {
    use serde::{Deserialize, Deserializer, Serializer};
    use serde_bytes::{ByteBuf, Bytes};

    pub fn serialize<S: Serializer>(list: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(list.iter().map(|b| Bytes::new(b)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u8>>, D::Error> {
        let list = Vec::<ByteBuf>::deserialize(d)?;
        Ok(list.into_iter().map(ByteBuf::into_vec).collect())
    }
}

/// Environment variables: a name (text) and a value (a byte string) each.
mod byte_values {
    use serde::{Deserialize, Deserializer, Serializer};
    use serde_bytes::{ByteBuf, Bytes};

    pub fn serialize<S: Serializer>(vars: &[(String, Vec<u8>)], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(vars.iter().map(|(k, v)| (k, Bytes::new(v))))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<(String, Vec<u8>)>, D::Error> {
        let vars = Vec::<(String, ByteBuf)>::deserialize(d)?;
        Ok(vars.into_iter().map(|(k, v)| (k, v.into_vec())).collect())
    }
}

/// Host → agent messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientMessage {
    Hello(Hello),
    Exec(ExecRequest),
    Health,
    ListPorts,
    Shutdown,
    /// Bytes for the command's stdin (during an exec).
    Stdin(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Close the command's stdin (with a tty: send the EOF character, `^D`).
    StdinEof,
    /// Resize the command's terminal (with a tty; it receives `SIGWINCH`).
    Resize {
        rows: u16,
        cols: u16,
    },
    /// Send this signal number to the command's process group.
    Signal(i32),
    /// Set up the VM's network side (see [`NetworkConfig`]); answered by
    /// [`AgentMessage::NetworkConfigured`]. Sent again to add relay ports.
    ConfigureNetwork(NetworkConfig),
    /// Connect this connection to the guest's loopback port (a published port):
    /// answered by [`AgentMessage::Connected`], after which the connection carries
    /// raw bytes both ways.
    ConnectPort(u16),
    /// Files and directories of writable shares that the host changed: the agent
    /// makes the guest's file watchers see them (see [`HostEdit`]) and answers
    /// [`AgentMessage::EditsShown`]. More batches may follow on the same connection.
    HostEdits(Vec<HostEdit>),
    /// The host can no longer take this output of the command (its reader went away,
    /// as in `vmctl exec -- yes | head -1`): the agent closes its end of that pipe,
    /// so the command's next write there fails with `EPIPE` (`SIGPIPE`), as it would
    /// have on the host, and the command goes on otherwise. Ignored with a tty.
    OutputClosed(OutputStream),
}

/// One of a command's output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OutputStream {
    Stdout,
    Stderr,
}

/// One change the host made in a share, at its guest path.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct HostEdit {
    /// The guest path (absolute, inside a writable share), as raw bytes: paths need
    /// not be UTF-8.
    #[serde(with = "serde_bytes")]
    pub path: Vec<u8>,
    pub kind: EditKind,
}

impl HostEdit {
    pub fn new(path: &std::path::Path, kind: EditKind) -> HostEdit {
        use std::os::unix::ffi::OsStrExt;
        HostEdit {
            path: path.as_os_str().as_bytes().to_vec(),
            kind,
        }
    }

    /// The guest path, as the bytes it was sent as.
    pub fn path(&self) -> &std::path::Path {
        use std::os::unix::ffi::OsStrExt;
        std::path::Path::new(std::ffi::OsStr::from_bytes(&self.path))
    }
}

/// What changed at a [`HostEdit`]'s path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum EditKind {
    /// The file's content or attributes.
    Content,
    /// The directory's entries: one was created, removed or renamed.
    Entries,
    /// This name was removed or renamed (from or over): the guest checks its cached
    /// name again (it may still lead to the file the name had before), and touches
    /// nothing (the directory's `Entries` is what file watchers see).
    Name,
}

/// How the agent dealt with a batch of [`HostEdit`]s.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EditsShown {
    /// Touched, so the guest's watchers saw an event.
    pub shown: u32,
    /// Left alone: the guest itself had just written there, so its watchers already
    /// saw the change (the host saw the guest's own write).
    pub guest_own: u32,
    /// Gone, outside every writable share, or refused (a symlink on the way, a file
    /// virtiofsd may not touch).
    pub failed: u32,
}

/// The VM's network setup, sent by the host once the agent answers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkConfig {
    /// The sandbox's egress CA (PEM): written to [`GUEST_CA_FILE`] and appended to
    /// [`GUEST_CA_BUNDLE`] (once).
    pub ca_cert_pem: String,
    /// Variables every command gets (under its own `env`) and that go into
    /// `/etc/environment`: the proxy, the CA paths, placeholder credentials.
    pub env: Vec<(String, String)>,
    /// Guest loopback ports relayed to the same port on the host's loopback;
    /// ports already relayed stay relayed.
    pub relay_ports: Vec<u16>,
    /// The certificates the host's egress proxy trusts upstream (PEM): the host's
    /// roots, a TLS-inspecting company proxy's CA among them. The guest's TLS through
    /// the proxy's tunnels runs end to end, so they go into [`GUEST_CA_BUNDLE`] too
    /// (those it lacks). Empty: the guest keeps its own roots.
    pub trusted_roots_pem: String,
}

/// The first frame of a connection the guest opens to [`HOST_SERVICE_PORT`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServiceRequest {
    /// A connection to the egress proxy (HTTP proxy protocol follows).
    Egress,
    /// A connection to the host's 127.0.0.1 at this port.
    Loopback { port: u16 },
}

/// The host's answer to a [`ServiceRequest`]: one byte, before the service's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ServiceAnswer {
    /// The service is connected: its bytes follow.
    Connected = 0,
    /// Refused: the host port is not relayed, nothing on the host accepted the
    /// connection, or not in time.
    Refused = 1,
    /// Refused: the guest holds as many connections to the host services as the host
    /// allows.
    Busy = 2,
}

impl ServiceAnswer {
    pub fn from_byte(byte: u8) -> Option<ServiceAnswer> {
        [
            ServiceAnswer::Connected,
            ServiceAnswer::Refused,
            ServiceAnswer::Busy,
        ]
        .into_iter()
        .find(|answer| *answer as u8 == byte)
    }
}

/// The agent's state, in answer to [`ClientMessage::Health`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthInfo {
    pub agent_version: String,
    /// Guest uptime (from `/proc/uptime`), in milliseconds.
    pub uptime_ms: u64,
    /// Time since the agent started, in milliseconds.
    pub agent_uptime_ms: u64,
    /// Resident set size of the agent process, in bytes.
    pub agent_rss_bytes: u64,
    /// Commands currently running through `Exec`.
    pub active_execs: u32,
    /// `MemTotal` and `MemAvailable` of `/proc/meminfo`, in KiB (0 if unknown).
    pub mem_total_kib: u64,
    pub mem_available_kib: u64,
}

/// One listening TCP socket of the guest.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ListeningPort {
    pub port: u16,
    /// The bound address (`0.0.0.0`/`::` for all interfaces, `127.0.0.1`/`::1` for loopback).
    pub address: IpAddr,
    /// Whether the socket came from `/proc/net/tcp6` (an IPv6 socket, which may
    /// also accept IPv4 when bound to `::`).
    pub ipv6: bool,
}

/// Agent → host messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentMessage {
    HelloOk {
        agent_version: String,
        protocol_version: u32,
    },
    /// The request failed or the connection misbehaved; the agent closes the connection.
    Error {
        message: String,
    },
    Healthy(HealthInfo),
    Ports(Vec<ListeningPort>),
    /// Acknowledges `Shutdown` (the VM powers off right after).
    Ok,
    /// The command runs as this pid (in the guest).
    Started {
        pid: u32,
    },
    Stdout(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Never sent with a tty (the terminal merges both streams into `Stdout`).
    Stderr(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The command ended: `code` if it exited, `signal` if a signal killed it. The
    /// agent closes the connection after this message.
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// Answers `ConfigureNetwork`: the relay ports that could not be set up, with why.
    NetworkConfigured {
        failed_relays: Vec<(u16, String)>,
    },
    /// Answers `ConnectPort`: raw bytes follow.
    Connected,
    /// Answers `Exec` whose program could not be run (not found, not executable):
    /// the shell's words for it, and the shell's exit code (127 or 126). The agent
    /// closes the connection after this message.
    NotStarted {
        message: String,
        exit_code: u8,
    },
    /// Answers each `HostEdits` batch.
    EditsShown(EditsShown),
    /// The command took this many bytes of stdin (or they were dropped, its stdin
    /// being closed): the host may send that many more ([`STDIN_WINDOW`]).
    StdinTaken(u32),
}

/// Encodes `msg` as a complete frame (length prefix + payload).
pub fn encode_frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    let mut out = vec![0u8; 4];
    out = postcard::to_extend(msg, out).map_err(ProtocolError::Encode)?;
    let len = out.len() - 4;
    if len > MAX_FRAME_SIZE {
        return Err(ProtocolError::FrameTooLarge(len));
    }
    out[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(out)
}

/// Decodes one payload (without its length prefix). Trailing bytes are an error.
pub fn decode_payload<T: DeserializeOwned>(payload: &[u8]) -> Result<T, ProtocolError> {
    let (msg, rest) = postcard::take_from_bytes(payload).map_err(ProtocolError::Decode)?;
    if !rest.is_empty() {
        return Err(ProtocolError::Decode(
            postcard::Error::DeserializeBadEncoding,
        ));
    }
    Ok(msg)
}

/// Reads the payload length of a frame header, refusing oversized frames.
fn frame_len(header: [u8; 4]) -> Result<usize, ProtocolError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_FRAME_SIZE {
        return Err(ProtocolError::FrameTooLarge(len));
    }
    Ok(len)
}

/// Decodes the first frame of `buf`: `Ok(None)` if `buf` does not hold a whole frame
/// yet, else the message and the number of bytes it used.
pub fn decode_frame<T: DeserializeOwned>(buf: &[u8]) -> Result<Option<(T, usize)>, ProtocolError> {
    let Some(header) = buf.get(..4) else {
        return Ok(None);
    };
    let mut h = [0u8; 4];
    h.copy_from_slice(header);
    let len = frame_len(h)?;
    let Some(payload) = buf.get(4..4 + len) else {
        return Ok(None);
    };
    Ok(Some((decode_payload(payload)?, 4 + len)))
}

/// Writes one frame.
pub async fn write_frame<W, T>(w: &mut W, msg: &T) -> Result<(), ProtocolError>
where
    W: AsyncWrite + Unpin + ?Sized,
    T: Serialize,
{
    let frame = encode_frame(msg)?;
    w.write_all(&frame).await?;
    w.flush().await?;
    Ok(())
}

/// Room added at the end of a buffer for a read: on drop, the buffer is cut back to
/// `keep` bytes (what was there before, and what the read filled).
struct Unread<'a> {
    buf: &'a mut Vec<u8>,
    keep: usize,
}

impl Drop for Unread<'_> {
    fn drop(&mut self) {
        self.buf.truncate(self.keep);
    }
}

/// Reads frames from a byte stream. [`FrameReader::next`] is cancel-safe: bytes
/// already read stay buffered when its future is dropped.
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    buf: Vec<u8>,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            buf: Vec::new(),
        }
    }

    /// Returns the next message, or `Ok(None)` at a clean end of stream.
    pub async fn next<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ProtocolError> {
        loop {
            if let Some((msg, used)) = decode_frame(&self.buf)? {
                self.buf.drain(..used);
                if self.buf.capacity() > 2 * CHUNK_SIZE && self.buf.len() < CHUNK_SIZE {
                    self.buf.shrink_to(CHUNK_SIZE);
                }
                return Ok(Some(msg));
            }
            // Read at most up to the end of the current frame (header checked above),
            // so a peer cannot make us buffer more than one frame.
            let want = if self.buf.len() < 4 {
                4 - self.buf.len()
            } else {
                let mut h = [0u8; 4];
                h.copy_from_slice(&self.buf[..4]);
                4 + frame_len(h)? - self.buf.len()
            };
            let want = want.min(CHUNK_SIZE);
            let start = self.buf.len();
            self.buf.resize(start + want, 0);
            // Should this future be dropped while the read waits (a `select!` that
            // took another branch), the room made for it goes with it: left as zeros,
            // it would be read as the rest of the frame.
            let mut read_into = Unread {
                buf: &mut self.buf,
                keep: start,
            };
            let res = self.inner.read(&mut read_into.buf[start..]).await;
            let n = match res {
                Ok(n) => n,
                Err(e) => return Err(e.into()),
            };
            read_into.keep = start + n;
            drop(read_into);
            if n == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(ProtocolError::TruncatedFrame)
                };
            }
        }
    }

    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    pub fn into_inner(self) -> R {
        self.inner
    }

    /// The reader and the bytes it read past the last returned frame, which belong
    /// to whatever follows the frames (the raw bytes after `ConnectPort`/`Connected`).
    /// [`FrameReader::next`] reads no further than the end of the frame it is
    /// decoding, so after a message this is empty; a partial frame stays in it.
    pub fn into_parts(self) -> (R, Vec<u8>) {
        (self.inner, self.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read given up while it waits for the rest of a frame (its future dropped by
    /// a `select!` that took another branch) loses nothing: the next read still gets
    /// the message whole.
    #[tokio::test]
    async fn a_read_given_up_midway_loses_nothing() {
        use tokio::io::AsyncWriteExt;
        let (mut agent, host) = tokio::io::duplex(1024);
        let mut reader = FrameReader::new(host);
        let frame = encode_frame(&ClientMessage::Stdin(vec![7; 100])).unwrap();
        agent.write_all(&frame[..10]).await.unwrap();
        for _ in 0..3 {
            let waited = tokio::time::timeout(
                std::time::Duration::from_millis(20),
                reader.next::<ClientMessage>(),
            )
            .await;
            assert!(waited.is_err(), "a message from half a frame: {waited:?}");
        }
        agent.write_all(&frame[10..]).await.unwrap();
        let message = reader.next::<ClientMessage>().await.unwrap();
        assert_eq!(message, Some(ClientMessage::Stdin(vec![7; 100])));
    }

    fn samples() -> Vec<ClientMessage> {
        vec![
            ClientMessage::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                client: "t".into(),
                host_time_ns: Some(1_800_000_000_123_456_789),
            }),
            ClientMessage::Exec(ExecRequest {
                argv: vec!["sh".into(), "-c".into(), "echo hi".into()],
                env: vec![("A".into(), "b".into())],
                cwd: Some("/tmp".into()),
                user: User::Named("dev".into()),
                tty: Some(TtyRequest {
                    rows: 24,
                    cols: 80,
                    term: "xterm".into(),
                }),
                umask: Some(0o002),
            }),
            // Bytes that are not UTF-8 (Latin-1 names) where the kernel takes bytes.
            ClientMessage::Exec(ExecRequest {
                argv: vec![b"cat".to_vec(), b"caf\xe9.txt".to_vec(), b"\xff".to_vec()],
                env: vec![
                    ("NAME".into(), b"Jos\xe9".to_vec()),
                    ("EMPTY".into(), Vec::new()),
                ],
                cwd: Some(b"/home/a/d\xe9j\xe0".to_vec()),
                user: User::Default,
                tty: None,
                umask: None,
            }),
            ClientMessage::Health,
            ClientMessage::ListPorts,
            ClientMessage::Shutdown,
            ClientMessage::Stdin(vec![0, 1, 2, 255]),
            ClientMessage::StdinEof,
            ClientMessage::Resize { rows: 1, cols: 2 },
            ClientMessage::Signal(-9),
            ClientMessage::ConfigureNetwork(NetworkConfig {
                ca_cert_pem: "-----BEGIN CERTIFICATE-----".into(),
                env: vec![("HTTPS_PROXY".into(), "http://127.0.0.1:3128".into())],
                relay_ports: vec![5432, 6379],
                trusted_roots_pem: "-----BEGIN CERTIFICATE-----".into(),
            }),
            ClientMessage::ConnectPort(8080),
            ClientMessage::HostEdits(vec![
                HostEdit {
                    path: b"/home/a/src/\xffmain.rs".to_vec(),
                    kind: EditKind::Content,
                },
                HostEdit {
                    path: b"/home/a/src".to_vec(),
                    kind: EditKind::Entries,
                },
            ]),
        ]
    }

    #[test]
    fn round_trip_all_messages() {
        for msg in samples() {
            let frame = encode_frame(&msg).unwrap();
            let (back, used): (ClientMessage, usize) = decode_frame(&frame).unwrap().unwrap();
            assert_eq!(back, msg);
            assert_eq!(used, frame.len());
        }
        let agent = vec![
            AgentMessage::HelloOk {
                agent_version: "1".into(),
                protocol_version: 1,
            },
            AgentMessage::Error {
                message: "x".into(),
            },
            AgentMessage::Ports(vec![ListeningPort {
                port: 80,
                address: "::1".parse().unwrap(),
                ipv6: true,
            }]),
            AgentMessage::Ok,
            AgentMessage::Started { pid: 7 },
            AgentMessage::Stdout(vec![1; 1000]),
            AgentMessage::Stderr(vec![]),
            AgentMessage::Exited {
                code: Some(3),
                signal: None,
            },
            AgentMessage::NetworkConfigured {
                failed_relays: vec![(80, "in use".into())],
            },
            AgentMessage::Connected,
            AgentMessage::NotStarted {
                message: "x: command not found".into(),
                exit_code: 127,
            },
            AgentMessage::EditsShown(EditsShown {
                shown: 3,
                guest_own: 2,
                failed: 1,
            }),
        ];
        for msg in agent {
            let frame = encode_frame(&msg).unwrap();
            let (back, _): (AgentMessage, usize) = decode_frame(&frame).unwrap().unwrap();
            assert_eq!(back, msg);
        }
        for msg in [
            ServiceRequest::Egress,
            ServiceRequest::Loopback { port: 22 },
        ] {
            let frame = encode_frame(&msg).unwrap();
            let (back, _): (ServiceRequest, usize) = decode_frame(&frame).unwrap().unwrap();
            assert_eq!(back, msg);
        }
    }

    /// The answer bytes are the wire format (PROTOCOL.md): they must not move.
    #[test]
    fn service_answers_are_the_documented_bytes() {
        assert_eq!(ServiceAnswer::from_byte(0), Some(ServiceAnswer::Connected));
        assert_eq!(ServiceAnswer::from_byte(1), Some(ServiceAnswer::Refused));
        assert_eq!(ServiceAnswer::from_byte(2), Some(ServiceAnswer::Busy));
        assert_eq!(ServiceAnswer::from_byte(3), None);
        assert_eq!(ServiceAnswer::from_byte(b'H'), None);
    }

    /// The messages that ask an agent of any protocol since
    /// `client::OLDEST_WITH_STABLE_MESSAGES` for its health or to shut down: their
    /// bytes must never move (PROTOCOL.md, "Messages every version keeps").
    #[test]
    fn the_stable_messages_are_the_documented_bytes() {
        let hello = ClientMessage::Hello(Hello {
            protocol_version: 11,
            client: "v".into(),
            host_time_ns: Some(1),
        });
        assert_eq!(
            postcard::to_allocvec(&hello).unwrap(),
            [0, 11, 1, b'v', 1, 1]
        );
        assert_eq!(postcard::to_allocvec(&ClientMessage::Health).unwrap(), [2]);
        assert_eq!(
            postcard::to_allocvec(&ClientMessage::Shutdown).unwrap(),
            [4]
        );
        let hello_ok = AgentMessage::HelloOk {
            agent_version: "a".into(),
            protocol_version: 11,
        };
        assert_eq!(postcard::to_allocvec(&hello_ok).unwrap(), [0, 1, b'a', 11]);
        let error = AgentMessage::Error {
            message: "e".into(),
        };
        assert_eq!(postcard::to_allocvec(&error).unwrap(), [1, 1, b'e']);
        let healthy = AgentMessage::Healthy(HealthInfo {
            agent_version: "a".into(),
            uptime_ms: 1,
            agent_uptime_ms: 2,
            agent_rss_bytes: 3,
            active_execs: 4,
            mem_total_kib: 5,
            mem_available_kib: 6,
        });
        assert_eq!(
            postcard::to_allocvec(&healthy).unwrap(),
            [2, 1, b'a', 1, 2, 3, 4, 5, 6]
        );
        assert_eq!(postcard::to_allocvec(&AgentMessage::Ok).unwrap(), [4]);
    }

    #[test]
    fn the_version_an_agent_speaks_is_read_from_its_refusal() {
        let said = format!("{UNSUPPORTED_VERSION} 12 (this agent 0.1.0 speaks 11)");
        assert_eq!(version_spoken_in(&said), Some(11));
        assert_eq!(version_spoken_in("unsupported protocol version 12"), None);
        assert_eq!(version_spoken_in("speaks many)"), None);
    }

    #[tokio::test]
    async fn into_parts_keeps_what_follows_the_frames() {
        let mut bytes = encode_frame(&ClientMessage::ConnectPort(1)).unwrap();
        bytes.extend_from_slice(b"raw");
        let mut r = FrameReader::new(&bytes[..]);
        assert_eq!(
            r.next::<ClientMessage>().await.unwrap(),
            Some(ClientMessage::ConnectPort(1))
        );
        // The reader stopped at the frame's end: the raw bytes are still unread.
        let (mut rest, buffered) = r.into_parts();
        assert!(buffered.is_empty());
        let mut raw = Vec::new();
        rest.read_to_end(&mut raw).await.unwrap();
        assert_eq!(raw, b"raw");
        // A partial frame stays in the buffer.
        let frame = encode_frame(&ClientMessage::Health).unwrap();
        let mut r = FrameReader::new(&frame[..frame.len() - 1]);
        assert!(r.next::<ClientMessage>().await.is_err());
        assert_eq!(r.into_parts().1, &frame[..frame.len() - 1]);
    }

    #[test]
    fn bytes_are_compact() {
        // serde_bytes: a 1000-byte payload costs 1000 bytes + varint length + tag.
        let frame = encode_frame(&AgentMessage::Stdout(vec![7; 1000])).unwrap();
        assert!(frame.len() <= 4 + 1 + 2 + 1000, "{}", frame.len());
    }

    /// An `Exec` whose arguments, environment value and working directory are not
    /// UTF-8 (Latin-1 names) decodes from the bytes a host sends for it and encodes
    /// back to them: each a byte string, its length then its bytes (which is also how
    /// a `String` goes, so UTF-8 ones are as they always were on the wire).
    #[test]
    fn an_exec_carries_arguments_environment_and_cwd_that_are_not_utf8() {
        let mut payload = vec![1]; // ClientMessage::Exec
        payload.extend(b"\x03\x06printf\x02%s\x04caf\xe9"); // argv
        payload.extend(b"\x01\x04NAME\x04Jos\xe9"); // env
        payload.extend(b"\x01\x09/tmp/d\xe9j\xe0"); // cwd: Some
        payload.extend([0, 0]); // user: Default; tty: None
        payload.extend([1, 0x12]); // umask: Some(0o022)
        let message: ClientMessage = decode_payload(&payload)
            .expect("an Exec with bytes that are not UTF-8 does not decode");
        assert_eq!(postcard::to_allocvec(&message).unwrap(), payload);
        let frame = encode_frame(&message).unwrap();
        assert_eq!(decode_frame(&frame).unwrap(), Some((message, frame.len())));
    }

    #[test]
    fn short_input_is_incomplete() {
        let frame = encode_frame(&ClientMessage::Health).unwrap();
        for cut in 0..frame.len() {
            assert!(decode_frame::<ClientMessage>(&frame[..cut])
                .unwrap()
                .is_none());
        }
    }

    #[test]
    fn oversize_length_is_refused() {
        let mut buf = ((MAX_FRAME_SIZE + 1) as u32).to_le_bytes().to_vec();
        buf.extend_from_slice(&[0; 16]);
        assert!(matches!(
            decode_frame::<ClientMessage>(&buf),
            Err(ProtocolError::FrameTooLarge(_))
        ));
        let huge = AgentMessage::Stdout(vec![0; MAX_FRAME_SIZE + 1]);
        assert!(matches!(
            encode_frame(&huge),
            Err(ProtocolError::FrameTooLarge(_))
        ));
    }

    #[test]
    fn garbage_payload_is_an_error() {
        let mut buf = 3u32.to_le_bytes().to_vec();
        buf.extend_from_slice(&[0xff, 0xff, 0xff]);
        assert!(matches!(
            decode_frame::<ClientMessage>(&buf),
            Err(ProtocolError::Decode(_))
        ));
        // Trailing bytes inside a frame are refused too.
        let mut buf = 2u32.to_le_bytes().to_vec();
        buf.extend_from_slice(&[2, 0]); // Health + junk
        assert!(decode_frame::<ClientMessage>(&buf).is_err());
    }

    /// xorshift64*: std-only pseudo-random bytes.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    #[test]
    fn random_input_never_panics() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let valid: Vec<Vec<u8>> = samples().iter().map(|m| encode_frame(m).unwrap()).collect();
        for i in 0..200_000 {
            let mut buf = if i % 2 == 0 {
                let len = (rng.next() % 64) as usize;
                let mut b: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                if b.len() >= 4 && i % 4 == 0 {
                    // Plausible length prefix so the payload decoder gets exercised.
                    let l = (b.len() - 4) as u32;
                    b[..4].copy_from_slice(&l.to_le_bytes());
                }
                b
            } else {
                // Mutate a valid frame.
                let mut b = valid[(rng.next() % valid.len() as u64) as usize].clone();
                for _ in 0..(1 + rng.next() % 3) {
                    let at = (rng.next() % b.len() as u64) as usize;
                    b[at] = rng.next() as u8;
                }
                b
            };
            let _ = decode_frame::<ClientMessage>(&buf);
            let _ = decode_frame::<AgentMessage>(&buf);
            buf.truncate(buf.len() / 2);
            let _ = decode_frame::<ClientMessage>(&buf);
        }
    }

    #[tokio::test]
    async fn frame_reader_handles_split_reads_and_eof() {
        let mut bytes = Vec::new();
        for m in samples() {
            bytes.extend(encode_frame(&m).unwrap());
        }
        let (mut a, b) = tokio::io::duplex(7);
        let writer = tokio::spawn(async move {
            for chunk in bytes.chunks(5) {
                a.write_all(chunk).await.unwrap();
            }
        });
        let mut r = FrameReader::new(b);
        let mut got = Vec::new();
        while let Some(m) = r.next::<ClientMessage>().await.unwrap() {
            got.push(m);
        }
        writer.await.unwrap();
        assert_eq!(got, samples());
    }

    #[tokio::test]
    async fn frame_reader_reports_truncation() {
        let frame = encode_frame(&ClientMessage::Stdin(vec![1; 100])).unwrap();
        let mut r = FrameReader::new(&frame[..50]);
        assert!(matches!(
            r.next::<ClientMessage>().await,
            Err(ProtocolError::TruncatedFrame)
        ));
    }
}
