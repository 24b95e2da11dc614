//! Consumers joining and leaving the hub: where a joiner starts (the one
//! rule, by `JoinPolicy`), saying goodbye, leaving.

use std::collections::VecDeque;

use batchcast::JoinPolicy;

use super::{Consumer, ConsumerId, Delivery, GroupId, Hub, HubError, Life, Sent, Slack, Window};

impl Hub {
    /// Subscribes a host consumer; returns its id and the first epoch it
    /// will see. (The broker joins through [`Hub::join_group`].)
    #[cfg(test)]
    pub(crate) fn join(
        &mut self,
        window: u32,
        join: JoinPolicy,
    ) -> Result<(ConsumerId, u64), HubError> {
        self.join_group(window, join, None, Delivery::Window)
    }

    /// Subscribes a consumer of group `group`'s copies (or, with `None`, of
    /// the host slots); returns its id and the first epoch it will see.
    pub(crate) fn join_group(
        &mut self,
        window: impl Into<Window>,
        join: JoinPolicy,
        group: Option<GroupId>,
        delivery: Delivery,
    ) -> Result<(ConsumerId, u64), HubError> {
        let group_slots = match group {
            None => None,
            Some(g) => {
                let grp = self
                    .groups
                    .get(g as usize)
                    .ok_or(HubError::UnknownGroup(g))?;
                if grp.failed() {
                    return Err(HubError::GroupFailed);
                }
                Some(grp.slots())
            }
        };
        let window = window.into();
        self.view().check_window(window, group_slots)?;
        let allowance = window.allowance();
        let window = window.units;
        let ahead = match delivery {
            Delivery::Window => window,
            Delivery::Ahead => group_slots.unwrap_or(self.cfg.slots),
        };
        if join == JoinPolicy::NextEpoch
            && !self.readers.anyone_reading()
            && self.ring.cursor().next_index != 0
        {
            // Paused mid-epoch with nobody subscribed: nobody would see the
            // rest of this epoch, so it is not produced; batches of it still
            // in flight are published to nobody.
            let next = self.ring.cursor().next_epoch + 1;
            self.ring.seek(next, 0);
        }
        let (floor, start_epoch, first, from_ring) = self.view().start_of(join, group);
        let owes = if from_ring {
            self.ring.head().saturating_sub(floor) as usize
        } else {
            0
        };
        let credit = self.readers.join_credit(self.ring.head(), owes);
        let id = self.readers.add(Consumer {
            window,
            ahead,
            group,
            floor,
            start_epoch,
            first,
            queue: VecDeque::new(),
            held: Vec::new(),
            life: Life::Reading { through: None },
            cuttable: false,
            slack: Slack { credit, allowance },
            sent: Sent::new(start_epoch),
        });
        if from_ring {
            self.post().owe_published(id, floor);
        }
        self.post().pump();
        Ok((id, start_epoch))
    }

    /// Whether consumer `id` may be cut from the shared stream and
    /// replayed to (a decoupled host consumer): the lag limit never
    /// detaches one that may.
    pub(crate) fn may_be_cut(&mut self, id: ConsumerId, may: bool) {
        if let Some(c) = self.readers.get_mut(id) {
            c.cuttable = may;
        }
    }

    /// The consumer wants nothing more; what it holds stays held until it
    /// releases it or leaves.
    pub fn goodbye(&mut self, id: ConsumerId) -> Result<(), HubError> {
        let c = self
            .readers
            .get_mut(id)
            .ok_or(HubError::UnknownConsumer(id))?;
        c.life = Life::Closing;
        let group = c.group;
        let queued: Vec<u64> = c.queue.drain(..).collect();
        for seq in queued {
            self.post().unref(group, seq);
        }
        self.post().pump();
        Ok(())
    }

    /// The consumer is gone: everything it held or was owed is given back.
    /// Idempotent: returns `false` if it was already gone.
    pub fn leave(&mut self, id: ConsumerId) -> bool {
        let gone = self.post().remove(id);
        self.post().pump();
        gone
    }
}
