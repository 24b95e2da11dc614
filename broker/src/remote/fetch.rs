//! Requests to a store: each bounded by a timeout, retried with backoff
//! and full jitter, within a stall bound. How many run at once finds what
//! the store sustains: it starts at 8 (`gate::START_REQUESTS`) and doubles each
//! window of successes (slow start) up to `requests`; a 429 or 503 (S3's
//! SlowDown), a reset connection or a timeout halves it, and successes
//! then win it back one by one (AIMD). `object_store`'s own retries are
//! off: they would hide each 503 from the rate control and can take
//! minutes. While requests are retried, the log says so at most every
//! `WARN_EVERY` (the pipeline may be waiting for the store).

use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectMeta, ObjectStore};
use tokio::sync::Notify;

use super::gate::{Gate, Outcome};
use super::redact::store_text;
use super::url::RemoteUrl;
use batchcast::synthetic::{SplitMix64, mix64};

/// An object's version as listings keep it: its ETag (quotes and a weak
/// marker dropped, as stores differ there between listings and reads),
/// else `mtime:` and its last-modified time.
pub(crate) fn version_of(m: &ObjectMeta) -> String {
    match &m.e_tag {
        Some(e) => etag(e).to_string(),
        None => format!("mtime:{}", m.last_modified.to_rfc3339()),
    }
}

fn etag(e: &str) -> &str {
    e.trim_start_matches("W/").trim_matches('"')
}

/// Whether what a read answered is the version listed: by ETag, where
/// both have one (last-modified times differ in precision between a
/// listing and a read, so they are not compared).
pub(crate) fn same_version(listed: &str, read: &ObjectMeta) -> bool {
    match &read.e_tag {
        Some(e) if !listed.is_empty() && !listed.starts_with("mtime:") => etag(e) == listed,
        _ => true,
    }
}

/// How requests are bounded (from `[stream.remote]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Requests in flight at once, at most.
    pub requests: u32,
    /// One request, from send to its last byte.
    pub timeout: Duration,
    /// Tries after the first.
    pub retries: u32,
    /// The longest one read may take, its retries and waits included.
    pub stall: Duration,
}

/// Why a request failed, with the address (never a credential).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{url}: {kind}: {detail}")]
pub struct FetchError {
    pub url: String,
    pub kind: FailKind,
    pub(crate) detail: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailKind {
    /// 404: the object is not there.
    Missing,
    /// 401/403: the credentials do not allow it.
    Denied,
    /// Still failing (5xx, resets, timeouts, 503 SlowDown) when the tries
    /// or the stall bound ran out.
    GaveUp,
    /// Refused for good (another 4xx).
    Refused,
    /// The broker is shutting the stream down.
    Closed,
    /// The object's ETag is not the one listed: it was replaced.
    Changed,
    /// The answer is larger than a sample may be (`max_file_bytes`) or
    /// than the range asked for: refused before its bytes are read.
    TooLarge,
}

impl std::fmt::Display for FailKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FailKind::Missing => "no such object",
            FailKind::Denied => "access denied (check the credentials in the environment)",
            FailKind::GaveUp => "gave up",
            FailKind::Refused => "refused",
            FailKind::Closed => "stream stopping",
            FailKind::Changed => {
                "changed since it was listed (restart the broker to list the dataset again)"
            }
            FailKind::TooLarge => "answer too large",
        })
    }
}

impl From<FetchError> for std::io::Error {
    fn from(e: FetchError) -> Self {
        let kind = match e.kind {
            FailKind::Missing => std::io::ErrorKind::NotFound,
            FailKind::Denied => std::io::ErrorKind::PermissionDenied,
            FailKind::GaveUp => std::io::ErrorKind::TimedOut,
            FailKind::Refused | FailKind::Changed | FailKind::TooLarge => {
                std::io::ErrorKind::InvalidData
            }
            FailKind::Closed => std::io::ErrorKind::Interrupted,
        };
        std::io::Error::new(kind, e)
    }
}

/// What one try's failure means for the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Permanent(FailKind),
    /// 429 or 503: slow down, then try again.
    Throttled,
    Transient,
}

/// Why one try failed: the store client's error, or an answer refused
/// here (too large, cut short) with what it means for the next try.
#[derive(Debug)]
enum TryError {
    Store(object_store::Error),
    Answer(Verdict, String),
}

impl From<object_store::Error> for TryError {
    fn from(e: object_store::Error) -> Self {
        TryError::Store(e)
    }
}

/// Reads `object_store`'s error: its kind where it has one, else the
/// status its message carries (the retry error type is not public).
fn judge(e: &object_store::Error) -> Verdict {
    use object_store::Error as E;
    match e {
        E::NotFound { .. } => return Verdict::Permanent(FailKind::Missing),
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => {
            return Verdict::Permanent(FailKind::Denied);
        }
        _ => {}
    }
    let text = error_chain(e);
    if text.contains(super::CROSS_HOST) || text.contains("error following redirect") {
        return Verdict::Permanent(FailKind::Refused);
    }
    if text.contains("SlowDown") {
        return Verdict::Throttled;
    }
    match status_in(&text) {
        Some(429 | 503) => Verdict::Throttled,
        Some(408) => Verdict::Transient,
        Some(404) => Verdict::Permanent(FailKind::Missing),
        Some(401 | 403) => Verdict::Permanent(FailKind::Denied),
        Some(s) if (400..500).contains(&s) => Verdict::Permanent(FailKind::Refused),
        _ => Verdict::Transient,
    }
}

/// An error's message with its sources' (a redirect refused by the
/// client is said in a source, not in the store's message).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut at = e.source();
    while let Some(s) = at {
        let said = s.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        at = s.source();
    }
    text
}

fn status_in(text: &str) -> Option<u16> {
    let at = text.find("status code: ")? + "status code: ".len();
    text.get(at..at + 3)?.parse().ok()
}

/// Counters of one store's requests (`stats`).
#[derive(Debug, Default)]
pub struct Counts {
    pub requests: AtomicU64,
    pub bytes: AtomicU64,
    pub retries: AtomicU64,
    pub throttled: AtomicU64,
    pub failed: AtomicU64,
    pub(crate) in_flight: AtomicU64,
    /// The longest one read took, its retries included (ns).
    pub(crate) longest_ns: AtomicU64,
    pub last_error: Mutex<Option<String>>,
}

/// Longest between two log lines saying a store's requests are retried.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(10);

/// One store, and how its requests are made.
#[derive(Debug)]
pub struct Fetcher {
    store: Arc<dyn ObjectStore>,
    pub url: RemoteUrl,
    limits: Limits,
    gate: Gate,
    pub counts: Counts,
    closed: AtomicBool,
    closing: Notify,
    /// When the log last said requests are retried.
    warned: Mutex<Option<Instant>>,
}

impl Fetcher {
    pub fn new(store: Arc<dyn ObjectStore>, url: RemoteUrl, limits: Limits) -> Fetcher {
        Fetcher {
            store,
            url,
            gate: Gate::new(limits.requests),
            limits,
            counts: Counts::default(),
            closed: AtomicBool::new(false),
            closing: Notify::new(),
            warned: Mutex::new(None),
        }
    }

    /// Says in the log, at most every [`WARN_EVERY`], that requests to
    /// this store fail and are retried: the pipeline may be waiting for it.
    fn warn_waiting(&self, what: &str) {
        {
            let mut w = self.warned.lock().unwrap_or_else(|p| p.into_inner());
            if w.is_some_and(|t| t.elapsed() < WARN_EVERY) {
                return;
            }
            *w = Some(Instant::now());
        }
        tracing::warn!(
            store = %self.url,
            retries = self.counts.retries.load(Ordering::Relaxed),
            throttled = self.counts.throttled.load(Ordering::Relaxed),
            requests_at_once = self.gate.limit(),
            "{what}; the pipeline may wait for the store: fewer requests at once are tried, down to what it sustains ([stream.remote] requests sets the most; `batchcast stats` shows its counts)"
        );
    }

    /// Ends every wait and request: the stream is stopping.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.closing.notify_waiters();
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// How many requests may run at once now.
    pub fn concurrency(&self) -> u32 {
        self.gate.limit()
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    fn error(&self, path: &str, kind: FailKind, detail: String) -> FetchError {
        FetchError {
            url: self.url.with_path(path).to_string(),
            kind,
            detail,
        }
    }

    /// The bytes of `path` (`range` of them, or all of at most
    /// `max_bytes`), with its ETag. Nothing the store says is trusted for
    /// an allocation: an answer declaring more than that is refused before
    /// its body is read, and a body is read in the chunks it comes in,
    /// ended as soon as it passes the bound (a store can declare one
    /// length and send another).
    pub async fn get(
        &self,
        path: &str,
        range: Option<Range<u64>>,
        max_bytes: u64,
    ) -> Result<(Bytes, ObjectMeta), FetchError> {
        let location = ObjectPath::parse(path)
            .map_err(|e| self.error(path, FailKind::Refused, e.to_string()))?;
        let opts = || GetOptions {
            range: range.clone().map(GetRange::Bounded),
            ..GetOptions::default()
        };
        let store = &self.store;
        let asked = range.as_ref().map(|r| r.end.saturating_sub(r.start));
        let (b, meta) = self
            .tried(path, || async {
                let r = store.get_opts(&location, opts()).await?;
                let meta = r.meta.clone();
                let declared = r.range.end.saturating_sub(r.range.start);
                if let Some(verdict) = oversized(declared, asked, max_bytes) {
                    return Err(verdict);
                }
                let body = bounded_body(r.into_stream(), declared).await?;
                Ok((body, meta))
            })
            .await?;
        self.counts
            .bytes
            .fetch_add(b.len() as u64, Ordering::Relaxed);
        Ok((b, meta))
    }

    /// What `path` is (size, ETag) without its bytes.
    pub async fn head(&self, path: &str) -> Result<ObjectMeta, FetchError> {
        let location = ObjectPath::parse(path)
            .map_err(|e| self.error(path, FailKind::Refused, e.to_string()))?;
        let store = &self.store;
        self.tried(path, || async {
            let r = store
                .get_opts(
                    &location,
                    GetOptions {
                        head: true,
                        ..GetOptions::default()
                    },
                )
                .await?;
            Ok(r.meta)
        })
        .await
    }

    /// Every object under `prefix` (a whole listing is one try).
    pub async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, FetchError> {
        let location = ObjectPath::parse(prefix.trim_end_matches('/'))
            .map_err(|e| self.error(prefix, FailKind::Refused, e.to_string()))?;
        let store = &self.store;
        self.tried(prefix, || async {
            let mut out = Vec::new();
            let mut s = store.list(Some(&location));
            while let Some(m) = s.next().await {
                out.push(m?);
            }
            Ok(out)
        })
        .await
    }

    /// Runs `attempt` until it succeeds, fails for good, or the tries or
    /// the stall bound run out.
    async fn tried<T, F, Fut>(&self, path: &str, attempt: F) -> Result<T, FetchError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, TryError>>,
    {
        let started = Instant::now();
        let deadline = started + self.limits.stall;
        let mut rng = SplitMix64::new(
            mix64(
                started.elapsed().as_nanos() as u64
                    ^ (path.len() as u64)
                    ^ std::process::id() as u64,
            ) ^ mix64(self.counts.requests.load(Ordering::Relaxed)),
        );
        let mut tries = 0u32;
        let result = loop {
            if self.is_closed() {
                break Err(self.error(path, FailKind::Closed, "the stream stopped".into()));
            }
            let outcome = self.try_once(&attempt, deadline).await;
            let (verdict, detail) = match outcome {
                Ok(v) => break Ok(v),
                Err((v, d)) => (v, d),
            };
            if let Verdict::Permanent(kind) = verdict {
                break Err(self.error(path, kind, detail));
            }
            if verdict == Verdict::Throttled {
                self.counts.throttled.fetch_add(1, Ordering::Relaxed);
            }
            let backoff = backoff(tries, verdict, &mut rng);
            if tries >= self.limits.retries || Instant::now() + backoff >= deadline {
                let detail = format!(
                    "{detail} (after {} tries in {:.1} s; bounds: retries = {}, stall_s = {}, timeout_s = {} a try)",
                    tries + 1,
                    started.elapsed().as_secs_f64(),
                    self.limits.retries,
                    self.limits.stall.as_secs_f64(),
                    self.limits.timeout.as_secs_f64(),
                );
                break Err(self.error(path, FailKind::GaveUp, detail));
            }
            tries += 1;
            self.counts.retries.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(path, tries, ?backoff, "retrying: {detail}");
            self.warn_waiting(&format!(
                "requests to the store fail and are retried ({detail})"
            ));
            self.nap(backoff).await;
        };
        let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.counts.longest_ns.fetch_max(took, Ordering::Relaxed);
        if let Err(e) = &result
            && e.kind != FailKind::Closed
        {
            self.counts.failed.fetch_add(1, Ordering::Relaxed);
            *self
                .counts
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        }
        result
    }

    /// One try, through the gate, within the request timeout.
    async fn try_once<T, F, Fut>(
        &self,
        attempt: &F,
        deadline: Instant,
    ) -> Result<T, (Verdict, String)>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, TryError>>,
    {
        // Waiting for a request slot counts against the stall bound: when
        // the gate has narrowed to a store that keeps requests waiting, a
        // read queued behind others gives up at `stall_s` like one whose
        // tries fail, instead of waiting its turn for as long as it takes.
        let ticket = tokio::select! {
            t = self.gate.enter() => t,
            _ = tokio::time::sleep_until(deadline.into()) => return Err((
                Verdict::Transient,
                format!(
                    "no request slot within stall_s = {:.1} (the store keeps requests waiting)",
                    self.limits.stall.as_secs_f64()
                ),
            )),
            _ = self.closing.notified() => return Err((Verdict::Transient, "the stream stopped".into())),
        };
        self.counts.requests.fetch_add(1, Ordering::Relaxed);
        self.counts.in_flight.fetch_add(1, Ordering::Relaxed);
        let r = tokio::select! {
            r = tokio::time::timeout(self.limits.timeout, attempt()) => match r {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(TryError::Store(e))) => Err((judge(&e), store_text(&error_chain(&e)))),
                Ok(Err(TryError::Answer(v, d))) => Err((v, d)),
                Err(_) => Err((
                    Verdict::Transient,
                    format!("no answer within timeout_s = {:.1}", self.limits.timeout.as_secs_f64()),
                )),
            },
            _ = self.closing.notified() => Err((Verdict::Transient, "the stream stopped".into())),
        };
        self.counts.in_flight.fetch_sub(1, Ordering::Relaxed);
        let took = ticket.elapsed();
        let slow = self.gate.leave(
            ticket,
            match r.as_ref().err().map(|(v, _)| *v) {
                None => Outcome::Success(took),
                Some(Verdict::Throttled | Verdict::Transient) => Outcome::Overload,
                Some(Verdict::Permanent(_)) => Outcome::Final,
            },
        );
        if slow {
            self.warn_waiting(&format!(
                "an answer took {:.1} s, many times the usual: the store (or a server before it) keeps requests waiting, as one does that takes fewer connections than were open",
                took.as_secs_f64()
            ));
        }
        r
    }

    async fn nap(&self, d: Duration) {
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = self.closing.notified() => {}
        }
    }
}

/// Why an answer declaring `declared` bytes is refused unread: more
/// than the range `asked` (a server ignoring Range), or, for a whole
/// object, more than `max_bytes`.
fn oversized(declared: u64, asked: Option<u64>, max_bytes: u64) -> Option<TryError> {
    let why = match asked {
        Some(a) if declared != a => format!(
            "answered {declared} bytes for a range of {a} (a server that ignores Range, or a truncated object)"
        ),
        None if declared > max_bytes => format!(
            "declares {declared} bytes, more than max_file_bytes = {max_bytes}; not downloaded (raise it if such files are real samples)"
        ),
        _ => return None,
    };
    Some(TryError::Answer(
        Verdict::Permanent(FailKind::TooLarge),
        why,
    ))
}

/// A body read chunk by chunk: at most `declared` bytes are kept (more
/// ends the read, refused), fewer is a cut answer (tried again). Memory
/// grows with bytes that arrived, never with what a header claimed.
async fn bounded_body(
    mut body: futures::stream::BoxStream<'static, object_store::Result<Bytes>>,
    declared: u64,
) -> Result<Bytes, TryError> {
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut got = 0u64;
    while let Some(chunk) = body.next().await {
        let chunk = chunk?;
        got += chunk.len() as u64;
        if got > declared {
            return Err(TryError::Answer(
                Verdict::Permanent(FailKind::TooLarge),
                format!("sent more than the {declared} bytes it declared; the read was ended"),
            ));
        }
        chunks.push(chunk);
    }
    if got < declared {
        return Err(TryError::Answer(
            Verdict::Transient,
            format!("answer cut short: {got} of {declared} bytes"),
        ));
    }
    Ok(match chunks.len() {
        1 => chunks.pop().unwrap_or_default(),
        _ => {
            let mut all = Vec::with_capacity(got as usize);
            for c in &chunks {
                all.extend_from_slice(c);
            }
            Bytes::from(all)
        }
    })
}

/// Exponential backoff with full jitter: a throttle starts from 200 ms,
/// anything else from 50 ms; at most 5 s.
fn backoff(tries: u32, verdict: Verdict, rng: &mut SplitMix64) -> Duration {
    let base_ms: u64 = if verdict == Verdict::Throttled {
        200
    } else {
        50
    };
    let cap = (base_ms << tries.min(10)).min(5_000);
    Duration::from_millis(cap / 2 + rng.below(cap / 2 + 1))
}

/// The runtime remote requests run on: two threads, made on first use.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(batchcast::stats_client::REMOTE_THREADS)
            .enable_all()
            .build()
            .expect("the remote-read runtime starts")
    })
}

/// Runs `fut` on [`runtime`] and waits for it on this thread (which may be
/// any thread, a runtime's own included: the wait is a plain channel).
pub fn wait<T: Send + 'static>(fut: impl Future<Output = T> + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    runtime().spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv().expect("a remote task answers")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_read_from_messages() {
        assert_eq!(
            status_in(
                "Server returned non-2xx status code: 503 Service Unavailable: <Code>SlowDown"
            ),
            Some(503)
        );
        assert_eq!(status_in("connection reset"), None);
    }

    #[test]
    fn backoff_grows_with_full_jitter_and_stays_bounded() {
        let mut rng = SplitMix64::new(1);
        for t in 0..20 {
            let d = backoff(t, Verdict::Transient, &mut rng);
            let cap = (50u64 << t.min(10)).min(5_000);
            assert!(
                d >= Duration::from_millis(cap / 2) && d <= Duration::from_millis(cap),
                "{t}: {d:?}"
            );
        }
        assert!(backoff(0, Verdict::Throttled, &mut rng) >= Duration::from_millis(100));
    }
}
