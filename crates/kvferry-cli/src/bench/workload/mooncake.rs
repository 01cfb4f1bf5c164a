//! Stock Mooncake through the same requests, in the same run: `--mooncake-python PY` runs
//! `tests/interop/mooncake_workload.py` (two Mooncake engines over TCP, the calls its users
//! make) on the descriptors kvferry moved, written to files for it.

use super::{request, Pool, Preset};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A point Mooncake runs: which request slots, drawn as kvferry's were.
pub(super) struct Planned {
    pub(super) preset: &'static Preset,
    pub(super) tokens: u64,
    pub(super) concurrency: usize,
    pub(super) direction: String,
    pub(super) seed: u64,
    pub(super) pool_blocks: u64,
}

/// Mooncake's records (one JSON object each), or why there are none.
pub(super) struct Outcome {
    pub(super) points: Vec<serde_json::Value>,
    pub(super) note: Option<String>,
}

impl Outcome {
    fn note(s: impl Into<String>) -> Outcome {
        Outcome {
            points: Vec::new(),
            note: Some(s.into()),
        }
    }
}

/// A directory of our own under the system's temporary one, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_descs(path: &Path, p: &Planned) -> Result<usize, String> {
    let pool = Pool::new(p.preset, p.pool_blocks);
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?,
    );
    let mut per_slot = 0;
    for slot in 0..p.concurrency as u64 {
        let d = request(p.preset, &pool, p.tokens, slot, p.seed)
            .ok_or("a planned request does not fit its pool")?;
        per_slot = d.len();
        for x in d {
            for v in [x.local, x.remote, x.len] {
                out.write_all(&v.to_le_bytes())
                    .map_err(|e| format!("{}: {e}", path.display()))?;
            }
        }
    }
    out.flush()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(per_slot)
}

/// Runs Mooncake on `planned` with pools of `pool_bytes`, each point for `secs`, requests in
/// calls of `chunk` descriptors (8192 when 0: what its users post). Bounded by `bound`.
pub(super) fn run(
    py: &str,
    planned: &[Planned],
    pool_bytes: u64,
    secs: f64,
    chunk: usize,
    bound: Duration,
) -> Outcome {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/interop/mooncake_workload.py");
    if !script.is_file() {
        return Outcome::note(format!(
            "not run: {} is missing (run from a source checkout)",
            script.display()
        ));
    }
    let dir =
        Scratch(std::env::temp_dir().join(format!("kvferry-workload-{}", std::process::id())));
    if let Err(e) = std::fs::create_dir_all(&dir.0) {
        return Outcome::note(format!("not run: {}: {e}", dir.0.display()));
    }
    let mut points = Vec::new();
    for (i, p) in planned.iter().enumerate() {
        let path = dir.0.join(format!("{i}.bin"));
        let per_slot = match write_descs(&path, p) {
            Ok(n) => n,
            Err(e) => return Outcome::note(format!("not run: {e}")),
        };
        points.push(serde_json::json!({
            "preset": p.preset.name,
            "tokens": p.tokens,
            "concurrency": p.concurrency,
            "direction": p.direction,
            "descs": path,
            "per_slot": per_slot,
        }));
    }
    let plan = serde_json::json!({
        "pool_bytes": pool_bytes,
        "duration": secs,
        "chunk": if chunk == 0 { 8192 } else { chunk },
        "workers": 8,
        "points": points,
    });
    let plan_path = dir.0.join("plan.json");
    if let Err(e) = std::fs::write(&plan_path, plan.to_string()) {
        return Outcome::note(format!("not run: {}: {e}", plan_path.display()));
    }
    eprint!("\r\x1b[K[mooncake] the same requests through its Python API ...");
    let _ = std::io::stderr().flush();
    let out = crate::peers::output_within(
        Command::new(py).arg(&script).arg("--plan").arg(&plan_path),
        bound,
    );
    eprint!("\r\x1b[K");
    match out {
        Err(e) => Outcome::note(format!("not run: {py}: {e}")),
        Ok(o) => {
            let recs: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect();
            let mut note = recs
                .iter()
                .find_map(|r| r["error"].as_str().map(|e| format!("Mooncake failed: {e}")));
            if o.timed_out() {
                note = Some(format!(
                    "Mooncake did not finish within {bound:?} and was killed (--peer-timeout \
                     adds to the bound); the points it finished are shown"
                ));
            } else if recs.is_empty() {
                note = Some(format!(
                    "Mooncake printed no record: {}",
                    String::from_utf8_lossy(&o.stderr)
                        .lines()
                        .last()
                        .unwrap_or("(nothing on stderr)")
                ));
            }
            Outcome {
                points: recs
                    .into_iter()
                    .filter(|r| r.get("gbps").is_some())
                    .collect(),
                note,
            }
        }
    }
}
