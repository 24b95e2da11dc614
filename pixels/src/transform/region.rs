//! What a transform reads of a JPEG decoded at a reduced scale: the region
//! its crop's resize reads, for a decode in part, and the check that a
//! decode in part holds it.

use super::{Plan, ResizeError, Transform};
use crate::decode::{Region, Rgb};

impl Transform {
    /// The part of the image decoded at `1/denom` that applying `plan`
    /// reads, or `None` where it reads all of it (a resize of the whole
    /// image). RandomResizedCrop resamples its box with Pillow's filters,
    /// whose taps reach `support × max(scale, 1)` source pixels past the
    /// box (support 3 at most: Lanczos), clamped to the image; one pixel
    /// more on each side covers the rounding of the box's edges.
    pub fn decode_region(
        &self,
        plan: &Plan,
        width: u32,
        height: u32,
        denom: u32,
    ) -> Option<Region> {
        if plan.resized.is_some() || plan.too_small {
            return None;
        }
        let (oh, ow) = self.crop_size();
        let f = 1.0 / f64::from(denom);
        let c = plan.crop;
        let span = |start: f64, len: f64, out: u32, size: u32| {
            let (start, len) = (start * f, len * f);
            let reach = 3.0 * (len / f64::from(out.max(1))).max(1.0) + 1.0;
            let lo = (start - reach).floor().max(0.0) as u32;
            let hi = ((start + len + reach).ceil() as u32).min(size);
            (lo, hi.max(lo))
        };
        let (x0, x1) = span(c.left, c.width, ow, width.div_ceil(denom));
        let (y0, y1) = span(c.top, c.height, oh, height.div_ceil(denom));
        Some(Region {
            x: x0,
            y: y0,
            width: x1 - x0,
            height: y1 - y0,
        })
    }

    /// A decode in part (at `1/denom`) must hold what the resize of
    /// `plan`'s crop reads.
    pub(super) fn check_decoded(
        &self,
        img: &Rgb,
        plan: &Plan,
        denom: u32,
    ) -> Result<(), ResizeError> {
        if img.decoded.is_some()
            && let Some(r) = self.decode_region(plan, img.width * denom, img.height * denom, denom)
            && !img.has(&r)
        {
            return Err(ResizeError(format!(
                "the image was decoded in {:?}, the crop reads {r:?}",
                img.decoded
            )));
        }
        Ok(())
    }
}
