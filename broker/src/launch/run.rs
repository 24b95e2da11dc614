//! One run of a sweep (shared, or the baseline): its brokers (started, or
//! a running one reused), its trainers, the loop that watches them until
//! every one has ended, and the run's summary.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use batchcast::StatsClient;
use batchcast::proto::{StatsReply, StreamStats};

use super::spec::{BrokerSource, OnFailure, Sweep};
use super::trainer::{State, Trainer, finished, refresh, rows, spawn_trainer, stop_all, summarise};
use super::view::View;
use super::{BrokerSummary, Mode, RunSummary, Stop, TrainerSummary};
use crate::harness::{self, BrokerProcess};

/// A broker the run talks to.
#[derive(Debug)]
pub(super) struct BrokerRun {
    process: Option<BrokerProcess>,
    pub(super) socket: PathBuf,
    client: Option<StatsClient>,
    pub(super) last: Option<StatsReply>,
    /// Consumer ids present before the run (a reused broker's earlier
    /// clients), left out of every trainer's numbers.
    pub(super) old_ids: HashSet<u64>,
    pid: u32,
    cpu_at_start: f64,
}

impl BrokerRun {
    pub(super) fn poll(&mut self) -> Option<&StatsReply> {
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

    pub(super) fn stream(&self, name: &str) -> Option<&StreamStats> {
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

/// Runs every trainer of `sweep` in `mode` until all have ended.
pub(super) fn run_mode(
    sweep: &Sweep,
    mode: Mode,
    dir: &Path,
    stop: &Stop,
    view: &mut View,
) -> anyhow::Result<RunSummary> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let exe = std::env::current_exe().context("cannot find the batchcast executable")?;
    let sockets = SocketDir::new(dir)?;
    let cpu_before = children_cpu_s();
    let t0 = Instant::now();
    let (mut brokers, assignment) = start_brokers(sweep, mode, dir, sockets.path(), &exe)?;
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
    let interrupted = supervise(sweep, stop, view, &mut trainers, &mut brokers, t0);
    view.clear();
    let wall = t0.elapsed().as_secs_f64();
    let (broker_summaries, reused_cpu) = stop_brokers(brokers);
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

/// The run's brokers, and which one each trainer uses (`None`: a trainer
/// with its own loader in the baseline).
fn start_brokers(
    sweep: &Sweep,
    mode: Mode,
    dir: &Path,
    sockets: &Path,
    exe: &Path,
) -> anyhow::Result<(Vec<BrokerRun>, Vec<Option<usize>>)> {
    let mut brokers: Vec<BrokerRun> = Vec::new();
    let mut assignment: Vec<Option<usize>> = Vec::new();
    match mode {
        Mode::Shared => {
            let b = match &sweep.broker {
                BrokerSource::Start {
                    config,
                    dir: cfg_dir,
                } => start_broker(
                    exe,
                    config,
                    cfg_dir,
                    &dir.join("broker.toml"),
                    &sockets.join("broker.sock"),
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
                    exe,
                    &config,
                    &cfg_dir,
                    &dir.join(format!("broker-{}.toml", t.name)),
                    &sockets.join(format!("{i}.sock")),
                    &dir.join(format!("broker-{}.log", t.name)),
                )?;
                assignment.push(Some(brokers.len()));
                brokers.push(b);
            }
        }
    }
    Ok((brokers, assignment))
}

/// Watches the trainers until every one has ended: reports each end,
/// applies the failure policy and Ctrl-C, and redraws the table each
/// second. Returns whether the run was interrupted.
fn supervise(
    sweep: &Sweep,
    stop: &Stop,
    view: &mut View,
    trainers: &mut [Trainer],
    brokers: &mut [BrokerRun],
    t0: Instant,
) -> bool {
    let mut interrupted = false;
    let mut last_refresh = Instant::now() - Duration::from_secs(1);
    loop {
        if stop.requested() && !interrupted {
            interrupted = true;
            view.event("interrupted: stopping every trainer, then the broker");
            stop_all(trainers, sweep.grace_s, stop);
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
            failed_now |= trainer_ended(i, status, trainers, brokers, view);
        }
        if failed_now && sweep.on_failure == OnFailure::StopAll && !interrupted {
            let left = trainers.iter().filter(|t| t.child.is_some()).count();
            if left > 0 {
                view.event(&format!(
                    "on_failure = \"stop-all\": stopping the {left} other trainer{}",
                    plural(left)
                ));
                stop_all(trainers, sweep.grace_s, stop);
            }
        }
        let all_done = trainers.iter().all(|t| t.child.is_none());
        if all_done || last_refresh.elapsed() >= Duration::from_secs(1) {
            last_refresh = Instant::now();
            for b in brokers.iter_mut() {
                b.poll();
            }
            for t in trainers.iter_mut() {
                match t.broker {
                    Some(b) => refresh(t, &brokers[b]),
                    // Its own loader (a baseline): what it reports.
                    None => super::trainer::refresh_from_report(t),
                }
            }
            if !all_done {
                view.table(&rows(trainers), t0.elapsed());
            }
        }
        if all_done {
            return interrupted;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Trainer `i` exited with `status`: records it, lets its stream stop
/// waiting for it if it never subscribed, and says so. Whether it failed.
fn trainer_ended(
    i: usize,
    status: ExitStatus,
    trainers: &mut [Trainer],
    brokers: &mut [BrokerRun],
    view: &mut View,
) -> bool {
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
            view.event(&format!(
                "{} FAILED ({why}); last lines of {}:\n{}",
                t.plan.name,
                t.log.display(),
                indent(t.log_tail.as_deref().unwrap_or(""))
            ));
            true
        }
        State::Done => {
            view.event(&format!(
                "{} done in {:.1} s",
                t.plan.name,
                t.ended
                    .unwrap_or(t.started)
                    .duration_since(t.started)
                    .as_secs_f64()
            ));
            false
        }
        _ => false,
    }
}

/// Stops the brokers this run started, with each one's summary; and the
/// CPU a reused broker spent meanwhile (not a child of this process).
fn stop_brokers(brokers: Vec<BrokerRun>) -> (Vec<BrokerSummary>, f64) {
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
        if let Some(mut p) = b.process
            && let Err(e) = p.terminate(Duration::from_secs(10))
        {
            tracing::warn!("stopping the broker: {e}");
        }
    }
    (broker_summaries, reused_cpu)
}

pub(super) fn plural(n: usize) -> &'static str {
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

/// Where the brokers' sockets go: the run folder's `sockets/` when their
/// paths fit a socket address (108 bytes), so a launcher killed with
/// SIGKILL leaves nothing outside its run folder; else a short private
/// folder in the temporary directory, removed when the run ends.
enum SocketDir {
    InRun(PathBuf),
    Temp(tempfile::TempDir),
}

impl SocketDir {
    /// The longest socket name a run uses (`broker.sock`, `N.sock`).
    const NAME: usize = 16;
    const MAX_PATH: usize = 107;

    fn new(run: &Path) -> anyhow::Result<SocketDir> {
        let dir = std::path::absolute(run.join("sockets")).unwrap_or_else(|_| run.join("sockets"));
        if dir.as_os_str().len() + 1 + Self::NAME <= Self::MAX_PATH {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            return Ok(SocketDir::InRun(dir));
        }
        tempfile::Builder::new()
            .prefix("batchcast-launch-")
            .tempdir()
            .map(SocketDir::Temp)
            .context("creating a folder for the broker sockets")
    }

    fn path(&self) -> &Path {
        match self {
            SocketDir::InRun(p) => p,
            SocketDir::Temp(t) => t.path(),
        }
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        if let SocketDir::InRun(p) = self {
            // Empty once the brokers removed their sockets.
            let _ = std::fs::remove_dir(p);
        }
    }
}
