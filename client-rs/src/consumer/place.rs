//! Where a consumer is in its stream: the position its state saves, the
//! batches of its epoch, the epochs it ended, rotated epochs.

use crate::proto::{EpochEnd, Position};

use super::rotate::Rotated;

#[derive(Debug)]
pub(super) struct Place {
    /// This consumer's batches handed out in the current epoch.
    pub(super) epoch_batches: (u64, u64),
    /// Where the first batch handed out began.
    pub(super) started_at: Option<Position>,
    /// Where the next batch handed out begins (this consumer's state).
    pub(super) next_at: Position,
    /// Rotated epochs, as received and as handed out.
    pub(super) rotated: Rotated,
    /// The last epoch whose end was handed out.
    pub(super) ended_epoch: Option<u64>,
    /// Ends of epochs read among notices a cut took back, until the cut's
    /// own notice says which count.
    pub(super) deferred: Vec<EpochEnd>,
    /// Where the shared stream's samples become this consumer's (they were
    /// replayed before, or it resumes there).
    pub(super) skip: Option<Position>,
}

impl Place {
    pub(super) fn new(skip: Option<Position>, next_at: Position, rotated: Rotated) -> Place {
        Place {
            epoch_batches: (0, 0),
            started_at: None,
            next_at,
            rotated,
            ended_epoch: None,
            deferred: Vec::new(),
            skip,
        }
    }
}
