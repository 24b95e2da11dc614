//! The host-memory stand-in for a GPU ([`batchcast::stand_in`]): device
//! memory that is host memory (a sealed memfd the consumers map
//! read-only), written by a copy engine of its own thread.
//!
//! It runs the same copier loop as CUDA (`gpu/copier.rs`) over that
//! engine, as a GPU's copy engine is: a copy is queued, read from the host
//! arena and written later, and its end is seen by waiting for it; and it
//! can fail mid-run (`fail_at`), as a device does (a
//! `CUDA_ERROR_ILLEGAL_ADDRESS` poisons every later call). So every device
//! behaviour of the stream runs, in unit tests and in the real broker
//! under the test setting, on machines without a GPU.

use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use batchcast::proto::{DeviceArena, DeviceMemory, DeviceRequest};
use batchcast::schema::RingLayout;
use batchcast::shm::{Arena, Fault};

use super::copier::{self, Copy, CopyEngine};
use super::{Device, GpuError, Mirror, MirrorSpec, Piece, ReplayTarget, TargetMemory};

/// What a consumer on stand-in GPU `ordinal` asks for.
pub fn request(ordinal: u32) -> DeviceRequest {
    DeviceRequest {
        uuid: batchcast::stand_in::uuid(ordinal),
        ordinal,
        name: batchcast::stand_in::NAME.into(),
    }
}

/// The stand-in's device memory: a sealed memfd the consumer maps.
impl TargetMemory for Arena {
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        Some(Arena::fd(self))
    }

    #[cfg(test)]
    fn read_back(&self, offset: usize, out: &mut [u8]) -> Result<(), GpuError> {
        let bytes = self
            .mapping()
            .get(offset as u64, out.len() as u64)
            .ok_or_else(|| {
                GpuError::Driver(format!("a read past the device memory at {offset}"))
            })?;
        out.copy_from_slice(bytes);
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Stand-in GPU `ordinal`'s arena for a stream: `slots × slot_bytes` of a
/// memfd, written by its copy engine. `fail_at`: the copy number (from 0)
/// at which the device fails instead.
pub(super) fn create(
    spec: MirrorSpec<'_>,
    ordinal: u32,
    fail_at: Option<u64>,
) -> Result<Mirror, GpuError> {
    start(spec, ordinal, fail_at).map(|(m, _)| m)
}

/// [`create`], and the mirror's copy engine (the tests hold it).
fn start(
    spec: MirrorSpec<'_>,
    ordinal: u32,
    fail_at: Option<u64>,
) -> Result<(Mirror, Arc<Engine>), GpuError> {
    let MirrorSpec {
        key,
        sink,
        slots,
        schema,
        stream,
        ..
    } = spec;
    let label = format!("cuda:{ordinal} {}", batchcast::stand_in::NAME);
    let open = |e: batchcast::Error| GpuError::Open {
        ordinal,
        name: batchcast::stand_in::NAME.into(),
        reason: e.to_string(),
    };
    // Mirrored where the host arena's rings would be: consumers map it as
    // they map the host arena, and take runs of any batch size from it.
    let rings = RingLayout::for_schema(schema, slots).map_err(|e| open(e.into()))?;
    let memory = Arena::create(
        &format!("{stream}-gpu{ordinal}"),
        rings.arena_bytes,
        Fault::Now,
    )
    .map_err(open)?;
    // Consumers map it read-only: only this engine writes device memory.
    memory.seal_writes().map_err(open)?;
    let memory = Arc::new(memory);
    let arena = DeviceArena {
        memory: DeviceMemory::StandIn,
        handle: Vec::new(),
        slots,
        rings: rings.clone(),
        gpu: label.clone(),
    };
    let engine = Arc::new(Engine::default());
    let (tx, jobs) = mpsc::channel::<Job>();
    {
        let (engine, memory) = (engine.clone(), memory.clone());
        std::thread::Builder::new()
            .name(format!("{stream}-gpu{ordinal}-engine"))
            .spawn(move || engine.run(jobs, &memory, fail_at))
            .map_err(|e| GpuError::Copier(e.to_string()))?;
    }
    let copies = Copies {
        engine: engine.clone(),
        jobs: tx,
    };
    let mut m = Mirror::start(
        label,
        arena,
        false,
        Arc::new(StandIn {
            engine: engine.clone(),
            memory: memory.clone(),
        }),
        move |rx| copier::run((key, rings), rx, sink, copies),
        format!("{stream}-copy-gpu{ordinal}"),
    )?;
    m.stand_in = Some(memory);
    Ok((m, engine))
}

/// A stand-in GPU: its copy engine and the device arena it writes.
#[derive(Debug)]
struct StandIn {
    engine: Arc<Engine>,
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "read back by the conformance suite")
    )]
    memory: Arc<Arena>,
}

impl Device for StandIn {
    fn fence(&self) -> Result<(), GpuError> {
        self.engine.synchronize()
    }

    #[cfg(test)]
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), GpuError> {
        self.memory.read_back(offset, out)
    }

    /// A sealed memfd of the host arena's rings.
    fn replay_target(
        &self,
        label: &str,
        schema: &batchcast::Schema,
        slots: u32,
        name: &str,
    ) -> Result<ReplayTarget, String> {
        let rings = RingLayout::for_schema(schema, slots).map_err(|e| e.to_string())?;
        let memory = Arena::create(
            &format!("{name}-replay-gpu"),
            rings.arena_bytes,
            Fault::Lazily,
        )
        .map_err(|e| e.to_string())?;
        memory.seal_writes().map_err(|e| e.to_string())?;
        Ok(ReplayTarget {
            arena: DeviceArena {
                memory: DeviceMemory::StandIn,
                handle: Vec::new(),
                slots,
                rings,
                gpu: label.into(),
            },
            memory: Box::new(memory),
        })
    }
}

/// A copy queued on the engine: copy number `n`, its host bytes, pieces
/// and destination (the shared arena, or a consumer's replay arena).
struct Job {
    n: u64,
    src: Arc<dyn super::CopySource>,
    pieces: Vec<Piece>,
    target: Option<Arc<ReplayTarget>>,
}

/// The copy engine's progress, shared by its thread, the copier (which
/// waits for copies) and the mirror (which fences).
#[derive(Debug, Default)]
pub struct Engine {
    state: Mutex<EngineState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct EngineState {
    queued: u64,
    /// Copies ended: every copy numbered below this.
    done: u64,
    /// Each ended copy's time, until it is waited for.
    took_ns: HashMap<u64, u64>,
    /// Why the device failed: every call from then on fails with it.
    failed: Option<GpuError>,
    /// Tests: the engine starts no copy while set (a busy device).
    held: bool,
}

impl Engine {
    fn lock(&self) -> MutexGuard<'_, EngineState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The engine's thread: copies jobs in order until the copier is gone.
    fn run(&self, jobs: mpsc::Receiver<Job>, memory: &Arena, fail_at: Option<u64>) {
        while let Ok(job) = jobs.recv() {
            {
                let mut st = self.lock();
                while st.held {
                    st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            }
            if fail_at == Some(job.n) {
                let mut st = self.lock();
                st.failed = Some(GpuError::Driver(
                    "CUDA_ERROR_ILLEGAL_ADDRESS (stand-in)".into(),
                ));
                self.changed.notify_all();
                return;
            }
            let t0 = Instant::now();
            let dst = match job.target.as_deref() {
                Some(t) => t
                    .memory::<Arena>()
                    .expect("a stand-in's replay target is its own memory"),
                None => memory,
            };
            let copied = job
                .pieces
                .iter()
                .try_for_each(|p| write(dst, p, job.src.bytes(p)));
            let n = job.n;
            // The stream is let go before the copy is seen to end, so this
            // thread never holds its last reference.
            drop(job);
            let mut st = self.lock();
            match copied {
                Ok(()) => {
                    st.done = n + 1;
                    st.took_ns.insert(n, t0.elapsed().as_nanos() as u64);
                }
                Err(p) => {
                    st.failed = Some(GpuError::Driver(format!(
                        "CUDA_ERROR_INVALID_VALUE (stand-in): a piece outside host or device memory: {p:?}"
                    )));
                }
            }
            self.changed.notify_all();
            if st.failed.is_some() {
                return;
            }
        }
    }

    /// Waits until copy `n` has ended (or the device failed).
    fn wait_for(&self, n: u64) -> Result<u64, GpuError> {
        let mut st = self.lock();
        loop {
            if st.done > n {
                return Ok(st.took_ns.remove(&n).unwrap_or(0));
            }
            if let Some(why) = &st.failed {
                return Err(why.clone());
            }
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Holds the engine (no copy starts) or lets it go on.
    #[cfg(test)]
    fn hold(&self, on: bool) {
        self.lock().held = on;
        self.changed.notify_all();
    }

    #[cfg(test)]
    fn queued(&self) -> u64 {
        self.lock().queued
    }

    /// Waits until every queued copy has ended (or the device failed).
    pub(super) fn synchronize(&self) -> Result<(), GpuError> {
        let queued = self.lock().queued;
        match queued.checked_sub(1) {
            Some(last) => self.wait_for(last).map(|_| ()),
            None => Ok(()),
        }
    }
}

/// Writes a piece's host bytes (`None`: outside the host arena) to device
/// memory at `piece.dst`, checked against the arena's end.
fn write(memory: &Arena, p: &Piece, src: Option<&[u8]>) -> Result<(), Piece> {
    let src = src.ok_or(*p)?;
    let at = p.dst;
    let map = memory.mapping();
    if src.len() != p.len || at.checked_add(p.len).is_none_or(|end| end > map.len()) {
        return Err(*p);
    }
    // SAFETY: in bounds (checked above). The cells a copy writes are the
    // stream's to fill: a unit's device slot is held by no consumer until
    // the copy is reported (the hub), a replayed batch's cells are sent to
    // no one until then and were released before its making began (the
    // replay book); and this engine makes one copy at a time, so nothing
    // else reads or writes these bytes meanwhile (consumers map the memfd
    // read-only).
    unsafe { map.slice_mut(at as u64, p.len as u64) }.copy_from_slice(src);
    Ok(())
}

/// The copier's side of the engine: numbers and sends its copies.
struct Copies {
    engine: Arc<Engine>,
    jobs: mpsc::Sender<Job>,
}

impl CopyEngine for Copies {
    type Done = u64;

    fn queue(&mut self, copy: &Copy) -> Result<u64, GpuError> {
        let n = {
            let mut st = self.engine.lock();
            if let Some(why) = &st.failed {
                return Err(why.clone());
            }
            st.queued += 1;
            st.queued - 1
        };
        let job = Job {
            n,
            src: copy.src.clone(),
            pieces: copy.pieces.clone(),
            target: copy.target.clone(),
        };
        self.jobs
            .send(job)
            .map_err(|_| GpuError::Driver("the stand-in's copy engine stopped".into()))?;
        Ok(n)
    }

    fn wait(&mut self, n: u64) -> Result<u64, GpuError> {
        self.engine.wait_for(n)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Weak;

    use super::*;
    use crate::gpu::conformance::until;
    use crate::gpu::{CopyRequest, CopySink, GpuKey};

    /// A stream of one field of 8 bytes a sample, units of one sample:
    /// unit `seq` is 8 bytes of `seq % 3 + 1` in a host ring of 3, in two
    /// pieces for every third unit; the device ring holds it at cell `seq`.
    struct Sink {
        host: Vec<u8>,
        copied: Mutex<Vec<(u64, u32, u64)>>,
        failed: Mutex<Vec<String>>,
        /// The engine, and the copies queued on it at each report.
        engine: std::sync::OnceLock<Arc<Engine>>,
        queued_at_report: Mutex<Vec<u64>>,
    }

    impl crate::gpu::CopySource for Sink {
        fn bytes(&self, p: &Piece) -> Option<&[u8]> {
            self.host.get(p.at..p.at + p.len)
        }
    }

    impl CopySink for Sink {
        fn replay_copied(&self, _: &GpuKey, _: u64, _: u64, _: u64, _: u64) {}
        fn host_pieces(&self, seq: u64, device: &RingLayout) -> Vec<Piece> {
            let at = (seq % 3) as usize * 8;
            let r = &device.fields[0];
            let dst = (r.offset + (seq % r.cells) * 8) as usize;
            if seq % 3 == 2 {
                vec![
                    Piece { at, len: 4, dst },
                    Piece {
                        at: at + 4,
                        len: 4,
                        dst: dst + 4,
                    },
                ]
            } else {
                vec![Piece { at, len: 8, dst }]
            }
        }
        fn copied(&self, _: &GpuKey, req: CopyRequest, bytes: u64, _: u64) {
            self.copied
                .lock()
                .unwrap()
                .push((req.seq, req.device, bytes));
            if let Some(e) = self.engine.get() {
                self.queued_at_report.lock().unwrap().push(e.queued());
            }
        }
        fn gpu_failed(&self, _: &GpuKey, why: GpuError) {
            self.failed.lock().unwrap().push(why.to_string());
        }
    }

    fn mirror(fail_at: Option<u64>) -> (Arc<Sink>, Mirror) {
        let host: Vec<u8> = (0..3u8).flat_map(|k| [k + 1; 8]).collect();
        let sink = Arc::new(Sink {
            host,
            copied: Mutex::default(),
            failed: Mutex::default(),
            engine: std::sync::OnceLock::new(),
            queued_at_report: Mutex::default(),
        });
        let weak: Weak<dyn CopySink> = Arc::downgrade(&(sink.clone() as Arc<dyn CopySink>));
        let schema = batchcast::Schema {
            fields: vec![batchcast::Field {
                name: "x".into(),
                dtype: batchcast::DType::U8,
                shape: vec![8],
                aux: false,
            }],
            batch_size: 1,
            samples_per_epoch: 12,
            batches_per_epoch: 12,
            epochs: Some(1),
            source: batchcast::schema::SourceInfo::External(
                batchcast::schema::ExternalSourceInfo {
                    producer: "test".into(),
                    pid: 0,
                    description: String::new(),
                    classes: Vec::new(),
                },
            ),
        };
        let spec = MirrorSpec {
            key: crate::gpu::GpuKey {
                uuid: [0; 16],
                uid: 0,
            },
            sink: weak,
            host: sink.host.as_ptr(),
            host_len: sink.host.len(),
            slots: 4,
            schema: &schema,
            stream: "s",
        };
        let (m, engine) = start(spec, 0, fail_at).unwrap();
        sink.engine.set(engine).ok();
        (sink, m)
    }

    /// Copies run on the engine's thread and are reported in the order
    /// they were asked for, each with its bytes, at its device slot.
    #[test]
    fn copies_land_in_their_device_slots_and_are_reported_in_order() {
        let (sink, m) = mirror(None);
        for seq in 0..12u64 {
            m.request(CopyRequest {
                host: 0,
                device: (seq % 4) as u32,
                seq,
            });
        }
        until(|| sink.copied.lock().unwrap().len() == 12);
        m.fence();
        let copied = sink.copied.lock().unwrap().clone();
        let want: Vec<_> = (0..12u64).map(|s| (s, (s % 4) as u32, 8)).collect();
        assert_eq!(copied, want);
        // Each unit at the cell of its stream position.
        let mem = m.stand_in_bytes().unwrap();
        for seq in 0..12usize {
            let at = seq * 8;
            assert_eq!(mem[at..at + 8], [(seq % 3) as u8 + 1; 8], "unit {seq}");
        }
        assert!(sink.failed.lock().unwrap().is_empty());
    }

    /// What the copier is for: requests that arrive while a copy runs are
    /// queued on the engine before that copy is reported (reporting sends
    /// the batch to every consumer on the GPU), so the engine is never
    /// idle for as long as a report takes.
    #[test]
    fn requests_arriving_during_a_copy_are_queued_before_it_is_reported() {
        let (sink, m) = mirror(None);
        let engine = sink.engine.get().unwrap().clone();
        engine.hold(true);
        m.request(CopyRequest {
            host: 0,
            device: 0,
            seq: 0,
        });
        until(|| engine.queued() == 1);
        for seq in 1..6u64 {
            m.request(CopyRequest {
                host: 0,
                device: (seq % 4) as u32,
                seq,
            });
        }
        engine.hold(false);
        until(|| sink.copied.lock().unwrap().len() == 6);
        let at_report = sink.queued_at_report.lock().unwrap().clone();
        assert_eq!(at_report, [6; 6], "copies queued at each report");
    }

    /// A device that fails mid-run: the stream is told once, and nothing
    /// after is copied or reported. Copies that ended before it are
    /// reported unless the copier learns of the failure first (queueing a
    /// later request fails as a sticky CUDA error does): the failure ends
    /// every consumer of the GPU either way.
    #[test]
    fn a_device_failing_mid_run_is_reported_once_and_copies_stop() {
        let (sink, m) = mirror(Some(2));
        for seq in 0..6u64 {
            m.request(CopyRequest {
                host: 0,
                device: (seq % 4) as u32,
                seq,
            });
        }
        until(|| !sink.failed.lock().unwrap().is_empty());
        m.stop();
        assert_eq!(
            *sink.failed.lock().unwrap(),
            ["CUDA_ERROR_ILLEGAL_ADDRESS (stand-in)"]
        );
        let copied: Vec<u64> = sink.copied.lock().unwrap().iter().map(|c| c.0).collect();
        assert!(
            [0, 1].starts_with(&copied),
            "in order, none past the failure: {copied:?}"
        );
        assert_eq!(
            m.stand_in_bytes().unwrap()[16..24],
            [0; 8],
            "copy 2 never ran"
        );
    }
}
