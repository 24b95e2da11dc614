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

use std::collections::HashMap;
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::time::Instant;

use batchcast::mailbox::{Bell, BrokerMailbox, Notice, Totals};
use batchcast::proto::{
    self, BatchReady, EpochEnd, ErrorCode, ErrorMsg, GoodbyeReason, MailboxSpec, Position,
    ReplayGrant, ServerMsg,
};
use tokio::sync::mpsc;

use super::mirror::request_copies;
use super::replay::{self, Replay, ReplayError};
use super::stats::{Cut, consumer_stats};
use super::{Inner, Stream, StreamFailed};
use crate::gpu::{GpuError, GpuKey};
use crate::hub::{ConsumerId, HubError, Outbound};

/// A connected consumer, as the stream sees it.
#[derive(Debug)]
pub(super) struct Conn {
    /// Messages for the connection's task, bounded: the hub never emits more
    /// than a window of batches plus a few control messages ahead of releases.
    pub(super) tx: mpsc::Sender<ServerMsg>,
    pub(super) name: String,
    pub(super) pid: u32,
    pub(super) uid: u32,
    /// When each unreleased batch was handed to the connection (ns).
    pub(super) sent_ns: HashMap<u64, u64>,
    pub(super) hold_ns: u64,
    pub(super) wait_ns: u64,
    pub(super) busy_ns: u64,
    /// Its own batch size and window (in its batches; the hub counts the
    /// units they span).
    pub(super) batch_size: u64,
    pub(super) window: u32,
    /// Its own batches in what it was sent: of the shared stream (from
    /// where its replay ends) and replayed.
    pub(super) cut: Cut,
    pub(super) replay_cut: Cut,
    /// The stream's production unit (samples of a full batch).
    pub(super) unit: u64,
    /// Replay in progress ([`super::replay`]), samples replayed to it and
    /// the CPU they cost.
    pub(super) replay: Option<Replay>,
    pub(super) replayed: u64,
    pub(super) replay_cpu: std::time::Duration,
    /// Where its first batch begins (its batch boundaries are counted from
    /// there in that epoch, from each epoch's start after).
    pub(super) anchor: Position,
    /// Decoupled pace: how often it was cut from the shared stream, and
    /// where it last merged back (its anchor until then).
    pub(super) cuts: u64,
    pub(super) merged_at: Position,
    pub(super) joined: Instant,
    /// Why it is about to leave, once known (the stream ended for it, it
    /// was detached, it said goodbye); otherwise it disconnected.
    pub(super) ending: Option<Ending>,
    /// Device consumers: their GPU.
    pub(super) gpu: Option<GpuKey>,
    /// Host consumers that asked for one: where their batches are noticed
    /// and their releases written (see [`batchcast::mailbox`]).
    pub(super) mailbox: Option<BrokerMailbox>,
    /// The mailbox's bytes in the broker's memory budget.
    pub(super) _mailbox_grant: Option<crate::budget::Grant>,
    /// Its mailbox got notices in this dispatch: ring the bell.
    pub(super) ring: bool,
    /// What it says of the batches it released through its mailbox (it
    /// times them itself: the broker takes those releases only now and
    /// then).
    pub(super) mailbox_totals: Totals,
}

/// Why a consumer is about to leave, once known; none means it
/// disconnected. Shown in `stats` as its last line's `left`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Ending {
    StreamEnded,
    SaidGoodbye,
    /// Its lag passed the stream's limit.
    Detached(String),
    /// It broke its mailbox's protocol.
    Ended(String),
    DeviceFailed(GpuError),
}

impl fmt::Display for Ending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ending::StreamEnded => f.write_str("stream ended"),
            Ending::SaidGoodbye => f.write_str("said goodbye"),
            Ending::Detached(why) => write!(f, "detached: {why}"),
            Ending::Ended(why) => write!(f, "ended: {why}"),
            Ending::DeviceFailed(why) => write!(f, "device failed: {why}"),
        }
    }
}

/// Who is connecting, for stats.
#[derive(Debug, Clone)]
pub struct Peer {
    pub name: String,
    pub pid: u32,
    pub uid: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error(transparent)]
    Hub(#[from] HubError),
    #[error("the stream stopped: {0}")]
    Failed(StreamFailed),
    #[error(transparent)]
    Device(GpuError),
    #[error("cannot make its mailbox: {0}")]
    Mailbox(batchcast::Error),
    #[error(transparent)]
    OverBudget(#[from] crate::budget::OverBudget),
    #[error("{0}")]
    BatchSize(String),
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

/// A release that does not name a batch the consumer holds.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error(transparent)]
    Hub(#[from] HubError),
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

/// A mailbox granted to a consumer: the server sends its fd with the
/// welcome and rings its bell after each socket write.
#[derive(Debug)]
pub struct MailboxGrant {
    pub spec: MailboxSpec,
    pub fd: OwnedFd,
    pub bell: Bell,
}

/// What a consumer gets on subscribing.
#[derive(Debug)]
pub struct Subscription {
    pub id: ConsumerId,
    pub start_epoch: u64,
    pub shape: Shape,
    pub rx: mpsc::Receiver<ServerMsg>,
    /// Device consumers: the arena to open.
    pub device: Option<proto::DeviceArena>,
    pub mailbox: Option<MailboxGrant>,
    /// Replay granted: what the welcome says, and its arena's fd.
    pub replay: Option<(ReplayGrant, OwnedFd)>,
}

/// What a consumer asks for: its hello's request, as it came.
pub use batchcast::proto::ConsumeRequest;

/// What a consumer's batches cost the hub: its batch size and the units it
/// may hold for its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub batch_size: u64,
    /// Whether it drops an epoch's short last batch: its own choice, else
    /// the stream's `drop_last`.
    pub drop_last: bool,
    /// The stream's production unit (samples of a full batch).
    pub unit: u64,
    /// The hub's window for it, in production units.
    pub units: u32,
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
            inner.drain_all = true;
            if drain(inner, |cid, _| cid == id) {
                dispatch(inner);
            }
            let unread = inner
                .conns
                .get_mut(&id)
                .and_then(|c| c.mailbox.as_mut())
                .map(BrokerMailbox::unread_units)
                .unwrap_or_default();
            for seq in unread {
                if let Err(e) = take_release(inner, id, seq) {
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
                if inner.past.len() == proto::PAST_CONSUMERS {
                    inner.past.pop_front();
                }
                inner.past.push_back(last);
            }
        });
    }

    /// A mailbox consumer rang: it released while a producer waited.
    pub fn doorbell(&self) {
        self.with_hub(|inner| inner.drain_all = true);
    }

    /// See [`crate::hub::Hub::set_min_consumers`]; whether the stream was still
    /// waiting to start.
    pub fn set_min_consumers(&self, min: u32) -> bool {
        self.with_hub(|inner| {
            let waiting = inner.hub.counts().produced == 0;
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
    take_release(inner, id, r.seq)?;
    if let Some(c) = inner.conns.get_mut(&id) {
        c.wait_ns = c.wait_ns.saturating_add(r.wait_ns);
        c.busy_ns = c.busy_ns.saturating_add(r.busy_ns);
        if let Some(sent) = c.sent_ns.remove(&r.seq) {
            c.hold_ns = c.hold_ns.saturating_add(now.saturating_sub(sent));
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
    let all = all || std::mem::take(&mut inner.drain_all);
    dispatch(inner);
    let want = inner.armed_workers > 0 || inner.producer_waiting;
    for conn in inner.conns.values_mut() {
        if let Some(mb) = conn.mailbox.as_mut() {
            mb.set_want(want);
        }
    }
    if !all {
        return;
    }
    // Pairs with the consumer's fence between writing a release and
    // reading the wish: either we see its release, or it sees the wish.
    std::sync::atomic::fence(Ordering::SeqCst);
    while drain_mailboxes(inner) {
        dispatch(inner);
    }
}

/// A release of a shared unit, or (with [`proto::REPLAYED`]) of a
/// replayed batch.
fn take_release(inner: &mut Inner, id: ConsumerId, seq: u64) -> Result<(), ReleaseError> {
    if seq & proto::REPLAYED != 0 {
        replay::release(inner, id, seq & !proto::REPLAYED)?;
        return Ok(());
    }
    Ok(inner.hub.release(id, seq)?)
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
    let mut taken = std::mem::take(&mut inner.drained);
    let mut broken = Vec::new();
    for (&id, conn) in inner.conns.iter_mut() {
        if !which(id, conn) {
            continue;
        }
        let Some(mb) = conn.mailbox.as_mut() else {
            continue;
        };
        match mb.drain(|seq| taken.push((id, seq))) {
            Ok((_, totals)) => conn.mailbox_totals = totals,
            Err(e) => broken.push((id, e.to_string())),
        }
    }
    let any = !taken.is_empty();
    for (id, seq) in taken.drain(..) {
        if let Err(e) = take_release(inner, id, seq) {
            broken.push((id, format!("bad release: {e}")));
        }
    }
    inner.drained = taken;
    for (id, why) in broken {
        end_mailbox_consumer(inner, id, why);
    }
    any
}

/// A consumer broke the mailbox protocol: it gets an error and nothing
/// more, and leaves when its connection closes. Nobody else is affected.
pub(super) fn end_mailbox_consumer(inner: &mut Inner, id: ConsumerId, why: String) {
    let Some(conn) = inner.conns.get_mut(&id) else {
        return;
    };
    if conn.mailbox.is_none() {
        return; // already ended
    }
    end_consumer(inner, id, ErrorCode::InvalidRequest, why);
}

/// Ends one consumer: its mailbox is dropped (no more notices), it is sent
/// an error with `code` and a goodbye, and it takes nothing more from the
/// hub; it leaves when its connection closes. Nobody else is affected.
pub(super) fn end_consumer(inner: &mut Inner, id: ConsumerId, code: ErrorCode, why: String) {
    let Some(conn) = inner.conns.get_mut(&id) else {
        return;
    };
    conn.mailbox = None;
    tracing::warn!(consumer = id, name = %conn.name, "ending a consumer: {why}");
    conn.ending = Some(Ending::Ended(why.clone()));
    send(
        conn,
        id,
        ServerMsg::Error(ErrorMsg {
            code,
            message: format!("the broker ended this consumer: {why}"),
        }),
    );
    send(conn, id, ServerMsg::Goodbye(GoodbyeReason::Detached));
    let _ = inner.hub.goodbye(id);
}

/// Turns what the hub emitted into notices in mailboxes and messages on
/// each connection's outbox, and the copies it ordered into requests to
/// each GPU's copier. (The hub sends a device consumer a batch only once
/// its copy has completed.)
fn dispatch(inner: &mut Inner) {
    let now = proto::monotonic_ns();
    let mut broken = Vec::new();
    let mut outbound = std::mem::take(&mut inner.outbound);
    inner.hub.swap_outbound(&mut outbound);
    for (id, out) in outbound.drain(..) {
        let Some(conn) = inner.conns.get_mut(&id) else {
            continue;
        };
        let msg = conn.message(id, out, now);
        if let Some(mb) = conn.mailbox.as_mut()
            && let Some(n) = notice(&msg)
        {
            match mb.push(&n) {
                Ok(()) => conn.ring = true,
                Err(e) => broken.push((id, e.to_string())),
            }
            continue;
        }
        send(conn, id, msg);
    }
    inner.outbound = outbound;
    for conn in inner.conns.values_mut() {
        if std::mem::take(&mut conn.ring)
            && let Some(mb) = &conn.mailbox
        {
            mb.ring();
        }
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

/// The mailbox notice for a message, for the kinds a mailbox carries.
fn notice(msg: &ServerMsg) -> Option<Notice> {
    match msg {
        ServerMsg::Batch(b) => Some(Notice::Batch(*b)),
        ServerMsg::EndOfEpoch(e) => Some(Notice::EndOfEpoch(*e)),
        ServerMsg::EndOfStream => Some(Notice::EndOfStream),
        _ => None,
    }
}

impl Conn {
    /// A consumer that just joined; `skip`: where its shared samples
    /// begin to count (see [`Cut`]).
    pub(super) fn new(
        tx: mpsc::Sender<ServerMsg>,
        peer: Peer,
        shape: Shape,
        req: &ConsumeRequest,
        mailbox: (Option<BrokerMailbox>, Option<crate::budget::Grant>),
        replay: Option<Replay>,
        (skip, anchor): (Option<Position>, Position),
    ) -> Conn {
        Conn {
            tx,
            name: peer.name,
            pid: peer.pid,
            uid: peer.uid,
            sent_ns: HashMap::new(),
            hold_ns: 0,
            wait_ns: 0,
            busy_ns: 0,
            batch_size: shape.batch_size,
            window: req.window,
            cut: Cut::new(shape.batch_size, shape.drop_last).skipping(skip),
            replay_cut: Cut::new(shape.batch_size, shape.drop_last),
            unit: shape.unit,
            replay,
            replayed: 0,
            replay_cpu: std::time::Duration::ZERO,
            anchor,
            cuts: 0,
            merged_at: anchor,
            joined: Instant::now(),
            ending: None,
            gpu: req.device.as_ref().map(|dev| dev.uuid),
            mailbox: mailbox.0,
            _mailbox_grant: mailbox.1,
            ring: false,
            mailbox_totals: Totals::default(),
        }
    }

    /// The message for what the hub emitted to this consumer, counting a
    /// batch in its numbers and noting why it is about to leave. A detached
    /// consumer is sent its error first, then the goodbye returned here.
    fn message(&mut self, id: ConsumerId, out: Outbound, now: u64) -> ServerMsg {
        match out {
            Outbound::Batch {
                seq,
                epoch,
                index,
                slot,
                samples,
            } => {
                if self.mailbox.is_none() {
                    self.sent_ns.insert(seq, now);
                }
                self.cut.add(epoch, index * self.unit, samples);
                ServerMsg::Batch(BatchReady {
                    seq,
                    epoch,
                    index,
                    slot,
                    samples,
                    sent_ns: now,
                })
            }
            Outbound::EndOfEpoch {
                epoch,
                batches,
                complete,
            } => ServerMsg::EndOfEpoch(EpochEnd {
                epoch,
                batches,
                complete,
            }),
            Outbound::EndOfStream => {
                self.ending = Some(Ending::StreamEnded);
                ServerMsg::EndOfStream
            }
            Outbound::Detached { reason, code } => {
                tracing::warn!(consumer = id, name = %self.name, "{reason}");
                send(
                    self,
                    id,
                    ServerMsg::Error(ErrorMsg {
                        code,
                        message: reason.clone(),
                    }),
                );
                self.ending = Some(Ending::Detached(reason));
                ServerMsg::Goodbye(GoodbyeReason::Detached)
            }
        }
    }
}

pub(super) fn send(conn: &Conn, id: ConsumerId, msg: ServerMsg) {
    // Full cannot happen (the outbox holds a window and then some); Closed
    // means the connection is going away and will leave.
    if let Err(e) = conn.tx.try_send(msg) {
        tracing::debug!(consumer = id, "outbox: {e}");
    }
}
