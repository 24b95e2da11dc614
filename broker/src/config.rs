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
//! gpu_slots = 4         # per GPU with consumers; default: slots
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
//!
//! [[stream]]            # real images: see README "Image streams"
//! name = "imagenet"
//! batch_size = 64
//! on_error = "skip"     # or "fail"
//! cache_mib = 4096      # MinIO cache of encoded bytes; 0 = off
//! rank = 0              # this host's share of a multi-host job
//! world_size = 1
//!
//! [stream.image_folder] # or [stream.webdataset] shards = "/d/shard-{000000..000099}.tar"
//! root = "/data/imagenet/train"   # a leading ~/ is $HOME
//!
//! [stream.transform]
//! random_resized_crop = { size = 224 }   # or resize = 256, center_crop = 224
//! horizontal_flip = 0.5
//! normalize = { mean = [0.485, 0.456, 0.406], std = [0.229, 0.224, 0.225] }
//! dtype = "f32"         # u8 | f16 | bf16 | f32
//! layout = "NCHW"       # or "NHWC"
//! ```

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use batchcast::DType;
use batchcast::proto::ProduceRequest;
use batchcast::schema::{
    ExternalSourceInfo, Field, ImageSourceInfo, Schema, SlotLayout, SourceInfo,
};
use batchcast::synthetic::{Fill, SyntheticSpec};
use serde::Deserialize;

use crate::pipeline::dataset::{Dataset, expand_pattern};
use crate::pipeline::sampler::{self, Split, Uneven};
use crate::pipeline::transform::{Geometry, Layout, Transform};
use crate::pipeline::{ImagePipeline, OnError};

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

#[derive(Debug, Clone, Default, Deserialize)]
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
    /// Slots of each GPU's arena (default: `slots`). Released independently
    /// of host slots, so GPU memory can be smaller than host memory.
    pub gpu_slots: Option<u32>,
    /// Pipeline threads; default: all cores but one.
    pub workers: Option<usize>,
    pub lag_limit: Option<u32>,
    #[serde(default = "one")]
    pub min_consumers: u32,
    pub synthetic: Option<SyntheticConfig>,
    pub image_folder: Option<ImageFolderConfig>,
    pub webdataset: Option<WebDatasetConfig>,
    pub transform: Option<TransformConfig>,
    /// This host's share of the dataset (DistributedSampler's split).
    #[serde(default)]
    pub rank: u64,
    #[serde(default = "one64")]
    pub world_size: u64,
    /// DistributedSampler's `drop_last`: pad (default) or drop the tail.
    #[serde(default)]
    pub uneven: Uneven,
    #[serde(default)]
    pub on_error: OnError,
    /// Largest image (width × height) decoded; PIL's default limit.
    #[serde(default = "default_max_pixels")]
    pub max_pixels: u64,
    /// Decode JPEGs at 1/2, 1/4 or 1/8 size when the output is that much
    /// smaller anyway.
    #[serde(default = "yes")]
    pub reduced_decode: bool,
    /// Budget of the MinIO cache of encoded bytes, in MiB (0: no cache).
    #[serde(default)]
    pub cache_mib: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageFolderConfig {
    pub root: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebDatasetConfig {
    /// `/data/shard-{000000..000099}.tar`, or one file.
    pub shards: String,
    /// Samples held by the shuffle buffer.
    #[serde(default = "default_shuffle_buffer")]
    pub shuffle_buffer: usize,
}

/// `int` or `[height, width]`, as torchvision takes sizes.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum Size {
    Square(u32),
    HeightWidth([u32; 2]),
}

impl Size {
    fn hw(self) -> (u32, u32) {
        match self {
            Size::Square(s) => (s, s),
            Size::HeightWidth([h, w]) => (h, w),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomResizedCropConfig {
    pub size: Size,
    #[serde(default = "default_scale")]
    pub scale: [f64; 2],
    #[serde(default = "default_ratio")]
    pub ratio: [f64; 2],
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NormalizeConfig {
    pub mean: [f64; 3],
    pub std: [f64; 3],
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransformConfig {
    pub random_resized_crop: Option<RandomResizedCropConfig>,
    /// Shorter side, for evaluation (with `center_crop`).
    pub resize: Option<u32>,
    pub center_crop: Option<Size>,
    /// Probability of a horizontal flip.
    #[serde(default)]
    pub horizontal_flip: f64,
    pub normalize: Option<NormalizeConfig>,
    #[serde(default = "default_dtype")]
    pub dtype: DType,
    #[serde(default)]
    pub layout: Layout,
}

fn one64() -> u64 {
    1
}
fn default_max_pixels() -> u64 {
    89_478_485
}
fn default_shuffle_buffer() -> usize {
    1000
}
fn default_scale() -> [f64; 2] {
    [0.08, 1.0]
}
fn default_ratio() -> [f64; 2] {
    [3.0 / 4.0, 4.0 / 3.0]
}
fn default_dtype() -> DType {
    DType::F32
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
/// Most slots of a stream: each mailbox consumer may owe every one of them.
pub const MAX_SLOTS: u32 = batchcast::proto::MailboxSpec::MAX_BATCHES;

fn default_slots() -> u32 {
    8
}

/// Where a stream's samples come from, ready to run.
#[derive(Debug, Clone)]
pub enum Source {
    Synthetic(SyntheticSpec),
    Images {
        pipeline: Arc<ImagePipeline>,
        split: Split,
        /// Shuffle buffer for tar shards; `None` for random access.
        shuffle_buffer: Option<usize>,
    },
    /// Filled by a producer process over the socket; the broker only does
    /// the bookkeeping.
    External,
}

/// A stream's config after validation, with everything derived from it.
#[derive(Debug, Clone)]
pub struct StreamPlan {
    pub cfg: StreamConfig,
    pub schema: Schema,
    pub layout: SlotLayout,
    pub source: Source,
    pub workers: usize,
}

impl StreamPlan {
    pub fn arena_bytes(&self) -> u64 {
        self.layout.slot_bytes * self.cfg.slots as u64
    }

    /// Slots of each GPU's arena.
    pub fn gpu_slots(&self) -> u32 {
        self.cfg.gpu_slots.unwrap_or(self.cfg.slots)
    }

    /// The dataset indices of `epoch`, in order, for this host.
    pub fn epoch_order(&self, epoch: u64) -> Vec<u64> {
        match &self.source {
            Source::Synthetic(spec) => spec.epoch_order(epoch),
            Source::Images {
                pipeline,
                split,
                shuffle_buffer,
            } => {
                let ds = &pipeline.dataset;
                let (shuffle, seed) = (self.cfg.shuffle, self.cfg.seed);
                let whole = match shuffle_buffer {
                    Some(b) => sampler::sharded(&ds.shard_items, shuffle, *b, seed, epoch),
                    None => sampler::permutation(ds.len(), shuffle, seed, epoch),
                };
                split.apply(whole)
            }
            // The producer decides what each batch holds.
            Source::External => Vec::new(),
        }
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

/// Checks what every stream needs, whatever its source.
fn check_common(s: &StreamConfig) -> Result<(), String> {
    if s.name.is_empty()
        || !s
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err("name must be non-empty and use only letters, digits, `-`, `_` and `.`".into());
    }
    if s.batch_size == 0 {
        return Err("batch_size must be at least 1".into());
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
    if s.slots > MAX_SLOTS {
        return Err(format!(
            "slots = {} is too many: at most {MAX_SLOTS} (a consumer's mailbox has room for every slot's batch)",
            s.slots
        ));
    }
    if s.min_consumers == 0 {
        return Err("min_consumers must be at least 1".into());
    }
    if let Some(g) = s.gpu_slots
        && g < 2
    {
        return Err(format!(
            "gpu_slots = {g} is too few: at least 2 so one batch can be copied while consumers read another"
        ));
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
    Ok(())
}

fn plan_stream(s: &StreamConfig) -> Result<StreamPlan, String> {
    check_common(s)?;
    let sources = [
        s.synthetic.is_some(),
        s.image_folder.is_some(),
        s.webdataset.is_some(),
    ];
    match sources.iter().filter(|&&x| x).count() {
        0 => {
            return Err(
                "no source: add a [stream.image_folder], [stream.webdataset] or [stream.synthetic] table"
                    .into(),
            );
        }
        1 => {}
        _ => return Err("more than one source table; keep exactly one".into()),
    }
    let (fields, len, samples_per_epoch, source, info) = match &s.synthetic {
        Some(src) => synthetic_source(s, src)?,
        None => image_source(s)?,
    };
    let batches_per_epoch = if s.drop_last {
        samples_per_epoch / s.batch_size
    } else {
        samples_per_epoch.div_ceil(s.batch_size)
    };
    if batches_per_epoch == 0 {
        return Err(format!(
            "the dataset has {samples_per_epoch} samples per epoch{}, fewer than one batch of {} with drop_last = true",
            if len != samples_per_epoch {
                format!(" on this host (of {len})")
            } else {
                String::new()
            },
            s.batch_size
        ));
    }
    let schema = Schema {
        fields,
        batch_size: s.batch_size,
        samples_per_epoch: if s.drop_last {
            batches_per_epoch * s.batch_size
        } else {
            samples_per_epoch
        },
        batches_per_epoch,
        epochs: s.epochs,
        source: info,
    };
    let layout = SlotLayout::for_schema(&schema).map_err(|e| e.to_string())?;
    let default_workers =
        std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1));
    Ok(StreamPlan {
        cfg: s.clone(),
        schema,
        layout,
        source,
        workers: s.workers.unwrap_or(default_workers),
    })
}

type SourceParts = (Vec<Field>, u64, u64, Source, SourceInfo);

/// Field names are distinct and non-empty; no dimension is zero.
fn check_fields(fields: &[Field]) -> Result<(), String> {
    let mut seen = HashSet::new();
    for f in fields {
        if f.name.is_empty() {
            return Err("a field has an empty name".into());
        }
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
    Ok(())
}

/// Plans the stream an external producer asked for, with the same checks
/// as a configured one; the message says what to change.
pub fn plan_external(req: &ProduceRequest, producer: &str, pid: u32) -> Result<StreamPlan, String> {
    let cfg = StreamConfig {
        name: req.stream.clone(),
        batch_size: req.batch_size,
        epochs: req.epochs,
        shuffle: false,
        seed: 0,
        drop_last: false,
        slots: req.slots,
        gpu_slots: None,
        workers: None,
        lag_limit: req.lag_limit,
        min_consumers: req.min_consumers,
        synthetic: None,
        image_folder: None,
        webdataset: None,
        transform: None,
        rank: 0,
        world_size: 1,
        uneven: Uneven::default(),
        on_error: OnError::default(),
        max_pixels: default_max_pixels(),
        reduced_decode: false,
        cache_mib: 0,
    };
    check_common(&cfg)?;
    if req.fields.is_empty() {
        return Err("the batch has no fields".into());
    }
    check_fields(&req.fields)?;
    if req.batches_per_epoch == 0 {
        return Err("batches_per_epoch must be at least 1".into());
    }
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
    let layout = SlotLayout::for_schema(&schema).map_err(|e| e.to_string())?;
    let plan = StreamPlan {
        cfg,
        schema,
        layout,
        source: Source::External,
        workers: 0,
    };
    let arena = plan
        .layout
        .slot_bytes
        .checked_mul(plan.cfg.slots as u64)
        .ok_or("the arena size overflows")?;
    if let Some(total) = mem_total_bytes()
        && arena > total / 2
    {
        return Err(format!(
            "the arena needs {} MiB of shared memory ({} slots of {} MiB), more than half of this host's {} MiB; use fewer slots or smaller batches",
            arena >> 20,
            plan.cfg.slots,
            plan.layout.slot_bytes >> 20,
            total >> 20
        ));
    }
    Ok(plan)
}

fn synthetic_source(s: &StreamConfig, src: &SyntheticConfig) -> Result<SourceParts, String> {
    if src.len == 0 {
        return Err("synthetic.len must be at least 1".into());
    }
    if s.world_size != 1 || s.transform.is_some() {
        return Err("rank/world_size and [stream.transform] apply to image sources only".into());
    }
    if src.fields.is_empty() {
        return Err("synthetic.fields is empty; list at least one field".into());
    }
    check_fields(&src.fields)?;
    let spec = SyntheticSpec {
        seed: s.seed,
        len: src.len,
        shuffle: s.shuffle,
        fill: src.fill,
    };
    Ok((
        src.fields.clone(),
        src.len,
        src.len,
        Source::Synthetic(spec),
        SourceInfo::Synthetic(spec),
    ))
}

fn transform_of(s: &StreamConfig) -> Result<Transform, String> {
    let Some(t) = &s.transform else {
        return Err("an image source needs a [stream.transform] table (random_resized_crop, or resize + center_crop)".into());
    };
    let positive = |what: &str, (h, w): (u32, u32)| {
        if h == 0 || w == 0 {
            Err(format!("transform.{what} must be positive"))
        } else {
            Ok((h, w))
        }
    };
    let geometry = match (&t.random_resized_crop, t.resize, t.center_crop) {
        (Some(r), None, None) => {
            let ok =
                |[a, b]: [f64; 2], min: f64| a.is_finite() && b.is_finite() && a > min && a <= b;
            if !ok(r.scale, 0.0) || r.scale[1] > 1.0 {
                return Err(format!(
                    "transform.random_resized_crop.scale = {:?} must be 0 < lo <= hi <= 1",
                    r.scale
                ));
            }
            if !ok(r.ratio, 0.0) {
                return Err(format!(
                    "transform.random_resized_crop.ratio = {:?} must be 0 < lo <= hi",
                    r.ratio
                ));
            }
            Geometry::RandomResizedCrop {
                size: positive("random_resized_crop.size", r.size.hw())?,
                scale: (r.scale[0], r.scale[1]),
                ratio: (r.ratio[0], r.ratio[1]),
            }
        }
        (None, Some(resize), Some(crop)) if resize > 0 => Geometry::ResizeCenterCrop {
            resize,
            crop: positive("center_crop", crop.hw())?,
        },
        (None, Some(0), _) => return Err("transform.resize must be positive".into()),
        _ => {
            return Err(
                "transform needs exactly one geometry: random_resized_crop = { size = N }, or resize = N with center_crop = M"
                    .into(),
            );
        }
    };
    if !(0.0..=1.0).contains(&t.horizontal_flip) {
        return Err(format!(
            "transform.horizontal_flip = {} is a probability; use 0..1",
            t.horizontal_flip
        ));
    }
    match t.dtype {
        DType::U8 | DType::F16 | DType::Bf16 | DType::F32 => {}
        other => {
            return Err(format!(
                "transform.dtype = \"{other}\" is not an image type; use u8, f16, bf16 or f32"
            ));
        }
    }
    if t.dtype == DType::U8 && t.normalize.is_some() {
        return Err("transform.normalize needs a float dtype (f16, bf16 or f32), not u8".into());
    }
    if let Some(n) = &t.normalize
        && n.std.iter().any(|&x| x == 0.0 || !x.is_finite())
    {
        return Err(format!(
            "transform.normalize.std = {:?} must be non-zero",
            n.std
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

fn image_source(s: &StreamConfig) -> Result<SourceParts, String> {
    let transform = transform_of(s)?;
    if s.world_size == 0 || s.rank >= s.world_size {
        return Err(format!(
            "rank = {} must be below world_size = {}",
            s.rank, s.world_size
        ));
    }
    if s.max_pixels == 0 {
        return Err("max_pixels must be positive".into());
    }
    let (dataset, shuffle_buffer) = match (&s.image_folder, &s.webdataset) {
        (Some(f), _) => (
            Dataset::image_folder(Path::new(&expand_home(&f.root.to_string_lossy())))
                .map_err(|e| e.to_string())?,
            None,
        ),
        (_, Some(w)) => {
            let shards = expand_home(&w.shards);
            let paths = expand_pattern(&shards).map_err(|e| e.to_string())?;
            (
                Dataset::webdataset(&shards, &paths).map_err(|e| e.to_string())?,
                Some(w.shuffle_buffer),
            )
        }
        _ => unreachable!("one source checked above"),
    };
    let split = Split {
        rank: s.rank,
        world_size: s.world_size,
        uneven: s.uneven,
    };
    let len = dataset.len();
    if split.uneven == Uneven::Drop && len < s.world_size {
        return Err(format!(
            "{len} samples cannot be split over world_size = {} with uneven = \"drop\"",
            s.world_size
        ));
    }
    let fields = vec![
        Field {
            name: "image".into(),
            dtype: transform.dtype,
            shape: transform.shape(),
            aux: false,
        },
        Field {
            name: "label".into(),
            dtype: DType::I64,
            shape: vec![],
            aux: false,
        },
        Field {
            name: "index".into(),
            dtype: DType::I64,
            shape: vec![],
            aux: true,
        },
    ];
    let info = SourceInfo::Images(ImageSourceInfo {
        format: dataset.format.into(),
        root: dataset.root.clone(),
        classes: dataset.classes.clone(),
        dataset_len: len,
        rank: s.rank,
        world_size: s.world_size,
    });
    let pipeline = ImagePipeline::new(
        dataset,
        transform,
        s.on_error,
        s.max_pixels,
        s.reduced_decode,
        s.cache_mib.saturating_mul(1 << 20),
    );
    Ok((
        fields,
        len,
        split.per_rank(len),
        Source::Images {
            pipeline: Arc::new(pipeline),
            split,
            shuffle_buffer,
        },
        info,
    ))
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
            (
                "epochs = 2",
                "epochs = 2\ngpu_slots = 1",
                "gpu_slots = 1 is too few",
            ),
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
