//! Replay: batches recomputed for one consumer alone. A stream the broker
//! computes is a pure function of `(seed, epoch, dataset index)`
//! (`StreamPlan::epoch_order`, `SlotWriter`), so any part of it can be made
//! again, byte for byte, into a small arena of that consumer's own.
//!
//! A consumer that joins with `join = "now"` (from the start of the epoch
//! in progress), or resumes from a position behind the stream, joins the
//! hub at once, like `immediate`. What lies between its start and the
//! first of its own batch boundaries at or past where the shared stream
//! begins for it ([`replay_end`]) is replayed; its client gives back the
//! shared samples before that boundary unread, and hands out the replayed
//! batches first, then the shared ones: every sample once, in order.
//!
//! # Rules
//!
//! * Replayed batches are made by the pipeline threads, in any order and
//!   on any thread, and sent in order (`seq` 0, 1, …).
//! * Its arena is a ring of `slots` batches of the consumer's batch size:
//!   batch `seq` at ring position `seq × batch_size`. A batch is started
//!   only once the batch `slots` before it was released, so no batch the
//!   consumer may read is ever written.
//! * A release names a batch sent and not yet released, or it ends that
//!   consumer (alone), as a bad release of a shared unit does.
//! * Fairness: a pipeline thread that could make a shared batch and made a
//!   replayed one last makes the shared one; at most half the threads (at
//!   least one) replay while the shared pipeline could go on. Replay is
//!   paced by its consumer's releases, so what it costs is bounded by what
//!   that consumer reads.
//! * Lockstep: the consumer is a member of the hub while it replays, so
//!   the shared units it has not reached yet pin the ring like any other
//!   consumer's, and the lag limit applies to it as to anyone.
//! * Decoupled pace: it is never waited for while it is replayed to. It
//!   starts cut from the shared stream (nothing shared is owed to it), its
//!   replay is open from its start, and it merges back like any cut
//!   consumer ([`super::decouple`]): what the ring still holds when its
//!   replay gets there is not recomputed.
//! * Its memory is taken from the broker's budget for the consumer's uid,
//!   and given back when the last replayed batch is released or it leaves.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use batchcast::JoinPolicy;
use batchcast::mailbox::Notice;
use batchcast::proto::{ErrorCode, Position, ReplayGrant, ReplayReady, ServerMsg};
use batchcast::schema::{RingLayout, Schema};
use batchcast::shm::{Arena, Fault, Mapping, RingView};

use super::deliver::{
    Conn, ConsumeRequest, Ending, SubscribeError, end_consumer, end_mailbox_consumer, send,
};
use super::{Inner, Stream};
use crate::budget::{Grant, Use};
use crate::config::Pace;
use crate::hub::ConsumerId;

/// Where replay ends for a consumer of batch size `batch` that starts at
/// `from`, when the shared stream carries on for it from `shared`: its
/// first batch boundary (counted from `from`, or from the epoch's start)
/// at or past `shared`, or the end of that epoch. `None`: nothing to
/// replay.
pub(super) fn replay_end(
    from: Position,
    shared: Position,
    batch: u64,
    per_epoch: u64,
) -> Option<Position> {
    if from >= shared {
        return None;
    }
    if shared.sample == 0 {
        return Some(shared);
    }
    let base = if from.epoch == shared.epoch {
        from.sample
    } else {
        0
    };
    let end = base + (shared.sample - base).div_ceil(batch.max(1)) * batch.max(1);
    Some(
        Position {
            epoch: shared.epoch,
            sample: 0,
        }
        .advance(end, per_epoch),
    )
}

/// Batches in the replay arena of a consumer with `window`: its window,
/// one being made, and one more so two threads can work ahead. Its
/// mailbox and outbox have room for as many more messages.
pub(super) fn slots(window: u32) -> u32 {
    window.saturating_add(2)
}

/// A replay arena made before the consumer joins (outside the hub's lock).
#[derive(Debug)]
pub(super) struct Prepared {
    arena: Arena,
    rings: Arc<Mapping>,
    layout: RingLayout,
    slots: u32,
    grant: Grant,
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    OverBudget(#[from] crate::budget::OverBudget),
    #[error("cannot make its replay arena: {0}")]
    Arena(#[from] batchcast::Error),
    #[error("replayed batch {seq} is not held by this consumer (already released, or never sent)")]
    NotHeld { seq: u64 },
}

impl Stream {
    /// Whether this request may need replay: `Some(None)` to replay the
    /// epoch in progress (`join = "now"`), `Some(Some(p))` to start at
    /// `p`; refused for what cannot replay, with what to do instead.
    pub(super) fn replay_request(
        &self,
        req: &ConsumeRequest,
    ) -> Result<Option<Option<Position>>, SubscribeError> {
        let wanted = match (req.resume, req.join) {
            (Some(p), _) => Some(Some(p)),
            (None, JoinPolicy::Now) => Some(None),
            (None, _) => None,
        };
        if wanted.is_none() {
            return Ok(None);
        }
        let what = match req.resume {
            Some(p) => format!("resuming at epoch {} sample {}", p.epoch, p.sample),
            None => "join=\"now\"".to_string(),
        };
        let refuse = |why: String| Err(SubscribeError::Replay(ReplayError::Refused(why)));
        if self.writer.is_none() {
            return refuse(format!(
                "{what} needs replay, and stream `{}` is fed by an external producer: its batches cannot be recomputed; join \"next-epoch\" or \"immediate\" instead",
                self.name()
            ));
        }
        if req.device.is_some() {
            return refuse(format!(
                "{what} needs replay, which serves host memory only for now; use device=\"cpu\", or join \"next-epoch\""
            ));
        }
        if let Some(p) = req.resume {
            let per_epoch = self.plan.schema.samples_per_epoch;
            if p.sample >= per_epoch {
                return refuse(format!(
                    "{what}: an epoch of stream `{}` has {per_epoch} samples (0 to {})",
                    self.name(),
                    per_epoch.saturating_sub(1)
                ));
            }
            if let Some(epochs) = self.plan.epochs
                && p.epoch >= epochs
            {
                return refuse(format!(
                    "{what}: stream `{}` has {epochs} epochs (0 to {})",
                    self.name(),
                    epochs.saturating_sub(1)
                ));
            }
        }
        Ok(wanted)
    }

    /// Consumer `id` just joined: where the shared stream begins for it
    /// decides what is replayed. `prepared`: its replay arena, if it may
    /// need one (it asked for replay, or the stream's pace is decoupled:
    /// then the arena stays, for the replay a cut begins).
    pub(super) fn start_replay(
        &self,
        inner: &mut Inner,
        id: ConsumerId,
        replaying: Option<Option<Position>>,
        prepared: Option<Prepared>,
        batch: u64,
    ) -> Result<Started, SubscribeError> {
        let (epoch, index) = inner.hub.first_batch(id).expect("it just joined");
        let shared = Position {
            epoch,
            sample: index * self.plan.schema.batch_size,
        };
        let from = match replaying {
            Some(resume) => resume.unwrap_or(Position { epoch, sample: 0 }),
            None => shared,
        };
        let Some(prepared) = prepared else {
            return Ok(Started {
                skip: replaying.flatten(),
                anchor: from,
                ..Started::default()
            });
        };
        let keep = self.plan.pace == Pace::Decoupled;
        let limit = Position {
            epoch: self.plan.epochs.unwrap_or(u64::MAX),
            sample: 0,
        };
        let per_epoch = self.plan.schema.samples_per_epoch;
        let to = match replay_end(from, shared, batch, per_epoch) {
            Some(to) => to,
            // Nothing to replay; a resume point ahead is skipped to.
            None if keep => from.max(shared),
            None => {
                return Ok(Started {
                    skip: replaying.flatten(),
                    anchor: from,
                    ..Started::default()
                });
            }
        };
        if keep && from < to {
            return self.start_cut(inner, id, prepared, (from, batch), limit);
        }
        let (replay, grant, fd) = prepared.start((from, to), batch, per_epoch, (keep, limit))?;
        if from < to {
            tracing::info!(stream = %self.name(), consumer = id, ?from, ?to, "replaying");
            self.work_cv.notify_all();
        }
        Ok(Started {
            replay: Some(replay),
            grant: Some((grant, fd)),
            skip: Some(to),
            anchor: from.min(to),
            cut: None,
        })
    }

    /// Decoupled pace: a consumer that needs replay to start at `from`
    /// starts cut from the shared stream, so nothing shared waits for it
    /// while it is replayed to (it may pause there like anywhere). Its
    /// replay is open from `from`, and it merges back like any cut
    /// consumer ([`super::decouple`]); its welcome grants the arena with
    /// nothing to replay (`from == to`), and the cut notice follows it.
    fn start_cut(
        &self,
        inner: &mut Inner,
        id: ConsumerId,
        prepared: Prepared,
        (from, batch): (Position, u64),
        limit: Position,
    ) -> Result<Started, SubscribeError> {
        inner.hub.cut_at_join(id)?;
        let per_epoch = self.plan.schema.samples_per_epoch;
        let (mut replay, grant, fd) =
            prepared.start((from, from), batch, per_epoch, (true, limit))?;
        replay.reopen(from);
        tracing::info!(stream = %self.name(), consumer = id, ?from, "replaying, cut from the shared stream until it merges back");
        self.work_cv.notify_all();
        Ok(Started {
            replay: Some(replay),
            grant: Some((grant, fd)),
            skip: Some(from),
            anchor: from,
            cut: Some(from),
        })
    }

    /// A replay arena for a consumer of batch size `batch` and `window`:
    /// [`slots`] of its batches.
    pub(super) fn prepare_replay(
        &self,
        batch: u64,
        window: u32,
        uid: u32,
        whom: &str,
    ) -> Result<Prepared, ReplayError> {
        let slots = slots(window);
        let schema = Schema {
            batch_size: batch,
            ..self.plan.schema.clone()
        };
        let layout = RingLayout::for_schema(&schema, slots)?;
        let grant = self
            .budget
            .take(uid, Use::Replay, layout.arena_bytes, whom)?;
        // Made while the broker serves others: allocated at once, faulted
        // in as the pipeline writes (see `Stream::start`).
        let arena = Arena::create(
            &format!("{}-replay", self.name()),
            layout.arena_bytes,
            Fault::Lazily,
        )?;
        let rings =
            Mapping::rings_faulted(arena.fd(), &RingView::of(&layout), true, Fault::Lazily)?;
        arena.seal_writes()?;
        Ok(Prepared {
            arena,
            rings: Arc::new(rings),
            layout,
            slots,
            grant,
        })
    }
}

impl Prepared {
    /// Starts replaying `from..to` in batches of `batch`; the grant for the
    /// welcome and the fd the consumer maps. `keep`: the arena stays once
    /// that is done (decoupled pace: replay may start again, up to `limit`,
    /// the stream's end).
    pub(super) fn start(
        self,
        (from, to): (Position, Position),
        batch: u64,
        per_epoch: u64,
        (keep, limit): (bool, Position),
    ) -> Result<(Replay, ReplayGrant, OwnedFd), ReplayError> {
        let fd = self
            .arena
            .fd()
            .try_clone_to_owned()
            .map_err(|e| ReplayError::Arena(e.into()))?;
        let grant = ReplayGrant {
            rings: self.layout.clone(),
            from,
            to,
        };
        let replay = Replay {
            rings: self.rings,
            layout: self.layout,
            batch,
            slots: self.slots,
            per_epoch,
            cursor: from,
            to: Some(to),
            limit,
            keep,
            next_seq: 0,
            live: BTreeMap::new(),
            sent: 0,
            _arena: self.arena,
            _grant: self.grant,
        };
        Ok((replay, grant, fd))
    }
}

/// What a consumer that just joined gets of replay: the replay itself, the
/// grant and arena fd for its welcome, and where its shared samples begin
/// to count (the end of its replay, or a resume point ahead).
#[derive(Debug, Default)]
pub(super) struct Started {
    pub(super) replay: Option<Replay>,
    pub(super) grant: Option<(ReplayGrant, OwnedFd)>,
    pub(super) skip: Option<Position>,
    /// Where its first batch begins: its batches' boundaries are counted
    /// from there in that epoch (from each epoch's start after).
    pub(super) anchor: Position,
    /// Decoupled pace: it starts cut, replayed to from here (its client is
    /// told so once it is connected).
    pub(super) cut: Option<Position>,
}

/// One consumer's replay in progress.
#[derive(Debug)]
pub(super) struct Replay {
    rings: Arc<Mapping>,
    layout: RingLayout,
    batch: u64,
    slots: u32,
    per_epoch: u64,
    /// The next batch to start, and where replay ends (`None`: open, a
    /// cut consumer's until it merges back; never past `limit`, the
    /// stream's end).
    pub(super) cursor: Position,
    pub(super) to: Option<Position>,
    limit: Position,
    /// Decoupled pace: the arena stays when a stretch of replay is done.
    pub(super) keep: bool,
    next_seq: u64,
    /// Batches started and not released, by seq.
    live: BTreeMap<u64, Entry>,
    /// Batches below this were sent.
    sent: u64,
    _arena: Arena,
    _grant: Grant,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    epoch: u64,
    first: u64,
    samples: u64,
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Making,
    Made,
    Sent,
}

/// A replayed batch for a pipeline thread to make: `samples` samples of
/// `epoch` from sample `first` on, into `spans` of `rings`.
#[derive(Debug)]
pub(super) struct ReplayJob {
    pub(super) id: ConsumerId,
    pub(super) seq: u64,
    pub(super) epoch: u64,
    pub(super) first: u64,
    pub(super) samples: u64,
    pub(super) rings: Arc<Mapping>,
    /// Per field: offset and length in `rings`.
    pub(super) spans: Vec<(u64, u64)>,
}

impl Replay {
    /// Where this stretch of replay stops.
    fn end(&self) -> Position {
        self.to.unwrap_or(self.limit).min(self.limit)
    }

    /// A stretch of replay is under way (batches are still to start).
    pub(super) fn running(&self) -> bool {
        self.cursor < self.end()
    }

    /// Every batch started was sent.
    pub(super) fn settled(&self) -> bool {
        self.sent == self.next_seq
    }

    /// An open stretch (a cut consumer's, until it merges back).
    pub(super) fn open(&self) -> bool {
        self.to.is_none()
    }

    /// Opens a stretch from `from` (the consumer was cut from the shared
    /// stream there); seqs go on from the last stretch's.
    pub(super) fn reopen(&mut self, from: Position) {
        self.cursor = from;
        self.to = None;
    }

    fn can_start(&self) -> bool {
        let oldest = self.live.keys().next().copied().unwrap_or(self.next_seq);
        self.running() && self.next_seq < oldest + u64::from(self.slots)
    }

    /// Waits for its consumer to release a batch.
    fn blocked(&self) -> bool {
        self.running() && !self.can_start()
    }

    fn start(&mut self, id: ConsumerId) -> ReplayJob {
        let c = self.cursor;
        let samples = self.batch.min(self.per_epoch - c.sample);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.cursor = c.advance(samples, self.per_epoch);
        self.live.insert(
            seq,
            Entry {
                epoch: c.epoch,
                first: c.sample,
                samples,
                state: State::Making,
            },
        );
        let spans = (0..self.layout.fields.len())
            .map(|f| {
                self.layout
                    .span(f, seq * self.batch, samples)
                    .expect("a replayed batch lies in one slot of its ring")
            })
            .collect();
        ReplayJob {
            id,
            seq,
            epoch: c.epoch,
            first: c.sample,
            samples,
            rings: self.rings.clone(),
            spans,
        }
    }

    /// Every batch made and released, and no more to come.
    fn done(&self) -> bool {
        self.to.is_some() && !self.running() && self.live.is_empty()
    }
}

/// Takes a replayed batch for a pipeline thread to make, if one may start
/// (see the module's rules). `shared_first`: the thread made a replayed
/// batch last and the shared pipeline could go on.
pub(super) fn take_job(inner: &mut Inner, shared_first: bool) -> Option<ReplayJob> {
    let shared_waits = !inner.hub.can_start();
    if shared_first && !shared_waits {
        return None;
    }
    if inner.replaying >= replay_threads(inner.workers, shared_waits) {
        return None;
    }
    if inner
        .conns
        .values()
        .any(|c| c.replay.as_ref().is_some_and(Replay::blocked))
    {
        super::deliver::drain_replaying(inner);
    }
    let (&id, conn) = inner
        .conns
        .iter_mut()
        .filter(|(_, c)| wants_replay(c))
        .min_by_key(|(_, c)| c.replay.as_ref().map_or(0, |r| r.live.len()))?;
    let job = conn.replay.as_mut().expect("filtered").start(id);
    tracing::debug!(
        consumer = id,
        seq = job.seq,
        shared_waits,
        "replaying a batch"
    );
    inner.replaying += 1;
    Some(job)
}

/// How many of `workers` pipeline threads may make replayed batches at
/// once: at most half (at least one) while the shared pipeline could go
/// on, any number while it waits.
fn replay_threads(workers: u32, shared_waits: bool) -> u32 {
    if shared_waits {
        workers.max(1)
    } else {
        (workers / 2).max(1)
    }
}

/// Whether a replayed batch could start now for this consumer: not once
/// it said goodbye or was ended (it would never read it); the end of the
/// shared stream comes after its replayed batches, so that one counts not.
fn wants_replay(c: &Conn) -> bool {
    matches!(c.ending, None | Some(Ending::StreamEnded))
        && c.replay.as_ref().is_some_and(Replay::can_start)
}

/// Whether a replayed batch could start now.
pub(super) fn has_work(inner: &Inner) -> bool {
    inner.conns.values().any(wants_replay)
}

/// Whether some consumer is still being replayed to (its releases must be
/// taken even while the shared pipeline has nothing to do).
pub(super) fn active(inner: &Inner) -> bool {
    inner
        .conns
        .values()
        .any(|c| c.replay.as_ref().is_some_and(Replay::running))
}

/// A pipeline thread made replayed batch `seq` for consumer `id` (or
/// failed to: the source changed under the stream, and that consumer is
/// ended); what is made is sent in order.
pub(super) fn finish(
    inner: &mut Inner,
    id: ConsumerId,
    seq: u64,
    cpu: Duration,
    made: Result<(), String>,
) {
    inner.replaying = inner.replaying.saturating_sub(1);
    inner.replay_cpu += cpu;
    let Some(conn) = inner.conns.get_mut(&id) else {
        return; // it left meanwhile
    };
    conn.replay_cpu += cpu;
    if let Err(why) = made {
        conn.replay = None;
        let why = format!("replaying its batches failed: {why}");
        end_consumer(inner, id, ErrorCode::SourceFailed, why);
        return;
    }
    let Some(r) = conn.replay.as_mut() else {
        return;
    };
    if let Some(e) = r.live.get_mut(&seq) {
        e.state = State::Made;
    }
    let mut ready = Vec::new();
    while let Some(e) = r.live.get_mut(&r.sent).filter(|e| e.state == State::Made) {
        e.state = State::Sent;
        ready.push(ReplayReady {
            seq: r.sent,
            epoch: e.epoch,
            first: e.first,
            samples: e.samples,
            ends_epoch: e.first + e.samples == r.per_epoch,
        });
        r.sent += 1;
    }
    for m in ready {
        tracing::debug!(
            consumer = id,
            seq = m.seq,
            epoch = m.epoch,
            first = m.first,
            "replayed batch sent"
        );
        conn.replayed += m.samples;
        conn.replay_cut.add(m.epoch, m.first, m.samples);
        if let Some(why) = deliver(conn, id, m) {
            end_mailbox_consumer(inner, id, why);
            return;
        }
    }
}

/// Sends a replayed batch: a notice in its mailbox, else a message.
fn deliver(conn: &mut Conn, id: ConsumerId, ready: ReplayReady) -> Option<String> {
    match conn.mailbox.as_mut() {
        Some(mb) => match mb.push(&Notice::Replay(ready)) {
            Ok(()) => {
                mb.ring();
                None
            }
            Err(e) => Some(e.to_string()),
        },
        None => {
            send(conn, id, ServerMsg::Replay(ready));
            None
        }
    }
}

/// Consumer `id` released replayed batch `seq`.
pub(super) fn release(inner: &mut Inner, id: ConsumerId, seq: u64) -> Result<(), ReplayError> {
    let conn = inner
        .conns
        .get_mut(&id)
        .ok_or(ReplayError::NotHeld { seq })?;
    let r = conn.replay.as_mut().ok_or(ReplayError::NotHeld { seq })?;
    match r.live.get(&seq) {
        Some(e) if e.state == State::Sent => {
            r.live.remove(&seq);
        }
        _ => return Err(ReplayError::NotHeld { seq }),
    }
    if r.done() && !r.keep {
        // Its arena and budget go back now.
        conn.replay = None;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(epoch: u64, sample: u64) -> Position {
        Position { epoch, sample }
    }

    /// Docs (replay's limits): while the shared pipeline could go on, at
    /// most half the pipeline threads replay.
    #[test]
    fn at_most_half_the_threads_replay_while_the_shared_pipeline_could_go_on() {
        for (workers, could_go_on, waits) in
            [(1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 2, 4), (16, 8, 16)]
        {
            assert_eq!(
                replay_threads(workers, false),
                could_go_on,
                "{workers} threads"
            );
            assert_eq!(replay_threads(workers, true), waits, "{workers} threads");
        }
    }

    #[test]
    fn replay_ends_on_the_consumers_own_batch_boundary() {
        // Epochs of 100 samples; the shared stream starts at sample 40.
        assert_eq!(replay_end(p(0, 0), p(0, 40), 32, 100), Some(p(0, 64)));
        assert_eq!(replay_end(p(0, 0), p(0, 40), 8, 100), Some(p(0, 40)));
        // The boundary past the epoch's end: the whole epoch is replayed.
        assert_eq!(replay_end(p(0, 0), p(0, 90), 64, 100), Some(p(1, 0)));
        // Resuming mid-epoch: boundaries counted from the resume point.
        assert_eq!(replay_end(p(0, 10), p(0, 40), 32, 100), Some(p(0, 42)));
        // From an earlier epoch: boundaries of the shared epoch's own.
        assert_eq!(replay_end(p(0, 10), p(1, 40), 32, 100), Some(p(1, 64)));
        // At an epoch's start: replay up to it.
        assert_eq!(replay_end(p(0, 0), p(1, 0), 7, 100), Some(p(1, 0)));
        // Nothing published before the start, or a start ahead.
        assert_eq!(replay_end(p(0, 0), p(0, 0), 32, 100), None);
        assert_eq!(replay_end(p(2, 5), p(1, 40), 32, 100), None);
    }
}
