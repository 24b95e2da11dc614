//! `batchcast feed`: a GPU host's end of a stream made on other machines
//! (`batchcast make --connect` on a cluster's CPU nodes; what
//! `batchcast.ray.feed_stream` starts). It registers the stream with the
//! host's broker as its producer, takes its makers' TCP connections (each
//! must say the feed's token first), asks them for the batches the
//! broker's slots want, in turn, `in_flight` requests ahead, and reads
//! each batch straight into its slot: the host's only copy is the
//! kernel's, from the socket into the ring.
//!
//! Every epoch is the stream's own: batch `i` of epoch `e` is what the
//! stream's broker would make there, whichever maker made it (each makes
//! with the same config); a batch whose samples or bytes are not the
//! schema's for its place stops the stream, naming the maker.

use std::collections::VecDeque;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use batchcast::schema::{Schema, SourceInfo};
use batchcast::{Acquired, Producer, ProducerOptions};
use batchcast_broker::make::Expand;

use crate::make::TOKEN_ENV;

mod makers;

use makers::{Maker, accept};

#[derive(Debug, Clone, clap::Args)]
pub struct FeedArgs {
    /// The stream's description as `batchcast make --schema` prints it (a
    /// file)
    #[arg(long)]
    pub schema: PathBuf,
    /// Listen for makers here (IP:PORT; port 0 picks one); the address is
    /// printed on stdout's first line
    #[arg(long)]
    pub listen: SocketAddr,
    /// Makers to wait for (their token in $BATCHCAST_FEED_TOKEN)
    #[arg(long)]
    pub makers: usize,
    /// The host broker's socket [default: as for any client]
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Epochs to feed [default: the stream's]
    #[arg(long)]
    pub epochs: Option<u64>,
    /// Batches a maker makes per request [default: twice its threads]
    #[arg(long)]
    pub per_request: Option<u64>,
    /// Requests each maker has ahead of the batch being published
    #[arg(long, default_value_t = 2)]
    pub in_flight: usize,
    /// Consumers that must subscribe before the first batch [default: the
    /// stream's]
    #[arg(long)]
    pub min_consumers: Option<u32>,
    /// Seconds to wait for every maker to connect
    #[arg(long, default_value_t = 60.0)]
    pub accept_timeout: f64,
    /// Seconds a maker may take to send a batch once the feed reads it,
    /// plus one for each 50 MiB of the batch: past that the stream fails,
    /// naming the maker (a stopped or cut-off node)
    #[arg(long, default_value_t = 20.0)]
    pub batch_timeout: f64,
}

/// What a feed did, printed as JSON at its end.
#[derive(Debug, Default, serde::Serialize)]
struct Figures {
    batches: u64,
    samples: u64,
    epochs: u64,
    seconds: f64,
    /// Time spent waiting for a slot (consumers slower than the makers).
    slot_wait_s: f64,
    /// Time spent waiting for a maker's batch (makers slower).
    maker_wait_s: f64,
    /// Batches read and dropped: the broker skipped to another place.
    dropped: u64,
    /// Bytes received from the makers (batches, their headers
    /// included), and whether the image field came as `u8` pixels.
    wire_bytes: u64,
    widened: bool,
}

/// A field sent as `u8` and widened here through the stream's table.
struct Widen {
    /// Its place among the schema's fields, its pixels per sample.
    field: usize,
    hw: usize,
    layout: batchcast_broker::pipeline::transform::Layout,
    lut: batchcast_broker::pipeline::transform::Lut,
    scratch: Vec<u8>,
}

impl Widen {
    /// How `described["wire"]` says the makers send `schema`'s field,
    /// and the schema of what they send.
    fn of(
        described: &serde_json::Value,
        schema: &Schema,
    ) -> anyhow::Result<Option<(Widen, Schema)>> {
        if described["wire"].is_null() {
            return Ok(None);
        }
        let e: Expand = serde_json::from_value(described["wire"].clone())
            .context("the schema file's `wire`")?;
        let field = schema
            .fields
            .iter()
            .position(|f| f.name == e.field && f.dtype == e.dtype)
            .with_context(|| {
                format!(
                    "the schema has no {:?} field `{}` to widen",
                    e.dtype, e.field
                )
            })?;
        let shape = &schema.fields[field].shape;
        let hw = (shape.iter().product::<u64>() / 3) as usize;
        let widen = Widen {
            field,
            hw,
            layout: e.layout(),
            lut: e.lut(),
            scratch: Vec::new(),
        };
        Ok(Some((widen, e.wire(schema))))
    }
}

pub fn run(args: &FeedArgs) -> anyhow::Result<()> {
    let token = std::env::var(TOKEN_ENV)
        .with_context(|| format!("the feed's token must be in ${TOKEN_ENV}"))?;
    if token.len() < 16 {
        bail!("${TOKEN_ENV} is too short to keep others out: give at least 16 characters");
    }
    if args.makers == 0 {
        bail!("--makers must be at least 1");
    }
    let text = std::fs::read_to_string(&args.schema)
        .with_context(|| format!("reading {}", args.schema.display()))?;
    let described: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}", args.schema.display()))?;
    let schema: Schema = serde_json::from_value(described["schema"].clone())
        .with_context(|| format!("the schema in {}", args.schema.display()))?;
    let (widen, wire) = match Widen::of(&described, &schema)? {
        Some((w, wire)) => (Some(w), wire),
        None => (None, schema.clone()),
    };
    let listener =
        TcpListener::bind(args.listen).with_context(|| format!("listening on {}", args.listen))?;
    writeln!(
        std::io::stdout().lock(),
        "listening {}",
        listener.local_addr()?
    )?;
    std::io::stdout().flush()?;
    let mut makers = accept(
        &listener,
        args.makers,
        &token,
        Duration::from_secs_f64(args.accept_timeout.max(0.0)),
    )?;
    let batch_timeout = Duration::from_secs_f64(args.batch_timeout.max(0.1));
    for m in &mut makers {
        m.batch_timeout = batch_timeout;
    }
    drop(listener); // no one else gets in
    let opts = producer_options(args, &described, &schema)?;
    let producer = Producer::register(opts).context("registering the stream with the broker")?;
    let workers = described["workers"].as_u64().unwrap_or(1).max(1);
    let per_request = args.per_request.unwrap_or(2 * workers).max(1);
    let mut feed = Feed {
        figures: Figures {
            widened: widen.is_some(),
            ..Figures::default()
        },
        schema,
        wire,
        widen,
        epochs: args.epochs.or(described["schema"]["epochs"].as_u64()),
        makers,
        per_request,
        ahead: args.in_flight.max(1) * args.makers,
        asked: VecDeque::new(),
        next: (0, 0),
        sent: 0,
    };
    let t0 = Instant::now();
    let result = feed.run(producer);
    // A feed that stops early (a maker failed or went silent) leaves its
    // makers nothing to do: they see the connections close.
    for m in &feed.makers {
        let _ = m.writer.shutdown(Shutdown::Both);
    }
    feed.figures.seconds = t0.elapsed().as_secs_f64();
    result?;
    let out = serde_json::to_string(&feed.figures)?;
    writeln!(std::io::stdout().lock(), "{out}")?;
    Ok(())
}

/// The stream as `described` says, with the feed's overrides.
fn producer_options(
    args: &FeedArgs,
    described: &serde_json::Value,
    schema: &Schema,
) -> anyhow::Result<ProducerOptions> {
    let name = described["stream"]
        .as_str()
        .context("the schema file names no stream")?;
    let mut opts = ProducerOptions::new(
        name,
        schema.fields.clone(),
        schema.batch_size,
        schema.batches_per_epoch,
    );
    let r = &mut opts.request;
    r.epochs = args.epochs.or(schema.epochs);
    if let Some(s) = described["slots"].as_u64() {
        r.slots = u32::try_from(s).context("slots")?;
    }
    r.min_consumers = match args.min_consumers {
        Some(n) => n,
        None => u32::try_from(described["min_consumers"].as_u64().unwrap_or(1))?,
    };
    r.lag_limit = described["lag_limit"]
        .as_u64()
        .map(u32::try_from)
        .transpose()?;
    r.hold_limit_ms = described["hold_limit_s"]
        .as_f64()
        .map(|s| (s * 1000.0) as u64);
    r.description = format!("made on {} nodes (batchcast make)", args.makers);
    if let SourceInfo::Images(i) = &schema.source {
        r.classes = i.classes.clone();
    }
    opts.socket = args.socket.clone();
    opts.name = "batchcast feed".into();
    opts.connect_timeout = Duration::from_secs(60);
    Ok(opts)
}

/// A request in flight: batches `first .. first + count` of `epoch`, of
/// which `read` were read so far, from maker `maker`.
#[derive(Debug, Clone, Copy)]
struct Asked {
    epoch: u64,
    first: u64,
    count: u64,
    read: u64,
    maker: usize,
}

impl Asked {
    fn head(&self) -> (u64, u64) {
        (self.epoch, self.first + self.read)
    }
}

struct Feed {
    schema: Schema,
    /// What the makers send: `schema`, or with a field as `u8` that
    /// `widen` widens.
    wire: Schema,
    widen: Option<Widen>,
    epochs: Option<u64>,
    makers: Vec<Maker>,
    per_request: u64,
    ahead: usize,
    asked: VecDeque<Asked>,
    /// The place the next request starts at.
    next: (u64, u64),
    sent: usize,
    figures: Figures,
}

impl Feed {
    /// Feeds the stream to its end; on an error (a maker's batch that is
    /// wrong, late or cut off), fails the stream with the reason, so its
    /// consumers are told as for any failed source.
    fn run(&mut self, mut producer: Producer) -> anyhow::Result<()> {
        match self.pump(&mut producer) {
            Err(e) => {
                let _ = producer.fail(&format!("{e:#}"));
                Err(e)
            }
            done => done,
        }
    }

    fn pump(&mut self, producer: &mut Producer) -> anyhow::Result<()> {
        loop {
            self.ask()?;
            let w0 = Instant::now();
            let slot = loop {
                match producer.acquire_timeout(Duration::from_millis(100))? {
                    Acquired::Slot(s) => break Some(s),
                    Acquired::Ended => break None,
                    Acquired::Pending => self.ask()?,
                }
            };
            self.figures.slot_wait_s += w0.elapsed().as_secs_f64();
            let Some(slot) = slot else { break };
            let place = (slot.epoch, slot.index);
            let samples = self.expected(place)?;
            self.line_up(place)?;
            let asked = self.asked[0];
            let w0 = Instant::now();
            let read = {
                let mut fields = producer.fields_mut(&slot);
                read_batch(
                    &mut self.makers[asked.maker],
                    &self.wire,
                    samples,
                    (&mut fields, self.widen.as_mut()),
                )
            };
            read.with_context(|| {
                format!(
                    "batch {} of epoch {} from the maker at {}",
                    place.1, place.0, self.makers[asked.maker].addr
                )
            })?;
            self.figures.maker_wait_s += w0.elapsed().as_secs_f64();
            self.figures.wire_bytes += 16 + self.wire.batch_bytes(samples);
            producer.publish(&slot, samples)?;
            self.figures.batches += 1;
            self.figures.samples += samples;
            self.figures.epochs = self.figures.epochs.max(place.0 + 1);
            self.advance();
        }
        Ok(())
    }

    /// Samples of the batch at `place`, or why it is not the stream's.
    fn expected(&self, (epoch, index): (u64, u64)) -> anyhow::Result<u64> {
        let s = &self.schema;
        if index >= s.batches_per_epoch || self.epochs.is_some_and(|n| epoch >= n) {
            bail!("the broker asked for batch {index} of epoch {epoch}, not one of the stream's");
        }
        Ok(s.batch_samples(index))
    }

    /// Keeps `ahead` requests in flight, each to the next maker in turn.
    fn ask(&mut self) -> anyhow::Result<()> {
        let per_epoch = self.schema.batches_per_epoch;
        while self.asked.len() < self.ahead {
            let (epoch, first) = self.next;
            if self.epochs.is_some_and(|n| epoch >= n) {
                return Ok(());
            }
            let count = self.per_request.min(per_epoch - first);
            let maker = self.sent % self.makers.len();
            let m = &mut self.makers[maker];
            writeln!(m.writer, "{epoch} {first} {count}")
                .with_context(|| format!("asking the maker at {}", m.addr))?;
            self.sent += 1;
            self.asked.push_back(Asked {
                epoch,
                first,
                count,
                read: 0,
                maker,
            });
            self.next = if first + count < per_epoch {
                (epoch, first + count)
            } else {
                (epoch + 1, 0)
            };
        }
        Ok(())
    }

    /// Makes the oldest request in flight start at `place`: batches asked
    /// before it (the broker skipped them: nobody read the rest of an
    /// epoch) are read and dropped, and where none was asked for `place`,
    /// requests start there.
    fn line_up(&mut self, place: (u64, u64)) -> anyhow::Result<()> {
        let mut scratch = Vec::new();
        loop {
            match self.asked.front() {
                Some(a) if a.head() == place => return Ok(()),
                Some(a) => {
                    let a = *a;
                    let samples = self.expected(a.head())?;
                    let m = &mut self.makers[a.maker];
                    let skipped = (|| {
                        let bytes = frame_head(m, samples, &self.wire)?;
                        scratch.resize(bytes as usize, 0);
                        m.read_exact(&mut scratch)
                    })();
                    skipped.with_context(|| {
                        format!(
                            "batch {} of epoch {} (skipped) from the maker at {}",
                            a.head().1,
                            a.head().0,
                            m.addr
                        )
                    })?;
                    self.figures.dropped += 1;
                    self.advance();
                }
                None => {
                    self.next = place;
                    self.ask()?;
                    if self.asked.is_empty() {
                        bail!(
                            "the broker asked for batch {} of epoch {}, past the stream's end",
                            place.1,
                            place.0
                        );
                    }
                }
            }
        }
    }

    /// The oldest request's next batch was read.
    fn advance(&mut self) {
        if let Some(a) = self.asked.front_mut() {
            a.read += 1;
            if a.read == a.count {
                self.asked.pop_front();
            }
        }
    }
}

/// Reads a frame's header from `m`: it must hold `samples` samples of
/// the schema's bytes; returns its bytes. The batch's deadline starts
/// here.
fn frame_head(m: &mut Maker, samples: u64, schema: &Schema) -> anyhow::Result<u64> {
    let mut head = [0u8; 16];
    m.batch_due(schema.batch_bytes(samples));
    m.read_exact(&mut head)?;
    let got = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    let bytes = u64::from_le_bytes(head[8..].try_into().expect("8 bytes"));
    let want = schema.batch_bytes(samples);
    if got != samples || bytes != want {
        bail!(
            "it sent {got} samples in {bytes} bytes where the stream has {samples} samples in {want} bytes (is it making the same config?)"
        );
    }
    Ok(bytes)
}

/// Reads the next batch of `m` (`wire`'s fields) straight into `fields`
/// (the slot's cells), but for a field `widen` widens: read into its
/// scratch, then written through the stream's table.
fn read_batch(
    m: &mut Maker,
    wire: &Schema,
    samples: u64,
    (fields, mut widen): (&mut [&mut [u8]], Option<&mut Widen>),
) -> anyhow::Result<()> {
    frame_head(m, samples, wire)?;
    for (i, (f, cells)) in wire.fields.iter().zip(fields.iter_mut()).enumerate() {
        let len = (f.bytes_per_sample().unwrap_or(0) * samples) as usize;
        match widen.as_deref_mut() {
            Some(w) if w.field == i => {
                w.scratch.resize(len, 0);
                m.read_exact(&mut w.scratch)?;
                let out = len * w.lut.element_bytes();
                w.lut.expand(w.layout, w.hw, &w.scratch, &mut cells[..out]);
            }
            _ => m.read_exact(&mut cells[..len])?,
        }
    }
    Ok(())
}
