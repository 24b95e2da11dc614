//! The error of parsing a name a user writes: a dtype (`"bf16"`), a device
//! (`"cuda:1"`), a join policy (`"next-epoch"`). A leaf: every module may
//! use it, and it uses none.

/// A name that is not one of the accepted spellings; the message lists them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} `{given}` is not {expected}")]
pub struct ParseError {
    /// What was being parsed (`"dtype"`, `"device"`, `"join"`).
    pub what: &'static str,
    pub given: String,
    /// The accepted spellings, for the message.
    pub expected: &'static str,
}

impl ParseError {
    pub fn new(what: &'static str, given: &str, expected: &'static str) -> ParseError {
        ParseError {
            what,
            given: given.into(),
            expected,
        }
    }
}
