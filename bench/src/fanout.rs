//! Fan-out benchmark: one broker, N consumer processes, a synthetic stream
//! of 64×3×224×224 u8 batches (9.6 MB each).
//!
//! Bound: on the zero-copy path no tensor byte moves per consumer. Per
//! delivery, on the socket the broker writes one ~30-byte message and reads
//! one ~15-byte release (two system calls and, usually, a wake-up); through
//! a mailbox it writes one 64-byte notice record and reads one 8-byte
//! release (cache lines, no system call unless a side sleeps). With
//! `fill = stamp` only 16 bytes per sample are written (the hand-off is
//! measured); with `fill = full` every byte is written, which is bounded by
//! memory bandwidth (9.6 MB per batch).
//!
//! Run: `bench/fanout.sh` (builds release binaries, prints a markdown table).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use batchcast_broker::config::StreamToml;
use batchcast_cli::harness::{self, BrokerProcess};
use batchcast_cli::{procstat::rss_anon_kb, report::ConsumerReport};
use clap::Parser;

#[derive(Debug, Parser)]
struct Args {
    /// The batchcast binary [default: next to this one]
    #[arg(long)]
    exe: Option<PathBuf>,
    /// Consumer counts to measure
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 2, 4, 8])]
    consumers: Vec<usize>,
    /// Batches each consumer receives in stamp mode
    #[arg(long, default_value_t = 100_000)]
    batches: u64,
    /// Batches each consumer receives in full-fill mode
    #[arg(long, default_value_t = 1_000)]
    full_batches: u64,
    #[arg(long, default_value_t = 4)]
    window: u32,
    #[arg(long, default_value_t = 16)]
    slots: u32,
}

struct Row {
    fill: &'static str,
    /// How consumers take batches: a shared-memory mailbox, or the socket.
    transport: &'static str,
    n: usize,
    per_consumer: f64,
    total: f64,
    p50: f64,
    p99: f64,
    cpu_per_1000: f64,
    broker_rss_mb: f64,
    broker_anon_mb: f64,
    consumer_anon_kb: (u64, u64),
    ok: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn config(fill: &str, n: usize, slots: u32) -> String {
    let fields: [(&str, &str, &[u64]); 2] =
        [("image", "u8", &[3, 224, 224]), ("label", "i64", &[])];
    StreamToml::synthetic("bench", 64, 64000, &fields)
        .fill(fill)
        .key("shuffle", false)
        .key("slots", slots)
        .key("workers", 1)
        .key("min_consumers", n)
        .to_toml()
}

fn run(
    exe: &Path,
    (fill, transport): (&'static str, &'static str),
    n: usize,
    batches: u64,
    a: &Args,
) -> anyhow::Result<Row> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("bench.toml");
    std::fs::write(&cfg, config(fill, n, a.slots))?;
    let sock = dir.path().join("b.sock");
    let mut broker =
        BrokerProcess::spawn(exe, Some(&cfg), &sock, Some(&dir.path().join("broker.log")))?;
    let cpu0 = harness::thread_cpu_seconds(broker.pid()).unwrap_or(0.0);
    let mut args: Vec<String> = [
        "--stream",
        "bench",
        "--window",
        &a.window.to_string(),
        "--max-batches",
        &batches.to_string(),
    ]
    .map(String::from)
    .to_vec();
    if transport == "socket" {
        args.push("--no-mailbox".into());
    }
    let kids = (0..n)
        .map(|_| harness::spawn_consumer(exe, &sock, &args))
        .collect::<std::io::Result<Vec<_>>>()?;
    let reports: Vec<ConsumerReport> = kids
        .into_iter()
        .map(|k| harness::wait_report(k, Duration::from_secs(600)))
        .collect::<std::io::Result<_>>()?;
    let stats = broker.stats()?;
    let cpu = harness::thread_cpu_seconds(broker.pid()).unwrap_or(0.0) - cpu0;
    let rss = harness::rss_kb(broker.pid()).unwrap_or(0) as f64 / 1024.0;
    let anon = rss_anon_kb(&broker.pid().to_string()) as f64 / 1024.0;
    broker.terminate(Duration::from_secs(5))?;
    let produced = stats.streams[0].batches_produced.max(1);
    Ok(Row {
        fill,
        transport,
        n,
        per_consumer: median(reports.iter().map(|r| r.batches_per_s).collect()),
        total: reports.iter().map(|r| r.batches_per_s).sum(),
        p50: median(reports.iter().map(|r| r.handoff_us_p50).collect()),
        p99: reports.iter().map(|r| r.handoff_us_p99).fold(0.0, f64::max),
        cpu_per_1000: cpu / produced as f64 * 1000.0,
        broker_rss_mb: rss,
        broker_anon_mb: anon,
        consumer_anon_kb: (
            reports
                .iter()
                .map(|r| r.rss_anon_kb_start)
                .max()
                .unwrap_or(0),
            reports.iter().map(|r| r.rss_anon_kb_end).max().unwrap_or(0),
        ),
        ok: reports.iter().all(|r| r.ok && r.batches == batches),
    })
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let exe = harness::batchcast_exe(a.exe.as_deref())?;
    let mut rows = Vec::new();
    for (fill, transport, batches) in [
        ("stamp", "mailbox", a.batches),
        ("stamp", "socket", a.batches),
        ("full", "mailbox", a.full_batches),
    ] {
        for &n in &a.consumers {
            eprintln!("fill={fill} transport={transport} consumers={n} ...");
            rows.push(
                run(&exe, (fill, transport), n, batches, &a)
                    .with_context(|| format!("fill={fill} transport={transport} consumers={n}"))?,
            );
        }
    }
    println!(
        "| fill | transport | consumers | batches/s per consumer (median) | deliveries/s (sum) | hand-off p50 µs | hand-off p99 µs (worst) | broker CPU-s / 1000 batches | broker RSS MiB (anon) | consumer anon KiB start→end | all ok |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:-:|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.4} | {:.0} ({:.1}) | {}→{} | {} |",
            r.fill,
            r.transport,
            r.n,
            r.per_consumer,
            r.total,
            r.p50,
            r.p99,
            r.cpu_per_1000,
            r.broker_rss_mb,
            r.broker_anon_mb,
            r.consumer_anon_kb.0,
            r.consumer_anon_kb.1,
            if r.ok { "yes" } else { "NO" }
        );
    }
    let cpu = |fill: &str, transport: &str, n: usize| {
        rows.iter()
            .find(|r| r.fill == fill && r.transport == transport && r.n == n)
            .map(|r| r.cpu_per_1000)
    };
    let most = *a.consumers.iter().max().unwrap_or(&1);
    println!();
    for (fill, transport) in [
        ("stamp", "mailbox"),
        ("stamp", "socket"),
        ("full", "mailbox"),
    ] {
        if let (Some(c1), Some(cn)) = (cpu(fill, transport, 1), cpu(fill, transport, most)) {
            println!(
                "broker CPU per batch, {most} consumers vs 1 ({fill}, {transport}): {:.2}x",
                cn / c1.max(1e-9)
            );
        }
    }
    if let (Some(m), Some(s)) = (cpu("stamp", "mailbox", most), cpu("stamp", "socket", most)) {
        println!(
            "broker CPU per batch at {most} consumers, socket vs mailbox (stamp): {:.1}x",
            s / m.max(1e-9)
        );
    }
    Ok(())
}
