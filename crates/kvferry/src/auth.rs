//! The optional cluster key (`KVFERRY_AUTH_KEY_FILE`) and the challenge-response that proves
//! knowledge of it, both ways, without sending it.
//!
//! What this is: HMAC-SHA256 (RustCrypto's `hmac` and `sha2`, constant-time comparison) over
//! a label naming the protocol and the side, and the two sides' fresh nonces. Each side sends a
//! random nonce; each answers with a MAC over both nonces under its own label, so a MAC seen on
//! one connection proves nothing on another (its nonces differ) and one side's MAC is never
//! the other side's. What it is not: encryption (the bytes that follow are in the clear), nor a
//! per-message MAC (whoever can take over an established TCP connection is past it). Used
//! today by the store's RPC (`kvferry-store`: a client and the master prove the key to each
//! other before any request); the engine's handshake and TCP data connections are next
//! (`docs/ARCHITECTURE.md`, "Authenticated peers").
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
    pub fn mac(&self, label: &str, a: &[u8], b: &[u8]) -> [u8; MAC_LEN] {
        Self::mac_with(&self.keys[0], label, a, b).finalize().into_bytes().into()
    }

    /// Whether `tag` is the MAC of `label` and the nonces under one of the keys (compared in
    /// constant time).
    pub fn verify(&self, label: &str, a: &[u8], b: &[u8], tag: &[u8]) -> bool {
        self.keys.iter().any(|k| Self::mac_with(k, label, a, b).verify_slice(tag).is_ok())
    }

    /// A fresh nonce.
    pub fn nonce() -> [u8; NONCE_LEN] {
        rand::random()
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
}
