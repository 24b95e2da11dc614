//! The stream driven in-process: replay (what a joiner is sent, what its
//! releases may name, whose budget its arena is in), and the GPU
//! bookkeeping (device rings, copies, what GPU consumers
//! are sent, a failing GPU) driven through a GPU made of host memory
//! ([`crate::gpu::stand_in`]): CUDA itself is exercised by `bench/gpu.sh`.
use std::path::Path;

use batchcast::mailbox::ConsumerMailbox;
use batchcast::proto::{Release, Unit};
use batchcast::schema::RingLayout;
use batchcast::synthetic::SyntheticSpec;

use crate::pipeline::shared::Shares;
use crate::stream::error::ReleaseError;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use batchcast::JoinPolicy;
use batchcast::mailbox::{Notice, Totals};
use batchcast::proto::{BatchReady, ErrorCode, ServerMsg};
use tokio::sync::mpsc;

use super::*;
use crate::budget::{Budget, Use};
use crate::config::Config;
use crate::config::StreamToml;
use crate::gpu::stand_in;
use crate::hub::ConsumerId;
use crate::plan::plan_config;
use batchcast::proto::ConsumeRequest;

/// Batches of 3, 100 to an epoch: the rings hold
/// 256 cells of `x` and 512 of `y`, so batches 85 and 170 straddle their
/// wraps (a GPU copy is then two pieces).
fn start(gpu_slots: u32, min_consumers: u32) -> Arc<Stream> {
    start_in(gpu_slots, min_consumers, &Budget::new(1 << 30, 0))
}

/// [`start`] with its arena in `budget`, under uid 0.
fn start_in(gpu_slots: u32, min_consumers: u32, budget: &Arc<Budget>) -> Arc<Stream> {
    let fields: [(&str, &str, &[u64]); 2] = [("x", "u8", &[3, 4, 4]), ("y", "i64", &[])];
    let text = StreamToml::synthetic("t", 3, 300, &fields)
        .epochs(2)
        .key("slots", 4)
        .key("gpu_slots", gpu_slots)
        .key("min_consumers", min_consumers)
        .key("workers", 1)
        .to_toml();
    let cfg = Config::parse(&text, Path::new("test.toml")).unwrap();
    let plan = plan_config(&cfg).unwrap().remove(0);
    Stream::start(plan, budget, 0, &mut Shares::default()).unwrap()
}

fn peer(name: &str) -> Peer {
    peer_of(name, 0)
}

fn peer_of(name: &str, uid: u32) -> Peer {
    Peer {
        name: name.into(),
        pid: std::process::id(),
        uid,
    }
}

/// A host socket consumer's request for `train`, window 2, joining as
/// `join` says.
fn request(join: JoinPolicy) -> ConsumeRequest {
    ConsumeRequest {
        stream: "train".into(),
        expect: None,
        group: None,
        batch_size: None,
        drop_last: Some(false),
        resume: None,
        rotation: None,
        window: 2,
        join,
        device: None,
        mailbox: false,
        serial: 0,
        taken: Default::default(),
    }
}

/// A socket consumer's request to join `train` now.
fn join_now() -> ConsumeRequest {
    request(JoinPolicy::Now)
}

/// Reads and releases `n` batches as `sub`.
fn read(s: &Stream, sub: &mut Subscription, n: usize) {
    let mut read = 0;
    while read < n {
        if let ServerMsg::Batch(b) = next(sub) {
            release(s, sub.id, b.seq);
            read += 1;
        }
    }
}

fn subscribe(s: &Arc<Stream>, name: &str, gpu: bool) -> Subscription {
    let req = ConsumeRequest {
        device: gpu.then(|| stand_in::request(0)),
        ..request(JoinPolicy::NextEpoch)
    };
    s.subscribe(req, peer(name)).unwrap()
}

fn next(sub: &mut Subscription) -> ServerMsg {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match sub.rx.try_recv() {
            Ok(m) => return m,
            Err(mpsc::error::TryRecvError::Empty) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1))
            }
            Err(e) => panic!("no message for consumer {}: {e}", sub.id),
        }
    }
}

fn release(s: &Stream, id: ConsumerId, seq: u64) {
    s.release(
        id,
        Release {
            unit: Unit::Shared(seq),
            wait_ns: 0,
            busy_ns: 0,
            taken: Default::default(),
        },
    )
    .unwrap();
}

/// Reads, checks and releases every batch `sub` (a host consumer) is sent
/// until the stream ends; how many.
fn read_to_end(s: &Stream, sub: &mut Subscription) -> usize {
    let mut n = 0;
    loop {
        match next(sub) {
            ServerMsg::Batch(b) => {
                verify_host(s, &b);
                release(s, sub.id, b.seq);
                n += 1;
            }
            ServerMsg::EndOfEpoch(_) => {}
            ServerMsg::EndOfStream => return n,
            m => panic!("{m:?}"),
        }
    }
}

fn spec(s: &Stream) -> &SyntheticSpec {
    match &s.plan.schema.source {
        batchcast::schema::SourceInfo::Synthetic(spec) => spec,
        _ => unreachable!(),
    }
}

/// Checks every sample of device batch `b` in a stand-in GPU's memory (a
/// plain mapping of its rings): at the cells of its stream position.
fn verify(s: &Stream, b: &BatchReady, (rings, memory): (RingLayout, Vec<u8>)) {
    assert_eq!(
        b.slot as u64,
        b.seq % u64::from(rings.slots),
        "a ring's slot"
    );
    let fields: Vec<Vec<u8>> = rings
        .fields
        .iter()
        .map(|r| {
            let bps = r.bytes_per_sample as usize;
            (0..b.samples)
                .flat_map(|j| {
                    let cell = ((b.seq * rings.unit + j) % r.cells) as usize;
                    memory[r.offset as usize + cell * bps..][..bps].to_vec()
                })
                .collect()
        })
        .collect();
    verify_fields(s, b, fields.iter().map(Vec::as_slice));
}

/// Checks every sample of host batch `b` in the stream's rings.
fn verify_host(s: &Stream, b: &BatchReady) {
    let rings = &s.plan.rings;
    let fields = (0..rings.fields.len()).map(|f| {
        let (start, len) = rings.span(f, b.seq * rings.unit, b.samples).unwrap();
        let region = s.lock().fill.regions.now() as usize;
        s.rings[region].get(start, len).unwrap()
    });
    verify_fields(s, b, fields);
}

fn verify_fields<'a>(s: &Stream, b: &BatchReady, fields: impl Iterator<Item = &'a [u8]>) {
    let order = s.plan.epoch_order(b.epoch);
    for (f, bytes) in fields.enumerate() {
        let bps = bytes.len() / b.samples as usize;
        for j in 0..b.samples as usize {
            let index = order[b.index as usize * 3 + j];
            assert!(
                spec(s).verify_sample(f, index, &bytes[j * bps..(j + 1) * bps]),
                "batch {} (slot {}) field {f} sample {j} is wrong",
                b.seq,
                b.slot
            );
        }
    }
}

/// A mailbox consumer as the client library drives one: takes notices,
/// checks each batch, releases it through the mailbox and rings when
/// the stream asks. Returns the batches it saw, up to the end.
fn drain_as_mailbox_consumer(s: &Stream, mb: &ConsumerMailbox) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    loop {
        assert!(Instant::now() < deadline, "stalled after {seen:?}");
        match mb.pop().unwrap() {
            Some(Notice::Batch(b)) => {
                verify_host(s, &b);
                seen.push(b.seq);
                assert!(mb.push_release(Unit::Shared(b.seq), Totals::default()));
                if mb.wants_doorbell() {
                    s.doorbell();
                }
            }
            Some(Notice::EndOfEpoch(_)) => {}
            Some(Notice::EndOfStream) => return seen,
            Some(Notice::Replay(r)) => panic!("replayed batch {r:?} without asking for replay"),
            Some(
                n @ (Notice::Cut(_) | Notice::Merge(_) | Notice::Rotate(_) | Notice::Arena(_)),
            ) => {
                panic!("{n:?} in a lockstep stream")
            }
            None => mb.sleep_unless(Duration::from_millis(5), || false),
        }
    }
}

#[test]
fn a_consumer_that_forges_a_mailbox_release_is_ended_and_the_others_finish() {
    let s = start(2, 2);
    let grant = |name: &str| {
        let mut sub = s
            .subscribe(
                ConsumeRequest {
                    mailbox: true,
                    ..request(JoinPolicy::NextEpoch)
                },
                peer(name),
            )
            .unwrap();
        let g = sub
            .mailbox
            .take()
            .expect("a host consumer gets its mailbox");
        (sub, ConsumerMailbox::open(g.fd, g.spec).unwrap())
    };
    let (good, good_mb) = grant("good");
    let (mut bad, bad_mb) = grant("bad");
    // It releases a batch it was never sent.
    assert!(bad_mb.push_release(Unit::Shared(12345), Totals::default()));
    let ServerMsg::Error(e) = next(&mut bad) else {
        panic!("expected an error")
    };
    assert!(e.message.contains("bad release"), "{}", e.message);
    assert!(matches!(next(&mut bad), ServerMsg::Goodbye(_)));
    // Its connection closes, as the server's would.
    s.leave(bad.id);
    let seen = drain_as_mailbox_consumer(&s, &good_mb);
    assert_eq!(
        seen,
        (0..200).collect::<Vec<_>>(),
        "2 epochs of 10, in order"
    );
    drop(good);
}

#[test]
fn gpu_consumers_read_every_batch_from_their_own_device_ring() {
    let s = start(2, 2);
    let mut host = subscribe(&s, "host", false);
    let mut gpu = subscribe(&s, "gpu", true);
    assert_eq!(gpu.device.as_ref().unwrap().arena().slots, 2);
    let (mut got_host, mut got_gpu) = (Vec::new(), Vec::new());
    let mut held = VecDeque::new();
    let (mut host_done, mut gpu_done) = (false, false);
    while !(host_done && gpu_done) {
        if !host_done {
            match next(&mut host) {
                ServerMsg::Batch(b) => {
                    verify_host(&s, &b);
                    got_host.push((b.epoch, b.index));
                    release(&s, host.id, b.seq);
                }
                ServerMsg::EndOfStream => host_done = true,
                ServerMsg::EndOfEpoch(_) => {}
                m => panic!("host consumer got {m:?}"),
            }
        }
        if !gpu_done {
            match next(&mut gpu) {
                ServerMsg::Batch(b) => {
                    assert!(b.slot < 2, "device slot {} of 2", b.slot);
                    verify(&s, &b, s.gpus.stand_in_memory(0));
                    got_gpu.push((b.epoch, b.index));
                    // Hold one batch while taking the next: both device
                    // slots in use at once.
                    held.push_back(b.seq);
                    if held.len() == 2 {
                        release(&s, gpu.id, held.pop_front().unwrap());
                    }
                }
                ServerMsg::EndOfEpoch(_) => {}
                ServerMsg::EndOfStream => {
                    gpu_done = true;
                    for seq in held.drain(..) {
                        release(&s, gpu.id, seq);
                    }
                }
                m => panic!("GPU consumer got {m:?}"),
            }
        }
    }
    let every: Vec<(u64, u64)> = (0..2).flat_map(|e| (0..100).map(move |i| (e, i))).collect();
    assert_eq!(got_host, every);
    assert_eq!(got_gpu, every);
    let st = s.stats();
    assert_eq!(st.gpus.len(), 1);
    let g = &st.gpus[0];
    assert_eq!(g.copies, 200, "one copy per batch: {g:?}");
    assert_eq!((g.slots, g.slots_in_use, g.waiting), (2, 0, 0), "{g:?}");
    s.leave(host.id);
    s.leave(gpu.id);
    s.shutdown();
}

#[test]
fn host_slots_are_refilled_while_a_gpu_consumer_holds_its_copies() {
    let s = start(2, 1);
    let mut gpu = subscribe(&s, "gpu", true);
    let first: Vec<BatchReady> = (0..2)
        .map(|_| match next(&mut gpu) {
            ServerMsg::Batch(b) => b,
            m => panic!("{m:?}"),
        })
        .collect();
    // The GPU consumer holds both device slots. Its next two batches
    // wait for a device slot, pinning two host slots; the other two host
    // slots were given back when their copies completed and hold two
    // more batches (with the host slot tied to the device slot, only
    // four batches could exist).
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.stats().batches_produced < 6 {
        assert!(Instant::now() < deadline, "{:?}", s.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    let st = s.stats();
    assert_eq!(st.batches_produced, 6, "no host slot is free: {st:?}");
    assert_eq!((st.gpus[0].slots_in_use, st.gpus[0].waiting), (2, 4));
    for b in &first {
        release(&s, gpu.id, b.seq);
    }
    for want in 2..4 {
        match next(&mut gpu) {
            ServerMsg::Batch(b) => {
                assert_eq!(b.seq, want);
                verify(&s, &b, s.gpus.stand_in_memory(0));
            }
            m => panic!("{m:?}"),
        }
    }
    s.leave(gpu.id);
    s.shutdown();
}

#[test]
fn a_failing_gpu_ends_its_consumers_and_host_consumers_finish() {
    let s = start(2, 2);
    s.gpus.fail_stand_ins_at(3);
    let mut host = subscribe(&s, "host", false);
    let mut gpu = subscribe(&s, "gpu", true);
    let mut gpu_batches = 0;
    loop {
        match next(&mut gpu) {
            ServerMsg::Batch(b) => {
                gpu_batches += 1;
                release(&s, gpu.id, b.seq);
            }
            ServerMsg::Error(e) => {
                assert_eq!(e.code, ErrorCode::DeviceUnavailable);
                assert!(
                    e.message.contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
                    "{}",
                    e.message
                );
                break;
            }
            m => panic!("{m:?}"),
        }
    }
    assert_eq!(gpu_batches, 3, "the copies before the failure arrived");
    assert!(matches!(next(&mut gpu), ServerMsg::Goodbye(_)));
    s.leave(gpu.id);
    // Copies that never completed gave back their host slots.
    let n = read_to_end(&s, &mut host);
    assert_eq!(n, 200);
    let req = ConsumeRequest {
        window: 1,
        device: Some(stand_in::request(0)),
        ..request(JoinPolicy::Immediate)
    };
    let err = s.subscribe(req, peer("again")).unwrap_err();
    assert!(err.to_string().contains("failed"), "{err}");
    s.leave(host.id);
    s.shutdown();
}

/// A socket consumer that joins now, mid-epoch, is replayed the epoch's
/// start in order, and a release of a replayed batch it does not hold
/// (forged, repeated, never sent) is refused without touching anyone
/// else's batches.
#[test]
fn replayed_batches_come_in_order_and_a_forged_replay_release_is_refused() {
    let s = start(2, 1);
    let mut first = subscribe(&s, "first", false);
    // Read and release ten batches, so the stream is mid-epoch 0.
    read(&s, &mut first, 10);
    let mut late = s.subscribe(join_now(), peer("late")).unwrap();
    let (grant, _fd) = late.replay.take().expect("mid-epoch: replay granted");
    assert_eq!(
        grant.from,
        batchcast::proto::Position {
            epoch: 0,
            sample: 0
        }
    );
    assert!(grant.to.sample >= 30, "{grant:?}");
    let forged = |seq: u64| Release {
        unit: Unit::Replayed(seq),
        wait_ns: 0,
        busy_ns: 0,
        taken: Default::default(),
    };
    assert!(matches!(
        s.release(late.id, forged(1000)),
        Err(ReleaseError::Replay(ReplayError::NotHeld { seq: 1000 }))
    ));
    assert!(
        s.release(first.id, forged(0)).is_err(),
        "a consumer without replay holds no replayed batch"
    );
    let mut seq = 0;
    let mut at = 0;
    while at < grant.to.sample {
        match next(&mut late) {
            ServerMsg::Replay(r) => {
                assert_eq!((r.seq, r.epoch, r.first), (seq, 0, at));
                s.release(late.id, forged(r.seq)).unwrap();
                assert!(s.release(late.id, forged(r.seq)).is_err(), "released twice");
                at += r.samples;
                seq += 1;
            }
            ServerMsg::Batch(_) => {} // shared units, held for after
            m => panic!("{m:?}"),
        }
    }
    s.leave(late.id);
    s.leave(first.id);
    let st = s.stats();
    assert!(st.replay_cpu_s > 0.0);
    s.shutdown();
}

/// Docs (threat model): a joiner's replay arena is taken from the budget
/// under its own uid, so another user's joiner counts against the three
/// quarters all other users may hold, and it is given back when it leaves.
#[test]
fn a_replay_arena_is_charged_to_the_joiners_uid() {
    let budget = Budget::new(1 << 30, 0);
    let s = start_in(2, 1, &budget);
    let mut first = subscribe(&s, "first", false);
    // A lockstep host consumer keeps an arena for a cut past the hold
    // limit, as long as it is connected.
    let kept = budget.stats().replay_bytes;
    assert!(kept > 0, "an arena kept for cuts");
    read(&s, &mut first, 10);
    let late = s.subscribe(join_now(), peer("owner")).unwrap();
    assert!(late.replay.is_some(), "mid-epoch: replay granted");
    let arena = budget.stats().replay_bytes - kept;
    assert!(arena > 0);
    s.leave(late.id);
    assert_eq!(budget.stats().replay_bytes, kept, "given back as it leaves");
    // Other users hold all but `arena - 1` bytes of their three quarters.
    let others = budget
        .take(1000, Use::Arena, (3 << 30) / 4 - arena + 1, "another user")
        .unwrap();
    let Err(e) = s.subscribe(join_now(), peer_of("guest", 1001)) else {
        panic!("a guest's replay arena does not fit the guests' share");
    };
    let e = e.to_string();
    assert!(
        e.contains("a replay arena") && e.contains("other users than uid 0"),
        "{e}"
    );
    let owner = s.subscribe(join_now(), peer("owner")).unwrap();
    assert_eq!(
        budget.stats().replay_bytes,
        kept + arena,
        "the owner's fits"
    );
    s.leave(owner.id);
    drop(others);
    let guest = s.subscribe(join_now(), peer_of("guest", 1001)).unwrap();
    assert_eq!(budget.stats().replay_bytes, kept + arena);
    s.leave(guest.id);
    s.leave(first.id);
    assert_eq!(budget.stats().replay_bytes, 0);
    s.shutdown();
}

/// A stream nobody has read starts where its owner's first consumer
/// resumes; a guest's resume does not move it (the owner's trainers
/// joining at the next epoch would miss the epochs before the guest).
#[test]
fn only_the_owners_resume_moves_a_stream_nobody_has_read() {
    let resume_at = |epoch| ConsumeRequest {
        resume: Some(batchcast::proto::Position { epoch, sample: 30 }),
        ..request(JoinPolicy::NextEpoch)
    };
    let s = start(2, 1);
    let guest = s.subscribe(resume_at(1), peer_of("guest", 1001)).unwrap();
    assert_eq!(
        s.lock()
            .hub
            .view()
            .reader(guest.id)
            .map(|c| c.first_batch()),
        Some((0, 0)),
        "not moved by a guest"
    );
    s.leave(guest.id);
    let s = start(2, 1);
    let owner = s.subscribe(resume_at(1), peer("owner")).unwrap();
    assert_eq!(
        s.lock()
            .hub
            .view()
            .reader(owner.id)
            .map(|c| c.first_batch()),
        Some((1, 10)),
        "moved to the owner's place"
    );
    s.leave(owner.id);
}

/// A GPU consumer (on the host-memory stand-in) that stops releasing
/// holds the host consumers of a lockstep stream only for the hold limit:
/// its GPU's ring fills, the copy of the ring's next unit waits for a
/// device slot, and it is cut to replay as a host consumer is (it owes
/// units it was never sent), while the host consumer reads every batch.
/// (Before, it was detached: a GPU consumer could not be cut.)
#[test]
fn a_gpu_consumer_that_stops_releasing_is_cut_at_the_hold_limit() {
    let fields: [(&str, &str, &[u64]); 2] = [("x", "u8", &[3, 4, 4]), ("y", "i64", &[])];
    let text = StreamToml::synthetic("t", 3, 300, &fields)
        .epochs(2)
        .key("slots", 4)
        .key("gpu_slots", 2)
        .key("min_consumers", 2)
        .key("workers", 1)
        .raw("hold_limit_s = 0.5")
        .to_toml();
    let cfg = Config::parse(&text, Path::new("test.toml")).unwrap();
    let plan = plan_config(&cfg).unwrap().remove(0);
    let s = Stream::start(plan, &Budget::new(1 << 30, 0), 0, &mut Shares::default()).unwrap();
    let mut host = subscribe(&s, "host", false);
    let mut gpu = subscribe(&s, "gpu", true);
    assert!(gpu.replay.is_some(), "it keeps a replay arena for a cut");
    assert!(gpu.device_replay.is_some(), "and one on its GPU");
    let n = read_to_end(&s, &mut host);
    assert_eq!(n, 200, "the host consumer read every batch");
    // It was sent what its GPU's ring held, then told it was cut.
    let mut sent = 0;
    let at = loop {
        match next(&mut gpu) {
            ServerMsg::Batch(_) => sent += 1,
            ServerMsg::Cut(at) => break at,
            m => panic!("{m:?}"),
        }
    };
    assert!(
        (1..=2).contains(&sent),
        "{sent} batches: its ring has 2 slots"
    );
    assert_eq!(at.sample, 3 * sent, "its replay begins where it stopped");
    assert_eq!(s.stats().detached, 0);
    s.leave(gpu.id);
    s.leave(host.id);
    s.shutdown();
}

/// Threat model (a rotated resume): a request's `rotation` is the client's
/// word. One that does not fit its resume (another epoch, a point at or
/// past the epoch's ends, a group member's) is refused, naming what goes
/// on instead; one that fits but is odd (a point inside a batch) is served
/// to its sender alone: the stream's other consumer reads every batch,
/// byte for byte, to the end.
#[test]
fn a_forged_rotation_is_refused_or_harms_only_its_sender() {
    use batchcast::proto::{Position, Seat};
    use batchcast::rotation::Rotation;
    let s = start(2, 1);
    let forged = |resume: (u64, u64), (epoch, at): (u64, u64)| ConsumeRequest {
        resume: Some(Position {
            epoch: resume.0,
            sample: resume.1,
        }),
        rotation: Some(Box::new(Rotation { epoch, at })),
        ..request(JoinPolicy::NextEpoch)
    };
    let seat = Seat {
        name: "g".into(),
        rank: 0,
        world: 2,
        replicate: 1,
    };
    let refused = [
        ("another epoch", forged((0, 30), (1, 30))),
        ("at the epoch's start", forged((0, 30), (0, 0))),
        ("at the epoch's end", forged((0, 30), (0, 300))),
        ("past every epoch's end", forged((0, 30), (0, u64::MAX))),
        (
            "a group member's",
            ConsumeRequest {
                group: Some(Box::new(seat)),
                window: 1,
                ..forged((0, 30), (0, 60))
            },
        ),
    ];
    for (what, req) in refused {
        match s.subscribe(req, peer("forger")) {
            Err(SubscribeError::Replay(ReplayError::Refused(m))) => {
                assert!(m.contains("read rotated"), "{what}: {m}")
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    let mut honest = subscribe(&s, "honest", false);
    let mut odd = s.subscribe(forged((0, 30), (0, 31)), peer("odd")).unwrap();
    let stream = s.clone();
    let forger = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut replayed = Vec::new();
        while Instant::now() < deadline {
            let Ok(m) = odd.rx.try_recv() else {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            };
            let unit = match m {
                ServerMsg::Batch(b) => Unit::Shared(b.seq),
                ServerMsg::Replay(r) => {
                    replayed.push((r.epoch, r.first, r.samples));
                    Unit::Replayed(r.seq)
                }
                ServerMsg::EndOfStream | ServerMsg::Error(_) | ServerMsg::Goodbye(_) => break,
                _ => continue,
            };
            let _ = stream.release(
                odd.id,
                Release {
                    unit,
                    wait_ns: 0,
                    busy_ns: 0,
                    taken: Default::default(),
                },
            );
        }
        stream.leave(odd.id);
        replayed
    });
    assert_eq!(
        read_to_end(&s, &mut honest),
        200,
        "every batch of both epochs"
    );
    // Its rotated epoch's part read last, [30, 31), replayed to it alone.
    let replayed = forger.join().unwrap();
    assert_eq!(replayed.first(), Some(&(0, 30, 1)), "{replayed:?}");
    s.leave(honest.id);
    s.shutdown();
}

/// A broker shutting down says goodbye to consumers first; as they leave,
/// what they held frees slots. Its producer must get none of them: the
/// producer registers the stream again from the oldest batch it kept, and
/// every batch it published past a consumer's position pushes that point
/// past the consumer's, which the new broker then refuses to resume (seen
/// under load: a producer's rejoin at batch 21 for a consumer at 165).
#[test]
fn a_stopping_stream_hands_its_producer_no_slot_its_leaving_consumers_free() {
    use crate::plan::StreamPlan;
    use crate::stream::port::Acquire;
    use batchcast::proto::ProduceRequest;
    use batchcast::schema::{DType, Field};
    let field = Field {
        name: "x".into(),
        dtype: DType::U8,
        shape: vec![4],
        aux: false,
    };
    let mut req = ProduceRequest::new("ext", vec![field], 8, 100);
    req.slots = 2;
    let plan = StreamPlan::external(&req, "loader", 7).unwrap();
    let s = Stream::start(plan, &Budget::new(1 << 30, 0), 0, &mut Shares::default()).unwrap();
    let ext = ConsumeRequest {
        stream: "ext".into(),
        ..request(JoinPolicy::NextEpoch)
    };
    let mut reader = s.subscribe(ext.clone(), peer("reader")).unwrap();
    let mut holder = s.subscribe(ext, peer("holder")).unwrap();
    let port = s.port();
    let fill = || match port.acquire().unwrap() {
        Acquire::Slot(w) => {
            port.publish(&w, 8, Duration::ZERO);
            true
        }
        Acquire::Wait => false,
        Acquire::Ended => panic!("the stream ended"),
    };
    // Both slots filled; one consumer read and released both, the other
    // holds them (window 2): none free.
    assert!(fill() && fill());
    read(&s, &mut reader, 2);
    for _ in 0..2 {
        assert!(matches!(next(&mut holder), ServerMsg::Batch(_)));
    }
    assert!(!fill());
    s.shutdown();
    for sub in [&mut reader, &mut holder] {
        assert!(matches!(
            next(sub),
            ServerMsg::Goodbye(batchcast::proto::GoodbyeReason::Shutdown)
        ));
    }
    // The holder leaves first, with both batches it held.
    s.leave(holder.id);
    assert!(!fill(), "a stopping stream handed its producer a slot");
}

/// A cut consumer that reads nothing of its replay is neither merged nor
/// rotated back into the shared stream: decoupled, ring of 8; `reader`
/// takes every notice, gives back units 0-3 and keeps 4-7; `stopped`
/// (window 6) never reads. `stopped` is cut at the epoch's start and its
/// replay is made ahead of it (its window and two more). Before, it was
/// rotated back at once (the epoch read from where the ring is: it owed 8
/// units again, replayed none); mid-epoch, merged back where its replay
/// reached a unit the ring still held (the second full hold a stopped
/// trainer cost `pause::` under load). Either way it pinned the ring
/// again though it read nothing.
#[test]
fn a_cut_consumer_that_reads_nothing_is_not_merged_back() {
    let fields: [(&str, &str, &[u64]); 2] = [("x", "u8", &[3, 4, 4]), ("y", "i64", &[])];
    let text = StreamToml::synthetic("t", 3, 300, &fields)
        .epochs(2)
        .key("slots", 8)
        .key("min_consumers", 2)
        .key("workers", 1)
        .raw("pace = \"decoupled\"")
        .to_toml();
    let cfg = Config::parse(&text, Path::new("test.toml")).unwrap();
    let plan = plan_config(&cfg).unwrap().remove(0);
    let s = Stream::start(plan, &Budget::new(1 << 30, 0), 0, &mut Shares::default()).unwrap();
    let grant = |name: &str, window: u32| {
        let mut sub = s
            .subscribe(
                ConsumeRequest {
                    mailbox: true,
                    window,
                    ..request(JoinPolicy::NextEpoch)
                },
                peer(name),
            )
            .unwrap();
        let g = sub.mailbox.take().expect("a mailbox");
        (sub, ConsumerMailbox::open(g.fd, g.spec).unwrap())
    };
    let (reader, reader_mb) = grant("reader", 2);
    let (stopped, stopped_mb) = grant("stopped", 6);
    // The arenas kept for cuts hold no memory until a cut needs one.
    let arena = |s: &Stream, name: &str| {
        let inner = s.lock();
        let c = inner.conns.values().find(|c| c.peer.name == name).unwrap();
        c.replay.as_ref().expect("kept for cuts").allocated()
    };
    assert_eq!((arena(&s, "reader"), arena(&s, "stopped")), (0, 0));
    // The reader takes the ring's 8 units, gives back 4 and keeps 4.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut taken = 0;
    while taken < 8 {
        assert!(Instant::now() < deadline, "{taken} units noticed");
        match reader_mb.pop().unwrap() {
            Some(Notice::Batch(b)) => {
                taken += 1;
                if b.seq < 4 {
                    assert!(reader_mb.push_release(Unit::Shared(b.seq), Totals::default()));
                }
            }
            Some(_) => {}
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    s.doorbell();
    // It waits for data: `stopped` is cut and replayed to, ahead of it.
    let replayed = |s: &Stream| {
        let st = s.stats();
        st.consumers
            .iter()
            .find(|c| c.name == "stopped")
            .map_or(0, |c| c.replayed)
    };
    // Its window and two more, of 3 samples each.
    let deadline = Instant::now() + Duration::from_secs(10);
    while replayed(&s) < 24 {
        assert!(Instant::now() < deadline, "{:?}", s.stats());
        s.doorbell();
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        arena(&s, "stopped") > 0,
        "its replay was written in its arena"
    );
    assert_eq!(arena(&s, "reader"), 0, "never cut: no memory");
    // A moment for the pipeline thread's merge check, then what it was told.
    std::thread::sleep(Duration::from_millis(200));
    s.doorbell();
    std::thread::sleep(Duration::from_millis(100));
    let mut told = Vec::new();
    while let Some(n) = stopped_mb.pop().unwrap() {
        told.push(n);
    }
    assert!(
        matches!(told.first(), Some(Notice::Cut(p)) if p.sample == 0),
        "{told:?}"
    );
    let replayed = told
        .iter()
        .filter(|n| matches!(n, Notice::Replay(_)))
        .count();
    assert_eq!(replayed, 8, "its window and two more: {told:?}");
    assert!(
        !told.iter().any(|n| matches!(n, Notice::Merge(_))),
        "merged back though it read nothing: {told:?}"
    );
    drop((reader, stopped));
    s.shutdown();
}

/// A pipeline thread waiting for the ring's next slot asks only the
/// consumers owing the unit there to ring when they release: a release
/// by anyone else frees no slot. (Before, every mailbox consumer sent a
/// doorbell on its socket after every release while the pipeline waited:
/// broker work that grew with the number of consumers.)
#[test]
fn only_the_consumers_owing_the_pinned_unit_are_asked_to_ring() {
    let fields: [(&str, &str, &[u64]); 1] = [("x", "u8", &[4])];
    let text = StreamToml::synthetic("t", 1, 1000, &fields)
        .key("slots", 4)
        .key("min_consumers", 2)
        .key("workers", 1)
        .raw("hold_limit_s = inf")
        .to_toml();
    let cfg = Config::parse(&text, Path::new("test.toml")).unwrap();
    let plan = plan_config(&cfg).unwrap().remove(0);
    let s = Stream::start(plan, &Budget::new(1 << 30, 0), 0, &mut Shares::default()).unwrap();
    let grant = |name: &str| {
        let mut sub = s
            .subscribe(
                ConsumeRequest {
                    mailbox: true,
                    window: 4,
                    ..request(JoinPolicy::NextEpoch)
                },
                peer(name),
            )
            .unwrap();
        let g = sub.mailbox.take().expect("a mailbox");
        (sub, ConsumerMailbox::open(g.fd, g.spec).unwrap())
    };
    let (fast, fast_mb) = grant("fast");
    let (slow, slow_mb) = grant("slow");
    // The fast one reads and releases the ring's 4 units; the slow one
    // takes nothing: unit 0 pins the ring, owed by the slow one alone.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut released = 0;
    while released < 4 {
        assert!(Instant::now() < deadline, "{released} released");
        match fast_mb.pop().unwrap() {
            Some(Notice::Batch(b)) => {
                assert!(fast_mb.push_release(Unit::Shared(b.seq), Totals::default()));
                released += 1;
            }
            Some(_) => {}
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    s.doorbell();
    // The pipeline thread arms once it has waited a moment.
    while !slow_mb.wants_doorbell() {
        assert!(
            Instant::now() < deadline,
            "the owing consumer never asked to ring"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        !fast_mb.wants_doorbell(),
        "the one owing nothing is asked to ring"
    );
    // The slow one releases unit 0 and rings: the pipeline goes on.
    match slow_mb.pop().unwrap() {
        Some(Notice::Batch(b)) => {
            assert_eq!(b.seq, 0);
            assert!(slow_mb.push_release(Unit::Shared(0), Totals::default()));
        }
        n => panic!("{n:?}"),
    }
    s.doorbell();
    while s.stats().batches_produced < 5 {
        assert!(Instant::now() < deadline, "{:?}", s.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    drop((fast, slow));
    s.shutdown();
}

/// At the defaults (no pace or hold key: `auto` with a 2 s limit), every
/// trainer of a stream the broker computes keeps a replay arena for a
/// cut, counted in the budget, but holding no memory while nobody is cut.
#[test]
fn at_the_defaults_the_arenas_kept_for_cuts_hold_no_memory_until_a_cut() {
    let fields: [(&str, &str, &[u64]); 1] = [("x", "u8", &[64])];
    let text = StreamToml::synthetic("t", 4, 400, &fields)
        .key("min_consumers", 2)
        .to_toml();
    let cfg = Config::parse(&text, Path::new("test.toml")).unwrap();
    let plan = plan_config(&cfg).unwrap().remove(0);
    let budget = Budget::new(1 << 30, 0);
    let s = Stream::start(plan, &budget, 0, &mut Shares::default()).unwrap();
    let subs: Vec<Subscription> = ["a", "b"]
        .iter()
        .map(|name| {
            let req = ConsumeRequest {
                mailbox: true,
                ..request(JoinPolicy::NextEpoch)
            };
            s.subscribe(req, peer(name)).unwrap()
        })
        .collect();
    {
        let inner = s.lock();
        for c in inner.conns.values() {
            let r = c.replay.as_ref().expect("an arena kept for a cut");
            assert_eq!(
                r.allocated(),
                0,
                "{} holds memory though never cut",
                c.peer.name
            );
        }
    }
    assert!(
        budget.stats().replay_bytes > 0,
        "the kept arenas are counted in the budget"
    );
    drop(subs);
    s.shutdown();
}
