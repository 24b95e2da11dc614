//! The external producer's port ([`Port`], from [`Stream::port`]): a
//! producer process (a Python `DataLoader`, a custom Rust loader) fills
//! the stream's slots instead of pipeline threads. The server's task for
//! the producer's connection asks for one slot at a time
//! ([`Port::acquire`]), waits on [`Port::ready`] when none is free,
//! publishes what was filled, and ends the stream when the producer
//! leaves.
//!
//! The arena is created unsealed for such a stream: the producer maps it
//! writable once, and the server seals it ([`Port::seal`]) on the
//! producer's first request, before any consumer can see the stream.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use batchcast::FillSlot;
use batchcast::proto::Rejoin;

use super::deliver::settle;
use super::error::StreamFailed;
use super::{Stream, decouple};

/// What an external producer's slot request finds.
#[derive(Debug)]
pub enum Acquire {
    Slot(FillSlot),
    /// Every epoch has been handed out.
    Ended,
    /// Nothing now (no free slot, or too few consumers): wait for
    /// [`Port::ready`].
    Wait,
}

/// A stream as its external producer sees it ([`Stream::port`]).
#[derive(Debug, Clone, Copy)]
pub struct Port<'a> {
    s: &'a Stream,
}

impl Stream {
    /// The producer's side of this stream.
    pub fn port(&self) -> Port<'_> {
        Port { s: self }
    }
}

impl Port<'_> {
    /// Forbids any new writable mapping of the arena (see [`Stream::start`]).
    pub(crate) fn seal(&self) -> Result<(), batchcast::Error> {
        self.s.arena.seal_writes()
    }

    /// How often a waiting producer's request is looked at again, so that
    /// a consumer keeping it waiting past the hold limit is detached.
    pub(crate) const HOLD_CHECK: Duration = Duration::from_millis(200);

    /// Resolves when an external producer's request may succeed now.
    pub async fn ready(&self) {
        self.s.ready.notified().await
    }

    /// An external producer asks for its next slot.
    pub fn acquire(&self) -> Result<Acquire, StreamFailed> {
        let s = self.s;
        s.with_hub(|inner| {
            if let Some(why) = &inner.records.failed {
                return Err(why.clone());
            }
            inner.fill.set_producer_waiting(false);
            // Stopping: the consumers told goodbye leave, and what they
            // held frees slots. A slot handed out now would be a batch
            // none of them reads, and would push the producer's kept
            // batches (where it registers again) past their positions.
            if s.stop.load(Ordering::SeqCst) {
                return Ok(Acquire::Wait);
            }
            if inner.hub.view().exhausted() {
                return Ok(Acquire::Ended);
            }
            // A consumer that kept the producer waiting past the hold
            // limit is detached (nothing here can be recomputed for it).
            let now = Instant::now();
            if inner.hub.view().ring().free_slots() == 0 && decouple::cut_laggards(s, inner, now) {
                settle(inner, true);
            }
            Ok(match inner.hub.start_batch() {
                Some(w) => Acquire::Slot({
                    inner.pace.begun(w.seq, s.plan.slots, now);
                    FillSlot {
                        seq: w.seq,
                        epoch: w.epoch,
                        index: w.index,
                        slot: w.slot,
                        readers: inner.hub.view().members(),
                    }
                }),
                None => {
                    // Mailbox consumers may have released already, and ring
                    // only for releases after this: take what is there.
                    inner.fill.set_producer_waiting(true);
                    inner.deliver.drain_all();
                    Acquire::Wait
                }
            })
        })
    }

    /// A producer registering its stream again (its broker went away):
    /// the stream starts at the batch it names and waits for `readers`
    /// consumers (or the stream's own minimum, if more) until
    /// [`Port::end_rejoin_hold`]. `false` if it could not be moved there
    /// (it has started already).
    pub(crate) fn rejoin_at(&self, rejoin: &Rejoin) -> bool {
        self.s.with_hub(|inner| {
            let moved = inner.hub.seek(rejoin.epoch, rejoin.index);
            if moved {
                inner
                    .hub
                    .set_min_consumers(rejoin.readers.max(self.s.plan.min_consumers));
            }
            moved
        })
    }

    /// The consumers a registering-again producer waited for had their
    /// grace: the stream goes on with its own minimum of consumers.
    pub(crate) fn end_rejoin_hold(&self) {
        // Wakes a waiting producer if the stream may start now.
        let min = self.s.plan.min_consumers;
        self.s.with_hub(|inner| inner.hub.set_min_consumers(min));
    }

    /// Whether no slot is free (the producer is under back-pressure).
    pub(crate) fn slots_full(&self) -> bool {
        self.s.lock().hub.view().ring().free_slots() == 0
    }

    /// An external producer filled `slot` with `samples` samples, after
    /// waiting `blocked` for it.
    pub fn publish(&self, slot: &FillSlot, samples: u64, blocked: Duration) {
        self.s.with_hub(|inner| {
            inner.fill.add_blocked(blocked);
            inner.hub.finish_batch(slot.seq, samples);
            inner.pace.made(slot.seq, Instant::now());
        });
    }

    /// An external producer said goodbye with nothing left unpublished.
    /// An endless stream ends normally at an epoch boundary; anything else
    /// ends early, and consumers are told.
    pub(crate) fn producer_done(&self, who: &str) {
        let s = self.s;
        let early = s.with_hub(|inner| {
            if inner.hub.view().exhausted() || inner.records.failed.is_some() {
                return None;
            }
            if s.plan.epochs.is_none() && inner.hub.end_at_epoch_boundary() {
                return None;
            }
            let c = inner.hub.view().counts();
            Some(StreamFailed::ProducerStopped {
                who: who.into(),
                produced: c.produced,
                epoch: c.epoch,
                epochs: s.plan.epochs,
            })
        });
        if let Some(why) = early {
            s.fail(why);
        }
    }
}
