//! How long the master's state lock is held by a `RemoveAll` of a large pool: `OBJECTS`
//! objects of 4 KiB (keys with a long common prefix, as real ones have) spread over 16
//! clients' segments, then one `RemoveAll { force: true }`; without HA, then with the state
//! journaling as an HA leader's does (every removal marked for replication, then taken as
//! changes). Every request of the master waits for that long.
//!
//! `cargo run --release -p kvferry-store --example remove_all_pause [objects]`

use std::time::Instant;

mod common;
use common::{counts, filled_state};

fn main() {
    let [objects] = counts("remove_all_pause", [("objects", 1_000_000)]);
    for journaling in [false, true] {
        let (mut st, m) = filled_state(objects, journaling);
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
