//! The augmentations ImageNet-class recipes use, with torchvision's
//! semantics on PIL images (which call Pillow): each works on the
//! cropped, resized `H × W` RGB image, in the order of a torchvision
//! `Compose` (see [`Augment`]), and its randomness is drawn with the rest
//! of the sample's plan, before the image is decoded.
//!
//! Every op reproduces Pillow's arithmetic: enhancements blend with a
//! degenerate image in 32-bit float and truncate (`ImageEnhance`,
//! `Image.blend`), lookup-table ops follow `ImageOps`, grayscale is
//! Pillow's fixed-point ITU-R 601-2 luma, and geometric ops (shear,
//! translate, rotate) map pixel centres through the inverse matrix
//! torchvision computes: nearest neighbour in Pillow's 16.16 fixed point,
//! bilinear and bicubic as Pillow's generic transform (double precision,
//! its clamped neighbours, truncation), the area mapped from outside the
//! image taking `fill` (see [`Resample`]).
//! Hue goes through Pillow's HSV and back (`Convert.c`'s float and double
//! arithmetic, as C promotes it). `GaussianBlur` follows torchvision's
//! tensor path (a float32 kernel, reflect padding, rounding half to even).
//! `tests/augment.rs` compares each with Pillow on generated images.

mod draw;
mod pixel;

pub use draw::Augment;
pub use pixel::luma;
use pixel::*;

/// One image operation with its drawn magnitude.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    Identity,
    /// `F.affine(shear=[degrees(atan(m)), 0], center=[0, 0])`.
    ShearX(f64),
    ShearY(f64),
    /// Whole pixels (`int(magnitude)`), as torchvision passes them.
    TranslateX(f64),
    TranslateY(f64),
    /// Degrees, counter-clockwise, about the image's centre.
    Rotate(f64),
    /// Enhancement factors (1.0 leaves the image as it is).
    Brightness(f64),
    Color(f64),
    Contrast(f64),
    Sharpness(f64),
    /// `F.adjust_hue(factor)`, factor in `[-0.5, 0.5]`: Pillow's HSV, the
    /// hue byte shifted with wrap-around, and back.
    Hue(f64),
    /// Bits kept per channel.
    Posterize(u8),
    /// Values at or above the threshold are inverted.
    Solarize(f64),
    AutoContrast,
    Equalize,
    Invert,
    /// `F.gaussian_blur(kernel (x, y), sigma)`: torchvision's float32
    /// kernel, reflect padding, rounded half to even.
    Blur(u16, u16, f64),
    /// Luma in all three channels.
    Grayscale,
    VerticalFlip,
    HorizontalFlip,
}

/// The `interpolation` of the automatic augmentations' geometric ops
/// (Pillow's transform filters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AffineFilter {
    #[default]
    Nearest,
    Bilinear,
    Bicubic,
}

/// How the geometric ops resample, and what they put where the source
/// lies outside the image (torchvision's `interpolation` and `fill`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Resample {
    pub filter: AffineFilter,
    pub fill: [u8; 3],
}

/// An RGB image being augmented, and a second buffer of its size.
#[derive(Debug, Default)]
pub struct Canvas {
    pub width: u32,
    pub height: u32,
    /// `height × width × 3`, row-major.
    pub data: Vec<u8>,
    /// For the geometric ops.
    pub resample: Resample,
    spare: Vec<u8>,
    /// The blur's first pass, kept between images.
    rows: Vec<f32>,
}

impl Canvas {
    pub fn new(width: u32, height: u32, data: Vec<u8>) -> Canvas {
        Canvas {
            width,
            height,
            data,
            resample: Resample::default(),
            spare: Vec::new(),
            rows: Vec::new(),
        }
    }

    /// Applies one op in place.
    pub fn apply(&mut self, op: Op) {
        match op {
            Op::Identity => {}
            Op::ShearX(m) => self.affine(shear_matrix(m, 0.0)),
            Op::ShearY(m) => self.affine(shear_matrix(0.0, m)),
            Op::TranslateX(m) => self.affine([1.0, 0.0, -(m.trunc()), 0.0, 1.0, 0.0]),
            Op::TranslateY(m) => self.affine([1.0, 0.0, 0.0, 0.0, 1.0, -(m.trunc())]),
            Op::Rotate(deg) => self.rotate(deg),
            // A constant degenerate image: one table for every value.
            Op::Brightness(f) => self.blend_constant(0, f),
            Op::Contrast(f) => {
                let mean = self.mean_luma();
                self.blend_constant(mean, f);
            }
            Op::Color(f) => self.color(f),
            Op::Sharpness(f) => self.sharpness(f),
            Op::Hue(f) => self.hue(f),
            Op::Blur(kx, ky, sigma) => self.blur(kx, ky, sigma),
            Op::Posterize(bits) => {
                let mask = !((1u16 << (8 - bits.clamp(1, 8))) - 1) as u8;
                self.lut(|_, v| v & mask);
            }
            Op::Solarize(t) => self.lut(|_, v| if (v as f64) < t { v } else { 255 - v }),
            Op::AutoContrast => self.autocontrast(),
            Op::Equalize => self.equalize(),
            Op::Invert => self.lut(|_, v| 255 - v),
            Op::Grayscale => {
                for px in self.data.chunks_exact_mut(3) {
                    let l = luma(px);
                    px.copy_from_slice(&[l, l, l]);
                }
            }
            Op::VerticalFlip => {
                let row = self.width as usize * 3;
                let h = self.height as usize;
                for y in 0..h / 2 {
                    let (top, bottom) = self.data.split_at_mut((h - 1 - y) * row);
                    top[y * row..(y + 1) * row].swap_with_slice(&mut bottom[..row]);
                }
            }
            Op::HorizontalFlip => {
                let w = self.width as usize;
                for row in self.data.chunks_exact_mut(w * 3) {
                    for x in 0..w / 2 {
                        for c in 0..3 {
                            row.swap(x * 3 + c, (w - 1 - x) * 3 + c);
                        }
                    }
                }
            }
        }
    }

    /// A per-channel lookup table, `f(channel, value)`.
    fn lut(&mut self, f: impl Fn(usize, u8) -> u8) {
        let mut t = [[0u8; 256]; 3];
        for (c, tc) in t.iter_mut().enumerate() {
            for (v, e) in tc.iter_mut().enumerate() {
                *e = f(c, v as u8);
            }
        }
        for px in self.data.chunks_exact_mut(3) {
            for c in 0..3 {
                px[c] = t[c][px[c] as usize];
            }
        }
    }

    /// `Image.blend(degenerate, image, f)` with a degenerate image of one
    /// grey level `d`: a table.
    fn blend_constant(&mut self, d: u8, f: f64) {
        let alpha = f as f32;
        if alpha == 1.0 {
            return;
        }
        let t: [u8; 256] = std::array::from_fn(|v| blend(f32::from(d), v as u8, alpha));
        for v in &mut self.data {
            *v = t[*v as usize];
        }
    }

    /// `ImageEnhance.Color`: blends each pixel with its own luma.
    fn color(&mut self, f: f64) {
        let alpha = f as f32;
        if alpha == 1.0 {
            return;
        }
        for px in self.data.chunks_exact_mut(3) {
            let l = f32::from(luma(px));
            for v in px.iter_mut() {
                *v = blend(l, *v, alpha);
            }
        }
    }

    /// `F.adjust_hue` on a PIL image: `convert("HSV")`, the hue byte plus
    /// `uint8(factor · 255)` (wrapping), `convert("RGB")`.
    fn hue(&mut self, f: f64) {
        // Even a zero shift goes through HSV and back, which is lossy.
        let shift = ((f * 255.0) as i64) as u8;
        for px in self.data.chunks_exact_mut(3) {
            let [h, s, v] = rgb_to_hsv([px[0], px[1], px[2]]);
            px.copy_from_slice(&hsv_to_rgb([h.wrapping_add(shift), s, v]));
        }
    }

    /// `F.gaussian_blur` on a PIL image (through a uint8 tensor):
    /// separable float32 passes with torchvision's kernel and reflect
    /// padding, rounded half to even.
    fn blur(&mut self, kx: u16, ky: u16, sigma: f64) {
        let (w, h) = (self.width as usize, self.height as usize);
        let (kx, ky) = (gaussian_kernel(kx, sigma), gaussian_kernel(ky, sigma));
        let (data, rows) = (&mut self.data, &mut self.rows);
        rows.clear();
        rows.resize(w * h * 3, 0.0);
        convolve::<true>(
            (w, h),
            &kx,
            |i| f32::from(data[i]),
            |i, v| {
                rows[i] = v;
            },
        );
        convolve::<false>(
            (w, h),
            &ky,
            |i| rows[i],
            |i, v| {
                data[i] = v.round_ties_even().clamp(0.0, 255.0) as u8;
            },
        );
    }

    /// `ImageStat.Stat(image.convert("L")).mean`, rounded as
    /// `ImageEnhance.Contrast` does.
    fn mean_luma(&self) -> u8 {
        let n = (self.data.len() / 3).max(1);
        let sum: u64 = self.data.chunks_exact(3).map(|p| u64::from(luma(p))).sum();
        (sum as f64 / n as f64 + 0.5) as u8
    }

    /// `ImageEnhance.Sharpness`: blends with `ImageFilter.SMOOTH` (3×3,
    /// centre 5, divisor 13), whose border pixels are the image's own.
    fn sharpness(&mut self, f: f64) {
        let (w, h) = (self.width as usize, self.height as usize);
        self.spare.clear();
        self.spare.extend_from_slice(&self.data);
        if w >= 3 && h >= 3 {
            let src = &self.data;
            for y in 1..h - 1 {
                for x in 1..w - 1 {
                    for c in 0..3 {
                        let mut s = 0u32;
                        for dy in 0..3 {
                            for dx in 0..3 {
                                let k = if dx == 1 && dy == 1 { 5 } else { 1 };
                                s += k * u32::from(src[((y + dy - 1) * w + x + dx - 1) * 3 + c]);
                            }
                        }
                        self.spare[(y * w + x) * 3 + c] = smooth_round(s);
                    }
                }
            }
        }
        let alpha = f as f32;
        for (px, d) in self.data.iter_mut().zip(&self.spare) {
            *px = blend(f32::from(*d), *px, alpha);
        }
    }

    /// Per-channel histogram.
    fn histograms(&self) -> [[u64; 256]; 3] {
        let mut h = [[0u64; 256]; 3];
        for px in self.data.chunks_exact(3) {
            for c in 0..3 {
                h[c][px[c] as usize] += 1;
            }
        }
        h
    }

    /// `ImageOps.autocontrast(image)` (no cutoff).
    fn autocontrast(&mut self) {
        let hist = self.histograms();
        let mut t = [[0u8; 256]; 3];
        for c in 0..3 {
            let lo = hist[c].iter().position(|&n| n > 0);
            let hi = hist[c].iter().rposition(|&n| n > 0);
            match (lo, hi) {
                (Some(lo), Some(hi)) if hi > lo => {
                    let scale = 255.0 / (hi - lo) as f64;
                    let offset = -(lo as f64) * scale;
                    for (v, e) in t[c].iter_mut().enumerate() {
                        *e = ((v as f64 * scale + offset) as i64).clamp(0, 255) as u8;
                    }
                }
                _ => t[c] = std::array::from_fn(|v| v as u8),
            }
        }
        self.lut(|c, v| t[c][v as usize]);
    }

    /// `ImageOps.equalize(image)`.
    fn equalize(&mut self) {
        let hist = self.histograms();
        let mut t = [[0u8; 256]; 3];
        for c in 0..3 {
            t[c] = std::array::from_fn(|v| v as u8);
            let used: Vec<u64> = hist[c].iter().copied().filter(|&n| n > 0).collect();
            if used.len() <= 1 {
                continue;
            }
            let step = (used.iter().sum::<u64>() - used[used.len() - 1]) / 255;
            if step == 0 {
                continue;
            }
            let mut n = step / 2;
            for v in 0..256 {
                t[c][v] = (n / step).min(255) as u8;
                n += hist[c][v];
            }
        }
        self.lut(|c, v| t[c][v as usize]);
    }

    /// `Image.rotate(deg, fillcolor)` (about the centre, same size).
    fn rotate(&mut self, deg: f64) {
        let deg = deg.rem_euclid(360.0);
        if deg == 0.0 {
            return;
        }
        let a = -(deg * (std::f64::consts::PI / 180.0));
        // Python's `round(x, 15)`: correctly rounded in decimal.
        let r15 = |x: f64| format!("{x:.15}").parse::<f64>().unwrap_or(x);
        let (cos, sin) = (r15(a.cos()), r15(a.sin()));
        let (cx, cy) = (self.width as f64 / 2.0, self.height as f64 / 2.0);
        let m = [
            cos,
            sin,
            cos * -cx + sin * -cy + cx,
            -sin,
            cos,
            -sin * -cx + cos * -cy + cy,
        ];
        self.affine(m);
    }

    /// `Image.transform(size, AFFINE, m, filter, fillcolor)`: output pixel
    /// `(x, y)` samples the input at `m · (x + ½, y + ½)`.
    fn affine(&mut self, m: [f64; 6]) {
        self.spare.clear();
        match self.resample.fill {
            // One value (black, most often): a memset.
            [v, g, b] if v == g && g == b => self.spare.resize(self.data.len(), v),
            fill => self
                .spare
                .extend(std::iter::repeat_n(fill, self.data.len() / 3).flatten()),
        }
        // A whole-pixel shift samples pixel centres exactly (the
        // interpolation weights are 0 and 1): every filter gives the copy.
        let shift = m[0] == 1.0 && m[1] == 0.0 && m[3] == 0.0 && m[4] == 1.0;
        let whole = shift && m[2].fract() == 0.0 && m[5].fract() == 0.0;
        let filter = if whole {
            AffineFilter::Nearest
        } else {
            self.resample.filter
        };
        match filter {
            AffineFilter::Nearest => self.affine_nearest(m),
            AffineFilter::Bilinear => self.affine_smooth::<2>(m),
            AffineFilter::Bicubic => self.affine_smooth::<4>(m),
        }
        std::mem::swap(&mut self.data, &mut self.spare);
    }

    /// Nearest neighbour, in Pillow's 16.16 fixed point, into `spare`.
    fn affine_nearest(&mut self, m: [f64; 6]) {
        let fix = |v: f64| (v * 65536.0 + 0.5).floor() as i64;
        let (w, h) = (self.width as i64, self.height as i64);
        let (a0, a1, a3, a4) = (fix(m[0]), fix(m[1]), fix(m[3]), fix(m[4]));
        let mut a2 = fix(m[2] + m[0] * 0.5 + m[1] * 0.5);
        let mut a5 = fix(m[5] + m[3] * 0.5 + m[4] * 0.5);
        for y in 0..h {
            // The outputs x whose source lies inside: where both fixed-point
            // coordinates are in [0, size · 2^16), an interval of x.
            let (x0, x1) = inside(a2, a0, w << 16, w);
            let (y0, y1) = inside(a5, a3, h << 16, w);
            let (lo, hi) = (x0.max(y0), x1.min(y1));
            let (mut xx, mut yy) = (a2 + lo * a0, a5 + lo * a3);
            if lo < hi && a0 == 1 << 16 && a3 == 0 {
                // A shift along the row (translation, horizontal shear):
                // one run of consecutive source pixels.
                let s = (((yy >> 16) * w + (xx >> 16)) * 3) as usize;
                let d = ((y * w + lo) * 3) as usize;
                let n = ((hi - lo) * 3) as usize;
                self.spare[d..d + n].copy_from_slice(&self.data[s..s + n]);
            } else {
                // Pixels as 3-byte arrays: one bounds check per copy.
                let (src, _) = self.data.as_chunks::<3>();
                let (dst, _) = self.spare.as_chunks_mut::<3>();
                let row = &mut dst[(y * w) as usize..((y + 1) * w) as usize];
                for px in &mut row[lo as usize..hi.max(lo) as usize] {
                    *px = src[((yy >> 16) * w + (xx >> 16)) as usize];
                    xx += a0;
                    yy += a3;
                }
            }
            a2 += a1;
            a5 += a4;
        }
    }

    /// Pillow's generic transform with its bilinear (`TAPS` 2) or bicubic
    /// (4) filter, into `spare`: the source point in double precision;
    /// outside the image it keeps the fill; inside, neighbours past the edge
    /// are clamped to it (a row below the last repeats the previous row),
    /// and the value is truncated (bicubic clamped to 0..=255 first).
    fn affine_smooth<const TAPS: usize>(&mut self, m: [f64; 6]) {
        let (w, h) = (self.width as usize, self.height as usize);
        let (wf, hf) = (w as f64, h as f64);
        let (src, _) = self.data.as_chunks::<3>();
        let (dst, _) = self.spare.as_chunks_mut::<3>();
        // The first tap is one to the left of / above the point's pixel for
        // bicubic, the pixel itself for bilinear.
        let back = TAPS as i64 / 2 - 1;
        for (y, row) in dst.chunks_exact_mut(w).enumerate() {
            let yo = y as f64 + 0.5;
            let (row_x, row_y) = (m[1] * yo, m[4] * yo);
            for (x, px) in row.iter_mut().enumerate() {
                let xo = x as f64 + 0.5;
                // Pillow's `a0 * xin + a1 * yin + a2`, in that order.
                let xin = m[0] * xo + row_x + m[2];
                let yin = m[3] * xo + row_y + m[5];
                if !(xin >= 0.0 && xin < wf && yin >= 0.0 && yin < hf) {
                    continue;
                }
                let (xs, ys) = (xin - 0.5, yin - 0.5);
                let (fx, fy) = (floor(xs), floor(ys));
                let (dx, dy) = (xs - fx as f64, ys - fy as f64);
                let (x0, y0) = (fx - back, fy - back);
                let cols: [usize; TAPS] =
                    std::array::from_fn(|k| (x0 + k as i64).clamp(0, w as i64 - 1) as usize);
                // The first row clamped; a later one outside repeats it.
                let mut rows = [(y0.clamp(0, h as i64 - 1) as usize) * w; TAPS];
                for k in 1..TAPS {
                    let r = y0 + k as i64;
                    rows[k] = if (0..h as i64).contains(&r) {
                        r as usize * w
                    } else {
                        rows[k - 1]
                    };
                }
                // Each row along x, then the rows along y; three channels.
                let along_x = |r: usize| -> [f64; 3] {
                    std::array::from_fn(|c| {
                        let v = |k: usize| f64::from(src[r + cols[k]][c]);
                        if TAPS == 4 {
                            cubic(v(0), v(1), v(2), v(3), dx)
                        } else {
                            v(0) + (v(1) - v(0)) * dx
                        }
                    })
                };
                let v: [[f64; 3]; TAPS] = std::array::from_fn(|k| along_x(rows[k]));
                for c in 0..3 {
                    px[c] = if TAPS == 4 {
                        let v = cubic(v[0][c], v[1][c], v[2][c], v[3][c], dy);
                        if v <= 0.0 {
                            0
                        } else if v >= 255.0 {
                            255
                        } else {
                            v as u8
                        }
                    } else {
                        (v[0][c] + (v[1][c] - v[0][c]) * dy) as u8
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchcast_core::synthetic::SplitMix64;

    fn draws(a: &Augment, n: u64) -> Vec<Vec<Op>> {
        (0..n)
            .map(|i| {
                let mut rng = SplitMix64::new(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                let mut ops = Vec::new();
                a.draw((224, 160), &mut rng, &mut ops);
                ops
            })
            .collect()
    }

    fn name(op: &Op) -> &'static str {
        match op {
            Op::Identity => "Identity",
            Op::ShearX(_) => "ShearX",
            Op::ShearY(_) => "ShearY",
            Op::TranslateX(_) => "TranslateX",
            Op::TranslateY(_) => "TranslateY",
            Op::Rotate(_) => "Rotate",
            Op::Brightness(_) => "Brightness",
            Op::Color(_) => "Color",
            Op::Contrast(_) => "Contrast",
            Op::Sharpness(_) => "Sharpness",
            Op::Hue(_) => "Hue",
            Op::Blur(..) => "Blur",
            Op::Posterize(_) => "Posterize",
            Op::Solarize(_) => "Solarize",
            Op::AutoContrast => "AutoContrast",
            Op::Equalize => "Equalize",
            Op::Invert => "Invert",
            Op::Grayscale => "Grayscale",
            Op::VerticalFlip => "VerticalFlip",
            Op::HorizontalFlip => "HorizontalFlip",
        }
    }

    #[test]
    fn trivial_augment_wide_picks_each_op_evenly_within_torchvisions_ranges() {
        let n = 28_000;
        let mut count = std::collections::HashMap::new();
        let mut negative = 0;
        for ops in draws(&Augment::TrivialAugmentWide { bins: 31 }, n) {
            assert_eq!(ops.len(), 1);
            *count.entry(name(&ops[0])).or_insert(0u64) += 1;
            match ops[0] {
                Op::ShearX(m) | Op::ShearY(m) => assert!(m.abs() <= 0.99 + 1e-6),
                Op::TranslateX(m) | Op::TranslateY(m) => assert!(m.abs() <= 32.0),
                Op::Rotate(m) => {
                    assert!(m.abs() <= 135.0);
                    negative += u64::from(m < 0.0);
                }
                Op::Brightness(f) | Op::Color(f) | Op::Contrast(f) | Op::Sharpness(f) => {
                    assert!((0.01 - 1e-6..=1.99 + 1e-6).contains(&f), "{f}")
                }
                Op::Posterize(b) => assert!((2..=8).contains(&b)),
                Op::Solarize(t) => assert!((0.0..=255.0).contains(&t)),
                _ => {}
            }
        }
        assert_eq!(count.len(), 14, "{count:?}");
        for (op, c) in &count {
            // 2000 expected each; 5 sigma is about 220.
            assert!((1780..=2220).contains(c), "{op}: {c}");
        }
        let rotations = count["Rotate"];
        assert!(negative * 10 > rotations * 4 && negative * 10 < rotations * 6);
    }

    #[test]
    fn rand_augment_uses_its_magnitude_and_auto_augment_its_policy() {
        for ops in draws(
            &Augment::RandAugment {
                num_ops: 2,
                magnitude: 30,
                bins: 31,
            },
            500,
        ) {
            assert_eq!(ops.len(), 2);
            for op in ops {
                match op {
                    Op::TranslateX(m) => assert!((m.abs() - 150.0 / 331.0 * 224.0).abs() < 1e-3),
                    Op::TranslateY(m) => assert!((m.abs() - 150.0 / 331.0 * 160.0).abs() < 1e-3),
                    Op::Rotate(m) => assert_eq!(m.abs(), 30.0),
                    Op::Posterize(b) => assert_eq!(b, 4),
                    Op::Solarize(t) => assert_eq!(t, 0.0),
                    _ => {}
                }
            }
        }
        // ImageNet policy: at most two ops, only its ops, Invert among them.
        let all = draws(&Augment::AutoAugmentImageNet, 5000);
        assert!(all.iter().all(|o| o.len() <= 2));
        let names: std::collections::HashSet<_> = all.iter().flatten().map(name).collect();
        for n in [
            "Invert",
            "Equalize",
            "Posterize",
            "Rotate",
            "Solarize",
            "ShearX",
        ] {
            assert!(names.contains(n), "{n}");
        }
        for n in ["TranslateX", "ShearY", "Brightness", "Identity"] {
            assert!(!names.contains(n), "{n} is not in the ImageNet policy");
        }
    }

    #[test]
    fn the_inside_interval_is_exactly_where_coordinates_are_in_bounds() {
        let mut rng = SplitMix64::new(7);
        for _ in 0..20_000 {
            let n = 1 + rng.below(50) as i64;
            let end = (1 + rng.below(40) as i64) << 16;
            let start = rng.below(200 << 16) as i64 - (100 << 16);
            let step = rng.below(4 << 16) as i64 - (2 << 16);
            let step = if rng.below(8) == 0 { 0 } else { step };
            let (lo, hi) = inside(start, step, end, n);
            for x in 0..n {
                let v = start + x * step;
                assert_eq!(
                    (lo..hi).contains(&x),
                    (0..end).contains(&v),
                    "start {start} step {step} end {end} x {x}: {lo}..{hi}"
                );
            }
        }
    }

    #[test]
    fn color_jitter_draws_each_factor_in_its_range_in_every_order() {
        let a = Augment::ColorJitter {
            p: 1.0,
            ranges: [Some((0.6, 1.4)), None, Some((0.0, 2.0)), None],
        };
        let mut orders = std::collections::HashSet::new();
        for ops in draws(&a, 2000) {
            assert_eq!(ops.len(), 2);
            orders.insert(ops.iter().map(name).collect::<Vec<_>>());
            for op in ops {
                match op {
                    Op::Brightness(f) => assert!((0.6..1.4).contains(&f)),
                    Op::Color(f) => assert!((0.0..2.0).contains(&f)),
                    other => panic!("{other:?}"),
                }
            }
        }
        assert_eq!(orders.len(), 2, "both orders of the two jitters");
    }
}
