//! A consumer's window, in the stream's units and in its own batches,
//! and the checks it must pass to join.

use super::{HubError, View};

/// A consumer's window: what it may hold unreleased, in the stream's
/// batches (`units`, what the hub counts), and in its own batches
/// (`batches`, what it asked for). They differ for a consumer of another
/// batch size (a run of its batches spans several of the stream's) and for
/// a group member (its runs lie a batch of each data rank apart). The lag
/// limit counts the consumer's own window: the units its window spans
/// beyond that are not lag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub units: u32,
    pub batches: u32,
}

impl From<u32> for Window {
    /// A consumer of the stream's own batches: a unit is one of its batches.
    fn from(units: u32) -> Self {
        Window {
            units,
            batches: units,
        }
    }
}

impl Window {
    /// Units its window may span beyond its own batches, allowed over the
    /// lag limit.
    pub(super) fn allowance(self) -> usize {
        self.units.saturating_sub(self.batches) as usize
    }
}

impl View<'_> {
    /// Whether a consumer with this window may join (in a group of
    /// `group_slots` slots): checked before anything is allocated for it.
    /// The lag limit bounds its window in its own batches.
    pub(crate) fn check_window(
        &self,
        window: impl Into<Window>,
        group_slots: Option<u32>,
    ) -> Result<(), HubError> {
        let Window {
            units: window,
            batches,
        } = window.into();
        if window == 0 || batches == 0 {
            return Err(HubError::WindowZero);
        }
        if window > self.cfg.slots {
            return Err(HubError::WindowTooLarge {
                window,
                slots: self.cfg.slots,
            });
        }
        if let Some(lag_limit) = self.cfg.lag_limit
            && batches > lag_limit
        {
            return Err(HubError::WindowAboveLagLimit {
                window: batches,
                lag_limit,
            });
        }
        if let Some(slots) = group_slots
            && window > slots
        {
            return Err(HubError::WindowAboveGroupSlots { window, slots });
        }
        Ok(())
    }
}
