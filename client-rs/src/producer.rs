//! The blocking producer client: registers a stream with the broker and
//! writes its batches into the shared arena, for pipelines that run outside
//! the broker (a Python `DataLoader`, a custom Rust loader).
//!
//! ```no_run
//! use batchcast::{DType, Field, Producer, ProducerOptions};
//! let fields = vec![Field { name: "x".into(), dtype: DType::F32, shape: vec![16], aux: false }];
//! let mut producer = Producer::register(ProducerOptions::new("train", fields, 32, 100))?;
//! while let Some(slot) = producer.acquire()? {
//!     let mut views = producer.fields_mut(&slot);
//!     views[0].fill(0); // write the batch straight into shared memory
//!     producer.publish(&slot, 32)?;
//! }
//! # Ok::<(), batchcast::Error>(())
//! ```
//!
//! The broker hands out one slot at a time ([`Producer::acquire`]), blocking
//! while every slot is still held by consumers (back-pressure) or while too
//! few consumers have subscribed. Each slot names the epoch and index of the
//! batch it must hold. Normally these follow the producer's own count; they
//! jump to the start of a later epoch when the broker skipped the rest of an
//! epoch that nobody was subscribed to, and the producer then starts that
//! epoch afresh.
//!
//! If the broker goes away (killed, restarted), the producer rides through
//! it within [`ProducerOptions::reconnect_timeout`] (see `ride.rs`): it
//! registers its stream again and publishes the last batches it wrote
//! itself, so its consumers resume where they were. The program notices
//! nothing but a longer wait in `acquire`.

mod ride;

use std::collections::VecDeque;
use std::io::BufReader;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::proto::{ClientMsg, FillSlot, Hello, Intent, ProduceRequest, Registered, ServerMsg};
use crate::schema::{Field, RingLayout, Schema, SlotLayout};
use crate::shm::{Mapping, RingView};
use crate::transport::{
    broker_error, connect_retrying, expect_reply, goodbye_error, handshake, last_words,
    program_name, read_server_msg, readable_within, send_msg,
};

/// What to register, and how to reach the broker.
#[derive(Debug, Clone)]
pub struct ProducerOptions {
    /// The broker's socket; `None` for [`crate::default_socket_path`].
    pub socket: Option<PathBuf>,
    /// The name shown in `batchcast stats`.
    pub name: String,
    /// How long to retry while no broker is listening yet.
    pub connect_timeout: Duration,
    /// The uid the broker must run as (see [`crate::ConsumerOptions::broker_uid`]).
    pub broker_uid: Option<u32>,
    /// The stream: its name, fields, batch size, epochs, slots, ... exactly
    /// as the broker receives it.
    pub request: ProduceRequest,
    /// How long to wait for a broker that went away to come back, then
    /// register the stream again and go on (`0`: fail at once).
    /// `$BATCHCAST_RECONNECT_TIMEOUT` seconds, else
    /// [`crate::DEFAULT_RECONNECT_TIMEOUT`].
    pub reconnect_timeout: Duration,
    /// Registering again, how long the new broker holds the stream for the
    /// consumers it had to come back (each resumes where it was) before it
    /// goes on with those there are. Capped by the broker's
    /// `registration_timeout_s`.
    pub rejoin_grace: Duration,
}

/// The default [`ProducerOptions::rejoin_grace`]: consumers notice a
/// broker gone at their next read and retry every 20 ms, so those busy
/// with a training step of a few seconds are back well within it.
pub const DEFAULT_REJOIN_GRACE: Duration = Duration::from_secs(10);

impl ProducerOptions {
    /// Options with [`ProduceRequest::new`]'s defaults: 4 slots, one
    /// consumer, endless, no lag limit; named after the program.
    pub fn new(
        stream: impl Into<String>,
        fields: Vec<Field>,
        batch_size: u64,
        batches_per_epoch: u64,
    ) -> ProducerOptions {
        ProducerOptions {
            socket: None,
            name: program_name("producer"),
            connect_timeout: Duration::ZERO,
            broker_uid: None,
            request: ProduceRequest::new(stream, fields, batch_size, batches_per_epoch),
            reconnect_timeout: crate::consumer::seconds(
                "BATCHCAST_RECONNECT_TIMEOUT",
                crate::DEFAULT_RECONNECT_TIMEOUT,
            ),
            rejoin_grace: DEFAULT_REJOIN_GRACE,
        }
    }
}

/// What [`Producer::acquire_timeout`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// Fill this slot, then [`Producer::publish`] it.
    Slot(FillSlot),
    /// Every epoch has been handed out; nothing more to produce.
    Ended,
    /// Nothing yet; ask again (the request stays outstanding).
    Pending,
}

/// A registered external stream.
#[derive(Debug)]
pub struct Producer {
    reader: Link,
    buf: Vec<u8>,
    map: Mapping,
    registered: Registered,
    /// A slot request is outstanding.
    requested: bool,
    /// The slot handed out and not yet published.
    filling: Option<FillSlot>,
    ended: bool,
    /// What it registered with, to register again.
    opts: ProducerOptions,
    /// The last batches published into this arena (at most its slots):
    /// what it publishes again if the broker goes away.
    kept: VecDeque<Kept>,
    /// Consumers subscribed when the last slot was handed out.
    readers: u32,
    /// The broker went away at this instant; it waits for it.
    down: Option<Instant>,
    /// Registered again: the previous arenas (oldest first), and the
    /// batches in each still to publish again.
    old: Vec<OldArena>,
    reconnects: u32,
}

/// A batch published into the arena: which, where, how many samples.
#[derive(Debug, Clone, Copy)]
struct Kept {
    epoch: u64,
    index: u64,
    seq: u64,
    samples: u64,
}

/// The arena of a broker that went away, kept mapped while its last
/// batches are published again under the new one.
#[derive(Debug)]
struct OldArena {
    map: Mapping,
    rings: RingLayout,
    kept: VecDeque<Kept>,
}

/// The producer's connection: says goodbye when dropped.
#[derive(Debug)]
struct Link(BufReader<UnixStream>);

impl Drop for Link {
    fn drop(&mut self) {
        // Done: the broker ends the stream normally if every epoch was
        // published, and tells consumers the producer left early otherwise.
        let _ = send_msg(self.0.get_ref(), &ClientMsg::Goodbye);
    }
}

impl Producer {
    /// Connects, registers the stream and maps its arena writable.
    pub fn register(opts: ProducerOptions) -> Result<Producer> {
        // The broker creates and pre-faults the arena before it answers:
        // give it time for that on top of the usual floor (at 0.5 GB/s, a
        // loaded host's worst, 2 s a GiB).
        let arena: u64 = opts
            .request
            .fields
            .iter()
            .filter_map(|f| f.bytes_per_sample())
            .sum::<u64>()
            .saturating_mul(opts.request.batch_size)
            .saturating_mul(u64::from(opts.request.slots));
        let floor = crate::transport::HANDSHAKE_FLOOR
            + Duration::from_secs_f64(2.0 * arena as f64 / f64::from(1u32 << 30));
        let hello = ClientMsg::Hello(Hello {
            name: opts.name.clone(),
            pid: std::process::id(),
            intent: Intent::Produce(Box::new(opts.request.clone())),
        });
        connect_retrying(
            opts.socket.clone(),
            (opts.connect_timeout, floor),
            opts.broker_uid,
            |stream| Producer::open(stream, &hello, &opts),
        )
    }

    fn open(stream: UnixStream, hello: &ClientMsg, opts: &ProducerOptions) -> Result<Producer> {
        let (reply, fds) = handshake(&stream, hello)?;
        let registered = expect_reply(reply, "a registration", |m| match m {
            ServerMsg::Registered(r) => Ok(*r),
            other => Err(other),
        })?;
        let fd = fds
            .into_iter()
            .next()
            .ok_or_else(|| Error::Shm("the broker's registration carried no arena fd".into()))?;
        registered.rings.validate(&registered.schema)?;
        let map = Mapping::rings(fd.as_fd(), &RingView::of(&registered.rings), true)?;
        Ok(Producer {
            reader: Link(BufReader::with_capacity(4096, stream)),
            buf: Vec::with_capacity(256),
            map,
            registered,
            requested: false,
            filling: None,
            ended: false,
            opts: opts.clone(),
            kept: VecDeque::new(),
            readers: 0,
            down: None,
            old: Vec::new(),
            reconnects: 0,
        })
    }

    /// Times it registered its stream again after the broker went away.
    pub fn reconnects(&self) -> u32 {
        self.reconnects
    }

    pub fn schema(&self) -> &Schema {
        &self.registered.schema
    }

    pub fn layout(&self) -> &SlotLayout {
        &self.registered.layout
    }

    /// Blocks for the next slot to fill; `None` once every epoch is done.
    pub fn acquire(&mut self) -> Result<Option<FillSlot>> {
        loop {
            match self.acquire_timeout(Duration::from_secs(3600))? {
                Acquired::Slot(s) => return Ok(Some(s)),
                Acquired::Ended => return Ok(None),
                Acquired::Pending => {}
            }
        }
    }

    /// Like [`Producer::acquire`], but gives up after `timeout` with
    /// [`Acquired::Pending`] so the caller can check for interrupts; the
    /// request stays outstanding and the next call continues waiting.
    pub fn acquire_timeout(&mut self, timeout: Duration) -> Result<Acquired> {
        if let Some(s) = self.filling {
            return Err(Error::InvalidOption(format!(
                "slot {} (batch {}) is still being filled; publish it before acquiring another",
                s.slot, s.seq
            )));
        }
        let until = Instant::now() + timeout;
        loop {
            if self.ended {
                return Ok(Acquired::Ended);
            }
            if self.down.is_some() && !self.reconnect(until)? {
                return Ok(Acquired::Pending);
            }
            let got = self.ask(until.saturating_duration_since(Instant::now()));
            match got {
                Ok(Acquired::Slot(s)) => {
                    self.readers = s.readers;
                    // A batch of the old arena published again: ask on.
                    if !self.publish_again(&s)? {
                        return Ok(Acquired::Slot(s));
                    }
                }
                Err(e) if self.may_ride(&e) => self.went_away(&e),
                other => return other,
            }
        }
    }

    /// One request for a slot, and its answer if it comes within `timeout`.
    fn ask(&mut self, timeout: Duration) -> Result<Acquired> {
        if !self.requested {
            if let Err(e) = send_msg(self.reader.0.get_ref(), &ClientMsg::Acquire) {
                return Err(last_words(&mut self.reader.0, &mut self.buf, e));
            }
            self.requested = true;
        }
        if self.reader.0.buffer().is_empty() {
            let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
            if !readable_within(self.reader.0.get_ref(), ms)? {
                return Ok(Acquired::Pending);
            }
        }
        let msg = read_server_msg(&mut self.reader.0, &mut self.buf)?;
        self.requested = false;
        match msg {
            ServerMsg::Fill(s) => {
                if s.slot >= self.registered.slots {
                    return Err(Error::Unexpected(format!(
                        "slot {} outside the arena of {}",
                        s.slot, self.registered.slots
                    )));
                }
                self.filling = Some(s);
                Ok(Acquired::Slot(s))
            }
            ServerMsg::EndOfStream => {
                self.ended = true;
                Ok(Acquired::Ended)
            }
            ServerMsg::Error(e) => Err(broker_error(e)),
            ServerMsg::Goodbye(reason) => Err(goodbye_error(reason)),
            other => Err(Error::Unexpected(format!("{other:?}"))),
        }
    }

    /// Writable views of every field of `slot`, in schema order, each sized
    /// for a full batch (`batch_size × bytes per sample`): the batch's cells
    /// in each field's ring.
    pub fn fields_mut(&mut self, slot: &FillSlot) -> Vec<&mut [u8]> {
        assert_eq!(
            self.filling.as_ref(),
            Some(slot),
            "fields_mut of a slot this producer is not filling"
        );
        let rings = &self.registered.rings;
        let mut views = Vec::with_capacity(rings.fields.len());
        for (start, len) in rings.unit_spans(slot.seq) {
            // SAFETY: the broker handed batch `seq` to this producer to fill:
            // no consumer reads its samples until `publish`, and the hub
            // keeps every other live batch's cells apart from them (slots
            // are a ring of `slots × batch_size` samples at most); the
            // `&mut self` borrow keeps this process from making a second
            // view. Each field's span lies in its own ring's part of the
            // mapping, so the views are disjoint.
            views.push(unsafe { self.map.slice_mut(start, len) });
        }
        views
    }

    /// The slot holds `samples` valid samples (at most the batch size; fewer
    /// for a short last batch): hand it to the consumers.
    pub fn publish(&mut self, slot: &FillSlot, samples: u64) -> Result<()> {
        if self.filling.as_ref() != Some(slot) {
            return Err(Error::InvalidOption(format!(
                "batch {} is not the one being filled",
                slot.seq
            )));
        }
        let batch = self.registered.schema.batch_size;
        if samples == 0 || samples > batch {
            return Err(Error::InvalidOption(format!(
                "a batch holds 1 to {batch} samples, not {samples}"
            )));
        }
        self.filling = None;
        self.keep(slot, samples);
        if self.down.is_some() {
            // Written into the old arena: published again once back.
            return Ok(());
        }
        let sent = send_msg(
            self.reader.0.get_ref(),
            &ClientMsg::Publish {
                seq: slot.seq,
                samples,
            },
        );
        match sent {
            Err(e) if self.may_ride(&e) => {
                self.went_away(&e);
                Ok(())
            }
            other => other,
        }
    }

    /// Stops the stream because the source failed; every consumer gets
    /// `message`. The connection closes.
    pub fn fail(self, message: &str) -> Result<()> {
        send_msg(
            self.reader.0.get_ref(),
            &ClientMsg::Fail {
                message: message.into(),
            },
        )
    }
}
