//! `batchcast._native`: the Python binding of the Rust client library.
//!
//! This module is thin on purpose: the protocol, the mapping and the
//! release bookkeeping all live in `client-rs`; here they are wrapped for
//! Python, with every blocking wait done without the GIL and in short steps
//! that check for Ctrl-C. The Python package `batchcast` builds the public
//! API (iteration, tensors, exceptions) on top.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use batchcast::schema::SourceInfo;
use batchcast::{Acquired, DType, Event, Field, FillSlot, JoinPolicy, ParseError, Schema};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

mod dlpack;
mod errors;

use errors::{invalid, parse_error, py_error, to_py};

/// How long one wait without the GIL lasts before checking for signals.
const TICK: Duration = Duration::from_millis(50);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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

/// The schema as plain Python data.
fn schema_dict<'py>(py: Python<'py>, s: &Schema) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let fields = PyList::empty(py);
    for f in &s.fields {
        let fd = PyDict::new(py);
        fd.set_item("name", &f.name)?;
        fd.set_item("dtype", f.dtype.name())?;
        fd.set_item("shape", f.shape.clone())?;
        fd.set_item("aux", f.aux)?;
        fields.append(fd)?;
    }
    d.set_item("fields", fields)?;
    d.set_item("batch_size", s.batch_size)?;
    d.set_item("samples_per_epoch", s.samples_per_epoch)?;
    d.set_item("batches_per_epoch", s.batches_per_epoch)?;
    d.set_item("epochs", s.epochs)?;
    d.set_item("classes", s.source.classes().to_vec())?;
    let source = PyDict::new(py);
    match &s.source {
        SourceInfo::Synthetic(spec) => {
            source.set_item("kind", "synthetic")?;
            source.set_item("len", spec.len)?;
            source.set_item("seed", spec.seed)?;
        }
        SourceInfo::Images(i) => {
            source.set_item("kind", "images")?;
            source.set_item("format", &i.format)?;
            source.set_item("root", &i.root)?;
            source.set_item("dataset_len", i.dataset_len)?;
            source.set_item("rank", i.rank)?;
            source.set_item("world_size", i.world_size)?;
        }
        SourceInfo::External(e) => {
            source.set_item("kind", "external")?;
            source.set_item("producer", &e.producer)?;
            source.set_item("pid", e.pid)?;
            source.set_item("description", &e.description)?;
        }
    }
    d.set_item("source", source)?;
    Ok(d)
}

/// A subscription to one stream (see `batchcast.Consumer`).
#[pyclass(module = "batchcast._native")]
struct Consumer {
    inner: Mutex<batchcast::Consumer>,
    schema: Arc<Schema>,
    window: u32,
    /// This consumer's batch size, and its batches in a whole epoch.
    batch_size: u64,
    batches_per_epoch: u64,
    start_epoch: u64,
    owner_uid: u32,
    arena: (usize, usize),
    /// DLPack `(device_type, device_id)` of delivered batches.
    device: (i32, i32),
}

#[pymethods]
impl Consumer {
    #[new]
    #[pyo3(signature = (stream, socket=None, window=2, join="next-epoch", name=None, connect_timeout=0.0, device="cpu", broker_uid=None, batch_size=None, drop_last=None, resume=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        stream: String,
        socket: Option<PathBuf>,
        window: u32,
        join: &str,
        name: Option<String>,
        connect_timeout: f64,
        device: &str,
        broker_uid: Option<u32>,
        batch_size: Option<u64>,
        drop_last: Option<bool>,
        resume: Option<(u64, u64)>,
    ) -> PyResult<Consumer> {
        let device: batchcast::Device = device.parse().map_err(parse_error)?;
        let join: JoinPolicy = join.parse().map_err(parse_error)?;
        if !(connect_timeout.is_finite() && connect_timeout >= 0.0) {
            return Err(invalid(format!(
                "connect_timeout={connect_timeout} must be a number of seconds ≥ 0"
            )));
        }
        let mut opts = batchcast::ConsumerOptions {
            socket,
            stream,
            window,
            join,
            connect_timeout: Duration::from_secs_f64(connect_timeout),
            device,
            broker_uid,
            ..Default::default()
        };
        if let Some(n) = name {
            opts.name = n;
        }
        if batch_size.is_some() {
            opts.batch_size = batch_size;
        }
        opts.drop_last = drop_last;
        opts.resume = resume.map(|(epoch, sample)| batchcast::proto::Position { epoch, sample });
        // Connecting may wait for the broker; Ctrl-C cannot interrupt that
        // wait, so it is bounded by connect_timeout.
        let consumer = py
            .detach(|| batchcast::Consumer::connect(opts))
            .map_err(|e| to_py(py, e))?;
        let (base, len) = consumer.arena();
        Ok(Consumer {
            schema: Arc::new(consumer.schema().clone()),
            window: consumer.welcome().window,
            batch_size: consumer.batch_size(),
            batches_per_epoch: consumer.batches_per_epoch(),
            start_epoch: consumer.welcome().start_epoch,
            owner_uid: consumer.welcome().owner_uid,
            arena: (base as usize, len),
            device: match consumer.device() {
                batchcast::Device::Cpu => (dlpack::DEVICE_CPU, 0),
                batchcast::Device::Cuda(n) => (dlpack::DEVICE_CUDA, n as i32),
            },
            inner: Mutex::new(consumer),
        })
    }

    /// The next event, waiting at most `timeout` seconds (forever if
    /// `None`): `("batch", Batch)`, `("epoch_end", epoch, batches,
    /// complete)`, `("end",)`, or `None` on timeout.
    #[pyo3(signature = (timeout=None))]
    fn next_event<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
        let mut guard = lock(&self.inner);
        loop {
            let c = &mut *guard;
            let ready = py
                .detach(|| c.wait_readable(TICK))
                .map_err(|e| to_py(py, e))?;
            if ready {
                break;
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
        }
        let c = &mut *guard;
        let event = py.detach(|| c.next_event()).map_err(|e| to_py(py, e))?;
        let out = match event {
            Some(Event::Batch(b)) => {
                let next = b.next_position();
                let batch = Batch {
                    first_sample: b.first_sample(),
                    replayed: b.replayed(),
                    next_position: (next.epoch, next.sample),
                    seq: b.seq(),
                    epoch: b.epoch(),
                    index: b.index(),
                    samples: b.len() as u64,
                    wait_s: b.wait_ns() as f64 * 1e-9,
                    handoff_s: b.handoff_ns() as f64 * 1e-9,
                    schema: self.schema.clone(),
                    device: self.device,
                    inner: Mutex::new(Some(Arc::new(b))),
                };
                ("batch", Py::new(py, batch)?).into_pyobject(py)?.into_any()
            }
            Some(Event::EndOfEpoch(e)) => ("epoch_end", e.epoch, e.batches, e.complete)
                .into_pyobject(py)?
                .into_any(),
            Some(Event::EndOfStream) | None => ("end",).into_pyobject(py)?.into_any(),
        };
        Ok(Some(out))
    }

    /// The stream's schema as a dict.
    fn schema<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        schema_dict(py, &self.schema)
    }

    #[getter]
    fn window(&self) -> u32 {
        self.window
    }

    /// This consumer's batch size (its own, or the stream's).
    #[getter]
    fn batch_size(&self) -> u64 {
        self.batch_size
    }

    /// This consumer's batches in a whole epoch.
    #[getter]
    fn batches_per_epoch(&self) -> u64 {
        self.batches_per_epoch
    }

    #[getter]
    fn start_epoch(&self) -> u64 {
        self.start_epoch
    }

    /// The uid the stream belongs to (the broker's, or its producer's).
    #[getter]
    fn owner_uid(&self) -> u32 {
        self.owner_uid
    }

    /// Batches received and not yet released.
    #[getter]
    fn held(&self) -> u32 {
        lock(&self.inner).held()
    }

    /// `(address, length)` of the shared arena in this process.
    #[getter]
    fn arena(&self) -> (usize, usize) {
        self.arena
    }

    /// DLPack `(device_type, device_id)` batches are delivered on:
    /// `(1, 0)` host memory, `(2, N)` GPU N.
    #[getter]
    fn device(&self) -> (i32, i32) {
        self.device
    }
}

/// One batch in shared memory (see `batchcast.Batch`).
#[pyclass(module = "batchcast._native")]
struct Batch {
    inner: Mutex<Option<Arc<batchcast::Batch>>>,
    schema: Arc<Schema>,
    device: (i32, i32),
    #[pyo3(get)]
    seq: u64,
    #[pyo3(get)]
    epoch: u64,
    #[pyo3(get)]
    index: u64,
    #[pyo3(get)]
    samples: u64,
    /// Its first sample's place in the epoch's order.
    #[pyo3(get)]
    first_sample: u64,
    /// Recomputed for this consumer alone (replay); the same bytes.
    #[pyo3(get)]
    replayed: bool,
    /// `(epoch, sample)` right after it: where to resume from a checkpoint
    /// saved after training on it.
    #[pyo3(get)]
    next_position: (u64, u64),
    /// Seconds the consumer waited for this batch to arrive.
    #[pyo3(get)]
    wait_s: f64,
    /// Seconds from the broker handing it over to this process having it.
    #[pyo3(get)]
    handoff_s: f64,
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
struct DLField {
    keep: Arc<batchcast::Batch>,
    ptr: usize,
    device: (i32, i32),
    shape: Vec<i64>,
    dtype: DType,
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

/// A registered external stream (see `batchcast.Producer`).
#[pyclass(module = "batchcast._native")]
struct Producer {
    inner: Mutex<Option<batchcast::Producer>>,
    filling: Mutex<Option<FillSlot>>,
    schema: Arc<Schema>,
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
    #[pyo3(signature = (stream, fields, batch_size, batches_per_epoch, epochs=None, slots=4, min_consumers=1, lag_limit=None, socket=None, name=None, description=String::new(), classes=Vec::new(), connect_timeout=0.0, broker_uid=None))]
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
        socket: Option<PathBuf>,
        name: Option<String>,
        description: String,
        classes: Vec<String>,
        connect_timeout: f64,
        broker_uid: Option<u32>,
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
        if !(connect_timeout.is_finite() && connect_timeout >= 0.0) {
            return Err(invalid("connect_timeout must be a number of seconds ≥ 0"));
        }
        let mut opts =
            batchcast::ProducerOptions::new(stream, fields, batch_size, batches_per_epoch);
        let r = &mut opts.request;
        r.epochs = epochs;
        r.slots = slots;
        r.min_consumers = min_consumers;
        r.lag_limit = lag_limit;
        r.description = description;
        r.classes = classes;
        opts.socket = socket;
        opts.connect_timeout = Duration::from_secs_f64(connect_timeout);
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

#[pyfunction]
fn default_socket_path() -> PathBuf {
    batchcast::default_socket_path()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Consumer>()?;
    m.add_class::<Batch>()?;
    m.add_class::<DLField>()?;
    m.add_class::<Producer>()?;
    m.add_function(wrap_pyfunction!(default_socket_path, m)?)?;
    m.add("PROTOCOL_VERSION", batchcast::proto::PROTOCOL_VERSION)?;
    // The release: the wheel's version (every crate shares the workspace's).
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
