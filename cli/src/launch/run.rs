//! One run of a sweep (shared, or the baseline): its brokers (started, or
//! a running one reused), its trainers, the loop that watches them until
//! every one has ended, and the run's summary.

use std::path::Path;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::brokers::{BrokerRun, SocketDir, reuse_broker, start_broker, stop_brokers};
use super::spec::{BrokerSource, OnFailure, Sweep};
use super::trainer::{State, Trainer, finished, refresh, rows, spawn_trainer, stop_all, summarise};
use super::view::View;
use super::{Mode, RunSummary, Stop, TrainerSummary};
use batchcast_cli::report::{TIMELINE_TICKS, Tick};

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
    let mut timeline = Timeline::default();
    let interrupted = supervise(
        sweep,
        stop,
        view,
        (&mut trainers, &mut brokers),
        (t0, &mut timeline),
    );
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
        timeline: timeline.ticks,
        events: view.said_since(t0),
    })
}

/// The run over time: a tick at each refresh, at most
/// [`TIMELINE_TICKS`]; past that every other goes and ticks come half as
/// often.
#[derive(Default)]
struct Timeline {
    ticks: Vec<Tick>,
    /// Refreshes per tick kept, and refreshes since the last one.
    every: u32,
    skipped: u32,
}

impl Timeline {
    fn record(&mut self, t0: Instant, trainers: &[Trainer], brokers: &[BrokerRun]) {
        self.skipped += 1;
        if self.skipped < self.every.max(1) {
            return;
        }
        self.skipped = 0;
        self.ticks.push(Tick {
            t_s: t0.elapsed().as_secs_f64(),
            trainers: trainers.iter().map(super::trainer::tick).collect(),
            brokers: brokers.iter().map(BrokerRun::tick).collect(),
        });
        if self.ticks.len() > TIMELINE_TICKS {
            let kept = self.ticks.iter().step_by(2).cloned().collect();
            self.ticks = kept;
            self.every = self.every.max(1) * 2;
        }
    }
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
            // Where to point `batchcast stats` and `doctor` while it runs.
            eprintln!(
                "broker socket: {0} (batchcast stats --socket {0}; batchcast doctor --socket {0})",
                b.socket.display()
            );
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
    (trainers, brokers): (&mut [Trainer], &mut [BrokerRun]),
    (t0, timeline): (Instant, &mut Timeline),
) -> bool {
    let mut interrupted = false;
    let mut restarts_left = sweep.broker_restarts;
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
            for (i, b) in brokers.iter_mut().enumerate() {
                if !interrupted && !all_done && b.restart_if_dead(&mut restarts_left) {
                    wait_only_for_live_trainers(b, i, trainers);
                }
                b.poll();
                for news in b.news.drain(..) {
                    view.event(&news);
                }
            }
            for t in trainers.iter_mut() {
                match t.broker {
                    Some(b) => {
                        for news in refresh(t, &brokers[b]) {
                            view.event(&news);
                        }
                    }
                    // Its own loader (a baseline): what it reports.
                    None => super::trainer::refresh_from_report(t),
                }
            }
            timeline.record(t0, trainers, brokers);
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

/// A broker started again (broker `b` of the run) holds each stream for
/// the trainers that will come back: those still running on it (its config
/// waited for every trainer of the sweep, some may have ended).
fn wait_only_for_live_trainers(broker: &mut BrokerRun, b: usize, trainers: &[Trainer]) {
    let mut streams: Vec<&str> = trainers
        .iter()
        .filter(|t| t.broker == Some(b))
        .map(|t| t.plan.stream.as_str())
        .collect();
    streams.sort_unstable();
    streams.dedup();
    for stream in streams {
        let live = trainers
            .iter()
            .filter(|t| t.broker == Some(b) && t.plan.stream == stream && t.child.is_some())
            .count();
        broker.poll();
        broker.set_min_consumers(stream, live.max(1) as u32);
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

pub(super) fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("    | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
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
