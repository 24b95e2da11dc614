//! Making a configured stream's batches away from any broker: on another
//! machine's CPUs (`batchcast make`, which `batchcast.ray.feed_stream` runs
//! on a cluster's CPU nodes), byte for byte what the stream's own broker
//! makes at the same place.
//!
//! Batch `index` of epoch `epoch` is the stream's epoch order at
//! `index × batch_size ..` written by the same `SlotWriter` as the
//! broker's pipeline threads, into a plain buffer: each field's cells in
//! schema order (`samples × bytes_per_sample` each). Where it lies in the
//! stream's sequence is the broker's replay place, so a stream on a
//! shared source decodes what a replay of it would (the same bytes; with
//! `decode = "once"`, the source's finest scale) and waits for none of
//! the source's other streams.
//!
//! [`Wire::U8`]: an image stream whose tensor is its `u8` pixels through a
//! table (`Normalize` to a float dtype, nothing in float after it) is sent
//! as those `u8` values, a quarter of an `f32` batch's bytes; its feed
//! writes them through the same table ([`Expand`]), so the slot holds the
//! bytes the stream's own broker writes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use batchcast::DType;
use batchcast::schema::Schema;

use crate::budget::{Budget, OverBudget};
use crate::config::Config;
use crate::pipeline::collate::{SlotWriter, ThreadState};
use crate::pipeline::decode::DecodeError;
use crate::pipeline::shared::Shares;
use crate::pipeline::transform::{Layout, Lut, Transform};
use crate::pipeline::{PipelineError, Place};
use crate::plan::kind::WriterJob;
use crate::plan::{PlanError, StreamPlan, plan_broker, plan_config};

#[derive(Debug, thiserror::Error)]
pub enum MakeError {
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("the config has no stream `{stream}` (its streams: {names})")]
    NoStream { stream: String, names: String },
    #[error(
        "stream `{0}` is an external producer's: only a stream the config describes can be made"
    )]
    External(String),
    #[error(
        "batch {index} of epoch {epoch} is not in stream `{stream}` ({batches} batches an epoch{epochs})"
    )]
    Outside {
        stream: String,
        epoch: u64,
        index: u64,
        batches: u64,
        epochs: String,
    },
    #[error("stream `{stream}` cannot be sent as u8 pixels: {why} (leave out --wire u8)")]
    Wire { stream: String, why: String },
    #[error(transparent)]
    Budget(#[from] OverBudget),
    #[error("cannot start a decoder")]
    Decoder(#[from] DecodeError),
    #[error("stream `{stream}`: {error}")]
    Pipeline {
        stream: String,
        error: PipelineError,
    },
}

/// A configured stream's maker: its plan, the writer of its batches and
/// the epoch orders it used last.
#[derive(Debug)]
pub struct Maker {
    plan: StreamPlan,
    /// What goes on the wire: the stream's schema, or with its image
    /// field as `u8` where [`Maker::expand`] says how to widen it.
    wire: Schema,
    expand: Option<Expand>,
    writer: SlotWriter,
    /// The decoded images and encoded bytes it keeps are taken from here
    /// (the config's `[broker] memory_mib`), as a broker's would be.
    _budget: Arc<Budget>,
    orders: Mutex<HashMap<u64, Arc<Vec<u64>>>>,
}

/// What one thread of a [`Maker`] makes batches with: a decoder and
/// buffers.
#[derive(Debug)]
pub struct MakerThread(ThreadState);

/// Epoch orders kept at once (a request spans one epoch, the next may
/// begin another).
const ORDERS_KEPT: usize = 4;

/// How a maker sends an image stream's image field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Wire {
    /// As the stream has it.
    #[default]
    AsIs,
    /// As `u8` pixels, widened by the feed; refused where the stream's
    /// tensor is not a table of its pixels.
    U8,
    /// `U8` where the stream allows it, else as it is.
    Auto,
}

/// How a feed widens a field sent as `u8`: the stream's own table.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Expand {
    /// The field, and the stream's dtype, layout and normalisation of it.
    pub field: String,
    pub dtype: DType,
    pub nhwc: bool,
    pub normalize: Option<([f64; 3], [f64; 3])>,
}

impl Expand {
    /// The table the stream's transform writes its tensor through.
    pub fn lut(&self) -> Lut {
        let geometry = crate::pipeline::transform::Geometry::ResizeCrop {
            resize: None,
            crop: None,
        };
        Lut::new(&Transform {
            dtype: self.dtype,
            normalize: self.normalize,
            layout: self.layout(),
            ..Transform::of(geometry)
        })
    }

    pub fn layout(&self) -> Layout {
        if self.nhwc {
            Layout::Nhwc
        } else {
            Layout::Nchw
        }
    }

    /// `schema` with this field as `u8`: what a maker sends.
    pub fn wire(&self, schema: &Schema) -> Schema {
        let mut wire = schema.clone();
        for f in wire.fields.iter_mut().filter(|f| f.name == self.field) {
            f.dtype = DType::U8;
        }
        wire
    }
}

/// The transform a maker runs for `wire`, and how its feed widens it.
fn wire_transform(
    stream: &str,
    t: &Transform,
    wire: Wire,
) -> Result<(Transform, Option<Expand>), MakeError> {
    let why = if t.dtype == DType::U8 {
        Some("its tensor is u8 already")
    } else if t.erasing.is_some() {
        Some("random_erasing works on the float tensor, after the table")
    } else {
        None
    };
    match (wire, why) {
        (Wire::AsIs, _) | (Wire::Auto, Some(_)) => Ok((t.clone(), None)),
        (Wire::U8, Some(why)) => Err(MakeError::Wire {
            stream: stream.into(),
            why: why.into(),
        }),
        (Wire::U8 | Wire::Auto, None) => Ok((
            Transform {
                dtype: DType::U8,
                normalize: None,
                ..t.clone()
            },
            Some(Expand {
                field: "image".into(),
                dtype: t.dtype,
                nhwc: t.layout == Layout::Nhwc,
                normalize: t.normalize,
            }),
        )),
    }
}

impl Maker {
    /// The maker of stream `stream` of `cfg`, as the user `uid` (whose
    /// share of the memory budget its caches take).
    pub fn new(cfg: &Config, stream: &str, uid: u32, wire: Wire) -> Result<Maker, MakeError> {
        let broker = plan_broker(&cfg.broker)?;
        let plans = plan_config(cfg)?;
        let names = plans
            .iter()
            .map(|p| format!("`{}`", p.name))
            .collect::<Vec<_>>()
            .join(", ");
        let plan = plans
            .into_iter()
            .find(|p| p.name == stream)
            .ok_or_else(|| MakeError::NoStream {
                stream: stream.into(),
                names,
            })?;
        let budget = Budget::new(broker.memory_bytes, uid);
        let whom = format!("stream `{}`", plan.name);
        let (transform, expand) = match plan.source.images() {
            Some(p) => {
                let (transform, widen) = wire_transform(&plan.name, &p.transform, wire)?;
                (Some(transform), widen)
            }
            None if wire == Wire::U8 && plan.source.broker_writes() => {
                return Err(MakeError::Wire {
                    stream: plan.name.clone(),
                    why: format!("a {} stream has no pixels", plan.source.kind()),
                });
            }
            None => (None, None),
        };
        let writer = plan
            .source
            .writer(WriterJob {
                budget: &budget,
                uid,
                whom: &whom,
                shares: &mut Shares::default(),
                transform,
                epochs: plan.epochs,
            })?
            .ok_or_else(|| MakeError::External(plan.name.clone()))?;
        let wire = match &expand {
            Some(e) => e.wire(&plan.schema),
            None => plan.schema.clone(),
        };
        Ok(Maker {
            plan,
            wire,
            expand,
            writer,
            _budget: budget,
            orders: Mutex::new(HashMap::new()),
        })
    }

    pub fn plan(&self) -> &StreamPlan {
        &self.plan
    }

    pub fn schema(&self) -> &Schema {
        &self.plan.schema
    }

    /// How the image field is sent, where it is sent as `u8`.
    pub fn expand(&self) -> Option<&Expand> {
        self.expand.as_ref()
    }

    /// A thread's own state (its decoder and buffers).
    pub fn thread(&self) -> Result<MakerThread, MakeError> {
        Ok(MakerThread(self.writer.thread_state()?))
    }

    /// The samples of batch `index` of `epoch`, or why it is not one of
    /// the stream's.
    pub fn samples(&self, epoch: u64, index: u64) -> Result<u64, MakeError> {
        let s = &self.plan.schema;
        let past_end = self.plan.epochs.is_some_and(|n| epoch >= n);
        if past_end || index >= s.batches_per_epoch {
            return Err(MakeError::Outside {
                stream: self.plan.name.clone(),
                epoch,
                index,
                batches: s.batches_per_epoch,
                epochs: self
                    .plan
                    .epochs
                    .map_or(String::new(), |n| format!(", {n} epochs")),
            });
        }
        Ok(s.batch_samples(index))
    }

    /// Tells a remote dataset the batches `index..end` of `epoch` come
    /// next (it reads ahead).
    pub fn want(&self, epoch: u64, index: u64, end: u64) {
        if !self.writer.reads_remote() {
            return;
        }
        let order = self.order(epoch);
        let bs = self.plan.schema.batch_size;
        // Any numbers a request holds: a range past the epoch (or one
        // that overflows) wants nothing; `make` then says why.
        let at = |i: u64| i.saturating_mul(bs).min(order.len() as u64) as usize;
        let (from, to) = (at(index), at(end));
        let Some(first) = epoch
            .checked_mul(order.len() as u64)
            .and_then(|e| e.checked_add(from as u64))
        else {
            return;
        };
        if from < to {
            self.writer
                .want(first, &mut order[from..to].iter().copied());
        }
    }

    /// Writes batch `index` of `epoch` into `out` (resized to its bytes):
    /// each field's cells in schema order. Returns its samples.
    pub fn make(
        &self,
        thread: &mut MakerThread,
        epoch: u64,
        index: u64,
        out: &mut Vec<u8>,
    ) -> Result<u64, MakeError> {
        let samples = self.samples(epoch, index)?;
        let order = self.order(epoch);
        let first = (index * self.plan.schema.batch_size) as usize;
        let indices = &order[first..first + samples as usize];
        out.clear();
        out.resize(self.wire.batch_bytes(samples) as usize, 0);
        let mut fields: Vec<&mut [u8]> = Vec::with_capacity(self.wire.fields.len());
        let mut rest = out.as_mut_slice();
        for f in &self.wire.fields {
            let len = (f.bytes_per_sample().unwrap_or(0) * samples) as usize;
            let (cells, tail) = rest.split_at_mut(len);
            fields.push(cells);
            rest = tail;
        }
        let place = Place {
            at: epoch * order.len() as u64 + first as u64,
            replay: true,
        };
        self.writer
            .write_batch(&mut thread.0, epoch, place, indices, &mut fields)
            .map_err(|error| MakeError::Pipeline {
                stream: self.plan.name.clone(),
                error,
            })
    }

    /// Epoch `epoch`'s order of dataset indices.
    fn order(&self, epoch: u64) -> Arc<Vec<u64>> {
        let mut orders = self.orders.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(o) = orders.get(&epoch) {
            return o.clone();
        }
        if orders.len() >= ORDERS_KEPT
            && let Some(&oldest) = orders.keys().min()
        {
            orders.remove(&oldest);
        }
        let o = Arc::new(self.plan.epoch_order(epoch));
        orders.insert(epoch, o.clone());
        o
    }
}
