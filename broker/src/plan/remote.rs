//! Planning how a remote dataset is read: `[stream.remote]`'s keys
//! checked into [`Settings`]. A table with a local dataset is refused (it
//! would do nothing).

use std::time::Duration;

use super::StreamError;
use super::checks::within;
use crate::config::{RemoteConfig, StreamConfig};
use crate::remote::Settings;
use crate::remote::fetch::Limits;
use crate::remote::url::{RemoteUrl, Scheme};

/// Most requests in flight for one dataset.
pub(crate) const MAX_REQUESTS: u32 = 256;
/// Most units in the read-ahead window.
pub(crate) const MAX_READ_AHEAD: u32 = 65_536;

/// The settings of a stream whose dataset is at a URL.
pub(super) fn settings(s: &StreamConfig, url: &RemoteUrl) -> Result<Settings, StreamError> {
    let r = s.remote.clone().unwrap_or_default();
    check(&r)?;
    if r.endpoint.is_some() && url.scheme == Scheme::Http {
        return Err(super::key(
            "remote.endpoint",
            "remote.endpoint names the server of an s3://, gs:// or az:// dataset; an http(s):// dataset's URL is its server: remove the key",
        ));
    }
    let secs = |v: f64| Duration::from_secs_f64(v);
    Ok(Settings {
        limits: Limits {
            requests: r.requests,
            timeout: secs(r.timeout_s),
            retries: r.retries,
            stall: secs(r.stall_s),
        },
        read_ahead: r.read_ahead,
        read_ahead_bytes: r.read_ahead_mib.saturating_mul(1 << 20),
        part_bytes: r.part_mib.saturating_mul(1 << 20),
        cache_dir: r.cache_dir.clone(),
        cache_dir_bytes: r.cache_dir_mib.saturating_mul(1 << 20),
        listing_max_age: secs(r.listing_max_age_s),
        endpoint: r.endpoint.clone(),
        anonymous: r.anonymous,
        max_object_bytes: s.max_file_bytes,
    })
}

fn check(r: &RemoteConfig) -> Result<(), StreamError> {
    within(
        "remote.requests",
        r.requests,
        1,
        MAX_REQUESTS,
        "requests in flight at once",
    )?;
    within(
        "remote.read_ahead",
        r.read_ahead,
        0,
        MAX_READ_AHEAD,
        "objects or parts fetched ahead; 0 = off",
    )?;
    within(
        "remote.read_ahead_mib",
        r.read_ahead_mib,
        0,
        1 << 20,
        "MiB fetched ahead; 0 = off",
    )?;
    within(
        "remote.part_mib",
        r.part_mib,
        1,
        1024,
        "MiB per range request of a shard",
    )?;
    within("remote.retries", r.retries, 0, 100, "tries after the first")?;
    within(
        "remote.timeout_s",
        r.timeout_s,
        0.01,
        3600.0,
        "seconds one request may take",
    )?;
    within(
        "remote.stall_s",
        r.stall_s,
        r.timeout_s.min(3600.0),
        86_400.0,
        "seconds one read may take with its retries; at least timeout_s",
    )?;
    within(
        "remote.listing_max_age_s",
        r.listing_max_age_s,
        0.0,
        365.0 * 86_400.0,
        "seconds a listing in the disk tier is used for; 0 = always list",
    )?;
    if r.cache_dir_mib > 0 && r.cache_dir.is_none() {
        return Err(super::key(
            "remote.cache_dir_mib",
            "remote.cache_dir_mib is set without remote.cache_dir: name the folder",
        ));
    }
    if let Some(e) = &r.endpoint
        && (e.contains('@') || e.contains('?'))
    {
        return Err(super::key(
            "remote.endpoint",
            "remote.endpoint holds a user, password or query: credentials go in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)",
        ));
    }
    if let Some(e) = &r.endpoint
        && !(e.starts_with("http://") || e.starts_with("https://"))
    {
        return Err(super::key(
            "remote.endpoint",
            format!("remote.endpoint = \"{e}\" must be an http:// or https:// URL"),
        ));
    }
    Ok(())
}
