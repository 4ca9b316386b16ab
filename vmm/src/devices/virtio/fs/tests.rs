use std::sync::atomic::Ordering;

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};

use super::fallback::{fail_requests, take_over};
use super::*;
use crate::memory::create_guest_ram;

/// An event sink that keeps what it is told, for the test to look at.
fn events() -> (EventSink, std::sync::mpsc::Receiver<Event>) {
    let (told, heard) = std::sync::mpsc::channel();
    let sink: EventSink = Arc::new(move |event| {
        let _ = told.send(event);
    });
    (sink, heard)
}

fn no_events() -> EventSink {
    Arc::new(|event| panic!("unexpected event: {event:?}"))
}

const W: u16 = VRING_DESC_F_WRITE as u16;
const N: u16 = VRING_DESC_F_NEXT as u16;

fn raw(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
    RawDescriptor::from(Descriptor::new(addr, len, flags, next))
}

/// A FUSE request header: len, opcode, unique, then the rest (zeros).
fn request_header(opcode: u32, unique: u64) -> [u8; 40] {
    let mut header = [0u8; 40];
    header[0..4].copy_from_slice(&40u32.to_le_bytes());
    header[4..8].copy_from_slice(&opcode.to_le_bytes());
    header[8..16].copy_from_slice(&unique.to_le_bytes());
    header
}

fn used_entries(vq: &MockSplitQueue<GuestMemoryMmap>) -> Vec<(u32, u32)> {
    (0..vq.used().idx().load())
        .map(|i| {
            let e = vq.used().ring().ref_at(i as usize).unwrap().load();
            (e.id(), e.len())
        })
        .collect()
}

#[test]
fn without_a_backend_requests_fail_with_eio() {
    let ram = create_guest_ram(4 << 20).unwrap();
    let mem = &ram.memory;
    mem.write_slice(&request_header(1, 0xabcd), GuestAddress(0x10_0000))
        .unwrap();
    mem.write_slice(&[0xffu8; 64], GuestAddress(0x11_0000))
        .unwrap();
    // FORGET (opcode 2) has no reply buffer.
    mem.write_slice(&request_header(2, 7), GuestAddress(0x12_0000))
        .unwrap();
    let vq = MockSplitQueue::new(mem, 16);
    vq.add_desc_chains(
        &[
            raw(0x10_0000, 40, N, 1),
            raw(0x11_0000, 64, W, 0),
            raw(0x12_0000, 40, 0, 0),
            raw(0x13_0000, 8, N, 4), // too short for a header
            raw(0x14_0000, 64, W, 0),
        ],
        0,
    )
    .unwrap();
    let mut queue: Queue = vq.create_queue().unwrap();
    take_over(&mut queue, mem);
    let answered = fail_requests(&mut queue, mem);
    assert!(answered.notify && !answered.needs_reset);
    assert_eq!(used_entries(&vq), vec![(0, 16), (2, 0), (3, 0)]);
    let mut reply = [0u8; 16];
    mem.read_slice(&mut reply, GuestAddress(0x11_0000)).unwrap();
    assert_eq!(u32::from_le_bytes(reply[0..4].try_into().unwrap()), 16);
    assert_eq!(
        i32::from_le_bytes(reply[4..8].try_into().unwrap()),
        -libc::EIO
    );
    assert_eq!(u64::from_le_bytes(reply[8..16].try_into().unwrap()), 0xabcd);
}

#[test]
fn the_takeover_resumes_where_the_backend_stopped_answering() {
    let ram = create_guest_ram(4 << 20).unwrap();
    let mem = &ram.memory;
    for i in 0..3u64 {
        mem.write_slice(&request_header(15, i), GuestAddress(0x10_0000 + i * 0x1000))
            .unwrap();
    }
    let vq = MockSplitQueue::new(mem, 16);
    vq.add_desc_chains(
        &[
            raw(0x10_0000, 40, N, 1),
            raw(0x20_0000, 64, W, 0),
            raw(0x10_1000, 40, N, 3),
            raw(0x20_1000, 64, W, 0),
            raw(0x10_2000, 40, N, 5),
            raw(0x20_2000, 64, W, 0),
        ],
        0,
    )
    .unwrap();
    // The backend answered the first request and had taken the second.
    let mut backend_view: Queue = vq.create_queue().unwrap();
    let first = backend_view.pop_descriptor_chain(mem).unwrap();
    backend_view.add_used(mem, first.head_index(), 100).unwrap();
    backend_view.pop_descriptor_chain(mem).unwrap();

    let mut queue: Queue = vq.create_queue().unwrap();
    take_over(&mut queue, mem);
    assert_eq!(queue.next_avail(), 1);
    fail_requests(&mut queue, mem);
    assert_eq!(used_entries(&vq), vec![(0, 100), (2, 16), (4, 16)]);
    assert_eq!(queue.used_idx(mem, Ordering::Acquire).unwrap().0, 3);
}

/// [`fail_requests`] on its own thread, with 5 s to return: a broken ring must not
/// make it spin. `what` names the ring in the failure.
fn fail_requests_within_5s(
    mut queue: Queue,
    memory: GuestMemoryMmap,
    what: &str,
) -> super::fallback::Answered {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(fail_requests(&mut queue, &memory));
    });
    finished
        .recv_timeout(std::time::Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("fail_requests still running after 5 s: it spins on {what}"))
}

/// A guest that sets its available index beyond the queue's size gets no answers, and
/// the worker goes back to waiting instead of spinning on requests that never pop.
#[test]
fn an_available_index_out_of_range_does_not_spin_the_fallback() {
    let ram = create_guest_ram(4 << 20).unwrap();
    let vq = MockSplitQueue::new(&ram.memory, 16);
    let mut queue: Queue = vq.create_queue().unwrap();
    take_over(&mut queue, &ram.memory);
    vq.avail().idx().store(17);
    let answered = fail_requests_within_5s(queue, ram.memory.clone(), "a broken ring");
    assert!(!answered.notify && !answered.more && answered.needs_reset);
    assert!(used_entries(&vq).is_empty());
}

/// virtio-queue takes nothing from an available ring at guest address 0, though its
/// index says there is a request: the fallback must give up on it too, not spin
/// (found by the `fs_fallback` fuzzer, `fuzz/`).
#[test]
fn an_available_ring_at_address_zero_does_not_spin_the_fallback() {
    let ram = create_guest_ram(4 << 20).unwrap();
    let memory = ram.memory.clone();
    let mut queue = Queue::new(16).unwrap();
    queue.set_size(16);
    queue.set_desc_table_address(Some(0x1000), Some(0));
    queue.set_avail_ring_address(Some(0), Some(0));
    queue.set_used_ring_address(Some(0x2000), Some(0));
    queue.set_ready(true);
    assert!(queue.is_valid(&memory), "a ring the transport accepts");
    memory.write_obj(1u16, GuestAddress(2)).unwrap();
    let answered = fail_requests_within_5s(queue, memory, "a ring at address 0");
    assert!(!answered.notify && !answered.more && answered.needs_reset);
}

#[test]
fn connect_errors_name_the_socket_and_check_the_tag() {
    let missing = std::path::Path::new("/nonexistent/vmm-test-virtiofsd.sock");
    let Err(err) = VhostUserFs::connect(missing, "share", no_events()) else {
        panic!("connected to a socket that does not exist");
    };
    let text = err.to_string();
    assert!(
        text.contains("/nonexistent/vmm-test-virtiofsd.sock"),
        "{text}"
    );
    assert!(text.contains("virtiofsd"), "{text}");
    for bad in ["", &"x".repeat(MAX_FS_TAG_LEN + 1)] {
        assert!(matches!(
            VhostUserFs::connect(missing, bad, no_events()),
            Err(FsError::BadTag { .. })
        ));
    }
}

/// What the fake vhost-user backend does besides answering like virtiofsd.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fake {
    /// Refuses SET_MEM_TABLE (as virtiofsd when it cannot map the memory), then exits.
    RefusesMemoryTable,
    /// Answers GET_VRING_BASE only once released (as virtiofsd whose queue thread is
    /// stuck on a file system that does not respond), staying connected meanwhile.
    StallsRingStop,
    /// Does not acknowledge SET_MEM_TABLE; stays connected until released, then ends
    /// the session (as virtiofsd stuck as the guest starts the device, then killed).
    StallsStart,
    /// Hangs up once connected (as virtiofsd that died before the driver started).
    DiesAfterConnect,
}

const GET_FEATURES: u32 = 1;
const SET_MEM_TABLE: u32 = 5;
const GET_VRING_BASE: u32 = 11;
const GET_PROTOCOL_FEATURES: u32 = 15;
const GET_QUEUE_NUM: u32 = 17;
const NEED_REPLY: u32 = 0x8;

/// A vhost-user backend on a socket in a directory of its own; its thread ends when
/// the session does, returning whether it saw the frontend hang up (or refuse its
/// late reply). A stalling one waits for [`FakeBackend::release`].
struct FakeBackend {
    socket: std::path::PathBuf,
    session: std::thread::JoinHandle<bool>,
    release: std::sync::mpsc::Sender<()>,
    _dir: tempfile::TempDir,
}

impl FakeBackend {
    fn start(behaviour: Fake) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("fs.sock");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let (release, released) = std::sync::mpsc::channel();
        let session = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            serve(stream, behaviour, &released)
        });
        Self {
            socket,
            session,
            release,
            _dir: dir,
        }
    }

    /// Lets a stalling backend go on.
    fn release(&self) {
        let _ = self.release.send(());
    }

    /// Whether the frontend hung up, once the session is over (within 5 s).
    fn saw_hang_up(self) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !self.session.is_finished() {
            assert!(
                std::time::Instant::now() < deadline,
                "the fake backend's session is still open"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        self.session.join().unwrap()
    }
}

/// Answers requests as virtiofsd does (with REPLY_ACK offered); returns true when the
/// frontend hung up or refused a reply, false when the fake ended the session.
fn serve(
    mut stream: std::os::unix::net::UnixStream,
    behaviour: Fake,
    released: &std::sync::mpsc::Receiver<()>,
) -> bool {
    use std::io::{Read, Write};
    let reply = |stream: &mut std::os::unix::net::UnixStream, code: u32, body: &[u8]| {
        let mut message = Vec::new();
        for word in [code, 0x1 | 0x4, body.len() as u32] {
            message.extend_from_slice(&word.to_le_bytes());
        }
        message.extend_from_slice(body);
        stream.write_all(&message)
    };
    let mut header = [0u8; 12];
    loop {
        // Descriptors sent along are dropped with the control data nobody reads.
        if stream.read_exact(&mut header).is_err() {
            return true;
        }
        let word = |i: usize| u32::from_le_bytes(header[4 * i..4 * i + 4].try_into().unwrap());
        let (code, flags, size) = (word(0), word(1), word(2));
        let mut body = vec![0u8; size as usize];
        stream.read_exact(&mut body).unwrap();
        let ack = |stream: &mut std::os::unix::net::UnixStream, status: u64| {
            if flags & NEED_REPLY != 0 {
                reply(stream, code, &status.to_le_bytes()).unwrap();
            }
        };
        match code {
            GET_FEATURES => {
                let features = FEATURE_VERSION_1 | (1 << 30);
                reply(&mut stream, code, &features.to_le_bytes()).unwrap();
            }
            GET_PROTOCOL_FEATURES => {
                let mq_and_reply_ack = 1u64 | (1 << 3);
                reply(&mut stream, code, &mq_and_reply_ack.to_le_bytes()).unwrap();
            }
            GET_QUEUE_NUM => {
                reply(&mut stream, code, &(NUM_QUEUES as u64).to_le_bytes()).unwrap();
                if behaviour == Fake::DiesAfterConnect {
                    return false;
                }
            }
            SET_MEM_TABLE if behaviour == Fake::RefusesMemoryTable => {
                ack(&mut stream, 1);
                return false;
            }
            SET_MEM_TABLE if behaviour == Fake::StallsStart => {
                let _ = released.recv();
                return false;
            }
            GET_VRING_BASE if behaviour == Fake::StallsRingStop => {
                let _ = released.recv();
                return reply(&mut stream, code, &body[..4].repeat(2)).is_err();
            }
            GET_VRING_BASE => reply(&mut stream, code, &body[..4].repeat(2)).unwrap(),
            _ => ack(&mut stream, 0),
        }
    }
}

/// Guest memory with two ready queues of 16, each with one LOOKUP waiting (request at
/// 0x10_0000 + 0x1000 * queue, reply buffer 0x800 further).
fn memory_and_queues() -> (crate::memory::GuestRam, Vec<Queue>) {
    let ram = create_guest_ram(4 << 20).unwrap();
    let queues = (0..NUM_QUEUES as u64)
        .map(|index| {
            let request = 0x10_0000 + 0x1000 * index;
            ram.memory
                .write_slice(&request_header(1, 100 + index), GuestAddress(request))
                .unwrap();
            let vq = MockSplitQueue::create(&ram.memory, GuestAddress(0x1_0000 * (index + 1)), 16);
            vq.add_desc_chains(&[raw(request, 40, N, 1), raw(request + 0x800, 64, W, 0)], 0)
                .unwrap();
            vq.create_queue().unwrap()
        })
        .collect();
    (ram, queues)
}

fn eventfds() -> Vec<EventFd> {
    (0..NUM_QUEUES)
        .map(|_| EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap())
        .collect()
}

/// With REPLY_ACK, the frontend asks for an acknowledgement of each request: one the
/// backend refuses fails the start, named, instead of passing unnoticed.
#[test]
fn a_request_the_backend_refuses_fails_the_start() {
    let fake = FakeBackend::start(Fake::RefusesMemoryTable);
    let mut backend = Backend::connect(&fake.socket, NUM_QUEUES).unwrap();
    let (ram, queues) = memory_and_queues();
    let kicks: Vec<_> = eventfds().into_iter().map(Arc::new).collect();
    let result = backend.start(FEATURE_VERSION_1, &ram.memory, &queues, &eventfds(), &kicks);
    assert!(
        matches!(
            result,
            Err(BackendError::Request {
                step: "SET_MEM_TABLE",
                ..
            })
        ),
        "{result:?}"
    );
    assert!(result.unwrap_err().ends_session());
}

/// A backend that stays connected but does not answer GET_VRING_BASE (a device reset
/// by the guest) is given up on after the timeout, so the vCPU that asked (holding the
/// device) goes on; its late answer is refused.
#[test]
fn a_backend_that_does_not_answer_is_given_up_on() {
    let fake = FakeBackend::start(Fake::StallsRingStop);
    let mut backend = Backend::connect(&fake.socket, NUM_QUEUES).unwrap();
    backend.set_reply_timeout(std::time::Duration::from_millis(200));
    let (done, stopped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let result = backend.stop_rings(NUM_QUEUES);
        // The backend comes back with it: its socket must stay open until the fake
        // replies, or that reply would fail however the session was ended.
        let _ = done.send((result, backend));
    });
    let (result, backend) = stopped
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("stopping the rings still waits for a backend that does not answer");
    assert!(
        matches!(
            result,
            Err(BackendError::NoAnswer {
                step: "GET_VRING_BASE",
                ..
            })
        ),
        "{result:?}"
    );
    assert!(backend.hung_up());
    fake.release();
    assert!(fake.saw_hang_up(), "the late answer was taken");
    drop(backend);
}

/// The guest's requests (waiting in both queues) are answered with EIO.
fn assert_requests_fail_with_eio(ram: &crate::memory::GuestRam) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    for index in 0..NUM_QUEUES as u64 {
        let mut reply = [0u8; 16];
        loop {
            ram.memory
                .read_slice(&mut reply, GuestAddress(0x10_0800 + 0x1000 * index))
                .unwrap();
            if reply != [0u8; 16] || std::time::Instant::now() > deadline {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let error = i32::from_le_bytes(reply[4..8].try_into().unwrap());
        let unique = u64::from_le_bytes(reply[8..16].try_into().unwrap());
        assert_eq!((error, unique), (-libc::EIO, 100 + index), "queue {index}");
    }
}

/// Starts `device` as the guest's driver does, with a request waiting in each queue
/// (see [`memory_and_queues`]); it must start whatever state its backend is in.
/// Returns the guest's memory, where the replies go.
fn start_with_requests_waiting(device: &mut VhostUserFs) -> crate::memory::GuestRam {
    let (ram, queues) = memory_and_queues();
    device.attach_queue_events(&eventfds()).unwrap();
    let interrupt = InterruptTrigger::new(Arc::new(
        EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap(),
    ));
    device
        .activate(ram.memory.clone(), queues, interrupt)
        .expect("the device starts without its backend");
    ram
}

/// A backend that stops answering as the driver starts the device is given up on:
/// its caller is told (to kill it), and the guest's requests wait while it runs, as
/// it may still complete them in the guest's memory; once it is gone they fail with
/// EIO.
#[test]
fn a_backend_given_up_on_is_reported_and_answered_for_only_once_gone() {
    let fake = FakeBackend::start(Fake::StallsStart);
    let (sink, heard) = events();
    let mut device = VhostUserFs::connect(&fake.socket, "share", sink).unwrap();
    device
        .backend
        .set_reply_timeout(std::time::Duration::from_millis(200));
    let ram = start_with_requests_waiting(&mut device);
    let event = heard
        .recv_timeout(std::time::Duration::from_secs(5))
        .expect("the caller was not told");
    assert!(
        matches!(&event, Event::FsBackendGivenUp { tag, reason }
            if tag == "share" && reason.contains("did not answer")),
        "{event:?}"
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut reply = [0u8; 16];
    ram.memory
        .read_slice(&mut reply, GuestAddress(0x10_0800))
        .unwrap();
    assert_eq!(reply, [0u8; 16], "answered while the backend still runs");
    fake.release();
    assert_requests_fail_with_eio(&ram);
    device.reset();
    assert!(heard.try_recv().is_err(), "told more than once");
}

/// A backend already gone when the driver starts the device: the device starts
/// anyway, and the guest's requests (waiting in both queues) are answered with EIO,
/// as Linux never looks at NEEDS_RESET and would wait on FUSE_INIT for ever. It is not
/// reported as given up on: it ended on its own, which its caller sees (and says how),
/// and there is nothing left to kill.
#[test]
fn a_backend_lost_before_the_driver_starts_answers_with_eio() {
    let fake = FakeBackend::start(Fake::DiesAfterConnect);
    let (sink, heard) = events();
    let mut device = VhostUserFs::connect(&fake.socket, "share", sink).unwrap();
    assert!(
        !fake.saw_hang_up(),
        "the fake backend ends the session itself"
    );
    let ram = start_with_requests_waiting(&mut device);
    assert_requests_fail_with_eio(&ram);
    device.reset();
    assert!(
        heard.try_recv().is_err(),
        "a backend that died on its own was reported as given up on"
    );
}
