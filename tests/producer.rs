//! External producers end to end: a broker started with no config, a
//! [`batchcast::Producer`] registering a stream over the real socket, and
//! real consumer processes (`batchcast consume`) reading it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use batchcast::proto::ErrorCode;
use batchcast::{DType, Field, Producer, ProducerOptions};
use batchcast_broker::config::StreamToml;

mod common;

use common::{Env, report};

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
