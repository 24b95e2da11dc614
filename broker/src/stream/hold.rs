//! The hold clock: when the units of the ring were begun and made, which
//! unit pins the ring's next slot and since when. No clock inside: every
//! call takes `now` from the stream's runtime, so the rules below are
//! tested on a simulated clock (the tests at the bottom).
//!
//! # Rules
//!
//! * A unit's age (decoupled pace's cut waits until it is [`CUT_AFTER`]
//!   old) runs from when it was made (published).
//! * A hold runs from when a unit first pinned the ring's next slot while
//!   another consumer waited for data; it ends when nothing pins it.
//! * What is done about the owers of the pinned unit ([`HoldClock::decide`]):
//!   decoupled pace cuts them once the unit is [`CUT_AFTER`] old; lockstep
//!   cuts them once the hold reaches the limit. An ower that cannot be cut
//!   is named to be detached: one with no replay arena (a producer's
//!   stream, one the budget refused) at the limit, one that took the unit
//!   itself (its program holds it: a cut would not free it) at the
//!   held-batch limit (`held_batch_limit_s`, at least the limit), the
//!   others cut meanwhile; one that took it where the ring can move away
//!   from what it holds ([`Ower::movable`]) at the limit, like the others
//!   (the runtime cuts it and moves the ring: `super::regions`); a
//!   joiner catching up is waited for. One that took the unit a hold was
//!   carried to (below) is not detached for a hold that was not its own:
//!   where the ring can move away from it at once (a region ready), it
//!   does (a cut, not a detach: the others' wait stays within the limit);
//!   otherwise it gets a hold of its own, from now, and the others wait
//!   up to a second limit (a producer's stream, a ring a GPU copier pins,
//!   a budget with no region left). The others are cut either way.
//!   A holder that decoupled pace cuts (it owes more than the unit it
//!   holds) still holds the unit: its cut does not end the hold, which
//!   runs on for it to the held-batch limit as for one that may not be
//!   cut, or, where the ring may move away from it, to the limit (the
//!   simulation found the others waiting a second bound from the cut,
//!   in both cases).
//!   Nothing is done while nobody waits for data, or without a limit
//!   under lockstep.
//! * The default pace (`auto`) is lockstep that holds the others behind
//!   a laggard only while that is cheaper than replaying to it. Cut, the
//!   laggard loses the units it owes in the ring, which its replay makes
//!   again: about `owed × make / workers` of the pipeline's time, where
//!   `make` is how long a pipeline thread took to make a unit of the ring
//!   (the median of the units the clock keeps; units served from the
//!   decoded cache are quicker, and so is their replay). Held, every
//!   waiting consumer loses the whole hold. So once the pinned unit has
//!   been held as long as remaking what its owers would lose takes
//!   ([`HoldClock::stall_after`], at least [`STALL_FLOOR`]), its owers that
//!   may be cut are cut, as at the limit, and one that holds the unit
//!   itself where the ring can move away from it is named (the runtime
//!   cuts it and moves the ring: a copy of the ring's written slots, less
//!   than the remake weighed); others that cannot be cut wait for their
//!   bound. Holding on longer would cost the waiting ones more than the
//!   replay costs everyone (on a pipeline-bound machine, one extra unit's
//!   worth of time each), whether the laggard then resumes at once or
//!   not. A trainer whose step is shorter than that sets the pace as
//!   under lockstep; one that pauses, or steps slower than that, is
//!   replayed to: holding the others for it would cost them more.
//! * A round at the limit (the owers of the pinned unit cut or detached)
//!   carries its hold to the next unit pinned if that unit was already in
//!   the ring when the hold began (begun, not necessarily made: workers
//!   fill several units at once and publish them out of order). Its owers
//!   kept the others waiting all along, behind the unit just freed, so
//!   consumers stalled at different places are all cut by one bound, not
//!   each by one of its own in turn. A unit begun after the hold began
//!   starts a hold of its own.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::hub::ConsumerId;

/// How old the unit in the ring's next slot must be before decoupled pace
/// cuts the consumers that owe it (one a moment late, as trainers starting
/// together are, is not worth a replay).
pub(super) const CUT_AFTER: Duration = Duration::from_millis(10);

/// The default pace cuts no pin shorter than this (a replay is not worth
/// a moment's wait, whatever the units cost).
pub(super) const STALL_FLOOR: Duration = Duration::from_millis(250);

/// The stream's hold rule.
#[derive(Debug, Clone, Copy)]
pub(super) struct Rule {
    /// Decoupled pace: cut at once (once the unit is [`CUT_AFTER`] old).
    pub eager: bool,
    /// The default pace (`auto`): cut a stalled ower before the limit
    /// (see the module's rules).
    pub stall_cut: bool,
    /// The pipeline threads that would remake what a cut loses (at least
    /// one counts).
    pub workers: u32,
    /// The hold limit (`None`: `hold_limit_s = inf`).
    pub limit: Option<Duration>,
    /// How long an ower that took the pinned unit itself is waited for
    /// before it is detached (`held_batch_limit_s`; at least `limit`).
    pub held_limit: Option<Duration>,
}

/// A consumer that owes the unit pinning the ring, as the runtime sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ower {
    pub id: ConsumerId,
    /// It may be cut: a replay arena, reading the shared stream, behind,
    /// and (lockstep) it did not take the pinned unit.
    pub cuttable: bool,
    /// A lockstep joiner whose catch-up replay moves within the limit.
    pub catching_up: bool,
    /// It took the pinned unit (its program holds it): a cut would not
    /// free it, so it waits for the held-batch limit...
    pub took: bool,
    /// ...unless the ring can move away from what it holds: then it is
    /// named at the limit like the others, and under the default pace at
    /// the stall cut (the runtime cuts it and moves the ring,
    /// `super::regions`).
    pub movable: bool,
}

/// What the hold rule says to do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Nothing: wait for the owers.
    Wait,
    /// Cut `cut` to replay; detach `detach`, which kept the others waiting
    /// for `held` (those of them that took the pinned unit where the ring
    /// can move away from it: cut, and the ring moved).
    Act {
        cut: Vec<ConsumerId>,
        detach: Vec<ConsumerId>,
        held: Duration,
        /// `detach` are holders the ring is to move away from only where a
        /// region is ready now; none is detached (the default pace's stall
        /// cut before the limit, a carried hold). A round that moved nothing
        /// is told back ([`HoldClock::unmoved`]).
        move_only: bool,
    },
}

/// What the hold rule asks the runtime about its consumers (the runtime's
/// answers come from their connections: mailboxes, replay arenas).
pub(super) trait Facts {
    /// Whether some consumer has read everything published for it and
    /// waits for data.
    fn hungry(&mut self) -> bool;
    /// Whether consumer `id` may be cut now (see [`Ower::cuttable`]);
    /// `stalled`: under lockstep, the pinned unit, which a cut would not
    /// free if it took it.
    fn cuttable(&mut self, id: ConsumerId, stalled: Option<u64>) -> bool;
    /// Whether consumer `id` is a joiner whose catch-up replay moves
    /// within `within` of `now`.
    fn catching_up(&self, id: ConsumerId, within: Duration, now: Instant) -> bool;
    /// Whether consumer `id` took unit `seq` itself (its program holds
    /// it; a cut cannot give it back).
    fn took(&mut self, id: ConsumerId, seq: u64) -> bool;
    /// Whether the ring may move away from what consumer `id` holds (it
    /// is cut, or may be, and the stream's ring can move).
    fn movable(&mut self, id: ConsumerId) -> bool;
}

/// One unit of the ring: when the pipeline began it and when it was made.
#[derive(Debug, Clone, Copy)]
struct Unit {
    seq: u64,
    begun: Instant,
    made: Option<Instant>,
}

/// How long the unit pinning the ring has held it, and what the rule's
/// bounds make of that.
struct Hold {
    since: Instant,
    /// Carried over a round at the limit.
    carried: bool,
    held: Duration,
    /// At or past the limit.
    past: bool,
    /// At or past the default pace's stall cut.
    stalled: bool,
}

/// The owers of the pinned unit by what the rule may do with them.
struct Sorted {
    /// May be cut.
    cut: Vec<ConsumerId>,
    /// Some took the unit and are waited for to the held-batch limit.
    waited: bool,
    /// Cannot be cut: named to be detached, or the ring moved from.
    detach: Vec<ConsumerId>,
    /// Those named all took the unit where the ring can move away.
    movers: bool,
}

/// Sorts the owers of the pinned unit (`past_held`: the hold reached the
/// held-batch limit): owers that took the unit are waited for up to the
/// held-batch limit, unless the ring can move away from them; the other
/// owers that cannot be cut, up to the limit.
fn sort(owe: &[Ower], past_held: bool) -> Sorted {
    let held_on = |o: &&Ower| o.took && !o.movable && !past_held;
    let (waited, detach): (Vec<&Ower>, Vec<&Ower>) = owe
        .iter()
        .filter(|o| !o.cuttable && !o.catching_up)
        .partition(held_on);
    Sorted {
        cut: owe.iter().filter(|o| o.cuttable).map(|o| o.id).collect(),
        // A holder cut under decoupled pace (it owes more than the unit
        // it holds) still holds it, whether or not the ring may move away
        // from it: the hold runs on for it, to the held-batch limit (or,
        // where the ring can move, to the limit, once it is cut), as for
        // one that may not be cut.
        waited: !waited.is_empty() || owe.iter().any(|o| o.cuttable && o.took && !past_held),
        movers: !detach.is_empty() && detach.iter().all(|o| o.took && o.movable),
        detach: detach.iter().map(|o| o.id).collect(),
    }
}

/// The hold clock of one stream (see the module's rules).
#[derive(Debug, Default)]
pub(super) struct HoldClock {
    /// The last units begun, at most a ring's worth (oldest first).
    units: VecDeque<Unit>,
    /// The unit pinning the ring's next slot, and since when.
    pinned: Option<(u64, Instant)>,
    /// When the hold that the last round at the limit ended began.
    carried: Option<Instant>,
    /// A move-only round on a carried hold named the holders of this
    /// unit: if the ring cannot move away from them, they get a hold of
    /// their own ([`HoldClock::unmoved`]).
    restart_unmoved: Option<u64>,
    /// Carried holds restarted for owers that took the unit (the others
    /// then wait up to a second limit: the simulation allows for it).
    pub(super) restarts: u64,
}

impl HoldClock {
    /// The pipeline waits for the ring's next slot: `pinned` is the unit
    /// in it and the consumers that owe it ([`crate::hub::View::pinning`]).
    /// Asks `facts` whether anyone waits for data and, only then, about
    /// each ower, and says what the rules make of it at `now`
    /// ([`HoldClock::decide`]).
    pub(super) fn judge(
        &mut self,
        rule: Rule,
        pinned: Option<(u64, Vec<ConsumerId>)>,
        facts: &mut impl Facts,
        now: Instant,
    ) -> Verdict {
        if !rule.eager && rule.limit.is_none() {
            return Verdict::Wait;
        }
        let hungry = pinned.is_some() && facts.hungry();
        // Owers are looked at only while someone waits for data.
        let owers: Vec<Ower> = match &pinned {
            Some((seq, owe)) if hungry => {
                let within = rule.limit.unwrap_or(Duration::MAX);
                let stalled = (!rule.eager).then_some(*seq);
                owe.iter()
                    .map(|&id| Ower {
                        id,
                        cuttable: facts.cuttable(id, stalled),
                        catching_up: facts.catching_up(id, within, now),
                        took: facts.took(id, *seq),
                        movable: facts.movable(id),
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        self.decide(
            rule,
            pinned.as_ref().map(|(seq, _)| (*seq, owers.as_slice())),
            hungry,
            now,
        )
    }

    /// The hold rule at `now` (see the module's rules): `pinned` is the
    /// unit in the ring's next slot and its owers, if a published unit is
    /// there; `hungry`, whether some consumer waits for data.
    pub(super) fn decide(
        &mut self,
        rule: Rule,
        pinned: Option<(u64, &[Ower])>,
        hungry: bool,
        now: Instant,
    ) -> Verdict {
        // Only the round just decided may be told back as unmoved.
        self.restart_unmoved = None;
        if !rule.eager && rule.limit.is_none() {
            return Verdict::Wait;
        }
        let Some((seq, owe)) = pinned else {
            self.unpin();
            return Verdict::Wait;
        };
        if (rule.eager && self.younger_than(seq, CUT_AFTER, now)) || !hungry || owe.is_empty() {
            return Verdict::Wait;
        }
        let hold = self.hold(rule, seq, now);
        let (since, held, past) = (hold.since, hold.held, hold.past);
        if !rule.eager && !past && !hold.stalled {
            return Verdict::Wait;
        }
        let Sorted {
            cut,
            waited,
            detach,
            movers,
        } = sort(owe, rule.held_limit.is_some_and(|l| held >= l));
        // Holders the ring can move away from are priced as the others
        // are (a move copies the ring's written slots, far less than the
        // remake the stall cut weighs); the rest wait for the limit.
        let early = hold.stalled && movers;
        let mut move_only = early && !past;
        if !detach.is_empty() {
            if !past && !early {
                return Verdict::Wait;
            }
            if hold.carried && self.carried_to_holders(seq, movers, now) {
                return Verdict::Act {
                    cut,
                    detach: Vec::new(),
                    held,
                    move_only: false,
                };
            }
            move_only |= hold.carried;
        }
        if cut.is_empty() && detach.is_empty() && !rule.eager && !past {
            // A stall with no one to cut (joiners catching up): the hold
            // runs on to the limit.
            return Verdict::Wait;
        }
        if waited {
            // The hold is theirs: it runs on, from `since`, to the
            // held-batch limit (nothing to do until then once the others
            // are cut).
            if cut.is_empty() && detach.is_empty() {
                return Verdict::Wait;
            }
        } else if past {
            self.carry(since);
        } else if !early {
            self.unpin();
        }
        // (An early round naming holders keeps the hold: where the ring
        // cannot move yet, they are waited for to the limit from `since`;
        // where it moves, another unit pins the ring next.)
        Verdict::Act {
            cut,
            detach,
            held,
            move_only,
        }
    }

    /// How long unit `seq` has pinned the ring at `now`, and what the
    /// rule's bounds make of that.
    fn hold(&mut self, rule: Rule, seq: u64, now: Instant) -> Hold {
        let (since, carried) = self.pinned_since(seq, now);
        let held = now.saturating_duration_since(since);
        Hold {
            since,
            carried,
            held,
            past: rule.limit.is_some_and(|l| held >= l),
            stalled: rule.stall_cut
                && self
                    .stall_after(seq, rule.workers)
                    .is_some_and(|d| held >= d),
        }
    }

    /// A hold was carried to unit `seq`, which owers took (they may be
    /// moving: a hold carried from behind another is not theirs to be
    /// detached for). Where the ring can move away from them all
    /// (`movers`), it moves at once (a move-only round: they are cut, not
    /// detached, and the others' wait stays within the limit), and only
    /// if it cannot after all (`unmoved`) do they get a hold of their own;
    /// otherwise they get one now. Whether they got one now.
    fn carried_to_holders(&mut self, seq: u64, movers: bool, now: Instant) -> bool {
        if movers {
            self.restart_unmoved = Some(seq);
            return false;
        }
        self.restart(seq, now);
        self.restarts += 1;
        true
    }

    /// The runtime could not move the ring away from the holders of unit
    /// `seq` that a move-only round named: after a carried hold they get
    /// a hold of their own from `now` (whether that happened); after the
    /// stall cut the hold runs on to the limit.
    pub(super) fn unmoved(&mut self, seq: u64, now: Instant) -> bool {
        if self.restart_unmoved.take() != Some(seq) {
            return false;
        }
        self.restart(seq, now);
        self.restarts += 1;
        true
    }

    /// Unit `seq` was begun at `now`; the clock keeps the last `slots`.
    pub(super) fn begun(&mut self, seq: u64, slots: u32, now: Instant) {
        self.units.push_back(Unit {
            seq,
            begun: now,
            made: None,
        });
        while self.units.len() > slots as usize {
            self.units.pop_front();
        }
    }

    /// Unit `seq` was made (published) at `now`.
    pub(super) fn made(&mut self, seq: u64, now: Instant) {
        if let Some(u) = self.units.iter_mut().find(|u| u.seq == seq) {
            u.made = Some(now);
        }
    }

    /// Whether unit `seq` was made less than `age` before `now` (one the
    /// clock no longer remembers is old enough; one not made yet is young).
    fn younger_than(&self, seq: u64, age: Duration, now: Instant) -> bool {
        self.units.iter().find(|u| u.seq == seq).is_some_and(|u| {
            u.made
                .is_none_or(|m| now.saturating_duration_since(m) < age)
        })
    }

    /// Since when unit `seq` has pinned the ring (from `now` if it did
    /// not, or from the hold carried over a round at the limit where `seq`
    /// was begun before that hold began), and whether that is a carried
    /// hold.
    fn pinned_since(&mut self, seq: u64, now: Instant) -> (Instant, bool) {
        if let Some((s, t)) = self.pinned
            && s == seq
        {
            return (t, self.carried.is_some());
        }
        let begun = self.units.iter().find(|u| u.seq == seq).map(|u| u.begun);
        let from = self.carried.filter(|&c| begun.is_none_or(|b| b <= c));
        if from.is_none() {
            self.carried = None;
        }
        (
            self.pinned.insert((seq, from.unwrap_or(now))).1,
            from.is_some(),
        )
    }

    /// How long the default pace holds the others behind unit `seq`
    /// before it cuts its owers (see the module's rules): the time
    /// `workers` pipeline threads take to remake the units a cut would
    /// take back (those made from `seq` on), each taking as long as the
    /// median unit the clock keeps took to make; at least
    /// [`STALL_FLOOR`]. `None` before any unit was made.
    pub(super) fn stall_after(&self, seq: u64, workers: u32) -> Option<Duration> {
        let mut make: Vec<Duration> = self
            .units
            .iter()
            .filter_map(|u| Some(u.made?.saturating_duration_since(u.begun)))
            .collect();
        if make.is_empty() {
            return None;
        }
        // The median without sorting the rest: this runs at every look
        // while the ring is full, over up to `slots` units.
        let mid = make.len() / 2;
        let median = *make.select_nth_unstable(mid).1;
        let owed = self
            .units
            .iter()
            .filter(|u| u.seq >= seq && u.made.is_some())
            .count()
            .max(1) as u32;
        Some((median * owed / workers.max(1)).max(STALL_FLOOR))
    }

    /// When the rule's verdict on the unit pinning the ring may next
    /// change (the stall cut, the limit, the held-batch limit; decoupled
    /// pace: the unit's age), if after `now`: the runtime looks again then
    /// rather than on its idle tick. `None`: nothing pins the ring, or
    /// nothing is due.
    pub(super) fn next_look(&self, rule: Rule, now: Instant) -> Option<Instant> {
        let (seq, since) = self.pinned?;
        let made = self
            .units
            .iter()
            .find(|u| u.seq == seq)
            .and_then(|u| u.made);
        let stall = rule
            .stall_cut
            .then(|| self.stall_after(seq, rule.workers))
            .flatten();
        [rule.limit, rule.held_limit, stall]
            .into_iter()
            .flatten()
            .map(|d| since + d)
            .chain(made.filter(|_| rule.eager).map(|m| m + CUT_AFTER))
            .filter(|&t| t > now)
            .min()
    }

    /// Nothing pins the ring: the next pin starts a hold of its own.
    fn unpin(&mut self) {
        self.pinned = None;
        self.carried = None;
    }

    /// A round at the limit freed the ring: the hold that began at `since`
    /// carries over to the next unit pinned (see the rules).
    fn carry(&mut self, since: Instant) {
        self.pinned = None;
        self.carried = Some(since);
    }

    /// Unit `seq`'s owers start a hold of their own, at `now`.
    fn restart(&mut self, seq: u64, now: Instant) {
        self.pinned = Some((seq, now));
        self.carried = None;
    }
}

mod round;
#[cfg(test)]
mod sim;

pub(super) use round::{Detach, Hands, Move, carry_out};

#[cfg(test)]
mod tests {
    use super::*;

    const SLOTS: u32 = 12;

    /// A simulated clock: `at(ms)` is that many milliseconds after its start.
    struct Clock(Instant);

    impl Clock {
        fn at(&self, ms: u64) -> Instant {
            self.0 + Duration::from_millis(ms)
        }
    }

    /// A full ring of 12 units, all begun by 0 ms; units 0..4 made at
    /// once, the rest made `late_ms` later (workers still filling them).
    fn ring(c: &Clock, late_ms: u64) -> HoldClock {
        let mut h = HoldClock::default();
        for seq in 0..12 {
            h.begun(seq, SLOTS, c.at(0));
            h.made(seq, c.at(if seq < 4 { 1 } else { late_ms }));
        }
        h
    }

    #[test]
    fn a_pin_counts_from_its_first_sight_and_an_unpin_forgets_it() {
        let c = Clock(Instant::now());
        let mut h = ring(&c, 2);
        assert_eq!(h.pinned_since(0, c.at(100)), (c.at(100), false));
        assert_eq!(h.pinned_since(0, c.at(900)), (c.at(100), false));
        h.unpin();
        assert_eq!(h.pinned_since(0, c.at(1000)), (c.at(1000), false));
        // Another unit pinned: a hold of its own.
        assert_eq!(h.pinned_since(1, c.at(1100)), (c.at(1100), false));
    }

    /// The CI failure of `pause::trainers_stopped_at_different_places...`:
    /// the hold began (at 100 ms) while workers were still filling the
    /// unit the second stopped trainer owes (made at 500 ms). That unit
    /// was in the ring all along, so the hold carries to it; counted
    /// from when it was made, it started a second bound.
    #[test]
    fn a_carried_hold_goes_to_a_unit_begun_before_it_even_if_made_after() {
        let c = Clock(Instant::now());
        let mut h = ring(&c, 500);
        let (since, carried) = h.pinned_since(0, c.at(100));
        assert!(!carried);
        // At the limit (3 s): the first trainer's units are cut.
        h.carry(since);
        assert_eq!(h.pinned_since(4, c.at(3100)), (c.at(100), true));
        // Still carried while the same unit pins the ring.
        assert_eq!(h.pinned_since(4, c.at(3200)), (c.at(100), true));
    }

    #[test]
    fn a_unit_begun_after_the_hold_began_starts_a_hold_of_its_own() {
        let c = Clock(Instant::now());
        let mut h = ring(&c, 2);
        let (since, _) = h.pinned_since(0, c.at(100));
        h.carry(since);
        // The cut freed slots: units 12.. are begun after the hold began.
        for seq in 12..16 {
            h.begun(seq, SLOTS, c.at(3100));
        }
        assert_eq!(h.pinned_since(12, c.at(3200)), (c.at(3200), false));
        // And the carry is spent: a later pin counts from its own sight.
        assert_eq!(h.pinned_since(13, c.at(3300)), (c.at(3300), false));
    }

    #[test]
    fn a_unit_the_clock_no_longer_remembers_takes_the_carried_hold() {
        let c = Clock(Instant::now());
        let mut h = HoldClock::default();
        for seq in 0..30 {
            h.begun(seq, SLOTS, c.at(seq));
        }
        let (since, _) = h.pinned_since(29, c.at(100));
        h.carry(since);
        assert_eq!(h.pinned_since(3, c.at(3100)), (c.at(100), true));
    }

    #[test]
    fn a_restart_gives_the_owers_a_bound_of_their_own() {
        let c = Clock(Instant::now());
        let mut h = ring(&c, 2);
        let (since, _) = h.pinned_since(0, c.at(100));
        h.carry(since);
        assert!(h.pinned_since(4, c.at(3100)).1);
        h.restart(4, c.at(3100));
        assert_eq!(h.pinned_since(4, c.at(5000)), (c.at(3100), false));
    }

    const LIMIT: Duration = Duration::from_secs(3);

    fn ower(id: ConsumerId, cuttable: bool) -> Ower {
        Ower {
            id,
            cuttable,
            catching_up: false,
            took: false,
            movable: false,
        }
    }

    fn lockstep() -> Rule {
        Rule {
            eager: false,
            stall_cut: false,
            workers: 1,
            limit: Some(LIMIT),
            held_limit: Some(LIMIT),
        }
    }

    #[test]
    fn lockstep_waits_for_the_limit_then_cuts_and_detaches_by_kind() {
        let c = Clock(Instant::now());
        let mut h = ring(&c, 2);
        let owe = [ower(1, true), ower(2, false)];
        assert_eq!(
            h.decide(lockstep(), Some((0, &owe)), true, c.at(100)),
            Verdict::Wait
        );
        assert_eq!(
            h.decide(lockstep(), Some((0, &owe)), true, c.at(3099)),
            Verdict::Wait
        );
        assert_eq!(
            h.decide(lockstep(), Some((0, &owe)), true, c.at(3100)),
            Verdict::Act {
                cut: vec![1],
                detach: vec![2],
                held: LIMIT,
                move_only: false,
            }
        );
    }

    /// The defaults' shape (2 s and 30 s, here 3 s and 9 s): at the limit
    /// the ower that may be cut is cut and the one without a replay arena
    /// detached, while the one that took the unit (its program holds it)
    /// is waited for until the held-batch limit, counted from the same
    /// start, then detached; nothing is done in between.
    /// Where the ring can move away from what a holder holds, it is named
    /// at the limit with the others (the runtime moves the ring), not
    /// waited for to the held-batch limit; one that cannot be moved is.
    #[test]
    fn one_holding_the_unit_the_ring_can_leave_is_named_at_the_limit() {
        let c = Clock(Instant::now());
        let mut h = ring(&c, 2);
        let rule = Rule {
            eager: false,
            stall_cut: false,
            workers: 1,
            limit: Some(LIMIT),
            held_limit: Some(3 * LIMIT),
        };
        let holder = |id, movable| Ower {
            took: true,
            movable,
            ..ower(id, false)
        };
        let owe = [ower(1, true), holder(3, true), holder(4, false)];
        assert_eq!(
            h.decide(rule, Some((0, &owe)), true, c.at(100)),
            Verdict::Wait
        );
        assert_eq!(
            h.decide(rule, Some((0, &owe)), true, c.at(3099)),
            Verdict::Wait
        );
        assert_eq!(
            h.decide(rule, Some((0, &owe)), true, c.at(3100)),
            Verdict::Act {
                cut: vec![1],
                detach: vec![3],
                held: LIMIT,
                move_only: false,
            }
        );
    }

    #[test]
    fn one_holding_the_unit_is_waited_for_to_the_held_batch_limit_the_others_cut_at_the_limit() {
        let c = Clock(Instant::now());
        let mut h = ring(&c, 2);
        let rule = Rule {
            eager: false,
            stall_cut: false,
            workers: 1,
            limit: Some(LIMIT),
            held_limit: Some(3 * LIMIT),
        };
        let holder = Ower {
            took: true,
            ..ower(3, false)
        };
        let owe = [ower(1, true), ower(2, false), holder];
        assert_eq!(
            h.decide(rule, Some((0, &owe)), true, c.at(100)),
            Verdict::Wait
        );
        assert_eq!(
            h.decide(rule, Some((0, &owe)), true, c.at(3100)),
            Verdict::Act {
                cut: vec![1],
                detach: vec![2],
                held: LIMIT,
                move_only: false,
            }
        );
        // Only the holder owes the unit now: waited for, its hold running
        // from 100 ms.
        let owe = [holder];
        for at in [3200, 6000, 9099] {
            assert_eq!(
                h.decide(rule, Some((0, &owe)), true, c.at(at)),
                Verdict::Wait,
                "{at}"
            );
        }
        assert_eq!(
            h.decide(rule, Some((0, &owe)), true, c.at(9100)),
            Verdict::Act {
                cut: vec![],
                detach: vec![3],
                held: 3 * LIMIT,
                move_only: false,
            }
        );
        // Decoupled: the same holder waits to the held-batch limit too.
        let mut h = ring(&c, 2);
        let eager = Rule {
            eager: true,
            ..rule
        };
        assert_eq!(
            h.decide(eager, Some((0, &owe)), true, c.at(100)),
            Verdict::Wait
        );
        assert_eq!(
            h.decide(eager, Some((0, &owe)), true, c.at(3100)),
            Verdict::Wait
        );
        assert!(matches!(
            h.decide(eager, Some((0, &owe)), true, c.at(9100)),
            Verdict::Act { ref detach, .. } if detach == &[3]
        ));
    }

    /// A ring of 12 units, unit `seq` begun at `seq × make_ms` and made
    /// `make_ms` later.
    fn made_in(c: &Clock, make_ms: u64) -> HoldClock {
        let mut h = HoldClock::default();
        for seq in 0..12 {
            h.begun(seq, SLOTS, c.at(seq * make_ms));
            h.made(seq, c.at((seq + 1) * make_ms));
        }
        h
    }

    /// The default pace (`auto`) holds the others behind a pinned unit as
    /// long as remaking what a cut takes back would take (12 units made
    /// in `make_ms` each, by `workers` threads), at least 250 ms and at
    /// most the limit, and says when to look again; explicit lockstep
    /// waits for the limit.
    #[test]
    fn the_default_pace_holds_the_others_while_that_is_cheaper_than_a_replay() {
        let auto = Rule {
            stall_cut: true,
            ..lockstep()
        };
        let owe = [ower(1, true)];
        // 12 × 30 ms by one thread; by four (the floor); 12 × 100 ms by
        // two; 12 × 400 ms by one (past the limit: the limit).
        for (make_ms, workers, cut_at) in
            [(30, 1, 360), (30, 4, 250), (100, 2, 600), (400, 1, 3000)]
        {
            for rule in [
                Rule { workers, ..auto },
                Rule {
                    workers,
                    ..lockstep()
                },
            ] {
                let at = if rule.stall_cut { cut_at } else { 3000 };
                let c = Clock(Instant::now());
                let mut h = made_in(&c, make_ms);
                let t = 13 * make_ms;
                assert_eq!(
                    h.decide(rule, Some((0, &owe)), true, c.at(t)),
                    Verdict::Wait
                );
                assert_eq!(h.next_look(rule, c.at(t)), Some(c.at(t + at)), "{rule:?}");
                assert_eq!(
                    h.decide(rule, Some((0, &owe)), true, c.at(t + at - 1)),
                    Verdict::Wait,
                    "units made in {make_ms} ms, {rule:?}"
                );
                assert_eq!(
                    h.decide(rule, Some((0, &owe)), true, c.at(t + at)),
                    Verdict::Act {
                        cut: vec![1],
                        detach: vec![],
                        held: Duration::from_millis(at),
                        move_only: false,
                    },
                    "units made in {make_ms} ms, {rule:?}"
                );
            }
        }
        // A unit later in the ring owes fewer units to remake: pinned at
        // unit 8, four units of 100 ms.
        let c = Clock(Instant::now());
        let h = made_in(&c, 100);
        assert_eq!(h.stall_after(8, 1), Some(Duration::from_millis(400)));
        assert_eq!(h.stall_after(0, 1), Some(Duration::from_millis(1200)));
        // One that holds the pinned unit itself where the ring can move
        // away from it (a trainer crawling through a step with its batch)
        // is named at the same moment, under `auto` only (lockstep: at
        // the limit); one the ring cannot leave waits for its bound.
        let holder = [Ower {
            took: true,
            movable: true,
            ..ower(1, false)
        }];
        for (rule, at) in [(auto, 360), (lockstep(), 3000)] {
            let mut h = made_in(&c, 30);
            let t = 13 * 30;
            assert_eq!(
                h.decide(rule, Some((0, &holder)), true, c.at(t)),
                Verdict::Wait
            );
            assert_eq!(
                h.decide(rule, Some((0, &holder)), true, c.at(t + at - 1)),
                Verdict::Wait
            );
            assert_eq!(
                h.decide(rule, Some((0, &holder)), true, c.at(t + at)),
                Verdict::Act {
                    cut: vec![],
                    detach: vec![1],
                    held: Duration::from_millis(at),
                    // Early: moved only where a region is ready.
                    move_only: at < 3000,
                },
                "{rule:?}"
            );
            // Not moved: a stall cut's hold runs on (no hold of its own).
            assert!(!h.unmoved(0, c.at(t + at)));
            // Named early where the ring could not move yet (the same
            // unit still pinned), the hold runs on from its start to the
            // limit.
            if at < 3000 {
                assert_eq!(
                    h.decide(rule, Some((0, &holder)), true, c.at(t + 3000)),
                    Verdict::Act {
                        cut: vec![],
                        detach: vec![1],
                        held: Duration::from_millis(3000),
                        move_only: false,
                    },
                    "{rule:?}"
                );
            }
        }
        let fixed = [Ower {
            movable: false,
            ..holder[0]
        }];
        let mut h = made_in(&c, 30);
        assert_eq!(
            h.decide(auto, Some((0, &fixed)), true, c.at(13 * 30)),
            Verdict::Wait
        );
        assert_eq!(
            h.decide(auto, Some((0, &fixed)), true, c.at(13 * 30 + 360)),
            Verdict::Wait
        );
        // Nothing made yet: no stall cut, only the limit.
        let mut h = HoldClock::default();
        h.begun(0, SLOTS, c.at(0));
        assert_eq!(h.stall_after(0, 1), None);
        assert_eq!(
            h.decide(auto, Some((0, &owe)), true, c.at(0)),
            Verdict::Wait
        );
        assert_eq!(h.next_look(auto, c.at(0)), Some(c.at(3000)));
        assert_eq!(
            h.decide(auto, Some((0, &owe)), true, c.at(2999)),
            Verdict::Wait
        );
    }

    #[test]
    fn nothing_is_done_without_a_limit_or_while_nobody_waits() {
        let c = Clock(Instant::now());
        let mut h = ring(&c, 2);
        let owe = [ower(1, true)];
        let inf = Rule {
            eager: false,
            stall_cut: false,
            workers: 1,
            limit: None,
            held_limit: None,
        };
        assert_eq!(
            h.decide(inf, Some((0, &owe)), true, c.at(100)),
            Verdict::Wait
        );
        assert_eq!(
            h.decide(inf, Some((0, &owe)), true, c.at(99_000)),
            Verdict::Wait
        );
        // Nobody waits: no hold starts.
        assert_eq!(
            h.decide(lockstep(), Some((0, &owe)), false, c.at(100)),
            Verdict::Wait
        );
        assert_eq!(
            h.decide(lockstep(), Some((0, &owe)), true, c.at(200)),
            Verdict::Wait
        );
        assert_eq!(h.pinned_since(0, c.at(300)), (c.at(200), false));
    }

    /// A round at the limit carries its hold to unit 1, which another
    /// ower took after the hold began (a trainer crawling through its
    /// step): it is not detached for a hold that was not its own. Where
    /// the ring can move away from it, the round names it move-only (cut,
    /// the ring moved: the others' wait ends within the limit); told it
    /// could not move, it gets a hold of its own. One the ring cannot
    /// leave gets that at once.
    #[test]
    fn a_carried_hold_moves_the_ring_from_a_holder_where_it_can_else_gives_it_its_own() {
        let c = Clock(Instant::now());
        let laggard = [ower(1, false)];
        let holder = |movable| Ower {
            took: true,
            movable,
            ..ower(2, false)
        };
        for movable in [true, false] {
            let mut h = ring(&c, 2);
            h.decide(lockstep(), Some((0, &laggard)), true, c.at(100));
            let v = h.decide(lockstep(), Some((0, &laggard)), true, c.at(3100));
            assert!(matches!(v, Verdict::Act { ref detach, .. } if detach == &[1]));
            let owe = [holder(movable)];
            let before = h.restarts;
            let v = h.decide(lockstep(), Some((1, &owe)), true, c.at(3200));
            if movable {
                assert_eq!(
                    v,
                    Verdict::Act {
                        cut: vec![],
                        detach: vec![2],
                        held: Duration::from_millis(3100),
                        move_only: true,
                    }
                );
                assert!(h.unmoved(1, c.at(3200)), "not moved: its own hold");
                assert!(!h.unmoved(1, c.at(3200)), "told once");
            } else {
                assert_eq!(
                    v,
                    Verdict::Act {
                        cut: vec![],
                        detach: vec![],
                        held: Duration::from_millis(3100),
                        move_only: false,
                    }
                );
            }
            assert_eq!(h.restarts, before + 1, "one hold of its own, counted");
            // Either way its own hold runs from 3200 to the limit.
            assert_eq!(h.pinned_since(1, c.at(5000)), (c.at(3200), false));
            assert_eq!(
                h.decide(lockstep(), Some((1, &owe)), true, c.at(6199)),
                Verdict::Wait
            );
            assert!(matches!(
                h.decide(lockstep(), Some((1, &owe)), true, c.at(6200)),
                Verdict::Act { ref detach, move_only: false, .. } if detach == &[2]
            ));
        }
    }

    #[test]
    fn a_joiner_catching_up_is_waited_for_past_the_limit() {
        let c = Clock(Instant::now());
        let mut h = ring(&c, 2);
        let owe = [Ower {
            id: 1,
            cuttable: false,
            catching_up: true,
            took: false,
            movable: false,
        }];
        h.decide(lockstep(), Some((0, &owe)), true, c.at(100));
        let v = h.decide(lockstep(), Some((0, &owe)), true, c.at(9000));
        assert_eq!(
            v,
            Verdict::Act {
                cut: vec![],
                detach: vec![],
                held: Duration::from_millis(8900),
                move_only: false,
            }
        );
    }

    #[test]
    fn decoupled_cuts_once_the_unit_is_old_enough_and_waits_for_one_it_cannot_cut() {
        let c = Clock(Instant::now());
        let mut h = ring(&c, 500);
        let eager = Rule {
            eager: true,
            ..lockstep()
        };
        // Unit 5 was made at 500: young until 510.
        let owe = [ower(1, true)];
        assert_eq!(
            h.decide(eager, Some((5, &owe)), true, c.at(505)),
            Verdict::Wait
        );
        assert!(matches!(
            h.decide(eager, Some((5, &owe)), true, c.at(510)),
            Verdict::Act { ref cut, .. } if cut == &[1]
        ));
        // One that cannot be cut is detached at the limit only.
        let owe = [ower(1, true), ower(2, false)];
        assert_eq!(
            h.decide(eager, Some((6, &owe)), true, c.at(600)),
            Verdict::Wait
        );
        assert!(matches!(
            h.decide(eager, Some((6, &owe)), true, c.at(3600)),
            Verdict::Act { ref detach, .. } if detach == &[2]
        ));
    }

    /// Found by the simulation: under decoupled pace a holder of the
    /// pinned unit that owes more is cut at once, and still holds the
    /// unit. Its cut once ended the hold, so the waiting consumers waited
    /// for a second bound from then; the hold runs on from when the unit
    /// pinned the ring, and the holder is detached at the held-batch
    /// limit (it could not be moved).
    #[test]
    fn a_holder_cut_under_decoupled_pace_is_still_held_to_the_limit() {
        let eager = Rule {
            eager: true,
            ..lockstep()
        };
        // Whether the ring may move away from what it holds or not: its
        // cut frees nothing it took.
        for movable in [false, true] {
            let c = Clock(Instant::now());
            let mut h = ring(&c, 2);
            let holder = |cuttable| Ower {
                id: 1,
                cuttable,
                catching_up: false,
                took: true,
                movable,
            };
            // Pinned from 100; cut at once (it owes more than the unit).
            assert!(matches!(
                h.decide(eager, Some((0, &[holder(true)])), true, c.at(100)),
                Verdict::Act { ref cut, ref detach, .. } if cut == &[1] && detach.is_empty()
            ));
            // Cut, it holds the unit still: waited for, from 100.
            assert_eq!(
                h.decide(eager, Some((0, &[holder(false)])), true, c.at(2000)),
                Verdict::Wait,
                "movable: {movable}"
            );
            // At the limit from 100 it is named (detached, or the ring
            // moved away from it).
            assert!(
                matches!(
                    h.decide(eager, Some((0, &[holder(false)])), true, c.at(3100)),
                    Verdict::Act { ref detach, held, .. } if detach == &[1] && held == LIMIT
                ),
                "movable: {movable}"
            );
        }
    }

    #[test]
    fn age_runs_from_the_unit_made_not_begun() {
        let c = Clock(Instant::now());
        let h = ring(&c, 500);
        let ten = Duration::from_millis(10);
        assert!(!h.younger_than(0, ten, c.at(20)));
        // Begun at 0, made at 500: young until 510.
        assert!(h.younger_than(5, ten, c.at(505)));
        assert!(!h.younger_than(5, ten, c.at(510)));
        // Forgotten or never begun here: old enough.
        assert!(!h.younger_than(99, ten, c.at(0)));
    }

    /// Random schedules on a simulated clock: consumers stopped at
    /// random units of a full ring (each cut to replay or not), a reader
    /// waiting for data throughout, workers still filling some units
    /// when the hold begins, the clock stepping 1-400 ms between looks.
    /// Lockstep acts on no one before the limit, cuts only those that
    /// may be cut and detaches only those that may not; when all may be
    /// cut, all are gone one limit after the hold began (one bound, not
    /// one each in turn), and every one that may not adds at most one
    /// limit of its own.
    mod schedules {
        use super::*;
        use proptest::prelude::*;

        const STEP_MS: u64 = 400;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
            #[test]
            fn stopped_consumers_are_all_gone_within_their_bounds(
                stops in proptest::collection::vec((0u64..12, any::<bool>()), 1..6),
                fill in proptest::collection::vec(0u64..300, 24),
                steps in proptest::collection::vec(1u64..STEP_MS, 1..50),
            ) {
                let c = Clock(Instant::now());
                let mut h = HoldClock::default();
                // The ring of 12 was begun before the hold; some units are
                // made after it began.
                for seq in 0..12 {
                    h.begun(seq, SLOTS, c.at(seq));
                    h.made(seq, c.at(seq + fill[seq as usize]));
                }
                let mut left: Vec<(ConsumerId, u64, bool)> = stops
                    .iter()
                    .enumerate()
                    .map(|(k, &(stop, may))| (k as ConsumerId, stop, may))
                    .collect();
                let uncuttable = left.iter().filter(|o| !o.2).count() as u32;
                let mut head = 12u64;
                let mut now = 20u64;
                let first = now + steps[0];
                let mut done_at = None;
                // One limit for all that may be cut, one more for each
                // that may not (it may have taken the unit and be moving);
                // each round seen up to a step late.
                let bound = first + (3000 + STEP_MS) * u64::from(1 + uncuttable);
                for &dt in steps.iter().cycle() {
                    now += dt;
                    if left.is_empty() || now > bound + STEP_MS {
                        break;
                    }
                    // The pipeline looks again at once after acting.
                    while let Some(p) = left.iter().map(|o| o.1).min() {
                        let owe: Vec<Ower> = left
                            .iter()
                            .filter(|o| o.1 == p)
                            .map(|o| ower(o.0, o.2))
                            .collect();
                        let Verdict::Act { cut, detach, held, .. } =
                            h.decide(lockstep(), Some((p, &owe)), true, c.at(now))
                        else {
                            break;
                        };
                        prop_assert!(held >= LIMIT, "acted after {held:?}");
                        prop_assert!(now >= first + 3000, "acted at {now} ms");
                        for id in &cut {
                            prop_assert!(owe.iter().any(|o| o.id == *id && o.cuttable));
                        }
                        for id in &detach {
                            prop_assert!(owe.iter().any(|o| o.id == *id && !o.cuttable));
                        }
                        let before = left.len();
                        left.retain(|o| !cut.contains(&o.0) && !detach.contains(&o.0));
                        if left.is_empty() {
                            done_at = Some(now);
                        }
                        // The freed slots are begun again now.
                        let next = left.iter().map(|o| o.1).min().unwrap_or(head);
                        while head < next.max(p + 1) + 12 {
                            h.begun(head, SLOTS, c.at(now));
                            h.made(head, c.at(now + fill[(head % 24) as usize]));
                            head += 1;
                        }
                        if left.len() == before {
                            break;
                        }
                    }
                }
                let Some(done) = done_at else {
                    return Err(TestCaseError::fail(format!("still held at {now} ms: {left:?}")));
                };
                prop_assert!(done <= bound, "all gone at {done} ms, bound {bound} ms");
            }
        }
    }
}
