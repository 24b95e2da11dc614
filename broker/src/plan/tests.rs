//! Planning configs and producer requests: defaults, every refusal names
//! its culprit, bounds, and a config of only `[broker]`.
use std::path::Path;

use batchcast::DType;

use super::*;
use crate::config::StreamToml;

/// A minimal valid config: one synthetic stream of 10 samples.
fn good() -> String {
    StreamToml::synthetic("train", 4, 10, &[("x", "f32", &[3])])
        .epochs(2)
        .to_toml()
}

fn plan(text: &str) -> Result<Vec<StreamPlan>, PlanError> {
    plan_config(&Config::parse(text, Path::new("test.toml")).unwrap())
}

#[test]
fn a_minimal_config_gets_documented_defaults() {
    let plans = plan(&good()).unwrap();
    let p = &plans[0];
    // The ring holds 4 × the batch size with a window of 2: (2 + 1) ×
    // (⌈15 / 4⌉ + 1) = 15 units.
    assert_eq!(
        (p.slots, p.gpu_slots, p.min_consumers, p.lag_limit),
        (15, 15, 1, None)
    );
    assert_eq!(p.source.kind(), "synthetic");
    let SourceInfo::Synthetic(spec) = p.schema.source else {
        panic!("a synthetic source")
    };
    assert!(spec.shuffle, "shuffled by default");
    // Every sample is made, the last unit short; consumers drop it only
    // if they choose to (the stream's drop_last, false, is their default).
    assert_eq!(p.schema.batches_per_epoch, 3, "10 samples in units of 4");
    assert_eq!(p.schema.samples_per_epoch, 10);
    assert!(!p.drop_last);
    let dropping = good().replace("epochs = 2", "epochs = 2\ndrop_last = true");
    let p = &plan(&dropping).unwrap()[0];
    assert_eq!((p.schema.batches_per_epoch, p.drop_last), (3, true));
    // Fewer samples than a batch: fine unless consumers drop short batches
    // by default (they would get none).
    assert!(plan(&good().replace("len = 10", "len = 3")).is_ok());
    let err = plan(&dropping.replace("len = 10", "len = 3")).unwrap_err();
    assert!(err.to_string().contains("fewer than one batch"), "{err}");
}

#[test]
fn a_typo_names_the_key_and_line() {
    let err = Config::parse(
        &good().replace("batch_size", "batch_szie"),
        Path::new("t.toml"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("batch_szie") && err.contains("line 3"),
        "{err}"
    );
}

#[test]
fn semantic_errors_name_the_stream_and_what_to_do() {
    for (from, to, expect, culprit) in [
        (
            "epochs = 2",
            "epochs = 2\nlag_limit = 8",
            "lag_limit = 8",
            Some("lag_limit"),
        ),
        ("shape = [3]", "shape = [0]", "zero dimension", None),
        (
            "epochs = 2",
            "epochs = 2\nslots = 1",
            "slots = 1",
            Some("slots"),
        ),
        (
            "epochs = 2",
            "epochs = 2\ngpu_slots = 1",
            "gpu_slots = 1 is too few",
            Some("gpu_slots"),
        ),
        (
            "name = \"train\"",
            "name = \"a b\"",
            "name must",
            Some("name"),
        ),
    ] {
        let err = plan(&good().replace(from, to)).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(expect) && text.contains("stream `"), "{text}");
        if let Some(culprit) = culprit {
            assert!(
                matches!(&err, PlanError::Stream { error: StreamError::Key { key, .. }, .. } if *key == culprit),
                "{err:?}"
            );
        }
    }
    let twice = format!("{}\n{}", good(), good());
    assert!(
        plan(&twice)
            .unwrap_err()
            .to_string()
            .contains("defined twice")
    );
}

#[test]
fn the_ring_is_sized_for_max_batch_size_and_refuses_fewer_slots() {
    let with = |extra: &str| plan(&good().replace("epochs = 2", &format!("epochs = 2\n{extra}")));
    // Batches of 10 over units of 4, window 2: (2 + 1) × (⌈9 / 4⌉ + 1).
    assert_eq!(with("max_batch_size = 10").unwrap()[0].slots, 12);
    // Never below the default; an explicit larger ring stays.
    assert_eq!(with("max_batch_size = 4").unwrap()[0].slots, 8);
    assert_eq!(
        with("max_batch_size = 10\nslots = 20").unwrap()[0].slots,
        20
    );
    assert_eq!(with("slots = 4").unwrap()[0].slots, 4);
    for (extra, culprit, expect) in [
        (
            "max_batch_size = 10\nslots = 4",
            "slots",
            "fewer than the 12",
        ),
        ("max_batch_size = 100000", "max_batch_size", "more than"),
        ("max_batch_size = 0", "max_batch_size", "out of range"),
    ] {
        let err = with(extra).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(expect), "{text}");
        assert!(
            matches!(&err, PlanError::Stream { error: StreamError::Key { key, .. }, .. } if *key == culprit),
            "{err:?}"
        );
    }
    // The default multiple shrinks to fit a quarter of the memory budget:
    // units of 1 MiB, a 40 MiB budget: 4 × (15 slots) and 3 × (12) do
    // not fit in 10 MiB, 2 × (9) does; nothing fits: the old default.
    let mib = 1 << 20;
    assert_eq!(super::ring_slots(4, None, None, mib, u64::MAX).unwrap(), 15);
    assert_eq!(super::ring_slots(4, None, None, mib, 40 * mib).unwrap(), 9);
    assert_eq!(super::ring_slots(4, None, None, mib, mib).unwrap(), 8);
}

#[test]
fn decoupled_pace_takes_its_run_ahead_budget_in_memory() {
    // Batches of 4 × 3 f32: 48 bytes; 1 MiB holds 21845 of them, more than
    // a ring may: refused, naming the most it may be.
    let decoupled = |extra: &str| {
        plan(&good().replace(
            "epochs = 2",
            &format!("epochs = 2\npace = \"decoupled\"\n{extra}"),
        ))
    };
    let p = &decoupled("").unwrap()[0];
    assert_eq!((p.pace, p.slots), (Pace::Decoupled, 15));
    assert_eq!(p.hold_limit, Some(crate::plan::DEFAULT_HOLD_LIMIT));
    let p = &decoupled("hold_limit_s = 2.5").unwrap()[0];
    assert_eq!(p.hold_limit, Some(std::time::Duration::from_millis(2500)));
    // Lockstep is bounded by default too; `inf` lifts the bound.
    let lockstep =
        |extra: &str| plan(&good().replace("epochs = 2", &format!("epochs = 2\n{extra}")));
    assert_eq!(
        lockstep("").unwrap()[0].hold_limit,
        Some(crate::plan::DEFAULT_HOLD_LIMIT)
    );
    assert_eq!(
        lockstep("hold_limit_s = 5").unwrap()[0].hold_limit,
        Some(std::time::Duration::from_secs(5))
    );
    assert_eq!(lockstep("hold_limit_s = inf").unwrap()[0].hold_limit, None);
    let err = decoupled("run_ahead_mib = 1").unwrap_err().to_string();
    assert!(
        err.contains("run_ahead_mib = 1 holds 21845 batches"),
        "{err}"
    );
    // A bigger batch: 4 × 65536 f32 = 1 MiB a batch.
    let big = good().replace("shape = [3]", "shape = [65536]").replace(
        "epochs = 2",
        "epochs = 2\npace = \"decoupled\"\nrun_ahead_mib = 64",
    );
    assert_eq!(plan(&big).unwrap()[0].slots, 64);
    let err = plan(&big.replace("run_ahead_mib = 64", "run_ahead_mib = 1"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fewer than 2 batches") && err.contains("at least 2"),
        "{err}"
    );
    for (extra, culprit, expect) in [
        (
            "run_ahead_mib = 64",
            "run_ahead_mib",
            "pace = \"decoupled\" only",
        ),
        (
            "pace = \"decoupled\"\nhold_limit_s = 0",
            "hold_limit_s",
            "use 0.1 to 86400",
        ),
        ("hold_limit_s = -inf", "hold_limit_s", "or inf for no bound"),
        ("hold_limit_s = nan", "hold_limit_s", "use 0.1 to 86400"),
    ] {
        let err = plan(&good().replace("epochs = 2", &format!("epochs = 2\n{extra}"))).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(expect), "{text}");
        assert!(
            matches!(&err, PlanError::Stream { error: StreamError::Key { key, .. }, .. } if *key == culprit),
            "{err:?}"
        );
    }
    let err = Config::parse(
        &good().replace("epochs = 2", "epochs = 2\npace = \"sometimes\""),
        Path::new("t.toml"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("sometimes") && err.contains("lockstep"),
        "{err}"
    );
}

#[test]
fn every_numeric_key_is_bounded_and_the_error_names_key_and_limit() {
    for (key, extra, limit) in [
        ("workers", "workers = 100000", "256"),
        ("batch_size", "", "1048576"),
        ("min_consumers", "min_consumers = 5000", "1024"),
        ("gpu_slots", "gpu_slots = 20000", "16384"),
        ("max_pixels", "max_pixels = 10000000000", "4294967296"),
        ("world_size", "world_size = 2000000", "1048576"),
        ("synthetic.len", "", "134217728"),
    ] {
        let text = match key {
            "batch_size" => good().replace("batch_size = 4", "batch_size = 2000000"),
            "synthetic.len" => good().replace("len = 10", "len = 200000000"),
            _ => good().replace("epochs = 2", &format!("epochs = 2\n{extra}")),
        };
        let err = plan(&text).unwrap_err();
        let PlanError::Stream {
            error: StreamError::Key { key: k, message },
            ..
        } = &err
        else {
            panic!("{key}: {err:?}")
        };
        assert_eq!(*k, key, "{message}");
        assert!(message.contains(limit), "{key}: {message}");
    }
}

#[test]
fn a_config_of_only_the_broker_section_plans_no_stream() {
    let cfg = Config::parse("[broker]\nallow_uids = [1234]\n", Path::new("b.toml")).unwrap();
    assert_eq!(cfg.broker.allow_uids, [1234]);
    assert!(plan_config(&cfg).unwrap().is_empty());
}

/// `allow_groups` names groups this host knows (root's is 0 everywhere);
/// one it does not know stops the broker at start, named.
#[test]
fn allow_groups_are_looked_up_by_name_and_an_unknown_one_is_refused() {
    let cfg = Config::parse(
        "[broker]\nallow_gids = [4321]\nallow_groups = [\"root\"]\n",
        Path::new("b.toml"),
    )
    .unwrap();
    assert_eq!(plan_broker(&cfg.broker).unwrap().allow_gids, [0, 4321]);
    let cfg = Config::parse(
        "[broker]\nallow_groups = [\"no-such-group-here\"]\n",
        Path::new("b.toml"),
    )
    .unwrap();
    let err = plan_broker(&cfg.broker).unwrap_err().to_string();
    assert!(
        err.contains("no group named `no-such-group-here`") && err.contains("groupadd"),
        "{err}"
    );
}

#[test]
fn keeping_the_last_short_batch() {
    let plans = plan(&good().replace("epochs = 2", "epochs = 2\ndrop_last = false")).unwrap();
    assert_eq!(plans[0].schema.batches_per_epoch, 3);
    assert_eq!(plans[0].schema.samples_per_epoch, 10);
}

#[test]
fn a_producer_request_is_checked_like_a_config() {
    let field = Field {
        name: "x".into(),
        dtype: DType::U8,
        shape: vec![4],
        aux: false,
    };
    let mut req = ProduceRequest::new("ext", vec![field], 8, 3);
    let p = StreamPlan::external(&req, "loader", 7).unwrap();
    assert_eq!((p.slots, p.workers, p.schema.samples_per_epoch), (4, 0, 24));
    assert_eq!(p.hold_limit, Some(crate::plan::DEFAULT_HOLD_LIMIT));
    req.hold_limit_ms = Some(1500);
    let p = StreamPlan::external(&req, "loader", 7).unwrap();
    assert_eq!(p.hold_limit, Some(std::time::Duration::from_millis(1500)));
    for ms in [0, 99, 86_400_001] {
        req.hold_limit_ms = Some(ms);
        let err = StreamPlan::external(&req, "loader", 7).unwrap_err();
        assert!(
            matches!(
                err,
                StreamError::Key {
                    key: "hold_limit_ms",
                    ..
                }
            ) && err.to_string().contains("use 100 to 86400000"),
            "{err}"
        );
    }
    req.hold_limit_ms = None;
    req.slots = 1;
    let err = StreamPlan::external(&req, "loader", 7).unwrap_err();
    assert!(
        matches!(err, StreamError::Key { key: "slots", .. }),
        "{err}"
    );
    req.slots = 4;
    req.stream = "a/b".into();
    let err = StreamPlan::external(&req, "loader", 7).unwrap_err();
    assert!(
        matches!(err, StreamError::Key { key: "name", .. })
            && err.to_string().contains("only letters"),
        "{err}"
    );
}

#[test]
fn augmentations_are_checked_and_named() {
    let with = |aug: &str| {
        format!(
            "[[stream]]\nname = \"aug\"\nbatch_size = 4\n[stream.image_folder]\nroot = \"/nonexistent\"\n[stream.transform]\nrandom_resized_crop = {{ size = 32 }}\n{aug}\n"
        )
    };
    for (aug, expect) in [
        (
            "vertical_flip = 1.5",
            "transform.vertical_flip = 1.5 is a probability",
        ),
        (
            "grayscale = -0.1",
            "transform.grayscale = -0.1 is a probability",
        ),
        (
            "color_jitter = { hue = 0.6 }",
            "transform.color_jitter.hue must be an amount in 0..0.5",
        ),
        (
            "color_jitter = { brightness = [1.5, 1.2] }",
            "transform.color_jitter.brightness must be",
        ),
        (
            "color_jitter = { contrast = -0.2 }",
            "transform.color_jitter.contrast must be",
        ),
        (
            "trivial_augment_wide = true\nauto_augment = \"imagenet\"",
            "at most one of trivial_augment_wide, rand_augment and auto_augment",
        ),
        (
            "rand_augment = { magnitude = 31 }",
            "magnitude = 31 must be below num_magnitude_bins = 31",
        ),
        (
            "rand_augment = { num_ops = 99 }",
            "num_ops = 99 is more than 16",
        ),
        (
            "trivial_augment_wide = { num_magnitude_bins = 1 }",
            "num_magnitude_bins = 1 must be between 2 and 1024",
        ),
        ("auto_augment = \"cifar10\"", "is not a policy here"),
        (
            "random_erasing = { value = \"random\" }\ndtype = \"u8\"",
            "draws normal noise in the tensor's units, which a u8 tensor cannot hold",
        ),
        (
            "random_erasing = { value = \"noise\" }",
            "value = \"noise\" is not a value; use a number, [r, g, b] or \"random\"",
        ),
        (
            "random_erasing = { value = 0.5 }\ndtype = \"u8\"",
            "whole numbers in 0..255 for a u8 tensor",
        ),
        (
            "random_erasing = { scale = [0.5, 0.1] }",
            "random_erasing.scale = [0.5, 0.1] must be",
        ),
        (
            "random_erasing = { p = 2 }",
            "random_erasing.p = 2 is a probability",
        ),
    ] {
        let err = plan(&with(aug)).unwrap_err().to_string();
        assert!(
            err.contains("stream `aug`") && err.contains(expect),
            "{aug}: {err}"
        );
    }
    // Valid ones get as far as listing the (missing) dataset.
    for aug in [
        "trivial_augment_wide = true",
        "trivial_augment_wide = false\nrand_augment = {}",
        "color_jitter = { brightness = 0.4, saturation = [0.5, 1.0], hue = [-0.1, 0.2] }\ngrayscale = 0.1\nvertical_flip = 0.5",
        "auto_augment = \"imagenet\"",
        "auto_augment = { policy = \"imagenet\", interpolation = \"bilinear\", fill = 7 }",
        "trivial_augment_wide = { num_magnitude_bins = 15, interpolation = \"bicubic\" }",
        "random_erasing = { p = 0.25, value = [0.1, 0.2, 0.3] }",
        "random_erasing = {}\ndtype = \"u8\"",
        "random_erasing = { value = \"random\" }\ndtype = \"bf16\"",
        "gaussian_blur = { kernel_size = 23, p = 0.5 }\ncolor_jitter = { brightness = 0.4, p = 0.8 }",
    ] {
        let err = plan(&with(aug)).unwrap_err().to_string();
        assert!(err.contains("/nonexistent"), "{aug}: {err}");
    }
}

#[test]
fn resize_and_crop_combinations_are_checked() {
    let with = |t: &str| {
        format!(
            "[[stream]]\nname = \"geo\"\nbatch_size = 4\n[stream.image_folder]\nroot = \"/nonexistent\"\n[stream.transform]\n{t}\n"
        )
    };
    for (t, expect) in [
        (
            "resize = 64",
            "resize = 64 alone gives images of different sizes",
        ),
        (
            "center_crop = 8\nrandom_crop = { size = 8 }",
            "use center_crop or random_crop, not both",
        ),
        ("horizontal_flip = 0.5", "transform needs a geometry"),
        ("resize = [0, 8]", "transform.resize must be positive"),
        (
            "resize = [8, 8]\ninterpolation = \"cubic\"",
            "unknown variant `cubic`, expected one of `nearest`, `bilinear`, `bicubic`",
        ),
        (
            "center_crop = 8\npad = { padding = 2, padding_mode = \"wrap\" }",
            "pad = n, [lr, tb], [l, t, r, b], or { padding = ..., fill = 0 or [r, g, b], padding_mode",
        ),
        (
            "center_crop = 8\npad = { padding = [1, 2, 3], fill = 9 }",
            "transform.pad.padding must be n, [left/right, top/bottom] or [left, top, right, bottom]",
        ),
        (
            "random_crop = { size = 8, fill = 256 }",
            "fill = a pixel level 0..255 for every channel, or [r, g, b]",
        ),
        (
            "random_crop = { size = 8, padding_mode = \"mirror\" }",
            "unknown variant `mirror`, expected one of `constant`, `edge`, `reflect`, `symmetric`",
        ),
    ] {
        // Unknown names and shapes fail as the file is read, the rest when
        // it is planned; both name the key.
        let err = match Config::parse(&with(t), Path::new("test.toml")) {
            Ok(c) => plan_config(&c).unwrap_err().to_string(),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(expect), "{t}: {err}");
    }
    for t in [
        "resize = [32, 48]",
        "center_crop = 24",
        "random_crop = { size = 32, padding = 4 }",
        "random_crop = { size = [32, 16], padding = [1, 2], pad_if_needed = true }\npad = 2",
        "resize = 40\nrandom_crop = { size = 32 }",
        "resize = [32, 48]\ninterpolation = \"bicubic\"",
        "random_resized_crop = { size = 32 }\ninterpolation = \"lanczos\"",
        "random_crop = { size = 32, padding = 4, fill = [1, 2, 3], padding_mode = \"reflect\" }",
        "center_crop = 24\npad = { padding = [1, 2], fill = 7, padding_mode = \"symmetric\" }",
        "center_crop = 24\npad = { padding = 3 }",
    ] {
        let err = plan(&with(t)).unwrap_err().to_string();
        assert!(err.contains("/nonexistent"), "{t}: {err}");
    }
}

#[test]
fn automatic_augmentations_carry_their_interpolation_and_fill() {
    use crate::config::TransformConfig;
    use crate::pipeline::augment::{AffineFilter, Resample};
    let resample = |aug: &str| {
        let t = format!("random_resized_crop = {{ size = 8 }}\n{aug}");
        let t: TransformConfig = toml::from_str(&t).unwrap_or_else(|e| panic!("{aug}: {e}"));
        super::augment::resample_of(&t)
    };
    assert_eq!(resample("trivial_augment_wide = true"), Resample::default());
    assert_eq!(resample(""), Resample::default());
    assert_eq!(
        resample("trivial_augment_wide = { interpolation = \"bilinear\", fill = 128 }"),
        Resample {
            filter: AffineFilter::Bilinear,
            fill: [128; 3]
        }
    );
    assert_eq!(
        resample("rand_augment = { magnitude = 9, interpolation = \"bicubic\", fill = [1, 2, 3] }"),
        Resample {
            filter: AffineFilter::Bicubic,
            fill: [1, 2, 3]
        }
    );
    assert_eq!(
        resample("auto_augment = { policy = \"imagenet\", fill = [124, 116, 104] }"),
        Resample {
            filter: AffineFilter::Nearest,
            fill: [124, 116, 104]
        }
    );
    // Pillow's transform has no other filters; unknown keys are named.
    for (aug, expect) in [
        (
            "trivial_augment_wide = { interpolation = \"lanczos\" }",
            "trivial_augment_wide = true, false or { num_magnitude_bins = 31, interpolation",
        ),
        (
            "rand_augment = { interpolation = \"lanczos\" }",
            "unknown variant `lanczos`, expected one of `nearest`, `bilinear`, `bicubic`",
        ),
        (
            "auto_augment = { policy = \"imagenet\", fil = 3 }",
            "auto_augment = \"imagenet\" or { policy = \"imagenet\", interpolation",
        ),
    ] {
        let t = format!("random_resized_crop = {{ size = 8 }}\n{aug}");
        let err = toml::from_str::<TransformConfig>(&t)
            .unwrap_err()
            .to_string();
        assert!(err.contains(expect), "{aug}: {err}");
    }
}
