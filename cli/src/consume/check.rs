//! What `batchcast consume` checks and counts from batch to batch: order,
//! epochs, digests, dumps, distinct dataset indices, synthetic bytes.

use std::borrow::Cow;
use std::collections::{HashSet, VecDeque};

use batchcast::proto::EpochEnd;
use batchcast::rotation::Rotation;
use batchcast::schema::SourceInfo;
use batchcast::synthetic::{SyntheticSpec, mix64};
use batchcast::{Batch, JoinPolicy, Schema};

use super::{ConsumeArgs, ConsumerReport, EpochReport, Histogram};

/// What `consume` checks and counts from batch to batch: order, epochs,
/// digests, dumps, distinct dataset indices, synthetic bytes.
pub(super) struct Checker<'a> {
    args: &'a ConsumeArgs,
    /// How it joined: a first batch mid-epoch is an error unless immediate.
    join: JoinPolicy,
    schema: Schema,
    /// This consumer's batches in an epoch.
    batches_per_epoch: u64,
    /// Synthetic streams with `--verify`: what every sample must hold.
    spec: Option<SyntheticSpec>,
    /// Image streams: the `index` field, to count distinct samples.
    index_field: Option<usize>,
    seen: HashSet<i64>,
    /// The sample order of the last two epochs seen.
    orders: VecDeque<(u64, Vec<u64>)>,
    handoff: Histogram,
    /// `(seq, epoch, index)` of the last batch, and whether it was replayed.
    last: Option<(u64, u64, u64)>,
    last_replayed: bool,
    /// The index of the epoch in progress's first batch: 0, or where a
    /// rotated epoch began (its batches before come after its last).
    epoch_start: u64,
    digest: u64,
    cur: EpochReport,
    /// Where the first batch must begin (`--resume`, `--resume-state`).
    resume: Option<batchcast::proto::Position>,
    /// Batches of the epoch in progress counted before a resume (an
    /// epoch's end counts only this process's).
    carried: u64,
    /// The consumer's reconnects when the last batch came.
    session: u64,
    /// The shared mapping's address range in this process, and the replay
    /// arena's.
    arenas: Vec<(usize, usize)>,
    /// A group member's share: its batches are its own runs.
    pub(super) deal: Option<batchcast::deal::Deal>,
}

impl<'a> Checker<'a> {
    /// The host arena's region the consumer's next batches lie in (the
    /// broker moves the ring on when a stopped consumer held a batch past
    /// the hold limit).
    pub(super) fn host_arena_is(&mut self, (base, len): (*const u8, usize)) {
        if let Some(a) = self.arenas.first_mut() {
            *a = (base as usize, len);
        }
    }

    pub(super) fn new(
        args: &'a ConsumeArgs,
        schema: Schema,
        batches_per_epoch: u64,
        arenas: Vec<(usize, usize)>,
        join: JoinPolicy,
    ) -> batchcast::Result<Checker<'a>> {
        let spec = match schema.source {
            SourceInfo::Synthetic(spec) => Some(spec).filter(|_| args.verify),
            SourceInfo::Images(_) | SourceInfo::External(_) if args.verify => {
                return Err(batchcast::Error::Schema(
                    "--verify checks synthetic streams; use --digest or --dump to compare what consumers of other streams receive".into(),
                ));
            }
            SourceInfo::Images(_) | SourceInfo::External(_) => None,
        };
        let index_field = schema
            .field("index")
            .filter(|(_, f)| f.dtype == batchcast::DType::I64 && f.shape.is_empty())
            .map(|(i, _)| i);
        if let Some(dir) = &args.dump {
            std::fs::create_dir_all(dir).map_err(batchcast::Error::Io)?;
        }
        Ok(Checker {
            args,
            join,
            schema,
            batches_per_epoch,
            spec,
            index_field,
            seen: HashSet::new(),
            orders: VecDeque::new(),
            deal: None,
            handoff: Histogram::default(),
            last: None,
            last_replayed: false,
            epoch_start: 0,
            digest: 0,
            cur: EpochReport::new(u64::MAX),
            resume: args.resume,
            carried: 0,
            session: 0,
            arenas,
        })
    }

    /// Resuming from `saved`: the epoch it was in carries on from its
    /// counts and digest (unless the resume begins the next epoch), and
    /// the first batch must begin at its position (a group member's: at
    /// its first own run from its group's round, whatever rank saved it).
    pub(super) fn carry_on(&mut self, saved: super::SavedState) {
        let round = saved.state.group.as_ref().filter(|_| self.deal.is_some());
        self.resume = Some(round.map_or(saved.state.position, |g| g.round));
        if let Some(r) = saved.state.rotation {
            self.epoch_start = r.at / saved.state.batch_size.max(1);
        }
        if saved.epoch.epoch == saved.state.position.epoch {
            self.carried = saved.epoch.batches;
            self.cur = saved.epoch;
            self.digest = saved.digest;
        }
    }

    /// The epoch in progress as counted so far, and its digest.
    pub(super) fn progress(&self) -> (EpochReport, u64) {
        (self.cur.clone(), self.digest)
    }

    pub(super) fn epoch_end(&mut self, end: EpochEnd, report: &mut ConsumerReport) {
        let carried = std::mem::take(&mut self.carried);
        if self.cur.epoch != end.epoch || self.cur.batches - carried != end.batches {
            report.order_errors.push(format!(
                "end of epoch {end:?} after {} batches of epoch {}",
                self.cur.batches, self.cur.epoch
            ));
        }
        self.cur.complete = end.complete;
    }

    /// Checks and counts one batch.
    /// `session`: the consumer's reconnects so far (a new subscription
    /// numbers its batches anew).
    /// `rotation`: the consumer's after handing it out (its state's).
    pub(super) fn batch(
        &mut self,
        batch: &Batch,
        (session, rotation): (u64, Option<Rotation>),
        report: &mut ConsumerReport,
    ) -> batchcast::Result<()> {
        if session != self.session {
            self.session = session;
            self.last_replayed = true; // seqs start anew: order by place only
        }
        self.handoff.record(batch.handoff_ns());
        report.wait_s += batch.wait_ns() as f64 * 1e-9;
        report.busy_s += batch.busy_ns() as f64 * 1e-9;
        self.check_order(batch, rotation, report);
        if batch.epoch() != self.cur.epoch {
            self.close_epoch(report);
            self.cur = EpochReport::new(batch.epoch());
        }
        self.cur.batches += 1;
        self.cur.samples += batch.len() as u64;
        if self.args.positions {
            self.cur
                .positions
                .push((batch.first_sample(), batch.len() as u64));
        }
        report.batches += 1;
        report.replayed_batches += u64::from(batch.replayed());
        report.samples += batch.len() as u64;
        // Host views, or for a device batch its bytes copied back from the
        // GPU (this is a test consumer: what it checks is what arrived).
        let fields: Vec<Cow<'_, [u8]>> = match batch.fields() {
            Ok(views) => views.map(|f| f.bytes().into()).collect(),
            Err(batchcast::Error::OnDevice { .. }) => (0..self.schema.fields.len())
                .map(|i| batch.copy_field(i).map(Into::into))
                .collect::<batchcast::Result<_>>()?,
            Err(e) => return Err(e),
        };
        for f in &fields {
            if let Cow::Borrowed(b) = f {
                let p = b.as_ptr() as usize;
                if !self
                    .arenas
                    .iter()
                    .any(|&(base, len)| p >= base && p + b.len() <= base + len)
                {
                    report.views_outside_arena += 1;
                }
            }
        }
        self.record_fields(batch, &fields, report)?;
        if let Some(fi) = self.index_field {
            for j in 0..batch.len() {
                let v = i64::from_le_bytes(
                    sample(&fields[fi], batch.len(), j)
                        .try_into()
                        .expect("i64 scalar"),
                );
                self.seen.insert(v);
            }
        }
        if let Some(spec) = self.spec {
            self.verify(spec, batch, &fields, report);
        }
        Ok(())
    }

    /// Batches come in sequence, epoch by epoch; the first at an epoch's
    /// start unless joining mid-epoch.
    /// Where the first batch of a consumer starting at `sample` begins:
    /// there, or for a group member the start of its next own run (there,
    /// if it starts inside one).
    fn first_own(&self, sample: u64) -> u64 {
        let Some(deal) = self.deal else {
            return sample;
        };
        let mut f = sample;
        while let Some(d) = deal.run_at(f) {
            if d.mine {
                return f;
            }
            f = d.end;
        }
        sample
    }

    /// A rotated epoch ([`batchcast::rotation`]) runs from its first
    /// batch's index to its last, then from 0 to just before it: each
    /// batch once, and its consumer's state names the rotation.
    fn check_order(
        &mut self,
        batch: &Batch,
        rotation: Option<Rotation>,
        report: &mut ConsumerReport,
    ) {
        let (seq, epoch, index) = (batch.seq(), batch.epoch(), batch.index());
        let rotated_here =
            rotation.is_some_and(|r| r.epoch == epoch && r.at == batch.first_sample());
        let new_epoch = self.last.is_none_or(|(_, pe, _)| pe != epoch);
        match self.last {
            Some((ps, pe, pi)) => {
                let expect = match (pi + 1 == self.batches_per_epoch, self.epoch_start) {
                    (true, 0) => (pe + 1, 0),
                    (true, _) => (pe, 0),
                    (false, s) if pi + 1 == s => (pe + 1, 0),
                    (false, _) => (pe, pi + 1),
                };
                // A new epoch may begin rotated.
                let as_expected =
                    (epoch, index) == expect || (epoch == expect.0 && epoch != pe && rotated_here);
                // Batches smaller than the stream's share its units' seq;
                // replayed batches count seqs of their own.
                let replay = batch.replayed() || self.last_replayed;
                if (!replay && seq < ps) || !as_expected {
                    report.order_errors.push(format!(
                        "batch ({epoch}, {index}) seq {seq} after ({pe}, {pi}) seq {ps}"
                    ));
                }
            }
            None if self.resume.is_some_and(|p| {
                (p.epoch, self.first_own(p.sample)) != (epoch, batch.first_sample())
            }) =>
            {
                report.order_errors.push(format!(
                    "first batch starts at sample {} of epoch {epoch}, not at the resume position {:?}",
                    batch.first_sample(),
                    self.resume
                ));
            }
            None if self.resume.is_none()
                && self.join != JoinPolicy::Immediate
                && index != 0
                && !rotated_here =>
            {
                report.order_errors.push(format!(
                    "first batch is index {index} of epoch {epoch}, not the start of an epoch"
                ));
            }
            None => {}
        }
        // A resume's first epoch keeps where its state says it began.
        if new_epoch && (self.last.is_some() || rotated_here) {
            self.epoch_start = if rotated_here { index } else { 0 };
            report.rotated_epochs += u64::from(rotated_here);
        }
        self.last = Some((seq, epoch, index));
        self.last_replayed = batch.replayed();
    }

    /// Counts the bytes, and digests or dumps them when asked.
    fn record_fields(
        &mut self,
        batch: &Batch,
        fields: &[Cow<'_, [u8]>],
        report: &mut ConsumerReport,
    ) -> batchcast::Result<()> {
        if self.args.digest {
            // Sample by sample, so that consumers of any batch size agree.
            for j in 0..batch.len() {
                for bytes in fields {
                    self.digest = digest_bytes(self.digest, sample(bytes, batch.len(), j));
                }
            }
        }
        for (f, bytes) in self.schema.fields.iter().zip(fields) {
            report.bytes += bytes.len() as u64;
            if let Some(dir) = &self.args.dump {
                let path = dir.join(format!(
                    "e{}-b{}-{}.bin",
                    batch.epoch(),
                    batch.index(),
                    f.name
                ));
                std::fs::write(&path, bytes).map_err(batchcast::Error::Io)?;
            }
        }
        Ok(())
    }

    /// Checks every sample of a synthetic batch against the generator.
    fn verify(
        &mut self,
        spec: SyntheticSpec,
        batch: &Batch,
        fields: &[Cow<'_, [u8]>],
        report: &mut ConsumerReport,
    ) {
        let epoch = batch.epoch();
        if !self.orders.iter().any(|(e, _)| *e == epoch) {
            if self.orders.len() == 2 {
                self.orders.pop_front();
            }
            self.orders.push_back((epoch, spec.epoch_order(epoch)));
        }
        let order = &self
            .orders
            .iter()
            .find(|(e, _)| *e == epoch)
            .expect("just inserted")
            .1;
        let first = batch.first_sample() as usize;
        let before = report.verify_failures;
        for (fi, bytes) in fields.iter().enumerate() {
            for j in 0..batch.len() {
                let Some(&ds) = order.get(first + j) else {
                    report.verify_failures += 1;
                    continue;
                };
                if !spec.verify_sample(fi, ds, sample(bytes, batch.len(), j)) {
                    report.verify_failures += 1;
                }
            }
        }
        if report.verify_failures > before && report.order_errors.len() < 20 {
            report.order_errors.push(format!(
                "verify: {} wrong in batch of epoch {epoch}, samples {first}..{} ({}, seq {})",
                report.verify_failures - before,
                first + batch.len(),
                if batch.replayed() {
                    "replayed"
                } else {
                    "shared"
                },
                batch.seq()
            ));
        }
        report.verified_samples += batch.len() as u64;
    }

    /// Adds the epoch in progress, if any, to the report.
    fn close_epoch(&mut self, report: &mut ConsumerReport) {
        if self.cur.epoch == u64::MAX {
            return;
        }
        let mut e = close_epoch(&mut self.cur, &mut self.digest, self.args.digest);
        e.distinct_indices = self.index_field.map(|_| self.seen.len() as u64);
        self.seen.clear();
        report.epochs.push(e);
    }

    pub(super) fn finish(mut self, report: &mut ConsumerReport) {
        self.close_epoch(report);
        report.handoff_us_p50 = self.handoff.quantile(0.50) as f64 / 1e3;
        report.handoff_us_p99 = self.handoff.quantile(0.99) as f64 / 1e3;
        report.handoff_us_max = self.handoff.max as f64 / 1e3;
    }
}

/// Sample `j` of a field's bytes in a batch of `samples` samples.
fn sample(field: &[u8], samples: usize, j: usize) -> &[u8] {
    let bps = field.len() / samples.max(1);
    &field[j * bps..(j + 1) * bps]
}

fn close_epoch(cur: &mut EpochReport, digest: &mut u64, with_digest: bool) -> EpochReport {
    let mut e = cur.clone();
    if with_digest {
        e.digest = Some(format!("{:016x}", *digest));
    }
    *digest = 0;
    e
}

fn digest_bytes(mut acc: u64, bytes: &[u8]) -> u64 {
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        acc = mix64(acc ^ u64::from_le_bytes(c.try_into().expect("8 bytes")));
    }
    for &b in chunks.remainder() {
        acc = mix64(acc ^ b as u64);
    }
    mix64(acc ^ bytes.len() as u64)
}
