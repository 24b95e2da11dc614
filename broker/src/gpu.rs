//! GPU delivery: for each GPU that has consumers of a stream, one device
//! arena of `gpu_slots × slot_bytes` (each slot laid out like a host slot),
//! allocated once at the first such subscription and exported once over
//! CUDA IPC; and a copier thread that copies host slots into device slots
//! with asynchronous H2D copies on its own CUDA stream, from page-locked
//! memory.
//!
//! The hub ([`crate::hub`], one group per GPU) decides what to copy where,
//! and keeps the host slot until the copy is reported and the device slot
//! until its consumers release it; this module only runs copies and reports
//! their end.

use std::sync::Arc;

use batchcast::proto::DeviceRequest;

/// Identifies a GPU across processes.
pub type GpuKey = [u8; 16];

/// A copy the copier must make: host slot `host` (holding batch `seq`) to
/// device slot `device`.
#[derive(Debug, Clone, Copy)]
pub struct CopyRequest {
    pub host: u32,
    pub device: u32,
    pub seq: u64,
}

/// What the copier calls back into (the stream).
pub trait CopySink: Send + Sync + 'static {
    /// Host bytes of `slot`; valid while the sink is alive.
    fn host_slot(&self, slot: u32) -> (*const u8, usize);
    /// The copy of `req` to GPU `key` completed after `elapsed_ns`.
    fn copied(&self, key: &GpuKey, req: CopyRequest, bytes: u64, elapsed_ns: u64);
    /// The GPU `key` failed; its consumers must be told.
    fn gpu_failed(&self, key: &GpuKey, why: String);
}

#[cfg(feature = "cuda")]
pub use imp::Mirror;

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::mpsc;
    use std::sync::{Mutex, OnceLock, Weak};
    use std::thread::JoinHandle;

    use batchcast::cuda::{self, CopyStream, DeviceBuffer, Gpu, HostRegistration};

    use super::*;

    /// One stream's arena on one GPU and its copier.
    #[derive(Debug)]
    pub struct Mirror {
        /// `cuda:N NAME (GPU-UUID)`, N the broker's ordinal.
        label: String,
        handle: Vec<u8>,
        slots: u32,
        bytes: u64,
        /// Whether copies come from page-locked memory.
        pinned: bool,
        tx: Mutex<Option<mpsc::Sender<CopyRequest>>>,
        copies: Arc<CopyStream>,
        thread: Mutex<Option<JoinHandle<()>>>,
    }

    impl Mirror {
        /// Allocates the device arena of `slots` slots of `slot_bytes` on
        /// the GPU `req` names, exports it and starts its copier.
        /// `registration` is the stream's page-locking of its host arena,
        /// shared by all its GPUs (made on first use).
        pub fn create(
            req: &DeviceRequest,
            sink: Weak<dyn CopySink>,
            host: (*const u8, usize),
            (slots, slot_bytes): (u32, u64),
            registration: &OnceLock<Option<HostRegistration>>,
            stream_name: &str,
        ) -> Result<Mirror, cuda::CudaError> {
            let gpu = Gpu::by_uuid(&req.uuid)?;
            let label = format!(
                "cuda:{} {} ({})",
                gpu.info.ordinal,
                gpu.info.name,
                cuda::format_uuid(&gpu.info.uuid)
            );
            let pinned = registration
                .get_or_init(|| {
                    // SAFETY: the host arena is mapped for the stream's whole
                    // life, and the stream drops this registration (with its
                    // mirrors, whose copy streams synchronise on drop) before
                    // its arena.
                    match unsafe { HostRegistration::register(&gpu, host.0, host.1) } {
                        Ok(r) => Some(r),
                        Err(e) => {
                            tracing::warn!(stream = stream_name, "cannot page-lock the host arena, copies will be staged and slower: {e}");
                            None
                        }
                    }
                })
                .is_some();
            let bytes = slots as u64 * slot_bytes;
            let buffer = Arc::new(DeviceBuffer::alloc(&gpu, bytes as usize)?);
            let handle = buffer.ipc_handle()?.to_vec();
            let copies = Arc::new(CopyStream::new(&gpu)?);
            let (tx, rx) = mpsc::channel();
            let key = req.uuid;
            let thread = {
                let copies = copies.clone();
                std::thread::Builder::new()
                    .name(format!("{stream_name}-copy-gpu{}", gpu.info.ordinal))
                    .spawn(move || copier(key, rx, sink, copies, buffer))
                    .map_err(|e| {
                        cuda::CudaError::NoDriver(format!("cannot start a copier thread: {e}"))
                    })?
            };
            tracing::info!(stream = stream_name, gpu = %label, slots, mib = bytes >> 20, pinned, "device arena allocated and exported");
            Ok(Mirror {
                label,
                handle,
                slots,
                bytes,
                pinned,
                tx: Mutex::new(Some(tx)),
                copies,
                thread: Mutex::new(Some(thread)),
            })
        }

        pub fn label(&self) -> &str {
            &self.label
        }

        /// What a consumer needs to open the device arena.
        pub fn arena(&self) -> batchcast::proto::DeviceArena {
            batchcast::proto::DeviceArena {
                handle: self.handle.clone(),
                slots: self.slots,
                bytes: self.bytes,
                gpu: self.label.clone(),
            }
        }

        pub fn pinned(&self) -> bool {
            self.pinned
        }

        /// Queues a copy; its completion is reported to the sink.
        pub fn request(&self, req: CopyRequest) {
            if let Some(tx) = &*self.tx.lock().unwrap_or_else(|p| p.into_inner()) {
                let _ = tx.send(req);
            }
        }

        /// Waits until every queued copy has finished reading host memory
        /// (before the host slots of copies that will never be reported are
        /// given back).
        pub fn fence(&self) {
            if let Err(e) = self.copies.synchronize() {
                tracing::warn!(gpu = %self.label, "waiting for copies: {e}");
            }
        }

        /// Stops the copier after the copies already queued.
        pub fn stop(&self) {
            self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
            let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
            // The copier itself may drop the last reference to its stream.
            if let Some(t) = thread.filter(|t| t.thread().id() != std::thread::current().id()) {
                let _ = t.join();
            }
        }
    }

    impl Drop for Mirror {
        fn drop(&mut self) {
            self.stop();
        }
    }

    /// Copies requests in order: queues every request waiting, each followed
    /// by an event, then reports each as its event completes. Copies to one
    /// GPU overlap with the reporting of earlier ones.
    fn copier(
        key: GpuKey,
        rx: mpsc::Receiver<CopyRequest>,
        sink: Weak<dyn CopySink>,
        copies: Arc<CopyStream>,
        buffer: Arc<DeviceBuffer>,
    ) {
        // Timing events whose copies were reported, recorded again for the
        // next copies (at most two per device slot are ever made).
        let mut spare: Vec<cuda::Event> = Vec::new();
        while let Ok(first) = rx.recv() {
            let Some(sink) = sink.upgrade() else { return };
            let mut queued = Vec::new();
            let mut next = Some(first);
            let result = (|| {
                while let Some(req) = next.take().or_else(|| rx.try_recv().ok()) {
                    let (ptr, len) = sink.host_slot(req.host);
                    let start = copies.record_timed_reusing(spare.pop())?;
                    // SAFETY: `sink` (the stream, which owns the host arena)
                    // is held until this copy's event has completed below,
                    // so the source stays mapped; the hub pins the host
                    // slot until this copy is reported (`copied`), and
                    // gives it back unreported only after `fence`.
                    unsafe { copies.copy_to_device(&buffer, req.device as usize * len, ptr, len)? };
                    let end = copies.record_timed_reusing(spare.pop())?;
                    queued.push((req, start, end, len as u64));
                }
                // Copy time is GPU time between events around each copy:
                // `bytes / copy_s` is the copy path's bandwidth.
                for (req, start, end, len) in queued.drain(..) {
                    end.synchronize()?;
                    sink.copied(&key, req, len, end.elapsed_since(&start)?.as_nanos() as u64);
                    spare.extend([start, end]);
                }
                Ok::<(), cuda::CudaError>(())
            })();
            if let Err(e) = result {
                sink.gpu_failed(&key, e.to_string());
                return;
            }
        }
    }
}

/// Without the `cuda` feature there is no mirror.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub enum Mirror {}

#[cfg(not(feature = "cuda"))]
impl Mirror {
    pub fn request(&self, _req: CopyRequest) {
        match *self {}
    }
    pub fn fence(&self) {
        match *self {}
    }
    pub fn stop(&self) {
        match *self {}
    }
    pub fn label(&self) -> &str {
        match *self {}
    }
    pub fn arena(&self) -> batchcast::proto::DeviceArena {
        match *self {}
    }
    pub fn pinned(&self) -> bool {
        match *self {}
    }
}

/// The GPUs one stream copies to: mirrors by GPU, created on demand.
#[derive(Debug, Default)]
pub struct Gpus {
    mirrors: std::sync::Mutex<std::collections::HashMap<GpuKey, Arc<Mirror>>>,
    #[cfg(feature = "cuda")]
    registration: std::sync::OnceLock<Option<batchcast::cuda::HostRegistration>>,
}

impl Gpus {
    /// The mirror for `req`'s GPU, created (allocated, exported, its copier
    /// started) on the first subscription for that GPU.
    #[cfg(feature = "cuda")]
    pub fn mirror(
        &self,
        req: &DeviceRequest,
        sink: std::sync::Weak<dyn CopySink>,
        host: (*const u8, usize),
        slots: (u32, u64),
        stream_name: &str,
    ) -> Result<Arc<Mirror>, String> {
        let mut mirrors = self.mirrors.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = mirrors.get(&req.uuid) {
            return Ok(m.clone());
        }
        let m = Mirror::create(req, sink, host, slots, &self.registration, stream_name)
            .map(Arc::new)
            .map_err(|e| format!("cannot deliver to cuda:{} ({}): {e}", req.ordinal, req.name))?;
        mirrors.insert(req.uuid, m.clone());
        Ok(m)
    }

    #[cfg(not(feature = "cuda"))]
    pub fn mirror(
        &self,
        req: &DeviceRequest,
        _sink: std::sync::Weak<dyn CopySink>,
        _host: (*const u8, usize),
        _slots: (u32, u64),
        _stream_name: &str,
    ) -> Result<Arc<Mirror>, String> {
        Err(format!(
            "cannot deliver to cuda:{} ({}): this broker was built without CUDA support (feature `cuda`); subscribe with device=\"cpu\"",
            req.ordinal, req.name
        ))
    }

    /// Stops every copier (after its queued copies) and frees the device
    /// arenas once no one else holds them.
    pub fn stop(&self) {
        let mirrors: Vec<_> = self
            .mirrors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, m)| m)
            .collect();
        for m in mirrors {
            m.stop();
        }
    }
}

/// What the broker says once at start about GPUs.
pub fn announce() {
    #[cfg(feature = "cuda")]
    match batchcast::cuda::gpus() {
        Ok(g) if !g.is_empty() => {
            let names: Vec<String> = g
                .iter()
                .map(|g| format!("cuda:{} {}", g.ordinal, g.name))
                .collect();
            tracing::info!(
                "CUDA: {} GPU(s) for device consumers: {}",
                g.len(),
                names.join(", ")
            );
        }
        Ok(_) => tracing::info!("CUDA: the driver sees no GPU; serving host memory only"),
        Err(e) => tracing::info!("{e}"),
    }
    #[cfg(not(feature = "cuda"))]
    tracing::info!("built without CUDA support: serving host memory only");
}
