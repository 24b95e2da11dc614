//! The broker's TOML config: one or more named streams and who may connect.
//!
//! ```toml
//! [broker]
//! socket = "/run/user/1000/batchcast.sock"   # optional; --socket overrides
//! allow_uids = [1001]                         # other users who may connect
//! allow_gids = [2000]
//!
//! [[stream]]
//! name = "train"
//! batch_size = 64
//! epochs = 3            # omit for an endless stream
//! shuffle = true
//! seed = 0
//! drop_last = true
//! slots = 8
//! workers = 1
//! lag_limit = 4         # omit to let the slowest consumer set the pace
//! min_consumers = 1
//!
//! [stream.synthetic]
//! len = 10000
//! fill = "full"         # or "stamp"
//! fields = [
//!   { name = "image", dtype = "u8", shape = [3, 224, 224] },
//!   { name = "label", dtype = "i64", shape = [] },
//! ]
//! ```

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use batchcast::schema::{Field, Schema, SlotLayout, SourceInfo};
use batchcast::synthetic::{Fill, SyntheticSpec};
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub broker: BrokerSection,
    #[serde(rename = "stream")]
    pub streams: Vec<StreamConfig>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerSection {
    pub socket: Option<PathBuf>,
    /// Users besides the broker's own who may connect.
    #[serde(default)]
    pub allow_uids: Vec<u32>,
    /// Groups (primary or supplementary) whose members may connect.
    #[serde(default)]
    pub allow_gids: Vec<u32>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamConfig {
    pub name: String,
    pub batch_size: u64,
    /// `None`: endless.
    pub epochs: Option<u64>,
    #[serde(default = "yes")]
    pub shuffle: bool,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "yes")]
    pub drop_last: bool,
    #[serde(default = "default_slots")]
    pub slots: u32,
    /// Pipeline threads; default: all cores but one.
    pub workers: Option<usize>,
    pub lag_limit: Option<u32>,
    #[serde(default = "one")]
    pub min_consumers: u32,
    pub synthetic: Option<SyntheticConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyntheticConfig {
    pub len: u64,
    #[serde(default)]
    pub fill: Fill,
    pub fields: Vec<Field>,
}

fn yes() -> bool {
    true
}
fn one() -> u32 {
    1
}
fn default_slots() -> u32 {
    8
}

/// A stream's config after validation, with everything derived from it.
#[derive(Debug, Clone)]
pub struct StreamPlan {
    pub cfg: StreamConfig,
    pub schema: Schema,
    pub layout: SlotLayout,
    pub spec: SyntheticSpec,
    pub workers: usize,
}

impl StreamPlan {
    pub fn arena_bytes(&self) -> u64 {
        self.layout.slot_bytes * self.cfg.slots as u64
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        Config::parse(&text, path)
    }

    /// Parses TOML; errors name the key and line (`path` is only for messages).
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.into(),
            message: e.to_string(),
        })
    }

    /// Checks every stream and derives its schema and slot layout.
    pub fn plan(&self, path: &Path) -> Result<Vec<StreamPlan>, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: path.into(),
            message,
        };
        if self.streams.is_empty() {
            return Err(invalid("no [[stream]] defined; add at least one".into()));
        }
        let mut names = HashSet::new();
        let mut plans = Vec::new();
        let mem_total = mem_total_bytes();
        let mut arenas = 0u64;
        for s in &self.streams {
            let plan = plan_stream(s).map_err(|m| invalid(format!("stream `{}`: {m}", s.name)))?;
            if !names.insert(s.name.clone()) {
                return Err(invalid(format!("stream `{}` is defined twice", s.name)));
            }
            arenas = arenas.saturating_add(plan.arena_bytes());
            plans.push(plan);
        }
        if let Some(total) = mem_total
            && arenas > total / 2
        {
            return Err(invalid(format!(
                "the streams' arenas need {} MiB of shared memory, more than half of this host's {} MiB; lower slots or batch_size",
                arenas >> 20,
                total >> 20
            )));
        }
        Ok(plans)
    }
}

fn plan_stream(s: &StreamConfig) -> Result<StreamPlan, String> {
    if s.name.is_empty()
        || !s
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err("name must be non-empty and use only letters, digits, `-`, `_` and `.`".into());
    }
    let Some(src) = &s.synthetic else {
        return Err("no source: add a [stream.synthetic] table".into());
    };
    if s.batch_size == 0 {
        return Err("batch_size must be at least 1".into());
    }
    if src.len == 0 {
        return Err("synthetic.len must be at least 1".into());
    }
    if s.epochs == Some(0) {
        return Err("epochs must be at least 1 (omit it for an endless stream)".into());
    }
    if s.slots < 2 {
        return Err(format!(
            "slots = {} is too few: at least 2 so the pipeline can fill one while consumers read another",
            s.slots
        ));
    }
    if s.min_consumers == 0 {
        return Err("min_consumers must be at least 1".into());
    }
    if let Some(lag) = s.lag_limit
        && (lag == 0 || lag >= s.slots)
    {
        return Err(format!(
            "lag_limit = {lag} must be between 1 and slots - 1 ({}); a consumer can never lag by {} or more",
            s.slots - 1,
            s.slots
        ));
    }
    if s.workers == Some(0) {
        return Err("workers must be at least 1".into());
    }
    if src.fields.is_empty() {
        return Err("synthetic.fields is empty; list at least one field".into());
    }
    let mut seen = HashSet::new();
    for f in &src.fields {
        if !seen.insert(&f.name) {
            return Err(format!("field `{}` is listed twice", f.name));
        }
        if f.shape.contains(&0) {
            return Err(format!(
                "field `{}` has a zero dimension in its shape {:?}",
                f.name, f.shape
            ));
        }
    }
    let batches_per_epoch = if s.drop_last {
        src.len / s.batch_size
    } else {
        src.len.div_ceil(s.batch_size)
    };
    if batches_per_epoch == 0 {
        return Err(format!(
            "the dataset has {} samples, fewer than one batch of {} with drop_last = true",
            src.len, s.batch_size
        ));
    }
    let spec = SyntheticSpec {
        seed: s.seed,
        len: src.len,
        shuffle: s.shuffle,
        fill: src.fill,
    };
    let schema = Schema {
        fields: src.fields.clone(),
        batch_size: s.batch_size,
        samples_per_epoch: if s.drop_last {
            batches_per_epoch * s.batch_size
        } else {
            src.len
        },
        batches_per_epoch,
        epochs: s.epochs,
        source: SourceInfo::Synthetic(spec),
    };
    let layout = SlotLayout::for_schema(&schema).map_err(|e| e.to_string())?;
    let default_workers =
        std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1));
    Ok(StreamPlan {
        cfg: s.clone(),
        schema,
        layout,
        spec,
        workers: s.workers.unwrap_or(default_workers),
    })
}

fn mem_total_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[[stream]]
name = "train"
batch_size = 4
epochs = 2

[stream.synthetic]
len = 10
fields = [{ name = "x", dtype = "f32", shape = [3] }]
"#;

    fn plan(text: &str) -> Result<Vec<StreamPlan>, ConfigError> {
        let p = Path::new("test.toml");
        Config::parse(text, p)?.plan(p)
    }

    #[test]
    fn a_minimal_config_gets_documented_defaults() {
        let plans = plan(GOOD).unwrap();
        let p = &plans[0];
        assert_eq!(
            (
                p.cfg.slots,
                p.cfg.shuffle,
                p.cfg.drop_last,
                p.cfg.min_consumers
            ),
            (8, true, true, 1)
        );
        assert_eq!(
            p.schema.batches_per_epoch, 2,
            "10 samples / 4 with drop_last"
        );
        assert_eq!(p.schema.samples_per_epoch, 8);
    }

    #[test]
    fn a_typo_names_the_key_and_line() {
        let err = plan(&GOOD.replace("batch_size", "batch_szie"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("batch_szie") && err.contains("line 4"),
            "{err}"
        );
    }

    #[test]
    fn semantic_errors_name_the_stream_and_what_to_do() {
        for (from, to, expect) in [
            ("epochs = 2", "epochs = 2\nlag_limit = 8", "lag_limit = 8"),
            ("len = 10", "len = 3", "fewer than one batch"),
            ("shape = [3]", "shape = [0]", "zero dimension"),
            ("epochs = 2", "epochs = 2\nslots = 1", "slots = 1"),
            ("name = \"train\"", "name = \"a b\"", "name must"),
        ] {
            let err = plan(&GOOD.replace(from, to)).unwrap_err().to_string();
            assert!(err.contains(expect), "{err}");
        }
        let twice = format!("{GOOD}\n{}", &GOOD[GOOD.find("[[stream]]").unwrap()..]);
        assert!(
            plan(&twice)
                .unwrap_err()
                .to_string()
                .contains("defined twice")
        );
    }

    #[test]
    fn keeping_the_last_short_batch() {
        let plans = plan(&GOOD.replace("epochs = 2", "epochs = 2\ndrop_last = false")).unwrap();
        assert_eq!(plans[0].schema.batches_per_epoch, 3);
        assert_eq!(plans[0].schema.samples_per_epoch, 10);
    }
}
