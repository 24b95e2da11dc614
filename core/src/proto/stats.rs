//! What `batchcast stats` and the launcher read: the broker's snapshot of
//! its streams, consumers, memory and connections.

use serde::{Deserialize, Serialize};

use super::Taken;

/// A snapshot of what the broker is doing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatsReply {
    pub broker_pid: u32,
    pub broker_version: String,
    pub uptime_s: f64,
    pub streams: Vec<StreamStats>,
    /// Producer registrations waiting for their first `Acquire`: not yet
    /// open to consumers, but holding their arenas.
    pub pending: Vec<PendingStream>,
    pub memory: MemoryStats,
    pub connections: ConnectionStats,
    /// Streams and registrations left out of this reply to keep it within
    /// [`MAX_STATS_BYTES`] (protocol 14; see [`StatsReply::fit`]).
    pub streams_left_out: u32,
    pub pending_left_out: u32,
}

/// The largest stats reply a broker sends, encoded: well inside a frame
/// ([`super::MAX_FRAME`]), whatever its clients are called or how many
/// came and went.
pub const MAX_STATS_BYTES: usize = 768 << 10;

impl StatsReply {
    /// Shrinks the reply until it encodes in at most `limit` bytes, and
    /// says what it left out: first the oldest departed consumers (a
    /// stream's `departed` still counts them all), then connected
    /// consumers beyond the first (`consumers_left_out`), then pending
    /// registrations, then streams. So a reply always fits, and nothing is
    /// dropped without a count. Whether anything was left out.
    pub fn fit(&mut self, limit: usize) -> bool {
        // Counted, not encoded: the reply is encoded once, to be sent.
        let fits = |r: &StatsReply| {
            postcard::serialize_with_flavor(r, postcard::ser_flavors::Size::default())
                .is_ok_and(|n| n <= limit)
        };
        if fits(self) {
            return false;
        }
        let most_past = self.streams.iter().map(|s| s.past_consumers.len()).max();
        let mut keep = most_past.unwrap_or(0);
        while keep > 0 && !fits(self) {
            keep /= 2;
            for s in &mut self.streams {
                let n = s.past_consumers.len().saturating_sub(keep);
                s.past_consumers.drain(..n); // the oldest first
            }
        }
        let most = self.streams.iter().map(|s| s.consumers.len()).max();
        let mut keep = most.unwrap_or(0);
        while keep > 0 && !fits(self) {
            keep /= 2;
            for s in &mut self.streams {
                let n = s.consumers.len().saturating_sub(keep);
                s.consumers.truncate(keep);
                s.consumers_left_out += n as u32;
            }
        }
        while !self.pending.is_empty() && !fits(self) {
            let keep = self.pending.len() / 2;
            self.pending_left_out += (self.pending.len() - keep) as u32;
            self.pending.truncate(keep);
        }
        while !self.streams.is_empty() && !fits(self) {
            let keep = self.streams.len() / 2;
            self.streams_left_out += (self.streams.len() - keep) as u32;
            self.streams.truncate(keep);
        }
        true
    }
}

/// A producer's stream between `Registered` and its first `Acquire`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingStream {
    pub name: String,
    pub producer: String,
    pub pid: u32,
    pub uid: u32,
    pub arena_bytes: u64,
    pub waiting_s: f64,
}

/// The broker's memory budget and what holds it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryStats {
    pub budget_bytes: u64,
    pub used_bytes: u64,
    pub arenas_bytes: u64,
    pub gpu_arenas_bytes: u64,
    pub mailboxes_bytes: u64,
    /// Reserved up front: every connection's largest frame.
    pub frame_buffers_bytes: u64,
    /// Replay arenas (`join = "now"`, resumed consumers).
    pub replay_bytes: u64,
    /// Allocations refused for not fitting, since start.
    pub refused: u64,
}

/// Connections held, by uid (largest first), and refused since start.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConnectionStats {
    pub held: u32,
    pub max: u32,
    /// Refused at accept (the allow list, connection limits), since start.
    pub refused: u64,
    pub by_uid: Vec<(u32, u32)>,
    /// Admitted, then refused at the handshake (a preamble of another
    /// protocol or none, no hello in time), since start (protocol 14).
    pub handshakes_refused: u64,
    /// Admitted, then refused at any point (the handshake's included: a
    /// bad name, an unknown stream, a request the stream refuses), since
    /// start. The broker logs at most a few of these every 10 s.
    pub requests_refused: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamStats {
    pub name: String,
    pub slots: u32,
    pub slot_bytes: u64,
    pub free_slots: u32,
    /// Slots being filled by the pipeline.
    pub filling: u32,
    /// Slots published and still owed to or held by a consumer.
    pub in_use: u32,
    pub batches_produced: u64,
    /// The epoch of the most recently published batch.
    pub epoch: u64,
    pub finished: bool,
    /// Batch deliveries summed over all consumers, past and present.
    pub deliveries: u64,
    /// Consumers that left (disconnected, died or detached).
    pub departed: u64,
    /// Consumers detached for exceeding the lag limit.
    pub detached: u64,
    /// Times the ring moved to another region of the host arena, away
    /// from batches stopped consumers held past the hold limit, and the
    /// batches still held in regions it left (protocol 27).
    #[serde(default)]
    pub ring_moves: u64,
    #[serde(default)]
    pub held_behind: u64,
    /// Seconds the pipeline waited for a free slot (back-pressure).
    pub producer_blocked_s: f64,
    /// CPU seconds of the pipeline threads (filling slots, and their share
    /// of the bookkeeping); read every 10 ms of a busy pipeline. Replay
    /// is not in it: see `replay_cpu_s`.
    pub pipeline_cpu_s: f64,
    /// CPU seconds the pipeline threads spent replaying batches for single
    /// consumers (every consumer's, those gone included).
    pub replay_cpu_s: f64,
    /// Pipeline threads (0 for a producer's stream; protocol 23).
    pub workers: u32,
    /// Image sources only.
    pub source: Option<SourceStats>,
    /// External streams: who produces them.
    pub producer: Option<String>,
    /// Image streams: this broker's share of the dataset, `(rank,
    /// world_size)`, and the samples of it an epoch (protocol 16).
    pub share: Option<(u64, u64, u64)>,
    /// The uid the stream belongs to (see [`Welcome::owner_uid`](super::Welcome::owner_uid)).
    pub owner_uid: u32,
    /// Why the stream stopped, if its source or producer failed.
    pub failed: Option<String>,
    /// One entry per GPU this stream copies to.
    pub gpus: Vec<GpuCopyStats>,
    pub consumers: Vec<ConsumerStats>,
    /// Connected consumers left out of `consumers` to keep the reply
    /// within [`MAX_STATS_BYTES`] (protocol 14).
    pub consumers_left_out: u32,
    /// Consumers that have left, with their final numbers (the most recent
    /// [`PAST_CONSUMERS`], fewer where the reply had to shrink: `departed`
    /// counts them all).
    pub past_consumers: Vec<ConsumerStats>,
    /// Of `workers`, the pipeline threads working now, and whether that
    /// number follows the trainers' demand (`workers` left out; protocol
    /// 28). (Missing from an older run's summary: 0, fixed.)
    #[serde(default)]
    pub workers_active: u32,
    #[serde(default)]
    pub workers_auto: bool,
}

/// How many departed consumers a stream's stats remember.
pub const PAST_CONSUMERS: usize = 256;

/// The broker's host-to-device copies of one stream to one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuCopyStats {
    pub gpu: String,
    /// Batches copied: one per batch published while the GPU had
    /// consumers, however many consumers it has.
    pub copies: u64,
    pub bytes: u64,
    /// GPU seconds of these copies (CUDA events around each); `bytes /
    /// copy_s` is the bandwidth of the broker's copy path.
    pub copy_s: f64,
    /// Whether the host arena is page-locked (else copies are staged by
    /// the driver and slower).
    pub pinned: bool,
    /// Device slots, and how many hold a batch (being copied, or owed to a
    /// consumer).
    pub slots: u32,
    pub slots_in_use: u32,
    /// Batches whose copy waits for a free device slot (their host slots
    /// stay pinned meanwhile).
    pub waiting: u32,
    /// Replayed batches copied to their consumers' own arenas on this GPU
    /// (protocol 21): one per batch replayed to a device consumer, not in
    /// `copies`.
    pub replayed: u64,
}

/// What an image source has done so far.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceStats {
    /// Images written into slots (on a shared source, some decoded by
    /// another stream: see `shared`).
    pub decoded: u64,
    /// Samples replaced because their file was bad (once per epoch each).
    pub skipped: u64,
    /// JPEGs decoded at reduced size.
    pub reduced: u64,
    /// JPEGs decoded in part, only where a crop reads (protocol 25).
    /// (Missing from an older run's summary: 0.)
    #[serde(default)]
    pub in_part: u64,
    /// Of those, JPEGs cut out of their file at their restart markers
    /// (protocol 25): only the MCUs around the crop entropy-decoded (a
    /// dataset `batchcast prepare` copied).
    #[serde(default)]
    pub cut: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub cache_bytes: u64,
    pub cache_items: u64,
    /// 0 when the cache is off.
    pub cache_budget: u64,
    /// A stream on a shared source (protocol 12).
    pub shared: Option<SharedSourceStats>,
    /// A dataset in an object store or on an HTTP server (protocol 17).
    pub remote: Option<RemoteSourceStats>,
    /// The cache of decoded images, if on (protocol 22).
    pub decoded_cache: Option<DecodedCacheStats>,
    /// Where the pipeline threads' time went (protocol 23).
    pub stages: StageStats,
    /// What the broker chose for the caches the config left out
    /// (`cache_mib`, `decoded_cache_mib`), and why (protocol 28). (Missing
    /// from an older run's summary: none.)
    #[serde(default)]
    pub caches_chosen: Option<String>,
}

/// Seconds an image stream's pipeline threads spent in each stage, summed
/// over the threads (protocol 23). Wall time: a read waiting for a remote
/// store counts as reading. Per image: divide by `decoded`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StageStats {
    /// Reading the file (the cache of encoded bytes, a remote store) and
    /// its header.
    pub read_s: f64,
    pub decode_s: f64,
    /// Crop, resize, augmentations and the tensor written into its slot.
    pub transform_s: f64,
    /// The CPU time of `read_s` (protocol 24): the rest of it waited for
    /// bytes (a remote store, a disk) or for a core. (Missing from an
    /// older run's summary: 0.)
    #[serde(default)]
    pub read_cpu_s: f64,
}

/// A source's cache of decoded images (`decoded_cache_mib`, protocol 22):
/// a lookup per sample made, a hit where the image was kept.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DecodedCacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Bytes and images kept, and the bytes it may keep.
    pub bytes: u64,
    pub items: u64,
    pub budget: u64,
}

/// How a remote dataset's bytes arrive (protocol 17). Its URL never holds
/// a credential (those are refused in URLs).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RemoteSourceStats {
    pub url: String,
    /// Requests sent (retries included), and bytes received.
    pub requests: u64,
    pub bytes: u64,
    pub retries: u64,
    /// Answers of 429 or 503 (SlowDown): each halves `concurrency`.
    pub throttled: u64,
    /// Reads that failed for good (then `on_error` decided).
    pub failed: u64,
    pub in_flight: u64,
    /// Requests allowed at once now (AIMD, at most `requests`).
    pub concurrency: u32,
    /// The longest one read took, retries included.
    pub longest_s: f64,
    /// Time the pipeline waited for bytes still on their way.
    pub waited_s: f64,
    /// Reads served from the read-ahead window, and read directly.
    pub ahead_hits: u64,
    pub direct: u64,
    /// Samples (objects, tar members) and bytes the window holds now.
    pub ahead_units: u64,
    pub ahead_bytes: u64,
    pub last_error: Option<String>,
    /// The disk tier (`cache_dir`), if on.
    pub disk_hits: u64,
    pub disk_misses: u64,
    pub disk_bytes: u64,
    pub disk_budget: u64,
    pub disk_corrupt: u64,
    pub disk_write_errors: u64,
}

/// A shared source, as one of its streams sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedSourceStats {
    /// The `[[source]]`'s name.
    pub source: String,
    /// Streams on the source.
    pub streams: u32,
    /// Decodes run by all of the source's streams together.
    pub decodes: u64,
    /// Images this stream took from another stream's decode.
    pub taken: u64,
    /// Seconds this stream's pipeline waited for slower streams.
    pub held_s: f64,
    /// Times this stream was let go by the others (it stopped moving, or
    /// kept them waiting too long in all) and decoded alone until it
    /// caught up: each costs up to a window of decodes made twice.
    pub let_go: u64,
    /// Decoded images left for other streams now, and their bytes.
    pub entries: u64,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConsumerStats {
    pub id: u64,
    pub name: String,
    pub pid: u32,
    pub uid: u32,
    /// Its window, in its own batches.
    pub window: u32,
    /// Its own batch size (the stream's unless it asked for another).
    pub batch_size: u64,
    /// Its own batches in what it was sent (an epoch in progress counted
    /// as if it ended there).
    pub batches: u64,
    /// The stream's batches (production units) sent to it; its own
    /// batches are cut from them.
    pub delivered: u64,
    /// Units sent and not yet released.
    pub held: u32,
    /// Units published for it but not yet sent (window full).
    pub queued: u32,
    /// Epoch of the last batch sent to it.
    pub epoch: u64,
    /// Samples in its own batches so far, shared and replayed (its
    /// `replayed` among them); may dip when decoupled pace takes back
    /// batches it had not read, which then come replayed.
    pub samples: u64,
    /// Seconds it reported being blocked waiting for data (data stall).
    pub wait_s: f64,
    /// Seconds it reported working between batches (its training steps).
    /// `wait_s / (wait_s + busy_s)` is its data-stall fraction.
    pub busy_s: f64,
    /// Seconds its batches spent between sending and release, summed.
    pub hold_s: f64,
    /// `None`: host memory; else the GPU its batches are delivered on.
    pub device: Option<String>,
    /// Connected for this long (until it left, for a past consumer).
    pub connected_s: f64,
    /// `None` while connected; else why it left (`closed`, `detached:
    /// lag limit`, …).
    pub left: Option<String>,
    /// Samples recomputed for it alone (replay), and the pipeline CPU
    /// seconds they cost.
    pub replayed: u64,
    pub replay_cpu_s: f64,
    /// Decoupled pace: how often it fell a ring behind and was cut from
    /// the shared stream (replay followed).
    pub cuts: u64,
    /// Epochs it was rotated into: read from where the shared stream was,
    /// their start replayed after their end (protocol 20,
    /// [`crate::rotation`]).
    pub rotations: u64,
    /// Its seat in a group (`name rank/world`), if it took one (protocol 16).
    pub group: Option<String>,
    /// Its client's number for it in its process (see
    /// [`ConsumeRequest::serial`](crate::proto::ConsumeRequest)).
    pub serial: u32,
    /// What its program has taken, as its client reports it (protocol
    /// 19): unlike `batches` and `samples` (what was sent to it, ahead of
    /// reading, and taken back by a cut), what the program read, carried
    /// across broker restarts. The client's own figures.
    pub taken: Taken,
}

impl ConsumerStats {
    /// Share of its loop time the consumer spent waiting for data.
    pub fn stall_fraction(&self) -> f64 {
        let total = self.wait_s + self.busy_s;
        if total > 0.0 {
            self.wait_s / total
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn consumer(id: u64, name: &str) -> ConsumerStats {
        ConsumerStats {
            id,
            name: name.into(),
            pid: 1,
            uid: 1,
            window: 2,
            batch_size: 64,
            batches: 0,
            delivered: 0,
            held: 0,
            queued: 0,
            epoch: 0,
            samples: 0,
            wait_s: 0.0,
            busy_s: 0.0,
            hold_s: 0.0,
            device: None,
            connected_s: 0.0,
            left: Some("closed".into()),
            replayed: 0,
            replay_cpu_s: 0.0,
            cuts: 0,
            rotations: 0,
            group: None,
            serial: 0,
            taken: Taken::default(),
        }
    }

    fn stream(name: &str, connected: u64, past: u64) -> StreamStats {
        let long = "n".repeat(crate::proto::MAX_NAME_BYTES);
        StreamStats {
            name: name.into(),
            slots: 8,
            slot_bytes: 1,
            free_slots: 8,
            filling: 0,
            in_use: 0,
            batches_produced: 0,
            epoch: 0,
            finished: false,
            deliveries: 0,
            departed: past,
            detached: 0,
            ring_moves: 0,
            held_behind: 0,
            producer_blocked_s: 0.0,
            pipeline_cpu_s: 0.0,
            replay_cpu_s: 0.0,
            workers: 1,
            source: None,
            producer: None,
            share: None,
            owner_uid: 0,
            failed: None,
            gpus: Vec::new(),
            consumers: (0..connected).map(|i| consumer(i, &long)).collect(),
            consumers_left_out: 0,
            past_consumers: (0..past).map(|i| consumer(1000 + i, &long)).collect(),
            workers_active: 1,
            workers_auto: true,
        }
    }

    fn reply(streams: Vec<StreamStats>) -> StatsReply {
        StatsReply {
            broker_pid: 1,
            broker_version: "0".into(),
            uptime_s: 0.0,
            streams,
            pending: Vec::new(),
            memory: MemoryStats::default(),
            connections: ConnectionStats::default(),
            streams_left_out: 0,
            pending_left_out: 0,
        }
    }

    fn len(r: &StatsReply) -> usize {
        postcard::to_stdvec(r).unwrap().len()
    }

    #[test]
    fn a_small_reply_is_left_whole() {
        let mut r = reply(vec![stream("a", 3, 3)]);
        let before = r.clone();
        assert!(!r.fit(MAX_STATS_BYTES));
        assert_eq!(r, before);
    }

    /// Departed consumers go first (the newest kept), then connected ones
    /// (counted), then whole streams (counted): always within the limit.
    #[test]
    fn a_large_reply_shrinks_to_the_limit_and_counts_what_it_left_out() {
        let mut r = reply(vec![stream("a", 40, 256), stream("b", 40, 256)]);
        assert!(len(&r) > 64 << 10);
        assert!(r.fit(64 << 10));
        assert!(len(&r) <= 64 << 10);
        for s in &r.streams {
            assert_eq!(s.consumers.len(), 40, "connected kept while departed go");
            assert!(s.past_consumers.len() < 256);
            // The newest departed stay.
            assert_eq!(s.past_consumers.last().unwrap().id, 1000 + 255);
            assert_eq!(s.departed, 256, "departed still counts them all");
        }

        let mut r = reply(vec![stream("a", 300, 256), stream("b", 300, 256)]);
        assert!(r.fit(32 << 10));
        assert!(len(&r) <= 32 << 10);
        for s in &r.streams {
            assert!(s.past_consumers.is_empty());
            assert_eq!(s.consumers.len() as u32 + s.consumers_left_out, 300);
            assert!(s.consumers_left_out > 0);
        }

        let many: Vec<_> = (0..200).map(|i| stream(&format!("s{i}"), 1, 0)).collect();
        let mut r = reply(many);
        assert!(r.fit(8 << 10));
        assert!(len(&r) <= 8 << 10);
        assert_eq!(r.streams.len() as u32 + r.streams_left_out, 200);
    }
}
