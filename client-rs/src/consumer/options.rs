//! How a consumer connects and what it asks for ([`ConsumerOptions`]).

use std::path::PathBuf;
use std::time::Duration;

use super::ConsumerState;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::options::env_var;
use crate::proto::{JoinPolicy, Position, Seat, SeatError};
use crate::transport::program_name;

/// How to connect. `Default` reads each option's environment variable
/// named in [`crate::options::CONSUMER_OPTIONS`] (and below); its fields
/// are that table's Rust rows, in order (a test checks).
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// The stream to subscribe to.
    pub stream: String,
    /// The broker's socket; `None` for [`crate::default_socket_path`].
    pub socket: Option<PathBuf>,
    /// Most batches the program may hold (received, not released) at once,
    /// ≥ 1: it gets no more until it releases one. (A mailbox consumer is
    /// sent batches ahead of that; they wait in its mailbox, and are given
    /// back unread when it leaves.)
    pub window: u32,
    pub join: JoinPolicy,
    /// The name shown in `batchcast stats`.
    pub name: String,
    /// How long to keep retrying while the broker is not up yet or the
    /// stream is not registered yet (a producer still starting). Zero: fail
    /// at once. Default: `$BATCHCAST_CONNECT_TIMEOUT` seconds, else zero.
    pub connect_timeout: Duration,
    /// Where batches are delivered: host memory, or a GPU's memory (the
    /// broker copies each batch once per GPU; see [`Batch::device_ptr`](crate::Batch::device_ptr)).
    /// Default: `$BATCHCAST_DEVICE`, else `cpu`.
    pub device: Device,
    /// The uid the broker must run as; a socket served by anyone else is
    /// refused ([`Error::Impostor`]). `None`: `$BATCHCAST_BROKER_UID`, else
    /// this process's own uid.
    pub broker_uid: Option<u32>,
    /// This consumer's batch size: `None` for the stream's. Any size from
    /// 1 to what the stream's slots hold with this window (the broker says
    /// the limit when asked for more) is served without a copy: each field
    /// of a batch is one contiguous view of the stream's ring. Default:
    /// `$BATCHCAST_BATCH_SIZE`, else the stream's.
    pub batch_size: Option<u64>,
    /// Drop each epoch's last batch when it is short (fewer than
    /// `batch_size` samples), as `DataLoader(drop_last=True)` does.
    /// `None`: the stream's `drop_last` (false unless its config says).
    /// Either way the stream makes every sample of the epoch: what is
    /// dropped is this consumer's choice alone.
    pub drop_last: Option<bool>,
    /// Start at this position of the stream instead of joining (a trainer
    /// restarting from a checkpoint saved with [`Batch::next_position`](crate::Batch::next_position)):
    /// what the stream already published from there is replayed (streams
    /// the broker computes), a position ahead of it is waited for.
    pub resume: Option<Position>,
    /// Resume from a checkpoint's [`ConsumerState`]
    /// ([`Consumer::state`](crate::Consumer::state)): its stream (in place
    /// of `stream`), position, batch size and `drop_last` (unless
    /// `batch_size` or `drop_last` are set here: a resume may regroup the
    /// same samples), and the stream's digest, which the broker checks.
    /// Not with `resume`.
    pub state: Option<ConsumerState>,
    /// When the broker goes away (killed, restarted, shut down; also while
    /// this consumer subscribes): how long to wait for it to come back and
    /// go on from this consumer's next position, the batches it holds
    /// still readable. Zero: fail at once
    /// with [`Error::BrokerGone`]. Default: `$BATCHCAST_RECONNECT_TIMEOUT`
    /// seconds, else [`DEFAULT_RECONNECT_TIMEOUT`].
    pub reconnect_timeout: Duration,
    /// A seat in a group: the ranks of one data-parallel trial split each
    /// epoch among them ([`crate::deal`]: every rank as many batches, each
    /// sample once across the group), while every other consumer of the
    /// stream still receives everything. The group's members share one
    /// batch size. Default: with `$BATCHCAST_GROUP` set, that group, the
    /// rank and world from the environment ([`group_from_env`]).
    pub group: Option<Seat>,
    /// Host consumers: take batch notices and give releases back through
    /// a [mailbox](crate::mailbox) in shared memory instead of the socket,
    /// which saves the broker two system calls per batch. Default: on,
    /// unless `$BATCHCAST_MAILBOX` is `0`.
    pub mailbox: bool,
    /// Mailbox consumers: how long to poll for the next batch before
    /// sleeping (a sleeper costs the broker a wake-up system call). The
    /// poll yields the CPU between looks. Default: `$BATCHCAST_SPIN_US`
    /// microseconds, else 50.
    pub spin: Duration,
}

impl ConsumerOptions {
    /// Checks what can be checked before connecting: bindings call it (via
    /// [`Consumer::connect`](crate::Consumer::connect)) rather than repeating the rules.
    pub fn validate(&self) -> Result<()> {
        // A variable set wrong is named first: it may be what set a value.
        check_env()?;
        if self.window == 0 {
            return Err(Error::InvalidOption(
                "window must be at least 1 (batches held at once)".into(),
            ));
        }
        if self.state.is_some() && self.resume.is_some() {
            return Err(Error::InvalidOption(
                "give a state or a resume position, not both (a state carries its position)".into(),
            ));
        }
        if self.batch_size == Some(0) {
            return Err(Error::InvalidOption(
                "batch_size must be at least 1 (or unset for the stream's)".into(),
            ));
        }
        crate::proto::check_peer_name(&self.name)
            .map_err(|e| Error::InvalidOption(format!("name={:?}: {e}", self.name)))?;
        if let Some(seat) = &self.group {
            seat.validate()
                .map_err(|e| Error::InvalidOption(e.to_string()))?;
        } else if let Ok(name) = std::env::var(env_var("group"))
            && !name.is_empty()
            && let Err(why) = group_from_env(&name)
        {
            // The default found no seat there: say why, rather than read
            // the whole stream as a plain consumer.
            return Err(Error::InvalidOption(format!(
                "$BATCHCAST_GROUP={name:?}: {why}"
            )));
        }
        Ok(())
    }
}

/// The environment's defaults, checked: a variable set to what its option
/// does not accept is refused, naming it, rather than left for the default
/// silently (`BATCHCAST_RECONNECT_TIMEOUT=1m` is not 60 s).
fn check_env() -> Result<()> {
    let refuse = |name: &str, value: &str, accepts: &str| {
        Err(Error::InvalidOption(format!(
            "${}={value:?} is not {accepts} (the default of option `{name}`): set it right or unset it",
            env_var(name)
        )))
    };
    let seconds_ok = |v: &str| v.parse::<f64>().is_ok_and(|s| s.is_finite() && s >= 0.0);
    for name in [
        "join",
        "name",
        "connect_timeout",
        "device",
        "mailbox",
        "broker_uid",
        "spin",
        "batch_size",
        "reconnect_timeout",
    ] {
        let Some(v) = env(name) else { continue };
        let ok = match name {
            "join" => v.parse::<JoinPolicy>().is_ok(),
            "name" => crate::proto::check_peer_name(&v).is_ok(),
            "connect_timeout" | "reconnect_timeout" => seconds_ok(&v),
            "device" => v.parse::<Device>().is_ok(),
            "mailbox" => v == "0" || v == "1",
            "broker_uid" => v.trim().parse::<u32>().is_ok(),
            "spin" => v.parse::<u64>().is_ok(),
            "batch_size" => v.parse::<u64>().is_ok_and(|n| n >= 1),
            _ => true,
        };
        if !ok {
            let accepts = match name {
                "spin" => "a number of microseconds",
                "mailbox" => "0 or 1",
                _ => crate::options::option(name).accepts,
            };
            return refuse(name, &v, accepts);
        }
    }
    Ok(())
}

/// Option `name`'s environment variable ([`crate::options`]), if set and
/// not empty.
fn env(name: &str) -> Option<String> {
    std::env::var(env_var(name)).ok().filter(|v| !v.is_empty())
}

impl Default for ConsumerOptions {
    /// The defaults of [`crate::options::CONSUMER_OPTIONS`], each read
    /// from its environment variable where it has one.
    fn default() -> Self {
        ConsumerOptions {
            socket: None,
            stream: env("stream").unwrap_or_else(|| "train".into()),
            window: 2,
            join: env("join")
                .and_then(|v| v.parse().ok())
                .unwrap_or(JoinPolicy::NextEpoch),
            name: env("name").unwrap_or_else(|| program_name("consumer")),
            connect_timeout: seconds(env_var("connect_timeout"), Duration::ZERO),
            device: env("device")
                .and_then(|d| d.parse().ok())
                .unwrap_or_default(),
            mailbox: env("mailbox").is_none_or(|v| v != "0"),
            broker_uid: None,
            spin: Duration::from_micros(env("spin").and_then(|v| v.parse().ok()).unwrap_or(50)),
            batch_size: env("batch_size").and_then(|v| v.parse().ok()),
            drop_last: None,
            resume: None,
            state: None,
            reconnect_timeout: seconds(env_var("reconnect_timeout"), DEFAULT_RECONNECT_TIMEOUT),
            group: env("group").and_then(|g| group_from_env(&g).ok()),
        }
    }
}

/// How long a consumer waits for its broker to come back, unless told
/// otherwise: long enough for a broker to restart (systemd restarts one in
/// a second or two), short enough that a trainer whose broker is gone for
/// good says so within a minute.
pub const DEFAULT_RECONNECT_TIMEOUT: Duration = Duration::from_secs(60);

/// `$key` as a number of seconds ≥ 0; `default` when unset or not one.
pub(crate) fn seconds(key: &str, default: Duration) -> Duration {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(default)
}

/// A seat in group `name` with the rank and world a launcher set in the
/// environment: torchrun's `LOCAL_RANK` and `LOCAL_WORLD_SIZE`, else
/// Slurm's `SLURM_LOCALID` and `SLURM_NTASKS_PER_NODE` (its first count,
/// for a value like `4(x2)`). The ranks on this host split its stream:
/// the host's share of the dataset is the stream's (`rank`/`world_size`
/// in its config). The error names what is missing.
pub fn group_from_env(name: &str) -> std::result::Result<Seat, SeatError> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let number = |k: &str| -> std::result::Result<Option<u32>, SeatError> {
        let Some(v) = var(k) else { return Ok(None) };
        let digits: String = v.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().map(Some).map_err(|_| SeatError::NotACount {
            var: k.into(),
            value: v.clone(),
        })
    };
    let (rank, world) = match (number("LOCAL_RANK")?, number("LOCAL_WORLD_SIZE")?) {
        (Some(r), Some(w)) => (r, w),
        _ => match (number("SLURM_LOCALID")?, number("SLURM_NTASKS_PER_NODE")?) {
            (Some(r), Some(w)) => (r, w),
            _ => return Err(SeatError::NoRank { name: name.into() }),
        },
    };
    let seat = Seat {
        name: name.into(),
        rank,
        world,
        replicate: 1,
    };
    seat.validate()?;
    Ok(seat)
}
