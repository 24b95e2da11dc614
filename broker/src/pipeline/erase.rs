//! `RandomErasing(p, scale, ratio, value)`: after the tensor is written
//! (it follows `Normalize` in a torchvision `Compose`), a random rectangle
//! of it is set to `value`, per channel, in the output's dtype.

use batchcast::DType;
use batchcast::synthetic::SplitMix64;

use super::transform::{Layout, round_half_even, uniform};

/// A `RandomErasing`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Erasing {
    pub p: f64,
    pub scale: (f64, f64),
    pub ratio: (f64, f64),
    /// Per channel, in the tensor's units (after Normalize).
    pub value: [f64; 3],
}

/// A rectangle of the output: top, left, height, width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rect {
    pub top: u32,
    pub left: u32,
    pub height: u32,
    pub width: u32,
}

impl Erasing {
    /// torchvision's `forward` + `get_params` for an `h × w` output: with
    /// probability `p`, ten tries of a random area and log-uniform aspect
    /// ratio; none that fits erases nothing.
    pub fn draw(&self, (h, w): (u32, u32), rng: &mut SplitMix64) -> Option<Rect> {
        if !(self.p > 0.0 && uniform(rng, 0.0, 1.0) < self.p) {
            return None;
        }
        let area = f64::from(h) * f64::from(w);
        let (l0, l1) = (self.ratio.0.ln(), self.ratio.1.ln());
        for _ in 0..10 {
            let erase = area * uniform(rng, self.scale.0, self.scale.1);
            let aspect = uniform(rng, l0, l1).exp();
            let eh = round_half_even((erase * aspect).sqrt()) as u32;
            let ew = round_half_even((erase / aspect).sqrt()) as u32;
            if !(eh < h && ew < w) {
                continue;
            }
            let top = rng.below(u64::from(h - eh) + 1) as u32;
            let left = rng.below(u64::from(w - ew) + 1) as u32;
            return Some(Rect {
                top,
                left,
                height: eh,
                width: ew,
            });
        }
        None
    }

    /// Sets `r` of one sample's tensor (`h × w`, in `layout` and `dtype`)
    /// to the value.
    pub fn apply(&self, r: Rect, (h, w): (u32, u32), layout: Layout, dtype: DType, out: &mut [u8]) {
        let size = dtype.size() as usize;
        let enc: [[u8; 4]; 3] = self.value.map(|v| encode(v, dtype));
        let (h, w) = (h as usize, w as usize);
        for y in r.top as usize..(r.top + r.height) as usize {
            for x in r.left as usize..(r.left + r.width) as usize {
                for (c, e) in enc.iter().enumerate() {
                    let at = match layout {
                        Layout::Nchw => (c * h * w + y * w + x) * size,
                        Layout::Nhwc => ((y * w + x) * 3 + c) * size,
                    };
                    out[at..at + size].copy_from_slice(&e[..size]);
                }
            }
        }
    }
}

/// A value's bytes in an image dtype (u8 saturates, as a cast of an
/// integer value in 0..=255 does; the plan checks it is one).
fn encode(v: f64, dtype: DType) -> [u8; 4] {
    let mut e = [0u8; 4];
    match dtype {
        DType::U8 => e[0] = v.clamp(0.0, 255.0) as u8,
        DType::F16 => e[..2].copy_from_slice(&half::f16::from_f64(v).to_le_bytes()),
        DType::Bf16 => e[..2].copy_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
        _ => e.copy_from_slice(&(v as f32).to_le_bytes()),
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rectangles_follow_torchvisions_bounds_and_probability() {
        let e = Erasing {
            p: 0.5,
            scale: (0.02, 0.33),
            ratio: (0.3, 3.3),
            value: [0.0; 3],
        };
        let (h, w) = (224u32, 160u32);
        let mut hits = 0;
        let n = 10_000;
        for i in 0..n {
            let mut rng = SplitMix64::new(i);
            if let Some(r) = e.draw((h, w), &mut rng) {
                hits += 1;
                assert!(r.top + r.height <= h && r.left + r.width <= w, "{r:?}");
                let frac = f64::from(r.height * r.width) / f64::from(h * w);
                // Rounding to whole pixels moves the area a little.
                assert!((0.015..=0.34).contains(&frac), "{frac}");
            }
        }
        assert!((4700..=5300).contains(&hits), "{hits}");
    }

    #[test]
    fn the_rectangle_takes_the_value_in_every_layout_and_dtype() {
        let e = Erasing {
            p: 1.0,
            scale: (0.1, 0.1),
            ratio: (1.0, 1.0),
            value: [1.5, -2.0, 0.25],
        };
        let r = Rect {
            top: 1,
            left: 2,
            height: 2,
            width: 3,
        };
        let (h, w) = (4u32, 6u32);
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let mut out = vec![0u8; 3 * 4 * 6 * 4];
            e.apply(r, (h, w), layout, DType::F32, &mut out);
            let v: Vec<f32> = out
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            for y in 0..4usize {
                for x in 0..6usize {
                    for c in 0..3usize {
                        let at = match layout {
                            Layout::Nchw => c * 24 + y * 6 + x,
                            Layout::Nhwc => (y * 6 + x) * 3 + c,
                        };
                        let inside = (1..3).contains(&y) && (2..5).contains(&x);
                        let want = if inside { [1.5, -2.0, 0.25][c] } else { 0.0 };
                        assert_eq!(v[at], want, "{layout:?} y{y} x{x} c{c}");
                    }
                }
            }
        }
    }
}
