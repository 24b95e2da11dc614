//! Running under systemd (or anything that speaks its protocols): a
//! listening socket handed over by socket activation (`LISTEN_FDS`,
//! `LISTEN_PID`; `sd_listen_fds(3)`), and readiness and stopping reported
//! to the service manager (`NOTIFY_SOCKET`; `sd_notify(3)`).
//!
//! With socket activation the service manager owns the socket: it exists
//! before the broker starts and stays while the broker restarts, so a
//! trainer that connects meanwhile waits in the socket's queue instead of
//! finding no broker. The broker neither creates nor removes its file.

use std::io::ErrorKind;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixDatagram, UnixListener};
use std::path::PathBuf;

use nix::sys::socket::{self, SockType, sockopt};

/// The first file descriptor a service manager passes
/// (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: i32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum ActivationError {
    #[error(
        "LISTEN_FDS={0}: the service manager passed {0} sockets; batchcast serves one (give the .socket unit one ListenStream=)"
    )]
    Count(String),
    #[error(
        "the socket passed as fd 3 is not a listening Unix stream socket ({0}); the .socket unit must say ListenStream=/path/to/batchcast.sock"
    )]
    NotUnixStream(String),
}

/// The listening socket the service manager passed, if it passed one to
/// this process, with the path it is bound to. The variables are removed
/// so that nothing this process starts takes them for its own.
pub fn inherited_listener() -> Result<Option<(UnixListener, PathBuf)>, ActivationError> {
    let for_us = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        .is_some_and(|p| p == std::process::id());
    let count = std::env::var("LISTEN_FDS").ok();
    // SAFETY: called at start-up, before the broker starts any thread, so
    // no other thread reads or writes the environment meanwhile.
    unsafe {
        std::env::remove_var("LISTEN_PID");
        std::env::remove_var("LISTEN_FDS");
        std::env::remove_var("LISTEN_FDNAMES");
    }
    let Some(count) = count.filter(|_| for_us) else {
        return Ok(None);
    };
    if count.trim() != "1" {
        return Err(ActivationError::Count(count));
    }
    // Checked before it is owned: a descriptor that is not open is refused
    // here (`fcntl` fails), never closed or used.
    nix::fcntl::fcntl(
        // SAFETY: only borrowed for this one call, which fails harmlessly
        // (EBADF) if the descriptor is not open.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(LISTEN_FDS_START) },
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .map_err(|e| ActivationError::NotUnixStream(format!("fd 3: {e}")))?;
    // SAFETY: the service manager passed fd 3 to this process for it to
    // own (LISTEN_PID is ours, and it is open: checked above); nothing
    // else in this process uses it, and it is taken once, at start-up.
    let fd = unsafe { OwnedFd::from_raw_fd(LISTEN_FDS_START) };
    let bad = |why: String| ActivationError::NotUnixStream(why);
    let ty = socket::getsockopt(&fd.as_fd(), sockopt::SockType).map_err(|e| bad(e.to_string()))?;
    let listening =
        socket::getsockopt(&fd.as_fd(), sockopt::AcceptConn).map_err(|e| bad(e.to_string()))?;
    let addr: socket::UnixAddr = socket::getsockname(std::os::fd::AsRawFd::as_raw_fd(&fd))
        .map_err(|e| bad(e.to_string()))?;
    if ty != SockType::Stream || !listening {
        return Err(bad(format!("type {ty:?}, listening {listening}")));
    }
    let path = addr
        .path()
        .map(PathBuf::from)
        .ok_or_else(|| bad("an abstract or unnamed socket, which has no path".into()))?;
    Ok(Some((UnixListener::from(fd), path)))
}

/// Tells the service manager `state` (`READY=1`, `STOPPING=1`,
/// `STATUS=...`) when it asked to be told (`NOTIFY_SOCKET`); otherwise
/// does nothing. A failure is logged, never fatal: the broker serves
/// whether or not its manager hears it.
pub fn notify(state: &str) {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = UnixDatagram::unbound().and_then(|sock| {
        let bytes = target.as_encoded_bytes();
        match bytes.strip_prefix(b"@") {
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                sock.send_to_addr(state.as_bytes(), &addr)
            }
            None if bytes.starts_with(b"/") => sock.send_to(state.as_bytes(), &target),
            None => Err(std::io::Error::new(
                ErrorKind::InvalidInput,
                "not a socket path",
            )),
        }
    });
    match sent {
        Ok(_) => tracing::debug!("told the service manager {state:?}"),
        Err(e) => tracing::warn!(
            "NOTIFY_SOCKET={}: could not tell the service manager {state:?}: {e}",
            target.to_string_lossy()
        ),
    }
}
