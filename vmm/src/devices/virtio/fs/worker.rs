//! The device's thread: turns the backend's call signals into guest interrupts and,
//! once the backend hangs up, serves the queues itself (see `fallback`).

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
/// Tokens `CALL_BASE + i` are queue i's call eventfd, `KICK_BASE + i` its kick.
const CALL_BASE: u64 = 100;
const KICK_BASE: u64 = 200;

pub struct Worker {
    tag: String,
    epoll: Epoll,
    stop: Arc<EventFd>,
    hangup_fd: RawFd,
    calls: Vec<EventFd>,
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
        calls: Vec<EventFd>,
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
            hangup_fd,
            calls,
            kicks,
            memory,
            queues,
            interrupt,
            backend_lost: false,
        };
        worker.watch(worker.stop.as_raw_fd(), EventSet::IN, STOP)?;
        // Only the hang-up matters: the backend never writes unprompted, and replies
        // to our requests are read by the frontend itself.
        worker.watch(hangup_fd, EventSet::READ_HANG_UP, HANGUP)?;
        for (index, call) in worker.calls.iter().enumerate() {
            worker.watch(call.as_raw_fd(), EventSet::IN, CALL_BASE + index as u64)?;
        }
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
                    token if (CALL_BASE..KICK_BASE).contains(&token) => {
                        self.on_call((token - CALL_BASE) as usize)
                    }
                    token => self.on_kick_without_backend((token - KICK_BASE) as usize),
                }
            }
        }
    }

    fn on_call(&mut self, index: usize) {
        if let Some(call) = self.calls.get(index) {
            // Nonblocking: an empty counter only means another wake-up took it.
            let _ = call.read();
            self.interrupt.signal_used_queue();
        }
    }

    /// The backend closed the session (it exited or crashed): the rings are ours now.
    fn on_backend_lost(&mut self) {
        if self.backend_lost {
            return;
        }
        self.backend_lost = true;
        tracing::error!(
            "virtio-fs {:?}: the backend (virtiofsd) hung up; the guest's requests to this \
             share now fail with EIO",
            self.tag
        );
        if let Err(e) = self.epoll.ctl(
            ControlOperation::Delete,
            self.hangup_fd,
            EpollEvent::default(),
        ) {
            tracing::warn!("virtio-fs {:?}: {e}", self.tag);
        }
        // Whatever the backend finished before it went is signalled first.
        for index in 0..self.calls.len() {
            self.on_call(index);
        }
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
        if fallback::fail_requests(queue, &self.memory) {
            self.interrupt.signal_used_queue();
        }
    }
}
