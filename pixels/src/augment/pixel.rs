//! Pixel arithmetic the ops share, as Pillow and torchvision compute it:
//! rounding, blending, HSV, kernels, reflection, matrices.

use super::draw::linspace;

/// `floor` as an integer without a libm call (baseline x86-64 has no
/// rounding instruction): truncation, one lower for negative fractions.
pub(super) fn floor(v: f64) -> i64 {
    let t = v as i64;
    t - i64::from((t as f64) > v)
}

/// The matrix `F.affine(angle = 0, translate = [0, 0], scale = 1, shear =
/// [degrees(atan(mx)), degrees(atan(my))], center = [0, 0])` hands Pillow:
/// torchvision's `_get_inverse_affine_matrix`, in its order of operations
/// (the smooth filters see its last bits, which `tan(atan(m))` changes).
pub(super) fn shear_matrix(mx: f64, my: f64) -> [f64; 6] {
    use std::f64::consts::PI;
    let radians = |deg: f64| deg * (PI / 180.0);
    let degrees = |rad: f64| rad * (180.0 / PI);
    let (sx, sy) = (radians(degrees(mx.atan())), radians(degrees(my.atan())));
    let rot = 0.0f64;
    let a = (rot - sy).cos() / sy.cos();
    let b = -(rot - sy).cos() * sx.tan() / sy.cos() - rot.sin();
    let c = (rot - sy).sin() / sy.cos();
    let d = -(rot - sy).sin() * sx.tan() / sy.cos() + rot.cos();
    // Centre and translation are zero: the offsets stay 0.
    [d, -b, 0.0, -c, a, 0.0]
}

/// Pillow's transform bicubic (a = -1) through four values at `d` past
/// the second.
pub(super) fn cubic(v1: f64, v2: f64, v3: f64, v4: f64, d: f64) -> f64 {
    let p1 = v2;
    let p2 = -v1 + v3;
    let p3 = 2.0 * (v1 - v2) + v3 - v4;
    let p4 = -v1 + v2 - v3 + v4;
    p1 + d * (p2 + d * (p3 + d * p4))
}

/// The `x` in `0..n` with `0 <= start + x · step < end`, as a range.
pub(super) fn inside(start: i64, step: i64, end: i64, n: i64) -> (i64, i64) {
    // Smallest x with start + x·step >= v (step > 0), by exact division.
    let first_at_least =
        |v: i64| (v - start).div_euclid(step) + i64::from((v - start).rem_euclid(step) != 0);
    let (lo, hi) = match step.signum() {
        0 => match (0..end).contains(&start) {
            true => (0, n),
            false => (0, 0),
        },
        1 => (first_at_least(0), first_at_least(end)),
        _ => {
            // start + x·step >= 0 ⟺ x <= start / −step; < end ⟺ x > (start − end) / −step.
            let s = -step;
            let last = start.div_euclid(s);
            let first = (start - end).div_euclid(s) + 1;
            (first, last + 1)
        }
    };
    (lo.clamp(0, n), hi.clamp(0, n))
}

/// torchvision's `_get_gaussian_kernel1d`, in float32.
pub(super) fn gaussian_kernel(size: u16, sigma: f64) -> Vec<f32> {
    let half = (f64::from(size) - 1.0) * 0.5;
    let sigma = sigma as f32;
    let pdf: Vec<f32> = (0..u32::from(size))
        .map(|k| {
            let x = linspace(-half, half, u32::from(size), k) as f32;
            (-0.5 * (x / sigma).powi(2)).exp()
        })
        .collect();
    let sum: f32 = pdf.iter().sum();
    pdf.iter().map(|p| p / sum).collect()
}

/// Reflect padding's index (`-1` is `1`), for any distance.
pub(super) fn reflect(i: i64, n: usize) -> usize {
    let n = n as i64;
    if n == 1 {
        return 0;
    }
    let period = 2 * (n - 1);
    let m = i.rem_euclid(period);
    (if m < n { m } else { period - m }) as usize
}

/// Pillow's RGB → HSV (`Convert.c`, after Python's `colorsys`): floats,
/// each byte truncated.
pub(super) fn rgb_to_hsv([r, g, b]: [u8; 3]) -> [u8; 3] {
    let maxc = r.max(g).max(b);
    let minc = r.min(g).min(b);
    if maxc == minc {
        return [0, 0, maxc];
    }
    let cr = f32::from(maxc - minc);
    let s = cr / f32::from(maxc);
    let rc = f32::from(maxc - r) / cr;
    let gc = f32::from(maxc - g) / cr;
    let bc = f32::from(maxc - b) / cr;
    // `2.0 + rc - bc` is double arithmetic in C (a double literal).
    let h = if r == maxc {
        bc - gc
    } else if g == maxc {
        (2.0 + f64::from(rc) - f64::from(bc)) as f32
    } else {
        (4.0 + f64::from(gc) - f64::from(rc)) as f32
    };
    // In double, as C promotes `h / 6.0 + 1.0`; stored back in a float.
    let h = ((f64::from(h) / 6.0 + 1.0) % 1.0) as f32;
    let clip = |x: f32| (f64::from(x) * 255.0).clamp(0.0, 255.0) as i64 as u8;
    [clip(h), clip(s), maxc]
}

/// Pillow's HSV → RGB (`Convert.c`).
pub(super) fn hsv_to_rgb([h, s, v]: [u8; 3]) -> [u8; 3] {
    if s == 0 {
        return [v, v, v];
    }
    let h6 = f64::from(h) * 6.0 / 255.0;
    let i = h6.floor() as i64;
    let f = (h6 - i as f64) as f32;
    let fs = (f64::from(s) / 255.0) as f32;
    let vf = f64::from(v);
    let round = |x: f64| x.round().clamp(0.0, 255.0) as u8;
    let p = round(vf * (1.0 - f64::from(fs)));
    // `fs * f` multiplies two floats (in float), the rest is double.
    let q = round(vf * (1.0 - f64::from(fs * f)));
    let t = round(vf * (1.0 - f64::from(fs) * (1.0 - f64::from(f))));
    match i % 6 {
        0 => [v, t, p],
        1 => [q, v, p],
        2 => [p, v, t],
        3 => [p, q, v],
        4 => [t, p, v],
        _ => [v, p, q],
    }
}

/// Pillow's RGB → L: `(R·19595 + G·38470 + B·7471 + 0x8000) >> 16`.
pub fn luma(px: &[u8]) -> u8 {
    ((u32::from(px[0]) * 19595 + u32::from(px[1]) * 38470 + u32::from(px[2]) * 7471 + 0x8000) >> 16)
        as u8
}

/// `Image.blend` of one value: `in1 + alpha · (in2 − in1)` in 32-bit
/// float, truncated. Pillow clips only when extrapolating (`alpha`
/// outside `[0, 1]`); inside, the result is already within 0..=255, so
/// clamping and truncating is what both of its cases do.
pub(super) fn blend(in1: f32, in2: u8, alpha: f32) -> u8 {
    (in1 + alpha * (f32::from(in2) - in1)).clamp(0.0, 255.0) as u8
}

/// A SMOOTH sum (weights total 13) back to a pixel, as Pillow's 3×3
/// filter rounds it.
pub(super) fn smooth_round(sum: u32) -> u8 {
    ((sum as f32 / 13.0) + 0.5).min(255.0) as u8
}

/// One pass of a separable filter over a `w × h` RGB image: each value
/// written is `kernel` applied along x (`ALONG_X`) or y to the values
/// `read` gives (index `(y·w + x)·3 + channel`), the image's edge
/// reflected. The direction is a constant, so the per-tap index needs no
/// branch.
pub(super) fn convolve<const ALONG_X: bool>(
    (w, h): (usize, usize),
    kernel: &[f32],
    read: impl Fn(usize) -> f32,
    mut write: impl FnMut(usize, f32),
) {
    let half = (kernel.len() / 2) as i64;
    for y in 0..h {
        for x in 0..w {
            for c in 0..3 {
                let mut acc = 0f32;
                for (k, &wt) in kernel.iter().enumerate() {
                    let at = if ALONG_X {
                        y * w + reflect(x as i64 + k as i64 - half, w)
                    } else {
                        reflect(y as i64 + k as i64 - half, h) * w + x
                    };
                    acc += wt * read(at * 3 + c);
                }
                write((y * w + x) * 3 + c, acc);
            }
        }
    }
}
