//! The RDMA `Connection` handshake message (reference §1.6, §2.6): what an initiator sends to
//! a peer's handshake port to connect its queue pairs, and the peer's answer.
//!
//! `local_nic_path` / `peer_nic_path` are `"<segment>@<nic>"`; GIDs travel as 16
//! colon-separated lowercase hex bytes (Mooncake's form, e.g. `00:00:...:ff:ff:0a:00:00:01`),
//! not sysfs's 8 groups of 4 hex digits. Decoding keeps unknown
//! fields (`efa_addr`, `jetty_num`, ... of other builds) and re-emits them; it is strict where
//! a wrong value would connect the wrong queue pairs ([`ConnectionMsg::validate`]).

use super::WireError;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Most QPs one endpoint may announce (Mooncake uses `MC_NUM_QP_PER_EP`, 2 by default).
pub(crate) const MAX_QPS: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ConnectionMsg {
    /// Opaque to the transport (Mooncake sends an empty string).
    #[serde(default)]
    pub payload: String,
    /// The sender's NIC: `"<segment>@<nic>"`.
    pub local_nic_path: String,
    #[serde(default)]
    pub local_lid: u16,
    /// The sender's GID, 16 colon-separated hex bytes.
    #[serde(default)]
    pub local_gid: String,
    /// The receiver's NIC the sender wants to reach: `"<segment>@<nic>"`.
    pub peer_nic_path: String,
    /// The sender's QP numbers, one per QP of the endpoint.
    #[serde(default)]
    pub qp_num: Vec<u32>,
    /// Present (with any value) when the sender supports the `ready_ack` round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_ack: Option<bool>,
    /// Non-empty in an answer that refuses the connection: the reason.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reply_msg: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn bad(field: &str, reason: impl Into<String>) -> WireError {
    WireError::Descriptor {
        field: format!("Connection.{field}"),
        reason: reason.into(),
    }
}

/// Splits `"<segment>@<nic>"` at its last `@` (a segment name may hold one, a NIC name not).
pub(crate) fn split_nic_path(path: &str) -> Option<(&str, &str)> {
    let (seg, nic) = path.rsplit_once('@')?;
    (!seg.is_empty() && !nic.is_empty()).then_some((seg, nic))
}

/// Parses a GID in Mooncake's wire form (16 colon-separated hex bytes).
pub fn parse_gid(s: &str) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    let mut n = 0;
    for part in s.split(':') {
        if n == 16 || part.is_empty() || part.len() > 2 {
            return None;
        }
        out[n] = u8::from_str_radix(part, 16).ok()?;
        n += 1;
    }
    (n == 16).then_some(out)
}

/// Mooncake's wire form of a GID.
pub fn format_gid(g: &[u8; 16]) -> String {
    g.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

impl ConnectionMsg {
    /// Decodes and validates a message (the JSON of a `Connection` frame).
    pub fn decode(json: &[u8]) -> Result<ConnectionMsg, WireError> {
        let m: ConnectionMsg = serde_json::from_slice(json).map_err(|e| WireError::Json {
            what: "RDMA Connection message",
            reason: e.to_string(),
        })?;
        m.validate()?;
        Ok(m)
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Whether this is an answer refusing the connection.
    pub fn refused(&self) -> Option<&str> {
        (!self.reply_msg.is_empty()).then_some(self.reply_msg.as_str())
    }

    /// The rules a message must keep to be acted on: both NIC paths `"<segment>@<nic>"`, a
    /// well-formed GID, and (unless it is a refusal) between 1 and [`MAX_QPS`] non-zero QP
    /// numbers (QP 0 is the special SMI QP, never an RC QP).
    pub fn validate(&self) -> Result<(), WireError> {
        for (field, p) in [
            ("local_nic_path", &self.local_nic_path),
            ("peer_nic_path", &self.peer_nic_path),
        ] {
            if split_nic_path(p).is_none() {
                return Err(bad(field, format!("{p:?} is not \"<segment>@<nic>\"")));
            }
        }
        if !self.local_gid.is_empty() && parse_gid(&self.local_gid).is_none() {
            return Err(bad(
                "local_gid",
                format!("{:?} is not 16 colon-separated hex bytes", self.local_gid),
            ));
        }
        if self.refused().is_some() {
            return Ok(());
        }
        if self.qp_num.is_empty() || self.qp_num.len() > MAX_QPS {
            return Err(bad(
                "qp_num",
                format!("{} QP numbers (1..={MAX_QPS} expected)", self.qp_num.len()),
            ));
        }
        if self.qp_num.contains(&0) {
            return Err(bad("qp_num", "QP number 0 is not a reliable-connection QP"));
        }
        if self.qp_num.iter().any(|&q| q >= 1 << 24) {
            return Err(bad("qp_num", "QP numbers are 24-bit"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Mooncake's request as its active side sends it (field names and forms).
    const MOONCAKE: &str = r#"{"local_nic_path":"10.0.0.1:12345@mlx5_0","local_lid":0,
        "local_gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:01","peer_nic_path":"10.0.0.2:12346@mlx5_1",
        "qp_num":[345,346],"payload":"","ready_ack":true,"efa_addr":""}"#;

    #[test]
    fn mooncakes_message_decodes_and_round_trips_with_unknown_fields() {
        let m = ConnectionMsg::decode(MOONCAKE.as_bytes()).unwrap();
        assert_eq!(
            split_nic_path(&m.local_nic_path),
            Some(("10.0.0.1:12345", "mlx5_0"))
        );
        assert_eq!(m.qp_num, [345, 346]);
        assert_eq!(m.ready_ack, Some(true));
        assert_eq!(
            parse_gid(&m.local_gid).unwrap()[10..],
            [0xff, 0xff, 10, 0, 0, 1]
        );
        assert!(
            m.extra.contains_key("efa_addr"),
            "other builds' fields are kept"
        );
        assert_eq!(ConnectionMsg::decode(&m.encode()).unwrap(), m);
        let no_ack = ConnectionMsg {
            ready_ack: None,
            ..m.clone()
        };
        assert!(
            !String::from_utf8(no_ack.encode())
                .unwrap()
                .contains("ready_ack"),
            "absent = capability not offered"
        );
    }

    #[test]
    fn what_would_connect_the_wrong_qps_is_refused() {
        let ok = ConnectionMsg::decode(MOONCAKE.as_bytes()).unwrap();
        let cases = [
            ConnectionMsg {
                peer_nic_path: "mlx5_1".into(),
                ..ok.clone()
            },
            ConnectionMsg {
                local_nic_path: "seg@".into(),
                ..ok.clone()
            },
            ConnectionMsg {
                local_gid: "fe80::1".into(),
                ..ok.clone()
            },
            ConnectionMsg {
                qp_num: vec![],
                ..ok.clone()
            },
            ConnectionMsg {
                qp_num: vec![0],
                ..ok.clone()
            },
            ConnectionMsg {
                qp_num: vec![1 << 24],
                ..ok.clone()
            },
            ConnectionMsg {
                qp_num: vec![7; MAX_QPS + 1],
                ..ok.clone()
            },
        ];
        for c in cases {
            assert!(c.validate().is_err(), "{c:?}");
            assert!(ConnectionMsg::decode(&c.encode()).is_err());
        }
        let refusal = ConnectionMsg {
            qp_num: vec![],
            reply_msg: "no such NIC mlx5_9".into(),
            ..ok
        };
        assert_eq!(
            ConnectionMsg::decode(&refusal.encode()).unwrap().refused(),
            Some("no such NIC mlx5_9")
        );
        assert!(ConnectionMsg::decode(b"[1,2]").is_err() && ConnectionMsg::decode(b"{").is_err());
    }

    #[test]
    fn gids_of_other_than_16_bytes_are_refused() {
        assert!(
            parse_gid("00:00:00:00:00:00:00:00:00:00:ff:ff:0a:63:02").is_none(),
            "15 bytes"
        );
        assert!(
            parse_gid("00:00:00:00:00:00:00:00:00:00:ff:ff:0a:63:02:01:00").is_none(),
            "17 bytes"
        );
        assert!(parse_gid("000:00:00:00:00:00:00:00:00:00:ff:ff:0a:63:02:01").is_none());
    }

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = ConnectionMsg::decode(&bytes);
        }

        #[test]
        fn valid_messages_round_trip(seg in "[a-z0-9.:]{1,20}", nic in "[a-z0-9_]{1,10}", gid in any::<[u8; 16]>(),
                                     qps in proptest::collection::vec(1u32..(1 << 24), 1..8), ack in any::<Option<bool>>()) {
            let m = ConnectionMsg { local_nic_path: format!("{seg}@{nic}"), peer_nic_path: format!("{seg}@{nic}"), local_gid: format_gid(&gid),
                                    qp_num: qps, ready_ack: ack, ..Default::default() };
            prop_assert_eq!(ConnectionMsg::decode(&m.encode()).unwrap(), m);
        }
    }
}
