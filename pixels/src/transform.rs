//! torchvision's image transforms, with its parameter names and sampling
//! procedures, writing the result straight into a slot.
//!
//! * `RandomResizedCrop(size, scale, ratio)`: ten tries of a random area and
//!   log-uniform aspect ratio, then the central fallback, exactly as
//!   `torchvision.transforms.RandomResizedCrop.get_params`.
//! * `Resize(shorter side | (h, w))`, `CenterCrop(size)`, `RandomCrop(size,
//!   padding, pad_if_needed, fill, padding_mode)`, `Pad(padding, fill,
//!   padding_mode)`, with `np.pad`'s modes as torchvision uses on PIL images.
//! * `RandomHorizontalFlip(p)`, `ToTensor` + `Normalize(mean, std)`.
//! * Pillow's resampling filters (`interpolation`; antialiased convolution
//!   via `fast_image_resize`).
//!
//! Randomness is drawn from a generator seeded by `(seed, epoch, index)`, so
//! results do not depend on which thread handles a sample.

use batchcast_core::DType;
use batchcast_core::synthetic::{SplitMix64, mix64};
use fast_image_resize::images::{TypedImage, TypedImageRef};
use fast_image_resize::pixels::U8x3;
use fast_image_resize::{FilterType, ResizeAlg, ResizeOptions, Resizer};
use serde::Deserialize;

use crate::augment::{Augment, Canvas, Op, Resample};
use crate::decode::Rgb;
use crate::erase::{Erasing, Rect};
pub use crate::layout::Layout;
pub use crate::random::round_half_even;
use crate::random::uniform;

mod pad;
mod region;
mod tensor;
pub use pad::Steps;
pub use pad::{Border, PaddingMode};
use pad::{Window, random_crop_steps};
pub use tensor::Lut;
use tensor::write_tensor;

/// torchvision's `interpolation` of a resize, on PIL images: Pillow's
/// filters (all but `nearest` antialiased, as Pillow always is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Interpolation {
    Nearest,
    #[default]
    Bilinear,
    /// Pillow's bicubic (a = -0.5, Catmull-Rom).
    Bicubic,
    Box,
    Hamming,
    /// Pillow's Lanczos (three lobes).
    Lanczos,
}

impl Interpolation {
    fn options(self) -> ResizeOptions {
        let conv = |f| ResizeAlg::Convolution(f);
        ResizeOptions::new().resize_alg(match self {
            Interpolation::Nearest => ResizeAlg::Nearest,
            Interpolation::Bilinear => conv(FilterType::Bilinear),
            Interpolation::Bicubic => conv(FilterType::CatmullRom),
            Interpolation::Box => conv(FilterType::Box),
            Interpolation::Hamming => conv(FilterType::Hamming),
            Interpolation::Lanczos => conv(FilterType::Lanczos3),
        })
    }
}

/// The geometric part of a transform.
#[derive(Debug, Clone, PartialEq)]
pub enum Geometry {
    RandomResizedCrop {
        /// Output height and width.
        size: (u32, u32),
        scale: (f64, f64),
        ratio: (f64, f64),
    },
    /// An optional `Resize`, then an optional crop (at least one; the plan
    /// checks the output has one size).
    ResizeCrop {
        resize: Option<Resize>,
        crop: Option<Crop>,
    },
}

/// torchvision's `Resize(size)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Resize {
    /// An int: the shorter side becomes it, the aspect stays.
    Shorter(u32),
    /// `(h, w)`: exactly.
    Exact((u32, u32)),
}

/// The crop after a resize.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Crop {
    /// `CenterCrop((h, w))` (zero-padded when the image is smaller).
    Center((u32, u32)),
    /// `RandomCrop((h, w), padding = [l, t, r, b], pad_if_needed, fill,
    /// padding_mode)`.
    Random {
        size: (u32, u32),
        padding: [u32; 4],
        pad_if_needed: bool,
        border: Border,
    },
}

/// A crop box in source pixels: top, left, height, width.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CropBox {
    pub top: f64,
    pub left: f64,
    pub height: f64,
    pub width: f64,
}

/// The per-sample decisions of a transform.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Region of the source image that becomes the output.
    pub crop: CropBox,
    /// For Resize + CenterCrop: the full image is first resized to this
    /// (width, height), and `crop` is then in *resized* pixels.
    pub resized: Option<(u32, u32)>,
    pub flip: bool,
    /// `RandomCrop` cannot fit even after its padding (torchvision raises
    /// an error for such an image): the sample fails as a bad one.
    pub too_small: bool,
    /// The augmentations' ops, in order (after the flip).
    pub ops: Vec<Op>,
    /// `RandomErasing`'s rectangle of the tensor.
    pub erase: Option<Rect>,
}

#[derive(Debug, Clone)]
pub struct Transform {
    pub geometry: Geometry,
    /// The resampling of the geometry's resize.
    pub interpolation: Interpolation,
    /// `Pad`: `[left, top, right, bottom]` around the crop.
    pub pad: [u32; 4],
    pub pad_border: Border,
    /// Augmentations after the crop and flip, in order.
    pub augment: Vec<Augment>,
    /// The geometric augmentation ops' interpolation and fill.
    pub resample: Resample,
    /// `RandomErasing` of the tensor, last.
    pub erasing: Option<Erasing>,
    pub flip_p: f64,
    pub dtype: DType,
    pub layout: Layout,
    /// `(mean, std)` per channel; `None` gives `ToTensor`'s `x / 255` for
    /// float outputs and raw values for `u8`.
    pub normalize: Option<([f64; 3], [f64; 3])>,
    pub seed: u64,
}

impl Transform {
    /// `geometry`, then `ToTensor` in `f32` NCHW: bilinear, no padding,
    /// flip, augmentation or normalisation, seed 0. The other fields are
    /// set with struct update syntax (`Transform { flip_p: 0.5,
    /// ..Transform::of(g) }`).
    pub fn of(geometry: Geometry) -> Transform {
        Transform {
            geometry,
            interpolation: Interpolation::Bilinear,
            pad: [0; 4],
            pad_border: Border::default(),
            augment: Vec::new(),
            resample: Resample::default(),
            erasing: None,
            flip_p: 0.0,
            dtype: DType::F32,
            layout: Layout::Nchw,
            normalize: None,
            seed: 0,
        }
    }

    /// Output (height, width): the crop's, with the padding.
    pub fn out_size(&self) -> (u32, u32) {
        let (h, w) = self.crop_size();
        let [l, t, r, b] = self.pad;
        (h + t + b, w + l + r)
    }

    /// The crop's (height, width), before `Pad`.
    pub fn crop_size(&self) -> (u32, u32) {
        match self.geometry {
            Geometry::RandomResizedCrop { size, .. } => size,
            Geometry::ResizeCrop {
                crop: Some(Crop::Center(size) | Crop::Random { size, .. }),
                ..
            }
            | Geometry::ResizeCrop {
                resize: Some(Resize::Exact(size)),
                crop: None,
            } => size,
            // The plan refuses a shorter-side resize with no crop.
            Geometry::ResizeCrop { .. } => (0, 0),
        }
    }

    /// The tensor shape of one sample.
    pub fn shape(&self) -> Vec<u64> {
        let (h, w) = self.out_size();
        match self.layout {
            Layout::Nchw => vec![3, h as u64, w as u64],
            Layout::Nhwc => vec![h as u64, w as u64, 3],
        }
    }

    pub fn rng(&self, epoch: u64, index: u64) -> SplitMix64 {
        SplitMix64::new(mix64(
            self.seed ^ mix64(epoch.wrapping_add(0x5EED)) ^ mix64(index.wrapping_mul(0x9E37_79B9)),
        ))
    }

    /// Decides the crop and flip for an image of `width × height`.
    pub fn plan(&self, width: u32, height: u32, rng: &mut SplitMix64) -> Plan {
        let mut too_small = false;
        let (crop, resized) = match self.geometry {
            Geometry::RandomResizedCrop { scale, ratio, .. } => {
                (rrc_params(width, height, scale, ratio, rng), None)
            }
            Geometry::ResizeCrop { resize, crop } => {
                let (rw, rh) = match resize {
                    Some(Resize::Shorter(n)) => resize_shorter(width, height, n),
                    Some(Resize::Exact((h, w))) => (w, h),
                    None => (width, height),
                };
                let (top, left, too) = match crop {
                    Some(Crop::Center(size)) => {
                        let (t, l) = center_offsets((rh, rw), size);
                        (t, l, false)
                    }
                    Some(Crop::Random {
                        size,
                        padding,
                        pad_if_needed,
                        ..
                    }) => random_crop_offsets((rh, rw), size, padding, pad_if_needed, rng),
                    None => (0, 0, false),
                };
                too_small = too;
                let (ch, cw) = self.crop_size();
                (
                    CropBox {
                        top: top as f64,
                        left: left as f64,
                        height: ch as f64,
                        width: cw as f64,
                    },
                    Some((rw, rh)),
                )
            }
        };
        // RandomHorizontalFlip draws after the crop in a Compose.
        let flip = self.flip_p > 0.0 && uniform(rng, 0.0, 1.0) < self.flip_p;
        // Then each augmentation, in Compose order, on the output's size.
        let (oh, ow) = self.out_size();
        let mut ops = Vec::new();
        for a in &self.augment {
            a.draw((ow, oh), rng, &mut ops);
        }
        let erase = self.erasing.as_ref().and_then(|e| e.draw((oh, ow), rng));
        Plan {
            crop,
            resized,
            flip,
            too_small,
            ops,
            erase,
        }
    }

    /// The largest DCT downscale (1, 2, 4 or 8) that still leaves at least
    /// the output's resolution in the region that becomes the output, so the
    /// final resize only ever shrinks. None for `nearest` and `box`: they
    /// pick or average exact source pixels, which a DCT-reduced decode has
    /// already blended (up to 7 levels off on photos, where the smooth
    /// filters stay within 1).
    pub fn reduction(&self, plan: &Plan, width: u32, height: u32) -> u32 {
        if matches!(
            self.interpolation,
            Interpolation::Nearest | Interpolation::Box
        ) {
            return 1;
        }
        let (oh, ow) = self.out_size();
        // Source pixels per output pixel along each axis.
        let (sx, sy) = match plan.resized {
            Some((rw, rh)) => (width as f64 / rw as f64, height as f64 / rh as f64),
            None => (plan.crop.width / ow as f64, plan.crop.height / oh as f64),
        };
        let s = sx.min(sy);
        [8u32, 4, 2]
            .into_iter()
            .find(|&d| s >= d as f64)
            .unwrap_or(1)
    }
}

/// torchvision's `Resize(size)` with an int: the shorter side becomes `size`,
/// the longer `int(size * long / short)`. Returns (width, height).
pub fn resize_shorter(width: u32, height: u32, size: u32) -> (u32, u32) {
    let (short, long) = if width <= height {
        (width, height)
    } else {
        (height, width)
    };
    let new_long = (size as f64 * long as f64 / short as f64) as u32;
    if width <= height {
        (size, new_long)
    } else {
        (new_long, size)
    }
}

/// `F.center_crop`'s offsets of an `(h, w)` crop in an `(ih, iw)` image
/// (negative: the image is padded with zeros on that side).
fn center_offsets((ih, iw): (u32, u32), (h, w): (u32, u32)) -> (i64, i64) {
    let one = |image: u32, crop: u32| {
        if crop > image {
            // Padded by (crop - image) // 2 before, then cropped at 0.
            -(i64::from(crop - image) / 2)
        } else {
            round_half_even((f64::from(image) - f64::from(crop)) / 2.0) as i64
        }
    };
    (one(ih, h), one(iw, w))
}

/// `RandomCrop`'s padding, `pad_if_needed` and `get_params` on an
/// `(ih, iw)` image: the crop's offsets (negative inside the padding), and
/// whether it cannot fit.
fn random_crop_offsets(
    (ih, iw): (u32, u32),
    (h, w): (u32, u32),
    padding: [u32; 4],
    pad_if_needed: bool,
    rng: &mut SplitMix64,
) -> (i64, i64, bool) {
    let (rows, cols) = random_crop_steps((ih, iw), (h, w), padding, pad_if_needed);
    let span = |n: u32, [(b1, a1), (b2, a2)]: Steps| i64::from(n) + b1 + a1 + b2 + a2;
    let (ph, pw) = (span(ih, rows), span(iw, cols));
    let (h, w) = (i64::from(h), i64::from(w));
    if ph < h || pw < w {
        return (0, 0, true);
    }
    let (i, j) = if ph == h && pw == w {
        (0, 0)
    } else {
        let i = rng.below((ph - h + 1) as u64) as i64;
        let j = rng.below((pw - w + 1) as u64) as i64;
        (i, j)
    };
    (i - rows[0].0 - rows[1].0, j - cols[0].0 - cols[1].0, false)
}

/// `RandomResizedCrop.get_params`.
pub fn rrc_params(
    width: u32,
    height: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
    rng: &mut SplitMix64,
) -> CropBox {
    let area = width as f64 * height as f64;
    let (lr0, lr1) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target_area = area * uniform(rng, scale.0, scale.1);
        let aspect = uniform(rng, lr0, lr1).exp();
        let w = round_half_even((target_area * aspect).sqrt());
        let h = round_half_even((target_area / aspect).sqrt());
        if 0.0 < w && w <= width as f64 && 0.0 < h && h <= height as f64 {
            let i = rng.below(height as u64 - h as u64 + 1) as f64;
            let j = rng.below(width as u64 - w as u64 + 1) as f64;
            return CropBox {
                top: i,
                left: j,
                height: h,
                width: w,
            };
        }
    }
    let in_ratio = width as f64 / height as f64;
    let (w, h) = if in_ratio < ratio.0.min(ratio.1) {
        let w = width as f64;
        (w, round_half_even(w / ratio.0.min(ratio.1)))
    } else if in_ratio > ratio.0.max(ratio.1) {
        let h = height as f64;
        (round_half_even(h * ratio.0.max(ratio.1)), h)
    } else {
        (width as f64, height as f64)
    };
    CropBox {
        top: ((height as f64 - h) / 2.0).floor(),
        left: ((width as f64 - w) / 2.0).floor(),
        height: h,
        width: w,
    }
}

/// Per-thread buffers and the resizer.
#[derive(Debug, Default)]
pub struct Scratch {
    resizer: Resizer,
    resized: Vec<u8>,
    out: Vec<u8>,
    canvas: Canvas,
}

#[derive(Debug, thiserror::Error)]
#[error("resize failed: {0}")]
pub struct ResizeError(String);

impl Transform {
    /// Crops, resizes, flips and converts `img` per `plan` (made for the
    /// image's full size; `denom` is the DCT reduction it was decoded at),
    /// writing one sample's tensor into `out`.
    pub fn apply(
        &self,
        img: &Rgb,
        plan: &Plan,
        denom: u32,
        lut: &Lut,
        scratch: &mut Scratch,
        out: &mut [u8],
    ) -> Result<(), ResizeError> {
        if plan.too_small {
            return Err(ResizeError(format!(
                "a {}×{} image is smaller than random_crop's size even with its padding",
                img.width, img.height
            )));
        }
        self.crop_into(img, plan, denom, scratch)?;
        let (oh, ow) = self.out_size();
        let [l, t, r, b] = self.pad;
        if l + t + r + b > 0 {
            // `Pad`: the crop inside its border.
            let (ch, cw) = self.crop_size();
            scratch.out.resize(oh as usize * ow as usize * 3, 0);
            let steps = |before: u32, after: u32| [(i64::from(before), i64::from(after)), (0, 0)];
            let window = Window {
                at: (-i64::from(t), -i64::from(l)),
                size: (oh, ow),
                border: self.pad_border,
                steps: (steps(t, b), steps(l, r)),
            };
            window.copy(&scratch.resized, cw, ch, &mut scratch.out);
            std::mem::swap(&mut scratch.out, &mut scratch.resized);
        }
        let mut flip = plan.flip;
        if !plan.ops.is_empty() {
            // The ops see the flipped image, as in a Compose.
            let c = &mut scratch.canvas;
            (c.width, c.height) = (ow, oh);
            c.resample = self.resample;
            std::mem::swap(&mut c.data, &mut scratch.resized);
            if flip {
                c.apply(Op::HorizontalFlip);
                flip = false;
            }
            for &op in &plan.ops {
                c.apply(op);
            }
            std::mem::swap(&mut c.data, &mut scratch.resized);
        }
        write_tensor(&scratch.resized, oh, ow, flip, self.layout, lut, out);
        if let (Some(e), Some(r)) = (&self.erasing, plan.erase) {
            e.apply(r, (oh, ow), self.layout, self.dtype, out);
        }
        Ok(())
    }

    /// The geometry: the crop (resized) into `scratch.resized`, at the
    /// crop's size.
    fn crop_into(
        &self,
        img: &Rgb,
        plan: &Plan,
        denom: u32,
        scratch: &mut Scratch,
    ) -> Result<(), ResizeError> {
        let err = |e: &dyn std::fmt::Display| ResizeError(e.to_string());
        let (oh, ow) = self.crop_size();
        // Typed (RGB only): the resizer's untyped entry point would build
        // its kernels for all 13 pixel types, most of this crate's build.
        let src = TypedImageRef::<U8x3>::from_buffer(img.width, img.height, &img.data)
            .map_err(|e| err(&e))?;
        let resample = self.interpolation.options();
        scratch.resized.resize(oh as usize * ow as usize * 3, 0);
        let (rw, rh) = match plan.resized {
            None => {
                self.check_decoded(img, plan, denom)?;
                // The crop box was chosen on the full-size image; a decode
                // reduced in the DCT domain maps pixel x to x / denom.
                let f = 1.0 / denom as f64;
                let c = plan.crop;
                let opts = resample.crop(c.left * f, c.top * f, c.width * f, c.height * f);
                let mut dst = TypedImage::<U8x3>::from_buffer(ow, oh, &mut scratch.resized)
                    .map_err(|e| err(&e))?;
                scratch
                    .resizer
                    .resize_typed(&src, &mut dst, &opts)
                    .map_err(|e| err(&e))?;
                return Ok(());
            }
            Some(size) => size,
        };
        // A crop of the image as decoded (copied), or of it resized.
        let resized = (rw, rh) != (img.width, img.height);
        if resized {
            scratch.out.resize(rw as usize * rh as usize * 3, 0);
            let mut full =
                TypedImage::<U8x3>::from_buffer(rw, rh, &mut scratch.out).map_err(|e| err(&e))?;
            scratch
                .resizer
                .resize_typed(&src, &mut full, &resample)
                .map_err(|e| err(&e))?;
        }
        let no_steps = [(0, 0), (0, 0)];
        let (border, steps) = match self.geometry {
            Geometry::ResizeCrop {
                crop:
                    Some(Crop::Random {
                        size,
                        padding,
                        pad_if_needed,
                        border,
                    }),
                ..
            } => (
                border,
                random_crop_steps((rh, rw), size, padding, pad_if_needed),
            ),
            // CenterCrop pads a smaller image with zeros.
            _ => (Border::default(), (no_steps, no_steps)),
        };
        let window = Window {
            at: (plan.crop.top as i64, plan.crop.left as i64),
            size: (oh, ow),
            border,
            steps,
        };
        let from = if resized { &scratch.out } else { &img.data };
        window.copy(from, rw, rh, &mut scratch.resized);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_rounding() {
        assert_eq!(round_half_even(0.5), 0.0);
        assert_eq!(round_half_even(1.5), 2.0);
        assert_eq!(round_half_even(2.5), 2.0);
        assert_eq!(round_half_even(2.6), 3.0);
        assert_eq!(round_half_even(16.0), 16.0);
    }

    #[test]
    fn resize_keeps_the_aspect_like_torchvision() {
        assert_eq!(resize_shorter(500, 375, 256), (341, 256));
        assert_eq!(resize_shorter(375, 500, 256), (256, 341));
        assert_eq!(resize_shorter(300, 300, 256), (256, 256));
    }

    #[test]
    fn random_crops_stay_inside_and_within_bounds() {
        let mut rng = SplitMix64::new(1);
        let (scale, ratio) = ((0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0));
        let mut fallbacks = 0;
        for k in 0..20_000u32 {
            let (w, h) = (1 + k % 997, 1 + (k * 7) % 613);
            let c = rrc_params(w, h, scale, ratio, &mut rng);
            assert!(c.top >= 0.0 && c.left >= 0.0 && c.width >= 1.0 && c.height >= 1.0);
            assert!(
                c.top + c.height <= h as f64 && c.left + c.width <= w as f64,
                "{c:?} in {w}x{h}"
            );
            let area = c.width * c.height / (w as f64 * h as f64);
            let r = c.width / c.height;
            // Rounding to whole pixels moves small crops off the exact bounds.
            let slack = 2.0 / (c.width.min(c.height));
            if !(area >= scale.0 * (1.0 - slack) - 1e-9
                && area <= 1.0 + 1e-9
                && r >= ratio.0 * (1.0 - slack)
                && r <= ratio.1 * (1.0 + slack))
            {
                fallbacks += 1;
            }
        }
        // Only the central fallback (extreme aspect ratios) may leave the
        // ratio bounds, and it keeps the image's own ratio.
        assert!(fallbacks < 2_000, "{fallbacks}");
    }

    #[test]
    fn random_crop_pads_like_torchvision() {
        let mut rng = SplitMix64::new(5);
        // Too small without pad_if_needed: torchvision raises; a bad sample here.
        assert!(random_crop_offsets((10, 10), (14, 12), [0; 4], false, &mut rng).2);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..2000 {
            // pad_if_needed pads the shortfall on both sides: 10 → 18 rows
            // (top pad 4) and 10 → 14 columns (left pad 2).
            let (top, left, too) = random_crop_offsets((10, 10), (14, 12), [0; 4], true, &mut rng);
            assert!(!too);
            assert!(
                (-4..=0).contains(&top) && (-2..=0).contains(&left),
                "{top} {left}"
            );
            seen.insert((top, left));
            // padding = [l, t, r, b] = [1, 2, 3, 4]: 16 × 14 around 10 × 10.
            let (top, left, _) =
                random_crop_offsets((10, 10), (10, 10), [1, 2, 3, 4], false, &mut rng);
            assert!(
                (-2..=4).contains(&top) && (-1..=3).contains(&left),
                "{top} {left}"
            );
        }
        assert_eq!(seen.len(), 5 * 3, "every offset happens");
        // CenterCrop larger than the image: padded by (crop - image) // 2.
        assert_eq!(center_offsets((10, 11), (13, 11)), (-1, 0));
        assert_eq!(center_offsets((11, 20), (4, 5)), (4, 8));
    }

    /// The one-pass tensor writer against the definition: element
    /// (c, y, x) is `table[c][src[y][x or w-1-x][c]]`, for every dtype,
    /// layout and flip.
    #[test]
    fn tensors_are_written_element_by_element_as_defined() {
        let (h, w) = (5usize, 7usize);
        let src: Vec<u8> = (0..h * w * 3).map(|i| (i * 37 % 256) as u8).collect();
        let norm = Some(([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]));
        for (dtype, normalize) in [
            (DType::U8, None),
            (DType::F16, norm),
            (DType::Bf16, None),
            (DType::F32, norm),
        ] {
            for layout in [Layout::Nchw, Layout::Nhwc] {
                for flip in [false, true] {
                    let t = Transform {
                        dtype,
                        layout,
                        normalize,
                        ..Transform::of(Geometry::ResizeCrop {
                            resize: None,
                            crop: None,
                        })
                    };
                    let lut = Lut::new(&t);
                    let n = lut.size;
                    let mut out = vec![0xAAu8; h * w * 3 * n + 3];
                    write_tensor(&src, h as u32, w as u32, flip, layout, &lut, &mut out);
                    let mut want = vec![0xAAu8; out.len()];
                    for (c, y, x) in (0..3)
                        .flat_map(|c| (0..h).flat_map(move |y| (0..w).map(move |x| (c, y, x))))
                    {
                        let sx = if flip { w - 1 - x } else { x };
                        let v = src[(y * w + sx) * 3 + c] as usize;
                        let at = match layout {
                            Layout::Nchw => (c * h * w + y * w + x) * n,
                            Layout::Nhwc => ((y * w + x) * 3 + c) * n,
                        };
                        want[at..at + n].copy_from_slice(&lut.bytes[c * 256 + v][..n]);
                    }
                    assert_eq!(out, want, "{dtype:?} {layout:?} flip={flip}");
                }
            }
        }
    }

    /// A u8 tensor expanded through an f32 (or f16) table is the tensor
    /// that table writes itself: what a stream made elsewhere sends as
    /// u8 and its feed expands.
    #[test]
    fn a_u8_tensor_expanded_is_the_tensor_written_with_the_table() {
        let (h, w) = (5usize, 7usize);
        let src: Vec<u8> = (0..h * w * 3).map(|i| (i * 53 % 256) as u8).collect();
        let norm = Some(([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]));
        let geometry = Geometry::ResizeCrop {
            resize: None,
            crop: None,
        };
        for (dtype, normalize) in [(DType::F32, norm), (DType::F32, None), (DType::F16, norm)] {
            for layout in [Layout::Nchw, Layout::Nhwc] {
                for flip in [false, true] {
                    let t = Transform {
                        dtype,
                        layout,
                        normalize,
                        ..Transform::of(geometry.clone())
                    };
                    let lut = Lut::new(&t);
                    let raw = Lut::new(&Transform {
                        dtype: DType::U8,
                        layout,
                        ..Transform::of(geometry.clone())
                    });
                    let mut want = vec![0u8; h * w * 3 * lut.element_bytes()];
                    write_tensor(&src, h as u32, w as u32, flip, layout, &lut, &mut want);
                    let mut small = vec![0u8; h * w * 3];
                    write_tensor(&src, h as u32, w as u32, flip, layout, &raw, &mut small);
                    // Two samples back to back, as in a batch.
                    let two = [small.clone(), small].concat();
                    let mut got = vec![0u8; 2 * want.len()];
                    lut.expand(layout, h * w, &two, &mut got);
                    assert_eq!(
                        got,
                        [want.clone(), want].concat(),
                        "{dtype:?} {layout:?} flip={flip}"
                    );
                }
            }
        }
    }

    #[test]
    fn padding_modes_fold_like_np_pad_in_one_and_two_steps() {
        let row = |mode, n: i64, steps: Steps| -> Vec<Option<i64>> {
            let b = Border { mode, fill: [0; 3] };
            let [(b1, a1), (b2, a2)] = steps;
            (-(b1 + b2)..n + a1 + a2)
                .map(|i| b.source(i, n, steps))
                .collect()
        };
        let one = |before: i64, after: i64| [(before, after), (0, 0)];
        let s = |v: &[i64]| v.iter().map(|&x| Some(x)).collect::<Vec<_>>();
        // np.pad([a b c d], 3, mode) as indices.
        assert_eq!(
            row(PaddingMode::Reflect, 4, one(3, 3)),
            s(&[3, 2, 1, 0, 1, 2, 3, 2, 1, 0])
        );
        assert_eq!(
            row(PaddingMode::Symmetric, 4, one(3, 3)),
            s(&[2, 1, 0, 0, 1, 2, 3, 3, 2, 1])
        );
        assert_eq!(
            row(PaddingMode::Edge, 4, one(3, 3)),
            s(&[0, 0, 0, 0, 1, 2, 3, 3, 3, 3])
        );
        let mut c = vec![None; 3];
        c.extend(s(&[0, 1, 2, 3]));
        c.extend([None; 3]);
        assert_eq!(row(PaddingMode::Constant, 4, one(3, 3)), c);
        // Wider than the image: np.pad keeps reflecting.
        assert_eq!(
            row(PaddingMode::Reflect, 3, one(5, 0)),
            s(&[1, 0, 1, 2, 1, 0, 1, 2])
        );
        assert_eq!(row(PaddingMode::Reflect, 1, one(2, 2)), s(&[0; 5]));
        // Two steps: np.pad(np.pad([a b c], 1, "reflect"), 2, "reflect")
        // = np.pad([b a b c b], 2) = [b a | b a b c b | c b]: the second
        // step mirrors the first one's padding, not the image.
        assert_eq!(
            row(PaddingMode::Reflect, 3, [(1, 1), (2, 2)]),
            s(&[1, 0, 1, 0, 1, 2, 1, 2, 1])
        );
        assert_eq!(
            row(PaddingMode::Symmetric, 3, [(1, 1), (2, 2)]),
            s(&[0, 0, 0, 0, 1, 2, 2, 2, 2])
        );
    }

    #[test]
    fn reduction_never_goes_below_the_output_size() {
        let t = Transform {
            flip_p: 0.5,
            ..Transform::of(Geometry::RandomResizedCrop {
                size: (224, 224),
                scale: (0.08, 1.0),
                ratio: (0.75, 4.0 / 3.0),
            })
        };
        let mut rng = SplitMix64::new(3);
        for _ in 0..1000 {
            let p = t.plan(4000, 3000, &mut rng);
            let d = t.reduction(&p, 4000, 3000) as f64;
            assert!(p.crop.width / d >= 224.0 && p.crop.height / d >= 224.0);
        }
    }
}
