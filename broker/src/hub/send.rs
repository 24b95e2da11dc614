//! The delivery engine: a finished batch is published in sequence
//! order to the consumers that want it (a host slot's refcount, a group's
//! copy), each consumer is sent what its window (or sending ahead) allows,
//! the lag limit detaches a straggler, copies are ordered, and releases
//! and departures unreference slots. Every command of the hub ends here.

use batchcast::proto::ErrorCode;

use super::group::{Group, Unowed};
use super::readers::Readers;
use super::{
    ConsumerId, CopyOrder, GroupId, HubConfig, Life, Outbound, Published, Ring, Tally, View,
};

/// The hub's owners borrowed to deliver ([`Hub::post`](super::Hub::post)):
/// the only code that moves a batch from the ring to a reader's queue, its
/// window and its messages, or takes one back.
pub(super) struct Post<'a> {
    pub(super) cfg: &'a HubConfig,
    pub(super) ring: &'a mut Ring,
    pub(super) readers: &'a mut Readers,
    pub(super) groups: &'a mut [Group],
    pub(super) out: &'a mut Vec<(ConsumerId, Outbound)>,
    pub(super) copies: &'a mut Vec<CopyOrder>,
    pub(super) tally: &'a mut Tally,
}

impl Post<'_> {
    /// The owners, to look at.
    fn view(&self) -> View<'_> {
        View {
            cfg: self.cfg,
            ring: self.ring,
            readers: self.readers,
            groups: self.groups,
            tally: self.tally,
        }
    }

    pub(super) fn publish(&mut self, seq: u64, b: Published) {
        self.tally.produced += 1;
        self.tally.last_epoch = b.epoch;
        // Host consumers and groups with a copy to make pin the host slot.
        let mut refs = 0;
        for c in self.readers.iter_mut().map(|(_, c)| c) {
            if !c.wants(seq, b.epoch) {
                continue;
            }
            c.queue.push_back(seq);
            let Some(g) = c.group else {
                refs += 1;
                continue;
            };
            if self.groups[g as usize].owe(seq, b) {
                refs += 1;
            }
        }
        self.ring.place(seq, b, refs);
    }

    /// A consumer (of `group`, or of host slots) no longer owes `seq`.
    pub(super) fn unref(&mut self, group: Option<GroupId>, seq: u64) {
        let Some(g) = group else {
            self.ring.unpin(seq);
            return;
        };
        if self.groups[g as usize].unowe(seq) == Unowed::Unpin {
            self.ring.unpin(seq);
        }
    }

    /// Sends what windows allow, ends epochs and streams, enforces the lag limit.
    pub(super) fn pump(&mut self) {
        self.start_copies();
        let mut next = self.readers.next_after(None);
        while let Some(id) = next {
            self.send_to(id);
            next = self.readers.next_after(Some(id));
        }
        self.enforce_lag_limit();
    }

    /// What a release by `id` may change: its own window, and (with a lag
    /// limit) who lags. Freeing a slot sends nobody anything.
    pub(super) fn pump_after_release(&mut self, id: ConsumerId) {
        if self.cfg.lag_limit.is_some() || !self.groups.is_empty() {
            return self.pump();
        }
        self.send_to(id);
    }

    /// Sends consumer `id` what its window allows, ends its epochs and its
    /// stream.
    pub(super) fn send_to(&mut self, id: ConsumerId) {
        let bpe = self.cfg.batches_per_epoch;
        let exhausted = self.view().exhausted();
        let Some(c) = self.readers.get_mut(id) else {
            return;
        };
        while c.held.len() < c.ahead as usize
            && let Some(&seq) = c.queue.front()
        {
            let (b, slot) = match c.group {
                None => {
                    let b = self
                        .ring
                        .published(seq)
                        .expect("a queued batch is published");
                    (b, b.slot)
                }
                Some(g) => match self.groups[g as usize].ready(seq) {
                    Some(ready) => ready,
                    // Members get batches in order, each once copied.
                    None => break,
                },
            };
            c.queue.pop_front();
            c.held.push(seq);
            c.sent.count(b.epoch);
            self.tally.deliveries += 1;
            self.out.push((
                id,
                Outbound::Batch {
                    seq,
                    epoch: b.epoch,
                    index: b.index,
                    slot,
                    samples: b.samples,
                },
            ));
            if b.index + 1 == bpe {
                self.out.push((
                    id,
                    Outbound::EndOfEpoch {
                        epoch: b.epoch,
                        batches: c.sent.in_epoch,
                        complete: c.sent.in_epoch == bpe,
                    },
                ));
            }
        }
        if exhausted
            && c.life == (Life::Reading { through: None })
            && c.queue.is_empty()
            && !self.ring.in_flight().any(|(s, epoch)| c.wants(s, epoch))
        {
            c.life = Life::Ended;
            self.out.push((id, Outbound::EndOfStream));
        }
    }

    /// Detaches whoever lags more than the lag limit and holds the oldest
    /// batch anyone owes: only such a consumer holds the others back. One
    /// that owes nothing, or owes only batches someone else holds older
    /// than, is waiting for the pipeline (held back itself), never
    /// detached for it.
    pub(super) fn enforce_lag_limit(&mut self) {
        // Detaching the oldest holder may leave the next one holding the
        // oldest batch past the limit: until none is.
        while let Some((id, lag)) = self.over_lag_limit() {
            let reason = format!(
                "detached: this consumer fell {lag} batches behind the others, more than the stream's lag_limit of {}; \
                 it was holding every other consumer back. Process batches faster, or raise lag_limit in the broker config",
                self.cfg.lag_limit.unwrap_or_default()
            );
            self.out.push((
                id,
                Outbound::Detached {
                    reason,
                    code: ErrorCode::LagLimit,
                },
            ));
            self.tally.detached += 1;
            self.remove(id);
        }
        // Removal may have freed group slots.
        self.start_copies();
    }

    /// A consumer past the lag limit that holds the oldest batch anyone
    /// owes, with its lag beyond what its own window spans (the most
    /// lagging first).
    fn over_lag_limit(&self) -> Option<(ConsumerId, usize)> {
        let limit = self.cfg.lag_limit? as usize;
        // Everything made: nobody waits for the pipeline any more (a
        // group's member ends before the last member's tail, which it
        // then no longer waits for).
        if self.view().exhausted() {
            return None;
        }
        let tail = self.readers.tail(false)?;
        self.readers
            .lags(self.ring.head())
            .into_iter()
            .filter_map(|(id, lag)| {
                let c = self.readers.get(id).expect("a listed reader");
                let lag = lag.saturating_sub(c.slack.allowance);
                (lag > limit && !c.cuttable && c.oldest_owed() == Some(tail)).then_some((id, lag))
            })
            .max_by_key(|&(id, lag)| (lag, std::cmp::Reverse(id)))
    }

    /// Orders the copies each group's ring has room for, in sequence order
    /// (`Group::place`).
    pub(super) fn start_copies(&mut self) {
        for (g, grp) in self.groups.iter_mut().enumerate() {
            grp.place(g as GroupId, self.copies);
        }
    }

    /// Removes a consumer and drops its references. Removing never adds to
    /// another consumer's queue, so callers need not pump again for it.
    pub(super) fn remove(&mut self, id: ConsumerId) -> bool {
        let Some(c) = self.readers.remove(id) else {
            return false;
        };
        self.tally.departed += 1;
        for seq in c.held.into_iter().chain(c.queue) {
            self.unref(c.group, seq);
        }
        true
    }

    /// Consumer `id` owes every published batch from `seq` to the head
    /// (all still published, and for a group member its GPU's copies of
    /// them still there or yet to be placed in order: the caller checked,
    /// `Group::may_owe`): referenced and queued. A group member owes
    /// its GPU's copy, made now where there is none.
    pub(super) fn owe_published(&mut self, id: ConsumerId, seq: u64) {
        let head = self.ring.head();
        let Some(c) = self.readers.get_mut(id) else {
            return;
        };
        let through = match c.life {
            Life::Reading { through } => through.unwrap_or(u64::MAX),
            _ => u64::MAX,
        };
        for s in seq..head {
            let b = self.ring.published(s).expect("owed batches are published");
            if b.epoch > through {
                continue;
            }
            c.queue.push_back(s);
            if let Some(g) = c.group
                && !self.groups[g as usize].owe(s, b)
            {
                continue; // its copy is there: the host slot is not pinned for it
            }
            self.ring.pin(s);
        }
    }
}
