//! DLPack export of a field of a batch: the only module of the Python
//! binding with `unsafe` code.
//!
//! A capsule owns a heap [`Holder`]: the DLPack struct the consumer reads,
//! the shape and strides it points to, and a reference that keeps the
//! batch (and so its slot) alive. Whoever consumes the capsule (numpy,
//! torch) renames it to `used_dltensor[_versioned]` and calls the deleter
//! when its array dies; a capsule never consumed is freed by its own
//! destructor. Either way the holder is dropped exactly once, and dropping
//! it drops the batch reference, which releases the slot when it was the
//! last one.
//!
//! Versioned capsules (DLPack ≥ 1.0, asked for with `max_version`) carry the
//! read-only flag: numpy then makes the array non-writeable. The arena is
//! mapped read-only as well, so a consumer that ignores the flag faults on
//! a write instead of changing what other trainers read.

use std::any::Any;
use std::ffi::{CStr, c_void};

use pyo3::ffi;
use pyo3::prelude::*;

/// `DLDeviceType::kDLCPU`.
pub const DEVICE_CPU: i32 = 1;
pub const DEVICE_CUDA: i32 = 2;
const READ_ONLY: u64 = 1;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

/// `code`: 0 int, 1 uint, 2 float, 4 bfloat, 6 bool.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
#[derive(Debug)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
#[derive(Debug)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
#[derive(Debug)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
#[derive(Debug)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// Everything a capsule owns. Boxed, so the pointers into it stay valid.
struct Holder<M> {
    managed: M,
    shape: Vec<i64>,
    strides: Vec<i64>,
    _keep: Box<dyn Any + Send + Sync>,
}

/// What to export: read-only memory of `shape` elements of `dtype` on
/// `device` (DLPack device type and id), kept valid by `keep`.
pub struct Export {
    pub data: *const u8,
    pub device: (i32, i32),
    pub shape: Vec<i64>,
    pub dtype: DLDataType,
    pub keep: Box<dyn Any + Send + Sync>,
}

const NAME: &CStr = c"dltensor";
const NAME_VERSIONED: &CStr = c"dltensor_versioned";

fn tensor(
    data: *const u8,
    device: (i32, i32),
    dtype: DLDataType,
    shape: &mut [i64],
    strides: &mut [i64],
) -> DLTensor {
    DLTensor {
        data: data as *mut c_void,
        device: DLDevice {
            device_type: device.0,
            device_id: device.1,
        },
        ndim: shape.len() as i32,
        dtype,
        shape: shape.as_mut_ptr(),
        strides: strides.as_mut_ptr(),
        byte_offset: 0,
    }
}

/// Row-major strides, in elements.
fn strides_of(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// The two managed-tensor structs, for code that fills either.
trait Managed: Sized {
    const NAME: &'static CStr;
    const DESTRUCTOR: unsafe extern "C" fn(*mut ffi::PyObject);
    fn new(tensor: DLTensor) -> Self;
    fn tensor(&mut self) -> &mut DLTensor;
    fn set_context(&mut self, ctx: *mut c_void);
}

impl Managed for DLManagedTensorVersioned {
    const NAME: &'static CStr = NAME_VERSIONED;
    const DESTRUCTOR: unsafe extern "C" fn(*mut ffi::PyObject) = capsule_destructor_versioned;
    fn new(dl_tensor: DLTensor) -> Self {
        DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_versioned),
            flags: READ_ONLY,
            dl_tensor,
        }
    }
    fn tensor(&mut self) -> &mut DLTensor {
        &mut self.dl_tensor
    }
    fn set_context(&mut self, ctx: *mut c_void) {
        self.manager_ctx = ctx;
    }
}

impl Managed for DLManagedTensor {
    const NAME: &'static CStr = NAME;
    const DESTRUCTOR: unsafe extern "C" fn(*mut ffi::PyObject) = capsule_destructor_legacy;
    fn new(dl_tensor: DLTensor) -> Self {
        DLManagedTensor {
            dl_tensor,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_legacy),
        }
    }
    fn tensor(&mut self) -> &mut DLTensor {
        &mut self.dl_tensor
    }
    fn set_context(&mut self, ctx: *mut c_void) {
        self.manager_ctx = ctx;
    }
}

/// A DLPack capsule of `export`: versioned (with the read-only flag) when
/// the consumer understands DLPack 1.x, legacy otherwise.
pub fn capsule(py: Python<'_>, export: Export, versioned: bool) -> PyResult<Bound<'_, PyAny>> {
    if versioned {
        make::<DLManagedTensorVersioned>(py, export)
    } else {
        make::<DLManagedTensor>(py, export)
    }
}

fn make<M: Managed>(py: Python<'_>, export: Export) -> PyResult<Bound<'_, PyAny>> {
    let strides = strides_of(&export.shape);
    let mut h = Box::new(Holder {
        managed: M::new(tensor(
            export.data,
            export.device,
            export.dtype,
            &mut [],
            &mut [],
        )),
        shape: export.shape,
        strides,
        _keep: export.keep,
    });
    let (shape, strides, ndim) = (h.shape.as_mut_ptr(), h.strides.as_mut_ptr(), h.shape.len());
    let t = h.managed.tensor();
    t.shape = shape;
    t.strides = strides;
    t.ndim = ndim as i32;
    let raw = Box::into_raw(h);
    // SAFETY: `raw` is a live, uniquely owned holder; the managed struct
    // points at it so the deleter can free it.
    unsafe { (*raw).managed.set_context(raw.cast()) };
    // SAFETY: `raw` stays valid until the deleter runs; the capsule's name
    // is a 'static C string, as the C API requires.
    let cap = unsafe {
        ffi::PyCapsule_New(
            std::ptr::addr_of_mut!((*raw).managed).cast(),
            M::NAME.as_ptr(),
            Some(M::DESTRUCTOR),
        )
    };
    if cap.is_null() {
        // SAFETY: the capsule was not created, so nothing else owns `raw`.
        drop(unsafe { Box::from_raw(raw) });
    }
    // SAFETY: `cap` is a new reference, or null with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, cap) }
}

/// DLPack deleter: the consumer's array is gone.
unsafe extern "C" fn delete_versioned(m: *mut DLManagedTensorVersioned) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` came from `capsule`, whose `manager_ctx` is the boxed
    // holder; DLPack calls the deleter exactly once.
    drop(unsafe { Box::from_raw((*m).manager_ctx.cast::<Holder<DLManagedTensorVersioned>>()) });
}

/// DLPack deleter for legacy capsules.
unsafe extern "C" fn delete_legacy(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: as in `delete_versioned`.
    drop(unsafe { Box::from_raw((*m).manager_ctx.cast::<Holder<DLManagedTensor>>()) });
}

/// Capsule destructor: frees the tensor only if nobody consumed it (a
/// consumer renames the capsule and takes over the deleter).
unsafe extern "C" fn capsule_destructor_versioned(cap: *mut ffi::PyObject) {
    // SAFETY: `cap` is the capsule being destroyed; `PyCapsule_IsValid`
    // only compares its name and never sets an exception.
    if unsafe { ffi::PyCapsule_IsValid(cap, NAME_VERSIONED.as_ptr()) } == 1 {
        // SAFETY: the name matched, so the pointer is our managed struct.
        let m = unsafe { ffi::PyCapsule_GetPointer(cap, NAME_VERSIONED.as_ptr()) };
        // SAFETY: never consumed, so the deleter has not run yet.
        unsafe { delete_versioned(m.cast()) };
    }
}

unsafe extern "C" fn capsule_destructor_legacy(cap: *mut ffi::PyObject) {
    // SAFETY: as in `capsule_destructor_versioned`.
    if unsafe { ffi::PyCapsule_IsValid(cap, NAME.as_ptr()) } == 1 {
        // SAFETY: as in `capsule_destructor_versioned`.
        let m = unsafe { ffi::PyCapsule_GetPointer(cap, NAME.as_ptr()) };
        // SAFETY: as in `capsule_destructor_versioned`.
        unsafe { delete_legacy(m.cast()) };
    }
}

/// Copies `len` bytes from a Python buffer's memory into `dst`.
///
/// # Safety
///
/// `src` must point at `dst.len()` readable bytes that stay allocated for
/// the call (the caller holds the buffer export). The bytes are copied with
/// a raw copy and never borrowed as a Rust slice, so another Python thread
/// writing the source array at the same time yields torn values, not
/// undefined behaviour in this crate's logic.
pub unsafe fn copy_from_raw(src: *const u8, dst: &mut [u8]) {
    // SAFETY: the caller's contract; `dst` is a distinct, exclusive slice.
    unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
}
