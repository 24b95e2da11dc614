//! Datasets where they live: image folders and tar shards in S3 (and
//! S3-compatible stores), GCS, Azure Blob and on HTTP servers.
//!
//! A remote dataset is listed once (`crate::pipeline::dataset`'s `remote`) into the same flat list of
//! items a local one has, so order, sharding, replay, join and resume are
//! unchanged: the bytes of item `i` are the same from every form of the
//! dataset. What differs is how bytes arrive:
//!
//! * **Units.** A fetch is a *unit*: a whole object (image folders), or a
//!   part of a shard of `part_mib` (a range request). A tar member is cut
//!   from the parts it spans.
//! * **Read-ahead** ([`ahead`]): the pipeline tells the dataset where it
//!   reads ([`RemoteSet::want`]); the units of the next samples are fetched
//!   by concurrent requests, bounded in count and bytes (the bytes taken
//!   from the broker's memory budget), and a read waits only for a unit
//!   still in flight. A read outside the window (replay, a joiner's first
//!   batch) fetches just what it needs.
//! * **Disk tier** ([`disk`]): units as fetched, checksummed, under
//!   `cache_dir`; later epochs and restarted brokers fetch only the rest.
//! * **Faults** ([`fetch`]): timeouts, retries with jittered backoff, AIMD
//!   on 429/503; a read that fails for good is a bad sample, handled by
//!   `on_error` with its URL.

pub mod ahead;
pub mod disk;
pub mod fetch;
mod gate;
pub mod listing;
pub(crate) mod redact;
pub mod runs;
mod store;
pub mod url;

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use batchcast::proto::RemoteSourceStats;
use bytes::Bytes;

pub use ahead::Unit;
use ahead::{Ahead, Taken};
use disk::DiskCache;
use fetch::{FetchError, Fetcher, Limits};
use runs::runs;
pub(crate) use store::{CROSS_HOST, open_store};

/// How a remote dataset is read (`[stream.remote]`, planned).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub limits: Limits,
    /// Samples fetched or held ahead of the pipeline, at most.
    pub(crate) read_ahead: u32,
    /// Their bytes, at most (taken from the broker's memory budget).
    pub(crate) read_ahead_bytes: u64,
    /// A shard's range requests, at most.
    pub(crate) part_bytes: u64,
    pub cache_dir: Option<PathBuf>,
    pub(crate) cache_dir_bytes: u64,
    /// A listing in the disk tier younger than this is used instead of
    /// listing again (zero: always list).
    pub(crate) listing_max_age: Duration,
    /// The store's address where not the default (see `RemoteConfig`).
    pub endpoint: Option<String>,
    /// Unsigned requests (public buckets).
    pub anonymous: bool,
    /// A whole object's bytes, at most (the source's `max_file_bytes`):
    /// a larger answer is refused before it is read.
    pub(crate) max_object_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error(transparent)]
    Url(#[from] url::UrlError),
    #[error("{url}: cannot open the store: {message}; credentials come from {hint}")]
    Store {
        url: String,
        message: String,
        hint: &'static str,
    },
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Disk(#[from] disk::DiskCacheError),
}

/// One object of a remote dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    /// Its path in the store.
    pub path: String,
    /// Its size, where the listing said (a manifest does not).
    pub size: Option<u64>,
    /// Its ETag (or last-modified time) where the store gave one: part of
    /// its disk-cache key, so a changed object is fetched again.
    pub version: String,
}

/// The objects of a remote dataset and how their bytes are read.
#[derive(Debug)]
pub struct RemoteSet {
    fetcher: Arc<Fetcher>,
    pub(crate) objects: Vec<Object>,
    /// `None`: units are whole objects (image folders), taken once read;
    /// else shard parts of this many bytes, kept while the window wants
    /// them.
    part_bytes: Option<u64>,
    ahead: Ahead,
    /// The window's bytes, taken from the broker's memory budget once
    /// (the streams of a shared source share the window).
    grant: std::sync::Mutex<Option<crate::budget::Grant>>,
    read_ahead_bytes: u64,
    max_object_bytes: u64,
    /// Versions of objects listed without one (a manifest), as first read.
    pins: std::sync::Mutex<std::collections::HashMap<u32, String>>,
    disk: Option<DiskCache>,
    waited_ns: AtomicU64,
    ahead_hits: AtomicU64,
    direct: AtomicU64,
}

impl RemoteSet {
    pub fn new(
        fetcher: Arc<Fetcher>,
        objects: Vec<Object>,
        part_bytes: Option<u64>,
        settings: &Settings,
        disk: Option<DiskCache>,
    ) -> RemoteSet {
        RemoteSet {
            fetcher,
            objects,
            part_bytes,
            ahead: Ahead::new(settings.read_ahead, settings.read_ahead_bytes),
            grant: std::sync::Mutex::new(None),
            read_ahead_bytes: settings.read_ahead_bytes,
            max_object_bytes: settings.max_object_bytes,
            pins: std::sync::Mutex::default(),
            disk,
            waited_ns: AtomicU64::new(0),
            ahead_hits: AtomicU64::new(0),
            direct: AtomicU64::new(0),
        }
    }

    /// Takes the read-ahead window's bytes from the broker's budget, once.
    pub(crate) fn reserve(
        &self,
        budget: &Arc<crate::budget::Budget>,
        uid: u32,
        whom: &str,
    ) -> Result<(), crate::budget::OverBudget> {
        let mut g = self.grant.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() && self.read_ahead_bytes > 0 {
            *g = Some(budget.take(
                uid,
                crate::budget::Use::Arena,
                self.read_ahead_bytes,
                &format!("{whom} (remote.read_ahead_mib)"),
            )?);
        }
        Ok(())
    }

    /// The URL of object `o`, for messages.
    pub fn describe(&self, o: u32) -> String {
        self.fetcher
            .url
            .with_path(&self.objects[o as usize].path)
            .to_string()
    }

    pub fn url(&self) -> String {
        self.fetcher.url.to_string()
    }

    /// Ends every wait and request (the stream stops).
    pub fn close(&self) {
        self.fetcher.close();
        self.ahead.close();
    }

    /// Units of the bytes `range` of object `o` (a tar member), or of the
    /// object (whole), with their size (0: unknown).
    pub(crate) fn unit_of(&self, o: u32, range: Option<Range<u64>>) -> (Unit, u64) {
        match range {
            Some(r) => (Unit::range(o, r.clone()), r.end.saturating_sub(r.start)),
            None => (Unit::whole(o), self.objects[o as usize].size.unwrap_or(0)),
        }
    }

    fn disk_key(&self, u: Unit) -> String {
        let o = &self.objects[u.object as usize];
        let range = u
            .bytes()
            .map_or("whole".to_string(), |r| format!("{}-{}", r.start, r.end));
        format!(
            "{}\n{}\n{}\n{:?}\n{range}",
            self.fetcher.url.root, o.path, o.version, o.size
        )
    }

    /// Part `i` of shard `o` (its index reads shards part by part, and
    /// the disk tier keeps parts), by the size its listing gave, which the
    /// store may have lied about: each part's answer is checked against
    /// the range asked for.
    pub fn part(&self, o: u32, i: u64) -> Option<Unit> {
        let p = self.part_bytes?;
        let size = self.objects[o as usize].size?;
        let start = i.checked_mul(p)?;
        (start < size).then(|| Unit::range(o, start..(start + p).min(size)))
    }

    /// Members' bytes (by offset, as a run holds them) from the shard
    /// parts the disk tier holds them in, `None` for each it does not
    /// hold whole: each part is read (and checked) once for all its
    /// members in a row, not once per member, and a member spanning parts
    /// is put together from them.
    fn members_on_disk(&self, units: &[Unit]) -> Vec<Option<Bytes>> {
        let (Some(disk), Some(p)) = (self.disk.as_ref(), self.part_bytes) else {
            return vec![None; units.len()];
        };
        // The last two parts read: a spanning member's two, or one's.
        let mut held: Vec<(Unit, Option<Bytes>)> = Vec::with_capacity(2);
        let mut part_on_disk = |part: Unit| {
            if let Some((_, b)) = held.iter().find(|(q, _)| *q == part) {
                return b.clone();
            }
            let b = disk.get(&self.disk_key(part));
            if held.len() == 2 {
                held.remove(0);
            }
            held.push((part, b.clone()));
            b
        };
        let mut cut = |u: Unit| {
            let r = u.bytes()?;
            if r.is_empty() {
                return Some(Bytes::new());
            }
            let (first, last) = (r.start / p, (r.end - 1) / p);
            let mut out = Vec::with_capacity(usize::try_from(r.end - r.start).ok()?);
            for i in first..=last {
                let part = self.part(u.object, i)?;
                let pr = part.bytes()?;
                let b = part_on_disk(part)?;
                let lo = usize::try_from(r.start.max(pr.start) - pr.start).ok()?;
                let hi = usize::try_from(r.end.min(pr.end) - pr.start).ok()?;
                out.extend_from_slice(b.get(lo..hi)?);
            }
            Some(Bytes::from(out))
        };
        units.iter().map(|&u| cut(u)).collect()
    }

    /// Fetches unit `u`: from the disk tier (a whole object or part as
    /// kept, a member from its part), else the store; whole objects and
    /// parts are then kept on disk.
    pub(crate) async fn fetch_unit(self: Arc<Self>, u: Unit) -> Result<Bytes, FetchError> {
        let kept = self.disk.is_some() && (u.bytes().is_none() || self.is_part(u));
        if self.disk.is_some() {
            let me = self.clone();
            let hit = tokio::task::spawn_blocking(move || {
                if kept {
                    me.disk.as_ref().and_then(|d| d.get(&me.disk_key(u)))
                } else {
                    me.members_on_disk(&[u]).pop().flatten()
                }
            })
            .await
            .ok()
            .flatten();
            if let Some(b) = hit {
                return Ok(b);
            }
        }
        let bytes = self.get_listed(u.object, u.bytes()).await?;
        if kept {
            let me = self.clone();
            let b = bytes.clone();
            let _ = tokio::task::spawn_blocking(move || {
                if let Some(d) = &me.disk {
                    d.put(&me.disk_key(u), &b);
                }
            })
            .await;
        }
        Ok(bytes)
    }

    fn is_part(&self, u: Unit) -> bool {
        match (self.part_bytes, u.bytes()) {
            (Some(p), Some(r)) => r.start % p == 0 && self.part(u.object, r.start / p) == Some(u),
            _ => false,
        }
    }

    /// Fetches members `run` (of one shard, by offset, close together)
    /// with one range request; each member's bytes are copied out, so a
    /// member read late does not keep the others' bytes alive. Those the
    /// disk tier holds come from there.
    async fn fetch_run(self: Arc<Self>, run: Vec<Unit>) -> Vec<(Unit, Result<Bytes, FetchError>)> {
        let mut out = Vec::with_capacity(run.len());
        let mut missing = Vec::with_capacity(run.len());
        if self.disk.is_some() {
            let me = self.clone();
            let units = run.clone();
            let found = tokio::task::spawn_blocking(move || {
                let found = me.members_on_disk(&units);
                units.into_iter().zip(found).collect::<Vec<_>>()
            })
            .await
            // The disk tier failed us: every member from the store.
            .unwrap_or_else(|_| run.into_iter().map(|u| (u, None)).collect());
            for (u, hit) in found {
                match hit {
                    Some(b) => out.push((u, Ok(b))),
                    None => missing.push(u),
                }
            }
        } else {
            missing = run;
        }
        let (Some(first), Some(last)) = (missing.first(), missing.last()) else {
            return out;
        };
        let span = first.start..last.end;
        match self.get_listed(first.object, Some(span.clone())).await {
            Ok(b) => out.extend(missing.into_iter().map(|u| {
                let cut = b
                    .get((u.start - span.start) as usize..(u.end - span.start) as usize)
                    .map(Bytes::copy_from_slice);
                (u, cut.ok_or_else(|| self.short(u, b.len())))
            })),
            Err(e) => out.extend(missing.into_iter().map(|u| (u, Err(e.clone())))),
        }
        out
    }

    fn short(&self, u: Unit, got: usize) -> FetchError {
        FetchError {
            url: self.describe(u.object),
            kind: fetch::FailKind::Refused,
            detail: format!(
                "a range answer of {got} bytes, short of {}..{}",
                u.start, u.end
            ),
        }
    }

    /// The bytes `range` of object `o` from the store, if it is still
    /// the version listed: a replaced object is an error (the dataset
    /// changed under the stream), never other bytes.
    async fn get_listed(&self, o: u32, range: Option<Range<u64>>) -> Result<Bytes, FetchError> {
        let obj = &self.objects[o as usize];
        let (bytes, meta) = self
            .fetcher
            .get(&obj.path, range, self.max_object_bytes)
            .await?;
        // A manifest lists no versions: the first read's is pinned, so an
        // object replaced later fails its reads (for this broker's life)
        // rather than give a replay, a joiner or a resumed trainer other
        // bytes than the epoch began with.
        let (listed, same) = if obj.version.is_empty() {
            let now = fetch::version_of(&meta);
            let mut pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
            let pinned = pins.entry(o).or_insert_with(|| now.clone()).clone();
            let same = pinned == now;
            (pinned, same)
        } else {
            (
                obj.version.clone(),
                fetch::same_version(&obj.version, &meta),
            )
        };
        if !same {
            return Err(FetchError {
                url: self.fetcher.url.with_path(&obj.path).to_string(),
                kind: fetch::FailKind::Changed,
                detail: redact::store_text(&format!(
                    "{listed} {}, {} now",
                    if obj.version.is_empty() {
                        "when first read (a manifest lists no versions)"
                    } else {
                        "listed"
                    },
                    fetch::version_of(&meta)
                )),
            });
        }
        Ok(bytes)
    }

    /// How many units the window holds at most.
    pub(crate) fn read_ahead_units(&self) -> usize {
        self.ahead.max_units()
    }

    /// The size shard `o` was listed with.
    pub(crate) fn listed_size(&self, o: u32) -> Option<u64> {
        self.objects[o as usize].size
    }

    /// The pipeline reads at `lead` (a position in its sequence) and
    /// after it: `upcoming[k]` is the unit (and size) of the sample at
    /// `lead + k`. Fetch what the window has room for.
    pub fn want(self: &Arc<Self>, lead: u64, upcoming: &[(Unit, u64)]) {
        let start = self.ahead.admit(lead, upcoming);
        for run in runs(start, self.part_bytes.unwrap_or(0)) {
            let me = self.clone();
            fetch::runtime().spawn(async move {
                if let [u] = run[..]
                    && u.bytes().is_none()
                {
                    let r = me.clone().fetch_unit(u).await;
                    me.ahead.settle(u, r);
                    return;
                }
                for (u, r) in me.clone().fetch_run(run).await {
                    me.ahead.settle(u, r);
                }
            });
        }
    }

    /// The bytes `range` of object `o` (all of it for `None`) into `buf`:
    /// from the window (waiting for them while on their way), else the
    /// disk tier, else a request for just those bytes.
    pub fn read(
        self: &Arc<Self>,
        o: u32,
        range: Option<Range<u64>>,
        buf: &mut Vec<u8>,
        max_bytes: u64,
    ) -> std::io::Result<()> {
        buf.clear();
        if let Some(r) = &range {
            check_size(r.end.saturating_sub(r.start), max_bytes)?;
        }
        let (u, _) = self.unit_of(o, range);
        let t0 = Instant::now();
        let taken = self.ahead.take(u);
        let waited = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.waited_ns.fetch_add(waited, Ordering::Relaxed);
        let bytes = match taken {
            Taken::Ready(b) => {
                self.ahead_hits.fetch_add(1, Ordering::Relaxed);
                b
            }
            Taken::Failed(e) => return Err(e.into()),
            Taken::Absent => {
                self.direct.fetch_add(1, Ordering::Relaxed);
                let me = self.clone();
                fetch::wait(async move { me.fetch_unit(u).await })?
            }
        };
        check_size(bytes.len() as u64, max_bytes)?;
        buf.extend_from_slice(&bytes);
        Ok(())
    }

    /// What `stats` shows of this dataset (`source.remote`).
    pub fn counts(&self) -> RemoteSourceStats {
        let c = &self.fetcher.counts;
        let (units, bytes) = self.ahead.held();
        let d = self.disk.as_ref().map(|d| d.counts()).unwrap_or_default();
        RemoteSourceStats {
            url: self.url(),
            requests: c.requests.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            retries: c.retries.load(Ordering::Relaxed),
            throttled: c.throttled.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            in_flight: c.in_flight.load(Ordering::Relaxed),
            concurrency: self.fetcher.concurrency(),
            longest_s: c.longest_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            waited_s: self.waited_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            ahead_hits: self.ahead_hits.load(Ordering::Relaxed),
            direct: self.direct.load(Ordering::Relaxed),
            ahead_units: units,
            ahead_bytes: bytes,
            last_error: c
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            disk_hits: d.hits,
            disk_misses: d.misses,
            disk_bytes: d.bytes,
            disk_budget: d.budget,
            disk_corrupt: d.corrupt,
            disk_write_errors: d.write_errors,
        }
    }
}

/// Refuses a sample of more than `max_bytes` (the source's `max_file_bytes`).
pub(crate) fn check_size(len: u64, max_bytes: u64) -> std::io::Result<()> {
    if len > max_bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{len} bytes, more than max_file_bytes = {max_bytes}; raise it if such files are real samples"
            ),
        ));
    }
    Ok(())
}
