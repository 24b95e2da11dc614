//! Decoupled pace: cutting a consumer from the shared stream (it fell
//! a ring behind and goes on from replay) and re-joining it where the
//! shared stream still holds its samples. What it took stays held; what it
//! never took, or was queued for it, is given back; nothing is published to
//! it while it is cut. The property tests cut and re-join at random.

use batchcast::proto::ErrorCode;

use super::{ConsumerId, GroupId, Hub, HubError, Life, Outbound};

impl Hub {
    /// Detaches a consumer that kept the pipeline waiting too long
    /// (decoupled pace's hold limit): it is removed, everything it held or
    /// was owed is given back (a batch it still reads may be rewritten: its
    /// own loss, as with the lag limit), and it is told `reason`.
    pub fn detach(&mut self, id: ConsumerId, reason: String) -> bool {
        if self.readers.get(id).is_none() {
            return false;
        }
        self.out.push((
            id,
            Outbound::Detached {
                reason,
                code: ErrorCode::HoldLimit,
            },
        ));
        self.tally.detached += 1;
        self.post().remove(id);
        self.post().pump();
        self.post().start_copies();
        true
    }

    /// Cuts a consumer from the shared stream (decoupled pace: it fell
    /// too far behind, and goes on from replay): what was queued for it,
    /// and the batches in `revoke` that it was sent and never took, are
    /// given back; nothing more is published to it until it
    /// [rejoins](Hub::rejoin). What it took stays held until released.
    /// The runtime must be sure it never reads the `revoke`d batches (the
    /// mailbox's cut handshake).
    ///
    /// Returns the epoch and index of the first batch it no longer gets
    /// (its replay begins there, or at its batch boundary before).
    pub fn cut(&mut self, id: ConsumerId, revoke: &[u64]) -> Result<(u64, u64), HubError> {
        let head = self.ring.head();
        let c = self.readers.get(id).ok_or(HubError::UnknownConsumer(id))?;
        let not = match c.life {
            Life::Closing => Some("it said goodbye"),
            Life::Ended => Some("it was told the stream ended"),
            Life::Reading { .. } | Life::Cut => None,
        };
        if let Some(why) = not {
            return Err(HubError::NotCuttable(why));
        }
        if let Some(&seq) = revoke.iter().find(|s| !c.held.contains(s)) {
            return Err(HubError::NotHeld { seq });
        }
        // What it took ends before this batch; one it never got yet starts
        // where it would have (its first epoch, if not reached).
        let lost = revoke
            .iter()
            .copied()
            .chain(c.queue.front().copied())
            .min()
            .unwrap_or(head.max(c.floor));
        // A GPU member's batch may be gone from the host ring, copied.
        let copied = |g: GroupId| self.groups[g as usize].position(lost);
        let next = self.ring.cursor();
        let at = self
            .ring
            .position(lost)
            .or_else(|| c.group.and_then(copied))
            .unwrap_or((next.next_epoch, next.next_index));
        let first = if at.0 < c.start_epoch {
            (c.start_epoch, 0)
        } else {
            at
        };
        let c = self.readers.get_mut(id).expect("looked up above");
        c.life = Life::Cut;
        c.held.retain(|s| !revoke.contains(s));
        let group = c.group;
        let dropped: Vec<u64> = c.queue.drain(..).chain(revoke.iter().copied()).collect();
        for seq in dropped {
            self.post().unref(group, seq);
        }
        self.post().pump();
        Ok(first)
    }

    /// Cuts consumer `id` as it joins, before anything the hub sent it has
    /// left the hub (decoupled pace: a consumer that needs replay starts
    /// from replay): what it was sent is taken back with its messages, so
    /// it owes and holds nothing. Returns what [`Hub::cut`] does.
    pub(crate) fn cut_at_join(&mut self, id: ConsumerId) -> Result<(u64, u64), HubError> {
        let sent = self
            .readers
            .get(id)
            .ok_or(HubError::UnknownConsumer(id))?
            .held
            .clone();
        self.out.retain(|(to, _)| *to != id);
        // A finite stream already made to its end told it so on joining:
        // that end is taken back with the rest (replay tells it again).
        if let Some(c) = self.readers.get_mut(id)
            && c.life == Life::Ended
        {
            c.life = Life::Reading { through: None };
        }
        self.cut(id, &sent)
    }

    /// Ends a cut consumer's stream: its replay read every epoch, so the
    /// shared stream has nothing left for it, wherever the ring stands
    /// (it may not have got there: nobody else reads it). It is told the
    /// stream ended; what it still holds stays held until released.
    pub(crate) fn end_replayed(&mut self, id: ConsumerId) -> Result<(), HubError> {
        let c = self
            .readers
            .get_mut(id)
            .ok_or(HubError::UnknownConsumer(id))?;
        if c.life != Life::Cut {
            return Err(HubError::NotCut(id));
        }
        c.life = Life::Ended;
        self.out.push((id, Outbound::EndOfStream));
        Ok(())
    }

    /// Puts a cut consumer back in the shared stream from batch `seq` on:
    /// it owes every batch from there, published or to come. Refused
    /// ([`HubError::NotLive`]) unless every batch from `seq` to the head is
    /// still published (nobody may reuse a slot it is to read) and it holds
    /// nothing from `seq` on. Sent no batch of an epoch after `through` (a
    /// rotated epoch: the consumer reads its rest, then is cut to be
    /// replayed its start, see [`View::read_through`](super::View::read_through)); its end of stream
    /// waits for that too.
    pub(crate) fn rejoin_through(
        &mut self,
        id: ConsumerId,
        seq: u64,
        through: Option<u64>,
    ) -> Result<(), HubError> {
        let head = self.ring.head();
        let c = self.readers.get(id).ok_or(HubError::UnknownConsumer(id))?;
        if c.life != Life::Cut {
            return Err(HubError::NotCut(id));
        }
        // Every batch from there on published, following each other in
        // the epoch (none of an epoch abandoned while nobody read it, see
        // `join_group`).
        let live = self.ring.live_from(seq);
        let copies = c
            .group
            .is_none_or(|g| self.groups[g as usize].may_owe(seq, head));
        let Some((epoch, _)) = self.ring.position(seq).filter(|_| live && copies) else {
            return Err(HubError::NotLive { seq });
        };
        if c.held.iter().any(|&h| h >= seq) {
            return Err(HubError::NotLive { seq });
        }
        let c = self.readers.get_mut(id).expect("looked up above");
        c.life = Life::Reading { through };
        c.floor = seq;
        c.start_epoch = epoch;
        self.post().owe_published(id, seq);
        self.post().pump();
        Ok(())
    }
}
