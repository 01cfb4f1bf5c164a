//! The optional cluster key (`KVFERRY_AUTH_KEY_FILE`) and the challenge-response that proves
//! knowledge of it, both ways, without sending it.
//!
//! What this is: HMAC-SHA256 (RustCrypto's `hmac` and `sha2`, constant-time comparison) over
//! a label naming the protocol and the side, and the two sides' fresh nonces. Each side sends a
//! random nonce; each answers with a MAC over both nonces under its own label, so a MAC seen on
//! one connection proves nothing on another (its nonces differ) and one side's MAC is never
//! the other side's. What it is not: encryption (the bytes that follow are in the clear), nor a
//! per-message MAC (whoever can take over an established TCP connection is past it). The exchange's
//! two sides are sans-IO ([`Opening`], [`Answering`]): each protocol carries the three
//! messages in its own frames. Used today by the store (`kvferry-store`: a client and the
//! master prove the key to each other before any request, a leader and a standby before any
//! replication) and by the engine (its handshake and TCP data connections; see
//! `docs/ARCHITECTURE.md`, "Authenticated peers").
//!
//! The file holds one or two keys, one per line (blank lines and lines starting with `#` are
//! skipped), each at least [`MIN_KEY_LEN`] bytes (`openssl rand -hex 32` writes one). The first
//! signs; every key is accepted. A key changes in three steps, each on every host before the
//! next: `old` then `new` in the file (still signing with the old key, accepting both), `new`
//! then `old` (signing with the new one), then `new` alone.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::path::{Path, PathBuf};

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 16;
/// Bytes of a MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Shortest key accepted, in bytes.
pub const MIN_KEY_LEN: usize = 32;
/// Most keys a file may hold (the one in use and the one it replaces).
pub const MAX_KEYS: usize = 2;

/// Why a key file cannot be used; each message names the file and the fix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyFileError {
    #[error("KVFERRY_AUTH_KEY_FILE {path}: cannot read it ({why}); point it at a readable file holding the cluster key, or unset it to run without one")]
    Unreadable { path: PathBuf, why: String },
    #[error("KVFERRY_AUTH_KEY_FILE {path}: holds no key; write one per line (e.g. `openssl rand -hex 32`)")]
    Empty { path: PathBuf },
    #[error("KVFERRY_AUTH_KEY_FILE {path}: key {line} is {len} bytes; keys are at least {MIN_KEY_LEN} bytes (e.g. `openssl rand -hex 32`)")]
    TooShort { path: PathBuf, line: usize, len: usize },
    #[error("KVFERRY_AUTH_KEY_FILE {path}: holds {n} keys; at most {MAX_KEYS} (the one in use first, then the one it replaces)")]
    TooMany { path: PathBuf, n: usize },
}

/// The cluster's key(s): the first signs, any verifies.
#[derive(Clone)]
pub struct ClusterKey {
    keys: Vec<Vec<u8>>,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key itself.
        write!(f, "ClusterKey({} key(s))", self.keys.len())
    }
}

impl ClusterKey {
    /// Reads the key file at `path`.
    pub fn load(path: &Path) -> Result<ClusterKey, KeyFileError> {
        let text = std::fs::read(path).map_err(|e| KeyFileError::Unreadable { path: path.to_path_buf(), why: e.to_string() })?;
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
                return Err(KeyFileError::TooShort { path: path.to_path_buf(), line: i + 1, len: line.len() });
            }
            keys.push(line.to_vec());
        }
        match keys.len() {
            0 => Err(KeyFileError::Empty { path: path.to_path_buf() }),
            n if n > MAX_KEYS => Err(KeyFileError::TooMany { path: path.to_path_buf(), n }),
            _ => Ok(ClusterKey { keys }),
        }
    }

    /// The key file named by the configuration, if one is.
    pub fn from_config(path: Option<&Path>) -> Result<Option<ClusterKey>, KeyFileError> {
        path.map(Self::load).transpose()
    }

    fn mac_with(key: &[u8], label: &str, a: &[u8], b: &[u8]) -> Hmac<Sha256> {
        // (HMAC takes a key of any length: this cannot fail.)
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
        // Lengths first: no two (label, a, b) encode alike.
        for part in [label.as_bytes(), a, b] {
            m.update(&(part.len() as u64).to_le_bytes());
            m.update(part);
        }
        m
    }

    /// The MAC under the signing key of `label` and the two nonces.
    fn mac(&self, label: &str, a: &[u8], b: &[u8]) -> [u8; MAC_LEN] {
        Self::mac_with(&self.keys[0], label, a, b).finalize().into_bytes().into()
    }

    /// Whether `tag` is the MAC of `label` and the nonces under one of the keys (compared in
    /// constant time).
    fn verify(&self, label: &str, a: &[u8], b: &[u8], tag: &[u8]) -> bool {
        self.keys.iter().any(|k| Self::mac_with(k, label, a, b).verify_slice(tag).is_ok())
    }

    /// A fresh nonce.
    fn nonce() -> [u8; NONCE_LEN] {
        rand::random()
    }
}

/// One protocol's exchange: the labels of the side that opens it and of the side that
/// answers (each side's MAC is under its own label, so one is never taken for the other).
/// The exchange, whatever carries its three messages: the opener sends its nonce
/// ([`Opening::nonce`]); the answerer sends its nonce and MAC over both
/// ([`Answering::new`]); the opener checks that and sends its own MAC ([`Opening::prove`]);
/// the answerer checks it ([`Answering::check`]).
#[derive(Debug, Clone, Copy)]
pub struct Exchange {
    pub opener: &'static str,
    pub answerer: &'static str,
}

/// Why the other side of an exchange is not let in (the caller says which side and where).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("its nonce is {0} bytes; {NONCE_LEN} expected")]
    Nonce(usize),
    #[error("its MAC is not under this host's cluster key: it holds another key than this host's KVFERRY_AUTH_KEY_FILE (while a key changes, every host must accept both first: the old and the new key in its file)")]
    OtherKey,
}

/// The opening side of an [`Exchange`].
pub struct Opening {
    mine: [u8; NONCE_LEN],
}

impl Default for Opening {
    fn default() -> Self {
        Opening { mine: ClusterKey::nonce() }
    }
}

impl Opening {
    /// The nonce to open with.
    pub fn nonce(&self) -> Vec<u8> {
        self.mine.to_vec()
    }

    /// The answerer's nonce and MAC checked: the proof to send it.
    pub fn prove(&self, key: &ClusterKey, x: Exchange, theirs: &[u8], mac: &[u8]) -> Result<Vec<u8>, Refusal> {
        if !key.verify(x.answerer, &self.mine, theirs, mac) {
            return Err(Refusal::OtherKey);
        }
        Ok(key.mac(x.opener, &self.mine, theirs).to_vec())
    }
}

/// The answering side of an [`Exchange`], once the opener's nonce came.
pub struct Answering {
    theirs: Vec<u8>,
    mine: [u8; NONCE_LEN],
}

impl Answering {
    /// Answers the opener's nonce: this side, and the nonce and MAC to send.
    pub fn new(key: &ClusterKey, x: Exchange, theirs: Vec<u8>) -> Result<(Answering, Vec<u8>, Vec<u8>), Refusal> {
        if theirs.len() != NONCE_LEN {
            return Err(Refusal::Nonce(theirs.len()));
        }
        let mine = ClusterKey::nonce();
        let mac = key.mac(x.answerer, &theirs, &mine).to_vec();
        Ok((Answering { theirs, mine }, mine.to_vec(), mac))
    }

    /// Checks the opener's proof.
    pub fn check(&self, key: &ClusterKey, x: Exchange, proof: &[u8]) -> Result<(), Refusal> {
        if key.verify(x.opener, &self.theirs, &self.mine, proof) {
            Ok(())
        } else {
            Err(Refusal::OtherKey)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(lines: &str) -> ClusterKey {
        ClusterKey::parse(lines.as_bytes(), Path::new("k")).expect("a valid key file")
    }

    #[test]
    fn a_key_file_holds_one_or_two_long_keys_and_says_what_is_wrong_otherwise() {
        let a = "a".repeat(64);
        let b = "b".repeat(32);
        assert_eq!(key(&format!("# the cluster's key\n\n{a}\n")).keys, vec![a.as_bytes().to_vec()]);
        assert_eq!(key(&format!("  {a}  \r\n{b}")).keys.len(), 2, "whitespace around a key is not part of it");
        let err = |t: &str| ClusterKey::parse(t.as_bytes(), Path::new("/etc/k")).expect_err("refused");
        assert_eq!(err("# nothing\n\n"), KeyFileError::Empty { path: "/etc/k".into() });
        assert_eq!(err(&format!("{a}\nshort\n")), KeyFileError::TooShort { path: "/etc/k".into(), line: 2, len: 5 });
        assert_eq!(err(&format!("{a}\n{b}\n{a}")), KeyFileError::TooMany { path: "/etc/k".into(), n: 3 });
        let missing = ClusterKey::load(Path::new("/nonexistent/kvferry-key")).expect_err("no file");
        assert!(missing.to_string().contains("KVFERRY_AUTH_KEY_FILE /nonexistent/kvferry-key") && missing.to_string().contains("unset it"), "{missing}");
        assert!(!format!("{:?}", key(&a)).contains(&a), "Debug never shows the key");
    }

    #[test]
    fn a_mac_verifies_only_under_its_label_nonces_and_a_key_held() {
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let old = key(&a);
        let (cn, sn) = (ClusterKey::nonce(), ClusterKey::nonce());
        assert_ne!(cn, sn, "nonces are random");
        let tag = old.mac("store/client", &cn, &sn);
        assert!(old.verify("store/client", &cn, &sn, &tag));
        assert!(!old.verify("store/master", &cn, &sn, &tag), "one side's MAC is not the other's");
        assert!(!old.verify("store/client", &sn, &cn, &tag), "nor the nonces swapped");
        assert!(!old.verify("store/client", &ClusterKey::nonce(), &sn, &tag), "nor another connection's");
        assert!(!old.verify("store/client", &cn, &sn, &tag[..16]), "nor a truncated MAC");
        let mut flipped = tag;
        flipped[31] ^= 1;
        assert!(!old.verify("store/client", &cn, &sn, &flipped));
        assert!(!key(&b).verify("store/client", &cn, &sn, &tag), "nor under another key");
        // Rotation: a host holding both accepts either; it signs with its first.
        let both = key(&format!("{b}\n{a}"));
        assert!(both.verify("store/client", &cn, &sn, &tag), "the key being replaced is still accepted");
        assert!(old.verify("l", &cn, &sn, &key(&format!("{a}\n{b}")).mac("l", &cn, &sn)), "the first key signs");
        assert!(!old.verify("l", &cn, &sn, &both.mac("l", &cn, &sn)));
        // Parts do not run into each other.
        assert_ne!(old.mac("ab", b"c", b""), old.mac("a", b"bc", b""));
    }

    /// The exchange: both sides holding a key in common let each other in; another key is
    /// refused by whichever side checks first; a proof is good for its own exchange only, and
    /// a nonce must be the right size.
    #[test]
    fn an_exchange_lets_in_only_a_side_holding_a_key_in_common() {
        const X: Exchange = Exchange { opener: "o", answerer: "a" };
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let run = |opener: &ClusterKey, answerer: &ClusterKey| -> Result<(), (&'static str, Refusal)> {
            let o = Opening::default();
            let (ans, nonce, mac) = Answering::new(answerer, X, o.nonce()).map_err(|r| ("answerer", r))?;
            let proof = o.prove(opener, X, &nonce, &mac).map_err(|r| ("opener", r))?;
            ans.check(answerer, X, &proof).map_err(|r| ("answerer", r))
        };
        assert_eq!(run(&key(&a), &key(&a)), Ok(()));
        assert_eq!(run(&key(&a), &key(&b)), Err(("opener", Refusal::OtherKey)), "the opener finds the answerer's MAC under another key");
        // Mid-change: the opener signs with the old key, the answerer accepts both (and signs
        // with the new one, which the opener accepts too).
        assert_eq!(run(&key(&format!("{a}\n{b}")), &key(&format!("{b}\n{a}"))), Ok(()));
        // A proof from another exchange, or of the answerer's label, is refused.
        let k = key(&a);
        let o = Opening::default();
        let (ans, nonce, mac) = Answering::new(&k, X, o.nonce()).expect("answer");
        let other = Opening::default();
        let (_, n2, m2) = Answering::new(&k, X, other.nonce()).expect("answer");
        assert_eq!(ans.check(&k, X, &other.prove(&k, X, &n2, &m2).expect("proof")), Err(Refusal::OtherKey), "another exchange's proof");
        assert_eq!(ans.check(&k, X, &mac), Err(Refusal::OtherKey), "the answerer's own MAC sent back");
        assert!(ans.check(&k, X, &o.prove(&k, X, &nonce, &mac).expect("proof")).is_ok());
        assert_eq!(Answering::new(&k, X, vec![0; 3]).err(), Some(Refusal::Nonce(3)));
    }
}
