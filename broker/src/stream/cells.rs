//! A batch's cells as mutable bytes, for the one pipeline thread that
//! fills it: the stream's only `unsafe`. Each view is handed out against
//! the claim that makes it exclusive (a hub [`Work`], a [`ReplayJob`]),
//! borrowed for as long as the views live.

use batchcast::schema::RingLayout;
use batchcast::shm::Mapping;

use super::replay::book::ReplayJob;
use crate::hub::Work;

/// One view per field of the shared stream's batch `work`, of `samples`
/// cells (its last batch of an epoch may be short).
#[allow(clippy::mut_from_ref)] // the claim, not the borrow, makes them exclusive
pub(super) fn of_work<'a>(
    rings: &'a Mapping,
    plan: &RingLayout,
    work: &'a Work,
    samples: u64,
) -> Vec<&'a mut [u8]> {
    (0..plan.fields.len())
        .map(|f| {
            let (start, len) = plan
                .span(f, work.seq * plan.unit, samples)
                .expect("a batch's cells are contiguous in every ring");
            // SAFETY: the hub handed batch `seq` (slot `seq mod slots`) to
            // this thread in its `Filling` state (`work` is that claim): no
            // consumer holds it and no other thread was given it, and the
            // ring keeps every live batch's cells apart (at most `slots`
            // batches live, each `batch_size` cells of rings of at least
            // `slots × batch_size`). Each field's span lies in its own
            // ring's part of the mapping, so these views are disjoint, and
            // the only references to these bytes until the batch is
            // published.
            unsafe { rings.slice_mut(start, len) }
        })
        .collect()
}

/// Copies the cells of the batches `units` (seq, samples) from region
/// `from` of the host arena to region `to`, field by field.
pub(super) fn copy_units(
    rings: &[Mapping],
    plan: &RingLayout,
    (from, to): (u32, u32),
    units: &[(u64, u64)],
) {
    let (src, dst) = (&rings[from as usize], &rings[to as usize]);
    for &(seq, samples) in units {
        for f in 0..plan.fields.len() {
            let (start, len) = plan
                .span(f, seq * plan.unit, samples)
                .expect("a batch's cells are contiguous in every ring");
            let bytes = src
                .get(start, len)
                .expect("a batch's cells lie in its region");
            // SAFETY: nobody reads or writes batch `seq`'s cells in region
            // `to` (`regions`' rules): either `to` holds nothing anyone
            // reads and no pipeline thread writes there (the region the
            // ring moves to), or the batch is still being filled by the
            // thread calling this, which alone claims its cells in every
            // region (a batch filled where the ring was). `src` and `dst`
            // are different regions of the arena, so the spans are apart.
            unsafe { dst.slice_mut(start, len) }.copy_from_slice(bytes);
        }
    }
}

/// One view per field of the replayed batch `job`.
#[allow(clippy::mut_from_ref)] // the claim, not the borrow, makes them exclusive
pub(super) fn of_replay(job: &ReplayJob) -> Vec<&mut [u8]> {
    job.spans
        .iter()
        .map(|&(start, len)| {
            // SAFETY: replayed batch `seq` of this consumer was handed to
            // this thread alone (`replay::take_job`; `job` is that claim),
            // and its slot of the replay ring is free: the batch `slots`
            // before it was released, and batches after it are not started
            // until this one is released in turn. Each field's span lies in
            // its own ring's part of the mapping, so these views are
            // disjoint, and the only references to these bytes until it is
            // sent.
            unsafe { job.rings.slice_mut(start, len) }
        })
        .collect()
}
