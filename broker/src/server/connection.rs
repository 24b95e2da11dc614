//! One client connection: its socket and its frame buffer. Frames are read
//! into the buffer and taken off its front with [`proto::split_frame`] (no
//! I/O there); every write goes through here, so a message that cannot be
//! encoded is answered with an `Internal` error rather than a silence.

use std::os::fd::{AsRawFd, BorrowedFd};

use batchcast::proto::{self, ClientMsg, ErrorCode, ErrorMsg, Hello, Preamble, ServerMsg};
use batchcast::shm;
use batchcast_core::WireError;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;

use super::MAX_CLIENT_FRAME;
use crate::stream::Stream;

/// A protocol failure to report to the peer before closing.
pub(super) struct Reject(pub(super) ErrorCode, pub(super) String);

/// A client's connection.
pub(super) struct Connection {
    pub(super) sock: UnixStream,
    /// Bytes read and not yet taken as frames; at most a frame of
    /// [`MAX_CLIENT_FRAME`] and a read's worth (its memory is reserved
    /// in the budget, `FRAME_BUFFER_BYTES` per connection).
    buf: Vec<u8>,
}

impl Connection {
    pub(super) fn new(sock: UnixStream) -> Connection {
        Connection {
            sock,
            buf: Vec::with_capacity(4096),
        }
    }

    /// Exchanges preambles and reads the hello.
    pub(super) async fn handshake(&mut self) -> Result<Hello, Reject> {
        let mut pre = [0u8; Preamble::LEN];
        self.sock
            .read_exact(&mut pre)
            .await
            .map_err(|e| Reject(ErrorCode::MalformedFrame, format!("no preamble: {e}")))?;
        let _ = self.sock.write_all(&Preamble::ours().to_bytes()).await;
        let theirs = Preamble::parse(pre).map_err(|_| {
            Reject(
                ErrorCode::NotBatchcast,
                format!("not a batchcast client: the connection began with {pre:02x?}, not `BCST`"),
            )
        })?;
        if theirs.version != proto::PROTOCOL_VERSION {
            let why = proto::mismatch(Preamble::ours(), theirs, proto::Side::Broker);
            return Err(Reject(ErrorCode::VersionMismatch, why));
        }
        match self.next().await? {
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

    /// Reads until one frame is complete. Cancel-safe: bytes read stay in
    /// the buffer.
    pub(super) async fn next(&mut self) -> Result<Option<ClientMsg>, Reject> {
        loop {
            if let Some(m) = self.take_frame()? {
                return Ok(Some(m));
            }
            match self.sock.read_buf(&mut self.buf).await {
                Ok(0) if self.buf.is_empty() => return Ok(None),
                Ok(0) => {
                    return Err(Reject(
                        ErrorCode::MalformedFrame,
                        "connection closed inside a frame".into(),
                    ));
                }
                Ok(_) => {}
                // A peer that exits with data unread (a consumer killed, or
                // one leaving with batches held) resets the connection:
                // between frames that is a close like any other.
                Err(e)
                    if e.kind() == std::io::ErrorKind::ConnectionReset && self.buf.is_empty() =>
                {
                    return Ok(None);
                }
                Err(e) => {
                    return Err(Reject(
                        ErrorCode::MalformedFrame,
                        format!("read failed: {e}"),
                    ));
                }
            }
        }
    }

    /// Takes one complete frame off the front of the buffer, if there is one.
    fn take_frame(&mut self) -> Result<Option<ClientMsg>, Reject> {
        match proto::split_frame(&self.buf, MAX_CLIENT_FRAME as u32) {
            Ok(Some((msg, used))) => {
                self.buf.drain(..used);
                Ok(Some(msg))
            }
            Ok(None) => Ok(None),
            Err(e @ WireError::FrameTooLarge { len, max }) => Err(Reject(
                ErrorCode::FrameTooLarge,
                match len > u64::from(proto::MAX_FRAME) {
                    true => e.to_string(),
                    false => {
                        format!("a frame of {len} bytes; a client's frames are at most {max} bytes")
                    }
                },
            )),
            Err(e) => Err(Reject(
                ErrorCode::MalformedFrame,
                format!("malformed frame: {e}"),
            )),
        }
    }

    /// Writes one message. One that cannot be encoded (over a frame: never
    /// expected, replies are bounded by construction) is logged and
    /// answered with an `Internal` error instead, so the peer is never left
    /// waiting.
    pub(super) async fn send(&mut self, msg: &ServerMsg) -> std::io::Result<()> {
        let bytes = match proto::encode(msg) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!("cannot send a message: {e}");
                let error = ServerMsg::Error(ErrorMsg {
                    code: ErrorCode::Internal,
                    message: format!("the broker could not send its answer: {e}"),
                });
                let b = proto::encode(&error).map_err(std::io::Error::other)?;
                self.sock.write_all(&b).await?;
                return Err(std::io::Error::other(e));
            }
        };
        self.sock.write_all(&bytes).await
    }

    /// Writes frames already encoded ([`append`]).
    pub(super) async fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.sock.write_all(bytes).await
    }

    /// Sends a welcome or registration frame with the arena fd (and a
    /// consumer's mailbox fd, after it) attached to its first byte.
    pub(super) async fn send_with_arena(
        &mut self,
        bytes: &[u8],
        stream: &Stream,
        more: &[BorrowedFd<'_>],
    ) -> std::io::Result<()> {
        let raw = self.sock.as_raw_fd();
        let mut fds = vec![stream.arena.fd()];
        fds.extend_from_slice(more);
        let n = self
            .sock
            .async_io(Interest::WRITABLE, || shm::send_with_fds(raw, bytes, &fds))
            .await?;
        self.sock.write_all(&bytes[n..]).await
    }
}

/// Appends `msg` as a frame to `out` (several messages, one write).
pub(super) fn append(out: &mut Vec<u8>, msg: &ServerMsg) {
    match proto::encode(msg) {
        Ok(b) => out.extend_from_slice(&b),
        Err(e) => tracing::error!("cannot encode {msg:?}: {e}"),
    }
}
