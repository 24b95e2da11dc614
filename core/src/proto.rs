//! The wire protocol between the broker and its clients: one definition of
//! every message, used by both sides.
//!
//! # Connection
//!
//! 1. Both sides first send an 8-byte [preamble](Preamble): the magic
//!    `BCST`, the protocol version (u16 LE) and two reserved bytes. Each side
//!    checks the other's; a mismatch is reported with both versions before
//!    any message is decoded, so it stays readable across versions.
//! 2. Then frames: a u32 little-endian payload length followed by a
//!    [postcard](https://docs.rs/postcard) payload (a [`ClientMsg`] or a
//!    [`ServerMsg`]). Payloads are limited to [`MAX_FRAME`] bytes.
//! 3. The client's first message is [`ClientMsg::Hello`]. A consumer is
//!    answered with [`ServerMsg::Welcome`], which carries the stream's arena
//!    as a file descriptor (`SCM_RIGHTS`) on the same `sendmsg`; a stats
//!    client with [`ServerMsg::Stats`].
//! 4. A producer ([`Intent::Produce`]) registers a stream of its own. The
//!    broker creates the arena and answers [`ServerMsg::Registered`] with its
//!    fd; the producer maps it writable and asks for a slot with
//!    [`ClientMsg::Acquire`]. That first request tells the broker the
//!    producer's mapping exists: the broker then seals the arena against
//!    every further writable mapping and opens the stream to consumers. Each
//!    [`ServerMsg::Fill`] names a slot and the batch it must hold; the
//!    producer writes it and sends [`ClientMsg::Publish`].
//!
//! Postcard was chosen over bincode 2 because it is maintained, its format
//! is documented and stable, and its varint encoding keeps these small
//! control messages to a few bytes. Tensor bytes never cross the socket.

use serde::{Deserialize, Serialize};

pub use crate::error::ErrorCode;
use crate::error::Result;
use crate::parse::ParseError;
use crate::schema::{RingLayout, Schema, SlotLayout};

mod digest;
mod frame;
mod names;
mod position;
mod preamble;
mod seat;
mod stats;
pub use digest::*;
pub use frame::*;
pub use names::*;
pub use position::*;
pub use preamble::*;
pub use seat::*;
pub use stats::*;

/// Version of this protocol. Bump on any incompatible change to a message;
/// a new protocol comes with a new minor (0.x) or major release, never a
/// patch release, so a release's (major, minor) names its protocol.
pub const PROTOCOL_VERSION: u16 = 28;
/// First four bytes either side sends.
pub const MAGIC: [u8; 4] = *b"BCST";
/// Largest payload either side accepts. Control messages are tiny; the
/// largest is a stats reply for many consumers.
pub const MAX_FRAME: u32 = 1 << 20;

/// How a consumer that arrives mid-stream joins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum JoinPolicy {
    /// Start at the first epoch of which nothing has been published yet, so
    /// every epoch it sees is complete (the default).
    #[default]
    NextEpoch,
    /// Start with the next batch published; the first epoch is reported as
    /// partial.
    Immediate,
    /// Start at once with a complete epoch: the part of the current epoch
    /// already published is recomputed for this consumer alone (replayed),
    /// then it merges into the shared stream. Only streams the broker
    /// computes can replay; an external producer's stream refuses it.
    Now,
}

impl std::str::FromStr for JoinPolicy {
    type Err = ParseError;

    /// `next-epoch`, `immediate` or `now`, as configs and the Python client
    /// write them.
    fn from_str(s: &str) -> Result<JoinPolicy, ParseError> {
        match s {
            "next-epoch" => Ok(JoinPolicy::NextEpoch),
            "immediate" => Ok(JoinPolicy::Immediate),
            "now" => Ok(JoinPolicy::Now),
            _ => Err(ParseError::new(
                "join",
                s,
                "\"next-epoch\" (whole epochs only), \"immediate\" (partial first epoch) or \"now\" (complete first epoch, replayed)",
            )),
        }
    }
}

/// What a consumer gives back: a unit of the shared stream (its `seq`),
/// or one of its replayed batches ([`ReplayReady::seq`]). The two are
/// told apart by this type on every path (a release on the socket, a
/// mailbox's release ring, a notice given back unread), never by a bit of
/// the number (protocol 26).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Unit {
    Shared(u64),
    Replayed(u64),
}

impl Unit {
    /// The shared unit's seq (`None` for a replayed batch).
    pub fn shared(self) -> Option<u64> {
        match self {
            Unit::Shared(seq) => Some(seq),
            Unit::Replayed(_) => None,
        }
    }
}

/// What a consumer asks for, from its hello to the stream that serves it
/// (the broker passes it on as it came).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumeRequest {
    pub stream: String,
    /// Most unreleased batches the program holds at once: on the socket,
    /// the most the broker sends ahead; a mailbox consumer is sent
    /// batches up to the stream's slots and keeps the window itself.
    pub window: u32,
    pub join: JoinPolicy,
    /// `Some`: deliver batches in this GPU's memory (CUDA IPC) instead
    /// of host memory.
    pub device: Option<DeviceRequest>,
    /// Ask for a [mailbox](crate::mailbox): batch notices and releases
    /// in shared memory instead of on the socket (host consumers). The
    /// consumer gives back the notices it never read before its
    /// `Goodbye`.
    pub mailbox: bool,
    /// This consumer's own batch size, `None` for the stream's. Batches
    /// of any size are contiguous views of the stream's rings; the
    /// window counts them.
    pub batch_size: Option<u64>,
    /// Drop each epoch's last batch when it is short; `None`: the
    /// stream's `drop_last` (protocol 14). The stream makes every
    /// sample of every epoch either way.
    pub drop_last: Option<bool>,
    /// Start at this position of the stream (a trainer restarting from
    /// a checkpoint): what the stream already published from there on
    /// is replayed, a position ahead of it is waited for. Overrides
    /// `join`.
    pub resume: Option<Position>,
    /// With `resume`: its epoch is read rotated ([`crate::rotation`]), as
    /// the consumer whose state this is was reading it (protocol 20).
    pub rotation: Option<Box<Rotation>>,
    /// The stream's digest as this consumer was last served it (a
    /// checkpoint's state, a reconnect): the broker refuses the request,
    /// naming the parts that differ, if its stream now makes other data
    /// (protocol 15).
    pub expect: Option<StreamDigest>,
    /// A member of a group (a data-parallel trial's ranks): it reads its
    /// share of each epoch ([`crate::deal`]); the broker checks the seat
    /// (protocol 16).
    pub group: Option<Box<Seat>>,
    /// The client's number for this consumer among its process's
    /// (protocol 19): with the process's pid it names one consumer across
    /// the subscriptions a broker restart makes it take again, so a
    /// watcher (`batchcast launch`) counts what it read once.
    pub serial: u32,
    /// What its program had taken before this subscription (a
    /// reconnect's carried count; zero for a new consumer).
    pub taken: Taken,
}

/// What a consumer's program has taken, as its client counts it
/// (protocol 19): the batches handed out (shared and replayed alike), their
/// samples, and the epoch of the last one. Counted from the client's
/// consumer on, across the subscriptions a broker restart makes it take
/// again. The consumer's own figures: a client that lies about them
/// misleads only about itself (`stats` shows them as its own; the broker
/// acts on none of them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Taken {
    pub batches: u64,
    pub samples: u64,
    pub epoch: u64,
}

impl Taken {
    /// The larger count of each (releases and mailbox words may be read
    /// in either order; a count never goes back).
    pub fn max(self, o: Taken) -> Taken {
        Taken {
            batches: self.batches.max(o.batches),
            samples: self.samples.max(o.samples),
            epoch: self.epoch.max(o.epoch),
        }
    }
}

/// What a client wants from this connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Intent {
    /// Receive the batches of a stream.
    Consume(ConsumeRequest),
    /// Ask for statistics with [`ClientMsg::StatsRequest`].
    Stats,
    /// Register a stream whose batches this client writes.
    Produce(Box<ProduceRequest>),
}

/// What an external producer will publish.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProduceRequest {
    /// The stream's name; no other stream of the broker may have it.
    pub stream: String,
    pub fields: Vec<crate::schema::Field>,
    /// Samples in a full batch; a batch may hold fewer (a short last batch).
    pub batch_size: u64,
    pub batches_per_epoch: u64,
    /// `None`: endless.
    pub epochs: Option<u64>,
    /// Slots of the arena (at least 2).
    pub slots: u32,
    /// Consumers that must subscribe before the first slot is handed out.
    pub min_consumers: u32,
    pub lag_limit: Option<u32>,
    /// The longest a consumer may keep the producer waiting while another
    /// consumer waits for data, in ms, before it is detached (protocol
    /// 18); `None`: the broker's default (30 s).
    pub hold_limit_ms: Option<u64>,
    /// What produces the batches, shown in stats.
    pub description: String,
    /// Class names in label order, if known.
    pub classes: Vec<String>,
    /// Registering again after the broker went away (protocol 16): where
    /// the stream goes on, and for how many of its consumers it waits.
    pub rejoin: Option<Rejoin>,
}

/// A producer registering its stream again under a new broker: the stream
/// starts at batch `index` of `epoch` (the oldest batch the producer still
/// holds: it publishes those again itself), and hands out no slot until
/// `readers` consumers subscribed (as many as it had) or `grace_ms` passed
/// (capped by the broker's `registration_timeout_s`), so that each of them
/// resumes where it was before the stream moves on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejoin {
    pub epoch: u64,
    pub index: u64,
    pub readers: u32,
    pub grace_ms: u32,
}

impl ProduceRequest {
    /// A request with defaults: 4 slots, one consumer, endless, no lag
    /// limit, no description or classes.
    pub fn new(
        stream: impl Into<String>,
        fields: Vec<crate::schema::Field>,
        batch_size: u64,
        batches_per_epoch: u64,
    ) -> ProduceRequest {
        ProduceRequest {
            stream: stream.into(),
            fields,
            batch_size,
            batches_per_epoch,
            epochs: None,
            slots: 4,
            min_consumers: 1,
            lag_limit: None,
            hold_limit_ms: None,
            description: String::new(),
            classes: Vec::new(),
            rejoin: None,
        }
    }
}

/// The GPU a consumer wants its batches on. Named by UUID because ordinals
/// differ between processes (`CUDA_VISIBLE_DEVICES`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRequest {
    pub uuid: [u8; 16],
    /// The consumer's own ordinal and the GPU's name, for messages.
    pub ordinal: u32,
    pub name: String,
}

/// A stream's arena on one GPU, as a consumer opens it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceArena {
    /// How the consumer opens it (protocol 21).
    pub memory: DeviceMemory,
    /// The CUDA IPC memory handle (64 bytes); empty for other memory.
    pub handle: Vec<u8>,
    /// Device slots: a ring of its own, released independently of the
    /// host slots. A device unit's `slot` is one of these: unit `seq` is
    /// in slot `seq mod slots`.
    pub slots: u32,
    /// Its layout (protocol 21): a ring per field, as the host arena's, of
    /// `slots` units; unit `seq`'s samples are at the cells of its stream
    /// position, so a consumer's runs of any batch size are spans of the
    /// rings where they are mirrored. Its `arena_bytes` is the arena's size.
    pub rings: crate::schema::RingLayout,
    /// The GPU, as the broker names it (`cuda:1 NVIDIA H100 (GPU-…)`).
    pub gpu: String,
}

/// What a device arena is made of (protocol 21).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceMemory {
    /// GPU memory exported over CUDA IPC: `DeviceArena::handle`.
    CudaIpc,
    /// The host-memory stand-in for a GPU (`crate::gpu::stand_in`, a
    /// test setting of broker and client alike): a sealed memfd that comes
    /// last among the welcome's fds, mapped read-only.
    StandIn,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// A human-readable name shown in stats (e.g. the trainer's name).
    pub name: String,
    pub pid: u32,
    pub intent: Intent,
}

/// Messages a client sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientMsg {
    Hello(Hello),
    /// The client is done with a batch.
    Release(Release),
    StatsRequest,
    /// Stats connections: `stream` now waits for `min` consumers before it
    /// starts (a launcher whose trainer died before subscribing lowers it
    /// to the trainers still coming); no effect once it has started.
    /// Answered with [`ServerMsg::Stats`].
    SetMinConsumers {
        stream: String,
        min: u32,
    },
    /// The client wants no further batches; the ones it still holds are
    /// released when it releases them or disconnects. From a producer: it
    /// is done (early, unless every epoch was published).
    Goodbye,
    /// A mailbox consumer released a batch while the broker said it waits
    /// for releases: look at its mailbox now.
    Doorbell,
    /// Producer: give me the next slot to fill (answered with
    /// [`ServerMsg::Fill`], or [`ServerMsg::EndOfStream`] once every epoch
    /// has been handed out). At most one request is outstanding.
    Acquire,
    /// Producer: the slot of batch `seq` now holds `samples` valid samples.
    Publish {
        seq: u64,
        samples: u64,
    },
    /// Producer: its source failed; consumers are told `message`.
    Fail {
        message: String,
    },
}

/// A consumer gives batch `seq` back, with the timing of its training loop
/// around it (measured on the consumer's side of `next()`, as DS-Analyzer
/// does: only the wait is data stall).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Release {
    pub unit: Unit,
    /// How long the program was blocked asking for this batch: from its
    /// first call that could return it to its arrival (data stall).
    pub wait_ns: u64,
    /// How long the program worked between the previous batch's arrival
    /// and asking for this one (its training step); 0 for the first batch
    /// of an epoch.
    pub busy_ns: u64,
    /// What its program has taken so far (protocol 19), for `stats`.
    pub taken: Taken,
}

/// Messages the broker sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ServerMsg {
    /// Accepted as a consumer; the arena's fd rides with this frame.
    Welcome(Box<Welcome>),
    Batch(BatchReady),
    EndOfEpoch(EpochEnd),
    /// No more batches will come: the stream's last epoch is done.
    EndOfStream,
    Error(ErrorMsg),
    /// The broker is going away or has dropped this client; no more messages follow.
    Goodbye(GoodbyeReason),
    Stats(Box<StatsReply>),
    /// Accepted as a producer; the arena's fd rides with this frame.
    Registered(Box<Registered>),
    /// Producer: fill `slot` with batch `seq` (`index` of `epoch`).
    Fill(FillSlot),
    /// A replayed batch is ready in this consumer's replay arena.
    Replay(ReplayReady),
    /// Decoupled pace: this consumer fell more than the run-ahead budget
    /// behind and was cut from the shared stream. It drops the batch it
    /// was building (which begins at this position, or the position after
    /// its last batch); batches from here on come replayed, until
    /// [`ServerMsg::Merge`].
    Cut(Position),
    /// Decoupled pace: replay ends at this position (a batch boundary of
    /// this consumer's); the shared stream carries on from there.
    Merge(Position),
    /// Decoupled pace (protocol 20): replay, which stands at the start of
    /// this position's epoch, ends there; the shared stream carries the
    /// epoch on from this position, and the epoch's samples before it
    /// come replayed after its end ([`crate::rotation`]): a `Cut` at the
    /// epoch's start follows the shared stream's `EndOfEpoch`.
    Rotate(Position),
    /// The shared stream's batches from here on are in region `g` of the
    /// host arena (protocol 27): its rings at `g ×`
    /// [`RingLayout::region_bytes`](crate::schema::RingLayout::region_bytes)
    /// into the arena's fd. Batches received before it stay where they
    /// were read (the broker keeps them there until released): a batch a
    /// stopped consumer held past the hold limit was left in the old
    /// region while the ring went on in a new one.
    Arena(u32),
}

/// A batch recomputed for one consumer ([`JoinPolicy::Now`],
/// [`ConsumeRequest::resume`]): `samples` samples of `epoch` from
/// sample `first` on, in its replay arena at ring position
/// `seq × batch_size`. Released as [`Unit::Replayed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayReady {
    pub seq: u64,
    pub epoch: u64,
    pub first: u64,
    pub samples: u64,
    /// The last batch of `epoch` this consumer gets by replay, and the
    /// epoch ends with it (the shared stream does not carry this epoch on
    /// for it).
    pub ends_epoch: bool,
}

/// Replay granted: batches from `from` up to `to` (excluded) are
/// recomputed into a replay arena of the consumer's own (its fd follows
/// the mailbox's, or the arena's), then the shared stream carries on from
/// `to`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayGrant {
    /// The replay arena: rings like the stream's, in units of this
    /// consumer's batch size.
    pub rings: RingLayout,
    pub from: Position,
    pub to: Position,
    /// A device consumer's own arena on its GPU for its replayed batches
    /// (protocol 21): each is copied there before it is sent, at the same
    /// ring position. A stand-in's fd comes after the shared device arena's.
    pub device: Option<DeviceArena>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registered {
    pub stream: String,
    pub schema: Schema,
    /// Where each field of batch `seq` goes: the arena's rings.
    pub rings: RingLayout,
    pub layout: SlotLayout,
    pub slots: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillSlot {
    pub seq: u64,
    pub epoch: u64,
    pub index: u64,
    pub slot: u32,
    /// Consumers subscribed when the slot was handed out (protocol 16): as
    /// many as a producer registering again waits for.
    pub readers: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub consumer_id: u64,
    pub stream: String,
    pub schema: Schema,
    /// The host arena: a ring per field (batch `seq` of the stream holds
    /// samples `seq × batch_size ..` of the rings).
    pub rings: RingLayout,
    /// A device arena's slots (each a whole batch of the stream).
    pub layout: SlotLayout,
    pub slots: u32,
    /// Window granted (the requested one), in this consumer's batches.
    pub window: u32,
    /// This consumer's batch size (granted: the requested one, or the
    /// stream's) and whether it drops an epoch's short last batch.
    pub batch_size: u64,
    pub drop_last: bool,
    /// First epoch this consumer will receive batches of.
    pub start_epoch: u64,
    /// The broker's version string, for diagnostics.
    pub broker: String,
    /// Device consumers: the GPU arena their batches live in (a device
    /// batch's `slot` is one of its slots, copied before the batch is
    /// sent). The host arena's fd still comes first with the welcome; a
    /// stand-in arena's fd comes last.
    pub device: Option<DeviceArena>,
    /// Granted a mailbox: its fd comes after the arena's with this frame,
    /// and batches, epoch ends and the end of the stream arrive there
    /// instead of on the socket.
    pub mailbox: Option<MailboxSpec>,
    /// The uid the stream belongs to: the broker's for a configured stream,
    /// its producer's for a registered one. A trainer that expects its own
    /// data can check it.
    pub owner_uid: u32,
    /// Replay granted (`join = "now"`, or a resume position behind the
    /// stream).
    pub replay: Option<ReplayGrant>,
    /// What the stream's data is made from, digested (protocol 15): a
    /// consumer's state carries it, and a resume names it in `expect`.
    pub digest: StreamDigest,
    /// The host arena's region the shared stream's batches are in now,
    /// and how many regions its fd holds (protocol 27; see
    /// [`ServerMsg::Arena`]).
    pub region: u32,
    pub regions: u32,
}

/// The rings of a consumer's [mailbox](crate::mailbox), in records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MailboxSpec {
    pub notices: u32,
    pub releases: u32,
}

/// A batch is ready in `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchReady {
    /// Position in the stream, increasing by one per batch published.
    pub seq: u64,
    pub epoch: u64,
    /// Position in the epoch, `0..batches_per_epoch`.
    pub index: u64,
    /// A host slot, or for a device consumer a slot of its GPU's arena.
    pub slot: u32,
    /// Valid samples (the batch size, or fewer for a short last batch).
    pub samples: u64,
    /// `CLOCK_MONOTONIC` nanoseconds when the broker handed the batch to
    /// this consumer's connection (for hand-off latency).
    pub sent_ns: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochEnd {
    pub epoch: u64,
    /// Batches this consumer received in that epoch.
    pub batches: u64,
    /// False when the consumer joined after the epoch began.
    pub complete: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GoodbyeReason {
    /// The broker is shutting down (SIGINT/SIGTERM).
    Shutdown,
    /// This consumer was detached (an [`ServerMsg::Error`] said why).
    Detached,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMsg {
    pub code: ErrorCode,
    pub message: String,
}

/// `CLOCK_MONOTONIC` in nanoseconds: comparable across processes on one host.
pub fn monotonic_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always available on Linux");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::WireError;

    #[test]
    fn frames_round_trip() {
        let msg = ClientMsg::Release(Release {
            unit: Unit::Replayed(1 << 40),
            wait_ns: 12,
            busy_ns: 1 << 33,
            taken: Taken {
                batches: 3,
                samples: 96,
                epoch: 1,
            },
        });
        let bytes = encode(&msg).unwrap();
        let mut cursor = std::io::Cursor::new(bytes);
        let mut buf = Vec::new();
        let back: ClientMsg = read_frame(&mut cursor, &mut buf).unwrap().unwrap();
        assert_eq!(back, msg);
        assert!(
            read_frame::<ClientMsg>(&mut cursor, &mut buf)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn oversized_length_prefix_is_rejected_before_allocating() {
        let mut cursor = std::io::Cursor::new(u32::MAX.to_le_bytes().to_vec());
        let err = read_frame::<ClientMsg>(&mut cursor, &mut Vec::new()).unwrap_err();
        assert!(matches!(err, WireError::FrameTooLarge { .. }), "{err}");
    }

    #[test]
    fn truncated_frame_is_an_error_not_a_clean_close() {
        let mut bytes = encode(&ClientMsg::StatsRequest).unwrap();
        bytes.truncate(bytes.len() - 1);
        bytes[0] += 1;
        let mut cursor = std::io::Cursor::new(bytes);
        assert!(read_frame::<ClientMsg>(&mut cursor, &mut Vec::new()).is_err());
    }

    #[test]
    fn preamble_checks_magic_and_version() {
        let ours = Preamble::ours().to_bytes();
        Preamble::parse(ours).unwrap().check().unwrap();
        let mut other = ours;
        other[4] = 99;
        assert!(matches!(
            Preamble::parse(other).unwrap().check(),
            Err(WireError::VersionMismatch { theirs: 99, .. })
        ));
        let back = Preamble::parse(ours).unwrap();
        assert_eq!(back.release, ReleaseLine::OURS);
        assert_eq!(
            ReleaseLine::OURS.to_string(),
            format!(
                "{}.{}",
                env!("CARGO_PKG_VERSION_MAJOR"),
                env!("CARGO_PKG_VERSION_MINOR")
            )
        );
        assert!(matches!(
            Preamble::parse(*b"GET / HT"),
            Err(WireError::NotABroker { .. })
        ));
    }

    /// The advice names both releases and protocols, always upgrades the
    /// side with the older protocol, and never names a downgrade.
    #[test]
    fn a_mismatch_names_both_releases_and_what_to_upgrade() {
        let old = Preamble {
            version: 12,
            release: ReleaseLine::UNKNOWN,
        };
        let next = ReleaseLine {
            major: ReleaseLine::OURS.major,
            minor: ReleaseLine::OURS.minor + 1,
        };
        let new = Preamble {
            version: PROTOCOL_VERSION + 1,
            release: next,
        };
        let ours = Preamble::ours();
        // A newer broker: the client upgrades, to the broker's line.
        let m = mismatch(ours, new, Side::Client);
        assert!(
            m.contains(&format!(
                "the client is batchcast {} (protocol {PROTOCOL_VERSION})",
                ReleaseLine::OURS
            )),
            "{m}"
        );
        assert!(
            m.contains(&format!(
                "the broker batchcast {next} (protocol {})",
                PROTOCOL_VERSION + 1
            )),
            "{m}"
        );
        assert!(
            m.contains("upgrade the client") && m.contains(&next.pip_spec()),
            "{m}"
        );
        // The same pair seen from the broker gives the same advice.
        let b = mismatch(new, ours, Side::Broker);
        assert_eq!(m, b);
        // An older broker (before the preamble carried releases): upgrade
        // it, and nothing says to install the old release on the client.
        let m = mismatch(ours, old, Side::Client);
        assert!(
            m.contains("the broker batchcast 0.1 or earlier (protocol 12)"),
            "{m}"
        );
        assert!(
            m.contains("upgrade the broker") && m.contains(&ReleaseLine::OURS.pip_spec()),
            "{m}"
        );
        assert!(!m.contains("batchcast<0.2"), "a downgrade: {m}");
        // A peer claiming a newer protocol with an older release line (a
        // forged or broken preamble): no release is named to install.
        let forged = Preamble {
            version: PROTOCOL_VERSION + 1,
            release: ReleaseLine::UNKNOWN,
        };
        let m = mismatch(ours, forged, Side::Broker);
        assert!(m.contains("upgrade the broker"), "{m}");
        assert!(
            !m.contains("pip install"),
            "names a release to install: {m}"
        );
        assert!(
            m.contains(&format!("speaks protocol {}", PROTOCOL_VERSION + 1)),
            "{m}"
        );
    }

    #[test]
    fn garbage_payload_is_a_decode_error() {
        assert!(decode::<ClientMsg>(&[0xff, 0xff, 0xff]).is_err());
    }
}
