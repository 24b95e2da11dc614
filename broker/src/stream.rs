//! One stream at run time: its arena, its hub, the pipeline threads that
//! fill slots, and the outboxes of its consumers' connections.
//!
//! The hub and the outboxes sit behind one mutex so that what the hub emits
//! is queued to each connection in the order the hub emitted it. Critical
//! sections are short (bookkeeping only: no I/O, no filling).

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use batchcast::JoinPolicy;
use batchcast::mailbox::{Bell, BrokerMailbox, Notice, Totals};
use batchcast::proto::{
    self, BatchReady, ConsumerStats, EpochEnd, ErrorCode, ErrorMsg, GoodbyeReason, MailboxSpec,
    ServerMsg, SourceStats, StreamStats,
};
use batchcast::shm::Arena;
use tokio::sync::mpsc;

use crate::config::{Source, StreamPlan};
use crate::gpu::{CopyRequest, CopySink, GpuKey, Gpus, Mirror};
use crate::hub::{ConsumerId, Delivery, GroupId, Hub, HubConfig, HubError, Outbound, Work};
use crate::pipeline::{self, ImagePipeline};

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
    busy_ns: u64,
    /// Samples in the batches sent to it.
    samples: u64,
    joined: Instant,
    /// Why it is about to leave, once known (the stream ended for it, it
    /// was detached, it said goodbye); otherwise it disconnected.
    ending: Option<String>,
    /// Device consumers: their GPU.
    gpu: Option<GpuKey>,
    /// Host consumers that asked for one: where their batches are noticed
    /// and their releases written (see [`batchcast::mailbox`]).
    mailbox: Option<BrokerMailbox>,
    /// Its mailbox got notices in this dispatch: ring the bell.
    ring: bool,
    /// What it says of the batches it released through its mailbox (it
    /// times them itself: the broker takes those releases only now and
    /// then).
    mailbox_totals: Totals,
}

/// One GPU's copies of this stream, as the stream tracks them.
#[derive(Debug)]
struct MirrorState {
    mirror: Arc<Mirror>,
    /// Its ring of device slots in the hub.
    group: GroupId,
    copies: u64,
    bytes: u64,
    copy_ns: u64,
    failed: Option<String>,
}

#[derive(Debug)]
struct Inner {
    hub: Hub,
    conns: HashMap<ConsumerId, Conn, BuildHasherDefault<IdHasher>>,
    producer_blocked: Duration,
    pipeline_cpu: Duration,
    /// Why the source failed; the stream serves no one after that.
    failed: Option<String>,
    mirrors: HashMap<GpuKey, MirrorState>,
    /// The GPU of each hub group.
    groups: Vec<GpuKey>,
    /// Consumers that left, with their final numbers (most recent last).
    past: VecDeque<ConsumerStats>,
    /// Pipeline workers waiting on `work_cv` (to be notified), and those of
    /// them done polling mailboxes: while one is, or an external producer
    /// was told to wait, mailbox consumers are asked to ring a doorbell when
    /// they release (nobody would look at their mailbox soon otherwise).
    idle_workers: u32,
    armed_workers: u32,
    producer_waiting: bool,
    /// Wall time the pipeline took for its last batch (`u64::MAX` until one
    /// is made): whether it is quick (see `QUICK_FILL_NS`).
    fill_ns: u64,
    /// Pipeline threads (0 for an external producer).
    workers: u32,
    /// A doorbell rang: take every mailbox's releases at the next settle.
    drain_all: bool,
    /// Releases drained from mailboxes, reused between drains.
    drained: Vec<(ConsumerId, u64)>,
    /// What the hub emitted, reused between dispatches.
    outbound: Vec<(ConsumerId, Outbound)>,
}

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

/// Who is connecting, for stats.
#[derive(Debug, Clone)]
pub struct Peer {
    pub name: String,
    pub pid: u32,
    pub uid: u32,
}

#[derive(Debug)]
pub struct Stream {
    /// Declared before the arena: device arenas and the page-locking of
    /// the host arena go first.
    gpus: Gpus,
    pub plan: StreamPlan,
    pub arena: Arena,
    inner: Mutex<Inner>,
    /// Wakes pipeline workers when work may have become available.
    work_cv: Condvar,
    stop: AtomicBool,
    workers: Mutex<Vec<JoinHandle<()>>>,
    /// Wakes an external producer's connection task, as `work_cv` wakes
    /// pipeline threads (a stored permit: no wake-up is lost).
    ready: tokio::sync::Notify,
}

/// What an external producer's slot request finds.
#[derive(Debug)]
pub enum Acquire {
    Slot(Work),
    /// Every epoch has been handed out.
    Ended,
    /// Nothing now (no free slot, or too few consumers): wait for
    /// [`Stream::ready`].
    Wait,
}

#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error(transparent)]
    Hub(#[from] HubError),
    #[error("the stream stopped: {0}")]
    Failed(String),
    #[error("{0}")]
    Device(String),
    #[error("cannot make its mailbox: {0}")]
    Mailbox(batchcast::Error),
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
    pub rx: mpsc::Receiver<ServerMsg>,
    /// Device consumers: the arena to open.
    pub device: Option<proto::DeviceArena>,
    pub mailbox: Option<MailboxGrant>,
}

impl Stream {
    /// Creates the arena and starts the pipeline threads, which wait for
    /// consumers. The arena is sealed against every writer but this process
    /// at once, except for an external stream: its producer maps it writable
    /// first, and the server seals it ([`Stream::seal`]) before any consumer
    /// can see it.
    pub fn start(plan: StreamPlan) -> Result<Arc<Stream>, batchcast::Error> {
        let arena = Arena::create(&plan.cfg.name, plan.arena_bytes())?;
        if !matches!(plan.source, Source::External) {
            arena.seal_writes()?;
        }
        let hub = Hub::new(HubConfig {
            slots: plan.cfg.slots,
            batches_per_epoch: plan.schema.batches_per_epoch,
            epochs: plan.cfg.epochs,
            lag_limit: plan.cfg.lag_limit,
            min_consumers: plan.cfg.min_consumers,
        });
        let workers = u32::try_from(plan.workers).unwrap_or(u32::MAX);
        let stream = Arc::new(Stream {
            gpus: Gpus::default(),
            plan,
            arena,
            inner: Mutex::new(Inner {
                hub,
                conns: HashMap::default(),
                producer_blocked: Duration::ZERO,
                pipeline_cpu: Duration::ZERO,
                failed: None,
                mirrors: HashMap::new(),
                groups: Vec::new(),
                past: VecDeque::new(),
                idle_workers: 0,
                armed_workers: 0,
                producer_waiting: false,
                fill_ns: u64::MAX,
                workers,
                drain_all: false,
                drained: Vec::new(),
                outbound: Vec::new(),
            }),
            work_cv: Condvar::new(),
            stop: AtomicBool::new(false),
            workers: Mutex::new(Vec::new()),
            ready: tokio::sync::Notify::new(),
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

    /// Runs a hub operation, then takes mailbox releases, queues what the
    /// hub emitted and wakes a producer that waits and now may go on.
    fn with_hub<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut inner = self.lock();
        let r = f(&mut inner);
        settle(&mut inner, false);
        if inner.hub.can_start() {
            // Waiters count themselves under this lock before they wait.
            if inner.idle_workers > 0 {
                self.work_cv.notify_all();
            }
            if inner.producer_waiting {
                self.ready.notify_one();
            }
        }
        r
    }

    /// A mailbox consumer rang: it released while a producer waited.
    pub fn doorbell(&self) {
        self.with_hub(|inner| inner.drain_all = true);
    }

    /// See [`Hub::set_min_consumers`]; whether the stream was still
    /// waiting to start.
    pub fn set_min_consumers(&self, min: u32) -> bool {
        self.with_hub(|inner| {
            let waiting = inner.hub.counts().produced == 0;
            inner.hub.set_min_consumers(min);
            waiting
        })
    }

    /// Forbids any new writable mapping of the arena (see [`Stream::start`]).
    pub fn seal(&self) -> Result<(), batchcast::Error> {
        self.arena.seal_writes()
    }

    /// Resolves when an external producer's request may succeed now.
    pub async fn ready(&self) {
        self.ready.notified().await
    }

    /// An external producer asks for its next slot.
    pub fn acquire(&self) -> Result<Acquire, String> {
        self.with_hub(|inner| {
            if let Some(why) = &inner.failed {
                return Err(why.clone());
            }
            inner.producer_waiting = false;
            if inner.hub.exhausted() {
                return Ok(Acquire::Ended);
            }
            Ok(match inner.hub.start_batch() {
                Some(w) => Acquire::Slot(w),
                None => {
                    // Mailbox consumers may have released already, and ring
                    // only for releases after this: take what is there.
                    inner.producer_waiting = true;
                    inner.drain_all = true;
                    Acquire::Wait
                }
            })
        })
    }

    /// Whether no slot is free (the producer is under back-pressure).
    pub fn slots_full(&self) -> bool {
        !self.lock().hub.has_free_slot()
    }

    /// An external producer filled `work`'s slot with `samples` samples.
    pub fn publish(&self, work: &Work, samples: u64, blocked: Duration) {
        self.with_hub(|inner| {
            inner.producer_blocked += blocked;
            inner.hub.finish_batch(work.seq, samples);
        });
    }

    /// An external producer said goodbye with nothing left unpublished.
    /// An endless stream ends normally at an epoch boundary; anything else
    /// ends early, and consumers are told.
    pub fn producer_done(&self, who: &str) {
        let early = self.with_hub(|inner| {
            if inner.hub.exhausted() || inner.failed.is_some() {
                return None;
            }
            if self.plan.cfg.epochs.is_none() && inner.hub.end_at_epoch_boundary() {
                return None;
            }
            let c = inner.hub.counts();
            Some(format!(
                "the producer {who} stopped after {} batches, in epoch {}{}",
                c.produced,
                c.epoch,
                match self.plan.cfg.epochs {
                    Some(e) => format!(" of {e}"),
                    None => " (mid-epoch)".into(),
                }
            ))
        });
        if let Some(why) = early {
            self.fail(why);
        }
    }

    pub fn subscribe(
        self: &Arc<Self>,
        window: u32,
        join: JoinPolicy,
        peer: Peer,
        device: Option<&proto::DeviceRequest>,
        mailbox: bool,
    ) -> Result<Subscription, SubscribeError> {
        // Room for a full window of batches, one end-of-epoch marker per
        // batch, and the final messages.
        let (tx, rx) = mpsc::channel(2 * window as usize + 4);
        let gpu_slots = self.plan.gpu_slots();
        // Refusals that need no GPU come before a device arena is allocated.
        {
            let inner = self.lock();
            if let Some(why) = &inner.failed {
                return Err(SubscribeError::Failed(why.clone()));
            }
            inner.hub.check_window(window, device.map(|_| gpu_slots))?;
            if let Some(why) = device
                .and_then(|req| inner.mirrors.get(&req.uuid))
                .and_then(|m| m.failed.as_ref())
            {
                return Err(SubscribeError::Device(why.clone()));
            }
        }
        let mailbox = match mailbox && device.is_none() {
            false => None,
            true => Some(
                BrokerMailbox::create(MailboxSpec::for_batches(self.plan.cfg.slots))
                    .map_err(SubscribeError::Mailbox)?,
            ),
        };
        let grant = match &mailbox {
            None => None,
            Some(m) => Some(MailboxGrant {
                spec: m.spec(),
                fd: m
                    .fd()
                    .try_clone_to_owned()
                    .map_err(|e| SubscribeError::Mailbox(e.into()))?,
                bell: m.bell(),
            }),
        };
        // Allocating a device arena takes a while: not under the hub's lock.
        let mirror = match device {
            None => None,
            Some(req) => {
                let sink: std::sync::Weak<dyn CopySink> = Arc::downgrade(self) as _;
                let host = (self.arena.mapping().as_ptr(), self.arena.mapping().len());
                let slots = (gpu_slots, self.plan.layout.slot_bytes);
                Some(
                    self.gpus
                        .mirror(req, sink, host, slots, self.name())
                        .map_err(SubscribeError::Device)?,
                )
            }
        };
        // A mailbox consumer is sent every batch at once and keeps to its
        // window itself: it never waits for the broker to take a release.
        let delivery = match mailbox {
            Some(_) => Delivery::Ahead,
            None => Delivery::Window,
        };
        self.with_hub(|inner| {
            if let Some(why) = &inner.failed {
                return Err(SubscribeError::Failed(why.clone()));
            }
            let group = match (&mirror, device) {
                (Some(m), Some(req)) => {
                    let state = match inner.mirrors.get(&req.uuid) {
                        Some(state) => state,
                        None => {
                            let group = inner.hub.add_group(gpu_slots);
                            inner.groups.push(req.uuid);
                            debug_assert_eq!(inner.groups.len(), group as usize + 1);
                            inner.mirrors.entry(req.uuid).or_insert(MirrorState {
                                mirror: m.clone(),
                                group,
                                copies: 0,
                                bytes: 0,
                                copy_ns: 0,
                                failed: None,
                            })
                        }
                    };
                    if let Some(why) = &state.failed {
                        return Err(SubscribeError::Device(why.clone()));
                    }
                    Some(state.group)
                }
                _ => None,
            };
            let (id, start_epoch) = inner.hub.join_group(window, join, group, delivery)?;
            tracing::info!(stream = %self.name(), consumer = id, name = %peer.name, pid = peer.pid, start_epoch, device = mirror.as_ref().map(|m| m.label()), "consumer subscribed");
            inner.conns.insert(
                id,
                Conn {
                    tx,
                    name: peer.name,
                    pid: peer.pid,
                    uid: peer.uid,
                    sent_ns: HashMap::new(),
                    hold_ns: 0,
                    wait_ns: 0,
                    busy_ns: 0,
                    samples: 0,
                    joined: Instant::now(),
                    ending: None,
                    gpu: device.map(|req| req.uuid),
                    mailbox,
                    ring: false,
                    mailbox_totals: Totals::default(),
                },
            );
            Ok(Subscription {
                id,
                start_epoch,
                rx,
                device: mirror.as_ref().map(|m| m.arena()),
                mailbox: grant,
            })
        })
    }

    pub fn release(&self, id: ConsumerId, r: proto::Release) -> Result<(), HubError> {
        let now = proto::monotonic_ns();
        self.with_hub(|inner| release(inner, id, r, now))
    }

    pub fn goodbye(&self, id: ConsumerId) {
        self.with_hub(|inner| {
            // A mailbox consumer gives back the notices it will never read
            // before it says goodbye: take them now.
            inner.drain_all = true;
            let _ = inner.hub.goodbye(id);
            if let Some(c) = inner.conns.get_mut(&id) {
                c.ending.get_or_insert_with(|| "said goodbye".into());
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
                last.left = Some(conn.ending.unwrap_or_else(|| "disconnected".into()));
                if inner.past.len() == proto::PAST_CONSUMERS {
                    inner.past.pop_front();
                }
                inner.past.push_back(last);
            }
        });
    }

    /// Tells every consumer the broker is going away and stops the pipeline.
    /// Device arenas are freed only after their consumers have been told and
    /// have gone (or 2 s have passed: a consumer that ignores the goodbye
    /// reads freed memory, and is named in the log).
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
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let on_gpu: Vec<String> = {
                let inner = self.lock();
                inner
                    .conns
                    .values()
                    .filter(|c| c.gpu.is_some())
                    .map(|c| format!("{} (pid {})", c.name, c.pid))
                    .collect()
            };
            if on_gpu.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                tracing::warn!(stream = %self.name(), "freeing device arenas still opened by {}", on_gpu.join(", "));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mirrors: Vec<MirrorState> = self.lock().mirrors.drain().map(|(_, m)| m).collect();
        self.gpus.stop();
        drop(mirrors);
    }

    pub fn stats(&self) -> StreamStats {
        // Releases sitting in mailboxes count as released.
        self.with_hub(|inner| inner.drain_all = true);
        let inner = self.lock();
        let c = inner.hub.counts();
        let mut consumers: Vec<ConsumerStats> = inner
            .conns
            .keys()
            .filter_map(|&id| consumer_stats(&inner, id))
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
            pipeline_cpu_s: inner.pipeline_cpu.as_secs_f64(),
            producer: match &self.plan.schema.source {
                batchcast::schema::SourceInfo::External(e) => Some(format!(
                    "{} (pid {}){}",
                    e.producer,
                    e.pid,
                    if e.description.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", e.description)
                    }
                )),
                _ => None,
            },
            failed: inner.failed.clone(),
            gpus: {
                let mut g: Vec<_> = inner
                    .mirrors
                    .values()
                    .map(|m| {
                        let n = inner.hub.group_counts(m.group).unwrap_or_default();
                        proto::GpuCopyStats {
                            gpu: m.mirror.label().to_string(),
                            copies: m.copies,
                            bytes: m.bytes,
                            copy_s: m.copy_ns as f64 * 1e-9,
                            pinned: m.mirror.pinned(),
                            slots: n.slots,
                            slots_in_use: n.in_use,
                            waiting: n.waiting,
                        }
                    })
                    .collect();
                g.sort_by(|a, b| a.gpu.cmp(&b.gpu));
                g
            },
            source: match &self.plan.source {
                Source::Synthetic(_) | Source::External => None,
                Source::Images { pipeline, .. } => {
                    let n = pipeline.counts();
                    let c = n.cache.unwrap_or_default();
                    Some(SourceStats {
                        decoded: n.decoded,
                        skipped: n.skipped,
                        reduced: n.reduced,
                        cache_hits: c.hits,
                        cache_misses: c.misses,
                        cache_bytes: c.bytes,
                        cache_items: c.items,
                        cache_budget: c.budget,
                    })
                }
            },
            consumers,
            past_consumers: inner.past.iter().cloned().collect(),
        }
    }

    /// A pipeline thread: take work from the hub, fill the slot, publish.
    fn worker(&self) {
        // Its naps between looks at mailboxes are tens of microseconds: do
        // not let the kernel stretch them by the default 50 µs of slack.
        if let Err(e) = nix::sys::prctl::set_timerslack(1_000) {
            tracing::debug!("timer slack: {e}");
        }
        let mut orders = OrderCache::default();
        let mut images = match &self.plan.source {
            Source::Images { .. } => match pipeline::Worker::new() {
                Ok(w) => Some(w),
                Err(e) => {
                    self.fail(format!("cannot start a decoder: {e}"));
                    return;
                }
            },
            Source::Synthetic(_) | Source::External => None,
        };
        let mut pace = Pace::default();
        let mut cpu = CpuClock::new();
        loop {
            let work = {
                let inner = self.lock();
                match self.wait_for_slot(inner, &mut pace, &mut cpu) {
                    Some(w) => w,
                    None => return,
                }
            };
            let t0 = Instant::now();
            let order = orders.get(work.epoch, |e| self.plan.epoch_order(e));
            let filled = self.fill(&work, &order, images.as_mut());
            let fill_ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let spent = cpu.spent(false);
            match filled {
                Ok(samples) => self.with_hub(|inner| {
                    inner.fill_ns = fill_ns;
                    inner.pipeline_cpu += spent;
                    inner.hub.finish_batch(work.seq, samples)
                }),
                Err(e) => {
                    // The slot stays in `Filling`: nobody ever sees a torn batch.
                    self.fail(e.to_string());
                    return;
                }
            }
        }
    }

    /// Waits until the hub gives this pipeline thread a slot to fill;
    /// `None` when the stream stops.
    ///
    /// Waiting on slots (back-pressure), a thread that serves only mailbox
    /// consumers looks at their releases after naps, and once batches are
    /// quick to make it waits for half the slots to be free before it goes
    /// on: it then fills them in one burst, so the cost of a wake-up is
    /// shared by many batches, and the slowest consumer still has the other
    /// half to read meanwhile. Naps are learned from the last wait (how
    /// long the consumers took to free that many). After `ARM_AFTER`
    /// without a free slot (consumers pause, or are slow), it asks them to
    /// ring a doorbell when they release and sleeps until one does. With a
    /// consumer on the socket, its releases wake the thread at once.
    fn wait_for_slot<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner>,
        pace: &mut Pace,
        cpu: &mut CpuClock,
    ) -> Option<Work> {
        // Since when it waits on slots (back-pressure, as opposed to waiting
        // for consumers or after the last epoch).
        let mut blocked_since: Option<Instant> = None;
        // End of the current nap (naps are cut short by notifications).
        let mut wake_at: Option<Instant> = None;
        // A doorbell or a socket release woke it: take any free slot.
        let mut take_any = false;
        let mut naps = 0u32;
        let work = loop {
            if self.stop.load(Ordering::SeqCst) {
                return None;
            }
            // Not waiting yet: any free slot will do (the path of every
            // batch in a burst, so it looks at nothing else).
            if blocked_since.is_none()
                && let Some(w) = inner.hub.start_batch()
            {
                break w;
            }
            let now = Instant::now();
            let waited = blocked_since.map_or(Duration::ZERO, |t| now - t);
            let mailboxes = inner.conns.values().filter(|c| c.mailbox.is_some()).count();
            let quick = inner.fill_ns / u64::from(inner.workers.max(1)) < QUICK_FILL_NS;
            // Slots to wait for once blocked.
            let target = match quick && mailboxes == inner.conns.len() {
                true => (self.plan.cfg.slots / 2).max(1),
                false => 1,
            };
            let free = inner.hub.free_slots();
            if (free >= target || (free > 0 && (take_any || waited >= MAX_GATHER)))
                && let Some(w) = inner.hub.start_batch()
            {
                if target > 1 {
                    pace.learn(waited, free);
                }
                tracing::trace!(
                    naps,
                    free,
                    waited_us = waited.as_micros() as u64,
                    "slot wait"
                );
                break w;
            }
            if !inner.hub.wants_batches() {
                // Idle: nothing to do until a hub change notifies it.
                inner.pipeline_cpu += cpu.spent(true);
                blocked_since = None;
                wake_at = None;
                inner = self.idle(inner, false, IDLE_WAIT);
                continue;
            }
            blocked_since.get_or_insert(now);
            let arm_after = if target > 1 { ARM_AFTER } else { ARM_AFTER_ONE };
            if mailboxes == 0 || (free == 0 && waited >= arm_after) {
                // Socket releases notify; mailbox consumers are asked to ring.
                inner.pipeline_cpu += cpu.spent(true);
                inner = self.idle(inner, mailboxes > 0, IDLE_WAIT);
                take_any = true;
                continue;
            }
            // Nap until the slots it waits for are likely free: learned for
            // the first nap, then from how many came in the time waited so
            // far; as long again when none came.
            let until = match wake_at {
                Some(w) if w > now => w,
                _ => {
                    let nap = match (wake_at, free) {
                        (None, _) => pace.first_nap(target),
                        (Some(_), 0) => waited,
                        (Some(_), f) => waited * (target - f) / f,
                    };
                    now + nap.clamp(MIN_NAP, MAX_NAP)
                }
            };
            wake_at = Some(until);
            naps += 1;
            inner = self.idle(inner, false, until - now);
            settle(&mut inner, true);
        };
        if let Some(t) = blocked_since {
            inner.producer_blocked += t.elapsed();
        }
        Some(work)
    }

    /// Waits on `work_cv` for up to `timeout`, counted as idle (hub changes
    /// that let the pipeline go on notify it); `armed`: asks mailbox
    /// consumers to ring when they release, first taking what they
    /// released already.
    fn idle<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner>,
        armed: bool,
        timeout: Duration,
    ) -> MutexGuard<'a, Inner> {
        inner.idle_workers += 1;
        if armed {
            inner.armed_workers += 1;
            settle(&mut inner, true);
        }
        if !(armed && inner.hub.can_start()) {
            inner = self
                .work_cv
                .wait_timeout(inner, timeout)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        inner.idle_workers -= 1;
        if armed {
            inner.armed_workers -= 1;
        }
        inner
    }

    /// Stops the stream because its source failed, telling every consumer.
    pub fn fail(&self, why: String) {
        tracing::error!(stream = %self.name(), "stream stopped: {why}");
        self.stop.store(true, Ordering::SeqCst);
        let mut inner = self.lock();
        if inner.failed.is_none() {
            inner.failed = Some(why.clone());
        }
        for c in inner.conns.values() {
            let _ = c.tx.try_send(ServerMsg::Error(ErrorMsg {
                code: ErrorCode::SourceFailed,
                message: format!("stream `{}` stopped: {why}", self.name()),
            }));
            let _ = c.tx.try_send(ServerMsg::Goodbye(GoodbyeReason::Shutdown));
        }
        drop(inner);
        self.work_cv.notify_all();
    }

    /// Writes every sample of `work` straight into its place in the slot.
    fn fill(
        &self,
        work: &Work,
        order: &[u64],
        images: Option<&mut pipeline::Worker>,
    ) -> Result<u64, pipeline::PipelineError> {
        let schema = &self.plan.schema;
        let layout = &self.plan.layout;
        let first = (work.index * schema.batch_size) as usize;
        let samples = (schema.batch_size as usize).min(order.len() - first);
        let indices = &order[first..first + samples];
        // SAFETY: the hub handed this slot to this worker in its `Filling`
        // state: no consumer holds it and no other worker was given it, so
        // this is the only reference to these bytes until `finish_batch`.
        let slot = unsafe {
            self.arena
                .mapping()
                .slice_mut(work.slot as u64 * layout.slot_bytes, layout.slot_bytes)
        };
        match (&self.plan.source, images) {
            (Source::Images { pipeline, .. }, Some(w)) => {
                fill_images(pipeline, w, work.epoch, indices, layout, slot)?;
            }
            (Source::Synthetic(spec), _) => {
                for (f, fl) in layout.fields.iter().enumerate() {
                    let bps = fl.bytes_per_sample as usize;
                    let base = fl.offset as usize;
                    for (j, &index) in indices.iter().enumerate() {
                        spec.fill_sample(f, index, &mut slot[base + j * bps..base + (j + 1) * bps]);
                    }
                }
            }
            (Source::Images { .. }, None) => unreachable!("image workers have a decoder"),
            (Source::External, _) => unreachable!("external streams have no workers"),
        }
        Ok(samples as u64)
    }
}

/// Fields of an image stream, in schema order: image, label, index.
fn fill_images(
    pipeline: &ImagePipeline,
    w: &mut pipeline::Worker,
    epoch: u64,
    indices: &[u64],
    layout: &batchcast::schema::SlotLayout,
    slot: &mut [u8],
) -> Result<(), pipeline::PipelineError> {
    let [image, label, index] = [0, 1, 2].map(|f| layout.fields[f]);
    for (j, &i) in indices.iter().enumerate() {
        let at = |fl: batchcast::schema::FieldLayout| {
            let b = fl.bytes_per_sample as usize;
            fl.offset as usize + j * b..fl.offset as usize + (j + 1) * b
        };
        let got = pipeline.fill(w, epoch, i, &mut slot[at(image)])?;
        slot[at(label)].copy_from_slice(&got.label.to_le_bytes());
        slot[at(index)].copy_from_slice(&(got.index as i64).to_le_bytes());
    }
    Ok(())
}

/// Counts a thread's CPU time. Reading it is a system call (a third of a
/// microsecond here, as long as stamping a small batch), so it is read at
/// most every `CPU_CLOCK_EVERY` of wall time; what it counts is exact
/// over time, and lags by at most that much.
struct CpuClock {
    read: Duration,
    at: Instant,
}

const CPU_CLOCK_EVERY: Duration = Duration::from_millis(10);

impl CpuClock {
    fn new() -> CpuClock {
        CpuClock {
            read: thread_cpu(),
            at: Instant::now(),
        }
    }

    /// CPU time since the last reading, or zero when it is not read now
    /// (`now`: read it, as before the thread waits for long).
    fn spent(&mut self, now: bool) -> Duration {
        if !now && self.at.elapsed() < CPU_CLOCK_EVERY {
            return Duration::ZERO;
        }
        self.at = Instant::now();
        let now = thread_cpu();
        now.saturating_sub(std::mem::replace(&mut self.read, now))
    }
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(Duration::from)
        .unwrap_or_default()
}

/// The sample order of the last two epochs, computed once per epoch.
#[derive(Default)]
struct OrderCache {
    entries: Vec<(u64, Arc<Vec<u64>>)>,
}

impl OrderCache {
    fn get(&mut self, epoch: u64, make: impl FnOnce(u64) -> Vec<u64>) -> Arc<Vec<u64>> {
        if let Some((_, o)) = self.entries.iter().find(|(e, _)| *e == epoch) {
            return o.clone();
        }
        let o = Arc::new(make(epoch));
        if self.entries.len() == 2 {
            self.entries.remove(0);
        }
        self.entries.push((epoch, o.clone()));
        o
    }
}

/// One connected consumer's numbers.
fn consumer_stats(inner: &Inner, id: ConsumerId) -> Option<ConsumerStats> {
    let conn = inner.conns.get(&id)?;
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
        samples: conn.samples,
        wait_s: (conn.wait_ns + conn.mailbox_totals.wait_ns) as f64 * 1e-9,
        busy_s: (conn.busy_ns + conn.mailbox_totals.busy_ns) as f64 * 1e-9,
        hold_s: (conn.hold_ns + conn.mailbox_totals.hold_ns) as f64 * 1e-9,
        device: conn
            .gpu
            .and_then(|k| inner.mirrors.get(&k))
            .map(|m| m.mirror.label().to_string()),
        connected_s: conn.joined.elapsed().as_secs_f64(),
        left: None,
    })
}

/// A pipeline whose batches take less than this (ns, per thread) is quick:
/// waiting on slots, it gathers half of them before it goes on.
const QUICK_FILL_NS: u64 = 200_000;
/// Shortest and longest nap of a pipeline thread between looks at the
/// mailboxes while it waits on slots.
const MIN_NAP: Duration = Duration::from_micros(10);
const MAX_NAP: Duration = Duration::from_millis(1);
/// After this long, go on with any free slot rather than gather more.
const MAX_GATHER: Duration = Duration::from_millis(1);
/// Without a free slot for this long (consumers pause, or are slow), stop
/// napping: ask mailbox consumers to ring, and sleep until one does.
const ARM_AFTER: Duration = Duration::from_millis(5);
/// The same for a pipeline that goes on with one slot (a slow pipeline, or
/// socket consumers are there): naps of about 10, 20, 40 and 80 µs.
const ARM_AFTER_ONE: Duration = Duration::from_micros(150);
/// Longest sleep of an idle or armed pipeline thread between looks.
const IDLE_WAIT: Duration = Duration::from_millis(200);

/// What a pipeline thread learned of how fast consumers free slots.
#[derive(Debug, Default)]
struct Pace {
    /// Time per freed slot in the last waits (a running average).
    per_slot: Option<Duration>,
}

impl Pace {
    /// `free` slots were free `waited` after the pipeline began to wait.
    fn learn(&mut self, waited: Duration, free: u32) {
        let now = waited / free.max(1);
        self.per_slot = Some(match self.per_slot {
            None => now,
            Some(before) => (before + now) / 2,
        });
    }

    /// The first nap of a wait for `gather` slots.
    fn first_nap(&self, gather: u32) -> Duration {
        self.per_slot.map_or(MIN_NAP, |p| p * gather)
    }
}

/// Counts a release (from the socket or a mailbox) in the hub and in the
/// consumer's numbers.
fn release(inner: &mut Inner, id: ConsumerId, r: proto::Release, now: u64) -> Result<(), HubError> {
    inner.hub.release(id, r.seq)?;
    if let Some(c) = inner.conns.get_mut(&id) {
        c.wait_ns = c.wait_ns.saturating_add(r.wait_ns);
        c.busy_ns = c.busy_ns.saturating_add(r.busy_ns);
        if let Some(sent) = c.sent_ns.remove(&r.seq) {
            c.hold_ns += now.saturating_sub(sent);
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
fn settle(inner: &mut Inner, all: bool) {
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

/// Takes the releases written to every mailbox; whether there were any.
fn drain_mailboxes(inner: &mut Inner) -> bool {
    let mut taken = std::mem::take(&mut inner.drained);
    let mut broken = Vec::new();
    for (&id, conn) in inner.conns.iter_mut() {
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
        if let Err(e) = inner.hub.release(id, seq) {
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
fn end_mailbox_consumer(inner: &mut Inner, id: ConsumerId, why: String) {
    let Some(conn) = inner.conns.get_mut(&id) else {
        return;
    };
    if conn.mailbox.take().is_none() {
        return; // already ended
    }
    tracing::warn!(consumer = id, name = %conn.name, "ending a consumer: {why}");
    conn.ending = Some(format!("ended: {why}"));
    send(
        conn,
        id,
        ServerMsg::Error(ErrorMsg {
            code: ErrorCode::InvalidRequest,
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
        let msg = match out {
            Outbound::Batch {
                seq,
                epoch,
                index,
                slot,
                samples,
            } => {
                if conn.mailbox.is_none() {
                    conn.sent_ns.insert(seq, now);
                }
                conn.samples += samples;
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
                conn.ending = Some("stream ended".into());
                ServerMsg::EndOfStream
            }
            Outbound::Detached { reason } => {
                tracing::warn!(consumer = id, name = %conn.name, "{reason}");
                conn.ending = Some(format!("detached: {reason}"));
                send(
                    conn,
                    id,
                    ServerMsg::Error(ErrorMsg {
                        code: ErrorCode::LagLimit,
                        message: reason,
                    }),
                );
                ServerMsg::Goodbye(GoodbyeReason::Detached)
            }
        };
        if let Some(mb) = conn.mailbox.as_mut() {
            let notice = match &msg {
                ServerMsg::Batch(b) => Some(Notice::Batch(*b)),
                ServerMsg::EndOfEpoch(e) => Some(Notice::EndOfEpoch(*e)),
                ServerMsg::EndOfStream => Some(Notice::EndOfStream),
                _ => None,
            };
            if let Some(n) = notice {
                match mb.push(&n) {
                    Ok(()) => conn.ring = true,
                    Err(e) => broken.push((id, e.to_string())),
                }
                continue;
            }
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
    for c in inner.hub.take_copies() {
        let Some(m) = inner
            .groups
            .get(c.group as usize)
            .and_then(|key| inner.mirrors.get(key))
        else {
            continue;
        };
        m.mirror.request(CopyRequest {
            host: c.host,
            device: c.slot,
            seq: c.seq,
        });
    }
}

fn send(conn: &Conn, id: ConsumerId, msg: ServerMsg) {
    // Full cannot happen (the outbox holds a window and then some); Closed
    // means the connection is going away and will leave.
    if let Err(e) = conn.tx.try_send(msg) {
        tracing::debug!(consumer = id, "outbox: {e}");
    }
}

impl CopySink for Stream {
    fn host_slot(&self, slot: u32) -> (*const u8, usize) {
        let bytes = self.plan.layout.slot_bytes;
        let ptr = self
            .arena
            .mapping()
            .as_ptr()
            .wrapping_add((slot as u64 * bytes) as usize);
        (ptr, bytes as usize)
    }

    fn copied(&self, key: &GpuKey, req: CopyRequest, bytes: u64, elapsed_ns: u64) {
        self.with_hub(|inner| {
            let Some(m) = inner.mirrors.get_mut(key) else {
                return;
            };
            m.copies += 1;
            m.bytes += bytes;
            m.copy_ns += elapsed_ns;
            let group = m.group;
            if let Err(e) = inner.hub.copied(group, req.seq) {
                tracing::error!(stream = %self.name(), gpu = %m.mirror.label(), "copy report: {e}");
            }
        });
    }

    fn gpu_failed(&self, key: &GpuKey, why: String) {
        tracing::error!(stream = %self.name(), "GPU copies stopped: {why}");
        self.with_hub(|inner| {
            let Some(m) = inner.mirrors.get_mut(key) else {
                return;
            };
            let message = format!(
                "stream `{}`: copies to {} failed: {why}",
                self.name(),
                m.mirror.label()
            );
            m.failed = Some(message.clone());
            // Copies still queued on the GPU may read host slots the hub is
            // about to give back.
            m.mirror.fence();
            let group = m.group;
            for id in inner.hub.fail_group(group) {
                let Some(conn) = inner.conns.get_mut(&id) else {
                    continue;
                };
                conn.ending
                    .get_or_insert_with(|| format!("device failed: {why}"));
                send(
                    conn,
                    id,
                    ServerMsg::Error(ErrorMsg {
                        code: ErrorCode::DeviceUnavailable,
                        message: message.clone(),
                    }),
                );
                send(conn, id, ServerMsg::Goodbye(GoodbyeReason::Shutdown));
            }
        });
    }
}

/// The stream's GPU bookkeeping (device rings, copies, what GPU consumers
/// are sent, a failing GPU) driven through a GPU made of host memory
/// ([`crate::gpu::test_gpu`]): CUDA itself is exercised by `bench/gpu.sh`.
#[cfg(test)]
mod tests {
    use std::path::Path;

    use batchcast::mailbox::ConsumerMailbox;
    use batchcast::proto::Release;
    use batchcast::synthetic::SyntheticSpec;

    use super::*;
    use crate::config::Config;
    use crate::gpu::test_gpu;

    fn start(gpu_slots: u32, min_consumers: u32) -> Arc<Stream> {
        let text = format!(
            r#"[[stream]]
name = "t"
batch_size = 4
epochs = 2
slots = 4
gpu_slots = {gpu_slots}
min_consumers = {min_consumers}
workers = 1
[stream.synthetic]
len = 40
fields = [{{ name = "x", dtype = "u8", shape = [3, 4, 4] }}, {{ name = "y", dtype = "i64", shape = [] }}]
"#
        );
        let p = Path::new("test.toml");
        let plan = Config::parse(&text, p).unwrap().plan(p).unwrap().remove(0);
        Stream::start(plan).unwrap()
    }

    fn peer(name: &str) -> Peer {
        Peer {
            name: name.into(),
            pid: std::process::id(),
            uid: 0,
        }
    }

    fn subscribe(s: &Arc<Stream>, name: &str, gpu: bool) -> Subscription {
        let req = test_gpu::request();
        s.subscribe(
            2,
            JoinPolicy::NextEpoch,
            peer(name),
            gpu.then_some(&req),
            false,
        )
        .unwrap()
    }

    fn next(sub: &mut Subscription) -> ServerMsg {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match sub.rx.try_recv() {
                Ok(m) => return m,
                Err(mpsc::error::TryRecvError::Empty) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(e) => panic!("no message for consumer {}: {e}", sub.id),
            }
        }
    }

    fn release(s: &Stream, id: ConsumerId, seq: u64) {
        s.release(
            id,
            Release {
                seq,
                wait_ns: 0,
                busy_ns: 0,
            },
        )
        .unwrap();
    }

    fn spec(s: &Stream) -> &SyntheticSpec {
        match &s.plan.source {
            Source::Synthetic(spec) => spec,
            _ => unreachable!(),
        }
    }

    /// Checks every sample of batch `b` in `slot_bytes` bytes from `memory`.
    fn verify(s: &Stream, b: &BatchReady, memory: &[u8]) {
        let order = s.plan.epoch_order(b.epoch);
        let layout = &s.plan.layout;
        let slot =
            &memory[(b.slot as u64 * layout.slot_bytes) as usize..][..layout.slot_bytes as usize];
        for (f, fl) in layout.fields.iter().enumerate() {
            let bps = fl.bytes_per_sample as usize;
            for j in 0..b.samples as usize {
                let index = order[b.index as usize * 4 + j];
                let at = fl.offset as usize + j * bps;
                assert!(
                    spec(s).verify_sample(f, index, &slot[at..at + bps]),
                    "batch {} (slot {}) field {f} sample {j} is wrong",
                    b.seq,
                    b.slot
                );
            }
        }
    }

    fn host_memory(s: &Stream) -> &[u8] {
        s.arena.mapping().get(0, s.plan.arena_bytes()).unwrap()
    }

    /// A mailbox consumer as the client library drives one: takes notices,
    /// checks each batch, releases it through the mailbox and rings when
    /// the stream asks. Returns the batches it saw, up to the end.
    fn drain_as_mailbox_consumer(s: &Stream, mb: &ConsumerMailbox) -> Vec<u64> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut seen = Vec::new();
        loop {
            assert!(Instant::now() < deadline, "stalled after {seen:?}");
            match mb.pop().unwrap() {
                Some(Notice::Batch(b)) => {
                    verify(s, &b, host_memory(s));
                    seen.push(b.seq);
                    assert!(mb.push_release(b.seq, Totals::default()));
                    if mb.wants_doorbell() {
                        s.doorbell();
                    }
                }
                Some(Notice::EndOfEpoch(_)) => {}
                Some(Notice::EndOfStream) => return seen,
                None => mb.sleep_unless(Duration::from_millis(5), || false),
            }
        }
    }

    #[test]
    fn a_consumer_that_forges_a_mailbox_release_is_ended_and_the_others_finish() {
        let s = start(2, 2);
        let grant = |name: &str| {
            let mut sub = s
                .subscribe(2, JoinPolicy::NextEpoch, peer(name), None, true)
                .unwrap();
            let g = sub
                .mailbox
                .take()
                .expect("a host consumer gets its mailbox");
            (sub, ConsumerMailbox::open(g.fd, g.spec).unwrap())
        };
        let (good, good_mb) = grant("good");
        let (mut bad, bad_mb) = grant("bad");
        // It releases a batch it was never sent.
        assert!(bad_mb.push_release(12345, Totals::default()));
        let ServerMsg::Error(e) = next(&mut bad) else {
            panic!("expected an error")
        };
        assert!(e.message.contains("bad release"), "{}", e.message);
        assert!(matches!(next(&mut bad), ServerMsg::Goodbye(_)));
        // Its connection closes, as the server's would.
        s.leave(bad.id);
        let seen = drain_as_mailbox_consumer(&s, &good_mb);
        assert_eq!(
            seen,
            (0..20).collect::<Vec<_>>(),
            "2 epochs of 10, in order"
        );
        drop(good);
    }

    #[test]
    fn gpu_consumers_read_every_batch_from_their_own_device_ring() {
        let s = start(2, 2);
        let mut host = subscribe(&s, "host", false);
        let mut gpu = subscribe(&s, "gpu", true);
        assert_eq!(gpu.device.as_ref().unwrap().slots, 2);
        let (mut got_host, mut got_gpu) = (Vec::new(), Vec::new());
        let mut held = VecDeque::new();
        let (mut host_done, mut gpu_done) = (false, false);
        while !(host_done && gpu_done) {
            if !host_done {
                match next(&mut host) {
                    ServerMsg::Batch(b) => {
                        verify(&s, &b, host_memory(&s));
                        got_host.push((b.epoch, b.index));
                        release(&s, host.id, b.seq);
                    }
                    ServerMsg::EndOfStream => host_done = true,
                    ServerMsg::EndOfEpoch(_) => {}
                    m => panic!("host consumer got {m:?}"),
                }
            }
            if !gpu_done {
                match next(&mut gpu) {
                    ServerMsg::Batch(b) => {
                        assert!(b.slot < 2, "device slot {} of 2", b.slot);
                        verify(&s, &b, &s.gpus.test_memory.lock().unwrap());
                        got_gpu.push((b.epoch, b.index));
                        // Hold one batch while taking the next: both device
                        // slots in use at once.
                        held.push_back(b.seq);
                        if held.len() == 2 {
                            release(&s, gpu.id, held.pop_front().unwrap());
                        }
                    }
                    ServerMsg::EndOfEpoch(_) => {}
                    ServerMsg::EndOfStream => {
                        gpu_done = true;
                        for seq in held.drain(..) {
                            release(&s, gpu.id, seq);
                        }
                    }
                    m => panic!("GPU consumer got {m:?}"),
                }
            }
        }
        let every: Vec<(u64, u64)> = (0..2).flat_map(|e| (0..10).map(move |i| (e, i))).collect();
        assert_eq!(got_host, every);
        assert_eq!(got_gpu, every);
        let st = s.stats();
        assert_eq!(st.gpus.len(), 1);
        let g = &st.gpus[0];
        assert_eq!(g.copies, 20, "one copy per batch: {g:?}");
        assert_eq!((g.slots, g.slots_in_use, g.waiting), (2, 0, 0), "{g:?}");
        s.leave(host.id);
        s.leave(gpu.id);
        s.shutdown();
    }

    #[test]
    fn host_slots_are_refilled_while_a_gpu_consumer_holds_its_copies() {
        let s = start(2, 1);
        let mut gpu = subscribe(&s, "gpu", true);
        let first: Vec<BatchReady> = (0..2)
            .map(|_| match next(&mut gpu) {
                ServerMsg::Batch(b) => b,
                m => panic!("{m:?}"),
            })
            .collect();
        // The GPU consumer holds both device slots. Its next two batches
        // wait for a device slot, pinning two host slots; the other two host
        // slots were given back when their copies completed and hold two
        // more batches (with the host slot tied to the device slot, only
        // four batches could exist).
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.stats().batches_produced < 6 {
            assert!(Instant::now() < deadline, "{:?}", s.stats());
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(50));
        let st = s.stats();
        assert_eq!(st.batches_produced, 6, "no host slot is free: {st:?}");
        assert_eq!((st.gpus[0].slots_in_use, st.gpus[0].waiting), (2, 4));
        for b in &first {
            release(&s, gpu.id, b.seq);
        }
        for want in 2..4 {
            match next(&mut gpu) {
                ServerMsg::Batch(b) => {
                    assert_eq!(b.seq, want);
                    verify(&s, &b, &s.gpus.test_memory.lock().unwrap());
                }
                m => panic!("{m:?}"),
            }
        }
        s.leave(gpu.id);
        s.shutdown();
    }

    #[test]
    fn a_failing_gpu_ends_its_consumers_and_host_consumers_finish() {
        let s = start(2, 2);
        *s.gpus.test_fail_at.lock().unwrap() = Some(3);
        let mut host = subscribe(&s, "host", false);
        let mut gpu = subscribe(&s, "gpu", true);
        let mut gpu_batches = 0;
        loop {
            match next(&mut gpu) {
                ServerMsg::Batch(b) => {
                    gpu_batches += 1;
                    release(&s, gpu.id, b.seq);
                }
                ServerMsg::Error(e) => {
                    assert_eq!(e.code, ErrorCode::DeviceUnavailable);
                    assert!(
                        e.message.contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
                        "{}",
                        e.message
                    );
                    break;
                }
                m => panic!("{m:?}"),
            }
        }
        assert_eq!(gpu_batches, 3, "the copies before the failure arrived");
        assert!(matches!(next(&mut gpu), ServerMsg::Goodbye(_)));
        s.leave(gpu.id);
        // Copies that never completed gave back their host slots.
        let mut n = 0;
        loop {
            match next(&mut host) {
                ServerMsg::Batch(b) => {
                    verify(&s, &b, host_memory(&s));
                    release(&s, host.id, b.seq);
                    n += 1;
                }
                ServerMsg::EndOfEpoch(_) => {}
                ServerMsg::EndOfStream => break,
                m => panic!("{m:?}"),
            }
        }
        assert_eq!(n, 20);
        let err = s
            .subscribe(
                1,
                JoinPolicy::Immediate,
                peer("again"),
                Some(&test_gpu::request()),
                false,
            )
            .unwrap_err();
        assert!(err.to_string().contains("failed"), "{err}");
        s.leave(host.id);
        s.shutdown();
    }
}
