//! A consumer's replayed batches (`join = "now"`, or resuming behind the
//! stream): the broker recomputes the part of the stream between its start
//! and where the shared stream carries on for it into an arena of its own,
//! and sends those batches in order. They are handed out first; the shared
//! units before `to` are given back unread by the batcher
//! ([`crate::batcher::Batcher::skip_to`]).

use std::collections::VecDeque;

use super::{Consumer, Next};
use crate::batcher::Run;
use crate::error::{Error, Result};
use crate::proto::{self, EpochEnd, Position, ReplayGrant, ReplayReady};

/// Replayed batches received and not yet handed out.
#[derive(Debug)]
pub(super) struct Replaying {
    /// Where the next replayed batch must start, and where replay ends.
    at: Position,
    to: Position,
    from: Position,
    next_seq: u64,
    pub(super) queue: VecDeque<Next>,
}

impl Replaying {
    pub(super) fn new(grant: &ReplayGrant) -> Replaying {
        Replaying {
            at: grant.from,
            to: grant.to,
            from: grant.from,
            next_seq: 0,
            queue: VecDeque::new(),
        }
    }

    /// Every replayed batch arrived.
    pub(super) fn received(&self) -> bool {
        self.at >= self.to
    }

    /// The releases of what was received and not handed out (leaving).
    pub(super) fn unread(self) -> impl Iterator<Item = u64> {
        self.queue.into_iter().filter_map(|n| match n {
            Next::Replayed(run) => Some(run.first_seq | proto::REPLAYED),
            _ => None,
        })
    }
}

impl Consumer {
    /// The next thing to hand out: a failure first, then replayed batches
    /// until replay is done, then the shared stream's.
    pub(super) fn front(&self) -> Option<&Next> {
        match (&self.replay, self.next.front()) {
            (_, Some(f @ Next::Fail(_))) => Some(f),
            (Some(r), _) => r.queue.front(),
            (None, f) => f,
        }
    }

    pub(super) fn pop_front(&mut self) -> Option<Next> {
        if matches!(self.next.front(), Some(Next::Fail(_))) {
            return self.next.pop_front();
        }
        let Some(r) = self.replay.as_mut() else {
            return self.next.pop_front();
        };
        let n = r.queue.pop_front();
        if r.received() && r.queue.is_empty() {
            self.replay = None;
        }
        n
    }

    /// A replayed batch arrived: checked to be the next one, at the place
    /// where the last one ended.
    pub(super) fn take_replayed(&mut self, m: ReplayReady) -> Result<()> {
        let size = self.shared.welcome.batch_size;
        let per_epoch = self.shared.welcome.schema.samples_per_epoch;
        let Some(r) = self.replay.as_mut() else {
            return Err(Error::Unexpected(format!(
                "replayed batch {} without replay, or after its end",
                m.seq
            )));
        };
        let ends = m.first.checked_add(m.samples) == Some(per_epoch);
        if m.seq != r.next_seq
            || (Position {
                epoch: m.epoch,
                sample: m.first,
            }) != r.at
            || m.samples == 0
            || m.samples > size
            || m.first + m.samples > per_epoch
            || m.ends_epoch != ends
            || r.received()
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
        r.at = r.at.advance(m.samples, per_epoch);
        if self.shared.welcome.drop_last && m.samples < size {
            // An epoch's short last batch, dropped as asked.
            self.shared
                .give_back(&[m.seq | proto::REPLAYED], Default::default())?;
        } else {
            r.queue.push_back(Next::Replayed(Run {
                epoch: m.epoch,
                index: m.first / size,
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
