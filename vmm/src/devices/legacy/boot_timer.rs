use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::arch::x86_64::layout::BOOT_TIMER_MAGIC;
use crate::devices::bus::BusDevice;

/// How long the guest took to reach its init, as signalled by the boot timer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BootTimeReport {
    /// Since the VMM process started.
    pub since_vmm_start: Duration,
    /// Since the boot vCPU first entered the guest.
    pub since_first_vcpu_run: Duration,
}

/// Firecracker's boot timer: the guest's init writes `BOOT_TIMER_MAGIC` to a magic
/// port, and the VMM reports the time since it started. Only the first write counts.
pub struct BootTimer {
    vmm_start: Instant,
    first_vcpu_run: Arc<OnceLock<Instant>>,
    reporter: Option<Box<dyn FnOnce(BootTimeReport) + Send>>,
}

impl BootTimer {
    /// `first_vcpu_run` is set by the boot vCPU just before its first KVM_RUN.
    pub fn new(
        vmm_start: Instant,
        first_vcpu_run: Arc<OnceLock<Instant>>,
        reporter: Box<dyn FnOnce(BootTimeReport) + Send>,
    ) -> Self {
        Self {
            vmm_start,
            first_vcpu_run,
            reporter: Some(reporter),
        }
    }
}

impl BusDevice for BootTimer {
    fn read(&mut self, _offset: u64, _data: &mut [u8]) {}

    fn write(&mut self, _offset: u64, data: &[u8]) {
        if data.first() != Some(&BOOT_TIMER_MAGIC) {
            return;
        }
        let now = Instant::now();
        let vcpu_start = self.first_vcpu_run.get().copied().unwrap_or(self.vmm_start);
        if let Some(report) = self.reporter.take() {
            report(BootTimeReport {
                since_vmm_start: now.duration_since(self.vmm_start),
                since_first_vcpu_run: now.duration_since(vcpu_start),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn reports_once_on_the_magic_value() {
        let reports = Arc::new(Mutex::new(Vec::new()));
        let sink = reports.clone();
        let start = Instant::now();
        let first_run = Arc::new(OnceLock::new());
        let mut timer = BootTimer::new(
            start,
            first_run.clone(),
            Box::new(move |r| sink.lock().unwrap().push(r)),
        );
        first_run.set(start + Duration::from_millis(1)).unwrap();
        timer.write(0, &[BOOT_TIMER_MAGIC - 1]);
        assert!(reports.lock().unwrap().is_empty());
        timer.write(0, &[BOOT_TIMER_MAGIC]);
        timer.write(0, &[BOOT_TIMER_MAGIC]);
        let reports = reports.lock().unwrap();
        assert_eq!(reports.len(), 1);
        assert!(reports[0].since_vmm_start >= reports[0].since_first_vcpu_run);
    }
}
