//! A hash map keyed by strings, in [`SHARDS`] shards (`hashbrown::HashTable`s found by one hash
//! of the key): the master's objects and a standby's mirror of them. One hash map grows by
//! doubling (or rehashes in place when removals' tombstones used up its room), and that
//! insert moves every entry at once: in the master, 0.47-1.76 s with the state's lock held
//! (every request waiting) at 1.8 M objects, 1.94 s for the rehash under churn at that size;
//! in a standby's mirror of a million objects 0.6-1.0 s without an acknowledgement, and past a
//! quarter of the fence bound the standby left the in-sync set. A shard moves a 64th of that
//! at a time: the longest step while filling or churning either is 3-53 ms (`cargo run
//! --release -p kvferry-store --example growth_pause [objects]`).
//!
//! Not an ordered map, nor one that shrinks: nothing may rely on the order of iteration.

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use std::borrow::Borrow;
use std::hash::BuildHasher;

/// Shards per map.
pub const SHARDS: usize = 64;

/// The map: keys `K` (owned strings), values `V`, hashed with `S`.
#[derive(Clone)]
pub struct Shards<K, V, S> {
    tables: Vec<HashTable<(K, V)>>,
    hasher: S,
    len: usize,
}

impl<K, V, S: Default> Default for Shards<K, V, S> {
    fn default() -> Self {
        Shards {
            tables: Vec::new(),
            hasher: S::default(),
            len: 0,
        }
    }
}

impl<K: Borrow<str>, V, S: BuildHasher> Shards<K, V, S> {
    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The shard of hash `h`: bits the tables use neither for the bucket (the low ones) nor
    /// for the tag (the top seven).
    fn shard(h: u64) -> usize {
        (h >> 40) as usize % SHARDS
    }

    fn table(&self, key: &str) -> Option<(u64, &HashTable<(K, V)>)> {
        let h = self.hash(key);
        self.tables.get(Self::shard(h)).map(|t| (h, t))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, key: &str) -> Option<&V> {
        let (h, t) = self.table(key)?;
        t.find(h, |(k, _)| k.borrow() == key).map(|(_, v)| v)
    }

    /// Inserts `value` under `key`; the value it replaced (the key already there is kept).
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        if self.tables.is_empty() {
            self.tables = (0..SHARDS).map(|_| HashTable::new()).collect();
        }
        let h = self.hash(key.borrow());
        let hasher = &self.hasher;
        let t = &mut self.tables[Self::shard(h)];
        match t.entry(
            h,
            |(k, _)| k.borrow() == key.borrow(),
            |(k, _)| hasher.hash_one(k.borrow()),
        ) {
            Entry::Occupied(mut e) => Some(std::mem::replace(&mut e.get_mut().1, value)),
            Entry::Vacant(e) => {
                e.insert((key, value));
                self.len += 1;
                None
            }
        }
    }

    pub fn remove(&mut self, key: &str) -> Option<V> {
        let h = self.hash(key);
        let e = self
            .tables
            .get_mut(Self::shard(h))?
            .find_entry(h, |(k, _)| k.borrow() == key)
            .ok()?;
        self.len -= 1;
        Some(e.remove().0 .1)
    }

    pub fn get_mut(&mut self, key: &str) -> Option<&mut V> {
        let h = self.hash(key);
        self.tables
            .get_mut(Self::shard(h))?
            .find_mut(h, |(k, _)| k.borrow() == key)
            .map(|(_, v)| v)
    }

    /// Keeps the entries for which `keep` returns true (it may change their values), one shard
    /// after another.
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        let mut len = 0;
        for t in &mut self.tables {
            t.retain(|(k, v)| keep(k, v));
            len += t.len();
        }
        self.len = len;
    }

    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.tables
            .iter()
            .flat_map(|t| t.iter().map(|(k, v)| (k, v)))
    }

    /// The entries of shard `i` (`0..SHARDS`; none once `i` is past the last): a walk of the
    /// whole map in [`SHARDS`] steps, each of which may be taken under a lock of its own.
    pub fn shard_entries(&self, i: usize) -> impl Iterator<Item = (&K, &V)> {
        self.tables
            .get(i)
            .into_iter()
            .flat_map(|t| t.iter().map(|(k, v)| (k, v)))
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }
}

impl<K, V, S> IntoIterator for Shards<K, V, S> {
    type Item = (K, V);
    type IntoIter = std::iter::Flatten<std::vec::IntoIter<HashTable<(K, V)>>>;
    fn into_iter(self) -> Self::IntoIter {
        self.tables.into_iter().flatten()
    }
}

impl<K: Borrow<str>, V: PartialEq, S: BuildHasher> PartialEq for Shards<K, V, S> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().all(|(k, v)| other.get(k.borrow()) == Some(v))
    }
}

impl<K: std::fmt::Debug, V: std::fmt::Debug, S> std::fmt::Debug for Shards<K, V, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(
                self.tables
                    .iter()
                    .flat_map(|t| t.iter().map(|(k, v)| (k, v))),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One map in behaviour (insert, replace, remove, equality, iteration), its keys spread
    /// over every shard so that none grows much beyond its share.
    #[test]
    fn a_sharded_map_is_one_map_in_even_shards() {
        let n = 64_000usize;
        let mut m: Shards<Box<str>, usize, std::hash::RandomState> = Shards::default();
        assert!(
            m.is_empty() && m.get("absent").is_none() && m.remove("absent").is_none(),
            "an empty map has no shards yet"
        );
        for i in 0..n {
            assert_eq!(m.insert(format!("key-{i}").into(), i), None);
        }
        assert_eq!(m.insert("key-7".into(), 70), Some(7), "replaced");
        assert_eq!(
            (m.len(), m.get("key-7").copied(), m.get("key-9").copied()),
            (n, Some(70), Some(9))
        );
        assert_eq!(m.remove("key-8"), Some(8));
        assert!(m.remove("key-8").is_none() && m.get("key-8").is_none());
        assert_eq!(m.len(), n - 1);
        let share = n / SHARDS;
        let largest = m.tables.iter().map(HashTable::len).max().unwrap_or(0);
        assert!(
            largest < share * 5 / 4,
            "a shard of {largest}, a share is {share}"
        );
        if let Some(v) = m.get_mut("key-10") {
            *v = 100;
        }
        assert_eq!(m.get("key-10").copied(), Some(100));
        assert!(m.get_mut("absent").is_none());
        // Retain: the keys ending in 3 go (a tenth), the others change.
        let mut back = m.clone();
        back.retain(|k, v| {
            *v += 1;
            !k.ends_with('3')
        });
        let gone = (0..n).filter(|i| i % 10 == 3).count();
        assert_eq!(
            (back.len(), back.iter().count()),
            (n - 1 - gone, n - 1 - gone),
            "its length follows what was kept"
        );
        assert!(back.get("key-13").is_none() && back.get("key-10").copied() == Some(101));
        assert_eq!(back.values().count(), back.keys().count());
        let copy = m.clone();
        assert_eq!(copy, m);
        m.insert("key-9".into(), 90);
        assert_ne!(copy, m, "a value differs");
        assert_eq!(m.iter().count(), n - 1);
        let mut keys: Vec<Box<str>> = m.into_iter().map(|(k, _)| k).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), n - 1);
    }
}
