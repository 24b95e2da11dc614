//! `batchcast demo`: the whole idea on built-in data, no set-up. Starts a
//! broker on a synthetic image-like stream and several consumer processes of
//! the real client, and shows that the pipeline ran once while every
//! consumer got every batch, verified byte for byte, identical across
//! consumers.

use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::consume::ConsumerReport;
use crate::harness::{self, BrokerProcess};

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Consumer processes to start
    #[arg(long, default_value_t = 4)]
    pub consumers: usize,
    /// Epochs to stream
    #[arg(long, default_value_t = 3)]
    pub epochs: u64,
}

pub fn run(args: &DemoArgs) -> anyhow::Result<()> {
    if args.consumers == 0 || args.epochs == 0 {
        bail!("--consumers and --epochs must be at least 1");
    }
    let exe = std::env::current_exe().context("cannot find the batchcast executable")?;
    let dir = tempfile::Builder::new()
        .prefix("batchcast-demo-")
        .tempdir()
        .context("cannot create a temporary directory")?;
    let config = dir.path().join("demo.toml");
    std::fs::write(&config, demo_config(args.consumers, args.epochs))?;
    let socket = dir.path().join("broker.sock");
    let log = dir.path().join("broker.log");
    println!(
        "batchcast demo: one broker, {} consumer processes, {} epochs of a synthetic image stream",
        args.consumers, args.epochs
    );
    println!(
        "  stream `demo`: 4096 samples of image u8 [3, 64, 64] + label i64, batches of 64, shuffled every epoch"
    );
    let broker =
        BrokerProcess::spawn(&exe, &config, &socket, Some(&log)).context("starting the broker")?;
    let t0 = Instant::now();
    let children = (0..args.consumers)
        .map(|i| {
            let a = [
                "--stream", "demo", "--verify", "--digest", "--window", "4", "--name",
            ]
            .map(String::from);
            let mut a = a.to_vec();
            a.push(format!("consumer-{i}"));
            harness::spawn_consumer(&exe, &socket, &a)
        })
        .collect::<std::io::Result<Vec<_>>>()
        .context("starting consumers")?;
    let progress = std::io::stdout().is_terminal().then(|| {
        let sock = socket.clone();
        std::thread::spawn(move || live_progress(&sock))
    });
    let reports = children
        .into_iter()
        .map(|c| harness::wait_report(c, Duration::from_secs(120)))
        .collect::<std::io::Result<Vec<_>>>()
        .context("collecting consumer reports")?;
    let wall = t0.elapsed().as_secs_f64();
    let stats = broker.stats().context("asking the broker for stats")?;
    let cpu = harness::cpu_seconds(broker.pid()).unwrap_or(0.0);
    broker.terminate(Duration::from_secs(5))?;
    drop(progress);
    if std::io::stdout().is_terminal() {
        print!("\r\x1b[K");
    }
    print_table(&reports);
    let st = &stats.streams[0];
    println!(
        "\nthe pipeline produced {} batches once ({:.2} CPU-s in the broker); the broker made {} deliveries = {} consumers × {} batches, without copying a byte",
        st.batches_produced,
        cpu,
        st.deliveries,
        reports.len(),
        st.batches_produced
    );
    let verdict = verdict(&reports, args.epochs);
    println!("{verdict}");
    println!("wall time {wall:.2} s");
    if !verdict.starts_with("OK") {
        bail!("the demo found a problem (broker log: {})", log.display());
    }
    Ok(())
}

fn demo_config(consumers: usize, epochs: u64) -> String {
    format!(
        r#"[[stream]]
name = "demo"
batch_size = 64
epochs = {epochs}
shuffle = true
seed = 2026
slots = 8
workers = 1
min_consumers = {consumers}

[stream.synthetic]
len = 4096
fill = "full"
fields = [
  {{ name = "image", dtype = "u8", shape = [3, 64, 64] }},
  {{ name = "label", dtype = "i64", shape = [] }},
]
"#
    )
}

fn live_progress(socket: &Path) {
    let Ok(mut client) = batchcast::StatsClient::connect(Some(socket.into())) else {
        return;
    };
    while let Ok(s) = client.fetch() {
        if let Some(st) = s.streams.first() {
            print!(
                "\r  produced {:>5} batches, delivered {:>6}   ",
                st.batches_produced, st.deliveries
            );
            let _ = std::io::Write::flush(&mut std::io::stdout());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn print_table(reports: &[ConsumerReport]) {
    println!(
        "\n{:<12} {:>8} {:>7} {:>10} {:>9} {:>12} {:>12} {:>9}  digest of epoch 0",
        "consumer",
        "batches",
        "epochs",
        "batches/s",
        "MB/s",
        "handoff p50",
        "handoff p99",
        "verified",
    );
    for r in reports {
        println!(
            "{:<12} {:>8} {:>7} {:>10.0} {:>9.0} {:>10.0}µs {:>10.0}µs {:>9} {}",
            r.name,
            r.batches,
            r.epochs.len(),
            r.batches_per_s,
            r.bytes as f64 / r.seconds.max(1e-9) / 1e6,
            r.handoff_us_p50,
            r.handoff_us_p99,
            if r.verify_failures == 0 && r.order_errors.is_empty() {
                "all ok"
            } else {
                "FAILED"
            },
            r.epochs
                .first()
                .and_then(|e| e.digest.as_deref())
                .unwrap_or("-"),
        );
    }
}

fn verdict(reports: &[ConsumerReport], epochs: u64) -> String {
    for r in reports {
        if let Some(e) = &r.error {
            return format!("FAILED: {} reported: {e}", r.name);
        }
        if r.verify_failures > 0 || !r.order_errors.is_empty() {
            return format!(
                "FAILED: {} saw {} wrong samples, order errors {:?}",
                r.name, r.verify_failures, r.order_errors
            );
        }
        if r.epochs.len() as u64 != epochs || !r.epochs.iter().all(|e| e.complete) {
            return format!("FAILED: {} did not see {epochs} complete epochs", r.name);
        }
    }
    let first: Vec<_> = reports[0].epochs.iter().map(|e| &e.digest).collect();
    if reports
        .iter()
        .any(|r| r.epochs.iter().map(|e| &e.digest).collect::<Vec<_>>() != first)
    {
        return "FAILED: consumers saw different data".into();
    }
    format!(
        "OK: all {} consumers received every batch of all {epochs} epochs exactly once, in order, every sample verified, identical data (same digests)",
        reports.len()
    )
}
