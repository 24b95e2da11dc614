//! Decoupled pace (`pace = "decoupled"`): the pipeline runs at the pace of
//! the fastest consumers, and the host arena (its `slots`, the run-ahead
//! budget) holds what slower ones have not read yet. A consumer that falls
//! a whole ring behind is cut from the shared stream and goes on from
//! replay ([`super::replay`]); it merges back where the shared stream still
//! holds the samples its replay reached.
//!
//! # Rules
//!
//! * A cut happens only when the pipeline waits for the ring's next slot,
//!   the unit in it was made at least [`super::hold::CUT_AFTER`] ago (a consumer a
//!   moment late, as trainers starting together are, is not worth a
//!   replay), some consumer has read everything published for it (it
//!   waits for the pipeline), and every consumer that owes that unit can
//!   be cut: a decoupled consumer (host memory, a mailbox, not replaying)
//!   with units noticed and not taken. Otherwise the pipeline waits, as in
//!   lockstep.
//! * The cut takes back, through the mailbox's handshake
//!   ([`batchcast::mailbox`]), exactly the units it has not taken; what it
//!   took stays held until released. Its replay begins at its own batch
//!   boundary at or before the first sample it lost ([`super::batches::Boundaries`]), and not
//!   before where it last merged back (the unit holding that point began
//!   before it): its client drops the batch it was building, which begins
//!   there.
//! * It merges back (a round of [`super::merge`], whose rules these are)
//!   when its replay is to start a batch inside a unit the
//!   shared stream still publishes, with at most half the ring ahead of it
//!   (room to keep up), once it holds no unit from before its cut and, if
//!   it was cut for falling behind (not a joiner starting cut), has read
//!   some of its replay since (either way it would pin the ring again at
//!   once: a stopped one's replay is made ahead of it up to its window): the hub re-joins it at that unit ([`crate::hub::Hub::rejoin`]),
//!   its replay ends there, and its client skips the unit's samples before
//!   that point. At the stream's end it merges at the end.
//! * Every sample reaches it once, in order: from the shared stream before
//!   the cut, replayed between, from the shared stream after the merge.
//! * A consumer on the socket is cut the same way: what was queued for it
//!   and never sent is what it gives back (everything sent, it took).
//! * A consumer that joins needing replay (`join = "now"`, `resume`)
//!   starts cut ([`super::replay`]): it is never waited for while it is
//!   replayed to, and merges back by the rule above.
//! * No consumer keeps the others waiting longer than the stream's hold
//!   limit (`hold_limit_s`, [`crate::plan::DEFAULT_HOLD_LIMIT`]): while
//!   another consumer waits for data, a consumer that owes the unit in the
//!   ring's next slot and cannot be cut (it holds that unit: a batch its
//!   program keeps, a mailbox `tail` claiming it took it, or a socket
//!   window sent and not read) is cut once the unit has been pinned that
//!   long, and the ring moves to another region of the host arena without
//!   what it holds ([`super::regions`]); where the ring cannot move (a GPU
//!   consumer's stream, a producer's) or has no region for it, it is
//!   detached (`HoldLimit`; everything it held is given back, as the lag
//!   limit does under lockstep), there after `held_batch_limit_s`.
//! * Lockstep (the default pace) is bounded by the same limit: there the
//!   consumers that owe the unit are cut only once it has been pinned for
//!   the hold limit (a host consumer of a stream the broker computes keeps
//!   a replay arena for that), those that cannot be cut are detached then,
//!   and a joiner whose catch-up replay goes on is waited for. A cut one
//!   merges back by the rule above. Without a limit (`inf`) nothing is.

use std::time::{Duration, Instant};

use batchcast::proto::{Position, ServerMsg, Unit};
use batchcast::rotation::Rotation;

use super::batches::CutPlace;
use super::conn::{Conn, end_mailbox_consumer, notify, unread};
use super::deliver::settle;
use super::hold::{self, Detach, Facts, Hands, Move, Rule};
use super::merge::{self, Merged, Replaying, Replays, Rotated};
use super::regions;
use super::replay::book::ArenaLife;
use super::rotate;
use super::{Conns, Inner, Stream};
use crate::config::Pace as PaceRule;
use crate::hub::{ConsumerId, Hub, HubError};

/// Whether consumer `id` took unit `seq` (it was sent it and, with a
/// mailbox, took the notice): a cut cannot give it back.
fn took(hub: &Hub, id: ConsumerId, c: &mut Conn, seq: u64) -> bool {
    hub.view().reader(id).is_some_and(|c| c.holds(seq))
        && !c
            .out
            .mailbox_mut()
            .is_some_and(|mb| mb.is_unread(Unit::Shared(seq)))
}

/// Whether consumer `id` may be cut: it keeps a replay arena for cuts
/// (a device consumer: and one on its GPU), reading the shared stream (its last replay's batches all
/// sent: a cut's notice must follow them), behind (units wait for it,
/// noticed or queued), and it did not take `stalled`, the unit it keeps
/// from reuse when it has not moved for the hold limit (lockstep: a cut
/// would not free it). One that moves releases what it took soon.
fn cuttable(hub: &Hub, id: ConsumerId, c: &mut Conn, stalled: Option<u64>) -> bool {
    let Some(queued) = hub.view().reader(id).and_then(|c| c.reading()) else {
        return false;
    };
    !stalled.is_some_and(|seq| took(hub, id, c, seq))
        && may_cut(hub, id, c)
        && (queued > 0 || unread(c) > 0)
}

/// Whether consumer `id` could go on from replay: reading the shared
/// stream, not leaving, its replay arena kept for cuts and idle.
fn may_cut(hub: &Hub, id: ConsumerId, c: &Conn) -> bool {
    hub.view().reader(id).and_then(|c| c.reading()).is_some()
        && c.ending.is_none()
        && c.replay.as_ref().is_some_and(|r| {
            r.life == ArenaLife::WhileConnected && !r.running() && !r.open() && r.settled()
        })
}

/// The runtime's answers to the hold rule's questions, from the
/// connections.
struct ConnFacts<'a> {
    hub: &'a Hub,
    conns: &'a mut Conns,
    regions: &'a regions::Regions,
}

impl Facts for ConnFacts<'_> {
    fn hungry(&mut self) -> bool {
        let hub = self.hub;
        self.conns
            .iter_mut()
            .any(|(&id, c)| hub.view().starved(id) && unread(c) == 0)
    }

    fn cuttable(&mut self, id: ConsumerId, stalled: Option<u64>) -> bool {
        self.conns
            .get_mut(&id)
            .is_some_and(|c| cuttable(self.hub, id, c, stalled))
    }

    fn catching_up(&self, id: ConsumerId, within: Duration, now: Instant) -> bool {
        self.conns
            .get(&id)
            .and_then(|c| c.replay.as_ref())
            .is_some_and(|r| r.catching_up(within, now))
    }

    fn took(&mut self, id: ConsumerId, seq: u64) -> bool {
        self.conns
            .get_mut(&id)
            .is_some_and(|c| took(self.hub, id, c, seq))
    }

    fn movable(&mut self, id: ConsumerId) -> bool {
        self.conns
            .get(&id)
            .is_some_and(|c| movable(self.hub, id, c, self.regions))
    }
}

/// Whether the ring may move away from what consumer `id` holds: the
/// stream's ring can move, and it is cut already (decoupled pace cuts at
/// once; what it took stays held) or may be.
fn movable(hub: &Hub, id: ConsumerId, c: &Conn, regions: &regions::Regions) -> bool {
    regions.movable() && (hub.view().reader(id).is_some_and(|r| r.is_cut()) || may_cut(hub, id, c))
}

/// The stream's hold rule, from its plan and the pipeline threads
/// working now (`autoscale`: what would remake the units a cut replays).
fn hold_rule(s: &Stream, inner: &Inner) -> Rule {
    Rule {
        eager: s.plan.pace == PaceRule::Decoupled,
        stall_cut: s.plan.pace == PaceRule::Auto,
        workers: inner.fill.scale.active(),
        limit: s.plan.hold_limit,
        held_limit: s.plan.held_batch_limit,
    }
}

/// How long a pipeline thread waiting for the ring's next slot may sleep
/// at most: until the hold rule's next deadline
/// ([`super::hold::HoldClock::next_look`]), if sooner than `idle`.
pub(super) fn look_within(s: &Stream, inner: &Inner, idle: Duration, now: Instant) -> Duration {
    inner
        .pace
        .next_look(hold_rule(s, inner), now)
        .map_or(idle, |t| idle.min(t - now))
}

/// How long an idle pipeline thread may sleep at most: `idle`, or once
/// every epoch was made, until the hold rule's next deadline if sooner
/// ([`cut_at_end`]).
pub(super) fn idle_within(s: &Stream, inner: &Inner, idle: Duration, now: Instant) -> Duration {
    match inner.hub.view().exhausted() {
        true => look_within(s, inner, idle, now),
        false => idle,
    }
}

/// Every epoch made, the pipeline waits for no slot, but a GPU member may
/// still wait for a copy its ring has no slot for while another member
/// keeps one (the hub's [`pinning`](crate::hub::View::pinning) then): the
/// hold rule judges that as when the pipeline waits ([`cut_laggards`]).
/// Whether it cut or detached anyone.
pub(super) fn cut_at_end(s: &Stream, inner: &mut Inner, now: Instant) -> bool {
    inner.hub.view().exhausted() && cut_laggards(s, inner, now)
}

/// The pipeline waits for the ring's next slot: asks the hold clock what
/// its rules say of who owes the unit there
/// ([`super::hold::HoldClock::judge`]), and cuts or detaches whom it
/// names. Whether it did either.
pub(super) fn cut_laggards(s: &Stream, inner: &mut Inner, now: Instant) -> bool {
    let rule = hold_rule(s, inner);
    if !rule.eager && rule.limit.is_none() {
        return false;
    }
    let pinned = inner.hub.view().pinning();
    let Inner {
        hub,
        conns,
        pace,
        fill,
        ..
    } = &mut *inner;
    let mut facts = ConnFacts {
        hub,
        conns,
        regions: &fill.regions,
    };
    let Some(round) = pace.round(rule, pinned, &mut facts, now) else {
        return false;
    };
    tracing::debug!(stream = %s.name(), ?round, "the hold rule acts");
    hold::carry_out(round, &mut Runtime { s, inner }, now)
}

/// The runtime's hands for a round of the hold rule: its connections,
/// its hub, its arena's regions.
struct Runtime<'a> {
    s: &'a Stream,
    inner: &'a mut Inner,
}

impl Hands for Runtime<'_> {
    fn holds_left(&self, id: ConsumerId) -> bool {
        self.inner.fill.regions.holds_left(id)
    }

    fn ready(&mut self, id: ConsumerId) -> bool {
        regions::ready(self.s, self.inner, id)
    }

    fn is_cut(&self, id: ConsumerId) -> bool {
        self.inner.hub.view().reader(id).is_some_and(|r| r.is_cut())
    }

    fn cut(&mut self, id: ConsumerId, now: Instant) -> bool {
        cut(self.s, self.inner, id, now)
    }

    fn detach(&mut self, id: ConsumerId, why: Detach<'_>) {
        match why {
            Detach::Held { held, took } => detach_holder(self.s, self.inner, id, (held, took)),
            Detach::Stuck { held, why } => detach_stuck(self.s, self.inner, id, held, why),
        }
    }

    fn move_from(&mut self, m: Move<'_>) -> Result<u32, regions::Stuck> {
        let to = regions::move_from(self.s, self.inner, m.ids)?;
        tracing::warn!(
            stream = %self.s.name(),
            consumers = ?m.ids,
            held_s = m.held.as_secs_f64(),
            before_the_limit = m.early,
            region = to,
            "consumers kept the batch the pipeline needed next while others waited: the ring moved on without it (they read it where it was, and go on from replay)"
        );
        Ok(to)
    }

    fn unmoved(&mut self, seq: u64, now: Instant) {
        self.inner.pace.unmoved(seq, now);
    }
}

/// Detaches consumer `id`, which kept the pipeline waiting for `held`
/// (`took_it`: holding the unit itself, so waited for up to the held-batch
/// limit).
fn detach_holder(s: &Stream, inner: &mut Inner, id: ConsumerId, (held, took_it): (Duration, bool)) {
    let (key, limit) = if took_it {
        ("held_batch_limit_s", s.plan.held_batch_limit)
    } else {
        ("hold_limit_s", s.plan.hold_limit)
    };
    let limit = limit.unwrap_or_default().as_secs_f64();
    let no_replay = inner.conns.get(&id).and_then(|c| c.no_replay.as_deref());
    let what = match (s.writer.is_some(), no_replay) {
        (false, _) => {
            "this stream is fed by an external producer, so its batches cannot be recomputed for it; resume from its state (state_dict()) while the ring still holds its place".to_string()
        }
        (true, Some(why)) if !took_it => format!(
            "it could not be cut to replay, having no replay arena (refused at subscribe: {why}); resume from its state (state_dict())"
        ),
        (true, _) => {
            "it kept the batch the pipeline needed next (one its program held, or one sent and not read, as while paused); release batches before a long pause (drop or `del` them), or resume from its state (state_dict())".to_string()
        }
    };
    let raise = match s.writer {
        Some(_) => format!("raise {key} in the broker config"),
        None => "the producer may set a longer hold_limit_s".to_string(),
    };
    let reason = format!(
        "detached: this consumer kept the stream's pipeline waiting for {:.1} s while other consumers waited for data, more than the stream's {key} of {limit}: {what}; or {raise}",
        held.as_secs_f64()
    );
    if inner.hub.detach(id, reason) {
        tracing::warn!(
            stream = %s.name(),
            consumer = id,
            held_s = held.as_secs_f64(),
            "detached a consumer that kept the pipeline waiting past the hold limit"
        );
    }
}

/// Detaches consumer `id`, which kept the batch the ring needed next for
/// `held`, because the ring could not move on without it (`why`).
fn detach_stuck(
    s: &Stream,
    inner: &mut Inner,
    id: ConsumerId,
    held: Duration,
    why: &regions::Stuck,
) {
    let reason = format!(
        "detached: this consumer kept the batch the stream's pipeline needed next for {:.1} s while other consumers waited for data, past the stream's hold_limit_s of {}, and the ring could not move on without it: {why}; release batches before a long pause (drop or `del` them), or resume from its state (state_dict())",
        held.as_secs_f64(),
        s.plan.hold_limit.unwrap_or_default().as_secs_f64(),
    );
    inner.hub.detach(id, reason);
}

/// Tells consumer `id`, which joined cut (it needs replay, see
/// [`super::replay`]), that it is replayed to from `from`.
pub(super) fn tell_cut(inner: &mut Inner, id: ConsumerId, from: Position) {
    notify(inner, id, ServerMsg::Cut(from));
}

/// Cuts consumer `id` in the hub, `revoked` (the units it was noticed and
/// did not take) given back, on a stream of `unit` samples a unit: where
/// it lost the shared stream, and where it restarts, its own batch (a
/// group member's own run) at or before the loss, not before where it
/// last merged back (`place`: it has every sample before that, the unit
/// holding it began earlier). The runtime's cut and the simulation's.
pub(super) fn cut_in_hub(
    hub: &mut Hub,
    id: ConsumerId,
    revoked: &[u64],
    (place, unit): (&CutPlace, u64),
) -> Result<(Position, Position), HubError> {
    let (epoch, index) = hub.cut(id, revoked)?;
    let lost = Position {
        epoch,
        sample: index * unit,
    };
    Ok((lost, place.restart(lost)))
}

/// Cuts consumer `id` from the shared stream; replay follows.
fn cut(s: &Stream, inner: &mut Inner, id: ConsumerId, now: Instant) -> bool {
    let unit = s.plan.schema.batch_size;
    // A mailbox consumer gives back the notices it has not taken; a
    // socket consumer took everything it was sent, and gives back only
    // what was queued for it (the hub drops the queue).
    let Some(revoked) = inner
        .conns
        .get_mut(&id)
        .and_then(|c| match c.out.mailbox_mut() {
            Some(mb) => mb.cut(),
            None => Some(Vec::new()),
        })
    else {
        return false;
    };
    let Inner { hub, conns, .. } = &mut *inner;
    let place = &conns.get(&id).expect("looked up above").own.place;
    let (lost, restart) = match cut_in_hub(hub, id, &revoked, (place, unit)) {
        Ok(at) => at,
        Err(e) => {
            // It released a unit it never took: only itself is harmed.
            end_mailbox_consumer(inner, id, format!("taking back its batches: {e}"));
            return false;
        }
    };
    let conn = inner.conns.get_mut(&id).expect("cut above");
    for seq in &revoked {
        conn.tally.sent_ns.remove(seq);
    }
    conn.own.shared.rewind(restart);
    conn.merges.cuts += 1;
    if let Some(r) = conn.replay.as_mut() {
        r.reopen(restart, now);
    }
    if !notify(inner, id, ServerMsg::Cut(restart)) {
        return true;
    }
    tracing::info!(
        stream = %s.name(),
        consumer = id,
        taken_back = revoked.len(),
        ?lost,
        ?restart,
        "a consumer fell a ring behind (decoupled) or kept the others waiting past the hold limit (lockstep); it goes on from replay"
    );
    s.work_cv.notify_all();
    true
}

/// Merges back each cut consumer whose replay reached a unit the
/// shared stream still publishes, rotates one whose replay stands at an
/// epoch's start the ring left behind, and cuts a rotated one to replay
/// its epoch's start: a round of [`merge::round`], carried out on the
/// connections. `clock` tells the time when a decision needs it (rarely:
/// this runs for every batch, which reads no clock for it).
pub(super) fn merge_replays(s: &Stream, inner: &mut Inner, clock: fn() -> Instant) {
    let shape = merge::Shape {
        unit: s.plan.schema.batch_size,
        per_epoch: s.plan.schema.samples_per_epoch,
    };
    if merge::round(&mut Merging { s, inner }, shape, clock) {
        settle(inner, false);
    }
}

/// The runtime's side of a merge round: its connections and their
/// replays.
struct Merging<'a> {
    s: &'a Stream,
    inner: &'a mut Inner,
}

impl Replays for Merging<'_> {
    fn hub(&mut self) -> &mut Hub {
        &mut self.inner.hub
    }

    /// Those whose replay is open, not leaving, and, if cut for keeping
    /// the others waiting, that read some of it since: one that read
    /// nothing (stopped, its replay made ahead of it) would only pin the
    /// ring again. A joiner that starts cut has not stalled.
    fn replaying(&mut self) -> Vec<Replaying> {
        let rotate = self.s.plan.rotate_epochs;
        self.inner
            .conns
            .iter()
            .filter(|(_, c)| c.ending.is_none())
            .filter_map(|(&id, c)| {
                let r = c.replay.as_ref().filter(|r| r.open())?;
                (c.merges.cuts == 0 || r.read()).then_some(Replaying {
                    id,
                    cursor: r.cursor,
                    rotation: r.rotation,
                    batch: c.own.batch_size,
                    may_rotate: rotate && c.seat.is_none(),
                })
            })
            .collect()
    }

    fn rotated(&mut self) -> Vec<Rotated> {
        let mut all = Vec::new();
        for (&id, c) in self.inner.conns.iter_mut() {
            let Some(rotation) = c
                .replay
                .as_ref()
                .filter(|r| r.settled())
                .and_then(|r| r.rotation)
            else {
                continue;
            };
            if c.ending.is_none() {
                let unread = unread(c);
                all.push(Rotated {
                    id,
                    rotation,
                    unread,
                });
            }
        }
        all
    }

    fn send_out(&mut self) {
        settle(self.inner, false);
    }

    fn merged(&mut self, id: ConsumerId, how: Merged) {
        match how {
            Merged::At(at) | Merged::End(at) => merged_at(self.s, self.inner, id, at),
            Merged::Rotated { at, point } => rotate::rotated(self.s, self.inner, id, (at, point)),
        }
    }

    fn cut_for_start(&mut self, id: ConsumerId, rot: Rotation, now: Instant) {
        rotate::cut_for_start(self.s, self.inner, id, rot, now);
    }

    fn refused(&mut self, id: ConsumerId, e: HubError) {
        tracing::debug!(stream = %self.s.name(), consumer = id, "a merge or a rotated start's cut waits: {e}");
    }
}

/// Consumer `id` re-joined the shared stream where its replay stood,
/// `at`: its replay ends there, and it is told.
fn merged_at(s: &Stream, inner: &mut Inner, id: ConsumerId, at: Position) {
    let Some(conn) = inner.conns.get_mut(&id) else {
        return;
    };
    if let Some(r) = conn.replay.as_mut() {
        r.to = Some(at);
    }
    conn.own.shared.resume_at(at);
    conn.own.place.merged(at);
    if !notify(inner, id, ServerMsg::Merge(at)) {
        return;
    }
    tracing::info!(
        stream = %s.name(),
        consumer = id,
        ?at,
        "a replayed consumer merged back into the shared stream"
    );
}
