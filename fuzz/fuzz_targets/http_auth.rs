#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvferry::fuzz::http_auth(data));
