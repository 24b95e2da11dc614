//! The hold clock: when the units of the ring were begun and made, which
//! unit pins the ring's next slot and since when. No clock inside: every
//! call takes `now` from the stream's runtime, so the rules below are
//! tested on a simulated clock (the tests at the bottom).
//!
//! # Rules
//!
//! * A unit's age (decoupled pace's cut waits until it is
//!   [`super::decouple::CUT_AFTER`] old) runs from when it was made
//!   (published).
//! * A hold runs from when a unit first pinned the ring's next slot while
//!   another consumer waited for data; it ends when nothing pins it.
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

/// One unit of the ring: when the pipeline began it and when it was made.
#[derive(Debug, Clone, Copy)]
struct Unit {
    seq: u64,
    begun: Instant,
    made: Option<Instant>,
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
}

impl HoldClock {
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
    pub(super) fn younger_than(&self, seq: u64, age: Duration, now: Instant) -> bool {
        self.units.iter().find(|u| u.seq == seq).is_some_and(|u| {
            u.made
                .is_none_or(|m| now.saturating_duration_since(m) < age)
        })
    }

    /// Since when unit `seq` has pinned the ring (from `now` if it did
    /// not, or from the hold carried over a round at the limit where `seq`
    /// was begun before that hold began), and whether that is a carried
    /// hold.
    pub(super) fn pinned_since(&mut self, seq: u64, now: Instant) -> (Instant, bool) {
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

    /// Nothing pins the ring: the next pin starts a hold of its own.
    pub(super) fn unpin(&mut self) {
        self.pinned = None;
        self.carried = None;
    }

    /// A round at the limit freed the ring: the hold that began at `since`
    /// carries over to the next unit pinned (see the rules).
    pub(super) fn carry(&mut self, since: Instant) {
        self.pinned = None;
        self.carried = Some(since);
    }

    /// Unit `seq`'s owers start a hold of their own, at `now`.
    pub(super) fn restart(&mut self, seq: u64, now: Instant) {
        self.pinned = Some((seq, now));
        self.carried = None;
    }
}

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
}
