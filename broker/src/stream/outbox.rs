//! The only writer to a consumer: messages on its connection's channel
//! (the server's task for that connection writes them out) and notices in
//! its mailbox, its bell rung once they are in. Nothing else in the stream
//! sends a consumer anything, so "a notice, then a ring" and "an error,
//! then a goodbye" are written once, here.

use batchcast::mailbox::{BrokerMailbox, MailboxError, Notice};
use batchcast::proto::{ErrorCode, ErrorMsg, GoodbyeReason, ServerMsg};
use tokio::sync::mpsc;

use crate::budget::Grant;
use crate::hub::ConsumerId;

/// What one consumer is sent, and how.
#[derive(Debug)]
pub(super) struct Outbox {
    id: ConsumerId,
    /// Bounded: the hub never emits more than a window of batches plus a
    /// few control messages ahead of releases.
    tx: mpsc::Sender<ServerMsg>,
    /// Host consumers that asked for one: where their batches are noticed
    /// and their releases written (see [`batchcast::mailbox`]).
    mailbox: Option<BrokerMailbox>,
    /// The mailbox's bytes in the broker's memory budget.
    _grant: Option<Grant>,
    /// Notices went into the mailbox since the bell last rang.
    ring: bool,
}

impl Outbox {
    pub(super) fn new(
        id: ConsumerId,
        tx: mpsc::Sender<ServerMsg>,
        (mailbox, grant): (Option<BrokerMailbox>, Option<Grant>),
    ) -> Outbox {
        Outbox {
            id,
            tx,
            mailbox,
            _grant: grant,
            ring: false,
        }
    }

    /// A message on the connection, whatever its kind.
    pub(super) fn send(&self, msg: ServerMsg) {
        // Full cannot happen (the channel holds a window and then some);
        // Closed means the connection is going away and will leave.
        if let Err(e) = self.tx.try_send(msg) {
            tracing::debug!(consumer = self.id, "outbox: {e}");
        }
    }

    /// A message where this consumer reads it: a notice in its mailbox for
    /// the kinds a mailbox carries (the bell rings at [`Outbox::ring`]),
    /// else on the connection. A mailbox that cannot take it (full: a ring
    /// its consumer never reads) is that consumer's fault: `Err` says why.
    pub(super) fn deliver(&mut self, msg: ServerMsg) -> Result<(), MailboxError> {
        if let Some(mb) = self.mailbox.as_mut()
            && let Some(n) = notice(&msg)
        {
            mb.push(&n)?;
            self.ring = true;
            return Ok(());
        }
        self.send(msg);
        Ok(())
    }

    /// [`Outbox::deliver`], then rings at once.
    pub(super) fn deliver_now(&mut self, msg: ServerMsg) -> Result<(), MailboxError> {
        self.deliver(msg)?;
        self.ring();
        Ok(())
    }

    /// Rings the mailbox's bell if notices went in since it last rang.
    pub(super) fn ring(&mut self) {
        if std::mem::take(&mut self.ring)
            && let Some(mb) = &self.mailbox
        {
            mb.ring();
        }
    }

    /// An error, then a goodbye: the last the consumer is sent.
    pub(super) fn end(&self, code: ErrorCode, message: String, reason: GoodbyeReason) {
        self.send(ServerMsg::Error(ErrorMsg { code, message }));
        self.send(ServerMsg::Goodbye(reason));
    }

    pub(super) fn mailbox(&self) -> Option<&BrokerMailbox> {
        self.mailbox.as_ref()
    }

    pub(super) fn mailbox_mut(&mut self) -> Option<&mut BrokerMailbox> {
        self.mailbox.as_mut()
    }

    /// No more notices (its consumer broke the mailbox's protocol, or is
    /// ended); whether it had a mailbox.
    pub(super) fn close_mailbox(&mut self) -> bool {
        self.mailbox.take().is_some()
    }
}

/// The mailbox notice for a message, for the kinds a mailbox carries.
fn notice(msg: &ServerMsg) -> Option<Notice> {
    match msg {
        ServerMsg::Batch(b) => Some(Notice::Batch(*b)),
        ServerMsg::EndOfEpoch(e) => Some(Notice::EndOfEpoch(*e)),
        ServerMsg::EndOfStream => Some(Notice::EndOfStream),
        ServerMsg::Replay(r) => Some(Notice::Replay(*r)),
        ServerMsg::Cut(p) => Some(Notice::Cut(*p)),
        ServerMsg::Merge(p) => Some(Notice::Merge(*p)),
        ServerMsg::Rotate(p) => Some(Notice::Rotate(*p)),
        ServerMsg::Arena(r) => Some(Notice::Arena(*r)),
        _ => None,
    }
}
