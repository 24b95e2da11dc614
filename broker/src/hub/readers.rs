//! Every reader of the hub by id, and how far behind each one is: the
//! numbers the lag limit and a joiner's credit are counted from.
//!
//! # Rules
//!
//! * Ids are given out once, in joining order; the hub visits readers in
//!   that order (who is sent first is fixed, not the map's whim).
//! * A reader's lag is how far behind the head the oldest batch it owes
//!   is, plus its join credit ([`Readers::join_credit`]); what counts
//!   against the lag limit is how much further behind it is than the least
//!   behind reader. Readers saying goodbye neither lag nor count.

use std::collections::BTreeMap;

use super::{Consumer, ConsumerId};

/// Every reader of the hub by id (see the module's rules).
#[derive(Debug)]
pub(super) struct Readers {
    map: BTreeMap<ConsumerId, Consumer>,
    /// The id the next reader gets.
    next_id: ConsumerId,
}

impl Readers {
    pub(super) fn new() -> Readers {
        Readers {
            map: BTreeMap::new(),
            next_id: 1,
        }
    }

    /// Adds a reader; returns its id.
    pub(super) fn add(&mut self, c: Consumer) -> ConsumerId {
        let id = self.next_id;
        self.next_id += 1;
        self.map.insert(id, c);
        id
    }

    pub(super) fn remove(&mut self, id: ConsumerId) -> Option<Consumer> {
        self.map.remove(&id)
    }

    pub(super) fn get(&self, id: ConsumerId) -> Option<&Consumer> {
        self.map.get(&id)
    }

    pub(super) fn get_mut(&mut self, id: ConsumerId) -> Option<&mut Consumer> {
        self.map.get_mut(&id)
    }

    /// Every reader, in joining order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (ConsumerId, &Consumer)> {
        self.map.iter().map(|(&id, c)| (id, c))
    }

    /// Every reader, in joining order, to change.
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = (ConsumerId, &mut Consumer)> {
        self.map.iter_mut().map(|(&id, c)| (id, c))
    }

    /// The first reader after `id` (after none: the first), in joining
    /// order: a walk over readers that may leave on the way.
    pub(super) fn next_after(&self, id: Option<ConsumerId>) -> Option<ConsumerId> {
        let from = id.map_or(0, |id| id + 1);
        self.map.range(from..).next().map(|(&id, _)| id)
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether some reader still takes batches (one that said goodbye, or
    /// was sent the end of the stream, only gives back what it holds).
    pub(super) fn anyone_reading(&self) -> bool {
        self.map.values().any(|c| c.life.reading())
    }

    /// The oldest batch a reader of the shared stream still holds or is
    /// owed (`reading`), or any reader not saying goodbye (`!reading`).
    pub(super) fn tail(&self, reading: bool) -> Option<u64> {
        self.map
            .values()
            .filter(|c| {
                if reading {
                    c.life.reading()
                } else {
                    !c.closing()
                }
            })
            .filter_map(Consumer::oldest_owed)
            .min()
    }

    /// How far behind `head` a reader is for the lag limit: what it owes
    /// (its oldest owed batch) plus its join credit.
    fn lag_behind(c: &Consumer, head: u64) -> usize {
        c.behind(head) + c.slack.credit
    }

    /// The least [`Readers::lag_behind`] of the readers (readers saying
    /// goodbye left out); `None` with no such reader. The lag limit is
    /// counted from it.
    pub(super) fn least_behind(&self, head: u64) -> Option<usize> {
        self.map
            .values()
            .filter(|c| !c.closing())
            .map(|c| Readers::lag_behind(c, head))
            .min()
    }

    /// Each reader's lag: how much further behind it is than the least
    /// behind reader. Readers saying goodbye neither lag nor count.
    pub(super) fn lags(&self, head: u64) -> Vec<(ConsumerId, usize)> {
        let least = self.least_behind(head).unwrap_or(0);
        self.map
            .iter()
            .filter(|(_, c)| !c.closing())
            .map(|(&id, c)| (id, Readers::lag_behind(c, head).saturating_sub(least)))
            .collect()
    }

    /// What a reader joining now, `behind` batches behind `head` (what the
    /// ring holds from where it starts), is credited with for the lag
    /// limit: how much further behind the least behind reader is. A reader
    /// sent the ring ahead (a mailbox), or with a full queue, owes the
    /// whole ring while it keeps up; one that joins at the next batch owes
    /// nothing yet. Without the credit the first would look a ring behind
    /// the second, and be detached, for batches the second skipped by
    /// joining late. With it the two start level, and a lag is what either
    /// falls behind from there.
    pub(super) fn join_credit(&self, head: u64, behind: usize) -> usize {
        self.least_behind(head)
            .map_or(0, |least| least.saturating_sub(behind))
    }
}
