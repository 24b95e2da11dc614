//! `batchcast launch SWEEP.toml`: start a broker and a sweep of trainers
//! subscribed to it, show what each is doing, survive a trainer failing,
//! and end with a summary (and, with `--baseline`, the same sweep with an
//! independent pipeline per trainer, side by side).
//!
//! Every child runs in its own process group, so Ctrl-C on the terminal
//! reaches only the launcher, which stops the trainers (SIGTERM to each
//! group, SIGKILL after the grace period) and then the broker, in that
//! order. Arenas are memfds: they vanish with the last process mapping
//! them, so nothing is left in shared memory.

pub mod spec;
mod view;

use std::collections::HashSet;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use batchcast::StatsClient;
use batchcast::proto::{StatsReply, StreamStats};
use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use crate::harness::{self, BrokerProcess};
use spec::{BrokerSource, Host, OnFailure, Sweep, TrainerPlan};
use view::View;

#[derive(Debug, Clone, clap::Args)]
pub struct LaunchArgs {
    /// The sweep file (see examples/sweep-rust.toml)
    pub file: PathBuf,
    /// Then run the same sweep again with an independent pipeline per
    /// trainer (its `baseline_command`, else a private broker each) and
    /// compare the two runs
    #[arg(long)]
    pub baseline: bool,
    /// Write logs and summary.json in this folder [default: a new folder
    /// under the sweep's run_dir]
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
}

/// Exit codes of `batchcast launch`.
pub mod exit {
    /// Every trainer finished successfully.
    pub const OK: i32 = 0;
    /// Some trainers failed; the others ran to the end (`on_failure = "continue"`).
    pub const FAILED: i32 = 2;
    /// A trainer failed and every other one was stopped (`"stop-all"`).
    pub const STOPPED: i32 = 3;
    /// Interrupted (SIGINT or SIGTERM); everything was stopped.
    pub const INTERRUPTED: i32 = 130;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// One broker, every trainer subscribed to it.
    Shared,
    /// Every trainer with its own pipeline.
    Baseline,
}

/// One trainer's run, as `summary.json` records it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerSummary {
    pub name: String,
    pub command: Vec<String>,
    pub stream: String,
    pub gpu: Option<String>,
    pub log: PathBuf,
    /// `done`, `failed`, `stopped` (by the launcher) or `killed`.
    pub state: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub wall_s: f64,
    pub batches: u64,
    pub samples: u64,
    pub samples_per_s: f64,
    /// Share of its loop time spent waiting for data.
    pub stall_pct: f64,
    pub wait_s: f64,
    pub busy_s: f64,
    /// Where the numbers come from: `broker` (its stats), `report` (the
    /// trainer's `$BATCHCAST_REPORT` file) or `none`.
    pub measured_by: String,
    /// The end of its log, when it failed.
    pub log_tail: Option<String>,
}

/// One broker of a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BrokerSummary {
    pub socket: PathBuf,
    pub pid: u32,
    /// Started by this launch (else an already running broker was used).
    pub started: bool,
    pub cpu_s: f64,
    pub batches_produced: u64,
    pub deliveries: u64,
    pub images_decoded: u64,
    pub cache_hits: u64,
    pub bad_files_skipped: u64,
}

/// One run of the sweep.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSummary {
    pub mode: Mode,
    pub dir: PathBuf,
    pub wall_s: f64,
    pub samples: u64,
    pub samples_per_s: f64,
    /// CPU seconds of every process of the run: brokers, trainers and
    /// their children.
    pub cpu_s: f64,
    pub cpu_ms_per_sample: Option<f64>,
    pub failed: usize,
    pub interrupted: bool,
    pub trainers: Vec<TrainerSummary>,
    pub brokers: Vec<BrokerSummary>,
}

/// Shared vs baseline.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Comparison {
    /// Baseline wall time / shared wall time.
    pub speedup: f64,
    /// Shared aggregate samples/s / baseline's.
    pub throughput_ratio: f64,
    /// Shared CPU per sample / baseline's (below 1: cheaper).
    pub cpu_per_sample_ratio: Option<f64>,
}

/// `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub sweep: PathBuf,
    pub on_failure: OnFailure,
    pub exit_code: i32,
    pub shared: RunSummary,
    pub baseline: Option<RunSummary>,
    pub comparison: Option<Comparison>,
}

/// Runs the sweep; returns the exit code (see [`exit`]). Errors are what
/// stops a launch before or outside the trainers (a bad sweep file, a
/// broker that will not start).
pub fn run(args: &LaunchArgs) -> anyhow::Result<i32> {
    let host = Host::detect().context("cannot find the batchcast executable")?;
    let sweep = Sweep::load(&args.file, &host)?;
    let stop = Stop::install()?;
    let dir = match &args.run_dir {
        Some(d) => d.clone(),
        None => new_run_dir(&sweep.run_dir)?,
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let summary = launch(&sweep, args.baseline, &dir, &stop)?;
    let path = dir.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("writing {}", path.display()))?;
    println!("summary: {}", path.display());
    Ok(summary.exit_code)
}

/// Runs `sweep` shared (and then baseline, if asked) with logs under
/// `dir`; prints the summaries and the comparison.
pub fn launch(sweep: &Sweep, baseline: bool, dir: &Path, stop: &Stop) -> anyhow::Result<Summary> {
    let mut view = View::new();
    let shared = run_mode(sweep, Mode::Shared, &dir.join("shared"), stop, &mut view)?;
    view::print_run(&shared);
    let mut exit_code = exit_code_of(&shared, sweep.on_failure);
    let base = if baseline && !shared.interrupted {
        let b = run_mode(
            sweep,
            Mode::Baseline,
            &dir.join("baseline"),
            stop,
            &mut view,
        )?;
        view::print_run(&b);
        if exit_code == exit::OK {
            exit_code = exit_code_of(&b, sweep.on_failure);
        }
        Some(b)
    } else {
        None
    };
    let comparison = base.as_ref().map(|b| compare(&shared, b));
    if let (Some(b), Some(c)) = (&base, &comparison) {
        view::print_comparison(&shared, b, c);
    }
    Ok(Summary {
        sweep: sweep.path.clone(),
        on_failure: sweep.on_failure,
        exit_code,
        shared,
        baseline: base,
        comparison,
    })
}

fn exit_code_of(run: &RunSummary, policy: OnFailure) -> i32 {
    if run.interrupted {
        exit::INTERRUPTED
    } else if run.failed == 0 {
        exit::OK
    } else if policy == OnFailure::StopAll {
        exit::STOPPED
    } else {
        exit::FAILED
    }
}

fn compare(shared: &RunSummary, base: &RunSummary) -> Comparison {
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    Comparison {
        speedup: ratio(base.wall_s, shared.wall_s),
        throughput_ratio: ratio(shared.samples_per_s, base.samples_per_s),
        cpu_per_sample_ratio: match (shared.cpu_ms_per_sample, base.cpu_ms_per_sample) {
            (Some(s), Some(b)) if b > 0.0 => Some(s / b),
            _ => None,
        },
    }
}

/// `RUN_DIR/<date>-<time>[-n]`, new.
fn new_run_dir(base: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(base).with_context(|| format!("creating {}", base.display()))?;
    let stamp = timestamp();
    for n in 0..1000 {
        let d = if n == 0 {
            base.join(&stamp)
        } else {
            base.join(format!("{stamp}-{n}"))
        };
        match std::fs::create_dir(&d) {
            Ok(()) => return Ok(d),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating {}", d.display())),
        }
    }
    bail!("{} holds too many runs named {stamp}", base.display())
}

/// Local time as `YYYYmmdd-HHMMSS` (UTC if the zone is unknown).
fn timestamp() -> String {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME)
        .map(|t| t.tv_sec())
        .unwrap_or(0);
    let days = now.div_euclid(86_400);
    let secs = now.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// SIGINT/SIGTERM, noticed by polling: the first asks for a clean stop,
/// a second one for an immediate kill.
#[derive(Debug, Clone)]
pub struct Stop {
    count: Arc<AtomicUsize>,
}

impl Stop {
    pub fn install() -> anyhow::Result<Stop> {
        let count = Arc::new(AtomicUsize::new(0));
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            let c = count.clone();
            let flag = Arc::new(AtomicBool::new(false));
            signal_hook::flag::register(sig, flag.clone())
                .context("installing a signal handler")?;
            // Count each delivery: a watcher thread turns the flag into a count.
            std::thread::Builder::new()
                .name("signals".into())
                .spawn(move || {
                    loop {
                        if flag.swap(false, Ordering::SeqCst) {
                            c.fetch_add(1, Ordering::SeqCst);
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                })
                .context("starting the signal watcher")?;
        }
        Ok(Stop { count })
    }

    /// A stop nobody can trigger (for callers that handle signals themselves).
    pub fn never() -> Stop {
        Stop {
            count: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn requested(&self) -> bool {
        self.count.load(Ordering::SeqCst) > 0
    }

    fn urgent(&self) -> bool {
        self.count.load(Ordering::SeqCst) > 1
    }
}

/// A broker the run talks to.
#[derive(Debug)]
struct BrokerRun {
    process: Option<BrokerProcess>,
    socket: PathBuf,
    client: Option<StatsClient>,
    last: Option<StatsReply>,
    /// Consumer ids present before the run (a reused broker's earlier
    /// clients), left out of every trainer's numbers.
    old_ids: HashSet<u64>,
    pid: u32,
    cpu_at_start: f64,
}

impl BrokerRun {
    fn poll(&mut self) -> Option<&StatsReply> {
        if self.client.is_none() {
            self.client = StatsClient::connect(Some(self.socket.clone())).ok();
        }
        match self.client.as_mut().map(|c| c.fetch()) {
            Some(Ok(s)) => self.last = Some(s),
            Some(Err(_)) => self.client = None,
            None => {}
        }
        self.last.as_ref()
    }

    fn stream(&self, name: &str) -> Option<&StreamStats> {
        self.last.as_ref()?.streams.iter().find(|s| s.name == name)
    }

    fn set_min_consumers(&mut self, stream: &str, min: u32) {
        if let Some(c) = self.client.as_mut() {
            match c.set_min_consumers(stream, min) {
                Ok(s) => self.last = Some(s),
                Err(e) => tracing::warn!("asking the broker to start `{stream}`: {e}"),
            }
        }
    }
}

/// What the broker says about one trainer (summed over its subscriptions
/// to its stream).
#[derive(Debug, Clone, Default)]
struct Seen {
    subscribed: bool,
    connected: bool,
    batches: u64,
    samples: u64,
    epoch: u64,
    held: u32,
    wait_s: f64,
    busy_s: f64,
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    Starting,
    Running,
    Done,
    Failed(String),
    /// Stopped by the launcher (a failure elsewhere, or Ctrl-C).
    Stopped,
}

#[derive(Debug)]
struct Trainer {
    plan: TrainerPlan,
    argv: Vec<String>,
    child: Option<Child>,
    pid: u32,
    /// Index into the run's brokers; `None` for a trainer with its own loader.
    broker: Option<usize>,
    log: PathBuf,
    report: PathBuf,
    started: Instant,
    ended: Option<Instant>,
    status: Option<ExitStatus>,
    state: State,
    stopping: bool,
    seen: Seen,
    /// (when, samples) at the previous refresh, for the current rate.
    prev: (Instant, u64),
    rate: f64,
    log_tail: Option<String>,
}

fn run_mode(
    sweep: &Sweep,
    mode: Mode,
    dir: &Path,
    stop: &Stop,
    view: &mut View,
) -> anyhow::Result<RunSummary> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let exe = std::env::current_exe().context("cannot find the batchcast executable")?;
    // Socket paths are limited to 108 bytes: keep them in a short private
    // folder rather than in a possibly deep run folder.
    let sockets = tempfile::Builder::new()
        .prefix("batchcast-launch-")
        .tempdir()
        .context("creating a folder for the broker sockets")?;
    let cpu_before = children_cpu_s();
    let t0 = Instant::now();
    let mut brokers: Vec<BrokerRun> = Vec::new();
    let mut assignment: Vec<Option<usize>> = Vec::new();
    match mode {
        Mode::Shared => {
            let b = match &sweep.broker {
                BrokerSource::Start {
                    config,
                    dir: cfg_dir,
                } => start_broker(
                    &exe,
                    config,
                    cfg_dir,
                    &dir.join("broker.toml"),
                    &sockets.path().join("broker.sock"),
                    &dir.join("broker.log"),
                )?,
                BrokerSource::Reuse(sock) => reuse_broker(sock)?,
            };
            brokers.push(b);
            assignment.resize(sweep.trainers.len(), Some(0));
        }
        Mode::Baseline => {
            for (i, t) in sweep.trainers.iter().enumerate() {
                if t.baseline_argv.is_some() {
                    assignment.push(None);
                    continue;
                }
                let Some((config, cfg_dir)) = sweep.private_config() else {
                    bail!(
                        "--baseline: trainer `{}` has no baseline_command, and the sweep uses a running broker (socket = …), so there is no config to start a private broker with; give it a baseline_command",
                        t.name
                    );
                };
                let b = start_broker(
                    &exe,
                    &config,
                    &cfg_dir,
                    &dir.join(format!("broker-{}.toml", t.name)),
                    &sockets.path().join(format!("{i}.sock")),
                    &dir.join(format!("broker-{}.log", t.name)),
                )?;
                assignment.push(Some(brokers.len()));
                brokers.push(b);
            }
        }
    }
    view.event(&format!(
        "{} run: {} trainer{}, {} broker{}; logs in {}",
        match mode {
            Mode::Shared => "shared",
            Mode::Baseline => "baseline",
        },
        sweep.trainers.len(),
        plural(sweep.trainers.len()),
        brokers.len(),
        plural(brokers.len()),
        dir.display()
    ));
    let mut trainers = Vec::new();
    for (plan, b) in sweep.trainers.iter().zip(assignment) {
        let socket = b.map(|i| brokers[i].socket.clone());
        match spawn_trainer(plan, mode, socket.as_deref(), dir) {
            Ok(t) => trainers.push(Trainer { broker: b, ..t }),
            Err(e) => {
                stop_all(&mut trainers, sweep.grace_s, stop);
                return Err(e).with_context(|| format!("starting trainer `{}`", plan.name));
            }
        }
    }

    let mut interrupted = false;
    let mut last_refresh = Instant::now() - Duration::from_secs(1);
    loop {
        if stop.requested() && !interrupted {
            interrupted = true;
            view.event("interrupted: stopping every trainer, then the broker");
            stop_all(&mut trainers, sweep.grace_s, stop);
        }
        let mut failed_now = false;
        for i in 0..trainers.len() {
            let Some(status) = trainers[i]
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            else {
                continue;
            };
            finished(&mut trainers[i], status);
            // Fresh numbers: did it ever subscribe, and is its stream
            // still waiting for it?
            if let Some(b) = trainers[i].broker {
                brokers[b].poll();
                refresh(&mut trainers[i], &brokers[b]);
                let stream = trainers[i].plan.stream.clone();
                // The stream waits for every trainer on it: one that
                // will never subscribe again must not be waited for.
                let coming = trainers
                    .iter()
                    .filter(|t| t.broker == Some(b) && t.plan.stream == stream && t.child.is_some())
                    .count();
                if coming > 0
                    && brokers[b]
                        .stream(&stream)
                        .is_some_and(|s| s.batches_produced == 0 && !s.finished)
                {
                    view.event(&format!(
                        "{} left before stream `{stream}` started: it now waits for the {coming} other trainer{}",
                        trainers[i].plan.name,
                        plural(coming)
                    ));
                    brokers[b].set_min_consumers(&stream, coming as u32);
                }
            }
            let t = &trainers[i];
            match &t.state {
                State::Failed(why) => {
                    failed_now = true;
                    view.event(&format!(
                        "{} FAILED ({why}); last lines of {}:\n{}",
                        t.plan.name,
                        t.log.display(),
                        indent(t.log_tail.as_deref().unwrap_or(""))
                    ));
                }
                State::Done => view.event(&format!(
                    "{} done in {:.1} s",
                    t.plan.name,
                    t.ended
                        .unwrap_or(t.started)
                        .duration_since(t.started)
                        .as_secs_f64()
                )),
                _ => {}
            }
        }
        if failed_now && sweep.on_failure == OnFailure::StopAll && !interrupted {
            let left = trainers.iter().filter(|t| t.child.is_some()).count();
            if left > 0 {
                view.event(&format!(
                    "on_failure = \"stop-all\": stopping the {left} other trainer{}",
                    plural(left)
                ));
                stop_all(&mut trainers, sweep.grace_s, stop);
            }
        }
        let all_done = trainers.iter().all(|t| t.child.is_none());
        if all_done || last_refresh.elapsed() >= Duration::from_secs(1) {
            last_refresh = Instant::now();
            for b in brokers.iter_mut() {
                b.poll();
            }
            for t in trainers.iter_mut() {
                if let Some(b) = t.broker {
                    refresh(t, &brokers[b]);
                }
            }
            if !all_done {
                view.table(&rows(&trainers), t0.elapsed());
            }
        }
        if all_done {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    view.clear();
    let wall = t0.elapsed().as_secs_f64();

    let mut broker_summaries = Vec::new();
    let mut reused_cpu = 0.0;
    for b in brokers {
        let cpu_end = harness::cpu_seconds(b.pid).unwrap_or(b.cpu_at_start);
        let st = b.last.as_ref();
        let started = b.process.is_some();
        if !started {
            reused_cpu += cpu_end - b.cpu_at_start;
        }
        let sum = |f: &dyn Fn(&StreamStats) -> u64| -> u64 {
            st.map(|s| s.streams.iter().map(f).sum()).unwrap_or(0)
        };
        broker_summaries.push(BrokerSummary {
            socket: b.socket.clone(),
            pid: b.pid,
            started,
            cpu_s: cpu_end - b.cpu_at_start,
            batches_produced: sum(&|s| s.batches_produced),
            deliveries: sum(&|s| s.deliveries),
            images_decoded: sum(&|s| s.source.as_ref().map_or(0, |x| x.decoded)),
            cache_hits: sum(&|s| s.source.as_ref().map_or(0, |x| x.cache_hits)),
            bad_files_skipped: sum(&|s| s.source.as_ref().map_or(0, |x| x.skipped)),
        });
        if let Some(p) = b.process
            && let Err(e) = p.terminate(Duration::from_secs(10))
        {
            tracing::warn!("stopping the broker: {e}");
        }
    }
    let cpu_s = (children_cpu_s() - cpu_before) + reused_cpu;
    let trainer_summaries: Vec<TrainerSummary> = trainers.iter().map(summarise).collect();
    let samples: u64 = trainer_summaries.iter().map(|t| t.samples).sum();
    Ok(RunSummary {
        mode,
        dir: dir.to_path_buf(),
        wall_s: wall,
        samples,
        samples_per_s: samples as f64 / wall.max(1e-9),
        cpu_s,
        cpu_ms_per_sample: (samples > 0).then(|| cpu_s * 1e3 / samples as f64),
        failed: trainers
            .iter()
            .filter(|t| matches!(t.state, State::Failed(_)))
            .count(),
        interrupted,
        trainers: trainer_summaries,
        brokers: broker_summaries,
    })
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("    | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn start_broker(
    exe: &Path,
    config: &str,
    cfg_dir: &Path,
    config_copy: &Path,
    socket: &Path,
    log: &Path,
) -> anyhow::Result<BrokerRun> {
    std::fs::write(config_copy, config)
        .with_context(|| format!("writing {}", config_copy.display()))?;
    let config_copy = std::path::absolute(config_copy)?;
    let process = BrokerProcess::spawn_in(exe, Some(&config_copy), socket, Some(log), cfg_dir)
        .with_context(|| format!("starting the broker (config {})", config_copy.display()))?;
    let pid = process.pid();
    let mut b = BrokerRun {
        process: Some(process),
        socket: socket.into(),
        client: None,
        last: None,
        old_ids: HashSet::new(),
        pid,
        cpu_at_start: 0.0,
    };
    b.poll();
    Ok(b)
}

fn reuse_broker(socket: &Path) -> anyhow::Result<BrokerRun> {
    let mut client = StatsClient::connect(Some(socket.into()))
        .with_context(|| format!("[launch] socket: no broker answers on {}", socket.display()))?;
    let stats = client.fetch()?;
    let old_ids = stats
        .streams
        .iter()
        .flat_map(|s| s.consumers.iter().chain(&s.past_consumers).map(|c| c.id))
        .collect();
    let pid = stats.broker_pid;
    Ok(BrokerRun {
        process: None,
        socket: socket.into(),
        client: Some(client),
        last: Some(stats),
        old_ids,
        pid,
        cpu_at_start: harness::cpu_seconds(pid).unwrap_or(0.0),
    })
}

fn spawn_trainer(
    plan: &TrainerPlan,
    mode: Mode,
    socket: Option<&Path>,
    dir: &Path,
) -> anyhow::Result<Trainer> {
    let log = dir.join(format!("{}.log", plan.name));
    let report = std::path::absolute(dir.join(format!("{}.report.json", plan.name)))?;
    let _ = std::fs::remove_file(&report);
    let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let argv = match (mode, &plan.baseline_argv) {
        (Mode::Baseline, Some(b)) => b.clone(),
        _ => plan.argv.clone(),
    };
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .current_dir(&plan.cwd)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .process_group(0)
        .env("BATCHCAST_NAME", &plan.name)
        .env("BATCHCAST_STREAM", &plan.stream)
        .env("BATCHCAST_REPORT", &report)
        .env(
            "BATCHCAST_MODE",
            match mode {
                Mode::Shared => "shared",
                Mode::Baseline => "baseline",
            },
        );
    if std::env::var_os("BATCHCAST_CONNECT_TIMEOUT").is_none() {
        cmd.env("BATCHCAST_CONNECT_TIMEOUT", "60");
    }
    match socket {
        Some(s) => cmd.env("BATCHCAST_SOCKET", std::path::absolute(s)?),
        None => cmd.env_remove("BATCHCAST_SOCKET"),
    };
    if let Some(g) = &plan.gpu {
        cmd.env("CUDA_VISIBLE_DEVICES", g);
    }
    crate::child::die_with_parent(&mut cmd);
    for (k, v) in &plan.env {
        cmd.env(k, v);
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("running {:?} in {}", argv, plan.cwd.display()))?;
    let now = Instant::now();
    Ok(Trainer {
        plan: plan.clone(),
        argv,
        pid: child.id(),
        child: Some(child),
        broker: None,
        log,
        report,
        started: now,
        ended: None,
        status: None,
        state: State::Starting,
        stopping: false,
        seen: Seen::default(),
        prev: (now, 0),
        rate: 0.0,
        log_tail: None,
    })
}

/// Records a trainer's exit.
fn finished(t: &mut Trainer, status: ExitStatus) {
    t.child = None;
    t.ended = Some(Instant::now());
    t.status = Some(status);
    t.state = if status.success() {
        State::Done
    } else if t.stopping {
        State::Stopped
    } else {
        t.log_tail = Some(tail(&t.log, 12));
        State::Failed(describe(status))
    };
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => match Signal::try_from(s) {
            Ok(sig) => format!("killed by {sig}"),
            Err(_) => format!("killed by signal {s}"),
        },
        _ => status.to_string(),
    }
}

/// The last `n` lines of a file (at most its last 16 KiB).
fn tail(path: &Path, n: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(16 * 1024)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// SIGTERM to every live trainer's process group, then SIGKILL to those
/// still there after `grace` seconds (at once on a second Ctrl-C).
fn stop_all(trainers: &mut [Trainer], grace: f64, stop: &Stop) {
    for t in trainers.iter_mut().filter(|t| t.child.is_some()) {
        t.stopping = true;
        killpg(t.pid, Signal::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs_f64(grace);
    loop {
        let mut alive = false;
        for t in trainers.iter_mut() {
            if let Some(status) = t.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                finished(t, status);
            }
            alive |= t.child.is_some();
        }
        if !alive {
            break;
        }
        if Instant::now() >= deadline || stop.urgent() {
            for t in trainers.iter_mut().filter(|t| t.child.is_some()) {
                killpg(t.pid, Signal::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Whatever the trainers started in their groups goes too.
    for t in trainers.iter() {
        killpg(t.pid, Signal::SIGKILL);
    }
}

fn killpg(pgid: u32, sig: Signal) {
    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid as i32), sig);
}

/// CPU seconds (user + system) of every child process waited for so far.
fn children_cpu_s() -> f64 {
    match nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN) {
        Ok(u) => {
            let tv = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 * 1e-6;
            tv(u.user_time()) + tv(u.system_time())
        }
        Err(_) => 0.0,
    }
}

/// Updates a trainer's numbers from its broker's latest stats.
fn refresh(t: &mut Trainer, b: &BrokerRun) {
    let Some(st) = b.stream(&t.plan.stream) else {
        return;
    };
    let mut seen = Seen::default();
    for c in st
        .consumers
        .iter()
        .chain(&st.past_consumers)
        .filter(|c| c.name == t.plan.name && !b.old_ids.contains(&c.id))
    {
        seen.subscribed = true;
        seen.connected |= c.left.is_none();
        seen.batches += c.delivered;
        seen.samples += c.samples;
        seen.epoch = seen.epoch.max(c.epoch);
        seen.held += c.held;
        seen.wait_s += c.wait_s;
        seen.busy_s += c.busy_s;
    }
    if !seen.subscribed {
        return;
    }
    let now = Instant::now();
    let dt = now.duration_since(t.prev.0).as_secs_f64();
    if dt >= 0.5 {
        t.rate = seen.samples.saturating_sub(t.prev.1) as f64 / dt;
        t.prev = (now, seen.samples);
    }
    if t.state == State::Starting {
        t.state = State::Running;
    }
    t.seen = seen;
}

/// What a trainer may write to `$BATCHCAST_REPORT` when the broker does
/// not see its data (its own loader, in a baseline run).
#[derive(Debug, Deserialize)]
struct TrainerReport {
    samples: u64,
    #[serde(default)]
    batches: u64,
    #[serde(default)]
    wait_s: f64,
    #[serde(default)]
    busy_s: f64,
}

fn summarise(t: &Trainer) -> TrainerSummary {
    let wall = t
        .ended
        .unwrap_or_else(Instant::now)
        .duration_since(t.started)
        .as_secs_f64();
    let report: Option<TrainerReport> = std::fs::read_to_string(&t.report)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok());
    let (measured_by, batches, samples, wait_s, busy_s) = match (&report, t.seen.subscribed) {
        (_, true) => (
            "broker",
            t.seen.batches,
            t.seen.samples,
            t.seen.wait_s,
            t.seen.busy_s,
        ),
        (Some(r), false) => ("report", r.batches, r.samples, r.wait_s, r.busy_s),
        (None, false) => ("none", 0, 0, 0.0, 0.0),
    };
    let total = wait_s + busy_s;
    TrainerSummary {
        name: t.plan.name.clone(),
        command: t.argv.clone(),
        stream: t.plan.stream.clone(),
        gpu: t.plan.gpu.clone(),
        log: t.log.clone(),
        state: match &t.state {
            State::Done => "done",
            State::Failed(_) => "failed",
            State::Stopped => "stopped",
            State::Starting | State::Running => "killed",
        }
        .into(),
        exit_code: t.status.and_then(|s| s.code()),
        signal: t.status.and_then(|s| s.signal()),
        wall_s: wall,
        batches,
        samples,
        samples_per_s: samples as f64 / wall.max(1e-9),
        stall_pct: if total > 0.0 {
            100.0 * wait_s / total
        } else {
            0.0
        },
        wait_s,
        busy_s,
        measured_by: measured_by.into(),
        log_tail: t.log_tail.clone(),
    }
}

fn rows(trainers: &[Trainer]) -> Vec<view::Row> {
    trainers
        .iter()
        .map(|t| {
            let total = t.seen.wait_s + t.seen.busy_s;
            view::Row {
                name: t.plan.name.clone(),
                state: match &t.state {
                    State::Starting => "starting".into(),
                    State::Running if !t.seen.connected => "finishing".into(),
                    State::Running => "running".into(),
                    State::Done => "done".into(),
                    State::Failed(why) => format!("FAILED: {why}"),
                    State::Stopped => "stopped".into(),
                },
                epoch: t.seen.subscribed.then_some(t.seen.epoch),
                batches: t.seen.batches,
                rate: if t.child.is_some() { t.rate } else { 0.0 },
                stall_pct: (total > 0.0).then(|| 100.0 * t.seen.wait_s / total),
                held: t.seen.held,
                gpu: t.plan.gpu.clone(),
            }
        })
        .collect()
}
