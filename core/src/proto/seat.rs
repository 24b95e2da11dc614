//! A consumer's seat in a data-parallel group, and what makes one wrong.

use serde::{Deserialize, Serialize};

use super::{MAX_NAME_BYTES, TextError, check_text};

/// A consumer's seat in a group: the group's name (unique per stream),
/// its rank, the group's world size, and how many consecutive ranks
/// share one data rank (`replicate`, 1: none).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seat {
    pub name: String,
    pub rank: u32,
    pub world: u32,
    pub replicate: u32,
}

/// The largest group a stream seats.
pub const MAX_WORLD: u32 = 4096;

/// A seat that cannot be taken as given, or not found in the environment:
/// each says which number is wrong and what it must be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SeatError {
    #[error(transparent)]
    Name(#[from] TextError),
    #[error("a group needs a name")]
    NoName,
    #[error("group `{name}`: world {world} must be 1 to {MAX_WORLD}")]
    World { name: String, world: u32 },
    #[error("group `{name}`: rank {rank} outside its world of {world} (ranks 0 to {})", world - 1)]
    Rank { name: String, rank: u32, world: u32 },
    #[error("group `{name}`: replicate {replicate} must divide its world of {world}")]
    Replicate {
        name: String,
        replicate: u32,
        world: u32,
    },
    #[error(
        "group `{name}` without a rank and world: set them, or run under torchrun (LOCAL_RANK, LOCAL_WORLD_SIZE) or srun (SLURM_LOCALID, SLURM_NTASKS_PER_NODE)"
    )]
    NoRank { name: String },
    #[error(
        "give a rank and a world together, or neither (then they come from torchrun's or Slurm's environment)"
    )]
    HalfGiven,
    #[error("${var}={value:?} is not a count")]
    NotACount { var: String, value: String },
}

impl Seat {
    /// Checks the seat alone (the broker checks it against the group's
    /// other members).
    pub fn validate(&self) -> Result<(), SeatError> {
        check_text(
            "a group's name",
            &self.name,
            MAX_NAME_BYTES,
            "a shorter name",
        )?;
        let name = || self.name.clone();
        if self.name.is_empty() {
            return Err(SeatError::NoName);
        }
        if self.world == 0 || self.world > MAX_WORLD {
            return Err(SeatError::World {
                name: name(),
                world: self.world,
            });
        }
        if self.rank >= self.world {
            return Err(SeatError::Rank {
                name: name(),
                rank: self.rank,
                world: self.world,
            });
        }
        if self.replicate == 0 || !self.world.is_multiple_of(self.replicate) {
            return Err(SeatError::Replicate {
                name: name(),
                replicate: self.replicate,
                world: self.world,
            });
        }
        Ok(())
    }
}
