//! The cluster key on a master's connection: what a request does before or without the
//! proof ([`gate`]), and the proof itself ([`prove`]) with its bounds on connections not yet
//! proved. Nothing here applies a request to the master.

use super::handlers::misplaced;
use super::{frame_of, SLOW_ANSWER};
use crate::error::StoreError;
use crate::net::read_by;
use crate::proto::{self, Request, Response};
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// What a connection does with a request ([`gate`]).
#[derive(Debug, PartialEq)]
pub(crate) enum Gate {
    /// Applied as usual.
    Pass(Request),
    /// Answered so, then the connection is closed.
    Refuse(Response),
}

fn unauthorized(why: impl Into<String>) -> Response {
    Response::Err(StoreError::Unauthorized(why.into()))
}

/// What a master does with a request of a connection: one holding the cluster key
/// (`keyed`) reads requests only on a connection that proved it ([`prove`]), so a handshake
/// step then is out of place; one without refuses a client that wants to authenticate (a
/// client holding a key must not talk to a master that cannot prove one).
pub(crate) fn gate(keyed: bool, req: Request) -> Gate {
    match req {
        Request::AuthHello { .. } if !keyed => Gate::Refuse(unauthorized("this master has no cluster key (KVFERRY_AUTH_KEY_FILE is unset where it runs): give it the cluster's key file, or unset KVFERRY_AUTH_KEY_FILE on this client")),
        req @ (Request::AuthHello { .. } | Request::AuthProof { .. }) => Gate::Refuse(misplaced(&req)),
        req => Gate::Pass(req),
    }
}

/// What a master holding the cluster key tells a connection whose first frame is not the
/// key's handshake.
const NEEDS_KEY: &str = "this master requires the cluster key: set KVFERRY_AUTH_KEY_FILE on this client to the cluster's key file (a stock Mooncake client cannot authenticate: serve those from a master without a key)";

/// How long a connection to a master holding the cluster key has, from its accept, to prove
/// the key: the handshake and its first sealed frame, whole. Until then the connection holds
/// one of the `Unproved` places, and nothing of it is decoded or served.
pub const PROOF_DEADLINE: Duration = Duration::from_secs(5);

/// The most connections not yet proved (`PROOF_DEADLINE`) a master holding the cluster key
/// keeps at once, in all; more are closed at accept.
pub const MAX_UNPROVED: usize = 256;

/// The most connections not yet proved a master holding the cluster key keeps at once from
/// one address; more are closed at accept.
pub const MAX_UNPROVED_PER_IP: usize = 64;

/// A connection's proof of the cluster key (`KVFERRY_AUTH_KEY_FILE`, [`kvferry::auth`]) to
/// a master that holds it, within `deadline`: the client's opening message in a plain
/// [`Request::AuthHello`] frame (a length prefix over [`proto::MAX_AUTH_HELLO_FRAME`] is
/// refused before anything more is read; the body, in a fixed buffer, is not decoded but
/// for that one message), dialing this master's cluster ([`proto::master_identity`]); the
/// answer in a plain [`Response::AuthChallenge`]; then the client's first sealed frame, which
/// must open under the session (only a client that holds it can seal one: a replayed
/// handshake gets an answer, but nothing more). Returns the session's halves, the first
/// frame's body in `body`. Anything else is refused with the reason (in a plain frame before
/// the session, a sealed one after) and ends the connection (an error).
pub(super) fn prove(
    key: &kvferry::auth::ClusterKey,
    identity: &str,
    s: &TcpStream,
    deadline: Instant,
    body: &mut Vec<u8>,
) -> std::io::Result<(kvferry::auth::Sealer, kvferry::auth::Opener)> {
    use kvferry::auth::{frame_body_len, Refusal, FRAME_HEAD_LEN};
    let refuse = |why: String, sealer: Option<&mut kvferry::auth::Sealer>| -> std::io::Error {
        let frame = frame_of(&unauthorized(why.clone()));
        let frame = match sealer {
            Some(sealer) => {
                let mut out = Vec::new();
                sealer.seal_frame(crate::frame::body(&frame), &mut out);
                out
            }
            None => frame,
        };
        let mut w = s;
        let _ = w.write_all(&frame);
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, why)
    };
    let late = |e: std::io::Error, sealer: Option<&mut kvferry::auth::Sealer>| {
        match e.kind() {
        std::io::ErrorKind::TimedOut => refuse(format!("the cluster key was not proved within {PROOF_DEADLINE:?} of connecting (the handshake and the first request)"), sealer),
        _ => e,
    }
    };
    s.set_write_timeout(Some(PROOF_DEADLINE))?;
    let mut prefix = [0u8; crate::frame::PREFIX_LEN];
    read_by(s, &mut prefix, deadline).map_err(|e| late(e, None))?;
    let n = crate::frame::body_len(prefix, proto::MAX_AUTH_HELLO_FRAME).map_err(|t| {
        refuse(
            format!(
                "{NEEDS_KEY} (its first frame claims {} bytes; the key's handshake is at most {})",
                t.len,
                proto::MAX_AUTH_HELLO_FRAME
            ),
            None,
        )
    })?;
    let mut first = [0u8; proto::MAX_AUTH_HELLO_FRAME];
    read_by(s, &mut first[..n], deadline).map_err(|e| late(e, None))?;
    let Some(hello) = proto::auth_hello_of(&first[..n]) else {
        return Err(refuse(NEEDS_KEY.into(), None));
    };
    let (session, answer) = match kvferry::auth::answer(key, proto::STORE_RPC, hello, &[identity]) {
        Ok(a) => a,
        Err(Refusal::Misdirected { meant, here }) => {
            return Err(refuse(format!("the client dialed {meant:?} and this master is {here:?}: it serves another cluster; give the client the master's cluster id (KVFERRY_STORE_CLUSTER_ID, or MC_STORE_CLUSTER_ID) or point it at a master of its own cluster"), None));
        }
        Err(r) => return Err(refuse(format!("the client's hello: {r}"), None)),
    };
    let mut w = s;
    w.write_all(&frame_of(&Response::AuthChallenge { answer }))?;
    let (mut sealer, mut opener) = session.split();
    let mut head = [0u8; FRAME_HEAD_LEN];
    read_by(s, &mut head, deadline).map_err(|e| late(e, Some(&mut sealer)))?;
    let why = |r: Refusal| {
        format!("the connection's first frame after the handshake: {r}; nothing of it was applied")
    };
    let n = match opener.open_frame_head(&head, proto::MAX_FRAME) {
        Ok(n) => n,
        Err(r) => return Err(refuse(why(r), Some(&mut sealer))),
    };
    // (The head opened: the client holds the session, so its frame may take memory.)
    let mut sealed = vec![0u8; frame_body_len(n)];
    read_by(s, &mut sealed, deadline).map_err(|e| late(e, Some(&mut sealer)))?;
    if let Err(r) = opener.open_frame_body(&sealed, body) {
        return Err(refuse(why(r), Some(&mut sealer)));
    }
    s.set_read_timeout(None)?;
    s.set_write_timeout(Some(SLOW_ANSWER))?;
    Ok((sealer, opener))
}
