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
//! The wire, shared with the broker (one definition of every message):
//!
//! * [`proto`]: preamble, every message, framing, protocol version.
//! * [`schema`]: fields, and where each field lives in a slot; [`dtype`]:
//!   element types.
//! * [`shm`]: memfd arenas, read-only mappings and fd passing.
//! * [`mailbox`]: a host consumer's batch notices and releases in shared
//!   memory, with futex wake-ups (the socket carries the rest).
//! * [`synthetic`]: the deterministic test data source both sides use.
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
//! The broker's half of the shared-memory protocols lives here too
//! ([`shm::Arena`], [`mailbox::BrokerMailbox`], [`synthetic`]'s fill): one
//! definition of each layout, next to the other side's (ARCHITECTURE.md,
//! "Crates", says why there is no separate wire crate).
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
pub mod deal;
pub mod device;
pub mod dtype;
pub mod error;
mod gpu;
pub mod mailbox;
pub mod options;
pub mod parse;
pub mod producer;
pub mod proto;
pub mod rotation;
pub mod schema;
pub mod shm;
pub mod stand_in;
pub mod stats_client;
pub mod synthetic;
mod transport;

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
