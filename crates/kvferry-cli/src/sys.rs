//! Small OS helpers: CPU time, page-aligned buffers, byte-size parsing.

use kvferry::hostbuf::{HostBuffer, HostOptions};
use std::time::Duration;

/// CPU time (user + system) of this process.
pub fn self_cpu() -> Duration {
    rusage(libc::RUSAGE_SELF)
}

/// CPU time of waited-for children.
pub fn children_cpu() -> Duration {
    rusage(libc::RUSAGE_CHILDREN)
}

fn rusage(who: libc::c_int) -> Duration {
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(who, &mut ru) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU time of another process, from /proc/<pid>/stat (utime + stime).
pub fn proc_cpu(pid: u32) -> Option<Duration> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(Duration::from_secs_f64(ticks as f64 / hz as f64))
}

/// CPU time of a process and all its descendants (a wrapper script's real worker included).
pub fn tree_cpu(root: u32) -> Duration {
    let mut parent = std::collections::HashMap::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
                continue;
            };
            if let Some(ppid) = rest
                .split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u32>().ok())
            {
                parent.insert(pid, ppid);
            }
        }
    }
    let descends = |mut p: u32| {
        for _ in 0..64 {
            if p == root {
                return true;
            }
            match parent.get(&p) {
                Some(&pp) if pp != p => p = pp,
                _ => return false,
            }
        }
        false
    };
    parent
        .keys()
        .filter(|&&p| descends(p))
        .filter_map(|&p| proc_cpu(p))
        .sum()
}

/// A pre-faulted, page-aligned buffer (kvferry's [`HostBuffer`]) with the bench's pattern fill.
pub struct Buffer(HostBuffer);

impl Buffer {
    /// `huge`: transparent huge pages where the host allows them; `shareable`: memfd-backed,
    /// so a same-host peer maps it (kvferry's allocator), else plain anonymous memory (as a
    /// tensor or `malloc` gives), which peers reach by cross-memory attach.
    pub fn alloc(len: usize, huge: bool, shareable: bool) -> std::io::Result<Buffer> {
        HostBuffer::with(
            len,
            HostOptions {
                populate: true,
                huge_pages: huge,
                shareable,
            },
        )
        .map(Buffer)
    }
    /// `len` bytes of anonymous memory reserved and not touched (no page is made until used).
    pub fn reserve(len: usize) -> std::io::Result<Buffer> {
        HostBuffer::with(
            len,
            HostOptions {
                populate: false,
                huge_pages: false,
                shareable: false,
            },
        )
        .map(Buffer)
    }
    pub fn addr(&self) -> u64 {
        self.0.addr()
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn slice(&self, off: usize, len: usize) -> &[u8] {
        self.0.slice(off, len)
    }
    #[allow(clippy::mut_from_ref)]
    pub fn slice_mut(&self, off: usize, len: usize) -> &mut [u8] {
        self.0.slice_mut(off, len)
    }
    /// Fills a range with a pattern derived from `seed`.
    pub fn fill(&self, off: usize, len: usize, seed: u64) {
        let s = self.slice_mut(off, len);
        let mut chunks = s.chunks_exact_mut(8);
        let first = (off / 8) as u64;
        for (i, c) in (first..).zip(&mut chunks) {
            c.copy_from_slice(&(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed).to_le_bytes());
        }
        for b in chunks.into_remainder() {
            *b = seed as u8;
        }
    }
}

/// Parses `4096`, `4K`, `64KiB`, `1M`, `1GiB`, `16MB` (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (examples: 4096, 64K, 1MiB, 1G)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use K, M or G)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// [`parse_size`] of a size that must be at least one byte (a buffer, a block, a value).
pub fn parse_size_nonzero(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err(format!("{s:?}: at least 1 byte")),
        n => Ok(n),
    }
}

/// The most seconds a flag in seconds takes (about 31 years): deadlines computed from it
/// (`Instant + Duration`) stay far from overflowing.
pub const MAX_SECS: f64 = 1e9;

/// A flag in seconds (clap names the flag in the error): a finite number from 0 to
/// [`MAX_SECS`]; not negative, not `inf` nor `NaN`, which no `Duration` holds.
pub fn parse_secs(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.0..=MAX_SECS).contains(&v) {
        return Err(format!("{s} s is not from 0 to {MAX_SECS:e} s"));
    }
    Ok(v)
}

pub fn human(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes() {
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("16mb").unwrap(), 16 << 20);
        assert!(parse_size("x").is_err());
        assert!(parse_size("1T").is_err());
        assert_eq!(parse_size_nonzero("1").unwrap(), 1);
        assert!(parse_size_nonzero("0").is_err());
        assert_eq!(parse_secs("0").unwrap(), 0.0);
        assert_eq!(parse_secs(" 1.5 ").unwrap(), 1.5);
        for bad in ["-1", "inf", "NaN", "1e10", "", "abc"] {
            assert!(parse_secs(bad).is_err(), "{bad}");
        }
        assert_eq!(human(16 << 20), "16 MiB");
    }
}
