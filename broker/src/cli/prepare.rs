//! `batchcast prepare SRC DST`: a copy of a dataset folder whose JPEGs
//! carry a restart marker after every MCU.
//!
//! Re-encoded losslessly (TurboJPEG's transform: the same DCT
//! coefficients, so the same pixels decoded, pinned by
//! `pixels/tests/crop_decode.rs`), a JPEG lets RandomResizedCrop's decode
//! in part entropy-decode only the MCUs around its crop instead of every
//! MCU above the crop's bottom (docs/pipeline.md, "Decoding only the
//! crop"). Other files are copied as they are, and so is a JPEG that
//! cannot be re-encoded (a lossless or corrupt one: the pipeline decodes
//! it as before), counted and named in the summary.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, bail};
use batchcast_pixels::decode::{Format, restart_marked, sniff};

#[derive(Debug, Clone, clap::Args)]
pub struct PrepareArgs {
    /// The dataset folder (an ImageFolder or any tree of files)
    pub src: PathBuf,
    /// Where the copy goes: a folder that does not exist yet, or an empty one
    pub dst: PathBuf,
    /// Files re-encoded side by side [default: the host's cores]
    #[arg(long)]
    pub jobs: Option<usize>,
}

/// What a run did, for its summary.
#[derive(Debug, Default)]
struct Tally {
    marked: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    copied: AtomicU64,
    /// JPEGs copied as they were, with TurboJPEG's reason.
    kept: Mutex<Vec<(PathBuf, String)>>,
}

pub fn run(args: &PrepareArgs) -> anyhow::Result<()> {
    let src = &args.src;
    if !src.is_dir() {
        bail!(
            "{} is not a folder: give the dataset's root folder",
            src.display()
        );
    }
    if args.dst.exists() && std::fs::read_dir(&args.dst)?.next().is_some() {
        bail!(
            "{} is not empty: give a new folder for the prepared copy",
            args.dst.display()
        );
    }
    if args.dst.starts_with(src) {
        bail!(
            "{} lies inside {}: put the copy elsewhere",
            args.dst.display(),
            src.display()
        );
    }
    let mut files = Vec::new();
    walk(src, &mut files)?;
    files.sort();
    let jobs = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let (tally, next, t0) = (Tally::default(), AtomicUsize::new(0), Instant::now());
    let tty = std::io::stderr().is_terminal();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let workers: Vec<_> = (0..jobs)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(file) = files.get(i) else {
                            return Ok(());
                        };
                        let to = args.dst.join(file.strip_prefix(src)?);
                        prepare_one(file, &to, &tally)?;
                        if tty && (i % 64 == 0 || i + 1 == files.len()) {
                            eprint!("\rprepared {} of {} files", i + 1, files.len());
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("a prepare thread panicked")?;
        }
        Ok(())
    })?;
    if tty {
        eprintln!();
    }
    println!("{}", summary(&tally, t0.elapsed().as_secs_f64()));
    Ok(())
}

/// Every file under `dir`, depth first: a link to a file is read as the
/// file (ImageFolders of links are common); a link to a folder is not
/// followed (it could lead back up).
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            walk(&entry.path(), out)?;
        } else if kind.is_file() || (kind.is_symlink() && entry.path().is_file()) {
            out.push(entry.path());
        }
    }
    Ok(())
}

/// Writes `file`'s prepared copy at `to`.
fn prepare_one(file: &Path, to: &Path, tally: &Tally) -> anyhow::Result<()> {
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let out = match sniff(&bytes) {
        // One MCU a segment: a crop is cut at any MCU column (an interval
        // that does not divide every image's MCU row would leave those
        // images decoded as before).
        Ok(Format::Jpeg) => match restart_marked(&bytes, 1) {
            Ok(marked) => {
                tally.marked.fetch_add(1, Ordering::Relaxed);
                tally
                    .bytes_in
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                tally
                    .bytes_out
                    .fetch_add(marked.len() as u64, Ordering::Relaxed);
                marked
            }
            Err(e) => {
                let mut kept = tally.kept.lock().unwrap_or_else(|p| p.into_inner());
                kept.push((file.to_path_buf(), e.to_string()));
                bytes
            }
        },
        _ => {
            tally.copied.fetch_add(1, Ordering::Relaxed);
            bytes
        }
    };
    std::fs::write(to, out).with_context(|| format!("writing {}", to.display()))
}

fn summary(t: &Tally, seconds: f64) -> String {
    let marked = t.marked.load(Ordering::Relaxed);
    let (bytes_in, bytes_out) = (
        t.bytes_in.load(Ordering::Relaxed),
        t.bytes_out.load(Ordering::Relaxed),
    );
    let growth = 100.0 * (bytes_out as f64 / bytes_in.max(1) as f64 - 1.0);
    let mut s = format!(
        "{marked} JPEGs re-encoded with restart markers ({:.1} MB -> {:.1} MB, {growth:+.1} %), {} other files copied, in {seconds:.1} s",
        bytes_in as f64 / 1e6,
        bytes_out as f64 / 1e6,
        t.copied.load(Ordering::Relaxed),
    );
    let kept = t.kept.lock().unwrap_or_else(|p| p.into_inner());
    if !kept.is_empty() {
        s.push_str(&format!(
            "\n{} JPEGs copied as they were (decoded as before):",
            kept.len()
        ));
        for (file, why) in kept.iter().take(10) {
            s.push_str(&format!("\n  {}: {why}", file.display()));
        }
        if kept.len() > 10 {
            s.push_str(&format!("\n  ... and {} more", kept.len() - 10));
        }
    }
    s
}
