//! The in-sync set as etcd holds it, a standby's registration, and the rules a master reads
//! from them: whether it may lead and from what ([`eligibility`]), and whether it must hand
//! its mirror to etcd before it stops ([`needed_at_stop`]). Pure: the [`Campaign`] and the
//! leader's writer (`crate::ha::journal`) read the values from etcd and ask these.
//!
//! [`Campaign`]: super::Campaign

use serde::{Deserialize, Serialize};

/// The in-sync set as etcd holds it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InSync {
    /// The term of the leader that wrote it (its members' mirrors come from that leader).
    pub term: i64,
    /// Member ids (standbys' RPC addresses).
    pub members: Vec<String>,
}

impl InSync {
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// An absent or empty value is the empty set; anything unreadable is an error (a master
    /// must not guess who may lead).
    pub fn parse(v: &[u8]) -> Result<InSync, String> {
        if v.is_empty() {
            return Ok(InSync::default());
        }
        serde_json::from_slice(v).map_err(|e| format!("the in-sync record is not readable ({e}); delete it only if every master is stopped"))
    }
}

/// The word in a standby's [`registration`] that says it takes `ToStandby::Base` frames.
pub const RUNS: &str = "runs";

/// The word in a standby's [`registration`] that says it reads `Change::Granted` (a leader
/// grants space ahead to puts only while every standby it links says so: one of an earlier
/// version would not decode the entry).
pub const GRANTS: &str = "grants";

/// A standby's registration (the value of its key, `crate::ha::sync::standby_key`): where leaders reach its
/// mirror, then the term of its complete mirror if it has one (`-` if not), then [`RUNS`]
/// (a leader sends `ToStandby::Base` only to a standby that says so: a standby of an
/// earlier version registers without it, and a leader of an earlier version reads the first
/// two words only). A member registered without a
/// complete mirror of the in-sync record's term (restarted since it was named) can never lead
/// from it, so it does not hold the others back ([`eligibility`]'s `alive`), and a leader
/// promotes into the in-sync set only a standby whose registration names its term (so that
/// every member of the record says so in etcd before the leader relies on it).
pub fn registration(addr: &str, mirror: Option<i64>) -> String {
    match mirror {
        Some(term) => format!("{addr} {term} {RUNS} {GRANTS}"),
        None => format!("{addr} - {RUNS} {GRANTS}"),
    }
}

/// A standby's [`registration`], read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration<'a> {
    pub addr: &'a str,
    /// The term of its complete mirror.
    pub mirror: Option<i64>,
    /// It takes `ToStandby::Base` frames.
    pub runs: bool,
    /// It reads `Change::Granted`.
    pub grants: bool,
}

/// The address, mirror term and abilities of a [`registration`] (or of one an earlier
/// version wrote: `addr` or `addr term`).
pub fn parse_registration(v: &str) -> Registration<'_> {
    let mut words = v.split_whitespace();
    let addr = words.next().unwrap_or("");
    let mirror = words.next().and_then(|t| t.parse().ok());
    let rest: Vec<&str> = words.collect();
    Registration {
        addr,
        mirror,
        runs: rest.contains(&RUNS),
        grants: rest.contains(&GRANTS),
    }
}

/// What a master that finds no leader may do, given the in-sync record and its mirror.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Eligibility {
    /// The set is empty: the etcd journal holds everything acknowledged; load it.
    Journal,
    /// This master is a member with a complete mirror of the record's term: lead from it.
    Mirror,
    /// Members are named but none of them is registered with a complete mirror of the
    /// record's term any more (all dead, or restarted without it): lead, starting empty (what
    /// only they held is lost; a stale journal is never served).
    Empty,
    /// Another member is registered with a complete mirror of the record's term: only it may
    /// lead; wait.
    Wait,
}

/// The rule, pure: `me` this master's id, `mirror` the term of its complete mirror (if any),
/// `alive` whether a member is registered with a complete mirror of the record's term.
pub fn eligibility(
    rec: &InSync,
    me: &str,
    mirror: Option<i64>,
    alive: impl Fn(&str) -> bool,
) -> Eligibility {
    if rec.members.is_empty() {
        return Eligibility::Journal;
    }
    if rec.members.iter().any(|m| m == me) && mirror == Some(rec.term) {
        return Eligibility::Mirror;
    }
    if rec.members.iter().any(|m| m != me && alive(m)) {
        return Eligibility::Wait;
    }
    // Members are all gone, or this master is the only one left and its mirror does not
    // match (restarted since it was named): start empty.
    Eligibility::Empty
}

/// Whether a member that is stopping holds what the next leader needs: the record names it,
/// its mirror is complete and of the record's term, and no other member is registered with
/// such a mirror (`alive`). It then leaves its mirror in etcd before it exits (it takes over
/// once the leader's key is gone, and hands off like a leader that stops), unless the record
/// stops naming it first (a leader alive drops it from the set, writing etcd what the set
/// held). Otherwise it may simply go.
pub fn needed_at_stop(
    rec: &InSync,
    me: &str,
    mirror: Option<i64>,
    alive: impl Fn(&str) -> bool,
) -> bool {
    rec.members.iter().any(|m| m == me)
        && mirror == Some(rec.term)
        && !rec.members.iter().any(|m| m != me && alive(m))
}
