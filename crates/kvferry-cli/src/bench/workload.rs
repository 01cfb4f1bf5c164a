//! `kvferry bench --workload`: KV-cache requests shaped as serving engines issue them.
//!
//! A **preset** is a model's KV cache as one rank holds it: vLLM's per-layer layout (one
//! region per layer and K/V, blocks of 16 tokens, one descriptor per layer, K/V and block, as
//! its MooncakeConnector posts them) or a block-packed one (one region per cache group, one
//! descriptor per block spanning the group's layers). Both sides hold a **pool** of blocks per
//! region; a request of T tokens takes ceil(T / block) blocks from each side's pool, picked by
//! a seeded permutation (as a fragmented allocator hands them out), so its descriptors are
//! scattered on both sides. Both processes derive the same descriptors from (preset, tokens,
//! pool, seed, slot): the target hashes its side of a request for verification
//! ([`target_checksum`]) without a list crossing the wire.

use crate::sys::Buffer;

mod mooncake;
mod run;

pub(super) use run::run;

/// How a preset's KV cache is laid out in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// vLLM's `[layer][K|V][block]`: a region per layer and K/V.
    PerLayerKv,
    /// A region per cache group; a block holds every layer of its group, each layer's page
    /// padded to `align` bytes (vLLM's packed DeepSeek-V4 layout, as CollectiveX models it).
    Packed {
        groups: &'static [Group],
        align: u64,
    },
}

/// One cache group of a packed layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Group {
    layers: u64,
    /// Tokens one cached state stands for (compressed attention keeps one state per 4 or 128).
    tokens_per_state: u64,
    state_bytes: u64,
    /// The group's own block size in tokens, where it is not the model's.
    block_tokens: Option<u64>,
    /// Only the last this many tokens are cached (a sliding window).
    window_tokens: Option<u64>,
}

/// A model's KV cache on one rank.
#[derive(Debug)]
pub(super) struct Preset {
    pub(super) name: &'static str,
    pub(super) about: &'static str,
    layers: u32,
    /// Bytes one token takes in one layer (K or V alone for [`Layout::PerLayerKv`]).
    token_bytes: u64,
    block_tokens: u64,
    layout: Layout,
}

/// DeepSeek-V4's cache groups in vLLM's packed layout, as CollectiveX's `dsv4` preset
/// transcribes them: 584-byte fp8 states; 30 compressed-sparse layers (a state per 4 tokens)
/// with their 132-byte indexer states, 31 heavily compressed layers (a state per 128 tokens),
/// and a 128-token sliding window over all 61 layers in 64-token blocks.
const DEEPSEEK_V4: &[Group] = &[
    Group {
        layers: 30,
        tokens_per_state: 4,
        state_bytes: 584,
        block_tokens: None,
        window_tokens: None,
    },
    Group {
        layers: 30,
        tokens_per_state: 4,
        state_bytes: 132,
        block_tokens: None,
        window_tokens: None,
    },
    Group {
        layers: 31,
        tokens_per_state: 128,
        state_bytes: 584,
        block_tokens: None,
        window_tokens: None,
    },
    Group {
        layers: 61,
        tokens_per_state: 1,
        state_bytes: 584,
        block_tokens: Some(64),
        window_tokens: Some(128),
    },
];

/// The presets (`--workload NAME`); KV bytes per token from the models' configs
/// (docs/BENCHMARKS.md, "Model-shaped requests").
pub(super) const PRESETS: &[Preset] = &[
    Preset {
        name: "llama3-70b-tp8",
        about: "Llama-3-70B at TP 8: 80 layers, one KV head of 128 (BF16) per rank, vLLM's \
                per-layer K/V layout, 16-token blocks (4 KiB descriptors)",
        layers: 80,
        token_bytes: 128 * 2,
        block_tokens: 16,
        layout: Layout::PerLayerKv,
    },
    Preset {
        name: "qwen3-8b",
        about: "Qwen3-8B at TP 1: 36 layers, 8 KV heads of 128 (BF16), vLLM's per-layer K/V \
                layout, 16-token blocks (32 KiB descriptors)",
        layers: 36,
        token_bytes: 8 * 128 * 2,
        block_tokens: 16,
        layout: Layout::PerLayerKv,
    },
    Preset {
        name: "deepseek-v4",
        about: "DeepSeek-V4 block-packed as vLLM lays it out (CollectiveX's dsv4): four cache \
                groups of fp8 states, 256-token blocks, one descriptor per block and group \
                (52 KiB to 2.2 MiB)",
        layers: 61,
        token_bytes: 0,
        block_tokens: 256,
        layout: Layout::Packed {
            groups: DEEPSEEK_V4,
            align: 576,
        },
    },
];

pub(super) fn preset(name: &str) -> Result<&'static Preset, String> {
    PRESETS.iter().find(|p| p.name == name).ok_or_else(|| {
        let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        format!(
            "--workload {name:?}: no such preset (presets: {})",
            names.join(", ")
        )
    })
}

impl Preset {
    /// Bytes of one block in each region.
    fn block_bytes(&self) -> Vec<u64> {
        match self.layout {
            Layout::PerLayerKv => {
                vec![self.block_tokens * self.token_bytes; 2 * self.layers as usize]
            }
            Layout::Packed { groups, align } => groups
                .iter()
                .map(|g| {
                    let states = g.block_tokens.unwrap_or(self.block_tokens) / g.tokens_per_state;
                    g.layers * (states * g.state_bytes).div_ceil(align) * align
                })
                .collect(),
        }
    }

    /// Blocks a request of `tokens` tokens takes in each region.
    fn region_blocks(&self, tokens: u64) -> Vec<u64> {
        match self.layout {
            Layout::PerLayerKv => {
                vec![tokens.div_ceil(self.block_tokens); 2 * self.layers as usize]
            }
            Layout::Packed { groups, .. } => groups
                .iter()
                .map(|g| {
                    let cached = g.window_tokens.map_or(tokens, |w| tokens.min(w));
                    cached.div_ceil(g.block_tokens.unwrap_or(self.block_tokens))
                })
                .collect(),
        }
    }

    /// Bytes of one block across every region: what a block of the pool costs.
    pub(super) fn row_bytes(&self) -> u64 {
        self.block_bytes().iter().sum()
    }

    /// Blocks a request of `tokens` tokens takes on each side, in its most used region.
    pub(super) fn blocks_for(&self, tokens: u64) -> u64 {
        self.region_blocks(tokens).into_iter().max().unwrap_or(0)
    }
}

/// A pool of `blocks` blocks per region over a buffer: region `r` starts at `base[r]`.
pub(super) struct Pool {
    block_bytes: Vec<u64>,
    base: Vec<u64>,
    pub(super) blocks: u64,
}

impl Pool {
    /// The largest pool of `p`'s blocks that fits in `bytes`.
    pub(super) fn fitting(p: &Preset, bytes: u64) -> Pool {
        Pool::new(p, bytes / p.row_bytes().max(1))
    }

    pub(super) fn new(p: &Preset, blocks: u64) -> Pool {
        let block_bytes = p.block_bytes();
        let mut base = Vec::with_capacity(block_bytes.len());
        let mut at = 0u64;
        for bb in &block_bytes {
            base.push(at);
            at += bb * blocks;
        }
        Pool {
            block_bytes,
            base,
            blocks,
        }
    }
}

/// Which side of a request: its initiator's pool or its target's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    Initiator,
    Target,
}

/// The block ids that request slot `slot` (of `n` blocks) holds on `side`: a slice of a
/// seeded permutation of the pool's blocks, so slots never share a block.
fn slot_blocks(pool: &Pool, n: u64, slot: u64, seed: u64, side: Side) -> Vec<u64> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let mut ids: Vec<u64> = (0..pool.blocks).collect();
    let side_seed = match side {
        Side::Initiator => 0x1417_1a70,
        Side::Target => 0x7a26_e700,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ side_seed);
    ids.shuffle(&mut rng);
    let from = (slot * n) as usize;
    ids[from..from + n as usize].to_vec()
}

/// One descriptor: offsets into the initiator's and the target's pool, and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Desc {
    pub(super) local: u64,
    pub(super) remote: u64,
    pub(super) len: u64,
}

/// The descriptors of request slot `slot` (region by region, block by block, as a
/// connector walks layers), `None` if `slot + 1` requests of `tokens` do not fit the pool.
pub(super) fn request(
    p: &Preset,
    pool: &Pool,
    tokens: u64,
    slot: u64,
    seed: u64,
) -> Option<Vec<Desc>> {
    let counts = p.region_blocks(tokens);
    let mut out = Vec::with_capacity(counts.iter().sum::<u64>() as usize);
    for ((base, bb), &n) in pool.base.iter().zip(&pool.block_bytes).zip(&counts) {
        if (slot + 1).checked_mul(n)? > pool.blocks {
            return None;
        }
        let mine = slot_blocks(pool, n, slot, seed, Side::Initiator);
        let theirs = slot_blocks(pool, n, slot, seed, Side::Target);
        out.extend(mine.iter().zip(&theirs).map(|(m, t)| Desc {
            local: base + m * bb,
            remote: base + t * bb,
            len: *bb,
        }));
    }
    Some(out)
}

/// The same bytes as [`request`] in one descriptor per region (slot `slot`'s blocks taken
/// contiguously on both sides): the reference the descriptor-bound shape is held to.
pub(super) fn packed_request(p: &Preset, pool: &Pool, tokens: u64, slot: u64) -> Option<Vec<Desc>> {
    let counts = p.region_blocks(tokens);
    pool.base
        .iter()
        .zip(&pool.block_bytes)
        .zip(&counts)
        .map(|((base, bb), &n)| {
            if (slot + 1).checked_mul(n)? > pool.blocks {
                return None;
            }
            let at = base + slot * n * bb;
            Some(Desc {
                local: at,
                remote: at,
                len: n * bb,
            })
        })
        .collect()
}

/// xxh3 of `buf`'s bytes at `side`'s offsets of `descs`, in order.
pub(super) fn hash(buf: &Buffer, descs: &[Desc], side: Side) -> Option<u64> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for d in descs {
        let off = match side {
            Side::Initiator => d.local,
            Side::Target => d.remote,
        };
        let end = off.checked_add(d.len)?;
        if end > buf.len() as u64 {
            return None;
        }
        h.update(buf.slice(off as usize, d.len as usize));
    }
    Some(h.digest())
}

/// The target's answer to `wl-checksum`: `args` = preset, tokens, pool blocks, seed, slot;
/// the hash of its side of that request, or why not.
pub(super) fn target_checksum(buf: &Buffer, args: &[&str]) -> String {
    let [name, tokens, blocks, seed, slot] = args else {
        return "bad-request".into();
    };
    let Ok(p) = preset(name) else {
        return "no-such-preset".into();
    };
    let num = |s: &str| s.parse::<u64>().ok();
    let (Some(tokens), Some(blocks), Some(seed), Some(slot)) =
        (num(tokens), num(blocks), num(seed), num(slot))
    else {
        return "bad-number".into();
    };
    let pool = Pool::new(p, blocks);
    match request(p, &pool, tokens, slot, seed).and_then(|d| hash(buf, &d, Side::Target)) {
        Some(h) => format!("{h:016x}"),
        None => "out-of-range".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's shape for Llama-3-70B at TP 8 and 8K tokens: 81,920 descriptors of 4 KiB.
    #[test]
    fn a_llama_70b_tp8_request_of_8k_tokens_is_81920_descriptors_of_4_kib() {
        let p = preset("llama3-70b-tp8").unwrap();
        let pool = Pool::new(p, 600);
        let d = request(p, &pool, 8192, 0, 7).unwrap();
        assert_eq!(d.len(), 81_920);
        assert!(d.iter().all(|d| d.len == 4096));
        assert_eq!(d.iter().map(|d| d.len).sum::<u64>(), 8192 * 327_680 / 8);
    }

    /// CollectiveX's dsv4 at 8K tokens: 98 descriptors (32 blocks in each of three groups,
    /// the window's 2), 50 518 656 bytes; pages padded to 576 bytes.
    #[test]
    fn a_deepseek_v4_request_of_8k_tokens_is_collectivex_dsv4() {
        let p = preset("deepseek-v4").unwrap();
        assert_eq!(p.block_bytes(), vec![1_123_200, 259_200, 53_568, 2_283_840]);
        assert_eq!(p.region_blocks(8192), vec![32, 32, 32, 2]);
        assert_eq!(p.region_blocks(100), vec![1, 1, 1, 2]);
        let pool = Pool::new(p, 40);
        let d = request(p, &pool, 8192, 0, 7).unwrap();
        assert_eq!(d.len(), 98);
        assert_eq!(d.iter().map(|d| d.len).sum::<u64>(), 50_518_656);
    }

    /// Slots never share a block on either side, descriptors stay inside the pool, and
    /// the blocks are scattered (not in order) on both sides.
    #[test]
    fn slots_are_disjoint_scattered_and_inside_the_pool() {
        for p in PRESETS {
            let pool = Pool::new(p, 64);
            let n = p.blocks_for(1000);
            let slots = pool.blocks / n;
            let mut seen_l = std::collections::HashSet::new();
            let mut seen_r = std::collections::HashSet::new();
            for s in 0..slots {
                let d = request(p, &pool, 1000, s, 3).unwrap();
                for x in &d {
                    assert!(
                        seen_l.insert(x.local),
                        "{}: local {} twice",
                        p.name,
                        x.local
                    );
                    assert!(
                        seen_r.insert(x.remote),
                        "{}: remote {} twice",
                        p.name,
                        x.remote
                    );
                    assert!(x.local + x.len <= p.row_bytes() * pool.blocks);
                    assert!(x.remote + x.len <= p.row_bytes() * pool.blocks);
                }
            }
            assert!(request(p, &pool, 1000, slots, 3).is_none());
            let d = request(p, &pool, 1000, 0, 3).unwrap();
            if n > 2 {
                assert!(d.windows(2).any(|w| w[1].local != w[0].local + w[0].len));
                assert!(d.iter().zip(&d).any(|(a, b)| a.local != b.remote));
            }
        }
    }

    /// The packed reference moves the same bytes in one descriptor per region.
    #[test]
    fn the_packed_reference_moves_the_same_bytes() {
        for p in PRESETS {
            let pool = Pool::new(p, 40);
            let a: u64 = request(p, &pool, 300, 1, 9)
                .unwrap()
                .iter()
                .map(|d| d.len)
                .sum();
            let b = packed_request(p, &pool, 300, 1).unwrap();
            assert_eq!(b.iter().map(|d| d.len).sum::<u64>(), a, "{}", p.name);
            assert_eq!(b.len(), p.block_bytes().len());
        }
    }

    /// The target's hash of a request is the initiator's once the bytes match, and differs
    /// when one byte of one descriptor differs.
    #[test]
    fn the_targets_checksum_matches_the_initiators_only_when_the_bytes_do() {
        let p = preset("qwen3-8b").unwrap();
        let blocks = 8;
        let pool = Pool::new(p, blocks);
        let bytes = (p.row_bytes() * blocks) as usize;
        let (mine, theirs) = (
            Buffer::alloc(bytes, false, false).unwrap(),
            Buffer::alloc(bytes, false, false).unwrap(),
        );
        mine.fill(0, bytes, 5);
        let d = request(p, &pool, 40, 1, 11).unwrap();
        for x in &d {
            let src = mine.slice(x.local as usize, x.len as usize);
            theirs
                .slice_mut(x.remote as usize, x.len as usize)
                .copy_from_slice(src);
        }
        let args = ["qwen3-8b", "40", "8", "11", "1"];
        let want = format!("{:016x}", hash(&mine, &d, Side::Initiator).unwrap());
        assert_eq!(target_checksum(&theirs, &args), want);
        theirs.slice_mut(d[3].remote as usize, 1)[0] ^= 1;
        assert_ne!(target_checksum(&theirs, &args), want);
        assert_eq!(target_checksum(&theirs, &["qwen3-8b", "40"]), "bad-request");
        assert_eq!(
            target_checksum(&theirs, &["qwen3-8b", "40", "8", "11", "9"]),
            "out-of-range"
        );
    }
}
