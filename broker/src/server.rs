//! The broker's server: accepts connections, admits peers, runs one task per
//! connection, and shuts down gracefully.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use batchcast::proto::{
    self, ClientMsg, ErrorCode, ErrorMsg, Hello, Intent, Preamble, ServerMsg, StatsReply, Welcome,
};
use batchcast::shm;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::listen::Allow;
use crate::stream::{Peer, Stream, SubscribeError};

/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 1024;
/// How long a client may take to send its preamble and hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything the connection tasks share.
#[derive(Debug)]
pub struct Broker {
    pub streams: HashMap<String, Arc<Stream>>,
    pub allow: Allow,
    pub started: Instant,
}

impl Broker {
    pub fn stats(&self) -> StatsReply {
        let mut streams: Vec<_> = self.streams.values().map(|s| s.stats()).collect();
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
    for s in broker.streams.values() {
        let s = s.clone();
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
            Intent::Consume { stream, window, join } => {
                let Some(s) = broker.streams.get(&stream) else {
                    let mut names: Vec<_> = broker.streams.keys().map(String::as_str).collect();
                    names.sort_unstable();
                    return Err(Reject(
                        ErrorCode::UnknownStream,
                        format!("no stream named `{stream}`; this broker serves: {}", names.join(", ")),
                    ));
                };
                serve_consumer(&mut sock, &broker, s.clone(), window, join, peer, &mut buf).await
            }
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
    window: u32,
    join: batchcast::JoinPolicy,
    peer: Peer,
    buf: &mut Vec<u8>,
) -> Result<(), Reject> {
    let sub = stream.subscribe(window, join, peer).map_err(|e| {
        let code = match e {
            SubscribeError::Hub(_) => ErrorCode::InvalidRequest,
            SubscribeError::Failed(_) => ErrorCode::SourceFailed,
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
    }));
    let bytes = proto::encode(&welcome).map_err(|e| Reject(ErrorCode::Internal, e.to_string()))?;
    if send_welcome(sock, &bytes, &stream).await.is_err() {
        return Ok(());
    }

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
                if sock.write_all(&out).await.is_err() || last {
                    return Ok(());
                }
            }
            m = next_frame(sock, buf) => match m? {
                Some(ClientMsg::Release { seq, wait_ns }) => {
                    stream.release(id, seq, wait_ns).map_err(|e| Reject(ErrorCode::InvalidRequest, format!("bad release: {e}")))?;
                }
                Some(ClientMsg::Goodbye) => stream.goodbye(id),
                Some(ClientMsg::StatsRequest) => {
                    let _ = write_msg(sock, &ServerMsg::Stats(Box::new(broker.stats()))).await;
                }
                Some(ClientMsg::Hello(_)) => return Err(Reject(ErrorCode::InvalidRequest, "hello sent twice".into())),
                None => return Ok(()),
            },
        }
    }
}

fn append(out: &mut Vec<u8>, msg: &ServerMsg) {
    match proto::encode(msg) {
        Ok(b) => out.extend_from_slice(&b),
        Err(e) => tracing::error!("cannot encode {msg:?}: {e}"),
    }
}

/// Sends the welcome frame with the arena fd attached to its first byte.
async fn send_welcome(sock: &mut UnixStream, bytes: &[u8], stream: &Stream) -> std::io::Result<()> {
    let raw = sock.as_raw_fd();
    let n = sock
        .async_io(Interest::WRITABLE, || {
            shm::send_with_fd(raw, bytes, stream.arena.fd())
        })
        .await?;
    sock.write_all(&bytes[n..]).await
}
