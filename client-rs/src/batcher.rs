//! A consumer's own batch size over the stream's production units, as plain
//! logic (no I/O): the broker publishes units of the stream's batch size;
//! the [`Batcher`] cuts them into this consumer's batches of `size`
//! samples, each a [`Run`] of consecutive samples of one epoch, and says
//! when a unit can be given back.
//!
//! The host arena is field-major with mirrored rings
//! ([`crate::schema::RingLayout`]), so a run is one contiguous view per
//! field whatever units it spans: nothing is copied.
//!
//! # Rules
//!
//! * Every sample of every unit received is in exactly one run, in order,
//!   or (the short end of an epoch, with `drop_last`) in none.
//! * Runs never cross an epoch: an epoch's last run is short, or dropped
//!   with `drop_last`.
//! * A unit is given back once every sample of it is in a run (or
//!   dropped) and every run overlapping it was released: exactly once,
//!   never while a handed-out run still reads it.
//! * Units are taken one at a time, only when no run is ready, so the
//!   consumer holds at most the units its held runs overlap plus the one
//!   run it is building ([`units_needed`]).

use std::collections::VecDeque;

use crate::deal::{Deal, Dealt};
use crate::error::{Error, Result};

/// A production unit, as the broker announced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit {
    pub seq: u64,
    pub epoch: u64,
    /// Its index in the epoch.
    pub index: u64,
    pub samples: u64,
}

/// One of this consumer's batches: `samples` consecutive samples of
/// `epoch`, the first being sample `first` of the epoch and at stream
/// position `position` (where the rings hold it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub epoch: u64,
    /// Its index among this consumer's batches of the epoch (counted from
    /// the epoch's start, also for a consumer that joined mid-epoch).
    pub index: u64,
    pub first: u64,
    pub position: u64,
    pub samples: u64,
    /// The units it spans, `first_seq..=last_seq`.
    pub first_seq: u64,
    pub last_seq: u64,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    unit: Unit,
    /// Samples already in a run (or dropped).
    consumed: u64,
    /// Runs overlapping it, not yet released.
    refs: u32,
}

/// The units a consumer may hold at once to keep `window` batches of
/// `size` over units of `unit` samples, and build the next: `window`
/// when the sizes are equal (each unit is a batch); otherwise the units
/// `window + 1` runs can overlap, each run at most `⌈(size − 1) / unit⌉ + 1`.
pub fn units_needed(window: u32, size: u64, unit: u64) -> u64 {
    if size == unit {
        return u64::from(window);
    }
    let per_run = (size.saturating_sub(1)).div_ceil(unit.max(1)) + 1;
    (u64::from(window) + 1).saturating_mul(per_run)
}

/// [`units_needed`] for a group member ([`crate::deal`]): its runs are
/// apart, and an epoch's tail parts may straddle units whatever the
/// sizes, so no run shares a unit with the next and the run it builds
/// counts even when `size` equals the unit.
pub fn member_units_needed(window: u32, size: u64, unit: u64) -> u64 {
    let per_run = (size.saturating_sub(1)).div_ceil(unit.max(1)) + 1;
    (u64::from(window) + 1).saturating_mul(per_run)
}

/// The ring slots a group member's window may span: holding `window` of
/// its runs while it builds the next, each `data_ranks` batches of `size`
/// after the one before (the others' runs lie between). The stream's
/// slots must cover it, or the member pins the ring
/// ([`Batcher::pins_ring`]) and nothing newer can be made.
pub fn member_ring_span(window: u32, size: u64, unit: u64, data_ranks: u64) -> u64 {
    let len = (u64::from(window) * data_ranks + 1).saturating_mul(size);
    (len.saturating_sub(1)).div_ceil(unit.max(1)) + 1
}

/// Cuts units into runs of `size` samples; see the module doc.
#[derive(Debug)]
pub struct Batcher {
    size: u64,
    drop_last: bool,
    unit: u64,
    units_per_epoch: u64,
    /// In sequence order.
    held: VecDeque<Held>,
    /// The last unit taken.
    last_seq: Option<u64>,
    /// The run being built: its first unit's position and samples so far.
    building: Option<Run>,
    ready: VecDeque<Run>,
    /// Samples before this (epoch, sample) are not this consumer's: given
    /// back unread (they were replayed to it, or it resumes past them).
    skip: (u64, u64),
    /// Where the run after the last one cut begins (the next epoch's start
    /// once an epoch ended).
    after: Option<(u64, u64)>,
    /// A group member's share ([`crate::deal`]): runs are the deal's, and
    /// only its own are cut; the rest is given back unread.
    deal: Option<Deal>,
}

impl Batcher {
    /// Runs of `size` samples over units of `unit` samples, `units_per_epoch`
    /// units to an epoch.
    pub fn new(size: u64, drop_last: bool, unit: u64, units_per_epoch: u64) -> Batcher {
        assert!(size > 0 && unit > 0, "checked by the options and the plan");
        Batcher {
            size,
            drop_last,
            unit,
            units_per_epoch,
            held: VecDeque::new(),
            last_seq: None,
            building: None,
            ready: VecDeque::new(),
            skip: (0, 0),
            after: None,
            deal: None,
        }
    }

    /// A group member's batcher: runs as `deal` cuts the epoch (its batch
    /// size is the deal's), only this member's.
    pub fn with_deal(mut self, deal: Deal) -> Batcher {
        self.deal = Some(deal);
        self
    }

    /// Samples before sample `sample` of `epoch` are given back unread;
    /// runs start there (set before the first unit).
    pub fn skip_to(&mut self, epoch: u64, sample: u64) {
        self.skip = (epoch, sample);
    }

    /// Where its next run begins: the first sample of the run being built,
    /// else the one after the last run cut (or the skip point past it); a
    /// group member's, the start of its own next run from there (the
    /// others' runs between are not its). `None` before any unit.
    pub fn next_position(&self) -> Option<(u64, u64)> {
        let at = self.building.map(|b| (b.epoch, b.first)).or(self.after)?;
        Some(self.own_from(at.max(self.skip)))
    }

    /// Where this consumer's first run at or after `at` begins: `at`
    /// itself, but for a group member, whose next own run may begin after
    /// others' runs (or, with none left in the epoch, in the next one).
    pub fn own_from(&self, at: (u64, u64)) -> (u64, u64) {
        match self.deal {
            Some(d) => d.own_at_or_after(at.0, at.1).unwrap_or(at),
            None => at,
        }
    }

    /// Cut from the shared stream (decoupled pace): the run being built is
    /// dropped (its samples come replayed); units no handed-out run reads
    /// are given back.
    /// Units from then on may repeat earlier seqs (it rejoins the shared
    /// stream where its replay ends, see [`skip_to`](Self::skip_to)).
    /// Returns where the dropped run began, or the next run would have.
    pub fn cut(&mut self, give_back: &mut Vec<u64>) -> Option<(u64, u64)> {
        let at = self.next_position();
        if let Some(b) = self.building.take() {
            self.unref(&b);
        }
        self.last_seq = None;
        self.collect(give_back);
        at
    }

    /// Whether it needs another unit to give a run.
    pub fn wants_unit(&self) -> bool {
        self.ready.is_empty()
    }

    /// Units held (received, not given back).
    pub fn units_held(&self) -> usize {
        self.held.len()
    }

    /// Whether the broker cannot send the next unit until this consumer
    /// gives one back: the stream's `slots` are a ring, and the next unit
    /// takes the slot of the one `slots` before it, which this consumer
    /// still holds (the program keeps an old batch while asking for new
    /// ones). Returns that unit.
    pub fn pins_ring(&self, slots: u32) -> Option<u64> {
        let oldest = self.held.front()?.unit.seq;
        let last = self.last_seq?;
        (oldest + u64::from(slots) <= last + 1).then_some(oldest)
    }

    /// Takes the next unit; its samples go into runs. An error if it does
    /// not follow the last one (the broker sends each unit once, in order).
    pub fn push(&mut self, unit: Unit, give_back: &mut Vec<u64>) -> Result<()> {
        self.check(&unit)?;
        if let Some(b) = self.building
            && (b.epoch != unit.epoch || b.position + b.samples != unit.seq * self.unit)
        {
            // Not contiguous: the epoch ended without its last unit (an
            // external producer ending early) or it is a broken stream.
            if b.epoch == unit.epoch {
                return Err(Error::Unexpected(format!(
                    "batch {} does not follow the samples before it",
                    unit.seq
                )));
            }
            self.end_epoch(b.epoch, give_back);
        }
        self.last_seq = Some(unit.seq);
        self.held.push_back(Held {
            unit,
            consumed: 0,
            refs: 0,
        });
        // Samples this consumer skips count as consumed, in no run.
        let mut offset = self.skipped(&unit);
        self.held.back_mut().expect("pushed").consumed = offset;
        while offset < unit.samples {
            let f = unit.index * self.unit + offset;
            let left = unit.samples - offset;
            // A group member: others' runs and a dropped tail are given
            // back unread, like skipped samples.
            let dealt = match self.dealt(f, left) {
                Ok(d) => d,
                Err(take) => {
                    self.held.back_mut().expect("pushed").consumed += take;
                    offset += take;
                    continue;
                }
            };
            let size = self.size;
            let b = self.building.get_or_insert(Run {
                epoch: unit.epoch,
                index: dealt.map_or(f / size, |d| d.index),
                first: f,
                position: unit.seq * self.unit + offset,
                samples: 0,
                first_seq: unit.seq,
                last_seq: unit.seq,
            });
            let room = dealt.map_or(size - b.samples, |d| d.end - f);
            let take = room.min(left);
            let joins = b.samples == 0 || b.last_seq != unit.seq;
            b.samples += take;
            b.last_seq = unit.seq;
            let full = take == room;
            offset += take;
            let h = self.held.back_mut().expect("pushed");
            h.consumed += take;
            // The run being built counts as a reader of each unit it spans.
            h.refs += u32::from(joins);
            if full {
                let run = self.building.take().expect("built");
                self.after = Some((run.epoch, run.first + run.samples));
                self.ready.push_back(run);
            }
        }
        if unit.index + 1 == self.units_per_epoch {
            self.end_epoch(unit.epoch, give_back);
        }
        self.collect(give_back);
        Ok(())
    }

    /// A unit that follows the last and fits the stream's units.
    fn check(&self, unit: &Unit) -> Result<()> {
        if let Some(last) = self.last_seq
            && unit.seq <= last
        {
            return Err(Error::Unexpected(format!(
                "batch {} after batch {last}: out of order",
                unit.seq
            )));
        }
        if unit.samples > self.unit || unit.index >= self.units_per_epoch {
            return Err(Error::Unexpected(format!(
                "batch {} claims {} samples at index {} (units of {}, {} to an epoch)",
                unit.seq, unit.samples, unit.index, self.unit, self.units_per_epoch
            )));
        }
        Ok(())
    }

    /// Samples at the start of `unit` before where this consumer starts.
    fn skipped(&self, unit: &Unit) -> u64 {
        match (unit.epoch, unit.index * self.unit) {
            (e, _) if e < self.skip.0 => unit.samples,
            (e, f) if e == self.skip.0 => self.skip.1.saturating_sub(f).min(unit.samples),
            _ => 0,
        }
    }

    /// A group member's run holding sample `f` when it is its own
    /// (`Ok(None)`: not a group member); `Err(n)`: the next `n` samples
    /// (of `left` in the unit) are another's, or a dropped tail.
    fn dealt(&self, f: u64, left: u64) -> std::result::Result<Option<Dealt>, u64> {
        match self.deal.map(|d| d.run_at(f)) {
            None => Ok(None),
            Some(Some(d)) if d.mine => Ok(Some(d)),
            Some(other) => Err(other.map_or(left, |d| (d.end - f).min(left))),
        }
    }

    /// The epoch ended: a run still being built is cut short, or dropped
    /// with `drop_last`.
    pub fn end_epoch(&mut self, epoch: u64, give_back: &mut Vec<u64>) {
        if self.after.is_none_or(|(e, _)| e <= epoch) {
            self.after = Some((epoch + 1, 0));
        }
        if let Some(b) = self.building
            && b.epoch == epoch
        {
            self.building = None;
            if self.drop_last && b.samples < self.size {
                self.unref(&b);
            } else {
                self.ready.push_back(b);
            }
        }
        self.collect(give_back);
    }

    /// The next run to hand out.
    pub fn pop(&mut self) -> Option<Run> {
        self.ready.pop_front()
    }

    /// A handed-out run was released: the units it was the last reader of
    /// are given back.
    pub fn release(&mut self, run: &Run, give_back: &mut Vec<u64>) {
        self.unref(run);
        self.collect(give_back);
    }

    /// Leaving: runs not handed out and the run being built are dropped;
    /// every unit no handed-out run reads is given back.
    pub fn leave(&mut self, give_back: &mut Vec<u64>) {
        if let Some(b) = self.building.take() {
            self.unref(&b);
        }
        while let Some(r) = self.ready.pop_front() {
            self.unref(&r);
        }
        for h in &mut self.held {
            h.consumed = h.unit.samples;
        }
        self.collect(give_back);
    }

    fn unref(&mut self, run: &Run) {
        for h in &mut self.held {
            if (run.first_seq..=run.last_seq).contains(&h.unit.seq) {
                h.refs = h.refs.checked_sub(1).expect("a run's units are held");
            }
        }
    }

    fn collect(&mut self, give_back: &mut Vec<u64>) {
        self.held.retain(|h| {
            let done = h.refs == 0 && h.consumed == h.unit.samples;
            if done {
                give_back.push(h.unit.seq);
            }
            !done
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Units of `unit` samples, `per_epoch` to an epoch whose last holds
    /// `last` samples, for `epochs` epochs from unit `skip` on.
    fn units(unit: u64, per_epoch: u64, last: u64, epochs: u64, skip: u64) -> Vec<Unit> {
        (skip..per_epoch * epochs)
            .map(|seq| Unit {
                seq,
                epoch: seq / per_epoch,
                index: seq % per_epoch,
                samples: if seq % per_epoch + 1 == per_epoch {
                    last
                } else {
                    unit
                },
            })
            .collect()
    }

    proptest! {
        /// Random sizes, a random join, random release order: every
        /// sample in exactly one run, in order, runs cut at epochs, units
        /// given back exactly once and never while a run reads them, and
        /// never more units held than `units_needed`.
        #[test]
        fn runs_cover_every_sample_once_and_units_come_back_once(
            size in 1u64..300, unit in 1u64..80, per_epoch in 1u64..6,
            last_cut in 0u64..80, epochs in 1u64..4, skip in 0u64..5,
            drop_last: bool, window in 1u32..4, seed: u64,
        ) {
            let last = 1 + last_cut % unit;
            let all = units(unit, per_epoch, last, epochs, skip.min(per_epoch * epochs - 1));
            let mut b = Batcher::new(size, drop_last, unit, per_epoch);
            let mut rng = crate::synthetic::SplitMix64::new(seed);
            let (mut given, mut out, mut held) = (Vec::new(), Vec::<Run>::new(), Vec::<Run>::new());
            let mut it = all.iter().peekable();
            loop {
                // The program holds at most `window` runs; it releases a
                // random one when full, or now and then.
                if held.len() as u32 == window || (!held.is_empty() && rng.below(3) == 0) {
                    let r = held.swap_remove(rng.below(held.len() as u64) as usize);
                    b.release(&r, &mut given);
                    continue;
                }
                if let Some(r) = b.pop() {
                    for s in &given {
                        prop_assert!(!(r.first_seq..=r.last_seq).contains(s), "unit {s} given back under a run");
                    }
                    held.push(r);
                    out.push(r);
                    continue;
                }
                prop_assert!(b.wants_unit());
                let Some(&u) = it.next() else { break };
                b.push(u, &mut given).unwrap();
                prop_assert!(b.units_held() as u64 <= units_needed(window, size, unit),
                    "{} units held, bound {}", b.units_held(), units_needed(window, size, unit));
            }
            for r in held.drain(..) {
                b.release(&r, &mut given);
            }
            b.leave(&mut given);
            // Units: each given back exactly once.
            let mut seqs = given.clone();
            seqs.sort_unstable();
            prop_assert_eq!(seqs, all.iter().map(|u| u.seq).collect::<Vec<_>>());
            // Samples: in order, each once, runs within epochs, full but
            // for an epoch's last.
            let mut expect: Vec<(u64, u64, u64)> = Vec::new(); // (epoch, first, position)
            for u in &all {
                for j in 0..u.samples {
                    expect.push((u.epoch, u.index * unit + j, u.seq * unit + j));
                }
            }
            let mut got = Vec::new();
            for r in &out {
                prop_assert!(r.samples >= 1 && r.samples <= size);
                prop_assert_eq!(r.index, r.first / size);
                for j in 0..r.samples {
                    got.push((r.epoch, r.first + j, r.position + j));
                }
            }
            if drop_last {
                prop_assert!(out.iter().all(|r| r.samples == size));
                let dropped: Vec<_> = expect.iter().filter(|s| !got.contains(s)).copied().collect();
                // Only the tail of each epoch is dropped, less than a batch.
                for e in 0..epochs {
                    let n = dropped.iter().filter(|s| s.0 == e).count() as u64;
                    prop_assert!(n < size);
                }
                expect.retain(|s| got.contains(s));
            }
            prop_assert_eq!(got, expect);
        }
    }

    proptest! {
        /// Decoupled pace: cut after a random number of units (the batch
        /// being built is dropped and must begin at the broker's restart,
        /// its batch boundary at or before the first unit not taken), the
        /// samples from there to a later boundary replayed, then units
        /// again from the one holding that boundary (seqs taken before may
        /// repeat), skipping to it: every sample once, in order.
        #[test]
        fn a_cut_and_a_merge_lose_and_repeat_no_sample(
            size in 1u64..50, unit in 1u64..30, per_epoch in 1u64..6,
            last_cut in 0u64..30, epochs in 1u64..4, skip in 0u64..4,
            cut_after in 0u64..20, ahead in 0u64..6, again_after in 0u64..8,
        ) {
            let last = 1 + last_cut % unit;
            let all = units(unit, per_epoch, last, epochs, skip.min(per_epoch * epochs - 1));
            let epoch_samples = (per_epoch - 1) * unit + last;
            let first = (all[0].epoch, all[0].index * unit);
            let taken = (cut_after as usize).min(all.len());
            let mut b = Batcher::new(size, false, unit, per_epoch);
            let (mut given, mut got, mut pushed) = (Vec::new(), Vec::new(), Vec::new());
            let take = |r: Run, got: &mut Vec<(u64, u64)>| {
                for j in 0..r.samples {
                    got.push((r.epoch, r.first + j));
                }
            };
            for &u in &all[..taken] {
                pushed.push(u.seq);
                b.push(u, &mut given).unwrap();
                while let Some(r) = b.pop() {
                    take(r, &mut got);
                    b.release(&r, &mut given);
                }
            }
            // The broker's restart: the boundary at or before the first
            // sample it did not take (not before where it last merged).
            let restart_at = |lost: (u64, u64), merged: (u64, u64)| {
                let base = if lost.0 == first.0 { first.1 } else { 0 };
                let r = if lost <= first {
                    first
                } else {
                    (lost.0, base + (lost.1 - base) / size * size)
                };
                r.max(merged)
            };
            let lost = all.get(taken).map_or((epochs, 0), |u| (u.epoch, u.index * unit));
            let restart = restart_at(lost, first);
            let at = b.cut(&mut given);
            prop_assert!(at.is_none_or(|a| a == restart), "batcher at {at:?}, broker {restart:?}");
            // Every run was released: the cut gives every unit back.
            prop_assert_eq!(b.units_held(), 0);
            // Replayed: batches of `size` from `x`, `n` of them (an
            // epoch's last one short); where replay stops.
            let replay = |mut x: (u64, u64), n: u64, got: &mut Vec<(u64, u64)>| {
                for _ in 0..n {
                    if x.0 >= epochs {
                        break;
                    }
                    let k = size.min(epoch_samples - x.1);
                    for j in 0..k {
                        got.push((x.0, x.1 + j));
                    }
                    x = if x.1 + k == epoch_samples { (x.0 + 1, 0) } else { (x.0, x.1 + k) };
                }
                x
            };
            let x = replay(restart, ahead, &mut got);
            // Merged at x: the shared units from the one holding it, some
            // taken, then cut again and replayed to the end.
            b.skip_to(x.0, x.1);
            let from = all
                .iter()
                .position(|u| (u.epoch, u.index) >= (x.0, x.1 / unit))
                .unwrap_or(all.len());
            let again = (from + again_after as usize).min(all.len());
            for &u in &all[from..again] {
                pushed.push(u.seq);
                b.push(u, &mut given).unwrap();
                while let Some(r) = b.pop() {
                    take(r, &mut got);
                    b.release(&r, &mut given);
                }
            }
            let lost = all.get(again).map_or((epochs, 0), |u| (u.epoch, u.index * unit));
            let restart = restart_at(lost, x);
            let at = b.cut(&mut given);
            prop_assert!(at.is_none_or(|a| a == restart), "again: batcher at {at:?}, broker {restart:?}");
            replay(restart, u64::MAX, &mut got);
            b.leave(&mut given);
            // Every unit taken given back once for each time it was taken.
            given.sort_unstable();
            pushed.sort_unstable();
            prop_assert_eq!(given, pushed);
            let expect: Vec<(u64, u64)> = all
                .iter()
                .flat_map(|u| (0..u.samples).map(move |j| (u.epoch, u.index * unit + j)))
                .collect();
            prop_assert_eq!(got, expect);
        }
    }

    proptest! {
        /// A group member cut after a random number of units stands at
        /// the run the broker restarts it at ([`Batcher::own_from`] of
        /// it): its own run holding the first sample not taken, else its
        /// next own run. Whether it took units of others' runs after its
        /// last run makes no difference (a member of rank 0 that cut its
        /// run 64-72 and took rank 1's unit 72-80 once said 72 to the
        /// broker's 80).
        #[test]
        fn a_cut_group_member_stands_at_the_run_the_broker_restarts(
            size in 1u64..20, unit in 1u64..24, per_epoch in 1u64..8,
            last_cut in 0u64..24, epochs in 1u64..3, ranks in 1u64..4,
            rank in 0u64..4, cut_after in 0u64..40, drop_last: bool,
        ) {
            let last = 1 + last_cut % unit;
            let n = (per_epoch - 1) * unit + last;
            let all = units(unit, per_epoch, last, epochs, 0);
            let rank = (rank % ranks) as u32;
            let deal = Deal::new(n, size, (rank, ranks as u32, 1), drop_last);
            // A member with no run in any epoch has no place to stand.
            if deal.own_at_or_after(0, 0).is_none() {
                return Ok(());
            }
            let mut b = Batcher::new(size, drop_last, unit, per_epoch).with_deal(deal);
            let taken = (cut_after as usize).min(all.len());
            let mut given = Vec::new();
            for &u in &all[..taken] {
                b.push(u, &mut given).unwrap();
                while let Some(r) = b.pop() {
                    b.release(&r, &mut given);
                }
            }
            let lost = all.get(taken).map_or((epochs, 0), |u| (u.epoch, u.index * unit));
            // The broker's rule (`Boundaries::restart`).
            let restart = match deal.run_at(lost.1) {
                Some(run) if run.mine && lost.0 < epochs => (lost.0, run.start),
                _ => deal.own_at_or_after(lost.0, lost.1).unwrap_or(lost),
            };
            let at = b.cut(&mut given);
            prop_assert!(
                at.is_none_or(|a| a == b.own_from(restart)),
                "batcher at {at:?}, broker {restart:?}"
            );
        }
    }

    #[test]
    fn skipped_samples_are_given_back_unread() {
        // Units of 4, 5 to an epoch (the last of 2); skip to epoch 1,
        // sample 6: runs of 3 start there.
        let mut b = Batcher::new(3, false, 4, 5);
        b.skip_to(1, 6);
        let mut given = Vec::new();
        let mut runs = Vec::new();
        for u in units(4, 5, 2, 2, 3) {
            b.push(u, &mut given).unwrap();
            while let Some(r) = b.pop() {
                runs.push(r);
            }
        }
        // Units 3 and 4 (epoch 0) and 5 (samples 0..4 of epoch 1) unread.
        assert_eq!(given, vec![3, 4, 5]);
        let firsts: Vec<_> = runs.iter().map(|r| (r.epoch, r.first, r.samples)).collect();
        assert_eq!(firsts, vec![(1, 6, 3), (1, 9, 3), (1, 12, 3), (1, 15, 3)]);
        assert_eq!(runs[0].index, 2);
        assert_eq!(runs[0].position, 6 * 4 + 2);
    }

    #[test]
    fn equal_sizes_pass_units_through() {
        let mut b = Batcher::new(4, false, 4, 3);
        let mut given = Vec::new();
        for u in units(4, 3, 2, 1, 0) {
            b.push(u, &mut given).unwrap();
            let r = b.pop().unwrap();
            assert_eq!(
                (r.first_seq, r.last_seq, r.samples),
                (u.seq, u.seq, u.samples)
            );
            b.release(&r, &mut given);
            assert_eq!(given.pop(), Some(u.seq));
        }
        assert_eq!(units_needed(2, 4, 4), 2);
    }

    #[test]
    fn an_out_of_order_unit_is_an_error() {
        let mut b = Batcher::new(3, false, 4, 10);
        let mut given = Vec::new();
        let u = units(4, 10, 4, 1, 0);
        b.push(u[1], &mut given).unwrap();
        let err = b.push(u[0], &mut given).unwrap_err().to_string();
        assert!(err.contains("out of order"), "{err}");
        let err = b.push(u[3], &mut given).unwrap_err().to_string();
        assert!(
            err.contains("does not follow"),
            "a gap inside an epoch: {err}"
        );
    }

    proptest! {
        /// A group member cuts exactly the deal's runs of its own, from
        /// where it starts, whatever the stream's unit; units come back
        /// exactly once.
        #[test]
        fn a_group_member_cuts_its_own_runs_of_the_deal(
            b in 1u64..30, unit in 1u64..20, per_epoch in 1u64..8, last_cut in 0u64..20,
            data in 1u32..5, rank_seed: u32, epochs in 1u64..3, skip in 0u64..3,
            drop_last: bool,
        ) {
            let last = 1 + last_cut % unit;
            let n = (per_epoch - 1) * unit + last;
            let rank = rank_seed % data;
            let deal = Deal::new(n, b, (rank, data, 1), drop_last);
            let skip = skip.min(per_epoch * epochs - 1);
            let all = units(unit, per_epoch, last, epochs, skip);
            let mut batcher = Batcher::new(b, drop_last, unit, per_epoch).with_deal(deal);
            let first = (skip / per_epoch, skip % per_epoch * unit);
            batcher.skip_to(first.0, first.1);
            let mut given = Vec::new();
            let mut got = Vec::new();
            for u in &all {
                batcher.push(*u, &mut given).unwrap();
                while let Some(r) = batcher.pop() {
                    got.push((r.epoch, r.index, r.first, r.first + r.samples));
                    batcher.release(&r, &mut given);
                }
            }
            batcher.leave(&mut given);
            given.sort_unstable();
            prop_assert_eq!(given, all.iter().map(|u| u.seq).collect::<Vec<_>>());
            // The deal's runs of this rank, from the start point on (a run
            // the start cuts into begins there).
            let mut want = Vec::new();
            for e in first.0..epochs {
                let from = if e == first.0 { first.1 } else { 0 };
                let mut f = 0;
                while f < n {
                    match deal.run_at(f) {
                        Some(d) => {
                            if d.mine && d.end > from {
                                want.push((e, d.index, d.start.max(from), d.end));
                            }
                            f = d.end.max(f + 1);
                        }
                        None => f += 1,
                    }
                }
            }
            // A tail shorter than the ranks is one sample each: repeated
            // runs come once here as the same (start, end).
            want.dedup();
            prop_assert_eq!(got, want);
        }
    }
}
