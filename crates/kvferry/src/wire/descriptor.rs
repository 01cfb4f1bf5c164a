//! The segment descriptor: the JSON document a peer publishes about its memory
//! (Mooncake's `TransferMetadata::encodeSegmentDesc`, reference §2.3).
//!
//! Decoding is tolerant where Mooncake is (unknown fields are kept and re-emitted, a missing
//! `tcp_proto_version` means 1, `protocol` may be a string or an array) and strict where a
//! wrong value would move bytes to the wrong place ([`SegmentDesc::validate`]).

use super::WireError;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// `protocol` is a string, or an array in Mooncake's multi-protocol builds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Protocols {
    One(String),
    Many(Vec<String>),
}

impl Protocols {
    pub fn contains(&self, p: &str) -> bool {
        match self {
            Protocols::One(s) => s == p,
            Protocols::Many(v) => v.iter().any(|s| s == p),
        }
    }
}

impl Default for Protocols {
    fn default() -> Self {
        Protocols::One("tcp".into())
    }
}

/// An RDMA-capable NIC of the peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDesc {
    pub name: String,
    #[serde(default)]
    pub lid: u16,
    #[serde(default)]
    pub gid: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One registered buffer of the peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDesc {
    /// The location (`cpu:0`, `cuda:1`, `*`) or, in Mooncake's tcp form, a name.
    #[serde(default)]
    pub name: String,
    pub addr: u64,
    pub length: u64,
    /// Per-device remote keys (RDMA), one per entry of `devices`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rkey: Vec<u64>,
    /// Per-device local keys (RDMA), one per entry of `devices`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lkey: Vec<u64>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl BufferDesc {
    /// Whether `[addr, addr+len)` lies inside this buffer.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        addr >= self.addr && end <= self.addr.saturating_add(self.length)
    }
}

/// A peer's segment descriptor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SegmentDesc {
    pub name: String,
    #[serde(default)]
    pub protocol: Protocols,
    /// Port of the peer's TCP data listener (0 or absent: no TCP transport).
    #[serde(default)]
    pub tcp_data_port: u16,
    /// Host to connect to for TCP data (Mooncake ≥ 0.3.13); absent or empty: the host part
    /// of the segment name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_data_host: Option<String>,
    /// TCP data protocol version; absent means 1 (legacy, unacknowledged writes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_proto_version: Option<u32>,
    #[serde(default)]
    pub timestamp: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceDesc>,
    #[serde(default)]
    pub buffers: Vec<BufferDesc>,
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub priority_matrix: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma_server_name: Option<String>,
    /// Fields this version does not know: kept so that re-encoding loses nothing.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl SegmentDesc {
    /// An empty TCP descriptor for `name`.
    pub fn new(name: impl Into<String>) -> Self {
        SegmentDesc {
            name: name.into(),
            protocol: Protocols::default(),
            tcp_data_port: 0,
            tcp_data_host: None,
            tcp_proto_version: None,
            timestamp: String::new(),
            devices: Vec::new(),
            buffers: Vec::new(),
            priority_matrix: Map::new(),
            rdma_server_name: None,
            extra: Map::new(),
        }
    }

    /// The TCP data protocol version the peer speaks.
    pub fn tcp_version(&self) -> u32 {
        self.tcp_proto_version.unwrap_or(1)
    }

    /// The host serving TCP data: `tcp_data_host` when published, else `fallback`.
    pub fn data_host<'a>(&'a self, fallback: &'a str) -> &'a str {
        self.tcp_data_host
            .as_deref()
            .filter(|h| !h.is_empty())
            .unwrap_or(fallback)
    }

    /// The buffer holding `[addr, addr+len)`, if any.
    pub fn find_buffer(&self, addr: u64, len: u64) -> Option<&BufferDesc> {
        self.buffers.iter().find(|b| b.contains(addr, len))
    }

    /// Decodes and validates a descriptor.
    pub fn decode(json: &[u8]) -> Result<SegmentDesc, WireError> {
        let desc: SegmentDesc = serde_json::from_slice(json).map_err(|e| WireError::Json {
            what: "segment descriptor",
            reason: e.to_string(),
        })?;
        desc.validate()?;
        Ok(desc)
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a descriptor always serialises")
    }

    /// Checks what a transport relies on; the error names the field.
    pub fn validate(&self) -> Result<(), WireError> {
        let bad = |field: String, reason: &str| {
            Err(WireError::Descriptor {
                field,
                reason: reason.into(),
            })
        };
        if self.name.is_empty() {
            return bad("name".into(), "empty segment name");
        }
        let keyed = ["rdma", "efa", "cxi", "barex"]
            .iter()
            .any(|p| self.protocol.contains(p));
        for (i, d) in self.devices.iter().enumerate() {
            if d.name.is_empty() {
                return bad(format!("devices[{i}].name"), "empty device name");
            }
        }
        for (i, b) in self.buffers.iter().enumerate() {
            if b.addr.checked_add(b.length).is_none() {
                return bad(format!("buffers[{i}]"), "addr + length overflows");
            }
            if keyed && (b.rkey.len() != self.devices.len() || b.lkey.len() != self.devices.len()) {
                return bad(
                    format!("buffers[{i}].rkey"),
                    "key count differs from the number of devices",
                );
            }
        }
        if self.protocol.contains("tcp") && self.tcp_data_port == 0 && !self.buffers.is_empty() {
            return bad(
                "tcp_data_port".into(),
                "protocol is tcp but no data port is published",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tolerant_decode_keeps_unknown_fields() {
        let j = br#"{"name":"127.0.0.1:15000","protocol":"tcp","tcp_data_port":15001,
            "timestamp":"2026-01-01 00:00:00","buffers":[{"name":"cpu:0","addr":4096,"length":8192,"shm_name":"x"}],
            "future":{"a":1}}"#;
        let d = SegmentDesc::decode(j).unwrap();
        assert_eq!(d.tcp_version(), 1, "absent version means v1");
        assert!(d.find_buffer(4096, 8192).is_some());
        assert!(d.find_buffer(4096, 8193).is_none());
        assert!(d.find_buffer(u64::MAX, 2).is_none());
        let re = SegmentDesc::decode(&d.encode()).unwrap();
        assert_eq!(re, d);
        assert_eq!(re.extra["future"]["a"], 1);
        assert_eq!(re.buffers[0].extra["shm_name"], "x");
    }

    #[test]
    fn rdma_form_and_validation() {
        let j = br#"{"name":"10.0.0.5:15432","protocol":"rdma","tcp_data_port":0,"tcp_proto_version":1,
         "timestamp":"2026-08-22 10:00:00",
         "devices":[{"name":"mlx5_0","lid":0,"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05"},
                    {"name":"mlx5_1","lid":0,"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:01:05"}],
         "buffers":[{"name":"cuda:0","addr":140234567680000,"length":1073741824,"rkey":[2101,2102],"lkey":[2101,2102]}],
         "priority_matrix":{"cpu:0":[["mlx5_0"],["mlx5_1"]]}}"#;
        let d = SegmentDesc::decode(j).unwrap();
        assert_eq!(d.devices.len(), 2);
        let mut bad = d.clone();
        bad.buffers[0].rkey.pop();
        let e = bad.validate().unwrap_err();
        assert!(e.to_string().contains("buffers[0].rkey"), "{e}");
        let e = SegmentDesc::decode(br#"{"name":"x","buffers":[{"addr":1}]}"#).unwrap_err();
        assert!(
            e.to_string().contains("length"),
            "missing field is named: {e}"
        );
        let e = SegmentDesc::decode(br#"{"protocol":"tcp"}"#).unwrap_err();
        assert!(e.to_string().contains("name"), "{e}");
        assert!(
            SegmentDesc::decode(br#"{"name":"a","protocol":["tcp","hip"],"tcp_data_port":5}"#)
                .is_ok()
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics(s in ".{0,200}") {
            let _ = SegmentDesc::decode(s.as_bytes());
        }

        #[test]
        fn roundtrip(name in "[a-z0-9:.]{1,20}", port in 1u16.., bufs in proptest::collection::vec((0u64..1<<47, 1u64..1<<30), 0..8)) {
            let mut d = SegmentDesc::new(name);
            d.tcp_data_port = port;
            d.tcp_proto_version = Some(2);
            d.buffers = bufs.into_iter().map(|(addr, length)| BufferDesc { name: "cpu:0".into(), addr, length, rkey: vec![], lkey: vec![], extra: Map::new() }).collect();
            prop_assert_eq!(SegmentDesc::decode(&d.encode()).unwrap(), d);
        }
    }
}
