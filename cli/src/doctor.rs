//! `batchcast doctor`: what limits the trainers, in a sentence a person
//! acts on, with the evidence beneath. Against a running broker it reads
//! its stats twice, `--seconds` apart, and judges what happened between;
//! against a finished `batchcast launch` (or `demo --run-dir`) run folder,
//! the brokers' last stats, over their whole run.
//!
//! Per stream, from the stats alone (the arithmetic is [`diagnose`]'s):
//! the trainers' data stall (`wait / (wait + busy)`, as each client
//! reports), how busy the pipeline threads were (their CPU over their
//! time), where that time went (read, decode, transform), and whether the
//! pipeline waited for free slots. The verdict: trainer-bound when the
//! trainers rarely wait; else bound by the pipeline's largest stage when
//! its threads are busy; else held by flow (slots, a holder) or by reads
//! that wait for storage.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use batchcast::StatsClient;
use batchcast::proto::{StatsReply, StreamStats};

pub use super::finding::{Bound, Finding, Model};
use super::predict::{self, CpuSeen, Limit, OtherCpu, Prediction, trainers};

#[derive(Debug, Clone, clap::Args)]
pub struct DoctorArgs {
    /// A run folder of `batchcast launch` or `batchcast demo --run-dir`
    /// (its summary.json) [default: ask the running broker]
    pub run: Option<PathBuf>,
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Seconds to watch a running broker
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Print the findings as JSON
    #[arg(long)]
    pub json: bool,
    /// The host's cores, for the predictions [default: the cores this
    /// process may use]
    #[arg(long)]
    pub cores: Option<f64>,
    /// Also write the findings (and a run folder's plots over time) as
    /// one self-contained HTML file
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

/// What the stream did between two stats replies, per second of `dt`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rates {
    pub images_s: f64,
    /// The share of the pipeline threads' time spent working on images
    /// (in a stage, running or waiting for a core; 0..1). A synthetic
    /// stream's: its CPU share.
    pub busy: f64,
    /// The pipeline threads' CPU over their time (0..1): below `busy`
    /// where they wait for a core.
    pub cpu: f64,
    /// Share of the pipeline threads' time waiting for free slots.
    pub blocked: f64,
    /// Seconds per image in each stage: read, decode, transform.
    pub per_image: [f64; 3],
    /// The trainers' median data stall (0..1), and how many reported.
    pub stall: f64,
    pub trainers: usize,
    /// GPU seconds per batch copied to a GPU (`None`: none copied).
    pub copy_per_batch: Option<f64>,
    /// Pipeline CPU seconds per sample replayed (`None`: none replayed).
    pub replay_per_sample: Option<f64>,
}

/// The rates of `after` since `before` (`None`: since the start).
pub fn rates(before: Option<&StreamStats>, after: &StreamStats, dt: f64) -> Rates {
    let dt = dt.max(1e-9);
    let src = |s: Option<&StreamStats>| {
        s.and_then(|s| s.source.as_ref())
            .map_or((0, [0.0; 3]), |x| {
                (
                    x.decoded,
                    [x.stages.read_s, x.stages.decode_s, x.stages.transform_s],
                )
            })
    };
    let (d0, t0) = src(before);
    let (d1, t1) = src(Some(after));
    let images = d1.saturating_sub(d0) as f64;
    let threads = f64::from(working(after).max(1)) * dt;
    let cpu = after.pipeline_cpu_s - before.map_or(0.0, |b| b.pipeline_cpu_s);
    let blocked = after.producer_blocked_s - before.map_or(0.0, |b| b.producer_blocked_s);
    let mut stalls: Vec<f64> = trainers(after)
        .filter_map(|c| {
            let was = before.and_then(|b| trainers(b).find(|p| p.id == c.id));
            let wait = c.wait_s - was.map_or(0.0, |p| p.wait_s);
            let busy = c.busy_s - was.map_or(0.0, |p| p.busy_s);
            (wait + busy > 1e-3).then(|| wait / (wait + busy))
        })
        .collect();
    stalls.sort_by(f64::total_cmp);
    let staged: f64 = (0..3).map(|i| t1[i] - t0[i]).sum();
    let cpu = (cpu / threads).clamp(0.0, 1.0);
    Rates {
        images_s: images / dt,
        busy: if after.source.is_some() {
            (staged / threads).clamp(0.0, 1.0)
        } else {
            cpu
        },
        cpu,
        blocked: (blocked / threads).clamp(0.0, 1.0),
        per_image: std::array::from_fn(|i| (t1[i] - t0[i]) / images.max(1.0)),
        stall: stalls.get(stalls.len() / 2).copied().unwrap_or(0.0),
        trainers: stalls.len(),
        copy_per_batch: per(before, after, |s| {
            let g = s.gpus.iter();
            (g.clone().map(|g| g.copy_s).sum(), g.map(|g| g.copies).sum())
        }),
        replay_per_sample: per(before, after, |s| {
            (s.replay_cpu_s, trainers(s).map(|c| c.replayed).sum())
        }),
    }
}

/// Seconds per count between two stats: `f` gives (seconds, count).
fn per(
    before: Option<&StreamStats>,
    after: &StreamStats,
    f: impl Fn(&StreamStats) -> (f64, u64),
) -> Option<f64> {
    let (s0, n0) = before.map_or((0.0, 0), &f);
    let (s1, n1) = f(after);
    let n = n1.saturating_sub(n0);
    (n > 0).then(|| (s1 - s0) / n as f64)
}

/// Trainers waiting less than this share of their time are not held by
/// data.
const STALL: f64 = 0.10;
/// Pipeline threads at least this busy are the bottleneck's suspects.
const BUSY: f64 = 0.85;

/// The finding for one stream, from its `r`ates; `cores`: the host's.
pub fn diagnose(name: &str, s: &StreamStats, r: &Rates, cores: usize) -> Finding {
    let evidence = evidence(s, r, cores);
    let (bound, verdict) = if s.producer.is_some() {
        (
            Bound::Producer,
            format!(
                "producer-paced: {} makes this stream; the trainers wait {} of their time for it",
                s.producer.as_deref().unwrap_or_default(),
                pct(r.stall)
            ),
        )
    } else if r.images_s <= 0.0 && r.trainers == 0 {
        (Bound::Idle, "idle: nothing was made or read".to_string())
    } else if r.stall < STALL {
        (
            Bound::Trainer,
            format!(
                "trainer-bound: the {} trainers wait for data only {} of their time; the pipeline is {} busy. Faster data would not speed them up",
                r.trainers,
                pct(r.stall),
                pct(r.busy)
            ),
        )
    } else if r.busy >= BUSY && s.source.is_none() {
        (
            Bound::Pipeline,
            format!(
                "pipeline-bound: {} pipeline threads {} busy making synthetic batches; the trainers wait {} of their time",
                working(s),
                pct(r.busy),
                pct(r.stall)
            ),
        )
    } else if r.busy >= BUSY {
        stage_bound(s, r, cores, None)
    } else if r.blocked >= 0.5 {
        (
            Bound::Flow,
            format!(
                "flow-bound: the trainers wait {} of their time while the pipeline waits for free slots {} of its own: a consumer holds the ring (see `batchcast stats`) or the stream has too few slots",
                pct(r.stall),
                pct(r.blocked)
            ),
        )
    } else {
        (
            Bound::Read,
            format!(
                "read-bound: the trainers wait {} of their time while the pipeline threads are only {} busy: they wait on reads ({} an image)",
                pct(r.stall),
                pct(r.busy),
                us(r.per_image[0])
            ),
        )
    };
    Finding {
        stream: name.to_string(),
        bound,
        verdict,
        evidence,
        model: None,
    }
}

fn pct(x: f64) -> String {
    format!("{:.0} %", 100.0 * x)
}

fn us(x: f64) -> String {
    format!("{:.0} µs", 1e6 * x)
}

const STAGES: [&str; 3] = ["read", "decode", "transform"];

/// The numbers a finding rests on.
fn evidence(s: &StreamStats, r: &Rates, cores: usize) -> Vec<(String, String)> {
    let mut evidence = vec![
        ("images/s".to_string(), format!("{:.0}", r.images_s)),
        (
            "trainers' data stall (median)".into(),
            format!("{} of {} trainers", pct(r.stall), r.trainers),
        ),
        (
            "pipeline threads busy".into(),
            format!("{} ({}; {cores} cores)", pct(r.busy), threads(s)),
        ),
        ("pipeline threads on a core".into(), pct(r.cpu)),
        ("pipeline waiting for slots".into(), pct(r.blocked)),
    ];
    for (i, st) in STAGES.iter().enumerate() {
        evidence.push((format!("{st} per image"), us(r.per_image[i])));
    }
    if let Some(c) = r.copy_per_batch {
        evidence.push(("copy to a GPU per batch".into(), us(c)));
    }
    if let Some(c) = r.replay_per_sample {
        evidence.push(("replay CPU per replayed sample".into(), us(c)));
    }
    if let Some(why) = s.source.as_ref().and_then(|x| x.caches_chosen.as_ref()) {
        evidence.push(("caches sized by the broker".into(), why.clone()));
    }
    evidence
}

/// The pipeline threads working: all of them, or with `workers` left out
/// as many as the broker keeps working now.
pub fn working(s: &StreamStats) -> u32 {
    match s.workers_auto {
        true => s.workers_active,
        false => s.workers,
    }
}

/// The threads, in words: how many, and how many may work.
fn threads(s: &StreamStats) -> String {
    match s.workers_auto {
        true => format!("{} of {} threads working", s.workers_active, s.workers),
        false => format!("{} threads", s.workers),
    }
}

/// The gain a change must promise for the headline to advise it.
const WORTH: f64 = 0.10;

/// The model's best change for a stream measured at `measured` images/s
/// (not one more trainer: that is no fix), with its gain, if it is worth
/// advising.
fn best_change(predictions: &[Prediction], measured: f64) -> Option<(&Prediction, f64)> {
    predictions
        .iter()
        .filter(|p| p.change != predict::Change::OneMoreTrainer)
        .map(|p| (p, p.rate.images_s / measured.max(1e-9) - 1.0))
        .filter(|&(_, gain)| gain >= WORTH)
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

/// Busy pipeline threads: bound by their largest stage. Its advice is the
/// model's best change where one is given (`best`: what, and its gain),
/// else what the threads and cores say.
fn stage_bound(
    s: &StreamStats,
    r: &Rates,
    cores: usize,
    best: Option<(&str, f64)>,
) -> (Bound, String) {
    let (i, _) = r
        .per_image
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .expect("three stages");
    let bound = [Bound::Read, Bound::Decode, Bound::Transform][i];
    let total: f64 = r.per_image.iter().sum();
    let spare = cores.saturating_sub(working(s) as usize + 1);
    let more = if let Some((what, gain)) = best {
        format!(
            "; the model's best change: {what} ({:+.0} %, below)",
            100.0 * gain
        )
    } else if r.cpu < 0.8 * r.busy {
        format!(
            "; they run only {} of the time they work: this host's {cores} cores are shared with the trainers, so more cores (or the work made elsewhere: feed_stream) would help, more threads would not",
            pct(r.cpu / r.busy)
        )
    } else if spare > 0 && !s.workers_auto {
        format!("; {spare} more pipeline threads (workers) would fit this host's {cores} cores")
    } else if spare > 0 && s.workers_active >= s.workers {
        format!(
            "; all {} threads [broker] max_cpu_share allows work: {spare} more would fit this host's {cores} cores (raise max_cpu_share)",
            s.workers
        )
    } else {
        format!(
            "; all of this host's {cores} cores are in use: fewer or cheaper transforms, or make it elsewhere (feed_stream)"
        )
    };
    let more = more + &prepare_hint(s, bound);
    (
        bound,
        format!(
            "{}-bound: {} pipeline threads {} busy, {} of their time {}ing ({} an image); the trainers wait {} of their time{more}",
            STAGES[i],
            working(s),
            pct(r.busy),
            pct(r.per_image[i] / total.max(1e-12)),
            STAGES[i].trim_end_matches('e'),
            us(r.per_image[i]),
            pct(r.stall)
        ),
    )
}

/// A decode-bound stream whose JPEGs are decoded in part but never cut
/// at restart markers: a prepared copy of its dataset would cut them.
fn prepare_hint(s: &StreamStats, bound: Bound) -> String {
    let Some(src) = s.source.as_ref().filter(|_| bound == Bound::Decode) else {
        return String::new();
    };
    // Most decodes in part not cut: most of its JPEGs have no markers
    // (a few that come with them are cut already).
    if src.in_part == 0 || src.cut.saturating_mul(2) >= src.in_part {
        return String::new();
    }
    format!(
        "; {} of its {} images were decoded in part, {} of them cut: a copy of its dataset that `batchcast prepare` makes (restart markers, the same pixels) would entropy-decode only each crop's part (12-23 % less CPU per image measured)",
        src.in_part, src.decoded, src.cut
    )
}

/// What the findings are read from: two stats replies `dt` seconds
/// apart (no first one: from the broker's start), and the CPU outside the
/// pipelines meanwhile.
pub struct Window<'a> {
    pub before: Option<&'a StatsReply>,
    pub after: &'a StatsReply,
    pub dt: f64,
    /// Per stream: the broker's CPU outside pipelines, and its trainers'.
    pub other: &'a dyn Fn(&StreamStats) -> OtherCpu,
    pub cores: f64,
}

/// Every stream's finding in `w`, with its model and predictions.
pub fn findings(w: &Window<'_>) -> Vec<Finding> {
    let cores = w.cores as usize;
    let was = |s: &StreamStats| {
        w.before
            .and_then(|b| b.streams.iter().find(|p| p.name == s.name))
    };
    let rated: Vec<Rates> = w
        .after
        .streams
        .iter()
        .map(|s| rates(was(s), s, w.dt))
        .collect();
    let all: f64 = rated.iter().map(|r| r.images_s).sum();
    w.after
        .streams
        .iter()
        .zip(rated)
        .map(|(s, r)| {
            let mut f = diagnose(&s.name, s, &r, cores);
            if !matches!(f.bound, Bound::Idle | Bound::Producer) {
                let share = if all > 0.0 {
                    r.images_s / all
                } else {
                    1.0 / w.after.streams.len() as f64
                };
                let inputs =
                    predict::inputs(was(s), s, w.dt, (w.cores, r.stall), (w.other)(s), share);
                let now = inputs.now();
                let predictions = inputs.predictions();
                let best = best_change(&predictions, inputs.images_s)
                    .map(|(p, gain)| (p.what.as_str(), gain));
                // Threads not busy enough for the rule, reads that do not
                // wait, and the host's cores the bound: CPU-bound after
                // all, by the largest stage (the cores shared). A stage's
                // headline advises the model's best change.
                let converted = f.bound == Bound::Read
                    && now.limit == Limit::HostCpu
                    && inputs.io() < 0.25 * inputs.wall[0].max(1e-12);
                let staged = matches!(f.bound, Bound::Read | Bound::Decode | Bound::Transform)
                    && r.busy >= BUSY;
                if converted || (staged && best.is_some()) {
                    (f.bound, f.verdict) = stage_bound(s, &r, cores, best);
                }
                f.model = Some(Model {
                    now,
                    predictions,
                    inputs,
                });
            }
            f
        })
        .collect()
}

pub fn host_cores() -> f64 {
    std::thread::available_parallelism().map_or(1, |n| n.get()) as f64
}

pub fn run(args: &DoctorArgs) -> anyhow::Result<()> {
    let cores = args.cores.unwrap_or_else(host_cores).max(1.0);
    let mut summary = None;
    let found = match &args.run {
        Some(dir) => {
            let s = read_summary(dir)?;
            let found = judge_run(&s, cores);
            if found.is_empty() {
                anyhow::bail!(
                    "{} holds no broker's stats (a run of an older batchcast?)",
                    dir.display()
                );
            }
            summary = Some(s);
            found
        }
        None => {
            let mut client = StatsClient::connect(args.socket.clone())
                .context("asking the broker (is one running? --socket)")?;
            let before = client.fetch()?;
            let cpu0 = CpuSeen::read(&before);
            let watch = Duration::from_secs_f64(args.seconds.clamp(0.1, 3600.0));
            std::thread::sleep(watch);
            let after = client.fetch()?;
            let cpu1 = CpuSeen::read(&after);
            findings(&Window {
                before: Some(&before),
                after: &after,
                dt: watch.as_secs_f64(),
                other: &|s| predict::other_cpu(&cpu0, &cpu1, (Some(&before), &after), s),
                cores,
            })
        }
    };
    let out = if args.json {
        serde_json::to_string(&found)?
    } else if found.is_empty() {
        "the broker serves no stream".into()
    } else {
        found.iter().map(render).collect::<Vec<_>>().join("\n")
    };
    use std::io::Write as _;
    writeln!(std::io::stdout().lock(), "{}", out.trim_end())?;
    if let Some(path) = &args.html {
        let title = match &args.run {
            Some(dir) => format!("batchcast doctor: {}", dir.display()),
            None => "batchcast doctor: the running broker".into(),
        };
        let page = super::report_html::page(&title, summary.as_ref(), &found);
        std::fs::write(path, page).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// A finding as text: the verdict, its evidence, the model's predictions.
fn render(f: &Finding) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "stream `{}`: {}", f.stream, f.verdict);
    for (k, v) in &f.evidence {
        let _ = writeln!(out, "    {k:<32} {v}");
    }
    if let Some(m) = &f.model {
        let measured = m.inputs.images_s;
        let _ = writeln!(
            out,
            "  the model ({}):\n    now: {:.0} images/s against {measured:.0} measured, limited by {}; the predictions scale that bound by {:.2}",
            m.inputs.describe(),
            m.now.images_s,
            m.now.limit.says(),
            m.inputs.calibration(),
        );
        for p in &m.predictions {
            let _ = writeln!(out, "    {}", predict::line(p, measured));
        }
    }
    out
}

/// A run folder's (or its file's) summary.json.
pub fn read_summary(dir: &std::path::Path) -> anyhow::Result<batchcast_cli::report::Summary> {
    let path = if dir.is_file() {
        dir.to_path_buf()
    } else {
        dir.join("summary.json")
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading {} (a launch run folder's summary)", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}", path.display()))
}

/// The findings of a finished run: its shared run's brokers' last stats,
/// from their start; the trainers' CPU is the run's less its brokers'.
pub fn judge_run(summary: &batchcast_cli::report::Summary, cores: f64) -> Vec<Finding> {
    let run = &summary.shared;
    let brokers: f64 = run.brokers.iter().map(|b| b.cpu_s).sum();
    let mut found = Vec::new();
    for b in &run.brokers {
        let Some(last) = &b.last_stats else { continue };
        let pipelines: f64 = last
            .streams
            .iter()
            .map(|s| s.pipeline_cpu_s + s.replay_cpu_s)
            .sum();
        // This broker's trainers: the run's trainers' CPU, by its share
        // of the brokers' CPU.
        let trainers = (run.cpu_s - brokers).max(0.0) * b.cpu_s / brokers.max(1e-9);
        let images: f64 = last.streams.iter().map(images_of).sum();
        let other = |s: &StreamStats| OtherCpu {
            broker: Some((b.cpu_s - pipelines).max(0.0)),
            trainers: Some(trainers * images_of(s) / images.max(1e-9)),
            run_queue: b.run_queue_s.get(&s.name).copied(),
            fetch: None,
        };
        found.extend(findings(&Window {
            before: None,
            after: last,
            dt: last.uptime_s,
            other: &other,
            cores,
        }));
    }
    found
}

/// Images an image stream made (0 for others).
fn images_of(s: &StreamStats) -> f64 {
    s.source.as_ref().map_or(0.0, |x| x.decoded as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stats `batchcast demo` (release build, this project's 2-core
    /// machine) left at its end: 3 trainers, 2 pipeline threads.
    fn demo() -> StatsReply {
        serde_json::from_str(include_str!("doctor_demo_stats.json")).unwrap()
    }

    /// `s` as it was `dt` seconds before, when it had made `images` fewer,
    /// `stage` seconds less in each stage, and each trainer had waited
    /// `wait` and worked `busy` seconds less.
    fn earlier(
        s: &StreamStats,
        images: u64,
        stage: [f64; 3],
        (wait, busy): (f64, f64),
    ) -> StreamStats {
        let mut b = s.clone();
        let src = b.source.as_mut().unwrap();
        src.decoded -= images;
        src.stages.read_s -= stage[0];
        src.stages.decode_s -= stage[1];
        src.stages.transform_s -= stage[2];
        b.pipeline_cpu_s -= 1.0;
        b.producer_blocked_s -= 0.25;
        for c in b.consumers.iter_mut().chain(b.past_consumers.iter_mut()) {
            c.wait_s -= wait;
            c.busy_s -= busy;
        }
        b
    }

    #[test]
    fn the_demo_on_two_cores_is_decode_bound_with_its_cores_shared() {
        let st = demo();
        let s = &st.streams[0];
        let r = rates(None, s, st.uptime_s);
        assert!((0.85..0.95).contains(&r.busy), "{r:?}");
        assert!(r.cpu < 0.8 * r.busy, "{r:?}");
        assert_eq!(r.trainers, 3);
        let f = diagnose(&s.name, s, &r, 2);
        assert_eq!(f.bound, Bound::Decode, "{}", f.verdict);
        assert!(
            f.verdict.starts_with("decode-bound: 2 pipeline threads"),
            "{}",
            f.verdict
        );
        assert!(
            f.verdict.contains("more threads would not"),
            "{}",
            f.verdict
        );
    }

    /// A decode-bound stream decoding JPEGs in part without cutting them
    /// is pointed at `batchcast prepare`; one that cuts, or decodes
    /// whole, is not.
    #[test]
    fn a_decode_bound_stream_of_uncut_crops_is_told_of_prepare() {
        let st = demo();
        let mut s = st.streams[0].clone();
        let said = |s: &StreamStats| {
            let r = rates(None, s, st.uptime_s);
            diagnose(&s.name, s, &r, 2).verdict
        };
        let src = s.source.as_mut().unwrap();
        (src.in_part, src.cut) = (src.decoded, 0);
        assert!(said(&s).contains("batchcast prepare"), "{}", said(&s));
        // Most of them cut: a prepared copy already.
        let src = s.source.as_mut().unwrap();
        src.cut = src.in_part * 9 / 10;
        assert!(!said(&s).contains("batchcast prepare"), "{}", said(&s));
        s.source.as_mut().unwrap().in_part = 0;
        s.source.as_mut().unwrap().cut = 0;
        assert!(!said(&s).contains("batchcast prepare"), "{}", said(&s));
    }

    /// doctor's first finding over one second from `before` to `after`
    /// (each the demo's reply with that one stream), on `cores` cores.
    fn finding_over_a_second(before: StreamStats, after: StreamStats, cores: f64) -> Finding {
        let (mut earlier_reply, mut reply) = (demo(), demo());
        earlier_reply.streams = vec![before];
        reply.streams = vec![after];
        findings(&Window {
            before: Some(&earlier_reply),
            after: &reply,
            dt: 1.0,
            other: &|_| OtherCpu::default(),
            cores,
        })
        .remove(0)
    }

    /// With `workers` left out, doctor counts the threads working, not
    /// those the stream has, and advises one more as the broker's own
    /// doing below the cap, `max_cpu_share` at it.
    #[test]
    fn automatic_threads_are_counted_as_they_work_and_advised_by_their_cap() {
        let found = |active: u32, cap: u32| {
            let mut after = demo().streams[0].clone();
            (after.workers, after.workers_active, after.workers_auto) = (cap, active, true);
            let mut before = earlier(&after, 1000, [0.05, 0.8, 0.15], (0.5, 0.5));
            before.pipeline_cpu_s = after.pipeline_cpu_s - 1.0;
            finding_over_a_second(before, after, 4.0)
        };
        let f = found(1, 2);
        assert!(
            f.verdict
                .starts_with("decode-bound: 1 pipeline threads 100 % busy"),
            "{}",
            f.verdict
        );
        let busy = f
            .evidence
            .iter()
            .find(|(k, _)| k == "pipeline threads busy")
            .unwrap();
        assert!(busy.1.contains("1 of 2 threads working"), "{busy:?}");
        let said = |f: &Finding| -> Vec<String> {
            f.model
                .as_ref()
                .unwrap()
                .predictions
                .iter()
                .map(|p| p.what.clone())
                .collect()
        };
        assert!(
            said(&f)
                .contains(&"2 threads working (the broker adds them itself, up to 2)".to_string()),
            "{:?}",
            said(&f)
        );
        let f = found(2, 2);
        assert!(
            said(&f).contains(
                &"[broker] max_cpu_share for 3 threads (now up to 2 work as trainers need)"
                    .to_string()
            ),
            "{:?}",
            said(&f)
        );
    }

    /// The case a user met: decode-bound with one pipeline thread on two
    /// cores, most crops decoded in part and a few cut (some files came
    /// with markers). The headline advises what the model's best change
    /// is (a second thread), not "all cores in use", and points at
    /// `batchcast prepare`.
    #[test]
    fn the_headline_is_the_models_best_change_and_few_cuts_still_point_at_prepare() {
        let mut after = demo().streams[0].clone();
        after.workers = 1;
        let src = after.source.as_mut().unwrap();
        (src.in_part, src.cut) = (src.decoded * 96 / 100, 25);
        // Over 1 s: 1000 images, the one thread in stages all of it, on a
        // core all of it; the trainers wait half their time.
        let mut before = earlier(&after, 1000, [0.05, 0.8, 0.15], (0.5, 0.5));
        before.pipeline_cpu_s = after.pipeline_cpu_s - 1.0;
        let mut reply = demo();
        reply.streams = vec![after];
        let mut earlier_reply = demo();
        earlier_reply.streams = vec![before];
        let found = findings(&Window {
            before: Some(&earlier_reply),
            after: &reply,
            dt: 1.0,
            other: &|_| OtherCpu::default(),
            cores: 2.0,
        });
        let f = &found[0];
        assert_eq!(f.bound, Bound::Decode, "{}", f.verdict);
        assert!(!f.verdict.contains("cores are in use"), "{}", f.verdict);
        assert!(
            f.verdict.contains("batchcast prepare") && f.verdict.contains("25 of them cut"),
            "{}",
            f.verdict
        );
        // The headline's change is the model's best (here keeping decoded
        // images, +565 %), with the gain the model gives; a second thread
        // is among the predictions below it, at about double.
        let m = f.model.as_ref().unwrap();
        let (best, gain) = best_change(&m.predictions, m.inputs.images_s).unwrap();
        assert!(
            f.verdict.contains(&format!(
                "the model's best change: {} ({:+.0} %",
                best.what,
                100.0 * gain
            )),
            "{}",
            f.verdict
        );
        let two = m
            .predictions
            .iter()
            .find(|p| p.what == "workers = 2")
            .unwrap();
        assert!(
            two.rate.images_s / m.inputs.images_s > 1.5,
            "{:?}",
            two.rate
        );
        // Without a cache to suggest (it keeps its decoded images already:
        // a cache not full), the best is the second thread; a full one
        // (the broker sized it within its budget: it holds a part) leaves
        // the suggestion, and what the broker chose is shown.
        let with_cache = |bytes: u64| {
            let mut kept = reply.streams[0].clone();
            let mut kept_before = earlier_reply.streams[0].clone();
            for st in [&mut kept, &mut kept_before] {
                let src = st.source.as_mut().unwrap();
                src.decoded_cache = Some(batchcast::proto::DecodedCacheStats {
                    bytes,
                    budget: 64 << 20,
                    ..Default::default()
                });
                src.caches_chosen = Some("decoded_cache_mib = 64: ...".into());
            }
            finding_over_a_second(kept_before, kept, 2.0)
        };
        let found = with_cache(1 << 20);
        assert!(
            found
                .verdict
                .contains("the model's best change: workers = 2"),
            "{}",
            found.verdict
        );
        assert!(
            found
                .evidence
                .iter()
                .any(|(k, v)| k == "caches sized by the broker"
                    && v.starts_with("decoded_cache_mib = 64")),
            "{:?}",
            found.evidence
        );
        let full = with_cache(64 << 20).model.unwrap();
        assert!(
            full.predictions
                .iter()
                .any(|p| p.what == "decoded_cache_mib that holds the dataset"),
            "{:?}",
            full.predictions
        );
    }

    #[test]
    fn rates_are_the_differences_over_the_time_between() {
        let after = demo().streams[0].clone();
        let before = earlier(&after, 1000, [0.1, 0.8, 0.3], (0.25, 0.75));
        let r = rates(Some(&before), &after, 2.0);
        assert!((r.images_s - 500.0).abs() < 1e-9, "{r:?}");
        // 1.2 s in stages over 2 threads × 2 s; 1 CPU-s; 0.25 s blocked.
        assert!((r.busy - 0.3).abs() < 1e-9, "{r:?}");
        assert!((r.cpu - 0.25).abs() < 1e-9, "{r:?}");
        assert!((r.blocked - 0.0625).abs() < 1e-9, "{r:?}");
        for (got, want) in r.per_image.iter().zip([1e-4, 8e-4, 3e-4]) {
            assert!((got - want).abs() < 1e-12, "{r:?}");
        }
        assert!((r.stall - 0.25).abs() < 1e-9, "{r:?}");
    }

    #[test]
    fn each_bottleneck_gets_its_verdict() {
        let after = demo().streams[0].clone();
        let verdict = |stage: [f64; 3], blocked: f64, wait: f64| {
            let mut before = earlier(&after, 1000, stage, (wait, 1.0 - wait));
            before.producer_blocked_s = after.producer_blocked_s - blocked;
            let r = rates(Some(&before), &after, 1.0);
            diagnose("s", &after, &r, 16).bound
        };
        // Trainers that rarely wait: theirs, whatever the pipeline does.
        assert_eq!(verdict([0.1, 1.7, 0.1], 0.0, 0.02), Bound::Trainer);
        // Busy threads (1.9 of 2 thread-seconds in stages): the largest stage.
        assert_eq!(verdict([0.1, 1.7, 0.1], 0.0, 0.5), Bound::Decode);
        assert_eq!(verdict([1.5, 0.2, 0.2], 0.0, 0.5), Bound::Read);
        assert_eq!(verdict([0.1, 0.3, 1.5], 0.0, 0.5), Bound::Transform);
        // Idle threads waiting for slots while trainers wait: flow.
        assert_eq!(verdict([0.1, 0.2, 0.1], 1.5, 0.5), Bound::Flow);
        // Idle threads, no slot wait: reads that wait for storage.
        assert_eq!(verdict([0.1, 0.2, 0.1], 0.0, 0.5), Bound::Read);
    }

    /// One trainer of three that claims it waited all the time (its
    /// client's own report) does not turn the honest two's verdict.
    #[test]
    fn one_lying_trainer_does_not_move_the_verdict() {
        let after = demo().streams[0].clone();
        let mut before = earlier(&after, 1000, [0.1, 1.7, 0.1], (0.02, 0.98));
        let liar = &mut before.past_consumers[0];
        liar.wait_s = after.past_consumers[0].wait_s - 1000.0;
        liar.busy_s = after.past_consumers[0].busy_s;
        let r = rates(Some(&before), &after, 1.0);
        assert_eq!(r.trainers, 3);
        assert!((r.stall - 0.02).abs() < 1e-9, "{r:?}");
        assert_eq!(diagnose("s", &after, &r, 16).bound, Bound::Trainer);
    }

    /// Copies to a GPU and replays are timed per batch and per sample over
    /// the interval, and shown only where there were some.
    #[test]
    fn gpu_copies_and_replays_are_timed_between_the_two_stats() {
        let before = demo().streams[0].clone();
        assert_eq!(rates(None, &before, 1.0).copy_per_batch, None);
        assert_eq!(rates(None, &before, 1.0).replay_per_sample, None);
        let mut after = before.clone();
        after.replay_cpu_s += 0.5;
        after.past_consumers[0].replayed += 1000;
        let gpu = |copies, copy_s| batchcast::proto::GpuCopyStats {
            gpu: "cuda:0".into(),
            copies,
            bytes: 0,
            copy_s,
            pinned: true,
            slots: 4,
            slots_in_use: 0,
            waiting: 0,
            replayed: 0,
        };
        let mut before = before;
        before.gpus = vec![gpu(100, 0.1)];
        after.gpus = vec![gpu(300, 0.5)];
        let r = rates(Some(&before), &after, 1.0);
        assert!((r.copy_per_batch.unwrap() - 0.002).abs() < 1e-12, "{r:?}");
        assert!(
            (r.replay_per_sample.unwrap() - 0.0005).abs() < 1e-12,
            "{r:?}"
        );
        let f = diagnose("s", &after, &r, 2);
        let shown: Vec<&str> = f.evidence.iter().map(|(k, _)| k.as_str()).collect();
        assert!(shown.contains(&"copy to a GPU per batch"), "{shown:?}");
        assert!(
            shown.contains(&"replay CPU per replayed sample"),
            "{shown:?}"
        );
    }

    /// The demand the predictions rest on is the median trainer's: one
    /// trainer claiming a step of 1000 s, or none at all, leaves it.
    #[test]
    fn one_lying_trainer_does_not_move_the_prediction() {
        let after = demo().streams[0].clone();
        let demand = |lie: f64| {
            let mut before = earlier(&after, 1000, [0.1, 1.7, 0.1], (0.5, 0.5));
            for c in before
                .consumers
                .iter_mut()
                .chain(&mut before.past_consumers)
            {
                c.samples -= 1000;
            }
            before.past_consumers[0].busy_s = after.past_consumers[0].busy_s - lie;
            let r = rates(Some(&before), &after, 1.0);
            let i = predict::inputs(
                Some(&before),
                &after,
                1.0,
                (2.0, r.stall),
                OtherCpu::default(),
                1.0,
            );
            assert_eq!(i.trainers, 3);
            i.demand
        };
        // Honest: 1000 samples in 0.5 busy seconds each.
        assert!((demand(0.5) - 2000.0).abs() < 1e-6);
        assert!((demand(1000.0) - 2000.0).abs() < 1e-6);
        assert!((demand(0.0) - 2000.0).abs() < 1e-6);
    }
}
