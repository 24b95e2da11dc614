//! From a description to a plan: a configured stream ([`crate::config`]) or
//! an external producer's request becomes a [`StreamPlan`], checked and with
//! everything derived (schema, slot layout, sample order, the dataset's
//! listing). This is where the disk is first touched (a dataset is listed
//! here); nothing here runs: [`crate::stream::Stream::start`] turns a plan
//! into threads, arenas and decoders.
//!
//! Every refusal is a [`PlanError`] that names the stream and the key at
//! fault, and says what to change.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use batchcast::DType;
use batchcast::proto::{MailboxSpec, ProduceRequest};
use batchcast::schema::{
    ExternalSourceInfo, Field, ImageSourceInfo, Schema, SlotLayout, SourceInfo,
};
use batchcast::synthetic::SyntheticSpec;

use crate::config::{Config, StreamConfig, SyntheticConfig, TransformConfig};
use crate::pipeline::OnError;
use crate::pipeline::dataset::{Dataset, DatasetError, expand_pattern};
use crate::pipeline::sampler::{self, Split, Uneven};
use crate::pipeline::transform::{Geometry, Transform};

/// Why a config or a producer's request cannot become a stream.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("stream `{0}` is defined twice")]
    Duplicate(String),
    /// (Its Display holds the stream's error, so it is not also a source:
    /// an error chain would print it twice.)
    #[error("stream `{stream}`: {error}")]
    Stream { stream: String, error: StreamError },
    #[error(
        "the streams' arenas need {need_mib} MiB of shared memory, more than half of this host's {have_mib} MiB; lower slots or batch_size"
    )]
    SharedMemory { need_mib: u64, have_mib: u64 },
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
    Layout(batchcast::Error),
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

/// Most slots of a stream: each mailbox consumer may owe every one of them.
pub const MAX_SLOTS: u32 = MailboxSpec::MAX_BATCHES;
/// Most samples in a batch.
pub const MAX_BATCH_SIZE: u64 = 1 << 20;
/// Most pipeline threads of a stream (each has its own stack and decoder).
pub const MAX_WORKERS: usize = 256;
/// Most consumers a stream may wait for (the broker serves 1,024
/// connections at once).
pub const MAX_MIN_CONSUMERS: u32 = 1024;
/// Most samples of a synthetic dataset (its order takes 8 bytes a sample
/// per epoch).
pub const MAX_SYNTHETIC_LEN: u64 = 1 << 27;
/// Most samples a tar shuffle buffer holds.
pub const MAX_SHUFFLE_BUFFER: usize = 1_000_000;
/// Largest output side of a transform, in pixels.
pub const MAX_SIDE: u32 = 16384;
/// Largest `max_pixels` (an image's width × height).
pub const MAX_PIXELS: u64 = 1 << 32;
/// Most hosts a dataset is split over.
pub const MAX_WORLD_SIZE: u64 = 1 << 20;
/// Most batches in an external producer's epoch.
pub const MAX_BATCHES_PER_EPOCH: u64 = 1 << 40;

/// `key = value` must lie in `lo..=hi`; the error names the key, the limit
/// and why it is there.
fn within<T: PartialOrd + std::fmt::Display>(
    key: &'static str,
    value: T,
    lo: T,
    hi: T,
    why: &str,
) -> Result<(), StreamError> {
    if value < lo || value > hi {
        return Err(StreamError::Key {
            key,
            message: format!("{key} = {value} is out of range: use {lo} to {hi} ({why})"),
        });
    }
    Ok(())
}

/// Where a stream's samples come from, described.
#[derive(Debug, Clone)]
pub enum SourcePlan {
    Synthetic(SyntheticSpec),
    Images(ImagePlan),
    /// Filled by a producer process over the socket; the broker only does
    /// the bookkeeping.
    External,
}

/// An image stream's source: the dataset's listing and what to do with
/// each sample.
#[derive(Debug, Clone)]
pub struct ImagePlan {
    pub dataset: Arc<Dataset>,
    pub transform: Transform,
    pub on_error: OnError,
    /// Largest image (width × height) decoded.
    pub max_pixels: u64,
    pub reduced_decode: bool,
    /// Budget of the cache of encoded bytes (0: none).
    pub cache_bytes: u64,
    pub split: Split,
    /// Shuffle buffer for tar shards; `None` for random access.
    pub shuffle_buffer: Option<usize>,
    pub shuffle: bool,
    pub seed: u64,
}

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
    pub min_consumers: u32,
    /// Pipeline threads (0 for an external producer).
    pub workers: usize,
    pub schema: Schema,
    pub layout: SlotLayout,
    pub source: SourcePlan,
}

impl StreamPlan {
    pub fn arena_bytes(&self) -> u64 {
        self.layout.slot_bytes * self.slots as u64
    }

    /// The dataset indices of `epoch`, in order, for this host.
    pub fn epoch_order(&self, epoch: u64) -> Vec<u64> {
        match &self.source {
            SourcePlan::Synthetic(spec) => spec.epoch_order(epoch),
            SourcePlan::Images(p) => {
                let whole = match p.shuffle_buffer {
                    Some(b) => {
                        sampler::sharded(&p.dataset.shard_items, p.shuffle, b, p.seed, epoch)
                    }
                    None => sampler::permutation(p.dataset.len(), p.shuffle, p.seed, epoch),
                };
                p.split.apply(whole)
            }
            // The producer decides what each batch holds.
            SourcePlan::External => Vec::new(),
        }
    }

    /// Plans the stream an external producer asked for, with the same
    /// checks as a configured one.
    pub fn external(
        req: &ProduceRequest,
        producer: &str,
        pid: u32,
    ) -> Result<StreamPlan, StreamError> {
        check_name(&req.stream)?;
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
        let arena = layout
            .slot_bytes
            .checked_mul(req.slots as u64)
            .ok_or_else(|| key("slots", "the arena size overflows"))?;
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
        Ok(StreamPlan {
            name: req.stream.clone(),
            slots: req.slots,
            gpu_slots: req.slots,
            epochs: req.epochs,
            lag_limit: req.lag_limit,
            min_consumers: req.min_consumers,
            workers: 0,
            schema,
            layout,
            source: SourcePlan::External,
        })
    }
}

/// Checks every configured stream and derives its plan; the arenas of all
/// of them together must fit in half of the host's memory. A config may
/// define no stream (only `[broker]`: the socket and who may connect, for
/// a broker that serves producers' streams).
pub fn plan_config(cfg: &Config) -> Result<Vec<StreamPlan>, PlanError> {
    let mut names = HashSet::new();
    let mut plans = Vec::new();
    let mut arenas = 0u64;
    for s in &cfg.streams {
        let plan = plan_stream(s).map_err(|error| PlanError::Stream {
            stream: s.name.clone(),
            error,
        })?;
        if !names.insert(s.name.clone()) {
            return Err(PlanError::Duplicate(s.name.clone()));
        }
        arenas = arenas.saturating_add(plan.arena_bytes());
        plans.push(plan);
    }
    if let Some(total) = mem_total_bytes()
        && arenas > total / 2
    {
        return Err(PlanError::SharedMemory {
            need_mib: arenas >> 20,
            have_mib: total >> 20,
        });
    }
    Ok(plans)
}

fn check_name(name: &str) -> Result<(), StreamError> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(key(
            "name",
            "name must be non-empty and use only letters, digits, `-`, `_` and `.`",
        ));
    }
    Ok(())
}

/// Checks the keys every stream has, whatever its source: batching, slots
/// and flow control.
fn check_flow(
    batch_size: u64,
    epochs: Option<u64>,
    slots: u32,
    gpu_slots: Option<u32>,
    lag_limit: Option<u32>,
    min_consumers: u32,
) -> Result<(), StreamError> {
    if batch_size == 0 {
        return Err(key("batch_size", "batch_size must be at least 1"));
    }
    within(
        "batch_size",
        batch_size,
        1,
        MAX_BATCH_SIZE,
        "samples in one batch",
    )?;
    if epochs == Some(0) {
        return Err(key(
            "epochs",
            "epochs must be at least 1 (omit it for an endless stream)",
        ));
    }
    if slots < 2 {
        return Err(key(
            "slots",
            format!(
                "slots = {slots} is too few: at least 2 so the pipeline can fill one while consumers read another"
            ),
        ));
    }
    if slots > MAX_SLOTS {
        return Err(key(
            "slots",
            format!(
                "slots = {slots} is too many: at most {MAX_SLOTS} (a consumer's mailbox has room for every slot's batch)"
            ),
        ));
    }
    if min_consumers == 0 {
        return Err(key("min_consumers", "min_consumers must be at least 1"));
    }
    within(
        "min_consumers",
        min_consumers,
        1,
        MAX_MIN_CONSUMERS,
        "the broker serves 1024 connections at once",
    )?;
    if let Some(g) = gpu_slots {
        if g < 2 {
            return Err(key(
                "gpu_slots",
                format!(
                    "gpu_slots = {g} is too few: at least 2 so one batch can be copied while consumers read another"
                ),
            ));
        }
        within(
            "gpu_slots",
            g,
            2,
            MAX_SLOTS,
            "device slots of one GPU's ring",
        )?;
    }
    if let Some(lag) = lag_limit
        && (lag == 0 || lag >= slots)
    {
        return Err(key(
            "lag_limit",
            format!(
                "lag_limit = {lag} must be between 1 and slots - 1 ({}); a consumer can never lag by {slots} or more",
                slots - 1
            ),
        ));
    }
    Ok(())
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

fn plan_stream(s: &StreamConfig) -> Result<StreamPlan, StreamError> {
    check_name(&s.name)?;
    check_flow(
        s.batch_size,
        s.epochs,
        s.slots,
        s.gpu_slots,
        s.lag_limit,
        s.min_consumers,
    )?;
    if s.workers == Some(0) {
        return Err(key("workers", "workers must be at least 1"));
    }
    if let Some(w) = s.workers {
        within(
            "workers",
            w,
            1,
            MAX_WORKERS,
            "pipeline threads; more than the host's cores only adds overhead",
        )?;
    }
    within(
        "max_pixels",
        s.max_pixels,
        1,
        MAX_PIXELS,
        "the largest width × height decoded",
    )?;
    if let Some(total) = mem_total_bytes() {
        within(
            "cache_mib",
            s.cache_mib,
            0,
            total >> 20,
            "MiB of this host's memory",
        )?;
    }
    within(
        "world_size",
        s.world_size,
        1,
        MAX_WORLD_SIZE,
        "hosts the dataset is split over",
    )?;
    let sources = [
        s.synthetic.is_some(),
        s.image_folder.is_some(),
        s.webdataset.is_some(),
    ];
    match sources.iter().filter(|&&x| x).count() {
        0 => return Err(StreamError::NoSource),
        1 => {}
        _ => return Err(StreamError::ManySources),
    }
    let parts = match &s.synthetic {
        Some(src) => synthetic_source(s, src)?,
        None => image_source(s)?,
    };
    let batches_per_epoch = if s.drop_last {
        parts.per_epoch / s.batch_size
    } else {
        parts.per_epoch.div_ceil(s.batch_size)
    };
    if batches_per_epoch == 0 {
        return Err(StreamError::FewerThanOneBatch {
            samples: parts.per_epoch,
            dataset: parts.len,
            batch_size: s.batch_size,
        });
    }
    let schema = Schema {
        fields: parts.fields,
        batch_size: s.batch_size,
        samples_per_epoch: if s.drop_last {
            batches_per_epoch * s.batch_size
        } else {
            parts.per_epoch
        },
        batches_per_epoch,
        epochs: s.epochs,
        source: parts.info,
    };
    let layout = SlotLayout::for_schema(&schema).map_err(StreamError::Layout)?;
    let default_workers =
        std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1));
    Ok(StreamPlan {
        name: s.name.clone(),
        slots: s.slots,
        gpu_slots: s.gpu_slots.unwrap_or(s.slots),
        epochs: s.epochs,
        lag_limit: s.lag_limit,
        min_consumers: s.min_consumers,
        workers: s.workers.unwrap_or(default_workers),
        schema,
        layout,
        source: parts.plan,
    })
}

/// Field names are distinct and non-empty; no dimension is zero.
fn check_fields(fields: &[Field]) -> Result<(), StreamError> {
    let mut seen = HashSet::new();
    for f in fields {
        if f.name.is_empty() {
            return Err(StreamError::Field("a field has an empty name".into()));
        }
        if !seen.insert(&f.name) {
            return Err(StreamError::Field(format!(
                "field `{}` is listed twice",
                f.name
            )));
        }
        if f.shape.contains(&0) {
            return Err(StreamError::Field(format!(
                "field `{}` has a zero dimension in its shape {:?}",
                f.name, f.shape
            )));
        }
    }
    Ok(())
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
        plan: SourcePlan::Synthetic(spec),
        info: SourceInfo::Synthetic(spec),
    })
}

fn geometry_of(t: &TransformConfig) -> Result<Geometry, StreamError> {
    let positive = |what: &'static str, (h, w): (u32, u32)| {
        if h == 0 || w == 0 {
            Err(key(what, format!("transform.{what} must be positive")))
        } else if h.max(w) > MAX_SIDE {
            Err(key(
                what,
                format!(
                    "transform.{what} = {h}×{w} is too large: at most {MAX_SIDE} pixels a side"
                ),
            ))
        } else {
            Ok((h, w))
        }
    };
    match (&t.random_resized_crop, t.resize, t.center_crop) {
        (Some(r), None, None) => {
            let ok =
                |[a, b]: [f64; 2], min: f64| a.is_finite() && b.is_finite() && a > min && a <= b;
            if !ok(r.scale, 0.0) || r.scale[1] > 1.0 {
                return Err(key(
                    "transform.random_resized_crop.scale",
                    format!(
                        "transform.random_resized_crop.scale = {:?} must be 0 < lo <= hi <= 1",
                        r.scale
                    ),
                ));
            }
            if !ok(r.ratio, 0.0) {
                return Err(key(
                    "transform.random_resized_crop.ratio",
                    format!(
                        "transform.random_resized_crop.ratio = {:?} must be 0 < lo <= hi",
                        r.ratio
                    ),
                ));
            }
            Ok(Geometry::RandomResizedCrop {
                size: positive("random_resized_crop.size", r.size.hw())?,
                scale: (r.scale[0], r.scale[1]),
                ratio: (r.ratio[0], r.ratio[1]),
            })
        }
        (None, Some(resize), _) if resize > MAX_SIDE => Err(key(
            "transform.resize",
            format!("transform.resize = {resize} is too large: at most {MAX_SIDE} pixels"),
        )),
        (None, Some(resize), Some(crop)) if resize > 0 => Ok(Geometry::ResizeCenterCrop {
            resize,
            crop: positive("center_crop", crop.hw())?,
        }),
        (None, Some(0), _) => Err(key("transform.resize", "transform.resize must be positive")),
        _ => Err(key(
            "transform",
            "transform needs exactly one geometry: random_resized_crop = { size = N }, or resize = N with center_crop = M",
        )),
    }
}

fn transform_of(s: &StreamConfig) -> Result<Transform, StreamError> {
    let Some(t) = &s.transform else {
        return Err(key(
            "transform",
            "an image source needs a [stream.transform] table (random_resized_crop, or resize + center_crop)",
        ));
    };
    let geometry = geometry_of(t)?;
    if !(0.0..=1.0).contains(&t.horizontal_flip) {
        return Err(key(
            "transform.horizontal_flip",
            format!(
                "transform.horizontal_flip = {} is a probability; use 0..1",
                t.horizontal_flip
            ),
        ));
    }
    match t.dtype {
        DType::U8 | DType::F16 | DType::Bf16 | DType::F32 => {}
        other => {
            return Err(key(
                "transform.dtype",
                format!(
                    "transform.dtype = \"{other}\" is not an image type; use u8, f16, bf16 or f32"
                ),
            ));
        }
    }
    if t.dtype == DType::U8 && t.normalize.is_some() {
        return Err(key(
            "transform.normalize",
            "transform.normalize needs a float dtype (f16, bf16 or f32), not u8",
        ));
    }
    if let Some(n) = &t.normalize
        && n.std.iter().any(|&x| x == 0.0 || !x.is_finite())
    {
        return Err(key(
            "transform.normalize.std",
            format!("transform.normalize.std = {:?} must be non-zero", n.std),
        ));
    }
    Ok(Transform {
        geometry,
        flip_p: t.horizontal_flip,
        dtype: t.dtype,
        layout: t.layout,
        normalize: t.normalize.as_ref().map(|n| (n.mean, n.std)),
        seed: s.seed,
    })
}

/// Lists the dataset (ImageFolder or tar shards) named by the config.
fn list_dataset(s: &StreamConfig) -> Result<(Dataset, Option<usize>), StreamError> {
    Ok(match (&s.image_folder, &s.webdataset) {
        (Some(f), _) => (
            Dataset::image_folder(Path::new(&expand_home(&f.root.to_string_lossy())))?,
            None,
        ),
        (_, Some(w)) => {
            within(
                "webdataset.shuffle_buffer",
                w.shuffle_buffer,
                1,
                MAX_SHUFFLE_BUFFER,
                "samples held to shuffle tar shards",
            )?;
            let shards = expand_home(&w.shards);
            let paths = expand_pattern(&shards)?;
            (
                Dataset::webdataset(&shards, &paths)?,
                Some(w.shuffle_buffer),
            )
        }
        _ => return Err(StreamError::NoSource),
    })
}

fn image_source(s: &StreamConfig) -> Result<SourceParts, StreamError> {
    let transform = transform_of(s)?;
    if s.world_size == 0 || s.rank >= s.world_size {
        return Err(key(
            "rank",
            format!(
                "rank = {} must be below world_size = {}",
                s.rank, s.world_size
            ),
        ));
    }
    if s.max_pixels == 0 {
        return Err(key("max_pixels", "max_pixels must be positive"));
    }
    let (dataset, shuffle_buffer) = list_dataset(s)?;
    let split = Split {
        rank: s.rank,
        world_size: s.world_size,
        uneven: s.uneven,
    };
    let len = dataset.len();
    if split.uneven == Uneven::Drop && len < s.world_size {
        return Err(key(
            "world_size",
            format!(
                "{len} samples cannot be split over world_size = {} with uneven = \"drop\"",
                s.world_size
            ),
        ));
    }
    let field = |name: &str, dtype, shape, aux| Field {
        name: name.into(),
        dtype,
        shape,
        aux,
    };
    let fields = vec![
        field("image", transform.dtype, transform.shape(), false),
        field("label", DType::I64, vec![], false),
        field("index", DType::I64, vec![], true),
    ];
    let info = SourceInfo::Images(ImageSourceInfo {
        format: dataset.format.into(),
        root: dataset.root.clone(),
        classes: dataset.classes.clone(),
        dataset_len: len,
        rank: s.rank,
        world_size: s.world_size,
    });
    Ok(SourceParts {
        fields,
        len,
        per_epoch: split.per_rank(len),
        plan: SourcePlan::Images(ImagePlan {
            dataset: Arc::new(dataset),
            transform,
            on_error: s.on_error,
            max_pixels: s.max_pixels,
            reduced_decode: s.reduced_decode,
            cache_bytes: s.cache_mib.saturating_mul(1 << 20),
            split,
            shuffle_buffer,
            shuffle: s.shuffle,
            seed: s.seed,
        }),
        info,
    })
}

fn mem_total_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A leading `~/` in a dataset path is the user's home folder (`$HOME`).
fn expand_home(path: &str) -> String {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => Path::new(&home).join(rest).to_string_lossy().into_owned(),
        _ => path.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::StreamToml;

    /// A minimal valid config: one synthetic stream of 10 samples.
    fn good() -> String {
        StreamToml::synthetic("train", 4, 10, &[("x", "f32", &[3])])
            .epochs(2)
            .to_toml()
    }

    fn plan(text: &str) -> Result<Vec<StreamPlan>, PlanError> {
        plan_config(&Config::parse(text, Path::new("test.toml")).unwrap())
    }

    #[test]
    fn a_minimal_config_gets_documented_defaults() {
        let plans = plan(&good()).unwrap();
        let p = &plans[0];
        assert_eq!(
            (p.slots, p.gpu_slots, p.min_consumers, p.lag_limit),
            (8, 8, 1, None)
        );
        let SourcePlan::Synthetic(spec) = p.source else {
            panic!("a synthetic source")
        };
        assert!(spec.shuffle, "shuffled by default");
        assert_eq!(
            p.schema.batches_per_epoch, 2,
            "10 samples / 4 with drop_last"
        );
        assert_eq!(p.schema.samples_per_epoch, 8);
    }

    #[test]
    fn a_typo_names_the_key_and_line() {
        let err = Config::parse(
            &good().replace("batch_size", "batch_szie"),
            Path::new("t.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("batch_szie") && err.contains("line 3"),
            "{err}"
        );
    }

    #[test]
    fn semantic_errors_name_the_stream_and_what_to_do() {
        for (from, to, expect, culprit) in [
            (
                "epochs = 2",
                "epochs = 2\nlag_limit = 8",
                "lag_limit = 8",
                Some("lag_limit"),
            ),
            ("len = 10", "len = 3", "fewer than one batch", None),
            ("shape = [3]", "shape = [0]", "zero dimension", None),
            (
                "epochs = 2",
                "epochs = 2\nslots = 1",
                "slots = 1",
                Some("slots"),
            ),
            (
                "epochs = 2",
                "epochs = 2\ngpu_slots = 1",
                "gpu_slots = 1 is too few",
                Some("gpu_slots"),
            ),
            (
                "name = \"train\"",
                "name = \"a b\"",
                "name must",
                Some("name"),
            ),
        ] {
            let err = plan(&good().replace(from, to)).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(expect) && text.contains("stream `"), "{text}");
            if let Some(culprit) = culprit {
                assert!(
                    matches!(&err, PlanError::Stream { error: StreamError::Key { key, .. }, .. } if *key == culprit),
                    "{err:?}"
                );
            }
        }
        let twice = format!("{}\n{}", good(), good());
        assert!(
            plan(&twice)
                .unwrap_err()
                .to_string()
                .contains("defined twice")
        );
    }

    #[test]
    fn every_numeric_key_is_bounded_and_the_error_names_key_and_limit() {
        for (key, extra, limit) in [
            ("workers", "workers = 100000", "256"),
            ("batch_size", "", "1048576"),
            ("min_consumers", "min_consumers = 5000", "1024"),
            ("gpu_slots", "gpu_slots = 20000", "16384"),
            ("max_pixels", "max_pixels = 10000000000", "4294967296"),
            ("world_size", "world_size = 2000000", "1048576"),
            ("synthetic.len", "", "134217728"),
        ] {
            let text = match key {
                "batch_size" => good().replace("batch_size = 4", "batch_size = 2000000"),
                "synthetic.len" => good().replace("len = 10", "len = 200000000"),
                _ => good().replace("epochs = 2", &format!("epochs = 2\n{extra}")),
            };
            let err = plan(&text).unwrap_err();
            let PlanError::Stream {
                error: StreamError::Key { key: k, message },
                ..
            } = &err
            else {
                panic!("{key}: {err:?}")
            };
            assert_eq!(*k, key, "{message}");
            assert!(message.contains(limit), "{key}: {message}");
        }
    }

    #[test]
    fn a_config_of_only_the_broker_section_plans_no_stream() {
        let cfg = Config::parse("[broker]\nallow_uids = [1234]\n", Path::new("b.toml")).unwrap();
        assert_eq!(cfg.broker.allow_uids, [1234]);
        assert!(plan_config(&cfg).unwrap().is_empty());
    }

    #[test]
    fn keeping_the_last_short_batch() {
        let plans = plan(&good().replace("epochs = 2", "epochs = 2\ndrop_last = false")).unwrap();
        assert_eq!(plans[0].schema.batches_per_epoch, 3);
        assert_eq!(plans[0].schema.samples_per_epoch, 10);
    }

    #[test]
    fn a_producer_request_is_checked_like_a_config() {
        let field = Field {
            name: "x".into(),
            dtype: DType::U8,
            shape: vec![4],
            aux: false,
        };
        let mut req = ProduceRequest::new("ext", vec![field], 8, 3);
        let p = StreamPlan::external(&req, "loader", 7).unwrap();
        assert_eq!((p.slots, p.workers, p.schema.samples_per_epoch), (4, 0, 24));
        req.slots = 1;
        let err = StreamPlan::external(&req, "loader", 7).unwrap_err();
        assert!(
            matches!(err, StreamError::Key { key: "slots", .. }),
            "{err}"
        );
        req.slots = 4;
        req.stream = "a/b".into();
        assert!(StreamPlan::external(&req, "loader", 7).is_err());
    }
}
