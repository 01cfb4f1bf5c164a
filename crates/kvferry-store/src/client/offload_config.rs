//! Turning the disk tier on as Mooncake spells it: `setup(..., enable_ssd_offload=True,
//! ssd_offload_path=DIR)` and `mooncake_client --enable_offload`, with the
//! `MOONCAKE_OFFLOAD_*` variables Mooncake's client reads for what the call does not say.

use super::ClientConfig;
use crate::error::{StoreError, StoreResult};
use std::time::Duration;

/// The directory, when the call names none (Mooncake's `FileStorageConfig`).
pub const PATH_VAR: &str = "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH";
/// The most bytes of records the disk holds.
pub const SIZE_VAR: &str = "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES";
/// The staging buffer readers are served from (Mooncake's `ClientBuffer`).
pub const BUFFER_VAR: &str = "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES";
/// Seconds between the disk tier's reports to the master.
pub const HEARTBEAT_VAR: &str = "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS";

impl ClientConfig {
    /// Gives this client a disk tier on `path` (empty: `MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`),
    /// its size limit, staging buffer and beat interval taken from `MOONCAKE_OFFLOAD_*`
    /// variables when `env` has them. No directory at all, or a variable that is not a
    /// number, is refused by name.
    pub fn enable_ssd_offload(
        &mut self,
        path: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> StoreResult<()> {
        let path = match path.trim() {
            "" => env(PATH_VAR).unwrap_or_default(),
            p => p.to_string(),
        };
        if path.trim().is_empty() {
            return Err(StoreError::InvalidParams(format!(
                "enable_ssd_offload needs a directory: pass ssd_offload_path, or set {PATH_VAR}"
            )));
        }
        let number = |var: &str| -> StoreResult<Option<u64>> {
            match env(var) {
                None => Ok(None),
                Some(v) if v.trim().is_empty() => Ok(None),
                Some(v) => v.trim().parse::<u64>().map(Some).map_err(|_| {
                    StoreError::InvalidParams(format!(
                        "{var}={v:?} is not a whole number: unset it or give one"
                    ))
                }),
            }
        };
        if let Some(n) = number(SIZE_VAR)?.filter(|&n| n > 0) {
            self.ssd_offload_capacity = n;
        }
        if let Some(n) = number(BUFFER_VAR)?.filter(|&n| n > 0) {
            self.ssd_offload_staging_size = n;
        }
        if let Some(n) = number(HEARTBEAT_VAR)?.filter(|&n| n > 0) {
            self.offload_interval = Duration::from_secs(n);
        }
        self.ssd_offload_path = Some(path.trim().into());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_comes_from_the_call_or_mooncakes_variable() {
        let none = |_: &str| None;
        let mut c = ClientConfig::default();
        let e = c.enable_ssd_offload("", &none).unwrap_err();
        assert!(e.to_string().contains(PATH_VAR), "{e}");
        assert!(c.ssd_offload_path.is_none());
        c.enable_ssd_offload("/nvme/a", &none).unwrap();
        assert_eq!(c.ssd_offload_path.as_deref(), Some("/nvme/a".as_ref()));
        let env = |k: &str| match k {
            PATH_VAR => Some("/nvme/b".to_string()),
            SIZE_VAR => Some("1048576".to_string()),
            BUFFER_VAR => Some("65536".to_string()),
            HEARTBEAT_VAR => Some("3".to_string()),
            _ => None,
        };
        let mut c = ClientConfig::default();
        c.enable_ssd_offload("", &env).unwrap();
        assert_eq!(c.ssd_offload_path.as_deref(), Some("/nvme/b".as_ref()));
        assert_eq!(
            (
                c.ssd_offload_capacity,
                c.ssd_offload_staging_size,
                c.offload_interval
            ),
            (1 << 20, 1 << 16, Duration::from_secs(3))
        );
        let bad = |k: &str| (k == SIZE_VAR).then(|| "lots".to_string());
        let e = ClientConfig::default()
            .enable_ssd_offload("/x", &bad)
            .unwrap_err();
        assert!(e.to_string().contains(SIZE_VAR), "{e}");
    }
}
