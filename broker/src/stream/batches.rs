//! A consumer's own batches in the stream's samples, each consumer cutting
//! the stream in its own batch size: where its batches begin
//! ([`Boundaries`], the one place that says so: replay ends on one, a cut
//! restarts on one) and how many it has been sent ([`BatchCounter`], for
//! `stats`). Pure arithmetic, no state of the stream's.

use std::collections::BTreeMap;

use batchcast::deal::Deal;
use batchcast::proto::Position;

/// Where the batches of a consumer of batch size `batch` begin, its first
/// at `anchor`: counted from the anchor in its epoch, from each epoch's
/// start after (an epoch's start is always a boundary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Boundaries {
    anchor: Position,
    batch: u64,
}

impl Boundaries {
    pub(super) fn new(anchor: Position, batch: u64) -> Boundaries {
        Boundaries {
            anchor,
            batch: batch.max(1),
        }
    }

    /// Where boundaries are counted from in `epoch`.
    fn base(&self, epoch: u64) -> u64 {
        if epoch == self.anchor.epoch {
            self.anchor.sample
        } else {
            0
        }
    }

    /// The boundary at or before `p` (never before the anchor).
    pub(super) fn at_or_before(&self, p: Position) -> Position {
        if p <= self.anchor {
            return self.anchor;
        }
        let base = self.base(p.epoch);
        Position {
            epoch: p.epoch,
            sample: base + (p.sample - base) / self.batch * self.batch,
        }
    }

    /// Where a consumer cut with `lost` the first sample it did not take
    /// goes on: its batch boundary at or before it; a group member's
    /// (`deal`), the start of its own run holding `lost` (it took part of
    /// that run), else of its next own run (`lost` lies in another's
    /// run, or a dropped tail). Never before the anchor. Its client
    /// checks its batcher stands there ([`Deal::own_at_or_after`]).
    pub(super) fn restart(&self, lost: Position, deal: Option<&Deal>) -> Position {
        let Some(d) = deal else {
            return self.at_or_before(lost);
        };
        let own = match d.run_at(lost.sample) {
            Some(run) if run.mine => Some((lost.epoch, run.start)),
            _ => d.own_at_or_after(lost.epoch, lost.sample),
        };
        own.map_or(lost, |(epoch, sample)| Position { epoch, sample })
            .max(self.anchor)
    }

    /// The boundary at or after `p`, or the end of `p`'s epoch (the next
    /// epoch's start) if that comes first; epochs of `per_epoch` samples.
    pub(super) fn at_or_after(&self, p: Position, per_epoch: u64) -> Position {
        if p <= self.anchor {
            return self.anchor;
        }
        let base = self.base(p.epoch);
        let end = base + (p.sample - base).div_ceil(self.batch) * self.batch;
        Position {
            epoch: p.epoch,
            sample: 0,
        }
        .advance(end, per_epoch)
    }
}

/// Where a consumer's cuts restart it: its own boundaries (a member's
/// runs of the deal), never before where it last merged back, rotated
/// or began (it has every sample before that). The one owner of that
/// place: the runtime's cut and merge and the hold simulation both ask it.
#[derive(Debug, Clone, Copy)]
pub(super) struct CutPlace {
    boundaries: Boundaries,
    deal: Option<Deal>,
    merged_at: Position,
}

impl CutPlace {
    /// A consumer of batch size `batch` (a member's `deal`) whose first
    /// batch begins at `anchor`.
    pub(super) fn new(anchor: Position, batch: u64, deal: Option<Deal>) -> CutPlace {
        CutPlace {
            boundaries: Boundaries::new(anchor, batch),
            deal,
            merged_at: anchor,
        }
    }

    /// Not before `skip` either, where its shared samples begin to count:
    /// it has those before (replayed to it as it joined) or resumed past
    /// them.
    pub(super) fn skipping(mut self, skip: Option<Position>) -> CutPlace {
        if let Some(skip) = skip {
            self.merged_at = self.merged_at.max(skip);
        }
        self
    }

    /// Where it goes on, cut with `lost` the first sample it did not take
    /// ([`Boundaries::restart`], not before where it last merged back).
    pub(super) fn restart(&self, lost: Position) -> Position {
        self.boundaries
            .restart(lost, self.deal.as_ref())
            .max(self.merged_at)
    }

    /// It merged back (or was rotated) into the shared stream at `at`.
    pub(super) fn merged(&mut self, at: Position) {
        self.merged_at = at;
    }
}

/// Where replay ends for a consumer of batch size `batch` that starts at
/// `from`, when the shared stream carries on for it from `shared`: its
/// first batch boundary at or past `shared` (or the end of that epoch); a
/// group member's, the first boundary of the deal's runs there (its client
/// cuts its runs from the shared stream from there on).
/// `None`: nothing to replay.
pub(super) fn replay_end(
    from: Position,
    shared: Position,
    (batch, deal): (u64, Option<&Deal>),
    per_epoch: u64,
) -> Option<Position> {
    if from >= shared {
        return None;
    }
    let Some(d) = deal else {
        return Some(Boundaries::new(from, batch).at_or_after(shared, per_epoch));
    };
    let to = Position {
        epoch: shared.epoch,
        sample: 0,
    }
    .advance(d.boundary_at_or_after(shared.sample), per_epoch);
    // Nothing to replay if none of its own runs begins before there.
    let (epoch, sample) = d.own_at_or_after(from.epoch, from.sample)?;
    (Position { epoch, sample } < to).then_some(to)
}

/// How a joiner begins: what is replayed to it first, and where its
/// batches begin ([`start`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Start {
    /// Nothing replayed (it keeps no replay arena, and there is nothing
    /// to replay): its batches begin at `anchor`, a resume point ahead of
    /// the shared stream skipped to (`skip`).
    Shared {
        anchor: Position,
        skip: Option<Position>,
    },
    /// It starts cut from the shared stream, replayed from `from` until it
    /// merges back (decoupled pace): nothing shared waits for it meanwhile.
    Cut { from: Position },
    /// Replayed `from..to` (catching up; nothing where `from == to`, an
    /// arena kept for cuts), then the shared stream from `to`, skipped to:
    /// under lockstep it is waited for while that replay moves.
    Replay { from: Position, to: Position },
}

impl Start {
    /// Where its batches are counted from (its place's anchor), and the
    /// point its client skips to first, if any.
    pub(super) fn begins(self) -> (Position, Option<Position>) {
        match self {
            Start::Shared { anchor, skip } => (anchor, skip),
            Start::Cut { from } => (from, Some(from)),
            Start::Replay { from, to } => (from.min(to), Some(to)),
        }
    }
}

/// How a joiner of batch size `batch` (a data-parallel member: its
/// `deal`'s runs) begins, on epochs of `per_epoch` samples: it asks to
/// begin at `from` (its epoch's start for `join = "now"`, a resume point,
/// else where the shared stream is) and the shared stream begins for it
/// at `shared`; `kept`: it keeps a replay arena for cuts; `decoupled`:
/// the stream's pace; `resume`: the point it resumes at, if any. The
/// stream's runtime and the hold simulation both start joiners by it.
pub(super) fn start(
    (from, shared): (Position, Position),
    (batch, deal): (u64, Option<&Deal>),
    per_epoch: u64,
    (kept, decoupled): (bool, bool),
    resume: Option<Position>,
) -> Start {
    let to = match replay_end(from, shared, (batch, deal), per_epoch) {
        Some(to) => to,
        // Nothing to replay; a resume point ahead is skipped to.
        None if kept => from.max(shared),
        None => {
            return Start::Shared {
                anchor: from,
                skip: resume,
            };
        }
    };
    if kept && decoupled && from < to {
        return Start::Cut { from };
    }
    Start::Replay { from, to }
}

/// Counts a consumer's own batches in the samples it was sent, epoch by
/// epoch (each epoch's last batch short, or dropped with `drop_last`), as
/// its client cuts them: stats show batches in its own size.
#[derive(Debug, Clone)]
pub(super) struct BatchCounter {
    size: u64,
    drop_last: bool,
    /// Batches and samples of epochs no longer kept below.
    done: u64,
    done_samples: u64,
    /// Per recent epoch: the first sample counted and how many.
    epochs: BTreeMap<u64, (u64, u64)>,
    /// Samples before this position are not its (its client gives them
    /// back unread: they were replayed, or it resumes past them).
    skip: Option<Position>,
    /// A group member's share: its batches are its own runs of the deal.
    deal: Option<Deal>,
}

/// Epochs a [`BatchCounter`] keeps apart (a rewind reaches back at most a ring of
/// units, and a stream's epochs hold at least one each).
const COUNTED_EPOCHS: usize = 4096;

impl BatchCounter {
    pub(super) fn new(size: u64, drop_last: bool) -> BatchCounter {
        BatchCounter {
            size: size.max(1),
            drop_last,
            done: 0,
            done_samples: 0,
            epochs: BTreeMap::new(),
            skip: None,
            deal: None,
        }
    }

    /// Counts only a group member's own runs of `deal`.
    pub(super) fn dealt(mut self, deal: Option<Deal>) -> BatchCounter {
        self.deal = deal;
        self
    }

    /// Counts only samples from `skip` on.
    pub(super) fn skipping(mut self, skip: Option<Position>) -> BatchCounter {
        self.skip = skip;
        self
    }

    /// `samples` samples of `epoch` from sample `first` on.
    pub(super) fn add(&mut self, epoch: u64, first: u64, samples: u64) {
        let (mut first, mut samples) = (first, samples);
        if let Some(skip) = self.skip {
            if epoch < skip.epoch {
                return;
            }
            if epoch == skip.epoch && first < skip.sample {
                samples = samples.saturating_sub(skip.sample - first);
                first = skip.sample;
            }
        }
        // The span from the epoch's first counted sample to the end of
        // these: a group member is replayed only its own runs, with the
        // others' between them. Almost always the epoch counted last
        // (called for every batch sent to every consumer): no search.
        if let Some(mut last) = self.epochs.last_entry()
            && *last.key() == epoch
        {
            let e = last.get_mut();
            e.1 = e.1.max((first + samples).saturating_sub(e.0));
            return;
        }
        let e = self.epochs.entry(epoch).or_insert((first, 0));
        e.1 = e.1.max((first + samples).saturating_sub(e.0));
        if self.epochs.len() > COUNTED_EPOCHS
            && let Some((_, (first, n))) = self.epochs.pop_first()
        {
            self.done += self.of(first, n);
            self.done_samples += self.kept(first, n);
        }
    }

    /// Samples from `at` on were not its after all (decoupled pace: they
    /// were taken back, and come replayed).
    pub(super) fn rewind(&mut self, at: Position) {
        self.epochs.retain(|&e, _| e <= at.epoch);
        if let Some((first, n)) = self.epochs.get_mut(&at.epoch) {
            *n = (*n).min(at.sample.saturating_sub(*first));
        }
    }

    /// Starts counting again from `skip` (it merged back there).
    pub(super) fn resume_at(&mut self, skip: Position) {
        self.skip = Some(skip);
    }

    /// Its batches among `samples` of one epoch from sample `first` on.
    fn of(&self, first: u64, samples: u64) -> u64 {
        if let Some(d) = self.deal {
            return d.own_within(first, first + samples).0;
        }
        if self.drop_last {
            samples / self.size
        } else {
            samples.div_ceil(self.size)
        }
    }

    /// Its batches so far: the current epoch's counted as if it ended now.
    pub(super) fn batches(&self) -> u64 {
        self.done
            + self
                .epochs
                .values()
                .map(|&(first, n)| self.of(first, n))
                .sum::<u64>()
    }

    /// The samples of those batches (a dropped short one's not counted).
    pub(super) fn samples(&self) -> u64 {
        self.done_samples
            + self
                .epochs
                .values()
                .map(|&(first, n)| self.kept(first, n))
                .sum::<u64>()
    }

    /// Of `samples` of one epoch from `first` on, those in its batches.
    fn kept(&self, first: u64, samples: u64) -> u64 {
        if let Some(d) = self.deal {
            return d.own_within(first, first + samples).1;
        }
        if self.drop_last {
            samples / self.size * self.size
        } else {
            samples
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(epoch: u64, sample: u64) -> Position {
        Position { epoch, sample }
    }

    #[test]
    fn a_cut_restarts_on_the_consumers_own_batch_boundary() {
        let at = |anchor, q| Boundaries::new(anchor, 32).at_or_before(q);
        // Batches of 32 from the epoch's start: the boundary at or before.
        assert_eq!(at(p(0, 0), p(0, 100)), p(0, 96));
        assert_eq!(at(p(0, 0), p(0, 96)), p(0, 96));
        // Joined (or resumed) mid-epoch at 10: boundaries 10 + k·32 there,
        // k·32 in later epochs.
        assert_eq!(at(p(0, 10), p(0, 100)), p(0, 74));
        assert_eq!(at(p(0, 10), p(1, 100)), p(1, 96));
        // An epoch's start is always a boundary; nothing before the anchor.
        assert_eq!(at(p(0, 10), p(2, 0)), p(2, 0));
        assert_eq!(at(p(3, 0), p(1, 50)), p(3, 0));
        assert_eq!(at(p(0, 10), p(0, 10)), p(0, 10));
    }

    #[test]
    fn a_cut_group_member_restarts_at_its_own_run() {
        // Rank 0 of 2, runs of 8 (rank 0's 64-72, 80-88; rank 1's 72-80),
        // epochs of 203: full rounds to 192, a tail of 11 split 6 + 5
        // (192-198 rank 0's, 198-203 rank 1's).
        let b = Boundaries::new(p(0, 0), 8);
        let zero = Deal::new(203, 8, (0, 2, 1), false);
        let one = Deal::new(203, 8, (1, 2, 1), false);
        // Cut having taken rank 1's unit 72-80 or not: its next run at 80
        // either way (the client's batcher stands there once it has cut
        // its run 64-72). The flat boundary rule said 80 or 72.
        assert_eq!(b.restart(p(1, 72), Some(&zero)), p(1, 80));
        assert_eq!(b.restart(p(1, 80), Some(&zero)), p(1, 80));
        assert_eq!(b.restart(p(1, 76), Some(&zero)), p(1, 80));
        // Inside its own run: that run's start (part of it was taken).
        assert_eq!(b.restart(p(1, 84), Some(&zero)), p(1, 80));
        // The tail: rank 1's run 198-203 began in the unit 192-200, so a
        // cut losing 200 restarts at 198 (the flat rule: 200, which no
        // run of its begins at).
        assert_eq!(b.restart(p(1, 200), Some(&one)), p(1, 198));
        assert_eq!(b.restart(p(1, 200), None), p(1, 200));
        // Past its last run of the epoch: the next epoch's first.
        assert_eq!(b.restart(p(1, 200), Some(&zero)), p(2, 0));
        assert_eq!(b.restart(p(1, 192), Some(&one)), p(1, 198));
        // Never before the anchor.
        let resumed = Boundaries::new(p(1, 88), 8);
        assert_eq!(resumed.restart(p(1, 72), Some(&one)), p(1, 88));
    }

    #[test]
    fn a_cut_never_restarts_before_the_last_merge() {
        let mut place = CutPlace::new(p(0, 10), 32, None);
        assert_eq!(place.restart(p(0, 100)), p(0, 74));
        assert_eq!(place.restart(p(0, 5)), p(0, 10), "not before the anchor");
        // Merged back at 80 (inside its batch 74-106): it has all before.
        place.merged(p(0, 80));
        assert_eq!(place.restart(p(0, 100)), p(0, 80));
        assert_eq!(place.restart(p(0, 120)), p(0, 106));
        // A lockstep joiner replayed its epoch's start up to its boundary
        // at 8 (the shared stream began for it at 7): a cut losing 7 goes
        // on at 8, not 6 (it has 6 and 7, replayed).
        let joiner = CutPlace::new(p(3, 0), 2, None).skipping(Some(p(3, 8)));
        assert_eq!(joiner.restart(p(3, 7)), p(3, 8));
        assert_eq!(joiner.restart(p(3, 9)), p(3, 8));
        assert_eq!(joiner.restart(p(3, 11)), p(3, 10));
        // A member's place: its runs, not its batch size from the anchor.
        let one = Deal::new(203, 8, (1, 2, 1), false);
        let member = CutPlace::new(p(0, 0), 8, Some(one));
        assert_eq!(member.restart(p(1, 200)), p(1, 198));
        assert_eq!(member.restart(p(1, 16)), p(1, 24));
    }

    #[test]
    fn replay_ends_on_the_consumers_own_batch_boundary() {
        // Epochs of 100 samples; the shared stream starts at sample 40.
        assert_eq!(
            replay_end(p(0, 0), p(0, 40), (32, None), 100),
            Some(p(0, 64))
        );
        assert_eq!(
            replay_end(p(0, 0), p(0, 40), (8, None), 100),
            Some(p(0, 40))
        );
        // The boundary past the epoch's end: the whole epoch is replayed.
        assert_eq!(
            replay_end(p(0, 0), p(0, 90), (64, None), 100),
            Some(p(1, 0))
        );
        // Resuming mid-epoch: boundaries counted from the resume point.
        assert_eq!(
            replay_end(p(0, 10), p(0, 40), (32, None), 100),
            Some(p(0, 42))
        );
        // From an earlier epoch: boundaries of the shared epoch's own.
        assert_eq!(
            replay_end(p(0, 10), p(1, 40), (32, None), 100),
            Some(p(1, 64))
        );
        // At an epoch's start: replay up to it.
        assert_eq!(replay_end(p(0, 0), p(1, 0), (7, None), 100), Some(p(1, 0)));
        // Nothing published before the start, or a start ahead.
        assert_eq!(replay_end(p(0, 0), p(0, 0), (32, None), 100), None);
        assert_eq!(replay_end(p(2, 5), p(1, 40), (32, None), 100), None);
        // A group member (2 ranks, runs of 16: rounds of 32, a tail of 4
        // split 2 + 2): the first boundary of anyone's run.
        let deal = Deal::new(100, 16, (1, 2, 1), false);
        let member = |from, shared| replay_end(from, shared, (16, Some(&deal)), 100);
        assert_eq!(member(p(0, 0), p(0, 40)), Some(p(0, 48)));
        assert_eq!(member(p(0, 0), p(0, 48)), Some(p(0, 48)));
        assert_eq!(member(p(0, 16), p(0, 97)), Some(p(0, 98)));
        assert_eq!(member(p(0, 16), p(0, 99)), Some(p(1, 0)));
        // Only another's run lies between (rank 0's 0-16, 32-48): nothing
        // to replay.
        assert_eq!(member(p(0, 0), p(0, 16)), None);
        assert_eq!(member(p(0, 32), p(0, 40)), None);
        assert_eq!(member(p(0, 32), p(0, 56)), Some(p(0, 64)));
        let dropping = Deal::new(100, 16, (1, 2, 1), true);
        assert_eq!(
            replay_end(p(0, 0), p(0, 97), (16, Some(&dropping)), 100),
            Some(p(0, 97)),
            "a dropped tail holds no run"
        );
    }

    #[test]
    fn the_counter_counts_batches_in_the_consumers_own_size() {
        let mut c = BatchCounter::new(32, false);
        c.add(0, 0, 100);
        assert_eq!((c.batches(), c.samples()), (4, 100));
        let mut d = BatchCounter::new(32, true).skipping(Some(p(0, 36)));
        d.add(0, 0, 100);
        assert_eq!((d.batches(), d.samples()), (2, 64));
        d.rewind(p(0, 68));
        assert_eq!((d.batches(), d.samples()), (1, 32));
    }
}
