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
//!   the unit in it was made at least [`CUT_AFTER`] ago (a consumer a
//!   moment late, as trainers starting together are, is not worth a
//!   replay), some consumer has read everything published for it (it
//!   waits for the pipeline), and every consumer that owes that unit can
//!   be cut: a decoupled consumer (host memory, a mailbox, not replaying)
//!   with units noticed and not taken. Otherwise the pipeline waits, as in
//!   lockstep.
//! * The cut takes back, through the mailbox's handshake
//!   ([`batchcast::mailbox`]), exactly the units it has not taken; what it
//!   took stays held until released. Its replay begins at its own batch
//!   boundary at or before the first sample it lost ([`boundary`]), and not
//!   before where it last merged back (the unit holding that point began
//!   before it): its client drops the batch it was building, which begins
//!   there.
//! * It merges back when its replay is to start a batch inside a unit the
//!   shared stream still publishes, with at most half the ring ahead of it
//!   (room to keep up), once it holds no unit from before its cut (it would
//!   pin the ring again at once): the hub re-joins it at that unit ([`crate::hub::Hub::rejoin`]),
//!   its replay ends there, and its client skips the unit's samples before
//!   that point. At the stream's end it merges at the end.
//! * Every sample reaches it once, in order: from the shared stream before
//!   the cut, replayed between, from the shared stream after the merge.

use std::time::{Duration, Instant};

use batchcast::mailbox::{BrokerMailbox, Notice};
use batchcast::proto::{self, Position};

use super::deliver::{Conn, end_mailbox_consumer, settle};
use super::{Inner, Stream};
use crate::config::Pace;
use crate::hub::{ConsumerId, Hub};

/// How old the unit in the ring's next slot must be before the consumers
/// that owe it are cut.
pub(super) const CUT_AFTER: Duration = Duration::from_millis(10);

/// The batch boundary at or before `p` of a consumer of batch size `batch`
/// whose first batch begins at `anchor`: boundaries are counted from the
/// anchor in its epoch, from each epoch's start after.
pub(super) fn boundary(anchor: Position, p: Position, batch: u64) -> Position {
    if p <= anchor {
        return anchor;
    }
    let batch = batch.max(1);
    let base = if p.epoch == anchor.epoch {
        anchor.sample
    } else {
        0
    };
    Position {
        epoch: p.epoch,
        sample: base + (p.sample - base) / batch * batch,
    }
}

/// Writes a notice to consumer `id`'s mailbox and rings; a full mailbox
/// ends that consumer (`false`).
fn notify(inner: &mut Inner, id: ConsumerId, notice: Notice) -> bool {
    let pushed = inner
        .conns
        .get_mut(&id)
        .and_then(|c| c.mailbox.as_mut())
        .map(|mb| mb.push(&notice).map(|()| mb.ring()));
    if let Some(Err(e)) = pushed {
        end_mailbox_consumer(inner, id, e.to_string());
        return false;
    }
    true
}

/// Shared units noticed to this consumer and not yet taken.
fn unread(c: &mut Conn) -> usize {
    c.mailbox.as_mut().map_or(0, |mb| {
        mb.unread_units()
            .iter()
            .filter(|&&s| s & proto::REPLAYED == 0)
            .count()
    })
}

/// Whether consumer `id` may be cut: decoupled, reading the shared stream
/// (its last replay's batches all sent: a cut's notice must follow them),
/// and behind (units wait for it, noticed or queued).
fn cuttable(hub: &Hub, id: ConsumerId, c: &mut Conn) -> bool {
    let Some(queued) = hub.reading(id) else {
        return false;
    };
    c.mailbox.is_some()
        && c.ending.is_none()
        && c.replay
            .as_ref()
            .is_some_and(|r| r.keep && !r.running() && !r.open() && r.settled())
        && (queued > 0 || unread(c) > 0)
}

impl Stream {
    /// Unit `seq` was made (decoupled pace: its age decides a cut).
    pub(super) fn made(&self, inner: &mut Inner, seq: u64) {
        if self.plan.pace != Pace::Decoupled {
            return;
        }
        inner.made_at.push_back((seq, Instant::now()));
        while inner.made_at.len() > self.plan.slots as usize {
            inner.made_at.pop_front();
        }
    }

    /// The pipeline waits for the ring's next slot: cuts the consumers that
    /// owe its unit if the rules allow (see the module's). Whether it did.
    pub(super) fn cut_laggards(&self, inner: &mut Inner) -> bool {
        if self.plan.pace != Pace::Decoupled {
            return false;
        }
        let Some((seq, owe)) = inner.hub.pinning() else {
            return false;
        };
        // Made longer ago than the ring remembers: old enough.
        let young = inner
            .made_at
            .iter()
            .find(|(s, _)| *s == seq)
            .is_some_and(|(_, t)| t.elapsed() < CUT_AFTER);
        if young {
            return false;
        }
        let Inner { hub, conns, .. } = &mut *inner;
        let hungry = conns
            .iter_mut()
            .any(|(&id, c)| hub.reading(id) == Some(0) && unread(c) == 0);
        if !hungry || owe.is_empty() {
            return false;
        }
        let all = owe
            .iter()
            .all(|id| conns.get_mut(id).is_some_and(|c| cuttable(hub, *id, c)));
        if !all {
            return false;
        }
        let mut any = false;
        for id in owe {
            any |= self.cut(inner, id);
        }
        any
    }

    /// Cuts consumer `id` from the shared stream; replay follows.
    fn cut(&self, inner: &mut Inner, id: ConsumerId) -> bool {
        let unit = self.plan.schema.batch_size;
        let Some(revoked) = inner
            .conns
            .get_mut(&id)
            .and_then(|c| c.mailbox.as_mut())
            .and_then(BrokerMailbox::cut)
        else {
            return false;
        };
        let (epoch, index) = match inner.hub.cut(id, &revoked) {
            Ok(first) => first,
            Err(e) => {
                // It released a unit it never took: only itself is harmed.
                end_mailbox_consumer(inner, id, format!("taking back its batches: {e}"));
                return false;
            }
        };
        let conn = inner.conns.get_mut(&id).expect("cut above");
        for seq in &revoked {
            conn.sent_ns.remove(seq);
        }
        let lost = Position {
            epoch,
            sample: index * unit,
        };
        // Not before where it last merged back: it has every sample before
        // that (the unit holding it began earlier).
        let restart = boundary(conn.anchor, lost, conn.batch_size).max(conn.merged_at);
        conn.cut.rewind(restart);
        conn.cuts += 1;
        if let Some(r) = conn.replay.as_mut() {
            r.reopen(restart);
        }
        if !notify(inner, id, Notice::Cut(restart)) {
            return true;
        }
        tracing::info!(
            stream = %self.name(),
            consumer = id,
            taken_back = revoked.len(),
            ?restart,
            "decoupled pace: a consumer fell a ring behind; it goes on from replay"
        );
        self.work_cv.notify_all();
        true
    }

    /// Merges back each cut consumer whose replay reached a unit the
    /// shared stream still publishes (see the module's rules).
    pub(super) fn merge_replays(&self, inner: &mut Inner) {
        if self.plan.pace != Pace::Decoupled {
            return;
        }
        let open: Vec<ConsumerId> = inner
            .conns
            .iter()
            .filter(|(_, c)| c.ending.is_none() && c.replay.as_ref().is_some_and(|r| r.open()))
            .map(|(&id, _)| id)
            .collect();
        let mut merged = false;
        for id in open {
            merged |= self.merge(inner, id);
        }
        if merged {
            settle(inner, false);
        }
    }

    fn merge(&self, inner: &mut Inner, id: ConsumerId) -> bool {
        let unit = self.plan.schema.batch_size;
        let Some(at) = inner
            .conns
            .get(&id)
            .and_then(|c| c.replay.as_ref())
            .map(|r| r.cursor)
        else {
            return false;
        };
        let Some(seq) = inner.hub.seq_of(at.epoch, at.sample / unit) else {
            return false;
        };
        let (head, slots) = inner.hub.head_seq();
        // It still holds units of the shared stream from before its cut: it
        // would pin the ring again at once.
        let holds = inner.hub.consumer_counts(id).is_none_or(|c| c.held > 0);
        if holds
            || head.saturating_sub(seq) > u64::from(slots / 2)
            || inner.hub.rejoin(id, seq).is_err()
        {
            return false;
        }
        let conn = inner.conns.get_mut(&id).expect("listed above");
        if let Some(r) = conn.replay.as_mut() {
            r.to = Some(at);
        }
        conn.cut.resume_at(at);
        conn.merged_at = at;
        if !notify(inner, id, Notice::Merge(at)) {
            return true;
        }
        tracing::info!(
            stream = %self.name(),
            consumer = id,
            ?at,
            "decoupled pace: a replayed consumer merged back into the shared stream"
        );
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(epoch: u64, sample: u64) -> Position {
        Position { epoch, sample }
    }

    #[test]
    fn replay_restarts_on_the_consumers_own_batch_boundary() {
        // Batches of 32 from the epoch's start: the boundary at or before.
        assert_eq!(boundary(p(0, 0), p(0, 100), 32), p(0, 96));
        assert_eq!(boundary(p(0, 0), p(0, 96), 32), p(0, 96));
        // Joined (or resumed) mid-epoch at 10: boundaries 10 + k·32 there,
        // k·32 in later epochs.
        assert_eq!(boundary(p(0, 10), p(0, 100), 32), p(0, 74));
        assert_eq!(boundary(p(0, 10), p(1, 100), 32), p(1, 96));
        // An epoch's start is always a boundary; nothing before the anchor.
        assert_eq!(boundary(p(0, 10), p(2, 0), 32), p(2, 0));
        assert_eq!(boundary(p(3, 0), p(1, 50), 32), p(3, 0));
        assert_eq!(boundary(p(0, 10), p(0, 10), 32), p(0, 10));
    }
}
