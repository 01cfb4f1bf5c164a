//! The client's unit tests: writes reported to a master that forgot them, read releases,
//! which requests are sent again, master addresses. Test code only: none of it talks to a
//! master.

use super::rpc::{idempotent, Target, Writes};
use super::*;
use crate::proto::ReplicateConfig;

/// A batch's writes are reported while they run; once every one landed they are
/// forgotten; a batch that did not land (failed, timed out) is reported until its time
/// is over, with the time it has left.
#[test]
fn writes_are_reported_until_they_landed_or_can_no_longer_land() {
    let mut w = Writes::default();
    let t0 = Instant::now();
    let a = w.start(
        vec![("h:1".into(), 4096, 100)],
        t0 + Duration::from_secs(60),
    );
    let b = w.start(
        vec![("h:2".into(), 0, 10), ("h:3".into(), 64, 1)],
        t0 + Duration::from_secs(60),
    );
    let mut now = w.report(t0);
    now.sort_by(|x, y| x.te_endpoint.cmp(&y.te_endpoint));
    assert_eq!(
        now.iter()
            .map(|x| (x.te_endpoint.as_str(), x.addr, x.size))
            .collect::<Vec<_>>(),
        vec![("h:1", 4096, 100), ("h:2", 0, 10), ("h:3", 64, 1)]
    );
    assert!(
        now.iter()
            .all(|x| x.left_ms > 59_000 && x.left_ms <= 60_000),
        "{now:?}"
    );
    w.ended(a, true);
    w.ended(b, false);
    let later = w.report(t0 + Duration::from_secs(30));
    assert_eq!(
        later.len(),
        2,
        "the batch that did not land is still reported: {later:?}"
    );
    assert!(
        later
            .iter()
            .all(|x| x.left_ms > 29_000 && x.left_ms <= 30_000),
        "{later:?}"
    );
    assert!(
        w.report(t0 + Duration::from_secs(61)).is_empty(),
        "its time over, nothing is reported"
    );
    // Batches past their time are dropped as new ones start, once there are many.
    let over: Vec<u64> = (0..63)
        .map(|_| w.start(vec![("h:4".into(), 0, 1)], Instant::now()))
        .collect();
    w.start(Vec::new(), Instant::now() + Duration::from_secs(1));
    assert!(
        over.iter().all(|id| !w.running.contains_key(id)) && w.running.contains_key(&b),
        "{} kept",
        w.running.len()
    );
}

#[test]
fn finished_reads_wait_a_tick_for_a_request_to_carry_their_release() {
    let t0 = Instant::now();
    let mut r = Releases::default();
    assert!(r.overdue(t0 + RELEASE_AFTER).is_empty(), "nothing queued");
    r.queue([1, 2], t0);
    r.queue([3], t0 + RELEASE_AFTER / 2);
    assert!(
        r.overdue(t0 + RELEASE_AFTER / 2).is_empty(),
        "a busy client's next request carries them"
    );
    assert_eq!(
        r.overdue(t0 + RELEASE_AFTER),
        vec![1, 2, 3],
        "the oldest waited a tick: all go"
    );
    assert!(r.overdue(t0 + RELEASE_AFTER * 10).is_empty());
    r.queue([4], t0 + RELEASE_AFTER * 10);
    assert_eq!(r.take(), vec![4], "a request carries them at once");
    assert!(
        r.overdue(t0 + RELEASE_AFTER * 100).is_empty(),
        "and the clock restarts with the next one"
    );
    r.queue([5], t0 + RELEASE_AFTER * 100);
    assert!(r
        .overdue(t0 + RELEASE_AFTER * 100 + RELEASE_AFTER / 2)
        .is_empty());
}

#[test]
fn only_requests_that_may_be_repeated_are_sent_again_after_a_lost_connection() {
    assert!(idempotent(&Request::Batch(vec![
        Request::ReleaseReads { ids: vec![1] },
        Request::GetReplicaList { key: "k".into() },
        Request::Ping { client: 1 }
    ])));
    assert!(!idempotent(&Request::Batch(vec![
        Request::ExistKey { key: "k".into() },
        Request::PutEnd {
            client: 1,
            key: "k".into(),
            put: 1
        }
    ])));
    for r in [
        Request::PutStart {
            client: 1,
            key: "k".into(),
            size: 1,
            config: ReplicateConfig::default(),
            upsert: false,
            put: 1,
        },
        Request::Remove {
            key: "k".into(),
            force: false,
        },
        Request::UnmountSegment {
            client: 1,
            segment: 2,
        },
    ] {
        assert!(!idempotent(&r), "{r:?}");
    }
}

#[test]
fn master_addresses_are_host_port_or_etcd() {
    let cfg = Config::default();
    assert!(matches!(
        Rpc::new("127.0.0.1:50051", Duration::from_secs(1), &cfg).map(|r| r.target),
        Ok(Target::Fixed)
    ));
    let r = Rpc::new(
        "etcd://127.0.0.1:2379;127.0.0.1:2380",
        Duration::from_secs(1),
        &cfg,
    )
    .expect("etcd form");
    match &r.target {
        Target::Etcd { key, etcd } => assert_eq!(
            (key.as_str(), etcd.location()),
            (
                "mooncake-store/mooncake_cluster/master_view",
                "etcd://127.0.0.1:2379,127.0.0.1:2380"
            )
        ),
        Target::Fixed => panic!("etcd:// is followed"),
    }
    let c = Config {
        store_cluster_id: Some("c7".into()),
        ..Config::default()
    };
    assert!(
        matches!(Rpc::new("etcd://h:1", Duration::from_secs(1), &c).map(|r| r.target), Ok(Target::Etcd { key, .. }) if key == "mooncake-store/c7/master_view")
    );
    for bad in ["etcd://", "redis://h:6379", "k8s://ns/lease"] {
        assert!(
            matches!(
                Rpc::new(bad, Duration::from_secs(1), &cfg),
                Err(StoreError::InvalidParams(_))
            ),
            "{bad}"
        );
    }
}

/// Issue 45: `setup(..., protocol="rdma", rdma_devices, ...)` makes the client's engine
/// RDMA-only, as Mooncake's store installs the protocol asked for: on a host without a usable
/// RDMA NIC (CI's) setup fails before anything starts, naming the cause and the fix.
#[test]
fn setup_with_protocol_rdma_where_rdma_is_unusable_fails_saying_why() {
    let env = [
        "MC_FORCE_TCP",
        "KVFERRY_TRANSPORT",
        "KVFERRY_RDMA_DEVICES",
        "MC_TE_FILTERS",
    ];
    if kvferry::host::rdma::probe().usable() || env.iter().any(|v| std::env::var_os(v).is_some()) {
        eprintln!("NOT RUN: this host has a usable RDMA port, or one of {env:?} is set");
        return;
    }
    let setup = |protocol: &str| {
        Client::setup(ClientConfig {
            protocol: protocol.into(),
            device_name: "mlx5_0,mlx5_1".into(),
            global_segment_size: 0,
            local_buffer_size: 0,
            master_server_addr: "127.0.0.1:1".into(),
            ..ClientConfig::default()
        })
    };
    match setup("rdma") {
        Err(StoreError::InvalidParams(e)) => assert!(
            e.contains("protocol=\"rdma\", device_name=\"mlx5_0,mlx5_1\" asks for RDMA only")
                && e.contains("Fix:")
                && e.contains("protocol=\"tcp\""),
            "{e}"
        ),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("an RDMA-only client started on a host without RDMA"),
    }
    // With "tcp" the engine starts (the master, absent here, is what fails).
    match setup("tcp") {
        Err(StoreError::Rpc(e)) => assert!(e.contains("127.0.0.1:1"), "{e}"),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("no master listens at 127.0.0.1:1"),
    }
}
