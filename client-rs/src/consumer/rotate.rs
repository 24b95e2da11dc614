//! A rotated epoch as this consumer reads it ([`crate::rotation`]): the
//! broker's `Rotate` ends its replay at an epoch's start and has the
//! shared stream carry the epoch on from a later point; the shared
//! stream's end of that epoch is not the epoch's end for it; a `Cut` at
//! the epoch's start follows, and the part it missed comes replayed, the
//! last of its batches ending the epoch. Its state names the rotation,
//! so a resume (or a ride through a broker restart) reads the rest of
//! the epoch in the same order.

use super::events::Inbox;
use crate::batch::Shared;
use crate::batcher::Run;
use crate::error::{Error, Result};
use crate::proto::Position;
use crate::rotation::{self, Rotation};

/// The rotations a consumer is in, as received and as handed out.
#[derive(Debug, Default)]
pub(super) struct Rotated {
    /// The epoch the shared stream carries on from a rotation point until
    /// the cut that replays its start (it moves to the replay then).
    pub(super) receiving: Option<Rotation>,
    /// The rotation of the epoch being handed out, or of a later one
    /// (its batches may still wait behind earlier epochs').
    pub(super) handing: Option<Rotation>,
}

impl Rotated {
    /// A consumer resuming from a state read rotated: its replay walks
    /// the rest of the epoch in that order.
    pub(super) fn resumed(rotation: Option<Rotation>) -> Rotated {
        Rotated {
            receiving: rotation,
            handing: rotation,
        }
    }

    /// Whether the shared stream's end of `epoch` is not the epoch's end
    /// for this consumer (its start comes replayed after it).
    pub(super) fn holds_end_of(&self, epoch: u64) -> bool {
        self.receiving.is_some_and(|r| r.epoch == epoch && r.at > 0)
    }

    /// Where the batch after `run` begins, in this consumer's order; the
    /// rotation of the epoch being handed out moves on with it.
    pub(super) fn after(&mut self, run: &Run, per_epoch: u64) -> Position {
        let at = Position {
            epoch: run.epoch,
            sample: run.first,
        };
        let step = rotation::step(at, run.samples, per_epoch, self.handing);
        self.handing = step.rotation;
        // Into a rotated epoch from the one before: it begins at its
        // point (within it, its start is the part read last).
        if step.next.epoch > run.epoch {
            self.start_of(step.next)
        } else {
            step.next
        }
    }

    /// `p`, or the rotation point if `p` is the start of a rotated epoch
    /// none of whose batches was handed out yet.
    pub(super) fn start_of(&self, p: Position) -> Position {
        match self.handing {
            Some(r) if r.owed_from() == p && r.at > 0 => Position {
                epoch: r.epoch,
                sample: r.at,
            },
            _ => p,
        }
    }

    /// The rotation a state taken at `next_at` carries.
    pub(super) fn of_state(&self, next_at: Position) -> Option<Rotation> {
        self.handing
            .filter(|r| r.epoch == next_at.epoch && r.at > 0)
    }
}

impl Inbox {
    /// The broker rotated this consumer into the epoch of `at`: its replay
    /// ends at that epoch's start (batches started before it still come,
    /// as with a merge); the shared stream's
    /// samples from `at` on are its, and the epoch's samples before `at`
    /// follow the shared stream's part, replayed.
    pub(super) fn take_rotate(&mut self, shared: &Shared, at: Position) -> Result<()> {
        let per_epoch = shared.welcome.schema.samples_per_epoch;
        let start = Position {
            epoch: at.epoch,
            sample: 0,
        };
        let Some(r) = self
            .replay
            .active
            .as_mut()
            .filter(|r| r.open() && r.at() <= start && at.sample > 0 && at.sample < per_epoch)
        else {
            return Err(Error::Unexpected(format!(
                "rotated into epoch {} at sample {} without a replay open at that epoch's start",
                at.epoch, at.sample
            )));
        };
        r.end_at(start);
        if r.received() && r.queue.is_empty() {
            self.replay.seq = r.next_seq;
            self.replay.active = None;
        }
        let rot = Rotation {
            epoch: at.epoch,
            at: at.sample,
        };
        self.place.rotated.receiving = Some(rot);
        self.place.rotated.handing = Some(rot);
        if self.place.next_at == start {
            self.place.next_at = at;
        }
        self.place.skip = Some(at);
        let mut b = shared.batching.lock().unwrap_or_else(|p| p.into_inner());
        b.batcher.skip_to(at.epoch, at.sample);
        drop(b);
        tracing::debug!(
            ?at,
            "rotated: the shared stream carries this epoch on from here; its start comes after its end"
        );
        Ok(())
    }
}
