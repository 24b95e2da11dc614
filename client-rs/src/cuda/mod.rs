//! A small safe layer over the parts of the CUDA driver API batchcast uses:
//! device lookup by UUID, device arenas exported and imported over CUDA IPC,
//! page-locked host registration, and asynchronous host-to-device copies
//! fenced by events.
//!
//! The driver is loaded at run time (cudarc's `dynamic-loading`): nothing
//! CUDA is needed to build, and on a host without a driver every entry point
//! returns [`CudaError::NoDriver`] instead of panicking (cudarc panics if
//! its first call finds no `libcuda`, so [`driver`] probes for the library
//! before any call).
//!
//! Layered as cudarc layers its own: [`result`] holds every driver call,
//! each a thin function returning `Result<_, CudaError>` (`unsafe` where
//! the driver asks what the types cannot check, with its `# Safety`); the
//! types here hold handles and call it, and make no driver call of their
//! own.
//!
//! This is the only module of the crate with `unsafe` CUDA calls. Objects
//! keep the device's primary context retained for as long as they live and
//! make it current on the calling thread before each call, so they can be
//! used from any thread.

use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

mod event;
#[cfg(any(test, feature = "broker"))]
mod owner;
pub mod result;
mod ring;

pub use event::Event;
#[cfg(any(test, feature = "broker"))]
pub use owner::{CopyStream, DeviceBuffer, HostRegistration};
pub use ring::{MirroredRing, granularity};

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_LEN: usize = 64;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CudaError {
    #[error(
        "no CUDA driver on this host ({0}); batches are served in host memory: subscribe with device=\"cpu\""
    )]
    NoDriver(String),
    /// A driver call failed; `name` is the CUDA error name
    /// (`CUDA_ERROR_OUT_OF_MEMORY`, ...).
    #[error("CUDA {call} failed: {name} ({description})")]
    Driver {
        call: &'static str,
        name: String,
        description: String,
    },
    #[error(
        "no CUDA device cuda:{ordinal}: this process sees {count} (check CUDA_VISIBLE_DEVICES)"
    )]
    NoDevice { ordinal: u32, count: u32 },
    #[error("no GPU of this host has UUID {0}")]
    UnknownGpu(String),
    #[error("an IPC handle must be {IPC_HANDLE_LEN} bytes, got {0}")]
    BadHandle(usize),
    /// A mirrored device ring of a length the driver cannot map (zero, not
    /// a multiple of the allocation granularity, or beyond the address space).
    #[error("a device ring of {len} bytes cannot be mapped (granularity {granularity} bytes)")]
    BadRing { len: usize, granularity: usize },
}

pub use result::check;

/// Proof that the driver is loaded and initialised.
#[derive(Debug)]
pub struct Driver {
    pub version: i32,
}

static DRIVER: OnceLock<Result<Driver, CudaError>> = OnceLock::new();

fn driver_loaded() -> bool {
    matches!(DRIVER.get(), Some(Ok(_)))
}

/// Loads and initialises the CUDA driver once per process.
pub fn driver() -> Result<&'static Driver, CudaError> {
    DRIVER
        .get_or_init(|| {
            if !result::library_present() {
                return Err(CudaError::NoDriver("libcuda.so not found".into()));
            }
            result::init()?;
            Ok(Driver {
                version: result::driver_version()?,
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether the driver loaded, without saying why not.
pub fn available() -> bool {
    driver().is_ok()
}

/// A GPU's identity: stable across processes, unlike ordinals (which
/// `CUDA_VISIBLE_DEVICES` renumbers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Ordinal in this process.
    pub ordinal: u32,
    pub uuid: [u8; 16],
    pub name: String,
}

/// `GPU-xxxxxxxx-xxxx-...` as `nvidia-smi -L` prints it.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Every GPU this process sees.
pub fn gpus() -> Result<Vec<GpuInfo>, CudaError> {
    driver()?;
    (0..result::device_count()?).map(gpu_info).collect()
}

fn gpu_info(ordinal: u32) -> Result<GpuInfo, CudaError> {
    let dev = result::device(ordinal)?;
    Ok(GpuInfo {
        ordinal,
        uuid: result::device_uuid(dev)?,
        name: result::device_name(dev)?,
    })
}

/// One GPU with its primary context retained (the context PyTorch uses).
#[derive(Debug)]
pub struct Gpu {
    pub info: GpuInfo,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUDA context handle may be used from any thread; every call
// makes it current on the calling thread first.
unsafe impl Send for Gpu {}
// SAFETY: as above; the driver serialises what needs serialising.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// The GPU with this process's ordinal `ordinal`.
    pub fn open(ordinal: u32) -> Result<Arc<Gpu>, CudaError> {
        driver()?;
        let count = result::device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let info = gpu_info(ordinal)?;
        let dev = result::device(ordinal)?;
        // SAFETY: `dev` is a device of the initialised driver; `Drop`
        // releases the context once.
        let ctx = unsafe { result::primary_ctx_retain(dev) }?;
        Ok(Arc::new(Gpu { info, dev, ctx }))
    }

    /// The GPU whose UUID is `uuid`.
    pub fn by_uuid(uuid: &[u8; 16]) -> Result<Arc<Gpu>, CudaError> {
        let found = gpus()?
            .into_iter()
            .find(|g| &g.uuid == uuid)
            .ok_or_else(|| CudaError::UnknownGpu(format_uuid(uuid)))?;
        Gpu::open(found.ordinal)
    }

    /// Makes this GPU's context current on the calling thread.
    fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context is retained for as long as `self` lives.
        unsafe { result::ctx_set_current(self.ctx) }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`; every object using the
        // context holds an `Arc<Gpu>`, so none outlives this.
        let _ = unsafe { result::primary_ctx_release(self.dev) };
    }
}

/// A range of device memory of one GPU.
#[derive(Debug)]
pub struct DeviceRange {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceRange {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Copies device bytes back to the host (checks, not the data path).
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        assert!(
            offset
                .checked_add(out.len())
                .is_some_and(|end| end <= self.len),
            "read past the device range"
        );
        self.gpu.bind()?;
        // SAFETY: the source range lies inside the allocation or mapping
        // (asserted), which lives as long as `self`; the destination is a
        // valid exclusive host slice.
        unsafe { result::memcpy_dtoh(out, self.ptr + offset as u64) }
    }

    /// Copies host bytes into the range (checks, not the data path).
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<(), CudaError> {
        assert!(
            offset
                .checked_add(bytes.len())
                .is_some_and(|end| end <= self.len),
            "write past the device range"
        );
        self.gpu.bind()?;
        // SAFETY: the destination lies inside the allocation or mapping
        // (asserted), which lives as long as `self`; the source is a host
        // slice of ours.
        unsafe { result::memcpy_htod(self.ptr + offset as u64, bytes) }
    }
}

/// Another process's device memory, opened from its IPC handle. The
/// mapping is closed on drop.
#[derive(Debug)]
pub struct IpcMapping(DeviceRange);

impl std::ops::Deref for IpcMapping {
    type Target = DeviceRange;
    fn deref(&self) -> &DeviceRange {
        &self.0
    }
}

impl IpcMapping {
    /// Opens `handle` (of `len` bytes) in `gpu`'s primary context.
    pub fn open(gpu: &Arc<Gpu>, handle: &[u8], len: usize) -> Result<IpcMapping, CudaError> {
        let bytes: [u8; IPC_HANDLE_LEN] = handle
            .try_into()
            .map_err(|_| CudaError::BadHandle(handle.len()))?;
        gpu.bind()?;
        // SAFETY: a context is current; `Drop` closes the mapping once.
        let ptr = unsafe { result::ipc_open(bytes) }?;
        Ok(IpcMapping(DeviceRange {
            gpu: gpu.clone(),
            ptr,
            len,
        }))
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once;
            // batches that point into it hold the mapping alive.
            let _ = unsafe { result::ipc_close(self.ptr) };
        }
    }
}

pub use crate::device::{LEGACY_STREAM, PER_THREAD_STREAM};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_errors_are_named_without_a_driver() {
        let e = check("cuMemAlloc", sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("cuMemAlloc"), "{text}");
        assert!(text.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{text}");
        assert_eq!(check("cuInit", sys::CUresult::CUDA_SUCCESS), Ok(()));
    }

    #[test]
    fn uuids_print_like_nvidia_smi() {
        let u: [u8; 16] = std::array::from_fn(|i| i as u8 * 17);
        assert_eq!(format_uuid(&u), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }

    #[test]
    fn without_a_driver_every_entry_point_says_so() {
        if result::library_present() {
            return; // a GPU host: the no-driver path cannot be exercised
        }
        assert!(matches!(driver(), Err(CudaError::NoDriver(_))));
        assert!(!available());
        assert!(matches!(Gpu::open(0), Err(CudaError::NoDriver(_))));
        assert!(matches!(gpus(), Err(CudaError::NoDriver(_))));
        let msg = Gpu::by_uuid(&[0; 16]).unwrap_err().to_string();
        assert!(msg.contains("device=\"cpu\""), "{msg}");
    }
}
