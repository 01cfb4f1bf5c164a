//! Mooncake 0.3.14's `setup(..., enable_embedded_master=True)`: a `kvferry master` in this
//! process, with the master's defaults, listening on `host` at a port the kernel picks (as
//! stock 0.3.14's embedded master does: it does not take `master_server_addr`'s port).

use kvferry_store::server::MasterServer;
use kvferry_store::{Master, MasterConfig};
use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// An in-process master; `shutdown()` (or garbage collection) stops it.
#[pyclass(frozen, module = "kvferry._kvferry")]
pub(crate) struct EmbeddedMaster {
    server: Mutex<Option<MasterServer>>,
    address: String,
}

#[pymethods]
impl EmbeddedMaster {
    #[new]
    fn new(py: Python<'_>, host: String) -> PyResult<Self> {
        let (server, address) = py
            .detach(|| -> std::io::Result<(MasterServer, String)> {
                let listener = TcpListener::bind((host.as_str(), 0))?;
                let addr = listener.local_addr()?;
                let master = Arc::new(Master::new(MasterConfig::default()));
                let server = MasterServer::start(master, listener, Duration::from_millis(200), 0)?;
                Ok((server, addr.to_string()))
            })
            .map_err(|e| {
                PyOSError::new_err(format!("the embedded master cannot listen on {host}: {e}"))
            })?;
        Ok(EmbeddedMaster {
            server: Mutex::new(Some(server)),
            address,
        })
    }

    /// `host:port` of its RPC listener.
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }

    /// Stops accepting connections and ticking; idempotent.
    fn shutdown(&self) {
        if let Some(s) = self.server.lock().unwrap_or_else(|e| e.into_inner()).take() {
            s.shutdown();
        }
    }
}
