//! The files the command line writes and the benchmarks and tests read:
//! `batchcast consume`'s report and `--state-file`, and `batchcast
//! launch`'s `summary.json` with its exit codes. One definition for the
//! writer and its readers, so a field renamed on one side cannot be
//! silently missing on the other.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One epoch as a consumer saw it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EpochReport {
    pub epoch: u64,
    pub batches: u64,
    pub samples: u64,
    pub complete: bool,
    /// Hex digest of every byte received in the epoch (with `--digest`).
    pub digest: Option<String>,
    /// Image streams: distinct dataset indices seen (the `index` field).
    pub distinct_indices: Option<u64>,
    /// With `--positions`: each batch's first sample and sample count.
    #[serde(default)]
    pub positions: Vec<(u64, u64)>,
}

impl EpochReport {
    /// Epoch `epoch`, nothing received yet.
    pub fn new(epoch: u64) -> EpochReport {
        EpochReport {
            epoch,
            batches: 0,
            samples: 0,
            complete: false,
            digest: None,
            distinct_indices: None,
            positions: Vec::new(),
        }
    }
}

/// What a consumer process reports on exit.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct ConsumerReport {
    pub name: String,
    pub pid: u32,
    pub ok: bool,
    pub error: Option<String>,
    pub error_code: Option<String>,
    pub ended: bool,
    pub batches: u64,
    pub samples: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub batches_per_s: f64,
    pub epochs: Vec<EpochReport>,
    pub verified_samples: u64,
    pub verify_failures: u64,
    /// Problems with sequence, epoch or index order (empty when in order).
    pub order_errors: Vec<String>,
    pub handoff_us_p50: f64,
    pub handoff_us_p99: f64,
    pub handoff_us_max: f64,
    pub wait_s: f64,
    /// Seconds between a batch's arrival and asking for the next.
    pub busy_s: f64,
    pub rss_anon_kb_start: u64,
    pub rss_anon_kb_end: u64,
    /// CPU seconds this process used (all threads, schedstat), in all
    /// and by the time its first batch arrived (start-up and connecting).
    #[serde(default)]
    pub cpu_s: f64,
    #[serde(default)]
    pub cpu_first_batch_s: f64,
    /// Host field views that did not lie in the shared mapping (a copy):
    /// zero on the zero-copy path.
    #[serde(default)]
    pub views_outside_arena: u64,
    /// Seconds from start to the first batch (connecting included).
    #[serde(default)]
    pub first_batch_s: f64,
    /// Batches recomputed for it alone (`--join now`, `--resume`).
    #[serde(default)]
    pub replayed_batches: u64,
    /// Epochs it read rotated ([`batchcast::rotation`]): from a later
    /// batch on, their start after their end.
    #[serde(default)]
    pub rotated_epochs: u64,
    /// Times it subscribed again after the broker went away.
    #[serde(default)]
    pub reconnects: u64,
}

/// What `--state-file` writes: the consumer's state and its epoch in
/// progress as counted so far.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedState {
    pub state: batchcast::ConsumerState,
    pub epoch: EpochReport,
    /// The epoch's digest accumulator (with `--digest`).
    pub digest: u64,
}

/// A `--resume-state` file that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("--resume-state {path}: {why}")]
pub struct StateFileError {
    path: PathBuf,
    why: String,
}

impl SavedState {
    pub fn load(path: &Path) -> Result<SavedState, StateFileError> {
        let err = |why: String| StateFileError {
            path: path.into(),
            why,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        serde_json::from_str(&text)
            .map_err(|e| err(format!("not a state written by --state-file: {e}")))
    }

    /// Writes it to `path` through a temporary file and a rename, so a
    /// reader (or a crash) never sees half of it.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec(self).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(&tmp, path)
    }
}

/// Exit codes of `batchcast launch`.
pub mod exit {
    /// Every trainer finished successfully.
    pub const OK: i32 = 0;
    /// Some trainers failed; the others ran to the end (`on_failure = "continue"`).
    pub const FAILED: i32 = 2;
    /// A trainer failed and every other one was stopped (`"stop-all"`).
    pub const STOPPED: i32 = 3;
    /// Interrupted (SIGINT or SIGTERM); everything was stopped.
    pub const INTERRUPTED: i32 = 130;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// One broker, every trainer subscribed to it.
    Shared,
    /// Every trainer with its own pipeline.
    Baseline,
}

/// One trainer's run, as `summary.json` records it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerSummary {
    pub name: String,
    pub command: Vec<String>,
    pub stream: String,
    pub gpu: Option<String>,
    pub log: PathBuf,
    /// `done`, `failed`, `stopped` (by the launcher) or `killed`.
    pub state: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub wall_s: f64,
    pub batches: u64,
    /// Every sample it received, shared or replayed.
    pub samples: u64,
    /// Of those, recomputed for it alone (a late join, a resume, a cut
    /// under decoupled pace).
    #[serde(default)]
    pub replayed: u64,
    pub samples_per_s: f64,
    /// Share of its loop time spent waiting for data.
    pub stall_pct: f64,
    pub wait_s: f64,
    pub busy_s: f64,
    /// Where the numbers come from: `broker` (what the trainer's clients
    /// counted as taken, relayed by the broker's stats and carried across
    /// its restarts; replayed, wait and busy from the broker's stats),
    /// `report` (the trainer's `$BATCHCAST_REPORT` file) or `none`.
    pub measured_by: String,
    /// The end of its log, when it failed.
    pub log_tail: Option<String>,
}

/// One broker of a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BrokerSummary {
    pub socket: PathBuf,
    pub pid: u32,
    /// Started by this launch (else an already running broker was used).
    pub started: bool,
    /// Times another broker was found on its socket during the run (a
    /// restart); the counts below add up every broker's, `pid` is the last.
    #[serde(default)]
    pub restarts: u32,
    pub cpu_s: f64,
    pub batches_produced: u64,
    pub deliveries: u64,
    pub images_decoded: u64,
    pub cache_hits: u64,
    pub bad_files_skipped: u64,
    /// Its stats as last seen (the last broker's, after a restart): what
    /// `batchcast doctor` judges a finished run by.
    #[serde(default)]
    pub last_stats: Option<batchcast::proto::StatsReply>,
    /// Per stream of the last broker: seconds its pipeline threads waited
    /// for a core (their run queue, from `/proc` at the run's end).
    #[serde(default)]
    pub run_queue_s: std::collections::BTreeMap<String, f64>,
}

/// One run of the sweep.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSummary {
    pub mode: Mode,
    pub dir: PathBuf,
    pub wall_s: f64,
    pub samples: u64,
    pub samples_per_s: f64,
    /// CPU seconds of every process of the run: brokers, trainers and
    /// their children.
    pub cpu_s: f64,
    pub cpu_ms_per_sample: Option<f64>,
    pub failed: usize,
    pub interrupted: bool,
    pub trainers: Vec<TrainerSummary>,
    pub brokers: Vec<BrokerSummary>,
    /// The run over time, about once a second (thinned to at most
    /// [`TIMELINE_TICKS`] over a long run): what `--report` plots.
    #[serde(default)]
    pub timeline: Vec<Tick>,
    /// What happened, when: each line the launcher printed above its
    /// table (a trainer joined, was cut to replay, detached, ended; a
    /// broker restarted), marked on the report's time axis.
    #[serde(default)]
    pub events: Vec<Event>,
}

/// A line the launcher printed during a run, seconds after it began.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub t_s: f64,
    pub text: String,
}

/// Most ticks a run's timeline keeps: past it, every other one goes and
/// the interval doubles.
pub const TIMELINE_TICKS: usize = 600;

/// The run at one moment; counts are totals so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Tick {
    /// Seconds since the run began.
    pub t_s: f64,
    /// Per trainer, in `trainers`' order: samples taken, seconds waiting
    /// for data, seconds busy.
    pub trainers: Vec<[f64; 3]>,
    /// Per broker, in `brokers`' order.
    pub brokers: Vec<BrokerTick>,
}

/// One broker at a [`Tick`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct BrokerTick {
    /// CPU seconds since the run began.
    pub cpu_s: f64,
    /// Its pipeline threads' seconds reading, decoding and transforming,
    /// all streams (of the broker now serving: they restart with it).
    pub stages: [f64; 3],
    /// Resident memory, and the shared memory it holds for batches
    /// (`MemoryStats::used_bytes`).
    pub rss_bytes: u64,
    pub shared_bytes: u64,
    /// Pipeline threads working now, all streams (with `workers` left
    /// out, as many as the trainers need). (Missing from an older run's
    /// summary: 0.)
    #[serde(default)]
    pub threads_working: u32,
}

/// Shared vs baseline.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Comparison {
    /// Baseline wall time / shared wall time.
    pub speedup: f64,
    /// Shared aggregate samples/s / baseline's.
    pub throughput_ratio: f64,
    /// Shared CPU per sample / baseline's (below 1: cheaper).
    pub cpu_per_sample_ratio: Option<f64>,
}

/// `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub sweep: PathBuf,
    pub on_failure: OnFailure,
    pub exit_code: i32,
    pub shared: RunSummary,
    pub baseline: Option<RunSummary>,
    pub comparison: Option<Comparison>,
}

/// What `batchcast launch` does when a trainer fails (`on_failure` in a
/// sweep file's `[launch]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnFailure {
    /// Mark the trainer failed; the others go on.
    #[default]
    Continue,
    /// Stop every trainer when one fails.
    StopAll,
}
