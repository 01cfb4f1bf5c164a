//! Reading Rust source as the boundary tests do (`boundaries.rs` here and in the store):
//! comments and literals made spaces, `#[cfg(test)]` items left out, whole-word needles found
//! per line. Test support, not part of the API.

use std::path::{Path, PathBuf};

fn ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `src` with comments made spaces, and the contents of string and char literals too unless
/// `keep_literals` (newlines kept, so lines keep their numbers).
pub fn strip(src: &str, keep_literals: bool) -> String {
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

/// `code` (from [`strip`]) with every item under `#[cfg(test)]` made spaces, and the names
/// of the modules it declares so (`#[cfg(test)] mod tests;`: their files are test code).
pub fn without_tests(code: &str) -> (String, Vec<String>) {
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

/// Every rule of `rules` (needle, why) `code` breaks: (line, needle, why), lines counted from
/// 1. A needle matches whole words: `tcp::` is a path segment, not the end of `xtcp::`.
pub fn rule_hits(
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
pub fn sources(dir: &Path) -> Vec<PathBuf> {
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
pub fn children_dir(file: &Path) -> PathBuf {
    let dir = file.parent().expect("a file's directory");
    match file.file_stem().and_then(|s| s.to_str()) {
        Some("mod") | Some("lib") => dir.to_path_buf(),
        Some(stem) => dir.join(stem),
        None => dir.to_path_buf(),
    }
}
