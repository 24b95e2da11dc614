//! Pipeline threads matched to demand (`workers` left out): the stream
//! starts `cap` threads (`[broker] max_cpu_share` of the host's cores)
//! and keeps only as many of them working as its trainers need, one at
//! first; the rest wait, parked, until they are needed again. Every such
//! stream's working threads come from one pool of `cap` in the broker's
//! budget (`budget::Threads`): together they never work on more, but
//! each keeps its first thread. No clock here: the runtime passes the time
//! and the totals it kept (`fill.rs`).
//!
//! # Rules
//!
//! * Judged once a [`TICK`] at most, over the time since the last judgement,
//!   from two shares: `blocked`, the part of the working threads' time
//!   spent waiting for a free slot (the trainers take less than the
//!   threads make), and `stall`, the part of the trainers' time spent
//!   waiting for data (they take more).
//! * **Grow** where the trainers stall ([`STALL`] or more) while the
//!   threads are rarely blocked (under [`SLACK`]): to what the stall says
//!   they need, `active / (1 - stall)`, at least one more, within `cap`.
//!   A trainer's stall alone never grows it: the threads must also be
//!   making all they can (a trainer lying about its wait moves nothing
//!   while the ring is full).
//! * **Shrink** where the threads are blocked [`BLOCKED`] or more, two
//!   judgements in a row, whatever the trainers say (one that waits while
//!   the threads wait for slots waits for a slower trainer, which sets the
//!   pace, not for threads): to what the threads' working share says they
//!   need, `active × (1 - blocked) × 1.25`, at least one less, at least
//!   one thread.
//! * Otherwise nothing changes. With no trainer nothing is judged (the
//!   threads wait anyway).

use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use super::{Inner, Stream};
use crate::budget::Threads;

/// How often the demand is judged.
pub(super) const TICK: Duration = Duration::from_millis(500);
/// Trainers stall: grow.
pub(super) const STALL: f64 = 0.02;
/// Threads this little blocked make all they can.
pub(super) const SLACK: f64 = 0.05;
/// Threads this much blocked make more than is taken: shrink.
pub(super) const BLOCKED: f64 = 0.25;

/// What the runtime has counted since the stream started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Totals {
    /// The pipeline threads' time waiting for a free slot, all together.
    pub blocked: Duration,
    /// The trainers' time waiting for data, all together (what they say).
    pub wait: Duration,
    /// Trainers reading now.
    pub trainers: u32,
}

/// How many pipeline threads work ([module rules](self)).
#[derive(Debug)]
pub(super) struct Autoscale {
    /// `None`: a fixed number (`workers` given), all working.
    cap: Option<u32>,
    active: u32,
    /// The last judgement: when, and the totals then.
    last: Option<(Instant, Totals)>,
    /// Judgements in a row that found too many threads.
    over: u32,
    /// What it holds of the broker's pool of threads.
    pool: Option<Threads>,
}

impl Autoscale {
    /// `workers` threads, all working.
    pub(super) fn fixed(workers: u32) -> Autoscale {
        Autoscale {
            cap: None,
            active: workers,
            last: None,
            over: 0,
            pool: None,
        }
    }

    /// Up to `cap` threads, as many as `pool` gives: one at first.
    pub(super) fn automatic(cap: u32, mut pool: Threads) -> Autoscale {
        pool.resize(1);
        Autoscale {
            cap: Some(cap.max(1)),
            pool: Some(pool),
            ..Autoscale::fixed(1)
        }
    }

    /// Threads that work now; thread `i` works while `i < active()`.
    pub(super) fn active(&self) -> u32 {
        self.active
    }

    /// Whether the number follows demand.
    pub(super) fn is_automatic(&self) -> bool {
        self.cap.is_some()
    }

    /// Whether a judgement is due at `now` (the totals are worth
    /// gathering).
    pub(super) fn due(&self, now: Instant) -> bool {
        self.cap.is_some()
            && self
                .last
                .is_none_or(|(then, _)| now.saturating_duration_since(then) >= TICK)
    }

    /// Judges the demand at `now` from `totals` if a [`TICK`] has passed;
    /// the new number of working threads where it changed.
    pub(super) fn judge(&mut self, now: Instant, totals: Totals) -> Option<u32> {
        let cap = self.cap?;
        let Some((then, before)) = self.last else {
            self.last = Some((now, totals));
            return None;
        };
        let dt = now.saturating_duration_since(then);
        if dt < TICK {
            return None;
        }
        self.last = Some((now, totals));
        if totals.trainers == 0 {
            self.over = 0;
            return None;
        }
        let active = f64::from(self.active);
        let share =
            |d: Duration, of: f64| (d.as_secs_f64() / (of * dt.as_secs_f64())).clamp(0.0, 1.0);
        let blocked = share(totals.blocked.saturating_sub(before.blocked), active);
        let stall = share(
            totals.wait.saturating_sub(before.wait),
            f64::from(totals.trainers),
        );
        let want = if stall >= STALL && blocked < SLACK {
            self.over = 0;
            let need = (active / (1.0 - stall).max(0.25)).ceil() as u32;
            need.max(self.active + 1).min(cap)
        } else if blocked >= BLOCKED {
            self.over += 1;
            if self.over < 2 {
                return None;
            }
            self.over = 0;
            let need = (active * (1.0 - blocked) * 1.25).ceil() as u32;
            need.min(self.active.saturating_sub(1)).max(1)
        } else {
            self.over = 0;
            return None;
        };
        // The pool may give fewer; the first thread is the stream's own.
        let want = self.pool.as_mut().map_or(want, |p| p.resize(want)).max(1);
        (want != self.active).then(|| {
            self.active = want;
            want
        })
    }
}

/// How long a parked thread sleeps before it looks again (a stop or more
/// work wakes it sooner).
const PARKED: Duration = Duration::from_secs(1);

/// Whether pipeline thread `index` works now; judges the demand first
/// when due (at `now`), and wakes the parked threads it adds.
pub(super) fn works(s: &Stream, inner: &mut Inner, index: u32, now: Instant) -> bool {
    if inner.fill.scale.due(now) {
        let totals = Totals {
            blocked: inner.fill.blocked(),
            wait: inner
                .conns
                .values()
                .map(|c| c.tally.wait_ns.saturating_add(c.tally.mailbox.wait_ns))
                .fold(Duration::ZERO, |sum, ns| sum + Duration::from_nanos(ns)),
            trainers: u32::try_from(inner.conns.len()).unwrap_or(u32::MAX),
        };
        let before = inner.fill.scale.active();
        if let Some(n) = inner.fill.scale.judge(now, totals) {
            tracing::debug!(stream = %s.plan.name, from = before, to = n, "pipeline threads working");
            if n > before {
                s.park_cv.notify_all();
            }
        }
    }
    index < inner.fill.scale.active()
}

/// Parks a thread the stream does not need now, until more are needed or
/// the stream stops.
pub(super) fn park<'a>(s: &'a Stream, inner: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
    s.park_cv
        .wait_timeout(inner, PARKED)
        .unwrap_or_else(|p| p.into_inner())
        .0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> Threads {
        crate::budget::Budget::new(1, 0).threads()
    }

    /// A stream whose threads each make `per_thread` images a second, read
    /// by trainers wanting `demand` a second, judged every second for
    /// `secs`: the working threads after each judgement.
    fn run(
        a: &mut Autoscale,
        demand: f64,
        per_thread: f64,
        secs: u32,
        t: &mut (Instant, Totals),
    ) -> Vec<u32> {
        let mut seen = Vec::new();
        for _ in 0..secs {
            let supply = f64::from(a.active()) * per_thread;
            // What the threads cannot give, the trainers wait for; what
            // they are not asked for, the threads wait to give.
            let (stall, blocked) = if supply >= demand {
                (0.0, 1.0 - demand / supply)
            } else {
                (1.0 - supply / demand, 0.0)
            };
            t.0 += TICK;
            t.1.blocked += TICK.mul_f64(blocked * f64::from(a.active()));
            t.1.wait += TICK.mul_f64(stall * f64::from(t.1.trainers));
            a.judge(t.0, t.1);
            seen.push(a.active());
        }
        seen
    }

    fn start(a: &mut Autoscale, trainers: u32) -> (Instant, Totals) {
        let t = (
            Instant::now(),
            Totals {
                trainers,
                ..Totals::default()
            },
        );
        assert_eq!(
            a.judge(t.0, t.1),
            None,
            "the first look only starts the clock"
        );
        t
    }

    #[test]
    fn it_settles_on_the_fewest_threads_that_meet_demand_and_follows_it() {
        // 8 threads of 100 images/s each; trainers wanting 250/s need 3.
        let mut a = Autoscale::automatic(8, pool());
        let mut t = start(&mut a, 3);
        let seen = run(&mut a, 250.0, 100.0, 10, &mut t);
        assert_eq!(*seen.last().unwrap(), 3, "{seen:?}");
        let settled = seen.iter().position(|&n| n == 3).unwrap();
        assert!(settled < 6, "within 6 s: {seen:?}");
        assert!(
            seen[settled..].iter().all(|&n| n == 3),
            "and stays: {seen:?}"
        );
        // Demand doubles: 5 threads; then drops to 90/s: 1.
        let seen = run(&mut a, 500.0, 100.0, 10, &mut t);
        assert!(
            seen.iter().take(3).any(|&n| n >= 5),
            "grows at once: {seen:?}"
        );
        assert_eq!(*seen.last().unwrap(), 5, "{seen:?}");
        let seen = run(&mut a, 90.0, 100.0, 10, &mut t);
        assert_eq!(*seen.last().unwrap(), 1, "{seen:?}");
        // More than the cap gives: the cap.
        let seen = run(&mut a, 5000.0, 100.0, 10, &mut t);
        assert!(
            seen.iter().all(|&n| n <= 8) && *seen.last().unwrap() == 8,
            "{seen:?}"
        );
    }

    #[test]
    fn a_trainer_saying_it_waits_grows_nothing_while_the_threads_wait_for_slots() {
        // From one thread: the ring full, the threads wait half their
        // time, and a trainer claims it waits all of its (a liar, or one
        // waiting for a slower trainer that sets the pace): never more.
        let mut a = Autoscale::automatic(8, pool());
        a.active = 1;
        let mut t = start(&mut a, 2);
        for _ in 0..10 {
            t.0 += TICK;
            t.1.blocked += TICK.mul_f64(0.5 * f64::from(a.active()));
            t.1.wait += TICK * 2;
            a.judge(t.0, t.1);
            assert_eq!(a.active(), 1);
        }
        // From eight: it goes down to what the threads' work says.
        let mut a = Autoscale::automatic(8, pool());
        a.active = 8;
        let mut t = start(&mut a, 2);
        let mut seen = vec![];
        for _ in 0..10 {
            t.0 += TICK;
            t.1.blocked += TICK.mul_f64(0.5 * f64::from(a.active()));
            t.1.wait += TICK * 2;
            a.judge(t.0, t.1);
            seen.push(a.active());
        }
        assert!(
            seen.windows(2).all(|w| w[1] <= w[0]) && seen[9] < 8,
            "{seen:?}"
        );
    }

    #[test]
    fn streams_on_one_pool_never_work_on_more_than_it_together() {
        let b = crate::budget::Budget::new(1, 0);
        b.set_thread_pool(4);
        let mut x = Autoscale::automatic(4, b.threads());
        let mut y = Autoscale::automatic(4, b.threads());
        let (mut tx, mut ty) = (start(&mut x, 1), start(&mut y, 1));
        for _ in 0..10 {
            run(&mut x, 1000.0, 100.0, 1, &mut tx);
            run(&mut y, 1000.0, 100.0, 1, &mut ty);
            assert!(
                x.active() + y.active() <= 4,
                "{} + {}",
                x.active(),
                y.active()
            );
            assert!(x.active() >= 1 && y.active() >= 1);
        }
        assert_eq!(x.active() + y.active(), 4);
        // One stream gone: the other may take what it held.
        drop(x);
        run(&mut y, 1000.0, 100.0, 3, &mut ty);
        assert_eq!(y.active(), 4);
    }

    #[test]
    fn fixed_threads_never_change_and_no_trainer_is_no_judgement() {
        let mut a = Autoscale::fixed(3);
        let mut t = start(&mut a, 2);
        let seen = run(&mut a, 10.0, 100.0, 5, &mut t);
        assert_eq!(seen, vec![3; 5]);
        let mut a = Autoscale::automatic(4, pool());
        let mut t = start(&mut a, 0);
        t.0 += TICK * 3;
        t.1.blocked += TICK * 12;
        assert_eq!(a.judge(t.0, t.1), None);
        // Judged no sooner than a tick.
        let mut a = Autoscale::automatic(4, pool());
        let mut t = start(&mut a, 1);
        t.0 += TICK / 2;
        t.1.blocked += TICK * 2;
        assert_eq!(a.judge(t.0, t.1), None);
    }
}
