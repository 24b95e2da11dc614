//! The kinds of sample source, behind one trait chosen once at planning:
//! synthetic data ([`SyntheticSpec`]), a dataset of images (an image
//! folder or WebDataset shards, on disk or in an object store:
//! [`ImagePlan`]) and a producer process ([`Producer`]). What differs
//! between them (the order of an epoch, what the data is made from for
//! the digest, who writes the rings and with what) is asked of the
//! source; nothing else matches on its kind.
//!
//! Every kind passes one conformance suite (`tests` below): an epoch's
//! order is the same on every call, covers the host's share of the
//! dataset once and in the range of its indices, differs between epochs
//! only where it shuffles; the digest is a function of what makes the
//! data, and changes when that does; the writer the pipeline gets (none
//! for a producer) writes the same bytes for the same sample.

use std::fmt;
use std::sync::Arc;

use batchcast::proto::Digester;
use batchcast::synthetic::SyntheticSpec;

use super::ImagePlan;
use crate::budget::{Budget, OverBudget};
use crate::pipeline::ImagePipeline;
use crate::pipeline::collate::SlotWriter;
use crate::pipeline::dataset::Location;
use crate::pipeline::sampler::{self, Uneven};
use crate::pipeline::shared::Shares;
use crate::pipeline::transform::Transform;

/// Where a stream's samples come from.
pub(crate) trait SampleSource: fmt::Debug + Send + Sync {
    /// The kind, as the config and messages name it.
    fn kind(&self) -> &'static str;

    /// The dataset indices of `epoch`, in order, for this host; empty
    /// where a producer decides what each batch holds.
    fn epoch_order(&self, epoch: u64) -> Vec<u64>;

    /// Adds what the data is made from to the digest's `source` part,
    /// and what orders it to its `order` part.
    fn digest(&self, source: &mut Digester, order: &mut Digester);

    /// Whether the broker's pipeline writes the stream's rings (and
    /// faults their pages in at once, and seals them against every other
    /// writer); `false` for a producer's stream, which the producer
    /// writes.
    fn broker_writes(&self) -> bool {
        true
    }

    /// The writer of the pipeline's threads, having taken from `budget`
    /// what it keeps (remote reads, a shared source's memory), and
    /// `transform` instead of its own where one is given (`make --wire`);
    /// `None` where a producer writes.
    fn writer(&self, job: WriterJob<'_>) -> Result<Option<SlotWriter>, OverBudget>;

    /// The image stream's plan (its dataset, transform and rules), which
    /// shared sources, `make --wire` and the decoded cache's notice read.
    fn images(&self) -> Option<&ImagePlan> {
        None
    }

    /// The same, to seat it on a shared source while planning.
    fn images_mut(&mut self) -> Option<&mut ImagePlan> {
        None
    }
}

/// What a source's writer is made with.
#[derive(Debug)]
pub(crate) struct WriterJob<'a> {
    pub budget: &'a Arc<Budget>,
    pub uid: u32,
    /// `stream `name``, for the budget's refusals.
    pub whom: &'a str,
    /// Where a stream on a shared source takes it from.
    pub shares: &'a mut Shares,
    /// Instead of the source's own transform (`make --wire u8`).
    pub transform: Option<Transform>,
    /// The stream's epochs (`None`: endless): caches the broker sizes
    /// are kept only for a stream that reads its images again.
    pub epochs: Option<u64>,
}

impl SampleSource for SyntheticSpec {
    fn kind(&self) -> &'static str {
        "synthetic"
    }

    fn epoch_order(&self, epoch: u64) -> Vec<u64> {
        SyntheticSpec::epoch_order(self, epoch)
    }

    fn digest(&self, source: &mut Digester, order: &mut Digester) {
        source
            .str("synthetic")
            .u64(self.len)
            .str(&format!("{:?}", self.fill));
        order.u64(u64::from(self.shuffle)).u64(self.seed);
    }

    fn writer(&self, _: WriterJob<'_>) -> Result<Option<SlotWriter>, OverBudget> {
        Ok(Some(Arc::new(*self)))
    }
}

impl SampleSource for ImagePlan {
    fn kind(&self) -> &'static str {
        self.dataset.format
    }

    fn epoch_order(&self, epoch: u64) -> Vec<u64> {
        let whole = match self.shuffle_buffer {
            Some(b) => {
                sampler::sharded(&self.dataset.shard_items, self.shuffle, b, self.seed, epoch)
            }
            None => sampler::permutation(self.dataset.len(), self.shuffle, self.seed, epoch),
        };
        self.split.apply(whole)
    }

    fn digest(&self, source: &mut Digester, order: &mut Digester) {
        let d = &self.dataset;
        source
            .str(d.format)
            .str(&d.root)
            .u64(d.classes.len() as u64);
        for c in &d.classes {
            source.str(c);
        }
        for (i, item) in d.items.iter().enumerate() {
            match &item.loc {
                Location::File(path) => source.str(&path.to_string_lossy()),
                Location::Object(_) => source.str(&d.item_name(i as u64)),
                Location::Member { shard, offset, len } => {
                    source.u64(u64::from(*shard)).u64(*offset).u64(*len)
                }
            };
            source.u64(item.label as u64);
        }
        // A remote dataset's objects by version: a resume across a
        // replaced object is refused (its reads would fail anyway).
        for o in d.remote.iter().flat_map(|r| &r.objects) {
            source.str(&o.path).str(&o.version);
        }
        order
            .u64(u64::from(self.shuffle))
            .u64(self.seed)
            .u64(self.shuffle_buffer.map_or(0, |b| b as u64 + 1))
            .u64(self.split.rank)
            .u64(self.split.world_size)
            .u64(match self.split.uneven {
                Uneven::Pad => 0,
                Uneven::Drop => 1,
            });
    }

    fn writer(&self, job: WriterJob<'_>) -> Result<Option<SlotWriter>, OverBudget> {
        if let Some(r) = &self.dataset.remote {
            r.reserve(job.budget, job.uid, job.whom)?;
        }
        let share = match &self.share {
            Some(seat) => {
                let share = job.shares.take(seat);
                share.reserve(job.budget, job.uid)?;
                Some((share, seat.member))
            }
            None => None,
        };
        let transform = job.transform.unwrap_or_else(|| self.transform.clone());
        let pipeline = ImagePipeline::new(self.dataset.clone(), transform, self.rules, share);
        pipeline.reserve(job.budget, job.uid, job.whom, job.epochs)?;
        Ok(Some(Arc::new(pipeline)))
    }

    fn images(&self) -> Option<&ImagePlan> {
        Some(self)
    }

    fn images_mut(&mut self) -> Option<&mut ImagePlan> {
        Some(self)
    }
}

/// A producer process fills the stream over the socket; the broker only
/// does the bookkeeping.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Producer;

impl SampleSource for Producer {
    fn kind(&self) -> &'static str {
        "producer"
    }

    fn epoch_order(&self, _: u64) -> Vec<u64> {
        Vec::new()
    }

    /// What it writes cannot be recomputed: the stream's digest is made
    /// from its name, epoch length and fields (`digest::of_external`).
    fn digest(&self, _: &mut Digester, _: &mut Digester) {}

    fn broker_writes(&self) -> bool {
        false
    }

    fn writer(&self, _: WriterJob<'_>) -> Result<Option<SlotWriter>, OverBudget> {
        Ok(None)
    }
}

/// The conformance suite: every kind of source, through the same checks
/// (the module's notes), on real files.
#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::path::Path;

    use batchcast::DType;
    use batchcast::proto::ProduceRequest;
    use batchcast::schema::Field;

    use super::*;
    use crate::config::{Config, StreamToml};
    use crate::pipeline::Place;
    use crate::plan::{StreamPlan, plan_config};

    /// One stream's config as each kind writes it, given what varies:
    /// the seed, this host's rank of two (or the only one), and whether
    /// the dataset has one sample more; `None` where the kind takes no
    /// rank (a synthetic stream is the same on every host).
    type Make = fn(&Path, u64, Option<u64>, bool) -> Option<StreamPlan>;

    const SAMPLES: u64 = 12;

    fn plan(text: &str) -> StreamPlan {
        let cfg = Config::parse(text, Path::new("test.toml")).unwrap();
        plan_config(&cfg).unwrap().remove(0)
    }

    fn ranked(toml: StreamToml, seed: u64, rank: Option<u64>) -> String {
        let toml = toml.key("seed", seed).key("shuffle", true);
        match rank {
            Some(r) => toml.key("rank", r).key("world_size", 2),
            None => toml,
        }
        .to_toml()
    }

    /// An 8 x 8 RGB PNG whose pixels say which sample it is.
    fn png(k: u64) -> Vec<u8> {
        let mut out = Vec::new();
        let mut enc = png::Encoder::new(&mut out, 8, 8);
        enc.set_color(png::ColorType::Rgb);
        let pixels: Vec<u8> = (0..8 * 8 * 3)
            .map(|i| (i as u64 * 7 + k * 31) as u8)
            .collect();
        let mut w = enc.write_header().unwrap();
        w.write_image_data(&pixels).unwrap();
        w.finish().unwrap();
        out
    }

    fn count(more: bool) -> u64 {
        SAMPLES + u64::from(more)
    }

    fn synthetic(_: &Path, seed: u64, rank: Option<u64>, more: bool) -> Option<StreamPlan> {
        let toml = StreamToml::synthetic("s", 2, count(more), &[("x", "u8", &[5])]);
        rank.is_none().then(|| plan(&ranked(toml, seed, None)))
    }

    fn image_folder(dir: &Path, seed: u64, rank: Option<u64>, more: bool) -> Option<StreamPlan> {
        let root = dir.join(format!("folder-{more}"));
        for k in 0..count(more) {
            let class = root.join(format!("c{}", k % 2));
            std::fs::create_dir_all(&class).unwrap();
            std::fs::write(class.join(format!("{k:02}.png")), png(k)).unwrap();
        }
        Some(plan(&ranked(
            StreamToml::image_folder("i", 2, &root, 8),
            seed,
            rank,
        )))
    }

    fn webdataset(dir: &Path, seed: u64, rank: Option<u64>, more: bool) -> Option<StreamPlan> {
        let root = dir.join(format!("shards-{more}"));
        std::fs::create_dir_all(&root).unwrap();
        for s in 0..2 {
            let mut b = tar::Builder::new(Vec::new());
            for k in (s..count(more)).step_by(2) {
                let label = (k % 2).to_string();
                for (ext, data) in [("png", png(k)), ("cls", label.into_bytes())] {
                    let mut h = tar::Header::new_gnu();
                    h.set_size(data.len() as u64);
                    h.set_mode(0o644);
                    h.set_cksum();
                    b.append_data(&mut h, format!("{k:04}.{ext}"), &data[..])
                        .unwrap();
                }
            }
            std::fs::write(root.join(format!("s{s}.tar")), b.into_inner().unwrap()).unwrap();
        }
        let toml = StreamToml::image_folder("w", 2, &root, 8);
        Some(plan(&ranked(toml, seed, rank).replace(
            &format!("[stream.image_folder]\nroot = \"{}\"", root.display()),
            &format!(
                "[stream.webdataset]\nshards = \"{}/s{{0..1}}.tar\"\nshuffle_buffer = 4",
                root.display()
            ),
        )))
    }

    fn producer(_: &Path, _: u64, rank: Option<u64>, more: bool) -> Option<StreamPlan> {
        let field = Field {
            name: "x".into(),
            dtype: DType::U8,
            shape: vec![4],
            aux: false,
        };
        let req = ProduceRequest::new("p", vec![field], 2, count(more));
        rank.is_none()
            .then(|| StreamPlan::external(&req, "loader", 7).unwrap())
    }

    const KINDS: [(&str, Make); 4] = [
        ("synthetic", synthetic),
        ("image_folder", image_folder),
        ("webdataset", webdataset),
        ("producer", producer),
    ];

    /// Writes `indices` of `epoch` with a fresh thread state: every
    /// field's bytes.
    fn write(plan: &StreamPlan, writer: &SlotWriter, epoch: u64, indices: &[u64]) -> Vec<u8> {
        let mut fields: Vec<Vec<u8>> = plan
            .schema
            .fields
            .iter()
            .map(|f| vec![0u8; (f.bytes_per_sample().unwrap() * indices.len() as u64) as usize])
            .collect();
        let mut cells: Vec<&mut [u8]> = fields.iter_mut().map(|f| &mut f[..]).collect();
        let mut state = writer.thread_state().unwrap();
        let first = Place {
            at: 0,
            replay: true,
        };
        let n = writer
            .write_batch(&mut state, epoch, first, indices, &mut cells)
            .unwrap();
        assert_eq!(n, indices.len() as u64);
        fields.concat()
    }

    fn writer(plan: &StreamPlan, budget: &Arc<Budget>) -> Option<SlotWriter> {
        let job = WriterJob {
            budget,
            uid: 0,
            whom: "stream `conformance`",
            shares: &mut Shares::default(),
            transform: None,
            epochs: plan.epochs,
        };
        plan.source.writer(job).unwrap()
    }

    fn check(kind: &str, make: Make, dir: &Path) {
        let make = |seed, rank, more| make(dir, seed, rank, more);
        let p = make(1, None, false).unwrap();
        let again = make(1, None, false).unwrap();
        assert_eq!(p.source.kind(), kind);
        assert_eq!(
            p.digest, again.digest,
            "{kind}: the same data, the same digest"
        );
        let order: Vec<Vec<u64>> = (0..3).map(|e| p.epoch_order(e)).collect();
        assert_eq!(
            order[1],
            again.epoch_order(1),
            "{kind}: an epoch's order is fixed"
        );
        let budget = Budget::new(1 << 30, 0);
        if !p.source.broker_writes() {
            assert!(order.iter().all(Vec::is_empty), "{kind}: a producer orders");
            assert!(writer(&p, &budget).is_none());
            assert!(p.source.images().is_none());
            assert_ne!(
                p.digest,
                make(1, None, true).unwrap().digest,
                "{kind}: another epoch length, another digest"
            );
            return;
        }
        for o in &order {
            assert_eq!(
                o.len() as u64,
                SAMPLES,
                "{kind}: every sample, once an epoch"
            );
            let once: HashSet<u64> = o.iter().copied().collect();
            assert_eq!(once.len() as u64, SAMPLES, "{kind}: no sample twice");
            assert!(o.iter().all(|&i| i < SAMPLES), "{kind}: {o:?}");
        }
        assert_ne!(
            order[0], order[1],
            "{kind}: a shuffled stream reorders epochs"
        );
        // Two hosts of a data-parallel run split each epoch between them.
        if let [Some(a), Some(b)] = [0, 1].map(|r| make(1, Some(r), false)) {
            let halves = [a.epoch_order(2), b.epoch_order(2)];
            assert_eq!(halves[0].len() as u64, SAMPLES / 2, "{kind}");
            let both: HashSet<u64> = halves.concat().into_iter().collect();
            assert_eq!(
                both.len() as u64,
                SAMPLES,
                "{kind}: the ranks' shares cover the epoch"
            );
        }
        // The digest follows what makes the data, and only that.
        let reseeded = make(2, None, false).unwrap();
        assert_eq!(reseeded.digest.source, p.digest.source, "{kind}");
        assert_ne!(
            reseeded.digest.order, p.digest.order,
            "{kind}: another seed"
        );
        assert_ne!(reseeded.epoch_order(0), order[0], "{kind}: another seed");
        let grown = make(1, None, true).unwrap();
        assert_ne!(
            grown.digest.source, p.digest.source,
            "{kind}: another dataset"
        );
        // The writer writes the same bytes for the same samples, whoever
        // asks, and other bytes for others.
        let w = writer(&p, &budget).expect("a writer");
        let w2 = writer(&again, &budget).expect("a writer");
        let batch = &order[1][..2];
        let bytes = write(&p, &w, 1, batch);
        assert_eq!(bytes, write(&again, &w2, 1, batch), "{kind}: made again");
        assert_ne!(bytes, write(&p, &w, 1, &order[1][2..4]), "{kind}");
        assert_eq!(p.source.images().is_some(), kind != "synthetic", "{kind}");
    }

    #[test]
    fn every_kind_of_source_passes_the_same_checks() {
        let dir = tempfile::tempdir().unwrap();
        for (kind, make) in KINDS {
            check(kind, make, dir.path());
        }
    }
}
