//! Merging replayed consumers back into the shared stream, and rotated
//! epochs' starts: the merge rule and a merge round carried out, written
//! once with no I/O and no clock. The stream's runtime
//! (`super::decouple::merge_replays`) and the hold simulation
//! (`super::hold::sim`) each lend a round their [`Replays`], so the
//! simulation runs the runtime's own order, not a copy.
//!
//! # Rules
//!
//! * A replayed consumer merges back when its replay is to start a batch
//!   inside a unit the shared stream still publishes, with at most half
//!   the ring ahead of it (room to keep up: [`rotate::merge_from`]), once
//!   it holds no unit from before its cut ([`merge_rule`]); which replayed
//!   consumers may merge at all (read some of their replay since a cut for
//!   keeping the others waiting, not leaving) the runtime says
//!   ([`Replays::replaying`]). Its replay ends where it merges.
//! * One whose replay stands past the stream's last epoch read it all:
//!   its stream ends there ([`Merge::End`]), wherever the ring stands (a
//!   member's next run may lie in an epoch the stream does not have; the
//!   ring may not have got there, nobody else reading it). It would
//!   otherwise wait for a unit never made, or one nobody makes.
//! * One whose replay stands at an epoch's start the ring no longer holds
//!   near its head rotates into that epoch where it may
//!   ([`Replaying::may_rotate`]) and the ring holds a point for it
//!   ([`rotate::point`]): re-joined there through that epoch.
//! * A round first cuts each rotated consumer the shared stream sent the
//!   rest of its epoch ([`rotate::start_due`]), nothing taken back, after
//!   what the hub sent it went out ([`Replays::send_out`]), to be replayed
//!   the epoch's start; then merges those that were replayed when it
//!   began, in the order the runtime listed them.
//! * A merge or a cut the hub refuses (a member whose copies from there
//!   are gone from its GPU's ring) changes nothing: it is tried again at a
//!   later round.

use std::time::Instant;

use batchcast::proto::Position;
use batchcast::rotation::Rotation;

use super::rotate::{self, merge_from};
use crate::hub::{ConsumerId, Hub, HubError};

/// What the merge rule says of a replayed consumer (see the module's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Merge {
    /// Re-join the shared stream at unit `seq`, sent no epoch after
    /// `through` (a rotated epoch's part read first).
    At { seq: u64, through: Option<u64> },
    /// Its replay stands at an epoch's start the ring no longer holds
    /// near its head: it may rotate into that epoch ([`rotate`]).
    Rotate,
    /// Its replay stands past the stream's last epoch: it read it all,
    /// and its stream ends there.
    End,
    /// Not now: its replay goes on.
    Wait,
}

/// The merge rule for consumer `id`, whose replay's cursor is `at`, on a
/// stream of `unit` samples a unit, reading a rotated epoch as
/// `rotation` says.
pub(super) fn merge_rule(
    hub: &Hub,
    id: ConsumerId,
    at: Position,
    unit: u64,
    rotation: Option<Rotation>,
) -> Merge {
    // The part of a rotated epoch read last: the stream left it behind.
    if rotation.is_some_and(|r| r.in_owed_part(at)) {
        return Merge::Wait;
    }
    if hub.view().past_end(at.epoch) {
        return Merge::End;
    }
    let from = merge_from(hub);
    let near = hub
        .view()
        .ring()
        .seq_of(at.epoch, at.sample / unit)
        .filter(|&seq| seq >= from);
    // An epoch's start the ring no longer holds near its head: the
    // epoch is read from where the ring is, its start after its end.
    let Some(seq) = near else {
        return if at.sample == 0 {
            Merge::Rotate
        } else {
            Merge::Wait
        };
    };
    // It still holds units of the shared stream from before its cut: it
    // would pin the ring again at once.
    if hub
        .view()
        .reader(id)
        .map(|c| c.counts())
        .is_none_or(|c| c.held > 0)
    {
        return Merge::Wait;
    }
    // Inside a rotated epoch's part read first: up to the epoch's end.
    let through = rotation.filter(|r| r.epoch == at.epoch).map(|r| r.epoch);
    Merge::At { seq, through }
}

/// A replayed consumer that may merge now.
#[derive(Debug, Clone, Copy)]
pub(super) struct Replaying {
    pub id: ConsumerId,
    /// Where its replay stands.
    pub cursor: Position,
    /// The epoch it reads rotated, if any.
    pub rotation: Option<Rotation>,
    /// Its batch size: a rotation point is one of its boundaries.
    pub batch: u64,
    /// It may rotate into an epoch (the stream rotates epochs; not a
    /// data-parallel member, whose seat's runs follow the epoch's order).
    pub may_rotate: bool,
}

/// A consumer rotated into an epoch, reading the shared stream (its last
/// replay all sent: a cut's notice must follow it).
#[derive(Debug, Clone, Copy)]
pub(super) struct Rotated {
    pub id: ConsumerId,
    pub rotation: Rotation,
    /// Units noticed to it and not taken.
    pub unread: usize,
}

/// How a replayed consumer re-joined the shared stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Merged {
    /// Where its replay stood.
    At(Position),
    /// Rotated into `at`'s epoch (its replay stood at its start), read
    /// from `point`.
    Rotated { at: Position, point: Position },
    /// Its replay, standing at `at`, read every epoch: its stream ended
    /// (the hub tells it).
    End(Position),
}

/// The stream's shape, as a merge round needs it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    /// Samples a unit of the ring.
    pub unit: u64,
    /// Samples an epoch.
    pub per_epoch: u64,
}

/// What a merge round asks of whoever carries it out (the runtime over its
/// connections, the simulation over its readers).
pub(super) trait Replays {
    fn hub(&mut self) -> &mut Hub;
    /// The replayed consumers that may merge now, in the order they are
    /// tried.
    fn replaying(&mut self) -> Vec<Replaying>;
    /// The consumers rotated into an epoch that read the shared stream.
    fn rotated(&mut self) -> Vec<Rotated>;
    /// What the hub sent goes out now (before a cut's notice).
    fn send_out(&mut self);
    /// Consumer `id` re-joined the shared stream (the hub knows): its
    /// replay ends, it is told.
    fn merged(&mut self, id: ConsumerId, how: Merged);
    /// Consumer `id`, rotated as `rot` says, was cut in the hub with
    /// nothing taken back: it is replayed the epoch's start
    /// ([`Rotation::owed_from`]) from `now`, told.
    fn cut_for_start(&mut self, id: ConsumerId, rot: Rotation, now: Instant);
    /// The hub refused to re-join or cut consumer `id`.
    fn refused(&mut self, id: ConsumerId, e: HubError);
}

/// Carries out a merge round (see the module's rules). Whether anyone
/// merged back. `clock` tells the time when a rotated start is cut (the
/// runtime runs a round for every batch, which reads no clock for it).
pub(super) fn round(r: &mut impl Replays, shape: Shape, clock: impl Fn() -> Instant) -> bool {
    let open = r.replaying();
    rotated_starts(r, clock);
    let mut merged = false;
    for c in open {
        merged |= merge(r, c, shape);
    }
    merged
}

/// Cuts each rotated consumer whose epoch's start is due, to be replayed
/// it.
fn rotated_starts(r: &mut impl Replays, clock: impl Fn() -> Instant) {
    let due: Vec<Rotated> = r
        .rotated()
        .into_iter()
        .filter(|c| rotate::start_due(r.hub(), c.id, c.rotation, c.unread))
        .collect();
    if due.is_empty() {
        return;
    }
    r.send_out();
    for c in due {
        match r.hub().cut(c.id, &[]) {
            Ok(_) => r.cut_for_start(c.id, c.rotation, clock()),
            Err(e) => r.refused(c.id, e),
        }
    }
}

/// Merges consumer `c` back, rotates it, or ends its stream, where the
/// rule says.
fn merge(r: &mut impl Replays, c: Replaying, shape: Shape) -> bool {
    let hub = r.hub();
    let (done, how) = match merge_rule(hub, c.id, c.cursor, shape.unit, c.rotation) {
        Merge::Wait => return false,
        Merge::End => (hub.end_replayed(c.id), Merged::End(c.cursor)),
        Merge::At { seq, through } => {
            (hub.rejoin_through(c.id, seq, through), Merged::At(c.cursor))
        }
        Merge::Rotate if !c.may_rotate => return false,
        Merge::Rotate => {
            let at = (c.batch, shape.unit);
            let Some((seq, point)) = rotate::point(hub, c.cursor, at, shape.per_epoch) else {
                return false;
            };
            let how = Merged::Rotated {
                at: c.cursor,
                point,
            };
            (hub.rejoin_through(c.id, seq, Some(c.cursor.epoch)), how)
        }
    };
    match done {
        Ok(()) => {
            r.merged(c.id, how);
            true
        }
        Err(e) => {
            r.refused(c.id, e);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use batchcast::JoinPolicy;

    use super::*;
    use crate::hub::{HubConfig, Outbound};

    /// A stream of 2 epochs of 4 units and two readers, the second cut;
    /// the first reads up to `units` of it.
    fn one_cut(units: u64) -> (Hub, ConsumerId, ConsumerId) {
        let mut hub = Hub::new(HubConfig {
            slots: 4,
            batches_per_epoch: 4,
            epochs: Some(2),
            lag_limit: None,
            min_consumers: 1,
        });
        let (a, _) = hub.join(1, JoinPolicy::Immediate).unwrap();
        let (b, _) = hub.join(1, JoinPolicy::Immediate).unwrap();
        hub.cut(b, &[]).unwrap();
        for _ in 0..units {
            let Some(w) = hub.start_batch() else { break };
            hub.finish_batch(w.seq, 1);
            hub.release(a, w.seq).unwrap();
        }
        (hub, a, b)
    }

    /// The stream read whole by one reader while a second one is cut:
    /// every epoch made, nothing held.
    fn ended_with_one_cut() -> (Hub, ConsumerId) {
        let (mut hub, _, b) = one_cut(u64::MAX);
        assert!(hub.view().exhausted());
        hub.take_outbound();
        (hub, b)
    }

    #[test]
    fn a_replay_past_the_streams_end_ends_its_stream_and_is_told() {
        let (mut hub, b) = ended_with_one_cut();
        // A member's cursor after its last run of the last epoch: its
        // next run's start, in an epoch the stream does not have (the
        // unit at its sample is never made: it waited for it forever).
        let past = Position {
            epoch: 2,
            sample: 1,
        };
        assert_eq!(merge_rule(&hub, b, past, 1, None), Merge::End);
        hub.end_replayed(b).unwrap();
        let out = hub.take_outbound();
        assert_eq!(out, vec![(b, Outbound::EndOfStream)], "told it ended");
        assert!(hub.end_replayed(b).is_err(), "once");
    }

    #[test]
    fn a_replay_past_the_end_of_a_ring_that_stands_still_ends_its_stream() {
        // The ring made 2 of 8 units and stands (its only other reader
        // left); the cut one's replay read both epochs.
        let (mut hub, a, b) = one_cut(2);
        hub.leave(a);
        assert!(!hub.view().exhausted() && !hub.view().wants_batches());
        let end = Position {
            epoch: 2,
            sample: 0,
        };
        // (Before, a replay there waited for a ring that makes nothing.)
        assert_eq!(merge_rule(&hub, b, end, 1, None), Merge::End);
        hub.take_outbound();
        hub.end_replayed(b).unwrap();
        assert_eq!(hub.take_outbound(), vec![(b, Outbound::EndOfStream)]);
    }

    #[test]
    fn a_replay_inside_the_last_epoch_the_ring_left_waits() {
        let (hub, b) = ended_with_one_cut();
        // Its replay reads on to the end: nothing of the stream waits.
        let inside = Position {
            epoch: 1,
            sample: 1,
        };
        assert_eq!(merge_rule(&hub, b, inside, 1, None), Merge::Wait);
        // Where the stream ends, a reader of every sample's stream ends.
        let end = Position {
            epoch: 2,
            sample: 0,
        };
        assert_eq!(merge_rule(&hub, b, end, 1, None), Merge::End);
    }
}
