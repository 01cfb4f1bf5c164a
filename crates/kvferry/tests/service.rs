//! A service on an engine's handshake port (`TransferEngine::serve` / `call_service`, what
//! the store's disk reads ride on): answered for peers, under the cluster key when the
//! engines hold one, refused to a peer without it; an engine without a service answers an
//! empty body. All on 127.0.0.1.

use kvferry::{Config, Error, TransferEngine};
use std::sync::Arc;
use std::time::Duration;

struct KeyFile(std::path::PathBuf);

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn key_file() -> KeyFile {
    use std::os::unix::fs::PermissionsExt;
    let p = std::env::temp_dir().join(format!("kvferry-service-test-{}", std::process::id()));
    std::fs::write(&p, "c".repeat(64)).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    KeyFile(p)
}

fn engine(key: Option<&KeyFile>) -> TransferEngine {
    TransferEngine::new(Config {
        transport: kvferry::TransportMode::Tcp,
        auth_key_file: key.map(|k| k.0.clone()),
        ..Config::default()
    })
    .expect("engine starts")
}

#[test]
fn a_service_answers_peers_holding_the_key_and_no_one_else() {
    let wait = Duration::from_secs(5);
    for keyed in [false, true] {
        let key = key_file();
        let k = keyed.then_some(&key);
        let (a, b) = (engine(k), engine(k));
        b.serve(Some(Arc::new(|body: &[u8]| {
            let mut v = b"echo:".to_vec();
            v.extend_from_slice(body);
            v
        })));
        assert_eq!(
            a.call_service(b.segment_name(), b"hi", wait).unwrap(),
            b"echo:hi",
            "keyed: {keyed}"
        );
        assert!(
            b.call_service(a.segment_name(), b"hi", wait)
                .unwrap()
                .is_empty(),
            "no service: an empty answer"
        );
        if keyed {
            let e = engine(None)
                .call_service(b.segment_name(), b"hi", wait)
                .unwrap_err();
            assert!(matches!(e, Error::Unauthorized { .. }), "{e}");
        }
        b.serve(None);
        assert!(a
            .call_service(b.segment_name(), b"hi", wait)
            .unwrap()
            .is_empty());
    }
}
