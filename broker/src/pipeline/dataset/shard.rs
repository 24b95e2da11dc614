//! WebDataset shards: a tar's members indexed into samples (an image
//! and its `.cls` label), bad samples and a shard cut short handled as
//! `on_error` says.

use std::io::{Read, Seek};

use super::{Item, Location, SHARD_IMAGE_KEYS};

/// The sample key and extension of a member path: `dir/abc.seg.jpg` →
/// (`dir/abc`, `seg.jpg`), as WebDataset splits them.
pub(super) fn split_key(path: &str) -> (&str, &str) {
    let name_start = path.rfind('/').map_or(0, |i| i + 1);
    match path[name_start..].find('.') {
        Some(dot) => (&path[..name_start + dot], &path[name_start + dot + 1..]),
        None => (path, ""),
    }
}

/// What is wrong with a WebDataset shard (its file is named with it).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ShardError {
    #[error("not a readable tar file: {0}")]
    NotTar(std::io::Error),
    #[error("corrupt tar header: {0}")]
    Header(std::io::Error),
    #[error("bad member name: {0}")]
    MemberName(std::io::Error),
    #[error("sample `{key}` has an image but no .cls label; add one or leave the sample out")]
    NoLabel { key: String },
    #[error("{path}: a .cls label of {bytes} bytes")]
    LabelSize { path: String, bytes: u64 },
    #[error("{path}: unreadable label: {source}")]
    LabelUnreadable {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: label `{text}` is not an integer")]
    LabelNotInteger { path: String, text: String },
    #[error(
        "member `{path}` declares {bytes} bytes at offset {offset}, past the shard's end ({len} bytes): a corrupt or lying tar header (the members after it cannot be found)"
    )]
    MemberPastEnd {
        path: String,
        offset: u64,
        bytes: u64,
        len: u64,
    },
    /// The thread indexing a remote shard's parts stopped (it panicked or
    /// the runtime shut down).
    #[error("indexing stopped: {0}")]
    Stopped(#[from] tokio::task::JoinError),
}

/// A sample being read from a shard: its key, image and label so far.
struct Pending {
    key: String,
    image: Option<(u64, u64)>,
    label: Option<i64>,
}

/// Lists the samples of shard number `shard` (its members in order, a
/// sample an image and its `.cls` label) into `items`. A member whose
/// declared size runs past the shard's `len` bytes is an error, not the
/// silent end of the shard.
///
/// A sample with an image but no label is a bad sample: with `strict`
/// (`on_error = "fail"`) the shard is refused naming it, else it is left
/// out and its key returned. So is a shard cut short (a header cut, a
/// member past the end): else its samples up to the cut are kept and why
/// it was cut is returned.
pub(super) fn index_shard<R: Read + Seek>(
    file: R,
    shard: u32,
    len: u64,
    strict: bool,
    items: &mut Vec<Item>,
) -> Result<(Vec<String>, Option<String>), ShardError> {
    let ended = std::rc::Rc::new(std::cell::Cell::new(false));
    let mut archive = tar::Archive::new(Watch {
        inner: file,
        ended: ended.clone(),
    });
    let mut cur: Option<Pending> = None;
    let mut unlabelled = Vec::new();
    let entries = archive.entries_with_seek().map_err(ShardError::NotTar)?;
    let mut cut = None;
    for entry in entries {
        let mut entry = match entry {
            Ok(e) => e,
            Err(e) => {
                // Only where its bytes ran out: a read that failed (a
                // store's error) is an error, not a shorter shard.
                cut = Some(cut_short(ShardError::Header(e), strict || !ended.get())?);
                break;
            }
        };
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let path = entry
            .path()
            .map_err(ShardError::MemberName)?
            .to_string_lossy()
            .into_owned();
        let (offset, bytes) = (entry.raw_file_position(), entry.size());
        if offset.checked_add(bytes).is_none_or(|end| end > len) {
            let past = ShardError::MemberPastEnd {
                path,
                offset,
                bytes,
                len,
            };
            cut = Some(cut_short(past, strict)?);
            break;
        }
        let (key, ext) = split_key(&path);
        if cur.as_ref().is_none_or(|c| c.key != key) {
            if let Some(p) = cur.take() {
                flush(p, (shard, strict), items, &mut unlabelled)?;
            }
            cur = Some(Pending {
                key: key.to_string(),
                image: None,
                label: None,
            });
        }
        let Some(p) = cur.as_mut() else {
            continue;
        };
        match ext.to_ascii_lowercase().as_str() {
            e if SHARD_IMAGE_KEYS.contains(&e) => {
                p.image = Some((offset, bytes));
            }
            "cls" => p.label = Some(read_label(&mut entry, bytes, path)?),
            _ => {}
        }
    }
    // A sample the cut went through is left out (its label may be lost).
    if let Some(p) = cur.take().filter(|p| cut.is_none() || p.label.is_some()) {
        flush(p, (shard, strict), items, &mut unlabelled)?;
    }
    Ok((unlabelled, cut.map(|e| e.to_string())))
}

/// Lists sample `p` of `shard` into `items` if it has an image: one
/// without a label is refused if `strict`, else its key goes to `left`.
fn flush(
    p: Pending,
    (shard, strict): (u32, bool),
    items: &mut Vec<Item>,
    left: &mut Vec<String>,
) -> Result<(), ShardError> {
    let Some((offset, len)) = p.image else {
        // Samples without an image (e.g. metadata only) are not samples.
        return Ok(());
    };
    match p.label {
        Some(label) => items.push(Item {
            loc: Location::Member { shard, offset, len },
            label,
        }),
        None if strict => return Err(ShardError::NoLabel { key: p.key }),
        None => left.push(p.key),
    }
    Ok(())
}

/// A shard cut short (`e`): refused if `strict`, else why it ends there.
fn cut_short(e: ShardError, strict: bool) -> Result<ShardError, ShardError> {
    if strict { Err(e) } else { Ok(e) }
}

/// Says that `shard` was cut short (`on_error = "skip"`).
pub(super) fn warn_cut(shard: &str, why: &str) {
    tracing::warn!(
        "{shard}: cut short ({why}); its samples from there on are left out (on_error = \"skip\"): upload it whole again, or set on_error = \"fail\" to refuse a cut shard"
    );
}

/// Says once which samples `index_shard` left out for want of a label:
/// `(shard, keys)` per shard.
pub(super) fn warn_unlabelled(pattern: &str, left: &[(String, Vec<String>)]) {
    let n: usize = left.iter().map(|(_, k)| k.len()).sum();
    if let Some((shard, keys)) = left.iter().find(|(_, k)| !k.is_empty()) {
        tracing::warn!(
            "{pattern}: {n} sample(s) with an image but no .cls label left out (on_error = \"skip\"), the first `{}` in {shard}; add their labels, or set on_error = \"fail\" to refuse such shards",
            keys[0]
        );
    }
}

/// A `.cls` member's integer label (`bytes` of text, at most 64).
fn read_label(entry: &mut impl Read, bytes: u64, path: String) -> Result<i64, ShardError> {
    if bytes > 64 {
        return Err(ShardError::LabelSize { path, bytes });
    }
    let mut text = String::new();
    entry
        .take(bytes)
        .read_to_string(&mut text)
        .map_err(|e| ShardError::LabelUnreadable {
            path: path.clone(),
            source: e,
        })?;
    text.trim()
        .parse()
        .map_err(|_| ShardError::LabelNotInteger {
            path,
            text: text.trim().to_string(),
        })
}

/// A shard's reader that notes when its bytes ran out (a read of none):
/// a header cut there is a shard cut short, one cut by a failed read is
/// not.
struct Watch<R> {
    inner: R,
    ended: std::rc::Rc<std::cell::Cell<bool>>,
}

impl<R: Read> Read for Watch<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.ended.set(true);
        }
        Ok(n)
    }
}

impl<R: Seek> Seek for Watch<R> {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        self.inner.seek(to)
    }
}
