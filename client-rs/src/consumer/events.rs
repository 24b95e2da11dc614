//! A consumer's events ([`Inbox`]): messages taken in (from the socket,
//! the mailbox, replay), batches cut in its own size and handed out in
//! order, units it will not read given back.

use std::sync::atomic::Ordering;

use crate::batch::Batch;
use crate::batcher::{Batcher, Unit};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::mailbox::{Notice, Totals};
use crate::proto::{self, EpochEnd, Position, ServerMsg};
use crate::transport::{broker_error, goodbye_error};

use super::clock::Clock;
use super::link::Link;
use super::*;

/// What a consumer received and has not handed out, in order, and where
/// handing it out has got to.
#[derive(Debug)]
pub(super) struct Inbox {
    /// Batches cut from the units received, and what follows them. Units
    /// are taken only while no batch waits here, so the consumer holds at
    /// most the units its window needs (a mailbox consumer is sent units
    /// ahead; they wait in its mailbox).
    pub(super) next: VecDeque<Next>,
    /// Where it is: its position, its epoch's batches, rotated epochs.
    pub(super) place: place::Place,
    /// Replay: in progress, where it began, the next replayed seq.
    pub(super) replay: replay::Replay,
    /// A group member's share of each epoch.
    pub(super) deal: Option<crate::deal::Deal>,
}

impl Inbox {
    /// Whether `next_event` returns at once.
    pub(super) fn ready(&self, shared: &Shared) -> bool {
        match self.front() {
            Some(Next::Run(..) | Next::Replayed(_)) => !shared.window_full(),
            Some(_) => true,
            None => false,
        }
    }

    /// The unit this host consumer holds that keeps the broker from making
    /// the next one ([`Batcher::pins_ring`]), when nothing else is ready.
    pub(super) fn pinning(&self, shared: &Shared) -> Option<u64> {
        // Replaying, it holds the shared units it has not reached yet.
        if shared.gpu.is_some() || !self.next.is_empty() || self.replay.active.is_some() {
            return None;
        }
        let b = shared.batching.lock().unwrap_or_else(|p| p.into_inner());
        b.batcher.pins_ring(shared.welcome.slots)
    }

    /// Hands out the batch at the front.
    pub(super) fn hand_out(&mut self, shared: &Arc<Shared>, clock: &mut Clock) -> Event {
        let (run, sent_ns, slot, map) = match self.pop_front() {
            Some(Next::Run(run, sent_ns, slot, map)) => (run, sent_ns, slot, Some(map)),
            Some(Next::Replayed(run)) => (run, proto::monotonic_ns(), 0, None),
            _ => unreachable!("called with a run at the front"),
        };
        clock.pinned_since = None;
        let now = proto::monotonic_ns();
        shared.held.fetch_add(1, Ordering::AcqRel);
        let asked = clock.asking_since.swap(0, Ordering::Relaxed);
        let busy_ns = match clock.last_batch_ns {
            0 => 0,
            last => asked.saturating_sub(last),
        };
        clock.last_batch_ns = now;
        if self.place.epoch_batches.0 != run.epoch {
            self.place.epoch_batches = (run.epoch, 0);
        }
        self.place.epoch_batches.1 += 1;
        let at = Position {
            epoch: run.epoch,
            sample: run.first,
        };
        self.place.started_at.get_or_insert(at);
        self.place.next_at = self
            .place
            .rotated
            .after(&run, shared.welcome.schema.samples_per_epoch);
        let taken = shared.taken.hand_out(run.samples, run.epoch);
        if let Some(mb) = &shared.mailbox {
            mb.note_taken(taken);
        }
        let replayed = map.is_none();
        Event::Batch(Batch {
            shared: shared.clone(),
            map: map.unwrap_or_else(|| shared.host.current()),
            run,
            slot,
            replayed,
            sent_ns,
            wait_ns: now.saturating_sub(asked),
            busy_ns,
            received_ns: now,
            released: false,
        })
    }

    /// Returns the event at the front, which is not a batch; `rides`: the
    /// consumer may wait for a broker that went away.
    pub(super) fn pop_event(
        &mut self,
        clock: &mut Clock,
        link: &mut Link,
        rides: bool,
    ) -> Result<Option<Event>> {
        match self.pop_front() {
            Some(Next::EndOfEpoch(mut e)) => {
                clock.asking_since.store(0, Ordering::Relaxed);
                clock.last_batch_ns = 0;
                // Counted in this consumer's batches.
                e.batches = match self.place.epoch_batches {
                    (epoch, n) if epoch == e.epoch => n,
                    _ => 0,
                };
                self.place.ended_epoch = Some(e.epoch);
                Ok(Some(Event::EndOfEpoch(e)))
            }
            Some(Next::EndOfStream) => {
                link.finished = true;
                Ok(Some(Event::EndOfStream))
            }
            Some(Next::Fail(e)) => {
                // A broker that went away may come back (see `reconnect`).
                link.finished = !e.broker_went_away() || !rides;
                Err(e)
            }
            Some(Next::Run(..) | Next::Replayed(_)) | None => {
                unreachable!("called with an event at the front")
            }
        }
    }

    /// Takes one message: a unit is cut into batches, the rest queued in
    /// order (a failure first: nothing after it matters).
    pub(super) fn intake(&mut self, shared: &Arc<Shared>, msg: ServerMsg) {
        if let Err(e) = self.take_message(shared, msg) {
            self.next.push_front(Next::Fail(e));
        }
    }

    /// The shared stream's end of epoch `e`: the batch being built is cut
    /// short (or dropped), and the end follows it unless the epoch is read
    /// rotated (its start, replayed, ends it).
    fn end_epoch(
        &mut self,
        shared: &Shared,
        batcher: &mut Batcher,
        mut e: EpochEnd,
        give: &mut Vec<u64>,
    ) {
        let start = Position {
            epoch: e.epoch,
            sample: 0,
        };
        if self.replay.from.is_some_and(|p| p <= start) {
            e.complete = true; // its start was replayed
        }
        batcher.end_epoch(e.epoch, give);
        while let Some(run) = batcher.pop() {
            self.next.push_back(Next::Run(
                run,
                proto::monotonic_ns(),
                0,
                shared.host.current(),
            ));
        }
        if !self.place.rotated.holds_end_of(e.epoch) {
            self.next.push_back(Next::EndOfEpoch(e));
        }
    }

    pub(super) fn take_message(&mut self, shared: &Arc<Shared>, msg: ServerMsg) -> Result<()> {
        let mut give = Vec::new();
        let mut b = shared.batching.lock().unwrap_or_else(|p| p.into_inner());
        let (sent_ns, slot) = match msg {
            ServerMsg::Batch(meta) => {
                let slots = match &shared.gpu {
                    Some(g) => g.slots(),
                    None => shared.welcome.slots,
                };
                if meta.slot >= slots {
                    return Err(Error::Unexpected(format!(
                        "batch {} in slot {} of {slots}",
                        meta.seq, meta.slot
                    )));
                }
                let unit = Unit {
                    seq: meta.seq,
                    epoch: meta.epoch,
                    index: meta.index,
                    samples: meta.samples,
                };
                b.batcher.push(unit, &mut give)?;
                (meta.sent_ns, meta.slot)
            }
            ServerMsg::Replay(r) => {
                drop(b);
                return self.take_replayed(shared, r);
            }
            ServerMsg::Cut(restart) => {
                drop(b);
                return self.take_cut(shared, restart);
            }
            ServerMsg::Merge(at) => {
                drop(b);
                return self.take_merge(shared, at);
            }
            ServerMsg::Rotate(at) => {
                drop(b);
                return self.take_rotate(shared, at);
            }
            ServerMsg::Arena(region) => {
                // Runs made before it are read where they were made (a
                // batch the broker left behind for this consumer is only
                // there); runs made from now on here (units noticed before
                // it and still held were copied across).
                return shared.host.move_to(&shared.welcome.rings, region);
            }
            ServerMsg::EndOfEpoch(e) => {
                if self.place.skip.is_some_and(|p| e.epoch < p.epoch) {
                    return Ok(()); // an epoch it replayed, or resumes past
                }
                self.end_epoch(shared, &mut b.batcher, e, &mut give);
                (0, 0)
            }
            ServerMsg::EndOfStream => {
                self.next.push_back(Next::EndOfStream);
                (0, 0)
            }
            ServerMsg::Error(e) => return Err(broker_error(e)),
            ServerMsg::Goodbye(reason) => return Err(goodbye_error(reason)),
            other => return Err(Error::Unexpected(format!("{other:?}"))),
        };
        while let Some(run) = b.batcher.pop() {
            self.next
                .push_back(Next::Run(run, sent_ns, slot, shared.host.current()));
        }
        let totals = if give.is_empty() {
            Totals::default()
        } else {
            std::mem::take(&mut b.totals)
        };
        drop(b);
        shared.give_back(give.into_iter().map(proto::Unit::Shared), totals)
    }

    /// Leaving: gives back every unit this consumer was sent and no batch
    /// it handed out still reads (notices never read, batches cut and not
    /// handed out, the batch being built), so they pin no slot until the
    /// connection closes.
    pub(super) fn give_back_unread(&mut self, shared: &Shared) {
        let mut seqs = Vec::new();
        let mut replayed = Vec::new();
        if let Some(mb) = shared.mailbox.as_ref() {
            loop {
                match mb.pop() {
                    Ok(Some(Notice::Batch(b))) => seqs.push(b.seq),
                    Ok(Some(Notice::Replay(r))) => replayed.push(r.seq),
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
        }
        let totals = {
            let mut b = shared.batching.lock().unwrap_or_else(|p| p.into_inner());
            for n in self.next.drain(..) {
                if let Next::Run(run, ..) = n {
                    b.batcher.release(&run, &mut seqs);
                }
            }
            if let Some(r) = self.replay.active.take() {
                for n in r.queue {
                    match n {
                        Next::Replayed(run) => replayed.push(run.first_seq),
                        Next::Run(run, ..) => b.batcher.release(&run, &mut seqs),
                        _ => {}
                    }
                }
            }
            b.batcher.leave(&mut seqs);
            std::mem::take(&mut b.totals)
        };
        let units = seqs
            .into_iter()
            .map(proto::Unit::Shared)
            .chain(replayed.into_iter().map(proto::Unit::Replayed));
        if let Err(e) = shared.give_back(units, totals) {
            tracing::debug!("giving back unread batches: {e}");
        }
    }

    /// The broker went away with nothing left for this consumer to read:
    /// its end (and the end of the epoch it last read, if unsaid) is all
    /// that was missing.
    pub(super) fn end_here(&mut self) {
        let end = self.unsaid_epoch_end();
        self.next.clear();
        self.next.extend(end.map(Next::EndOfEpoch));
        self.next.push_back(Next::EndOfStream);
    }

    /// The end of the epoch the last batch handed out ended, if its end
    /// was not handed out yet: a new broker will not say it.
    pub(super) fn unsaid_epoch_end(&self) -> Option<EpochEnd> {
        let (epoch, batches) = self.place.epoch_batches;
        let start = Position { epoch, sample: 0 };
        let ended = self.place.next_at
            == Position {
                epoch: epoch + 1,
                sample: 0,
            }
            && batches > 0
            && self.place.ended_epoch != Some(epoch);
        ended.then(|| EpochEnd {
            epoch,
            batches,
            complete: self.place.started_at.is_some_and(|p| p <= start)
                || self.replay.from.is_some_and(|p| p <= start),
        })
    }
}

impl Consumer {
    /// Where this consumer's batches are delivered.
    pub fn device(&self) -> Device {
        self.shared.gpu.as_ref().map_or(Device::Cpu, |g| g.device())
    }
}
