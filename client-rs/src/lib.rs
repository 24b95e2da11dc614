//! batchcast: zero-copy batches from a per-host data-loading broker.
//!
//! A broker (`batchcast serve`) runs the input pipeline once per host and
//! writes every batch into a shared-memory arena; this crate subscribes to
//! it, maps the arena read-only and hands out views of each batch without
//! copying it.
//!
//! ```no_run
//! let mut consumer = batchcast::Consumer::connect(Default::default())?;
//! for batch in &mut consumer {
//!     let batch = batch?;
//!     let images = batch.field("image")?; // a view into shared memory
//!     println!("epoch {} batch {}: {:?}", batch.epoch(), batch.index(), images.shape());
//! } // each batch is released when dropped
//! # Ok::<(), batchcast::Error>(())
//! ```
//!
//! # Layout
//!
//! * [`proto`]: the wire protocol shared with the broker: preamble, every
//!   message, framing.
//! * [`schema`]: dtypes, fields, and where each field lives in a slot.
//! * [`shm`]: memfd arenas, read-only mappings and fd passing.
//! * [`mailbox`]: a host consumer's batch notices and releases in shared
//!   memory, with futex wake-ups (the socket carries the rest).
//! * [`consumer`]: the blocking [`Consumer`], [`Batch`] and its field views,
//!   and [`StatsClient`].
//! * [`producer`]: the blocking [`Producer`], which registers a stream and
//!   writes its batches from outside the broker (e.g. a Python DataLoader).
//! * [`synthetic`]: the deterministic test data source both sides use.
//! * [`device`]: where a consumer wants its batches (`cpu`, `cuda:N`).
//! * `cuda` (feature `cuda`, on by default): a safe layer over the CUDA
//!   driver, loaded at run time: device arenas over CUDA IPC, page-locked
//!   host memory, asynchronous copies and events.
//!
//! # Shared means read-only
//!
//! Every consumer sees the same bytes. The arena is mapped read-only here
//! and sealed so that no process but the broker can ever map it writable:
//! an in-place write to a batch faults in the process that tries it and can
//! never change what other consumers read.

pub mod consumer;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod error;
mod gpu;
pub mod mailbox;
pub mod producer;
pub mod proto;
pub mod schema;
pub mod shm;
pub mod synthetic;

pub use consumer::{
    Batch, Consumer, ConsumerOptions, Element, Event, FieldView, StatsClient, default_socket_path,
};
pub use device::Device;
pub use error::{Error, Result};
pub use producer::{Acquired, Producer, ProducerOptions};
pub use proto::{FillSlot, JoinPolicy};
pub use schema::{DType, Field, Schema};
