//! Deterministic synthetic data: the stand-in source for tests, benchmarks
//! and the demo.
//!
//! Sample `i` of a synthetic stream has bytes that are a pure function of
//! `(seed, i, field)`, and epoch `e` visits the samples in a seeded
//! permutation, so any consumer can recompute what it should have received
//! and check it byte for byte ([`SyntheticSpec::verify_sample`]).

use serde::{Deserialize, Serialize};

/// How much of each sample the producer writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Fill {
    /// Every byte of every field: realistic memory traffic.
    #[default]
    Full,
    /// Only the first [`STAMP_BYTES`] bytes of each field of each sample: the
    /// hand-off is measured, not the filling.
    Stamp,
}

/// Bytes written per sample and field in [`Fill::Stamp`] mode.
pub const STAMP_BYTES: usize = 16;

/// Parameters of a synthetic source that a consumer needs to verify it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyntheticSpec {
    pub seed: u64,
    /// Samples in the dataset.
    pub len: u64,
    pub shuffle: bool,
    pub fill: Fill,
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finaliser: a fast, well-mixed bijection on u64.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A tiny splitmix64 generator for shuffles (not for cryptography).
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        mix64(self.0)
    }
    /// Uniform in `0..n` (Lemire's multiply-shift, bias below 2^-32 for the
    /// sizes used here).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

impl SyntheticSpec {
    /// Dataset indices in the order epoch `epoch` visits them: the identity
    /// without shuffling, else a Fisher-Yates permutation seeded by
    /// `(seed, epoch)`, new every epoch and the same on every run.
    pub fn epoch_order(&self, epoch: u64) -> Vec<u64> {
        let mut order: Vec<u64> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = SplitMix64::new(mix64(self.seed ^ mix64(epoch.wrapping_add(1))));
            for i in (1..order.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                order.swap(i, j);
            }
        }
        order
    }

    fn key(&self, index: u64, field: usize) -> u64 {
        mix64(self.seed ^ mix64(index.wrapping_mul(GOLDEN) ^ (field as u64).wrapping_add(1) << 48))
    }

    /// Writes sample `index` of field number `field` into `out` (its bytes
    /// for one sample), all of it or only the stamp, per `fill`. The
    /// broker's side; consumers check with [`verify_sample`](Self::verify_sample).
    pub fn fill_sample(&self, field: usize, index: u64, out: &mut [u8]) {
        let n = match self.fill {
            Fill::Full => out.len(),
            Fill::Stamp => out.len().min(STAMP_BYTES),
        };
        pattern(self.key(index, field), &mut out[..n]);
    }

    /// Whether `data` is what [`fill_sample`](Self::fill_sample) writes for
    /// `(field, index)`; only the stamp is compared in stamp mode.
    pub fn verify_sample(&self, field: usize, index: u64, data: &[u8]) -> bool {
        let n = match self.fill {
            Fill::Full => data.len(),
            Fill::Stamp => data.len().min(STAMP_BYTES),
        };
        let key = self.key(index, field);
        let mut chunks = data[..n].chunks_exact(8);
        let mut k = 0u64;
        for chunk in &mut chunks {
            if chunk != word(key, k).to_le_bytes() {
                return false;
            }
            k += 1;
        }
        let rest = chunks.remainder();
        rest == &word(key, k).to_le_bytes()[..rest.len()]
    }
}

#[inline]
fn word(key: u64, k: u64) -> u64 {
    mix64(key.wrapping_add(k.wrapping_mul(GOLDEN)))
}

fn pattern(key: u64, out: &mut [u8]) {
    let mut chunks = out.chunks_exact_mut(8);
    let mut k = 0u64;
    for chunk in &mut chunks {
        chunk.copy_from_slice(&word(key, k).to_le_bytes());
        k += 1;
    }
    let rest = chunks.into_remainder();
    let n = rest.len();
    rest.copy_from_slice(&word(key, k).to_le_bytes()[..n]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(shuffle: bool, fill: Fill) -> SyntheticSpec {
        SyntheticSpec {
            seed: 7,
            len: 1000,
            shuffle,
            fill,
        }
    }

    #[test]
    fn orders_are_permutations_new_each_epoch_and_reproducible() {
        let s = spec(true, Fill::Full);
        let e0 = s.epoch_order(0);
        let e1 = s.epoch_order(1);
        assert_ne!(e0, e1);
        assert_eq!(e0, s.epoch_order(0));
        let mut sorted = e1.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_eq!(
            spec(false, Fill::Full).epoch_order(3),
            (0..1000).collect::<Vec<_>>()
        );
    }

    #[test]
    fn stamp_fill_touches_only_the_stamp() {
        let s = spec(false, Fill::Stamp);
        let mut buf = vec![0xAAu8; 64];
        s.fill_sample(0, 5, &mut buf);
        assert!(buf[STAMP_BYTES..].iter().all(|&b| b == 0xAA));
        assert!(s.verify_sample(0, 5, &buf));
        assert!(!s.verify_sample(0, 6, &buf));
    }

    proptest! {
        #[test]
        fn full_fill_verifies_and_detects_any_flipped_byte(
            len in 1usize..200, index in 0u64..1_000_000, field in 0usize..4, flip in any::<prop::sample::Index>()
        ) {
            let s = spec(true, Fill::Full);
            let mut buf = vec![0u8; len];
            s.fill_sample(field, index, &mut buf);
            prop_assert!(s.verify_sample(field, index, &buf));
            let i = flip.index(len);
            buf[i] ^= 1;
            prop_assert!(!s.verify_sample(field, index, &buf));
        }
    }
}
