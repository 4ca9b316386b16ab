//! The VM's network side. The VM has no network device: the agent gives commands a
//! way out through the host, and the host a way in.
//!
//! - `ConfigureNetwork` installs the egress CA and environment ([`files`]), starts
//!   the egress proxy listener (127.0.0.1:[`EGRESS_PROXY_PORT`]) and relays of guest
//!   loopback ports to the host's loopback ([`relay`]);
//! - `ConnectPort` joins a host connection to a guest loopback port (`vmctl publish`).

pub mod files;
pub mod relay;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use tracing::info;

pub use files::{FileError, NetworkPaths};
pub use relay::{HostConnector, Relay, RelayError};

use crate::protocol::{NetworkConfig, ServiceRequest, EGRESS_PROXY_PORT};

/// Errors of `ConfigureNetwork`.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("{0}")]
    File(#[from] FileError),
    #[error("cannot listen on 127.0.0.1:{port} for the egress proxy: {source}")]
    Egress { port: u16, source: std::io::Error },
    #[error("network configuration needs a tokio runtime")]
    NoRuntime,
}

/// Where the network setup writes and connects; [`Default`] is the VM's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkSettings {
    pub paths: NetworkPaths,
    pub host: HostConnector,
    /// The egress proxy's port on 127.0.0.1; 0 picks a free one (tests), see
    /// [`Network::egress_addr`].
    pub egress_port: u16,
}

impl Default for NetworkSettings {
    fn default() -> Self {
        Self {
            paths: NetworkPaths::default(),
            host: HostConnector::default(),
            egress_port: EGRESS_PROXY_PORT,
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    /// Variables every command gets (validated).
    env: Vec<(String, String)>,
    egress: Option<Relay>,
    relays: BTreeMap<u16, Relay>,
}

/// The network state of a running agent. Listeners live as long as it does.
#[derive(Debug)]
pub struct Network {
    paths: NetworkPaths,
    egress_port: u16,
    host: Arc<HostConnector>,
    inner: Mutex<Inner>,
}

impl Default for Network {
    fn default() -> Self {
        Self::new(NetworkSettings::default())
    }
}

impl Network {
    pub fn new(settings: NetworkSettings) -> Self {
        Self {
            paths: settings.paths,
            egress_port: settings.egress_port,
            host: Arc::new(settings.host),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The state stays consistent across a panic (plain assignments), so a
        // poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The variables every command gets (under its own `env`).
    pub fn env(&self) -> Vec<(String, String)> {
        self.lock().env.clone()
    }

    /// Where the egress proxy listens (IPv4), once configured.
    pub fn egress_addr(&self) -> Option<SocketAddr> {
        self.lock().egress.as_ref().map(Relay::addr)
    }

    /// The guest ports relayed to the host.
    pub fn relayed_ports(&self) -> Vec<u16> {
        self.lock().relays.keys().copied().collect()
    }

    /// Applies `config` (see `ConfigureNetwork` in PROTOCOL.md): an empty CA or env
    /// leaves the current one; relays only get added. Returns the relay ports that
    /// could not be set up, with why. Must run in a tokio runtime (it spawns the
    /// listeners' tasks).
    pub fn configure(&self, config: &NetworkConfig) -> Result<Vec<(u16, String)>, NetworkError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(NetworkError::NoRuntime);
        }
        // Validate everything before changing anything.
        let ca = match config.ca_cert_pem.trim() {
            "" => None,
            pem => Some(files::validate_ca(pem)?),
        };
        let roots = match config.trusted_roots_pem.trim() {
            "" => None,
            pem => Some(files::validate_roots(pem)?),
        };
        let env = match config.env.is_empty() {
            true => None,
            false => Some(files::validate_env(&config.env)?),
        };

        // One configuration at a time: the files and listeners are shared.
        let mut inner = self.lock();
        if inner.egress.is_none() {
            let relay = relay::start(self.egress_port, ServiceRequest::Egress, self.host.clone())
                .map_err(|source| NetworkError::Egress {
                port: self.egress_port,
                source,
            })?;
            info!(addr = %relay.addr(), "egress proxy listening");
            inner.egress = Some(relay);
        }
        if let Some(pem) = &ca {
            files::install_ca(&self.paths, pem)?;
            files::install_node_preload(&self.paths)?;
        }
        if let Some(pem) = &roots {
            files::install_roots(&self.paths, pem)?;
        }
        if let Some(env) = env {
            files::write_environment(&self.paths, &env)?;
            inner.env = env;
        }
        let egress_port = inner.egress.as_ref().map(|r| r.addr().port());
        let mut failed = Vec::new();
        for &port in &config.relay_ports {
            if inner.relays.contains_key(&port) || failed.iter().any(|(p, _)| *p == port) {
                continue;
            }
            if port == 0 {
                failed.push((port, "port 0 cannot be relayed".to_string()));
                continue;
            }
            if port == EGRESS_PROXY_PORT || Some(port) == egress_port {
                failed.push((port, format!("port {port} is the egress proxy's")));
                continue;
            }
            match relay::start(port, ServiceRequest::Loopback { port }, self.host.clone()) {
                Ok(r) => {
                    info!(port, "relaying guest port to the host");
                    inner.relays.insert(port, r);
                }
                Err(e) => failed.push((port, format!("cannot listen on 127.0.0.1:{port}: {e}"))),
            }
        }
        Ok(failed)
    }
}
