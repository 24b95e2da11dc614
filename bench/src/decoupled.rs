//! Decoupled pace benchmark: the sweep of `examples/sweep-rust.toml` (one
//! synthetic image stream, 3×96×96 u8 + label, batches of 64, 16384
//! samples an epoch, 4 epochs; three trainers spending 1, 2 and 4 ms per
//! batch) under `pace = "lockstep"` and `pace = "decoupled"`, side by side,
//! then decoupled with a run-ahead budget from one ring of 8 batches to
//! the whole run.
//!
//! Bound: lockstep runs everyone at the slowest trainer's pace, so the
//! 1 ms trainer waits 3 ms of every 4 (a 75% stall) and the pipeline makes
//! each batch once (1024 batches). Decoupled lets each trainer run at its
//! own speed; a trainer that falls a ring behind has the rest of the run
//! recomputed for it alone, so the pipeline makes each batch once per
//! trainer it cannot hold for (up to 3 × 1024), unless the budget holds
//! the whole spread between the fastest and the slowest (1024 − 256
//! batches here: 1.3 GiB).
//!
//! For each run: each trainer's samples/s as a fraction of its speed
//! alone (measured first, one trainer on the broker), its data stall, the
//! broker's pipeline and replay CPU seconds, samples replayed, how often a
//! trainer was cut from the shared stream, and the run-ahead memory.
//!
//! Run: `bench/decoupled.sh` (builds release binaries, prints markdown).

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
    /// Trainers' milliseconds per batch
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 2, 4])]
    steps: Vec<u64>,
    /// Epochs of 16384 samples
    #[arg(long, default_value_t = 4)]
    epochs: u64,
    /// Run-ahead budgets of the sweep, in batches of the ring
    #[arg(long, value_delimiter = ',', default_values_t = vec![8, 64, 256, 1024])]
    budgets: Vec<u32>,
}

const BATCH: u64 = 64;
const LEN: u64 = 16384;
/// Bytes of one batch: 64 × (3 × 96 × 96 + 8).
const BATCH_BYTES: u64 = BATCH * (3 * 96 * 96 + 8);

fn stream(epochs: u64, pace: &str, slots: u32, min_consumers: usize) -> String {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 96, 96]), ("label", "i64", &[])];
    StreamToml::synthetic("train", BATCH, LEN, &fields)
        .fill("full")
        .epochs(epochs)
        .key("seed", 7)
        .key("slots", slots)
        .key("min_consumers", min_consumers)
        .raw(&format!("pace = \"{pace}\"\nshuffle = true"))
        .to_toml()
}

struct Run {
    trainers: Vec<ConsumerReport>,
    pipeline_cpu_s: f64,
    replay_cpu_s: f64,
    cuts: u64,
    replayed: u64,
}

/// One broker, the trainers with `steps` started together (the stream
/// waits for all of them), each reading the whole run.
fn run(exe: &Path, epochs: u64, pace: &str, slots: u32, steps: &[u64]) -> anyhow::Result<Run> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.toml");
    std::fs::write(&path, stream(epochs, pace, slots, steps.len()))?;
    let sock = dir.path().join("b.sock");
    let mut broker =
        BrokerProcess::spawn(exe, Some(&path), &sock, Some(&dir.path().join("b.log")))?;
    let mut children = Vec::new();
    for step in steps {
        let args: Vec<String> = [
            "--sleep-ms",
            &step.to_string(),
            "--name",
            &format!("step{step}ms"),
        ]
        .map(String::from)
        .to_vec();
        children.push(harness::spawn_consumer(exe, &sock, &args)?);
    }
    let mut trainers = Vec::new();
    for child in children {
        trainers.push(harness::wait_report(child, Duration::from_secs(900))?);
    }
    let stats = broker.stats()?;
    broker.terminate(Duration::from_secs(5))?;
    if let Some(t) = trainers.iter().find(|t| !t.ok || t.samples != epochs * LEN) {
        bail!(
            "trainer {} failed or read {} samples: {:?}",
            t.name,
            t.samples,
            t.error
        );
    }
    let st = &stats.streams[0];
    Ok(Run {
        pipeline_cpu_s: st.pipeline_cpu_s,
        replay_cpu_s: st.replay_cpu_s,
        cuts: st.past_consumers.iter().map(|c| c.cuts).sum(),
        replayed: st.past_consumers.iter().map(|c| c.replayed).sum(),
        trainers,
    })
}

fn rate(r: &ConsumerReport) -> f64 {
    r.samples as f64 / r.seconds.max(1e-9)
}

fn stall(r: &ConsumerReport) -> f64 {
    r.wait_s / (r.wait_s + r.busy_s).max(1e-9)
}

fn mib(slots: u32) -> f64 {
    f64::from(slots) * BATCH_BYTES as f64 / f64::from(1 << 20)
}

fn row(label: &str, slots: u32, r: &Run, solo: &[f64]) {
    let cells: Vec<String> = r
        .trainers
        .iter()
        .zip(solo)
        .map(|(t, s)| format!("{:.0}% ({:.0}%)", 100.0 * rate(t) / s, 100.0 * stall(t)))
        .collect();
    println!(
        "| {label} | {slots} ({:.0} MiB) | {} | {:.2} + {:.2} | {} | {} |",
        mib(slots),
        cells.join(" | "),
        r.pipeline_cpu_s,
        r.replay_cpu_s,
        r.replayed,
        r.cuts
    );
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let exe = harness::batchcast_exe(a.exe.as_deref())?;
    let mut solo = Vec::new();
    for &step in &a.steps {
        eprintln!("trainer with {step} ms steps alone ...");
        let r = run(&exe, a.epochs, "lockstep", 8, &[step])?;
        solo.push(rate(&r.trainers[0]));
    }
    let head: Vec<String> = a
        .steps
        .iter()
        .zip(&solo)
        .map(|(s, r)| format!("{s} ms trainer: speed (stall); alone {:.0} samples/s", r))
        .collect();
    println!(
        "| pace | run-ahead budget: batches (memory) | {} | broker CPU s: pipeline + replay | samples replayed | cuts |",
        head.join(" | ")
    );
    println!("|---|---:|{}---:|---:|---:|", "---:|".repeat(a.steps.len()));
    eprintln!("lockstep ...");
    let lock = run(&exe, a.epochs, "lockstep", 8, &a.steps).context("lockstep")?;
    row("lockstep", 8, &lock, &solo);
    for &slots in &a.budgets {
        eprintln!("decoupled, {slots} batches ahead ...");
        let r = run(&exe, a.epochs, "decoupled", slots, &a.steps).context("decoupled")?;
        row("decoupled", slots, &r, &solo);
    }
    Ok(())
}
