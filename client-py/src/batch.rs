//! `Batch` (one batch in shared memory, released once) and `DLField` (one
//! of its fields, exported through DLPack).

use std::sync::{Arc, Mutex};

use batchcast::{DType, Schema};
use pyo3::prelude::*;

use crate::errors::{py_error, to_py};
use crate::{dlpack, lock};

/// One batch in shared memory (see `batchcast.Batch`).
#[pyclass(module = "batchcast._native")]
pub(crate) struct Batch {
    pub(crate) inner: Mutex<Option<Arc<batchcast::Batch>>>,
    pub(crate) schema: Arc<Schema>,
    pub(crate) device: (i32, i32),
    #[pyo3(get)]
    pub(crate) seq: u64,
    #[pyo3(get)]
    pub(crate) epoch: u64,
    #[pyo3(get)]
    pub(crate) index: u64,
    #[pyo3(get)]
    pub(crate) samples: u64,
    /// Its first sample's place in the epoch's order.
    #[pyo3(get)]
    pub(crate) first_sample: u64,
    /// Recomputed for this consumer alone (replay); the same bytes.
    #[pyo3(get)]
    pub(crate) replayed: bool,
    /// `(epoch, sample)` right after it: where to resume from a checkpoint
    /// saved after training on it.
    #[pyo3(get)]
    pub(crate) next_position: (u64, u64),
    /// Seconds the consumer waited for this batch to arrive.
    #[pyo3(get)]
    pub(crate) wait_s: f64,
    /// Seconds from the broker handing it over to this process having it.
    #[pyo3(get)]
    pub(crate) handoff_s: f64,
}

#[pymethods]
impl Batch {
    /// A DLPack exporter of field `i` (zero-copy, read-only): on the
    /// consumer's device; `host=True` asks for host shared memory, which
    /// only a host batch has (a device batch's host slot is given back once
    /// copied).
    #[pyo3(signature = (i, host=false))]
    fn field(&self, i: usize, host: bool) -> PyResult<DLField> {
        let guard = lock(&self.inner);
        let Some(b) = guard.as_ref() else {
            return Err(Python::attach(|py| {
                py_error(
                    py,
                    "BatchReleased",
                    format!(
                        "batch {} of epoch {} was released; its memory may already hold another batch. Take what you need before release(), or keep the tensors (they keep the batch alive)",
                        self.index, self.epoch
                    ),
                    None,
                )
            }));
        };
        let f = self.schema.fields.get(i).ok_or_else(|| {
            pyo3::exceptions::PyIndexError::new_err(format!(
                "field {i} out of range: the stream has {}",
                self.schema.fields.len()
            ))
        })?;
        let shape = b
            .shape(i)
            .expect("index checked above")
            .into_iter()
            .map(|d| d as i64)
            .collect();
        let (ptr, device) = match b.device_ptr(i) {
            Some(p) if !host => (p as usize, self.device),
            _ => {
                let view = b
                    .field_at(i)
                    .map_err(|e| Python::attach(|py| to_py(py, e)))?;
                (view.bytes().as_ptr() as usize, (dlpack::DEVICE_CPU, 0))
            }
        };
        Ok(DLField {
            keep: b.clone(),
            ptr,
            device,
            shape,
            dtype: f.dtype,
        })
    }

    /// Gives up this object's claim on the slot; the slot returns to the
    /// broker once no tensor made from the batch is alive either.
    fn release(&self) {
        lock(&self.inner).take();
    }

    #[getter]
    fn released(&self) -> bool {
        lock(&self.inner).is_none()
    }
}

/// One field of one batch, exported through DLPack.
#[pyclass(module = "batchcast._native", frozen)]
pub(crate) struct DLField {
    pub(crate) keep: Arc<batchcast::Batch>,
    pub(crate) ptr: usize,
    pub(crate) device: (i32, i32),
    pub(crate) shape: Vec<i64>,
    pub(crate) dtype: DType,
}

#[pymethods]
impl DLField {
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some(dev) = dl_device
            && dev != self.device
        {
            return Err(pyo3::exceptions::PyBufferError::new_err(format!(
                "this batchcast field lives on DLPack device {:?}, not {dev:?}; move the tensor after import (or subscribe with that device=)",
                self.device
            )));
        }
        if self.device.0 == dlpack::DEVICE_CUDA {
            // The bytes are ready on every stream (the broker synchronised
            // its copy). The stream the importer will use is where reads of
            // this batch are queued: its release waits for them.
            let s = match stream {
                None => batchcast::device::LEGACY_STREAM,
                Some(s) => match s.extract::<i64>()? {
                    -1 | 1 => batchcast::device::LEGACY_STREAM,
                    0 => {
                        return Err(pyo3::exceptions::PyValueError::new_err(
                            "stream=0 is ambiguous for CUDA in DLPack; pass 1 (legacy default), 2 (per-thread default) or a stream handle",
                        ));
                    }
                    s => s as u64,
                },
            };
            self.keep.fence_on(s);
        }
        if copy == Some(true) {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "batchcast exports batches zero-copy only; copy the array after import",
            ));
        }
        let export = dlpack::Export {
            data: self.ptr as *const u8,
            device: self.device,
            shape: self.shape.clone(),
            dtype: dl_dtype(self.dtype),
            keep: Box::new(self.keep.clone()),
        };
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        dlpack::capsule(py, export, versioned)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        self.device
    }

    /// Address of the first element (for zero-copy checks).
    #[getter]
    fn data_ptr(&self) -> usize {
        self.ptr
    }
}

fn dl_dtype(d: DType) -> dlpack::DLDataType {
    let (code, bits) = match d {
        DType::I8 => (0, 8),
        DType::I16 => (0, 16),
        DType::I32 => (0, 32),
        DType::I64 => (0, 64),
        DType::U8 => (1, 8),
        DType::U16 => (1, 16),
        DType::U32 => (1, 32),
        DType::U64 => (1, 64),
        DType::F16 => (2, 16),
        DType::F32 => (2, 32),
        DType::F64 => (2, 64),
        DType::Bf16 => (4, 16),
        DType::Bool => (6, 8),
    };
    dlpack::DLDataType {
        code,
        bits,
        lanes: 1,
    }
}
