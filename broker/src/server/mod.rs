//! The broker's server: accepts connections, admits peers, runs one task per
//! connection, and shuts down gracefully. One file per kind of connection:
//!
//! * `mod.rs` (here): the [`Broker`]'s registry of streams, accepting,
//!   and shutdown.
//! * `connection`: one connection's socket and frame buffer: the
//!   handshake, frames in, every write out.
//! * `consumer`: a consumer's connection: subscribe, the welcome with
//!   the arena's (and mailbox's) fd, then outbox out and releases in.
//! * `producer`: an external producer's connection: register, seal the
//!   arena, hand out slots, publish.
//! * `stats`: a stats connection, and the launcher's `SetMinConsumers`.
//! * `admit`: who gets a connection (allow list, limits per uid), decided
//!   at accept before anything is read.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use batchcast::proto::{
    self, ConnectionStats, ErrorCode, ErrorMsg, Intent, PendingStream, Preamble, ServerMsg,
    StatsReply,
};
use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::budget::{Budget, Grant};
use crate::stream::{Peer, Stream};

mod admit;
mod connection;
mod consumer;
pub mod metrics;
mod producer;
mod refusals;
mod stats;

pub use admit::Admission;
use connection::{Connection, Reject, append};

/// How long a client may take to send its preamble and hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest frame a client may send (a producer's request with its
/// schema is the largest; a few KiB). With it, every connection's buffer
/// is bounded, and all of them together are reserved from the memory
/// budget at start: `max_connections × FRAME_BUFFER_BYTES`.
pub(crate) const MAX_CLIENT_FRAME: usize = 64 << 10;
pub const FRAME_BUFFER_BYTES: u64 = (MAX_CLIENT_FRAME + 4096) as u64;

/// Everything the connection tasks share.
#[derive(Debug)]
pub struct Broker {
    /// Streams by name: the configured ones, and external ones while their
    /// producer is connected.
    streams: RwLock<HashMap<String, Entry>>,
    pub admission: Arc<Admission>,
    pub budget: Arc<Budget>,
    /// Every connection's frame buffer, reserved at start.
    _buffers: Grant,
    pub started: Instant,
    /// Refused connections: counted, and logged at a bounded rate.
    refusals: refusals::Refusals,
}

#[derive(Debug)]
enum Entry {
    Ready(Arc<Stream>),
    /// A producer is registering it; not yet open to consumers.
    Pending(Pending),
}

/// A registration between its request and its first `Acquire`.
#[derive(Debug, Clone)]
struct Pending {
    producer: String,
    pid: u32,
    uid: u32,
    arena_bytes: u64,
    since: Instant,
}

impl Broker {
    pub fn new(
        streams: Vec<Arc<Stream>>,
        admission: Arc<Admission>,
        budget: Arc<Budget>,
        buffers: Grant,
    ) -> Broker {
        Broker {
            streams: RwLock::new(
                streams
                    .into_iter()
                    .map(|s| (s.name().to_string(), Entry::Ready(s)))
                    .collect(),
            ),
            admission,
            budget,
            _buffers: buffers,
            started: Instant::now(),
            refusals: refusals::Refusals::default(),
        }
    }

    fn registry(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Entry>> {
        self.streams.read().unwrap_or_else(|p| p.into_inner())
    }

    fn registry_mut(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, Entry>> {
        self.streams.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Every stream open to consumers.
    pub fn streams(&self) -> Vec<Arc<Stream>> {
        self.registry()
            .values()
            .filter_map(|e| match e {
                Entry::Ready(s) => Some(s.clone()),
                Entry::Pending(_) => None,
            })
            .collect()
    }

    fn lookup(&self, name: &str) -> Result<Arc<Stream>, Reject> {
        // The name is logged and answered back: a stream's name rules
        // first (no 60 KB line, no forged log line of a guest's).
        batchcast::proto::check_text(
            "the stream's name asked for",
            name,
            batchcast::proto::MAX_NAME_BYTES,
            "the name of a stream this broker serves (`batchcast stats` lists them)",
        )
        .map_err(|e| Reject(ErrorCode::InvalidRequest, e.to_string()))?;
        let reg = self.registry();
        match reg.get(name) {
            Some(Entry::Ready(s)) => Ok(s.clone()),
            Some(Entry::Pending(_)) => Err(Reject(
                ErrorCode::UnknownStream,
                format!(
                    "stream `{name}` is being registered by its producer; try again in a moment (or connect with a connect timeout)"
                ),
            )),
            None => {
                let mut names: Vec<_> = reg.keys().map(String::as_str).collect();
                names.sort_unstable();
                Err(Reject(
                    ErrorCode::UnknownStream,
                    if names.is_empty() {
                        format!(
                            "no stream named `{name}`: this broker serves none yet; start a producer for it or give the broker a config"
                        )
                    } else {
                        format!(
                            "no stream named `{name}`; this broker serves: {}",
                            names.join(", ")
                        )
                    },
                ))
            }
        }
    }

    /// Claims `name` for a producer that is registering it.
    fn reserve(&self, name: &str, pending: Pending) -> Result<(), Reject> {
        let mut reg = self.registry_mut();
        if reg.contains_key(name) {
            return Err(Reject(
                ErrorCode::StreamExists,
                format!(
                    "this broker already serves a stream named `{name}`; pick another name, or stop the producer that registered it"
                ),
            ));
        }
        reg.insert(name.to_string(), Entry::Pending(pending));
        Ok(())
    }

    /// Opens a reserved name to consumers.
    fn open(&self, stream: Arc<Stream>) {
        self.registry_mut()
            .insert(stream.name().to_string(), Entry::Ready(stream));
    }

    /// Forgets the stream a producer registered (consumers already attached
    /// keep it until they leave).
    fn unregister(&self, name: &str, stream: Option<&Arc<Stream>>) {
        let mut reg = self.registry_mut();
        let ours = match (reg.get(name), stream) {
            (Some(Entry::Pending(_)), _) => true,
            (Some(Entry::Ready(s)), Some(mine)) => Arc::ptr_eq(s, mine),
            _ => false,
        };
        if ours {
            reg.remove(name);
        }
    }

    pub fn stats(&self) -> StatsReply {
        let mut streams: Vec<_> = self.streams().iter().map(|s| s.stats()).collect();
        streams.sort_by(|a, b| a.name.cmp(&b.name));
        let mut pending: Vec<_> = self
            .registry()
            .iter()
            .filter_map(|(name, e)| match e {
                Entry::Pending(p) => Some(PendingStream {
                    name: name.clone(),
                    producer: p.producer.clone(),
                    pid: p.pid,
                    uid: p.uid,
                    arena_bytes: p.arena_bytes,
                    waiting_s: p.since.elapsed().as_secs_f64(),
                }),
                Entry::Ready(_) => None,
            })
            .collect();
        pending.sort_by(|a, b| a.name.cmp(&b.name));
        let (held, refused, by_uid) = self.admission.counts();
        let (handshakes_refused, requests_refused) = self.refusals.counts();
        let mut reply = StatsReply {
            broker_pid: std::process::id(),
            broker_version: env!("CARGO_PKG_VERSION").into(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            streams,
            pending,
            memory: self.budget.stats(),
            connections: ConnectionStats {
                held: held as u32,
                max: self.admission.limits().max_connections as u32,
                refused,
                by_uid: by_uid.into_iter().map(|(u, n)| (u, n as u32)).collect(),
                handshakes_refused,
                requests_refused,
            },
            streams_left_out: 0,
            pending_left_out: 0,
        };
        if reply.fit(proto::MAX_STATS_BYTES) {
            tracing::debug!(
                streams_left_out = reply.streams_left_out,
                pending_left_out = reply.pending_left_out,
                "the stats reply was shortened to fit a frame"
            );
        }
        reply
    }
}

/// Serves until `shutdown` resolves, then tells every consumer goodbye and
/// waits (briefly) for connections to finish.
pub async fn run(
    listener: UnixListener,
    broker: Arc<Broker>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                // Admission never waits: a refused peer is answered and
                // closed here, so the loop always comes back to `shutdown`.
                Ok((sock, _)) => if let Some((ticket, cred)) = admit(&broker.admission, &sock) {
                    let broker = broker.clone();
                    let stop = stop_rx.clone();
                    tasks.spawn(async move {
                        serve_connection(sock, cred, broker, stop).await;
                        drop(ticket);
                    });
                },
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    tracing::info!(
        "shutting down: saying goodbye to {} connection(s)",
        tasks.len()
    );
    // Streams queue a goodbye to each consumer (whose task ends after writing
    // it), then stats connections are told to stop. All within 2 s in all,
    // whatever the connections do: streams stop at once and together.
    let stopping: Vec<_> = broker
        .streams()
        .into_iter()
        .map(|s| tokio::task::spawn_blocking(move || s.shutdown()))
        .collect();
    let _ = tokio::time::timeout(Duration::from_millis(1200), async {
        for s in stopping {
            let _ = s.await;
        }
    })
    .await;
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(Duration::from_millis(500), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tasks.abort_all();
    }
}

/// Decides from the peer's kernel credentials, before reading anything,
/// whether it gets a connection; a refused peer is sent the broker's
/// preamble and the reason (a client reads them as the answer to its
/// hello) and closed.
fn admit(
    admission: &Arc<Admission>,
    sock: &UnixStream,
) -> Option<(admit::Ticket, tokio::net::unix::UCred)> {
    let cred = match sock.peer_cred() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("no peer credentials: {e}");
            return None;
        }
    };
    match admission.admit(cred.uid(), cred.gid(), cred.pid()) {
        Ok(ticket) => Some((ticket, cred)),
        Err(refusal) => {
            tracing::debug!(uid = cred.uid(), pid = ?cred.pid(), "{}", refusal.message);
            let mut bytes = Preamble::ours().to_bytes().to_vec();
            let error = ServerMsg::Error(ErrorMsg {
                code: refusal.code,
                message: refusal.message,
            });
            append(&mut bytes, &error);
            // A fresh socket's buffer takes this small write whole; if not,
            // the peer only loses the reason, never the broker its time.
            let _ = sock.try_write(&bytes);
            None
        }
    }
}

async fn serve_connection(
    sock: UnixStream,
    cred: tokio::net::unix::UCred,
    broker: Arc<Broker>,
    stop: watch::Receiver<bool>,
) {
    let mut conn = Connection::new(sock);
    let mut in_handshake = true;
    let result = async {
        let hello = tokio::time::timeout(HANDSHAKE_TIMEOUT, conn.handshake())
            .await
            .map_err(|_| Reject(ErrorCode::InvalidRequest, "no hello within 10 s".into()))??;
        in_handshake = false;
        proto::check_peer_name(&hello.name)
            .map_err(|why| Reject(ErrorCode::InvalidRequest, why.to_string()))?;
        // The kernel's pid for the peer (SO_PEERCRED, taken at connect),
        // never the one its hello claims: stats show it and doctor reads
        // /proc for it. 0 where the kernel gave none.
        let pid = cred.pid().and_then(|p| u32::try_from(p).ok()).unwrap_or(0);
        if pid != hello.pid {
            tracing::debug!(pid, claimed = hello.pid, name = %hello.name, "a hello's pid is not the kernel's: the kernel's is kept");
        }
        let peer = Peer {
            name: hello.name,
            pid,
            uid: cred.uid(),
        };
        match hello.intent {
            Intent::Stats => stats::serve_stats(&mut conn, &broker, peer.uid, stop).await,
            Intent::Consume(req) => {
                let s = broker.lookup(&req.stream)?;
                consumer::serve_consumer(&mut conn, &broker, s, req, peer).await
            }
            Intent::Produce(req) => {
                producer::serve_producer(&mut conn, &broker, *req, peer, stop).await
            }
        }
    }
    .await;
    if let Err(Reject(code, message)) = result {
        match broker.refusals.note(in_handshake, Instant::now()) {
            refusals::Verdict::Log { left_out } => {
                if left_out > 0 {
                    tracing::info!(
                        "{left_out} more connection(s) refused in the last {} s, not logged (`batchcast stats` counts them)",
                        refusals::WINDOW.as_secs()
                    );
                }
                tracing::info!(uid = cred.uid(), pid = ?cred.pid(), ?code, "{message}");
            }
            refusals::Verdict::Quiet => {}
        }
        let _ = conn
            .send(&ServerMsg::Error(ErrorMsg { code, message }))
            .await;
        let _ = conn.sock.shutdown().await;
    }
}
