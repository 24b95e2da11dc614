//! The CUDA backend: a device arena allocated and exported over CUDA IPC,
//! the host arena page-locked, and a copy engine of asynchronous H2D
//! copies on a CUDA stream of its own, each between two timing events.

use std::os::fd::BorrowedFd;
use std::sync::{Arc, OnceLock};

use batchcast::cuda::{self, CopyStream, DeviceBuffer, Event, Gpu, HostRegistration};
use batchcast::proto::{DeviceArena, DeviceRequest};
use batchcast::schema::RingLayout;

use super::copier::{self, Copy, CopyEngine};
use super::{Device, GpuError, Mirror, MirrorSpec, ReplayTarget, TargetMemory};

/// Allocates the device arena of `slots` slots of `slot_bytes` on the
/// GPU `req` names, exports it and starts its copier. `registration` is
/// the stream's page-locking of its host arena, shared by all its GPUs
/// (made on first use).
pub(super) fn create(
    req: &DeviceRequest,
    spec: MirrorSpec<'_>,
    registration: &OnceLock<Option<HostRegistration>>,
) -> Result<Mirror, cuda::CudaError> {
    let MirrorSpec {
        key,
        sink,
        host,
        host_len,
        slots,
        schema,
        stream: stream_name,
    } = spec;
    let gpu = Gpu::by_uuid(&req.uuid)?;
    let label = format!(
        "cuda:{} {} ({})",
        gpu.info.ordinal,
        gpu.info.name,
        cuda::format_uuid(&gpu.info.uuid)
    );
    let pinned = registration
        .get_or_init(|| {
            // SAFETY: the host arena is mapped for the stream's whole life,
            // and the stream drops this registration (with its mirrors,
            // whose copy streams synchronise on drop) before its arena.
            match unsafe { HostRegistration::register(&gpu, host, host_len) } {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::warn!(
                        stream = stream_name,
                        "cannot page-lock the host arena, copies will be staged and slower: {e}"
                    );
                    None
                }
            }
        })
        .is_some();
    // Memory shared over CUDA IPC is mapped once: its rings hold whole
    // units, and device consumers take the stream's batch size (mirrored
    // device rings need CUDA's virtual memory management: `cuda/ring.rs`).
    let rings = RingLayout::unmirrored_for_schema(schema, slots)
        .map_err(|e| cuda::CudaError::NoDriver(e.to_string()))?;
    let bytes = rings.arena_bytes;
    let buffer = Arc::new(DeviceBuffer::alloc(&gpu, bytes as usize)?);
    let arena = DeviceArena {
        memory: batchcast::proto::DeviceMemory::CudaIpc,
        handle: buffer.ipc_handle()?.to_vec(),
        slots,
        rings: rings.clone(),
        gpu: label.clone(),
    };
    let copies = Arc::new(CopyStream::new(&gpu)?);
    let engine = Engine {
        copies: copies.clone(),
        buffer: buffer.clone(),
        spare: Vec::new(),
    };
    let m = Mirror::start(
        label,
        arena,
        pinned,
        Arc::new(Cuda { copies, buffer }),
        move |rx| copier::run((key, rings), rx, sink, engine),
        format!("{stream_name}-copy-gpu{}", gpu.info.ordinal),
    )
    .map_err(|e| cuda::CudaError::NoDriver(e.to_string()))?;
    tracing::info!(stream = stream_name, gpu = %m.label, slots, mib = bytes >> 20, pinned, "device arena allocated and exported");
    Ok(m)
}

/// A CUDA GPU: the stream its mirror copies on, and the device arena
/// the copies go to.
#[derive(Debug)]
struct Cuda {
    copies: Arc<CopyStream>,
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "read back by the conformance suite")
    )]
    buffer: Arc<DeviceBuffer>,
}

impl Device for Cuda {
    fn fence(&self) -> Result<(), GpuError> {
        self.copies.synchronize().map_err(driver)
    }

    #[cfg(test)]
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), GpuError> {
        self.buffer.read_back(offset, out)
    }

    /// Device memory exported over CUDA IPC, its rings unmirrored (mapped
    /// once).
    fn replay_target(
        &self,
        label: &str,
        schema: &batchcast::Schema,
        slots: u32,
        _name: &str,
    ) -> Result<ReplayTarget, String> {
        let rings = RingLayout::unmirrored_for_schema(schema, slots).map_err(|e| e.to_string())?;
        let buffer = DeviceBuffer::alloc(self.copies.gpu(), rings.arena_bytes as usize)
            .map_err(|e| e.to_string())?;
        let handle = buffer.ipc_handle().map_err(|e| e.to_string())?.to_vec();
        Ok(ReplayTarget {
            arena: DeviceArena {
                memory: batchcast::proto::DeviceMemory::CudaIpc,
                handle,
                slots,
                rings,
                gpu: label.into(),
            },
            memory: Box::new(buffer),
        })
    }
}

/// A CUDA replay arena: device memory exported over CUDA IPC (no fd).
impl TargetMemory for DeviceBuffer {
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    #[cfg(test)]
    fn read_back(&self, offset: usize, out: &mut [u8]) -> Result<(), GpuError> {
        self.read(offset, out).map_err(driver)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Copies on one CUDA stream into one device arena.
struct Engine {
    copies: Arc<CopyStream>,
    buffer: Arc<DeviceBuffer>,
    /// Timing events whose copies were waited for, recorded again for the
    /// next copies (at most two per device slot are ever made).
    spare: Vec<Event>,
}

fn driver(e: cuda::CudaError) -> GpuError {
    GpuError::Driver(e.to_string())
}

impl CopyEngine for Engine {
    type Done = (Event, Event);

    fn queue(&mut self, copy: &Copy) -> Result<(Event, Event), GpuError> {
        let dst = match copy.target.as_deref() {
            Some(t) => t.memory::<DeviceBuffer>().ok_or_else(|| {
                GpuError::Driver("a replay arena of another backend for a CUDA copy".into())
            })?,
            None => &*self.buffer,
        };
        let start = self
            .copies
            .record_timed_reusing(self.spare.pop())
            .map_err(driver)?;
        for p in &copy.pieces {
            let src = copy.src.bytes(p).ok_or_else(|| {
                GpuError::Driver(format!(
                    "a batch's piece lies past the host arena ({} bytes at {})",
                    p.len, p.at
                ))
            })?;
            // SAFETY: `src` is inside the copy's source (the stream's host
            // arena, or a consumer's replay arena), which stays mapped
            // while `copy` is alive: the copier holds it until this copy's
            // end event has completed (`wait`). The hub pins a unit's cells
            // until its copy is reported (`copied`), and gives them back
            // unreported only after `fence`; a replayed batch's cells are
            // neither sent nor rewritten before its copy is reported; so
            // the bytes do not change while they are read.
            unsafe {
                self.copies
                    .copy_to_device(dst, p.dst, src.as_ptr(), src.len())
                    .map_err(driver)?
            };
        }
        let end = self
            .copies
            .record_timed_reusing(self.spare.pop())
            .map_err(driver)?;
        Ok((start, end))
    }

    fn wait(&mut self, (start, end): (Event, Event)) -> Result<u64, GpuError> {
        end.synchronize().map_err(driver)?;
        let ns = end.elapsed_since(&start).map_err(driver)?.as_nanos() as u64;
        self.spare.extend([start, end]);
        Ok(ns)
    }
}
