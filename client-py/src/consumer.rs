//! `Consumer`: a subscription to one stream, its waits done without the
//! GIL in steps that check for Ctrl-C.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use batchcast::{Event, JoinPolicy, Schema};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{invalid, parse_error, to_py};
use crate::{TICK, args, dlpack, lock, schema_dict};

use crate::batch::Batch;

impl Consumer {
    /// The Python side of a subscription just made.
    fn connected(consumer: batchcast::Consumer) -> Consumer {
        Consumer {
            schema: Arc::new(consumer.schema().clone()),
            window: consumer.welcome().window,
            batch_size: consumer.batch_size(),
            batches_per_epoch: consumer.batches_per_epoch(),
            start_epoch: consumer.welcome().start_epoch,
            owner_uid: consumer.welcome().owner_uid,
            device: dl_device(consumer.device()),
            inner: Mutex::new(consumer),
        }
    }
}

/// A subscription to one stream (see `batchcast.Consumer`).
#[pyclass(module = "batchcast._native")]
pub(crate) struct Consumer {
    pub(crate) inner: Mutex<batchcast::Consumer>,
    pub(crate) schema: Arc<Schema>,
    pub(crate) window: u32,
    /// This consumer's batch size, and its batches in a whole epoch.
    pub(crate) batch_size: u64,
    pub(crate) batches_per_epoch: u64,
    pub(crate) start_epoch: u64,
    pub(crate) owner_uid: u32,
    /// DLPack `(device_type, device_id)` of delivered batches.
    pub(crate) device: (i32, i32),
}

#[pymethods]
impl Consumer {
    /// Its arguments are `batchcast::options::CONSUMER_OPTIONS`' native
    /// rows, in order (`client-py/tests/test_options.py` checks): `None`
    /// is the Rust client's default, read from the environment where the
    /// table says.
    #[new]
    #[pyo3(signature = (stream=None, socket=None, window=None, join=None, name=None, connect_timeout=None, device=None, broker_uid=None, batch_size=None, drop_last=None, resume=None, state=None, reconnect_timeout=None, group=None, rank=None, world=None, replicate=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        stream: Option<String>,
        socket: Option<PathBuf>,
        window: Option<Bound<'_, PyAny>>,
        join: Option<&str>,
        name: Option<String>,
        connect_timeout: Option<f64>,
        device: Option<&str>,
        broker_uid: Option<u32>,
        batch_size: Option<Bound<'_, PyAny>>,
        drop_last: Option<bool>,
        resume: Option<Bound<'_, PyAny>>,
        state: Option<Bound<'_, PyAny>>,
        reconnect_timeout: Option<f64>,
        group: Option<String>,
        rank: Option<Bound<'_, PyAny>>,
        world: Option<Bound<'_, PyAny>>,
        replicate: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Consumer> {
        if state.is_some() && resume.is_some() {
            return Err(invalid(
                "give state= or resume=, not both (a state carries its position)",
            ));
        }
        let mut opts = batchcast::ConsumerOptions {
            socket,
            broker_uid,
            ..Default::default()
        };
        if let Some(s) = stream {
            opts.stream = s;
        }
        if let Some(d) = device {
            opts.device = d.parse().map_err(parse_error)?;
        }
        if let Some(j) = join {
            opts.join = j.parse::<JoinPolicy>().map_err(parse_error)?;
        }
        if let Some(t) = connect_timeout {
            opts.connect_timeout = args::seconds("connect_timeout", t)?;
        }
        if let Some(w) = &window {
            opts.window = u32::try_from(args::size("window", w)?).unwrap_or(u32::MAX);
        }
        if let Some(n) = name {
            opts.name = n;
        }
        if let Some(n) = batch_size {
            opts.batch_size = Some(args::size("batch_size", &n)?);
        }
        opts.drop_last = drop_last;
        opts.resume = resume.as_ref().map(args::position).transpose()?;
        if let Some(state) = &state {
            opts.state = Some(state_from_dict(&args::state(state)?)?);
        }
        if let Some(t) = reconnect_timeout {
            opts.reconnect_timeout = args::seconds("reconnect_timeout", t)?;
        }
        let (rank, world, replicate) = args::seat_numbers(rank, world, replicate)?;
        // Without group=, the default's: $BATCHCAST_GROUP's seat, if set.
        if let Some(name) = group {
            opts.group = Some(seat(name, (rank, world), replicate)?);
        }
        // Connecting may wait for the broker; Ctrl-C cannot interrupt that
        // wait, so it is bounded by connect_timeout.
        let consumer = py
            .detach(|| batchcast::Consumer::connect(opts))
            .map_err(|e| to_py(py, e))?;
        Ok(Consumer::connected(consumer))
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

    /// This consumer's state for a checkpoint, as a dict (see
    /// `batchcast.Consumer.state_dict`).
    fn state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = lock(&self.inner).state();
        let d = PyDict::new(py);
        d.set_item("version", STATE_VERSION)?;
        d.set_item("stream", s.stream)?;
        d.set_item("digest", s.digest.to_string())?;
        d.set_item("epoch", s.position.epoch)?;
        d.set_item("sample", s.position.sample)?;
        d.set_item("batch_size", s.batch_size)?;
        d.set_item("drop_last", s.drop_last)?;
        if let Some(g) = s.group {
            // A member's group and where it goes on: any rank's state
            // re-forms the group (another world, the same global batch).
            d.set_item("group", g.name)?;
            d.set_item("world", g.world)?;
            d.set_item("replicate", g.replicate)?;
            d.set_item("round_epoch", g.round.epoch)?;
            d.set_item("round_sample", g.round.sample)?;
        }
        if let Some(r) = s.rotation {
            // Its epoch is read rotated: a resume goes on in that order.
            d.set_item("rotated_at", r.at)?;
        }
        Ok(d)
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

    /// Times it subscribed again after its broker went away.
    #[getter]
    fn reconnects(&self) -> u64 {
        lock(&self.inner).reconnects()
    }

    /// `(address, length)` of the shared arena in this process: where
    /// the host batches handed out from now on lie.
    #[getter]
    fn arena(&self) -> (usize, usize) {
        let (base, len) = lock(&self.inner).arena();
        (base as usize, len)
    }

    /// DLPack `(device_type, device_id)` batches are delivered on:
    /// `(1, 0)` host memory, `(2, N)` GPU N.
    #[getter]
    fn device(&self) -> (i32, i32) {
        self.device
    }
}

/// The version of the dict `state()` gives (a later format says so).
const STATE_VERSION: u32 = 1;

/// A state dict (from `state()`, through a checkpoint) as the Rust
/// client's `ConsumerState`; a missing or mistyped key is named.
fn state_from_dict(d: &Bound<'_, PyDict>) -> PyResult<batchcast::ConsumerState> {
    fn get<'py, T: FromPyObjectOwned<'py>>(
        d: &Bound<'py, PyDict>,
        key: &str,
        what: &str,
    ) -> PyResult<T> {
        let bad = || {
            invalid(format!(
                "state: `{key}` must be {what}; pass the dict consumer.state_dict() returned"
            ))
        };
        let v = d.get_item(key)?.ok_or_else(bad)?;
        v.extract::<T>().map_err(|_| bad())
    }
    let version: u32 = get(d, "version", "1")?;
    if version != STATE_VERSION {
        return Err(invalid(format!(
            "state: version {version} is not one this client reads ({STATE_VERSION}); it was saved by another release of batchcast"
        )));
    }
    let digest: String = get(d, "digest", "a stream digest string")?;
    Ok(batchcast::ConsumerState {
        stream: get(d, "stream", "a stream name")?,
        digest: digest
            .parse()
            .map_err(|e: batchcast::proto::BadDigest| invalid(format!("state: {e}")))?,
        position: batchcast::proto::Position {
            epoch: get(d, "epoch", "an integer ≥ 0")?,
            sample: get(d, "sample", "an integer ≥ 0")?,
        },
        batch_size: get(d, "batch_size", "an integer ≥ 1")?,
        drop_last: get(d, "drop_last", "True or False")?,
        group: match d.get_item("group")? {
            None => None,
            Some(_) => Some(batchcast::GroupPlace {
                name: get(d, "group", "a group name")?,
                world: get(d, "world", "an integer ≥ 1")?,
                replicate: get(d, "replicate", "an integer ≥ 1")?,
                round: batchcast::proto::Position {
                    epoch: get(d, "round_epoch", "an integer ≥ 0")?,
                    sample: get(d, "round_sample", "an integer ≥ 0")?,
                },
            }),
        },
        rotation: match d.get_item("rotated_at")? {
            None => None,
            Some(_) => Some(batchcast::rotation::Rotation {
                epoch: get(d, "epoch", "an integer ≥ 0")?,
                at: get(d, "rotated_at", "an integer ≥ 1")?,
            }),
        },
    })
}

/// The seat `group=`, `rank=`, `world=` and `replicate=` ask for; rank and
/// world from the launcher's environment when neither is given.
fn seat(
    name: String,
    (rank, world): (Option<u32>, Option<u32>),
    replicate: u32,
) -> PyResult<batchcast::proto::Seat> {
    match (rank, world) {
        (Some(rank), Some(world)) => Ok(batchcast::proto::Seat {
            name,
            rank,
            world,
            replicate,
        }),
        (None, None) => Ok(batchcast::proto::Seat {
            replicate,
            ..batchcast::group_from_env(&name).map_err(|e| invalid(e.to_string()))?
        }),
        _ => Err(invalid(batchcast::proto::SeatError::HalfGiven.to_string())),
    }
}

/// The DLPack device of a consumer's batches. Under the GPU stand-in's
/// setting (tests only) every `cuda:N` is host memory: its tensors are
/// CPU tensors.
fn dl_device(device: batchcast::Device) -> (i32, i32) {
    match device {
        batchcast::Device::Cuda(_) if batchcast::stand_in::setting().ok().flatten().is_some() => {
            (dlpack::DEVICE_CPU, 0)
        }
        batchcast::Device::Cpu => (dlpack::DEVICE_CPU, 0),
        batchcast::Device::Cuda(n) => (dlpack::DEVICE_CUDA, n as i32),
    }
}
