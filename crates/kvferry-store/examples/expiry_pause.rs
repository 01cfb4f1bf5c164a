//! How long the master's state lock is held when many clients die together: a state with
//! `OBJECTS` objects (one replica each, spread over the segments of `CLIENTS` clients, one
//! segment each), then all but one client stop pinging and one tick's expiry drops them.
//! Every request of the master waits for that long.
//!
//! `cargo run --release -p kvferry-store --example expiry_pause [objects] [clients]`

use kvferry_store::master::{MasterConfig, PutId, State, Stats};
use kvferry_store::proto::{ReplicateConfig, Segment};
use std::time::Instant;

mod common;
use common::{counts, or_exit};

fn main() {
    let [objects, clients] = counts("expiry_pause", [("objects", 1_000_000), ("clients", 100)]);
    let clients = clients.max(2);
    let mut st = State::default();
    for c in 1..=clients {
        let seg = Segment {
            id: c,
            name: format!("seg{c}"),
            te_endpoint: format!("127.0.0.1:{}", 20000 + c),
            base: c << 40,
            size: 1 << 36,
        };
        or_exit(st.mount(c, seg, 0), || "mount".into());
    }
    let (m, s) = (MasterConfig::default(), Stats::default());
    let t = Instant::now();
    for i in 0..objects {
        let c = 1 + i % clients;
        let cfg = ReplicateConfig {
            preferred_segments: vec![format!("seg{c}")],
            ..ReplicateConfig::default()
        };
        let key = format!("obj-{i:09}");
        or_exit(
            st.put_start(
                &m,
                &s,
                PutId { client: c, put: 1 },
                &key,
                4096,
                &cfg,
                false,
                0,
            )
            .and_then(|_| st.put_end(PutId { client: c, put: 1 }, &key, 0)),
            || format!("put {key}"),
        );
    }
    println!(
        "{objects} objects on {clients} clients' segments in {:.2} s",
        t.elapsed().as_secs_f64()
    );
    // Every client but the last stops pinging.
    st.ping(clients, 5_000);
    let t = Instant::now();
    let dead = st.expire_clients(10_001, 10_000, 600_000);
    println!(
        "{} clients expired in one tick: the state lock held {:.1} ms",
        dead.len(),
        t.elapsed().as_secs_f64() * 1e3
    );
}
