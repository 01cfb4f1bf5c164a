//! The longest single insert while a map of objects grows: the master's state (every request
//! waits for it, the state's lock held) and a standby's mirror (its acknowledgements wait for
//! it). A hash map grows by doubling, and the insert that grows it moves every object; under
//! churn (removes and puts at a steady size) its tombstones make an insert rehash it in place.
//! Beside them, one plain hash map of objects of about the state's size, filled and churned.
//!
//! `cargo run --release -p kvferry-store --example growth_pause [objects]`

use kvferry_store::master::journal::{Change, Image, ObjectRec};
use kvferry_store::master::{MasterConfig, State, Stats};
use kvferry_store::proto::{ReplicateConfig, Segment};
use std::time::{Duration, Instant};

fn main() {
    let objects: u64 = match std::env::args().nth(1) {
        None => 2_000_000,
        Some(a) => a.parse().unwrap_or_else(|_| {
            eprintln!("growth_pause: objects {a:?} is not a whole number; usage: growth_pause [objects]");
            std::process::exit(2)
        }),
    };
    let mut st = State::default();
    let seg = Segment { id: 1, name: "seg1".into(), te_endpoint: "127.0.0.1:20001".into(), base: 1 << 40, size: 1 << 40 };
    if let Err(e) = st.mount(1, seg, 0) {
        eprintln!("mount: {e}");
        std::process::exit(1);
    }
    let (m, s, cfg) = (MasterConfig::default(), Stats::default(), ReplicateConfig::default());
    let (mut worst, mut at, t) = (Duration::ZERO, 0, Instant::now());
    for i in 0..objects {
        let key = format!("obj-{i:09}");
        let one = Instant::now();
        if let Err(e) = st.put_start(&m, &s, 1, &key, 4096, &cfg, false, 0).and_then(|_| st.put_end(1, &key, 0)) {
            eprintln!("put {key}: {e}");
            std::process::exit(1);
        }
        if one.elapsed() > worst {
            (worst, at) = (one.elapsed(), i);
        }
    }
    println!("master state: {objects} puts in {:.2} s, the longest {:.1} ms (object {at})", t.elapsed().as_secs_f64(), worst.as_secs_f64() * 1e3);
    // Churn at a steady size: the oldest object removed, a new one put, as many times. A hash
    // table's removals leave tombstones that use up its room, and then an insert rehashes the
    // table in place, every object moved, with the lock held.
    let (mut worst, mut at, t) = (Duration::ZERO, 0, Instant::now());
    for i in 0..objects {
        let (old, key) = (format!("obj-{i:09}"), format!("obj-{:09}", objects + i));
        let one = Instant::now();
        if let Err(e) = st.remove(&m, &old, true, 0).and_then(|_| st.put_start(&m, &s, 1, &key, 4096, &cfg, false, 0)).and_then(|_| st.put_end(1, &key, 0)) {
            eprintln!("churn {key}: {e}");
            std::process::exit(1);
        }
        if one.elapsed() > worst {
            (worst, at) = (one.elapsed(), i);
        }
    }
    println!("master state, churn: {objects} removes and puts in {:.2} s, the longest {:.1} ms (step {at})", t.elapsed().as_secs_f64(), worst.as_secs_f64() * 1e3);
    // The same two phases in one hash map of objects about the state's size, for comparison.
    let mut one_map: std::collections::HashMap<Box<str>, [u64; 20]> = std::collections::HashMap::new();
    let longest = |phase: &str, f: &mut dyn FnMut(u64)| {
        let (mut worst, mut at, t) = (Duration::ZERO, 0, Instant::now());
        for i in 0..objects {
            let one = Instant::now();
            f(i);
            if one.elapsed() > worst {
                (worst, at) = (one.elapsed(), i);
            }
        }
        println!("one hash map, {phase}: {objects} in {:.2} s, the longest {:.1} ms (step {at})", t.elapsed().as_secs_f64(), worst.as_secs_f64() * 1e3);
    };
    longest("inserts", &mut |i| {
        one_map.insert(format!("obj-{i:09}").into(), [i; 20]);
    });
    longest("churn", &mut |i| {
        one_map.remove(format!("obj-{i:09}").as_str());
        one_map.insert(format!("obj-{:09}", objects + i).into(), [i; 20]);
    });
    let mut image = Image::default();
    let (mut worst, mut at, t) = (Duration::ZERO, 0, Instant::now());
    for i in 0..objects {
        let rec = ObjectRec { size: 4096, current: [(1, (1 << 40) + i * 4096, 4096)].into_iter().collect(), pending: None, owner: 1, hard_pin: false, soft_pin_left: 0, group: None };
        let c = Change::Object { key: format!("obj-{i:09}"), rec };
        let one = Instant::now();
        image.apply(c);
        if one.elapsed() > worst {
            (worst, at) = (one.elapsed(), i);
        }
    }
    println!("standby mirror: {objects} objects in {:.2} s, the longest {:.1} ms (object {at})", t.elapsed().as_secs_f64(), worst.as_secs_f64() * 1e3);
}
