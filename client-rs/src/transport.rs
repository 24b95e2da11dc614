//! The client's side of the socket, used by the consumer, the producer
//! and the stats client alike: where the broker listens, connecting with
//! retries, the handshake (preambles, the hello, a first reply that may
//! carry file descriptors), frames in both directions, and waiting for the
//! socket to become readable. A dead broker is always [`Error::BrokerGone`],
//! never a SIGPIPE or a hang.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use batchcast_core::WireError;

use crate::error::{Error, Result};
use crate::proto::{self, ClientMsg, ErrorCode, ErrorMsg, GoodbyeReason, Preamble, ServerMsg};
use crate::shm;

/// Where to find the broker when no socket is given: `$BATCHCAST_SOCKET`,
/// else `$XDG_RUNTIME_DIR/batchcast.sock`, else
/// `/tmp/batchcast-<uid>/batchcast.sock`.
pub fn default_socket_path() -> PathBuf {
    if let Some(p) = std::env::var_os(crate::options::env_var("socket")).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR").filter(|p| !p.is_empty()) {
        return PathBuf::from(dir).join("batchcast.sock");
    }
    PathBuf::from(format!("/tmp/batchcast-{}", nix::unistd::getuid())).join("batchcast.sock")
}

/// Why connecting to `path` failed: [`Error::Denied`] (with the socket's
/// mode and owner, or its folder's) where the file system kept this user
/// out, else [`Error::Connect`].
fn connect_error(path: &Path, source: std::io::Error) -> Error {
    use std::os::unix::fs::MetadataExt;
    if source.kind() != std::io::ErrorKind::PermissionDenied {
        return Error::Connect {
            path: path.into(),
            source,
        };
    }
    let what = match std::fs::metadata(path) {
        Ok(m) => format!("mode {:o}, owned by uid {}", m.mode() & 0o777, m.uid()),
        Err(_) => {
            let dir = path.parent().unwrap_or(Path::new("/"));
            match std::fs::metadata(dir) {
                Ok(m) => format!(
                    "its folder {} has mode {:o} and is owned by uid {}",
                    dir.display(),
                    m.mode() & 0o777,
                    m.uid()
                ),
                Err(e) => format!("its folder {}: {e}", dir.display()),
            }
        }
    };
    Error::Denied {
        path: path.into(),
        what,
        me: nix::unistd::getuid().as_raw(),
    }
}

/// This program's file name (for `batchcast stats`), else `fallback`.
pub(crate) fn program_name(fallback: &str) -> String {
    let name = std::env::args()
        .next()
        .and_then(|a| {
            PathBuf::from(a)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| fallback.into());
    fit_name(&name)
}

/// A name the broker accepts ([`proto::check_peer_name`]): control
/// characters dropped, cut to [`proto::MAX_NAME_BYTES`] on a character
/// boundary. For names the client makes up; a name the program gives is
/// sent as it is, and a bad one is refused with the reason.
pub(crate) fn fit_name(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars().filter(|c| !c.is_control()) {
        if out.len() + c.len_utf8() > proto::MAX_NAME_BYTES {
            break;
        }
        out.push(c);
    }
    out
}

/// Sends one frame; a dead broker is [`Error::BrokerGone`], never SIGPIPE.
pub(crate) fn send_msg(stream: &UnixStream, msg: &ClientMsg) -> Result<()> {
    let bytes = proto::encode(msg)?;
    let fd = stream.as_raw_fd();
    let mut off = 0;
    while off < bytes.len() {
        match nix::sys::socket::send(fd, &bytes[off..], nix::sys::socket::MsgFlags::MSG_NOSIGNAL) {
            Ok(n) => off += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::EPIPE | nix::errno::Errno::ECONNRESET) => {
                return Err(Error::BrokerGone);
            }
            Err(e) => return Err(Error::Io(e.into())),
        }
    }
    Ok(())
}

/// Connects to the broker's socket, retrying for up to `timeout` while it
/// is not there yet, checks that the process listening is the broker
/// expected (see [`check_broker`]), and runs `attempt` on the connection;
/// an attempt that fails with [`Error::is_not_ready`] is retried too.
/// However little of `timeout` is left, a live broker gets `floor` to
/// answer ([`HANDSHAKE_FLOOR`], more for work it must do first).
pub(crate) fn connect_retrying<T>(
    socket: Option<PathBuf>,
    (timeout, floor): (Duration, Duration),
    broker_uid: Option<u32>,
    mut attempt: impl FnMut(UnixStream) -> Result<T>,
) -> Result<T> {
    let path = socket.unwrap_or_else(default_socket_path);
    let deadline = std::time::Instant::now() + timeout;
    loop {
        // However long is left, a live broker gets a moment to answer.
        let patience = deadline
            .saturating_duration_since(std::time::Instant::now())
            .max(floor);
        let result = UnixStream::connect(&path)
            .map_err(|source| connect_error(&path, source))
            .and_then(|s| check_broker(&s, &path, broker_uid).map(|()| s))
            .and_then(|s| with_deadline(s, patience, &mut attempt))
            .map_err(|e| match e {
                Error::Io(io)
                    if matches!(
                        io.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    Error::HandshakeTimeout {
                        path: path.clone(),
                        waited: patience,
                    }
                }
                other => other,
            });
        match result {
            Err(e) if e.is_not_ready() && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            other => return other,
        }
    }
}

/// The least time a handshake is given, whatever is left of the connect
/// timeout (a broker answers in microseconds when it is well).
pub(crate) const HANDSHAKE_FLOOR: Duration = Duration::from_secs(2);

/// Runs `attempt` (the handshake and whatever the connection's kind reads
/// next) with every read and write on `s` bounded by `patience`, then
/// lifts the bounds for the connection's life: a broker that accepts and
/// then says nothing cannot hold a client past its connect timeout.
fn with_deadline<T>(
    s: UnixStream,
    patience: Duration,
    attempt: &mut impl FnMut(UnixStream) -> Result<T>,
) -> Result<T> {
    // A clone shares the socket, and with it the timeouts.
    let ctl = s.try_clone()?;
    ctl.set_read_timeout(Some(patience))?;
    ctl.set_write_timeout(Some(patience))?;
    let r = attempt(s)?;
    ctl.set_read_timeout(None)?;
    ctl.set_write_timeout(None)?;
    Ok(r)
}

/// The uid a broker must run as: `expected`, else `$BATCHCAST_BROKER_UID`,
/// else this process's own.
pub(crate) fn expected_broker_uid(expected: Option<u32>) -> u32 {
    expected
        .or_else(|| {
            std::env::var(crate::options::env_var("broker_uid"))
                .ok()
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or_else(|| nix::unistd::geteuid().as_raw())
}

/// Checks whom the socket leads to, from the kernel's record of the
/// listening process (`SO_PEERCRED`): anyone who could replace the socket
/// file could otherwise serve forged batches to this trainer.
fn check_broker(stream: &UnixStream, path: &std::path::Path, expected: Option<u32>) -> Result<()> {
    let cred = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| Error::Io(e.into()))?;
    let expected = expected_broker_uid(expected);
    if cred.uid() != expected {
        return Err(Error::Impostor {
            path: path.into(),
            uid: cred.uid(),
            expected,
        });
    }
    Ok(())
}

/// Sends the preamble and `hello`, checks the broker's preamble and reads
/// its first frame with any fds attached to it. Reads exactly what it needs:
/// reading an fd-carrying message with plain `read` would drop the fd.
pub(crate) fn handshake(
    stream: &UnixStream,
    hello: &ClientMsg,
) -> Result<(ServerMsg, Vec<OwnedFd>)> {
    let mut out = Preamble::ours().to_bytes().to_vec();
    out.extend_from_slice(&proto::encode(hello)?);
    let mut w = stream;
    // A broker that refuses a peer at accept (allow list, connection
    // limits) writes its reason and closes without reading: the write may
    // fail, and the reason is still there to read.
    let written = std::io::Write::write_all(&mut w, &out);
    let mut pre = [0u8; Preamble::LEN];
    let mut r = stream;
    if let Err(e) = r.read_exact(&mut pre) {
        return Err(match (written, e.kind()) {
            (Err(w), _) => Error::Io(w),
            (Ok(()), std::io::ErrorKind::UnexpectedEof) => Error::BrokerGone,
            (Ok(()), _) => Error::Io(e),
        });
    }
    Preamble::parse(pre)?.check()?;
    let mut fds = Vec::new();
    let mut len = [0u8; 4];
    recv_exact(stream, &mut len, &mut fds)?;
    let mut payload = vec![0u8; proto::check_len(u32::from_le_bytes(len))?];
    recv_exact(stream, &mut payload, &mut fds)?;
    Ok((proto::decode(&payload)?, fds))
}

fn recv_exact(stream: &UnixStream, mut buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<()> {
    while !buf.is_empty() {
        match shm::recv_with_fds(stream.as_raw_fd(), buf) {
            Ok((0, _)) => return Err(Error::BrokerGone),
            Ok((n, got)) => {
                fds.extend(got);
                buf = &mut buf[n..];
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

pub(crate) fn readable_within(stream: &UnixStream, ms: u16) -> Result<bool> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let fd = std::os::fd::AsFd::as_fd(stream);
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    loop {
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(n) => return Ok(n > 0),
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(Error::Io(e.into())),
        }
    }
}

/// The broker's first reply, as the connection's kind expects it: `pick`
/// takes the message it wants; an error from the broker becomes
/// [`Error::Broker`] and anything else [`Error::Unexpected`] naming `what`
/// was expected.
pub(crate) fn expect_reply<T>(
    reply: ServerMsg,
    what: &str,
    pick: impl FnOnce(ServerMsg) -> Result<T, ServerMsg>,
) -> Result<T> {
    match pick(reply) {
        Ok(t) => Ok(t),
        Err(ServerMsg::Error(e)) => Err(broker_error(e)),
        Err(other) => Err(Error::Unexpected(format!("{other:?} instead of {what}"))),
    }
}

/// The error the broker sent.
pub(crate) fn broker_error(e: ErrorMsg) -> Error {
    Error::Broker {
        code: e.code,
        message: e.message,
    }
}

/// The broker said goodbye where a reply was expected.
pub(crate) fn goodbye_error(reason: GoodbyeReason) -> Error {
    match reason {
        // It is stopping: the same as its going away (a consumer that may
        // reconnect waits for the next one).
        GoodbyeReason::Shutdown => Error::BrokerShutdown,
        GoodbyeReason::Detached => Error::Broker {
            code: ErrorCode::StreamEnded,
            message: format!("the broker said goodbye ({reason:?})"),
        },
    }
}

/// Reads the next frame; the connection closing, cleanly or not, is
/// [`Error::BrokerGone`].
/// What to report when a send found the broker gone (`sent` failed with
/// [`Error::BrokerGone`]): the reason it left in the socket before closing
/// (an error, a goodbye), if it left one. The socket is closed on its side,
/// so reading does not block.
pub(crate) fn last_words(r: &mut impl Read, buf: &mut Vec<u8>, sent: Error) -> Error {
    if !matches!(sent, Error::BrokerGone) {
        return sent;
    }
    loop {
        match read_server_msg(r, buf) {
            Ok(ServerMsg::Error(e)) => return broker_error(e),
            Ok(ServerMsg::Goodbye(reason)) => return goodbye_error(reason),
            // Messages sent before the reason.
            Ok(_) => {}
            Err(_) => return sent,
        }
    }
}

pub(crate) fn read_server_msg(r: &mut impl Read, buf: &mut Vec<u8>) -> Result<ServerMsg> {
    match proto::read_frame(r, buf) {
        Ok(Some(m)) => Ok(m),
        Ok(None) => Err(Error::BrokerGone),
        Err(WireError::Io(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            Err(Error::BrokerGone)
        }
        Err(e) => Err(e.into()),
    }
}
