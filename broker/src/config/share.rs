//! A stream's share of a multi-host job (`rank`, `world_size`) as a number
//! or taken from the environment the broker starts in, so that one config
//! serves every node:
//!
//! ```toml
//! rank = { env = "NODE_RANK" }        # any variable
//! world_size = { env = "NNODES" }
//! rank = "torchrun"                   # GROUP_RANK
//! world_size = "torchrun"             # WORLD_SIZE / LOCAL_WORLD_SIZE
//! rank = "slurm"                      # SLURM_NODEID
//! world_size = "slurm"                # SLURM_NNODES
//! ```
//!
//! The value is read once, when the config is loaded; a variable that is
//! missing or not a count is an error naming it (with the key's place in
//! the file).

use std::fmt;

use serde::Deserializer;
use serde::de::{self, MapAccess, Visitor};

/// Which of the two keys is being read.
#[derive(Debug, Clone, Copy)]
enum Which {
    Rank,
    WorldSize,
}

/// `rank`: a number, `{ env = "VAR" }`, `"torchrun"` or `"slurm"`.
pub(super) fn rank<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(Count(Which::Rank))
}

/// `world_size`: a number, `{ env = "VAR" }`, `"torchrun"` or `"slurm"`.
pub(super) fn world_size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(Count(Which::WorldSize))
}

struct Count(Which);

/// Why a share could not be read from the environment.
#[derive(Debug, thiserror::Error)]
enum ShareError {
    #[error(
        "${0} is not set in the broker's environment (start the broker where the launcher sets it, or give a number)"
    )]
    Unset(String),
    #[error("${name}={value:?} is not a count")]
    NotACount { name: String, value: String },
    #[error("$WORLD_SIZE={all} is not a whole number of nodes of $LOCAL_WORLD_SIZE={local}")]
    NotWholeNodes { all: u64, local: u64 },
    #[error("unknown preset {0:?}: give a number, {{ env = \"VAR\" }}, \"torchrun\" or \"slurm\"")]
    UnknownPreset(String),
}

/// `$name` as a count, or what is wrong with it.
fn var(name: &str) -> Result<u64, ShareError> {
    let v = std::env::var(name).map_err(|_| ShareError::Unset(name.into()))?;
    v.trim().parse().map_err(|_| ShareError::NotACount {
        name: name.into(),
        value: v.clone(),
    })
}

impl Count {
    fn preset(&self, preset: &str) -> Result<u64, ShareError> {
        match (preset, self.0) {
            ("torchrun", Which::Rank) => var("GROUP_RANK"),
            ("torchrun", Which::WorldSize) => {
                let (all, local) = (var("WORLD_SIZE")?, var("LOCAL_WORLD_SIZE")?);
                if local == 0 || all % local != 0 {
                    return Err(ShareError::NotWholeNodes { all, local });
                }
                Ok(all / local)
            }
            ("slurm", Which::Rank) => var("SLURM_NODEID"),
            ("slurm", Which::WorldSize) => var("SLURM_NNODES"),
            (other, _) => Err(ShareError::UnknownPreset(other.into())),
        }
    }
}

impl<'de> Visitor<'de> for Count {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a count, { env = \"VAR\" }, \"torchrun\" or \"slurm\"")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::custom(format!("{v} is negative; give a count")))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        self.preset(v).map_err(E::custom)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<u64, A::Error> {
        let mut name: Option<String> = None;
        while let Some(key) = map.next_key::<String>()? {
            if key != "env" || name.is_some() {
                return Err(de::Error::custom(format!(
                    "unknown key `{key}`: the table takes one key, env = \"VAR\""
                )));
            }
            name = Some(map.next_value()?);
        }
        let name = name.ok_or_else(|| de::Error::custom("the table needs env = \"VAR\""))?;
        var(&name).map_err(de::Error::custom)
    }
}
