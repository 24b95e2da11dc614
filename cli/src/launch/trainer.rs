//! The trainers of a run: starting each in its own process group, what
//! the broker says about each, stopping them (SIGTERM, then SIGKILL after
//! the grace period), and each one's summary and table row.

use batchcast::options::env_var;
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use batchcast::proto::Taken;
use nix::sys::signal::Signal;
use serde::Deserialize;

use super::brokers::BrokerRun;
use super::pulse::{Glimpse, Pulse};
use super::spec::TrainerPlan;
use super::view;
use super::{Mode, Stop, TrainerSummary};

/// What the broker says about one trainer: what it took (its clients'
/// counts, relayed by the broker, carried across broker restarts), and
/// the broker's own figures (summed over its subscriptions, and over the
/// brokers before a restart).
#[derive(Debug, Clone, Default)]
pub(super) struct Seen {
    subscribed: bool,
    connected: bool,
    /// Its broker stopped answering (its counts are the last seen), or
    /// a new broker has not seen it yet (it reconnects).
    broker_down: bool,
    reconnecting: bool,
    /// Batches and samples its program took, shared or replayed; `replayed`
    /// samples were recomputed for it alone.
    batches: u64,
    samples: u64,
    replayed: u64,
    /// The epoch of the last batch it took.
    epoch: u64,
    held: u32,
    wait_s: f64,
    busy_s: f64,
}

/// The broker's figures for one trainer that start again at 0 with a new
/// broker: summed over its consumers.
#[derive(Debug, Clone, Copy, Default)]
struct BrokerSums {
    replayed: u64,
    wait_s: f64,
    busy_s: f64,
}

impl BrokerSums {
    fn add(&mut self, o: BrokerSums) {
        self.replayed += o.replayed;
        self.wait_s += o.wait_s;
        self.busy_s += o.busy_s;
    }
}

/// A trainer's account across broker restarts.
#[derive(Debug, Default)]
pub(super) struct Account {
    /// What each of its consumers (its process's pid and the client's
    /// number for it) says it has taken, the most seen: a consumer that
    /// rode through a restart reports its carried count to the new broker,
    /// so each is counted once, and what it took after the old broker's
    /// last stats is counted when the new one reports it.
    taken: HashMap<(u32, u32), Taken>,
    /// The brokers' sums before the last restart, the current broker's at
    /// the last refresh, and which broker that is (its restart count).
    before: BrokerSums,
    now: BrokerSums,
    broker: u32,
}

impl Account {
    /// The broker now serving is the run's `restarts`-th: a new one
    /// keeps the old one's figures as last seen.
    fn serving(&mut self, restarts: u32) {
        if self.broker != restarts {
            let now = std::mem::take(&mut self.now);
            self.before.add(now);
            self.broker = restarts;
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum State {
    Starting,
    Running,
    Done,
    Failed(String),
    /// Stopped by the launcher (a failure elsewhere, or Ctrl-C).
    Stopped,
}

#[derive(Debug)]
pub(super) struct Trainer {
    pub(super) plan: TrainerPlan,
    pub(super) argv: Vec<String>,
    pub(super) child: Option<Child>,
    pub(super) pid: u32,
    /// Index into the run's brokers; `None` for a trainer with its own loader.
    pub(super) broker: Option<usize>,
    pub(super) log: PathBuf,
    pub(super) report: PathBuf,
    pub(super) started: Instant,
    pub(super) ended: Option<Instant>,
    pub(super) status: Option<ExitStatus>,
    pub(super) state: State,
    pub(super) stopping: bool,
    pub(super) seen: Seen,
    pub(super) account: Account,
    /// Its rate over a window, whether it waits on a held stream or is
    /// stopped, and what the broker said last (for events).
    pub(super) pulse: Pulse,
    pub(super) log_tail: Option<String>,
}

pub(super) fn spawn_trainer(
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
        .env(env_var("name"), &plan.name)
        .env(env_var("stream"), &plan.stream)
        .env("BATCHCAST_REPORT", &report)
        .env(
            "BATCHCAST_MODE",
            match mode {
                Mode::Shared => "shared",
                Mode::Baseline => "baseline",
            },
        );
    if std::env::var_os(env_var("connect_timeout")).is_none() {
        cmd.env(env_var("connect_timeout"), "60");
    }
    match socket {
        Some(s) => cmd.env(env_var("socket"), std::path::absolute(s)?),
        None => cmd.env_remove(env_var("socket")),
    };
    if let Some(g) = &plan.gpu {
        cmd.env("CUDA_VISIBLE_DEVICES", g);
    }
    batchcast_cli::child::die_with_parent(&mut cmd);
    for (k, v) in &plan.env {
        cmd.env(k, v);
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("running {:?} in {}", argv, plan.cwd.display()))?;
    let now = Instant::now();
    // Its rate counts from its start.
    let mut pulse = Pulse::default();
    pulse.count(now, 0);
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
        account: Account::default(),
        pulse,
        log_tail: None,
    })
}

/// Records a trainer's exit.
pub(super) fn finished(t: &mut Trainer, status: ExitStatus) {
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
pub(super) fn stop_all(trainers: &mut [Trainer], grace: f64, stop: &Stop) {
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

/// Updates a trainer's numbers from its broker's latest stats.
/// What the run's timeline keeps of a trainer now: samples, wait (with
/// the wait on a held stream so far, which its client reports only once
/// the next batch comes), busy.
pub(super) fn tick(t: &Trainer) -> [f64; 3] {
    let wait = t.seen.wait_s + t.pulse.waiting_s(Instant::now());
    [t.seen.samples as f64, wait, t.seen.busy_s]
}

/// Updates a trainer's numbers from its broker's latest stats; returns
/// the events they make (it joined, was cut, was detached).
pub(super) fn refresh(t: &mut Trainer, b: &BrokerRun) -> Vec<String> {
    t.seen.broker_down = b.down();
    let Some(st) = b.stream(&t.plan.stream) else {
        return Vec::new();
    };
    if b.down() {
        // Its last stats, seen already; it reads at most what it was sent.
        t.pulse.count(Instant::now(), t.seen.samples);
        return Vec::new();
    }
    let a = &mut t.account;
    a.serving(b.restarts);
    let mut now = BrokerSums::default();
    let (mut connected, mut held, mut any) = (false, 0, false);
    let (mut cuts, mut detached, mut unread) = (0, None, false);
    for c in st
        .consumers
        .iter()
        .chain(&st.past_consumers)
        .filter(|c| c.name == t.plan.name && !b.old_ids.contains(&c.id))
    {
        any = true;
        connected |= c.left.is_none();
        held += c.held;
        cuts += c.cuts;
        // Sent batches its program has not taken yet.
        unread |= c.left.is_none() && c.batches > c.taken.batches;
        if c.left.as_deref().is_some_and(|l| l.starts_with("detached")) {
            detached.clone_from(&c.left);
        }
        now.add(BrokerSums {
            replayed: c.replayed,
            wait_s: c.wait_s,
            busy_s: c.busy_s,
        });
        a.taken
            .entry((c.pid, c.serial))
            .and_modify(|t| *t = t.max(c.taken))
            .or_insert(c.taken);
    }
    if !any && !t.seen.subscribed {
        return Vec::new();
    }
    a.now = now;
    let mut all = a.before;
    all.add(now);
    let seen = Seen {
        subscribed: true,
        connected,
        broker_down: false,
        // Seen before, on no record of this broker: it was restarted.
        reconnecting: !any,
        batches: a.taken.values().map(|t| t.batches).sum(),
        samples: a.taken.values().map(|t| t.samples).sum(),
        replayed: all.replayed,
        epoch: a.taken.values().map(|t| t.epoch).max().unwrap_or(0),
        held,
        wait_s: all.wait_s,
        busy_s: all.busy_s,
    };
    // What a trainer took never goes back (its clients count it), so
    // neither does the table; its rate is over a window of several reports.
    let glimpse = Glimpse {
        samples: seen.samples,
        epoch: seen.epoch,
        connected,
        cuts,
        detached: detached.filter(|_| !connected),
        unread,
    };
    let news = t.pulse.see(Instant::now(), t.pid, &t.plan.name, &glimpse);
    if t.state == State::Starting {
        t.state = State::Running;
    }
    t.seen = seen;
    news
}

/// Updates a trainer the broker does not see (its own loader, in a
/// baseline run) from its `$BATCHCAST_REPORT`, which it may rewrite as it
/// runs (every few seconds: `examples/train_torch.py` does), so the live
/// table compares both modes as they run. Counts never go backwards.
pub(super) fn refresh_from_report(t: &mut Trainer) {
    let Some(r) = std::fs::read_to_string(&t.report)
        .ok()
        .and_then(|s| serde_json::from_str::<TrainerReport>(&s).ok())
    else {
        return;
    };
    let samples = r.samples.max(t.seen.samples);
    // The report changes every few seconds, the table every second: the
    // rate is over a window that spans several reports.
    t.pulse.count(Instant::now(), samples);
    t.seen.batches = r.batches.max(t.seen.batches);
    t.seen.samples = samples;
    t.seen.wait_s = r.wait_s;
    t.seen.busy_s = r.busy_s;
    t.seen.connected = t.child.is_some();
    if t.state == State::Starting {
        t.state = State::Running;
    }
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

pub(super) fn summarise(t: &Trainer) -> TrainerSummary {
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
    let replayed = if t.seen.subscribed {
        t.seen.replayed
    } else {
        0
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
        replayed,
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

pub(super) fn rows(trainers: &[Trainer]) -> Vec<view::Row> {
    trainers
        .iter()
        .map(|t| {
            // The wait on a held stream so far counts as stall now, not
            // only once its client reports it with the next batch.
            let waiting = t.pulse.waiting_s(Instant::now());
            let wait = t.seen.wait_s + waiting;
            let total = wait + t.seen.busy_s;
            view::Row {
                name: t.plan.name.clone(),
                state: match &t.state {
                    State::Starting => "starting".into(),
                    State::Running if t.pulse.stopped => "stopped (SIGSTOP)".into(),
                    State::Running if t.seen.broker_down => "waiting for its broker".into(),
                    State::Running if t.seen.reconnecting => "reconnecting".into(),
                    State::Running if !t.seen.connected && t.pulse.detached().is_some() => {
                        "detached".into()
                    }
                    State::Running if !t.seen.connected => "finishing".into(),
                    State::Running if waiting > 0.0 => {
                        format!("waiting {waiting:.0} s for data")
                    }
                    State::Running => "running".into(),
                    State::Done => "done".into(),
                    State::Failed(why) => format!("FAILED: {why}"),
                    State::Stopped => "stopped".into(),
                },
                epoch: t.seen.subscribed.then_some(t.seen.epoch),
                batches: t.seen.batches,
                replayed: t.seen.replayed,
                rate: if t.child.is_some() {
                    t.pulse.rate()
                } else {
                    0.0
                },
                // Until it has trained at all, its stall says nothing (it
                // was 100 % on a first refresh: waiting for the first batch).
                stall_pct: (t.seen.busy_s > 0.0).then(|| 100.0 * wait / total),
                held: t.seen.held,
                gpu: t.plan.gpu.clone(),
            }
        })
        .collect()
}
