//! From a description to a plan: a configured stream ([`crate::config`]) or
//! an external producer's request becomes a [`StreamPlan`], checked and with
//! everything derived (schema, slot layout, sample order, the dataset's
//! listing). This is where the disk is first touched (a dataset is listed
//! here); nothing here runs: [`crate::stream::Stream::start`] turns a plan
//! into threads, arenas and decoders.
//!
//! Every refusal is a [`PlanError`] that names the stream and the key at
//! fault, and says what to change. `checks.rs` holds the rules every
//! stream follows (and every number's bounds); `image.rs` plans an image
//! source (its transform and its dataset's listing).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use batchcast::proto::ProduceRequest;
use batchcast::proto::StreamDigest;
use batchcast::schema::{ExternalSourceInfo, Field, RingLayout, Schema, SlotLayout, SourceInfo};
use batchcast::synthetic::SyntheticSpec;

use crate::config::{Config, Pace, StreamConfig, SyntheticConfig};
use crate::pipeline::SampleRules;
use crate::pipeline::dataset::{Dataset, DatasetError};
use crate::pipeline::sampler::Split;
use crate::pipeline::transform::Transform;

mod augment;
mod checks;
mod digest;
mod image;
pub(crate) mod kind;
mod remote;
mod source;
#[cfg(test)]
mod tests;

pub(crate) use checks::{MAX_BATCH_SIZE, MAX_BATCHES_PER_EPOCH, MAX_SLOTS, MAX_SYNTHETIC_LEN};

use checks::{
    check_fields, check_flow, check_limits, check_name, check_pace, check_producer_text,
    producer_hold_limit, run_ahead_slots, seconds, within,
};
use image::image_source;

/// Why a config or a producer's request cannot become a stream.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("stream `{0}` is defined twice")]
    Duplicate(String),
    /// (Its Display holds the stream's error, so it is not also a source:
    /// an error chain would print it twice.)
    #[error("stream `{stream}`: {error}")]
    Stream { stream: String, error: StreamError },
    #[error("[broker]: {0}")]
    Broker(StreamError),
    #[error("source `{name}`: {message}")]
    Source { name: String, message: String },
}

/// The `[broker]` section's numbers, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerPlan {
    /// Groups whose members may connect: `allow_gids` and the numbers of
    /// `allow_groups`.
    pub allow_gids: Vec<u32>,
    /// Connections served at once, all users together.
    pub max_connections: usize,
    /// For each uid other than the broker's.
    pub max_connections_per_uid: usize,
    /// How long a stats connection may go without a request before it is
    /// closed (consumers and producers are bounded by their streams).
    pub idle_timeout: std::time::Duration,
    /// What the broker may allocate for clients in all.
    pub memory_bytes: u64,
    /// Pipeline threads the streams that leave `workers` out may work on,
    /// all together (`max_cpu_share` of the cores).
    pub threads: usize,
    /// How long a producer's registration may hold its arena before its
    /// first `Acquire`.
    pub registration_timeout: std::time::Duration,
    /// What a guest's stream names must start with: `{user}` and `{uid}`
    /// are replaced; empty allows any name not taken.
    pub guest_stream_prefix: String,
}

/// Checks the `[broker]` section's bounds; absent keys take the defaults.
pub fn plan_broker(b: &crate::config::BrokerSection) -> Result<BrokerPlan, PlanError> {
    checks::check_broker(b).map_err(PlanError::Broker)
}

/// What is wrong with one stream.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// A key's value is out of its range or does not fit the others.
    #[error("{message}")]
    Key { key: &'static str, message: String },
    #[error(
        "no source: add a [stream.image_folder], [stream.webdataset] or [stream.synthetic] table"
    )]
    NoSource,
    #[error("more than one source table; keep exactly one")]
    ManySources,
    #[error(
        "the dataset has {samples} samples per epoch{}, fewer than one batch of {batch_size} with drop_last = true",
        if samples != dataset { format!(" on this host (of {dataset})") } else { String::new() }
    )]
    FewerThanOneBatch {
        samples: u64,
        dataset: u64,
        batch_size: u64,
    },
    #[error("{0}")]
    Field(String),
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    #[error("its slot layout: {0}")]
    Layout(batchcast_core::WireError),
    #[error(
        "the arena needs {need_mib} MiB of shared memory ({slots} slots of {slot_mib} MiB), more than half of this host's {have_mib} MiB; use fewer slots or smaller batches"
    )]
    ArenaTooLarge {
        need_mib: u64,
        slots: u32,
        slot_mib: u64,
        have_mib: u64,
    },
}

fn key(key: &'static str, message: impl Into<String>) -> StreamError {
    StreamError::Key {
        key,
        message: message.into(),
    }
}

/// Where a stream's samples come from: one of [`kind`]'s sources, chosen
/// once here.
pub(crate) type SourcePlan = Arc<dyn kind::SampleSource>;

/// An image stream's source: the dataset's listing and what to do with
/// each sample.
#[derive(Debug, Clone)]
pub struct ImagePlan {
    pub dataset: Arc<Dataset>,
    pub transform: Transform,
    pub rules: SampleRules,
    pub split: Split,
    /// Shuffle buffer for tar shards; `None` for random access.
    pub shuffle_buffer: Option<usize>,
    pub shuffle: bool,
    pub seed: u64,
    /// A stream on a shared source: the source as planned, and which of
    /// its streams this is.
    pub share: Option<crate::pipeline::shared::ShareSeat>,
}

/// Host slots when nothing asks for more (the fewest a stream gets when
/// its ring is sized for it).
pub const DEFAULT_SLOTS: u32 = 8;
/// The window a stream's ring is sized for (the clients' default).
pub const SIZING_WINDOW: u32 = 2;
/// Without `max_batch_size`, a ring is sized for consumers asking up to
/// this many times the stream's batch size, where a quarter of the memory
/// budget allows.
pub const DEFAULT_BATCH_MULTIPLE: u64 = 4;

/// How long, by default, a consumer may keep the pipeline waiting (it pins
/// the ring's next unit while another consumer waits for data) before it
/// is cut to replay or, if it cannot be (a producer's stream), detached:
/// a paused, stopped or crashed trainer holds the others 2 s at most.
/// Decoupled pace cuts at once and detaches at this limit.
pub const DEFAULT_HOLD_LIMIT: Duration = Duration::from_secs(2);

pub use checks::DEFAULT_MAX_CPU_SHARE;

/// How long, by default, a consumer whose program holds the very batch
/// the ring needs next may keep the others waiting before it is detached
/// (a cut cannot free that batch): long enough for a trainer's checkpoint
/// or a short evaluation with its last batch still referenced, as a
/// PyTorch loop keeps it. Never less than the hold limit.
pub const DEFAULT_HELD_BATCH_LIMIT: Duration = Duration::from_secs(30);

/// A stream, checked, with everything derived from its description.
#[derive(Debug, Clone)]
pub struct StreamPlan {
    pub name: String,
    /// Host slots of the arena.
    pub slots: u32,
    /// Slots of each GPU's arena.
    pub gpu_slots: u32,
    /// `None`: endless.
    pub epochs: Option<u64>,
    pub lag_limit: Option<u32>,
    pub pace: Pace,
    /// The default of consumers that do not say whether to drop an epoch's
    /// short last batch (the stream makes every sample either way).
    pub drop_last: bool,
    /// How long a consumer may keep the pipeline waiting while another
    /// waits for data ([`DEFAULT_HOLD_LIMIT`]): then it is cut to replay
    /// (lockstep) or detached (it cannot be cut). `None`: no bound
    /// (`hold_limit_s = inf`).
    pub hold_limit: Option<Duration>,
    /// How long one that holds the batch the ring needs next may keep the
    /// others waiting before it is detached ([`DEFAULT_HELD_BATCH_LIMIT`],
    /// at least `hold_limit`; `None` with no hold limit).
    pub held_batch_limit: Option<Duration>,
    /// Whether a replayed consumer may read an epoch rotated
    /// (`rotate_epochs`, default true; see `stream/rotate.rs`).
    pub rotate_epochs: bool,
    pub min_consumers: u32,
    /// Pipeline threads (0 for an external producer): with
    /// `workers_auto`, the most that may work.
    pub workers: usize,
    /// The threads that work follow the trainers' demand
    /// (`stream/autoscale.rs`): `workers` was left out.
    pub workers_auto: bool,
    pub schema: Schema,
    /// The host arena: a ring per field.
    pub rings: RingLayout,
    /// A device arena's slots (each a whole unit).
    pub layout: SlotLayout,
    pub(crate) source: SourcePlan,
    /// What the stream's data is made from, digested: sent in every
    /// welcome, checked against a resuming consumer's.
    pub digest: StreamDigest,
}

impl StreamPlan {
    pub fn arena_bytes(&self) -> u64 {
        self.rings.arena_bytes
    }

    /// The dataset indices of `epoch`, in order, for this host (none
    /// where a producer decides what each batch holds).
    pub fn epoch_order(&self, epoch: u64) -> Vec<u64> {
        self.source.epoch_order(epoch)
    }

    /// Plans the stream an external producer asked for, with the same
    /// checks as a configured one.
    pub fn external(
        req: &ProduceRequest,
        producer: &str,
        pid: u32,
    ) -> Result<StreamPlan, StreamError> {
        check_producer_text(req)?;
        check_flow(
            req.batch_size,
            req.epochs,
            req.slots,
            None,
            req.lag_limit,
            req.min_consumers,
        )?;
        if req.fields.is_empty() {
            return Err(StreamError::Field("the batch has no fields".into()));
        }
        check_fields(&req.fields)?;
        within(
            "batches_per_epoch",
            req.batches_per_epoch,
            1,
            MAX_BATCHES_PER_EPOCH,
            "batches in one epoch",
        )?;
        check_rejoin(req)?;
        let hold_limit = producer_hold_limit(req)?;
        let schema = Schema {
            fields: req.fields.clone(),
            batch_size: req.batch_size,
            samples_per_epoch: req.batches_per_epoch.saturating_mul(req.batch_size),
            batches_per_epoch: req.batches_per_epoch,
            epochs: req.epochs,
            source: SourceInfo::External(ExternalSourceInfo {
                producer: producer.into(),
                pid,
                description: req.description.clone(),
                classes: req.classes.clone(),
            }),
        };
        let layout = SlotLayout::for_schema(&schema).map_err(StreamError::Layout)?;
        let rings = RingLayout::for_schema(&schema, req.slots).map_err(StreamError::Layout)?;
        let arena = rings.arena_bytes;
        if let Some(total) = mem_total_bytes()
            && arena > total / 2
        {
            return Err(StreamError::ArenaTooLarge {
                need_mib: arena >> 20,
                slots: req.slots,
                slot_mib: layout.slot_bytes >> 20,
                have_mib: total >> 20,
            });
        }
        let plan = StreamPlan {
            name: req.stream.clone(),
            slots: req.slots,
            gpu_slots: req.slots,
            epochs: req.epochs,
            lag_limit: req.lag_limit,
            pace: Pace::Lockstep,
            hold_limit: Some(hold_limit),
            held_batch_limit: Some(hold_limit.max(DEFAULT_HELD_BATCH_LIMIT)),
            rotate_epochs: false,
            drop_last: false,
            min_consumers: req.min_consumers,
            workers: 0,
            workers_auto: false,
            schema,
            rings,
            layout,
            source: Arc::new(kind::Producer),
            digest: Default::default(),
        };
        Ok(plan.digested(digest::of_external))
    }

    /// The plan with its digest, as `of` makes it from the rest.
    fn digested(mut self, of: impl FnOnce(&StreamPlan) -> StreamDigest) -> StreamPlan {
        self.digest = of(&self);
        self
    }
}

/// A producer registering again names a batch of its stream.
fn check_rejoin(req: &ProduceRequest) -> Result<(), StreamError> {
    let Some(r) = req.rejoin else {
        return Ok(());
    };
    let last = crate::hub::MAX_EPOCH;
    if r.index >= req.batches_per_epoch
        || req.epochs.is_some_and(|n| r.epoch >= n)
        || r.epoch >= last
    {
        return Err(key(
            "rejoin",
            format!(
                "registering again at batch {} of epoch {}, outside the stream ({} batches an epoch, {} epochs; no stream counts epoch {last} or later)",
                r.index,
                r.epoch,
                req.batches_per_epoch,
                req.epochs.map_or("endless".to_string(), |n| n.to_string())
            ),
        ));
    }
    Ok(())
}

/// Checks every configured stream and derives its plan; the arenas of all
/// of them together must fit in half of the host's memory. A config may
/// define no stream (only `[broker]`: the socket and who may connect, for
/// a broker that serves producers' streams).
pub fn plan_config(cfg: &Config) -> Result<Vec<StreamPlan>, PlanError> {
    let streams = source::resolve(cfg)?;
    // The broker's memory budget (`[broker] memory_mib`, else half the
    // host's memory): a ring sized by default takes at most a quarter.
    let budget = cfg
        .broker
        .memory_mib
        .map(|m| m.saturating_mul(1 << 20))
        .or_else(|| mem_total_bytes().map(|b| b / 2))
        .unwrap_or(u64::MAX);
    // What streams that leave `workers` out spawn: as many threads as all
    // of them may work on together.
    let threads = checks::host_threads(cfg.broker.max_cpu_share).map_err(PlanError::Broker)?;
    let mut names = HashSet::new();
    let mut plans: Vec<StreamPlan> = Vec::new();
    for (i, s) in streams.iter().enumerate() {
        // The streams of a source list its dataset once.
        let listed = streams[..i]
            .iter()
            .position(|t| source::same_listing(t, s))
            .and_then(|j| plans[j].source.images())
            .map(|p| (p.dataset.clone(), p.shuffle_buffer));
        let plan =
            plan_stream(s, listed, (budget, threads)).map_err(|error| PlanError::Stream {
                stream: s.name.clone(),
                error,
            })?;
        if !names.insert(s.name.clone()) {
            return Err(PlanError::Duplicate(s.name.clone()));
        }
        plans.push(plan);
    }
    source::attach(cfg, &streams, &mut plans)?;
    // What all the arenas take together is the memory budget's to judge
    // (`[broker] memory_mib`), when the broker starts them.
    Ok(plans)
}

/// What a source contributes to its stream's plan.
struct SourceParts {
    fields: Vec<Field>,
    /// Samples in the whole dataset, and in this host's share of an epoch.
    len: u64,
    per_epoch: u64,
    plan: SourcePlan,
    info: SourceInfo,
}

/// The checks of a stream's keys that need nothing planned: its name,
/// pace, flow control, workers, limits, and exactly one source.
fn check_stream_keys(s: &StreamConfig) -> Result<(), StreamError> {
    check_name(&s.name)?;
    check_pace(s)?;
    check_flow(
        s.batch_size,
        s.epochs,
        s.slots.unwrap_or(DEFAULT_SLOTS),
        s.gpu_slots,
        s.lag_limit,
        s.min_consumers,
    )?;
    if s.workers == Some(0) {
        return Err(key("workers", "workers must be at least 1"));
    }
    check_limits(s)?;
    let sources = [
        s.synthetic.is_some(),
        s.image_folder.is_some(),
        s.webdataset.is_some(),
    ];
    match sources.iter().filter(|&&x| x).count() {
        0 => Err(StreamError::NoSource),
        1 => Ok(()),
        _ => Err(StreamError::ManySources),
    }
}

/// `listed`: the dataset's listing, when another stream of its source
/// has made it; `threads`: what a stream that leaves `workers` out spawns.
fn plan_stream(
    s: &StreamConfig,
    listed: Option<(Arc<Dataset>, Option<usize>)>,
    (budget, threads): (u64, usize),
) -> Result<StreamPlan, StreamError> {
    check_stream_keys(s)?;
    let parts = match &s.synthetic {
        Some(src) => synthetic_source(s, src)?,
        None => image_source(s, listed)?,
    };
    // Every sample of the epoch is made (the last unit short): whether a
    // consumer drops a short last batch is its own choice, the stream's
    // `drop_last` only its default.
    let batches_per_epoch = parts.per_epoch.div_ceil(s.batch_size);
    if batches_per_epoch == 0 || (s.drop_last && parts.per_epoch < s.batch_size) {
        return Err(StreamError::FewerThanOneBatch {
            samples: parts.per_epoch,
            dataset: parts.len,
            batch_size: s.batch_size,
        });
    }
    let schema = Schema {
        fields: parts.fields,
        batch_size: s.batch_size,
        samples_per_epoch: parts.per_epoch,
        batches_per_epoch,
        epochs: s.epochs,
        source: parts.info,
    };
    let layout = SlotLayout::for_schema(&schema).map_err(StreamError::Layout)?;
    // A unit's bytes in the rings (page rounding aside).
    let unit_bytes = schema
        .fields
        .iter()
        .filter_map(|f| f.bytes_per_sample())
        .sum::<u64>()
        .saturating_mul(schema.batch_size);
    let given = match s.run_ahead_mib {
        Some(mib) => Some(("run_ahead_mib", run_ahead_slots(mib, unit_bytes)?)),
        None => s.slots.map(|n| ("slots", n)),
    };
    let slots = ring_slots(s.batch_size, s.max_batch_size, given, unit_bytes, budget)?;
    let rings = RingLayout::for_schema(&schema, slots).map_err(StreamError::Layout)?;
    let plan = StreamPlan {
        name: s.name.clone(),
        slots,
        gpu_slots: s.gpu_slots.unwrap_or(slots),
        epochs: s.epochs,
        lag_limit: s.lag_limit,
        pace: s.pace,
        hold_limit: seconds(s.hold_limit_s, DEFAULT_HOLD_LIMIT),
        held_batch_limit: match (
            seconds(s.hold_limit_s, DEFAULT_HOLD_LIMIT),
            seconds(s.held_batch_limit_s, DEFAULT_HELD_BATCH_LIMIT),
        ) {
            (Some(hold), Some(held)) => Some(hold.max(held)),
            _ => None,
        },
        rotate_epochs: s.rotate_epochs.unwrap_or(true),
        drop_last: s.drop_last,
        min_consumers: s.min_consumers,
        workers: s.workers.unwrap_or(threads),
        workers_auto: s.workers.is_none(),
        schema,
        rings,
        layout,
        source: parts.plan,
        digest: Default::default(),
    };
    Ok(plan.digested(|p| digest::of_config(s, p)))
}

fn synthetic_source(s: &StreamConfig, src: &SyntheticConfig) -> Result<SourceParts, StreamError> {
    within(
        "synthetic.len",
        src.len,
        1,
        MAX_SYNTHETIC_LEN,
        "samples; each epoch's order takes 8 bytes a sample",
    )?;
    if s.world_size != 1 || s.transform.is_some() {
        return Err(key(
            "transform",
            "rank/world_size and [stream.transform] apply to image sources only",
        ));
    }
    if src.fields.is_empty() {
        return Err(StreamError::Field(
            "synthetic.fields is empty; list at least one field".into(),
        ));
    }
    check_fields(&src.fields)?;
    let spec = SyntheticSpec {
        seed: s.seed,
        len: src.len,
        shuffle: s.shuffle,
        fill: src.fill,
    };
    Ok(SourceParts {
        fields: src.fields.clone(),
        len: src.len,
        per_epoch: src.len,
        plan: Arc::new(spec),
        info: SourceInfo::Synthetic(spec),
    })
}

fn mem_total_bytes() -> Option<u64> {
    crate::pipeline::autosize::meminfo("MemTotal")
}

/// The host ring's slots: what the config gives (`slots`, or
/// `run_ahead_mib`'s), which must hold `max_batch_size` if that is given;
/// else enough for `max_batch_size` with the default window; else enough
/// for a few times the batch size, within a quarter of `budget`.
fn ring_slots(
    unit: u64,
    max_batch: Option<u64>,
    given: Option<(&'static str, u32)>,
    unit_bytes: u64,
    budget: u64,
) -> Result<u32, StreamError> {
    let need = |b: u64| {
        batchcast::batcher::units_needed(SIZING_WINDOW, b, unit).max(u64::from(DEFAULT_SLOTS))
    };
    let Some(max) = max_batch else {
        if let Some((_, n)) = given {
            return Ok(n);
        }
        let fits = |n: u64| n <= u64::from(MAX_SLOTS) && n.saturating_mul(unit_bytes) <= budget / 4;
        let n = (1..=DEFAULT_BATCH_MULTIPLE)
            .rev()
            .map(|k| need(k * unit))
            .find(|&n| fits(n))
            .unwrap_or(u64::from(DEFAULT_SLOTS));
        return Ok(n as u32);
    };
    within(
        "max_batch_size",
        max,
        1,
        MAX_BATCH_SIZE,
        "samples in one consumer's batch",
    )?;
    let needed = need(max);
    if needed > u64::from(MAX_SLOTS) {
        return Err(key(
            "max_batch_size",
            format!(
                "max_batch_size = {max} needs {needed} slots of {unit} samples (batches of {max} span that many with a window of {SIZING_WINDOW}), more than {MAX_SLOTS}: raise batch_size, or ask for smaller batches"
            ),
        ));
    }
    match given {
        Some((k, n)) if u64::from(n) < needed => Err(key(
            k,
            format!(
                "{k} gives {n} slots, fewer than the {needed} that max_batch_size = {max} needs (batches of {max} span that many units of {unit} with a window of {SIZING_WINDOW}): raise it, or leave slots out and the ring is sized for max_batch_size"
            ),
        )),
        Some((_, n)) => Ok(n),
        None => Ok(needed as u32),
    }
}
