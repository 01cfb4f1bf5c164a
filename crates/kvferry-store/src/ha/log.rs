//! The HA leader's journal as it lies in etcd: its keys, how its values are encoded, and
//! reading it back. Pure codec plus the few etcd reads of a takeover (over [`Read`], so the
//! simulator reads its model of etcd with the same code); the keys and what is written when
//! are the writer's machine's ([`crate::repl::JournalWriter`]), carried out by
//! [`super::journal::Writer`].
//!
//! Keys under `mooncake-store/<cluster_id>/journal/`:
//! - `log/<seq, 16 hex digits>`: postcard-encoded `Vec<Change>` (at most [`CHUNK`] bytes,
//!   LZ4-compressed behind a magic when that makes it smaller: see [`encode_chunks`]; a
//!   rebase from the [`crate::repl::Tail`] puts consecutive entries in one value behind `RANGE_MAGIC`,
//!   which names the last, under the first one's key),
//!   written in order by one writer thread, each in a transaction guarded by the leader's view
//!   key still being the one it created (its term): a deposed leader cannot append.
//! - `snap/<seq>/<i>`: a snapshot, the whole state after `log/<seq>` in chunks; `head` names
//!   the current one ([`Head`]). Written when the log since the last snapshot outgrows the
//!   snapshot (at least [`super::journal::SNAPSHOT_MIN`] bytes): the log up to `seq` and the older snapshot are
//!   deleted in the same guarded transaction, and etcd's history compacted, so etcd holds at
//!   most about two snapshots plus their size of log (a new term counts the log its
//!   predecessors left: `crate::sim`'s etcd bound checks it).
//! - `term`: the term of the last leader that loaded the journal (see [`load`]).
//!

use super::sync::ToStandby;
use crate::error::StoreError;
use crate::master::changes::{Change, Image};
use crate::repl::TailFrame;
use kvferry::metadata::etcd::{EtcdClient, Owner};

/// Largest encoded value written to one key (etcd refuses requests over 1.5 MiB by default;
/// base64 in the JSON gateway adds a third).
pub const CHUNK: usize = 512 << 10;

pub use crate::repl::writer::{log_key, prefix_end, snap_dir, Head};

pub fn prefix(cluster_id: &str) -> String {
    let id = cluster_id.strip_suffix('/').unwrap_or(cluster_id);
    format!("mooncake-store/{id}/journal/")
}

/// A stored value that starts with this is an LZ4 block of the postcard encoding (its size,
/// u32 little-endian, after the magic); any other value is the bare postcard encoding (what
/// builds before compression wrote, and what is kept when compressing does not pay). A bare
/// `Vec<Change>` cannot start with it: its second byte would be a `Change` variant number
/// beyond the few there are.
const LZ4_MAGIC: &[u8; 4] = b"KVFz";
/// A log value that holds several entries starts with this, then the last entry's number (8
/// bytes, little-endian), then the stored value of their changes; its key names the first.
/// Written only by a rebase from the [`crate::repl::Tail`] (thousands of small entries in a few values);
/// every other value holds the one entry its key names. It cannot start a bare value either,
/// for the same reason as [`LZ4_MAGIC`]. Builds before it refuse such a journal (an entry
/// that does not decode): the masters of a cluster are upgraded together.
const RANGE_MAGIC: &[u8; 4] = b"KVFn";

/// The last entry a log value under `first`'s key holds, and the stored value of its changes.
pub(super) fn log_range(first: u64, v: &[u8]) -> Result<(u64, &[u8]), String> {
    let Some(rest) = v.strip_prefix(RANGE_MAGIC) else {
        return Ok((first, v));
    };
    let (last, rest) = rest
        .split_first_chunk::<8>()
        .ok_or("a journal entry's range is cut short")?;
    let last = u64::from_le_bytes(*last);
    if last < first {
        return Err(format!(
            "a journal entry under number {first} claims to end at {last}: it is corrupt"
        ));
    }
    Ok((last, rest))
}

/// The largest decoded size a compressed value may claim (a raw chunk is at most [`CHUNK`],
/// one change larger than that gets a value of its own): a corrupt size is refused, never
/// allocated.
const MAX_DECODED: usize = 64 << 20;

/// A value as stored: compressed when that makes it smaller. etcd spends ~50 ns of CPU per
/// byte of a transaction on this project's VM (`docs/BENCHMARKS.md`), so every byte saved here
/// is etcd CPU saved, in the log as in snapshots.
fn pack(raw: Vec<u8>) -> Vec<u8> {
    let compressed = lz4_flex::block::compress(&raw);
    if compressed.len() + LZ4_MAGIC.len() + 4 >= raw.len() {
        return raw;
    }
    let mut v = Vec::with_capacity(LZ4_MAGIC.len() + 4 + compressed.len());
    v.extend_from_slice(LZ4_MAGIC);
    v.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    v.extend_from_slice(&compressed);
    v
}

/// The postcard bytes of a stored value.
fn unpack(v: &[u8]) -> Result<std::borrow::Cow<'_, [u8]>, String> {
    let Some(rest) = v.strip_prefix(LZ4_MAGIC) else {
        return Ok(std::borrow::Cow::Borrowed(v));
    };
    let (size, block) = rest
        .split_first_chunk::<4>()
        .ok_or("a compressed journal entry is cut short")?;
    let size = u32::from_le_bytes(*size) as usize;
    if size > MAX_DECODED {
        return Err(format!(
            "a compressed journal entry claims {size} bytes (at most {MAX_DECODED}): it is corrupt"
        ));
    }
    let raw = lz4_flex::block::decompress(block, size).map_err(|e| {
        format!("a compressed journal entry does not decompress ({e}): it is corrupt")
    })?;
    if raw.len() != size {
        return Err(format!("a compressed journal entry decompresses to {} bytes, not the {size} it claims: it is corrupt", raw.len()));
    }
    Ok(std::borrow::Cow::Owned(raw))
}

/// Encodes `changes` into values of at most [`CHUNK`] bytes (one change larger than that gets
/// a value of its own), each compressed when that pays.
pub fn encode_chunks(changes: &[Change]) -> Result<Vec<Vec<u8>>, StoreError> {
    encode_chunks_of(changes, CHUNK)
}

/// [`encode_chunks`] into values of at most `chunk` bytes (the simulator's are small, so
/// that its snapshots take several).
pub fn encode_chunks_of(changes: &[Change], chunk: usize) -> Result<Vec<Vec<u8>>, StoreError> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut size = 0usize;
    for (i, c) in changes.iter().enumerate() {
        let n = postcard::experimental::serialized_size(c)
            .map_err(|e| StoreError::Internal(format!("journal: encoding a change: {e}")))?;
        // (`CHUNK - 16`: room for the vector's length prefix.)
        if i > start && size + n > chunk.saturating_sub(16) {
            out.push(pack(postcard::to_stdvec(&changes[start..i]).map_err(
                |e| StoreError::Internal(format!("journal: encoding: {e}")),
            )?));
            start = i;
            size = 0;
        }
        size += n;
    }
    if start < changes.len() {
        out.push(pack(postcard::to_stdvec(&changes[start..]).map_err(
            |e| StoreError::Internal(format!("journal: encoding: {e}")),
        )?));
    }
    Ok(out)
}

/// The changes of one stored value (compressed or bare).
pub fn decode_chunk(v: &[u8]) -> Result<Vec<Change>, String> {
    postcard::from_bytes(&unpack(v)?).map_err(|e| {
        format!("a journal entry is not readable ({e}); was it written by another kvferry version?")
    })
}

/// What reading the journal needs of etcd: the real client, or the simulator's model.
pub trait Read {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, String>;
    /// The keys in `from..to` with their values, in order (read `page` at a time).
    fn range(&self, from: &str, to: &str, page: usize) -> Result<Vec<(String, Vec<u8>)>, String>;
}

impl Read for EtcdClient {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
        Ok(self
            .get_kv(key)
            .map_err(|e| e.to_string())?
            .map(|kv| kv.value))
    }

    fn range(&self, from: &str, to: &str, page: usize) -> Result<Vec<(String, Vec<u8>)>, String> {
        Ok(EtcdClient::range(self, from, to, page)
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|(k, kv)| (k, kv.value))
            .collect())
    }
}

/// What [`load`] found.
pub struct Loaded {
    pub image: Image,
    /// The last log entry's sequence number (the next entry gets the one after).
    pub seq: u64,
    /// The leader that last loaded the journal (its view key's creation), if any.
    pub last_leader: Option<Owner>,
    pub head: Option<Head>,
    pub log_entries: usize,
    /// Bytes read: the snapshot's and the log's.
    pub bytes: u64,
    /// Bytes of log after the snapshot.
    pub log_bytes: u64,
}

/// Reads the journal: the snapshot `head` names, then every log entry after it, in order.
pub fn load(etcd: &EtcdClient, cluster_id: &str) -> Result<Loaded, String> {
    let mut loaded = load_from(etcd, &prefix(cluster_id))?;
    loaded.last_leader = last_leader(etcd, cluster_id)?;
    Ok(loaded)
}

/// [`load`] from what `etcd` holds under the journal's prefix `p` (the last leader not read).
pub fn load_from(etcd: &impl Read, p: &str) -> Result<Loaded, String> {
    // What is stored cannot be read (no leader can start from it): what the operator can do.
    let corrupt = |e: String| {
        format!("{e}; no master can lead from this journal: restore etcd's data from a backup, or delete the keys under {p} to start this cluster empty (every object it held is then lost)")
    };
    let mut image = Image::default();
    let mut bytes = 0u64;
    let head = match etcd.get(&format!("{p}head"))? {
        Some(v) => Some(
            postcard::from_bytes::<Head>(&v)
                .map_err(|e| corrupt(format!("the journal head is not readable ({e})")))?,
        ),
        None => None,
    };
    let after = head.map_or(0, |h| h.seq);
    if let Some(h) = head {
        let dir = snap_dir(p, h.seq);
        let chunks = etcd.range(&dir, &prefix_end(&dir), 64)?;
        if chunks.len() != h.chunks as usize {
            return Err(corrupt(format!(
                "the journal snapshot {dir} has {} of its {} chunks: etcd lost part of it",
                chunks.len(),
                h.chunks
            )));
        }
        for (_, v) in chunks {
            bytes += v.len() as u64;
            for c in decode_chunk(&v).map_err(corrupt)? {
                image.apply(c);
            }
        }
    }
    let first = after.checked_add(1).ok_or_else(|| {
        corrupt(format!(
            "the journal's head names entry {after}, the last there can be"
        ))
    })?;
    let logs = etcd.range(&log_key(p, first), &prefix_end(&format!("{p}log/")), 256)?;
    let mut seq = after;
    let log_entries = logs.len();
    let mut log_bytes = 0u64;
    for (key, v) in logs {
        let n = key
            .rsplit('/')
            .next()
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .ok_or_else(|| corrupt(format!("unexpected journal key {key}")))?;
        if Some(n) != seq.checked_add(1) {
            return Err(corrupt(format!(
                "the journal skips from entry {seq} to {n}: etcd lost part of it"
            )));
        }
        let (last, value) = log_range(n, &v).map_err(corrupt)?;
        seq = last;
        log_bytes += v.len() as u64;
        for c in decode_chunk(value).map_err(corrupt)? {
            image.apply(c);
        }
    }
    Ok(Loaded {
        image,
        seq,
        last_leader: None,
        head,
        log_entries,
        bytes: bytes + log_bytes,
        log_bytes,
    })
}

/// The leader that last loaded the journal (its `term` marker), if any.
pub fn last_leader(etcd: &EtcdClient, cluster_id: &str) -> Result<Option<Owner>, String> {
    Ok(
        match etcd
            .get_kv(&format!("{}term", prefix(cluster_id)))
            .map_err(|e| e.to_string())?
        {
            Some(kv) => parse_term_marker(&String::from_utf8_lossy(&kv.value)),
            None => None,
        },
    )
}

/// Where the etcd journal ends, without decoding its entries ([`stored_seq`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    /// The largest entry number stored (head or log).
    pub seq: u64,
    pub head: Option<Head>,
    /// Bytes of log after the head's snapshot.
    pub log_bytes: u64,
}

/// The journal's head and the largest entry number stored (head or log), without decoding
/// the entries: where a leader that does not load the journal (it starts from a standby's
/// mirror, or empty) continues the numbering.
pub fn stored_seq(etcd: &EtcdClient, cluster_id: &str) -> Result<Stored, String> {
    stored_from(etcd, &prefix(cluster_id))
}

/// [`stored_seq`] from what `etcd` holds under the journal's prefix `p`.
pub fn stored_from(etcd: &impl Read, p: &str) -> Result<Stored, String> {
    let head = match etcd.get(&format!("{p}head"))? {
        Some(v) => postcard::from_bytes::<Head>(&v).ok(),
        None => None,
    };
    let after = head.map_or(0, |h| h.seq);
    let mut seq = after;
    let mut log_bytes = 0;
    let log = format!("{p}log/");
    for (key, v) in etcd.range(&log, &prefix_end(&log), 256)? {
        if let Some(n) = key
            .rsplit('/')
            .next()
            .and_then(|h| u64::from_str_radix(h, 16).ok())
        {
            seq = seq.max(log_range(n, &v).map_or(n, |(last, _)| last));
            if n > after {
                log_bytes += v.len() as u64;
            }
        }
    }
    Ok(Stored {
        seq,
        head,
        log_bytes,
    })
}

/// The changes of a streamed entry (`super::journal::entry_frame`'s `frame`, entry `seq`) as postcard
/// elements, and how many: the frame's body is the entry's postcard encoding, whose end is
/// exactly its `Vec<Change>` (a length, then the elements), taken as it is, not decoded and
/// encoded again. `None` if the frame is not entry `seq`.
fn entry_changes(seq: u64, frame: &[u8]) -> Option<(usize, &[u8])> {
    let head = postcard::to_stdvec(&ToStandby::Entry {
        seq,
        changes: Vec::new(),
    })
    .ok()?;
    // (`head` ends with the empty vector's length, one byte.)
    let prefix = &head[..head.len() - 1];
    let changes = frame.get(4..)?.strip_prefix(prefix)?;
    postcard::take_from_bytes::<usize>(changes).ok()
}

/// The largest log value a rebase from the tail writes (one entry of `super::journal::ENTRY_PIECE` large
/// changes may be over [`CHUNK`]; etcd takes requests of 1.5 MiB, base64 included).
pub(super) const REBASE_VALUE_MAX: usize = 1 << 20;

/// The log values (key, value) of the entries `frames`, in order, one after the other: each
/// the streamed frame of entry `last` holding the changes of the log's entries `first..=last`
/// (a leader streams the entries it appended to etcd in several values as one; the leader's
/// own [`crate::repl::Tail`] holds one entry per frame). Consecutive entries share a value while their changes fit [`CHUNK`]
/// ([`RANGE_MAGIC`] when it holds more than one log entry). `None` if a frame is not its
/// entry, the frames are not consecutive, or one entry alone is over [`REBASE_VALUE_MAX`]
/// stored.
pub(crate) fn tail_log_values(
    prefix: &str,
    frames: &[TailFrame],
) -> Option<Vec<(String, Vec<u8>)>> {
    struct Group {
        first: u64,
        last: u64,
        count: usize,
        elems: Vec<u8>,
    }
    let finish = |g: Group| -> Option<(String, Vec<u8>)> {
        let mut raw = postcard::to_stdvec(&g.count).ok()?;
        raw.extend_from_slice(&g.elems);
        let packed = pack(raw);
        let value = if g.last == g.first {
            packed
        } else {
            let mut v = Vec::with_capacity(RANGE_MAGIC.len() + 8 + packed.len());
            v.extend_from_slice(RANGE_MAGIC);
            v.extend_from_slice(&g.last.to_le_bytes());
            v.extend_from_slice(&packed);
            v
        };
        (value.len() <= REBASE_VALUE_MAX).then(|| (log_key(prefix, g.first), value))
    };
    let mut out = Vec::new();
    let mut group: Option<Group> = None;
    for &TailFrame {
        first,
        last,
        ref frame,
    } in frames
    {
        let (n, elems) = entry_changes(last, frame)?;
        if first > last
            || group
                .as_ref()
                .is_some_and(|g| g.last.checked_add(1) != Some(first))
        {
            return None;
        }
        if group
            .as_ref()
            .is_some_and(|g| g.elems.len() + elems.len() > CHUNK - 16)
        {
            out.push(finish(group.take()?)?);
        }
        let g = group.get_or_insert(Group {
            first,
            last,
            count: 0,
            elems: Vec::new(),
        });
        g.last = last;
        g.count += n;
        g.elems.extend_from_slice(elems);
    }
    if let Some(g) = group {
        out.push(finish(g)?);
    }
    Some(out)
}

/// Writes the `term` marker, `"<term> <lease>"`: this leader (`owner`, its view key's
/// creation) loaded the journal. Whether the key was still `owner`'s.
pub fn mark_term(
    etcd: &EtcdClient,
    view_key: &str,
    cluster_id: &str,
    owner: Owner,
) -> Result<bool, String> {
    let marker = format!("{} {}", owner.create_revision, owner.lease);
    etcd.txn_if_owned(
        view_key,
        owner,
        &[(format!("{}term", prefix(cluster_id)), marker.into_bytes())],
        None,
    )
    .map(|r| r.is_some())
    .map_err(|e| e.to_string())
}

/// The leader a `term` marker names; `None` for anything else (an older build wrote the term
/// alone, which no longer names one leader: the new leader then waits out a fence bound).
pub(super) fn parse_term_marker(s: &str) -> Option<Owner> {
    let (term, lease) = s.trim().split_once(' ')?;
    Some(Owner {
        create_revision: term.parse().ok()?,
        lease: lease.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master::changes::ObjectRec;

    fn obj(i: usize) -> Change {
        Change::Object {
            key: format!("key-{i:06}"),
            rec: ObjectRec {
                size: 4096,
                current: smallvec::smallvec![(1, 4096 * i as u64, 4096)],
                pending: None,
                owner: 7,
                hard_pin: false,
                soft_pin_left: 0,
                group: None,
            },
        }
    }

    #[test]
    fn chunks_stay_under_the_limit_and_decode_to_the_same_changes_in_order() {
        let changes: Vec<Change> = (0..40_000).map(obj).collect();
        let chunks = encode_chunks(&changes).expect("encode");
        assert!(chunks.len() > 1, "40k changes do not fit one value");
        assert!(chunks.iter().all(|c| c.len() <= CHUNK));
        assert!(
            chunks.iter().all(|c| c.starts_with(LZ4_MAGIC)),
            "similar changes compress"
        );
        let back: Vec<Change> = chunks
            .iter()
            .flat_map(|c| decode_chunk(c).expect("decode"))
            .collect();
        assert_eq!(back, changes);
        assert!(encode_chunks(&[]).expect("empty").is_empty());
        assert!(decode_chunk(b"\xff\xff garbage").is_err());
    }
    /// Values written before compression (bare postcard) still load; a value compression does
    /// not shrink is kept bare; a bare `Vec<Change>` never looks compressed.
    #[test]
    fn bare_values_still_decode_and_incompressible_ones_stay_bare() {
        let changes: Vec<Change> = (0..500).map(obj).collect();
        let bare = postcard::to_stdvec(&changes).expect("encode");
        assert_eq!(
            decode_chunk(&bare).expect("an older build's entry"),
            changes
        );
        let packed = encode_chunks(&changes).expect("encode");
        assert_eq!(packed.len(), 1);
        assert!(
            packed[0].len() * 3 < bare.len(),
            "{} bytes compressed from {}",
            packed[0].len(),
            bare.len()
        );
        let one = vec![Change::Forget { key: "k".into() }];
        assert_eq!(
            encode_chunks(&one).expect("encode"),
            vec![postcard::to_stdvec(&one).expect("encode")],
            "too small to pay: kept bare"
        );
        // A bare encoding's first bytes: its length, then the first change's variant (< 6).
        let many: Vec<Change> = (0..(LZ4_MAGIC[0] as usize)).map(obj).collect();
        let b = postcard::to_stdvec(&many).expect("encode");
        assert_eq!(b[0], LZ4_MAGIC[0]);
        assert_ne!(b[1], LZ4_MAGIC[1]);
        assert_eq!(decode_chunk(&b).expect("decode"), many);
    }
    /// A corrupt compressed value is an error naming the corruption, never a panic or a huge
    /// allocation.
    #[test]
    fn corrupt_compressed_values_are_refused() {
        let good = encode_chunks(&(0..500).map(obj).collect::<Vec<_>>())
            .expect("encode")
            .remove(0);
        let mut huge = good.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_chunk(&huge).is_err_and(|e| e.contains("claims")));
        assert!(decode_chunk(&good[..6]).is_err_and(|e| e.contains("cut short")));
        let mut flipped = good.clone();
        let n = flipped.len();
        flipped[n / 2] ^= 0x55;
        flipped.truncate(n - 3);
        assert!(decode_chunk(&flipped).is_err());
    }
    proptest::proptest! {
        #[test]
        fn decoding_any_value_never_panics(tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512), claimed in 0u32..(1 << 20)) {
            let _ = decode_chunk(&tail);
            if let Ok((_, v)) = log_range(1, &tail) {
                let _ = decode_chunk(v);
            }
            let mut v = LZ4_MAGIC.to_vec();
            v.extend_from_slice(&claimed.to_le_bytes());
            v.extend_from_slice(&tail);
            let _ = decode_chunk(&v);
        }
    }
    #[test]
    fn keys_sort_in_sequence_order() {
        let p = prefix("c/");
        assert_eq!(p, "mooncake-store/c/journal/");
        assert!(log_key(&p, 9) < log_key(&p, 10) && log_key(&p, 0xff) < log_key(&p, 0x100));
        assert!(log_key(&p, u64::MAX) < prefix_end(&format!("{p}log/")));
        assert!(snap_dir(&p, 1) < prefix_end(&snap_dir(&p, 1)));
    }
}
