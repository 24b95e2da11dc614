//! What a stream carries: fields, their element types and per-sample shapes,
//! and where each field lives inside a slot of the shared arena.
//!
//! The broker computes a [`SlotLayout`] once per stream with
//! [`SlotLayout::for_schema`] and sends it in the welcome message; clients
//! validate it against the mapping before handing out any view, so a bad
//! layout can never produce an out-of-bounds slice.

use serde::{Deserialize, Serialize};

pub use crate::dtype::DType;
use crate::error::{Result, WireError};

/// Alignment of every field inside a slot. 256 bytes satisfies SIMD loads,
/// cache lines and the CUDA allocation granularity for copies.
pub const FIELD_ALIGN: u64 = 256;
/// Alignment of every slot inside the arena: a page, so slots can be
/// registered, advised or protected independently.
pub const SLOT_ALIGN: u64 = 4096;

/// One named tensor of every sample, e.g. `image: u8 [3, 224, 224]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Field {
    pub name: String,
    pub dtype: DType,
    /// Shape of one sample's tensor; the batch dimension is not included.
    pub shape: Vec<u64>,
    /// Metadata a trainer rarely wants (an image stream's dataset `index`):
    /// clients leave it out when a batch is unpacked by position, and still
    /// give it by name.
    #[serde(default)]
    pub aux: bool,
}

impl Field {
    /// Bytes of one sample's tensor, or `None` on overflow.
    pub fn bytes_per_sample(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(self.dtype.size(), |acc, &d| acc.checked_mul(d))
    }
}

/// Everything a consumer needs to interpret a stream's batches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schema {
    pub fields: Vec<Field>,
    /// Samples in a full batch; the last batch of an epoch may hold fewer
    /// when `drop_last` is false.
    pub batch_size: u64,
    /// Samples in one epoch.
    pub samples_per_epoch: u64,
    /// Batches in one epoch.
    pub batches_per_epoch: u64,
    /// Number of epochs, or `None` for an endless stream.
    pub epochs: Option<u64>,
    /// Where the samples come from; lets a consumer verify synthetic data.
    pub source: SourceInfo,
}

impl Schema {
    pub fn field(&self, name: &str) -> Option<(usize, &Field)> {
        self.fields.iter().enumerate().find(|(_, f)| f.name == name)
    }

    /// Samples in batch `index` of an epoch (`index <
    /// batches_per_epoch`): the batch size, fewer for a short last batch.
    pub fn batch_samples(&self, index: u64) -> u64 {
        self.batch_size.min(
            self.samples_per_epoch
                .saturating_sub(index * self.batch_size),
        )
    }

    /// Bytes of a batch of `samples`, every field's cells together.
    pub fn batch_bytes(&self, samples: u64) -> u64 {
        self.fields
            .iter()
            .map(|f| f.bytes_per_sample().unwrap_or(0) * samples)
            .sum()
    }
}

/// Description of the stream's data source, as far as a consumer may care.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SourceInfo {
    /// Deterministic generated data (see [`crate::synthetic`]).
    Synthetic(crate::synthetic::SyntheticSpec),
    /// Decoded, transformed images from a dataset on the broker's host.
    Images(ImageSourceInfo),
    /// Batches written by an external producer process (e.g. a Python
    /// `batchcast.Producer` sharing a PyTorch DataLoader).
    External(ExternalSourceInfo),
}

impl SourceInfo {
    /// Class names in label order, where the source knows them.
    pub fn classes(&self) -> &[String] {
        match self {
            SourceInfo::Synthetic(_) => &[],
            SourceInfo::Images(i) => &i.classes,
            SourceInfo::External(e) => &e.classes,
        }
    }
}

/// Who fills an external stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExternalSourceInfo {
    /// The producer's name and pid, as it introduced itself.
    pub producer: String,
    pub pid: u32,
    /// What the producer says it runs (e.g. `DataLoader(ImageFolder)`).
    pub description: String,
    /// Class names in label order, if the producer knows them.
    pub classes: Vec<String>,
}

/// What a consumer may want to know about an image dataset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageSourceInfo {
    /// `image_folder` or `webdataset`.
    pub format: String,
    /// The dataset's root folder or shard pattern, as configured.
    pub root: String,
    /// Class names in label order (ImageFolder: the sorted folder names);
    /// empty when labels come from `.cls` files.
    pub classes: Vec<String>,
    /// Samples in the whole dataset, before splitting across hosts.
    pub dataset_len: u64,
    /// This broker's share: `rank` of `world_size` (DistributedSampler's split).
    pub rank: u64,
    pub world_size: u64,
}

/// Where one field lives inside a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldLayout {
    /// Byte offset of sample 0 of this field from the start of the slot.
    pub offset: u64,
    /// Bytes of one sample of this field (samples are contiguous).
    pub bytes_per_sample: u64,
}

/// Where every field of a batch lives inside one slot of the arena.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotLayout {
    /// One entry per schema field, in schema order.
    pub fields: Vec<FieldLayout>,
    /// Size of one slot, a multiple of [`SLOT_ALIGN`].
    pub slot_bytes: u64,
}

impl SlotLayout {
    /// Lays out the fields of a full batch of `schema`: each field's samples
    /// contiguous (`[B, ...shape]`), each field aligned to [`FIELD_ALIGN`],
    /// the slot rounded up to [`SLOT_ALIGN`].
    pub fn for_schema(schema: &Schema) -> Result<SlotLayout> {
        let overflow = || WireError::Schema("slot size overflows u64".into());
        let mut offset = 0u64;
        let mut fields = Vec::with_capacity(schema.fields.len());
        for field in &schema.fields {
            let bytes_per_sample = field.bytes_per_sample().ok_or_else(overflow)?;
            let bytes = bytes_per_sample
                .checked_mul(schema.batch_size)
                .ok_or_else(overflow)?;
            fields.push(FieldLayout {
                offset,
                bytes_per_sample,
            });
            offset = align_up(offset.checked_add(bytes).ok_or_else(overflow)?, FIELD_ALIGN)
                .ok_or_else(overflow)?;
        }
        let slot_bytes = align_up(offset.max(1), SLOT_ALIGN).ok_or_else(overflow)?;
        Ok(SlotLayout { fields, slot_bytes })
    }

    /// Checks that the layout describes `schema` and fits in `slot_bytes`, so
    /// that views built from it stay inside their slot.
    pub fn validate(&self, schema: &Schema) -> Result<()> {
        if self.fields.len() != schema.fields.len() {
            return Err(WireError::Schema(format!(
                "layout has {} fields but the schema has {}",
                self.fields.len(),
                schema.fields.len()
            )));
        }
        for (layout, field) in self.fields.iter().zip(&schema.fields) {
            let expect = field.bytes_per_sample();
            let end = layout
                .bytes_per_sample
                .checked_mul(schema.batch_size)
                .and_then(|b| b.checked_add(layout.offset));
            let aligned = layout.offset % field.dtype.size() == 0;
            match (expect, end) {
                (Some(bps), Some(end))
                    if bps == layout.bytes_per_sample && end <= self.slot_bytes && aligned => {}
                _ => {
                    return Err(WireError::Schema(format!(
                        "field `{}` does not fit its slot (offset {}, {} bytes per sample, slot {} bytes)",
                        field.name, layout.offset, layout.bytes_per_sample, self.slot_bytes
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Where one field's samples live in a host arena. The arena is
/// field-major: each field is a ring of `cells` sample cells of
/// `bytes_per_sample` bytes, and sample `p` of the stream (counted from
/// the stream's start: production unit `seq` begins at `seq × unit`) lies
/// in cell `p mod cells`.
///
/// A `mirrored` ring is mapped twice, back to back
/// (`batchcast::shm::Mapping::rings`), so any run of up to `cells`
/// consecutive samples is one contiguous slice, across the wrap: that is
/// what lets each consumer take batches of its own size without a copy.
/// Mirroring needs the ring to be whole pages; a field whose stride would
/// make that cost too much is not mirrored, has exactly one cell per sample
/// of the slots (`slots × unit`, so units never straddle its wrap), and its
/// stream serves only batches of the production unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldRing {
    /// Byte offset of the ring in the arena's memfd (page-aligned).
    pub offset: u64,
    pub bytes_per_sample: u64,
    pub cells: u64,
    /// Bytes the ring occupies in the memfd (whole pages; exactly
    /// `cells × bytes_per_sample` when mirrored).
    pub ring_bytes: u64,
    pub mirrored: bool,
}

impl FieldRing {
    /// Bytes of address space the ring takes when mapped: twice its bytes
    /// when mirrored.
    pub fn mapped_bytes(&self) -> u64 {
        if self.mirrored {
            2 * self.ring_bytes
        } else {
            self.ring_bytes
        }
    }
}

/// The host arena's field-major layout: a ring per field (see
/// [`FieldRing`]), sized so that the `slots` production units the hub may
/// keep live (`slots × unit` samples) never share a cell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingLayout {
    /// One entry per schema field, in schema order.
    pub fields: Vec<FieldRing>,
    /// Samples in a production unit (the stream's `batch_size`).
    pub unit: u64,
    /// Production units the hub keeps live at most.
    pub slots: u32,
    /// Size of the arena's memfd.
    pub arena_bytes: u64,
}

/// A mirrored ring may cost this many bytes over the live samples'...
const MIRROR_SLACK_BYTES: u64 = 1 << 20;
/// ...or this fraction of them (1/4), whichever is more.
const MIRROR_SLACK_DIV: u64 = 4;

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl RingLayout {
    /// Lays out the rings of `schema`'s fields for `slots` production units.
    /// A field of stride `d` is mirrored when a whole-page ring of at least
    /// `slots × unit` cells (a multiple of `4096 / gcd(4096, d)` cells)
    /// costs at most the larger of 1 MiB and a quarter of the live bytes
    /// more than `slots × unit` cells would.
    pub fn for_schema(schema: &Schema, slots: u32) -> Result<RingLayout> {
        RingLayout::lay_out(schema, slots, true)
    }

    /// [`RingLayout::for_schema`] with no ring mirrored: each field's ring
    /// holds exactly `slots` whole units, for memory that cannot be mapped
    /// twice (a GPU arena shared over CUDA IPC).
    pub fn unmirrored_for_schema(schema: &Schema, slots: u32) -> Result<RingLayout> {
        RingLayout::lay_out(schema, slots, false)
    }

    fn lay_out(schema: &Schema, slots: u32, mirror: bool) -> Result<RingLayout> {
        let overflow = || WireError::Schema("arena size overflows u64".into());
        let live = schema
            .batch_size
            .checked_mul(u64::from(slots))
            .filter(|&l| l > 0)
            .ok_or_else(|| WireError::Schema("a stream needs a batch size and slots".into()))?;
        let mut offset = 0u64;
        let mut fields = Vec::with_capacity(schema.fields.len());
        for field in &schema.fields {
            let bps = field.bytes_per_sample().ok_or_else(overflow)?.max(1);
            let step = SLOT_ALIGN / gcd(SLOT_ALIGN, bps);
            let cells = live.div_ceil(step).checked_mul(step).ok_or_else(overflow)?;
            let live_bytes = live.checked_mul(bps).ok_or_else(overflow)?;
            let ring = cells.checked_mul(bps).ok_or_else(overflow)?;
            let slack = MIRROR_SLACK_BYTES.max(live_bytes / MIRROR_SLACK_DIV);
            let ring = if mirror && ring - live_bytes <= slack {
                FieldRing {
                    offset,
                    bytes_per_sample: bps,
                    cells,
                    ring_bytes: ring,
                    mirrored: true,
                }
            } else {
                FieldRing {
                    offset,
                    bytes_per_sample: bps,
                    cells: live,
                    ring_bytes: align_up(live_bytes, SLOT_ALIGN).ok_or_else(overflow)?,
                    mirrored: false,
                }
            };
            offset = offset.checked_add(ring.ring_bytes).ok_or_else(overflow)?;
            fields.push(ring);
        }
        Ok(RingLayout {
            fields,
            unit: schema.batch_size,
            slots,
            arena_bytes: offset.max(SLOT_ALIGN),
        })
    }

    /// Bytes of one region of the host arena: the arena's fd holds the
    /// rings once per region, region `r` at `r × region_bytes` (a batch a
    /// stopped consumer held past the hold limit is left in its region
    /// while the ring goes on in another). Whole pages.
    pub fn region_bytes(&self) -> u64 {
        self.arena_bytes
    }

    /// Checks that the layout describes `schema` and stays inside its
    /// arena, so that views built from it stay inside their rings.
    pub fn validate(&self, schema: &Schema) -> Result<()> {
        let bad = |what: String| Err(WireError::Schema(format!("arena layout: {what}")));
        if self.fields.len() != schema.fields.len() {
            return bad(format!(
                "{} rings for {} fields",
                self.fields.len(),
                schema.fields.len()
            ));
        }
        if self.unit != schema.batch_size || self.slots == 0 {
            return bad(format!(
                "unit {} for batch size {}",
                self.unit, schema.batch_size
            ));
        }
        let live = self.unit.checked_mul(u64::from(self.slots));
        let mut end = 0u64;
        for (r, field) in self.fields.iter().zip(&schema.fields) {
            let fits = field.bytes_per_sample().map(|b| b.max(1)) == Some(r.bytes_per_sample)
                && r.offset >= end
                && r.offset.is_multiple_of(SLOT_ALIGN)
                && r.ring_bytes.is_multiple_of(SLOT_ALIGN)
                && r.cells.checked_mul(r.bytes_per_sample).is_some_and(|b| {
                    if r.mirrored {
                        b == r.ring_bytes
                    } else {
                        b <= r.ring_bytes
                    }
                })
                && live.is_some_and(|l| {
                    if r.mirrored {
                        r.cells >= l
                    } else {
                        r.cells == l
                    }
                });
            end = r.offset.saturating_add(r.ring_bytes);
            if !fits || end > self.arena_bytes {
                return bad(format!(
                    "field `{}` does not fit its ring: {r:?}",
                    field.name
                ));
            }
        }
        Ok(())
    }

    /// Address-space offset of field `f`'s ring in a mapping of every ring
    /// in order (`batchcast::shm::Mapping::rings`).
    pub fn mapped_offset(&self, f: usize) -> u64 {
        self.fields[..f].iter().map(FieldRing::mapped_bytes).sum()
    }

    /// Address space a mapping of every ring takes.
    pub fn mapped_bytes(&self) -> u64 {
        self.fields.iter().map(FieldRing::mapped_bytes).sum()
    }

    /// Where each field of production unit `seq` (a whole unit's cells)
    /// lies in a mapping of every ring: one contiguous span per field.
    pub fn unit_spans(&self, seq: u64) -> Vec<(u64, u64)> {
        (0..self.fields.len())
            .map(|f| {
                self.span(f, seq * self.unit, self.unit)
                    .expect("a unit's cells are contiguous: rings hold whole units or are mirrored")
            })
            .collect()
    }

    /// `None` when a consumer may take batches of any size; otherwise the
    /// first field whose ring is not mirrored.
    pub fn unmirrored(&self) -> Option<usize> {
        self.fields.iter().position(|r| !r.mirrored)
    }

    /// Where in field `f`'s mapped ring (see [`RingLayout::mapped_offset`])
    /// `samples` samples starting at stream position `position` lie: one
    /// contiguous range. `None` if they cannot be one (more than the ring,
    /// or across the wrap of a ring that is not mirrored).
    pub fn span(&self, f: usize, position: u64, samples: u64) -> Option<(u64, u64)> {
        let r = self.fields.get(f)?;
        let cell = position % r.cells;
        let end_cell = cell.checked_add(samples)?;
        let limit = if r.mirrored { 2 * r.cells } else { r.cells };
        if samples > r.cells || end_cell > limit {
            return None;
        }
        Some((
            self.mapped_offset(f) + cell * r.bytes_per_sample,
            samples * r.bytes_per_sample,
        ))
    }
}

/// Rounds `v` up to a multiple of `align` (a power of two), `None` on overflow.
pub fn align_up(v: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    Some(v.checked_add(align - 1)? & !(align - 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{Fill, SyntheticSpec};

    fn schema(fields: Vec<Field>, batch: u64) -> Schema {
        Schema {
            fields,
            batch_size: batch,
            samples_per_epoch: 100,
            batches_per_epoch: 100u64.div_ceil(batch),
            epochs: Some(1),
            source: SourceInfo::Synthetic(SyntheticSpec {
                seed: 0,
                len: 100,
                shuffle: false,
                fill: Fill::Full,
            }),
        }
    }

    #[test]
    fn image_label_layout_is_aligned_and_contiguous() {
        let s = schema(
            vec![
                Field {
                    name: "image".into(),
                    dtype: DType::U8,
                    shape: vec![3, 224, 224],
                    aux: false,
                },
                Field {
                    name: "label".into(),
                    dtype: DType::I64,
                    shape: vec![],
                    aux: false,
                },
            ],
            64,
        );
        let l = SlotLayout::for_schema(&s).unwrap();
        assert_eq!(
            l.fields[0],
            FieldLayout {
                offset: 0,
                bytes_per_sample: 3 * 224 * 224
            }
        );
        assert_eq!(
            l.fields[1].offset,
            align_up(64 * 3 * 224 * 224, FIELD_ALIGN).unwrap()
        );
        assert_eq!(l.fields[1].bytes_per_sample, 8);
        assert_eq!(l.slot_bytes % SLOT_ALIGN, 0);
        assert!(l.slot_bytes >= l.fields[1].offset + 64 * 8);
        l.validate(&s).unwrap();
    }

    #[test]
    fn overflowing_shapes_are_an_error_not_a_panic() {
        let s = schema(
            vec![Field {
                name: "huge".into(),
                dtype: DType::F64,
                shape: vec![u64::MAX / 2, 4],
                aux: false,
            }],
            8,
        );
        assert!(SlotLayout::for_schema(&s).is_err());
    }

    #[test]
    fn a_layout_pointing_past_its_slot_is_rejected() {
        let s = schema(
            vec![Field {
                name: "x".into(),
                dtype: DType::F32,
                shape: vec![10],
                aux: false,
            }],
            4,
        );
        let mut l = SlotLayout::for_schema(&s).unwrap();
        l.fields[0].offset = l.slot_bytes - 8;
        assert!(l.validate(&s).is_err());
        let mut l = SlotLayout::for_schema(&s).unwrap();
        l.fields[0].offset = 2; // misaligned for f32
        assert!(l.validate(&s).is_err());
    }

    fn field(name: &str, dtype: DType, shape: &[u64]) -> Field {
        Field {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            aux: false,
        }
    }

    #[test]
    fn rings_are_whole_pages_hold_the_live_samples_and_mirror_unless_too_costly() {
        let s = schema(
            vec![
                field("image", DType::U8, &[3, 224, 224]),
                field("label", DType::I64, &[]),
                field("odd", DType::U8, &[3, 225, 225]),
                field("rgb", DType::U8, &[3]),
            ],
            64,
        );
        let l = RingLayout::for_schema(&s, 8).unwrap();
        l.validate(&s).unwrap();
        let live = 8 * 64;
        // 3×224×224 is a multiple of 1024: 512 cells cost nothing extra.
        assert_eq!((l.fields[0].cells, l.fields[0].mirrored), (live, true));
        // i64: 512 cells make a page.
        assert_eq!((l.fields[1].cells, l.fields[1].mirrored), (512, true));
        // An odd stride would need 4096 cells (×8): not mirrored, exactly
        // the slots' cells, and the stream serves only its own batch size.
        assert_eq!((l.fields[2].cells, l.fields[2].mirrored), (live, false));
        assert_eq!(l.unmirrored(), Some(2));
        // Tiny fields mirror whatever the factor (4096 cells of 3 bytes).
        assert_eq!((l.fields[3].cells, l.fields[3].mirrored), (4096, true));
        for (k, r) in l.fields.iter().enumerate() {
            assert_eq!(r.offset % SLOT_ALIGN, 0);
            assert_eq!(r.ring_bytes % SLOT_ALIGN, 0);
            assert!(r.cells >= live);
            if k > 0 {
                let prev = l.fields[k - 1];
                assert_eq!(
                    r.offset,
                    prev.offset + prev.ring_bytes,
                    "rings back to back"
                );
            }
        }
    }

    #[test]
    fn spans_are_contiguous_across_a_mirrored_wrap_and_refused_past_a_plain_one() {
        let s = schema(
            vec![
                field("x", DType::F32, &[5]),
                field("odd", DType::U8, &[3, 225, 225]),
            ],
            10,
        );
        let l = RingLayout::for_schema(&s, 4).unwrap();
        let x = l.fields[0];
        assert!(x.mirrored && x.cells == 1024, "{x:?}");
        // 20 samples from cell 1014: 10 before the wrap, 10 after, one span.
        assert_eq!(l.span(0, 1014, 20), Some((1014 * 20, 20 * 20)));
        assert_eq!(l.span(0, 1024 + 1014, 20), l.span(0, 1014, 20));
        assert_eq!(l.span(0, 0, 1025), None, "more than the ring");
        // The plain ring holds 40 cells: units never straddle, runs may not.
        let odd = l.mapped_offset(1);
        assert_eq!(odd, 2 * x.ring_bytes);
        assert_eq!(l.span(1, 30, 10), Some((odd + 30 * 151_875, 10 * 151_875)));
        assert_eq!(l.span(1, 35, 10), None);
        assert_eq!(l.unit_spans(7)[1], l.span(1, 70, 10).unwrap());
    }

    #[test]
    fn a_ring_layout_that_does_not_fit_is_rejected() {
        let s = schema(vec![field("x", DType::F32, &[5])], 10);
        let good = RingLayout::for_schema(&s, 4).unwrap();
        let mut l = good.clone();
        l.fields[0].cells += 1; // no longer whole pages
        assert!(l.validate(&s).is_err());
        let mut l = good.clone();
        l.arena_bytes -= 4096;
        assert!(l.validate(&s).is_err());
        let mut l = good.clone();
        l.fields[0].offset = 100;
        assert!(l.validate(&s).is_err());
        let mut l = good;
        l.unit = 11;
        assert!(l.validate(&s).is_err());
    }
}
