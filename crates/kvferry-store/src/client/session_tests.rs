//! Reservations written by ranges and kept replica lists read by ranges, end to end in one
//! process: a master on 127.0.0.1 and clients over TCP.

use super::super::{Client, ClientConfig};
use super::Range;
use crate::error::StoreError;
use crate::master::MasterConfig;
use crate::node::Master;
use crate::proto::ReplicateConfig;
use crate::server::MasterServer;
use std::sync::Arc;
use std::time::Duration;

fn master(lease_ttl: Duration) -> (MasterServer, String) {
    let m = Arc::new(Master::new(MasterConfig {
        lease_ttl,
        ..MasterConfig::default()
    }));
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (
        MasterServer::start(m, l, Duration::from_millis(20), 0).unwrap(),
        addr,
    )
}

fn client(master: &str) -> Client {
    Client::setup(ClientConfig {
        master_server_addr: master.into(),
        global_segment_size: 1 << 20,
        local_buffer_size: 1 << 20,
        ..ClientConfig::default()
    })
    .unwrap()
}

/// A registered buffer of `len` bytes, `i * 7 + seed` (mod 251) at byte `i`.
fn buffer(c: &Client, len: usize, seed: usize) -> (Vec<u8>, u64) {
    let mut v: Vec<u8> = (0..len).map(|i| ((i * 7 + seed) % 251) as u8).collect();
    // A mutable pointer: the engine writes into it.
    let addr = v.as_mut_ptr() as u64;
    c.register_buffer(addr, len as u64).unwrap();
    (v, addr)
}

fn r(addr: u64, len: u64, off: u64) -> Range {
    Range { addr, len, off }
}

/// Reserved keys are not readable; ranges land at their offsets in every replica (two
/// segments here); a range past the reserved size fails before anything moves; an end makes
/// the value readable, a revoke frees the key; an ended reservation cannot end again.
#[test]
fn a_reservation_is_written_by_ranges_and_readable_only_once_ended() {
    let (_s, addr) = master(Duration::from_secs(10));
    let (a, b) = (client(&addr), client(&addr));
    let (src, p) = buffer(&a, 8192, 3);
    let two = ReplicateConfig {
        replica_num: 2,
        ..ReplicateConfig::default()
    };
    let mut rs: Vec<_> = a
        .reserve(&[("k", 100), ("j", 50)], &two)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(!b.is_exist("k").unwrap() && !b.probe_key("k").unwrap());
    assert!(b.get("k").is_err(), "not readable before its end");
    let (k, j) = (&rs[0], &rs[1]);
    let wrote = a.write_reserved(&[
        (k, &[r(p, 60, 0), r(p + 1000, 40, 60)][..]),
        (j, &[r(p + 2000, 50, 0)][..]),
    ]);
    assert_eq!(wrote, vec![Ok(100), Ok(50)]);
    assert!(matches!(
        a.write_reserved(&[(k, &[r(p, 10, 95)][..])])[0],
        Err(StoreError::InvalidParams(_))
    ));
    assert_eq!(a.end_reserved(&[k, j]), vec![Ok(()), Ok(())]);
    let mut want = src[..60].to_vec();
    want.extend_from_slice(&src[1000..1040]);
    assert_eq!(b.get("k").unwrap(), want);
    assert_eq!(b.get("j").unwrap(), &src[2000..2050]);
    assert_eq!(
        b.batch_get_replica_desc(&["k"])[0].as_ref().unwrap().len(),
        2
    );
    assert!(a.end_reserved(&[k])[0].is_err(), "ended already");
    rs.clear();
    let again = a.reserve(&[("r", 10)], &ReplicateConfig::default());
    let again = again[0].as_ref().unwrap();
    assert_eq!(a.revoke_reserved(&[again]), vec![Ok(())]);
    assert!(!b.is_exist("r").unwrap());
    assert!(
        a.reserve(&[("r", 10)], &ReplicateConfig::default())[0].is_ok(),
        "a revoked key is free"
    );
    assert!(matches!(
        a.reserve(&[("k", 10)], &ReplicateConfig::default())[0],
        Err(StoreError::ObjectAlreadyExists(_))
    ));
}

/// A kept list reads ranges of the value (from the other client's segment) and holds a read
/// lease (a remove is refused meanwhile); a range past the value fails; a missing key is
/// ObjectNotFound at once.
#[test]
fn kept_replica_lists_read_ranges_and_hold_a_lease() {
    let (_s, addr) = master(Duration::from_secs(10));
    let (a, b) = (client(&addr), client(&addr));
    let value: Vec<u8> = (0..200u32).map(|i| i as u8).collect();
    a.put("v", &value, &ReplicateConfig::default()).unwrap();
    let (dst, d) = buffer(&b, 4096, 0);
    let leases = b.lease_reads(&["v", "missing"]);
    assert!(matches!(leases[1], Err(StoreError::ObjectNotFound(_))));
    let l = leases[0].as_ref().unwrap();
    assert_eq!(l.size(), 200);
    assert!(matches!(
        a.remove("v", false),
        Err(StoreError::ObjectHasLease(_))
    ));
    let got = b.read_leased(&[(l, &[r(d, 3, 5), r(d + 10, 4, 50)][..])]);
    assert_eq!(got, vec![Ok(7)]);
    // The transfer above has ended: `dst` holds what it wrote.
    let bytes = &dst[..14];
    assert_eq!(
        (&bytes[..3], &bytes[10..14]),
        (&value[5..8], &value[50..54])
    );
    assert!(matches!(
        b.read_leased(&[(l, &[r(d, 10, 195)][..])])[0],
        Err(StoreError::InvalidParams(_))
    ));
    b.release_leases(leases.iter().flatten());
}

/// A read from a list whose lease ran out is refused (the replica may have been reused):
/// with a 1 ms lease every read is past it.
#[test]
fn a_kept_list_past_its_lease_is_refused() {
    let (_s, addr) = master(Duration::from_millis(1));
    let (a, b) = (client(&addr), client(&addr));
    a.put("v", &[7u8; 64], &ReplicateConfig::default()).unwrap();
    let (_dst, d) = buffer(&b, 64, 0);
    let l = b.lease_reads(&["v"]).pop().unwrap().unwrap();
    assert!(matches!(
        b.read_leased(&[(&l, &[r(d, 8, 0)][..])])[0],
        Err(StoreError::LeaseExpired(_))
    ));
}
