//! What a change would buy: `batchcast doctor`'s predictions, after
//! DS-Analyzer (the CoorDL paper's tool). A stream runs at the slowest of
//! three rates, each measured or derived from what the broker and the
//! trainers report over the same interval:
//!
//! * the trainers' **demand**: images per second the median trainer would
//!   take if data never kept it waiting (an image costs it its step, its
//!   busy seconds over its samples, and the time it spends neither working
//!   nor waiting);
//! * the **pipeline threads**: `workers / (cpu + io)`, each thread making
//!   an image in its CPU time plus the time its read waits for bytes;
//! * the **host's cores**: `cores / (cpu + others)`, the pipeline's CPU
//!   and everything else batchcast runs here per image (the broker's other
//!   threads, the trainers' processes);
//! * with read-ahead, the **fetches**: requests in flight over the time
//!   one takes.
//!
//! A change moves one input (more threads; one more trainer, whose
//! process costs as much CPU per image as the others'; a cache that holds
//! the dataset, which takes the read, or the read and the decode, out of
//! the pipeline; read-ahead, which takes the waiting for bytes out of the
//! threads; GPU consumers, whose batches are copied to the GPU by the
//! broker, not in the trainer's step) and the model says the new rate,
//! the trainers' stall (`1 - rate / demand`) and what limits it then.
//!
//! The read stage's wall time splits into its CPU time (measured) and a
//! wait: for a core (as long, in proportion, as decode and transform
//! waited for one) and, the rest, for bytes.

use std::fmt::Write as _;

mod seen;

pub use seen::{CpuSeen, OtherCpu, inputs, other_cpu, trainers};

/// What the model of one stream rests on, all over the same interval;
/// seconds are per image the stream made.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Inputs {
    /// Images the stream made per second.
    pub images_s: f64,
    /// Trainers that reported, and the images per second the median one
    /// would take if it never waited (0: none reported working).
    pub trainers: usize,
    pub demand: f64,
    /// Pipeline threads working.
    pub workers: u32,
    /// With `workers` left out, the most threads the broker keeps working
    /// (`[broker] max_cpu_share`'s): it adds them itself as trainers need.
    #[serde(default)]
    pub workers_cap: Option<u32>,
    /// The host's cores (`available_parallelism`, or `doctor --cores`).
    pub cores: f64,
    /// The pipeline threads' CPU seconds (all of it: stages, collating).
    pub cpu: f64,
    /// Wall seconds in each stage: read, decode, transform.
    pub wall: [f64; 3],
    /// The read stage's CPU seconds.
    pub read_cpu: f64,
    /// Seconds the pipeline threads waited for a core (their run queue
    /// wait, from `/proc`); `None` where it could not be read.
    pub core_wait: Option<f64>,
    /// CPU seconds of the broker outside the pipeline threads (its hub,
    /// request threads), and of all the trainers' processes together;
    /// `None` where they could not be read.
    pub broker_other: Option<f64>,
    pub trainers_cpu: Option<f64>,
    /// Of `broker_other`: the threads fetching from a remote store.
    pub fetch_cpu: Option<f64>,
    /// The trainers' median data stall now (0..1).
    pub stall: f64,
    /// Bytes of one image in a batch (slot bytes over the batch size).
    pub image_bytes: f64,
    /// The stream reads a remote store: read-ahead is on.
    pub remote: Option<Remote>,
    /// Share of reads the cache of encoded bytes served, and whether the
    /// stream keeps its decoded images already (a cache not full: it holds
    /// every image offered).
    pub cache_hits: f64,
    pub decoded_cache: bool,
    /// Consumers on a GPU already.
    pub gpu_consumers: bool,
}

/// A stream's remote store, as the model sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Remote {
    /// Requests it may have in flight (the `requests` key's, or now).
    pub requests: u32,
    /// Reads served from the read-ahead window, and read directly.
    pub ahead_hits: u64,
    pub direct: u64,
}

/// A change the model can price.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(rename_all = "kebab-case", tag = "change", content = "to")]
pub enum Change {
    /// This many pipeline threads.
    Workers(u32),
    /// One more trainer reading the stream, like the median one.
    OneMoreTrainer,
    /// `cache_mib` that holds the dataset's encoded bytes.
    Cache,
    /// `decoded_cache_mib` that holds the dataset's decoded images.
    DecodedCache,
    /// Read-ahead with this many requests in flight.
    ReadAhead(u32),
    /// The trainers as GPU consumers.
    GpuConsumers,
}

/// What limits a stream's rate in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Limit {
    Trainers,
    PipelineThreads,
    HostCpu,
    Fetches,
}

impl Limit {
    pub fn says(self) -> &'static str {
        match self {
            Limit::Trainers => "the trainers",
            Limit::PipelineThreads => "the pipeline threads",
            Limit::HostCpu => "the host's cores",
            Limit::Fetches => "the fetches in flight",
        }
    }
}

/// The model's rate for one set of inputs.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Rate {
    pub images_s: f64,
    /// The trainers' data stall (0..1); `None` without a demand.
    pub stall: Option<f64>,
    pub limit: Limit,
}

/// One prediction: a change and the rate after it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Prediction {
    #[serde(flatten)]
    pub change: Change,
    /// What to set, in words.
    pub what: String,
    #[serde(flatten)]
    pub rate: Rate,
    /// What the number rests on beyond the stream's own inputs.
    pub assumes: String,
}

/// Host-to-device copy bandwidth a trainer's own `.to(device)` of a
/// pageable host batch gets (bytes/s): what a GPU consumer saves it.
pub const H2D_BYTES_S: f64 = 10e9;

/// The inputs after the model's split of the read stage.
#[derive(Debug, Clone, Copy)]
struct Terms {
    /// Pipeline CPU per image, and waiting for bytes per image.
    cpu: f64,
    io: f64,
    /// CPU per image of everything else (broker, trainers).
    others: f64,
    trainers_cpu: f64,
    workers: f64,
    cores: f64,
    demand: f64,
    /// Images per second the fetches allow (infinite without a bound).
    fetch: f64,
    /// A trainer's seconds per image neither working nor waiting (its
    /// client's own work, waiting for the other trainers' releases).
    aside: f64,
}

impl Inputs {
    /// The read stage's wait for bytes, per image: the threads' time in
    /// stages off a core and not waiting for one, at most the read's
    /// own time off a core.
    pub fn io(&self) -> f64 {
        let off = (self.wall[0] - self.read_cpu).max(0.0);
        if let Some(q) = self.core_wait {
            let wall: f64 = self.wall.iter().sum();
            return (wall - self.cpu - q).clamp(0.0, off);
        }
        // Without the run queue's figure: a read waited for a core as
        // long, in proportion, as decode and transform did.
        let work = (self.cpu - self.read_cpu).max(0.0);
        let waited = self.wall[1] + self.wall[2];
        // How much longer than its CPU a stage took waiting for a core.
        let stretch = if work > 0.0 {
            (waited / work).max(1.0)
        } else {
            1.0
        };
        (self.wall[0] - stretch * self.read_cpu).max(0.0)
    }

    /// The decode stage's share of the pipeline's CPU outside reads.
    fn decode_cpu(&self) -> f64 {
        let work = (self.cpu - self.read_cpu).max(0.0);
        let both = self.wall[1] + self.wall[2];
        if both > 0.0 {
            work * self.wall[1] / both
        } else {
            0.0
        }
    }

    fn terms(&self) -> Terms {
        let trainers_cpu = self.trainers_cpu.unwrap_or(0.0);
        Terms {
            cpu: self.cpu,
            io: self.io(),
            others: self.broker_other.unwrap_or(0.0) + trainers_cpu,
            trainers_cpu,
            workers: f64::from(self.workers.max(1)),
            cores: self.cores.max(1.0),
            demand: self.demand,
            fetch: f64::INFINITY,
            aside: self.aside(),
        }
    }

    /// A trainer's seconds per image outside its step and its waits now:
    /// `1 / rate - busy - wait`, with `busy = 1 / demand` and `wait =
    /// busy * stall / (1 - stall)`.
    fn aside(&self) -> f64 {
        if self.demand <= 0.0 || self.images_s <= 0.0 || self.stall >= 1.0 {
            return 0.0;
        }
        let busy = 1.0 / self.demand;
        let wait = busy * self.stall / (1.0 - self.stall);
        (1.0 / self.images_s - busy - wait).max(0.0)
    }

    /// The model's rate now, uncalibrated: what the measured rate checks
    /// it against.
    pub fn now(&self) -> Rate {
        self.terms().rate(1.0, Limit::Trainers)
    }

    /// Measured over modelled rate now: what the bound that limits now
    /// leaves out (trainers in lockstep waiting for each other, the
    /// pipeline's work outside its stages), carried to the same bound
    /// after a change.
    pub fn calibration(&self) -> f64 {
        self.calibrated(self.now())
    }

    fn calibrated(&self, now: Rate) -> f64 {
        if self.images_s > 0.0 && now.images_s.is_finite() && now.images_s > 0.0 {
            self.images_s / now.images_s
        } else {
            1.0
        }
    }

    /// The rate after `change`, the bound that limits now scaled by
    /// [`Inputs::calibration`].
    pub fn after(&self, change: Change) -> Rate {
        let mut t = self.terms();
        match change {
            Change::Workers(n) => t.workers = f64::from(n.max(1)),
            Change::OneMoreTrainer => {
                let n = self.trainers.max(1) as f64;
                t.others += t.trainers_cpu / n;
            }
            Change::Cache => {
                t.cpu -= self.read_cpu;
                t.others -= self.fetch_cpu.unwrap_or(0.0);
                t.io = 0.0;
            }
            Change::DecodedCache => {
                t.cpu -= self.read_cpu + self.decode_cpu();
                t.others -= self.fetch_cpu.unwrap_or(0.0);
                t.io = 0.0;
            }
            Change::ReadAhead(requests) => {
                // Each request takes what a direct read took; the
                // pipeline threads no longer wait for it.
                let one = self.wall[0].max(1e-9);
                t.fetch = f64::from(requests.max(1)) / one;
                t.io = 0.0;
            }
            Change::GpuConsumers => {
                if t.demand > 0.0 {
                    let step = 1.0 / t.demand - self.image_bytes / H2D_BYTES_S;
                    t.demand = 1.0 / step.max(1e-9);
                }
            }
        }
        t.cpu = t.cpu.max(1e-9);
        let now = self.now();
        t.rate(self.calibrated(now), now.limit)
    }

    /// The changes worth pricing for this stream, with their words.
    pub fn predictions(&self) -> Vec<Prediction> {
        let mut out = Vec::new();
        let mut add = |change: Change, what: String, assumes: &str| {
            out.push(Prediction {
                change,
                what,
                rate: self.after(change),
                assumes: assumes.to_string(),
            });
        };
        let n = self.workers + 1;
        add(
            Change::Workers(n),
            match self.workers_cap {
                None => format!("workers = {n}"),
                Some(cap) if n > cap => {
                    format!(
                        "[broker] max_cpu_share for {n} threads (now up to {cap} work as trainers need)"
                    )
                }
                Some(cap) => {
                    format!("{n} threads working (the broker adds them itself, up to {cap})")
                }
            },
            "each thread as fast as now when it has a core",
        );
        if self.trainers > 0 {
            add(
                Change::OneMoreTrainer,
                format!("{} trainers", self.trainers + 1),
                "the new trainer steps like the median one and its process costs as much CPU per image as the others'",
            );
        }
        if self.wall[0] > 0.0 && self.cache_hits < 0.9 && !self.decoded_cache {
            add(
                Change::Cache,
                "cache_mib that holds the dataset".into(),
                "later epochs: every read from memory, at no cost, no request to a store",
            );
        }
        if self.wall[1] > 0.0 && !self.decoded_cache {
            add(
                Change::DecodedCache,
                "decoded_cache_mib that holds the dataset".into(),
                "later epochs: no read, no decode; the transform as now",
            );
        }
        if let Some(r) = self.remote
            && r.direct > r.ahead_hits
        {
            let requests = r.requests.max(128);
            add(
                Change::ReadAhead(requests),
                format!("read-ahead on, requests = {requests}"),
                "a request as slow as a direct read is now, however many are in flight; bandwidth to spare",
            );
        }
        if self.demand > 0.0 && !self.gpu_consumers && self.image_bytes > 0.0 {
            add(
                Change::GpuConsumers,
                "the trainers as GPU consumers (device=)".into(),
                "the trainers copy each batch to their GPU inside their step at 10 GB/s; not checked here (no GPU)",
            );
        }
        out
    }

    /// The inputs in a line, for the evidence.
    pub fn describe(&self) -> String {
        let ms = |s: f64| format!("{:.3}", 1e3 * s);
        let mut out = format!(
            "demand {:.0} images/s; per image: pipeline CPU {} ms, read {} ms ({} on a CPU, {} waiting for bytes), waiting for a core {}",
            self.demand,
            ms(self.cpu),
            ms(self.wall[0]),
            ms(self.read_cpu),
            ms(self.io()),
            self.core_wait
                .map_or("not measured".into(), |q| format!("{} ms", ms(q))),
        );
        match (self.broker_other, self.trainers_cpu) {
            (Some(b), Some(t)) => {
                let _ = write!(
                    out,
                    ", broker otherwise {} ms, trainers {} ms",
                    ms(b),
                    ms(t)
                );
            }
            _ => out.push_str(", other CPU not measured"),
        }
        let _ = write!(out, "; {:.0} cores", self.cores);
        out
    }
}

impl Terms {
    /// The slowest bound, `scaled`'s multiplied by `by`.
    fn rate(&self, by: f64, scaled: Limit) -> Rate {
        // A trainer's pace when it never waits: its step and its time
        // aside.
        let demand = if self.demand > 0.0 {
            1.0 / (1.0 / self.demand + self.aside)
        } else {
            f64::INFINITY
        };
        let bounds = [
            (demand, Limit::Trainers),
            (self.workers / (self.cpu + self.io), Limit::PipelineThreads),
            (self.cores / (self.cpu + self.others), Limit::HostCpu),
            (self.fetch, Limit::Fetches),
        ];
        let (images_s, limit) = bounds
            .into_iter()
            .map(|(r, l)| (if l == scaled { r * by } else { r }, l))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .expect("four bounds");
        // The trainers wait whatever of an image's time their step and
        // their time aside leave.
        let stall = (self.demand > 0.0).then(|| {
            let busy = 1.0 / self.demand;
            let wait = (1.0 / images_s - busy - self.aside).max(0.0);
            wait / (wait + busy)
        });
        Rate {
            images_s,
            stall,
            limit,
        }
    }
}

/// A prediction in a line.
pub fn line(p: &Prediction, now: f64) -> String {
    let stall = p.rate.stall.map_or(String::new(), |s| {
        format!(", trainers waiting {:.0} %", 100.0 * s)
    });
    format!(
        "{}: {:.0} images/s ({:+.0} %){stall}; then {} limit it (assumes {})",
        p.what,
        p.rate.images_s,
        100.0 * (p.rate.images_s / now.max(1e-9) - 1.0),
        p.rate.limit.says(),
        p.assumes
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: f64, want: f64) -> bool {
        (got - want).abs() <= 1e-6 * want.abs().max(1.0)
    }

    /// Recorded by `bench/predict.py`'s decode-bound scenario (1 pipeline
    /// thread, 2 trainers that never sleep, 2 cores).
    fn decode_bound() -> Inputs {
        Inputs {
            images_s: 1633.3,
            trainers: 2,
            demand: 3.5e6,
            workers: 1,
            workers_cap: None,
            cores: 2.0,
            cpu: 611e-6,
            wall: [20.8e-6, 387.1e-6, 195.5e-6],
            read_cpu: 22e-6,
            core_wait: Some(5e-6),
            broker_other: Some(2e-6),
            trainers_cpu: Some(4e-6),
            stall: 0.9999,
            image_bytes: 602_112.0,
            ..Inputs::default()
        }
    }

    #[test]
    fn more_threads_on_a_decode_bound_stream_meet_the_hosts_cores() {
        let i = decode_bound();
        // Its stages spent less than their CPU off a core: no read waits.
        assert_eq!(i.io(), 0.0);
        let now = i.now();
        assert_eq!(now.limit, Limit::PipelineThreads);
        assert!(close(now.images_s, 1.0 / 611e-6), "{now:?}");
        assert!(close(i.calibration(), 1633.3 * 611e-6));
        // Two threads: 2 / 611 µs (3273/s, scaled by 0.998) against the
        // cores: 2 / (611 + 2 + 4 µs) = 3241/s, the lower.
        let two = i.after(Change::Workers(2));
        assert_eq!(two.limit, Limit::HostCpu);
        assert!(close(two.images_s, 2.0 / 617e-6), "{two:?}");
        // One more trainer costs 2 µs of CPU an image: the thread still
        // limits it, at today's measured rate.
        let three = i.after(Change::OneMoreTrainer);
        assert_eq!(three.limit, Limit::PipelineThreads);
        assert!(close(three.images_s, 1633.3), "{three:?}");
        // A decoded cache leaves the transform: 611 - 22 - 589 × 387 /
        // 583 µs of CPU an image, for the one thread.
        let kept = i.after(Change::DecodedCache);
        let left = 611e-6 - 22e-6 - 589e-6 * 387.1 / 582.6;
        assert_eq!(kept.limit, Limit::PipelineThreads);
        assert!(close(kept.images_s, i.calibration() / left), "{kept:?}");
    }

    /// The I/O-bound scenario: 2 threads reading over HTTP with a 20 ms
    /// round trip, no read-ahead.
    fn io_bound() -> Inputs {
        Inputs {
            images_s: 80.0,
            trainers: 2,
            demand: 5e5,
            workers: 2,
            workers_cap: None,
            cores: 2.0,
            cpu: 1.3e-3,
            wall: [23.5e-3, 0.4e-3, 0.2e-3],
            read_cpu: 0.7e-3,
            core_wait: Some(0.01e-3),
            broker_other: Some(0.05e-3),
            trainers_cpu: Some(0.01e-3),
            stall: 0.9999,
            remote: Some(Remote {
                requests: 128,
                ahead_hits: 0,
                direct: 400,
            }),
            ..Inputs::default()
        }
    }

    #[test]
    fn an_io_bound_stream_gains_threads_until_the_bytes_stop_waiting() {
        let i = io_bound();
        // In stages 24.1 ms, on a core 1.3, waiting for one 0.01: 22.79
        // ms waiting for bytes.
        assert!(close(i.io(), 22.79e-3), "{}", i.io());
        let now = i.now();
        assert_eq!(now.limit, Limit::PipelineThreads);
        let model = 2.0 / (1.3e-3 + 22.79e-3);
        assert!(close(now.images_s, model));
        // A third thread: half as much again, on the measured 80.
        let three = i.after(Change::Workers(3));
        assert!(close(three.images_s, 120.0), "{three:?}");
        // A cache: the read's CPU and wait gone; 2 threads at 0.6 ms (the
        // calibration 80 / model with them) or the cores at 0.66 ms.
        let cached = i.after(Change::Cache);
        let threads = 2.0 / 0.6e-3 * 80.0 / model;
        let cores = 2.0 / 0.66e-3;
        assert!(close(cached.images_s, threads.min(cores)), "{cached:?}");
        // Read-ahead: 128 requests of 23.5 ms each, 5447/s, more than the
        // cores allow at 1.36 ms an image (1471/s).
        let ahead = i.after(Change::ReadAhead(128));
        assert_eq!(ahead.limit, Limit::HostCpu);
        assert!(close(ahead.images_s, 2.0 / 1.36e-3), "{ahead:?}");
        let few = i.after(Change::ReadAhead(4));
        assert_eq!(few.limit, Limit::Fetches);
        assert!(close(few.images_s, 4.0 / 23.5e-3), "{few:?}");
        // Its predictions: threads, trainers, both caches, read-ahead, GPU
        // consumers (no batch bytes known: not priced).
        let what: Vec<_> = i.predictions().iter().map(|p| p.change).collect();
        assert_eq!(
            what,
            [
                Change::Workers(3),
                Change::OneMoreTrainer,
                Change::Cache,
                Change::DecodedCache,
                Change::ReadAhead(128)
            ]
        );
    }

    #[test]
    fn a_trainer_bound_stream_stays_at_its_trainers_pace() {
        // 2 trainers sleeping 50 ms a batch of 32: 664 images per busy
        // second, 592 measured (they also wait for each other).
        let i = Inputs {
            images_s: 592.0,
            trainers: 2,
            demand: 664.0,
            workers: 2,
            workers_cap: None,
            cores: 2.0,
            cpu: 0.62e-3,
            wall: [0.02e-3, 0.4e-3, 0.2e-3],
            read_cpu: 0.02e-3,
            core_wait: Some(0.0),
            broker_other: Some(0.01e-3),
            trainers_cpu: Some(0.02e-3),
            image_bytes: 602_112.0,
            ..Inputs::default()
        };
        assert_eq!(i.now().limit, Limit::Trainers);
        let three = i.after(Change::OneMoreTrainer);
        assert_eq!(three.limit, Limit::Trainers);
        assert!(close(three.images_s, 592.0), "{three:?}");
        // They reported no wait: the 0.18 ms an image beyond their step
        // is their own (their client, each other's releases), not a stall.
        assert!(close(three.stall.unwrap(), 0.0), "{three:?}");
        // More threads buy nothing.
        assert!(close(i.after(Change::Workers(3)).images_s, 592.0));
        // Their pace: the step and the time aside, 1 / 592 s an image.
        assert!(close(i.now().images_s, 592.0), "{:?}", i.now());
        // GPU consumers: a step 588 KiB / 10 GB/s shorter per image.
        let gpu = i.after(Change::GpuConsumers);
        let aside = 1.0 / 592.0 - 1.0 / 664.0;
        let step = 1.0 / 664.0 - 602_112.0 / H2D_BYTES_S;
        assert!(close(gpu.images_s, 1.0 / (step + aside)), "{gpu:?}");
    }

    #[test]
    fn without_the_run_queue_a_read_waits_for_a_core_like_the_other_stages() {
        // Decode and transform took 1.5x their CPU; the read 2 ms of wall
        // time for 0.2 of CPU: 0.3 of it waited for a core, 1.7 for bytes.
        let i = Inputs {
            cpu: 1.2e-3,
            wall: [2e-3, 1.0e-3, 0.5e-3],
            read_cpu: 0.2e-3,
            ..Inputs::default()
        };
        assert!(close(i.io(), 1.7e-3), "{}", i.io());
    }
}
