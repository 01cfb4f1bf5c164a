//! Sans-IO codecs for every byte kvferry puts on the wire.
//!
//! Each codec is a set of pure functions from bytes to values and back: no sockets, no
//! clocks, no allocation beyond the value itself. Transports and the handshake server
//! call them; tests and fuzzers call them directly. A decoder never panics on any input:
//! malformed bytes give a [`WireError`] naming what was wrong.
//!
//! - [`handshake`]: Mooncake's handshake framing (u64 length, type byte, JSON).
//! - [`descriptor`]: the segment descriptor JSON that peers exchange.
//! - [`tcp`]: the 24-byte TCP data header and the v2 status frame.
//! - [`rdma`]: the RDMA `Connection` handshake message (NIC paths, LID, GID, QP numbers).

pub(crate) mod descriptor;
pub(crate) mod handshake;
pub(crate) mod rdma;
pub(crate) mod tcp;

/// A decoding or validation failure of bytes received from a peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("handshake frame length {len} is outside 1..={max} bytes (raise KVFERRY_HANDSHAKE_MAX_LENGTH / MC_HANDSHAKE_MAX_LENGTH if a peer has very many buffers)")]
    FrameLength { len: u64, max: u64 },
    #[error("handshake reply has type {got}, expected {expected}: the peer is not a Mooncake-compatible engine or is confused")]
    UnexpectedType { got: u8, expected: u8 },
    #[error("malformed JSON in {what}: {reason}")]
    Json { what: &'static str, reason: String },
    #[error("segment descriptor field `{field}` is invalid: {reason}")]
    Descriptor { field: String, reason: String },
    #[error("TCP data header has unknown opcode 0x{0:02x} (expected 0=READ or 1=WRITE, optionally | 0x80)")]
    Opcode(u8),
    #[error("TCP status frame has magic 0x{0:08x}, expected 0x4d435456 (\"MCTV\"): the target speaks the legacy v1 protocol or is not a Mooncake-compatible TCP server")]
    StatusMagic(u32),
    #[error("TCP status frame has unknown status code {0}")]
    StatusCode(u32),
    #[error("TCP data header range overflows: addr 0x{addr:x} + size {size} exceeds 2^64")]
    RangeOverflow { addr: u64, size: u64 },
    #[error("a sealed status frame does not open under the connection's session (altered or injected by something on the path)")]
    Unsealed,
}
