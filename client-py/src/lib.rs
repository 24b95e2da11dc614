//! `batchcast._native`: the Python binding of the Rust client library.
//!
//! This module is thin on purpose: the protocol, the mapping and the
//! release bookkeeping all live in `client-rs`; here they are wrapped for
//! Python, with every blocking wait done without the GIL and in short steps
//! that check for Ctrl-C. The Python package `batchcast` builds the public
//! API (iteration, tensors, exceptions) on top.
//!
//! Here: the module's registration and what the classes share; the classes
//! in `consumer.rs`, `batch.rs` (`Batch`, `DLField`) and `producer.rs`;
//! errors to exceptions in `errors.rs`, the checks on arguments in
//! `args.rs`, DLPack's C structs in `dlpack.rs`.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use batchcast::Schema;
use batchcast::schema::SourceInfo;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

mod args;
mod batch;
mod consumer;
mod dlpack;
mod errors;
mod producer;

/// How long one wait without the GIL lasts before checking for signals.
const TICK: Duration = Duration::from_millis(50);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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

use batch::{Batch, DLField};
use consumer::Consumer;
use producer::Producer;

#[pyfunction]
fn default_socket_path() -> PathBuf {
    batchcast::default_socket_path()
}

/// `batchcast::options::CONSUMER_OPTIONS` as a list of dicts, for the
/// Python package's checks of its own signatures against it.
fn consumer_options(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyList>> {
    let rows = pyo3::types::PyList::empty(py);
    for o in batchcast::options::CONSUMER_OPTIONS {
        let d = pyo3::types::PyDict::new(py);
        d.set_item("name", o.name)?;
        d.set_item("flag", o.cli_flag())?;
        d.set_item("py_type", o.py_type)?;
        d.set_item("native_type", o.native_type.unwrap_or(o.py_type))?;
        d.set_item("py_default", o.py_default)?;
        d.set_item("native_default", o.native_default.unwrap_or(o.py_default))?;
        d.set_item("env", o.env)?;
        d.set_item("refused", o.refused)?;
        d.set_item("rust", o.on.rust)?;
        d.set_item("native", o.on.native)?;
        d.set_item("python", o.on.python)?;
        d.set_item("cli", o.on.cli)?;
        rows.append(d)?;
    }
    Ok(rows)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Consumer>()?;
    m.add_class::<Batch>()?;
    m.add_class::<DLField>()?;
    m.add_class::<Producer>()?;
    m.add_function(wrap_pyfunction!(default_socket_path, m)?)?;
    m.add("PROTOCOL_VERSION", batchcast::proto::PROTOCOL_VERSION)?;
    m.add("CONSUMER_OPTIONS", consumer_options(m.py())?)?;
    // The release: the wheel's version (every crate shares the workspace's).
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
