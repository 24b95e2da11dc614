//! One batch in shared memory ([`Batch`]), its read-only field views
//! ([`FieldView`]), and the state a consumer shares with the batches it
//! handed out, which keeps the arena mapped and the connection open until
//! the last batch is dropped.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::batcher::{Batcher, Run};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::mailbox::ConsumerMailbox;
use crate::mailbox::Totals;
use crate::proto::ReplayGrant;
use crate::proto::{self, ClientMsg, Release, Taken, Unit, Welcome};
use crate::schema::{DType, Field, RingLayout, Schema};
use crate::shm::{Mapping, RingView};
use crate::transport::send_msg;

mod host;
pub(crate) use host::HostArena;

/// State shared by a consumer and the batches it handed out: the mapping
/// stays mapped and the connection open until the last batch is dropped,
/// so a batch never reads a slot the broker has already reused.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Write half, used by `release` from any thread.
    pub(crate) writer: Mutex<UnixStream>,
    /// The host arena: its fd and, mapped, the region the shared stream's
    /// batches are in now ([`proto::ServerMsg::Arena`] moves it).
    pub(crate) host: HostArena,
    /// This consumer's batches over the stream's units.
    pub(crate) batching: Mutex<Batching>,
    pub(crate) welcome: Welcome,
    /// Batches received and not yet released.
    pub(crate) held: AtomicU32,
    /// Device consumers: the stream's GPU arena in this process.
    pub(crate) gpu: Option<crate::gpu::DeviceSide>,
    pub(crate) mailbox: Option<ConsumerMailbox>,
    /// Replay granted: its arena, mapped.
    pub(crate) replay: Option<ReplayArena>,
    /// What the program has taken (reported with each release).
    pub(crate) taken: TakenTally,
}

/// A consumer's number in its process and what its program has taken
/// ([`Taken`]): counted as batches are handed out, reported with each
/// release and in the mailbox, carried to the next subscription on a
/// reconnect. Only the thread handing batches out writes the counts.
#[derive(Debug)]
pub(crate) struct TakenTally {
    pub(crate) serial: u32,
    batches: AtomicU64,
    samples: AtomicU64,
    epoch: AtomicU64,
}

/// Consumers this process has made, for their numbers.
static CONSUMERS: AtomicU32 = AtomicU32::new(0);

impl TakenTally {
    /// A new consumer's: the process's next number, nothing taken.
    pub(crate) fn new_consumer() -> TakenTally {
        TakenTally {
            serial: CONSUMERS.fetch_add(1, Ordering::Relaxed),
            batches: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            epoch: AtomicU64::new(0),
        }
    }

    pub(crate) fn load(&self) -> Taken {
        Taken {
            batches: self.batches.load(Ordering::Relaxed),
            samples: self.samples.load(Ordering::Relaxed),
            epoch: self.epoch.load(Ordering::Relaxed),
        }
    }

    /// Counts a batch of `samples` of `epoch` handed out; what is taken now.
    pub(crate) fn hand_out(&self, samples: u64, epoch: u64) -> Taken {
        let mut t = self.load();
        t.batches += 1;
        t.samples += samples;
        t.epoch = epoch;
        self.batches.store(t.batches, Ordering::Relaxed);
        self.samples.store(t.samples, Ordering::Relaxed);
        self.epoch.store(t.epoch, Ordering::Relaxed);
        t
    }
}

impl Clone for TakenTally {
    fn clone(&self) -> TakenTally {
        let t = self.load();
        TakenTally {
            serial: self.serial,
            batches: AtomicU64::new(t.batches),
            samples: AtomicU64::new(t.samples),
            epoch: AtomicU64::new(t.epoch),
        }
    }
}

/// The replay arena, mapped read-only.
#[derive(Debug)]
pub(crate) struct ReplayArena {
    pub(crate) map: Mapping,
    pub(crate) rings: RingLayout,
}

impl ReplayArena {
    /// Maps the arena the broker granted, after checking its layout holds
    /// this consumer's batches.
    pub(crate) fn open(fd: OwnedFd, grant: &ReplayGrant, welcome: &Welcome) -> Result<ReplayArena> {
        let schema = Schema {
            batch_size: welcome.batch_size,
            ..welcome.schema.clone()
        };
        grant.rings.validate(&schema)?;
        // `from == to`: nothing to replay yet (decoupled pace: a cut may
        // begin replay later).
        if grant.rings.unit != welcome.batch_size || grant.from > grant.to {
            return Err(Error::Schema(format!(
                "the broker granted replay from {:?} to {:?} in batches of {} (this consumer's are {})",
                grant.from, grant.to, grant.rings.unit, welcome.batch_size
            )));
        }
        let map = Mapping::rings(
            std::os::fd::AsFd::as_fd(&fd),
            &RingView::of(&grant.rings),
            false,
        )?;
        Ok(ReplayArena {
            map,
            rings: grant.rings.clone(),
        })
    }
}

/// The batcher, and the loop timing of released batches not yet reported
/// (it rides with the next unit given back).
#[derive(Debug)]
pub(crate) struct Batching {
    pub(crate) batcher: Batcher,
    pub(crate) totals: Totals,
    /// Units to give back, reused.
    pub(crate) scratch: Vec<u64>,
}

impl Shared {
    /// Gives units back to the broker: through the mailbox (or the socket
    /// when its ring is full), or for device units once the GPU work on
    /// them is done. `totals` rides with the first.
    pub(crate) fn give_back(
        &self,
        units: impl IntoIterator<Item = Unit>,
        mut totals: Totals,
    ) -> Result<()> {
        for unit in units {
            let t = std::mem::take(&mut totals);
            let release = Release {
                unit,
                wait_ns: t.wait_ns,
                busy_ns: t.busy_ns,
                taken: self.taken.load(),
            };
            if let Some(g) = &self.gpu {
                g.release_after_gpu(release)?;
                continue;
            }
            if let Some(mb) = &self.mailbox
                && mb.push_release(unit, t)
            {
                if mb.wants_doorbell() {
                    self.send(&ClientMsg::Doorbell)?;
                }
                continue;
            }
            self.send(&ClientMsg::Release(release))?;
        }
        self.flush_fenced(false)
    }

    /// A run was released (or never handed out): gives back the units it
    /// was the last reader of.
    pub(crate) fn release_run(&self, run: &Run, add: Totals) -> Result<()> {
        let mut guard = self.batching.lock().unwrap_or_else(|p| p.into_inner());
        let Batching {
            batcher,
            totals,
            scratch,
        } = &mut *guard;
        batcher.release(run, scratch);
        totals.add(add);
        if scratch.is_empty() {
            return Ok(());
        }
        // Given back under the lock, from a buffer kept for it: no
        // allocation per batch.
        let result = self.give_back(
            scratch.iter().map(|&seq| Unit::Shared(seq)),
            std::mem::take(totals),
        );
        scratch.clear();
        result
    }

    pub(crate) fn send(&self, msg: &ClientMsg) -> Result<()> {
        let guard = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        send_msg(&guard, msg)
    }

    /// Sends the releases whose GPU work has finished; with `all`, waits
    /// for the rest first.
    pub(crate) fn flush_fenced(&self, all: bool) -> Result<()> {
        let Some(gpu) = &self.gpu else {
            return Ok(());
        };
        for release in gpu.finished_releases(all)? {
            self.send(&ClientMsg::Release(release))?;
        }
        Ok(())
    }

    /// The program holds its whole window of batches.
    pub(crate) fn window_full(&self) -> bool {
        self.held.load(std::sync::atomic::Ordering::Acquire) >= self.welcome.window
    }

    pub(crate) fn fenced_pending(&self) -> bool {
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
///
/// A batch is `len()` consecutive samples of one epoch, in this consumer's
/// own batch size: each field is one contiguous view of the stream's ring
/// of that field, however the broker's production units fall.
#[derive(Debug)]
pub struct Batch {
    pub(crate) shared: Arc<Shared>,
    /// The host arena's region it was handed out from (mapped until the
    /// last batch read there is dropped).
    pub(crate) map: Arc<Mapping>,
    pub(crate) run: Run,
    /// The slot of its unit: a device batch's slot in its GPU's arena.
    pub(crate) slot: u32,
    /// Recomputed for this consumer alone, in its replay arena
    /// (`run.first_seq` is its seq there).
    pub(crate) replayed: bool,
    pub(crate) sent_ns: u64,
    pub(crate) wait_ns: u64,
    pub(crate) busy_ns: u64,
    pub(crate) received_ns: u64,
    pub(crate) released: bool,
}

impl Batch {
    /// The stream's sequence number of the production unit its first
    /// sample is in (with the stream's batch size, the batch's own).
    pub fn seq(&self) -> u64 {
        self.run.first_seq
    }
    pub fn epoch(&self) -> u64 {
        self.run.epoch
    }
    /// Position of this batch in its epoch, in this consumer's batches.
    pub fn index(&self) -> u64 {
        self.run.index
    }
    /// Index in its epoch of the batch's first sample.
    pub fn first_sample(&self) -> u64 {
        self.run.first
    }

    /// The position right after this batch in the stream's order: where a
    /// trainer that saves a checkpoint after training on it resumes
    /// ([`ConsumerOptions::resume`](crate::ConsumerOptions::resume)). In
    /// an epoch read rotated ([`crate::rotation`]) a position alone does
    /// not say the epoch's start is still to come: save
    /// [`Consumer::state`](crate::Consumer::state), which does.
    pub fn next_position(&self) -> proto::Position {
        proto::Position {
            epoch: self.run.epoch,
            sample: self.run.first,
        }
        .advance(
            self.run.samples,
            self.shared.welcome.schema.samples_per_epoch,
        )
    }

    /// Whether it was recomputed for this consumer alone (replay) rather
    /// than read from the stream's shared ring; the bytes are the same.
    pub fn replayed(&self) -> bool {
        self.replayed
    }
    /// Valid samples in this batch.
    pub fn len(&self) -> usize {
        self.run.samples as usize
    }
    pub fn is_empty(&self) -> bool {
        self.run.samples == 0
    }
    /// The slot of its first production unit (host), or of its GPU's arena.
    pub fn slot(&self) -> u32 {
        self.slot
    }
    /// Nanoseconds the hand-off took: from the later of the broker sending
    /// the batch and the program asking for it, to this process having it.
    /// (A batch sent while the program was still busy with earlier ones
    /// waits in the mailbox or socket; that wait is the program's backlog,
    /// not the hand-off, and is not counted.)
    pub fn handoff_ns(&self) -> u64 {
        self.received_ns
            .saturating_sub(self.sent_ns)
            .min(self.wait_ns)
    }
    /// Nanoseconds the program was blocked asking for this batch: from its
    /// first [`crate::Consumer::wait_readable`] or [`crate::Consumer::next_event`] call
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
            std::iter::once(self.run.samples)
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
        if i >= self.schema().fields.len() {
            return Err(Error::NoSuchField {
                name: format!("#{i}"),
                available: format!("{} fields", self.schema().fields.len()),
            });
        }
        g.read(i, (self.run.position, self.run.samples), self.replayed)
    }

    fn host_only(&self) -> Result<()> {
        match &self.shared.gpu {
            None => Ok(()),
            Some(g) => Err(Error::OnDevice {
                seq: self.run.first_seq,
                device: g.device(),
            }),
        }
    }

    /// For a host batch only: its samples in field `i`'s mirrored ring.
    fn host_view(&self, i: usize) -> FieldView<'_> {
        let w = &self.shared.welcome;
        let (rings, map) = match (&self.shared.replay, self.replayed) {
            (Some(r), true) => (&r.rings, &r.map),
            _ => (&w.rings, &*self.map),
        };
        let bytes = rings
            .span(i, self.run.position, self.run.samples)
            .and_then(|(start, len)| map.get(start, len))
            .expect("rings validated against the mapping at connect; runs fit the rings");
        FieldView {
            field: &w.schema.fields[i],
            bytes,
            samples: self.run.samples as usize,
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
        g.address(i, (self.run.position, self.run.samples), self.replayed)
            .ok()
    }

    /// Device batches: also wait for the work queued so far on `stream` (a
    /// `CUstream`, or DLPack's `1`/`2` for the legacy and per-thread default
    /// streams) before the slot is given back. Without any, the legacy
    /// default stream is used.
    pub fn fence_on(&self, stream: u64) {
        if let Some(g) = &self.shared.gpu {
            if self.replayed {
                g.fence_on(Unit::Replayed(self.run.first_seq), stream);
                return;
            }
            for seq in self.run.first_seq..=self.run.last_seq {
                g.fence_on(Unit::Shared(seq), stream);
            }
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
        let totals = Totals {
            wait_ns: self.wait_ns,
            busy_ns: self.busy_ns,
            hold_ns: proto::monotonic_ns().saturating_sub(self.received_ns),
        };
        if self.replayed {
            return self
                .shared
                .give_back([Unit::Replayed(self.run.first_seq)], totals);
        }
        self.shared.release_run(&self.run, totals)
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Err(e) = self.do_release() {
            tracing::debug!("release of batch {} failed: {e}", self.run.first_seq);
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
