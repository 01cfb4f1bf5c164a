//! The model of etcd the election simulator's masters campaign in: revisions, leases with their
//! TTL (and when etcd last said each expires, kept across a wipe), create-if-absent guarded
//! transactions, the journal's term marker, the in-sync record, the standbys' registrations
//! under leases of their own, and the objects the journal holds (a count).

use super::{INSYNC, KEY, STANDBY, TTL};
use crate::elect::insync::{parse_registration, registration, InSync};
use kvferry::metadata::etcd::{Cond, Created, KeyValue, Owner};
use std::cell::RefCell;
use std::collections::BTreeMap;

/// etcd, as far as the election sees it.
#[derive(Default)]
pub(super) struct Etcd {
    pub(super) rev: i64,
    pub(super) key: Option<KeyValue>,
    /// lease -> when it expires
    pub(super) leases: BTreeMap<i64, u64>,
    pub(super) next_lease: i64,
    /// The last leader that marked the journal.
    pub(super) marker: Option<Owner>,
    /// The in-sync record.
    pub(super) insync: Option<KeyValue>,
    /// The standbys' registrations (member -> value, under a lease of its own).
    pub(super) regs: BTreeMap<String, KeyValue>,
    /// The objects the etcd journal holds (the state's size, abstracted to a count).
    pub(super) objects: u64,
    /// lease -> when it expires as etcd last said (granted or renewed), kept when a lease is
    /// revoked or etcd loses its data: what a leader's fence is checked against.
    pub(super) ledger: BTreeMap<i64, u64>,
}

impl Etcd {
    pub(super) fn expire(&mut self, now: u64) {
        self.leases.retain(|_, &mut at| at > now);
        let leases = &self.leases;
        self.regs.retain(|_, kv| leases.contains_key(&kv.lease));
        if self
            .key
            .as_ref()
            .is_some_and(|k| !self.leases.contains_key(&k.lease))
        {
            self.key = None;
            self.rev += 1;
        }
    }

    /// A takeover's load: the leader the journal names, and this one's mark, if the key is
    /// still `owner`'s (the marker is written in a transaction guarded by the key). The new
    /// leader's state is then whole in the journal: the in-sync set is emptied.
    pub(super) fn mark(&mut self, owner: Owner, now: u64) -> Result<Option<Owner>, String> {
        self.expire(now);
        match &self.key {
            Some(kv) if owner.holds(kv) => {
                self.set_insync(&InSync {
                    term: owner.create_revision,
                    members: Vec::new(),
                });
                Ok(self.marker.replace(owner))
            }
            _ => Err("the key is no longer this master's".into()),
        }
    }

    pub(super) fn set_insync(&mut self, rec: &InSync) {
        self.rev += 1;
        let rev = self.rev;
        self.insync = Some(KeyValue {
            value: rec.to_bytes(),
            create_revision: self.insync.as_ref().map_or(rev, |k| k.create_revision),
            mod_revision: rev,
            lease: 0,
        });
    }

    pub(super) fn record(&self) -> InSync {
        self.insync
            .as_ref()
            .and_then(|kv| InSync::parse(&kv.value).ok())
            .unwrap_or_default()
    }

    /// The mirror term member `m`'s registration names.
    pub(super) fn registered(&self, m: &str) -> Option<i64> {
        let kv = self.regs.get(m)?;
        parse_registration(&String::from_utf8_lossy(&kv.value)).mirror
    }

    /// A standby keeps its registration: written when it changes (under a new lease), its
    /// lease renewed.
    pub(super) fn register(&mut self, m: &str, mirror: Option<i64>, now: u64) {
        self.expire(now);
        let value = registration(m, mirror).into_bytes();
        match self.regs.get(m) {
            Some(kv) if kv.value == value => {
                self.leases.insert(kv.lease, now + TTL);
            }
            _ => {
                let lease = self.grant(now);
                self.rev += 1;
                let rev = self.rev;
                self.regs.insert(
                    m.to_string(),
                    KeyValue {
                        value,
                        create_revision: rev,
                        mod_revision: rev,
                        lease,
                    },
                );
            }
        }
    }

    pub(super) fn grant(&mut self, now: u64) -> i64 {
        self.next_lease += 1;
        let lease = self.next_lease;
        self.leases.insert(lease, now + TTL);
        self.ledger.insert(lease, now + TTL);
        lease
    }

    /// Renews `lease`: whether etcd still knew it.
    pub(super) fn keepalive(&mut self, lease: i64, now: u64) -> bool {
        self.expire(now);
        match self.leases.get_mut(&lease) {
            Some(at) => {
                *at = now + TTL;
                self.ledger.insert(lease, now + TTL);
                true
            }
            None => false,
        }
    }
}

/// The model at one time, as the campaign's [`crate::elect::Etcd`].
pub(super) struct At<'a> {
    pub(super) etcd: RefCell<&'a mut Etcd>,
    pub(super) won: RefCell<&'a mut Won>,
    pub(super) now: u64,
}

/// At each successful campaign (by term and lease): the in-sync record and its members
/// registered with a mirror of its term, as the transaction saw them (kept outside etcd: a
/// wipe does not undo what a master won).
pub(super) type Won = BTreeMap<(i64, i64), (InSync, Vec<String>)>;

impl crate::elect::Etcd for At<'_> {
    fn get(&self, key: &str) -> Result<Option<KeyValue>, String> {
        let mut e = self.etcd.borrow_mut();
        e.expire(self.now);
        Ok(match key {
            KEY => e.key.clone(),
            INSYNC => e.insync.clone(),
            _ => None,
        })
    }

    fn range(&self, prefix: &str) -> Result<Vec<(String, KeyValue)>, String> {
        let mut e = self.etcd.borrow_mut();
        e.expire(self.now);
        Ok(e.regs
            .iter()
            .map(|(m, kv)| (format!("{STANDBY}{m}"), kv.clone()))
            .filter(|(k, _)| k.starts_with(prefix))
            .collect())
    }

    fn lease_grant(&self, _ttl_secs: i64) -> Result<i64, String> {
        Ok(self.etcd.borrow_mut().grant(self.now))
    }

    fn create_when(
        &self,
        key: &str,
        value: &[u8],
        lease: i64,
        conds: &[Cond],
    ) -> Result<Created, String> {
        let mut e = self.etcd.borrow_mut();
        e.expire(self.now);
        if !e.leases.contains_key(&lease) {
            return Err("etcdserver: requested lease not found".into());
        }
        if e.key.is_some() {
            return Ok(Created::Lost(e.key.clone()));
        }
        let mod_rev = |k: &str| match k {
            INSYNC => e.insync.as_ref().map_or(0, |kv| kv.mod_revision),
            _ => k
                .strip_prefix(STANDBY)
                .and_then(|m| e.regs.get(m))
                .map_or(0, |r| r.mod_revision),
        };
        let holds = conds.iter().all(|c| match c {
            Cond::ModRevision(k, rev) => mod_rev(k) == *rev,
            Cond::Absent(k) => mod_rev(k) == 0,
        });
        if !holds || key != KEY {
            return Ok(Created::Lost(None));
        }
        // What the campaign's rules were checked against, as the transaction saw it.
        let rec = e.record();
        let alive: Vec<String> = rec
            .members
            .iter()
            .filter(|m| e.registered(m) == Some(rec.term))
            .cloned()
            .collect();
        let won = (e.rev + 1, lease);
        self.won.borrow_mut().insert(won, (rec, alive));
        e.rev += 1;
        e.key = Some(KeyValue {
            value: value.to_vec(),
            create_revision: e.rev,
            mod_revision: e.rev,
            lease,
        });
        Ok(Created::Won(e.rev))
    }

    fn lease_keepalive(&self, lease: i64) -> Result<bool, String> {
        Ok(self.etcd.borrow_mut().keepalive(lease, self.now))
    }

    fn lease_alive(&self, lease: i64) -> Result<bool, String> {
        let mut e = self.etcd.borrow_mut();
        e.expire(self.now);
        Ok(e.leases.contains_key(&lease))
    }

    fn delete_if_owned(&self, _key: &str, owner: Owner) -> Result<(), String> {
        let mut e = self.etcd.borrow_mut();
        if e.key.as_ref().is_some_and(|kv| owner.holds(kv)) {
            e.key = None;
            e.rev += 1;
        }
        Ok(())
    }

    fn lease_revoke(&self, lease: i64) -> Result<(), String> {
        let mut e = self.etcd.borrow_mut();
        e.leases.remove(&lease);
        e.expire(self.now);
        Ok(())
    }
}
