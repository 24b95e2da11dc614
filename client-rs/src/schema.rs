//! What a stream carries: fields, their element types and per-sample shapes,
//! and where each field lives inside a slot of the shared arena.
//!
//! The broker computes a [`SlotLayout`] once per stream with
//! [`SlotLayout::for_schema`] and sends it in the welcome message; clients
//! validate it against the mapping before handing out any view, so a bad
//! layout can never produce an out-of-bounds slice.

use serde::{Deserialize, Serialize};

pub use crate::dtype::DType;
use crate::error::{Error, Result};

/// Alignment of every field inside a slot. 256 bytes satisfies SIMD loads,
/// cache lines and the CUDA allocation granularity for copies.
pub const FIELD_ALIGN: u64 = 256;
/// Alignment of every slot inside the arena: a page, so slots can be
/// registered, advised or protected independently.
pub const SLOT_ALIGN: u64 = 4096;

/// One named tensor of every sample, e.g. `image: u8 [3, 224, 224]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    /// Number of elements in one sample's tensor.
    pub fn elements_per_sample(&self) -> u64 {
        self.shape.iter().product()
    }

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
        let overflow = || Error::Schema("slot size overflows u64".into());
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
            return Err(Error::Schema(format!(
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
                    return Err(Error::Schema(format!(
                        "field `{}` does not fit its slot (offset {}, {} bytes per sample, slot {} bytes)",
                        field.name, layout.offset, layout.bytes_per_sample, self.slot_bytes
                    )));
                }
            }
        }
        Ok(())
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
}
