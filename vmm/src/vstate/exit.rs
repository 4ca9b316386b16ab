//! How a VM run ends, reported from whichever thread saw it first.

use std::sync::Mutex;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Why the VM stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest rebooted or powered off (i8042 reset, triple fault, system event).
    GuestShutdown,
    /// The VMM was asked to stop (SIGINT, SIGTERM).
    Signal(i32),
    /// A vCPU hit something the VMM cannot continue from.
    Fatal(String),
}

/// The first exit reason wins; its eventfd wakes the event loop.
pub struct ExitNotifier {
    reason: Mutex<Option<ExitReason>>,
    event: EventFd,
}

impl ExitNotifier {
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            reason: Mutex::new(None),
            event: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    pub fn notify(&self, reason: ExitReason) {
        let mut slot = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(reason);
        }
        if let Err(e) = self.event.write(1) {
            tracing::error!("cannot wake the event loop to stop the VM: {e}");
        }
    }

    pub fn reason(&self) -> Option<ExitReason> {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn event(&self) -> &EventFd {
        &self.event
    }
}

/// What the i8042 pulls when the guest asks for a CPU reset: the guest is done.
pub struct GuestResetTrigger(pub std::sync::Arc<ExitNotifier>);

impl vm_superio::Trigger for GuestResetTrigger {
    type E = std::convert::Infallible;

    fn trigger(&self) -> Result<(), Self::E> {
        tracing::info!("guest requested a reset through the i8042");
        self.0.notify(ExitReason::GuestShutdown);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_reason_wins() {
        let exit = ExitNotifier::new().unwrap();
        assert_eq!(exit.reason(), None);
        exit.notify(ExitReason::GuestShutdown);
        exit.notify(ExitReason::Signal(15));
        assert_eq!(exit.reason(), Some(ExitReason::GuestShutdown));
        assert_eq!(exit.event().read().unwrap(), 2);
    }
}
