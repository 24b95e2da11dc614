//! A consumer's replayed batches (`join = "now"`, or resuming behind the
//! stream): the broker recomputes the part of the stream between its start
//! and where the shared stream carries on for it into an arena of its own,
//! and sends those batches in order. They are handed out first; the shared
//! units before `to` are given back unread by the batcher
//! ([`crate::batcher::Batcher::skip_to`]).
//!
//! Decoupled pace: a consumer that fell behind by more than the run-ahead
//! budget is cut from the shared stream ([`ServerMsg::Cut`](crate::proto::ServerMsg)):
//! it drops the batch it was building, and replay goes on from where that
//! batch began, with no end until the broker merges it back
//! ([`ServerMsg::Merge`](crate::proto::ServerMsg)) at a batch boundary
//! where the shared stream still holds the units.

use std::collections::VecDeque;
use std::sync::Arc;

use super::Next;
use super::events::Inbox;
use crate::batch::Shared;
use crate::batcher::Run;
use crate::deal::Deal;
use crate::error::{Error, Result};
use crate::proto::{EpochEnd, Position, ReplayGrant, ReplayReady, ServerMsg, Unit};
use crate::rotation::{self, Rotation};

/// A consumer's replay: the one in progress, where replay began, and the
/// seq of the next replayed batch (replay may come in several stretches,
/// decoupled pace).
#[derive(Debug)]
pub(super) struct Replay {
    /// In progress: its batches go out before the shared stream's.
    pub(super) active: Option<Replaying>,
    pub(super) from: Option<Position>,
    pub(super) seq: u64,
}

/// Replayed batches received and not yet handed out.
#[derive(Debug)]
pub(super) struct Replaying {
    /// Where the next replayed batch must start, and where replay ends
    /// (`None`: not known yet, a cut's replay before its merge).
    at: Position,
    to: Option<Position>,
    /// Where the consumer began (for epochs' completeness).
    from: Position,
    pub(super) next_seq: u64,
    pub(super) queue: VecDeque<Next>,
    /// A group member's share: it is replayed its own runs only, and
    /// `at` stands at the start of its next one.
    deal: Option<Deal>,
    /// `at`'s epoch, or a later one, is replayed rotated
    /// ([`crate::rotation`]).
    rotation: Option<Rotation>,
}

impl Replaying {
    pub(super) fn new(grant: &ReplayGrant, deal: Option<Deal>) -> Replaying {
        let mut r = Replaying {
            at: grant.from,
            to: Some(grant.to),
            from: grant.from,
            next_seq: 0,
            queue: VecDeque::new(),
            deal,
            rotation: None,
        };
        r.seek_own_run();
        r
    }

    /// The consumer began at `from` (before a reconnect): the epochs this
    /// stretch ends are complete from there.
    pub(super) fn began_at(&mut self, from: Position) {
        self.from = self.from.min(from);
    }

    /// An open stretch (a cut's, until the broker merges or rotates it).
    pub(super) fn open(&self) -> bool {
        self.to.is_none()
    }

    /// Where the next replayed batch must start.
    pub(super) fn at(&self) -> Position {
        self.at
    }

    /// The stretch ends at `to`.
    pub(super) fn end_at(&mut self, to: Position) {
        self.to = Some(to);
    }

    /// A group member's `at` moves to the start of its next own run (past
    /// where replay ends if it has none).
    fn seek_own_run(&mut self) {
        let Some(deal) = self.deal else {
            return;
        };
        // A cut's replay has no end yet: to the member's next run,
        // whichever epoch holds it.
        let end = self.to.unwrap_or(Position {
            epoch: u64::MAX,
            sample: 0,
        });
        self.at = deal.seek_own_run(self.at, end);
    }

    /// The batch that must come next from `at` on: its samples, and
    /// whether it is the consumer's last of its epoch.
    fn expected(&self, size: u64, per_epoch: u64) -> (u64, bool) {
        match self.deal {
            None => {
                let step = rotation::step(self.at, size, per_epoch, self.rotation);
                (step.samples, step.ends_epoch)
            }
            Some(deal) => deal
                .next_own(self.at.sample)
                .filter(|run| run.start == self.at.sample)
                .map_or((0, false), |run| {
                    // Within the epoch where replay ends, the end of the
                    // epoch comes with the shared stream's (a cut's replay
                    // has no end yet: its epochs end in it, as the
                    // broker's stream-end limit lies past them).
                    let later = self.to.is_none_or(|to| to.epoch > self.at.epoch);
                    (run.end - run.start, later && deal.ends_epoch(&run))
                }),
        }
    }

    /// Every replayed batch arrived.
    pub(super) fn received(&self) -> bool {
        self.to.is_some_and(|to| self.at >= to)
    }
}

impl Inbox {
    /// The next thing to hand out: a failure first, then replayed batches
    /// until replay is done, then the shared stream's.
    pub(super) fn front(&self) -> Option<&Next> {
        match (&self.replay.active, self.next.front()) {
            (_, Some(f @ Next::Fail(_))) => Some(f),
            (Some(r), _) => r.queue.front(),
            (None, f) => f,
        }
    }

    pub(super) fn pop_front(&mut self) -> Option<Next> {
        if matches!(self.next.front(), Some(Next::Fail(_))) {
            return self.next.pop_front();
        }
        let Some(r) = self.replay.active.as_mut() else {
            return self.next.pop_front();
        };
        let n = r.queue.pop_front();
        if r.received() && r.queue.is_empty() {
            self.replay.seq = r.next_seq;
            self.replay.active = None;
        }
        n
    }

    /// Cut from the shared stream at `restart`: ends of epochs read among
    /// the batches taken back count if they end epochs before it; the
    /// batch being built is dropped (it must begin at `restart`); what is
    /// waiting to be handed out goes first, then replay from `restart`.
    pub(super) fn take_cut(&mut self, shared: &Arc<Shared>, restart: Position) -> Result<()> {
        for e in std::mem::take(&mut self.place.deferred) {
            if e.epoch < restart.epoch {
                self.take_message(shared, ServerMsg::EndOfEpoch(e))?;
            }
        }
        // A rotated epoch's start, replayed after the shared stream's part
        // (its batches all cut): the batcher stands past the epoch's end.
        let rot = self
            .place
            .rotated
            .receiving
            .take()
            .filter(|r| r.epoch == restart.epoch);
        let mut give = Vec::new();
        // Compared as this consumer's next run: a group member's restart
        // may fall at the end of its last run or at the start of its
        // next, with others' runs between (whether it took those units
        // before the cut), the same run either way.
        let (at, totals, want, past_epoch) = {
            let mut b = shared.batching.lock().unwrap_or_else(|p| p.into_inner());
            let at = b.batcher.cut(&mut give);
            let want = b.batcher.own_from((restart.epoch, restart.sample));
            let past_epoch = rot.map(|r| b.batcher.own_from((r.epoch + 1, 0)));
            (at, std::mem::take(&mut b.totals), want, past_epoch)
        };
        shared.give_back(give.into_iter().map(Unit::Shared), totals)?;
        let owed = rot
            .is_some_and(|r| r.owed_from() == restart && at.is_none_or(|a| Some(a) == past_epoch));
        if !owed
            && let Some((epoch, sample)) = at
            && (epoch, sample) != want
        {
            return Err(Error::Unexpected(format!(
                "the broker replays this consumer from epoch {} sample {}, but its next batch begins at epoch {epoch} sample {sample}",
                restart.epoch, restart.sample
            )));
        }
        let from = *self
            .replay
            .from
            .get_or_insert(self.place.started_at.unwrap_or(restart));
        tracing::debug!(?restart, "cut from the shared stream; replay follows");
        // A rotated epoch's start is replayed after a later part of it.
        if let Some(r) = &self.replay.active
            && (!r.received() || (r.at > restart && !owed))
        {
            return Err(Error::Unexpected(format!(
                "cut at epoch {} sample {} before its last replay was all received",
                restart.epoch, restart.sample
            )));
        }
        let deal = self.deal;
        let r = self.replay.active.get_or_insert_with(|| Replaying {
            at: restart,
            to: None,
            from,
            next_seq: self.replay.seq,
            queue: VecDeque::new(),
            deal,
            rotation: None,
        });
        r.at = restart;
        r.to = None;
        r.rotation = rot;
        r.seek_own_run();
        r.queue.extend(self.next.drain(..));
        Ok(())
    }

    /// Replay ends at `at`; the shared stream's samples from there are
    /// this consumer's.
    pub(super) fn take_merge(&mut self, shared: &Shared, at: Position) -> Result<()> {
        let Some(r) = self
            .replay
            .active
            .as_mut()
            .filter(|r| r.to.is_none() && r.at <= at)
        else {
            return Err(Error::Unexpected(format!(
                "merged at epoch {} sample {} without a replay open before there",
                at.epoch, at.sample
            )));
        };
        r.to = Some(at);
        // Merged inside a rotated epoch's part read first: the shared
        // stream's end of it is not the epoch's.
        self.place.rotated.receiving = r.rotation.filter(|rot| rot.epoch == at.epoch);
        if r.received() && r.queue.is_empty() {
            // Everything replayed was handed out already.
            self.replay.seq = r.next_seq;
            self.replay.active = None;
        }
        self.place.skip = Some(at);
        let mut b = shared.batching.lock().unwrap_or_else(|p| p.into_inner());
        b.batcher.skip_to(at.epoch, at.sample);
        drop(b);
        tracing::debug!(?at, "merged back into the shared stream");
        Ok(())
    }

    /// A replayed batch arrived: checked to be the next one, at the place
    /// where the last one ended.
    pub(super) fn take_replayed(&mut self, shared: &Shared, m: ReplayReady) -> Result<()> {
        let size = shared.welcome.batch_size;
        let per_epoch = shared.welcome.schema.samples_per_epoch;
        let Some(r) = self.replay.active.as_mut() else {
            return Err(Error::Unexpected(format!(
                "replayed batch {} without replay, or after its end",
                m.seq
            )));
        };
        let (samples, ends) = r.expected(size, per_epoch);
        if m.seq != r.next_seq
            || (Position {
                epoch: m.epoch,
                sample: m.first,
            }) != r.at
            || m.samples == 0
            || m.samples != samples
            || m.ends_epoch != ends
            || r.received()
            || r.to
                .is_some_and(|to| r.at.advance(m.samples, per_epoch) > to)
        {
            return Err(Error::Unexpected(format!(
                "replayed batch {} ({} samples of epoch {} from {}) does not follow batch {} ending at {:?}",
                m.seq,
                m.samples,
                m.epoch,
                m.first,
                r.next_seq.wrapping_sub(1),
                r.at
            )));
        }
        r.next_seq += 1;
        if r.deal.is_some() {
            r.at = r.at.advance(m.samples, per_epoch);
            r.seek_own_run();
        } else {
            let step = rotation::step(r.at, m.samples, per_epoch, r.rotation);
            (r.at, r.rotation) = (step.next, step.rotation);
        }
        // A group member's runs are its batches: its share of the tail is
        // short, and dropped already with `drop_last` (never sent).
        let index = r.deal.and_then(|d| d.run_at(m.first)).map(|d| d.index);
        if shared.welcome.drop_last && m.samples < size && index.is_none() {
            // An epoch's short last batch, dropped as asked.
            shared.give_back([Unit::Replayed(m.seq)], Default::default())?;
        } else {
            r.queue.push_back(Next::Replayed(Run {
                epoch: m.epoch,
                index: index.unwrap_or(m.first / size),
                first: m.first,
                position: m.seq * size,
                samples: m.samples,
                first_seq: m.seq,
                last_seq: m.seq,
            }));
        }
        if m.ends_epoch {
            r.queue.push_back(Next::EndOfEpoch(EpochEnd {
                epoch: m.epoch,
                batches: 0, // counted when handed out
                complete: r.from
                    <= Position {
                        epoch: m.epoch,
                        sample: 0,
                    },
            }));
        }
        Ok(())
    }
}
