//! Handshake framing (Mooncake's "RPC port" protocol, reference §2.6).
//!
//! A frame is `u64 length` (little-endian) followed by `length` payload bytes. The payload is
//! one type byte (`Connection=0`, `Metadata=1`, `Notify=2`, `Probe=3`) and JSON text. Legacy
//! peers send no type byte: a payload whose first byte is greater than 3 (and not kvferry's
//! `Auth`, `K`, or `Service`, `S`) is JSON and is treated as a `Connection` message. Each request uses its own connection; the reply carries the same
//! type as the request.

use super::WireError;
use serde::{Deserialize, Serialize};

/// Length of the frame prefix.
pub(crate) const LEN_PREFIX: usize = 8;
/// Default upper bound on one frame's payload (Mooncake's `MC_HANDSHAKE_MAX_LENGTH`).
pub(crate) const DEFAULT_MAX_FRAME: u64 = 1 << 20;
/// The largest bound a user may configure.
pub(crate) const MAX_MAX_FRAME: u64 = 128 << 20;

/// Handshake message types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MsgType {
    /// RDMA queue-pair exchange (and legacy untyped frames).
    Connection = 0,
    /// Segment descriptor exchange: request and reply bodies are descriptors.
    Metadata = 1,
    /// A user message delivered to the peer's notify queue.
    Notify = 2,
    /// Liveness probe.
    Probe = 3,
    /// kvferry's, only with a cluster key (`crate::auth`): the key's handshake, before the
    /// request on the same connection. The initiator's frame carries `AUTH_HELLO` and its
    /// opening Noise message; the engine answers `AUTH_CHALLENGE` and its Noise answer, or
    /// refuses with `AUTH_REFUSED` and the reason. The request and its reply then go as
    /// sealed frames (`crate::auth::Sealer::seal_frame` of the whole encoded frame), not as
    /// frames of this framing. `K`: no JSON text starts with it, so no legacy frame is taken
    /// for it.
    Auth = 0x4B,
    /// kvferry's: a request to a service its user installed on the engine
    /// ([`crate::TransferEngine::serve`], e.g. the store client's disk reads); the bodies are
    /// the service's own. `S`: no JSON text starts with it either.
    Service = 0x53,
}

/// First byte of the `Auth` frame opening a keyed handshake; the Noise opening message follows.
pub(crate) const AUTH_HELLO: u8 = b'N';
/// First byte of an `Auth` answer carrying the engine's Noise answer.
pub(crate) const AUTH_CHALLENGE: u8 = b'C';
/// First byte of an `Auth` answer refusing the connection; the reason (UTF-8) follows.
pub(crate) const AUTH_REFUSED: u8 = b'R';

impl MsgType {
    pub fn from_u8(b: u8) -> Option<MsgType> {
        match b {
            0 => Some(MsgType::Connection),
            1 => Some(MsgType::Metadata),
            2 => Some(MsgType::Notify),
            3 => Some(MsgType::Probe),
            0x4B => Some(MsgType::Auth),
            0x53 => Some(MsgType::Service),
            _ => None,
        }
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: MsgType,
    /// The JSON text (without the type byte).
    pub body: Vec<u8>,
}

/// Encodes a frame: length prefix, type byte, body.
pub fn encode(kind: MsgType, body: &[u8]) -> Vec<u8> {
    let len = body.len() as u64 + 1;
    let mut out = Vec::with_capacity(LEN_PREFIX + 1 + body.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(body);
    out
}

/// Validates the 8-byte length prefix and returns the payload length to read next.
pub(crate) fn decode_len(prefix: [u8; LEN_PREFIX], max: u64) -> Result<usize, WireError> {
    let len = u64::from_le_bytes(prefix);
    if len == 0 || len > max {
        return Err(WireError::FrameLength { len, max });
    }
    usize::try_from(len).map_err(|_| WireError::FrameLength { len, max })
}

/// Splits a payload (everything after the length prefix) into its type and JSON body.
pub(crate) fn decode_payload(payload: &[u8]) -> Frame {
    match payload.first().copied().and_then(MsgType::from_u8) {
        Some(kind) => Frame {
            kind,
            body: payload[1..].to_vec(),
        },
        // Legacy: no type byte, the whole payload is a Connection JSON.
        None => Frame {
            kind: MsgType::Connection,
            body: payload.to_vec(),
        },
    }
}

/// Streaming decode: returns the frame and the number of bytes consumed, or `None` when
/// `buf` does not yet hold a whole frame.
pub fn decode(buf: &[u8], max: u64) -> Result<Option<(Frame, usize)>, WireError> {
    if buf.len() < LEN_PREFIX {
        return Ok(None);
    }
    let mut prefix = [0u8; LEN_PREFIX];
    prefix.copy_from_slice(&buf[..LEN_PREFIX]);
    let len = decode_len(prefix, max)?;
    let Some(end) = LEN_PREFIX.checked_add(len) else {
        return Err(WireError::FrameLength {
            len: len as u64,
            max,
        });
    };
    if buf.len() < end {
        return Ok(None);
    }
    Ok(Some((decode_payload(&buf[LEN_PREFIX..end]), end)))
}

/// Body of a `Notify` message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NotifyMsg {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub notify_msg: String,
}

/// Reply body of a `Probe` message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ProbeReply {
    #[serde(default)]
    pub status: String,
}

/// Parses a JSON body, naming the message kind in the error.
pub(crate) fn parse_json<T: for<'de> Deserialize<'de>>(
    what: &'static str,
    body: &[u8],
) -> Result<T, WireError> {
    serde_json::from_slice(body).map_err(|e| WireError::Json {
        what,
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn roundtrip_and_legacy() {
        let f = encode(MsgType::Probe, b"{}");
        assert_eq!(&f[..8], &3u64.to_le_bytes());
        let (frame, n) = decode(&f, DEFAULT_MAX_FRAME).unwrap().unwrap();
        assert_eq!(n, f.len());
        assert_eq!(
            frame,
            Frame {
                kind: MsgType::Probe,
                body: b"{}".to_vec()
            }
        );
        // Legacy untyped frame.
        let mut legacy = 2u64.to_le_bytes().to_vec();
        legacy.extend_from_slice(b"{}");
        let (frame, _) = decode(&legacy, DEFAULT_MAX_FRAME).unwrap().unwrap();
        assert_eq!(frame.kind, MsgType::Connection);
        assert_eq!(frame.body, b"{}");
    }

    #[test]
    fn rejects_zero_and_oversized() {
        assert!(decode(&0u64.to_le_bytes(), 100).is_err());
        assert!(decode(&101u64.to_le_bytes(), 100).is_err());
        assert!(
            decode(&u64::MAX.to_le_bytes(), u64::MAX).is_err(),
            "length overflowing the address space"
        );
        assert_eq!(
            decode(&5u64.to_le_bytes(), 100).unwrap(),
            None,
            "truncated frame waits for more"
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics(buf in proptest::collection::vec(any::<u8>(), 0..64), max in 1u64..1000) {
            let _ = decode(&buf, max);
        }

        #[test]
        fn encode_decode_roundtrip(kind in 0u8..4, body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let kind = MsgType::from_u8(kind).unwrap();
            let f = encode(kind, &body);
            let (frame, n) = decode(&f, DEFAULT_MAX_FRAME).unwrap().unwrap();
            prop_assert_eq!(n, f.len());
            prop_assert_eq!(frame.kind, kind);
            prop_assert_eq!(frame.body, body);
        }
    }
}
