//! What the hub refuses, and why.

use super::{ConsumerId, GroupId};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HubError {
    #[error("window must be at least 1")]
    WindowZero,
    #[error("window {window} exceeds the stream's {slots} slots")]
    WindowTooLarge { window: u32, slots: u32 },
    #[error(
        "window {window} exceeds the stream's lag_limit of {lag_limit} batches; ask for a window of at most {lag_limit}"
    )]
    WindowAboveLagLimit { window: u32, lag_limit: u32 },
    #[error("no consumer {0}")]
    UnknownConsumer(ConsumerId),
    #[error("batch {seq} is not held by this consumer (already released, or never sent)")]
    NotHeld { seq: u64 },
    #[error("this consumer is not cut from the shared stream: {0}")]
    NotCuttable(&'static str),
    #[error("consumer {0} was not cut from the stream, or said goodbye since")]
    NotCut(ConsumerId),
    #[error(
        "batch {seq} is no longer published (or it holds batch {seq} or a later one): it cannot rejoin there"
    )]
    NotLive { seq: u64 },
    #[error(
        "window {window} exceeds the {slots} device slots of this stream's GPU arena; ask for a window of at most {slots}"
    )]
    WindowAboveGroupSlots { window: u32, slots: u32 },
    #[error("no group {0}")]
    UnknownGroup(GroupId),
    #[error("copies to this GPU failed; it takes no more consumers")]
    GroupFailed,
    #[error("batch {seq} is not being copied to group {group}")]
    NotCopying { group: GroupId, seq: u64 },
}
