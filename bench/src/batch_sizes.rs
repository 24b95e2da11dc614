//! Mixed batch sizes benchmark: one stream of image-shaped samples
//! (3×224×224 u8 and an i64 label, produced in units of 64), read by
//! consumers that each ask for their own batch size.
//!
//! Bound: the pipeline's work is the same whoever reads (each sample
//! written once: 150 KB, 2 epochs of 8192 samples = 2.5 GB); per consumer,
//! no tensor byte moves. A consumer batch of B samples costs notices and
//! releases for the units it spans (⌈B / 64⌉ + 1 at most: one cache line
//! each way) and one `Batch`; so the cost per batch grows with B only by
//! those few records, and the cost per sample falls.
//!
//! Three parts, each printed as a table:
//! 1. Correctness and pipeline CPU: one consumer of the stream's size
//!    alone, then six of sizes {1, 7, 32, 64, 96, 256} together (fill
//!    `full`: every byte written). Every consumer's per-epoch digest (taken
//!    sample by sample, so batch boundaries do not matter) must equal the
//!    lone consumer's; pipeline CPU per epoch must match.
//! 2. Zero copies: each consumer checks that every field view lies in the
//!    shared mapping, and its anonymous memory stays flat (a copy of one
//!    batch of 256 would add 37 MiB).
//! 3. Per-batch consumer cost: each size alone, taking a 1 ms step per
//!    batch (a trainer's work, slept) against a pipeline that only stamps
//!    samples, so the units it needs are always there when it asks and
//!    its CPU is its own cost of getting and releasing batches (plus the
//!    step's sleep call, the same for every size), not waiting. CPU µs per
//!    batch and per sample, median of `--repeats` runs.
//!
//! Run: `bench/batch_sizes.sh` (builds release binaries, prints markdown).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use batchcast_broker::config::StreamToml;
use batchcast_cli::harness::{self, BrokerProcess};
use batchcast_cli::report::ConsumerReport;
use clap::Parser;

#[derive(Debug, Parser)]
struct Args {
    /// The batchcast binary [default: next to this one]
    #[arg(long)]
    exe: Option<PathBuf>,
    /// Consumer batch sizes
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 7, 32, 64, 96, 256])]
    sizes: Vec<u64>,
    /// Samples per epoch
    #[arg(long, default_value_t = 8192)]
    samples: u64,
    #[arg(long, default_value_t = 2)]
    epochs: u64,
    /// Batches each consumer reads in the cost runs (1 ms step each)
    #[arg(long, default_value_t = 2000)]
    cost_batches: u64,
    /// Runs per size in the cost part (the median is shown)
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

const UNIT: u64 = 64;
/// Holds batches of up to 256 with a window of 2: 3 × (⌈255/64⌉ + 1).
const SLOTS: u32 = 16;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn config(fill: &str, samples: u64, epochs: Option<u64>, consumers: usize) -> String {
    let fields: [(&str, &str, &[u64]); 2] =
        [("image", "u8", &[3, 224, 224]), ("label", "i64", &[])];
    let mut t = StreamToml::synthetic("bench", UNIT, samples, &fields)
        .fill(fill)
        .key("shuffle", true)
        .key("slots", SLOTS)
        .key("workers", 1)
        .key("min_consumers", consumers);
    if let Some(e) = epochs {
        t = t.epochs(e);
    }
    t.to_toml()
}

/// One broker, one consumer per entry of `sizes` (`None`: the stream's).
fn run(exe: &Path, cfg: &str, sizes: &[Option<u64>], extra: &[&str]) -> anyhow::Result<Run> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.toml");
    std::fs::write(&path, cfg)?;
    let sock = dir.path().join("b.sock");
    let mut broker = BrokerProcess::spawn(
        exe,
        Some(&path),
        &sock,
        Some(&dir.path().join("broker.log")),
    )?;
    let kids = sizes
        .iter()
        .map(|b| {
            let mut args: Vec<String> = ["--stream", "bench", "--window", "2"]
                .map(String::from)
                .to_vec();
            args.extend(extra.iter().map(|s| s.to_string()));
            if let Some(b) = b {
                args.extend(["--batch-size".into(), b.to_string()]);
            }
            harness::spawn_consumer(exe, &sock, &args)
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let reports: Vec<ConsumerReport> = kids
        .into_iter()
        .map(|k| harness::wait_report(k, Duration::from_secs(900)))
        .collect::<std::io::Result<_>>()?;
    let stats = broker.stats()?;
    broker.terminate(Duration::from_secs(5))?;
    let st = &stats.streams[0];
    Ok(Run {
        reports,
        pipeline_cpu_s: st.pipeline_cpu_s,
        produced: st.batches_produced,
    })
}

struct Run {
    reports: Vec<ConsumerReport>,
    pipeline_cpu_s: f64,
    produced: u64,
}

fn digests(r: &ConsumerReport) -> Vec<Option<String>> {
    r.epochs.iter().map(|e| e.digest.clone()).collect()
}

/// Parts 1 and 2: a lone consumer of the stream's size, as many of that
/// size as there are sizes, then every size together; `--repeats` times
/// each, pipeline CPU the median (the consumers compete with the pipeline
/// for this machine's cores, so equal consumer counts compare cleanly).
fn shared(exe: &Path, a: &Args) -> anyhow::Result<()> {
    let flags = ["--digest"];
    let n = a.sizes.len();
    let runs: [(String, Vec<Option<u64>>); 3] = [
        (format!("1 consumer ({UNIT})"), vec![None]),
        (format!("{n} consumers (all {UNIT})"), vec![None; n]),
        (
            format!("{n} consumers ({:?})", a.sizes),
            a.sizes.iter().copied().map(Some).collect(),
        ),
    ];
    let mut done = Vec::new();
    for (label, sizes) in &runs {
        let mut cpu = Vec::new();
        let mut first = None;
        for k in 0..a.repeats {
            eprintln!("{label}, run {} of {} ...", k + 1, a.repeats);
            let cfg = config("full", a.samples, Some(a.epochs), sizes.len());
            let r = run(exe, &cfg, sizes, &flags)?;
            cpu.push(r.pipeline_cpu_s / a.epochs as f64);
            first.get_or_insert(r);
        }
        done.push((label, median(cpu), first.expect("at least one run")));
    }
    let want = digests(&done[0].2.reports[0]);
    println!(
        "Part 1–2: one stream, {} epochs of {} samples of 3×224×224 u8 + i64 (units of {UNIT}, fill full)\n",
        a.epochs, a.samples
    );
    println!(
        "| consumer batch size | batches | samples / epoch | same bytes as the lone consumer | views outside the shared mapping | consumer anon KiB start→end | samples/s |"
    );
    println!("|---:|---:|---:|:-:|---:|---:|---:|");
    let row = |label: String, r: &ConsumerReport| {
        let per_epoch: Vec<String> = r.epochs.iter().map(|e| e.samples.to_string()).collect();
        println!(
            "| {label} | {} | {} | {} | {} | {}→{} | {:.0} |",
            r.batches,
            per_epoch.join(", "),
            if r.ok && digests(r) == want {
                "yes"
            } else {
                "NO"
            },
            r.views_outside_arena,
            r.rss_anon_kb_start,
            r.rss_anon_kb_end,
            r.samples as f64 / r.seconds.max(1e-9),
        );
    };
    row(format!("{UNIT} (alone)"), &done[0].2.reports[0]);
    for (r, b) in done[2].2.reports.iter().zip(&a.sizes) {
        row(b.to_string(), r);
    }
    println!();
    println!(
        "| run | units made | pipeline CPU-s / epoch (median of {}) |",
        a.repeats
    );
    println!("|---|---:|---:|");
    for (label, cpu, r) in &done {
        println!("| {label} | {} | {cpu:.3} |", r.produced);
    }
    println!(
        "\npipeline CPU per epoch, mixed sizes / all {UNIT}: {:.2}; mixed sizes / one consumer: {:.2}",
        done[2].1 / done[1].1.max(1e-9),
        done[2].1 / done[0].1.max(1e-9)
    );
    Ok(())
}

/// Part 3: each size alone, the pipeline only stamping samples.
fn cost(exe: &Path, a: &Args) -> anyhow::Result<()> {
    println!(
        "\nPart 3: consumer cost, each size alone, {} batches with a 1 ms step each, pipeline stamps only (median of {})\n",
        a.cost_batches, a.repeats
    );
    println!("| consumer batch size | consumer CPU µs / batch | CPU ns / sample | batches/s |");
    println!("|---:|---:|---:|---:|");
    let mut per_batch = Vec::new();
    for &b in &a.sizes {
        let batches = a.cost_batches;
        let mut cpu = Vec::new();
        let mut rate = Vec::new();
        for _ in 0..a.repeats {
            eprintln!("cost: batch size {b} ...");
            let r = run(
                exe,
                &config("stamp", 1 << 20, None, 1),
                &[Some(b)],
                &["--max-batches", &batches.to_string(), "--sleep-ms", "1"],
            )?;
            let rep = &r.reports[0];
            if !rep.ok || rep.batches != batches {
                bail!("batch size {b}: {rep:?}");
            }
            // From the first batch on: start-up and connecting excluded.
            let spent = rep.cpu_s - rep.cpu_first_batch_s;
            cpu.push(spent / (rep.batches - 1).max(1) as f64 * 1e6);
            rate.push(rep.batches_per_s);
        }
        let us = median(cpu);
        per_batch.push((b, us));
        println!(
            "| {b} | {us:.2} | {:.0} | {:.0} |",
            us * 1e3 / b as f64,
            median(rate)
        );
    }
    let at = |size| per_batch.iter().find(|(b, _)| *b == size).map(|p| p.1);
    if let (Some(big), Some(own)) = (at(256), at(UNIT)) {
        println!(
            "\nper-batch consumer cost, batches of 256 / batches of {UNIT}: {:.2}",
            big / own
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let exe = harness::batchcast_exe(a.exe.as_deref())?;
    shared(&exe, &a).context("shared stream")?;
    cost(&exe, &a).context("consumer cost")?;
    Ok(())
}
