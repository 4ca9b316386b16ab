//! The device's thread: it waits for the backend to be gone, then serves the queues
//! itself (see `fallback`). While the backend is there, the thread sleeps: the
//! backend reads the kicks and signals the irqfd itself. Gone means its end of the
//! session closed (EPOLLHUP), as when it exits or is killed: a backend the VMM gave up
//! on but that still runs may still complete requests in the guest's rings, and two
//! servers of one ring would corrupt the guest's memory.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::thread::JoinHandle;

use virtio_queue::Queue;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::fallback;
use crate::devices::virtio::InterruptTrigger;
use crate::memory::GuestMemoryMmap;

const STOP: u64 = 0;
const HANGUP: u64 = 1;
/// Token `KICK_BASE + i` is queue i's kick, watched once the backend is gone.
const KICK_BASE: u64 = 100;

pub struct Worker {
    tag: String,
    epoll: Epoll,
    stop: Arc<EventFd>,
    /// The backend's socket, watched until the backend is gone.
    hangup_fd: Option<RawFd>,
    kicks: Vec<Arc<EventFd>>,
    memory: GuestMemoryMmap,
    queues: Vec<Queue>,
    interrupt: InterruptTrigger,
    backend_lost: bool,
}

/// Stops the thread and waits for it.
pub struct WorkerHandle {
    stop: Arc<EventFd>,
    thread: JoinHandle<()>,
}

impl WorkerHandle {
    pub fn stop(self) {
        if let Err(e) = self.stop.write(1) {
            tracing::error!("virtio-fs: cannot stop the device thread: {e}");
            return;
        }
        if self.thread.join().is_err() {
            tracing::error!("virtio-fs: the device thread panicked");
        }
    }
}

impl Worker {
    pub fn new(
        tag: String,
        hangup_fd: RawFd,
        kicks: Vec<Arc<EventFd>>,
        memory: GuestMemoryMmap,
        queues: Vec<Queue>,
        interrupt: InterruptTrigger,
    ) -> std::io::Result<Self> {
        let epoll = Epoll::new()?;
        let stop = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let worker = Self {
            tag,
            epoll,
            stop,
            hangup_fd: Some(hangup_fd),
            kicks,
            memory,
            queues,
            interrupt,
            backend_lost: false,
        };
        worker.watch(worker.stop.as_raw_fd(), EventSet::IN, STOP)?;
        // Only the backend's end matters: it never writes unprompted, and replies to
        // our requests are read by the frontend itself. Not EPOLLRDHUP: a session the
        // VMM gave up on is shut for reading on our side, which raises that at once.
        worker.watch(hangup_fd, EventSet::HANG_UP, HANGUP)?;
        Ok(worker)
    }

    fn watch(&self, fd: RawFd, events: EventSet, token: u64) -> std::io::Result<()> {
        self.epoll
            .ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))
    }

    pub fn spawn(self) -> std::io::Result<WorkerHandle> {
        let stop = self.stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("virtio-fs {}", self.tag))
            .spawn(move || self.run())?;
        Ok(WorkerHandle { stop, thread })
    }

    fn run(mut self) {
        let mut events = vec![EpollEvent::default(); 8];
        loop {
            let count = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("virtio-fs {:?}: waiting for events failed: {e}", self.tag);
                    return;
                }
            };
            for event in &events[..count] {
                match event.data() {
                    STOP => return,
                    HANGUP => self.on_backend_lost(),
                    token => self.on_kick_without_backend((token - KICK_BASE) as usize),
                }
            }
        }
    }

    /// The backend closed its end (it exited, crashed or was killed): the rings are
    /// ours now.
    fn on_backend_lost(&mut self) {
        if self.backend_lost {
            return;
        }
        tracing::error!(
            "virtio-fs {:?}: the backend (virtiofsd) is gone; the guest's requests to this \
             share now fail with EIO",
            self.tag
        );
        if let Some(fd) = self.hangup_fd.take() {
            if let Err(e) = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default())
            {
                tracing::warn!("virtio-fs {:?}: {e}", self.tag);
            }
        }
        self.take_over_queues();
    }

    /// Serves the queues from where the backend left them, and from now on.
    fn take_over_queues(&mut self) {
        self.backend_lost = true;
        // Whatever the backend finished before it went, it may not have signalled.
        self.interrupt.signal_used_queue();
        for (index, queue) in self.queues.iter_mut().enumerate() {
            fallback::take_over(queue, &self.memory);
            let kick = self.kicks[index].as_raw_fd();
            if let Err(e) = self.epoll.ctl(
                ControlOperation::Add,
                kick,
                EpollEvent::new(EventSet::IN, KICK_BASE + index as u64),
            ) {
                tracing::error!("virtio-fs {:?}: cannot watch queue {index}: {e}", self.tag);
            }
        }
        for index in 0..self.queues.len() {
            self.on_kick_without_backend(index);
        }
    }

    fn on_kick_without_backend(&mut self, index: usize) {
        let (Some(queue), Some(kick)) = (self.queues.get_mut(index), self.kicks.get(index)) else {
            return;
        };
        let _ = kick.read();
        let answered = fallback::fail_requests(queue, &self.memory);
        if answered.notify {
            self.interrupt.signal_used_queue();
        }
        if answered.needs_reset {
            self.interrupt.signal_needs_reset();
        }
        // Back to this queue after the other events, as if kicked again.
        if answered.more {
            if let Err(e) = kick.write(1) {
                tracing::error!(
                    "virtio-fs {:?}: cannot requeue queue {index}: {e}",
                    self.tag
                );
            }
        }
    }
}
