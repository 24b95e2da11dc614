//! The broker's TOML config: one or more named streams and who may connect.
//!
//! ```toml
//! [broker]
//! socket = "/run/user/1000/batchcast.sock"   # optional; --socket overrides
//! allow_uids = [1001]                         # other users who may connect
//! allow_gids = [2000]
//! allow_groups = ["batchcast"]                # by name: its members may connect
//! max_connections = 1024                     # all users together
//! max_connections_per_uid = 128              # each user but the broker's
//! idle_timeout_s = 60                        # stats connections asking nothing
//! memory_mib = 16384                         # arenas, GPU arenas, mailboxes, buffers
//! max_cpu_share = 0.5                         # of the cores, for the pipeline threads of streams without workers
//! registration_timeout_s = 30                # a producer's first Acquire
//! guest_stream_prefix = "{user}."             # names other users may register
//!
//! [[stream]]
//! name = "train"
//! batch_size = 64
//! epochs = 3            # omit for an endless stream
//! shuffle = true
//! seed = 0
//! drop_last = false     # consumers' default; each may choose its own
//! slots = 8
//! gpu_slots = 4         # per GPU with consumers; default: slots
//! workers = 1         # absent: as many as the trainers need, within [broker] max_cpu_share
//! lag_limit = 4         # a rate bound: detach one this many batches behind (decoupled: cut instead)
//! pace = "auto"         # or "lockstep", "decoupled": see docs/python-client.md and ARCHITECTURE "Decoupled pace"
//! run_ahead_mib = 512   # decoupled: memory the pipeline runs ahead in (sets slots)
//! hold_limit_s = 2      # longest one consumer keeps the others waiting: then cut to replay or detached (inf: no bound)
//! held_batch_limit_s = 30  # where the ring cannot move (GPU consumers, a producer): the same for one holding the batch needed next
//! rotate_epochs = true  # a replayed consumer may read an epoch from where the stream is, its start last
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
//! [[stream]]            # real images: see docs/image-streams.md
//! name = "imagenet"
//! batch_size = 64
//! on_error = "skip"     # or "fail"
//! cache_mib = 4096      # MinIO cache of encoded bytes; 0 = off; absent: sized by the broker
//! decoded_cache_mib = 0 # MinIO cache of decoded images (from the memory budget); 0 = off; absent: sized by the broker
//! decoded_side = 256    # ... JPEGs kept at the DCT scale leaving the longer side >= this (changes bytes)
//! max_file_bytes = 268435456   # larger samples are bad files
//! rank = 0              # this host's share of a multi-host job; or
//! world_size = 1        # { env = "VAR" }, "torchrun" or "slurm" (config/share.rs)
//!
//! [stream.image_folder] # or [stream.webdataset] shards = "/d/shard-{000000..000099}.tar"
//! root = "/data/imagenet/train"   # a leading ~/ is $HOME
//!
//! [stream.transform]
//! random_resized_crop = { size = 224 }   # or resize = 256, center_crop = 224
//! # or: resize = [h, w]; random_crop = { size = 32, padding = 4 }; pad = 4
//! horizontal_flip = 0.5
//! normalize = { mean = [0.485, 0.456, 0.406], std = [0.229, 0.224, 0.225] }
//! dtype = "f32"         # u8 | f16 | bf16 | f32
//! layout = "NCHW"       # or "NHWC"
//! # augmentations, applied in this order after the crop and flip:
//! vertical_flip = 0.0
//! color_jitter = { brightness = 0.4, contrast = 0.4, saturation = 0.4 }
//! grayscale = 0.0       # RandomGrayscale(p)
//! gaussian_blur = { kernel_size = 23, sigma = [0.1, 2.0], p = 0.5 }
//! trivial_augment_wide = true   # or rand_augment = { num_ops = 2, magnitude = 9 }
//!                               # or auto_augment = "imagenet"
//! random_erasing = { p = 0.25 }   # on the tensor, last (scale, ratio, value as torchvision)
//!
//! [[source]]            # one dataset, order and split, decoded once for
//! name = "photos"       # every stream that names it: see docs/image-streams.md "Shared sources"
//! shuffle = true        # every dataset key of a stream lives here instead
//! seed = 0
//! decode = "exact"      # or "once": see `DecodeShare`
//! ahead = 1024          # samples a stream may run ahead of a slower one
//! decoded_mib = 512     # decoded images left for the other streams, at most
//! [source.image_folder]
//! root = "/data/photos"
//!
//! [[stream]]
//! name = "crop160"
//! source = "photos"
//! batch_size = 128
//! [stream.transform]
//! random_resized_crop = { size = 160 }
//! ```
//!
//! This module only describes: it parses and names what was written. The
//! checks, and everything derived from a stream's description (schema,
//! slot layout, the dataset's listing), are [`crate::plan`]'s.

use std::path::{Path, PathBuf};

use batchcast::schema::Field;
use batchcast::synthetic::Fill;
use serde::Deserialize;

use crate::pipeline::OnError;
use crate::pipeline::sampler::Uneven;
use crate::pipeline::shared::DecodeShare;

mod share;
mod stream_toml;
mod transform;
pub use stream_toml::{StreamToml, image_stream_toml};
pub use transform::*;

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
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub broker: BrokerSection,
    /// Configured streams; none is fine (producers register theirs).
    #[serde(rename = "stream", default)]
    pub streams: Vec<StreamConfig>,
    /// Sources several streams share (each names one with `source`).
    #[serde(rename = "source", default)]
    pub sources: Vec<SourceConfig>,
}

/// Declares [`StreamConfig`] and [`SourceConfig`] with the keys that
/// describe a source (dataset, order, split, what a bad file does) written
/// once: both structs end with them, [`SOURCE_KEYS`] names them, and
/// [`StreamConfig::with_source_keys`] takes them from a `[[source]]`.
macro_rules! with_source_keys {
    (
        source keys { $( $(#[$km:meta])* $key:ident : $kty:ty, )* }
        $(#[$sm:meta])* pub struct StreamConfig { $($stream:tt)* }
        $(#[$om:meta])* pub struct SourceConfig { $($source:tt)* }
    ) => {
        /// The keys of a `[[stream]]` that describe its source: a stream
        /// that names a `[[source]]` takes them from it.
        pub(crate) const SOURCE_KEYS: &[&str] = &[$(stringify!($key)),*];

        $(#[$sm])*
        pub struct StreamConfig { $($stream)* $( $(#[$km])* pub $key: $kty, )* }

        $(#[$om])*
        pub struct SourceConfig { $($source)* $( $(#[$km])* pub $key: $kty, )* }

        impl StreamConfig {
            /// This stream with `src`'s source keys in place of its own.
            pub(crate) fn with_source_keys(&self, src: &SourceConfig) -> StreamConfig {
                StreamConfig { $( $key: src.$key.clone(), )* ..self.clone() }
            }
        }
    };
}

with_source_keys! {
    source keys {
        image_folder: Option<ImageFolderConfig>,
        webdataset: Option<WebDatasetConfig>,
        #[serde(default = "yes")]
        shuffle: bool,
        #[serde(default)]
        seed: u64,
        /// This host's share of the dataset (DistributedSampler's split):
        /// numbers, or from the environment (`share.rs`).
        #[serde(default, deserialize_with = "share::rank")]
        rank: u64,
        #[serde(default = "one64", deserialize_with = "share::world_size")]
        world_size: u64,
        /// DistributedSampler's `drop_last`: pad (default) or drop the tail.
        #[serde(default)]
        uneven: Uneven,
        #[serde(default)]
        on_error: OnError,
        /// Largest image (width × height) decoded; PIL's default limit.
        #[serde(default = "default_max_pixels")]
        max_pixels: u64,
        /// Largest encoded sample read, in bytes (a file, or a tar member).
        #[serde(default = "default_max_file_bytes")]
        max_file_bytes: u64,
        /// Decode JPEGs at 1/2, 1/4 or 1/8 size when the output is that
        /// much smaller anyway.
        #[serde(default = "yes")]
        reduced_decode: bool,
        /// Decode only the part of a JPEG RandomResizedCrop reads (the
        /// same bytes as decoding it all).
        #[serde(default = "yes")]
        crop_decode: bool,
        /// Budget of the MinIO cache of encoded bytes, in MiB (0: no
        /// cache; absent: the broker sizes it, `pipeline::autosize`).
        cache_mib: Option<u64>,
        /// Budget of the MinIO cache of decoded images, in MiB (0: none;
        /// absent: the broker sizes it), taken from the broker's memory
        /// budget. Bytes as without it, unless `decoded_side` is set.
        decoded_cache_mib: Option<u64>,
        /// JPEGs are kept at the largest DCT reduction that leaves the
        /// longer side at least this (every JPEG then decoded at its kept
        /// scale: other bytes than without); absent: at the scale each
        /// crop decodes at.
        decoded_side: Option<u32>,
        /// How a dataset in an object store or on an HTTP server is read
        /// (`[stream.remote]`; defaults when absent).
        remote: Option<RemoteConfig>,
    }

    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct StreamConfig {
        pub name: String,
        /// A `[[source]]` this stream shares (its source keys come from there).
        pub source: Option<String>,
        /// Which of [`SOURCE_KEYS`] the stream's own table writes (filled by
        /// [`Config::parse`]; a stream that names a source may write none).
        #[serde(skip)]
        pub(crate) own_source_keys: Vec<&'static str>,
        /// The `[stream.transform]` table as written (filled by
        /// [`Config::parse`]): the stream's digest is of what it says.
        #[serde(skip)]
        pub(crate) transform_table: Option<toml::Value>,
        pub batch_size: u64,
        /// `None`: endless.
        pub epochs: Option<u64>,
        /// The default of consumers that do not choose whether to drop an
        /// epoch's short last batch (false, as a DataLoader's). The stream
        /// makes every sample of every epoch either way.
        #[serde(default)]
        pub drop_last: bool,
        /// Slots of the host ring; default: enough for `max_batch_size` (at
        /// least 8).
        pub slots: Option<u32>,
        /// The largest batch size a consumer of the stream will ask for with
        /// the default window of 2: the ring is sized for it (default: a few
        /// times `batch_size`, as far as a quarter of the memory budget
        /// allows). Larger sizes are refused with the largest that fits.
        pub max_batch_size: Option<u64>,
        /// Slots of each GPU's arena (default: `slots`). Released independently
        /// of host slots, so GPU memory can be smaller than host memory.
        pub gpu_slots: Option<u32>,
        /// Pipeline threads, all working; absent: as many as the trainers
        /// need, within `[broker] max_cpu_share` of the host's cores for
        /// every such stream together (`stream/autoscale.rs`).
        pub workers: Option<usize>,
        /// Detach a consumer this many batches behind the least behind one;
        /// under decoupled pace a consumer is cut and replayed to instead
        /// (host and GPU consumers alike).
        pub lag_limit: Option<u32>,
        /// Who sets the pipeline's pace; see [`Pace`].
        #[serde(default)]
        pub pace: Pace,
        /// Decoupled pace: how far the pipeline may run ahead of the slowest
        /// consumer, as memory (MiB of the host arena); sets `slots`.
        pub(crate) run_ahead_mib: Option<u64>,
        /// The longest one consumer may keep the pipeline waiting while
        /// another waits for data (it paused, or holds the batch needed
        /// next): then it is cut to replay, or detached if it cannot be
        /// (a producer's stream); default 2 s, `inf` for no bound.
        /// Decoupled pace cuts at once.
        pub hold_limit_s: Option<f64>,
        /// Where the ring cannot move away from a held batch (a stream
        /// with GPU consumers, a producer's stream): how long one whose
        /// program holds the batch the ring needs next (a cut cannot free
        /// it) may keep the others waiting, then it is detached; default
        /// 30 s, at least `hold_limit_s`, `inf` for no bound. Elsewhere the
        /// ring moves on without that batch at `hold_limit_s`.
        pub held_batch_limit_s: Option<f64>,
        /// A replayed consumer (a late joiner, one cut) reads an epoch
        /// whose start the ring no longer holds from where the shared
        /// stream is and that start after its end (`true`, the default:
        /// its start replayed, not the whole epoch), or always in the
        /// stream's order (`false`: the same order on every run, whatever
        /// the timing). See ARCHITECTURE "Rotated epochs".
        pub(crate) rotate_epochs: Option<bool>,
        #[serde(default = "one")]
        pub min_consumers: u32,
        pub synthetic: Option<SyntheticConfig>,
        pub transform: Option<TransformConfig>,
    }

    /// A `[[source]]`: a dataset, its order and split, shared by the streams
    /// that name it; its keys mean what they mean in a `[[stream]]`.
    #[derive(Debug, Clone, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct SourceConfig {
        pub name: String,
        /// Which JPEG scale a shared decode is made at.
        #[serde(default)]
        pub decode: DecodeShare,
        /// Samples a stream may run ahead of a slower stream of the source
        /// (default: four times the largest `workers × batch_size`).
        pub ahead: Option<u64>,
        /// MiB of decoded images left for the other streams, at most.
        #[serde(default = "default_decoded_mib")]
        pub(crate) decoded_mib: u64,
    }
}

fn default_decoded_mib() -> u64 {
    512
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
    /// The same by name (`/etc/group`, or NSS), looked up at start.
    #[serde(default)]
    pub allow_groups: Vec<String>,
    /// Connections served at once, all users together (default 1024).
    pub max_connections: Option<u64>,
    /// Connections each user other than the broker's may hold (default 128).
    pub max_connections_per_uid: Option<u64>,
    /// Seconds a stats connection may ask nothing before it is closed
    /// (default 60).
    pub idle_timeout_s: Option<u64>,
    /// MiB the broker may allocate for clients in all: arenas, GPU
    /// arenas, mailboxes, frame buffers (default: half of this host's RAM).
    pub memory_mib: Option<u64>,
    /// The most of the host's cores the pipeline threads of the streams
    /// that leave `workers` out may work on, all together (above 0, at
    /// most 1; default 0.5, at least one thread each), leaving the
    /// trainers theirs.
    pub max_cpu_share: Option<f64>,
    /// Seconds a producer's registration may hold its arena before its
    /// first `Acquire` (default 30).
    pub(crate) registration_timeout_s: Option<u64>,
    /// What the names of streams registered by other users than the
    /// broker's must start with; `{user}` and `{uid}` are replaced
    /// (default `"{user}."`; `""` allows any name not taken).
    pub(crate) guest_stream_prefix: Option<String>,
}

/// Who sets a stream's pace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pace {
    /// Lockstep while the slowest consumer moves; one that stalls (its
    /// unit pins the ring 8 times its usual step, and at least 0.25 s) is
    /// cut to replay at once, not after `hold_limit_s` (the default; see
    /// `stream/hold.rs`).
    #[default]
    Auto,
    /// The slowest consumer: the pipeline waits for it, up to
    /// `hold_limit_s`.
    Lockstep,
    /// The fastest consumers: the arena holds what slower ones have not
    /// read yet; one that falls a whole arena behind is cut from the
    /// shared stream and goes on from replay (recomputed batches), and
    /// merges back where the shared stream still holds its samples.
    /// Every consumer of a stream the broker computes: host or GPU, with
    /// a mailbox or on the socket, a group member (replayed its share).
    Decoupled,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageFolderConfig {
    /// A folder, or a URL: `s3://bucket/prefix/`, `gs://`, `az://`,
    /// `http(s)://` (with a manifest unless the server lists: WebDAV).
    pub root: String,
    /// A remote folder's list of files (`class/name.jpg` per line,
    /// relative to `root`): a URL, or a name under `root`. Plain HTTP
    /// servers cannot list.
    pub manifest: Option<String>,
}

/// How a remote dataset is read: `[stream.remote]` (see
/// docs/remote-datasets.md). Credentials come from the environment only.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteConfig {
    /// Samples (objects, tar members) fetched or held ahead of the
    /// pipeline.
    #[serde(default = "default_read_ahead")]
    pub(crate) read_ahead: u32,
    /// Their bytes, at most (from the broker's memory budget).
    #[serde(default = "default_read_ahead_mib")]
    pub read_ahead_mib: u64,
    /// Requests in flight at once, at most (halved on 429/503).
    #[serde(default = "default_requests")]
    pub requests: u32,
    /// A shard's range requests, at most (members read together go out
    /// as one; the index reads shards in parts of this size).
    #[serde(default = "default_part_mib")]
    pub part_mib: u64,
    /// One request, from sending it to its last byte.
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
    /// Tries after the first, with backoff and jitter.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// The longest one read may take, retries included; then it is a bad
    /// sample (`on_error`).
    #[serde(default = "default_stall_s")]
    pub(crate) stall_s: f64,
    /// The disk tier of the cache (whole objects and shard parts).
    pub cache_dir: Option<PathBuf>,
    /// Its size, at most (0: no disk tier).
    #[serde(default)]
    pub cache_dir_mib: u64,
    /// With a disk tier: a listing kept there younger than this many
    /// seconds is used instead of listing the store again at a start
    /// (0: always list).
    #[serde(default = "default_listing_max_age_s")]
    pub listing_max_age_s: f64,
    /// The store's address where it is not the default: an S3-compatible
    /// endpoint (MinIO, R2, Ceph; else `AWS_ENDPOINT_URL`), GCS's XML API
    /// elsewhere, or an Azure account's blob endpoint (azurite:
    /// `http://127.0.0.1:10000/devstoreaccount1`).
    pub endpoint: Option<String>,
    /// Unsigned requests (public buckets).
    #[serde(default)]
    pub anonymous: bool,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        toml::from_str("").expect("every key of [stream.remote] has a default")
    }
}

fn default_read_ahead() -> u32 {
    256
}
fn default_read_ahead_mib() -> u64 {
    256
}
fn default_requests() -> u32 {
    // At 50 ms a request, 64 in flight bound an image folder at 1,280
    // objects/s (bench/remote.py: 0.58x of local disk behind an S3
    // server, 0.86x with 128).
    128
}
fn default_part_mib() -> u64 {
    8
}
fn default_timeout_s() -> f64 {
    10.0
}
fn default_retries() -> u32 {
    4
}
fn default_stall_s() -> f64 {
    30.0
}
fn default_listing_max_age_s() -> f64 {
    3600.0
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebDatasetConfig {
    /// `/data/shard-{000000..000099}.tar`, or one file.
    pub shards: String,
    /// Samples held by the shuffle buffer.
    #[serde(default = "default_shuffle_buffer")]
    pub(crate) shuffle_buffer: usize,
}

fn one64() -> u64 {
    1
}
fn default_max_pixels() -> u64 {
    89_478_485
}
fn default_max_file_bytes() -> u64 {
    256 << 20
}
fn default_shuffle_buffer() -> usize {
    1000
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
        let err = |e: toml::de::Error| ConfigError::Parse {
            path: path.into(),
            message: e.to_string(),
        };
        let mut cfg: Config = toml::from_str(text).map_err(err)?;
        // Which source keys each stream wrote itself (defaults hide that).
        let table: toml::Table = toml::from_str(text).map_err(err)?;
        if let Some(toml::Value::Array(streams)) = table.get("stream") {
            for (s, raw) in cfg.streams.iter_mut().zip(streams) {
                if let toml::Value::Table(t) = raw {
                    s.own_source_keys = SOURCE_KEYS
                        .iter()
                        .copied()
                        .filter(|k| t.contains_key(*k))
                        .collect();
                    s.transform_table = t.get("transform").cloned();
                }
            }
        }
        Ok(cfg)
    }
}
