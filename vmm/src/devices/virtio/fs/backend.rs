//! The vhost-user session with the backend (virtiofsd), on the rust-vmm `vhost`
//! crate's frontend.

use std::net::Shutdown;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::memory::GuestMemoryMmap;

/// VHOST_USER_F_PROTOCOL_FEATURES: a virtio feature bit that only the vhost-user
/// session uses; never offered to the guest.
const PROTOCOL_FEATURES_BIT: u64 = 1 << 30;

/// How long the backend has to answer the requests of one step once the guest runs
/// (starting the rings, stopping them). The vCPU that asked waits meanwhile, holding
/// the device, so a stuck backend must not keep it for ever; a slow but live one must
/// not be given up on. virtiofsd answers GET_VRING_BASE only once its queue thread has
/// finished the requests it took (up to a queue's worth: 1,024 FUSE requests, each a
/// write of up to 1 MiB to a slow disk or a network file system, on a loaded host or
/// the nested host, under emulation). 30 s, as long as vmctl gives virtiofsd to start.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("cannot connect to the backend at {path}: {source} (is virtiofsd running there?)")]
    Connect { path: String, source: vhost::Error },
    #[error("the backend refused {step}: {source}")]
    Request {
        step: &'static str,
        source: vhost::Error,
    },
    #[error(
        "the backend did not answer {step} within {} s, so it is taken as lost; is the \
         file system it serves stuck? Stop the VM and start it again once it responds",
        .timeout.as_secs()
    )]
    NoAnswer {
        step: &'static str,
        timeout: Duration,
    },
    #[error("cannot keep a second descriptor of the backend's socket: {0}")]
    Duplicate(std::io::Error),
    #[error("the backend does not offer VIRTIO_F_VERSION_1")]
    NotModern,
    #[error("the backend serves {got} queues; this device needs {needed}")]
    TooFewQueues { got: u64, needed: usize },
    #[error("guest memory region at {addr:#x} has no file behind it to share with the backend")]
    UnsharedMemory { addr: u64 },
    #[error(
        "queue {index}: its {ring} at {addr:#x}+{len:#x} is not inside one guest memory region"
    )]
    RingOutsideMemory {
        index: usize,
        ring: &'static str,
        addr: u64,
        len: u64,
    },
}

impl BackendError {
    /// Whether the session is over: the backend hung up, broke the protocol, refused a
    /// request (virtiofsd then exits) or did not answer in time.
    pub fn ends_session(&self) -> bool {
        matches!(self, Self::Request { .. } | Self::NoAnswer { .. })
    }
}

/// A connected backend.
pub struct Backend {
    frontend: Frontend,
    /// Another descriptor of the frontend's socket, to shut the session down from
    /// another thread while the frontend waits for a reply (and holds its lock).
    session: Arc<UnixStream>,
    virtio_features: u64,
    protocol_features: bool,
    reply_timeout: Duration,
    /// The session was shut down: nothing more is asked of the backend.
    hung_up: bool,
}

fn request(step: &'static str) -> impl FnOnce(vhost::Error) -> BackendError {
    move |source| BackendError::Request { step, source }
}

impl Backend {
    pub fn connect(socket: &Path, queues: usize) -> Result<Self, BackendError> {
        let mut frontend =
            Frontend::connect(socket, queues as u64).map_err(|source| BackendError::Connect {
                path: socket.display().to_string(),
                source,
            })?;
        frontend.set_owner().map_err(request("SET_OWNER"))?;
        let virtio_features = frontend.get_features().map_err(request("GET_FEATURES"))?;
        let protocol_features = virtio_features & PROTOCOL_FEATURES_BIT != 0;
        if protocol_features {
            let offered = frontend
                .get_protocol_features()
                .map_err(request("GET_PROTOCOL_FEATURES"))?;
            let wanted = VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::REPLY_ACK;
            frontend
                .set_protocol_features(offered & wanted)
                .map_err(request("SET_PROTOCOL_FEATURES"))?;
            // Without it the backend acknowledges nothing and the crate waits for no
            // acknowledgement: a request it refused (a memory table it cannot map)
            // would go unnoticed until it hung up.
            if offered.contains(VhostUserProtocolFeatures::REPLY_ACK) {
                frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
            if offered.contains(VhostUserProtocolFeatures::MQ) {
                let got = frontend.get_queue_num().map_err(request("GET_QUEUE_NUM"))?;
                if got < queues as u64 {
                    return Err(BackendError::TooFewQueues {
                        got,
                        needed: queues,
                    });
                }
            }
        }
        let fd = frontend.as_raw_fd();
        // SAFETY: `fd` is the frontend's open socket, which it owns for this whole call;
        // it is only borrowed here, to make a descriptor of our own.
        let session = unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .map(|fd| Arc::new(UnixStream::from(fd)))
            .map_err(BackendError::Duplicate)?;
        Ok(Self {
            frontend,
            session,
            virtio_features,
            protocol_features,
            reply_timeout: REPLY_TIMEOUT,
            hung_up: false,
        })
    }

    pub fn virtio_features(&self) -> u64 {
        self.virtio_features
    }

    /// A descriptor of the session's socket, to poll for the backend going away
    /// (EPOLLHUP: it closed its side, which it does as it exits).
    pub fn hangup_fd(&self) -> RawFd {
        self.frontend.as_raw_fd()
    }

    /// Hands the guest's memory and the driver's rings to the backend and starts it.
    pub fn start(
        &mut self,
        guest_features: u64,
        memory: &GuestMemoryMmap,
        queues: &[Queue],
        calls: &[EventFd],
        kicks: &[Arc<EventFd>],
    ) -> Result<(), BackendError> {
        self.within_deadline("the requests that start the rings", |backend| {
            backend.start_rings(guest_features, memory, queues, calls, kicks)
        })
    }

    fn start_rings(
        &mut self,
        guest_features: u64,
        memory: &GuestMemoryMmap,
        queues: &[Queue],
        calls: &[EventFd],
        kicks: &[Arc<EventFd>],
    ) -> Result<(), BackendError> {
        let mut features = guest_features;
        if self.protocol_features {
            features |= PROTOCOL_FEATURES_BIT;
        }
        self.frontend
            .set_features(features)
            .map_err(request("SET_FEATURES"))?;
        let regions = memory
            .iter()
            .map(|region| {
                VhostUserMemoryRegionInfo::from_guest_region(region).map_err(|_| {
                    BackendError::UnsharedMemory {
                        addr: region.start_addr().0,
                    }
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.frontend
            .set_mem_table(&regions)
            .map_err(request("SET_MEM_TABLE"))?;
        for (index, ((queue, call), kick)) in queues.iter().zip(calls).zip(kicks).enumerate() {
            let size = queue.size();
            let ring = |ring, addr, len| host_address(memory, index, ring, addr, len);
            let config = VringConfigData {
                queue_max_size: queue.max_size(),
                queue_size: size,
                flags: 0,
                desc_table_addr: ring(
                    "descriptor table",
                    queue.desc_table(),
                    16 * u64::from(size),
                )?,
                used_ring_addr: ring("used ring", queue.used_ring(), 6 + 8 * u64::from(size))?,
                avail_ring_addr: ring(
                    "available ring",
                    queue.avail_ring(),
                    6 + 2 * u64::from(size),
                )?,
                log_addr: None,
            };
            self.frontend
                .set_vring_num(index, size)
                .map_err(request("SET_VRING_NUM"))?;
            self.frontend
                .set_vring_addr(index, &config)
                .map_err(request("SET_VRING_ADDR"))?;
            self.frontend
                .set_vring_base(index, 0)
                .map_err(request("SET_VRING_BASE"))?;
            self.frontend
                .set_vring_call(index, call)
                .map_err(request("SET_VRING_CALL"))?;
            self.frontend
                .set_vring_kick(index, kick)
                .map_err(request("SET_VRING_KICK"))?;
            if self.protocol_features {
                self.frontend
                    .set_vring_enable(index, true)
                    .map_err(request("SET_VRING_ENABLE"))?;
            }
        }
        Ok(())
    }

    /// Stops the rings (GET_VRING_BASE) after a device reset.
    pub fn stop_rings(&mut self, queues: usize) -> Result<(), BackendError> {
        self.within_deadline("GET_VRING_BASE", |backend| {
            for index in 0..queues {
                backend
                    .frontend
                    .get_vring_base(index)
                    .map_err(request("GET_VRING_BASE"))?;
            }
            Ok(())
        })
    }

    /// Ends the session: nothing is asked of the backend again, and what it says is
    /// not read (a late reply of its fails). Only our reading side is shut: the
    /// socket then still tells the device's worker when the backend is gone (EPOLLHUP
    /// comes only once both sides are closed), and only then may the worker answer
    /// the guest's requests itself. Until then the backend may still be working on
    /// them, in the guest's memory.
    pub fn hang_up(&mut self) {
        self.hung_up = true;
        stop_reading(&self.session);
    }

    /// How long the backend has to answer (tests wait less than [`REPLY_TIMEOUT`]).
    #[cfg(test)]
    pub fn set_reply_timeout(&mut self, timeout: Duration) {
        self.reply_timeout = timeout;
    }

    /// Whether the backend has closed its end of the session: it exited, crashed or
    /// was killed (the socket shows a hang-up, as the device's worker waits for).
    pub fn is_gone(&self) -> bool {
        let mut watched = libc::pollfd {
            fd: self.session.as_raw_fd(),
            // A hang-up is reported whatever is asked for.
            events: 0,
            revents: 0,
        };
        // SAFETY: `watched` is one valid pollfd for the call's length, on a descriptor
        // we own; a timeout of 0 only looks.
        let ready = unsafe { libc::poll(&mut watched, 1, 0) };
        ready == 1 && watched.revents & libc::POLLHUP != 0
    }

    /// Whether the session was ended: by [`Self::hang_up`], or for want of an answer.
    pub fn hung_up(&self) -> bool {
        self.hung_up
    }

    /// Runs `requests` (`what`, for the error), giving the backend its reply timeout
    /// ([`REPLY_TIMEOUT`]) to answer. vhost retries a receive that times out
    /// (SO_RCVTIMEO), so a thread of its own keeps the time: it shuts the session
    /// down, which ends the wait for a reply.
    fn within_deadline(
        &mut self,
        what: &'static str,
        requests: impl FnOnce(&mut Self) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let timeout = self.reply_timeout;
        let session = Arc::clone(&self.session);
        let (answered, waiting) = mpsc::channel::<()>();
        let watchdog = std::thread::Builder::new()
            .name("virtio-fs deadline".into())
            .spawn(move || {
                let timed_out = waiting.recv_timeout(timeout) == Err(RecvTimeoutError::Timeout);
                if timed_out {
                    // Ends the frontend's wait for the reply (see `hang_up`).
                    stop_reading(&session);
                }
                timed_out
            });
        if let Err(e) = &watchdog {
            tracing::warn!(
                "virtio-fs: cannot start the thread that bounds the backend's answers ({e}); \
                 a stuck backend could hold the vCPU that asked"
            );
        }
        let result = requests(self);
        drop(answered);
        let timed_out = match watchdog {
            Ok(watchdog) => watchdog.join().unwrap_or(false),
            Err(_) => false,
        };
        if timed_out {
            self.hung_up = true;
        }
        match result {
            Err(BackendError::Request { step, .. }) if timed_out => {
                Err(BackendError::NoAnswer { step, timeout })
            }
            // The last reply came as the time ran out, and the session is shut down.
            Ok(()) if timed_out => Err(BackendError::NoAnswer {
                step: what,
                timeout,
            }),
            other => other,
        }
    }
}

/// Shuts the reading side of the session: a wait for a reply ends at once, and the
/// backend's writes fail from now on.
fn stop_reading(session: &UnixStream) {
    if let Err(e) = session.shutdown(Shutdown::Read) {
        tracing::warn!("virtio-fs: shutting the backend's socket down for reading: {e}");
    }
}

/// The VMM's virtual address of a ring the driver placed at `addr`, which the backend
/// translates through the memory table. The whole ring must lie in one region.
fn host_address(
    memory: &GuestMemoryMmap,
    index: usize,
    ring: &'static str,
    addr: u64,
    len: u64,
) -> Result<u64, BackendError> {
    let outside = || BackendError::RingOutsideMemory {
        index,
        ring,
        addr,
        len,
    };
    let (region, offset) = memory
        .to_region_addr(GuestAddress(addr))
        .ok_or_else(outside)?;
    let end = offset.0.checked_add(len).ok_or_else(outside)?;
    if end > region.len() {
        return Err(outside());
    }
    let host = memory
        .get_host_address(GuestAddress(addr))
        .map_err(|_| outside())?;
    Ok(host as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::create_guest_ram;

    #[test]
    fn rings_must_sit_inside_one_region() {
        let ram = create_guest_ram(4 << 20).unwrap();
        let memory = &ram.memory;
        let base = memory.get_host_address(GuestAddress(0x1000)).unwrap() as u64;
        assert_eq!(host_address(memory, 0, "ring", 0x1000, 64).unwrap(), base);
        let end = 4 << 20;
        assert!(host_address(memory, 0, "ring", end - 8, 16).is_err());
        assert!(host_address(memory, 0, "ring", end, 1).is_err());
        assert!(host_address(memory, 0, "ring", u64::MAX - 4, 16).is_err());
    }
}
