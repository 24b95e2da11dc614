//! The mailbox's handshakes on loom's model of atomics: the protocol code
//! of `super` itself (not a copy), on a [`Memory`] whose words are loom's,
//! run by loom under every interleaving and every outcome the memory
//! orderings allow, within a preemption bound. Each test states the
//! property of the module's notes it checks, and fails if what the notes
//! rely on is weakened (tried by hand when written: without the fence in
//! `ring` a sleeper is left asleep; without the consumer's fence between
//! `tail` and `cut` a batch is both taken and given back; a second cut
//! covering only `tail < last cut's end` gave back a batch a consumer
//! still checking took, the bug these tests found).
//!
//! Loom models `SeqCst` fences but treats `SeqCst` loads and stores as
//! acquire/release, so the model's Dekker handshake ([`Memory::sc_store`],
//! [`Memory::sc_load`]) takes the fence form (store, `SeqCst` fence,
//! load), which the C++ memory model makes as strong as the `SeqCst`
//! accesses of the real memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use loom::sync::atomic::{AtomicU32, AtomicU64};

use super::*;
use crate::proto::{BatchReady, Position};

/// Loom's atomics as a mailbox's words, and what the futex calls did;
/// the broker's and the consumer's side each hold a clone (one memory).
#[derive(Debug, Clone)]
struct Model(Arc<Cells>);

#[derive(Debug)]
struct Cells {
    header: Header<AtomicU64, AtomicU32>,
    rings: Vec<AtomicU64>,
    /// A `wait` found the word at its expected value: a real futex sleeps
    /// until a `wake`.
    blocked: AtomicBool,
    woken: AtomicBool,
}

impl Model {
    fn new(spec: MailboxSpec) -> Model {
        Model(Arc::new(Cells {
            header: Header::new(|| AtomicU64::new(0), || AtomicU32::new(0)),
            rings: (0..spec.ring_words()).map(|_| AtomicU64::new(0)).collect(),
            blocked: AtomicBool::new(false),
            woken: AtomicBool::new(false),
        }))
    }
}

impl Word64 for AtomicU64 {
    fn load(&self, order: Ordering) -> u64 {
        AtomicU64::load(self, order)
    }
    fn store(&self, value: u64, order: Ordering) {
        AtomicU64::store(self, value, order)
    }
}

impl Word32 for AtomicU32 {
    fn load(&self, order: Ordering) -> u32 {
        AtomicU32::load(self, order)
    }
    fn store(&self, value: u32, order: Ordering) {
        AtomicU32::store(self, value, order)
    }
    fn fetch_add(&self, value: u32, order: Ordering) -> u32 {
        AtomicU32::fetch_add(self, value, order)
    }
}

impl Memory for Model {
    type W64 = AtomicU64;
    type W32 = AtomicU32;

    fn header(&self) -> &Header<AtomicU64, AtomicU32> {
        &self.0.header
    }

    fn rings(&self) -> &[AtomicU64] {
        &self.0.rings
    }

    fn fence(&self, order: Ordering) {
        loom::sync::atomic::fence(order)
    }

    fn spin(&self) {
        loom::thread::yield_now()
    }

    // Loom treats `SeqCst` accesses as acquire/release but models `SeqCst`
    // fences: the fence form, as strong under the C++ memory model as the
    // `SeqCst` accesses `Shm` uses.
    fn sc_store(&self, word: &AtomicU64, value: u64) {
        word.store(value, Ordering::Release);
        loom::sync::atomic::fence(Ordering::SeqCst);
    }

    fn sc_load(&self, word: &AtomicU64) -> u64 {
        word.load(Ordering::Acquire)
    }

    fn wait(&self, word: &AtomicU32, expected: u32, _timeout: Duration) {
        // The futex's check: sleep only if the word still reads `expected`.
        // Then it sleeps until the bell changes: a wake that never comes
        // leaves this loop spinning, which loom reports (it exceeds its
        // branch limit).
        if word.load(Ordering::Acquire) == expected {
            self.0.blocked.store(true, Ordering::Relaxed);
            while word.load(Ordering::Acquire) == expected {
                loom::thread::yield_now();
            }
        }
    }

    fn wake(&self, _word: &AtomicU32) {
        self.0.woken.store(true, Ordering::Relaxed);
    }
}

/// The smallest rings a spec may have.
const SPEC: MailboxSpec = MailboxSpec {
    notices: 8,
    releases: 8,
};

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    // Every interleaving with up to this many preemptions: the races
    // here need one or two.
    b.preemption_bound = Some(3);
    b.check(f);
}

fn batch(seq: u64) -> Notice {
    Notice::Batch(BatchReady {
        seq,
        epoch: 0,
        index: seq,
        slot: seq as u32,
        samples: 1,
        sent_ns: 0,
    })
}

fn pair() -> (BrokerMailbox<Model>, ConsumerMailbox<Model>) {
    let mem = Model::new(SPEC);
    (
        BrokerMailbox::in_memory(Arc::new(Words {
            mem: mem.clone(),
            spec: SPEC,
        })),
        ConsumerMailbox::in_memory(Words { mem, spec: SPEC }),
    )
}

/// The batches a consumer takes, in order, over `pops` calls (each takes
/// at most one notice the broker did not take back).
fn take(c: &ConsumerMailbox<Model>, pops: usize) -> Vec<u64> {
    let mut got = Vec::new();
    for _ in 0..pops {
        if let Some(Notice::Batch(b)) = c.pop().expect("a well-formed mailbox") {
            got.push(b.seq);
        }
    }
    got
}

/// Every batch noticed is either taken by the consumer or given back by
/// the cut, never both and never neither; a batch noticed after the cut
/// is never taken back; the consumer takes its batches in order.
fn check_split(noticed: &[u64], taken: &[u64], revoked: &[u64], after_cut: &[u64]) {
    let mut all: Vec<u64> = taken.iter().chain(revoked).copied().collect();
    all.sort_unstable();
    assert_eq!(
        all, noticed,
        "taken {taken:?} and given back {revoked:?} must split the batches noticed"
    );
    assert!(taken.is_sorted(), "taken out of order: {taken:?}");
    for seq in after_cut {
        assert!(
            !revoked.contains(seq),
            "batch {seq} noticed after the cut was given back"
        );
    }
}

#[test]
fn a_cut_racing_the_reader_splits_every_batch_exactly_once() {
    model(|| {
        let (mut b, c) = pair();
        b.push(&batch(0)).unwrap();
        b.push(&batch(1)).unwrap();
        let reader = loom::thread::spawn(move || {
            let got = take(&c, 2);
            (got, c)
        });
        let revoked = b.cut().expect("a small notice count");
        b.push(&Notice::Cut(Position::default())).unwrap();
        b.push(&batch(2)).unwrap();
        let (mut taken, c) = reader.join().unwrap();
        taken.extend(take(&c, 3));
        check_split(&[0, 1, 2], &taken, &revoked, &[2]);
    });
}

#[test]
fn a_second_cut_before_the_reader_passed_the_first_still_covers_it() {
    model(|| {
        let (mut b, c) = pair();
        b.push(&batch(0)).unwrap();
        let reader = loom::thread::spawn(move || {
            let got = take(&c, 2);
            (got, c)
        });
        let mut revoked = b.cut().expect("a small notice count");
        b.push(&batch(1)).unwrap();
        revoked.extend(b.cut().expect("a small notice count"));
        b.push(&batch(2)).unwrap();
        let (mut taken, c) = reader.join().unwrap();
        taken.extend(take(&c, 3));
        check_split(&[0, 1, 2], &taken, &revoked, &[2]);
    });
}

#[test]
fn a_consumer_going_to_sleep_is_never_left_asleep_with_a_notice() {
    model(|| {
        let (mut b, c) = pair();
        let mem = c.words.mem.clone();
        let sleeper = loom::thread::spawn(move || {
            c.sleep_unless(Duration::from_secs(1), || false);
        });
        b.push(&batch(0)).unwrap();
        let rang = b.ring();
        sleeper.join().unwrap();
        // A futex that slept (the bell unchanged when it looked) must be
        // woken by this ring: otherwise the notice waits for its timeout.
        let blocked = mem.0.blocked.load(Ordering::Relaxed);
        assert!(
            !blocked || (rang && mem.0.woken.load(Ordering::Relaxed)),
            "the consumer slept past a notice: the broker did not see it sleeping"
        );
    });
}

#[test]
fn a_release_written_as_the_broker_asks_for_doorbells_is_never_missed() {
    model(|| {
        let (mut b, c) = pair();
        let writer = loom::thread::spawn(move || {
            assert!(c.push_release(Unit::Shared(7), Totals::default()));
            c.wants_doorbell()
        });
        // As the stream's `settle` does: raise the wish, fence, take.
        b.set_want(true);
        b.words.mem.fence(Ordering::SeqCst);
        let mut seen = Vec::new();
        b.drain(|u| seen.push(u)).unwrap();
        let will_ring = writer.join().unwrap();
        // Either the broker took the release, or the consumer saw the
        // wish and sends a doorbell (which makes the broker take it).
        assert!(
            seen == [Unit::Shared(7)] || will_ring,
            "a release nobody will take until the next look: seen {seen:?}"
        );
        let mut rest = Vec::new();
        b.drain(|u| rest.push(u)).unwrap();
        seen.extend(rest);
        assert_eq!(seen, [Unit::Shared(7)], "each release taken once");
    });
}

#[test]
fn releases_cross_in_order_while_the_broker_drains() {
    model(|| {
        let (mut b, c) = pair();
        let writer = loom::thread::spawn(move || {
            for seq in 0..3 {
                assert!(c.push_release(Unit::Shared(seq), Totals::default()));
            }
        });
        let mut seen = Vec::new();
        b.drain(|u| seen.push(u)).unwrap();
        writer.join().unwrap();
        b.drain(|u| seen.push(u)).unwrap();
        assert_eq!(seen, (0..3).map(Unit::Shared).collect::<Vec<_>>());
    });
}
