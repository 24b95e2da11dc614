//! Delivery: consumers joining and leaving the stream, and what the hub
//! emits reaching them. A batch reaches a mailbox consumer as a notice in
//! its mailbox (its bell rung once per dispatch); anything else, and every
//! batch of a socket consumer, is a message on the connection's outbox,
//! which the server's task for that connection writes out.
//!
//! Releases come back on the socket ([`Stream::release`]) or through
//! mailboxes, which are taken only when someone needs a slot ([`settle`]).
//! A consumer that breaks its mailbox's protocol (a forged release, a
//! count out of range, a ring it never reads) is ended alone.

use std::sync::atomic::Ordering;
use std::time::Instant;

use batchcast::mailbox::BrokerMailbox;
use batchcast::proto::{self, Unit};

use super::conn::{Conn, Ending, end_mailbox_consumer};
use super::error::{ReleaseError, ReplayError};
use super::mirror::request_copies;
use super::stats::consumer_stats;
use super::{Inner, Stream};
use crate::hub::{ConsumerId, HubError, Outbound};

/// Delivery's own state: whether a doorbell rang, and buffers reused
/// between drains and dispatches.
#[derive(Debug, Default)]
pub(super) struct Dispatch {
    /// A doorbell rang: take every mailbox's releases at the next settle.
    drain_all: bool,
    /// Releases drained from mailboxes, reused between drains.
    drained: Vec<(ConsumerId, Unit)>,
    /// What the hub emitted, reused between dispatches.
    outbound: Vec<(ConsumerId, Outbound)>,
}

impl Dispatch {
    /// Takes every mailbox's releases at the next settle (a doorbell rang,
    /// a producer is about to wait, stats are asked for).
    pub(super) fn drain_all(&mut self) {
        self.drain_all = true;
    }
}

impl Stream {
    pub fn release(&self, id: ConsumerId, r: proto::Release) -> Result<(), ReleaseError> {
        let now = proto::monotonic_ns();
        self.with_hub(|inner| release(inner, id, r, now))
    }

    pub fn goodbye(&self, id: ConsumerId) {
        self.with_hub(|inner| {
            // A mailbox consumer gives back the notices it read and will
            // not use before it says goodbye: take them now. Notices
            // written after it last looked it never read: give those back
            // for it (a release of one of them that still comes is refused,
            // which ends only this consumer, which is leaving anyway).
            inner.deliver.drain_all = true;
            if drain(inner, |cid, _| cid == id) {
                dispatch(inner);
            }
            let unread = inner
                .conns
                .get_mut(&id)
                .and_then(|c| c.out.mailbox_mut())
                .map(BrokerMailbox::unread_units)
                .unwrap_or_default();
            for unit in unread {
                if let Err(e) = take_release(inner, id, unit) {
                    tracing::debug!(consumer = id, "giving back an unread notice: {e}");
                }
            }
            let _ = inner.hub.goodbye(id);
            if let Some(c) = inner.conns.get_mut(&id) {
                c.ending.get_or_insert(Ending::SaidGoodbye);
            }
        });
    }

    /// The connection is gone; idempotent.
    pub fn leave(&self, id: ConsumerId) {
        self.with_hub(|inner| {
            // A copy for it keeps its host slot pinned in the hub until the
            // copy is reported, so leaving needs no fence.
            let last = consumer_stats(inner, id);
            inner.fill.regions.forget(id);
            if inner.hub.leave(id) {
                tracing::info!(stream = %self.name(), consumer = id, "consumer left; its slots are released");
            }
            if let Some(conn) = inner.conns.remove(&id)
                && let Some(mut last) = last
            {
                last.held = 0;
                last.queued = 0;
                last.left = Some(
                    conn.ending
                        .map_or_else(|| "disconnected".into(), |e| e.to_string()),
                );
                let past = &mut inner.records.past;
                if past.len() == proto::PAST_CONSUMERS {
                    past.pop_front();
                }
                past.push_back(last);
            }
        });
    }

    /// A mailbox consumer rang: it released while a producer waited.
    pub(crate) fn doorbell(&self) {
        self.with_hub(|inner| inner.deliver.drain_all = true);
    }

    /// See `crate::hub::Hub::set_min_consumers`; whether the stream was still
    /// waiting to start.
    pub fn set_min_consumers(&self, min: u32) -> bool {
        self.with_hub(|inner| {
            let waiting = inner.hub.view().counts().produced == 0;
            inner.hub.set_min_consumers(min);
            waiting
        })
    }
}

/// Counts a release (from the socket or a mailbox) in the hub and in the
/// consumer's numbers.
fn release(
    inner: &mut Inner,
    id: ConsumerId,
    r: proto::Release,
    now: u64,
) -> Result<(), ReleaseError> {
    take_release(inner, id, r.unit)?;
    if let Some(c) = inner.conns.get_mut(&id) {
        c.tally.wait_ns = c.tally.wait_ns.saturating_add(r.wait_ns);
        c.tally.busy_ns = c.tally.busy_ns.saturating_add(r.busy_ns);
        c.tally.taken = c.tally.taken.max(r.taken);
        if let Some(sent) = r.unit.shared().and_then(|seq| c.tally.sent_ns.remove(&seq)) {
            c.tally.hold_ns = c.tally.hold_ns.saturating_add(now.saturating_sub(sent));
        }
    }
    Ok(())
}

/// Brings the hub and the mailboxes in step: sends what the hub emitted,
/// sets each mailbox's doorbell wish and, with `all` (a producer is about
/// to wait or looks after a nap, a doorbell rang, stats are asked for),
/// takes the releases written there, until nothing changes.
///
/// Releases are taken only then: mailbox consumers are sent every batch at
/// once ([`Delivery::Ahead`]), so nobody waits for the broker to take a
/// release except a pipeline waiting on slots. So a producer with free
/// slots reads no consumer's lines.
///
/// A consumer is asked to ring when nobody would look at its mailbox soon:
/// a pipeline thread or an external producer waits without napping.
pub(super) fn settle(inner: &mut Inner, all: bool) {
    let all = all || std::mem::take(&mut inner.deliver.drain_all);
    dispatch(inner);
    ask_for_doorbells(inner);
    if !all {
        return;
    }
    // Pairs with the consumer's fence between writing a release and
    // reading the wish: either we see its release, or it sees the wish.
    std::sync::atomic::fence(Ordering::SeqCst);
    while drain_mailboxes(inner) {
        dispatch(inner);
        // What was taken may leave other owers of the ring's next unit:
        // the wishes follow (a wish raised here is drained after, as the
        // first).
        ask_for_doorbells(inner);
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

/// Sets each mailbox's doorbell wish. A waiting pipeline thread or
/// producer wants a slot while none is free: only a release of the unit
/// in the ring's next slot frees one, so only the consumers that owe it
/// are asked to ring, and those being replayed to (a release frees a
/// slot of their replay arena, which nobody else would look at). Asking
/// every consumer had each of them send a message on its socket after
/// every release while the pipeline waited: work for the broker's I/O
/// thread that grew with the number of consumers.
fn ask_for_doorbells(inner: &mut Inner) {
    let want = inner.fill.wants_doorbells();
    let owers = match want {
        true => inner.hub.view().pinning().map(|(_, owe)| owe),
        false => None,
    }
    .unwrap_or_default();
    for (id, conn) in inner.conns.iter_mut() {
        let replayed = || conn.replay.as_ref().is_some_and(|r| r.active());
        let wish = want && (owers.contains(id) || replayed());
        if let Some(mb) = conn.out.mailbox_mut() {
            mb.set_want(wish);
        }
    }
}

/// A release of a shared unit (the hub's) or of a replayed batch (the
/// consumer's replay book's): one path, told apart by the unit's type.
fn take_release(inner: &mut Inner, id: ConsumerId, unit: Unit) -> Result<(), ReleaseError> {
    let seq = match unit {
        // One the ring left behind for it is not the hub's any more.
        Unit::Shared(seq) if inner.fill.regions.release_left(id, seq) => return Ok(()),
        Unit::Shared(seq) => return Ok(inner.hub.release(id, seq)?),
        Unit::Replayed(seq) => seq,
    };
    {
        let Some(conn) = inner.conns.get_mut(&id) else {
            return Err(ReplayError::NotHeld { seq }.into());
        };
        let Some(r) = conn.replay.as_mut() else {
            return Err(ReplayError::NotHeld { seq }.into());
        };
        if r.release(seq, Instant::now())? {
            // Its arena and budget go back now.
            conn.replay = None;
        }
    }
    Ok(())
}

/// Takes the releases of consumers being replayed to (a pipeline thread
/// waits on them), and sends what the hub emits after.
pub(super) fn drain_replaying(inner: &mut Inner) {
    std::sync::atomic::fence(Ordering::SeqCst);
    if drain(inner, |_, c| c.replay.is_some()) {
        dispatch(inner);
    }
}

/// Takes the releases written to every mailbox; whether there were any.
fn drain_mailboxes(inner: &mut Inner) -> bool {
    drain(inner, |_, _| true)
}

/// Takes the releases written to the mailboxes of the consumers `which`
/// picks; whether there were any.
fn drain(inner: &mut Inner, which: impl Fn(ConsumerId, &Conn) -> bool) -> bool {
    let mut taken = std::mem::take(&mut inner.deliver.drained);
    let mut broken = Vec::new();
    for (&id, conn) in inner.conns.iter_mut() {
        if !which(id, conn) {
            continue;
        }
        let Some(mb) = conn.out.mailbox_mut() else {
            continue;
        };
        match mb.drain(|unit| taken.push((id, unit))) {
            Ok((_, totals)) => conn.tally.mailbox = totals,
            Err(e) => broken.push((id, e.to_string())),
        }
    }
    let any = !taken.is_empty();
    for (id, unit) in taken.drain(..) {
        match take_release(inner, id, unit) {
            // Detached by one of its own releases just taken (the lag
            // limit): the hub gave back everything it held, and the reason
            // is on its way; the rest of what it released is moot.
            Err(ReleaseError::Hub(HubError::UnknownConsumer(_))) => {}
            Err(e) => broken.push((id, format!("bad release: {e}"))),
            Ok(()) => {}
        }
    }
    inner.deliver.drained = taken;
    for (id, why) in broken {
        end_mailbox_consumer(inner, id, why);
    }
    any
}

/// Turns what the hub emitted into notices in mailboxes and messages on
/// each connection's outbox, and the copies it ordered into requests to
/// each GPU's copier. (The hub sends a device consumer a batch only once
/// its copy has completed.)
fn dispatch(inner: &mut Inner) {
    let now = proto::monotonic_ns();
    let mut broken = Vec::new();
    let mut outbound = std::mem::take(&mut inner.deliver.outbound);
    inner.hub.swap_outbound(&mut outbound);
    for (id, out) in outbound.drain(..) {
        let Some(conn) = inner.conns.get_mut(&id) else {
            continue;
        };
        if let Some(msg) = conn.message(id, out, now)
            && let Err(why) = conn.out.deliver(msg)
        {
            broken.push((id, why.to_string()));
        }
    }
    inner.deliver.outbound = outbound;
    for conn in inner.conns.values_mut() {
        conn.out.ring();
    }
    if !broken.is_empty() {
        for (id, why) in broken {
            end_mailbox_consumer(inner, id, why);
        }
        // Ending a consumer may let the hub send others what it held back.
        dispatch(inner);
        return;
    }
    request_copies(inner);
}
