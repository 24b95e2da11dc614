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
//!   published batches wait in its queue until it releases one. A consumer
//!   that joined with [`Delivery::Ahead`] is sent every batch as soon as it
//!   is published (up to the slots of its ring) and keeps to its window
//!   itself: what it was sent it owes, exactly as what is queued for it.
//! * [`Hub::start_batch`] returns `None` when no slot is free: the pipeline
//!   blocks (back-pressure). Memory is the fixed set of slots; every queue
//!   here is bounded by the number of slots.
//! * The slots are a ring: batch `seq` takes slot `seq mod slots` (the
//!   host arena holds samples in rings, and a batch's samples are the
//!   `seq × batch_size ..` cells), so the pipeline never runs more than
//!   `slots` batches past the oldest batch anyone owes.
//! * The slowest consumer sets the pace. With a lag limit, a consumer whose
//!   oldest owed batch is more than `lag_limit` batches behind the others'
//!   is detached (for one that releases in order: it owes more than that;
//!   a consumer that joins beside others starts level with the least
//!   behind of them, see `Readers::join_credit`),
//!   unless it may be cut ([`Hub::may_be_cut`], decoupled pace): a host
//!   consumer or a GPU group's member alike.
//! * A consumer that leaves (disconnects, dies, is detached) gives back all
//!   it held and all that was queued for it at once. One that said goodbye
//!   takes nothing more: with nobody else, the stream pauses.
//! * Joining: [`JoinPolicy::NextEpoch`](batchcast::JoinPolicy::NextEpoch) starts at the first epoch of which
//!   nothing has been published; [`JoinPolicy::Immediate`](batchcast::JoinPolicy::Immediate) at the next batch
//!   published. With no consumer at all, the pipeline pauses; a consumer
//!   joining a paused stream for the next epoch makes it skip the rest of the
//!   epoch nobody was watching.
//! * Batches are published in sequence order even when the pipeline finishes
//!   them out of order.
//! * Decoupled pace: a host consumer may be cut ([`Hub::cut`]): what was
//!   queued for it and what it was sent but never took are given back,
//!   what it took stays held, and nothing is published to it until it
//!   re-joins ([`Hub::rejoin`]) at a batch still published, from where it
//!   owes every batch again, in order.
//!
//! # Groups: copies in other memory
//!
//! A group ([`Hub::add_group`]) is a second ring of slots holding copies of
//! batches, one per GPU, read by the consumers that joined the group. A
//! batch a member owes is copied once into the group's ring, laid out as
//! the host's (batch `seq` in slot `seq mod slots`, in sequence order, the
//! live ones less than `slots` apart, so a member's runs of its own batch
//! size are spans of it; [`Hub::take_copies`] says which, [`Hub::copied`]
//! reports the end).
//! The host slot is pinned only until its copy has completed; the group
//! slot is pinned by the members that owe the batch, exactly as host slots
//! are by host consumers. So host and group slots are released
//! independently: a host slot is refilled while a GPU still reads its copy.
//! A member is sent a batch only once its copy has completed.
//!
//! # Layout
//!
//! The state is split by owner: [`Ring`] (`ring.rs`), each GPU's `Group`
//! (`group.rs`), the `Readers` (`readers.rs`), each changed only here.
//! [`Hub`] takes the runtime's commands: here the types, releases and the
//! pipeline's side (`start_batch`, `finish_batch`); `members.rs` joining
//! and leaving; `cut.rs` cutting a consumer from the shared stream and
//! re-joining it (decoupled pace); `groups.rs` GPU groups and their copies.
//! Every command ends in the delivery engine `Post` (`send.rs`: publishing,
//! sending within windows, the lag limit, ordering copies,
//! unreferencing). What is asked without changing anything goes through
//! [`View`] (`view.rs`; `window.rs` the join checks, `counts.rs` numbers
//! for stats). `invariants.rs` (tests): every
//! rule above, checked after each step of the property tests (`tests.rs`).

use std::collections::VecDeque;

use batchcast::proto::ErrorCode;

use group::Group;
use life::{Life, Sent, Slack};
use readers::Readers;
use ring::Published;
pub(crate) use ring::Ring;
use send::Post;
pub(crate) use view::View;

pub(crate) type ConsumerId = u64;
pub(crate) type SlotId = u32;
/// A ring of copies in other memory (one GPU); see [`Hub::add_group`].
pub(crate) type GroupId = u32;

pub(crate) use counts::GroupCounts;
pub use error::HubError;
pub use window::Window;

/// A copy the runtime must make: host slot `host`, holding batch `seq`,
/// into slot `slot` of group `group`'s ring. The host slot stays as it is
/// until the copy is reported with [`Hub::copied`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CopyOrder {
    pub group: GroupId,
    pub seq: u64,
    pub host: SlotId,
    pub slot: SlotId,
}

/// Limits and shape of one stream.
#[derive(Debug, Clone)]
pub(crate) struct HubConfig {
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
pub(crate) struct Work {
    pub seq: u64,
    pub epoch: u64,
    pub index: u64,
    pub slot: SlotId,
}

/// How far ahead of its releases a consumer is sent batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// At most its window of unreleased batches; the rest waits here.
    Window,
    /// Every batch as soon as it is published: the consumer reads notices
    /// from a mailbox and keeps to its window itself, so it never waits for
    /// the broker to look at its releases. It owes what it was sent, as a
    /// windowed consumer owes what is queued for it: slots, flow control
    /// and the lag limit are the same.
    Ahead,
}

/// Something the runtime must tell one consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outbound {
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
        /// `LagLimit`, or `HoldLimit` (decoupled pace).
        code: ErrorCode,
    },
}

/// The first epoch a stream never reaches: a position at or past it (a
/// forged resume or registration) is refused rather than counted on until
/// the epoch number wraps.
pub(crate) const MAX_EPOCH: u64 = 1 << 48;

/// A reader of the hub: where it starts, what is queued for it and what
/// it holds, its life. The stream runtime looks at one through
/// [`View::reader`]; only the hub changes it.
#[derive(Debug, Clone)]
pub(crate) struct Consumer {
    window: u32,
    /// Unreleased batches it may be sent: its window, or its ring's slots
    /// for [`Delivery::Ahead`].
    ahead: u32,
    /// Reads copies in this group instead of host slots.
    group: Option<GroupId>,
    /// Receives batches with `seq >= floor` and `epoch >= start_epoch`.
    floor: u64,
    start_epoch: u64,
    /// Epoch and index of the first batch it gets (at `floor`, or the
    /// start of `start_epoch`).
    first: (u64, u64),
    /// Published for it, not yet sent (in sequence order).
    queue: VecDeque<u64>,
    /// Sent, not yet released.
    held: Vec<u64>,
    /// Where it is in its life: reading, cut, told the end, saying goodbye.
    life: Life,
    /// May be cut (decoupled pace: [`Hub::may_be_cut`]): the lag limit
    /// leaves it alone, since falling behind gets it cut and replayed to.
    cuttable: bool,
    /// What the lag limit does not count as its lag.
    slack: Slack,
    /// What it was sent, counted.
    sent: Sent,
}

impl Consumer {
    fn wants(&self, seq: u64, epoch: u64) -> bool {
        let Life::Reading { through } = self.life else {
            return false;
        };
        seq >= self.floor && epoch >= self.start_epoch && through.is_none_or(|t| epoch <= t)
    }
    fn closing(&self) -> bool {
        self.life == Life::Closing
    }
    /// How far behind the first unpublished batch `head` the oldest batch
    /// it owes is: what it keeps the ring from reusing (batches are slots
    /// of a ring, reused in order). A consumer that keeps up and releases
    /// in order is behind by exactly what it owes; one that keeps an old
    /// batch while taking newer ones is behind by everything since.
    fn behind(&self, head: u64) -> usize {
        self.oldest_owed()
            .map_or(0, |s| head.saturating_sub(s) as usize)
    }
    /// The oldest batch it holds or is owed: the slot it keeps from reuse.
    fn oldest_owed(&self) -> Option<u64> {
        self.held.iter().chain(self.queue.front()).min().copied()
    }

    /// Epoch and index in it of the first batch it gets (unless the
    /// stream ends before): where the shared stream begins for it.
    pub(crate) fn first_batch(&self) -> (u64, u64) {
        self.first
    }

    /// How many batches wait for it here, unsent, if it takes batches from
    /// the shared stream now (not cut, closing or ended).
    pub(crate) fn reading(&self) -> Option<usize> {
        self.life.reading().then_some(self.queue.len())
    }

    /// Whether it was sent batch `seq` and has not released it.
    pub(crate) fn holds(&self, seq: u64) -> bool {
        self.held.contains(&seq)
    }

    /// The batches it was sent and has not released.
    pub(crate) fn held(&self) -> &[u64] {
        &self.held
    }

    /// Whether it is cut from the shared stream.
    pub(crate) fn is_cut(&self) -> bool {
        self.life == Life::Cut
    }

    /// Its numbers for stats.
    pub(crate) fn counts(&self) -> counts::ConsumerCounts {
        counts::ConsumerCounts {
            window: self.window,
            delivered: self.sent.batches,
            held: self.held.len() as u32,
            queued: self.queue.len() as u32,
            epoch: self.sent.epoch,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Hub {
    cfg: HubConfig,
    /// The host ring: slots, batches in flight and published, the cursor.
    ring: Ring,
    /// Every reader by id, and their lags.
    readers: Readers,
    groups: Vec<Group>,
    out: Vec<(ConsumerId, Outbound)>,
    copies: Vec<CopyOrder>,
    /// What the hub has done, counted (for stats).
    tally: Tally,
}

/// What the hub has done, counted (for stats).
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
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
            ring: Ring::new(cfg.slots),
            cfg,
            readers: Readers::new(),
            groups: Vec::new(),
            out: Vec::new(),
            copies: Vec::new(),
            tally: Tally::default(),
        }
    }

    /// The hub, to look at: every question the runtime and the stats ask.
    pub(crate) fn view(&self) -> View<'_> {
        View {
            cfg: &self.cfg,
            ring: &self.ring,
            readers: &self.readers,
            groups: &self.groups,
            tally: &self.tally,
        }
    }

    /// The delivery engine over the hub's owners: what every command ends
    /// with (publishing, sending, the lag limit, copies, unreferencing).
    fn post(&mut self) -> Post<'_> {
        Post {
            cfg: &self.cfg,
            ring: &mut self.ring,
            readers: &mut self.readers,
            groups: &mut self.groups,
            out: &mut self.out,
            copies: &mut self.copies,
            tally: &mut self.tally,
        }
    }

    /// Swaps what must be sent, in order, with `empty` (so the runtime and
    /// the hub keep reusing two buffers).
    pub(crate) fn swap_outbound(&mut self, empty: &mut Vec<(ConsumerId, Outbound)>) {
        debug_assert!(empty.is_empty());
        std::mem::swap(&mut self.out, empty);
    }

    /// Takes what must be sent, in order (tests; the runtime swaps).
    #[cfg(test)]
    pub fn take_outbound(&mut self) -> Vec<(ConsumerId, Outbound)> {
        std::mem::take(&mut self.out)
    }

    /// Takes the copies to start, in order.
    pub fn take_copies(&mut self) -> Vec<CopyOrder> {
        std::mem::take(&mut self.copies)
    }

    /// Changes how many consumers the stream waits for before it starts
    /// (when one that was counted on will never come); no effect once it
    /// has started.
    pub fn set_min_consumers(&mut self, min: u32) {
        if !self.ring.cursor().started {
            self.cfg.min_consumers = min;
        }
    }

    pub fn release(&mut self, id: ConsumerId, seq: u64) -> Result<(), HubError> {
        let c = self
            .readers
            .get_mut(id)
            .ok_or(HubError::UnknownConsumer(id))?;
        let pos = c
            .held
            .iter()
            .position(|&s| s == seq)
            .ok_or(HubError::NotHeld { seq })?;
        c.held.swap_remove(pos);
        let group = c.group;
        self.post().unref(group, seq);
        self.post().pump_after_release(id);
        Ok(())
    }

    /// Ends an endless stream here if no batch of the next epoch has been
    /// started (an external producer stopping between epochs): consumers get
    /// the end of the stream after what was already produced.
    pub fn end_at_epoch_boundary(&mut self) -> bool {
        let cursor = self.ring.cursor();
        if cursor.next_index != 0 {
            return false;
        }
        self.cfg.epochs = Some(cursor.next_epoch);
        self.post().pump();
        true
    }

    /// Starts a stream that has not begun (no batch started, nobody
    /// subscribed) at batch `index` of `epoch`: the first consumer resumes
    /// there (after a broker restart, say), and computing everything before
    /// it for nobody would keep it waiting. `false`, and nothing changes,
    /// once a batch was started or someone subscribed, or for a place past
    /// the stream.
    pub fn seek(&mut self, epoch: u64, index: u64) -> bool {
        let past = self.cfg.epochs.is_some_and(|e| epoch >= e)
            || epoch >= MAX_EPOCH
            || index >= self.cfg.batches_per_epoch;
        let cursor = self.ring.cursor();
        if cursor.started || cursor.next_seq != 0 || !self.readers.is_empty() || past {
            return false;
        }
        self.ring.seek(epoch, index);
        true
    }

    /// Gives the pipeline its next batch to fill, or `None` if it must wait
    /// (no free slot, no consumer yet, or all epochs produced).
    pub fn start_batch(&mut self) -> Option<Work> {
        if !self.view().can_start() {
            return None;
        }
        let work = self.ring.start(self.cfg.batches_per_epoch);
        Some(work)
    }

    /// The pipeline has filled batch `seq` with `samples` samples. It is
    /// published once every earlier batch is.
    pub fn finish_batch(&mut self, seq: u64, samples: u64) {
        for (seq, b) in self.ring.finish(seq, samples) {
            self.post().publish(seq, b);
        }
        self.post().pump();
    }
}

mod counts;
mod cut;
mod error;
mod group;
mod groups;
#[cfg(test)]
mod invariants;
mod life;
mod members;
#[cfg(test)]
mod mixed;
mod readers;
mod ring;
mod send;
#[cfg(test)]
mod tests;
mod view;
mod window;
