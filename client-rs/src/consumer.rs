//! The blocking consumer client.
//!
//! Epochs are visible in two ways: every [`Batch`] carries its epoch and its
//! index in the epoch, and [`Consumer::next_event`] also yields
//! [`Event::EndOfEpoch`] after the last batch of each epoch. Iterating a
//! [`Consumer`] yields only the batches, across all epochs, and ends when
//! the stream ends.

use std::collections::VecDeque;
use std::io::BufReader;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod clock;
mod events;
mod link;
mod options;
mod place;
pub(crate) use options::seconds;
mod reconnect;
mod replay;
mod rotate;
mod state;
mod wait;

pub use options::{ConsumerOptions, DEFAULT_RECONNECT_TIMEOUT, group_from_env};
pub use state::{ConsumerState, GroupPlace};

/// How long a consumer holding its whole window waits for a message
/// before calling it [`Error::WindowFull`].
const WINDOW_FULL_GRACE_MS: u16 = 50;

use crate::batch::{Batch, Batching, HostArena, ReplayArena, Shared, TakenTally};
use crate::batcher::{Batcher, Run};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::mailbox::{ConsumerMailbox, Totals};
use crate::proto::{
    ClientMsg, ConsumeRequest, EpochEnd, Hello, Intent, Position, ServerMsg, Welcome,
};
use crate::schema::Schema;
use crate::transport::{connect_retrying, expect_reply, handshake};

/// What the broker says next.
#[derive(Debug)]
pub enum Event {
    Batch(Batch),
    EndOfEpoch(EpochEnd),
    EndOfStream,
}

/// What the consumer hands out next, in order.
#[derive(Debug)]
enum Next {
    /// A batch: its run, when its last unit was sent, its unit's slot,
    /// and the host arena's region it is read in (the ring's when the run
    /// was made: its units are there until released, whatever moves).
    Run(Run, u64, u32, Arc<crate::shm::Mapping>),
    /// A replayed batch (in the replay arena; `first_seq` is its seq).
    Replayed(Run),
    EndOfEpoch(EpochEnd),
    EndOfStream,
    /// The broker refused, detached or left; nothing follows.
    Fail(Error),
}

/// A subscription to one stream of a broker.
#[derive(Debug)]
pub struct Consumer {
    shared: Arc<Shared>,
    /// The connection: its reader and frame buffer, reconnects.
    link: link::Link,
    /// When the program asked, when the last batch came, since when it
    /// pins the ring.
    clock: clock::Clock,
    /// What it received and has not handed out, its place and its replay.
    inbox: events::Inbox,
    /// What it was asked for: a reconnect subscribes with it again.
    opts: ConsumerOptions,
}

impl Consumer {
    /// Connects to the broker, subscribes and maps the stream's arena.
    ///
    /// A broker that goes away before its welcome arrives (killed or
    /// restarted while this consumer subscribed) is waited for as one that
    /// goes away later is: up to `reconnect_timeout`.
    pub fn connect(opts: ConsumerOptions) -> Result<Consumer> {
        reconnect::first_connect(opts)
    }

    /// Where this consumer is, for a checkpoint: right after the last
    /// batch it handed out (see [`ConsumerState`]). Free: no message, no
    /// lock.
    pub fn state(&self) -> ConsumerState {
        let w = &self.shared.welcome;
        let group = self
            .opts
            .group
            .as_ref()
            .zip(self.deal())
            .map(|(seat, deal)| {
                let at = self.inbox.place.next_at;
                let (epoch, sample) = deal.round_of(at.epoch, at.sample);
                state::GroupPlace {
                    name: seat.name.clone(),
                    world: seat.world,
                    replicate: seat.replicate,
                    round: Position { epoch, sample },
                }
            });
        ConsumerState {
            stream: w.stream.clone(),
            digest: w.digest,
            position: self.inbox.place.next_at,
            batch_size: w.batch_size,
            drop_last: w.drop_last,
            group,
            rotation: self.inbox.place.rotated.of_state(self.inbox.place.next_at),
        }
    }

    /// The stream's schema: fields, dtypes, shapes, batch size, epoch length.
    pub fn schema(&self) -> &Schema {
        &self.shared.welcome.schema
    }

    /// Times this consumer subscribed again after its broker went away
    /// ([`ConsumerOptions::reconnect_timeout`]); batch `seq`s start anew
    /// with each.
    pub fn reconnects(&self) -> u64 {
        self.link.reconnects
    }

    /// Everything the broker said on subscribing.
    pub fn welcome(&self) -> &Welcome {
        &self.shared.welcome
    }

    /// Batches received and not yet released.
    pub fn held(&self) -> u32 {
        self.shared.held.load(Ordering::Acquire)
    }

    /// This consumer's batch size (its own, or the stream's).
    pub fn batch_size(&self) -> u64 {
        self.shared.welcome.batch_size
    }

    /// A group member's share of each epoch ([`crate::deal`]); `None` for
    /// a consumer of the whole stream.
    pub fn deal(&self) -> Option<crate::deal::Deal> {
        self.inbox.deal
    }

    /// This consumer's batches in a whole epoch.
    pub fn batches_per_epoch(&self) -> u64 {
        let w = &self.shared.welcome;
        if let Some(deal) = self.inbox.deal {
            return deal.batches_per_epoch();
        }
        let n = w.schema.samples_per_epoch;
        if w.drop_last {
            n / w.batch_size
        } else {
            n.div_ceil(w.batch_size)
        }
    }

    /// Address and length of the stream's rings as mapped in this process:
    /// the views of every host batch handed out from now on lie inside
    /// (until the broker moves the ring to another region of the arena,
    /// [`crate::proto::ServerMsg::Arena`]).
    pub fn arena(&self) -> (*const u8, usize) {
        let map = self.shared.host.current();
        (map.as_ptr(), map.len())
    }

    /// Address and length of this consumer's replay arena, while it has
    /// one (`join = "now"`, or resuming behind the stream).
    pub fn replay_arena(&self) -> Option<(*const u8, usize)> {
        let r = self.shared.replay.as_ref()?;
        Some((r.map.as_ptr(), r.map.len()))
    }

    /// Waits up to `timeout` until [`Consumer::next_event`] will return
    /// without blocking for long (a batch within the window, an epoch's
    /// end, the stream's end, or an error). Takes what the broker has sent
    /// meanwhile. Lets callers stay interruptible.
    ///
    /// If the broker goes away meanwhile and `reconnect_timeout` allows,
    /// it waits for the broker (up to that timeout) and subscribes again
    /// from this consumer's next position (see [`ConsumerOptions::reconnect_timeout`]).
    /// That wait ends at `timeout` too (the consumer waits on at the next
    /// call), so a caller that checks for Ctrl-C between calls stays
    /// interruptible while its broker is down.
    pub fn wait_readable(&mut self, timeout: Duration) -> Result<bool> {
        let until = Instant::now() + timeout;
        loop {
            if self.link.down.is_some() {
                if !self.reconnect(Some(until))? {
                    return Ok(false);
                }
                continue;
            }
            let r = self.wait_readable_once(until.saturating_duration_since(Instant::now()));
            if let Some(ready) = self.ride_through(r)? {
                return Ok(ready);
            }
        }
    }

    fn wait_readable_once(&mut self, timeout: Duration) -> Result<bool> {
        self.clock.start_asking();
        let deadline = Instant::now() + timeout;
        loop {
            let shared = &self.shared;
            if self.link.finished || self.inbox.ready(shared) || self.link.buffered() {
                return Ok(true);
            }
            if shared.window_full() {
                if !self
                    .link
                    .poll_socket(&self.shared, &mut self.inbox, deadline)?
                {
                    return Ok(false);
                }
                continue;
            }
            if self.inbox.pinning(shared).is_some() {
                // `next_event` reports it once nothing came for a grace,
                // counted from the first call that found it so (a caller
                // polling in short steps still gets there).
                let grace = Duration::from_millis(WINDOW_FULL_GRACE_MS.into());
                let since = *self.clock.pinned_since.get_or_insert_with(Instant::now);
                if Instant::now() >= since + grace {
                    return Ok(true);
                }
                if !self.take_next((since + grace).min(deadline))? {
                    // Nothing came: the grace is over, unless the caller's
                    // own deadline ended the wait first.
                    return Ok(deadline > since + grace);
                }
                continue;
            }
            self.clock.pinned_since = None;
            if !self.take_next(deadline)? {
                return Ok(false);
            }
        }
    }

    /// Blocks for the broker's next event. `Ok(None)` once the stream has
    /// ended. Errors if the broker goes away (at once, never a hang), if it
    /// detached this consumer, or if this consumer holds its whole window
    /// (no batch could ever arrive).
    ///
    /// If the broker goes away and `reconnect_timeout` allows, it waits
    /// for the broker and goes on from this consumer's next position, the
    /// batches it holds still readable: no error, and every sample still
    /// once, in order ([`ConsumerOptions::reconnect_timeout`]).
    pub fn next_event(&mut self) -> Result<Option<Event>> {
        loop {
            if self.link.down.is_some() {
                self.reconnect(None)?;
                continue;
            }
            let r = self.next_event_once();
            if let Some(event) = self.ride_through(r)? {
                return Ok(event);
            }
        }
    }

    /// Takes the next message into the inbox, waiting until `deadline`;
    /// `false` if none came.
    fn take_next(&mut self, deadline: Instant) -> Result<bool> {
        let deferred = &mut self.inbox.place.deferred;
        let Some(msg) = self.link.receive(&self.shared, deferred, deadline)? else {
            return Ok(false);
        };
        self.inbox.intake(&self.shared, msg);
        Ok(true)
    }

    fn next_event_once(&mut self) -> Result<Option<Event>> {
        if self.link.finished {
            return Ok(None);
        }
        self.clock.start_asking();
        self.link.wait_for_fenced(&self.shared)?;
        let mut full_since = None;
        loop {
            match self.inbox.front() {
                Some(Next::Run(..) | Next::Replayed(_)) if !self.shared.window_full() => {
                    self.link.take_waiting(&self.shared, &mut self.inbox);
                    if matches!(self.inbox.front(), Some(Next::Run(..) | Next::Replayed(_))) {
                        return Ok(Some(self.inbox.hand_out(&self.shared, &mut self.clock)));
                    }
                    continue;
                }
                Some(Next::EndOfEpoch(_) | Next::EndOfStream | Next::Fail(_)) => {
                    let rides = !self.opts.reconnect_timeout.is_zero();
                    return self.inbox.pop_event(&mut self.clock, &mut self.link, rides);
                }
                _ => {}
            }
            if let Some(seq) = self.inbox.pinning(&self.shared) {
                // The broker cannot make the next batch until this program
                // releases an old one.
                let since = *self.clock.pinned_since.get_or_insert_with(Instant::now);
                if Instant::now() >= since + Duration::from_millis(WINDOW_FULL_GRACE_MS.into()) {
                    return Err(Error::RingPinned {
                        seq,
                        slots: self.shared.welcome.slots,
                    });
                }
                self.take_next(Instant::now() + Duration::from_millis(1))?;
                continue;
            }
            self.clock.pinned_since = None;
            if self.shared.window_full() {
                // No batch can be handed out until a release (by another
                // thread, or the garbage collector).
                let since = *full_since.get_or_insert_with(Instant::now);
                let grace = since + Duration::from_millis(WINDOW_FULL_GRACE_MS.into());
                if Instant::now() >= grace {
                    return Err(Error::WindowFull { held: self.held() });
                }
                self.link.poll_socket(
                    &self.shared,
                    &mut self.inbox,
                    grace.min(Instant::now() + Duration::from_millis(1)),
                )?;
                continue;
            }
            let far = Instant::now() + Duration::from_secs(3600);
            self.take_next(far)?;
        }
    }
}

/// Connects as `taken`'s consumer (a reconnect carries its number and
/// counts over).
fn connect_carrying(opts: ConsumerOptions, taken: TakenTally) -> Result<Consumer> {
    opts.validate()?;
    connect_retrying(
        opts.socket.clone(),
        (opts.connect_timeout, crate::transport::HANDSHAKE_FLOOR),
        opts.broker_uid,
        |stream| subscribe(stream, &opts, &taken),
    )
}

/// What `opts` asks the broker for (a state's stream, position, batch
/// size and digest where options do not say otherwise).
fn request(opts: &ConsumerOptions, taken: &TakenTally) -> Result<ConsumeRequest> {
    let state = opts.state.as_ref();
    let (resume, batch_size) = start_of(opts)?;
    Ok(ConsumeRequest {
        stream: state.map_or(&opts.stream, |s| &s.stream).clone(),
        window: opts.window,
        join: opts.join,
        device: opts.device.request()?,
        mailbox: opts.mailbox && opts.device == Device::Cpu,
        batch_size,
        drop_last: opts.drop_last.or(state.map(|s| s.drop_last)),
        resume,
        rotation: resume.and(state.and_then(|s| s.rotation)).map(Box::new),
        expect: state.map(|s| s.digest),
        group: opts.group.clone().map(Box::new),
        serial: taken.serial,
        taken: taken.load(),
    })
}

/// Says hello as a consumer on `stream`, and makes the consumer the
/// broker's welcome describes.
fn subscribe(stream: UnixStream, opts: &ConsumerOptions, taken: &TakenTally) -> Result<Consumer> {
    let hello = ClientMsg::Hello(Hello {
        name: opts.name.clone(),
        pid: std::process::id(),
        intent: Intent::Consume(request(opts, taken)?),
    });
    let (reply, fds) = handshake(&stream, &hello)?;
    let welcome = expect_reply(reply, "a welcome", |m| match m {
        ServerMsg::Welcome(w) => Ok(*w),
        other => Err(other),
    })?;
    let Arenas {
        host,
        mailbox,
        replay: replay_arena,
        device_fds,
    } = open_arenas(&welcome, fds)?;
    let gpu = crate::gpu::DeviceSide::open(
        opts.device,
        (
            welcome.device.as_ref(),
            welcome.replay.as_ref().and_then(|g| g.device.as_ref()),
        ),
        &welcome.schema,
        device_fds.into_iter(),
    )?;
    let (resume, _) = start_of(opts)?;
    let skip = welcome.replay.as_ref().map(|g| g.to).or(resume);
    let deal = deal_of(&welcome, opts);
    let batcher = batcher_for(&welcome, deal, skip);
    // A decoupled consumer is granted a replay arena with nothing to
    // replay yet (`from == to`).
    let replaying = welcome
        .replay
        .as_ref()
        .filter(|g| g.from < g.to)
        .map(|g| replay::Replaying::new(g, deal))
        // A group member none of whose runs lies in it has none to wait for.
        .filter(|r| !r.received());
    let replay_from = welcome.replay.as_ref().map(|g| g.from);
    let reader = BufReader::with_capacity(64 * 1024, stream.try_clone()?);
    let start_epoch = welcome.start_epoch;
    Ok(Consumer {
        shared: Arc::new(Shared {
            writer: Mutex::new(stream),
            host,
            batching: Mutex::new(Batching {
                batcher,
                totals: Totals::default(),
                scratch: Vec::with_capacity(16),
            }),
            welcome,
            held: AtomicU32::new(0),
            gpu,
            mailbox,
            replay: replay_arena,
            taken: taken.clone(),
        }),
        link: link::Link::new(reader, opts.spin),
        clock: clock::Clock::default(),
        inbox: events::Inbox {
            next: VecDeque::new(),
            place: place::Place::new(
                skip,
                resume.unwrap_or(Position {
                    epoch: start_epoch,
                    sample: 0,
                }),
                rotate::Rotated::resumed(resume.and(opts.state.as_ref().and_then(|s| s.rotation))),
            ),
            replay: replay::Replay {
                active: replaying,
                from: replay_from,
                seq: 0,
            },
            deal,
        },
        opts: opts.clone(),
    })
}

/// What a welcome's fds hold, mapped.
struct Arenas {
    host: HostArena,
    mailbox: Option<ConsumerMailbox>,
    replay: Option<ReplayArena>,
    /// The stand-in's device arenas (shared, then replay), for the device
    /// side to map.
    device_fds: Vec<OwnedFd>,
}

/// Maps what the welcome's fds hold, in order: the stream's rings, the
/// mailbox (if granted), the replay arena (if granted), each checked
/// against what the welcome says first; a stand-in's device arena fd, if
/// any, is the last.
fn open_arenas(welcome: &Welcome, fds: Vec<OwnedFd>) -> Result<Arenas> {
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
    let replay = match &welcome.replay {
        None => None,
        Some(g) => {
            let rfd = fds.next().ok_or_else(|| {
                Error::Shm("the broker granted replay but sent no fd for its arena".into())
            })?;
            Some(ReplayArena::open(rfd, g, welcome)?)
        }
    };
    welcome.rings.validate(&welcome.schema)?;
    let unit = welcome.schema.batch_size;
    if welcome.batch_size == 0
        || (welcome.batch_size != unit && welcome.rings.unmirrored().is_some())
    {
        return Err(Error::Schema(format!(
            "the broker granted batches of {} samples over units of {unit} it cannot serve",
            welcome.batch_size
        )));
    }
    let host = HostArena::open(fd, &welcome.rings, (welcome.region, welcome.regions))?;
    Ok(Arenas {
        host,
        mailbox,
        replay,
        device_fds: fds.collect(),
    })
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
        self.inbox.give_back_unread(&self.shared);
        let _ = self.shared.send(&ClientMsg::Goodbye);
    }
}

/// Where `opts` resume (a resume position, or its state's: a group
/// member's, its group's round) and in which batch size (`None`: the
/// stream's).
fn start_of(opts: &ConsumerOptions) -> Result<(Option<Position>, Option<u64>)> {
    match (&opts.state, opts.resume) {
        (Some(s), None) => {
            let (at, size) = s.resume_for(opts.group.as_ref(), opts.batch_size)?;
            Ok((Some(at), Some(size)))
        }
        (_, resume) => Ok((resume, opts.batch_size)),
    }
}

/// A group member's share of each epoch ([`crate::deal`]).
pub(super) fn deal_of(welcome: &Welcome, opts: &ConsumerOptions) -> Option<crate::deal::Deal> {
    let seat = opts.group.as_ref()?;
    Some(crate::deal::Deal::new(
        welcome.schema.samples_per_epoch,
        welcome.batch_size,
        (seat.rank, seat.world, seat.replicate),
        welcome.drop_last,
    ))
}

/// The batcher of a consumer just welcomed: its batch size over the
/// stream's units, its share if it is a group member, samples before its
/// start skipped.
fn batcher_for(
    welcome: &Welcome,
    deal: Option<crate::deal::Deal>,
    skip: Option<Position>,
) -> Batcher {
    let mut batcher = Batcher::new(
        welcome.batch_size,
        welcome.drop_last,
        welcome.schema.batch_size,
        welcome.schema.batches_per_epoch,
    );
    if let Some(deal) = deal {
        batcher = batcher.with_deal(deal);
    }
    if let Some(p) = skip {
        batcher.skip_to(p.epoch, p.sample);
    }
    batcher
}
