//! Bounds on the texts a client gives the broker to show to others: its
//! name, a stream's name, a producer's description. They are printed on
//! every stats line and kept for departed consumers, so their length
//! bounds the stats reply, and control characters could rewrite a
//! terminal.

/// The longest name a client may give itself (`Hello.name`: a trainer's
/// name in `stats`), a stream may have, or a producer's description, in
/// bytes of UTF-8. Names are shown on every stats line and kept for
/// departed consumers, so their length bounds the stats reply.
pub const MAX_NAME_BYTES: usize = 128;
/// The longest description an external producer may give its stream.
pub const MAX_DESCRIPTION_BYTES: usize = 512;

/// A text a client gave that the broker will not show: too long, or
/// holding a control character. Says which rule it broke and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    #[error("{what} is {len} bytes long; at most {max} bytes are allowed: give it {fix}")]
    TooLong {
        what: String,
        len: usize,
        max: usize,
        fix: String,
    },
    #[error(
        "{what} holds the control character {c:?}; names are shown on terminals: give it {fix}"
    )]
    Control { what: String, c: char, fix: String },
}

/// Checks a client's name (`Hello.name`): at most [`MAX_NAME_BYTES`] and
/// no control characters (it is printed on terminals: no escapes). The
/// error says which rule it broke and what to do.
pub fn check_peer_name(name: &str) -> std::result::Result<(), TextError> {
    check_text(
        "the client's name",
        name,
        MAX_NAME_BYTES,
        "a shorter name (ConsumerOptions::name, Python name=, BATCHCAST_NAME)",
    )
}

/// Checks a text a client gives the broker to show to others: at most
/// `max` bytes, no control characters.
pub fn check_text(
    what: &str,
    text: &str,
    max: usize,
    fix: &str,
) -> std::result::Result<(), TextError> {
    if text.len() > max {
        return Err(TextError::TooLong {
            what: what.into(),
            len: text.len(),
            max,
            fix: fix.into(),
        });
    }
    if let Some(c) = text.chars().find(|&c| c.is_control() || is_bidi_control(c)) {
        return Err(TextError::Control {
            what: what.into(),
            c,
            fix: fix.into(),
        });
    }
    Ok(())
}

/// The characters that reorder text on a terminal (bidirectional
/// embeddings, overrides, isolates and marks): a name holding one could
/// make a stats line read as something else, so they count as control
/// characters.
fn is_bidi_control(c: char) -> bool {
    matches!(
        c,
        '\u{061C}' | '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}'
    )
}
