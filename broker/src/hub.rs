//! The hub: slots, reference counts, per-consumer windows, epochs and
//! sequence numbers, as plain logic with no I/O, clocks or threads. The
//! stream runtime drives it and carries out what it emits.
//!
//! # Rules
//!
//! * A slot's reference count is the number of consumers that still owe it:
//!   it was published for them and they have not released it (whether it is
//!   still queued for them or already sent). A slot is reused only at zero.
//! * A consumer is never sent more than its window of unreleased batches;
//!   published batches wait in its queue until it releases one.
//! * [`Hub::start_batch`] returns `None` when no slot is free: the pipeline
//!   blocks (back-pressure). Memory is the fixed set of slots; every queue
//!   here is bounded by the number of slots.
//! * The slowest consumer sets the pace. With a lag limit, a consumer that
//!   owes more than `lag_limit` batches (held plus queued) is detached.
//! * A consumer that leaves (disconnects, dies, is detached) gives back all
//!   it held and all that was queued for it at once.
//! * Joining: [`JoinPolicy::NextEpoch`] starts at the first epoch of which
//!   nothing has been published; [`JoinPolicy::Immediate`] at the next batch
//!   published. With no consumer at all, the pipeline pauses; a consumer
//!   joining a paused stream for the next epoch makes it skip the rest of the
//!   epoch nobody was watching.
//! * Batches are published in sequence order even when the pipeline finishes
//!   them out of order.

use std::collections::{BTreeMap, VecDeque};

use batchcast::JoinPolicy;

pub type ConsumerId = u64;
pub type SlotId = u32;

/// Limits and shape of one stream.
#[derive(Debug, Clone)]
pub struct HubConfig {
    pub slots: u32,
    pub batches_per_epoch: u64,
    /// `None`: endless.
    pub epochs: Option<u64>,
    /// Detach a consumer whose backlog exceeds the least-behind consumer's by
    /// more than this many batches; `None`: wait for it.
    pub lag_limit: Option<u32>,
    /// Consumers that must subscribe before the first batch is produced.
    pub min_consumers: u32,
}

/// A batch for the pipeline to fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Work {
    pub seq: u64,
    pub epoch: u64,
    pub index: u64,
    pub slot: SlotId,
}

/// Something the runtime must tell one consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outbound {
    Batch {
        seq: u64,
        epoch: u64,
        index: u64,
        slot: SlotId,
        samples: u64,
    },
    EndOfEpoch {
        epoch: u64,
        batches: u64,
        complete: bool,
    },
    EndOfStream,
    /// The consumer has been removed from the hub; tell it why and close.
    Detached {
        reason: String,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HubError {
    #[error("window must be at least 1")]
    WindowZero,
    #[error("window {window} exceeds the stream's {slots} slots")]
    WindowTooLarge { window: u32, slots: u32 },
    #[error(
        "window {window} exceeds the stream's lag_limit of {lag_limit} batches; ask for a window of at most {lag_limit}"
    )]
    WindowAboveLagLimit { window: u32, lag_limit: u32 },
    #[error("no consumer {0}")]
    UnknownConsumer(ConsumerId),
    #[error("batch {seq} is not held by this consumer (already released, or never sent)")]
    NotHeld { seq: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    /// Being written by the pipeline (exclusive).
    Filling,
    /// Published; `refs` consumers owe it.
    Published {
        seq: u64,
        refs: u32,
    },
}

#[derive(Debug, Clone, Copy)]
struct InFlight {
    epoch: u64,
    index: u64,
    slot: SlotId,
    /// `Some` once filled.
    samples: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
struct Published {
    epoch: u64,
    index: u64,
    slot: SlotId,
    samples: u64,
}

#[derive(Debug, Clone)]
struct Consumer {
    window: u32,
    /// Receives batches with `seq >= floor` and `epoch >= start_epoch`.
    floor: u64,
    start_epoch: u64,
    /// Published for it, not yet sent (in sequence order).
    queue: VecDeque<u64>,
    /// Sent, not yet released.
    held: Vec<u64>,
    /// Said goodbye: nothing more is sent, held batches await release.
    closing: bool,
    /// End of stream was sent.
    ended: bool,
    delivered: u64,
    /// Epoch of the batches being counted in `in_epoch`.
    cur_epoch: u64,
    in_epoch: u64,
}

impl Consumer {
    fn wants(&self, seq: u64, epoch: u64) -> bool {
        !self.closing && !self.ended && seq >= self.floor && epoch >= self.start_epoch
    }
    fn owes(&self) -> usize {
        self.held.len() + self.queue.len()
    }
}

/// Per-consumer numbers for stats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerCounts {
    pub window: u32,
    pub delivered: u64,
    pub held: u32,
    pub queued: u32,
    pub epoch: u64,
}

/// Per-stream numbers for stats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubCounts {
    pub free: u32,
    pub filling: u32,
    pub in_use: u32,
    pub produced: u64,
    pub epoch: u64,
    pub finished: bool,
    pub deliveries: u64,
    pub departed: u64,
    pub detached: u64,
}

#[derive(Debug)]
pub struct Hub {
    cfg: HubConfig,
    slots: Vec<Slot>,
    /// Free slots, reused last-in first-out so recently used (cache-warm)
    /// slots are refilled first.
    free: Vec<SlotId>,
    started: bool,
    /// Cursor: the next batch the pipeline will be given.
    next_seq: u64,
    next_epoch: u64,
    next_index: u64,
    /// Epochs below this were abandoned while nobody was subscribed.
    live_epoch: u64,
    inflight: BTreeMap<u64, InFlight>,
    published: BTreeMap<u64, Published>,
    consumers: BTreeMap<ConsumerId, Consumer>,
    next_id: ConsumerId,
    out: Vec<(ConsumerId, Outbound)>,
    produced: u64,
    last_epoch: u64,
    deliveries: u64,
    departed: u64,
    detached: u64,
}

impl Hub {
    pub fn new(cfg: HubConfig) -> Hub {
        assert!(
            cfg.slots > 0 && cfg.batches_per_epoch > 0,
            "validated by the config"
        );
        Hub {
            slots: vec![Slot::Free; cfg.slots as usize],
            free: (0..cfg.slots).rev().collect(),
            cfg,
            started: false,
            next_seq: 0,
            next_epoch: 0,
            next_index: 0,
            live_epoch: 0,
            inflight: BTreeMap::new(),
            published: BTreeMap::new(),
            consumers: BTreeMap::new(),
            next_id: 1,
            out: Vec::new(),
            produced: 0,
            last_epoch: 0,
            deliveries: 0,
            departed: 0,
            detached: 0,
        }
    }

    /// Takes what must be sent, in order.
    pub fn take_outbound(&mut self) -> Vec<(ConsumerId, Outbound)> {
        std::mem::take(&mut self.out)
    }

    /// True once every epoch has been produced (finite streams only).
    pub fn exhausted(&self) -> bool {
        self.cfg.epochs.is_some_and(|e| self.next_epoch >= e)
    }

    /// True once every batch has been produced, published and given back.
    pub fn finished(&self) -> bool {
        self.exhausted() && self.inflight.is_empty() && self.published.is_empty()
    }

    /// Whether the pipeline could be given work now (a free slot, someone
    /// to produce for, epochs left).
    pub fn can_start(&self) -> bool {
        (self.started || self.consumers.len() as u32 >= self.cfg.min_consumers)
            && !self.consumers.is_empty()
            && !self.exhausted()
            && !self.free.is_empty()
    }

    /// Changes how many consumers the stream waits for before it starts
    /// (when one that was counted on will never come); no effect once it
    /// has started.
    pub fn set_min_consumers(&mut self, min: u32) {
        if !self.started {
            self.cfg.min_consumers = min;
        }
    }

    /// Whether a slot is free (otherwise the pipeline is under back-pressure).
    pub fn has_free_slot(&self) -> bool {
        !self.free.is_empty()
    }

    /// Subscribes a consumer; returns its id and the first epoch it will see.
    pub fn join(&mut self, window: u32, join: JoinPolicy) -> Result<(ConsumerId, u64), HubError> {
        if window == 0 {
            return Err(HubError::WindowZero);
        }
        if window > self.cfg.slots {
            return Err(HubError::WindowTooLarge {
                window,
                slots: self.cfg.slots,
            });
        }
        if let Some(lag_limit) = self.cfg.lag_limit
            && window > lag_limit
        {
            return Err(HubError::WindowAboveLagLimit { window, lag_limit });
        }
        if join == JoinPolicy::NextEpoch && self.consumers.is_empty() && self.next_index != 0 {
            // Paused mid-epoch with nobody subscribed: nobody would see the
            // rest of this epoch, so it is not produced; batches of it still
            // in flight are published to nobody.
            self.next_epoch += 1;
            self.next_index = 0;
            self.live_epoch = self.next_epoch;
        }
        // The first batch not yet published, skipping abandoned epochs.
        let (floor, epoch, index) = self
            .inflight
            .iter()
            .find(|(_, b)| b.epoch >= self.live_epoch)
            .map(|(&seq, b)| (seq, b.epoch, b.index))
            .unwrap_or((self.next_seq, self.next_epoch, self.next_index));
        let start_epoch = match join {
            JoinPolicy::NextEpoch if index != 0 => epoch + 1,
            _ => epoch,
        };
        let id = self.next_id;
        self.next_id += 1;
        self.consumers.insert(
            id,
            Consumer {
                window,
                floor,
                start_epoch,
                queue: VecDeque::new(),
                held: Vec::new(),
                closing: false,
                ended: false,
                delivered: 0,
                cur_epoch: start_epoch,
                in_epoch: 0,
            },
        );
        self.pump();
        Ok((id, start_epoch))
    }

    /// The consumer wants nothing more; what it holds stays held until it
    /// releases it or leaves.
    pub fn goodbye(&mut self, id: ConsumerId) -> Result<(), HubError> {
        let c = self
            .consumers
            .get_mut(&id)
            .ok_or(HubError::UnknownConsumer(id))?;
        c.closing = true;
        let queued: Vec<u64> = c.queue.drain(..).collect();
        for seq in queued {
            self.unref(seq);
        }
        self.pump();
        Ok(())
    }

    /// The consumer is gone: everything it held or was owed is given back.
    /// Idempotent: returns `false` if it was already gone.
    pub fn leave(&mut self, id: ConsumerId) -> bool {
        let gone = self.remove(id);
        self.pump();
        gone
    }

    /// Removes a consumer and drops its references. Removing never adds to
    /// another consumer's queue, so callers need not pump again for it.
    fn remove(&mut self, id: ConsumerId) -> bool {
        let Some(c) = self.consumers.remove(&id) else {
            return false;
        };
        self.departed += 1;
        for seq in c.held.into_iter().chain(c.queue) {
            self.unref(seq);
        }
        true
    }

    pub fn release(&mut self, id: ConsumerId, seq: u64) -> Result<(), HubError> {
        let c = self
            .consumers
            .get_mut(&id)
            .ok_or(HubError::UnknownConsumer(id))?;
        let pos = c
            .held
            .iter()
            .position(|&s| s == seq)
            .ok_or(HubError::NotHeld { seq })?;
        c.held.swap_remove(pos);
        self.unref(seq);
        self.pump();
        Ok(())
    }

    /// Ends an endless stream here if no batch of the next epoch has been
    /// started (an external producer stopping between epochs): consumers get
    /// the end of the stream after what was already produced.
    pub fn end_at_epoch_boundary(&mut self) -> bool {
        if self.next_index != 0 {
            return false;
        }
        self.cfg.epochs = Some(self.next_epoch);
        self.pump();
        true
    }

    /// Gives the pipeline its next batch to fill, or `None` if it must wait
    /// (no free slot, no consumer yet, or all epochs produced).
    pub fn start_batch(&mut self) -> Option<Work> {
        if !self.can_start() {
            return None;
        }
        self.started = true;
        let slot = self.free.pop()?;
        self.slots[slot as usize] = Slot::Filling;
        let work = Work {
            seq: self.next_seq,
            epoch: self.next_epoch,
            index: self.next_index,
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
        self.next_seq += 1;
        self.next_index += 1;
        if self.next_index == self.cfg.batches_per_epoch {
            self.next_index = 0;
            self.next_epoch += 1;
        }
        Some(work)
    }

    /// The pipeline has filled batch `seq` with `samples` samples. It is
    /// published once every earlier batch is.
    pub fn finish_batch(&mut self, seq: u64, samples: u64) {
        let b = self
            .inflight
            .get_mut(&seq)
            .expect("finish_batch of a batch that is not in flight");
        b.samples = Some(samples);
        while let Some(entry) = self.inflight.first_entry() {
            let Some(samples) = entry.get().samples else {
                break;
            };
            let (seq, b) = entry.remove_entry();
            self.publish(
                seq,
                Published {
                    epoch: b.epoch,
                    index: b.index,
                    slot: b.slot,
                    samples,
                },
            );
        }
        self.pump();
    }

    fn publish(&mut self, seq: u64, b: Published) {
        self.produced += 1;
        self.last_epoch = b.epoch;
        let mut refs = 0;
        for c in self.consumers.values_mut() {
            if c.wants(seq, b.epoch) {
                c.queue.push_back(seq);
                refs += 1;
            }
        }
        if refs == 0 {
            self.slots[b.slot as usize] = Slot::Free;
            self.free.push(b.slot);
        } else {
            self.slots[b.slot as usize] = Slot::Published { seq, refs };
            self.published.insert(seq, b);
        }
    }

    fn unref(&mut self, seq: u64) {
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

    /// Sends what windows allow, ends epochs and streams, enforces the lag limit.
    fn pump(&mut self) {
        let bpe = self.cfg.batches_per_epoch;
        let exhausted = self.exhausted();
        let mut detach = Vec::new();
        for (&id, c) in self.consumers.iter_mut() {
            while c.held.len() < c.window as usize
                && let Some(seq) = c.queue.pop_front()
            {
                let b = self.published[&seq];
                c.held.push(seq);
                c.delivered += 1;
                self.deliveries += 1;
                if b.epoch != c.cur_epoch {
                    c.cur_epoch = b.epoch;
                    c.in_epoch = 0;
                }
                c.in_epoch += 1;
                self.out.push((
                    id,
                    Outbound::Batch {
                        seq,
                        epoch: b.epoch,
                        index: b.index,
                        slot: b.slot,
                        samples: b.samples,
                    },
                ));
                if b.index + 1 == bpe {
                    self.out.push((
                        id,
                        Outbound::EndOfEpoch {
                            epoch: b.epoch,
                            batches: c.in_epoch,
                            complete: c.in_epoch == bpe,
                        },
                    ));
                }
            }
            if exhausted
                && !c.ended
                && !c.closing
                && c.queue.is_empty()
                && !self.inflight.iter().any(|(&s, b)| c.wants(s, b.epoch))
            {
                c.ended = true;
                self.out.push((id, Outbound::EndOfStream));
            }
        }
        if let Some(limit) = self.cfg.lag_limit {
            let least = self
                .consumers
                .values()
                .filter(|c| !c.closing)
                .map(Consumer::owes)
                .min()
                .unwrap_or(0);
            for (&id, c) in &self.consumers {
                let lag = c.owes().saturating_sub(least);
                if !c.closing && lag > limit as usize {
                    detach.push((id, lag));
                }
            }
        }
        for (id, lag) in detach {
            let reason = format!(
                "detached: this consumer fell {lag} batches behind the others, more than the stream's lag_limit of {}; \
                 it was holding every other consumer back. Process batches faster, or raise lag_limit in the broker config",
                self.cfg.lag_limit.unwrap_or_default()
            );
            self.out.push((id, Outbound::Detached { reason }));
            self.detached += 1;
            self.remove(id);
        }
    }

    pub fn consumer_counts(&self, id: ConsumerId) -> Option<ConsumerCounts> {
        self.consumers.get(&id).map(|c| ConsumerCounts {
            window: c.window,
            delivered: c.delivered,
            held: c.held.len() as u32,
            queued: c.queue.len() as u32,
            epoch: c.cur_epoch,
        })
    }

    pub fn counts(&self) -> HubCounts {
        let filling = self
            .slots
            .iter()
            .filter(|s| matches!(s, Slot::Filling))
            .count() as u32;
        HubCounts {
            free: self.free.len() as u32,
            filling,
            in_use: self.cfg.slots - self.free.len() as u32 - filling,
            produced: self.produced,
            epoch: self.last_epoch,
            finished: self.finished(),
            deliveries: self.deliveries,
            departed: self.departed,
            detached: self.detached,
        }
    }

    /// Checks every structural invariant; tests call it after each step.
    #[cfg(test)]
    pub fn check_invariants(&self) {
        let mut free_seen = vec![false; self.slots.len()];
        for &s in &self.free {
            assert_eq!(
                self.slots[s as usize],
                Slot::Free,
                "free list holds a used slot {s}"
            );
            assert!(
                !std::mem::replace(&mut free_seen[s as usize], true),
                "slot {s} twice in the free list"
            );
        }
        for (i, slot) in self.slots.iter().enumerate() {
            match *slot {
                Slot::Free => assert!(free_seen[i], "free slot {i} missing from the free list"),
                Slot::Filling => {
                    assert_eq!(
                        self.inflight
                            .values()
                            .filter(|b| b.slot as usize == i)
                            .count(),
                        1
                    )
                }
                Slot::Published { seq, refs } => {
                    assert!(refs > 0, "published slot {i} with no references");
                    assert_eq!(self.published[&seq].slot as usize, i);
                    let owing = self
                        .consumers
                        .values()
                        .filter(|c| c.held.contains(&seq) || c.queue.contains(&seq))
                        .count() as u32;
                    assert_eq!(
                        refs, owing,
                        "slot {i} (batch {seq}) refcount {refs} but {owing} consumers owe it"
                    );
                }
            }
        }
        assert_eq!(
            self.published.len() + self.inflight.len() + self.free.len(),
            self.slots.len()
        );
        for c in self.consumers.values() {
            assert!(c.held.len() <= c.window as usize, "window exceeded");
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
            if c.closing {
                assert!(c.queue.is_empty());
            }
        }
        if let Some(limit) = self.cfg.lag_limit {
            let active = || {
                self.consumers
                    .values()
                    .filter(|c| !c.closing)
                    .map(Consumer::owes)
            };
            if let (Some(least), Some(most)) = (active().min(), active().max()) {
                assert!(most - least <= limit as usize, "lag limit not enforced");
            }
        }
    }
}

#[cfg(test)]
mod tests;
