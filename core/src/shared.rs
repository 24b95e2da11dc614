//! Memory that two processes map: what may be viewed in it.
//!
//! A type is viewed in shared memory only through [`Shared`]: the one
//! place that turns an offset of a mapping into a reference
//! (`batchcast::shm::Mapping::view`) asks for it, so no code casts a
//! pointer at an offset of its own. The layouts themselves are
//! `#[repr(C)]` types whose offsets are checked when this crate compiles
//! (`crate::mailbox::Header`).

use std::sync::atomic::{AtomicU32, AtomicU64};

/// A type that may be viewed, through a shared reference, in memory
/// another process maps and writes.
///
/// # Safety
///
/// An implementor is a primitive or `#[repr(C)]` of implementors (its
/// layout is fixed); every bit pattern of its size is a valid value (the
/// other process may write anything); it is changed only through atomics,
/// which both sides use for every access (so a write by the other side is
/// not a data race); and its alignment is at most a page's (a mapping's
/// start is page-aligned).
pub unsafe trait Shared: Sync {}

// SAFETY: an atomic integer: any bits are a value, every access atomic,
// 8-byte aligned.
unsafe impl Shared for AtomicU64 {}
// SAFETY: as for `AtomicU64`, 4-byte aligned.
unsafe impl Shared for AtomicU32 {}
// SAFETY: `#[repr(C)]` (with `Line`'s `align(64)`) of atomics only, which
// are `Shared`: any bits are a value, every access is atomic; aligned to
// 64 bytes, less than a page. Its offsets are checked as this crate
// compiles (`crate::mailbox`).
unsafe impl Shared for crate::mailbox::SharedHeader {}
