//! Property test: consumers of mixed batch sizes. The hub counts
//! production units; each consumer cuts them into batches of its own size
//! with the client's [`Batcher`] and gives a unit back once no batch of
//! its reads it. The model writes every unit's samples into rings of
//! sample cells exactly as the arena does (two rings, one whose length is
//! not a multiple of the unit, so units and batches straddle its wrap)
//! and checks, after every step of random schedules, that no cell a held
//! batch reads is ever rewritten, and that every consumer present to the
//! end got every sample of every epoch it joined for once, in order (a
//! group member: its share of the deal, [`batchcast::deal`]).

use std::collections::{BTreeMap, VecDeque};

use batchcast::JoinPolicy;
use batchcast::batcher::{Batcher, Run, Unit, member_units_needed, units_needed};
use batchcast::deal::Deal;
use proptest::prelude::*;

use super::{ConsumerId, Delivery, Hub, HubConfig, Outbound, Work};

#[derive(Debug, Clone)]
enum Op {
    Join {
        window: u32,
        /// A multiple of the unit, plus some.
        size: (u64, u64),
        drop_last: bool,
        immediate: bool,
        ahead: bool,
        /// A group member: (rank seed, world).
        member: Option<(u32, u32)>,
    },
    Start,
    Finish(prop::sample::Index),
    /// A consumer takes what it was sent and hands out what its window allows.
    Take(prop::sample::Index),
    Release {
        who: prop::sample::Index,
        which: prop::sample::Index,
    },
    Die(prop::sample::Index),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (1u32..3, (0u64..3, 0u64..8), any::<bool>(), any::<bool>(), any::<bool>(), prop::option::of((any::<u32>(), 1u32..4)))
            .prop_map(|(window, size, drop_last, immediate, ahead, member)| Op::Join { window, size, drop_last, immediate, ahead, member }),
        4 => Just(Op::Start),
        4 => any::<prop::sample::Index>().prop_map(Op::Finish),
        5 => any::<prop::sample::Index>().prop_map(Op::Take),
        5 => (any::<prop::sample::Index>(), any::<prop::sample::Index>()).prop_map(|(who, which)| Op::Release { who, which }),
        1 => any::<prop::sample::Index>().prop_map(Op::Die),
    ]
}

/// One consumer as the client library runs it.
#[derive(Debug)]
struct Client {
    batcher: Batcher,
    window: u32,
    size: u64,
    drop_last: bool,
    /// What the hub sent, not yet taken (a mailbox, a socket's buffer).
    inbox: VecDeque<Outbound>,
    /// Batches handed out, not released.
    held: Vec<Run>,
    /// (epoch, sample index in the epoch) handed out, in order.
    got: Vec<(u64, u64)>,
    start_epoch: u64,
    immediate: bool,
    ended: bool,
    gone: bool,
    /// A group member's share.
    deal: Option<Deal>,
}

struct Model {
    hub: Hub,
    unit: u64,
    bpe: u64,
    /// The sample each cell holds: (epoch, sample index in the epoch).
    rings: Vec<Vec<Option<(u64, u64)>>>,
    inflight: Vec<Work>,
    clients: BTreeMap<ConsumerId, Client>,
}

impl Model {
    fn cell(&self, r: usize, position: u64) -> usize {
        (position % self.rings[r].len() as u64) as usize
    }

    /// Whether a held batch reads the cell of stream position `p` in ring `r`.
    fn cell_held(&self, r: usize, p: u64) -> bool {
        let cell = self.cell(r, p);
        self.clients.values().filter(|c| !c.gone).any(|c| {
            c.held.iter().any(|run| {
                (run.position..run.position + run.samples).any(|q| self.cell(r, q) == cell)
            })
        })
    }

    fn start(&mut self) {
        let Some(w) = self.hub.start_batch() else {
            return;
        };
        let order = self.bpe * self.unit;
        for r in 0..self.rings.len() {
            for j in 0..self.unit {
                let p = w.seq * self.unit + j;
                assert!(
                    !self.cell_held(r, p),
                    "batch {} rewrites ring {r} cell {} under a held batch",
                    w.seq,
                    self.cell(r, p)
                );
                let first = w.index * self.unit + j;
                let c = self.cell(r, p);
                self.rings[r][c] = (first < order).then_some((w.epoch, first));
            }
        }
        self.inflight.push(w);
    }

    /// The pipeline has filled `w`: a whole unit, or 3 samples (at most)
    /// for an epoch's last.
    fn finish(&mut self, w: Work) {
        let samples = if w.index + 1 == self.bpe {
            self.unit.min(3)
        } else {
            self.unit
        };
        self.hub.finish_batch(w.seq, samples);
        self.drain();
    }

    fn drain(&mut self) {
        for (id, o) in self.hub.take_outbound() {
            let c = self.clients.get_mut(&id).expect("a consumer that joined");
            assert!(!c.gone, "message to a departed consumer");
            // Detached: the hub has let go of everything it held.
            c.gone |= matches!(o, Outbound::Detached { .. });
            c.inbox.push_back(o);
        }
    }

    /// Consumer `id` takes what it was sent while it has room, as the
    /// client does: units only while no batch is ready.
    fn take(&mut self, id: ConsumerId) {
        let mut give = Vec::new();
        loop {
            let c = self.clients.get_mut(&id).unwrap();
            if c.gone || c.held.len() as u32 >= c.window {
                break;
            }
            if let Some(run) = c.batcher.pop() {
                c.held.push(run);
                for j in 0..run.samples {
                    c.got.push((run.epoch, run.first + j));
                }
                self.check_run(id, &run);
                continue;
            }
            let Some(o) = c.inbox.pop_front() else { break };
            match o {
                Outbound::Batch {
                    seq,
                    epoch,
                    index,
                    samples,
                    ..
                } => c
                    .batcher
                    .push(
                        Unit {
                            seq,
                            epoch,
                            index,
                            samples,
                        },
                        &mut give,
                    )
                    .unwrap(),
                Outbound::EndOfEpoch { epoch, .. } => c.batcher.end_epoch(epoch, &mut give),
                Outbound::EndOfStream => c.ended = true,
                Outbound::Detached { .. } => unreachable!("gone when detached"),
            }
            let bound = if c.deal.is_some() {
                member_units_needed(c.window, c.size, self.unit)
            } else {
                units_needed(c.window, c.size, self.unit)
            } as usize;
            assert!(
                c.batcher.units_held() <= bound,
                "holds more units than its window needs"
            );
            for seq in give.drain(..) {
                self.hub.release(id, seq).unwrap();
            }
        }
        self.drain();
    }

    /// The batch's cells hold its samples, in every ring.
    fn check_run(&self, id: ConsumerId, run: &Run) {
        for r in 0..self.rings.len() {
            for j in 0..run.samples {
                assert_eq!(
                    self.rings[r][self.cell(r, run.position + j)],
                    Some((run.epoch, run.first + j)),
                    "consumer {id}: ring {r} does not hold sample {j} of {run:?}"
                );
            }
        }
    }

    fn release(&mut self, id: ConsumerId, k: usize) {
        let c = self.clients.get_mut(&id).unwrap();
        let run = c.held.swap_remove(k);
        let mut give = Vec::new();
        c.batcher.release(&run, &mut give);
        self.check_run(id, &run);
        for seq in give {
            self.hub.release(id, seq).unwrap();
        }
        self.drain();
    }

    fn live(&self) -> Vec<ConsumerId> {
        let live = self.clients.iter().filter(|(_, c)| !c.gone);
        live.map(|(&id, _)| id).collect()
    }

    fn join(
        &mut self,
        (window, size, drop_last): (u32, u64, bool),
        (immediate, ahead): (bool, bool),
        member: Option<(u32, u32)>,
    ) {
        let units = if member.is_some() {
            member_units_needed(window, size, self.unit)
        } else {
            units_needed(window, size, self.unit)
        };
        if units > u64::from(self.hub.cfg.slots) {
            return; // refused by the stream (covered by an end-to-end test)
        }
        let policy = [JoinPolicy::NextEpoch, JoinPolicy::Immediate][usize::from(immediate)];
        let delivery = [Delivery::Window, Delivery::Ahead][usize::from(ahead)];
        let span = super::Window {
            units: units as u32,
            batches: window,
        };
        let Ok((id, start_epoch)) = self.hub.join_group(span, policy, None, delivery) else {
            return; // above the lag limit
        };
        let deal = member.map(|(seed, world)| {
            Deal::new(self.per_epoch(), size, (seed % world, world, 1), drop_last)
        });
        let mut batcher = Batcher::new(size, drop_last, self.unit, self.bpe);
        if let Some(d) = deal {
            batcher = batcher.with_deal(d);
        }
        self.clients.insert(
            id,
            Client {
                batcher,
                window,
                size,
                drop_last,
                inbox: VecDeque::new(),
                held: Vec::new(),
                got: Vec::new(),
                start_epoch,
                immediate,
                ended: false,
                gone: false,
                deal,
            },
        );
        self.drain();
    }

    fn step(&mut self, op: Op) {
        let live = self.live();
        let pick = |i: prop::sample::Index| (!live.is_empty()).then(|| live[i.index(live.len())]);
        match op {
            Op::Join {
                window,
                size: (k, extra),
                drop_last,
                immediate,
                ahead,
                member,
            } => {
                let size = (k * self.unit + extra).max(1);
                self.join((window, size, drop_last), (immediate, ahead), member);
            }
            Op::Start => self.start(),
            Op::Finish(i) if !self.inflight.is_empty() => {
                let w = self.inflight.remove(i.index(self.inflight.len()));
                self.finish(w);
            }
            Op::Finish(_) => {}
            Op::Take(i) => {
                if let Some(id) = pick(i) {
                    self.take(id);
                }
            }
            Op::Release { who, which } => {
                if let Some(id) = pick(who) {
                    let n = self.clients[&id].held.len();
                    if n > 0 {
                        self.release(id, which.index(n));
                    }
                }
            }
            Op::Die(i) => {
                if let Some(id) = pick(i) {
                    assert!(self.hub.leave(id));
                    self.clients.get_mut(&id).unwrap().gone = true;
                    self.drain();
                }
            }
        }
        self.hub.view().check_invariants();
    }

    /// Everyone takes and releases promptly until the stream ends.
    fn run_to_end(&mut self) {
        for _ in 0..20_000 {
            for id in self.live() {
                self.take(id);
                while !self.clients[&id].gone && !self.clients[&id].held.is_empty() {
                    self.release(id, 0);
                }
            }
            self.start();
            if let Some(w) = self.inflight.pop() {
                self.finish(w);
            }
            self.hub.view().check_invariants();
            let idle = self.live().iter().all(|id| {
                let c = &self.clients[id];
                c.ended && c.inbox.is_empty()
            });
            if self.hub.view().finished() && self.inflight.is_empty() && idle {
                break;
            }
        }
    }

    /// A consumer present to the end: every sample of every epoch from its
    /// start, once, in order; its batches full but for each epoch's last.
    /// Samples in an epoch: its last unit holds at most 3.
    fn per_epoch(&self) -> u64 {
        (self.bpe - 1) * self.unit + self.unit.min(3)
    }

    fn check_complete(&self, id: ConsumerId, c: &Client, epochs: u64) {
        let per_epoch = self.per_epoch();
        let first_epoch = match c.got.first() {
            Some(&(e, _)) => e,
            None => return,
        };
        if !c.immediate {
            assert_eq!(first_epoch, c.start_epoch, "consumer {id}");
        }
        let mut want = Vec::new();
        for e in first_epoch..epochs {
            if let Some(d) = c.deal {
                let mine = (0..per_epoch).filter(|&f| d.run_at(f).is_some_and(|r| r.mine));
                want.extend(mine.map(|i| (e, i)));
                continue;
            }
            let keep = if c.drop_last {
                per_epoch / c.size * c.size
            } else {
                per_epoch
            };
            want.extend((0..keep).map(|i| (e, i)));
        }
        if c.immediate {
            // A partial first epoch: it starts wherever it joined.
            let skip = want.iter().position(|s| *s == c.got[0]).unwrap_or(0);
            want.drain(..skip);
            if c.drop_last {
                return; // its first epoch's cut depends on where it joined
            }
        }
        assert_eq!(
            c.got, want,
            "consumer {id} (size {}, drop_last {})",
            c.size, c.drop_last
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn consumers_of_mixed_batch_sizes_never_read_a_rewritten_cell_and_get_every_sample_once(
        slots in 2u32..14,
        unit in 1u64..6,
        bpe in 1u64..5,
        extra in 0u64..6,
        lag in prop::option::of(4u32..14),
        ops in prop::collection::vec(op(), 1..200),
    ) {
        let epochs = 3;
        let live = u64::from(slots) * unit;
        let mut m = Model {
            hub: Hub::new(HubConfig {
                slots,
                batches_per_epoch: bpe,
                epochs: Some(epochs),
                lag_limit: lag,
                min_consumers: 1,
            }),
            unit,
            bpe,
            rings: vec![vec![None; live as usize], vec![None; (live + extra) as usize]],
            inflight: Vec::new(),
            clients: BTreeMap::new(),
        };
        for op in ops {
            m.step(op);
        }
        if m.live().is_empty() {
            m.join((1, unit, false), (false, false), None);
        }
        m.run_to_end();
        prop_assert!(m.hub.view().finished(), "stream did not finish: {:?}", m.hub.view().counts());
        for (&id, c) in &m.clients {
            if !c.gone {
                prop_assert!(c.ended, "consumer {} never saw the end", id);
                m.check_complete(id, c, epochs);
            }
        }
        prop_assert_eq!(m.hub.view().counts().free, slots);
    }
}
