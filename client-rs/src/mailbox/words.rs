//! Where a mailbox's words live, and the only place its atomics, fences,
//! spins and futex calls come from ([`Memory`]). The mailbox's protocol
//! (`super`) is written once over this trait; the real memory is the
//! shared memfd ([`Shm`]: its header and rings viewed as the core's
//! `#[repr(C)]` layout through [`Mapping::view`], and the futex calls,
//! the only `unsafe` of the mailbox), and the tests put the same protocol on
//! loom's model of atomics (`super::loom_tests`), which tries every
//! interleaving and weak-memory outcome of the handshakes the module's
//! notes describe.
//!
//! The accessors are `#[inline]`: the mailbox's generic code is
//! instantiated in the broker's crate, which without them calls each
//! word's accessor across crates (measured: broker CPU per batch +11 % at
//! 8 consumers in the fan-out benchmark).

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use batchcast_core::mailbox::{HEADER_BYTES, Header, SharedHeader};

#[cfg(any(test, feature = "broker"))]
use crate::shm::Arena;
use crate::shm::Mapping;

/// A 64-bit word of a mailbox, accessed only atomically.
pub trait Word64 {
    fn load(&self, order: Ordering) -> u64;
    fn store(&self, value: u64, order: Ordering);
}

/// A 32-bit word of a mailbox (the futex word and the flags).
pub trait Word32 {
    fn load(&self, order: Ordering) -> u32;
    fn store(&self, value: u32, order: Ordering);
    fn fetch_add(&self, value: u32, order: Ordering) -> u32;
}

/// A mailbox's memory: its header and its rings (the layout's,
/// [`batchcast_core::mailbox`]), and how a side fences, spins, sleeps on a
/// word and wakes a sleeper.
pub trait Memory: fmt::Debug + Send + Sync {
    type W64: Word64;
    type W32: Word32;
    fn header(&self) -> &Header<Self::W64, Self::W32>;
    /// The words after the header: the notice ring's, then the release
    /// ring's ([`MailboxSpec::ring_words`](crate::proto::MailboxSpec::ring_words)).
    fn rings(&self) -> &[Self::W64];
    fn fence(&self, order: Ordering);
    /// The store half of a Dekker handshake: stores `value` (with release
    /// ordering), ordered before this side's next [`Memory::sc_load`] as
    /// if by a `SeqCst` fence between them, so that of two sides that each
    /// store, then load the other's word, at least one sees the other's
    /// store.
    fn sc_store(&self, word: &Self::W64, value: u64);
    /// The load half of a Dekker handshake (see [`Memory::sc_store`]),
    /// with acquire ordering.
    fn sc_load(&self, word: &Self::W64) -> u64;
    /// A pause in a wait for the other side (a spin-loop hint).
    fn spin(&self);
    /// Sleeps while `word` reads `expected`, up to `timeout`; may return
    /// early for no reason (callers re-check).
    fn wait(&self, word: &Self::W32, expected: u32, timeout: Duration);
    /// Wakes every side sleeping on `word`.
    fn wake(&self, word: &Self::W32);
}

impl Word64 for AtomicU64 {
    #[inline]
    fn load(&self, order: Ordering) -> u64 {
        AtomicU64::load(self, order)
    }
    #[inline]
    fn store(&self, value: u64, order: Ordering) {
        AtomicU64::store(self, value, order)
    }
}

impl Word32 for AtomicU32 {
    #[inline]
    fn load(&self, order: Ordering) -> u32 {
        AtomicU32::load(self, order)
    }
    #[inline]
    fn store(&self, value: u32, order: Ordering) {
        AtomicU32::store(self, value, order)
    }
    #[inline]
    fn fetch_add(&self, value: u32, order: Ordering) -> u32 {
        AtomicU32::fetch_add(self, value, order)
    }
}

/// The shared memfd: the broker owns it, a consumer maps the fd it was
/// sent.
#[derive(Debug)]
pub enum Shm {
    #[cfg(any(test, feature = "broker"))]
    Owner(Arena),
    Mapped(Mapping),
}

impl Shm {
    #[inline]
    fn map(&self) -> &Mapping {
        match self {
            #[cfg(any(test, feature = "broker"))]
            Shm::Owner(a) => a.mapping(),
            Shm::Mapped(m) => m,
        }
    }
}

impl Memory for Shm {
    type W64 = AtomicU64;
    type W32 = AtomicU32;

    #[inline]
    fn header(&self) -> &SharedHeader {
        self.map().view(0)
    }

    #[inline]
    fn rings(&self) -> &[AtomicU64] {
        let m = self.map();
        m.view_slice(HEADER_BYTES, (m.len() - HEADER_BYTES) / 8)
    }

    #[inline]
    fn fence(&self, order: Ordering) {
        std::sync::atomic::fence(order)
    }

    #[inline]
    fn spin(&self) {
        std::hint::spin_loop()
    }

    // `SeqCst` accesses on both sides (all in one total order): on x86 a
    // locked exchange and a plain load, cheaper than a store and an
    // `mfence` on the consumer's path, which takes every notice this way.
    #[inline]
    fn sc_store(&self, word: &AtomicU64, value: u64) {
        word.store(value, Ordering::SeqCst)
    }

    #[inline]
    fn sc_load(&self, word: &AtomicU64) -> u64 {
        word.load(Ordering::SeqCst)
    }

    fn wait(&self, word: &AtomicU32, expected: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: FUTEX_WAIT only reads the aligned u32 at `word` (live for
        // the call: borrowed) and the timespec on our stack; a shared
        // (non-private) futex, because the other side is another process.
        // Spurious returns (EINTR, EAGAIN, ETIMEDOUT) are fine: callers
        // re-check.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                expected,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0,
            );
        }
    }

    fn wake(&self, word: &AtomicU32) {
        // SAFETY: FUTEX_WAKE reads nothing behind the pointer beyond using
        // its address as the key; the word is borrowed and live.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0,
            );
        }
    }
}
