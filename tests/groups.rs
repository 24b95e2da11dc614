//! Groups: the ranks of a data-parallel trial split a stream among them
//! (each sample once per epoch across the group, every rank as many
//! batches), while other groups and plain consumers of the same stream
//! still receive everything. Real broker, real consumer processes.

use std::collections::BTreeMap;

use batchcast::deal::Deal;
use batchcast::proto::StatsReply;
use batchcast_broker::config::StreamToml;
use batchcast_cli::harness;
use batchcast_cli::report::ConsumerReport;

use crate::common;

use common::{Env, report};

/// 203 samples an epoch (no batch size divides it) in units of 8, shuffled,
/// 2 epochs; `consumers` start it together.
pub(crate) fn config(consumers: u32) -> String {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 4, 4]), ("label", "i64", &[])];
    StreamToml::synthetic("train", 8, 203, &fields)
        .epochs(2)
        .key("seed", 5)
        .key("slots", 12)
        .key("max_batch_size", 8)
        .key("min_consumers", consumers)
        .fill("full")
        .to_toml()
}

/// A member's batches, per epoch: (first sample, samples).
fn runs(r: &ConsumerReport) -> BTreeMap<u64, Vec<(u64, u64)>> {
    r.epochs
        .iter()
        .map(|e| (e.epoch, e.positions.clone()))
        .collect()
}

/// What the deal gives `rank` of a group in an epoch.
fn dealt(deal: Deal) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for f in 0..deal.n {
        if let Some(d) = deal.run_at(f).filter(|d| d.mine)
            && out.last() != Some(&(d.start, d.end - d.start))
        {
            out.push((d.start, d.end - d.start));
        }
    }
    out
}

/// Stats once the broker has recorded `n` group members as gone (a
/// member's report can come before the broker sees its connection close).
fn members_gone(env: &Env, n: usize) -> StatsReply {
    env.wait_for(&format!("{n} members to be recorded as gone"), |s| {
        s.streams[0]
            .past_consumers
            .iter()
            .filter(|c| c.group.is_some())
            .count()
            >= n
    })
}

fn member(env: &Env, group: &str, rank: u32, world: u32, extra: &[&str]) -> std::process::Child {
    let (rank, world) = (rank.to_string(), world.to_string());
    let mut args = vec![
        "--verify",
        "--positions",
        "--group",
        group,
        "--rank",
        &rank,
        "--world",
        &world,
    ];
    args.extend_from_slice(extra);
    env.consumer(&args)
}

#[test]
fn a_groups_ranks_split_each_epoch_while_others_receive_everything() {
    let env = Env::start(&config(6));
    ranks_split_each_epoch_while_others_receive_everything(&env, [&[], &[], &[]]);
}

/// Trial A: 3 ranks of the stream's batch size; trial B: 2 ranks of 5,
/// replicated in pairs (4 ranks, 2 data ranks); and a plain consumer;
/// each with `device`'s arguments (A's, B's, the plain one's). Its device
/// twin is in `device.rs`.
pub(crate) fn ranks_split_each_epoch_while_others_receive_everything(
    env: &Env,
    device: [&[&str]; 3],
) {
    let a: Vec<_> = (0..3)
        .map(|r| member(env, "trial-a", r, 3, device[0]))
        .collect();
    let b: Vec<_> = (0..2)
        .map(|r| {
            let mut args = vec!["--batch-size", "5", "--replicate", "2", "--no-mailbox"];
            args.extend_from_slice(device[1]);
            member(env, "trial-b", r, 4, &args)
        })
        .collect();
    let mut args = vec!["--verify", "--positions"];
    args.extend_from_slice(device[2]);
    let plain = env.consumer(&args);
    let check = |kids: Vec<std::process::Child>, world: u32, replicate: u32, batch: u64| {
        let mut seen = BTreeMap::<u64, Vec<u32>>::new();
        for (rank, kid) in kids.into_iter().enumerate() {
            let r = report(kid);
            assert!(r.ok && r.ended, "{r:#?}");
            assert_eq!(r.verify_failures, 0, "{r:#?}");
            assert!(r.order_errors.is_empty(), "{r:#?}");
            let deal = Deal::new(203, batch, (rank as u32, world, replicate), false);
            for (epoch, got) in runs(&r) {
                assert_eq!(got, dealt(deal), "rank {rank} epoch {epoch}");
                assert_eq!(got.len() as u64, deal.batches_per_epoch());
                let counts = seen.entry(epoch).or_insert_with(|| vec![0; 203]);
                for (first, n) in got {
                    for f in first..first + n {
                        counts[f as usize] += 1;
                    }
                }
            }
        }
        assert_eq!(seen.len(), 2, "both epochs");
        seen
    };
    // A: every sample once per epoch across its ranks.
    for (epoch, counts) in check(a, 3, 1, 8) {
        assert!(counts.iter().all(|&c| c == 1), "epoch {epoch}: {counts:?}");
    }
    // B's two members are ranks 0 and 1 of world 4, replicate 2: the same
    // data rank, so both read data rank 0's share, and nothing of rank 1's.
    for (epoch, counts) in check(b, 4, 2, 5) {
        let want = dealt(Deal::new(203, 5, (0, 4, 2), false));
        let mut expect = vec![0u32; 203];
        for (first, n) in want {
            for f in first..first + n {
                expect[f as usize] = 2;
            }
        }
        assert_eq!(counts, expect, "epoch {epoch}");
    }
    let r = report(plain);
    assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
    for e in &r.epochs {
        assert_eq!(
            e.samples, 203,
            "the plain consumer reads everything: {r:#?}"
        );
    }
    // Stats count each member's own batches and samples, and show its seat
    // (once the broker has seen each leave: a report can come first).
    let st = members_gone(env, 3);
    for r in 0..3u32 {
        let seat = format!("trial-a {r}/3");
        let c = st.streams[0]
            .past_consumers
            .iter()
            .find(|c| c.group.as_deref() == Some(seat.as_str()))
            .unwrap_or_else(|| panic!("{seat} in {st:#?}"));
        let mine = dealt(Deal::new(203, 8, (r, 3, 1), false));
        assert_eq!(c.batches, 2 * mine.len() as u64, "{c:#?}");
        assert_eq!(
            c.samples,
            2 * mine.iter().map(|&(_, n)| n).sum::<u64>(),
            "{c:#?}"
        );
    }
}

#[test]
fn a_seat_is_taken_once_and_a_group_deals_alike() {
    let env = Env::start(&config(1));
    let first = member(&env, "t", 1, 2, &["--sleep-ms", "20"]);
    env.wait_for("the first member", |s| s.streams[0].consumers.len() == 1);
    let refused = |extra: &[&str], rank: u32, world: u32| {
        let r = report(member(&env, "t", rank, world, extra));
        assert!(!r.ok, "{r:#?}");
        r.error.unwrap_or_default()
    };
    let msg = refused(&[], 1, 2);
    assert!(msg.contains("rank 1 is taken by"), "{msg}");
    let msg = refused(&[], 0, 3);
    assert!(msg.contains("has world 2"), "{msg}");
    let msg = refused(&["--batch-size", "4"], 0, 2);
    assert!(msg.contains("share one batch size"), "{msg}");
    let msg = refused(&[], 2, 2);
    assert!(msg.contains("rank 2 outside its world of 2"), "{msg}");
    let msg = refused(&["--replicate", "3"], 0, 2);
    assert!(msg.contains("replicate 3 must divide"), "{msg}");
    // Another group, and a plain consumer, are not held to it.
    let other = report(member(&env, "u", 1, 2, &["--batch-size", "4"]));
    assert!(other.ok, "{other:#?}");
    let r = report(first);
    assert!(r.ok && r.ended, "{r:#?}");
}

#[test]
fn a_forged_seat_is_refused_by_the_broker() {
    use batchcast::proto::{self, ErrorCode, Preamble, Seat};
    let env = Env::start(&config(1));
    let hello = |seat: Seat| {
        let hello = proto::ClientMsg::Hello(proto::Hello {
            name: "forged".into(),
            pid: std::process::id(),
            intent: proto::Intent::Consume(proto::ConsumeRequest {
                stream: "train".into(),
                window: 2,
                join: batchcast::JoinPolicy::NextEpoch,
                device: None,
                mailbox: false,
                batch_size: None,
                drop_last: None,
                resume: None,
                rotation: None,
                expect: None,
                group: Some(Box::new(seat)),
                serial: 0,
                taken: Default::default(),
            }),
        });
        let mut bytes = Preamble::ours().to_bytes().to_vec();
        bytes.extend_from_slice(&proto::encode(&hello).unwrap());
        common::raw_exchange(&env.socket(), &bytes).1
    };
    let seat = |rank, world, replicate| Seat {
        name: "t".into(),
        rank,
        world,
        replicate,
    };
    for (s, needle) in [
        (seat(5, 2, 1), "rank 5 outside its world of 2"),
        (seat(0, 0, 1), "world 0 must be 1 to"),
        (seat(0, 4, 0), "replicate 0 must divide"),
        (
            Seat {
                name: "bad\u{1b}[2J".into(),
                ..seat(0, 1, 1)
            },
            "control character",
        ),
    ] {
        common::expect_error(hello(s), ErrorCode::InvalidRequest, needle);
    }
    // Nothing was seated: a good member still takes rank 0.
    let r = report(member(&env, "t", 0, 1, &["--max-batches", "3"]));
    assert!(r.ok, "{r:#?}");
}

#[test]
fn members_killed_mid_epoch_resume_their_own_share_by_replay() {
    let env = Env::start(&config(3));
    // A plain consumer keeps the stream going while the group is away.
    let plain = env.consumer(&["--verify", "--positions", "--sleep-ms", "30"]);
    // Both ranks of 2 checkpoint every batch, stall after 5 of their
    // batches (epoch 0, 10 units in) and are killed there.
    let states: Vec<_> = (0..2)
        .map(|r| env.path(&format!("rank{r}.state")))
        .collect();
    let files: Vec<&str> = states.iter().map(|s| s.to_str().unwrap()).collect();
    let stalled = ["--stall-after", "5", "--stall-ms", "60000"];
    let mut kids: Vec<_> = (0..2u32)
        .map(|r| {
            let mut args = vec!["--state-file", files[r as usize]];
            args.extend_from_slice(&stalled);
            member(&env, "t", r, 2, &args)
        })
        .collect();
    let t0 = std::time::Instant::now();
    for state in &states {
        while !batchcast_cli::report::SavedState::load(state)
            .is_ok_and(|s| (s.epoch.epoch, s.epoch.positions.len()) == (0, 5))
        {
            assert!(t0.elapsed() < common::LIMIT, "a member never stood still");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    for kid in &mut kids {
        common::sigkill(kid);
    }
    // The stream moves on past where they stood (unit 10) without them:
    // the ring no longer holds their places.
    env.wait_for("the plain consumer to move on", |s| {
        s.streams[0]
            .consumers
            .iter()
            .any(|c| c.group.is_none() && c.batches >= 24)
    });
    // Each takes its seat back and goes on from its state: its share of
    // both epochs exactly (epoch 0 carried over from the state), what the
    // stream passed replayed, in its own runs.
    let resumed: Vec<_> = (0..2u32)
        .map(|r| member(&env, "t", r, 2, &["--resume-state", files[r as usize]]))
        .collect();
    // A member of another group joining now, mid-stream: its first epoch
    // whole, from that epoch's start.
    let late = member(&env, "late", 1, 2, &["--join", "now"]);
    for (rank, kid) in resumed.into_iter().enumerate() {
        let r = report(kid);
        assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
        assert!(r.order_errors.is_empty(), "{r:#?}");
        assert!(r.replayed_batches > 0, "{r:#?}");
        let want = dealt(Deal::new(203, 8, (rank as u32, 2, 1), false));
        assert_eq!(
            runs(&r),
            BTreeMap::from([(0, want.clone()), (1, want)]),
            "rank {rank}: {r:#?}"
        );
    }
    let r = report(late);
    assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
    assert!(r.order_errors.is_empty(), "{r:#?}");
    let want = dealt(Deal::new(203, 8, (1, 2, 1), false));
    assert!(!r.epochs.is_empty(), "{r:#?}");
    for e in &r.epochs {
        assert_eq!(e.positions, want, "epoch {}: {r:#?}", e.epoch);
    }
    let r = report(plain);
    assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
    // After the stream's end, a place behind it is replayed too: its
    // share of epoch 1, each run once.
    let r = report(member(&env, "t", 0, 2, &["--resume", "1:0"]));
    assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
    let want = dealt(Deal::new(203, 8, (0, 2, 1), false));
    assert_eq!(runs(&r), BTreeMap::from([(1, want)]), "{r:#?}");
}

#[test]
fn a_member_whose_window_the_slots_cannot_hold_is_told_what_to_size() {
    let fields: [(&str, &str, &[u64]); 1] = [("x", "u8", &[4])];
    let env = Env::start(
        &StreamToml::synthetic("train", 8, 64, &fields)
            .epochs(1)
            .key("slots", 4)
            .to_toml(),
    );
    let r = report(member(&env, "t", 0, 2, &[]));
    let msg = r.error.unwrap_or_default();
    assert!(
        msg.contains("may span 6 of stream `train`'s 4 slots") && msg.contains("slots = 6"),
        "{msg}"
    );
    let r = report(member(&env, "t", 0, 2, &["--window", "1"]));
    assert!(r.ok && r.ended, "{r:#?}");
    // 8 ranks: a member's runs lie 8 units apart, so holding one while
    // it waits for the next spans 9 to 10 slots (with window 1), though
    // it holds only 2 units; told to give a unit one batch of each rank.
    let r = report(member(&env, "wide", 0, 8, &["--window", "1"]));
    let msg = r.error.unwrap_or_default();
    assert!(
        msg.contains("may span 10 of stream `train`'s 4 slots")
            && msg.contains("batch_size = 64 in its config"),
        "{msg}"
    );
}

/// `lag_limit` counts a consumer's own window: the docs' example
/// (`lag_limit = 4`) seats the members of a group with the default window
/// (2 of their runs span 6 of the stream's units) and consumers of another
/// batch size (2 batches of 24 span 12 units of 8), and detaches none of
/// them for what their windows span; a window above the limit is refused
/// in the consumer's own batches. (Each pair reads at one pace, 50 ms a
/// batch, on a stream of its own: one consistently slower than another
/// falls the ring behind, which is what the limit bounds.)
#[test]
fn lag_limit_4_seats_members_and_own_batch_sizes_with_the_default_window() {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 4, 4]), ("label", "i64", &[])];
    let stream = |name| {
        StreamToml::synthetic(name, 8, 203, &fields)
            .epochs(2)
            .key("seed", 5)
            .key("slots", 16)
            .key("max_batch_size", 24)
            .key("min_consumers", 2)
            .key("lag_limit", 4)
            .fill("full")
            .to_toml()
    };
    let env = Env::start(&format!("{}\n{}", stream("train"), stream("own")));
    let r = report(member(&env, "g", 0, 2, &["--window", "5"]));
    let msg = r.error.unwrap_or_default();
    assert!(
        msg.contains("window 5 exceeds the stream's lag_limit of 4"),
        "{msg}"
    );
    let pace = ["--sleep-ms", "50"];
    let members: Vec<_> = (0..2).map(|r| member(&env, "g", r, 2, &pace)).collect();
    let own: Vec<_> = (0..2)
        .map(|_| {
            env.consumer(&[
                "--stream",
                "own",
                "--verify",
                "--batch-size",
                "24",
                "--sleep-ms",
                "50",
            ])
        })
        .collect();
    for (rank, kid) in members.into_iter().enumerate() {
        let r = report(kid);
        assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
        let want = dealt(Deal::new(203, 8, (rank as u32, 2, 1), false));
        assert_eq!(runs(&r), BTreeMap::from([(0, want.clone()), (1, want)]));
    }
    for kid in own {
        let r = report(kid);
        assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
        assert!(r.epochs.iter().all(|e| e.samples == 203), "{r:#?}");
    }
    let st = env.stats();
    assert!(st.streams.iter().all(|s| s.detached == 0), "{st:#?}");
}

#[test]
fn a_group_rides_through_broker_restarts_each_member_with_its_own_share() {
    let mut env = Env::start(&config(2));
    // 40 ms a batch: after the second broker has sent them 6, the members
    // still read for half a second or more, the time the restart needs
    // on a busy machine (at 10 ms CI once saw a member finish first).
    let ride = ["--reconnect-timeout", "30", "--sleep-ms", "40"];
    let kids: Vec<_> = (0..2u32).map(|r| member(&env, "t", r, 2, &ride)).collect();
    // Killed twice, each time after the members read a while (each broker
    // counts what it delivered itself).
    for _ in 0..2 {
        env.wait_for("the members to read on", |s| {
            s.streams[0].consumers.len() == 2
                && s.streams[0].consumers.iter().all(|c| c.batches >= 6)
        });
        env.restart_broker(true);
    }
    for (rank, kid) in kids.into_iter().enumerate() {
        let r = report(kid);
        assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
        assert!(r.order_errors.is_empty(), "{r:#?}");
        assert_eq!(r.reconnects, 2, "{r:#?}");
        let want = dealt(Deal::new(203, 8, (rank as u32, 2, 1), false));
        assert_eq!(
            runs(&r),
            BTreeMap::from([(0, want.clone()), (1, want)]),
            "rank {rank}: {r:#?}"
        );
    }
}

/// A rank coming back to a seat another connection of its uid holds (its
/// own old one, not yet gone; here a raw member that took rank 1 while
/// the rank was stopped across a broker restart) is refused `Busy` and
/// asks again until its `reconnect_timeout`: once the seat is free it
/// reads the rest of its share, every sample once. Before, the refusal
/// ended it.
#[test]
fn a_member_coming_back_to_a_held_seat_asks_again_until_it_is_free() {
    use nix::sys::signal::Signal::SIGCONT;
    let mut env = Env::start(&config(1));
    // It stops itself once it has read 6 batches: the broker's count
    // of what it sent says nothing of what the member took (the broker
    // may have counted batches before its welcome was even written).
    let kid = member(
        &env,
        "t",
        1,
        2,
        &["--reconnect-timeout", "30", "--stop-after", "6"],
    );
    common::wait_stopped(kid.id());
    env.restart_broker(true);
    let mut req = common::consume_request(2);
    req.group = Some(Box::new(batchcast::proto::Seat {
        name: "t".into(),
        rank: 1,
        world: 2,
        replicate: 1,
    }));
    let squatter = common::raw_subscribe_with(&env.socket(), "squatter", req);
    harness::signal(kid.id(), SIGCONT);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(
        env.stats().streams[0].consumers.len() == 1,
        "the rank came back beside the seat's holder"
    );
    drop(squatter);
    let r = report(kid);
    let said = env.what_they_said();
    assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}\n{said}");
    assert_eq!(r.reconnects, 1, "{r:#?}\n{said}");
    let want = dealt(Deal::new(203, 8, (1, 2, 1), false));
    assert_eq!(runs(&r), BTreeMap::from([(0, want.clone()), (1, want)]));
}

/// A decoupled stream of 203 samples in units of 8, 2 epochs, a ring of
/// 12, for members of 2 ranks (`Deal::new(203, 8, (rank, 2, 1), false)`).
fn decoupled_members_env() -> Env {
    let fields: [(&str, &str, &[u64]); 1] = [("x", "u8", &[16])];
    Env::start(
        &StreamToml::synthetic("train", 8, 203, &fields)
            .epochs(2)
            .key("seed", 9)
            .key("slots", 12)
            .key("min_consumers", 1)
            .fill("full")
            .raw("pace = \"decoupled\"")
            .to_toml(),
    )
}

#[test]
fn on_a_decoupled_stream_members_joining_now_are_replayed_their_share() {
    let env = decoupled_members_env();
    // A plain consumer reads on; two members join now, mid-stream, and
    // are replayed their share of the epoch in progress. (A member that
    // falls a ring behind, as a machine busy with the whole suite may make
    // one, is cut and replayed its own runs like any consumer: the share
    // it reads is the same either way.)
    let plain = env.consumer(&["--verify", "--positions", "--sleep-ms", "20"]);
    env.wait_for("the stream to move", |s| {
        s.streams[0].consumers.iter().any(|c| c.batches >= 5)
    });
    let kids: Vec<_> = (0..2u32)
        .map(|r| member(&env, "t", r, 2, &["--join", "now", "--sleep-ms", "2"]))
        .collect();
    for (rank, kid) in kids.into_iter().enumerate() {
        let r = report(kid);
        assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
        assert!(r.order_errors.is_empty(), "{r:#?}");
        let want = dealt(Deal::new(203, 8, (rank as u32, 2, 1), false));
        assert!(!r.epochs.is_empty(), "{r:#?}");
        for e in &r.epochs {
            assert_eq!(e.positions, want, "rank {rank} epoch {}: {r:#?}", e.epoch);
        }
    }
    let r = report(plain);
    assert!(r.ok && r.ended, "{r:#?}");
    let st = members_gone(&env, 2);
    for c in st.streams[0]
        .past_consumers
        .iter()
        .filter(|c| c.group.is_some())
    {
        assert_eq!(c.left.as_deref(), Some("stream ended"), "{c:#?}");
    }
}

/// Members that join `now` at the end of the last epoch, one of them
/// stopped before its replay reaches the units the ring held then, are
/// replayed their share of that epoch and told the stream ended. The
/// second rank's replay ends past the last epoch (its next run would
/// begin at sample 8 of an epoch the stream does not have): it waited
/// for a unit never made, and was killed at the suite's limit (CI saw
/// it where a member began late on a busy machine).
#[test]
fn on_a_decoupled_stream_a_member_replayed_past_the_end_is_told_it_ended() {
    let env = decoupled_members_env();
    // A plain consumer stops 7 units before the end, which the ring keeps
    // for it: every epoch is made, and a joiner `now` begins in the last.
    let last = ["--stall-after", "45", "--stall-ms", "120000"];
    let mut plain = env.consumer(&[&["--verify", "--positions"][..], &last].concat());
    env.wait_for("every batch to be made", |s| {
        s.streams[0].batches_produced == 52
    });
    let first = member(&env, "t", 0, 2, &["--join", "now"]);
    let second = member(&env, "t", 1, 2, &["--join", "now", "--stop-after", "1"]);
    common::wait_stopped(second.id());
    let first = env.report(first);
    // The ring lets go of the end: the stopped member's replay walks past
    // it with nothing of the stream left to merge into.
    common::sigkill(&mut plain);
    env.wait_for("the plain consumer to be gone", |s| {
        s.streams[0].consumers.iter().all(|c| c.group.is_some())
    });
    harness::signal(second.id(), nix::sys::signal::Signal::SIGCONT);
    let second = env.report(second);
    for (rank, r) in [first, second].into_iter().enumerate() {
        assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
        assert!(r.order_errors.is_empty(), "{r:#?}");
        let want = dealt(Deal::new(203, 8, (rank as u32, 2, 1), false));
        let epochs: Vec<u64> = r.epochs.iter().map(|e| e.epoch).collect();
        assert_eq!(epochs, [1], "rank {rank}: the last epoch: {r:#?}");
        assert_eq!(r.epochs[0].positions, want, "rank {rank}: {r:#?}");
    }
    for c in members_gone(&env, 2).streams[0].past_consumers.iter() {
        if c.group.is_some() {
            assert_eq!(c.left.as_deref(), Some("stream ended"), "{c:#?}");
        }
    }
}

#[test]
fn a_group_reformed_with_another_world_goes_on_from_any_members_state() {
    let env = Env::start(&config(4));
    // 4 ranks of 4 (16 samples a step), each checkpointing every batch,
    // stall after 10 batches (round 10 of epoch 0: sample 160) and are
    // killed there, as a failed node takes its ranks down.
    let states: Vec<_> = (0..4).map(|r| env.path(&format!("r{r}.state"))).collect();
    let files: Vec<&str> = states.iter().map(|s| s.to_str().unwrap()).collect();
    let mut kids: Vec<_> = (0..4u32)
        .map(|r| {
            let args = [
                "--batch-size",
                "4",
                "--state-file",
                files[r as usize],
                "--stall-after",
                "10",
                "--stall-ms",
                "60000",
            ];
            member(&env, "t", r, 4, &args)
        })
        .collect();
    let t0 = std::time::Instant::now();
    for state in &states {
        while !batchcast_cli::report::SavedState::load(state)
            .is_ok_and(|s| s.epoch.positions.len() == 10)
        {
            assert!(t0.elapsed() < common::LIMIT, "a member never stood still");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    for kid in &mut kids {
        common::sigkill(kid);
    }
    let saved = batchcast_cli::report::SavedState::load(&states[2]).unwrap();
    let place = saved
        .state
        .group
        .clone()
        .expect("a member's state has its group's place");
    assert_eq!((place.round.epoch, place.round.sample), (0, 160));
    // torchrun re-forms the trial with 2 ranks; both load rank 2's state
    // and take batches of 8 (the same 16 a step: derived, not given).
    let round = 160;
    let reformed: Vec<_> = (0..2u32)
        .map(|r| member(&env, "t", r, 2, &["--resume-state", files[2]]))
        .collect();
    let mut tail = vec![0u32; 203 - round];
    for (rank, kid) in reformed.into_iter().enumerate() {
        let r = report(kid);
        assert!(r.ok && r.ended && r.verify_failures == 0, "{r:#?}");
        let want = dealt(Deal::new(203, 8, (rank as u32, 2, 1), false));
        let got = runs(&r);
        let from_round: Vec<_> = got[&0]
            .iter()
            .filter(|&&(f, _)| f >= round as u64)
            .copied()
            .collect();
        let want0: Vec<_> = want
            .iter()
            .filter(|&&(f, _)| f >= round as u64)
            .copied()
            .collect();
        assert_eq!(from_round, want0, "rank {rank}: {r:#?}");
        assert_eq!(got[&1], want, "rank {rank} epoch 1: {r:#?}");
        for (f, n) in from_round {
            for s in f..f + n {
                tail[s as usize - round] += 1;
            }
        }
    }
    assert!(
        tail.iter().all(|&c| c == 1),
        "the rest of epoch 0 once: {tail:?}"
    );
    // Another global batch is refused, saying which batch size keeps it.
    let r = report(member(
        &env,
        "t",
        0,
        2,
        &["--resume-state", files[2], "--batch-size", "4"],
    ));
    let msg = r.error.unwrap_or_default();
    assert!(msg.contains("ask for batch_size=8"), "{msg}");
}

/// An endless decoupled stream whose pipeline waits at most 1 s for a
/// consumer it cannot cut (a group member: members keep lockstep), and
/// with `lag` detaches one that keeps lockstep more than `lag` batches
/// behind the others.
fn held_decoupled(lag: Option<u32>) -> String {
    let fields: [(&str, &str, &[u64]); 2] = [("image", "u8", &[3, 8, 8]), ("label", "i64", &[])];
    let toml = StreamToml::synthetic("train", 40, 4000, &fields)
        .key("seed", 5)
        .key("slots", 12)
        .key("workers", 2)
        .raw("pace = \"decoupled\"")
        .raw("hold_limit_s = 1.0");
    match lag {
        Some(lag) => toml.key("lag_limit", lag).to_toml(),
        None => toml.to_toml(),
    }
}

/// A plain reader of 600 batches, 2 ms each (about 1.2 s alone), started
/// and reading before the member under test comes.
fn steady_reader(env: &Env) -> std::process::Child {
    let steady = env.consumer(&[
        "--verify",
        "--sleep-ms",
        "2",
        "--max-batches",
        "600",
        "--name",
        "steady",
    ]);
    env.wait_for("the steady reader to start", |s| {
        s.streams[0].consumers.iter().any(|c| c.delivered > 0)
    });
    steady
}

/// The steady reader got everything right and was not held for long: the
/// member under test would hold it for its whole 12 s pause, or at its
/// crawl (600 batches at 25 ms a unit: 15 s); the bound is the hold limit
/// or the lag limit, and slack.
fn assert_steady_not_held(steady: std::process::Child) {
    let r = report(steady);
    assert!(r.ok && r.verified_samples == r.samples, "{r:#?}");
    assert_eq!(r.batches, 600);
    assert!(
        r.seconds < 8.0,
        "the steady reader was held {:.1} s",
        r.seconds
    );
}

/// A member of `held_decoupled`'s stream (4000 samples an epoch, batches
/// of 40) read its own runs of the deal, each once and in order, from
/// where it joined: a suffix of its share in its first epoch, all of it
/// in the epochs between, a prefix in its last.
fn assert_own_runs_in_order(r: &ConsumerReport, rank: u32) {
    assert!(r.ok && r.verify_failures == 0, "{r:#?}");
    assert!(r.order_errors.is_empty(), "{r:#?}");
    let mine = dealt(Deal::new(4000, 40, (rank, 2, 1), false));
    let epochs = runs(r);
    let last = epochs.keys().next_back().copied();
    for (k, (epoch, got)) in epochs.iter().enumerate() {
        let at = mine.iter().position(|x| Some(x) == got.first());
        let from = at.unwrap_or_else(|| panic!("epoch {epoch}: {got:?} is not its share"));
        assert!(
            k == 0 || from == 0,
            "epoch {epoch} begins mid-share: {got:?}"
        );
        let want = &mine[from..(from + got.len()).min(mine.len())];
        assert_eq!(got.as_slice(), want, "epoch {epoch}");
        assert!(
            Some(*epoch) == last || from + got.len() == mine.len(),
            "epoch {epoch} ends short: {got:?}"
        );
    }
}

/// Decoupled pace cuts a member as any consumer: one that pauses for 12 s
/// (longer than the hold limit, with nothing it holds: its unread units
/// are taken back) is replayed its own runs and goes on, and the others
/// are not held. Before, members kept lockstep: it was detached.
#[test]
fn on_a_decoupled_stream_a_paused_member_is_cut_and_goes_on_from_replay() {
    let env = Env::start(&held_decoupled(None));
    let steady = steady_reader(&env);
    let paused = member(
        &env,
        "t",
        0,
        2,
        &[
            "--join",
            "immediate",
            "--stop-after",
            "3",
            "--max-batches",
            "60",
        ],
    );
    // Stopped until the steady reader is done: had it held the stream,
    // the steady reader would wait for it.
    assert_steady_not_held(steady);
    common::wait_stopped(paused.id());
    harness::signal(paused.id(), nix::sys::signal::Signal::SIGCONT);
    let paused = report(paused);
    assert_eq!(paused.batches, 60, "{paused:#?}");
    assert_eq!(paused.reconnects, 0, "{paused:#?}");
    assert!(paused.replayed_batches > 0, "{paused:#?}");
    assert_own_runs_in_order(&paused, 0);
}

/// A member that crawls (12x slower than a plain reader) with no
/// `lag_limit`, the default, holds no one: it is cut and replayed its
/// share at its own pace. Before, it held the stream (11 s for what takes
/// 0.01 s) unless `lag_limit` was set.
#[test]
fn on_a_decoupled_stream_a_crawling_member_holds_no_one_with_no_lag_limit() {
    let env = Env::start(&held_decoupled(None));
    let steady = steady_reader(&env);
    // 50 ms an own batch, every other unit: 25 ms a unit, moving but
    // 12x slower than the steady reader.
    let slow = member(
        &env,
        "t",
        1,
        2,
        &[
            "--join",
            "immediate",
            "--sleep-ms",
            "50",
            "--max-batches",
            "120",
        ],
    );
    assert_steady_not_held(steady);
    let slow = report(slow);
    assert_eq!(slow.batches, 120, "{slow:#?}");
    assert_own_runs_in_order(&slow, 1);
}

#[test]
fn on_a_decoupled_stream_a_member_that_takes_nothing_is_cut_and_holds_no_one() {
    // A member speaking the protocol by hand: it takes a seat, then never
    // takes what its mailbox is sent, nor releases anything, its
    // connection open. Its unread units are taken back at a cut (before,
    // members kept lockstep and it was detached at the hold limit).
    use batchcast::proto::{ConsumeRequest, Seat};
    let env = Env::start(&held_decoupled(None));
    let steady = steady_reader(&env);
    let request = ConsumeRequest {
        batch_size: None,
        expect: None,
        group: Some(Box::new(Seat {
            name: "t".into(),
            rank: 0,
            world: 2,
            replicate: 1,
        })),
        drop_last: None,
        resume: None,
        rotation: None,
        stream: "train".into(),
        window: 2,
        join: batchcast::JoinPolicy::Immediate,
        device: None,
        mailbox: true,
        serial: 0,
        taken: Default::default(),
    };
    let (_sock, _welcome, _fds) = common::raw_subscribe_with(&env.socket(), "hoarder", request);
    assert_steady_not_held(steady);
    let st = env.stats();
    let hoarder = st.streams[0]
        .consumers
        .iter()
        .find(|c| c.name == "hoarder")
        .unwrap_or_else(|| panic!("{st:#?}"));
    assert!(hoarder.cuts >= 1 && hoarder.left.is_none(), "{hoarder:#?}");
}

/// Under the default pace (lockstep) a member stopped with SIGSTOP holds
/// the others only for the hold limit: it is cut and replayed its own
/// runs, and continued it reads its share once, in order. Before, the
/// others waited until it was continued.
#[test]
fn on_a_lockstep_stream_a_stopped_member_is_cut_at_the_hold_limit_and_reads_its_share() {
    let lockstep = held_decoupled(None).replace("pace = \"decoupled\"\n", "");
    assert!(!lockstep.contains("decoupled"), "{lockstep}");
    let env = Env::start(&lockstep);
    let mut steady = steady_reader(&env);
    let stopped = member(
        &env,
        "t",
        0,
        2,
        &[
            "--join",
            "immediate",
            "--stop-after",
            "3",
            "--max-batches",
            "60",
        ],
    );
    common::wait_stopped(stopped.id());
    let t0 = std::time::Instant::now();
    while t0.elapsed().as_secs() < 12 && steady.try_wait().unwrap().is_none() {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    harness::signal(stopped.id(), nix::sys::signal::Signal::SIGCONT);
    assert_steady_not_held(steady);
    let stopped = report(stopped);
    assert_eq!(stopped.batches, 60, "{stopped:#?}");
    assert!(stopped.replayed_batches > 0, "{stopped:#?}");
    assert_own_runs_in_order(&stopped, 0);
    // `batchcast stats` names its seat and counts its own batches, the
    // replayed ones among them (each its own run; before, counted as if
    // the runs were contiguous: 35 here).
    env.wait_for("the member to be gone", |s| {
        s.streams[0].past_consumers.len() == 2
    });
    let out = common::run(
        common::command(common::EXE)
            .arg("stats")
            .arg("--socket")
            .arg(env.socket()),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("group t 0/2"))
        .unwrap_or_else(|| panic!("no member line: {text}"));
    // It read 60, and was sent what its mailbox was noticed past them
    // (the units in the ring, at most 12).
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "batches").unwrap();
    let batches: u64 = words[at - 1].parse().unwrap();
    assert!((60..=72).contains(&batches), "{line}");
}

/// Issue 72 at the defaults (no pace, no limits in the config): a group
/// member stopped mid-step holding its batch (`--hold 1`) holds a steady
/// reader at most the 2 s hold limit (the ring moves on without what it
/// holds), and continued it reads its share once, in order, partly
/// replayed, never detached.
#[test]
fn at_the_defaults_a_member_stopped_holding_its_batch_holds_no_one_and_reads_its_share() {
    let defaults = held_decoupled(None)
        .replace("pace = \"decoupled\"\n", "")
        .replace("hold_limit_s = 1.0\n", "");
    assert!(
        !defaults.contains("pace") && !defaults.contains("limit"),
        "{defaults}"
    );
    let env = Env::start(&defaults);
    let steady = steady_reader(&env);
    let stopped = member(
        &env,
        "t",
        0,
        2,
        &[
            "--join",
            "immediate",
            "--hold",
            "1",
            "--stop-after",
            "3",
            "--max-batches",
            "60",
        ],
    );
    common::wait_stopped(stopped.id());
    let steady = {
        let mut steady = steady;
        let t0 = std::time::Instant::now();
        while t0.elapsed().as_secs() < 12 && steady.try_wait().unwrap().is_none() {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        steady
    };
    harness::signal(stopped.id(), nix::sys::signal::Signal::SIGCONT);
    assert_steady_not_held(steady);
    let stopped = report(stopped);
    assert_eq!(stopped.batches, 60, "{stopped:#?}");
    assert!(stopped.replayed_batches > 0, "{stopped:#?}");
    assert_own_runs_in_order(&stopped, 0);
    let s = env.wait_for("the member to be gone", |s| {
        s.streams[0].past_consumers.len() == 2
    });
    assert_eq!(s.streams[0].detached, 0);
    assert!(s.streams[0].ring_moves >= 1, "{:#?}", s.streams[0]);
}
