"""Triton kernels for the target's batch-1 short-query passes: decode steps, chain and tree verification.

At batch 1 SmolLM2-135M's compiled decode step is ~560 kernels of ~2 us each on an H200
(h200-decode.json): launches, not bytes, bound it. Here a decoder layer is five kernels:

  1. rmsnorm -> qkv matmul -> rotary on q and k -> k and v written into their cache slots
  2. attention of every query row over the cache slots up to the last one written, under the mask
     (or, with Tuning.split, two: chunks of the cache in parallel, then their partial softmaxes merged;
     with Tuning.merge_last the last chunk program of a token merges them, one kernel again)
  3. o_proj + residual
  4. rmsnorm -> gate/up matmul -> silu(gate) * up
  5. down_proj + residual
(1, 3 and 5 optionally split over K, Tuning.ksplit: the last part of a tile to finish adds the parts up.
A program knows it is the last by an atomic counter, _arrive_last, so neither needs another launch.
With Tuning.pdl each kernel is launched while the one before it runs and waits for it on the device.)

A token gets the same arithmetic in a one-token step as in a 48-node tree verify: the decoder layers
give it the same bits, in bf16 as in fp32 (so in fp32 speculative output equals plain output, as
with the torch path, and bf16 near-ties break the same way in both). Matmul rows go in tiles of ROWS
whatever their number, which needs tl.dot to give a row the same bits wherever it sits in its tile:
true on CUDA (tested in fp32 and bf16), not under the interpreter where numpy's BLAS is not.
Attention takes one token a program (its query heads, as a one-token step has them), and a tree
token's ancestors become its keys right after the prefix, in order, which is where plain decoding
puts them: a reduction's bits depend on where its terms sit. Intermediate results are rounded to
the model's dtype where the torch layer rounds them (matmul outputs, silu, the residual adds).
Attention reads the slots up to the largest one being written: every mask the engine builds
(causal, chain, tree) hides later ones. Tree verification's KV commit is one kernel for all layers
(SlotMover). The model's final norm and lm_head run here too (Head), rows in tiles, so a token's
logits, and with them its greedy choice, do not depend on the pass either.

`Transformer.optimize(kernels="triton")` routes batch-1 short queries of supported layers here
(`supports`); everything else keeps the torch path. Tests run these kernels on the CPU through
Triton's interpreter (TRITON_INTERPRET=1 before this module is imported).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ROWS = 16  # query rows a tile: tl.dot's smallest M
MAX_T = 64  # query tokens a call (target.COMPILED_MAX_TOKENS)


@dataclass(frozen=True)
class Tuning:
    """Tile sizes, warps and the commit kernel. One model uses one Tuning for every call, so a token's arithmetic does
    not depend on how many tokens share the pass. At batch 1 the kernels are latency-bound: more programs and
    bytes in flight, and shorter dependent chains a program, make a step faster.
    The default is the fastest measured at both shapes on the H200 at 50882f9 (logs/bench-full-h200-50882f9.json,
    logs/bench-k4-h200-50882f9.json): K split in 4 parts, 32 rotary pairs a qkv program, attention split in
    64-slot chunks, PDL. SmolLM2's shape (random weights): one-token step 0.694 ms against 0.786 with PDL alone
    and 0.915 with the earlier default (split 128, pairs 16, no K split, no PDL; logs/bench-full-1011bf3.json);
    the real SmolLM2 1381.7 tok/s against 1217.0 with PDL alone. The Llama-3.1-8B shape: 4.42 ms against 5.26
    inductor-compiled and 5.04 with the earlier default (1011bf3); on an H100 5.80 against 6.19, where PDL
    without the K split was slower (6.66 against 5.94 ms; logs/engine-8b-sweep-h100-3ff982a.json).
    256-wide reduction tiles made SmolLM2's step 0.96 ms against 1.14 with 64 (logs/engine-triton-sweep-8114dc5.json);
    256 slots a step do not fit the 8B shape's shared memory, so 128. Sizes count 2-byte elements; fp32 models get
    half as many. Measured and dropped: matmul programs computing up to four row tiles from one weight read (a
    49-row pass 2.19 ms against 1.32, logs/tree-cycle-8c7a00e.json), RMSNorm folded into the matmul's pass over x
    (8B step 7.75 against 5.07 ms), the split's merge done by o_proj (SmolLM2 step 1.31 against 0.90 ms), the merge
    by the last chunk program (merge_last: 0.831 against 0.786 ms with PDL on the H200, 0.916 against 0.898 without
    on an H100), and weight tiles prefetched into L2 before the PDL wait (0.827 against 0.786 ms; 8B 5.83
    against 4.42: logs/tree-cycle-h200-50882f9.json, reverted in a99c11c), gate_up split over K like the others
    (SmolLM2 step 0.785 against 0.686 ms, 8B 5.73 against 5.64 on an H100: logs/bench-h100-6bd8ada.json), 2 warps
    (8B 5.80 against 5.64, logs/engine8b-h100-6bd8ada.json) and o_proj merging the split's chunks itself, each
    program its K range's heads (0.945 against 0.686 ms; 8B 7.62 against 5.78: every program redoes the merge;
    logs/engine-fuse-merge-h100-ca6e436.json). On SmolLM2's own weights split 32 was 1% faster than 64 (0.687 against
    0.695 ms, the sweep in logs/bench-h100-6bd8ada.json), level on random weights. head (on, so that a token's
    logits do not depend on its pass): its speed against cuBLAS is unmeasured; its argmax (head_argmax) saves the
    torch argmax and copy. early_weights (since 3dbfcea) reads each matmul program's first weight tiles before the
    PDL wait, into registers, where the L2 prefetch above read them into L2 (and at the 8B shape thrashed it)."""
    bk_max: int = 256  # reduction tile: K rounded up to a power of 2, at most this
    slots: int = 128  # attention: cache slots a step
    warps: int = 4
    move_slots: bool = True  # Transformer.commit as one SlotMover launch instead of 4 torch kernels a layer
    cols: int = 0  # output columns a matmul program; 0: 16 or 32 by _block
    stages: int = 0  # the matmul kernels' software-pipelining depth (num_stages); 0: Triton's default
    pairs: int = 32  # rotary pairs (d, d + D/2) a qkv program computes: 2 x pairs output columns of one head
    # attention split over the cache (flash-decoding): slots a program, its partial softmaxes merged by a
    # sixth kernel; 0: one program a kv head and row block walks every slot (SmolLM2: 3 programs a step)
    split: int = 64
    # the final RMSNorm and the lm_head of short batch-1 passes as kernels too (rows in tiles, so a token's
    # logits have the same bits in any pass); False: torch's, whose cuBLAS kernels are chosen by row count
    head: bool = True
    # the qkv, o_proj and down_proj matmuls split over K into up to this many parts a tile (more programs
    # and bytes in flight: the 8B shape's o_proj and down_proj have 128 column blocks, qkv 96-192 programs);
    # the last part to finish sums the parts in order, so no extra launch
    ksplit: int = 4
    # with split: the last chunk program of a token merges the chunks itself instead of a sixth kernel
    merge_last: bool = False
    # programmatic dependent launch (Hopper): each kernel is put on the GPU while the one before it runs and
    # waits on the device for it to finish, instead of being launched after it (to hide the launch gaps of
    # SmolLM2's ~180 dependent kernels a step: 12% of its one-token step on an H100); the arithmetic is unchanged
    pdl: bool = True
    # with pdl: the matmul kernels load their first weight tiles before waiting for the kernel before (weights
    # are never written), so that read overlaps it. The arithmetic is the same either way. Real SmolLM2 on an H100:
    # one-token step 0.677 against 0.697 ms, 8-token 0.724 against 0.752 (logs/bench-early-h100-3dbfcea.json); the
    # 8B shape: one-token 5.57 against 5.64 ms, but 8-token 6.89 against 6.53 (logs/engine-8b-early-h100-21ee8c9.json)
    early_weights: bool = True
    # with early_weights: only passes of at most this many rows read early, longer ones after the wait (0: every
    # pass). The bits do not change (the same arithmetic), so a pass size can choose. At the 8B shape on the H200
    # (logs/engine-8b-early1-h200-1f6bb76.json, random weights) early_rows=1 ran 229.4 tok/s with an 8-token pass of
    # 1.220 steps, early weights everywhere 230.2 / 1.328, none 231.4 / 1.227: not the default
    early_rows: int = 0

    def __post_init__(self):
        for name in ("bk_max", "slots"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Tuning.{name} must be a power of 2 >= 16, got {v}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Tuning.warps must be 1, 2, 4, 8 or 16, got {self.warps}")
        if self.cols and (self.cols < 16 or self.cols & (self.cols - 1)):
            raise ValueError(f"Tuning.cols must be 0 (automatic) or a power of 2 >= 16, got {self.cols}")
        if self.split and (self.split < 16 or self.split & (self.split - 1)):
            raise ValueError(f"Tuning.split must be 0 (no split) or a power of 2 >= 16, got {self.split}")
        if self.pairs < 16 or self.pairs & (self.pairs - 1):
            raise ValueError(f"Tuning.pairs must be a power of 2 >= 16, got {self.pairs}")
        if not 1 <= self.ksplit <= 16:
            raise ValueError(f"Tuning.ksplit must be 1 (no split) to 16, got {self.ksplit}")
        if not 0 <= self.stages <= 8:
            raise ValueError(f"Tuning.stages must be 0 (Triton's default) to 8, got {self.stages}")
        if self.early_rows < 0:
            raise ValueError(f"Tuning.early_rows must be 0 (every pass) or a row count, got {self.early_rows}")

    def bk(self, k: int, itemsize: int = 2) -> int:
        return max(16, min(self.bk_max * 2 // max(itemsize, 2), triton.next_power_of_2(k)))

    def slots_for(self, itemsize: int = 2) -> int:
        return max(16, self.slots * 2 // max(itemsize, 2))


@triton.jit
def _rows(a_ptr, rm, rk, n_rows, K: tl.constexpr):
    """Rows rm (BM,), columns rk (BK,) of a row-major (n_rows, K) matrix; zeros outside."""
    return tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < n_rows) & (rk[None, :] < K), other=0.0)


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """With programmatic dependent launch (Tuning.pdl) a kernel is put on the GPU while the one before it
    still runs: it waits here until that one has finished and its writes are visible (so nothing before
    this call may touch memory), then lets the next kernel be launched in turn."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _rstd(x_ptr, rm, n_rows, eps, K: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr):
    ss = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = _rows(x_ptr, rm, rk, n_rows, K)
        x = x.to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _normed(x_ptr, nw_ptr, rm, rk, n_rows, rstd, K: tl.constexpr):
    """RMSNorm's output tile (BM, BK), rounded as RMSNorm.forward rounds it: x * rstd in fp32, cast,
    times the weight in the model's dtype."""
    x = _rows(x_ptr, rm, rk, n_rows, K)
    xn = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
    w = tl.load(nw_ptr + rk, mask=rk < K, other=0.0)
    return w[None, :] * xn


@triton.jit
def _w_tile(w_ptr, n, n_ok, rk, K: tl.constexpr):
    """Weight rows n (n_ok masking them), columns rk of a row-major (N, K) matrix, transposed: (BK, BN)."""
    return tl.trans(tl.load(w_ptr + n[:, None] * K + rk[None, :], mask=n_ok[:, None] & (rk[None, :] < K), other=0.0))


@triton.jit
def _normed_dots(x_ptr, nw_ptr, w_ptr, n1, n2, n_ok, rm, n_rows, eps, lo, K: tl.constexpr, KP: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
                 EARLY: tl.constexpr):
    """rmsnorm(x) @ w[n1]^T and @ w[n2]^T for rows rm (BN weight rows each, n_ok masking them) over K's
    lo .. lo + KP (all of it: 0, K), RMSNorm rounded as RMSNorm.forward rounds it after a first pass over
    the whole of x for rstd. Waits for the kernel before (PDL) itself: with EARLY (Tuning.early_weights) after
    loading the first weight tiles, which no kernel writes."""
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    first = lo
    if EARLY:  # the first tiles' dots peeled off the loop, their weights read before the wait
        rk = lo + tl.arange(0, BK)
        w1 = _w_tile(w_ptr, n1, n_ok, rk, K)
        w2 = _w_tile(w_ptr, n2, n_ok, rk, K)
        _pdl_start(PDL)
        rstd = _rstd(x_ptr, rm, n_rows, eps, K, BK, BM)
        a = _normed(x_ptr, nw_ptr, rm, rk, n_rows, rstd, K)
        acc1 += tl.dot(a, w1, input_precision=PREC)
        acc2 += tl.dot(a, w2, input_precision=PREC)
        first = lo + BK
    else:
        _pdl_start(PDL)
        rstd = _rstd(x_ptr, rm, n_rows, eps, K, BK, BM)
    for k0 in range(first, lo + KP, BK):
        rk = k0 + tl.arange(0, BK)
        w1 = _w_tile(w_ptr, n1, n_ok, rk, K)
        w2 = _w_tile(w_ptr, n2, n_ok, rk, K)
        a = _normed(x_ptr, nw_ptr, rm, rk, n_rows, rstd, K)
        acc1 += tl.dot(a, w1, input_precision=PREC)
        acc2 += tl.dot(a, w2, input_precision=PREC)
    return acc1, acc2


@triton.jit
def _qkv_out(acc1, acc2, rm, head, d1, b_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, n_rows, S,
             D: tl.constexpr, H: tl.constexpr, KV: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One row tile's epilogue: bias, rotary on q and k heads, q into its buffer, k or v into its cache slots."""
    dt = q_ptr.dtype.element_ty
    if HAS_BIAS:
        y1 = (acc1.to(dt) + tl.load(b_ptr + head * D + d1)[None, :]).to(tl.float32)
        y2 = (acc2.to(dt) + tl.load(b_ptr + head * D + d1 + D // 2)[None, :]).to(tl.float32)
    else:
        y1 = acc1.to(dt).to(tl.float32)
        y2 = acc2.to(dt).to(tl.float32)
    ok = rm < n_rows
    c1 = tl.load(cos_ptr + rm[:, None] * D + d1[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + rm[:, None] * D + D // 2 + d1[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + rm[:, None] * D + d1[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + rm[:, None] * D + D // 2 + d1[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    rotate = head < H + KV  # q and k heads; v heads pass through
    o1 = tl.where(rotate, y1 * c1 - y2 * s1, y1)
    o2 = tl.where(rotate, y2 * c2 + y1 * s2, y2)
    qa = q_ptr + (rm[:, None] * H + head) * D + d1[None, :]  # q buffer (T, H, D)
    slot = tl.load(slot_ptr + rm, mask=ok, other=0)
    if head < H:
        tl.store(qa, o1, mask=ok[:, None])
        tl.store(qa + D // 2, o2, mask=ok[:, None])
    elif head < H + KV:
        ca = ((head - H) * S + slot)[:, None] * D + d1[None, :]  # cache (1, KV, S, D)
        tl.store(kc_ptr + ca, o1, mask=ok[:, None])
        tl.store(kc_ptr + ca + D // 2, o2, mask=ok[:, None])
    else:
        ca = ((head - H - KV) * S + slot)[:, None] * D + d1[None, :]
        tl.store(vc_ptr + ca, o1, mask=ok[:, None])
        tl.store(vc_ptr + ca + D // 2, o2, mask=ok[:, None])


@triton.jit
def _qkv_rope_cache(x_ptr, nw_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, p_ptr, count_ptr,
                    n_rows, S, eps, K: tl.constexpr, D: tl.constexpr, H: tl.constexpr, KV: tl.constexpr,
                    BP: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                    KS: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    # program (head x K part, pair block, row tile); heads are q heads, then k heads, then v heads (qkv's
    # rows). A program computes BP rotary pairs (d, d + D/2) of one head, so it can rotate them itself.
    # With KS parts (Tuning.ksplit) each sums KP of K into fp32 partials p (KS, n_rows, qkv's columns); the
    # last part of (head, pairs, rows) to finish adds them up in order and finishes as an unsplit one does
    head = tl.program_id(0) // KS
    d1 = tl.program_id(1) * BP + tl.arange(0, BP)  # first halves; partners at d1 + D/2
    rm = tl.program_id(2) * BM + tl.arange(0, BM)
    n1 = head * D + d1
    part = tl.program_id(0) % KS
    lo = part * KP if KS > 1 else 0
    acc1, acc2 = _normed_dots(x_ptr, nw_ptr, w_ptr, n1, n1 + D // 2, d1 < D // 2, rm, n_rows, eps, lo, K, KP, BP, BK, BM, PREC,
                              PDL, EARLY)
    if KS > 1:
        NQ: tl.constexpr = (H + 2 * KV) * D  # qkv's columns
        at = rm[:, None] * NQ + n1[None, :]
        ok = (rm < n_rows)[:, None]
        tl.store(p_ptr + part * n_rows * NQ + at, acc1, mask=ok)
        tl.store(p_ptr + part * n_rows * NQ + at + D // 2, acc2, mask=ok)
        tile = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * (H + 2 * KV) + head
        if _arrive_last(count_ptr, tile, KS):
            sum1 = _sum_parts(p_ptr, at, ok, n_rows * NQ, KS)
            sum2 = _sum_parts(p_ptr, at + D // 2, ok, n_rows * NQ, KS)
            _qkv_out(sum1, sum2, rm, head, d1, b_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, n_rows, S, D, H, KV,
                     HAS_BIAS)
    else:
        _qkv_out(acc1, acc2, rm, head, d1, b_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, n_rows, S, D, H, KV,
                 HAS_BIAS)


@triton.jit
def _attend(q, kc_ptr, vc_ptr, m_ptr, t, j, S, m_row, m_col, scale, lo, hi, base, vis, rank, move,
            D: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr, WIN: tl.constexpr, PREC: tl.constexpr):
    """Online softmax of token t's query rows q (BM, D) of kv head j over its keys lo..hi-1 under the mask:
    (running max, sum of exponentials, unnormalised output). Keys before base are the cache slots of the
    same number; with `move`, key base + i is the i-th slot from base on that t sees (_token_rows), so a tree
    token reduces over its ancestors in the places plain decoding gives them (without it, as for a one-token
    step or a chain, those slots are its keys already). Masked keys add exact zeros, so a row's result
    does not depend on how far past its own keys hi reaches."""
    rd = tl.arange(0, D)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    dt = q.dtype
    u = tl.arange(0, WIN)
    for s0 in range(lo, hi, BS):
        rs = s0 + tl.arange(0, BS)
        inside = rs < hi
        slot = rs.to(tl.int64)
        seen = tl.load(m_ptr + t * m_row + rs * m_col, mask=inside, other=0) != 0
        if move:
            if s0 + BS > base:  # the block reaches the pass's own slots: the token's i-th seen one at key base + i
                i = rs - base
                nth = tl.sum(tl.where(vis[None, :] & (rank[None, :] == i[:, None]), u[None, :], 0), axis=1)
                slot = tl.where(i >= 0, base + nth, slot)
                seen = tl.where(i >= 0, inside, seen)
        kv_at = (j * S + slot)[:, None] * D + rd[None, :]
        k = tl.load(kc_ptr + kv_at, mask=inside[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC).to(dt).to(tl.float32) * scale  # (BM, BS), rounded as q @ k^T is
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: no nan
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + kv_at, mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), v, input_precision=PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _pass_slots(slot_ptr, n_rows, TMAX: tl.constexpr):
    """The first cache slot the pass writes and one past its last: attention reads the slots below the latter."""
    rt = tl.arange(0, TMAX)
    slots = tl.load(slot_ptr + rt, mask=rt < n_rows, other=0)
    end = tl.max(slots, axis=0) + 1
    return tl.min(tl.where(rt < n_rows, slots, end), axis=0), end


@triton.jit
def _sum_parts(p_ptr, at, mask, stride, KS: tl.constexpr):
    """The KS fp32 partials at p_ptr + part * stride + at, added up in order (so a token's bits do not
    depend on which part finished last), read from L2 (.cg): other programs of this launch wrote them."""
    total = tl.zeros(at.shape, dtype=tl.float32)
    for part in tl.static_range(KS):
        total += tl.load(p_ptr + part * stride + at, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _arrive_last(count_ptr, at, arrivals):
    """Whether this program is the last of `arrivals` to reach counter `at`. Every program's stores before
    the call are visible to the last one (a barrier, then one thread's release-acquire atomic, as a
    CUTLASS semaphore), which also sets the counter back to 0 for the next launch. Read what the others
    stored with cache_modifier=".cg" (from L2, not this SM's L1)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr + at, 1, sem="acq_rel", scope="gpu")
    last = ticket == arrivals - 1
    if last:
        tl.atomic_xchg(count_ptr + at, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _token_rows(q_ptr, slot_ptr, m_ptr, n_rows, m_row, m_col, H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
                BM: tl.constexpr, TMAX: tl.constexpr, WIN: tl.constexpr):
    """An attention program's rows: the query heads of kv head program_id(0)'s group for token
    t = program_id(1), so they are the rows a one-token step at the token's slot has. Returns t, head,
    which rows are real, their q (BM, D), the pass's first slot (base) and one past its last (end), and
    the layout of the slots t sees from base on: vis, rank, whether _attend must move them (move) and
    one past its last key (hi)."""
    REP: tl.constexpr = H // KV
    t = tl.program_id(1)
    r = tl.arange(0, BM)
    head = tl.program_id(0) * REP + r
    ok = r < REP
    q = tl.load(q_ptr + (t * H + head)[:, None] * D + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
    base, end = _pass_slots(slot_ptr, n_rows, TMAX)
    # the slots from base on that t sees, in order, become its keys base, base + 1, ... (a tree token's
    # ancestors, as plain decoding leaves them); a pass spread wider than WIN slots keeps the cache's order
    u = tl.arange(0, WIN)
    vis = tl.load(m_ptr + t * m_row + (base + u) * m_col, mask=base + u < end, other=0) != 0
    rank = tl.cumsum(vis.to(tl.int32), axis=0) - 1
    n_seen = tl.sum(vis.to(tl.int32), axis=0)
    laid = end - base <= WIN
    hi = tl.where(laid, base + n_seen, end)
    in_place = tl.max(tl.where(vis, u, -1), axis=0) == n_seen - 1  # seen: base, base + 1, ... (causal rows)
    return t, head, ok, q, base, end, vis, rank, laid & ~in_place, hi


@triton.jit
def _attention(q_ptr, kc_ptr, vc_ptr, m_ptr, slot_ptr, o_ptr, n_rows, S, m_row, m_col, scale,
               H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
               TMAX: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
    # program (kv head, token): its query heads over its keys
    _pdl_start(PDL)
    t, head, ok, q, base, end, vis, rank, move, hi = _token_rows(q_ptr, slot_ptr, m_ptr, n_rows, m_row, m_col, H, KV, D, BM,
                                                                 TMAX, TMAX)
    m_i, l_i, acc = _attend(q, kc_ptr, vc_ptr, m_ptr, t, tl.program_id(0), S, m_row, m_col, scale, 0, hi, base, vis, rank,
                            move, D, BS, BM, TMAX, PREC)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    rd = tl.arange(0, D)
    tl.store(o_ptr + (t * H + head)[:, None] * D + rd[None, :], out.to(q.dtype), mask=ok[:, None])


@triton.jit
def _attention_part(q_ptr, kc_ptr, vc_ptr, m_ptr, slot_ptr, pm_ptr, pl_ptr, pacc_ptr, o_ptr, count_ptr, n_rows, S, m_row,
                    m_col, scale, H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
                    TMAX: tl.constexpr, CH: tl.constexpr, PREC: tl.constexpr, MERGE: tl.constexpr, NCP: tl.constexpr,
                    PDL: tl.constexpr):
    # split-KV (flash-decoding): program (kv head, token, chunk c of CH keys) attends over its chunk and
    # writes the running max, sum and unnormalised output for _attention_merge. Chunks at or past the
    # pass's end write nothing (the merge reads only the chunks below it); those past the token's own
    # keys write (-inf, 0, 0), as a one-token step's merge reads them there. With MERGE the last chunk
    # program of (kv head, token) to finish merges them (Tuning.merge_last)
    _pdl_start(PDL)
    t, head, ok, q, base, end, vis, rank, move, hi = _token_rows(q_ptr, slot_ptr, m_ptr, n_rows, m_row, m_col, H, KV, D, BM,
                                                                 TMAX, TMAX)
    c = tl.program_id(2)
    lo = c * CH
    if lo < end:
        m_i, l_i, acc = _attend(q, kc_ptr, vc_ptr, m_ptr, t, tl.program_id(0), S, m_row, m_col, scale, lo,
                                tl.minimum(lo + CH, hi), base, vis, rank, move, D, BS, BM, TMAX, PREC)
        part = c * n_rows * H + t * H + head  # partials (chunks, T, H[, D])
        tl.store(pm_ptr + part, m_i, mask=ok)
        tl.store(pl_ptr + part, l_i, mask=ok)
        tl.store(pacc_ptr + part[:, None] * D + tl.arange(0, D)[None, :], acc, mask=ok[:, None])
    if MERGE:
        if _arrive_last(count_ptr, tl.program_id(0) * TMAX + t, tl.num_programs(2)):
            for r in tl.static_range(H // KV):  # its query heads, each as _attention_merge merges a row
                _merge_row(pm_ptr, pl_ptr, pacc_ptr, o_ptr, t * H + tl.program_id(0) * (H // KV) + r, n_rows * H,
                           tl.cdiv(end, CH), D, NCP, ".cg")


@triton.jit
def _attention_merge(pm_ptr, pl_ptr, pacc_ptr, slot_ptr, o_ptr, n_rows, H: tl.constexpr, D: tl.constexpr,
                     CH: tl.constexpr, NCP: tl.constexpr, TMAX: tl.constexpr, PDL: tl.constexpr):
    # program (row = token t * H + head): the chunks' partial softmaxes as one, summed over a fixed
    # NCP-wide vector. Chunks at or past the pass's end are not read, and a chunk the row cannot see
    # holds (-inf, 0, 0): either way (-inf, 0, 0) at that place, so a row's bits are the same in a
    # one-token step as in a verify pass at the same slot.
    _pdl_start(PDL)
    _, end = _pass_slots(slot_ptr, n_rows, TMAX)
    _merge_row(pm_ptr, pl_ptr, pacc_ptr, o_ptr, tl.program_id(0), n_rows * H, tl.cdiv(end, CH), D, NCP, "")


@triton.jit
def _merge_row(pm_ptr, pl_ptr, pacc_ptr, o_ptr, row, stride, n_chunks, D: tl.constexpr, NCP: tl.constexpr,
               CACHE: tl.constexpr):
    """Output row `row` from the chunks' partial softmaxes (chunk c's at c * stride + row), summed over a
    fixed NCP-wide vector: chunks at or past n_chunks, like those the row cannot see, are (-inf, 0, 0) at
    the same places, so its bits do not depend on how far its pass reaches. CACHE ".cg" reads them from
    L2, for partials that other programs of the same launch wrote (Tuning.merge_last)."""
    c = tl.arange(0, NCP)
    real = c < n_chunks
    at = c * stride + row
    m = tl.load(pm_ptr + at, mask=real, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(pl_ptr + at, mask=real, other=0.0, cache_modifier=CACHE)
    rd = tl.arange(0, D)
    acc = tl.load(pacc_ptr + at[:, None] * D + rd[None, :], mask=real[:, None], other=0.0, cache_modifier=CACHE)
    top = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))
    den = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(den == 0.0, 1.0, den)
    tl.store(o_ptr + row * D + rd, out.to(o_ptr.dtype.element_ty))


@triton.jit
def _linear(a_ptr, w_ptr, r_ptr, y_ptr, p_ptr, count_ptr, n_rows, K: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr, RESIDUAL: tl.constexpr, KS: tl.constexpr,
            KP: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    # y = r + a @ w^T (or a @ w^T), program (column block, row tile[, K part]). With KS parts each sums
    # KP of K into fp32 partials p (KS, n_rows, N); the last part of a tile to finish adds them up in order
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    inside = (rm[:, None] < n_rows) & (rn[None, :] < N)
    acc = _dots(a_ptr, w_ptr, rm, rn, n_rows, tl.program_id(2) * KP if KS > 1 else 0, K, N, KP, BN, BK, BM, PREC, PDL,
                EARLY)
    at = rm[:, None] * N + rn[None, :]
    if KS > 1:
        tl.store(p_ptr + tl.program_id(2) * n_rows * N + at, acc, mask=inside)
        if _arrive_last(count_ptr, tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), KS):
            _linear_out(_sum_parts(p_ptr, at, inside, n_rows * N, KS), at, inside, r_ptr, y_ptr, RESIDUAL)
    else:
        _linear_out(acc, at, inside, r_ptr, y_ptr, RESIDUAL)


@triton.jit
def _dots(a_ptr, w_ptr, rm, rn, n_rows, lo, K: tl.constexpr, N: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """a[rm] @ w[rn]^T over K's lo .. lo + KP in fp32: one tile of _linear's (and _head_argmax's) product.
    Waits for the kernel before (PDL) as _normed_dots does, with EARLY after loading the first weight tile."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    first = lo
    if EARLY:  # the first tile's dot peeled off the loop, its weights read before the wait
        rk = lo + tl.arange(0, BK)
        w = _w_tile(w_ptr, rn, rn < N, rk, K)
        _pdl_start(PDL)
        acc += tl.dot(_rows(a_ptr, rm, rk, n_rows, K), w, input_precision=PREC)
        first = lo + BK
    else:
        _pdl_start(PDL)
    for k0 in range(first, lo + KP, BK):
        rk = k0 + tl.arange(0, BK)
        acc += tl.dot(_rows(a_ptr, rm, rk, n_rows, K), _w_tile(w_ptr, rn, rn < N, rk, K), input_precision=PREC)
    return acc


@triton.jit
def _head_argmax(a_ptr, w_ptr, pv_ptr, pi_ptr, out_ptr, count_ptr, n_rows, K: tl.constexpr, N: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr, LAST: tl.constexpr,
                 CH: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    # out = argmax over N of a @ w^T rounded to a's dtype (what logits(...).argmax(-1) picks: the first
    # column of the largest), program (column block, row tile) as _linear's, without writing the logits:
    # each program writes its block's largest and where (pv, pi: (n_rows, blocks)); with LAST the last
    # program of a row tile to finish reduces them, else _argmax_reduce does (one launch more)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    acc = _dots(a_ptr, w_ptr, rm, rn, n_rows, 0, K, N, K, BN, BK, BM, PREC, PDL, EARLY)
    v = tl.where(rn[None, :] < N, acc.to(a_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
    top = tl.max(v, axis=1)
    first = tl.min(tl.where(v == top[:, None], rn[None, :], N), axis=1)
    nb = tl.num_programs(0)
    ok = rm < n_rows
    tl.store(pv_ptr + rm * nb + tl.program_id(0), top, mask=ok)
    tl.store(pi_ptr + rm * nb + tl.program_id(0), first, mask=ok)
    if LAST:
        if _arrive_last(count_ptr, tl.program_id(1), nb):
            _argmax_rows(pv_ptr, pi_ptr, out_ptr, rm, n_rows, nb, N, BM, CH, ".cg")


@triton.jit
def _argmax_reduce(pv_ptr, pi_ptr, out_ptr, n_rows, nb, N: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr,
                   PDL: tl.constexpr):
    # program (row tile): _head_argmax's blocks reduced, where its LAST is off (inside torch.compile)
    _pdl_start(PDL)
    _argmax_rows(pv_ptr, pi_ptr, out_ptr, tl.program_id(0) * BM + tl.arange(0, BM), n_rows, nb, N, BM, CH, "")


@triton.jit
def _argmax_rows(pv_ptr, pi_ptr, out_ptr, rm, n_rows, nb, N: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr,
                 CACHE: tl.constexpr):
    """out[rm] = the first column of the largest over the blocks' (largest, first column) in pv, pi."""
    ok = rm < n_rows
    best = tl.full([BM], float("-inf"), tl.float32)
    at = tl.full([BM], N, tl.int32)
    for c0 in range(0, nb, CH):
        c = c0 + tl.arange(0, CH)
        inside = ok[:, None] & (c[None, :] < nb)
        v = tl.load(pv_ptr + rm[:, None] * nb + c[None, :], mask=inside, other=float("-inf"), cache_modifier=CACHE)
        i = tl.load(pi_ptr + rm[:, None] * nb + c[None, :], mask=inside, other=N, cache_modifier=CACHE)
        top = tl.max(v, axis=1)
        first = tl.min(tl.where(v == top[:, None], i, N), axis=1)
        take = (top > best) | ((top == best) & (first < at))
        best = tl.where(take, top, best)
        at = tl.where(take, first, at)
    tl.store(out_ptr + rm, at.to(tl.int64), mask=ok)


@triton.jit
def _linear_out(acc, at, inside, r_ptr, y_ptr, RESIDUAL: tl.constexpr):
    if RESIDUAL:
        r = tl.load(r_ptr + at, mask=inside, other=0.0)
        tl.store(y_ptr + at, r + acc.to(r.dtype), mask=inside)
    else:
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _rmsnorm(x_ptr, nw_ptr, y_ptr, n_rows, eps, K: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, PDL: tl.constexpr):
    # program (row tile): RMSNorm rounded as RMSNorm.forward rounds it, as the layers' kernels compute it
    _pdl_start(PDL)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rstd = _rstd(x_ptr, rm, n_rows, eps, K, BK, BM)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        y = _normed(x_ptr, nw_ptr, rm, rk, n_rows, rstd, K)
        tl.store(y_ptr + rm[:, None] * K + rk[None, :], y, mask=(rm[:, None] < n_rows) & (rk[None, :] < K))


@triton.jit
def _gate_up(x_ptr, nw_ptr, w_ptr, y_ptr, n_rows, eps, K: tl.constexpr, I: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    # y = silu(norm(x) @ gate^T) * (norm(x) @ up^T); w is gate_up (2I, K): gate rows, then up rows.
    # Program (column block, row tile), as _linear.
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    acc_g, acc_u = _normed_dots(x_ptr, nw_ptr, w_ptr, rn, rn + I, rn < I, rm, n_rows, eps, 0, K, K, BN, BK, BM, PREC, PDL,
                                EARLY)
    dt = y_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt)
    tl.store(y_ptr + rm[:, None] * I + rn[None, :], act * acc_u.to(dt), mask=(rm[:, None] < n_rows) & (rn[None, :] < I))


@triton.jit
def _move_slots(table_ptr, like_ptr, src_ptr, dst_ptr, n, S, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    # program (buffer, kv head): slots src -> dst of one (1, KV, S, D) buffer whose address is table[buffer];
    # every row is read before any is written, so a destination may be another row's source
    base = tl.load(table_ptr + tl.program_id(0)).to(like_ptr.dtype)
    head = tl.program_id(1)
    r = tl.arange(0, BR)
    ok = r < n
    d = tl.arange(0, BD)
    inside = ok[:, None] & (d[None, :] < D)
    src = tl.load(src_ptr + r, mask=ok, other=0)
    dst = tl.load(dst_ptr + r, mask=ok, other=0)
    rows = tl.load(base + (head * S + src)[:, None] * D + d[None, :], mask=inside)
    tl.debug_barrier()  # every thread's reads before any thread's writes: a row's source may be another's destination
    tl.store(base + (head * S + dst)[:, None] * D + d[None, :], rows, mask=inside)


class SlotMover:
    """Transformer.commit as one kernel launch: slots src -> dst in every layer's k and v cache, where
    the torch path is a gather and a scatter a buffer (4 kernels a layer, 120 for SmolLM2, in every
    tree cycle). The buffers' addresses go to the kernel as a table, rebuilt whenever they change
    (new caches, .to()); build it outside CUDA-graph capture (Graphs warms a step up first)."""

    def __init__(self):
        self.ptrs: tuple[int, ...] = ()
        self.table: torch.Tensor | None = None

    @staticmethod
    def covers(buffers: list[torch.Tensor], src: torch.Tensor) -> bool:
        b = buffers[0]
        return (b.dim() == 4 and b.shape[0] == 1 and src.dim() == 1 and 0 < len(src) <= MAX_T
                and all(x.shape == b.shape and x.dtype == b.dtype and x.device == b.device and x.is_contiguous() for x in buffers))

    def __call__(self, buffers: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor):
        ptrs = tuple(b.data_ptr() for b in buffers)
        if ptrs != self.ptrs:
            self.table = torch.tensor(ptrs, dtype=torch.int64, device=buffers[0].device)
            self.ptrs = ptrs
        _, kv, S, D = buffers[0].shape
        _move_slots[(len(buffers), kv)](self.table, buffers[0], src.contiguous(), dst.contiguous(), len(src), S, D=D,
                                        BD=triton.next_power_of_2(D), BR=max(16, triton.next_power_of_2(len(src))))


def supports(layer, x: torch.Tensor) -> bool:
    """Whether layer_forward computes this call: batch 1, up to MAX_T tokens, a fused Llama layer
    (qkv / gate_up from Transformer.optimize) without qk-norm or biases other than qkv's."""
    attn, mlp = layer.self_attn, layer.mlp
    return (x.shape[0] == 1 and x.shape[1] <= MAX_T and hasattr(attn, "qkv") and hasattr(mlp, "gate_up")
            and not hasattr(attn, "q_norm") and attn.o_proj.bias is None and mlp.gate_up.bias is None
            and mlp.down_proj.bias is None and attn.kv_cache is not None and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and attn.head_dim // 2 >= ROWS and (attn.head_dim & (attn.head_dim - 1)) == 0)


def _block(n: int, want_programs: int = 128) -> int:
    """Columns a program: 16 when that still leaves fewer than want_programs programs at 32."""
    return 16 if n // 32 < want_programs else 32


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, input_pos: torch.Tensor,
              out: torch.Tensor, tuning: Tuning = Tuning()):
    """out (T, H * D) = attention of q (T, H, D) over caches k, v (1, KV, S, D) under mask (T, S), reading
    the slots up to the largest in input_pos; in one kernel, or split over the cache (Tuning.split).
    A program takes one token's query heads of one kv head (padded to a tile), as a one-token step does."""
    T, h, D = q.shape
    kv, S = k.shape[1], k.shape[2]
    grid, bs = (kv, T), tuning.slots_for(q.element_size())
    common = dict(H=h, KV=kv, D=D, BM=max(ROWS, triton.next_power_of_2(h // kv)), TMAX=MAX_T, PREC=_precision(q),
                  num_warps=tuning.warps, **_pdl(tuning, q))
    if not tuning.split:
        _attention[grid](q, k, v, mask, input_pos, out, T, S, mask.stride(0), mask.stride(1), D**-0.5, BS=bs, **common)
        return
    chunks = triton.cdiv(S, tuning.split)
    pm, pl = (torch.empty(chunks, T, h, dtype=torch.float32, device=q.device) for _ in range(2))
    pacc = torch.empty(chunks, T, h, D, dtype=torch.float32, device=q.device)
    ncp = triton.next_power_of_2(chunks)
    count = _counters(q, kv * MAX_T) if tuning.merge_last else _unused(q)
    _attention_part[(*grid, chunks)](q, k, v, mask, input_pos, pm, pl, pacc, out, count, T, S, mask.stride(0), mask.stride(1),
                                      D**-0.5, BS=min(bs, tuning.split), CH=tuning.split, MERGE=tuning.merge_last, NCP=ncp,
                                      **common)
    if not tuning.merge_last:
        _attention_merge[(T * h,)](pm, pl, pacc, input_pos, out, T, H=h, D=D, CH=tuning.split, NCP=ncp, TMAX=MAX_T,
                                   **_pdl(tuning, q))


def layer_forward(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor,
                  mask: torch.Tensor, tuning: Tuning = Tuning()) -> torch.Tensor:
    """DecoderLayer.forward for x (1, T, H) at cache slots input_pos (T,) under mask (1, 1, T, S)."""
    attn, mlp = layer.self_attn, layer.mlp
    _, T, Hd = x.shape
    h, kv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    cache = attn.kv_cache
    S, I = cache.k.shape[2], mlp.down_proj.weight.shape[1]
    x2 = x.reshape(T, Hd).contiguous()
    cos, sin = cos.reshape(-1, D)[-T:].contiguous(), sin.reshape(-1, D)[-T:].contiguous()  # (T, D)
    rows = triton.cdiv(T, ROWS)  # row tiles
    size = x.element_size()
    mm = _matmul_options(x, tuning, T)
    bk = tuning.bk(Hd, size)
    bias = attn.qkv.bias
    q = torch.empty(T, h, D, dtype=x.dtype, device=x.device)
    bp = min(tuning.pairs, D // 2)
    ks, kp = _k_parts(Hd, bk, tuning.ksplit)
    grid = (ks * (h + 2 * kv), D // 2 // bp, rows)
    parts = torch.empty(ks, T, (h + 2 * kv) * D, dtype=torch.float32, device=x.device) if ks > 1 else _unused(x)
    count = _counters(x, grid[0] * grid[1] * grid[2] // ks) if ks > 1 else _unused(x)
    _qkv_rope_cache[grid](
        x2, layer.input_layernorm.weight, attn.qkv.weight, bias if bias is not None else _unused(x), cos, sin, input_pos, q,
        cache.k, cache.v, parts, count, T, S, layer.input_layernorm.eps, K=Hd, D=D, H=h, KV=kv, BP=bp, BK=bk,
        HAS_BIAS=bias is not None, KS=ks, KP=kp, **mm)
    o = torch.empty(T, h * D, dtype=x.dtype, device=x.device)
    attention(q, cache.k, cache.v, mask[0, 0], input_pos, o, tuning)
    h1 = _matmul(o, attn.o_proj.weight, x2, tuning, tuning.ksplit)
    a = torch.empty(T, I, dtype=x.dtype, device=x.device)
    bi = tuning.cols or _block(I)
    post = layer.post_attention_layernorm
    _gate_up[(triton.cdiv(I, bi), rows)](h1, post.weight, mlp.gate_up.weight, a, T, post.eps, K=Hd, I=I, BN=bi, BK=bk, **mm)
    return _matmul(a, mlp.down_proj.weight, h1, tuning, tuning.ksplit).view(1, T, Hd)


def _precision(x: torch.Tensor) -> str:
    """tl.dot's input_precision: exact fp32 products for fp32 models (tf32 is ignored for 16-bit inputs)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _matmul_options(x: torch.Tensor, tuning: Tuning, rows: int) -> dict:
    """The matmul kernels' launch options for x's dtype and a pass of `rows` tokens (layer_forward's and the head's alike)."""
    early = tuning.early_weights and (not tuning.early_rows or rows <= tuning.early_rows)
    return dict(BM=ROWS, PREC=_precision(x), num_warps=tuning.warps, **({"num_stages": tuning.stages} if tuning.stages else {}),
                EARLY=early, **_pdl(tuning, x))


def _pdl(tuning: Tuning, like: torch.Tensor) -> dict:
    """The PDL switch a kernel takes (_pdl_start) and, when on, the launch option that goes with it: a GPU's
    launch feature of Hopper and newer GPUs, so off for CPU tensors (the interpreter) and older GPUs (the
    default Tuning asks for it). Off too where torch.compile traces the launch (the head's kernels inside a
    compiled acceptance step): its analysis of which arguments a kernel writes cannot read PDL's inline
    assembly and then takes every argument as written (cloning the lm_head's weight at each call), and
    nothing is known of how inductor would launch the kernel."""
    on = tuning.pdl and _has_pdl(like.device) and not torch.compiler.is_compiling()
    return dict(PDL=on, **({"launch_pdl": True} if on else {}))


@functools.lru_cache
def _has_pdl(device: torch.device) -> bool:
    """Whether kernels on device can use programmatic dependent launch (griddepcontrol): CUDA compute
    capability 9.0 (Hopper) or newer. Meta tensors count as such: compile_kernels.py builds for sm_90 on them."""
    if device.type == "meta":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, tuning: Tuning = Tuning()) -> torch.Tensor:
    """RMSNorm of x (..., K), rows in tiles: the model's final norm in the Triton engine."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    out = torch.empty_like(x2)
    _rmsnorm[(triton.cdiv(x2.shape[0], ROWS),)](x2, weight, out, x2.shape[0], eps, K=K, BK=tuning.bk(K, x.element_size()),
                                                BM=ROWS, num_warps=tuning.warps, **_pdl(tuning, x))
    return out.view(x.shape)


def linear(x: torch.Tensor, weight: torch.Tensor, tuning: Tuning = Tuning()) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T in x's dtype, rows in tiles: the lm_head in the Triton engine."""
    K, N = x.shape[-1], weight.shape[0]
    return _matmul(x.reshape(-1, K).contiguous(), weight, None, tuning).view(*x.shape[:-1], N)


def _matmul(a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, tuning: Tuning, ksplit: int = 1):
    """(residual +) a (T, K) @ weight (N, K)^T, rows in tiles, K in up to ksplit parts of whole BK tiles."""
    (T, K), N = a.shape, weight.shape[0]
    bn, bk = tuning.cols or _block(N), tuning.bk(K, a.element_size())
    ks, kp = _k_parts(K, bk, ksplit)
    grid = (triton.cdiv(N, bn), triton.cdiv(T, ROWS), ks)
    y = torch.empty(T, N, dtype=a.dtype, device=a.device)
    parts = torch.empty(ks, T, N, dtype=torch.float32, device=a.device) if ks > 1 else _unused(a)
    count = _counters(a, grid[0] * grid[1]) if ks > 1 else _unused(a)
    _linear[grid](a, weight, _unused(a) if residual is None else residual, y, parts, count, T, K=K, N=N,
                  BN=bn, BK=bk, RESIDUAL=residual is not None, KS=ks, KP=kp, **_matmul_options(a, tuning, T))
    return y


def _k_parts(K: int, bk: int, ksplit: int) -> tuple[int, int]:
    """(parts, K a part) for K in up to ksplit parts of whole bk tiles: (1, K) unsplit."""
    tiles = triton.cdiv(K, bk)
    kp = triton.cdiv(tiles, min(ksplit, tiles)) * bk
    ks = triton.cdiv(K, kp)
    return (ks, kp) if ks > 1 else (1, K)


def _unused(like: torch.Tensor) -> torch.Tensor:
    """A stand-in for a pointer argument the launch does not use (no bias, no residual, no K split): never
    another argument of the same launch. torch.compile's functional form of a kernel call clones each
    written argument separately and writes each clone back, so a written tensor passed twice gets the
    untouched clone back when torch cannot tell which arguments the kernel writes (as with Tuning.pdl's
    inline assembly before _pdl turned it off under tracing: the bf16 tree's 55% greedy agreement on the
    H100, logs/h100-bench-triton-pdl-7318e6b.json; 100% since, logs/h100-bench-triton-pdl-3ff982a.json).
    A fresh tensor per argument: one shared stand-in would be two arguments again."""
    return torch.empty(1, dtype=like.dtype, device=like.device)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(like: torch.Tensor, n: int) -> torch.Tensor:
    """The arrival counters of like's device (int32 zeros that every kernel using them leaves at zero),
    made once, outside CUDA-graph capture (Graphs warms a step up first)."""
    c = _COUNTERS.get(like.device)
    if c is None:
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kernels: arrival counters first needed inside CUDA-graph capture; run the pass once before capturing")
        c = _COUNTERS[like.device] = torch.zeros(1 << 16, dtype=torch.int32, device=like.device)
    if n > c.numel():
        raise ValueError(f"kernels: {n} arrival counters needed, {c.numel()} made; raise Tuning.cols")
    return c


class Head:
    """The model's final norm and lm_head for short passes (Tuning.head): rows in tiles, so a token's
    logits have the same bits in a one-token step as in a verify pass."""

    def __init__(self, tuning: Tuning):
        self.tuning = tuning

    @staticmethod
    def covers(x: torch.Tensor) -> bool:
        """Up to MAX_T rows (a batch-1 short pass) in a float dtype."""
        return x.numel() // x.shape[-1] <= MAX_T and x.dtype in (torch.float32, torch.bfloat16, torch.float16)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm(x, weight, eps, self.tuning)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear(x, weight, self.tuning)

    def argmax(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return head_argmax(x, weight, self.tuning)


def head_argmax(x: torch.Tensor, weight: torch.Tensor, tuning: Tuning = Tuning()) -> torch.Tensor:
    """linear(x, weight).float().argmax(-1) (ties: the first) without writing the logits: the greedy token
    in the lm_head's own pass, its blocks reduced by the last program of each row tile to finish (one
    kernel) or, where torch.compile traces the call (its functional form would copy the arrival
    counters), by a second kernel."""
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K).contiguous()
    T = x2.shape[0]
    bn, bk = tuning.cols or _block(N), tuning.bk(K, x.element_size())
    grid = (triton.cdiv(N, bn), triton.cdiv(T, ROWS))
    pv = torch.empty(T, grid[0], dtype=torch.float32, device=x.device)
    pi = torch.empty(T, grid[0], dtype=torch.int32, device=x.device)
    out = torch.empty(T, dtype=torch.long, device=x.device)
    last = not torch.compiler.is_compiling()
    count = _counters(x, grid[1]) if last else _unused(x)
    _head_argmax[grid](x2, weight, pv, pi, out, count, T, K=K, N=N, BN=bn, BK=bk, LAST=last, CH=256,
                       **_matmul_options(x, tuning, T))
    if not last:
        _argmax_reduce[(grid[1],)](pv, pi, out, T, grid[0], N=N, BM=ROWS, CH=256, num_warps=tuning.warps, **_pdl(tuning, x))
    return out.view(x.shape[:-1])
