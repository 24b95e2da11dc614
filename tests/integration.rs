//! Every integration test in one binary: one build of `common` and one
//! link instead of one per file, and the files' tests scheduled together.
//! A file's tests are its module's: `cargo test --test integration
//! decoupled::` runs those of `decoupled.rs`.

mod common;

mod augment;
mod batch_sizes;
mod config_doc;
mod decoupled;
mod device;
mod e2e;
mod feed;
mod groups;
mod hostile;
mod images;
mod launch;
mod pause;
mod producer;
mod remote;
mod replay;
mod restart;
mod shared_sources;
mod state;
mod systemd;
mod versions;
