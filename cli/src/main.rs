//! The `batchcast` command line. Errors are reported here with their whole
//! chain; everything below returns typed errors. Its tools are this
//! binary's modules, apart from the broker's library: the test consumer
//! (`consume`), the demo, the stats table, the launcher, and `make` and `feed`
//! (a stream made on other machines).

use std::io::{IsTerminal, Write};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use batchcast_broker::{config, listen, plan, server, stream};
use clap::{Parser, Subcommand};

mod consume;
mod demo;
mod doctor;
mod feed;
mod finding;
mod launch;
mod make;
mod predict;
mod prepare;
mod report_html;
mod stats_view;

/// batchcast: run the input pipeline once per host, share every batch with
/// every trainer, zero-copy.
#[derive(Debug, Parser)]
#[command(name = "batchcast", version = version(), about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// `--version`: the release and the protocol it speaks (a client must
/// speak the same one; the Python package's `__version__` is the release).
fn version() -> &'static str {
    static V: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "{} (protocol {})",
            env!("CARGO_PKG_VERSION"),
            batchcast::proto::PROTOCOL_VERSION
        )
    });
    &V
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run a broker serving the streams of a config file, and any stream an
    /// external producer (e.g. `batchcast.Producer` in Python) registers
    Serve {
        /// Streams to run [default: none; only external producers' streams]
        #[arg(long)]
        config: Option<PathBuf>,
        /// Socket path [default: config's broker.socket, else $BATCHCAST_SOCKET, else $XDG_RUNTIME_DIR/batchcast.sock, else /tmp/batchcast-$UID/batchcast.sock]
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Also serve Prometheus metrics at http://ADDR/metrics, and the
        /// probes /healthz and /readyz (e.g. 127.0.0.1:9464; port 0 picks
        /// a free one, logged at start)
        #[arg(long, value_name = "ADDR")]
        metrics: Option<std::net::SocketAddr>,
    },
    /// Show what a running broker is doing
    Stats {
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
        /// Refresh every second until interrupted
        #[arg(long)]
        watch: bool,
    },
    /// Subscribe to a stream and report what arrives (a test and benchmark consumer)
    Consume(Box<consume::ConsumeArgs>),
    /// Start a broker and a sweep of trainers from a sweep file, show them
    /// live, and summarise (exit code 0: all done; 2: some failed; 3:
    /// stopped after a failure; 130: interrupted)
    Launch(launch::LaunchArgs),
    /// Make a configured stream's batches here, for a broker elsewhere:
    /// requests `EPOCH INDEX COUNT` on stdin, each batch on stdout (a
    /// cluster's CPU nodes run it for `batchcast.ray.feed_stream`)
    Make(make::MakeArgs),
    /// Feed a stream that `batchcast make --connect` makes on other
    /// machines into this host's broker, each batch read straight into its
    /// slot (what `batchcast.ray.feed_stream` runs on the GPU host)
    Feed(feed::FeedArgs),
    /// Say what limits the trainers (the data, or not; which stage), with
    /// the evidence: watching a running broker, or a finished run folder
    Doctor(doctor::DoctorArgs),
    /// Show the whole idea on built-in data: a sweep of trainers sharing one
    /// broker, then with a pipeline each, side by side
    Demo(demo::DemoArgs),
    /// Copy a dataset folder with its JPEGs re-encoded losslessly with
    /// restart markers (the same pixels), so that decoding only a crop
    /// reads only the crop's part of each file
    Prepare(prepare::PrepareArgs),
}

fn main() {
    let cli = Cli::parse();
    let default_level = if matches!(cli.cmd, Cmd::Serve { .. }) {
        "info"
    } else {
        "warn"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a log file or a pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.cmd {
        Cmd::Serve {
            config,
            socket,
            metrics,
        } => serve(config, socket, metrics),
        Cmd::Stats {
            socket,
            json,
            watch,
        } => stats(socket, json, watch),
        Cmd::Consume(args) => {
            let report = consume::run(&args);
            let summary = if args.json {
                serde_json::to_string(&report).expect("report serialises")
            } else {
                format!(
                    "{}: {} batches ({} samples) in {:.2} s, {:.0} batches/s, hand-off p50 {:.0} µs p99 {:.0} µs, {} samples verified",
                    report.name,
                    report.batches,
                    report.samples,
                    report.seconds,
                    report.batches_per_s,
                    report.handoff_us_p50,
                    report.handoff_us_p99,
                    report.verified_samples,
                )
            };
            // A closed stdout (the reader went away) is not worth a panic.
            // A consumer that read nothing and failed prints only its
            // error (the JSON report always: a program reads it).
            if args.json || report.batches > 0 || report.error.is_none() {
                let _ = writeln!(std::io::stdout().lock(), "{summary}");
            }
            match (&report.error, report.ok) {
                (Some(e), _) => Err(anyhow::anyhow!("{e}")),
                (None, false) => Err(anyhow::anyhow!(
                    "{} wrong samples, order errors: {:?}",
                    report.verify_failures,
                    report.order_errors
                )),
                _ => Ok(()),
            }
        }
        Cmd::Launch(args) => match launch::run(&args) {
            Ok(code) => std::process::exit(code),
            Err(e) => Err(e),
        },
        Cmd::Demo(args) => demo::run(&args),
        Cmd::Make(args) => make::run(&args),
        Cmd::Doctor(args) => doctor::run(&args),
        Cmd::Feed(args) => feed::run(&args),
        Cmd::Prepare(args) => prepare::run(&args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn serve(
    config_path: Option<PathBuf>,
    socket: Option<PathBuf>,
    metrics: Option<std::net::SocketAddr>,
) -> anyhow::Result<()> {
    // First, before any thread starts: it takes the variables out of the
    // environment.
    let inherited = batchcast_broker::systemd::inherited_listener()?;
    let (cfg, plans, limits) = load_config(config_path.as_deref())?;
    let allow = listen::Allow {
        own_uid: nix::unistd::getuid().as_raw(),
        uids: cfg.broker.allow_uids.clone(),
        gids: limits.allow_gids.clone(),
    };
    let bound = listen_on(inherited, socket.or(cfg.broker.socket.clone()), &allow)?;
    let own_uid = allow.own_uid;
    let budget = batchcast_broker::budget::Budget::new(limits.memory_bytes, own_uid);
    budget.set_thread_pool(u32::try_from(limits.threads).unwrap_or(u32::MAX));
    let buffers = budget
        .take(
            own_uid,
            batchcast_broker::budget::Use::FrameBuffers,
            limits.max_connections as u64 * server::FRAME_BUFFER_BYTES,
            &format!("{} connections", limits.max_connections),
        )
        .context("lower max_connections")?;
    let mut shares = batchcast_broker::pipeline::shared::Shares::default();
    let streams = plans
        .into_iter()
        .map(|plan| {
            let name = plan.name.clone();
            stream::Stream::start(plan, &budget, own_uid, &mut shares)
                .with_context(|| format!("starting stream `{name}`"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    batchcast_broker::gpu::announce()?;
    raise_fd_limit(limits.max_connections);
    let admission = server::Admission::new(allow, limits);
    let broker = Arc::new(server::Broker::new(streams, admission, budget, buffers));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("batchcast-io")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let std_listener = bound.listener.try_clone()?;
        std_listener.set_nonblocking(true)?;
        let listener = tokio::net::UnixListener::from_std(std_listener)?;
        if let Some(addr) = metrics {
            let tcp = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--metrics {addr}: cannot listen there"))?;
            tracing::info!("metrics on http://{}/metrics", tcp.local_addr()?);
            tokio::spawn(batchcast_broker::metrics::serve(tcp, broker.clone()));
        }
        let (streams, path) = (broker.streams().len(), bound.path.display());
        tracing::info!(
            "serving {streams} configured stream(s) on {path}; producers may register more"
        );
        batchcast_broker::systemd::notify(&format!(
            "READY=1\nSTATUS=serving {streams} stream(s) on {path}"
        ));
        server::run(listener, broker, shutdown_signal()).await;
        anyhow::Ok(())
    })?;
    // A pipeline thread stuck in I/O (see stream shutdown) or a blocking
    // task must not hold the exit: SIGINT/SIGTERM end the broker in < 2 s.
    rt.shutdown_timeout(Duration::from_millis(200));
    drop(bound);
    tracing::info!("broker stopped");
    Ok(())
}

/// SIGINT or SIGTERM, told to the service manager as it comes.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
        _ = term.recv() => tracing::info!("SIGTERM received"),
    }
    batchcast_broker::systemd::notify("STOPPING=1\nSTATUS=stopping");
}

/// The socket to serve: the one a service manager passed (socket
/// activation), which must be `asked` if that is given, else `asked` (or
/// the default path) bound here.
fn listen_on(
    inherited: Option<(std::os::unix::net::UnixListener, PathBuf)>,
    asked: Option<PathBuf>,
    allow: &listen::Allow,
) -> anyhow::Result<listen::Bound> {
    let Some((listener, path)) = inherited else {
        let path = asked.unwrap_or_else(batchcast::default_socket_path);
        return Ok(listen::bind(&path, allow.is_shared())?);
    };
    if let Some(asked) = asked.filter(|a| *a != path) {
        anyhow::bail!(
            "the service manager passed the socket {} but --socket or the config's broker.socket says {}: make them the same, or drop the one here",
            path.display(),
            asked.display()
        );
    }
    tracing::info!(
        "socket activation: serving {}, which the service manager owns",
        path.display()
    );
    if let Ok(meta) = std::fs::metadata(&path)
        && let Some(why) = allow.unreachable(meta.mode(), meta.gid())
    {
        tracing::warn!(
            "the config allows other users, but {} {why}",
            path.display()
        );
    }
    Ok(listen::Bound::inherited(listener, path))
}

/// The config at `path` (or the built-in defaults), its streams' plans and
/// the broker's limits; errors name the file.
fn load_config(
    path: Option<&std::path::Path>,
) -> anyhow::Result<(config::Config, Vec<plan::StreamPlan>, plan::BrokerPlan)> {
    let (cfg, plans) = match path {
        Some(path) => {
            let cfg = config::Config::load(path)?;
            let plans =
                plan::plan_config(&cfg).with_context(|| format!("config {}", path.display()))?;
            (cfg, plans)
        }
        None => (config::Config::default(), Vec::new()),
    };
    let limits = plan::plan_broker(&cfg.broker).with_context(|| match path {
        Some(path) => format!("config {}", path.display()),
        None => "the built-in defaults".into(),
    })?;
    Ok((cfg, plans, limits))
}

/// Raises the soft limit on open files to the hard one: each connection is
/// a descriptor (a consumer's arena and mailbox are sent, not kept). Says
/// so once if `max_connections` cannot fit.
fn raise_fd_limit(max_connections: usize) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_err() {
        tracing::debug!("could not raise the open-file limit from {soft} to {hard}");
    }
    // Streams, pipeline files and the runtime take some beyond connections.
    let need = max_connections as u64 + 256;
    if hard < need {
        tracing::warn!(
            "the open-file limit is {hard}, below the {need} that max_connections = {max_connections} needs; connections past it fail to be accepted (raise `ulimit -n` or lower max_connections)"
        );
    }
}

fn stats(socket: Option<PathBuf>, json: bool, watch: bool) -> anyhow::Result<()> {
    let mut client = batchcast::StatsClient::connect(socket)?;
    let tty = std::io::stdout().is_terminal();
    loop {
        let s = client.fetch()?;
        if json {
            println!("{}", serde_json::to_string(&s)?);
        } else {
            if watch && tty {
                print!("\x1b[2J\x1b[H");
            }
            print!("{}", stats_view::render(&s));
        }
        if !watch {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs(1));
        if !tty && !json {
            println!("---");
        }
    }
}
