//! Decoded images kept for the next epoch (`decoded_cache_mib`, or sized
//! by the broker: [`super::autosize`]), as FFCV keeps decoded pixels.
//!
//! Each image is kept as decoded whole at the scale a crop of it decodes
//! at, the key being the image and the scale: a later crop that decodes at
//! the same scale takes it, one at another scale decodes (and is kept
//! too, where there is room). A JPEG's scale is the DCT reduction its crop
//! allows (`reduced_decode`, `Transform::reduction`; the finest of its
//! source's streams under `decode = "once"`), every other image's full
//! size: so the bytes are those of a stream without the cache, whatever it
//! holds (a whole decode at a scale has the pixels a crop's part of it
//! has, `pixels/tests/crop_decode.rs`). That is why the broker may keep
//! images without being asked.
//!
//! With `decoded_side` a JPEG is instead kept at one scale per image, the
//! largest DCT reduction (1/2, 1/4, 1/8) that leaves its longer side at
//! least that (so below twice that, or its own size when smaller), and
//! every crop of it decodes at that scale: less memory and one decode per
//! image, but other bytes than without the cache (fixed per image here,
//! chosen per crop there). No resampling either way: each epoch's
//! transform is applied to the kept image exactly as to a decode at that
//! scale, its plan drawn for the original size. An image the cache has no
//! room for is decoded again on each use, only the part its crop reads.
//!
//! The cache is a [`MinIoCache`] (admitted until its budget is spent,
//! never evicted), one per source, its budget taken from the broker's
//! memory budget when the stream starts.

use std::sync::{Arc, Mutex};

use super::cache::MinIoCache;
use super::decode::{Format, Rgb};
use super::stages::Stage;
use super::transform::Plan;
use super::{Dims, ImagePipeline, Place, SampleError, Worker};
use crate::budget::{Budget, Grant, OverBudget, Use};

/// A decoded image as kept: decoded at `1/denom`, and the size and format
/// of the image it stands for.
#[derive(Debug)]
pub struct Kept {
    pub rgb: Rgb,
    pub denom: u32,
    pub dims: Dims,
}

/// The cache's key of image `index` kept at `1/denom` (1, 2, 4 or 8).
fn key(index: u64, denom: u32) -> u64 {
    index.saturating_mul(4) + u64::from(denom.trailing_zeros().min(3))
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

    /// A cache of the bytes `grant` took from the broker's budget.
    pub fn granted(grant: Grant) -> KeptImages {
        KeptImages {
            cache: MinIoCache::new(grant.bytes()),
            grant: Mutex::new(Some(grant)),
        }
    }

    /// The size and format of image `index`, from any scale of it kept.
    fn dims(&self, index: u64) -> Option<Dims> {
        [1, 2, 4, 8]
            .into_iter()
            .find_map(|d| self.cache.peek(key(index, d)))
            .map(|k| k.dims)
    }

    /// Takes the cache's budget from the broker's, once per source.
    pub fn reserve(&self, budget: &Arc<Budget>, uid: u32, whom: &str) -> Result<(), OverBudget> {
        let mut g = self.grant.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(budget.take(
                uid,
                Use::KeptImages,
                self.cache.budget(),
                &format!("{whom} (decoded_cache_mib)"),
            )?);
        }
        Ok(())
    }
}

impl ImagePipeline {
    /// Writes sample `index`'s tensor (drawn for `(epoch, position)`, at
    /// `place` on a shared source) from its kept image at the scale it
    /// decodes at; where that was not kept, decodes it there: whole, and
    /// kept, if the cache has room, else only where the crop reads.
    pub(super) fn fill_kept(
        &self,
        w: &mut Worker,
        kept: &KeptImages,
        (epoch, position, index, place): (u64, u64, u64, Option<Place>),
        out: &mut [u8],
    ) -> Result<(), SampleError> {
        // Its size, to draw its plan and scale, from another scale kept.
        let mut looked = false;
        if let Some(dims) = kept.dims(index) {
            let plan = self.plan_for(epoch, position, dims);
            let denom = self.kept_scale(&plan, (epoch, position, index, place), dims);
            if let Some(k) = kept.cache.get(key(index, denom)) {
                return self.transform_into(w, &k.rgb, (&plan, k.denom), index, out);
            }
            looked = true;
        }
        let (cached, header) = self.read_header(w, index)?;
        let dims = Dims {
            width: header.width,
            height: header.height,
            format: header.format,
        };
        let plan = self.plan_for(epoch, position, dims);
        let denom = self.kept_scale(&plan, (epoch, position, index, place), dims);
        if !looked {
            kept.cache.count_miss();
        }
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
            self.offer_encoded(index, cached.is_none(), &w.bytes);
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
            dims,
        });
        kept.cache.offer_with(key(index, denom), len, || k.clone());
        self.transform_into(w, &k.rgb, (&plan, denom), index, out)
    }

    /// The plan of the sample at `(epoch, position)` for an image of
    /// `size`.
    fn plan_for(&self, epoch: u64, position: u64, dims: Dims) -> Plan {
        let mut rng = self.transform.rng(epoch, position);
        self.transform.plan(dims.width, dims.height, &mut rng)
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

    /// The DCT reduction sample `index` is kept at: with `decoded_side`,
    /// the largest that leaves its longer side at least that (JPEG, with
    /// `reduced_decode`), the same for every crop; else the one its crop
    /// decodes at without the cache ([`ImagePipeline::scale_of`]).
    fn kept_scale(
        &self,
        plan: &Plan,
        (epoch, position, index, place): (u64, u64, u64, Option<Place>),
        dims: Dims,
    ) -> u32 {
        if self.rules.decoded_side.is_some() {
            return self.side_scale(dims);
        }
        let shared = match (&self.share, place) {
            (Some((s, _)), Some(_)) if index == position => Some(&**s),
            _ => None,
        };
        self.scale_of(shared, (epoch, position), dims, plan)
    }

    /// With `decoded_side`, the scale a JPEG is kept at (with
    /// `reduced_decode`): the largest DCT reduction that leaves its longer
    /// side at least that; 1 for other images.
    pub(super) fn side_scale(&self, dims: Dims) -> u32 {
        let (Some(side), Format::Jpeg, true) = (
            self.rules.decoded_side,
            dims.format,
            self.rules.reduced_decode,
        ) else {
            return 1;
        };
        let long = dims.width.max(dims.height);
        [8u32, 4, 2]
            .into_iter()
            .find(|&d| long.div_ceil(d) >= side)
            .unwrap_or(1)
    }
}
