//! Helpers shared by the master's pause examples (`mod common;` in each): their whole-number
//! arguments, how they stop on an error, and the longest of many steps. Not an example of its
//! own (Cargo builds `examples/<name>.rs` and `examples/<name>/main.rs`, not this `mod.rs`).
#![allow(dead_code)]

use std::time::{Duration, Instant};

/// The whole-number arguments of example `example`, in order, each `(name, default)`; one that
/// is not a whole number ends the example with its usage (exit status 2).
pub fn counts<const N: usize>(example: &str, args: [(&str, u64); N]) -> [u64; N] {
    let usage: Vec<String> = args.iter().map(|(name, _)| format!("[{name}]")).collect();
    let mut given = std::env::args().skip(1);
    args.map(|(name, default)| match given.next() {
        None => default,
        Some(a) => a.parse().unwrap_or_else(|_| {
            eprintln!(
                "{example}: {name} {a:?} is not a whole number; usage: {example} {}",
                usage.join(" ")
            );
            std::process::exit(2)
        }),
    })
}

/// `r`'s value; an error ends the example saying what failed (exit status 1).
pub fn or_exit<T, E: std::fmt::Display>(r: Result<T, E>, what: impl FnOnce() -> String) -> T {
    r.unwrap_or_else(|e| {
        eprintln!("{}: {e}", what());
        std::process::exit(1)
    })
}

/// Runs `step(i)` for each `i` in `0..n`, and prints the whole time and the longest step
/// (which `i`), as `what`.
pub fn longest(what: &str, n: u64, mut step: impl FnMut(u64)) {
    let (mut worst, mut at, t) = (Duration::ZERO, 0, Instant::now());
    for i in 0..n {
        let one = Instant::now();
        step(i);
        if one.elapsed() > worst {
            (worst, at) = (one.elapsed(), i);
        }
    }
    println!(
        "{what}: {n} in {:.2} s, the longest {:.1} ms (step {at})",
        t.elapsed().as_secs_f64(),
        worst.as_secs_f64() * 1e3
    );
}

/// A state with `objects` objects of 4 KiB (keys with a long common prefix, as real ones have)
/// spread over 16 clients' segments, journaling as an HA leader's does when `journaling` (the
/// changes of the fill taken already), and the master settings it was filled with.
pub fn filled_state(
    objects: u64,
    journaling: bool,
) -> (
    kvferry_store::master::State,
    kvferry_store::master::MasterConfig,
) {
    use kvferry_store::master::{MasterConfig, PutId, State, Stats};
    use kvferry_store::proto::{ReplicateConfig, Segment};
    let mut st = State::default();
    if journaling {
        st.journal_on();
    }
    let clients = 16u64;
    for c in 1..=clients {
        let seg = Segment {
            id: c,
            name: format!("seg{c}"),
            te_endpoint: format!("127.0.0.1:{}", 20000 + c),
            base: c << 44,
            size: 1 << 42,
        };
        or_exit(st.mount(c, seg, 0), || "mount".into());
    }
    let (m, s) = (MasterConfig::default(), Stats::default());
    for i in 0..objects {
        let c = 1 + i % clients;
        let key = format!("prefill-tenant-0042/layer-block-{c}-{i:09}");
        or_exit(
            st.put_start(
                &m,
                &s,
                PutId { client: c, put: 1 },
                &key,
                4096,
                &ReplicateConfig::default(),
                false,
                0,
            )
            .and_then(|_| st.put_end(PutId { client: c, put: 1 }, &key, 0)),
            || format!("put {key}"),
        );
    }
    let _ = st.take_changes(0);
    (st, m)
}
