//! What `batchcast launch` prints: on a terminal, a table redrawn in place
//! about once a second with events scrolling above it; in a pipe, events
//! and a status line per trainer every few seconds. Then the summaries.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use super::{Comparison, RunSummary};
use crate::stats_view::truncate;

/// One trainer in the live table.
#[derive(Debug, Clone)]
pub struct Row {
    pub name: String,
    pub state: String,
    pub epoch: Option<u64>,
    pub batches: u64,
    /// Samples recomputed for it alone (counted in its batches and rate).
    pub replayed: u64,
    pub rate: f64,
    pub stall_pct: Option<f64>,
    pub held: u32,
    pub gpu: Option<String>,
}

#[derive(Debug)]
pub struct View {
    tty: bool,
    /// Lines of the table currently on screen (terminal only).
    drawn: usize,
    last_plain: Option<Instant>,
    /// Time between status lines when output is not a terminal.
    plain_every: Duration,
    /// Every event line, with when it was said (for the run's summary and
    /// the marks on its report's time axis).
    said: Vec<(Instant, String)>,
}

impl View {
    pub fn new(plain_every: Duration) -> View {
        View {
            tty: std::io::stdout().is_terminal(),
            drawn: 0,
            last_plain: None,
            plain_every,
            said: Vec::new(),
        }
    }

    /// The events said since `t0`, as seconds from it.
    pub fn said_since(&self, t0: Instant) -> Vec<batchcast_cli::report::Event> {
        self.said
            .iter()
            .filter(|(t, _)| *t >= t0)
            .map(|(t, text)| batchcast_cli::report::Event {
                t_s: t.duration_since(t0).as_secs_f64(),
                text: text.clone(),
            })
            .collect()
    }

    /// A line that stays (above the table on a terminal).
    pub fn event(&mut self, msg: &str) {
        self.said.push((Instant::now(), msg.to_string()));
        let mut out = std::io::stdout().lock();
        self.erase(&mut out);
        let _ = writeln!(out, "{msg}");
        let _ = out.flush();
    }

    /// Removes the table (before the summary).
    pub fn clear(&mut self) {
        let mut out = std::io::stdout().lock();
        self.erase(&mut out);
        let _ = out.flush();
    }

    fn erase(&mut self, out: &mut impl Write) {
        if self.tty && self.drawn > 0 {
            // Up to the table's first line, then clear to the end.
            let _ = write!(out, "\x1b[{}F\x1b[J", self.drawn);
            self.drawn = 0;
        }
    }

    pub fn table(&mut self, rows: &[Row], elapsed: Duration) {
        let mut out = std::io::stdout().lock();
        if self.tty {
            self.erase(&mut out);
            let text = render(rows, elapsed);
            self.drawn = text.lines().count();
            let _ = write!(out, "{text}");
        } else {
            if self
                .last_plain
                .is_some_and(|t| t.elapsed() < self.plain_every)
            {
                return;
            }
            self.last_plain = Some(Instant::now());
            for r in rows {
                let _ = writeln!(
                    out,
                    "[{:>6.1}s] {} {} epoch {} batches {} replayed {} {:.0} samples/s stall {} held {}",
                    elapsed.as_secs_f64(),
                    r.name,
                    r.state,
                    r.epoch.map_or("-".into(), |e| e.to_string()),
                    r.batches,
                    r.replayed,
                    r.rate,
                    r.stall_pct.map_or("-".into(), |s| format!("{s:.0}%")),
                    r.held
                );
            }
        }
        let _ = out.flush();
    }
}

fn render(rows: &[Row], elapsed: Duration) -> String {
    let mut s = format!(
        "{:<18} {:<22} {:>5} {:>8} {:>9} {:>10} {:>7} {:>5}  {}\n",
        "trainer", "state", "epoch", "batches", "replayed", "samples/s", "stall", "held", "gpu"
    );
    for r in rows {
        s += &format!(
            "{:<18} {:<22} {:>5} {:>8} {:>9} {:>10.0} {:>7} {:>5}  {}\n",
            truncate(&r.name, 18),
            truncate(&r.state, 22),
            r.epoch.map_or("-".into(), |e| e.to_string()),
            r.batches,
            r.replayed,
            r.rate,
            r.stall_pct.map_or("-".into(), |p| format!("{p:.1}%")),
            r.held,
            r.gpu.as_deref().unwrap_or("-"),
        );
    }
    s += &format!(
        "{:.0} s elapsed; Ctrl-C stops everything\n",
        elapsed.as_secs_f64()
    );
    s
}

/// The end-of-run table.
pub fn print_run(run: &RunSummary) {
    let mode = match run.mode {
        super::Mode::Shared => "shared",
        super::Mode::Baseline => "baseline",
    };
    println!(
        "\n{mode} run{}: {:.2} s",
        if run.interrupted {
            " (interrupted)"
        } else {
            ""
        },
        run.wall_s
    );
    println!(
        "{:<18} {:<9} {:>8} {:>9} {:>9} {:>9} {:>11} {:>7}  exit",
        "trainer", "state", "wall s", "batches", "samples", "replayed", "samples/s", "stall"
    );
    for t in &run.trainers {
        println!(
            "{:<18} {:<9} {:>8.2} {:>9} {:>9} {:>9} {:>11.1} {:>6.1}%  {}",
            truncate(&t.name, 18),
            t.state,
            t.wall_s,
            t.batches,
            t.samples,
            t.replayed,
            t.samples_per_s,
            t.stall_pct,
            match (t.exit_code, t.signal) {
                (Some(c), _) => c.to_string(),
                (None, Some(s)) => format!("signal {s}"),
                _ => "-".into(),
            }
        );
    }
    for b in &run.brokers {
        println!(
            "broker pid {}{}{}: {:.2} CPU-s, {} batches produced, {} deliveries, {} images decoded, {} cache hits, {} bad files skipped",
            b.pid,
            if b.started { "" } else { " (already running)" },
            match b.restarts {
                0 => String::new(),
                1 => " (restarted once; counts of both brokers)".into(),
                n => format!(" (restarted {n} times; counts of every broker)"),
            },
            b.cpu_s,
            b.batches_produced,
            b.deliveries,
            b.images_decoded,
            b.cache_hits,
            b.bad_files_skipped
        );
    }
    println!(
        "all: {} samples, {:.0} samples/s, {:.2} CPU-s for every process of the run{}",
        run.samples,
        run.samples_per_s,
        run.cpu_s,
        run.cpu_ms_per_sample
            .map_or(String::new(), |c| format!(" = {c:.3} CPU-ms per sample"))
    );
}

/// Shared vs baseline, side by side.
pub fn print_comparison(shared: &RunSummary, base: &RunSummary, c: &Comparison) {
    println!(
        "\n{:<28} {:>12} {:>12}  shared vs baseline",
        "", "shared", "baseline"
    );
    println!(
        "{:<28} {:>12.2} {:>12.2}  {:.2}× faster",
        "wall time, s", shared.wall_s, base.wall_s, c.speedup
    );
    println!(
        "{:<28} {:>12.0} {:>12.0}  {:.2}× the throughput",
        "aggregate samples/s", shared.samples_per_s, base.samples_per_s, c.throughput_ratio
    );
    println!(
        "{:<28} {:>12.2} {:>12.2}",
        "CPU-s, all processes", shared.cpu_s, base.cpu_s
    );
    let fmt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.3}"));
    println!(
        "{:<28} {:>12} {:>12}  {}",
        "CPU-ms per sample",
        fmt(shared.cpu_ms_per_sample),
        fmt(base.cpu_ms_per_sample),
        c.cpu_per_sample_ratio
            .map_or("-".into(), |r| format!("{r:.2}× the CPU"))
    );
}
