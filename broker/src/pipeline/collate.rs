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

/// What fills a stream's slots, shared by its pipeline threads: chosen
/// once at planning by the stream's source
/// ([`crate::plan::kind::SampleSource::writer`]): the synthetic source's
/// fields ([`SyntheticSpec`]) or the image pipeline ([`ImagePipeline`]).
/// Every source, and so every writer, passes the sources' one
/// conformance suite (`plan/kind.rs`).
pub(crate) type SlotWriter = Arc<dyn Fill>;

/// A writer of slots (see [`SlotWriter`]).
pub(crate) trait Fill: std::fmt::Debug + Send + Sync {
    /// A pipeline thread's own state.
    fn thread_state(&self) -> Result<ThreadState, DecodeError>;

    /// Writes the samples `indices` (dataset indices, in batch order) of
    /// `epoch` into `fields` (each field's cells for exactly these
    /// samples, in schema order); returns how many. `first`: where the
    /// first sample lies in the source's sequence (the next ones follow
    /// it), and whether this is a replayed batch.
    fn write_batch(
        &self,
        state: &mut ThreadState,
        epoch: u64,
        first: Place,
        indices: &[u64],
        fields: &mut [&mut [u8]],
    ) -> Result<u64, PipelineError>;

    /// Tells a shared source whether this stream takes batches.
    fn set_live(&self, _live: bool) {}

    /// Whether the dataset is remote (reads ahead).
    fn reads_remote(&self) -> bool {
        false
    }

    /// The samples `upcoming` come next, the first at `lead` in the
    /// stream's sequence: a remote dataset fetches ahead.
    fn want(&self, _lead: u64, _upcoming: &mut dyn Iterator<Item = u64>) {}

    /// Ends remote reads in progress (the stream stops).
    fn close(&self) {}

    /// The image pipeline's counts (decodes, skips, cache), if it has one.
    fn counts(&self) -> Option<PipelineCounts> {
        None
    }
}

/// One pipeline thread's state: a decoder and buffers for images.
#[derive(Debug)]
pub(crate) struct ThreadState(Option<Worker>);

impl Fill for SyntheticSpec {
    fn thread_state(&self) -> Result<ThreadState, DecodeError> {
        Ok(ThreadState(None))
    }

    fn write_batch(
        &self,
        _: &mut ThreadState,
        _epoch: u64,
        _first: Place,
        indices: &[u64],
        fields: &mut [&mut [u8]],
    ) -> Result<u64, PipelineError> {
        let n = indices.len().max(1);
        for (f, cells) in fields.iter_mut().enumerate() {
            let b = cells.len() / n;
            for (j, &index) in indices.iter().enumerate() {
                self.fill_sample(f, index, &mut cells[j * b..(j + 1) * b]);
            }
        }
        Ok(indices.len() as u64)
    }
}

/// Fields `image`, `label`, `index`, in that order.
impl Fill for ImagePipeline {
    fn thread_state(&self) -> Result<ThreadState, DecodeError> {
        Ok(ThreadState(Some(Worker::new()?)))
    }

    fn write_batch(
        &self,
        state: &mut ThreadState,
        epoch: u64,
        first: Place,
        indices: &[u64],
        fields: &mut [&mut [u8]],
    ) -> Result<u64, PipelineError> {
        let Some(w) = state.0.as_mut() else {
            unreachable!("thread_state gives image writers a decoder")
        };
        let [image, label, index] = fields else {
            unreachable!("image streams have fields image, label, index")
        };
        let n = indices.len().max(1);
        let b = image.len() / n;
        let end = first.at + indices.len() as u64;
        if !first.replay {
            self.batch_started(first.at);
        }
        let filled = (|| -> Result<(), PipelineError> {
            for (j, &i) in indices.iter().enumerate() {
                let place = Place {
                    at: first.at + j as u64,
                    replay: first.replay,
                };
                let got = self.fill(w, epoch, i, Some(place), &mut image[j * b..(j + 1) * b])?;
                label[j * 8..(j + 1) * 8].copy_from_slice(&got.label.to_le_bytes());
                index[j * 8..(j + 1) * 8].copy_from_slice(&(got.index as i64).to_le_bytes());
            }
            Ok(())
        })();
        if !first.replay {
            self.batch_done(first.at, end);
        }
        filled?;
        Ok(indices.len() as u64)
    }

    fn set_live(&self, live: bool) {
        ImagePipeline::set_live(self, live);
    }

    fn reads_remote(&self) -> bool {
        self.dataset.remote.is_some()
    }

    fn want(&self, lead: u64, upcoming: &mut dyn Iterator<Item = u64>) {
        if self.dataset.remote.is_some() {
            self.dataset.want(lead, upcoming);
        }
    }

    fn close(&self) {
        self.dataset.close();
    }

    fn counts(&self) -> Option<PipelineCounts> {
        Some(ImagePipeline::counts(self))
    }
}
