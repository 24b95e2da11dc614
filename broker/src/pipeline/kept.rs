//! Decoded images kept for the next epoch (`decoded_cache_mib`), as FFCV
//! keeps decoded pixels at a bounded resolution. A JPEG is kept as decoded
//! at the largest DCT reduction (1/2, 1/4, 1/8) that leaves its longer side
//! at least `decoded_side` (so below twice that, or its own size when
//! smaller); other formats, and every image without `decoded_side`, at
//! full size. No resampling: each epoch's transform is applied to the kept
//! image exactly as to a decode at that scale, its plan
//! drawn for the original size.
//!
//! The bytes depend only on the configuration, never on what the cache
//! holds: an image the cache has no room for is decoded at the same scale
//! again on each use (only the part its crop reads: the same pixels,
//! `pixels/tests/crop_decode.rs`). They differ from a stream without the
//! cache only in the scale a JPEG is decoded at (fixed per image here,
//! chosen per crop there); without `decoded_side` they equal those of
//! `reduced_decode = false`.
//!
//! The cache is a [`MinIoCache`] (admitted until its budget is spent,
//! never evicted), one per source, its budget taken from the broker's
//! memory budget when the stream starts.

use std::sync::{Arc, Mutex};

use super::cache::MinIoCache;
use super::decode::{Format, Header, Rgb};
use super::stages::Stage;
use super::transform::Plan;
use super::{ImagePipeline, SampleError, Worker};
use crate::budget::{Budget, Grant, OverBudget, Use};

/// A decoded image as kept: decoded at `1/denom`, and the size of the
/// image it stands for.
#[derive(Debug)]
pub struct Kept {
    pub rgb: Rgb,
    pub denom: u32,
    pub width: u32,
    pub height: u32,
}

/// A source's cache of decoded images, with its share of the broker's
/// memory budget.
#[derive(Debug)]
pub struct KeptImages {
    pub cache: MinIoCache<Kept>,
    grant: Mutex<Option<Grant>>,
}

impl KeptImages {
    pub fn new(budget: u64) -> KeptImages {
        KeptImages {
            cache: MinIoCache::new(budget),
            grant: Mutex::new(None),
        }
    }

    /// Takes the cache's budget from the broker's, once per source.
    pub fn reserve(&self, budget: &Arc<Budget>, uid: u32, whom: &str) -> Result<(), OverBudget> {
        let mut g = self.grant.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(budget.take(
                uid,
                Use::Arena,
                self.cache.budget(),
                &format!("{whom} (decoded_cache_mib)"),
            )?);
        }
        Ok(())
    }
}

impl ImagePipeline {
    /// Writes sample `index`'s tensor (drawn for `(epoch, position)`) from
    /// its kept image; where it was not kept, decodes it at its kept
    /// scale: whole, and kept, if the cache has room, else only where the
    /// crop reads.
    pub(super) fn fill_kept(
        &self,
        w: &mut Worker,
        kept: &KeptImages,
        (epoch, position, index): (u64, u64, u64),
        out: &mut [u8],
    ) -> Result<(), SampleError> {
        if let Some(k) = kept.cache.get(index) {
            let plan = self.plan_for(epoch, position, (k.width, k.height));
            return self.transform_into(w, &k.rgb, (&plan, k.denom), index, out);
        }
        let (cached, header) = self.read_header(w, index)?;
        let denom = self.kept_scale(&header);
        let plan = self.plan_for(epoch, position, (header.width, header.height));
        let (sw, sh) = (header.width.div_ceil(denom), header.height.div_ceil(denom));
        let len = u64::from(sw) * u64::from(sh) * 3;
        let room = kept.cache.has_room(len);
        let region = match header.format {
            Format::Jpeg if !room && self.rules.crop_decode => {
                self.transform
                    .decode_region(&plan, header.width, header.height, denom)
            }
            _ => None,
        };
        // Kept: decoded straight into its own buffer (fresh, zeroed pages
        // the decode writes once); else into the worker's.
        let mut img = if room {
            Rgb::default()
        } else {
            std::mem::take(&mut w.rgb)
        };
        let bytes = cached.as_deref().unwrap_or(&w.bytes);
        let decoded = self
            .stages
            .time(Stage::Decode, || {
                w.decoder.decode(bytes, &header, (denom, region), &mut img)
            })
            .map_err(|source| SampleError::Decode {
                path: self.dataset.describe(index),
                source,
            });
        if decoded.is_ok() {
            self.count_decode(denom, &img);
        }
        if !room {
            let r = decoded.and_then(|()| self.transform_into(w, &img, (&plan, denom), index, out));
            w.rgb = img;
            return r;
        }
        decoded?;
        let k = Arc::new(Kept {
            rgb: img,
            denom,
            width: header.width,
            height: header.height,
        });
        kept.cache.offer_with(index, len, || k.clone());
        self.transform_into(w, &k.rgb, (&plan, denom), index, out)
    }

    /// The plan of the sample at `(epoch, position)` for an image of
    /// `size`.
    fn plan_for(&self, epoch: u64, position: u64, (width, height): (u32, u32)) -> Plan {
        let mut rng = self.transform.rng(epoch, position);
        self.transform.plan(width, height, &mut rng)
    }

    fn transform_into(
        &self,
        w: &mut Worker,
        img: &Rgb,
        (plan, denom): (&Plan, u32),
        index: u64,
        out: &mut [u8],
    ) -> Result<(), SampleError> {
        self.stages
            .time(Stage::Transform, || {
                self.transform
                    .apply(img, plan, denom, &self.lut, &mut w.scratch, out)
            })
            .map_err(|e| SampleError::Transform {
                path: self.dataset.describe(index),
                message: e.to_string(),
            })
    }

    /// The DCT reduction an image is kept at: the largest that leaves its
    /// longer side at least `decoded_side` (JPEG, with `reduced_decode`).
    fn kept_scale(&self, header: &Header) -> u32 {
        let (Some(side), Format::Jpeg, true) = (
            self.rules.decoded_side,
            header.format,
            self.rules.reduced_decode,
        ) else {
            return 1;
        };
        let long = header.width.max(header.height);
        [8u32, 4, 2]
            .into_iter()
            .find(|&d| long.div_ceil(d) >= side)
            .unwrap_or(1)
    }
}
