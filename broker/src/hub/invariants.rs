//! The hub's invariants, checked by the property tests after every step
//! (`tests.rs`): host slots and their refcounts, each GPU group's ring, and
//! each consumer's window, queue and lag.

use super::{GroupId, Hub, SlotId};

impl Hub {
    /// Checks every structural invariant.
    pub(crate) fn check_invariants(&self) {
        self.check_slots();
        self.check_groups();
        self.check_consumers();
    }

    /// The ring's own rules; a published slot's refcount is what its host
    /// consumers owe plus the copies reading it.
    fn check_slots(&self) {
        super::ring::tests::check(&self.ring);
        for (seq, refs) in super::ring::tests::pins(&self.ring) {
            let owing = self
                .consumers
                .values()
                .filter(|c| c.group.is_none())
                .filter(|c| c.held.contains(&seq) || c.queue.contains(&seq))
                .count() as u32;
            let copying = self
                .groups
                .iter()
                .filter(|g| g.replicas.get(&seq).is_some_and(|r| !r.done))
                .count() as u32;
            assert_eq!(
                refs,
                owing + copying,
                "batch {seq}: refcount {refs} but {owing} host consumers owe it and {copying} groups copy it"
            );
        }
    }

    /// Each group's ring: free list, replicas, refcounts, copies in order.
    fn check_groups(&self) {
        for (g, grp) in self.groups.iter().enumerate() {
            let g = g as GroupId;
            let mut seen = vec![false; grp.slots.len()];
            for &s in &grp.free {
                assert_eq!(
                    grp.slots[s as usize], None,
                    "group {g}: free list holds a used slot {s}"
                );
                assert!(
                    !std::mem::replace(&mut seen[s as usize], true),
                    "group {g}: slot {s} freed twice"
                );
            }
            for (i, slot) in grp.slots.iter().enumerate() {
                match slot {
                    None => assert!(
                        seen[i],
                        "group {g}: free slot {i} missing from the free list"
                    ),
                    Some(seq) => assert_eq!(
                        grp.replicas[seq].slot,
                        Some(i as SlotId),
                        "group {g}: slot {i} and batch {seq} disagree"
                    ),
                }
            }
            for (&seq, r) in &grp.replicas {
                let owing = self
                    .consumers
                    .values()
                    .filter(|c| c.group == Some(g))
                    .filter(|c| c.held.contains(&seq) || c.queue.contains(&seq))
                    .count() as u32;
                assert_eq!(
                    r.refs, owing,
                    "group {g}: batch {seq} refcount {} but {owing} members owe it",
                    r.refs
                );
                assert!(
                    r.refs > 0 || (r.slot.is_some() && !r.done),
                    "group {g}: batch {seq} kept for nobody"
                );
                if !r.done {
                    assert!(
                        self.ring.published(seq).is_some(),
                        "group {g}: batch {seq} copied from an unpinned host slot"
                    );
                }
                assert_eq!(
                    r.slot.is_none(),
                    grp.waiting.contains(&seq),
                    "group {g}: batch {seq} both waiting and placed, or neither"
                );
            }
            // Copies are placed in sequence order.
            if let (Some(&first_waiting), Some(last_placed)) = (
                grp.waiting.front(),
                grp.replicas
                    .iter()
                    .filter(|(_, r)| r.slot.is_some())
                    .map(|(&s, _)| s)
                    .max(),
            ) {
                assert!(
                    last_placed < first_waiting,
                    "group {g}: batch {first_waiting} waits behind a later one"
                );
            }
            check_ring(g, grp);
        }
    }

    /// Windows, queues in order, members sent only completed copies, the
    /// lag limit.
    fn check_consumers(&self) {
        for c in self.consumers.values() {
            assert!(c.held.len() <= c.ahead as usize, "window exceeded");
            if let Some(g) = c.group.filter(|&g| !self.groups[g as usize].failed) {
                let grp = &self.groups[g as usize];
                for seq in &c.held {
                    assert!(
                        grp.replicas[seq].done,
                        "member sent batch {seq} before its copy completed"
                    );
                }
                for seq in &c.queue {
                    assert!(
                        grp.replicas.contains_key(seq),
                        "member owes batch {seq} the group lacks"
                    );
                }
            }
            assert!(
                c.queue
                    .iter()
                    .zip(c.queue.iter().skip(1))
                    .all(|(a, b)| a < b),
                "queue out of order"
            );
            if let (Some(&q), Some(&h)) = (c.queue.front(), c.held.iter().max()) {
                assert!(q > h, "queued batch older than a sent one");
            }
            if c.closing() {
                assert!(c.queue.is_empty());
            }
        }
        if let Some(limit) = self.cfg.lag_limit.filter(|_| !self.exhausted()) {
            // Consumers that may be cut are left to cuts (decoupled pace);
            // one that does not hold the oldest owed batch holds no one.
            let tail = self
                .consumers
                .values()
                .filter(|c| !c.closing())
                .filter_map(super::Consumer::oldest_owed)
                .min();
            for (id, lag) in self.lags(self.ring.head()) {
                let c = &self.consumers[&id];
                assert!(
                    lag <= limit as usize + c.slack.allowance
                        || c.cuttable
                        || c.oldest_owed() != tail
                        || tail.is_none(),
                    "lag limit not enforced: consumer {id} lags {lag} holding the oldest batch"
                );
            }
        }
    }
}

/// A group's ring, as the host's: batch `seq` in slot `seq mod slots`,
/// the live ones less than `slots` apart, and a copy waits only while the
/// next would be `slots` ahead of the oldest.
fn check_ring(g: GroupId, grp: &super::Group) {
    let n = grp.slots.len() as u64;
    let placed: Vec<u64> = grp.slots.iter().flatten().copied().collect();
    for (i, slot) in grp.slots.iter().enumerate() {
        if let Some(seq) = slot {
            assert_eq!(seq % n, i as u64, "group {g}: batch {seq} in slot {i}");
        }
    }
    if let (Some(lo), Some(hi)) = (placed.iter().min(), placed.iter().max()) {
        assert!(
            hi - lo < n,
            "group {g}: batches {lo} and {hi} live in a ring of {n}"
        );
    }
    if let Some(&w) = grp.waiting.front() {
        let oldest = placed.iter().min().copied();
        assert!(
            oldest.is_some_and(|o| w >= o + n),
            "group {g}: batch {w} waits with room in the ring (oldest {oldest:?})"
        );
    }
}
