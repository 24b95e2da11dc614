//! A consumer's waits: for the next message from its mailbox or its
//! socket ([`Link`]), with the spin-then-sleep of mailbox consumers, and
//! the socket while the window is full.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Next;
use super::events::Inbox;
use super::link::Link;
use crate::batch::Shared;
use crate::error::Result;
use crate::mailbox::{ConsumerMailbox, Notice};
use crate::proto::{EpochEnd, ServerMsg};
use crate::transport::{read_server_msg, readable_within};

/// Longest sleep of a mailbox consumer between looks at its socket (a
/// broker that dies rings no bell).
const MAILBOX_TICK: Duration = Duration::from_millis(50);

/// Why [`Link::wait_mailbox`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Woke {
    Notice,
    Socket,
    Timeout,
}

/// A notice as the message it stands for.
fn message(n: Notice) -> ServerMsg {
    match n {
        Notice::Batch(b) => ServerMsg::Batch(b),
        Notice::EndOfEpoch(e) => ServerMsg::EndOfEpoch(e),
        Notice::EndOfStream => ServerMsg::EndOfStream,
        Notice::Replay(r) => ServerMsg::Replay(r),
        Notice::Cut(p) => ServerMsg::Cut(p),
        Notice::Merge(p) => ServerMsg::Merge(p),
        Notice::Rotate(p) => ServerMsg::Rotate(p),
        Notice::Arena(r) => ServerMsg::Arena(r),
    }
}

impl Link {
    /// The next message, waiting until `deadline`: from the mailbox, else
    /// the socket (an error, a goodbye, the broker gone). `None` at the
    /// deadline. An end of epoch among notices a cut took back goes to
    /// `deferred` (the cut's notice, next, says whether it counts).
    pub(super) fn receive(
        &mut self,
        shared: &Shared,
        deferred: &mut Vec<EpochEnd>,
        deadline: Instant,
    ) -> Result<Option<ServerMsg>> {
        let Some(mb) = shared.mailbox.as_ref() else {
            // A device consumer's releases whose GPU work is done go out
            // now, not only once its socket runs dry: with batches queued
            // on the socket they would wait behind them, and the broker
            // copies into a device slot only once every member released it.
            shared.flush_fenced(false)?;
            if self.buffered() || self.socket_readable(shared, deadline)? {
                return self.read_msg().map(Some);
            }
            return Ok(None);
        };
        loop {
            match mb.pop_marked()? {
                // An end of epoch among batches a cut took back: it counts
                // only if it ends an epoch before where replay begins,
                // which the cut's notice, next, says.
                Some((Notice::EndOfEpoch(e), true)) => {
                    deferred.push(e);
                    continue;
                }
                Some((n, _)) => return Ok(Some(message(n))),
                None => {}
            }
            if self.buffered() {
                return self.read_msg().map(Some);
            }
            match self.wait_mailbox(mb, deadline)? {
                Woke::Notice => {}
                Woke::Socket if !mb.has_notice() => return self.read_msg().map(Some),
                Woke::Socket => {}
                Woke::Timeout => return Ok(None),
            }
        }
    }

    /// Socket consumers: waits until `deadline` for the socket, sending
    /// the releases whose GPU work finishes meanwhile (the broker may be
    /// waiting for one of them to send the next batch).
    fn socket_readable(&self, shared: &Shared, deadline: Instant) -> Result<bool> {
        loop {
            shared.flush_fenced(false)?;
            let left = deadline.saturating_duration_since(Instant::now());
            let step = if shared.fenced_pending() {
                left.min(Duration::from_millis(1))
            } else {
                left
            };
            let ms = u16::try_from(step.as_millis()).unwrap_or(u16::MAX);
            if readable_within(self.reader.get_ref(), ms)? {
                return Ok(true);
            }
            if left.is_zero() || (step == left && ms != u16::MAX) {
                return Ok(false);
            }
        }
    }

    /// Reads the next frame from the socket.
    pub(super) fn read_msg(&mut self) -> Result<ServerMsg> {
        read_server_msg(&mut self.reader, &mut self.buf)
    }

    /// Whether a frame's bytes were read into the buffer already (no
    /// system call).
    pub(super) fn buffered(&self) -> bool {
        !self.reader.buffer().is_empty()
    }

    /// Whether a message waits: read into the buffer, or on the socket
    /// within `ms`.
    pub(super) fn waiting(&self, ms: u16) -> Result<bool> {
        Ok(self.buffered() || readable_within(self.reader.get_ref(), ms)?)
    }

    /// Device consumers: sends the releases whose GPU work is done, and
    /// until none is left keeps doing so while no message has arrived (the
    /// broker may be waiting for them to send the next batch).
    pub(super) fn wait_for_fenced(&self, shared: &Shared) -> Result<()> {
        shared.flush_fenced(false)?;
        while shared.fenced_pending() && !self.waiting(1)? {
            shared.flush_fenced(false)?;
        }
        Ok(())
    }

    /// Waits for a notice, a socket message or `deadline`: polls for the
    /// spin time (yielding the CPU between looks), then sleeps on the bell,
    /// looking at the socket before each sleep.
    fn wait_mailbox(&self, mb: &ConsumerMailbox, deadline: Instant) -> Result<Woke> {
        let start = Instant::now();
        let spin_until = (start + self.spin).min(deadline);
        let mut looks = 0u32;
        loop {
            if mb.has_notice() {
                return Ok(Woke::Notice);
            }
            let now = Instant::now();
            if now < spin_until {
                looks += 1;
                if looks < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
                continue;
            }
            let mut socket = Ok(false);
            if now >= deadline {
                socket = readable_within(self.reader.get_ref(), 0);
            } else {
                mb.sleep_unless((deadline - now).min(MAILBOX_TICK), || {
                    socket = readable_within(self.reader.get_ref(), 0);
                    !matches!(socket, Ok(false))
                });
            }
            if socket? {
                return Ok(Woke::Socket);
            }
            if now >= deadline {
                return Ok(Woke::Timeout);
            }
        }
    }

    /// While the window is full: takes a socket message (an error, a
    /// goodbye) if one comes before `deadline`; `false` at the deadline.
    pub(super) fn poll_socket(
        &mut self,
        shared: &Arc<Shared>,
        inbox: &mut Inbox,
        deadline: Instant,
    ) -> Result<bool> {
        loop {
            if !shared.window_full() {
                return Ok(true);
            }
            if self.waiting(1)? {
                let msg = self.read_msg()?;
                inbox.intake(shared, msg);
                return Ok(true);
            }
            shared.flush_fenced(false)?;
            if Instant::now() >= deadline {
                return Ok(false);
            }
        }
    }

    /// Socket consumers, before a batch is handed out: takes every message
    /// already waiting on the socket, so that an error the broker sent
    /// after batches still unread there comes first. A consumer detached
    /// while it paused (the hold limit, the lag limit) finds the batches
    /// sent before the detach and then the reason; their slots were given
    /// back and may hold other data by now, so they must never be handed
    /// out. (A mailbox consumer's unread notices are taken back by the
    /// broker at the detach.) The broker gone is queued after what came
    /// before it, as when read in turn.
    pub(super) fn take_waiting(&mut self, shared: &Arc<Shared>, inbox: &mut Inbox) {
        if shared.mailbox.is_some() {
            return;
        }
        loop {
            if !self.waiting(0).unwrap_or(false) {
                return;
            }
            match self.read_msg() {
                Ok(msg) => {
                    inbox.intake(shared, msg);
                    // The first reason is the one: a goodbye follows it.
                    if matches!(inbox.next.front(), Some(Next::Fail(_))) {
                        return;
                    }
                }
                Err(e) if e.broker_went_away() => {
                    inbox.next.push_back(Next::Fail(e));
                    return;
                }
                Err(e) => {
                    inbox.next.push_front(Next::Fail(e));
                    return;
                }
            }
        }
    }
}
