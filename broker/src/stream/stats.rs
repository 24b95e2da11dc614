//! What `batchcast stats` (and `/metrics`) shows of a stream: its slots,
//! batches and epochs, the pipeline's CPU and back-pressure, its source's
//! decodes and cache, its GPUs' copies, and each consumer's numbers,
//! connected and departed.

use std::collections::BTreeMap;

use batchcast::proto::{self, ConsumerStats, Position, SourceStats, StreamStats};

use super::{Inner, Stream};
use crate::hub::ConsumerId;

impl Stream {
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
            producer_blocked_s: inner.producer_blocked.as_secs_f64(),
            pipeline_cpu_s: inner.pipeline_cpu.as_secs_f64(),
            replay_cpu_s: inner.replay_cpu.as_secs_f64(),
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
            failed: inner.failed.as_ref().map(|f| f.to_string()),
            gpus: gpu_stats(&inner),
            source: self.writer.as_ref().and_then(|w| w.counts()).map(|n| {
                let c = n.cache.unwrap_or_default();
                let shared = n.shared.map(|(name, s)| proto::SharedSourceStats {
                    source: name,
                    streams: s.streams,
                    decodes: s.decodes,
                    taken: s.taken,
                    held_s: s.held.as_secs_f64(),
                    entries: s.entries,
                    bytes: s.bytes,
                });
                SourceStats {
                    decoded: n.decoded,
                    skipped: n.skipped,
                    reduced: n.reduced,
                    cache_hits: c.hits,
                    cache_misses: c.misses,
                    cache_bytes: c.bytes,
                    cache_items: c.items,
                    cache_budget: c.budget,
                    shared,
                }
            }),
            consumers,
            consumers_left_out: 0,
            past_consumers: inner.past.iter().cloned().collect(),
        }
    }
}

/// Each GPU's copies, by GPU label.
fn gpu_stats(inner: &Inner) -> Vec<proto::GpuCopyStats> {
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
}

/// One connected consumer's numbers.
pub(super) fn consumer_stats(inner: &Inner, id: ConsumerId) -> Option<ConsumerStats> {
    let conn = inner.conns.get(&id)?;
    // One the hub detached (lag or hold limit) is still shown, with the
    // reason, until its connection closes; the hub no longer counts it.
    let n = inner.hub.consumer_counts(id).unwrap_or_default();
    // Wait, busy and hold times are the client's own figures (a release
    // carries them, a mailbox sums them): nobody can have waited, worked or
    // held longer than it has been connected, whatever it writes.
    let connected = conn.joined.elapsed();
    let connected_ns = u64::try_from(connected.as_nanos()).unwrap_or(u64::MAX);
    let secs =
        |socket: u64, mailbox: u64| socket.saturating_add(mailbox).min(connected_ns) as f64 * 1e-9;
    Some(ConsumerStats {
        id,
        name: conn.name.clone(),
        pid: conn.pid,
        uid: conn.uid,
        window: conn.window,
        batch_size: conn.batch_size,
        batches: conn.cut.batches() + conn.replay_cut.batches(),
        delivered: n.delivered,
        held: n.held,
        queued: n.queued,
        epoch: n.epoch,
        // Its own batches' samples, shared and replayed alike (not the
        // shared samples it skipped, nor those taken back to replay).
        samples: conn.cut.samples() + conn.replay_cut.samples(),
        wait_s: secs(conn.wait_ns, conn.mailbox_totals.wait_ns),
        busy_s: secs(conn.busy_ns, conn.mailbox_totals.busy_ns),
        hold_s: secs(conn.hold_ns, conn.mailbox_totals.hold_ns),
        device: conn
            .gpu
            .and_then(|k| inner.mirrors.get(&k))
            .map(|m| m.mirror.label().to_string()),
        connected_s: connected.as_secs_f64(),
        left: None,
        replayed: conn.replayed,
        replay_cpu_s: conn.replay_cpu.as_secs_f64(),
        cuts: conn.cuts,
    })
}

/// Counts a consumer's own batches in the samples it was sent, epoch by
/// epoch (each epoch's last batch short, or dropped with `drop_last`), as
/// its client cuts them: stats show batches in its own size.
#[derive(Debug, Clone)]
pub(super) struct Cut {
    size: u64,
    drop_last: bool,
    /// Batches and samples of epochs no longer kept below.
    done: u64,
    done_samples: u64,
    /// Per recent epoch: the first sample counted and how many.
    epochs: BTreeMap<u64, (u64, u64)>,
    /// Samples before this position are not its (its client gives them
    /// back unread: they were replayed, or it resumes past them).
    skip: Option<Position>,
}

/// Epochs a [`Cut`] keeps apart (a rewind reaches back at most a ring of
/// units, and a stream's epochs hold at least one each).
const CUT_EPOCHS: usize = 4096;

impl Cut {
    pub(super) fn new(size: u64, drop_last: bool) -> Cut {
        Cut {
            size: size.max(1),
            drop_last,
            done: 0,
            done_samples: 0,
            epochs: BTreeMap::new(),
            skip: None,
        }
    }

    /// Counts only samples from `skip` on.
    pub(super) fn skipping(mut self, skip: Option<Position>) -> Cut {
        self.skip = skip;
        self
    }

    /// `samples` samples of `epoch` from sample `first` on.
    pub(super) fn add(&mut self, epoch: u64, first: u64, samples: u64) {
        let (mut first, mut samples) = (first, samples);
        if let Some(skip) = self.skip {
            if epoch < skip.epoch {
                return;
            }
            if epoch == skip.epoch && first < skip.sample {
                samples = samples.saturating_sub(skip.sample - first);
                first = skip.sample;
            }
        }
        let e = self.epochs.entry(epoch).or_insert((first, 0));
        e.1 += samples;
        if self.epochs.len() > CUT_EPOCHS
            && let Some((_, (_, n))) = self.epochs.pop_first()
        {
            self.done += self.of(n);
            self.done_samples += self.kept(n);
        }
    }

    /// Samples from `at` on were not its after all (decoupled pace: they
    /// were taken back, and come replayed).
    pub(super) fn rewind(&mut self, at: Position) {
        self.epochs.retain(|&e, _| e <= at.epoch);
        if let Some((first, n)) = self.epochs.get_mut(&at.epoch) {
            *n = (*n).min(at.sample.saturating_sub(*first));
        }
    }

    /// Starts counting again from `skip` (it merged back there).
    pub(super) fn resume_at(&mut self, skip: Position) {
        self.skip = Some(skip);
    }

    fn of(&self, samples: u64) -> u64 {
        if self.drop_last {
            samples / self.size
        } else {
            samples.div_ceil(self.size)
        }
    }

    /// Its batches so far: the current epoch's counted as if it ended now.
    pub(super) fn batches(&self) -> u64 {
        self.done + self.epochs.values().map(|&(_, n)| self.of(n)).sum::<u64>()
    }

    /// The samples of those batches (a dropped short one's not counted).
    pub(super) fn samples(&self) -> u64 {
        self.done_samples
            + self
                .epochs
                .values()
                .map(|&(_, n)| self.kept(n))
                .sum::<u64>()
    }

    /// Of `samples` of one epoch, those in its batches.
    fn kept(&self, samples: u64) -> u64 {
        if self.drop_last {
            samples / self.size * self.size
        } else {
            samples
        }
    }
}
