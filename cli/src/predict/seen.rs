//! What doctor's model reads: a stream's rates from two stats replies,
//! and from `/proc` the CPU of the broker, of the trainers' processes and
//! of the fetching threads, and the pipeline threads' run-queue wait.

use batchcast::proto::{ConsumerStats, StatsReply, StreamStats};

use super::{Inputs, Remote};

/// CPU seconds the broker and the trainers' processes had used when
/// `doctor` read the stats (from `/proc`: this host's processes only; a
/// consumer in another PID namespace reports a PID that means nothing
/// here and is left out).
#[derive(Debug, Clone, Default)]
pub struct CpuSeen {
    pub broker: Option<f64>,
    pub trainers: std::collections::HashMap<u32, f64>,
    /// Per stream: its pipeline threads' waits for a core, so far.
    pub run_queue: std::collections::HashMap<String, f64>,
    /// The broker's remote fetching threads' CPU, so far.
    pub fetch: Option<f64>,
}

impl CpuSeen {
    /// Reads the CPU of `reply`'s broker and of its consumers' processes.
    pub fn read(reply: &StatsReply) -> Self {
        use batchcast_cli::procstat::{
            REMOTE_THREADS, cpu_seconds, named_threads, pipeline_threads,
        };
        let trainers = reply
            .streams
            .iter()
            .flat_map(|s| &s.consumers)
            .filter_map(|c| Some((c.pid, cpu_seconds(c.pid)?)))
            .collect();
        let run_queue = reply
            .streams
            .iter()
            .filter_map(|s| {
                let t = named_threads(reply.broker_pid, &pipeline_threads(&s.name))?;
                Some((s.name.clone(), t.run_queue_s))
            })
            .collect();
        CpuSeen {
            broker: cpu_seconds(reply.broker_pid),
            trainers,
            run_queue,
            fetch: named_threads(reply.broker_pid, REMOTE_THREADS).map(|t| t.cpu_s),
        }
    }
}

/// CPU seconds outside every stream's pipeline threads over an interval:
/// the broker's other threads, and the trainers of one stream.
#[derive(Debug, Clone, Copy, Default)]
pub struct OtherCpu {
    /// The broker's CPU outside the pipeline threads, all streams.
    pub broker: Option<f64>,
    /// Per stream: its trainers' processes.
    pub trainers: Option<f64>,
    /// Per stream: its pipeline threads' waits for a core (run queue).
    pub run_queue: Option<f64>,
    /// The broker's fetching threads (remote stores; all streams), part
    /// of `broker`.
    pub fetch: Option<f64>,
}

/// The broker's and `s`'s trainers' CPU between two readings.
pub fn other_cpu(
    before: &CpuSeen,
    after: &CpuSeen,
    reply: (Option<&StatsReply>, &StatsReply),
    s: &StreamStats,
) -> OtherCpu {
    let pipelines = |r: Option<&StatsReply>| {
        r.map_or(0.0, |r| {
            r.streams
                .iter()
                .map(|s| s.pipeline_cpu_s + s.replay_cpu_s)
                .sum::<f64>()
        })
    };
    let broker = match (before.broker, after.broker) {
        (Some(b), Some(a)) => {
            Some((a - b - (pipelines(Some(reply.1)) - pipelines(reply.0))).max(0.0))
        }
        _ => None,
    };
    let mut pids: Vec<u32> = s.consumers.iter().map(|c| c.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    let seen: Vec<f64> = pids
        .iter()
        .filter_map(|p| Some(after.trainers.get(p)? - before.trainers.get(p)?))
        .collect();
    let q = |c: &CpuSeen| c.run_queue.get(&s.name).copied();
    OtherCpu {
        broker,
        trainers: (!seen.is_empty() && seen.len() == pids.len()).then(|| seen.iter().sum()),
        run_queue: q(after).zip(q(before)).map(|(a, b)| (a - b).max(0.0)),
        fetch: after.fetch.zip(before.fetch).map(|(a, b)| (a - b).max(0.0)),
    }
}

/// The model's inputs for stream `s` between `before` (`None`: its start)
/// and now, over `dt` seconds; `other`: CPU outside its pipeline,
/// `share`: its part of the broker's (its share of the images made).
pub fn inputs(
    before: Option<&StreamStats>,
    s: &StreamStats,
    dt: f64,
    (cores, stall): (f64, f64),
    other: OtherCpu,
    share: f64,
) -> Inputs {
    let src = |x: Option<&StreamStats>| {
        x.and_then(|x| x.source.as_ref())
            .map_or((0, [0.0; 4], 0, 0), |x| {
                let t = x.stages;
                (
                    x.decoded,
                    [t.read_s, t.decode_s, t.transform_s, t.read_cpu_s],
                    x.cache_hits,
                    x.cache_misses,
                )
            })
    };
    let (d0, t0, h0, m0) = src(before);
    let (d1, t1, h1, m1) = src(Some(s));
    let images = if s.source.is_some() {
        d1.saturating_sub(d0) as f64
    } else {
        // A synthetic stream: its batches' samples.
        let batches = s.batches_produced - before.map_or(0, |b| b.batches_produced);
        batches as f64 * stream_batch(s)
    };
    let per = |x: f64| x / images.max(1.0);
    // A trainer that read and hardly worked wants data as fast as it
    // comes: its demand is no bound (1e12 images/s).
    let mut demands: Vec<f64> = trainers(s)
        .filter_map(|c| {
            let was = before.and_then(|b| trainers(b).find(|p| p.id == c.id));
            let samples = c.samples.saturating_sub(was.map_or(0, |p| p.samples));
            let busy = c.busy_s - was.map_or(0.0, |p| p.busy_s);
            (samples > 0).then(|| (samples as f64 / busy.max(1e-12)).min(1e12))
        })
        .collect();
    demands.sort_by(f64::total_cmp);
    let hits = h1.saturating_sub(h0) as f64;
    let looked = hits + m1.saturating_sub(m0) as f64;
    let cpu = s.pipeline_cpu_s - before.map_or(0.0, |b| b.pipeline_cpu_s);
    let remote = s.source.as_ref().and_then(|x| x.remote.as_ref());
    let was_remote = before.and_then(|b| b.source.as_ref()?.remote.as_ref());
    Inputs {
        images_s: images / dt.max(1e-9),
        trainers: demands.len(),
        demand: demands.get(demands.len() / 2).copied().unwrap_or(0.0),
        workers: crate::doctor::working(s),
        workers_cap: s.workers_auto.then_some(s.workers),
        cores,
        cpu: per(cpu),
        wall: [per(t1[0] - t0[0]), per(t1[1] - t0[1]), per(t1[2] - t0[2])],
        read_cpu: per(t1[3] - t0[3]),
        core_wait: other.run_queue.map(per),
        fetch_cpu: other
            .fetch
            .filter(|_| remote.is_some())
            .map(|f| per(f * share)),
        stall,
        broker_other: other.broker.map(|b| per(b * share)),
        trainers_cpu: other.trainers.map(per),
        image_bytes: s.slot_bytes as f64 / stream_batch(s).max(1.0),
        remote: remote.map(|r| Remote {
            requests: r.concurrency,
            ahead_hits: r.ahead_hits - was_remote.map_or(0, |w| w.ahead_hits),
            direct: r.direct - was_remote.map_or(0, |w| w.direct),
        }),
        cache_hits: if looked > 0.0 { hits / looked } else { 0.0 },
        decoded_cache: keeps_its_images(s),
        gpu_consumers: trainers(s).any(|c| c.device.is_some()),
    }
}

/// Whether the stream keeps its decoded images: a cache not full (a full
/// MinIO cache holds only part of them, as one the broker sized within
/// its budget may).
fn keeps_its_images(s: &StreamStats) -> bool {
    s.source
        .as_ref()
        .and_then(|x| x.decoded_cache.as_ref())
        .is_some_and(|k| (k.bytes as f64) < 0.95 * k.budget as f64)
}

/// A stream's consumers, those still there and those that left.
pub fn trainers(s: &StreamStats) -> impl Iterator<Item = &ConsumerStats> {
    s.consumers.iter().chain(&s.past_consumers)
}

/// Samples in one of the stream's batches: its consumers' samples over
/// the stream's batches (units) they were sent, whatever their own batch
/// size.
fn stream_batch(s: &StreamStats) -> f64 {
    let (samples, units) =
        trainers(s).fold((0u64, 0u64), |(a, b), c| (a + c.samples, b + c.delivered));
    if units == 0 {
        0.0
    } else {
        samples as f64 / units as f64
    }
}
