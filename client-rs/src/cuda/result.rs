//! The result layer: every CUDA driver call batchcast makes, each a thin
//! function that makes one call (or one fixed pair) and returns
//! `Result<_, CudaError>` naming the call, as cudarc layers its own
//! (`sys` -> `result` -> safe types). The safe types of [`super`] hold
//! handles and call these; none of them calls the driver itself.
//!
//! A function is `unsafe` when the driver's contract asks something the
//! types here cannot check (a live handle, a current context, a mapped
//! range); its `# Safety` says what. Those with nothing to ask are safe.
//! cudarc's `result` layer is used where it has the call; the rest (the
//! driver version, CUDA IPC, host registration, the asynchronous copy from
//! a raw pointer, events' record and query, virtual memory management) go
//! to `sys` here and nowhere else.

use std::ffi::c_void;
#[cfg(any(test, feature = "broker"))]
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::{CudaError, IPC_HANDLE_LEN};

/// Maps a driver status to `Ok` or to a [`CudaError::Driver`] naming the
/// call and the CUDA error. The name comes from the status itself, so it is
/// right even when the driver cannot describe it.
pub fn check(call: &'static str, status: sys::CUresult) -> Result<(), CudaError> {
    if status == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let description = if super::driver_loaded() {
        cu::DriverError(status)
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "no description".into())
    } else {
        "no description".into()
    };
    Err(CudaError::Driver {
        call,
        name: format!("{status:?}"),
        description,
    })
}

fn named(call: &'static str) -> impl Fn(cu::DriverError) -> CudaError {
    move |e| check(call, e.0).expect_err("a DriverError is never CUDA_SUCCESS")
}

/// Whether a CUDA driver library can be loaded (cudarc panics on its first
/// call if none can, so this comes first).
pub(super) fn library_present() -> bool {
    // SAFETY: only tries to dlopen the library names cudarc would use.
    unsafe { sys::is_culib_present() }
}

/// `cuInit`; a driver that sees no GPU is [`CudaError::NoDriver`].
/// Call only after [`library_present`].
pub(super) fn init() -> Result<(), CudaError> {
    cu::init().map_err(|e| match e.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE => CudaError::NoDriver("the driver sees no GPU".into()),
        _ => named("cuInit")(e),
    })
}

/// `cuDriverGetVersion`. Call only after [`init`].
pub(super) fn driver_version() -> Result<i32, CudaError> {
    let mut version = 0;
    // SAFETY: the driver is loaded; `version` is a valid out-pointer.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut version)
    })?;
    Ok(version)
}

/// GPUs this process sees (`cuDeviceGetCount`).
pub(super) fn device_count() -> Result<u32, CudaError> {
    cu::device::get_count()
        .map(|n| n.max(0) as u32)
        .map_err(named("cuDeviceGetCount"))
}

/// The device of ordinal `ordinal` (`cuDeviceGet`).
pub(super) fn device(ordinal: u32) -> Result<sys::CUdevice, CudaError> {
    cu::device::get(ordinal as i32).map_err(named("cuDeviceGet"))
}

/// A device's UUID bytes (`cuDeviceGetUuid`).
pub(super) fn device_uuid(dev: sys::CUdevice) -> Result<[u8; 16], CudaError> {
    cu::device::get_uuid(dev)
        .map(|u| u.bytes.map(|b| b as u8))
        .map_err(named("cuDeviceGetUuid"))
}

/// A device's name (`cuDeviceGetName`).
pub(super) fn device_name(dev: sys::CUdevice) -> Result<String, CudaError> {
    cu::device::get_name(dev).map_err(named("cuDeviceGetName"))
}

/// Retains `dev`'s primary context (`cuDevicePrimaryCtxRetain`).
///
/// # Safety
///
/// `dev` is a device of the initialised driver; the context is released
/// once with [`primary_ctx_release`].
pub(super) unsafe fn primary_ctx_retain(dev: sys::CUdevice) -> Result<sys::CUcontext, CudaError> {
    // SAFETY: as the caller guarantees.
    unsafe { cu::primary_ctx::retain(dev) }.map_err(named("cuDevicePrimaryCtxRetain"))
}

/// Releases what [`primary_ctx_retain`] retained.
///
/// # Safety
///
/// Once per retain, after everything using the context is gone.
pub(super) unsafe fn primary_ctx_release(dev: sys::CUdevice) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    unsafe { cu::primary_ctx::release(dev) }.map_err(named("cuDevicePrimaryCtxRelease"))
}

/// Makes `ctx` current on the calling thread (`cuCtxSetCurrent`).
///
/// # Safety
///
/// `ctx` is retained for the call and for as long as the thread uses it.
pub(super) unsafe fn ctx_set_current(ctx: sys::CUcontext) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    unsafe { cu::ctx::set_current(ctx) }.map_err(named("cuCtxSetCurrent"))
}

/// Copies device bytes at `src` into `out`, synchronously (`cuMemcpyDtoH`).
///
/// # Safety
///
/// `src .. src + out.len()` lies in live device memory of the current
/// context.
pub(super) unsafe fn memcpy_dtoh(out: &mut [u8], src: sys::CUdeviceptr) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees; `out` is an exclusive host slice.
    unsafe { cu::memcpy_dtoh_sync(out, src) }.map_err(named("cuMemcpyDtoH"))
}

/// Copies `bytes` to device memory at `dst`, synchronously (`cuMemcpyHtoD`).
///
/// # Safety
///
/// `dst .. dst + bytes.len()` lies in live device memory of the current
/// context.
pub(super) unsafe fn memcpy_htod(dst: sys::CUdeviceptr, bytes: &[u8]) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees; `bytes` is a host slice.
    unsafe { cu::memcpy_htod_sync(dst, bytes) }.map_err(named("cuMemcpyHtoD"))
}

/// Queues a copy of `len` host bytes at `src` to `dst` on `stream`
/// (`cuMemcpyHtoDAsync`).
///
/// # Safety
///
/// `dst .. dst + len` lies in live device memory of the current context;
/// `src .. src + len` stays mapped until the copy completes; `stream` is a
/// live stream of the current context.
#[cfg(any(test, feature = "broker"))]
pub(super) unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const u8,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, stream)
    })
}

/// `len` bytes (at least one) of device memory (`cuMemAlloc`).
///
/// # Safety
///
/// A context is current; the memory is uninitialised, freed once with
/// [`mem_free`].
#[cfg(any(test, feature = "broker"))]
pub(super) unsafe fn mem_alloc(len: usize) -> Result<sys::CUdeviceptr, CudaError> {
    // SAFETY: as the caller guarantees; Rust never reads the memory.
    unsafe { cu::malloc_sync(len.max(1)) }.map_err(named("cuMemAlloc"))
}

/// Frees what [`mem_alloc`] returned (`cuMemFree`).
///
/// # Safety
///
/// Once, with nothing queued that uses it.
#[cfg(any(test, feature = "broker"))]
pub(super) unsafe fn mem_free(ptr: sys::CUdeviceptr) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    unsafe { cu::free_sync(ptr) }.map_err(named("cuMemFree"))
}

/// The IPC handle of an allocation (`cuIpcGetMemHandle`).
///
/// # Safety
///
/// `ptr` is the base of a live [`mem_alloc`] allocation of the current
/// context.
#[cfg(any(test, feature = "broker"))]
pub(super) unsafe fn ipc_handle(ptr: sys::CUdeviceptr) -> Result<[u8; IPC_HANDLE_LEN], CudaError> {
    let mut handle = MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: as the caller guarantees; the out-pointer is valid for one
    // handle.
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(handle.as_mut_ptr(), ptr)
    })?;
    // SAFETY: initialised by the successful call above.
    let handle = unsafe { handle.assume_init() };
    Ok(handle.reserved.map(|b| b as u8))
}

/// Opens another process's allocation from its IPC handle in the current
/// context (`cuIpcOpenMemHandle`); the driver validates the handle.
///
/// # Safety
///
/// A context is current; the mapping is closed once with [`ipc_close`].
pub(super) unsafe fn ipc_open(handle: [u8; IPC_HANDLE_LEN]) -> Result<sys::CUdeviceptr, CudaError> {
    let handle = sys::CUipcMemHandle {
        reserved: handle.map(|b| b as _),
    };
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: as the caller guarantees; `ptr` is a valid out-pointer.
    check("cuIpcOpenMemHandle", unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            handle,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    })?;
    Ok(ptr)
}

/// Closes what [`ipc_open`] opened (`cuIpcCloseMemHandle`).
///
/// # Safety
///
/// Once, with nothing queued that uses it.
pub(super) unsafe fn ipc_close(ptr: sys::CUdeviceptr) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    check("cuIpcCloseMemHandle", unsafe {
        sys::cuIpcCloseMemHandle(ptr)
    })
}

/// Page-locks `len` host bytes at `ptr` for every context
/// (`cuMemHostRegister`, `PORTABLE`).
///
/// # Safety
///
/// The range stays mapped until [`host_unregister`].
#[cfg(any(test, feature = "broker"))]
pub(super) unsafe fn host_register(ptr: *const u8, len: usize) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    check("cuMemHostRegister", unsafe {
        sys::cuMemHostRegister_v2(ptr as *mut c_void, len, sys::CU_MEMHOSTREGISTER_PORTABLE)
    })
}

/// Undoes [`host_register`] (`cuMemHostUnregister`).
///
/// # Safety
///
/// Once per registration, with no copy from it in flight.
#[cfg(any(test, feature = "broker"))]
pub(super) unsafe fn host_unregister(ptr: *const u8) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(ptr as *mut c_void)
    })
}

/// A new non-blocking stream of the current context (`cuStreamCreate`).
/// Call with a context current.
#[cfg(any(test, feature = "broker"))]
pub(super) fn stream_create() -> Result<sys::CUstream, CudaError> {
    cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(named("cuStreamCreate"))
}

/// Waits for everything queued on `stream` (`cuStreamSynchronize`).
///
/// # Safety
///
/// `stream` is live.
#[cfg(any(test, feature = "broker"))]
pub(super) unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    unsafe { cu::stream::synchronize(stream) }.map_err(named("cuStreamSynchronize"))
}

/// Destroys `stream` (`cuStreamDestroy`).
///
/// # Safety
///
/// Once; nothing is queued on it any more.
#[cfg(any(test, feature = "broker"))]
pub(super) unsafe fn stream_destroy(stream: sys::CUstream) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    unsafe { cu::stream::destroy(stream) }.map_err(named("cuStreamDestroy"))
}

/// A new event of the current context (`cuEventCreate`). Call with a
/// context current.
pub(super) fn event_create(flags: sys::CUevent_flags) -> Result<sys::CUevent, CudaError> {
    cu::event::create(flags).map_err(named("cuEventCreate"))
}

/// Records `ev` on a stream given as a raw handle (`cuEventRecord`): `1`
/// the legacy default stream, `2` the per-thread default, else a `CUstream`.
///
/// # Safety
///
/// `ev` is live; `stream` is one of the driver's special values or a live
/// stream of `ev`'s context.
pub(super) unsafe fn event_record(ev: sys::CUevent, stream: u64) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    check("cuEventRecord", unsafe {
        sys::cuEventRecord(ev, stream as usize as sys::CUstream)
    })
}

/// Whether the work before `ev`'s record has completed (`cuEventQuery`).
///
/// # Safety
///
/// `ev` is live.
pub(super) unsafe fn event_query(ev: sys::CUevent) -> Result<bool, CudaError> {
    // SAFETY: as the caller guarantees.
    match unsafe { sys::cuEventQuery(ev) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => check("cuEventQuery", other).map(|_| false),
    }
}

/// Waits for `ev` (`cuEventSynchronize`).
///
/// # Safety
///
/// `ev` is live.
pub(super) unsafe fn event_synchronize(ev: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(ev) })
}

/// Milliseconds from `start` to `end` (`cuEventElapsedTime`).
///
/// # Safety
///
/// Both are live timing events of one context, recorded and completed.
pub(super) unsafe fn event_elapsed_ms(
    start: sys::CUevent,
    end: sys::CUevent,
) -> Result<f32, CudaError> {
    // SAFETY: as the caller guarantees.
    unsafe { cu::event::elapsed(start, end) }.map_err(named("cuEventElapsedTime"))
}

/// Destroys `ev` (`cuEventDestroy`).
///
/// # Safety
///
/// Once.
pub(super) unsafe fn event_destroy(ev: sys::CUevent) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    unsafe { cu::event::destroy(ev) }.map_err(named("cuEventDestroy"))
}

/// What a mirrored ring asks of its allocation: device memory of device
/// `ordinal`, exportable as a POSIX file descriptor.
pub(super) fn ring_properties(ordinal: u32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct of integers and one pointer, for which all
    // zeroes is the documented "no flags, no metadata" value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal as i32;
    prop
}

/// The minimum granularity of allocations like `prop`
/// (`cuMemGetAllocationGranularity`). Call with a context current.
pub(super) fn granularity(prop: &sys::CUmemAllocationProp) -> Result<usize, CudaError> {
    let mut g = 0usize;
    // SAFETY: both pointers are valid for the call.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(g)
}

/// A physical allocation of `len` bytes (`cuMemCreate`). Call with a
/// context current; `len` a multiple of the granularity (the driver checks).
pub(super) fn mem_create(
    len: usize,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle, CudaError> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: valid out-pointer and properties.
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut handle, len, prop, 0)
    })?;
    Ok(handle)
}

/// Imports an allocation another process exported as `fd`
/// (`cuMemImportFromShareableHandle`). Call with a context current.
pub(super) fn mem_import(
    fd: BorrowedFd<'_>,
) -> Result<sys::CUmemGenericAllocationHandle, CudaError> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: for a POSIX fd handle the driver takes the descriptor's value
    // in place of a pointer (the documented calling convention); the fd
    // stays open for the call and the driver does not keep it.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut handle,
            fd.as_raw_fd() as isize as *mut c_void,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
    })?;
    Ok(handle)
}

/// The allocation `handle` as a new file descriptor
/// (`cuMemExportToShareableHandle`).
///
/// # Safety
///
/// `handle` is live and was made exportable as a POSIX fd
/// ([`ring_properties`]).
pub(super) unsafe fn mem_export(
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<OwnedFd, CudaError> {
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: as the caller guarantees; for a POSIX fd handle the
    // out-pointer is an `int`.
    check("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut std::ffi::c_int).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    })?;
    // SAFETY: the driver returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Releases an allocation's handle (`cuMemRelease`).
///
/// # Safety
///
/// Once; its mappings are unmapped first or keep the memory alive.
pub(super) unsafe fn mem_release(
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}

/// Reserves `len` bytes of device address space aligned to `align`
/// (`cuMemAddressReserve`), at no fixed address.
pub(super) fn address_reserve(len: usize, align: usize) -> Result<sys::CUdeviceptr, CudaError> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: valid out-pointer; no fixed address asked for.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut ptr, len, align, 0, 0)
    })?;
    Ok(ptr)
}

/// Frees a reservation (`cuMemAddressFree`).
///
/// # Safety
///
/// Once, exactly as [`address_reserve`] returned it, nothing mapped in it.
pub(super) unsafe fn address_free(ptr: sys::CUdeviceptr, len: usize) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(ptr, len)
    })
}

/// Maps `len` bytes of allocation `handle` at `at` (`cuMemMap`).
///
/// # Safety
///
/// `at .. at + len` lies in a reservation of ours and is not mapped; the
/// allocation holds `len` bytes.
pub(super) unsafe fn mem_map(
    at: sys::CUdeviceptr,
    len: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    check("cuMemMap", unsafe { sys::cuMemMap(at, len, 0, handle, 0) })
}

/// Unmaps `len` bytes at `at` (`cuMemUnmap`).
///
/// # Safety
///
/// Exactly what [`mem_map`] mapped, once, with nothing queued that uses it.
pub(super) unsafe fn mem_unmap(at: sys::CUdeviceptr, len: usize) -> Result<(), CudaError> {
    // SAFETY: as the caller guarantees.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(at, len) })
}

/// Lets device `ordinal` read and write `len` mapped bytes at `at`
/// (`cuMemSetAccess`).
///
/// # Safety
///
/// `at .. at + len` is mapped ([`mem_map`]).
pub(super) unsafe fn mem_set_access(
    at: sys::CUdeviceptr,
    len: usize,
    ordinal: u32,
) -> Result<(), CudaError> {
    let access = sys::CUmemAccessDesc {
        location: ring_properties(ordinal).location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: as the caller guarantees; one valid descriptor.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(at, len, &access, 1)
    })
}
