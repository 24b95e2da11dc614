//! A mirror's copier thread, the same for every backend: it takes copy
//! requests in order, queues each on the backend's copy engine, waits for
//! the oldest and reports it to the stream. Only [`CopyEngine`]'s two
//! calls differ between CUDA and the host-memory stand-in, so the tests
//! without a GPU run this loop as a GPU host does.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Weak};

use batchcast::schema::RingLayout;

use super::{CopyRequest, CopySink, GpuError, GpuKey, Piece};

/// A device's copy engine: copies queued in order, each ending later.
pub(super) trait CopyEngine {
    /// What marks a queued copy's end (CUDA: events around it).
    type Done;
    /// Queues the copy of `pieces` (the host bytes `sink` gives for them)
    /// to device arena bytes `piece.dst`, after every copy queued before.
    /// `sink` stays alive until [`CopyEngine::wait`] has returned for it.
    fn queue(&mut self, sink: &Arc<dyn CopySink>, pieces: &[Piece])
    -> Result<Self::Done, GpuError>;
    /// Waits until a queued copy has ended; its time on the device, ns.
    fn wait(&mut self, done: Self::Done) -> Result<u64, GpuError>;
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
    rx: mpsc::Receiver<CopyRequest>,
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
            while let Some((req, done, len)) = queued.pop_front() {
                while let Ok(more) = rx.try_recv() {
                    queued.push_back(queue(&mut engine, more)?);
                }
                let ns = engine.wait(done)?;
                while let Ok(more) = rx.try_recv() {
                    queued.push_back(queue(&mut engine, more)?);
                }
                // Copy time is device time around each copy: `bytes /
                // copy_s` is the copy path's bandwidth.
                sink.copied(&key, req, len, ns);
            }
            Ok::<(), GpuError>(())
        })();
        if let Err(e) = result {
            sink.gpu_failed(&key, e);
            return;
        }
    }
}

/// Queues request `req`'s unit: its end marker and its bytes.
fn queue<E: CopyEngine>(
    engine: &mut E,
    sink: &Arc<dyn CopySink>,
    rings: &RingLayout,
    req: CopyRequest,
) -> Result<(CopyRequest, E::Done, u64), GpuError> {
    let pieces = sink.host_pieces(req.seq, rings);
    let done = engine.queue(sink, &pieces)?;
    Ok((req, done, pieces.iter().map(|p| p.len as u64).sum()))
}
