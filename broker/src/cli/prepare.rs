//! `batchcast prepare SRC DST`: a copy of a dataset folder whose JPEGs
//! carry a restart marker after every MCU.
//!
//! Re-encoded losslessly (TurboJPEG's transform: the same DCT
//! coefficients, so the same pixels decoded, pinned by
//! `pixels/tests/crop_decode.rs`), a JPEG lets RandomResizedCrop's decode
//! in part entropy-decode only the MCUs around its crop instead of every
//! MCU above the crop's bottom (ARCHITECTURE.md, "Cutting the crop out
//! of the file"). Other files are copied as they are, and so is a JPEG that
//! cannot be re-encoded (a lossless or corrupt one: the pipeline decodes
//! it as before), counted and named in the summary. A `.tar` (a
//! WebDataset shard) is written again with its JPEG members prepared,
//! every member in its place under its name.

use std::io::{IsTerminal, Read};
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
    /// JPEGs (and shards) copied as they were, with the reason.
    kept: Mutex<Vec<(PathBuf, String)>>,
}

impl Tally {
    fn keep(&self, name: PathBuf, why: String) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.push((name, why));
    }
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
    let out = if file
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("tar"))
    {
        match prepare_tar(&bytes, file, tally) {
            Ok(shard) => shard,
            Err(e) => {
                tally.keep(
                    file.to_path_buf(),
                    format!("not a tar shard it can read: {e}"),
                );
                bytes
            }
        }
    } else {
        match sniff(&bytes) {
            Ok(Format::Jpeg) => prepare_jpeg(bytes, file.to_path_buf(), tally),
            _ => {
                tally.copied.fetch_add(1, Ordering::Relaxed);
                bytes
            }
        }
    };
    std::fs::write(to, out).with_context(|| format!("writing {}", to.display()))
}

/// A JPEG's prepared bytes: re-encoded with a marker after every MCU (a
/// crop is then cut at any MCU column; an interval that does not divide
/// every image's MCU row would leave those images decoded as before), or
/// the bytes as they are where TurboJPEG cannot re-encode them.
fn prepare_jpeg(bytes: Vec<u8>, name: PathBuf, tally: &Tally) -> Vec<u8> {
    match restart_marked(&bytes, 1) {
        Ok(marked) => {
            tally.marked.fetch_add(1, Ordering::Relaxed);
            let n = bytes.len() as u64;
            tally.bytes_in.fetch_add(n, Ordering::Relaxed);
            let n = marked.len() as u64;
            tally.bytes_out.fetch_add(n, Ordering::Relaxed);
            marked
        }
        Err(e) => {
            tally.keep(name, e.to_string());
            bytes
        }
    }
}

/// A WebDataset shard with its JPEG members prepared, every other member
/// (labels, other images) as it is, in the same order under the same
/// names. An error (a tar it cannot read) leaves the shard to be copied
/// as it is.
fn prepare_tar(bytes: &[u8], file: &Path, tally: &Tally) -> anyhow::Result<Vec<u8>> {
    let mut archive = tar::Archive::new(bytes);
    let mut out = tar::Builder::new(Vec::with_capacity(bytes.len() + bytes.len() / 8));
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        let mut header = entry.header().clone();
        // A member holds at most the shard's bytes, whatever its header says.
        let mut data = Vec::with_capacity(entry.size().min(bytes.len() as u64) as usize);
        entry.read_to_end(&mut data)?;
        if header.entry_type().is_file() && sniff(&data).is_ok_and(|f| f == Format::Jpeg) {
            let name = file.join(&path);
            data = prepare_jpeg(data, name, tally);
        } else if header.entry_type().is_file() {
            tally.copied.fetch_add(1, Ordering::Relaxed);
        }
        header.set_size(data.len() as u64);
        out.append_data(&mut header, &path, &data[..])?;
    }
    Ok(out.into_inner()?)
}

fn summary(t: &Tally, seconds: f64) -> String {
    let marked = t.marked.load(Ordering::Relaxed);
    let (bytes_in, bytes_out) = (
        t.bytes_in.load(Ordering::Relaxed),
        t.bytes_out.load(Ordering::Relaxed),
    );
    let growth = 100.0 * (bytes_out as f64 / bytes_in.max(1) as f64 - 1.0);
    let mut s = format!(
        "{marked} JPEGs re-encoded with restart markers ({:.1} MB -> {:.1} MB, {growth:+.1} %), {} other files or shard members copied, in {seconds:.1} s",
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
