//! A consumer's connection: subscribe (off the async threads: a GPU
//! arena may be allocated), the welcome with the arena's fd (and the
//! mailbox's), then the stream's outbox written out and releases, goodbyes
//! and doorbells read in, until either side ends it. The consumer leaves
//! the stream whenever this returns, whatever the reason.

use std::os::fd::AsFd;
use std::sync::Arc;

use batchcast::mailbox::Bell;
use batchcast::proto::{self, ClientMsg, ErrorCode, ServerMsg, Welcome};
use tokio::sync::mpsc;

use super::Broker;
use super::connection::{Connection, Reject, append};
use crate::hub::ConsumerId;
use batchcast::proto::ConsumeRequest;

use crate::stream::{Peer, Stream, SubscribeError, Subscription};

pub(super) async fn serve_consumer(
    conn: &mut Connection,
    broker: &Broker,
    stream: Arc<Stream>,
    req: ConsumeRequest,
    peer: Peer,
) -> Result<(), Reject> {
    let window = req.window;
    let sub = subscribe(&stream, req, peer).await?;
    // Whatever happens below, the consumer leaves the hub when this returns.
    struct Leave<'a>(&'a Stream, u64);
    impl Drop for Leave<'_> {
        fn drop(&mut self) {
            self.0.leave(self.1);
        }
    }
    let _leave = Leave(&stream, sub.id);
    let welcome = ServerMsg::Welcome(Box::new(Welcome {
        consumer_id: sub.id,
        stream: stream.name().into(),
        schema: stream.plan.schema.clone(),
        rings: stream.plan.rings.clone(),
        layout: stream.plan.layout.clone(),
        slots: stream.plan.slots,
        window,
        batch_size: sub.shape.batch_size,
        drop_last: sub.shape.drop_last,
        start_epoch: sub.start_epoch,
        broker: env!("CARGO_PKG_VERSION").into(),
        device: sub.device.as_ref().map(|m| m.arena()),
        mailbox: sub.mailbox.as_ref().map(|m| m.spec),
        owner_uid: stream.owner_uid,
        replay: sub.replay.as_ref().map(|(g, _)| g.clone()),
        digest: stream.plan.digest,
        region: sub.region.0,
        regions: sub.region.1,
    }));
    let bytes = proto::encode(&welcome).map_err(|e| Reject(ErrorCode::Internal, e.to_string()))?;
    let more: Vec<_> = sub
        .mailbox
        .as_ref()
        .map(|m| m.fd.as_fd())
        .into_iter()
        .chain(sub.replay.as_ref().map(|(_, fd)| fd.as_fd()))
        .chain(sub.device.as_ref().and_then(|m| m.device_fd()))
        .chain(sub.device_replay.as_ref().and_then(|t| t.fd()))
        .collect();
    if conn.send_with_arena(&bytes, &stream, &more).await.is_err() {
        return Ok(());
    }
    // A mailbox consumer may be asleep on its bell rather than on the
    // socket: ring after everything written to it.
    let bell = sub.mailbox.map(|m| m.bell);
    relay(conn, broker, &stream, sub.id, sub.rx, bell).await
}

/// Subscribes on a blocking thread: opening a GPU (driver calls, a device
/// allocation) must not hold up the async runtime's threads.
async fn subscribe(
    stream: &Arc<Stream>,
    req: ConsumeRequest,
    peer: Peer,
) -> Result<Subscription, Reject> {
    let s = stream.clone();
    let sub = tokio::task::spawn_blocking(move || s.subscribe(req, peer))
        .await
        .map_err(|e| Reject(ErrorCode::Internal, format!("subscribing: {e}")))?;
    sub.map_err(|e| {
        let code = match e {
            SubscribeError::Hub(_) | SubscribeError::BatchSize(_) | SubscribeError::Seat(_) => {
                ErrorCode::InvalidRequest
            }
            SubscribeError::Failed(_) => ErrorCode::SourceFailed,
            SubscribeError::Device(_) => ErrorCode::DeviceUnavailable,
            SubscribeError::Mailbox(_) => ErrorCode::Internal,
            SubscribeError::OverBudget(_)
            | SubscribeError::SeatTaken(_)
            | SubscribeError::Replay(crate::stream::ReplayError::OverBudget(_)) => ErrorCode::Busy,
            SubscribeError::Replay(_) => ErrorCode::InvalidRequest,
            SubscribeError::Changed { .. } => ErrorCode::StreamChanged,
        };
        Reject(
            code,
            format!("cannot subscribe to `{}`: {e}", stream.name()),
        )
    })
}

/// Writes what the stream queued for the consumer (coalesced into one
/// write) and takes what it sends, until either side ends.
async fn relay(
    conn: &mut Connection,
    broker: &Broker,
    stream: &Stream,
    id: ConsumerId,
    mut rx: mpsc::Receiver<ServerMsg>,
    bell: Option<Bell>,
) -> Result<(), Reject> {
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
                let written = conn.write_all(&out).await;
                if let Some(bell) = &bell {
                    bell.ring();
                }
                if written.is_err() || last {
                    return Ok(());
                }
            }
            m = conn.next() => match m? {
                Some(ClientMsg::Release(r)) => {
                    stream.release(id, r).map_err(|e| Reject(ErrorCode::InvalidRequest, format!("bad release: {e}")))?;
                }
                Some(ClientMsg::Goodbye) => stream.goodbye(id),
                Some(ClientMsg::Doorbell) => stream.doorbell(),
                Some(ClientMsg::StatsRequest) => {
                    let _ = conn.send(&ServerMsg::Stats(Box::new(broker.stats()))).await;
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
