//! Starting a client's transfer engine: in central mode a bare `local_hostname` gets a held
//! port of `KVFERRY_STORE_CLIENT_MIN_PORT..=KVFERRY_STORE_CLIENT_MAX_PORT` appended, retried
//! while the name is taken, as Mooncake's client does.

use super::ClientConfig;
use crate::error::{StoreError, StoreResult};
use kvferry::{Config, TransferEngine};
use std::net::TcpListener;

/// Whether an engine failed to start because its segment name is taken (retry another port).
fn name_taken(e: &kvferry::Error) -> bool {
    match e {
        kvferry::Error::Metadata { reason, .. } => {
            reason.contains("already registered") || reason.contains("Duplicate")
        }
        _ => false,
    }
}

/// Starts the engine. In central mode a `local_hostname` without a port gets a bound port
/// appended (retrying another one when the name is taken), as Mooncake's client does.
pub(super) fn start_engine(
    cfg: &ClientConfig,
    mut ecfg: Config,
) -> StoreResult<(TransferEngine, Option<TcpListener>)> {
    let start = |ecfg: Config| TransferEngine::new(ecfg);
    let failed =
        |e: kvferry::Error| StoreError::InvalidParams(format!("starting the transfer engine: {e}"));
    let host = cfg.local_hostname.trim();
    if !ecfg.central() || host.is_empty() || kvferry::split_host_port(host).1.is_some() {
        return start(ecfg).map(|e| (e, None)).map_err(failed);
    }
    ecfg.validate().map_err(failed)?;
    let retries = ecfg.store_client_setup_retries;
    let (lo, hi) = ecfg.store_client_ports;
    let bare = kvferry::split_host_port(host).0;
    let mut last = String::from("no free port in the range");
    for _ in 0..retries {
        // Hold a free port of the range (Mooncake's AutoPortBinder: any address, random port).
        let mut held = None;
        for _ in 0..20 {
            let port = rand::random_range(lo..=hi);
            if let Ok(l) = TcpListener::bind(("0.0.0.0", port)) {
                held = Some((l, port));
                break;
            }
        }
        let Some((listener, port)) = held else {
            continue;
        };
        let name = if bare.contains(':') {
            format!("[{bare}]:{port}")
        } else {
            format!("{bare}:{port}")
        };
        ecfg.local_hostname = name;
        match start(ecfg.clone()) {
            Ok(e) => return Ok((e, Some(listener))),
            Err(e) if name_taken(&e) => {
                tracing::info!(
                    "segment name {} is taken; retrying with another port: {e}",
                    ecfg.local_hostname
                );
                last = e.to_string();
            }
            Err(e) => return Err(failed(e)),
        }
    }
    Err(StoreError::InvalidParams(format!(
        "local_hostname {host:?}: no free segment name {host}:<port> with a port in {lo}..={hi} after {retries} attempts (last: {last}); widen KVFERRY_STORE_CLIENT_MIN_PORT/KVFERRY_STORE_CLIENT_MAX_PORT (MC_STORE_CLIENT_*) or pass host:port"
    )))
}
