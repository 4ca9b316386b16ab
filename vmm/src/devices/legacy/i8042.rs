use vm_superio::{I8042Device, Trigger};

use crate::devices::bus::BusDevice;

/// The i8042 keyboard controller at ports 0x60-0x64, reduced to what a guest booted
/// with `reboot=k` needs: the CPU-reset command, which signals the VM's reset event.
pub struct ResetController<T: Trigger> {
    controller: I8042Device<T>,
}

impl<T: Trigger> ResetController<T> {
    pub fn new(reset: T) -> Self {
        Self {
            controller: I8042Device::new(reset),
        }
    }
}

impl<T: Trigger + Send> BusDevice for ResetController<T> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let ([byte], Ok(offset)) = (data, u8::try_from(offset)) {
            *byte = self.controller.read(offset);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let ([byte], Ok(offset)) = (data, u8::try_from(offset)) {
            if let Err(e) = self.controller.write(offset, *byte) {
                tracing::error!("i8042: cannot signal the reset event: {e:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::legacy::EventFdTrigger;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    #[test]
    fn reset_command_signals_the_reset_event() {
        let reset = EventFd::new(EFD_NONBLOCK).unwrap();
        let mut i8042 = ResetController::new(EventFdTrigger::new(reset.try_clone().unwrap()));
        i8042.write(0, &[0xfe]);
        assert!(reset.read().is_err(), "a data-port write is not a reset");
        i8042.write(4, &[0xfe]);
        assert_eq!(reset.read().unwrap(), 1);
    }
}
