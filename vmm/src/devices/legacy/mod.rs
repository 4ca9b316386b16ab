//! Legacy port-I/O devices: the 8250 serial console, the i8042 controller (only for
//! its CPU-reset command, which is how a `reboot=k` guest asks to stop) and the boot
//! timer.

mod boot_timer;
mod i8042;
mod serial;

pub use boot_timer::{BootTimeReport, BootTimer};
pub use i8042::ResetController;
pub use serial::SerialConsole;

use vm_superio::Trigger;
use vmm_sys_util::eventfd::EventFd;

/// A vm-superio trigger that signals an eventfd (an irqfd or the VM's reset event).
pub struct EventFdTrigger(EventFd);

impl EventFdTrigger {
    pub fn new(event: EventFd) -> Self {
        Self(event)
    }
}

impl Trigger for EventFdTrigger {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}
