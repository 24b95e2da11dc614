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
//!
//! Whoever runs it may read more than the dataset's owner (root preparing
//! a shared folder): a link is followed only to a file inside the source
//! (canonical paths) or to a file of the link's own owner (a subset made
//! of links into the owner's full dataset), every copy gets at most its
//! source's mode bits, and a destination that resolves inside the source
//! is refused.

use std::io::{IsTerminal, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
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
    /// Links not followed: they lead out of the source (or nowhere).
    skipped: Vec<(PathBuf, String)>,
}

impl Tally {
    fn keep(&self, name: PathBuf, why: String) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.push((name, why));
    }
}

pub fn run(args: &PrepareArgs) -> anyhow::Result<()> {
    if !args.src.is_dir() {
        bail!(
            "{} is not a folder: give the dataset's root folder",
            args.src.display()
        );
    }
    let src = &std::fs::canonicalize(&args.src)
        .with_context(|| format!("resolving {}", args.src.display()))?;
    if args.dst.exists() && std::fs::read_dir(&args.dst)?.next().is_some() {
        bail!(
            "{} is not empty: give a new folder for the prepared copy",
            args.dst.display()
        );
    }
    let dst = &resolved(&args.dst)?;
    if dst.starts_with(src) {
        bail!(
            "{} lies inside {} (as {}): put the copy elsewhere",
            args.dst.display(),
            args.src.display(),
            dst.display()
        );
    }
    let mut tree = Tree::default();
    tree.walk(src, src)?;
    tree.files.sort();
    let files = tree.files;
    // The folders first, each with at most its source's mode bits.
    make_dir(dst, &std::fs::metadata(src)?)?;
    for dir in &tree.dirs {
        make_dir(&dst.join(dir.strip_prefix(src)?), &std::fs::metadata(dir)?)?;
    }
    let jobs = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let tally = Tally {
        skipped: tree.skipped,
        ..Tally::default()
    };
    let (next, done, t0) = (AtomicUsize::new(0), AtomicUsize::new(0), Instant::now());
    let progress = Progress::new(files.len());
    std::thread::scope(|s| -> anyhow::Result<()> {
        let workers: Vec<_> = (0..jobs)
            .map(|_| {
                s.spawn(|| -> anyhow::Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some((name, file)) = files.get(i) else {
                            return Ok(());
                        };
                        let to = dst.join(name.strip_prefix(src)?);
                        prepare_one(file, &to, &tally)?;
                        progress.tick(done.fetch_add(1, Ordering::Relaxed) + 1, &tally);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("a prepare thread panicked")?;
        }
        Ok(())
    })?;
    progress.finish();
    println!("{}", summary(&tally, t0.elapsed().as_secs_f64()));
    Ok(())
}

/// `path` with its links resolved, whether or not it exists yet: its
/// nearest existing ancestor made canonical, the rest appended.
fn resolved(path: &Path) -> anyhow::Result<PathBuf> {
    let abs = std::path::absolute(path)?;
    let mut base = abs.as_path();
    let mut rest = Vec::new();
    loop {
        match std::fs::canonicalize(base) {
            Ok(real) => return Ok(rest.iter().rev().fold(real, |p, c| p.join(c))),
            Err(_) => {
                rest.push(base.file_name().context("a path with no folder")?);
                base = base.parent().context("a path with no folder")?;
            }
        }
    }
}

/// Creates `dir` (if it is not there) with at most the mode bits of the
/// folder it copies.
fn make_dir(dir: &Path, like: &std::fs::Metadata) -> anyhow::Result<()> {
    match std::fs::DirBuilder::new()
        .mode(like.mode() & 0o7777)
        .create(dir)
    {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        other => other.with_context(|| format!("creating {}", dir.display())),
    }
}

/// The source's files and folders, by walking it.
#[derive(Default)]
struct Tree {
    /// Each file: its name in the source, and the file it reads (a
    /// link's canonical target, inside the source).
    files: Vec<(PathBuf, PathBuf)>,
    dirs: Vec<PathBuf>,
    skipped: Vec<(PathBuf, String)>,
}

impl Tree {
    /// Every file under `dir`, depth first: a link to a file inside
    /// `root`, or to a file its own owner owns, is read as the file
    /// (ImageFolders of links are common); a link out of `root` to
    /// someone else's file is not followed (it could reach another
    /// user's files or the system's, which whoever runs this may read:
    /// named in the summary), nor is a link to a folder (it could lead
    /// back up).
    fn walk(&mut self, root: &Path, dir: &Path) -> anyhow::Result<()> {
        let entries =
            std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
        for entry in entries {
            let entry = entry?;
            let (kind, path) = (entry.file_type()?, entry.path());
            if kind.is_dir() {
                self.dirs.push(path.clone());
                self.walk(root, &path)?;
            } else if kind.is_file() {
                self.files.push((path.clone(), path));
            } else if kind.is_symlink() {
                let owner = entry.metadata()?.uid();
                let theirs = |real: &Path| std::fs::metadata(real).is_ok_and(|m| m.uid() == owner);
                match std::fs::canonicalize(&path) {
                    Ok(real) if !real.starts_with(root) && !theirs(&real) => self.skipped.push((
                        path,
                        format!(
                            "a link to {}, outside the dataset and not its owner's",
                            real.display()
                        ),
                    )),
                    Ok(real) if real.is_file() => self.files.push((path, real)),
                    Ok(_) => {}
                    Err(e) => self.skipped.push((path, format!("a link to nowhere: {e}"))),
                }
            }
        }
        Ok(())
    }
}

/// Progress on a terminal: files done of all, and the JPEGs re-encoded;
/// nothing in a pipe.
struct Progress {
    tty: bool,
    total: usize,
    shown: Mutex<Instant>,
}

impl Progress {
    fn new(total: usize) -> Progress {
        Progress {
            tty: std::io::stderr().is_terminal(),
            total,
            shown: Mutex::new(Instant::now()),
        }
    }

    fn tick(&self, done: usize, tally: &Tally) {
        if !self.tty {
            return;
        }
        let mut shown = self.shown.lock().unwrap_or_else(|p| p.into_inner());
        if shown.elapsed().as_millis() < 200 && done < self.total {
            return;
        }
        *shown = Instant::now();
        eprint!(
            "\rprepared {done} of {} files ({} JPEGs re-encoded)",
            self.total,
            tally.marked.load(Ordering::Relaxed)
        );
    }

    fn finish(&self) {
        if self.tty {
            eprintln!();
        }
    }
}

/// Writes `file`'s prepared copy at `to`, with at most `file`'s mode
/// bits. `file` is opened without following a link (the walk resolved
/// it) and must be a regular file.
fn prepare_one(file: &Path, to: &Path, tally: &Tally) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(file)
        .with_context(|| format!("reading {}", file.display()))?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        bail!("{} is no longer a regular file", file.display());
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.read_to_end(&mut bytes)
        .with_context(|| format!("reading {}", file.display()))?;
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
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(meta.mode() & 0o777)
        .open(to)
        .and_then(|mut w| w.write_all(&out))
        .with_context(|| format!("writing {}", to.display()))
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
    if !t.skipped.is_empty() {
        s.push_str(&format!(
            "\n{} links not followed (not copied):",
            t.skipped.len()
        ));
        for (file, why) in t.skipped.iter().take(10) {
            s.push_str(&format!("\n  {}: {why}", file.display()));
        }
        if t.skipped.len() > 10 {
            s.push_str(&format!("\n  ... and {} more", t.skipped.len() - 10));
        }
    }
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
