//! The brokers of a run: one it started (stopped at the end) or a running
//! one it reuses, what the run last read from each, each one's summary,
//! and where their sockets go.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use batchcast::StatsClient;
use batchcast::proto::{StatsReply, StreamStats};

use super::BrokerSummary;
use batchcast_cli::harness::{self, BrokerProcess};

/// A broker the run talks to.
#[derive(Debug)]
pub(super) struct BrokerRun {
    process: Option<BrokerProcess>,
    /// How the run started it, to start it again when it dies.
    start: Option<StartedBy>,
    pub(super) socket: PathBuf,
    client: Option<StatsClient>,
    pub(super) last: Option<StatsReply>,
    /// Consumer ids present before the run (a reused broker's earlier
    /// clients), left out of every trainer's numbers.
    pub(super) old_ids: HashSet<u64>,
    pid: u32,
    cpu_at_start: f64,
    /// The CPU seconds of `pid` when last polled (a broker killed under
    /// the run cannot be asked afterwards).
    cpu_seen: f64,
    /// Times a new broker was found serving `socket` (a restart under the
    /// run: a service manager's, or someone's kill and start), and the
    /// counts of the brokers before it, at their last stats.
    pub(super) restarts: u32,
    before: Counts,
    /// The CPU seconds of the brokers this process started (its
    /// children: the run's CPU counts them as it waits for them).
    child_cpu_s: f64,
    /// What happened since the supervisor last looked (a restart), for
    /// the view's events.
    pub(super) news: Vec<String>,
    /// Since when the broker has not answered.
    down_since: Option<Instant>,
}

/// How the run started a broker: its program, config copy, folder
/// (relative paths in the config) and log.
#[derive(Debug)]
struct StartedBy {
    exe: PathBuf,
    config: PathBuf,
    dir: PathBuf,
    log: PathBuf,
}

/// A broker's counts for the run's summary.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    cpu_s: f64,
    batches_produced: u64,
    deliveries: u64,
    images_decoded: u64,
    cache_hits: u64,
    bad_files_skipped: u64,
}

impl Counts {
    fn of(st: Option<&StatsReply>) -> Counts {
        let sum = |f: &dyn Fn(&StreamStats) -> u64| -> u64 {
            st.map(|s| s.streams.iter().map(f).sum()).unwrap_or(0)
        };
        Counts {
            cpu_s: 0.0,
            batches_produced: sum(&|s| s.batches_produced),
            deliveries: sum(&|s| s.deliveries),
            images_decoded: sum(&|s| s.source.as_ref().map_or(0, |x| x.decoded)),
            cache_hits: sum(&|s| s.source.as_ref().map_or(0, |x| x.cache_hits)),
            bad_files_skipped: sum(&|s| s.source.as_ref().map_or(0, |x| x.skipped)),
        }
    }

    fn add(&mut self, o: Counts) {
        self.cpu_s += o.cpu_s;
        self.batches_produced += o.batches_produced;
        self.deliveries += o.deliveries;
        self.images_decoded += o.images_decoded;
        self.cache_hits += o.cache_hits;
        self.bad_files_skipped += o.bad_files_skipped;
    }
}

impl BrokerRun {
    fn new(
        process: Option<BrokerProcess>,
        socket: &Path,
        client: Option<StatsClient>,
        last: Option<StatsReply>,
        pid: u32,
    ) -> BrokerRun {
        let cpu_at_start = match process {
            Some(_) => 0.0,
            None => harness::cpu_seconds(pid).unwrap_or(0.0),
        };
        BrokerRun {
            process,
            socket: socket.into(),
            client,
            last,
            old_ids: HashSet::new(),
            pid,
            cpu_at_start,
            cpu_seen: cpu_at_start,
            restarts: 0,
            before: Counts::default(),
            child_cpu_s: 0.0,
            start: None,
            news: Vec::new(),
            down_since: None,
        }
    }

    /// Asks the broker for its stats (connecting again after it went
    /// away). A broker of another pid on the socket is a restart: the old
    /// one's counts are kept as last seen and the view is told.
    pub(super) fn poll(&mut self) -> Option<&StatsReply> {
        if self.client.is_none() {
            self.client = StatsClient::connect(Some(self.socket.clone())).ok();
        }
        match self.client.as_mut().map(|c| c.fetch()) {
            Some(Ok(s)) => {
                if s.broker_pid != self.pid {
                    let ours = self.process.as_ref().is_some_and(|p| p.pid() == self.pid);
                    self.restarted(s.broker_pid, ours);
                }
                self.down_since = None;
                self.last = Some(s);
                self.cpu_seen = harness::cpu_seconds(self.pid).unwrap_or(self.cpu_seen);
            }
            Some(Err(_)) | None => {
                self.client = None;
                if self.down_since.is_none() {
                    self.down_since = Some(Instant::now());
                    self.news.push(format!(
                        "the broker on {} stopped answering (pid {}); its trainers wait for it to come back",
                        self.socket.display(),
                        self.pid
                    ));
                }
            }
        }
        self.last.as_ref()
    }

    /// What the run's timeline keeps of this broker now.
    pub(super) fn tick(&self) -> batchcast_cli::report::BrokerTick {
        let last = self.last.as_ref();
        let mut stages = [0.0; 3];
        for x in last
            .iter()
            .flat_map(|l| &l.streams)
            .filter_map(|s| s.source.as_ref())
        {
            stages[0] += x.stages.read_s;
            stages[1] += x.stages.decode_s;
            stages[2] += x.stages.transform_s;
        }
        batchcast_cli::report::BrokerTick {
            cpu_s: self.before.cpu_s + self.cpu_seen - self.cpu_at_start,
            stages,
            rss_bytes: harness::rss_kb(self.pid).unwrap_or(0) * 1024,
            shared_bytes: last.map_or(0, |l| l.memory.used_bytes),
            threads_working: last
                .iter()
                .flat_map(|l| &l.streams)
                .map(|s| s.workers_active)
                .sum(),
        }
    }

    /// Another broker (`pid`) serves the socket now; `ours`: the one
    /// before was this process's child.
    fn restarted(&mut self, pid: u32, ours: bool) {
        let mut old = Counts::of(self.last.as_ref());
        old.cpu_s = self.cpu_seen - self.cpu_at_start;
        self.before.add(old);
        if ours {
            self.child_cpu_s += old.cpu_s;
        }
        self.news.push(format!(
            "the broker on {} restarted (pid {} -> {pid}); counts carry over",
            self.socket.display(),
            self.pid
        ));
        self.restarts += 1;
        self.pid = pid;
        // Its consumers are all the run's (ids start again), and all its
        // CPU time is the run's.
        self.old_ids.clear();
        self.cpu_at_start = 0.0;
        self.cpu_seen = 0.0;
    }

    /// A broker this run started that exited is started again on the same
    /// socket and config (its trainers ride through), while `left` allows;
    /// says so in the view's events either way. Whether one was started.
    pub(super) fn restart_if_dead(&mut self, left: &mut u32) -> bool {
        let Some(status) = self
            .process
            .as_mut()
            .and_then(|p| p.try_wait().ok().flatten())
        else {
            return false;
        };
        let Some(start) = self.start.as_ref() else {
            return false;
        };
        let dead = self.process.take().map_or(self.pid, |p| p.pid());
        if *left == 0 {
            self.news.push(format!(
                "the broker (pid {dead}) exited ({status}); not started again ([launch] broker_restarts is used up); see {}",
                start.log.display()
            ));
            return false;
        }
        *left -= 1;
        let n = self.restarts + 1;
        let log = start.log.with_extension(format!("{n}.log"));
        self.news.push(format!(
            "the broker (pid {dead}) exited ({status}; its log: {}); starting it again, its trainers ride through (log: {})",
            start.log.display(),
            log.display()
        ));
        match BrokerProcess::spawn_in(
            &start.exe,
            Some(&start.config),
            &self.socket,
            Some(&log),
            &start.dir,
        ) {
            Ok(p) => {
                let pid = p.pid();
                self.process = Some(p);
                self.restarted(pid, true);
                self.client = None;
                self.last = None;
                true
            }
            Err(e) => {
                self.news
                    .push(format!("starting the broker again failed: {e}"));
                false
            }
        }
    }

    /// Whether the broker stopped answering (until a broker answers again).
    pub(super) fn down(&self) -> bool {
        self.down_since.is_some()
    }

    pub(super) fn stream(&self, name: &str) -> Option<&StreamStats> {
        self.last.as_ref()?.streams.iter().find(|s| s.name == name)
    }

    pub(super) fn set_min_consumers(&mut self, stream: &str, min: u32) {
        if let Some(c) = self.client.as_mut() {
            match c.set_min_consumers(stream, min) {
                Ok(s) => self.last = Some(s),
                Err(e) => tracing::warn!("asking the broker to start `{stream}`: {e}"),
            }
        }
    }
}

/// Stops the brokers this run started, with each one's summary; and the
/// CPU a reused broker spent meanwhile (not a child of this process).
pub(super) fn stop_brokers(brokers: Vec<BrokerRun>) -> (Vec<BrokerSummary>, f64) {
    let mut broker_summaries = Vec::new();
    let mut reused_cpu = 0.0;
    for b in brokers {
        let cpu_end = harness::cpu_seconds(b.pid).unwrap_or(b.cpu_seen);
        let run_queue_s = b
            .last
            .iter()
            .flat_map(|st| &st.streams)
            .filter_map(|s| {
                let t = batchcast_cli::procstat::named_threads(
                    b.pid,
                    &batchcast_cli::procstat::pipeline_threads(&s.name),
                )?;
                Some((s.name.clone(), t.run_queue_s))
            })
            .collect();
        let started = b.process.is_some();
        let mut all = b.before;
        let mut last = Counts::of(b.last.as_ref());
        last.cpu_s = cpu_end - b.cpu_at_start;
        all.add(last);
        // The run's CPU counts its children as they are waited for: the
        // brokers it started are; one someone else started is not.
        let mut children = b.child_cpu_s;
        if b.process.as_ref().is_some_and(|p| p.pid() == b.pid) {
            children += last.cpu_s;
        }
        reused_cpu += all.cpu_s - children;
        broker_summaries.push(BrokerSummary {
            socket: b.socket.clone(),
            pid: b.pid,
            started,
            restarts: b.restarts,
            cpu_s: all.cpu_s,
            batches_produced: all.batches_produced,
            deliveries: all.deliveries,
            images_decoded: all.images_decoded,
            cache_hits: all.cache_hits,
            bad_files_skipped: all.bad_files_skipped,
            last_stats: b.last.clone(),
            run_queue_s,
        });
        if let Some(mut p) = b.process
            && let Err(e) = p.terminate(Duration::from_secs(10))
        {
            tracing::warn!("stopping the broker: {e}");
        }
    }
    (broker_summaries, reused_cpu)
}

/// Starts a broker on `config` (written to `config_copy`, relative paths
/// from `cfg_dir`) at `socket`, its log in `log`.
pub(super) fn start_broker(
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
    let mut b = BrokerRun::new(Some(process), socket, None, None, pid);
    b.start = Some(StartedBy {
        exe: exe.into(),
        config: config_copy,
        dir: cfg_dir.into(),
        log: log.into(),
    });
    b.poll();
    Ok(b)
}

/// A broker already serving on `socket`, reused (its earlier consumers
/// are left out of the run's numbers).
pub(super) fn reuse_broker(socket: &Path) -> anyhow::Result<BrokerRun> {
    let mut client = StatsClient::connect(Some(socket.into()))
        .with_context(|| format!("[launch] socket: no broker answers on {}", socket.display()))?;
    let stats = client.fetch()?;
    let old_ids = stats
        .streams
        .iter()
        .flat_map(|s| s.consumers.iter().chain(&s.past_consumers).map(|c| c.id))
        .collect();
    let pid = stats.broker_pid;
    let mut b = BrokerRun::new(None, socket, Some(client), Some(stats), pid);
    b.old_ids = old_ids;
    Ok(b)
}

/// Where the brokers' sockets go: the run folder's `sockets/` when their
/// paths fit a socket address (108 bytes), so a launcher killed with
/// SIGKILL leaves nothing outside its run folder; else a short private
/// folder in the temporary directory, removed when the run ends.
pub(super) enum SocketDir {
    InRun(PathBuf),
    Temp(tempfile::TempDir),
}

impl SocketDir {
    /// The longest socket name a run uses (`broker.sock`, `N.sock`).
    const NAME: usize = 16;
    const MAX_PATH: usize = 107;

    pub(super) fn new(run: &Path) -> anyhow::Result<SocketDir> {
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

    pub(super) fn path(&self) -> &Path {
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
