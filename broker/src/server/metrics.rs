//! `batchcast serve --metrics ADDR`: the broker's stats in Prometheus text
//! format (version 0.0.4) at `http://ADDR/metrics`, what cluster monitoring
//! already scrapes. The same numbers as `batchcast stats --json`; a tiny
//! HTTP/1.1 responder, one request per connection. Beside it, probes for
//! an orchestrator (a Kubernetes DaemonSet's liveness and readiness):
//! `/healthz` answers 200 once every stream's lock answered (a wedged
//! broker times out), `/readyz` 200 while no stream has failed, else 503
//! naming each failed stream and why.
//!
//! Anyone who can reach the address may connect: at most
//! [`MAX_CONNECTIONS`] are held (more are answered 503 and closed), each
//! for at most [`REQUEST_WITHIN`] before its request, and failed accepts
//! back off instead of spinning. Bind it to loopback or a pod address
//! that only the monitoring reaches.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use batchcast::proto::{ConsumerStats, GpuCopyStats, StatsReply, StreamStats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::server::Broker;

/// Connections held at once, at most: past it, one is answered 503 and
/// closed at once, so a flood costs an accept and a close each and takes
/// no more descriptors from the Unix socket's clients than this many.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a connection may take to send its request.
pub const REQUEST_WITHIN: Duration = Duration::from_secs(2);
/// How long answering one may take in all.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// Serves until the runtime stops.
pub async fn serve(listener: TcpListener, broker: Arc<Broker>) {
    let held = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut backoff = Duration::ZERO;
    loop {
        let sock = match listener.accept().await {
            Ok((sock, _)) => {
                backoff = Duration::ZERO;
                sock
            }
            Err(e) => {
                // Out of descriptors (EMFILE) and the like: accepting again
                // at once would fail again and spin. Back off, said once
                // per run of failures.
                if backoff.is_zero() {
                    tracing::warn!(
                        "metrics address: accept failed ({e}); backing off until it succeeds"
                    );
                }
                backoff = (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        let Ok(permit) = held.clone().try_acquire_owned() else {
            shed(sock);
            continue;
        };
        let broker = broker.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(ANSWER_WITHIN, answer(sock, &broker)).await;
            drop(permit);
        });
    }
}

/// A connection past [`MAX_CONNECTIONS`]: told so (into its empty send
/// buffer, never waiting), unread, and closed at once.
fn shed(sock: TcpStream) {
    let _ = sock.try_write(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    );
}

async fn answer(mut sock: TcpStream, broker: &Broker) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let by = tokio::time::Instant::now() + REQUEST_WITHIN;
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let Ok(n) = tokio::time::timeout_at(by, sock.read(&mut chunk)).await else {
            return Ok(()); // idle: the seat goes to the next connection
        };
        let n = n?;
        if n == 0 || buf.len() > 16 * 1024 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let line = String::from_utf8_lossy(&buf);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET" | "HEAD", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            render(&broker.stats()),
        ),
        ("GET" | "HEAD", "/healthz") => {
            let st = broker.stats();
            (
                "200 OK",
                "text/plain",
                format!("ok: {} streams\n", st.streams.len()),
            )
        }
        ("GET" | "HEAD", "/readyz") => {
            let (status, body) = readiness(&broker.stats());
            (status, "text/plain", body)
        }
        ("GET" | "HEAD", _) => (
            "404 Not Found",
            "text/plain",
            "batchcast serves /metrics, /healthz and /readyz\n".to_string(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET /metrics, /healthz or /readyz\n".to_string(),
        ),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    sock.write_all(head.as_bytes()).await?;
    if method != "HEAD" {
        sock.write_all(body.as_bytes()).await?;
    }
    sock.shutdown().await
}

/// `/readyz`: ready while no stream has failed (its source or producer);
/// else 503, each failed stream named with why. (A stream waiting for its
/// producer, or for consumers, is ready: it serves as soon as they come.)
fn readiness(stats: &StatsReply) -> (&'static str, String) {
    let failed: Vec<String> = stats
        .streams
        .iter()
        .filter_map(|s| {
            s.failed
                .as_ref()
                .map(|why| format!("stream `{}` failed: {why}", s.name))
        })
        .collect();
    if failed.is_empty() {
        (
            "200 OK",
            format!("ready: {} streams\n", stats.streams.len()),
        )
    } else {
        (
            "503 Service Unavailable",
            format!("not ready:\n{}\n", failed.join("\n")),
        )
    }
}

/// A label value with `\`, `"` and newlines escaped.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One metric family: HELP, TYPE, then its samples.
struct Family<'a> {
    out: &'a mut String,
}

impl Family<'_> {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP batchcast_{name} {help}");
        let _ = writeln!(self.out, "# TYPE batchcast_{name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], v: f64) {
        let l: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", esc(v)))
            .collect();
        if l.is_empty() {
            let _ = writeln!(self.out, "batchcast_{name} {v}");
        } else {
            let _ = writeln!(self.out, "batchcast_{name}{{{}}} {v}", l.join(","));
        }
    }
}

/// A metric: name, Prometheus type, help, and its value in a stats record.
type Metric<T> = (&'static str, &'static str, &'static str, fn(&T) -> f64);

/// Per stream, labelled `stream` (named `batchcast_stream_NAME`).
static STREAM_METRICS: [Metric<StreamStats>; 19] = [
    (
        "batches_produced_total",
        "counter",
        "Batches the pipeline published.",
        |st| st.batches_produced as f64,
    ),
    (
        "deliveries_total",
        "counter",
        "Batch deliveries summed over consumers.",
        |st| st.deliveries as f64,
    ),
    ("slots", "gauge", "Slots of the stream's arena.", |st| {
        st.slots as f64
    }),
    (
        "free_slots",
        "gauge",
        "Slots free for the pipeline.",
        |st| st.free_slots as f64,
    ),
    (
        "slots_in_use",
        "gauge",
        "Slots published and not yet released by everyone.",
        |st| st.in_use as f64,
    ),
    (
        "producer_blocked_seconds_total",
        "counter",
        "Seconds the pipeline waited for a free slot.",
        |st| st.producer_blocked_s,
    ),
    (
        "pipeline_cpu_seconds_total",
        "counter",
        "CPU seconds the pipeline threads spent filling slots.",
        |st| st.pipeline_cpu_s,
    ),
    (
        "pipeline_threads",
        "gauge",
        "Pipeline threads the stream has (with workers left out, the most that may work).",
        |st| f64::from(st.workers),
    ),
    (
        "pipeline_threads_working",
        "gauge",
        "Pipeline threads working now (with workers left out, as many as the trainers need).",
        |st| f64::from(st.workers_active),
    ),
    ("consumers", "gauge", "Consumers connected.", |st| {
        st.consumers.len() as f64
    }),
    (
        "images_decoded_total",
        "counter",
        "Images decoded (image streams).",
        |st| st.source.as_ref().map_or(0.0, |x| x.decoded as f64),
    ),
    (
        "cache_hits_total",
        "counter",
        "Encoded-bytes cache hits (image streams).",
        |st| st.source.as_ref().map_or(0.0, |x| x.cache_hits as f64),
    ),
    (
        "decoded_cache_hits_total",
        "counter",
        "Decoded-image cache hits (image streams with decoded_cache_mib).",
        |st| decoded_cache(st).map_or(0.0, |k| k.hits as f64),
    ),
    (
        "decoded_cache_misses_total",
        "counter",
        "Decoded-image cache misses: images decoded and kept, or not kept (full).",
        |st| decoded_cache(st).map_or(0.0, |k| k.misses as f64),
    ),
    (
        "stage_read_seconds_total",
        "counter",
        "Seconds the pipeline threads spent reading files and headers (image streams; wall time).",
        |st| st.source.as_ref().map_or(0.0, |x| x.stages.read_s),
    ),
    (
        "stage_read_cpu_seconds_total",
        "counter",
        "CPU seconds of the read stage; the rest of stage_read_seconds_total waited for bytes or a core (image streams).",
        |st| st.source.as_ref().map_or(0.0, |x| x.stages.read_cpu_s),
    ),
    (
        "stage_decode_seconds_total",
        "counter",
        "Seconds the pipeline threads spent decoding (image streams).",
        |st| st.source.as_ref().map_or(0.0, |x| x.stages.decode_s),
    ),
    (
        "stage_transform_seconds_total",
        "counter",
        "Seconds the pipeline threads spent cropping, resizing, augmenting and writing tensors (image streams).",
        |st| st.source.as_ref().map_or(0.0, |x| x.stages.transform_s),
    ),
    (
        "bad_files_skipped_total",
        "counter",
        "Samples replaced because their file was bad.",
        |st| st.source.as_ref().map_or(0.0, |x| x.skipped as f64),
    ),
];

/// A stream's cache of decoded images, if it has one.
fn decoded_cache(st: &StreamStats) -> Option<&batchcast::proto::DecodedCacheStats> {
    st.source.as_ref().and_then(|x| x.decoded_cache.as_ref())
}

/// Per consumer, labelled `stream`, `consumer` and `id`
/// (`batchcast_consumer_NAME`).
static CONSUMER_METRICS: [Metric<ConsumerStats>; 7] = [
    (
        "delivered_total",
        "counter",
        "Batches sent to the consumer.",
        |c| c.delivered as f64,
    ),
    (
        "samples_total",
        "counter",
        "Samples sent to the consumer.",
        |c| c.samples as f64,
    ),
    (
        "taken_samples_total",
        "counter",
        "Samples the consumer's program took, as its client reports (carried across broker restarts).",
        |c| c.taken.samples as f64,
    ),
    ("held", "gauge", "Batches the consumer holds.", |c| {
        c.held as f64
    }),
    (
        "wait_seconds_total",
        "counter",
        "Seconds the consumer was blocked waiting for data (data stall).",
        |c| c.wait_s,
    ),
    (
        "busy_seconds_total",
        "counter",
        "Seconds the consumer worked between batches (training steps).",
        |c| c.busy_s,
    ),
    ("stall_ratio", "gauge", "wait / (wait + busy).", |c| {
        c.stall_fraction()
    }),
];

/// Per GPU of a stream, labelled `stream` and `gpu`.
static GPU_METRICS: [Metric<GpuCopyStats>; 4] = [
    (
        "gpu_copies_total",
        "counter",
        "Host-to-device copies of batches.",
        |g| g.copies as f64,
    ),
    (
        "gpu_replayed_copies_total",
        "counter",
        "Host-to-device copies of batches replayed to one consumer (its own arena on the GPU).",
        |g| g.replayed as f64,
    ),
    (
        "gpu_copy_bytes_total",
        "counter",
        "Bytes copied to the GPU.",
        |g| g.bytes as f64,
    ),
    (
        "gpu_slots_in_use",
        "gauge",
        "Device slots holding a batch (being copied, or owed to a consumer).",
        |g| g.slots_in_use as f64,
    ),
];

/// The broker's own metrics: name, kind, help, value.
type BrokerMetric = (
    &'static str,
    &'static str,
    &'static str,
    fn(&StatsReply) -> f64,
);

const BROKER_METRICS: [BrokerMetric; 9] = [
    (
        "uptime_seconds",
        "gauge",
        "Seconds since the broker started.",
        |s| s.uptime_s,
    ),
    (
        "memory_budget_bytes",
        "gauge",
        "The broker's memory budget ([broker] memory_mib).",
        |s| s.memory.budget_bytes as f64,
    ),
    (
        "memory_used_bytes",
        "gauge",
        "Bytes of the budget held by arenas, GPU arenas, mailboxes and frame buffers.",
        |s| s.memory.used_bytes as f64,
    ),
    (
        "memory_refused_total",
        "counter",
        "Allocations refused for not fitting the budget.",
        |s| s.memory.refused as f64,
    ),
    ("connections", "gauge", "Connections held.", |s| {
        f64::from(s.connections.held)
    }),
    (
        "connections_refused_total",
        "counter",
        "Connections refused (allow list, limits).",
        |s| s.connections.refused as f64,
    ),
    (
        "handshakes_refused_total",
        "counter",
        "Connections refused at the handshake (another protocol, no preamble, no hello).",
        |s| s.connections.handshakes_refused as f64,
    ),
    (
        "requests_refused_total",
        "counter",
        "Connections refused after admission, for any reason (logged at a bounded rate).",
        |s| s.connections.requests_refused as f64,
    ),
    (
        "pending_registrations",
        "gauge",
        "Producer registrations waiting for their first Acquire.",
        |s| s.pending.len() as f64,
    ),
];

/// The Prometheus text exposition of `s`.
pub fn render(s: &StatsReply) -> String {
    let mut out = String::new();
    let mut f = Family { out: &mut out };
    for (name, kind, help, get) in &BROKER_METRICS {
        f.head(name, kind, help);
        f.sample(name, &[], get(s));
    }
    for (name, kind, help, get) in &STREAM_METRICS {
        let name = format!("stream_{name}");
        f.head(&name, kind, help);
        for st in &s.streams {
            f.sample(&name, &[("stream", &st.name)], get(st));
        }
    }
    for (name, kind, help, get) in &CONSUMER_METRICS {
        let name = format!("consumer_{name}");
        f.head(&name, kind, help);
        for st in &s.streams {
            for c in &st.consumers {
                let id = c.id.to_string();
                let labels = [
                    ("stream", st.name.as_str()),
                    ("consumer", c.name.as_str()),
                    ("id", &id),
                ];
                f.sample(&name, &labels, get(c));
            }
        }
    }
    for (name, kind, help, get) in &GPU_METRICS {
        f.head(name, kind, help);
        for st in &s.streams {
            for g in &st.gpus {
                f.sample(name, &[("stream", &st.name), ("gpu", &g.gpu)], get(g));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(esc("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
