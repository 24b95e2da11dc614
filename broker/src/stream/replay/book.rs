//! The book of one consumer's replay: its arena (a ring of `slots` of its
//! batches, in the budget under its uid, living as long as [`ArenaLife`]
//! says), which batches are being made, made, sent and released, and where
//! the stretch under way ends. No locks, no I/O: the stream drives it
//! under its lock ([`super`]).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use batchcast::deal::Deal;
use batchcast::proto::{Position, ReplayGrant, ReplayReady};
use batchcast::rotation::{self, Rotation};
use batchcast::schema::{RingLayout, Schema};
use batchcast::shm::{Arena, Fault, Mapping, RingView};

use crate::budget::Grant;
use crate::gpu::Piece;
use crate::hub::ConsumerId;
use crate::stream::error::ReplayError;

/// How long a consumer's replay arena lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::stream) enum ArenaLife {
    /// Until the stretch it was made for is replayed and released
    /// (lockstep: a joiner's catch-up); its memory goes back then.
    UntilDone,
    /// As long as its consumer (decoupled pace: a cut may open another
    /// stretch at any time, up to the stream's end).
    WhileConnected,
}

/// Batches in the replay arena of a consumer with `window`: its window,
/// one being made, and one more so two threads can work ahead. Its
/// mailbox and outbox have room for as many more messages.
pub(in crate::stream) fn slots(window: u32) -> u32 {
    window.saturating_add(2)
}

/// A replay arena made before the consumer joins (outside the hub's lock).
#[derive(Debug)]
pub(in crate::stream) struct Prepared {
    arena: Arc<Arena>,
    rings: Arc<Mapping>,
    layout: RingLayout,
    slots: u32,
    /// Its memory's allocation, once made (see [`Prepared::make`]).
    committed: Arc<OnceLock<Result<(), String>>>,
    /// What pays for the arena's bytes, given back when it is dropped.
    _grant: Grant,
}

impl Prepared {
    /// The arena of a consumer of batch size `schema.batch_size`: [`slots`]
    /// of its batches for a `window`, paid for by `grant` (its bytes:
    /// [`Prepared::bytes`]).
    pub(in crate::stream) fn layout(
        schema: &Schema,
        window: u32,
    ) -> Result<RingLayout, ReplayError> {
        Ok(RingLayout::for_schema(schema, slots(window)).map_err(batchcast::Error::from)?)
    }

    /// Makes the arena, its bytes paid for by `grant`. `commit`: its memory
    /// is allocated now (it replays at once: a resume, a joiner `now`),
    /// while the broker serves others; otherwise (kept for a cut that may
    /// never come) only when its first replayed batch starts
    /// ([`Replay::commit`]): a sweep of trainers none of which is ever cut
    /// commits none of it. Faulted in as the pipeline writes either way
    /// (see `Stream::start`).
    pub(in crate::stream) fn make(
        name: &str,
        layout: RingLayout,
        (window, commit): (u32, bool),
        grant: Grant,
    ) -> Result<Prepared, ReplayError> {
        let name = format!("{name}-replay");
        let arena = match commit {
            true => Arena::create(&name, layout.arena_bytes, Fault::Lazily)?,
            false => Arena::reserve(&name, layout.arena_bytes, 1, Fault::Lazily)?,
        };
        let rings =
            Mapping::rings_faulted(arena.fd(), &RingView::of(&layout), true, Fault::Lazily)?;
        arena.seal_writes()?;
        Ok(Prepared {
            arena: Arc::new(arena),
            rings: Arc::new(rings),
            layout,
            slots: slots(window),
            committed: Arc::new(match commit {
                true => OnceLock::from(Ok(())),
                false => OnceLock::new(),
            }),
            _grant: grant,
        })
    }

    /// Starts replaying `from..to` in batches of `batch` (a group member:
    /// its own runs of `deal`, each at most `batch`); the grant for the
    /// welcome and the fd the consumer maps. The arena lives as `life`
    /// says; no stretch goes past `limit`, the stream's end.
    pub(in crate::stream) fn start(
        self,
        (from, to): (Position, Position),
        (batch, deal): (u64, Option<Deal>),
        per_epoch: u64,
        (life, limit): (ArenaLife, Position),
        now: Instant,
    ) -> Result<(Replay, ReplayGrant, OwnedFd), ReplayError> {
        let fd = self
            .arena
            .fd()
            .try_clone_to_owned()
            .map_err(|e| ReplayError::Arena(e.into()))?;
        let grant = ReplayGrant {
            rings: self.layout.clone(),
            from,
            to,
            device: None,
        };
        let mut replay = Replay {
            mem: self,
            shape: Shape {
                batch,
                deal,
                per_epoch,
            },
            cursor: from,
            rotation: None,
            to: Some(to),
            limit,
            life,
            next_seq: 0,
            live: BTreeMap::new(),
            sent: 0,
            active: now,
            moved: false,
        };
        replay.seek_own_run();
        Ok((replay, grant, fd))
    }
}

/// One consumer's replay in progress.
#[derive(Debug)]
pub(in crate::stream) struct Replay {
    /// Its arena: the rings its batches are made in, and their slots.
    mem: Prepared,
    /// The batches it replays.
    shape: Shape,
    /// The next batch to start, and where replay ends (`None`: open, a
    /// cut consumer's until it merges back; never past `limit`, the
    /// stream's end).
    pub(in crate::stream) cursor: Position,
    /// The cursor's epoch, or a later one, is read rotated
    /// ([`batchcast::rotation`]): set when the consumer rotates into an
    /// epoch (or resumes so), gone once the cursor passes its end.
    pub(in crate::stream) rotation: Option<Rotation>,
    pub(in crate::stream) to: Option<Position>,
    limit: Position,
    pub(in crate::stream) life: ArenaLife,
    next_seq: u64,
    /// Batches started and not released, by seq.
    live: BTreeMap<u64, Entry>,
    /// Batches below this were sent.
    sent: u64,
    /// When its stretch began or its consumer last released a batch.
    active: Instant,
    /// Its consumer released a replayed batch since the stretch began: it
    /// reads, so it may merge back (one that does not would only pin the
    /// ring again, see `decouple::merge`).
    moved: bool,
}

/// The batches a replay makes.
#[derive(Debug, Clone)]
struct Shape {
    batch: u64,
    /// A group member's share: only its own runs are replayed.
    deal: Option<Deal>,
    per_epoch: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    epoch: u64,
    first: u64,
    samples: u64,
    /// The consumer's last batch of its epoch.
    ends_epoch: bool,
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Making,
    /// Made, and being copied to its consumer's GPU (a device consumer's:
    /// sent once the copy is reported).
    Copying,
    Made,
    Sent,
}

/// A replayed batch for a pipeline thread to make: `samples` samples of
/// `epoch` from sample `first` on, into `spans` of `rings`.
#[derive(Debug)]
pub(in crate::stream) struct ReplayJob {
    pub(in crate::stream) id: ConsumerId,
    pub(in crate::stream) seq: u64,
    pub(in crate::stream) epoch: u64,
    pub(in crate::stream) first: u64,
    pub(in crate::stream) samples: u64,
    pub(in crate::stream) rings: Arc<Mapping>,
    /// Per field: offset and length in `rings`.
    pub(in crate::stream) spans: Vec<(u64, u64)>,
    /// The arena's memory, to allocate before writing where it was kept
    /// uncommitted ([`Prepared::make`]); `None` once it is.
    pub(in crate::stream) commit: Option<Commit>,
}

/// A replay arena's memory, allocated by the first pipeline thread that
/// writes there, outside the stream's lock (others wait for it), once.
#[derive(Debug, Clone)]
pub(in crate::stream) struct Commit {
    arena: Arc<Arena>,
    done: Arc<OnceLock<Result<(), String>>>,
}

impl Commit {
    /// Allocates the arena's memory unless that was done (or failed:
    /// the same error again).
    pub(in crate::stream) fn ensure(&self) -> Result<(), String> {
        self.done
            .get_or_init(|| self.arena.allocate_region(0).map_err(|e| e.to_string()))
            .clone()
    }
}

impl Replay {
    /// Where this stretch of replay stops.
    fn end(&self) -> Position {
        self.to.unwrap_or(self.limit).min(self.limit)
    }

    /// A stretch of replay is under way (batches are still to start).
    pub(in crate::stream) fn running(&self) -> bool {
        self.cursor < self.end()
    }

    /// Every batch started was sent.
    pub(in crate::stream) fn settled(&self) -> bool {
        self.sent == self.next_seq
    }

    /// An open stretch (a cut consumer's, until it merges back).
    pub(in crate::stream) fn open(&self) -> bool {
        self.to.is_none()
    }

    /// Whether its releases matter to a pipeline thread: a stretch is
    /// running or open, or batches of it are in flight.
    pub(in crate::stream) fn active(&self) -> bool {
        self.running() || self.open() || self.in_flight() > 0
    }

    /// Opens a stretch from `from` (the consumer was cut from the shared
    /// stream there); seqs go on from the last stretch's.
    pub(in crate::stream) fn reopen(&mut self, from: Position, now: Instant) {
        self.cursor = from;
        self.to = None;
        self.active = now;
        self.moved = false;
        self.seek_own_run();
    }

    /// Whether its consumer reads its replay: it released a replayed
    /// batch since the stretch began, or there is nothing left to replay
    /// (the stream's end). A stopped one's replay is made ahead of it, up
    /// to its window, and waits; one just cut has none made yet.
    pub(in crate::stream) fn read(&self) -> bool {
        self.moved || (self.live.is_empty() && self.cursor >= self.limit)
    }

    /// A lockstep joiner's stretch (it ends where the shared stream
    /// begins for it) is under way and its consumer released a batch, or
    /// the stretch began, less than `within` before `now`: it is catching up.
    pub(in crate::stream) fn catching_up(&self, within: Duration, now: Instant) -> bool {
        !self.open()
            && (self.running() || !self.live.is_empty())
            && now.saturating_duration_since(self.active) < within
    }

    /// A group member's cursor moves to the start of its next own run
    /// (the next epoch's first, past its last of an epoch), or past the
    /// end if it has none.
    fn seek_own_run(&mut self) {
        let Some(deal) = self.shape.deal else {
            return;
        };
        self.cursor = deal.seek_own_run(self.cursor, self.end());
    }

    pub(in crate::stream) fn can_start(&self) -> bool {
        // Asked of every consumer for every batch the pipeline makes: the
        // cheap test first (most consumers are not being replayed to).
        self.running() && {
            let oldest = self.live.keys().next().copied().unwrap_or(self.next_seq);
            self.next_seq < oldest + u64::from(self.mem.slots)
        }
    }

    /// Waits for its consumer to release a batch.
    pub(in crate::stream) fn blocked(&self) -> bool {
        self.running() && !self.can_start()
    }

    /// Bytes of memory its arena holds now (tests).
    #[cfg(test)]
    pub(in crate::stream) fn allocated(&self) -> u64 {
        let st = nix::sys::stat::fstat(self.mem.arena.fd()).expect("fstat of a memfd");
        st.st_blocks as u64 * 512
    }

    pub(in crate::stream) fn start(&mut self, id: ConsumerId) -> ReplayJob {
        let c = self.cursor;
        let (samples, ends_epoch) = match self.shape.deal {
            None => {
                let step = rotation::step(c, self.shape.batch, self.shape.per_epoch, self.rotation);
                self.cursor = step.next;
                self.rotation = step.rotation;
                (step.samples, step.ends_epoch)
            }
            Some(deal) => {
                let run = deal
                    .next_own(c.sample)
                    .filter(|r| r.start == c.sample)
                    .expect("a member's cursor stands at one of its runs");
                // Its epoch's end comes with the shared stream's when
                // replay ends within that epoch (its last run may lie
                // before where it ends).
                let later = self.end().epoch > c.epoch;
                let samples = run.end - run.start;
                self.cursor = c.advance(samples, self.shape.per_epoch);
                self.seek_own_run();
                (samples, later && deal.ends_epoch(&run))
            }
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.live.insert(
            seq,
            Entry {
                epoch: c.epoch,
                first: c.sample,
                samples,
                ends_epoch,
                state: State::Making,
            },
        );
        let spans = (0..self.mem.layout.fields.len())
            .map(|f| {
                self.mem
                    .layout
                    .span(f, seq * self.shape.batch, samples)
                    .expect("a replayed batch lies in one slot of its ring")
            })
            .collect();
        ReplayJob {
            id,
            seq,
            epoch: c.epoch,
            first: c.sample,
            samples,
            rings: self.mem.rings.clone(),
            spans,
            commit: match self.mem.committed.get() {
                Some(_) => None,
                None => Some(Commit {
                    arena: self.mem.arena.clone(),
                    done: self.mem.committed.clone(),
                }),
            },
        }
    }

    /// Every batch made and released, and no more to come.
    pub(in crate::stream) fn done(&self) -> bool {
        self.to.is_some() && !self.running() && self.live.is_empty()
    }
    /// Batches started and not yet released.
    pub(in crate::stream) fn in_flight(&self) -> usize {
        self.live.len()
    }

    /// Batch `seq` was made: what is now ready to send, in order.
    pub(in crate::stream) fn made(&mut self, seq: u64) -> Vec<ReplayReady> {
        self.set(seq, State::Making, State::Made);
        self.ready()
    }

    /// Batch `seq` was made for a device consumer: its copy to the GPU
    /// (`target`'s rings), piece by piece, before it is ready.
    pub(in crate::stream) fn made_for_copy(
        &mut self,
        seq: u64,
        target: &RingLayout,
    ) -> Option<(Arc<Mapping>, Vec<Piece>)> {
        let samples = self.live.get(&seq)?.samples;
        self.set(seq, State::Making, State::Copying);
        let pieces = copy_pieces(&self.mem.layout, target, seq * self.shape.batch, samples);
        Some((self.mem.rings.clone(), pieces))
    }

    /// Batch `seq`'s copy to its consumer's GPU was reported: what is now
    /// ready to send, in order.
    pub(in crate::stream) fn copied(&mut self, seq: u64) -> Vec<ReplayReady> {
        self.set(seq, State::Copying, State::Made);
        self.ready()
    }

    fn set(&mut self, seq: u64, from: State, to: State) {
        if let Some(e) = self.live.get_mut(&seq).filter(|e| e.state == from) {
            e.state = to;
        }
    }

    fn ready(&mut self) -> Vec<ReplayReady> {
        let mut ready = Vec::new();
        while let Some(e) = self
            .live
            .get_mut(&self.sent)
            .filter(|e| e.state == State::Made)
        {
            e.state = State::Sent;
            ready.push(ReplayReady {
                seq: self.sent,
                epoch: e.epoch,
                first: e.first,
                samples: e.samples,
                ends_epoch: e.ends_epoch,
            });
            self.sent += 1;
        }
        ready
    }

    /// Its consumer released batch `seq`: one sent and not yet released,
    /// else refused. Whether the arena may go now ([`ArenaLife`]).
    pub(in crate::stream) fn release(
        &mut self,
        seq: u64,
        now: Instant,
    ) -> Result<bool, ReplayError> {
        match self.live.get(&seq) {
            Some(e) if e.state == State::Sent => {
                self.live.remove(&seq);
                self.active = now;
                self.moved = true;
            }
            _ => return Err(ReplayError::NotHeld { seq }),
        }
        Ok(self.done() && self.life == ArenaLife::UntilDone)
    }
}

/// A replayed batch's bytes, `samples` from ring position `position`:
/// from the broker's mapping of the replay arena laid out as `host` (each
/// field one span: mirrored, or whole batches in the ring) to the cells of
/// the same position in a device arena laid out as `device`, a piece
/// wherever its ring wraps.
fn copy_pieces(host: &RingLayout, device: &RingLayout, position: u64, samples: u64) -> Vec<Piece> {
    let mut pieces = Vec::with_capacity(2 * host.fields.len());
    for (f, d) in device.fields.iter().enumerate() {
        let (at, _) = host
            .span(f, position, samples)
            .expect("a replayed batch lies in one span of its ring");
        let bps = d.bytes_per_sample;
        let (mut from, mut cell, mut left) = (at, position % d.cells, samples);
        while left > 0 {
            let n = left.min(d.cells - cell);
            pieces.push(Piece {
                at: from as usize,
                len: (n * bps) as usize,
                dst: (d.offset + cell * bps) as usize,
            });
            (from, cell, left) = (from + n * bps, (cell + n) % d.cells, left - n);
        }
    }
    pieces
}
