//! The journal's unit tests: records' encodings, states rebuilt from changes and images
//! (replayed, retargeted, taken in pieces) against the state they came from, replicas a
//! rebuild drops, and the space a new leader holds for grants. Test code only
//! (`#[cfg(test)]`): it may use what the state machine must not (randomness included).

use super::*;
use crate::master::{MasterConfig, PutId, Stats};
use crate::proto::ReplicateConfig;
use rand::{Rng, SeedableRng};

#[cfg(test)]
mod takeover;

fn seg(id: u64, size: u64) -> Segment {
    Segment {
        id,
        name: format!("seg{id}"),
        te_endpoint: format!("127.0.0.1:{}", 15000 + id),
        base: id << 32,
        size,
    }
}

#[test]
fn replica_lists_round_trip_at_any_length_and_a_claimed_huge_one_is_refused() {
    for n in [0u64, 1, 2, 5] {
        let rec = ObjectRec {
            size: 4096,
            current: (0..n).map(|i| (i, i << 12, 4096)).collect(),
            pending: Some(PendingRec {
                id: 1,
                replicas: (0..n).map(|i| (i + 9, i << 20, 4096)).collect(),
                size: 4096,
                client: 3,
                soft_pin: SoftPin::default(),
                soft_pin_ttl: 0,
            }),
            owner: 3,
            hard_pin: false,
            soft_pin_left: 0,
            group: None,
        };
        let bytes = postcard::to_allocvec(&rec).expect("encode");
        // Encoded as a sequence, like a Vec (what earlier leaders wrote).
        let as_vec = (rec.size, rec.current.to_vec());
        assert!(bytes.starts_with(&postcard::to_allocvec(&as_vec).expect("encode")));
        assert_eq!(
            postcard::from_bytes::<ObjectRec>(&bytes).expect("decode"),
            rec
        );
    }
    // size 1, then a replica count of 2^28 - 1 and three bytes: an error, no panic.
    assert!(postcard::from_bytes::<ObjectRec>(&[1, 0xff, 0xff, 0xff, 0x7f, 1, 2, 3]).is_err());
    // An input that claims a million replicas and holds one: decoded without reserving
    // what it claimed (smallvec's own decoder would have spilled to the heap for it).
    struct Claims(Option<Vec<u64>>);
    impl Iterator for Claims {
        type Item = Vec<u64>;
        fn next(&mut self) -> Option<Vec<u64>> {
            self.0.take()
        }
        fn size_hint(&self) -> (usize, Option<usize>) {
            (1 << 20, Some(1 << 20))
        }
    }
    let input =
        serde::de::value::SeqDeserializer::<_, serde::de::value::Error>::new(Claims(Some(vec![
            4, 8192, 4096,
        ])));
    let recs = de_recs(input).expect("one replica");
    assert_eq!(recs.as_slice(), &[(4, 8192, 4096)]);
    assert!(
        !recs.spilled(),
        "one replica stays inline: nothing reserved for the claim"
    );
    let claimed =
        serde::de::value::SeqDeserializer::<_, serde::de::value::Error>::new(Claims(Some(vec![
            4, 8192, 4096,
        ])));
    assert!(
        <ReplicaRecs as Deserialize>::deserialize(claimed).is_ok_and(|r| r.spilled()),
        "the check above can fail: smallvec's decoder reserves the claim"
    );
}

/// Durable content of a state, comparable: objects with replicas, segments, clients.
type Durable = (Vec<(String, ObjectRec)>, Vec<(u64, u64)>, Vec<u64>);

fn durable(st: &State) -> Durable {
    let mut objs: Vec<(String, ObjectRec)> = st
        .objects
        .iter()
        .map(|(k, o)| (k.to_string(), State::object_rec(o, 0)))
        .collect();
    for (_, r) in objs.iter_mut() {
        r.soft_pin_left = 0;
    }
    objs.sort_by(|a, b| a.0.cmp(&b.0));
    let mut segs: Vec<(u64, u64)> = st.segments.iter().map(|(id, s)| (*id, s.client)).collect();
    segs.sort_unstable();
    let mut clients: Vec<u64> = st.clients.keys().copied().collect();
    clients.sort_unstable();
    (objs, segs, clients)
}

/// `image` rebuilt ([`Image::into_state`]) holds what `st` holds durably: the same objects,
/// replicas, segments and clients, the space of every replica taken (and of held-back
/// ones), new puts never on a replica's bytes, nothing readable evictable for a lease.
/// The objects, writes in progress and held-back replicas it had.
fn assert_rebuilds(
    st: &State,
    image: Image,
    m: &MasterConfig,
    now: u64,
    lease: u64,
    what: &str,
) -> (usize, usize, usize) {
    let (mut back, report) = image.into_state(7, now, lease);
    let seen = (
        back.objects.len(),
        back.objects
            .values()
            .filter(|o| o.pending.is_some())
            .count(),
        back.deferred.len(),
    );
    assert_eq!(
        report.dropped_replicas + report.dropped_objects,
        0,
        "{what}: {report:?}"
    );
    let (objs, segs, clients) = durable(st);
    let (bobjs, bsegs, bclients) = durable(&back);
    assert_eq!(bobjs, objs, "{what}: objects");
    assert_eq!(bsegs, segs, "{what}: segments");
    // Every client of the original is known (segment owners are known even when
    // their client record went: the segment keeps them alive).
    assert!(
        clients.iter().all(|c| bclients.contains(c)),
        "{what}: clients {clients:?} vs {bclients:?}"
    );
    assert!(
        back.used_bytes()
            >= st.used_bytes().saturating_sub(
                st.deferred
                    .replicas()
                    .filter(|(r, _)| st.segments.contains_key(&r.seg))
                    .map(|(r, _)| r.block.cap())
                    .sum::<u64>()
            ),
        "{what}: space"
    );
    // New puts on the rebuilt state never touch a replica of the original.
    let taken: Vec<(u64, u64, u64)> = st
        .objects
        .values()
        .flat_map(|o| {
            o.current
                .iter()
                .chain(o.pending.iter().flat_map(|p| p.replicas.iter()))
        })
        .map(|r| (r.seg, r.block.addr, r.block.len))
        .collect();
    back.register_client(99, now);
    for i in 0..20 {
        let Ok(descs) = back.put_start(
            &MasterConfig {
                allow_evict_soft_pinned: false,
                ..m.clone()
            },
            &Stats::default(),
            PutId {
                client: 99,
                put: i as u64,
            },
            &format!("new{i}"),
            50_000,
            &ReplicateConfig {
                with_hard_pin: true,
                ..ReplicateConfig::default()
            },
            false,
            now,
        ) else {
            continue;
        };
        for d in descs {
            let id = back
                .segments
                .iter()
                .find(|(_, s)| s.seg.te_endpoint == d.te_endpoint)
                .map(|(id, _)| *id);
            for &(s, a, l) in &taken {
                assert!(
                    Some(s) != id || d.addr + d.size <= a || a + l <= d.addr,
                    "{what}: a new put landed on a replica's bytes"
                );
            }
        }
    }
    // Everything readable counts as being read for one lease: not evictable.
    let before = back
        .objects
        .values()
        .filter(|o| !o.current.is_empty())
        .count();
    back.evict(u64::MAX, now, true, &Stats::default());
    assert_eq!(
        back.objects
            .values()
            .filter(|o| !o.current.is_empty())
            .count(),
        before,
        "{what}: nothing is evicted during the first lease"
    );
    seen
}

/// One operation of any kind on `st` at `now`, drawn from `rng` (keys `k0`..`k39`, clients
/// 1-3, segments 1-5), as a master's requests and timers would make it.
fn random_op(
    st: &mut State,
    rng: &mut rand::rngs::StdRng,
    m: &MasterConfig,
    stats: &Stats,
    now: u64,
    lease: u64,
) {
    let key = format!("k{}", rng.random_range(0..40));
    let client = rng.random_range(1..4u64);
    // (Two ids per client: an end or revoke sometimes names another put of the key.)
    let put = PutId {
        client,
        put: rng.random_range(1..3u64),
    };
    match rng.random_range(0..100) {
        0..=4 => {
            let id = rng.random_range(1..6u64);
            let _ = st.mount(id, seg(id, 1 << 20), now);
        }
        5..=6 => {
            let id = rng.random_range(1..6u64);
            let owner = st.segments.get(&id).map(|s| s.client);
            if let Some(c) = owner {
                let _ = st.unmount(c, id, now, 600_000);
            }
        }
        7..=40 => {
            let cfg = ReplicateConfig {
                replica_num: rng.random_range(1..4),
                group_id: rng.random_bool(0.1).then(|| "g".to_string()),
                soft_pin: if rng.random_bool(0.2) {
                    SoftPin::Enable
                } else {
                    SoftPin::Preserve
                },
                ..ReplicateConfig::default()
            };
            st.register_client(client, now);
            let _ = st.put_start(
                m,
                stats,
                put,
                &key,
                rng.random_range(1..200_000),
                &cfg,
                rng.random_bool(0.5),
                now,
            );
        }
        41..=65 => {
            let _ = st.put_end(put, &key, now);
        }
        66..=70 => {
            let _ = st.put_revoke(put, &key);
        }
        71..=80 => {
            let _ = st.get_replica_list(&key, now, lease);
        }
        81..=87 => {
            let _ = st.remove(m, &key, rng.random_bool(0.5), now);
        }
        88 => {
            // RemoveByRegex / RemoveAll: the keys of one digit, or every key.
            let digit = rng.random_range(0..12u8);
            st.remove_matching(
                m,
                |k| digit > 9 || k.ends_with(char::from(b'0' + digit)),
                rng.random_bool(0.5),
                now,
            );
        }
        89..=91 => {
            let on = if rng.random_bool(0.3) {
                String::new()
            } else {
                format!("seg{}", rng.random_range(1..6))
            };
            let keys: Vec<String> = (0..10)
                .map(|_| format!("k{}", rng.random_range(0..40)))
                .collect();
            st.batch_replica_clear(client, &keys, &on, now + 2 * lease);
        }
        92..=93 => {
            st.evict(rng.random_range(1..1_000_000), now, true, stats);
        }
        94 => {
            // Grants: made durable, turned off (the pools go back) or on again.
            match rng.random_range(0..4) {
                0 => st.set_grant_bytes(0, 600_000),
                1 => st.set_grant_bytes(64 << 10, 600_000),
                _ => st.set_grants_durable(super::super::grants_issued()),
            }
        }
        95..=96 => {
            st.expire_clients(now, 200, 600_000);
        }
        _ => {
            st.expire_reads(now);
            st.release_deferred(now);
        }
    }
}

/// A put placed in granted space rides (is answered before its change is acknowledged)
/// only once the grant is durable; a new leader that never received such a put's change
/// holds the bytes the grant named that no replica it knows covers, for the hold the grant
/// carries, so nothing placed there meanwhile lands on what that put's writer may still
/// write; a grant turned off gives the pool's unused space back and says so.
#[test]
fn a_new_leader_holds_what_a_grant_named_that_no_replica_it_knows_covers() {
    let (m, stats) = (MasterConfig::default(), Stats::default());
    let mut st = State {
        term: 3,
        ..State::default()
    };
    st.journal_on();
    st.register_client(1, 0);
    st.mount(1, seg(1, 1 << 30), 0).expect("mount");
    st.set_grant_bytes(1 << 20, 600_000);
    let put = |st: &mut State, key: &str, id: u64| -> (u64, bool) {
        let d = st
            .put_start(
                &m,
                &stats,
                PutId { client: 1, put: id },
                key,
                4096,
                &ReplicateConfig::default(),
                false,
                0,
            )
            .expect("put");
        (d[0].addr, st.placed_granted())
    };
    let (a0, rode) = put(&mut st, "k0", 1);
    assert!(!rode, "the grant it was placed in is not durable yet");
    assert_eq!(
        st.used_bytes(),
        4096,
        "what a pool has not handed out is not counted as used"
    );
    let mut log = Image::default();
    let changes = st.take_changes(0);
    let pool = changes.iter().find_map(|c| match c {
        Change::Granted {
            seg: 1,
            term: 3,
            ranges,
            hold: 600_000,
        } => Some(ranges.clone()),
        _ => None,
    });
    let pool = pool.expect("the grant is journaled with the put");
    assert_eq!(pool.len(), 1);
    let (start, len) = pool[0];
    assert_eq!(len, 1 << 20);
    assert!(
        a0 >= start && a0 + 4096 <= start + len,
        "the put lies in the pool"
    );
    for c in changes {
        log.apply(c);
    }
    st.set_grants_durable(super::super::grants_issued());
    let (a1, rode) = put(&mut st, "k1", 2);
    assert!(
        rode && a1 >= start && a1 + 4096 <= start + len,
        "placed in the durable grant: it rides"
    );
    let _lost = st.take_changes(0); // (k1's change never reaches the next leader)
                                    // The next leader knows k0, and holds the rest of the pool: k1's bytes among them.
    let image_objects = log.objects();
    let (mut next, report) = log.into_state(4, 10, 1000);
    assert_eq!((report.objects, image_objects), (1, 1));
    let seg1 = &next.segments[&1].space;
    assert!(
        seg1.free_within(start, start + len).is_empty(),
        "every byte of the pool is the known put's or held"
    );
    next.register_client(2, 10);
    for i in 0..300 {
        let d = next
            .put_start(
                &m,
                &stats,
                PutId { client: 2, put: i },
                &format!("n{i}"),
                4096,
                &ReplicateConfig::default(),
                false,
                10,
            )
            .expect("put on the new leader");
        assert!(
            d[0].addr + 4096 <= a1 || a1 + 4096 <= d[0].addr,
            "a new put landed on the bytes of a put the new leader never heard of"
        );
    }
    // Once the hold is over, the space comes back.
    next.release_deferred(10 + 600_000);
    assert!(
        next.segments[&1]
            .space
            .free_within(start, start + len)
            .iter()
            .any(|&(a, l)| a <= a1 && a1 + 4096 <= a + l),
        "the held bytes are free again after the hold"
    );
    // Grants off: the pool's unused space goes back to the segment, and the journal says so.
    st.set_grant_bytes(0, 600_000);
    assert!(!st.granting());
    let off = st.take_changes(0);
    assert!(
        off.iter().any(
            |c| matches!(c, Change::Granted { seg: 1, term: 3, ranges, .. } if ranges.is_empty())
        ),
        "{off:?}"
    );
    let free = st.segments[&1].space.free_within(start, start + len);
    assert_eq!(
        free.iter().map(|r| r.1).sum::<u64>(),
        len - 2 * 4096,
        "all of the pool but the two puts is free again: {free:?}"
    );
}

/// Random operations on a journaling state; after each, its changes go into a replayed
/// image (as etcd's log would). At checkpoints the state rebuilt from the log and the one
/// rebuilt from a snapshot ([`State::image`]) hold the same objects, replicas, segments
/// and clients, the space of every replica (and of held-back replicas) is taken, and a new
/// put never lands on a replica's bytes.
#[test]
fn replaying_the_changes_rebuilds_the_durable_state_after_any_operations() {
    let (mut seen_objects, mut seen_pending, mut seen_held) = (0, 0, 0);
    for seed in 0..20u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (m, stats) = (
            MasterConfig {
                put_wait_for_reads: std::time::Duration::ZERO,
                ..MasterConfig::default()
            },
            Stats::default(),
        );
        let mut st = State::default();
        st.journal_on();
        // (Segments of 1 MiB: pools of 16 KiB, for values up to 4 KiB.)
        st.set_grant_bytes(if seed % 2 == 1 { 64 << 10 } else { 0 }, 600_000);
        let mut log = Image::default();
        let mut now = 1u64;
        let lease = 1000;
        for step in 0..400 {
            now += rng.random_range(1..50);
            random_op(&mut st, &mut rng, &m, &stats, now, lease);
            for c in st.take_changes(now) {
                log.apply(c);
            }
            if step % 50 != 49 {
                continue;
            }
            let mut snap = Image::default();
            for c in st.image(now) {
                snap.apply(c);
            }
            for (name, image) in [("log", std::mem::take(&mut log)), ("snapshot", snap)] {
                let keep = Image {
                    clients: image.clients.clone(),
                    segments: image.segments.clone(),
                    seg_order: image.seg_order.clone(),
                    objects: image.objects.clone(),
                    held_back: image.held_back.clone(),
                    grants: image.grants.clone(),
                    disk: image.disk.clone(),
                };
                if name == "log" {
                    log = keep;
                }
                let (o, p, h) = assert_rebuilds(
                    &st,
                    image,
                    &m,
                    now,
                    lease,
                    &format!("seed {seed} step {step} ({name})"),
                );
                seen_objects += o;
                seen_pending += p;
                seen_held += h;
            }
        }
    }
    assert!(seen_objects > 500 && seen_pending > 20 && seen_held > 5, "the operations exercise objects, writes in progress and held-back space: {seen_objects} {seen_pending} {seen_held}");
}

/// A state built ahead for no term ([`PREBUILT_TERM`]) at one time and retargeted to a
/// term at a later one ([`State::retarget`]) is the state built for that term then: the
/// same durable content, term, takeover read and its lease, clients, and per object its
/// reads, lease, times, soft pin and pending put's start; the same space held back (held
/// from the earlier time). After random operations of every kind.
#[test]
fn a_state_built_ahead_and_retargeted_is_the_one_built_for_its_term_then() {
    type Times = (Vec<u64>, u64, u64, u64, u64, u64, Option<u64>);
    let times = |st: &State| -> Vec<(String, Times)> {
        let mut v: Vec<_> = st
            .objects
            .iter()
            .map(|(k, o)| {
                (
                    k.to_string(),
                    (
                        o.reads.clone(),
                        o.lease_until,
                        o.written,
                        o.last_access,
                        o.soft_pin_until,
                        o.joined,
                        o.pending.as_ref().map(|p| p.started),
                    ),
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let (mut pinned, mut pending) = (0, 0);
    for seed in 0..10u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (m, stats) = (
            MasterConfig {
                put_wait_for_reads: std::time::Duration::ZERO,
                ..MasterConfig::default()
            },
            Stats::default(),
        );
        let mut st = State::default();
        let lease = 1000;
        let mut now = 1u64;
        for _ in 0..300 {
            now += rng.random_range(1..50);
            random_op(&mut st, &mut rng, &m, &stats, now, lease);
        }
        // (Soft-pinned objects, and a put left in progress, for certain.)
        let _ = st.mount(9, seg(9, 1 << 20), now);
        st.register_client(9, now);
        let pin = ReplicateConfig {
            soft_pin: SoftPin::Enable,
            soft_pin_ttl_ms: Some(60_000),
            ..ReplicateConfig::default()
        };
        for (i, end) in [(1, true), (2, true), (3, false)] {
            let id = PutId { client: 9, put: i };
            st.put_start(
                &m,
                &stats,
                id,
                &format!("pinned{i}"),
                1000,
                &pin,
                false,
                now,
            )
            .expect("room on segment 9");
            if end {
                st.put_end(id, &format!("pinned{i}"), now).expect("ends");
            }
        }
        let mut image = Image::default();
        for c in st.image(now) {
            image.apply(c);
        }
        let copy = Image {
            clients: image.clients.clone(),
            segments: image.segments.clone(),
            seg_order: image.seg_order.clone(),
            objects: image.objects.clone(),
            held_back: image.held_back.clone(),
            grants: image.grants.clone(),
            disk: image.disk.clone(),
        };
        let (built_at, then) = (now + 10, now + 2_345);
        let (want, want_report) = image.into_state(77, then, lease);
        let (mut got, got_report) = copy.into_state(PREBUILT_TERM, built_at, lease);
        got.retarget(77, built_at, then, lease);
        assert_eq!(
            format!("{got_report:?}"),
            format!("{want_report:?}"),
            "seed {seed}"
        );
        assert_eq!(durable(&got), durable(&want), "seed {seed}");
        assert_eq!(
            (got.term, got.next_read, &got.reads),
            (want.term, want.next_read, &want.reads),
            "seed {seed}: the term and its takeover read"
        );
        assert_eq!(
            got.clients, want.clients,
            "seed {seed}: every client seen at the takeover"
        );
        assert_eq!(
            times(&got),
            times(&want),
            "seed {seed}: each object's reads, lease and times"
        );
        assert_eq!(
            got.deferred.len(),
            want.deferred.len(),
            "seed {seed}: the same space held back"
        );
        pinned += want
            .objects
            .values()
            .filter(|o| o.soft_pin_until > 0)
            .count();
        pending += want
            .objects
            .values()
            .filter(|o| o.pending.is_some())
            .count();
    }
    assert!(
        pinned > 0 && pending > 0,
        "soft pins and pending puts were exercised: {pinned} {pending}"
    );
}

/// An image taken in pieces, as a leader's `Writer::image_in_pieces` takes it (`ha::journal`: the state's
/// lock let go between pieces), with operations of every kind applied between the pieces
/// and after the last one: the image followed by the changes of those operations (what
/// the journal holds after it) rebuilds what the state holds, as one taken at once
/// would. Fails when pieces are left out (every other one), or when the changes made
/// between pieces are not journaled after the image.
#[test]
fn an_image_taken_in_pieces_with_operations_between_them_and_the_changes_after_it_rebuild_the_state(
) {
    let (mut seen_objects, mut seen_between) = (0, 0);
    for seed in 0..40u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1000 + seed);
        let (m, stats) = (
            MasterConfig {
                put_wait_for_reads: std::time::Duration::ZERO,
                ..MasterConfig::default()
            },
            Stats::default(),
        );
        let mut st = State::default();
        st.journal_on();
        let (mut now, lease) = (1u64, 1000);
        for _ in 0..rng.random_range(50..300) {
            now += rng.random_range(1..50);
            random_op(&mut st, &mut rng, &m, &stats, now, lease);
        }
        // What was marked before the image is queued before it (`Writer::image_in_pieces`).
        let _ = st.take_changes(now);
        let mut image = st.image_head(now);
        let mut after = Vec::new();
        for piece in 0..IMAGE_PIECES {
            // (Most pieces are taken back to back; some have requests between them.)
            if rng.random_bool(0.3) {
                for _ in 0..rng.random_range(1..6) {
                    now += rng.random_range(1..50);
                    random_op(&mut st, &mut rng, &m, &stats, now, lease);
                    let changes = st.take_changes(now);
                    seen_between += changes.len();
                    after.extend(changes);
                }
            }
            st.image_piece(piece, now, &mut image);
        }
        for _ in 0..rng.random_range(0..20) {
            now += rng.random_range(1..50);
            random_op(&mut st, &mut rng, &m, &stats, now, lease);
            after.extend(st.take_changes(now));
        }
        let mut replayed = Image::default();
        for c in image.into_iter().chain(after) {
            replayed.apply(c);
        }
        seen_objects += assert_rebuilds(&st, replayed, &m, now, lease, &format!("seed {seed}")).0;
    }
    assert!(seen_objects > 200 && seen_between > 200, "the pieces hold objects and requests change them in between: {seen_objects} {seen_between}");
}
