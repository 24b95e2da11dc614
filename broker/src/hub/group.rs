//! One GPU's ring of copies: which batches it holds or waits to copy,
//! and the members that owe each. Only this type changes them; the hub
//! tells it who owes what and carries out the copies it orders.
//!
//! # Rules
//!
//! * The ring is laid out as the host's: batch `seq` goes to slot
//!   `seq mod slots`, its samples to the cells of its stream position, so a
//!   member's runs of any batch size are spans of it.
//! * Copies are placed in sequence order: a batch waits until every batch
//!   the ring holds is less than `slots` behind it (then its slot is free
//!   too), so live batches never share a cell.
//! * A replica is kept while a member owes it, or while it is being
//!   copied; the host slot it is copied from stays pinned until the copy
//!   completes (or, never placed, until nobody owes it).
//! * A failed group holds nothing and takes nothing more.

use std::collections::{BTreeMap, VecDeque};

use super::{CopyOrder, GroupCounts, GroupId, Published, SlotId};

/// A batch a group owes: its copy and the members that owe it.
#[derive(Debug, Clone, Copy)]
struct Replica {
    batch: Published,
    /// The group slot, once one was free (copies are ordered by sequence).
    slot: Option<SlotId>,
    /// The copy completed: members may be sent it, the host slot is unpinned.
    done: bool,
    /// Members that owe it (queued or sent, not released).
    refs: u32,
}

/// One GPU's ring of copies (see the module's rules).
#[derive(Debug, Clone)]
pub(super) struct Group {
    /// Per group slot: the batch copied (or being copied) there.
    slots: Vec<Option<u64>>,
    free: Vec<SlotId>,
    replicas: BTreeMap<u64, Replica>,
    /// Batches waiting for a free group slot, in sequence order.
    waiting: VecDeque<u64>,
    failed: bool,
}

/// What a member no longer owing a batch leaves to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unowed {
    /// Nothing more (others owe it, it is being copied, or the group failed).
    Kept,
    /// Never copied and owed by nobody: the host slot's pin for it goes.
    Unpin,
}

impl Group {
    pub(super) fn new(slots: u32) -> Group {
        Group {
            slots: vec![None; slots as usize],
            free: (0..slots).rev().collect(),
            replicas: BTreeMap::new(),
            waiting: VecDeque::new(),
            failed: false,
        }
    }

    /// How many slots its ring has.
    pub(super) fn slots(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Its GPU failed: it takes nothing more.
    pub(super) fn failed(&self) -> bool {
        self.failed
    }

    /// It holds no batch, copied or to copy.
    pub(super) fn is_empty(&self) -> bool {
        self.replicas.is_empty()
    }

    pub(super) fn counts(&self) -> GroupCounts {
        GroupCounts {
            slots: self.slots.len() as u32,
            in_use: (self.slots.len() - self.free.len()) as u32,
            waiting: self.waiting.len() as u32,
        }
    }

    /// A member owes batch `seq` (`b` in the host ring): `true` when the
    /// group had no copy of it, so one waits to be made and the host slot
    /// must be pinned for it.
    pub(super) fn owe(&mut self, seq: u64, b: Published) -> bool {
        if let Some(r) = self.replicas.get_mut(&seq) {
            r.refs += 1;
            return false;
        }
        self.replicas.insert(
            seq,
            Replica {
                batch: b,
                slot: None,
                done: false,
                refs: 1,
            },
        );
        let at = self.waiting.partition_point(|&w| w < seq);
        self.waiting.insert(at, seq);
        true
    }

    /// A member no longer owes batch `seq`.
    pub(super) fn unowe(&mut self, seq: u64) -> Unowed {
        if self.failed {
            return Unowed::Kept; // its replicas are gone
        }
        let r = self
            .replicas
            .get_mut(&seq)
            .expect("a member's batch has a replica");
        r.refs -= 1;
        if r.refs > 0 {
            return Unowed::Kept;
        }
        match (r.slot, r.done) {
            (None, _) => {
                // Never copied: nobody needs it on this GPU any more.
                self.waiting.retain(|&s| s != seq);
                self.replicas.remove(&seq);
                Unowed::Unpin
            }
            (Some(slot), true) => {
                self.replicas.remove(&seq);
                self.slots[slot as usize] = None;
                self.free.push(slot);
                Unowed::Kept
            }
            // Being copied: `copied` frees both slots.
            (Some(_), false) => Unowed::Kept,
        }
    }

    /// The copy of `seq` completed (`false`: none was being made): members
    /// may be sent it; the caller unpins the host slot.
    pub(super) fn copied(&mut self, seq: u64) -> bool {
        let Some(r) = self
            .replicas
            .get_mut(&seq)
            .filter(|r| r.slot.is_some() && !r.done)
        else {
            return false;
        };
        r.done = true;
        if r.refs == 0 {
            // Every member that owed it left while it was being copied.
            let slot = r.slot.expect("filtered above");
            self.replicas.remove(&seq);
            self.slots[slot as usize] = None;
            self.free.push(slot);
        }
        true
    }

    /// Its GPU failed: everything goes; returns the batches whose host
    /// slots were pinned for copies never completed.
    pub(super) fn fail(&mut self) -> Vec<u64> {
        self.failed = true;
        let pinned: Vec<u64> = self
            .replicas
            .iter()
            .filter(|(_, r)| !r.done)
            .map(|(&s, _)| s)
            .collect();
        self.replicas.clear();
        self.waiting.clear();
        self.slots.fill(None);
        self.free = (0..self.slots.len() as SlotId).rev().collect();
        pinned
    }

    /// Orders the copies its ring has room for, in sequence order (see
    /// the rules), into `orders`.
    pub(super) fn place(&mut self, g: GroupId, orders: &mut Vec<CopyOrder>) {
        let n = self.slots.len() as u64;
        while let Some(&seq) = self.waiting.front()
            && self
                .slots
                .iter()
                .flatten()
                .min()
                .is_none_or(|&oldest| seq < oldest + n)
        {
            self.waiting.pop_front();
            let slot = (seq % n) as SlotId;
            debug_assert_eq!(self.slots[slot as usize], None, "the span rule frees it");
            self.free.retain(|&s| s != slot);
            let r = self.replicas.get_mut(&seq).expect("waiting has a replica");
            r.slot = Some(slot);
            self.slots[slot as usize] = Some(seq);
            orders.push(CopyOrder {
                group: g,
                seq,
                host: r.batch.slot,
                slot,
            });
        }
    }

    /// Batch `seq` and its group slot, once its copy completed (a member
    /// may be sent it).
    pub(super) fn ready(&self, seq: u64) -> Option<(Published, SlotId)> {
        match self.replicas.get(&seq) {
            Some(Replica {
                batch,
                slot: Some(slot),
                done: true,
                ..
            }) => Some((*batch, *slot)),
            _ => None,
        }
    }

    /// Epoch and index of batch `seq`, if the group has it.
    pub(super) fn position(&self, seq: u64) -> Option<(u64, u64)> {
        let r = self.replicas.get(&seq)?;
        Some((r.batch.epoch, r.batch.index))
    }

    /// Whether a member may owe every batch from `seq` to `head` again:
    /// each has its copy here still (placed or waiting), or comes after
    /// every copy placed, so that a copy made for it now is placed in
    /// sequence order.
    pub(super) fn may_owe(&self, seq: u64, head: u64) -> bool {
        let placed = self
            .replicas
            .iter()
            .filter(|(_, r)| r.slot.is_some())
            .map(|(&s, _)| s)
            .max();
        !self.failed
            && (seq..head).all(|s| self.replicas.contains_key(&s) || placed.is_none_or(|p| s > p))
    }

    /// The oldest batch whose copy waits for a free slot, which the
    /// ring's oldest copy keeps from it ([`Group::blocked_by`]).
    pub(super) fn first_blocked(&self) -> Option<u64> {
        let seq = self
            .replicas
            .iter()
            .find(|(_, r)| r.slot.is_none())
            .map(|(&s, _)| s)?;
        self.blocked_by(seq).map(|_| seq)
    }

    /// When batch `seq`'s copy waits for a free slot: the oldest copy the
    /// ring holds, whose members keep it from being freed.
    pub(super) fn blocked_by(&self, seq: u64) -> Option<u64> {
        let waits = self.replicas.get(&seq).is_some_and(|r| r.slot.is_none());
        let oldest = self
            .replicas
            .iter()
            .find(|(_, r)| r.slot.is_some() && r.done)
            .map(|(&s, _)| s);
        oldest.filter(|_| waits)
    }
}

/// The group's rules checked from outside (the hub's invariants, after
/// every step of the property tests).
#[cfg(test)]
pub(super) mod tests {
    use super::{Group, GroupId, SlotId};

    /// Whether the group is copying batch `seq` (its host slot pinned).
    pub(in crate::hub) fn copying(grp: &Group, seq: u64) -> bool {
        grp.replicas.get(&seq).is_some_and(|r| !r.done)
    }

    /// Whether the group has a replica of `seq`, and whether its copy is done.
    pub(in crate::hub) fn replica(grp: &Group, seq: u64) -> Option<bool> {
        grp.replicas.get(&seq).map(|r| r.done)
    }

    /// The latest batch whose copy was placed in the ring.
    pub(in crate::hub) fn last_placed(grp: &Group) -> Option<u64> {
        grp.replicas
            .iter()
            .filter(|(_, r)| r.slot.is_some())
            .map(|(&q, _)| q)
            .max()
    }

    /// Free list, replicas, refcounts (`owing`: how many members owe a
    /// batch), copies in order, the ring's span; `pinned`: whether a host
    /// slot holds a batch.
    pub(in crate::hub) fn check(
        g: GroupId,
        grp: &Group,
        owing: impl Fn(u64) -> u32,
        pinned: impl Fn(u64) -> bool,
    ) {
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
            let owing = owing(seq);
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
                    pinned(seq),
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
        check_span(g, grp);
    }

    /// A group's ring, as the host's: batch `seq` in slot `seq mod slots`,
    /// the live ones less than `slots` apart, and a copy waits only while
    /// the next would be `slots` ahead of the oldest.
    fn check_span(g: GroupId, grp: &Group) {
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
}
