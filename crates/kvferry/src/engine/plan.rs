//! Request plans built inside the engine: Mooncake 0.3.14's compact page tables expanded into
//! requests ([`PageTable`]), and runs of adjacent requests merged into one ([`coalesce`]).

use super::{Batch, Inner, SegmentId, TransferEngine, TransferRequest, LOCAL_SEGMENT_ID};
use crate::batch::TransferStatus;
use crate::error::{Error, Result};
use crate::transport::Peer;
use crate::Opcode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A page table in the compact form of Mooncake 0.3.14's `batch_transfer_sync_*_pages`:
/// for every row `(src_base, src_stride, dst_base, dst_stride, length)` of `fields` and every
/// page `i`, one copy of `length` bytes between local `src_base + src_pages[i] * src_stride`
/// and remote `dst_base + dst_pages[i] * dst_stride` (local = source of a WRITE, destination
/// of a READ). `F` rows and `P` pages make `F * P` requests, row by row.
#[derive(Debug, Clone, Copy)]
pub struct PageTable<'a> {
    /// Local page indices (`P` of them).
    pub src_pages: &'a [u64],
    /// Remote page indices (`P` of them, paired with `src_pages`).
    pub dst_pages: &'a [u64],
    /// `F` rows `(src_base, src_stride, dst_base, dst_stride, length)`.
    pub fields: &'a [[u64; 5]],
}

impl PageTable<'_> {
    /// How many requests the table expands to (`F * P`), or an error when the page lists
    /// differ in length, a row has a zero length, or the count overflows.
    pub fn len(&self) -> Result<usize> {
        if self.src_pages.len() != self.dst_pages.len() {
            return Err(Error::InvalidArgument(format!(
                "src_pages and dst_pages must have the same length (got {} and {})",
                self.src_pages.len(),
                self.dst_pages.len()
            )));
        }
        if let Some(i) = self.fields.iter().position(|r| r[4] == 0) {
            return Err(Error::InvalidArgument(format!(
                "fields rows need a positive length and non-negative strides (row {i} has length 0)"
            )));
        }
        self.fields
            .len()
            .checked_mul(self.src_pages.len())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{} fields x {} pages overflows the request count",
                    self.fields.len(),
                    self.src_pages.len()
                ))
            })
    }

    /// Whether the table expands to no request.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty() || self.src_pages.is_empty()
    }

    /// The requests, row by row, with checked arithmetic: an address or range end past
    /// 2^64 - 1 is an error naming the row and page, and then no request is returned.
    pub(crate) fn expand(&self, opcode: Opcode, target: SegmentId) -> Result<Vec<TransferRequest>> {
        let n = self.len()?;
        let mut out = Vec::with_capacity(n);
        for (f, &[src_base, src_stride, dst_base, dst_stride, length]) in
            self.fields.iter().enumerate()
        {
            let at = |base: u64, stride: u64, page: u64, side: &str, i: usize| {
                page.checked_mul(stride)
                    .and_then(|o| base.checked_add(o))
                    .filter(|a| a.checked_add(length).is_some())
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "fields row {f}, page {i}: {side} address {base} + {page} * {stride} (+ length {length}) overflows 64 bits"
                        ))
                    })
            };
            for (i, (&sp, &dp)) in self.src_pages.iter().zip(self.dst_pages).enumerate() {
                out.push(TransferRequest {
                    opcode,
                    source: at(src_base, src_stride, sp, "source", i)?,
                    target_id: target,
                    target_offset: at(dst_base, dst_stride, dp, "destination", i)?,
                    length,
                });
            }
        }
        Ok(out)
    }
}

impl TransferEngine {
    /// [`TransferEngine::transfer_sync`] with runs of adjacent requests merged first (see
    /// [`Batch::submit_coalesced`]): fewer, larger pieces for the transports, the same bytes.
    pub fn transfer_sync_coalesced(
        &self,
        requests: &[TransferRequest],
        timeout: Duration,
    ) -> Result<TransferStatus> {
        self.inner.check_home()?;
        let merged = self.inner.coalesce(requests);
        let batch = self.allocate_batch(merged.len().max(1))?;
        // A lone request may run in this thread; several go to the transports' threads and
        // move in parallel.
        let inline = merged.len() == 1;
        batch.submit_with(
            &self.inner,
            &merged,
            inline,
            Instant::now().checked_add(timeout),
        )?;
        Ok(batch.wait_done())
    }

    /// Moves a page table (Mooncake 0.3.14's `batch_transfer_sync_*_pages`), expanded here
    /// into `F * P` requests with checked arithmetic and adjacent ones merged, as one batch;
    /// waits as [`TransferEngine::transfer_sync`]. A table that does not expand (page lists of
    /// different lengths, a zero-length row, an address past 2^64 - 1) is refused before
    /// anything moves. An empty table completes at once.
    pub fn transfer_pages_sync(
        &self,
        opcode: Opcode,
        target: SegmentId,
        pages: &PageTable<'_>,
        timeout: Duration,
    ) -> Result<TransferStatus> {
        let requests = pages.expand(opcode, target)?;
        self.transfer_sync_coalesced(&requests, timeout)
    }
}

impl Batch {
    /// [`Batch::submit`] with runs of adjacent requests merged first: a request joins the
    /// previous one when both go the same way to the same segment and it starts, locally
    /// and remotely, where the previous one ends, and the merged range lies in one
    /// registered local region and one buffer of the peer. The batch then holds one task
    /// per merged run (returned: how many), so use it where only the batch's status is read.
    pub fn submit_coalesced(&self, requests: &[TransferRequest]) -> Result<usize> {
        let engine = self.engine()?;
        let merged = engine.coalesce(requests);
        self.submit_with(&engine, &merged, false, None)?;
        Ok(merged.len())
    }
}

impl Inner {
    /// [`coalesce`] against this engine's registrations and the peers' cached descriptors.
    pub(super) fn coalesce(&self, requests: &[TransferRequest]) -> Vec<TransferRequest> {
        if requests.len() < 2 {
            return requests.to_vec();
        }
        let mut peer: Option<Arc<Peer>> = None;
        coalesce(requests, |r| {
            if self.memory.check(r.source, r.length).is_none() {
                return false;
            }
            if r.target_id == LOCAL_SEGMENT_ID {
                return self.memory.check(r.target_offset, r.length).is_some();
            }
            let p = match &peer {
                Some(p) if p.id == r.target_id => p,
                _ => match self.peer(r.target_id) {
                    Ok(p) => peer.insert(p),
                    Err(_) => return false,
                },
            };
            p.desc().find_buffer(r.target_offset, r.length).is_some()
        })
    }
}

/// Merges runs of adjacent requests: request `b` joins the run ending with `a` when both
/// have the same opcode and segment, `b` starts locally where `a` ends and remotely where `a`
/// ends. A run of two or more is kept merged only if `fits(&merged)` (its local range lies in
/// one registered region and its remote range in one buffer of the peer): otherwise its
/// requests go as they came, so merging never turns a request that would succeed into one that
/// fails. (A zero-length request where a run ends joins it, moving nothing.)
pub(crate) fn coalesce(
    requests: &[TransferRequest],
    mut fits: impl FnMut(&TransferRequest) -> bool,
) -> Vec<TransferRequest> {
    let mut out = Vec::with_capacity(requests.len());
    let mut i = 0;
    while i < requests.len() {
        let first = requests[i];
        let mut run = first;
        let mut j = i + 1;
        while let Some(next) = requests.get(j) {
            let adjacent = next.opcode == run.opcode
                && next.target_id == run.target_id
                && run.source.checked_add(run.length) == Some(next.source)
                && run.target_offset.checked_add(run.length) == Some(next.target_offset);
            // (The merged range must end inside the address space on both sides.)
            let len = run.length.checked_add(next.length).filter(|&len| {
                run.source.checked_add(len).is_some()
                    && run.target_offset.checked_add(len).is_some()
            });
            match len {
                Some(len) if adjacent => run.length = len,
                _ => break,
            }
            j += 1;
        }
        if j - i == 1 || fits(&run) {
            out.push(run);
        } else {
            out.extend_from_slice(&requests[i..j]);
        }
        i = j;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(source: u64, remote: u64, length: u64) -> TransferRequest {
        TransferRequest {
            opcode: Opcode::Write,
            source,
            target_id: 1,
            target_offset: remote,
            length,
        }
    }

    #[test]
    fn adjacent_runs_merge_and_others_stay() {
        let reqs = [
            req(0, 1000, 10),
            req(10, 1010, 10),
            req(20, 1020, 5),
            // local adjacent, remote not
            req(25, 2000, 5),
            // a READ after a WRITE never merges
            TransferRequest {
                opcode: Opcode::Read,
                ..req(30, 2005, 5)
            },
        ];
        let out = coalesce(&reqs, |_| true);
        assert_eq!(
            out,
            vec![
                req(0, 1000, 25),
                req(25, 2000, 5),
                TransferRequest {
                    opcode: Opcode::Read,
                    ..req(30, 2005, 5)
                }
            ]
        );
    }

    #[test]
    fn a_run_that_does_not_fit_goes_unmerged() {
        let reqs = [
            req(0, 0, 8),
            req(8, 8, 8),
            req(100, 100, 8),
            req(108, 108, 8),
        ];
        // The merged range starting at 0 crosses a registration boundary: kept apart.
        let out = coalesce(&reqs, |r| r.source != 0);
        assert_eq!(out, vec![req(0, 0, 8), req(8, 8, 8), req(100, 100, 16)]);
    }

    #[test]
    fn runs_stop_at_address_overflow() {
        let reqs = [req(u64::MAX - 8, 0, 8), req(u64::MAX, 8, 8)];
        assert_eq!(coalesce(&reqs, |_| true), reqs.to_vec());
    }

    #[test]
    fn pages_expand_row_by_row() {
        let t = PageTable {
            src_pages: &[2, 0],
            dst_pages: &[5, 1],
            fields: &[[1000, 64, 9000, 128, 16], [5000, 32, 7000, 32, 8]],
        };
        assert_eq!(t.len().unwrap(), 4);
        let got = t.expand(Opcode::Write, 1).unwrap();
        assert_eq!(
            got,
            vec![
                req(1128, 9640, 16),
                req(1000, 9128, 16),
                req(5064, 7160, 8),
                req(5000, 7032, 8),
            ]
        );
    }

    #[test]
    fn contiguous_pages_coalesce_into_one_request() {
        let pages: Vec<u64> = (0..1000).collect();
        let t = PageTable {
            src_pages: &pages,
            dst_pages: &pages,
            fields: &[[4096, 4096, 1 << 20, 4096, 4096]],
        };
        let reqs = t.expand(Opcode::Write, 1).unwrap();
        assert_eq!(reqs.len(), 1000);
        assert_eq!(
            coalesce(&reqs, |_| true),
            vec![req(4096, 1 << 20, 4096 * 1000)]
        );
    }

    #[test]
    fn bad_page_tables_are_refused_whole() {
        let over = PageTable {
            src_pages: &[0, u64::MAX],
            dst_pages: &[0, 1],
            fields: &[[0, 2, 0, 2, 1]],
        };
        let e = over.expand(Opcode::Read, 1).unwrap_err().to_string();
        assert!(
            e.contains("row 0, page 1") && e.contains("overflows"),
            "{e}"
        );
        // The end of the range overflows even though the start does not.
        let end = PageTable {
            src_pages: &[0],
            dst_pages: &[1],
            fields: &[[0, 0, u64::MAX - 3, 1, 4]],
        };
        assert!(end.expand(Opcode::Read, 1).is_err());
        let mismatch = PageTable {
            src_pages: &[0, 1],
            dst_pages: &[0],
            fields: &[[0, 1, 0, 1, 1]],
        };
        assert!(mismatch
            .len()
            .unwrap_err()
            .to_string()
            .contains("same length"));
        let zero = PageTable {
            src_pages: &[0],
            dst_pages: &[0],
            fields: &[[0, 1, 0, 1, 0]],
        };
        assert!(zero.expand(Opcode::Write, 1).is_err());
        let empty = PageTable {
            src_pages: &[],
            dst_pages: &[],
            fields: &[[0, 1, 0, 1, 1]],
        };
        assert!(empty.is_empty());
        assert_eq!(empty.expand(Opcode::Write, 1).unwrap(), vec![]);
    }
}
