//! The consumer's side of its mailbox: taking notices, writing releases,
//! sleeping on the bell.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use batchcast_core::mailbox::NoticeWords;

use crate::error::{Error, Result};
use crate::proto::MailboxSpec;
use crate::shm::Mapping;

use super::*;

/// The consumer's side of a mailbox.
#[derive(Debug)]
pub struct ConsumerMailbox<M: Memory = Shm> {
    pub(super) words: Words<M>,
    /// Serialises release writers (batches are released from any thread).
    releasing: std::sync::Mutex<()>,
}

impl ConsumerMailbox {
    /// Maps a mailbox fd the broker sent with its welcome.
    pub fn open(fd: impl AsFd, spec: MailboxSpec) -> Result<ConsumerMailbox> {
        spec.validate()?;
        let map = Mapping::map_readwrite(fd.as_fd(), spec.bytes())?;
        Ok(ConsumerMailbox::in_memory(Words {
            mem: Shm::Mapped(map),
            spec,
        }))
    }
}

impl<M: Memory> ConsumerMailbox<M> {
    pub(super) fn in_memory(words: Words<M>) -> ConsumerMailbox<M> {
        ConsumerMailbox {
            words,
            releasing: std::sync::Mutex::new(()),
        }
    }

    /// Whether a notice is waiting.
    pub fn has_notice(&self) -> bool {
        let w = &self.words;
        let tail = w.header().tail.load(Ordering::Relaxed);
        w.notice(tail)[0].load(Ordering::Acquire) == tail + 1
    }

    /// Whether the batch noticed at `n`, just taken, was taken back by the
    /// broker (read after storing `tail` past it).
    fn taken_back(&self, n: u64) -> Result<bool> {
        let cut = &self.words.header().broker.cut;
        let mut word = self.words.mem.sc_load(cut);
        let start = Instant::now();
        while word == CUT_UNDER_WAY {
            if start.elapsed() > CUT_WAIT {
                return Err(Error::Unexpected(
                    "mailbox: the broker began taking notices back and never finished".into(),
                ));
            }
            self.words.mem.spin();
            word = cut.load(Ordering::Acquire);
        }
        let from = word & ((1 << CUT_FROM_BITS) - 1);
        if from < 2 {
            return Ok(false); // never cut
        }
        let from = from - 2;
        Ok(n >= from && n - from < word >> CUT_FROM_BITS)
    }

    /// Takes the next notice, if any, passing over batches the broker took
    /// back. Call from one thread at a time.
    pub fn pop(&self) -> Result<Option<Notice>> {
        Ok(self.pop_marked()?.map(|(n, _)| n))
    }

    /// [`pop`](Self::pop), also saying whether a notice other than a batch
    /// lies among the notices the last cut took back (an end of epoch
    /// written after batches taken back: it counts only if its epoch ends
    /// before where the cut's replay begins).
    pub fn pop_marked(&self) -> Result<Option<(Notice, bool)>> {
        let w = &self.words;
        let tail = &w.header().tail;
        let (v, in_cut) = loop {
            let n = tail.load(Ordering::Relaxed);
            let record = w.notice(n);
            if record[0].load(Ordering::Acquire) != n + 1 {
                return Ok(None);
            }
            let v: NoticeWords = std::array::from_fn(|i| record[i + 1].load(Ordering::Relaxed));
            // The entry may be rewritten once `tail` moves on (a release
            // store); a Dekker handshake with the broker's cut (see the
            // module's notes).
            w.mem.sc_store(tail, n + 1);
            let in_cut = self.taken_back(n)?;
            if !Notice::is_batch(&v) || !in_cut {
                break (v, in_cut);
            }
        };
        Ok(Some((Notice::from_words(v)?, in_cut)))
    }

    /// Sleeps until the broker rings or `timeout` passes, unless a notice
    /// is there or `ready` says there is something else to do (it runs
    /// after this consumer has said it sleeps, so nothing that rings is
    /// missed). The broker wakes a sleeper with a system call: poll first
    /// when a notice is due soon.
    pub fn sleep_unless(&self, timeout: Duration, ready: impl FnOnce() -> bool) {
        let w = &self.words;
        let seen = w.bell().load(Ordering::Acquire);
        let sleeping = &*w.header().sleeping;
        sleeping.store(1, Ordering::Relaxed);
        w.mem.fence(Ordering::SeqCst);
        if !self.has_notice() && !ready() {
            w.mem.wait(w.bell(), seen, timeout);
        }
        sleeping.store(0, Ordering::Relaxed);
    }

    /// Writes the release of `unit`, adding its timings to the
    /// running totals. `false` when the ring is full (the caller sends it
    /// on the socket instead); then [`wants_doorbell`] says whether the
    /// broker waits for it.
    ///
    /// [`wants_doorbell`]: Self::wants_doorbell
    pub fn push_release(&self, unit: Unit, t: Totals) -> bool {
        let _guard = self.releasing.lock().unwrap_or_else(|p| p.into_inner());
        let w = &self.words;
        let h = w.header();
        let n = h.consumer.released.load(Ordering::Relaxed);
        let drained = h.broker.drained.load(Ordering::Acquire);
        if n.wrapping_sub(drained) >= w.spec.releases as u64 {
            return false;
        }
        for (word, v) in w.release(n).iter().zip(record_of(unit)) {
            word.store(v, Ordering::Relaxed);
        }
        let c = &h.consumer;
        for (total, add) in [
            (&c.wait_total, t.wait_ns),
            (&c.busy_total, t.busy_ns),
            (&c.hold_total, t.hold_ns),
        ] {
            total.store(
                total.load(Ordering::Relaxed).wrapping_add(add),
                Ordering::Relaxed,
            );
        }
        c.released.store(n + 1, Ordering::Release);
        true
    }

    /// Notes what the program has taken so far (for the broker's
    /// `stats`; only this side writes these words).
    pub fn note_taken(&self, t: crate::proto::Taken) {
        let c = &self.words.header().consumer;
        c.taken_batches.store(t.batches, Ordering::Relaxed);
        c.taken_samples.store(t.samples, Ordering::Relaxed);
        c.taken_epoch.store(t.epoch, Ordering::Relaxed);
    }

    /// Whether the broker asked to be told of releases (it waits on one).
    pub fn wants_doorbell(&self) -> bool {
        self.words.mem.fence(Ordering::SeqCst);
        self.words.header().broker.want.load(Ordering::Relaxed) != 0
    }
}
