//! The control region: a sealed 64 KiB memfd per engine, mapped shared by the engine and by
//! every initiator attached to it (epoch, closed flag, segment name, initiator slots).

use super::cma::*;
use crate::sys::mem::Mapping;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Size of the control region.
pub(crate) const CTL_LEN: usize = 64 << 10;
/// (02: slots record when their owner started.)
pub(super) const CTL_MAGIC: u64 = u64::from_le_bytes(*b"KVFCTL02");
pub(super) const OFF_MAGIC: usize = 0;
pub(super) const OFF_COOKIE: usize = 8;
pub(super) const OFF_EPOCH: usize = 24;
pub(super) const OFF_CLOSED: usize = 32;
pub(super) const OFF_PROBE: usize = 40;
pub(super) const OFF_HWM: usize = 48;
/// The owner's segment name: a length word, then up to [`NAME_MAX`] bytes.
pub(super) const OFF_NAME: usize = 64;
pub(super) const NAME_MAX: usize = 248;
pub(super) const SLOT_BASE: usize = 320;
pub(super) const SLOT_SIZE: usize = 64;
pub(super) const N_SLOTS: usize = (CTL_LEN - SLOT_BASE) / SLOT_SIZE;

/// A shared mapping of a control region (ours or a peer's).
pub(super) struct CtlMap {
    pub(super) ptr: *mut u8,
    /// The mapping `ptr` starts, unmapped as this value drops.
    map: Mapping,
    /// The process that mapped it.
    pub(super) home: u32,
}

// SAFETY: the mapping is only accessed through atomics and immutable header bytes.
unsafe impl Send for CtlMap {}
unsafe impl Sync for CtlMap {}

impl CtlMap {
    pub(super) fn map(fd: &OwnedFd) -> io::Result<CtlMap> {
        // A memfd at least CTL_LEN long (checked by callers).
        let map = Mapping::shared(fd, CTL_LEN, 0)?;
        if let Err(e) = map.dontfork() {
            tracing::debug!("madvise(MADV_DONTFORK) failed: {e}");
        }
        Ok(CtlMap {
            ptr: map.as_ptr(),
            map,
            home: std::process::id(),
        })
    }

    pub(super) fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= CTL_LEN);
        // SAFETY: in bounds, 8-aligned (the mapping is page-aligned), shared memory accessed
        // only atomically.
        unsafe { &*(self.ptr.add(off) as *const AtomicU64) }
    }

    pub(super) fn header(&self) -> [u8; 24] {
        let mut h = [0u8; 24];
        h[..8].copy_from_slice(&self.word(OFF_MAGIC).load(Ordering::Acquire).to_le_bytes());
        h[8..16].copy_from_slice(&self.word(OFF_COOKIE).load(Ordering::Acquire).to_le_bytes());
        h[16..].copy_from_slice(
            &self
                .word(OFF_COOKIE + 8)
                .load(Ordering::Acquire)
                .to_le_bytes(),
        );
        h
    }

    pub(super) fn cookie_hex(&self) -> String {
        self.header()[8..]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    pub(super) fn epoch(&self) -> &AtomicU64 {
        self.word(OFF_EPOCH)
    }
    pub(super) fn closed(&self) -> &AtomicU64 {
        self.word(OFF_CLOSED)
    }
    pub(super) fn owner(&self, slot: usize) -> &AtomicU64 {
        self.word(SLOT_BASE + slot * SLOT_SIZE)
    }
    pub(super) fn active(&self, slot: usize) -> &AtomicU64 {
        self.word(SLOT_BASE + slot * SLOT_SIZE + 8)
    }
    /// When the slot's owner process started (`/proc/<pid>/stat` field 22; 0: not known):
    /// tells the owner from a later process that was given the same pid.
    pub(super) fn started(&self, slot: usize) -> &AtomicU64 {
        self.word(SLOT_BASE + slot * SLOT_SIZE + 16)
    }

    /// Whether the owner `owner` of slot `slot` still runs: its pid is alive and is the
    /// process that claimed the slot, not a later one given the same pid (a SIGKILLed
    /// initiator's slot keeps its copy "in flight" for ever, and a drain waiting on a reused
    /// pid would wait for ever).
    pub(super) fn owner_alive(&self, slot: usize, owner: u64) -> bool {
        let pid = owner_pid(owner);
        if !pid_exists(pid) {
            return false;
        }
        let Some((exited, started)) = proc_stat(pid) else {
            return true;
        };
        let claimed = self.started(slot).load(Ordering::SeqCst);
        !exited && (claimed == 0 || started.is_none_or(|now| now == claimed))
    }
    /// The segment name its owner wrote (empty if none or malformed).
    pub(super) fn name(&self) -> String {
        let len = (self.word(OFF_NAME).load(Ordering::Acquire) as usize).min(NAME_MAX);
        let mut bytes = vec![0u8; len];
        for (i, b) in bytes.iter_mut().enumerate() {
            // SAFETY: in bounds of the mapping; written once by the owner before publishing.
            *b = unsafe { std::ptr::read_volatile(self.ptr.add(OFF_NAME + 8 + i)) };
        }
        String::from_utf8(bytes).unwrap_or_default()
    }

    pub(super) fn hwm(&self) -> usize {
        (self.word(OFF_HWM).load(Ordering::Acquire) as usize).min(N_SLOTS)
    }
}

impl Drop for CtlMap {
    fn drop(&mut self) {
        if foreign(self.home) {
            self.map.disown(); // a forked child does not have the mapping (MADV_DONTFORK)
        }
        // Else the mapping is unmapped as `map` drops: nothing refers to it any more.
    }
}

/// The process id stored in a slot owner word.
pub(super) fn owner_pid(owner: u64) -> i32 {
    (owner >> 32) as i32
}

/// Whether process `pid` exists (signal 0 checks existence and permission only).
fn pid_exists(pid: i32) -> bool {
    let Some(p) = rustix::process::Pid::from_raw(pid).filter(|_| pid > 0) else {
        return false;
    };
    rustix::process::test_kill_process(p) != Err(rustix::io::Errno::SRCH)
}

/// What `/proc/<pid>/stat` says of a process: whether it has exited (a zombie) and when it
/// started (field 22, clock ticks since boot); `None` if it cannot be read.
fn proc_stat(pid: i32) -> Option<(bool, Option<u64>)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name: the state (field 3) first.
    let mut fields = s[s.rfind(')')? + 1..].split_whitespace();
    let exited = matches!(fields.next(), Some("Z" | "X"));
    Some((exited, fields.nth(18).and_then(|f| f.parse().ok())))
}

/// When process `pid` started (`/proc/<pid>/stat` field 22); `None` if it cannot be read.
pub(super) fn start_time(pid: i32) -> Option<u64> {
    proc_stat(pid).and_then(|(_, started)| started)
}

/// This engine's own control region.
pub(super) struct LocalCtl {
    pub(super) map: CtlMap,
    pub(super) fd: OwnedFd,
}

impl LocalCtl {
    pub(super) fn create(name: &str) -> io::Result<LocalCtl> {
        use rustix::fs::{MemfdFlags, SealFlags};
        let fd = rustix::fs::memfd_create(
            "kvferry-shm-ctl",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, CTL_LEN as u64)?;
        // Peers map the region and read it without a system call: its size must never
        // change under them (a truncated mapping raises SIGBUS in the reader).
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let map = CtlMap::map(&fd)?;
        let cookie: [u8; 16] = rand::random();
        map.word(OFF_COOKIE).store(
            u64::from_le_bytes(cookie[..8].try_into().unwrap_or_default()),
            Ordering::Release,
        );
        map.word(OFF_COOKIE + 8).store(
            u64::from_le_bytes(cookie[8..].try_into().unwrap_or_default()),
            Ordering::Release,
        );
        let name = &name.as_bytes()[..name.len().min(NAME_MAX)];
        // SAFETY: in bounds; nobody else has the region yet.
        unsafe {
            std::ptr::copy_nonoverlapping(name.as_ptr(), map.ptr.add(OFF_NAME + 8), name.len())
        };
        map.word(OFF_NAME)
            .store(name.len() as u64, Ordering::Release);
        map.word(OFF_MAGIC).store(CTL_MAGIC, Ordering::Release);
        Ok(LocalCtl { map, fd })
    }

    /// Waits until no initiator has a copy in flight, up to `until`. Slots of dead owners
    /// are cleared. Returns false if copies were still in flight at `until`.
    pub(super) fn drain(&self, until: Instant) -> bool {
        let mut pause = Duration::from_micros(20);
        loop {
            let mut busy = false;
            for s in 0..self.map.hwm() {
                if self.map.active(s).load(Ordering::SeqCst) == 0 {
                    continue;
                }
                let owner = self.map.owner(s).load(Ordering::SeqCst);
                if owner == 0 || !self.map.owner_alive(s, owner) {
                    // Its owner died mid-copy: the copy cannot continue.
                    self.map.active(s).store(0, Ordering::SeqCst);
                    let _ = self.map.owner(s).compare_exchange(
                        owner,
                        0,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    );
                    continue;
                }
                busy = true;
            }
            if !busy {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

pub(super) fn claim_slot(ctl: &CtlMap, owner: u64) -> Option<usize> {
    for s in 0..N_SLOTS {
        let cur = ctl.owner(s).load(Ordering::SeqCst);
        let free = cur == 0
            || (cur != owner
                && !ctl.owner_alive(s, cur)
                && ctl.active(s).load(Ordering::SeqCst) == 0);
        if free
            && ctl
                .owner(s)
                .compare_exchange(cur, owner, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            // Before the owner raises `active` (after this returns): a drain looks at the
            // slot only then, so it never reads the previous owner's start time.
            ctl.started(s)
                .store(start_time(owner_pid(owner)).unwrap_or(0), Ordering::SeqCst);
            ctl.active(s).store(0, Ordering::SeqCst);
            ctl.word(OFF_HWM).fetch_max(s as u64 + 1, Ordering::SeqCst);
            return Some(s);
        }
    }
    None
}
