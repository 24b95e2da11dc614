//! The broker's server: accepts connections, admits peers, runs one task per
//! connection, and shuts down gracefully.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use batchcast::proto::{
    self, ClientMsg, ErrorCode, ErrorMsg, FillSlot, GoodbyeReason, Hello, Intent, Preamble,
    ProduceRequest, Registered, ServerMsg, StatsReply, Welcome,
};
use batchcast::shm;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config;
use crate::hub::Work;
use crate::listen::Allow;
use crate::stream::{Acquire, Peer, Stream, SubscribeError};

/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 1024;
/// How long a client may take to send its preamble and hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything the connection tasks share.
#[derive(Debug)]
pub struct Broker {
    /// Streams by name: the configured ones, and external ones while their
    /// producer is connected.
    streams: RwLock<HashMap<String, Entry>>,
    pub allow: Allow,
    pub started: Instant,
}

#[derive(Debug)]
enum Entry {
    Ready(Arc<Stream>),
    /// A producer is registering it; not yet open to consumers.
    Pending,
}

impl Broker {
    pub fn new(streams: Vec<Arc<Stream>>, allow: Allow) -> Broker {
        Broker {
            streams: RwLock::new(
                streams
                    .into_iter()
                    .map(|s| (s.name().to_string(), Entry::Ready(s)))
                    .collect(),
            ),
            allow,
            started: Instant::now(),
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
                Entry::Pending => None,
            })
            .collect()
    }

    fn lookup(&self, name: &str) -> Result<Arc<Stream>, Reject> {
        let reg = self.registry();
        match reg.get(name) {
            Some(Entry::Ready(s)) => Ok(s.clone()),
            Some(Entry::Pending) => Err(Reject(
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
    fn reserve(&self, name: &str) -> Result<(), Reject> {
        let mut reg = self.registry_mut();
        if reg.contains_key(name) {
            return Err(Reject(
                ErrorCode::StreamExists,
                format!(
                    "this broker already serves a stream named `{name}`; pick another name, or stop the producer that registered it"
                ),
            ));
        }
        reg.insert(name.to_string(), Entry::Pending);
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
            (Some(Entry::Pending), _) => true,
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
        StatsReply {
            broker_pid: std::process::id(),
            broker_version: env!("CARGO_PKG_VERSION").into(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            streams,
        }
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
    let limit = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((sock, _)) => {
                    let Ok(permit) = limit.clone().acquire_owned().await else { break };
                    let broker = broker.clone();
                    let stop = stop_rx.clone();
                    tasks.spawn(async move {
                        serve_connection(sock, broker, stop).await;
                        drop(permit);
                    });
                }
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
    // it), then stats connections are told to stop.
    for s in broker.streams() {
        let _ = tokio::task::spawn_blocking(move || s.shutdown()).await;
    }
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(Duration::from_secs(2), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tasks.abort_all();
    }
}

/// A protocol failure to report to the peer before closing.
struct Reject(ErrorCode, String);

async fn write_msg(sock: &mut UnixStream, msg: &ServerMsg) -> std::io::Result<()> {
    let bytes = proto::encode(msg).map_err(std::io::Error::other)?;
    sock.write_all(&bytes).await
}

async fn serve_connection(mut sock: UnixStream, broker: Arc<Broker>, stop: watch::Receiver<bool>) {
    let cred = match sock.peer_cred() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("no peer credentials: {e}");
            return;
        }
    };
    let mut buf = Vec::with_capacity(4096);
    let result = async {
        let hello = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&mut sock, &mut buf))
            .await
            .map_err(|_| Reject(ErrorCode::InvalidRequest, "no hello within 10 s".into()))??;
        if !broker.allow.admits(cred.uid(), cred.gid(), cred.pid()) {
            tracing::warn!(uid = cred.uid(), pid = ?cred.pid(), "refused a peer not in the allow list");
            return Err(Reject(
                ErrorCode::NotAllowed,
                format!("uid {} is not allowed to use this broker; add it to allow_uids in the broker config", cred.uid()),
            ));
        }
        let peer = Peer { name: hello.name, pid: hello.pid, uid: cred.uid() };
        match hello.intent {
            Intent::Stats => serve_stats(&mut sock, &broker, &mut buf, stop).await,
            Intent::Consume { stream, window, join, device, mailbox } => {
                let s = broker.lookup(&stream)?;
                let sub = Subscribe { window, join, device, mailbox };
                serve_consumer(&mut sock, &broker, s, sub, peer, &mut buf).await
            }
            Intent::Produce(req) => serve_producer(&mut sock, &broker, *req, peer, &mut buf, stop).await,
        }
    }
    .await;
    if let Err(Reject(code, message)) = result {
        tracing::info!(pid = ?cred.pid(), ?code, "{message}");
        let _ = write_msg(&mut sock, &ServerMsg::Error(ErrorMsg { code, message })).await;
        let _ = sock.shutdown().await;
    }
}

/// Exchanges preambles and reads the hello.
async fn handshake(sock: &mut UnixStream, buf: &mut Vec<u8>) -> Result<Hello, Reject> {
    let mut pre = [0u8; Preamble::LEN];
    sock.read_exact(&mut pre)
        .await
        .map_err(|e| Reject(ErrorCode::MalformedFrame, format!("no preamble: {e}")))?;
    let _ = sock.write_all(&Preamble::ours().to_bytes()).await;
    let theirs = Preamble::parse(pre).map_err(|_| {
        Reject(
            ErrorCode::NotBatchcast,
            format!("not a batchcast client: the connection began with {pre:02x?}, not `BCST`"),
        )
    })?;
    if theirs.version != proto::PROTOCOL_VERSION {
        return Err(Reject(
            ErrorCode::VersionMismatch,
            format!(
                "client speaks protocol v{}, this broker v{}; use a client and broker from the same release",
                theirs.version,
                proto::PROTOCOL_VERSION
            ),
        ));
    }
    match next_frame(sock, buf).await? {
        Some(ClientMsg::Hello(h)) => Ok(h),
        Some(other) => Err(Reject(
            ErrorCode::InvalidRequest,
            format!("expected a hello first, got {other:?}"),
        )),
        None => Err(Reject(
            ErrorCode::InvalidRequest,
            "closed before saying hello".into(),
        )),
    }
}

/// Takes one complete frame off the front of `buf`, if there is one.
fn take_frame(buf: &mut Vec<u8>) -> Result<Option<ClientMsg>, Reject> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    let len = proto::check_len(len).map_err(|e| Reject(ErrorCode::FrameTooLarge, e.to_string()))?;
    if buf.len() < 4 + len {
        return Ok(None);
    }
    let msg = proto::decode(&buf[4..4 + len]).map_err(|e| {
        Reject(
            ErrorCode::MalformedFrame,
            format!("malformed frame of {len} bytes: {e}"),
        )
    })?;
    buf.drain(..4 + len);
    Ok(Some(msg))
}

/// Reads until one frame is complete. Cancel-safe: bytes read stay in `buf`.
async fn next_frame(sock: &mut UnixStream, buf: &mut Vec<u8>) -> Result<Option<ClientMsg>, Reject> {
    loop {
        if let Some(m) = take_frame(buf)? {
            return Ok(Some(m));
        }
        match sock.read_buf(buf).await {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) => {
                return Err(Reject(
                    ErrorCode::MalformedFrame,
                    "connection closed inside a frame".into(),
                ));
            }
            Ok(_) => {}
            Err(e) => {
                return Err(Reject(
                    ErrorCode::MalformedFrame,
                    format!("read failed: {e}"),
                ));
            }
        }
    }
}

async fn serve_stats(
    sock: &mut UnixStream,
    broker: &Broker,
    buf: &mut Vec<u8>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), Reject> {
    // An answer to the hello, so clients know they were admitted.
    let _ = write_msg(sock, &ServerMsg::Stats(Box::new(broker.stats()))).await;
    loop {
        let msg = tokio::select! {
            m = next_frame(sock, buf) => m?,
            _ = stop.changed() => return Ok(()),
        };
        match msg {
            Some(ClientMsg::StatsRequest) => {
                if write_msg(sock, &ServerMsg::Stats(Box::new(broker.stats())))
                    .await
                    .is_err()
                {
                    return Ok(());
                }
            }
            Some(ClientMsg::SetMinConsumers { stream, min }) => {
                let s = broker.lookup(&stream)?;
                if s.set_min_consumers(min) {
                    tracing::info!(stream = %stream, min, "asked to wait for a different number of consumers");
                }
                if write_msg(sock, &ServerMsg::Stats(Box::new(broker.stats())))
                    .await
                    .is_err()
                {
                    return Ok(());
                }
            }
            Some(ClientMsg::Goodbye) | None => return Ok(()),
            Some(other) => {
                return Err(Reject(
                    ErrorCode::InvalidRequest,
                    format!("a stats connection cannot send {other:?}"),
                ));
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_consumer(
    sock: &mut UnixStream,
    broker: &Broker,
    stream: Arc<Stream>,
    req: Subscribe,
    peer: Peer,
    buf: &mut Vec<u8>,
) -> Result<(), Reject> {
    let window = req.window;
    // Opening a GPU (driver calls, a device allocation) blocks: not on the
    // async runtime's threads.
    let sub = {
        let stream = stream.clone();
        tokio::task::spawn_blocking(move || {
            stream.subscribe(req.window, req.join, peer, req.device.as_ref(), req.mailbox)
        })
        .await
        .map_err(|e| Reject(ErrorCode::Internal, format!("subscribing: {e}")))?
    };
    let sub = sub.map_err(|e| {
        let code = match e {
            SubscribeError::Hub(_) => ErrorCode::InvalidRequest,
            SubscribeError::Failed(_) => ErrorCode::SourceFailed,
            SubscribeError::Device(_) => ErrorCode::DeviceUnavailable,
            SubscribeError::Mailbox(_) => ErrorCode::Internal,
        };
        Reject(
            code,
            format!("cannot subscribe to `{}`: {e}", stream.name()),
        )
    })?;
    let id = sub.id;
    let mut rx = sub.rx;
    // Whatever happens below, the consumer leaves the hub when this returns.
    struct Leave<'a>(&'a Stream, u64);
    impl Drop for Leave<'_> {
        fn drop(&mut self) {
            self.0.leave(self.1);
        }
    }
    let _leave = Leave(&stream, id);

    let welcome = ServerMsg::Welcome(Box::new(Welcome {
        consumer_id: id,
        stream: stream.name().into(),
        schema: stream.plan.schema.clone(),
        layout: stream.plan.layout.clone(),
        slots: stream.plan.cfg.slots,
        window,
        start_epoch: sub.start_epoch,
        broker: env!("CARGO_PKG_VERSION").into(),
        device: sub.device,
        mailbox: sub.mailbox.as_ref().map(|m| m.spec),
    }));
    let bytes = proto::encode(&welcome).map_err(|e| Reject(ErrorCode::Internal, e.to_string()))?;
    let mailbox_fd = sub.mailbox.as_ref().map(|m| m.fd.as_fd());
    if send_with_arena(sock, &bytes, &stream, mailbox_fd)
        .await
        .is_err()
    {
        return Ok(());
    }
    // A mailbox consumer may be asleep on its bell rather than on the
    // socket: ring after everything written to it.
    let bell = sub.mailbox.map(|m| m.bell);

    let mut out = Vec::with_capacity(1024);
    loop {
        tokio::select! {
            biased;
            msg = rx.recv() => {
                let Some(msg) = msg else { return Ok(()) };
                // Coalesce everything queued into one write.
                out.clear();
                let mut last = matches!(msg, ServerMsg::Goodbye(_));
                append(&mut out, &msg);
                while let Ok(m) = rx.try_recv() {
                    last |= matches!(m, ServerMsg::Goodbye(_));
                    append(&mut out, &m);
                }
                let written = sock.write_all(&out).await;
                if let Some(bell) = &bell {
                    bell.ring();
                }
                if written.is_err() || last {
                    return Ok(());
                }
            }
            m = next_frame(sock, buf) => match m? {
                Some(ClientMsg::Release(r)) => {
                    stream.release(id, r).map_err(|e| Reject(ErrorCode::InvalidRequest, format!("bad release: {e}")))?;
                }
                Some(ClientMsg::Goodbye) => stream.goodbye(id),
                Some(ClientMsg::Doorbell) => stream.doorbell(),
                Some(ClientMsg::StatsRequest) => {
                    let _ = write_msg(sock, &ServerMsg::Stats(Box::new(broker.stats()))).await;
                }
                Some(ClientMsg::Hello(_)) => return Err(Reject(ErrorCode::InvalidRequest, "hello sent twice".into())),
                Some(m @ (ClientMsg::Acquire | ClientMsg::Publish { .. } | ClientMsg::Fail { .. } | ClientMsg::SetMinConsumers { .. })) => {
                    return Err(Reject(ErrorCode::InvalidRequest, format!("a consumer cannot send {m:?}")));
                }
                None => return Ok(()),
            },
        }
    }
}

/// What a consumer asked for.
struct Subscribe {
    window: u32,
    join: batchcast::JoinPolicy,
    device: Option<batchcast::proto::DeviceRequest>,
    mailbox: bool,
}

fn append(out: &mut Vec<u8>, msg: &ServerMsg) {
    match proto::encode(msg) {
        Ok(b) => out.extend_from_slice(&b),
        Err(e) => tracing::error!("cannot encode {msg:?}: {e}"),
    }
}

/// Sends a welcome or registration frame with the arena fd (and a
/// consumer's mailbox fd, after it) attached to its first byte.
async fn send_with_arena(
    sock: &mut UnixStream,
    bytes: &[u8],
    stream: &Stream,
    mailbox: Option<BorrowedFd<'_>>,
) -> std::io::Result<()> {
    let raw = sock.as_raw_fd();
    let mut fds = vec![stream.arena.fd()];
    fds.extend(mailbox);
    let n = sock
        .async_io(Interest::WRITABLE, || shm::send_with_fds(raw, bytes, &fds))
        .await?;
    sock.write_all(&bytes[n..]).await
}

/// Serves a producer: registers its stream, hands it slots one at a time,
/// publishes what it fills, and ends or fails the stream when it leaves.
async fn serve_producer(
    sock: &mut UnixStream,
    broker: &Broker,
    req: ProduceRequest,
    peer: Peer,
    buf: &mut Vec<u8>,
    stop: watch::Receiver<bool>,
) -> Result<(), Reject> {
    let name = req.stream.clone();
    let plan = config::plan_external(&req, &peer.name, peer.pid).map_err(|m| {
        Reject(
            ErrorCode::InvalidRequest,
            format!("cannot register stream `{name}`: {m}"),
        )
    })?;
    broker.reserve(&name)?;
    let mut opened: Option<Arc<Stream>> = None;
    let result = produce(sock, broker, plan, &peer, buf, stop, &mut opened).await;
    broker.unregister(&name, opened.as_ref());
    if let (Err(Reject(_, why)), Some(s)) = (&result, &opened) {
        s.fail(format!(
            "producer `{}` (pid {}): {why}",
            peer.name, peer.pid
        ));
    }
    result
}

async fn produce(
    sock: &mut UnixStream,
    broker: &Broker,
    plan: config::StreamPlan,
    peer: &Peer,
    buf: &mut Vec<u8>,
    mut stop: watch::Receiver<bool>,
    opened: &mut Option<Arc<Stream>>,
) -> Result<(), Reject> {
    let who = format!("`{}` (pid {})", peer.name, peer.pid);
    let batch_size = plan.schema.batch_size;
    let stream = Stream::start(plan)
        .map_err(|e| Reject(ErrorCode::Internal, format!("cannot create the arena: {e}")))?;
    let registered = ServerMsg::Registered(Box::new(Registered {
        stream: stream.name().into(),
        schema: stream.plan.schema.clone(),
        layout: stream.plan.layout.clone(),
        slots: stream.plan.cfg.slots,
    }));
    let bytes =
        proto::encode(&registered).map_err(|e| Reject(ErrorCode::Internal, e.to_string()))?;
    if send_with_arena(sock, &bytes, &stream, None).await.is_err() {
        return Ok(());
    }
    // The first request means the producer has mapped the arena: seal it
    // against every other writer, then let consumers in.
    match next_frame(sock, buf).await? {
        Some(ClientMsg::Acquire) => {}
        Some(ClientMsg::Goodbye | ClientMsg::Fail { .. }) | None => return Ok(()),
        Some(other) => {
            return Err(Reject(
                ErrorCode::InvalidRequest,
                format!("a producer's first request must be Acquire, not {other:?}"),
            ));
        }
    }
    stream
        .seal()
        .map_err(|e| Reject(ErrorCode::Internal, format!("cannot seal the arena: {e}")))?;
    broker.open(stream.clone());
    *opened = Some(stream.clone());
    tracing::info!(stream = %stream.name(), producer = %who, "external stream registered");

    let mut wants = true;
    let mut blocked_since = stream.slots_full().then(Instant::now);
    let mut filling: Option<Work> = None;
    let mut blocked = Duration::ZERO;
    loop {
        if wants {
            let reply = match stream.acquire() {
                Err(why) => Some(ServerMsg::Error(ErrorMsg {
                    code: ErrorCode::SourceFailed,
                    message: why,
                })),
                Ok(Acquire::Ended) => Some(ServerMsg::EndOfStream),
                Ok(Acquire::Slot(w)) => {
                    blocked = blocked_since
                        .take()
                        .map(|t| t.elapsed())
                        .unwrap_or_default();
                    filling = Some(w);
                    Some(ServerMsg::Fill(FillSlot {
                        seq: w.seq,
                        epoch: w.epoch,
                        index: w.index,
                        slot: w.slot,
                    }))
                }
                Ok(Acquire::Wait) => None,
            };
            if let Some(msg) = reply {
                wants = false;
                if write_msg(sock, &msg).await.is_err() {
                    stream.producer_done(&who);
                    return Ok(());
                }
            }
        }
        tokio::select! {
            _ = stream.ready(), if wants => {}
            _ = stop.changed() => {
                let _ = write_msg(sock, &ServerMsg::Goodbye(GoodbyeReason::Shutdown)).await;
                return Ok(());
            }
            m = next_frame(sock, buf) => match m? {
                Some(ClientMsg::Acquire) if !wants && filling.is_none() => {
                    wants = true;
                    blocked_since = stream.slots_full().then(Instant::now);
                }
                Some(ClientMsg::Acquire) => {
                    return Err(Reject(ErrorCode::InvalidRequest, "Acquire while a slot is still requested or being filled; publish it first".into()));
                }
                Some(ClientMsg::Publish { seq, samples }) => {
                    let Some(w) = filling.filter(|w| w.seq == seq) else {
                        return Err(Reject(ErrorCode::InvalidRequest, format!("Publish of batch {seq}, which this producer is not filling")));
                    };
                    if samples == 0 || samples > batch_size {
                        return Err(Reject(ErrorCode::SchemaMismatch, format!("batch {seq} claims {samples} samples; a batch of this stream holds 1 to {batch_size}")));
                    }
                    stream.publish(&w, samples, blocked);
                    filling = None;
                }
                Some(ClientMsg::Fail { message }) => {
                    stream.fail(format!("producer {who} failed: {message}"));
                    return Ok(());
                }
                Some(ClientMsg::Goodbye) | None => {
                    match filling {
                        Some(w) => stream.fail(format!("producer {who} left while filling batch {} of epoch {}", w.index, w.epoch)),
                        None => stream.producer_done(&who),
                    }
                    return Ok(());
                }
                Some(other) => {
                    return Err(Reject(ErrorCode::InvalidRequest, format!("a producer cannot send {other:?}")));
                }
            },
        }
    }
}
