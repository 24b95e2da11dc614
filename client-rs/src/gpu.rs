//! The consumer's side of GPU delivery: the stream's device arena, opened
//! once per process from its CUDA IPC handle, and releases fenced on the
//! trainer's GPU work.
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
//! events while it waits for its next batch.

use crate::device::Device;
use crate::error::{Error, Result};
use crate::proto::{DeviceArena, DeviceRequest, Release};

impl Device {
    /// What the broker needs to know about this device: its GPU's UUID.
    /// Errors, naming the reason, when this host or build has no such GPU.
    pub fn request(&self) -> Result<Option<DeviceRequest>> {
        match *self {
            Device::Cpu => Ok(None),
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

#[cfg(feature = "cuda")]
pub(crate) use imp::DeviceSide;

#[cfg(feature = "cuda")]
mod imp {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock, Weak};

    use super::*;
    use crate::cuda::{self, Event, Gpu, IpcMapping};

    /// A device batch released by the program, waiting for its GPU work.
    #[derive(Debug)]
    struct Pending {
        release: Release,
        events: Vec<Event>,
    }

    #[derive(Debug)]
    pub(crate) struct DeviceSide {
        device: Device,
        mapping: Arc<IpcMapping>,
        slots: u32,
        /// Streams each held batch was handed to.
        fences: Mutex<HashMap<u64, Vec<u64>>>,
        pending: Mutex<Vec<Pending>>,
    }

    type Key = (Vec<u8>, u32);

    /// One mapping per (handle, GPU) per process: several consumers of one
    /// stream in one process share it.
    fn open_shared(gpu: &Arc<Gpu>, handle: &[u8], len: usize) -> Result<Arc<IpcMapping>> {
        static OPEN: OnceLock<Mutex<HashMap<Key, Weak<IpcMapping>>>> = OnceLock::new();
        let mut open = OPEN
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        open.retain(|_, m| m.strong_count() > 0);
        let key = (handle.to_vec(), gpu.info.ordinal);
        if let Some(m) = open.get(&key).and_then(Weak::upgrade) {
            return Ok(m);
        }
        let m = Arc::new(IpcMapping::open(gpu, handle, len)?);
        open.insert(key, Arc::downgrade(&m));
        Ok(m)
    }

    impl DeviceSide {
        pub(crate) fn open(
            device: Device,
            arena: Option<&DeviceArena>,
            slot_bytes: u64,
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
            if arena.slots == 0 || Some(arena.bytes) != slot_bytes.checked_mul(arena.slots as u64) {
                return Err(Error::Unexpected(format!(
                    "device arena of {} bytes for {} slots of {slot_bytes} bytes",
                    arena.bytes, arena.slots
                )));
            }
            let gpu = Gpu::open(ordinal)?;
            let mapping = open_shared(&gpu, &arena.handle, arena.bytes as usize)?;
            tracing::info!(device = %device, gpu = %arena.gpu, "opened the stream's device arena");
            Ok(Some(DeviceSide {
                device,
                mapping,
                slots: arena.slots,
                fences: Mutex::new(HashMap::new()),
                pending: Mutex::new(Vec::new()),
            }))
        }

        pub(crate) fn device(&self) -> Device {
            self.device
        }

        pub(crate) fn base(&self) -> u64 {
            self.mapping.ptr()
        }

        pub(crate) fn slots(&self) -> u32 {
            self.slots
        }

        /// Copies `out.len()` bytes at `offset` of the arena to the host.
        pub(crate) fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
            Ok(self.mapping.read(offset as usize, out)?)
        }

        pub(crate) fn fence_on(&self, seq: u64, stream: u64) {
            let mut f = self.fences.lock().unwrap_or_else(|p| p.into_inner());
            let streams = f.entry(seq).or_default();
            if !streams.contains(&stream) {
                streams.push(stream);
            }
        }

        /// Records the release of `seq`: it is sent once the GPU has done
        /// what was queued on the batch's streams so far.
        pub(crate) fn release_after_gpu(&self, release: Release) -> Result<()> {
            let streams = self
                .fences
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&release.seq)
                .unwrap_or_else(|| vec![cuda::LEGACY_STREAM]);
            let gpu = self.mapping.gpu();
            let events = streams
                .into_iter()
                .map(|s| {
                    let ev = Event::new(gpu)?;
                    ev.record_on(s)?;
                    Ok(ev)
                })
                .collect::<Result<Vec<_>, cuda::CudaError>>()?;
            self.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Pending { release, events });
            Ok(())
        }

        /// Releases whose GPU work has finished (with `all`: waits for all).
        pub(crate) fn finished_releases(&self, all: bool) -> Result<Vec<Release>> {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let mut done = Vec::new();
            let mut err = None;
            pending.retain(|p| {
                let finished = p.events.iter().all(|e| {
                    let r = if all {
                        e.synchronize().map(|_| true)
                    } else {
                        e.done()
                    };
                    r.unwrap_or_else(|e| {
                        err.get_or_insert(e);
                        true
                    })
                });
                if finished {
                    done.push(p.release);
                }
                !finished
            });
            match err {
                // A failed query means the context is broken; the release
                // still goes out (the process's GPU work cannot continue).
                Some(e) => {
                    tracing::warn!("waiting for GPU work before a release: {e}");
                    Ok(done)
                }
                None => Ok(done),
            }
        }

        pub(crate) fn pending(&self) -> bool {
            !self
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
        }
    }
}

/// Without the `cuda` feature no device side can exist.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub(crate) enum DeviceSide {}

#[cfg(not(feature = "cuda"))]
impl DeviceSide {
    pub(crate) fn open(
        device: Device,
        arena: Option<&DeviceArena>,
        _slot_bytes: u64,
    ) -> Result<Option<DeviceSide>> {
        match (device, arena) {
            (Device::Cpu, None) => Ok(None),
            _ => Err(Error::Device(
                "this build of batchcast has no CUDA support (feature `cuda`); use device=\"cpu\""
                    .into(),
            )),
        }
    }
    pub(crate) fn device(&self) -> Device {
        match *self {}
    }
    pub(crate) fn base(&self) -> u64 {
        match *self {}
    }
    pub(crate) fn slots(&self) -> u32 {
        match *self {}
    }
    pub(crate) fn read(&self, _offset: u64, _out: &mut [u8]) -> Result<()> {
        match *self {}
    }
    pub(crate) fn fence_on(&self, _seq: u64, _stream: u64) {
        match *self {}
    }
    pub(crate) fn release_after_gpu(&self, _release: Release) -> Result<()> {
        match *self {}
    }
    pub(crate) fn finished_releases(&self, _all: bool) -> Result<Vec<Release>> {
        match *self {}
    }
    pub(crate) fn pending(&self) -> bool {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_request_without_a_gpu_names_the_way_out() {
        #[cfg(feature = "cuda")]
        if crate::cuda::available() {
            return; // a GPU host: this is the no-driver path only
        }
        let e = Device::Cuda(0).request().unwrap_err().to_string();
        assert!(e.contains("device=\"cpu\""), "{e}");
        assert_eq!(Device::Cpu.request().unwrap(), None);
    }
}
