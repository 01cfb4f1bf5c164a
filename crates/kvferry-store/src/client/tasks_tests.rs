//! Replica copy and move tasks end to end in one process: a master on 127.0.0.1 and four
//! clients, each with a segment. The clients' own task loops never come round (an hour
//! apart): the test runs each task at its owner with `run_tasks`, so a task's end is the
//! call's return, not something to wait for.

use super::super::{Client, ClientConfig};
use crate::master::MasterConfig;
use crate::node::Master;
use crate::proto::{ReplicateConfig, TaskStatus};
use crate::server::MasterServer;
use std::sync::Arc;
use std::time::Duration;

fn client(addr: &str) -> Client {
    Client::setup(ClientConfig {
        master_server_addr: addr.to_string(),
        global_segment_size: 1 << 20,
        local_buffer_size: 1 << 20,
        ping_interval: Duration::from_secs(3600),
        ..ClientConfig::default()
    })
    .unwrap()
}

fn endpoints(c: &Client, key: &str) -> Vec<String> {
    let mut v: Vec<String> = c
        .batch_get_replica_desc(&[key])
        .pop()
        .unwrap()
        .unwrap()
        .into_iter()
        .map(|r| r.te_endpoint)
        .collect();
    v.sort();
    v
}

/// A copy adds a replica on the target with the value's bytes (read back once the source's
/// segment is gone); a move leaves exactly the target replica, with the bytes; a task whose
/// object went before it ran fails with the error named.
#[test]
fn copies_and_moves_carry_the_bytes_to_their_targets() {
    // (A client TTL the test never reaches: `d` below does not ping on its own.)
    let m = Arc::new(Master::new(MasterConfig {
        client_ttl: Duration::from_secs(600),
        ..MasterConfig::default()
    }));
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let _s = MasterServer::start(m, l, Duration::from_millis(20), 0).unwrap();
    let (a, b, c) = (client(&addr), client(&addr), client(&addr));
    let (na, nb, nc) = (
        a.segment_name().to_string(),
        b.segment_name().to_string(),
        c.segment_name().to_string(),
    );
    let on = |n: &str| ReplicateConfig {
        preferred_segments: vec![n.to_string()],
        ..Default::default()
    };
    let v: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let w: Vec<u8> = v.iter().rev().copied().collect();
    a.put("v", &v, &on(&na)).unwrap();
    b.put("w", &w, &on(&nb)).unwrap();
    assert_eq!(endpoints(&c, "v"), [na.as_str()]);

    let id = c.create_copy_task("v", std::slice::from_ref(&nb)).unwrap();
    assert_eq!(c.query_task(id).unwrap().status, TaskStatus::Pending);
    assert_eq!(
        a.run_tasks().unwrap(),
        1,
        "the copy runs at the source's owner"
    );
    let q = c.query_task(id).unwrap();
    assert_eq!(
        (q.status, q.message.as_str()),
        (TaskStatus::Success, "Task completed successfully")
    );
    let mut both = vec![na.clone(), nb.clone()];
    both.sort();
    assert_eq!(endpoints(&c, "v"), both);

    let id = c.create_move_task("w", &nb, &nc).unwrap();
    assert_eq!(
        a.run_tasks().unwrap(),
        0,
        "a move runs at its source's owner only"
    );
    assert_eq!(b.run_tasks().unwrap(), 1);
    assert_eq!(c.query_task(id).unwrap().status, TaskStatus::Success);
    assert_eq!(
        endpoints(&c, "w"),
        [nc.as_str()],
        "only the target replica is left"
    );
    assert_eq!(a.get("w").unwrap(), w, "the moved replica holds the value");

    // The copy's source goes: the value is read from the copy.
    a.close().unwrap();
    assert_eq!(endpoints(&c, "v"), [nb.as_str()]);
    assert_eq!(c.get("v").unwrap(), v, "the copied replica holds the value");

    // Removed after the task was created, before it ran: FAILED, naming the error.
    let d = client(&addr);
    let nd = d.segment_name().to_string();
    d.put("gone", b"x", &on(&nd)).unwrap();
    let id = c.create_move_task("gone", &nd, &nc).unwrap();
    c.remove("gone", true).unwrap();
    assert_eq!(c.query_task(id).unwrap().status, TaskStatus::Pending);
    assert_eq!(d.run_tasks().unwrap(), 1);
    let q = c.query_task(id).unwrap();
    assert_eq!(q.status, TaskStatus::Failed);
    assert!(q.message.contains("-704"), "{}", q.message);
}
