//! Replica copy and move tasks (`master/tasks.rs`, `master/copy.rs`): Mooncake 0.3.14's
//! states and error codes, the table's bounds and timeouts, a dropped client's tasks, and the
//! copy itself (room reserved, replicas added, a move's source dropped). Test code only
//! (`#[cfg(test)]`, declared so for the boundary check).

use super::*;
use crate::master::tasks::TaskLimits;
use crate::proto::{TaskKind, TaskStatus};

fn on(segment: &str) -> ReplicateConfig {
    ReplicateConfig {
        preferred_segments: vec![segment.into()],
        ..Default::default()
    }
}

/// The segment names holding `key`'s readable replicas, sorted.
fn placed(st: &State, key: &str) -> Vec<String> {
    let o = st.objects.get(key).expect("the object");
    let mut v: Vec<String> = o
        .current
        .iter()
        .map(|r| st.segments[&r.seg].seg.name.clone())
        .collect();
    v.sort();
    v
}

/// Three segments, one per client (client n owns `seg{n}`), and `k` (4 KiB) on seg1.
fn three() -> (State, MasterConfig, Stats) {
    let (mut st, m, s) = setup(&[(1, 1 << 20), (2, 1 << 20), (3, 1 << 20)]);
    st.seed_placement(7);
    put(&mut st, &m, &s, "k", 4096, &on("seg1"), 0).unwrap();
    (st, m, s)
}

/// A copy task from creation to SUCCESS: assigned to the owner of the source replica,
/// PENDING until that client fetches it (another client fetches nothing), PROCESSING while
/// it copies; the copy reserves room on the target, keeps the object readable from its
/// replica and refuses another put or copy of it meanwhile; its end adds the replica; the
/// client's report ends the task (once: a second report changes nothing, another client's is
/// ILLEGAL_CLIENT).
#[test]
fn a_copy_task_runs_at_the_source_owner_and_adds_the_replica() {
    let (mut st, m, s) = three();
    let id = st.create_copy_task("k", &["seg2".into()], 10).unwrap();
    let q = st.query_task(id, 15).unwrap();
    assert_eq!(
        (q.kind, q.status, q.assigned_client),
        (TaskKind::Copy, TaskStatus::Pending, 1)
    );
    assert_eq!((q.created_ago_ms, q.message.as_str()), (5, ""));
    assert!(st.fetch_tasks(2, 10, 20).is_empty());
    let got = st.fetch_tasks(1, 10, 20);
    assert_eq!(got.len(), 1);
    let t = &got[0];
    assert_eq!(
        (t.id, t.kind, t.key.as_str(), t.source.as_str()),
        (id, TaskKind::Copy, "k", "seg1")
    );
    assert_eq!(
        (t.targets.clone(), t.max_retry),
        (vec!["seg2".to_string()], 10)
    );
    assert!(st.fetch_tasks(1, 10, 21).is_empty(), "handed out once");
    assert_eq!(
        st.query_task(id, 25).unwrap().status,
        TaskStatus::Processing
    );

    let used = st.used_bytes();
    let plan = st
        .copy_start(1, "k", "seg1", &t.targets, 9, false, 30, 5_000)
        .unwrap();
    assert_eq!((plan.size, plan.targets.len()), (4096, 1));
    assert_eq!(plan.source.te_endpoint, seg(1, 0).te_endpoint);
    assert_eq!(plan.targets[0].te_endpoint, seg(2, 0).te_endpoint);
    assert_eq!(st.used_bytes(), used + 4096, "room reserved on the target");
    assert_eq!(placed(&st, "k"), ["seg1"], "the copy is not readable yet");
    assert!(
        st.get_replica_list("k", 31, 5_000).is_ok(),
        "the object stays readable"
    );
    let e = st
        .copy_start(1, "k", "seg1", &["seg3".into()], 10, false, 31, 5_000)
        .unwrap_err();
    assert_eq!(e.code(), -708);
    let e = st
        .put_start(
            &m,
            &s,
            PutId { client: 3, put: 1 },
            "k",
            10,
            &Default::default(),
            true,
            32,
        )
        .unwrap_err();
    assert_eq!(e.code(), -705, "{e}");
    assert_eq!(
        st.put_end(PutId { client: 1, put: 9 }, "k", 33)
            .unwrap_err()
            .code(),
        -600,
        "a copy does not end as a put"
    );
    assert_eq!(st.copy_end(2, "k", 9, 34).unwrap_err().code(), -709);
    st.copy_end(1, "k", 9, 35).unwrap();
    assert_eq!(placed(&st, "k"), ["seg1", "seg2"]);

    st.complete_task(1, id, true, "Task completed successfully", 40)
        .unwrap();
    let q = st.query_task(id, 50).unwrap();
    assert_eq!(
        (q.status, q.updated_ago_ms, q.message.as_str()),
        (TaskStatus::Success, 10, "Task completed successfully")
    );
    assert_eq!(
        st.complete_task(2, id, false, "x", 51).unwrap_err().code(),
        -601
    );
    st.complete_task(1, id, false, "late", 52).unwrap();
    assert_eq!(
        st.query_task(id, 53).unwrap().status,
        TaskStatus::Success,
        "a finished task stays as it ended"
    );
}

/// A move: its end leaves exactly the target replica, and the source's room comes back once
/// the copier's read of it is released.
#[test]
fn a_move_leaves_exactly_the_target_replica() {
    let (mut st, _m, _s) = three();
    let used = st.used_bytes();
    let id = st.create_move_task("k", "seg1", "seg3", 0).unwrap();
    let t = st.fetch_tasks(1, 10, 1).pop().unwrap();
    assert_eq!(
        (t.kind, t.targets.clone()),
        (TaskKind::Move, vec!["seg3".to_string()])
    );
    let plan = st
        .copy_start(1, "k", "seg1", &t.targets, 5, true, 2, 5_000)
        .unwrap();
    st.copy_end(1, "k", 5, 3).unwrap();
    assert_eq!(placed(&st, "k"), ["seg3"]);
    assert_eq!(
        st.used_bytes(),
        used + 4096,
        "the source waits for the copier's read"
    );
    st.release_reads(&[plan.read_id], 4);
    assert_eq!(st.used_bytes(), used);
    st.complete_task(1, id, true, "", 5).unwrap();
    assert_eq!(st.query_task(id, 5).unwrap().status, TaskStatus::Success);
    // A move to a segment already holding a replica reserves nothing and drops the source.
    let (mut st, m, s) = three();
    st.upsert_two(&m, &s);
    let plan = st
        .copy_start(1, "k", "seg1", &["seg2".into()], 6, true, 2, 5_000)
        .unwrap();
    assert!(plan.targets.is_empty());
    st.copy_end(1, "k", 6, 3).unwrap();
    assert_eq!(placed(&st, "k"), ["seg2"]);
}

impl State {
    /// `k` again, on seg1 and seg2.
    fn upsert_two(&mut self, m: &MasterConfig, s: &Stats) {
        let cfg = ReplicateConfig {
            replica_num: 2,
            preferred_segments: vec!["seg1".into(), "seg2".into()],
            ..Default::default()
        };
        let p = PutId { client: 1, put: 77 };
        self.put_start(m, s, p, "k", 4096, &cfg, true, 1).unwrap();
        self.put_end(p, "k", 1).unwrap();
        assert_eq!(placed(self, "k"), ["seg1", "seg2"]);
    }
}

/// A copy revoked (its write failed) gives its room back and adds nothing; a copy to a
/// segment with no room fails NO_AVAILABLE_HANDLE and reserves nothing.
#[test]
fn a_revoked_or_roomless_copy_leaves_nothing() {
    let (mut st, m, s) = setup(&[(1, 1 << 20), (2, 8192)]);
    put(&mut st, &m, &s, "k", 4096, &on("seg1"), 0).unwrap();
    let used = st.used_bytes();
    st.copy_start(1, "k", "seg1", &["seg2".into()], 3, false, 1, 5_000)
        .unwrap();
    st.put_revoke(PutId { client: 1, put: 3 }, "k").unwrap();
    assert_eq!(
        (placed(&st, "k"), st.used_bytes()),
        (vec!["seg1".to_string()], used)
    );
    put(&mut st, &m, &s, "big", 6000, &on("seg2"), 2).unwrap();
    let used = st.used_bytes();
    let e = st
        .copy_start(1, "k", "seg1", &["seg2".into()], 4, false, 3, 5_000)
        .unwrap_err();
    assert_eq!(e.code(), -200);
    assert_eq!(st.used_bytes(), used);
    assert!(st.objects.get("k").unwrap().pending.is_none());
}

/// Mooncake's refusals, with its codes.
#[test]
fn task_requests_are_refused_with_mooncakes_codes() {
    let (mut st, _m, _s) = three();
    let code = |r: StoreResult<crate::proto::TaskId>| r.unwrap_err().code();
    assert_eq!(code(st.create_copy_task("k", &[], 0)), -600, "no target");
    assert_eq!(code(st.create_copy_task("nope", &["seg2".into()], 0)), -704);
    assert_eq!(
        code(st.create_copy_task("k", &["seg9".into()], 0)),
        -600,
        "target not mounted"
    );
    assert_eq!(code(st.create_move_task("nope", "seg1", "seg2", 0)), -704);
    assert_eq!(
        code(st.create_move_task("nope", "seg1", "seg1", 0)),
        -600,
        "source is target, before the key"
    );
    assert_eq!(
        code(st.create_move_task("k", "seg1", "seg1", 0)),
        -600,
        "source is target"
    );
    assert_eq!(
        code(st.create_move_task("k", "seg1", "seg9", 0)),
        -600,
        "target not mounted"
    );
    assert_eq!(
        code(st.create_move_task("k", "seg2", "seg3", 0)),
        -600,
        "no replica on source"
    );
    assert_eq!(st.query_task((1, 2), 0).unwrap_err().code(), -1400);
    assert_eq!(
        st.complete_task(1, (1, 2), true, "", 0).unwrap_err().code(),
        -1400
    );
    assert_eq!(
        st.copy_start(1, "k", "seg2", &["seg3".into()], 1, false, 0, 5_000)
            .unwrap_err()
            .code(),
        -710
    );
    assert_eq!(
        st.copy_start(1, "k", "seg1", &["seg9".into()], 1, false, 0, 5_000)
            .unwrap_err()
            .code(),
        -101
    );
    st.set_task_limits(TaskLimits {
        max_pending: 2,
        ..Default::default()
    });
    st.create_copy_task("k", &["seg2".into()], 0).unwrap();
    st.create_copy_task("k", &["seg3".into()], 0).unwrap();
    assert_eq!(code(st.create_copy_task("k", &["seg2".into()], 0)), -1401);
    st.fetch_tasks(1, 1, 0);
    st.create_copy_task("k", &["seg2".into()], 0).unwrap();
}

/// Bounded: only the last `max_finished` finished tasks are kept; at most `max_processing`
/// run at once (a fetch beyond hands out nothing).
#[test]
fn the_task_table_is_bounded() {
    let (mut st, _m, _s) = three();
    st.set_task_limits(TaskLimits {
        max_finished: 2,
        max_processing: 2,
        ..Default::default()
    });
    let ids: Vec<_> = (0..4)
        .map(|i| st.create_copy_task("k", &["seg2".into()], i).unwrap())
        .collect();
    assert_eq!(st.fetch_tasks(1, 10, 5).len(), 2);
    assert!(st.fetch_tasks(1, 10, 5).is_empty(), "processing limit");
    for id in &ids[..2] {
        st.complete_task(1, *id, true, "", 6).unwrap();
    }
    assert_eq!(st.fetch_tasks(1, 10, 7).len(), 2);
    for id in &ids[2..] {
        st.complete_task(1, *id, false, "no", 8).unwrap();
    }
    assert_eq!(st.tasks_kept(), 2);
    assert_eq!(
        st.query_task(ids[0], 9).unwrap_err().code(),
        -1400,
        "the oldest finished went"
    );
    assert_eq!(st.query_task(ids[3], 9).unwrap().status, TaskStatus::Failed);
}

/// A task waiting past the pending timeout, or running past the processing timeout, fails
/// ("pending timeout", "processing timeout", Mooncake's messages); the tasks of a client the
/// master drops fail then.
#[test]
fn late_tasks_and_a_dropped_clients_tasks_fail() {
    let (mut st, _m, _s) = three();
    st.set_task_limits(TaskLimits {
        pending_timeout_ms: 100,
        processing_timeout_ms: 50,
        ..Default::default()
    });
    let waiting = st.create_copy_task("k", &["seg2".into()], 0).unwrap();
    st.expire_tasks(100);
    assert_eq!(
        st.query_task(waiting, 100).unwrap().status,
        TaskStatus::Pending
    );
    st.expire_tasks(101);
    let q = st.query_task(waiting, 101).unwrap();
    assert_eq!(
        (q.status, q.message.as_str()),
        (TaskStatus::Failed, "pending timeout")
    );
    assert!(st.fetch_tasks(1, 10, 102).is_empty());
    let running = st.create_copy_task("k", &["seg2".into()], 200).unwrap();
    assert_eq!(st.fetch_tasks(1, 10, 220).len(), 1);
    st.expire_tasks(270);
    assert_eq!(
        st.query_task(running, 270).unwrap().status,
        TaskStatus::Processing
    );
    st.expire_tasks(271);
    let q = st.query_task(running, 271).unwrap();
    assert_eq!(
        (q.status, q.message.as_str()),
        (TaskStatus::Failed, "processing timeout")
    );

    let (mut st, _m, _s) = three();
    let a = st.create_copy_task("k", &["seg2".into()], 0).unwrap();
    let b = st.create_move_task("k", "seg1", "seg3", 0).unwrap();
    st.fetch_tasks(1, 1, 0);
    for c in [2, 3] {
        st.ping(c, 5_000);
    }
    let dead = st.expire_clients(10_001, 10_000, 1_000);
    assert_eq!(dead.len(), 1, "client 1 only");
    for id in [a, b] {
        let q = st.query_task(id, 10_001).unwrap();
        assert_eq!(q.status, TaskStatus::Failed);
        assert!(q.message.contains("went away"), "{}", q.message);
    }
}

/// Tasks are not journaled (Mooncake's op log carries none): the next leader knows none, and
/// a copy in progress at the takeover is a write in progress there whose `CopyEnd` is refused
/// and whose revoke frees its room.
#[test]
fn the_next_leader_knows_no_task_and_refuses_the_copys_end() {
    let (m, s) = (MasterConfig::default(), Stats::default());
    let mut st = State::default();
    st.journal_on();
    for id in [1, 2] {
        st.mount(id, seg(id, 1 << 20), 0).unwrap();
    }
    put(&mut st, &m, &s, "k", 4096, &on("seg1"), 0).unwrap();
    let id = st.create_copy_task("k", &["seg2".into()], 0).unwrap();
    st.fetch_tasks(1, 10, 0);
    st.copy_start(1, "k", "seg1", &["seg2".into()], 9, false, 1, 5_000)
        .unwrap();
    let mut image = changes::Image::default();
    for c in st.take_changes(2) {
        image.apply(c);
    }
    let (mut next, _) = image.into_state(2, 3, 5_000);
    next.register_client(1, 3);
    assert_eq!(next.query_task(id, 3).unwrap_err().code(), -1400);
    let used = next.used_bytes();
    assert_eq!(next.copy_end(1, "k", 9, 4).unwrap_err().code(), -709);
    next.put_revoke(PutId { client: 1, put: 9 }, "k").unwrap();
    assert_eq!(next.used_bytes(), used - 4096);
    assert_eq!(placed(&next, "k"), ["seg1"]);
}
