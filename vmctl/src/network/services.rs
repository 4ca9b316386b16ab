//! The supervisor's network side: it serves the connections the guest opens to
//! [`HOST_SERVICE_PORT`] (the egress proxy, loopback relays), the control socket,
//! and the published ports, on a runtime of its own beside the VMM.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use guest_agent::network::files::MAX_ROOTS_SIZE;
use guest_agent::protocol::{
    decode_payload, NetworkConfig, ServiceAnswer, ServiceRequest, HOST_SERVICE_PORT,
    SERVICE_ANSWER_TIMEOUT,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::control::{ControlRequest, ControlResponse, MAX_LINE};
use super::guest_setup::{guest_env, EgressFiles};
use super::published::Published;
use crate::state::{VmDir, VmRecord};

/// How long the guest may take to name the service it wants.
const PREAMBLE_TIMEOUT: Duration = Duration::from_secs(10);
/// A service request is a few bytes; anything longer is garbage.
const MAX_PREAMBLE: usize = 256;
/// How long each connect to a host loopback port may take, IPv4 then IPv6: a wedged
/// server whose accept queue is full would otherwise hold the guest's client, and a
/// relay slot, through minutes of SYN retries. Both fit in the agent's wait for the
/// answer.
const HOST_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const _: () = assert!(HOST_CONNECT_TIMEOUT.as_secs() * 2 < SERVICE_ANSWER_TIMEOUT.as_secs());

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("no config directory for the egress policy and secrets (set HOME or VMCTL_CONFIG)")]
    NoConfigDir,
    #[error("the sandbox's egress CA in {}: {source}", .path.display())]
    Ca {
        path: PathBuf,
        source: egress::ca::CaError,
    },
    #[error("the egress proxy's upstream trust roots: {0}")]
    TrustRoots(egress::proxy::ProxyError),
    #[error("cannot listen on {}: {source}", .path.display())]
    Listen {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the network runtime: {0}")]
    Runtime(std::io::Error),
}

/// The most connections the guest holds to the host services at once, the egress
/// proxy's and the loopback relays' together: a relay lasts until both sides end,
/// and a host server that never closes its side would otherwise let the guest hold
/// connections (and descriptors) on the host without bound. Below the most the VMM
/// lets the guest open, so that the supervisor refuses first, and says why.
pub const MAX_GUEST_SERVICE_CONNECTIONS: usize = 768;
const _: () = assert!(
    MAX_GUEST_SERVICE_CONNECTIONS < vmm::devices::virtio::vsock::muxer::MAX_GUEST_CONNECTIONS
);

/// The egress proxy's bounds here, which keep the connections it holds open (its
/// requests, those waiting for a request head, those displaced in their grace) under
/// [`MAX_GUEST_SERVICE_CONNECTIONS`] with [`ROOM_FOR_RELAYS`] to spare. Under egress's
/// own defaults (512 requests, 512 waiting, 64 in grace) idle kept-alive connections
/// filled that bound before the proxy closed any to make room, and the guest's next
/// connection, a real request, was refused there instead of served.
///
/// Requests get the most: a tunnel (HTTPS without a secret, most of the guest's
/// traffic) is one request for as long as it is open, idle or not. Waiting ones are
/// idle plain HTTP and TLS terminated for a secret's host between requests, and
/// connections before their first request; past the bound the longest waiting is
/// closed, so fewer do.
const EGRESS_REQUEST_SLOTS: usize = 416;
const EGRESS_WAITING_CONNECTIONS: usize = 192;
const EGRESS_DISPLACED_IN_GRACE: usize = 32;
/// What the egress proxy leaves of [`MAX_GUEST_SERVICE_CONNECTIONS`]: for the
/// loopback relays (Paseo's MCP server, the relay ports), and for the moments a
/// connection holds a slot without the proxy counting it (while it names its
/// service, while the proxy answers it 503).
const ROOM_FOR_RELAYS: usize = 128;
const _: () = assert!(
    EGRESS_REQUEST_SLOTS + EGRESS_WAITING_CONNECTIONS + EGRESS_DISPLACED_IN_GRACE + ROOM_FOR_RELAYS
        <= MAX_GUEST_SERVICE_CONNECTIONS
);

/// The egress proxy's limits in the supervisor ([`EGRESS_REQUEST_SLOTS`]), egress's
/// defaults for the rest.
fn egress_limits() -> egress::proxy::Limits {
    egress::proxy::Limits {
        max_connections: EGRESS_REQUEST_SLOTS,
        max_waiting_connections: EGRESS_WAITING_CONNECTIONS,
        max_displaced_in_grace: EGRESS_DISPLACED_IN_GRACE,
        ..egress::proxy::Limits::default()
    }
}

/// The guest's connections to the host services: their slots
/// ([`MAX_GUEST_SERVICE_CONNECTIONS`]), how many were refused for want of one, and
/// when the last was (Unix time, seconds; 0: none was).
struct GuestSlots {
    slots: Arc<tokio::sync::Semaphore>,
    refused: AtomicU64,
    last_refused_unix_s: AtomicU64,
}

impl GuestSlots {
    fn new(limit: usize) -> GuestSlots {
        GuestSlots {
            slots: Arc::new(tokio::sync::Semaphore::new(limit)),
            refused: AtomicU64::new(0),
            last_refused_unix_s: AtomicU64::new(0),
        }
    }

    /// Counts a connection refused for want of a slot, now.
    fn count_refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        self.last_refused_unix_s.store(now, Ordering::Relaxed);
    }

    /// When the last connection was refused for want of a slot, if one was.
    fn last_refused(&self) -> Option<u64> {
        Some(self.last_refused_unix_s.load(Ordering::Relaxed)).filter(|&at| at != 0)
    }

    fn take(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.slots.clone().try_acquire_owned().ok()
    }
}

/// The host loopback ports relayed into the VM.
#[derive(Debug, Default)]
struct Relays {
    /// Ports the guest may reach on the host's loopback.
    allowed: BTreeSet<u16>,
    /// Of those, the ones the guest said it could not relay when last asked (a server
    /// in the VM holds the port, most often): its clients reach that server there,
    /// not the host's. Each is tried again at the next network setup.
    failed: BTreeSet<u16>,
}

impl Relays {
    fn allowing(ports: impl IntoIterator<Item = u16>) -> Relays {
        Relays {
            allowed: ports.into_iter().collect(),
            failed: BTreeSet::new(),
        }
    }
}

/// The state shared by everything the supervisor serves for one VM.
pub struct NetworkService {
    /// The VM's hybrid-vsock socket, through which we reach the guest agent.
    vsock: PathBuf,
    proxy: Arc<egress::proxy::ProxyConfig>,
    ca_pem: String,
    /// What the proxy trusts upstream, for the guest to trust too (PEM).
    trusted_roots_pem: String,
    secrets: PathBuf,
    relays: Mutex<Relays>,
    guest_slots: GuestSlots,
    published: Published,
    /// The setup the guest last took without a failure: sessions ask for it at each
    /// start, and the guest need not redo it when nothing changed. Held across the
    /// call to the guest, so concurrent requests apply one at a time.
    applied: tokio::sync::Mutex<Option<NetworkConfig>>,
}

/// The roots the egress proxy trusts upstream (`pem`, of `count` certificates), for the
/// guest: its TLS through the proxy's tunnels runs end to end, so behind a
/// TLS-inspecting company proxy it must trust that proxy's CA as the host does. Too
/// many to send: none, with a warning (the guest keeps its image's roots).
fn guest_roots(pem: String, count: usize) -> String {
    if pem.len() > MAX_ROOTS_SIZE {
        tracing::warn!(
            "the host trusts {} certificates ({} bytes of PEM, more than the {MAX_ROOTS_SIZE} \
             the guest takes): the guest keeps its own roots only",
            count,
            pem.len()
        );
        return String::new();
    }
    pem
}

/// Starts serving the VM's network on a thread of its own; it runs until the
/// process ends.
pub fn start(vm: &VmDir, record: &VmRecord) -> Result<(), NetworkError> {
    let files = EgressFiles::locate().ok_or(NetworkError::NoConfigDir)?;
    let ca_dir = vm.egress_ca_dir();
    let name = crate::state::vm_name(&record.workspace);
    let ca =
        egress::ca::CertificateAuthority::load_or_create(&ca_dir, &name).map_err(|source| {
            NetworkError::Ca {
                path: ca_dir.clone(),
                source,
            }
        })?;
    if let Some(soon) = ca.expires_soon() {
        // The supervisor's stderr is its log, whose `vmctl: warning:` lines `vmctl up`
        // shows (a tracing line it does not pick out). The only time it is said: egress
        // leaves it to us.
        vmm::to_stderr!("vmctl: warning: {soon}");
    }
    let extra_ca = record.egress.extra_ca.as_deref();
    let roots = egress::proxy::upstream_roots(extra_ca).map_err(NetworkError::TrustRoots)?;
    let trusted_roots_pem = guest_roots(egress::proxy::to_pem(&roots), roots.len());
    let upstream_tls =
        egress::proxy::tls_config_trusting(roots).map_err(NetworkError::TrustRoots)?;
    let rules = egress::file_rules::FileRules::new(
        files.policy.clone(),
        files.secrets.clone(),
        record.workspace.clone(),
    );
    let ca_pem = ca.cert_pem().to_string();
    let mut proxy = egress::proxy::ProxyConfig::new(
        Arc::new(ca),
        Arc::new(rules),
        Arc::new(upstream_tls),
        Arc::new(egress::log::DecisionLog::open(vm.egress_log())),
    )
    .with_probe_records(vm.egress_probes())
    .with_limits(egress_limits());
    for (target, addr) in &record.egress.resolve {
        proxy = proxy.with_resolve_override(target.clone(), *addr);
    }
    let service = Arc::new(NetworkService {
        vsock: vm.vsock_socket(),
        proxy: Arc::new(proxy),
        ca_pem,
        trusted_roots_pem,
        secrets: files.secrets,
        relays: Mutex::new(Relays::allowing(record.relay_ports.iter().copied())),
        guest_slots: GuestSlots::new(MAX_GUEST_SERVICE_CONNECTIONS),
        published: Published::default(),
        applied: tokio::sync::Mutex::new(None),
    });
    let services_path = service_socket(&vm.vsock_socket());
    let control_path = vm.control_socket();
    let services = bind(&services_path)?;
    let control = bind(&control_path)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("vmctl-net")
        .enable_all()
        .build()
        .map_err(NetworkError::Runtime)?;
    std::thread::Builder::new()
        .name("vmctl-net".into())
        .spawn(move || {
            runtime.block_on(async move {
                let (Ok(services), Ok(control)) = (
                    UnixListener::from_std(services),
                    UnixListener::from_std(control),
                ) else {
                    tracing::error!("cannot serve the VM's network sockets");
                    return;
                };
                tokio::spawn(egress::log::keep_counts_current(Arc::downgrade(
                    &service.proxy.log,
                )));
                tokio::spawn(serve_guest_connections(services, service.clone()));
                serve_control(control, service).await;
            })
        })
        .map_err(NetworkError::Runtime)?;
    Ok(())
}

/// Where the VMM connects the guest's connections to host port [`HOST_SERVICE_PORT`].
pub fn service_socket(vsock: &Path) -> PathBuf {
    PathBuf::from(format!("{}_{HOST_SERVICE_PORT}", vsock.display()))
}

fn bind(path: &Path) -> Result<std::os::unix::net::UnixListener, NetworkError> {
    let error = |source| NetworkError::Listen {
        path: path.to_path_buf(),
        source,
    };
    let _ = std::fs::remove_file(path);
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(error)?;
    listener.set_nonblocking(true).map_err(error)?;
    Ok(listener)
}

async fn serve_guest_connections(listener: UnixListener, service: Arc<NetworkService>) {
    loop {
        let stream = super::accept_again_and_again(&listener, "a guest connection").await;
        tokio::spawn(serve_guest_connection(stream, service.clone()));
    }
}

async fn serve_guest_connection(stream: UnixStream, service: Arc<NetworkService>) {
    let proxy = service.proxy.clone();
    serve_guest_request(stream, &service.guest_slots, &service.relays, |stream| {
        egress::proxy::serve_connection(stream, proxy)
    })
    .await
}

/// Serves the request `stream` opens with: the egress proxy (`serve_egress`) or a
/// relay to one of `relays`, while one of `slots` is free.
async fn serve_guest_request<Egress, Served>(
    mut stream: UnixStream,
    slots: &GuestSlots,
    relays: &Mutex<Relays>,
    serve_egress: Egress,
) where
    Egress: FnOnce(UnixStream) -> Served,
    Served: std::future::Future<Output = ()>,
{
    // Taken before the request is read: a connection holds its vsock connection from
    // its start.
    let slot = slots.take();
    let request = match tokio::time::timeout(PREAMBLE_TIMEOUT, read_preamble(&mut stream)).await {
        Ok(Ok(request)) => request,
        Ok(Err(reason)) => {
            guest_log::guest_warn!("a guest connection to the host services: {reason}");
            return;
        }
        Err(_) => {
            guest_log::guest_warn!(
                "a guest connection to the host services never said what it wants"
            );
            return;
        }
    };
    let Some(_slot) = slot else {
        slots.count_refused();
        guest_log::guest_warn!(
            "the guest holds {MAX_GUEST_SERVICE_CONNECTIONS} connections to the host \
             services (egress proxy and relays) already, the most it may; its {} is \
             refused (reset in the VM). A program in the VM may leave its connections \
             open: 'vmctl exec ss -tnp' lists them",
            match request {
                ServiceRequest::Egress => "connection to the egress proxy".to_string(),
                ServiceRequest::Loopback { port } => format!("relay to host port {port}"),
            }
        );
        let _ = answer(&mut stream, ServiceAnswer::Busy).await;
        return;
    };
    match request {
        ServiceRequest::Egress => {
            if answer(&mut stream, ServiceAnswer::Connected).await.is_ok() {
                serve_egress(stream).await;
            }
        }
        ServiceRequest::Loopback { port } => relay_to_host_loopback(stream, port, relays).await,
    }
}

/// Reads the one frame that names the service, and not a byte more: what follows
/// belongs to the service.
async fn read_preamble(stream: &mut UnixStream) -> Result<ServiceRequest, String> {
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .await
        .map_err(|e| format!("reading its request: {e}"))?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_PREAMBLE {
        return Err(format!(
            "its request is {len} bytes long, over {MAX_PREAMBLE}"
        ));
    }
    let mut payload = vec![0u8; len];
    stream
        .read_exact(&mut payload)
        .await
        .map_err(|e| format!("reading its request: {e}"))?;
    decode_payload(&payload).map_err(|e| format!("unreadable request: {e}"))
}

/// Tells the guest's agent what became of its request: after anything but
/// [`ServiceAnswer::Connected`] it resets its client's connection.
async fn answer(stream: &mut UnixStream, answer: ServiceAnswer) -> std::io::Result<()> {
    stream.write_all(&[answer as u8]).await
}

/// Relays `stream` to the host's loopback `port` if it is one of `relays`.
async fn relay_to_host_loopback(mut stream: UnixStream, port: u16, relays: &Mutex<Relays>) {
    let allowed = relays
        .lock()
        .map(|relays| relays.allowed.contains(&port))
        .unwrap_or(false);
    if !allowed {
        guest_log::guest_warn!(
            "the guest asked for host port {port}, which is not relayed; refused"
        );
        let _ = answer(&mut stream, ServiceAnswer::Refused).await;
        return;
    }
    let mut host = match connect_host_loopback(port).await {
        Ok(host) => host,
        Err(e) => {
            // Rate-limited: a guest client that retries at once would flood the log.
            guest_log::guest_warn!(
                "the guest's connection to the host's loopback port {port} is refused: \
                 {e} (is the host's service on that port running?)"
            );
            let _ = answer(&mut stream, ServiceAnswer::Refused).await;
            return;
        }
    };
    if answer(&mut stream, ServiceAnswer::Connected).await.is_err() {
        return;
    }
    let relayed = byte_relay::both_ways(stream, &mut host).await;
    if relayed.broken() == Some(byte_relay::Side::A) {
        // The host's server learns that its client broke off, not that it finished
        // (unless what its client sent is still queued for it). Apart, so that the
        // guest's slot, whose vsock connection is gone, is free meanwhile; but among
        // a few such drains only: a guest breaking off connection after connection
        // to a server that does not read would hold host sockets past its slots.
        pass_on_break_apart(host, &HOST_DRAINS);
    }
}

/// [`byte_relay::pass_on_break`] of `host` on a task of its own if one of `drains` is
/// free, else a reset at once (what was queued for the server is lost with it).
fn pass_on_break_apart(host: tokio::net::TcpStream, drains: &Arc<tokio::sync::Semaphore>) {
    match Arc::clone(drains).try_acquire_owned() {
        Ok(place) => {
            tokio::spawn(async move {
                byte_relay::pass_on_break(host).await;
                drop(place);
            });
        }
        Err(_) => {
            let _ = host.set_zero_linger();
        }
    }
}

/// Host connections at most whose broken-off relays are drained at once (each for up
/// to [`byte_relay::DRAIN_TIMEOUT`]); past them a broken-off relay is reset.
const MAX_HOST_DRAINS: usize = 32;
static HOST_DRAINS: std::sync::LazyLock<Arc<tokio::sync::Semaphore>> =
    std::sync::LazyLock::new(|| Arc::new(tokio::sync::Semaphore::new(MAX_HOST_DRAINS)));

/// Connects to `port` on the host's loopback, IPv4 first, then IPv6: a server bound to
/// `localhost` may listen on `::1` only (Node's, since version 17). Each try has
/// [`HOST_CONNECT_TIMEOUT`].
async fn connect_host_loopback(port: u16) -> std::io::Result<tokio::net::TcpStream> {
    let connect = |address: SocketAddr| async move {
        tokio::time::timeout(
            HOST_CONNECT_TIMEOUT,
            tokio::net::TcpStream::connect(address),
        )
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "{address} did not accept the connection within {} s",
                    HOST_CONNECT_TIMEOUT.as_secs()
                ),
            ))
        })
    };
    match connect(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await {
        Ok(stream) => Ok(stream),
        Err(v4_error) => connect(SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)))
            .await
            .map_err(|_| v4_error),
    }
}

async fn serve_control(listener: UnixListener, service: Arc<NetworkService>) {
    accept_control(listener, crate::vmm_process::running_vmm_pid, |stream| {
        tokio::spawn(serve_control_connection(stream, service.clone()));
    })
    .await
}

/// Hands each control connection to `serve`, except the VM's own VMM's (`vmm_pid`):
/// a guest that took the VMM over must not publish ports on the host's network or
/// relay the host's loopback ports into itself. Its jail keeps the control socket
/// out of its sight; this holds where the jail could not be set up (no user
/// namespaces) too, as its seccomp filter lets it create no other process.
async fn accept_control(
    listener: UnixListener,
    vmm_pid: fn() -> Option<u32>,
    serve: impl Fn(UnixStream),
) {
    loop {
        let stream = super::accept_again_and_again(&listener, "a control connection").await;
        let peer = stream.peer_cred().ok().and_then(|cred| cred.pid());
        match (peer, vmm_pid()) {
            (Some(peer), Some(vmm)) if u32::try_from(peer).ok() == Some(vmm) => {
                tracing::warn!(
                    "refused a control connection from the VM's own VMM (pid {vmm}): the \
                     guest may have taken it over"
                );
                tokio::spawn(refuse_control_connection(stream));
            }
            _ => serve(stream),
        }
    }
}

async fn refuse_control_connection(mut stream: UnixStream) {
    let refusal = ControlResponse::Error {
        message: "the VM's own VMM may not use its supervisor's control socket".into(),
    };
    if let Ok(mut answer) = serde_json::to_vec(&refusal) {
        answer.push(b'\n');
        let _ = stream.write_all(&answer).await;
    }
}

async fn serve_control_connection(stream: UnixStream, service: Arc<NetworkService>) {
    let (reader, mut writer) = stream.into_split();
    let mut line = String::new();
    let read = BufReader::new(reader.take(MAX_LINE as u64))
        .read_line(&mut line)
        .await;
    let response = match read.map(|_| serde_json::from_str::<ControlRequest>(&line)) {
        Ok(Ok(request)) => handle_control(request, &service).await,
        Ok(Err(e)) => ControlResponse::Error {
            message: format!("unreadable control request: {e}"),
        },
        Err(e) => ControlResponse::Error {
            message: format!("reading the control request: {e}"),
        },
    };
    if let Ok(mut answer) = serde_json::to_vec(&response) {
        answer.push(b'\n');
        let _ = writer.write_all(&answer).await;
    }
}

async fn handle_control(request: ControlRequest, service: &Arc<NetworkService>) -> ControlResponse {
    let outcome = match request {
        ControlRequest::Configure { relay_ports } => configure_guest(service, relay_ports).await,
        ControlRequest::Publish {
            guest_port,
            host_port,
            address,
        } => service
            .published
            .publish(
                service.vsock.clone(),
                guest_port,
                SocketAddr::new(address, host_port),
                || not_to_publish(&service.relays, guest_port),
            )
            .await
            .map(ControlResponse::Published),
        ControlRequest::Unpublish { guest_port } => service
            .published
            .unpublish(guest_port)
            .await
            .map(|host| ControlResponse::Unpublished { host }),
        ControlRequest::ListPublished => {
            let (relays, failed_relays) = service
                .relays
                .lock()
                .map(|relays| {
                    (
                        relays.allowed.iter().copied().collect(),
                        relays.failed.iter().copied().collect(),
                    )
                })
                .unwrap_or_default();
            Ok(ControlResponse::PublishedList {
                ports: service.published.list(),
                relays,
                failed_relays,
                refused_at_limit: service.guest_slots.refused.load(Ordering::Relaxed),
                last_refused_at_limit: service.guest_slots.last_refused(),
            })
        }
    };
    outcome.unwrap_or_else(|message| ControlResponse::Error { message })
}

/// Of `extra` relays asked for, those to add, and those refused: published from the
/// VM (`published`) and not relayed already (`relayed`).
fn relays_to_add(
    extra: Vec<u16>,
    published: &BTreeSet<u16>,
    relayed: &BTreeSet<u16>,
) -> (Vec<u16>, Vec<u16>) {
    extra
        .into_iter()
        .partition(|port| !published.contains(port) || relayed.contains(port))
}

/// Adds `extra` to `relays`, but for the ports `published` from the VM: relayed too,
/// the published address would reach the host's own service (see `not_to_publish`,
/// which refuses the other order). Decided with the publications held still, as a
/// publication is made with the relays checked under the same lock, so that neither
/// passes on what the other is about to change. Returns all the relays, and those
/// refused.
fn add_relays(
    published: &Published,
    relays: &Mutex<Relays>,
    extra: Vec<u16>,
) -> Result<(Vec<u16>, Vec<u16>), String> {
    published.while_unchanged(|published| {
        let mut relays = relays
            .lock()
            .map_err(|_| "the relay list is unusable".to_string())?;
        let (extra, refused) = relays_to_add(extra, published, &relays.allowed);
        relays.allowed.extend(extra);
        Ok((relays.allowed.iter().copied().collect(), refused))
    })?
}

/// Records which of `asked` the guest could relay and which it could not (`failed`).
fn record_relays(relays: &Mutex<Relays>, asked: &[u16], failed: &[(u16, String)]) {
    let Ok(mut relays) = relays.lock() else {
        return;
    };
    for port in asked {
        if failed.iter().any(|(failed, _)| failed == port) {
            relays.failed.insert(*port);
        } else {
            relays.failed.remove(port);
        }
    }
}

/// Why `guest_port` must not be published, if it must not: the VM's ports that are
/// the host's own services, whose reach publishing would widen.
fn not_to_publish(relays: &Mutex<Relays>, guest_port: u16) -> Option<String> {
    if guest_port == guest_agent::protocol::EGRESS_PROXY_PORT {
        return Some(format!(
            "port {guest_port} in the VM is vmctl's egress proxy, which adds your secrets to \
             the requests through it: published, it would add them to the requests of \
             whoever reaches it on the host; not published"
        ));
    }
    let (relayed, failed) = match relays.lock() {
        Ok(relays) => (
            relays.allowed.contains(&guest_port),
            relays.failed.contains(&guest_port),
        ),
        // Unknown: refused as relayed, the safe side.
        Err(_) => (true, false),
    };
    if failed {
        return Some(format!(
            "port {guest_port} in the VM is on its list of ports relayed from the host, but \
             the relay failed (a server in the VM holds the port, most likely): once that \
             server lets the port go, the relay is set up again at the next session's start, \
             and the published address would reach the host's own port {guest_port}; not \
             published (to publish the VM's server, take the port off the VM's relay ports, \
             --relay-port or relay_ports in the config, and restart the VM)"
        ));
    }
    relayed.then(|| {
        format!(
            "port {guest_port} in the VM is relayed from the host's own loopback port \
             {guest_port}: published, that host service would be reachable where the host \
             keeps it from; not published (on the host it is at 127.0.0.1:{guest_port})"
        )
    })
}

/// Sends `config` to the guest agent behind `vsock`, giving up after
/// [`crate::exec::AGENT_TIMEOUT`]; the answer is the relays that failed.
async fn apply_in_guest(vsock: &Path, config: NetworkConfig) -> Result<Vec<(u16, String)>, String> {
    crate::exec::call_agent(vsock, |connection| connection.configure_network(config))
        .await
        .map_err(|e| match e {
            crate::exec::AgentCallError::Call(e) => {
                format!("the guest agent refused the network setup: {e}")
            }
            other => other.describe("the guest agent did not apply the network setup"),
        })
}

/// The guest's `failed` relays among those `asked` for, once each: a guest cannot
/// have vmctl warn of other ports, nor make the answer too long for the control
/// socket.
fn only_asked(failed: Vec<(u16, String)>, asked: &[u16]) -> Vec<(u16, String)> {
    let mut seen = std::collections::BTreeSet::new();
    failed
        .into_iter()
        .filter(|(port, _)| asked.contains(port) && seen.insert(*port))
        .collect()
}

/// Tells the guest agent the CA, the variables (with the placeholders of the secrets
/// as they are now) and the relay ports, adding `extra_relays` to them.
async fn configure_guest(
    service: &NetworkService,
    extra_relays: Vec<u16>,
) -> Result<ControlResponse, String> {
    let (relay_ports, refused) = add_relays(&service.published, &service.relays, extra_relays)?;
    let refused = refused.into_iter().map(|port| {
        (
            port,
            format!(
                "port {port} is published from the VM; relayed too, the published address \
                 would reach the host's own port {port} ('vmctl unpublish {port}' first)"
            ),
        )
    });
    let placeholders = match egress::secrets::SecretStore::load(&service.secrets) {
        Ok(store) => store.placeholder_env(),
        Err(e) => {
            tracing::warn!("no placeholder credentials for the guest: {e}");
            Vec::new()
        }
    };
    let config = NetworkConfig {
        ca_cert_pem: service.ca_pem.clone(),
        env: guest_env(placeholders),
        relay_ports: relay_ports.clone(),
        trusted_roots_pem: service.trusted_roots_pem.clone(),
    };
    let mut applied = service.applied.lock().await;
    if applied.as_ref() == Some(&config) {
        return Ok(ControlResponse::Configured {
            relay_ports,
            failed_relays: refused.collect(),
        });
    }
    // Bounded: the lock held meanwhile keeps every other session's setup waiting.
    let failed_relays = only_asked(
        apply_in_guest(&service.vsock, config.clone()).await?,
        &relay_ports,
    );
    record_relays(&service.relays, &relay_ports, &failed_relays);
    // A failed relay is tried again next time.
    *applied = failed_relays.is_empty().then_some(config);
    Ok(ControlResponse::Configured {
        relay_ports,
        failed_relays: failed_relays.into_iter().chain(refused).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_relays_asked_for_are_reported_failed_once_each() {
        let failed = vec![
            (3000, "in use".to_string()),
            (22, "made up by the guest".to_string()),
            (3000, "again".to_string()),
            (6767, "refused".to_string()),
        ];
        assert_eq!(
            only_asked(failed, &[6767, 3000]),
            [(3000, "in use".to_string()), (6767, "refused".to_string())]
        );
    }

    /// The egress proxy and the ports relayed from the host's loopback are the host's
    /// services: not published. Others are.
    #[test]
    fn the_hosts_own_services_in_the_vm_are_not_published() {
        let relays = Mutex::new(Relays::allowing([6767]));
        let proxy = guest_agent::protocol::EGRESS_PROXY_PORT;
        assert!(not_to_publish(&relays, proxy).is_some_and(|why| why.contains("egress proxy")));
        assert!(not_to_publish(&relays, 6767).is_some_and(|why| why.contains("127.0.0.1:6767")));
        assert_eq!(not_to_publish(&relays, 8080), None);
    }

    /// A relay the guest could not set up (a server in the VM holds the port) is not
    /// called the host's service when its publication is refused; once the guest
    /// relays the port, it is again.
    #[test]
    fn a_relay_that_failed_is_said_to_have() {
        let relays = Mutex::new(Relays::allowing([5432, 6767]));
        record_relays(
            &relays,
            &[5432, 6767],
            &[(5432, "cannot listen on 127.0.0.1:5432: in use".into())],
        );
        let why = not_to_publish(&relays, 5432).unwrap();
        assert!(
            why.contains("the relay failed") && !why.contains("is relayed from"),
            "{why}"
        );
        assert!(not_to_publish(&relays, 6767).is_some_and(|why| why.contains("is relayed from")));
        record_relays(&relays, &[5432, 6767], &[]);
        assert!(not_to_publish(&relays, 5432).is_some_and(|why| why.contains("is relayed from")));
    }

    /// A port published from the VM is not relayed from the host's loopback later
    /// (the published address would reach the host's service); one relayed already
    /// stays.
    #[test]
    fn a_published_port_is_not_relayed_later() {
        let published = BTreeSet::from([5432, 6767]);
        let relayed = BTreeSet::from([6767]);
        assert_eq!(
            relays_to_add(vec![5432, 6767, 9100], &published, &relayed),
            (vec![6767, 9100], vec![5432])
        );
    }

    /// The relays added while ports are published: those published are refused,
    /// the others added to the ones there were.
    #[tokio::test]
    async fn relays_are_added_but_for_the_published_ports() {
        let published = Published::default();
        let vsock = PathBuf::from("/nonexistent/vsock.sock");
        let any_port: SocketAddr = "127.0.0.1:0".parse().unwrap();
        published
            .publish(vsock, 5432, any_port, || None)
            .await
            .unwrap();
        let relays = Mutex::new(Relays::allowing([6767]));
        assert_eq!(
            add_relays(&published, &relays, vec![5432, 9100]),
            Ok((vec![6767, 9100], vec![5432]))
        );
        assert_eq!(relays.lock().unwrap().allowed.len(), 2);
    }

    /// A server listening on `::1` only (Node's `localhost`) is reached too.
    #[tokio::test]
    async fn a_host_server_on_ipv6_loopback_only_is_reached() {
        let server = tokio::net::TcpListener::bind("[::1]:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        let connected = connect_host_loopback(port).await.unwrap();
        assert_eq!(connected.peer_addr().unwrap(), server.local_addr().unwrap());
        drop(server);
        assert!(connect_host_loopback(port).await.is_err());
    }

    /// A host server that never closes its side keeps each relay to it: the guest
    /// gets no more connections to the host services, relays and the egress proxy's
    /// together, than there are slots; one past them is answered `Busy` and counted,
    /// not made.
    #[tokio::test]
    async fn guest_connections_to_the_host_services_are_bounded() {
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = server.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(conn);
            }
        });
        let relays = Arc::new(Mutex::new(Relays::allowing([port])));
        let slots = Arc::new(GuestSlots::new(1));
        assert_eq!(slots.last_refused(), None);
        let egress_served = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let serve = |request: ServiceRequest| {
            let (relays, slots, egress_served) =
                (relays.clone(), slots.clone(), egress_served.clone());
            let (mut guest_end, host_end) = UnixStream::pair().unwrap();
            let served = tokio::spawn(async move {
                serve_guest_request(host_end, &slots, &relays, |_| async move {
                    egress_served.store(true, std::sync::atomic::Ordering::SeqCst);
                })
                .await
            });
            let preamble = guest_agent::protocol::encode_frame(&request).unwrap();
            async move {
                guest_end.write_all(&preamble).await.unwrap();
                (guest_end, served)
            }
        };
        let (mut first_guest, _held) = serve(ServiceRequest::Loopback { port }).await;
        let mut connected = [0u8; 1];
        first_guest.read_exact(&mut connected).await.unwrap();
        assert_eq!(connected, [ServiceAnswer::Connected as u8]);
        for past_the_bound in [ServiceRequest::Egress, ServiceRequest::Loopback { port }] {
            let (mut guest, served) = serve(past_the_bound).await;
            tokio::time::timeout(Duration::from_secs(5), served)
                .await
                .expect("the connection past the bound was served and held")
                .unwrap();
            assert_eq!(
                answer_and_end(&mut guest).await,
                [ServiceAnswer::Busy as u8],
                "refused as busy"
            );
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(!egress_served.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(slots.refused.load(Ordering::Relaxed), 2);
        // When, for 'vmctl ports' to say (and to stop saying once it is long over).
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let last = slots.last_refused().expect("the refusal's time");
        assert!(now.abs_diff(last) <= 5, "{last} is not now ({now})");
    }

    /// The connections the egress proxy holds open at the most (requests, waiting
    /// ones, displaced ones in their grace) leave room under the guest's bound for
    /// the relays: idle connections to the proxy must not use up that bound before
    /// the proxy closes one of them for a real request.
    #[test]
    fn the_egress_proxy_leaves_room_for_the_relays_under_the_guests_bound() {
        let limits = egress_limits();
        let held_by_the_proxy =
            limits.max_connections + limits.max_waiting_connections + limits.max_displaced_in_grace;
        assert!(
            held_by_the_proxy + ROOM_FOR_RELAYS <= MAX_GUEST_SERVICE_CONNECTIONS,
            "the egress proxy may hold {held_by_the_proxy} of the guest's \
             {MAX_GUEST_SERVICE_CONNECTIONS} connections to the host services"
        );
    }

    /// All the guest's end of a relay gets before the relay closes it.
    async fn answer_and_end(guest: &mut UnixStream) -> Vec<u8> {
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), guest.read_to_end(&mut got))
            .await
            .expect("the relay neither answered nor closed")
            .unwrap();
        got
    }

    /// A loopback port nothing listens on, and a port not relayed, are answered
    /// `Refused` (the agent then resets its client), not closed without a word.
    #[tokio::test]
    async fn a_relay_that_cannot_connect_is_answered_refused() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed_port = closed.local_addr().unwrap().port();
        drop(closed);
        let relays = Mutex::new(Relays::allowing([closed_port]));
        for port in [closed_port, closed_port.wrapping_add(1).max(1)] {
            let (mut guest, relay_end) = UnixStream::pair().unwrap();
            relay_to_host_loopback(relay_end, port, &relays).await;
            assert_eq!(
                answer_and_end(&mut guest).await,
                [ServiceAnswer::Refused as u8],
                "port {port}"
            );
        }
    }

    /// A relay that connects answers `Connected`, then carries the bytes.
    #[tokio::test]
    async fn a_relay_answers_connected_then_carries_the_bytes() {
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = server.local_addr().unwrap().port();
        let relays = Arc::new(Mutex::new(Relays::allowing([port])));
        let (mut guest, relay_end) = UnixStream::pair().unwrap();
        tokio::spawn(async move { relay_to_host_loopback(relay_end, port, &relays).await });
        let (mut host, _) = server.accept().await.unwrap();
        host.write_all(b"hello").await.unwrap();
        drop(host);
        assert_eq!(answer_and_end(&mut guest).await, b"\0hello");
    }

    /// A relay broken off while its writes are queued for a host server that does not
    /// read is drained apart (the server gets what was queued, then an end) while a
    /// drain's place is free, and reset at once when none is.
    #[tokio::test]
    async fn broken_off_relays_are_drained_apart_within_their_places() {
        for places in [1, 0] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.set_recv_buffer_size(4096).unwrap();
            let mut server = socket
                .connect(listener.local_addr().unwrap())
                .await
                .unwrap();
            let (relay_side, _) = listener.accept().await.unwrap();
            let mut written = 0;
            loop {
                match relay_side.try_write(&[7u8; 64 * 1024]) {
                    Ok(n) => written += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => panic!("{e}"),
                }
            }
            let drains = Arc::new(tokio::sync::Semaphore::new(places));
            pass_on_break_apart(relay_side, &drains);
            let mut received = Vec::new();
            let read =
                tokio::time::timeout(Duration::from_secs(5), server.read_to_end(&mut received))
                    .await
                    .expect("the server's read did not end");
            if places == 1 {
                assert!(read.is_ok(), "{read:?}");
                assert_eq!(received.len(), written, "drained apart");
            } else {
                let error = read.expect_err("a reset was expected");
                assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset);
            }
        }
    }

    /// A host server whose accept queue is full never completes a connect: the relay
    /// gives up within its bound instead of holding the guest's client for minutes.
    #[tokio::test(start_paused = true)]
    async fn a_host_port_that_never_accepts_is_given_up_on() {
        let wedged = tokio::net::TcpSocket::new_v4().unwrap();
        wedged
            .bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
            .unwrap();
        // The accept queue of a backlog of 0 holds one connection; this one, never
        // accepted, fills it, and the SYNs of the next connect go unanswered.
        let wedged = wedged.listen(0).unwrap();
        let address = wedged.local_addr().unwrap();
        let _queued = tokio::net::TcpStream::connect(address).await.unwrap();
        let started = tokio::time::Instant::now();
        let error = tokio::time::timeout(
            HOST_CONNECT_TIMEOUT * 3,
            connect_host_loopback(address.port()),
        )
        .await
        .expect("still connecting after twice the bound")
        .unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut, "{error}");
        assert!(started.elapsed() >= HOST_CONNECT_TIMEOUT, "{error}");
    }

    fn this_process() -> Option<u32> {
        Some(std::process::id())
    }

    fn no_vmm() -> Option<u32> {
        None
    }

    /// What a control client connecting to `accept_control` gets back: the line it
    /// is answered, and whether the connection was handed on to be served.
    async fn connect_to_control(vmm_pid: fn() -> Option<u32>) -> (String, bool) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (served_tx, mut served_rx) = tokio::sync::mpsc::unbounded_channel();
        let server = tokio::spawn(accept_control(listener, vmm_pid, move |stream| {
            let _ = served_tx.send(stream);
        }));
        let mut client = UnixStream::connect(&path).await.unwrap();
        let mut answer = String::new();
        let read = tokio::time::timeout(Duration::from_secs(5), client.read_to_string(&mut answer));
        let served = tokio::select! {
            _ = read => false,
            stream = served_rx.recv() => stream.is_some(),
        };
        server.abort();
        (answer, served)
    }

    #[tokio::test]
    async fn the_vms_own_vmm_is_refused_the_control_socket() {
        let (answer, served) = connect_to_control(this_process).await;
        assert!(!served, "the VMM's connection was served");
        let response: ControlResponse = serde_json::from_str(answer.trim()).unwrap();
        assert!(
            matches!(&response, ControlResponse::Error { message } if message.contains("VMM")),
            "{answer}"
        );

        let (answer, served) = connect_to_control(no_vmm).await;
        assert!(served, "a client was refused: {answer}");
    }

    /// A guest agent that accepts but never answers must not hold the setup's lock,
    /// and with it every other session's start, forever.
    #[tokio::test(start_paused = true)]
    async fn an_agent_that_never_answers_the_setup_is_given_up_on() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vsock.sock");
        let _silent = tokio::net::UnixListener::bind(&socket).unwrap();
        let config = NetworkConfig {
            ca_cert_pem: String::new(),
            env: Vec::new(),
            relay_ports: vec![6767],
            trusted_roots_pem: String::new(),
        };
        let error = tokio::time::timeout(
            crate::exec::AGENT_TIMEOUT * 2,
            apply_in_guest(&socket, config),
        )
        .await
        .expect("still waiting for the agent after twice the bound")
        .unwrap_err();
        assert!(
            error.contains("within 60 s") && error.contains("vmctl stop"),
            "{error}"
        );
    }
}
