//! Mooncake's `transfer_engine_bench`, run side by side with kvferry's bench.

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct McPoint {
    pub engine: &'static str,
    pub op: String,
    pub block_bytes: u64,
    pub batch: usize,
    pub threads: usize,
    pub gbps: f64,
    pub initiator_cpu_s_per_gb: f64,
    pub target_cpu_s_per_gb: f64,
}

#[derive(Default)]
pub struct SideBySide {
    points: Vec<McPoint>,
    note: Option<String>,
}

impl SideBySide {
    pub fn points(&self) -> &[McPoint] {
        &self.points
    }
    pub fn gbps(&self, op: &str, block: u64) -> Option<f64> {
        self.points.iter().find(|p| p.op == op && p.block_bytes == block).map(|p| p.gbps).filter(|g| *g > 0.0)
    }
    pub fn print(&self) {
        if let Some(n) = &self.note {
            println!("\nmooncake: {n}");
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn run_side_by_side(_path: Option<&str>, _host: &str, _buffer: u64, _ops: &[String], _blocks: &[u64], _batch: usize, _threads: usize, _duration: f64) -> SideBySide {
    SideBySide { points: Vec::new(), note: Some("not run".into()) }
}
