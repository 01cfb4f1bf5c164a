//! The optional cluster key (`KVFERRY_AUTH_KEY_FILE`): what proves it on a connection, and what
//! keeps every frame after that proof bound to the connection.
//!
//! What this is: the Noise protocol `Noise_NNpsk0_25519_AESGCM_SHA256` ([`NOISE`], the `snow`
//! crate with ring's ciphers), keyed by a pre-shared key derived from the cluster key. Two messages: the
//! initiator's ephemeral key and the identity it meant to reach, sealed under the key
//! ([`Initiator::new`]); the responder's ephemeral key and an empty sealed payload
//! ([`answer`]). After them each side holds two fresh session keys (one per direction,
//! forward-secret: a Diffie-Hellman of the two ephemerals), and every frame of the connection
//! is a Noise transport message under them with its own sequence number ([`Sealer`],
//! [`Opener`]): a frame injected, replayed, reordered, dropped or taken from another connection
//! does not open. The protocol's name and the use ([`Protocol`]: the engine's handshake or data
//! port, the store's RPC, the HA link) are in the prologue, so a handshake made for one use
//! fails on another; the identity dialed (a segment name, a master's cluster, a standby) is
//! checked by the responder, so a handshake relayed to another endpoint fails there.
//!
//! What each side learns when: the responder learns from the opening message that its sender
//! held the key once (it can be a replay: the message holds nothing fresh from the responder),
//! and from the first transport frame that opens that the sender holds the session (no replay
//! can make one): nothing is served, decoded or allocated for a connection before that frame.
//! The initiator learns from the answer that the responder holds the key and this session.
//! An opening message that was not sealed under a key held here is refused after a hash and an
//! AEAD check, before any Diffie-Hellman (a flood without the key costs no public-key work).
//!
//! What it does not stop: a host that holds the key (it can do anything the cluster can); a
//! host on the path reading what is not encrypted (the TCP data port's payload bytes by
//! default, `docs/ARCHITECTURE.md`) or cutting a connection.
//!
//! The file holds one or two keys, one per line (blank lines and lines starting with `#` are
//! skipped), each at least `MIN_KEY_LEN` bytes (`openssl rand -hex 32` writes one), readable
//! by its owner only (as ssh wants of a private key). The first opens handshakes; every key is
//! accepted. A key changes in three steps, each on every host before the next: `old` then
//! `new` in the file (still opening with the old key, accepting both), `new` then `old`
//! (opening with the new one), then `new` alone.

pub(crate) mod keyed;

pub(crate) use keyed::Keyed;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The Noise protocol every keyed connection runs (`snow`).
///
/// AES-GCM rather than ChaCha20-Poly1305: with ring's implementation (`snow`'s
/// `ring-accelerated`) it seals 5 GB/s and a 24-byte header in about 150 ns on the x86 hosts
/// here, against 1.9 GB/s and 220 ns (and 1.0 GB/s, 1.8 us with `snow`'s default ciphers).
pub const NOISE: &str = "Noise_NNpsk0_25519_AESGCM_SHA256";
/// Shortest key accepted, in bytes.
pub(crate) const MIN_KEY_LEN: usize = 32;
/// Most keys a file may hold (the one in use and the one it replaces).
pub(crate) const MAX_KEYS: usize = 2;
/// Bytes of an AEAD tag: what sealing adds to each message.
pub(crate) const TAG_LEN: usize = 16;
/// Bytes of an ephemeral public key (X25519).
const DH_LEN: usize = 32;
/// Longest identity an initiator may name (a segment name, a cluster, a member).
pub(crate) const MAX_IDENTITY: usize = 512;
/// Longest Noise message; a sealed frame's body goes in messages of at most this size.
pub const MAX_MSG: usize = 65535;
/// Most plaintext bytes one message carries.
pub(crate) const MAX_PLAIN: usize = MAX_MSG - TAG_LEN;
/// Most bytes of an opening message ([`Initiator::new`]).
pub const MAX_HELLO_LEN: usize = DH_LEN + MAX_IDENTITY + TAG_LEN;
/// Bytes of the answer to it ([`answer`]).
pub const ANSWER_LEN: usize = DH_LEN + TAG_LEN;
/// Bytes of a sealed frame's sealed length ([`Sealer::seal_frame`]).
pub const FRAME_HEAD_LEN: usize = 4 + TAG_LEN;

/// Bytes of an opening message naming `identity`.
pub const fn hello_len(identity: usize) -> usize {
    DH_LEN + identity + TAG_LEN
}

/// Why a key file cannot be used; each message names the file and the fix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyFileError {
    #[error("KVFERRY_AUTH_KEY_FILE {path}: cannot read it ({why}); point it at a readable file holding the cluster key, or unset it to run without one")]
    Unreadable { path: PathBuf, why: String },
    #[error("KVFERRY_AUTH_KEY_FILE {path}: holds no key; write one per line (e.g. `openssl rand -hex 32`)")]
    Empty { path: PathBuf },
    #[error("KVFERRY_AUTH_KEY_FILE {path}: key {line} is {len} bytes; keys are at least {MIN_KEY_LEN} bytes (e.g. `openssl rand -hex 32`)")]
    TooShort {
        path: PathBuf,
        line: usize,
        len: usize,
    },
    #[error("KVFERRY_AUTH_KEY_FILE {path}: holds {n} keys; at most {MAX_KEYS} (the one in use first, then the one it replaces)")]
    TooMany { path: PathBuf, n: usize },
    #[error("KVFERRY_AUTH_KEY_FILE {path}: mode {mode:04o} lets others than its owner read it; the key must be the owner's alone: `chmod 600 {path}`")]
    Exposed { path: PathBuf, mode: u32 },
}

/// The cluster's key(s): the first opens handshakes, any is accepted. Holds what is derived
/// from each key, never the key's text.
#[derive(Clone)]
pub struct ClusterKey {
    /// Noise pre-shared keys, one per key in the file.
    psks: Vec<[u8; 32]>,
    /// Keys for requests to HTTP surfaces ([`ClusterKey::http_tag`]).
    http: Vec<[u8; 32]>,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key itself.
        write!(f, "ClusterKey({} key(s))", self.psks.len())
    }
}

fn derive(key: &[u8], label: &str) -> [u8; 32] {
    // HMAC takes a key of any length: this cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    m.update(label.as_bytes());
    m.finalize().into_bytes().into()
}

impl ClusterKey {
    /// Reads the key file at `path`; refused when others than its owner may read it.
    pub fn load(path: &Path) -> Result<ClusterKey, KeyFileError> {
        use std::os::unix::fs::PermissionsExt;
        let unreadable = |e: std::io::Error| KeyFileError::Unreadable {
            path: path.to_path_buf(),
            why: e.to_string(),
        };
        let file = std::fs::File::open(path).map_err(unreadable)?;
        // (The mode of the file opened, not of whatever the path names by the time it is read.)
        let mode = file.metadata().map_err(unreadable)?.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(KeyFileError::Exposed {
                path: path.to_path_buf(),
                mode,
            });
        }
        let mut text = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(&file, 1 << 16), &mut text)
            .map_err(unreadable)?;
        Self::parse(&text, path)
    }

    /// The keys a file's bytes hold (`path` only names it in errors).
    pub fn parse(text: &[u8], path: &Path) -> Result<ClusterKey, KeyFileError> {
        let mut keys = Vec::new();
        for (i, line) in text.split(|&b| b == b'\n').enumerate() {
            let line = line.trim_ascii();
            if line.is_empty() || line.starts_with(b"#") {
                continue;
            }
            if line.len() < MIN_KEY_LEN {
                return Err(KeyFileError::TooShort {
                    path: path.to_path_buf(),
                    line: i + 1,
                    len: line.len(),
                });
            }
            keys.push(line);
        }
        match keys.len() {
            0 => Err(KeyFileError::Empty {
                path: path.to_path_buf(),
            }),
            n if n > MAX_KEYS => Err(KeyFileError::TooMany {
                path: path.to_path_buf(),
                n,
            }),
            _ => Ok(ClusterKey {
                psks: keys
                    .iter()
                    .map(|k| derive(k, "kvferry cluster key: Noise psk v1"))
                    .collect(),
                http: keys
                    .iter()
                    .map(|k| derive(k, "kvferry cluster key: HTTP v1"))
                    .collect(),
            }),
        }
    }

    /// The key file named by the configuration, if one is.
    pub fn from_config(path: Option<&Path>) -> Result<Option<ClusterKey>, KeyFileError> {
        path.map(Self::load).transpose()
    }

    /// The tag of an HTTP request's `parts` under the first key (HMAC-SHA256, lengths
    /// first, so no two lists of parts encode alike).
    pub(crate) fn http_tag(&self, parts: &[&[u8]]) -> [u8; 32] {
        Self::tag_with(&self.http[0], parts)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `tag` is the tag of `parts` under one of the keys (compared in constant time).
    pub(crate) fn http_verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.http
            .iter()
            .any(|k| Self::tag_with(k, parts).verify_slice(tag).is_ok())
    }

    fn tag_with(key: &[u8; 32], parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
        for part in parts {
            m.update(&(part.len() as u64).to_le_bytes());
            m.update(part);
        }
        m
    }
}

/// What the cluster key protects on a TCP data connection beyond the handshake
/// (`KVFERRY_AUTH_PROTECT`): every request header and status frame is sealed in all three;
/// `Payload` also authenticates the bytes of WRITE bodies and READ answers (a BLAKE3 digest of each
/// 32 KiB chunk, sealed after it: altered bytes fail the request before it is answered), and
/// `Encrypt` seals them (each chunk a Noise message: nothing on the path reads or alters them).
/// The initiator asks for its own; a target refuses a connection that asks for less than its
/// own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum Protect {
    #[default]
    Headers,
    Payload,
    Encrypt,
}

impl Protect {
    pub fn parse(s: &str) -> Option<Protect> {
        match s.trim().to_ascii_lowercase().as_str() {
            "headers" => Some(Protect::Headers),
            "payload" => Some(Protect::Payload),
            "encrypt" => Some(Protect::Encrypt),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Protect::Headers => "headers",
            Protect::Payload => "payload",
            Protect::Encrypt => "encrypt",
        }
    }

    /// Its number on the wire.
    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(b: u8) -> Option<Protect> {
        [Protect::Headers, Protect::Payload, Protect::Encrypt]
            .get(usize::from(b))
            .copied()
    }
}

/// Connections that have not proved the key yet, counted in total and per source address, so
/// that a flood from one host (idle connections, slow senders) cannot take every place: a
/// port admits a new connection only while both counts are under their caps, and a
/// connection leaves the count when it proves the key (`Pass::proved`) or ends.
pub struct Unproved {
    total: usize,
    per_source: usize,
    counts: std::sync::Mutex<(usize, std::collections::HashMap<std::net::IpAddr, usize>)>,
}

impl Unproved {
    pub fn new(total: usize, per_source: usize) -> Arc<Unproved> {
        Arc::new(Unproved {
            total,
            per_source,
            counts: std::sync::Mutex::default(),
        })
    }

    /// A place for a new connection from `source`, or `None` when either cap is reached.
    pub fn admit(self: &Arc<Self>, source: std::net::IpAddr) -> Option<Pass> {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let from = c.1.get(&source).copied().unwrap_or(0);
        if c.0 >= self.total || from >= self.per_source {
            return None;
        }
        c.0 += 1;
        *c.1.entry(source).or_default() += 1;
        Some(Pass {
            of: Some((Arc::clone(self), source)),
        })
    }

    /// Connections counted now (in total, and from `source`).
    pub fn counted(&self, source: std::net::IpAddr) -> (usize, usize) {
        let c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        (c.0, c.1.get(&source).copied().unwrap_or(0))
    }

    fn leave(&self, source: std::net::IpAddr) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.0 = c.0.saturating_sub(1);
        if let Some(n) = c.1.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                c.1.remove(&source);
            }
        }
    }
}

/// A connection's place among the [`Unproved`]; given back when it proves the key or ends.
pub struct Pass {
    of: Option<(Arc<Unproved>, std::net::IpAddr)>,
}

impl Pass {
    /// The connection proved the key: it no longer counts.
    pub(crate) fn proved(&mut self) {
        if let Some((u, ip)) = self.of.take() {
            u.leave(ip);
        }
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        self.proved();
    }
}

/// One use of the cluster key: its name is the handshake's prologue, so a handshake made for
/// one use never completes on another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Protocol(pub &'static str);

/// Why the other side of a connection is not let in, or a frame not taken (the caller says
/// which side and where).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("its opening message is {0} bytes; {min} to {MAX_HELLO_LEN} expected", min = hello_len(0))]
    HelloSize(usize),
    #[error("its answer is {0} bytes; {ANSWER_LEN} expected")]
    AnswerSize(usize),
    #[error("it is not sealed under this host's cluster key: the other side holds another key than this host's KVFERRY_AUTH_KEY_FILE (while a key changes, every host must accept both first: the old and the new key in its file), or it was made for another protocol")]
    OtherKey,
    #[error("it was meant for {meant:?}, and this is {here:?}: a proof made for one endpoint is not taken by another (a relay, or a stale address for that name)")]
    Misdirected { meant: String, here: String },
    #[error("the identity to reach is {0} bytes; at most {MAX_IDENTITY}")]
    IdentityTooLong(usize),
    #[error("a frame does not open under this connection's session (injected, replayed, reordered or cut by something on the path)")]
    Frame,
    #[error("a sealed frame claims {0} bytes; at most {1} here")]
    FrameTooLarge(usize, usize),
}

/// A handshake state for `proto` under `psk`, either side.
fn handshake(
    proto: Protocol,
    psk: &[u8; 32],
    initiator: bool,
) -> Result<snow::HandshakeState, snow::Error> {
    // (The pattern's name is a constant of this module: parsing it cannot fail.)
    let params: snow::params::NoiseParams = NOISE
        .parse()
        .unwrap_or_else(|_| unreachable!("{NOISE} is a valid Noise protocol name"));
    let b = snow::Builder::new(params)
        .prologue(proto.0.as_bytes())?
        .psk(0, psk)?;
    if initiator {
        b.build_initiator()
    } else {
        b.build_responder()
    }
}

/// The initiating side of a handshake, between its opening message and the answer.
pub struct Initiator {
    hs: snow::HandshakeState,
}

impl Initiator {
    /// Opens a handshake for `proto` towards the endpoint known as `dialed`: this side, and
    /// the opening message to send ([`hello_len`] of `dialed`'s length).
    pub fn new(
        key: &ClusterKey,
        proto: Protocol,
        dialed: &str,
    ) -> Result<(Initiator, Vec<u8>), Refusal> {
        if dialed.len() > MAX_IDENTITY {
            return Err(Refusal::IdentityTooLong(dialed.len()));
        }
        let mut hs = handshake(proto, &key.psks[0], true).map_err(|_| Refusal::OtherKey)?;
        let mut msg = vec![0u8; hello_len(dialed.len())];
        let n = hs
            .write_message(dialed.as_bytes(), &mut msg)
            .map_err(|_| Refusal::OtherKey)?;
        msg.truncate(n);
        Ok((Initiator { hs }, msg))
    }

    /// The responder's answer checked: the session.
    pub fn finish(mut self, answer: &[u8]) -> Result<Session, Refusal> {
        if answer.len() != ANSWER_LEN {
            return Err(Refusal::AnswerSize(answer.len()));
        }
        let mut payload = [0u8; ANSWER_LEN];
        self.hs
            .read_message(answer, &mut payload)
            .map_err(|_| Refusal::OtherKey)?;
        Session::of(self.hs)
    }
}

/// Answers an opening message for `proto` at the endpoint known by any of the names `here`
/// (the first names it in a refusal): the session, and the answer to send. Refused, before any
/// public-key work, when the message is not sealed under a key held here or names another
/// endpoint.
pub fn answer(
    key: &ClusterKey,
    proto: Protocol,
    hello: &[u8],
    here: &[&str],
) -> Result<(Session, Vec<u8>), Refusal> {
    if hello.len() < hello_len(0) || hello.len() > MAX_HELLO_LEN {
        return Err(Refusal::HelloSize(hello.len()));
    }
    let mut meant = vec![0u8; hello.len()];
    for psk in &key.psks {
        let Ok(mut hs) = handshake(proto, psk, false) else {
            continue;
        };
        let Ok(n) = hs.read_message(hello, &mut meant) else {
            continue;
        };
        let meant = &meant[..n];
        if !here.iter().any(|h| h.as_bytes() == meant) {
            return Err(Refusal::Misdirected {
                meant: String::from_utf8_lossy(meant).into_owned(),
                here: here.first().copied().unwrap_or_default().to_string(),
            });
        }
        let mut msg = [0u8; ANSWER_LEN];
        let n = hs
            .write_message(&[], &mut msg)
            .map_err(|_| Refusal::OtherKey)?;
        return Ok((Session::of(hs)?, msg[..n].to_vec()));
    }
    Err(Refusal::OtherKey)
}

/// A finished handshake: split into the sealing and the opening halves, which may live on
/// different threads.
pub struct Session {
    state: Arc<snow::StatelessTransportState>,
}

impl Session {
    fn of(hs: snow::HandshakeState) -> Result<Session, Refusal> {
        let state = hs
            .into_stateless_transport_mode()
            .map_err(|_| Refusal::OtherKey)?;
        Ok(Session {
            state: Arc::new(state),
        })
    }

    pub fn split(self) -> (Sealer, Opener) {
        (
            Sealer {
                state: Arc::clone(&self.state),
                n: 0,
            },
            Opener {
                state: self.state,
                n: 0,
            },
        )
    }
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Session")
    }
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sealer {{ sent: {} }}", self.n)
    }
}

impl std::fmt::Debug for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Opener {{ opened: {} }}", self.n)
    }
}

/// Seals what one side sends on a connection, in order.
pub struct Sealer {
    state: Arc<snow::StatelessTransportState>,
    n: u64,
}

impl Sealer {
    /// Appends `plain` (at most `MAX_PLAIN` bytes) sealed as the next message:
    /// `plain.len() + TAG_LEN` bytes.
    pub fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>) {
        assert!(
            plain.len() <= MAX_PLAIN,
            "a Noise message carries at most {MAX_PLAIN} bytes"
        );
        let at = out.len();
        out.resize(at + plain.len() + TAG_LEN, 0);
        let n = self
            .state
            .write_message(self.n, plain, &mut out[at..])
            .unwrap_or_else(|e| {
                unreachable!(
                    "sealing {} bytes into {}: {e}",
                    plain.len(),
                    plain.len() + TAG_LEN
                )
            });
        debug_assert_eq!(n, plain.len() + TAG_LEN);
        self.n += 1;
    }

    /// Seals `plain` as the next message into `out`, which must hold exactly
    /// `plain.len() + TAG_LEN` bytes.
    pub(crate) fn seal_to(&mut self, plain: &[u8], out: &mut [u8]) {
        assert!(
            plain.len() <= MAX_PLAIN && out.len() == plain.len() + TAG_LEN,
            "sealing {} bytes into {}",
            plain.len(),
            out.len()
        );
        let n = self
            .state
            .write_message(self.n, plain, out)
            .unwrap_or_else(|e| unreachable!("sealing {} bytes: {e}", plain.len()));
        debug_assert_eq!(n, out.len());
        self.n += 1;
    }

    /// Appends `body` sealed as a frame: its length sealed ([`FRAME_HEAD_LEN`] bytes), then
    /// the body in messages of at most [`MAX_MSG`] bytes ([`frame_body_len`] in all).
    pub fn seal_frame(&mut self, body: &[u8], out: &mut Vec<u8>) {
        let len = u32::try_from(body.len()).unwrap_or_else(|_| {
            panic!(
                "a sealed frame of {} bytes; the callers bound theirs far lower",
                body.len()
            )
        });
        out.reserve(FRAME_HEAD_LEN + frame_body_len(body.len()));
        self.seal(&len.to_le_bytes(), out);
        for chunk in body.chunks(MAX_PLAIN) {
            self.seal(chunk, out);
        }
    }
}

/// The sealed bytes of a frame body of `n` bytes (its head excluded).
pub const fn frame_body_len(n: usize) -> usize {
    n + n.div_ceil(MAX_PLAIN) * TAG_LEN
}

/// Opens what the other side sent on a connection, in order.
pub struct Opener {
    state: Arc<snow::StatelessTransportState>,
    n: u64,
}

impl Opener {
    /// Opens the next message (`sealed`, `TAG_LEN` bytes more than what it carries) into
    /// `out`, returning how many bytes it carries.
    pub fn open(&mut self, sealed: &[u8], out: &mut [u8]) -> Result<usize, Refusal> {
        if sealed.len() < TAG_LEN || sealed.len() > MAX_MSG {
            return Err(Refusal::Frame);
        }
        let n = self
            .state
            .read_message(self.n, sealed, out)
            .map_err(|_| Refusal::Frame)?;
        self.n += 1;
        Ok(n)
    }

    /// Opens a frame's head ([`FRAME_HEAD_LEN`] bytes): its body's length, if at most `max`
    /// (then [`frame_body_len`] of it sealed bytes follow).
    pub fn open_frame_head(
        &mut self,
        head: &[u8; FRAME_HEAD_LEN],
        max: usize,
    ) -> Result<usize, Refusal> {
        let mut len = [0u8; FRAME_HEAD_LEN];
        if self.open(head, &mut len)? != 4 {
            return Err(Refusal::Frame);
        }
        let n = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        if n > max {
            return Err(Refusal::FrameTooLarge(n, max));
        }
        Ok(n)
    }

    /// Opens a frame's body ([`frame_body_len`] of its length, as its head said) into `out`.
    pub fn open_frame_body(&mut self, sealed: &[u8], out: &mut Vec<u8>) -> Result<(), Refusal> {
        out.clear();
        out.reserve(sealed.len());
        for chunk in sealed.chunks(MAX_MSG) {
            let at = out.len();
            out.resize(at + chunk.len(), 0);
            let n = self.open(chunk, &mut out[at..])?;
            out.truncate(at + n);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Protocol = Protocol("kvferry/test");

    fn key(lines: &str) -> ClusterKey {
        ClusterKey::parse(lines.as_bytes(), Path::new("k")).expect("a valid key file")
    }

    /// A full handshake between `i` (dialing `dialed`) and `r` (known as `here`).
    fn pair(
        i: &ClusterKey,
        r: &ClusterKey,
        dialed: &str,
        here: &[&str],
    ) -> Result<(Session, Session), (&'static str, Refusal)> {
        let (init, hello) = Initiator::new(i, P, dialed).map_err(|e| ("initiator", e))?;
        let (rs, ans) = answer(r, P, &hello, here).map_err(|e| ("responder", e))?;
        let is = init.finish(&ans).map_err(|e| ("initiator", e))?;
        Ok((is, rs))
    }

    #[test]
    fn a_key_file_holds_one_or_two_long_keys_owned_alone_and_says_what_is_wrong_otherwise() {
        use std::os::unix::fs::PermissionsExt;
        let a = "a".repeat(64);
        let b = "b".repeat(32);
        assert_eq!(key(&format!("# the cluster's key\n\n{a}\n")).psks.len(), 1);
        let ws = key(&format!("  {a}  \r\n{b}"));
        assert_eq!(ws.psks.len(), 2);
        assert_eq!(
            ws.psks[0],
            key(&a).psks[0],
            "whitespace around a key is not part of it"
        );
        let err =
            |t: &str| ClusterKey::parse(t.as_bytes(), Path::new("/etc/k")).expect_err("refused");
        assert_eq!(
            err("# nothing\n\n"),
            KeyFileError::Empty {
                path: "/etc/k".into()
            }
        );
        assert_eq!(
            err(&format!("{a}\nshort\n")),
            KeyFileError::TooShort {
                path: "/etc/k".into(),
                line: 2,
                len: 5
            }
        );
        assert_eq!(
            err(&format!("{a}\n{b}\n{a}")),
            KeyFileError::TooMany {
                path: "/etc/k".into(),
                n: 3
            }
        );
        let missing = ClusterKey::load(Path::new("/nonexistent/kvferry-key")).expect_err("no file");
        assert!(
            missing
                .to_string()
                .contains("KVFERRY_AUTH_KEY_FILE /nonexistent/kvferry-key")
                && missing.to_string().contains("unset it"),
            "{missing}"
        );
        assert!(
            !format!("{:?}", key(&a)).contains(&a),
            "Debug never shows the key"
        );
        // A file others may read is refused, naming the fix; the owner's alone is taken.
        let dir = std::env::temp_dir().join(format!("kvferry-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("key");
        std::fs::write(&f, &a).unwrap();
        for mode in [0o644, 0o640, 0o604, 0o660] {
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = ClusterKey::load(&f).expect_err("exposed");
            assert_eq!(
                e,
                KeyFileError::Exposed {
                    path: f.clone(),
                    mode
                }
            );
            assert!(e.to_string().contains("chmod 600"), "{e}");
        }
        for mode in [0o600, 0o400] {
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
            assert!(ClusterKey::load(&f).is_ok(), "mode {mode:o}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Both sides holding a key in common get a session whose frames open in order, one way
    /// and the other; another key, a handshake for another protocol or another endpoint is
    /// refused by the responder, which says why.
    #[test]
    fn a_handshake_completes_only_with_a_key_in_common_for_the_endpoint_dialed() {
        let (a, b) = (key(&"a".repeat(64)), key(&"b".repeat(64)));
        let (i, r) = pair(&a, &a, "seg-1", &["seg-1"]).expect("same key");
        let ((mut is, mut io), (mut rs, mut ro)) = (i.split(), r.split());
        let mut wire = Vec::new();
        is.seal_frame(b"a request", &mut wire);
        let mut body = Vec::new();
        let n = ro
            .open_frame_head(wire[..FRAME_HEAD_LEN].try_into().unwrap(), 1 << 20)
            .unwrap();
        assert_eq!(wire.len(), FRAME_HEAD_LEN + frame_body_len(n));
        ro.open_frame_body(&wire[FRAME_HEAD_LEN..], &mut body)
            .unwrap();
        assert_eq!(body, b"a request");
        wire.clear();
        rs.seal(b"answer", &mut wire);
        let mut out = [0u8; 64];
        assert_eq!(io.open(&wire, &mut out), Ok(6));
        assert_eq!(&out[..6], b"answer");

        assert_eq!(
            pair(&a, &b, "seg-1", &["seg-1"]).err(),
            Some(("responder", Refusal::OtherKey))
        );
        let (_, hello) = Initiator::new(&a, P, "seg-1").unwrap();
        assert_eq!(
            answer(&a, Protocol("kvferry/other"), &hello, &["seg-1"]).err(),
            Some(Refusal::OtherKey),
            "another protocol's handshake"
        );
        let e = pair(&a, &a, "seg-1", &["seg-2"]).expect_err("misdirected");
        assert_eq!(
            e,
            (
                "responder",
                Refusal::Misdirected {
                    meant: "seg-1".into(),
                    here: "seg-2".into()
                }
            )
        );
        assert!(
            pair(&a, &a, "alias", &["seg-2", "alias"]).is_ok(),
            "any of the names an endpoint answers to"
        );
        // Mid-change: the initiator opens with the old key, the responder accepts both.
        let (ab, ba) = (
            key(&format!("{}\n{}", "a".repeat(64), "b".repeat(64))),
            key(&format!("{}\n{}", "b".repeat(64), "a".repeat(64))),
        );
        assert!(pair(&ab, &ba, "s", &["s"]).is_ok());
        assert!(pair(&ba, &ab, "s", &["s"]).is_ok());
        assert!(
            pair(&ab, &b, "s", &["s"]).is_err(),
            "a host that dropped the old key too early"
        );
        // Sizes.
        assert_eq!(
            answer(&a, P, &[0; 10], &["s"]).err(),
            Some(Refusal::HelloSize(10))
        );
        assert_eq!(
            answer(&a, P, &vec![0; MAX_HELLO_LEN + 1], &["s"]).err(),
            Some(Refusal::HelloSize(MAX_HELLO_LEN + 1))
        );
        assert_eq!(
            Initiator::new(&a, P, &"x".repeat(MAX_IDENTITY + 1)).err(),
            Some(Refusal::IdentityTooLong(MAX_IDENTITY + 1))
        );
        let (i, _) = Initiator::new(&a, P, "s").unwrap();
        assert_eq!(i.finish(&[0; 5]).err(), Some(Refusal::AnswerSize(5)));
    }

    /// What a keyless host that sees the messages can do: replay an opening message (it gets
    /// an answer, but no frame it sends opens), reflect a side's message back to it, or
    /// inject, replay, reorder, splice or alter frames: nothing opens.
    #[test]
    fn replayed_reflected_or_altered_messages_never_open() {
        let k = key(&"k".repeat(64));
        let (init, hello) = Initiator::new(&k, P, "s").unwrap();
        let (r1, ans) = answer(&k, P, &hello, &["s"]).unwrap();
        // A replay of the opening message is answered (nothing in it is fresh from the
        // responder) but the replayer holds no session: its frames, even the real initiator's
        // first frame replayed onto the replayed connection, do not open.
        let (r2, _) = answer(&k, P, &hello, &["s"]).unwrap();
        let i = init.finish(&ans).unwrap();
        let (mut is, _) = i.split();
        let mut f1 = Vec::new();
        is.seal_frame(b"write 4096 bytes at 0x1000", &mut f1);
        let (_, mut r2o) = r2.split();
        assert_eq!(
            r2o.open_frame_head(f1[..FRAME_HEAD_LEN].try_into().unwrap(), 1 << 20),
            Err(Refusal::Frame),
            "a frame of one connection on another"
        );
        let (_, mut r1o) = r1.split();
        let mut f2 = Vec::new();
        is.seal_frame(b"second", &mut f2);
        assert_eq!(
            r1o.open_frame_head(f2[..FRAME_HEAD_LEN].try_into().unwrap(), 1 << 20),
            Err(Refusal::Frame),
            "reordered: the second frame first"
        );
        let n = r1o
            .open_frame_head(f1[..FRAME_HEAD_LEN].try_into().unwrap(), 1 << 20)
            .unwrap();
        let mut body = Vec::new();
        r1o.open_frame_body(
            &f1[FRAME_HEAD_LEN..FRAME_HEAD_LEN + frame_body_len(n)],
            &mut body,
        )
        .unwrap();
        assert_eq!(body, b"write 4096 bytes at 0x1000");
        assert_eq!(
            r1o.open_frame_head(f1[..FRAME_HEAD_LEN].try_into().unwrap(), 1 << 20),
            Err(Refusal::Frame),
            "replayed on its own connection"
        );
        // (The opener's count is not moved by a refusal: the right frame still opens after.)
        let mut altered = f2.clone();
        altered[FRAME_HEAD_LEN] ^= 1;
        assert!(r1o
            .open_frame_head(altered[..FRAME_HEAD_LEN].try_into().unwrap(), 1 << 20)
            .is_ok());
        assert_eq!(
            r1o.open_frame_body(&altered[FRAME_HEAD_LEN..], &mut body),
            Err(Refusal::Frame),
            "one bit flipped"
        );

        // Reflection: an initiator's own opening message as its answer, or a responder's
        // answer fed to a responder, completes nothing.
        let (init, hello) = Initiator::new(&k, P, "s").unwrap();
        assert!(
            init.finish(&hello[..ANSWER_LEN.min(hello.len())]).is_err(),
            "its own opening message as the answer"
        );
        let (_, ans) = answer(&k, P, &Initiator::new(&k, P, "s").unwrap().1, &["s"]).unwrap();
        assert_eq!(ans.len(), hello_len(0));
        assert_eq!(
            answer(&k, P, &ans, &[""]).err(),
            Some(Refusal::OtherKey),
            "an answer as an opening message"
        );
        // A side's own sealed frame sent back to it does not open (each direction has its key).
        let (i, r) = pair(&k, &k, "s", &["s"]).unwrap();
        let ((mut is, mut io), (_, _r)) = (i.split(), r.split());
        let mut f = Vec::new();
        is.seal(b"mine", &mut f);
        assert_eq!(
            io.open(&f, &mut [0u8; 64]),
            Err(Refusal::Frame),
            "a frame reflected to its sender"
        );
    }

    /// A frame longer than one Noise message goes in several; a head claiming more than the
    /// reader takes is refused before anything else is read.
    #[test]
    fn large_frames_go_in_several_messages_and_their_length_is_bounded_first() {
        let k = key(&"k".repeat(64));
        let (i, r) = pair(&k, &k, "s", &["s"]).unwrap();
        let ((mut is, _), (_, mut ro)) = (i.split(), r.split());
        for len in [
            0usize,
            1,
            MAX_PLAIN - 1,
            MAX_PLAIN,
            MAX_PLAIN + 1,
            3 * MAX_PLAIN + 17,
        ] {
            let body: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut wire = Vec::new();
            is.seal_frame(&body, &mut wire);
            assert_eq!(wire.len(), FRAME_HEAD_LEN + frame_body_len(len));
            let n = ro
                .open_frame_head(wire[..FRAME_HEAD_LEN].try_into().unwrap(), 1 << 20)
                .unwrap();
            let mut got = Vec::new();
            ro.open_frame_body(&wire[FRAME_HEAD_LEN..], &mut got)
                .unwrap();
            assert_eq!((n, got), (len, body));
        }
        let mut wire = Vec::new();
        is.seal_frame(&[0; 100], &mut wire);
        assert_eq!(
            ro.open_frame_head(wire[..FRAME_HEAD_LEN].try_into().unwrap(), 99),
            Err(Refusal::FrameTooLarge(100, 99))
        );
    }

    #[test]
    fn unproved_connections_are_capped_in_total_and_per_source() {
        let u = Unproved::new(3, 2);
        let (a, b, c) = (
            "10.0.0.1".parse().unwrap(),
            "10.0.0.2".parse().unwrap(),
            "10.0.0.3".parse().unwrap(),
        );
        let a1 = u.admit(a).expect("first from a");
        let mut a2 = u.admit(a).expect("second from a");
        assert!(u.admit(a).is_none(), "a third from one source");
        let b1 = u.admit(b).expect("another source");
        assert!(u.admit(c).is_none(), "the total is reached");
        a2.proved();
        assert_eq!(u.counted(a), (2, 1), "a proved connection no longer counts");
        drop(a2);
        assert_eq!(u.counted(a), (2, 1), "nor twice");
        let c1 = u.admit(c).expect("a place freed");
        drop((a1, b1, c1));
        assert_eq!(u.counted(a), (0, 0));
        assert!(
            u.counts.lock().unwrap().1.is_empty(),
            "no address is kept once its places are back"
        );
    }

    #[test]
    fn http_tags_verify_only_under_a_key_held_and_their_own_parts() {
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let k = key(&a);
        let t = k.http_tag(&[b"PUT", b"/metadata?key=x", b"body"]);
        assert!(k.http_verify(&[b"PUT", b"/metadata?key=x", b"body"], &t));
        assert!(!k.http_verify(&[b"PUT", b"/metadata?key=y", b"body"], &t));
        assert!(!k.http_verify(&[b"PUT", b"/metadata?key=x", b"bod"], &t));
        assert!(
            !k.http_verify(&[b"PU", b"T/metadata?key=x", b"body"], &t),
            "parts do not run into each other"
        );
        assert!(!key(&b).http_verify(&[b"PUT", b"/metadata?key=x", b"body"], &t));
        assert!(
            key(&format!("{b}\n{a}")).http_verify(&[b"PUT", b"/metadata?key=x", b"body"], &t),
            "the key being replaced is still accepted"
        );
        assert_ne!(
            k.http_tag(&[b"x"]),
            k.psks[0],
            "HTTP and Noise keys are apart"
        );
    }
}
