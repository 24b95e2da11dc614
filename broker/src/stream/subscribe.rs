//! Subscribing a consumer: its shape, mailbox, replay arena or GPU arena
//! are made outside the hub's lock (they take a while), then it joins the
//! hub, and replay starts if it needs any.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use batchcast::JoinPolicy;
use batchcast::mailbox::{Bell, BrokerMailbox};
use batchcast::proto::{ConsumeRequest, MailboxSpec, ReplayGrant, ServerMsg};
use tokio::sync::mpsc;

use super::conn::{Conn, Peer, Start};
use super::error::SubscribeError;
use super::replay::{self, ReplayFrom, book};
use super::shape::Shape;
use super::{Inner, Stream, decouple, mirror, seats};
use crate::config::Pace;
use crate::gpu::{Mirror, ReplayTarget};
use crate::hub::{ConsumerId, Delivery};

/// A mailbox granted to a consumer: the server sends its fd with the
/// welcome and rings its bell after each socket write.
#[derive(Debug)]
pub struct MailboxGrant {
    pub spec: MailboxSpec,
    pub fd: OwnedFd,
    pub(crate) bell: Bell,
}

/// What a consumer gets on subscribing.
#[derive(Debug)]
pub struct Subscription {
    pub id: ConsumerId,
    pub start_epoch: u64,
    pub shape: Shape,
    pub rx: mpsc::Receiver<ServerMsg>,
    /// Device consumers: their GPU's mirror (the arena to open, and for
    /// the stand-in its fd).
    pub device: Option<Arc<Mirror>>,
    pub mailbox: Option<MailboxGrant>,
    /// Replay granted: what the welcome says, and its arena's fd.
    pub replay: Option<(ReplayGrant, OwnedFd)>,
    /// A device consumer's own arena on its GPU for replayed batches (its
    /// fd, the stand-in's, follows the device arena's).
    pub device_replay: Option<Arc<ReplayTarget>>,
    /// The host arena's region the ring is in as it joins, and how many
    /// the arena has (`Welcome::region`; a move after it is sent as
    /// `ServerMsg::Arena`, after the welcome).
    pub region: (u32, u32),
}

/// A subscriber's replay arena, where it may need one.
struct ReplayArena {
    /// It may be replayed to (its mailbox has room for replayed batches).
    replays: bool,
    /// The arena stays for cuts (at once: decoupled; past the hold limit:
    /// lockstep), not only until a join's or resume's replay is done.
    kept: bool,
    prepared: Option<book::Prepared>,
    /// Why one that would have kept an arena for cuts has none (the
    /// budget, or its GPU, refused it): it is detached at the bound
    /// instead, and told this.
    missing: Option<String>,
}

impl ReplayArena {
    const NONE: ReplayArena = ReplayArena {
        replays: false,
        kept: false,
        prepared: None,
        missing: None,
    };
}

impl Stream {
    /// Subscribes a consumer: checks what needs no GPU, makes its mailbox
    /// or opens its GPU's arena (outside the hub's lock: both take a
    /// while), then joins it to the hub.
    pub fn subscribe(
        self: &Arc<Self>,
        req: ConsumeRequest,
        peer: Peer,
    ) -> Result<Subscription, SubscribeError> {
        let j = Joining {
            s: self,
            req: &req,
            peer: &peer,
        };
        let shape = j.shape()?;
        let replaying = replay::wanted(self, &req)?;
        j.check(shape)?;
        let arena = j.replay_arena(replaying.is_some(), shape)?;
        let (tx, rx) = mpsc::channel(outbox_room(shape, arena.replays.then_some(req.window)));
        // Replay cuts its batches, or its deal (the seat is checked now).
        let cut = (shape.batch_size, shape.deal(&req));
        let (mailbox, mailbox_grant) = j.make_mailbox((arena.replays, arena.kept))?;
        let grant = mailbox.as_ref().map(grant).transpose()?;
        let (mirror, gpu_grant) = j.open_gpu(shape)?;
        let (device_replay, arena) =
            j.device_replay_or_none(mirror.as_deref(), shape, arena, replaying.is_some())?;
        let replay_target = device_replay.as_ref().map(|(t, _)| t.clone());
        // A mailbox consumer is sent every batch at once and keeps to its
        // window itself: it never waits for the broker to take a release.
        let delivery = mailbox
            .as_ref()
            .map_or(Delivery::Window, |_| Delivery::Ahead);
        self.with_hub(|inner| {
            if let Some(why) = &inner.records.failed {
                return Err(SubscribeError::Failed(why.clone()));
            }
            seats::check(inner, &req, shape, peer.uid)?;
            let group = mirror::group_of(inner, (mirror.as_ref(), gpu_grant), (&req, peer.uid), self.plan.gpu_slots)?;
            // Where a consumer starts (`join`, `resume`): a replaying one
            // joins where the readers are, at the oldest batch the ring
            // still holds (`JoinPolicy::Now` in the hub): it is sent what
            // the ring holds from there and replayed only what came before
            // (its epoch's start, or from its resume position).
            let join = replaying.map_or(req.join, |_| JoinPolicy::Now);
            j.seek_to_resume(inner, replaying);
            let (id, mut start_epoch) = inner.hub.join_group(shape.window(&req), join, group, delivery)?;
            inner.hub.may_be_cut(id, j.decoupled());
            let mut started = replay::start(self, inner, id, (replaying, arena.kept), arena.prepared, cut)
                .inspect_err(|_| {
                    inner.hub.leave(id);
                })?;
            if let Some((g, _)) = &mut started.grant {
                start_epoch = g.from.epoch;
                g.device = replay_target.as_ref().map(|t| t.arena());
            }
            tracing::info!(stream = %self.name(), consumer = id, name = %peer.name, pid = peer.pid, start_epoch, device = mirror.as_ref().map(|m| m.label()), "consumer subscribed");
            let mut conn = Conn::new(
                (id, tx),
                peer.clone(),
                (shape, &req),
                (mailbox, mailbox_grant),
                started.replay,
                Start::of(started.skip, started.anchor),
            );
            conn.device_replay = device_replay;
            conn.no_replay = arena.missing;
            inner.conns.insert(id, conn);
            if let Some(from) = started.cut {
                decouple::tell_cut(inner, id, from);
            }
            Ok(Subscription {
                id,
                start_epoch,
                shape,
                rx,
                device: mirror,
                mailbox: grant,
                replay: started.grant,
                device_replay: replay_target,
                region: (inner.fill.regions.now(), inner.fill.regions.count()),
            })
        })
    }
}

/// A consumer's request as it joins, and the stream it joins.
struct Joining<'a> {
    s: &'a Arc<Stream>,
    req: &'a ConsumeRequest,
    peer: &'a Peer,
}

impl Joining<'_> {
    /// A replay arena, if one may be needed (whether it is depends on where
    /// the stream is when the consumer joins, and on whether it is ever
    /// cut). Lockstep's only bounds a pause: one the budget refuses is
    /// none, said in the log, and the consumer is detached at the bound
    /// instead of cut.
    fn replay_arena(&self, asks: bool, shape: Shape) -> Result<ReplayArena, SubscribeError> {
        let (s, req, peer) = (self.s, self.req, self.peer);
        let decoupled = self.decoupled();
        let kept = decoupled || self.bounded();
        if !(self.may_replay(asks) || kept) {
            return Ok(ReplayArena::NONE);
        }
        let whom = format!("consumer `{}` (pid {})", peer.name, peer.pid);
        // One that may only be cut keeps its arena uncommitted until then.
        let now = self.may_replay(asks);
        match replay::prepare(s, (shape.batch_size, req.window), (peer.uid, &whom), now) {
            Ok(p) => Ok(ReplayArena {
                replays: true,
                kept,
                prepared: Some(p),
                missing: None,
            }),
            Err(e) if kept && !decoupled && !asks => {
                tracing::info!(stream = %s.name(), consumer = %peer.name, pid = peer.pid, "no replay arena ({e}): if it keeps the others waiting past hold_limit_s it is detached instead of cut to replay");
                Ok(ReplayArena {
                    missing: Some(e.to_string()),
                    ..ReplayArena::NONE
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Refuses a consumer resuming under another description of the
    /// stream (its state's digest differs): it would get other data.
    fn check_digest(&self) -> Result<(), SubscribeError> {
        let changed = self
            .req
            .expect
            .map(|expect| expect.changes(&self.s.plan.digest))
            .unwrap_or_default();
        if changed.is_empty() {
            return Ok(());
        }
        Err(SubscribeError::Changed {
            stream: self.s.name().into(),
            changed,
        })
    }

    /// A stream nobody has read yet (a broker just restarted) starts where
    /// its first consumer resumes, rather than computing everything before
    /// that for nobody. Only its owner's consumers move it: a guest that
    /// came first could otherwise make the owner's trainers, joining at
    /// the next epoch, miss every epoch before its place.
    fn seek_to_resume(&self, inner: &mut Inner, replaying: Option<ReplayFrom>) {
        let s = self.s;
        // A producer's stream starts where its producer says.
        if self.peer.uid != s.owner_uid || s.writer.is_none() {
            return;
        }
        if let Some(p) = replaying.and_then(ReplayFrom::resume)
            && inner.hub.seek(p.epoch, p.sample / s.plan.schema.batch_size)
        {
            tracing::info!(stream = %s.name(), epoch = p.epoch, sample = p.sample, "starting where the first consumer resumes");
        }
    }

    /// The consumer's batch size and window, on the stream it expects.
    fn shape(&self) -> Result<Shape, SubscribeError> {
        self.check_digest()?;
        Shape::for_request(&self.s.plan, self.req)
    }

    /// Refusals that need no GPU, before a device arena is allocated.
    fn check(&self, shape: Shape) -> Result<(), SubscribeError> {
        let req = self.req;
        let inner = self.s.lock();
        if let Some(why) = &inner.records.failed {
            return Err(SubscribeError::Failed(why.clone()));
        }
        seats::check(&inner, req, shape, self.peer.uid)?;
        let gpu_slots = req.device.as_ref().map(|_| self.s.plan.gpu_slots);
        inner
            .hub
            .view()
            .check_window(shape.window(req), gpu_slots)?;
        if let Some(dev) = &req.device {
            inner.mirrors.check(&mirror::key_of(dev, self.peer.uid))?;
        }
        Ok(())
    }

    /// Whether a consumer that asks for a place (`join="now"`, a resume)
    /// may be replayed to: not on a producer's stream (nothing to make).
    /// A group member is replayed its own runs of the deal.
    fn may_replay(&self, asks: bool) -> bool {
        asks && self.s.writer.is_some()
    }

    /// Decoupled pace: a consumer (mailbox or socket, a group member too:
    /// replayed its own runs; on a GPU: replayed to its own arena there)
    /// of a stream the broker computes may be cut from the shared stream
    /// and replayed to.
    fn decoupled(&self) -> bool {
        let s = self.s;
        s.plan.pace == Pace::Decoupled && s.writer.is_some()
    }

    /// Lockstep with a hold limit (the default): a consumer of a stream
    /// the broker computes that keeps the others waiting past the limit is
    /// cut to replay ([`super::decouple`]), so it keeps a replay arena as a
    /// decoupled one does. On a producer's stream it is detached at the
    /// limit.
    fn bounded(&self) -> bool {
        let s = self.s;
        s.plan.hold_limit.is_some() && s.writer.is_some()
    }

    /// A device consumer's GPU: its arena there (opened on its first
    /// consumer, with the grant that pays for it), its batch size checked
    /// against it, and with `replays` its own arena there for replayed
    /// batches. Nothing for a host consumer.
    fn open_gpu(
        &self,
        shape: Shape,
    ) -> Result<(Option<Arc<Mirror>>, Option<crate::budget::Grant>), SubscribeError> {
        let Some(dev) = &self.req.device else {
            return Ok((None, None));
        };
        let (m, grant) = mirror::open(self.s, dev, self.peer)?;
        super::shape::check_device(shape, self.req, &m.arena())?;
        Ok((Some(m), grant))
    }

    /// A device consumer's own arena on its GPU for the batches replayed
    /// to it, where it has a host replay arena (`arena`). One it needs
    /// now (`asks`: a join or resume that replays) is refused when that
    /// arena cannot be had; one kept only for cuts falls back as a host
    /// consumer's does: no replay arena at all (it is detached at the
    /// bound instead of cut, and told why), never a refused subscription.
    #[allow(clippy::type_complexity)] // the arena and its grant, or none
    fn device_replay_or_none(
        &self,
        mirror: Option<&Mirror>,
        shape: Shape,
        arena: ReplayArena,
        asks: bool,
    ) -> Result<
        (
            Option<(Arc<ReplayTarget>, crate::budget::Grant)>,
            ReplayArena,
        ),
        SubscribeError,
    > {
        let (Some(m), Some(_)) = (mirror, &arena.prepared) else {
            return Ok((None, arena));
        };
        match self.device_replay(m, shape) {
            Ok(target) => Ok((Some(target), arena)),
            Err(e) if !asks => {
                let (s, peer) = (self.s, self.peer);
                tracing::info!(stream = %s.name(), consumer = %peer.name, pid = peer.pid, gpu = %m.label(), "no replay arena on its GPU ({e}): if it keeps the others waiting past hold_limit_s it is detached instead of cut to replay");
                Ok((
                    None,
                    ReplayArena {
                        missing: Some(format!("on {}: {e}", m.label())),
                        ..ReplayArena::NONE
                    },
                ))
            }
            Err(e) => Err(e),
        }
    }

    /// A device consumer's own arena on its GPU for the batches replayed
    /// to it: as many of its batches as its host replay arena holds, in
    /// the budget under its uid.
    fn device_replay(
        &self,
        mirror: &Mirror,
        shape: Shape,
    ) -> Result<(Arc<ReplayTarget>, crate::budget::Grant), SubscribeError> {
        let (s, peer) = (self.s, self.peer);
        let schema = batchcast::Schema {
            batch_size: shape.batch_size,
            ..s.plan.schema.clone()
        };
        let slots = book::slots(self.req.window);
        let bytes = batchcast::schema::RingLayout::for_schema(&schema, slots)
            .map_err(|e| SubscribeError::Replay(batchcast::Error::from(e).into()))?
            .arena_bytes;
        let grant = s.budget.take(
            peer.uid,
            crate::budget::Use::GpuArena,
            bytes,
            &format!(
                "the replay arena on {} of consumer `{}` (pid {})",
                mirror.label(),
                peer.name,
                peer.pid
            ),
        )?;
        let target = mirror
            .replay_target(&schema, slots, s.name())
            .map_err(SubscribeError::Device)?;
        Ok((target, grant))
    }

    /// A mailbox for a host consumer that asked for one, in the budget
    /// under its uid: room for every unit of the stream's slots, and for
    /// the replayed batches it may be sent.
    fn make_mailbox(
        &self,
        (replaying, kept): (bool, bool),
    ) -> Result<(Option<BrokerMailbox>, Option<crate::budget::Grant>), SubscribeError> {
        let (s, req, peer) = (self.s, self.req, self.peer);
        if !req.mailbox || req.device.is_some() {
            return Ok((None, None));
        }
        let replayed = if replaying {
            book::slots(req.window)
        } else {
            0
        };
        // One that may be cut: the notices a cut took back wait until the
        // consumer passes them, and a ring more may come after its merge.
        let rings = if kept { 2 } else { 1 };
        let spec =
            MailboxSpec::for_batches(s.plan.slots.saturating_mul(rings).saturating_add(replayed));
        let grant = s.budget.take(
            peer.uid,
            crate::budget::Use::Mailbox,
            spec.bytes(),
            &format!("consumer `{}` (pid {})", peer.name, peer.pid),
        )?;
        let mb = BrokerMailbox::create(spec).map_err(SubscribeError::Mailbox)?;
        Ok((Some(mb), Some(grant)))
    }
}

/// What the server needs to hand a mailbox to its consumer.
fn grant(m: &BrokerMailbox) -> Result<MailboxGrant, SubscribeError> {
    Ok(MailboxGrant {
        spec: m.spec(),
        fd: m
            .fd()
            .try_clone_to_owned()
            .map_err(|e| SubscribeError::Mailbox(e.into()))?,
        bell: m.bell(),
    })
}

/// Messages a consumer's channel must hold: a full window of batches
/// (`shape.units`), one end-of-epoch marker per batch, the final messages,
/// and with replay (its `window`) the replayed batches it may be sent
/// ahead of its releases.
fn outbox_room(shape: Shape, replay_window: Option<u32>) -> usize {
    let replayed = replay_window.map_or(0, |w| book::slots(w) as usize);
    2 * shape.units as usize + 4 + replayed
}
