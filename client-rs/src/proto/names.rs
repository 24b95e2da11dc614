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

/// Checks a client's name (`Hello.name`): at most [`MAX_NAME_BYTES`] and
/// no control characters (it is printed on terminals: no escapes). The
/// error says which rule it broke and what to do.
pub fn check_peer_name(name: &str) -> std::result::Result<(), String> {
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
) -> std::result::Result<(), String> {
    if text.len() > max {
        return Err(format!(
            "{what} is {} bytes long; at most {max} bytes are allowed: give it {fix}",
            text.len()
        ));
    }
    if let Some(c) = text.chars().find(|c| c.is_control()) {
        return Err(format!(
            "{what} holds the control character {:?}; names are shown on terminals: give it {fix}",
            c
        ));
    }
    Ok(())
}
