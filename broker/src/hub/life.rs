//! A consumer's life in the hub, and what is counted for it: its one
//! lifecycle state ([`Life`]), what the lag limit does not count as its
//! lag ([`Slack`]) and what it was sent ([`Sent`]).

#[cfg(doc)]
use super::{Hub, Window};

/// What the lag limit does not count as a consumer's lag.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slack {
    /// Batches the least behind reader owed beyond what this one owed when
    /// it joined, counted as behind (`Readers::join_credit`).
    pub(super) credit: usize,
    /// Units its window spans beyond its own batches ([`Window`]): behind
    /// by that much more is not lag.
    pub(super) allowance: usize,
}

/// What a consumer was sent, counted: every batch, and those of the epoch
/// it is in.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sent {
    pub(super) batches: u64,
    /// The epoch of the batches counted in `in_epoch`.
    pub(super) epoch: u64,
    pub(super) in_epoch: u64,
}

impl Sent {
    pub(super) fn new(epoch: u64) -> Sent {
        Sent {
            batches: 0,
            epoch,
            in_epoch: 0,
        }
    }

    /// A batch of `epoch` was sent.
    pub(super) fn count(&mut self, epoch: u64) {
        self.batches += 1;
        if epoch != self.epoch {
            self.epoch = epoch;
            self.in_epoch = 0;
        }
        self.in_epoch += 1;
    }
}

/// A consumer's life in the hub: one state, changed only by the hub's
/// methods named on each variant. In every state what it holds stays held
/// until it releases it or leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Life {
    /// Reads the shared stream (from joining, or [`Hub::rejoin_through`]);
    /// with `through`, gets no batch of a later epoch (it reads this
    /// epoch's rest, and the part it missed comes replayed next).
    Reading { through: Option<u64> },
    /// Cut from the shared stream ([`Hub::cut`]): nothing more is published
    /// to it until it [rejoins](Hub::rejoin).
    Cut,
    /// Was sent the end of the stream (`pump`); a joiner's end is taken
    /// back if it is cut as it joins ([`Hub::cut_at_join`]).
    Ended,
    /// Said goodbye ([`Hub::goodbye`]) or its GPU failed: nothing more is
    /// sent. Final.
    Closing,
}

impl Life {
    /// Whether it reads the shared stream (cut, ended and closing ones do not).
    pub(super) fn reading(self) -> bool {
        matches!(self, Life::Reading { .. })
    }
}
