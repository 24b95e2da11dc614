//! The hub's invariants, checked by the property tests after every step
//! (`tests.rs`): host slots and their refcounts, each GPU group's ring, and
//! each consumer's window, queue and lag.

use super::{GroupId, View, group};

impl View<'_> {
    /// Checks every structural invariant.
    pub(crate) fn check_invariants(&self) {
        check_slots(self);
        check_groups(self);
        check_consumers(self);
    }
}

/// The ring's own rules; a published slot's refcount is what its host
/// consumers owe plus the copies reading it.
fn check_slots(hub: &View<'_>) {
    super::ring::tests::check(hub.ring);
    for (seq, refs) in super::ring::tests::pins(hub.ring) {
        let owing = hub
            .readers
            .iter()
            .map(|(_, c)| c)
            .filter(|c| c.group.is_none())
            .filter(|c| c.held.contains(&seq) || c.queue.contains(&seq))
            .count() as u32;
        let copying = hub
            .groups
            .iter()
            .filter(|g| group::tests::copying(g, seq))
            .count() as u32;
        assert_eq!(
            refs,
            owing + copying,
            "batch {seq}: refcount {refs} but {owing} host consumers owe it and {copying} groups copy it"
        );
    }
}

/// Each group's ring: free list, replicas, refcounts, copies in order.
fn check_groups(hub: &View<'_>) {
    for (g, grp) in hub.groups.iter().enumerate() {
        let g = g as GroupId;
        let owing = |seq: u64| {
            hub.readers
                .iter()
                .map(|(_, c)| c)
                .filter(|c| c.group == Some(g))
                .filter(|c| c.held.contains(&seq) || c.queue.contains(&seq))
                .count() as u32
        };
        group::tests::check(g, grp, owing, |seq| hub.ring.published(seq).is_some());
    }
}

/// Windows, queues in order, members sent only completed copies, the
/// lag limit.
fn check_consumers(hub: &View<'_>) {
    for c in hub.readers.iter().map(|(_, c)| c) {
        assert!(c.held.len() <= c.ahead as usize, "window exceeded");
        if let Some(g) = c.group.filter(|&g| !hub.groups[g as usize].failed()) {
            let grp = &hub.groups[g as usize];
            for &seq in &c.held {
                assert_eq!(
                    group::tests::replica(grp, seq),
                    Some(true),
                    "member sent batch {seq} before its copy completed"
                );
            }
            for &seq in &c.queue {
                assert!(
                    group::tests::replica(grp, seq).is_some(),
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
    if let Some(limit) = hub.cfg.lag_limit.filter(|_| !hub.exhausted()) {
        // Consumers that may be cut are left to cuts (decoupled pace);
        // one that does not hold the oldest owed batch holds no one.
        let tail = hub.readers.tail(false);
        for (id, lag) in hub.readers.lags(hub.ring.head()) {
            let c = hub.readers.get(id).expect("a listed reader");
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
