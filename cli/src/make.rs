//! `batchcast make`: a configured stream's batches, made here for a broker
//! elsewhere (`batchcast.ray.feed_stream` runs it on a cluster's CPU
//! nodes and publishes what it writes into the GPU host's broker).
//!
//! It reads requests from stdin, one a line: `EPOCH INDEX COUNT`, the
//! batches `INDEX .. INDEX + COUNT` of epoch `EPOCH`; and writes each
//! batch to stdout in order: a header of two little-endian `u64`s (its
//! samples, its bytes), then its bytes, every field's cells in schema
//! order. Its pipeline threads make a request's batches side by side.
//! `--schema` prints the stream's schema as JSON instead (with the
//! `slots`, `min_consumers`, `lag_limit` and `hold_limit_s` a producer of
//! it elsewhere registers it with). A batch that
//! cannot be made ends it with the reason on stderr and exit code 1.
//!
//! `--wire u8` (or `auto`: where the stream allows it) sends an image
//! stream's float tensor as the `u8` pixels it is made from, for the feed
//! to widen through the stream's own table (`--schema` says how, under
//! `wire`): the same bytes in the slot, a quarter of them on the wire.
//!
//! `--connect ADDR` serves a `batchcast feed` over TCP instead: it says
//! `batchcast-make 1 TOKEN` first (the feed's token, from
//! `$BATCHCAST_FEED_TOKEN`), then reads requests and writes batches on
//! that connection, and prints what it made (JSON) when the feed closes it.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

use anyhow::{Context, bail};
use batchcast_broker::config::Config;
use batchcast_broker::make::{MakeError, Maker, MakerThread, Wire};

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
    /// Serve a feed (`batchcast feed`) at this address instead of stdin
    /// and stdout, its token in $BATCHCAST_FEED_TOKEN; print what was
    /// made (JSON) at the end
    #[arg(long, value_name = "ADDR")]
    pub connect: Option<std::net::SocketAddr>,
    /// How to send an image stream's image field: as the stream has it,
    /// as u8 pixels its feed widens (refused where the stream's tensor is
    /// not a table of its pixels), or u8 where the stream allows it
    #[arg(long, default_value = "as-is", value_parser = ["as-is", "u8", "auto"])]
    pub wire: String,
}

pub fn run(args: &MakeArgs) -> anyhow::Result<()> {
    let cfg = Config::load(&args.config)?;
    let uid = nix::unistd::getuid().as_raw();
    let wire = match args.wire.as_str() {
        "u8" => Wire::U8,
        "auto" => Wire::Auto,
        _ => Wire::AsIs,
    };
    let maker = Maker::new(&cfg, &args.stream, uid, wire).with_context(|| {
        format!(
            "making stream `{}` of {}",
            args.stream,
            args.config.display()
        )
    })?;
    let workers = args.workers.unwrap_or(maker.plan().workers).max(1);
    if args.schema {
        // What a producer of the stream elsewhere registers it with.
        let plan = maker.plan();
        let out = serde_json::json!({
            "stream": plan.name,
            "schema": maker.schema(),
            "workers": workers,
            "slots": plan.slots,
            "min_consumers": plan.min_consumers,
            "lag_limit": plan.lag_limit,
            "hold_limit_s": plan.hold_limit.map(|d| d.as_secs_f64()),
            "wire": maker.expand(),
        });
        writeln!(std::io::stdout().lock(), "{out}")?;
        return Ok(());
    }
    let mut threads = (0..workers)
        .map(|_| maker.thread())
        .collect::<Result<Vec<_>, _>>()?;
    match args.connect {
        None => {
            let out = std::io::stdout().lock();
            serve(&maker, &mut threads, std::io::stdin().lock(), out)?;
        }
        Some(addr) => {
            let conn = connect(addr)?;
            let reader = std::io::BufReader::new(conn.try_clone()?);
            let made = serve(&maker, &mut threads, reader, conn)?;
            let out = serde_json::json!({"batches": made.0, "samples": made.1});
            writeln!(std::io::stdout().lock(), "{out}")?;
        }
    }
    Ok(())
}

/// Connects to the feed at `addr` and says who it is: the feed's token
/// (`$BATCHCAST_FEED_TOKEN`), which only the feed's owner handed out.
fn connect(addr: std::net::SocketAddr) -> anyhow::Result<std::net::TcpStream> {
    let token = std::env::var(TOKEN_ENV)
        .with_context(|| format!("--connect needs the feed's token in ${TOKEN_ENV}"))?;
    let mut conn = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(30))
        .with_context(|| format!("connecting to the feed at {addr}"))?;
    conn.set_nodelay(true)?;
    writeln!(conn, "{HELLO} {token}")?;
    Ok(conn)
}

/// The variable a maker finds its feed's token in.
pub const TOKEN_ENV: &str = "BATCHCAST_FEED_TOKEN";
/// What a maker says first, before its token.
pub const HELLO: &str = "batchcast-make 1";

/// Serves the requests of `input` into `out` until `input` ends (or its
/// reader goes away): the batches and samples it made.
fn serve(
    maker: &Maker,
    threads: &mut [MakerThread],
    input: impl BufRead,
    out: impl Write,
) -> anyhow::Result<(u64, u64)> {
    let mut out = std::io::BufWriter::with_capacity(1 << 20, out);
    let mut made = (0u64, 0u64);
    for (n, line) in input.lines().enumerate() {
        let line = line.context("reading requests")?;
        if line.trim().is_empty() {
            continue;
        }
        let (epoch, index, count) =
            request(&line).with_context(|| format!("request {}: {line:?}", n + 1))?;
        maker.want(epoch, index, index + count);
        let written = make_in_order(maker, threads, (epoch, index, count), &mut out);
        // A reader that went away (its feed ended) is not an error here.
        let samples = match written {
            Err(e) if is_closed(&e) => return Ok(made),
            other => other?,
        };
        match out.flush() {
            Err(e) if closed_io(&e) => return Ok(made),
            other => other?,
        }
        made = (made.0 + count, made.1 + samples);
    }
    Ok(made)
}

fn is_closed(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>().is_some_and(closed_io)
}

fn closed_io(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
    )
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
    if index.checked_add(count).is_none() {
        bail!("batches {index} + {count} lie past any epoch: INDEX + COUNT must be a batch count");
    }
    Ok((epoch, index, count))
}

/// Makes the batches `index .. index + count` of `epoch` with `threads`,
/// writing each to `out` as soon as those before it are written.
fn make_in_order(
    maker: &Maker,
    threads: &mut [MakerThread],
    (epoch, index, count): (u64, u64, u64),
    out: &mut impl Write,
) -> anyhow::Result<u64> {
    let next = AtomicU64::new(0);
    let (tx, rx) = mpsc::channel::<(u64, Result<(u64, Vec<u8>), MakeError>)>();
    std::thread::scope(|scope| -> anyhow::Result<u64> {
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
        let (mut due, mut samples_out) = (0u64, 0u64);
        for (k, made) in rx {
            waiting.insert(k, made?);
            while let Some((samples, bytes)) = waiting.remove(&due) {
                out.write_all(&samples.to_le_bytes())?;
                out.write_all(&(bytes.len() as u64).to_le_bytes())?;
                out.write_all(&bytes)?;
                due += 1;
                samples_out += samples;
            }
        }
        if due < count {
            bail!("made {due} of {count} batches");
        }
        Ok(samples_out)
    })
}
