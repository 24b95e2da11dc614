//! A consumer's clocks: what its stall and step times are measured from.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::proto;

#[derive(Debug, Default)]
pub(super) struct Clock {
    /// `CLOCK_MONOTONIC` ns when the program began asking for the next
    /// batch (its first `wait_readable` or `next_event` since the last
    /// one); 0 when it is not asking.
    pub(super) asking_since: AtomicU64,
    /// When the last batch arrived; 0 at the start and after an epoch end
    /// (time between epochs is neither a training step nor a stall).
    pub(super) last_batch_ns: u64,
    /// Since when `wait_readable` has found it pinning the ring.
    pub(super) pinned_since: Option<Instant>,
}

impl Clock {
    /// Notes when the program began asking for a batch (data-stall time
    /// runs from there to the batch's arrival).
    pub(super) fn start_asking(&self) {
        if self.asking_since.load(Ordering::Relaxed) != 0 {
            return; // still the same request (a polling loop)
        }
        let _ = self.asking_since.compare_exchange(
            0,
            proto::monotonic_ns(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }
}
