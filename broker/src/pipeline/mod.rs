//! The native pipeline: read → decode → transform → write into the slot
//! (`collate`), once per host, for every consumer.
//!
//! Bad input never tears a batch: with `on_error = "skip"` a sample that
//! cannot be read or decoded is replaced, deterministically, by the next
//! good sample of the dataset (index + 1, + 2, ...), counted, and its path
//! logged once with the reason; with `"fail"` the stream stops and every
//! consumer is told which file and why.

pub mod autosize;
pub mod cache;
pub(crate) mod collate;
pub mod dataset;
pub mod kept;
pub(crate) mod sampler;
pub mod shared;
pub mod stages;

// The per-image work lives in its own crate (optimised in debug builds,
// docs/development.md); its modules keep their paths here.
pub use batchcast_pixels::{augment, decode, erase, layout, random, transform};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Deserialize;

pub use autosize::CacheSize;
use cache::CacheCounts;
use dataset::Dataset;
use decode::{DecodeError, Decoder, Format, Header, Region, Rgb};
use shared::{Claim, DecodeShare, ShareCounts, SourceFiles, SourceShare};
use stages::Stage;
use transform::{Lut, Scratch, Transform};

/// What to do with a sample that cannot be read or decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// Replace it with the next good sample, count it, log it once.
    #[default]
    Skip,
    /// Stop the stream with an error naming the file.
    Fail,
}

/// How many consecutive bad samples a replacement may step over before the
/// stream gives up (the dataset is then mostly unreadable).
const MAX_REPLACEMENT_STEPS: u64 = 64;

#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Decode {
        path: String,
        #[source]
        source: DecodeError,
    },
    #[error("{path}: {message}")]
    Transform { path: String, message: String },
}

/// A failure that ends the stream.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("bad sample with on_error = \"fail\": {0}")]
    Failed(SampleError),
    #[error(
        "{0} consecutive samples starting at index {1} are unreadable (the last: {2}); the dataset looks broken"
    )]
    TooManyBad(u64, u64, SampleError),
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct PipelineCounts {
    pub decoded: u64,
    pub skipped: u64,
    pub reduced: u64,
    /// JPEGs decoded in part (only what a crop reads), and of those, cut
    /// out of their file at restart markers.
    pub in_part: u64,
    pub cut: u64,
    pub cache: Option<CacheCounts>,
    /// The cache of decoded images, if on.
    pub kept: Option<CacheCounts>,
    /// A stream on a shared source: the source's name and counts.
    pub shared: Option<(String, ShareCounts)>,
    /// A remote dataset's requests, read-ahead and disk tier.
    pub remote: Option<batchcast::proto::RemoteSourceStats>,
    /// Seconds the threads spent reading, decoding and transforming
    /// ([`stages`]).
    pub stages: [f64; 3],
    /// CPU seconds of the read stage.
    pub read_cpu_s: f64,
    /// What the broker chose for the caches the config left out, and why.
    pub caches_chosen: Option<String>,
}

/// How samples are read and decoded, and what a bad one does: the plan
/// carries them, the pipeline follows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleRules {
    pub on_error: OnError,
    /// Largest image (width × height) decoded.
    pub max_pixels: u64,
    /// Largest encoded sample read (a bigger one is a bad file).
    pub max_file_bytes: u64,
    /// Decode JPEGs at reduced size when the transform shrinks them anyway.
    pub reduced_decode: bool,
    /// Decode only the region of a JPEG the transform reads (the same
    /// bytes as a whole decode: `Transform::decode_region`).
    pub crop_decode: bool,
    /// Budget of the cache of encoded bytes.
    pub cache: CacheSize,
    /// Budget of the cache of decoded images: with one, samples are
    /// transformed from kept images ([`kept`]).
    pub decoded_cache: CacheSize,
    /// The least longer side JPEGs are kept at (`None`: full size).
    pub decoded_side: Option<u32>,
}

#[derive(Debug)]
pub struct ImagePipeline {
    pub dataset: Arc<Dataset>,
    pub transform: Transform,
    pub rules: SampleRules,
    lut: Lut,
    /// The cache of encoded bytes and the known bad files (the source's,
    /// for a stream on a shared source).
    files: Arc<SourceFiles>,
    /// A stream on a shared source: the source, and which stream of it
    /// this is.
    share: Option<(Arc<SourceShare>, usize)>,
    decoded: AtomicU64,
    skipped: AtomicU64,
    reduced: AtomicU64,
    in_part: AtomicU64,
    cut: AtomicU64,
    /// Where the threads' time goes, stage by stage.
    stages: stages::StageClock,
}

/// Per-thread state: decoder, buffers.
#[derive(Debug)]
pub struct Worker {
    decoder: Decoder,
    bytes: Vec<u8>,
    rgb: Rgb,
    scratch: Scratch,
}

impl Worker {
    pub fn new() -> Result<Worker, DecodeError> {
        Ok(Worker {
            decoder: Decoder::new()?,
            bytes: Vec::new(),
            rgb: Rgb::default(),
            scratch: Scratch::default(),
        })
    }
}

/// A decoded image's size and format, known without decoding it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub width: u32,
    pub height: u32,
    pub format: Format,
}

/// Where a sample lies in its source's sequence (`epoch × samples per
/// epoch + position`), for a stream on a shared source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub at: u64,
    /// A replayed batch: it takes what another stream left, but neither
    /// waits for the others nor leaves anything for them.
    pub replay: bool,
}

/// A sample read: its bytes when they came from the cache (else they are
/// in the worker's buffer), and its header.
type Read = (Option<Arc<[u8]>>, Header);

/// What ended up in a sample's place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Filled {
    pub index: u64,
    pub label: i64,
}

impl ImagePipeline {
    /// `share`: the shared source this stream is on, and its member number.
    pub fn new(
        dataset: Arc<Dataset>,
        transform: Transform,
        rules: SampleRules,
        share: Option<(Arc<SourceShare>, usize)>,
    ) -> ImagePipeline {
        let files = match &share {
            Some((s, _)) => s.files.clone(),
            None => Arc::new(SourceFiles::new(rules.cache, rules.decoded_cache)),
        };
        ImagePipeline {
            lut: Lut::new(&transform),
            dataset,
            transform,
            rules,
            files,
            share,
            decoded: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            reduced: AtomicU64::new(0),
            in_part: AtomicU64::new(0),
            cut: AtomicU64::new(0),
            stages: stages::StageClock::default(),
        }
    }

    pub fn counts(&self) -> PipelineCounts {
        PipelineCounts {
            decoded: self.decoded.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
            reduced: self.reduced.load(Ordering::Relaxed),
            in_part: self.in_part.load(Ordering::Relaxed),
            cut: self.cut.load(Ordering::Relaxed),
            cache: self.files.cache.get().map(|c| c.counts()),
            kept: self.files.kept.get().map(|k| k.cache.counts()),
            shared: self
                .share
                .as_ref()
                .map(|(s, m)| (s.plan.name.clone(), s.counts(*m))),
            remote: self.dataset.remote.as_ref().map(|r| r.counts()),
            stages: self.stages.seconds(),
            read_cpu_s: self.stages.read_cpu_seconds(),
            caches_chosen: self.caches_chosen(),
        }
    }

    /// Tells a shared source whether this stream takes batches.
    pub(crate) fn set_live(&self, live: bool) {
        if let Some((s, m)) = &self.share {
            s.set_live(*m, live);
        }
    }

    /// A batch of this stream's own (not a replay) starts at `at` in its
    /// source's sequence; [`ImagePipeline::batch_done`] when it is filled.
    pub(crate) fn batch_started(&self, at: u64) {
        if let Some((s, m)) = &self.share {
            s.begin(*m, at);
        }
    }

    pub(crate) fn batch_done(&self, at: u64, end: u64) {
        if let Some((s, m)) = &self.share {
            s.end(*m, at, end);
        }
    }

    /// Fills one sample's image tensor (`out`) for dataset index `index`
    /// of `epoch` (at `place` in a shared source's sequence), replacing a
    /// bad sample per the policy.
    pub fn fill(
        &self,
        w: &mut Worker,
        epoch: u64,
        index: u64,
        place: Option<Place>,
        out: &mut [u8],
    ) -> Result<Filled, PipelineError> {
        let len = self.dataset.len();
        let mut last_err = None;
        for step in 0..MAX_REPLACEMENT_STEPS.min(len) {
            let candidate = (index + step) % len;
            if step > 0 && self.is_known_bad(candidate) {
                continue;
            }
            // Randomness follows the position, not the replacement, so a
            // skipped sample does not shift anyone else's augmentation.
            match self.try_fill(w, epoch, index, candidate, place, out) {
                Ok(()) => {
                    self.decoded.fetch_add(1, Ordering::Relaxed);
                    if step > 0 {
                        // Counted once per replaced position, however many
                        // bad neighbours the replacement stepped over.
                        self.skipped.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(Filled {
                        index: candidate,
                        label: self.dataset.items[candidate as usize].label,
                    });
                }
                Err(e) => {
                    if self.rules.on_error == OnError::Fail {
                        return Err(PipelineError::Failed(e));
                    }
                    if self.files.mark_bad(candidate) {
                        tracing::warn!("skipping a bad sample (index {candidate}): {e}");
                    }
                    last_err = Some(e);
                }
            }
        }
        Err(PipelineError::TooManyBad(
            MAX_REPLACEMENT_STEPS.min(len),
            index,
            last_err.expect("at least one attempt"),
        ))
    }

    fn is_known_bad(&self, index: u64) -> bool {
        self.files.is_bad(index)
    }

    /// Decodes sample `index` at `denom` (reading it unless `read` holds
    /// its bytes and header): into `w.rgb` (`None` returned) for this
    /// stream alone, or into a new image left for the source's other
    /// streams when the claim says so.
    fn decode(
        &self,
        w: &mut Worker,
        index: u64,
        read: Option<Read>,
        dims: Dims,
        scale: (u32, Option<Region>),
        claim: Claim,
    ) -> Result<Option<Arc<Rgb>>, SampleError> {
        let path = || self.dataset.describe(index);
        let decode_err = |source| SampleError::Decode {
            path: path(),
            source,
        };
        let (cached, header) = match read {
            Some(r) => r,
            None => self.read_header(w, index)?,
        };
        if (header.width, header.height) != (dims.width, dims.height) {
            return Err(SampleError::Transform {
                path: path(),
                message: "the file changed while the streams of its source read it".into(),
            });
        }
        let bytes = cached.as_deref().unwrap_or(&w.bytes);
        let mut fresh = Rgb::default();
        let rgb = match claim {
            Claim::Mine(_) => &mut fresh,
            _ => &mut w.rgb,
        };
        self.stages
            .time(Stage::Decode, || {
                w.decoder.decode(bytes, &header, scale, rgb)
            })
            .map_err(decode_err)?;
        self.count_decode(scale.0, rgb);
        self.offer_encoded(index, cached.is_none(), bytes);
        Ok(match claim {
            Claim::Mine(ticket) => {
                let img = Arc::new(fresh);
                ticket.publish(img.clone());
                Some(img)
            }
            _ => None,
        })
    }

    /// The scale sample `position` (image `dims`, its transform `plan`)
    /// is decoded at: a JPEG's the DCT reduction its crop allows (with
    /// `reduced_decode`), on a `shared` source deciding once the finest
    /// of its streams'; every other image at full size.
    fn scale_of(
        &self,
        shared: Option<&SourceShare>,
        (epoch, position): (u64, u64),
        dims: Dims,
        plan: &transform::Plan,
    ) -> u32 {
        match shared {
            _ if !self.rules.reduced_decode || dims.format != Format::Jpeg => 1,
            Some(s) if s.plan.policy == DecodeShare::Once => s.finest(epoch, position, dims),
            _ => self.transform.reduction(plan, dims.width, dims.height),
        }
    }

    /// Offers `bytes`, sample `index`'s file just read (`fresh`: not from
    /// the cache) and decoded, to the cache of encoded bytes, if on.
    fn offer_encoded(&self, index: u64, fresh: bool, bytes: &[u8]) {
        // Only what decoded is worth keeping.
        if fresh && let Some(c) = self.files.cache.get() {
            c.offer(index, bytes);
        }
    }

    /// Counts a decode run, at `1/denom`, into `img`.
    fn count_decode(&self, denom: u32, img: &Rgb) {
        if denom > 1 {
            self.reduced.fetch_add(1, Ordering::Relaxed);
        }
        if img.decoded.is_some() {
            self.in_part.fetch_add(1, Ordering::Relaxed);
        }
        if img.cut {
            self.cut.fetch_add(1, Ordering::Relaxed);
        }
        if let Some((s, _)) = &self.share {
            s.count_decode();
        }
    }

    /// Takes what this stream's source keeps from the broker's memory
    /// budget (its cache of decoded images), once per source, and readies
    /// the sizing of the caches its config left out for a stream of
    /// `epochs` (`None`: endless).
    pub fn reserve(
        &self,
        budget: &Arc<crate::budget::Budget>,
        uid: u32,
        whom: &str,
        epochs: Option<u64>,
    ) -> Result<(), crate::budget::OverBudget> {
        self.size_caches_later(budget, (uid, whom), epochs);
        match self.files.kept.get() {
            Some(k) => k.reserve(budget, uid, whom),
            None => Ok(()),
        }
    }

    /// Reads sample `index` ([`ImagePipeline::read`]) and its header.
    fn read_header(&self, w: &mut Worker, index: u64) -> Result<Read, SampleError> {
        let cached = self.stages.time(Stage::Read, || self.read(w, index))?;
        let bytes = cached.as_deref().unwrap_or(&w.bytes);
        let h = w
            .decoder
            .header(bytes, self.rules.max_pixels)
            .map_err(|source| SampleError::Decode {
                path: self.dataset.describe(index),
                source,
            })?;
        let dims = Dims {
            width: h.width,
            height: h.height,
            format: h.format,
        };
        self.saw(index, dims, bytes.len() as u64);
        Ok((cached, h))
    }

    /// Reads sample `index`'s bytes: from the cache (returned), or into
    /// `w.bytes`.
    fn read(&self, w: &mut Worker, index: u64) -> Result<Option<Arc<[u8]>>, SampleError> {
        if let Some(b) = self.files.cache.get().and_then(|c| c.get(index)) {
            return Ok(Some(b));
        }
        self.dataset
            .read(index, &mut w.bytes, self.rules.max_file_bytes)
            .map_err(|source| SampleError::Read {
                path: self.dataset.describe(index),
                source,
            })?;
        Ok(None)
    }

    /// Reads and decodes sample `index` (the replacement of `position`
    /// when they differ) and writes its transformed tensor. On a shared
    /// source its size and decode may come from another stream.
    fn try_fill(
        &self,
        w: &mut Worker,
        epoch: u64,
        position: u64,
        index: u64,
        place: Option<Place>,
        out: &mut [u8],
    ) -> Result<(), SampleError> {
        if let Some(kept) = self.files.kept.get() {
            // Kept images stand in for decodes (a source's streams share
            // them through the cache, not by place).
            return self.fill_kept(w, kept, (epoch, position, index, place), out);
        }
        let path = || self.dataset.describe(index);
        // Only a sample in its own place is shared (a replacement is not
        // where the other streams look for it).
        let shared = match (&self.share, place) {
            (Some((s, m)), Some(p)) if index == position => Some((s, *m, p)),
            _ => None,
        };
        let known = shared.and_then(|(s, m, p)| s.dims(m, p.at, index, !p.replay));
        let mut read: Option<Read> = None;
        let dims = match known {
            Some(d) => d,
            None => {
                let (cached, h) = self.read_header(w, index)?;
                read = Some((cached, h));
                Dims {
                    width: h.width,
                    height: h.height,
                    format: h.format,
                }
            }
        };
        let mut rng = self.transform.rng(epoch, position);
        let plan = self.transform.plan(dims.width, dims.height, &mut rng);
        let denom = self.scale_of(shared.map(|(s, _, _)| &**s), (epoch, position), dims, &plan);
        let claim = match shared {
            Some((s, m, p)) => s.claim(m, p.at, index, dims, denom, !p.replay),
            None => Claim::Alone,
        };
        let img = match claim {
            Claim::Ready(img) => Some(img),
            claim => {
                // Only a decode that happens needs its region.
                let region = match shared {
                    _ if !self.rules.crop_decode || dims.format != Format::Jpeg => None,
                    Some((s, _, _)) => {
                        s.region((epoch, position), dims, denom, self.rules.reduced_decode)
                    }
                    None => self
                        .transform
                        .decode_region(&plan, dims.width, dims.height, denom),
                };
                self.decode(w, index, read, dims, (denom, region), claim)?
            }
        };
        let src: &Rgb = img.as_deref().unwrap_or(&w.rgb);
        self.stages
            .time(Stage::Transform, || {
                self.transform
                    .apply(src, &plan, denom, &self.lut, &mut w.scratch, out)
            })
            .map_err(|e| SampleError::Transform {
                path: path(),
                message: e.to_string(),
            })
    }
}
