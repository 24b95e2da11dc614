//! `Producer`: a registered external stream, filled from numpy arrays.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use batchcast::{Acquired, DType, Field, FillSlot, ParseError, Schema};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{invalid, to_py};
use crate::{TICK, dlpack, lock, schema_dict};

/// A registered external stream (see `batchcast.Producer`).
#[pyclass(module = "batchcast._native")]
pub(crate) struct Producer {
    pub(crate) inner: Mutex<Option<batchcast::Producer>>,
    pub(crate) filling: Mutex<Option<FillSlot>>,
    pub(crate) schema: Arc<Schema>,
}

impl Producer {
    fn with<R>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut batchcast::Producer) -> batchcast::Result<R>,
    ) -> PyResult<R> {
        let mut guard = lock(&self.inner);
        let p = guard
            .as_mut()
            .ok_or_else(|| invalid("this producer is closed"))?;
        f(p).map_err(|e| to_py(py, e))
    }
}

#[pymethods]
impl Producer {
    /// `fields`: `(name, dtype, shape)` per field, in order.
    #[new]
    #[pyo3(signature = (stream, fields, batch_size, batches_per_epoch, epochs=None, slots=4, min_consumers=1, lag_limit=None, hold_limit_s=None, socket=None, name=None, description=String::new(), classes=Vec::new(), connect_timeout=0.0, broker_uid=None, reconnect_timeout=None, rejoin_grace=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        stream: String,
        fields: Vec<(String, String, Vec<u64>)>,
        batch_size: u64,
        batches_per_epoch: u64,
        epochs: Option<u64>,
        slots: u32,
        min_consumers: u32,
        lag_limit: Option<u32>,
        hold_limit_s: Option<f64>,
        socket: Option<PathBuf>,
        name: Option<String>,
        description: String,
        classes: Vec<String>,
        connect_timeout: f64,
        broker_uid: Option<u32>,
        reconnect_timeout: Option<f64>,
        rejoin_grace: Option<f64>,
    ) -> PyResult<Producer> {
        let fields = fields
            .into_iter()
            .map(|(name, dtype, shape)| {
                let dtype: DType = dtype.parse().map_err(|e: ParseError| {
                    invalid(format!("field `{name}`: {e}; batchcast cannot share it"))
                })?;
                Ok(Field {
                    name,
                    dtype,
                    shape,
                    aux: false,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let mut opts =
            batchcast::ProducerOptions::new(stream, fields, batch_size, batches_per_epoch);
        let r = &mut opts.request;
        r.epochs = epochs;
        r.slots = slots;
        r.min_consumers = min_consumers;
        r.lag_limit = lag_limit;
        r.hold_limit_ms = hold_limit_s
            .map(|s| crate::args::seconds("hold_limit_s", s).map(|d| d.as_millis() as u64))
            .transpose()?;
        r.description = description;
        r.classes = classes;
        opts.socket = socket;
        opts.connect_timeout = crate::args::seconds("connect_timeout", connect_timeout)?;
        if let Some(t) = reconnect_timeout {
            opts.reconnect_timeout = crate::args::seconds("reconnect_timeout", t)?;
        }
        if let Some(t) = rejoin_grace {
            opts.rejoin_grace = crate::args::seconds("rejoin_grace", t)?;
        }
        opts.broker_uid = broker_uid;
        if let Some(n) = name {
            opts.name = n;
        }
        let p = py
            .detach(|| batchcast::Producer::register(opts))
            .map_err(|e| to_py(py, e))?;
        Ok(Producer {
            schema: Arc::new(p.schema().clone()),
            inner: Mutex::new(Some(p)),
            filling: Mutex::new(None),
        })
    }

    fn schema<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        schema_dict(py, &self.schema)
    }

    /// Waits for the next slot: `(seq, epoch, index)`, or `None` once every
    /// epoch has been handed out. Ctrl-C interrupts the wait.
    fn acquire(&self, py: Python<'_>) -> PyResult<Option<(u64, u64, u64)>> {
        loop {
            let got = {
                let mut guard = lock(&self.inner);
                let p = guard
                    .as_mut()
                    .ok_or_else(|| invalid("this producer is closed"))?;
                py.detach(|| p.acquire_timeout(TICK))
                    .map_err(|e| to_py(py, e))?
            };
            match got {
                Acquired::Slot(s) => {
                    *lock(&self.filling) = Some(s);
                    return Ok(Some((s.seq, s.epoch, s.index)));
                }
                Acquired::Ended => return Ok(None),
                Acquired::Pending => py.check_signals()?,
            }
        }
    }

    /// Copies `array` (a C-contiguous numpy array, or anything with the
    /// numpy array interface) into field `field` of the slot being filled,
    /// from sample 0 on.
    fn write(&self, py: Python<'_>, field: usize, array: &Bound<'_, PyAny>) -> PyResult<()> {
        let (src, len) = array_memory(array)?;
        if len == 0 {
            return Ok(());
        }
        let slot = lock(&self.filling)
            .ok_or_else(|| invalid("no slot is being filled; call acquire() first"))?;
        self.with(py, |p| {
            let mut views = p.fields_mut(&slot);
            let n = views.len();
            let dst = views.get_mut(field).ok_or_else(|| {
                batchcast::Error::InvalidOption(format!("field {field} out of range ({n} fields)"))
            })?;
            if len > dst.len() {
                return Err(batchcast::Error::InvalidOption(format!(
                    "{len} bytes do not fit field {field}, which holds {} bytes per batch",
                    dst.len()
                )));
            }
            // SAFETY: `src` points at `len` readable bytes of the array's
            // C-contiguous memory (checked by `array_memory`); `array` is
            // borrowed for this whole call, so the memory stays allocated.
            unsafe { dlpack::copy_from_raw(src as *const u8, &mut dst[..len]) };
            Ok(())
        })
    }

    /// Hands the slot being filled to the consumers, with `samples` valid
    /// samples.
    fn publish(&self, py: Python<'_>, samples: u64) -> PyResult<()> {
        let slot = lock(&self.filling)
            .take()
            .ok_or_else(|| invalid("no slot is being filled; call acquire() first"))?;
        self.with(py, |p| p.publish(&slot, samples))
    }

    /// Stops the stream: consumers are told `message`.
    fn fail(&self, py: Python<'_>, message: &str) -> PyResult<()> {
        match lock(&self.inner).take() {
            Some(p) => p.fail(message).map_err(|e| to_py(py, e)),
            None => Ok(()),
        }
    }

    /// Says goodbye: the stream ends normally if every epoch was published
    /// (or, for an endless stream, at an epoch boundary).
    fn close(&self) {
        lock(&self.inner).take();
    }
}

/// Address and byte length of a C-contiguous array, from the numpy array
/// interface (the limited C API of Python 3.9 has no buffer protocol).
fn array_memory(array: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
    let iface = array.getattr("__array_interface__").map_err(|_| {
        invalid(format!(
            "cannot share a {}: pass a numpy array or a CPU torch tensor",
            array
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    let strides = iface.get_item("strides")?;
    if !strides.is_none() {
        return Err(invalid(
            "the array is not C-contiguous; pass numpy.ascontiguousarray(a)",
        ));
    }
    let (ptr, _readonly): (usize, bool) = iface.get_item("data")?.extract()?;
    let shape: Vec<usize> = iface.get_item("shape")?.extract()?;
    let typestr: String = iface.get_item("typestr")?.extract()?;
    let itemsize: usize = typestr
        .get(2..)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| invalid(format!("unknown element type {typestr:?}")))?;
    let len = shape
        .iter()
        .try_fold(itemsize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| invalid("array size overflows"))?;
    if ptr == 0 && len > 0 {
        return Err(invalid("the array has no data pointer"));
    }
    Ok((ptr, len))
}
