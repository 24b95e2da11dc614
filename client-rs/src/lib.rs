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
//! The wire, shared with the broker, is the core crate's
//! (`batchcast-core`: one definition of every message and layout), and is
//! this crate's at the same paths:
//!
//! * [`proto`]: preamble, every message, framing, protocol version.
//! * [`schema`]: fields, and where each field lives in a slot; [`dtype`]:
//!   element types.
//! * [`synthetic`]: the deterministic test data source both sides use.
//!
//! Shared memory, over the core's layouts:
//!
//! * [`shm`]: read-only mappings of memfd arenas and fd passing.
//! * [`mailbox`]: a host consumer's batch notices and releases in shared
//!   memory, with futex wake-ups (the socket carries the rest).
//!
//! The client:
//!
//! * `transport`: connecting (with retries), the handshake, frames, and
//!   waiting on the socket; used by every kind of client below.
//! * [`consumer`]: the blocking [`Consumer`] and its options.
//! * [`batch`]: one [`Batch`] and its read-only [`FieldView`]s.
//! * [`stats_client`]: [`StatsClient`], what a broker is doing.
//! * [`producer`]: the blocking [`Producer`], which registers a stream and
//!   writes its batches from outside the broker (e.g. a Python DataLoader).
//! * [`device`]: where a consumer wants its batches (`cpu`, `cuda:N`);
//!   `gpu`: the consumer's side of GPU delivery.
//! * `cuda` (feature `cuda`, on by default): a safe layer over the CUDA
//!   driver, loaded at run time: device arenas over CUDA IPC, page-locked
//!   host memory, asynchronous copies and events.
//! * [`error`]: [`Error`] and the broker's [`ErrorCode`]s; [`parse`]: the
//!   error of parsing a dtype, device or join policy a user wrote.
//!
//! The broker's half of the shared-memory protocols (creating and sealing
//! an arena, sending its fd, a mailbox's broker side, the GPU memory it
//! exports and copies into) is built only with
//! the `broker` feature, which the broker turns on: a client's API has
//! none of it, and each protocol's two sides stay in one module.
//!
//! # Shared means read-only
//!
//! Every consumer sees the same bytes. The arena is mapped read-only here
//! and sealed so that no process but the broker can ever map it writable:
//! an in-place write to a batch faults in the process that tries it and can
//! never change what other consumers read.

pub mod batch;
pub mod batcher;
pub mod consumer;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod error;
mod gpu;
pub mod mailbox;
pub mod options;
pub mod producer;
pub mod shm;
pub mod stand_in;
pub mod stats_client;
mod transport;

// What the broker and this client agree on byte for byte lives in
// batchcast-core; its modules are this crate's at the same paths.
pub use batchcast_core::{deal, dtype, parse, proto, rotation, schema, synthetic};

pub use batch::{Batch, Element, FieldView};
pub use consumer::{
    Consumer, ConsumerOptions, ConsumerState, DEFAULT_RECONNECT_TIMEOUT, Event, GroupPlace,
    group_from_env,
};
pub use device::Device;
pub use error::{Error, ErrorCode, Result};
pub use parse::ParseError;
pub use producer::{Acquired, Producer, ProducerOptions};
pub use proto::{FillSlot, JoinPolicy, ProduceRequest};
pub use schema::{DType, Field, Schema};
pub use stats_client::StatsClient;
pub use transport::default_socket_path;
