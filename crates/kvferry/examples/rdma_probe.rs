//! Prints what RDMA can do on this host (`kvferry::host::rdma::probe`) as JSON, plus the GID each
//! active port would use. Used to check the probe against real verbs in the Soft-RoCE VM:
//! `cargo run --example rdma_probe -p kvferry`.

fn main() {
    let p = kvferry::host::rdma::probe();
    println!("{}", serde_json::to_string_pretty(&p).unwrap_or_default());
    for n in &p.nics {
        for port in n.ports.iter().filter(|p| p.active) {
            println!(
                "{} port {}: rate {:?}, gid index {:?}",
                n.name,
                port.num,
                port.rate,
                kvferry::testing::rdma::sysfs::select_gid(port, None)
            );
        }
    }
    match p.why_not() {
        None => println!("RDMA usable"),
        Some(w) => println!("RDMA not usable: {w}"),
    }
}
