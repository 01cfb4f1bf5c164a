//! Mooncake's TCP data protocol (reference §3): the 24-byte request header and the v2
//! status frame.
//!
//! Header layout: `size` u64 LE, `addr` u64 LE (a virtual address on the target), `opcode`
//! u8 (0 = READ, 1 = WRITE, bit 0x80 = v2 framing requested), 7 padding bytes (sent as zero,
//! ignored on receive). A v2 status frame is one u64 LE whose high 32 bits are the magic
//! `0x4D435456` ("MCTV") and whose low 32 bits are the status (0 OK, 1 rejected, 2
//! unauthorized: kvferry's, for a target holding a cluster key).
//!
//! kvferry's addition, only with a cluster key (`KVFERRY_AUTH_KEY_FILE`, [`crate::auth`]): a
//! connection opens with the key's Noise handshake before any request. The initiator sends an
//! opening frame ([`encode_auth_hello`]: a header whose opcode byte is [`AUTH_OPCODE`], which
//! no Mooncake peer sends or accepts, `addr` the magic [`AUTH_MAGIC`] and `size` the length of
//! the Noise opening message that follows); the target answers [`ANSWER_MAGIC`] and its Noise
//! answer ([`AUTH_ANSWER_LEN`] bytes in all) or, refusing (no key, another key, another
//! segment's name), an `Unauthorized` status frame and closes. Then every request header and
//! every status frame travels sealed under the connection's session ([`SEALED_HEADER_LEN`],
//! [`SEALED_STATUS_LEN`]: each a Noise transport message with its sequence number); the bytes
//! of WRITE bodies and READ answers travel as they are. Keyed connections always use v2
//! framing (no v1 fence).

use super::WireError;

pub const HEADER_LEN: usize = 24;
pub(crate) const STATUS_LEN: usize = 8;
pub(crate) const STATUS_MAGIC: u32 = 0x4D43_5456;
pub(crate) const V2_FLAG: u8 = 0x80;
/// Opcode byte of the cluster key's opening frame.
pub(crate) const AUTH_OPCODE: u8 = 0x4B;
/// The `addr` field of the opening frame ("KVFNOIS1").
pub(crate) const AUTH_MAGIC: u64 = u64::from_le_bytes(*b"KVFNOIS1");
/// The first 8 bytes of the target's answer ("KVFNOIS2"), where a status frame would be.
pub(crate) const ANSWER_MAGIC: u64 = u64::from_le_bytes(*b"KVFNOIS2");
/// Bytes of the target's answer: the magic and its Noise answer.
pub const AUTH_ANSWER_LEN: usize = 8 + crate::auth::ANSWER_LEN;
/// Bytes of a request header sealed.
pub const SEALED_HEADER_LEN: usize = HEADER_LEN + crate::auth::TAG_LEN;
/// Bytes of a status frame sealed.
pub const SEALED_STATUS_LEN: usize = STATUS_LEN + crate::auth::TAG_LEN;

/// The direction of a transfer, as seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Opcode {
    /// Remote memory → local memory.
    Read = 0,
    /// Local memory → remote memory.
    Write = 1,
}

/// A decoded request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    pub size: u64,
    pub addr: u64,
    pub opcode: Opcode,
    /// The initiator asked for v2 acknowledged framing.
    pub v2: bool,
}

impl DataHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16] = self.opcode as u8 | if self.v2 { V2_FLAG } else { 0 };
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<DataHeader, WireError> {
        let size = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
        let addr = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let op = b[16];
        let opcode = match op & !V2_FLAG {
            0 => Opcode::Read,
            1 => Opcode::Write,
            _ => return Err(WireError::Opcode(op)),
        };
        if addr.checked_add(size).is_none() {
            return Err(WireError::RangeOverflow { addr, size });
        }
        Ok(DataHeader {
            size,
            addr,
            opcode,
            v2: op & V2_FLAG != 0,
        })
    }
}

/// Status carried by a v2 status frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    /// The target refused the address range; it closes the connection after this frame.
    Rejected = 1,
    /// kvferry's: the target holds a cluster key and this connection did not prove it (or it
    /// holds none and was asked to); it closes the connection after this frame.
    Unauthorized = 2,
}

pub fn encode_status(s: Status) -> [u8; STATUS_LEN] {
    ((u64::from(STATUS_MAGIC) << 32) | s as u64).to_le_bytes()
}

pub fn decode_status(b: [u8; STATUS_LEN]) -> Result<Status, WireError> {
    let v = u64::from_le_bytes(b);
    let magic = (v >> 32) as u32;
    if magic != STATUS_MAGIC {
        return Err(WireError::StatusMagic(magic));
    }
    match v as u32 {
        0 => Ok(Status::Ok),
        1 => Ok(Status::Rejected),
        2 => Ok(Status::Unauthorized),
        other => Err(WireError::StatusCode(other)),
    }
}

/// The initiator's opening frame announcing a Noise opening message of `msg_len` bytes (the
/// message follows it) and what the connection protects (`protect`, `crate::auth::Protect`'s
/// code, in the byte after the opcode: the handshake is bound to it, see `auth_hello_protect`).
pub fn encode_auth_hello(msg_len: usize, protect: u8) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[0..8].copy_from_slice(&(msg_len as u64).to_le_bytes());
    b[8..16].copy_from_slice(&AUTH_MAGIC.to_le_bytes());
    b[16] = AUTH_OPCODE;
    b[17] = protect;
    b
}

/// What an opening frame asks the connection to protect (`crate::auth::Protect`'s code).
pub(crate) fn auth_hello_protect(h: &[u8; HEADER_LEN]) -> u8 {
    h[17]
}

/// Whether a header is the opening frame's: then the length of the message it announces
/// (which the caller bounds before reading it).
pub(crate) fn auth_hello_len(h: &[u8]) -> Option<u64> {
    let h = h.get(..HEADER_LEN)?;
    (h[16] == AUTH_OPCODE && h[8..16] == AUTH_MAGIC.to_le_bytes())
        .then(|| u64::from_le_bytes(h[0..8].try_into().expect("8 bytes")))
}

/// What the target answered the opening frame with, from its first 8 bytes: its Noise answer
/// (`AUTH_ANSWER_LEN - 8` bytes follow) or a status frame.
pub fn decode_auth_answer(first: [u8; STATUS_LEN]) -> Result<Option<Status>, WireError> {
    if u64::from_le_bytes(first) == ANSWER_MAGIC {
        return Ok(None);
    }
    decode_status(first).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_bytes() {
        let h = DataHeader {
            size: 4096,
            addr: 0x1000,
            opcode: Opcode::Write,
            v2: true,
        };
        let b = h.encode();
        assert_eq!(&b[0..8], &[0, 16, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[8..16], &[0, 16, 0, 0, 0, 0, 0, 0]);
        assert_eq!(b[16], 0x81);
        assert_eq!(&b[17..], &[0; 7]);
        assert_eq!(
            encode_status(Status::Ok),
            [0, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d]
        );
        assert_eq!(
            decode_status(encode_status(Status::Rejected)),
            Ok(Status::Rejected)
        );
        assert_eq!(decode_status([0; 8]), Err(WireError::StatusMagic(0)));
        let mut bad = encode_status(Status::Ok);
        bad[0] = 7;
        assert_eq!(decode_status(bad), Err(WireError::StatusCode(7)));
    }

    #[test]
    fn padding_ignored_bad_opcode_and_overflow_rejected() {
        let mut b = DataHeader {
            size: 1,
            addr: 2,
            opcode: Opcode::Read,
            v2: false,
        }
        .encode();
        b[20] = 0xff;
        assert_eq!(DataHeader::decode(&b).unwrap().opcode, Opcode::Read);
        b[16] = 2;
        assert_eq!(DataHeader::decode(&b), Err(WireError::Opcode(2)));
        let b = DataHeader {
            size: 2,
            addr: u64::MAX,
            opcode: Opcode::Read,
            v2: false,
        }
        .encode();
        assert!(matches!(
            DataHeader::decode(&b),
            Err(WireError::RangeOverflow { .. })
        ));
    }

    #[test]
    fn the_cluster_keys_frames_are_never_taken_for_a_request_or_a_status() {
        let hdr = encode_auth_hello(80, 2);
        assert_eq!(auth_hello_protect(&hdr), 2);
        assert_eq!(auth_hello_len(&hdr), Some(80));
        // A Mooncake target (and a kvferry one that does not look for it) cannot decode it as a
        // request: nothing is read or written for it.
        assert_eq!(
            DataHeader::decode(&hdr),
            Err(WireError::Opcode(AUTH_OPCODE))
        );
        // Nor is a request an opening frame, whatever its fields.
        let req = DataHeader {
            size: 80,
            addr: AUTH_MAGIC,
            opcode: Opcode::Write,
            v2: true,
        }
        .encode();
        assert_eq!(auth_hello_len(&req), None);
        assert_eq!(auth_hello_len(&hdr[..10]), None);
        let first = ANSWER_MAGIC.to_le_bytes();
        assert_eq!(decode_auth_answer(first), Ok(None));
        assert!(
            decode_status(first).is_err(),
            "an answer is not a status frame"
        );
        assert_eq!(
            decode_auth_answer(encode_status(Status::Unauthorized)),
            Ok(Some(Status::Unauthorized))
        );
        assert_eq!(
            decode_status(encode_status(Status::Unauthorized)),
            Ok(Status::Unauthorized)
        );
    }

    proptest! {
        #[test]
        fn header_decode_never_panics(b in proptest::array::uniform24(any::<u8>())) {
            if let Ok(h) = DataHeader::decode(&b) {
                // Whatever decodes re-encodes to the same meaningful bytes.
                prop_assert_eq!(&h.encode()[..17], &b[..17]);
            }
        }

        #[test]
        fn header_roundtrip(size in any::<u64>(), addr in any::<u64>(), w in any::<bool>(), v2 in any::<bool>()) {
            prop_assume!(addr.checked_add(size).is_some());
            let h = DataHeader { size, addr, opcode: if w { Opcode::Write } else { Opcode::Read }, v2 };
            prop_assert_eq!(DataHeader::decode(&h.encode()).unwrap(), h);
        }

        #[test]
        fn status_decode_never_panics(v in any::<u64>()) {
            let _ = decode_status(v.to_le_bytes());
        }
    }
}
