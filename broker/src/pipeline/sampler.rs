//! Which dataset indices an epoch visits, in which order, on this host.
//!
//! * ImageFolder (random access): a seeded permutation of all indices, new
//!   every epoch, the same on every run.
//! * Tar shards (sequential access): the shard order is permuted per epoch
//!   and samples pass through a bounded shuffle buffer, as WebDataset does.
//!   Reads stay nearly sequential (each read is within `buffer` samples of
//!   the stream position), at the price of a weaker shuffle: a sample can
//!   only move about `buffer` places from where its shard put it, so a small
//!   buffer with label-sorted shards gives label-correlated batches.
//! * Across hosts: the epoch's order is split exactly as PyTorch's
//!   `DistributedSampler` splits it: padded by repeating the start of the
//!   order (or truncated with `drop`) to a multiple of `world_size`, then
//!   every `world_size`-th index starting at `rank`.

use batchcast::synthetic::{SplitMix64, mix64};

/// How an uneven dataset is split across hosts (DistributedSampler's
/// `drop_last`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Uneven {
    /// Repeat samples from the start so every host gets the same number.
    #[default]
    Pad,
    /// Drop the tail so every host gets the same number.
    Drop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    pub rank: u64,
    pub world_size: u64,
    pub(crate) uneven: Uneven,
}

impl Split {
    /// Samples per epoch on each host (DistributedSampler's `num_samples`).
    pub(crate) fn per_rank(&self, len: u64) -> u64 {
        let w = self.world_size;
        if self.uneven == Uneven::Drop && !len.is_multiple_of(w) {
            (len - w).div_ceil(w)
        } else {
            len.div_ceil(w)
        }
    }

    /// This host's part of a whole-dataset order.
    pub fn apply(&self, order: Vec<u64>) -> Vec<u64> {
        let n = self.per_rank(order.len() as u64) as usize;
        let total = n * self.world_size as usize;
        let mut order = order;
        if order.len() < total {
            // Pad by repeating the order from its start, as often as needed.
            let base = order.clone();
            while order.len() < total {
                let need = total - order.len();
                order.extend_from_slice(&base[..need.min(base.len())]);
            }
        } else {
            order.truncate(total);
        }
        order
            .into_iter()
            .skip(self.rank as usize)
            .step_by(self.world_size as usize)
            .collect()
    }
}

fn epoch_rng(seed: u64, epoch: u64, salt: u64) -> SplitMix64 {
    SplitMix64::new(mix64(seed ^ mix64(epoch.wrapping_add(1)) ^ salt))
}

fn fisher_yates<T>(v: &mut [T], rng: &mut SplitMix64) {
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

/// The whole-dataset order of a random-access dataset for `epoch`.
pub(crate) fn permutation(len: u64, shuffle: bool, seed: u64, epoch: u64) -> Vec<u64> {
    let mut order: Vec<u64> = (0..len).collect();
    if shuffle {
        fisher_yates(&mut order, &mut epoch_rng(seed, epoch, 0));
    }
    order
}

/// The whole-dataset order of a sharded dataset for `epoch`: shards in a
/// permuted order, their samples through a shuffle buffer of `buffer`.
pub(crate) fn sharded(
    shards: &[std::ops::Range<usize>],
    shuffle: bool,
    buffer: usize,
    seed: u64,
    epoch: u64,
) -> Vec<u64> {
    let mut shard_order: Vec<usize> = (0..shards.len()).collect();
    let stream = |order: &[usize]| {
        order
            .iter()
            .flat_map(|&s| shards[s].clone())
            .map(|i| i as u64)
            .collect::<Vec<u64>>()
    };
    if !shuffle {
        return stream(&shard_order);
    }
    fisher_yates(&mut shard_order, &mut epoch_rng(seed, epoch, 1));
    let mut rng = epoch_rng(seed, epoch, 2);
    let buffer = buffer.max(1);
    let mut buf: Vec<u64> = Vec::with_capacity(buffer);
    let mut out = Vec::new();
    for i in stream(&shard_order) {
        if buf.len() < buffer {
            buf.push(i);
            continue;
        }
        let j = rng.below(buffer as u64) as usize;
        out.push(std::mem::replace(&mut buf[j], i));
    }
    fisher_yates(&mut buf, &mut rng);
    out.extend(buf);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DistributedSampler's split, written as its Python source reads.
    fn reference(len: usize, world: usize, rank: usize, drop: bool) -> Vec<u64> {
        let indices: Vec<u64> = (0..len as u64).collect();
        let num = if drop && !len.is_multiple_of(world) {
            (len - world).div_ceil(world)
        } else {
            len.div_ceil(world)
        };
        let total = num * world;
        let mut idx = indices.clone();
        if !drop {
            let padding = total - idx.len();
            if padding <= idx.len() {
                idx.extend_from_slice(&indices[..padding]);
            } else {
                let reps = padding.div_ceil(idx.len());
                let extra: Vec<u64> = (0..reps).flat_map(|_| indices.clone()).collect();
                idx.extend_from_slice(&extra[..padding]);
            }
        } else {
            idx.truncate(total);
        }
        idx.into_iter().skip(rank).step_by(world).collect()
    }

    #[test]
    fn splits_like_distributed_sampler() {
        for len in 1..40usize {
            for world in 1..9usize {
                for drop in [false, true] {
                    if drop && len < world {
                        continue; // DistributedSampler yields nothing there
                    }
                    let mut all = Vec::new();
                    for rank in 0..world {
                        let split = Split {
                            rank: rank as u64,
                            world_size: world as u64,
                            uneven: if drop { Uneven::Drop } else { Uneven::Pad },
                        };
                        let got = split.apply((0..len as u64).collect());
                        assert_eq!(
                            got,
                            reference(len, world, rank, drop),
                            "{len} {world} {rank} {drop}"
                        );
                        assert_eq!(got.len() as u64, split.per_rank(len as u64));
                        all.extend(got);
                    }
                    all.sort_unstable();
                    all.dedup();
                    if !drop {
                        assert_eq!(all.len(), len, "padding covers everything");
                    }
                }
            }
        }
    }

    #[test]
    fn permutations_are_seeded_and_new_each_epoch() {
        let a = permutation(1000, true, 7, 0);
        assert_eq!(a, permutation(1000, true, 7, 0));
        assert_ne!(a, permutation(1000, true, 7, 1));
        assert_ne!(a, permutation(1000, true, 8, 0));
        let mut s = a.clone();
        s.sort_unstable();
        assert_eq!(s, (0..1000).collect::<Vec<_>>());
        assert_eq!(permutation(5, false, 7, 3), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn the_shard_shuffle_visits_everything_and_moves_samples_locally() {
        let shards: Vec<_> = (0..10).map(|s| s * 100..(s + 1) * 100).collect();
        let o = sharded(&shards, true, 50, 3, 0);
        let mut s = o.clone();
        s.sort_unstable();
        assert_eq!(s, (0..1000).collect::<Vec<_>>());
        assert_ne!(o, sharded(&shards, true, 50, 3, 1));
        assert_eq!(o, sharded(&shards, true, 50, 3, 0));
        // Each output position reads from a shard that is at most a buffer
        // behind the stream: the first 50 outputs come from the first shard
        // read or the start of the second.
        let first_shard = o[0] / 100;
        assert!(o[..40].iter().all(|&i| i / 100 == first_shard));
        assert_eq!(
            sharded(&shards, false, 50, 3, 0),
            (0..1000).collect::<Vec<_>>()
        );
    }
}
