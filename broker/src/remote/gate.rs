//! How many requests to one store run at once: an AIMD gate that starts
//! low, finds what the store sustains, and backs off on throttles and
//! transient faults (see [`super::fetch`]).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// What one request's end tells the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Answered, after this long (entering the gate to the last byte).
    Success(Duration),
    /// A throttle (429, 503) or a transient fault (a reset, a timeout, a
    /// 5xx): the store, or the path to it, is overwhelmed.
    Overload,
    /// An answer that says nothing of load (a 404, a 403).
    Final,
}

/// A request the gate let through: when, and how many were in flight
/// with it (itself included).
#[derive(Debug, Clone, Copy)]
pub(super) struct Ticket {
    at: Instant,
    flying: u32,
}

impl Ticket {
    /// Time since the request was let through (its answer's latency).
    pub(super) fn elapsed(&self) -> Duration {
        self.at.elapsed()
    }
}

/// Requests in flight a store starts with: a plain HTTP server (Python's
/// `http.server`, a small nginx) may take only a few connections at once;
/// object stores soon earn their `requests` by slow start.
pub(crate) const START_REQUESTS: u32 = 8;

/// The AIMD gate: at most `limit` requests at once, `limit` between 1 and
/// `max`, starting at [`START_REQUESTS`] and grown by one per success
/// until the first fault (slow start: doubling each window), then by one
/// per `limit` successes; halved on a throttle or a transient fault (a
/// reset, a timeout, a 5xx; at most once per `CUT_EVERY`, and not for a
/// request sent before the last cut). A fault of a request sent with `n`
/// requests in flight also caps the limit at `n - 1` (a server that
/// takes 4 connections fails the 5th at once, and growing back to 5 every
/// few requests would fail one of every few); the cap rises by one per
/// `PROBE_EVERY` without a fault, so a passing fault costs little.
///
/// A server can also be overwhelmed without a fault: one that accepts few
/// connections at once (Python's `http.server` listens with a backlog of
/// 5) lets the rest wait for the kernel's SYN retry, a second or more,
/// and answers them all in the end. So an answer slower than both
/// `SLOW_ANSWER` and `SLOW_RATIO` times the usual one (an average over
/// about `USUAL_SAMPLES` answers that were not slow) counts as a fault. A
/// store that is slow throughout (far away, big objects, a busy broker)
/// moves the usual answer with it, so it is never cut for that.
#[derive(Debug)]
pub(super) struct Gate {
    max: f64,
    state: Mutex<GateState>,
    freed: Notify,
}

#[derive(Debug)]
struct GateState {
    limit: f64,
    in_flight: u32,
    last_cut: Option<Instant>,
    /// No fault yet: grow by one per success.
    slow_start: bool,
    /// The most `limit` grows to now, and when it last rose or was set.
    ceiling: f64,
    probed: Instant,
    /// The usual answer's latency, seconds (none before an answer), and
    /// how many answers it averages (at most `USUAL_SAMPLES`).
    usual: Option<f64>,
    usual_of: f64,
}

const CUT_EVERY: Duration = Duration::from_millis(200);
const PROBE_EVERY: Duration = Duration::from_secs(5);
/// An answer slower than this and than `SLOW_RATIO` usual ones counts as
/// a fault: the kernel's first SYN retry comes after a second.
const SLOW_ANSWER: f64 = 1.0;
const SLOW_RATIO: f64 = 8.0;
/// Answers the usual latency averages over: their mean until there are
/// this many, then an exponential average over about this many.
const USUAL_SAMPLES: f64 = 100.0;

impl Gate {
    pub(super) fn new(max: u32) -> Gate {
        Gate {
            max: f64::from(max.max(1)),
            state: Mutex::new(GateState {
                limit: f64::from(max.clamp(1, START_REQUESTS)),
                in_flight: 0,
                last_cut: None,
                slow_start: true,
                ceiling: f64::from(max.max(1)),
                probed: Instant::now(),
                usual: None,
                usual_of: 0.0,
            }),
            freed: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) async fn enter(&self) -> Ticket {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut s = self.lock();
                if f64::from(s.in_flight) < s.limit.floor().max(1.0) {
                    s.in_flight += 1;
                    return Ticket {
                        at: Instant::now(),
                        flying: s.in_flight,
                    };
                }
            }
            freed.await;
        }
    }

    /// Counts a request's end; true when it was an answer slow enough to
    /// count as a fault (see [`Gate`]).
    pub(super) fn leave(&self, ticket: Ticket, outcome: Outcome) -> bool {
        let mut s = self.lock();
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.probed.elapsed() >= PROBE_EVERY {
            s.ceiling = (s.ceiling + 1.0).min(self.max);
            s.probed = Instant::now();
        }
        let slow = matches!(outcome, Outcome::Success(took) if s.slow(took.as_secs_f64()));
        let outcome = if slow { Outcome::Overload } else { outcome };
        match outcome {
            Outcome::Success(_) if s.slow_start => s.limit = (s.limit + 1.0).min(s.ceiling),
            Outcome::Success(_) => s.limit = (s.limit + 1.0 / s.limit).min(s.ceiling),
            // Sent before the gate last cut: that cut answered the load it
            // met (a burst's faults and slow answers come back together).
            Outcome::Overload if s.last_cut.is_some_and(|cut| ticket.at < cut) => {}
            // The store is overwhelmed (or the path to it is): fewer at once.
            Outcome::Overload => {
                s.slow_start = false;
                s.ceiling = s
                    .ceiling
                    .min(f64::from(ticket.flying.saturating_sub(1).max(1)));
                s.probed = Instant::now();
                if s.last_cut.is_none_or(|t| t.elapsed() >= CUT_EVERY) {
                    s.limit = (s.limit / 2.0).max(1.0);
                    s.last_cut = Some(Instant::now());
                }
                s.limit = s.limit.min(s.ceiling);
            }
            Outcome::Final => {}
        }
        drop(s);
        self.freed.notify_waiters();
        slow
    }

    pub(super) fn limit(&self) -> u32 {
        self.lock().limit.floor() as u32
    }
}

impl GateState {
    /// Whether an answer that took `took` seconds was a slow one (see
    /// [`Gate`]); one that was not counts toward the usual answer.
    fn slow(&mut self, took: f64) -> bool {
        let usual = *self.usual.get_or_insert(took);
        let slow = took >= SLOW_ANSWER && took >= SLOW_RATIO * usual;
        if !slow {
            // The first answers (a cold connection, a server still
            // warming up, a busy machine) weigh as much as later ones,
            // not a hundred times more: seeded with the first answer
            // alone, a 0.3 s first answer held the usual one above 0.2 s
            // for the next hundred, and a server keeping requests waiting
            // 1.5 s was never seen (one run in three of the test).
            self.usual_of = (self.usual_of + 1.0).min(USUAL_SAMPLES);
            self.usual = Some(usual + (took - usual) / self.usual_of);
        }
        slow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer at the store's usual pace.
    const FAST: Outcome = Outcome::Success(Duration::from_millis(10));

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }

    /// `n` requests through the gate at once: entered, then left one by
    /// one, the last entered first, as `outcomes` say (the rest succeed):
    /// the first outcome is the request sent with `n` in flight.
    fn at_once(g: &Gate, rt: &tokio::runtime::Runtime, n: usize, outcomes: &[Outcome]) {
        let tickets: Vec<Ticket> = (0..n).map(|_| rt.block_on(g.enter())).collect();
        for (k, t) in tickets.into_iter().rev().enumerate() {
            g.leave(t, outcomes.get(k).copied().unwrap_or(FAST));
        }
    }

    #[test]
    fn the_gate_starts_low_and_doubles_each_window_until_a_fault() {
        let g = Gate::new(128);
        let rt = runtime();
        assert_eq!(g.limit(), START_REQUESTS);
        // One more per success: a window of 8 doubles it.
        at_once(&g, &rt, 8, &[]);
        assert_eq!(g.limit(), 16);
        // A reset or a timeout (transient) with 16 in flight halves it,
        // ends slow start, and caps it at 15.
        at_once(&g, &rt, 16, &[Outcome::Overload]);
        assert_eq!(g.limit(), 9, "8, then + 1/limit for each of 15 successes");
        // A missing object says nothing about load.
        at_once(&g, &rt, 1, &[Outcome::Final]);
        assert_eq!(g.limit(), 9);
        // Never past the configured most.
        assert_eq!(Gate::new(3).limit(), 3);
    }

    #[test]
    fn a_server_that_fails_the_fifth_connection_caps_the_gate_at_four() {
        let g = Gate::new(128);
        let rt = runtime();
        at_once(&g, &rt, 5, &[Outcome::Overload]);
        assert_eq!(g.limit(), 4);
        // However many succeed at 4, it does not try 5 again until a
        // fault-free `PROBE_EVERY` has passed.
        for _ in 0..100 {
            at_once(&g, &rt, 4, &[]);
        }
        assert_eq!(g.limit(), 4);
    }

    #[test]
    fn the_gate_halves_on_throttles_and_grows_back_by_one_per_window() {
        let g = Gate::new(16);
        let rt = runtime();
        // Slow start to the most: a window of 8.
        at_once(&g, &rt, 8, &[]);
        assert_eq!(g.limit(), 16);
        // Two throttles within CUT_EVERY: one burst, one cut (to 8); the
        // 14 others succeed, + 1/limit each: a little over a window of 8
        // reaches 9.
        at_once(&g, &rt, 16, &[Outcome::Overload, Outcome::Overload]);
        assert_eq!(g.limit(), 9);
    }

    /// A server that makes requests past its few connections wait (a SYN
    /// retry: a second) answers them in the end, with no fault: such an
    /// answer counts as one, capping the gate below the requests then in
    /// flight.
    #[test]
    fn an_answer_that_waited_a_second_counts_as_a_fault() {
        let g = Gate::new(128);
        let rt = runtime();
        at_once(&g, &rt, 8, &[]);
        assert_eq!(g.limit(), 16);
        at_once(
            &g,
            &rt,
            16,
            &[Outcome::Success(Duration::from_millis(1100))],
        );
        assert_eq!(
            g.limit(),
            9,
            "halved, capped at 15, then grown as after a fault"
        );
        // Slower than usual, but under a second: an answer like others.
        at_once(&g, &rt, 9, &[Outcome::Success(Duration::from_millis(900))]);
        assert_eq!(g.limit(), 10);
    }

    /// A first answer slowed by a cold start (a new connection, a busy
    /// machine) is one answer among the first few, not the usual one:
    /// after a few fast answers, one that waited 1.5 s is seen.
    #[test]
    fn a_slow_first_answer_does_not_hide_a_waiting_server() {
        let g = Gate::new(128);
        let rt = runtime();
        at_once(&g, &rt, 1, &[Outcome::Success(Duration::from_millis(300))]);
        for _ in 0..3 {
            at_once(&g, &rt, 4, &[]);
        }
        let before = g.limit();
        at_once(&g, &rt, 1, &[Outcome::Success(Duration::from_millis(1500))]);
        assert!(g.limit() < before, "{} -> {}", before, g.limit());
    }

    /// A store that is slow throughout (far away, big objects) is not
    /// cut: its own pace is the usual answer.
    #[test]
    fn a_store_slow_throughout_is_not_cut() {
        let g = Gate::new(64);
        let rt = runtime();
        let slow = Outcome::Success(Duration::from_millis(1500));
        for _ in 0..6 {
            let n = g.limit() as usize;
            at_once(&g, &rt, n, &vec![slow; n]);
        }
        assert_eq!(g.limit(), 64);
    }

    /// A burst's faults and slow answers come back together, some long
    /// after the first (SYN retries at 1, 3, 7 s): those of requests sent
    /// before the gate cut are the load it already answered, and cut
    /// nothing more.
    #[test]
    fn a_fault_of_a_request_sent_before_the_last_cut_cuts_nothing() {
        let g = Gate::new(128);
        let rt = runtime();
        at_once(&g, &rt, 8, &[]);
        let burst: Vec<Ticket> = (0..16).map(|_| rt.block_on(g.enter())).collect();
        g.leave(burst[15], Outcome::Overload);
        assert_eq!(g.limit(), 8);
        std::thread::sleep(CUT_EVERY);
        for t in &burst[..15] {
            g.leave(*t, Outcome::Success(Duration::from_secs(3)));
        }
        assert_eq!(g.limit(), 8);
        // One sent after the cut still counts: halved to 4, then + 1/limit
        // for each of the 7 others.
        at_once(&g, &rt, 8, &[Outcome::Overload]);
        assert_eq!(g.limit(), 5);
    }
}
