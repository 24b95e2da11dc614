//! Groups: the ranks of one data-parallel trial split each epoch among
//! them ([`batchcast::deal`]). The split is the members' own (each client
//! keeps its runs of the deal); the stream only checks the seats, so that
//! two members never take one share and they all deal alike: one rank per
//! seat, one world, one `replicate`, one batch size and `drop_last` per
//! group. A seat is free again when its consumer leaves (a restarted rank
//! takes it back). A group is named within its members' uid: members of
//! two uids under one name are two groups, so a guest can neither take a
//! rank of the owner's group nor fix its world first, whoever comes
//! first (after a broker restart too). A seat held by another member of
//! the uid is refused `Busy` (it may be a rank's old connection, not yet
//! gone): a reconnecting client tries again until its
//! `reconnect_timeout`.

use batchcast::proto::{ConsumeRequest, Seat};

use super::Inner;
use super::error::SubscribeError;
use super::shape::Shape;

/// Refuses a seat another member holds, or one that would deal other
/// than the group's members do.
pub(super) fn check(
    inner: &Inner,
    req: &ConsumeRequest,
    shape: Shape,
    uid: u32,
) -> Result<(), SubscribeError> {
    let Some(seat) = &req.group else {
        return Ok(());
    };
    let refuse = |why: String| Err(SubscribeError::Seat(why));
    if let Err(why) = seat.validate() {
        return refuse(why.to_string());
    }
    let members = inner
        .conns
        .values()
        .filter_map(|c| c.seat.as_ref().map(|s| (s, c)))
        .filter(|(s, c)| s.name == seat.name && c.peer.uid == uid);
    for (other, conn) in members {
        let who = format!("`{}` (pid {})", conn.peer.name, conn.peer.pid);
        if other.rank == seat.rank {
            return Err(SubscribeError::SeatTaken(format!(
                "group `{}`: rank {} is taken by {who}; each rank of a group reads its own share once",
                seat.name, seat.rank
            )));
        }
        if (other.world, other.replicate) != (seat.world, seat.replicate) {
            return refuse(format!(
                "group `{}` has world {} (replicate {}) as {who} joined it; this member says world {} (replicate {})",
                seat.name, other.world, other.replicate, seat.world, seat.replicate
            ));
        }
        let own = (conn.own.batch_size, conn.own.drop_last);
        if own != (shape.batch_size, shape.drop_last) {
            return refuse(format!(
                "group `{}` reads batches of {} (drop_last {}) as {who} does; this member asks for {} (drop_last {}): a group's members share one batch size, so that every rank gets as many batches",
                seat.name, own.0, own.1, shape.batch_size, shape.drop_last
            ));
        }
    }
    Ok(())
}

/// How stats show a seat: `name rank/world` (`×k` when replicated).
pub(super) fn label(seat: &Seat) -> String {
    let rep = if seat.replicate > 1 {
        format!(" ×{}", seat.replicate)
    } else {
        String::new()
    };
    format!("{} {}/{}{rep}", seat.name, seat.rank, seat.world)
}
