//! Where an image stream's pipeline threads spend their time, image by
//! image: reading (a file, the cache of encoded bytes, a remote store's
//! answer), decoding, and transforming into the slot (crop, resize,
//! augmentations, the tensor write). Wall time summed over the threads, so
//! a read waiting for a remote store counts as reading. Always on: two
//! clock reads (about 20 ns each, from the vDSO) per stage, against
//! hundreds of microseconds an image.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A stage of an image's way into its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Read = 0,
    Decode = 1,
    Transform = 2,
}

/// Nanoseconds spent in each [`Stage`], all threads together.
#[derive(Debug, Default)]
pub struct StageClock {
    ns: [AtomicU64; 3],
}

impl StageClock {
    /// Runs `f`, counting its time as `stage`'s.
    pub fn time<T>(&self, stage: Stage, f: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let r = f();
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.ns[stage as usize].fetch_add(ns, Ordering::Relaxed);
        r
    }

    /// Seconds spent so far: read, decode, transform.
    pub fn seconds(&self) -> [f64; 3] {
        self.ns
            .each_ref()
            .map(|n| n.load(Ordering::Relaxed) as f64 / 1e9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stage_counts_only_its_own_time() {
        let c = StageClock::default();
        let nap = std::time::Duration::from_millis(20);
        assert_eq!(c.time(Stage::Decode, || 7), 7);
        c.time(Stage::Read, || std::thread::sleep(nap));
        let [read, decode, transform] = c.seconds();
        assert!(read >= nap.as_secs_f64(), "{read}");
        assert!(decode < read && transform == 0.0, "{decode} {transform}");
    }
}
