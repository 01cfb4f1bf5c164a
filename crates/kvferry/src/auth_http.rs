//! Requests to kvferry's HTTP surfaces proved with the cluster key (`KVFERRY_AUTH_KEY_FILE`,
//! [`crate::auth`]): what a client adds to a request, and what a server checks. Sans-IO: the
//! time is an argument ([`now_ms`] reads the clock for callers that have none).
//!
//! A signed request carries one header, [`HEADER`]:
//!
//! ```text
//! X-Kvferry-Auth: v1 <unix time in ms> <nonce: 32 hex digits> <tag: 64 hex digits>
//! ```
//!
//! The tag is `ClusterKey::http_tag` (HMAC-SHA256 under the key derived for HTTP) of the
//! request's method, its path and query as sent on the request line, the timestamp and the
//! nonce as written in the header, and the SHA-256 of its body ([`sign`]). A server takes it
//! ([`Guard::verify`]) when:
//!
//! - the header is well formed ([`Refusal::Missing`], [`Refusal::Malformed`] otherwise);
//! - its timestamp is within `WINDOW_MS` (30 s) of the server's clock, before or after
//!   ([`Refusal::Skewed`]): hosts' clocks must agree that closely (NTP);
//! - its tag is that of this request under a key the server holds, either of the two while a
//!   key changes ([`Refusal::OtherKey`]; compared in constant time);
//! - its nonce was not taken within the window ([`Refusal::Replayed`]): the server remembers
//!   each nonce it took until the request's timestamp leaves the window, at most
//!   `REPLAY_CAPACITY` nonces at once (under 7 MiB, `ReplayCache`); when that many are held,
//!   a new request is refused ([`Refusal::Busy`], 503), never taken by forgetting one. Only
//!   requests whose tag verified are remembered, so a client without the key cannot fill it.
//!
//! What this does not do: hide anything (the request and the answer travel as they are; use
//! `https://` for that), nor tell one server from another of the cluster (the host is not
//! signed: a request captured on its way to one server can be replayed within the window to
//! another that has not seen its nonce and serves the same path).

use crate::auth::ClusterKey;
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashSet};
use std::sync::Mutex;

/// The header a signed request carries (header names are case-insensitive).
pub const HEADER: &str = "X-Kvferry-Auth";
/// The scheme, the header's first word.
pub(crate) const SCHEME: &str = "v1";
/// How far a request's timestamp may be from the server's clock, either way (ms).
pub(crate) const WINDOW_MS: u64 = 30_000;
/// Most nonces a server remembers at once (each for at most twice [`WINDOW_MS`]).
pub(crate) const REPLAY_CAPACITY: usize = 65_536;
/// Bytes of a nonce (written as twice as many hex digits).
pub(crate) const NONCE_LEN: usize = 16;
/// Bytes of a tag (written as twice as many hex digits).
pub(crate) const TAG_LEN: usize = 32;
/// Most digits of a timestamp.
const MAX_TS_DIGITS: usize = 15;
/// Longest header value taken.
pub(crate) const MAX_HEADER_LEN: usize =
    SCHEME.len() + 1 + MAX_TS_DIGITS + 1 + 2 * NONCE_LEN + 1 + 2 * TAG_LEN;

/// What a server tells a client without the key, after the cause.
const FIX: &str = "set KVFERRY_AUTH_KEY_FILE to the cluster's key file where the client runs (kvferry's clients then sign every request); stock Mooncake clients cannot";

/// Why a request is not taken; each message names the cause and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("this server holds the cluster key and the request carries no {HEADER} header proving it: {FIX}")]
    Missing,
    #[error("its {HEADER} header is malformed ({0}); kvferry writes `{SCHEME} <unix ms> <32 hex digits> <64 hex digits>`: {FIX}")]
    Malformed(&'static str),
    #[error("its {HEADER} timestamp is {skew_ms} ms from this server's clock; at most {WINDOW_MS} ms either way is taken: synchronise the clocks of the client and the server (NTP)")]
    Skewed { skew_ms: i128 },
    #[error("its {HEADER} tag is not this request's under this server's cluster key: the client holds another key than this server's KVFERRY_AUTH_KEY_FILE (while a key changes, every host must accept both first: the old and the new key in its file), or the request (method, path, query or body) was altered on the way")]
    OtherKey,
    #[error("its {HEADER} nonce was taken already within the last {WINDOW_MS} ms: a request is taken once (a replay); kvferry's clients send a new nonce with each request")]
    Replayed,
    #[error("this server holds {REPLAY_CAPACITY} nonces of signed requests of the last minute and takes no more until they age out: retry in a few seconds")]
    Busy,
}

impl Refusal {
    /// The HTTP status to answer with: 503 for [`Refusal::Busy`], 401 otherwise.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::Busy => 503,
            _ => 401,
        }
    }
}

/// The time now in milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    bytes
        .iter()
        .flat_map(|b| {
            [
                D[usize::from(b >> 4)] as char,
                D[usize::from(b & 15)] as char,
            ]
        })
        .collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let b = s.as_bytes();
    if b.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (digit(b[2 * i])? << 4) | digit(b[2 * i + 1])?;
    }
    Some(out)
}

fn tag_parts<'a>(
    method: &'a str,
    path_and_query: &'a str,
    ts: &'a str,
    nonce: &'a str,
    body_hash: &'a [u8; 32],
) -> [&'a [u8]; 5] {
    [
        method.as_bytes(),
        path_and_query.as_bytes(),
        ts.as_bytes(),
        nonce.as_bytes(),
        body_hash,
    ]
}

/// The [`HEADER`] value for a request: `method` (`GET`, `PUT`...), `path_and_query` as on the
/// request line (`/metadata?key=mooncake%2Fram%2Fa`), `body` (empty for none), at `now_ms`
/// with `nonce` (random: a server takes a nonce once within the window).
pub fn sign(
    key: &ClusterKey,
    method: &str,
    path_and_query: &str,
    body: &[u8],
    now_ms: u64,
    nonce: [u8; NONCE_LEN],
) -> String {
    let (ts, nonce) = (now_ms.to_string(), hex(&nonce));
    let tag = key.http_tag(&tag_parts(
        method,
        path_and_query,
        &ts,
        &nonce,
        &Sha256::digest(body).into(),
    ));
    format!("{SCHEME} {ts} {nonce} {}", hex(&tag))
}

/// [`sign`] at the time now, with a random nonce.
pub fn sign_now(key: &ClusterKey, method: &str, path_and_query: &str, body: &[u8]) -> String {
    sign(key, method, path_and_query, body, now_ms(), rand::random())
}

/// A header that is well formed and within the window at the time it was parsed
/// ([`Claim::parse`]); its tag not yet checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    ts: u64,
    ts_text: String,
    nonce: [u8; NONCE_LEN],
    nonce_text: String,
    tag: [u8; TAG_LEN],
}

impl Claim {
    /// Parses the header's value (`None`: the request has none) and checks its timestamp
    /// against `now_ms`: what can be refused before the body is read.
    pub fn parse(header: Option<&[u8]>, now_ms: u64) -> Result<Claim, Refusal> {
        let header = header.ok_or(Refusal::Missing)?;
        if header.len() > MAX_HEADER_LEN {
            return Err(Refusal::Malformed("longer than the scheme writes"));
        }
        let text = std::str::from_utf8(header).map_err(|_| Refusal::Malformed("not ASCII"))?;
        let mut words = text.split(' ');
        let (Some(scheme), Some(ts_text), Some(nonce_text), Some(tag_text), None) = (
            words.next(),
            words.next(),
            words.next(),
            words.next(),
            words.next(),
        ) else {
            return Err(Refusal::Malformed(
                "not four words separated by single spaces",
            ));
        };
        if scheme != SCHEME {
            return Err(Refusal::Malformed(
                "an unknown scheme: this server takes v1",
            ));
        }
        if ts_text.is_empty()
            || ts_text.len() > MAX_TS_DIGITS
            || !ts_text.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(Refusal::Malformed(
                "the timestamp is not a number of milliseconds",
            ));
        }
        let ts: u64 = ts_text
            .parse()
            .map_err(|_| Refusal::Malformed("the timestamp is not a number of milliseconds"))?;
        let nonce = unhex::<NONCE_LEN>(nonce_text)
            .ok_or(Refusal::Malformed("the nonce is not 32 hex digits"))?;
        let tag =
            unhex::<TAG_LEN>(tag_text).ok_or(Refusal::Malformed("the tag is not 64 hex digits"))?;
        let skew_ms = i128::from(ts) - i128::from(now_ms);
        if skew_ms.unsigned_abs() > u128::from(WINDOW_MS) {
            return Err(Refusal::Skewed { skew_ms });
        }
        Ok(Claim {
            ts,
            ts_text: ts_text.to_string(),
            nonce,
            nonce_text: nonce_text.to_string(),
            tag,
        })
    }

    /// Whether the tag is that of this request under one of `key`'s keys.
    pub(crate) fn check_tag(
        &self,
        key: &ClusterKey,
        method: &str,
        path_and_query: &str,
        body: &[u8],
    ) -> Result<(), Refusal> {
        let body_hash: [u8; 32] = Sha256::digest(body).into();
        if key.http_verify(
            &tag_parts(
                method,
                path_and_query,
                &self.ts_text,
                &self.nonce_text,
                &body_hash,
            ),
            &self.tag,
        ) {
            Ok(())
        } else {
            Err(Refusal::OtherKey)
        }
    }

    /// The request's timestamp (ms since the Unix epoch).
    #[cfg(test)]
    pub(crate) fn timestamp_ms(&self) -> u64 {
        self.ts
    }
}

/// The nonces a server took, each until its request's timestamp leaves the window: at most
/// `capacity` at once (under 100 bytes each: a hash set entry and a B-tree entry), a request
/// beyond that refused.
///
/// The clock it goes by never goes back (the latest time it was given), so a nonce forgotten
/// is one whose request the window refuses, even after the system clock was set back.
#[derive(Debug)]
pub(crate) struct ReplayCache {
    capacity: usize,
    seen: HashSet<[u8; NONCE_LEN]>,
    /// (the time a nonce may be forgotten, the nonce), earliest first.
    by_expiry: BTreeSet<(u64, [u8; NONCE_LEN])>,
    latest: u64,
}

impl Default for ReplayCache {
    fn default() -> Self {
        ReplayCache::new(REPLAY_CAPACITY)
    }
}

impl ReplayCache {
    pub(crate) fn new(capacity: usize) -> ReplayCache {
        ReplayCache {
            capacity,
            seen: HashSet::new(),
            by_expiry: BTreeSet::new(),
            latest: 0,
        }
    }

    /// Nonces held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.seen.len()
    }

    /// Takes `claim`'s nonce at `now_ms`, once: refused when it was taken within the window,
    /// when the request is older than the window by this cache's clock, or when the cache is
    /// full of nonces still in their window.
    pub(crate) fn admit(&mut self, claim: &Claim, now_ms: u64) -> Result<(), Refusal> {
        self.latest = self.latest.max(now_ms);
        while let Some(&(expiry, nonce)) = self.by_expiry.first() {
            if expiry >= self.latest {
                break;
            }
            self.by_expiry.pop_first();
            self.seen.remove(&nonce);
        }
        let expiry = claim.ts.saturating_add(WINDOW_MS);
        if expiry < self.latest {
            return Err(Refusal::Skewed {
                skew_ms: i128::from(claim.ts) - i128::from(self.latest),
            });
        }
        if self.seen.contains(&claim.nonce) {
            return Err(Refusal::Replayed);
        }
        if self.seen.len() >= self.capacity {
            return Err(Refusal::Busy);
        }
        self.seen.insert(claim.nonce);
        self.by_expiry.insert((expiry, claim.nonce));
        Ok(())
    }
}

/// A server's check of signed requests: the cluster key and the nonces taken. Shared by the
/// threads that serve (the cache behind a lock).
#[derive(Debug)]
pub struct Guard {
    key: ClusterKey,
    cache: Mutex<ReplayCache>,
}

impl Guard {
    pub fn new(key: ClusterKey) -> Guard {
        Guard::with_capacity(key, REPLAY_CAPACITY)
    }

    pub(crate) fn with_capacity(key: ClusterKey, capacity: usize) -> Guard {
        Guard {
            key,
            cache: Mutex::new(ReplayCache::new(capacity)),
        }
    }

    /// What can be checked before the body is read: the header's form and its timestamp.
    pub fn precheck(&self, header: Option<&[u8]>, now_ms: u64) -> Result<Claim, Refusal> {
        Claim::parse(header, now_ms)
    }

    /// The rest, once the body is read: the tag, then the nonce (remembered only once the tag
    /// verified).
    pub fn check(
        &self,
        claim: &Claim,
        method: &str,
        path_and_query: &str,
        body: &[u8],
        now_ms: u64,
    ) -> Result<(), Refusal> {
        claim.check_tag(&self.key, method, path_and_query, body)?;
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .admit(claim, now_ms)
    }

    /// The whole check of one request ([`Guard::precheck`] then [`Guard::check`]).
    pub fn verify(
        &self,
        method: &str,
        path_and_query: &str,
        header: Option<&[u8]>,
        body: &[u8],
        now_ms: u64,
    ) -> Result<(), Refusal> {
        let claim = self.precheck(header, now_ms)?;
        self.check(&claim, method, path_and_query, body, now_ms)
    }

    /// Nonces held now.
    #[cfg(test)]
    pub(crate) fn remembered(&self) -> usize {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn key(lines: &str) -> ClusterKey {
        ClusterKey::parse(lines.as_bytes(), Path::new("k")).expect("a valid key file")
    }

    const T: u64 = 1_700_000_000_000;
    const PQ: &str = "/metadata?key=mooncake%2Fram%2Fa";

    fn nonce(i: u8) -> [u8; NONCE_LEN] {
        [i; NONCE_LEN]
    }

    #[test]
    fn a_signed_request_is_taken_once_and_only_as_it_was_signed() {
        let k = key(&"a".repeat(64));
        let g = Guard::new(k.clone());
        let h = sign(&k, "PUT", PQ, b"{\"v\":1}", T, nonce(1));
        assert!(
            h.starts_with("v1 1700000000000 01010101010101010101010101010101 "),
            "{h}"
        );
        assert_eq!(h.len(), MAX_HEADER_LEN - (MAX_TS_DIGITS - 13));
        assert_eq!(
            g.verify("PUT", PQ, Some(h.as_bytes()), b"{\"v\":1}", T + 5),
            Ok(())
        );
        assert_eq!(
            g.verify("PUT", PQ, Some(h.as_bytes()), b"{\"v\":1}", T + 6),
            Err(Refusal::Replayed),
            "the same header and body again"
        );
        // Anything altered: another method, path, query or body.
        let fresh = |i| sign(&k, "PUT", PQ, b"{\"v\":1}", T, nonce(i));
        assert_eq!(
            g.verify("DELETE", PQ, Some(fresh(2).as_bytes()), b"{\"v\":1}", T),
            Err(Refusal::OtherKey)
        );
        assert_eq!(
            g.verify(
                "PUT",
                "/metadata?key=mooncake%2Fram%2Fb",
                Some(fresh(3).as_bytes()),
                b"{\"v\":1}",
                T
            ),
            Err(Refusal::OtherKey)
        );
        assert_eq!(
            g.verify("PUT", PQ, Some(fresh(4).as_bytes()), b"{\"v\":2}", T),
            Err(Refusal::OtherKey)
        );
        assert_eq!(
            g.verify("PUT", PQ, Some(fresh(5).as_bytes()), b"", T),
            Err(Refusal::OtherKey)
        );
        // A timestamp or nonce changed in the header breaks the tag.
        let h6 = fresh(6);
        let moved = h6.replacen("1700000000000", "1700000000001", 1);
        assert_eq!(
            g.verify("PUT", PQ, Some(moved.as_bytes()), b"{\"v\":1}", T),
            Err(Refusal::OtherKey)
        );
        let other_nonce = h6.replacen("0606", "0607", 1);
        assert_eq!(
            g.verify("PUT", PQ, Some(other_nonce.as_bytes()), b"{\"v\":1}", T),
            Err(Refusal::OtherKey)
        );
        // Refusals of a bad tag are not remembered: the genuine request still goes through.
        assert_eq!(g.remembered(), 1);
        assert_eq!(
            g.verify("PUT", PQ, Some(h6.as_bytes()), b"{\"v\":1}", T),
            Ok(())
        );
        assert_eq!(g.remembered(), 2);
    }

    #[test]
    fn another_key_is_refused_and_either_key_is_taken_while_one_changes() {
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let g = Guard::new(key(&a));
        let h = sign(&key(&b), "GET", "/query_key?key=x", b"", T, nonce(1));
        assert_eq!(
            g.verify("GET", "/query_key?key=x", Some(h.as_bytes()), b"", T),
            Err(Refusal::OtherKey)
        );
        assert_eq!(g.remembered(), 0);
        // Mid-change: a server holding `new, old` takes requests signed with either; a client
        // holding `old, new` signs with the old one.
        let mid = Guard::new(key(&format!("{b}\n{a}")));
        let by_old = sign(&key(&format!("{a}\n{b}")), "GET", "/x", b"", T, nonce(2));
        let by_new = sign(&key(&b), "GET", "/x", b"", T, nonce(3));
        assert_eq!(
            mid.verify("GET", "/x", Some(by_old.as_bytes()), b"", T),
            Ok(())
        );
        assert_eq!(
            mid.verify("GET", "/x", Some(by_new.as_bytes()), b"", T),
            Ok(())
        );
        assert_eq!(
            Guard::new(key(&b)).verify("GET", "/x", Some(by_old.as_bytes()), b"", T),
            Err(Refusal::OtherKey),
            "a server that dropped the old key too early"
        );
    }

    #[test]
    fn a_timestamp_outside_the_window_either_way_is_refused() {
        let k = key(&"a".repeat(64));
        let g = Guard::new(k.clone());
        let at = |ts: u64, i: u8| sign(&k, "GET", "/x", b"", ts, nonce(i));
        assert_eq!(
            g.verify("GET", "/x", Some(at(T - WINDOW_MS, 1).as_bytes()), b"", T),
            Ok(()),
            "the window's edge, past"
        );
        assert_eq!(
            g.verify("GET", "/x", Some(at(T + WINDOW_MS, 2).as_bytes()), b"", T),
            Ok(()),
            "the window's edge, future"
        );
        let stale = g
            .verify(
                "GET",
                "/x",
                Some(at(T - WINDOW_MS - 1, 3).as_bytes()),
                b"",
                T,
            )
            .unwrap_err();
        assert_eq!(
            stale,
            Refusal::Skewed {
                skew_ms: -(WINDOW_MS as i128) - 1
            }
        );
        assert!(
            stale.to_string().contains("NTP") && stale.to_string().contains("30000 ms"),
            "{stale}"
        );
        assert_eq!(
            g.verify(
                "GET",
                "/x",
                Some(at(T + WINDOW_MS + 1, 4).as_bytes()),
                b"",
                T
            ),
            Err(Refusal::Skewed {
                skew_ms: WINDOW_MS as i128 + 1
            })
        );
        assert_eq!(
            g.verify("GET", "/x", Some(at(0, 5).as_bytes()), b"", T)
                .map_err(|e| e.status()),
            Err(401)
        );
    }

    #[test]
    fn a_nonce_is_remembered_until_its_request_leaves_the_window_even_if_the_clock_goes_back() {
        let k = key(&"a".repeat(64));
        let mut c = ReplayCache::new(8);
        let claim = |ts: u64, i: u8, now: u64| {
            Claim::parse(
                Some(sign(&k, "GET", "/x", b"", ts, nonce(i)).as_bytes()),
                now,
            )
            .expect("well formed, in the window")
        };
        let one = claim(T, 1, T);
        assert_eq!(c.admit(&one, T), Ok(()));
        assert_eq!(
            c.admit(&one, T + WINDOW_MS),
            Err(Refusal::Replayed),
            "to the window's last ms"
        );
        // Past the window the nonce is forgotten, and the request is stale.
        let two = claim(T + 2 * WINDOW_MS, 2, T + 2 * WINDOW_MS);
        assert_eq!(c.admit(&two, T + 2 * WINDOW_MS), Ok(()));
        assert_eq!(c.len(), 1, "the first nonce aged out");
        assert!(Claim::parse(
            Some(sign(&k, "GET", "/x", b"", T, nonce(1)).as_bytes()),
            T + WINDOW_MS + 1
        )
        .is_err());
        // The system clock set back: the cache goes by the latest time it saw, so the first
        // request (whose nonce it forgot) is still refused.
        assert!(matches!(c.admit(&one, T), Err(Refusal::Skewed { .. })));
    }

    #[test]
    fn a_full_cache_refuses_new_requests_rather_than_forget_a_nonce() {
        let k = key(&"a".repeat(64));
        let g = Guard::with_capacity(k.clone(), 3);
        for i in 0..3 {
            assert_eq!(
                g.verify(
                    "GET",
                    "/x",
                    Some(sign(&k, "GET", "/x", b"", T, nonce(i)).as_bytes()),
                    b"",
                    T
                ),
                Ok(())
            );
        }
        let next = sign(&k, "GET", "/x", b"", T, nonce(9));
        let busy = g
            .verify("GET", "/x", Some(next.as_bytes()), b"", T)
            .unwrap_err();
        assert_eq!((busy.clone(), busy.status()), (Refusal::Busy, 503));
        for i in 0..3 {
            assert_eq!(
                g.verify(
                    "GET",
                    "/x",
                    Some(sign(&k, "GET", "/x", b"", T, nonce(i)).as_bytes()),
                    b"",
                    T + 1
                ),
                Err(Refusal::Replayed),
                "none was forgotten"
            );
        }
        // Once the first ones left the window, room again.
        let later = sign(&k, "GET", "/x", b"", T + WINDOW_MS + 1, nonce(9));
        assert_eq!(
            g.verify("GET", "/x", Some(later.as_bytes()), b"", T + WINDOW_MS + 1),
            Ok(())
        );
        assert_eq!(g.remembered(), 1);
    }

    #[test]
    fn malformed_headers_are_refused_saying_what_is_wrong() {
        let k = key(&"a".repeat(64));
        let good = sign(&k, "GET", "/x", b"", T, nonce(1));
        let parse = |h: &str| Claim::parse(Some(h.as_bytes()), T);
        assert_eq!(Claim::parse(None, T), Err(Refusal::Missing));
        let missing = Refusal::Missing.to_string();
        assert!(
            missing.contains("KVFERRY_AUTH_KEY_FILE") && missing.contains("Mooncake"),
            "{missing}"
        );
        let words: Vec<&str> = good.split(' ').collect();
        let cases = [
            String::new(),
            "v1".into(),
            format!("v2 {} {} {}", words[1], words[2], words[3]),
            format!("v1  {} {} {}", words[1], words[2], words[3]),
            format!("v1 {} {} {} extra", words[1], words[2], words[3]),
            format!("v1 -{} {} {}", words[1], words[2], words[3]),
            format!("v1 1e3 {} {}", words[2], words[3]),
            format!("v1 {} {} {}", "9".repeat(16), words[2], words[3]),
            format!("v1 {} {} {}", words[1], &words[2][1..], words[3]),
            format!("v1 {} {}zz {}", words[1], &words[2][2..], words[3]),
            format!("v1 {} {} {}", words[1], words[2], &words[3][2..]),
            format!("v1 {} {} {}0", words[1], words[2], words[3]),
            "x".repeat(10_000),
        ];
        for h in &cases {
            let e = parse(h).expect_err(h);
            assert!(matches!(e, Refusal::Malformed(_)), "{h:?}: {e:?}");
            assert!(e.to_string().contains("v1 <unix ms>"), "{e}");
        }
        assert!(matches!(
            Claim::parse(Some(&[0xff, 0xfe]), T),
            Err(Refusal::Malformed(_))
        ));
        // Upper-case hex is the same nonce and tag.
        let upper = format!(
            "v1 {} {} {}",
            words[1],
            words[2].to_uppercase(),
            words[3].to_uppercase()
        );
        assert_eq!(
            parse(&upper).map(|c| c.nonce),
            parse(&good).map(|c| c.nonce)
        );
        assert_eq!(parse(&good).map(|c| c.timestamp_ms()), Ok(T));
    }
}
