#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vmm_fuzz::redact::run(data));
