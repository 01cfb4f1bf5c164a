//! The state machines' boundary, checked: no code of `src/master/`, `src/repl/` (replication's
//! bookkeeping) or `src/elect/` (the election) outside `#[cfg(test)]`
//! names a driver (the HA layer, the server, the client, the cleanup, `crate::node`'s
//! `Master`), the clock, threads, locks, the network or the file system, or the process's
//! randomness. Time comes in as an argument and whatever else it needs comes from its driver
//! (`crate::node`), so the state machine can be driven by a test, a simulation or a replica
//! alike, and never imports what replicates it.
//!
//! The check reads the source: comments and the contents of literals are not code, and an
//! item under `#[cfg(test)]` (a file it declares as `#[cfg(test)] mod tests;` included) may
//! use anything.

use kvferry::testing::source_scan::{children_dir, rule_hits, sources, strip, without_tests};
use std::path::{Path, PathBuf};

/// What the state machine's code must not name, and why. A rule matches whole words: `ha::`
/// is a path segment (`crate::ha::`, `super::super::ha::`, `ha::Gate` after a grouped
/// import), not the end of `sha::`; `Master` is not `MasterConfig`.
const RULES: &[(&str, &str)] = &[
    (
        "ha::",
        "the HA layer replicates the state machine: a driver",
    ),
    (
        "server::",
        "the server puts the master on the network: a driver",
    ),
    ("client::", "the client is a driver of its own"),
    ("cleanup::", "the metadata cleanup is I/O: a driver"),
    (
        "EtcdClient",
        "the etcd client is I/O: a machine asks for requests (`elect::Op`), its driver sends them",
    ),
    ("node::", "crate::node is the master's driver"),
    ("Master", "crate::node::Master is the master's driver"),
    ("Instant", "the clock: time is an argument (`now`)"),
    ("SystemTime", "the clock: time is an argument (`now`)"),
    ("thread", "threads belong to the drivers"),
    ("thread_local", "per-thread state belongs to the drivers"),
    ("Mutex", "locks belong to the drivers"),
    ("RwLock", "locks belong to the drivers"),
    ("Condvar", "waiting belongs to the drivers"),
    ("mpsc", "channels belong to the drivers"),
    ("std::net", "the network belongs to the drivers"),
    ("std::fs", "the file system belongs to the drivers"),
    ("std::io", "I/O belongs to the drivers"),
    ("std::env", "the environment belongs to the drivers"),
    ("std::process", "processes belong to the drivers"),
    (
        "rand::",
        "the process's randomness: the state draws from its own generator, seeded by its driver",
    ),
    (
        "thread_rng",
        "the process's randomness: the state draws from its own generator, seeded by its driver",
    ),
    (
        "OsRng",
        "the process's randomness: the state draws from its own generator, seeded by its driver",
    ),
    (
        "getrandom",
        "the process's randomness: the state draws from its own generator, seeded by its driver",
    ),
];

/// Every rule of [`RULES`] `code` breaks: (line, needle, why), lines counted from 1.
fn broken(code: &str) -> Vec<(usize, &'static str, &'static str)> {
    rule_hits(code, RULES)
}

#[test]
fn the_state_machine_names_no_driver_clock_lock_thread_io_or_process_randomness() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = sources(&root.join("src/master"));
    assert!(
        files.iter().any(|f| f.ends_with("master/mod.rs")),
        "no src/master/mod.rs among {files:?}"
    );
    for dir in ["repl", "elect"] {
        let more = sources(&root.join("src").join(dir));
        assert!(
            more.iter().any(|f| f.ends_with(format!("{dir}/mod.rs"))),
            "no src/{dir}/mod.rs among {more:?}"
        );
        files.extend(more);
    }
    let mut test_files = Vec::new();
    let mut broke = Vec::new();
    for file in &files {
        let src =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let (code, test_mods) = without_tests(&strip(&src, false));
        test_files.extend(test_mods.iter().flat_map(|m| {
            [
                children_dir(file).join(format!("{m}.rs")),
                children_dir(file).join(m).join("mod.rs"),
            ]
        }));
        let name = file
            .strip_prefix(root)
            .unwrap_or(file)
            .display()
            .to_string();
        broke.extend(
            broken(&code)
                .into_iter()
                .map(|(line, needle, why)| (name.clone(), file.clone(), line, needle, why)),
        );
    }
    let broke: Vec<String> = broke
        .into_iter()
        .filter(|(_, file, ..)| !test_files.contains(file))
        .map(|(name, _, line, needle, why)| format!("{name}:{line}: names `{needle}`: {why}"))
        .collect();
    assert!(broke.is_empty(), "the state machines (src/master/, src/repl/, src/elect/, outside #[cfg(test)]) must be pure: no driver, clock, lock, thread, I/O or process randomness:\n{}", broke.join("\n"));
}

/// The drivers are layered, each importing only what lies below it: the frame codec
/// (`frame.rs`) is sans-IO and imports no driver; the socket helpers (`net.rs`) serve the RPC
/// server and the HA links and import neither, nor the state; the HA layer (`ha/`) does not
/// borrow from the RPC server (it did: replication used `server.rs`'s socket helpers).
#[test]
fn the_drivers_import_only_what_lies_below_them() {
    const DRIVERS: &[(&str, &str)] = &[
        ("server::", "the RPC server is a driver above this one"),
        ("ha::", "the HA layer is a driver above this one"),
        (
            "node::",
            "crate::node is the master's driver, above this one",
        ),
        ("client::", "the client is a driver of its own"),
    ];
    const NOT_THE_SERVER: &[(&str, &str)] = &[("server::", "the HA layer must not borrow from the RPC server: shared socket helpers live in crate::net")];
    let mut sans_io: Vec<(&str, &str)> = DRIVERS.to_vec();
    sans_io.extend([
        ("std::net", "the frame codec is sans-IO"),
        ("thread", "the frame codec is sans-IO"),
        ("Instant", "the frame codec reads no clock"),
    ]);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checks: Vec<(PathBuf, Vec<(&str, &str)>)> = vec![
        (root.join("src/frame.rs"), sans_io),
        (
            root.join("src/net.rs"),
            [DRIVERS, &[("master::", "the socket helpers know no state")]].concat(),
        ),
    ];
    checks.extend(
        sources(&root.join("src/ha"))
            .into_iter()
            .map(|f| (f, NOT_THE_SERVER.to_vec())),
    );
    let mut broke = Vec::new();
    for (file, rules) in &checks {
        let src =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let (code, _) = without_tests(&strip(&src, false));
        let name = file
            .strip_prefix(root)
            .unwrap_or(file)
            .display()
            .to_string();
        broke.extend(
            rule_hits(&code, rules)
                .into_iter()
                .map(|(line, needle, why)| format!("{name}:{line}: names `{needle}`: {why}")),
        );
    }
    assert!(
        broke.is_empty(),
        "a driver imports one above it:\n{}",
        broke.join("\n")
    );
}

/// The check finds what it must, where it is, and nothing in comments, literals or test code.
#[test]
fn the_boundary_check_sees_code_only() {
    let src = r##"//! Uses crate::ha::Gate in a doc comment.
use crate::proto::Segment; // Mutex in a comment
/* std::thread::spawn in a block comment */
const A: &str = "std::time::Instant in a string";
const B: &str = r#"rand::random in a raw string"#;
const C: char = '{';
fn f<'a>(s: &'a str) -> &'a str { s }
use crate::ha::Gate;
#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    fn g() { let _ = std::time::Instant::now(); }
}
#[cfg(test)]
mod more;
struct MasterConfig;
static M: std::sync::Mutex<u8> = std::sync::Mutex::new(0);
fn h() -> u64 { rand::random() }
fn sha() { sha::x(); }
"##;
    let (code, mods) = without_tests(&strip(src, false));
    assert_eq!(mods, ["more"]);
    let got: Vec<(usize, &str)> = broken(&code).into_iter().map(|(l, n, _)| (l, n)).collect();
    assert_eq!(got, [(8, "ha::"), (17, "Mutex"), (18, "rand::")], "{code}");
}
