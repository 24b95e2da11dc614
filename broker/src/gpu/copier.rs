//! A mirror's copier thread, the same for every backend: it takes copy
//! requests in order, queues each on the backend's copy engine, waits for
//! the oldest and reports it to the stream. Only [`CopyEngine`]'s two
//! calls differ between CUDA and the host-memory stand-in, so the tests
//! without a GPU run this loop as a GPU host does.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Weak};

use batchcast::schema::RingLayout;

use super::{CopyRequest, CopySink, CopySource, GpuError, GpuKey, Piece, ReplayTarget, Request};

/// One copy for an engine: `pieces` of `src`'s host bytes to the GPU's
/// shared arena, or to a consumer's replay arena (`target`). The copier
/// keeps it until the copy has ended, so what it names stays mapped.
pub(super) struct Copy {
    pub src: Arc<dyn CopySource>,
    pub pieces: Vec<Piece>,
    pub target: Option<Arc<ReplayTarget>>,
}

/// A device's copy engine: copies queued in order, each ending later.
pub(super) trait CopyEngine {
    /// What marks a queued copy's end (CUDA: events around it).
    type Done;
    /// Queues `copy` (each piece's `src` bytes to byte `piece.dst` of its
    /// destination), after every copy queued before. `copy` stays alive
    /// until [`CopyEngine::wait`] has returned for it.
    fn queue(&mut self, copy: &Copy) -> Result<Self::Done, GpuError>;
    /// Waits until a queued copy has ended; its time on the device, ns.
    fn wait(&mut self, done: Self::Done) -> Result<u64, GpuError>;
}

/// What a copy's end is reported as.
enum Report {
    Unit(CopyRequest),
    Replay { consumer: u64, seq: u64 },
}

/// Runs copies for GPU `key`, whose arena is laid out as `rings`, until
/// the requests' sender is dropped (the mirror stopped), the stream is
/// gone, or the device fails (then the stream is told, and its consumers
/// on that GPU are ended).
///
/// It keeps the copy engine fed: every request waiting is queued before
/// the oldest copy is waited for, and again before that copy is reported,
/// so reporting it (sending the batch to each consumer on the GPU)
/// overlaps with the next copies instead of leaving the engine idle for
/// as long as the report takes.
pub(super) fn run<E: CopyEngine>(
    (key, rings): (GpuKey, RingLayout),
    rx: mpsc::Receiver<Request>,
    sink: Weak<dyn CopySink>,
    mut engine: E,
) {
    let mut queued = VecDeque::new();
    while let Ok(first) = rx.recv() {
        // Held until every copy queued below has ended: the host bytes
        // they read stay mapped.
        let Some(sink) = sink.upgrade() else { return };
        let result = (|| {
            let queue = |engine: &mut E, req| queue(engine, &sink, &rings, req);
            queued.push_back(queue(&mut engine, first)?);
            while let Some((report, done, copy)) = queued.pop_front() {
                while let Ok(more) = rx.try_recv() {
                    queued.push_back(queue(&mut engine, more)?);
                }
                let ns = engine.wait(done)?;
                let bytes = copy.pieces.iter().map(|p| p.len as u64).sum();
                drop(copy);
                while let Ok(more) = rx.try_recv() {
                    queued.push_back(queue(&mut engine, more)?);
                }
                // Copy time is device time around each copy: `bytes /
                // copy_s` is the copy path's bandwidth.
                match report {
                    Report::Unit(req) => sink.copied(&key, req, bytes, ns),
                    Report::Replay { consumer, seq } => {
                        sink.replay_copied(&key, consumer, seq, bytes, ns)
                    }
                }
            }
            Ok::<(), GpuError>(())
        })();
        if let Err(e) = result {
            sink.gpu_failed(&key, e);
            return;
        }
    }
}

/// Queues request `req`: a unit of the stream (its pieces from the host
/// arena to the shared arena's rings), or a replayed batch.
fn queue<E: CopyEngine>(
    engine: &mut E,
    sink: &Arc<dyn CopySink>,
    rings: &RingLayout,
    req: Request,
) -> Result<(Report, E::Done, Copy), GpuError> {
    let (report, copy) = match req {
        Request::Unit(req) => (
            Report::Unit(req),
            Copy {
                src: sink.clone(),
                pieces: sink.host_pieces(req.seq, rings),
                target: None,
            },
        ),
        Request::Replay(r) => (
            Report::Replay {
                consumer: r.consumer,
                seq: r.seq,
            },
            Copy {
                src: r.src,
                pieces: r.pieces,
                target: Some(r.target),
            },
        ),
    };
    let done = engine.queue(&copy)?;
    Ok((report, done, copy))
}
