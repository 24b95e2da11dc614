//! End-to-end tests of trainers that differ in batch size: the real broker,
//! real consumer processes each asking for its own batch size, real shared
//! memory. Each consumer must get every sample of every epoch once, in the
//! stream's order, with the bytes every other consumer got, and nothing a
//! killed or careless consumer does may change that for the others.

use std::time::{Duration, Instant};

use batchcast_broker::config::StreamToml;
use batchcast_cli::report::ConsumerReport;

use crate::common;

use common::{Env, LIMIT, report};

/// 1000 samples a epoch in production units of 40: the label ring (1536
/// cells) and the weights ring (2048) are not multiples of the unit, so
/// units straddle those rings' wraps, and consumer batches straddle them
/// too; 28 slots hold batches of up to 256 with a window of 2.
pub(crate) fn config(extra: &str) -> String {
    let fields: [(&str, &str, &[u64]); 3] = [
        ("image", "u8", &[3, 16, 16]),
        ("label", "i64", &[]),
        ("weights", "f32", &[5]),
    ];
    StreamToml::synthetic("train", 40, 1000, &fields)
        .key("seed", 5)
        .key("slots", 28)
        .key("workers", 2)
        .key("shuffle", true)
        .raw(extra)
        .to_toml()
}

fn digests(r: &ConsumerReport) -> Vec<Option<String>> {
    r.epochs.iter().map(|e| e.digest.clone()).collect()
}

#[test]
fn consumers_of_mixed_batch_sizes_each_get_every_sample_once_and_a_killed_one_changes_nothing() {
    let sizes: [u64; 7] = [1, 7, 32, 40, 64, 96, 256];
    // Seven that finish, and one that is SIGKILLed holding batches.
    let env = Env::start(&config("epochs = 3\nmin_consumers = 8"));
    let kids: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let (name, b) = (format!("b{b}"), b.to_string());
            let mut args = vec!["--verify", "--digest", "--batch-size", &b, "--name", &name];
            if i % 2 == 1 {
                args.push("--no-mailbox");
            }
            env.consumer(&args)
        })
        .collect();
    let mut victim = env.consumer(&[
        "--batch-size",
        "13",
        "--hold",
        "2",
        "--sleep-ms",
        "2",
        "--name",
        "victim",
    ]);
    let s = env.wait_for("the victim to read a few batches", |s| {
        s.streams[0]
            .consumers
            .iter()
            .any(|c| c.name == "victim" && c.delivered >= 5)
    });
    let sizes_seen: Vec<(String, u64, u32)> = s.streams[0]
        .consumers
        .iter()
        .map(|c| (c.name.clone(), c.batch_size, c.window))
        .collect();
    assert!(
        sizes_seen.contains(&("victim".into(), 13, 2))
            && sizes_seen.contains(&("b256".into(), 256, 2)),
        "stats show each consumer's own batch size and window: {sizes_seen:?}"
    );
    common::sigkill(&mut victim);
    let reports: Vec<ConsumerReport> = kids.into_iter().map(report).collect();
    for (r, &b) in reports.iter().zip(&sizes) {
        assert!(r.ok && r.ended, "{r:#?}");
        assert_eq!(r.verified_samples, 3000, "batch size {b}");
        assert_eq!(r.views_outside_arena, 0, "batch size {b}: a view is a copy");
        assert_eq!(r.batches, 3 * 1000u64.div_ceil(b), "batch size {b}");
        assert_eq!(
            r.epochs
                .iter()
                .map(|e| (e.epoch, e.samples, e.complete))
                .collect::<Vec<_>>(),
            vec![(0, 1000, true), (1, 1000, true), (2, 1000, true)],
            "batch size {b}"
        );
        assert_eq!(
            digests(r),
            digests(&reports[0]),
            "batch size {b}: the same bytes as batches of 1"
        );
    }
    let s = env.wait_for("the killed consumer to be gone", |s| {
        s.streams[0].consumers.is_empty()
    });
    let st = &s.streams[0];
    assert_eq!(
        st.batches_produced,
        3 * 25,
        "each unit made once, whatever the consumers' sizes"
    );
    assert_eq!(st.in_use, 0, "every slot came back: {st:#?}");
}

#[test]
fn drop_last_drops_only_a_short_last_batch() {
    let env = Env::start(&config("epochs = 2\nmin_consumers = 2"));
    let keep = env.consumer(&["--verify", "--batch-size", "96", "--name", "keep"]);
    let drop = env.consumer(&[
        "--verify",
        "--batch-size",
        "96",
        "--drop-last",
        "--name",
        "drop",
    ]);
    let (keep, drop) = (report(keep), report(drop));
    assert!(keep.ok && drop.ok, "{keep:#?} {drop:#?}");
    // 1000 = 10 × 96 + 40.
    assert_eq!((keep.batches, keep.samples), (2 * 11, 2000));
    assert_eq!((drop.batches, drop.samples), (2 * 10, 2 * 960));
    assert_eq!(drop.verified_samples, 1920, "the first 960 of each epoch");
}

/// The stream makes every sample of every epoch (1000 in units of 64:
/// the last unit holds 40): what is dropped is each consumer's choice,
/// and the stream's `drop_last` is only the default of those that do not
/// choose.
#[test]
fn every_consumer_gets_the_epochs_tail_unless_it_drops_it_itself() {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 16, 16]), ("label", "i64", &[])];
    let env = Env::start(
        &StreamToml::synthetic("train", 64, 1000, &fields)
            .key("seed", 5)
            .key("slots", 16)
            .key("workers", 2)
            .key("epochs", 2)
            .key("drop_last", true)
            .key("min_consumers", 4)
            .to_toml(),
    );
    let run = |name: &str, extra: &[&str]| {
        let mut args = vec!["--verify", "--name", name];
        args.extend_from_slice(extra);
        env.consumer(&args)
    };
    let own = run("own32", &["--batch-size", "32", "--drop-last=false"]);
    let default = run("default32", &["--batch-size", "32"]);
    let unit = run("unit", &["--drop-last=false"]);
    let unit_default = run("unit-default", &[]);
    let (own, default, unit, unit_default) = (
        report(own),
        report(default),
        report(unit),
        report(unit_default),
    );
    for r in [&own, &default, &unit, &unit_default] {
        assert!(r.ok && r.ended && r.verified_samples == r.samples, "{r:#?}");
        assert!(r.order_errors.is_empty(), "{:?}", r.order_errors);
    }
    // Its own choice: every sample, the last batch short (1000 = 31 × 32 + 8).
    assert_eq!((own.batches, own.samples), (2 * 32, 2000));
    // The stream's default (drop_last = true): 31 batches of 32.
    assert_eq!((default.batches, default.samples), (2 * 31, 2 * 992));
    // At the stream's own batch size: 15 × 64 + 40.
    assert_eq!((unit.batches, unit.samples), (2 * 16, 2000));
    assert_eq!(
        (unit_default.batches, unit_default.samples),
        (2 * 15, 2 * 960)
    );
    let s = env.stats();
    assert_eq!(
        s.streams[0].batches_produced,
        2 * 16,
        "the short unit is made"
    );
}

/// A stream sizes its ring for the batch sizes it will be asked: by
/// default a few times its own (no `slots` to compute by hand), with
/// `max_batch_size` for exactly that; beyond it the refusal stays.
#[test]
fn a_stream_sizes_its_ring_for_the_batch_sizes_it_will_be_asked() {
    let fields: [(&str, &str, &[u64]); 1] = [("x", "u8", &[16])];
    let stream = |name: &str, extra: &str| {
        StreamToml::synthetic(name, 8, 256, &fields)
            .key("epochs", 1)
            .raw(extra)
            .to_toml()
    };
    let env = Env::start(&format!(
        "{}{}",
        stream("train", ""),
        stream("grid", "max_batch_size = 64")
    ));
    // The default ring takes 4 × its batch size (32 with a window of 2).
    let r = report(env.consumer(&["--verify", "--batch-size", "32", "--name", "b32"]));
    assert!(
        r.ok && r.samples == 256 && r.verified_samples == 256,
        "{r:#?}"
    );
    let r = report(env.consumer(&[
        "--stream",
        "grid",
        "--verify",
        "--batch-size",
        "64",
        "--name",
        "b64",
    ]));
    assert!(
        r.ok && r.samples == 256 && r.verified_samples == 256,
        "{r:#?}"
    );
    let s = env.stats();
    let slots = |n: &str| s.streams.iter().find(|s| s.name == n).unwrap().slots;
    assert_eq!(slots("train"), 15, "(2 + 1) × (⌈31 / 8⌉ + 1)");
    assert_eq!(slots("grid"), 27, "(2 + 1) × (⌈63 / 8⌉ + 1)");
    // Beyond what it was sized for: refused, naming the key to set.
    let r = report(env.consumer(&["--stream", "grid", "--batch-size", "128", "--name", "b128"]));
    let err = r.error.unwrap_or_default();
    assert!(
        err.contains("max_batch_size = 128") && err.contains("batch_size ≤ 65"),
        "{err}"
    );
}

#[test]
fn a_batch_size_the_slots_cannot_hold_is_refused_with_the_largest_that_fits() {
    let env = Env::start(&config("epochs = 1"));
    let r = report(env.consumer(&["--batch-size", "1000", "--name", "big"]));
    let err = r.error.clone().unwrap_or_default();
    assert_eq!(r.error_code.as_deref(), Some("InvalidRequest"), "{r:#?}");
    assert!(
        err.contains("batch_size 1000 with window 2")
            && err.contains("batch_size ≤ 321")
            && err.contains("max_batch_size = 1000"),
        "{err}"
    );
    // The largest size a client can send is refused the same way, with no
    // overflow in the arithmetic and nothing allocated for it.
    let r = report(env.consumer(&["--batch-size", &u64::MAX.to_string(), "--name", "huge"]));
    assert_eq!(r.error_code.as_deref(), Some("InvalidRequest"), "{r:#?}");
    let r = report(env.consumer(&["--batch-size", "0", "--name", "zero"]));
    assert!(
        r.error
            .unwrap_or_default()
            .contains("batch_size must be at least 1"),
        "a zero batch size is refused before connecting"
    );
}

#[test]
fn a_program_that_keeps_an_old_batch_is_told_it_pins_the_ring() {
    let env = Env::start(&config("epochs = 4"));
    let mut c = batchcast::Consumer::connect(batchcast::ConsumerOptions {
        socket: Some(env.socket()),
        stream: "train".into(),
        window: 2,
        batch_size: Some(50),
        name: "keeper".into(),
        ..Default::default()
    })
    .unwrap();
    let first = c.next().unwrap().unwrap();
    let t0 = Instant::now();
    let err = loop {
        match c.next().unwrap() {
            Ok(b) => drop(b),
            Err(e) => break e,
        }
        assert!(t0.elapsed() < LIMIT, "no error while pinning the ring");
    };
    assert!(
        matches!(err, batchcast::Error::RingPinned { seq: 0, slots: 28 }),
        "{err}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "told at once, not after a hang"
    );
    drop(first);
}
