//! End-to-end tests of decoupled pace: the real broker, real consumer
//! processes. Trainers of different speeds on one stream each read every
//! sample once, in order, byte for byte, whatever their batch size; one
//! that stalls for a second is cut from the shared stream (the others go
//! on) and catches up from replay; one killed while it is being replayed
//! to leaves nothing behind; a socket consumer is cut like a mailbox one;
//! one that pins the ring (holding a batch, or paused while replayed to)
//! is detached after the stream's hold limit, and the others go on.

use std::time::Duration;

use batchcast_cli::harness;
use batchcast_cli::report::ConsumerReport;
use nix::sys::signal::Signal::SIGCONT;

use crate::common;

use common::{Env, report};

const PER_EPOCH: u64 = 410;
const EPOCHS: u64 = 4;

/// 410 samples an epoch in units of 40 (the last 10), `EPOCHS` epochs,
/// decoupled with a ring of 12 units (a consumer of batches of 64 with a
/// window of 2 may hold 9); the stream starts once `consumers` have
/// subscribed.
pub(crate) fn config(consumers: usize) -> String {
    common::small_images(40, PER_EPOCH)
        .epochs(EPOCHS)
        .key("min_consumers", consumers)
        .key("drop_last", false)
        .raw("pace = \"decoupled\"")
        .to_toml()
}

/// Every sample of every epoch, once, in order, with the generator's bytes.
fn assert_whole(r: &ConsumerReport, batch: u64, drop_last: bool) {
    let per_epoch = if drop_last {
        PER_EPOCH / batch * batch
    } else {
        PER_EPOCH
    };
    common::assert_every_epoch_whole(r, EPOCHS, per_epoch);
}

#[test]
fn a_trainer_that_stalls_is_replayed_to_while_the_others_go_on_unheld() {
    let env = Env::start(&config(4));
    stalling_trainer_is_replayed_to_while_the_others_go_on(&env, [&[], &[]]);
}

/// `odd` (batches of 7) and `stalls` have `device`'s arguments; the device
/// twin is in `device.rs`.
pub(crate) fn stalling_trainer_is_replayed_to_while_the_others_go_on(
    env: &Env,
    device: [&[&str]; 2],
) {
    let fast = env.consumer(&["--verify", "--name", "fast"]);
    let odd = env.consumer(
        &[
            &[
                "--verify",
                "--sleep-ms",
                "1",
                "--batch-size",
                "7",
                "--window",
                "3",
                "--name",
                "odd",
            ][..],
            device[0],
        ]
        .concat(),
    );
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
    // Stalls 5 s between two batches (it holds none meanwhile): far longer
    // than the others take to read the whole run, on any machine.
    let stalls = env.consumer(
        &[
            &[
                "--verify",
                "--stall-after",
                "15",
                "--stall-ms",
                "5000",
                "--name",
                "stalls",
            ][..],
            device[1],
        ]
        .concat(),
    );
    let fast = report(fast);
    let odd = report(odd);
    let big = report(big);
    let stalls = report(stalls);
    assert_whole(&fast, 40, false);
    assert_whole(&odd, 7, false);
    assert_whole(&big, 64, true);
    assert_whole(&stalls, 40, false);
    // The others were not held: each read its whole run in less time than
    // the stall (docs: fast trainers are not held by a slow one).
    for r in [&fast, &odd, &big] {
        assert!(r.seconds < 4.0, "{} took {:.1} s", r.name, r.seconds);
    }
    // It fell a ring behind while it stalled: cut, and replayed to.
    assert!(stalls.replayed_batches > 0, "{stalls:#?}");
    let s = env.gone(&["stalls"]);
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
fn a_slow_socket_consumer_is_cut_and_replayed_to_like_a_mailbox_one() {
    // Without a mailbox it took everything it was sent; what was queued
    // for it is what it gives back when it falls a ring behind.
    let env = Env::start(&config(2));
    let fast = env.consumer(&["--verify", "--name", "fast"]);
    let slow = env.consumer(&[
        "--verify",
        "--sleep-ms",
        "3",
        "--no-mailbox",
        "--name",
        "slow",
    ]);
    let fast = report(fast);
    let slow = report(slow);
    assert_whole(&fast, 40, false);
    assert_whole(&slow, 40, false);
    let s = env.wait_for("both to be gone", |s| {
        s.streams[0].past_consumers.len() == 2
    });
    let past = &s.streams[0].past_consumers;
    let slow_stats = past.iter().find(|c| c.name == "slow").unwrap();
    assert!(
        slow_stats.cuts >= 1 && slow.replayed_batches > 0,
        "{slow_stats:#?} {slow:#?}"
    );
}

/// A paused socket consumer keeps the window it was sent (it cannot be
/// taken back without its reading): past the hold limit the ring moves on
/// without those batches, and continued, it reads them where they were,
/// then the rest from replay, every batch right.
#[test]
fn a_socket_consumer_that_pauses_is_left_its_window_and_reads_on() {
    // It pauses first, then the steady reader comes: a steady reader
    // started first may itself be a ring behind when the other joins
    // (under load) and go on from replay, where no one can hold it, and
    // the paused one, keeping no one waiting, would rightly read on.
    let env = Env::start(&held_config(1.0));
    let paused = env.consumer(&[
        "--verify",
        "--stop-after",
        "3",
        "--max-batches",
        "400",
        "--no-mailbox",
        "--name",
        "paused",
    ]);
    common::wait_stopped(paused.id());
    let steady = steady(&env, 600);
    let steady = env.report(steady);
    harness::signal(paused.id(), SIGCONT);
    let paused = env.report(paused);
    assert_not_held(&steady);
    assert!(
        paused.ok && paused.verified_samples == paused.samples && paused.batches == 400,
        "{paused:#?}"
    );
    assert!(paused.order_errors.is_empty(), "{:?}", paused.order_errors);
    let s = env.wait_for("it to be gone", |s| s.streams[0].consumers.is_empty());
    assert_eq!(s.streams[0].detached, 0);
    assert!(s.streams[0].ring_moves >= 1, "{:#?}", s.streams[0]);
}

/// An endless decoupled stream whose pipeline waits at most `hold` s for
/// a consumer it cannot cut, one that holds the batch needed next
/// included (`held_batch_limit_s`, whose default is 30 s).
fn held_config(hold: f64) -> String {
    common::small_images(40, PER_EPOCH)
        .raw("pace = \"decoupled\"")
        .raw(&format!("hold_limit_s = {hold}"))
        .raw(&format!("held_batch_limit_s = {hold}"))
        .to_toml()
}

/// The steady reader got everything right and was not held: 600 batches
/// at 2 ms are 1.2 s alone; held by the consumer under test they would
/// take its whole pause (12 s, or until it is continued after the steady
/// reader ends; the bound: the hold limit and slack).
fn assert_not_held(steady: &ConsumerReport) {
    assert!(
        steady.ok && steady.verified_samples == steady.samples,
        "{steady:#?}"
    );
    assert_eq!(steady.batches, 600);
    assert!(
        steady.seconds < 8.0,
        "the steady reader was held {:.1} s",
        steady.seconds
    );
}

/// A steady reader of `batches` batches, 2 ms each (alone: about 2 ms ×
/// `batches`).
fn steady(env: &Env, batches: u64) -> std::process::Child {
    env.consumer(&[
        "--verify",
        "--sleep-ms",
        "2",
        "--max-batches",
        &batches.to_string(),
        "--name",
        "steady",
    ])
}

/// One that keeps its last batch through a 12 s pause pins the ring's
/// slot itself (a cut cannot free it): past the hold limit the ring moves
/// on to another region of the arena without that batch, and continued,
/// the holder reads on from replay, every batch right.
#[test]
fn a_consumer_that_keeps_a_batch_through_a_long_pause_is_left_it_and_reads_on() {
    // It pauses before the steady reader comes (see the test above).
    let env = Env::start(&held_config(1.0));
    let holder = env.consumer(&[
        "--verify",
        "--stop-after",
        "5",
        "--hold",
        "1",
        "--max-batches",
        "400",
        "--name",
        "holder",
    ]);
    common::wait_stopped(holder.id());
    let steady = steady(&env, 600);
    let steady = env.report(steady);
    harness::signal(holder.id(), SIGCONT);
    let holder = env.report(holder);
    assert_not_held(&steady);
    assert!(
        holder.ok && holder.verified_samples == holder.samples && holder.batches == 400,
        "{holder:#?}"
    );
    assert!(holder.order_errors.is_empty(), "{:?}", holder.order_errors);
    let s = env.wait_for("the holder to be gone", |s| {
        s.streams[0].consumers.is_empty()
    });
    assert_eq!(s.streams[0].detached, 0);
    assert!(s.streams[0].ring_moves >= 1, "{:#?}", s.streams[0]);
    assert_eq!(s.streams[0].held_behind, 0);
}

#[test]
fn a_consumer_being_replayed_to_that_pauses_is_never_waited_for() {
    // A hold limit far longer than the steady reader's run: only never
    // waiting for the paused consumers lets it finish in time.
    let env = Env::start(&held_config(60.0));
    let steady = steady(&env, 600);
    // Past epoch 2 (11 units an epoch): the ring no longer holds epoch 1.
    env.wait_for("the steady reader to be past epoch 1", |s| {
        s.streams[0].consumers.iter().any(|c| c.delivered > 30)
    });
    // One joins with `now` (its epoch's start replayed, unless the ring
    // begins there), one resumes inside epoch 1 (replayed for sure); each
    // reads one batch and pauses.
    let paused: Vec<_> = [["--join", "now"], ["--resume", "1:5"]]
        .iter()
        .map(|start| {
            env.consumer(&[
                "--verify",
                start[0],
                start[1],
                "--stop-after",
                "1",
                "--max-batches",
                "30",
                "--name",
                "paused",
            ])
        })
        .collect();
    // They stay stopped until the steady reader is done: had they held
    // the stream, it would wait for them (up to the 60 s hold limit).
    let steady = env.report(steady);
    assert_not_held(&steady);
    for p in &paused {
        common::wait_stopped(p.id());
        harness::signal(p.id(), SIGCONT);
    }
    // Not detached: neither was in the others' way, and what each read
    // (replayed, then shared after its merge) is right and in order.
    let reports: Vec<_> = paused.into_iter().map(report).collect();
    for paused in &reports {
        assert!(paused.ok && paused.error_code.is_none(), "{paused:#?}");
        assert_eq!(paused.batches, 30, "{paused:#?}");
        assert_eq!(paused.verified_samples, paused.samples, "{paused:#?}");
        assert!(paused.order_errors.is_empty(), "{:?}", paused.order_errors);
    }
    assert!(reports[1].replayed_batches > 0, "{:#?}", reports[1]);
    let s = env.stats();
    assert_eq!(s.streams[0].detached, 0);
}

#[test]
fn a_trainer_killed_while_cut_and_replayed_to_leaves_nothing_behind() {
    // An endless stream: a steady reader, and a slow one (holding two
    // batches, 100 ms a batch) that falls a ring behind, is cut, and is
    // killed while it is being replayed to.
    let env = Env::start(
        &common::small_images(40, PER_EPOCH)
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

/// A hostile client speaking the protocol by hand: it takes every batch
/// noticed to it (its mailbox's `tail` says so) and gives none back,
/// keeping its connection open. The ring moves on without what it holds,
/// and the steady reader is not held; hoarding again, it is detached
/// (one consumer holds at most one region), told why.
#[test]
fn a_raw_client_that_takes_every_notice_and_never_releases_holds_no_one() {
    // It hoards before the steady reader comes (see the tests above).
    let env = Env::start(&held_config(1.0));
    let hoard = common::hoarder(&env.socket(), Duration::from_secs(10));
    env.wait_for("the hoarder to take its window", |s| {
        s.streams[0].consumers.iter().any(|c| c.delivered >= 2)
    });
    let steady = steady(&env, 600);
    let steady = env.report(steady);
    assert_not_held(&steady);
    let s = env.stats();
    assert!(s.streams[0].ring_moves >= 1, "{:#?}", s.streams[0]);
    let (taken, msg) = hoard.join().unwrap();
    assert!(taken > 0);
    if let Some(msg) = msg {
        common::expect_error(
            msg,
            batchcast::proto::ErrorCode::HoldLimit,
            "still holds batches the ring left behind",
        );
    }
}

/// A finite decoupled stream already made to its end still serves a
/// joiner or a resume anywhere in it (from replay), as lockstep does: a
/// trainer restarted from its checkpoint after the others finished reads
/// the rest of its run, byte for byte.
#[test]
fn a_resume_on_a_finished_decoupled_stream_is_served_from_replay() {
    let env = Env::start(&config(1));
    let first = report(env.consumer(&["--batch-size", "64", "--verify"]));
    assert_whole(&first, 64, false);
    let s = env.stats();
    assert_eq!(
        s.streams[0].batches_produced,
        EPOCHS * PER_EPOCH.div_ceil(40)
    );
    for (at, from_epoch) in [("0:0", 0), ("1:0", 1), ("3:5", 3)] {
        let r = report(env.consumer(&["--batch-size", "64", "--verify", "--resume", at]));
        assert!(r.ok && r.ended, "resume at {at}: {r:#?}");
        assert_eq!(r.verify_failures, 0, "{r:#?}");
        assert!(r.order_errors.is_empty(), "{:?}", r.order_errors);
        assert_eq!(
            r.epochs.first().map(|e| e.epoch),
            Some(from_epoch),
            "{r:#?}"
        );
        assert_eq!(r.epochs.last().map(|e| e.epoch), Some(EPOCHS - 1), "{r:#?}");
        assert!(r.replayed_batches > 0, "{r:#?}");
        if from_epoch < 3 {
            assert!(
                r.epochs
                    .iter()
                    .all(|e| e.complete && e.samples == PER_EPOCH),
                "{r:#?}"
            );
        }
    }
    let r = report(env.consumer(&["--join", "now", "--verify"]));
    assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
}

/// 2,000 samples an epoch in units of 40 (50 units, the ring 12),
/// decoupled: an epoch far longer than the ring, as a real dataset's is.
pub(crate) fn long_epochs(epochs: u64) -> String {
    common::small_images(40, 2000)
        .epochs(epochs)
        .key("drop_last", false)
        .raw("pace = \"decoupled\"")
        .to_toml()
}

/// Issue 49, item 8: a `join = "now"` trainer as fast as the others used
/// to stay as far behind as it joined, never merge, and be replayed every
/// sample it read. Now each epoch whose start the ring no longer holds it
/// reads from where the shared stream is, and the part it missed after
/// the epoch's end: every sample once an epoch, replayed only that part.
#[test]
fn a_joiner_as_fast_as_the_others_reads_each_epoch_rotated_and_replays_only_its_start() {
    let env = Env::start(&long_epochs(3));
    joiner_reads_each_epoch_rotated(&env, &[]);
}

/// The joiner has `device`'s arguments; the device twin is in `device.rs`.
pub(crate) fn joiner_reads_each_epoch_rotated(env: &Env, device: &[&str]) {
    const EPOCHS: u64 = 3;
    let pace = ["--verify", "--sleep-ms", "10"];
    let steady = env.consumer(&[&pace[..], &["--name", "steady"]].concat());
    // Far enough in that the ring, 12 units ahead of the steady reader at
    // most, no longer holds the epoch's start within half a ring.
    env.wait_for("the steady reader to take 10 batches", |s| {
        s.streams[0]
            .consumers
            .iter()
            .any(|c| c.name == "steady" && c.taken.batches >= 10)
    });
    let late = env.consumer(&[&pace[..], &["--join", "now", "--name", "late"], device].concat());
    let steady = report(steady);
    let late = report(late);
    common::assert_every_epoch_whole(&steady, EPOCHS, 2000);
    common::assert_every_epoch_whole(&late, EPOCHS, 2000);
    assert!(late.rotated_epochs >= 1, "{late:#?}");
    // The broker counts the epochs it rotated it into, as the trainer saw.
    let s = env.gone(&["late"]);
    let broker_says = s.streams[0]
        .past_consumers
        .iter()
        .find(|c| c.name == "late")
        .map(|c| c.rotations);
    assert_eq!(broker_says, Some(late.rotated_epochs), "{s:#?}");
    // Replayed: what it missed of each rotated epoch (at most the ring's
    // lead and its own lag), not every sample.
    let replayed = late.replayed_batches as f64 / late.batches as f64;
    assert!(
        replayed < 0.6,
        "late: {} of {} batches replayed ({} epochs rotated)",
        late.replayed_batches,
        late.batches,
        late.rotated_epochs
    );
}

/// A rotated joiner's state names the rotation, and a resume from it
/// reads the rest of that epoch in the same order: the epoch's part after
/// the point, then its start, then whole epochs (every sample once).
#[test]
fn a_resume_from_a_rotated_state_goes_on_in_the_rotated_order() {
    const EPOCHS: u64 = 2;
    let env = Env::start(&long_epochs(EPOCHS));
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("late.json");
    let file = state.to_str().unwrap();
    let pace = ["--verify", "--sleep-ms", "10"];
    let steady = env.consumer(&[&pace[..], &["--name", "steady"]].concat());
    env.wait_for("the steady reader to take 10 batches", |s| {
        s.streams[0]
            .consumers
            .iter()
            .any(|c| c.name == "steady" && c.taken.batches >= 10)
    });
    // 20 batches: inside its first, rotated epoch.
    let first = report(
        env.consumer(
            &[
                &pace[..],
                &["--join", "now", "--state-file", file, "--max-batches", "20"],
            ]
            .concat(),
        ),
    );
    assert!(first.ok && first.rotated_epochs == 1, "{first:#?}");
    let saved = batchcast_cli::report::SavedState::load(&state).unwrap();
    let rot = saved
        .state
        .rotation
        .expect("a rotated epoch's state names it");
    assert_eq!(rot.epoch, 0);
    let resumed = report(env.consumer(&[&pace[..], &["--resume-state", file]].concat()));
    report(steady);
    // The epoch it was in carries on from the state's counts (read whole
    // across the two processes); the next is its own, whole.
    assert!(resumed.ok && resumed.ended, "{resumed:#?}");
    assert_eq!(resumed.verify_failures, 0, "{resumed:#?}");
    assert!(
        resumed.order_errors.is_empty(),
        "{:?}",
        resumed.order_errors
    );
    let epochs: Vec<(u64, u64)> = resumed
        .epochs
        .iter()
        .map(|e| (e.epoch, e.samples))
        .collect();
    assert_eq!(epochs, [(0, 2000), (1, 2000)], "{resumed:#?}");
    assert_eq!(first.samples + resumed.samples, EPOCHS * 2000);
    assert!(resumed.replayed_batches > 0, "{resumed:#?}");
}
