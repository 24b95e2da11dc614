//! The native pipeline: read → decode → transform → write into the slot
//! ([`collate`]), once per host, for every consumer.
//!
//! Bad input never tears a batch: with `on_error = "skip"` a sample that
//! cannot be read or decoded is replaced, deterministically, by the next
//! good sample of the dataset (index + 1, + 2, ...), counted, and its path
//! logged once with the reason; with `"fail"` the stream stops and every
//! consumer is told which file and why.

pub mod cache;
pub mod collate;
pub mod dataset;
pub mod decode;
pub mod sampler;
pub mod transform;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Deserialize;

use cache::{CacheCounts, MinIoCache};
use dataset::Dataset;
use decode::{DecodeError, Decoder, Rgb};
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

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PipelineCounts {
    pub decoded: u64,
    pub skipped: u64,
    pub reduced: u64,
    pub cache: Option<CacheCounts>,
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
    /// Budget of the cache of encoded bytes (0: none).
    pub cache_bytes: u64,
}

#[derive(Debug)]
pub struct ImagePipeline {
    pub dataset: Arc<Dataset>,
    pub transform: Transform,
    pub rules: SampleRules,
    lut: Lut,
    cache: Option<MinIoCache>,
    bad: Mutex<HashSet<u64>>,
    decoded: AtomicU64,
    skipped: AtomicU64,
    reduced: AtomicU64,
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

/// What ended up in a sample's place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Filled {
    pub index: u64,
    pub label: i64,
}

impl ImagePipeline {
    pub fn new(dataset: Arc<Dataset>, transform: Transform, rules: SampleRules) -> ImagePipeline {
        ImagePipeline {
            lut: Lut::new(&transform),
            dataset,
            transform,
            rules,
            cache: (rules.cache_bytes > 0).then(|| MinIoCache::new(rules.cache_bytes)),
            bad: Mutex::new(HashSet::new()),
            decoded: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            reduced: AtomicU64::new(0),
        }
    }

    pub fn counts(&self) -> PipelineCounts {
        PipelineCounts {
            decoded: self.decoded.load(Ordering::Relaxed),
            skipped: self.skipped.load(Ordering::Relaxed),
            reduced: self.reduced.load(Ordering::Relaxed),
            cache: self.cache.as_ref().map(|c| c.counts()),
        }
    }

    /// Fills one sample's image tensor (`out`) for position `index` of
    /// `epoch`, replacing a bad sample per the policy.
    pub fn fill(
        &self,
        w: &mut Worker,
        epoch: u64,
        index: u64,
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
            match self.try_fill(w, epoch, index, candidate, out) {
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
                    if self
                        .bad
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(candidate)
                    {
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
        self.bad
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&index)
    }

    fn try_fill(
        &self,
        w: &mut Worker,
        epoch: u64,
        position: u64,
        index: u64,
        out: &mut [u8],
    ) -> Result<(), SampleError> {
        let path = || self.dataset.describe(index);
        let cached = self.cache.as_ref().and_then(|c| c.get(index));
        let bytes: &[u8] = match &cached {
            Some(b) => b,
            None => {
                self.dataset
                    .read(index, &mut w.bytes, self.rules.max_file_bytes)
                    .map_err(|source| SampleError::Read {
                        path: path(),
                        source,
                    })?;
                &w.bytes
            }
        };
        let decode_err = |source| SampleError::Decode {
            path: path(),
            source,
        };
        let header = w
            .decoder
            .header(bytes, self.rules.max_pixels)
            .map_err(decode_err)?;
        let mut rng = self.transform.rng(epoch, position);
        let plan = self.transform.plan(header.width, header.height, &mut rng);
        let denom = if self.rules.reduced_decode && header.format == decode::Format::Jpeg {
            self.transform.reduction(&plan, header.width, header.height)
        } else {
            1
        };
        w.decoder
            .decode(bytes, &header, denom, &mut w.rgb)
            .map_err(decode_err)?;
        if denom > 1 {
            self.reduced.fetch_add(1, Ordering::Relaxed);
        }
        self.transform
            .apply(&w.rgb, &plan, denom, &self.lut, &mut w.scratch, out)
            .map_err(|e| SampleError::Transform {
                path: path(),
                message: e.to_string(),
            })?;
        // Only what decoded is worth keeping.
        if cached.is_none()
            && let Some(c) = &self.cache
        {
            c.offer(index, bytes);
        }
        Ok(())
    }
}
