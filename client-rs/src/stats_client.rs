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
}

impl StatsClient {
    pub fn connect(socket: Option<PathBuf>) -> Result<StatsClient> {
        connect_retrying(socket, Duration::ZERO, None, StatsClient::open)
    }

    fn open(stream: UnixStream) -> Result<StatsClient> {
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
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

    fn ask(&mut self, msg: &ClientMsg) -> Result<StatsReply> {
        proto::write_frame(&mut self.stream, msg)?;
        match read_server_msg(&mut self.stream, &mut self.buf)? {
            ServerMsg::Stats(s) => Ok(*s),
            ServerMsg::Error(e) => Err(broker_error(e)),
            other => Err(Error::Unexpected(format!("{other:?}"))),
        }
    }
}
