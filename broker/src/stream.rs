//! One stream at run time: its arena, its hub, the pipeline threads that
//! fill slots, and the outboxes of its consumers' connections.
//!
//! The hub and the outboxes sit behind one mutex so that what the hub emits
//! is queued to each connection in the order the hub emitted it. Critical
//! sections are short (bookkeeping only: no I/O, no filling).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use batchcast::JoinPolicy;
use batchcast::proto::{
    self, BatchReady, ConsumerStats, EpochEnd, ErrorCode, ErrorMsg, GoodbyeReason, ServerMsg,
    StreamStats,
};
use batchcast::shm::Arena;
use batchcast::synthetic::SyntheticSpec;
use tokio::sync::mpsc;

use crate::config::StreamPlan;
use crate::hub::{ConsumerId, Hub, HubConfig, HubError, Outbound, Work};

/// A connected consumer, as the stream sees it.
#[derive(Debug)]
struct Conn {
    /// Messages for the connection's task, bounded: the hub never emits more
    /// than a window of batches plus a few control messages ahead of releases.
    tx: mpsc::Sender<ServerMsg>,
    name: String,
    pid: u32,
    uid: u32,
    /// When each unreleased batch was handed to the connection (ns).
    sent_ns: HashMap<u64, u64>,
    hold_ns: u64,
    wait_ns: u64,
}

#[derive(Debug)]
struct Inner {
    hub: Hub,
    conns: HashMap<ConsumerId, Conn>,
    producer_blocked: Duration,
}

/// Who is connecting, for stats.
#[derive(Debug, Clone)]
pub struct Peer {
    pub name: String,
    pub pid: u32,
    pub uid: u32,
}

#[derive(Debug)]
pub struct Stream {
    pub plan: StreamPlan,
    pub arena: Arena,
    inner: Mutex<Inner>,
    /// Wakes pipeline workers when work may have become available.
    work_cv: Condvar,
    stop: AtomicBool,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

/// What a consumer gets on subscribing.
#[derive(Debug)]
pub struct Subscription {
    pub id: ConsumerId,
    pub start_epoch: u64,
    pub rx: mpsc::Receiver<ServerMsg>,
}

impl Stream {
    /// Creates the arena (sealed against every writer but this process) and
    /// starts the pipeline threads, which wait for consumers.
    pub fn start(plan: StreamPlan) -> Result<Arc<Stream>, batchcast::Error> {
        let arena = Arena::create(&plan.cfg.name, plan.arena_bytes())?;
        arena.seal_writes()?;
        let hub = Hub::new(HubConfig {
            slots: plan.cfg.slots,
            batches_per_epoch: plan.schema.batches_per_epoch,
            epochs: plan.cfg.epochs,
            lag_limit: plan.cfg.lag_limit,
            min_consumers: plan.cfg.min_consumers,
        });
        let stream = Arc::new(Stream {
            plan,
            arena,
            inner: Mutex::new(Inner {
                hub,
                conns: HashMap::new(),
                producer_blocked: Duration::ZERO,
            }),
            work_cv: Condvar::new(),
            stop: AtomicBool::new(false),
            workers: Mutex::new(Vec::new()),
        });
        let mut workers = stream.workers.lock().unwrap_or_else(|p| p.into_inner());
        for i in 0..stream.plan.workers {
            let s = stream.clone();
            let handle = std::thread::Builder::new()
                .name(format!("{}-worker-{i}", stream.plan.cfg.name))
                .spawn(move || s.worker())
                .map_err(batchcast::Error::Io)?;
            workers.push(handle);
        }
        drop(workers);
        tracing::info!(
            stream = %stream.plan.cfg.name,
            slots = stream.plan.cfg.slots,
            slot_mib = stream.plan.layout.slot_bytes as f64 / (1 << 20) as f64,
            workers = stream.plan.workers,
            "stream ready"
        );
        Ok(stream)
    }

    pub fn name(&self) -> &str {
        &self.plan.cfg.name
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock would be a bug in bookkeeping; the
        // state is still the last consistent one, so keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs a hub operation, then queues what it emitted and wakes workers.
    fn with_hub<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut inner = self.lock();
        let r = f(&mut inner);
        dispatch(&mut inner);
        if inner.hub.can_start() {
            self.work_cv.notify_all();
        }
        r
    }

    pub fn subscribe(
        &self,
        window: u32,
        join: JoinPolicy,
        peer: Peer,
    ) -> Result<Subscription, HubError> {
        // Room for a full window of batches, one end-of-epoch marker per
        // batch, and the final messages.
        let (tx, rx) = mpsc::channel(2 * window as usize + 4);
        self.with_hub(|inner| {
            let (id, start_epoch) = inner.hub.join(window, join)?;
            tracing::info!(stream = %self.name(), consumer = id, name = %peer.name, pid = peer.pid, start_epoch, "consumer subscribed");
            inner.conns.insert(
                id,
                Conn { tx, name: peer.name, pid: peer.pid, uid: peer.uid, sent_ns: HashMap::new(), hold_ns: 0, wait_ns: 0 },
            );
            Ok(Subscription { id, start_epoch, rx })
        })
    }

    pub fn release(&self, id: ConsumerId, seq: u64, wait_ns: u64) -> Result<(), HubError> {
        let now = proto::monotonic_ns();
        self.with_hub(|inner| {
            inner.hub.release(id, seq)?;
            if let Some(c) = inner.conns.get_mut(&id) {
                c.wait_ns = c.wait_ns.saturating_add(wait_ns);
                if let Some(sent) = c.sent_ns.remove(&seq) {
                    c.hold_ns += now.saturating_sub(sent);
                }
            }
            Ok(())
        })
    }

    pub fn goodbye(&self, id: ConsumerId) {
        self.with_hub(|inner| {
            let _ = inner.hub.goodbye(id);
        });
    }

    /// The connection is gone; idempotent.
    pub fn leave(&self, id: ConsumerId) {
        self.with_hub(|inner| {
            if inner.hub.leave(id) {
                tracing::info!(stream = %self.name(), consumer = id, "consumer left; its slots are released");
            }
            inner.conns.remove(&id);
        });
    }

    /// Tells every consumer the broker is going away and stops the pipeline.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::SeqCst);
        {
            let inner = self.lock();
            for c in inner.conns.values() {
                let _ = c.tx.try_send(ServerMsg::Goodbye(GoodbyeReason::Shutdown));
            }
        }
        self.work_cv.notify_all();
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in workers {
            let _ = w.join();
        }
    }

    pub fn stats(&self) -> StreamStats {
        let inner = self.lock();
        let c = inner.hub.counts();
        let mut consumers: Vec<ConsumerStats> = inner
            .conns
            .iter()
            .filter_map(|(&id, conn)| {
                let n = inner.hub.consumer_counts(id)?;
                Some(ConsumerStats {
                    id,
                    name: conn.name.clone(),
                    pid: conn.pid,
                    uid: conn.uid,
                    window: n.window,
                    delivered: n.delivered,
                    held: n.held,
                    queued: n.queued,
                    epoch: n.epoch,
                    wait_s: conn.wait_ns as f64 * 1e-9,
                    hold_s: conn.hold_ns as f64 * 1e-9,
                })
            })
            .collect();
        consumers.sort_by_key(|c| c.id);
        StreamStats {
            name: self.name().to_string(),
            slots: self.plan.cfg.slots,
            slot_bytes: self.plan.layout.slot_bytes,
            free_slots: c.free,
            filling: c.filling,
            in_use: c.in_use,
            batches_produced: c.produced,
            epoch: c.epoch,
            finished: c.finished,
            deliveries: c.deliveries,
            departed: c.departed,
            detached: c.detached,
            producer_blocked_s: inner.producer_blocked.as_secs_f64(),
            consumers,
        }
    }

    /// A pipeline thread: take work from the hub, fill the slot, publish.
    fn worker(&self) {
        let mut cache = OrderCache::new(self.plan.spec);
        loop {
            let work = {
                let mut inner = self.lock();
                let mut blocked_since: Option<Instant> = None;
                let work = loop {
                    if self.stop.load(Ordering::SeqCst) {
                        return;
                    }
                    if let Some(w) = inner.hub.start_batch() {
                        break w;
                    }
                    // Waiting on slots while consumers exist is back-pressure;
                    // waiting for consumers or after the last epoch is idling.
                    let busy = !inner.hub.has_free_slot();
                    if busy && blocked_since.is_none() {
                        blocked_since = Some(Instant::now());
                    }
                    inner = self
                        .work_cv
                        .wait_timeout(inner, Duration::from_millis(200))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                };
                if let Some(t) = blocked_since {
                    inner.producer_blocked += t.elapsed();
                }
                work
            };
            let samples = self.fill(&work, &mut cache);
            self.with_hub(|inner| inner.hub.finish_batch(work.seq, samples));
        }
    }

    /// Writes every sample of `work` straight into its place in the slot.
    fn fill(&self, work: &Work, cache: &mut OrderCache) -> u64 {
        let schema = &self.plan.schema;
        let layout = &self.plan.layout;
        let first = work.index * schema.batch_size;
        let samples = schema.batch_size.min(self.plan.spec.len - first);
        let order = cache.get(work.epoch);
        // SAFETY: the hub handed this slot to this worker in its `Filling`
        // state: no consumer holds it and no other worker was given it, so
        // this is the only reference to these bytes until `finish_batch`.
        let slot = unsafe {
            self.arena
                .mapping()
                .slice_mut(work.slot as u64 * layout.slot_bytes, layout.slot_bytes)
        };
        for (f, fl) in layout.fields.iter().enumerate() {
            let bps = fl.bytes_per_sample as usize;
            let base = fl.offset as usize;
            for j in 0..samples as usize {
                let index = order[(first as usize) + j];
                self.plan.spec.fill_sample(
                    f,
                    index,
                    &mut slot[base + j * bps..base + (j + 1) * bps],
                );
            }
        }
        samples
    }
}

/// The sample order of the last two epochs, computed once per epoch.
struct OrderCache {
    spec: SyntheticSpec,
    entries: Vec<(u64, Arc<Vec<u64>>)>,
}

impl OrderCache {
    fn new(spec: SyntheticSpec) -> Self {
        OrderCache {
            spec,
            entries: Vec::new(),
        }
    }
    fn get(&mut self, epoch: u64) -> Arc<Vec<u64>> {
        if let Some((_, o)) = self.entries.iter().find(|(e, _)| *e == epoch) {
            return o.clone();
        }
        let o = Arc::new(self.spec.epoch_order(epoch));
        if self.entries.len() == 2 {
            self.entries.remove(0);
        }
        self.entries.push((epoch, o.clone()));
        o
    }
}

/// Turns what the hub emitted into messages on each connection's outbox.
fn dispatch(inner: &mut Inner) {
    let now = proto::monotonic_ns();
    for (id, out) in inner.hub.take_outbound() {
        let Some(conn) = inner.conns.get_mut(&id) else {
            continue;
        };
        let send = |msg: ServerMsg| {
            // Full cannot happen (the outbox holds a window and then some);
            // Closed means the connection is going away and will leave.
            if let Err(e) = conn.tx.try_send(msg) {
                tracing::debug!(consumer = id, "outbox: {e}");
            }
        };
        match out {
            Outbound::Batch {
                seq,
                epoch,
                index,
                slot,
                samples,
            } => {
                send(ServerMsg::Batch(BatchReady {
                    seq,
                    epoch,
                    index,
                    slot,
                    samples,
                    sent_ns: now,
                }));
                conn.sent_ns.insert(seq, now);
            }
            Outbound::EndOfEpoch {
                epoch,
                batches,
                complete,
            } => {
                send(ServerMsg::EndOfEpoch(EpochEnd {
                    epoch,
                    batches,
                    complete,
                }));
            }
            Outbound::EndOfStream => send(ServerMsg::EndOfStream),
            Outbound::Detached { reason } => {
                tracing::warn!(consumer = id, name = %conn.name, "{reason}");
                send(ServerMsg::Error(ErrorMsg {
                    code: ErrorCode::LagLimit,
                    message: reason,
                }));
                send(ServerMsg::Goodbye(GoodbyeReason::Detached));
            }
        }
    }
}
