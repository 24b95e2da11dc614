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

mod brokers;
mod expand;
mod file;
mod pulse;
mod run;
pub mod spec;
mod trainer;
mod view;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
pub use batchcast_cli::report::{
    BrokerSummary, Comparison, Mode, OnFailure, RunSummary, Summary, TrainerSummary, exit,
};

use run::run_mode;
use spec::{Host, Sweep};
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
    /// Seconds between status lines when the output is not a terminal (a
    /// terminal's table is redrawn every second)
    #[arg(long, default_value_t = STATUS_EVERY.as_secs_f64(), value_parser = parse_status_every)]
    pub status_every: f64,
    /// Also write report.html in the run folder: doctor's verdict and
    /// predictions, and the run over time (one self-contained file)
    #[arg(long)]
    pub report: bool,
}

/// Time between status lines when the output is not a terminal, unless
/// `--status-every` says.
pub const STATUS_EVERY: Duration = Duration::from_secs(5);

fn parse_status_every(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (1.0..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("`{s}`: give seconds from 1 to 3600")),
    }
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
    let every = Duration::from_secs_f64(args.status_every);
    let summary = launch(&sweep, args.baseline, &dir, &stop, every)?;
    let path = dir.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("writing {}", path.display()))?;
    println!("summary: {}", path.display());
    if args.report {
        let title = format!("batchcast launch {}", args.file.display());
        let report = write_report(&dir, &summary, &title)?;
        println!("report: {}", report.display());
    }
    Ok(summary.exit_code)
}

/// Writes `dir`/report.html for `summary`: doctor's findings on its shared
/// run and its timelines. Returns the file's path.
pub fn write_report(dir: &Path, summary: &Summary, title: &str) -> anyhow::Result<PathBuf> {
    let found = crate::doctor::judge_run(summary, crate::doctor::host_cores());
    let page = crate::report_html::page(title, Some(summary), &found);
    let path = dir.join("report.html");
    std::fs::write(&path, page).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Runs `sweep` shared (and then baseline, if asked) with logs under
/// `dir`; prints the summaries and the comparison (status lines every
/// `status_every` when the output is not a terminal).
pub fn launch(
    sweep: &Sweep,
    baseline: bool,
    dir: &Path,
    stop: &Stop,
    status_every: Duration,
) -> anyhow::Result<Summary> {
    let mut view = View::new(status_every);
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

    fn requested(&self) -> bool {
        self.count.load(Ordering::SeqCst) > 0
    }

    fn urgent(&self) -> bool {
        self.count.load(Ordering::SeqCst) > 1
    }
}
