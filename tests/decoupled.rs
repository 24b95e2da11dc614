//! End-to-end tests of decoupled pace: the real broker, real consumer
//! processes. Trainers of different speeds on one stream each read every
//! sample once, in order, byte for byte, whatever their batch size; one
//! that stalls for a second is cut from the shared stream (the others go
//! on) and catches up from replay; one killed while it is being replayed
//! to leaves nothing behind; a stream keeps consumers that cannot be
//! replayed to (on the socket) in lockstep.

use batchcast_broker::config::StreamToml;
use batchcast_broker::consume::ConsumerReport;

mod common;

use common::{Env, report};

const PER_EPOCH: u64 = 410;
const EPOCHS: u64 = 4;

/// 410 samples an epoch in units of 40 (the last 10), `EPOCHS` epochs,
/// decoupled with a ring of 12 units (a consumer of batches of 64 with a
/// window of 2 may hold 9); the stream starts once `consumers` have
/// subscribed.
fn config(consumers: usize) -> String {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    StreamToml::synthetic("train", 40, PER_EPOCH, &fields)
        .epochs(EPOCHS)
        .key("seed", 5)
        .key("slots", 12)
        .key("workers", 2)
        .key("min_consumers", consumers)
        .key("drop_last", false)
        .raw("pace = \"decoupled\"")
        .to_toml()
}

/// Every sample of every epoch, once, in order, with the generator's bytes.
fn assert_whole(r: &ConsumerReport, batch: u64, drop_last: bool) {
    assert!(r.ok && r.ended, "{r:#?}");
    assert_eq!(r.verify_failures, 0, "{r:#?}");
    assert!(r.order_errors.is_empty(), "{:?}", r.order_errors);
    let per_epoch = if drop_last {
        PER_EPOCH / batch * batch
    } else {
        PER_EPOCH
    };
    assert_eq!(r.samples, EPOCHS * per_epoch, "{}", r.name);
    assert_eq!(r.verified_samples, r.samples);
    let epochs: Vec<(u64, u64, bool)> = r
        .epochs
        .iter()
        .map(|e| (e.epoch, e.samples, e.complete))
        .collect();
    let want: Vec<(u64, u64, bool)> = (0..EPOCHS).map(|e| (e, per_epoch, true)).collect();
    assert_eq!(epochs, want, "{}", r.name);
}

#[test]
fn a_trainer_that_stalls_for_a_second_is_replayed_to_while_the_others_go_on() {
    let env = Env::start(&config(4));
    let fast = env.consumer(&["--verify", "--name", "fast"]);
    let odd = env.consumer(&[
        "--verify",
        "--sleep-ms",
        "1",
        "--batch-size",
        "7",
        "--window",
        "3",
        "--name",
        "odd",
    ]);
    let big = env.consumer(&[
        "--verify",
        "--sleep-ms",
        "2",
        "--batch-size",
        "64",
        "--drop-last",
        "--name",
        "big",
    ]);
    // Stalls a second between two batches (it holds none meanwhile).
    let stalls = env.consumer(&[
        "--verify",
        "--stall-after",
        "15",
        "--stall-ms",
        "1000",
        "--name",
        "stalls",
    ]);
    let fast = report(fast);
    let odd = report(odd);
    let big = report(big);
    let stalls = report(stalls);
    assert_whole(&fast, 40, false);
    assert_whole(&odd, 7, false);
    assert_whole(&big, 64, true);
    assert_whole(&stalls, 40, false);
    // It fell a ring behind while it stalled: cut, and replayed to.
    assert!(stalls.replayed_batches > 0, "{stalls:#?}");
    let s = env.stats();
    let past = &s.streams[0].past_consumers;
    let cuts = |name: &str| {
        past.iter()
            .find(|c| c.name == name)
            .map(|c| (c.cuts, c.replayed))
            .unwrap_or_else(|| panic!("{name} not among {past:#?}"))
    };
    let (n, replayed) = cuts("stalls");
    assert!(
        n >= 1 && replayed > 0,
        "stalls: {n} cuts, {replayed} replayed"
    );
    // What it replayed was recomputed by the pipeline, not sent twice.
    assert!(s.streams[0].replay_cpu_s > 0.0);
}

#[test]
fn a_socket_consumer_keeps_lockstep_in_a_decoupled_stream() {
    // Without a mailbox it cannot be cut: the others wait for it, as in
    // lockstep, and everyone still gets everything.
    let env = Env::start(&config(2));
    let fast = env.consumer(&["--verify", "--name", "fast"]);
    let slow = env.consumer(&[
        "--verify",
        "--sleep-ms",
        "1",
        "--no-mailbox",
        "--name",
        "slow",
    ]);
    let fast = report(fast);
    let slow = report(slow);
    assert_whole(&fast, 40, false);
    assert_whole(&slow, 40, false);
    assert_eq!(slow.replayed_batches, 0);
    let s = env.stats();
    assert!(s.streams[0].past_consumers.iter().all(|c| c.cuts == 0));
}

#[test]
fn a_trainer_killed_while_cut_and_replayed_to_leaves_nothing_behind() {
    // An endless stream: a steady reader, and a slow one (holding two
    // batches, 100 ms a batch) that falls a ring behind, is cut, and is
    // killed while it is being replayed to.
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    let env = Env::start(
        &StreamToml::synthetic("train", 40, PER_EPOCH, &fields)
            .key("seed", 5)
            .key("slots", 12)
            .key("workers", 2)
            .key("min_consumers", 2)
            .raw("pace = \"decoupled\"")
            .to_toml(),
    );
    let steady = env.consumer(&[
        "--verify",
        "--sleep-ms",
        "1",
        "--max-batches",
        "400",
        "--name",
        "steady",
    ]);
    let mut victim = env.consumer(&[
        "--verify",
        "--window",
        "3",
        "--hold",
        "2",
        "--sleep-ms",
        "100",
        "--name",
        "victim",
    ]);
    env.wait_for("the victim to be cut and replayed to", |s| {
        s.streams[0]
            .consumers
            .iter()
            .any(|c| c.name == "victim" && c.cuts > 0 && c.replayed > 0)
            && s.memory.replay_bytes > 0
    });
    common::sigkill(&mut victim);
    let r = report(steady);
    assert!(r.ok && r.verified_samples == r.samples, "{r:#?}");
    assert!(r.order_errors.is_empty(), "{:?}", r.order_errors);
    let s = env.wait_for("both to be gone", |s| s.streams[0].consumers.is_empty());
    assert_eq!(s.memory.replay_bytes, 0, "its replay arena went back");
    assert_eq!(s.streams[0].in_use, 0, "every slot came back");
}
