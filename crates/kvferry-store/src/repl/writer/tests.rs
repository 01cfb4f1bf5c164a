//! The etcd journal's writer machine alone: keys, the snapshot rule, what a snapshot writes
//! and deletes, retries.

use super::*;

const P: &str = "j/";

fn w(seq: u64, head: Option<Head>, log_bytes: u64) -> JournalWriter {
    JournalWriter::new(P.to_string(), seq, head, log_bytes, 100)
}

#[test]
fn entries_are_appended_in_order_under_their_number() {
    let mut m = w(7, None, 0);
    let t = m.append(vec![1; 10]);
    assert_eq!(t.puts, vec![(log_key(P, 8), vec![1; 10])]);
    assert_eq!(t.delete, None);
    m.appended(10);
    assert_eq!((m.seq(), m.log_bytes()), (8, 10));
    assert_eq!(m.append(vec![2]).puts[0].0, "j/log/0000000000000009");
}

/// Due once the log outgrows both the threshold and the current snapshot; never while
/// standbys are in sync; and a new term counts the log its predecessors left.
#[test]
fn a_snapshot_is_due_when_the_log_outgrows_the_threshold_and_the_snapshot() {
    let mut m = w(0, None, 0);
    m.appended(100);
    assert!(!m.snapshot_due(false), "at the threshold");
    m.appended(1);
    assert!(m.snapshot_due(false));
    assert!(!m.snapshot_due(true), "streaming: etcd is not written");
    let head = Head {
        seq: 5,
        chunks: 2,
        bytes: 500,
    };
    let mut m = w(9, Some(head), 400);
    assert!(
        !m.snapshot_due(false),
        "the log is smaller than the snapshot"
    );
    m.appended(101);
    assert!(m.snapshot_due(false), "the inherited log counts");
}

#[test]
fn a_snapshot_writes_chunks_then_a_head_that_deletes_the_log_then_the_old_snapshot() {
    let old = Head {
        seq: 3,
        chunks: 1,
        bytes: 50,
    };
    let mut m = w(12, Some(old), 300);
    let clear = m.begin_snapshot(12).expect("a new position");
    assert_eq!(
        clear.delete,
        Some((snap_dir(P, 12), prefix_end(&snap_dir(P, 12))))
    );
    for i in 0..2u8 {
        let t = m.chunk(vec![i; 40]).expect("writing");
        assert_eq!(t.puts[0].0, format!("{}{:08x}", snap_dir(P, 12), i));
        m.chunk_written(40);
    }
    // (An entry committed between the chunks stays after the head.)
    m.appended(30);
    let head = m.head_txn(Some(("x".into(), vec![9]))).expect("head");
    assert_eq!(head.puts[0].0, "j/head");
    assert_eq!(
        postcard::from_bytes::<Head>(&head.puts[0].1).expect("decodes"),
        Head {
            seq: 12,
            chunks: 2,
            bytes: 80
        }
    );
    assert_eq!(head.puts[1], ("x".into(), vec![9]));
    assert_eq!(
        head.delete,
        Some(("j/log/".to_string(), log_key(P, 13))),
        "the log up to the snapshot's position"
    );
    let after = m.head_written(77).expect("written");
    assert_eq!(after.compact, 77);
    assert_eq!(
        after.delete_old,
        Some(Txn::delete(snap_dir(P, 3), prefix_end(&snap_dir(P, 3))))
    );
    assert_eq!((m.log_bytes(), m.snapshot_bytes()), (30, 80));
    assert_eq!(m.head().map(|h| h.seq), Some(12));
}

/// A snapshot at the head's own position would delete the live snapshot's chunks before
/// writing them again: refused.
#[test]
fn no_snapshot_is_begun_at_the_heads_own_position() {
    let head = Head {
        seq: 4,
        chunks: 1,
        bytes: 10,
    };
    let mut m = w(4, Some(head), 0);
    assert_eq!(m.begin_snapshot(4), None);
    assert_eq!(m.chunk(vec![1]), None, "nothing is being written");
    assert_eq!(m.head_txn(None), None);
}

#[test]
fn garbage_is_every_snapshot_but_the_heads() {
    let m = w(0, None, 0);
    assert_eq!(
        m.garbage(),
        vec![Txn::delete("j/snap/".into(), "j/snap0".into())]
    );
    let head = Head {
        seq: 2,
        chunks: 1,
        bytes: 1,
    };
    let g = w(2, Some(head), 0).garbage();
    let keep = snap_dir(P, 2);
    assert_eq!(
        g,
        vec![
            Txn::delete("j/snap/".into(), keep.clone()),
            Txn::delete(prefix_end(&keep), "j/snap0".into())
        ]
    );
}

#[test]
fn a_failed_transaction_is_retried_while_the_lease_can_be_proven_or_within_the_takeovers_bound() {
    let mut m = w(0, None, 0);
    assert_eq!(m.on_answer(Answer::Written(5), 0, false), Next::Done(5));
    assert_eq!(m.on_answer(Answer::NotOwner, 0, true), Next::GiveUp);
    assert_eq!(m.on_answer(Answer::Failed, 0, true), Next::Retry);
    assert_eq!(m.on_answer(Answer::Failed, 0, false), Next::GiveUp);
    m.retry_until(Some(1_000));
    assert_eq!(m.on_answer(Answer::Failed, 999, false), Next::Retry);
    assert_eq!(m.on_answer(Answer::Failed, 1_000, false), Next::GiveUp);
}

#[test]
fn a_rebase_batches_values_under_etcds_limits() {
    let values: Vec<(String, Vec<u8>)> = (0..200u64)
        .map(|i| (log_key(P, i + 1), vec![0; 10]))
        .collect();
    let txns = JournalWriter::rebase_txns(values);
    assert_eq!(
        txns.iter().map(|t| t.puts.len()).collect::<Vec<_>>(),
        vec![64, 64, 64, 8]
    );
    let big: Vec<(String, Vec<u8>)> = (0..3u64)
        .map(|i| (log_key(P, i + 1), vec![0; REBASE_TXN_BYTES / 2 + 1]))
        .collect();
    assert_eq!(JournalWriter::rebase_txns(big).len(), 3);
    let mut m = w(10, None, 5);
    m.set_seq(13);
    m.rebased(20);
    assert_eq!((m.seq(), m.log_bytes()), (13, 25));
}
