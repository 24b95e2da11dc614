//! A minimal trainer-side consumer: subscribes to a stream, reads every
//! field of every batch through zero-copy views, and prints throughput once
//! a second and at the end of each epoch.
//!
//! ```sh
//! batchcast serve --config examples/synthetic.toml &
//! cargo run --release -p batchcast-examples --bin rust-consumer -- train
//! ```
//!
//! The socket comes from `BATCHCAST_SOCKET` (or the default path), the
//! stream from the first argument (or `BATCHCAST_STREAM`, else `train`).
//! `--step-ms N` spends N ms on each batch, standing in for a training step
//! (`batchcast launch examples/sweep-rust.toml` runs a sweep of these).

use std::time::{Duration, Instant};

use batchcast::{Consumer, ConsumerOptions, Event};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut opts = ConsumerOptions::default();
    let mut step = Duration::ZERO;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--step-ms" => {
                let ms: u64 = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--step-ms needs a number of milliseconds")?;
                step = Duration::from_millis(ms);
            }
            s if s.starts_with("--") => return Err(format!("unknown option {s}").into()),
            stream => opts.stream = stream.to_string(),
        }
    }
    let mut consumer = Consumer::connect(opts)?;
    let schema = consumer.schema().clone();
    println!(
        "subscribed: {} batches of {} per epoch, fields: {}",
        consumer.batches_per_epoch(),
        consumer.batch_size(),
        schema
            .fields
            .iter()
            .map(|f| format!("{} {} {:?}", f.name, f.dtype, f.shape))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let (t0, mut tick) = (Instant::now(), Instant::now());
    let (mut batches, mut bytes, mut checksum) = (0u64, 0u64, 0u64);
    while let Some(event) = consumer.next_event()? {
        match event {
            Event::Batch(batch) => {
                for field in batch.fields()? {
                    // A trainer would hand these bytes to its model; here we
                    // touch one byte per sample so the read is real.
                    for i in 0..batch.len() {
                        checksum = checksum.wrapping_add(field.sample(i)[0] as u64);
                    }
                    bytes += field.bytes().len() as u64;
                }
                if !step.is_zero() {
                    std::thread::sleep(step);
                }
                batches += 1;
                if tick.elapsed().as_secs() >= 1 {
                    report(batches, bytes, t0);
                    tick = Instant::now();
                }
            } // the batch is released here, when it is dropped
            Event::EndOfEpoch(end) => {
                println!(
                    "epoch {} done: {} batches{}",
                    end.epoch,
                    end.batches,
                    if end.complete { "" } else { " (joined late)" }
                );
            }
            Event::EndOfStream => break,
        }
    }
    report(batches, bytes, t0);
    println!("checksum {checksum:x}");
    Ok(())
}

fn report(batches: u64, bytes: u64, t0: Instant) {
    let s = t0.elapsed().as_secs_f64();
    println!(
        "{batches} batches, {:.0} batches/s, {:.0} MB/s",
        batches as f64 / s,
        bytes as f64 / s / 1e6
    );
}
