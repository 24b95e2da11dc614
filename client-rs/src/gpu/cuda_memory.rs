//! A device arena in GPU memory: opened from its CUDA IPC handle once per
//! (handle, GPU) per process, and the events a release waits for.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::cuda::{self, Event, Gpu, IpcMapping};
use crate::error::Result;
use crate::proto::DeviceArena;

type Key = (Vec<u8>, u32);

/// The arena on this process's GPU `ordinal`. Several consumers of one
/// stream in one process share its mapping.
pub(super) fn open(ordinal: u32, arena: &DeviceArena) -> Result<Arc<IpcMapping>> {
    static OPEN: OnceLock<Mutex<HashMap<Key, Weak<IpcMapping>>>> = OnceLock::new();
    let gpu = Gpu::open(ordinal)?;
    let mut open = OPEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    open.retain(|_, m| m.strong_count() > 0);
    let key = (arena.handle.clone(), gpu.info.ordinal);
    if let Some(m) = open.get(&key).and_then(Weak::upgrade) {
        return Ok(m);
    }
    let m = Arc::new(IpcMapping::open(
        &gpu,
        &arena.handle,
        arena.rings.arena_bytes as usize,
    )?);
    open.insert(key, Arc::downgrade(&m));
    Ok(m)
}

/// An event recorded on each stream a batch was handed to (the legacy
/// default stream if none was named).
pub(super) fn fences(m: &IpcMapping, streams: Option<Vec<u64>>) -> Result<Vec<Event>> {
    let gpu = m.gpu();
    Ok(streams
        .unwrap_or_else(|| vec![cuda::LEGACY_STREAM])
        .into_iter()
        .map(|s| {
            let ev = Event::new(gpu)?;
            ev.record_on(s)?;
            Ok(ev)
        })
        .collect::<Result<Vec<_>, cuda::CudaError>>()?)
}
