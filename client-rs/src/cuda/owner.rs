//! What only the broker does with a GPU: allocate device memory it
//! exports over CUDA IPC, page-lock host memory, copy into the device on
//! streams of its own (the `broker` feature, and this crate's tests).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::{CudaError, DeviceRange, Event, Gpu, IPC_HANDLE_LEN, result};

/// Device memory allocated with `cuMemAlloc` (plain device memory, which
/// is what CUDA IPC can export).
#[derive(Debug)]
pub struct DeviceBuffer(DeviceRange);

impl std::ops::Deref for DeviceBuffer {
    type Target = DeviceRange;
    fn deref(&self) -> &DeviceRange {
        &self.0
    }
}

impl DeviceBuffer {
    pub fn alloc(gpu: &Arc<Gpu>, len: usize) -> Result<DeviceBuffer, CudaError> {
        gpu.bind()?;
        // SAFETY: a context is current; `len` bytes of uninitialised device
        // memory are never read by Rust.
        let ptr = unsafe { result::mem_alloc(len) }?;
        Ok(DeviceBuffer(DeviceRange {
            gpu: gpu.clone(),
            ptr,
            len,
        }))
    }

    /// The handle another process opens with [`IpcMapping::open`](super::IpcMapping::open).
    pub fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_LEN], CudaError> {
        self.gpu.bind()?;
        // SAFETY: `ptr` is the base of a live cuMemAlloc allocation of the
        // context made current above.
        unsafe { result::ipc_handle(self.ptr) }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc and is freed once; users
            // of the memory (copy streams) are dropped first by their owners.
            let _ = unsafe { result::mem_free(self.ptr) };
        }
    }
}

/// A host range page-locked for every context (`PORTABLE`), so copies from
/// it are true DMA and asynchronous.
#[derive(Debug)]
pub struct HostRegistration {
    gpu: Arc<Gpu>,
    ptr: *mut c_void,
    len: usize,
}

// SAFETY: the registration is an address range; the driver allows
// unregistering from any thread.
unsafe impl Send for HostRegistration {}
// SAFETY: as above; it has no interior state.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Page-locks `len` bytes at `ptr`.
    ///
    /// # Safety
    ///
    /// The range must stay mapped until the registration is dropped, and no
    /// copy from it may be in flight then.
    pub unsafe fn register(
        gpu: &Arc<Gpu>,
        ptr: *const u8,
        len: usize,
    ) -> Result<HostRegistration, CudaError> {
        gpu.bind()?;
        // SAFETY: the caller guarantees the range is mapped for the
        // registration's lifetime.
        unsafe { result::host_register(ptr, len) }?;
        Ok(HostRegistration {
            gpu: gpu.clone(),
            ptr: ptr as *mut c_void,
            len,
        })
    }

    pub fn contains(&self, ptr: *const u8, len: usize) -> bool {
        let base = self.ptr as usize;
        let p = ptr as usize;
        p >= base && p.saturating_add(len) <= base + self.len
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: registered in `register`, unregistered once.
            let _ = unsafe { result::host_unregister(self.ptr as *const u8) };
        }
    }
}

/// A non-blocking CUDA stream of one GPU for asynchronous copies.
#[derive(Debug)]
pub struct CopyStream {
    gpu: Arc<Gpu>,
    stream: sys::CUstream,
}

// SAFETY: CUDA streams may be used from any thread with their context current.
unsafe impl Send for CopyStream {}
// SAFETY: as above; the driver orders work submitted to one stream.
unsafe impl Sync for CopyStream {}

impl CopyStream {
    pub fn new(gpu: &Arc<Gpu>) -> Result<CopyStream, CudaError> {
        gpu.bind()?;
        let stream = result::stream_create()?;
        Ok(CopyStream {
            gpu: gpu.clone(),
            stream,
        })
    }

    /// The GPU its copies go to.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Queues a copy of `len` host bytes at `src` to `dst + offset`.
    ///
    /// # Safety
    ///
    /// `src..src+len` must stay mapped until the copy completes (wait for an
    /// event recorded after it). Its bytes may change meanwhile only if the
    /// copy's result is never used.
    pub unsafe fn copy_to_device(
        &self,
        dst: &DeviceBuffer,
        offset: usize,
        src: *const u8,
        len: usize,
    ) -> Result<(), CudaError> {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= dst.len),
            "copy past the device buffer"
        );
        self.gpu.bind()?;
        // SAFETY: the destination range lies inside `dst` (asserted), the
        // stream is live in the context made current above; the caller
        // guarantees the source stays mapped until the copy is done.
        unsafe { result::memcpy_htod_async(dst.ptr + offset as u64, src, len, self.stream) }
    }

    /// Records an event after everything queued so far.
    pub fn record(&self) -> Result<Event, CudaError> {
        let ev = Event::new(&self.gpu)?;
        ev.record_on(self.stream as u64)?;
        Ok(ev)
    }

    /// Records a timing event after everything queued so far (see
    /// [`Event::elapsed_since`]).
    pub fn record_timed(&self) -> Result<Event, CudaError> {
        let ev = Event::with_flags(&self.gpu, sys::CUevent_flags::CU_EVENT_DEFAULT)?;
        ev.record_on(self.stream as u64)?;
        Ok(ev)
    }

    /// Records a timing event after everything queued so far, reusing
    /// `spare` (an event of this stream's GPU from [`CopyStream::record_timed`]
    /// whose last record has completed) when there is one: a copier records
    /// two events per copy, and reusing them keeps `cuEventCreate` and
    /// `cuEventDestroy` out of its loop.
    pub fn record_timed_reusing(&self, spare: Option<Event>) -> Result<Event, CudaError> {
        match spare {
            Some(ev) if Arc::ptr_eq(&ev.gpu, &self.gpu) => {
                ev.record_on(self.stream as u64)?;
                Ok(ev)
            }
            _ => self.record_timed(),
        }
    }

    /// Blocks until everything queued so far has completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: the stream is live.
        unsafe { result::stream_synchronize(self.stream) }
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: wait for queued copies (their sources and destinations
            // are still alive: owners drop streams first), then destroy once.
            unsafe {
                let _ = result::stream_synchronize(self.stream);
                let _ = result::stream_destroy(self.stream);
            }
        }
    }
}
