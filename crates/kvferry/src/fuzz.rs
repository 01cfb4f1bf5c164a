//! Entries for fuzzing the decoders that read bytes from the network, before and after the
//! cluster key's proof. Each takes arbitrary bytes and must never panic (nor, for the data
//! port, touch memory outside what is registered). The coverage-guided targets in `fuzz/`
//! (cargo-fuzz, libFuzzer) call them, and so do the property tests below, which
//! `scripts/test` runs on every change (random inputs, no coverage feedback). Built only for
//! tests and with the `fuzzing` feature.

use crate::wire::{descriptor::SegmentDesc, handshake};

/// The handshake port: a frame as the listener reads it (length prefix bounded, type byte,
/// JSON body), its descriptor, notify and probe bodies.
pub fn handshake_frame(data: &[u8]) {
    if let Ok(Some((f, _))) = handshake::decode(data, 1 << 16) {
        let _ = SegmentDesc::decode(&f.body);
        let _ = handshake::parse_json::<serde_json::Value>("fuzz", &f.body);
    }
}

/// The TCP data port's target side, with and without a key, before and after a handshake
/// (see `transport::tcp::target_conn::fuzz_drive`).
pub fn tcp_serve(data: &[u8]) {
    crate::transport::tcp::fuzz_drive(data);
}

/// What [`tcp_serve`] landed: bytes of the registered page changed.
#[cfg(test)]
fn landed(data: &[u8]) -> usize {
    crate::transport::tcp::fuzz_drive(data)
}

/// The signed-request header of the HTTP surfaces (`X-Kvferry-Auth`) as a server reads it,
/// and a request checked against it.
pub fn http_auth(data: &[u8]) {
    let key =
        crate::auth::ClusterKey::parse(&[b'h'; 64], std::path::Path::new("fuzz")).expect("a key");
    let split = usize::from(data.first().copied().unwrap_or(0)).min(data.len());
    let (header, body) = data.split_at(split);
    let now = 1_800_000_000_000;
    if let Ok(claim) = crate::auth_http::Claim::parse(Some(header), now) {
        let _ = claim.check_tag(&key, "PUT", "/metadata?key=x", body);
    }
}

/// The cluster key's handshake and sealed frames as a responder and an opener read them: an
/// opening message, then what follows as sealed frames of the session it would give.
pub fn noise(data: &[u8]) {
    let key =
        crate::auth::ClusterKey::parse(&[b'n'; 64], std::path::Path::new("fuzz")).expect("a key");
    let split = usize::from(data.first().copied().unwrap_or(0)).min(data.len());
    let (hello, rest) = data.split_at(split);
    if let Ok((session, _)) =
        crate::auth::answer(&key, crate::auth::Protocol("fuzz"), hello, &["t"])
    {
        let (_, mut open) = session.split();
        if let Some(head) = rest.first_chunk::<{ crate::auth::FRAME_HEAD_LEN }>() {
            if let Ok(n) = open.open_frame_head(head, 1 << 16) {
                let mut out = Vec::new();
                let body = &rest[crate::auth::FRAME_HEAD_LEN..];
                let _ = open.open_frame_body(
                    &body[..crate::auth::frame_body_len(n).min(body.len())],
                    &mut out,
                );
            }
        }
    }
    // An initiator's view of an answer.
    if let Ok((init, _)) = crate::auth::Initiator::new(&key, crate::auth::Protocol("fuzz"), "t") {
        let _ = init.finish(data);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
        #[test]
        fn handshake_frames_never_panic(b in proptest::collection::vec(any::<u8>(), 0..512)) {
            super::handshake_frame(&b);
        }

        #[test]
        fn the_data_port_never_panics_nor_writes_outside_registered_memory(mode in 0u8..5, cut in any::<u8>(), b in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let mut data = vec![mode, cut];
            data.extend_from_slice(&b);
            super::tcp_serve(&data);
        }

        #[test]
        fn http_auth_headers_never_panic(b in proptest::collection::vec(any::<u8>(), 0..512)) {
            super::http_auth(&b);
        }

        #[test]
        fn noise_messages_and_sealed_frames_never_panic(b in proptest::collection::vec(any::<u8>(), 0..1024)) {
            super::noise(&b);
        }
    }

    /// The entry reaches what is decoded after the proof: a WRITE of 8 bytes at the start of
    /// the registered page lands, without a key and after a keyed handshake; before the
    /// handshake, nothing does.
    #[test]
    fn the_data_port_entry_reaches_requests_after_the_handshake() {
        let mut write = vec![8, 0, 0, 0, 0, 0, 0, 0];
        write.extend_from_slice(&4096u64.to_le_bytes()); // the page's start
        write.extend_from_slice(&[0x81, 0, 0, 0, 0, 0, 0, 0]);
        write.push(8);
        write.extend_from_slice(&[0x11; 8]);
        for cut in [1u8, 7, 255] {
            assert_eq!(
                super::landed(&[&[0, cut][..], &write].concat()),
                8,
                "no key, pieces of {cut}"
            );
            for protect in [2u8, 3, 4] {
                assert_eq!(
                    super::landed(&[&[protect, cut][..], &write].concat()),
                    8,
                    "keyed ({protect}), pieces of {cut}"
                );
            }
            assert_eq!(
                super::landed(&[&[1, cut][..], &write].concat()),
                0,
                "keyed, no handshake"
            );
        }
    }
}
