//! The host ring: its slots, the batches being filled and published in
//! them, and where the pipeline is. Only this type changes them; the hub
//! decides who owes what and tells it.
//!
//! # Rules
//!
//! * Batch `seq` takes slot `seq mod slots` (the host arena holds samples
//!   in rings, a batch's samples are its `seq × unit ..` cells), so the
//!   pipeline never runs more than `slots` batches past the oldest batch
//!   anyone owes: no free next slot ([`Ring::free_slots`] 0) is the
//!   back-pressure.
//! * A published slot carries the number of pins on it (consumers that
//!   owe it, pending copies); it is free again at zero, never before.
//! * Batches are published in sequence order even when the pipeline
//!   finishes them out of order ([`Ring::finish`] returns them in order).
//! * The cursor is the next batch the pipeline is given; epochs below
//!   `live_epoch` were abandoned while nobody was subscribed.

use std::collections::BTreeMap;

use super::{SlotId, Work};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Slot {
    Free,
    /// Being written by the pipeline (exclusive).
    Filling,
    /// Published; `refs` pins (consumers that owe it, pending copies).
    Published {
        seq: u64,
        refs: u32,
    },
}

#[derive(Debug, Clone, Copy)]
pub(super) struct InFlight {
    pub(super) epoch: u64,
    pub(super) index: u64,
    pub(super) slot: SlotId,
    /// `Some` once filled.
    pub(super) samples: Option<u64>,
}

/// A batch in a host slot.
#[derive(Debug, Clone, Copy)]
pub(super) struct Published {
    pub(super) epoch: u64,
    pub(super) index: u64,
    pub(super) slot: SlotId,
    pub(super) samples: u64,
}

/// Where the pipeline is: the next batch it will be given.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Cursor {
    /// The first batch was given out (the stream started).
    pub(super) started: bool,
    pub(super) next_seq: u64,
    pub(super) next_epoch: u64,
    pub(super) next_index: u64,
    /// Epochs below this were abandoned while nobody was subscribed.
    pub(super) live_epoch: u64,
}

/// The host ring (see the module's rules).
#[derive(Debug)]
pub(crate) struct Ring {
    slots: Vec<Slot>,
    /// Free slots (for counts and checks: batch `seq` always takes slot
    /// `seq mod slots`, see `next_slot`).
    free: Vec<SlotId>,
    cursor: Cursor,
    inflight: BTreeMap<u64, InFlight>,
    /// Batches in host slots (pinned by a host consumer or a pending copy).
    published: BTreeMap<u64, Published>,
}

impl Ring {
    pub(super) fn new(slots: u32) -> Ring {
        Ring {
            slots: vec![Slot::Free; slots as usize],
            free: (0..slots).rev().collect(),
            cursor: Cursor::default(),
            inflight: BTreeMap::new(),
            published: BTreeMap::new(),
        }
    }

    /// How many slots the ring has.
    pub fn slots(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Where the pipeline is.
    pub(super) fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// The slot the next batch goes to: batch `seq` takes slot
    /// `seq mod slots`, and the ring cannot run past a slot still owed.
    fn next_slot(&self) -> SlotId {
        (self.cursor.next_seq % self.slots.len() as u64) as SlotId
    }

    /// Slots the pipeline may fill now: the free ones from the ring's next
    /// slot on, up to the first still in use (a free slot beyond that one
    /// waits for it).
    pub fn free_slots(&self) -> u32 {
        let n = self.slots.len();
        let next = self.next_slot() as usize;
        (0..n)
            .take_while(|k| self.slots[(next + k) % n] == Slot::Free)
            .count() as u32
    }

    /// Whether batches are being filled (taken by the pipeline, not yet
    /// published).
    pub fn filling(&self) -> bool {
        !self.inflight.is_empty()
    }

    /// The first batch not yet published.
    pub fn head(&self) -> u64 {
        self.inflight
            .keys()
            .next()
            .copied()
            .unwrap_or(self.cursor.next_seq)
    }

    /// Batch `seq`, if it is in a host slot.
    pub(super) fn published(&self, seq: u64) -> Option<Published> {
        self.published.get(&seq).copied()
    }

    /// The batches being filled: seq and epoch, in sequence order.
    pub(super) fn in_flight(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.inflight.iter().map(|(&s, b)| (s, b.epoch))
    }

    /// The first batch not yet published of an epoch not abandoned (or
    /// the next to be made): seq, epoch, index.
    pub(super) fn first_unpublished(&self) -> (u64, u64, u64) {
        self.inflight
            .iter()
            .find(|(_, b)| b.epoch >= self.cursor.live_epoch)
            .map(|(&seq, b)| (seq, b.epoch, b.index))
            .unwrap_or((
                self.cursor.next_seq,
                self.cursor.next_epoch,
                self.cursor.next_index,
            ))
    }

    /// Epoch and index of batch `seq`, if it is published, being made, or
    /// the next one to be made.
    pub fn position(&self, seq: u64) -> Option<(u64, u64)> {
        if let Some(b) = self.published.get(&seq) {
            return Some((b.epoch, b.index));
        }
        if let Some(b) = self.inflight.get(&seq) {
            return Some((b.epoch, b.index));
        }
        (seq == self.cursor.next_seq).then_some((self.cursor.next_epoch, self.cursor.next_index))
    }

    /// The seq of batch `index` of `epoch`, if it is published, being made,
    /// or the next one to be made.
    pub(crate) fn seq_of(&self, epoch: u64, index: u64) -> Option<u64> {
        if (self.cursor.next_epoch, self.cursor.next_index) == (epoch, index) {
            return Some(self.cursor.next_seq);
        }
        let found = |e: u64, i: u64| (e, i) == (epoch, index);
        self.published
            .iter()
            .find(|(_, b)| found(b.epoch, b.index))
            .map(|(&s, _)| s)
            .or_else(|| {
                self.inflight
                    .iter()
                    .find(|(_, b)| found(b.epoch, b.index))
                    .map(|(&s, _)| s)
            })
    }

    /// Whether every batch from `seq` to the head is published, of epochs
    /// not abandoned: nobody reuses a slot a consumer owing them reads.
    pub(super) fn live_from(&self, seq: u64) -> bool {
        let head = self.head();
        seq <= head
            && (seq..head).all(|s| self.published.contains_key(&s))
            && self
                .position(seq)
                .is_some_and(|(epoch, _)| epoch >= self.cursor.live_epoch)
    }

    /// The oldest batch from which every batch up to the head is still
    /// published (of an epoch not abandoned): seq, epoch, index.
    pub(crate) fn oldest_live(&self) -> Option<(u64, u64, u64)> {
        let mut s = self.head();
        while let Some(prev) = s.checked_sub(1)
            && let Some(b) = self.published.get(&prev)
            && b.epoch >= self.cursor.live_epoch
        {
            s = prev;
        }
        let b = self.published.get(&s)?;
        Some((s, b.epoch, b.index))
    }

    /// The oldest batch of `epoch` from seq `from` on, past the epoch's
    /// first and at an index that `every` divides, with every batch from
    /// there to the head still published (older ones, given back by every
    /// reader, are not looked at): where a consumer may rotate into that
    /// epoch ([`super::Hub::rejoin_through`]). Its seq and index.
    pub(crate) fn rotation_point(&self, epoch: u64, from: u64, every: u64) -> Option<(u64, u64)> {
        let mut found = None;
        // Back from the head while every batch is still published.
        for s in (from..self.head()).rev() {
            let Some(b) = self.published.get(&s) else {
                break;
            };
            if b.epoch < self.cursor.live_epoch || b.epoch < epoch {
                break;
            }
            if b.epoch == epoch && b.index > 0 && b.index.is_multiple_of(every.max(1)) {
                found = Some((s, b.index));
            }
        }
        found
    }

    /// Every batch whose cells hold what the pipeline wrote (published, or
    /// filled and waiting for an earlier one to be published): seq and
    /// samples, in sequence order.
    pub(crate) fn written(&self) -> Vec<(u64, u64)> {
        let mut all: Vec<(u64, u64)> = self
            .published
            .iter()
            .map(|(&seq, b)| (seq, b.samples))
            .chain(
                self.inflight
                    .iter()
                    .filter_map(|(&seq, b)| b.samples.map(|n| (seq, n))),
            )
            .collect();
        all.sort_unstable();
        all
    }

    /// The oldest batch still in a host slot (pinned by someone).
    pub(crate) fn oldest_published(&self) -> Option<u64> {
        self.published.keys().next().copied()
    }

    /// The batch in the ring's next slot, which the pipeline waits for
    /// (`None` if the slot is free or being filled).
    pub(super) fn pinned(&self) -> Option<u64> {
        match self.slots[self.next_slot() as usize] {
            Slot::Published { seq, .. } => Some(seq),
            _ => None,
        }
    }

    /// Free and filling slots, for stats.
    pub(super) fn counts(&self) -> (u32, u32) {
        let filling = self
            .slots
            .iter()
            .filter(|s| matches!(s, Slot::Filling))
            .count() as u32;
        (self.free.len() as u32, filling)
    }

    /// The pipeline goes on at batch `index` of `epoch`, epochs before it
    /// abandoned: a stream that has not begun starts there (the hub checked
    /// it has not), or the rest of the epoch nobody will read is skipped
    /// (batches of it still in flight are published to nobody).
    pub(super) fn seek(&mut self, epoch: u64, index: u64) {
        self.cursor.next_epoch = epoch;
        self.cursor.next_index = index;
        self.cursor.live_epoch = epoch;
    }

    /// Gives the pipeline the next batch into the next slot (the caller
    /// checked it is free).
    pub(super) fn start(&mut self, batches_per_epoch: u64) -> Work {
        self.cursor.started = true;
        let slot = self.next_slot();
        self.free.retain(|&s| s != slot);
        self.slots[slot as usize] = Slot::Filling;
        let work = Work {
            seq: self.cursor.next_seq,
            epoch: self.cursor.next_epoch,
            index: self.cursor.next_index,
            slot,
        };
        self.inflight.insert(
            work.seq,
            InFlight {
                epoch: work.epoch,
                index: work.index,
                slot,
                samples: None,
            },
        );
        self.cursor.next_seq += 1;
        self.cursor.next_index += 1;
        if self.cursor.next_index == batches_per_epoch {
            self.cursor.next_index = 0;
            self.cursor.next_epoch += 1;
        }
        work
    }

    /// Batch `seq` was filled with `samples` samples; returns the batches
    /// now ready to publish, in sequence order (every earlier one is).
    pub(super) fn finish(&mut self, seq: u64, samples: u64) -> Vec<(u64, Published)> {
        let b = self
            .inflight
            .get_mut(&seq)
            .expect("finish_batch of a batch that is not in flight");
        b.samples = Some(samples);
        let mut ready = Vec::new();
        while let Some(entry) = self.inflight.first_entry() {
            let Some(samples) = entry.get().samples else {
                break;
            };
            let (seq, b) = entry.remove_entry();
            ready.push((
                seq,
                Published {
                    epoch: b.epoch,
                    index: b.index,
                    slot: b.slot,
                    samples,
                },
            ));
        }
        ready
    }

    /// Publishes batch `seq` with `refs` pins; with none it is free again
    /// at once (nobody wanted it).
    pub(super) fn place(&mut self, seq: u64, b: Published, refs: u32) {
        if refs == 0 {
            self.slots[b.slot as usize] = Slot::Free;
            self.free.push(b.slot);
        } else {
            self.slots[b.slot as usize] = Slot::Published { seq, refs };
            self.published.insert(seq, b);
        }
    }

    /// One more pin on published batch `seq`.
    pub(super) fn pin(&mut self, seq: u64) {
        let slot = self.published[&seq].slot;
        match &mut self.slots[slot as usize] {
            Slot::Published { refs, .. } => *refs += 1,
            other => unreachable!("published batch {seq} in slot {slot} in state {other:?}"),
        }
    }

    /// Drops one pin of the host slot holding `seq`.
    pub(super) fn unpin(&mut self, seq: u64) {
        let b = self
            .published
            .get(&seq)
            .expect("a referenced batch is published");
        let slot = b.slot as usize;
        match &mut self.slots[slot] {
            Slot::Published { refs, .. } if *refs > 1 => *refs -= 1,
            Slot::Published { .. } => {
                self.slots[slot] = Slot::Free;
                self.free.push(slot as SlotId);
                self.published.remove(&seq);
            }
            other => unreachable!("unref of slot {slot} in state {other:?}"),
        }
    }
}

/// The ring's rules checked from outside (the hub's invariants, after every
/// step of the property tests).
#[cfg(test)]
pub(super) mod tests {
    use super::{Ring, Slot};

    /// Each published batch and the pins on it.
    pub(in crate::hub) fn pins(r: &Ring) -> impl Iterator<Item = (u64, u32)> + '_ {
        r.slots.iter().filter_map(|s| match *s {
            Slot::Published { seq, refs } => Some((seq, refs)),
            _ => None,
        })
    }

    /// The oldest published batch.
    pub(in crate::hub) fn oldest_published(r: &Ring) -> Option<u64> {
        r.published.keys().next().copied()
    }

    /// Free slots are free, each filling slot has its batch in flight,
    /// each published one its batch published there, and every slot is one
    /// of the three.
    pub(in crate::hub) fn check(r: &Ring) {
        let mut free_seen = vec![false; r.slots.len()];
        for &s in &r.free {
            assert_eq!(r.slots[s as usize], Slot::Free, "slot {s} listed free");
            assert!(!free_seen[s as usize], "slot {s} listed free twice");
            free_seen[s as usize] = true;
        }
        for (i, slot) in r.slots.iter().enumerate() {
            match *slot {
                Slot::Free => assert!(free_seen[i], "free slot {i} not listed free"),
                Slot::Filling => assert_eq!(
                    r.inflight.values().filter(|b| b.slot as usize == i).count(),
                    1,
                    "filling slot {i} has no batch in flight, or several"
                ),
                Slot::Published { seq, refs } => {
                    assert!(refs > 0, "published slot {i} with no pins");
                    assert_eq!(r.published[&seq].slot as usize, i);
                }
            }
        }
        assert_eq!(
            r.published.len() + r.inflight.len() + r.free.len(),
            r.slots.len()
        );
    }
}
