//! `batchcast consume`: a consumer process built on the client library that
//! can verify every byte it receives, hold or dawdle on purpose, and report
//! what it saw as JSON. The demo, the benchmark and the end-to-end tests run
//! it as their consumer processes.

use std::borrow::Cow;
use std::collections::{HashSet, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use batchcast::proto::EpochEnd;
use batchcast::schema::SourceInfo;
use batchcast::synthetic::{SyntheticSpec, mix64};
use batchcast::{Batch, Consumer, ConsumerOptions, Event, JoinPolicy, Schema};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, clap::Args)]
pub struct ConsumeArgs {
    /// The broker's socket [default: $BATCHCAST_SOCKET, else $XDG_RUNTIME_DIR/batchcast.sock]
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Stream to subscribe to [default: $BATCHCAST_STREAM, else train]
    #[arg(long)]
    pub stream: Option<String>,
    /// Most batches held (received, not released) at once
    #[arg(long, default_value_t = 2)]
    pub window: u32,
    /// Join at the next epoch boundary, with the next batch (`immediate`:
    /// a partial first epoch), or at once with a complete epoch (`now`:
    /// the part already published is replayed) [default: $BATCHCAST_JOIN,
    /// else next-epoch]
    #[arg(long, value_enum)]
    pub join: Option<Join>,
    /// Start at EPOCH:SAMPLE of the stream (as a trainer resuming from a
    /// checkpoint); overrides --join
    #[arg(long, value_parser = parse_position)]
    pub resume: Option<batchcast::proto::Position>,
    /// Name shown in `batchcast stats`
    #[arg(long)]
    pub name: Option<String>,
    /// Check every sample's bytes against the synthetic generator
    #[arg(long)]
    pub verify: bool,
    /// Compute a digest of all bytes received per epoch
    #[arg(long)]
    pub digest: bool,
    /// Sleep this long while holding each batch (a slow trainer)
    #[arg(long, default_value_t = 0)]
    pub sleep_ms: u64,
    /// After releasing batch N (counted from 1), stall for --stall-ms (a
    /// trainer pausing between steps: evaluating, saving a checkpoint)
    #[arg(long)]
    pub stall_after: Option<u64>,
    #[arg(long, default_value_t = 1000)]
    pub stall_ms: u64,
    /// Keep the last N batches instead of releasing each at once
    #[arg(long, default_value_t = 0)]
    pub hold: usize,
    /// Stop after this many batches
    #[arg(long)]
    pub max_batches: Option<u64>,
    /// Stop after this many epoch ends
    #[arg(long)]
    pub max_epochs: Option<u64>,
    /// Crash after this many batches (SIGABRT, batches still held): a
    /// trainer dying mid-run, for tests of what survives it
    #[arg(long, hide = true)]
    pub abort_after: Option<u64>,
    /// Print one JSON report on stdout instead of a summary
    #[arg(long)]
    pub json: bool,
    /// Keep retrying this many seconds while the broker or the stream is
    /// not there yet (e.g. a producer still starting)
    #[arg(long, default_value_t = 0.0)]
    pub connect_timeout: f64,
    /// Receive batches on this device: `cpu`, or `cuda:N` (the broker
    /// copies each batch to that GPU; --verify and --dump read the host copy)
    #[arg(long)]
    pub device: Option<batchcast::Device>,
    /// Write every batch's fields to DIR/e{epoch}-b{index}-{field}.bin
    /// (raw little-endian tensors) for inspection
    #[arg(long)]
    pub dump: Option<PathBuf>,
    /// Take batches and give releases back on the socket instead of
    /// through a shared-memory mailbox (as `BATCHCAST_MAILBOX=0` does)
    #[arg(long)]
    pub no_mailbox: bool,
    /// This consumer's own batch size [default: $BATCHCAST_BATCH_SIZE, else
    /// the stream's]
    #[arg(long)]
    pub batch_size: Option<u64>,
    /// Drop each epoch's last batch when it is short [default: the
    /// stream's drop_last]; `--drop-last=false` keeps it whatever the
    /// stream says
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub drop_last: Option<bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Join {
    NextEpoch,
    Immediate,
    Now,
}

fn parse_position(s: &str) -> Result<batchcast::proto::Position, String> {
    let (e, i) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}`: write EPOCH:SAMPLE, e.g. 2:640"))?;
    let num = |v: &str| {
        v.trim()
            .parse::<u64>()
            .map_err(|e| format!("`{s}`: `{v}` is not a count ({e})"))
    };
    Ok(batchcast::proto::Position {
        epoch: num(e)?,
        sample: num(i)?,
    })
}

/// One epoch as a consumer saw it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EpochReport {
    pub epoch: u64,
    pub batches: u64,
    pub samples: u64,
    pub complete: bool,
    /// Hex digest of every byte received in the epoch (with `--digest`).
    pub digest: Option<String>,
    /// Image streams: distinct dataset indices seen (the `index` field).
    pub distinct_indices: Option<u64>,
}

/// What a consumer process reports on exit.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct ConsumerReport {
    pub name: String,
    pub pid: u32,
    pub ok: bool,
    pub error: Option<String>,
    pub error_code: Option<String>,
    pub ended: bool,
    pub batches: u64,
    pub samples: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub batches_per_s: f64,
    pub epochs: Vec<EpochReport>,
    pub verified_samples: u64,
    pub verify_failures: u64,
    /// Problems with sequence, epoch or index order (empty when in order).
    pub order_errors: Vec<String>,
    pub handoff_us_p50: f64,
    pub handoff_us_p99: f64,
    pub handoff_us_max: f64,
    pub wait_s: f64,
    /// Seconds between a batch's arrival and asking for the next.
    pub busy_s: f64,
    pub rss_anon_kb_start: u64,
    pub rss_anon_kb_end: u64,
    /// CPU seconds this process used (all threads, schedstat), in all
    /// and by the time its first batch arrived (start-up and connecting).
    #[serde(default)]
    pub cpu_s: f64,
    #[serde(default)]
    pub cpu_first_batch_s: f64,
    /// Host field views that did not lie in the shared mapping (a copy):
    /// zero on the zero-copy path.
    #[serde(default)]
    pub views_outside_arena: u64,
    /// Seconds from start to the first batch (connecting included).
    #[serde(default)]
    pub first_batch_s: f64,
    /// Batches recomputed for it alone (`--join now`, `--resume`).
    #[serde(default)]
    pub replayed_batches: u64,
}

/// Anonymous resident memory of this process (excludes the shared arena).
pub fn rss_anon_kb(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("RssAnon:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

pub fn run(args: &ConsumeArgs) -> ConsumerReport {
    let mut opts = ConsumerOptions::default();
    if let Some(s) = &args.stream {
        opts.stream = s.clone();
    }
    if let Some(n) = &args.name {
        opts.name = n.clone();
    }
    opts.socket = args.socket.clone();
    opts.window = args.window;
    if args.batch_size.is_some() {
        opts.batch_size = args.batch_size;
    }
    opts.drop_last = args.drop_last;
    if args.no_mailbox {
        opts.mailbox = false;
    }
    if let Some(d) = args.device {
        opts.device = d;
    }
    if args.connect_timeout > 0.0 && args.connect_timeout.is_finite() {
        opts.connect_timeout = std::time::Duration::from_secs_f64(args.connect_timeout);
    }
    if let Some(join) = args.join {
        opts.join = match join {
            Join::NextEpoch => JoinPolicy::NextEpoch,
            Join::Immediate => JoinPolicy::Immediate,
            Join::Now => JoinPolicy::Now,
        };
    }
    opts.resume = args.resume;
    let mut report = ConsumerReport {
        name: opts.name.clone(),
        pid: std::process::id(),
        rss_anon_kb_start: rss_anon_kb("self"),
        ..Default::default()
    };
    let t0 = Instant::now();
    let result = consume(args, opts, &mut report);
    report.seconds = t0.elapsed().as_secs_f64();
    report.batches_per_s = report.batches as f64 / report.seconds.max(1e-9);
    report.rss_anon_kb_end = rss_anon_kb("self");
    report.cpu_s = crate::procstat::thread_cpu_seconds(std::process::id()).unwrap_or(0.0);
    if let Err(e) = result {
        report.error_code = e.code().map(|c| format!("{c:?}"));
        report.error = Some(e.to_string());
    }
    report.ok =
        report.error.is_none() && report.verify_failures == 0 && report.order_errors.is_empty();
    report
}

fn consume(
    args: &ConsumeArgs,
    opts: ConsumerOptions,
    report: &mut ConsumerReport,
) -> batchcast::Result<()> {
    let t0 = Instant::now();
    let join = opts.join;
    let mut consumer = Consumer::connect(opts)?;
    let arenas = [Some(consumer.arena()), consumer.replay_arena()]
        .into_iter()
        .flatten()
        .map(|(base, len)| (base as usize, len))
        .collect();
    let mut check = Checker::new(
        args,
        consumer.schema().clone(),
        consumer.batches_per_epoch(),
        arenas,
        join,
    )?;
    let mut held: VecDeque<Batch> = VecDeque::new();
    let mut ends = 0u64;
    loop {
        let batch = match consumer.next_event()? {
            None | Some(Event::EndOfStream) => {
                report.ended = true;
                break;
            }
            Some(Event::EndOfEpoch(end)) => {
                check.epoch_end(end, report);
                ends += 1;
                if args.max_epochs.is_some_and(|m| ends >= m) {
                    break;
                }
                continue;
            }
            Some(Event::Batch(b)) => b,
        };
        if report.batches == 0 {
            report.first_batch_s = t0.elapsed().as_secs_f64();
            report.cpu_first_batch_s =
                crate::procstat::thread_cpu_seconds(std::process::id()).unwrap_or(0.0);
        }
        check.batch(&batch, report)?;
        if args.sleep_ms > 0 {
            std::thread::sleep(Duration::from_millis(args.sleep_ms));
        }
        held.push_back(batch);
        while held.len() > args.hold {
            held.pop_front(); // dropping releases
        }
        if args.stall_after == Some(report.batches) {
            std::thread::sleep(Duration::from_millis(args.stall_ms));
        }
        if args.abort_after.is_some_and(|m| report.batches >= m) {
            eprintln!(
                "consume: --abort-after {}: aborting with {} batches held",
                report.batches,
                held.len()
            );
            std::process::abort();
        }
        if args.max_batches.is_some_and(|m| report.batches >= m) {
            break;
        }
    }
    check.finish(report);
    Ok(())
}

/// What `consume` checks and counts from batch to batch: order, epochs,
/// digests, dumps, distinct dataset indices, synthetic bytes.
struct Checker<'a> {
    args: &'a ConsumeArgs,
    /// How it joined: a first batch mid-epoch is an error unless immediate.
    join: JoinPolicy,
    schema: Schema,
    /// This consumer's batches in an epoch.
    batches_per_epoch: u64,
    /// Synthetic streams with `--verify`: what every sample must hold.
    spec: Option<SyntheticSpec>,
    /// Image streams: the `index` field, to count distinct samples.
    index_field: Option<usize>,
    seen: HashSet<i64>,
    /// The sample order of the last two epochs seen.
    orders: VecDeque<(u64, Vec<u64>)>,
    handoff: Histogram,
    /// `(seq, epoch, index)` of the last batch, and whether it was replayed.
    last: Option<(u64, u64, u64)>,
    last_replayed: bool,
    digest: u64,
    cur: EpochReport,
    /// The shared mapping's address range in this process, and the replay
    /// arena's.
    arenas: Vec<(usize, usize)>,
}

impl<'a> Checker<'a> {
    fn new(
        args: &'a ConsumeArgs,
        schema: Schema,
        batches_per_epoch: u64,
        arenas: Vec<(usize, usize)>,
        join: JoinPolicy,
    ) -> batchcast::Result<Checker<'a>> {
        let spec = match schema.source {
            SourceInfo::Synthetic(spec) => Some(spec).filter(|_| args.verify),
            SourceInfo::Images(_) | SourceInfo::External(_) if args.verify => {
                return Err(batchcast::Error::Schema(
                    "--verify checks synthetic streams; use --digest or --dump to compare what consumers of other streams receive".into(),
                ));
            }
            SourceInfo::Images(_) | SourceInfo::External(_) => None,
        };
        let index_field = schema
            .field("index")
            .filter(|(_, f)| f.dtype == batchcast::DType::I64 && f.shape.is_empty())
            .map(|(i, _)| i);
        if let Some(dir) = &args.dump {
            std::fs::create_dir_all(dir).map_err(batchcast::Error::Io)?;
        }
        Ok(Checker {
            args,
            join,
            schema,
            batches_per_epoch,
            spec,
            index_field,
            seen: HashSet::new(),
            orders: VecDeque::new(),
            handoff: Histogram::default(),
            last: None,
            last_replayed: false,
            digest: 0,
            cur: EpochReport::new(u64::MAX),
            arenas,
        })
    }

    fn epoch_end(&mut self, end: EpochEnd, report: &mut ConsumerReport) {
        if self.cur.epoch != end.epoch || self.cur.batches != end.batches {
            report.order_errors.push(format!(
                "end of epoch {end:?} after {} batches of epoch {}",
                self.cur.batches, self.cur.epoch
            ));
        }
        self.cur.complete = end.complete;
    }

    /// Checks and counts one batch.
    fn batch(&mut self, batch: &Batch, report: &mut ConsumerReport) -> batchcast::Result<()> {
        self.handoff.record(batch.handoff_ns());
        report.wait_s += batch.wait_ns() as f64 * 1e-9;
        report.busy_s += batch.busy_ns() as f64 * 1e-9;
        self.check_order(batch, report);
        if batch.epoch() != self.cur.epoch {
            self.close_epoch(report);
            self.cur = EpochReport::new(batch.epoch());
        }
        self.cur.batches += 1;
        self.cur.samples += batch.len() as u64;
        report.batches += 1;
        report.replayed_batches += u64::from(batch.replayed());
        report.samples += batch.len() as u64;
        // Host views, or for a device batch its bytes copied back from the
        // GPU (this is a test consumer: what it checks is what arrived).
        let fields: Vec<Cow<'_, [u8]>> = match batch.fields() {
            Ok(views) => views.map(|f| f.bytes().into()).collect(),
            Err(batchcast::Error::OnDevice { .. }) => (0..self.schema.fields.len())
                .map(|i| batch.copy_field(i).map(Into::into))
                .collect::<batchcast::Result<_>>()?,
            Err(e) => return Err(e),
        };
        for f in &fields {
            if let Cow::Borrowed(b) = f {
                let p = b.as_ptr() as usize;
                if !self
                    .arenas
                    .iter()
                    .any(|&(base, len)| p >= base && p + b.len() <= base + len)
                {
                    report.views_outside_arena += 1;
                }
            }
        }
        self.record_fields(batch, &fields, report)?;
        if let Some(fi) = self.index_field {
            for j in 0..batch.len() {
                let v = i64::from_le_bytes(
                    sample(&fields[fi], batch.len(), j)
                        .try_into()
                        .expect("i64 scalar"),
                );
                self.seen.insert(v);
            }
        }
        if let Some(spec) = self.spec {
            self.verify(spec, batch, &fields, report);
        }
        Ok(())
    }

    /// Batches come in sequence, epoch by epoch; the first at an epoch's
    /// start unless joining mid-epoch.
    fn check_order(&mut self, batch: &Batch, report: &mut ConsumerReport) {
        let (seq, epoch, index) = (batch.seq(), batch.epoch(), batch.index());
        match self.last {
            Some((ps, pe, pi)) => {
                let expect = if pi + 1 == self.batches_per_epoch {
                    (pe + 1, 0)
                } else {
                    (pe, pi + 1)
                };
                // Batches smaller than the stream's share its units' seq;
                // replayed batches count seqs of their own.
                let replay = batch.replayed() || self.last_replayed;
                if (!replay && seq < ps) || (epoch, index) != expect {
                    report.order_errors.push(format!(
                        "batch ({epoch}, {index}) seq {seq} after ({pe}, {pi}) seq {ps}"
                    ));
                }
            }
            None if self
                .args
                .resume
                .is_some_and(|p| (p.epoch, p.sample) != (epoch, batch.first_sample())) =>
            {
                report.order_errors.push(format!(
                    "first batch starts at sample {} of epoch {epoch}, not at the resume position {:?}",
                    batch.first_sample(),
                    self.args.resume
                ));
            }
            None if self.args.resume.is_none()
                && self.join != JoinPolicy::Immediate
                && index != 0 =>
            {
                report.order_errors.push(format!(
                    "first batch is index {index} of epoch {epoch}, not the start of an epoch"
                ));
            }
            None => {}
        }
        self.last = Some((seq, epoch, index));
        self.last_replayed = batch.replayed();
    }

    /// Counts the bytes, and digests or dumps them when asked.
    fn record_fields(
        &mut self,
        batch: &Batch,
        fields: &[Cow<'_, [u8]>],
        report: &mut ConsumerReport,
    ) -> batchcast::Result<()> {
        if self.args.digest {
            // Sample by sample, so that consumers of any batch size agree.
            for j in 0..batch.len() {
                for bytes in fields {
                    self.digest = digest_bytes(self.digest, sample(bytes, batch.len(), j));
                }
            }
        }
        for (f, bytes) in self.schema.fields.iter().zip(fields) {
            report.bytes += bytes.len() as u64;
            if let Some(dir) = &self.args.dump {
                let path = dir.join(format!(
                    "e{}-b{}-{}.bin",
                    batch.epoch(),
                    batch.index(),
                    f.name
                ));
                std::fs::write(&path, bytes).map_err(batchcast::Error::Io)?;
            }
        }
        Ok(())
    }

    /// Checks every sample of a synthetic batch against the generator.
    fn verify(
        &mut self,
        spec: SyntheticSpec,
        batch: &Batch,
        fields: &[Cow<'_, [u8]>],
        report: &mut ConsumerReport,
    ) {
        let epoch = batch.epoch();
        if !self.orders.iter().any(|(e, _)| *e == epoch) {
            if self.orders.len() == 2 {
                self.orders.pop_front();
            }
            self.orders.push_back((epoch, spec.epoch_order(epoch)));
        }
        let order = &self
            .orders
            .iter()
            .find(|(e, _)| *e == epoch)
            .expect("just inserted")
            .1;
        let first = batch.first_sample() as usize;
        let before = report.verify_failures;
        for (fi, bytes) in fields.iter().enumerate() {
            for j in 0..batch.len() {
                let Some(&ds) = order.get(first + j) else {
                    report.verify_failures += 1;
                    continue;
                };
                if !spec.verify_sample(fi, ds, sample(bytes, batch.len(), j)) {
                    report.verify_failures += 1;
                }
            }
        }
        if report.verify_failures > before && report.order_errors.len() < 20 {
            report.order_errors.push(format!(
                "verify: {} wrong in batch of epoch {epoch}, samples {first}..{} ({}, seq {})",
                report.verify_failures - before,
                first + batch.len(),
                if batch.replayed() {
                    "replayed"
                } else {
                    "shared"
                },
                batch.seq()
            ));
        }
        report.verified_samples += batch.len() as u64;
    }

    /// Adds the epoch in progress, if any, to the report.
    fn close_epoch(&mut self, report: &mut ConsumerReport) {
        if self.cur.epoch == u64::MAX {
            return;
        }
        let mut e = close_epoch(&mut self.cur, &mut self.digest, self.args.digest);
        e.distinct_indices = self.index_field.map(|_| self.seen.len() as u64);
        self.seen.clear();
        report.epochs.push(e);
    }

    fn finish(mut self, report: &mut ConsumerReport) {
        self.close_epoch(report);
        report.handoff_us_p50 = self.handoff.quantile(0.50) as f64 / 1e3;
        report.handoff_us_p99 = self.handoff.quantile(0.99) as f64 / 1e3;
        report.handoff_us_max = self.handoff.max as f64 / 1e3;
    }
}

/// Sample `j` of a field's bytes in a batch of `samples` samples.
fn sample(field: &[u8], samples: usize, j: usize) -> &[u8] {
    let bps = field.len() / samples.max(1);
    &field[j * bps..(j + 1) * bps]
}

impl EpochReport {
    fn new(epoch: u64) -> EpochReport {
        EpochReport {
            epoch,
            batches: 0,
            samples: 0,
            complete: false,
            digest: None,
            distinct_indices: None,
        }
    }
}

fn close_epoch(cur: &mut EpochReport, digest: &mut u64, with_digest: bool) -> EpochReport {
    let mut e = cur.clone();
    if with_digest {
        e.digest = Some(format!("{:016x}", *digest));
    }
    *digest = 0;
    e
}

fn digest_bytes(mut acc: u64, bytes: &[u8]) -> u64 {
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        acc = mix64(acc ^ u64::from_le_bytes(c.try_into().expect("8 bytes")));
    }
    for &b in chunks.remainder() {
        acc = mix64(acc ^ b as u64);
    }
    mix64(acc ^ bytes.len() as u64)
}

/// A fixed-size latency histogram (8 buckets per power of two, so within
/// 12.5%): memory stays constant however many batches are recorded.
#[derive(Debug)]
pub struct Histogram {
    counts: Box<[u64; 64 * 8]>,
    total: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: Box::new([0; 64 * 8]),
            total: 0,
            max: 0,
        }
    }
}

impl Histogram {
    fn bucket(v: u64) -> usize {
        if v < 8 {
            return v as usize;
        }
        let exp = 63 - v.leading_zeros() as usize; // >= 3
        let sub = ((v >> (exp - 3)) & 7) as usize;
        (exp - 2) * 8 + sub
    }

    /// The smallest value that falls in bucket `b`.
    fn lower(b: usize) -> u64 {
        if b < 8 {
            return b as u64;
        }
        let exp = b / 8 + 2;
        (8 + (b % 8) as u64) << (exp - 3)
    }

    pub fn record(&mut self, v: u64) {
        self.counts[Self::bucket(v)] += 1;
        self.total += 1;
        self.max = self.max.max(v);
    }

    /// The value below which a fraction `q` of recordings fall (bucket lower bound).
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((self.total as f64 * q).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::lower(b).min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::Histogram;

    #[test]
    fn histogram_quantiles_are_within_an_eighth() {
        let mut h = Histogram::default();
        for v in 1..=100_000u64 {
            h.record(v);
        }
        for (q, exact) in [(0.5, 50_000f64), (0.99, 99_000.0)] {
            let got = h.quantile(q) as f64;
            assert!(
                (got - exact).abs() / exact <= 0.125,
                "q{q}: {got} vs {exact}"
            );
        }
        assert_eq!(h.quantile(1.0), 100_000u64.min(h.quantile(1.0)));
        assert_eq!(Histogram::default().quantile(0.5), 0);
        for v in [0u64, 7, 8, 9, 15, 16, 1 << 40, u64::MAX] {
            let b = Histogram::bucket(v);
            assert!(Histogram::lower(b) <= v, "{v}");
        }
    }
}
