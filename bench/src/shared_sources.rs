//! Shared source benchmark: three streams a sweep varies (RandomResizedCrop
//! 224, RandomResizedCrop 160, TrivialAugmentWide + RandomResizedCrop 224;
//! all with a horizontal flip, ImageNet Normalize, f32 NCHW) on a folder
//! of photographs, one trainer each, run three ways: as independent
//! streams (each reads and decodes every image), on one `[[source]]` with
//! `decode = "exact"`, and with `decode = "once"`.
//!
//! Bound: alone, the three streams decode each image three times; on a
//! source, once per distinct JPEG scale their crops ask for (`exact`:
//! between 1 and 3), or once (`once`). Decoding is most of a sample's CPU
//! on photographs, so the broker's CPU per epoch should fall towards a
//! third plus the three transforms.
//!
//! For each way: decodes per image per epoch, broker CPU seconds per epoch
//! (the whole process), the pipeline's CPU, how long streams waited for
//! each other, and whether each stream's bytes (a digest per epoch) equal
//! the independent stream's. Then the CPU each augmentation op costs per
//! 224×224 image, native against Pillow running torchvision's op on the
//! same crops (`bench/augment_ops.py`).
//!
//! Run: `bench/shared_sources.sh DATASET` (an ImageFolder; make one of
//! real photographs with `python bench/prepare_photos.py OUT`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use batchcast_broker::pipeline::augment::{AffineFilter, Canvas, Op};
use batchcast_cli::harness::{self, BrokerProcess};
use batchcast_cli::procstat;
use clap::Parser;

#[derive(Debug, Parser)]
struct Args {
    /// An ImageFolder of photographs
    dataset: PathBuf,
    /// The batchcast binary [default: next to this one]
    #[arg(long)]
    exe: Option<PathBuf>,
    /// Epochs each trainer reads
    #[arg(long, default_value_t = 2)]
    epochs: u64,
    /// Pipeline threads per stream
    #[arg(long, default_value_t = 2)]
    workers: u32,
    /// Python with Pillow and numpy, for the per-op table
    #[arg(long, default_value = ".venv/bin/python")]
    python: PathBuf,
    /// Crops timed per op (each op runs on every crop)
    #[arg(long, default_value_t = 64)]
    crops: usize,
    /// Output dtype: `f32` (with ImageNet Normalize) or `u8` (the trainer
    /// normalizes on its GPU)
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Skip the per-op table
    #[arg(long)]
    no_ops: bool,
    /// Only the per-op table
    #[arg(long)]
    only_ops: bool,
}

const NORM: &str = "normalize = { mean = [0.485, 0.456, 0.406], std = [0.229, 0.224, 0.225] }";

/// (stream, transform).
const STREAMS: [(&str, &str); 3] = [
    ("rrc224", "random_resized_crop = { size = 224 }"),
    ("rrc160", "random_resized_crop = { size = 160 }"),
    (
        "ta224",
        "random_resized_crop = { size = 224 }\ntrivial_augment_wide = true",
    ),
];

fn config(root: &Path, epochs: u64, workers: u32, dtype: &str, decode: Option<&str>) -> String {
    let output = match dtype {
        "u8" => "dtype = \"u8\"".to_string(),
        d => format!("dtype = \"{d}\"\n{NORM}"),
    };
    let data = "seed = 3\n";
    let folder = |t: &str| format!("[{t}.image_folder]\nroot = \"{}\"\n", root.display());
    let mut c = String::new();
    if let Some(d) = decode {
        c += &format!(
            "[[source]]\nname = \"photos\"\n{data}decode = \"{d}\"\n{}\n",
            folder("source")
        );
    }
    for (name, t) in STREAMS {
        c += &format!(
            "[[stream]]\nname = \"{name}\"\nbatch_size = 64\nepochs = {epochs}\nworkers = {workers}\nslots = 8\n"
        );
        match decode {
            Some(_) => c += "source = \"photos\"\n",
            None => c += &format!("{data}{}", folder("stream")),
        }
        c += &format!("[stream.transform]\n{t}\nhorizontal_flip = 0.5\n{output}\n\n");
    }
    c
}

struct Run {
    /// Per stream: its epochs' digests.
    digests: BTreeMap<String, Vec<String>>,
    decodes: u64,
    written: u64,
    broker_cpu_s: f64,
    pipeline_cpu_s: f64,
    held_s: f64,
    wall_s: f64,
}

fn run(exe: &Path, cfg: &str) -> anyhow::Result<Run> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.toml");
    std::fs::write(&path, cfg)?;
    let sock = dir.path().join("b.sock");
    let mut broker =
        BrokerProcess::spawn(exe, Some(&path), &sock, Some(&dir.path().join("b.log")))?;
    let cpu0 = procstat::cpu_seconds(broker.pid()).unwrap_or(0.0);
    let t0 = Instant::now();
    let mut children = Vec::new();
    for (name, _) in STREAMS {
        let args: Vec<String> = ["--stream", name, "--digest", "--name", name]
            .map(String::from)
            .to_vec();
        children.push((name, harness::spawn_consumer(exe, &sock, &args)?));
    }
    let mut digests = BTreeMap::new();
    for (name, child) in children {
        let r = harness::wait_report(child, Duration::from_secs(1800))?;
        if !r.ok || !r.ended {
            bail!("trainer {name} failed: {:?}", r.error);
        }
        digests.insert(
            name.to_string(),
            r.epochs.iter().filter_map(|e| e.digest.clone()).collect(),
        );
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let broker_cpu_s = procstat::cpu_seconds(broker.pid()).unwrap_or(0.0) - cpu0;
    let stats = broker.stats()?;
    broker.terminate(Duration::from_secs(5))?;
    let mut run = Run {
        digests,
        decodes: 0,
        written: 0,
        broker_cpu_s,
        pipeline_cpu_s: 0.0,
        held_s: 0.0,
        wall_s,
    };
    for st in &stats.streams {
        let src = st.source.as_ref().context("an image stream")?;
        run.pipeline_cpu_s += st.pipeline_cpu_s;
        run.written += src.decoded;
        match &src.shared {
            Some(sh) => {
                run.decodes = sh.decodes;
                run.held_s += sh.held_s;
            }
            None => run.decodes += src.decoded,
        }
    }
    Ok(run)
}

fn count_images(root: &Path) -> anyhow::Result<u64> {
    let mut n = 0;
    for class in std::fs::read_dir(root).with_context(|| format!("{}", root.display()))? {
        let class = class?.path();
        if class.is_dir() {
            n += std::fs::read_dir(&class)?.count() as u64;
        }
    }
    Ok(n)
}

fn shared_table(a: &Args, exe: &Path) -> anyhow::Result<()> {
    let images = count_images(&a.dataset)?;
    let ways = [
        ("independent streams", None),
        ("one source, decode = \"exact\"", Some("exact")),
        ("one source, decode = \"once\"", Some("once")),
    ];
    println!(
        "| {images} photos × {} epochs, 3 streams, {} out | decodes per image served | broker CPU s per epoch | vs independent | pipeline CPU s per epoch | held s | wall s | bytes equal to independent (rrc224, rrc160, ta224) |",
        a.epochs, a.dtype
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---|");
    let mut base: Option<Run> = None;
    for (label, decode) in ways {
        eprintln!("{label} ...");
        let cfg = config(&a.dataset, a.epochs, a.workers, &a.dtype, decode);
        let r = run(exe, &cfg).context(label)?;
        let per_epoch = |x: f64| x / a.epochs as f64;
        let (ratio, same) = match &base {
            None => ("1.00×".to_string(), "(reference)".to_string()),
            Some(b) => (
                format!("{:.2}×", r.broker_cpu_s / b.broker_cpu_s),
                STREAMS
                    .iter()
                    .map(|(s, _)| {
                        if r.digests[*s] == b.digests[*s] {
                            "yes"
                        } else {
                            "no"
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
        };
        println!(
            "| {label} | {:.2} | {:.2} | {ratio} | {:.2} | {:.2} | {:.1} | {same} |",
            // Each stream writes the same samples (one order, batches of 64).
            r.decodes as f64 / (r.written as f64 / STREAMS.len() as f64),
            per_epoch(r.broker_cpu_s),
            per_epoch(r.pipeline_cpu_s),
            r.held_s,
            r.wall_s,
        );
        eprintln!("  {} samples written, {} decodes", r.written, r.decodes);
        if base.is_none() {
            base = Some(r);
        }
    }
    Ok(())
}

/// The ops timed, as (torchvision name, magnitude, ours, the geometric
/// ops' interpolation).
fn ops() -> Vec<(&'static str, f64, Op, AffineFilter)> {
    let nearest = AffineFilter::Nearest;
    vec![
        ("ShearX", 0.5, Op::ShearX(0.5), nearest),
        ("ShearX", 0.5, Op::ShearX(0.5), AffineFilter::Bilinear),
        ("TranslateX", 16.0, Op::TranslateX(16.0), nearest),
        ("Rotate", 30.0, Op::Rotate(30.0), nearest),
        ("Rotate", 30.0, Op::Rotate(30.0), AffineFilter::Bilinear),
        ("Rotate", 30.0, Op::Rotate(30.0), AffineFilter::Bicubic),
        ("Brightness", 1.5, Op::Brightness(1.5), nearest),
        ("Color", 1.5, Op::Color(1.5), nearest),
        ("Contrast", 1.5, Op::Contrast(1.5), nearest),
        ("Sharpness", 1.5, Op::Sharpness(1.5), nearest),
        ("Hue", 0.1, Op::Hue(0.1), nearest),
        ("Posterize", 4.0, Op::Posterize(4), nearest),
        ("Solarize", 128.0, Op::Solarize(128.0), nearest),
        ("AutoContrast", 0.0, Op::AutoContrast, nearest),
        ("Equalize", 0.0, Op::Equalize, nearest),
        ("Grayscale", 0.0, Op::Grayscale, nearest),
        ("VerticalFlip", 0.0, Op::VerticalFlip, nearest),
    ]
}

/// An op's row label: the filter named for the geometric ops.
fn label(name: &str, m: f64, filter: AffineFilter) -> String {
    match (name, filter) {
        ("ShearX" | "TranslateX" | "Rotate", f) => format!("{name}({m}, {})", filter_name(f)),
        _ => format!("{name}({m})"),
    }
}

fn filter_name(f: AffineFilter) -> &'static str {
    match f {
        AffineFilter::Nearest => "nearest",
        AffineFilter::Bilinear => "bilinear",
        AffineFilter::Bicubic => "bicubic",
    }
}

/// Microseconds per 224×224 image of each op: ours, in this process,
/// and Pillow's (torchvision's PIL path) on the same crops.
fn ops_table(a: &Args) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let spec: Vec<serde_json::Value> = ops()
        .iter()
        .map(|&(n, m, _, f)| {
            serde_json::json!([label(n, m, f), n, m, {"interpolation": filter_name(f)}])
        })
        .collect();
    let out = std::process::Command::new(&a.python)
        .arg("bench/augment_ops.py")
        .arg(&a.dataset)
        .arg(dir.path())
        .arg(a.crops.to_string())
        .arg(serde_json::to_string(&spec)?)
        .output()
        .with_context(|| format!("running {} bench/augment_ops.py", a.python.display()))?;
    if !out.status.success() {
        bail!("augment_ops.py: {}", String::from_utf8_lossy(&out.stderr));
    }
    let pillow: BTreeMap<String, f64> = serde_json::from_slice(&out.stdout)?;
    let crops: Vec<Vec<u8>> = (0..a.crops)
        .map(|i| std::fs::read(dir.path().join(format!("{i}.rgb"))))
        .collect::<Result<_, _>>()?;
    println!();
    println!(
        "| op on a 224×224 image | native µs | Pillow (torchvision's op) µs | native speed-up |"
    );
    println!("|---|---:|---:|---:|");
    for (name, m, op, filter) in ops() {
        let label = label(name, m, filter);
        // The median of five passes over all crops, each on fresh pixels
        // in canvases used before (as a pipeline thread's canvas is).
        let mut canvases: Vec<Canvas> = crops
            .iter()
            .map(|c| {
                let mut c = Canvas::new(224, 224, c.clone());
                c.resample.filter = filter;
                c
            })
            .collect();
        for c in &mut canvases {
            c.apply(op);
        }
        let mut passes = Vec::new();
        for _ in 0..5 {
            for (c, px) in canvases.iter_mut().zip(&crops) {
                c.data.copy_from_slice(px);
            }
            let t0 = Instant::now();
            for c in &mut canvases {
                c.apply(op);
            }
            passes.push(t0.elapsed().as_secs_f64() / crops.len() as f64);
        }
        passes.sort_by(f64::total_cmp);
        let median = passes[passes.len() / 2];
        let p = pillow.get(&label).copied().unwrap_or(f64::NAN);
        println!(
            "| {label} | {:.1} | {:.1} | {:.1}× |",
            median * 1e6,
            p * 1e6,
            p / median
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let exe = harness::batchcast_exe(a.exe.as_deref())?;
    if !a.only_ops {
        shared_table(&a, &exe)?;
    }
    if a.no_ops {
        return Ok(());
    }
    ops_table(&a)
}
