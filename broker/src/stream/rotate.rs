//! Rotated epochs ([`batchcast::rotation`]): a replayed consumer whose
//! replay reaches an epoch's start that the ring no longer holds near its
//! head (a `join = "now"` joiner, one cut and as fast as the others) does
//! not replay the epoch in order, which it could never catch up from. It
//! reads the epoch from the oldest unit the ring holds within the merge
//! margin, at one of its batch boundaries, and the part it missed after
//! the epoch's end, replayed: an epoch's start costs it once per epoch.
//!
//! # Rules
//!
//! * It rotates only where it would merge back (its replay's cursor is
//!   the epoch's start, no `Merge` possible there), outside a group, in
//!   host memory; the point is a multiple of its batch size and of the
//!   stream's unit, past the epoch's first unit, the oldest such the ring
//!   holds within half the ring of the head or from where the shared
//!   stream's readers are (what the ring keeps for them anyway). None
//!   there: its replay goes on in order.
//! * `Rotate(point)` ends its replay at the epoch's start; the hub re-joins
//!   it at the point sending it nothing of a later epoch
//!   ([`crate::hub::Hub::rejoin_through`]) and no end of stream.
//! * Once it was sent the epoch's last unit (the stream made the epoch)
//!   and took every unit it was sent (a paused one would keep them from
//!   the ring; it is cut as any member is instead), it is cut with nothing
//!   taken back (`Cut` at the epoch's start, after
//!   everything it was sent) and replayed the epoch's samples before the
//!   point, the last batch ending the epoch; at the next epoch's start the
//!   merge rule applies again.
//! * A cut in the part read first replays the rest of it, then the part
//!   read last: the replay book walks the rotated order.

use std::time::Instant;

use batchcast::proto::{Position, ServerMsg};
use batchcast::rotation::Rotation;

use super::conn::notify;
use super::{Inner, Stream};
use crate::hub::{ConsumerId, Hub};

/// The oldest unit a replayed consumer may merge back at: within half the
/// ring of its head, room to keep up (merged further back, one that
/// pauses would pin the ring, be cut and merge again at once, over and
/// over).
pub(super) fn merge_from(hub: &Hub) -> u64 {
    let (head, slots) = (hub.view().ring().head(), hub.view().ring().slots());
    head.saturating_sub(u64::from(slots / 2))
}

/// Greatest common divisor.
fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Where a replayed consumer of batch size `batch` whose replay stands
/// at `at`, an epoch's start, may rotate into that epoch on a stream of
/// `unit` samples a unit and `per_epoch` samples an epoch (see the
/// module's rules): the unit it re-joins at and where that begins.
/// `None`: the ring holds no point for it.
pub(super) fn point(
    hub: &Hub,
    at: Position,
    (batch, unit): (u64, u64),
    per_epoch: u64,
) -> Option<(u64, Position)> {
    // Units from one of its batch boundaries: lcm(batch, unit) / unit.
    let every = batch / gcd(batch, unit).max(1);
    // Also where the shared stream's readers are, if further back (a
    // ring larger than half an epoch runs that far ahead of them): the
    // ring keeps that for them anyway, and a rotation happens once an
    // epoch at most.
    let room = merge_from(hub);
    let from = hub.view().members_tail().map_or(room, |t| t.min(room));
    let (seq, index) = hub.view().ring().rotation_point(at.epoch, from, every)?;
    let point = Position {
        epoch: at.epoch,
        sample: index * unit,
    };
    (point.sample < per_epoch).then_some((seq, point))
}

/// Whether consumer `id`, rotated into `rot`'s epoch, is to be cut now to
/// be replayed that epoch's start: the shared stream sent it the rest of
/// the epoch (the stream made it), and it took every unit it was sent
/// (`unread`: noticed and not taken; a paused one that did not is cut as
/// any member is instead).
pub(super) fn start_due(hub: &Hub, id: ConsumerId, rot: Rotation, unread: usize) -> bool {
    hub.view().read_through(id, rot.epoch) && unread == 0
}

/// Consumer `id` re-joined the shared stream rotated into `at`'s epoch,
/// read from `point` (its replay stood at the epoch's start, `at`): its
/// replay ends there and will walk the rotated order, and it is told.
pub(super) fn rotated(
    s: &Stream,
    inner: &mut Inner,
    id: ConsumerId,
    (at, point): (Position, Position),
) {
    let Some(conn) = inner.conns.get_mut(&id) else {
        return;
    };
    if let Some(r) = conn.replay.as_mut() {
        r.to = Some(at);
        r.rotation = Some(Rotation {
            epoch: at.epoch,
            at: point.sample,
        });
    }
    conn.own.shared.resume_at(point);
    conn.own.place.merged(point);
    conn.merges.rotations += 1;
    if !notify(inner, id, ServerMsg::Rotate(point)) {
        return;
    }
    tracing::info!(
        stream = %s.name(),
        consumer = id,
        epoch = at.epoch,
        from = point.sample,
        "a replayed consumer reads this epoch from where the shared stream is, and its start after its end"
    );
}

/// Consumer `id`, rotated as `rot` says, was cut (the hub knows, nothing
/// taken back): its replay reopens at the epoch's start from `now`, and
/// it is told.
pub(super) fn cut_for_start(
    s: &Stream,
    inner: &mut Inner,
    id: ConsumerId,
    rot: Rotation,
    now: Instant,
) {
    let from = rot.owed_from();
    if let Some(r) = inner.conns.get_mut(&id).and_then(|c| c.replay.as_mut()) {
        r.reopen(from, now);
    }
    if notify(inner, id, ServerMsg::Cut(from)) {
        tracing::debug!(stream = %s.name(), consumer = id, epoch = rot.epoch, until = rot.at, "replaying a rotated epoch's start after its end");
    }
    s.work_cv.notify_all();
}
