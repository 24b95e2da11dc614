//! The client library's error type (the broker's error codes on the wire
//! are the core's, re-exported). It names only leaf modules (dtypes,
//! devices, parse errors, CUDA), so every other module may use it without
//! an import circle.

use std::path::PathBuf;
use std::time::Duration;

use crate::device::Device;
use crate::dtype::DType;
use crate::parse::ParseError;

pub use batchcast_core::ErrorCode;

/// Everything that can go wrong talking to a broker.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "cannot connect to the batchcast broker at {path}: {source}; is `batchcast serve` running, and is BATCHCAST_SOCKET or --socket pointing at its socket?"
    )]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The socket is there but this user may not open it (its mode, or
    /// its folder's): the broker never sees the attempt, so this is the
    /// only place to say why.
    #[error(
        "you (uid {me}) may not open the broker's socket {path} ({what}): a broker admits only its own user unless its config's [broker] allow_uids, allow_gids or allow_groups names yours, and then it opens the socket to others itself (mode 0666; peer credentials still decide). Ask the broker's owner to add you there, or run a broker of your own (`batchcast serve`) and point BATCHCAST_SOCKET or --socket at it"
    )]
    Denied {
        path: PathBuf,
        /// The socket's mode and owner, or why its folder keeps this user out.
        what: String,
        me: u32,
    },
    #[error(
        "the broker at {path} accepted the connection but did not answer within {waited:?}: it may be overloaded or stuck (`batchcast stats` shows its connections); raise connect_timeout to wait longer"
    )]
    HandshakeTimeout { path: PathBuf, waited: Duration },
    #[error(
        "the socket {path} is served by a process of uid {uid}, not uid {expected}: it may be an impostor, so nothing was sent. If a broker run by uid {uid} is the one you want, set BATCHCAST_BROKER_UID={uid} (ConsumerOptions::broker_uid in Rust)"
    )]
    Impostor {
        path: PathBuf,
        uid: u32,
        expected: u32,
    },
    #[error("socket I/O with the broker failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the broker closed the connection (it exited or was killed)")]
    BrokerGone,
    /// The broker said it is shutting down (SIGTERM or SIGINT): like
    /// [`Error::BrokerGone`], a consumer that may reconnect waits for the
    /// next one.
    #[error("the broker is shutting down (it said goodbye: Shutdown)")]
    BrokerShutdown,
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
    #[error("broker error ({code:?}): {message}")]
    Broker { code: ErrorCode, message: String },
    #[error("unexpected message from the broker: {0}")]
    Unexpected(String),
    #[error("invalid schema or layout: {0}")]
    Schema(String),
    #[error("shared memory: {0}")]
    Shm(String),
    #[error("field `{name}` is not in this stream; it has: {available}")]
    NoSuchField { name: String, available: String },
    #[error("field `{name}` has dtype {actual}, not {requested}")]
    DType {
        name: String,
        actual: DType,
        requested: DType,
    },
    #[error(
        "you hold {held} unreleased batches, the whole window; drop or release one before asking for the next (or connect with a larger window)"
    )]
    WindowFull { held: u32 },
    #[error(
        "you still hold a batch of the stream's unit {seq}, {slots} units ago: the stream's {slots} slots are a ring, \
         and no newer batch can be made until it is released; drop or release old batches (copy what you keep)"
    )]
    RingPinned { seq: u64, slots: u32 },
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// A name that is not a dtype, device or join policy.
    #[error(transparent)]
    Parse(#[from] ParseError),
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
    /// A device was asked for that this build or host cannot serve.
    #[error("{0}")]
    Device(String),
    #[error(
        "batch {seq} is in GPU memory ({device}) and has no host view: the broker gives its host slot back once the copy to the GPU is done. Read it on the GPU, copy it with Batch::copy_field, or subscribe with device=\"cpu\""
    )]
    OnDevice { seq: u64, device: Device },
}

impl Error {
    /// Whether this says the broker went away (killed, restarted, shut
    /// down) rather than refused or detached this client.
    pub fn broker_went_away(&self) -> bool {
        match self {
            Error::BrokerGone | Error::BrokerShutdown => true,
            Error::Io(io) => matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::UnexpectedEof
            ),
            _ => false,
        }
    }

    /// Whether a client waiting for its broker to come back tries again
    /// after this: the old broker still closing, the new one not listening
    /// or not ready yet (socket activation queues a connection until the
    /// new broker accepts it, which may outlast one handshake).
    pub(crate) fn while_restarting(&self) -> bool {
        self.broker_went_away()
            || self.is_not_ready()
            || matches!(self, Error::HandshakeTimeout { .. })
    }

    /// True for errors that go away by themselves when a job starts up: no
    /// broker listening yet, or the stream not registered yet.
    pub fn is_not_ready(&self) -> bool {
        match self {
            Error::Connect { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ),
            Error::Broker { code, .. } => *code == ErrorCode::UnknownStream,
            _ => false,
        }
    }

    /// The broker's error code, when the broker sent one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Broker { code, .. } => Some(*code),
            Error::VersionMismatch { .. } => Some(ErrorCode::VersionMismatch),
            _ => None,
        }
    }
}

/// Each of the core's errors is the variant of the same name.
impl From<batchcast_core::WireError> for Error {
    fn from(e: batchcast_core::WireError) -> Error {
        use batchcast_core::WireError as W;
        match e {
            W::Io(io) => Error::Io(io),
            W::VersionMismatch {
                ours,
                theirs,
                message,
            } => Error::VersionMismatch {
                ours,
                theirs,
                message,
            },
            W::NotABroker { found } => Error::NotABroker { found },
            W::FrameTooLarge { len, max } => Error::FrameTooLarge { len, max },
            W::Decode(d) => Error::Decode(d),
            W::Schema(s) => Error::Schema(s),
            W::Unexpected(s) => Error::Unexpected(s),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
