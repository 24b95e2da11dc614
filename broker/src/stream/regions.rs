//! The host arena's regions: where the ring is, and where it left the
//! batches that stopped consumers held. The arena's fd holds the rings
//! [`REGIONS`] times over; the pipeline writes the current region, and
//! every consumer reads its batches there.
//!
//! # Rules
//!
//! * A consumer that took the batch the ring needs next and keeps it past
//!   the hold limit (a program stopped mid-step, holding its batch) does
//!   not hold the ring: the ring **moves** to another region. Every batch
//!   the pipeline wrote is copied there (at the same place), the
//!   consumer's batches are given back to the hub as if released, and
//!   every consumer is told ([`ServerMsg::Arena`], in order with its
//!   batches) that the batches noticed from now on are in the new region.
//!   The stopped one reads what it held where it was, is cut to replay,
//!   and reads on when it continues.
//! * The region left keeps its bytes until nobody may read them: the
//!   stopped consumers released (or left with) what they held there, and
//!   every batch published before the move was released by everyone
//!   (a consumer reads a batch noticed before the move in either region:
//!   the bytes are the same). Nobody writes it meanwhile.
//! * A region is allocated the first time the ring moves there, its bytes
//!   charged to the uid of the consumer whose batch made it move (sealed
//!   memory cannot be given back before the stream ends, so it stays
//!   charged, and reused by later moves). With no region free and none
//!   the budget lets it allocate, that consumer is detached instead, told
//!   why; so is one that still holds batches an earlier move left behind
//!   (one consumer holds at most one region).
//! * A pipeline thread writes the region that was current when it began
//!   its batch; if the ring moved meanwhile, its batch is copied to the
//!   current region before it is published. A region where a batch is
//!   being written is not free.
//! * The ring never moves once a GPU copier reads the host arena (its
//!   host memory is page-locked where it was), nor for a producer's
//!   stream (the producer writes where it mapped).

use std::collections::{BTreeSet, HashMap};

use batchcast::proto::ServerMsg;
use batchcast::shm::Mapping;

use super::cells;
use super::conn::{Conn, notify};
use super::{Inner, Stream};
use crate::budget::{Grant, OverBudget, Use};
use crate::hub::{ConsumerId, Hub};

/// Regions of a stream the broker writes: the ring's, and room for the
/// batches of up to three stopped consumers at once (more wait in turn,
/// or are detached).
pub(crate) const REGIONS: u32 = 4;

/// What a region holds.
#[derive(Debug)]
enum Holds {
    /// Nothing anyone reads.
    Nothing,
    /// The ring: where batches are written and read now.
    Ring,
    /// What the ring left when it moved on: batches stopped consumers
    /// held (by consumer), and the batches published before the move
    /// (seq below `before`), which others may still read here.
    Left {
        held: HashMap<ConsumerId, BTreeSet<u64>>,
        before: u64,
    },
}

#[derive(Debug)]
struct Region {
    holds: Holds,
    /// Allocated (region 0 always: the stream's own arena grant).
    allocated: bool,
    /// Its bytes in the budget, once allocated (region 0: none here).
    _grant: Option<Grant>,
    /// Pipeline threads writing a batch here.
    writing: u32,
}

/// Why the ring could not move.
#[derive(Debug, thiserror::Error)]
pub(super) enum Stuck {
    #[error(
        "every other region of the stream's host arena still holds batches of stopped consumers"
    )]
    Full,
    #[error("{0}")]
    OverBudget(#[from] OverBudget),
    #[error("it still holds batches the ring left behind for it when it held the ring before")]
    Again,
    #[error("allocating a region of the host arena: {0}")]
    Memory(batchcast::Error),
}

/// The regions of one stream's host arena (see the module's rules).
#[derive(Debug)]
pub(super) struct Regions {
    now: u32,
    regions: Vec<Region>,
    /// A GPU copier reads the host arena: the ring stays.
    pinned: bool,
    /// Times the ring moved.
    pub(super) moves: u64,
}

impl Regions {
    /// `count` regions, the ring in the first.
    pub(super) fn new(count: u32) -> Regions {
        Regions {
            now: 0,
            regions: (0..count.max(1))
                .map(|r| Region {
                    holds: if r == 0 { Holds::Ring } else { Holds::Nothing },
                    allocated: r == 0,
                    _grant: None,
                    writing: 0,
                })
                .collect(),
            pinned: false,
            moves: 0,
        }
    }

    /// Where the ring is.
    pub(super) fn now(&self) -> u32 {
        self.now
    }

    pub(super) fn count(&self) -> u32 {
        self.regions.len() as u32
    }

    /// Whether the ring may move (more than one region, no GPU copier).
    pub(super) fn movable(&self) -> bool {
        self.regions.len() > 1 && !self.pinned
    }

    /// A GPU copier is about to read the host arena where the ring is:
    /// it stays there from now on. The region's index.
    pub(super) fn pin(&mut self) -> u32 {
        self.pinned = true;
        self.now
    }

    /// A pipeline thread begins a batch: the region it writes.
    pub(super) fn begin(&mut self) -> u32 {
        self.regions[self.now as usize].writing += 1;
        self.now
    }

    /// A pipeline thread finished (or gave up) a batch it began in `r`.
    pub(super) fn end(&mut self, r: u32) {
        let w = &mut self.regions[r as usize].writing;
        *w = w.saturating_sub(1);
    }

    /// Consumer `id` released shared batch `seq`: whether it was one the
    /// ring left behind for it (then the hub is not told again).
    pub(super) fn release_left(&mut self, id: ConsumerId, seq: u64) -> bool {
        for r in &mut self.regions {
            if let Holds::Left { held, .. } = &mut r.holds
                && let Some(seqs) = held.get_mut(&id)
                && seqs.remove(&seq)
            {
                if seqs.is_empty() {
                    held.remove(&id);
                }
                return true;
            }
        }
        false
    }

    /// Whether consumer `id` holds batches in a region the ring left.
    pub(super) fn holds_left(&self, id: ConsumerId) -> bool {
        self.regions
            .iter()
            .any(|r| matches!(&r.holds, Holds::Left { held, .. } if held.contains_key(&id)))
    }

    /// Consumer `id` left: what it held in regions left behind is free.
    pub(super) fn forget(&mut self, id: ConsumerId) {
        for r in &mut self.regions {
            if let Holds::Left { held, .. } = &mut r.holds {
                held.remove(&id);
            }
        }
    }

    /// Batches the ring left held by stopped consumers, for stats.
    pub(super) fn held_left(&self) -> usize {
        self.regions
            .iter()
            .map(|r| match &r.holds {
                Holds::Left { held, .. } => held.values().map(BTreeSet::len).sum(),
                _ => 0,
            })
            .sum()
    }

    /// Regions left behind that nobody may read any more are free again
    /// (`oldest`: the oldest batch still in a host slot).
    fn settle(&mut self, oldest: Option<u64>) {
        for r in &mut self.regions {
            if let Holds::Left { held, before } = &r.holds
                && held.is_empty()
                && oldest.is_none_or(|o| o >= *before)
                && r.writing == 0
            {
                r.holds = Holds::Nothing;
            }
        }
    }

    /// The region the ring may move to, once the regions nobody reads
    /// any more are freed (`oldest`: the oldest batch still in a host
    /// slot): one holding nothing, allocated if one is, else one to
    /// allocate ([`Target::Allocate`]: the runtime charges and maps it,
    /// then says so with [`Regions::allocated`]).
    pub(super) fn target(&mut self, oldest: Option<u64>) -> Result<Target, Stuck> {
        self.settle(oldest);
        let free = |r: &Region| matches!(r.holds, Holds::Nothing) && r.writing == 0;
        if let Some(i) = self.regions.iter().position(|r| free(r) && r.allocated) {
            return Ok(Target::Free(i as u32));
        }
        let i = self.regions.iter().position(free).ok_or(Stuck::Full)?;
        Ok(Target::Allocate(i as u32))
    }

    /// Region `i` was allocated, its bytes charged by `grant` (kept until
    /// the stream ends: sealed memory cannot be given back before).
    pub(super) fn allocated(&mut self, i: u32, grant: Option<Grant>) {
        let r = &mut self.regions[i as usize];
        r.allocated = true;
        r._grant = grant;
    }

    /// The ring moved to region `to` (a [`Regions::target`]); the region
    /// it left keeps `left`, what each stopped consumer held there, and
    /// the batches published before `before`.
    pub(super) fn moved(&mut self, to: u32, left: HashMap<ConsumerId, BTreeSet<u64>>, before: u64) {
        let from = self.now as usize;
        self.regions[from].holds = Holds::Left { held: left, before };
        self.regions[to as usize].holds = Holds::Ring;
        self.now = to;
        self.moves += 1;
    }

    /// Whether every region but the ring's holds nothing once `oldest` is
    /// the oldest batch in a host slot (nothing leaked: tests).
    #[cfg(test)]
    pub(super) fn all_free_but_the_ring(&mut self, oldest: Option<u64>) -> bool {
        self.settle(oldest);
        self.regions
            .iter()
            .all(|r| matches!(r.holds, Holds::Nothing | Holds::Ring))
    }
}

/// Where the ring may move (see [`Regions::target`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Target {
    /// A region allocated before, holding nothing now.
    Free(u32),
    /// A region never allocated: the runtime allocates it first.
    Allocate(u32),
}

/// Of the holders the hold rule named, `ids` the ring may move away from
/// and `again` those still holding what an earlier move left (detached:
/// one consumer holds at most one region): whether to go on with them now
/// (see the module's rules). `early`: a move-only round, made only where
/// the ring can move at once (`ready`, asked of the first of them), never
/// detaching anyone. The runtime and the hold simulation decide through
/// this one function.
pub(super) fn movers(
    (ids, again): (Vec<ConsumerId>, Vec<ConsumerId>),
    early: bool,
    ready: impl FnOnce(ConsumerId) -> bool,
) -> Option<(Vec<ConsumerId>, Vec<ConsumerId>)> {
    if early && (!again.is_empty() || !ids.first().is_some_and(|&id| ready(id))) {
        return None;
    }
    Some((ids, again))
}

/// A pipeline thread filled batch `seq` (`samples` samples) in region
/// `r`: copied to where the ring is now if it moved meanwhile. Call
/// before the batch is published.
pub(super) fn filled(s: &Stream, inner: &mut Inner, r: u32, (seq, samples): (u64, u64)) {
    let now = inner.fill.regions.now;
    inner.fill.regions.end(r);
    if r != now {
        // SAFETY of the copy: batch `seq` is still being filled (this
        // thread's claim), so nobody reads its cells in either region.
        cells::copy_units(&s.rings, &s.plan.rings, (r, now), &[(seq, samples)]);
    }
}

/// What a region charged to consumer `c`'s uid is, in the budget's words.
fn whom(s: &Stream, c: &Conn) -> String {
    format!(
        "stream `{}`: the batches {} (pid {}) held",
        s.name(),
        c.peer.name,
        c.peer.pid
    )
}

/// The region the ring may move to on behalf of consumer `id`,
/// allocated now (charged to its uid) where none allocated is free.
fn reserve(s: &Stream, inner: &mut Inner, id: ConsumerId) -> Result<u32, Stuck> {
    let oldest = inner.hub.view().ring().oldest_published();
    let i = match inner.fill.regions.target(oldest)? {
        Target::Free(i) => return Ok(i),
        Target::Allocate(i) => i,
    };
    let Some(c) = inner.conns.get(&id) else {
        return Err(Stuck::Full);
    };
    let grant = s
        .budget
        .take(c.peer.uid, Use::Arena, s.arena.region_len(), &whom(s, c))?;
    s.arena.allocate_region(i).map_err(Stuck::Memory)?;
    inner.fill.regions.allocated(i, Some(grant));
    Ok(i)
}

/// Whether the ring could move now on behalf of consumer `id` (a region
/// free, allocated now if none is and its uid's budget pays for one):
/// asked before a move the default pace would make ahead of the hold
/// limit, which never detaches anyone (see `super::decouple`).
pub(super) fn ready(s: &Stream, inner: &mut Inner, id: ConsumerId) -> bool {
    reserve(s, inner, id).is_ok()
}

/// Moves the ring away from the batches the consumers `ids` hold (see
/// the module's rules), after they were cut: those are given back to the
/// hub, the written batches copied to the new region, and every consumer
/// told. The new region, or why the ring could not move (then nothing
/// changed).
pub(super) fn move_from(s: &Stream, inner: &mut Inner, ids: &[ConsumerId]) -> Result<u32, Stuck> {
    let first = *ids.first().ok_or(Stuck::Full)?;
    let to = reserve(s, inner, first)?;
    let from = inner.fill.regions.now;
    let left = give_back_held(&mut inner.hub, ids);
    let ring = inner.hub.view().ring();
    let before = ring.head();
    cells::copy_units(&s.rings, &s.plan.rings, (from, to), &ring.written());
    inner.fill.regions.moved(to, left, before);
    let all: Vec<ConsumerId> = inner.conns.keys().copied().collect();
    for c in all {
        notify(inner, c, ServerMsg::Arena(to));
    }
    Ok(to)
}

/// Gives back to the hub, as if released, the batches the consumers
/// `ids` hold (the ring moves away from them): what each held, to be
/// left with them in the region the ring leaves.
pub(super) fn give_back_held(
    hub: &mut Hub,
    ids: &[ConsumerId],
) -> HashMap<ConsumerId, BTreeSet<u64>> {
    let mut left = HashMap::new();
    for &id in ids {
        let held: BTreeSet<u64> = hub
            .view()
            .reader(id)
            .map(|c| c.held().iter().copied().collect())
            .unwrap_or_default();
        for &seq in &held {
            // Held, so known to the hub: a failure is a bookkeeping bug.
            if let Err(e) = hub.release(id, seq) {
                tracing::error!(consumer = id, seq, "moving the ring: {e}");
            }
        }
        if !held.is_empty() {
            left.insert(id, held);
        }
    }
    left
}

/// The stream's host arena mapped once per region, writable.
pub(super) type RegionMaps = Vec<Mapping>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A move: what the region the ring leaves holds, as `move_from`
    /// records it.
    fn leave(r: &mut Regions, to: u32, held: &[(ConsumerId, &[u64])], before: u64) {
        let held = held
            .iter()
            .map(|&(id, seqs)| (id, seqs.iter().copied().collect()))
            .collect();
        r.moved(to, held, before);
    }

    #[test]
    fn a_region_left_is_free_once_its_holders_released_and_older_batches_are_gone() {
        let mut r = Regions::new(3);
        assert_eq!(
            r.target(None).ok(),
            Some(Target::Allocate(1)),
            "none allocated but the ring's"
        );
        r.allocated(1, None);
        leave(&mut r, 1, &[(7, &[4, 5])], 10);
        // Held by consumer 7, and batches before 10 may still be read.
        assert_eq!(r.target(Some(12)).ok(), Some(Target::Allocate(2)));
        assert!(matches!(r.regions[0].holds, Holds::Left { .. }));
        assert!(!r.release_left(8, 4), "not consumer 8's");
        assert!(r.release_left(7, 4) && r.release_left(7, 5));
        assert!(!r.release_left(7, 5), "released once");
        assert_eq!(r.target(Some(9)).ok(), Some(Target::Allocate(2)));
        assert!(
            matches!(r.regions[0].holds, Holds::Left { .. }),
            "batch 9, published before the move, may be read there"
        );
        // Allocated regions are reused before new ones are taken.
        assert_eq!(r.target(Some(10)).ok(), Some(Target::Free(0)));
        assert!(matches!(r.regions[0].holds, Holds::Nothing));
        assert!(r.all_free_but_the_ring(Some(10)));
        assert_eq!(r.moves, 1);
    }

    #[test]
    fn a_region_a_pipeline_thread_still_writes_is_not_free() {
        let mut r = Regions::new(2);
        r.allocated(1, None);
        let began = r.begin();
        leave(&mut r, 1, &[], 0);
        assert!(matches!(r.target(None), Err(Stuck::Full)));
        assert!(matches!(r.regions[0].holds, Holds::Left { .. }));
        r.end(began);
        assert_eq!(r.target(None).ok(), Some(Target::Free(0)));
    }

    #[test]
    fn a_consumer_leaving_frees_what_it_held_and_a_copier_pins_the_ring() {
        let mut r = Regions::new(4);
        leave(&mut r, 1, &[(3, &[1])], 0);
        assert_eq!(r.target(None).ok(), Some(Target::Allocate(2)));
        assert_eq!(r.held_left(), 1);
        assert!(r.holds_left(3) && !r.holds_left(4));
        r.forget(3);
        assert_eq!(r.held_left(), 0);
        assert!(r.all_free_but_the_ring(None));
        assert!(r.movable());
        r.pin();
        assert!(!r.movable(), "a GPU copier reads where the ring is");
        assert!(
            !Regions::new(1).movable(),
            "a producer's stream has one region"
        );
    }

    #[test]
    fn the_holders_named_early_move_only_where_a_region_is_ready() {
        // At the limit: those holding what a move left get no second region.
        assert_eq!(
            movers((vec![1], vec![2]), false, |_| false),
            Some((vec![1], vec![2]))
        );
        // Early: only where the ring can move now, and nobody is refused.
        assert_eq!(movers((vec![1], vec![]), true, |_| false), None);
        assert_eq!(
            movers((vec![1], vec![]), true, |_| true),
            Some((vec![1], vec![]))
        );
        assert_eq!(movers((vec![1], vec![2]), true, |_| true), None);
    }
}
