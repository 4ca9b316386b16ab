//! virtio-vsock (virtio 1.2, section 5.10), stream sockets only, with a
//! Firecracker-style "hybrid" host side over Unix sockets:
//!
//! - host → guest: a client connects to the Unix socket `P` and writes
//!   `CONNECT <port>\n`; once the guest accepts, the client reads `OK <host_port>\n`
//!   and the stream is bridged; if the guest refuses, the client is disconnected.
//! - guest → host: a guest connection to CID 2 port `N` is forwarded to the Unix
//!   socket `P_N`; if nothing listens there the guest gets a reset.
//!
//! The worker thread ([`worker`]) does all queue and socket I/O. It waits on the
//! queues' ioeventfds itself ([`VirtioDevice::attach_queue_events`]): a guest's kick
//! wakes it directly, not through the VMM's event loop, which may be busy serving a
//! block device's reads. [`VirtioDevice::process_queue`] (a kick the transport
//! forwards, as in tests) only wakes it.

pub mod connection;
pub mod muxer;
pub mod packet;
pub mod worker;

use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::{
    ActivateError, InterruptTrigger, QueueProgress, VirtioDevice, DEVICE_ID_VSOCK,
    FEATURE_EVENT_IDX, FEATURE_VERSION_1,
};
use crate::memory::GuestMemoryMmap;
use muxer::Muxer;
use worker::{WorkerHandle, NUM_QUEUES, TX_QUEUE};

/// Size of each of the three queues.
pub const QUEUE_SIZE: u16 = 256;
/// The guest CID used when none is configured.
pub const DEFAULT_GUEST_CID: u64 = 3;

#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("guest CID {0} is reserved or out of range (use 3..=4294967294)")]
    InvalidCid(u64),
    #[error("{}: exists and is not a socket; refusing to replace it", .0.display())]
    NotASocket(PathBuf),
    #[error("cannot remove the stale socket {}: {source}", .path.display())]
    RemoveStale {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot listen on {}: {source}", .path.display())]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The vsock device.
pub struct Vsock {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: Arc<UnixListener>,
    queue_max_sizes: [u16; NUM_QUEUES],
    /// The queues' ioeventfds, when the VMM gave them ([`VirtioDevice::attach_queue_events`]).
    kicks: Option<[Arc<EventFd>; NUM_QUEUES]>,
    worker: Option<WorkerHandle>,
}

impl Vsock {
    /// A device whose guest has CID `guest_cid`, listening on `uds_path` right away
    /// (a stale socket file there is replaced).
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Vsock, VsockError> {
        if !(3..u64::from(u32::MAX)).contains(&guest_cid) {
            return Err(VsockError::InvalidCid(guest_cid));
        }
        if let Ok(meta) = std::fs::symlink_metadata(uds_path) {
            if !meta.file_type().is_socket() {
                return Err(VsockError::NotASocket(uds_path.to_path_buf()));
            }
            std::fs::remove_file(uds_path).map_err(|source| VsockError::RemoveStale {
                path: uds_path.to_path_buf(),
                source,
            })?;
        }
        let bind_err = |source| VsockError::Bind {
            path: uds_path.to_path_buf(),
            source,
        };
        let listener = UnixListener::bind(uds_path).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        Ok(Vsock {
            guest_cid,
            uds_path: uds_path.to_path_buf(),
            listener: Arc::new(listener),
            queue_max_sizes: [QUEUE_SIZE; NUM_QUEUES],
            kicks: None,
            worker: None,
        })
    }

    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    /// The Unix socket host clients connect to.
    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// Whether the worker runs (the driver activated the device).
    pub fn is_active(&self) -> bool {
        self.worker.as_ref().is_some_and(WorkerHandle::is_running)
    }

    fn stop_worker(&mut self) {
        if let Some(mut worker) = self.worker.take() {
            worker.stop();
        }
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        self.stop_worker();
        if let Err(e) = std::fs::remove_file(&self.uds_path) {
            tracing::debug!("vsock: cannot remove {}: {e}", self.uds_path.display());
        }
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        DEVICE_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_max_sizes
    }

    fn avail_features(&self) -> u64 {
        FEATURE_VERSION_1 | FEATURE_EVENT_IDX
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }

    /// The receive queue's buffers wait for packets for the guest, the event queue's
    /// for events; every transmit chain goes back as the worker takes it.
    fn holds_chains(&self, index: usize) -> bool {
        index != TX_QUEUE
    }

    fn attach_queue_events(&mut self, events: &[EventFd]) -> Result<bool, std::io::Error> {
        let Ok(events) = <&[EventFd; NUM_QUEUES]>::try_from(events) else {
            return Ok(false);
        };
        let [rx, tx, event] = events;
        self.kicks = Some([
            Arc::new(rx.try_clone()?),
            Arc::new(tx.try_clone()?),
            Arc::new(event.try_clone()?),
        ]);
        Ok(true)
    }

    fn activate(
        &mut self,
        memory: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: InterruptTrigger,
    ) -> Result<(), ActivateError> {
        let queues: [Queue; NUM_QUEUES] = super::queues_of(queues)?;
        if let Some(index) = queues.iter().position(|q| !q.ready()) {
            return Err(ActivateError::QueueNotReady { index });
        }
        self.stop_worker();
        let muxer = Muxer::new(self.guest_cid, &self.uds_path, self.listener.clone())
            .map_err(|e| ActivateError::Device(e.to_string()))?;
        let handle = worker::spawn(
            memory,
            queues,
            interrupt,
            muxer,
            self.guest_cid,
            self.kicks.clone(),
        )
        .map_err(|e| ActivateError::Device(e.to_string()))?;
        self.worker = Some(handle);
        Ok(())
    }

    fn process_queue(&mut self, index: usize) -> QueueProgress {
        match &self.worker {
            Some(worker) if index < NUM_QUEUES => worker.notify(index),
            Some(_) => {
                guest_log::guest_warn!("virtio-vsock: notification for nonexistent queue {index}")
            }
            None => tracing::debug!("virtio-vsock: queue {index} notified before activation"),
        }
        // The worker serves the queues, in rounds of its own.
        QueueProgress::Done
    }

    fn reset(&mut self) {
        self.stop_worker();
    }
}

#[cfg(test)]
mod tests;
