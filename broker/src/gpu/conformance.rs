//! One conformance suite for every GPU backend: the same checks, through
//! [`Mirror`] and the backend's [`Device`](super::Device), on the
//! host-memory stand-in (every run) and on CUDA (`gpu_*`, ignored without
//! a GPU; `bench/gpu.sh` runs them where one is lent). What is checked is
//! what the stream relies on whatever the backend: a unit's copy lands at
//! the device cells of its stream position and is reported once, in the
//! order asked, with its bytes; a replayed batch lands in its consumer's
//! own arena and nowhere else, reported as that consumer's; the copies
//! queued before a stop are all made and reported.
//!
//! Fault injection (a device failing mid-run) and the copier's queueing
//! are the stand-in's own tests (`stand_in.rs`): a real GPU cannot be
//! made to fail on cue.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use batchcast::schema::{ExternalSourceInfo, RingLayout, SourceInfo};
use batchcast::shm::{Arena, Fault, Mapping};
use batchcast::{DType, Field, Schema};

use super::{CopyRequest, CopySink, CopySource, GpuError, GpuKey, Mirror, MirrorSpec, Piece};
use super::{ReplayCopy, stand_in};

/// A backend under test: how a mirror is started on it.
type Start = fn(MirrorSpec<'_>) -> Result<Mirror, GpuError>;

/// Bytes of a sample of the suite's one field.
const SAMPLE: usize = 8;
/// Units in the host ring (each of one sample).
const HOST_UNITS: usize = 3;

/// A stream of one field of 8 bytes a sample, units of one sample: unit
/// `seq` is 8 bytes of `seq % 3 + 1` in a host ring of 3 (two pieces for
/// every third unit); the device ring holds it at its cell.
struct Sink {
    host: Vec<u8>,
    copied: Mutex<Vec<(u64, u32, u64)>>,
    replayed: Mutex<Vec<(u64, u64, u64)>>,
    failed: Mutex<Vec<String>>,
}

impl CopySource for Sink {
    fn bytes(&self, p: &Piece) -> Option<&[u8]> {
        self.host.get(p.at..p.at + p.len)
    }
}

impl CopySink for Sink {
    fn host_pieces(&self, seq: u64, device: &RingLayout) -> Vec<Piece> {
        let at = (seq as usize % HOST_UNITS) * SAMPLE;
        let r = &device.fields[0];
        let dst = (r.offset + (seq % r.cells) * SAMPLE as u64) as usize;
        match seq % 3 {
            2 => vec![
                Piece { at, len: 4, dst },
                Piece {
                    at: at + 4,
                    len: 4,
                    dst: dst + 4,
                },
            ],
            _ => vec![Piece {
                at,
                len: SAMPLE,
                dst,
            }],
        }
    }
    fn copied(&self, _: &GpuKey, req: CopyRequest, bytes: u64, _: u64) {
        let mut c = self.copied.lock().unwrap();
        c.push((req.seq, req.device, bytes));
    }
    fn replay_copied(&self, _: &GpuKey, consumer: u64, seq: u64, bytes: u64, _: u64) {
        let mut r = self.replayed.lock().unwrap();
        r.push((consumer, seq, bytes));
    }
    fn gpu_failed(&self, _: &GpuKey, why: GpuError) {
        self.failed.lock().unwrap().push(why.to_string());
    }
}

fn schema(batch_size: u64) -> Schema {
    Schema {
        fields: vec![Field {
            name: "x".into(),
            dtype: DType::U8,
            shape: vec![SAMPLE as u64],
            aux: false,
        }],
        batch_size,
        samples_per_epoch: 12,
        batches_per_epoch: 12 / batch_size,
        epochs: Some(1),
        source: SourceInfo::External(ExternalSourceInfo {
            producer: "conformance".into(),
            pid: 0,
            description: String::new(),
            classes: Vec::new(),
        }),
    }
}

/// A mirror of 4 device slots on the backend, and what it reports.
fn mirror(start: Start) -> (Arc<Sink>, Mirror) {
    let sink = Arc::new(Sink {
        host: (0..HOST_UNITS as u8)
            .flat_map(|k| [k + 1; SAMPLE])
            .collect(),
        copied: Mutex::default(),
        replayed: Mutex::default(),
        failed: Mutex::default(),
    });
    let weak: Weak<dyn CopySink> = Arc::downgrade(&(sink.clone() as Arc<dyn CopySink>));
    let spec = MirrorSpec {
        key: crate::gpu::GpuKey {
            uuid: [0; 16],
            uid: 0,
        },
        sink: weak,
        host: sink.host.as_ptr(),
        host_len: sink.host.len(),
        slots: 4,
        schema: &schema(1),
        stream: "conformance",
    };
    let m = start(spec).expect("the backend starts a mirror");
    (sink, m)
}

/// Waits for `what`, failing the test after 10 s.
pub(super) fn until(what: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !what() {
        assert!(t0.elapsed() < Duration::from_secs(10), "timed out");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Units `0..12` through 4 device slots, one at a time (a slot is
/// written again only after its last copy was reported, as the hub
/// does): each lands at its cell, reported in order with its bytes.
fn copies_land_at_their_cells_reported_in_order(start: Start) {
    let (sink, m) = mirror(start);
    let rings = m.arena().rings;
    for seq in 0..12u64 {
        m.request(CopyRequest {
            host: (seq % HOST_UNITS as u64) as u32,
            device: (seq % 4) as u32,
            seq,
        });
        until(|| sink.copied.lock().unwrap().len() as u64 == seq + 1);
        let cell =
            (rings.fields[0].offset + (seq % rings.fields[0].cells) * SAMPLE as u64) as usize;
        let mut got = [0u8; SAMPLE];
        m.read_device(cell, &mut got).unwrap();
        assert_eq!(got, [(seq % 3) as u8 + 1; SAMPLE], "unit {seq} at its cell");
    }
    m.fence();
    let want: Vec<_> = (0..12u64)
        .map(|s| (s, (s % 4) as u32, SAMPLE as u64))
        .collect();
    assert_eq!(*sink.copied.lock().unwrap(), want);
    assert!(sink.failed.lock().unwrap().is_empty());
}

/// Copies queued before a stop are all made and reported, in order.
fn a_stop_comes_after_the_queued_copies(start: Start) {
    let (sink, m) = mirror(start);
    for seq in 0..4u64 {
        m.request(CopyRequest {
            host: 0,
            device: seq as u32,
            seq,
        });
    }
    m.stop();
    let seqs: Vec<u64> = sink.copied.lock().unwrap().iter().map(|c| c.0).collect();
    assert_eq!(seqs, [0, 1, 2, 3]);
}

/// A replayed batch of 2 samples goes to its consumer's own arena (its
/// batch size, not the stream's), reported as that consumer's; the
/// stream's device arena is not touched.
fn a_replayed_batch_lands_in_its_consumers_arena_only(start: Start) {
    let (sink, m) = mirror(start);
    let target = m.replay_target(&schema(2), 3, "conformance").unwrap();
    assert_eq!(target.rings().fields[0].cells % 2, 0, "whole batches of 2");
    // The replay arena: 2 samples of the consumer's batch, made apart.
    let src_bytes: Vec<u8> = (0..2 * SAMPLE as u8).map(|b| 0xA0 + b).collect();
    let arena = Arena::create("conformance-replay", 4096, Fault::Now).unwrap();
    let file = File::from(arena.fd().try_clone_to_owned().unwrap());
    file.write_all_at(&src_bytes, 0).unwrap();
    let src = Arc::new(Mapping::map_readonly(arena.fd(), 4096).unwrap());
    let cells = &target.rings().fields[0];
    // Batch 1 of the consumer's replay: its second slot.
    let dst = (cells.offset + 2 * SAMPLE as u64) as usize;
    m.request_replay(ReplayCopy {
        consumer: 7,
        seq: 1,
        src,
        pieces: vec![Piece {
            at: 0,
            len: 2 * SAMPLE,
            dst,
        }],
        target: target.clone(),
    });
    until(|| !sink.replayed.lock().unwrap().is_empty());
    assert_eq!(*sink.replayed.lock().unwrap(), [(7, 1, 2 * SAMPLE as u64)]);
    let mut got = vec![0u8; 2 * SAMPLE];
    target.read(dst, &mut got).unwrap();
    assert_eq!(got, src_bytes, "the batch in the consumer's arena");
    let mut shared = vec![0xFFu8; 4 * SAMPLE];
    m.read_device(m.arena().rings.fields[0].offset as usize, &mut shared)
        .unwrap();
    assert_eq!(
        shared,
        vec![0u8; 4 * SAMPLE],
        "the stream's arena untouched"
    );
    assert!(sink.copied.lock().unwrap().is_empty());
}

/// Instantiates the suite for a backend.
macro_rules! conformance {
    ($backend:ident, $start:expr $(, #[$attr:meta])?) => {
        mod $backend {
            #[test]
            $(#[$attr])?
            fn copies_land_at_their_cells_reported_in_order() {
                super::copies_land_at_their_cells_reported_in_order($start);
            }

            #[test]
            $(#[$attr])?
            fn a_stop_comes_after_the_queued_copies() {
                super::a_stop_comes_after_the_queued_copies($start);
            }

            #[test]
            $(#[$attr])?
            fn a_replayed_batch_lands_in_its_consumers_arena_only() {
                super::a_replayed_batch_lands_in_its_consumers_arena_only($start);
            }
        }
    };
}

fn stand_in_start(spec: MirrorSpec<'_>) -> Result<Mirror, GpuError> {
    stand_in::create(spec, 0, None)
}

conformance!(stand_in_backend, super::stand_in_start);

/// The first GPU the driver lists.
#[cfg(feature = "cuda")]
fn cuda_start(spec: MirrorSpec<'_>) -> Result<Mirror, GpuError> {
    let gpu = batchcast::cuda::gpus()
        .map_err(|e| GpuError::Driver(e.to_string()))?
        .into_iter()
        .next()
        .ok_or_else(|| GpuError::Driver("no GPU".into()))?;
    let req = batchcast::proto::DeviceRequest {
        uuid: gpu.uuid,
        ordinal: gpu.ordinal,
        name: gpu.name,
    };
    super::cuda::create(&req, spec, &std::sync::OnceLock::new())
        .map_err(|e| GpuError::Driver(e.to_string()))
}

#[cfg(feature = "cuda")]
conformance!(gpu_cuda_backend, super::cuda_start, #[ignore = "needs a GPU (bench/gpu.sh runs it)"]);
