//! Writing a batch into its slot: every field of every sample, straight
//! into its place (collating is zero copies). This is the one place that
//! writes slot bytes for the broker's own sources: the image (through
//! [`ImagePipeline::fill`]: read, decode, transform), its label and dataset
//! index, and the synthetic source's fields.
//!
//! A slot holds each field contiguously for the whole batch, at the offset
//! the stream's [`SlotLayout`] gives it: sample `j` of a field starts
//! `j × bytes_per_sample` bytes into that field.

use std::ops::Range;
use std::sync::Arc;

use batchcast::schema::{FieldLayout, SlotLayout};
use batchcast::synthetic::SyntheticSpec;

use super::decode::DecodeError;
use super::{ImagePipeline, PipelineCounts, PipelineError, Worker};

/// What fills a stream's slots, shared by its pipeline threads.
#[derive(Debug, Clone)]
pub enum SlotWriter {
    Synthetic(SyntheticSpec),
    /// Fields `image`, `label`, `index`, in that order.
    Images(Arc<ImagePipeline>),
}

/// One pipeline thread's state: a decoder and buffers for images.
#[derive(Debug)]
pub struct ThreadState(Option<Worker>);

impl SlotWriter {
    /// A pipeline thread's own state.
    pub fn thread_state(&self) -> Result<ThreadState, DecodeError> {
        Ok(ThreadState(match self {
            SlotWriter::Synthetic(_) => None,
            SlotWriter::Images(_) => Some(Worker::new()?),
        }))
    }

    /// Writes the samples `indices` (dataset indices, in batch order) of
    /// `epoch` into `slot`; returns how many.
    pub fn write_batch(
        &self,
        state: &mut ThreadState,
        epoch: u64,
        indices: &[u64],
        layout: &SlotLayout,
        slot: &mut [u8],
    ) -> Result<u64, PipelineError> {
        match (self, &mut state.0) {
            (SlotWriter::Synthetic(spec), _) => {
                for (f, &fl) in layout.fields.iter().enumerate() {
                    for (j, &index) in indices.iter().enumerate() {
                        spec.fill_sample(f, index, &mut slot[sample(fl, j)]);
                    }
                }
            }
            (SlotWriter::Images(pipeline), Some(w)) => {
                let [image, label, index] = [0, 1, 2].map(|f| layout.fields[f]);
                for (j, &i) in indices.iter().enumerate() {
                    let got = pipeline.fill(w, epoch, i, &mut slot[sample(image, j)])?;
                    slot[sample(label, j)].copy_from_slice(&got.label.to_le_bytes());
                    slot[sample(index, j)].copy_from_slice(&(got.index as i64).to_le_bytes());
                }
            }
            (SlotWriter::Images(_), None) => {
                unreachable!("thread_state gives image writers a decoder")
            }
        }
        Ok(indices.len() as u64)
    }

    /// The image pipeline's counts (decodes, skips, cache), if it has one.
    pub fn counts(&self) -> Option<PipelineCounts> {
        match self {
            SlotWriter::Synthetic(_) => None,
            SlotWriter::Images(p) => Some(p.counts()),
        }
    }
}

/// Where sample `j` of field `fl` lies in its slot.
fn sample(fl: FieldLayout, j: usize) -> Range<usize> {
    let b = fl.bytes_per_sample as usize;
    fl.offset as usize + j * b..fl.offset as usize + (j + 1) * b
}
