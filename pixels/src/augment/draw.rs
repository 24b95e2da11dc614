//! Drawing an augmentation's ops for one image: torchvision's op spaces,
//! magnitude bins, probabilities and orders, with the sample's generator.

use batchcast_core::synthetic::SplitMix64;

use super::Op;
use crate::random::uniform;

/// An augmentation of a transform, in the order they run: after the crop
/// and the horizontal flip, before the conversion to a tensor.
#[derive(Debug, Clone, PartialEq)]
pub enum Augment {
    /// `RandomVerticalFlip(p)`.
    VerticalFlip(f64),
    /// `RandomApply([ColorJitter(brightness, contrast, saturation, hue)],
    /// p)`: each a range `[lo, hi]` (a factor; for hue a shift in
    /// `[-0.5, 0.5]`), or `None`; applied in a random order.
    ColorJitter {
        p: f64,
        ranges: [Option<(f64, f64)>; 4],
    },
    /// `RandomGrayscale(p)`.
    Grayscale(f64),
    /// `RandomApply([GaussianBlur(kernel, sigma)], p)`.
    GaussianBlur {
        p: f64,
        kernel: (u16, u16),
        sigma: (f64, f64),
    },
    /// `TrivialAugmentWide(num_magnitude_bins)`.
    TrivialAugmentWide { bins: u32 },
    /// `RandAugment(num_ops, magnitude, num_magnitude_bins)`.
    RandAugment {
        num_ops: u32,
        magnitude: u32,
        bins: u32,
    },
    /// `AutoAugment(AutoAugmentPolicy.IMAGENET)`.
    AutoAugmentImageNet,
}

/// `torch.linspace(lo, hi, n)[k]` (float32, as torch computes it).
pub(super) fn linspace(lo: f64, hi: f64, n: u32, k: u32) -> f64 {
    if n <= 1 {
        return lo as f32 as f64;
    }
    let (lo32, hi32) = (lo as f32, hi as f32);
    let step = (hi32 - lo32) / (n - 1) as f32;
    let v = if k < n / 2 {
        lo32 + step * k as f32
    } else {
        hi32 - step * (n - 1 - k) as f32
    };
    v as f64
}

/// The op space of the automatic augmentations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Identity,
    ShearX,
    ShearY,
    TranslateX,
    TranslateY,
    Rotate,
    Brightness,
    Color,
    Contrast,
    Sharpness,
    Posterize,
    Solarize,
    AutoContrast,
    Equalize,
    Invert,
}

/// TrivialAugmentWide's and RandAugment's ops, in torchvision's order.
const SPACE: [Kind; 14] = [
    Kind::Identity,
    Kind::ShearX,
    Kind::ShearY,
    Kind::TranslateX,
    Kind::TranslateY,
    Kind::Rotate,
    Kind::Brightness,
    Kind::Color,
    Kind::Contrast,
    Kind::Sharpness,
    Kind::Posterize,
    Kind::Solarize,
    Kind::AutoContrast,
    Kind::Equalize,
];

/// Which magnitude ranges: TrivialAugmentWide's, or RandAugment's and
/// AutoAugment's (which scale translations with the image).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Space {
    Wide,
    Standard,
}

impl Kind {
    /// Magnitude of bin `k` of `bins`, and whether it takes a random sign;
    /// `None`: the op has no magnitude.
    fn magnitude(self, space: Space, bins: u32, k: u32, (w, h): (u32, u32)) -> Option<(f64, bool)> {
        let wide = space == Space::Wide;
        let lin = |hi: f64| linspace(0.0, hi, bins, k);
        Some(match self {
            Kind::ShearX | Kind::ShearY => (lin(if wide { 0.99 } else { 0.3 }), true),
            Kind::TranslateX => (
                lin(if wide { 32.0 } else { 150.0 / 331.0 * w as f64 }),
                true,
            ),
            Kind::TranslateY => (
                lin(if wide { 32.0 } else { 150.0 / 331.0 * h as f64 }),
                true,
            ),
            Kind::Rotate => (lin(if wide { 135.0 } else { 30.0 }), true),
            Kind::Brightness | Kind::Color | Kind::Contrast | Kind::Sharpness => {
                (lin(if wide { 0.99 } else { 0.9 }), true)
            }
            Kind::Posterize => {
                let per = (bins.max(2) - 1) as f64 / if wide { 6.0 } else { 4.0 };
                ((8.0 - (k as f64 / per).round_ties_even()).max(1.0), false)
            }
            Kind::Solarize => (linspace(255.0, 0.0, bins, k), false),
            Kind::Identity | Kind::AutoContrast | Kind::Equalize | Kind::Invert => return None,
        })
    }

    fn op(self, m: f64) -> Op {
        match self {
            Kind::Identity => Op::Identity,
            Kind::ShearX => Op::ShearX(m),
            Kind::ShearY => Op::ShearY(m),
            Kind::TranslateX => Op::TranslateX(m),
            Kind::TranslateY => Op::TranslateY(m),
            Kind::Rotate => Op::Rotate(m),
            Kind::Brightness => Op::Brightness(1.0 + m),
            Kind::Color => Op::Color(1.0 + m),
            Kind::Contrast => Op::Contrast(1.0 + m),
            Kind::Sharpness => Op::Sharpness(1.0 + m),
            Kind::Posterize => Op::Posterize(m as u8),
            Kind::Solarize => Op::Solarize(m),
            Kind::AutoContrast => Op::AutoContrast,
            Kind::Equalize => Op::Equalize,
            Kind::Invert => Op::Invert,
        }
    }
}

/// AutoAugment's ImageNet policy: pairs of (op, probability, magnitude bin).
#[rustfmt::skip]
const IMAGENET_POLICY: [[(Kind, f64, u32); 2]; 25] = {
    use Kind::*;
    [
        [(Posterize, 0.4, 8), (Rotate, 0.6, 9)],
        [(Solarize, 0.6, 5), (AutoContrast, 0.6, 0)],
        [(Equalize, 0.8, 0), (Equalize, 0.6, 0)],
        [(Posterize, 0.6, 7), (Posterize, 0.6, 6)],
        [(Equalize, 0.4, 0), (Solarize, 0.2, 4)],
        [(Equalize, 0.4, 0), (Rotate, 0.8, 8)],
        [(Solarize, 0.6, 3), (Equalize, 0.6, 0)],
        [(Posterize, 0.8, 5), (Equalize, 1.0, 0)],
        [(Rotate, 0.2, 3), (Solarize, 0.6, 8)],
        [(Equalize, 0.6, 0), (Posterize, 0.4, 6)],
        [(Rotate, 0.8, 8), (Color, 0.4, 0)],
        [(Rotate, 0.4, 9), (Equalize, 0.6, 0)],
        [(Equalize, 0.0, 0), (Equalize, 0.8, 0)],
        [(Invert, 0.6, 0), (Equalize, 1.0, 0)],
        [(Color, 0.6, 4), (Contrast, 1.0, 8)],
        [(Rotate, 0.8, 8), (Color, 1.0, 2)],
        [(Color, 0.8, 8), (Solarize, 0.8, 7)],
        [(Sharpness, 0.4, 7), (Invert, 0.6, 0)],
        [(ShearX, 0.6, 5), (Equalize, 1.0, 0)],
        [(Color, 0.4, 0), (Equalize, 0.6, 0)],
        [(Equalize, 0.4, 0), (Solarize, 0.2, 4)],
        [(Solarize, 0.6, 5), (AutoContrast, 0.6, 0)],
        [(Invert, 0.6, 0), (Equalize, 1.0, 0)],
        [(Color, 0.6, 4), (Contrast, 1.0, 8)],
        [(Equalize, 0.8, 0), (Equalize, 0.6, 0)],
    ]
};

impl Augment {
    /// Draws this augmentation's ops for one image of `size` (width,
    /// height), appending them to `ops` in the order they apply.
    pub fn draw(&self, size: (u32, u32), rng: &mut SplitMix64, ops: &mut Vec<Op>) {
        match *self {
            Augment::VerticalFlip(p) => {
                if p > 0.0 && uniform(rng, 0.0, 1.0) < p {
                    ops.push(Op::VerticalFlip);
                }
            }
            Augment::Grayscale(p) => {
                if p > 0.0 && uniform(rng, 0.0, 1.0) < p {
                    ops.push(Op::Grayscale);
                }
            }
            Augment::ColorJitter { p, ranges } => {
                // RandomApply draws first (only when it is not certain).
                if p < 1.0 && uniform(rng, 0.0, 1.0) >= p {
                    return;
                }
                // get_params: a permutation, then each factor in turn.
                let mut order = [0usize, 1, 2, 3];
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i as u64 + 1) as usize);
                }
                let factors = ranges.map(|r| r.map(|(lo, hi)| uniform(rng, lo, hi)));
                for k in order {
                    if let Some(f) = factors[k] {
                        ops.push([Op::Brightness(f), Op::Contrast(f), Op::Color(f), Op::Hue(f)][k]);
                    }
                }
            }
            Augment::GaussianBlur { p, kernel, sigma } => {
                if p < 1.0 && uniform(rng, 0.0, 1.0) >= p {
                    return;
                }
                let s = uniform(rng, sigma.0, sigma.1);
                ops.push(Op::Blur(kernel.0, kernel.1, s));
            }
            Augment::TrivialAugmentWide { bins } => {
                let kind = SPACE[rng.below(SPACE.len() as u64) as usize];
                let k = rng.below(u64::from(bins.max(1))) as u32;
                ops.push(signed(
                    kind,
                    kind.magnitude(Space::Wide, bins, k, size),
                    rng,
                ));
            }
            Augment::RandAugment {
                num_ops,
                magnitude,
                bins,
            } => {
                for _ in 0..num_ops {
                    let kind = SPACE[rng.below(SPACE.len() as u64) as usize];
                    let m = kind.magnitude(Space::Standard, bins, magnitude, size);
                    ops.push(signed(kind, m, rng));
                }
            }
            Augment::AutoAugmentImageNet => {
                let policy = IMAGENET_POLICY[rng.below(IMAGENET_POLICY.len() as u64) as usize];
                let probs = [uniform(rng, 0.0, 1.0), uniform(rng, 0.0, 1.0)];
                let signs = [rng.below(2), rng.below(2)];
                for (i, (kind, p, bin)) in policy.into_iter().enumerate() {
                    if probs[i] <= p {
                        let m = match kind.magnitude(Space::Standard, 10, bin, size) {
                            Some((m, true)) if signs[i] == 0 => -m,
                            Some((m, _)) => m,
                            None => 0.0,
                        };
                        ops.push(kind.op(m));
                    }
                }
            }
        }
    }
}

/// The op with its magnitude, negated half the time if it is signed.
fn signed(kind: Kind, m: Option<(f64, bool)>, rng: &mut SplitMix64) -> Op {
    let m = match m {
        Some((m, true)) if rng.below(2) == 1 => -m,
        Some((m, _)) => m,
        None => 0.0,
    };
    kind.op(m)
}
