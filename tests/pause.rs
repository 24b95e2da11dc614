//! A paused trainer holds no one past the stream's hold limit, under the
//! default pace (`auto`) as under lockstep and decoupled: the real broker, real
//! consumer processes stopped with SIGSTOP (as Ctrl-Z, a debugger or a
//! hung process stops them) and continued with SIGCONT. On a stream the
//! broker computes, the stopped one is cut to replay once it has kept the
//! others waiting for the limit, and continued it reads every sample
//! once, in order, byte for byte; one that keeps a batch while stopped,
//! or reads a producer's stream, is detached and told why.

use std::time::{Duration, Instant};

use batchcast_cli::harness;
use batchcast_cli::report::ConsumerReport;
use nix::sys::signal::Signal::SIGCONT;

use crate::common;

use common::{Env, report, wait_stopped};

const PER_EPOCH: u64 = 400;
const EPOCHS: u64 = 20;
/// How long the consumer under test stays stopped.
const STOPPED: Duration = Duration::from_secs(6);

/// 400 samples an epoch in units of 40, `EPOCHS` epochs, a ring of 12,
/// the default pace with a hold limit of 1 s; the stream starts
/// once two consumers have subscribed.
pub(crate) fn lockstep() -> String {
    common::small_images(40, PER_EPOCH)
        .epochs(EPOCHS)
        .key("min_consumers", 2)
        .raw("hold_limit_s = 1.0")
        .to_toml()
}

/// Waits for `steady` to finish while the consumer `stopped` stays
/// stopped, continues it then (also when `steady` was held: the test then
/// fails instead of hanging), and returns both reports.
fn steady_then_continue(
    steady: std::process::Child,
    stopped: std::process::Child,
) -> (ConsumerReport, ConsumerReport, Duration) {
    steady_then_continue_after(steady, stopped, STOPPED)
}

/// [`steady_then_continue`], the consumer stopped for `stop`.
fn steady_then_continue_after(
    mut steady: std::process::Child,
    stopped: std::process::Child,
    stop: Duration,
) -> (ConsumerReport, ConsumerReport, Duration) {
    wait_stopped(stopped.id());
    let t0 = Instant::now();
    while t0.elapsed() < stop && steady.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let finished = t0.elapsed();
    let held = steady.try_wait().unwrap().is_none();
    std::thread::sleep(stop.saturating_sub(t0.elapsed()));
    harness::signal(stopped.id(), SIGCONT);
    let (steady, stopped) = (report(steady), report(stopped));
    assert!(
        !held,
        "the steady reader was held while the other was stopped: {steady:#?}"
    );
    (steady, stopped, finished)
}

/// Every sample of every epoch, once, in order, with the generator's bytes.
fn assert_whole(r: &ConsumerReport) {
    common::assert_every_epoch_whole(r, EPOCHS, PER_EPOCH);
}

/// A steady reader: 2 ms a batch, 200 batches (0.4 s alone).
fn steady(env: &Env) -> std::process::Child {
    env.consumer(&["--verify", "--sleep-ms", "2", "--name", "steady"])
}

/// Docs (README, security.md): under the default pace a trainer stopped
/// for 6 s holds the others only for the hold limit (1 s here): it is cut
/// to replay, and continued it reads every sample once, in order, byte
/// for byte, then merges back. Before, the others waited all 6 s.
#[test]
fn a_stopped_trainer_on_a_default_stream_is_cut_and_reads_every_sample_once() {
    let env = Env::start(&lockstep());
    stopped_trainer_is_cut_and_reads_every_sample_once(&env, &[]);
}

/// README's promise at the defaults (no `hold_limit_s`, no `pace` in the
/// config): a trainer stopped for 10 s that holds no batch keeps a steady
/// one waiting well under the 2 s hold limit (the default pace cuts a
/// stall once it has lasted as long as remaking what the stalled one
/// owes, at least 0.25 s: here about that), then is cut to replay and,
/// continued, reads every sample once. Before (a 30 s default under
/// lockstep) the steady one waited the whole stop.
#[test]
fn at_the_defaults_a_stopped_trainer_holds_the_others_at_most_2_s() {
    let env = Env::start(&defaults());
    let steady = steady(&env);
    let stopped = env.consumer(&["--verify", "--stop-after", "5", "--name", "stopped"]);
    let stop = Duration::from_secs(10);
    let (steady, stopped, finished) = steady_then_continue_after(steady, stopped, stop);
    assert_whole(&steady);
    // Alone 0.4 s; the bound 2 s; slack for a loaded machine. Held all
    // along: the stop's 10 s.
    eprintln!("steady finished {finished:?} after the stop");
    assert!(
        finished < Duration::from_secs(6),
        "steady finished {finished:?} after the stop"
    );
    assert_whole(&stopped);
    assert!(stopped.replayed_batches > 0, "{stopped:#?}");
}

/// The default pace tells a step from a stall: beside a fast trainer, one
/// that takes 50 ms a batch sets the pace (lockstep: nothing replayed,
/// never cut: its steps are shorter than remaking the ring's 12 units of
/// small images, and than the 0.25 s below which nobody is cut).
#[test]
fn at_the_defaults_a_slow_but_moving_trainer_sets_the_pace_and_is_never_cut() {
    let cfg = common::small_images(40, PER_EPOCH)
        .epochs(4)
        .key("min_consumers", 2)
        .to_toml();
    let env = Env::start(&cfg);
    let fast = env.consumer(&["--verify", "--name", "fast"]);
    let slow = env.consumer(&["--verify", "--sleep-ms", "50", "--name", "slow"]);
    let (fast, slow) = (report(fast), report(slow));
    common::assert_every_epoch_whole(&fast, 4, PER_EPOCH);
    common::assert_every_epoch_whole(&slow, 4, PER_EPOCH);
    assert_eq!(slow.replayed_batches, 0, "{slow:#?}");
    // Held to the slow one's pace: 40 batches, the ring 12 of them, so
    // 28 of its 50 ms steps at least (1.4 s; alone, well under 0.5 s).
    assert!(fast.seconds >= 1.0, "{fast:#?}");
    let s = env.gone(&["fast", "slow"]);
    assert!(
        s.streams[0].past_consumers.iter().all(|c| c.cuts == 0),
        "{:#?}",
        s.streams[0].past_consumers
    );
}

/// Issue 72 at the defaults: a trainer crawling at 1 s a batch, slower
/// than remaking what it owes, holds a steady one no more than the first
/// stall (about 0.25 s here, where lockstep would hold it through the
/// crawler's 8 s): it is cut to replay and reads its batches in order,
/// byte for byte, from its own arena.
#[test]
fn at_the_defaults_a_crawling_trainer_is_replayed_to_and_holds_no_one() {
    let env = Env::start(&defaults());
    let steady = steady(&env);
    let crawler = env.consumer(&[
        "--verify",
        "--sleep-ms",
        "1000",
        "--max-batches",
        "8",
        "--name",
        "crawler",
    ]);
    let steady = report(steady);
    assert_whole(&steady);
    // Alone 0.4 s; held to the crawler's pace, at least 7 s.
    eprintln!("steady read its run in {:.2} s", steady.seconds);
    assert!(steady.seconds < 4.0, "{steady:#?}");
    let crawler = report(crawler);
    assert!(crawler.ok && crawler.batches == 8, "{crawler:#?}");
    assert_eq!(crawler.verified_samples, 8 * 40, "{crawler:#?}");
    assert!(crawler.replayed_batches > 0, "{crawler:#?}");
    let s = env.gone(&["steady", "crawler"]);
    let past = &s.streams[0].past_consumers;
    let cut = past.iter().find(|c| c.name == "crawler").unwrap();
    assert!(cut.cuts >= 1, "{cut:#?}");
    assert_eq!(s.streams[0].detached, 0);
}

/// The stopped trainer has `device`'s arguments; its device twin is in
/// `device.rs`.
pub(crate) fn stopped_trainer_is_cut_and_reads_every_sample_once(env: &Env, device: &[&str]) {
    let steady = steady(env);
    let stopped = env.consumer(
        &[
            &["--verify", "--stop-after", "5", "--name", "stopped"][..],
            device,
        ]
        .concat(),
    );
    let (steady, stopped, finished) = steady_then_continue(steady, stopped);
    assert_whole(&steady);
    // Alone it takes 0.4 s; held, the stop's 6 s: the bound is the hold
    // limit and slack for a loaded machine.
    assert!(
        finished < Duration::from_secs(4),
        "steady finished {finished:?} after the stop"
    );
    assert_whole(&stopped);
    assert!(stopped.replayed_batches > 0, "{stopped:#?}");
    let s = env.gone(&["stopped"]);
    let past = &s.streams[0].past_consumers;
    let cut = past.iter().find(|c| c.name == "stopped").unwrap();
    assert!(cut.cuts >= 1 && cut.replayed > 0, "{cut:#?}");
    assert_eq!(s.streams[0].detached, 0);
    // The broker's log is a file here: plain text, no colour escapes.
    let log = env.log();
    assert!(
        log.contains("hold limit") && !log.contains('\u{1b}'),
        "{log}"
    );
}

/// The stream at the defaults (nothing about pace or limits): 400
/// samples an epoch in units of 40, `EPOCHS` epochs, a ring of 12,
/// starting once two consumers subscribed.
pub(crate) fn defaults() -> String {
    let cfg = common::small_images(40, PER_EPOCH)
        .epochs(EPOCHS)
        .key("min_consumers", 2)
        .to_toml();
    assert!(!cfg.contains("limit") && !cfg.contains("pace"), "{cfg}");
    cfg
}

/// Issue 72 at the defaults (no `hold_limit_s` in the config): a
/// trainer stopped mid-step while its program keeps its batch (`--hold
/// 1`, as a training step's does) holds the others at most the 2 s hold
/// limit. A cut cannot give that batch back, so the ring moves on to
/// another region of the arena without it (the stopped one reads it where
/// it was); the stopped one is cut to replay and, continued, reads every
/// sample once. Before, the others waited the held-batch limit (30 s),
/// and then it was detached.
#[test]
fn at_the_defaults_a_trainer_stopped_holding_its_batch_holds_the_others_at_most_2_s_and_reads_on() {
    let env = Env::start(&defaults());
    let st = stopped_holding_its_batch_reads_on(&env, &[]);
    assert!(st.ring_moves >= 1, "{st:#?}");
    assert_eq!(st.held_behind, 0, "what it held was released");
    assert!(env.log().contains("the ring moved on"), "{}", env.log());
}

/// A steady trainer, and one with `device`'s arguments stopped for 10 s
/// after 5 batches holding its last: the steady one is held at most the
/// hold limit (and slack), the stopped one, continued, reads every sample
/// once, replayed some, detached never. The stream's stats once it left.
pub(crate) fn stopped_holding_its_batch_reads_on(
    env: &Env,
    device: &[&str],
) -> batchcast::proto::StreamStats {
    let steady = steady(env);
    let stopped = env.consumer(
        &[
            &[
                "--verify",
                "--hold",
                "1",
                "--stop-after",
                "5",
                "--name",
                "stopped",
            ][..],
            device,
        ]
        .concat(),
    );
    let stop = Duration::from_secs(10);
    let (steady, stopped, finished) = steady_then_continue_after(steady, stopped, stop);
    assert_whole(&steady);
    // Alone 0.4 s; the bound 2 s; slack for a loaded machine. Held all
    // along: the stop's 10 s.
    eprintln!("steady finished {finished:?} after the stop");
    assert!(
        finished < Duration::from_secs(6),
        "steady finished {finished:?} after the stop"
    );
    assert_whole(&stopped);
    assert!(stopped.replayed_batches > 0, "{stopped:#?}");
    let s = env.gone(&["stopped"]);
    assert_eq!(s.streams[0].detached, 0);
    s.streams[0].clone()
}

/// The lockstep twin of decoupled pace's hoarder: a client speaking the
/// protocol by hand takes every batch noticed to it (its mailbox's `tail`
/// says so, truly or not) and gives none back. It claims the ring's next
/// unit itself, so a cut cannot free it: the ring moves on without what
/// it holds, and the steady reader finishes. Merged back, it hoards
/// again: one consumer holds at most one region, so then it is detached,
/// told why.
#[test]
fn a_raw_client_that_takes_every_notice_and_never_releases_holds_no_one_under_lockstep() {
    let env = Env::start(&lockstep());
    let steady = steady(&env);
    let hoard = common::hoarder(&env.socket(), Duration::from_secs(8));
    let t0 = Instant::now();
    let steady = report(steady);
    let finished = t0.elapsed();
    assert_whole(&steady);
    // Alone 0.4 s; held, the hoarder's 8 s.
    assert!(
        finished < Duration::from_secs(6),
        "steady finished {finished:?} after the hoarder subscribed"
    );
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

/// `hold_limit_s = inf` lifts the bound: the stopped trainer holds the
/// others until it is continued (lockstep as it was), and nobody is cut.
#[test]
fn without_a_hold_limit_a_stopped_trainer_holds_the_others_until_continued() {
    let env = Env::start(&lockstep().replace("hold_limit_s = 1.0", "hold_limit_s = inf"));
    let steady = steady(&env);
    let stopped = env.consumer(&["--verify", "--stop-after", "5", "--name", "stopped"]);
    wait_stopped(stopped.id());
    std::thread::sleep(Duration::from_secs(3));
    let s = env.stats();
    let c = &s.streams[0].consumers;
    let steady_batches = c.iter().find(|c| c.name == "steady").unwrap().batches;
    assert!(steady_batches < 20, "the ring is 12 units: {c:#?}");
    harness::signal(stopped.id(), SIGCONT);
    assert_whole(&report(steady));
    assert_whole(&report(stopped));
    let past = &env.gone(&["steady", "stopped"]).streams[0].past_consumers;
    assert!(past.iter().all(|c| c.cuts == 0), "{past:#?}");
}

/// Two trainers stopped at different places (after 5 and after 9
/// batches: each owes a unit of its own in the ring) hold the steady one
/// for one hold limit, not one each in turn: the bound is the stream's
/// (how long anyone has waited), so once the first is cut at the limit,
/// the second, which has kept the others waiting as long behind it, is
/// cut at once. Continued, both read every sample once.
#[test]
fn trainers_stopped_at_different_places_are_cut_by_one_bound_not_each_in_turn() {
    let env = Env::start(
        &lockstep()
            .replace("hold_limit_s = 1.0", "hold_limit_s = 3.0")
            .replace("min_consumers = 2", "min_consumers = 3"),
    );
    let steady = steady(&env);
    let stopped: Vec<_> = [("first", "5"), ("second", "9")]
        .into_iter()
        .map(|(name, after)| env.consumer(&["--verify", "--stop-after", after, "--name", name]))
        .collect();
    for s in &stopped {
        wait_stopped(s.id());
    }
    let t0 = Instant::now();
    let steady = report(steady);
    let finished = t0.elapsed();
    for s in &stopped {
        harness::signal(s.id(), SIGCONT);
    }
    assert_whole(&steady);
    // Alone 0.4 s; one limit 3 s; one limit each in turn 6 s.
    assert!(
        finished < Duration::from_secs(5),
        "steady finished {finished:?} after both stopped: held once for each\n{}",
        env.log()
    );
    for s in stopped {
        let r = report(s);
        assert_whole(&r);
        assert!(r.replayed_batches > 0, "{r:#?}");
    }
    assert_eq!(env.stats().streams[0].detached, 0);
}

/// The default pace moves the ring away from a crawling holder ahead of
/// the hold limit only where a region can be had: with the budget of the
/// test below full, a trainer crawling through 600 ms steps with its batch
/// held (longer than the 0.25 s a replay is priced at here, shorter than
/// the 2 s limit) is waited for, as lockstep does, and never detached.
/// (Moved at the stall cut whatever the budget, it was detached at its
/// first slow step.)
#[test]
fn at_the_defaults_a_crawling_holder_the_ring_cannot_leave_is_waited_for_not_detached() {
    let env = Env::start(FULL_BUDGET);
    let steady = env.consumer(&STEADY_OF_ONE);
    let crawler = env.consumer(&[
        "--verify",
        "--window",
        "2",
        "--hold",
        "1",
        "--sleep-ms",
        "600",
        "--max-batches",
        "6",
        "--name",
        "crawler",
    ]);
    let crawler = report(crawler);
    assert!(
        crawler.ok && crawler.error_code.is_none() && crawler.batches == 6,
        "{crawler:#?}"
    );
    assert_eq!(crawler.verify_failures, 0, "{crawler:#?}");
    let steady = report(steady);
    assert!(steady.ok && steady.ended, "{steady:#?}");
    assert_eq!(steady.verified_samples, 40 * 16);
    assert_eq!(env.stats().streams[0].detached, 0);
}

/// A steady reader with a window of one batch (a replay arena of one
/// batch and two more, as the full budgets of these tests and of
/// `device.rs` are sized for).
pub(crate) const STEADY_OF_ONE: [&str; 7] = [
    "--verify",
    "--window",
    "1",
    "--sleep-ms",
    "2",
    "--name",
    "steady",
];

/// A stream whose arena the memory budget can hold once, with no room
/// for a second region (see the test below).
const FULL_BUDGET: &str = "[broker]\nmemory_mib = 70\nmax_connections = 16\n\n[[stream]]\nname = \"train\"\n\
               batch_size = 4\nslots = 8\nepochs = 40\nmin_consumers = 2\n\n\
               [stream.synthetic]\nlen = 16\nfill = \"stamp\"\n\
               fields = [{ name = \"x\", dtype = \"u8\", shape = [1048576] }]\n";

/// A held batch moves the ring only where the holder's uid can pay for the
/// region it needs: with the memory budget full (the stream's 32 MiB
/// arena, replay arenas of 12 and 16 MiB (windows of 1 and 2 batches, and
/// 2 more), frame buffers: about 61 of 70 MiB, no room for another 32 MiB
/// region), a trainer stopped holding its batch is
/// detached at the hold limit instead, told that the budget had no room,
/// and the steady one goes on.
#[test]
fn a_holder_whose_uid_cannot_pay_for_a_region_is_detached_and_told_the_budget_is_full() {
    let env = Env::start(FULL_BUDGET);
    let steady = env.consumer(&STEADY_OF_ONE);
    let stopped = env.consumer(&[
        "--verify",
        "--window",
        "2",
        "--hold",
        "1",
        "--stop-after",
        "5",
        "--name",
        "stopped",
    ]);
    let (steady, stopped, finished) =
        steady_then_continue_after(steady, stopped, Duration::from_secs(8));
    assert!(steady.ok && steady.ended, "{steady:#?}");
    assert_eq!(steady.verified_samples, 40 * 16);
    assert!(
        finished < Duration::from_secs(6),
        "steady finished {finished:?} after the stop"
    );
    assert_eq!(
        stopped.error_code.as_deref(),
        Some("HoldLimit"),
        "{stopped:#?}"
    );
    let why = stopped.error.clone().unwrap_or_default();
    assert!(
        why.contains("could not move on without it") && why.contains("memory budget"),
        "{why}"
    );
    assert_eq!(stopped.verify_failures, 0, "{stopped:#?}");
    let s = env.stats();
    assert_eq!((s.streams[0].ring_moves, s.streams[0].detached), (0, 1));
}
