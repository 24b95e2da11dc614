//! A rotated epoch, as plain logic (no I/O): a consumer that reaches an
//! epoch's start after the shared stream left it behind by more than the
//! ring holds (a `join = "now"` joiner on a decoupled stream, one cut and
//! replayed to that point) reads that epoch from where the shared stream
//! still is, and the part it missed after the epoch's end, replayed.
//!
//! # Rules
//!
//! * Epoch `e` rotated at `at` (0 < `at` < the epoch's samples) is read as
//!   its samples `[at, n)` then `[0, at)`; its end comes after sample
//!   `at - 1`. Every sample once, the epoch's own samples only.
//! * Batches never span the two parts: the first part's last batch ends
//!   at `n` (short if the batch size does not divide `n - at`), the second
//!   part's at `at`. The broker rotates only at a multiple of the
//!   consumer's batch size, so its batches are the very batches (the same
//!   samples together) an unrotated consumer gets, in another order; a
//!   consumer resumed from a rotated state in another batch size may get a
//!   short batch at `at`.
//! * The cost is the second part: `at` samples made again for this
//!   consumer once in the epoch, however long the run (an unrotated joiner
//!   as fast as the others never merges, and is replayed everything).

use crate::proto::Position;
pub use crate::proto::Rotation;

/// One batch in a consumer's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub samples: u64,
    /// Its epoch ends with this batch.
    pub ends_epoch: bool,
    /// Where the next batch begins.
    pub next: Position,
    /// The rotation that still applies after it.
    pub rotation: Option<Rotation>,
}

impl Rotation {
    /// Whether it applies at `p`: in its epoch, a real rotation.
    fn covers(self, p: Position) -> bool {
        p.epoch == self.epoch && self.at > 0
    }

    /// Where the rotated part begins: the start of the samples that come
    /// after the epoch's end.
    pub fn owed_from(self) -> Position {
        Position {
            epoch: self.epoch,
            sample: 0,
        }
    }

    /// Whether `p` lies in the part read last (`[0, at)`).
    pub fn in_owed_part(self, p: Position) -> bool {
        self.covers(p) && p.sample < self.at
    }
}

/// The batch of at most `size` samples that begins at `p` in a consumer's
/// order, in epochs of `per_epoch` samples, under `rotation` (none: the
/// stream's order, an epoch's last batch short).
pub fn step(p: Position, size: u64, per_epoch: u64, rotation: Option<Rotation>) -> Step {
    let Some(rot) = rotation.filter(|r| r.covers(p)) else {
        let samples = size.min(per_epoch - p.sample);
        return Step {
            samples,
            ends_epoch: p.sample + samples == per_epoch,
            next: p.advance(samples, per_epoch),
            // A rotation of a later epoch still waits.
            rotation: rotation.filter(|r| r.epoch > p.epoch),
        };
    };
    if p.sample < rot.at {
        // The part read last: it ends the epoch at `at`.
        let samples = size.min(rot.at - p.sample);
        let ends = p.sample + samples == rot.at;
        return Step {
            samples,
            ends_epoch: ends,
            // The epoch ends at `at`: the next starts after it.
            next: p.advance(samples, rot.at),
            rotation: (!ends).then_some(rot),
        };
    }
    // The part read first: at its end the epoch goes on from its start.
    let samples = size.min(per_epoch - p.sample);
    let next = if p.sample + samples == per_epoch {
        rot.owed_from()
    } else {
        Position {
            epoch: p.epoch,
            sample: p.sample + samples,
        }
    };
    Step {
        samples,
        ends_epoch: false,
        next,
        rotation: Some(rot),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walk(from: Position, size: u64, n: u64, rot: Option<Rotation>, until: u64) -> Vec<Step> {
        let mut out = Vec::new();
        let (mut p, mut r) = (from, rot);
        while p.epoch < until {
            let s = step(p, size, n, r);
            out.push(s);
            p = s.next;
            r = s.rotation;
        }
        out
    }

    #[test]
    fn a_rotated_epoch_is_every_sample_once_in_the_same_batches() {
        let n = 100;
        let rot = Rotation { epoch: 1, at: 64 };
        let start = Position {
            epoch: 1,
            sample: 64,
        };
        let steps = walk(start, 32, n, Some(rot), 2);
        // [64, 96), [96, 100) short, then [0, 32), [32, 64) ending it.
        let sizes: Vec<u64> = steps.iter().map(|s| s.samples).collect();
        assert_eq!(sizes, [32, 4, 32, 32]);
        let ends: Vec<bool> = steps.iter().map(|s| s.ends_epoch).collect();
        assert_eq!(ends, [false, false, false, true]);
        assert_eq!(
            steps.last().unwrap().next,
            Position {
                epoch: 2,
                sample: 0
            }
        );
        assert_eq!(steps.last().unwrap().rotation, None);
        // The next epoch is the stream's order again.
        let after = walk(
            Position {
                epoch: 2,
                sample: 0,
            },
            32,
            n,
            None,
            3,
        );
        assert_eq!(
            after.iter().map(|s| s.samples).collect::<Vec<_>>(),
            [32, 32, 32, 4]
        );
    }

    #[test]
    fn a_resume_inside_either_part_goes_on_in_the_rotated_order() {
        let rot = Rotation { epoch: 3, at: 40 };
        // From inside the part read last: to its end, then epoch 4.
        let s = walk(
            Position {
                epoch: 3,
                sample: 10,
            },
            16,
            100,
            Some(rot),
            4,
        );
        assert_eq!(s.iter().map(|s| s.samples).collect::<Vec<_>>(), [16, 14]);
        assert!(s[1].ends_epoch);
        // Not a multiple of the batch size (a resume in another size):
        // short batches at both parts' ends.
        let s = walk(
            Position {
                epoch: 3,
                sample: 88,
            },
            16,
            100,
            Some(rot),
            4,
        );
        assert_eq!(
            s.iter().map(|s| s.samples).collect::<Vec<_>>(),
            [12, 16, 16, 8]
        );
        // A rotation of a later epoch waits for it.
        let later = Rotation { epoch: 5, at: 8 };
        let s = step(
            Position {
                epoch: 4,
                sample: 0,
            },
            16,
            100,
            Some(later),
        );
        assert_eq!((s.samples, s.rotation), (16, Some(later)));
        // At 0 it is no rotation.
        let none = Rotation { epoch: 4, at: 0 };
        let s = step(
            Position {
                epoch: 4,
                sample: 96,
            },
            16,
            100,
            Some(none),
        );
        assert!(s.ends_epoch);
    }
}
