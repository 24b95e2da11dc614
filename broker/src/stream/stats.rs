//! What `batchcast stats` (and `/metrics`) shows of a stream: its slots,
//! batches and epochs, the pipeline's CPU and back-pressure, its source's
//! decodes and cache, its GPUs' copies, and each consumer's numbers,
//! connected and departed; and the clock a pipeline thread counts its
//! CPU time by.

use batchcast::proto::{self, ConsumerStats, SourceStats, StreamStats};

use super::{Inner, Stream};
use crate::hub::ConsumerId;
use std::time::{Duration, Instant};

impl Stream {
    pub fn stats(&self) -> StreamStats {
        // Releases sitting in mailboxes count as released.
        self.with_hub(|inner| inner.deliver.drain_all());
        let inner = self.lock();
        let c = inner.hub.view().counts();
        let mut consumers: Vec<ConsumerStats> = inner
            .conns
            .keys()
            .filter_map(|&id| consumer_stats(&inner, id))
            .collect();
        consumers.sort_by_key(|c| c.id);
        StreamStats {
            name: self.name().to_string(),
            slots: self.plan.slots,
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
            ring_moves: inner.fill.regions.moves,
            held_behind: inner.fill.regions.held_left() as u64,
            producer_blocked_s: inner.fill.blocked().as_secs_f64(),
            pipeline_cpu_s: inner.fill.cpu().as_secs_f64(),
            replay_cpu_s: inner.replay.cpu().as_secs_f64(),
            workers: u32::try_from(self.plan.workers).unwrap_or(u32::MAX),
            workers_active: inner.fill.scale.active(),
            workers_auto: inner.fill.scale.is_automatic(),
            owner_uid: self.owner_uid,
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
            failed: inner.records.failed.as_ref().map(|f| f.to_string()),
            share: match &self.plan.schema.source {
                batchcast::schema::SourceInfo::Images(i) => {
                    Some((i.rank, i.world_size, self.plan.schema.samples_per_epoch))
                }
                _ => None,
            },
            gpus: inner.mirrors.stats(&inner.hub),
            source: self
                .writer
                .as_ref()
                .and_then(|w| w.counts())
                .map(source_stats),
            consumers,
            consumers_left_out: 0,
            past_consumers: inner.records.past.iter().cloned().collect(),
        }
    }
}

/// One connected consumer's numbers.
pub(super) fn consumer_stats(inner: &Inner, id: ConsumerId) -> Option<ConsumerStats> {
    let conn = inner.conns.get(&id)?;
    // One the hub detached (lag or hold limit) is still shown, with the
    // reason, until its connection closes; the hub no longer counts it.
    let n = inner
        .hub
        .view()
        .reader(id)
        .map(|c| c.counts())
        .unwrap_or_default();
    // Wait, busy and hold times are the client's own figures (a release
    // carries them, a mailbox sums them): nobody can have waited, worked or
    // held longer than it has been connected, whatever it writes.
    let connected = conn.tally.joined.elapsed();
    let connected_ns = u64::try_from(connected.as_nanos()).unwrap_or(u64::MAX);
    let secs =
        |socket: u64, mailbox: u64| socket.saturating_add(mailbox).min(connected_ns) as f64 * 1e-9;
    Some(ConsumerStats {
        id,
        name: conn.peer.name.clone(),
        pid: conn.peer.pid,
        uid: conn.peer.uid,
        window: conn.own.window,
        batch_size: conn.own.batch_size,
        batches: conn.own.shared.batches() + conn.own.replayed.batches(),
        delivered: n.delivered,
        held: n.held,
        queued: n.queued,
        epoch: n.epoch,
        // Its own batches' samples, shared and replayed alike (not the
        // shared samples it skipped, nor those taken back to replay).
        samples: conn.own.shared.samples() + conn.own.replayed.samples(),
        wait_s: secs(conn.tally.wait_ns, conn.tally.mailbox.wait_ns),
        busy_s: secs(conn.tally.busy_ns, conn.tally.mailbox.busy_ns),
        hold_s: secs(conn.tally.hold_ns, conn.tally.mailbox.hold_ns),
        device: conn.gpu.and_then(|k| inner.mirrors.label(&k)),
        connected_s: connected.as_secs_f64(),
        left: None,
        replayed: conn.tally.replayed,
        replay_cpu_s: conn.tally.replay_cpu.as_secs_f64(),
        cuts: conn.merges.cuts,
        rotations: conn.merges.rotations,
        group: conn.seat.as_ref().map(super::seats::label),
        serial: conn.tally.serial,
        taken: conn
            .out
            .mailbox()
            .map_or(conn.tally.taken, |mb| conn.tally.taken.max(mb.taken())),
    })
}

/// What an image source's counts show.
fn source_stats(n: crate::pipeline::PipelineCounts) -> SourceStats {
    let c = n.cache.unwrap_or_default();
    let shared = n.shared.map(|(name, s)| proto::SharedSourceStats {
        source: name,
        streams: s.streams,
        decodes: s.decodes,
        taken: s.taken,
        held_s: s.held.as_secs_f64(),
        let_go: s.let_go,
        entries: s.entries,
        bytes: s.bytes,
    });
    SourceStats {
        decoded: n.decoded,
        skipped: n.skipped,
        reduced: n.reduced,
        in_part: n.in_part,
        cut: n.cut,
        cache_hits: c.hits,
        cache_misses: c.misses,
        cache_bytes: c.bytes,
        cache_items: c.items,
        cache_budget: c.budget,
        shared,
        remote: n.remote,
        decoded_cache: n.kept.map(|k| proto::DecodedCacheStats {
            hits: k.hits,
            misses: k.misses,
            bytes: k.bytes,
            items: k.items,
            budget: k.budget,
        }),
        stages: proto::StageStats {
            read_s: n.stages[0],
            decode_s: n.stages[1],
            transform_s: n.stages[2],
            read_cpu_s: n.read_cpu_s,
        },
        caches_chosen: n.caches_chosen,
    }
}

/// Counts a thread's CPU time. Reading it is a system call (a third of a
/// microsecond here, as long as stamping a small batch), so it is read at
/// most every `CPU_CLOCK_EVERY` of wall time; what it counts is exact
/// over time, and lags by at most that much.
pub(super) struct CpuClock {
    read: Duration,
    at: Instant,
}

const CPU_CLOCK_EVERY: Duration = Duration::from_millis(10);

impl CpuClock {
    pub(super) fn new() -> CpuClock {
        CpuClock {
            read: thread_cpu(),
            at: Instant::now(),
        }
    }

    /// CPU time since the last reading, or zero when it is not read now
    /// (`now`: read it, as before the thread waits for long).
    pub(super) fn spent(&mut self, now: bool) -> Duration {
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
