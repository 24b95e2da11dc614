//! The rules every stream's keys follow, whatever its source, and the
//! bounds of every number: a value out of range is refused with the key,
//! its limit and why the limit is there.

use std::collections::HashSet;

use batchcast::proto::MailboxSpec;
use batchcast::schema::Field;

use super::{StreamError, key, mem_total_bytes};
use crate::config::{BrokerSection, Pace, StreamConfig};

/// Most slots of a stream: each mailbox consumer may owe every one of them.
pub(crate) const MAX_SLOTS: u32 = MailboxSpec::MAX_BATCHES;
/// Most samples in a batch.
pub(crate) const MAX_BATCH_SIZE: u64 = 1 << 20;
/// Most pipeline threads of a stream (each has its own stack and decoder).
pub(crate) const MAX_WORKERS: usize = 256;
/// Most consumers a stream may wait for (the broker serves 1,024
/// connections at once by default).
pub(crate) const MAX_MIN_CONSUMERS: u32 = 1024;
/// Most samples of a synthetic dataset (its order takes 8 bytes a sample
/// per epoch).
pub(crate) const MAX_SYNTHETIC_LEN: u64 = 1 << 27;
/// Most samples a tar shuffle buffer holds.
pub(crate) const MAX_SHUFFLE_BUFFER: usize = 1_000_000;
/// Largest output side of a transform, in pixels.
pub(crate) const MAX_SIDE: u32 = 16384;
/// Largest `max_pixels` (an image's width × height).
pub(crate) const MAX_PIXELS: u64 = 1 << 32;
/// Most hosts a dataset is split over.
pub(crate) const MAX_WORLD_SIZE: u64 = 1 << 20;
/// Largest `max_file_bytes`.
pub(crate) const MAX_FILE_BYTES: u64 = 1 << 32;
/// Most batches in an external producer's epoch.
pub(crate) const MAX_BATCHES_PER_EPOCH: u64 = 1 << 40;
/// Most connections a broker serves (each is a file descriptor and a task).
pub const MAX_CONNECTIONS: u64 = 65536;
/// Longest `idle_timeout_s`: a day.
pub(crate) const MAX_IDLE_S: u64 = 86400;
/// The `[broker]` defaults.
pub(crate) const DEFAULT_MAX_CONNECTIONS: u64 = 1024;
pub(crate) const DEFAULT_MAX_CONNECTIONS_PER_UID: u64 = 128;
pub(crate) const DEFAULT_IDLE_S: u64 = 60;
pub(crate) const DEFAULT_REGISTRATION_TIMEOUT_S: u64 = 30;
pub(crate) const DEFAULT_GUEST_PREFIX: &str = "{user}.";
/// The smallest memory budget: the frame buffers of a few connections and
/// a small arena.
pub(crate) const MIN_MEMORY_MIB: u64 = 64;
/// The budget where the host's memory cannot be read: 4 GiB.
const DEFAULT_MEMORY_MIB_UNKNOWN_RAM: u64 = 4096;

/// The `[broker]` section's numbers within their bounds.
/// `allow_gids` with `allow_groups`' names looked up on this host; a name
/// it does not know is refused by name.
fn allowed_gids(b: &BrokerSection) -> Result<Vec<u32>, StreamError> {
    let mut gids = b.allow_gids.clone();
    for name in &b.allow_groups {
        match nix::unistd::Group::from_name(name) {
            Ok(Some(g)) => gids.push(g.gid.as_raw()),
            Ok(None) => {
                return Err(super::key(
                    "allow_groups",
                    format!(
                        "allow_groups: this host has no group named `{name}` (`getent group {name}` finds none): create it (`groupadd --system {name}`) and add the trainers' users to it, or list the group's number in allow_gids"
                    ),
                ));
            }
            Err(e) => {
                return Err(super::key(
                    "allow_groups",
                    format!("allow_groups: looking up group `{name}` failed: {e}"),
                ));
            }
        }
    }
    gids.sort_unstable();
    gids.dedup();
    Ok(gids)
}

pub(super) fn check_broker(b: &BrokerSection) -> Result<super::BrokerPlan, StreamError> {
    let max = b.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS);
    within(
        "max_connections",
        max,
        16,
        MAX_CONNECTIONS,
        "connections served at once, each a file descriptor",
    )?;
    let per_uid = b
        .max_connections_per_uid
        .unwrap_or(DEFAULT_MAX_CONNECTIONS_PER_UID.min(max - max / 4));
    within(
        "max_connections_per_uid",
        per_uid,
        1,
        max - max / 4,
        "connections of one user other than the broker's; all of them together may hold three quarters of max_connections",
    )?;
    let idle = b.idle_timeout_s.unwrap_or(DEFAULT_IDLE_S);
    within(
        "idle_timeout_s",
        idle,
        1,
        MAX_IDLE_S,
        "seconds a stats connection may ask nothing",
    )?;
    let ram_mib = mem_total_bytes().map_or(DEFAULT_MEMORY_MIB_UNKNOWN_RAM * 2, |b| b >> 20);
    let memory = b.memory_mib.unwrap_or(ram_mib / 2);
    within(
        "memory_mib",
        memory,
        MIN_MEMORY_MIB,
        ram_mib,
        "MiB of this host's memory the broker may allocate for clients",
    )?;
    let register = b
        .registration_timeout_s
        .unwrap_or(DEFAULT_REGISTRATION_TIMEOUT_S);
    within(
        "registration_timeout_s",
        register,
        1,
        MAX_IDLE_S,
        "seconds a producer's registration may wait for its first Acquire",
    )?;
    let prefix = b
        .guest_stream_prefix
        .clone()
        .unwrap_or_else(|| DEFAULT_GUEST_PREFIX.into());
    let bare = prefix.replace("{user}", "").replace("{uid}", "");
    if !bare
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(super::key(
            "guest_stream_prefix",
            format!(
                "guest_stream_prefix = \"{prefix}\": stream names use only letters, digits, `-`, `_` and `.` (plus the placeholders {{user}} and {{uid}})"
            ),
        ));
    }
    Ok(super::BrokerPlan {
        threads: host_threads(b.max_cpu_share)?,
        allow_gids: allowed_gids(b)?,
        guest_stream_prefix: prefix,
        max_connections: max as usize,
        max_connections_per_uid: per_uid as usize,
        idle_timeout: std::time::Duration::from_secs(idle),
        memory_bytes: memory << 20,
        registration_timeout: std::time::Duration::from_secs(register),
    })
}

/// `key = value` must lie in `lo..=hi`; the error names the key, the limit
/// and why it is there.
pub(super) fn within<T: PartialOrd + std::fmt::Display>(
    key: &'static str,
    value: T,
    lo: T,
    hi: T,
    why: &str,
) -> Result<(), StreamError> {
    if !(value >= lo && value <= hi) {
        return Err(StreamError::Key {
            key,
            message: format!("{key} = {value} is out of range: use {lo} to {hi} ({why})"),
        });
    }
    Ok(())
}

pub(super) fn check_name(name: &str) -> Result<(), StreamError> {
    if name.is_empty()
        || name.len() > batchcast::proto::MAX_NAME_BYTES
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(key(
            "name",
            format!(
                "name must be 1 to {} characters, only letters, digits, `-`, `_` and `.`",
                batchcast::proto::MAX_NAME_BYTES
            ),
        ));
    }
    Ok(())
}

/// Checks the keys every stream has, whatever its source: batching, slots
/// and flow control.
pub(super) fn check_flow(
    batch_size: u64,
    epochs: Option<u64>,
    slots: u32,
    gpu_slots: Option<u32>,
    lag_limit: Option<u32>,
    min_consumers: u32,
) -> Result<(), StreamError> {
    if batch_size == 0 {
        return Err(key("batch_size", "batch_size must be at least 1"));
    }
    within(
        "batch_size",
        batch_size,
        1,
        MAX_BATCH_SIZE,
        "samples in one batch",
    )?;
    if epochs == Some(0) {
        return Err(key(
            "epochs",
            "epochs must be at least 1 (omit it for an endless stream)",
        ));
    }
    if slots < 2 {
        return Err(key(
            "slots",
            format!(
                "slots = {slots} is too few: at least 2 so the pipeline can fill one while consumers read another"
            ),
        ));
    }
    if slots > MAX_SLOTS {
        return Err(key(
            "slots",
            format!(
                "slots = {slots} is too many: at most {MAX_SLOTS} (a consumer's mailbox has room for every slot's batch)"
            ),
        ));
    }
    if min_consumers == 0 {
        return Err(key("min_consumers", "min_consumers must be at least 1"));
    }
    within(
        "min_consumers",
        min_consumers,
        1,
        MAX_MIN_CONSUMERS,
        "the broker serves 1024 connections at once",
    )?;
    if let Some(g) = gpu_slots {
        if g < 2 {
            return Err(key(
                "gpu_slots",
                format!(
                    "gpu_slots = {g} is too few: at least 2 so one batch can be copied while consumers read another"
                ),
            ));
        }
        within(
            "gpu_slots",
            g,
            2,
            MAX_SLOTS,
            "device slots of one GPU's ring",
        )?;
    }
    if let Some(lag) = lag_limit
        && (lag == 0 || lag >= slots)
    {
        return Err(key(
            "lag_limit",
            format!(
                "lag_limit = {lag} must be between 1 and slots - 1 ({}); a consumer can never lag by {slots} or more",
                slots - 1
            ),
        ));
    }
    Ok(())
}

/// `pace` and `run_ahead_mib` go together, and not with a lag limit.
pub(super) fn check_pace(s: &StreamConfig) -> Result<(), StreamError> {
    for (name, v) in [
        ("hold_limit_s", s.hold_limit_s),
        ("held_batch_limit_s", s.held_batch_limit_s),
    ] {
        if let Some(h) = v
            && h != f64::INFINITY
            && !(0.1..=86_400.0).contains(&h)
        {
            return Err(key(
                name,
                format!(
                    "{name} = {h} is out of range: use 0.1 to 86400 (seconds a consumer may keep the others waiting), or inf for no bound"
                ),
            ));
        }
    }
    if let (Some(hold), Some(held)) = (s.hold_limit_s, s.held_batch_limit_s)
        && held < hold
    {
        return Err(key(
            "held_batch_limit_s",
            format!(
                "held_batch_limit_s = {held} is less than hold_limit_s = {hold}: one holding the batch needed next is waited for at least as long as any other; raise it or leave it out"
            ),
        ));
    }
    // On a decoupled stream a consumer `lag_limit` would detach is cut
    // instead.
    match (s.pace, s.run_ahead_mib) {
        (Pace::Lockstep | Pace::Auto, Some(_)) => Err(key(
            "run_ahead_mib",
            "run_ahead_mib applies to pace = \"decoupled\" only; a lockstep stream's memory is set by slots",
        )),
        _ => Ok(()),
    }
}

/// The slots `run_ahead_mib` MiB hold, each unit of `slot_bytes`.
pub(super) fn run_ahead_slots(mib: u64, slot_bytes: u64) -> Result<u32, StreamError> {
    let slots = mib.saturating_mul(1 << 20) / slot_bytes.max(1);
    let need_mib = (2 * slot_bytes).div_ceil(1 << 20);
    if slots < 2 {
        return Err(key(
            "run_ahead_mib",
            format!(
                "run_ahead_mib = {mib} holds fewer than 2 batches of {:.1} KiB: give at least {need_mib}",
                slot_bytes as f64 / 1024.0
            ),
        ));
    }
    if slots > u64::from(MAX_SLOTS) {
        return Err(key(
            "run_ahead_mib",
            format!(
                "run_ahead_mib = {mib} holds {slots} batches, more than {MAX_SLOTS}: give at most {}",
                (u64::from(MAX_SLOTS) * slot_bytes) >> 20
            ),
        ));
    }
    Ok(slots as u32)
}

/// The bounds of a configured stream's other numeric keys.
pub(super) fn check_limits(s: &StreamConfig) -> Result<(), StreamError> {
    if let Some(w) = s.workers {
        within(
            "workers",
            w,
            1,
            MAX_WORKERS,
            "pipeline threads; more than the host's cores only adds overhead",
        )?;
    }
    within(
        "max_pixels",
        s.max_pixels,
        1,
        MAX_PIXELS,
        "the largest width × height decoded",
    )?;
    within(
        "max_file_bytes",
        s.max_file_bytes,
        1,
        MAX_FILE_BYTES,
        "the largest encoded sample read",
    )?;
    if let Some(total) = mem_total_bytes() {
        for (key, mib) in [
            ("cache_mib", s.cache_mib),
            ("decoded_cache_mib", s.decoded_cache_mib),
        ] {
            if let Some(mib) = mib {
                within(key, mib, 0, total >> 20, "MiB of this host's memory")?;
            }
        }
    }
    if let Some(side) = s.decoded_side {
        within(
            "decoded_side",
            u64::from(side),
            16,
            65_535,
            "pixels on a kept image's longer side",
        )?;
        if s.decoded_cache_mib == Some(0) {
            return Err(StreamError::Key {
                key: "decoded_side",
                message: format!(
                    "decoded_side = {side} keeps decoded images at that size, but decoded_cache_mib is 0 (no cache of decoded images): set decoded_cache_mib (or leave it out for the broker to size), or remove decoded_side"
                ),
            });
        }
    }
    within(
        "world_size",
        s.world_size,
        1,
        MAX_WORLD_SIZE,
        "hosts the dataset is split over",
    )?;
    Ok(())
}

/// Field names are distinct and non-empty; no dimension is zero.
pub(super) fn check_fields(fields: &[Field]) -> Result<(), StreamError> {
    let mut seen = HashSet::new();
    for f in fields {
        if f.name.is_empty() {
            return Err(StreamError::Field("a field has an empty name".into()));
        }
        if !seen.insert(&f.name) {
            return Err(StreamError::Field(format!(
                "field `{}` is listed twice",
                f.name
            )));
        }
        if f.shape.contains(&0) {
            return Err(StreamError::Field(format!(
                "field `{}` has a zero dimension in its shape {:?}",
                f.name, f.shape
            )));
        }
    }
    Ok(())
}

/// A bound in seconds from the config: its default when absent, `None`
/// for `inf`.
pub(super) fn seconds(s: Option<f64>, default: std::time::Duration) -> Option<std::time::Duration> {
    match s {
        None => Some(default),
        Some(h) if h.is_finite() => Some(std::time::Duration::from_secs_f64(h)),
        Some(_) => None,
    }
}

/// A producer's stream name and description, checked.
pub(super) fn check_producer_text(
    req: &batchcast::proto::ProduceRequest,
) -> Result<(), StreamError> {
    check_name(&req.stream)?;
    batchcast::proto::check_text(
        "the producer's description",
        &req.description,
        batchcast::proto::MAX_DESCRIPTION_BYTES,
        "a shorter description",
    )
    .map_err(|e| key("description", e.to_string()))
}

/// A producer's `hold_limit_ms`, checked, or the default.
pub(super) fn producer_hold_limit(
    req: &batchcast::proto::ProduceRequest,
) -> Result<std::time::Duration, StreamError> {
    let Some(ms) = req.hold_limit_ms else {
        return Ok(super::DEFAULT_HOLD_LIMIT);
    };
    within(
        "hold_limit_ms",
        ms,
        100,
        86_400_000,
        "milliseconds a consumer may keep the producer waiting",
    )?;
    Ok(std::time::Duration::from_millis(ms))
}

/// With `workers` left out, the most of the host's cores the pipeline
/// threads of every such stream take together (`[broker]
/// max_cpu_share`): half, leaving the trainers the rest (a loader's CPU
/// kept near 40 % of a GPU host's in SPDL's guidance).
pub const DEFAULT_MAX_CPU_SHARE: f64 = 0.5;

/// The pipeline threads `[broker] max_cpu_share` allows the streams that
/// leave `workers` out, all together: that share of the host's cores, at
/// least one.
pub(super) fn host_threads(share: Option<f64>) -> Result<usize, StreamError> {
    let share = share.unwrap_or(DEFAULT_MAX_CPU_SHARE);
    if !(share > 0.0 && share <= 1.0) {
        return Err(StreamError::Key {
            key: "max_cpu_share",
            message: format!(
                "max_cpu_share = {share}: the share of the host's cores the pipeline threads may take is above 0 and at most 1"
            ),
        });
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok(((cores as f64 * share).floor() as usize).max(1))
}
