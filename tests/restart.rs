//! Trainers ride through a broker restart: real broker processes, SIGKILLed
//! or stopped and started again on the same socket under real consumer
//! processes that may reconnect (`--reconnect-timeout`). Every consumer
//! must finish without an error, with every epoch's digest (sample by
//! sample) equal to an uninterrupted run's.

use batchcast_broker::config::StreamToml;

use crate::common;

use common::{Env, digests, report};

/// 400 samples an epoch in batches of 10, 4 epochs, shuffled, every
/// sample's bytes its own; two consumers start it.
pub(crate) fn config() -> String {
    config_starting_with(2)
}

/// `config()`, the stream starting with `min_consumers` consumers.
fn config_starting_with(min_consumers: u32) -> String {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    StreamToml::synthetic("train", 10, 400, &fields)
        .epochs(4)
        .key("seed", 21)
        .key("slots", 12)
        .key("max_batch_size", 16)
        .key("workers", 2)
        .key("min_consumers", min_consumers)
        .fill("full")
        .to_toml()
}

/// Per-epoch digests of an uninterrupted run of `config()` (at the
/// stream's batch size and at 16: the same).
fn reference() -> Vec<(u64, Option<String>)> {
    let env = Env::start(&config());
    let a = env.consumer(&["--digest"]);
    let b = env.consumer(&["--digest", "--batch-size", "16"]);
    let (a, b) = (report(a), report(b));
    assert!(a.ok && b.ok, "{a:#?}\n{b:#?}");
    assert_eq!(digests(&a), digests(&b));
    assert_eq!(digests(&a).len(), 4);
    digests(&a)
}

#[test]
fn consumers_ride_through_broker_restarts_with_the_bytes_of_an_uninterrupted_run() {
    let mut env = Env::start(&config());
    ride_through_broker_restarts(&mut env, [&[], &[]]);
}

/// Two consumers (with `device`'s arguments, one each) ride through a
/// SIGKILL, a SIGTERM and a SIGKILL of the broker; its device twin is in
/// `device.rs`.
pub(crate) fn ride_through_broker_restarts(env: &mut Env, device: [&[&str]; 2]) {
    let reference = reference();
    let ride = ["--digest", "--reconnect-timeout", "30", "--sleep-ms", "3"];
    let a = env.consumer(&[&ride[..], &["--name", "a"], device[0]].concat());
    let b = env.consumer(
        &[
            &ride[..],
            &["--name", "b", "--batch-size", "16", "--no-mailbox"],
            device[1],
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
    let s = env.gone(&[&a.name, &b.name]);
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

/// The broker dies while one consumer pauses in epoch 0's last part and
/// the other has read on into epoch 1; the next broker starts with the
/// second alone (its config: `min_consumers = 1`), and the first, back later, is
/// replayed from its place past epoch 0's end: that epoch is whole
/// (`complete`: the consumer saw its start, from the first broker).
#[test]
fn an_epoch_end_replayed_after_a_restart_completes_the_epoch_the_consumer_began() {
    let reference = reference();
    let mut env = Env::start(&config());
    let ride = ["--digest", "--reconnect-timeout", "30"];
    let a = env.consumer(&[&ride[..], &["--name", "a", "--sleep-ms", "20"]].concat());
    // 20 batches of 16: epoch 0's sample 320, then a pause.
    let b = env.consumer(
        &[
            &ride[..],
            &["--name", "b", "--batch-size", "16"],
            &["--stall-after", "20", "--stall-ms", "1500"],
        ]
        .concat(),
    );
    env.wait_for("b paused in epoch 0, a in epoch 1", |s| {
        let taken = |n: &str| {
            s.streams[0]
                .consumers
                .iter()
                .find(|c| c.name == n)
                .map(|c| c.taken)
        };
        matches!(
            (taken("a"), taken("b")),
            (Some(a), Some(b)) if a.epoch >= 1 && b.epoch == 0 && b.samples == 320
        )
    });
    std::fs::write(env.path("broker.toml"), config_starting_with(1)).unwrap();
    env.restart_broker(true);
    let (a, b) = (report(a), report(b));
    for r in [&a, &b] {
        common::assert_rode_through(r, 1, &reference, 400);
    }
    assert!(b.replayed_batches >= 5, "{b:#?}");
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

/// A broker that goes away while a consumer subscribes (here a listener
/// that reads its hello and closes without a word, then nothing
/// listening, then the real broker behind the same path) is waited for
/// as one that goes away later is: the consumer reads the whole stream.
/// Before, a broker killed between a subscription and its welcome ended
/// the consumer at once.
#[test]
fn a_broker_gone_before_its_welcome_is_waited_for_like_one_gone_later() {
    use std::io::Read;
    let env = Env::start(&config_starting_with(1));
    let door = env.path("door.sock");
    let listener = std::os::unix::net::UnixListener::bind(&door).unwrap();
    let (d, real) = (door.clone(), env.socket());
    let gate = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let _ = s.read(&mut [0u8; 64]);
        drop((s, listener));
        std::fs::remove_file(&d).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        std::os::unix::fs::symlink(&real, &d).unwrap();
    });
    let kid = env.consumer_on(&door, &["--digest", "--reconnect-timeout", "30"]);
    gate.join().unwrap();
    let r = report(kid);
    let said = env.what_they_said();
    assert!(r.ok && r.ended, "{r:#?}\n{said}");
    assert_eq!(r.reconnects, 0, "{r:#?}");
    assert_eq!(digests(&r), reference());
    assert!(said.contains("waits up to 30 s"), "{said}");
}
