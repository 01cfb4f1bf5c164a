//! Mooncake's TCP data protocol (reference §3): the 24-byte request header and the v2
//! status frame.
//!
//! Header layout: `size` u64 LE, `addr` u64 LE (a virtual address on the target), `opcode`
//! u8 (0 = READ, 1 = WRITE, bit 0x80 = v2 framing requested), 7 padding bytes (sent as zero,
//! ignored on receive). A v2 status frame is one u64 LE whose high 32 bits are the magic
//! `0x4D435456` ("MCTV") and whose low 32 bits are the status (0 OK, 1 rejected).

use super::WireError;

pub const HEADER_LEN: usize = 24;
pub const STATUS_LEN: usize = 8;
pub const STATUS_MAGIC: u32 = 0x4D43_5456;
pub const V2_FLAG: u8 = 0x80;

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
        Ok(DataHeader { size, addr, opcode, v2: op & V2_FLAG != 0 })
    }
}

/// Status carried by a v2 status frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    /// The target refused the address range; it closes the connection after this frame.
    Rejected = 1,
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
        other => Err(WireError::StatusCode(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_bytes() {
        let h = DataHeader { size: 4096, addr: 0x1000, opcode: Opcode::Write, v2: true };
        let b = h.encode();
        assert_eq!(&b[0..8], &[0, 16, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[8..16], &[0, 16, 0, 0, 0, 0, 0, 0]);
        assert_eq!(b[16], 0x81);
        assert_eq!(&b[17..], &[0; 7]);
        assert_eq!(encode_status(Status::Ok), [0, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d]);
        assert_eq!(decode_status(encode_status(Status::Rejected)), Ok(Status::Rejected));
        assert_eq!(decode_status([0; 8]), Err(WireError::StatusMagic(0)));
        let mut bad = encode_status(Status::Ok);
        bad[0] = 7;
        assert_eq!(decode_status(bad), Err(WireError::StatusCode(7)));
    }

    #[test]
    fn padding_ignored_bad_opcode_and_overflow_rejected() {
        let mut b = DataHeader { size: 1, addr: 2, opcode: Opcode::Read, v2: false }.encode();
        b[20] = 0xff;
        assert_eq!(DataHeader::decode(&b).unwrap().opcode, Opcode::Read);
        b[16] = 2;
        assert_eq!(DataHeader::decode(&b), Err(WireError::Opcode(2)));
        let b = DataHeader { size: 2, addr: u64::MAX, opcode: Opcode::Read, v2: false }.encode();
        assert!(matches!(DataHeader::decode(&b), Err(WireError::RangeOverflow { .. })));
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
