//! Frames: a u32 little-endian payload length, then a postcard payload of
//! at most [`MAX_FRAME`] bytes. [`split_frame`] does no I/O (the broker's
//! async connections use it); [`read_frame`] and [`write_frame`] are for
//! blocking sockets (the clients).

use std::io::{ErrorKind, Read, Write};

use serde::{Serialize, de::DeserializeOwned};

use super::MAX_FRAME;
use crate::error::{Result, WireError};

/// Encodes `msg` as one frame (length prefix + payload).
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>> {
    let mut out = postcard::to_extend(msg, vec![0u8; 4])?;
    let len = out.len() - 4;
    if len > MAX_FRAME as usize {
        return Err(WireError::FrameTooLarge {
            len: len as u64,
            max: MAX_FRAME as u64,
        });
    }
    out[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(out)
}

/// Checks a length prefix against [`MAX_FRAME`].
pub fn check_len(len: u32) -> Result<usize> {
    if len > MAX_FRAME {
        Err(WireError::FrameTooLarge {
            len: len as u64,
            max: MAX_FRAME as u64,
        })
    } else {
        Ok(len as usize)
    }
}

/// Decodes one payload; trailing bytes are an error.
pub fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T> {
    let (msg, rest) = postcard::take_from_bytes(payload)?;
    if !rest.is_empty() {
        return Err(WireError::Decode(postcard::Error::DeserializeBadEncoding));
    }
    Ok(msg)
}

/// Takes one complete frame off the front of `buf`, if there is one: the
/// message and the bytes it took. No I/O: whoever reads the socket
/// appends to `buf` and calls this. A length over `max` (at most
/// [`MAX_FRAME`]) is refused before its payload is waited for.
pub fn split_frame<T: DeserializeOwned>(buf: &[u8], max: u32) -> Result<Option<(T, usize)>> {
    let Some(prefix) = buf.first_chunk::<4>() else {
        return Ok(None);
    };
    let len = u32::from_le_bytes(*prefix);
    let max = max.min(MAX_FRAME);
    if len > max {
        return Err(WireError::FrameTooLarge {
            len: len.into(),
            max: max.into(),
        });
    }
    let len = len as usize;
    match buf.get(4..4 + len) {
        Some(payload) => Ok(Some((decode(payload)?, 4 + len))),
        None => Ok(None),
    }
}

/// Reads one frame. `Ok(None)` means the peer closed the connection cleanly
/// between frames; a close inside a frame is an error.
pub fn read_frame<T: DeserializeOwned>(r: &mut impl Read, buf: &mut Vec<u8>) -> Result<Option<T>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(WireError::Io(ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = check_len(u32::from_le_bytes(len))?;
    buf.clear();
    buf.resize(len, 0);
    r.read_exact(buf)?;
    decode(buf).map(Some)
}

/// Writes one frame.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<()> {
    w.write_all(&encode(msg)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::ClientMsg;

    #[test]
    fn split_frame_takes_whole_frames_and_refuses_long_ones_before_their_payload() {
        let one = encode(&ClientMsg::Goodbye).unwrap();
        let mut two = one.clone();
        two.extend_from_slice(&encode(&ClientMsg::Doorbell).unwrap());
        // Incomplete: nothing yet, whatever is missing.
        for cut in 0..one.len() {
            assert!(
                split_frame::<ClientMsg>(&one[..cut], MAX_FRAME)
                    .unwrap()
                    .is_none()
            );
        }
        let (m, used) = split_frame::<ClientMsg>(&two, MAX_FRAME).unwrap().unwrap();
        assert_eq!((m, used), (ClientMsg::Goodbye, one.len()));
        let (m, _) = split_frame::<ClientMsg>(&two[used..], MAX_FRAME)
            .unwrap()
            .unwrap();
        assert_eq!(m, ClientMsg::Doorbell);
        // A length over the caller's bound is refused from its prefix alone.
        let long = 100u32.to_le_bytes();
        assert!(matches!(
            split_frame::<ClientMsg>(&long, 64),
            Err(WireError::FrameTooLarge { len: 100, max: 64 })
        ));
        // A payload with bytes after its message is malformed.
        let mut padded = vec![(one.len() - 4 + 1) as u8, 0, 0, 0];
        padded.extend_from_slice(&one[4..]);
        padded.push(0);
        assert!(matches!(
            split_frame::<ClientMsg>(&padded, MAX_FRAME),
            Err(WireError::Decode(_))
        ));
    }
}
