//! One stream at run time: its arena, its hub, the pipeline threads that
//! fill slots, and the connections of its consumers. Files by role, lowest
//! first (a file imports only those above it in this list, and `mod.rs`):
//!
//! * `batches`: a consumer's own batches in the stream's samples: where
//!   they begin (`Boundaries`) and how many it was sent. Pure.
//! * `error`: what the stream refuses ([`SubscribeError`],
//!   `ReleaseError`, `ReplayError`) and why it stops ([`StreamFailed`]).
//! * `outbox`: the only writer to a consumer: socket messages, mailbox
//!   notices and their bell, "an error, then a goodbye".
//! * `replay/book`: one consumer's replay: its arena (with a named
//!   lifetime), batches making, made, sent, released.
//! * `cells`: a batch's cells as mutable bytes for the thread that fills
//!   it, against the claim that makes them its own: the only `unsafe`.
//! * `shape`: a consumer's own batch size and what its window costs.
//! * `conn`: a connected consumer, made of parts (peer, outbox, own
//!   batches, tally, replay, merges); ending one consumer alone, telling
//!   one of a cut, a merge or a rotation.
//! * `stats`: what `batchcast stats` shows of the stream.
//! * `mirror`: GPU copies (`Mirrors`): a device ring per GPU (a
//!   hub group), the copier's reports, a failing GPU.
//! * `deliver`: release, goodbye, leave; what the hub emitted turned into
//!   messages (`dispatch`), mailbox releases taken (`settle`).
//! * `replay`: replay's rules: who is replayed what, which thread makes
//!   which replayed batch (its load: `Load`), sending them in
//!   order.
//! * `rotate`: rotated epochs: a replayed consumer rotated into an epoch
//!   the ring holds, its start replayed after its end.
//! * `merge`: the merge rule and a merge round (merging back, rotating,
//!   a rotated epoch's start), no I/O: whoever carries it out lends its
//!   `Replays`.
//! * `decouple`: decoupled pace: cutting a consumer that fell a ring
//!   behind, the hold limit; the runtime's side of the hold and merge
//!   rounds.
//! * `hold`: the hold clock (`HoldClock`) and a round of its rule carried
//!   out through the runtime's `Hands`, with no clock inside: when
//!   units were begun and made, which unit pins the ring since when, the
//!   hold a round at the limit carries over.
//! * `subscribe`: a consumer joining: what is made outside the lock, then
//!   the hub, then replay.
//! * `fill`: pipeline threads (`Filling`: their counts and clocks;
//!   a thread's own loop): waiting for a free slot or a replay job
//!   (back-pressure, pacing, naps), writing the batch
//!   (`crate::pipeline::collate`) and publishing it.
//! * `port`: the external producer's side ([`Port`]): slots handed out one
//!   at a time, publishing, sealing the arena, the producer leaving.
//! * `mod.rs` (here): the stream's lifecycle: start, fail, shut down; the
//!   lock and `Stream::with_hub`, through which every change to the hub
//!   goes. `Inner`, under the lock, holds what every part needs (the hub,
//!   the connections, why the stream failed and who left) and one field per
//!   part, whose state is private to that part's file.
//!
//! The hub and the connections sit behind one mutex so that what the hub
//! emits is queued to each connection in the order the hub emitted it.
//! Critical sections are short (bookkeeping only: no I/O, no filling).

/// How long shutdown waits for the pipeline threads to stop.
const WORKER_JOIN_WAIT: Duration = Duration::from_secs(1);

mod autoscale;
mod batches;
mod cells;
mod conn;
mod decouple;
mod deliver;
mod error;
mod fill;
mod hold;
mod merge;
mod mirror;
mod outbox;
mod port;
mod regions;
mod replay;
mod rotate;
mod seats;
mod shape;
mod stats;
mod subscribe;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use batchcast::proto::{ConsumerStats, ErrorCode, GoodbyeReason, ServerMsg};
use batchcast::shm::{Arena, Fault, Mapping, RingView};

use crate::budget::{Budget, Grant, OverBudget, Use};
use crate::gpu::Gpus;
use crate::hub::{ConsumerId, Hub, HubConfig};
use crate::pipeline::collate::SlotWriter;
use crate::pipeline::shared::Shares;
use crate::plan::StreamPlan;
use crate::plan::kind::{SampleSource, WriterJob};

pub use conn::Peer;
use deliver::settle;
pub use error::ReplayError;
pub use error::{StreamFailed, SubscribeError};
pub use port::{Acquire, Port};
pub use subscribe::Subscription;

/// What the stream's lock guards: what every part needs (the hub, the
/// connections, what ended), and each part's own state, behind its private
/// fields in its own file.
#[derive(Debug)]
struct Inner {
    hub: Hub,
    conns: Conns,
    records: Records,
    /// Whoever fills the slots: pipeline threads or a producer.
    fill: fill::Filling,
    /// GPU copies: a device ring per GPU.
    mirrors: mirror::Mirrors,
    /// The hold clock: when units were begun and made, what is pinned.
    pace: hold::HoldClock,
    /// Replayed batches being made, and their CPU.
    replay: replay::Load,
    /// What the hub emitted and mailboxes released, on their way.
    deliver: deliver::Dispatch,
}

/// Why the stream failed, and the consumers that left.
#[derive(Debug, Default)]
struct Records {
    /// Why the source failed; the stream serves no one after that.
    failed: Option<StreamFailed>,
    /// Consumers that left, with their final numbers (most recent last).
    past: VecDeque<ConsumerStats>,
}

#[derive(Debug)]
pub struct Stream {
    /// Declared before the arena: device arenas and the page-locking of
    /// the host arena go first.
    gpus: Gpus,
    pub plan: StreamPlan,
    pub arena: Arena,
    /// The arena's rings, mirrored and writable, once per region: where
    /// the pipeline writes each batch's fields (the GPU copier reads
    /// `arena`'s plain mapping, which is page-locked).
    rings: regions::RegionMaps,
    /// What fills the slots (`None`: an external producer does).
    writer: Option<SlotWriter>,
    inner: Mutex<Inner>,
    /// Wakes pipeline workers when work may have become available.
    work_cv: Condvar,
    /// Wakes the parked ones when more are to work, or the stream stops
    /// (`autoscale`).
    park_cv: Condvar,
    stop: AtomicBool,
    workers: Mutex<Vec<JoinHandle<()>>>,
    /// Wakes an external producer's connection task, as `work_cv` wakes
    /// pipeline threads (a stored permit: no wake-up is lost).
    ready: tokio::sync::Notify,
    /// The broker's memory budget: mailboxes and GPU arenas are taken from
    /// it as consumers come.
    budget: Arc<Budget>,
    /// Who the stream belongs to: the broker's uid for a configured
    /// stream, its producer's for a registered one.
    pub owner_uid: u32,
    /// The arena's bytes in the budget, given back after the arena goes.
    _arena_grant: Grant,
}

/// Why a stream could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    OverBudget(#[from] OverBudget),
    #[error("cannot create the arena: {0}")]
    Arena(#[from] batchcast::Error),
}

impl Inner {
    /// A stream's state before anything happened: its hub, no consumers.
    fn new(plan: &StreamPlan, workers: u32, regions: u32, budget: &Arc<Budget>) -> Inner {
        let hub = Hub::new(HubConfig {
            slots: plan.slots,
            batches_per_epoch: plan.schema.batches_per_epoch,
            epochs: plan.epochs,
            lag_limit: plan.lag_limit,
            min_consumers: plan.min_consumers,
        });
        Inner {
            hub,
            conns: HashMap::default(),
            records: Records::default(),
            fill: fill::Filling::new(
                workers,
                regions::Regions::new(regions),
                match plan.workers_auto {
                    true => autoscale::Autoscale::automatic(workers, budget.threads()),
                    false => autoscale::Autoscale::fixed(workers),
                },
            ),
            mirrors: mirror::Mirrors::default(),
            pace: hold::HoldClock::default(),
            replay: replay::Load::default(),
            deliver: deliver::Dispatch::default(),
        }
    }
}

impl Stream {
    /// Creates the arena and starts the pipeline threads, which wait for
    /// consumers. The arena is sealed against every writer but this process
    /// at once, except for an external stream: its producer maps it writable
    /// first, and the server seals it (`Port::seal`) before any consumer
    /// can see it.
    ///
    /// The arena's bytes are taken from `budget` for `owner_uid` first; a
    /// stream that does not fit is refused before anything is allocated.
    /// A stream on a shared source takes the source from `shares` (the
    /// first of its streams to start makes it).
    pub fn start(
        plan: StreamPlan,
        budget: &Arc<Budget>,
        owner_uid: u32,
        shares: &mut Shares,
    ) -> Result<Arc<Stream>, StartError> {
        let grant = budget.take(
            owner_uid,
            Use::Arena,
            plan.arena_bytes(),
            &format!("stream `{}`", plan.name),
        )?;
        let writer = plan.source.writer(WriterJob {
            budget,
            uid: owner_uid,
            whom: &format!("stream `{}`", plan.name),
            shares,
            transform: None,
            epochs: plan.epochs,
        })?;
        if let Some(p) = plan.source.images() {
            say_decoded_cost(&plan.name, p);
        }
        // The ring may move between regions only where the broker writes.
        let count = match plan.source.broker_writes() {
            true => regions::REGIONS,
            false => 1,
        };
        let arena = Arena::create_regions(&plan.name, plan.arena_bytes(), count, Fault::Lazily)?;
        let fault = ring_fault(&*plan.source);
        let rings = (0..count)
            .map(|r| {
                let fault = if r == 0 { fault } else { Fault::Lazily };
                Mapping::rings_faulted(
                    arena.fd(),
                    &RingView::of_region(&plan.rings, r),
                    true,
                    fault,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        if plan.source.broker_writes() {
            arena.seal_writes()?;
        }
        let workers = u32::try_from(plan.workers).unwrap_or(u32::MAX);
        let stream = Arc::new(Stream {
            gpus: Gpus::default(),
            inner: Mutex::new(Inner::new(&plan, workers, count, budget)),
            plan,
            arena,
            rings,
            writer,
            work_cv: Condvar::new(),
            park_cv: Condvar::new(),
            stop: AtomicBool::new(false),
            workers: Mutex::new(Vec::new()),
            ready: tokio::sync::Notify::new(),
            budget: budget.clone(),
            owner_uid,
            _arena_grant: grant,
        });
        fill::spawn_workers(&stream).map_err(batchcast::Error::Io)?;
        tracing::info!(
            stream = %stream.plan.name,
            slots = stream.plan.slots,
            slot_mib = stream.plan.layout.slot_bytes as f64 / (1 << 20) as f64,
            workers = stream.plan.workers,
            "stream ready"
        );
        Ok(stream)
    }

    pub fn name(&self) -> &str {
        &self.plan.name
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock would be a bug in bookkeeping; the
        // state is still the last consistent one, so keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs a hub operation, then takes mailbox releases, queues what the
    /// hub emitted and wakes a producer that waits and now may go on.
    fn with_hub<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut inner = self.lock();
        let r = f(&mut inner);
        settle(&mut inner, false);
        fill::tell_source(self, &mut inner);
        let can_start = inner.hub.view().can_start();
        // Waiters count themselves under this lock before they wait.
        if (can_start || replay::has_work(&inner)) && inner.fill.anyone_idle() {
            self.work_cv.notify_all();
        }
        if can_start && inner.fill.producer_waiting() {
            self.ready.notify_one();
        }
        r
    }

    /// Stops the stream because its source failed, telling every consumer.
    pub fn fail(&self, why: StreamFailed) {
        tracing::error!(stream = %self.name(), "stream stopped: {why}");
        self.stop.store(true, Ordering::SeqCst);
        let mut inner = self.lock();
        inner.records.failed.get_or_insert_with(|| why.clone());
        for c in inner.conns.values() {
            c.out.end(
                ErrorCode::SourceFailed,
                format!("stream `{}` stopped: {why}", self.name()),
                GoodbyeReason::Shutdown,
            );
        }
        fill::tell_source(self, &mut inner);
        drop(inner);
        self.work_cv.notify_all();
        self.park_cv.notify_all();
    }

    /// Stops the stream: its pipeline threads end, its consumers are told
    /// goodbye, and its device arenas are freed once their consumers went
    /// (2 s at most: one that stays reads freed memory, and is named in
    /// the log).
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(w) = &self.writer {
            w.close();
        }
        {
            let mut inner = self.lock();
            for c in inner.conns.values() {
                c.out.send(ServerMsg::Goodbye(GoodbyeReason::Shutdown));
            }
            fill::tell_source(self, &mut inner);
        }
        self.work_cv.notify_all();
        self.park_cv.notify_all();
        fill::join_workers(self, WORKER_JOIN_WAIT);
        mirror::free_device_arenas(self);
    }
}

/// The stream's consumers by id.
type Conns = HashMap<ConsumerId, conn::Conn, std::hash::BuildHasherDefault<IdHasher>>;

/// Consumer ids are the hub's own counter, not chosen by peers: looking a
/// connection up needs no keyed hash (it is done per consumer per batch).
#[derive(Debug, Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// When a stream's rings are faulted into the broker. The memory is
/// allocated at once either way (committed). The pipeline writes every
/// page of its rings: those are faulted in now. A producer's arena is
/// written by the producer, and a registration comes while the broker
/// serves others: nothing is faulted in (populating holds the process's
/// memory map lock, and stalled every other connection while it ran).
fn ring_fault(source: &dyn SampleSource) -> Fault {
    match source.broker_writes() {
        true => Fault::Now,
        false => Fault::Lazily,
    }
}

/// Says once, at start, what keeping a stream's decoded images costs
/// where its config sized the cache (`decoded_cache_mib`; the broker says
/// what it chose itself, `pipeline::autosize`), and how `decoded_side`
/// makes it less.
fn say_decoded_cost(name: &str, p: &crate::plan::ImagePlan) {
    let crate::pipeline::CacheSize::Bytes(bytes @ 1..) = p.rules.decoded_cache else {
        return;
    };
    let scale = match p.rules.decoded_side {
        Some(side) => format!(
            "JPEGs at the largest reduction that keeps their longer side at least {side} px, others at full size"
        ),
        None => "the scale each crop decodes at, the bytes as without the cache: set decoded_side (the crop's side, say 256) to keep each photo once at 1/2 to 1/8 of its size, for less memory and other bytes".into(),
    };
    tracing::info!(
        stream = %name,
        "keeping decoded images in up to {} MiB (decoded_cache_mib) for its {} images, each width x height x 3 bytes at its kept scale ({scale}): often 10-20x its file; an image is decoded whole where it is kept",
        bytes >> 20,
        p.dataset.len()
    );
}
