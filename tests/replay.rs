//! End-to-end tests of replay: the real broker, real consumer processes.
//! A trainer that joins mid-epoch with `join = "now"` gets a complete first
//! epoch (the part already published recomputed for it alone, byte for
//! byte what the shared pipeline made), wherever in the epoch it joins; a
//! trainer resuming from a checkpoint position starts exactly there; a
//! replaying trainer killed mid-replay leaves nothing behind; a stream that
//! cannot replay says so.

use std::collections::BTreeSet;
use std::io::Write;

use batchcast::proto::{self, ClientMsg, ErrorCode, Release, ServerMsg};
use batchcast_broker::config::StreamToml;
use batchcast_cli::report::ConsumerReport;

use crate::common;

use common::{Env, report};

/// 400 samples an epoch in units of 40 (10 units), endless, 8 slots.
pub(crate) fn config(extra: &str) -> String {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    StreamToml::synthetic("train", 40, 400, &fields)
        .key("seed", 11)
        .key("slots", 8)
        .key("workers", 2)
        .key("shuffle", true)
        .raw(extra)
        .to_toml()
}

const UNIT: u64 = 40;
const PER_EPOCH: u64 = 400;

/// Units the stream has made, once it stays put: nobody is subscribed
/// (so nothing new starts) and no slot is being filled (what had started
/// is published). A state, not a pause in the counts.
fn paused_at(env: &Env) -> u64 {
    let s = env.wait_for("the stream to stand still", |s| {
        s.streams[0].consumers.is_empty() && s.streams[0].filling == 0
    });
    s.streams[0].batches_produced
}

/// A broker whose stream stands mid-epoch (a first consumer read `read`
/// batches and left), and a consumer `steady` that joins immediately and
/// verifies `steady_batches` batches.
fn mid_epoch_with_a_steady_reader(read: u64, steady_batches: u64) -> (Env, std::process::Child) {
    let env = Env::start(&config(""));
    let r = report(env.consumer(&["--max-batches", &read.to_string()]));
    assert!(r.ok, "{r:#?}");
    paused_at(&env);
    let n = steady_batches.to_string();
    let steady = env.consumer(&[
        "--join",
        "immediate",
        "--verify",
        "--max-batches",
        &n,
        "--name",
        "steady",
    ]);
    (env, steady)
}

fn epochs(r: &ConsumerReport) -> Vec<(u64, u64, bool)> {
    r.epochs
        .iter()
        .map(|e| (e.epoch, e.samples, e.complete))
        .collect()
}

#[test]
fn joining_now_at_every_position_of_an_epoch_gives_a_complete_first_epoch_of_the_same_bytes() {
    let env = Env::start(&config(""));
    joining_now_at_every_position_of_an_epoch(&env, &[]);
}

/// Consumers (with `device`'s arguments) join now at every unit of an
/// epoch; its device twin is in `device.rs`.
pub(crate) fn joining_now_at_every_position_of_an_epoch(env: &Env, device: &[&str]) {
    let b: u64 = 32;
    let per_epoch_batches = PER_EPOCH.div_ceil(b);
    let mut seen = BTreeSet::new();
    let units = PER_EPOCH / UNIT;
    // How far the pipeline runs ahead of a reader that reads slowly: the
    // ring's slots, less what it holds; learned as it goes.
    let mut ahead = 8;
    let mut produced = paused_at(env);
    for round in 0..40 {
        let Some(target) = (0..units).find(|k| !seen.contains(k)) else {
            break;
        };
        // Move the stream to unit `target` of an epoch with a consumer that
        // joins immediately, reads m batches slowly (the ring fills before
        // each read) and leaves; the stream pauses.
        if produced % units != target {
            let m = match (target + 3 * units - produced % units - ahead % units) % units {
                0 => units,
                m => m,
            };
            let pacer = env.consumer(&[
                "--join",
                "immediate",
                "--max-batches",
                &m.to_string(),
                "--sleep-ms",
                "3",
            ]);
            let r = report(pacer);
            assert!(r.ok, "{r:#?}");
            let before = produced;
            produced = paused_at(env);
            ahead = (produced - before).saturating_sub(m);
        }
        let at = produced % units;
        let epoch = produced / units;
        // Joins now, reads its first epoch, leaves: through its mailbox or
        // on the socket, keeping or dropping the epoch's short last batch.
        let mut args = vec!["--join", "now", "--verify", "--batch-size", "32"];
        args.extend(["--max-epochs", "1"]);
        let socket = round % 2 == 1;
        let drop_last = round % 3 == 2;
        if socket {
            args.push("--no-mailbox");
        }
        if drop_last {
            args.push("--drop-last");
        }
        args.extend_from_slice(device);
        let r = report(env.consumer(&args));
        let what = format!(
            "joined at unit {at} of epoch {epoch} (socket {socket}, drop_last {drop_last})"
        );
        assert!(r.ok, "{what}: {r:#?}");
        let samples = if drop_last {
            PER_EPOCH / b * b
        } else {
            PER_EPOCH
        };
        assert_eq!(
            epochs(&r),
            vec![(epoch, samples, true)],
            "{what}: a complete first epoch"
        );
        assert_eq!(
            r.verified_samples, samples,
            "every byte as the stream makes it"
        );
        assert_eq!(r.views_outside_arena, 0, "replayed batches are views too");
        assert_eq!(
            r.replayed_batches,
            (at * UNIT).div_ceil(b).min(per_epoch_batches),
            "{what}: replays up to its first batch boundary past it"
        );
        seen.insert(at);
        produced = paused_at(env);
    }
    assert_eq!(
        seen.len() as u64,
        PER_EPOCH / UNIT,
        "joins at every unit of an epoch: {seen:?}"
    );
    // Once the broker has seen the last joiner leave (its report can come
    // first), its replay arena is given back.
    let s = env.wait_for("every replay arena to be given back", |s| {
        s.memory.replay_bytes == 0
    });
    let past = &s.streams[0].past_consumers;
    assert!(
        past.iter().any(|c| c.replayed > 0 && c.replay_cpu_s > 0.0),
        "stats count replayed samples and their CPU: {past:#?}"
    );
}

#[test]
fn a_trainer_resumes_at_a_checkpoint_position_behind_or_ahead_of_the_stream() {
    let env = Env::start(&config(""));
    resumes_at_a_checkpoint_position_behind_or_ahead(&env, &[]);
}

/// A trainer (with `device`'s arguments) resumes behind the stream and
/// ahead of it; its device twin is in `device.rs`.
pub(crate) fn resumes_at_a_checkpoint_position_behind_or_ahead(env: &Env, device: &[&str]) {
    let with = |args: &[&str]| -> Vec<String> {
        args.iter().chain(device).map(|a| a.to_string()).collect()
    };
    let consumer = |args: &[&str]| {
        let args = with(args);
        env.consumer(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    // Run the stream into its third epoch, then stop.
    let r = report(env.consumer(&["--max-batches", "25"]));
    assert!(r.ok, "{r:#?}");
    let produced = paused_at(env);
    assert!(produced >= 25);
    // Behind: from sample 50 of epoch 0, through epoch 1, into the shared
    // stream; batches of 16 from there.
    let r = report(consumer(&[
        "--resume",
        "0:50",
        "--verify",
        "--batch-size",
        "16",
        "--max-epochs",
        "2",
    ]));
    assert!(r.ok, "{r:#?}");
    let e = epochs(&r);
    assert_eq!(e[0], (0, 350, false), "resumed mid-epoch 0: {e:?}");
    assert_eq!(e[1], (1, 400, true), "{e:?}");
    assert_eq!(r.verified_samples, r.samples);
    assert!(r.replayed_batches >= 22 + 25, "{r:#?}");
    // Ahead: epoch 9, sample 120: waited for, nothing before it.
    let at = paused_at(env);
    assert!(
        at < 9 * 10,
        "the stream is at unit {at}, not yet at epoch 9: {:#?}",
        env.stats().streams[0].past_consumers
    );
    let r = report(consumer(&[
        "--resume",
        "9:120",
        "--verify",
        "--max-batches",
        "3",
    ]));
    assert!(r.ok, "{r:#?}");
    assert_eq!(r.replayed_batches, 0);
    assert_eq!(epochs(&r), vec![(9, 120, false)]);
    // A position outside the epoch is refused, naming it.
    let r = report(consumer(&["--resume", "0:400"]));
    assert!(!r.ok);
    let err = r.error.unwrap_or_default();
    assert!(err.contains("400 samples"), "{err}");
    // So is an epoch past what a stream counts (a forged state).
    let r = report(env.consumer(&["--resume", &format!("{}:0", u64::MAX)]));
    assert!(!r.ok, "{r:#?}");
    let err = r.error.unwrap_or_default();
    assert!(err.contains("no stream counts epoch"), "{err}");
    assert!(env.stats().streams[0].failed.is_none());
}

#[test]
fn a_consumer_killed_while_replaying_leaves_nothing_behind_and_others_go_on() {
    let (env, steady) = mid_epoch_with_a_steady_reader(7, 60);
    // Resumes from the start of epoch 0 (far behind: it replays for a long
    // while), holding two batches and reading slowly.
    let mut victim = env.consumer(&[
        "--resume",
        "0:0",
        "--batch-size",
        "8",
        "--window",
        "3",
        "--hold",
        "2",
        "--sleep-ms",
        "200",
        "--name",
        "victim",
    ]);
    env.wait_for("the victim to be replayed to", |s| {
        s.streams[0]
            .consumers
            .iter()
            .any(|c| c.name == "victim" && c.replayed > 0)
            && s.memory.replay_bytes > 0
    });
    common::sigkill(&mut victim);
    let r = report(steady);
    assert!(r.ok && r.verified_samples == r.samples, "{r:#?}");
    let s = env.wait_for("the victim to be gone", |s| {
        s.streams[0].consumers.is_empty()
    });
    assert_eq!(s.memory.replay_bytes, 0, "its replay arena went back");
    assert_eq!(s.streams[0].in_use, 0, "every slot came back");
}

#[test]
fn a_forged_release_of_a_replayed_batch_ends_only_that_consumer() {
    let (env, steady) = mid_epoch_with_a_steady_reader(5, 40);
    // Resumes from the stream's start on the socket, by hand: granted
    // replay (the replay arena's fd after the arena's), it releases a
    // replayed batch it never got.
    let (mut sock, welcome, fds) = common::raw_subscribe(
        &env.socket(),
        "forger",
        false,
        batchcast::JoinPolicy::Now,
        Some(proto::Position::default()),
    );
    let grant = welcome.replay.expect("behind the stream: replay granted");
    assert!(
        grant.to > grant.from && fds.len() == 2,
        "{grant:?}, {} fds",
        fds.len()
    );
    let s = forged_release_ends_only_the_forger(&env, &mut sock, steady);
    assert_eq!(s.memory.replay_bytes, 0, "its replay arena went back");
}

/// The forger on `sock` releases a replayed batch it never got: it alone
/// is refused (`InvalidRequest`, naming the batch) and ended, `steady`
/// reads its 40 batches unaffected. The stats once the forger is gone.
pub(crate) fn forged_release_ends_only_the_forger(
    env: &Env,
    sock: &mut std::os::unix::net::UnixStream,
    steady: std::process::Child,
) -> batchcast::proto::StatsReply {
    let forged = ClientMsg::Release(Release {
        unit: batchcast::proto::Unit::Replayed(999),
        wait_ns: 0,
        busy_ns: 0,
        taken: Default::default(),
    });
    sock.write_all(&proto::encode(&forged).unwrap()).unwrap();
    let error = loop {
        match proto::read_frame::<ServerMsg>(sock, &mut Vec::new()) {
            Ok(Some(ServerMsg::Error(e))) => break e,
            Ok(Some(_)) => {}
            other => panic!("the connection ended without an error: {other:?}"),
        }
    };
    assert_eq!(error.code, ErrorCode::InvalidRequest);
    assert!(
        error.message.contains("replayed batch 999 is not held"),
        "{}",
        error.message
    );
    let r = report(steady);
    assert!(
        r.ok && r.batches == 40 && r.verified_samples == r.samples,
        "the others are unaffected: {r:#?}"
    );
    env.wait_for("the forger to be gone", |s| {
        s.streams[0].consumers.is_empty()
    })
}

/// A ring larger than the whole run: the pipeline has made every epoch
/// before the trainers finished the first. A trainer joining with
/// `join = "now"` joins where the trainers read, not where the pipeline
/// is: it gets every epoch its peers still have ahead, taking from the
/// ring what it still holds (the start of the epoch before the oldest
/// batch held is all that is replayed).
#[test]
fn joining_now_joins_where_the_trainers_read_when_the_ring_is_ahead() {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    let env = Env::start(
        &StreamToml::synthetic("train", 8, 64, &fields)
            .key("seed", 11)
            .key("slots", 40)
            .key("workers", 2)
            .key("epochs", 3)
            .key("min_consumers", 4)
            .to_toml(),
    );
    let peers: Vec<_> = (0..4)
        .map(|i| {
            env.consumer(&[
                "--verify",
                "--sleep-ms",
                "30",
                "--name",
                &format!("peer{i}"),
            ])
        })
        .collect();
    // The pipeline runs ahead: it makes the whole run while the peers,
    // 30 ms a batch, read their first few (waited for, not assumed: on a
    // loaded machine its threads start later than the peers read).
    let s = env.wait_for("the peers a few batches in, the pipeline far ahead", |s| {
        s.streams[0]
            .consumers
            .iter()
            .filter(|c| c.batches >= 3)
            .count()
            == 4
            && s.streams[0].batches_produced >= 20
    });
    assert!(
        s.streams[0].consumers.iter().all(|c| c.taken.batches < 8),
        "the peers' programs still in their first epoch: {:#?}",
        s.streams[0]
    );
    let late = report(env.consumer(&["--verify", "--join", "now", "--name", "late"]));
    assert!(late.ok && late.ended, "{late:#?}");
    assert_eq!(late.verified_samples, late.samples);
    assert!(late.order_errors.is_empty(), "{:?}", late.order_errors);
    let epochs: Vec<(u64, u64, bool)> = late
        .epochs
        .iter()
        .map(|e| (e.epoch, e.samples, e.complete))
        .collect();
    assert_eq!(
        epochs,
        vec![(0, 64, true), (1, 64, true), (2, 64, true)],
        "every epoch its peers had ahead"
    );
    // Only the start of epoch 0 before the oldest batch the ring held was
    // recomputed, not whole epochs.
    assert!(late.replayed_batches < 8, "{late:#?}");
    assert!(late.first_batch_s < 1.0, "{late:#?}");
    for p in peers {
        let r = report(p);
        assert!(r.ok && r.samples == 3 * 64, "{r:#?}");
    }
}

/// docs (replay's limits): replay is paced by its consumer's releases,
/// `window + 2` of its batches ahead: a joiner that read one batch and
/// pauses is not replayed the rest of its epoch meanwhile.
#[test]
fn replay_runs_at_most_window_plus_two_batches_ahead_of_its_reader() {
    let env = Env::start(&config(""));
    // The stream stands at unit 6 or later of its epoch: at least 240
    // samples to replay, more than the 160 the pacing allows ahead.
    let mut produced = paused_at(&env);
    for _ in 0..40 {
        if produced % (PER_EPOCH / UNIT) >= 6 {
            break;
        }
        let r = report(env.consumer(&["--join", "immediate", "--max-batches", "1"]));
        assert!(r.ok, "{r:#?}");
        produced = paused_at(&env);
    }
    assert!(produced % (PER_EPOCH / UNIT) >= 6, "stands at {produced}");
    let epoch = produced / (PER_EPOCH / UNIT);
    let joiner = env.consumer(&[
        "--join",
        "now",
        "--verify",
        "--batch-size",
        "32",
        "--window",
        "2",
        "--stall-after",
        "1",
        "--stall-ms",
        "3000",
        "--max-epochs",
        "1",
        "--name",
        "joiner",
    ]);
    let replayed = |s: &proto::StatsReply| {
        s.streams[0]
            .consumers
            .iter()
            .find(|c| c.name == "joiner")
            .map_or(0, |c| c.replayed)
    };
    // One batch read and released, window 2 + 2 more made: 5 × 32.
    let bound = 5 * 32;
    env.wait_for("the joiner's replay to fill its window", |s| {
        replayed(s) >= bound
    });
    // It stays there while the joiner pauses (were replay not paced by its
    // releases, all 360 samples would be made now).
    std::thread::sleep(std::time::Duration::from_millis(500));
    let s = env.stats();
    assert!(
        s.streams[0].consumers.iter().any(|c| c.name == "joiner"),
        "still paused"
    );
    assert_eq!(replayed(&s), bound);
    let r = report(joiner);
    assert!(r.ok && r.verified_samples == r.samples, "{r:#?}");
    assert_eq!(epochs(&r), vec![(epoch, 400, true)]);
}

/// docs (replay's limits): under lockstep a joiner is a member of the
/// stream while it is replayed to, and the lag limit detaches it like
/// anyone when it stalls there.
#[test]
fn the_lag_limit_detaches_a_replayed_joiner_that_stalls() {
    let env = Env::start(&config("lag_limit = 2"));
    let r = report(env.consumer(&["--max-batches", "9"]));
    assert!(r.ok, "{r:#?}");
    paused_at(&env);
    // Still reading (100 batches at 20 ms) while the joiner stalls.
    let steady = env.consumer(&[
        "--join",
        "immediate",
        "--verify",
        "--sleep-ms",
        "20",
        "--max-batches",
        "100",
        "--name",
        "steady",
    ]);
    env.wait_for("the steady reader to read", |s| {
        s.streams[0].consumers.iter().any(|c| c.delivered > 0)
    });
    let joiner = env.consumer(&[
        "--join",
        "now",
        "--stall-after",
        "1",
        "--stall-ms",
        "6000",
        "--max-batches",
        "20",
        "--name",
        "joiner",
    ]);
    let joiner = report(joiner);
    assert_eq!(
        joiner.error_code.as_deref(),
        Some("LagLimit"),
        "{joiner:#?}"
    );
    let steady = report(steady);
    assert!(
        steady.ok && steady.batches == 100 && steady.verified_samples == steady.samples,
        "{steady:#?}"
    );
}
