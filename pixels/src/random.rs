//! The draws of a sample's plan: what transform, augment and erase share
//! (below all three, so none imports another for them).

use batchcast_core::synthetic::SplitMix64;

/// Uniform in `[lo, hi)`: every random draw of a sample's plan (crop,
/// flips, augmentations, erasing).
pub fn uniform(rng: &mut SplitMix64, lo: f64, hi: f64) -> f64 {
    let u = (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
    lo + (hi - lo) * u
}

/// Python's `round`: halves go to the even neighbour.
pub fn round_half_even(x: f64) -> f64 {
    x.round_ties_even()
}
