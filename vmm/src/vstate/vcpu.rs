//! vCPUs: boot-time register state and the run loop, one thread each.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_regs, kvm_sregs};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vm_memory::GuestAddress;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use super::exit::{ExitNotifier, ExitReason};
use crate::arch::x86_64::{cpuid, interrupts, msr, regs};
use crate::devices::bus::Bus;
use crate::memory::GuestMemoryMmap;

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("cannot create vCPU {index}: {source}")]
    Create {
        index: u8,
        source: kvm_ioctls::Error,
    },
    #[error("cannot configure vCPU {index}: {reason}")]
    Configure { index: u8, reason: String },
    #[error("cannot start the thread of vCPU {index}: {source}")]
    Spawn { index: u8, source: std::io::Error },
    #[error("cannot install the vCPU kick signal handler: {0}")]
    KickSignal(vmm_sys_util::errno::Error),
}

/// The signal that interrupts a vCPU thread's KVM_RUN so it sees the stop request.
fn kick_signal() -> i32 {
    SIGRTMIN()
}

extern "C" fn ignore_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the (empty) handler of the kick signal: its only job is to make KVM_RUN
/// return EINTR.
pub fn install_kick_handler() -> Result<(), VcpuError> {
    register_signal_handler(kick_signal(), ignore_kick).map_err(VcpuError::KickSignal)
}

/// What a vCPU thread shares with the rest of the VMM.
#[derive(Clone)]
pub struct VcpuContext {
    pub pio_bus: Arc<Bus>,
    pub mmio_bus: Arc<Bus>,
    pub exit: Arc<ExitNotifier>,
    pub stop: Arc<AtomicBool>,
    /// Set by the boot vCPU just before its first KVM_RUN (for the boot timer).
    pub first_run: Arc<OnceLock<Instant>>,
}

pub struct Vcpu {
    fd: VcpuFd,
    index: u8,
    unexpected_exits: UnexpectedExits,
}

impl Vcpu {
    pub fn new(vm: &VmFd, index: u8) -> Result<Self, VcpuError> {
        let fd = vm
            .create_vcpu(u64::from(index))
            .map_err(|source| VcpuError::Create { index, source })?;
        Ok(Self {
            fd,
            index,
            unexpected_exits: UnexpectedExits::default(),
        })
    }

    /// Sets CPUID, MSRs, LAPIC LINT pins and the 64-bit boot registers. Every vCPU
    /// gets the same registers; the application processors are then held by KVM until
    /// the guest's INIT/SIPI, which resets them.
    pub fn configure(
        &self,
        kvm: &Kvm,
        memory: &GuestMemoryMmap,
        entry: GuestAddress,
        vcpu_count: u8,
    ) -> Result<(), VcpuError> {
        let index = self.index;
        let fail = |reason: String| VcpuError::Configure { index, reason };
        cpuid::setup_cpuid(kvm, &self.fd, index, vcpu_count).map_err(|e| fail(e.to_string()))?;
        msr::setup_msrs(&self.fd).map_err(|e| fail(e.to_string()))?;
        regs::setup_regs(&self.fd, entry.0).map_err(|e| fail(e.to_string()))?;
        regs::setup_fpu(&self.fd).map_err(|e| fail(e.to_string()))?;
        regs::setup_sregs(memory, &self.fd).map_err(|e| fail(e.to_string()))?;
        interrupts::set_lint(&self.fd).map_err(|e| fail(e.to_string()))?;
        Ok(())
    }

    /// Starts the run loop on its own thread.
    pub fn start(self, context: VcpuContext) -> Result<VcpuHandle, VcpuError> {
        let index = self.index;
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || self.run(&context))
            .map_err(|source| VcpuError::Spawn { index, source })?;
        Ok(VcpuHandle { index, thread })
    }

    fn run(mut self, context: &VcpuContext) {
        if self.index == 0 {
            let _ = context.first_run.set(Instant::now());
        }
        while !context.stop.load(Ordering::Acquire) {
            let index = self.index;
            let ran = self.run_once(context);
            match ran.and_then(|unexpected| self.unexpected_exits.count(index, unexpected)) {
                Ok(()) => {}
                Err(reason) => {
                    context.exit.notify(reason);
                    return;
                }
            }
        }
    }

    /// The registers that say where a crashed guest was, for the error message.
    fn crash_state(&self) -> String {
        match (self.fd.get_regs(), self.fd.get_sregs()) {
            (Ok(regs), Ok(sregs)) => describe_crash_registers(&regs, &sregs),
            (Err(e), _) | (_, Err(e)) => format!("registers unavailable: {e}"),
        }
    }

    /// Runs the guest until its next exit and handles it: `Ok(Some(exit))` for one
    /// it has no handling for, `Err` to end the VM.
    fn run_once(&mut self, context: &VcpuContext) -> Result<Option<String>, ExitReason> {
        let index = self.index;
        let exit = self.fd.run();
        tracing::trace!("vcpu{index}: exit {exit:?}");
        match exit {
            Ok(VcpuExit::IoIn(port, data)) => {
                let (at, len) = (data.as_mut_ptr(), data.len());
                let element_size = self.port_io_element_size();
                // SAFETY: `at..at + len` is the port I/O data area kvm-ioctls handed out
                // for this exit: it lies in the vCPU's kvm_run mapping, which lives as
                // long as `self.fd`, past the kvm_run struct (2,352 bytes) that
                // `port_io_element_size` borrowed (KVM puts it at `data_offset`, a page
                // in), and nothing else refers to it until the next KVM_RUN.
                let data = unsafe { std::slice::from_raw_parts_mut(at, len) };
                port_in(&context.pio_bus, port, data, element_size);
                Ok(None)
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                let (at, len) = (data.as_ptr(), data.len());
                let element_size = self.port_io_element_size();
                // SAFETY: as for IoIn above; the area is only read.
                let data = unsafe { std::slice::from_raw_parts(at, len) };
                if !port_out(&context.pio_bus, port, data, element_size) {
                    tracing::trace!("vcpu{index}: write to unclaimed port {port:#x}");
                }
                Ok(None)
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                data.fill(0xff);
                if !context.mmio_bus.read(addr, data) {
                    tracing::debug!("vcpu{index}: read from unclaimed MMIO address {addr:#x}");
                }
                Ok(None)
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                if !context.mmio_bus.write(addr, data) {
                    tracing::debug!("vcpu{index}: write to unclaimed MMIO address {addr:#x}");
                }
                Ok(None)
            }
            Ok(VcpuExit::Shutdown) => {
                // Our guests reboot through the i8042 (reboot=k); a shutdown exit is a
                // triple fault: the guest crashed.
                let state = self.crash_state();
                tracing::error!("vcpu{index}: the guest crashed (triple fault): {state}");
                Err(ExitReason::Fatal(format!(
                    "the guest crashed (triple fault on vCPU {index}: {state})"
                )))
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                tracing::info!("vcpu{index}: guest system event {kind}");
                Err(system_event_exit(index, kind))
            }
            Ok(VcpuExit::Hlt) => {
                // Only reachable without an in-kernel LAPIC; nothing to do but wait.
                std::thread::sleep(Duration::from_millis(1));
                Ok(None)
            }
            Ok(VcpuExit::FailEntry(reason, cpu)) => Err(ExitReason::Fatal(format!(
                "vCPU {index}: KVM could not enter the guest (hardware reason {reason:#x}, cpu {cpu})"
            ))),
            Ok(VcpuExit::InternalError) => {
                // SAFETY: after a KVM_EXIT_INTERNAL_ERROR exit, `internal` is the union
                // member KVM filled in; suberror is a plain u32.
                let suberror = unsafe { self.fd.get_kvm_run().__bindgen_anon_1.internal.suberror };
                Err(ExitReason::Fatal(internal_error_message(index, suberror)))
            }
            Ok(other) => Ok(Some(format!("{other:?}"))),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                if index == 0 && !context.stop.load(Ordering::Acquire) && self.is_powered_off() {
                    tracing::info!("vcpu0: guest halted with interrupts off (power-off)");
                    return Err(ExitReason::GuestShutdown);
                }
                Ok(None)
            }
            Err(e) => Err(ExitReason::Fatal(format!("vCPU {index}: KVM_RUN failed: {e}"))),
        }
    }
}

/// The exits in a row that the run loop has no handling for. Going on past one is
/// right for an exit that comes once (nothing asked KVM for those, but a host's KVM
/// may still send one); one that KVM sends again at each entry would have the vCPU
/// spin, its guest stuck and nobody told, so after [`UnexpectedExits::LIMIT`] in a row
/// the VM ends, saying which.
#[derive(Debug, Default)]
struct UnexpectedExits {
    in_a_row: u32,
}

impl UnexpectedExits {
    const LIMIT: u32 = 64;

    /// Counts vCPU `index`'s exit: `unexpected` names one the run loop has no handling
    /// for, None is any other, which ends a run of them. `Err` ends the VM.
    fn count(&mut self, index: u8, unexpected: Option<String>) -> Result<(), ExitReason> {
        let Some(what) = unexpected else {
            self.in_a_row = 0;
            return Ok(());
        };
        self.in_a_row += 1;
        if self.in_a_row >= Self::LIMIT {
            return Err(ExitReason::Fatal(format!(
                "vCPU {index}: KVM exited with {what}, which this VMM does not handle, {} \
                 times in a row",
                self.in_a_row
            )));
        }
        guest_log::guest_warn!("vcpu{index}: unexpected exit {what}; continuing");
        Ok(())
    }
}

/// An `in` exit on `port`: `data` holds `data.len() / element_size` elements (more
/// than one for `rep ins*`), each read from the device in turn, as the CPU would. An
/// element no device answers reads as all-ones, like an open bus.
fn port_in(bus: &Bus, port: u16, data: &mut [u8], element_size: usize) {
    for element in data.chunks_mut(element_size.max(1)) {
        element.fill(0xff);
        bus.read(u64::from(port), element);
    }
}

/// An `out` exit on `port`: each of the elements in `data` (more than one for
/// `rep outs*`) written to the device in turn. Returns whether a device took them.
fn port_out(bus: &Bus, port: u16, data: &[u8], element_size: usize) -> bool {
    let mut claimed = true;
    for element in data.chunks(element_size.max(1)) {
        claimed &= bus.write(u64::from(port), element);
    }
    claimed
}

/// What a KVM_EXIT_SYSTEM_EVENT of `kind` ends the VM with: the guest's own report of
/// a crash (pvpanic-style, through a hypervisor interface) is a crash, anything else
/// (a shutdown, a reset: our guests reboot to exit) an orderly end.
fn system_event_exit(index: u8, kind: u32) -> ExitReason {
    if kind == kvm_bindings::KVM_SYSTEM_EVENT_CRASH {
        ExitReason::Fatal(format!(
            "the guest reported a crash (system event on vCPU {index})"
        ))
    } else {
        ExitReason::GuestShutdown
    }
}

/// Why vCPU `index` stopped with KVM's internal error `suberror`. An emulation failure
/// may be this host's KVM (PVM cannot run every guest) or the guest itself (an access
/// KVM cannot emulate, such as a vector instruction on a device's registers).
fn internal_error_message(index: u8, suberror: u32) -> String {
    let what = if suberror == kvm_bindings::KVM_INTERNAL_ERROR_EMULATION {
        "an instruction KVM could not emulate"
    } else {
        "see KVM_INTERNAL_ERROR_* in linux/kvm.h"
    };
    format!(
        "vCPU {index}: KVM internal error (suberror {suberror}: {what}); either the guest did \
         something KVM cannot handle, or this host's KVM cannot run a standard Linux guest (if \
         other guests fail the same way, try --nested always)"
    )
}

/// Where a vCPU was when it triple-faulted, or why that is unknown. On AMD, KVM
/// answers the shutdown intercept by INIT-ing the vCPU (the VMCB is undefined after
/// one), so what it reports then is a CPU at the reset vector, where our guests never
/// run otherwise: the boot vCPU starts in long mode, and the others start in real mode
/// at their SIPI vector, below 1 MiB.
fn describe_crash_registers(regs: &kvm_regs, sregs: &kvm_sregs) -> String {
    use crate::arch::x86_64::regs::X86_CR0_PE;
    const RESET_CS_BASE: u64 = 0xffff_0000;
    const RESET_RIP: u64 = 0xfff0;
    if sregs.cr0 & X86_CR0_PE == 0 && sregs.cs.base == RESET_CS_BASE && regs.rip == RESET_RIP {
        return "its registers are lost: KVM on AMD resets a vCPU that triple-faults".to_string();
    }
    format!(
        "rip {:#x} rsp {:#x} cr0 {:#x} cr2 {:#x} cr3 {:#x} cr4 {:#x} efer {:#x} idt {:#x}+{:#x}",
        regs.rip,
        regs.rsp,
        sregs.cr0,
        sregs.cr2,
        sregs.cr3,
        sregs.cr4,
        sregs.efer,
        sregs.idt.base,
        sregs.idt.limit
    )
}

impl Vcpu {
    /// The size of each element of the port I/O exit being handled: kvm-ioctls hands
    /// out the data of all of them as one slice (`size * count` bytes) and drops the
    /// size, which a string instruction (`rep outsb`, `rep insw`) needs to be split by.
    fn port_io_element_size(&mut self) -> usize {
        // SAFETY: only called while handling a KVM_EXIT_IO exit, after which `io` is
        // the union member KVM filled in; it holds plain integers.
        let io = unsafe { self.fd.get_kvm_run().__bindgen_anon_1.io };
        usize::from(io.size)
    }

    /// Without ACPI, a guest's power-off ends with its boot CPU halted and interrupts
    /// disabled, which nothing but an NMI can wake: with an in-kernel LAPIC that halt
    /// never reaches us as an exit, so the event loop kicks the boot vCPU now and then
    /// and it looks at its own state.
    fn is_powered_off(&self) -> bool {
        const RFLAGS_IF: u64 = 1 << 9;
        let halted = self
            .fd
            .get_mp_state()
            .is_ok_and(|state| state.mp_state == kvm_bindings::KVM_MP_STATE_HALTED);
        halted
            && self
                .fd
                .get_regs()
                .is_ok_and(|regs| regs.rflags & RFLAGS_IF == 0)
    }
}

/// A running vCPU thread.
pub struct VcpuHandle {
    index: u8,
    thread: JoinHandle<()>,
}

impl VcpuHandle {
    /// Interrupts the vCPU's KVM_RUN once (see `Vcpu::is_powered_off`).
    pub fn kick(&self) {
        if let Err(e) = self.thread.kill(kick_signal()) {
            tracing::warn!("cannot kick vcpu{}: {e}", self.index);
        }
    }

    /// Kicks the thread out of KVM_RUN until it notices `stop` (which the caller has
    /// set) and joins it. Kicking repeatedly closes the race with a thread that was
    /// about to enter KVM_RUN when the first signal arrived.
    pub fn stop(self) {
        while !self.thread.is_finished() {
            if let Err(e) = self.thread.kill(kick_signal()) {
                tracing::warn!("cannot kick vcpu{}: {e}", self.index);
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if self.thread.join().is_err() {
            tracing::error!("vcpu{} thread panicked", self.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::bus::BusDevice;
    use std::sync::Mutex;

    /// Records each write; each read returns the next value of a counter, in every
    /// byte of the access.
    #[derive(Default)]
    struct Port {
        writes: Vec<(u64, Vec<u8>)>,
        reads: u8,
    }

    impl BusDevice for Port {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            assert_eq!(offset, 0);
            data.fill(self.reads);
            self.reads += 1;
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.writes.push((offset, data.to_vec()));
        }
    }

    fn bus_with_port_at(port: u16) -> (Bus, Arc<Mutex<Port>>) {
        let device = Arc::new(Mutex::new(Port::default()));
        let mut bus = Bus::new();
        bus.insert(device.clone(), u64::from(port), 1).unwrap();
        (bus, device)
    }

    /// An exit the loop does not handle, sent again at each entry, ends the VM after
    /// the limit, naming it; with handled exits between them, such exits never do.
    #[test]
    fn only_unexpected_exits_in_a_row_end_the_vm() {
        let debug = || Some("Debug".to_string());
        let mut exits = UnexpectedExits::default();
        for _ in 1..UnexpectedExits::LIMIT {
            assert!(exits.count(1, debug()).is_ok());
        }
        match exits.count(1, debug()) {
            Err(ExitReason::Fatal(why)) => {
                assert!(why.contains("vCPU 1") && why.contains("Debug"), "{why}")
            }
            other => panic!("the VM goes on after the limit: {other:?}"),
        }

        let mut exits = UnexpectedExits::default();
        for _ in 0..UnexpectedExits::LIMIT * 4 {
            assert!(exits.count(0, debug()).is_ok());
            assert!(exits.count(0, None).is_ok());
        }
    }

    /// `rep outsb` / `rep outsw`: KVM exits once with all the elements; the device
    /// sees one write per element, of the element's size, in order.
    #[test]
    fn a_string_out_is_one_write_per_element() {
        let (bus, device) = bus_with_port_at(0x3f8);
        assert!(port_out(&bus, 0x3f8, b"abc", 1));
        assert!(port_out(&bus, 0x3f8, &[1, 2, 3, 4], 2));
        assert!(port_out(&bus, 0x3f8, &[9, 8, 7, 6], 4));
        let writes: Vec<Vec<u8>> = device
            .lock()
            .unwrap()
            .writes
            .iter()
            .map(|(_, w)| w.clone())
            .collect();
        let expected: Vec<&[u8]> = vec![b"a", b"b", b"c", &[1, 2], &[3, 4], &[9, 8, 7, 6]];
        assert_eq!(writes, expected);
        assert!(!port_out(&bus, 0x3f9, b"xy", 1), "an unclaimed port");
    }

    /// `rep insb` / `rep insw`: each element is its own read of the device.
    #[test]
    fn a_string_in_is_one_read_per_element() {
        let (bus, _device) = bus_with_port_at(0x60);
        let mut bytes = [0u8; 4];
        port_in(&bus, 0x60, &mut bytes, 1);
        assert_eq!(bytes, [0, 1, 2, 3]);
        let mut words = [0u8; 4];
        port_in(&bus, 0x60, &mut words, 2);
        assert_eq!(words, [4, 4, 5, 5]);
        let mut open_bus = [0u8; 3];
        port_in(&bus, 0x61, &mut open_bus, 1);
        assert_eq!(open_bus, [0xff; 3]);
    }

    #[test]
    fn a_crash_the_guest_reports_is_a_crash_and_other_system_events_an_end() {
        assert!(matches!(
            system_event_exit(1, kvm_bindings::KVM_SYSTEM_EVENT_CRASH),
            ExitReason::Fatal(why) if why.contains("the guest reported a crash")
        ));
        for orderly in [
            kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN,
            kvm_bindings::KVM_SYSTEM_EVENT_RESET,
        ] {
            assert!(matches!(
                system_event_exit(0, orderly),
                ExitReason::GuestShutdown
            ));
        }
    }

    #[test]
    fn an_internal_error_names_its_suberror_and_both_possible_causes() {
        let emulation = internal_error_message(2, kvm_bindings::KVM_INTERNAL_ERROR_EMULATION);
        assert!(
            emulation.contains("vCPU 2")
                && emulation.contains("suberror 1: an instruction KVM could not emulate")
                && emulation.contains("the guest did something")
                && emulation.contains("--nested always"),
            "{emulation}"
        );
        assert!(internal_error_message(0, 99).contains("suberror 99"));
    }

    fn long_mode_crash() -> (kvm_regs, kvm_sregs) {
        let regs = kvm_regs {
            rip: 0xffff_ffff_8100_0000,
            rsp: 0xffff_c900_0000_3f00,
            ..Default::default()
        };
        let mut sregs = kvm_sregs {
            cr0: 0x8005_0033,
            cr3: 0x1_0000,
            efer: 0xd01,
            ..Default::default()
        };
        sregs.idt.limit = 0xfff;
        (regs, sregs)
    }

    #[test]
    fn a_crash_in_long_mode_is_described_by_its_registers() {
        let (regs, sregs) = long_mode_crash();
        let text = describe_crash_registers(&regs, &sregs);
        assert!(text.starts_with("rip 0xffffffff81000000 rsp 0xffffc90000003f00 cr0 0x80050033"));
        assert!(text.ends_with("efer 0xd01 idt 0x0+0xfff"), "{text}");
    }

    #[test]
    fn registers_reset_by_kvm_are_not_passed_off_as_the_crash() {
        // What KVM on AMD leaves after a shutdown intercept: an INIT-ed vCPU (seen in
        // the nested host: rip 0xfff0, cr0 0x10, the reset code segment).
        let regs = kvm_regs {
            rip: 0xfff0,
            ..Default::default()
        };
        let mut sregs = kvm_sregs {
            cr0: 0x10,
            ..Default::default()
        };
        sregs.cs.base = 0xffff_0000;
        sregs.cs.selector = 0xf000;
        sregs.idt.limit = 0xffff;
        let text = describe_crash_registers(&regs, &sregs);
        assert!(text.starts_with("its registers are lost"), "{text}");
        assert!(!text.contains("0xfff0"), "{text}");
    }

    #[test]
    fn only_real_mode_at_the_reset_vector_counts_as_reset() {
        let (mut regs, sregs) = long_mode_crash();
        regs.rip = 0xfff0;
        assert!(describe_crash_registers(&regs, &sregs).starts_with("rip 0xfff0 "));
        // An application processor in its real-mode start-up code, at offset 0xfff0 of
        // a SIPI page below 1 MiB: a real crash, described.
        let mut sregs = kvm_sregs {
            cr0: 0x10,
            ..Default::default()
        };
        sregs.cs.base = 0x9_a000;
        assert!(describe_crash_registers(&regs, &sregs).starts_with("rip 0xfff0 "));
    }
}
