//! A round of the hold rule: made from the clock's verdict on the ring's
//! pinned unit ([`HoldClock::round`]: who is detached, who is cut, who the
//! ring moves away from) and carried out ([`carry_out`]). Written once,
//! with no I/O and no clock: the stream's runtime
//! (`super::super::decouple`) and the hold simulation (`super::sim`) each
//! lend it their [`Facts`] and [`Hands`], so the simulation runs the
//! runtime's own order and fallbacks, not a copy.
//!
//! # Rules
//!
//! * A round's steps come in this order: the named holders that cannot be
//!   moved from are detached; then the ring moves away from those it can
//!   (each cut first where it is not already); then the others named are
//!   cut to replay.
//! * One still holding batches an earlier move left behind gets no second
//!   region: it is detached (`Stuck::Again`), as is every holder when the
//!   ring found no region to move to (the reason told to each).
//! * A move-only round (the default pace's stall cut before the limit, a
//!   hold carried to owers that had no part in it) acts only where a region
//!   is ready now and nobody holds a left-behind batch: otherwise nothing
//!   is done, nobody is detached, and the clock is told the ring did not
//!   move ([`Hands::unmoved`]: the carried hold becomes the holders' own).

use std::time::{Duration, Instant};

use super::{Facts, HoldClock, Rule, Verdict};
use crate::hub::ConsumerId;
use crate::stream::regions::{self, Stuck};

/// What a verdict's round does, in the order the runtime and the
/// simulation carry it out ([`Verdict::round`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::stream) struct Round {
    /// Detached, each with whether it took the pinned unit itself (told
    /// it was waited for up to the held-batch limit), first.
    pub detach: Vec<(ConsumerId, bool)>,
    /// Then cut, and the ring moved away from what they hold (they took
    /// the pinned unit, and it can move); `move_only`: only where a region
    /// is ready now, and if it moved nothing the clock is told
    /// ([`HoldClock::unmoved`]).
    pub movers: Vec<ConsumerId>,
    pub move_only: bool,
    /// Then cut to replay.
    pub cut: Vec<ConsumerId>,
    /// How long the pinned unit kept the others waiting.
    pub held: Duration,
    /// The pinned unit the round was made on.
    pub pinned: Option<u64>,
}

impl Verdict {
    /// The round this verdict makes on the ring's pinned unit `seq`: of
    /// those it names, the ones that took the unit where the ring can move
    /// away from them are moved from, the others detached (none in a
    /// move-only round).
    pub(super) fn round(self, seq: Option<u64>, facts: &mut impl Facts) -> Option<Round> {
        let Verdict::Act {
            cut,
            detach,
            held,
            move_only,
        } = self
        else {
            return None;
        };
        let mut round = Round {
            detach: Vec::new(),
            movers: Vec::new(),
            move_only,
            cut,
            held,
            pinned: seq,
        };
        for id in detach {
            let took = seq.is_some_and(|q| facts.took(id, q));
            if took && facts.movable(id) {
                round.movers.push(id);
            } else if !move_only {
                round.detach.push((id, took));
            }
        }
        Some(round)
    }
}

impl HoldClock {
    /// The pipeline waits for the ring's next slot, `pinned` (the unit in
    /// it and its owers, [`crate::hub::View::pinning`]): the round the
    /// hold rule makes at `now` ([`HoldClock::judge`], then
    /// [`Verdict::round`]), if it acts.
    pub(in crate::stream) fn round(
        &mut self,
        rule: Rule,
        pinned: Option<(u64, Vec<ConsumerId>)>,
        facts: &mut impl Facts,
        now: Instant,
    ) -> Option<Round> {
        let seq = pinned.as_ref().map(|(seq, _)| *seq);
        self.judge(rule, pinned, facts, now).round(seq, facts)
    }
}

/// Why a round detaches a consumer.
#[derive(Debug)]
pub(in crate::stream) enum Detach<'a> {
    /// It kept the others waiting `held` and could not be cut or moved
    /// from; `took`: it holds the pinned unit itself (waited for up to the
    /// held-batch limit).
    Held { held: Duration, took: bool },
    /// The ring could not move away from what it holds.
    Stuck { held: Duration, why: &'a Stuck },
}

/// A move of the ring a round asks for: away from what `ids` hold, which
/// kept the others waiting `held`; `early`: a move-only round.
#[derive(Debug)]
pub(in crate::stream) struct Move<'a> {
    pub ids: &'a [ConsumerId],
    pub held: Duration,
    pub early: bool,
}

/// What a round does to the stream, lent by whoever carries it out (the
/// runtime over its connections and arena, the simulation over its
/// readers). Each call does one thing and says whether it was done.
pub(in crate::stream) trait Hands {
    /// Whether consumer `id` still holds batches a move left behind.
    fn holds_left(&self, id: ConsumerId) -> bool;
    /// Whether the ring could move now, away from what `id` holds: a region
    /// is free, or the budget pays for one (allocated now if so).
    fn ready(&mut self, id: ConsumerId) -> bool;
    /// Whether consumer `id` is cut from the shared stream already.
    fn is_cut(&self, id: ConsumerId) -> bool;
    /// Cuts consumer `id` to replay; whether it was.
    fn cut(&mut self, id: ConsumerId, now: Instant) -> bool;
    /// Detaches consumer `id`, told why.
    fn detach(&mut self, id: ConsumerId, why: Detach<'_>);
    /// Moves the ring away from what `m.ids` hold (all cut): the region
    /// it moved to, or why it could not (then nothing changed).
    fn move_from(&mut self, m: Move<'_>) -> Result<u32, Stuck>;
    /// A move-only round on unit `seq` moved nothing
    /// ([`super::HoldClock::unmoved`]).
    fn unmoved(&mut self, seq: u64, now: Instant);
}

/// Carries out `round` (see the module's rules). Whether anyone was cut,
/// detached or moved from.
pub(in crate::stream) fn carry_out(round: Round, hands: &mut impl Hands, now: Instant) -> bool {
    let held = round.held;
    let mut any = !round.detach.is_empty() || !round.movers.is_empty();
    for (id, took) in round.detach {
        hands.detach(id, Detach::Held { held, took });
    }
    // Detaching freed the slot of whoever could not be cut; moving the
    // ring away from what the others hold, and cutting them, frees it of
    // them.
    if !round.movers.is_empty()
        && !move_ring(hands, round.movers, (held, round.move_only), now)
        && round.move_only
        && let Some(seq) = round.pinned
    {
        hands.unmoved(seq, now);
    }
    for id in round.cut {
        any |= hands.cut(id, now);
    }
    any
}

/// Cuts the holders `ids` (those not cut yet) and moves the ring away from
/// what they hold (see the module's rules). Whether it moved.
fn move_ring(
    hands: &mut impl Hands,
    ids: Vec<ConsumerId>,
    (held, early): (Duration, bool),
    now: Instant,
) -> bool {
    let (again, ids): (Vec<ConsumerId>, Vec<ConsumerId>) =
        ids.into_iter().partition(|&id| hands.holds_left(id));
    let Some((ids, again)) = regions::movers((ids, again), early, |id| hands.ready(id)) else {
        return false;
    };
    for id in again {
        let why = Stuck::Again;
        hands.detach(id, Detach::Stuck { held, why: &why });
    }
    let cut: Vec<ConsumerId> = ids
        .into_iter()
        .filter(|&id| hands.is_cut(id) || hands.cut(id, now))
        .collect();
    if cut.is_empty() {
        return false;
    }
    let m = Move {
        ids: &cut,
        held,
        early,
    };
    match hands.move_from(m) {
        Ok(_) => true,
        Err(why) => {
            for &id in &cut {
                hands.detach(id, Detach::Stuck { held, why: &why });
            }
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hands that write down what a round asks of them, over a stream
    /// whose answers the test sets.
    #[derive(Default)]
    struct Log {
        /// Consumers still holding what an earlier move left behind.
        left: Vec<ConsumerId>,
        /// Consumers cut already, and those whose cut fails.
        cut_already: Vec<ConsumerId>,
        cut_fails: Vec<ConsumerId>,
        /// Whether a region is ready; what a move meets.
        ready: bool,
        stuck: Option<Stuck>,
        did: Vec<String>,
    }

    impl Hands for Log {
        fn holds_left(&self, id: ConsumerId) -> bool {
            self.left.contains(&id)
        }
        fn ready(&mut self, id: ConsumerId) -> bool {
            self.did.push(format!("ready {id}"));
            self.ready
        }
        fn is_cut(&self, id: ConsumerId) -> bool {
            self.cut_already.contains(&id)
        }
        fn cut(&mut self, id: ConsumerId, _now: Instant) -> bool {
            self.did.push(format!("cut {id}"));
            !self.cut_fails.contains(&id)
        }
        fn detach(&mut self, id: ConsumerId, why: Detach<'_>) {
            self.did.push(match why {
                Detach::Held { took, .. } => format!("detach {id} held took={took}"),
                Detach::Stuck { why, .. } => format!("detach {id} stuck: {why}"),
            });
        }
        fn move_from(&mut self, m: Move<'_>) -> Result<u32, Stuck> {
            self.did
                .push(format!("move from {:?} early={}", m.ids, m.early));
            self.stuck.take().map_or(Ok(1), Err)
        }
        fn unmoved(&mut self, seq: u64, _now: Instant) {
            self.did.push(format!("unmoved {seq}"));
        }
    }

    fn round(
        detach: &[(ConsumerId, bool)],
        movers: &[ConsumerId],
        cut: &[ConsumerId],
        move_only: bool,
    ) -> Round {
        Round {
            detach: detach.to_vec(),
            movers: movers.to_vec(),
            move_only,
            cut: cut.to_vec(),
            held: Duration::from_secs(30),
            pinned: Some(7),
        }
    }

    fn run(hands: &mut Log, r: Round) -> (bool, Vec<String>) {
        let any = carry_out(r, hands, Instant::now());
        (any, std::mem::take(&mut hands.did))
    }

    #[test]
    fn a_round_detaches_then_moves_then_cuts() {
        let mut h = Log {
            ready: true,
            cut_already: vec![3],
            ..Log::default()
        };
        let (any, did) = run(&mut h, round(&[(1, true)], &[2, 3], &[4], false));
        assert!(any);
        assert_eq!(
            did,
            [
                "detach 1 held took=true",
                "cut 2",
                "move from [2, 3] early=false",
                "cut 4"
            ],
            "the holder cut already is moved from without a second cut; a round at the limit does not ask whether a region is ready"
        );
    }

    #[test]
    fn a_holder_of_batches_left_behind_gets_no_second_region() {
        let mut h = Log {
            ready: true,
            left: vec![2],
            ..Log::default()
        };
        let (_, did) = run(&mut h, round(&[], &[2, 3], &[], false));
        assert_eq!(
            did,
            [
                "detach 2 stuck: it still holds batches the ring left behind for it when it held the ring before",
                "cut 3",
                "move from [3] early=false"
            ]
        );
    }

    #[test]
    fn a_ring_that_cannot_move_detaches_its_holders_told_why() {
        let mut h = Log {
            stuck: Some(Stuck::Full),
            ..Log::default()
        };
        let (_, did) = run(&mut h, round(&[], &[2, 3], &[5], false));
        assert_eq!(
            did,
            [
                "cut 2",
                "cut 3",
                "move from [2, 3] early=false",
                "detach 2 stuck: every other region of the stream's host arena still holds batches of stopped consumers",
                "detach 3 stuck: every other region of the stream's host arena still holds batches of stopped consumers",
                "cut 5"
            ]
        );
    }

    #[test]
    fn a_move_only_round_without_a_ready_region_does_nothing_and_tells_the_clock() {
        let mut h = Log::default();
        let (_, did) = run(&mut h, round(&[], &[2], &[], true));
        assert_eq!(did, ["ready 2", "unmoved 7"], "nobody cut or detached");
        // Nor where a holder still holds what an earlier move left.
        let mut h = Log {
            ready: true,
            left: vec![3],
            ..Log::default()
        };
        let (_, did) = run(&mut h, round(&[], &[2, 3], &[4], true));
        assert_eq!(did, ["unmoved 7", "cut 4"]);
        // A region ready: it moves, and the clock is not told.
        let mut h = Log {
            ready: true,
            ..Log::default()
        };
        let (_, did) = run(&mut h, round(&[], &[2], &[], true));
        assert_eq!(did, ["ready 2", "cut 2", "move from [2] early=true"]);
    }

    #[test]
    fn holders_whose_cuts_fail_are_not_moved_from() {
        let mut h = Log {
            ready: true,
            cut_fails: vec![2, 3],
            ..Log::default()
        };
        let (any, did) = run(&mut h, round(&[], &[2, 3], &[], true));
        assert!(any, "the round named holders");
        assert_eq!(did, ["ready 2", "cut 2", "cut 3", "unmoved 7"]);
        let (any, did) = run(&mut h, round(&[], &[], &[2], false));
        assert!(!any, "a cut that failed is not counted");
        assert_eq!(did, ["cut 2"]);
    }
}
