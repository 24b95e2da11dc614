//! Groups: rings of copies in other memory, one per GPU (see the module
//! doc of [`crate::hub`], "Groups"). Adding one, ordering copies into the
//! group's ring in sequence order, a completed copy, a failed GPU.

use super::{ConsumerId, Group, GroupId, Hub, HubError, Life};

impl Hub {
    /// Adds a ring of `slots` copies (one GPU's arena); its members join
    /// with [`Hub::join_group`].
    pub(crate) fn add_group(&mut self, slots: u32) -> GroupId {
        assert!(slots > 0, "validated by the config");
        self.groups.push(Group::new(slots));
        (self.groups.len() - 1) as GroupId
    }

    /// The copy `seq` to group `g` has completed: its members may be sent
    /// it, and the host slot it was read from is given back.
    pub fn copied(&mut self, g: GroupId, seq: u64) -> Result<(), HubError> {
        let grp = self
            .groups
            .get_mut(g as usize)
            .ok_or(HubError::UnknownGroup(g))?;
        if !grp.copied(seq) {
            return Err(HubError::NotCopying { group: g, seq });
        }
        self.ring.unpin(seq);
        self.post().pump();
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
        let pinned = grp.fail();
        for seq in pinned {
            self.ring.unpin(seq);
        }
        let mut members = Vec::new();
        for (id, c) in self.readers.iter_mut() {
            if c.group == Some(g) {
                c.queue.clear();
                c.life = Life::Closing;
                members.push(id);
            }
        }
        self.post().pump();
        members
    }
}
