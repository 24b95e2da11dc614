//! What a sweep file says (its tables, as written) and the machine it runs
//! on: the shapes `spec.rs` checks and `expand.rs` expands into one
//! [`TrainerPlan`] per trainer process. Below both, so neither imports
//! the other for them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use batchcast_cli::report::OnFailure;
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LaunchSection {
    pub(super) config: Option<PathBuf>,
    pub(super) socket: Option<PathBuf>,
    pub(super) run_dir: Option<PathBuf>,
    #[serde(default)]
    pub(super) on_failure: OnFailure,
    pub(super) stream: Option<String>,
    pub(super) gpus: Option<Vec<u32>>,
    /// Seconds between SIGTERM and SIGKILL when stopping trainers.
    pub(super) grace_s: Option<f64>,
    /// Times a broker the run started is started again when it dies.
    pub(super) broker_restarts: Option<u32>,
}

/// The keys of `[launch]`.
const LAUNCH_KEYS: [&str; 8] = [
    "config",
    "socket",
    "run_dir",
    "on_failure",
    "stream",
    "gpus",
    "grace_s",
    "broker_restarts",
];

/// A `[launch]` key written at a sweep file's top level (above any
/// section), named with where it belongs; `None` if there is none.
pub(super) fn misplaced_launch_key(text: &str) -> Option<String> {
    let table: toml::Table = toml::from_str(text).ok()?;
    let key = LAUNCH_KEYS.iter().find(|k| {
        // `stream` is also the `[[stream]]` array of tables.
        table
            .get(**k)
            .is_some_and(|v| !(**k == "stream" && v.is_array()))
    })?;
    Some(format!(
        "`{key}` at the top of the file is a key of the [launch] section: write `[launch]` on a line above it"
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SweepFile {
    #[serde(default)]
    pub(super) launch: LaunchSection,
    pub(super) broker: Option<toml::Table>,
    #[serde(default, rename = "stream")]
    pub(super) streams: Vec<toml::Table>,
    #[serde(default, rename = "trainer")]
    pub(super) trainers: Vec<TrainerSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum GpuSpec {
    Word(String),
    One(u32),
    List(Vec<u32>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TrainerSpec {
    pub(super) name: String,
    pub(super) command: Vec<String>,
    pub(super) copies: Option<u32>,
    #[serde(default)]
    pub(super) grid: BTreeMap<String, Vec<toml::Value>>,
    /// Lists of one length whose i-th values go together (a batch size
    /// with its own learning rate): one trainer per position, crossed
    /// with `grid`'s combinations.
    #[serde(default)]
    pub(super) zip: BTreeMap<String, Vec<toml::Value>>,
    #[serde(default)]
    pub(super) env: BTreeMap<String, toml::Value>,
    pub(super) gpu: Option<GpuSpec>,
    pub(super) cwd: Option<PathBuf>,
    pub(super) stream: Option<String>,
    pub(super) baseline_command: Option<Vec<String>>,
    /// The trainer's own batch size (a number, or a placeholder such as
    /// `"{bs}"`); a grid key `batch_size` sets it too. Given to the
    /// trainer's consumer as `$BATCHCAST_BATCH_SIZE`.
    pub(super) batch_size: Option<toml::Value>,
    /// How its consumer joins (`"next-epoch"`, `"immediate"`, `"now"`),
    /// given as `$BATCHCAST_JOIN`.
    pub(super) join: Option<String>,
}

/// One trainer process.
#[derive(Debug, Clone)]
pub struct TrainerPlan {
    pub name: String,
    pub argv: Vec<String>,
    /// `--baseline` with its own loader: this command, with no broker.
    pub baseline_argv: Option<Vec<String>>,
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    pub stream: String,
    /// The value of `CUDA_VISIBLE_DEVICES` for it (`None`: left as is).
    pub gpu: Option<String>,
}

/// What the machine offers, for checking GPU indices (tests pass their own).
#[derive(Debug, Clone)]
pub struct Host {
    /// `CUDA_VISIBLE_DEVICES` values of the GPUs this process sees, in
    /// ordinal order.
    pub gpus: Vec<String>,
    /// This executable, for `{batchcast}` and finding sibling programs.
    pub exe: PathBuf,
}

impl Host {
    /// The GPUs visible to this process (none without a CUDA driver).
    pub fn detect() -> std::io::Result<Host> {
        let count = visible_gpu_count();
        let listed: Option<Vec<String>> = std::env::var("CUDA_VISIBLE_DEVICES")
            .ok()
            .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
        let gpus = (0..count)
            .map(|i| match &listed {
                Some(l) => l.get(i).cloned().unwrap_or_else(|| i.to_string()),
                None => i.to_string(),
            })
            .collect();
        Ok(Host {
            gpus,
            exe: std::env::current_exe()?,
        })
    }
}

#[cfg(feature = "cuda")]
fn visible_gpu_count() -> usize {
    batchcast::cuda::gpus().map(|g| g.len()).unwrap_or(0)
}

#[cfg(not(feature = "cuda"))]
fn visible_gpu_count() -> usize {
    0
}

/// `1st`, `2nd`, … for messages about the n-th of something.
pub(super) fn ordinal(i: usize) -> String {
    match i + 1 {
        1 => "1st".into(),
        2 => "2nd".into(),
        3 => "3rd".into(),
        n => format!("{n}th"),
    }
}
