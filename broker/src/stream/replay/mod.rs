//! Replay: batches recomputed for one consumer alone. A stream the broker
//! computes is a pure function of `(seed, epoch, dataset index)`
//! (`StreamPlan::epoch_order`, `SlotWriter`), so any part of it can be made
//! again, byte for byte, into a small arena of that consumer's own.
//!
//! A consumer that joins with `join = "now"` (from the start of the epoch
//! in progress), or resumes from a position behind the stream, joins the
//! hub at once, like `immediate`. What lies between its start and the
//! first of its own batch boundaries at or past where the shared stream
//! begins for it ([`super::batches::replay_end`]) is replayed; its client gives back the
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

pub(super) mod book;

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use batchcast::JoinPolicy;
use batchcast::deal::Deal;
use batchcast::proto::{ConsumeRequest, ErrorCode, Position, ReplayGrant};
use batchcast::rotation::Rotation;
use batchcast::schema::Schema;

use super::batches::{self, Start};
use super::conn::{Conn, Ending, end_consumer};
use super::error::{MakeError, ReplayError, SubscribeError};
use super::{Inner, Stream};
use crate::budget::Use;
use crate::config::Pace;
use crate::gpu::ReplayCopy;
use crate::hub::ConsumerId;
use crate::plan::StreamPlan;
use book::{ArenaLife, Prepared, Replay, ReplayJob};

/// Where a consumer asks to start, when that may need replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReplayFrom {
    /// `join = "now"`: the start of the epoch in progress.
    EpochStart,
    /// `resume`: this position of the stream, its epoch read rotated if
    /// the state says so ([`batchcast::rotation`]).
    Resume(Position, Option<Rotation>),
}

impl ReplayFrom {
    pub(super) fn resume(self) -> Option<Position> {
        match self {
            ReplayFrom::EpochStart => None,
            ReplayFrom::Resume(p, _) => Some(p),
        }
    }

    fn rotation(self) -> Option<Rotation> {
        match self {
            ReplayFrom::EpochStart => None,
            ReplayFrom::Resume(_, r) => r,
        }
    }
}

/// Where this request starts if that may need replay; refused for what
/// cannot replay, with what to do instead.
pub(super) fn wanted(
    s: &Stream,
    req: &ConsumeRequest,
) -> Result<Option<ReplayFrom>, SubscribeError> {
    let wanted = match (req.resume, req.join) {
        (Some(p), _) => Some(ReplayFrom::Resume(p, req.rotation.as_deref().copied())),
        (None, JoinPolicy::Now) => Some(ReplayFrom::EpochStart),
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
    // A producer's stream is not recomputed: a resume there (a consumer
    // back after a broker restart, its producer registered again) is
    // served from what the ring holds, skipping to its place, or
    // refused at `start_replay` if the ring has moved past it.
    if s.writer.is_none() && req.resume.is_none() {
        return refuse(format!(
            "{what} needs replay, and stream `{}` is fed by an external producer: its batches cannot be recomputed; join \"next-epoch\" or \"immediate\" instead",
            s.name()
        ));
    }
    if let Some(p) = req.resume {
        let per_epoch = s.plan.schema.samples_per_epoch;
        if p.sample >= per_epoch {
            return refuse(format!(
                "{what}: an epoch of stream `{}` has {per_epoch} samples (0 to {})",
                s.name(),
                per_epoch.saturating_sub(1)
            ));
        }
        if p.epoch >= crate::hub::MAX_EPOCH {
            return refuse(format!(
                "{what}: no stream counts epoch {} or later",
                crate::hub::MAX_EPOCH
            ));
        }
        if let Some(epochs) = s.plan.epochs
            && p.epoch >= epochs
        {
            return refuse(format!(
                "{what}: stream `{}` has {epochs} epochs (0 to {})",
                s.name(),
                epochs.saturating_sub(1)
            ));
        }
    }
    if let Some(&r) = req.rotation.as_deref() {
        check_rotation(s, r, req)?;
    }
    Ok(wanted)
}

/// A resume in a rotated epoch ([`ConsumeRequest::rotation`]): of the
/// resume's epoch, inside it, for a plain host consumer of a stream
/// the broker computes (the part read last is replayed).
fn check_rotation(s: &Stream, r: Rotation, req: &ConsumeRequest) -> Result<(), SubscribeError> {
    let per_epoch = s.plan.schema.samples_per_epoch;
    let fits = req.resume.is_some_and(|p| p.epoch == r.epoch)
        && r.at > 0
        && r.at < per_epoch
        && req.group.is_none()
        && s.writer.is_some();
    if fits {
        return Ok(());
    }
    Err(SubscribeError::Replay(ReplayError::Refused(format!(
        "a state read rotated at epoch {} sample {}: only a resume in that epoch (of {per_epoch} samples an epoch), by a consumer outside a group, of a stream the broker computes, goes on in that order; resume from the next epoch's start instead",
        r.epoch, r.at
    ))))
}

/// Consumer `id` just joined: where the shared stream begins for it
/// decides what is replayed. `prepared`: its replay arena, if it may
/// need one (it asked for replay, or it may be cut: `kept`, then the
/// arena stays, for the replay a cut begins).
pub(super) fn start(
    s: &Stream,
    inner: &mut Inner,
    id: ConsumerId,
    (replaying, kept): (Option<ReplayFrom>, bool),
    prepared: Option<Prepared>,
    (batch, deal): (u64, Option<Deal>),
) -> Result<Started, SubscribeError> {
    let (epoch, index) = inner
        .hub
        .view()
        .reader(id)
        .map(|c| c.first_batch())
        .expect("it just joined");
    let shared = Position {
        epoch,
        sample: index * s.plan.schema.batch_size,
    };
    let from = match replaying {
        Some(wanted) => wanted.resume().unwrap_or(Position { epoch, sample: 0 }),
        None => shared,
    };
    let Some(prepared) = prepared else {
        return without_arena(s, (from, shared), replaying);
    };
    if let Some(rot) = replaying.and_then(ReplayFrom::rotation) {
        return start_rotated(s, inner, id, (prepared, kept), (from, rot), (batch, deal));
    }
    // One that may be cut keeps its arena (a group member's too).
    let life = if kept {
        ArenaLife::WhileConnected
    } else {
        ArenaLife::UntilDone
    };
    let limit = stream_end(&s.plan);
    let per_epoch = s.plan.schema.samples_per_epoch;
    let decoupled = s.plan.pace == Pace::Decoupled;
    let resume = replaying.and_then(ReplayFrom::resume);
    let shape = (batch, deal.as_ref());
    let start = batches::start((from, shared), shape, per_epoch, (kept, decoupled), resume);
    let (anchor, skip) = start.begins();
    let (from, to) = match start {
        Start::Shared { .. } => {
            return Ok(Started {
                skip,
                anchor,
                ..Started::default()
            });
        }
        // Decoupled: it starts cut. Lockstep: a joiner is waited for while
        // it catches up (as long as its replay goes on, see `decouple`).
        Start::Cut { from } => {
            return start_cut(s, inner, id, prepared, (from, (batch, deal)), limit);
        }
        Start::Replay { from, to } => (from, to),
    };
    let (replay, grant, fd) = prepared.start(
        (from, to),
        (batch, deal),
        per_epoch,
        (life, limit),
        Instant::now(),
    )?;
    if from < to {
        tracing::info!(stream = %s.name(), consumer = id, ?from, ?to, "replaying");
        s.work_cv.notify_all();
    }
    Ok(Started {
        replay: Some(replay),
        grant: Some((grant, fd)),
        skip,
        anchor,
        cut: None,
    })
}

/// A joiner with no replay arena (a producer's stream): it starts where
/// the shared stream is, or is refused a resume behind it.
fn without_arena(
    s: &Stream,
    (from, shared): (Position, Position),
    replaying: Option<ReplayFrom>,
) -> Result<Started, SubscribeError> {
    if from < shared {
        return Err(SubscribeError::Replay(ReplayError::Refused(format!(
            "resuming at epoch {} sample {}: stream `{}` is fed by an external producer and now goes on from epoch {} sample {}; the batches between were not kept and cannot be made again for it",
            from.epoch,
            from.sample,
            s.name(),
            shared.epoch,
            shared.sample
        ))));
    }
    Ok(Started {
        skip: replaying.and_then(ReplayFrom::resume),
        anchor: from,
        ..Started::default()
    })
}

/// Where the stream ends (epochs past it are none).
fn stream_end(plan: &StreamPlan) -> Position {
    Position {
        epoch: plan.epochs.unwrap_or(u64::MAX),
        sample: 0,
    }
}

/// A resume inside a rotated epoch starts cut under either pace (the
/// part of the epoch it reads last is behind the stream whatever it
/// is), its replay walking the rotated order; refused where it keeps
/// no replay arena (it could not be replayed that part).
fn start_rotated(
    s: &Stream,
    inner: &mut Inner,
    id: ConsumerId,
    (prepared, kept): (Prepared, bool),
    (from, rot): (Position, Rotation),
    cut: (u64, Option<Deal>),
) -> Result<Started, SubscribeError> {
    if !kept {
        return Err(SubscribeError::Replay(ReplayError::Refused(format!(
            "resuming a state read rotated at epoch {} sample {}: stream `{}` keeps no replay arena for this consumer (hold_limit_s = \"inf\" under lockstep, or the memory budget); resume from epoch {} sample 0",
            rot.epoch,
            rot.at,
            s.name(),
            from.epoch + 1
        ))));
    }
    let mut started = start_cut(s, inner, id, prepared, (from, cut), stream_end(&s.plan))?;
    if let Some(r) = started.replay.as_mut() {
        r.rotation = Some(rot);
    }
    Ok(started)
}

/// Decoupled pace: a consumer that needs replay to start at `from`
/// starts cut from the shared stream, so nothing shared waits for it
/// while it is replayed to (it may pause there like anywhere). Its
/// replay is open from `from`, and it merges back like any cut
/// consumer ([`super::decouple`]); its welcome grants the arena with
/// nothing to replay (`from == to`), and the cut notice follows it.
fn start_cut(
    s: &Stream,
    inner: &mut Inner,
    id: ConsumerId,
    prepared: Prepared,
    (from, (batch, deal)): (Position, (u64, Option<Deal>)),
    limit: Position,
) -> Result<Started, SubscribeError> {
    inner.hub.cut_at_join(id)?;
    let per_epoch = s.plan.schema.samples_per_epoch;
    let now = Instant::now();
    let (mut replay, grant, fd) = prepared.start(
        (from, from),
        (batch, deal),
        per_epoch,
        (ArenaLife::WhileConnected, limit),
        now,
    )?;
    replay.reopen(from, now);
    tracing::info!(stream = %s.name(), consumer = id, ?from, "replaying, cut from the shared stream until it merges back");
    s.work_cv.notify_all();
    Ok(Started {
        replay: Some(replay),
        grant: Some((grant, fd)),
        skip: Some(from),
        anchor: from,
        cut: Some(from),
    })
}

/// A replay arena for a consumer of batch size `batch` and `window`:
/// [`book::slots`] of its batches, in the budget under `uid`.
pub(super) fn prepare(
    s: &Stream,
    (batch, window): (u64, u32),
    (uid, whom): (u32, &str),
    commit: bool,
) -> Result<Prepared, ReplayError> {
    let schema = Schema {
        batch_size: batch,
        ..s.plan.schema.clone()
    };
    let layout = Prepared::layout(&schema, window)?;
    let grant = s.budget.take(uid, Use::Replay, layout.arena_bytes, whom)?;
    Prepared::make(s.name(), layout, (window, commit), grant)
}

/// Replay's load on the pipeline threads.
#[derive(Debug, Default)]
pub(super) struct Load {
    /// Replayed batches being made.
    making: u32,
    /// The CPU replay has cost.
    cpu: Duration,
}

impl Load {
    /// The CPU replay has cost.
    pub(super) fn cpu(&self) -> Duration {
        self.cpu
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

/// Takes a replayed batch for a pipeline thread to make, if one may start
/// (see the module's rules). `shared_first`: the thread made a replayed
/// batch last and the shared pipeline could go on.
pub(super) fn take_job(inner: &mut Inner, shared_first: bool) -> Option<ReplayJob> {
    let shared_waits = !inner.hub.view().can_start();
    if shared_first && !shared_waits {
        return None;
    }
    // Of the threads working now (`autoscale`: the rest are parked).
    if inner.replay.making >= replay_threads(inner.fill.scale.active(), shared_waits) {
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
        .min_by_key(|(_, c)| c.replay.as_ref().map_or(0, Replay::in_flight))?;
    let job = conn.replay.as_mut().expect("filtered").start(id);
    tracing::debug!(
        consumer = id,
        seq = job.seq,
        shared_waits,
        "replaying a batch"
    );
    inner.replay.making += 1;
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

/// Whether some consumer is still being replayed to, or waits for its
/// merge (its releases must be taken even while the shared pipeline has
/// nothing to do: a merge waits until it holds nothing from before its
/// cut, as a rotated consumer reading its epoch's shared part does while
/// its start, replayed, is all made).
pub(super) fn active(inner: &Inner) -> bool {
    inner
        .conns
        .values()
        .any(|c| c.replay.as_ref().is_some_and(book::Replay::active))
}

/// A pipeline thread made replayed batch `seq` for consumer `id` (or
/// failed to: the source changed under the stream, and that consumer is
/// ended); what is made is sent in order.
pub(super) fn finish(
    inner: &mut Inner,
    id: ConsumerId,
    seq: u64,
    cpu: Duration,
    made: Result<(), MakeError>,
) {
    inner.replay.making = inner.replay.making.saturating_sub(1);
    inner.replay.cpu += cpu;
    let Some(conn) = inner.conns.get_mut(&id) else {
        return; // it left meanwhile
    };
    conn.tally.replay_cpu += cpu;
    if let Err(why) = made {
        conn.replay = None;
        let code = match why {
            MakeError::Memory(_) => ErrorCode::Busy,
            _ => ErrorCode::SourceFailed,
        };
        let why = format!("replaying its batches failed: {why}");
        end_consumer(inner, id, code, why);
        return;
    }
    let Some(r) = conn.replay.as_mut() else {
        return;
    };
    // A device consumer's batch is copied to its GPU first (sent once the
    // copy is reported: `replay_copied`).
    if let (Some((target, _)), Some(key)) = (&conn.device_replay, conn.gpu) {
        let target = target.clone();
        let mirror = inner.mirrors.mirror(&key);
        match (r.made_for_copy(seq, target.rings()), mirror) {
            (Some((src, pieces)), Some(m)) => m.request_replay(ReplayCopy {
                consumer: id,
                seq,
                src,
                pieces,
                target,
            }),
            _ => tracing::warn!(consumer = id, seq, "a replayed batch with no copy to make"),
        }
        return;
    }
    let ready = r.made(seq);
    super::conn::send_replayed(inner, id, ready);
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
