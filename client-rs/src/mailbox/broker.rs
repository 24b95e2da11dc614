//! The broker's side of a mailbox: writing notices, taking batches back
//! (a cut), draining releases, ringing the bell. Only the broker builds
//! it (the `broker` feature, and this crate's tests, which run both
//! sides).

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use batchcast_core::mailbox::{CUT_FROM_BITS, CUT_UNDER_WAY, RELEASE_WORDS, unit_of};

use super::{Memory, Notice, Shm, Totals, Word32, Word64, Words};
use crate::error::Result;
use crate::proto::{self, MailboxSpec, Unit};
use crate::shm::Arena;

impl<M: Memory> Words<M> {
    /// Wakes the consumer if it sleeps; cheap when it does not (a load of
    /// a line that changes only when it goes to sleep). The broker clears
    /// `sleeping` for it: one wake per sleep.
    fn ring(&self) -> bool {
        self.mem.fence(Ordering::SeqCst);
        let sleeping = &*self.header().sleeping;
        if sleeping.load(Ordering::Relaxed) == 0 {
            return false;
        }
        sleeping.store(0, Ordering::Relaxed);
        self.bell().fetch_add(1, Ordering::SeqCst);
        self.mem.wake(self.bell());
        true
    }
}

/// The broker's side of a mailbox.
#[derive(Debug)]
pub struct BrokerMailbox<M: Memory = Shm> {
    pub(super) words: Arc<Words<M>>,
    /// Notices written, the consumer's `tail` as last read, releases taken.
    head: u64,
    tail: u64,
    drained: u64,
    want: bool,
    /// The notice index and unit of each batch noticed at or after
    /// `tail`: what the consumer may not have read. At most the ring's
    /// capacity.
    units: VecDeque<(u64, Unit)>,
    /// The notices the last cut took back: `[from, to)`.
    cut: (u64, u64),
}

/// A consumer's mailbox broke the protocol; that consumer is ended.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MailboxError {
    #[error(
        "its mailbox is full: {unread} notices unread of {capacity} (the consumer does not read them)"
    )]
    Full { unread: u64, capacity: u32 },
    #[error(
        "its mailbox says {released} releases were written, but {drained} were taken and the ring holds {capacity}"
    )]
    BadReleaseCount {
        released: u64,
        drained: u64,
        capacity: u32,
    },
    #[error(
        "its mailbox's release number {at} is of kind {kind}, which no client writes (1 is a shared batch, 2 a replayed one)"
    )]
    BadReleaseKind { at: u64, kind: u64 },
}

impl BrokerMailbox {
    pub fn create(spec: MailboxSpec) -> Result<BrokerMailbox> {
        spec.validate()?;
        // Sealed against resizing: a consumer cannot make the broker fault.
        let arena = Arena::create("mailbox", spec.bytes(), crate::shm::Fault::Now)?;
        Ok(BrokerMailbox::in_memory(Arc::new(Words {
            mem: Shm::Owner(arena),
            spec,
        })))
    }

    /// The fd to hand to the consumer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        match &self.words.mem {
            Shm::Owner(a) => a.fd(),
            Shm::Mapped(_) => unreachable!("the broker's side owns its memfd"),
        }
    }
}

impl<M: Memory> BrokerMailbox<M> {
    pub(super) fn in_memory(words: Arc<Words<M>>) -> BrokerMailbox<M> {
        BrokerMailbox {
            words,
            head: 0,
            tail: 0,
            drained: 0,
            want: false,
            units: VecDeque::new(),
            cut: (0, 0),
        }
    }

    pub fn spec(&self) -> MailboxSpec {
        self.words.spec
    }

    /// Wakes the consumer if it sleeps: call after a run of pushes.
    pub fn ring(&self) -> bool {
        self.words.ring()
    }

    /// A handle that rings this mailbox's bell from another thread.
    pub fn bell(&self) -> Bell<M> {
        Bell(self.words.clone())
    }

    /// Writes one notice (see [`ring`](Self::ring)).
    pub fn push(&mut self, notice: &Notice) -> std::result::Result<(), MailboxError> {
        let cap = self.words.spec.notices as u64;
        if self.head.wrapping_sub(self.tail) >= cap {
            self.tail = self.words.header().tail.load(Ordering::Acquire);
            self.forget_read();
            let unread = self.head.wrapping_sub(self.tail);
            if unread >= cap {
                return Err(MailboxError::Full {
                    unread,
                    capacity: self.words.spec.notices,
                });
            }
        }
        let w = &self.words;
        let words = notice.to_words();
        let record = w.notice(self.head);
        for (word, v) in record[1..].iter().zip(words) {
            word.store(v, Ordering::Relaxed);
        }
        record[0].store(self.head + 1, Ordering::Release);
        if let Some(unit) = notice.unit() {
            self.units.push_back((self.head, unit));
        }
        self.head += 1;
        Ok(())
    }

    /// Takes back the shared batches noticed and not yet taken by the
    /// consumer (see the module's notes), and returns their seqs: the
    /// consumer will never read them. Replayed batches are not taken back.
    /// `None` if the notice count outgrew the word (never, in practice).
    pub fn cut(&mut self) -> Option<Vec<u64>> {
        let w = &self.words;
        if self.head + 2 >= 1 << CUT_FROM_BITS {
            return None;
        }
        // A Dekker handshake with the consumer's store of `tail` and read
        // of `cut` (see the module's notes).
        let h = w.header();
        w.mem.sc_store(&h.broker.cut, CUT_UNDER_WAY);
        // A tail past what was written is forged: nothing is unread.
        let tail = w.mem.sc_load(&h.tail).min(self.head);
        // The word replaces the last cut's, so it must still cover what
        // that one took back and the consumer may yet check: the notices
        // from `tail` on, and the one before it (a consumer checks notice
        // `n` after storing `tail = n + 1`, so that check may still be
        // under way; the ones before it are done, since their check came
        // before the store of the `tail` read here). Found by loom
        // (`loom_tests`): with `tail < self.cut.1` a consumer stopped
        // between storing `tail` and reading `cut` took a batch the last
        // cut had given back.
        let from = if tail <= self.cut.1 { self.cut.0 } else { tail };
        self.cut = (from, self.head);
        h.broker.cut.store(
            ((self.head - from) << CUT_FROM_BITS) | (from + 2),
            Ordering::Release,
        );
        self.tail = self.tail.max(tail);
        self.forget_read();
        let mut revoked = Vec::new();
        self.units.retain(|&(n, unit)| match unit {
            Unit::Shared(seq) if n >= tail => {
                revoked.push(seq);
                false
            }
            _ => true,
        });
        Some(revoked)
    }

    /// Drops the record of units noticed before `tail`.
    fn forget_read(&mut self) {
        while self.units.front().is_some_and(|&(n, _)| n < self.tail) {
            self.units.pop_front();
        }
    }

    /// The units noticed and not read by the consumer's `tail`: what a
    /// consumer that said goodbye will never give back itself. A forged
    /// `tail` harms only that consumer (units it holds given back, or units
    /// kept until it leaves).
    pub fn unread_units(&mut self) -> Vec<Unit> {
        self.unread().collect()
    }

    /// Whether `unit` is noticed and not read by the consumer's `tail`
    /// ([`unread_units`](Self::unread_units), asked without a list).
    pub fn is_unread(&mut self, unit: Unit) -> bool {
        self.unread().any(|u| u == unit)
    }

    /// How many shared batches are noticed and not read by the consumer's
    /// `tail` ([`unread_units`](Self::unread_units)' shared ones, counted
    /// without a list: asked of every consumer whenever the pipeline
    /// waits for a slot).
    pub fn unread_shared(&mut self) -> usize {
        self.unread()
            .filter(|u| matches!(u, Unit::Shared(_)))
            .count()
    }

    /// The units noticed and not read by the consumer's `tail` as it reads
    /// now (none for a `tail` past what was written: forged).
    fn unread(&mut self) -> impl Iterator<Item = Unit> + '_ {
        let tail = self.words.header().tail.load(Ordering::Acquire);
        let forged = tail > self.head;
        if !forged {
            self.tail = self.tail.max(tail);
            self.forget_read();
        }
        self.units
            .iter()
            .filter(move |_| !forged)
            .map(|&(_, unit)| unit)
    }

    /// Asks the consumer to send a doorbell after each release (`true`), or
    /// to stop. Stores only when the wish changes; returns whether it rose.
    /// After raising it, [`drain`](Self::drain) once more after a `SeqCst`
    /// fence: a release written just before the consumer saw the wish would
    /// otherwise go unnoticed.
    pub fn set_want(&mut self, want: bool) -> bool {
        if want == self.want {
            return false;
        }
        self.want = want;
        self.words
            .header()
            .broker
            .want
            .store(want as u32, Ordering::SeqCst);
        want
    }

    /// What the consumer says its program has taken so far (its own
    /// figures, for `stats`: any value is taken as written).
    pub fn taken(&self) -> proto::Taken {
        let c = &self.words.header().consumer;
        proto::Taken {
            batches: c.taken_batches.load(Ordering::Relaxed),
            samples: c.taken_samples.load(Ordering::Relaxed),
            epoch: c.taken_epoch.load(Ordering::Relaxed),
        }
    }

    /// Hands the unit of every release the consumer has written to
    /// `take`, in order, and returns how many there were with the
    /// consumer's running totals. An impossible count, or a record of no
    /// kind a client writes, is an error (the records before it were
    /// taken).
    pub fn drain(
        &mut self,
        mut take: impl FnMut(Unit),
    ) -> std::result::Result<(usize, Totals), MailboxError> {
        let w = &self.words;
        let h = w.header();
        let released = h.consumer.released.load(Ordering::Acquire);
        let new = released.wrapping_sub(self.drained);
        if new > w.spec.releases as u64 {
            return Err(MailboxError::BadReleaseCount {
                released,
                drained: self.drained,
                capacity: w.spec.releases,
            });
        }
        let totals = Totals {
            wait_ns: h.consumer.wait_total.load(Ordering::Relaxed),
            busy_ns: h.consumer.busy_total.load(Ordering::Relaxed),
            hold_ns: h.consumer.hold_total.load(Ordering::Relaxed),
        };
        let mut bad = None;
        for _ in 0..new {
            let n = self.drained;
            let record: [u64; RELEASE_WORDS] = w
                .release(n)
                .each_ref()
                .map(|word| word.load(Ordering::Relaxed));
            self.drained += 1;
            match unit_of(record) {
                Some(unit) => take(unit),
                None => {
                    bad = Some(MailboxError::BadReleaseKind {
                        at: n,
                        kind: record[0],
                    });
                    break;
                }
            }
        }
        if new > 0 {
            h.broker.drained.store(self.drained, Ordering::Release);
        }
        match bad {
            Some(e) => Err(e),
            None => Ok((new as usize, totals)),
        }
    }
}

/// Rings a mailbox's bell from another thread (the connection's task,
/// after writing to the socket).
#[derive(Debug)]
pub struct Bell<M: Memory = Shm>(Arc<Words<M>>);

impl<M: Memory> Clone for Bell<M> {
    fn clone(&self) -> Self {
        Bell(self.0.clone())
    }
}

impl<M: Memory> Bell<M> {
    /// Returns whether the consumer was asleep (and was woken).
    pub fn ring(&self) -> bool {
        self.0.ring()
    }
}
