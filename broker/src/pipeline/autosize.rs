//! Caches that size themselves: where a stream's config leaves
//! `decoded_cache_mib` or `cache_mib` out, the broker decides, once its
//! pipeline has read the first [`SAMPLED`] images (no read of its own),
//! whether and how much to keep, from those images, the memory budget
//! left and the host's available memory, and says what it chose and why
//! (its log, `batchcast stats`). Until then nothing is kept.
//!
//! Bytes never depend on the choice: the cache of decoded images keeps
//! each image at the scale its crop decodes at (`kept.rs`), the cache of
//! encoded bytes keeps files as read. A key written in the config wins,
//! `0` turning a cache off.
//!
//! # Rules
//!
//! * **Decoded images.** The dataset's footprint is estimated from the
//!   first [`SAMPLED`] images read (a random sample where the stream
//!   shuffles; the first of its order where it does not): each one's size
//!   at the scales
//!   [`DRAWS`] of its crops decode at (one scale per image with
//!   `decoded_side`), times the images. The cache takes that and an
//!   eighth more, within what the memory budget leaves kept images (a
//!   quarter of it for every stream's together, so that caches nobody
//!   asked for never take what arenas, mailboxes and replay arenas need:
//!   `Budget::room_for_caches`) and a quarter of the host's available
//!   memory; its bytes are taken from the budget at once, as a configured
//!   one's are.
//!   Under [`FLOOR`] it is off. A stream on a `[[source]]` keeps none
//!   unasked: its streams share their decodes by place instead.
//! * **Encoded bytes.** Files on a local disk are kept by the page cache
//!   where they fit in half the available memory: no cache. Past that,
//!   and for a dataset in an object store or on an HTTP server (each read
//!   a request), the files' estimated size, within an eighth of the
//!   available memory (1 GiB where it is unknown); under [`FLOOR`], none.
//!   Its memory is the host's, outside the budget, as a configured one's.
//! * **One epoch.** A stream of one epoch reads each image once: it keeps
//!   neither (a whole decode of an image kept costs more than its crop's).

use std::fmt::Write as _;
use std::sync::Arc;

use super::decode::Format;
use super::{Dims, ImagePipeline};
use crate::budget::{Budget, Use};

/// Images read before the caches are sized, to estimate the dataset's
/// footprint.
pub const SAMPLED: u64 = 32;
/// Crops drawn per sampled image to find the scales it decodes at.
pub const DRAWS: u64 = 4;
/// The least a cache the broker sizes is worth keeping.
pub const FLOOR: u64 = 16 << 20;
const MIB: u64 = 1 << 20;

/// A cache's size as the config gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSize {
    /// Left out: the broker sizes it.
    Auto,
    /// Written: bytes (0: off).
    Bytes(u64),
}

impl CacheSize {
    /// From a `*_mib` key (absent: [`CacheSize::Auto`]).
    pub fn from_mib(mib: Option<u64>) -> CacheSize {
        match mib {
            None => CacheSize::Auto,
            Some(m) => CacheSize::Bytes(m.saturating_mul(MIB)),
        }
    }
}

/// What a sample of the dataset says of all of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    pub images: u64,
    /// Of [`SAMPLED`], those read and understood.
    pub sampled: u64,
    /// The files' bytes, all together.
    pub encoded: u64,
    /// The decoded images' bytes at the scales their crops decode at.
    pub decoded: u64,
}

/// What the choice is made from, besides the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    pub estimate: Option<Estimate>,
    /// What the memory budget leaves kept images
    /// (`Budget::room_for_caches`).
    pub budget_left: u64,
    /// The host's available memory (`MemAvailable`), where known.
    pub available: Option<u64>,
    /// The dataset is in an object store or on an HTTP server.
    pub remote: bool,
    /// The stream is on a `[[source]]`.
    pub shared: bool,
}

/// What the broker chose for the caches the config left out, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// Bytes of the cache of decoded images (`None`: the config's).
    pub decoded: Option<u64>,
    /// Bytes of the cache of encoded bytes (`None`: the config's).
    pub encoded: Option<u64>,
    /// One line for each, for the log and `stats`.
    pub why: String,
}

fn mib(b: u64) -> u64 {
    b.div_ceil(MIB)
}

/// Sizes the caches `decoded` and `encoded` leave to the broker
/// ([module rules](self)).
pub fn choose(decoded: CacheSize, encoded: CacheSize, f: &Facts) -> Choice {
    let mut why = String::new();
    let decoded = (decoded == CacheSize::Auto).then(|| {
        let (bytes, said) = choose_decoded(f);
        let _ = write!(why, "decoded_cache_mib = {}: {said}", mib(bytes));
        bytes
    });
    let encoded = (encoded == CacheSize::Auto).then(|| {
        let (bytes, said) = choose_encoded(f);
        if !why.is_empty() {
            why.push_str("; ");
        }
        let _ = write!(why, "cache_mib = {}: {said}", mib(bytes));
        bytes
    });
    Choice {
        decoded,
        encoded,
        why,
    }
}

fn choose_decoded(f: &Facts) -> (u64, String) {
    if f.shared {
        return (
            0,
            "on a [[source]], its streams share their decodes by place; set decoded_cache_mib there to keep them".into(),
        );
    }
    let Some(e) = f.estimate.filter(|e| e.sampled > 0) else {
        return (0, "no sampled image could be read to size it".into());
    };
    let cap = f.budget_left.min(f.available.map_or(u64::MAX, |a| a / 4));
    let want = (e.decoded + e.decoded / 8).div_ceil(MIB) * MIB;
    if cap < FLOOR {
        return (
            0,
            format!(
                "what the memory budget leaves kept images and a quarter of the host's available memory ({} MiB) is under {} MiB",
                mib(cap),
                FLOOR >> 20
            ),
        );
    }
    let what = format!(
        "its {} images take about {} MiB decoded at the scales their crops decode at (from {} sampled)",
        e.images,
        mib(e.decoded),
        e.sampled
    );
    if want <= cap {
        (want, format!("holds them all: {what}"))
    } else {
        let part = cap as f64 / want as f64 * 100.0;
        (
            cap,
            format!(
                "what the memory budget leaves kept images (a quarter of it, every stream's together) or a quarter of the host's available memory, about {part:.0} % of them: {what}; raise [broker] memory_mib or set decoded_side to keep more"
            ),
        )
    }
}

fn choose_encoded(f: &Facts) -> (u64, String) {
    let Some(e) = f.estimate.filter(|e| e.sampled > 0) else {
        return (0, "no sampled file could be read to size it".into());
    };
    let files = format!("its files take about {} MiB", mib(e.encoded));
    let want = (e.encoded + e.encoded / 20).div_ceil(MIB) * MIB;
    let cap = f.available.map_or(1 << 30, |a| a / 8);
    let outgrown = f.available.is_some_and(|a| e.encoded > a / 2);
    if !f.remote && !outgrown {
        return (
            0,
            format!(
                "{files}, which the page cache keeps (local files within half the available memory)"
            ),
        );
    }
    let reason = match f.remote {
        true => "each read of a remote dataset is a request",
        false => {
            "more than half the available memory: the page cache would drop each file before its next use"
        }
    };
    if cap < FLOOR {
        return (
            0,
            format!(
                "{files}; an eighth of the available memory is under {} MiB",
                FLOOR >> 20
            ),
        );
    }
    match want <= cap {
        true => (want, format!("{files} and {reason}: holds them all")),
        false => (
            cap,
            format!(
                "{files} and {reason}: an eighth of the available memory keeps about {:.0} % of them",
                cap as f64 / want as f64 * 100.0
            ),
        ),
    }
}

/// The choice for a stream of one epoch: the caches left out, off.
fn once(decoded: CacheSize, encoded: CacheSize) -> Choice {
    let off = |c: CacheSize| (c == CacheSize::Auto).then_some(0);
    let (decoded, encoded) = (off(decoded), off(encoded));
    let keys: Vec<&str> = [
        (decoded, "decoded_cache_mib = 0"),
        (encoded, "cache_mib = 0"),
    ]
    .into_iter()
    .filter_map(|(c, key)| c.map(|_| key))
    .collect();
    Choice {
        decoded,
        encoded,
        why: format!(
            "{}: a stream of one epoch reads each image once",
            keys.join(", ")
        ),
    }
}

/// `/proc/meminfo`'s `field` (`MemTotal`, `MemAvailable`), in bytes.
pub fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.split(':').next() == Some(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// What a source needs to size its caches once it has read [`SAMPLED`]
/// images: where their bytes come from, and what it saw.
#[derive(Debug)]
pub struct Sizer {
    budget: Arc<Budget>,
    uid: u32,
    whom: String,
    /// Each image read: its index, size and format, and file bytes.
    seen: Vec<(u64, Dims, u64)>,
}

impl ImagePipeline {
    /// Readies the sizing of the caches the config left out, once per
    /// source: they are sized when the pipeline has read [`SAMPLED`]
    /// images (or the whole dataset, if smaller; [module rules](self)),
    /// without a read of its own, and the cache of decoded images' bytes
    /// taken from `budget` then (none where they do not fit after all).
    pub(super) fn size_caches_later(
        &self,
        budget: &Arc<Budget>,
        (uid, whom): (u32, &str),
        epochs: Option<u64>,
    ) {
        let (decoded, encoded) = (self.rules.decoded_cache, self.rules.cache);
        if decoded != CacheSize::Auto && encoded != CacheSize::Auto {
            return;
        }
        if epochs == Some(1) {
            // Each image read once: nothing to keep it for.
            let choice = once(decoded, encoded);
            tracing::info!("{whom}: caches sized by the broker: {}", choice.why);
            let _ = self.files.sized.set(choice);
            return;
        }
        let mut sizer = self.files.sizer.lock().unwrap_or_else(|p| p.into_inner());
        if sizer.is_none() && self.files.sized.get().is_none() {
            *sizer = Some(Sizer {
                budget: budget.clone(),
                uid,
                whom: whom.to_string(),
                seen: Vec::with_capacity(SAMPLED as usize),
            });
        }
    }

    /// Notes image `index` (`dims`, `len` bytes of file) as read; sizes
    /// the caches once enough were. Nothing once they are sized.
    pub(super) fn saw(&self, index: u64, dims: Dims, len: u64) {
        let auto = [self.rules.decoded_cache, self.rules.cache].contains(&CacheSize::Auto);
        if !auto || self.files.sized.get().is_some() {
            return;
        }
        let mut slot = self.files.sizer.lock().unwrap_or_else(|p| p.into_inner());
        let Some(sizer) = slot.as_mut() else {
            return;
        };
        sizer.seen.push((index, dims, len));
        if (sizer.seen.len() as u64) < SAMPLED.min(self.dataset.len()) {
            return;
        }
        let sizer = slot.take().expect("checked above");
        drop(slot);
        self.size_caches(sizer);
    }

    /// Sizes the caches from what `sizer` saw, once per source.
    fn size_caches(&self, sizer: Sizer) {
        let files = &self.files;
        files.sized.get_or_init(|| {
            let n = sizer.seen.len() as u64;
            let images = self.dataset.len();
            let (encoded, decoded) = sizer
                .seen
                .iter()
                .fold((0u64, 0u64), |(e, d), &(i, dims, len)| {
                    (e + len, d + self.footprint(i, dims))
                });
            let facts = Facts {
                estimate: Some(Estimate {
                    images,
                    sampled: n,
                    encoded: encoded.saturating_mul(images) / n.max(1),
                    decoded: decoded.saturating_mul(images) / n.max(1),
                }),
                budget_left: sizer.budget.room_for_caches(sizer.uid),
                available: meminfo("MemAvailable"),
                remote: self.dataset.remote.is_some(),
                shared: self.share.is_some(),
            };
            let mut choice = choose(self.rules.decoded_cache, self.rules.cache, &facts);
            let whom = &sizer.whom;
            if let Some(b @ 1..) = choice.decoded {
                let what = format!("{whom} (decoded images kept)");
                match sizer.budget.take(sizer.uid, Use::KeptImages, b, &what) {
                    Ok(grant) => {
                        let _ = files.kept.set(super::kept::KeptImages::granted(grant));
                    }
                    Err(e) => {
                        choice.decoded = Some(0);
                        choice.why = format!("{}; but the budget refused it: {e}", choice.why);
                    }
                }
            }
            if let Some(b @ 1..) = choice.encoded {
                let _ = files.cache.set(super::cache::MinIoCache::new(b));
            }
            tracing::info!("{whom}: caches sized by the broker: {}", choice.why);
            choice
        });
    }

    /// What the broker chose for the caches the config left out, and why,
    /// once it did.
    pub fn caches_chosen(&self) -> Option<String> {
        self.files.sized.get().map(|c| c.why.clone())
    }

    /// The bytes image `index` takes kept at each scale [`DRAWS`] crops of
    /// it decode at.
    fn footprint(&self, index: u64, dims: Dims) -> u64 {
        let mut scales = 0u32;
        for epoch in 0..DRAWS {
            let plan = {
                let mut rng = self.transform.rng(epoch, index);
                self.transform.plan(dims.width, dims.height, &mut rng)
            };
            let denom = match (self.rules.decoded_side, dims.format) {
                (Some(_), Format::Jpeg) => self.side_scale(dims),
                (Some(_), _) => 1,
                (None, _) => self.scale_of(None, (epoch, index), dims, &plan),
            };
            scales |= denom;
        }
        [1u32, 2, 4, 8]
            .into_iter()
            .filter(|d| scales & d != 0)
            .map(|d| u64::from(dims.width.div_ceil(d)) * u64::from(dims.height.div_ceil(d)) * 3)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn facts(decoded: u64, encoded: u64) -> Facts {
        Facts {
            estimate: Some(Estimate {
                images: 1000,
                sampled: 32,
                encoded,
                decoded,
            }),
            budget_left: 4 * GIB,
            available: Some(64 * GIB),
            remote: false,
            shared: false,
        }
    }

    #[test]
    fn a_dataset_that_fits_is_kept_whole_and_its_local_files_left_to_the_page_cache() {
        let c = choose(
            CacheSize::Auto,
            CacheSize::Auto,
            &facts(800 * MIB, 100 * MIB),
        );
        assert_eq!(c.decoded, Some(900 * MIB), "{c:?}");
        assert_eq!(c.encoded, Some(0), "{c:?}");
        assert!(
            c.why.contains("holds them all") && c.why.contains("page cache"),
            "{}",
            c.why
        );
    }

    #[test]
    fn one_that_does_not_fit_takes_a_quarter_of_what_is_left_and_says_how_much_it_holds() {
        let c = choose(
            CacheSize::Auto,
            CacheSize::Auto,
            &facts(40 * GIB, 100 * MIB),
        );
        assert_eq!(c.decoded, Some(4 * GIB), "{c:?}");
        assert!(c.why.contains("about 9 %"), "{}", c.why);
        // The host's available memory bounds it too.
        let mut f = facts(40 * GIB, 100 * MIB);
        f.available = Some(8 * GIB);
        assert_eq!(
            choose(CacheSize::Auto, CacheSize::Bytes(0), &f).decoded,
            Some(2 * GIB)
        );
        // Under the floor: none.
        f.budget_left = 8 * MIB;
        let c = choose(CacheSize::Auto, CacheSize::Bytes(0), &f);
        assert_eq!((c.decoded, c.encoded), (Some(0), None), "{c:?}");
        assert!(c.why.contains("under 16 MiB"), "{}", c.why);
    }

    #[test]
    fn written_keys_win_and_a_shared_source_keeps_no_decodes_unasked() {
        let c = choose(
            CacheSize::Bytes(0),
            CacheSize::Bytes(5 * MIB),
            &facts(MIB, MIB),
        );
        assert_eq!((c.decoded, c.encoded, c.why.as_str()), (None, None, ""));
        let mut f = facts(800 * MIB, 100 * MIB);
        f.shared = true;
        let c = choose(CacheSize::Auto, CacheSize::Bytes(0), &f);
        assert_eq!(c.decoded, Some(0));
        assert!(c.why.contains("[[source]]"), "{}", c.why);
        f.estimate = None;
        f.shared = false;
        assert_eq!(
            choose(CacheSize::Auto, CacheSize::Auto, &f).decoded,
            Some(0)
        );
    }

    #[test]
    fn remote_files_and_files_past_the_page_cache_are_kept_within_an_eighth_of_memory() {
        let mut f = facts(800 * MIB, 2 * GIB);
        f.remote = true;
        let c = choose(CacheSize::Bytes(0), CacheSize::Auto, &f);
        assert_eq!(
            c.encoded,
            Some((2 * GIB + 2 * GIB / 20).div_ceil(MIB) * MIB)
        );
        assert!(c.why.contains("request"), "{}", c.why);
        // Local files larger than half the available memory.
        let f = facts(800 * MIB, 40 * GIB);
        let c = choose(CacheSize::Bytes(0), CacheSize::Auto, &f);
        assert_eq!(c.encoded, Some(8 * GIB), "{c:?}");
        assert!(c.why.contains("page cache would drop"), "{}", c.why);
    }
}
