//! The batchcast broker: runs the input pipeline once per host and shares
//! every batch with all subscribed consumers through shared memory.
//!
//! # Layout
//!
//! * [`config`]: the TOML config and its validation.
//! * [`hub`]: slots, reference counts, windows and epochs: pure logic.
//! * [`stream`]: one stream at run time: arena, hub, pipeline threads.
//! * [`listen`]: the Unix socket, stale-socket handling, who is admitted.
//! * [`server`]: the tokio server, one task per connection.
//! * [`consume`], [`demo`], [`stats_view`]: the CLI's consumer, demo and
//!   stats table.
//! * [`harness`]: starting real broker and consumer processes (demo,
//!   benchmarks, end-to-end tests).

pub mod budget;
pub mod child;
pub mod config;
pub mod consume;
pub mod demo;
pub mod demo_images;
pub mod gpu;
pub mod harness;
pub mod hub;
pub mod launch;
pub mod listen;
pub mod metrics;
pub mod pipeline;
pub mod plan;
pub mod procstat;
pub mod server;
pub mod stats_view;
pub mod stream;
