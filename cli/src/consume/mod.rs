//! `batchcast consume`: a consumer process built on the client library that
//! can verify every byte it receives, hold or dawdle on purpose, and report
//! what it saw as JSON. The demo, the benchmark and the end-to-end tests run
//! it as their consumer processes.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use batchcast::{Batch, Consumer, ConsumerOptions, Event, JoinPolicy};
use batchcast_cli::procstat::rss_anon_kb;
use batchcast_cli::report::{ConsumerReport, EpochReport, SavedState};

mod check;
mod options;

use check::Checker;

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
    /// Name shown in `batchcast stats` [default: $BATCHCAST_NAME, else the
    /// program's name]
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
    /// With --stall-after N: stall again every this many batches after N
    /// (an evaluation every so many steps)
    #[arg(long)]
    pub stall_every: Option<u64>,
    /// After releasing batch N (and those beyond --hold), stop this
    /// process with SIGSTOP (as Ctrl-Z or a debugger would) until it is
    /// sent SIGCONT: for tests of a paused trainer (0: once subscribed,
    /// before its first batch)
    #[arg(long, hide = true)]
    pub stop_after: Option<u64>,
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
    /// not there yet (e.g. a producer still starting) [default:
    /// $BATCHCAST_CONNECT_TIMEOUT, else 0]
    #[arg(long)]
    pub connect_timeout: Option<f64>,
    /// When the broker goes away, wait this many seconds for it to come
    /// back and go on from this consumer's next position; 0: fail at once
    /// [default: $BATCHCAST_RECONNECT_TIMEOUT, else 60]
    #[arg(long)]
    pub reconnect_timeout: Option<f64>,
    /// Receive batches on this device: `cpu`, or `cuda:N` (the broker
    /// copies each batch to that GPU; --verify and --dump read the host
    /// copy) [default: $BATCHCAST_DEVICE, else cpu]
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
    /// After each batch, write this consumer's state and its epoch's
    /// digest so far to FILE (atomically): a trainer checkpointing every
    /// step, for tests of resuming
    #[arg(long, value_name = "FILE")]
    pub state_file: Option<PathBuf>,
    /// Resume from a state FILE written by --state-file, carrying on its
    /// epoch's counts and digest (so the epoch's digest covers the samples
    /// before the resume too); not with --resume
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub resume_state: Option<PathBuf>,
    /// Take a seat in this group: its ranks split each epoch among them
    /// (rank and world from --rank/--world, else torchrun's or Slurm's
    /// environment) [default: $BATCHCAST_GROUP]
    #[arg(long)]
    pub group: Option<String>,
    /// This member's rank in --group [default: $LOCAL_RANK, else
    /// $SLURM_LOCALID]
    #[arg(long, requires = "group")]
    pub rank: Option<u32>,
    /// The ranks of --group [default: $LOCAL_WORLD_SIZE, else
    /// $SLURM_NTASKS_PER_NODE]
    #[arg(long, requires = "group")]
    pub world: Option<u32>,
    /// Consecutive ranks of --group that read the same samples
    #[arg(long, default_value_t = 1, requires = "group")]
    pub replicate: u32,
    /// Report each batch's place: the first sample and how many, per epoch
    #[arg(long)]
    pub positions: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Join {
    NextEpoch,
    Immediate,
    Now,
}

/// `--resume` that is not `EPOCH:SAMPLE`.
#[derive(Debug, thiserror::Error)]
pub enum PositionError {
    #[error("`{0}`: write EPOCH:SAMPLE, e.g. 2:640")]
    Shape(String),
    #[error("`{text}`: `{part}` is not a count ({error})")]
    Count {
        text: String,
        part: String,
        error: std::num::ParseIntError,
    },
}

fn parse_position(s: &str) -> Result<batchcast::proto::Position, PositionError> {
    let (e, i) = s
        .split_once(':')
        .ok_or_else(|| PositionError::Shape(s.to_string()))?;
    let num = |v: &str| {
        v.trim()
            .parse::<u64>()
            .map_err(|error| PositionError::Count {
                text: s.to_string(),
                part: v.to_string(),
                error,
            })
    };
    Ok(batchcast::proto::Position {
        epoch: num(e)?,
        sample: num(i)?,
    })
}

pub fn run(args: &ConsumeArgs) -> ConsumerReport {
    let (opts, saved) = match options::from_args(args) {
        Ok(o) => o,
        Err(e) => {
            return ConsumerReport {
                error: Some(e),
                ..Default::default()
            };
        }
    };
    let mut report = ConsumerReport {
        name: opts.name.clone(),
        pid: std::process::id(),
        rss_anon_kb_start: rss_anon_kb("self"),
        ..Default::default()
    };
    let t0 = Instant::now();
    let result = consume(args, opts, saved, &mut report);
    report.seconds = t0.elapsed().as_secs_f64();
    report.batches_per_s = report.batches as f64 / report.seconds.max(1e-9);
    report.rss_anon_kb_end = rss_anon_kb("self");
    report.cpu_s = batchcast_cli::procstat::thread_cpu_seconds(std::process::id()).unwrap_or(0.0);
    if let Err(e) = result {
        report.error_code = e.code().map(|c| format!("{c:?}"));
        report.error = Some(e.to_string());
    }
    report.ok =
        report.error.is_none() && report.verify_failures == 0 && report.order_errors.is_empty();
    report
}

/// `--state-file`: the consumer's state and the epoch's counts so far.
fn checkpoint(
    path: Option<&Path>,
    consumer: &Consumer,
    check: &Checker<'_>,
) -> std::io::Result<()> {
    let Some(path) = path else { return Ok(()) };
    let (epoch, digest) = check.progress();
    SavedState {
        state: consumer.state(),
        epoch,
        digest,
    }
    .save(path)
}

/// What checks `consumer`'s batches: its arenas, batch size, share, and
/// the epoch a saved state carries on.
fn checker_for<'a>(
    args: &'a ConsumeArgs,
    consumer: &Consumer,
    join: JoinPolicy,
    saved: Option<SavedState>,
) -> batchcast::Result<Checker<'a>> {
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
    check.deal = consumer.deal();
    if let Some(saved) = saved {
        check.carry_on(saved);
    }
    Ok(check)
}

fn consume(
    args: &ConsumeArgs,
    opts: ConsumerOptions,
    saved: Option<SavedState>,
    report: &mut ConsumerReport,
) -> batchcast::Result<()> {
    let t0 = Instant::now();
    let join = opts.join;
    let mut consumer = Consumer::connect(opts)?;
    let mut check = checker_for(args, &consumer, join, saved)?;
    let mut held: VecDeque<Batch> = VecDeque::new();
    let mut ends = 0u64;
    if args.stop_after == Some(0) {
        // Subscribed, before its first notice: a trainer that never reads.
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP)
            .map_err(|e| batchcast::Error::Io(e.into()))?;
    }
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
                batchcast_cli::procstat::thread_cpu_seconds(std::process::id()).unwrap_or(0.0);
        }
        report.reconnects = consumer.reconnects();
        check.host_arena_is(consumer.arena());
        check.batch(
            &batch,
            (consumer.reconnects(), consumer.state().rotation),
            report,
        )?;
        checkpoint(args.state_file.as_deref(), &consumer, &check)?;
        if args.sleep_ms > 0 {
            std::thread::sleep(Duration::from_millis(args.sleep_ms));
        }
        held.push_back(batch);
        while held.len() > args.hold {
            held.pop_front(); // dropping releases
        }
        if stalls_at(args.stall_after, args.stall_every, report.batches) {
            std::thread::sleep(Duration::from_millis(args.stall_ms));
        }
        if args.stop_after == Some(report.batches) {
            nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP)
                .map_err(|e| batchcast::Error::Io(e.into()))?;
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

/// Whether a consumer that stalls after batch `after` (and every `every`
/// batches from there) stalls after batch `n`.
fn stalls_at(after: Option<u64>, every: Option<u64>, n: u64) -> bool {
    match (after, every) {
        (Some(a), _) if n == a => true,
        (Some(a), Some(e)) if e > 0 && n > a => (n - a).is_multiple_of(e),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::{Histogram, stalls_at};

    #[test]
    fn a_stall_comes_after_its_batch_and_then_every_so_many() {
        let at: Vec<u64> = (1..=40)
            .filter(|&n| stalls_at(Some(5), Some(10), n))
            .collect();
        assert_eq!(at, [5, 15, 25, 35]);
        let once: Vec<u64> = (1..=40).filter(|&n| stalls_at(Some(5), None, n)).collect();
        assert_eq!(once, [5]);
        assert!(!(1..=40).any(|n| stalls_at(None, Some(10), n)));
    }

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
