//! The QPs made for peers that connect to us (passive pairs): which are held, the bounds on
//! them, and which a look for departed peers releases (sans-IO: generic over what a pair holds,
//! so the rules are tested without NICs; the verbs and probes stay in `rdma.rs`).
//!
//! - **Keys**: a pair is (the peer's NIC path `segment@device`, our NIC's index); the peer is
//!   its segment name. Both are what the peer says, so neither is trusted for a resource: a
//!   reconnect of the same pair replaces its QPs, and every QP counts against the bounds.
//! - **Bounds**: at most `per_peer` QPs for one segment name (a peer with up to
//!   [`PEER_NICS`] NICs, each pair with the most QPs we accept) and `total` for all peers
//!   (`KVFERRY_RDMA_MAX_PASSIVE_QPS`). A connection beyond either is refused, naming the bound
//!   ([`Passive::admit`]); a live pair is never evicted to make room (one-sided traffic gives
//!   the passive side no way to tell an idle pair from a busy one).
//! - **Release**: the QPs of a peer found gone, made before the look began
//!   ([`Passive::release`]). Gone ([`gone`]): in P2P mode its segment name is its handshake
//!   address and refuses connections; with a metadata service its entry names a handshake
//!   address that refuses connections, or its entry is absent and either the address it named
//!   before refuses or the entry stayed absent for [`ABSENT_GRACE`] (a live engine whose entries
//!   the service lost puts them back within its keeper's period).

use crate::transport::Published;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// NICs a peer is assumed to have at most (for the per-peer bound): more than any host has.
pub(crate) const PEER_NICS: usize = 16;

/// How long a peer's entry may be absent from the metadata service (with no address known
/// for it) before it counts as gone: well above a keeper's period (a third of the lease).
pub(crate) const ABSENT_GRACE: Duration = Duration::from_secs(30);

struct Pair<Q> {
    made: Instant,
    qps: Vec<Q>,
}

/// What is known of one peer between looks (metadata mode).
#[derive(Default, Clone, Copy)]
struct Seen {
    addr: Option<SocketAddr>,
    absent_since: Option<Instant>,
}

/// The passive pairs of one transport.
pub(super) struct Passive<Q> {
    pairs: HashMap<(String, usize), Pair<Q>>,
    per_peer: usize,
    total: usize,
    /// QPs held, all peers / per segment name.
    held: usize,
    by_peer: HashMap<String, usize>,
    seen: HashMap<String, Seen>,
}

/// The segment name of a NIC path (`segment@device`: the last `@` splits).
fn segment_of(path: &str) -> &str {
    path.rsplit_once('@').map_or(path, |(s, _)| s)
}

impl<Q> Passive<Q> {
    /// Bounds in QPs: `per_peer` for one segment name, `total` for all.
    pub(super) fn new(per_peer: usize, total: usize) -> Passive<Q> {
        Passive {
            pairs: HashMap::new(),
            per_peer: per_peer.max(1),
            total: total.max(1),
            held: 0,
            by_peer: HashMap::new(),
            seen: HashMap::new(),
        }
    }

    /// Whether `n` QPs for pair (`path`, `nic`) fit (those the pair holds now are replaced);
    /// `Err`: the refusal, naming the bound and what to do.
    pub(super) fn admit(&self, path: &str, nic: usize, n: usize) -> Result<(), String> {
        let seg = segment_of(path);
        let replaced = self
            .pairs
            .get(&(path.to_string(), nic))
            .map_or(0, |p| p.qps.len());
        let peer = self.by_peer.get(seg).copied().unwrap_or(0) - replaced + n;
        if peer > self.per_peer {
            return Err(format!(
                "kvferry: too many RDMA connections from {seg}: {peer} QPs would be held for it, at most {} ({PEER_NICS} NICs of a peer to each of ours); its connections' QPs are released when it reconnects them or is gone",
                self.per_peer
            ));
        }
        let all = self.held - replaced + n;
        if all > self.total {
            return Err(format!(
                "kvferry: this engine holds {} QPs for peers that connected to it, at most {} (KVFERRY_RDMA_MAX_PASSIVE_QPS); refused until peers that left are found gone, or raise KVFERRY_RDMA_MAX_PASSIVE_QPS",
                self.held, self.total
            ));
        }
        Ok(())
    }

    /// Installs `qps` for the pair if they fit ([`Passive::admit`]); returns what the pair held
    /// before (to be destroyed outside any lock). `Err` gives `qps` back with the refusal.
    pub(super) fn insert(
        &mut self,
        path: &str,
        nic: usize,
        made: Instant,
        qps: Vec<Q>,
    ) -> Result<Option<Vec<Q>>, (Vec<Q>, String)> {
        if let Err(why) = self.admit(path, nic, qps.len()) {
            return Err((qps, why));
        }
        let seg = segment_of(path).to_string();
        let n = qps.len();
        let old = self
            .pairs
            .insert((path.to_string(), nic), Pair { made, qps });
        let was = old.as_ref().map_or(0, |p| p.qps.len());
        self.held = self.held - was + n;
        *self.by_peer.entry(seg).or_default() += n;
        if let Some(c) = self.by_peer.get_mut(segment_of(path)) {
            *c -= was;
        }
        Ok(old.map(|p| p.qps))
    }

    /// The QPs of the pair, if held.
    pub(super) fn get(&self, path: &str, nic: usize) -> Option<&[Q]> {
        self.pairs
            .get(&(path.to_string(), nic))
            .map(|p| p.qps.as_slice())
    }

    /// Pairs held.
    pub(super) fn pairs(&self) -> usize {
        self.pairs.len()
    }

    /// QPs held.
    pub(super) fn qps(&self) -> usize {
        self.held
    }

    /// The peers (segment names) holding pairs.
    pub(super) fn peers(&self) -> Vec<String> {
        let s: BTreeSet<&str> = self.pairs.keys().map(|(p, _)| segment_of(p)).collect();
        s.into_iter().map(str::to_string).collect()
    }

    /// Removes the pairs of the peers `gone` made before `before` (a pair made since is of a
    /// peer that came back); returns their QPs, to be destroyed outside any lock. What was
    /// known of peers that no longer hold pairs is forgotten.
    pub(super) fn release(&mut self, gone: &HashSet<String>, before: Instant) -> Vec<Vec<Q>> {
        let keys: Vec<(String, usize)> = self
            .pairs
            .iter()
            .filter(|((p, _), pair)| pair.made < before && gone.contains(segment_of(p)))
            .map(|(k, _)| k.clone())
            .collect();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            if let Some(pair) = self.pairs.remove(&k) {
                self.held -= pair.qps.len();
                let seg = segment_of(&k.0);
                if let Some(c) = self.by_peer.get_mut(seg) {
                    *c -= pair.qps.len();
                    if *c == 0 {
                        self.by_peer.remove(seg);
                    }
                }
                out.push(pair.qps);
            }
        }
        let by_peer = &self.by_peer;
        self.seen.retain(|seg, _| by_peer.contains_key(seg));
        out
    }

    /// Metadata mode: the address to probe for peer `seg` given what the service says of it:
    /// the one its entry names, or for an absent entry the one it named before.
    pub(super) fn to_probe(&self, seg: &str, said: Published) -> Option<SocketAddr> {
        match said {
            Published::Listed(a) => a,
            Published::Absent => self.seen.get(seg).and_then(|s| s.addr),
            Published::Unknown => None,
        }
    }

    /// Metadata mode: whether the peer `seg` is gone, given what the service says of it now
    /// (`now`) and `refuses` (whether nothing listens at an address); remembers what it
    /// learns for the next look.
    pub(super) fn judge(
        &mut self,
        seg: &str,
        said: Published,
        now: Instant,
        refuses: impl Fn(SocketAddr) -> bool,
    ) -> bool {
        let seen = self.seen.entry(seg.to_string()).or_default();
        match said {
            Published::Listed(addr) => {
                seen.absent_since = None;
                if addr.is_some() {
                    seen.addr = addr;
                }
                addr.is_some_and(refuses)
            }
            Published::Absent => {
                let since = *seen.absent_since.get_or_insert(now);
                match seen.addr {
                    Some(a) => refuses(a),
                    None => now.duration_since(since) >= ABSENT_GRACE,
                }
            }
            Published::Unknown => false,
        }
    }
}

/// P2P mode: the peers among `peers` (segment names) that are an `ip:port` that `refused`
/// says refuses connections: their engine is gone. Names that are not a socket address are
/// never looked up (no name resolution in a sweep).
pub(super) fn gone_by_address<'a>(
    peers: impl Iterator<Item = &'a str>,
    refused: impl Fn(SocketAddr) -> bool,
) -> HashSet<String> {
    peers
        .filter(|seg| seg.parse::<SocketAddr>().is_ok_and(&refused))
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qps(n: usize) -> Vec<u32> {
        (0..n as u32).collect()
    }

    #[test]
    fn a_peer_and_all_peers_are_bounded_and_a_reconnect_replaces() {
        // 2 QPs a pair; 4 per peer; 6 in all.
        let mut p = Passive::<u32>::new(4, 6);
        let t = Instant::now();
        assert!(p.insert("a:1@mlx5_0", 0, t, qps(2)).unwrap().is_none());
        assert!(p.insert("a:1@mlx5_1", 0, t, qps(2)).unwrap().is_none());
        // The same pair again replaces (its old QPs come back to be destroyed).
        assert_eq!(p.insert("a:1@mlx5_1", 0, t, qps(2)).unwrap(), Some(qps(2)));
        assert_eq!((p.pairs(), p.qps()), (2, 4));
        // A third NIC path of the same peer (a name it chose): over its bound, refused.
        let (back, why) = p.insert("a:1@fake", 0, t, qps(2)).unwrap_err();
        assert_eq!(back.len(), 2, "the QPs come back to be destroyed");
        assert!(why.contains("too many RDMA connections from a:1"), "{why}");
        assert_eq!((p.pairs(), p.qps()), (2, 4), "nothing evicted");
        // Another peer: the total bound.
        p.insert("b:1@mlx5_0", 0, t, qps(2)).unwrap();
        let (_, why) = p.insert("c:1@mlx5_0", 0, t, qps(2)).unwrap_err();
        assert!(why.contains("KVFERRY_RDMA_MAX_PASSIVE_QPS"), "{why}");
        assert_eq!(p.qps(), 6);
        // Replacing one's own pair still fits at the bound.
        assert!(p.admit("b:1@mlx5_0", 0, 2).is_ok());
        assert!(p.get("a:1@mlx5_0", 0).is_some() && p.get("a:1@mlx5_0", 1).is_none());
    }

    #[test]
    fn a_sweep_releases_only_the_gone_peers_pairs_made_before_it() {
        let mut p = Passive::<u32>::new(100, 100);
        let t0 = Instant::now();
        p.insert("10.0.0.1:1@n0", 0, t0, qps(2)).unwrap();
        p.insert("10.0.0.1:1@n1", 1, t0, qps(2)).unwrap();
        p.insert("10.0.0.2:1@n0", 0, t0, qps(2)).unwrap();
        let begun = t0 + Duration::from_millis(10);
        // Reconnected after the look began: kept.
        p.insert("10.0.0.3:1@n0", 0, begun + Duration::from_millis(1), qps(2))
            .unwrap();
        assert_eq!(
            p.peers(),
            ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"].map(String::from)
        );
        let gone: HashSet<String> = ["10.0.0.1:1", "10.0.0.3:1"].map(String::from).into();
        let out = p.release(&gone, begun);
        assert_eq!(out.len(), 2, "both pairs of the gone peer");
        assert_eq!((p.pairs(), p.qps()), (2, 4));
        // Room again for a peer up to its bound.
        assert!(p.admit("10.0.0.1:1@n0", 0, 2).is_ok());
    }

    #[test]
    fn p2p_looks_only_at_addresses() {
        let refused = |a: SocketAddr| a.port() == 1;
        let names = ["10.0.0.1:1", "10.0.0.2:2", "host:1", "x"];
        let gone = gone_by_address(names.into_iter(), refused);
        assert_eq!(gone, ["10.0.0.1:1"].map(String::from).into());
    }

    #[test]
    fn metadata_mode_judges_by_entry_and_address() {
        let mut p = Passive::<u32>::new(10, 10);
        let t = Instant::now();
        let live: SocketAddr = "10.0.0.1:7".parse().unwrap();
        let dead: SocketAddr = "10.0.0.2:7".parse().unwrap();
        let refuses = |a: SocketAddr| a == dead;
        // Listed: gone only if its published address refuses.
        assert!(!p.judge("live", Published::Listed(Some(live)), t, refuses));
        assert!(p.judge("dead", Published::Listed(Some(dead)), t, refuses));
        assert!(!p.judge("named", Published::Listed(None), t, refuses));
        // No answer from the service: never gone.
        assert!(!p.judge("x", Published::Unknown, t, |_| true));
        // Absent, its earlier address answers (entries lost by the service): kept; once its
        // address refuses: gone.
        assert!(!p.judge("live", Published::Absent, t, refuses));
        assert!(p.judge("live", Published::Absent, t, |_| true));
        // Absent with no address ever known: gone once absent for the grace period.
        assert!(!p.judge("anon", Published::Absent, t, refuses));
        assert!(!p.judge("anon", Published::Absent, t + ABSENT_GRACE / 2, refuses));
        // Listed again meanwhile restarts the count.
        assert!(!p.judge(
            "anon",
            Published::Listed(None),
            t + ABSENT_GRACE / 2,
            refuses
        ));
        assert!(!p.judge("anon", Published::Absent, t + ABSENT_GRACE, refuses));
        assert!(p.judge("anon", Published::Absent, t + ABSENT_GRACE * 2, refuses));
    }
}
