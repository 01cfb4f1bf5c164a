//! The shared token of HTTP metadata servers (`MC_METADATA_HTTP_TOKEN`, Mooncake 0.3.14), as
//! `kvferry metadata-server` and `kvferry master --enable_http_metadata_server` enforce it:
//! the answers of Mooncake 0.3.14's `mooncake_http_metadata_server` to every method, with no
//! token, another one, malformed headers and the right one (the scheme in any case).
//! Engines sending it are tested in `metadata_interop.rs` (kvferry's and 0.3.14's).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const TOKEN: &str = "0123456789abcdef-token";

/// A server process this test started, killed (by its handle) when dropped.
struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&str], token: Option<&str>) -> (Proc, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvferry"));
    cmd.args(args)
        .env_remove("MC_METADATA_HTTP_TOKEN")
        .env_remove("KVFERRY_METADATA_HTTP_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(t) = token {
        cmd.env("MC_METADATA_HTTP_TOKEN", t);
    }
    let mut child = cmd.spawn().expect("spawn kvferry");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read the first line");
    (Proc(child), line)
}

/// `kvferry metadata-server`: its address.
fn metadata_server(token: Option<&str>) -> (Proc, String) {
    let (p, line) = spawn(&["metadata-server", "--port", "0"], token);
    let port = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("port="))
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    (p, format!("127.0.0.1:{port}"))
}

/// `kvferry master` with its embedded metadata server, started as `mooncake_master` is: the
/// embedded server's address.
fn master(token: Option<&str>) -> (Proc, String) {
    let (p, line) = spawn(
        &[
            "master",
            "--rpc_port=0",
            "--rpc_address=127.0.0.1",
            "--metrics_port=-1",
            "--enable_http_metadata_server",
            "--http_metadata_server_host=127.0.0.1",
            "--http_metadata_server_port=0",
            "--enable_metric_reporting=false",
        ],
        token,
    );
    let url = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("metadata="))
        .unwrap_or_else(|| panic!("no metadata= in {line:?}"));
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches("/metadata")
        .to_string();
    // The master binds the embedded server before it announces the URL: it is listening now.
    (p, addr)
}

/// One request with an optional `Authorization` line: (status, body).
fn http(addr: &str, method: &str, target: &str, auth: Option<&str>, body: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let auth = auth
        .map(|a| format!("Authorization: {a}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {target} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (code, body)
}

/// What Mooncake 0.3.14's Python server answers when it holds [`TOKEN`] (checked against it:
/// `mooncake/http_metadata_server.py`, `_handle_metadata` and `_token_ok`).
fn check_token_server(addr: &str, who: &str) {
    let good = format!("Bearer {TOKEN}");
    let refused = [
        None,
        Some("Bearer not-the-token".to_string()),
        Some(format!("Bearer {TOKEN}x")),
        Some(format!("Basic {TOKEN}")),
        Some("Bearer".to_string()),
        Some("Bearer ".to_string()),
        Some(format!("Bearer  {TOKEN}")),
        Some(TOKEN.to_string()),
    ];
    for auth in &refused {
        for (method, target) in [
            ("GET", "/metadata?key=k"),
            ("PUT", "/metadata?key=k"),
            ("DELETE", "/metadata?key=k"),
            ("POST", "/metadata?key=k"),
            // Refused before the key is looked at.
            ("GET", "/metadata"),
        ] {
            assert_eq!(
                http(addr, method, target, auth.as_deref(), "v"),
                (401, "unauthorized".to_string()),
                "{who}: {method} {target} with {auth:?}"
            );
        }
    }
    // Nothing was written by the refused PUTs.
    assert_eq!(
        http(addr, "GET", "/metadata?key=k", Some(&good), "").0,
        404,
        "{who}"
    );
    assert_eq!(
        http(addr, "PUT", "/metadata?key=k", Some(&good), "v"),
        (200, "metadata updated".to_string()),
        "{who}"
    );
    // The scheme in any case, as the Python server's `scheme.lower() != "bearer"`.
    for auth in [
        good.clone(),
        format!("bearer {TOKEN}"),
        format!("BEARER {TOKEN}"),
    ] {
        assert_eq!(
            http(addr, "GET", "/metadata?key=k", Some(&auth), ""),
            (200, "v".to_string()),
            "{who}: {auth}"
        );
    }
    assert_eq!(
        http(addr, "GET", "/metadata", Some(&good), "").0,
        400,
        "{who}: no key, with the token"
    );
    assert_eq!(
        http(addr, "POST", "/metadata?key=k", Some(&good), "").0,
        405,
        "{who}"
    );
    assert_eq!(
        http(addr, "DELETE", "/metadata?key=k", Some(&good), ""),
        (200, "metadata deleted".to_string()),
        "{who}"
    );
    // Probes hold no token.
    assert_eq!(http(addr, "GET", "/health", None, "").0, 200, "{who}");
}

#[test]
fn metadata_server_with_a_token_answers_as_mooncake_0_3_14() {
    let (_p, addr) = metadata_server(Some(TOKEN));
    check_token_server(&addr, "kvferry metadata-server");
}

#[test]
fn masters_embedded_metadata_server_enforces_the_token_too() {
    let (_p, addr) = master(Some(TOKEN));
    check_token_server(&addr, "kvferry master's embedded metadata server");
}

/// Without a token (unset or blank, as Mooncake's `or None`) nothing changes: any request is
/// served, with or without an `Authorization` header.
#[test]
fn without_a_token_requests_are_served_as_before() {
    for token in [None, Some(""), Some("  ")] {
        let (_p, addr) = metadata_server(token);
        for auth in [None, Some("Bearer whatever")] {
            assert_eq!(
                http(&addr, "PUT", "/metadata?key=k", auth, "v").0,
                200,
                "{token:?} {auth:?}"
            );
            assert_eq!(
                http(&addr, "GET", "/metadata?key=k", auth, ""),
                (200, "v".to_string()),
                "{token:?} {auth:?}"
            );
        }
    }
}

/// `kvferry doctor` lists the token's variable (under the name it was set by) with its length,
/// never its value; the same for passwords.
#[test]
fn doctor_shows_the_token_by_length_only() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .arg("doctor")
        .env_remove("KVFERRY_METADATA_HTTP_TOKEN")
        .env("MC_METADATA_HTTP_TOKEN", TOKEN)
        .env("KVFERRY_REDIS_PASSWORD", "hunter2-password")
        .stdin(Stdio::null())
        .output()
        .expect("run kvferry doctor");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!(
            "MC_METADATA_HTTP_TOKEN=(set, {} bytes, not shown)",
            TOKEN.len()
        )) && text.contains("KVFERRY_REDIS_PASSWORD=(set, 16 bytes, not shown)"),
        "{text}"
    );
    assert!(
        !text.contains(TOKEN) && !text.contains("hunter2"),
        "a secret is shown: {text}"
    );
}
