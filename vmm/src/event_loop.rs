//! The VMM's main thread: waits for queue notifications (ioeventfds), console input,
//! stop signals and the VM's exit, and dispatches each to its handler.

use std::io::ErrorKind;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::signal::register_signal_handler;

use crate::devices::legacy::SerialConsole;
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::QueueProgress;
use crate::vstate::exit::{ExitNotifier, ExitReason};

#[derive(Debug, thiserror::Error)]
pub enum EventLoopError {
    #[error("cannot set up the event loop ({step}): {source}")]
    Setup {
        step: &'static str,
        source: std::io::Error,
    },
    #[error("cannot install the handler for signal {signal}: {source}")]
    Signal {
        signal: i32,
        source: vmm_sys_util::errno::Error,
    },
    #[error("waiting for events failed: {0}")]
    Wait(std::io::Error),
}

/// The eventfd that the SIGINT/SIGTERM handler writes to (-1 until installed), and the
/// signal that arrived. Statics, because a signal handler can reach nothing else.
static STOP_SIGNAL_FD: AtomicI32 = AtomicI32::new(-1);
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(signal: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    STOP_SIGNAL.store(signal, Ordering::SeqCst);
    let fd = STOP_SIGNAL_FD.load(Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: __errno_location returns this thread's errno, which the write below
        // may change under the code the signal interrupted: put back after it.
        let errno = unsafe { libc::__errno_location() };
        // SAFETY: as above; reading a thread's own errno.
        let saved = unsafe { *errno };
        let one: u64 = 1;
        // SAFETY: write(2) is async-signal-safe; `one` is a live 8-byte value and `fd`
        // is a copy of the event loop's eventfd that stays open for the life of the
        // process (`handle_stop_signals`), after the loop too.
        unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
        // SAFETY: as above.
        unsafe { *errno = saved };
    }
}

/// What serves a queue's notifications: the device's transport.
pub trait QueueTarget: Send {
    fn notify_queue(&mut self, queue: u32) -> QueueProgress;
}

impl QueueTarget for MmioTransport {
    fn notify_queue(&mut self, queue: u32) -> QueueProgress {
        MmioTransport::notify_queue(self, queue)
    }
}

enum Source {
    Exit,
    StopSignal,
    ConsoleInput,
    Queue {
        transport: Arc<Mutex<dyn QueueTarget>>,
        queue: u32,
        event: EventFd,
    },
}

/// Dispatches events until the VM exits.
pub struct EventLoop {
    epoll: Epoll,
    sources: Vec<Source>,
    exit: Arc<ExitNotifier>,
    stop_signal: EventFd,
    console: Option<Console>,
}

/// The serial console fed from the VMM's stdin. While the guest's receive FIFO is
/// full, or a vCPU holds the console (its write of the guest's output to a stdout
/// nobody reads may block for good), stdin is left unread (not dropped) and polled
/// again a little later: the loop's other work never waits for the console.
struct Console {
    serial: Arc<Mutex<SerialConsole>>,
    /// The VMM's stdin ([`STDIN_FD`]), a test's pipe.
    input: RawFd,
    token: u64,
    paused: bool,
}

/// The console unless a vCPU holds it now.
fn console_if_free(
    serial: &Mutex<SerialConsole>,
) -> Option<std::sync::MutexGuard<'_, SerialConsole>> {
    match serial.try_lock() {
        Ok(serial) => Some(serial),
        Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

const STDIN_FD: RawFd = 0;
const CONSOLE_RETRY_MS: i32 = 10;
/// How often the event loop calls its tick handler.
pub const TICK_MS: u64 = 500;

impl EventLoop {
    pub fn new(exit: Arc<ExitNotifier>) -> Result<Self, EventLoopError> {
        let setup = |step| move |source| EventLoopError::Setup { step, source };
        let epoll = Epoll::new().map_err(setup("epoll"))?;
        let stop_signal = EventFd::new(EFD_NONBLOCK).map_err(setup("signal eventfd"))?;
        let mut event_loop = Self {
            epoll,
            sources: Vec::new(),
            exit,
            stop_signal,
            console: None,
        };
        let exit_fd = event_loop.exit.event().as_raw_fd();
        event_loop.watch(exit_fd, Source::Exit)?;
        event_loop.watch(event_loop.stop_signal.as_raw_fd(), Source::StopSignal)?;
        Ok(event_loop)
    }

    /// Turns SIGINT and SIGTERM into a clean stop with `ExitReason::Signal`. The
    /// handler writes to a copy of the loop's eventfd that is never closed: a signal
    /// during the teardown, or after, would otherwise write to whatever had taken the
    /// closed descriptor's number by then.
    pub fn handle_stop_signals(&self) -> Result<(), EventLoopError> {
        let kept = self
            .stop_signal
            .try_clone()
            .map_err(|e| EventLoopError::Setup {
                step: "signal eventfd copy",
                source: e,
            })?;
        STOP_SIGNAL_FD.store(kept.as_raw_fd(), Ordering::SeqCst);
        std::mem::forget(kept);
        for signal in [libc::SIGINT, libc::SIGTERM] {
            register_signal_handler(signal, on_stop_signal)
                .map_err(|source| EventLoopError::Signal { signal, source })?;
        }
        Ok(())
    }

    /// Feeds the VMM's stdin to the serial console.
    pub fn add_console_input(
        &mut self,
        console: Arc<Mutex<SerialConsole>>,
    ) -> Result<(), EventLoopError> {
        self.add_console_input_from(STDIN_FD, console)
    }

    fn add_console_input_from(
        &mut self,
        input: RawFd,
        console: Arc<Mutex<SerialConsole>>,
    ) -> Result<(), EventLoopError> {
        let token = self.sources.len() as u64;
        // A regular file or /dev/null cannot be polled (EPERM): there is no input then.
        if let Err(e) = self.add_to_epoll(input, token) {
            tracing::debug!("no console input: stdin cannot be polled ({e})");
            return Ok(());
        }
        self.sources.push(Source::ConsoleInput);
        self.console = Some(Console {
            serial: console,
            input,
            token,
            paused: false,
        });
        Ok(())
    }

    /// Calls `transport.notify_queue(queue)` whenever `event` (the queue's ioeventfd)
    /// fires.
    pub fn add_queue(
        &mut self,
        transport: Arc<Mutex<dyn QueueTarget>>,
        queue: u32,
        event: EventFd,
    ) -> Result<(), EventLoopError> {
        let fd = event.as_raw_fd();
        self.watch(
            fd,
            Source::Queue {
                transport,
                queue,
                event,
            },
        )
    }

    fn watch(&mut self, fd: RawFd, source: Source) -> Result<(), EventLoopError> {
        let token = self.sources.len() as u64;
        self.add_to_epoll(fd, token)
            .map_err(|source| EventLoopError::Setup {
                step: "epoll registration",
                source,
            })?;
        self.sources.push(source);
        Ok(())
    }

    fn add_to_epoll(&self, fd: RawFd, token: u64) -> std::io::Result<()> {
        self.epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, token),
        )
    }

    fn unwatch(&self, fd: RawFd) {
        if let Err(e) = self
            .epoll
            .ctl(ControlOperation::Delete, fd, EpollEvent::default())
        {
            tracing::warn!("cannot stop watching fd {fd}: {e}");
        }
    }

    /// Runs until the VM exits or a stop signal arrives, calling `on_tick` about every
    /// `TICK_MS` milliseconds.
    pub fn run(&mut self, on_tick: &mut dyn FnMut()) -> Result<ExitReason, EventLoopError> {
        let mut events = vec![EpollEvent::default(); 32];
        let mut next_tick = Instant::now() + Duration::from_millis(TICK_MS);
        loop {
            let now = Instant::now();
            if now >= next_tick {
                on_tick();
                next_tick = now + Duration::from_millis(TICK_MS);
            }
            let until_tick = next_tick.saturating_duration_since(now).as_millis() as i32 + 1;
            let timeout = match &self.console {
                Some(console) if console.paused => CONSOLE_RETRY_MS.min(until_tick),
                _ => until_tick,
            };
            let ready = match self.epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(EventLoopError::Wait(e)),
            };
            self.resume_console_input();
            for event in &events[..ready] {
                if let Some(reason) = self.dispatch(event.data() as usize) {
                    return Ok(reason);
                }
            }
        }
    }

    fn dispatch(&mut self, token: usize) -> Option<ExitReason> {
        match self.sources.get(token)? {
            Source::Exit => {
                let _ = self.exit.event().read();
                self.exit.reason()
            }
            Source::StopSignal => {
                let _ = self.stop_signal.read();
                Some(ExitReason::Signal(STOP_SIGNAL.load(Ordering::SeqCst)))
            }
            Source::ConsoleInput => {
                self.forward_console_input();
                None
            }
            Source::Queue {
                transport,
                queue,
                event,
            } => {
                let _ = event.read();
                let progress = transport
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .notify_queue(*queue);
                // Served again after the other events that are ready: the guest
                // cannot keep this thread from a stop or a vCPU's exit.
                if progress == QueueProgress::MoreAvailable {
                    if let Err(e) = event.write(1) {
                        tracing::error!("cannot requeue the notification of queue {queue}: {e}");
                    }
                }
                None
            }
        }
    }

    fn forward_console_input(&mut self) {
        let Some(console) = &mut self.console else {
            return;
        };
        let input = console.input;
        let serial = console_if_free(&console.serial);
        let room = serial.as_ref().map_or(0, |serial| serial.input_capacity());
        let Some(mut serial) = serial.filter(|_| room > 0) else {
            console.paused = true;
            self.unwatch(input);
            return;
        };
        let mut buf = vec![0u8; room];
        // SAFETY: `buf` is a live, writable buffer of `room` bytes; read(2) writes at
        // most that many. Raw read(2) rather than std's Stdin, whose buffering would
        // hide pending input from epoll.
        let n = unsafe { libc::read(input, buf.as_mut_ptr().cast(), room) };
        let read = usize::try_from(n).map_err(|_| std::io::Error::last_os_error());
        match read {
            Ok(n) if n > 0 => {
                serial.enqueue_input(&buf[..n]);
            }
            // Interrupted, or a stdin shared with another reader (non-blocking) that
            // took the bytes first: nothing now, more later.
            Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock) => {}
            // The end of the input, or an input that fails.
            _ => {
                drop(serial);
                self.unwatch(input);
                self.console = None;
            }
        }
    }

    fn resume_console_input(&mut self) {
        let Some(console) = &self.console else {
            return;
        };
        if !console.paused {
            return;
        }
        let has_room =
            console_if_free(&console.serial).is_some_and(|serial| serial.input_capacity() > 0);
        if has_room {
            let (input, token) = (console.input, console.token);
            if let Err(e) = self.add_to_epoll(input, token) {
                tracing::warn!("cannot resume console input: {e}");
                self.console = None;
            } else if let Some(console) = &mut self.console {
                console.paused = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queue that has more for the first `more_for` calls, then ends the VM.
    struct RefillingQueue {
        calls: Arc<Mutex<usize>>,
        more_for: usize,
        exit: Arc<ExitNotifier>,
    }

    impl QueueTarget for RefillingQueue {
        fn notify_queue(&mut self, _queue: u32) -> QueueProgress {
            let mut calls = self.calls.lock().unwrap();
            *calls += 1;
            if *calls <= self.more_for {
                return QueueProgress::MoreAvailable;
            }
            self.exit.notify(ExitReason::GuestShutdown);
            QueueProgress::Done
        }
    }

    /// A vCPU holding the console (blocked writing the guest's output to a stdout
    /// nobody reads) does not hold up the loop: console input waits, unread, until
    /// the console is free again, then reaches the guest.
    #[test]
    fn console_input_waits_for_a_console_a_vcpu_holds() {
        use std::io::Write;
        use std::os::unix::net::UnixStream;
        let exit = Arc::new(ExitNotifier::new().unwrap());
        let mut event_loop = EventLoop::new(exit).unwrap();
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        let serial = Arc::new(Mutex::new(SerialConsole::new(
            crate::devices::legacy::EventFdTrigger::new(irq),
            Box::new(std::io::sink()),
        )));
        let empty = serial.lock().unwrap().input_capacity();
        let (mut host, input) = UnixStream::pair().unwrap();
        event_loop
            .add_console_input_from(input.as_raw_fd(), serial.clone())
            .unwrap();
        host.write_all(b"ab").unwrap();

        let (release, released) = std::sync::mpsc::channel::<()>();
        let (holding, held) = std::sync::mpsc::channel();
        let vcpu = {
            let serial = serial.clone();
            std::thread::spawn(move || {
                let _writing = serial.lock().unwrap();
                holding.send(()).unwrap();
                // Long enough to tell a loop that waited from one that did not.
                let _ = released.recv_timeout(Duration::from_secs(10));
            })
        };
        held.recv().unwrap();
        let started = Instant::now();
        event_loop.forward_console_input();
        let waited = started.elapsed();
        release.send(()).unwrap();
        vcpu.join().unwrap();
        assert!(
            waited < Duration::from_secs(5),
            "the loop waited {waited:?} for the console"
        );
        assert!(event_loop.console.as_ref().unwrap().paused);

        event_loop.resume_console_input();
        assert!(!event_loop.console.as_ref().unwrap().paused);
        event_loop.forward_console_input();
        assert_eq!(
            serial.lock().unwrap().input_capacity(),
            empty - 2,
            "the input arrived"
        );
    }

    /// A queue left with chains is served again without a new notification (and
    /// between its calls the loop sees its other events).
    #[test]
    fn a_queue_with_more_is_served_again_without_a_notification() {
        let exit = Arc::new(ExitNotifier::new().unwrap());
        let mut event_loop = EventLoop::new(exit.clone()).unwrap();
        let calls = Arc::new(Mutex::new(0));
        let target = RefillingQueue {
            calls: calls.clone(),
            more_for: 3,
            exit: exit.clone(),
        };
        let event = EventFd::new(EFD_NONBLOCK).unwrap();
        event.write(1).unwrap();
        event_loop
            .add_queue(Arc::new(Mutex::new(target)), 0, event)
            .unwrap();
        // Should the queue not be served again, the first tick ends the wait.
        let mut on_tick = || exit.notify(ExitReason::Fatal("the queue was left".into()));
        let reason = event_loop.run(&mut on_tick).unwrap();
        assert!(matches!(reason, ExitReason::GuestShutdown), "{reason:?}");
        assert_eq!(*calls.lock().unwrap(), 4);
    }
}
