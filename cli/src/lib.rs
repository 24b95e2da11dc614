//! What the `batchcast` binary's subcommands share with the benchmarks and
//! the end-to-end tests that run it (the binary itself is `main.rs`):
//!
//! * [`harness`]: starting and watching real broker and consumer processes
//!   (`launch` starts its brokers so; the tests and benchmarks theirs).
//! * [`child`]: children that die with their parent (this library's one
//!   `unsafe` block, a `pre_exec` hook).
//! * [`procstat`]: CPU time and memory from `/proc`.
//! * [`report`]: the files the command line writes (`consume`'s report and
//!   state file, `launch`'s `summary.json`), one definition for the writer
//!   and its readers.
//! * [`demo_data`]: the demo's image dataset, generated on first use.
//!
//! A broker's `[[stream]]` tables written for a run are the broker
//! library's `config::StreamToml`.

pub mod child;
pub mod demo_data;
pub mod harness;
pub mod procstat;
pub mod report;
