//! The longest single insert while a map of objects grows: the master's state (every request
//! waits for it, the state's lock held) and a standby's mirror (its acknowledgements wait for
//! it). A hash map grows by doubling, and the insert that grows it moves every object; under
//! churn (removes and puts at a steady size) its tombstones make an insert rehash it in place.
//! Beside them, one plain hash map of objects of about the state's size, filled and churned.
//!
//! `cargo run --release -p kvferry-store --example growth_pause [objects]`

use kvferry_store::master::changes::{Change, Image, ObjectRec};
use kvferry_store::master::{MasterConfig, PutId, State, Stats};
use kvferry_store::proto::{ReplicateConfig, Segment};

mod common;
use common::{counts, longest, or_exit};

fn main() {
    let [objects] = counts("growth_pause", [("objects", 2_000_000)]);
    let mut st = State::default();
    let seg = Segment {
        id: 1,
        name: "seg1".into(),
        te_endpoint: "127.0.0.1:20001".into(),
        base: 1 << 40,
        size: 1 << 40,
    };
    or_exit(st.mount(1, seg, 0), || "mount".into());
    let (m, s, cfg) = (
        MasterConfig::default(),
        Stats::default(),
        ReplicateConfig::default(),
    );
    let key = |i: u64| format!("obj-{i:09}");
    longest("master state, puts", objects, |i| {
        let k = key(i);
        or_exit(
            st.put_start(
                &m,
                &s,
                PutId { client: 1, put: 1 },
                &k,
                4096,
                &cfg,
                false,
                0,
            )
            .and_then(|_| st.put_end(PutId { client: 1, put: 1 }, &k, 0)),
            || format!("put {k}"),
        );
    });
    // Churn at a steady size: the oldest object removed, a new one put, as many times. A hash
    // table's removals leave tombstones that use up its room, and then an insert rehashes the
    // table in place, every object moved, with the lock held.
    longest(
        "master state, churn (a remove and a put each)",
        objects,
        |i| {
            let k = key(objects + i);
            or_exit(
                st.remove(&m, &key(i), true, 0)
                    .and_then(|_| {
                        st.put_start(
                            &m,
                            &s,
                            PutId { client: 1, put: 1 },
                            &k,
                            4096,
                            &cfg,
                            false,
                            0,
                        )
                    })
                    .and_then(|_| st.put_end(PutId { client: 1, put: 1 }, &k, 0)),
                || format!("churn {k}"),
            );
        },
    );
    // The same two phases in one hash map of objects about the state's size, for comparison.
    let mut one_map: std::collections::HashMap<Box<str>, [u64; 20]> =
        std::collections::HashMap::new();
    longest("one hash map, inserts", objects, |i| {
        one_map.insert(key(i).into(), [i; 20]);
    });
    longest("one hash map, churn", objects, |i| {
        one_map.remove(key(i).as_str());
        one_map.insert(key(objects + i).into(), [i; 20]);
    });
    let mut image = Image::default();
    longest("standby mirror, objects", objects, |i| {
        let rec = ObjectRec {
            size: 4096,
            current: [(1, (1 << 40) + i * 4096, 4096)].into_iter().collect(),
            pending: None,
            owner: 1,
            hard_pin: false,
            soft_pin_left: 0,
            group: None,
        };
        image.apply(Change::Object { key: key(i), rec });
    });
}
