//! The disk tier's local store: objects a client persists on its own disk, one file each
//! (`layout.rs`), found again after a restart, and never served torn, stale or corrupt.
//!
//! Durability: a record is written to `tmp/`, flushed with `fdatasync`, renamed into
//! `objects/`, and the directory it entered flushed with `fsync`; only then does
//! [`DiskTier::put`] return and the object count as present. A crash before the rename leaves a
//! file in `tmp/`, which [`DiskTier::open`] deletes; a crash after it leaves a whole record.
//! Buffered I/O with fsync, not `O_DIRECT`: the page cache serves repeated gets of hot pages,
//! and the record needs no alignment.
//!
//! Every read checks the record's length and checksum; a record failing either is deleted and
//! reported [`DiskError::Corrupt`], so the caller treats the object as absent. One process owns
//! a directory at a time (an exclusive `flock` on `.lock`, released when the process dies).
//! Files are opened per call and closed at its end, so open descriptors are bounded by the
//! calls in flight.
//!
//! Eviction is two-phase, so that the master stops naming a replica before its file goes:
//! [`DiskTier::prepare_eviction`] takes objects out of the index (no new get finds them), the
//! caller tells the master, then [`DiskTier::finalize_eviction`] deletes the files, or
//! [`DiskTier::cancel_eviction`] puts them back. A get already reading a file keeps reading it:
//! an unlinked file lives until its last descriptor closes.

pub(crate) mod layout;
#[cfg(test)]
mod tests;

use layout::{checksum, object_path, Header, HEADER_LEN, MAX_KEY};
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// What went wrong in the disk tier, with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error(
        "the offload directory {0} does not exist or is not a directory: create it \
         (mkdir -p) or give an existing directory"
    )]
    NoDirectory(PathBuf),
    #[error(
        "the offload directory {0} is in use by another process (its .lock is held): give \
         each client a directory of its own"
    )]
    InUse(PathBuf),
    #[error("{op} {path}: {err}; check the offload directory's disk (space, permissions, health)")]
    Io {
        op: &'static str,
        path: PathBuf,
        err: io::Error,
    },
    #[error(
        "the disk tier holds {used} of its {capacity} bytes and {need} more do not fit: evict \
         first, or raise the offload size limit"
    )]
    Full { used: u64, capacity: u64, need: u64 },
    #[error(
        "the record of {key:?} at {path} is corrupt ({why}): it was deleted; the object is absent"
    )]
    Corrupt {
        key: String,
        path: PathBuf,
        why: String,
    },
    #[error("key of {0} bytes: the disk tier stores keys of at most 64 KiB")]
    KeyTooLong(usize),
    #[error("the buffer of {have} bytes is smaller than the object's {need}")]
    BufferTooSmall { have: usize, need: u64 },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> DiskError + 'a {
    move |err| DiskError::Io {
        op,
        path: path.to_path_buf(),
        err,
    }
}

/// What [`DiskTier::open`] found in the directory.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// Whole records, now served: (key, value length).
    pub objects: Vec<(String, u64)>,
    /// Records that were not whole (wrong length or header) or were left in `tmp/`, deleted.
    pub dropped: usize,
}

#[derive(Debug, Clone)]
struct Entry {
    len: u64,
    last_use: u64,
}

#[derive(Debug, Default)]
struct Index {
    objects: HashMap<String, Entry>,
    /// Bytes of the records indexed (header + key + value each).
    used: u64,
    clock: u64,
}

/// Objects taken out of the index by [`DiskTier::prepare_eviction`], to delete or put back.
#[derive(Debug)]
#[must_use = "finalize or cancel an eviction"]
pub struct PendingEviction {
    entries: Vec<(String, Entry)>,
}

impl PendingEviction {
    /// The keys whose disk replicas go: what the master must be told.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }
}

/// One client's disk tier over one directory.
pub struct DiskTier {
    root: PathBuf,
    id: u64,
    capacity: u64,
    index: Mutex<Index>,
    tmp_seq: AtomicU64,
    _lock: File,
}

impl DiskTier {
    /// Opens `root` (which must exist), takes its lock, deletes what a crash left in `tmp/`
    /// and records that are not whole, and indexes the rest. `capacity` bounds the bytes of
    /// records held.
    pub fn open(root: &Path, capacity: u64) -> Result<(DiskTier, Recovered), DiskError> {
        if !root.is_dir() {
            return Err(DiskError::NoDirectory(root.to_path_buf()));
        }
        let lock_path = root.join(".lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err("creating", &lock_path))?;
        match rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => return Err(DiskError::InUse(root.to_path_buf())),
            Err(e) => return Err(io_err("locking", &lock_path)(e.into())),
        }
        for d in ["tmp", "objects"] {
            let p = root.join(d);
            fs::create_dir_all(&p).map_err(io_err("creating", &p))?;
        }
        let mut rec = Recovered::default();
        let tmp = root.join("tmp");
        for e in fs::read_dir(&tmp).map_err(io_err("listing", &tmp))? {
            let p = e.map_err(io_err("listing", &tmp))?.path();
            fs::remove_file(&p).map_err(io_err("deleting", &p))?;
            rec.dropped += 1;
        }
        let id = disk_id(root)?;
        let mut index = Index::default();
        scan(&root.join("objects"), 0, &mut index, &mut rec)?;
        rec.objects.sort();
        Ok((
            DiskTier {
                root: root.to_path_buf(),
                id,
                capacity,
                index: Mutex::new(index),
                tmp_seq: AtomicU64::new(0),
                _lock: lock,
            },
            rec,
        ))
    }

    /// The directory's id: chosen at its first open, kept in `.id` across restarts (the
    /// master names a disk copy by it, whichever client process holds the directory now).
    pub fn id(&self) -> u64 {
        self.id
    }

    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes of records held, and the capacity.
    pub fn usage(&self) -> (u64, u64) {
        (self.index().used, self.capacity)
    }

    /// Whether `key` has a record here.
    pub fn contains(&self, key: &str) -> bool {
        self.index().objects.contains_key(key)
    }

    /// The value length of `key`'s record, if held.
    pub fn len_of(&self, key: &str) -> Option<u64> {
        self.index().objects.get(key).map(|e| e.len)
    }

    /// Writes `key`'s record durably (see the module's rules); replaces an older one.
    pub fn put(&self, key: &str, value: &[u8]) -> Result<(), DiskError> {
        if key.len() > MAX_KEY {
            return Err(DiskError::KeyTooLong(key.len()));
        }
        let header = Header {
            key_len: key.len() as u32,
            value_len: value.len() as u64,
            checksum: checksum(key.as_bytes(), value),
        };
        let size = header.file_len().unwrap_or(u64::MAX);
        {
            let ix = self.index();
            let freed = ix.objects.get(key).map_or(0, |e| record_len(key, e.len));
            if (ix.used - freed).saturating_add(size) > self.capacity {
                return Err(DiskError::Full {
                    used: ix.used,
                    capacity: self.capacity,
                    need: size,
                });
            }
        }
        let tmp = self.root.join("tmp").join(format!(
            "{}.{}",
            std::process::id(),
            self.tmp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| {
            let mut f = File::create(&tmp).map_err(io_err("creating", &tmp))?;
            f.write_all(&header.encode())
                .and_then(|_| f.write_all(key.as_bytes()))
                .and_then(|_| f.write_all(value))
                .map_err(io_err("writing", &tmp))?;
            f.sync_data().map_err(io_err("flushing", &tmp))
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        let dst = object_path(&self.root, key);
        let dir = dst.parent().expect("an object path has a parent");
        let placed = fs::create_dir_all(dir)
            .map_err(io_err("creating", dir))
            .and_then(|_| {
                // Renamed and indexed under the lock, so an eviction of this key in between
                // cannot delete the new record.
                let mut ix = self.index();
                fs::rename(&tmp, &dst).map_err(io_err("renaming into", &dst))?;
                ix.clock += 1;
                let clock = ix.clock;
                if let Some(old) = ix.objects.insert(
                    key.to_string(),
                    Entry {
                        len: value.len() as u64,
                        last_use: clock,
                    },
                ) {
                    ix.used -= record_len(key, old.len);
                }
                ix.used += size;
                Ok(())
            });
        if let Err(e) = placed {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        // The rename is durable once the directory it entered is.
        match File::open(dir).and_then(|d| d.sync_all()) {
            Ok(()) => Ok(()),
            Err(err) => {
                let mut ix = self.index();
                let _ = fs::remove_file(&dst);
                if let Some(e) = ix.objects.remove(key) {
                    ix.used -= record_len(key, e.len);
                }
                Err(DiskError::Io {
                    op: "flushing",
                    path: dir.to_path_buf(),
                    err,
                })
            }
        }
    }

    /// Drops `key` from the index if its file is gone (checked under the index's lock, so a
    /// put that just placed a new record keeps it).
    fn forget_if_gone(&self, key: &str, path: &Path) {
        let mut ix = self.index();
        if !path.exists() {
            if let Some(e) = ix.objects.remove(key) {
                ix.used -= record_len(key, e.len);
            }
        }
    }

    /// Deletes the record at `path` that failed a check, unless a newer record has replaced it
    /// since it was opened (`seen` is the inode read).
    fn drop_corrupt(&self, key: &str, path: &Path, seen: u64, why: String) -> DiskError {
        use std::os::unix::fs::MetadataExt;
        let mut ix = self.index();
        if fs::metadata(path).map(|m| m.ino()).ok() == Some(seen) {
            let _ = fs::remove_file(path);
            if let Some(e) = ix.objects.remove(key) {
                ix.used -= record_len(key, e.len);
            }
        }
        DiskError::Corrupt {
            key: key.to_string(),
            path: path.to_path_buf(),
            why,
        }
    }

    /// Reads `key`'s value into `dst`, checking its record; `Ok(None)` if not held. Returns
    /// the value's length.
    pub fn get_into(&self, key: &str, dst: &mut [u8]) -> Result<Option<usize>, DiskError> {
        use std::os::unix::fs::MetadataExt;
        {
            let mut ix = self.index();
            ix.clock += 1;
            let clock = ix.clock;
            match ix.objects.get_mut(key) {
                None => return Ok(None),
                Some(e) => e.last_use = clock,
            }
        }
        let path = object_path(&self.root, key);
        let mut f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Removed meanwhile, or deleted behind our back: absent, never wrong.
                self.forget_if_gone(key, &path);
                return Ok(None);
            }
            Err(e) => return Err(io_err("opening", &path)(e)),
        };
        // The file opened is one whole record (renames replace records atomically); it is
        // checked on its own, whatever the index says now. Read with one request for the
        // whole file (header and key aside, the value straight into `dst`), so that the
        // kernel reads it from the device at once instead of ramping its readahead up.
        let meta = f.metadata().map_err(io_err("reading", &path))?;
        let ino = meta.ino();
        let Some(value_len) = meta.len().checked_sub((HEADER_LEN + key.len()) as u64) else {
            return Err(self.drop_corrupt(key, &path, ino, "shorter than its header".into()));
        };
        if (dst.len() as u64) < value_len {
            return Err(DiskError::BufferTooSmall {
                have: dst.len(),
                need: value_len,
            });
        }
        let mut head = vec![0u8; HEADER_LEN + key.len()];
        let out = &mut dst[..value_len as usize];
        if let Err(e) = read_both(&mut f, &mut head, out) {
            return Err(self.drop_corrupt(key, &path, ino, format!("short record: {e}")));
        }
        let h = match Header::decode(&head) {
            Ok(h) => h,
            Err(why) => return Err(self.drop_corrupt(key, &path, ino, format!("{why:?}"))),
        };
        if &head[HEADER_LEN..] != key.as_bytes() || h.file_len() != Some(meta.len()) {
            return Err(self.drop_corrupt(
                key,
                &path,
                ino,
                "its header names another key or length".into(),
            ));
        }
        if checksum(key.as_bytes(), out) != h.checksum {
            return Err(self.drop_corrupt(key, &path, ino, "checksum mismatch".into()));
        }
        Ok(Some(out.len()))
    }

    /// Reads `key`'s value; `Ok(None)` if not held. A put replacing the record with a longer
    /// value between the length read and the file read is met by reading again at the new
    /// length (a few times at most).
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>, DiskError> {
        let Some(mut len) = self.len_of(key) else {
            return Ok(None);
        };
        for _ in 0..8 {
            let mut v = vec![0u8; len as usize];
            match self.get_into(key, &mut v) {
                Ok(got) => {
                    return Ok(got.map(|n| {
                        v.truncate(n);
                        v
                    }))
                }
                Err(DiskError::BufferTooSmall { need, .. }) => len = need,
                Err(e) => return Err(e),
            }
        }
        Err(DiskError::Io {
            op: "reading",
            path: layout::object_path(&self.root, key),
            err: io::Error::other("the record kept growing while it was read"),
        })
    }

    /// Deletes `key`'s record; whether it was held.
    pub fn remove(&self, key: &str) -> Result<bool, DiskError> {
        let mut ix = self.index();
        let Some(e) = ix.objects.remove(key) else {
            return Ok(false);
        };
        ix.used -= record_len(key, e.len);
        let path = object_path(&self.root, key);
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(io_err("deleting", &path)(e)),
        }
    }

    /// Takes the least recently used objects out of the index until `need` more bytes fit
    /// under `target` (at most the capacity). Their files stay until
    /// [`DiskTier::finalize_eviction`].
    pub fn prepare_eviction(&self, need: u64, target: u64) -> PendingEviction {
        let target = target.min(self.capacity);
        let mut ix = self.index();
        let mut by_age: Vec<(u64, String)> = ix
            .objects
            .iter()
            .map(|(k, e)| (e.last_use, k.clone()))
            .collect();
        by_age.sort_unstable();
        let mut entries = Vec::new();
        for (_, key) in by_age {
            if ix.used.saturating_add(need) <= target {
                break;
            }
            if let Some(e) = ix.objects.remove(&key) {
                ix.used -= record_len(&key, e.len);
                entries.push((key, e));
            }
        }
        PendingEviction { entries }
    }

    /// Deletes the files of an eviction the master was told of.
    pub fn finalize_eviction(&self, p: PendingEviction) -> Result<(), DiskError> {
        let mut first = None;
        for (key, _) in p.entries {
            // Under the lock: a put of the same key since then has its own, newer record,
            // which stays.
            let ix = self.index();
            if ix.objects.contains_key(&key) {
                continue;
            }
            let path = object_path(&self.root, &key);
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    first.get_or_insert(io_err("deleting", &path)(e));
                }
            }
            drop(ix);
        }
        first.map_or(Ok(()), Err)
    }

    /// Puts back the objects of an eviction the master could not be told of.
    pub fn cancel_eviction(&self, p: PendingEviction) {
        let mut ix = self.index();
        for (key, e) in p.entries {
            if !ix.objects.contains_key(&key) {
                ix.used += record_len(&key, e.len);
                ix.objects.insert(key, e);
            }
        }
    }
}

/// Fills `a` then `b` from `f`, with one `readv` when the kernel returns it all (a regular
/// file does, unless it is shorter).
fn read_both(f: &mut File, a: &mut [u8], b: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < a.len() + b.len() {
        let n = if done < a.len() {
            f.read_vectored(&mut [io::IoSliceMut::new(&mut a[done..]), io::IoSliceMut::new(b)])?
        } else {
            f.read(&mut b[done - a.len()..])?
        };
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        done += n;
    }
    Ok(())
}

/// The id in `root/.id` (16 hex digits), or a new one written there durably (through `tmp/`,
/// as a record is) when it is missing or unreadable.
fn disk_id(root: &Path) -> Result<u64, DiskError> {
    let path = root.join(".id");
    if let Ok(s) = fs::read_to_string(&path) {
        if let Ok(id) = u64::from_str_radix(s.trim(), 16) {
            if id != 0 {
                return Ok(id);
            }
        }
    }
    let id = rand::random::<u64>() | 1;
    let tmp = root.join("tmp").join("id");
    let mut f = File::create(&tmp).map_err(io_err("creating", &tmp))?;
    f.write_all(format!("{id:016x}\n").as_bytes())
        .and_then(|_| f.sync_data())
        .map_err(io_err("writing", &tmp))?;
    fs::rename(&tmp, &path).map_err(io_err("renaming into", &path))?;
    File::open(root)
        .and_then(|d| d.sync_all())
        .map_err(io_err("flushing", root))?;
    Ok(id)
}

fn record_len(key: &str, len: u64) -> u64 {
    (HEADER_LEN + key.len()) as u64 + len
}

/// Indexes the whole records under `objects/` (two directory levels), deleting the others.
fn scan(dir: &Path, depth: u32, ix: &mut Index, rec: &mut Recovered) -> Result<(), DiskError> {
    for e in fs::read_dir(dir).map_err(io_err("listing", dir))? {
        let e = e.map_err(io_err("listing", dir))?;
        let p = e.path();
        let ft = e.file_type().map_err(io_err("reading", &p))?;
        if depth < 2 {
            if ft.is_dir() {
                scan(&p, depth + 1, ix, rec)?;
            }
            continue;
        }
        if !ft.is_file() {
            continue;
        }
        match whole_record(&p)? {
            Some((key, len)) if object_path(Path::new(""), &key).file_name() == p.file_name() => {
                ix.used += record_len(&key, len);
                ix.clock += 1;
                let clock = ix.clock;
                ix.objects.insert(
                    key.clone(),
                    Entry {
                        len,
                        last_use: clock,
                    },
                );
                rec.objects.push((key, len));
            }
            _ => {
                fs::remove_file(&p).map_err(io_err("deleting", &p))?;
                rec.dropped += 1;
            }
        }
    }
    Ok(())
}

/// The key and value length of the record at `p` if its header is valid and its length is
/// exactly what the header says (the checksum is checked when it is read).
fn whole_record(p: &Path) -> Result<Option<(String, u64)>, DiskError> {
    let mut f = File::open(p).map_err(io_err("opening", p))?;
    let size = f.metadata().map_err(io_err("reading", p))?.len();
    let mut head = [0u8; HEADER_LEN];
    if f.read_exact(&mut head).is_err() {
        return Ok(None);
    }
    let Ok(h) = Header::decode(&head) else {
        return Ok(None);
    };
    if h.file_len() != Some(size) {
        return Ok(None);
    }
    let mut key = vec![0u8; h.key_len as usize];
    if f.read_exact(&mut key).is_err() {
        return Ok(None);
    }
    Ok(String::from_utf8(key).ok().map(|k| (k, h.value_len)))
}
