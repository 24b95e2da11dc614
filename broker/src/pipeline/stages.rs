//! Where an image stream's pipeline threads spend their time, image by
//! image: reading (a file, the cache of encoded bytes, a remote store's
//! answer), decoding, and transforming into the slot (crop, resize,
//! augmentations, the tensor write). Wall time summed over the threads, so
//! a read waiting for a remote store counts as reading. Always on: two
//! clock reads (about 20 ns each, from the vDSO) per stage, against
//! hundreds of microseconds an image. The read stage also counts the
//! thread's CPU time (two more clock reads, system calls of about half a
//! microsecond here), so that its wall time splits into work and waiting
//! for bytes: what `batchcast doctor`'s predictions need.

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
    /// CPU nanoseconds of the read stage.
    read_cpu_ns: AtomicU64,
}

impl StageClock {
    /// Runs `f`, counting its time as `stage`'s.
    pub fn time<T>(&self, stage: Stage, f: impl FnOnce() -> T) -> T {
        let cpu0 = (stage == Stage::Read).then(thread_cpu_ns);
        let t0 = Instant::now();
        let r = f();
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.ns[stage as usize].fetch_add(ns, Ordering::Relaxed);
        if let Some(cpu0) = cpu0 {
            let cpu = thread_cpu_ns().saturating_sub(cpu0);
            self.read_cpu_ns.fetch_add(cpu, Ordering::Relaxed);
        }
        r
    }

    /// CPU seconds the read stage took so far (of its wall time in
    /// [`StageClock::seconds`]; the rest waited for bytes or a core).
    pub fn read_cpu_seconds(&self) -> f64 {
        self.read_cpu_ns.load(Ordering::Relaxed) as f64 / 1e9
    }

    /// Seconds spent so far: read, decode, transform.
    pub fn seconds(&self) -> [f64; 3] {
        self.ns
            .each_ref()
            .map(|n| n.load(Ordering::Relaxed) as f64 / 1e9)
    }
}

/// CPU nanoseconds of the calling thread (0 where the clock is missing).
fn thread_cpu_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(|t| u64::try_from(std::time::Duration::from(t).as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
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
        // The read slept: its wall time is nearly all waiting, not CPU.
        let cpu = c.read_cpu_seconds();
        assert!(
            cpu < 0.5 * nap.as_secs_f64(),
            "read CPU {cpu} s of {read} s"
        );
        c.time(Stage::Read, || {
            let t = Instant::now();
            while t.elapsed() < nap {
                std::hint::black_box(0);
            }
        });
        let spun = c.read_cpu_seconds() - cpu;
        assert!(
            spun > 0.3 * nap.as_secs_f64(),
            "a spinning read's CPU: {spun} s"
        );
    }
}
