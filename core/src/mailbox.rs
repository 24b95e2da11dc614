//! A mailbox's shared memory, word by word: the layout both sides map
//! (`batchcast::mailbox` holds the protocol over it, the handshakes and
//! who stores what when). One memfd per host consumer, shared by the
//! broker and that consumer only.
//!
//! Every word is little-endian and accessed only atomically; each group
//! is on its own cache line ([`Line`]), so that a word one side polls is
//! not written by the other more often than it must be:
//!
//! | offset | written by | words |
//! |---:|---|---|
//! | 0 | broker | [`BrokerLine`]: `bell` (u32 futex word, bumped to wake a sleeper), `want` (u32: 1 = send a doorbell after releasing), `drained` (u64: release records taken), `cut` (u64: the batch notices last taken back) |
//! | 64 | consumer | `sleeping` (u32: 1 = waiting on `bell`) |
//! | 128 | consumer | `tail` (u64: notices read) |
//! | 192 | consumer | [`ConsumerLine`]: `released` (u64: release records written), running totals of wait, busy and hold ns, what its program has taken ([`Taken`](crate::proto::Taken)) |
//! | 256 | broker | notice ring: records of [`NOTICE_WORDS`] words, the first a stamp (the notice's number + 1) written last |
//! | … | consumer | release ring: [`RELEASE_WORDS`] words per release, the unit's kind ([`RELEASE_SHARED`], [`RELEASE_REPLAYED`]) and its seq |
//!
//! The first 256 bytes are one `#[repr(C)]` type, [`Header`], whose
//! offsets this crate checks as it compiles; the rings follow it as words
//! ([`MailboxSpec::ring_words`]). Both are generic over the word types so
//! that the protocol can run on loom's model of atomics as well as on
//! shared memory ([`Header::new`]); on shared memory they are the standard
//! atomics ([`SharedHeader`]), viewed there as a
//! [`Shared`](crate::shared::Shared) type.

use std::mem::{offset_of, size_of};
use std::ops::Deref;
use std::sync::atomic::{AtomicU32, AtomicU64};

use crate::error::{Result, WireError};
use crate::proto::{BatchReady, EpochEnd, MailboxSpec, Position, ReplayReady, Unit};

/// Largest ring either side accepts, in records.
pub const MAX_RECORDS: u32 = 1 << 16;
/// Words of a notice record: its stamp, its kind, then six of its own.
pub const NOTICE_WORDS: usize = 8;
/// Words of a release record: the unit's kind, then its seq.
pub const RELEASE_WORDS: usize = 2;
/// A release record's kind word: a shared batch.
pub const RELEASE_SHARED: u64 = 1;
/// A release record's kind word: a replayed batch.
pub const RELEASE_REPLAYED: u64 = 2;

const KIND_BATCH: u64 = 1;
const KIND_EPOCH_END: u64 = 2;
const KIND_END_OF_STREAM: u64 = 3;
const KIND_REPLAY: u64 = 4;
const KIND_CUT: u64 = 5;
const KIND_MERGE: u64 = 6;
const KIND_ROTATE: u64 = 7;
const KIND_ARENA: u64 = 8;

/// `cut` while the broker takes notices back.
pub const CUT_UNDER_WAY: u64 = 1;
/// Bits of `cut` holding the first notice taken back, plus 2 (its length
/// is above them): one word, never read half old, half new.
pub const CUT_FROM_BITS: u32 = 47;

/// A cache line of its own.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct Line<T>(pub T);

impl<T> Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// The broker's line (offset 0).
#[derive(Debug)]
#[repr(C)]
pub struct BrokerLine<W64, W32> {
    /// Bumped to wake a sleeping consumer (its futex word).
    pub bell: W32,
    /// 1: the consumer sends a doorbell after each release.
    pub want: W32,
    /// Release records taken.
    pub drained: W64,
    /// The batch notices last taken back (see [`CUT_FROM_BITS`]), or
    /// [`CUT_UNDER_WAY`].
    pub cut: W64,
}

/// The consumer's line of counters (offset 192).
#[derive(Debug)]
#[repr(C)]
pub struct ConsumerLine<W64> {
    /// Release records written.
    pub released: W64,
    /// Running totals over its releases, ns (its own figures, for stats).
    pub wait_total: W64,
    pub busy_total: W64,
    pub hold_total: W64,
    /// What its program has taken (its own figures, for stats).
    pub taken_batches: W64,
    pub taken_samples: W64,
    pub taken_epoch: W64,
}

/// The first 256 bytes of a mailbox.
#[derive(Debug)]
#[repr(C)]
pub struct Header<W64, W32> {
    pub broker: Line<BrokerLine<W64, W32>>,
    /// 1: the consumer waits on `bell`.
    pub sleeping: Line<W32>,
    /// Notices the consumer has read.
    pub tail: Line<W64>,
    pub consumer: Line<ConsumerLine<W64>>,
}

impl<W64, W32> Header<W64, W32> {
    /// A header of fresh words (a model's; shared memory starts zeroed).
    pub fn new(w64: impl Fn() -> W64, w32: impl Fn() -> W32) -> Header<W64, W32> {
        Header {
            broker: Line(BrokerLine {
                bell: w32(),
                want: w32(),
                drained: w64(),
                cut: w64(),
            }),
            sleeping: Line(w32()),
            tail: Line(w64()),
            consumer: Line(ConsumerLine {
                released: w64(),
                wait_total: w64(),
                busy_total: w64(),
                hold_total: w64(),
                taken_batches: w64(),
                taken_samples: w64(),
                taken_epoch: w64(),
            }),
        }
    }
}

/// The header as it lies in shared memory.
pub type SharedHeader = Header<AtomicU64, AtomicU32>;

/// Bytes before the notice ring.
pub const HEADER_BYTES: usize = size_of::<SharedHeader>();

// The table above, checked as this crate compiles.
const _: () = {
    assert!(offset_of!(SharedHeader, broker) == 0);
    assert!(offset_of!(BrokerLine<AtomicU64, AtomicU32>, bell) == 0);
    assert!(offset_of!(BrokerLine<AtomicU64, AtomicU32>, want) == 4);
    assert!(offset_of!(BrokerLine<AtomicU64, AtomicU32>, drained) == 8);
    assert!(offset_of!(BrokerLine<AtomicU64, AtomicU32>, cut) == 16);
    assert!(offset_of!(SharedHeader, sleeping) == 64);
    assert!(offset_of!(SharedHeader, tail) == 128);
    assert!(offset_of!(SharedHeader, consumer) == 192);
    assert!(offset_of!(ConsumerLine<AtomicU64>, released) == 0);
    assert!(offset_of!(ConsumerLine<AtomicU64>, taken_epoch) == 48);
    assert!(HEADER_BYTES == 256);
};

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

    /// Words of both rings, after the header: the notice ring's, then the
    /// release ring's from [`MailboxSpec::releases_from`].
    pub fn ring_words(&self) -> usize {
        self.releases_from() + self.releases as usize * RELEASE_WORDS
    }

    /// The word of the rings where the release ring begins.
    pub fn releases_from(&self) -> usize {
        self.notices as usize * NOTICE_WORDS
    }

    /// Bytes of the shared memory.
    pub fn bytes(&self) -> u64 {
        (HEADER_BYTES + self.ring_words() * 8) as u64
    }

    /// A broker's spec, checked before anything is mapped.
    pub fn validate(&self) -> Result<()> {
        for (what, n) in [("notice", self.notices), ("release", self.releases)] {
            if !n.is_power_of_two() || n > MAX_RECORDS {
                return Err(WireError::Unexpected(format!(
                    "the broker's mailbox has a {what} ring of {n} records (must be a power of two up to {MAX_RECORDS})"
                )));
            }
        }
        Ok(())
    }
}

/// The release record for `unit`: its kind and its seq, each a word of
/// its own (a seq is any u64; nothing in it marks its kind).
pub fn record_of(unit: Unit) -> [u64; RELEASE_WORDS] {
    match unit {
        Unit::Shared(seq) => [RELEASE_SHARED, seq],
        Unit::Replayed(seq) => [RELEASE_REPLAYED, seq],
    }
}

/// The unit a release record names; `None` for a kind no client writes.
pub fn unit_of([kind, seq]: [u64; RELEASE_WORDS]) -> Option<Unit> {
    match kind {
        RELEASE_SHARED => Some(Unit::Shared(seq)),
        RELEASE_REPLAYED => Some(Unit::Replayed(seq)),
        _ => None,
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
    /// See [`crate::proto::ServerMsg::Arena`].
    Arena(u32),
}

/// A notice record's words after its stamp: the kind, then its own.
pub type NoticeWords = [u64; NOTICE_WORDS - 1];

impl Notice {
    /// Its record's words after the stamp.
    pub fn to_words(&self) -> NoticeWords {
        match *self {
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
            Notice::Arena(g) => [KIND_ARENA, g as u64, 0, 0, 0, 0, 0],
        }
    }

    /// Whether the words are a batch's notice (one a cut may take back).
    pub fn is_batch(words: &NoticeWords) -> bool {
        words[0] == KIND_BATCH
    }

    /// The notice whose record's words (after the stamp) these are.
    pub fn from_words(v: NoticeWords) -> Result<Notice> {
        let at = |epoch, sample| Position { epoch, sample };
        Ok(match v[0] {
            KIND_BATCH => Notice::Batch(BatchReady {
                seq: v[1],
                epoch: v[2],
                index: v[3],
                slot: u32::try_from(v[4]).map_err(|_| {
                    WireError::Unexpected(format!("mailbox: batch {} in slot {}", v[1], v[4]))
                })?,
                samples: v[5],
                sent_ns: v[6],
            }),
            KIND_EPOCH_END => Notice::EndOfEpoch(EpochEnd {
                epoch: v[1],
                batches: v[2],
                complete: v[3] != 0,
            }),
            KIND_END_OF_STREAM => Notice::EndOfStream,
            KIND_REPLAY => Notice::Replay(ReplayReady {
                seq: v[1],
                epoch: v[2],
                first: v[3],
                samples: v[4],
                ends_epoch: v[5] != 0,
            }),
            KIND_CUT => Notice::Cut(at(v[1], v[2])),
            KIND_MERGE => Notice::Merge(at(v[1], v[2])),
            KIND_ROTATE => Notice::Rotate(at(v[1], v[2])),
            KIND_ARENA => {
                Notice::Arena(u32::try_from(v[1]).map_err(|_| {
                    WireError::Unexpected(format!("mailbox: arena region {}", v[1]))
                })?)
            }
            k => {
                return Err(WireError::Unexpected(format!(
                    "mailbox: notice of unknown kind {k}"
                )));
            }
        })
    }

    /// The unit a batch's notice carries (what its consumer releases).
    pub fn unit(&self) -> Option<Unit> {
        match *self {
            Notice::Batch(b) => Some(Unit::Shared(b.seq)),
            Notice::Replay(r) => Some(Unit::Replayed(r.seq)),
            Notice::EndOfEpoch(_)
            | Notice::EndOfStream
            | Notice::Cut(_)
            | Notice::Merge(_)
            | Notice::Rotate(_)
            | Notice::Arena(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_notice_round_trips_through_its_words() {
        let p = Position {
            epoch: 3,
            sample: 1 << 40,
        };
        for n in [
            Notice::Batch(BatchReady {
                seq: u64::MAX,
                epoch: 2,
                index: 7,
                slot: u32::MAX,
                samples: 64,
                sent_ns: 99,
            }),
            Notice::EndOfEpoch(EpochEnd {
                epoch: 4,
                batches: 10,
                complete: true,
            }),
            Notice::EndOfStream,
            Notice::Replay(ReplayReady {
                seq: 5,
                epoch: 1,
                first: 320,
                samples: 32,
                ends_epoch: true,
            }),
            Notice::Cut(p),
            Notice::Merge(p),
            Notice::Rotate(p),
            Notice::Arena(3),
        ] {
            assert_eq!(Notice::from_words(n.to_words()).unwrap(), n);
            assert_eq!(
                Notice::is_batch(&n.to_words()),
                matches!(n, Notice::Batch(_))
            );
        }
    }

    #[test]
    fn forged_notices_are_errors_naming_what_is_wrong() {
        let err = Notice::from_words([99, 0, 0, 0, 0, 0, 0]).unwrap_err();
        assert!(err.to_string().contains("unknown kind 99"), "{err}");
        let err = Notice::from_words([KIND_BATCH, 8, 0, 0, 1 << 32, 0, 0]).unwrap_err();
        assert!(
            err.to_string().contains("batch 8 in slot 4294967296"),
            "{err}"
        );
    }

    #[test]
    fn release_records_name_their_kind_in_a_word_of_its_own() {
        for unit in [
            Unit::Shared(u64::MAX),
            Unit::Replayed(1 << 63),
            Unit::Shared(0),
        ] {
            assert_eq!(unit_of(record_of(unit)), Some(unit));
        }
        assert_eq!(unit_of([0, 5]), None);
        assert_eq!(unit_of([3, 5]), None);
    }

    #[test]
    fn specs_size_their_rings_and_refuse_what_no_broker_makes() {
        let s = MailboxSpec::for_batches(4);
        assert_eq!((s.notices, s.releases), (16, 8));
        assert_eq!(s.bytes(), 256 + (16 * 8 + 8 * 2) * 8);
        let big = MailboxSpec::for_batches(u32::MAX);
        assert!(big.notices <= MAX_RECORDS && big.validate().is_ok());
        for bad in [
            MailboxSpec {
                notices: 12,
                releases: 8,
            },
            MailboxSpec {
                notices: 8,
                releases: MAX_RECORDS * 2,
            },
        ] {
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains("must be a power of two"), "{err}");
        }
    }
}
