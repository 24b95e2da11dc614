//! batchcast's core: what the broker and its clients must agree on, byte
//! for byte, and nothing else. The wire protocol ([`proto`]: messages,
//! frames, the preamble), a stream's schema and the layout of its slots
//! and rings ([`schema`]), the synthetic data both sides generate
//! ([`synthetic`]), the orders a consumer reads an epoch in ([`rotation`],
//! [`deal`]) and the names they parse ([`dtype`], [`parse`]); a mailbox's
//! shared memory word by word ([`mailbox`]), viewed there only as a
//! [`shared::Shared`] type.
//!
//! No sockets, threads, mappings or clocks beyond reading one: the client
//! library (`batchcast`) and the broker (`batchcast-broker`) build on it,
//! and the pixel pipeline (`batchcast-pixels`) needs only this.

pub mod deal;
pub mod dtype;
pub mod error;
pub mod mailbox;
pub mod parse;
pub mod proto;
pub mod rotation;
pub mod schema;
pub mod shared;
pub mod synthetic;

pub use dtype::DType;
pub use error::{ErrorCode, Result, WireError};
