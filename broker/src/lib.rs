//! The batchcast broker: runs the input pipeline once per host and shares
//! every batch with all subscribed consumers through shared memory.
//!
//! # Layout
//!
//! The core, in the order a batch's life runs through it:
//!
//! * [`config`]: the TOML config (serde types only).
//! * [`plan`]: config or producer request to a stream's plan, every key
//!   checked.
//! * [`pipeline`]: the native pipeline: read, decode, transform, collate.
//! * [`remote`]: datasets in object stores and on HTTP servers: requests,
//!   read-ahead, the disk cache.
//! * `hub`: slots, reference counts, windows and epochs: pure logic.
//! * [`stream`]: one stream at run time: arena, hub, pipeline threads.
//! * [`server`]: the tokio server, one task per connection, and the
//!   `/metrics` endpoint ([`server::metrics`]).
//! * [`listen`], [`budget`], [`gpu`]: the socket and who is admitted, the
//!   memory budget, device arenas and copiers.
//! * [`make`]: a configured stream's batches made away from any broker
//!   (`batchcast make`, for a cluster's CPU nodes).
//!
//! The command line (`batchcast serve`, `consume`, `demo`, `launch`,
//! `stats`, ...) is the crate `batchcast-cli` (`cli/`), over this library;
//! what it shares with the benchmarks and tests (starting real processes,
//! the reports it writes) is the `batchcast-kit` crate. This library knows
//! neither (its tests use the kit).

pub mod budget;
pub mod config;
pub mod gpu;
pub(crate) mod hub;
pub mod listen;
pub mod make;
pub mod pipeline;
pub mod plan;
pub mod remote;
pub mod server;
pub mod stream;
pub mod systemd;

pub use server::metrics;
