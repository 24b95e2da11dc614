//! Writing a batch into its slot: every field of every sample, straight
//! into its place (collating is zero copies). This is the one place that
//! writes slot bytes for the broker's own sources: the image (through
//! [`ImagePipeline::fill`]: read, decode, transform), its label and dataset
//! index, and the synthetic source's fields.
//!
//! A batch's samples are consecutive cells of each field's ring (the
//! stream's [`batchcast::schema::RingLayout`]): the writer is handed each
//! field's cells for the batch, and sample `j` starts `j ×
//! bytes_per_sample` bytes in.

use std::sync::Arc;

use batchcast::synthetic::SyntheticSpec;

use super::decode::DecodeError;
use super::{ImagePipeline, PipelineCounts, PipelineError, Place, Worker};

/// What fills a stream's slots, shared by its pipeline threads.
#[derive(Debug, Clone)]
pub(crate) enum SlotWriter {
    Synthetic(SyntheticSpec),
    /// Fields `image`, `label`, `index`, in that order.
    Images(Arc<ImagePipeline>),
}

/// One pipeline thread's state: a decoder and buffers for images.
#[derive(Debug)]
pub(crate) struct ThreadState(Option<Worker>);

impl SlotWriter {
    /// A pipeline thread's own state.
    pub(crate) fn thread_state(&self) -> Result<ThreadState, DecodeError> {
        Ok(ThreadState(match self {
            SlotWriter::Synthetic(_) => None,
            SlotWriter::Images(_) => Some(Worker::new()?),
        }))
    }

    /// Writes the samples `indices` (dataset indices, in batch order) of
    /// `epoch` into `fields` (each field's cells for exactly these samples,
    /// in schema order); returns how many. `first`: where the first sample
    /// lies in the source's sequence (the next ones follow it), and
    /// whether this is a replayed batch.
    pub(crate) fn write_batch(
        &self,
        state: &mut ThreadState,
        epoch: u64,
        first: Place,
        indices: &[u64],
        fields: &mut [&mut [u8]],
    ) -> Result<u64, PipelineError> {
        let n = indices.len().max(1);
        match (self, &mut state.0) {
            (SlotWriter::Synthetic(spec), _) => {
                for (f, cells) in fields.iter_mut().enumerate() {
                    let b = cells.len() / n;
                    for (j, &index) in indices.iter().enumerate() {
                        spec.fill_sample(f, index, &mut cells[j * b..(j + 1) * b]);
                    }
                }
            }
            (SlotWriter::Images(pipeline), Some(w)) => {
                let [image, label, index] = fields else {
                    unreachable!("image streams have fields image, label, index")
                };
                let b = image.len() / n;
                let end = first.at + indices.len() as u64;
                if !first.replay {
                    pipeline.batch_started(first.at);
                }
                let filled = (|| -> Result<(), PipelineError> {
                    for (j, &i) in indices.iter().enumerate() {
                        let place = Place {
                            at: first.at + j as u64,
                            replay: first.replay,
                        };
                        let got = pipeline.fill(
                            w,
                            epoch,
                            i,
                            Some(place),
                            &mut image[j * b..(j + 1) * b],
                        )?;
                        label[j * 8..(j + 1) * 8].copy_from_slice(&got.label.to_le_bytes());
                        index[j * 8..(j + 1) * 8]
                            .copy_from_slice(&(got.index as i64).to_le_bytes());
                    }
                    Ok(())
                })();
                if !first.replay {
                    pipeline.batch_done(first.at, end);
                }
                filled?;
            }
            (SlotWriter::Images(_), None) => {
                unreachable!("thread_state gives image writers a decoder")
            }
        }
        Ok(indices.len() as u64)
    }

    /// Tells a shared source whether this stream takes batches.
    pub(crate) fn set_live(&self, live: bool) {
        if let SlotWriter::Images(p) = self {
            p.set_live(live);
        }
    }

    /// Whether the dataset is remote (reads ahead).
    pub(crate) fn reads_remote(&self) -> bool {
        matches!(self, SlotWriter::Images(p) if p.dataset.remote.is_some())
    }

    /// The samples `order[from..]` come next, the first at `lead` in the
    /// stream's sequence: a remote dataset fetches ahead.
    pub fn want(&self, lead: u64, upcoming: impl Iterator<Item = u64>) {
        if let SlotWriter::Images(p) = self
            && p.dataset.remote.is_some()
        {
            p.dataset.want(lead, upcoming);
        }
    }

    /// Ends remote reads in progress (the stream stops).
    pub fn close(&self) {
        if let SlotWriter::Images(p) = self {
            p.dataset.close();
        }
    }

    /// The image pipeline's counts (decodes, skips, cache), if it has one.
    pub fn counts(&self) -> Option<PipelineCounts> {
        match self {
            SlotWriter::Synthetic(_) => None,
            SlotWriter::Images(p) => Some(p.counts()),
        }
    }
}
