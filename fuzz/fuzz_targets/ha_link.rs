#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvferry_store::fuzz::ha(data));
