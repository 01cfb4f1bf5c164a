//! The leader's decisions about its in-sync set, as pure functions of what it knows of each
//! standby's link: who leaves the set (its link broke, or it has not acknowledged the oldest
//! entry in flight within the bound), who joins it (it acknowledged everything up to the
//! last entry, and its registration names this term's mirror), and whether puts may be
//! granted space ahead. The writer (`crate::ha::journal::Writer`) writes the set to etcd
//! first and then acts; the simulator makes its standbys leave by the same rule.

/// What the leader knows of one standby's link.
#[derive(Debug, Clone, Copy)]
pub struct LinkView {
    /// The link broke.
    pub dead: bool,
    /// The last entry the standby acknowledged.
    pub acked: u64,
    /// The position of the image it was sent when it linked.
    pub image_seq: u64,
    /// It reads grants of space ahead (its registration says so).
    pub grants: bool,
}

/// The members of `insync` that must leave it: no link, a dead one, or one that has not
/// acknowledged `late` (the oldest entry in flight, past the acknowledgement bound).
pub fn failing(
    insync: &[String],
    link: impl Fn(&str) -> Option<LinkView>,
    late: Option<u64>,
) -> Vec<String> {
    insync
        .iter()
        .filter(|m| link(m).is_none_or(|l| l.dead || late.is_some_and(|seq| l.acked < seq)))
        .cloned()
        .collect()
}

/// Whether the standby of `l` may join the set after entry `seq` of `term`: its link is
/// alive, it acknowledged everything up to `seq` (and its image), and its registration names
/// this term's mirror (`mirror`: the term it names), so that it says so in etcd before
/// anyone relies on it.
pub fn ready(l: LinkView, seq: u64, term: i64, mirror: Option<i64>) -> bool {
    !l.dead && l.acked >= seq.max(l.image_seq) && mirror == Some(term)
}

/// Whether puts may be granted space ahead: the set is not empty (the etcd journal alone is
/// read by masters of every version) and every linked standby, and every member, reads
/// grants.
pub fn grants_allowed(
    insync: &[String],
    links: impl IntoIterator<Item = LinkView>,
    member: impl Fn(&str) -> Option<LinkView>,
) -> bool {
    !insync.is_empty()
        && links.into_iter().all(|l| l.grants)
        && insync.iter().all(|m| member(m).is_some_and(|l| l.grants))
}
