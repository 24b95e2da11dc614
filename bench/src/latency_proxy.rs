//! A TCP proxy that adds a fixed one-way delay to every byte in both
//! directions (a round trip `2 × DELAY` longer), without limiting the
//! bandwidth: what a distant server looks like, for bench/remote.py where
//! the kernel's netem is not available. Bytes keep their order and are
//! forwarded as soon as their delay is over (a timestamped queue per
//! direction), so many requests overlap as they would on a long link.
//!
//! Usage: latency_proxy LISTEN_PORT UPSTREAM_HOST:PORT ONE_WAY_MS
//! (LISTEN_PORT 0: any; the port is printed as `listening PORT`).

use std::collections::VecDeque;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(
        args.len() == 4,
        "usage: latency_proxy LISTEN_PORT UPSTREAM ONE_WAY_MS"
    );
    let listener = TcpListener::bind(("127.0.0.1", args[1].parse::<u16>()?)).await?;
    let upstream = args[2].clone();
    let delay = Duration::from_secs_f64(args[3].parse::<f64>().context("ONE_WAY_MS")? / 1e3);
    println!("listening {}", listener.local_addr()?.port());
    loop {
        let (client, _) = listener.accept().await?;
        let upstream = upstream.clone();
        tokio::spawn(async move {
            if let Ok(server) = TcpStream::connect(&upstream).await {
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::join!(pipe(cr, sw, delay), pipe(sr, cw, delay));
            }
        });
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read.
async fn pipe(
    mut from: impl AsyncReadExt + Unpin,
    mut to: impl AsyncWriteExt + Unpin + Send + 'static,
    delay: Duration,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        let mut queue = VecDeque::new();
        while let Some(item) = rx.recv().await {
            queue.push_back(item);
            while let Ok(more) = rx.try_recv() {
                queue.push_back(more);
            }
            while let Some((due, bytes)) = queue.pop_front() {
                tokio::time::sleep_until(due).await;
                if to.write_all(&bytes).await.is_err() {
                    return;
                }
                while let Ok(more) = rx.try_recv() {
                    queue.push_back(more);
                }
            }
        }
        let _ = to.shutdown().await;
    });
    let mut buf = vec![0u8; 256 << 10];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
                {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.await;
}
