//! A few thousand inputs per harness, from a fixed seed: random bytes, and the
//! hand-written sessions with bytes changed, cut or repeated (which keep enough
//! structure to reach request handling). A cheap stand-in for a fuzzing campaign on
//! every test run; `fuzz/README.md` says how to run libFuzzer for longer.

use std::panic::{catch_unwind, AssertUnwindSafe};

use vmm_fuzz::{fs_fallback, mmio, redact, seeds, vsock};

const RUNS: usize = 3000;

/// xorshift64*: repeatable, and good enough to pick bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut data = seed.to_vec();
    for _ in 0..=rng.below(8) {
        match rng.below(4) {
            0 if !data.is_empty() => {
                let at = rng.below(data.len());
                data[at] = rng.next() as u8;
            }
            1 if !data.is_empty() => {
                let at = rng.below(data.len());
                data[at] ^= 1 << rng.below(8);
            }
            2 => data.truncate(rng.below(data.len() + 1)),
            _ => {
                let at = rng.below(data.len() + 1);
                let len = rng.below(64);
                let repeated: Vec<u8> = data[at..].iter().copied().take(len).collect();
                data.extend(repeated);
            }
        }
    }
    data
}

fn inputs(target: &str, seed: u64) -> impl Iterator<Item = Vec<u8>> {
    let seeds: Vec<Vec<u8>> = seeds::corpus()
        .into_iter()
        .filter(|(t, _, _)| *t == target)
        .map(|(_, _, data)| data)
        .collect();
    let mut rng = Rng(seed);
    (0..RUNS).map(move |i| {
        if i % 2 == 0 || seeds.is_empty() {
            let len = rng.below(2048);
            (0..len).map(|_| rng.next() as u8).collect()
        } else {
            let seed = &seeds[rng.below(seeds.len())];
            mutate(&mut rng, seed)
        }
    })
}

fn survive(target: &str, seed: u64, run: fn(&[u8])) {
    for (i, data) in inputs(target, seed).enumerate() {
        if catch_unwind(AssertUnwindSafe(|| run(&data))).is_err() {
            let hex: String = data.iter().map(|b| format!("{b:02x}")).collect();
            panic!("{target}: input {i} of seed {seed:#x} panicked; the input: {hex}");
        }
    }
}

#[test]
fn mmio_devices_survive_random_drivers() {
    survive("mmio", 0x5eed_0001, mmio::run);
}

#[test]
fn vsock_survives_random_queues_and_packets() {
    survive("vsock", 0x5eed_0002, vsock::run);
}

#[test]
fn fs_fallback_survives_random_requests() {
    survive("fs_fallback", 0x5eed_0003, fs_fallback::run);
}

#[test]
fn redaction_keeps_the_secret_from_random_streams() {
    survive("redact", 0x5eed_0004, redact::run);
}

#[test]
fn mutation_keeps_inputs_varied() {
    let mut rng = Rng(1);
    let seed = seeds::rng_request().encode();
    let mutated: std::collections::HashSet<Vec<u8>> =
        (0..100).map(|_| mutate(&mut rng, &seed)).collect();
    assert!(mutated.len() > 90, "{} distinct of 100", mutated.len());
}
