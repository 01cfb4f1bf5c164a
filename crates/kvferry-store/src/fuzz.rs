//! Entries for fuzzing what the store reads from the network, before and after the cluster
//! key's proof: the master's RPC frames, the replication link's frames, and what a master
//! reads from etcd about its peers. Each takes arbitrary bytes and must never panic. The
//! coverage-guided targets in `fuzz/` (cargo-fuzz, libFuzzer) call them, and so do the
//! property tests below, which `scripts/test` runs on every change. Built only for tests and
//! with the `fuzzing` feature.

use crate::proto::{self, Request, Response};

/// The master's RPC: a frame's length prefix, its body as a request (with the decode bound a
/// master applies) and as an answer (what a client decodes), and a keyed connection's first
/// frame as the hello it must be.
pub fn rpc(data: &[u8]) {
    if let Some(prefix) = data.first_chunk::<4>() {
        let _ = proto::decode_len(*prefix);
    }
    let _ = proto::decode_request(data);
    let _ = proto::decode::<Response>(data);
    let _ = proto::auth_hello_of(data);
    // A request that decodes encodes again.
    if let Ok(r) = proto::decode::<Request>(data) {
        let _ = proto::encode(&r);
    }
}

/// The replication link: a stream of frames as either side reads it, and a standby's
/// registration in etcd.
pub fn ha(data: &[u8]) {
    let _ = crate::ha::sync::decode_frame::<crate::ha::sync::ToStandby>(data);
    let _ = crate::ha::sync::decode_frame::<crate::ha::sync::ToLeader>(data);
    let _ = crate::ha::sync::parse_registration(&String::from_utf8_lossy(data));
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]
        #[test]
        fn rpc_frames_never_panic(b in proptest::collection::vec(any::<u8>(), 0..1024)) {
            super::rpc(&b);
        }

        #[test]
        fn replication_frames_never_panic(b in proptest::collection::vec(any::<u8>(), 0..1024)) {
            super::ha(&b);
        }

        /// Mutated real frames (not just random bytes) reach deep into the decoders.
        #[test]
        fn mutated_requests_never_panic(flip in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
            let r = crate::proto::Request::Batch(vec![
                crate::proto::Request::PutStart { client: 7, key: "key".into(), size: 4096, config: Default::default(), upsert: false, put: 1 },
                crate::proto::Request::Remove { key: "k2".into(), force: true },
                crate::proto::Request::HoldWrites { client: 1, writes: vec![] },
            ]);
            let mut f = crate::proto::encode(&r).unwrap();
            for (i, b) in flip {
                let at = i.index(f.len());
                f[at] = b;
            }
            super::rpc(&f[4..]);
            super::ha(&f);
        }
    }
}
