use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use vm_superio::serial::NoEvents;
use vm_superio::Serial;

use super::EventFdTrigger;
use crate::devices::bus::BusDevice;

/// The guest's ttyS0: a vm-superio 8250 whose output goes to the VMM's stdout (or any
/// writer) and whose interrupt is an irqfd on IRQ 4. Without that interrupt the
/// guest's 8250 driver polls THRE (transmitter empty) for every character it sends.
pub struct SerialConsole {
    uart: Serial<EventFdTrigger, NoEvents, Box<dyn Write + Send>>,
}

impl SerialConsole {
    pub fn new(interrupt: EventFdTrigger, output: Box<dyn Write + Send>) -> Self {
        Self {
            uart: Serial::new(interrupt, output),
        }
    }

    /// Room left in the receive FIFO.
    pub fn input_capacity(&self) -> usize {
        self.uart.fifo_capacity()
    }

    /// Queues host input for the guest; returns how many bytes were taken.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        let room = self.uart.fifo_capacity().min(bytes.len());
        match self.uart.enqueue_raw_bytes(&bytes[..room]) {
            Ok(taken) => taken,
            Err(e) => {
                tracing::warn!("serial console: cannot queue input: {e:?}");
                0
            }
        }
    }
}

impl BusDevice for SerialConsole {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let ([byte], Ok(offset)) = (data, u8::try_from(offset)) {
            *byte = self.uart.read(offset);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let ([byte], Ok(offset)) = (data, u8::try_from(offset)) {
            if let Err(e) = self.uart.write(offset, *byte) {
                guest_log::guest_warn!("serial console: {e:?}");
            }
        }
    }
}

/// The console's output as the VM stops: a vCPU blocked writing the guest's output to
/// a stdout nobody reads (a foreground `vmctl boot` piped into a program that stopped
/// reading) is kicked out of write(2) with EINTR, and must then let go of it, or the
/// VM could never stop. Until the VM stops, a full output holds the guest back, and
/// nothing is lost; once it stops, what is left of a write interrupted so is dropped.
pub struct StoppableOutput {
    inner: Box<dyn Write + Send>,
    stopping: Arc<AtomicBool>,
}

impl StoppableOutput {
    /// `stopping` is the flag the VMM sets before it kicks the vCPUs to stop them.
    pub fn new(inner: Box<dyn Write + Send>, stopping: Arc<AtomicBool>) -> Self {
        Self { inner, stopping }
    }
}

impl Write for StoppableOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        loop {
            match self.inner.write(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {
                    if self.stopping.load(Ordering::Acquire) {
                        return Ok(buf.len());
                    }
                }
                done => return done,
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use vmm_sys_util::eventfd::EventFd;

    #[derive(Clone, Default)]
    struct SharedBuf(Arc<Mutex<Vec<u8>>>);
    impl Write for SharedBuf {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn transmitted_bytes_reach_the_output() {
        let out = SharedBuf::default();
        let irq = EventFd::new(0).unwrap();
        let mut serial = SerialConsole::new(
            EventFdTrigger::new(irq.try_clone().unwrap()),
            Box::new(out.clone()),
        );
        for b in b"hi" {
            serial.write(0, &[*b]);
        }
        assert_eq!(&*out.0.lock().unwrap(), b"hi");
    }

    #[test]
    fn odd_widths_and_offsets_are_ignored() {
        let irq = EventFd::new(0).unwrap();
        let mut serial = SerialConsole::new(EventFdTrigger::new(irq), Box::new(std::io::sink()));
        let mut wide = [0xaa_u8; 4];
        serial.read(0, &mut wide);
        assert_eq!(wide, [0xaa; 4]);
        serial.write(u64::MAX, &[1]);
        serial.write(0, &[]);
    }

    #[test]
    fn input_is_limited_by_the_fifo() {
        let irq = EventFd::new(0).unwrap();
        let mut serial = SerialConsole::new(EventFdTrigger::new(irq), Box::new(std::io::sink()));
        let capacity = serial.input_capacity();
        assert_eq!(serial.enqueue_input(&vec![b'x'; capacity + 10]), capacity);
        assert_eq!(serial.enqueue_input(b"more"), 0);
    }

    /// A write blocked on a full pipe nobody reads is interrupted by the vCPU's kick:
    /// before the VM stops it goes on waiting (nothing is lost), once it stops it gives
    /// up.
    #[test]
    fn a_write_blocked_on_a_full_output_ends_when_the_vm_stops() {
        use std::os::fd::AsRawFd;
        use vmm_sys_util::signal::Killable;
        crate::vstate::vcpu::install_kick_handler().unwrap();
        let (reader, writer) = std::io::pipe().unwrap();
        // SAFETY: F_GETPIPE_SZ only reads the size of this open pipe.
        let capacity = unsafe { libc::fcntl(writer.as_raw_fd(), libc::F_GETPIPE_SZ) };
        assert!(capacity > 0);
        let stopping = Arc::new(AtomicBool::new(false));
        let mut output = StoppableOutput::new(Box::new(writer), stopping.clone());
        let (wrote, told) = std::sync::mpsc::channel();
        let writing = std::thread::spawn(move || {
            let full = vec![b'x'; capacity as usize + 1];
            let result = output.write_all(&full).map(|()| full.len());
            let _ = wrote.send(());
            result
        });
        let kick = || {
            writing
                .kill(crate::vstate::vcpu::kick_signal())
                .expect("kicking the writer")
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        kick();
        assert!(
            told.recv_timeout(std::time::Duration::from_millis(300))
                .is_err(),
            "a kick before the stop ended the write"
        );
        stopping.store(true, Ordering::Release);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while told.try_recv().is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "the write never ended"
            );
            kick();
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let written = writing.join().unwrap().unwrap();
        assert_eq!(written, capacity as usize + 1);
        drop(reader);
    }
}
