//! The mailbox: a consumer's notices and releases in shared memory instead
//! of on the socket. One memfd per host consumer, shared by the broker and
//! that consumer only; the socket stays for the handshake, errors, goodbyes
//! and wake-ups.
//!
//! Why: on the socket every delivery costs the broker a write that wakes
//! the consumer and a read of its release (about 5 µs of broker CPU here),
//! so broker CPU per batch grew with the number of consumers. Through the
//! mailbox a delivery is a few stores and loads of shared cache lines; a
//! system call is made only for a consumer that went to sleep (a futex
//! wake) or for a broker that waits on a release (a doorbell on the socket).
//!
//! Layout (all words little-endian, accessed only as atomics; each group
//! on its own cache line, so that a word one side polls is not written
//! by the other more often than it must be):
//!
//! | offset | written by | words |
//! |---:|---|---|
//! | 0 | broker | `bell` (u32 futex word, bumped to wake a sleeper), `want` (u32: 1 = send [`ClientMsg::Doorbell`](crate::proto::ClientMsg) after releasing), `drained` (u64: release records taken), `cut` (u64: the batch notices last taken back, see below) |
//! | 64 | consumer | `sleeping` (u32: 1 = waiting on `bell`) |
//! | 128 | consumer | `tail` (u64: notices read) |
//! | 192 | consumer | `released` (u64: release records written), then running totals of wait, busy and hold ns, then what its program has taken ([`Taken`](crate::proto::Taken): batches, samples, the last one's epoch) |
//! | 256 | broker | notice ring: records of 8 words, the first a stamp (the notice's number + 1) written last |
//! | … | consumer | release ring: two words per release, the unit's kind (1 shared, 2 replayed) and its seq |
//!
//! A notice costs the broker one cache line (the stamp publishes it; there
//! is no separate head counter to bounce), and it reads the consumer's
//! lines only when its ring looks full, when it wants releases, and to see
//! whether the consumer sleeps (a line that changes only when it does).
//!
//! Trust: the broker acts only on `tail`, `released`, `sleeping` and the
//! release records, and checks every one (a release is checked by the hub
//! like one from the socket; a counter out of range is a protocol error
//! that ends this consumer only). The totals and the taken counts are
//! only shown in `stats`, as the consumer's own figures. The memfd is sealed against resizing, so
//! a consumer cannot make the broker fault. What a consumer writes can harm
//! only itself.
//!
//! Taking notices back (decoupled pace: a consumer that fell behind is cut
//! from the shared stream and goes on from replay). The broker may take
//! back only the batches the consumer has not taken. Both sides store,
//! then read the other's word, a Dekker handshake (`Memory::sc_store` and
//! `sc_load`: `SeqCst` accesses, so at least one sees the other): the
//! consumer stores `tail` past a notice, then reads `cut`; the
//! broker stores `cut = 1` (under way), reads `tail` as `T`, then stores
//! the range `[T, head)` in `cut`. A batch notice at `i` is taken back iff
//! `T <= i < head` in the range the consumer reads after taking it (it
//! waits while `cut` reads 1): the broker then gives back exactly the
//! batches noticed at or after the `tail` it read, and the consumer drops
//! exactly those. The range is one word (`T + 2` in the low 47 bits, its
//! length above), so it is never read half old, half new.
//!
//! Lost wake-ups are ruled out by the same pattern on both sides: a side
//! that is about to wait first publishes that (`sleeping`, `want`), then a
//! `SeqCst` fence, then looks once more; a side that publishes work first
//! stores it, then a `SeqCst` fence, then reads the other's flag.

use std::collections::VecDeque;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::proto::{self, BatchReady, EpochEnd, MailboxSpec, Position, ReplayReady, Unit};
use crate::shm::Arena;

mod consumer;
#[cfg(test)]
mod loom_tests;
mod words;

pub use consumer::ConsumerMailbox;
pub use words::{Memory, Shm, Word32, Word64};

const BELL: usize = 0;
const WANT: usize = 4;
const DRAINED: usize = 8;
const CUT: usize = 16;
const SLEEPING: usize = 64;
const TAIL: usize = 128;
const RELEASED: usize = 192;
const WAIT_TOTAL: usize = 200;
const BUSY_TOTAL: usize = 208;
const HOLD_TOTAL: usize = 216;
const TAKEN_BATCHES: usize = 224;
const TAKEN_SAMPLES: usize = 232;
const TAKEN_EPOCH: usize = 240;
const NOTICES: usize = 256;
const NOTICE_WORDS: usize = 8;
/// Largest ring either side accepts.
const MAX_RECORDS: u32 = 1 << 16;

/// Words of a release record: the unit's kind, then its seq.
const RELEASE_WORDS: usize = 2;
/// A release record's kind word.
const RELEASE_SHARED: u64 = 1;
const RELEASE_REPLAYED: u64 = 2;

/// The release record for `unit`: its kind and its seq, each a word of
/// its own (a seq is any u64; nothing in it marks its kind).
pub(crate) fn record_of(unit: Unit) -> [u64; RELEASE_WORDS] {
    match unit {
        Unit::Shared(seq) => [RELEASE_SHARED, seq],
        Unit::Replayed(seq) => [RELEASE_REPLAYED, seq],
    }
}

/// The unit a release record names; `None` for a kind no client writes.
pub(crate) fn unit_of([kind, seq]: [u64; RELEASE_WORDS]) -> Option<Unit> {
    match kind {
        RELEASE_SHARED => Some(Unit::Shared(seq)),
        RELEASE_REPLAYED => Some(Unit::Replayed(seq)),
        _ => None,
    }
}

const KIND_BATCH: u64 = 1;
const KIND_EPOCH_END: u64 = 2;
const KIND_END_OF_STREAM: u64 = 3;
const KIND_REPLAY: u64 = 4;
const KIND_CUT: u64 = 5;
const KIND_MERGE: u64 = 6;
const KIND_ROTATE: u64 = 7;

/// `cut` while the broker takes notices back.
const CUT_UNDER_WAY: u64 = 1;
/// Bits of `cut` holding the first notice taken back, plus 2.
const CUT_FROM_BITS: u32 = 47;
/// Longest a consumer waits for a cut under way to be written.
const CUT_WAIT: Duration = Duration::from_secs(1);

impl MailboxSpec {
    /// Most batches a mailbox can be sized for.
    pub const MAX_BATCHES: u32 = MAX_RECORDS / 4;

    /// Rings for a consumer that may owe `batches` batches at once (the
    /// broker sends a mailbox consumer every batch of the stream's slots as
    /// it is published). Unread notices are at most that many batches, one
    /// end-of-epoch per batch and the end of stream; untaken releases at
    /// most that many. Clamped to [`MailboxSpec::MAX_BATCHES`].
    pub fn for_batches(batches: u32) -> MailboxSpec {
        let w = batches.clamp(1, Self::MAX_BATCHES);
        MailboxSpec {
            notices: (2 * w + 4).next_power_of_two().max(8),
            releases: w.next_power_of_two().max(8),
        }
    }

    /// Bytes of the shared memory.
    pub fn bytes(&self) -> u64 {
        self.releases_at() as u64 + self.releases as u64 * (RELEASE_WORDS * 8) as u64
    }

    fn releases_at(&self) -> usize {
        NOTICES + self.notices as usize * NOTICE_WORDS * 8
    }

    /// A broker's spec, checked before anything is mapped.
    pub fn validate(&self) -> Result<()> {
        for (what, n) in [("notice", self.notices), ("release", self.releases)] {
            if !n.is_power_of_two() || n > MAX_RECORDS {
                return Err(Error::Unexpected(format!(
                    "the broker's mailbox has a {what} ring of {n} records (must be a power of two up to {MAX_RECORDS})"
                )));
            }
        }
        Ok(())
    }
}

/// What the broker tells a consumer through its mailbox, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    Batch(BatchReady),
    EndOfEpoch(EpochEnd),
    EndOfStream,
    Replay(ReplayReady),
    /// See [`crate::proto::ServerMsg::Cut`].
    Cut(Position),
    /// See [`crate::proto::ServerMsg::Merge`].
    Merge(Position),
    /// See [`crate::proto::ServerMsg::Rotate`].
    Rotate(Position),
}

/// A consumer's running totals over its mailbox releases (ns), for stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub wait_ns: u64,
    pub busy_ns: u64,
    pub hold_ns: u64,
}

impl Totals {
    pub fn add(&mut self, o: Totals) {
        self.wait_ns = self.wait_ns.wrapping_add(o.wait_ns);
        self.busy_ns = self.busy_ns.wrapping_add(o.busy_ns);
        self.hold_ns = self.hold_ns.wrapping_add(o.hold_ns);
    }
}

/// A mailbox's memory and the word accessors both sides use.
#[derive(Debug)]
struct Words<M: Memory> {
    mem: M,
    spec: MailboxSpec,
}

impl<M: Memory> Words<M> {
    fn u64(&self, offset: usize) -> &M::W64 {
        self.mem.u64(offset)
    }

    fn u32(&self, offset: usize) -> &M::W32 {
        self.mem.u32(offset)
    }

    /// Word `word` of the ring entry that notice number `n` uses.
    fn notice(&self, n: u64, word: usize) -> &M::W64 {
        let i = (n % self.spec.notices as u64) as usize;
        self.u64(NOTICES + (i * NOTICE_WORDS + word) * 8)
    }

    /// Word `word` of the ring entry that release number `n` uses.
    fn release(&self, n: u64, word: usize) -> &M::W64 {
        let i = (n % self.spec.releases as u64) as usize;
        self.u64(self.spec.releases_at() + (i * RELEASE_WORDS + word) * 8)
    }

    fn bell(&self) -> &M::W32 {
        self.u32(BELL)
    }

    /// Wakes the consumer if it sleeps; cheap when it does not (a load of
    /// a line that changes only when it goes to sleep). The broker clears
    /// `sleeping` for it: one wake per sleep.
    fn ring(&self) -> bool {
        self.mem.fence(Ordering::SeqCst);
        if self.u32(SLEEPING).load(Ordering::Relaxed) == 0 {
            return false;
        }
        self.u32(SLEEPING).store(0, Ordering::Relaxed);
        self.bell().fetch_add(1, Ordering::SeqCst);
        self.mem.wake(self.bell());
        true
    }
}

/// The broker's side of a mailbox.
#[derive(Debug)]
pub struct BrokerMailbox<M: Memory = Shm> {
    words: Arc<Words<M>>,
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
    fn in_memory(words: Arc<Words<M>>) -> BrokerMailbox<M> {
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
            self.tail = self.words.u64(TAIL).load(Ordering::Acquire);
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
        let words: [u64; NOTICE_WORDS - 1] = match *notice {
            Notice::Batch(b) => [
                KIND_BATCH,
                b.seq,
                b.epoch,
                b.index,
                b.slot as u64,
                b.samples,
                b.sent_ns,
            ],
            Notice::EndOfEpoch(e) => [
                KIND_EPOCH_END,
                e.epoch,
                e.batches,
                e.complete as u64,
                0,
                0,
                0,
            ],
            Notice::EndOfStream => [KIND_END_OF_STREAM, 0, 0, 0, 0, 0, 0],
            Notice::Replay(r) => [
                KIND_REPLAY,
                r.seq,
                r.epoch,
                r.first,
                r.samples,
                r.ends_epoch as u64,
                0,
            ],
            Notice::Cut(p) => [KIND_CUT, p.epoch, p.sample, 0, 0, 0, 0],
            Notice::Merge(p) => [KIND_MERGE, p.epoch, p.sample, 0, 0, 0, 0],
            Notice::Rotate(p) => [KIND_ROTATE, p.epoch, p.sample, 0, 0, 0, 0],
        };
        for (i, v) in words.into_iter().enumerate() {
            w.notice(self.head, i + 1).store(v, Ordering::Relaxed);
        }
        w.notice(self.head, 0)
            .store(self.head + 1, Ordering::Release);
        match *notice {
            Notice::Batch(b) => self.units.push_back((self.head, Unit::Shared(b.seq))),
            Notice::Replay(r) => self.units.push_back((self.head, Unit::Replayed(r.seq))),
            Notice::EndOfEpoch(_)
            | Notice::EndOfStream
            | Notice::Cut(_)
            | Notice::Merge(_)
            | Notice::Rotate(_) => {}
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
        w.mem.sc_store(w.u64(CUT), CUT_UNDER_WAY);
        // A tail past what was written is forged: nothing is unread.
        let tail = w.mem.sc_load(w.u64(TAIL)).min(self.head);
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
        w.u64(CUT).store(
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
        let tail = self.words.u64(TAIL).load(Ordering::Acquire);
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
        self.words.u32(WANT).store(want as u32, Ordering::SeqCst);
        want
    }

    /// What the consumer says its program has taken so far (its own
    /// figures, for `stats`: any value is taken as written).
    pub fn taken(&self) -> proto::Taken {
        let w = &self.words;
        proto::Taken {
            batches: w.u64(TAKEN_BATCHES).load(Ordering::Relaxed),
            samples: w.u64(TAKEN_SAMPLES).load(Ordering::Relaxed),
            epoch: w.u64(TAKEN_EPOCH).load(Ordering::Relaxed),
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
        let released = w.u64(RELEASED).load(Ordering::Acquire);
        let new = released.wrapping_sub(self.drained);
        if new > w.spec.releases as u64 {
            return Err(MailboxError::BadReleaseCount {
                released,
                drained: self.drained,
                capacity: w.spec.releases,
            });
        }
        let totals = Totals {
            wait_ns: w.u64(WAIT_TOTAL).load(Ordering::Relaxed),
            busy_ns: w.u64(BUSY_TOTAL).load(Ordering::Relaxed),
            hold_ns: w.u64(HOLD_TOTAL).load(Ordering::Relaxed),
        };
        let mut bad = None;
        for _ in 0..new {
            let n = self.drained;
            let record: [u64; RELEASE_WORDS] =
                std::array::from_fn(|word| w.release(n, word).load(Ordering::Relaxed));
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
            w.u64(DRAINED).store(self.drained, Ordering::Release);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn pair(window: u32) -> (BrokerMailbox, ConsumerMailbox) {
        let b = BrokerMailbox::create(MailboxSpec::for_batches(window)).unwrap();
        let c = ConsumerMailbox::open(b.fd(), b.spec()).unwrap();
        (b, c)
    }

    fn batch(seq: u64) -> Notice {
        Notice::Batch(BatchReady {
            seq,
            epoch: seq / 10,
            index: seq % 10,
            slot: (seq % 4) as u32,
            samples: 64,
            sent_ns: 1000 + seq,
        })
    }

    fn t(wait_ns: u64) -> Totals {
        Totals {
            wait_ns,
            busy_ns: 2 * wait_ns,
            hold_ns: 3 * wait_ns,
        }
    }

    #[test]
    fn the_broker_knows_which_units_were_noticed_and_not_read() {
        let (mut b, c) = pair(2);
        let cap = b.spec().notices as u64;
        // Wraps the ring several times, so records of read units are
        // forgotten as the broker learns of reads.
        for seq in 0..3 * cap {
            b.push(&batch(seq)).unwrap();
            assert_eq!(c.pop().unwrap(), Some(batch(seq)));
        }
        let next = 3 * cap;
        b.push(&batch(next)).unwrap();
        b.push(&Notice::EndOfEpoch(EpochEnd {
            epoch: 0,
            batches: 1,
            complete: true,
        }))
        .unwrap();
        b.push(&Notice::Replay(ReplayReady {
            seq: 5,
            epoch: 0,
            first: 0,
            samples: 3,
            ends_epoch: false,
        }))
        .unwrap();
        assert_eq!(
            b.unread_units(),
            vec![Unit::Shared(next), Unit::Replayed(5)]
        );
        assert_eq!(b.unread_shared(), 1, "the replayed one is not counted");
        assert_eq!(c.pop().unwrap(), Some(batch(next)));
        assert_eq!(b.unread_units(), vec![Unit::Replayed(5)]);
        assert_eq!(b.unread_shared(), 0);
        assert!(c.pop().unwrap().is_some());
        assert!(c.pop().unwrap().is_some());
        assert_eq!(b.unread_units(), Vec::<Unit>::new());
        // A tail forged past what was written: nothing is unread.
        b.push(&batch(next + 1)).unwrap();
        c.words.u64(TAIL).store(u64::MAX / 2, Ordering::Release);
        assert_eq!(b.unread_units(), Vec::<Unit>::new());
        assert_eq!(b.unread_shared(), 0);
    }

    #[test]
    fn what_the_consumer_took_reaches_the_broker_apart_from_its_releases() {
        let (mut b, c) = pair(2);
        assert_eq!(b.taken(), proto::Taken::default());
        let taken = proto::Taken {
            batches: 7,
            samples: 7 * 64 - 3,
            epoch: 2,
        };
        c.note_taken(taken);
        assert_eq!(b.taken(), taken);
        // The release words are untouched by it.
        let (n, totals) = b.drain(|_| {}).unwrap();
        assert_eq!((n, totals), (0, Totals::default()));
    }

    #[test]
    fn a_cut_takes_back_exactly_the_batches_not_yet_taken() {
        let (mut b, c) = pair(4);
        for seq in 0..5 {
            b.push(&batch(seq)).unwrap();
        }
        assert_eq!(c.pop().unwrap(), Some(batch(0)));
        assert_eq!(c.pop().unwrap(), Some(batch(1)));
        assert_eq!(b.cut(), Some(vec![2, 3, 4]));
        // What comes after the cut is read; what it took back is passed over.
        let end = Notice::EndOfEpoch(EpochEnd {
            epoch: 0,
            batches: 5,
            complete: true,
        });
        b.push(&end).unwrap();
        b.push(&batch(7)).unwrap();
        assert_eq!(c.pop().unwrap(), Some(end));
        assert_eq!(c.pop().unwrap(), Some(batch(7)));
        assert_eq!(c.pop().unwrap(), None);
        // A second cut with nothing unread takes nothing, and the goodbye
        // record no longer holds what was taken back.
        assert_eq!(b.cut(), Some(vec![]));
        b.push(&batch(8)).unwrap();
        assert_eq!(b.unread_units(), vec![Unit::Shared(8)]);
        assert_eq!(c.pop().unwrap(), Some(batch(8)));
    }

    #[test]
    fn a_forged_tail_changes_only_what_that_consumer_is_given_back() {
        // Ahead of what was written: nothing counts as unread, nothing is
        // taken back (the units stay held for it, as a slow reader's).
        let (mut b, c) = pair(4);
        for seq in 0..4 {
            b.push(&batch(seq)).unwrap();
        }
        c.words.u64(TAIL).store(u64::MAX / 2, Ordering::Release);
        assert_eq!(b.cut(), Some(vec![]));
        // Behind what it read: units it took are taken back (its own loss;
        // the hub gives back only references it holds).
        let (mut b, c) = pair(4);
        for seq in 0..4 {
            b.push(&batch(seq)).unwrap();
        }
        assert_eq!(c.pop().unwrap(), Some(batch(0)));
        c.words.u64(TAIL).store(0, Ordering::Release);
        assert_eq!(b.cut(), Some(vec![0, 1, 2, 3]));
    }

    /// A consumer taking notices while the broker cuts at random moments:
    /// every batch is either taken by the consumer or given back by the
    /// broker, never both, never neither.
    #[test]
    fn cuts_racing_a_reader_split_every_batch_exactly_once() {
        let (mut all_taken, mut all_revoked) = (0, 0);
        for round in 0..20u64 {
            let (mut b, c) = pair(8);
            let total = 20_000u64;
            let reader = std::thread::spawn(move || {
                let mut taken = Vec::new();
                while taken.last() != Some(&u64::MAX) {
                    match c.pop().unwrap() {
                        Some(Notice::Batch(n)) => taken.push(n.seq),
                        Some(Notice::EndOfStream) => taken.push(u64::MAX),
                        _ => std::hint::spin_loop(),
                    }
                }
                taken.pop();
                taken
            });
            let mut revoked = Vec::new();
            let mut seq = 0;
            while seq < total {
                match b.push(&batch(seq)) {
                    Ok(()) => seq += 1,
                    Err(MailboxError::Full { .. }) => std::thread::yield_now(),
                    Err(e) => panic!("{e}"),
                }
                if (seq * 7919 + round) % 97 == 0 {
                    revoked.extend(b.cut().unwrap());
                }
            }
            while b.push(&Notice::EndOfStream).is_err() {
                std::thread::yield_now();
            }
            let taken = reader.join().unwrap();
            all_taken += taken.len();
            all_revoked += revoked.len();
            let mut count = vec![0u32; total as usize];
            for &s in taken.iter().chain(&revoked) {
                count[s as usize] += 1;
            }
            let wrong: Vec<(usize, u32)> = count
                .iter()
                .enumerate()
                .filter(|(_, n)| **n != 1)
                .map(|(s, n)| (s, *n))
                .take(10)
                .collect();
            assert!(
                wrong.is_empty(),
                "round {round}: (seq, times) {wrong:?}; {} taken, {} revoked",
                taken.len(),
                revoked.len()
            );
            assert!(taken.windows(2).all(|w| w[0] < w[1]), "in order");
        }
        assert!(all_taken > 0 && all_revoked > 0, "both sides won races");
    }

    #[test]
    fn notices_and_releases_cross_in_order_and_wrap() {
        let (mut b, c) = pair(2);
        let cap = b.spec().notices as u64;
        let mut sum = Totals::default();
        for round in 0..5 * cap {
            assert!(!c.has_notice());
            b.push(&batch(round)).unwrap();
            if round % 3 == 0 {
                b.push(&Notice::EndOfEpoch(EpochEnd {
                    epoch: round,
                    batches: 7,
                    complete: true,
                }))
                .unwrap();
            }
            assert!(c.has_notice());
            assert_eq!(c.pop().unwrap(), Some(batch(round)));
            if round % 3 == 0 {
                assert!(
                    matches!(c.pop().unwrap(), Some(Notice::EndOfEpoch(e)) if e.epoch == round && e.complete)
                );
            }
            assert_eq!(c.pop().unwrap(), None);
            assert!(c.push_release(Unit::Shared(round), t(round)));
            sum.wait_ns += round;
            sum.busy_ns += 2 * round;
            sum.hold_ns += 3 * round;
            let mut got = Vec::new();
            let (n, totals) = b.drain(|s| got.push(s)).unwrap();
            assert_eq!((n, got, totals), (1, vec![Unit::Shared(round)], sum));
        }
        b.push(&Notice::EndOfStream).unwrap();
        assert_eq!(c.pop().unwrap(), Some(Notice::EndOfStream));
    }

    #[test]
    fn a_full_ring_is_reported_not_overwritten() {
        let (mut b, c) = pair(1);
        let cap = b.spec().notices as u64;
        for s in 0..cap {
            b.push(&batch(s)).unwrap();
        }
        assert!(matches!(
            b.push(&batch(cap)),
            Err(MailboxError::Full { .. })
        ));
        assert_eq!(c.pop().unwrap(), Some(batch(0)));
        b.push(&batch(cap)).unwrap();
        for s in 1..=cap {
            assert_eq!(c.pop().unwrap(), Some(batch(s)));
        }
        // Releases: the consumer falls back to the socket when full.
        let rcap = b.spec().releases;
        for s in 0..rcap {
            assert!(c.push_release(Unit::Shared(s as u64), t(1)));
        }
        assert!(!c.push_release(Unit::Shared(99), t(1)));
        assert_eq!(b.drain(|_| {}).unwrap().0, rcap as usize);
        assert!(c.push_release(Unit::Replayed(99), t(1)));
        assert!(c.push_release(Unit::Shared(98), t(1)));
        let mut got = Vec::new();
        b.drain(|u| got.push(u)).unwrap();
        assert_eq!(got, vec![Unit::Replayed(99), Unit::Shared(98)]);
    }

    #[test]
    fn forged_counters_are_errors_for_the_broker() {
        let (mut b, c) = pair(2);
        // A consumer writing nonsense into its own lines.
        c.words.u64(RELEASED).store(1 << 40, Ordering::Release);
        assert!(matches!(
            b.drain(|_| {}),
            Err(MailboxError::BadReleaseCount { .. })
        ));
        // A tail ahead of what was written: the ring reads as full once the
        // broker looks at it.
        let cap = b.spec().notices as u64;
        c.words.u64(TAIL).store(cap + 5, Ordering::Release);
        let mut full = false;
        for s in 0..=cap {
            if b.push(&batch(s)).is_err() {
                full = true;
                break;
            }
        }
        assert!(full);
        // A release record of no kind a client writes: the records before
        // it are taken, then the error (which ends this consumer only).
        let (mut b, c) = pair(2);
        assert!(c.push_release(Unit::Shared(7), t(1)));
        assert!(c.push_release(Unit::Replayed(7), t(1)));
        c.words.release(1, 0).store(3, Ordering::Relaxed);
        let mut got = Vec::new();
        assert_eq!(
            b.drain(|u| got.push(u)),
            Err(MailboxError::BadReleaseKind { at: 1, kind: 3 })
        );
        assert_eq!(got, vec![Unit::Shared(7)]);
        // A seq with its top bit set is a seq like any other.
        assert!(c.push_release(Unit::Shared(u64::MAX), t(1)));
        got.clear();
        b.drain(|u| got.push(u)).unwrap();
        assert_eq!(got, vec![Unit::Shared(u64::MAX)]);
        // And the consumer refuses an unknown record kind.
        let (mut b, c) = pair(2);
        b.push(&batch(0)).unwrap();
        b.words.notice(0, 1).store(99, Ordering::Relaxed);
        assert!(c.pop().is_err());
    }

    #[test]
    fn want_flag_reaches_the_consumer() {
        let (mut b, c) = pair(2);
        assert!(!c.wants_doorbell());
        assert!(b.set_want(true));
        assert!(!b.set_want(true), "unchanged: no store");
        assert!(c.wants_doorbell());
        b.set_want(false);
        assert!(!c.wants_doorbell());
    }

    #[test]
    fn a_sleeping_consumer_is_woken_by_the_bell() {
        let (mut b, c) = pair(2);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let t0 = Instant::now();
            c.sleep_unless(Duration::from_secs(20), || {
                tx.send(()).unwrap();
                false
            });
            (t0.elapsed(), c.pop().unwrap())
        });
        // The consumer has said it sleeps (it is about to wait, or waits).
        rx.recv().unwrap();
        b.push(&batch(7)).unwrap();
        assert!(b.ring(), "the broker saw it sleeping");
        let (waited, got) = t.join().unwrap();
        assert_eq!(got, Some(batch(7)));
        assert!(waited < Duration::from_secs(20), "woken, not timed out");
        assert!(!b.ring(), "nobody sleeps now: no wake");
    }

    #[test]
    fn no_sleep_when_a_notice_or_something_else_is_there() {
        let (mut b, c) = pair(2);
        let t0 = Instant::now();
        c.sleep_unless(Duration::from_secs(20), || true);
        b.push(&batch(1)).unwrap();
        c.sleep_unless(Duration::from_secs(20), || false);
        assert!(t0.elapsed() < Duration::from_secs(10));
    }
}
