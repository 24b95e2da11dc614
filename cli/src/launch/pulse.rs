//! What the live table and the report show of a trainer between its own
//! reports: its rate over a window long enough to span several of them,
//! whether it waits for data now (the wait its client reports only once
//! the batch comes: a stream someone holds, a pipeline too slow), whether
//! its process is stopped,
//! and the events worth a line: it joined, was cut to replay, was
//! detached.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The rate is taken over at least this long (when the run is that old):
/// clients report what they took every batch or every few seconds (a
/// Python trainer's `$BATCHCAST_REPORT` every 2 s), so a shorter window
/// reads 0 between two reports and double after.
pub(super) const RATE_WINDOW: Duration = Duration::from_secs(5);

/// A trainer's pulse, refreshed about once a second.
#[derive(Debug, Default)]
pub(super) struct Pulse {
    /// (when, samples taken) over the last [`RATE_WINDOW`] and one more.
    history: VecDeque<(Instant, u64)>,
    /// Since when it has waited for data: what it took has not moved,
    /// its process runs, and it was sent nothing it has not taken.
    waiting_since: Option<Instant>,
    /// Its process is stopped (SIGSTOP, a debugger).
    pub(super) stopped: bool,
    /// What the broker said about it last: its cuts, whether it was
    /// detached (and why), whether it had subscribed.
    cuts: u64,
    detached: Option<String>,
    joined: bool,
}

/// What the broker's latest stats say of a trainer, for [`Pulse::see`].
#[derive(Debug, Clone, Default)]
pub(super) struct Glimpse {
    pub samples: u64,
    pub epoch: u64,
    pub connected: bool,
    pub cuts: u64,
    /// Why its consumer left, if the broker detached it.
    pub detached: Option<String>,
    /// It was sent batches it has not taken (it is not starved).
    pub unread: bool,
}

impl Pulse {
    /// Takes in a refresh at `now` for the trainer of process `pid`
    /// named `name`; returns the events it makes.
    pub(super) fn see(&mut self, now: Instant, pid: u32, name: &str, g: &Glimpse) -> Vec<String> {
        let mut news = Vec::new();
        let moved = self.count(now, g.samples);
        self.stopped = process_stopped(pid);
        if moved || self.stopped || !g.connected || g.unread {
            self.waiting_since = None;
        } else if self.waiting_since.is_none() {
            self.waiting_since = Some(now);
        }
        if g.connected && !self.joined {
            self.joined = true;
            news.push(format!("{name} joined its stream (epoch {})", g.epoch));
        }
        if g.cuts > self.cuts {
            news.push(format!(
                "{name} was cut to replay: it kept the others waiting past the hold limit, or fell a ring behind; it reads on from replay"
            ));
        }
        self.cuts = self.cuts.max(g.cuts);
        if let Some(why) = &g.detached
            && self.detached.as_ref() != Some(why)
        {
            news.push(format!("{name} was detached: {why}"));
            self.detached = Some(why.clone());
        }
        news
    }

    /// Counts `samples` taken by `now` (for the rate); whether they moved.
    pub(super) fn count(&mut self, now: Instant, samples: u64) -> bool {
        let moved = self.history.back().is_none_or(|&(_, s)| samples > s);
        self.history.push_back((now, samples));
        while self
            .history
            .get(1)
            .is_some_and(|&(t, _)| now.duration_since(t) >= RATE_WINDOW)
        {
            self.history.pop_front();
        }
        moved
    }

    /// Samples a second over the window.
    pub(super) fn rate(&self) -> f64 {
        match (self.history.front(), self.history.back()) {
            (Some(&(t0, s0)), Some(&(t1, s1))) if t1 > t0 => {
                s1.saturating_sub(s0) as f64 / t1.duration_since(t0).as_secs_f64()
            }
            _ => 0.0,
        }
    }

    /// Seconds it has waited for data so far in this spell (its client
    /// reports them only once the next batch comes).
    pub(super) fn waiting_s(&self, now: Instant) -> f64 {
        self.waiting_since
            .map_or(0.0, |t| now.duration_since(t).as_secs_f64())
    }

    pub(super) fn detached(&self) -> Option<&str> {
        self.detached.as_deref()
    }
}

/// Whether process `pid` is stopped (its state in /proc is `T` or `t`).
pub(super) fn process_stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command's closing parenthesis.
    stat.rsplit_once(") ")
        .and_then(|(_, s)| s.chars().next())
        .is_some_and(|c| c == 'T' || c == 't')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn glimpse(samples: u64, unread: bool) -> Glimpse {
        Glimpse {
            samples,
            connected: true,
            unread,
            ..Glimpse::default()
        }
    }

    /// A client that reports every 2 s, seen every second: the rate over
    /// the window is steady (the last second's alone read 0, 100, 0, 100).
    #[test]
    fn the_rate_spans_several_reports() {
        let mut p = Pulse::default();
        let t0 = Instant::now();
        let me = std::process::id();
        let mut rates = Vec::new();
        for k in 0..12u64 {
            let now = t0 + Duration::from_secs(k);
            p.see(now, me, "t", &glimpse(k / 2 * 100, false));
            rates.push(p.rate());
        }
        for r in &rates[6..] {
            assert!((40.0..=60.0).contains(r), "{rates:?}");
        }
    }

    /// A trainer whose count stops with nothing unread waits for data,
    /// from the first refresh it did not move; one with batches sent and
    /// not taken is busy in its own step, not waiting.
    #[test]
    fn a_trainer_with_nothing_to_read_is_waiting() {
        let mut p = Pulse::default();
        let t0 = Instant::now();
        let me = std::process::id();
        let at = |s: u64| t0 + Duration::from_secs(s);
        p.see(at(0), me, "t", &glimpse(100, false));
        p.see(at(1), me, "t", &glimpse(200, false));
        assert_eq!(p.waiting_s(at(1)), 0.0);
        p.see(at(2), me, "t", &glimpse(200, false));
        p.see(at(3), me, "t", &glimpse(200, false));
        assert!((p.waiting_s(at(5)) - 3.0).abs() < 1e-9);
        // Sent a batch it has not taken: its own step, not a wait.
        p.see(at(6), me, "t", &glimpse(200, true));
        assert_eq!(p.waiting_s(at(6)), 0.0);
    }

    #[test]
    fn joins_cuts_and_detaches_are_events_once() {
        let mut p = Pulse::default();
        let t0 = Instant::now();
        let me = std::process::id();
        let mut g = glimpse(0, false);
        assert!(p.see(t0, me, "t-1", &g)[0].contains("t-1 joined"));
        g.cuts = 1;
        let news = p.see(t0, me, "t-1", &g);
        assert!(
            news.len() == 1 && news[0].contains("cut to replay"),
            "{news:?}"
        );
        assert!(p.see(t0, me, "t-1", &g).is_empty());
        g.detached = Some("detached: hold limit".into());
        let news = p.see(t0, me, "t-1", &g);
        assert!(news.len() == 1 && news[0].contains("t-1 was detached: detached: hold limit"));
        assert!(p.see(t0, me, "t-1", &g).is_empty());
    }
}
