//! Engine errors as Python exceptions.
//!
//! The exception classes live in `kvferry._errors` (Python), so that they can have several
//! bases (`TransferTimeout` is both a `kvferry.TransferError` and a builtin `TimeoutError`).
//! Every exception carries the reason as its message and Mooncake's numeric code as `.code`.

use kvferry::{Error, FailCause, TaskStatus, TransferStatus};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyModule;

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// The Python exception classes of `kvferry._errors`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Base,
    InvalidArgument,
    Config,
    AddressNotRegistered,
    AddressOverlap,
    SegmentNotFound,
    BatchBusy,
    TooManyRequests,
    Transfer,
    Timeout,
    PeerUnreachable,
    Closed,
}

impl Kind {
    fn class_name(self) -> &'static str {
        match self {
            Kind::Base => "KvferryError",
            Kind::InvalidArgument => "InvalidArgument",
            Kind::Config => "ConfigError",
            Kind::AddressNotRegistered => "AddressNotRegistered",
            Kind::AddressOverlap => "AddressOverlap",
            Kind::SegmentNotFound => "SegmentNotFound",
            Kind::BatchBusy => "BatchBusy",
            Kind::TooManyRequests => "TooManyRequests",
            Kind::Transfer => "TransferError",
            Kind::Timeout => "TransferTimeout",
            Kind::PeerUnreachable => "PeerUnreachable",
            Kind::Closed => "EngineClosed",
        }
    }
}

/// Builds `kvferry.<Kind>(message, code)`.
pub fn raise(py: Python<'_>, kind: Kind, message: impl Into<String>, code: i32) -> PyErr {
    let message = message.into();
    let module =
        match ERRORS.get_or_try_init(py, || py.import("kvferry._errors").map(Bound::unbind)) {
            Ok(m) => m.bind(py),
            Err(e) => {
                return PyRuntimeError::new_err(format!(
                    "{message} (and kvferry._errors could not be imported: {e})"
                ));
            }
        };
    match module
        .getattr(kind.class_name())
        .and_then(|cls| cls.call1((message, code)))
    {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}

/// The exception class for an engine error.
pub fn kind_of(e: &Error) -> Kind {
    match e {
        Error::Config(_) | Error::Bind { .. } => Kind::Config,
        Error::InvalidArgument(_) | Error::UnknownBatch(_) | Error::UnknownTask { .. } => {
            Kind::InvalidArgument
        }
        Error::Overlap { .. } => Kind::AddressOverlap,
        Error::NotRegistered { .. }
        | Error::LocalNotRegistered { .. }
        | Error::RemoteNotRegistered { .. } => Kind::AddressNotRegistered,
        Error::UnknownSegmentId(_) | Error::SegmentNotFound { .. } => Kind::SegmentNotFound,
        Error::TooManyRequests { .. } => Kind::TooManyRequests,
        Error::BatchBusy { .. } => Kind::BatchBusy,
        Error::NoTransport { .. } => Kind::Transfer,
        Error::Handshake { .. } | Error::Wire { .. } | Error::Unauthorized { .. } => {
            Kind::PeerUnreachable
        }
        Error::Shutdown => Kind::Closed,
        // The engine's error enum grows (metadata services, ...): classify newer variants by
        // their Mooncake code; anything else is at least a KvferryError.
        #[allow(unreachable_patterns)]
        other => match other.mooncake_code() {
            -1 => Kind::InvalidArgument,
            -3 => Kind::AddressNotRegistered,
            -200 => Kind::SegmentNotFound,
            -101 | -102 | -104 => Kind::PeerUnreachable,
            _ => Kind::Base,
        },
    }
}

/// Converts an engine error.
pub fn engine(py: Python<'_>, e: &Error) -> PyErr {
    raise(py, kind_of(e), e.to_string(), e.mooncake_code())
}

/// Mooncake's code for a failed probe or notify: -101 (ERR_DNS) when the name cannot be
/// resolved or parsed, -102 (ERR_SOCKET) when the peer cannot be reached, the engine's code
/// otherwise.
pub fn peer_code(e: &Error) -> i32 {
    match e {
        Error::SegmentNotFound { .. } => -101,
        Error::Handshake { reason, .. } if reason.starts_with("cannot resolve") => -101,
        Error::Handshake { .. } | Error::Io { .. } => -102,
        other => other.mooncake_code(),
    }
}

/// The exception for a task or batch that ended FAILED or TIMEOUT, chosen by the engine's
/// failure cause: `TransferTimeout`, `AddressNotRegistered`, `SegmentNotFound`, else
/// `TransferError`. The exception's `cause` attribute is the cause's code (see
/// `kvferry.FailCause`), `None` when the engine gave none.
pub fn transfer_failure(py: Python<'_>, segment: &str, st: &TransferStatus) -> PyErr {
    let reason = st.reason.clone().unwrap_or_else(|| match st.status {
        TaskStatus::Timeout => "the transfer did not finish in time".to_string(),
        TaskStatus::Canceled => "the transfer was canceled".to_string(),
        _ => "the transfer failed (no reason recorded)".to_string(),
    });
    let msg = format!(
        "transfer with segment {segment:?} {}: {reason}",
        status_word(st.status)
    );
    let (kind, code) = match (st.status, st.cause) {
        (TaskStatus::Timeout, _) | (_, Some(FailCause::Timeout)) => (Kind::Timeout, -1),
        (_, Some(FailCause::LocalNotRegistered | FailCause::RemoteNotRegistered)) => {
            (Kind::AddressNotRegistered, -3)
        }
        (_, Some(FailCause::SegmentNotFound)) => (Kind::SegmentNotFound, -200),
        _ => (Kind::Transfer, -1),
    };
    let err = raise(py, kind, msg, code);
    let _ = err
        .value(py)
        .setattr("cause", st.cause.map(FailCause::code));
    err
}

pub fn status_word(s: TaskStatus) -> &'static str {
    match s {
        TaskStatus::Waiting => "is waiting",
        TaskStatus::Pending => "is pending",
        TaskStatus::Invalid => "is invalid",
        TaskStatus::Canceled => "was canceled",
        TaskStatus::Completed => "completed",
        TaskStatus::Timeout => "timed out",
        TaskStatus::Failed => "failed",
    }
}
