//! The brokers of a run: one it started (stopped at the end) or a running
//! one it reuses, what the run last read from each, each one's summary,
//! and where their sockets go.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use batchcast::StatsClient;
use batchcast::proto::{StatsReply, StreamStats};

use super::BrokerSummary;
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
