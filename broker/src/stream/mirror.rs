//! GPU copies of a stream: one device ring per GPU with consumers (a hub
//! group), opened when the first consumer on that GPU subscribes; the
//! copier's reports ([`CopySink`]); a failing GPU, which ends its
//! consumers and gives back its host slots; freeing the device arenas at
//! shutdown once their consumers are gone.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use batchcast::proto::{self, DeviceRequest, ErrorCode, GoodbyeReason};
use batchcast::schema::RingLayout;

use super::conn::{Ending, Peer};
use super::error::SubscribeError;
use super::{Inner, Stream};
use crate::budget::{Grant, Use};
use crate::gpu::{CopyRequest, CopySink, CopySource, GpuError, GpuKey, Mirror, MirrorSpec, Piece};
use crate::hub::{GroupId, Hub};

/// One GPU's copies of this stream, as the stream tracks them.
#[derive(Debug)]
struct MirrorState {
    mirror: Arc<Mirror>,
    /// Its ring of device slots in the hub.
    group: GroupId,
    copies: u64,
    bytes: u64,
    copy_ns: u64,
    /// Replayed batches copied to consumers' own arenas.
    replayed: u64,
    /// Why its copies stopped; its consumers were ended then.
    failed: Option<GpuError>,
    /// Its device arena's bytes in the broker's memory budget (`None` if
    /// another consumer's subscription paid for it first).
    _grant: Option<Grant>,
}

/// The stream's GPU copies: one [`MirrorState`] per GPU with consumers,
/// and the GPU of each hub group.
#[derive(Debug, Default)]
pub(super) struct Mirrors {
    by_gpu: HashMap<GpuKey, MirrorState>,
    /// The GPU of each hub group (group `g` is `groups[g]`).
    groups: Vec<GpuKey>,
}

impl Mirrors {
    /// Refuses a device consumer before any GPU work when its GPU failed
    /// already.
    pub(super) fn check(&self, key: &GpuKey) -> Result<(), SubscribeError> {
        match self.by_gpu.get(key).and_then(|m| m.failed.as_ref()) {
            Some(why) => Err(SubscribeError::Device(why.clone())),
            None => Ok(()),
        }
    }

    /// The hub group of the consumer's device arena (its GPU, its uid),
    /// made on its first consumer.
    pub(super) fn group_for(
        &mut self,
        hub: &mut Hub,
        (mirror, grant): (&Arc<Mirror>, Option<Grant>),
        key: GpuKey,
        gpu_slots: u32,
    ) -> Result<GroupId, SubscribeError> {
        if !self.by_gpu.contains_key(&key) {
            let group = hub.add_group(gpu_slots);
            self.groups.push(key);
            debug_assert_eq!(self.groups.len(), group as usize + 1);
            self.by_gpu.insert(
                key,
                MirrorState {
                    mirror: mirror.clone(),
                    group,
                    copies: 0,
                    bytes: 0,
                    copy_ns: 0,
                    replayed: 0,
                    failed: None,
                    _grant: grant,
                },
            );
        }
        self.check(&key)?;
        Ok(self.by_gpu[&key].group)
    }

    /// The mirror of a GPU this stream copies to.
    pub(super) fn mirror(&self, key: &GpuKey) -> Option<Arc<Mirror>> {
        self.by_gpu.get(key).map(|m| m.mirror.clone())
    }

    /// The label of a device arena this stream copies to: its GPU's, and
    /// the uid it serves where that is not the broker's.
    pub(super) fn label(&self, key: &GpuKey) -> Option<String> {
        self.by_gpu
            .get(key)
            .map(|m| labelled(m.mirror.label(), key.uid))
    }

    /// Each device arena's copies, by label ([`Mirrors::label`]).
    pub(super) fn stats(&self, hub: &Hub) -> Vec<proto::GpuCopyStats> {
        let mut g: Vec<_> = self
            .by_gpu
            .iter()
            .map(|(key, m)| {
                let n = hub.view().group_counts(m.group).unwrap_or_default();
                proto::GpuCopyStats {
                    gpu: labelled(m.mirror.label(), key.uid),
                    copies: m.copies,
                    bytes: m.bytes,
                    copy_s: m.copy_ns as f64 * 1e-9,
                    pinned: m.mirror.pinned(),
                    slots: n.slots,
                    slots_in_use: n.in_use,
                    waiting: n.waiting,
                    replayed: m.replayed,
                }
            })
            .collect();
        g.sort_by(|a, b| a.gpu.cmp(&b.gpu));
        g
    }
}

/// A GPU's label, and the uid its arena serves where that is not the
/// broker's own (each uid reads an arena of its own: [`GpuKey`]).
fn labelled(gpu: &str, uid: u32) -> String {
    if uid == nix::unistd::geteuid().as_raw() {
        gpu.to_string()
    } else {
        format!("{gpu}, uid {uid}")
    }
}

/// The key of a device consumer's arena: its GPU and its uid.
pub(super) fn key_of(dev: &DeviceRequest, uid: u32) -> GpuKey {
    GpuKey::of(dev, uid)
}

/// The hub group of a device consumer's arena (made on the first
/// consumer of its uid on its GPU, keeping `grant`, which paid for the
/// arena), or `None` for a host consumer.
pub(super) fn group_of(
    inner: &mut Inner,
    (mirror, grant): (Option<&Arc<Mirror>>, Option<Grant>),
    (req, uid): (&batchcast::proto::ConsumeRequest, u32),
    gpu_slots: u32,
) -> Result<Option<GroupId>, SubscribeError> {
    let (Some(m), Some(dev)) = (mirror, &req.device) else {
        return Ok(None);
    };
    let Inner { hub, mirrors, .. } = inner;
    mirrors
        .group_for(hub, (m, grant), key_of(dev, uid), gpu_slots)
        .map(Some)
}

/// Opens (or finds) the stream's arena on the consumer's GPU. It takes a
/// while (a device allocation): call it without the hub's lock.
///
/// A GPU's first consumer pays for its arena from the broker's memory
/// budget: the grant comes back with the mirror, for the stream to keep
/// with it ([`Mirrors::group_for`]).
pub(super) fn open(
    s: &Arc<Stream>,
    req: &DeviceRequest,
    peer: &Peer,
) -> Result<(Arc<Mirror>, Option<Grant>), SubscribeError> {
    let key = key_of(req, peer.uid);
    // The copier reads the host arena where the ring is now: it stays
    // there from now on (`regions`).
    let (exists, region) = {
        let mut inner = s.lock();
        (
            inner.mirrors.by_gpu.contains_key(&key),
            inner.fill.regions.pin(),
        )
    };
    let grant = match exists {
        true => None,
        false => Some(s.budget.take(
            peer.uid,
            Use::GpuArena,
            device_arena_bytes(s),
            &format!(
                "stream `{}` on cuda:{} ({})",
                s.name(),
                req.ordinal,
                req.name
            ),
        )?),
    };
    let spec = MirrorSpec {
        key,
        sink: Arc::downgrade(s) as std::sync::Weak<dyn CopySink>,
        host: s
            .arena
            .mapping()
            .as_ptr()
            .wrapping_add(region as usize * s.arena.region_len() as usize),
        host_len: s.arena.region_len() as usize,
        slots: s.plan.gpu_slots,
        schema: &s.plan.schema,
        stream: s.name(),
    };
    let mirror = s.gpus.mirror(req, spec).map_err(SubscribeError::Device)?;
    Ok((mirror, grant))
}

/// Waits (2 s at most) for the consumers on a GPU to go after they were
/// told goodbye, then frees the device arenas. A consumer that ignores the
/// goodbye reads freed memory, and is named in the log.
pub(super) fn free_device_arenas(s: &Stream) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let on_gpu: Vec<String> = {
            let inner = s.lock();
            inner
                .conns
                .values()
                .filter(|c| c.gpu.is_some())
                .map(|c| format!("{} (pid {})", c.peer.name, c.peer.pid))
                .collect()
        };
        if on_gpu.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            tracing::warn!(stream = %s.name(), "freeing device arenas still opened by {}", on_gpu.join(", "));
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mirrors: Vec<MirrorState> = s.lock().mirrors.by_gpu.drain().map(|(_, m)| m).collect();
    s.gpus.stop();
    drop(mirrors);
}

/// What a GPU's arena for this stream costs the memory budget: its rings
/// laid out as the stand-in's are (mirrored where cheap), at least what
/// CUDA's unmirrored ones take.
fn device_arena_bytes(s: &Stream) -> u64 {
    RingLayout::for_schema(&s.plan.schema, s.plan.gpu_slots).map_or(u64::MAX, |r| r.arena_bytes)
}

/// Unit `seq`'s bytes, field by field, from the host arena's plain
/// (page-locked) mapping laid out as `host` to the device arena laid out
/// as `device`: its samples lie at the cells of its stream position in
/// each, so a piece ends wherever either ring wraps.
pub(super) fn unit_pieces(host: &RingLayout, device: &RingLayout, seq: u64) -> Vec<Piece> {
    let unit = host.unit;
    let mut pieces = Vec::with_capacity(2 * host.fields.len());
    for (h, d) in host.fields.iter().zip(&device.fields) {
        let bps = h.bytes_per_sample;
        let (mut hc, mut dc) = ((seq * unit) % h.cells, (seq * unit) % d.cells);
        let mut left = unit;
        while left > 0 {
            let n = left.min(h.cells - hc).min(d.cells - dc);
            pieces.push(Piece {
                at: (h.offset + hc * bps) as usize,
                len: (n * bps) as usize,
                dst: (d.offset + dc * bps) as usize,
            });
            (hc, dc, left) = ((hc + n) % h.cells, (dc + n) % d.cells, left - n);
        }
    }
    pieces
}

/// Hands the copies the hub ordered to each GPU's copier.
pub(super) fn request_copies(inner: &mut Inner) {
    for c in inner.hub.take_copies() {
        let Some(m) = inner
            .mirrors
            .groups
            .get(c.group as usize)
            .and_then(|key| inner.mirrors.by_gpu.get(key))
        else {
            continue;
        };
        m.mirror.request(CopyRequest {
            host: c.host,
            device: c.slot,
            seq: c.seq,
        });
    }
}

impl CopySource for Stream {
    fn bytes(&self, piece: &Piece) -> Option<&[u8]> {
        self.arena.mapping().get(piece.at as u64, piece.len as u64)
    }
}

impl CopySink for Stream {
    fn host_pieces(&self, seq: u64, device: &RingLayout) -> Vec<Piece> {
        unit_pieces(&self.plan.rings, device, seq)
    }

    fn copied(&self, key: &GpuKey, req: CopyRequest, bytes: u64, elapsed_ns: u64) {
        self.with_hub(|inner| {
            let Some(m) = inner.mirrors.by_gpu.get_mut(key) else {
                return;
            };
            m.copies += 1;
            m.bytes += bytes;
            m.copy_ns += elapsed_ns;
            let group = m.group;
            if let Err(e) = inner.hub.copied(group, req.seq) {
                tracing::error!(stream = %self.name(), gpu = %m.mirror.label(), "copy report: {e}");
            }
        });
    }

    fn replay_copied(&self, key: &GpuKey, consumer: u64, seq: u64, bytes: u64, elapsed_ns: u64) {
        self.with_hub(|inner| {
            if let Some(m) = inner.mirrors.by_gpu.get_mut(key) {
                m.replayed += 1;
                m.bytes += bytes;
                m.copy_ns += elapsed_ns;
            }
            let Some(r) = inner
                .conns
                .get_mut(&consumer)
                .and_then(|c| c.replay.as_mut())
            else {
                return; // it left meanwhile
            };
            let ready = r.copied(seq);
            super::conn::send_replayed(inner, consumer, ready);
        });
    }

    fn gpu_failed(&self, key: &GpuKey, why: GpuError) {
        tracing::error!(stream = %self.name(), "GPU copies stopped: {why}");
        self.with_hub(|inner| {
            let Some(m) = inner.mirrors.by_gpu.get_mut(key) else {
                return;
            };
            let failure = GpuError::CopiesFailed {
                stream: self.name().into(),
                gpu: m.mirror.label().into(),
                reason: Box::new(why.clone()),
            };
            m.failed = Some(failure.clone());
            // Copies still queued on the GPU may read host slots the hub is
            // about to give back.
            m.mirror.fence();
            let group = m.group;
            for id in inner.hub.fail_group(group) {
                let Some(conn) = inner.conns.get_mut(&id) else {
                    continue;
                };
                conn.ending
                    .get_or_insert_with(|| Ending::DeviceFailed(why.clone()));
                conn.out.end(
                    ErrorCode::DeviceUnavailable,
                    failure.to_string(),
                    GoodbyeReason::Shutdown,
                );
            }
        });
    }
}
