//! A producer riding through a broker restart.
//!
//! The broker that went away took its arena's batches with it, and a
//! producer's stream cannot be recomputed. But every batch a consumer had
//! not released yet is among the last `slots` the producer published (it
//! is handed a slot only once every consumer released what was there), and
//! the producer still maps the old arena. So it keeps a note of the last
//! `slots` batches it published ([`Kept`]), and when the broker goes away:
//!
//! * it says once on stderr that it waits, and `acquire` answers
//!   `Pending` while it does (a `publish` meanwhile only notes the batch);
//! * it registers the stream again within `reconnect_timeout`, with a
//!   [`Rejoin`] naming the oldest batch it kept and how many consumers the
//!   stream had: the new broker starts the stream there and holds it until
//!   they are back (or `rejoin_grace` passes), so each resumes at its own
//!   position and skips what it had read;
//! * the new broker hands out the kept batches first: the producer copies
//!   each from the old arena and publishes it itself, then hands the
//!   program the slot for the batch it was going to write next.
//!
//! The program sees one long `acquire`. Every consumer back within the
//! grace gets every batch once, in order, with the producer's bytes.

use std::time::{Duration, Instant};

use super::{Kept, OldArena, Producer};
use crate::error::{Error, Result};
use crate::proto::{FillSlot, Rejoin};

/// How soon a registration the restarting broker could not take yet is
/// tried again.
const RETRY: Duration = Duration::from_millis(20);

impl Producer {
    /// Whether this error lets the producer wait for its broker.
    pub(super) fn may_ride(&self, e: &Error) -> bool {
        e.broker_went_away() && !self.ended && !self.opts.reconnect_timeout.is_zero()
    }

    /// Notes a batch just published into this arena (the last `slots`).
    pub(super) fn keep(&mut self, slot: &FillSlot, samples: u64) {
        let per_epoch = self.registered.schema.batches_per_epoch;
        if self
            .kept
            .back()
            .is_some_and(|k| successor((k.epoch, k.index), per_epoch) != (slot.epoch, slot.index))
        {
            // The broker skipped the rest of an epoch nobody read: what
            // came before is not the stream's next to anyone.
            self.kept.clear();
        }
        self.kept.push_back(Kept {
            epoch: slot.epoch,
            index: slot.index,
            seq: slot.seq,
            samples,
        });
        while self.kept.len() > self.registered.slots as usize {
            self.kept.pop_front();
        }
    }

    /// The broker went away: begins the wait for it, saying so once.
    pub(super) fn went_away(&mut self, cause: &Error) {
        if self.down.is_some() {
            return;
        }
        let (epoch, index) = self.resume_point();
        eprintln!(
            "batchcast: {cause}; producer `{}` of stream `{}` waits up to {:.0} s for it to come back, to register the stream again from batch {index} of epoch {epoch}",
            self.opts.name,
            self.opts.request.stream,
            self.opts.reconnect_timeout.as_secs_f64(),
        );
        self.requested = false;
        self.down = Some(Instant::now());
    }

    /// The oldest batch it still holds, where the stream goes on: the
    /// oldest of an arena before this one that is still to be published
    /// again, else of this arena, else batch 0.
    fn resume_point(&self) -> (u64, u64) {
        self.old
            .iter()
            .find_map(|a| a.kept.front())
            .or(self.kept.front())
            .map_or((0, 0), |k| (k.epoch, k.index))
    }

    /// Waits for the broker (until `until`, and at most until
    /// `reconnect_timeout` after it went) and registers the stream again
    /// from its oldest kept batch. `false`: not back by `until` (call
    /// again). Errors once the timeout passes or the new broker refuses
    /// the registration.
    pub(super) fn reconnect(&mut self, until: Instant) -> Result<bool> {
        let Some(since) = self.down else {
            return Ok(true);
        };
        let deadline = since + self.opts.reconnect_timeout;
        let (epoch, index) = self.resume_point();
        let mut opts = self.opts.clone();
        opts.request.rejoin = Some(Rejoin {
            epoch,
            index,
            readers: self.readers,
            grace_ms: u32::try_from(opts.rejoin_grace.as_millis()).unwrap_or(u32::MAX),
        });
        let fresh = loop {
            opts.connect_timeout = until
                .min(deadline)
                .saturating_duration_since(Instant::now());
            match Producer::register(opts.clone()) {
                Ok(p) => break p,
                // The old broker still closing (its name for the stream
                // not given back yet), or the new one starting.
                Err(e)
                    if (e.while_restarting()
                        || e.code() == Some(crate::proto::ErrorCode::StreamExists))
                        && Instant::now() < deadline =>
                {
                    if Instant::now() >= until {
                        return Ok(false);
                    }
                    std::thread::sleep(RETRY);
                }
                Err(e) => {
                    eprintln!(
                        "batchcast: producer `{}` gave up waiting for the broker: {e}",
                        self.opts.name
                    );
                    self.down = None;
                    self.opts.reconnect_timeout = Duration::ZERO;
                    return Err(e);
                }
            }
        };
        let mut old = std::mem::take(&mut self.old);
        let kept = std::mem::take(&mut self.kept);
        let (readers, reconnects) = (self.readers, self.reconnects + 1);
        // The old connection says goodbye into its closed socket.
        let prev = std::mem::replace(self, fresh);
        old.push(OldArena {
            map: prev.map,
            rings: prev.registered.rings,
            kept,
        });
        old.retain(|a| !a.kept.is_empty());
        let again: usize = old.iter().map(|a| a.kept.len()).sum();
        eprintln!(
            "batchcast: producer `{}` is back after {:.2} s; it publishes its last {again} batches again",
            self.opts.name,
            since.elapsed().as_secs_f64()
        );
        self.old = old;
        self.readers = readers;
        self.reconnects = reconnects;
        Ok(true)
    }

    /// If `slot` is for a batch of an old arena still to be published
    /// again, copies it from there and publishes it: `true`. `false`: the
    /// slot is the program's to fill.
    pub(super) fn publish_again(&mut self, slot: &FillSlot) -> Result<bool> {
        let mut old = std::mem::take(&mut self.old);
        let Some(arena) = old.first_mut() else {
            return Ok(false);
        };
        let Some(k) = arena
            .kept
            .front()
            .copied()
            .filter(|k| (k.epoch, k.index) == (slot.epoch, slot.index))
        else {
            // The new broker went elsewhere: what was kept is no one's next.
            tracing::warn!(
                epoch = slot.epoch,
                index = slot.index,
                "registered again, the broker asks for another batch than the producer kept"
            );
            return Ok(false);
        };
        arena.kept.pop_front();
        let from = arena.rings.unit_spans(k.seq);
        {
            let views = self.fields_mut(slot);
            for (view, (offset, len)) in views.into_iter().zip(from) {
                let bytes = arena
                    .map
                    .get(offset, len)
                    .filter(|b| b.len() == view.len())
                    .ok_or_else(|| {
                        Error::Unexpected(format!(
                            "the new broker's arena does not match the old one's (batch {} of epoch {})",
                            k.index, k.epoch
                        ))
                    })?;
                view.copy_from_slice(bytes);
            }
        }
        old.retain(|a| !a.kept.is_empty());
        self.old = old;
        self.publish(slot, k.samples)?;
        Ok(true)
    }
}

/// The batch after batch `index` of `epoch`.
fn successor((epoch, index): (u64, u64), per_epoch: u64) -> (u64, u64) {
    if index + 1 >= per_epoch {
        (epoch + 1, 0)
    } else {
        (epoch, index + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::successor;

    #[test]
    fn the_batch_after_an_epochs_last_is_the_next_epochs_first() {
        assert_eq!(successor((0, 0), 3), (0, 1));
        assert_eq!(successor((0, 2), 3), (1, 0));
        assert_eq!(successor((4, 0), 1), (5, 0));
    }
}
