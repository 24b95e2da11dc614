//! Decoded images kept for the next epoch (`decoded_cache_mib`), as FFCV
//! keeps decoded pixels at a bounded resolution: each sample is decoded
//! whole once, kept with its longer side at most `decoded_side`
//! (`transform::kept_size`: the largest DCT reduction that leaves at least
//! that, then Pillow's bilinear filter), and every epoch's transform is
//! applied to the kept image, its plan drawn for the original size and its
//! crop box mapped by the kept size over the original
//! (`transform::Scale::kept`).
//!
//! The bytes depend only on the configuration, never on what the cache
//! holds: an image that did not fit is made the same way again on each
//! use. They differ from a stream without the cache where the kept image
//! is smaller than the decode the transform alone would choose (a crop of
//! a 256-px image resized to 224 instead of a crop of the photo), and,
//! without `decoded_side`, equal those of `reduced_decode = false` (the
//! whole image at full size, the crop box unscaled).
//!
//! The cache is a [`MinIoCache`] (admitted until its budget is spent,
//! never evicted), one per source, its budget taken from the broker's
//! memory budget when the stream starts.

use std::sync::{Arc, Mutex};

use super::cache::MinIoCache;
use super::decode::{Format, Rgb};
use super::transform::{Scale, kept_size, shrink};
use super::{ImagePipeline, SampleError, Worker};
use crate::budget::{Budget, Grant, OverBudget, Use};

/// A decoded image as kept, and the size of the image it stands for.
#[derive(Debug, Default)]
pub struct Kept {
    pub rgb: Rgb,
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
    /// its kept image, made now if it was not kept (and kept if it fits;
    /// made in the worker's buffer if it does not).
    pub(super) fn fill_kept(
        &self,
        w: &mut Worker,
        kept: &KeptImages,
        (epoch, position, index): (u64, u64, u64),
        out: &mut [u8],
    ) -> Result<(), SampleError> {
        let found = kept.cache.get(index);
        let mut made = std::mem::take(&mut w.kept);
        let result = match &found {
            Some(k) => self.apply_kept(w, k, (epoch, position, index), out),
            None => self.keep(w, index, &mut made).and_then(|()| {
                let len = made.rgb.data.len() as u64;
                if !kept.cache.has_room(len) {
                    return self.apply_kept(w, &made, (epoch, position, index), out);
                }
                // Admitted: an exact copy (the worker's buffer stays).
                let k = Arc::new(Kept {
                    rgb: Rgb {
                        data: made.rgb.data.clone(),
                        ..made.rgb
                    },
                    ..made
                });
                kept.cache.offer_with(index, len, || k.clone());
                self.apply_kept(w, &k, (epoch, position, index), out)
            }),
        };
        w.kept = made;
        result
    }

    fn apply_kept(
        &self,
        w: &mut Worker,
        img: &Kept,
        (epoch, position, index): (u64, u64, u64),
        out: &mut [u8],
    ) -> Result<(), SampleError> {
        let mut rng = self.transform.rng(epoch, position);
        let plan = self.transform.plan(img.width, img.height, &mut rng);
        let scale = Scale::kept((img.rgb.width, img.rgb.height), (img.width, img.height));
        self.transform
            .apply(&img.rgb, &plan, scale, &self.lut, &mut w.scratch, out)
            .map_err(|e| SampleError::Transform {
                path: self.dataset.describe(index),
                message: e.to_string(),
            })
    }

    /// Reads and decodes sample `index` whole, at the size it is kept at,
    /// into `into` (its buffer reused).
    fn keep(&self, w: &mut Worker, index: u64, into: &mut Kept) -> Result<(), SampleError> {
        let (cached, header) = self.read_header(w, index)?;
        let (width, height) = (header.width, header.height);
        let size = self
            .rules
            .decoded_side
            .map_or((width, height), |s| kept_size(width, height, s));
        // The largest DCT reduction that still leaves the kept size.
        let denom = [8u32, 4, 2]
            .into_iter()
            .find(|&d| width.div_ceil(d) >= size.0 && height.div_ceil(d) >= size.1)
            .filter(|_| header.format == Format::Jpeg && self.rules.reduced_decode)
            .unwrap_or(1);
        let bytes = cached.as_deref().unwrap_or(&w.bytes);
        w.decoder
            .decode(bytes, &header, (denom, None), &mut w.rgb)
            .map_err(|source| SampleError::Decode {
                path: self.dataset.describe(index),
                source,
            })?;
        self.count_decode(denom);
        (into.width, into.height) = (width, height);
        let rgb = &mut into.rgb;
        if (w.rgb.width, w.rgb.height) == size {
            let n = size.0 as usize * size.1 as usize * 3;
            rgb.data.clear();
            rgb.data.extend_from_slice(&w.rgb.data[..n]);
            (rgb.width, rgb.height, rgb.decoded) = (size.0, size.1, None);
            return Ok(());
        }
        shrink(&w.rgb, size, &mut w.scratch, rgb).map_err(|e| SampleError::Transform {
            path: self.dataset.describe(index),
            message: e.to_string(),
        })
    }
}
