//! The hub seen from outside: what the runtime, the stats and the rules
//! ask of it without changing it. A [`View`] borrows the hub's owners
//! read-only, so nothing asked here can change a reader, a slot or a group.

use batchcast::JoinPolicy;

use super::group::Group;
use super::readers::Readers;
use super::{Consumer, ConsumerId, GroupId, HubConfig, Ring, Tally};

/// The hub, to look at ([`Hub::view`](super::Hub::view)).
#[derive(Debug, Clone, Copy)]
pub(crate) struct View<'a> {
    pub(super) cfg: &'a HubConfig,
    pub(super) ring: &'a Ring,
    pub(super) readers: &'a Readers,
    pub(super) groups: &'a [Group],
    pub(super) tally: &'a Tally,
}

impl<'a> View<'a> {
    /// True once every epoch has been produced (finite streams only).
    pub fn exhausted(&self) -> bool {
        self.cfg
            .epochs
            .is_some_and(|e| self.ring.cursor().next_epoch >= e)
    }

    /// True once every batch has been produced, published and given back.
    pub fn finished(&self) -> bool {
        self.exhausted()
            && !self.ring.filling()
            && self.ring.oldest_published().is_none()
            && self.groups.iter().all(Group::is_empty)
    }

    /// Whether consumer `id` reads the shared stream and has nothing it
    /// could be sent now: nothing is queued for it, or (a GPU member) the
    /// copy of the next batch queued for it waits for a slot of its GPU's
    /// ring that another member keeps (not one it keeps itself: it then
    /// waits for itself). It waits for data.
    pub(crate) fn starved(&self, id: ConsumerId) -> bool {
        let Some(c) = self.readers.get(id).filter(|c| c.life.reading()) else {
            return false;
        };
        match (c.queue.front(), c.group) {
            (None, _) => true,
            (Some(&seq), Some(g)) => self.groups[g as usize]
                .blocked_by(seq)
                .is_some_and(|oldest| !c.held.contains(&oldest)),
            (Some(_), None) => false,
        }
    }

    /// Whether `epoch` lies past the stream's last one (a finite stream's;
    /// a member's next run may lie there).
    pub fn past_end(&self, epoch: u64) -> bool {
        self.cfg.epochs.is_some_and(|e| epoch >= e)
    }

    /// Whether the pipeline could be given work now (the next slot of the
    /// ring free, someone to produce for, epochs left).
    pub fn can_start(&self) -> bool {
        self.wants_batches() && self.ring.free_slots() > 0
    }

    /// Whether the pipeline would be given work if a slot were free
    /// (someone to produce for, epochs left).
    pub fn wants_batches(&self) -> bool {
        (self.ring.cursor().started || self.readers.len() as u32 >= self.cfg.min_consumers)
            && self.readers.anyone_reading()
            && !self.exhausted()
    }

    /// Consumers subscribed now.
    pub fn members(&self) -> u32 {
        self.readers.len() as u32
    }

    /// Reader `id` (only the hub changes it).
    pub(crate) fn reader(&self, id: ConsumerId) -> Option<&'a Consumer> {
        self.readers.get(id)
    }

    /// The host ring (only the hub changes it).
    pub(crate) fn ring(&self) -> &'a Ring {
        self.ring
    }

    /// The oldest batch a consumer reading the shared stream still holds or
    /// is owed: the ring keeps everything from there to the head for its
    /// members, so one merging back there pins nothing they do not.
    pub(crate) fn members_tail(&self) -> Option<u64> {
        self.readers.tail(true)
    }

    /// Whether consumer `id`, rejoined through `epoch`, was sent all of
    /// that epoch: nothing is queued for it, and every batch of the epoch
    /// was published (the next to be made is of a later one, or the
    /// stream is made to its end).
    pub(crate) fn read_through(&self, id: ConsumerId, epoch: u64) -> bool {
        let Some(c) = self.readers.get(id) else {
            return false;
        };
        c.life
            == (super::Life::Reading {
                through: Some(epoch),
            })
            && c.queue.is_empty()
            && !self.ring.in_flight().any(|(_, e)| e <= epoch)
            && self.ring.cursor().next_epoch > epoch
    }

    /// The batch in the ring's next slot, which the pipeline waits for
    /// (`None` if the slot is free or being filled), and the consumers
    /// that owe it: host consumers that hold it or are to be sent it, and
    /// where a GPU's copy of it waits for a free slot of that GPU's ring,
    /// the members that owe the oldest copy there. Once every epoch was
    /// made the pipeline waits for no slot: what is left to wait for is a
    /// GPU's copy that waits for a slot of its ring, and the oldest batch
    /// whose copy does pins (owed by that ring's members alone: a host
    /// consumer holding a batch then keeps no one waiting).
    pub fn pinning(&self) -> Option<(u64, Vec<ConsumerId>)> {
        let (seq, host) = match self.exhausted() {
            false => (self.ring.pinned()?, true),
            true => {
                let blocked = self.groups.iter().filter_map(Group::first_blocked).min();
                (blocked?, false)
            }
        };
        let owes = |c: &Consumer, s: u64| c.held.contains(&s) || c.queue.contains(&s);
        let mut owe: Vec<ConsumerId> = self
            .readers
            .iter()
            .filter(|(_, c)| host && c.group.is_none() && owes(c, seq))
            .map(|(id, _)| id)
            .collect();
        // A GPU's copy of it waits for a free slot of that GPU's ring: the
        // members owing the oldest copy there keep it from being freed,
        // and the members owing the copy that waits keep it wanted (cut,
        // they owe it no more; a copy nobody owes is never made, and its
        // host slot goes: a member stopped holding the oldest copy then
        // holds only its own GPU ring, whose other readers are cut too).
        for (g, grp) in self.groups.iter().enumerate() {
            if let Some(oldest) = grp.blocked_by(seq) {
                owe.extend(
                    self.readers
                        .iter()
                        .filter(|(_, c)| {
                            c.group == Some(g as GroupId) && (owes(c, oldest) || owes(c, seq))
                        })
                        .map(|(id, _)| id),
                );
            }
        }
        Some((seq, owe))
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
    /// host slots) starts, once abandoned epochs are skipped
    /// (`Hub::join_group`): the first seq it may be owed, its first epoch,
    /// its first batch (epoch, index), and whether that batch is already
    /// published (it is owed what the ring holds from there).
    pub(super) fn start_of(
        &self,
        join: JoinPolicy,
        group: Option<GroupId>,
    ) -> (u64, u64, (u64, u64), bool) {
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
