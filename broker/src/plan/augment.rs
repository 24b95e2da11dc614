//! Planning a transform's augmentations: torchvision's parameters,
//! checked, in the order they apply.

use super::{StreamError, key};
use batchcast::DType;

use crate::config::{
    AutoAugmentConfig, AutoAugmentSwitch, ErasingValue, GaussianBlurConfig, Jitter, PadFill,
    RandAugmentConfig, Size, TransformConfig,
};
use crate::pipeline::augment::{Augment, Resample};
use crate::pipeline::erase::{EraseValue, Erasing};

/// Most magnitude bins an automatic augmentation may have.
pub(crate) const MAX_BINS: u32 = 1024;
/// Most ops RandAugment may chain.
pub(crate) const MAX_RAND_OPS: u32 = 16;
/// Largest Gaussian blur kernel side.
pub(crate) const MAX_KERNEL: u32 = 255;

fn probability(name: &'static str, p: f64) -> Result<f64, StreamError> {
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        Err(key(
            name,
            format!("{name} = {p} is a probability; use 0..1"),
        ))
    }
}

/// A `ColorJitter` amount as a factor range, as torchvision's
/// `_check_input` makes it (`None`: that part is off).
fn jitter(name: &'static str, j: Option<Jitter>) -> Result<Option<(f64, f64)>, StreamError> {
    let (lo, hi) = match j {
        None => return Ok(None),
        Some(Jitter::Amount(x)) if x.is_finite() && x >= 0.0 => ((1.0 - x).max(0.0), 1.0 + x),
        Some(Jitter::Range([lo, hi]))
            if lo.is_finite() && hi.is_finite() && 0.0 <= lo && lo <= hi =>
        {
            (lo, hi)
        }
        Some(_) => {
            return Err(key(
                name,
                format!(
                    "{name} must be a non-negative amount or a range [lo, hi] with 0 <= lo <= hi"
                ),
            ));
        }
    };
    // torchvision leaves out a jitter that can only give 1.
    Ok((lo, hi).ne(&(1.0, 1.0)).then_some((lo, hi)))
}

/// `ColorJitter`'s hue: `h` is `[-h, h]`; within `[-0.5, 0.5]`.
fn hue(j: Option<Jitter>) -> Result<Option<(f64, f64)>, StreamError> {
    let name = "transform.color_jitter.hue";
    let ok = |x: f64| (-0.5..=0.5).contains(&x);
    let (lo, hi) = match j {
        None => return Ok(None),
        Some(Jitter::Amount(h)) if (0.0..=0.5).contains(&h) => (-h, h),
        Some(Jitter::Range([lo, hi])) if ok(lo) && ok(hi) && lo <= hi => (lo, hi),
        Some(_) => {
            return Err(key(
                name,
                format!("{name} must be an amount in 0..0.5 or a range [lo, hi] within -0.5..0.5"),
            ));
        }
    };
    Ok((lo, hi).ne(&(0.0, 0.0)).then_some((lo, hi)))
}

fn bins(name: &'static str, n: u32) -> Result<u32, StreamError> {
    if (2..=MAX_BINS).contains(&n) {
        Ok(n)
    } else {
        Err(key(
            name,
            format!("{name} = {n} must be between 2 and {MAX_BINS}"),
        ))
    }
}

/// The transform's augmentations, in the order they apply: vertical flip,
/// color jitter, grayscale, Gaussian blur, then at most one of
/// TrivialAugmentWide, RandAugment and AutoAugment.
pub(super) fn augments_of(t: &TransformConfig) -> Result<Vec<Augment>, StreamError> {
    let mut out = Vec::new();
    if probability("transform.vertical_flip", t.vertical_flip)? > 0.0 {
        out.push(Augment::VerticalFlip(t.vertical_flip));
    }
    if let Some(cj) = &t.color_jitter {
        let ranges = [
            jitter("transform.color_jitter.brightness", cj.brightness)?,
            jitter("transform.color_jitter.contrast", cj.contrast)?,
            jitter("transform.color_jitter.saturation", cj.saturation)?,
            hue(cj.hue)?,
        ];
        let p = probability("transform.color_jitter.p", cj.p)?;
        if ranges.iter().any(Option::is_some) && p > 0.0 {
            out.push(Augment::ColorJitter { p, ranges });
        }
    }
    if probability("transform.grayscale", t.grayscale)? > 0.0 {
        out.push(Augment::Grayscale(t.grayscale));
    }
    if let Some(g) = &t.gaussian_blur {
        out.extend(gaussian_blur(g)?);
    }
    let mut auto = Vec::new();
    match t.trivial_augment_wide {
        None | Some(AutoAugmentSwitch::On(false)) => {}
        Some(AutoAugmentSwitch::On(true)) => auto.push(Augment::TrivialAugmentWide { bins: 31 }),
        Some(AutoAugmentSwitch::Table(ta)) => auto.push(Augment::TrivialAugmentWide {
            bins: bins(
                "transform.trivial_augment_wide.num_magnitude_bins",
                ta.num_magnitude_bins,
            )?,
        }),
    }
    if let Some(r) = &t.rand_augment {
        auto.push(rand_augment(r)?);
    }
    let policy = match &t.auto_augment {
        None => None,
        Some(AutoAugmentConfig::Policy(p)) => Some(p),
        Some(AutoAugmentConfig::Table(a)) => Some(&a.policy),
    };
    match policy.map(String::as_str) {
        None => {}
        Some("imagenet" | "IMAGENET") => auto.push(Augment::AutoAugmentImageNet),
        Some(other) => {
            return Err(key(
                "transform.auto_augment",
                format!(
                    "transform.auto_augment = \"{other}\" is not a policy here; use \"imagenet\" (the CIFAR-10 and SVHN policies are for 32×32 images)"
                ),
            ));
        }
    }
    if auto.len() > 1 {
        return Err(key(
            "transform",
            "use at most one of trivial_augment_wide, rand_augment and auto_augment",
        ));
    }
    out.extend(auto);
    Ok(out)
}

/// `RandAugment(num_ops, magnitude, num_magnitude_bins)`: a magnitude
/// below the bins, at most `MAX_RAND_OPS` ops.
fn rand_augment(r: &RandAugmentConfig) -> Result<Augment, StreamError> {
    let bins = bins(
        "transform.rand_augment.num_magnitude_bins",
        r.num_magnitude_bins,
    )?;
    if r.magnitude >= bins {
        return Err(key(
            "transform.rand_augment.magnitude",
            format!(
                "transform.rand_augment.magnitude = {} must be below num_magnitude_bins = {bins}",
                r.magnitude
            ),
        ));
    }
    if r.num_ops > MAX_RAND_OPS {
        return Err(key(
            "transform.rand_augment.num_ops",
            format!(
                "transform.rand_augment.num_ops = {} is more than {MAX_RAND_OPS}",
                r.num_ops
            ),
        ));
    }
    Ok(Augment::RandAugment {
        num_ops: r.num_ops,
        magnitude: r.magnitude,
        bins,
    })
}

/// `RandomApply([GaussianBlur(kernel_size, sigma)], p)`: odd kernel sides
/// up to `MAX_KERNEL`, `0 < sigma_lo <= sigma_hi`.
fn gaussian_blur(g: &GaussianBlurConfig) -> Result<Option<Augment>, StreamError> {
    let p = probability("transform.gaussian_blur.p", g.p)?;
    let (kx, ky) = match g.kernel_size {
        Size::Square(k) => (k, k),
        // torchvision's kernel_size is (x, y), unlike its sizes.
        Size::HeightWidth([x, y]) => (x, y),
    };
    if [kx, ky].iter().any(|&k| k % 2 == 0 || k > MAX_KERNEL) {
        return Err(key(
            "transform.gaussian_blur.kernel_size",
            format!(
                "transform.gaussian_blur.kernel_size = {kx}×{ky} must be odd and at most {MAX_KERNEL}"
            ),
        ));
    }
    let (s0, s1) = match g.sigma {
        Jitter::Amount(s) => (s, s),
        Jitter::Range([a, b]) => (a, b),
    };
    if !(s0 > 0.0 && s0 <= s1 && s1.is_finite()) {
        return Err(key(
            "transform.gaussian_blur.sigma",
            format!("transform.gaussian_blur.sigma = [{s0}, {s1}] must be 0 < lo <= hi"),
        ));
    }
    Ok((p > 0.0).then_some(Augment::GaussianBlur {
        p,
        kernel: (kx as u16, ky as u16),
        sigma: (s0, s1),
    }))
}

/// `RandomErasing`, checked as torchvision checks it; on a u8 tensor the
/// value must be a whole number in 0..=255.
pub(super) fn erasing_of(t: &TransformConfig) -> Result<Option<Erasing>, StreamError> {
    let Some(e) = &t.random_erasing else {
        return Ok(None);
    };
    let p = probability("transform.random_erasing.p", e.p)?;
    let [s0, s1] = e.scale;
    if !(0.0 <= s0 && s0 <= s1 && s1 <= 1.0) {
        return Err(key(
            "transform.random_erasing.scale",
            format!(
                "transform.random_erasing.scale = {:?} must be 0 <= lo <= hi <= 1",
                e.scale
            ),
        ));
    }
    let [r0, r1] = e.ratio;
    if !(r0 > 0.0 && r0 <= r1 && r1.is_finite()) {
        return Err(key(
            "transform.random_erasing.ratio",
            format!(
                "transform.random_erasing.ratio = {:?} must be 0 < lo <= hi",
                e.ratio
            ),
        ));
    }
    let value = match &e.value {
        ErasingValue::One(v) => [*v; 3],
        ErasingValue::PerChannel(v) => *v,
        ErasingValue::Named(n) if n == "random" && t.dtype == DType::U8 => {
            return Err(key(
                "transform.random_erasing.value",
                "transform.random_erasing.value = \"random\" draws normal noise in the tensor's units, which a u8 tensor cannot hold; use a float dtype, or a number or [r, g, b]",
            ));
        }
        ErasingValue::Named(n) if n == "random" => {
            return Ok(Some(Erasing {
                p,
                scale: (s0, s1),
                ratio: (r0, r1),
                value: EraseValue::Normal,
            }));
        }
        ErasingValue::Named(n) => {
            return Err(key(
                "transform.random_erasing.value",
                format!(
                    "transform.random_erasing.value = \"{n}\" is not a value; use a number, [r, g, b] or \"random\""
                ),
            ));
        }
    };
    let whole = |v: f64| v.fract() == 0.0 && (0.0..=255.0).contains(&v);
    if value.iter().any(|v| !v.is_finite())
        || (t.dtype == DType::U8 && !value.iter().all(|&v| whole(v)))
    {
        return Err(key(
            "transform.random_erasing.value",
            format!(
                "transform.random_erasing.value = {value:?} must be finite (whole numbers in 0..255 for a u8 tensor)"
            ),
        ));
    }
    Ok(Some(Erasing {
        p,
        scale: (s0, s1),
        ratio: (r0, r1),
        value: EraseValue::Fixed(value),
    }))
}

/// The geometric ops' `interpolation` and `fill`, from whichever automatic
/// augmentation the transform has (at most one; the default otherwise).
pub(super) fn resample_of(t: &TransformConfig) -> Resample {
    let (filter, fill) = match (&t.trivial_augment_wide, &t.rand_augment, &t.auto_augment) {
        (Some(AutoAugmentSwitch::Table(a)), _, _) => (a.interpolation, a.fill),
        (_, Some(r), _) => (r.interpolation, r.fill),
        (_, _, Some(AutoAugmentConfig::Table(a))) => (a.interpolation, a.fill),
        _ => return Resample::default(),
    };
    Resample {
        filter,
        fill: fill.map(PadFill::rgb).unwrap_or_default(),
    }
}
