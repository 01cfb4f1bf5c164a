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
    ("ibverbs::", "the RDMA transport's verbs layer (ibverbs/)"),
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

/// String literals that would name a transport (its `Transport::name`).
const NAMES: &[&str] = &["tcp", "shm", "rdma", "local"];

fn ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `src` with comments made spaces, and the contents of string and char literals too unless
/// `keep_literals` (newlines kept, so lines keep their numbers).
fn strip(src: &str, keep_literals: bool) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out: Vec<char> = c.clone();
    let blank = |out: &mut Vec<char>, from: usize, to: usize| {
        for ch in &mut out[from..to.min(c.len())] {
            if *ch != '\n' {
                *ch = ' ';
            }
        }
    };
    let lit = |out: &mut Vec<char>, from: usize, to: usize| {
        if !keep_literals {
            blank(out, from, to);
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
            lit(&mut out, body, end.saturating_sub(close.len()));
            i = end;
        } else if c[i] == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            lit(&mut out, i + 1, j);
            i = j + 1;
        } else if c[i] == '\'' {
            // A char literal ('x', '\n', '\u{7f}'), or a lifetime ('a), left as it is.
            if next == Some('\\') {
                let end = (i + 2..c.len()).find(|&j| c[j] == '\'').unwrap_or(c.len());
                lit(&mut out, i + 1, end);
                i = end + 1;
            } else if c.get(i + 2) == Some(&'\'') {
                lit(&mut out, i + 1, i + 2);
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

/// `code` (from [`strip`]) with every item under `#[cfg(test)]` made spaces.
fn without_tests(code: &str) -> String {
    let attr: Vec<char> = "#[cfg(test)]".chars().collect();
    let mut out: Vec<char> = code.chars().collect();
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
        for ch in &mut out[start..end] {
            if *ch != '\n' {
                *ch = ' ';
            }
        }
        from = end.max(body);
    }
    out.into_iter().collect()
}

/// Every rule `code` breaks: (line, what, why), lines counted from 1.
fn broken(code: &str, literals: &str) -> Vec<(usize, String, &'static str)> {
    let mut found = Vec::new();
    for (n, line) in code.lines().enumerate() {
        let chars: Vec<char> = line.chars().collect();
        for &(needle, why) in RULES {
            let want: Vec<char> = needle.chars().collect();
            let hit = (0..chars.len()).any(|i| {
                chars[i..].starts_with(&want)
                    && (i == 0 || !ident(chars[i - 1]) || !ident(want[0]))
                    && chars
                        .get(i + want.len())
                        .is_none_or(|&after| !ident(after) || !ident(want[want.len() - 1]))
            });
            if hit {
                found.push((n + 1, needle.to_string(), why));
            }
        }
    }
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
        &without_tests(&strip(src, false)),
        &without_tests(&strip(src, true)),
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
