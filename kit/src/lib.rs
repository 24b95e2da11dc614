//! What batchcast's command line, benchmarks and end-to-end tests share,
//! apart from the broker's library (which knows none of it):
//!
//! * [`harness`]: starting and watching real broker and consumer processes.
//! * [`child`]: children that die with their parent (this crate's one
//!   `unsafe` block, a `pre_exec` hook).
//! * [`procstat`]: CPU time and memory from `/proc`.
//! * [`report`]: the files the command line writes (`consume`'s report and
//!   state file, `launch`'s `summary.json`), one definition for the writer
//!   and its readers.
//! * [`StreamToml`]: a broker's `[[stream]]` tables, written for a test.
//! * [`demo_data`]: the demo's image dataset, generated on first use.

pub mod child;
pub mod demo_data;
pub mod harness;
pub mod procstat;
pub mod report;
mod stream_toml;

pub use stream_toml::{StreamToml, image_stream_toml};
