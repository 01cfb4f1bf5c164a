//! The store's one frame codec, sans-IO (no sockets, no clock, no threads): what a plain frame
//! is on the wire, for the master's RPC ([`crate::proto`]) and the HA replication link
//! ([`crate::ha::sync`]).
//!
//! A frame is the body's length as a `u32` little-endian ([`PREFIX_LEN`] bytes), then the body:
//! the postcard encoding of one message. Each user passes its own limit on a body's length and
//! turns this module's errors into its own (its own words on cause and fix). A prefix over the
//! limit is refused from its 4 bytes alone, before anything more is read or allocated.
//!
//! Under the cluster key a connection seals a frame's [`body`] instead
//! (`kvferry::auth::Sealer::seal_frame`: the sealed length, then the sealed body; no plain
//! prefix), so that what a sealed connection carries is this module's frame without its first
//! [`PREFIX_LEN`] bytes.

use serde::{Deserialize, Serialize};

/// The length prefix's size: a `u32`, little-endian.
pub const PREFIX_LEN: usize = 4;

/// A body's length over the limit it was checked against (the limit is at most `u32::MAX`, what
/// a prefix can say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge {
    pub len: usize,
    pub max: usize,
}

impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "a frame of {} bytes is over the limit of {}",
            self.len, self.max
        )
    }
}

impl std::error::Error for TooLarge {}

/// Why [`encode`] made no frame.
#[derive(Debug)]
pub enum EncodeError {
    /// The message does not encode (postcard's reason).
    Encode(postcard::Error),
    /// It encodes into a body over the limit.
    TooLarge(TooLarge),
}

impl std::fmt::Display for EncodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            EncodeError::Encode(e) => write!(f, "encoding a frame: {e}"),
            EncodeError::TooLarge(t) => t.fmt(f),
        }
    }
}

impl std::error::Error for EncodeError {}

/// The prefix of a body of `len` bytes, if that is at most `max` (and `u32::MAX`).
pub fn prefix(len: usize, max: usize) -> Result<[u8; PREFIX_LEN], TooLarge> {
    let max = max.min(u32::MAX as usize);
    match u32::try_from(len) {
        Ok(n) if len <= max => Ok(n.to_le_bytes()),
        _ => Err(TooLarge { len, max }),
    }
}

/// Encodes `msg` as one frame whose body is at most `max` bytes: the prefix, then the body, in
/// one buffer.
pub fn encode<T: Serialize + ?Sized>(msg: &T, max: usize) -> Result<Vec<u8>, EncodeError> {
    let mut v = postcard::to_extend(msg, vec![0u8; PREFIX_LEN]).map_err(EncodeError::Encode)?;
    let head = prefix(v.len().saturating_sub(PREFIX_LEN), max).map_err(EncodeError::TooLarge)?;
    if let Some(at) = v.first_chunk_mut::<PREFIX_LEN>() {
        *at = head;
    }
    Ok(v)
}

/// The body of a frame [`encode`] made: what a sealed connection seals in its place (empty if
/// `frame` is shorter than a prefix).
pub fn body(frame: &[u8]) -> &[u8] {
    frame.get(PREFIX_LEN..).unwrap_or_default()
}

/// The body length a prefix claims, if it is at most `max`: checked before the body is read or
/// any room made for it.
pub fn body_len(prefix: [u8; PREFIX_LEN], max: usize) -> Result<usize, TooLarge> {
    let len = u32::from_le_bytes(prefix) as usize;
    let max = max.min(u32::MAX as usize);
    if len > max {
        return Err(TooLarge { len, max });
    }
    Ok(len)
}

/// The body length the frame at the start of `buf` claims, unchecked (`None` before its
/// prefix is whole).
pub fn claimed_len(buf: &[u8]) -> Option<usize> {
    buf.first_chunk::<PREFIX_LEN>()
        .map(|p| u32::from_le_bytes(*p) as usize)
}

/// Whether `buf` starts with a whole frame, as far as its prefix says (partial input waits for
/// the rest; the limit is checked where the frame is taken: [`split`], [`body_len`]).
pub fn whole(buf: &[u8]) -> bool {
    claimed_len(buf).is_some_and(|n| buf.len() - PREFIX_LEN >= n)
}

/// The first frame in `buf`: its body and the bytes the whole frame takes (the next frame
/// starts there); `None` while `buf` holds only part of it. A prefix over `max` is an error as
/// soon as its 4 bytes are in.
pub fn split(buf: &[u8], max: usize) -> Result<Option<(&[u8], usize)>, TooLarge> {
    let Some(head) = buf.first_chunk::<PREFIX_LEN>() else {
        return Ok(None);
    };
    let n = body_len(*head, max)?;
    let Some(end) = PREFIX_LEN.checked_add(n) else {
        return Err(TooLarge { len: n, max });
    };
    Ok(buf.get(PREFIX_LEN..end).map(|b| (b, end)))
}

/// Decodes a frame's body (bytes after the message are ignored, as postcard does). A body that
/// does not decode is an error, never a panic.
pub fn decode_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, postcard::Error> {
    postcard::from_bytes(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum Msg {
        Ping { id: u64 },
        Name(String),
        Bytes(Vec<u8>),
    }

    #[test]
    fn a_frame_round_trips_with_its_wire_bytes() {
        let f = encode(&Msg::Ping { id: 300 }, 64).unwrap();
        assert_eq!(
            f,
            [3, 0, 0, 0, 0, 0xac, 0x02],
            "the prefix (u32 LE), then the postcard body"
        );
        assert_eq!(body(&f), &[0, 0xac, 0x02]);
        assert_eq!(body_len(f[..4].try_into().unwrap(), 64), Ok(3));
        let (b, took) = split(&f, 64).unwrap().unwrap();
        assert_eq!(
            (decode_body::<Msg>(b).unwrap(), took),
            (Msg::Ping { id: 300 }, f.len())
        );
        let name = Msg::Name("kv".into());
        assert_eq!(encode(&name, 64).unwrap(), [4, 0, 0, 0, 1, 2, b'k', b'v']);
        // Two frames back to back: each is taken whole, the next starts where the first ended.
        let mut two = f.clone();
        two.extend(encode(&name, 64).unwrap());
        let (b, took) = split(&two, 64).unwrap().unwrap();
        assert_eq!(decode_body::<Msg>(b).unwrap(), Msg::Ping { id: 300 });
        let (b, _) = split(&two[took..], 64).unwrap().unwrap();
        assert_eq!(decode_body::<Msg>(b).unwrap(), name);
        assert_eq!(body(&[1, 2]), &[] as &[u8]);
    }

    #[test]
    fn partial_input_waits() {
        let f = encode(&Msg::Bytes(vec![9; 300]), 1024).unwrap();
        for cut in 0..f.len() {
            assert_eq!(
                split(&f[..cut], 1024),
                Ok(None),
                "{cut} bytes are not a frame yet"
            );
            assert!(!whole(&f[..cut]), "{cut} bytes");
            assert_eq!(claimed_len(&f[..cut]), (cut >= 4).then_some(f.len() - 4));
        }
        assert!(whole(&f));
        assert_eq!(
            split(&f, 1024).unwrap().map(|(_, took)| took),
            Some(f.len())
        );
        let empty = encode(&(), 0).unwrap();
        assert_eq!(empty, [0, 0, 0, 0]);
        assert!(whole(&empty));
        assert_eq!(split(&empty, 0), Ok(Some((&[][..], 4))));
    }

    #[test]
    fn a_body_over_the_limit_is_refused() {
        let m = Msg::Bytes(vec![1; 100]);
        let n = encode(&m, 1024).unwrap().len() - 4;
        assert!(encode(&m, n).is_ok(), "a body of exactly the limit fits");
        assert!(
            matches!(encode(&m, n - 1), Err(EncodeError::TooLarge(TooLarge { len, max })) if len == n && max == n - 1)
        );
        assert_eq!(
            encode(&m, n - 1).unwrap_err().to_string(),
            format!("a frame of {n} bytes is over the limit of {}", n - 1)
        );
        assert_eq!(prefix(5, usize::MAX), Ok([5, 0, 0, 0]));
        assert_eq!(
            prefix(u32::MAX as usize + 1, usize::MAX),
            Err(TooLarge {
                len: u32::MAX as usize + 1,
                max: u32::MAX as usize
            })
        );
        assert_eq!(
            body_len(u32::MAX.to_le_bytes(), usize::MAX),
            Ok(u32::MAX as usize)
        );
    }

    /// A prefix claiming 4 GiB (or just over the limit) is refused from its 4 bytes alone:
    /// nothing is allocated for the claim.
    #[test]
    fn an_over_limit_prefix_is_refused_before_allocating() {
        use crate::alloc_count::peak_during;
        let claim = u32::MAX.to_le_bytes();
        let (r, peak) = peak_during(|| split(&claim, 1 << 20));
        assert_eq!(
            r,
            Err(TooLarge {
                len: u32::MAX as usize,
                max: 1 << 20
            })
        );
        assert_eq!(peak, 0, "{peak} bytes allocated for a refused claim");
        let (r, peak) = peak_during(|| body_len(claim, 1 << 20));
        assert!(r.is_err() && peak == 0, "{peak}");
        // Just over: refused with the prefix alone, the body not waited for.
        assert_eq!(
            split(&1025u32.to_le_bytes(), 1024),
            Err(TooLarge {
                len: 1025,
                max: 1024
            })
        );
        assert_eq!(body_len(1024u32.to_le_bytes(), 1024), Ok(1024));
    }

    #[test]
    fn a_corrupt_body_is_refused() {
        let f = encode(&Msg::Name("abc".into()), 64).unwrap();
        // An unknown variant, a string cut short, a string that is not UTF-8, nothing at all.
        assert!(decode_body::<Msg>(&[7, 0]).is_err());
        assert!(decode_body::<Msg>(&f[4..f.len() - 1]).is_err());
        assert!(decode_body::<Msg>(&[1, 2, 0xff, 0xfe]).is_err());
        assert!(decode_body::<Msg>(&[]).is_err());
        // A vector claiming more elements than the body holds.
        assert!(decode_body::<Msg>(&[2, 0xff, 0xff, 0xff, 0xff, 0x0f, 1]).is_err());
    }

    proptest! {
        #[test]
        fn any_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64), max in 0usize..128) {
            let _ = whole(&b);
            let _ = claimed_len(&b);
            if let Ok(Some((body, took))) = split(&b, max) {
                prop_assert!(took <= b.len() && body.len() == took - 4 && body.len() <= max);
                let _ = decode_body::<Msg>(body);
            }
            let _ = decode_body::<Msg>(&b);
        }

        #[test]
        fn any_message_round_trips(id in any::<u64>(), s in ".{0,40}", v in proptest::collection::vec(any::<u8>(), 0..200)) {
            for m in [Msg::Ping { id }, Msg::Name(s.clone()), Msg::Bytes(v.clone())] {
                let f = encode(&m, 1024).unwrap();
                prop_assert!(whole(&f));
                let (b, took) = split(&f, 1024).unwrap().unwrap();
                prop_assert_eq!(took, f.len());
                prop_assert_eq!(decode_body::<Msg>(b).unwrap(), m);
            }
        }
    }
}
