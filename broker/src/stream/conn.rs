//! A connected consumer as the stream sees it, made of parts that each
//! have one job: who it is ([`Peer`]), what it is sent ([`Outbox`], the
//! only writer to it), its own batching ([`OwnBatches`]), its numbers
//! ([`Tally`]), its replay ([`Replay`]) and, under decoupled pace, its
//! cuts and merges ([`Merges`]); and why it is about to leave.

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

use batchcast::mailbox::{BrokerMailbox, Totals};
use batchcast::proto::{
    self, BatchReady, ConsumeRequest, EpochEnd, ErrorCode, GoodbyeReason, Position, ServerMsg,
};
use tokio::sync::mpsc;

use super::Inner;
use super::batches::{BatchCounter, CutPlace};
use super::outbox::Outbox;
use super::replay::book::Replay;
use super::shape::Shape;
use crate::budget::Grant;
use crate::gpu::{GpuError, GpuKey};
use crate::hub::{ConsumerId, Outbound};

/// A connected consumer.
#[derive(Debug)]
pub(super) struct Conn {
    pub(super) peer: Peer,
    pub(super) out: Outbox,
    pub(super) own: OwnBatches,
    pub(super) tally: Tally,
    /// Replay in progress, or kept for the next (decoupled pace).
    pub(super) replay: Option<Replay>,
    pub(super) merges: Merges,
    /// Device consumers: their GPU, and their own arena there for the
    /// batches replayed to them.
    pub(super) gpu: Option<GpuKey>,
    pub(super) device_replay: Option<(
        std::sync::Arc<crate::gpu::ReplayTarget>,
        crate::budget::Grant,
    )>,
    /// Why it is about to leave, once known (the stream ended for it, it
    /// was detached, it said goodbye); otherwise it disconnected.
    pub(super) ending: Option<Ending>,
    /// Its seat in a group, if it took one.
    pub(super) seat: Option<batchcast::proto::Seat>,
    /// Why it has no replay arena where it would have kept one for cuts
    /// (the budget or its GPU refused it): said if it is detached.
    pub(super) no_replay: Option<String>,
}

/// Who is connecting, for stats and the budget.
#[derive(Debug, Clone)]
pub struct Peer {
    pub name: String,
    pub pid: u32,
    pub uid: u32,
}

/// The consumer's own batches: its batch size and window, where they
/// begin, and how many it was sent, of the shared stream and replayed.
#[derive(Debug)]
pub(super) struct OwnBatches {
    pub(super) batch_size: u64,
    pub(super) drop_last: bool,
    /// In its batches (the hub counts the units they span).
    pub(super) window: u32,
    /// The stream's production unit (samples of a full batch).
    pub(super) unit: u64,
    /// Where a cut restarts it: its batch boundaries, counted from where
    /// its first batch began in that epoch (from each epoch's start
    /// after), not before where it last merged back.
    pub(super) place: CutPlace,
    pub(super) shared: BatchCounter,
    pub(super) replayed: BatchCounter,
}

/// Its numbers for `stats`: hold, wait and busy times (the client's own
/// figures for the latter two), and what replay cost.
#[derive(Debug)]
pub(super) struct Tally {
    /// When each unreleased batch was handed to the connection (ns).
    pub(super) sent_ns: HashMap<u64, u64>,
    pub(super) hold_ns: u64,
    pub(super) wait_ns: u64,
    pub(super) busy_ns: u64,
    /// What it says of the batches it released through its mailbox (it
    /// times them itself: the broker takes those releases only now and
    /// then).
    pub(super) mailbox: Totals,
    /// Samples replayed to it, and the CPU they cost.
    pub(super) replayed: u64,
    pub(super) replay_cpu: Duration,
    pub(super) joined: Instant,
    /// Its client's number for it, and what it says its program has taken
    /// (the last release's count; a mailbox's words are read at `stats`).
    pub(super) serial: u32,
    pub(super) taken: proto::Taken,
}

/// Decoupled pace: how often it was cut from the shared stream (where it
/// last merged back is its [`CutPlace`]'s).
#[derive(Debug)]
pub(super) struct Merges {
    pub(super) cuts: u64,
    /// Epochs it was rotated into ([`super::rotate`]).
    pub(super) rotations: u64,
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
            // The limits' reasons say "detached: ..." to the consumer.
            Ending::Detached(why) => {
                write!(
                    f,
                    "detached: {}",
                    why.strip_prefix("detached: ").unwrap_or(why)
                )
            }
            Ending::Ended(why) => write!(f, "ended: {why}"),
            Ending::DeviceFailed(why) => write!(f, "device failed: {why}"),
        }
    }
}

/// Where a consumer that just joined begins: `skip`, where its shared
/// samples begin to count (see [`BatchCounter`]); `anchor`, where its
/// first batch begins.
#[derive(Debug, Clone, Copy)]
pub(super) struct Start {
    pub(super) skip: Option<Position>,
    pub(super) anchor: Position,
}

impl Start {
    pub(super) fn of(skip: Option<Position>, anchor: Position) -> Start {
        Start { skip, anchor }
    }
}

impl Conn {
    /// A consumer that just joined.
    pub(super) fn new(
        (id, tx): (ConsumerId, mpsc::Sender<ServerMsg>),
        peer: Peer,
        (shape, req): (Shape, &ConsumeRequest),
        mailbox: (Option<BrokerMailbox>, Option<Grant>),
        replay: Option<Replay>,
        start: Start,
    ) -> Conn {
        let gpu = req.device.as_ref().map(|dev| GpuKey::of(dev, peer.uid));
        Conn {
            peer,
            out: Outbox::new(id, tx, mailbox),
            own: OwnBatches {
                batch_size: shape.batch_size,
                drop_last: shape.drop_last,
                window: req.window,
                unit: shape.unit,
                place: CutPlace::new(start.anchor, shape.batch_size, shape.deal(req))
                    .skipping(start.skip),
                shared: BatchCounter::new(shape.batch_size, shape.drop_last)
                    .skipping(start.skip)
                    .dealt(shape.deal(req)),
                replayed: BatchCounter::new(shape.batch_size, shape.drop_last)
                    .dealt(shape.deal(req)),
            },
            tally: Tally {
                sent_ns: HashMap::new(),
                hold_ns: 0,
                wait_ns: 0,
                busy_ns: 0,
                mailbox: Totals::default(),
                replayed: 0,
                replay_cpu: Duration::ZERO,
                joined: Instant::now(),
                serial: req.serial,
                taken: req.taken,
            },
            replay,
            merges: Merges {
                cuts: 0,
                rotations: 0,
            },
            gpu,
            device_replay: None,
            ending: None,
            seat: req.group.as_deref().cloned(),
            no_replay: None,
        }
    }

    /// The message for what the hub emitted to this consumer, counting a
    /// batch in its numbers and noting why it is about to leave. A detached
    /// consumer is sent its error and goodbye here, and `None` returned.
    pub(super) fn message(&mut self, id: ConsumerId, out: Outbound, now: u64) -> Option<ServerMsg> {
        Some(match out {
            Outbound::Batch {
                seq,
                epoch,
                index,
                slot,
                samples,
            } => {
                if self.out.mailbox().is_none() {
                    self.tally.sent_ns.insert(seq, now);
                }
                self.own.shared.add(epoch, index * self.own.unit, samples);
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
                tracing::warn!(consumer = id, name = %self.peer.name, "{reason}");
                // The hub gave back every unit it held: the ones noticed
                // and not taken are taken back, so that it never reads
                // them (their slots may hold other data by now); it finds
                // the reason on its socket.
                if let Some(mb) = self.out.mailbox_mut() {
                    let _ = mb.cut();
                }
                self.out.end(code, reason.clone(), GoodbyeReason::Detached);
                self.ending = Some(Ending::Detached(reason));
                return None;
            }
        })
    }
}

/// A consumer broke the mailbox protocol: it gets an error and nothing
/// more, and leaves when its connection closes. Nobody else is affected.
pub(super) fn end_mailbox_consumer(inner: &mut Inner, id: ConsumerId, why: String) {
    let Some(conn) = inner.conns.get(&id) else {
        return;
    };
    if conn.out.mailbox().is_none() {
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
    conn.out.close_mailbox();
    tracing::warn!(consumer = id, name = %conn.peer.name, "ending a consumer: {why}");
    conn.ending = Some(Ending::Ended(why.clone()));
    conn.out.end(
        code,
        format!("the broker ended this consumer: {why}"),
        GoodbyeReason::Detached,
    );
    let _ = inner.hub.goodbye(id);
}

/// Tells consumer `id` of a cut or a merge (`ServerMsg::Cut`/`Merge`): a
/// notice in its mailbox (and a ring), or the message on its socket. A
/// full mailbox ends that consumer (`false`).
pub(super) fn notify(inner: &mut Inner, id: ConsumerId, msg: ServerMsg) -> bool {
    let Some(conn) = inner.conns.get_mut(&id) else {
        return false;
    };
    if let Err(why) = conn.out.deliver_now(msg) {
        end_mailbox_consumer(inner, id, why.to_string());
        return false;
    }
    true
}

/// Shared units noticed to this consumer and not yet taken.
pub(super) fn unread(c: &mut Conn) -> usize {
    c.out.mailbox_mut().map_or(0, |mb| mb.unread_shared())
}

/// Sends consumer `id` the replayed batches that are ready, in order.
pub(super) fn send_replayed(
    inner: &mut Inner,
    id: ConsumerId,
    ready: Vec<batchcast::proto::ReplayReady>,
) {
    let Some(conn) = inner.conns.get_mut(&id) else {
        return;
    };
    for m in ready {
        tracing::debug!(
            consumer = id,
            seq = m.seq,
            epoch = m.epoch,
            first = m.first,
            "replayed batch sent"
        );
        conn.tally.replayed += m.samples;
        conn.own.replayed.add(m.epoch, m.first, m.samples);
        if let Err(why) = conn.out.deliver_now(ServerMsg::Replay(m)) {
            end_mailbox_consumer(inner, id, why.to_string());
            return;
        }
    }
}
