//! The blocking consumer client.
//!
//! Epochs are visible in two ways: every [`Batch`] carries its epoch and its
//! index in the epoch, and [`Consumer::next_event`] also yields
//! [`Event::EndOfEpoch`] after the last batch of each epoch. Iterating a
//! [`Consumer`] yields only the batches, across all epochs, and ends when
//! the stream ends.

use std::io::{BufReader, Read};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::mailbox::{ConsumerMailbox, Notice};
use crate::proto::{
    self, BatchReady, ClientMsg, EpochEnd, Hello, Intent, JoinPolicy, Preamble, Release, ServerMsg,
    StatsReply, Welcome,
};
use crate::schema::{DType, Field, Schema};
use crate::shm::{self, Mapping};

/// Where to find the broker when no socket is given: `$BATCHCAST_SOCKET`,
/// else `$XDG_RUNTIME_DIR/batchcast.sock`, else
/// `/tmp/batchcast-<uid>/batchcast.sock`.
pub fn default_socket_path() -> PathBuf {
    if let Some(p) = std::env::var_os("BATCHCAST_SOCKET").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR").filter(|p| !p.is_empty()) {
        return PathBuf::from(dir).join("batchcast.sock");
    }
    PathBuf::from(format!("/tmp/batchcast-{}", nix::unistd::getuid())).join("batchcast.sock")
}

/// How to connect. `Default` reads `BATCHCAST_SOCKET`, `BATCHCAST_STREAM`
/// (else `train`) and `BATCHCAST_NAME` from the environment.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// The broker's socket; `None` for [`default_socket_path`].
    pub socket: Option<PathBuf>,
    /// The stream to subscribe to.
    pub stream: String,
    /// Most batches the program may hold (received, not released) at once,
    /// ≥ 1: it gets no more until it releases one. (A mailbox consumer is
    /// sent batches ahead of that; they wait in its mailbox, and are given
    /// back unread when it leaves.)
    pub window: u32,
    pub join: JoinPolicy,
    /// The name shown in `batchcast stats`.
    pub name: String,
    /// How long to keep retrying while the broker is not up yet or the
    /// stream is not registered yet (a producer still starting). Zero: fail
    /// at once. Default: `$BATCHCAST_CONNECT_TIMEOUT` seconds, else zero.
    pub connect_timeout: Duration,
    /// Where batches are delivered: host memory, or a GPU's memory (the
    /// broker copies each batch once per GPU; see [`Batch::device_ptr`]).
    /// Default: `$BATCHCAST_DEVICE`, else `cpu`.
    pub device: Device,
    /// Host consumers: take batch notices and give releases back through
    /// a [mailbox](crate::mailbox) in shared memory instead of the socket,
    /// which saves the broker two system calls per batch. Default: on,
    /// unless `$BATCHCAST_MAILBOX` is `0`.
    pub mailbox: bool,
    /// Mailbox consumers: how long to poll for the next batch before
    /// sleeping (a sleeper costs the broker a wake-up system call). The
    /// poll yields the CPU between looks. Default: `$BATCHCAST_SPIN_US`
    /// microseconds, else 50.
    pub spin: Duration,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        ConsumerOptions {
            socket: None,
            stream: env("BATCHCAST_STREAM").unwrap_or_else(|| "train".into()),
            window: 2,
            join: JoinPolicy::NextEpoch,
            device: env("BATCHCAST_DEVICE")
                .and_then(|d| d.parse().ok())
                .unwrap_or_default(),
            mailbox: env("BATCHCAST_MAILBOX").is_none_or(|v| v != "0"),
            spin: Duration::from_micros(
                env("BATCHCAST_SPIN_US")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(50),
            ),
            connect_timeout: env("BATCHCAST_CONNECT_TIMEOUT")
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(Duration::from_secs_f64)
                .unwrap_or_default(),
            name: env("BATCHCAST_NAME").unwrap_or_else(|| {
                std::env::args()
                    .next()
                    .and_then(|a| {
                        PathBuf::from(a)
                            .file_name()
                            .map(|n| n.to_string_lossy().into_owned())
                    })
                    .unwrap_or_else(|| "consumer".into())
            }),
        }
    }
}

/// State shared by a consumer and the batches it handed out: the mapping
/// stays mapped and the connection open until the last batch is dropped,
/// so a batch never reads a slot the broker has already reused.
#[derive(Debug)]
struct Shared {
    /// Write half, used by `release` from any thread.
    writer: Mutex<UnixStream>,
    map: Mapping,
    welcome: Welcome,
    /// Batches received and not yet released.
    held: AtomicU32,
    /// Device consumers: the stream's GPU arena in this process.
    gpu: Option<crate::gpu::DeviceSide>,
    mailbox: Option<ConsumerMailbox>,
}

impl Shared {
    fn send(&self, msg: &ClientMsg) -> Result<()> {
        let guard = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        send_msg(&guard, msg)
    }

    /// Sends the releases whose GPU work has finished; with `all`, waits
    /// for the rest first.
    fn flush_fenced(&self, all: bool) -> Result<()> {
        let Some(gpu) = &self.gpu else {
            return Ok(());
        };
        for release in gpu.finished_releases(all)? {
            self.send(&ClientMsg::Release(release))?;
        }
        Ok(())
    }

    fn fenced_pending(&self) -> bool {
        self.gpu.as_ref().is_some_and(|g| g.pending())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Device batches still in use by queued GPU work: wait for it, so
        // the broker never reuses their slots under a running kernel.
        if let Err(e) = self.flush_fenced(true) {
            tracing::debug!("final releases: {e}");
        }
    }
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
/// is not there yet, and runs `attempt` on the connection; an attempt that
/// fails with [`Error::is_not_ready`] is retried too.
pub(crate) fn connect_retrying<T>(
    socket: Option<PathBuf>,
    timeout: Duration,
    mut attempt: impl FnMut(UnixStream) -> Result<T>,
) -> Result<T> {
    let path = socket.unwrap_or_else(default_socket_path);
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let result = UnixStream::connect(&path)
            .map_err(|source| Error::Connect {
                path: path.clone(),
                source,
            })
            .and_then(&mut attempt);
        match result {
            Err(e) if e.is_not_ready() && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            other => return other,
        }
    }
}

/// What the broker says next.
#[derive(Debug)]
pub enum Event {
    Batch(Batch),
    EndOfEpoch(EpochEnd),
    EndOfStream,
}

/// A subscription to one stream of a broker.
#[derive(Debug)]
pub struct Consumer {
    shared: Arc<Shared>,
    reader: BufReader<UnixStream>,
    buf: Vec<u8>,
    finished: bool,
    spin: Duration,
    /// `CLOCK_MONOTONIC` ns when the program began asking for the next
    /// batch (its first `wait_readable` or `next_event` since the last
    /// one); 0 when it is not asking.
    asking_since: AtomicU64,
    /// When the last batch arrived; 0 at the start and after an epoch end
    /// (time between epochs is neither a training step nor a stall).
    last_batch_ns: u64,
    /// A mailbox consumer's next batch, read while the program held its
    /// whole window (the broker sends mailbox consumers every batch at
    /// once; the window is kept here).
    stash: Option<BatchReady>,
}

impl Consumer {
    /// Connects to the broker, subscribes and maps the stream's arena.
    pub fn connect(opts: ConsumerOptions) -> Result<Consumer> {
        if opts.window == 0 {
            return Err(Error::InvalidOption("window must be at least 1".into()));
        }
        connect_retrying(opts.socket.clone(), opts.connect_timeout, |stream| {
            Consumer::subscribe(stream, &opts)
        })
    }

    fn subscribe(stream: UnixStream, opts: &ConsumerOptions) -> Result<Consumer> {
        let hello = ClientMsg::Hello(Hello {
            name: opts.name.clone(),
            pid: std::process::id(),
            intent: Intent::Consume {
                stream: opts.stream.clone(),
                window: opts.window,
                join: opts.join,
                device: opts.device.request()?,
                mailbox: opts.mailbox && opts.device == Device::Cpu,
            },
        });
        let (welcome, fds) = handshake(&stream, &hello)?;
        let welcome = match welcome {
            ServerMsg::Welcome(w) => *w,
            ServerMsg::Error(e) => {
                return Err(Error::Broker {
                    code: e.code,
                    message: e.message,
                });
            }
            other => return Err(Error::Unexpected(format!("{other:?} instead of a welcome"))),
        };
        let mut fds = fds.into_iter();
        let fd = fds
            .next()
            .ok_or_else(|| Error::Shm("the broker's welcome carried no arena fd".into()))?;
        let mailbox = match welcome.mailbox {
            None => None,
            Some(spec) => {
                let mfd = fds.next().ok_or_else(|| {
                    Error::Shm("the broker granted a mailbox but sent no fd for it".into())
                })?;
                Some(ConsumerMailbox::open(mfd, spec)?)
            }
        };
        welcome.layout.validate(&welcome.schema)?;
        let arena_len = welcome
            .layout
            .slot_bytes
            .checked_mul(welcome.slots as u64)
            .ok_or_else(|| Error::Schema("arena size overflows".into()))?;
        let map = Mapping::map_readonly(std::os::fd::AsFd::as_fd(&fd), arena_len)?;
        drop::<OwnedFd>(fd); // the mapping keeps the memory alive
        let gpu = crate::gpu::DeviceSide::open(
            opts.device,
            welcome.device.as_ref(),
            welcome.layout.slot_bytes,
        )?;
        let reader = BufReader::with_capacity(64 * 1024, stream.try_clone()?);
        Ok(Consumer {
            shared: Arc::new(Shared {
                writer: Mutex::new(stream),
                map,
                welcome,
                held: AtomicU32::new(0),
                gpu,
                mailbox,
            }),
            reader,
            buf: Vec::with_capacity(256),
            finished: false,
            spin: opts.spin,
            asking_since: AtomicU64::new(0),
            last_batch_ns: 0,
            stash: None,
        })
    }

    /// The stream's schema: fields, dtypes, shapes, batch size, epoch length.
    pub fn schema(&self) -> &Schema {
        &self.shared.welcome.schema
    }

    /// Everything the broker said on subscribing.
    pub fn welcome(&self) -> &Welcome {
        &self.shared.welcome
    }

    /// Batches received and not yet released.
    pub fn held(&self) -> u32 {
        self.shared.held.load(Ordering::Acquire)
    }

    /// Address and length of the whole shared arena in this process.
    pub fn arena(&self) -> (*const u8, usize) {
        (self.shared.map.as_ptr(), self.shared.map.len())
    }

    /// Waits up to `timeout` for the broker's next message (or its going
    /// away) without consuming it: `true` means [`Consumer::next_event`]
    /// will not block for long. Lets callers stay interruptible.
    pub fn wait_readable(&self, timeout: Duration) -> Result<bool> {
        self.start_asking();
        if self.finished || !self.reader.buffer().is_empty() {
            return Ok(true);
        }
        if let Some(mb) = &self.shared.mailbox {
            return self.wait_mailbox_readable(mb, std::time::Instant::now() + timeout);
        }
        // Releases waiting for GPU work are sent as it finishes: the broker
        // may be waiting for one of them to send the next batch.
        let deadline = std::time::Instant::now() + timeout;
        loop {
            self.shared.flush_fenced(false)?;
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let step = if self.shared.fenced_pending() {
                left.min(Duration::from_millis(1))
            } else {
                left
            };
            let ms = u16::try_from(step.as_millis()).unwrap_or(u16::MAX);
            if readable_within(self.reader.get_ref(), ms)? {
                return Ok(true);
            }
            if left.is_zero() || step == left {
                return Ok(false);
            }
        }
    }

    /// Blocks for the broker's next event. `Ok(None)` once the stream has
    /// ended. Errors if the broker goes away (at once, never a hang), if it
    /// detached this consumer, or if this consumer holds its whole window
    /// (no batch could ever arrive).
    pub fn next_event(&mut self) -> Result<Option<Event>> {
        if self.finished {
            return Ok(None);
        }
        self.start_asking();
        self.wait_for_fenced()?;
        let msg = if self.shared.mailbox.is_some() {
            self.next_from_mailbox()?
        } else {
            if self.held() >= self.shared.welcome.window
                && self.reader.buffer().is_empty()
                && !readable_within(self.reader.get_ref(), WINDOW_FULL_GRACE_MS)?
            {
                return Err(Error::WindowFull { held: self.held() });
            }
            self.read_msg()?
        };
        let now = proto::monotonic_ns();
        match msg {
            ServerMsg::Batch(meta) => {
                let slots = match &self.shared.gpu {
                    Some(g) => g.slots(),
                    None => self.shared.welcome.slots,
                };
                if meta.slot >= slots || meta.samples > self.schema().batch_size {
                    return Err(Error::Unexpected(format!(
                        "batch refers to slot {} / {} samples outside the arena",
                        meta.slot, meta.samples
                    )));
                }
                self.shared.held.fetch_add(1, Ordering::AcqRel);
                let asked = self.asking_since.swap(0, Ordering::Relaxed);
                let busy_ns = match self.last_batch_ns {
                    0 => 0,
                    last => asked.saturating_sub(last),
                };
                self.last_batch_ns = now;
                Ok(Some(Event::Batch(Batch {
                    shared: self.shared.clone(),
                    meta,
                    wait_ns: now.saturating_sub(asked),
                    busy_ns,
                    received_ns: now,
                    released: false,
                })))
            }
            ServerMsg::EndOfEpoch(e) => {
                self.asking_since.store(0, Ordering::Relaxed);
                self.last_batch_ns = 0;
                Ok(Some(Event::EndOfEpoch(e)))
            }
            ServerMsg::EndOfStream => {
                self.finished = true;
                Ok(Some(Event::EndOfStream))
            }
            ServerMsg::Error(e) => {
                self.finished = true;
                Err(Error::Broker {
                    code: e.code,
                    message: e.message,
                })
            }
            ServerMsg::Goodbye(reason) => {
                self.finished = true;
                Err(Error::Broker {
                    code: proto::ErrorCode::StreamEnded,
                    message: format!("the broker said goodbye ({reason:?})"),
                })
            }
            other => Err(Error::Unexpected(format!("{other:?}"))),
        }
    }
}

/// How long a consumer holding its whole window waits for a message
/// before calling it [`Error::WindowFull`].
const WINDOW_FULL_GRACE_MS: u16 = 50;

/// Longest sleep of a mailbox consumer between looks at its socket (a
/// broker that dies rings no bell).
const MAILBOX_TICK: Duration = Duration::from_millis(50);

/// Why [`Consumer::wait_mailbox`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Woke {
    Notice,
    Socket,
    Timeout,
}

impl Consumer {
    /// Reads the next frame from the socket.
    fn read_msg(&mut self) -> Result<ServerMsg> {
        match proto::read_frame(&mut self.reader, &mut self.buf) {
            Ok(Some(m)) => Ok(m),
            Ok(None) => Err(Error::BrokerGone),
            Err(Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                Err(Error::BrokerGone)
            }
            Err(e) => Err(e),
        }
    }

    /// The next message of a mailbox consumer: a notice from the mailbox,
    /// else whatever the socket says (an error, a goodbye, the broker gone).
    ///
    /// The broker sends a mailbox consumer every batch as it is published;
    /// the window is kept here: while the program holds its whole window,
    /// the next batch waits (for a release from another thread, or until
    /// [`Error::WindowFull`]).
    fn next_from_mailbox(&mut self) -> Result<ServerMsg> {
        let shared = self.shared.clone();
        let mb = shared
            .mailbox
            .as_ref()
            .expect("called for mailbox consumers");
        let window = shared.welcome.window;
        let mut full_since = None;
        loop {
            if self.stash.is_none() {
                match mb.pop()? {
                    Some(Notice::Batch(b)) => self.stash = Some(b),
                    Some(Notice::EndOfEpoch(e)) => return Ok(ServerMsg::EndOfEpoch(e)),
                    Some(Notice::EndOfStream) => return Ok(ServerMsg::EndOfStream),
                    None => {}
                }
            }
            if self.stash.is_some() && self.held() < window {
                return Ok(ServerMsg::Batch(self.stash.take().expect("checked")));
            }
            if !self.reader.buffer().is_empty() {
                return self.read_msg();
            }
            let now = std::time::Instant::now();
            if self.held() >= window {
                let since = *full_since.get_or_insert(now);
                let grace = Duration::from_millis(WINDOW_FULL_GRACE_MS.into());
                if now.duration_since(since) >= grace {
                    return Err(Error::WindowFull { held: self.held() });
                }
                if self.stash.is_some() {
                    // Only a release by another thread can help now.
                    if readable_within(self.reader.get_ref(), 1)? {
                        return self.read_msg();
                    }
                    continue;
                }
                if self.wait_mailbox(mb, since + grace)? == Woke::Socket && !mb.has_notice() {
                    return self.read_msg();
                }
                continue;
            }
            let deadline = now + Duration::from_secs(3600);
            if self.wait_mailbox(mb, deadline)? == Woke::Socket && !mb.has_notice() {
                return self.read_msg();
            }
        }
    }

    /// Whether a mailbox consumer's [`Consumer::next_event`] returns at
    /// once: an epoch or stream end is next, or a batch and the program
    /// holds less than its window.
    fn mailbox_ready(&self, mb: &ConsumerMailbox) -> bool {
        let room = self.held() < self.shared.welcome.window;
        match (&self.stash, mb.next_is_batch()) {
            (Some(_), _) | (None, Some(true)) => room,
            (None, Some(false)) => true,
            (None, None) => false,
        }
    }

    /// [`Consumer::wait_readable`] for a mailbox consumer: a batch that
    /// came while the program holds its whole window is not ready until it
    /// releases one (from another thread, or the garbage collector).
    fn wait_mailbox_readable(
        &self,
        mb: &ConsumerMailbox,
        deadline: std::time::Instant,
    ) -> Result<bool> {
        loop {
            if self.mailbox_ready(mb) || !self.reader.buffer().is_empty() {
                return Ok(true);
            }
            if self.stash.is_some() || mb.has_notice() {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                let step = u16::try_from(left.as_millis().min(1)).unwrap_or(1);
                if readable_within(self.reader.get_ref(), step)? {
                    return Ok(true);
                }
                if left.is_zero() {
                    return Ok(false);
                }
                continue;
            }
            match self.wait_mailbox(mb, deadline)? {
                Woke::Notice => {}
                Woke::Socket => return Ok(true),
                Woke::Timeout => return Ok(false),
            }
        }
    }

    /// A mailbox consumer leaving: gives back the batches it was sent and
    /// will never read, so they pin no slot until the connection closes.
    fn give_back_unread(&mut self) {
        let Some(mb) = self.shared.mailbox.as_ref() else {
            return;
        };
        let mut unread: Vec<u64> = self.stash.take().map(|b| b.seq).into_iter().collect();
        loop {
            match mb.pop() {
                Ok(Some(Notice::Batch(b))) => unread.push(b.seq),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        for seq in unread {
            if !mb.push_release(seq, crate::mailbox::Totals::default()) {
                let _ = self.shared.send(&ClientMsg::Release(Release {
                    seq,
                    wait_ns: 0,
                    busy_ns: 0,
                }));
            }
        }
    }

    /// Waits for a notice, a socket message or `deadline`: polls for the
    /// spin time (yielding the CPU between looks), then sleeps on the bell,
    /// looking at the socket before each sleep.
    fn wait_mailbox(&self, mb: &ConsumerMailbox, deadline: std::time::Instant) -> Result<Woke> {
        let start = std::time::Instant::now();
        let spin_until = (start + self.spin).min(deadline);
        let mut looks = 0u32;
        loop {
            if mb.has_notice() {
                return Ok(Woke::Notice);
            }
            let now = std::time::Instant::now();
            if now < spin_until {
                looks += 1;
                if looks < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
                continue;
            }
            let mut socket = Ok(false);
            if now >= deadline {
                socket = readable_within(self.reader.get_ref(), 0);
            } else {
                mb.sleep_unless((deadline - now).min(MAILBOX_TICK), || {
                    socket = readable_within(self.reader.get_ref(), 0);
                    !matches!(socket, Ok(false))
                });
            }
            if socket? {
                return Ok(Woke::Socket);
            }
            if now >= deadline {
                return Ok(Woke::Timeout);
            }
        }
    }

    /// Notes when the program began asking for a batch (data-stall time
    /// runs from there to the batch's arrival).
    fn start_asking(&self) {
        if self.asking_since.load(Ordering::Relaxed) != 0 {
            return; // still the same request (a polling loop)
        }
        let _ = self.asking_since.compare_exchange(
            0,
            proto::monotonic_ns(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Device consumers: sends the releases whose GPU work is done, and
    /// until none is left keeps doing so while no message has arrived (the
    /// broker may be waiting for them to send the next batch).
    fn wait_for_fenced(&mut self) -> Result<()> {
        self.shared.flush_fenced(false)?;
        while self.shared.fenced_pending()
            && self.reader.buffer().is_empty()
            && !readable_within(self.reader.get_ref(), 1)?
        {
            self.shared.flush_fenced(false)?;
        }
        Ok(())
    }

    /// Where this consumer's batches are delivered.
    pub fn device(&self) -> Device {
        self.shared.gpu.as_ref().map_or(Device::Cpu, |g| g.device())
    }
}

impl Iterator for Consumer {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        loop {
            match self.next_event() {
                Ok(Some(Event::Batch(b))) => return Some(Ok(b)),
                Ok(Some(Event::EndOfEpoch(_))) => continue,
                Ok(Some(Event::EndOfStream) | None) => return None,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        // Stop further deliveries now; batches still held are released when
        // they are dropped, and the connection closes with the last of them.
        self.give_back_unread();
        let _ = self.shared.send(&ClientMsg::Goodbye);
    }
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
    std::io::Write::write_all(&mut w, &out)?;
    let mut pre = [0u8; Preamble::LEN];
    let mut r = stream;
    r.read_exact(&mut pre).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => Error::BrokerGone,
        _ => Error::Io(e),
    })?;
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

/// Element types a field can be viewed as.
pub trait Element: bytemuck::Pod + sealed::Sealed {
    const DTYPE: DType;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64, i64 => I64,
         half::f16 => F16, half::bf16 => Bf16, f32 => F32, f64 => F64);

/// One batch in shared memory. Read-only; released when dropped (or with
/// [`Batch::release`]).
#[derive(Debug)]
pub struct Batch {
    shared: Arc<Shared>,
    meta: BatchReady,
    wait_ns: u64,
    busy_ns: u64,
    received_ns: u64,
    released: bool,
}

impl Batch {
    pub fn seq(&self) -> u64 {
        self.meta.seq
    }
    pub fn epoch(&self) -> u64 {
        self.meta.epoch
    }
    /// Position of this batch in its epoch.
    pub fn index(&self) -> u64 {
        self.meta.index
    }
    /// Valid samples in this batch.
    pub fn len(&self) -> usize {
        self.meta.samples as usize
    }
    pub fn is_empty(&self) -> bool {
        self.meta.samples == 0
    }
    pub fn slot(&self) -> u32 {
        self.meta.slot
    }
    /// Nanoseconds the hand-off took: from the later of the broker sending
    /// the batch and the program asking for it, to this process having it.
    /// (A batch sent while the program was still busy with earlier ones
    /// waits in the mailbox or socket; that wait is the program's backlog,
    /// not the hand-off, and is not counted.)
    pub fn handoff_ns(&self) -> u64 {
        self.received_ns
            .saturating_sub(self.meta.sent_ns)
            .min(self.wait_ns)
    }
    /// Nanoseconds the program was blocked asking for this batch: from its
    /// first [`Consumer::wait_readable`] or [`Consumer::next_event`] call
    /// for it to its arrival (data stall).
    pub fn wait_ns(&self) -> u64 {
        self.wait_ns
    }
    /// Nanoseconds the program spent between the previous batch's arrival
    /// and asking for this one (its training step); 0 for an epoch's first.
    pub fn busy_ns(&self) -> u64 {
        self.busy_ns
    }
    pub fn schema(&self) -> &Schema {
        &self.shared.welcome.schema
    }

    /// A read-only view of field `name` in host memory. A device batch
    /// has none ([`Error::OnDevice`]): see [`Batch::device_ptr`] and
    /// [`Batch::copy_field`].
    pub fn field(&self, name: &str) -> Result<FieldView<'_>> {
        let schema = self.schema();
        let (i, _) = schema.field(name).ok_or_else(|| Error::NoSuchField {
            name: name.into(),
            available: schema
                .fields
                .iter()
                .map(|f| f.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })?;
        self.field_at(i)
    }

    /// Host views of every field, in schema order ([`Error::OnDevice`] for
    /// a device batch).
    pub fn fields(&self) -> Result<impl Iterator<Item = FieldView<'_>>> {
        self.host_only()?;
        Ok((0..self.schema().fields.len()).map(|i| self.host_view(i)))
    }

    /// The host view of field `i` (schema order).
    pub fn field_at(&self, i: usize) -> Result<FieldView<'_>> {
        self.host_only()?;
        if i >= self.schema().fields.len() {
            return Err(Error::NoSuchField {
                name: format!("#{i}"),
                available: format!("{} fields", self.schema().fields.len()),
            });
        }
        Ok(self.host_view(i))
    }

    /// Shape of field `i` (schema order) including the batch dimension.
    pub fn shape(&self, i: usize) -> Option<Vec<u64>> {
        let f = self.schema().fields.get(i)?;
        Some(
            std::iter::once(self.meta.samples)
                .chain(f.shape.iter().copied())
                .collect(),
        )
    }

    /// Field `i`'s bytes, copied to host memory: from the GPU for a device
    /// batch (checks and debugging, not the data path).
    pub fn copy_field(&self, i: usize) -> Result<Vec<u8>> {
        let Some(g) = &self.shared.gpu else {
            return Ok(self.field_at(i)?.bytes().to_vec());
        };
        let w = &self.shared.welcome;
        let fl = w.layout.fields.get(i).ok_or_else(|| Error::NoSuchField {
            name: format!("#{i}"),
            available: format!("{} fields", w.schema.fields.len()),
        })?;
        let mut out = vec![0; (fl.bytes_per_sample * self.meta.samples) as usize];
        g.read(
            self.meta.slot as u64 * w.layout.slot_bytes + fl.offset,
            &mut out,
        )?;
        Ok(out)
    }

    fn host_only(&self) -> Result<()> {
        match &self.shared.gpu {
            None => Ok(()),
            Some(g) => Err(Error::OnDevice {
                seq: self.meta.seq,
                device: g.device(),
            }),
        }
    }

    /// For a host batch only: a device batch's slot is a device slot.
    fn host_view(&self, i: usize) -> FieldView<'_> {
        let w = &self.shared.welcome;
        let fl = w.layout.fields[i];
        let start = self.meta.slot as u64 * w.layout.slot_bytes + fl.offset;
        let bytes = self
            .shared
            .map
            .get(start, fl.bytes_per_sample * self.meta.samples)
            .expect("layout validated against the mapping at connect");
        FieldView {
            field: &w.schema.fields[i],
            bytes,
            samples: self.meta.samples as usize,
        }
    }

    /// Where this batch lives: host memory, or a GPU.
    pub fn device(&self) -> Device {
        self.shared.gpu.as_ref().map_or(Device::Cpu, |g| g.device())
    }

    /// Device batches: the GPU address of field `i` (schema order). The
    /// broker finished copying them before it sent the batch, so any CUDA
    /// stream may read them at once. They must not be written: every
    /// consumer on this GPU reads the same memory. `None` for host batches.
    pub fn device_ptr(&self, i: usize) -> Option<u64> {
        let g = self.shared.gpu.as_ref()?;
        let w = &self.shared.welcome;
        let fl = w.layout.fields.get(i)?;
        Some(g.base() + self.meta.slot as u64 * w.layout.slot_bytes + fl.offset)
    }

    /// Device batches: also wait for the work queued so far on `stream` (a
    /// `CUstream`, or DLPack's `1`/`2` for the legacy and per-thread default
    /// streams) before the slot is given back. Without any, the legacy
    /// default stream is used.
    pub fn fence_on(&self, stream: u64) {
        if let Some(g) = &self.shared.gpu {
            g.fence_on(self.meta.seq, stream);
        }
    }

    /// Releases the slot now instead of at drop. For a device batch the
    /// release reaches the broker once the GPU work queued on its fence
    /// streams has finished (see [`Batch::fence_on`]).
    pub fn release(mut self) -> Result<()> {
        self.do_release()
    }

    fn do_release(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.released, true) {
            return Ok(());
        }
        self.shared.held.fetch_sub(1, Ordering::AcqRel);
        let release = Release {
            seq: self.meta.seq,
            wait_ns: self.wait_ns,
            busy_ns: self.busy_ns,
        };
        if let Some(g) = &self.shared.gpu {
            g.release_after_gpu(release)?;
            return self.shared.flush_fenced(false);
        }
        let totals = crate::mailbox::Totals {
            wait_ns: self.wait_ns,
            busy_ns: self.busy_ns,
            hold_ns: proto::monotonic_ns().saturating_sub(self.received_ns),
        };
        if let Some(mb) = &self.shared.mailbox
            && mb.push_release(release.seq, totals)
        {
            if mb.wants_doorbell() {
                return self.shared.send(&ClientMsg::Doorbell);
            }
            return Ok(());
        }
        self.shared.send(&ClientMsg::Release(release))
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Err(e) = self.do_release() {
            tracing::debug!("release of batch {} failed: {e}", self.meta.seq);
        }
    }
}

/// A read-only view of one field of a batch: `[samples, ...shape]`.
#[derive(Debug, Clone, Copy)]
pub struct FieldView<'a> {
    field: &'a Field,
    bytes: &'a [u8],
    samples: usize,
}

impl<'a> FieldView<'a> {
    pub fn name(&self) -> &'a str {
        &self.field.name
    }
    pub fn dtype(&self) -> DType {
        self.field.dtype
    }
    /// Shape including the batch dimension.
    pub fn shape(&self) -> Vec<u64> {
        std::iter::once(self.samples as u64)
            .chain(self.field.shape.iter().copied())
            .collect()
    }
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
    /// The bytes of sample `i`.
    pub fn sample(&self, i: usize) -> &'a [u8] {
        let n = self.bytes.len() / self.samples.max(1);
        &self.bytes[i * n..(i + 1) * n]
    }
    /// The elements, if `T` matches the field's dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&'a [T]> {
        if T::DTYPE != self.field.dtype {
            return Err(Error::DType {
                name: self.field.name.clone(),
                actual: self.field.dtype,
                requested: T::DTYPE,
            });
        }
        bytemuck::try_cast_slice(self.bytes)
            .map_err(|e| Error::Schema(format!("field `{}`: {e:?}", self.field.name)))
    }
}

/// A connection that asks a broker for statistics.
#[derive(Debug)]
pub struct StatsClient {
    stream: UnixStream,
    buf: Vec<u8>,
}

impl StatsClient {
    pub fn connect(socket: Option<PathBuf>) -> Result<StatsClient> {
        connect_retrying(socket, Duration::ZERO, StatsClient::open)
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
            return Err(Error::Broker {
                code: e.code,
                message: e.message,
            });
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
        match proto::read_frame(&mut self.stream, &mut self.buf)? {
            Some(ServerMsg::Stats(s)) => Ok(*s),
            Some(ServerMsg::Error(e)) => Err(Error::Broker {
                code: e.code,
                message: e.message,
            }),
            Some(other) => Err(Error::Unexpected(format!("{other:?}"))),
            None => Err(Error::BrokerGone),
        }
    }
}
