//! A consumer's data state for a checkpoint ([`ConsumerState`]): where
//! its next batch begins in its stream, and what it needs to resume there
//! exactly (the convention of torchdata's `StatefulDataLoader`).

use serde::{Deserialize, Serialize};

use crate::proto::{Position, StreamDigest};

/// Where a consumer is: saved with a model checkpoint, given back as
/// [`ConsumerOptions::state`](crate::ConsumerOptions::state) to resume
/// there. It costs nothing to take (fields the consumer already has) and
/// is a few dozen bytes.
///
/// Resuming is exact: the samples from `position` on, in the stream's
/// order, with the bytes an uninterrupted consumer gets (what the stream
/// already made is recomputed for it). A broker whose stream now makes
/// other data (its [`StreamDigest`] differs) refuses the resume, naming
/// what changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerState {
    pub stream: String,
    /// The stream's description as the consumer was served it.
    pub digest: StreamDigest,
    /// Where its next batch begins: right after the last batch it handed
    /// out (an epoch's end is the next epoch's start), or where it
    /// started if it handed out none.
    pub position: Position,
    /// Its batch size and whether it drops an epoch's short last batch;
    /// a resume may ask for another batch size (the same samples from
    /// `position` on, grouped anew).
    pub batch_size: u64,
    pub drop_last: bool,
}
