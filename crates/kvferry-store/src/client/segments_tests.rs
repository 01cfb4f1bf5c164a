//! Segments mounted after setup, end to end in one process (a master on 127.0.0.1).

use super::super::{Client, ClientConfig};
use crate::error::StoreError;
use crate::master::MasterConfig;
use crate::node::Master;
use crate::proto::ReplicateConfig;
use crate::server::MasterServer;
use std::sync::Arc;
use std::time::Duration;

/// A segment mounted after setup takes values the setup's segment cannot (too large for
/// it); unmounted, its objects are gone at once; it cannot be unmounted twice, nor one of
/// 0 bytes mounted.
#[test]
fn a_segment_mounted_after_setup_serves_until_unmounted() {
    let m = Arc::new(Master::new(MasterConfig::default()));
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let _s = MasterServer::start(m, l, Duration::from_millis(20), 0).unwrap();
    let client = |seg: u64| {
        Client::setup(ClientConfig {
            master_server_addr: addr.clone(),
            global_segment_size: seg,
            local_buffer_size: 4 << 20,
            ..ClientConfig::default()
        })
        .unwrap()
    };
    let (a, b) = (client(1 << 20), client(0));
    let big = vec![5u8; 3 << 19]; // 1.5 MiB: more than the setup's segment
    let cfg = ReplicateConfig::default();
    assert!(matches!(
        b.put("big", &big, &cfg),
        Err(StoreError::NoAvailableHandle { .. })
    ));
    let (id, size) = a.mount_more(2 << 20).unwrap();
    assert!(size >= 2 << 20);
    assert_eq!(a.more_segments(), vec![(id, size)]);
    b.put("big", &big, &cfg).unwrap();
    assert_eq!(b.get("big").unwrap(), big);
    a.unmount_more(id, Duration::ZERO).unwrap();
    assert!(a.more_segments().is_empty());
    assert!(matches!(b.get("big"), Err(StoreError::ObjectNotFound(_))));
    assert!(matches!(
        a.unmount_more(id, Duration::ZERO),
        Err(StoreError::InvalidParams(_))
    ));
    assert!(matches!(a.mount_more(0), Err(StoreError::InvalidParams(_))));
    a.close().unwrap();
}
