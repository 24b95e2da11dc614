//! Starting and watching real broker and consumer processes: shared by
//! `batchcast demo`, the benchmark harness and the end-to-end tests.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use batchcast::StatsClient;
use batchcast::proto::StatsReply;

use crate::report::ConsumerReport;

pub use crate::procstat::{cpu_seconds, rss_kb, thread_cpu_seconds};

/// A `batchcast serve` child process; killed when dropped.
#[derive(Debug)]
pub struct BrokerProcess {
    child: Child,
    pub socket: PathBuf,
}

impl BrokerProcess {
    /// Starts `exe serve [--config CONFIG] --socket SOCKET` and waits until
    /// it answers on its socket. Its stderr goes to `log` (or is inherited).
    /// Without a config it serves only streams that producers register.
    pub fn spawn(
        exe: &Path,
        config: Option<&Path>,
        socket: &Path,
        log: Option<&Path>,
    ) -> std::io::Result<BrokerProcess> {
        Self::spawn_with(Command::new(exe), config, socket, log)
    }

    /// [`BrokerProcess::spawn`] from a command the caller prepared (its
    /// environment, say): `serve` and the rest are added to it.
    pub fn spawn_with(
        mut cmd: Command,
        config: Option<&Path>,
        socket: &Path,
        log: Option<&Path>,
    ) -> std::io::Result<BrokerProcess> {
        Self::start(&mut cmd, config, socket, log)
    }

    /// [`BrokerProcess::spawn`] with the broker running in `cwd` (relative
    /// paths in its config resolve from there), in a process group of its
    /// own (a terminal's Ctrl-C reaches only whoever started it), and
    /// stopped when this process dies (see [`crate::child::die_with_parent`]).
    pub fn spawn_in(
        exe: &Path,
        config: Option<&Path>,
        socket: &Path,
        log: Option<&Path>,
        cwd: &Path,
    ) -> std::io::Result<BrokerProcess> {
        let mut cmd = Command::new(exe);
        cmd.current_dir(cwd).process_group(0);
        crate::child::die_with_parent(&mut cmd);
        Self::start(&mut cmd, config, socket, log)
    }

    /// Runs `cmd serve …` and waits until it answers on its socket.
    fn start(
        cmd: &mut Command,
        config: Option<&Path>,
        socket: &Path,
        log: Option<&Path>,
    ) -> std::io::Result<BrokerProcess> {
        cmd.arg("serve");
        if let Some(config) = config {
            cmd.arg("--config").arg(config);
        }
        cmd.arg("--socket").arg(socket);
        cmd.stdin(Stdio::null()).stdout(Stdio::null());
        if let Some(log) = log {
            cmd.stderr(std::fs::File::create(log)?);
        }
        let child = cmd.spawn()?;
        let mut broker = BrokerProcess {
            child,
            socket: socket.into(),
        };
        let t0 = Instant::now();
        loop {
            if let Some(status) = broker.child.try_wait()? {
                let tail = log
                    .and_then(|l| std::fs::read_to_string(l).ok())
                    .unwrap_or_default();
                return Err(std::io::Error::other(format!(
                    "broker exited with {status} before it was ready:\n{tail}"
                )));
            }
            if StatsClient::connect(Some(socket.into())).is_ok() {
                return Ok(broker);
            }
            if t0.elapsed() > Duration::from_secs(30) {
                return Err(std::io::Error::other(
                    "broker did not answer on its socket within 30 s",
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stats(&self) -> batchcast::Result<StatsReply> {
        StatsClient::connect(Some(self.socket.clone()))?.fetch()
    }

    pub fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// SIGTERM, then up to `grace` for it to exit, then SIGKILL.
    pub fn terminate(&mut self, grace: Duration) -> std::io::Result<ExitStatus> {
        signal(self.child.id(), nix::sys::signal::Signal::SIGTERM);
        wait_timeout(&mut self.child, grace)
    }

    /// SIGKILL: the broker dies without a chance to say goodbye.
    pub fn kill(&mut self) -> std::io::Result<ExitStatus> {
        self.child.kill()?;
        self.child.wait()
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Sends `sig` to `pid`, ignoring a process that is already gone.
pub fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
}

/// Waits up to `grace`, then kills.
pub fn wait_timeout(child: &mut Child, grace: Duration) -> std::io::Result<ExitStatus> {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s);
        }
        if t0.elapsed() > grace {
            child.kill()?;
            return child.wait();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Starts `exe consume --json --socket SOCKET ARGS...` with stdout piped.
pub fn spawn_consumer(exe: &Path, socket: &Path, args: &[String]) -> std::io::Result<Child> {
    Command::new(exe)
        .arg("consume")
        .arg("--json")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
}

/// Waits (at most `limit`) for a consumer started by [`spawn_consumer`] and
/// parses its report.
pub fn wait_report(mut child: Child, limit: Duration) -> std::io::Result<ConsumerReport> {
    let mut stdout = child.stdout.take().expect("spawned with piped stdout");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let status = wait_timeout(&mut child, limit)?;
    let out = reader.join().unwrap_or_default();
    parse_report(&out).map_err(|e| {
        std::io::Error::other(format!("consumer {} exited with {status}: {e}", child.id()))
    })
}

/// A consumer's output without the report `consume --json` prints.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("no report in its output: {0}")]
    Missing(String),
    #[error("bad report {line}: {error}")]
    Bad {
        line: String,
        error: serde_json::Error,
    },
}

/// The report `consume --json` prints last, from its output (a log may
/// hold other lines before it).
pub fn parse_report(out: &str) -> Result<ConsumerReport, ReportError> {
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| ReportError::Missing(out.to_string()))?;
    serde_json::from_str(line).map_err(|error| ReportError::Bad {
        line: line.to_string(),
        error,
    })
}

/// The `batchcast` binary a benchmark runs: `given`, else the one next to
/// the running executable; an error saying how to build it if it is not
/// there.
pub fn batchcast_exe(given: Option<&Path>) -> std::io::Result<PathBuf> {
    let exe = match given {
        Some(e) => e.to_path_buf(),
        None => std::env::current_exe()?.with_file_name("batchcast"),
    };
    if !exe.exists() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!(
                "{} not found; build it with `cargo build --release -p batchcast-cli` or pass --exe",
                exe.display()
            ),
        ));
    }
    Ok(exe)
}
