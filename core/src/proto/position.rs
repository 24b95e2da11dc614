//! Places in a stream: a position, and a rotated epoch's order.

use serde::{Deserialize, Serialize};

/// A place in a stream: sample `sample` (counted from 0 in the epoch's
/// order) of epoch `epoch`. The stream's order is a pure function of its
/// seed and the epoch, so a position names the same samples for every
/// consumer and every run of the same config.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Position {
    pub epoch: u64,
    pub sample: u64,
}

impl Position {
    /// The position `samples` samples on, in epochs of `per_epoch` samples
    /// (an epoch's end is the next epoch's start).
    pub fn advance(self, samples: u64, per_epoch: u64) -> Position {
        let sample = self.sample.saturating_add(samples);
        if sample >= per_epoch {
            Position {
                epoch: self.epoch + 1,
                sample: 0,
            }
        } else {
            Position {
                epoch: self.epoch,
                sample,
            }
        }
    }
}

/// Epoch `epoch` is read from sample `at` on, and its samples before `at`
/// after its end (protocol 20; the order: [`crate::rotation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rotation {
    pub epoch: u64,
    pub at: u64,
}
