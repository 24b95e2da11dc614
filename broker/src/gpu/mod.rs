//! GPU delivery: for each GPU that has consumers of a stream, one device
//! arena of `gpu_slots × slot_bytes` (each slot laid out like a host slot),
//! allocated once at the first such subscription and exported once over
//! CUDA IPC; and a copier thread that copies host slots into device slots
//! with asynchronous H2D copies on its own CUDA stream, from page-locked
//! memory.
//!
//! The hub (`crate::hub`, one group per GPU) decides what to copy where,
//! and keeps the host slot until the copy is reported and the device slot
//! until its consumers release it; this module only runs copies and reports
//! their end.
//!
//! A [`Mirror`] is the same for every backend (its copier thread, its
//! queue, what consumers are told); the backend (a `copier::CopyEngine`
//! and a `Device`, chosen once when the mirror is made) makes the copies:
//! CUDA, or the host-memory stand-in (`stand_in`, selected by the test
//! setting [`batchcast::stand_in`]) that lets every device behaviour run
//! on machines without a GPU.

use std::os::fd::BorrowedFd;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use batchcast::proto::{DeviceArena, DeviceRequest};
use batchcast::schema::{RingLayout, Schema};
use batchcast::stand_in::Setting;

#[cfg(test)]
mod conformance;
mod copier;
#[cfg(feature = "cuda")]
mod cuda;
pub mod stand_in;

/// A device arena's key: the GPU (its UUID, the same across processes)
/// and the uid whose consumers read it. Memory shared over CUDA IPC is
/// mapped writable (CUDA has no read-only mapping), so each uid reads an
/// arena of its own, copied once per batch for all that uid's consumers
/// on the GPU: what one user's program writes there reaches only that
/// user's own trainers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GpuKey {
    pub uuid: [u8; 16],
    pub uid: u32,
}

impl GpuKey {
    /// The arena a consumer of `uid` asking for `dev` reads.
    pub fn of(dev: &DeviceRequest, uid: u32) -> GpuKey {
        GpuKey {
            uuid: dev.uuid,
            uid,
        }
    }
}

/// Why a GPU cannot be served, or stopped being served. Cloned into each
/// refusal of a consumer of a failed GPU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    #[error("cannot deliver to cuda:{ordinal} ({name}): {reason}")]
    Open {
        ordinal: u32,
        name: String,
        reason: String,
    },
    #[error(
        "cannot deliver to cuda:{ordinal} ({name}): this broker was built without CUDA support (feature `cuda`); subscribe with device=\"cpu\""
    )]
    NotBuilt { ordinal: u32, name: String },
    #[error("cannot start a copier thread: {0}")]
    Copier(String),
    /// The driver failed during copies (its error's text).
    #[error("{0}")]
    Driver(String),
    #[error("cannot make a replay arena on {gpu}: {reason}")]
    ReplayArena { gpu: String, reason: String },
    #[error("stream `{stream}`: copies to {gpu} failed: {reason}")]
    CopiesFailed {
        stream: String,
        gpu: String,
        reason: Box<GpuError>,
    },
}

/// A copy the copier must make: host slot `host` (holding batch `seq`) to
/// device slot `device`.
#[derive(Debug, Clone, Copy)]
pub struct CopyRequest {
    pub host: u32,
    pub device: u32,
    pub seq: u64,
}

/// A replayed batch to copy: batch `seq` of consumer `consumer`'s replay,
/// from its replay arena (`src`, the broker's mapping of its rings) to its
/// own device arena (`target`), as `pieces` say.
#[derive(Debug, Clone)]
pub struct ReplayCopy {
    pub consumer: u64,
    pub seq: u64,
    pub src: Arc<batchcast::shm::Mapping>,
    pub pieces: Vec<Piece>,
    pub target: Arc<ReplayTarget>,
}

/// What a copier is asked to copy.
#[derive(Debug)]
pub(crate) enum Request {
    /// A unit of the stream, to the GPU's shared arena.
    Unit(CopyRequest),
    /// A replayed batch, to its consumer's device arena.
    Replay(ReplayCopy),
}

/// Where a copy's host bytes are read.
pub trait CopySource: Send + Sync {
    /// A piece's host bytes as a checked slice (`None` past the end),
    /// mapped while the source is alive.
    fn bytes(&self, piece: &Piece) -> Option<&[u8]>;
}

impl CopySource for batchcast::shm::Mapping {
    fn bytes(&self, p: &Piece) -> Option<&[u8]> {
        self.get(p.at as u64, p.len as u64)
    }
}

/// A consumer's own arena on its GPU for the batches replayed to it (its
/// replay is its alone: copied once, for it), laid out as the backend's
/// rings for its batch size; freed when the last holder lets it go.
#[derive(Debug)]
pub struct ReplayTarget {
    arena: DeviceArena,
    memory: Box<dyn TargetMemory>,
}

/// A replay arena's memory, of the backend that made it (a sealed memfd
/// the consumer maps for the stand-in, a device buffer for CUDA): only
/// that backend's copy engine writes it, finding its own type again
/// through [`TargetMemory::as_any`].
pub(crate) trait TargetMemory: std::fmt::Debug + Send + Sync + 'static {
    /// The fd the consumer maps, where it maps one (the stand-in's).
    fn fd(&self) -> Option<BorrowedFd<'_>>;
    /// `out.len()` bytes at `offset`, read back (tests).
    #[cfg(test)]
    fn read_back(&self, offset: usize, out: &mut [u8]) -> Result<(), GpuError>;
    fn as_any(&self) -> &dyn std::any::Any;
}

impl ReplayTarget {
    /// What the consumer opens.
    pub fn arena(&self) -> DeviceArena {
        self.arena.clone()
    }

    /// Its layout: where each replayed batch's samples go.
    pub fn rings(&self) -> &RingLayout {
        &self.arena.rings
    }

    /// `out.len()` bytes of the arena at `offset`, read back.
    #[cfg(test)]
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), GpuError> {
        self.memory.read_back(offset, out)
    }

    /// The fd the consumer maps (the stand-in's).
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.memory.fd()
    }

    /// Its memory, if it is of type `M` (the backend that made it asks).
    fn memory<M: TargetMemory>(&self) -> Option<&M> {
        self.memory.as_any().downcast_ref()
    }
}

/// A piece of a unit to copy: `len` host bytes at `at` bytes into the
/// host arena to `dst` bytes into the device arena. Offsets only: the
/// copier gets the bytes through [`CopySource::bytes`], checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub at: usize,
    pub len: usize,
    pub dst: usize,
}

/// What the copier calls back into (the stream); it is the source of
/// units' bytes ([`CopySource`]: its host arena).
pub trait CopySink: CopySource + 'static {
    /// Unit `seq`'s bytes: each field's cells in the host arena, to the
    /// cells of its stream position in the device arena laid out as
    /// `device` (a piece wherever either ring wraps).
    fn host_pieces(&self, seq: u64, device: &RingLayout) -> Vec<Piece>;
    /// The copy of `req` to GPU `key` completed after `elapsed_ns`.
    fn copied(&self, key: &GpuKey, req: CopyRequest, bytes: u64, elapsed_ns: u64);
    /// The copy of consumer `consumer`'s replayed batch `seq` completed.
    fn replay_copied(&self, key: &GpuKey, consumer: u64, seq: u64, bytes: u64, elapsed_ns: u64);
    /// The GPU `key` failed; its consumers must be told.
    fn gpu_failed(&self, key: &GpuKey, why: GpuError);
}

/// A backend's device, chosen once when its mirror is made (CUDA, or the
/// host-memory stand-in): what the copier thread, the same for every
/// backend, does not do itself. Its copies go through the backend's
/// `copier::CopyEngine`.
trait Device: Send + Sync + std::fmt::Debug {
    /// Waits until every queued copy has finished reading host memory.
    fn fence(&self) -> Result<(), GpuError>;
    /// `out.len()` bytes of the mirror's device arena at `offset`, read
    /// back (what the conformance suite checks copies by).
    #[cfg(test)]
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), GpuError>;
    /// A consumer's own arena on this device (labelled `label`) for
    /// `schema`'s batch size and `slots` batches; `name` names its memory.
    fn replay_target(
        &self,
        label: &str,
        schema: &Schema,
        slots: u32,
        name: &str,
    ) -> Result<ReplayTarget, String>;
}

/// One stream's arena on one GPU and its copier.
#[derive(Debug)]
pub struct Mirror {
    /// `cuda:N NAME (GPU-UUID)`, N the broker's ordinal.
    label: String,
    arena: DeviceArena,
    /// Whether copies come from page-locked memory.
    pinned: bool,
    device: Arc<dyn Device>,
    tx: Mutex<Option<mpsc::Sender<Request>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The stand-in's device memory, whose fd its consumers are sent.
    stand_in: Option<Arc<batchcast::shm::Arena>>,
}

impl Mirror {
    /// Starts the copier thread of a mirror whose arena exists.
    fn start(
        label: String,
        arena: DeviceArena,
        pinned: bool,
        device: Arc<dyn Device>,
        run: impl FnOnce(mpsc::Receiver<Request>) + Send + 'static,
        thread_name: String,
    ) -> Result<Mirror, GpuError> {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || run(rx))
            .map_err(|e| GpuError::Copier(e.to_string()))?;
        Ok(Mirror {
            label,
            arena,
            pinned,
            device,
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            stand_in: None,
        })
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    /// What a consumer needs to open the device arena.
    pub fn arena(&self) -> DeviceArena {
        self.arena.clone()
    }

    pub fn pinned(&self) -> bool {
        self.pinned
    }

    /// The fd a consumer maps the arena from, sent with its welcome: the
    /// stand-in's memfd (CUDA's arena goes by its IPC handle).
    pub fn device_fd(&self) -> Option<BorrowedFd<'_>> {
        self.stand_in.as_ref().map(|a| a.fd())
    }

    /// The stand-in's device memory, as consumers see it.
    pub fn stand_in_bytes(&self) -> Option<&[u8]> {
        let m = self.stand_in.as_ref()?.mapping();
        m.get(0, m.len() as u64)
    }

    /// Queues a copy; its completion is reported to the sink.
    pub fn request(&self, req: CopyRequest) {
        self.send(Request::Unit(req));
    }

    /// Queues the copy of a replayed batch; its completion is reported to
    /// the sink ([`CopySink::replay_copied`]).
    pub fn request_replay(&self, copy: ReplayCopy) {
        self.send(Request::Replay(copy));
    }

    fn send(&self, req: Request) {
        if let Some(tx) = &*self.tx.lock().unwrap_or_else(|p| p.into_inner()) {
            let _ = tx.send(req);
        }
    }

    /// A consumer's own arena on this GPU for its replayed batches: the
    /// backend's rings for `schema` (its batch size) and `slots` batches.
    pub fn replay_target(
        &self,
        schema: &Schema,
        slots: u32,
        name: &str,
    ) -> Result<Arc<ReplayTarget>, GpuError> {
        self.device
            .replay_target(&self.label, schema, slots, name)
            .map(Arc::new)
            .map_err(|reason| GpuError::ReplayArena {
                gpu: self.label.clone(),
                reason,
            })
    }

    /// Waits until every queued copy has finished reading host memory
    /// (before the host slots of copies that will never be reported are
    /// given back).
    pub fn fence(&self) {
        if let Err(e) = self.device.fence() {
            tracing::warn!(gpu = %self.label, "waiting for copies: {e}");
        }
    }

    /// `out.len()` bytes of the device arena at `offset`, read back.
    #[cfg(test)]
    fn read_device(&self, offset: usize, out: &mut [u8]) -> Result<(), GpuError> {
        self.device.read(offset, out)
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

/// The GPUs one stream copies to: mirrors by GPU, created on demand.
#[derive(Debug)]
pub struct Gpus {
    mirrors: Mutex<std::collections::HashMap<GpuKey, Arc<Mirror>>>,
    #[cfg(feature = "cuda")]
    registration: std::sync::OnceLock<Option<batchcast::cuda::HostRegistration>>,
    /// Whether stand-in GPUs are served ([`batchcast::stand_in`]): the
    /// broker's test setting, read once (always on in unit tests).
    stand_in: Mutex<Option<Setting>>,
}

impl Default for Gpus {
    fn default() -> Gpus {
        let stand_in = match cfg!(test) {
            true => Some(Setting::default()),
            // A bad value stopped the broker at start (`announce`).
            false => batchcast::stand_in::setting().ok().flatten(),
        };
        Gpus {
            mirrors: Mutex::default(),
            #[cfg(feature = "cuda")]
            registration: std::sync::OnceLock::new(),
            stand_in: Mutex::new(stand_in),
        }
    }
}

/// What a stream gives [`Gpus::mirror`] to make a GPU's device arena.
pub struct MirrorSpec<'a> {
    /// The arena's GPU and the uid it serves.
    pub key: GpuKey,
    /// Where the copier reports copies done or failed: the stream.
    pub sink: Weak<dyn CopySink>,
    /// The stream's host arena (page-locked once for all its GPUs): its
    /// start, mapped for the stream's whole life, and its length.
    pub host: *const u8,
    pub host_len: usize,
    /// The device arena's slots (`gpu_slots`): units of `schema`.
    pub slots: u32,
    pub schema: &'a Schema,
    /// The stream's name, for logs and the copier thread's name.
    pub stream: &'a str,
}

impl std::fmt::Debug for MirrorSpec<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MirrorSpec")
            .field("host", &self.host)
            .field("host_len", &self.host_len)
            .field("slots", &self.slots)
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl Gpus {
    /// The mirror for `req`'s GPU, created (allocated, exported, its copier
    /// started) as `spec` says on the first subscription for that GPU.
    pub fn mirror(
        &self,
        req: &DeviceRequest,
        spec: MirrorSpec<'_>,
    ) -> Result<Arc<Mirror>, GpuError> {
        let mut mirrors = self.mirrors.lock().unwrap_or_else(|p| p.into_inner());
        let key = spec.key;
        if let Some(m) = mirrors.get(&key) {
            return Ok(m.clone());
        }
        let m = Arc::new(self.create(req, spec)?);
        mirrors.insert(key, m.clone());
        Ok(m)
    }

    #[allow(unused_variables)] // which ones depends on the features
    fn create(&self, req: &DeviceRequest, spec: MirrorSpec<'_>) -> Result<Mirror, GpuError> {
        if let Some(ordinal) = batchcast::stand_in::ordinal_of(&req.uuid) {
            let setting = *self.stand_in.lock().unwrap_or_else(|p| p.into_inner());
            let Some(setting) = setting else {
                return Err(GpuError::Open {
                    ordinal: req.ordinal,
                    name: req.name.clone(),
                    reason: format!(
                        "this is the host-memory stand-in for a GPU, a test setting this broker was not started with ({}=1)",
                        batchcast::stand_in::ENV
                    ),
                });
            };
            return stand_in::create(spec, ordinal, setting.fail_at);
        }
        #[cfg(feature = "cuda")]
        return cuda::create(req, spec, &self.registration).map_err(|e| GpuError::Open {
            ordinal: req.ordinal,
            name: req.name.clone(),
            reason: e.to_string(),
        });
        #[cfg(not(feature = "cuda"))]
        Err(GpuError::NotBuilt {
            ordinal: req.ordinal,
            name: req.name.clone(),
        })
    }

    /// Tests: stand-in GPUs fail at copy `n` (those made from now on).
    #[cfg(test)]
    pub fn fail_stand_ins_at(&self, n: u64) {
        *self.stand_in.lock().unwrap() = Some(Setting { fail_at: Some(n) });
    }

    /// Tests: stand-in GPU `ordinal`'s rings for this stream, and its
    /// memory (the arena of this process's uid).
    #[cfg(test)]
    pub fn stand_in_memory(&self, ordinal: u32) -> (RingLayout, Vec<u8>) {
        let mirrors = self.mirrors.lock().unwrap();
        let m = &mirrors[&GpuKey {
            uuid: batchcast::stand_in::uuid(ordinal),
            uid: nix::unistd::geteuid().as_raw(),
        }];
        (m.arena.rings.clone(), m.stand_in_bytes().unwrap().to_vec())
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

/// What the broker says once at start about GPUs; a bad test setting
/// ([`batchcast::stand_in::ENV`]) stops it.
pub fn announce() -> Result<(), batchcast::ParseError> {
    if let Some(s) = batchcast::stand_in::setting()? {
        tracing::warn!(
            "{}: device consumers are served by a host-memory stand-in for a GPU (a test setting){}",
            batchcast::stand_in::ENV,
            s.fail_at
                .map(|n| format!("; each fails at copy {n}"))
                .unwrap_or_default()
        );
    }
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
    Ok(())
}
