//! Hostile clients benchmark: what the broker's owner sees while another
//! user attacks it, and what random SIGKILLs of consumers leave behind.
//! Prints one markdown table.
//!
//! The attack: a process of another uid (65534) keeps `--idle` connections
//! open that never say hello (reconnecting each one the broker refuses)
//! and `--garbage` connections writing random bytes (reconnecting each one
//! the broker closes). Bounds: admission happens at accept, so the owner's
//! connect costs one refusal-free accept and handshake (microseconds) plus
//! the wait for its first batch (one synthetic fill, ~0.1 ms); the
//! attacker holds at most `max_connections_per_uid` connections, so broker
//! memory stays at its idle level plus that many tasks.
//!
//! Chaos: `--chaos-consumers` `batchcast consume --verify --digest`
//! processes on a stream of `--chaos-epochs` epochs; every 0.5–2.5 s one
//! of them is SIGKILLed (holding batches) and a new one started. At the
//! end every complete epoch any survivor saw must be byte-identical across
//! them (digests), verified against the generator, and in order.
//!
//! Run: `bench/hostile.sh` (as root: the attacker runs as uid 65534).

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use batchcast::{Consumer, ConsumerOptions, JoinPolicy, StatsClient};
use batchcast_broker::config::StreamToml;
use batchcast_cli::harness::{self, BrokerProcess};
use batchcast_cli::report::ConsumerReport;
use clap::Parser;

const GUEST: u32 = 65534;

#[derive(Debug, Parser)]
struct Args {
    /// The batchcast binary [default: next to this one]
    #[arg(long)]
    exe: Option<PathBuf>,
    /// Idle connections the attacker keeps trying to hold
    #[arg(long, default_value_t = 1000)]
    idle: usize,
    /// Connections the attacker fills with random bytes
    #[arg(long, default_value_t = 100)]
    garbage: usize,
    /// Owner connects measured (each: connect, first batch, leave)
    #[arg(long, default_value_t = 30)]
    trials: usize,
    /// Consumers of the chaos run
    #[arg(long, default_value_t = 4)]
    chaos_consumers: usize,
    /// Epochs of the chaos run's stream (100 batches each, 1 ms a batch)
    #[arg(long, default_value_t = 300)]
    chaos_epochs: u64,
    /// Run as the attacker against this socket (used by the harness itself)
    #[arg(long, hide = true)]
    attack: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if let Some(socket) = &a.attack {
        attack(socket, a.idle, a.garbage);
    }
    let exe = a.exe.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .expect("own path")
            .with_file_name("batchcast")
    });
    let mut rows = Vec::new();
    if nix::unistd::geteuid().is_root() {
        rows.extend(under_attack(&exe, &a)?);
    } else {
        rows.push(row(
            "owner under attack",
            "not measured",
            "needs root to run the attacker as another uid",
        ));
    }
    rows.extend(chaos(&exe, &a)?);
    println!("\n| measure | value | note |\n| --- | --- | --- |");
    for r in rows {
        println!("| {} | {} | {} |", r.0, r.1, r.2);
    }
    Ok(())
}

type Row = (String, String, String);

fn row(a: &str, b: impl Into<String>, c: impl Into<String>) -> Row {
    (a.into(), b.into(), c.into())
}

/// The attacker (runs as another uid until killed): holds what it can of
/// `idle` silent connections and `garbage` noisy ones, replacing each one
/// the broker refuses or closes.
fn attack(socket: &Path, idle: usize, garbage: usize) -> ! {
    let mut quiet: Vec<UnixStream> = Vec::new();
    let mut noisy: Vec<UnixStream> = Vec::new();
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut junk = [0u8; 4096];
    loop {
        while quiet.len() < idle {
            match UnixStream::connect(socket) {
                Ok(s) => {
                    let _ = s.set_nonblocking(true);
                    quiet.push(s);
                }
                Err(_) => break,
            }
        }
        while noisy.len() < garbage {
            match UnixStream::connect(socket) {
                Ok(s) => {
                    let _ = s.set_nonblocking(true);
                    noisy.push(s);
                }
                Err(_) => break,
            }
        }
        // A refusal (bytes) or a close ends a connection: make another.
        let mut buf = [0u8; 512];
        quiet.retain_mut(
            |s| matches!(s.read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        );
        for b in junk.iter_mut() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            *b = seed as u8;
        }
        noisy.retain_mut(|s| {
            let alive =
                matches!(s.read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
            alive && s.write(&junk).is_ok()
        });
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn synthetic(extra: &str) -> String {
    let body = StreamToml::synthetic("train", 32, 100_000, &[("x", "u8", &[3, 64, 64])])
        .key("slots", 8)
        .to_toml();
    format!("[broker]\nallow_uids = [{GUEST}]\n{extra}\n{body}")
}

/// Connect, first batch, leave: seconds.
fn first_batch(socket: &Path) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let mut c = Consumer::connect(ConsumerOptions {
        socket: Some(socket.into()),
        stream: "train".into(),
        join: JoinPolicy::Immediate,
        connect_timeout: Duration::from_secs(5),
        ..Default::default()
    })?;
    let b = c.next().context("no batch")??;
    let s = t0.elapsed().as_secs_f64();
    drop(b);
    Ok(s)
}

fn median_max(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() - 1])
}

/// The attacker: a copy of this binary (one uid 65534 can run) against
/// `socket`.
fn start_attacker(dir: &Path, socket: &Path, a: &Args) -> anyhow::Result<Child> {
    let me = dir.join("hostile-attacker");
    std::fs::copy(std::env::current_exe()?, &me)?;
    std::fs::set_permissions(&me, std::fs::Permissions::from_mode(0o755))?;
    let (idle, garbage) = (a.idle.to_string(), a.garbage.to_string());
    Ok(Command::new(&me)
        .arg("--attack")
        .arg(socket)
        .args(["--idle", &idle, "--garbage", &garbage])
        .uid(GUEST)
        .gid(GUEST)
        .stdout(Stdio::null())
        .spawn()?)
}

/// Seconds from SIGINT to the broker's exit (`None`: still running after 30 s).
fn sigint_to_exit(broker: &mut BrokerProcess) -> anyhow::Result<Option<f64>> {
    let t0 = Instant::now();
    harness::signal(broker.pid(), nix::sys::signal::Signal::SIGINT);
    while t0.elapsed() < Duration::from_secs(30) {
        if broker.try_wait()?.is_some() {
            return Ok(Some(t0.elapsed().as_secs_f64()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(None)
}

fn under_attack(exe: &Path, a: &Args) -> anyhow::Result<Vec<Row>> {
    let dir = tempfile::tempdir()?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711))?;
    let cfg = dir.path().join("b.toml");
    std::fs::write(&cfg, synthetic(""))?;
    let socket = dir.path().join("b.sock");
    let mut broker = BrokerProcess::spawn(
        exe,
        Some(&cfg),
        &socket,
        Some(&dir.path().join("broker.log")),
    )?;
    // Before: the owner alone.
    let _ = first_batch(&socket)?;
    let quiet = (0..a.trials)
        .map(|_| first_batch(&socket))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let rss_quiet = harness::rss_kb(broker.pid()).unwrap_or(0);
    let mut attacker = start_attacker(dir.path(), &socket, a)?;
    std::thread::sleep(Duration::from_secs(2));
    let attacked = (0..a.trials)
        .map(|_| first_batch(&socket))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let t0 = Instant::now();
    let s = StatsClient::connect(Some(socket.clone()))?.fetch()?;
    let stats_s = t0.elapsed().as_secs_f64();
    let rss = harness::rss_kb(broker.pid()).unwrap_or(0);
    let guest_held = s
        .connections
        .by_uid
        .iter()
        .find(|(u, _)| *u == GUEST)
        .map_or(0, |(_, n)| *n);
    let exit_s = sigint_to_exit(&mut broker)?;
    let _ = attacker.kill();
    let _ = attacker.wait();
    let (q50, qmax) = median_max(quiet);
    let (a50, amax) = median_max(attacked);
    Ok(vec![
        row(
            "owner: connect to first batch, alone",
            format!("{:.2} ms p50, {:.2} ms max", 1e3 * q50, 1e3 * qmax),
            format!("{} trials", a.trials),
        ),
        row(
            &format!(
                "owner: connect to first batch, under attack ({} idle + {} garbage connections from uid {GUEST})",
                a.idle, a.garbage
            ),
            format!("{:.2} ms p50, {:.2} ms max", 1e3 * a50, 1e3 * amax),
            format!(
                "target < 100 ms; the attacker held {guest_held} connections (its share), {} refused so far",
                s.connections.refused
            ),
        ),
        row(
            "stats answer under attack",
            format!("{:.2} ms", 1e3 * stats_s),
            "",
        ),
        memory_row(rss, rss_quiet, &s.memory),
        row(
            "SIGINT to exit under attack",
            exit_s.map_or("did not exit in 30 s".into(), |e| {
                format!("{:.0} ms", 1e3 * e)
            }),
            "target < 2 s",
        ),
    ])
}

/// The broker's memory under attack, next to its memory alone.
fn memory_row(rss: u64, rss_quiet: u64, m: &batchcast::proto::MemoryStats) -> Row {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    row(
        "broker memory under attack",
        format!(
            "RSS {:.1} MiB (alone {:.1} MiB)",
            rss as f64 / 1024.0,
            rss_quiet as f64 / 1024.0
        ),
        format!(
            "budget {:.0} MiB, {:.0} MiB used (arenas {:.1}, frame buffers {:.0})",
            mib(m.budget_bytes),
            mib(m.used_bytes),
            mib(m.arenas_bytes),
            mib(m.frame_buffers_bytes)
        ),
    )
}

/// Each chaos consumer verifies and digests every batch, holding two of
/// a window of three.
const CHAOS_CONSUMER: [&str; 8] = [
    "--verify",
    "--digest",
    "--window",
    "3",
    "--hold",
    "2",
    "--sleep-ms",
    "1",
];

/// What the consumers alive at the end of the chaos run saw.
struct Survivors {
    verified: u64,
    failures: u64,
    order: usize,
    /// Complete epochs, and those whose digests differ between consumers.
    epochs: usize,
    differing: usize,
}

fn survivors(reports: &[ConsumerReport]) -> anyhow::Result<Survivors> {
    let mut by_epoch: std::collections::BTreeMap<u64, Vec<String>> = Default::default();
    let (mut verified, mut failures, mut order) = (0u64, 0u64, 0usize);
    for r in reports {
        if !r.ok {
            bail!("a surviving consumer failed: {r:#?}");
        }
        verified += r.verified_samples;
        failures += r.verify_failures;
        order += r.order_errors.len();
        for e in r.epochs.iter().filter(|e| e.complete) {
            by_epoch
                .entry(e.epoch)
                .or_default()
                .push(e.digest.clone().unwrap_or_default());
        }
    }
    Ok(Survivors {
        verified,
        failures,
        order,
        epochs: by_epoch.values().map(Vec::len).sum(),
        differing: by_epoch
            .values()
            .filter(|d| d.iter().any(|x| x != &d[0]))
            .count(),
    })
}

fn chaos(exe: &Path, a: &Args) -> anyhow::Result<Vec<Row>> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("b.toml");
    let body = StreamToml::synthetic(
        "train",
        10,
        1000,
        &[("x", "u8", &[3, 16, 16]), ("y", "i64", &[])],
    )
    .epochs(a.chaos_epochs)
    .key("slots", 6)
    .key("min_consumers", a.chaos_consumers as u64)
    .to_toml();
    std::fs::write(&cfg, body)?;
    let socket = dir.path().join("b.sock");
    let broker = BrokerProcess::spawn(
        exe,
        Some(&cfg),
        &socket,
        Some(&dir.path().join("broker.log")),
    )?;
    let args: Vec<String> = CHAOS_CONSUMER.map(String::from).to_vec();
    let spawn = || harness::spawn_consumer(exe, &socket, &args);
    let mut live: Vec<Child> = (0..a.chaos_consumers)
        .map(|_| spawn())
        .collect::<std::io::Result<_>>()?;
    let mut kills = 0u32;
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |lo: u64, hi: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        lo + rng % (hi - lo)
    };
    let t0 = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(next(500, 2500)));
        let s = broker.stats()?;
        if s.streams.first().is_none_or(|st| st.finished) {
            break;
        }
        let i = next(0, live.len() as u64) as usize;
        harness::signal(live[i].id(), nix::sys::signal::Signal::SIGKILL);
        let _ = live[i].wait();
        kills += 1;
        live[i] = spawn()?;
    }
    let took = t0.elapsed().as_secs_f64();
    let reports: Vec<ConsumerReport> = live
        .into_iter()
        .map(|c| harness::wait_report(c, Duration::from_secs(600)))
        .collect::<std::io::Result<_>>()?;
    let Survivors {
        verified,
        failures,
        order,
        epochs,
        differing,
    } = survivors(&reports)?;
    let s = broker.stats()?;
    let st = &s.streams[0];
    Ok(vec![row(
        &format!(
            "chaos: {} consumers, one SIGKILLed every 0.5–2.5 s",
            a.chaos_consumers
        ),
        format!("{kills} kills in {took:.0} s; {epochs} complete epochs checked"),
        format!(
            "{differing} epochs whose bytes differ between consumers, {failures} verify failures of {verified} samples, {order} order errors; broker: {} departed, {} slots in use at the end",
            st.departed, st.in_use
        ),
    )])
}
