//! The checks on a Python caller's arguments, in one place: what pyo3's
//! own conversions would let through (a `bool` is an `int` to Python) or
//! answer with a bare `TypeError`/`OverflowError` is refused here with
//! `InvalidArgument` naming the argument. The rules on a value's range are
//! the Rust client's (`ConsumerOptions::validate`), so the errors read the
//! same from both clients.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt};

use crate::errors::invalid;

/// `value` as an integer: an `int`, not a `bool`.
pub(crate) fn integer(name: &str, value: &Bound<'_, PyAny>) -> PyResult<i64> {
    if value.is_instance_of::<PyBool>() || !value.is_instance_of::<PyInt>() {
        return Err(invalid(format!(
            "{name}={} must be an integer",
            repr(value)
        )));
    }
    value
        .extract::<i64>()
        .map_err(|_| invalid(format!("{name}={} is out of range", repr(value))))
}

/// An integer ≥ 0 of at most `u32::MAX`.
pub(crate) fn count(name: &str, value: &Bound<'_, PyAny>) -> PyResult<u32> {
    let n = integer(name, value)?;
    if n < 0 {
        return Err(invalid(format!("{name}={n} must be ≥ 0")));
    }
    u32::try_from(n).map_err(|_| invalid(format!("{name}={n} is out of range")))
}

/// A count the client's options check further: below 1 is passed as 0,
/// which they refuse with their own message.
pub(crate) fn size(name: &str, value: &Bound<'_, PyAny>) -> PyResult<u64> {
    Ok(u64::try_from(integer(name, value)?).unwrap_or(0))
}

/// A group seat's `rank`, `world` and `replicate` (default 1).
pub(crate) fn seat_numbers(
    rank: Option<Bound<'_, PyAny>>,
    world: Option<Bound<'_, PyAny>>,
    replicate: Option<Bound<'_, PyAny>>,
) -> PyResult<(Option<u32>, Option<u32>, u32)> {
    Ok((
        rank.map(|r| count("rank", &r)).transpose()?,
        world.map(|w| count("world", &w)).transpose()?,
        replicate.map_or(Ok(1), |r| count("replicate", &r))?,
    ))
}

/// A resume position: `(epoch, sample)`, two integers ≥ 0.
pub(crate) fn position(value: &Bound<'_, PyAny>) -> PyResult<batchcast::proto::Position> {
    let bad = || {
        invalid(format!(
            "resume={} must be (epoch, sample): two integers ≥ 0, as batch.next_position gives",
            repr(value)
        ))
    };
    let (epoch, sample): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
        value.extract().map_err(|_| bad())?;
    let part = |v: &Bound<'_, PyAny>| {
        integer("resume", v)
            .ok()
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(bad)
    };
    Ok(batchcast::proto::Position {
        epoch: part(&epoch)?,
        sample: part(&sample)?,
    })
}

/// A state as `consumer.state_dict()` returned it: a dict.
pub(crate) fn state<'py>(value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
    value.cast::<PyDict>().cloned().map_err(|_| {
        let kind = value
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        invalid(format!(
            "state must be the dict consumer.state_dict() returned, not {kind}"
        ))
    })
}

/// A non-negative, finite number of seconds given as argument `name`.
pub(crate) fn seconds(name: &str, t: f64) -> PyResult<std::time::Duration> {
    if !(t.is_finite() && t >= 0.0) {
        return Err(invalid(format!(
            "{name}={t} must be a number of seconds ≥ 0"
        )));
    }
    Ok(std::time::Duration::from_secs_f64(t))
}

fn repr(value: &Bound<'_, PyAny>) -> String {
    value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into())
}
