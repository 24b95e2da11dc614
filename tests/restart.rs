//! Trainers ride through a broker restart: real broker processes, SIGKILLed
//! or stopped and started again on the same socket under real consumer
//! processes that may reconnect (`--reconnect-timeout`). Every consumer
//! must finish without an error, with every epoch's digest (sample by
//! sample) equal to an uninterrupted run's.

use batchcast_kit::StreamToml;

use crate::common;

use common::{Env, digests, report};

/// 400 samples an epoch in batches of 10, 4 epochs, shuffled, every
/// sample's bytes its own; two consumers start it.
fn config() -> String {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    StreamToml::synthetic("train", 10, 400, &fields)
        .epochs(4)
        .key("seed", 21)
        .key("slots", 12)
        .key("max_batch_size", 16)
        .key("workers", 2)
        .key("min_consumers", 2)
        .fill("full")
        .to_toml()
}

#[test]
fn consumers_ride_through_broker_restarts_with_the_bytes_of_an_uninterrupted_run() {
    let reference = {
        let env = Env::start(&config());
        let a = env.consumer(&["--digest"]);
        let b = env.consumer(&["--digest", "--batch-size", "16"]);
        let (a, b) = (report(a), report(b));
        assert!(a.ok && b.ok, "{a:#?}\n{b:#?}");
        assert_eq!(digests(&a), digests(&b));
        digests(&a)
    };
    assert_eq!(reference.len(), 4);
    let mut env = Env::start(&config());
    let ride = ["--digest", "--reconnect-timeout", "30", "--sleep-ms", "3"];
    let a = env.consumer(&[&ride[..], &["--name", "a"]].concat());
    let b = env.consumer(
        &[
            &ride[..],
            &["--name", "b", "--batch-size", "16", "--no-mailbox"],
        ]
        .concat(),
    );
    // Killed, then stopped, each after the consumers read a while.
    // (Each broker counts what it delivered itself.)
    for kill in [true, false, true] {
        env.wait_for("the consumers to read on", |s| {
            s.streams[0].consumers.len() == 2
                && s.streams[0].consumers.iter().all(|c| c.delivered >= 15)
        });
        env.restart_broker(kill);
    }
    let (a, b) = (report(a), report(b));
    for r in [&a, &b] {
        common::assert_rode_through(r, 3, &reference, 400);
    }
    // What each says it took, carried across the restarts, reaches the
    // last broker's stats: from its mailbox (a) and with its releases on
    // the socket (b).
    let s = env.stats();
    for r in [&a, &b] {
        let c = s.streams[0]
            .past_consumers
            .iter()
            .find(|c| c.name == r.name)
            .unwrap_or_else(|| panic!("{} among those that left: {s:#?}", r.name));
        assert_eq!(
            (c.taken.batches, c.taken.samples, c.taken.epoch),
            (r.batches, r.samples, 3),
            "{}: {c:#?}",
            r.name
        );
    }
}

#[test]
fn without_a_reconnect_timeout_a_consumer_fails_at_once() {
    let mut env = Env::start(&config());
    let a = env.consumer(&["--sleep-ms", "3", "--reconnect-timeout", "0"]);
    let b = env.consumer(&["--sleep-ms", "3", "--reconnect-timeout", "0"]);
    env.wait_for("the consumers to read", |s| {
        s.streams[0]
            .consumers
            .iter()
            .filter(|c| c.delivered > 5)
            .count()
            == 2
    });
    env.broker.kill().unwrap();
    for r in [report(a), report(b)] {
        assert!(!r.ok, "{r:#?}");
        assert!(
            r.error
                .as_deref()
                .is_some_and(|e| e.contains("broker closed")),
            "{r:#?}"
        );
    }
}
