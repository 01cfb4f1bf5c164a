//! How long the master's state lock is held by a `RemoveAll` of a large pool: `OBJECTS`
//! objects of 4 KiB (keys with a long common prefix, as real ones have) spread over 16
//! clients' segments, then one `RemoveAll { force: true }`; without HA, then with the state
//! journaling as an HA leader's does (every removal marked for replication, then taken as
//! changes). Every request of the master waits for that long.
//!
//! `cargo run --release -p kvferry-store --example remove_all_pause [objects]`

use kvferry_store::master::{MasterConfig, PutId, State, Stats};
use kvferry_store::proto::{ReplicateConfig, Segment};
use std::time::Instant;

mod common;
use common::{counts, or_exit};

fn main() {
    let [objects] = counts("remove_all_pause", [("objects", 1_000_000)]);
    for journaling in [false, true] {
        let mut st = State::default();
        if journaling {
            st.journal_on();
        }
        let clients = 16u64;
        for c in 1..=clients {
            let seg = Segment { id: c, name: format!("seg{c}"), te_endpoint: format!("127.0.0.1:{}", 20000 + c), base: c << 44, size: 1 << 42 };
            or_exit(st.mount(c, seg, 0), || "mount".into());
        }
        let (m, s) = (MasterConfig::default(), Stats::default());
        for i in 0..objects {
            let c = 1 + i % clients;
            let key = format!("prefill-tenant-0042/layer-block-{c}-{i:09}");
            or_exit(st.put_start(&m, &s, PutId { client: c, put: 1 }, &key, 4096, &ReplicateConfig::default(), false, 0).and_then(|_| st.put_end(PutId { client: c, put: 1 }, &key, 0)), || format!("put {key}"));
        }
        let _ = st.take_changes(0);
        let t = Instant::now();
        let removed = st.remove_matching(&m, |_| true, true, 1);
        let held = t.elapsed();
        let n = removed.count();
        // (The master's server frees what was removed after it let the lock go.)
        let t = Instant::now();
        drop(removed);
        let freed = t.elapsed();
        let t = Instant::now();
        let changes = st.take_changes(1).len();
        println!(
            "{}: RemoveAll of {n} objects held the state lock {:.0} ms (their memory freed after it, {:.0} ms){}",
            if journaling { "journaling (HA leader)" } else { "no HA" },
            held.as_secs_f64() * 1e3,
            freed.as_secs_f64() * 1e3,
            if journaling { format!(", taking its {changes} changes {:.0} ms more", t.elapsed().as_secs_f64() * 1e3) } else { String::new() }
        );
    }
}
