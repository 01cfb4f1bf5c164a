//! What reads cost the master under its state's lock when much else is held: reading every
//! member of one large group (each read leases the whole group), and releasing reads while
//! many replicas wait for reads to end before they are freed (deferred frees: a forced remove
//! or an upsert of an object being read).
//!
//! `cargo run --release -p kvferry-store --example read_walks [group members] [deferred]`

use kvferry_store::master::{MasterConfig, PutId, State, Stats};
use kvferry_store::proto::{ReplicateConfig, Segment};

mod common;
use common::{counts, longest, or_exit};

fn main() {
    let [members, deferred] = counts(
        "read_walks",
        [("group members", 20_000), ("deferred", 20_000)],
    );
    let (m, s) = (MasterConfig::default(), Stats::default());
    let put = PutId { client: 1, put: 1 };
    let lease = 5_000;

    // One group of `members` objects, then a read of each member (what a reader of a whole
    // request's KV blocks, put under one group id, does).
    let mut st = State::default();
    let seg = Segment {
        id: 1,
        name: "seg1".into(),
        te_endpoint: "127.0.0.1:20001".into(),
        base: 1 << 40,
        size: 1 << 40,
    };
    or_exit(st.mount(1, seg.clone(), 0), || "mount".into());
    let grouped = ReplicateConfig {
        group_id: Some("request-1".into()),
        ..Default::default()
    };
    let key = |i: u64| format!("block-{i:09}");
    for i in 0..members {
        let k = key(i);
        or_exit(
            st.put_start(&m, &s, put, &k, 4096, &grouped, false, 0)
                .and_then(|_| st.put_end(put, &k, 0)),
            || format!("put {k}"),
        );
    }
    longest(
        &format!("a read of each member of a group of {members}"),
        members,
        |i| {
            or_exit(st.get_replica_list(&key(i), 1, lease), || {
                format!("read {}", key(i))
            });
        },
    );

    // `deferred` objects each read, then removed by force: each one's space waits for its
    // read. Then each read released in turn, as readers finish (`ReleaseReads`).
    let mut st = State::default();
    or_exit(st.mount(1, seg, 0), || "mount".into());
    let plain = ReplicateConfig::default();
    let mut reads = Vec::with_capacity(deferred as usize);
    for i in 0..deferred {
        let k = key(i);
        or_exit(
            st.put_start(&m, &s, put, &k, 4096, &plain, false, 0)
                .and_then(|_| st.put_end(put, &k, 0)),
            || format!("put {k}"),
        );
        reads.push(or_exit(st.get_replica_list(&k, 1, lease), || format!("read {k}")).read_id);
        or_exit(st.remove(&m, &k, true, 2), || format!("remove {k}"));
    }
    let before = st.summary().deferred_frees;
    longest(
        &format!("a release of each of {deferred} reads, {before} frees waiting for them"),
        deferred,
        |i| {
            st.release_reads(&[reads[i as usize]], 3);
        },
    );
    let left = st.summary();
    println!(
        "left waiting: {} frees; bytes in use: {}",
        left.deferred_frees, left.bytes_used
    );
    if left.deferred_frees != 0 || left.bytes_used != 0 {
        eprintln!("read_walks: space still held after every read was released");
        std::process::exit(1);
    }
}
