//! Late join benchmark: a trainer that starts in the middle of an epoch of
//! an image stream (the demo's ImageFolder: JPEG/PNG decode,
//! RandomResizedCrop 224, flip, normalise; 360 images, units of 32), while
//! a steady trainer (50 ms steps) reads it, joined three ways:
//!
//! * `next-epoch`: waits for the next epoch boundary;
//! * `immediate`: starts with the next unit, its first epoch partial;
//! * `now`: the part of the epoch already published is replayed to it
//!   (recomputed by the pipeline threads into its own arena), then it
//!   reads the shared stream: a complete first epoch at once.
//!
//! Bound: replaying unit k of the epoch costs the decode of the k × 32
//! images already published (the one cost sharing cannot avoid for a
//! complete epoch); its first batch needs only the first 32 of them, so it
//! should come within about one unit's decode of joining, as with
//! `immediate`. Lockstep: the steady trainer waits while the newcomer
//! catches up, at most the replay time.
//!
//! For each join and position (units of epoch 1 the stream has made when
//! the late one starts): seconds from the late trainer's start to its
//! first batch (connecting included; median of `--repeats`), the samples
//! and completeness of its first epoch, batches replayed, whether its
//! first epoch's bytes equal the steady trainer's (per-sample digests),
//! the replay's CPU seconds, and the steady trainer's total data stall
//! over its 3 epochs (what lockstep catch-up cost it).
//!
//! `--decoupled`: instead, the cost of a joiner as fast as the others on
//! a `pace = "decoupled"` stream (issue 49, item 8): two steady trainers
//! and a late one joining now, all with 50 ms steps, reading to the end of
//! `--epochs` epochs. Bound: a complete first epoch costs the decode of the
//! part of it the ring no longer holds, once; every later sample it reads
//! from the shared stream costs nothing more; rotated epochs (an epoch's
//! start the ring no longer holds read after its end) cost that start once
//! an epoch. Measured: its samples, its epochs read rotated, those
//! replayed for it, replayed per sample read (extra decodes per delivered
//! sample: 0 when it reads only the shared stream, 1 when everything it
//! read was decoded again for it), its cuts, and the pipeline's and the
//! replay's CPU seconds.
//!
//! Run: `bench/late_join.sh` (builds release binaries, prints markdown).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use batchcast_cli::harness::{self, BrokerProcess};
use batchcast_cli::report::ConsumerReport;
use clap::Parser;

#[derive(Debug, Parser)]
struct Args {
    /// The batchcast binary [default: next to this one]
    #[arg(long)]
    exe: Option<PathBuf>,
    /// Units of epoch 1 the stream has made when the late one starts
    #[arg(long, value_delimiter = ',', default_values_t = vec![2, 5, 8])]
    at: Vec<u64>,
    /// Runs per case (the median first-batch time is shown)
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// The stream's slots, one table each: smaller than an epoch (12
    /// units) and larger (the pipeline then runs ahead of the trainers
    /// into the next epoch)
    #[arg(long, value_delimiter = ',', default_values_t = vec![6, 24])]
    slots: Vec<u32>,
    /// The decoupled-pace table instead: a joiner as fast as two steady
    /// trainers, all reading to the end
    #[arg(long)]
    decoupled: bool,
    /// Epochs of the stream in the decoupled table
    #[arg(long, default_value_t = 5)]
    epochs: u64,
}

const UNITS_PER_EPOCH: u64 = 12; // 360 images in units of 32

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

struct Case {
    first_batch_s: f64,
    late: ConsumerReport,
    steady: ConsumerReport,
    replay_cpu_s: f64,
}

/// One broker: the steady trainer reads 3 epochs; when the stream has
/// made `at` units of epoch 1 the late one starts with `join` and reads
/// one epoch.
fn run(exe: &Path, root: &Path, join: &str, at: u64, slots: u32) -> anyhow::Result<Case> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.toml");
    let cfg = batchcast_broker::config::image_stream_toml("img", root, 224, 3, 1, "workers = 2")
        .replace("slots = 6", &format!("slots = {slots}"));
    if !cfg.contains(&format!("slots = {slots}")) {
        bail!("the demo stream's config no longer sets its slots: update this benchmark");
    }
    std::fs::write(&path, cfg)?;
    let sock = dir.path().join("b.sock");
    let mut broker =
        BrokerProcess::spawn(exe, Some(&path), &sock, Some(&dir.path().join("b.log")))?;
    let args = |more: &[&str]| {
        let mut a: Vec<String> = ["--stream", "img", "--digest"].map(String::from).to_vec();
        a.extend(more.iter().map(|s| s.to_string()));
        a
    };
    let steady =
        harness::spawn_consumer(exe, &sock, &args(&["--sleep-ms", "50", "--name", "steady"]))?;
    let target = UNITS_PER_EPOCH + at;
    let t0 = Instant::now();
    loop {
        let s = broker.stats()?;
        if s.streams[0].batches_produced >= target {
            break;
        }
        if t0.elapsed() > Duration::from_secs(300) {
            bail!("the stream never reached unit {target}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let late = harness::spawn_consumer(
        exe,
        &sock,
        &args(&["--join", join, "--max-epochs", "1", "--name", "late"]),
    )?;
    let late = harness::wait_report(late, Duration::from_secs(600))?;
    let stats = broker.stats()?;
    let steady = harness::wait_report(steady, Duration::from_secs(600))?;
    broker.terminate(Duration::from_secs(5))?;
    if !late.ok || !steady.ok {
        bail!(
            "a trainer failed: late {:?}, steady {:?}",
            late.error,
            steady.error
        );
    }
    let st = &stats.streams[0];
    Ok(Case {
        first_batch_s: late.first_batch_s,
        replay_cpu_s: st.replay_cpu_s,
        late,
        steady,
    })
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let exe = harness::batchcast_exe(a.exe.as_deref())?;
    let root = batchcast_cli::demo_data::ensure().context("the demo images")?;
    if a.decoupled {
        return decoupled_table(&a, &exe, &root);
    }
    for &slots in &a.slots {
        println!(
            "\n{slots} slots ({}):\n",
            if u64::from(slots) < UNITS_PER_EPOCH {
                "less than an epoch"
            } else {
                "more than an epoch"
            }
        );
        table(&a, &exe, &root, slots)?;
    }
    Ok(())
}

/// One table: every join at every position, with `slots` slots.
fn table(a: &Args, exe: &Path, root: &Path, slots: u32) -> anyhow::Result<()> {
    println!(
        "| join | stream at unit | first batch (s, median of {}) | first epoch: epoch, samples | complete | replayed batches | bytes = shared | replay CPU (s) | steady trainer's stall (s) |",
        a.repeats
    );
    println!("|---|---:|---:|---|:-:|---:|:-:|---:|---:|");
    for join in ["next-epoch", "immediate", "now"] {
        for &at in &a.at {
            let mut cases = Vec::new();
            for k in 0..a.repeats {
                eprintln!(
                    "join {join} at unit {at}, run {} of {} ...",
                    k + 1,
                    a.repeats
                );
                cases.push(run(exe, root, join, at, slots)?);
            }
            let first = median(cases.iter().map(|c| c.first_batch_s).collect());
            let c = &cases[0];
            let e = c
                .late
                .epochs
                .first()
                .context("the late trainer saw no epoch")?;
            let same = c
                .steady
                .epochs
                .iter()
                .find(|s| s.epoch == e.epoch)
                .is_some_and(|s| s.digest == e.digest);
            let same = match (e.complete, same) {
                (true, true) => "yes",
                (true, false) => "NO",
                (false, _) => "(partial)",
            };
            println!(
                "| {join} | {} of {UNITS_PER_EPOCH} | {first:.3} | {}, {} | {} | {} | {same} | {:.2} | {:.2} |",
                at,
                e.epoch,
                e.samples,
                if e.complete { "yes" } else { "no" },
                c.late.replayed_batches,
                c.replay_cpu_s,
                median(cases.iter().map(|c| c.steady.wait_s).collect()),
            );
        }
    }
    Ok(())
}

/// One decoupled run: two steady trainers read `epochs` epochs; when the
/// stream has made `at` units of epoch 1 a third joins now, as fast as
/// they are, and reads to the end.
struct Decoupled {
    late: ConsumerReport,
    /// Samples replayed to the late trainer, and its cuts (the broker's).
    replayed: u64,
    cuts: u64,
    steady_samples_per_s: f64,
    pipeline_cpu_s: f64,
    replay_cpu_s: f64,
}

fn run_decoupled(
    exe: &Path,
    root: &Path,
    at: u64,
    slots: u32,
    epochs: u64,
) -> anyhow::Result<Decoupled> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.toml");
    let cfg = batchcast_broker::config::image_stream_toml(
        "img",
        root,
        224,
        epochs,
        2,
        "workers = 2\npace = \"decoupled\"",
    )
    .replace("slots = 6", &format!("slots = {slots}"));
    std::fs::write(&path, cfg)?;
    let sock = dir.path().join("b.sock");
    let mut broker =
        BrokerProcess::spawn(exe, Some(&path), &sock, Some(&dir.path().join("b.log")))?;
    let args = |more: &[&str]| {
        let mut a: Vec<String> = ["--stream", "img", "--sleep-ms", "50"]
            .map(String::from)
            .to_vec();
        a.extend(more.iter().map(|s| s.to_string()));
        a
    };
    let steady: Vec<_> = ["steady-0", "steady-1"]
        .iter()
        .map(|n| harness::spawn_consumer(exe, &sock, &args(&["--name", n])))
        .collect::<Result<_, _>>()?;
    let target = UNITS_PER_EPOCH + at;
    let t0 = Instant::now();
    while broker.stats()?.streams[0].batches_produced < target {
        if t0.elapsed() > Duration::from_secs(300) {
            bail!("the stream never reached unit {target}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let late = harness::spawn_consumer(exe, &sock, &args(&["--join", "now", "--name", "late"]))?;
    let late = harness::wait_report(late, Duration::from_secs(600))?;
    let mut steady_rate = Vec::new();
    for s in steady {
        let r = harness::wait_report(s, Duration::from_secs(600))?;
        if !r.ok {
            bail!("a steady trainer failed: {:?}", r.error);
        }
        steady_rate.push(r.samples as f64 / r.seconds.max(1e-9));
    }
    let stats = broker.stats()?;
    broker.terminate(Duration::from_secs(5))?;
    if !late.ok {
        bail!("the late trainer failed: {:?}", late.error);
    }
    let st = &stats.streams[0];
    let me = st
        .consumers
        .iter()
        .chain(&st.past_consumers)
        .find(|c| c.name == "late")
        .context("the late trainer in the stats")?;
    Ok(Decoupled {
        replayed: me.replayed,
        cuts: me.cuts,
        late,
        steady_samples_per_s: median(steady_rate),
        pipeline_cpu_s: st.pipeline_cpu_s,
        replay_cpu_s: st.replay_cpu_s,
    })
}

/// The decoupled table: for each position and ring size, one run.
fn decoupled_table(a: &Args, exe: &Path, root: &Path) -> anyhow::Result<()> {
    println!(
        "| slots | late joins at unit | its epochs, samples | epochs rotated | replayed samples | replayed per sample read | cuts | steady trainers' samples/s | pipeline CPU (s) | replay CPU (s) |"
    );
    println!("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for &slots in &a.slots {
        for &at in &a.at {
            eprintln!("decoupled, {slots} slots, late at unit {at} ...");
            let d = run_decoupled(exe, root, at, slots, a.epochs)?;
            let samples = d.late.samples.max(1);
            println!(
                "| {slots} | {at} of {UNITS_PER_EPOCH} | {}, {} | {} | {} | {:.2} | {} | {:.0} | {:.2} | {:.2} |",
                d.late.epochs.len(),
                d.late.samples,
                d.late.rotated_epochs,
                d.replayed,
                d.replayed as f64 / samples as f64,
                d.cuts,
                d.steady_samples_per_s,
                d.pipeline_cpu_s,
                d.replay_cpu_s,
            );
        }
    }
    Ok(())
}
