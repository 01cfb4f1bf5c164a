//! The router's boundary, checked: neither the routing module (`route.rs`) nor the engine
//! (`engine.rs`) names a transport, outside `#[cfg(test)]`. They reach transports through the
//! `Transport` trait, pick them by what they declare (`Transport::caps`) and the ranks
//! `transport/set.rs` writes, and report on them through its `Diag`; `transport/set.rs` is the
//! one place that builds them by name.
//!
//! The check reads the source: comments are not code, nor are the contents of literals,
//! except that a literal that *is* a transport's name (`"shm"`, compared with
//! `Transport::name`) counts.

/// What the router and the engine must not name, and why. A rule matches whole words:
/// `tcp::` is a path segment (`crate::transport::tcp::`), not the end of `xtcp::`.
const RULES: &[(&str, &str)] = &[
    ("tcp::", "the TCP transport's module (transport/tcp)"),
    (
        "shm::",
        "the shared-memory transport's module (transport/shm)",
    ),
    ("rdma::", "the RDMA transport's module (transport/rdma)"),
    (
        "ibverbs::",
        "the RDMA transport's verbs layer (sys/ibverbs/)",
    ),
    ("nic::", "the RDMA NICs, their ports and topology (nic/)"),
    ("local::", "the own segment's copy (transport/local.rs)"),
    (
        "stage::",
        "GPU staging (gpu/stage.rs), a transport decorator",
    ),
    ("TcpTransport", "a concrete transport"),
    ("ShmTransport", "a concrete transport"),
    ("RdmaTransport", "a concrete transport"),
    ("LocalTransport", "a concrete transport"),
    (
        "StagedTransport",
        "a concrete transport (the staging decorator)",
    ),
    ("Stager", "GPU staging's workers"),
    (
        "TransportMode",
        "the preference order per mode is data: the ranks written in transport/set.rs",
    ),
    (
        "downcast",
        "reaching a concrete transport through `Any` names it all the same",
    ),
];

use crate::source_scan::{rule_hits, strip, without_tests};

/// String literals that would name a transport (its `Transport::name`).
const NAMES: &[&str] = &["tcp", "shm", "rdma", "local"];

/// Every rule `code` breaks: (line, what, why), lines counted from 1.
fn broken(code: &str, literals: &str) -> Vec<(usize, String, &'static str)> {
    let mut found: Vec<(usize, String, &'static str)> = rule_hits(code, RULES)
        .into_iter()
        .map(|(line, needle, why)| (line, needle.to_string(), why))
        .collect();
    for (n, line) in literals.lines().enumerate() {
        for name in NAMES {
            if line.contains(&format!("\"{name}\"")) {
                found.push((
                    n + 1,
                    format!("\"{name}\""),
                    "a transport's name: compared with `Transport::name`, it special-cases that transport",
                ));
            }
        }
    }
    found
}

/// What `src` breaks, outside `#[cfg(test)]`.
fn check(src: &str) -> Vec<(usize, String, &'static str)> {
    broken(
        &without_tests(&strip(src, false)).0,
        &without_tests(&strip(src, true)).0,
    )
}

#[test]
fn the_router_and_the_engine_name_no_transport() {
    let files = [
        ("src/route.rs", include_str!("route.rs")),
        ("src/engine.rs", include_str!("engine.rs")),
    ];
    let mut broke = Vec::new();
    for (name, src) in files {
        assert!(src.len() > 1000, "{name} is not the source it should be");
        broke.extend(
            check(src)
                .into_iter()
                .map(|(line, what, why)| format!("{name}:{line}: names `{what}`: {why}")),
        );
    }
    assert!(
        broke.is_empty(),
        "the router and the engine route through the Transport trait and what transports declare; they must name no transport (build them in transport/set.rs):\n{}",
        broke.join("\n")
    );
}

/// The check finds what it must, where it is, and nothing in comments, other literals or
/// test code.
#[test]
fn the_boundary_check_sees_code_only() {
    let src = r##"//! Uses crate::transport::tcp::TcpTransport in a doc comment.
use crate::transport::Transport; // ShmTransport in a comment
/* crate::transport::shm::ShmTransport in a block comment */
const A: &str = "RdmaTransport in a string, and \"tcp\" quoted in it";
const B: &str = r#"stage::Stager in a raw string"#;
use crate::wire::xtcp::Opcode;
fn f(t: &dyn Transport) -> bool { t.name() == "shm" }
use crate::transport::rdma::RdmaUsage;
#[cfg(test)]
mod tests {
    use crate::transport::tcp::TcpTransport;
    fn g() -> &'static str { "tcp" }
}
struct TcpTransportish;
fn h(x: Box<dyn std::any::Any>) { let _ = x.downcast::<u8>(); }
"##;
    let got: Vec<(usize, String)> = check(src).into_iter().map(|(l, n, _)| (l, n)).collect();
    let want: Vec<(usize, String)> = [(8, "rdma::"), (15, "downcast"), (7, "\"shm\"")]
        .into_iter()
        .map(|(l, n)| (l, n.to_string()))
        .collect();
    assert_eq!(got, want);
}

/// What only `sys/` may name: the platform's raw calls and foreign functions.
const PLATFORM: &[(&str, &str)] = &[
    (
        "libc::",
        "a raw platform call or constant: wrap it in sys/ (or use rustix where it has it)",
    ),
    (
        "extern \"",
        "a foreign function (an `extern \"C\"` declaration or pointer type): declare it in sys/",
    ),
    (
        "libloading",
        "a library loaded at run time: its loader and symbol table live in sys/",
    ),
];

/// Every `PLATFORM` rule the source files of `src/` outside `src/sys/` break, outside
/// `#[cfg(test)]` (and the files of test modules): "file:line: names `what`: why".
fn platform_hits(root: &std::path::Path) -> Vec<String> {
    use crate::source_scan::{children_dir, sources};
    let src = root.join("src");
    let mut test_files = Vec::new();
    let mut broke = Vec::new();
    for file in sources(&src) {
        let text =
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let (code, test_mods) = without_tests(&strip(&text, false));
        test_files.extend(test_mods.iter().flat_map(|m| {
            [
                children_dir(&file).join(format!("{m}.rs")),
                children_dir(&file).join(m).join("mod.rs"),
            ]
        }));
        if file.starts_with(src.join("sys")) {
            continue;
        }
        for (line, needle, why) in rule_hits(&code, PLATFORM) {
            broke.push((file.clone(), line, needle, why));
        }
    }
    broke
        .into_iter()
        .filter(|(file, ..)| !test_files.contains(file))
        .map(|(file, line, needle, why)| {
            let name = file.strip_prefix(root).unwrap_or(&file).display();
            format!("{name}:{line}: names `{needle}`: {why}")
        })
        .collect()
}

#[test]
fn platform_calls_and_ffi_live_in_sys_only() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    assert!(
        root.join("src/engine.rs").is_file(),
        "{} is not the crate's root",
        root.display()
    );
    let broke = platform_hits(root);
    assert!(
        broke.is_empty(),
        "FFI and platform calls live under src/sys/ (small safe wrappers, rustix where it has the call); outside it no `libc::`, `extern \"C\"` or `libloading` in non-test code:\n{}",
        broke.join("\n")
    );
}

/// The platform check finds raw calls and foreign functions in code, and nothing in comments,
/// literals or test code.
#[test]
fn the_platform_check_sees_code_only() {
    let src = r##"//! libc::mmap in a doc comment.
use std::io; // libc::EPERM in a comment
const A: &str = "libc::munmap and extern \"C\" in a string";
fn f() -> i32 { libc::ESRCH }
type F = unsafe extern "C" fn(i32) -> i32;
extern crate alloc;
fn g() { let _ = libloading::Library::new("x"); }
fn h() -> i32 { xlibc::E }
#[cfg(test)]
mod tests {
    fn t() -> i32 { libc::EPERM }
}
"##;
    let (code, _) = without_tests(&strip(src, false));
    let got: Vec<(usize, &str)> = rule_hits(&code, PLATFORM)
        .into_iter()
        .map(|(l, n, _)| (l, n))
        .collect();
    assert_eq!(got, [(4, "libc::"), (5, "extern \""), (7, "libloading")]);
}
