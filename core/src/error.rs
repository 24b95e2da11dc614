//! The core's errors: what a frame, a preamble or a schema's layout can
//! get wrong ([`WireError`]), and the broker's error codes on the wire
//! ([`ErrorCode`]). The client's error type takes each [`WireError`] as
//! its own variant of the same name (`batchcast::Error`).

use serde::{Deserialize, Serialize};

/// Machine-readable error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    VersionMismatch,
    NotBatchcast,
    MalformedFrame,
    FrameTooLarge,
    UnknownStream,
    NotAllowed,
    InvalidRequest,
    /// The consumer fell further behind than the stream's lag limit.
    LagLimit,
    StreamEnded,
    /// The stream's data source failed (a bad file with `on_error = "fail"`,
    /// an unreadable dataset); the message names the file.
    SourceFailed,
    /// A producer asked for a stream name that is already served.
    StreamExists,
    /// A producer's request or batch does not fit its stream's schema.
    SchemaMismatch,
    /// A GPU delivery the broker cannot make (no driver, unknown GPU, a
    /// driver error); the message names the CUDA error.
    DeviceUnavailable,
    Internal,
    /// The broker is at a limit (connections, its own or this uid's
    /// share; the memory budget), or a group seat is held by another
    /// member of the uid: the message names what and who. Worth asking
    /// again later: a reconnecting consumer does, until its
    /// `reconnect_timeout`.
    Busy,
    /// A stats connection asked nothing for the broker's `idle_timeout_s`
    /// and was closed (the client's `StatsClient` reconnects by itself).
    Idle,
    /// Decoupled pace: the consumer kept the pipeline waiting longer than
    /// the stream's `hold_limit_s` (it held batches, or paused while being
    /// replayed to) and was detached (protocol 14).
    HoldLimit,
    /// A consumer resumed (from a checkpoint's state, or reconnecting)
    /// with a digest its stream no longer has: the stream now makes other
    /// data; the message names the parts that changed (protocol 15).
    StreamChanged,
}

/// What bytes from a peer, or a schema, can get wrong before any I/O
/// beyond reading them: each names the culprit.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("socket I/O with the peer failed: {0}")]
    Io(#[from] std::io::Error),
    /// `message` names both releases and which to upgrade.
    #[error("protocol version mismatch: {message}")]
    VersionMismatch {
        ours: u16,
        theirs: u16,
        message: String,
    },
    #[error("the peer is not a batchcast broker (bad preamble {found:02x?})")]
    NotABroker { found: [u8; 4] },
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge { len: u64, max: u64 },
    #[error("malformed frame: {0}")]
    Decode(#[from] postcard::Error),
    #[error("invalid schema or layout: {0}")]
    Schema(String),
    /// Something a peer wrote that no peer of this protocol writes (a
    /// mailbox's record of no known kind, a ring of an impossible size).
    #[error("unexpected message from the broker: {0}")]
    Unexpected(String),
}

pub type Result<T, E = WireError> = std::result::Result<T, E>;
