//! The consumer's side of GPU delivery: the stream's device arena, opened
//! once per process, and releases fenced on the trainer's GPU work.
//!
//! The arena is GPU memory opened from its CUDA IPC handle, or under the
//! test setting ([`crate::stand_in`]) the host-memory stand-in's memfd,
//! mapped read-only. Everything else here is the same for both: what a
//! device consumer receives was decided by the broker as for any consumer;
//! this side only knows where the bytes are and when it may give a batch
//! back.
//!
//! # Stream semantics
//!
//! The broker publishes a device batch only after its host-to-device copy
//! has completed, so a trainer may read it on any CUDA stream at once.
//! Releasing is the other direction: when Python drops a tensor, the kernels
//! that read it may still be queued. A release therefore records an event on
//! the streams the batch was used on (those DLPack consumers pass to
//! `__dlpack__`, else the legacy default stream) and reaches the broker only
//! once that event has completed, so the broker never copies a new batch
//! into a slot a kernel is still reading. The consumer keeps polling those
//! events while it waits for its next batch. (The stand-in has no GPU work:
//! its releases go at once.)

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::proto::{DeviceArena, DeviceMemory, DeviceRequest, Release, Unit};
use crate::schema::{RingLayout, Schema};
use crate::shm::{Mapping, RingView};
use crate::stand_in;

#[cfg(feature = "cuda")]
mod cuda_memory;

impl Device {
    /// What the broker needs to know about this device: its GPU's UUID.
    /// Errors, naming the reason, when this host or build has no such GPU.
    pub fn request(&self) -> Result<Option<DeviceRequest>> {
        match *self {
            Device::Cpu => Ok(None),
            Device::Cuda(ordinal) if stand_in::setting()?.is_some() => Ok(Some(DeviceRequest {
                uuid: stand_in::uuid(ordinal),
                ordinal,
                name: stand_in::NAME.into(),
            })),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                let gpu = crate::cuda::Gpu::open(ordinal)?;
                Ok(Some(DeviceRequest {
                    uuid: gpu.info.uuid,
                    ordinal,
                    name: gpu.info.name.clone(),
                }))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(Error::Device(format!(
                "{self} asked for, but this build of batchcast has no CUDA support (rebuild with the `cuda` feature) — use device=\"cpu\""
            ))),
        }
    }
}

/// Where a device arena's bytes are.
#[derive(Debug)]
enum Memory {
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<crate::cuda::IpcMapping>),
    /// The stand-in's memfd, mapped read-only.
    StandIn(Mapping),
}

/// What a release waits for: the GPU work queued on a batch's streams.
#[cfg(feature = "cuda")]
type Fence = crate::cuda::Event;
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
enum Fence {}

/// A device batch released by the program, waiting for its GPU work.
#[derive(Debug)]
struct Pending {
    release: Release,
    fences: Vec<Fence>,
}

/// A device arena opened: its memory and its rings (where each unit's
/// and run's samples are).
#[derive(Debug)]
struct Region {
    memory: Memory,
    rings: RingLayout,
}

#[derive(Debug)]
pub(crate) struct DeviceSide {
    device: Device,
    /// The stream's arena on the GPU, shared by its consumers there.
    shared: Region,
    slots: u32,
    /// This consumer's own arena there for its replayed batches.
    replay: Option<Region>,
    /// Streams each held unit was handed to.
    streams: Mutex<HashMap<Unit, Vec<u64>>>,
    pending: Mutex<Vec<Pending>>,
}

impl DeviceSide {
    /// Opens the device arenas a welcome names (the shared one, and the
    /// consumer's own for replay if granted; `fds`: a stand-in's, the
    /// welcome's last, in that order), or `None` for a host consumer.
    pub(crate) fn open(
        device: Device,
        (arena, replay): (Option<&DeviceArena>, Option<&DeviceArena>),
        schema: &Schema,
        mut fds: impl Iterator<Item = OwnedFd>,
    ) -> Result<Option<DeviceSide>> {
        let (ordinal, arena) = match (device, arena) {
            (Device::Cpu, None) => return Ok(None),
            (Device::Cpu, Some(_)) => {
                return Err(Error::Unexpected(
                    "a device arena for a host consumer".into(),
                ));
            }
            (Device::Cuda(_), None) => {
                return Err(Error::Device(
                    "the broker answered without a device arena".into(),
                ));
            }
            (Device::Cuda(n), Some(a)) => (n, a),
        };
        let shared = Region::open(ordinal, arena, schema, &mut fds)?;
        let replay = replay
            .map(|a| {
                // Its rings are of this consumer's batch size.
                let schema = Schema {
                    batch_size: a.rings.unit,
                    ..schema.clone()
                };
                Region::open(ordinal, a, &schema, &mut fds)
            })
            .transpose()?;
        tracing::info!(device = %device, gpu = %arena.gpu, replay = replay.is_some(), "opened the stream's device arena");
        Ok(Some(DeviceSide {
            device,
            shared,
            slots: arena.slots,
            replay,
            streams: Mutex::new(HashMap::new()),
            pending: Mutex::new(Vec::new()),
        }))
    }

    pub(crate) fn device(&self) -> Device {
        self.device
    }

    pub(crate) fn slots(&self) -> u32 {
        self.slots
    }

    /// The arena a run lies in: the shared one, or for a replayed batch
    /// the consumer's own.
    fn region(&self, replayed: bool) -> Result<&Region> {
        match (replayed, &self.replay) {
            (false, _) => Ok(&self.shared),
            (true, Some(r)) => Ok(r),
            (true, None) => Err(Error::Unexpected(
                "a replayed device batch with no replay arena on the GPU".into(),
            )),
        }
    }

    /// The device address of field `f` of a run (`samples` samples from
    /// ring position `position`, replayed or shared).
    pub(crate) fn address(
        &self,
        f: usize,
        (position, samples): (u64, u64),
        replayed: bool,
    ) -> Result<u64> {
        let r = self.region(replayed)?;
        Ok(r.base() + r.span(f, position, samples)?.0)
    }

    /// Copies field `f` of a run to the host.
    pub(crate) fn read(
        &self,
        f: usize,
        (position, samples): (u64, u64),
        replayed: bool,
    ) -> Result<Vec<u8>> {
        self.region(replayed)?.read(f, position, samples)
    }

    pub(crate) fn fence_on(&self, unit: Unit, stream: u64) {
        let mut f = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        let streams = f.entry(unit).or_default();
        if !streams.contains(&stream) {
            streams.push(stream);
        }
    }

    /// Records the release of its unit: it is sent once the GPU has done
    /// what was queued on the batch's streams so far.
    pub(crate) fn release_after_gpu(&self, release: Release) -> Result<()> {
        let streams = self
            .streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&release.unit);
        let fences = match &self.shared.memory {
            #[cfg(feature = "cuda")]
            Memory::Cuda(m) => cuda_memory::fences(m, streams)?,
            Memory::StandIn(_) => {
                let _ = streams;
                Vec::new()
            }
        };
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Pending { release, fences });
        Ok(())
    }

    /// Releases whose GPU work has finished (with `all`: waits for all).
    pub(crate) fn finished_releases(&self, all: bool) -> Result<Vec<Release>> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let mut done = Vec::new();
        let mut err = None;
        pending.retain(|p| {
            let finished = p.fences.iter().all(|f| {
                finished(f, all).unwrap_or_else(|e| {
                    err.get_or_insert(e);
                    true
                })
            });
            if finished {
                done.push(p.release);
            }
            !finished
        });
        // A failed query means the context is broken; the release still
        // goes out (the process's GPU work cannot continue).
        if let Some(e) = err {
            tracing::warn!("waiting for GPU work before a release: {e}");
        }
        Ok(done)
    }

    pub(crate) fn pending(&self) -> bool {
        !self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }
}

impl Region {
    /// Opens `arena` (laid out for `schema`), taking its fd from `fds` if
    /// it is the stand-in's.
    fn open(
        ordinal: u32,
        arena: &DeviceArena,
        schema: &Schema,
        fds: &mut impl Iterator<Item = OwnedFd>,
    ) -> Result<Region> {
        arena.rings.validate(schema)?;
        let mirrored = arena.rings.fields.iter().filter(|r| r.mirrored).count();
        if arena.slots != arena.rings.slots
            || (arena.memory == DeviceMemory::CudaIpc && mirrored > 0)
        {
            return Err(Error::Unexpected(format!(
                "a device arena of {} slots laid out for {} ({:?} memory, {mirrored} rings mirrored)",
                arena.slots, arena.rings.slots, arena.memory,
            )));
        }
        let memory = match arena.memory {
            DeviceMemory::StandIn => Memory::StandIn(open_stand_in(arena, fds.next())?),
            #[cfg(feature = "cuda")]
            DeviceMemory::CudaIpc => Memory::Cuda(cuda_memory::open(ordinal, arena)?),
            #[cfg(not(feature = "cuda"))]
            DeviceMemory::CudaIpc => {
                let _ = ordinal;
                return Err(Error::Device(
                    "this build of batchcast has no CUDA support (feature `cuda`); use device=\"cpu\""
                        .into(),
                ));
            }
        };
        Ok(Region {
            memory,
            rings: arena.rings.clone(),
        })
    }

    /// The arena's first byte: a device address (a host one for the
    /// stand-in).
    fn base(&self) -> u64 {
        match &self.memory {
            #[cfg(feature = "cuda")]
            Memory::Cuda(m) => m.ptr(),
            Memory::StandIn(m) => m.as_ptr() as u64,
        }
    }

    /// Where field `f` of `samples` samples from ring position `position`
    /// lie in the arena's mapping: one contiguous span (what the broker
    /// copied there), as an offset and a length.
    fn span(&self, f: usize, position: u64, samples: u64) -> Result<(u64, u64)> {
        self.rings.span(f, position, samples).ok_or_else(|| {
            Error::Unexpected(format!(
                "{samples} samples at {position} are not one span of field {f}'s device ring"
            ))
        })
    }

    fn read(&self, f: usize, position: u64, samples: u64) -> Result<Vec<u8>> {
        let (at, len) = self.span(f, position, samples)?;
        match &self.memory {
            #[cfg(feature = "cuda")]
            Memory::Cuda(m) => {
                let mut out = vec![0; len as usize];
                m.read(at as usize, &mut out)?;
                Ok(out)
            }
            Memory::StandIn(m) => m.get(at, len).map(<[u8]>::to_vec).ok_or_else(|| {
                Error::Unexpected(format!("{len} bytes at {at} past the device arena's end"))
            }),
        }
    }
}

/// Whether a fence's GPU work has finished (with `wait`: once it has).
#[cfg(feature = "cuda")]
fn finished(f: &Fence, wait: bool) -> Result<bool> {
    Ok(if wait {
        f.synchronize().map(|_| true)?
    } else {
        f.done()?
    })
}

#[cfg(not(feature = "cuda"))]
fn finished(f: &Fence, _wait: bool) -> Result<bool> {
    match *f {}
}

/// Maps the stand-in's memfd, which only a consumer that asked for a
/// stand-in GPU accepts.
fn open_stand_in(arena: &DeviceArena, fd: Option<OwnedFd>) -> Result<Mapping> {
    if stand_in::setting()?.is_none() {
        return Err(Error::Unexpected(format!(
            "the broker answered with a host-memory stand-in for a GPU, which this process did not ask for ({} is not set)",
            stand_in::ENV
        )));
    }
    let fd = fd.ok_or_else(|| {
        Error::Shm("the broker's welcome carried no fd for the stand-in's device arena".into())
    })?;
    Mapping::rings(fd.as_fd(), &RingView::of(&arena.rings), false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_request_without_a_gpu_names_the_way_out() {
        if stand_in::setting().unwrap().is_some() {
            return; // the stand-in answers for every ordinal
        }
        #[cfg(feature = "cuda")]
        if crate::cuda::available() {
            return; // a GPU host: this is the no-driver path only
        }
        let e = Device::Cuda(0).request().unwrap_err().to_string();
        assert!(e.contains("device=\"cpu\""), "{e}");
        assert_eq!(Device::Cpu.request().unwrap(), None);
    }
}
