//! Small OS helpers: CPU time, page-aligned buffers, byte-size parsing.

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
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else { continue };
            if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok()) {
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
    parent.keys().filter(|&&p| descends(p)).filter_map(|&p| proc_cpu(p)).sum()
}

/// A page-aligned, pre-faulted anonymous mapping.
pub struct Buffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

const HUGE: usize = 2 << 20;

impl Buffer {
    /// Like [`Buffer::new`]; with `huge`, 2 MiB aligned and advised to use transparent huge
    /// pages (`MADV_HUGEPAGE`) before the pages are populated.
    pub fn with_huge_pages(len: usize, huge: bool) -> std::io::Result<Buffer> {
        if !huge || len < HUGE {
            return Buffer::new(len);
        }
        let span = len + HUGE;
        // SAFETY: anonymous private mapping, not populated yet; checked for MAP_FAILED.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), span, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let start = (p as usize).next_multiple_of(HUGE);
        let (head, tail) = (start - p as usize, p as usize + span - (start + len));
        // SAFETY: trimming our own mapping to the aligned part; then advising and populating it.
        unsafe {
            if head > 0 {
                libc::munmap(p, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            // MADV_POPULATE_WRITE (Linux 5.14); else touch every page.
            if libc::madvise(start as *mut libc::c_void, len, 23) != 0 {
                for off in (0..len).step_by(4096) {
                    std::ptr::write_volatile((start + off) as *mut u8, 0);
                }
            }
        }
        Ok(Buffer { ptr: start as *mut u8, len })
    }

    pub fn new(len: usize) -> std::io::Result<Buffer> {
        // SAFETY: anonymous private mapping; checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Buffer { ptr: p as *mut u8, len })
    }
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds of our mapping.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }
    }
    #[allow(clippy::mut_from_ref)]
    pub fn slice_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds; the bench coordinates who writes when.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
    /// Fills a range with a pattern derived from `seed`.
    pub fn fill(&self, off: usize, len: usize, seed: u64) {
        let s = self.slice_mut(off, len);
        let mut chunks = s.chunks_exact_mut(8);
        let mut i = (off / 8) as u64;
        for c in &mut chunks {
            c.copy_from_slice(&(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed).to_le_bytes());
            i += 1;
        }
        for b in chunks.into_remainder() {
            *b = seed as u8;
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: we own the mapping.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// Parses `4096`, `4K`, `64KiB`, `1M`, `1GiB`, `16MB` (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size (examples: 4096, 64K, 1MiB, 1G)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use K, M or G)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
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
        assert_eq!(human(16 << 20), "16 MiB");
    }
}
