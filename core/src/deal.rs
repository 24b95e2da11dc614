//! How a group of consumers splits each epoch among its ranks, as plain
//! logic (no I/O): the members of a data-parallel trial read one stream
//! together, each its own share, with the same number of batches per
//! epoch so that no rank waits for another's batch in a collective.
//!
//! Every member receives every unit of the stream (zero-copy, as any
//! consumer) and keeps only its own runs; the others' samples it gives
//! back unread. The deal is a function of the epoch's length `n`, the
//! group's batch size `b`, its data ranks `d` (= world / replicate) and
//! `drop_last`, so every member computes the same one alone.
//!
//! # Rules
//!
//! * An epoch's samples (the stream's order) are dealt in rounds of `d`
//!   batches of `b` consecutive samples: batch `k` of the epoch goes to
//!   data rank `k mod d`. A member's batches are contiguous runs: views
//!   into the ring, never gathered.
//! * The tail (the `m < d·b` samples after the last full round):
//!   with `drop_last` it is dropped (every rank gets `⌊n / (d·b)⌋` full
//!   batches); without it, it is split into `d` contiguous parts whose
//!   sizes differ by at most one, one last batch for each rank; when
//!   `m < d`, data rank `p` gets tail sample `p mod m` (some samples are
//!   seen twice, as `DistributedSampler` pads by repeating samples).
//!   So every rank gets the same number of batches each epoch.
//! * With `replicate = k`, ranks `r` and `r'` with `r / k == r' / k` get
//!   the same batches (tensor- or sequence-parallel peers).
//! * Other consumers of the stream, and other groups, are not affected.

use crate::proto::Position;

/// A consumer's place in a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deal {
    /// Samples in an epoch.
    pub n: u64,
    /// The group's batch size.
    pub b: u64,
    /// Data ranks: world / replicate.
    pub d: u64,
    /// This member's data rank: rank / replicate.
    pub me: u64,
    pub drop_last: bool,
}

/// The run of the deal that holds a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dealt {
    /// Its first sample in the epoch and the one after its last.
    pub start: u64,
    pub end: u64,
    /// Whether it is this member's.
    pub mine: bool,
    /// Its index among each member's batches of the epoch.
    pub index: u64,
}

impl Deal {
    /// The deal of `world` ranks (`replicate` to a data rank) for `rank`,
    /// over epochs of `n` samples in batches of `b`.
    pub fn new(n: u64, b: u64, (rank, world, replicate): (u32, u32, u32), drop_last: bool) -> Deal {
        assert!(
            b > 0 && replicate > 0 && world.is_multiple_of(replicate) && rank < world,
            "checked by the options and the broker"
        );
        Deal {
            n,
            b,
            d: u64::from(world / replicate),
            me: u64::from(rank / replicate),
            drop_last,
        }
    }

    /// Samples in the full rounds of an epoch.
    fn full(&self) -> u64 {
        let round = self.d * self.b;
        self.n / round * round
    }

    /// Batches each member gets in an epoch.
    pub fn batches_per_epoch(&self) -> u64 {
        let rounds = self.n / (self.d * self.b);
        let tail = self.n > self.full() && !self.drop_last;
        rounds + u64::from(tail)
    }

    /// This member's part of the tail: its first sample and length
    /// (`None` with `drop_last`, or when there is no tail).
    fn tail_part(&self) -> Option<(u64, u64)> {
        let full = self.full();
        let m = self.n - full;
        if m == 0 || self.drop_last {
            return None;
        }
        if m < self.d {
            return Some((full + self.me % m, 1));
        }
        let (q, r) = (m / self.d, m % self.d);
        let start = if self.me < r {
            self.me * (q + 1)
        } else {
            r * (q + 1) + (self.me - r) * q
        };
        Some((full + start, if self.me < r { q + 1 } else { q }))
    }

    /// Of this member's runs in an epoch, how many begin before sample
    /// `x`, and how many of their samples lie before `x`.
    pub fn own_before(&self, x: u64) -> (u64, u64) {
        let x = x.min(self.n);
        let round = self.d * self.b;
        let in_full = x.min(self.full());
        let rounds = in_full / round;
        let rem = in_full - rounds * round;
        let mine = self.me * self.b;
        let mut runs = rounds + u64::from(rem > mine);
        let mut samples = rounds * self.b + rem.saturating_sub(mine).min(self.b);
        if let Some((start, len)) = self.tail_part() {
            runs += u64::from(x > start);
            samples += x.saturating_sub(start).min(len);
        }
        (runs, samples)
    }

    /// Of this member's runs, those with samples in `lo..hi` of an epoch,
    /// and those samples.
    pub fn own_within(&self, lo: u64, hi: u64) -> (u64, u64) {
        let (r0, s0) = self.own_before(lo);
        let (r1, s1) = self.own_before(hi.max(lo));
        // A run begun before `lo` that reaches into it counts too.
        let inside = self
            .run_at(lo)
            .is_some_and(|d| d.mine && d.start < lo && hi > lo);
        (r1 - r0 + u64::from(inside), s1 - s0)
    }

    /// This member's first run that begins at or after sample `from` of an
    /// epoch; `None` if it has none left there.
    pub fn next_own(&self, from: u64) -> Option<Dealt> {
        let full = self.full();
        if from < full {
            let k = from.div_ceil(self.b);
            // The first batch from `k` on dealt to this data rank.
            let k = k + (self.me + self.d - k % self.d) % self.d;
            if (k + 1) * self.b <= full {
                return Some(Dealt {
                    start: k * self.b,
                    end: (k + 1) * self.b,
                    mine: true,
                    index: k / self.d,
                });
            }
        }
        let (start, len) = self.tail_part()?;
        (start >= from).then_some(Dealt {
            start,
            end: start + len,
            mine: true,
            index: full / (self.d * self.b),
        })
    }

    /// Where this member's first run at or after sample `sample` of
    /// `epoch` begins (in that epoch, or the next one's first run past its
    /// last); `None` if it has none in any epoch.
    pub fn own_at_or_after(&self, epoch: u64, sample: u64) -> Option<(u64, u64)> {
        match self.next_own(sample) {
            Some(run) => Some((epoch, run.start)),
            None => Some((epoch + 1, self.next_own(0)?.start)),
        }
    }

    /// Where a replay cursor at `at` goes next: the start of this
    /// member's first run at or after it, or, with none in any epoch,
    /// `at` or `end` (where replay ends), whichever is later. The broker's
    /// replay book and the client's replay check move alike through it.
    pub fn seek_own_run(&self, at: Position, end: Position) -> Position {
        match self.own_at_or_after(at.epoch, at.sample) {
            Some((epoch, sample)) => Position { epoch, sample },
            None => at.max(end),
        }
    }

    /// The start of the round (one batch of every data rank; the tail is
    /// one round) that holds this member's next run at or after sample
    /// `sample` of `epoch`: where its group goes on. A group re-formed
    /// with another world but the same global batch (`d × b`) has its
    /// rounds at the same samples, so it may go on from there.
    pub fn round_of(&self, epoch: u64, sample: u64) -> (u64, u64) {
        let Some((epoch, start)) = self.own_at_or_after(epoch, sample) else {
            return (epoch, sample);
        };
        let round = self.d * self.b;
        (epoch, (start / round * round).min(self.full()))
    }

    /// The first sample at or after `x` of an epoch that lies inside no
    /// run (anyone's) but at its start, or is dropped, or `n`: where a
    /// member may begin cutting runs of its own from the shared stream.
    pub fn boundary_at_or_after(&self, x: u64) -> u64 {
        match self.run_at(x) {
            Some(d) if d.start < x => d.end,
            _ => x.min(self.n),
        }
    }

    /// Whether this member's run `run` is its last of the epoch.
    pub fn ends_epoch(&self, run: &Dealt) -> bool {
        self.next_own(run.end).is_none()
    }

    /// The run holding sample `f` of an epoch; `None` if it is dropped
    /// (the tail, with `drop_last`) or past the epoch.
    pub fn run_at(&self, f: u64) -> Option<Dealt> {
        let full = self.full();
        if f >= self.n {
            return None;
        }
        if f < full {
            let k = f / self.b;
            return Some(Dealt {
                start: k * self.b,
                end: (k + 1) * self.b,
                mine: k % self.d == self.me,
                index: k / self.d,
            });
        }
        if self.drop_last {
            return None;
        }
        let m = self.n - full;
        let index = full / (self.d * self.b);
        let j = f - full;
        if m < self.d {
            // One sample each; ranks past the tail repeat its samples.
            return Some(Dealt {
                start: f,
                end: f + 1,
                mine: self.me % m == j,
                index,
            });
        }
        // `d` parts: the first `m mod d` of `q + 1` samples, then of `q`.
        let (q, r) = (m / self.d, m % self.d);
        let (part, start) = if j < r * (q + 1) {
            (j / (q + 1), j / (q + 1) * (q + 1))
        } else {
            let p = r + (j - r * (q + 1)) / q;
            (p, r * (q + 1) + (p - r) * q)
        };
        let len = if part < r { q + 1 } else { q };
        Some(Dealt {
            start: full + start,
            end: full + start + len,
            mine: part == self.me,
            index,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Each rank's samples of an epoch, in order, as the deal gives them.
    fn samples_of(deal_for: impl Fn(u32) -> Deal, world: u32) -> Vec<Vec<(u64, u64)>> {
        (0..world)
            .map(|r| {
                let deal = deal_for(r);
                let mut runs: Vec<(u64, u64)> = Vec::new();
                for f in 0..deal.n {
                    if let Some(d) = deal.run_at(f).filter(|d| d.mine)
                        && runs.last() != Some(&(d.start, d.end))
                    {
                        runs.push((d.start, d.end));
                    }
                }
                runs
            })
            .collect()
    }

    #[test]
    fn ranks_take_batches_in_turn_and_split_the_tail() {
        // 23 samples, batches of 4, 2 ranks: rounds of 8 (two full), a
        // tail of 7 split 4 + 3.
        let runs = samples_of(|r| Deal::new(23, 4, (r, 2, 1), false), 2);
        assert_eq!(runs[0], vec![(0, 4), (8, 12), (16, 20)]);
        assert_eq!(runs[1], vec![(4, 8), (12, 16), (20, 23)]);
        let dropped = samples_of(|r| Deal::new(23, 4, (r, 2, 1), true), 2);
        assert_eq!(dropped[0], vec![(0, 4), (8, 12)]);
        assert_eq!(dropped[1], vec![(4, 8), (12, 16)]);
        // A tail shorter than the ranks: repeated, as DistributedSampler pads.
        let padded = samples_of(|r| Deal::new(19, 4, (r, 4, 1), false), 4);
        assert_eq!(
            padded,
            vec![
                vec![(0, 4), (16, 17)],
                vec![(4, 8), (17, 18)],
                vec![(8, 12), (18, 19)],
                vec![(12, 16), (16, 17)],
            ]
        );
    }

    proptest! {
        /// The closed forms agree with the runs, sample by sample.
        #[test]
        fn own_counts_agree_with_the_runs(
            n in 1u64..300, b in 1u64..30, data in 1u32..6, rank_seed: u32, drop_last: bool,
            lo_seed: u64, len in 0u64..300,
        ) {
            let deal = Deal::new(n, b, (rank_seed % data, data, 1), drop_last);
            let lo = lo_seed % (n + 1);
            let hi = (lo + len).min(n);
            let mut runs = std::collections::BTreeSet::new();
            let mut samples = 0;
            for f in lo..hi {
                if let Some(d) = deal.run_at(f).filter(|d| d.mine) {
                    runs.insert(d.start);
                    samples += 1;
                }
            }
            prop_assert_eq!(deal.own_within(lo, hi), (runs.len() as u64, samples));
        }

        /// `next_own`, `boundary_at_or_after` and `ends_epoch` agree with
        /// the runs, sample by sample.
        #[test]
        fn the_next_own_run_and_boundaries_agree_with_the_runs(
            n in 1u64..300, b in 1u64..30, data in 1u32..6, rank_seed: u32, drop_last: bool,
            from_seed: u64,
        ) {
            let deal = Deal::new(n, b, (rank_seed % data, data, 1), drop_last);
            let from = from_seed % (n + 1);
            let runs: Vec<Dealt> = (0..n)
                .filter_map(|f| deal.run_at(f))
                .filter(|d| d.start >= from)
                .collect();
            let want = runs.iter().find(|d| d.mine && d.start >= from).copied();
            prop_assert_eq!(deal.next_own(from), want);
            if let Some(d) = want {
                let later = runs.iter().any(|e| e.mine && e.start >= d.end);
                prop_assert_eq!(deal.ends_epoch(&d), !later);
            }
            let boundary = (from..n)
                .find(|&f| deal.run_at(f).is_none_or(|d| d.start == f))
                .unwrap_or(n);
            prop_assert_eq!(deal.boundary_at_or_after(from), boundary);
        }

        /// Every member's round is the same for all ranks after the same
        /// number of batches, and a re-formed group (another world, the
        /// same global batch) starting there reads exactly the samples
        /// the old one had not.
        #[test]
        fn a_group_reformed_with_the_same_global_batch_goes_on_at_its_round(
            n in 1u64..300, rounds_seed: u64, data in 1u32..5, new_data_seed: u32, b in 1u64..6,
        ) {
            let global = u64::from(data) * b;
            // Another world whose batch still makes the same global batch.
            let divisors: Vec<u32> = (1..=global as u32).filter(|k| global.is_multiple_of(u64::from(*k))).collect();
            let new_data = divisors[new_data_seed as usize % divisors.len()];
            let b2 = global / u64::from(new_data);
            let old = |r| Deal::new(n, b, (r, data, 1), false);
            let new = |r| Deal::new(n, b2, (r, new_data, 1), false);
            let steps = rounds_seed % (old(0).batches_per_epoch() + 1);
            // Each old rank after `steps` batches: where its next run begins.
            let mut rounds = std::collections::BTreeSet::new();
            for r in 0..data {
                let runs = samples_of(old, data)[r as usize].clone();
                let at = runs.get(steps as usize).map_or(n, |&(s, _)| s);
                rounds.insert(old(r).round_of(0, at));
            }
            prop_assert_eq!(rounds.len(), 1, "one round for the whole group");
            let (epoch, round) = *rounds.iter().next().unwrap();
            // The old group read the runs of its first `steps` rounds; the
            // new one reads its runs from the round on: together, the
            // whole epoch as one deal would give it, each sample as often.
            let mut seen = vec![0u32; n as usize];
            let mut count = |runs: &[(u64, u64)], from: u64, to: u64| {
                for &(s, e) in runs.iter().filter(|&&(s, _)| s >= from && s < to) {
                    for f in s..e { seen[f as usize] += 1; }
                }
            };
            if epoch == 0 {
                for runs in samples_of(old, data) { count(&runs, 0, round); }
                let news = samples_of(new, new_data);
                let counts: std::collections::BTreeSet<usize> =
                    news.iter().map(|runs| runs.iter().filter(|&&(s, _)| s >= round).count()).collect();
                prop_assert_eq!(counts.len(), 1, "every new rank as many batches");
                for runs in news { count(&runs, round, n); }
            } else {
                for runs in samples_of(old, data) { count(&runs, 0, n); }
            }
            let full = n / global * global;
            for (f, &k) in seen.iter().enumerate() {
                if (f as u64) < full || n - full >= u64::from(data.max(new_data)) {
                    prop_assert_eq!(k, 1, "sample {}", f);
                }
            }
        }

        /// Every rank the same number of batches; each sample once across
        /// the data ranks (but for a tail shorter than the ranks, repeated,
        /// or the dropped tail); runs contiguous, in order, at most `b`;
        /// replicated ranks alike.
        #[test]
        fn every_rank_gets_as_many_batches_and_each_sample_once(
            n in 1u64..400, b in 1u64..40, data in 1u32..6, replicate in 1u32..4, drop_last: bool,
        ) {
            let world = data * replicate;
            let deal = |r| Deal::new(n, b, (r, world, replicate), drop_last);
            let runs = samples_of(deal, world);
            let want = deal(0).batches_per_epoch();
            for (r, mine) in runs.iter().enumerate() {
                prop_assert_eq!(mine.len() as u64, want, "rank {}", r);
                prop_assert!(mine.windows(2).all(|w| w[0].1 <= w[1].0));
                prop_assert!(mine.iter().all(|&(s, e)| s < e && e - s <= b));
                prop_assert_eq!(mine, &runs[r / replicate as usize * replicate as usize]);
                for (i, &(s, _)) in mine.iter().enumerate() {
                    prop_assert_eq!(deal(r as u32).run_at(s).unwrap().index, i as u64);
                }
            }
            let mut seen = vec![0u32; n as usize];
            for mine in runs.iter().step_by(replicate as usize) {
                for &(s, e) in mine {
                    for f in s..e {
                        seen[f as usize] += 1;
                    }
                }
            }
            let full = n / (u64::from(data) * b) * (u64::from(data) * b);
            let tail = n - full;
            for (f, &k) in seen.iter().enumerate() {
                let f = f as u64;
                if f < full {
                    prop_assert_eq!(k, 1, "sample {}", f);
                } else if drop_last {
                    prop_assert_eq!(k, 0, "sample {} of the dropped tail", f);
                } else if tail >= u64::from(data) {
                    prop_assert_eq!(k, 1, "sample {}", f);
                } else {
                    prop_assert!(k >= 1, "tail sample {} seen", f);
                }
            }
        }
    }
}
