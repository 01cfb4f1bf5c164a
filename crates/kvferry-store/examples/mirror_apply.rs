//! Scratch: a standby's cost per change (decode + apply), the rate bench's shape.
use kvferry_store::ha::sync::{decode_frame, encode_frame, ToStandby};
use kvferry_store::master::journal::{Change, Image, ObjectRec, PendingRec};
use kvferry_store::SoftPin;
use std::time::Instant;

fn main() {
    let objects: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1_200_000);
    let per: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(128);
    let mut frames = Vec::new();
    let mut seq = 0u64;
    let mut n = 0usize;
    while n < objects {
        let keys: Vec<String> = (0..per).map(|i| format!("Some(Standbys)-16-128-0-{}-{}", i % 16, n + i)).collect();
        let starts: Vec<Change> = keys.iter().enumerate().map(|(i, k)| Change::Object { key: k.clone(), rec: ObjectRec { size: 4096, current: Default::default(), pending: Some(PendingRec { replicas: [(7u64, ((n + i) as u64) << 12, 4096u64)].into_iter().collect(), size: 4096, client: 1000, soft_pin: SoftPin::Preserve, soft_pin_ttl: 0 }), owner: 1000, hard_pin: false, soft_pin_left: 0, group: None } }).collect();
        let ends: Vec<Change> = keys.iter().enumerate().map(|(i, k)| Change::Object { key: k.clone(), rec: ObjectRec { size: 4096, current: [(7u64, ((n + i) as u64) << 12, 4096u64)].into_iter().collect(), pending: None, owner: 1000, hard_pin: false, soft_pin_left: 0, group: None } }).collect();
        seq += 1;
        frames.push(encode_frame(&ToStandby::Entry { seq, changes: starts }).unwrap());
        seq += 1;
        frames.push(encode_frame(&ToStandby::Entry { seq, changes: ends }).unwrap());
        n += per;
    }
    let bytes: usize = frames.iter().map(|f| f.len()).sum();
    let mode = std::env::args().nth(3).unwrap_or_default();
    for round in 0..3 {
        let mut img = Image::default();
        let t = Instant::now();
        let mut changes = 0usize;
        for f in &frames {
            let copy = f.clone();
            let (m, _): (ToStandby, usize) = decode_frame(&copy).unwrap().unwrap();
            if let ToStandby::Entry { changes: cs, .. } = m {
                changes += cs.len();
                if mode == "decode" { drop(cs); } else {
                for c in cs {
                    img.apply(c);
                }}
            }
        }
        let e = t.elapsed();
        println!("round {round}: {changes} changes, {} B/change, {:.0} ns/change, {:.0} ns/object", bytes / changes, e.as_nanos() as f64 / changes as f64, e.as_nanos() as f64 / (changes / 2) as f64);
    }
}
