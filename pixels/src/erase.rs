//! `RandomErasing(p, scale, ratio, value)`: after the tensor is written
//! (it follows `Normalize` in a torchvision `Compose`), a random rectangle
//! of it is set to `value`, per channel, in the output's dtype, or with
//! `value = "random"` to normal noise, one draw per element, as
//! torchvision's `normal_()` (from the sample's own seeded generator, so the
//! same sample gets the same noise in every run).

use batchcast_core::DType;
use batchcast_core::synthetic::SplitMix64;

use crate::layout::Layout;
use crate::random::{round_half_even, uniform};

/// A `RandomErasing`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Erasing {
    pub p: f64,
    pub scale: (f64, f64),
    pub ratio: (f64, f64),
    pub value: EraseValue,
}

/// What an erased rectangle holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EraseValue {
    /// Per channel, in the tensor's units (after Normalize).
    Fixed([f64; 3]),
    /// A standard normal draw per element (float dtypes only).
    Normal,
}

/// A rectangle of the output: top, left, height, width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rect {
    pub top: u32,
    pub left: u32,
    pub height: u32,
    pub width: u32,
    /// Seeds the noise of [`EraseValue::Normal`] (0 otherwise).
    pub noise: u64,
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
            let noise = match self.value {
                EraseValue::Normal => rng.next_u64(),
                EraseValue::Fixed(_) => 0,
            };
            return Some(Rect {
                top,
                left,
                height: eh,
                width: ew,
                noise,
            });
        }
        None
    }

    /// Sets `r` of one sample's tensor (`h × w`, in `layout` and `dtype`)
    /// to the value.
    pub fn apply(&self, r: Rect, (h, w): (u32, u32), layout: Layout, dtype: DType, out: &mut [u8]) {
        let size = dtype.size() as usize;
        let (h, w) = (h as usize, w as usize);
        let mut normal = Normal::new(r.noise);
        let fixed = match self.value {
            EraseValue::Fixed(v) => Some(v.map(|x| encode(x, dtype))),
            EraseValue::Normal => None,
        };
        // Channel by channel, row by row, as `normal_()` fills `[c, h, w]`.
        for c in 0..3 {
            for y in r.top as usize..(r.top + r.height) as usize {
                for x in r.left as usize..(r.left + r.width) as usize {
                    let e = match &fixed {
                        Some(enc) => enc[c],
                        None => encode(normal.next(), dtype),
                    };
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

/// Standard normal draws (Marsaglia's polar method: two per accepted pair,
/// no trigonometry).
struct Normal {
    rng: SplitMix64,
    spare: Option<f64>,
}

impl Normal {
    fn new(seed: u64) -> Normal {
        Normal {
            rng: SplitMix64::new(seed),
            spare: None,
        }
    }

    fn next(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        loop {
            let u = uniform(&mut self.rng, -1.0, 1.0);
            let v = uniform(&mut self.rng, -1.0, 1.0);
            let s = u * u + v * v;
            if s > 0.0 && s < 1.0 {
                let k = (-2.0 * s.ln() / s).sqrt();
                self.spare = Some(v * k);
                return u * k;
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
            value: EraseValue::Fixed([0.0; 3]),
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
            value: EraseValue::Fixed([1.5, -2.0, 0.25]),
        };
        let r = Rect {
            top: 1,
            left: 2,
            height: 2,
            width: 3,
            noise: 0,
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

    #[test]
    fn random_values_are_standard_normal_inside_the_rectangle_and_reproducible() {
        let e = Erasing {
            p: 1.0,
            scale: (0.3, 0.3),
            ratio: (1.0, 1.0),
            value: EraseValue::Normal,
        };
        let (h, w) = (64u32, 48u32);
        let mut rng = SplitMix64::new(9);
        let r = e.draw((h, w), &mut rng).expect("p = 1 erases");
        assert_ne!(r.noise, 0);
        for dtype in [DType::F32, DType::F16, DType::Bf16] {
            let size = dtype.size() as usize;
            let run = |layout| {
                let mut out = vec![0u8; 3 * 64 * 48 * size];
                e.apply(r, (h, w), layout, dtype, &mut out);
                out
            };
            let (a, b) = (run(Layout::Nchw), run(Layout::Nchw));
            assert_eq!(a, b, "the same rectangle gets the same noise");
            let value = |at: usize| -> f64 {
                let x = &a[at * size..(at + 1) * size];
                match dtype {
                    DType::F32 => f64::from(f32::from_le_bytes(x.try_into().unwrap())),
                    DType::F16 => half::f16::from_le_bytes(x.try_into().unwrap()).to_f64(),
                    _ => half::bf16::from_le_bytes(x.try_into().unwrap()).to_f64(),
                }
            };
            let mut inside = Vec::new();
            for c in 0..3usize {
                for y in 0..64u32 {
                    for x in 0..48u32 {
                        let v = value(c * 64 * 48 + (y * 48 + x) as usize);
                        let is_in = (r.top..r.top + r.height).contains(&y)
                            && (r.left..r.left + r.width).contains(&x);
                        if is_in {
                            inside.push(v);
                        } else {
                            assert_eq!(v, 0.0, "outside the rectangle is untouched");
                        }
                    }
                }
            }
            let n = inside.len() as f64;
            assert!(n > 1500.0, "{n}");
            let mean = inside.iter().sum::<f64>() / n;
            let var = inside.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
            assert!(mean.abs() < 0.1, "{dtype:?} mean {mean}");
            assert!(
                (var.sqrt() - 1.0).abs() < 0.1,
                "{dtype:?} std {}",
                var.sqrt()
            );
            // Tails as a normal's: about 4.6 % beyond two standard deviations.
            let tails = inside.iter().filter(|v| v.abs() > 2.0).count() as f64 / n;
            assert!((0.03..0.065).contains(&tails), "{dtype:?} tails {tails}");
        }
    }
}
