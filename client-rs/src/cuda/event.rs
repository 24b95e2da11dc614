//! CUDA events: recorded on a stream, queried or waited on, timed.

use std::sync::Arc;

use cudarc::driver::sys;

use super::{CudaError, Gpu, result};

/// A CUDA event without timing (cheap to record and query).
#[derive(Debug)]
pub struct Event {
    pub(super) gpu: Arc<Gpu>,
    pub(super) ev: sys::CUevent,
}

// SAFETY: events may be recorded and queried from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(gpu: &Arc<Gpu>) -> Result<Event, CudaError> {
        Event::with_flags(gpu, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    pub(super) fn with_flags(
        gpu: &Arc<Gpu>,
        flags: sys::CUevent_flags,
    ) -> Result<Event, CudaError> {
        gpu.bind()?;
        let ev = result::event_create(flags)?;
        Ok(Event {
            gpu: gpu.clone(),
            ev,
        })
    }

    /// GPU time from `start` to this event, both timing events recorded and
    /// completed.
    pub fn elapsed_since(&self, start: &Event) -> Result<std::time::Duration, CudaError> {
        self.gpu.bind()?;
        // SAFETY: both events are live timing events of this context.
        let ms = unsafe { result::event_elapsed_ms(start.ev, self.ev) }?;
        Ok(std::time::Duration::from_secs_f64(
            f64::from(ms.max(0.0)) * 1e-3,
        ))
    }

    /// Records the event on a stream given as a raw handle, as DLPack
    /// consumers pass it (`1` legacy default, `2` per-thread default, else a
    /// `CUstream` of this GPU).
    pub fn record_on(&self, stream: u64) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: the event is live; the stream handle is either one of the
        // driver's special values or a stream the caller owns on this GPU.
        unsafe { result::event_record(self.ev, stream) }
    }

    /// Whether the work before the record has completed.
    pub fn done(&self) -> Result<bool, CudaError> {
        self.gpu.bind()?;
        // SAFETY: the event is live.
        unsafe { result::event_query(self.ev) }
    }

    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: the event is live.
        unsafe { result::event_synchronize(self.ev) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: created in `new`, destroyed once.
            let _ = unsafe { result::event_destroy(self.ev) };
        }
    }
}
