//! A feed's makers: their connections, let in by their hellos (read side
//! by side, each within [`HELLO_TIME`] of its accept), and each batch read
//! from them by its deadline.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::make::HELLO;

/// A maker's connection.
pub(super) struct Maker {
    pub(super) addr: SocketAddr,
    reader: BufReader<TcpStream>,
    pub(super) writer: TcpStream,
    /// How long it may take to send a batch (plus a second per
    /// [`BYTES_PER_SECOND`] of it), and when the one being read is due.
    pub(super) batch_timeout: Duration,
    due: Instant,
}

/// The slowest a maker's link is taken to be when a batch's deadline is
/// set: one second more for each 50 MiB.
const BYTES_PER_SECOND: u64 = 50 << 20;

impl Maker {
    /// Starts the clock on a batch of `bytes` bytes.
    pub(super) fn batch_due(&mut self, bytes: u64) {
        let allowed = self.batch_timeout + Duration::from_secs(bytes / BYTES_PER_SECOND);
        self.due = Instant::now() + allowed;
    }

    /// `buf.len()` bytes of the batch being read, by its deadline.
    pub(super) fn read_exact(&mut self, buf: &mut [u8]) -> anyhow::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let left = self.due.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "it sent {done} of the next {} bytes and then nothing within its deadline ({:.0} s a batch, --batch-timeout): is the node stopped or cut off?",
                    buf.len(),
                    self.batch_timeout.as_secs_f64()
                );
            }
            self.writer.set_read_timeout(Some(left))?;
            match self.reader.read(&mut buf[done..]) {
                Ok(0) => bail!("the maker closed its connection (see its log)"),
                Ok(k) => done += k,
                Err(e) if retry(&e) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// A read that ran out of time (the deadline decides) or was interrupted.
fn retry(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock
            | std::io::ErrorKind::TimedOut
            | std::io::ErrorKind::Interrupted
    )
}

/// How long a connection has, from its accept, to say its whole hello.
const HELLO_TIME: Duration = Duration::from_secs(5);
/// Connections whose hello is being read at once; past it the oldest is
/// dropped for the newest (so strangers opening connections cannot keep
/// a maker, which says hello as soon as it connects, out).
const PENDING_HELLOS: usize = 64;

/// Takes `n` makers' connections, each of which must say the token first;
/// others are dropped (and logged) without a word. Each connection's
/// hello is read on a thread of its own, within [`HELLO_TIME`] of its
/// accept, so a stranger that connects and says nothing, or drips, holds
/// no one: the makers are let in while strangers wait out their deadline.
pub(super) fn accept(
    listener: &TcpListener,
    n: usize,
    token: &str,
    timeout: Duration,
) -> anyhow::Result<Vec<Maker>> {
    let deadline = Instant::now() + timeout;
    listener.set_nonblocking(true)?;
    let token: Arc<str> = token.into();
    let (tx, rx) = mpsc::channel::<(u64, anyhow::Result<Maker>)>();
    // Connections whose hello is being read, oldest first (a clone each,
    // to cut it short).
    let mut pending: BTreeMap<u64, (SocketAddr, TcpStream)> = BTreeMap::new();
    let mut accepted = 0u64;
    let mut makers = Vec::with_capacity(n);
    while makers.len() < n {
        while let Ok((id, said)) = rx.try_recv() {
            let addr = pending.remove(&id).map(|p| p.0);
            match said {
                Ok(m) if makers.len() < n => makers.push(m),
                Ok(m) => tracing::warn!(addr = %m.addr, "a maker more than --makers: dropped"),
                Err(e) => {
                    tracing::warn!(
                        ?addr,
                        "a connection that is not one of this feed's makers: {e:#}"
                    )
                }
            }
        }
        if makers.len() >= n {
            break;
        }
        let (conn, addr) = match listener.accept() {
            Ok(c) => c,
            Err(e) if retry(&e) => {
                if Instant::now() >= deadline {
                    bail!(
                        "{} of {n} makers connected within {:.0} s",
                        makers.len(),
                        timeout.as_secs_f64()
                    );
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if pending.len() >= PENDING_HELLOS
            && let Some((_, (old, conn))) = pending.pop_first()
        {
            tracing::warn!(addr = %old, "{PENDING_HELLOS} connections are saying hello at once: the oldest is dropped");
            let _ = conn.shutdown(Shutdown::Both);
        }
        let id = accepted;
        accepted += 1;
        let Ok(clone) = conn.try_clone() else {
            continue;
        };
        pending.insert(id, (addr, clone));
        let (tx, token) = (tx.clone(), token.clone());
        let due = Instant::now() + HELLO_TIME;
        let spawned = std::thread::Builder::new()
            .name("feed-hello".into())
            .spawn(move || {
                let _ = tx.send((id, hello(conn, addr, &token, due)));
            });
        if spawned.is_err()
            && let Some((_, conn)) = pending.remove(&id)
        {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
    // No one else gets in: hellos still being read are cut short.
    for (_, conn) in pending.values() {
        let _ = conn.shutdown(Shutdown::Both);
    }
    Ok(makers)
}

/// Reads a maker's first line (at most 256 bytes, all of it by `due`)
/// and checks its token.
fn hello(conn: TcpStream, addr: SocketAddr, token: &str, due: Instant) -> anyhow::Result<Maker> {
    conn.set_nonblocking(false)?;
    conn.set_nodelay(true)?;
    let mut reader = BufReader::with_capacity(1 << 20, conn.try_clone()?);
    let mut line = Vec::new();
    while line.last() != Some(&b'\n') && line.len() < 256 {
        let left = due.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!(
                "it did not say hello within {} s of connecting",
                HELLO_TIME.as_secs()
            );
        }
        conn.set_read_timeout(Some(left))?;
        let room = 256 - line.len() as u64;
        match reader.by_ref().take(room).read_until(b'\n', &mut line) {
            Ok(0) => bail!("it closed the connection before its hello"),
            Ok(_) => {}
            Err(e) if retry(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let said = String::from_utf8_lossy(&line);
    let given = said
        .trim_end()
        .strip_prefix(HELLO)
        .map(str::trim)
        .context("it did not say hello as a maker")?;
    if !same(given.as_bytes(), token.as_bytes()) {
        bail!("wrong token");
    }
    conn.set_read_timeout(None)?;
    Ok(Maker {
        addr,
        reader,
        writer: conn,
        batch_timeout: Duration::from_secs(20),
        due: Instant::now(),
    })
}

/// `a == b` in a time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
