//! Watching a running nested host for its known stalls (docs/nested-host.md):
//!
//! - one of its vCPUs halted, with interrupts enabled and an interrupt pending in its
//!   local APIC that it may take, which the emulation never delivers. The nested host
//!   never recovers from that (not even an NMI from QEMU's monitor wakes the vCPU),
//!   and whatever waits on that vCPU waits for good: the VM's commands hang, with
//!   every process at 0% CPU;
//! - its vCPUs spinning at one instruction with interrupts disabled (seen: both in
//!   the nested host kernel's `queued_spin_lock_slowpath`, a lock nobody would ever
//!   release), with QEMU busy and the VM's commands hanging just the same.
//!
//! So the launcher samples each vCPU through QEMU's monitor, and one seen stuck for
//! [`STALL_AFTER`] ends the nested host with an error that says so, instead of a hang.
//!
//! A healthy vCPU is halted with an interrupt it may take only between the
//! interrupt's arrival and its wake-up, microseconds; it keeps interrupts disabled
//! for microseconds too, and not at the same instruction seconds later. Consecutive
//! samples seconds apart find neither.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often each vCPU is sampled.
const POLL: Duration = Duration::from_secs(5);
/// How long a vCPU must be seen stuck, sample after sample, to be declared stalled.
pub const STALL_AFTER: Duration = Duration::from_secs(20);
/// How long one monitor exchange may take: a monitor held by someone else (such as
/// `scripts/nested-monitor`) only costs a sample.
const MONITOR_TIMEOUT: Duration = Duration::from_secs(3);
/// `off` leaves a stalled nested host running, for a look inside it
/// (`scripts/nested-monitor`).
pub const WATCH_ENV: &str = "VMCTL_NESTED_STALL_WATCH";

/// How a vCPU of the nested host was seen stuck, sample after sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stuck {
    /// Halted with interrupts enabled, never taking the deliverable interrupts
    /// pending in its local APIC (their vectors).
    Halted { pending: Vec<u8> },
    /// Running with interrupts disabled, at the same instruction every time.
    Spinning { rip: u64 },
}

impl Stuck {
    /// Whether a vCPU first seen as `self` and now as `now` has been stuck all along:
    /// a spinning one must still be at the same instruction.
    fn continued_by(&self, now: &Stuck) -> bool {
        match (self, now) {
            (Stuck::Halted { .. }, Stuck::Halted { .. }) => true,
            (Stuck::Spinning { rip: then }, Stuck::Spinning { rip }) => then == rip,
            _ => false,
        }
    }
}

/// A vCPU of the nested host that stopped making progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stall {
    pub cpu: u32,
    pub stuck: Stuck,
    /// How long it was seen stuck.
    pub seconds: u64,
}

impl std::fmt::Display for Stall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Stall {
            cpu,
            stuck,
            seconds,
        } = self;
        match stuck {
            Stuck::Halted { pending } => {
                let vectors: Vec<String> = pending.iter().map(u8::to_string).collect();
                write!(
                    f,
                    "its vCPU {cpu} sat halted for {seconds} s with interrupts it never took \
                     pending (vectors {})",
                    vectors.join(" ")
                )
            }
            Stuck::Spinning { rip } => write!(
                f,
                "its vCPU {cpu} spun for {seconds} s with interrupts disabled, at one \
                 instruction (RIP {rip:#x})"
            ),
        }
    }
}

/// One vCPU as the monitor shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CpuSample {
    halted: bool,
    /// The instruction pointer.
    rip: u64,
    interrupts_enabled: bool,
    /// Vectors in the local APIC's interrupt request register.
    pending: Vec<u8>,
    /// The processor priority: only vectors of a higher class (upper nibble) are
    /// delivered.
    priority: u8,
}

impl CpuSample {
    /// From the monitor's `info registers` and `info lapic` of one vCPU.
    fn parse(registers: &str, lapic: &str) -> Option<CpuSample> {
        let register_line = registers.lines().find(|line| line.contains("RFL="))?;
        let value_of = |line: &str, name: &str| -> Option<String> {
            let start = line.find(name)? + name.len();
            Some(line[start..].split_whitespace().next()?.to_string())
        };
        let flags = u64::from_str_radix(&value_of(register_line, "RFL=")?, 16).ok()?;
        let rip = u64::from_str_radix(&value_of(register_line, "RIP=")?, 16).ok()?;
        let halted = value_of(register_line, "HLT=")? == "1";
        let irr = lapic
            .lines()
            .find_map(|line| line.trim_start().strip_prefix("IRR"))?;
        let pending = irr
            .split_whitespace()
            .filter_map(|vector| vector.parse().ok())
            .collect();
        let priority_line = lapic.lines().find(|line| line.contains("PPR 0x"))?;
        let priority = value_of(priority_line, "PPR 0x")?;
        Some(CpuSample {
            halted,
            rip,
            interrupts_enabled: flags & (1 << 9) != 0,
            pending,
            priority: u8::from_str_radix(&priority, 16).ok()?,
        })
    }

    /// Halted although it could take an interrupt it has, or running with interrupts
    /// disabled: either is a stall if it lasts.
    fn stuck(&self) -> Option<Stuck> {
        let deliverable = self
            .pending
            .iter()
            .any(|vector| vector >> 4 > self.priority >> 4);
        match (self.halted, self.interrupts_enabled) {
            (true, true) if deliverable => Some(Stuck::Halted {
                pending: self.pending.clone(),
            }),
            (false, false) => Some(Stuck::Spinning { rip: self.rip }),
            _ => None,
        }
    }
}

/// Since when, and how, each vCPU has been seen stuck, sample after sample.
#[derive(Debug, Default)]
struct StuckSince(Vec<Option<(Instant, Stuck)>>);

impl StuckSince {
    /// Takes one round of samples (`None`: that vCPU could not be sampled, which
    /// forgets what was seen of it); returns the first vCPU stuck for `after`.
    fn update(
        &mut self,
        samples: &[Option<CpuSample>],
        now: Instant,
        after: Duration,
    ) -> Option<Stall> {
        self.0.resize(samples.len(), None);
        for (cpu, (sample, since)) in samples.iter().zip(self.0.iter_mut()).enumerate() {
            let Some(stuck) = sample.as_ref().and_then(CpuSample::stuck) else {
                *since = None;
                continue;
            };
            let first = match since.take() {
                Some((first, then)) if then.continued_by(&stuck) => first,
                _ => now,
            };
            let stuck_for = now.duration_since(first);
            if stuck_for >= after {
                return Some(Stall {
                    cpu: cpu as u32,
                    stuck,
                    seconds: stuck_for.as_secs(),
                });
            }
            *since = Some((first, stuck));
        }
        None
    }
}

/// A session with QEMU's human monitor: each answer ends with the next prompt.
struct Monitor {
    stream: UnixStream,
}

const PROMPT: &str = "(qemu) ";

impl Monitor {
    fn connect(socket: &std::path::Path) -> std::io::Result<Monitor> {
        let stream = UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(MONITOR_TIMEOUT))?;
        stream.set_write_timeout(Some(MONITOR_TIMEOUT))?;
        let mut monitor = Monitor { stream };
        monitor.read_answer()?;
        Ok(monitor)
    }

    fn ask(&mut self, command: &str) -> std::io::Result<String> {
        self.stream.write_all(format!("{command}\n").as_bytes())?;
        self.read_answer()
    }

    fn read_answer(&mut self) -> std::io::Result<String> {
        let mut answer = Vec::new();
        let mut buffer = [0u8; 4096];
        while !answer.ends_with(PROMPT.as_bytes()) {
            let n = self.stream.read(&mut buffer)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            answer.extend_from_slice(&buffer[..n]);
        }
        Ok(String::from_utf8_lossy(&answer).into_owned())
    }

    /// Every vCPU's sample; `None` for one the monitor did not describe.
    fn sample(&mut self, cpus: u32) -> std::io::Result<Vec<Option<CpuSample>>> {
        let mut samples = Vec::new();
        for cpu in 0..cpus {
            self.ask(&format!("cpu {cpu}"))?;
            let registers = self.ask("info registers")?;
            let lapic = self.ask("info lapic")?;
            samples.push(CpuSample::parse(&registers, &lapic));
        }
        Ok(samples)
    }
}

/// A running watch of one nested host.
pub struct StallWatch {
    /// Dropped to stop the watch: its thread wakes at once.
    stop: Option<Sender<()>>,
    found: Arc<Mutex<Option<Stall>>>,
    thread: Option<JoinHandle<()>>,
}

impl StallWatch {
    /// Watches the `cpus` vCPUs of the nested host whose monitor is `socket`, unless
    /// [`WATCH_ENV`] is `off`.
    pub fn start(socket: PathBuf, cpus: u32) -> StallWatch {
        let enabled = std::env::var(WATCH_ENV).map_or(true, |value| value != "off");
        Self::start_with(socket, cpus, enabled.then_some(POLL), STALL_AFTER)
    }

    fn start_with(
        socket: PathBuf,
        cpus: u32,
        poll: Option<Duration>,
        after: Duration,
    ) -> StallWatch {
        let (stop, stopped) = mpsc::channel();
        let found = Arc::new(Mutex::new(None));
        let thread = poll.map(|poll| {
            let found = found.clone();
            std::thread::spawn(move || {
                if let Some(stall) = watch(&socket, cpus, poll, after, &stopped) {
                    tracing::debug!("the nested host stalled: {stall}");
                    if let Ok(mut slot) = found.lock() {
                        *slot = Some(stall);
                    }
                }
            })
        });
        StallWatch {
            stop: Some(stop),
            found,
            thread,
        }
    }

    /// The stall found, if one was.
    pub fn stall(&self) -> Option<Stall> {
        self.found.lock().ok().and_then(|slot| slot.clone())
    }
}

impl Drop for StallWatch {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Samples the nested host's vCPUs every `poll` until one is stuck for `after` (its
/// stall) or `stopped` hangs up (`None`).
fn watch(
    socket: &std::path::Path,
    cpus: u32,
    poll: Duration,
    after: Duration,
    stopped: &Receiver<()>,
) -> Option<Stall> {
    let mut stuck = StuckSince::default();
    while stopped.recv_timeout(poll) == Err(RecvTimeoutError::Timeout) {
        match Monitor::connect(socket).and_then(|mut monitor| monitor.sample(cpus)) {
            Ok(samples) => {
                tracing::debug!("the nested host's vCPUs: {}", describe(&samples));
                if let Some(stall) = stuck.update(&samples, Instant::now(), after) {
                    return Some(stall);
                }
            }
            Err(e) => {
                // Only what is seen sample after sample counts.
                tracing::debug!("cannot sample the nested host's vCPUs: {e}");
                stuck = StuckSince::default();
            }
        }
    }
    None
}

/// One round of samples in a few words, for the debug log: `0 halted, 1 running`.
fn describe(samples: &[Option<CpuSample>]) -> String {
    let words: Vec<String> = samples
        .iter()
        .enumerate()
        .map(
            |(cpu, sample)| match sample.as_ref().map(|s| (s, s.stuck())) {
                None => format!("{cpu} unreadable"),
                Some((_, Some(Stuck::Halted { pending }))) => format!("{cpu} stuck {pending:?}"),
                Some((_, Some(Stuck::Spinning { rip }))) => {
                    format!("{cpu} interrupts off at {rip:#x}")
                }
                Some((sample, None)) if sample.halted => format!("{cpu} halted"),
                Some(_) => format!("{cpu} running"),
            },
        )
        .collect();
    words.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What QEMU 7.2's monitor answered for vCPU 0 of a stalled nested host (CI,
    /// 2026-12-04), the echo of the command included.
    const STALLED_REGISTERS: &str = "info registers\r\n\r\nCPU#0\r\n\
        RAX=0000000000000000 RBX=0000000000000000 RCX=4000000000000000 RDX=0000000000000000\r\n\
        RIP=ffffffff810970ee RFL=00000246 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=1\r\n\
        ES =0000 0000000000000000 00000000 00000000\r\n(qemu) ";
    const STALLED_LAPIC: &str = "info lapic\r\ndumping local APIC state for CPU 0 \r\n\r\n\
        LVTT\t 0x000000ec active-hi edge                 one-shot     Fixed  (vec 236)\r\n\
        Timer\t DCR=0x3 (divide by 16) initial_count = 153548 current_count = 0\r\n\
        ISR\t (none)\r\n\
        IRR\t 34 236 251 \r\n\r\n\
        APR 0x00 TPR 0x10 DFR 0x0f LDR 0x01 PPR 0x10\r\n(qemu) ";
    /// What it answered for a vCPU of a nested host whose vCPUs both sat in its
    /// kernel's `queued_spin_lock_slowpath` with interrupts off (2026-12-05).
    const SPINNING_REGISTERS: &str = "info registers\r\n\r\nCPU#1\r\n\
        RIP=ffffffff81589223 RFL=00000002 [-------] CPL=0 II=0 A20=1 SMM=0 HLT=0\r\n(qemu) ";
    const IDLE_LAPIC: &str = "info lapic\r\nISR\t (none)\r\nIRR\t (none)\r\n\r\n\
        APR 0x01 TPR 0x10 DFR 0x0f LDR 0x02 PPR 0x10\r\n(qemu) ";

    fn stalled() -> CpuSample {
        CpuSample::parse(STALLED_REGISTERS, STALLED_LAPIC).unwrap()
    }

    #[test]
    fn a_halted_vcpu_with_a_deliverable_interrupt_is_stuck() {
        let sample = stalled();
        assert_eq!(
            sample,
            CpuSample {
                halted: true,
                rip: 0xffff_ffff_8109_70ee,
                interrupts_enabled: true,
                pending: vec![34, 236, 251],
                priority: 0x10,
            }
        );
        assert_eq!(
            sample.stuck(),
            Some(Stuck::Halted {
                pending: vec![34, 236, 251]
            })
        );
    }

    #[test]
    fn a_running_vcpu_with_interrupts_off_is_stuck_at_its_instruction() {
        let spinning = CpuSample::parse(SPINNING_REGISTERS, IDLE_LAPIC).unwrap();
        assert_eq!(
            spinning.stuck(),
            Some(Stuck::Spinning {
                rip: 0xffff_ffff_8158_9223
            })
        );
    }

    #[test]
    fn idle_running_masked_or_blocked_vcpus_are_not_stuck() {
        let idle = CpuSample::parse(STALLED_REGISTERS, IDLE_LAPIC).unwrap();
        assert!(idle.halted && idle.pending.is_empty() && idle.stuck().is_none());
        let running = CpuSample {
            halted: false,
            ..stalled()
        };
        assert_eq!(running.stuck(), None);
        let interrupts_off = CpuSample {
            interrupts_enabled: false,
            ..stalled()
        };
        assert_eq!(
            interrupts_off.stuck(),
            None,
            "a halt with interrupts off waits for an NMI"
        );
        // An interrupt of the class being served waits for its end of interrupt.
        let in_service = CpuSample {
            pending: vec![0xec],
            priority: 0xe0,
            ..stalled()
        };
        assert_eq!(in_service.stuck(), None);
        assert_eq!(CpuSample::parse("garbage", STALLED_LAPIC), None);
        assert_eq!(CpuSample::parse(STALLED_REGISTERS, "garbage"), None);
    }

    #[test]
    fn a_stall_is_declared_only_after_consecutive_stuck_samples() {
        let start = Instant::now();
        let at = |secs: u64| start + Duration::from_secs(secs);
        let after = Duration::from_secs(20);
        let idle = Some(CpuSample {
            pending: Vec::new(),
            ..stalled()
        });
        let stuck = Some(stalled());
        let mut since = StuckSince::default();
        // vCPU 1 stuck, stuck, then seen moving, stuck, unreadable, stuck: a sample that
        // shows it moving, or none, starts the count again.
        for (vcpu1, secs) in [
            (&stuck, 0),
            (&stuck, 10),
            (&idle, 15),
            (&stuck, 20),
            (&None, 25),
            (&stuck, 30),
        ] {
            let round = [idle.clone(), vcpu1.clone()];
            assert_eq!(since.update(&round, at(secs), after), None, "at {secs} s");
        }
        let stall = since
            .update(&[idle, stuck], at(50), after)
            .expect("stuck for 20 s");
        assert_eq!(
            stall,
            Stall {
                cpu: 1,
                stuck: Stuck::Halted {
                    pending: vec![34, 236, 251]
                },
                seconds: 20
            }
        );
        let stuck = Some(stalled());
        let running = Some(CpuSample {
            halted: false,
            ..stalled()
        });
        let spinning = CpuSample::parse(SPINNING_REGISTERS, IDLE_LAPIC);
        assert_eq!(
            describe(&[stuck, running, None, spinning]),
            "0 stuck [34, 236, 251], 1 running, 2 unreadable, \
             3 interrupts off at 0xffffffff81589223"
        );
        let said = stall.to_string();
        assert!(said.contains("vCPU 1 sat halted for 20 s"), "{said}");
        assert!(said.ends_with("(vectors 34 236 251)"), "{said}");
    }

    #[test]
    fn a_vcpu_spinning_with_interrupts_off_stalls_only_if_it_stays_at_one_instruction() {
        let start = Instant::now();
        let at = |secs: u64| start + Duration::from_secs(secs);
        let after = Duration::from_secs(20);
        let healthy = Some(CpuSample {
            pending: Vec::new(),
            ..stalled()
        });
        let spinning = CpuSample::parse(SPINNING_REGISTERS, IDLE_LAPIC).unwrap();
        let elsewhere = Some(CpuSample {
            rip: spinning.rip + 0x40,
            ..spinning.clone()
        });
        let spinning = Some(spinning);
        let halted_stuck = Some(stalled());
        let mut since = StuckSince::default();
        // Interrupts off at one instruction, then at another (a busy vCPU sampled in
        // sections with interrupts off), then halted: each starts the count again.
        for (vcpu0, secs) in [
            (&spinning, 0),
            (&spinning, 15),
            (&elsewhere, 20),
            (&spinning, 25),
            (&halted_stuck, 40),
            (&spinning, 45),
        ] {
            let round = [vcpu0.clone(), healthy.clone()];
            assert_eq!(since.update(&round, at(secs), after), None, "at {secs} s");
        }
        let stall = since
            .update(&[spinning, healthy], at(65), after)
            .expect("at one instruction for 20 s");
        assert_eq!(
            stall,
            Stall {
                cpu: 0,
                stuck: Stuck::Spinning {
                    rip: 0xffff_ffff_8158_9223
                },
                seconds: 20
            }
        );
        let said = stall.to_string();
        assert!(
            said.contains("vCPU 0 spun for 20 s with interrupts disabled"),
            "{said}"
        );
        assert!(said.ends_with("(RIP 0xffffffff81589223)"), "{said}");
    }

    /// A stand-in for QEMU's monitor on `socket` that describes every vCPU with
    /// `lapic`; serves until the listener is dropped with the test.
    fn fake_monitor(socket: &std::path::Path, lapic: &'static str) {
        let listener = std::os::unix::net::UnixListener::bind(socket).unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let _ = stream.write_all(b"QEMU 7.2.22 monitor\r\n(qemu) ");
                let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                while std::io::BufRead::read_line(&mut reader, &mut line).is_ok_and(|n| n > 0) {
                    let answer = match line.trim() {
                        "info registers" => STALLED_REGISTERS,
                        "info lapic" => lapic,
                        _ => "\r\n(qemu) ",
                    };
                    if stream.write_all(answer.as_bytes()).is_err() {
                        break;
                    }
                    line.clear();
                }
            }
        });
    }

    /// A [`quick_watch`] of a [`fake_monitor`] answering with `lapic`, in a directory
    /// that lives as long as the returned one.
    fn watch_fake_monitor(lapic: &'static str) -> (tempfile::TempDir, StallWatch) {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("monitor.sock");
        fake_monitor(&socket, lapic);
        let watch = quick_watch(socket);
        (dir, watch)
    }

    /// A watch of two vCPUs that samples every 20 ms and calls a stall after 100 ms.
    fn quick_watch(socket: PathBuf) -> StallWatch {
        StallWatch::start_with(
            socket,
            2,
            Some(Duration::from_millis(20)),
            Duration::from_millis(100),
        )
    }

    #[test]
    fn the_watch_finds_a_stalled_nested_host_through_its_monitor() {
        let (_dir, watch) = watch_fake_monitor(STALLED_LAPIC);
        let deadline = Instant::now() + Duration::from_secs(10);
        while watch.stall().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let stall = watch.stall().expect("the stall was found");
        assert_eq!(
            (stall.cpu, stall.stuck),
            (
                0,
                Stuck::Halted {
                    pending: vec![34, 236, 251]
                }
            )
        );
    }

    #[test]
    fn the_watch_leaves_a_healthy_nested_host_alone() {
        let (dir, watch) = watch_fake_monitor(IDLE_LAPIC);
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(watch.stall(), None);
        // Without a monitor (QEMU not up yet, or gone) there is nothing to find.
        let absent = quick_watch(dir.path().join("absent.sock"));
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(absent.stall(), None);
    }
}
