//! The engine's own side of the key: what its ports answer to. Internal (the integration
//! tests reach it through `kvferry::testing`).

use super::{answer, ClusterKey, Protocol, Refusal, Session};
use std::sync::Arc;

/// What a keyed endpoint answers to: the key, and the names it is dialed by (a handshake made
/// for another name is refused: [`Refusal::Misdirected`]).
#[derive(Clone, Debug)]
pub struct Keyed {
    pub key: Arc<ClusterKey>,
    pub names: Vec<String>,
}

impl Keyed {
    /// Answers an opening message for `proto` here ([`answer`]).
    pub fn answer(&self, proto: Protocol, hello: &[u8]) -> Result<(Session, Vec<u8>), Refusal> {
        let here: Vec<&str> = self.names.iter().map(String::as_str).collect();
        answer(&self.key, proto, hello, &here)
    }
}
