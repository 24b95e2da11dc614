//! What the stream refuses, and why it stops. Each error names the
//! culprit and what to do; the server turns them into the client's
//! `ErrorCode`.

use crate::gpu::GpuError;
use crate::hub::HubError;
use crate::pipeline::PipelineError;

/// Why a stream stopped serving: its source failed. Every consumer is told
/// (`SourceFailed`), `stats` shows it, and new consumers are refused with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamFailed {
    /// The pipeline failed: a bad file with `on_error = "fail"`, a dataset
    /// that is mostly unreadable (the text names the file and why).
    #[error("{0}")]
    Source(String),
    #[error("cannot start a decoder: {0}")]
    Decoder(String),
    /// The producer said it failed.
    #[error("producer {who} failed: {message}")]
    ProducerFailed { who: String, message: String },
    #[error("producer {who} left while filling batch {index} of epoch {epoch}")]
    ProducerLeftMidBatch { who: String, index: u64, epoch: u64 },
    /// The producer left before every epoch was published.
    #[error("the producer {who} stopped after {produced} batches, in epoch {epoch}{}", match epochs {
        Some(e) => format!(" of {e}"),
        None => " (mid-epoch)".into(),
    })]
    ProducerStopped {
        who: String,
        produced: u64,
        epoch: u64,
        epochs: Option<u64>,
    },
    /// The producer broke the protocol, and its connection was closed.
    #[error("producer {who}: {why}")]
    ProducerBroke { who: String, why: String },
}

#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error(transparent)]
    Hub(#[from] HubError),
    #[error("the stream stopped: {0}")]
    Failed(StreamFailed),
    #[error(transparent)]
    Device(GpuError),
    #[error("cannot make its mailbox: {0}")]
    Mailbox(batchcast::Error),
    #[error(transparent)]
    OverBudget(#[from] crate::budget::OverBudget),
    #[error("{0}")]
    BatchSize(String),
    /// A group seat that would deal unlike its group.
    #[error("{0}")]
    Seat(String),
    /// A group seat another member of the uid holds (perhaps a rank's old
    /// connection, not yet gone): worth asking again.
    #[error("{0}")]
    SeatTaken(String),
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// The consumer's state was saved under another description of the
    /// stream: serving it would give other data than it expects.
    #[error(
        "stream `{stream}` has changed since this consumer's state was saved: {}; resuming would serve other data. Start it afresh (without its state), or serve the stream as it was",
        changed.iter().map(|p| batchcast::proto::StreamDigest::describe(p)).collect::<Vec<_>>().join(", ")
    )]
    Changed {
        stream: String,
        changed: Vec<&'static str>,
    },
}

/// A release that does not name a batch the consumer holds.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error(transparent)]
    Hub(#[from] HubError),
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

/// Replay refused, or a release of a replayed batch that names none held.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    OverBudget(#[from] crate::budget::OverBudget),
    #[error("cannot make its replay arena: {0}")]
    Arena(#[from] batchcast::Error),
    #[error("replayed batch {seq} is not held by this consumer (already released, or never sent)")]
    NotHeld { seq: u64 },
}

/// Why a pipeline thread could not make a replayed batch (that consumer
/// alone is ended with it).
#[derive(Debug, thiserror::Error)]
pub(crate) enum MakeError {
    #[error("samples {first}..{end} of epoch {epoch} lie outside its {len} samples")]
    OutsideEpoch {
        first: u64,
        end: u64,
        epoch: u64,
        len: usize,
    },
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// The memory of its replay arena, kept in the budget for a cut, could
    /// not be allocated at its first replayed batch.
    #[error(
        "the memory of its replay arena, kept in the budget for a cut, could not be allocated ({0}): the host has less free memory than the broker's budget says; resume from its state (state_dict()) once memory is free, or lower the broker's memory budget"
    )]
    Memory(String),
}
