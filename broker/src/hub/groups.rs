//! Groups: rings of copies in other memory, one per GPU (see the module
//! doc of [`crate::hub`], "Groups"). Adding one, ordering copies into the
//! group's ring in sequence order, a completed copy, a failed GPU.

use std::collections::{BTreeMap, VecDeque};

use super::{ConsumerId, CopyOrder, Group, GroupCounts, GroupId, Hub, HubError, Life, SlotId};

impl Hub {
    /// Adds a ring of `slots` copies (one GPU's arena); its members join
    /// with [`Hub::join_group`].
    pub(crate) fn add_group(&mut self, slots: u32) -> GroupId {
        assert!(slots > 0, "validated by the config");
        self.groups.push(Group {
            slots: vec![None; slots as usize],
            free: (0..slots).rev().collect(),
            replicas: BTreeMap::new(),
            waiting: VecDeque::new(),
            failed: false,
        });
        (self.groups.len() - 1) as GroupId
    }

    pub(crate) fn group_counts(&self, g: GroupId) -> Option<GroupCounts> {
        self.groups.get(g as usize).map(|grp| GroupCounts {
            slots: grp.slots.len() as u32,
            in_use: (grp.slots.len() - grp.free.len()) as u32,
            waiting: grp.waiting.len() as u32,
        })
    }

    /// The copy `seq` to group `g` has completed: its members may be sent
    /// it, and the host slot it was read from is given back.
    pub fn copied(&mut self, g: GroupId, seq: u64) -> Result<(), HubError> {
        let grp = self
            .groups
            .get_mut(g as usize)
            .ok_or(HubError::UnknownGroup(g))?;
        let r = grp
            .replicas
            .get_mut(&seq)
            .filter(|r| r.slot.is_some() && !r.done)
            .ok_or(HubError::NotCopying { group: g, seq })?;
        r.done = true;
        if r.refs == 0 {
            // Every member that owed it left while it was being copied.
            let slot = r.slot.expect("filtered above");
            grp.replicas.remove(&seq);
            grp.slots[slot as usize] = None;
            grp.free.push(slot);
        }
        self.ring.unpin(seq);
        self.pump();
        Ok(())
    }

    /// Copies to group `g` stopped for good (the GPU failed): its pending
    /// copies are dropped, unpinning their host slots, and its members are
    /// sent nothing more (they are told by the runtime and leave; what they
    /// still hold they may release, to no effect). Returns the members. The
    /// runtime must first make sure no copy still reads host memory.
    pub(crate) fn fail_group(&mut self, g: GroupId) -> Vec<ConsumerId> {
        let Some(grp) = self.groups.get_mut(g as usize) else {
            return Vec::new();
        };
        grp.failed = true;
        let pinned: Vec<u64> = grp
            .replicas
            .iter()
            .filter(|(_, r)| !r.done)
            .map(|(&s, _)| s)
            .collect();
        grp.replicas.clear();
        grp.waiting.clear();
        grp.slots.fill(None);
        grp.free = (0..grp.slots.len() as SlotId).rev().collect();
        for seq in pinned {
            self.ring.unpin(seq);
        }
        let mut members = Vec::new();
        for (&id, c) in self.consumers.iter_mut() {
            if c.group == Some(g) {
                c.queue.clear();
                c.life = Life::Closing;
                members.push(id);
            }
        }
        self.pump();
        members
    }

    /// Orders the copies the group's ring has room for, in sequence
    /// order. The ring is laid out as the host's: batch `seq` goes to slot
    /// `seq mod slots`, its samples to the cells of its stream position, so
    /// a member's runs of any batch size are spans of it. A copy waits
    /// until every batch the ring holds is less than `slots` behind it
    /// (then its slot is free too): live batches never share a cell.
    pub(super) fn start_copies(&mut self) {
        for (g, grp) in self.groups.iter_mut().enumerate() {
            let n = grp.slots.len() as u64;
            while let Some(&seq) = grp.waiting.front()
                && grp
                    .slots
                    .iter()
                    .flatten()
                    .min()
                    .is_none_or(|&oldest| seq < oldest + n)
            {
                grp.waiting.pop_front();
                let slot = (seq % n) as SlotId;
                debug_assert_eq!(grp.slots[slot as usize], None, "the span rule frees it");
                grp.free.retain(|&s| s != slot);
                let r = grp.replicas.get_mut(&seq).expect("waiting has a replica");
                r.slot = Some(slot);
                grp.slots[slot as usize] = Some(seq);
                self.copies.push(CopyOrder {
                    group: g as GroupId,
                    seq,
                    host: r.batch.slot,
                    slot,
                });
            }
        }
    }
}
