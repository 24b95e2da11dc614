//! One memory budget for everything the broker allocates on clients'
//! behalf: stream arenas (configured and registered), GPU arenas, consumer
//! mailboxes, and the connections' frame buffers. Each allocation takes a
//! [`Grant`] first, which gives its bytes back when dropped; one that does
//! not fit is refused with the numbers, before anything is allocated.
//!
//! As with connections (`server/admit.rs`), uids other than the broker's
//! may together hold three quarters of the budget, so a guest cannot leave
//! the broker's owner without room for its own streams. The quarters are
//! of what is left after the broker's own standing reservations (every
//! connection's frame buffers, taken at start): those would otherwise eat
//! the owner's quarter before any stream of its own asked.

use std::sync::{Arc, Mutex};

use batchcast::proto::MemoryStats;

/// What a grant pays for (a row of `stats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    Arena,
    GpuArena,
    Mailbox,
    FrameBuffers,
    /// A consumer's replay arena (batches recomputed for it alone).
    Replay,
    /// A source's decoded images kept for later epochs (shown in `stats`
    /// with the arenas).
    KeptImages,
}

impl Use {
    fn index(self) -> usize {
        self as usize
    }

    fn label(self) -> &'static str {
        match self {
            Use::Arena => "an arena",
            Use::GpuArena => "a GPU arena",
            Use::Mailbox => "a mailbox",
            Use::FrameBuffers => "frame buffers",
            Use::Replay => "a replay arena",
            Use::KeptImages => "a cache of decoded images",
        }
    }
}

#[derive(Debug)]
pub struct Budget {
    total: u64,
    own_uid: u32,
    held: Mutex<Held>,
    /// Pipeline threads the streams whose threads follow demand may work
    /// on together (`[broker] max_cpu_share` of the cores), and how many
    /// they hold ([`Threads`]).
    threads: Mutex<(u32, u32)>,
}

#[derive(Debug, Default)]
struct Held {
    used: u64,
    guests: u64,
    /// The broker's own standing reservations ([`Use::FrameBuffers`]).
    reserved: u64,
    by_use: [u64; 6],
    refused: u64,
}

/// Bytes taken from the budget; dropping it gives them back.
#[derive(Debug)]
pub struct Grant {
    budget: Arc<Budget>,
    uid: u32,
    what: Use,
    bytes: u64,
}

/// An allocation that does not fit.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error(
    "{label} of {need_mib} MiB for {whom} does not fit the broker's memory budget: {used_mib} of {total_mib} MiB in use{guests}; free some (end a stream, fewer slots or smaller batches) or raise [broker] memory_mib"
)]
pub struct OverBudget {
    pub label: &'static str,
    pub(crate) whom: String,
    pub(crate) need_mib: u64,
    pub(crate) used_mib: u64,
    pub(crate) total_mib: u64,
    guests: String,
}

fn mib(b: u64) -> u64 {
    b.div_ceil(1 << 20)
}

impl Budget {
    pub fn new(total: u64, own_uid: u32) -> Arc<Budget> {
        Arc::new(Budget {
            total,
            own_uid,
            held: Mutex::new(Held::default()),
            threads: Mutex::new((u32::MAX, 0)),
        })
    }

    /// Lets the streams whose threads follow demand work on `cap` pipeline
    /// threads together (no bound until set).
    pub fn set_thread_pool(&self, cap: u32) {
        self.threads.lock().unwrap_or_else(|p| p.into_inner()).0 = cap;
    }

    /// An empty hold on the pool of pipeline threads.
    pub fn threads(self: &Arc<Self>) -> Threads {
        Threads {
            budget: self.clone(),
            held: 0,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What other users may hold together: three quarters of the budget
    /// left after the broker's own reservations.
    fn guest_share(&self, held: &Held) -> u64 {
        let shared = self.total.saturating_sub(held.reserved);
        shared - shared / 4
    }

    /// Takes `bytes` for `what` on behalf of `uid`, or says why not.
    /// `whom` names the stream or consumer in the refusal.
    pub fn take(
        self: &Arc<Self>,
        uid: u32,
        what: Use,
        bytes: u64,
        whom: &str,
    ) -> Result<Grant, OverBudget> {
        let mut held = self.lock();
        let guest = uid != self.own_uid;
        let over_total = held.used.saturating_add(bytes) > self.total;
        let over_share = guest && held.guests.saturating_add(bytes) > self.guest_share(&held);
        if over_total || over_share {
            held.refused += 1;
            return Err(OverBudget {
                label: what.label(),
                whom: whom.to_string(),
                need_mib: mib(bytes),
                used_mib: mib(held.used),
                total_mib: mib(self.total),
                guests: if over_share && !over_total {
                    format!(
                        ", and other users than uid {} hold {} MiB of the {} MiB (three quarters of what the broker's own reservations leave) they may",
                        self.own_uid,
                        mib(held.guests),
                        mib(self.guest_share(&held))
                    )
                } else {
                    String::new()
                },
            });
        }
        held.used += bytes;
        if guest {
            held.guests += bytes;
        } else if what == Use::FrameBuffers {
            held.reserved += bytes;
        }
        held.by_use[what.index()] += bytes;
        Ok(Grant {
            budget: self.clone(),
            uid,
            what,
            bytes,
        })
    }

    /// The most [`Budget::take`] would give `uid` now for kept images
    /// the broker sizes itself: within what `uid` may take, and within a
    /// quarter of the budget for every stream's kept images together, so
    /// caches nobody asked for never take what arenas, mailboxes and
    /// replay arenas need.
    pub fn room_for_caches(&self, uid: u32) -> u64 {
        let held = self.lock();
        let mut room = self.total.saturating_sub(held.used);
        if uid != self.own_uid {
            room = room.min(self.guest_share(&held).saturating_sub(held.guests));
        }
        let kept = held.by_use[Use::KeptImages.index()];
        room.min((self.total / 4).saturating_sub(kept))
    }

    pub fn stats(&self) -> MemoryStats {
        let held = self.lock();
        MemoryStats {
            budget_bytes: self.total,
            used_bytes: held.used,
            arenas_bytes: held.by_use[Use::Arena.index()] + held.by_use[Use::KeptImages.index()],
            gpu_arenas_bytes: held.by_use[Use::GpuArena.index()],
            mailboxes_bytes: held.by_use[Use::Mailbox.index()],
            frame_buffers_bytes: held.by_use[Use::FrameBuffers.index()],
            replay_bytes: held.by_use[Use::Replay.index()],
            refused: held.refused,
        }
    }
}

/// Pipeline threads a stream holds of its budget's pool; given back when
/// dropped.
#[derive(Debug)]
pub struct Threads {
    budget: Arc<Budget>,
    held: u32,
}

impl Threads {
    /// Holds `n` threads, or as many more as the pool has left where `n`
    /// is more than it holds: what it holds then.
    pub fn resize(&mut self, n: u32) -> u32 {
        let mut pool = self
            .budget
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (cap, taken) = *pool;
        let others = taken - self.held;
        let n = n.min(cap.saturating_sub(others).max(self.held.min(n)));
        pool.1 = others + n;
        self.held = n;
        n
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        self.resize(0);
    }
}

impl Grant {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        let guest = self.uid != self.budget.own_uid;
        let mut held = self.budget.lock();
        held.used -= self.bytes;
        if guest {
            held.guests -= self.bytes;
        } else if self.what == Use::FrameBuffers {
            held.reserved -= self.bytes;
        }
        held.by_use[self.what.index()] -= self.bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// `memory_mib = 256` with 68 MiB of frame buffers reserved at start:
    /// guests fill their share, and the owner still has a quarter of the
    /// rest (before, the frame buffers had taken the owner's quarter and
    /// guests' arenas left it nothing).
    #[test]
    fn the_owners_quarter_is_of_what_the_brokers_reservations_leave() {
        let b = Budget::new(256 * MIB, 1000);
        let _buffers = b
            .take(1000, Use::FrameBuffers, 68 * MIB, "1000 connections")
            .unwrap();
        let mut guests = Vec::new();
        while let Ok(g) = b.take(2000, Use::Replay, 2_304 * 1024, "a guest's arena") {
            guests.push(g);
        }
        let held: u64 = guests.iter().map(Grant::bytes).sum();
        assert!(held <= (256 - 68) * MIB * 3 / 4, "{held}");
        assert!(held > (256 - 68) * MIB * 3 / 4 - 3 * MIB, "{held}");
        let owner = b.take(
            1000,
            Use::Replay,
            (256 - 68) * MIB / 4 - MIB,
            "the owner's joiner",
        );
        assert!(owner.is_ok(), "{owner:?}");
        let e = b
            .take(2000, Use::Replay, 2_304 * 1024, "one more")
            .unwrap_err()
            .to_string();
        assert!(e.contains("three quarters"), "{e}");
    }

    #[test]
    fn grants_add_up_give_back_on_drop_and_refusals_name_the_numbers() {
        let b = Budget::new(100 * MIB, 1000);
        let a = b.take(1000, Use::Arena, 60 * MIB, "stream `a`").unwrap();
        let m = b.take(1000, Use::Mailbox, MIB, "consumer 1").unwrap();
        let e = b
            .take(1000, Use::Arena, 40 * MIB, "stream `b`")
            .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("an arena of 40 MiB for stream `b`")
                && text.contains("61 of 100 MiB in use")
                && text.contains("memory_mib"),
            "{text}"
        );
        let s = b.stats();
        assert_eq!(
            (s.used_bytes, s.arenas_bytes, s.mailboxes_bytes, s.refused),
            (61 * MIB, 60 * MIB, MIB, 1)
        );
        drop(a);
        assert_eq!(b.stats().used_bytes, MIB);
        drop(m);
        assert_eq!(b.stats().used_bytes, 0);
    }

    #[test]
    fn other_users_together_get_three_quarters_and_the_owner_the_rest() {
        let b = Budget::new(100 * MIB, 1000);
        let g = b.take(1001, Use::Arena, 70 * MIB, "guest").unwrap();
        let e = b
            .take(1002, Use::Arena, 10 * MIB, "another guest")
            .unwrap_err();
        assert!(e.to_string().contains("three quarters"), "{e}");
        let o = b.take(1000, Use::Arena, 30 * MIB, "owner").unwrap();
        assert_eq!(b.stats().used_bytes, 100 * MIB);
        drop((g, o));
    }

    #[test]
    fn caches_the_broker_sizes_take_at_most_a_quarter_of_the_budget_together() {
        let b = Budget::new(400 * MIB, 1000);
        assert_eq!(b.room_for_caches(1000), 100 * MIB);
        let kept = b.take(1000, Use::KeptImages, 60 * MIB, "a").unwrap();
        assert_eq!(b.room_for_caches(1000), 40 * MIB, "every stream's together");
        let arena = b.take(1000, Use::Arena, 320 * MIB, "b").unwrap();
        assert_eq!(b.room_for_caches(1000), 20 * MIB, "within what is left");
        // Shown with the arenas.
        assert_eq!(b.stats().arenas_bytes, 380 * MIB);
        drop(kept);
        assert_eq!(b.room_for_caches(1000), 80 * MIB);
        drop(arena);
        // A guest's: within its users' three quarters too.
        let g = b.take(1001, Use::Arena, 280 * MIB, "guest").unwrap();
        assert_eq!(b.room_for_caches(1001), 20 * MIB);
        drop(g);
    }

    #[test]
    fn streams_share_the_pool_of_threads_and_give_it_back() {
        let b = Budget::new(MIB, 0);
        b.set_thread_pool(4);
        let (mut one, mut two) = (b.threads(), b.threads());
        assert_eq!(one.resize(3), 3);
        assert_eq!(two.resize(3), 1, "what the pool has left");
        assert_eq!(one.resize(1), 1);
        assert_eq!(two.resize(3), 3);
        drop(two);
        assert_eq!(one.resize(8), 4, "given back when dropped");
        // Unbounded until set.
        let b = Budget::new(MIB, 0);
        assert_eq!(b.threads().resize(64), 64);
    }
}
