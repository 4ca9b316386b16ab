//! The guest's console output on its way to the VMM's stdout (under vmctl, the VM's
//! `console.log`), from both of its consoles: the 8250 (a byte per vCPU exit; the
//! kernel's messages) and the virtio console (whole buffers; the guest agent's log).
//!
//! The consoles only queue bytes here; one thread of its own writes them out. So
//! neither a vCPU nor the event loop ever sits in write(2) on an output nobody reads
//! (a foreground `vmctl boot` piped into a program that stopped reading, a terminal
//! paused with Ctrl-S), where a stop could not reach it, and the two consoles' output
//! keeps the order in which the guest wrote it.
//!
//! When [`CAPACITY`] bytes wait, the 8250 holds its vCPU back until there is room (the
//! guest's own flow control: nothing is lost), until the VM stops. The virtio console
//! cannot wait: Linux spins, interrupts off, until its buffer comes back, and the
//! event loop serves every other device. It drops what does not fit, and the output
//! says how much was dropped.

use std::io::Write;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// Most bytes waiting to be written out.
pub const CAPACITY: usize = 1 << 20;
/// How long the writer, woken by new output, lets more come before it writes. The
/// 8250 queues a byte per vCPU exit, and a wake-up of the writer for each cost three
/// times the exit itself in the nested host (23 ms for a 100-byte line, against 12 ms
/// when the vCPU wrote each byte itself); a console line a few ms later costs nobody.
const COLLECT_BURST: Duration = Duration::from_millis(5);

/// What the consoles and the writer thread share.
struct Shared {
    queue: Mutex<Queue>,
    /// Signalled when there is room again, and when the VM stops.
    room: Condvar,
    /// Signalled when there are bytes to write, and when no more will come.
    work: Condvar,
}

#[derive(Default)]
struct Queue {
    bytes: Vec<u8>,
    /// Bytes the virtio console dropped since the writer last took the queue.
    dropped: u64,
    /// The VM is stopping: an 8250 write no longer waits for room.
    stopping: bool,
    /// No more bytes will come: the writer ends once the queue is empty.
    closed: bool,
    /// The writer waits for work (a wake-up is needed).
    writer_idle: bool,
    /// The output failed: what comes is discarded, so that no console waits for ever.
    broken: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A poisoned lock only means a console panicked mid-push: the bytes are plain
        // data, still fit to write.
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wake_writer(&self, queue: &mut Queue) {
        if queue.writer_idle {
            queue.writer_idle = false;
            self.work.notify_one();
        }
    }
}

/// The writer thread's side: made with the VM, writing once the VM runs, finished as
/// it ends. Dropped without [`ConsoleOutput::finish`] (a VM that failed to build), it
/// lets the thread write out what is queued and end, without waiting for it.
pub struct ConsoleOutput {
    shared: Arc<Shared>,
    writer: Writer,
}

enum Writer {
    /// Not started yet: the VMM jails itself while it still has one thread (user
    /// namespaces need that), so the thread starts with the vCPUs.
    NotStarted(Box<dyn Write + Send>),
    Running {
        thread: JoinHandle<()>,
        written_out: Receiver<()>,
    },
    Finished,
}

/// A console's side: cheap to clone, one per console.
#[derive(Clone)]
pub struct ConsoleQueue {
    shared: Arc<Shared>,
}

impl ConsoleOutput {
    /// The output to `sink`, queued until [`Self::start_writing`].
    pub fn new(sink: Box<dyn Write + Send>) -> Self {
        Self {
            shared: Arc::new(Shared {
                queue: Mutex::new(Queue::default()),
                room: Condvar::new(),
                work: Condvar::new(),
            }),
            writer: Writer::NotStarted(sink),
        }
    }

    /// Starts the thread that writes the queued output out (once).
    pub fn start_writing(&mut self) -> std::io::Result<()> {
        let mut sink = match std::mem::replace(&mut self.writer, Writer::Finished) {
            Writer::NotStarted(sink) => sink,
            started => {
                self.writer = started;
                return Ok(());
            }
        };
        let (done, written_out) = std::sync::mpsc::channel();
        let shared = self.shared.clone();
        let thread = std::thread::Builder::new()
            .name("console-out".into())
            .spawn(move || {
                write_out(&shared, &mut sink);
                let _ = done.send(());
            })?;
        self.writer = Writer::Running {
            thread,
            written_out,
        };
        Ok(())
    }

    /// A handle for a console to queue its bytes with.
    pub fn queue(&self) -> ConsoleQueue {
        ConsoleQueue {
            shared: self.shared.clone(),
        }
    }

    /// The VM is stopping: an 8250 write waiting for room gives up, dropping its byte,
    /// so that its vCPU can stop. Bytes that fit are still queued.
    pub fn stop_waiting(&self) {
        let mut queue = self.shared.lock();
        queue.stopping = true;
        self.shared.room.notify_all();
    }

    /// Writes out what is queued, waiting at most `timeout` for an output that is not
    /// read; returns whether all of it was written. The writer thread is left behind
    /// when it is stuck (the process is about to end anyway).
    pub fn finish(mut self, timeout: Duration) -> bool {
        self.close();
        match std::mem::replace(&mut self.writer, Writer::Finished) {
            Writer::NotStarted(mut sink) => {
                write_out(&self.shared, &mut sink);
                true
            }
            Writer::Running {
                thread,
                written_out,
            } => match written_out.recv_timeout(timeout) {
                Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                    if thread.join().is_err() {
                        tracing::error!("the console output thread panicked");
                    }
                    true
                }
                Err(RecvTimeoutError::Timeout) => {
                    let left = self.shared.lock().bytes.len();
                    tracing::warn!(
                        "the guest console's output is not being read: {left} bytes of it not written out"
                    );
                    false
                }
            },
            Writer::Finished => true,
        }
    }

    /// No more bytes will come, and no console waits for room any more.
    fn close(&self) {
        let mut queue = self.shared.lock();
        queue.closed = true;
        queue.stopping = true;
        self.shared.room.notify_all();
        self.shared.work.notify_one();
    }
}

impl Drop for ConsoleOutput {
    fn drop(&mut self) {
        self.close();
        // Never started, no vCPU ran: there is next to nothing to write.
        if let Writer::NotStarted(sink) = &mut self.writer {
            write_out(&self.shared, sink);
        }
    }
}

/// The writer thread: takes what is queued and writes it, until the queue is closed
/// and empty.
fn write_out(shared: &Shared, sink: &mut dyn Write) {
    loop {
        let (bytes, dropped) = {
            let mut queue = shared.lock();
            if queue.bytes.is_empty() && queue.dropped == 0 && !queue.closed {
                while queue.bytes.is_empty() && queue.dropped == 0 && !queue.closed {
                    queue.writer_idle = true;
                    queue = shared
                        .work
                        .wait(queue)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                if !queue.closed {
                    // Woken by the first byte of a burst: let the rest come (without a
                    // wake-up each) and write it in one go.
                    drop(queue);
                    std::thread::sleep(COLLECT_BURST);
                    queue = shared.lock();
                }
            }
            queue.writer_idle = false;
            if queue.bytes.is_empty() && queue.dropped == 0 {
                return;
            }
            let taken = (
                std::mem::take(&mut queue.bytes),
                std::mem::take(&mut queue.dropped),
            );
            shared.room.notify_all();
            taken
        };
        let mut written = sink.write_all(&bytes);
        if dropped > 0 {
            written = written.and_then(|()| {
                writeln!(
                    sink,
                    "\n[vmm: {dropped} bytes of the guest's virtio console output were dropped: this output was not read fast enough]"
                )
            });
        }
        if let Err(e) = written.and_then(|()| sink.flush()) {
            tracing::warn!("cannot write the guest console's output: {e}; the rest is discarded");
            let mut queue = shared.lock();
            queue.broken = true;
            queue.bytes = Vec::new();
            shared.room.notify_all();
        }
    }
}

impl ConsoleQueue {
    /// Queues `bytes`, waiting for room while the queue is full, until the VM stops;
    /// then what does not fit is dropped.
    pub fn queue_waiting(&self, mut bytes: &[u8]) {
        let mut queue = self.shared.lock();
        while !bytes.is_empty() && !queue.broken {
            let room = CAPACITY.saturating_sub(queue.bytes.len());
            if room == 0 {
                if queue.stopping {
                    return;
                }
                queue = self
                    .shared
                    .room
                    .wait(queue)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                continue;
            }
            let (now, later) = bytes.split_at(room.min(bytes.len()));
            queue.bytes.extend_from_slice(now);
            bytes = later;
            self.shared.wake_writer(&mut queue);
        }
    }

    /// Queues what of `bytes` fits and drops the rest (counted, and said in the
    /// output); never waits.
    pub fn queue_or_drop(&self, bytes: &[u8]) {
        let mut queue = self.shared.lock();
        if queue.broken {
            return;
        }
        let room = CAPACITY.saturating_sub(queue.bytes.len());
        let (now, dropped) = bytes.split_at(room.min(bytes.len()));
        queue.bytes.extend_from_slice(now);
        queue.dropped = queue.dropped.saturating_add(dropped.len() as u64);
        self.shared.wake_writer(&mut queue);
    }

    /// The 8250's output: each byte it sends, queued with [`Self::queue_waiting`].
    pub fn serial_output(&self) -> Box<dyn Write + Send> {
        Box::new(WaitingWriter(self.clone()))
    }
}

/// [`ConsoleQueue::queue_waiting`] as a `Write`.
struct WaitingWriter(ConsoleQueue);

impl Write for WaitingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.queue_waiting(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the consoles' tests write to.
#[cfg(test)]
pub(crate) mod testing {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    /// A `Write` that keeps what it is given.
    #[derive(Clone, Default)]
    pub(crate) struct SharedBuf(pub(crate) Arc<Mutex<Vec<u8>>>);

    impl Write for SharedBuf {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    use testing::SharedBuf;

    fn started(sink: Box<dyn Write + Send>) -> std::io::Result<ConsoleOutput> {
        let mut output = ConsoleOutput::new(sink);
        output.start_writing()?;
        Ok(output)
    }

    /// Until the thread starts, the output waits in the queue; a VM that never ran
    /// still writes out what was queued as it ends.
    #[test]
    fn the_output_waits_for_the_writer_and_is_written_out_without_one() {
        let sink = SharedBuf::default();
        let mut output = ConsoleOutput::new(Box::new(sink.clone()));
        output.queue().queue_or_drop(b"early\n");
        std::thread::sleep(Duration::from_millis(50));
        assert!(sink.0.lock().unwrap().is_empty());
        output.start_writing().unwrap();
        output.queue().queue_or_drop(b"late\n");
        assert!(output.finish(Duration::from_secs(10)));
        assert_eq!(&*sink.0.lock().unwrap(), b"early\nlate\n");

        let sink = SharedBuf::default();
        let output = ConsoleOutput::new(Box::new(sink.clone()));
        output.queue().queue_or_drop(b"never ran\n");
        assert!(output.finish(Duration::from_secs(10)));
        assert_eq!(&*sink.0.lock().unwrap(), b"never ran\n");
    }

    /// A pipe whose reader is kept but never read, full once `CAPACITY` and the pipe's
    /// own buffer are.
    fn unread_pipe() -> (std::io::PipeReader, Box<dyn Write + Send>) {
        let (reader, writer) = std::io::pipe().unwrap();
        (reader, Box::new(writer))
    }

    #[test]
    fn both_consoles_output_arrives_in_the_order_written() {
        let sink = SharedBuf::default();
        let output = started(Box::new(sink.clone())).unwrap();
        let mut serial = output.queue().serial_output();
        let virtio = output.queue();
        serial.write_all(b"[kernel] one\n").unwrap();
        virtio.queue_or_drop(b"guest-agent: two\n");
        serial.write_all(b"[kernel] three\n").unwrap();
        assert!(output.finish(Duration::from_secs(10)));
        assert_eq!(
            &*sink.0.lock().unwrap(),
            b"[kernel] one\nguest-agent: two\n[kernel] three\n"
        );
    }

    /// With the output unread: the virtio console never waits, drops what does not
    /// fit; the 8250 waits for room until the VM stops.
    #[test]
    fn an_unread_output_holds_back_the_8250_until_the_stop_and_never_the_virtio_console() {
        let (reader, writer) = unread_pipe();
        let output = started(writer).unwrap();
        let virtio = output.queue();
        let started = Instant::now();
        virtio.queue_or_drop(&vec![b'v'; CAPACITY]);
        // The writer takes that and is stuck writing it into the pipe's smaller buffer;
        // the queue then fills up, and the rest is dropped.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !output.shared.lock().bytes.is_empty() {
            assert!(Instant::now() < deadline, "the writer never took its bytes");
            std::thread::sleep(Duration::from_millis(1));
        }
        for _ in 0..3 {
            virtio.queue_or_drop(&vec![b'v'; CAPACITY]);
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the virtio console waited"
        );
        assert_eq!(output.shared.lock().dropped, 2 * CAPACITY as u64);

        let serial = output.queue();
        let (wrote, told) = std::sync::mpsc::channel();
        let writing = std::thread::spawn(move || {
            serial.serial_output().write_all(b"x").unwrap();
            let _ = wrote.send(());
        });
        assert!(
            told.recv_timeout(Duration::from_millis(300)).is_err(),
            "an 8250 write went past a full queue"
        );
        output.stop_waiting();
        told.recv_timeout(Duration::from_secs(10))
            .expect("the 8250 write still waits after the stop");
        writing.join().unwrap();
        assert!(
            !output.finish(Duration::from_millis(100)),
            "the unread output was all written out"
        );
        drop(reader);
    }

    /// A sink whose writes wait until it is opened.
    #[derive(Clone, Default)]
    struct Gate {
        open: Arc<(Mutex<bool>, Condvar)>,
        entered: Arc<std::sync::atomic::AtomicBool>,
        out: SharedBuf,
    }
    impl Write for Gate {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.entered
                .store(true, std::sync::atomic::Ordering::Release);
            let (open, opened) = &*self.open;
            let mut open = open.lock().unwrap();
            while !*open {
                open = opened.wait(open).unwrap();
            }
            self.out.write(buf)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn dropped_bytes_are_said_in_the_output() {
        let gate = Gate::default();
        let output = started(Box::new(gate.clone())).unwrap();
        let virtio = output.queue();
        virtio.queue_or_drop(b"first\n");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !gate.entered.load(std::sync::atomic::Ordering::Acquire) {
            assert!(Instant::now() < deadline, "the writer never wrote");
            std::thread::sleep(Duration::from_millis(1));
        }
        // The writer holds "first"; the queue fills up exactly, and the next 10 bytes
        // do not fit.
        virtio.queue_or_drop(&vec![b'a'; CAPACITY]);
        virtio.queue_or_drop(b"0123456789");
        *gate.open.0.lock().unwrap() = true;
        gate.open.1.notify_all();
        assert!(output.finish(Duration::from_secs(10)));
        let mut expected = b"first\n".to_vec();
        expected.extend(vec![b'a'; CAPACITY]);
        expected.extend(
            b"\n[vmm: 10 bytes of the guest's virtio console output were dropped: \
              this output was not read fast enough]\n",
        );
        let text = gate.out.0.lock().unwrap().clone();
        assert!(
            text == expected,
            "{}",
            String::from_utf8_lossy(&text[text.len().saturating_sub(200)..])
        );
    }

    #[test]
    fn a_dropped_output_still_writes_out_what_was_queued() {
        let sink = SharedBuf::default();
        let output = started(Box::new(sink.clone())).unwrap();
        output.queue().queue_or_drop(b"last words\n");
        drop(output);
        let deadline = Instant::now() + Duration::from_secs(10);
        while sink.0.lock().unwrap().as_slice() != b"last words\n" {
            assert!(Instant::now() < deadline, "never written out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_failed_output_discards_and_never_holds_a_console() {
        struct Failing;
        impl Write for Failing {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let output = started(Box::new(Failing)).unwrap();
        let mut serial = output.queue().serial_output();
        let started = Instant::now();
        for _ in 0..3 {
            serial.write_all(&vec![b's'; CAPACITY]).unwrap();
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(output.finish(Duration::from_secs(10)));
    }
}
