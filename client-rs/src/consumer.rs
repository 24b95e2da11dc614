//! The blocking consumer client.
//!
//! Epochs are visible in two ways: every [`Batch`] carries its epoch and its
//! index in the epoch, and [`Consumer::next_event`] also yields
//! [`Event::EndOfEpoch`] after the last batch of each epoch. Iterating a
//! [`Consumer`] yields only the batches, across all epochs, and ends when
//! the stream ends.

use std::io::BufReader;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::batch::{Batch, Shared};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::mailbox::{ConsumerMailbox, Notice};
use crate::proto::{
    self, BatchReady, ClientMsg, EpochEnd, Hello, Intent, JoinPolicy, Release, ServerMsg, Welcome,
};
use crate::schema::Schema;
use crate::shm::Mapping;
use crate::transport::{
    broker_error, connect_retrying, expect_reply, goodbye_error, handshake, program_name,
    read_server_msg, readable_within,
};

/// How to connect. `Default` reads `BATCHCAST_SOCKET`, `BATCHCAST_STREAM`
/// (else `train`) and `BATCHCAST_NAME` from the environment.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// The broker's socket; `None` for [`crate::default_socket_path`].
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
    /// The uid the broker must run as; a socket served by anyone else is
    /// refused ([`Error::Impostor`]). `None`: `$BATCHCAST_BROKER_UID`, else
    /// this process's own uid.
    pub broker_uid: Option<u32>,
    /// Mailbox consumers: how long to poll for the next batch before
    /// sleeping (a sleeper costs the broker a wake-up system call). The
    /// poll yields the CPU between looks. Default: `$BATCHCAST_SPIN_US`
    /// microseconds, else 50.
    pub spin: Duration,
}

impl ConsumerOptions {
    /// Checks what can be checked before connecting: bindings call it (via
    /// [`Consumer::connect`]) rather than repeating the rules.
    pub fn validate(&self) -> Result<()> {
        if self.window == 0 {
            return Err(Error::InvalidOption("window must be at least 1".into()));
        }
        Ok(())
    }
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
            broker_uid: None,
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
            name: env("BATCHCAST_NAME").unwrap_or_else(|| program_name("consumer")),
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
        opts.validate()?;
        connect_retrying(
            opts.socket.clone(),
            opts.connect_timeout,
            opts.broker_uid,
            |stream| Consumer::subscribe(stream, &opts),
        )
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
        let (reply, fds) = handshake(&stream, &hello)?;
        let welcome = expect_reply(reply, "a welcome", |m| match m {
            ServerMsg::Welcome(w) => Ok(*w),
            other => Err(other),
        })?;
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
                Err(broker_error(e))
            }
            ServerMsg::Goodbye(reason) => {
                self.finished = true;
                Err(goodbye_error(reason))
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
        read_server_msg(&mut self.reader, &mut self.buf)
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
