//! The hub's numbers for `stats`: per stream, per consumer, per group.

use super::{GroupId, View};

/// One group's numbers for stats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct GroupCounts {
    pub slots: u32,
    pub in_use: u32,
    /// Batches waiting for a free group slot.
    pub waiting: u32,
}

/// Per-consumer numbers for stats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ConsumerCounts {
    pub window: u32,
    pub delivered: u64,
    pub held: u32,
    pub queued: u32,
    pub epoch: u64,
}

/// Per-stream numbers for stats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HubCounts {
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

impl View<'_> {
    pub fn counts(&self) -> HubCounts {
        let (free, filling) = self.ring.counts();
        HubCounts {
            free,
            filling,
            in_use: self.cfg.slots - free - filling,
            produced: self.tally.produced,
            epoch: self.tally.last_epoch,
            finished: self.finished(),
            deliveries: self.tally.deliveries,
            departed: self.tally.departed,
            detached: self.tally.detached,
        }
    }

    pub(crate) fn group_counts(&self, g: GroupId) -> Option<GroupCounts> {
        self.groups.get(g as usize).map(super::group::Group::counts)
    }
}
