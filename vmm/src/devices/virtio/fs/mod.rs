//! virtio-fs (virtio 1.2, section 5.11) through a vhost-user backend: virtiofsd
//! serves the FUSE requests straight from guest memory (the memfd it maps), kicked by
//! the queues' ioeventfds, and interrupts the guest through the device's irqfd. The
//! VMM only sets the session up and, once the backend is gone, answers the guest's
//! requests with EIO itself so nothing in the guest hangs on a dead share. A backend
//! that refuses one of the VMM's requests, or leaves one unanswered for
//! `backend::REPLY_TIMEOUT`, is given up on: the VMM stops listening to it and tells
//! its caller ([`Event::FsBackendGivenUp`]), which kills it; only when it is gone does
//! the VMM answer for it, as it may be at work in the guest's rings until then. One
//! that ended on its own is not reported: its caller sees it end.

mod backend;
pub mod fallback;
mod worker;

use std::os::fd::RawFd;
use std::path::Path;
use std::sync::Arc;

use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use self::backend::{Backend, BackendError};
use self::worker::{Worker, WorkerHandle};
use super::{
    ActivateError, InterruptTrigger, QueueProgress, VirtioDevice, FEATURE_EVENT_IDX,
    FEATURE_VERSION_1,
};
use crate::config::MAX_FS_TAG_LEN;
use crate::memory::GuestMemoryMmap;
use crate::process::{Event, EventSink};

pub const DEVICE_ID_FS: u32 = 26;
/// One high-priority queue (FORGET, INTERRUPT) and one request queue.
pub const NUM_QUEUES: usize = 2;
pub const QUEUE_SIZE: u16 = 1024;

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("virtio-fs tag {tag:?}: a tag is 1 to {MAX_FS_TAG_LEN} bytes")]
    BadTag { tag: String },
    #[error("virtio-fs {tag:?}: {source}")]
    Backend { tag: String, source: BackendError },
}

/// The virtio-fs device of one share.
pub struct VhostUserFs {
    tag: String,
    backend: Backend,
    /// What the guest may negotiate: the backend's transport features we support.
    avail_features: u64,
    acked_features: u64,
    queue_max_sizes: [u16; NUM_QUEUES],
    /// The queues' ioeventfds (clones of those registered with KVM): the backend's
    /// kick descriptors.
    kicks: Vec<Arc<EventFd>>,
    worker: Option<WorkerHandle>,
    /// Told when the backend is given up on.
    events: EventSink,
    /// The backend was given up on (and the caller told, once).
    given_up: bool,
}

/// Transport features we let the guest and backend agree on. EVENT_IDX matters most:
/// it lets both sides skip most notifications and interrupts.
const SUPPORTED_FEATURES: u64 = FEATURE_VERSION_1
    | FEATURE_EVENT_IDX
    | (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC);

impl VhostUserFs {
    /// Connects to the backend listening on `socket` and negotiates what does not
    /// depend on the guest. `events` is told if the backend is given up on.
    pub fn connect(socket: &Path, tag: &str, events: EventSink) -> Result<Self, FsError> {
        if tag.is_empty() || tag.len() > MAX_FS_TAG_LEN {
            return Err(FsError::BadTag { tag: tag.into() });
        }
        let backend_error = |source| FsError::Backend {
            tag: tag.into(),
            source,
        };
        let backend = Backend::connect(socket, NUM_QUEUES).map_err(backend_error)?;
        let avail_features = backend.virtio_features() & SUPPORTED_FEATURES;
        if avail_features & FEATURE_VERSION_1 == 0 {
            return Err(backend_error(BackendError::NotModern));
        }
        Ok(Self {
            tag: tag.into(),
            backend,
            avail_features,
            acked_features: 0,
            queue_max_sizes: [QUEUE_SIZE; NUM_QUEUES],
            kicks: Vec::new(),
            worker: None,
            events,
            given_up: false,
        })
    }

    /// struct virtio_fs_config: the tag, NUL-padded, then num_request_queues.
    fn config_space(&self) -> [u8; MAX_FS_TAG_LEN + 4] {
        let mut config = [0u8; MAX_FS_TAG_LEN + 4];
        config[..self.tag.len()].copy_from_slice(self.tag.as_bytes());
        let request_queues = (NUM_QUEUES as u32 - 1).to_le_bytes();
        config[MAX_FS_TAG_LEN..].copy_from_slice(&request_queues);
        config
    }

    /// Starts the backend on the driver's rings; returns its socket for the worker to
    /// watch for its end. A backend given up on (before, or now, as it fails to
    /// start) is not started: the worker answers the guest's requests with EIO once
    /// it is gone, as the driver never looks at NEEDS_RESET (Linux's virtio-fs waits
    /// on its FUSE_INIT for ever).
    fn start_backend(
        &mut self,
        memory: &GuestMemoryMmap,
        queues: &[Queue],
        calls: &[EventFd],
    ) -> Result<RawFd, ActivateError> {
        if self.backend.hung_up() {
            tracing::debug!(
                "virtio-fs {:?}: the backend was given up on; the guest's requests fail \
                 with EIO once it is gone",
                self.tag
            );
            return Ok(self.backend.hangup_fd());
        }
        match self
            .backend
            .start(self.acked_features, memory, queues, calls, &self.kicks)
        {
            Ok(()) => Ok(self.backend.hangup_fd()),
            Err(e) if e.ends_session() => {
                self.give_up(&e, "starting the backend (virtiofsd)");
                Ok(self.backend.hangup_fd())
            }
            Err(e) => Err(ActivateError::Device(format!(
                "virtio-fs {:?}: {e}",
                self.tag
            ))),
        }
    }

    /// Stops listening to the backend after `error` (in `doing`) and tells the
    /// caller, once, so that it kills the backend: a backend that stopped answering
    /// may still write into the guest's memory, so its requests are answered only
    /// when it is gone. A backend already gone (it died on its own, and `error` is
    /// only the broken session) is not reported: there is nothing to kill, and its
    /// caller, which watches it, says how it ended; "given up on" would be untrue.
    fn give_up(&mut self, error: &BackendError, doing: &str) {
        let gone = self.backend.is_gone();
        self.backend.hang_up();
        if self.given_up {
            return;
        }
        self.given_up = true;
        if gone {
            tracing::error!(
                "virtio-fs {:?}: {doing} failed: {error}; the backend (virtiofsd) has \
                 ended, and the guest's requests to this share fail with EIO",
                self.tag
            );
            return;
        }
        tracing::error!(
            "virtio-fs {:?}: {doing} failed: {error}; the backend is given up on, and the \
             guest's requests to this share fail with EIO once it has ended",
            self.tag
        );
        (self.events)(Event::FsBackendGivenUp {
            tag: self.tag.clone(),
            reason: error.to_string(),
        });
    }

    fn stop_worker(&mut self) {
        if let Some(worker) = self.worker.take() {
            worker.stop();
        }
    }
}

impl VirtioDevice for VhostUserFs {
    fn device_type(&self) -> u32 {
        DEVICE_ID_FS
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_max_sizes
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_bytes(&self.config_space(), offset, data);
    }

    fn attach_queue_events(&mut self, events: &[EventFd]) -> Result<bool, std::io::Error> {
        self.kicks = events
            .iter()
            .map(|e| e.try_clone().map(Arc::new))
            .collect::<Result<_, _>>()?;
        Ok(true)
    }

    fn activate(
        &mut self,
        memory: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: InterruptTrigger,
    ) -> Result<(), ActivateError> {
        self.stop_worker();
        let got = queues.len();
        if got != NUM_QUEUES || self.kicks.len() != NUM_QUEUES {
            return Err(ActivateError::QueueCount {
                expected: NUM_QUEUES,
                got,
            });
        }
        if let Some(index) = queues.iter().position(|q| !virtio_queue::QueueT::ready(q)) {
            return Err(ActivateError::QueueNotReady { index });
        }
        // Every queue's "call" is the device's irqfd: virtiofsd interrupts the guest
        // directly, and no VMM thread wakes per request.
        let calls = (0..NUM_QUEUES)
            .map(|_| interrupt.irqfd_for_backend())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ActivateError::Device(format!("virtio-fs: irqfd: {e}")))?;
        let backend = self.start_backend(&memory, &queues, &calls)?;
        let worker = Worker::new(
            self.tag.clone(),
            backend,
            self.kicks.clone(),
            memory,
            queues,
            interrupt,
        )
        .map_err(|e| ActivateError::Device(format!("virtio-fs {:?}: {e}", self.tag)))?;
        self.worker = Some(
            worker
                .spawn()
                .map_err(|e| ActivateError::Device(format!("virtio-fs {:?}: {e}", self.tag)))?,
        );
        Ok(())
    }

    fn process_queue(&mut self, index: usize) -> QueueProgress {
        // The backend reads the kicks itself; a trapped QueueNotify only lands here
        // when ioeventfds are unavailable, so forward it.
        if let Some(kick) = self.kicks.get(index) {
            if let Err(e) = kick.write(1) {
                tracing::warn!("virtio-fs {:?}: cannot kick queue {index}: {e}", self.tag);
            }
        }
        QueueProgress::Done
    }

    fn reset(&mut self) {
        self.stop_worker();
        if !self.backend.hung_up() {
            match self.backend.stop_rings(NUM_QUEUES) {
                Ok(()) => {}
                Err(e) if e.ends_session() => {
                    self.give_up(&e, "stopping the rings for the guest's reset")
                }
                Err(e) => tracing::debug!("virtio-fs {:?}: stopping the rings: {e}", self.tag),
            }
        }
        self.acked_features = 0;
    }
}

impl Drop for VhostUserFs {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

#[cfg(test)]
mod tests;
