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

use std::io::BufReader;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::proto::{ClientMsg, FillSlot, Hello, Intent, ProduceRequest, Registered, ServerMsg};
use crate::schema::{Field, Schema, SlotLayout};
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
}

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
    reader: BufReader<UnixStream>,
    buf: Vec<u8>,
    map: Mapping,
    registered: Registered,
    /// A slot request is outstanding.
    requested: bool,
    /// The slot handed out and not yet published.
    filling: Option<FillSlot>,
    ended: bool,
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
            intent: Intent::Produce(Box::new(opts.request)),
        });
        connect_retrying(
            opts.socket,
            (opts.connect_timeout, floor),
            opts.broker_uid,
            |stream| Producer::open(stream, &hello),
        )
    }

    fn open(stream: UnixStream, hello: &ClientMsg) -> Result<Producer> {
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
            reader: BufReader::with_capacity(4096, stream),
            buf: Vec::with_capacity(256),
            map,
            registered,
            requested: false,
            filling: None,
            ended: false,
        })
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
        if self.ended {
            return Ok(Acquired::Ended);
        }
        if !self.requested {
            if let Err(e) = send_msg(self.reader.get_ref(), &ClientMsg::Acquire) {
                return Err(last_words(&mut self.reader, &mut self.buf, e));
            }
            self.requested = true;
        }
        if self.reader.buffer().is_empty() {
            let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
            if !readable_within(self.reader.get_ref(), ms)? {
                return Ok(Acquired::Pending);
            }
        }
        let msg = read_server_msg(&mut self.reader, &mut self.buf)?;
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
        send_msg(
            self.reader.get_ref(),
            &ClientMsg::Publish {
                seq: slot.seq,
                samples,
            },
        )?;
        self.filling = None;
        Ok(())
    }

    /// Stops the stream because the source failed; every consumer gets
    /// `message`. The connection closes.
    pub fn fail(self, message: &str) -> Result<()> {
        send_msg(
            self.reader.get_ref(),
            &ClientMsg::Fail {
                message: message.into(),
            },
        )
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        // Done: the broker ends the stream normally if every epoch was
        // published, and tells consumers the producer left early otherwise.
        let _ = send_msg(self.reader.get_ref(), &ClientMsg::Goodbye);
    }
}
