//! The disk tier's on-disk record, pure: no I/O, no clock.
//!
//! One file per object, `objects/<aa>/<bb>/<32 hex digits>.kv`, named by the 128-bit xxh3 of
//! its key. A file is a [`HEADER_LEN`]-byte header, the key, then the value:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | [`MAGIC`] (`KVFDISK1`) |
//! | 4 | key length, little-endian |
//! | 4 | zero |
//! | 8 | value length, little-endian |
//! | 8 | xxh3-64 of key and value |
//!
//! A file is valid only if its length is exactly header + key + value; its value is served only
//! if the checksum matches (checked on every read).

use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

pub(crate) const MAGIC: &[u8; 8] = b"KVFDISK1";
pub(crate) const HEADER_LEN: usize = 32;
/// The longest key stored (Mooncake's keys are far shorter); a longer one is refused.
pub(crate) const MAX_KEY: usize = 64 << 10;

/// A record's header, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) key_len: u32,
    pub(crate) value_len: u64,
    pub(crate) checksum: u64,
}

/// Why bytes are not a record's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BadHeader {
    Short,
    Magic,
    KeyTooLong(u64),
    Reserved,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&self.key_len.to_le_bytes());
        h[16..24].copy_from_slice(&self.value_len.to_le_bytes());
        h[24..32].copy_from_slice(&self.checksum.to_le_bytes());
        h
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Header, BadHeader> {
        if b.len() < HEADER_LEN {
            return Err(BadHeader::Short);
        }
        if &b[..8] != MAGIC {
            return Err(BadHeader::Magic);
        }
        let word = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 8];
            a[..r.len()].copy_from_slice(&b[r]);
            u64::from_le_bytes(a)
        };
        let key_len = word(8..12);
        if key_len as usize > MAX_KEY {
            return Err(BadHeader::KeyTooLong(key_len));
        }
        if word(12..16) != 0 {
            return Err(BadHeader::Reserved);
        }
        Ok(Header {
            key_len: key_len as u32,
            value_len: word(16..24),
            checksum: word(24..32),
        })
    }

    /// The file length a whole record with this header has; `None` if it overflows.
    pub(crate) fn file_len(&self) -> Option<u64> {
        (HEADER_LEN as u64)
            .checked_add(self.key_len as u64)?
            .checked_add(self.value_len)
    }
}

/// The checksum of a record: key, then value.
pub(crate) fn checksum(key: &[u8], value: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&(key.len() as u64).to_le_bytes());
    h.update(key);
    h.update(value);
    h.digest()
}

/// Where a key's record lives under `root`: two levels of 256 directories.
pub(crate) fn object_path(root: &Path, key: &str) -> PathBuf {
    let h = format!("{:032x}", xxh3_128(key.as_bytes()));
    root.join("objects")
        .join(&h[..2])
        .join(&h[2..4])
        .join(format!("{h}.kv"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_round_trips_and_garbage_is_refused_by_name() {
        let h = Header {
            key_len: 7,
            value_len: 1 << 40,
            checksum: 0xdead_beef_0123_4567,
        };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        assert_eq!(h.file_len(), Some(32 + 7 + (1 << 40)));
        assert_eq!(Header::decode(&h.encode()[..31]), Err(BadHeader::Short));
        let mut bad = h.encode();
        bad[0] ^= 1;
        assert_eq!(Header::decode(&bad), Err(BadHeader::Magic));
        let mut bad = h.encode();
        bad[12] = 1;
        assert_eq!(Header::decode(&bad), Err(BadHeader::Reserved));
        let mut bad = h.encode();
        bad[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Header::decode(&bad),
            Err(BadHeader::KeyTooLong(_))
        ));
        let huge = Header {
            key_len: 1,
            value_len: u64::MAX,
            checksum: 0,
        };
        assert_eq!(huge.file_len(), None);
    }

    #[test]
    fn the_checksum_covers_where_key_ends_and_value_begins() {
        assert_ne!(checksum(b"ab", b"c"), checksum(b"a", b"bc"));
        assert_ne!(checksum(b"k", b"v1"), checksum(b"k", b"v2"));
    }

    #[test]
    fn paths_spread_over_two_levels_and_differ_per_key() {
        let root = Path::new("/r");
        let a = object_path(root, "a");
        let b = object_path(root, "b");
        assert_ne!(a, b);
        assert!(a.starts_with("/r/objects"));
        assert_eq!(a.components().count(), 6, "{a:?}");
        assert_eq!(a.extension().unwrap(), "kv");
    }
}
