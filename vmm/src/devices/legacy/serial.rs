use std::io::Write;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::console_output::testing::SharedBuf;
    use vmm_sys_util::eventfd::EventFd;

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
}
