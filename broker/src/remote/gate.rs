//! How many requests to one store run at once: an AIMD gate that starts
//! low, finds what the store sustains, and backs off on throttles and
//! transient faults (see [`super::fetch`]).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// What one request's end tells the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    Success,
    /// A throttle (429, 503) or a transient fault (a reset, a timeout, a
    /// 5xx): the store, or the path to it, is overwhelmed.
    Overload,
    /// An answer that says nothing of load (a 404, a 403).
    Final,
}

/// Requests in flight a store starts with: a plain HTTP server (Python's
/// `http.server`, a small nginx) may take only a few connections at once;
/// object stores soon earn their `requests` by slow start.
pub const START_REQUESTS: u32 = 8;

/// The AIMD gate: at most `limit` requests at once, `limit` between 1 and
/// `max`, starting at [`START_REQUESTS`] and grown by one per success
/// until the first fault (slow start: doubling each window), then by one
/// per `limit` successes; halved on a throttle or a transient fault (a
/// reset, a timeout, a 5xx; at most once per `CUT_EVERY`). A fault with
/// `n` requests in flight also caps the limit at `n - 1` (a server that
/// takes 4 connections fails the 5th at once, and growing back to 5 every
/// few requests would fail one of every few); the cap rises by one per
/// `PROBE_EVERY` without a fault, so a passing fault costs little.
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
}

const CUT_EVERY: Duration = Duration::from_millis(200);
const PROBE_EVERY: Duration = Duration::from_secs(5);

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
            }),
            freed: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) async fn enter(&self) {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut s = self.lock();
                if f64::from(s.in_flight) < s.limit.floor().max(1.0) {
                    s.in_flight += 1;
                    return;
                }
            }
            freed.await;
        }
    }

    pub(super) fn leave(&self, outcome: Outcome) {
        let mut s = self.lock();
        let flying = s.in_flight;
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.probed.elapsed() >= PROBE_EVERY {
            s.ceiling = (s.ceiling + 1.0).min(self.max);
            s.probed = Instant::now();
        }
        match outcome {
            Outcome::Success if s.slow_start => s.limit = (s.limit + 1.0).min(s.ceiling),
            Outcome::Success => s.limit = (s.limit + 1.0 / s.limit).min(s.ceiling),
            // The store is overwhelmed (or the path to it is): fewer at once.
            Outcome::Overload => {
                s.slow_start = false;
                s.ceiling = s.ceiling.min(f64::from(flying.saturating_sub(1).max(1)));
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
    }

    pub(super) fn limit(&self) -> u32 {
        self.lock().limit.floor() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }

    /// `n` requests through the gate at once: entered, then left one by
    /// one as `verdicts` say (the rest succeed).
    fn at_once(g: &Gate, rt: &tokio::runtime::Runtime, n: usize, outcomes: &[Outcome]) {
        for _ in 0..n {
            rt.block_on(g.enter());
        }
        for k in 0..n {
            g.leave(outcomes.get(k).copied().unwrap_or(Outcome::Success));
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
}
