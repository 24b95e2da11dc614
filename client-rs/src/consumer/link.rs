//! A consumer's connection to its broker: the socket it reads, the frame
//! being read, whether the broker said its last word, and its reconnects.

use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::reconnect::Down;

#[derive(Debug)]
pub(super) struct Link {
    pub(super) reader: BufReader<UnixStream>,
    /// The frame being read.
    pub(super) buf: Vec<u8>,
    /// The broker sent its last message (an end, a failure): nothing more
    /// is read.
    pub(super) finished: bool,
    /// How long a wait spins before it sleeps (`ConsumerOptions::spin`).
    pub(super) spin: Duration,
    /// Times it subscribed again after the broker went away.
    pub(super) reconnects: u64,
    /// Since when it has waited for its broker to come back, and why it
    /// went (a wait [`super::Consumer::wait_readable`] may leave and take
    /// up again).
    pub(super) down: Option<Down>,
}

impl Link {
    pub(super) fn new(reader: BufReader<UnixStream>, spin: Duration) -> Link {
        Link {
            reader,
            buf: Vec::with_capacity(256),
            finished: false,
            spin,
            reconnects: 0,
            down: None,
        }
    }
}
