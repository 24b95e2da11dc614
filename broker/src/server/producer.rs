//! An external producer's connection: its request is planned like a
//! configured stream ([`StreamPlan::external`]), its name reserved, the
//! arena created and sent; on its first `Acquire` the arena is sealed
//! against every other writer and the stream opened to consumers. Then
//! slots are handed out one at a time, and what it publishes reaches the
//! consumers. Leaving early (or failing) fails the stream for everyone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use batchcast::FillSlot;
use batchcast::proto::{
    self, ClientMsg, ErrorCode, ErrorMsg, GoodbyeReason, ProduceRequest, Registered, Rejoin,
    ServerMsg,
};
use tokio::sync::watch;

use super::Broker;
use super::connection::{Connection, Reject};
use crate::pipeline::shared::Shares;
use crate::plan::StreamPlan;
use crate::stream::{Acquire, Peer, Port, StartError, Stream, StreamFailed};

/// Serves a producer: registers its stream, hands it slots one at a time,
/// publishes what it fills, and ends or fails the stream when it leaves.
pub(super) async fn serve_producer(
    conn: &mut Connection,
    broker: &Broker,
    req: ProduceRequest,
    peer: Peer,
    stop: watch::Receiver<bool>,
) -> Result<(), Reject> {
    let name = req.stream.clone();
    let plan = StreamPlan::external(&req, &peer.name, peer.pid).map_err(|e| {
        Reject(
            ErrorCode::InvalidRequest,
            format!("cannot register stream `{name}`: {e}"),
        )
    })?;
    broker
        .admission
        .may_name(peer.uid, &name)
        .map_err(|r| Reject(r.code, r.message))?;
    broker.reserve(
        &name,
        super::Pending {
            producer: peer.name.clone(),
            pid: peer.pid,
            uid: peer.uid,
            arena_bytes: plan.arena_bytes(),
            since: Instant::now(),
        },
    )?;
    let who = format!("`{}` (pid {})", peer.name, peer.pid);
    let limits = broker.admission.limits();
    // Registering again: hold the stream for the consumers it had, at most
    // the producer's grace, capped by the registration timeout.
    let hold = req.rejoin.map(|r| {
        Instant::now()
            + Duration::from_millis(u64::from(r.grace_ms)).min(limits.registration_timeout)
    });
    let registered = register(conn, broker, plan, (peer.uid, req.rejoin), &who).await;
    let result = match &registered {
        Ok(Some(stream)) => serve_slots(conn, stream, (&who, hold), stop).await,
        Ok(None) => Ok(()),
        Err(Reject(code, why)) => Err(Reject(*code, why.clone())),
    };
    let opened = registered.ok().flatten();
    broker.unregister(&name, opened.as_ref());
    if let (Err(Reject(_, why)), Some(s)) = (&result, &opened) {
        s.fail(StreamFailed::ProducerBroke {
            who: who.clone(),
            why: why.clone(),
        });
    }
    // Freeing a large arena (its pages, its mappings) takes a while: not
    // on a thread that serves other connections.
    if let Some(s) = opened {
        tokio::task::spawn_blocking(move || drop(s));
    }
    result
}

/// Starts the stream, sends the producer its arena, and once it asks for
/// its first slot (it has mapped the arena), seals the arena and opens the
/// stream to consumers. `None`: the producer left before that.
///
/// The arena is taken from the memory budget (a registration beyond it is
/// refused with the numbers) and allocated on a blocking thread: creating
/// gigabytes must not hold up the I/O threads that answer everyone else.
/// A producer that does not `Acquire` within the registration timeout
/// loses its registration, and the arena is freed.
async fn register(
    conn: &mut Connection,
    broker: &Broker,
    plan: StreamPlan,
    (uid, rejoin): (u32, Option<Rejoin>),
    who: &str,
) -> Result<Option<Arc<Stream>>, Reject> {
    let budget = broker.budget.clone();
    let stream = tokio::task::spawn_blocking(move || {
        Stream::start(plan, &budget, uid, &mut Shares::default())
    })
    .await
    .map_err(|e| Reject(ErrorCode::Internal, format!("creating the arena: {e}")))?
    .map_err(|e| match e {
        StartError::OverBudget(e) => Reject(ErrorCode::Busy, e.to_string()),
        StartError::Arena(e) => Reject(ErrorCode::Internal, e.to_string()),
    })?;
    if let Some(r) = rejoin {
        // Nobody has seen the new stream yet: it starts anywhere it has.
        if !stream.port().rejoin_at(&r) {
            return Err(Reject(
                ErrorCode::InvalidRequest,
                format!(
                    "cannot register `{}` again at epoch {} batch {}: past its last epoch or batch, or past epoch {} (the largest a stream counts)",
                    stream.name(),
                    r.epoch,
                    r.index,
                    crate::hub::MAX_EPOCH
                ),
            ));
        }
        tracing::info!(stream = %stream.name(), producer = %who, epoch = r.epoch, index = r.index, readers = r.readers, "producer registers again after a broker restart");
    }
    let registered = ServerMsg::Registered(Box::new(Registered {
        stream: stream.name().into(),
        schema: stream.plan.schema.clone(),
        rings: stream.plan.rings.clone(),
        layout: stream.plan.layout.clone(),
        slots: stream.plan.slots,
    }));
    let bytes =
        proto::encode(&registered).map_err(|e| Reject(ErrorCode::Internal, e.to_string()))?;
    if conn.send_with_arena(&bytes, &stream, &[]).await.is_err() {
        return Ok(None);
    }
    // The first request means the producer has mapped the arena: seal it
    // against every other writer, then let consumers in.
    let limit = broker.admission.limits().registration_timeout;
    let first = tokio::time::timeout(limit, conn.next())
        .await
        .map_err(|_| {
            Reject(
                ErrorCode::InvalidRequest,
                format!(
                    "stream `{}` was registered but not acquired within {} s (registration_timeout_s); its arena is freed",
                    stream.name(),
                    limit.as_secs()
                ),
            )
        })?;
    match first? {
        Some(ClientMsg::Acquire) => {}
        Some(ClientMsg::Goodbye | ClientMsg::Fail { .. }) | None => return Ok(None),
        Some(other) => {
            return Err(Reject(
                ErrorCode::InvalidRequest,
                format!("a producer's first request must be Acquire, not {other:?}"),
            ));
        }
    }
    stream
        .port()
        .seal()
        .map_err(|e| Reject(ErrorCode::Internal, format!("cannot seal the arena: {e}")))?;
    broker.open(stream.clone());
    tracing::info!(stream = %stream.name(), producer = %who, "external stream registered");
    Ok(Some(stream))
}

/// Hands out slots one at a time and publishes what the producer fills,
/// until it leaves, fails, or the broker stops.
async fn serve_slots(
    conn: &mut Connection,
    stream: &Stream,
    (who, mut hold): (&str, Option<Instant>),
    mut stop: watch::Receiver<bool>,
) -> Result<(), Reject> {
    let batch_size = stream.plan.schema.batch_size;
    let port = stream.port();
    let mut wants = true;
    let mut blocked_since = port.slots_full().then(Instant::now);
    let mut filling: Option<FillSlot> = None;
    let mut blocked = Duration::ZERO;
    loop {
        if wants && let Some(msg) = answer(port) {
            if let ServerMsg::Fill(w) = msg {
                blocked = blocked_since
                    .take()
                    .map(|t| t.elapsed())
                    .unwrap_or_default();
                filling = Some(w);
            }
            wants = false;
            if conn.send(&msg).await.is_err() {
                port.producer_done(who);
                return Ok(());
            }
        }
        let held_until = hold.unwrap_or_else(Instant::now);
        tokio::select! {
            _ = port.ready(), if wants => {}
            // Looks again: a consumer may have held it past the hold limit.
            _ = tokio::time::sleep(Port::HOLD_CHECK), if wants => {}
            _ = tokio::time::sleep_until(held_until.into()), if hold.is_some() => {
                hold = None;
                port.end_rejoin_hold();
            }
            _ = stop.changed() => {
                let _ = conn.send(&ServerMsg::Goodbye(GoodbyeReason::Shutdown)).await;
                return Ok(());
            }
            m = conn.next() => match m? {
                Some(ClientMsg::Acquire) if !wants && filling.is_none() => {
                    wants = true;
                    blocked_since = port.slots_full().then(Instant::now);
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
                    port.publish(&w, samples, blocked);
                    filling = None;
                }
                Some(ClientMsg::Fail { message }) => {
                    stream.fail(StreamFailed::ProducerFailed { who: who.into(), message });
                    return Ok(());
                }
                Some(ClientMsg::Goodbye) | None => {
                    match filling {
                        Some(w) => stream.fail(StreamFailed::ProducerLeftMidBatch { who: who.into(), index: w.index, epoch: w.epoch }),
                        None => port.producer_done(who),
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

/// The answer to the producer's outstanding `Acquire`, if there is one now.
fn answer(port: Port<'_>) -> Option<ServerMsg> {
    match port.acquire() {
        Err(why) => Some(ServerMsg::Error(ErrorMsg {
            code: ErrorCode::SourceFailed,
            message: why.to_string(),
        })),
        Ok(Acquire::Ended) => Some(ServerMsg::EndOfStream),
        Ok(Acquire::Slot(w)) => Some(ServerMsg::Fill(w)),
        Ok(Acquire::Wait) => None,
    }
}
