//! An in-broker cache of encoded file bytes with CoorDL's MinIO policy:
//! an item, once admitted, is never evicted; when the byte budget is spent
//! the cache simply stops admitting. With a dataset larger than memory, the
//! page cache's LRU evicts every file before its next use (each epoch reads
//! everything again); MinIO keeps a fixed part of the dataset resident, so
//! each epoch reads from storage only what did not fit.
//!
//! The same policy keeps decoded images (`decoded_cache_mib`): a value is
//! anything shared (`Arc`) with its size in bytes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

#[derive(Debug)]
pub struct MinIoCache<V: ?Sized = [u8]> {
    /// Set once more at most, by the self-sizing caches when the stream
    /// starts ([`MinIoCache::set_budget`]).
    budget: AtomicU64,
    used: AtomicU64,
    items: RwLock<HashMap<u64, Arc<V>>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounts {
    pub hits: u64,
    pub misses: u64,
    pub bytes: u64,
    pub items: u64,
    pub budget: u64,
}

impl<V: ?Sized> MinIoCache<V> {
    pub fn new(budget: u64) -> MinIoCache<V> {
        MinIoCache {
            budget: AtomicU64::new(budget),
            used: AtomicU64::new(0),
            items: RwLock::new(HashMap::new()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    pub fn get(&self, index: u64) -> Option<Arc<V>> {
        let hit = self.peek(index);
        let counter = if hit.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        hit
    }

    /// Counts a miss found without [`MinIoCache::get`] (its key was not
    /// known before reading).
    pub fn count_miss(&self) {
        self.misses.fetch_add(1, Ordering::Relaxed);
    }

    /// What the cache holds at `index`, counted neither a hit nor a miss.
    pub fn peek(&self, index: u64) -> Option<Arc<V>> {
        self.items
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&index)
            .cloned()
    }

    /// Admits `value`, `len` bytes, if it fits in what is left of the
    /// budget (`make` is called only then).
    pub(crate) fn offer_with(&self, index: u64, len: u64, make: impl FnOnce() -> Arc<V>) {
        // Reserve first so concurrent offers never overshoot the budget.
        let budget = self.budget();
        let reserved = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                (u + len <= budget).then_some(u + len)
            })
            .is_ok();
        if !reserved {
            return;
        }
        let mut items = self.items.write().unwrap_or_else(|p| p.into_inner());
        if items.insert(index, make()).is_some() {
            // Another thread admitted the same item meanwhile.
            self.used.fetch_sub(len, Ordering::Relaxed);
        }
    }

    /// Whether `len` bytes more would be admitted now (another thread may
    /// take the room first: `offer_with` decides).
    pub fn has_room(&self, len: u64) -> bool {
        self.used.load(Ordering::Relaxed).saturating_add(len) <= self.budget()
    }

    /// The bytes it may hold.
    pub fn budget(&self) -> u64 {
        self.budget.load(Ordering::Relaxed)
    }

    /// Sets the bytes it may hold (a self-sized cache, when its stream
    /// starts). Never below what it holds: nothing is evicted.
    pub fn set_budget(&self, budget: u64) {
        let held = self.used.load(Ordering::Relaxed);
        self.budget.store(budget.max(held), Ordering::Relaxed);
    }

    pub fn counts(&self) -> CacheCounts {
        CacheCounts {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            bytes: self.used.load(Ordering::Relaxed),
            items: self.items.read().unwrap_or_else(|p| p.into_inner()).len() as u64,
            budget: self.budget(),
        }
    }
}

impl MinIoCache<[u8]> {
    /// Admits `bytes` if they fit in what is left of the budget.
    pub(crate) fn offer(&self, index: u64, bytes: &[u8]) {
        self.offer_with(index, bytes.len() as u64, || Arc::from(bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_until_full_and_never_evicts() {
        let c = MinIoCache::<[u8]>::new(10);
        c.offer(1, &[1; 4]);
        c.offer(2, &[2; 4]);
        c.offer(3, &[3; 4]); // does not fit
        c.offer(4, &[4; 2]); // fits exactly
        assert!(c.get(1).is_some() && c.get(2).is_some() && c.get(4).is_some());
        assert!(c.get(3).is_none());
        c.offer(1, &[1; 4]); // already there: no double count
        let n = c.counts();
        assert_eq!((n.hits, n.misses, n.bytes, n.items), (3, 1, 10, 3));
    }
}
