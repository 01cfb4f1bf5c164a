//! Prints what the CUDA driver reports (`kvferry::host::gpu::probe`) as JSON; exits 1 when GPU memory
//! cannot be used. `cargo run --example gpu_probe -p kvferry` (scripts/gpu-check runs it on a
//! GPU machine).

fn main() {
    let p = kvferry::host::gpu::probe();
    println!("{}", serde_json::to_string_pretty(&p).unwrap_or_default());
    if let Some(why) = &p.unavailable {
        eprintln!("GPU memory not usable: {why}");
        std::process::exit(1);
    }
}
