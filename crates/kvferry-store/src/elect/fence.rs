//! The leader's fence and its lease renewals as machines without I/O: time is an argument
//! (milliseconds on the caller's monotonic clock), etcd's answers are inputs. The HA layer's gate
//! (`crate::ha::Gate`) wraps a [`Fence`] with a lock and the process's clock; the
//! [`Campaign`](super::Campaign) drives a [`Renewals`] while it leads; the simulator
//! (`crate::sim::election`) drives both against a model of etcd on a fake clock.
//!
//! The rule (the module docs of `super` say why it is safe): a leader answers only while
//! `now < sent + bound` for the last renewal that succeeded, `sent` being when that renewal
//! was sent (etcd counts the lease's TTL from when it handles it, later) and `bound` two
//! thirds of the TTL. A leader found past its bound turns standby at once, and nothing but a
//! new term's leadership makes it a leader again.

use crate::error::StoreError;

/// Whether a master leads or stands by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Leader,
    Standby,
}

/// Whether this master may answer, and whom it names as the leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    role: Role,
    /// The leader's term (the key's create revision); 0 when unknown.
    term: i64,
    /// The leader's address as the key says (ours when leading), "" when unknown.
    leader: String,
    /// Requests are answered only before this time (leaders only).
    valid_until: Option<u64>,
    /// When the last successful renewal was sent.
    last_keepalive: Option<u64>,
    lease_id: i64,
}

impl Default for Fence {
    /// A leader of no term with no bound: what a master without HA has (its gate does not
    /// consult it).
    fn default() -> Self {
        Fence {
            role: Role::Leader,
            term: 0,
            leader: String::new(),
            valid_until: None,
            last_keepalive: None,
            lease_id: 0,
        }
    }
}

impl Fence {
    /// A standby that knows no leader yet.
    pub fn standby() -> Fence {
        Fence {
            role: Role::Standby,
            ..Fence::default()
        }
    }

    fn not_leader(&self) -> StoreError {
        StoreError::NotLeader {
            leader: self.leader.clone(),
        }
    }

    /// Whether a request may be applied at `now`; the leader's term if so. A leader past its
    /// bound turns standby here, at once.
    pub fn admit(&mut self, now: u64) -> Result<i64, StoreError> {
        match (self.role, self.valid_until) {
            (Role::Leader, Some(t)) if now < t => Ok(self.term),
            (Role::Leader, _) => {
                self.role = Role::Standby;
                self.valid_until = None;
                self.leader.clear();
                tracing::warn!(term = self.term, "HA: the lease could not be renewed in time; refusing requests (fenced) and stepping down");
                Err(self.not_leader())
            }
            (Role::Standby, _) => Err(self.not_leader()),
        }
    }

    /// Whether [`Fence::admit`] would admit at `now` (nothing changes).
    pub fn admits(&self, now: u64) -> bool {
        self.role == Role::Leader && self.valid_until.is_some_and(|t| now < t)
    }

    /// Whether the answer of a request admitted under `term` may be sent at `now`: still the
    /// leader of that term, within its bound.
    pub fn confirm(&mut self, term: i64, now: u64) -> Result<(), StoreError> {
        match self.admit(now) {
            Ok(t) if t == term => Ok(()),
            Ok(_) => Err(self.not_leader()),
            Err(e) => Err(e),
        }
    }

    /// Still the leader of `term` at `now`.
    pub fn still_leader(&mut self, term: i64, now: u64) -> bool {
        self.admit(now).is_ok_and(|t| t == term)
    }

    /// Stands by; `view` is the key's leader address and term when it names one.
    pub fn set_standby(&mut self, view: Option<(&str, i64)>) {
        self.role = Role::Standby;
        self.valid_until = None;
        self.last_keepalive = None;
        self.lease_id = 0;
        match view {
            Some((leader, term)) => {
                self.leader = leader.to_string();
                self.term = term;
            }
            None => self.leader.clear(),
        }
    }

    /// Leads `term` (its key created with `lease_id`), a renewal sent at `sent` proven:
    /// answers until `sent + bound`.
    pub fn set_leader(&mut self, term: i64, address: &str, lease_id: i64, sent: u64, bound: u64) {
        *self = Fence {
            role: Role::Leader,
            term,
            leader: address.to_string(),
            valid_until: Some(sent.saturating_add(bound)),
            last_keepalive: Some(sent),
            lease_id,
        };
    }

    /// A renewal sent at `sent` succeeded and the key is still this leader's: it answers
    /// until `sent + bound`. A leader already fenced, or of another term, stays as it is.
    pub fn renewed(&mut self, term: i64, sent: u64, bound: u64) {
        if self.role == Role::Leader && self.term == term {
            self.valid_until = Some(sent.saturating_add(bound));
            self.last_keepalive = Some(sent);
        }
    }

    /// Refuses everything of `term` from `now` on (its journal cannot be written).
    pub fn fence(&mut self, term: i64, now: u64) {
        if self.role == Role::Leader && self.term == term {
            self.valid_until = Some(now);
        }
    }

    pub fn role(&self) -> Role {
        self.role
    }

    pub fn term(&self) -> i64 {
        self.term
    }

    pub fn leader(&self) -> &str {
        &self.leader
    }

    pub fn lease_id(&self) -> i64 {
        self.lease_id
    }

    /// Until when a leader answers, and when its last renewal was sent.
    pub fn bounds(&self) -> (Option<u64>, Option<u64>) {
        (self.valid_until, self.last_keepalive)
    }
}

/// What a renewal found: the lease renewed and the key read back as this leader's creation,
/// the key gone or another's, the lease unknown to etcd, or no answer (an error, a timeout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    Ours,
    KeyLost,
    LeaseLost,
    Failed,
}

/// What the leader does next ([`Renewals::poll`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Nothing before this time (it looks again then: a fence may come sooner).
    Wait(u64),
    /// Send a renewal now (its outcome goes to [`Renewals::on_renewal`] with this time).
    Renew,
    /// It can no longer prove its lease, or lost its key: step down.
    StepDown,
}

/// A leader's renewals: one every `every` ms (a quarter of the TTL), each extending the
/// fence from when it was sent.
#[derive(Debug, Clone)]
pub struct Renewals {
    term: i64,
    every: u64,
    bound: u64,
    next: u64,
}

/// How often a leader waiting for its next renewal looks at its fence (a journal that
/// cannot be written fences it between two renewals).
pub const LOOK_EVERY: u64 = 50;

impl Renewals {
    /// The renewals of the leader of `term`, starting at `now` (its first renewal is due one
    /// period later: leadership was just proven).
    pub fn new(term: i64, every: u64, bound: u64, now: u64) -> Renewals {
        Renewals {
            term,
            every,
            bound,
            next: now.saturating_add(every),
        }
    }

    /// What the leader does at `now`.
    pub fn poll(&mut self, fence: &mut Fence, now: u64) -> Next {
        if !fence.still_leader(self.term, now) {
            return Next::StepDown;
        }
        if now < self.next {
            return Next::Wait(self.next.min(now.saturating_add(LOOK_EVERY)));
        }
        self.next = now.saturating_add(self.every);
        Next::Renew
    }

    /// The renewal sent at `sent` found `outcome`: whether the leader steps down.
    pub fn on_renewal(&mut self, fence: &mut Fence, sent: u64, outcome: Renewal) -> bool {
        match outcome {
            Renewal::Ours => {
                fence.renewed(self.term, sent, self.bound);
                false
            }
            Renewal::KeyLost | Renewal::LeaseLost => true,
            // Tried again at the next period; the fence runs out meanwhile if none succeeds.
            Renewal::Failed => false,
        }
    }
}

/// A won key's renewals while the new leader loads its state ([`Out::TakeOver`] until
/// [`Out::Lead`] or [`Out::StepDown`]): a takeover of a large state outlasts the lease TTL, and
/// with the key's lease gone another master would campaign, with the standby's registration
/// gone (while the in-sync record still names it) a master would start empty. Every `every`
/// ms from the start, each of `leases` is renewed; one that fails is tried again at the next
/// period (the campaign proves the key's lease itself before it serves, [`Campaign`]). The
/// HA layer's elector runs it on a thread of its own beside the load; the simulator
/// (`crate::sim::election`) on its fake clock, with loads longer than the TTL.
///
/// [`Out::TakeOver`]: super::Out::TakeOver
/// [`Out::Lead`]: super::Out::Lead
/// [`Out::StepDown`]: super::Out::StepDown
/// [`Campaign`]: super::Campaign
#[derive(Debug, Clone)]
pub struct TakeoverRenewals {
    leases: Vec<i64>,
    every: u64,
    next: u64,
}

/// What [`TakeoverRenewals::poll`] says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keep {
    /// Nothing before this time.
    Wait(u64),
    /// Renew these leases now.
    Renew(Vec<i64>),
}

impl TakeoverRenewals {
    /// Renewals of `leases` every `every` ms, the first one period after `now` (the key's
    /// lease was just granted).
    pub fn new(leases: &[i64], every: u64, now: u64) -> TakeoverRenewals {
        TakeoverRenewals {
            leases: leases.to_vec(),
            every,
            next: now.saturating_add(every),
        }
    }

    /// What to do at `now`.
    pub fn poll(&mut self, now: u64) -> Keep {
        if now < self.next {
            return Keep::Wait(self.next);
        }
        self.next = now.saturating_add(self.every);
        Keep::Renew(self.leases.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_admits_only_a_leader_within_its_bound() {
        let mut f = Fence::standby();
        assert_eq!(
            f.admit(0),
            Err(StoreError::NotLeader {
                leader: String::new()
            })
        );
        f.set_standby(Some(("10.0.0.1:50051", 7)));
        assert_eq!(
            f.admit(0),
            Err(StoreError::NotLeader {
                leader: "10.0.0.1:50051".into()
            })
        );
        f.set_leader(9, "10.0.0.2:50051", 5, 1_000, 80);
        assert!(f.admits(1_079) && !f.admits(1_080));
        assert_eq!(f.admit(1_000), Ok(9));
        assert_eq!(f.confirm(9, 1_050), Ok(()));
        assert!(
            f.confirm(8, 1_050).is_err(),
            "an answer computed under another term is not sent"
        );
        f.renewed(9, 1_060, 80);
        assert_eq!(f.admit(1_139), Ok(9));
        // Past the bound: refused, and it reads as a standby.
        assert!(f.admit(1_140).is_err());
        assert_eq!(f.role(), Role::Standby);
        // A renewal that comes back late does not revive a fenced leader.
        f.renewed(9, 1_200, 80);
        assert!(f.admit(1_201).is_err());
        // Fenced by its journal: refused from then on.
        f.set_leader(10, "a", 6, 2_000, 80);
        f.fence(10, 2_010);
        assert!(!f.still_leader(10, 2_010));
    }

    #[test]
    fn a_takeover_renews_every_lease_it_needs_every_period_until_it_ends() {
        let mut k = TakeoverRenewals::new(&[7, 9], 1_250, 100);
        assert_eq!(k.poll(100), Keep::Wait(1_350));
        assert_eq!(k.poll(1_349), Keep::Wait(1_350));
        assert_eq!(k.poll(1_350), Keep::Renew(vec![7, 9]));
        assert_eq!(k.poll(1_351), Keep::Wait(2_600));
        // Woken late (a loaded machine): the next one period after this one.
        assert_eq!(k.poll(3_000), Keep::Renew(vec![7, 9]));
        assert_eq!(k.poll(3_000), Keep::Wait(4_250));
    }

    #[test]
    fn renewals_come_every_period_and_a_lost_key_or_lease_steps_down() {
        let mut f = Fence::standby();
        f.set_leader(3, "a", 1, 0, 666);
        let mut r = Renewals::new(3, 250, 666, 0);
        assert_eq!(r.poll(&mut f, 10), Next::Wait(60));
        assert_eq!(r.poll(&mut f, 240), Next::Wait(250));
        assert_eq!(r.poll(&mut f, 250), Next::Renew);
        assert!(!r.on_renewal(&mut f, 250, Renewal::Ours));
        assert!(f.admits(915) && !f.admits(916));
        assert_eq!(r.poll(&mut f, 500), Next::Renew);
        assert!(
            !r.on_renewal(&mut f, 500, Renewal::Failed),
            "a failed renewal is tried again"
        );
        assert!(f.admits(915) && !f.admits(916), "and extends nothing");
        assert_eq!(
            r.poll(&mut f, 916),
            Next::StepDown,
            "past the bound of the last success"
        );
        f.set_leader(4, "a", 2, 1_000, 666);
        let mut r = Renewals::new(4, 250, 666, 1_000);
        assert_eq!(r.poll(&mut f, 1_250), Next::Renew);
        assert!(r.on_renewal(&mut f, 1_250, Renewal::KeyLost));
        assert!(r.on_renewal(&mut f, 1_250, Renewal::LeaseLost));
    }
}
