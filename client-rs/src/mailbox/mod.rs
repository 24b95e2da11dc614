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
//! The layout, word by word, is the core's ([`batchcast_core::mailbox`]:
//! a `#[repr(C)]` header of four cache lines, the broker's, `sleeping`,
//! `tail` and the consumer's counters, then the notice ring and the
//! release ring); this module is the protocol over it.
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

use std::time::Duration;

use batchcast_core::mailbox::{
    CUT_FROM_BITS, CUT_UNDER_WAY, Header, NOTICE_WORDS, RELEASE_WORDS, record_of,
};

use crate::proto::{MailboxSpec, Unit};

#[cfg(any(test, feature = "broker"))]
mod broker;
mod consumer;
#[cfg(test)]
mod loom_tests;
mod words;

pub use batchcast_core::mailbox::Notice;
#[cfg(any(test, feature = "broker"))]
pub use broker::{Bell, BrokerMailbox, MailboxError};
pub use consumer::ConsumerMailbox;
pub use words::{Memory, Shm, Word32, Word64};

/// Longest a consumer waits for a cut under way to be written.
const CUT_WAIT: Duration = Duration::from_secs(1);

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

/// The `N` words of the rings from `at` (within the rings: the spec sized
/// them, and the memory was checked against it when mapped).
#[inline]
fn record<W, const N: usize>(rings: &[W], at: usize) -> &[W; N] {
    rings[at..at + N].try_into().expect("N words")
}

/// A mailbox's memory and the word accessors both sides use.
#[derive(Debug)]
struct Words<M: Memory> {
    mem: M,
    spec: MailboxSpec,
}

impl<M: Memory> Words<M> {
    #[inline]
    fn header(&self) -> &Header<M::W64, M::W32> {
        self.mem.header()
    }

    /// The ring entry that notice number `n` uses (its words, found once:
    /// a notice costs the broker one lookup, not one a word).
    #[inline]
    fn notice(&self, n: u64) -> &[M::W64; NOTICE_WORDS] {
        let at = (n % self.spec.notices as u64) as usize * NOTICE_WORDS;
        record(self.mem.rings(), at)
    }

    /// The ring entry that release number `n` uses.
    #[inline]
    fn release(&self, n: u64) -> &[M::W64; RELEASE_WORDS] {
        let i = (n % self.spec.releases as u64) as usize;
        record(
            self.mem.rings(),
            self.spec.releases_from() + i * RELEASE_WORDS,
        )
    }

    #[inline]
    fn bell(&self) -> &M::W32 {
        &self.header().broker.bell
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{self, BatchReady, EpochEnd, ReplayReady};
    use std::sync::atomic::Ordering;
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
        assert!(b.is_unread(Unit::Shared(next)) && b.is_unread(Unit::Replayed(5)));
        assert!(!b.is_unread(Unit::Replayed(next)), "a unit's kind counts");
        assert_eq!(c.pop().unwrap(), Some(batch(next)));
        assert_eq!(b.unread_units(), vec![Unit::Replayed(5)]);
        assert!(!b.is_unread(Unit::Shared(next)), "read");
        assert_eq!(b.unread_shared(), 0);
        assert!(c.pop().unwrap().is_some());
        assert!(c.pop().unwrap().is_some());
        assert_eq!(b.unread_units(), Vec::<Unit>::new());
        // A tail forged past what was written: nothing is unread.
        b.push(&batch(next + 1)).unwrap();
        c.words.header().tail.store(u64::MAX / 2, Ordering::Release);
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
        c.words.header().tail.store(u64::MAX / 2, Ordering::Release);
        assert_eq!(b.cut(), Some(vec![]));
        // Behind what it read: units it took are taken back (its own loss;
        // the hub gives back only references it holds).
        let (mut b, c) = pair(4);
        for seq in 0..4 {
            b.push(&batch(seq)).unwrap();
        }
        assert_eq!(c.pop().unwrap(), Some(batch(0)));
        c.words.header().tail.store(0, Ordering::Release);
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
        c.words
            .header()
            .consumer
            .released
            .store(1 << 40, Ordering::Release);
        assert!(matches!(
            b.drain(|_| {}),
            Err(MailboxError::BadReleaseCount { .. })
        ));
        // A tail ahead of what was written: the ring reads as full once the
        // broker looks at it.
        let cap = b.spec().notices as u64;
        c.words.header().tail.store(cap + 5, Ordering::Release);
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
        c.words.release(1)[0].store(3, Ordering::Relaxed);
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
        b.words.notice(0)[1].store(99, Ordering::Relaxed);
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
