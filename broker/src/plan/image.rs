//! Planning an image source: its transform (torchvision's semantics and
//! names, checked) and its dataset's listing (ImageFolder or tar shards),
//! split over hosts.

use std::path::Path;
use std::sync::Arc;

use batchcast::DType;
use batchcast::schema::{Field, ImageSourceInfo, SourceInfo};

use super::checks::{MAX_SHUFFLE_BUFFER, MAX_SIDE, within};
use super::{ImagePlan, SourceParts, StreamError, key};
use crate::config::{PadConfig, PadFill, Padding, Size, StreamConfig, TransformConfig};
use crate::pipeline::dataset::{self, Dataset, expand_pattern};
use crate::pipeline::dataset::{DatasetError, DatasetRoot};
use crate::pipeline::sampler::{Split, Uneven};
use crate::pipeline::transform::{Border, Crop, Geometry, PaddingMode, Resize, Transform};
use crate::pipeline::{CacheSize, SampleRules};
use crate::remote::RemoteError;

fn geometry_of(t: &TransformConfig) -> Result<Geometry, StreamError> {
    let positive = |what: &'static str, (h, w): (u32, u32)| {
        if h == 0 || w == 0 {
            Err(key(what, format!("transform.{what} must be positive")))
        } else if h.max(w) > MAX_SIDE {
            Err(key(
                what,
                format!(
                    "transform.{what} = {h}×{w} is too large: at most {MAX_SIDE} pixels a side"
                ),
            ))
        } else {
            Ok((h, w))
        }
    };
    match (&t.random_resized_crop, t.resize, t.center_crop) {
        (Some(r), None, None) if t.random_crop.is_none() => {
            let ok =
                |[a, b]: [f64; 2], min: f64| a.is_finite() && b.is_finite() && a > min && a <= b;
            if !ok(r.scale, 0.0) || r.scale[1] > 1.0 {
                return Err(key(
                    "transform.random_resized_crop.scale",
                    format!(
                        "transform.random_resized_crop.scale = {:?} must be 0 < lo <= hi <= 1",
                        r.scale
                    ),
                ));
            }
            if !ok(r.ratio, 0.0) {
                return Err(key(
                    "transform.random_resized_crop.ratio",
                    format!(
                        "transform.random_resized_crop.ratio = {:?} must be 0 < lo <= hi",
                        r.ratio
                    ),
                ));
            }
            Ok(Geometry::RandomResizedCrop {
                size: positive("random_resized_crop.size", r.size.hw())?,
                scale: (r.scale[0], r.scale[1]),
                ratio: (r.ratio[0], r.ratio[1]),
            })
        }
        (None, _, _) => resize_crop(t, positive),
        (Some(_), _, _) => Err(key(
            "transform",
            "random_resized_crop takes no resize, center_crop or random_crop: use one geometry",
        )),
    }
}

/// torchvision's padding as `[left, top, right, bottom]`.
fn padding(name: &'static str, p: &Padding) -> Result<[u32; 4], StreamError> {
    let sides = match p {
        Padding::All(n) => [*n; 4],
        Padding::Sides(v) => match v.as_slice() {
            [x, y] => [*x, *y, *x, *y],
            [l, t, r, b] => [*l, *t, *r, *b],
            _ => {
                return Err(key(
                    name,
                    format!(
                        "{name} must be n, [left/right, top/bottom] or [left, top, right, bottom]"
                    ),
                ));
            }
        },
    };
    if sides.iter().any(|&n| n > MAX_SIDE) {
        return Err(key(
            name,
            format!("{name} = {sides:?}: at most {MAX_SIDE} a side"),
        ));
    }
    Ok(sides)
}

fn border(fill: PadFill, mode: PaddingMode) -> Border {
    Border {
        mode,
        fill: fill.rgb(),
    }
}

/// `Resize` and a crop: evaluation (`resize = 256`, `center_crop = 224`),
/// an exact size (`resize = [h, w]`), a random crop with padding.
fn resize_crop(
    t: &TransformConfig,
    positive: impl Fn(&'static str, (u32, u32)) -> Result<(u32, u32), StreamError>,
) -> Result<Geometry, StreamError> {
    let resize = match t.resize {
        None => None,
        Some(Size::Square(0)) => {
            return Err(key("transform.resize", "transform.resize must be positive"));
        }
        Some(Size::Square(n)) if n > MAX_SIDE => {
            return Err(key(
                "transform.resize",
                format!("transform.resize = {n} is too large: at most {MAX_SIDE} pixels"),
            ));
        }
        Some(Size::Square(n)) => Some(Resize::Shorter(n)),
        Some(size @ Size::HeightWidth(_)) => Some(Resize::Exact(positive("resize", size.hw())?)),
    };
    let crop = match (t.center_crop, &t.random_crop) {
        (Some(_), Some(_)) => {
            return Err(key("transform", "use center_crop or random_crop, not both"));
        }
        (Some(c), None) => Some(Crop::Center(positive("center_crop", c.hw())?)),
        (None, Some(r)) => Some(Crop::Random {
            size: positive("random_crop.size", r.size.hw())?,
            padding: match &r.padding {
                Some(p) => padding("transform.random_crop.padding", p)?,
                None => [0; 4],
            },
            pad_if_needed: r.pad_if_needed,
            border: border(r.fill, r.padding_mode),
        }),
        (None, None) => None,
    };
    match (resize, crop) {
        (None, None) => Err(key(
            "transform",
            "transform needs a geometry: random_resized_crop = { size = N }, resize = N with center_crop = M, resize = [h, w], or a center_crop / random_crop",
        )),
        (Some(Resize::Shorter(n)), None) => Err(key(
            "transform.resize",
            format!(
                "transform.resize = {n} alone gives images of different sizes; add center_crop or random_crop, or give resize = [h, w]"
            ),
        )),
        (resize, crop) => Ok(Geometry::ResizeCrop { resize, crop }),
    }
}

fn transform_of(s: &StreamConfig) -> Result<Transform, StreamError> {
    let Some(t) = &s.transform else {
        return Err(key(
            "transform",
            "an image source needs a [stream.transform] table (random_resized_crop, or resize + center_crop, ...)",
        ));
    };
    let geometry = geometry_of(t)?;
    if !(0.0..=1.0).contains(&t.horizontal_flip) {
        return Err(key(
            "transform.horizontal_flip",
            format!(
                "transform.horizontal_flip = {} is a probability; use 0..1",
                t.horizontal_flip
            ),
        ));
    }
    match t.dtype {
        DType::U8 | DType::F16 | DType::Bf16 | DType::F32 => {}
        other => {
            return Err(key(
                "transform.dtype",
                format!(
                    "transform.dtype = \"{other}\" is not an image type; use u8, f16, bf16 or f32"
                ),
            ));
        }
    }
    if t.dtype == DType::U8 && t.normalize.is_some() {
        return Err(key(
            "transform.normalize",
            "transform.normalize needs a float dtype (f16, bf16 or f32), not u8",
        ));
    }
    if let Some(n) = &t.normalize
        && n.std.iter().any(|&x| x == 0.0 || !x.is_finite())
    {
        return Err(key(
            "transform.normalize.std",
            format!("transform.normalize.std = {:?} must be non-zero", n.std),
        ));
    }
    let augment = super::augment::augments_of(t)?;
    let resample = super::augment::resample_of(t);
    let erasing = super::augment::erasing_of(t)?;
    let (pad, pad_border) = match &t.pad {
        Some(PadConfig::Zeros(p)) => (padding("transform.pad", p)?, Border::default()),
        Some(PadConfig::With(p)) => (
            padding("transform.pad.padding", &p.padding)?,
            border(p.fill, p.padding_mode),
        ),
        None => ([0; 4], Border::default()),
    };
    Ok(Transform {
        geometry,
        resample,
        interpolation: t.interpolation,
        pad,
        pad_border,
        augment,
        erasing,
        flip_p: t.horizontal_flip,
        dtype: t.dtype,
        layout: t.layout,
        normalize: t.normalize.as_ref().map(|n| (n.mean, n.std)),
        seed: s.seed,
    })
}

/// Lists the dataset (ImageFolder or tar shards, local or at a URL)
/// named by the config.
fn list_dataset(s: &StreamConfig) -> Result<(Dataset, Option<usize>), StreamError> {
    let text = match (&s.image_folder, &s.webdataset) {
        (Some(f), _) => f.root.clone(),
        (_, Some(w)) => w.shards.clone(),
        _ => return Err(StreamError::NoSource),
    };
    // Told apart once: everything below takes the parsed root.
    let root = DatasetRoot::parse(&text).map_err(|e| DatasetError::from(RemoteError::from(e)))?;
    if root.remote().is_none() && s.remote.is_some() {
        return Err(key(
            "remote",
            "a [stream.remote] table with a local dataset does nothing: remove it, or give the dataset as a URL (s3://, gs://, az://, http(s)://)",
        ));
    }
    if let Some(f) = &s.image_folder
        && f.manifest.is_some()
        && root.remote().is_none()
    {
        return Err(key(
            "image_folder.manifest",
            "a manifest lists a remote folder (a plain HTTP server cannot); a local folder is listed by reading it: remove the key",
        ));
    }
    let shuffle_buffer = match &s.webdataset {
        Some(w) => {
            within(
                "webdataset.shuffle_buffer",
                w.shuffle_buffer,
                1,
                MAX_SHUFFLE_BUFFER,
                "samples held to shuffle tar shards",
            )?;
            Some(w.shuffle_buffer)
        }
        None => None,
    };
    let strict = s.on_error == crate::pipeline::OnError::Fail;
    let manifest = s.image_folder.as_ref().map(|f| f.manifest.as_deref());
    let dataset = match (&root, manifest) {
        (DatasetRoot::Remote(url), Some(manifest)) => {
            dataset::remote::image_folder(url, manifest, &super::remote::settings(s, url)?)?
        }
        (DatasetRoot::Remote(url), None) => {
            dataset::remote::webdataset(url, &super::remote::settings(s, url)?, strict)?
        }
        (DatasetRoot::Local(path), Some(_)) => Dataset::image_folder(Path::new(path))?,
        (DatasetRoot::Local(shards), None) => {
            Dataset::webdataset(shards, &expand_pattern(shards)?, strict)?
        }
    };
    Ok((dataset, shuffle_buffer))
}

/// `listed`: the dataset already listed (by another stream of a shared
/// source), with its shuffle buffer.
/// How a stream's samples are read and decoded, from its keys.
fn sample_rules(s: &StreamConfig) -> SampleRules {
    SampleRules {
        on_error: s.on_error,
        max_pixels: s.max_pixels,
        max_file_bytes: s.max_file_bytes,
        reduced_decode: s.reduced_decode,
        crop_decode: s.crop_decode,
        cache: CacheSize::from_mib(s.cache_mib),
        decoded_cache: CacheSize::from_mib(s.decoded_cache_mib),
        decoded_side: s.decoded_side,
    }
}

pub(super) fn image_source(
    s: &StreamConfig,
    listed: Option<(Arc<Dataset>, Option<usize>)>,
) -> Result<SourceParts, StreamError> {
    let transform = transform_of(s)?;
    if s.world_size == 0 || s.rank >= s.world_size {
        return Err(key(
            "rank",
            format!(
                "rank = {} must be below world_size = {}",
                s.rank, s.world_size
            ),
        ));
    }
    let (dataset, shuffle_buffer) = match listed {
        Some(l) => l,
        None => {
            let (d, b) = list_dataset(s)?;
            (Arc::new(d), b)
        }
    };
    let split = Split {
        rank: s.rank,
        world_size: s.world_size,
        uneven: s.uneven,
    };
    let len = dataset.len();
    if split.uneven == Uneven::Drop && len < s.world_size {
        return Err(key(
            "world_size",
            format!(
                "{len} samples cannot be split over world_size = {} with uneven = \"drop\"",
                s.world_size
            ),
        ));
    }
    let field = |name: &str, dtype, shape, aux| Field {
        name: name.into(),
        dtype,
        shape,
        aux,
    };
    let fields = vec![
        field("image", transform.dtype, transform.shape(), false),
        field("label", DType::I64, vec![], false),
        field("index", DType::I64, vec![], true),
    ];
    let info = SourceInfo::Images(ImageSourceInfo {
        format: dataset.format.into(),
        root: dataset.root.clone(),
        classes: dataset.classes.clone(),
        dataset_len: len,
        rank: s.rank,
        world_size: s.world_size,
    });
    Ok(SourceParts {
        fields,
        len,
        per_epoch: split.per_rank(len),
        plan: Arc::new(ImagePlan {
            dataset,
            transform,
            rules: sample_rules(s),
            split,
            shuffle_buffer,
            shuffle: s.shuffle,
            seed: s.seed,
            share: None,
        }),
        info,
    })
}
