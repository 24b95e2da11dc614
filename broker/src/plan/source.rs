//! Shared sources: a `[[source]]`'s keys handed to the streams that name
//! it, and, once they are planned, the [`SharePlan`] their
//! `SourceShare` is made from when they start (`crate::pipeline::shared`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::checks::check_name;
use super::{PlanError, StreamError, StreamPlan, key};
use crate::config::{Config, Pace, SourceConfig, StreamConfig};
use crate::pipeline::CacheSize;
use crate::pipeline::shared::{MAX_MEMBERS, MemberSpec, SharePlan, ShareSeat};

/// Largest `ahead` (samples a stream may run ahead of a slower one).
pub(crate) const MAX_AHEAD: u64 = 1 << 20;

fn source_err(name: &str, message: impl Into<String>) -> PlanError {
    PlanError::Source {
        name: name.to_string(),
        message: message.into(),
    }
}

/// The streams as planned: a stream that names a source gets the
/// source's keys. Refuses an unknown source, a stream that also writes a
/// source's key, a source without a dataset or that no stream names.
pub(super) fn resolve(cfg: &Config) -> Result<Vec<StreamConfig>, PlanError> {
    let mut by_name: HashMap<&str, &SourceConfig> = HashMap::new();
    for src in &cfg.sources {
        check_name(&src.name).map_err(|e| source_err(&src.name, e.to_string()))?;
        if by_name.insert(&src.name, src).is_some() {
            return Err(source_err(&src.name, "defined twice"));
        }
        match (&src.image_folder, &src.webdataset) {
            (Some(_), None) | (None, Some(_)) => {}
            _ => {
                return Err(source_err(
                    &src.name,
                    "needs exactly one dataset: a [source.image_folder] or a [source.webdataset] table (synthetic streams have nothing to share)",
                ));
            }
        }
    }
    let mut used = HashSet::new();
    let mut out = Vec::with_capacity(cfg.streams.len());
    for s in &cfg.streams {
        let Some(name) = &s.source else {
            out.push(s.clone());
            continue;
        };
        let stream_err = |error| PlanError::Stream {
            stream: s.name.clone(),
            error,
        };
        let Some(src) = by_name.get(name.as_str()) else {
            let mut known: Vec<&str> = by_name.keys().copied().collect();
            known.sort_unstable();
            return Err(stream_err(key(
                "source",
                format!(
                    "source = \"{name}\" names no [[source]] (defined: {})",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ),
            )));
        };
        if let Some(k) = s.own_source_keys.first() {
            return Err(stream_err(key(
                "source",
                format!(
                    "`{k}` belongs to its source: a stream with source = \"{name}\" takes {} from the [[source]] table; move it there",
                    s.own_source_keys.join(", ")
                ),
            )));
        }
        if s.synthetic.is_some() {
            return Err(stream_err(StreamError::ManySources));
        }
        used.insert(name.as_str());
        out.push(s.with_source_keys(src));
    }
    if let Some(src) = cfg.sources.iter().find(|s| !used.contains(s.name.as_str())) {
        return Err(source_err(
            &src.name,
            "no stream names it; add source = \"NAME\" to a [[stream]], or remove the [[source]]",
        ));
    }
    Ok(out)
}

/// Gives the streams of each source (`streams[i]` planned as `plans[i]`)
/// their seat on its [`SharePlan`].
pub(super) fn attach(
    cfg: &Config,
    streams: &[StreamConfig],
    plans: &mut [StreamPlan],
) -> Result<(), PlanError> {
    for src in &cfg.sources {
        let members: Vec<usize> = streams
            .iter()
            .enumerate()
            .filter(|(_, s)| s.source.as_deref() == Some(src.name.as_str()))
            .map(|(i, _)| i)
            .collect();
        if members.len() > MAX_MEMBERS {
            return Err(source_err(
                &src.name,
                format!(
                    "{} streams name it; at most {MAX_MEMBERS} streams share a source",
                    members.len()
                ),
            ));
        }
        let largest_batch = members
            .iter()
            .map(|&i| plans[i].schema.batch_size)
            .max()
            .unwrap_or(1);
        let window = match src.ahead {
            Some(a) if a < largest_batch || a > MAX_AHEAD => {
                return Err(source_err(
                    &src.name,
                    format!(
                        "ahead = {a} must be at least its largest batch ({largest_batch} samples) and at most {MAX_AHEAD}"
                    ),
                ));
            }
            Some(a) => a,
            None => members
                .iter()
                .map(|&i| plans[i].schema.batch_size * plans[i].workers as u64 * 4)
                .max()
                .unwrap_or(1)
                .min(MAX_AHEAD),
        };
        let specs = members
            .iter()
            .map(|&i| match plans[i].source.images() {
                Some(p) => Ok(MemberSpec {
                    stream: plans[i].name.clone(),
                    transform: p.transform.clone(),
                    decoupled: plans[i].pace == Pace::Decoupled,
                }),
                None => Err(source_err(&src.name, "only image streams share a source")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let source = Arc::new(SharePlan {
            name: src.name.clone(),
            policy: src.decode,
            window,
            budget: src.decoded_mib.saturating_mul(1 << 20),
            members: specs,
            cache: CacheSize::from_mib(src.cache_mib),
            decoded_cache: CacheSize::from_mib(src.decoded_cache_mib),
        });
        for (member, &i) in members.iter().enumerate() {
            // Planned just now: no other handle to the source yet, and
            // every member is an image stream (checked above).
            let p = Arc::get_mut(&mut plans[i].source)
                .and_then(|s| s.images_mut())
                .ok_or_else(|| source_err(&src.name, "a member's plan is already shared"))?;
            p.share = Some(ShareSeat {
                source: source.clone(),
                member,
            });
        }
    }
    Ok(())
}

/// `true` if `a` and `b` are one dataset's listing (streams of a source
/// list it once).
pub(super) fn same_listing(a: &StreamConfig, b: &StreamConfig) -> bool {
    a.source.is_some() && a.source == b.source
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn parse(text: &str) -> Config {
        Config::parse(text, Path::new("test.toml")).unwrap()
    }

    const SOURCE: &str = r#"
[[source]]
name = "photos"
[source.image_folder]
root = "/nonexistent"
"#;

    fn stream(name: &str, extra: &str) -> String {
        format!(
            "[[stream]]\nname = \"{name}\"\nsource = \"photos\"\nbatch_size = 4\n{extra}\n[stream.transform]\nrandom_resized_crop = {{ size = 8 }}\n"
        )
    }

    #[test]
    fn streams_take_the_sources_keys_and_may_not_write_them() {
        let cfg = parse(&format!(
            "{}\n[[source]]\nname = \"photos\"\nshuffle = false\nseed = 9\n[source.image_folder]\nroot = \"/x\"\n",
            stream("a", "")
        ));
        let s = resolve(&cfg).unwrap();
        assert!(!s[0].shuffle && s[0].seed == 9 && s[0].image_folder.is_some());

        let cfg = parse(&format!(
            "{SOURCE}\n{}",
            stream("a", "seed = 3\nshuffle = true")
        ));
        let e = resolve(&cfg).unwrap_err().to_string();
        assert!(
            e.contains("stream `a`") && e.contains("`shuffle`") || e.contains("`seed`"),
            "{e}"
        );
        assert!(e.contains("move it there"), "{e}");
    }

    #[test]
    fn unknown_unused_duplicate_and_datasetless_sources_are_refused() {
        let cfg = parse(&stream("a", ""));
        let e = resolve(&cfg).unwrap_err().to_string();
        assert!(e.contains("names no [[source]] (defined: none)"), "{e}");

        let cfg = parse(&format!(
            "{SOURCE}\n[[source]]\nname = \"other\"\n[source.image_folder]\nroot = \"/y\"\n{}",
            stream("a", "")
        ));
        let e = resolve(&cfg).unwrap_err().to_string();
        assert!(e.contains("source `other`: no stream names it"), "{e}");

        let cfg = parse(&format!("{SOURCE}{SOURCE}{}", stream("a", "")));
        assert!(
            resolve(&cfg)
                .unwrap_err()
                .to_string()
                .contains("defined twice")
        );

        let cfg = parse(&format!(
            "[[source]]\nname = \"photos\"\n{}",
            stream("a", "")
        ));
        let e = resolve(&cfg).unwrap_err().to_string();
        assert!(e.contains("needs exactly one dataset"), "{e}");
    }
}
