//! External producers end to end: a broker started with no config, a
//! [`batchcast::Producer`] registering a stream over the real socket, and
//! real consumer processes (`batchcast consume`) reading it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use batchcast::proto::ErrorCode;
use batchcast::{DType, Field, Producer, ProducerOptions};
use batchcast_broker::config::StreamToml;

use crate::common;

use common::{Env, digests, report, wait_stopped};

/// `batchcast consume` of `stream`, waiting up to a minute for it to be
/// registered, dumping what it gets to `dump`.
fn consumer(env: &Env, stream: &str, dump: Option<&Path>) -> std::process::Child {
    let dump = dump.map(|d| d.display().to_string());
    let mut args = vec!["--stream", stream, "--connect-timeout", "60"];
    if let Some(d) = &dump {
        args.extend(["--dump", d]);
    }
    env.consumer(&args)
}

/// A producer of `stream`: `batches` per epoch of the test's fields.
fn options(env: &Env, stream: &str, batches: u64, epochs: Option<u64>) -> ProducerOptions {
    let mut o = ProducerOptions::new(stream, fields(), BATCH, batches);
    o.socket = Some(env.socket());
    o.request.epochs = epochs;
    o.name = "test-producer".into();
    o.request.description = "tests/producer.rs".into();
    o
}

const BATCH: u64 = 8;

fn fields() -> Vec<Field> {
    vec![
        Field {
            name: "x".into(),
            dtype: DType::F32,
            shape: vec![4],
            aux: false,
        },
        Field {
            name: "y".into(),
            dtype: DType::I64,
            shape: vec![],
            aux: false,
        },
    ]
}

/// What batch (`epoch`, `index`) holds: x[i][k] = epoch·1e4 + index·100 +
/// i·10 + k and y[i] = epoch·1000 + index·10 + i; the last batch of an
/// epoch is short (5 samples).
fn expected(epoch: u64, index: u64, samples: u64) -> (Vec<u8>, Vec<u8>) {
    let mut x = Vec::new();
    let mut y = Vec::new();
    for i in 0..samples {
        for k in 0..4 {
            let v = (epoch * 10_000 + index * 100 + i * 10 + k) as f32;
            x.extend_from_slice(&v.to_le_bytes());
        }
        y.extend_from_slice(&((epoch * 1000 + index * 10 + i) as i64).to_le_bytes());
    }
    (x, y)
}

fn samples_of(index: u64, batches: u64) -> u64 {
    if index + 1 == batches { 5 } else { BATCH }
}

/// Writes the expected content of `slot`'s batch and publishes it.
fn fill(p: &mut Producer, slot: &batchcast::FillSlot, samples: u64) {
    let (x, y) = expected(slot.epoch, slot.index, samples);
    let mut views = p.fields_mut(slot);
    views[0][..x.len()].copy_from_slice(&x);
    views[1][..y.len()].copy_from_slice(&y);
    p.publish(slot, samples).unwrap();
}

/// Produces every batch it is handed until the stream ends; returns how
/// many it published.
fn produce_all(p: &mut Producer, batches: u64) -> u64 {
    let mut n = 0;
    while let Some(slot) = p.acquire().unwrap() {
        fill(p, &slot, samples_of(slot.index, batches));
        n += 1;
    }
    n
}

#[test]
fn a_producer_shares_every_batch_with_every_consumer_including_short_last_batches() {
    let env = Env::bare();
    let (batches, epochs) = (3, 2);
    let dumps: Vec<PathBuf> = (0..2).map(|i| env.path(&format!("dump{i}"))).collect();
    // Consumers start first and wait for the stream to be registered.
    let kids: Vec<_> = dumps
        .iter()
        .map(|d| consumer(&env, "ext", Some(d)))
        .collect();
    let mut opts = options(&env, "ext", batches, Some(epochs));
    opts.request.min_consumers = 2;
    opts.request.slots = 3;
    let mut producer = Producer::register(opts).unwrap();
    assert_eq!(producer.schema().batches_per_epoch, batches);
    assert_eq!(produce_all(&mut producer, batches), batches * epochs);
    drop(producer);
    for (kid, dump) in kids.into_iter().zip(&dumps) {
        let r = report(kid);
        assert!(r.ok && r.ended, "{r:#?}");
        assert_eq!(r.batches, batches * epochs, "{r:#?}");
        assert!(r.order_errors.is_empty(), "{r:#?}");
        assert_eq!(r.samples, epochs * (2 * BATCH + 5));
        for e in 0..epochs {
            for b in 0..batches {
                let (x, y) = expected(e, b, samples_of(b, batches));
                let got = |f: &str| std::fs::read(dump.join(format!("e{e}-b{b}-{f}.bin"))).unwrap();
                assert_eq!(got("x"), x, "epoch {e} batch {b} field x");
                assert_eq!(got("y"), y, "epoch {e} batch {b} field y");
            }
        }
    }
    // The stream is gone once its producer is: the name can be registered again.
    let again = Producer::register(options(&env, "ext", 1, Some(1)));
    assert!(again.is_ok(), "{again:?}");
}

#[test]
fn a_broker_configured_with_only_its_broker_section_serves_producer_streams() {
    // The config sets who may connect and nothing else: no [[stream]].
    let uid = nix::unistd::getuid().as_raw();
    let env = Env::start(&format!("[broker]\nallow_uids = [{uid}]\n"));
    assert!(env.stats().streams.is_empty());
    let kid = consumer(&env, "ext", None);
    let mut producer = Producer::register(options(&env, "ext", 2, Some(1))).unwrap();
    assert_eq!(produce_all(&mut producer, 2), 2);
    drop(producer);
    let r = report(kid);
    assert!(r.ok && r.ended && r.batches == 2, "{r:#?}");
}

#[test]
fn a_producer_that_leaves_mid_epoch_gives_consumers_a_clear_error() {
    let env = Env::bare();
    let kid = consumer(&env, "ext", None);
    let mut producer = Producer::register(options(&env, "ext", 4, None)).unwrap();
    let slot = producer.acquire().unwrap().unwrap();
    fill(&mut producer, &slot, BATCH);
    // Take the next slot and vanish while filling it.
    let _half = producer.acquire().unwrap().unwrap();
    drop(producer);
    let r = report(kid);
    assert!(!r.ok, "{r:#?}");
    assert_eq!(r.batches, 1, "the published batch still arrives: {r:#?}");
    assert_eq!(r.error_code.as_deref(), Some("SourceFailed"), "{r:#?}");
    let msg = r.error.unwrap();
    assert!(
        msg.contains("test-producer") && msg.contains("left while filling batch 1"),
        "{msg}"
    );
    let st = env.broker.stats().unwrap();
    assert!(st.streams.iter().all(|s| s.name != "ext"), "{st:#?}");
}

#[test]
fn an_endless_stream_ends_normally_when_its_producer_stops_between_epochs() {
    let env = Env::bare();
    let kid = consumer(&env, "ext", None);
    let batches = 2;
    let mut producer = Producer::register(options(&env, "ext", batches, None)).unwrap();
    for _ in 0..2 * batches {
        let slot = producer.acquire().unwrap().unwrap();
        let samples = samples_of(slot.index, batches);
        producer.publish(&slot, samples).unwrap();
    }
    drop(producer);
    let r = report(kid);
    assert!(r.ok && r.ended, "{r:#?}");
    assert_eq!(r.batches, 2 * batches);
}

#[test]
fn registrations_that_cannot_work_are_refused_with_what_to_change() {
    let env = Env::start(
        &StreamToml::synthetic("train", 4, 8, &[("x", "u8", &[2])])
            .epochs(1)
            .to_toml(),
    );
    let err = Producer::register(options(&env, "train", 2, Some(1))).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::StreamExists), "{err}");
    assert!(
        err.to_string()
            .contains("already serves a stream named `train`")
    );

    let mut zero = options(&env, "ext", 2, Some(1));
    zero.request.fields[0].shape = vec![0];
    let err = Producer::register(zero).unwrap_err();
    assert!(err.to_string().contains("zero dimension"), "{err}");

    let mut slots = options(&env, "ext", 2, Some(1));
    slots.request.slots = 1;
    let err = Producer::register(slots).unwrap_err();
    assert!(err.to_string().contains("slots = 1"), "{err}");

    // Registering again at a batch outside the stream.
    let mut rejoin = options(&env, "ext", 2, Some(1));
    rejoin.request.rejoin = Some(batchcast::proto::Rejoin {
        epoch: 0,
        index: 2,
        readers: 1,
        grace_ms: 0,
    });
    let err = Producer::register(rejoin).unwrap_err();
    assert!(
        err.to_string()
            .contains("registering again at batch 2 of epoch 0, outside the stream"),
        "{err}"
    );
    // At the last epoch a u64 counts, on an endless stream (it wrapped to
    // epoch 0 silently).
    let mut wrap = options(&env, "ext", 2, None);
    wrap.request.rejoin = Some(batchcast::proto::Rejoin {
        epoch: u64::MAX,
        index: 0,
        readers: 1,
        grace_ms: 0,
    });
    let err = Producer::register(wrap).unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "registering again at batch 0 of epoch {}, outside the stream",
            u64::MAX
        )),
        "{err}"
    );

    // A refused producer leaves nothing behind: the name is free.
    let _ok = Producer::register(options(&env, "ext", 2, Some(1))).unwrap();
    // And a second producer for the same name is refused while the first lives.
    let err = Producer::register(options(&env, "ext", 2, Some(1))).unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::StreamExists), "{err}");
}

#[test]
fn consumers_of_an_external_stream_read_the_producers_bytes_in_place() {
    let env = Env::bare();
    let mut producer = Producer::register(options(&env, "ext", 2, Some(1))).unwrap();
    let socket = env.broker.socket.clone();
    let reader = std::thread::spawn(move || {
        let opts = batchcast::ConsumerOptions {
            socket: Some(socket),
            stream: "ext".into(),
            connect_timeout: Duration::from_secs(30),
            ..Default::default()
        };
        let mut c = batchcast::Consumer::connect(opts).unwrap();
        let (base, len) = c.arena();
        let b = c.next().unwrap().unwrap();
        let x = b.field("x").unwrap().as_slice::<f32>().unwrap().to_vec();
        let inside = {
            let p = b.field("x").unwrap().bytes().as_ptr() as usize;
            p >= base as usize && p < base as usize + len
        };
        (x, inside)
    });
    let slot = producer.acquire().unwrap().unwrap();
    fill(&mut producer, &slot, BATCH);
    let (x, _) = expected(0, 0, BATCH);
    let (got, inside) = reader.join().unwrap();
    assert!(inside, "the consumer's view lies in the shared arena");
    let got: Vec<u8> = got.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(got, x);
}

/// A producer of `batches` × `epochs` on its own thread, pausing a
/// moment each batch so a run lasts; it answers how many batches the
/// program published and how often it registered again.
fn producing(
    env: &Env,
    (batches, epochs): (u64, u64),
    consumers: u32,
) -> std::thread::JoinHandle<(u64, u32)> {
    let mut opts = options(env, "ext", batches, Some(epochs));
    opts.request.min_consumers = consumers;
    // Room for a consumer's batches of 5 over the stream's 8.
    opts.request.slots = 6;
    opts.reconnect_timeout = Duration::from_secs(30);
    std::thread::spawn(move || {
        let mut p = Producer::register(opts).unwrap();
        let mut n = 0;
        while let Some(slot) = p.acquire().unwrap() {
            std::thread::sleep(Duration::from_millis(1));
            fill(&mut p, &slot, samples_of(slot.index, batches));
            n += 1;
        }
        (n, p.reconnects())
    })
}

#[test]
fn a_producer_and_its_consumers_ride_through_broker_restarts() {
    let shape = (60, 3);
    let ride = ["--digest", "--reconnect-timeout", "30", "--sleep-ms", "2"];
    let a_args = [&ride[..], &["--stream", "ext", "--connect-timeout", "60"]].concat();
    let b_args = [&a_args[..], &["--no-mailbox", "--batch-size", "5"]].concat();
    let reference = {
        let env = Env::bare();
        let (a, b) = (env.consumer(&a_args), env.consumer(&b_args));
        let made = producing(&env, shape, 2).join().unwrap();
        assert_eq!(made, (60 * 3, 0));
        let (a, b) = (report(a), report(b));
        assert!(a.ok && b.ok, "{a:#?}\n{b:#?}");
        assert_eq!(digests(&a), digests(&b));
        digests(&a)
    };
    assert_eq!(reference.len(), 3);
    let mut env = Env::bare();
    let (a, b) = (env.consumer(&a_args), env.consumer(&b_args));
    let producer = producing(&env, shape, 2);
    // Killed, stopped, killed, each after both consumers read a while
    // from the broker of the moment (each counts what it delivered).
    for kill in [true, false, true] {
        env.wait_for("the consumers to read on", |s| {
            s.streams.iter().any(|s| {
                s.name == "ext"
                    && s.consumers.len() == 2
                    && s.consumers.iter().all(|c| c.delivered >= 15)
            })
        });
        env.restart_broker(kill);
    }
    // The program published each batch once; the producer published its
    // kept batches again itself.
    assert_eq!(producer.join().unwrap(), (60 * 3, 3));
    for r in [report(a), report(b)] {
        common::assert_rode_through(&r, 3, &reference, 59 * BATCH + 5);
    }
}

#[test]
fn a_stream_registered_again_waits_for_its_consumers_and_refuses_a_place_it_no_longer_holds() {
    use batchcast::proto::{Position, Rejoin};
    let env = Env::bare();
    let batches = 20;
    // A producer registering again (as after a restart): from batch 10,
    // for the two consumers it had, holding the stream half a second.
    let mut opts = options(&env, "ext", batches, Some(1));
    opts.request.rejoin = Some(Rejoin {
        epoch: 0,
        index: 10,
        readers: 2,
        grace_ms: 500,
    });
    let t0 = std::time::Instant::now();
    let mut p = Producer::register(opts).unwrap();
    // Its first request opens the stream; no slot comes yet.
    assert_eq!(
        p.acquire_timeout(Duration::from_millis(1)).unwrap(),
        batchcast::Acquired::Pending
    );
    let resume = |sample: u64| batchcast::ConsumerOptions {
        socket: Some(env.socket()),
        stream: "ext".into(),
        resume: Some(Position { epoch: 0, sample }),
        connect_timeout: Duration::from_secs(10),
        reconnect_timeout: Duration::ZERO,
        ..Default::default()
    };
    // Batch 5 is gone with the old broker: refused, saying so.
    let err = batchcast::Consumer::connect(resume(5 * BATCH)).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("external producer") && msg.contains("epoch 0 sample 80"),
        "{msg}"
    );
    // One consumer back, in the middle of batch 12.
    let mut back = batchcast::Consumer::connect(resume(12 * BATCH + 3)).unwrap();
    let reader = std::thread::spawn(move || {
        let mut ys = Vec::new();
        for b in &mut back {
            let b = b.unwrap();
            ys.extend_from_slice(b.field("y").unwrap().as_slice::<i64>().unwrap());
        }
        ys
    });
    // The stream waits for the second one, which never comes, for the grace.
    let first = p.acquire().unwrap().unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(400),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!((first.epoch, first.index, first.readers), (0, 10, 1));
    fill(&mut p, &first, BATCH);
    produce_all(&mut p, batches);
    drop(p);
    // From its place on: sample 3 of batch 12 to the epoch's end.
    let want: Vec<i64> = (12..batches)
        .flat_map(|b| (0..samples_of(b, batches)).map(move |i| (b * 10 + i) as i64))
        .skip(3)
        .collect();
    assert_eq!(reader.join().unwrap(), want);
}

/// Docs (README, security.md): on a producer's stream nothing can be
/// recomputed for a consumer, so one stopped (SIGSTOP) keeps the producer
/// and the other consumers waiting only for the stream's hold limit (the
/// producer sets none here: the default, 2 s): then it is detached and,
/// continued, told why and what to do. The other consumer reads every
/// batch. Before, both waited until it was continued (and then, with the
/// 30 s default, 30 s).
#[test]
fn a_stopped_consumer_of_a_producers_stream_is_detached_at_the_hold_limit() {
    let env = Env::bare();
    let batches = 10;
    let steady = consumer(&env, "ext", None);
    let stopped = env.consumer(&[
        "--stream",
        "ext",
        "--connect-timeout",
        "60",
        "--stop-after",
        "3",
        "--name",
        "stopped",
    ]);
    let mut opts = options(&env, "ext", batches, Some(20));
    opts.request.min_consumers = 2;
    opts.request.slots = 4;
    assert_eq!(opts.request.hold_limit_ms, None, "the default");
    let mut producer = Producer::register(opts).unwrap();
    let made = std::thread::spawn(move || produce_all(&mut producer, batches));
    wait_stopped(stopped.id());
    let t0 = std::time::Instant::now();
    // 200 batches: all made while it is stopped, past the 2 s limit.
    assert_eq!(made.join().unwrap(), 200);
    let finished = t0.elapsed();
    batchcast_cli::harness::signal(stopped.id(), nix::sys::signal::Signal::SIGCONT);
    assert!(
        finished < Duration::from_secs(10),
        "the producer was held {finished:?}"
    );
    let r = report(steady);
    assert!(r.ok && r.ended && r.order_errors.is_empty(), "{r:#?}");
    assert_eq!(r.batches, 200, "{r:#?}");
    let r = report(stopped);
    assert_eq!(r.error_code.as_deref(), Some("HoldLimit"), "{r:#?}");
    let why = r.error.unwrap_or_default();
    assert!(
        why.contains("hold_limit_s of 2") && why.contains("external producer"),
        "{why}"
    );
}
