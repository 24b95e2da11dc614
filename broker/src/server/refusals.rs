//! Refused connections, logged at a bounded rate: any peer may send a bad
//! preamble or an unknown stream's name as often as it connects, and each
//! refusal must not cost a log line (a flood of them would fill the disk
//! and drown every other message). All are counted; `stats` shows them.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Refusals logged in full per [`WINDOW`]; the rest are summed into one
/// line when the window ends.
pub(super) const LOGGED_PER_WINDOW: u32 = 10;
pub(super) const WINDOW: Duration = Duration::from_secs(10);

#[derive(Debug, Default)]
pub(super) struct Refusals {
    /// Connections refused at the handshake (a bad or mismatched
    /// preamble, no hello), since start.
    handshakes: AtomicU64,
    /// Every refusal after admission (the handshake's included), since start.
    total: AtomicU64,
    window: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    start: Option<Instant>,
    logged: u32,
    suppressed: u64,
}

/// What to do with one refusal's log line.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Log it, after a line saying how many were left out before it.
    Log { left_out: u64 },
    /// Over the window's share: counted, not logged.
    Quiet,
}

impl Refusals {
    /// Counts a refusal and says whether to log it.
    pub(super) fn note(&self, handshake: bool, now: Instant) -> Verdict {
        self.total.fetch_add(1, Ordering::Relaxed);
        if handshake {
            self.handshakes.fetch_add(1, Ordering::Relaxed);
        }
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        let mut left_out = 0;
        if w.start.is_none_or(|s| now.duration_since(s) >= WINDOW) {
            left_out = std::mem::take(&mut w.suppressed);
            w.start = Some(now);
            w.logged = 0;
        }
        if w.logged < LOGGED_PER_WINDOW {
            w.logged += 1;
            Verdict::Log { left_out }
        } else {
            w.suppressed += 1;
            Verdict::Quiet
        }
    }

    /// (refused at the handshake, refused in all) since start.
    pub(super) fn counts(&self) -> (u64, u64) {
        (
            self.handshakes.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_logs_a_few_lines_a_window_and_counts_everything() {
        let r = Refusals::default();
        let t0 = Instant::now();
        let logged = (0..1000)
            .filter(|_| r.note(true, t0) != Verdict::Quiet)
            .count();
        assert_eq!(logged, LOGGED_PER_WINDOW as usize);
        assert_eq!(r.counts(), (1000, 1000));
        // The next window's first line says how many were left out.
        assert_eq!(
            r.note(false, t0 + WINDOW),
            Verdict::Log {
                left_out: 1000 - u64::from(LOGGED_PER_WINDOW)
            }
        );
        assert_eq!(r.note(false, t0 + WINDOW), Verdict::Log { left_out: 0 });
        assert_eq!(r.counts(), (1000, 1002));
    }
}
