//! Races on one metadata entry, run against every backend that promises them atomic:
//! engines taking one name at once, and a removal of only the write that was seen. Shared
//! by `crates/kvferry/tests/metadata.rs` (etcd, Redis, Mooncake's HTTP server) and
//! `crates/kvferry-cli/tests/metadata_server.rs` (`kvferry metadata-server`).

use kvferry::metadata::{connect, Directory, Keys, MetadataStore, RpcMeta, StoreOptions};
use std::sync::Arc;

fn raw_store(url: &str) -> Arc<dyn MetadataStore> {
    connect(url, &StoreOptions::default())
        .expect("connect")
        .expect("not P2P")
}

/// Engines starting under one name at the same instant: exactly one gets it, each of the
/// others is told a live engine has it, and the entry is the winner's. Before, each looked
/// (absent) and then put, and several of them "registered" the name, the last put winning.
/// With `dead`, the name is held by a dead engine's entry, which they all replace at once
/// (each removes it only if unchanged, so none removes the entry another one just made).
pub fn one_name_raced(url: &str, dead: bool) {
    const N: u16 = 8;
    const DEAD: u16 = 2999;
    let keys = Keys::new(None);
    let holder = raw_store(url);
    if dead {
        let v = serde_json::to_vec(&RpcMeta {
            ip_or_host_name: "127.0.0.1".into(),
            rpc_port: DEAD,
        })
        .unwrap();
        holder.put(&keys.rpc_meta("raced"), &v).unwrap();
    }
    let barrier = Arc::new(std::sync::Barrier::new(N as usize));
    let threads: Vec<_> = (0..N)
        .map(|i| {
            let (url, keys, barrier) = (url.to_string(), keys.clone(), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let d = Directory::new(raw_store(&url), keys);
                let meta = RpcMeta {
                    ip_or_host_name: "127.0.0.1".into(),
                    rpc_port: 3000 + i,
                };
                barrier.wait();
                (
                    meta.rpc_port,
                    d.publish_rpc_meta("raced", &meta, &|m| m.rpc_port != DEAD)
                        .map_err(|e| e.to_string()),
                    d,
                )
            })
        })
        .collect();
    let results: Vec<_> = threads
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    let won: Vec<u16> = results
        .iter()
        .filter(|(_, r, _)| r.is_ok())
        .map(|(p, _, _)| *p)
        .collect();
    assert_eq!(
        won.len(),
        1,
        "{url}: winners {won:?} of {:?}",
        results.iter().map(|(p, r, _)| (p, r)).collect::<Vec<_>>()
    );
    for (port, r, _) in &results {
        if let Err(e) = r {
            assert!(
                e.contains("already registered by a live engine") || e.contains("kept changing"),
                "{url}: engine {port}: {e}"
            );
        }
    }
    let stored = raw_store(url)
        .get(&keys.rpc_meta("raced"))
        .expect("get")
        .expect("the winner's entry");
    let m: RpcMeta = serde_json::from_slice(&stored).expect("rpc_meta");
    assert_eq!(m.rpc_port, won[0], "{url}: the entry is the winner's");
    for (_, _, d) in results {
        d.withdraw_all();
    }
    holder.remove(&keys.rpc_meta("raced")).unwrap();
}

/// A removal of what was seen takes only that write: on etcd, an identical entry written
/// again since (the dead engine restarted at its address and registered anew, between
/// another engine's look and its removal) stays (the write is compared, `mod_revision`); a
/// changed value stays on every backend; an unchanged one goes. Before, etcd compared the
/// value alone and removed the restarted engine's entry. `kvferry metadata-server` tells
/// rewrites apart too (`ETag`, `If-Match`).
pub fn removal_takes_only_the_write_seen(url: &str, tells_rewrites: bool) {
    let s = raw_store(url);
    let keys = Keys::new(None);
    let key = keys.rpc_meta("seen");
    s.put(&key, b"v1").unwrap();
    let seen = s.get_seen(&key).unwrap().expect("present");
    assert_eq!(seen.value, b"v1");
    assert_eq!(seen.revision.is_some(), tells_rewrites, "{url}: {seen:?}");
    // Written again with the same value: removed first (the dead engine restarted and
    // registered anew), or written over (an identical rpc_meta PUT, which HTTP servers
    // accept).
    for over in [false, true] {
        let seen = s.get_seen(&key).unwrap().expect("present");
        if !over {
            s.remove(&key).unwrap();
        }
        s.put(&key, b"v1").unwrap();
        let removed = s.remove_if(&key, &seen).unwrap();
        assert_eq!(
            removed,
            !tells_rewrites,
            "{url}: an identical rewrite ({}) {}",
            if over { "over it" } else { "after a removal" },
            if tells_rewrites {
                "was removed"
            } else {
                "is not told apart here"
            }
        );
        if removed {
            s.put(&key, b"v1").unwrap();
        }
    }
    // Changed: never removed. (Not an rpc_meta key: HTTP servers refuse to change those.)
    let other = keys.ram("seen");
    s.put(&other, b"v1").unwrap();
    let seen_other = s.get_seen(&other).unwrap().expect("present");
    s.put(&other, b"v2").unwrap();
    assert!(
        !s.remove_if(&other, &seen_other).unwrap(),
        "{url}: a changed value was removed"
    );
    assert_eq!(s.get(&other).unwrap().as_deref(), Some(&b"v2"[..]));
    s.remove(&other).unwrap();
    // Unchanged: removed.
    let seen = s.get_seen(&key).unwrap().expect("present");
    assert!(
        s.remove_if(&key, &seen).unwrap(),
        "{url}: the entry seen was not removed"
    );
    assert_eq!(s.get(&key).unwrap(), None);
    assert!(!s.remove_if(&key, &seen).unwrap(), "{url}: removed twice");
}
