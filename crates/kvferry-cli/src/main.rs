//! The `kvferry` binary: a thin front of the kvferry-cli library (see its lib.rs).

fn main() {
    std::process::exit(kvferry_cli::main_with_args(std::env::args_os().collect()));
}
