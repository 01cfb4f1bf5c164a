//! The disk tier against a real directory: restarts, crash leftovers, corruption, a second
//! owner, a vanished directory, capacity and two-phase eviction, concurrent use.

use super::layout::object_path;
use super::*;
use std::sync::Arc;

fn value(key: &str, version: u32, len: usize) -> Vec<u8> {
    let seed = format!("{key}/{version}/");
    seed.bytes().cycle().take(len).collect()
}

fn open(dir: &Path, cap: u64) -> (DiskTier, Recovered) {
    DiskTier::open(dir, cap).unwrap()
}

#[test]
fn objects_come_back_whole_after_a_restart_and_usage_counts_each_record_once() {
    let d = tempfile::tempdir().unwrap();
    {
        let (t, rec) = open(d.path(), 1 << 30);
        assert_eq!(rec, Recovered::default());
        t.put("a", &value("a", 1, 5000)).unwrap();
        t.put("b", &value("b", 1, 1)).unwrap();
        t.put("a", &value("a", 2, 70_000)).unwrap(); // replaces
        t.put("empty", b"").unwrap();
        assert_eq!(t.get("a").unwrap().unwrap(), value("a", 2, 70_000));
        assert_eq!(t.usage().0, (32 + 1 + 70_000) + (32 + 1 + 1) + (32 + 5));
    }
    let (t, rec) = open(d.path(), 1 << 30);
    assert_eq!(rec.dropped, 0);
    assert_eq!(
        rec.objects,
        vec![("a".into(), 70_000), ("b".into(), 1), ("empty".into(), 0)]
    );
    assert_eq!(t.get("a").unwrap().unwrap(), value("a", 2, 70_000));
    assert_eq!(t.get("b").unwrap().unwrap(), value("b", 1, 1));
    assert_eq!(t.get("empty").unwrap().unwrap(), b"");
    assert_eq!(t.get("nope").unwrap(), None);
    assert_eq!(t.usage().0, (32 + 1 + 70_000) + (32 + 1 + 1) + (32 + 5));
    assert!(t.remove("a").unwrap());
    assert!(!t.remove("a").unwrap());
    assert!(!object_path(d.path(), "a").exists());
}

/// A directory keeps its id across restarts (the master names disk copies by it); another
/// directory has another, and a garbled `.id` is replaced by a new one.
#[test]
fn a_directorys_id_survives_restarts_and_differs_between_directories() {
    let (d, e) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let first = open(d.path(), 1 << 20).0.id();
    assert_eq!(open(d.path(), 1 << 20).0.id(), first);
    assert_ne!(open(e.path(), 1 << 20).0.id(), first);
    assert!(std::fs::read_dir(d.path().join("tmp"))
        .unwrap()
        .next()
        .is_none());
    std::fs::write(d.path().join(".id"), "garbage").unwrap();
    let new = open(d.path(), 1 << 20).0.id();
    assert_ne!(new, first);
    assert_eq!(open(d.path(), 1 << 20).0.id(), new);
}

#[test]
fn a_second_owner_of_a_directory_is_refused_and_a_missing_directory_named() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = open(d.path(), 1 << 20);
    let err = DiskTier::open(d.path(), 1 << 20).err().unwrap();
    assert!(matches!(err, DiskError::InUse(_)), "{err}");
    assert!(err.to_string().contains("directory of its own"), "{err}");
    drop(t);
    let (_t, _) = open(d.path(), 1 << 20);
    let missing = d.path().join("not-there");
    let err = DiskTier::open(&missing, 1 << 20).err().unwrap();
    assert!(matches!(err, DiskError::NoDirectory(_)), "{err}");
    assert!(err.to_string().contains("mkdir -p"), "{err}");
}

#[test]
fn what_a_crash_leaves_is_deleted_at_open_and_whole_records_stay() {
    let d = tempfile::tempdir().unwrap();
    {
        let (t, _) = open(d.path(), 1 << 30);
        t.put("whole", &value("whole", 1, 4096)).unwrap();
        t.put("torn", &value("torn", 1, 4096)).unwrap();
        t.put("moved", &value("moved", 1, 10)).unwrap();
    }
    // A write that died before its rename, a record cut short, one under another key's name.
    fs::write(d.path().join("tmp").join("123.0"), b"half a record").unwrap();
    let torn = object_path(d.path(), "torn");
    let f = OpenOptions::new().write(true).open(&torn).unwrap();
    f.set_len(32 + 4 + 100).unwrap();
    let elsewhere = object_path(d.path(), "not-moved");
    fs::create_dir_all(elsewhere.parent().unwrap()).unwrap();
    fs::rename(object_path(d.path(), "moved"), &elsewhere).unwrap();

    let (t, rec) = open(d.path(), 1 << 30);
    assert_eq!(rec.objects, vec![("whole".into(), 4096)]);
    assert_eq!(rec.dropped, 3);
    assert!(!torn.exists() && !elsewhere.exists());
    assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
    assert_eq!(t.get("whole").unwrap().unwrap(), value("whole", 1, 4096));
    assert_eq!(t.get("torn").unwrap(), None);
}

#[test]
fn a_corrupt_record_is_never_served_and_is_deleted() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = open(d.path(), 1 << 30);
    t.put("k", &value("k", 1, 100_000)).unwrap();
    let p = object_path(d.path(), "k");
    let mut bytes = fs::read(&p).unwrap();
    bytes[32 + 1 + 50_000] ^= 0x40;
    fs::write(&p, &bytes).unwrap();
    let mut buf = vec![0u8; 100_000];
    let err = t.get_into("k", &mut buf).unwrap_err();
    assert!(matches!(err, DiskError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("checksum"), "{err}");
    assert!(!p.exists());
    assert_eq!(t.get("k").unwrap(), None);
    assert_eq!(t.usage().0, 0);
}

#[test]
fn a_vanished_directory_makes_objects_absent_and_puts_fail_by_name() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("offload");
    fs::create_dir(&root).unwrap();
    let (t, _) = open(&root, 1 << 30);
    t.put("k", &value("k", 1, 10)).unwrap();
    fs::remove_dir_all(&root).unwrap();
    assert_eq!(t.get("k").unwrap(), None);
    assert!(!t.contains("k"));
    let err = t.put("j", b"v").unwrap_err();
    assert!(matches!(err, DiskError::Io { .. }), "{err}");
    assert!(
        err.to_string().contains(&root.display().to_string()),
        "{err}"
    );
}

#[test]
fn bad_arguments_are_refused_and_touch_nothing() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = open(d.path(), 1 << 30);
    let long = "k".repeat(MAX_KEY + 1);
    assert!(matches!(t.put(&long, b"v"), Err(DiskError::KeyTooLong(_))));
    t.put("k", &value("k", 1, 10)).unwrap();
    let mut small = [0u8; 9];
    assert!(matches!(
        t.get_into("k", &mut small),
        Err(DiskError::BufferTooSmall { have: 9, need: 10 })
    ));
    assert_eq!(t.get("k").unwrap().unwrap(), value("k", 1, 10));
}

#[test]
fn a_full_tier_refuses_then_evicts_least_recently_used_in_two_phases() {
    let d = tempfile::tempdir().unwrap();
    let rec = |k: &str, n: u64| 32 + k.len() as u64 + n;
    let cap = 3 * rec("k0", 1000);
    let (t, _) = open(d.path(), cap);
    for k in ["k0", "k1", "k2"] {
        t.put(k, &value(k, 1, 1000)).unwrap();
    }
    let err = t.put("k3", &value("k3", 1, 1000)).unwrap_err();
    assert!(matches!(err, DiskError::Full { .. }), "{err}");
    assert!(!t.contains("k3"));
    t.get("k0").unwrap().unwrap(); // k1 is now the least recently used

    // Told to the master, then cancelled: everything is back.
    let p = t.prepare_eviction(rec("k3", 1000), cap);
    assert_eq!(p.keys().collect::<Vec<_>>(), vec!["k1"]);
    assert_eq!(
        t.get("k1").unwrap(),
        None,
        "no new get finds an object being evicted"
    );
    t.cancel_eviction(p);
    assert_eq!(t.get("k1").unwrap().unwrap(), value("k1", 1, 1000));

    // Now k2 is the oldest; this time the master was told and the file goes.
    let p = t.prepare_eviction(rec("k3", 1000), cap);
    assert_eq!(p.keys().collect::<Vec<_>>(), vec!["k2"]);
    t.finalize_eviction(p).unwrap();
    assert!(!object_path(d.path(), "k2").exists());
    t.put("k3", &value("k3", 1, 1000)).unwrap();
    assert_eq!(t.usage(), (cap, cap));

    // A put of an evicted key between the phases keeps its new record.
    let p = t.prepare_eviction(rec("k4", 1000), cap);
    let gone: Vec<String> = p.keys().map(String::from).collect();
    assert_eq!(gone.len(), 1);
    t.put(&gone[0], &value(&gone[0], 2, 1000)).unwrap();
    t.finalize_eviction(p).unwrap();
    assert_eq!(t.get(&gone[0]).unwrap().unwrap(), value(&gone[0], 2, 1000));
}

#[test]
fn concurrent_puts_gets_removes_and_evictions_only_ever_serve_a_value_put_for_that_key() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = open(d.path(), 40 * 3000);
    let t = Arc::new(t);
    let threads: Vec<_> = (0..4u32)
        .map(|id| {
            let t = t.clone();
            std::thread::spawn(move || {
                let mut x = 0x9e37_79b9u32.wrapping_mul(id + 1);
                for i in 0..400u32 {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    let key = format!("k{}", x % 8);
                    match x % 5 {
                        0 | 1 => match t.put(&key, &value(&key, i, 500 + (x % 2000) as usize)) {
                            Ok(()) | Err(DiskError::Full { .. }) => {}
                            Err(e) => panic!("{e}"),
                        },
                        2 => {
                            t.remove(&key).unwrap();
                        }
                        3 => {
                            let p = t.prepare_eviction(3000, 30 * 3000);
                            if x % 2 == 0 {
                                t.finalize_eviction(p).unwrap();
                            } else {
                                t.cancel_eviction(p);
                            }
                        }
                        _ => {
                            if let Some(v) = t.get(&key).unwrap() {
                                let prefix = format!("{key}/");
                                assert!(
                                    v.starts_with(prefix.as_bytes()),
                                    "{key} served another key's bytes"
                                );
                                let version: u32 = std::str::from_utf8(&v[prefix.len()..])
                                    .unwrap_or("")
                                    .split('/')
                                    .next()
                                    .and_then(|s| s.parse().ok())
                                    .unwrap_or(u32::MAX);
                                assert_eq!(
                                    v,
                                    value(&key, version, v.len()),
                                    "{key}: torn or mixed bytes"
                                );
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
    // What the index says matches what is on disk, and a reopen agrees.
    let held: Vec<(String, u64)> = (0..8)
        .filter_map(|k| {
            let key = format!("k{k}");
            t.len_of(&key).map(|n| (key, n))
        })
        .collect();
    let used = t.usage().0;
    drop(t);
    let (t, rec) = open(d.path(), 40 * 3000);
    assert_eq!(rec.objects, held);
    assert_eq!(rec.dropped, 0);
    assert_eq!(t.usage().0, used);
}
