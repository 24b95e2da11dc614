//! Shared sources: several streams over one dataset, order and split
//! (a `[[source]]` their `[[stream]]`s name) read and decode each sample
//! once, and each applies its own transform into its own slots.
//!
//! The bound: on photographs decoding is most of a sample's cost, and a
//! stream alone decodes every sample it writes. N streams on one source
//! need one decode per sample (per distinct JPEG scale, under
//! [`DecodeShare::Exact`]); everything after the decode is per stream.
//!
//! How it works. Samples are numbered by their place in the source's
//! sequence (`epoch × samples per epoch + position`), the same in every
//! stream of the source because they share the order. The first stream at
//! a sample reads and decodes it and leaves the decoded image here, in an
//! *entry*, for the other streams that have not passed that place yet;
//! each takes it (an `Arc`, no copy) and the entry goes when all have, or
//! when every stream has passed it. A miss is never an error: the stream
//! decodes alone, so what a stream writes never depends on the others.
//!
//! Streams advance together: a stream may not work more than `window`
//! samples ahead of a slower one that *holds* the source (it waits), so
//! entries are taken before they pile up. A stream holds only while it
//! is live (it has consumers taking batches), and moving; one that starts
//! more than `REACH_WINDOWS` windows behind the leader (a trainer that
//! came much later) holds only once it is within half a window. And: one whose place has not moved for `HOLD_STALL`
//! (`DECOUPLED_HOLD` for a decoupled stream) while another waits is let
//! go, and decodes alone until it is back within half a window of the
//! leader; so is one that keeps moving but has kept the others waiting
//! `HOLD_STALL` (`DECOUPLED_HOLD`) in all since it last held (a slow
//! trainer that will not catch up). So a stalled or slow trainer, or a
//! stream nobody reads, never stops the others for longer than that, and nothing can wait on itself in a circle (the
//! stream furthest behind never waits). Streams start a moment apart
//! (their trainers connect one after another), so for `START_GRACE` after
//! the first becomes live, the first decodes are also left for streams
//! not live yet. Entries also fit in a byte budget: beyond it a stream
//! decodes alone rather than leave more.
//!
//! Who can reach this: only the broker's pipeline threads. A consumer
//! changes a stream's pace (how fast its batches are released), which is
//! bounded as above; it cannot put or change an entry.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use serde::Deserialize;

pub use super::Dims;
use super::autosize::{self, CacheSize};
use super::cache::MinIoCache;
use super::decode::{Region, Rgb};
use super::kept::KeptImages;
use super::transform::Transform;
use crate::budget::{Budget, Grant, OverBudget, Use};

/// At most this many streams share one source (a bit each in an entry).
mod pace;

pub(crate) const MAX_MEMBERS: usize = 64;

/// A lockstep stream that has not moved for this long while another
/// waits for it stops holding the source.
pub const HOLD_STALL: Duration = Duration::from_secs(1);
/// The same for a decoupled stream (its consumers fall back on replay).
pub(crate) const DECOUPLED_HOLD: Duration = Duration::from_millis(10);
/// A stream that starts taking batches up to this many windows behind
/// the leader holds the source at once (the leader waits while it
/// catches up, as a slow consumer holds a stream); one further behind
/// decodes alone until it is within half a window.
pub(crate) const REACH_WINDOWS: u64 = 8;
/// Streams on a source start a moment apart (their trainers connect one
/// after another): for this long after the first becomes live, decodes
/// of the first `REACH_WINDOWS` windows are also left for the streams not
/// live yet, so one that starts a little late takes them instead of
/// decoding its first batches again. The byte budget bounds what waits.
pub const START_GRACE: Duration = Duration::from_secs(2);
/// A waiter looks again at least this often.
const RECHECK: Duration = Duration::from_millis(50);

/// Which JPEG scale a shared decode is made at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecodeShare {
    /// Each stream gets the scale it would choose alone, so its bytes are
    /// exactly those it makes alone; streams whose crops ask for
    /// different scales of one sample decode it once per scale.
    #[default]
    Exact,
    /// One decode per sample, at the finest scale any stream of the
    /// source asks for; a stream that alone would decode smaller gets
    /// bytes within a few levels of those (libjpeg's scaled IDCT is not a
    /// downscale of the full decode).
    Once,
}

/// A `[[source]]` as planned: what its [`SourceShare`] is made from
/// when its streams start (nothing here runs).
#[derive(Debug, Clone)]
pub struct SharePlan {
    pub name: String,
    pub policy: DecodeShare,
    /// Samples a stream may run ahead of one that holds the source.
    pub window: u64,
    /// Bytes of decoded images left for other streams, at most.
    pub budget: u64,
    /// Its streams, in member order (at most `MAX_MEMBERS`).
    pub members: Vec<MemberSpec>,
    /// The source's cache of encoded bytes.
    pub cache: CacheSize,
    /// The source's cache of decoded images.
    pub decoded_cache: CacheSize,
}

/// A stream's seat on a shared source, as planned: the source, and which
/// of its streams this one is.
#[derive(Debug, Clone)]
pub struct ShareSeat {
    pub source: Arc<SharePlan>,
    pub member: usize,
}

/// The shared sources of a broker's streams, made as the streams start:
/// the first stream of a source makes its [`SourceShare`], the others
/// take that one.
#[derive(Debug, Default)]
pub struct Shares(HashMap<String, Arc<SourceShare>>);

impl Shares {
    /// The source `seat` names, made on its first stream.
    pub fn take(&mut self, seat: &ShareSeat) -> Arc<SourceShare> {
        self.0
            .entry(seat.source.name.clone())
            .or_insert_with(|| Arc::new(SourceShare::new(seat.source.clone())))
            .clone()
    }
}

/// The files of a source as read: the cache of their encoded bytes and
/// the bad ones found (one per source, so each is logged once; a stream
/// alone has its own).
#[derive(Debug, Default)]
pub struct SourceFiles {
    /// The cache of encoded bytes, once on: set here where its size is
    /// written, else when the first stream starts, if the broker keeps
    /// one ([`super::autosize`]).
    pub cache: OnceLock<MinIoCache>,
    /// The cache of decoded images (`decoded_cache_mib`), the same way.
    pub kept: OnceLock<KeptImages>,
    /// What the broker chose for the caches the config left to it, and
    /// why (said in the log and `stats`); set when the first stream starts.
    pub sized: OnceLock<autosize::Choice>,
    /// Until then, what sizing them needs and has seen.
    pub sizer: Mutex<Option<autosize::Sizer>>,
    bad: Mutex<HashSet<u64>>,
}

impl SourceFiles {
    /// With the caches of encoded bytes and of decoded images the config
    /// sized (0: none); those left to the broker come when a stream starts.
    pub fn new(cache: CacheSize, decoded: CacheSize) -> SourceFiles {
        let files = SourceFiles::default();
        if let CacheSize::Bytes(b @ 1..) = cache {
            let _ = files.cache.set(MinIoCache::new(b));
        }
        if let CacheSize::Bytes(b @ 1..) = decoded {
            let _ = files.kept.set(KeptImages::new(b));
        }
        files
    }

    /// Records `index` as bad: `true` the first time (log it then).
    pub(crate) fn mark_bad(&self, index: u64) -> bool {
        self.bad
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(index)
    }

    pub(crate) fn is_bad(&self, index: u64) -> bool {
        self.bad
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&index)
    }
}

/// One stream of a source, as planned.
#[derive(Debug, Clone)]
pub struct MemberSpec {
    pub stream: String,
    pub transform: Transform,
    pub decoupled: bool,
}

#[derive(Debug)]
struct Decode {
    denom: u32,
    /// `None` while the stream that claimed it decodes.
    img: Option<Arc<Rgb>>,
}

#[derive(Debug)]
struct Entry {
    index: u64,
    dims: Dims,
    decodes: Vec<Decode>,
    /// Members that may still take it.
    want: u64,
    bytes: u64,
}

impl Entry {
    fn pending(&self) -> bool {
        self.decodes.iter().any(|d| d.img.is_none())
    }
}

#[derive(Debug)]
struct Progress {
    /// Its stream takes batches (it has consumers, epochs left).
    live: bool,
    /// It holds the others back (see the module's rules).
    holding: bool,
    /// Starts of the batches it is filling.
    in_flight: Vec<u64>,
    /// End of the furthest batch it has filled.
    done_to: u64,
    /// When its place last moved.
    moved_at: Instant,
    /// How long it has kept other streams waiting since it last began
    /// holding: at `HOLD_STALL` (`DECOUPLED_HOLD`) it is let go.
    kept_waiting: Duration,
}

impl Progress {
    /// The first sample it may still need.
    fn marker(&self) -> u64 {
        self.in_flight.iter().copied().min().unwrap_or(self.done_to)
    }
}

#[derive(Debug)]
struct State {
    entries: BTreeMap<u64, Entry>,
    bytes: u64,
    members: Vec<Progress>,
    /// When the first stream became live, and the streams that have been.
    first_live: Option<Instant>,
    ever_live: u64,
}

/// A source shared by several streams, running: its entries, its
/// streams' progress, and what it has counted.
#[derive(Debug)]
pub struct SourceShare {
    pub plan: Arc<SharePlan>,
    /// [`START_GRACE`] (shorter in tests).
    start_grace: Duration,
    pub files: Arc<SourceFiles>,
    state: Mutex<State>,
    changed: Condvar,
    decodes: AtomicU64,
    held_ns: Vec<AtomicU64>,
    /// Per stream: times it was let go (see [`ShareCounts::let_go`]).
    let_go: Vec<AtomicU64>,
    taken: Vec<AtomicU64>,
    /// `budget` bytes of the broker's memory budget, taken by the first
    /// of its streams to start.
    grant: Mutex<Option<Grant>>,
}

/// What a stream does for one sample's decode.
#[derive(Debug)]
pub enum Claim {
    /// Another stream decoded it at this scale.
    Ready(Arc<Rgb>),
    /// Decode it and [`Ticket::publish`] it: others wait for it.
    Mine(Ticket),
    /// Decode it for this stream only.
    Alone,
}

/// [`Claim::Alone`], said at debug level with why: which member, position
/// and index, the others that want it, whether it fits the budget.
fn alone((member, at, index): (usize, u64, u64), why: &str, (others, fits): (u64, bool)) -> Claim {
    tracing::debug!(member, at, index, others, fits, "decodes alone: {why}");
    Claim::Alone
}

/// A decode this stream promised the others; dropped unpublished (an
/// error), it is withdrawn and whoever waited decodes alone.
#[derive(Debug)]
pub struct Ticket {
    share: Arc<SourceShare>,
    member: usize,
    at: u64,
    denom: u32,
    done: bool,
}

impl Ticket {
    /// Leaves the decoded image for the other streams.
    pub fn publish(mut self, img: Arc<Rgb>) {
        self.done = true;
        let mut st = self.share.lock();
        let bit = 1u64 << self.member;
        if let Some(e) = st.entries.get_mut(&self.at) {
            if let Some(d) = e.decodes.iter_mut().find(|d| d.denom == self.denom) {
                d.img = Some(img);
            }
            e.want &= !bit;
        }
        SourceShare::drop_if_done(&mut st, self.at);
        drop(st);
        self.share.changed.notify_all();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.share.lock();
        if let Some(e) = st.entries.get_mut(&self.at) {
            e.decodes
                .retain(|d| !(d.denom == self.denom && d.img.is_none()));
        }
        SourceShare::drop_if_done(&mut st, self.at);
        drop(st);
        self.share.changed.notify_all();
    }
}

/// What a shared source counted, for one of its streams.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShareCounts {
    /// Streams on the source.
    pub streams: u32,
    /// Decodes run by all the source's streams together.
    pub decodes: u64,
    /// Images this stream took from another's decode.
    pub taken: u64,
    /// Time this stream's pipeline waited for slower streams.
    pub held: Duration,
    /// Times this stream was let go (it stopped moving, or kept the
    /// others waiting too long) and decoded alone until it caught up.
    pub let_go: u64,
    /// Decoded images left for other streams now, and their bytes.
    pub entries: u64,
    pub bytes: u64,
}

impl SourceShare {
    pub fn new(plan: Arc<SharePlan>) -> SourceShare {
        let now = Instant::now();
        let n = plan.members.len().min(MAX_MEMBERS);
        SourceShare {
            files: Arc::new(SourceFiles::new(plan.cache, plan.decoded_cache)),
            plan,
            start_grace: START_GRACE,
            state: Mutex::new(State {
                entries: BTreeMap::new(),
                bytes: 0,
                members: (0..n)
                    .map(|_| Progress {
                        live: false,
                        holding: true,
                        in_flight: Vec::new(),
                        done_to: 0,
                        moved_at: now,
                        kept_waiting: Duration::ZERO,
                    })
                    .collect(),
                first_live: None,
                ever_live: 0,
            }),
            changed: Condvar::new(),
            decodes: AtomicU64::new(0),
            held_ns: (0..n).map(|_| AtomicU64::new(0)).collect(),
            let_go: (0..n).map(|_| AtomicU64::new(0)).collect(),
            taken: (0..n).map(|_| AtomicU64::new(0)).collect(),
            grant: Mutex::new(None),
        }
    }

    /// The same share with another start grace (tests).
    #[cfg(test)]
    fn with_start_grace(mut self, grace: Duration) -> SourceShare {
        self.start_grace = grace;
        self
    }

    /// Takes the decoded images' budget from the broker's, once.
    pub fn reserve(&self, budget: &Arc<Budget>, uid: u32) -> Result<(), OverBudget> {
        let mut g = self.grant.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(budget.take(
                uid,
                Use::Arena,
                self.plan.budget,
                &format!("shared source `{}` (decoded_mib)", self.plan.name),
            )?);
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn counts(&self, member: usize) -> ShareCounts {
        let st = self.lock();
        ShareCounts {
            streams: self.plan.members.len() as u32,
            decodes: self.decodes.load(Ordering::Relaxed),
            taken: self.taken[member].load(Ordering::Relaxed),
            held: Duration::from_nanos(self.held_ns[member].load(Ordering::Relaxed)),
            let_go: self.let_go[member].load(Ordering::Relaxed),
            entries: st.entries.len() as u64,
            bytes: st.bytes,
        }
    }

    /// Counts one decode run by any of the source's streams.
    pub fn count_decode(&self) {
        self.decodes.fetch_add(1, Ordering::Relaxed);
    }

    /// The size of sample `at` (dataset index `index`) if a stream has
    /// read it. `turn`: a stream's own fill, which first waits its turn
    /// (a replayed batch neither waits nor holds).
    pub fn dims(&self, member: usize, at: u64, index: u64, turn: bool) -> Option<Dims> {
        let mut st = self.lock();
        if turn {
            st = self.wait_turn(st, member, at);
        }
        st.entries
            .get(&at)
            .filter(|e| e.index == index)
            .map(|e| e.dims)
    }

    /// Under [`DecodeShare::Once`]: the finest scale any stream of the
    /// source asks for this sample (the same whichever stream asks).
    pub fn finest(&self, epoch: u64, index: u64, dims: Dims) -> u32 {
        self.plan
            .members
            .iter()
            .map(|m| {
                let mut rng = m.transform.rng(epoch, index);
                let plan = m.transform.plan(dims.width, dims.height, &mut rng);
                m.transform.reduction(&plan, dims.width, dims.height)
            })
            .min()
            .unwrap_or(1)
    }

    /// The part of sample `index` (at `epoch`) decoded at `denom` that the
    /// streams taking that decode read: the union of their regions
    /// (`Transform::decode_region`), the same whichever stream asks;
    /// `None` (all of it) if one of them reads all. The streams taking it
    /// are those that decode at `denom`: under [`DecodeShare::Once`] all
    /// of them; under `Exact` those whose own scale it is (`reduced`: the
    /// source's `reduced_decode`, else every scale is 1).
    pub fn region(
        &self,
        (epoch, index): (u64, u64),
        dims: Dims,
        denom: u32,
        reduced: bool,
    ) -> Option<Region> {
        let mut union: Option<Region> = None;
        for m in &self.plan.members {
            let mut rng = m.transform.rng(epoch, index);
            let plan = m.transform.plan(dims.width, dims.height, &mut rng);
            let own = if reduced {
                m.transform.reduction(&plan, dims.width, dims.height)
            } else {
                1
            };
            if self.plan.policy == DecodeShare::Exact && own != denom {
                continue;
            }
            let r = m
                .transform
                .decode_region(&plan, dims.width, dims.height, denom)?;
            union = Some(union.map_or(r, |u| u.union(r)));
        }
        union
    }

    /// Takes sample `at` decoded at `denom` from another stream, waiting
    /// for one that is decoding it, or says who decodes it.
    /// `share`: a stream's own fill (a replayed batch only takes).
    pub fn claim(
        self: &Arc<Self>,
        member: usize,
        at: u64,
        index: u64,
        dims: Dims,
        denom: u32,
        share: bool,
    ) -> Claim {
        let bit = 1u64 << member;
        let bytes =
            u64::from(dims.width.div_ceil(denom)) * u64::from(dims.height.div_ceil(denom)) * 3;
        let mut st = self.lock();
        loop {
            let others = if share {
                self.wanting(&st, member, at)
            } else {
                0
            };
            let fits = st.bytes.saturating_add(bytes) <= self.plan.budget;
            let Some(e) = st.entries.get_mut(&at).filter(|e| e.index == index) else {
                if others == 0 || !fits || st.entries.contains_key(&at) {
                    return alone((member, at, index), "no entry to share", (others, fits));
                }
                st.entries.insert(
                    at,
                    Entry {
                        index,
                        dims,
                        decodes: vec![Decode { denom, img: None }],
                        want: others | bit,
                        bytes,
                    },
                );
                st.bytes += bytes;
                return Claim::Mine(self.ticket(member, at, denom));
            };
            match e.decodes.iter().find(|d| d.denom == denom) {
                Some(Decode { img: Some(img), .. }) => {
                    let img = img.clone();
                    e.want &= !bit;
                    Self::drop_if_done(&mut st, at);
                    self.taken[member].fetch_add(1, Ordering::Relaxed);
                    return Claim::Ready(img);
                }
                Some(Decode { img: None, .. }) => {
                    st = self
                        .changed
                        .wait_timeout(st, RECHECK)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                None => {
                    if !share || !fits || e.want & !bit == 0 {
                        let why = "its scale wanted by no other";
                        return alone((member, at, index), why, (e.want & !bit, fits));
                    }
                    e.decodes.push(Decode { denom, img: None });
                    e.want |= bit;
                    e.bytes += bytes;
                    st.bytes += bytes;
                    return Claim::Mine(self.ticket(member, at, denom));
                }
            }
        }
    }

    fn ticket(self: &Arc<Self>, member: usize, at: u64, denom: u32) -> Ticket {
        Ticket {
            share: self.clone(),
            member,
            at,
            denom,
            done: false,
        }
    }

    /// The streams other than `member` an entry at `at` is left for: the
    /// live ones holding the source that have not passed it, and those
    /// still [`expected`](Self::expected).
    fn wanting(&self, st: &State, member: usize, at: u64) -> u64 {
        let live = st
            .members
            .iter()
            .enumerate()
            .filter(|&(k, p)| k != member && p.live && p.holding && p.marker() <= at)
            .fold(0, |acc, (k, _)| acc | (1 << k));
        (live | self.expected(st, at)) & !(1 << member)
    }

    /// The streams never live yet, while the start grace lasts and `at`
    /// is within their reach (see [`START_GRACE`]).
    fn expected(&self, st: &State, at: u64) -> u64 {
        let Some(t) = st.first_live else { return 0 };
        if t.elapsed() >= self.start_grace || at >= self.plan.window.saturating_mul(REACH_WINDOWS) {
            return 0;
        }
        let all = u64::MAX >> (64 - st.members.len().clamp(1, MAX_MEMBERS));
        all & !st.ever_live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::pipeline::decode::Format;
    use crate::pipeline::transform::Geometry;
    use batchcast::DType;

    fn share(n: usize, window: u64, budget: u64) -> Arc<SourceShare> {
        share_with_grace(n, window, budget, Duration::ZERO)
    }

    fn share_with_grace(n: usize, window: u64, budget: u64, grace: Duration) -> Arc<SourceShare> {
        let t = Transform {
            dtype: DType::U8,
            ..Transform::of(Geometry::RandomResizedCrop {
                size: (8, 8),
                scale: (0.08, 1.0),
                ratio: (0.75, 4.0 / 3.0),
            })
        };
        let members = (0..n)
            .map(|i| MemberSpec {
                stream: format!("s{i}"),
                transform: t.clone(),
                decoupled: false,
            })
            .collect();
        Arc::new(
            SourceShare::new(Arc::new(SharePlan {
                name: "src".into(),
                policy: DecodeShare::Exact,
                window,
                budget,
                members,
                cache: CacheSize::Bytes(0),
                decoded_cache: CacheSize::Bytes(0),
            }))
            .with_start_grace(grace),
        )
    }

    const DIMS: Dims = Dims {
        width: 4,
        height: 4,
        format: Format::Jpeg,
    };

    fn img() -> Arc<Rgb> {
        Arc::new(Rgb {
            width: 4,
            height: 4,
            data: vec![7; 48],
            decoded: None,
            cut: false,
        })
    }

    #[test]
    fn the_first_stream_decodes_and_the_others_take_it_once() {
        let s = share(3, 100, 1 << 20);
        for m in 0..3 {
            s.set_live(m, true);
            s.begin(m, 0);
        }
        let Claim::Mine(t) = s.claim(0, 0, 5, DIMS, 1, true) else {
            panic!("the first stream decodes")
        };
        t.publish(img());
        assert_eq!(s.dims(1, 0, 5, true), Some(DIMS));
        assert!(matches!(s.claim(1, 0, 5, DIMS, 1, true), Claim::Ready(_)));
        assert_eq!(s.counts(0).entries, 1, "stream 2 has not taken it yet");
        assert!(matches!(s.claim(2, 0, 5, DIMS, 1, true), Claim::Ready(_)));
        let c = s.counts(2);
        assert_eq!(
            (c.entries, c.bytes, c.taken),
            (0, 0, 1),
            "taken by all: gone"
        );
        // Once the others have passed it, a second take (a padded split
        // repeats a sample) decodes alone and leaves nothing.
        s.end(0, 0, 4);
        s.end(2, 0, 4);
        assert!(matches!(s.claim(1, 0, 5, DIMS, 1, true), Claim::Alone));
    }

    #[test]
    fn another_scale_or_another_index_is_decoded_apart() {
        let s = share(3, 100, 1 << 20);
        for m in 0..3 {
            s.set_live(m, true);
            s.begin(m, 0);
        }
        let Claim::Mine(t) = s.claim(0, 0, 5, DIMS, 1, true) else {
            panic!()
        };
        t.publish(img());
        // Stream 1 wants half scale: it claims that one too (stream 2 may
        // want it), fails, and withdraws it.
        let Claim::Mine(t) = s.claim(1, 0, 5, DIMS, 2, true) else {
            panic!("a second scale is claimed")
        };
        drop(t);
        assert_eq!(
            s.dims(2, 0, 6, true),
            None,
            "another index is not this entry"
        );
        assert!(matches!(s.claim(2, 0, 6, DIMS, 1, true), Claim::Alone));
        assert!(matches!(s.claim(2, 0, 5, DIMS, 1, true), Claim::Ready(_)));
        // A replayed batch takes but never claims.
        assert!(matches!(s.claim(2, 0, 5, DIMS, 4, false), Claim::Alone));
        assert!(matches!(s.claim(1, 0, 5, DIMS, 1, true), Claim::Ready(_)));
        assert_eq!(s.counts(0).entries, 0);
    }

    #[test]
    fn nothing_is_left_for_streams_that_are_not_live_or_past_it_or_over_budget() {
        let s = share(3, 100, 100);
        s.set_live(0, true);
        s.begin(0, 0);
        assert!(
            matches!(s.claim(0, 0, 1, DIMS, 1, true), Claim::Alone),
            "alone"
        );
        s.set_live(1, true);
        s.begin(1, 10);
        assert!(
            matches!(s.claim(0, 3, 1, DIMS, 1, true), Claim::Alone),
            "stream 1 is past sample 3"
        );
        let Claim::Mine(t) = s.claim(0, 12, 1, DIMS, 1, true) else {
            panic!()
        };
        t.publish(img());
        // 48 bytes held; another 48 fits the 100, a third does not.
        let Claim::Mine(t) = s.claim(0, 13, 2, DIMS, 1, true) else {
            panic!()
        };
        t.publish(img());
        assert!(
            matches!(s.claim(0, 14, 3, DIMS, 1, true), Claim::Alone),
            "budget"
        );
        // Stream 1 leaves: what was left for it goes.
        s.set_live(1, false);
        assert_eq!(s.counts(0).bytes, 0);
    }

    /// A stream that becomes live within the start grace takes what the
    /// first decoded before it came; after the grace nothing waits for
    /// one that never came, and one that comes then decodes alone.
    #[test]
    fn a_stream_starting_a_moment_late_takes_the_first_decodes() {
        // A grace far longer than the steps before its end take, however
        // loaded the machine: the test sleeps past it, measured from here.
        let grace = Duration::from_millis(1500);
        let t0 = Instant::now();
        let s = share_with_grace(3, 10, 1 << 20, grace);
        s.set_live(0, true);
        s.begin(0, 0);
        let Claim::Mine(t) = s.claim(0, 0, 5, DIMS, 1, true) else {
            panic!("left for the streams not live yet")
        };
        t.publish(img());
        s.end(0, 0, 4);
        assert_eq!(
            s.counts(0).entries,
            1,
            "passed by every live stream, still expected"
        );
        // Beyond the reach of a late stream, nothing is left for it.
        assert!(matches!(
            s.claim(0, 10 * REACH_WINDOWS, 9, DIMS, 1, true),
            Claim::Alone
        ));
        s.set_live(1, true);
        s.begin(1, 0);
        assert!(matches!(s.claim(1, 0, 5, DIMS, 1, true), Claim::Ready(_)));
        assert_eq!(s.counts(1).taken, 1);
        assert!(t0.elapsed() < grace, "the steps above outran the grace");
        assert_eq!(s.counts(0).entries, 1, "stream 2 may still come");
        std::thread::sleep((grace + Duration::from_millis(200)).saturating_sub(t0.elapsed()));
        s.end(1, 0, 4);
        assert_eq!(
            s.counts(0).entries,
            0,
            "the grace is over: nobody else is expected"
        );
        s.set_live(2, true);
        s.begin(2, 0);
        assert!(matches!(s.claim(2, 0, 5, DIMS, 1, true), Claim::Alone));
    }

    #[test]
    fn a_stream_waits_for_a_moving_slower_one_and_lets_a_stalled_one_go() {
        let s = share(2, 10, 1 << 20);
        s.set_live(0, true);
        s.set_live(1, true);
        s.begin(1, 0);
        // Stream 1 moves every 20 ms up to sample 20: stream 0 at 25
        // waits until it is past 15.
        let mover = {
            let s = s.clone();
            std::thread::spawn(move || {
                for at in 0..4u64 {
                    std::thread::sleep(Duration::from_millis(20));
                    s.begin(1, (at + 1) * 5);
                    s.end(1, at * 5, (at + 1) * 5);
                }
            })
        };
        let t0 = Instant::now();
        s.dims(0, 25, 0, true);
        assert!(
            t0.elapsed() >= Duration::from_millis(50),
            "{:?}",
            t0.elapsed()
        );
        mover.join().unwrap();
        assert_eq!(s.counts(1).let_go, 0, "a moving stream is waited for");
        // Now stream 1 stops at 20 (batch 20..25 in flight): stream 0 at 40
        // waits about HOLD_STALL, then goes on without it.
        let t0 = Instant::now();
        s.dims(0, 40, 0, true);
        assert!(t0.elapsed() >= Duration::from_millis(500));
        assert!(s.counts(0).held >= Duration::from_millis(500));
        // Released: no more waiting, and nothing left for it.
        let held = s.counts(0).held;
        s.dims(0, 60, 0, true);
        assert_eq!(s.counts(0).held, held);
        assert!(matches!(s.claim(0, 60, 1, DIMS, 1, true), Claim::Alone));
        assert_eq!((s.counts(0).let_go, s.counts(1).let_go), (0, 1));
    }

    #[test]
    fn a_stream_waiting_for_anothers_decode_gets_it() {
        let s = share(2, 100, 1 << 20);
        for m in 0..2 {
            s.set_live(m, true);
            s.begin(m, 0);
        }
        let Claim::Mine(t) = s.claim(0, 0, 5, DIMS, 1, true) else {
            panic!()
        };
        let taker = {
            let s = s.clone();
            std::thread::spawn(move || matches!(s.claim(1, 0, 5, DIMS, 1, true), Claim::Ready(_)))
        };
        std::thread::sleep(Duration::from_millis(30));
        t.publish(img());
        assert!(taker.join().unwrap());
    }
}
