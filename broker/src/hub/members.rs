//! Consumers joining and leaving the hub: where a joiner starts (the one
//! rule, by `JoinPolicy`), saying goodbye, leaving.

use std::collections::VecDeque;

use batchcast::JoinPolicy;

use super::{Consumer, ConsumerId, Delivery, GroupId, Hub, HubError, Life, Sent, Slack, Window};

impl Hub {
    /// Subscribes a host consumer; returns its id and the first epoch it
    /// will see. (The broker joins through [`Hub::join_group`].)
    #[cfg(test)]
    pub(crate) fn join(
        &mut self,
        window: u32,
        join: JoinPolicy,
    ) -> Result<(ConsumerId, u64), HubError> {
        self.join_group(window, join, None, Delivery::Window)
    }

    /// Subscribes a consumer of group `group`'s copies (or, with `None`, of
    /// the host slots); returns its id and the first epoch it will see.
    pub(crate) fn join_group(
        &mut self,
        window: impl Into<Window>,
        join: JoinPolicy,
        group: Option<GroupId>,
        delivery: Delivery,
    ) -> Result<(ConsumerId, u64), HubError> {
        let group_slots = match group {
            None => None,
            Some(g) => {
                let grp = self
                    .groups
                    .get(g as usize)
                    .ok_or(HubError::UnknownGroup(g))?;
                if grp.failed() {
                    return Err(HubError::GroupFailed);
                }
                Some(grp.slots())
            }
        };
        let window = window.into();
        self.check_window(window, group_slots)?;
        let allowance = window.allowance();
        let window = window.units;
        let ahead = match delivery {
            Delivery::Window => window,
            Delivery::Ahead => group_slots.unwrap_or(self.cfg.slots),
        };
        let (floor, start_epoch, first, from_ring) = self.start_of(join, group);
        let owes = if from_ring {
            self.ring.head().saturating_sub(floor) as usize
        } else {
            0
        };
        let credit = self.readers.join_credit(self.ring.head(), owes);
        let id = self.readers.add(Consumer {
            window,
            ahead,
            group,
            floor,
            start_epoch,
            first,
            queue: VecDeque::new(),
            held: Vec::new(),
            life: Life::Reading { through: None },
            cuttable: false,
            slack: Slack { credit, allowance },
            sent: Sent::new(start_epoch),
        });
        if from_ring {
            self.owe_published(id, floor);
        }
        self.pump();
        Ok((id, start_epoch))
    }

    /// Whether consumer `id` may be cut from the shared stream and
    /// replayed to (a decoupled host consumer): the lag limit never
    /// detaches one that may.
    pub(crate) fn may_be_cut(&mut self, id: ConsumerId, may: bool) {
        if let Some(c) = self.readers.get_mut(id) {
            c.cuttable = may;
        }
    }

    /// The consumer wants nothing more; what it holds stays held until it
    /// releases it or leaves.
    pub fn goodbye(&mut self, id: ConsumerId) -> Result<(), HubError> {
        let c = self
            .readers
            .get_mut(id)
            .ok_or(HubError::UnknownConsumer(id))?;
        c.life = Life::Closing;
        let group = c.group;
        let queued: Vec<u64> = c.queue.drain(..).collect();
        for seq in queued {
            self.unref(group, seq);
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

    /// `oldest` (seq, epoch, index), or a later published batch so that a
    /// consumer starting there is no more than the lag limit behind the
    /// least behind of the others (`None`: none is, it starts at the head).
    fn within_lag_limit(&self, oldest: (u64, u64, u64)) -> Option<(u64, u64, u64)> {
        let Some(limit) = self.cfg.lag_limit else {
            return Some(oldest);
        };
        let head = self.ring.head();
        let Some(least) = self.readers.least_behind(head) else {
            return Some(oldest);
        };
        let earliest = head.saturating_sub(least as u64 + u64::from(limit));
        if oldest.0 >= earliest {
            return Some(oldest);
        }
        let b = self.ring.published(earliest)?;
        Some((earliest, b.epoch, b.index))
    }

    /// Where a consumer joining with `join` (of `group`'s copies, or the
    /// host slots) starts: the first seq it may be owed, its first epoch,
    /// its first batch (epoch, index), and whether that batch is already
    /// published (it is owed what the ring holds from there).
    fn start_of(
        &mut self,
        join: JoinPolicy,
        group: Option<GroupId>,
    ) -> (u64, u64, (u64, u64), bool) {
        if join == JoinPolicy::NextEpoch
            && !self.readers.anyone_reading()
            && self.ring.cursor().next_index != 0
        {
            // Paused mid-epoch with nobody subscribed: nobody would see the
            // rest of this epoch, so it is not produced; batches of it still
            // in flight are published to nobody.
            let next = self.ring.cursor().next_epoch + 1;
            self.ring.seek(next, 0);
        }
        // The first batch not yet published, skipping abandoned epochs.
        let (floor, epoch, index) = self.ring.first_unpublished();
        let (start_epoch, first) = match join {
            JoinPolicy::NextEpoch if index != 0 => (epoch + 1, (epoch + 1, 0)),
            _ => (epoch, (epoch, index)),
        };
        // `Now` starts where the readers are, not where the pipeline is:
        // at the oldest batch still published (the ring holds it: it is
        // sent from there, not recomputed), when there is one.
        // (Host consumers only: a GPU member's batches are its group's
        // copies, made as they are published.)
        // Never further behind than the lag limit allows: it would be
        // detached at once.
        let oldest = match (join, group) {
            (JoinPolicy::Now, None) => self
                .ring
                .oldest_live()
                .and_then(|o| self.within_lag_limit(o)),
            _ => None,
        };
        match oldest {
            Some((seq, e, i)) => (seq, e, (e, i), true),
            None => (floor, start_epoch, first, false),
        }
    }
}
