//! The hand-written sessions get the answers a correct device gives, through the same
//! harnesses libFuzzer runs: so the harnesses do reach the devices' request handling.

use vm_memory::{Bytes, GuestAddress};
use vmm_fuzz::guest::{used_element, used_index};
use vmm_fuzz::mmio::{self, disk_pattern};
use vmm_fuzz::seeds::*;
use vmm_fuzz::{fs_fallback, redact, vsock};

fn read(memory: &vmm::memory::GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    memory
        .read_slice(&mut out, GuestAddress(addr))
        .expect("inside guest memory");
    out
}

fn sector(content: &[u8], n: u64) -> &[u8] {
    &content[(n * SECTOR) as usize..((n + 1) * SECTOR) as usize]
}

#[test]
fn a_read_request_gets_the_sector_into_the_second_region() {
    let session = mmio::run_input(&block_request(true, BLK_IN, 3, DATA, 512, &[]));
    assert_eq!(read(&session.memory, STATUS, 1), [BLK_OK]);
    assert_eq!(read(&session.memory, DATA, 512), sector(&disk_pattern(), 3));
    assert_eq!(used_index(&session.memory, USED), 1);
    assert_eq!(used_element(&session.memory, USED, 0), (0, 513));
}

#[test]
fn a_write_request_reaches_the_disk_unless_it_is_read_only() {
    let payload = vec![b'W'; 512];
    let mut session = mmio::run_input(&block_request(false, BLK_OUT, 5, DATA, 512, &payload));
    assert_eq!(read(&session.memory, STATUS, 1), [BLK_OK]);
    assert_eq!(sector(&session.disk_content().unwrap(), 5), &payload[..]);

    // The harness's own check fails the run if the read-only disk changed.
    let session = mmio::run_input(&block_request(true, BLK_OUT, 5, DATA, 512, &payload));
    assert_eq!(read(&session.memory, STATUS, 1), [BLK_IOERR]);
}

#[test]
fn buffers_across_the_hole_or_past_memory_are_refused() {
    for (data, len) in [
        (0x7f00, 512),             // runs from the first region into the hole
        (0x1_7f00, 512),           // runs past the end of memory
        (u64::MAX - 100, 512),     // wraps around
        (DATA, 512 * 1024 * 1024), // longer than the disk
    ] {
        let session = mmio::run_input(&block_request(true, BLK_IN, 0, data, len, &[]));
        assert_eq!(
            read(&session.memory, STATUS, 1),
            [BLK_IOERR],
            "data at {data:#x}+{len:#x}"
        );
        assert_eq!(used_index(&session.memory, USED), 1);
    }
}

#[test]
fn the_rng_fills_the_buffer() {
    let session = mmio::run_input(&rng_request());
    assert_eq!(used_element(&session.memory, USED, 0), (0, 64));
    assert!(read(&session.memory, DATA, 64).iter().any(|&b| b != 0));
}

/// The reported pages read as zeros afterwards: the device dropped them.
#[test]
fn the_balloon_drops_the_reported_pages() {
    let session = mmio::run_input(&balloon_report());
    let reporting = balloon_layouts()[2];
    assert_eq!(used_element(&session.memory, reporting.used, 0), (0, 0));
    assert!(read(&session.memory, DATA, 0x2000).iter().all(|&b| b == 0));
}

/// The line reaches the output, and its buffer comes back.
#[test]
fn the_consoles_line_reaches_the_output() {
    let mut session = mmio::run_input(&console_write());
    let [_, transmit] = console_layouts();
    assert_eq!(used_element(&session.memory, transmit.used, 0), (0, 0));
    assert_eq!(session.console_written().unwrap(), CONSOLE_LINE);
}

#[test]
fn a_guest_connects_to_the_host_service_and_its_data_arrives() {
    let mut session = vsock::run_input(&vsock_connect_and_send()).expect("valid queues");
    let [rx, tx, _] = vsock_layouts();
    assert_eq!(
        used_index(&session.memory, tx.used),
        2,
        "both packets taken"
    );
    assert_eq!(
        used_index(&session.memory, rx.used),
        1,
        "the answer delivered"
    );
    let answer = read(&session.memory, RX_BUFFER, 44);
    let op = u16::from_le_bytes([answer[30], answer[31]]);
    assert_eq!(op, VSOCK_RESPONSE, "header {answer:?}");
    assert_eq!(session.service_received(), b"hello");
}

#[test]
fn requests_after_the_backend_died_get_eio_and_forget_gets_nothing() {
    let memory = fs_fallback::run_input(&fs_requests()).expect("a valid queue");
    let reply = read(&memory, FUSE_REPLY, 16);
    assert_eq!(&reply[..4], &16u32.to_le_bytes());
    assert_eq!(&reply[4..8], &(-5i32).to_le_bytes(), "EIO");
    assert_eq!(&reply[8..], &UNIQUE.to_le_bytes());
    assert_eq!(used_index(&memory, USED), 2);
    assert_eq!(used_element(&memory, USED, 0), (0, 16));
    assert_eq!(used_element(&memory, USED, 1), (2, 0));
}

/// `len` bytes of the mask the redaction writes.
fn mask(len: usize) -> Vec<u8> {
    let mut mask = b"[REDACTED]".to_vec();
    mask.resize(len, b'*');
    mask
}

/// The session's run, which the harness's own checks pass.
fn redacted(input: &redact::Input) -> redact::Outcome {
    let outcome = redact::run_input(input);
    redact::check(input, &outcome);
    outcome
}

#[test]
fn an_echoed_header_split_across_chunks_is_masked_whole() {
    let outcome = redacted(&bearer_echo());
    let value_len = "Bearer ".len() + SECRET.len();
    let expected = [
        b"{\"headers\": {\"authorization\": \"".as_slice(),
        &mask(value_len),
        b"\"}}\n",
    ]
    .concat();
    assert_eq!(outcome.sent, expected);
    assert_eq!(outcome.probes, 0);
}

#[test]
fn a_pause_inside_the_secret_lets_only_a_short_start_through() {
    let outcome = redacted(&pause_inside_the_secret());
    // The 5 bytes before the pause went on; the rest, masked as a part of the whole.
    let expected = [b"data: sk-an".as_slice(), &mask(SECRET.len())[5..], b"\n\n"].concat();
    assert_eq!(outcome.sent, expected);
    assert!(outcome.paused);
}

#[test]
fn gits_encoded_credential_arriving_a_byte_at_a_time_is_masked() {
    let outcome = redacted(&git_basic_bytewise());
    let word_len = outcome.stream.len() - "auth=".len();
    assert_eq!(
        outcome.sent,
        [b"auth=".as_slice(), &mask(word_len)].concat()
    );
}

#[test]
fn the_third_probe_withdraws_the_secret_before_its_response_goes_on() {
    let outcome = redacted(&probes_for_the_secret());
    assert!(outcome.withdrawn);
    assert_eq!(outcome.probes, 3);
    let guess = &SECRET[..20];
    assert_eq!(outcome.sent, [guess, b"x", guess, b"y"].concat());
}

/// A secret whose end begins it again: where the upstream's bytes after a copy
/// complete another, overlapping one, the copy is masked and the rest is the sender's
/// own, which the harness accepts.
#[test]
fn of_overlapping_copies_of_a_secret_the_first_is_masked() {
    let secret = b"abcdefghabcdefgh".to_vec();
    let input = redact::Input {
        form: redact::Form::Bare,
        watched: false,
        secret: secret.clone(),
        ops: vec![
            redact::Op::Bytes([secret.as_slice(), b"abcdefgh!"].concat()),
            redact::Op::Chunk,
        ],
    };
    let outcome = redacted(&input);
    assert_eq!(
        outcome.sent,
        [mask(secret.len()), b"abcdefgh!".to_vec()].concat()
    );
}

#[test]
fn every_seed_survives_encoding() {
    assert_eq!(
        mmio::Input::decode(&block_request(false, BLK_OUT, 5, DATA, 512, b"x").encode()),
        block_request(false, BLK_OUT, 5, DATA, 512, b"x")
    );
    assert_eq!(
        vsock::Input::decode(&vsock_connect_and_send().encode()),
        vsock_connect_and_send()
    );
    assert_eq!(
        fs_fallback::Input::decode(&fs_requests().encode()),
        fs_requests()
    );
    for session in [
        bearer_echo(),
        pause_inside_the_secret(),
        git_basic_bytewise(),
        probes_for_the_secret(),
    ] {
        assert_eq!(redact::Input::decode(&session.encode()), session);
    }
}
