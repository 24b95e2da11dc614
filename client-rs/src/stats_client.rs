//! [`StatsClient`]: a connection that asks a broker what it is doing, and
//! the launcher's one control message (`SetMinConsumers`).

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::proto::{self, ClientMsg, Hello, Intent, ServerMsg, StatsReply};
use crate::transport::{broker_error, connect_retrying, handshake, read_server_msg};

/// A connection that asks a broker for statistics.
#[derive(Debug)]
pub struct StatsClient {
    stream: UnixStream,
    buf: Vec<u8>,
    socket: Option<PathBuf>,
}

impl StatsClient {
    pub fn connect(socket: Option<PathBuf>) -> Result<StatsClient> {
        let mut c = connect_retrying(
            socket.clone(),
            (Duration::ZERO, crate::transport::HANDSHAKE_FLOOR),
            None,
            StatsClient::open,
        )?;
        c.socket = socket;
        // A broker that stops answering fails a request, never hangs it.
        c.stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(c)
    }

    fn open(stream: UnixStream) -> Result<StatsClient> {
        let hello = ClientMsg::Hello(Hello {
            name: "stats".into(),
            pid: std::process::id(),
            intent: Intent::Stats,
        });
        let (first, _) = handshake(&stream, &hello)?;
        if let ServerMsg::Error(e) = first {
            return Err(broker_error(e));
        }
        Ok(StatsClient {
            stream,
            buf: Vec::new(),
            socket: None,
        })
    }

    pub fn fetch(&mut self) -> Result<StatsReply> {
        self.ask(&ClientMsg::StatsRequest)
    }

    /// Tells the broker that `stream` should wait for `min` consumers
    /// before it starts (a launcher whose trainer died before subscribing
    /// lowers it); no effect once the stream has started. Answers with the
    /// stats after that.
    pub fn set_min_consumers(&mut self, stream: &str, min: u32) -> Result<StatsReply> {
        self.ask(&ClientMsg::SetMinConsumers {
            stream: stream.into(),
            min,
        })
    }

    /// Asks, and if the broker had closed this connection for idleness
    /// (`idle_timeout_s`), asks again once on a new one. Both requests are
    /// idempotent.
    fn ask(&mut self, msg: &ClientMsg) -> Result<StatsReply> {
        match self.ask_once(msg) {
            Err(e)
                if e.code() == Some(crate::ErrorCode::Idle) || matches!(e, Error::BrokerGone) =>
            {
                *self = StatsClient::connect(self.socket.clone())?;
                self.ask_once(msg)
            }
            other => other,
        }
    }

    fn ask_once(&mut self, msg: &ClientMsg) -> Result<StatsReply> {
        // The broker may have closed an idle connection: a failed write is
        // read past, to the reason it left in the socket.
        if let Err(e) = proto::write_frame(&mut self.stream, msg) {
            tracing::debug!("stats request not sent: {e}");
        }
        match read_server_msg(&mut self.stream, &mut self.buf)? {
            ServerMsg::Stats(s) => Ok(*s),
            ServerMsg::Error(e) => Err(broker_error(e)),
            other => Err(Error::Unexpected(format!("{other:?}"))),
        }
    }
}

/// The name of the broker's threads that fetch from remote stores: a stats
/// reader (`batchcast doctor`) finds their CPU time in `/proc` by it.
pub const REMOTE_THREADS: &str = "batchcast-remote";

/// The name prefix of stream `stream`'s pipeline threads in the broker, as
/// [`REMOTE_THREADS`].
pub fn pipeline_threads(stream: &str) -> String {
    format!("{stream}-worker-")
}
