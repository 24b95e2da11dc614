//! Image pipeline benchmark: the native pipeline against the Pillow + numpy
//! pipeline a torchvision user runs, on an ImageFolder of real photographs,
//! and the broker's CPU per epoch as consumers are added.
//!
//! Bound: every image must be read and entropy-decoded once per epoch; the
//! rest (IDCT, colour conversion, resampling, normalising) scales with the
//! pixels touched. The native pipeline avoids work Pillow does: it decodes
//! JPEGs at 1/2, 1/4 or 1/8 size in the DCT domain when the crop is that
//! much larger than the output, resamples with SIMD, and normalises through
//! a per-channel lookup table straight into the slot (no float temporaries).
//! Expected: several times Pillow's images per CPU-second on photos larger
//! than the output, less on small ones where decoding dominates both.
//!
//! Decoding only the crop: RandomResizedCrop keeps on average about 54 %
//! of the image's area (scale uniform in 0.08..1, clamped by the aspect),
//! so the IDCT, upsampling and colour conversion it skips are about half
//! of a whole decode's; entropy decoding still reads every block above the
//! crop's last row (a JPEG has no index into its scans), so expect CPU per
//! image to fall by a third at most where those pixel stages dominate
//! (large photos), less on ImageNet-sized ones. It is measured against the
//! whole-image decode of the same reduced scale, alternating, median of
//! `--repeats`.
//!
//! The dataset as `batchcast prepare` copies it (`--prepared`): with a
//! restart marker after every MCU, a crop is cut out of the file and only
//! its MCUs (and a margin) are entropy-decoded: the Huffman work falls
//! from the rows above the crop's bottom, every column, to the crop's
//! area, about 0.9 to 0.65 of the image on average; but libjpeg-turbo
//! decodes a scan with restart markers on its slower Huffman path (a
//! whole decode of the prepared copy costs more than of the original).
//! Expected: a further tenth to a fifth less CPU per image, most on large
//! photos. With
//! the broker, CPU per epoch is the decode work once, whatever the number of
//! consumers.
//!
//! Run: `bench/images.sh PATH` (see bench/RESULTS.md "Image pipeline benchmark").

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, bail};
use batchcast_broker::config::image_stream_toml;
use batchcast_broker::pipeline::dataset::Dataset;
use batchcast_broker::pipeline::transform::{Geometry, Transform};
use batchcast_broker::pipeline::{CacheSize, ImagePipeline, OnError, SampleRules, Worker};
use batchcast_cli::harness::{self, BrokerProcess};
use batchcast_cli::report::ConsumerReport;
use clap::Parser;

#[derive(Debug, Parser)]
struct Args {
    /// An ImageFolder (`root/<class>/<image>`) of photographs
    dataset: PathBuf,
    /// Passes over the dataset per measurement
    #[arg(long, default_value_t = 3)]
    passes: usize,
    /// Python with Pillow and numpy [default: .venv/bin/python]
    #[arg(long)]
    python: Option<PathBuf>,
    /// The batchcast binary [default: next to this one]
    #[arg(long)]
    exe: Option<PathBuf>,
    /// Consumer counts for the broker rows
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 2, 4])]
    consumers: Vec<usize>,
    /// Runs of each decode variant (alternating); rows show the median
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// The decoded cache that holds the dataset, in MiB
    #[arg(long, default_value_t = 1024)]
    decoded_cache_mib: u64,
    /// The longer side decoded images are kept at
    #[arg(long, default_value_t = 256)]
    decoded_side: u32,
    /// The dataset as `batchcast prepare` copies it (restart markers):
    /// its crop-only rows, alternating with the dataset's
    #[arg(long)]
    prepared: Option<PathBuf>,
    /// Only the caches the broker sizes itself: no keys set against the
    /// caches off (the defaults before), with the memory budget of a
    /// broker at its defaults and with `--small-budget-mib`, alternating,
    /// medians of `--repeats`
    #[arg(long)]
    autosize: bool,
    /// The small memory budget of `--autosize`, in MiB (the cache gets a
    /// quarter of it)
    #[arg(long, default_value_t = 128)]
    small_budget_mib: u64,
}

/// How the native pipeline decodes a JPEG.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decode {
    /// At the reduced scale, only the part the crop reads (the default).
    Crop,
    /// At the reduced scale, the whole image (before crop-only decoding).
    Whole,
    /// At full size, the whole image.
    FullSize,
}

impl Decode {
    fn label(self) -> &'static str {
        match self {
            Decode::Crop => "native",
            Decode::Whole => "native, whole-image decode",
            Decode::FullSize => "native, full-size decode",
        }
    }
}

fn process_cpu() -> f64 {
    harness::cpu_seconds(std::process::id()).unwrap_or(0.0)
}

const MEAN: [f64; 3] = [0.485, 0.456, 0.406];
const STD: [f64; 3] = [0.229, 0.224, 0.225];

fn transform() -> Transform {
    Transform {
        flip_p: 0.5,
        normalize: Some((MEAN, STD)),
        ..Transform::of(Geometry::RandomResizedCrop {
            size: (224, 224),
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
        })
    }
}

#[derive(Clone)]
struct Row {
    what: String,
    threads: usize,
    images: usize,
    wall: f64,
    cpu: f64,
}

/// The sample rules of a decode variant (no caches).
fn rules(decode: Decode) -> SampleRules {
    SampleRules {
        on_error: OnError::Skip,
        max_pixels: u64::MAX,
        max_file_bytes: u64::MAX,
        reduced_decode: decode != Decode::FullSize,
        crop_decode: decode == Decode::Crop,
        cache: CacheSize::Bytes(0),
        decoded_cache: CacheSize::Bytes(0),
        decoded_side: None,
    }
}

fn pipeline(root: &Path, rules: SampleRules) -> anyhow::Result<Arc<ImagePipeline>> {
    let ds = Dataset::image_folder(root)?;
    Ok(Arc::new(ImagePipeline::new(
        Arc::new(ds),
        transform(),
        rules,
        None,
    )))
}

/// The native pipeline in this process: `threads` threads share the work.
/// What the always-on stage clock costs (`pipeline::stages`): a timed
/// stage measured here, three an image, against `cpu_s` CPU-seconds an
/// image of crop-only decoding.
fn stage_clock_line(cpu_s: f64) -> String {
    use batchcast_broker::pipeline::stages::{Stage, StageClock};
    let clock = StageClock::default();
    let n = 1_000_000u32;
    let per = |stage: Stage| {
        let t0 = std::time::Instant::now();
        for i in 0..n {
            std::hint::black_box(clock.time(stage, || std::hint::black_box(i)));
        }
        t0.elapsed().as_secs_f64() / f64::from(n)
    };
    let (read, other) = (per(Stage::Read), per(Stage::Decode));
    let image = read + 2.0 * other;
    format!(
        "stage clock: {:.0} ns a read (its CPU clock too), {:.0} ns a decode or transform; {:.0} ns an image = {:.3} % of the CPU per image of crop-only decoding",
        read * 1e9,
        other * 1e9,
        image * 1e9,
        100.0 * image / cpu_s
    )
}

fn native(root: &Path, threads: usize, passes: usize, decode: Decode) -> anyhow::Result<Row> {
    let p = pipeline(root, rules(decode))?;
    run(&p, threads, 0..passes, decode.label())
}

/// The pipeline keeping decoded images (`decoded_cache_mib` of
/// `cache_bytes`, `decoded_side` of `side`): its first epoch and the
/// later ones, apart.
fn kept(root: &Path, passes: usize, cache_bytes: u64, side: u32) -> anyhow::Result<(Row, Row)> {
    let p = pipeline(
        root,
        SampleRules {
            decoded_cache: CacheSize::Bytes(cache_bytes),
            decoded_side: Some(side),
            ..rules(Decode::Crop)
        },
    )?;
    let what = format!(
        "native, decoded cache {} MiB at side {side}",
        cache_bytes >> 20
    );
    let first = run(&p, 1, 0..1, &format!("{what}: first epoch"))?;
    let later = run(&p, 1, 1..passes.max(2), &format!("{what}: later epochs"))?;
    Ok((first, later))
}

/// `threads` threads make every sample of `epochs` through `p`.
fn run(
    p: &Arc<ImagePipeline>,
    threads: usize,
    epochs: std::ops::Range<usize>,
    what: &str,
) -> anyhow::Result<Row> {
    let n = p.dataset.len() as usize;
    let (from, total) = (epochs.start * n, epochs.len() * n);
    let next = Arc::new(AtomicUsize::new(0));
    let (cpu0, t0) = (process_cpu(), Instant::now());
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (p, next) = (p.clone(), next.clone());
            std::thread::spawn(move || -> anyhow::Result<()> {
                let mut w = Worker::new()?;
                let mut out = vec![0u8; 3 * 224 * 224 * 4];
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= total {
                        return Ok(());
                    }
                    let k = from + k;
                    p.fill(&mut w, (k / n) as u64, (k % n) as u64, None, &mut out)?;
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("bench thread")?;
    }
    let counts = p.counts();
    if counts.skipped > 0 {
        eprintln!("note: {} unreadable images were replaced", counts.skipped);
    }
    Ok(Row {
        what: what.into(),
        threads,
        images: total,
        wall: t0.elapsed().as_secs_f64(),
        cpu: process_cpu() - cpu0,
    })
}

/// The run of median CPU per image.
fn median(mut runs: Vec<Row>) -> Row {
    runs.sort_by(|a, b| (a.cpu / a.images as f64).total_cmp(&(b.cpu / b.images as f64)));
    runs.swap_remove(runs.len() / 2)
}

fn pillow(python: &Path, root: &Path, procs: usize, passes: usize) -> anyhow::Result<Row> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("pillow_pipeline.py");
    let out = Command::new(python)
        .arg(&script)
        .arg(root)
        .args([
            "--passes",
            &passes.to_string(),
            "--procs",
            &procs.to_string(),
        ])
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    if !out.status.success() {
        bail!(
            "Pillow pipeline failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(Row {
        what: "Pillow + numpy".into(),
        threads: procs,
        images: v["images"].as_u64().unwrap_or(0) as usize,
        wall: v["wall_s"].as_f64().unwrap_or(0.0),
        cpu: v["cpu_s"].as_f64().unwrap_or(0.0),
    })
}

/// One broker, one epoch, `n` consumers: broker CPU seconds for the epoch.
fn broker_epoch(exe: &Path, root: &Path, n: usize) -> anyhow::Result<(f64, f64, bool)> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("b.toml");
    // Two pipeline threads: the machine's cores, as the native rows use.
    let toml = image_stream_toml("train", root, 224, 1, n, "workers = 2");
    std::fs::write(&cfg, toml)?;
    let sock = dir.path().join("b.sock");
    let mut broker = BrokerProcess::spawn(exe, Some(&cfg), &sock, Some(&dir.path().join("log")))?;
    let cpu0 = harness::thread_cpu_seconds(broker.pid()).unwrap_or(0.0);
    let t0 = Instant::now();
    let kids = (0..n)
        .map(|_| {
            harness::spawn_consumer(
                exe,
                &sock,
                &["--stream".into(), "train".into(), "--digest".into()],
            )
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let reports: Vec<ConsumerReport> = kids
        .into_iter()
        .map(|k| harness::wait_report(k, std::time::Duration::from_secs(600)))
        .collect::<std::io::Result<_>>()?;
    let wall = t0.elapsed().as_secs_f64();
    let cpu = harness::thread_cpu_seconds(broker.pid()).unwrap_or(0.0) - cpu0;
    let d0 = reports[0].epochs.first().and_then(|e| e.digest.clone());
    let same = reports
        .iter()
        .all(|r| r.ok && r.epochs.first().and_then(|e| e.digest.clone()) == d0);
    broker.terminate(std::time::Duration::from_secs(5))?;
    Ok((cpu, wall, same))
}

/// The decoded-cache rows (a cache that holds the dataset, and one that
/// holds almost none of it, as a dataset larger than memory sees), with
/// their ratios to the first row (the native pipeline, 1 thread).
fn kept_rows(a: &Args, rows: &mut Vec<Row>) -> anyhow::Result<Vec<String>> {
    let rate = |r: &Row| r.images as f64 / r.wall;
    let native = rate(&rows[0]);
    let mut lines = Vec::new();
    for bytes in [a.decoded_cache_mib << 20, 1 << 20] {
        let (first, later) = kept(&a.dataset, a.passes, bytes, a.decoded_side)?;
        lines.push(format!(
            "decoded cache of {} MiB at side {}: later epochs {:.2}x the first epoch's images/s; first epoch {:.2}x, later {:.2}x the images/s of the native row (1 thread)",
            bytes >> 20,
            a.decoded_side,
            rate(&later) / rate(&first),
            rate(&first) / native,
            rate(&later) / native,
        ));
        rows.push(first);
        rows.push(later);
    }
    Ok(lines)
}

/// The pipeline with its caches left to the broker (`CacheSize::Auto`),
/// sized from `budget_mib` of memory budget as a broker's stream start
/// sizes them: its first epoch and the later ones apart, and what it chose.
fn autosized(a: &Args, budget_mib: Option<u64>) -> anyhow::Result<(Row, Row, String)> {
    use batchcast_broker::budget::Budget;
    let rules = SampleRules {
        cache: if budget_mib.is_some() {
            CacheSize::Auto
        } else {
            CacheSize::Bytes(0)
        },
        decoded_cache: if budget_mib.is_some() {
            CacheSize::Auto
        } else {
            CacheSize::Bytes(0)
        },
        ..rules(Decode::Crop)
    };
    let p = pipeline(&a.dataset, rules)?;
    let budget = Budget::new(budget_mib.unwrap_or(0) << 20, 0);
    p.reserve(&budget, 0, "stream `bench`", None)?;
    let what = match budget_mib {
        None => "caches off (the defaults before)".to_string(),
        Some(m) => format!("caches sized by the broker, memory budget {m} MiB"),
    };
    let first = run(&p, 1, 0..1, &format!("{what}: first epoch"))?;
    // The later epochs one at a time, summed into one row.
    let mut later = run(&p, 1, 1..2, &format!("{what}: later epochs"))?;
    let mut each = vec![
        first.images as f64 / first.wall,
        later.images as f64 / later.wall,
    ];
    for e in 2..a.passes.max(2) {
        let r = run(&p, 1, e..e + 1, "")?;
        each.push(r.images as f64 / r.wall);
        later.images += r.images;
        later.wall += r.wall;
        later.cpu += r.cpu;
    }
    let each: Vec<String> = each.iter().map(|r| format!("{r:.0}")).collect();
    let chose = format!(
        "images/s by epoch {}; chose: {}",
        each.join(", "),
        p.caches_chosen().unwrap_or_default()
    );
    Ok((first, later, chose))
}

/// `--autosize`: the table of [`autosized`] against the caches off, and
/// the ratios the targets are stated in.
fn autosize_main(a: &Args) -> anyhow::Result<()> {
    let half_ram =
        batchcast_broker::pipeline::autosize::meminfo("MemTotal").unwrap_or(8 << 30) >> 21;
    let configs = [None, Some(half_ram), Some(a.small_budget_mib)];
    let mut runs: Vec<Vec<(Row, Row)>> = vec![Vec::new(); configs.len()];
    let mut chosen = vec![String::new(); configs.len()];
    for _ in 0..a.repeats.max(1) {
        for (i, c) in configs.iter().enumerate() {
            let (first, later, chose) = autosized(a, *c)?;
            runs[i].push((first, later));
            chosen[i] = chose;
        }
    }
    let rate = |r: &Row| r.images as f64 / r.wall;
    let med = |rs: &[(Row, Row)], later: bool| -> Row {
        let mut v: Vec<Row> = rs
            .iter()
            .map(|(f, l)| if later { l.clone() } else { f.clone() })
            .collect();
        v.sort_by(|x, y| rate(x).total_cmp(&rate(y)));
        v.swap_remove(v.len() / 2)
    };
    println!(
        "| pipeline (1 thread, median of {} by images/s) | images/s | CPU-ms per image | vs caches off, same epochs |",
        a.repeats.max(1)
    );
    println!("|---|---:|---:|---:|");
    let (off_first, off_later) = (med(&runs[0], false), med(&runs[0], true));
    for rs in &runs {
        for (r, base) in [(med(rs, false), &off_first), (med(rs, true), &off_later)] {
            println!(
                "| {} | {:.0} | {:.2} | {:.2}x |",
                r.what,
                rate(&r),
                r.cpu * 1e3 / r.images as f64,
                rate(&r) / rate(base)
            );
        }
    }
    println!();
    for (i, c) in configs.iter().enumerate().skip(1) {
        let (first, later) = (med(&runs[i], false), med(&runs[i], true));
        println!(
            "memory budget {} MiB: later epochs {:.2}x the first epoch's images/s; first epoch {:.2}x, later {:.2}x the caches-off rows' (the last run's {})\n",
            c.unwrap_or(0),
            rate(&later) / rate(&first),
            rate(&first) / rate(&off_first),
            rate(&later) / rate(&off_later),
            chosen[i]
        );
    }
    Ok(())
}

/// Crop-only against whole-image decoding (and crop-only from the
/// prepared copy, if given), alternating on one thread, `--repeats` runs
/// each: the median rows (crop-only first, then 2 threads, then the
/// whole-image decode and the prepared copy's), the ratio lines, and
/// crop-only's CPU-ms per image.
fn decode_rows(a: &Args) -> anyhow::Result<(Vec<Row>, Vec<String>, f64)> {
    let (mut crop, mut whole, mut cut) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..a.repeats.max(1) {
        whole.push(native(&a.dataset, 1, a.passes, Decode::Whole)?);
        crop.push(native(&a.dataset, 1, a.passes, Decode::Crop)?);
        if let Some(p) = &a.prepared {
            let mut r = native(p, 1, a.passes, Decode::Crop)?;
            r.what = "native, the prepared copy (restart markers)".into();
            cut.push(r);
        }
    }
    let (crop, whole) = (median(crop), median(whole));
    let ratio = |r: &Row| (r.cpu / r.images as f64, r.images as f64 / r.cpu);
    let ((c_ms, c_per), (w_ms, w_per)) = (ratio(&crop), ratio(&whole));
    let n = a.repeats.max(1);
    let mut lines = vec![format!(
        "crop-only vs whole-image decode (1 thread, median of {n}): CPU per image {:.2}x, images per CPU-second {:.2}x",
        c_ms / w_ms,
        c_per / w_per
    )];
    let mut rows = vec![crop, native(&a.dataset, 2, a.passes, Decode::Crop)?, whole];
    if let Some(p) = &a.prepared {
        let cut = median(cut);
        let (p_ms, p_per) = ratio(&cut);
        lines.push(format!(
            "crop-only from the prepared copy vs whole-image decode of the dataset (1 thread, median of {n}): CPU per image {:.2}x, images per CPU-second {:.2}x; vs crop-only of the dataset: {:.2}x, {:.2}x",
            p_ms / w_ms,
            p_per / w_per,
            p_ms / c_ms,
            p_per / c_per
        ));
        rows.push(cut);
        let mut r = native(p, 2, a.passes, Decode::Crop)?;
        r.what = "native, the prepared copy (restart markers)".into();
        rows.push(r);
        let mut r = native(p, 1, a.passes, Decode::Whole)?;
        r.what = "native, the prepared copy, whole-image decode".into();
        rows.push(r);
    }
    Ok((rows, lines, c_ms))
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if a.autosize {
        return autosize_main(&a);
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = a.python.clone().unwrap_or(repo.join(".venv/bin/python"));
    let exe = harness::batchcast_exe(a.exe.as_deref())?;
    let n = Dataset::image_folder(&a.dataset)?.len();
    println!(
        "dataset: {} ({n} images), {} passes, RandomResizedCrop(224) + flip + Normalize, f32 NCHW\n",
        a.dataset.display(),
        a.passes
    );
    let (mut rows, decode_lines, c_ms) = decode_rows(&a)?;
    let clock_line = stage_clock_line(c_ms);
    rows.push(native(&a.dataset, 1, a.passes, Decode::FullSize)?);
    let kept_lines = kept_rows(&a, &mut rows)?;
    for p in [1, 2] {
        rows.push(pillow(&python, &a.dataset, p, a.passes)?);
    }
    let pil = rows
        .iter()
        .find(|r| r.what.starts_with("Pillow") && r.threads == 1)
        .map(|r| r.images as f64 / r.cpu)
        .unwrap_or(f64::NAN);
    println!(
        "| pipeline | threads/processes | images/s | CPU-ms per image | images per CPU-s | vs Pillow (per CPU-s) |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        let per_cpu = r.images as f64 / r.cpu;
        println!(
            "| {} | {} | {:.0} | {:.2} | {:.0} | {:.2}x |",
            r.what,
            r.threads,
            r.images as f64 / r.wall,
            r.cpu * 1e3 / r.images as f64,
            per_cpu,
            per_cpu / pil
        );
    }
    println!();
    for l in &decode_lines {
        println!("{l}");
    }
    println!("{clock_line}\n");
    for l in &kept_lines {
        println!("{l}\n");
    }
    println!(
        "| consumers | broker CPU-s per epoch | epoch wall s | identical bytes at every consumer |"
    );
    println!("|---:|---:|---:|:-:|");
    let mut first = None;
    for &c in &a.consumers {
        let (cpu, wall, same) = broker_epoch(&exe, &a.dataset, c)?;
        first.get_or_insert(cpu);
        println!(
            "| {c} | {cpu:.2} ({:.2}x) | {wall:.2} | {} |",
            cpu / first.unwrap_or(cpu),
            if same { "yes" } else { "NO" }
        );
    }
    Ok(())
}
