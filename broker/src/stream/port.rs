//! The external producer's port: a producer process (a Python
//! `DataLoader`, a custom Rust loader) fills the stream's slots instead of
//! pipeline threads. The server's task for the producer's connection asks
//! for one slot at a time ([`Stream::acquire`]), waits on
//! [`Stream::ready`] when none is free, publishes what was filled, and
//! ends the stream when the producer leaves.
//!
//! The arena is created unsealed for such a stream: the producer maps it
//! writable once, and the server seals it ([`Stream::seal`]) on the
//! producer's first request, before any consumer can see the stream.

use std::time::Duration;

use batchcast::FillSlot;

use super::Stream;
use super::error::StreamFailed;

/// What an external producer's slot request finds.
#[derive(Debug)]
pub enum Acquire {
    Slot(FillSlot),
    /// Every epoch has been handed out.
    Ended,
    /// Nothing now (no free slot, or too few consumers): wait for
    /// [`Stream::ready`].
    Wait,
}

impl Stream {
    /// Forbids any new writable mapping of the arena (see [`Stream::start`]).
    pub fn seal(&self) -> Result<(), batchcast::Error> {
        self.arena.seal_writes()
    }

    /// Resolves when an external producer's request may succeed now.
    pub async fn ready(&self) {
        self.ready.notified().await
    }

    /// An external producer asks for its next slot.
    pub fn acquire(&self) -> Result<Acquire, StreamFailed> {
        self.with_hub(|inner| {
            if let Some(why) = &inner.failed {
                return Err(why.clone());
            }
            inner.producer_waiting = false;
            if inner.hub.exhausted() {
                return Ok(Acquire::Ended);
            }
            Ok(match inner.hub.start_batch() {
                Some(w) => Acquire::Slot(FillSlot {
                    seq: w.seq,
                    epoch: w.epoch,
                    index: w.index,
                    slot: w.slot,
                }),
                None => {
                    // Mailbox consumers may have released already, and ring
                    // only for releases after this: take what is there.
                    inner.producer_waiting = true;
                    inner.drain_all = true;
                    Acquire::Wait
                }
            })
        })
    }

    /// Whether no slot is free (the producer is under back-pressure).
    pub fn slots_full(&self) -> bool {
        !self.lock().hub.has_free_slot()
    }

    /// An external producer filled `slot` with `samples` samples, after
    /// waiting `blocked` for it.
    pub fn publish(&self, slot: &FillSlot, samples: u64, blocked: Duration) {
        self.with_hub(|inner| {
            inner.producer_blocked += blocked;
            inner.hub.finish_batch(slot.seq, samples);
        });
    }

    /// An external producer said goodbye with nothing left unpublished.
    /// An endless stream ends normally at an epoch boundary; anything else
    /// ends early, and consumers are told.
    pub fn producer_done(&self, who: &str) {
        let early = self.with_hub(|inner| {
            if inner.hub.exhausted() || inner.failed.is_some() {
                return None;
            }
            if self.plan.epochs.is_none() && inner.hub.end_at_epoch_boundary() {
                return None;
            }
            let c = inner.hub.counts();
            Some(StreamFailed::ProducerStopped {
                who: who.into(),
                produced: c.produced,
                epoch: c.epoch,
                epochs: self.plan.epochs,
            })
        });
        if let Some(why) = early {
            self.fail(why);
        }
    }
}
