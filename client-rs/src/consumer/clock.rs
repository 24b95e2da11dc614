//! A consumer's clocks: what its stall and step times are measured from.

use std::sync::atomic::AtomicU64;
use std::time::Instant;

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
