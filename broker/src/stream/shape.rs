//! A consumer's own batch size: whether the stream can serve it, and what
//! its window costs the hub in production units.

use batchcast::proto::ConsumeRequest;

use super::error::SubscribeError;
use crate::plan::StreamPlan;

/// What a consumer's batches cost the hub: its batch size and the units it
/// may hold for its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub batch_size: u64,
    /// Whether it drops an epoch's short last batch: its own choice, else
    /// the stream's `drop_last`.
    pub drop_last: bool,
    /// The stream's production unit (samples of a full batch).
    pub unit: u64,
    /// The hub's window for it, in production units.
    pub units: u32,
    /// Samples in an epoch of the stream.
    pub per_epoch: u64,
}

/// A device consumer's batch size against its GPU's arena: another size
/// than the stream's needs the arena's rings mirrored, as the host's
/// (the stand-in's are where the host's are; memory shared over CUDA IPC
/// is mapped once).
///
/// A group member's runs lie a batch of each data rank apart: the span of
/// units it may hold must fit the GPU's ring as it must the host's.
pub(super) fn check_device(
    shape: Shape,
    req: &ConsumeRequest,
    arena: &batchcast::proto::DeviceArena,
) -> Result<(), SubscribeError> {
    if let Some(f) = arena.rings.unmirrored()
        && shape.batch_size != shape.unit
    {
        return Err(SubscribeError::BatchSize(format!(
            "batch_size {}: {} serves the stream's batch size ({}) only: its arena's ring of field #{f} is not mirrored \
             (GPU memory shared over CUDA IPC is mapped once; mirrored device rings need CUDA's virtual memory management, \
             not in this build); leave batch_size unset, or use device=\"cpu\"",
            shape.batch_size, arena.gpu, shape.unit
        )));
    }
    if let Some(seat) = req.group.as_deref() {
        let data_ranks = u64::from(seat.world / seat.replicate.max(1));
        let span = batchcast::batcher::member_ring_span(
            req.window,
            shape.batch_size,
            shape.unit,
            data_ranks,
        );
        let need = span.max(u64::from(shape.units));
        if need > u64::from(arena.slots) {
            return Err(SubscribeError::BatchSize(format!(
                "a group member of {data_ranks} data ranks with window {} and batches of {} may span {need} units of the stream, \
                 more than the {} slots of its arena on {}: size the stream for it (gpu_slots = {need}), or use a smaller window",
                req.window, shape.batch_size, arena.slots, arena.gpu
            )));
        }
    }
    Ok(())
}

impl Shape {
    /// Its window as the hub counts it: `units` of the stream, holding
    /// the consumer's own `window` batches.
    pub fn window(&self, req: &ConsumeRequest) -> crate::hub::Window {
        crate::hub::Window {
            units: self.units,
            batches: req.window.min(self.units),
        }
    }

    /// A group member's share of each epoch, as its client deals it.
    pub fn deal(&self, req: &batchcast::proto::ConsumeRequest) -> Option<batchcast::deal::Deal> {
        let seat = req.group.as_deref()?;
        Some(batchcast::deal::Deal::new(
            self.per_epoch,
            self.batch_size,
            (seat.rank, seat.world, seat.replicate),
            self.drop_last,
        ))
    }
}

impl Shape {
    /// A consumer's batch size and what its window costs in units, on
    /// stream `plan`; the refusal says what to ask for instead.
    pub(super) fn for_request(
        plan: &StreamPlan,
        req: &ConsumeRequest,
    ) -> Result<Shape, SubscribeError> {
        let unit = plan.schema.batch_size;
        let size = req.batch_size.unwrap_or(unit);
        let refuse = |why: String| Err(SubscribeError::BatchSize(why));
        if size == 0 {
            return refuse("batch_size must be at least 1".into());
        }
        if size != unit
            && let Some(f) = plan.rings.unmirrored()
        {
            let field = &plan.schema.fields[f];
            return refuse(format!(
                "batch_size {size}: stream `{}` serves only its own batch size ({unit}): field `{}` \
                 ({} bytes a sample) would need a ring many times its size to be mirrored; leave batch_size unset",
                plan.name, field.name, plan.rings.fields[f].bytes_per_sample
            ));
        }
        let units = if req.group.is_some() {
            batchcast::batcher::member_units_needed(req.window, size, unit)
        } else {
            batchcast::batcher::units_needed(req.window, size, unit)
        };
        let slots = u64::from(plan.slots);
        if let Some(seat) = req.group.as_deref() {
            let data_ranks = u64::from(seat.world / seat.replicate.max(1));
            let span = batchcast::batcher::member_ring_span(req.window, size, unit, data_ranks);
            let need = units.max(span);
            if need > slots {
                return refuse(format!(
                    "a group member of {data_ranks} data ranks with window {} and batches of {size} may span {need} of stream `{}`'s {slots} slots of {unit} samples (its runs lie {data_ranks} batches apart, one more being built); size the stream for it: slots = {need}, or batch_size = {} in its config (a unit holds one batch of each data rank; members still ask for {size}), or use a smaller window",
                    req.window,
                    plan.name,
                    data_ranks.saturating_mul(size),
                ));
            }
        }
        // With the stream's own size the hub checks the window.
        if units > slots && size != unit {
            // The largest batch this window allows.
            // (window + 1) × (⌈(b − 1) / unit⌉ + 1) ≤ slots, or b = unit.
            let per_run = slots / (u64::from(req.window) + 1);
            let other = per_run.checked_sub(1).map(|k| k * unit + 1);
            let own = u64::from(req.window) <= slots;
            return refuse(format!(
                "batch_size {size} with window {}: needs {units} of stream `{}`'s {slots} slots of {unit} samples \
                 (batches of {size} span up to that many while the window is full); {}, or size the stream for it: max_batch_size = {size} in its config (`batchcast launch` sets it from the sweep's batch sizes), or slots = {units}",
                req.window,
                plan.name,
                match (other, own) {
                    (Some(b), _) if b >= unit =>
                        format!("ask for batch_size ≤ {b} or a smaller window"),
                    (Some(b), true) => format!(
                        "ask for batch_size ≤ {b} or the stream's {unit}, or a smaller window"
                    ),
                    (None, true) =>
                        format!("ask for the stream's batch_size {unit}, or a smaller window"),
                    (_, false) => "ask for a smaller window".into(),
                }
            ));
        }
        Ok(Shape {
            batch_size: size,
            drop_last: req.drop_last.unwrap_or(plan.drop_last),
            unit,
            units: u32::try_from(units).unwrap_or(u32::MAX),
            per_epoch: plan.schema.samples_per_epoch,
        })
    }
}
