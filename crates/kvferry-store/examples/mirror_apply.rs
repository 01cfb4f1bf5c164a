//! What a standby's mirror costs, and what rebuilding a new leader's state from it costs, in
//! the rate bench's shape: `objects` objects put as `store-bench --ha` puts them (a `PutStart`
//! batch of `per` keys, then their `PutEnd` batch), each batch one replication entry.
//!
//! ```sh
//! cargo run --release -p kvferry-store --example mirror_apply [objects] [per]
//! ```
//!
//! Prints, per round: the entries' decoding and applying to the mirror, per change and per
//! object; then the takeover's rebuild of a master state from that mirror
//! (`Image::into_state`). Single-threaded, no I/O.

use kvferry_store::ha::sync::{decode_frame, encode_frame, ToStandby};
use kvferry_store::master::changes::{Change, Image, ObjectRec, PendingRec};
use kvferry_store::proto::Segment;
use kvferry_store::SoftPin;
use std::time::Instant;

fn main() -> Result<(), String> {
    let arg = |i: usize, d: usize| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(d)
    };
    let (objects, per) = (arg(1, 1_200_000), arg(2, 128).max(1));
    let seg = 7u64;
    let mount = Change::Mount {
        client: 1000,
        seg: Segment {
            id: seg,
            name: "bench".into(),
            te_endpoint: "127.0.0.1:1".into(),
            base: 0,
            size: 1 << 44,
        },
    };
    let mut frames = vec![encode_frame(&ToStandby::Entry {
        seq: 1,
        changes: vec![
            Change::Client {
                id: 1000,
                live: true,
            },
            mount,
        ],
    })?];
    let mut n = 0usize;
    while n < objects {
        let keys: Vec<String> = (0..per)
            .map(|i| format!("Some(Standbys)-16-128-0-{}-{}", i % 16, n + i))
            .collect();
        let at = |i: usize| {
            [(seg, ((n + i) as u64) << 12, 4096u64)]
                .into_iter()
                .collect()
        };
        let rec = |i: usize, done: bool| ObjectRec {
            size: 4096,
            current: if done { at(i) } else { Default::default() },
            pending: (!done).then(|| PendingRec {
                id: (n + i) as u64 + 1,
                replicas: at(i),
                size: 4096,
                client: 1000,
                soft_pin: SoftPin::Preserve,
                soft_pin_ttl: 0,
            }),
            owner: 1000,
            hard_pin: false,
            soft_pin_left: 0,
            group: None,
        };
        for done in [false, true] {
            let changes = keys
                .iter()
                .enumerate()
                .map(|(i, k)| Change::Object {
                    key: k.clone(),
                    rec: rec(i, done),
                })
                .collect();
            frames.push(encode_frame(&ToStandby::Entry {
                seq: frames.len() as u64 + 1,
                changes,
            })?);
        }
        n += per;
    }
    let bytes: usize = frames.iter().map(Vec::len).sum();
    for round in 0..3 {
        let mut image = Image::default();
        let t = Instant::now();
        let mut changes = 0usize;
        for f in &frames {
            // (A standby reads each frame into a buffer of its own.)
            let copy = f.clone();
            if let Some((ToStandby::Entry { changes: cs, .. }, _)) =
                decode_frame::<ToStandby>(&copy)?
            {
                changes += cs.len();
                for c in cs {
                    image.apply(c);
                }
            }
        }
        let e = t.elapsed();
        let t = Instant::now();
        let (st, report) = image.into_state(1, 0, 10_000);
        let rebuild = t.elapsed();
        println!(
            "round {round}: {changes} changes ({} B each): applied {:.0} ns/change, {:.0} ns/object; rebuilt {} objects in {:.2} s ({:.2} µs/object)",
            bytes / changes.max(1),
            e.as_nanos() as f64 / changes.max(1) as f64,
            e.as_nanos() as f64 / objects.max(1) as f64,
            report.objects,
            rebuild.as_secs_f64(),
            rebuild.as_secs_f64() * 1e6 / report.objects.max(1) as f64
        );
        drop(st);
    }
    Ok(())
}
