//! The state machine's tests of space accounted exactly through drops, remounts and
//! takeovers, and of zombie puts' space held for their release timeout. Test code only
//! (`#[cfg(test)]`, declared so for the boundary check).

use super::*;

/// Space accounting under random operations, takeovers among them: every mounted
/// segment's used bytes are exactly its objects' and its held ranges', and every range
/// held on a segment that went is looked for when it comes back. (A reviewer's fuzz test.)
#[test]
fn space_is_accounted_exactly_through_drops_remounts_and_takeovers() {
    use rand::{Rng, SeedableRng};
    fn check(st: &State, ctx: &str) {
        let mut want: HashMap<u64, u64> = HashMap::new();
        for o in st.objects.values() {
            for r in o
                .current
                .iter()
                .chain(o.pending.iter().flat_map(|p| p.replicas.iter()))
            {
                assert!(
                    st.segments.contains_key(&r.seg),
                    "{ctx}: a replica on a segment that went"
                );
                *want.entry(r.seg).or_default() += r.block.cap();
            }
        }
        for (r, _) in st.deferred.replicas() {
            if st.segments.contains_key(&r.seg) {
                *want.entry(r.seg).or_default() += r.block.cap();
            } else {
                assert!(
                    st.orphaned.contains(&r.seg),
                    "{ctx}: held on segment {} that went, which a mount would not look for",
                    r.seg
                );
            }
        }
        for (id, s) in &st.segments {
            assert_eq!(
                s.space.used(),
                want.get(id).copied().unwrap_or(0),
                "{ctx}: segment {id}'s used bytes"
            );
        }
    }
    let m = MasterConfig {
        put_start_discard_timeout: Duration::from_millis(300),
        put_start_release_timeout: Duration::from_millis(2_000),
        ..MasterConfig::default()
    };
    let s = Stats::default();
    let segment = |id: u64, shift: u64| Segment {
        id,
        name: format!("s{id}"),
        te_endpoint: format!("e{id}"),
        base: (id << 32) + shift * 1024,
        size: 64 << 10,
    };
    for seed in 0..300u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut st = State::default();
        st.journal_on();
        let (mut now, mut reads, mut puts) = (0u64, Vec::new(), 0u64);
        for step in 0..400 {
            now += rng.random_range(0..60);
            let op = rng.random_range(0..100);
            let ctx = format!("seed {seed} step {step} op {op}");
            match op {
                0..=5 => {
                    let id = rng.random_range(1..4u64);
                    let _ = st.mount(id, segment(id, rng.random_range(0..3)), now);
                }
                6..=9 => {
                    let id = rng.random_range(1..4u64);
                    let _ = st.remount(id, vec![segment(id, rng.random_range(0..3))], now, 500);
                }
                10..=12 => {
                    let id = rng.random_range(1..4u64);
                    let _ = st.unmount(id, id, now, 2_000);
                }
                13..=14 => {
                    for c in 1..4u64 {
                        if rng.random_bool(0.5) {
                            st.ping(c, now);
                        }
                    }
                    st.expire_clients(now, 400, 2_000);
                }
                15..=40 => {
                    let c = rng.random_range(1..4u64);
                    st.register_client(c, now);
                    puts += 1;
                    let (k, put) = (
                        format!("k{}", rng.random_range(0..20)),
                        PutId {
                            client: c,
                            put: puts,
                        },
                    );
                    let _ = st.put_start(
                        &m,
                        &s,
                        put,
                        &k,
                        rng.random_range(1..8192),
                        &ReplicateConfig {
                            replica_num: rng.random_range(1..3),
                            ..Default::default()
                        },
                        rng.random_bool(0.3),
                        now,
                    );
                    if rng.random_bool(0.6) {
                        let _ = st.put_end(put, &k, now);
                    } else if rng.random_bool(0.3) {
                        let _ = st.put_revoke(put, &k);
                    }
                }
                41..=60 => {
                    if let Ok(l) =
                        st.get_replica_list(&format!("k{}", rng.random_range(0..20)), now, 300)
                    {
                        reads.push(l.read_id);
                    }
                }
                61..=70 => {
                    if !reads.is_empty() {
                        let r = reads.swap_remove(rng.random_range(0..reads.len()));
                        st.release_reads(&[r], now);
                    }
                }
                71..=78 => {
                    let _ = st.remove(
                        &m,
                        &format!("k{}", rng.random_range(0..20)),
                        rng.random_bool(0.7),
                        now,
                    );
                }
                79..=80 => {
                    st.remove_matching(&m, |k| k.ends_with('3'), true, now);
                }
                81..=84 => {
                    st.evict(rng.random_range(1..100_000), now, true, &s);
                }
                85..=87 => {
                    let keys: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
                    let on = if rng.random_bool(0.5) {
                        String::new()
                    } else {
                        format!("s{}", rng.random_range(1..4))
                    };
                    st.batch_replica_clear(rng.random_range(1..4u64), &keys, &on, now);
                }
                88..=92 => st.expire_reads(now),
                93..=96 => st.release_deferred(now),
                _ => {
                    let mut image = changes::Image::default();
                    for c in st.image(now) {
                        image.apply(c);
                    }
                    st = image.into_state(st.term + 1, now, 300).0;
                    st.journal_on();
                    reads.clear();
                }
            }
            check(&st, &ctx);
        }
    }
}

/// A zombie write's space is held until its release timeout (its writer may still be
/// writing) also at a new leader: the journal carries how long each held range has left,
/// where it once carried only that it was held (freed after one read lease at a takeover).
#[test]
fn a_zombie_writes_space_stays_held_for_its_release_timeout_across_a_takeover() {
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    st.journal_on();
    st.put_start(&m, &s, P1, "z", 4096, &ReplicateConfig::default(), false, 0)
        .unwrap();
    let later = m.put_start_discard_timeout.as_millis() as u64 + 1;
    let release = later + m.put_start_release_timeout.as_millis() as u64;
    st.put_start(
        &m,
        &s,
        PutId { client: 1, put: 2 },
        "z",
        4096,
        &ReplicateConfig::default(),
        false,
        later,
    )
    .unwrap();
    let held = st.take_changes(later).into_iter().filter_map(|c| match c {
        Change::HeldUntil { left, .. } => Some(left),
        _ => None,
    });
    assert_eq!(
        held.collect::<Vec<_>>(),
        [release - later],
        "journaled with the time it has left"
    );
    let mut image = changes::Image::default();
    for c in st.image(later + 1_000) {
        image.apply(c);
    }
    let (mut back, _) = image.into_state(2, later + 1_000, 5_000);
    let used = back.used_bytes();
    assert_eq!(used, 2 * 4096, "the new put's space and the zombie's");
    back.release_deferred(later + 1_000 + 5_001);
    assert_eq!(back.used_bytes(), used, "still held after one read lease");
    back.release_deferred(release - 1);
    assert_eq!(back.used_bytes(), used);
    back.release_deferred(release);
    assert_eq!(back.used_bytes(), 4096, "given back at the release timeout");
}

#[test]
fn zombie_put_is_replaced_after_the_discard_timeout() {
    let (mut st, m, s) = setup(&[(1, 1 << 20)]);
    st.put_start(&m, &s, P1, "z", 4096, &ReplicateConfig::default(), false, 0)
        .unwrap();
    assert!(matches!(
        st.put_start(
            &m,
            &s,
            P1,
            "z",
            4096,
            &ReplicateConfig::default(),
            false,
            10
        ),
        Err(StoreError::ObjectAlreadyExists(_))
    ));
    assert!(matches!(
        st.get_replica_list("z", 10, 1),
        Err(StoreError::ReplicaNotReady(_))
    ));
    let later = m.put_start_discard_timeout.as_millis() as u64 + 1;
    let p2 = PutId { client: 1, put: 2 };
    st.put_start(
        &m,
        &s,
        p2,
        "z",
        4096,
        &ReplicateConfig::default(),
        false,
        later,
    )
    .unwrap();
    assert_eq!(st.deferred.len(), 1, "zombie space released only later");
    // The zombie's writer wakes up and ends (or revokes) its put: the same client and key,
    // but not this put, whose bytes may not have landed yet.
    let late = st.put_end(P1, "z", later + 1).unwrap_err();
    assert!(
        matches!(&late, StoreError::InvalidParams(w) if w.contains("discarded as a zombie")),
        "{late:?}"
    );
    assert!(
        matches!(
            st.get_replica_list("z", later + 1, 1),
            Err(StoreError::ReplicaNotReady(_))
        ),
        "the replacing put is still in progress"
    );
    assert!(
        st.put_revoke(P1, "z").is_err(),
        "nor does its revoke touch the replacing put"
    );
    st.put_end(p2, "z", later + 1).unwrap();
    assert!(st.exist_key("z", later + 2, 1).unwrap());
}
