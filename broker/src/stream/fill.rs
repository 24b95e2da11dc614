//! Filling: the pipeline threads, and what the stream's lock keeps of
//! whoever fills its slots ([`Filling`]: the threads' counts and clocks,
//! or an external producer's wait). Each thread ([`Worker`]) takes a slot
//! from the hub, writes the batch into it ([`crate::pipeline::collate`])
//! and publishes it. While no slot is free (back-pressure) it waits,
//! pacing itself to its consumers: see [`Worker::wait_for_job`]. Its CPU
//! time is counted for `stats` (`pipeline_cpu_s`).

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use super::autoscale;
use super::cells;
use super::decouple;
use super::deliver::settle;
use super::error::MakeError;
use super::regions;
use super::replay::{self, book::ReplayJob};
use super::stats::CpuClock;
use super::{Inner, Stream, StreamFailed};
use crate::hub::Work;
use crate::pipeline::collate::{SlotWriter, ThreadState};
use crate::pipeline::{PipelineError, Place};

/// Whoever fills the slots, as the stream's lock keeps them: pipeline
/// threads waiting on `work_cv` (to be notified), and those of them done
/// polling mailboxes: while one is, or an external producer was told to
/// wait, mailbox consumers are asked to ring a doorbell when they release
/// (nobody would look at their mailbox soon otherwise).
#[derive(Debug)]
pub(super) struct Filling {
    /// Pipeline threads (0 for an external producer).
    workers: u32,
    idle: u32,
    armed: u32,
    producer_waiting: bool,
    /// Wall time the pipeline took for its last batch (`u64::MAX` until one
    /// is made): whether it is quick (see `QUICK_FILL_NS`).
    fill_ns: u64,
    /// CPU the pipeline threads spent on the shared stream.
    cpu: Duration,
    /// Time the pipeline (or the producer) waited for a free slot.
    blocked: Duration,
    /// What a shared source was last told: whether this stream takes
    /// batches (see [`tell_source`]).
    told_live: bool,
    /// Where the ring is in the host arena, and what it left behind.
    pub(super) regions: regions::Regions,
    /// How many of the threads work (`workers` left out: as many as the
    /// trainers need).
    pub(super) scale: autoscale::Autoscale,
}

impl Filling {
    pub(super) fn new(
        workers: u32,
        regions: regions::Regions,
        scale: autoscale::Autoscale,
    ) -> Filling {
        Filling {
            regions,
            scale,
            workers,
            idle: 0,
            armed: 0,
            producer_waiting: false,
            fill_ns: u64::MAX,
            cpu: Duration::ZERO,
            blocked: Duration::ZERO,
            told_live: false,
        }
    }

    /// Whether a pipeline thread waits on `work_cv` (and must be notified).
    pub(super) fn anyone_idle(&self) -> bool {
        self.idle > 0
    }

    pub(super) fn producer_waiting(&self) -> bool {
        self.producer_waiting
    }

    pub(super) fn set_producer_waiting(&mut self, waiting: bool) {
        self.producer_waiting = waiting;
    }

    /// Whether mailbox consumers should ring when they release: someone
    /// who fills waits without looking at mailboxes.
    pub(super) fn wants_doorbells(&self) -> bool {
        self.armed > 0 || self.producer_waiting
    }

    pub(super) fn add_blocked(&mut self, waited: Duration) {
        self.blocked += waited;
    }

    /// Back-pressure: time spent waiting for a free slot.
    pub(super) fn blocked(&self) -> Duration {
        self.blocked
    }

    /// CPU the pipeline threads spent on the shared stream.
    pub(super) fn cpu(&self) -> Duration {
        self.cpu
    }
}

/// Starts the stream's pipeline threads (none for an external producer).
pub(super) fn spawn_workers(stream: &Arc<Stream>) -> std::io::Result<()> {
    let mut workers = stream.workers.lock().unwrap_or_else(|p| p.into_inner());
    for i in 0..stream.plan.workers {
        let s = stream.clone();
        let handle = std::thread::Builder::new()
            .name(format!(
                "{}{i}",
                batchcast::stats_client::pipeline_threads(&stream.plan.name)
            ))
            .spawn(move || run(&s, i as u32))?;
        workers.push(handle);
    }
    Ok(())
}

/// Joins the pipeline threads that end within `wait`. One stuck in I/O
/// (a hung network filesystem) is left behind, named in the log: it holds
/// nothing anyone waits for, and shutdown must not wait on it.
pub(super) fn join_workers(s: &Stream, wait: Duration) {
    let mut workers = std::mem::take(&mut *s.workers.lock().unwrap_or_else(|p| p.into_inner()));
    let deadline = Instant::now() + wait;
    while !workers.is_empty() && Instant::now() < deadline {
        let (done, running): (Vec<_>, Vec<_>) = workers.into_iter().partition(|w| w.is_finished());
        for w in done {
            let _ = w.join();
        }
        workers = running;
        if !workers.is_empty() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    for w in workers {
        tracing::warn!(
            stream = %s.name(),
            thread = w.thread().name().unwrap_or("?"),
            "a pipeline thread did not stop within {wait:?} (stuck reading?); leaving it"
        );
    }
}

/// Tells a shared source whether this stream takes batches (someone reads
/// and epochs are left, or its last batches are being filled; the stream
/// has not stopped): one that does not never holds the source's other
/// streams.
pub(super) fn tell_source(s: &Stream, inner: &mut Inner) {
    // Batches still being filled count: the last ones of a run are filled
    // after the hub has handed out its last batch.
    let live = !s.stop.load(Ordering::SeqCst)
        && (inner.hub.view().wants_batches() || inner.hub.view().ring().filling());
    if live != inner.fill.told_live
        && let Some(w) = &s.writer
    {
        inner.fill.told_live = live;
        w.set_live(live);
    }
}

/// Pipeline thread `index`: take work from the hub, fill the slot,
/// publish (while the stream needs it: `autoscale`).
fn run(s: &Stream, index: u32) {
    // Its naps between looks at mailboxes are tens of microseconds: do
    // not let the kernel stretch them by the default 50 µs of slack.
    if let Err(e) = nix::sys::prctl::set_timerslack(1_000) {
        tracing::debug!("timer slack: {e}");
    }
    let Some(writer) = &s.writer else {
        return; // an external producer fills the slots
    };
    let state = match writer.thread_state() {
        Ok(st) => st,
        Err(e) => {
            s.fail(StreamFailed::Decoder(e.to_string()));
            return;
        }
    };
    Worker {
        s,
        index,
        writer,
        state,
        orders: OrderCache::default(),
        pace: Pacer::default(),
        cpu: CpuClock::new(),
        replayed_last: false,
    }
    .run();
}

/// One pipeline thread and what it keeps between batches.
struct Worker<'a> {
    s: &'a Stream,
    /// Its number among the stream's threads (`autoscale`).
    index: u32,
    writer: &'a SlotWriter,
    state: ThreadState,
    orders: OrderCache,
    pace: Pacer,
    cpu: CpuClock,
    /// It made a replayed batch last (the shared one goes first next).
    replayed_last: bool,
}

impl<'a> Worker<'a> {
    fn run(mut self) {
        let s = self.s;
        loop {
            let job = match self.wait_for_job(s.lock()) {
                Some(j) => j,
                None => return,
            };
            let (work, region) = match job {
                Job::Shared(work, r) => (work, r),
                Job::Replay(job) => {
                    self.replayed_last = true;
                    self.replay(job);
                    continue;
                }
            };
            self.replayed_last = false;
            let t0 = Instant::now();
            let order = self.orders.get(work.epoch, |e| s.plan.epoch_order(e));
            self.read_ahead(&work, &order);
            let filled = self.fill(&work, &order, region);
            let fill_ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let spent = self.cpu.spent(false);
            match filled {
                Ok(samples) => s.with_hub(|inner| {
                    regions::filled(s, inner, region, (work.seq, samples));
                    inner.fill.fill_ns = fill_ns;
                    inner.fill.cpu += spent;
                    inner.hub.finish_batch(work.seq, samples);
                    inner.pace.made(work.seq, Instant::now());
                }),
                Err(e) => {
                    // The slot stays in `Filling`: nobody ever sees a torn batch.
                    s.fail(StreamFailed::Source(e.to_string()));
                    return;
                }
            }
        }
    }

    /// Tells a remote dataset what this batch and the ones after it read,
    /// the next epoch's first samples too near an epoch's end (its first
    /// batch would otherwise wait a round trip).
    fn read_ahead(&mut self, work: &Work, order: &[u64]) {
        if !self.writer.reads_remote() {
            return;
        }
        let plan = &self.s.plan;
        let first = (work.index as usize * plan.schema.batch_size as usize).min(order.len());
        let lead = work.epoch * order.len() as u64 + first as u64;
        let last = plan.epochs.is_some_and(|n| work.epoch + 1 >= n);
        let mut rest = order[first..].iter().copied();
        if order.len() - first >= EPOCH_TAIL || last {
            self.writer.want(lead, &mut rest);
            return;
        }
        let next = self.orders.get(work.epoch + 1, |e| plan.epoch_order(e));
        let mut both = rest.chain(next[..next.len().min(EPOCH_TAIL)].iter().copied());
        self.writer.want(lead, &mut both);
    }

    /// Makes a replayed batch into its consumer's replay arena and sends
    /// it (see [`super::replay`]); its CPU time is counted as replay.
    fn replay(&mut self, job: ReplayJob) {
        let before = self.cpu.spent(true);
        let order = self.orders.get(job.epoch, |e| self.s.plan.epoch_order(e));
        let range = job.first as usize..(job.first + job.samples) as usize;
        let memory = job.commit.as_ref().map_or(Ok(()), |c| c.ensure()); // outside the lock
        let made = match (memory, order.get(range)) {
            (Err(e), _) => Err(MakeError::Memory(e)),
            (Ok(()), None) => Err(MakeError::OutsideEpoch {
                first: job.first,
                end: job.first + job.samples,
                epoch: job.epoch,
                len: order.len(),
            }),
            (Ok(()), Some(indices)) => {
                let mut fields = cells::of_replay(&job);
                let first = Place {
                    at: job.epoch * order.len() as u64 + job.first,
                    replay: true,
                };
                self.writer
                    .write_batch(&mut self.state, job.epoch, first, indices, &mut fields)
                    .map(|_| ())
                    .map_err(MakeError::from)
            }
        };
        let spent = self.cpu.spent(true);
        self.s.with_hub(|inner| {
            inner.fill.cpu += before;
            replay::finish(inner, job.id, job.seq, spent, made);
        });
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
    ///
    /// A replayed batch for some consumer goes first when one may start
    /// (`replay::take_job`; `replayed_last`: this thread made one last).
    ///
    /// In order, a pipeline thread looks for: a cut consumer to merge back,
    /// a replayed batch, a free slot (at once outside a wait; else once
    /// enough are free), and otherwise waits: idle while the hub wants no
    /// batch, cutting laggards under decoupled pace, sleeping until a
    /// release, or napping while consumers free slots.
    fn wait_for_job(&mut self, mut inner: MutexGuard<'a, Inner>) -> Option<Job> {
        let s = self.s;
        // Since when it waits on slots (back-pressure, as opposed to waiting
        // for consumers or after the last epoch).
        let mut blocked_since: Option<Instant> = None;
        // End of the current nap (naps are cut short by notifications).
        let mut wake_at: Option<Instant> = None;
        // A doorbell or a socket release woke it: take any free slot.
        let mut take_any = false;
        let mut naps = 0u32;
        let work = loop {
            if s.stop.load(Ordering::SeqCst) {
                return None;
            }
            if !autoscale::works(s, &mut inner, self.index, Instant::now()) {
                add_blocked(&mut inner, blocked_since.take());
                inner.fill.cpu += self.cpu.spent(true);
                inner = autoscale::park(s, inner);
                continue;
            }
            decouple::merge_replays(s, &mut inner, Instant::now);
            if let Some(job) = replay::take_job(&mut inner, self.replayed_last) {
                add_blocked(&mut inner, blocked_since);
                return Some(Job::Replay(job));
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
            let (mailboxes, target) = slot_target(s, &inner);
            let free = inner.hub.view().ring().free_slots();
            if (free >= target || (free > 0 && (take_any || waited >= MAX_GATHER)))
                && let Some(w) = inner.hub.start_batch()
            {
                if target > 1 {
                    self.pace.learn(waited, free);
                }
                let waited_us = waited.as_micros() as u64;
                tracing::trace!(naps, free, waited_us, "slot wait");
                break w;
            }
            if !inner.hub.view().wants_batches() {
                if decouple::cut_at_end(s, &mut inner, Instant::now()) {
                    settle(&mut inner, true);
                    continue;
                }
                inner = self.wait_idle(inner);
                (blocked_since, wake_at) = (None, None);
                continue;
            }
            blocked_since.get_or_insert(now);
            // Decoupled pace: one a ring behind is cut, not waited for.
            if free == 0 && decouple::cut_laggards(s, &mut inner, now) {
                settle(&mut inner, true);
                continue;
            }
            let arm_after = if target > 1 { ARM_AFTER } else { ARM_AFTER_ONE };
            if mailboxes == 0 || (free == 0 && waited >= arm_after) {
                // Socket releases notify; mailbox consumers are asked to ring.
                inner.fill.cpu += self.cpu.spent(true);
                let wait = decouple::look_within(s, &inner, IDLE_WAIT, now);
                inner = idle(s, inner, mailboxes > 0, wait);
                take_any = true;
                continue;
            }
            let until = self.pace.wake_at(wake_at, now, waited, (free, target));
            wake_at = Some(until);
            naps += 1;
            inner = idle(s, inner, false, until - now);
            settle(&mut inner, true);
        };
        add_blocked(&mut inner, blocked_since);
        inner.pace.begun(work.seq, s.plan.slots, Instant::now());
        Some(Job::Shared(work, inner.fill.regions.begin()))
    }

    /// Idle: nothing to do until a hub change notifies it. A consumer being
    /// replayed to is asked to ring when it releases (nobody else would
    /// look at its mailbox).
    /// (Every epoch made, it wakes by the hold rule's next deadline, if
    /// sooner: `decouple::cut_at_end`.)
    fn wait_idle(&mut self, mut inner: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        tell_source(self.s, &mut inner);
        inner.fill.cpu += self.cpu.spent(true);
        let armed = replay::active(&inner);
        let wait = decouple::idle_within(self.s, &inner, IDLE_WAIT, Instant::now());
        idle(self.s, inner, armed, wait)
    }

    /// Writes every sample of `work` straight into its slot in `region`.
    fn fill(&mut self, work: &Work, order: &[u64], region: u32) -> Result<u64, PipelineError> {
        let s = self.s;
        let batch_size = s.plan.schema.batch_size as usize;
        let first = work.index as usize * batch_size;
        let indices = &order[first..(first + batch_size).min(order.len())];
        let rings = &s.rings[region as usize];
        let mut fields = cells::of_work(rings, &s.plan.rings, work, indices.len() as u64);
        let first = Place {
            at: work.epoch * order.len() as u64 + first as u64,
            replay: false,
        };
        self.writer
            .write_batch(&mut self.state, work.epoch, first, indices, &mut fields)
    }
}

/// How many consumers read through a mailbox, and how many free slots a
/// blocked thread waits for: half the ring when batches are quick to make
/// and every consumer has a mailbox, else one.
fn slot_target(s: &Stream, inner: &Inner) -> (usize, u32) {
    let mailboxes = inner
        .conns
        .values()
        .filter(|c| c.out.mailbox().is_some())
        .count();
    let quick = inner.fill.fill_ns / u64::from(inner.fill.workers.max(1)) < QUICK_FILL_NS;
    let target = match quick && mailboxes == inner.conns.len() {
        true => (s.plan.slots / 2).max(1),
        false => 1,
    };
    (mailboxes, target)
}

/// Waits on `work_cv` for up to `timeout`, counted as idle (hub changes
/// that let the pipeline go on notify it); `armed`: asks mailbox consumers
/// to ring when they release, first taking what they released already.
fn idle<'a>(
    s: &'a Stream,
    mut inner: MutexGuard<'a, Inner>,
    armed: bool,
    timeout: Duration,
) -> MutexGuard<'a, Inner> {
    inner.fill.idle += 1;
    if armed {
        inner.fill.armed += 1;
        settle(&mut inner, true);
    }
    if !(armed && (inner.hub.view().can_start() || replay::has_work(&inner))) {
        inner = s
            .work_cv
            .wait_timeout(inner, timeout)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    inner.fill.idle -= 1;
    if armed {
        inner.fill.armed -= 1;
    }
    inner
}

/// Counts a wait for a slot that began `since` (if it did) as blocked.
fn add_blocked(inner: &mut Inner, since: Option<Instant>) {
    if let Some(t) = since {
        inner.fill.blocked += t.elapsed();
    }
}

/// What a pipeline thread does next.
enum Job {
    Shared(Work, u32), // written in this region of the host arena
    Replay(ReplayJob),
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

/// Samples before an epoch's end from which a remote dataset's read-ahead
/// looks into the next epoch too.
const EPOCH_TAIL: usize = 4096;

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
struct Pacer {
    /// Time per freed slot in the last waits (a running average).
    per_slot: Option<Duration>,
}

impl Pacer {
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

    /// When to look again, waiting for `target` slots with `free` free
    /// after `waited`: at the end of the nap under way (`wake_at`), else
    /// when they are likely free: learned for the first nap, then from how
    /// many came in the time waited so far; as long again when none came.
    fn wake_at(
        &self,
        wake_at: Option<Instant>,
        now: Instant,
        waited: Duration,
        (free, target): (u32, u32),
    ) -> Instant {
        match wake_at {
            Some(w) if w > now => w,
            _ => {
                let nap = match (wake_at, free) {
                    (None, _) => self.first_nap(target),
                    (Some(_), 0) => waited,
                    (Some(_), f) => waited * (target - f) / f,
                };
                now + nap.clamp(MIN_NAP, MAX_NAP)
            }
        }
    }
}
