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

fn ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `src` with comments and the contents of string and char literals made spaces (newlines
/// kept, so lines keep their numbers).
fn code_of(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out: Vec<char> = c.clone();
    let blank = |out: &mut Vec<char>, from: usize, to: usize| {
        for ch in &mut out[from..to.min(c.len())] {
            if *ch != '\n' {
                *ch = ' ';
            }
        }
    };
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            let end = c[i..]
                .iter()
                .position(|&ch| ch == '\n')
                .map_or(c.len(), |p| i + p);
            blank(&mut out, i, end);
            i = end;
        } else if c[i] == '/' && next == Some('*') {
            let (mut j, mut depth) = (i + 2, 1);
            while j < c.len() && depth > 0 {
                if c[j] == '/' && c.get(j + 1) == Some(&'*') {
                    (depth, j) = (depth + 1, j + 2);
                } else if c[j] == '*' && c.get(j + 1) == Some(&'/') {
                    (depth, j) = (depth - 1, j + 2);
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if c[i] == 'r'
            && (next == Some('"') || next == Some('#'))
            && (i == 0 || !ident(c[i - 1]) || (c[i - 1] == 'b' && (i == 1 || !ident(c[i - 2]))))
        {
            // A raw string: r"…", r#"…"#, br"…".
            let hashes = c[i + 1..].iter().take_while(|&&ch| ch == '#').count();
            if c.get(i + 1 + hashes) != Some(&'"') {
                i += 1;
                continue;
            }
            let body = i + 2 + hashes;
            let close: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            let end = (body..c.len())
                .find(|&j| c[j..].starts_with(&close))
                .map_or(c.len(), |j| j + close.len());
            blank(&mut out, body, end.saturating_sub(close.len()));
            i = end;
        } else if c[i] == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            blank(&mut out, i + 1, j);
            i = j + 1;
        } else if c[i] == '\'' {
            // A char literal ('x', '\n', '\u{7f}'), or a lifetime ('a), left as it is.
            if next == Some('\\') {
                let end = (i + 2..c.len()).find(|&j| c[j] == '\'').unwrap_or(c.len());
                blank(&mut out, i + 1, end);
                i = end + 1;
            } else if c.get(i + 2) == Some(&'\'') {
                blank(&mut out, i + 1, i + 2);
                i += 3;
            } else {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    out.into_iter().collect()
}

/// `code` (from [`code_of`]) with every item under `#[cfg(test)]` made spaces, and the names
/// of the modules it declares so (`#[cfg(test)] mod tests;`: their files are test code).
fn without_tests(code: &str) -> (String, Vec<String>) {
    let attr: Vec<char> = "#[cfg(test)]".chars().collect();
    let mut out: Vec<char> = code.chars().collect();
    let mut test_mods = Vec::new();
    let mut from = 0;
    while let Some(start) = (from..out.len()).find(|&i| out[i..].starts_with(&attr)) {
        let body = start + attr.len();
        let (mut end, mut depth) = (body, 0i32);
        while end < out.len() {
            match out[end] {
                '{' | '(' | '[' => depth += 1,
                '}' | ')' | ']' if depth == 0 => break, // the end of what holds the item
                '}' if depth == 1 => {
                    end += 1;
                    break;
                }
                '}' | ')' | ']' => depth -= 1,
                ';' if depth == 0 => {
                    end += 1;
                    break;
                }
                _ => {}
            }
            end += 1;
        }
        let item: String = out[body..end].iter().collect();
        let words: Vec<&str> = item
            .split(|ch: char| !ident(ch))
            .filter(|w| !w.is_empty())
            .collect();
        if item.trim_end().ends_with(';') {
            if let Some(name) = words.iter().skip_while(|w| **w != "mod").nth(1) {
                test_mods.push(name.to_string());
            }
        }
        for ch in &mut out[start..end] {
            if *ch != '\n' {
                *ch = ' ';
            }
        }
        from = end.max(body);
    }
    (out.into_iter().collect(), test_mods)
}

/// Every rule of [`RULES`] `code` breaks: (line, needle, why), lines counted from 1.
fn broken(code: &str) -> Vec<(usize, &'static str, &'static str)> {
    broken_by(code, RULES)
}

/// Every rule of `rules` `code` breaks.
fn broken_by(
    code: &str,
    rules: &[(&'static str, &'static str)],
) -> Vec<(usize, &'static str, &'static str)> {
    let mut found = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let chars: Vec<char> = line.chars().collect();
        for &(needle, why) in rules {
            let want: Vec<char> = needle.chars().collect();
            let hit = (0..chars.len()).any(|i| {
                chars[i..].starts_with(&want)
                    && (i == 0 || !ident(chars[i - 1]) || !ident(want[0]))
                    && chars
                        .get(i + want.len())
                        .is_none_or(|&after| !ident(after) || !ident(want[want.len() - 1]))
            });
            if hit {
                found.push((n + 1, needle, why));
            }
        }
    }
    found
}

/// The `.rs` files under `dir`, and of the directories in it, sorted.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            out.extend(sources(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

/// Where the modules a file declares live: beside `mod.rs`, or in a directory named as the
/// file.
fn children_dir(file: &Path) -> PathBuf {
    let dir = file.parent().expect("a file's directory");
    match file.file_stem().and_then(|s| s.to_str()) {
        Some("mod") | Some("lib") => dir.to_path_buf(),
        Some(stem) => dir.join(stem),
        None => dir.to_path_buf(),
    }
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
        let (code, test_mods) = without_tests(&code_of(&src));
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
        let (code, _) = without_tests(&code_of(&src));
        let name = file
            .strip_prefix(root)
            .unwrap_or(file)
            .display()
            .to_string();
        broke.extend(
            broken_by(&code, rules)
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
    let (code, mods) = without_tests(&code_of(src));
    assert_eq!(mods, ["more"]);
    let got: Vec<(usize, &str)> = broken(&code).into_iter().map(|(l, n, _)| (l, n)).collect();
    assert_eq!(got, [(8, "ha::"), (17, "Mutex"), (18, "rand::")], "{code}");
}
