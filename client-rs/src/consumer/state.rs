//! A consumer's data state for a checkpoint ([`ConsumerState`]): where
//! its next batch begins in its stream, and what it needs to resume there
//! exactly (the convention of torchdata's `StatefulDataLoader`).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::proto::{Position, Seat, StreamDigest};
use crate::rotation::Rotation;

/// Where a consumer is: saved with a model checkpoint, given back as
/// [`ConsumerOptions::state`](crate::ConsumerOptions::state) to resume
/// there. It costs nothing to take (fields the consumer already has) and
/// is a few dozen bytes.
///
/// Resuming is exact: the samples from `position` on, in the stream's
/// order, with the bytes an uninterrupted consumer gets (what the stream
/// already made is recomputed for it). A broker whose stream now makes
/// other data (its [`StreamDigest`] differs) refuses the resume, naming
/// what changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerState {
    pub stream: String,
    /// The stream's description as the consumer was served it.
    pub digest: StreamDigest,
    /// Where its next batch begins: right after the last batch it handed
    /// out (an epoch's end is the next epoch's start), or where it
    /// started if it handed out none.
    pub position: Position,
    /// Its batch size and whether it drops an epoch's short last batch;
    /// a resume may ask for another batch size (the same samples from
    /// `position` on, grouped anew).
    pub batch_size: u64,
    pub drop_last: bool,
    /// A group member's place in its group: where the group goes on, so
    /// that the group may be re-formed (another world, the same global
    /// batch) from any one member's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<GroupPlace>,
    /// `position`'s epoch is being read rotated ([`crate::rotation`]): a
    /// resume reads the rest of it in that order (protocol 20).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotation: Option<Rotation>,
}

/// Where a group stands: saved by each member ([`ConsumerState::group`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupPlace {
    pub name: String,
    pub world: u32,
    pub replicate: u32,
    /// The start of the round (one batch of every data rank) that holds
    /// the member's next batch ([`crate::deal::Deal::round_of`]).
    pub round: Position,
}

impl ConsumerState {
    /// The group's samples a step: its members' batch size times its data
    /// ranks (`None` for a plain consumer's state).
    pub fn global_batch(&self) -> Option<u64> {
        let g = self.group.as_ref()?;
        Some(self.batch_size * u64::from(g.world / g.replicate.max(1)))
    }

    /// Where a consumer that takes `seat` (or none) and asks for
    /// `batch_size` resumes from this state, and in which batch size.
    ///
    /// A member resuming a member's state goes on from the start of the
    /// group's round, whatever its rank or world now (the deal gives it
    /// its own runs from there), in the batch size that keeps the global
    /// batch: torchrun may re-form a trial with another world after a
    /// failure, and every new rank loads the one state the trial saved.
    /// Another global batch is refused: its rounds lie elsewhere, and its
    /// ranks would get unequal batch counts in that epoch.
    pub fn resume_for(
        &self,
        seat: Option<&Seat>,
        batch_size: Option<u64>,
    ) -> Result<(Position, u64)> {
        let (Some(place), Some(global), Some(seat)) = (&self.group, self.global_batch(), seat)
        else {
            return Ok((self.position, batch_size.unwrap_or(self.batch_size)));
        };
        let data = u64::from(seat.world / seat.replicate.max(1)).max(1);
        let fits = global.is_multiple_of(data);
        let size = batch_size.unwrap_or(if fits { global / data } else { 0 });
        if size.saturating_mul(data) != global {
            let ask = if fits {
                format!("batch_size={} (or leave it unset)", global / data)
            } else {
                format!("a world whose data ranks divide {global}")
            };
            return Err(Error::InvalidOption(format!(
                "state of group `{}` ({} data ranks × batch {} = {global} samples a step): a group of {data} data ranks goes on from it exactly only with the same global batch; ask for {ask}",
                place.name,
                place.world / place.replicate.max(1),
                self.batch_size,
            )));
        }
        Ok((place.round, size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member_state(world: u32, batch: u64, round: (u64, u64)) -> ConsumerState {
        ConsumerState {
            stream: "train".into(),
            digest: StreamDigest::default(),
            position: Position {
                epoch: 9,
                sample: 9,
            },
            batch_size: batch,
            drop_last: false,
            group: Some(GroupPlace {
                name: "t".into(),
                world,
                replicate: 1,
                round: Position {
                    epoch: round.0,
                    sample: round.1,
                },
            }),
            rotation: None,
        }
    }

    fn seat(rank: u32, world: u32) -> Seat {
        Seat {
            name: "t".into(),
            rank,
            world,
            replicate: 1,
        }
    }

    #[test]
    fn a_reformed_group_goes_on_at_the_round_with_the_same_global_batch() {
        // 4 ranks of 8 (32 a step), re-formed as 2: batches of 16.
        let s = member_state(4, 8, (1, 64));
        let at = Position {
            epoch: 1,
            sample: 64,
        };
        assert_eq!(s.resume_for(Some(&seat(1, 2)), None).unwrap(), (at, 16));
        assert_eq!(s.resume_for(Some(&seat(0, 8)), Some(4)).unwrap(), (at, 4));
        let e = s
            .resume_for(Some(&seat(0, 2)), Some(8))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("only with the same global batch; ask for batch_size=16"),
            "{e}"
        );
        let e = s
            .resume_for(Some(&seat(0, 3)), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("a world whose data ranks divide 32"), "{e}");
        // A plain consumer's resume is its own position, as ever.
        assert_eq!(s.resume_for(None, None).unwrap(), (s.position, 8));
        // The JSON form carries the place, and an older state (without
        // one) still loads.
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.len() < 1024, "{json}");
        assert_eq!(serde_json::from_str::<ConsumerState>(&json).unwrap(), s);
        let plain = ConsumerState { group: None, ..s };
        let old = serde_json::to_string(&plain).unwrap();
        assert!(!old.contains("group"));
        assert_eq!(serde_json::from_str::<ConsumerState>(&old).unwrap(), plain);
    }
}
