//! A stats connection: the broker's numbers on each request, and the one
//! control message a launcher sends (`SetMinConsumers`).

use batchcast::proto::{ClientMsg, ErrorCode, ServerMsg};
use tokio::sync::watch;

use super::Broker;
use super::connection::{Connection, Reject};

pub(super) async fn serve_stats(
    conn: &mut Connection,
    broker: &Broker,
    uid: u32,
    mut stop: watch::Receiver<bool>,
) -> Result<(), Reject> {
    // An answer to the hello, so clients know they were admitted.
    let _ = conn.send(&ServerMsg::Stats(Box::new(broker.stats()))).await;
    let idle = broker.admission.limits().idle_timeout;
    loop {
        let msg = tokio::select! {
            m = tokio::time::timeout(idle, conn.next()) => match m {
                Ok(m) => m?,
                // Its place goes to someone else; `StatsClient` reconnects.
                Err(_) => return Err(Reject(
                    ErrorCode::Idle,
                    format!("no request for {} s (idle_timeout_s): closing this stats connection", idle.as_secs()),
                )),
            },
            _ = stop.changed() => return Ok(()),
        };
        match msg {
            Some(ClientMsg::StatsRequest) => {
                if conn
                    .send(&ServerMsg::Stats(Box::new(broker.stats())))
                    .await
                    .is_err()
                {
                    return Ok(());
                }
            }
            Some(ClientMsg::SetMinConsumers { stream, min }) => {
                let s = broker.lookup(&stream)?;
                broker
                    .admission
                    .may_control(uid, s.owner_uid, &stream)
                    .map_err(|r| Reject(r.code, r.message))?;
                if s.set_min_consumers(min) {
                    tracing::info!(stream = %stream, min, "asked to wait for a different number of consumers");
                }
                if conn
                    .send(&ServerMsg::Stats(Box::new(broker.stats())))
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
