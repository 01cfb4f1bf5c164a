//! The server's unit tests: the key's proof on live connections, batches, puts waiting for
//! reads, connections' polls, and answers that wait for the journal. Test code only: nothing
//! here is compiled into the server.

use super::handlers::{handle_admitted, settle, BATCH_HOLD};
use super::*;
use crate::error::StoreError;
use crate::master::MasterConfig;
use crate::net::read_by;
use crate::proto::ReplicateConfig;
use crate::proto::Segment;
use crate::proto::{PingStatus, Request};
use std::sync::atomic::AtomicUsize;

mod auth;

mod journal;

fn read_answer(c: &mut TcpStream) -> std::io::Result<Response> {
    let mut len = [0u8; 4];
    c.read_exact(&mut len)?;
    let mut body =
        vec![0u8; proto::decode_len(len).map_err(|e| std::io::Error::other(e.to_string()))?];
    c.read_exact(&mut body)?;
    proto::decode(&body).map_err(|e| std::io::Error::other(e.to_string()))
}

fn seg(id: u64, size: u64) -> Segment {
    Segment {
        id,
        name: format!("s{id}"),
        te_endpoint: format!("127.0.0.1:{id}"),
        base: id << 32,
        size,
    }
}

/// A master leading `term`, its state journaling and its journal active (nothing writes
/// it: tests drive the journal by hand).
fn journaling_leader(term: i64) -> Master {
    let m = Master::new(MasterConfig::default());
    m.gate.lead_for_test(term, Duration::from_secs(60));
    {
        let mut st = m.lock();
        st.term = term;
        st.journal_on();
    }
    m.journal.activate(term);
    m
}

fn put_start(key: &str, size: u64) -> Request {
    Request::PutStart {
        client: 1,
        key: key.into(),
        size,
        config: ReplicateConfig::default(),
        upsert: false,
        put: 1,
    }
}

/// A removal's pattern is compiled with a bounded size under the state's lock: one that
/// would compile to more is refused, saying so, and removes nothing.
#[test]
fn a_regex_removal_too_large_to_compile_is_refused() {
    let m = Master::new(MasterConfig::default());
    // (`\w{40}` compiles under regex's own 10 MiB limit, over this one.)
    let r = handle(
        &m,
        Request::RemoveByRegex {
            pattern: "\\w{40}".into(),
            force: false,
        },
    );
    assert!(
        matches!(&r, Response::Err(StoreError::InvalidParams(w)) if w.contains("bad regex")),
        "{r:?}"
    );
    assert_eq!(
        handle(
            &m,
            Request::RemoveByRegex {
                pattern: "^k".into(),
                force: false
            }
        ),
        Response::Count(0)
    );
}

/// A batch whose answers would pass the frame limit stops applying its requests at half
/// of it: the rest are answered "not applied", and the answer is sent (before, every
/// request was applied and the whole answer replaced by one error).
#[test]
fn a_batch_stops_applying_before_its_answer_outgrows_a_frame() {
    let m = Master::new(MasterConfig::default());
    let long = Segment {
        te_endpoint: format!("127.0.0.1:1/{}", "x".repeat(8000)),
        ..seg(1, 4 << 20)
    };
    assert_eq!(
        handle(
            &m,
            Request::MountSegment {
                client: 1,
                segment: long
            }
        ),
        Response::Ok
    );
    assert!(matches!(
        handle(&m, put_start("k", 4096)),
        Response::Replicas(_)
    ));
    assert_eq!(
        handle(
            &m,
            Request::PutEnd {
                client: 1,
                key: "k".into(),
                put: 1
            }
        ),
        Response::Ok
    );
    let n = 6000; // 6000 answers of ~8 KB: 48 MB
    let Response::Batch(a) = handle(
        &m,
        Request::Batch(
            (0..n)
                .map(|_| Request::GetReplicaList { key: "k".into() })
                .collect(),
        ),
    ) else {
        panic!("not a batch's answer")
    };
    assert_eq!(a.len(), n);
    let served = a
        .iter()
        .take_while(|r| matches!(r, Response::ReplicaList(_)))
        .count();
    assert!(
        (3000..5000).contains(&served),
        "{served} gets served before half a frame (32 MiB) of answers"
    );
    assert!(a[served..].iter().all(
        |r| matches!(r, Response::Err(StoreError::InvalidParams(w)) if w.contains("not applied"))
    ));
    assert!(
        proto::encode(&Response::Batch(a)).is_ok(),
        "the answer fits a frame"
    );
}

/// A batch is answered request by request, in order, across several holds of the lock
/// (more requests than one hold takes, a bulk removal and a nested batch among them),
/// each request counted in the statistics as when sent alone.
#[test]
fn a_batch_answers_every_request_in_order_across_holds_of_the_lock() {
    let m = Master::new(MasterConfig::default());
    assert_eq!(
        handle(
            &m,
            Request::MountSegment {
                client: 1,
                segment: seg(1, 4 << 20)
            }
        ),
        Response::Ok
    );
    let n = 2 * BATCH_HOLD + 22;
    let keys: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
    let mut starts: Vec<Request> = keys.iter().map(|k| put_start(k, 4096)).collect();
    starts.insert(
        BATCH_HOLD + 3,
        Request::Batch(vec![Request::Ping { client: 1 }]),
    );
    let Response::Batch(a) = handle(&m, Request::Batch(starts)) else {
        panic!("not a batch's answer")
    };
    assert_eq!(a.len(), n + 1);
    for (i, r) in a.iter().enumerate() {
        if i == BATCH_HOLD + 3 {
            assert!(
                matches!(r, Response::Err(StoreError::InvalidParams(_))),
                "the nested batch: {r:?}"
            );
        } else {
            assert!(
                matches!(r, Response::Replicas(v) if v.len() == 1),
                "put {i}: {r:?}"
            );
        }
    }
    let mut ends: Vec<Request> = keys
        .iter()
        .map(|k| Request::PutEnd {
            client: 1,
            key: k.clone(),
            put: 1,
        })
        .collect();
    ends.push(Request::PutEnd {
        client: 1,
        key: "never-started".into(),
        put: 1,
    });
    ends.push(Request::RemoveByRegex {
        pattern: "^k1".into(),
        force: false,
    });
    ends.push(Request::ExistKey { key: "k0".into() });
    ends.push(Request::ExistKey { key: "k100".into() });
    ends.push(Request::RemoveByRegex {
        pattern: "(".into(),
        force: false,
    });
    let Response::Batch(b) = handle(&m, Request::Batch(ends)) else {
        panic!("not a batch's answer")
    };
    assert!(b[..n].iter().all(|r| *r == Response::Ok), "{:?}", &b[..n]);
    assert!(
        matches!(b[n], Response::Err(_)),
        "a put that never started: {:?}",
        b[n]
    );
    // k1, k10-k19 and k100-k149.
    assert_eq!(b[n + 1], Response::Count(1 + 10 + (n as u64 - 100)));
    assert_eq!(
        b[n + 2..n + 4],
        [Response::Exists(true), Response::Exists(false)]
    );
    assert!(
        matches!(b[n + 4], Response::Err(StoreError::InvalidParams(_))),
        "{:?}",
        b[n + 4]
    );
    let ops = |op: usize| {
        (
            m.stats.ops[op].load(Ordering::Relaxed),
            m.stats.errors[op].load(Ordering::Relaxed),
        )
    };
    assert_eq!(ops(4), (n as u64, 0), "PutStart");
    assert_eq!(ops(5), (n as u64 + 1, 1), "PutEnd");
    assert_eq!(ops(11), (2, 1), "RemoveByRegex");
    assert_eq!(ops(3), (0, 0), "the nested batch's ping was not applied");
}

/// A put in a batch that finds the space held by a read in flight lets the lock go, waits
/// for the read to end and tries again; the requests after it see what it did.
#[test]
fn a_put_in_a_batch_waits_for_reads_without_the_lock_and_the_rest_follow_it() {
    let m = Arc::new(Master::new(MasterConfig {
        put_wait_for_reads: Duration::from_secs(5),
        ..MasterConfig::default()
    }));
    assert_eq!(
        handle(
            &m,
            Request::MountSegment {
                client: 1,
                segment: seg(1, 64 << 10)
            }
        ),
        Response::Ok
    );
    for k in ["old", "read"] {
        assert!(matches!(
            handle(&m, put_start(k, 32 << 10)),
            Response::Replicas(_)
        ));
        assert_eq!(
            handle(
                &m,
                Request::PutEnd {
                    client: 1,
                    key: k.into(),
                    put: 1
                }
            ),
            Response::Ok
        );
    }
    let Response::ReplicaList(l) = handle(&m, Request::GetReplicaList { key: "read".into() })
    else {
        panic!("no replica list")
    };
    let t = Instant::now();
    let reader = {
        let m = Arc::clone(&m);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            // Not blocked behind the batch: the put waits without the lock.
            assert_eq!(
                handle(&m, Request::ExistKey { key: "old".into() }),
                Response::Exists(true)
            );
            assert_eq!(
                handle(
                    &m,
                    Request::ReleaseReads {
                        ids: vec![l.read_id]
                    }
                ),
                Response::Ok
            );
        })
    };
    let exists = |k: &str| Request::ExistKey { key: k.into() };
    let batch = vec![
        exists("read"),
        put_start("new", 32 << 10),
        exists("old"),
        exists("read"),
        exists("new"),
    ];
    let Response::Batch(a) = handle(&m, Request::Batch(batch)) else {
        panic!("not a batch's answer")
    };
    reader.join().expect("the reader's checks");
    assert!(
        t.elapsed() >= Duration::from_millis(100),
        "the put did not wait for the read"
    );
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "the put gave up waiting instead of seeing the read end"
    );
    assert_eq!(a[0], Response::Exists(true));
    assert!(matches!(a[1], Response::Replicas(_)), "{:?}", a[1]);
    let left = a[2..4]
        .iter()
        .filter(|r| **r == Response::Exists(true))
        .count();
    assert_eq!(
        left,
        1,
        "one object made room for the put, seen by the requests after it: {:?}",
        &a[2..4]
    );
    assert_eq!(
        a[4],
        Response::Exists(false),
        "the new object is not complete"
    );
}

/// Only `limit` connections poll at once; the others go to sleep in the kernel at once
/// (and read nothing); a poll takes what arrived, a closed peer is an end of stream.
#[test]
fn at_most_the_limit_of_connections_poll_for_their_next_request() {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
    let (s, _) = l.accept().expect("accept");
    let spin = Spin {
        bound: Duration::from_secs(5),
        polling: AtomicUsize::new(1),
        limit: 1,
    };
    c.write_all(&[1, 2, 3, 4]).expect("send");
    let mut prefix = [0u8; 4];
    let t = Instant::now();
    assert_eq!(
        spin.poll(&s, &mut prefix).expect("poll"),
        0,
        "over the limit: no poll"
    );
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(
        spin.polling.load(Ordering::Relaxed),
        1,
        "the count is left as it was"
    );
    spin.polling.store(0, Ordering::Relaxed);
    assert_eq!(spin.poll(&s, &mut prefix).expect("poll"), 4);
    assert_eq!(prefix, [1, 2, 3, 4]);
    assert_eq!(spin.polling.load(Ordering::Relaxed), 0);
    let quick = Spin {
        bound: Duration::from_millis(20),
        ..spin
    };
    assert_eq!(
        quick.poll(&s, &mut prefix).expect("poll"),
        0,
        "nothing came within the bound"
    );
    drop(c);
    let e = quick.poll(&s, &mut prefix).expect_err("the peer closed");
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    assert_eq!(quick.polling.load(Ordering::Relaxed), 0);
}

/// A replication reader's poll returns once bytes arrived (reading none of them) or the
/// peer closed, gives up after its bound, and polls only below its limit; under 4 CPUs
/// nothing polls.
#[test]
fn a_replication_reader_polls_until_its_next_frame_arrives_and_reads_nothing() {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
    let (mut s, _) = l.accept().expect("accept");
    let spin = Spin {
        bound: Duration::from_secs(5),
        polling: AtomicUsize::new(0),
        limit: 1,
    };
    let t = Instant::now();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(30));
            c.write_all(&[7]).expect("send");
        });
        assert!(spin.readable(&s), "the byte arrived within the bound");
    });
    assert!(
        t.elapsed() >= Duration::from_millis(25) && t.elapsed() < Duration::from_secs(4),
        "polled until it arrived: {:?}",
        t.elapsed()
    );
    assert_eq!(spin.polling.load(Ordering::Relaxed), 0);
    let mut b = [0u8; 1];
    s.read_exact(&mut b).expect("the byte is still there");
    assert_eq!(b, [7]);
    let quick = Spin {
        bound: Duration::from_millis(20),
        ..spin
    };
    let t = Instant::now();
    assert!(!quick.readable(&s), "nothing came within the bound");
    assert!(t.elapsed() >= Duration::from_millis(20));
    quick.polling.store(1, Ordering::Relaxed);
    c.write_all(&[8]).expect("send");
    let t = Instant::now();
    assert!(
        !quick.readable(&s),
        "over the limit: no poll, even with a byte there"
    );
    assert!(t.elapsed() < Duration::from_millis(20));
    quick.polling.store(0, Ordering::Relaxed);
    s.read_exact(&mut b).expect("read");
    drop(c);
    assert!(
        quick.readable(&s),
        "a closed peer ends the poll (the read finds the end)"
    );
    assert_eq!(s.read(&mut b).expect("read"), 0);
    assert!(
        Spin::for_replication_on(2).bound.is_zero(),
        "two CPUs: no poll"
    );
    assert_eq!(Spin::for_replication_on(16).limit, 4);
}

/// Half the CPUs poll at once; on one CPU nothing polls (the poller would hold the CPU its
/// client needs): a request already there is read at once, and nothing is waited for.
#[test]
fn on_one_cpu_no_connection_polls() {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
    let (s, _) = l.accept().expect("accept");
    assert_eq!(Spin::for_cpus(Duration::from_micros(50), 16).limit, 8);
    assert_eq!(Spin::for_cpus(Duration::from_micros(50), 2).limit, 1);
    let one = Spin::for_cpus(Duration::from_secs(5), 1);
    let mut prefix = [0u8; 4];
    let t = Instant::now();
    assert_eq!(
        one.poll(&s, &mut prefix).expect("poll"),
        0,
        "nothing there, nothing waited for"
    );
    c.write_all(&[1, 2, 3, 4]).expect("send");
    // Until all four bytes are there (a blocking peek waits for them, reading none).
    while s.peek(&mut [0u8; 4]).expect("peek") < 4 {}
    assert_eq!(
        one.poll(&s, &mut prefix).expect("poll"),
        0,
        "even what is there is left to the blocking read"
    );
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "no poll ran to its bound"
    );
    assert_eq!(one.polling.load(Ordering::Relaxed), 0);
}
