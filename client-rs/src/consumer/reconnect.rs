//! Riding through a broker restart: when the broker goes away (killed,
//! restarted, shut down), a consumer with a `reconnect_timeout` keeps the
//! batches it holds readable (their mappings stay), says once on stderr
//! that it waits, connects again within the timeout and subscribes from
//! its own next position with its state ([`ConsumerState`]): the new
//! broker serves it from exactly there, by replay where its stream is
//! elsewhere, and refuses it if its stream now makes other data.
//! Batches received and not handed out yet are dropped: the new broker
//! sends them again.

use std::time::{Duration, Instant};

use super::{Consumer, ConsumerOptions, Next};
use crate::batch::TakenTally;
use crate::error::{Error, ErrorCode, Result};
use crate::transport::last_words;

/// How soon a connection the broker dropped while starting or stopping is
/// tried again.
const RETRY: Duration = Duration::from_millis(20);
/// Between asks while refused `Busy`: each is a subscription the broker
/// refuses (and may log), so fewer.
const BUSY_RETRY: Duration = Duration::from_millis(200);

impl Consumer {
    /// `result`, unless it says the broker went away and this consumer
    /// may wait for it: then `None`, the wait begun (the caller goes on
    /// with [`Consumer::reconnect`]), or the stream's end where nothing
    /// was left to read.
    pub(super) fn ride_through<T>(&mut self, result: Result<T>) -> Result<Option<T>> {
        match result {
            // A device consumer too: its place is served by replay to its
            // GPU. A stream a producer feeds resumes once its producer
            // registered it again (see [`crate::Producer`]).
            Err(e)
                if e.broker_went_away()
                    && !self.link.finished
                    && !self.opts.reconnect_timeout.is_zero() =>
            {
                // A send that found the connection closed: the broker may
                // have left its reason there first (it detached this
                // consumer), which is not a broker going away.
                let e = last_words(&mut self.link.reader, &mut self.link.buf, e);
                if !e.broker_went_away() {
                    self.link.finished = true;
                    return Err(e);
                }
                self.went_away(e);
                Ok(None)
            }
            other => other.map(Some),
        }
    }

    /// The broker went away: begins the wait for it, saying so once, or,
    /// where the stream has nothing left for this consumer, ends it.
    fn went_away(&mut self, cause: Error) {
        let state = self.state();
        if self
            .shared
            .welcome
            .schema
            .epochs
            .is_some_and(|n| state.position.epoch >= n)
        {
            // Nothing is left to read: its end is all that was missing.
            self.inbox.end_here();
            return;
        }
        eprintln!(
            "batchcast: {cause}; consumer `{}` of stream `{}` waits up to {:.0} s for it to come back, to go on at epoch {} sample {}",
            self.opts.name,
            state.stream,
            self.opts.reconnect_timeout.as_secs_f64(),
            state.position.epoch,
            state.position.sample
        );
        self.link.down = Some(Down {
            since: Instant::now(),
        });
    }

    /// Waits for the broker (until `until`, if given, and at most until
    /// `reconnect_timeout` after it went) and subscribes again from this
    /// consumer's next position. `false`: not back by `until`, still
    /// waiting (call again). Errors once the timeout passes or the new
    /// broker refuses the consumer (its stream changed, ...).
    pub(super) fn reconnect(&mut self, until: Option<Instant>) -> Result<bool> {
        let Some(down) = self.link.down else {
            return Ok(true);
        };
        let deadline = down.since + self.opts.reconnect_timeout;
        let mut opts = self.opts.clone();
        opts.resume = None;
        opts.state = Some(self.state());
        opts.batch_size = None;
        opts.drop_last = None;
        let mut said_busy = false;
        let mut fresh = loop {
            let stop = until.map_or(deadline, |u| u.min(deadline));
            opts.connect_timeout = stop.saturating_duration_since(Instant::now());
            match super::connect_carrying(opts.clone(), self.shared.taken.clone()) {
                Ok(c) => break c,
                // The old broker still closing, or the new one starting;
                // or a limit or group seat still held (by this consumer's
                // old connection, not yet gone, or another that may leave).
                Err(e)
                    if (e.while_restarting() || e.code() == Some(ErrorCode::Busy))
                        && Instant::now() < deadline =>
                {
                    let busy = e.code() == Some(ErrorCode::Busy);
                    if busy && !std::mem::replace(&mut said_busy, true) {
                        eprintln!(
                            "batchcast: consumer `{}` waits to be let in again: {e}",
                            self.opts.name
                        );
                    }
                    if until.is_some_and(|u| Instant::now() >= u) {
                        return Ok(false);
                    }
                    std::thread::sleep(if busy { BUSY_RETRY } else { RETRY });
                }
                Err(e) => {
                    eprintln!(
                        "batchcast: consumer `{}` gave up waiting for the broker: {e}",
                        self.opts.name
                    );
                    // Said once: later calls fail at once.
                    self.link.down = None;
                    self.opts.reconnect_timeout = Duration::ZERO;
                    return Err(e);
                }
            }
        };
        eprintln!(
            "batchcast: consumer `{}` is back after {:.2} s",
            self.opts.name,
            down.since.elapsed().as_secs_f64()
        );
        hand_over(self, &mut fresh);
        *self = fresh; // the old one says goodbye into the closed socket
        Ok(true)
    }
}

/// [`Consumer::connect`]: subscribes with `opts`; where the broker goes
/// away before its welcome arrives and `reconnect_timeout` allows, waits
/// for it to come back (saying so once) and subscribes again, as a
/// consumer that had received nothing.
pub(super) fn first_connect(opts: ConsumerOptions) -> Result<Consumer> {
    let t0 = Instant::now();
    let mut went_away = false;
    loop {
        match super::connect_carrying(opts.clone(), TakenTally::new_consumer()) {
            // Once it went away, a broker not listening yet or still
            // closing is the restart under way, whatever the connect
            // timeout says.
            Err(e)
                if (e.broker_went_away() || (went_away && e.while_restarting()))
                    && t0.elapsed() < opts.reconnect_timeout =>
            {
                if !std::mem::replace(&mut went_away, true) {
                    eprintln!(
                        "batchcast: {e} while consumer `{}` subscribed to stream `{}`; it waits up to {:.0} s for the broker to come back",
                        opts.name,
                        opts.state.as_ref().map_or(&opts.stream, |s| &s.stream),
                        opts.reconnect_timeout.as_secs_f64()
                    );
                }
                std::thread::sleep(RETRY);
            }
            other => return other,
        }
    }
}

/// What the program saw carries over to `fresh`, the new subscription:
/// its place, clocks, reconnect count, where it began, and the end of
/// the epoch its last batch ended if no broker said it yet.
fn hand_over(old: &mut Consumer, fresh: &mut Consumer) {
    let end = old.inbox.unsaid_epoch_end();
    fresh.opts = old.opts.clone();
    let (place, was) = (&mut fresh.inbox.place, &old.inbox.place);
    place.epoch_batches = was.epoch_batches;
    place.ended_epoch = was.ended_epoch;
    place.started_at = was.started_at;
    fresh.clock.asking_since = std::mem::take(&mut old.clock.asking_since);
    fresh.clock.last_batch_ns = old.clock.last_batch_ns;
    fresh.link.reconnects = old.link.reconnects + 1;
    // It has seen everything since it first started: an epoch whose
    // start it saw is complete, whichever broker ends it.
    fresh.inbox.replay.from = old
        .inbox
        .replay
        .from
        .or(was.started_at)
        .or(fresh.inbox.replay.from);
    // The new broker's replay stretch begins where this consumer stopped:
    // an epoch end it replays is complete if the consumer saw the epoch's
    // start before.
    if let (Some(r), Some(from)) = (fresh.inbox.replay.active.as_mut(), fresh.inbox.replay.from) {
        r.began_at(from);
    }
    if let Some(end) = end {
        fresh.inbox.next.push_front(Next::EndOfEpoch(end));
    }
}

/// A consumer waiting for its broker to come back.
#[derive(Debug, Clone, Copy)]
pub(super) struct Down {
    since: Instant,
}
