//! Composes a VM from a [`VmConfig`] (memory, kernel, devices, vCPUs) and runs it
//! until the guest shuts down or the VMM is told to stop.

use std::fs::File;
use std::io::Write;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvm_ioctls::IoEventAddress;
use linux_loader::cmdline::Cmdline;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::arch::x86_64::{boot, layout, mptable};
use crate::config::{host_memory_mib, ConfigError, VmConfig};
use crate::devices::bus::{Bus, BusDevice, BusError};
use crate::devices::console_output::{ConsoleOutput, ConsoleQueue};
use crate::devices::legacy::{
    BootTimeReport, BootTimer, EventFdTrigger, ResetController, SerialConsole,
};
use crate::devices::virtio::balloon::Balloon;
use crate::devices::virtio::block::Block;
use crate::devices::virtio::console::Console;
use crate::devices::virtio::fs::VhostUserFs;
use crate::devices::virtio::mmio::{MmioTransport, QUEUE_NOTIFY_OFFSET};
use crate::devices::virtio::rng::Rng;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::{missed_interrupt, missed_notification};
use crate::devices::virtio::{InterruptTrigger, VirtioDevice};
use crate::event_loop::{EventLoop, EventLoopError};
use crate::memory::{create_guest_ram, GuestMemoryMmap, MemoryError};
use crate::vstate::exit::{ExitNotifier, ExitReason, GuestResetTrigger};
use crate::vstate::vcpu::{install_kick_handler, Vcpu, VcpuContext, VcpuError, VcpuHandle};
use crate::vstate::vm::{open_kvm, Vm, VmError};

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error("cannot write the MP table: {0}")]
    Mptable(#[from] mptable::MptableError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    EventLoop(#[from] EventLoopError),
    #[error("cannot open {what} {path}: {source}")]
    Open {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("cannot set up device {device}: {reason}")]
    Device { device: String, reason: String },
    #[error("device address conflict: {0}")]
    Bus(#[from] BusError),
    /// What [`RunOptions::before_vcpus_start`] said.
    #[error("{0}")]
    BeforeVcpusStart(String),
}

/// How the VM talks to its surroundings.
pub struct RunOptions {
    /// When the VMM process started, for the boot timer.
    pub vmm_start: Instant,
    /// Where the guest's console output goes, the serial's and the virtio console's
    /// (unbuffered writes are best; a thread of its own writes it).
    pub console_output: Box<dyn Write + Send>,
    /// Feed the VMM's stdin to the serial console.
    pub console_input: bool,
    /// Called once when the guest's init writes the boot timer.
    pub on_boot_time: Box<dyn FnOnce(BootTimeReport) + Send>,
    /// Called once the VM is built (files open, memory mapped, devices connected) and
    /// before a vCPU runs: where the VMM gives up what running the VM does not need
    /// (`vmctl-vmm` jails itself, confines itself with Landlock and installs its
    /// seccomp filter). The process still has one thread then (vCPUs and device
    /// workers start later), which user namespaces need. An error ends the run.
    pub before_vcpus_start: Box<dyn FnOnce() -> Result<(), String>>,
    /// Told what the caller must act on while the VM runs (a virtio-fs backend given
    /// up on, to be killed).
    pub events: crate::process::EventSink,
}

/// Boots the VM and runs it to the end. A guest shutdown is `Ok(GuestShutdown)`.
pub fn run(config: &VmConfig, options: RunOptions) -> Result<ExitReason, BuildError> {
    // Unknown, the host's RAM bounds nothing: the kernel's own refusal will.
    config.validate(host_memory_mib().unwrap_or(u64::MAX))?;
    let kvm = open_kvm(&config.kvm_device)?;
    let vm = Vm::new(&kvm, config.vcpus as usize)?;
    let ram = create_guest_ram(config.memory_bytes())?;
    vm.register_memory(&ram.memory)?;
    let entry = load_guest_software(config, &ram.memory)?;

    let exit = Arc::new(ExitNotifier::new().map_err(|source| BuildError::Open {
        what: "exit event",
        path: "eventfd".into(),
        source,
    })?);
    let mut event_loop = EventLoop::new(exit.clone())?;
    event_loop.handle_stop_signals()?;
    let first_run = Arc::new(OnceLock::new());
    let mut pio_bus = Bus::new();
    let mut mmio_bus = Bus::new();

    let stop = Arc::new(AtomicBool::new(false));
    // Its thread starts with the vCPUs: until then the VMM must keep to one thread.
    let mut console_output = ConsoleOutput::new(options.console_output);
    let serial = Arc::new(Mutex::new(SerialConsole::new(
        EventFdTrigger::new(irqfd(&vm, layout::SERIAL_IRQ, "serial console")?),
        console_output.queue().serial_output(),
    )));
    pio_bus.insert(
        serial.clone(),
        u64::from(layout::SERIAL_COM1_PORT),
        u64::from(layout::SERIAL_PORT_LEN),
    )?;
    if options.console_input {
        event_loop.add_console_input(serial)?;
    }
    pio_bus.insert(
        Arc::new(Mutex::new(ResetController::new(GuestResetTrigger(
            exit.clone(),
        )))),
        u64::from(layout::I8042_DATA_PORT),
        u64::from(layout::I8042_PORT_LEN),
    )?;
    pio_bus.insert(
        Arc::new(Mutex::new(BootTimer::new(
            options.vmm_start,
            first_run.clone(),
            options.on_boot_time,
        ))),
        u64::from(layout::BOOT_TIMER_PORT),
        1,
    )?;

    let mut transports = Vec::new();
    for (index, device) in virtio_devices(config, &options.events, console_output.queue())?
        .into_iter()
        .enumerate()
    {
        transports.push(attach_virtio_device(
            &vm,
            &ram.memory,
            &mut mmio_bus,
            &mut event_loop,
            index,
            device,
        )?);
    }

    install_kick_handler()?;
    let context = VcpuContext {
        pio_bus: Arc::new(pio_bus),
        mmio_bus: Arc::new(mmio_bus),
        exit,
        stop,
        first_run,
    };
    let vcpu_count = config.vcpus as u8;
    let mut vcpus = Vec::with_capacity(vcpu_count.into());
    for index in 0..vcpu_count {
        let vcpu = Vcpu::new(vm.fd(), index)?;
        vcpu.configure(&kvm, &ram.memory, entry, vcpu_count)?;
        vcpus.push(vcpu);
    }
    (options.before_vcpus_start)().map_err(BuildError::BeforeVcpusStart)?;
    console_output
        .start_writing()
        .map_err(|e| BuildError::Device {
            device: "console output".into(),
            reason: format!("cannot start its thread: {e}"),
        })?;
    let mut handles = Vec::with_capacity(vcpus.len());
    for vcpu in vcpus {
        match vcpu.start(context.clone()) {
            Ok(handle) => handles.push(handle),
            Err(e) => {
                // Those started are stopped and joined before guest memory goes.
                stop_vcpus(&context, &console_output, handles);
                return Err(e.into());
            }
        }
    }

    tracing::debug!("{vcpu_count} vCPU(s) started");
    let boot_vcpu = handles.first();
    let outcome = event_loop.run(&mut || {
        if let Some(vcpu) = boot_vcpu {
            vcpu.kick();
        }
        make_up_for_lost_wakeups(&transports);
    });
    tracing::debug!("VM stopping: {outcome:?}");
    report_lost_wakeups(&transports);
    stop_vcpus(&context, &console_output, handles);
    console_output.finish(CONSOLE_WRITE_OUT_TIMEOUT);
    // Guest memory (`ram`) outlives every vCPU: they are all joined above.
    drop(ram);
    Ok(outcome?)
}

/// Stops the vCPUs of `handles` and joins their threads. A vCPU waiting for room in
/// the output of a console nobody reads must stop too.
fn stop_vcpus(context: &VcpuContext, console_output: &ConsoleOutput, handles: Vec<VcpuHandle>) {
    context
        .stop
        .store(true, std::sync::atomic::Ordering::Release);
    console_output.stop_waiting();
    for handle in handles {
        handle.stop();
    }
}

/// Loads kernel and initrd, writes the command line, boot_params and MP table;
/// returns the kernel's entry point.
fn load_guest_software(
    config: &VmConfig,
    memory: &GuestMemoryMmap,
) -> Result<vm_memory::GuestAddress, BuildError> {
    let kernel = boot::load_kernel(memory, &mut open_file("kernel", &config.kernel)?)?;
    tracing::debug!(
        "kernel {} loaded, entry {:#x}, ends at {:#x}",
        config.kernel.display(),
        kernel.entry.0,
        kernel.kernel_end
    );
    let initrd = match &config.initrd {
        Some(path) => Some(boot::load_initrd(
            memory,
            &mut open_file("initrd", path)?,
            kernel.kernel_end,
        )?),
        None => None,
    };
    let cmdline_text = config.kernel_cmdline();
    // `run` validated it first (`VmConfig::check_cmdline`, as linux-loader checks
    // it): an error here would be linux-loader's own.
    let cmdline_error = |e: linux_loader::cmdline::Error| {
        tracing::debug!("kernel command line rejected: {e}");
        ConfigError::CmdlineTooLong {
            len: cmdline_text.len(),
            max: layout::CMDLINE_MAX_SIZE - 1,
        }
    };
    let mut cmdline = Cmdline::new(layout::CMDLINE_MAX_SIZE).map_err(cmdline_error)?;
    cmdline.insert_str(&cmdline_text).map_err(cmdline_error)?;
    tracing::debug!("initrd: {initrd:x?}; kernel command line: {cmdline_text}");
    let cmdline_len = boot::write_cmdline(memory, &cmdline)?;
    boot::write_boot_params(
        memory,
        config.memory_bytes(),
        cmdline_len,
        initrd,
        kernel.setup_header,
    )?;
    mptable::setup_mptable(memory, config.vcpus as u8)?;
    Ok(kernel.entry)
}

fn open_file(what: &'static str, path: &std::path::Path) -> Result<File, BuildError> {
    File::open(path).map_err(|source| BuildError::Open {
        what,
        path: path.display().to_string(),
        source,
    })
}

/// How long the end of a run waits for the guest's last console output to be written
/// out, when the output is not being read.
const CONSOLE_WRITE_OUT_TIMEOUT: Duration = Duration::from_secs(2);

/// The virtio devices in slot order: disks (vda, vdb, ...), rng, vsock, filesystems,
/// balloon, console.
fn virtio_devices(
    config: &VmConfig,
    events: &crate::process::EventSink,
    console_output: ConsoleQueue,
) -> Result<Vec<Box<dyn VirtioDevice>>, BuildError> {
    let mut devices: Vec<Box<dyn VirtioDevice>> = Vec::new();
    for (index, disk) in config.disks.iter().enumerate() {
        let file = File::options()
            .read(true)
            .write(!disk.read_only)
            .open(&disk.path)
            .map_err(|source| BuildError::Open {
                what: "disk",
                path: disk.path.display().to_string(),
                source,
            })?;
        let id = format!("vd{}", (b'a' + (index % 26) as u8) as char);
        let block = Block::new(file, disk.read_only, id).map_err(|e| BuildError::Device {
            device: disk.path.display().to_string(),
            reason: e.to_string(),
        })?;
        devices.push(Box::new(block));
    }
    if config.rng {
        devices.push(Box::new(Rng::new()));
    }
    if let Some(vsock) = &config.vsock {
        let device =
            Vsock::new(vsock.guest_cid, &vsock.uds_path).map_err(|e| BuildError::Device {
                device: vsock.uds_path.display().to_string(),
                reason: e.to_string(),
            })?;
        devices.push(Box::new(device));
    }
    for fs in &config.filesystems {
        let device =
            VhostUserFs::connect(&fs.socket_path, &fs.tag, events.clone()).map_err(|e| {
                BuildError::Device {
                    device: fs.socket_path.display().to_string(),
                    reason: e.to_string(),
                }
            })?;
        devices.push(Box::new(device));
    }
    if config.free_page_reporting {
        devices.push(Box::new(Balloon::new()));
    }
    if config.virtio_console {
        devices.push(Box::new(Console::new(console_output)));
    }
    Ok(devices)
}

fn irqfd(vm: &Vm, irq: u32, device: &str) -> Result<EventFd, BuildError> {
    let fail = |reason: String| BuildError::Device {
        device: device.to_string(),
        reason,
    };
    let event = EventFd::new(EFD_NONBLOCK).map_err(|e| fail(format!("eventfd: {e}")))?;
    vm.fd()
        .register_irqfd(&event, irq)
        .map_err(|e| fail(format!("irqfd for IRQ {irq}: {e}")))?;
    Ok(event)
}

/// The event loop's tick: each device's lost interrupt raised again, and its lost
/// notifications made up for. A transport a vCPU holds is left for the next tick:
/// that vCPU may be waiting on a vhost-user backend (up to its reply timeout), and the
/// loop must go on handling stop signals.
fn make_up_for_lost_wakeups(transports: &[Arc<Mutex<MmioTransport>>]) {
    for transport in transports {
        if let Ok(mut transport) = transport.try_lock() {
            transport.raise_missed_interrupt();
            transport.serve_missed_notifications();
        }
    }
}

/// Says, as the VM ends, which devices' drivers missed interrupts and which devices
/// missed notifications, and how often.
fn report_lost_wakeups(transports: &[Arc<Mutex<MmioTransport>>]) {
    for (index, transport) in transports.iter().enumerate() {
        let Ok(transport) = transport.lock() else {
            continue;
        };
        let count = transport.interrupts_raised_again();
        if count > 0 {
            tracing::warn!("{}", missed_interrupt::summary(index, count));
        }
        let count = transport.notifications_made_up();
        if count > 0 {
            tracing::warn!("{}", missed_notification::summary(index, count));
        }
    }
}

/// Puts `device` in virtio-mmio slot `index`: its MMIO window, its IRQ (irqfd) and
/// one ioeventfd per queue, served by the event loop.
fn attach_virtio_device(
    vm: &Vm,
    memory: &GuestMemoryMmap,
    mmio_bus: &mut Bus,
    event_loop: &mut EventLoop,
    index: usize,
    device: Box<dyn VirtioDevice>,
) -> Result<Arc<Mutex<MmioTransport>>, BuildError> {
    let (base, irq) = layout::virtio_mmio_slot(index);
    let name = format!("virtio-mmio slot {index} (type {})", device.device_type());
    let device_error = |reason: String| BuildError::Device {
        device: name.clone(),
        reason,
    };
    let interrupt = InterruptTrigger::new(Arc::new(irqfd(vm, irq, &name)?));
    let mut device = device;
    let mut queue_events = Vec::new();
    for queue in 0..device.queue_max_sizes().len() as u32 {
        let event =
            EventFd::new(EFD_NONBLOCK).map_err(|e| device_error(format!("eventfd: {e}")))?;
        vm.fd()
            .register_ioevent(
                &event,
                &IoEventAddress::Mmio(base + QUEUE_NOTIFY_OFFSET),
                queue,
            )
            .map_err(|e| device_error(format!("ioeventfd for queue {queue}: {e}")))?;
        queue_events.push(event);
    }
    let served_elsewhere = device
        .attach_queue_events(&queue_events)
        .map_err(|e| device_error(format!("queue events: {e}")))?;
    let mut transport = MmioTransport::new(device, memory.clone(), interrupt);
    if !served_elsewhere {
        let clones = queue_events
            .iter()
            .map(EventFd::try_clone)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| device_error(format!("queue events: {e}")))?;
        transport.deliver_through(clones);
    }
    let transport = Arc::new(Mutex::new(transport));
    mmio_bus.insert(
        transport.clone() as Arc<Mutex<dyn BusDevice>>,
        base,
        layout::VIRTIO_MMIO_WINDOW_SIZE,
    )?;
    if !served_elsewhere {
        for (queue, event) in queue_events.into_iter().enumerate() {
            event_loop.add_queue(transport.clone(), queue as u32, event)?;
        }
    }
    Ok(transport)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use vm_memory::GuestAddress;

    /// A transport a vCPU holds (as one waiting on a stuck vhost-user backend does)
    /// does not hold up the tick, after which the event loop handles stop signals.
    #[test]
    fn the_tick_passes_over_a_transport_in_use() {
        let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let interrupt = InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
        let transport = MmioTransport::new(Box::new(Rng::new()), memory, interrupt);
        let transports = vec![Arc::new(Mutex::new(transport))];
        let held = transports[0].lock().unwrap();
        let (done, ticked) = std::sync::mpsc::channel();
        let tick_transports = transports.clone();
        std::thread::spawn(move || {
            make_up_for_lost_wakeups(&tick_transports);
            let _ = done.send(());
        });
        let ticked = ticked.recv_timeout(Duration::from_secs(5));
        drop(held);
        assert!(
            ticked.is_ok(),
            "the tick waited for the transport a vCPU holds"
        );
    }
}
