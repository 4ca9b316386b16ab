//! A guest driving the vsock device's queues: packets of any header and length on
//! the transmit queue, receive buffers of any shape, its rings changing between
//! rounds; on the host, a service that accepts (and talks) and clients that connect
//! to the guest. The queues are processed by the device's own [`Datapath`], the code
//! its worker thread runs, here one round at a time so every run is repeatable.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use vmm::devices::virtio::vsock::muxer::{Muxer, MAX_CONNECTIONS};
use vmm::devices::virtio::vsock::worker::{Datapath, NUM_QUEUES};
use vmm::devices::virtio::InterruptTrigger;
use vmm::memory::GuestMemoryMmap;
use vmm_sys_util::epoll::EpollEvent;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::guest::{self, QueueLayout};
use crate::input::{Reader, Writer};

pub const GUEST_CID: u64 = 3;
/// The host port a service listens on (`<socket>_1234`); others have none.
pub const SERVICE_PORT: u32 = 1234;
const QUEUE_MAX: u16 = 256;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// One round of the worker: the transmit queue, then the receive queue.
    Process,
    /// The host sockets' events, as the worker's epoll would deliver them.
    HostEvents,
    Poke {
        addr: u32,
        bytes: Vec<u8>,
    },
    /// The host service accepts what connected and writes `len` bytes to each.
    ServiceTalks {
        len: u16,
    },
    /// The host service closes every connection it accepted.
    ServiceCloses,
    /// A host client connects to the guest's `port` (`CONNECT <port>\n`).
    ClientConnects {
        port: u32,
    },
}

impl Op {
    fn read(r: &mut Reader) -> Op {
        match r.u8() % 6 {
            0 => Op::Process,
            1 => Op::HostEvents,
            2 => {
                let (addr, bytes) = r.poke();
                Op::Poke { addr, bytes }
            }
            3 => Op::ServiceTalks { len: r.u16() },
            4 => Op::ServiceCloses,
            _ => Op::ClientConnects { port: r.u32() },
        }
    }

    fn write(&self, w: &mut Writer) {
        match self {
            Op::Process => {
                w.u8(0);
            }
            Op::HostEvents => {
                w.u8(1);
            }
            Op::Poke { addr, bytes } => {
                w.u8(2).poke(*addr, bytes);
            }
            Op::ServiceTalks { len } => {
                w.u8(3).u16(*len);
            }
            Op::ServiceCloses => {
                w.u8(4);
            }
            Op::ClientConnects { port } => {
                w.u8(5).u32(*port);
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Input {
    /// rx, tx, event.
    pub queues: [QueueLayout; NUM_QUEUES],
    pub image: Vec<u8>,
    pub ops: Vec<Op>,
}

impl Input {
    pub fn decode(data: &[u8]) -> Input {
        let mut r = Reader::new(data);
        let queues = [0; NUM_QUEUES].map(|_| QueueLayout::read(&mut r));
        let (image, ops) = r.image_and_ops(Op::read);
        Input { queues, image, ops }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        for q in &self.queues {
            q.write(&mut w);
        }
        w.image(&self.image);
        for op in &self.ops {
            op.write(&mut w);
        }
        w.data
    }
}

/// The host side, made once per process: the device's socket and a service.
struct Host {
    socket: PathBuf,
    listener: Arc<UnixListener>,
    service: UnixListener,
}

/// The directory of [`Host`]'s sockets, removed at exit by [`remove_host_dir`] (a
/// static is never dropped).
static HOST_DIR: Mutex<Option<tempfile::TempDir>> = Mutex::new(None);

extern "C" fn remove_host_dir() {
    if let Ok(mut slot) = HOST_DIR.lock() {
        slot.take();
    }
}

fn host() -> &'static Host {
    static HOST: OnceLock<Host> = OnceLock::new();
    HOST.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let socket = dir.path().join("v.sock");
        let listener = UnixListener::bind(&socket).expect("the device's socket");
        listener
            .set_nonblocking(true)
            .expect("a non-blocking socket");
        let service = UnixListener::bind(dir.path().join(format!("v.sock_{SERVICE_PORT}")))
            .expect("the service's socket");
        service
            .set_nonblocking(true)
            .expect("a non-blocking socket");
        if let Ok(mut slot) = HOST_DIR.lock() {
            *slot = Some(dir);
        }
        // SAFETY: registers a function that takes no arguments and only drops a TempDir.
        unsafe { libc::atexit(remove_host_dir) };
        Host {
            socket,
            listener: Arc::new(listener),
            service,
        }
    })
}

/// The device's interrupt, raised into an event fd nobody reads.
fn interrupt() -> InterruptTrigger {
    InterruptTrigger::new(Arc::new(EventFd::new(EFD_NONBLOCK).expect("an eventfd")))
}

/// The device's datapath over the guest's queues, and the host's sockets. One
/// session at a time per process: they share the host's sockets (as libFuzzer runs,
/// and as the tests that use one do, each in a binary of its own).
pub struct Session {
    pub datapath: Datapath,
    pub memory: GuestMemoryMmap,
    accepted: Vec<UnixStream>,
    clients: Vec<UnixStream>,
}

impl Session {
    /// None where the transport would not activate the device (a queue it refuses).
    pub fn new(queues: &[QueueLayout; NUM_QUEUES], image: &[u8]) -> Option<Session> {
        let memory = guest::memory(image);
        let [rx, tx, event] = queues;
        let queues = [
            rx.queue(QUEUE_MAX, &memory)?,
            tx.queue(QUEUE_MAX, &memory)?,
            event.queue(QUEUE_MAX, &memory)?,
        ];
        let host = host();
        // Leftovers of the previous run would make this one depend on it.
        while host.service.accept().is_ok() {}
        while host.listener.accept().is_ok() {}
        let muxer =
            Muxer::new(GUEST_CID, &host.socket, host.listener.clone()).expect("the muxer's epoll");
        Some(Session {
            datapath: Datapath::new(memory.clone(), queues, interrupt(), muxer, GUEST_CID),
            memory,
            accepted: Vec::new(),
            clients: Vec::new(),
        })
    }

    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::Process => {
                self.datapath.process_tx();
                self.datapath.process_rx();
            }
            Op::HostEvents => self.host_events(),
            Op::Poke { addr, bytes } => guest::poke(&self.memory, u64::from(*addr), bytes),
            Op::ServiceTalks { len } => {
                self.accept_service_connections();
                let data = vec![b'h'; usize::from(*len)];
                for stream in &mut self.accepted {
                    let _ = stream.write(&data);
                    let mut sink = [0u8; 4096];
                    let _ = stream.read(&mut sink);
                }
            }
            Op::ServiceCloses => self.accepted.clear(),
            Op::ClientConnects { port } => {
                if let Ok(mut client) = UnixStream::connect(&host().socket) {
                    let _ = client.set_nonblocking(true);
                    let _ = client.write_all(format!("CONNECT {port}\n").as_bytes());
                    self.clients.push(client);
                }
            }
        }
    }

    /// The host service takes what the guest's connections made wait.
    fn accept_service_connections(&mut self) {
        while let Ok((stream, _)) = host().service.accept() {
            let _ = stream.set_nonblocking(true);
            self.accepted.push(stream);
        }
    }

    fn host_events(&mut self) {
        let mut events = vec![EpollEvent::default(); 64];
        let ready = self
            .datapath
            .muxer
            .epoll()
            .wait(0, &mut events)
            .unwrap_or(0);
        for event in &events[..ready] {
            self.datapath
                .muxer
                .handle_event(event.data(), event.event_set());
        }
    }

    pub fn check(&self) {
        assert!(self.datapath.muxer.connection_count() <= MAX_CONNECTIONS);
    }

    /// Bytes the host service has received, from every connection it accepted.
    pub fn service_received(&mut self) -> Vec<u8> {
        self.accept_service_connections();
        let mut all = Vec::new();
        for stream in &mut self.accepted {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = stream.read(&mut buf) {
                all.extend_from_slice(&buf[..n]);
            }
        }
        all
    }
}

/// The fuzz target: any bytes.
pub fn run(data: &[u8]) {
    let _ = run_input(&Input::decode(data));
}

/// Runs `input` and checks what must hold; the session is returned for more checks
/// (None where the queues would not have been accepted).
pub fn run_input(input: &Input) -> Option<Session> {
    let mut session = Session::new(&input.queues, &input.image)?;
    for op in &input.ops {
        session.apply(op);
    }
    session.check();
    Some(session)
}
