//! Errors of the core as the `batchcast.errors` exceptions Python code
//! catches.

use batchcast::proto::ErrorCode;
use batchcast::{Error, ParseError};
use pyo3::prelude::*;

/// Raises the `batchcast.errors` exception that fits `e`.
pub(crate) fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let code = e.code();
    let class = match &e {
        Error::Connect { .. }
        | Error::Denied { .. }
        | Error::BrokerGone
        | Error::BrokerShutdown
        | Error::Impostor { .. }
        | Error::HandshakeTimeout { .. }
        | Error::Broker {
            code: ErrorCode::Busy | ErrorCode::NotAllowed,
            ..
        } => "BrokerUnavailable",
        Error::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::UnexpectedEof
            ) =>
        {
            "BrokerUnavailable"
        }
        Error::InvalidOption(_) | Error::Parse(_) | Error::OnDevice { .. } => "InvalidArgument",
        Error::Broker {
            code: ErrorCode::SchemaMismatch,
            ..
        } => "SchemaError",
        Error::VersionMismatch { .. } => "VersionMismatch",
        Error::WindowFull { .. } => "WindowFull",
        Error::RingPinned { .. } => "RingPinned",
        Error::Device(_)
        | Error::Broker {
            code: ErrorCode::DeviceUnavailable,
            ..
        } => "DeviceUnavailable",
        #[cfg(feature = "cuda")]
        Error::Cuda(_) => "DeviceUnavailable",
        _ => "StreamError",
    };
    py_error(py, class, e.to_string(), code.map(|c| format!("{c:?}")))
}

/// An instance of `batchcast.errors.<class>` carrying `message` (and the
/// broker's `code`), or a RuntimeError if that module cannot be imported.
pub(crate) fn py_error(
    py: Python<'_>,
    class: &str,
    message: String,
    code: Option<String>,
) -> PyErr {
    py.import("batchcast.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|cls| cls.call1((message.clone(),)))
        .and_then(|exc| {
            exc.setattr("code", code)?;
            Ok(PyErr::from_value(exc))
        })
        .unwrap_or_else(|_| pyo3::exceptions::PyRuntimeError::new_err(message))
}

/// A name the user wrote that is not one the core accepts.
pub(crate) fn parse_error(e: ParseError) -> PyErr {
    invalid(e.to_string())
}

pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    Python::attach(|py| py_error(py, "InvalidArgument", message.into(), None))
}
