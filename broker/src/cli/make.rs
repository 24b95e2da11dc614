//! `batchcast make`: a configured stream's batches, made here for a broker
//! elsewhere (`batchcast.ray.feed_stream` runs it on a cluster's CPU
//! nodes and publishes what it writes into the GPU host's broker).
//!
//! It reads requests from stdin, one a line: `EPOCH INDEX COUNT`, the
//! batches `INDEX .. INDEX + COUNT` of epoch `EPOCH`; and writes each
//! batch to stdout in order: a header of two little-endian `u64`s (its
//! samples, its bytes), then its bytes, every field's cells in schema
//! order. Its pipeline threads make a request's batches side by side.
//! `--schema` prints the stream's schema as JSON instead. A batch that
//! cannot be made ends it with the reason on stderr and exit code 1.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

use anyhow::{Context, bail};
use batchcast_broker::config::Config;
use batchcast_broker::make::{MakeError, Maker, MakerThread};

#[derive(Debug, Clone, clap::Args)]
pub struct MakeArgs {
    /// The config that describes the stream (as its broker has it)
    #[arg(long)]
    pub config: PathBuf,
    /// The stream to make
    #[arg(long)]
    pub stream: String,
    /// Pipeline threads [default: the stream's `workers`]
    #[arg(long)]
    pub workers: Option<usize>,
    /// Print the stream's schema (JSON) and exit
    #[arg(long)]
    pub schema: bool,
}

pub fn run(args: &MakeArgs) -> anyhow::Result<()> {
    let cfg = Config::load(&args.config)?;
    let uid = nix::unistd::getuid().as_raw();
    let maker = Maker::new(&cfg, &args.stream, uid).with_context(|| {
        format!(
            "making stream `{}` of {}",
            args.stream,
            args.config.display()
        )
    })?;
    let workers = args.workers.unwrap_or(maker.plan().workers).max(1);
    if args.schema {
        let out = serde_json::json!({
            "stream": maker.plan().name,
            "schema": maker.schema(),
            "workers": workers,
        });
        writeln!(std::io::stdout().lock(), "{out}")?;
        return Ok(());
    }
    let mut threads = (0..workers)
        .map(|_| maker.thread())
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, std::io::stdout().lock());
    for (n, line) in std::io::stdin().lock().lines().enumerate() {
        let line = line.context("reading requests from stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        let (epoch, index, count) =
            request(&line).with_context(|| format!("request {} on stdin: {line:?}", n + 1))?;
        maker.want(epoch, index, index + count);
        let written = make_in_order(&maker, &mut threads, (epoch, index, count), &mut out);
        // A reader that went away (its feed ended) is not an error here.
        match written {
            Err(e) if is_closed(&e) => return Ok(()),
            other => other?,
        }
        match out.flush() {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            other => other?,
        }
    }
    Ok(())
}

fn is_closed(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>()
        .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
}

/// `EPOCH INDEX COUNT`.
fn request(line: &str) -> anyhow::Result<(u64, u64, u64)> {
    let nums = line
        .split_whitespace()
        .map(|w| {
            w.parse::<u64>()
                .with_context(|| format!("{w:?} is not a count"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let [epoch, index, count] = nums[..] else {
        bail!("a request is three numbers: EPOCH INDEX COUNT");
    };
    Ok((epoch, index, count))
}

/// Makes the batches `index .. index + count` of `epoch` with `threads`,
/// writing each to `out` as soon as those before it are written.
fn make_in_order(
    maker: &Maker,
    threads: &mut [MakerThread],
    (epoch, index, count): (u64, u64, u64),
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let next = AtomicU64::new(0);
    let (tx, rx) = mpsc::channel::<(u64, Result<(u64, Vec<u8>), MakeError>)>();
    std::thread::scope(|scope| -> anyhow::Result<()> {
        for thread in threads.iter_mut().take(count as usize) {
            let (tx, next) = (tx.clone(), &next);
            scope.spawn(move || {
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= count {
                        return;
                    }
                    let mut buf = Vec::new();
                    let made = maker
                        .make(thread, epoch, index + k, &mut buf)
                        .map(|samples| (samples, buf));
                    let failed = made.is_err();
                    if tx.send((k, made)).is_err() || failed {
                        // The rest is not wanted: let the others stop too.
                        next.store(count, Ordering::Relaxed);
                        return;
                    }
                }
            });
        }
        drop(tx);
        let mut waiting = std::collections::BTreeMap::new();
        let mut due = 0u64;
        for (k, made) in rx {
            waiting.insert(k, made?);
            while let Some((samples, bytes)) = waiting.remove(&due) {
                out.write_all(&samples.to_le_bytes())?;
                out.write_all(&(bytes.len() as u64).to_le_bytes())?;
                out.write_all(&bytes)?;
                due += 1;
            }
        }
        if due < count {
            bail!("made {due} of {count} batches");
        }
        Ok(())
    })
}
