import dataclasses
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from draftsmith.cudagraph import Graphs, eager
from draftsmith.decode import decode_chain, decode_plain, generate_batch
from draftsmith.draft import DraftConfig

from helpers import OracleDrafter, tiny_drafter, tiny_native


@pytest.fixture(scope="module")
def target():
    return tiny_native()


def cuda_syncs(fn):
    """fn() under CUDA's sync debug mode -> (its result, how many host syncs it made)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return out, len([w for w in caught if "synchroniz" in str(w.message)])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_chain_equals_greedy_with_a_random_drafter(target, k):
    drafter = tiny_drafter(target, draft_vocab=200)
    for seed in range(3):
        prompt = torch.randint(3, 320, (1, 9), generator=torch.Generator().manual_seed(seed))
        plain = decode_plain(target, prompt, 40)
        spec = decode_chain(target, drafter, prompt, 40, k)
        assert spec.tokens == plain.tokens
        assert 1 + sum(spec.accept_lengths) >= len(spec.tokens)  # the first token comes from prefill


@pytest.mark.parametrize("p_right,expect", [(0.0, "never"), (1.0, "always"), (0.6, "sometimes")])
def test_chain_equals_greedy_for_stub_drafters(target, p_right, expect):
    k = 4
    prompt = torch.randint(3, 320, (1, 7), generator=torch.Generator().manual_seed(5))
    plain = decode_plain(target, prompt, 50)
    oracle = prompt[0].tolist() + plain.tokens + [0] * 10
    drafter = OracleDrafter(DraftConfig.from_target(target.args, target.args.vocab_size), oracle, p_right)
    spec = decode_chain(target, drafter, prompt, 50, k)
    assert spec.tokens == plain.tokens
    lengths = spec.accept_lengths
    if expect == "never":
        assert set(lengths) == {1}
    elif expect == "always":
        assert all(n == k + 1 for n in lengths[:-1])
    else:
        assert min(lengths) < max(lengths)


def overfit(drafter, full: torch.Tensor, aux: torch.Tensor, greedy: torch.Tensor, depth: int, steps: int = 80):
    """Train a (full-vocab) drafter on one sequence until it drafts much of it right: a real drafter,
    in miniature, whose drafts get accepted, so decoding exercises its catch-up after accepted drafts."""
    import torch.nn.functional as F

    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    L = full.shape[1]
    for _ in range(steps):
        outs = drafter.ttt(full, aux, depth)
        loss = sum(F.cross_entropy(drafter.logits(o[0, : L - 1 - j]), greedy[1 + j :]) for j, o in enumerate(outs))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.mark.parametrize("k", [1, 3])
def test_chain_drafts_what_the_trained_rows_predict(target, k, monkeypatch):
    """The first draft of every cycle must be the drafter's training-time (teacher-forced) prediction
    at that position: the decoder feeds it the same target features, tokens and cache as `ttt` does.
    A plumbing slip (wrong aux layer, a row off by one, a stale drafter cache) keeps the output
    lossless but silently ruins the accept length, and fails here."""
    import draftsmith.decode as dec

    drafter = tiny_drafter(target)
    prompt = torch.randint(3, 320, (1, 9), generator=torch.Generator().manual_seed(7))
    full = torch.cat([prompt, torch.tensor([decode_plain(target, prompt, 40).tokens])], 1)
    with torch.no_grad():
        out = target(full, torch.arange(full.shape[1]), capture=drafter.cfg.aux_layer_ids)
        greedy = target.logits(out.hidden).argmax(-1)[0]
    overfit(drafter.train(), full, out.aux, greedy, k)
    drafted = []  # every cycle's first draft, in order (one more is drafted after the last cycle)
    real = dec.draft_chain

    def spy(drafter, k):
        chain = real(drafter, k)
        return lambda h, pos: drafted.append(int((d := chain(h, pos))[0])) or d

    monkeypatch.setattr(dec, "draft_chain", spy)
    spec = decode_chain(target, drafter, prompt, 40, k)
    assert spec.tokens == full[0, 9:].tolist()
    assert max(spec.accept_lengths) > 1 + (k > 1)  # drafts were accepted: the catch-up after them is tested
    assert len(drafted) == len(spec.accept_lengths) + 1
    done = [1 + sum(spec.accept_lengths[:i]) for i in range(len(spec.accept_lengths))]  # before each cycle; prefill made one
    with torch.no_grad():
        taught = drafter.to_target(drafter.logits(drafter.ttt(full, out.aux, 1)[0]).argmax(-1))[0]  # row r drafts token r+2
    same = [d == int(taught[9 + g - 2]) for g, d in zip(done, drafted)]
    assert len(same) >= 10 and sum(same) >= 0.95 * len(same)


def test_eos_and_max_new_are_respected(target):
    prompt = torch.randint(3, 320, (1, 6), generator=torch.Generator().manual_seed(2))
    plain = decode_plain(target, prompt, 30)
    eos = plain.tokens[10]
    cut = decode_plain(target, prompt, 30, eos_ids=(eos,))
    first = plain.tokens.index(eos)
    assert cut.tokens == plain.tokens[: first + 1]
    drafter = tiny_drafter(target)
    assert decode_chain(target, drafter, prompt, 30, 3, eos_ids=(eos,)).tokens == cut.tokens
    assert len(decode_chain(target, drafter, prompt, 13, 5).tokens) == 13


def test_greedy_agreement_counts_the_tokens_greedy_decoding_would_pick(target):
    from draftsmith.decode import greedy_agreement

    prompt = torch.randint(3, 320, (1, 8), generator=torch.Generator().manual_seed(4))
    plain = decode_plain(target, prompt, 24)
    spec = decode_chain(target, tiny_drafter(target), prompt, 24, 3)
    assert greedy_agreement(target, prompt, spec.tokens) == len(plain.tokens) == 24
    wrong = plain.tokens[:-1] + [(plain.tokens[-1] + 1) % 320]  # the last token is not the greedy one
    assert greedy_agreement(target, prompt, wrong) == 23


@pytest.mark.parametrize("T", [5, 8, 13, 20], ids=["shorter", "one-chunk", "padded", "two-chunks-padded"])
def test_chunked_prefill_equals_one_pass_and_its_padding_is_never_read(target, T):
    """run_prompt in passes of 8 tokens (the last padded) gives the one-pass prefill's outputs and cache
    slots, and a decode step after it (reading the cache up to its own slot, with pad rows written past
    the prompt) gives the one-pass step's hidden state: the padding is overwritten or never seen."""
    from draftsmith.decode import run_prompt

    prompt = torch.randint(3, 320, (1, T), generator=torch.Generator().manual_seed(T))
    nxt = torch.tensor([[7]])
    runs = {}
    for chunk in (0, 8):
        graphs = Graphs(False, prefill_chunk=chunk)
        target.setup_caches(1, 64)
        out = run_prompt(target, prompt, (1, 2), graphs)
        cache = [(a.kv_cache.k[:, :, :T].clone(), a.kv_cache.v[:, :, :T].clone()) for a in (l.self_attn for l in target.layers)]
        step = target(nxt, torch.tensor([T])).hidden
        runs[chunk] = (out, cache, step)
    (one, cache1, step1), (chunked, cache8, step8) = runs[0], runs[8]
    assert chunked.hidden.shape == one.hidden.shape == (1, T, target.args.hidden_size)
    torch.testing.assert_close(chunked.hidden, one.hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.aux, one.aux, rtol=1e-5, atol=1e-5)
    for (k1, v1), (k8, v8) in zip(cache1, cache8):
        torch.testing.assert_close(k8, k1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v8, v1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step8, step1, rtol=1e-5, atol=1e-5)


def test_spans_timed_on_one_cycle_in_n_are_scaled_to_all_cycles(target, monkeypatch):
    """With TIME_EVERY = 4 the chain and the tree time draft and verify on cycles 0, 4, 8, ... only (an
    untimed cycle records no event) and scale the totals to every cycle: with each timed span counted
    as 1 ms, both totals are 1 ms a cycle; the tokens are those of plain decoding. A cycle's draft is
    queued (and marked) during the one before (speculation_cycles)."""
    from draftsmith import decode as dec

    monkeypatch.setattr(dec, "TIME_EVERY", {"cpu": 4})
    marks = []
    monkeypatch.setattr(dec, "mark", lambda device, on=True: marks.append(on) or (0.0 if on else None))
    monkeypatch.setattr(dec, "elapsed", lambda a, b: 0.0 if a is None else 1e-3)
    drafter = tiny_drafter(target, draft_vocab=200)
    prompt = torch.randint(3, 320, (1, 9), generator=torch.Generator().manual_seed(8))
    plain = decode_plain(target, prompt, 30)
    for run in (lambda: dec.decode_chain(target, drafter, prompt, 30, 3),
                lambda: dec.decode_tree(target, drafter, prompt, 30, TreeSpec(2, 3, 4))):
        marks.clear()
        gen = run()
        n = len(gen.accept_lengths)
        assert gen.tokens == plain.tokens and n > 8
        on = [i % 4 == 0 for i in range(n + 1)]
        assert marks == [on[0], on[0]] + [m for i in range(n) for m in (on[i], on[i + 1], on[i + 1])]
        for total in (gen.draft_seconds, gen.verify_seconds):
            assert total == pytest.approx(n * 1e-3)


@pytest.mark.parametrize("T", [5, 13, 20], ids=["shorter", "padded", "two-chunks-padded"])
def test_drafters_chunked_prompt_pass_equals_one_pass_and_its_padding_is_never_read(target, T):
    """draft_prompt in passes of 8 rows (the last padded) gives the one-pass output of the last row and
    the same drafter cache slots 0..T-1, and drafting after it (slot T on, reading slots <= its own)
    gives what it gives after one pass: the pad rows' slots are overwritten before they are read."""
    from draftsmith.decode import draft_chain, draft_prompt

    drafter = tiny_drafter(target, draft_vocab=200)
    g = torch.Generator().manual_seed(T)
    prompt, first = torch.randint(3, 320, (1, T), generator=g), torch.tensor([7])
    aux = torch.randn(1, T, 3 * target.args.hidden_size, generator=g)
    runs = {}
    for chunk in (0, 8):
        drafter.setup_caches(1, 64)
        h = draft_prompt(drafter, prompt, first, aux, Graphs(False, prefill_chunk=chunk))
        cache = drafter.midlayer.self_attn.kv_cache
        drafts = draft_chain(drafter, 4)(h, torch.tensor([T]))
        runs[chunk] = h, cache.k[:, :, :T].clone(), cache.v[:, :, :T].clone(), drafts
    (h1, k1, v1, d1), (h8, k8, v8, d8) = runs[0], runs[8]
    assert h8.shape == h1.shape == (1, 1, drafter.cfg.hidden_size)
    for a, b in ((h8, h1), (k8, k1), (v8, v1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert d8.tolist() == d1.tolist()


def test_speculation_after_a_chunked_prefill_equals_plain_decoding(target):
    """Every decoder on prompts prefilled in padded 8-token passes (as CUDA graphs run them, in 256)
    decodes what plain greedy decoding does, and plain decoding what it does after a one-pass prefill;
    the caches are sized for the padding (cache_slots), here where the prompt needs more than decoding."""
    from draftsmith.decode import cache_slots

    drafter = tiny_drafter(target, draft_vocab=200)
    graphs = Graphs(False, prefill_chunk=8)
    assert cache_slots(target, graphs, 13, 15) == 16 and cache_slots(target, Graphs(False), 13, 15) == 15
    for seed, T in ((0, 13), (1, 17)):
        prompt = torch.randint(3, 320, (1, T), generator=torch.Generator().manual_seed(seed))
        target.layers[0].self_attn.kv_cache = None  # fresh caches: decode_plain sizes them for 2 new tokens
        target.max_len = 0
        short = decode_plain(target, prompt, 2, graphs=graphs)
        assert target.max_len >= -(-T // 8) * 8  # room for the padded last pass, beyond T + 2 + 1
        plain = decode_plain(target, prompt, 30)
        assert short.tokens == plain.tokens[:2]
        assert decode_plain(target, prompt, 30, graphs=graphs).tokens == plain.tokens
        assert decode_chain(target, drafter, prompt, 30, 3, graphs=graphs).tokens == plain.tokens
        assert decode_tree(target, drafter, prompt, 30, TreeSpec(2, 3, 4), graphs=graphs).tokens == plain.tokens


# --------------------------------------------------------------------------- trees

from draftsmith.decode import (DraftTree, TreeSpec, accept_on_device, accept_tree_greedy, ancestors,  # noqa: E402
                               decode_tree, draft_greedy, draft_tree, prefill, verify_greedy, verify_tree)

SPECS = {"small": TreeSpec(2, 3, 4), "wide": TreeSpec(4, 5, 16), "chain-like": TreeSpec(1, 4, 4),
         "all-candidates": TreeSpec(3, 2, 50), "one-step": TreeSpec(3, 1, 2), "shallow-budget": TreeSpec(2, 4, 3)}


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_tree_equals_greedy_with_a_random_drafter(target, spec):
    drafter = tiny_drafter(target, draft_vocab=200)
    for seed in range(2):
        prompt = torch.randint(3, 320, (1, 8), generator=torch.Generator().manual_seed(seed))
        plain = decode_plain(target, prompt, 40)
        tree = decode_tree(target, drafter, prompt, 40, spec)
        assert tree.tokens == plain.tokens


@pytest.mark.parametrize("p_right", [0.0, 1.0, 0.5])
def test_tree_equals_greedy_for_stub_drafters(target, p_right):
    prompt = torch.randint(3, 320, (1, 7), generator=torch.Generator().manual_seed(5))
    plain = decode_plain(target, prompt, 50)
    oracle = prompt[0].tolist() + plain.tokens + [0] * 20
    drafter = OracleDrafter(DraftConfig.from_target(target.args, target.args.vocab_size), oracle, p_right)
    spec = TreeSpec(topk=2, steps=4, num_draft_tokens=8)
    out = decode_tree(target, drafter, prompt, 50, spec)
    assert out.tokens == plain.tokens
    if p_right == 1.0:  # the true path is drafted at every depth and survives the rerank
        assert set(out.accept_lengths[:-1]) == {spec.steps + 1}
    if p_right == 0.0:
        assert set(out.accept_lengths) == {1}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_top1_tree_is_the_chain(target, k):
    """decode_tree with TreeSpec(1, k, k) drafts, accepts and emits exactly what decode_chain(k) does
    (same tokens, same accept length every cycle), so the device-resident tree cycle (one host read a
    cycle, the next draft queued before it) can serve chain speculation."""
    prompt = torch.randint(3, 320, (1, 7), generator=torch.Generator().manual_seed(9))
    plain = decode_plain(target, prompt, 60)
    oracle = prompt[0].tolist() + plain.tokens + [0] * 20
    drafter = OracleDrafter(DraftConfig.from_target(target.args, target.args.vocab_size), oracle, 0.7)
    chain = decode_chain(target, drafter, prompt, 60, k)
    tree = decode_tree(target, drafter, prompt, 60, TreeSpec(1, k, k))
    assert tree.tokens == chain.tokens == plain.tokens
    assert tree.accept_lengths == chain.accept_lengths and len(set(chain.accept_lengths)) > 1  # some drafts accepted, some not


@pytest.mark.parametrize("kind", ["trained-shape", "sometimes-right"])
def test_compiled_drafting_steps_decode_the_same(target, kind):
    """Eagle3Drafter.optimize(backend): the fused drafter's drafting steps run under torch.compile
    (fullgraph, so any graph break fails here); chain, tree and sampled tree (same seed) then give the same tokens and the same
    accept lengths as the drafter as it was trained (a real drafter module, and a stub that is right
    half the time so that acceptance paths run too)."""
    import copy
    prompt = torch.randint(3, 320, (1, 8), generator=torch.Generator().manual_seed(3))
    if kind == "trained-shape":
        drafter = tiny_drafter(target, draft_vocab=200)
    else:
        oracle = prompt[0].tolist() + decode_plain(target, prompt, 30).tokens + [0] * 20
        drafter = OracleDrafter(DraftConfig.from_target(target.args, target.args.vocab_size), oracle, 0.5)
    fast = copy.deepcopy(drafter).optimize("eager")
    assert hasattr(fast.midlayer.mlp, "gate_up") and not hasattr(drafter.midlayer.mlp, "gate_up")
    spec = TreeSpec(3, 4, 10)

    def sampled_tree(draws):
        return lambda d: decode_tree(target, d, prompt, 30, dataclasses.replace(spec, draws=draws), temperature=0.8,
                                     top_p=0.9, generator=torch.Generator().manual_seed(0))
    for sampled, decode in ((False, lambda d: decode_chain(target, d, prompt, 30, 3)),
                            (False, lambda d: decode_tree(target, d, prompt, 30, spec)),
                            (True, sampled_tree("sample")), (True, sampled_tree("top"))):
        ref, got = decode(drafter), decode(fast)
        assert got.tokens == ref.tokens and got.accept_lengths == ref.accept_lengths
        assert kind == "trained-shape" or sampled or max(ref.accept_lengths) > 1  # the oracle drafts greedy text


def test_compiled_drafting_steps_trace_once_per_shape(target):
    """torch.compile traces each drafting step once per shape, over prompts of different lengths and every
    cycle, uncaptured as on the CPU: the first step of a prompt reads its last hidden row (strides of a
    transposed matmul), the others a cycle's, and the two are made the same layout; before that, the first
    cycle traced the step again with symbolic shapes, which every later cycle ran. Static shapes: a second
    tree shape gets its own trace, not a symbolic one, and more shapes than torch.compile's limit still run."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch._dynamo.reset()
    backend = EagerAndRecordGraphs()  # keeps the graphs it is given and runs them as traced
    drafter = tiny_drafter(target, draft_vocab=200).optimize(backend)
    ref = tiny_drafter(target, draft_vocab=200).optimize()
    drafter.setup_caches(1, 128)  # one cache for both prompts, as the bench sizes it (a new size is a new shape)
    for T in (8, 13):
        prompt = torch.randint(3, 320, (1, T), generator=torch.Generator().manual_seed(T))
        assert decode_chain(target, drafter, prompt, 24, 3).tokens == decode_chain(target, ref, prompt, 24, 3).tokens
        for spec in (TreeSpec(3, 4, 10), TreeSpec(2, 2, 4)):
            assert decode_tree(target, drafter, prompt, 24, spec).tokens == decode_tree(target, ref, prompt, 24, spec).tokens
    assert len(backend.graphs) == 2 + 2 * 2  # the chain's drafting and catch-up steps, then each tree shape's

    def symbolic(node):
        value = node.meta.get("example_value")
        return isinstance(value, torch.SymInt) or torch.is_tensor(value) and any(
            isinstance(n, torch.SymInt) for n in (*value.shape, *value.stride()))
    assert not any(symbolic(n) for g in backend.graphs for n in g.graph.nodes if n.op == "placeholder")
    for steps in range(2, 11):  # more shapes than torch.compile's 8 traces a code object, which fail a fullgraph step
        decode_tree(target, drafter, prompt, 8, TreeSpec(2, steps, 2 * steps))
    torch._dynamo.reset()


def test_hand_built_tree_mask_and_commit(target):
    """Each node's logits equal a plain forward over prefix + its path; after the commit the cache
    holds the accepted path contiguously, so decoding continues exactly as plain greedy does."""
    prompt = torch.randint(3, 320, (1, 6), generator=torch.Generator().manual_seed(3))
    plain = decode_plain(target, prompt, 6).tokens  # greedy continuation g0 g1 g2 ...
    g = plain
    #        root(g0)
    #       /    |     \
    #     g1     7      9
    #    /  \     \
    #  g2    5     11
    #  |
    #  13
    tree = DraftTree(tokens=torch.tensor([g[1], 7, 9, g[2], 5, 11, 13]),
                     parents=torch.tensor([-1, -1, -1, 0, 0, 1, 3]),
                     depth=torch.tensor([1, 1, 1, 2, 2, 2, 3]))
    T = prompt.shape[1]
    target.setup_caches(1, 64)
    target(prompt, torch.arange(T))
    n, bonus, aux, path = verify_tree(target, torch.tensor([g[0]]), tree, T, capture=(1,))
    assert n == 2 and path.tolist() == [g[1], g[2]] and int(bonus) == g[3]
    # node 13 (path g0 g1 g2 13): its hidden state must equal a plain forward over that sequence
    ref = tiny_native()
    ref.setup_caches(1, 64)
    seq = torch.cat([prompt[0], torch.tensor([g[0], g[1], g[2]])])[None]
    want = ref(seq, torch.arange(seq.shape[1]), capture=(1,))
    assert (aux[0, 2] - want.aux[0, -1]).abs().max() < 1e-4
    # the committed cache continues like plain decoding: feed the bonus token at the next slot
    h = target(bonus[None], torch.tensor([T + 3])).hidden
    assert int(target.logits(h[:, -1]).argmax(-1)) == g[4]


def test_tree_ancestor_matrix():
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, -1]), torch.tensor([1, 2, 1]))
    anc = tree.ancestors().int().tolist()
    assert anc == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]


def prefilled(target, drafter, prompt):
    """Target and drafter caches holding the prompt, as decoding has them before its first cycle:
    (the pending token, the drafter's output for the row before it)."""
    T = prompt.shape[1]
    target.setup_caches(1, 64)
    drafter.setup_caches(1, 64)
    pending, first = prefill(target, prompt, drafter.cfg.aux_layer_ids)
    h = drafter(torch.cat([prompt[0, 1:], pending])[None], drafter.fuse(first.aux), torch.arange(T))
    return pending, h[:, -1:]


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_device_drafting_picks_the_host_tree(target, spec):
    """Without ties (a random drafter), draft_greedy builds exactly draft_tree's tree: the same
    nodes in the same order, with the same parents and depths."""
    drafter = tiny_drafter(target, draft_vocab=200)
    for seed in range(2):
        prompt = torch.randint(3, 320, (1, 8), generator=torch.Generator().manual_seed(seed))
        _, h = prefilled(target, drafter, prompt)
        T = prompt.shape[1]
        host = draft_tree(drafter, h, T, spec)
        dev = draft_greedy(drafter, spec)(h, torch.tensor([T]))
        assert len(dev.tokens) == spec.nodes
        assert dev.tokens.tolist() == host.tokens.tolist()
        assert dev.parents.tolist() == host.parents.tolist() and dev.depth.tolist() == host.depth.tolist()


def test_device_drafting_keeps_whole_chains_under_ties(target):
    """A drafter that is always right with probability 1: every node on the true chain scores exactly
    0, a child ties its parent. The kept nodes still form a tree (each parent kept, listed before its
    children) and hold the chain, so with 3 nodes and 5 steps every cycle accepts 3 drafts."""
    prompt = torch.randint(3, 320, (1, 7), generator=torch.Generator().manual_seed(5))
    plain = decode_plain(target, prompt, 30)
    oracle = prompt[0].tolist() + plain.tokens + [0] * 20
    drafter = OracleDrafter(DraftConfig.from_target(target.args, target.args.vocab_size), oracle, 1.0)
    drafter.setup_caches(1, 64)
    T = prompt.shape[1]
    for spec in (TreeSpec(2, 5, 3), TreeSpec(3, 4, 10)):
        tree = draft_greedy(drafter, spec)(torch.full((1, 1, drafter.cfg.hidden_size), T - 1.0), torch.tensor([T]))
        parents, depth = tree.parents.tolist(), tree.depth.tolist()
        for i, (p, d) in enumerate(zip(parents, depth)):
            assert p < i and d == (1 if p < 0 else depth[p] + 1)
        node = -1
        for d in range(1, min(spec.steps, spec.nodes) + 1):  # the true chain, node by node
            node = next(i for i, p in enumerate(parents) if p == node and tree.tokens[i] == plain.tokens[d])
    out = decode_tree(target, drafter, prompt, 30, TreeSpec(2, 5, 3))
    assert out.tokens == plain.tokens and set(out.accept_lengths[:-1]) == {4}


def random_tree(gen: torch.Generator, n: int, vocab: int = 4) -> DraftTree:
    """n nodes, parents before children, siblings with distinct tokens from a small vocabulary."""
    parents, depth, tokens, used = [], [], [], {}
    for i in range(n):
        p = int(torch.randint(-1, i, (), generator=gen))
        free = [t for t in range(vocab) if t not in used.setdefault(p, set())]
        if not free:
            p, free = -1, [t for t in range(vocab + i + 1) if t not in used[-1]]
        tok = free[int(torch.randint(len(free), (), generator=gen))]
        used[p].add(tok)
        parents.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
        tokens.append(tok)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depth))


def test_device_acceptance_matches_the_host_walk():
    """accept_on_device == accept_tree_greedy on random trees whose target choices often match (small
    vocabulary), also with a depth bound larger than the tree's (rows past the path are the root)."""
    gen = torch.Generator().manual_seed(0)
    lengths = set()
    for _ in range(300):
        tree = random_tree(gen, int(torch.randint(1, 12, (), generator=gen)))
        best = torch.randint(0, 4, (len(tree.tokens) + 1,), generator=gen)
        path, bonus = accept_tree_greedy(best, tree)
        D = int(tree.depth.max()) + int(torch.randint(0, 3, (), generator=gen))
        n, rows = accept_on_device(best, tree, ancestors(tree.parents, D), D)
        assert n.tolist() == [len(path)] and rows.tolist() == [0] + path + [0] * (D - len(path))
        assert int(best[rows[n]]) == int(bonus)
        lengths.add(len(path))
    assert {0, 1, 2, 3} <= lengths


def test_device_verify_commits_the_path_and_keeps_live_slots(target):
    """verify_greedy on a hand-built tree accepting 2, 1 or 0 nodes (of depth up to 3): it returns the
    path and the bonus token; its fixed-size commit and catch-up leave the prefix slots of both caches
    untouched and make slots up to pos+n what plain causal passes over the accepted sequence write,
    and its drafter output is that of the catch-up row reading the bonus token."""
    drafter = tiny_drafter(target)
    prompt = torch.randint(3, 320, (1, 6), generator=torch.Generator().manual_seed(3))
    g = decode_plain(target, prompt, 6).tokens  # greedy continuation g0 g1 g2 ...
    T, spec = prompt.shape[1], TreeSpec(3, 3, 7)  # at most 7 nodes, depth 3: a 3-row commit, a 4-row catch-up
    x1, x2 = (g[1] + 1) % 320, (g[2] + 1) % 320
    for tokens, n_want in [([g[1], 7, 9, g[2], 5, 11, 13], 2), ([g[1], 7, 9, x2, 5, 11, 13], 1), ([x1, 7, 9, g[2], 5, 11, 13], 0)]:
        tree = DraftTree(torch.tensor(tokens), torch.tensor([-1, -1, -1, 0, 0, 1, 3]), torch.tensor([1, 1, 1, 2, 2, 2, 3]))
        pending, h = prefilled(target, drafter, prompt)
        draft_greedy(drafter, spec)(h, torch.tensor([T]))  # a cycle's drafting scribbles on the drafter's tree slots
        caches = [layer.self_attn.kv_cache for layer in target.layers] + [drafter.midlayer.self_attn.kv_cache]
        before = [(c.k.clone(), c.v.clone()) for c in caches]
        out, h, nxt, pos = verify_greedy(target, drafter, spec)(pending, tree.tokens, tree.parents, tree.depth, torch.tensor([T]))
        n = int(out[0])
        assert n == n_want and out[1 : n + 2].tolist() == g[1 : n + 2] and int(nxt) == g[n + 1] and int(pos) == T + n + 1
        # reference: causal passes over prompt + accepted tokens, in fresh caches
        seq = torch.cat([prompt[0], torch.tensor(g[: n + 1])])[None]  # (1, T+n+1)
        ref, ref_drafter = tiny_native(), tiny_drafter(target)
        ref.setup_caches(1, 64)
        ref_drafter.setup_caches(1, 64)
        aux = ref(seq, torch.arange(seq.shape[1]), capture=drafter.cfg.aux_layer_ids).aux
        ref_h = ref_drafter(torch.cat([seq[0, 1:], nxt])[None], ref_drafter.fuse(aux), torch.arange(seq.shape[1]))
        assert (h[0, -1] - ref_h[0, -1]).abs().max() < 1e-4
        refs = [layer.self_attn.kv_cache for layer in ref.layers] + [ref_drafter.midlayer.self_attn.kv_cache]
        live = T + n + 1
        for c, r, (k0, v0) in zip(caches, refs, before):
            assert torch.equal(c.k[:, :, :T], k0[:, :, :T]) and torch.equal(c.v[:, :, :T], v0[:, :, :T])
            assert (c.k[:, :, :live] - r.k[:, :, :live]).abs().max() < 1e-4
            assert (c.v[:, :, :live] - r.v[:, :, :live]).abs().max() < 1e-4


def test_device_steps_trace_as_one_graph(target):
    """The CPU stand-in for CUDA-graph capture: draft_greedy and verify_greedy trace whole under
    torch.compile(fullgraph=True), so they hold no host read (.item(), .tolist()), no data-dependent
    shape (nonzero, boolean-mask indexing) and no Python branch on tensor values."""
    drafter, spec = tiny_drafter(target, draft_vocab=200), TreeSpec(2, 3, 5)
    prompt = torch.randint(3, 320, (1, 8), generator=torch.Generator().manual_seed(0))
    pending, h = prefilled(target, drafter, prompt)
    pos = torch.tensor([prompt.shape[1]])
    try:
        with torch.no_grad():
            tree = torch.compile(draft_greedy(drafter, spec), backend="eager", fullgraph=True)(h, pos)
            assert tree.tokens.tolist() == draft_greedy(drafter, spec)(h, pos).tokens.tolist()
            out = torch.compile(verify_greedy(target, drafter, spec), backend="eager", fullgraph=True)(
                pending, tree.tokens, tree.parents, tree.depth, pos)
            assert out[0].shape == (min(spec.steps, spec.nodes) + 2,)
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_prefill_on_cuda_equals_one_eager_pass():
    """On CUDA prompts are prefilled in captured 256-token passes: a 300-token prompt (two passes, the
    second mostly padding) gives the eager pass's outputs (fp32), the drafter's prompt pass likewise, and
    plain and speculative decoding after them what they give after eager passes."""
    from draftsmith.cudagraph import Graphs
    from draftsmith.decode import draft_prompt, run_prompt

    target = tiny_native().cuda()
    drafter = tiny_drafter(target, draft_vocab=200).cuda()
    prompt = torch.randint(3, 320, (1, 300), generator=torch.Generator().manual_seed(6)).cuda()
    graphs, one_pass = Graphs(True), Graphs(True, prefill_chunk=0)
    assert graphs.prefill_chunk == 256
    target.setup_caches(1, 512)  # its max_position_embeddings: room for two 256-token passes
    capture = drafter.cfg.aux_layer_ids  # the drafter reads these layers' features (3 x hidden)
    outs = [run_prompt(target, prompt, capture, g) for g in (one_pass, graphs, graphs)]  # the last one replays
    for out in outs[1:]:
        torch.testing.assert_close(out.hidden, outs[0].hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.aux, outs[0].aux, rtol=1e-4, atol=1e-4)
    drafter.setup_caches(1, 512)
    h_one = draft_prompt(drafter, prompt, prompt[0, :1], outs[0].aux, one_pass)
    for _ in range(2):  # captured, then replayed: the drafter's prompt pass in 256-row passes
        torch.testing.assert_close(draft_prompt(drafter, prompt, prompt[0, :1], outs[0].aux, graphs), h_one, rtol=1e-4,
                                   atol=1e-4)
    plain = decode_plain(target, prompt, 40, graphs=one_pass)
    assert decode_plain(target, prompt, 40, graphs=graphs).tokens == plain.tokens
    assert decode_chain(target, drafter, prompt, 40, 3, graphs=graphs).tokens == plain.tokens
    assert decode_tree(target, drafter, prompt, 40, TreeSpec(4, 5, 16), graphs=graphs).tokens == plain.tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_graphed_speculation_on_cuda_equals_plain_and_syncs_once_per_cycle(mode):
    """On CUDA decode_chain's and decode_tree's two steps are captured as CUDA graphs (capture fails on
    any sync or host copy inside them; the chain's acceptance and drafter catch-up run inside its verify
    graph, verify_chain), the output equals plain greedy decoding in fp32, and once captured a cycle
    makes one synchronizing call, the host's read of its tokens (sync debug mode counts them)."""
    from draftsmith.cudagraph import Graphs

    target = tiny_native().cuda()
    prompt = torch.randint(3, 320, (1, 7), generator=torch.Generator().manual_seed(5)).cuda()
    plain = decode_plain(target, prompt, 60, graphs=Graphs(True))
    oracle = prompt[0].tolist() + plain.tokens + [0] * 20
    drafters = {"random": tiny_drafter(target, draft_vocab=200).cuda(),
                "oracle": OracleDrafter(DraftConfig.from_target(target.args, target.args.vocab_size), oracle, 0.6).cuda()}
    # (case, depth: the most drafts a cycle can accept, decode)
    cases = {"chain": [(k, k, lambda d, g, k=k: decode_chain(target, d, prompt, 60, k, graphs=g)) for k in (1, 3, 5)],
             "tree": [(spec, spec.steps, lambda d, g, spec=spec: decode_tree(target, d, prompt, 60, spec, graphs=g))
                      for spec in (TreeSpec(4, 5, 16), TreeSpec(2, 4, 3), TreeSpec(1, 3, 3), TreeSpec(3, 1, 2))]}[mode]
    for name, drafter in drafters.items():
        graphs = Graphs(True)
        for case, depth, decode in cases:
            assert decode(drafter, graphs).tokens == plain.tokens, (name, case)
            out, syncs = cuda_syncs(lambda: decode(drafter, graphs))
            assert out.tokens == plain.tokens
            assert syncs <= len(out.accept_lengths) + 3, (name, case, syncs, len(out.accept_lengths))  # + prefill's
            assert out.draft_seconds > 0 and out.verify_seconds > 0
            if name == "oracle":  # right at 60% of positions: some cycle gets past the first draft
                assert max(out.accept_lengths) > min(2, depth)


def test_tree_respects_eos_and_max_new(target):
    """Cuts inside an accepted path: an always-right drafter accepts several tokens per cycle."""
    prompt = torch.randint(3, 320, (1, 6), generator=torch.Generator().manual_seed(2))
    plain = decode_plain(target, prompt, 30)
    oracle = prompt[0].tolist() + plain.tokens + [0] * 20
    drafter = OracleDrafter(DraftConfig.from_target(target.args, target.args.vocab_size), oracle, 1.0)
    eos = plain.tokens[10]
    cut = plain.tokens[: plain.tokens.index(eos) + 1]
    spec = TreeSpec(2, 4, 6)
    assert decode_tree(target, drafter, prompt, 30, spec, eos_ids=(eos,)).tokens == cut
    for max_new in (1, 2, 13):
        assert decode_tree(target, drafter, prompt, max_new, spec).tokens == plain.tokens[:max_new]


# --------------------------------------------------------------------------- sampling

from draftsmith.decode import decode_chain_sampled, probs, speculative_accept  # noqa: E402


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_acceptance_rule_reproduces_the_target_distribution():
    torch.manual_seed(0)
    V, N = 6, 20000
    p = torch.softmax(torch.randn(2, V) * 2, -1)
    q = torch.softmax(torch.randn(1, V) * 2, -1)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    for _ in range(N):
        d = torch.multinomial(q[0], 1, generator=gen)
        n, nxt = speculative_accept(p, q, d, gen)
        counts[d[0] if n == 1 else nxt[0]] += 1
    assert total_variation(counts / N, p[0]) < 0.02
    assert total_variation(q[0], p[0]) > 0.2  # the drafter really was wrong, so rejections happened


def test_gumbel_sampling_is_exact_and_never_picks_a_zero_probability_token():
    from draftsmith.decode import gumbel_sample

    p = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    N = 20000
    tokens = gumbel_sample(p.expand(N, 5), torch.rand(N, 5, generator=torch.Generator().manual_seed(0)))
    assert total_variation(tokens.bincount(minlength=5) / N, p) < 0.015  # noise: ~0.004
    for x in (0.0, 1 - 2**-24, 1.0):  # the extremes of the uniforms, and 1 which [0, 1) never draws
        for u in (torch.full((1, 5), x), torch.tensor([[0.5, x, 0.5, 0.5, x]])):
            assert p[gumbel_sample(p[None], u)] > 0


def exact_joint(target, prompt: torch.Tensor, temp: float, top_p: float) -> torch.Tensor:
    """(V, V) the exact joint distribution of the 2nd and 3rd tokens the target samples after `prompt`,
    enumerated over every first and second token (a tiny vocabulary)."""
    V, T, dev = target.args.vocab_size, prompt.shape[1], prompt.device
    target.setup_caches(1, T)
    p1 = probs(target.logits(target(prompt, torch.arange(T, device=dev)).hidden[0, -1:]), temp, top_p)[0]  # (V,)
    x = torch.cartesian_prod(torch.arange(V, device=dev), torch.arange(V, device=dev))  # (V*V, 2) every x1 x2
    target.setup_caches(V * V, T + 2)
    h = target(torch.cat([prompt.expand(V * V, T), x], 1), torch.arange(T + 2, device=dev)).hidden
    p2 = probs(target.logits(h[::V, -2]), temp, top_p)  # (V, V): p(x2 | x1)
    p3 = probs(target.logits(h[:, -1]), temp, top_p).view(V, V, V)  # p(x3 | x1, x2)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).cpu()


def sampled_joint(target, prompt: torch.Tensor, temp: float, top_p: float, n: int, graphs=None) -> torch.Tensor:
    """(V, V) the empirical joint of the 2nd and 3rd tokens of n runs of decode_plain."""
    V = target.args.vocab_size
    gen, counts = torch.Generator(prompt.device).manual_seed(0), torch.zeros(V, V)
    for _ in range(n):
        tokens = decode_plain(target, prompt, 3, graphs=graphs, temperature=temp, top_p=top_p, generator=gen).tokens
        counts[tokens[1], tokens[2]] += 1
    return counts / n


@pytest.mark.parametrize("temp,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_plain_matches_the_targets_own_distribution(one_thread, monkeypatch, temp, top_p):
    """decode_plain at temperature > 0 samples every token after the first with gumbel_sample from
    uniforms drawn ahead (the graph-capturable way). On an 8-token vocabulary the joint of the 2nd
    and 3rd tokens matches the exact one, top-p's cut tokens never appear, and a wrong noise
    transform fails the same check."""
    import draftsmith.decode as decode

    target = tiny_native(vocab=8)
    prompt = torch.randint(3, 8, (1, 5), generator=torch.Generator().manual_seed(1))
    exact = exact_joint(target, prompt, temp, top_p)
    got = sampled_joint(target, prompt, temp, top_p, 600)
    assert total_variation(got, exact) < 0.17  # sampling noise: mean 0.12 and 0.08, 0.17 and 0.13 at the 1e-4 quantile
    if top_p < 1.0:
        assert (exact == 0).any() and got[exact == 0].sum() == 0
        monkeypatch.setattr(decode, "gumbel_sample", lambda p, u: (p * u).argmax(-1))  # argmax(log p + log u)
        assert total_variation(sampled_joint(target, prompt, temp, top_p, 300), exact) > 0.25


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_batched_greedy_reads_the_cache_in_windows_and_equals_one_at_a_time(monkeypatch, device):
    """generate_batch attends over the cache's first slots only, up to the next multiple of slot_window
    past the slot a step writes (the prefill over the prompt's): with windows of 4 slots, three left-padded
    prompts of different lengths get the same tokens as one-at-a-time greedy decoding and as the whole cache,
    and the steps did read different, shorter windows. An EOS that ends one row early leaves the others'
    tokens as they were (on CUDA, where each window is a captured graph, the batch is then compacted)."""
    import draftsmith.target as tgt
    from draftsmith.decode import cut_at_eos

    target = tiny_native().to(device)
    widths = []
    full = tgt.attention

    def seen(q, k, v, mask, *a, **kw):  # on CUDA called while a window's graph is captured
        widths.append((mask.shape[-1], k.shape[2]))
        return full(q, k, v, mask, *a, **kw)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (T,), generator=g).tolist() for T in (3, 9, 14)]
    plain = [decode_plain(target, torch.tensor([p], device=device), 25).tokens for p in prompts]
    monkeypatch.setattr(tgt, "attention", seen)
    assert generate_batch(target, prompts, 25, slot_window=4) == plain
    windows = {w for w, _ in widths}
    assert windows >= {16, 20, 24, 28, 32, 36} and max(windows) == 39 == widths[0][1]  # 14 + 25 slots
    widths.clear()
    assert generate_batch(target, prompts, 25, slot_window=0) == plain
    assert {w for w, _ in widths} == {39}
    eos = plain[0][8]  # ends the first row by its 9th token; compact_at 0.75: 2 of 3 live rows compact on CUDA
    cut = [cut_at_eos(p, (eos,)) for p in plain]
    assert len(cut[0]) <= 9 and any(len(c) == 25 for c in cut)
    assert generate_batch(target, prompts, 25, (eos,), slot_window=4, compact_at=0.75) == cut
    with pytest.raises(ValueError, match="slot_window"):
        generate_batch(target, prompts, 25, slot_window=-1)
    for bad in (0, 1, 1.5):  # the live share at which a CUDA batch is compacted
        with pytest.raises(ValueError, match="compact_at"):
            generate_batch(target, prompts, 25, compact_at=bad)


def batch_joint(target, prompts: list[torch.Tensor], temp: float, top_p: float, n: int) -> torch.Tensor:
    """(len(prompts), V, V) the empirical joint of the 2nd and 3rd tokens generate_batch samples after each
    prompt: n rows of every prompt in one left-padded batch."""
    V = target.args.vocab_size
    rows = [p[0].tolist() for p in prompts for _ in range(n)]
    answers = generate_batch(target, rows, 3, (), temp, top_p, torch.Generator(prompts[0].device).manual_seed(0))
    counts = torch.zeros(len(prompts), V, V)
    for i, a in enumerate(answers):
        counts[i // n, a[1], a[2]] += 1
    return counts / n


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_batched_sampling_matches_the_targets_own_distribution(monkeypatch, device):
    """generate_batch at temperature > 0 (how training answers are sampled) draws with gumbel_sample from
    uniforms the host draws per step, so on CUDA its steps are captured graphs like greedy ones. For two
    prompts of different lengths (left padding) in one batch, the joint of the 2nd and 3rd tokens matches
    each prompt's exact one and top-p's cut tokens never appear; a wrong noise transform fails."""
    import draftsmith.decode as decode

    target = tiny_native(vocab=8).to(device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 8, (1, T), generator=g).to(device) for T in (5, 3)]
    exact = [exact_joint(target, p, 0.7, 0.8) for p in prompts]
    got = batch_joint(target, prompts, 0.7, 0.8, 600)
    for i in range(len(prompts)):
        assert total_variation(got[i], exact[i]) < 0.17  # as test_sampled_plain_matches_the_targets_own_distribution
        assert (exact[i] == 0).any() and got[i][exact[i] == 0].sum() == 0
    if device == "cpu":
        monkeypatch.setattr(decode, "gumbel_sample", lambda p, u: (p * u).argmax(-1))  # argmax(log p + log u)
        assert min(total_variation(a, b) for a, b in zip(batch_joint(target, prompts, 0.7, 0.8, 300), exact)) > 0.25
        return

    def syncs(max_new):  # host syncs of a sampled batch of 4 rows that never stops early
        gen = torch.Generator(device).manual_seed(0)
        out, n = cuda_syncs(lambda: generate_batch(target, [prompts[0][0].tolist()] * 4, max_new, (), 0.8, 0.9, gen))
        assert [len(a) for a in out] == [max_new] * 4
        return n

    # captured steps: the host looks once per CHECK_EVERY steps (it used to after every sampled step)
    assert syncs(4 * decode.CHECK_EVERY) - syncs(decode.CHECK_EVERY) <= 6


def test_sampled_chain_matches_the_targets_own_distribution(monkeypatch):
    """Second generated token (the first that goes through speculation): the empirical distribution of
    speculative sampling vs the exact marginal sum_x1 p(x1) p(x2 | x1) of the target. The same test
    on a sampler that accepts every draft fails, so the check has the power to see a wrong rule."""
    import draftsmith.decode as decode

    target = tiny_native()
    target.lm_head.weight.mul_(6.0)  # peaked distributions: few categories, so 600 samples resolve them
    drafter = tiny_drafter(target, draft_vocab=200, seed=3)
    prompt = torch.randint(3, 320, (1, 5), generator=torch.Generator().manual_seed(1))
    temp, top_p = 1.0, 0.95
    T, V = prompt.shape[1], target.args.vocab_size
    target.setup_caches(1, T + 8)
    p1 = probs(target.logits(target(prompt, torch.arange(T)).hidden[0, -1:]), temp, top_p)[0]  # (V,)
    seqs = torch.cat([prompt.expand(V, T), torch.arange(V)[:, None]], dim=1)  # every possible x1
    target.setup_caches(V, T + 1)
    p2 = probs(target.logits(target(seqs, torch.arange(T + 1)).hidden[:, -1]), temp, top_p)  # (V, V)
    exact = p1 @ p2

    def second_token_tv(n=600):
        gen = torch.Generator().manual_seed(0)
        counts = torch.zeros(V)
        for _ in range(n):
            counts[decode_chain_sampled(target, drafter, prompt, 2, 2, temp, top_p, generator=gen).tokens[1]] += 1
        return total_variation(counts / n, exact)

    assert second_token_tv() < 0.14  # sampling noise alone is ~0.09 at 600 samples here
    monkeypatch.setattr(decode, "speculative_accept", lambda p, q, d, g=None: (len(d), torch.multinomial(p[-1], 1, generator=g)))
    assert second_token_tv() > 0.3


# --------------------------------------------------------------------------- sampled trees

from draftsmith.decode import decode_tree_sampled  # noqa: E402

from helpers import BigramDrafter, BigramTarget  # noqa: E402


@pytest.fixture
def one_thread():
    """These tests make thousands of calls on tensors of a few elements, where intra-op threads only
    add synchronisation (100x slower on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def first_child_always(p, tree, generator=None):
    """A wrong walk for the power checks: accept the first drafted child at every node."""
    kids, path, cur = tree.children(), [], 0
    while kids[cur]:
        cur = kids[cur][0]
        path.append(cur)
    return path, torch.multinomial(p[cur], 1, generator=generator)


def first_child_on_device(real):
    """The same wrong walk in the device acceptance: with "uniforms" of -1 the test u q(x) < r(x) always passes."""
    def accept(p, tree, rank, exists, qrow, q, draft_ids, u_nodes, u_vocab, depth, k):
        return real(p, tree, rank, exists, qrow, q, draft_ids, torch.full_like(u_nodes, -1.0), u_vocab, depth, k)
    return accept


def first_children(best, tree):
    """best (N+1,) with each node's entry replaced by its first child's token: a walk over it always
    accepts the first child (the power checks' wrong walk for trees drafted as at T=0)."""
    best = best.clone()
    for j in reversed(range(len(tree.parents))):
        best[int(tree.parents[j]) + 1] = tree.tokens[j]
    return best


def wrong_walk(monkeypatch, kind: str, draws: str = "sample"):
    import draftsmith.decode as decode

    if draws == "top":
        walk = decode.accept_tree_greedy if kind == "host" else decode.accept_on_device
        monkeypatch.setattr(decode, walk.__name__, lambda best, tree, *a: walk(first_children(best, tree), tree, *a))
    elif kind == "host":
        monkeypatch.setattr(decode, "accept_tree_sampled", first_child_always)
    else:
        monkeypatch.setattr(decode, "accept_sampled_on_device", first_child_on_device(decode.accept_sampled_on_device))


def scored_by_own_token(prefix: bool):
    """Wrong selections for the power checks (both tree samplers draw children with children_sampled):
    EAGLE-2's score log q(x) on sampled children, either as is (verified siblings need not be a prefix
    of the draw order) or made monotone over the draw order (a prefix, but of a length that depends on
    the children's own tokens)."""
    import draftsmith.decode as decode

    sampled = decode.children_sampled

    def children(q, parent_score, k, u):
        score, ids = sampled(q, parent_score, k, u)
        own = parent_score[:, None] + q.gather(-1, ids).log()
        own = own.cummin(-1).values if prefix else own
        return own.masked_fill(score.isneginf(), float("-inf")), ids
    return children


def tree_sampler(kind: str):
    """The device-resident sampled tree (decode_tree_sampled) or the host-driven reference (tree_loop)."""
    import draftsmith.decode as decode

    if kind == "device":
        return decode.decode_tree_sampled
    return lambda target, drafter, prompt, n, spec, temp, top_p=1.0, generator=None: decode.tree_loop(
        target, drafter, prompt, n, spec, (), decode.eager(), temp, top_p, generator)


@pytest.mark.parametrize("draws", ["sample", "top"])
@pytest.mark.parametrize("drafter_kind", ["random", "oracle"])
def test_sampled_tree_at_tiny_temperature_is_greedy(target, drafter_kind, draws):
    prompt = torch.randint(3, 320, (1, 7), generator=torch.Generator().manual_seed(5))
    plain = decode_plain(target, prompt, 40)
    if drafter_kind == "random":
        drafter, spec = tiny_drafter(target, draft_vocab=200), TreeSpec(4, 5, 16)
    else:
        oracle = prompt[0].tolist() + plain.tokens + [0] * 20
        drafter = OracleDrafter(DraftConfig.from_target(target.args, target.args.vocab_size), oracle, 0.7)
        spec = TreeSpec(2, 4, 8)
    spec = dataclasses.replace(spec, draws=draws)
    out = decode_tree_sampled(target, drafter, prompt, 40, spec, 1e-4, generator=torch.Generator().manual_seed(0))
    assert out.tokens == plain.tokens
    assert len(out.accept_lengths) >= 1 and out.draft_seconds > 0 and out.verify_seconds > 0
    if drafter_kind == "oracle":
        assert max(out.accept_lengths) > 2


@pytest.mark.parametrize("draws", ["sample", "top"])
@pytest.mark.parametrize("kind", ["device", "host"])
def test_sampled_tree_matches_the_targets_own_distribution(one_thread, monkeypatch, kind, draws):
    """Real tiny target (8-token vocabulary, so the exact marginals of the 2nd and 3rd tokens can be
    enumerated), a drafter over 5 of those tokens, top-p that cuts a token: the empirical marginals
    match, and a walk that always accepts the first child fails the same check. Both ways of drafting
    at T > 0 (TreeSpec.draws)."""
    V = 8
    target = tiny_native(vocab=V)
    drafter = tiny_drafter(target, draft_vocab=5, seed=3)
    prompt = torch.randint(3, V, (1, 5), generator=torch.Generator().manual_seed(1))
    temp, top_p, T = 1.0, 0.9, prompt.shape[1]
    target.setup_caches(1, T)
    p1 = probs(target.logits(target(prompt, torch.arange(T)).hidden[0, -1:]), temp, top_p)[0]  # (V,)
    x = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (V*V, 2) every x1 x2
    target.setup_caches(V * V, T + 2)
    h = target(torch.cat([prompt.expand(V * V, T), x], 1), torch.arange(T + 2)).hidden
    p2 = probs(target.logits(h[::V, -2]), temp, top_p)  # (V, V): p(x2 | x1)
    p3 = probs(target.logits(h[:, -1]), temp, top_p).view(V, V, V)  # p(x3 | x1, x2)
    exact2, exact3 = p1 @ p2, torch.einsum("a,ab,abc->c", p1, p2, p3)

    def marginals_tv(n):
        gen, spec = torch.Generator().manual_seed(0), TreeSpec(3, 3, 6, draws)
        counts = torch.zeros(2, V)
        for _ in range(n):
            tokens = tree_sampler(kind)(target, drafter, prompt, 3, spec, temp, top_p, generator=gen).tokens
            counts[0, tokens[1]] += 1
            counts[1, tokens[2]] += 1
        return total_variation(counts[0] / n, exact2), total_variation(counts[1] / n, exact3)

    assert max(marginals_tv(300)) < 0.14  # sampling noise: mean 0.055, 0.13 at the 1e-4 quantile
    wrong_walk(monkeypatch, kind, draws)
    assert marginals_tv(150)[0] > 0.3


def bigram_pair():
    """Target p and drafter q tables over tokens 0-2 (token 3 only starts the prompt, and is
    always followed by 0), chosen so that wrong selection rules show: after the draft order
    1, 0, 2 from q(.|0) and the rejection of 1, a rule that tries 0 but not 2 favours 0."""
    def table(rows):
        return torch.tensor(rows).log().clamp(min=-1e4)
    p = table([[.75, 0, .25, 0], [.2, .5, .3, 0], [.3, .3, .4, 0], [1, 0, 0, 0]])
    q = table([[.45, .4, .15, 0], [0, 1, 0, 0], [.3, .3, .4, 0], [1, 0, 0, 0]])
    return BigramTarget(p), BigramDrafter(q)


def bigram_tv(n: int, kind: str = "device", draws: str = "sample", spec: TreeSpec | None = None) -> tuple[float, float]:
    """TV distances of tokens 2-3 (jointly) and of token 2 from the exact target over n runs (of a 2x2x2 tree
    unless `spec`)."""
    target, drafter = bigram_pair()
    p = probs(target.table, 1.0)
    exact = p[0][:, None] * p  # (4, 4): x1 is always 0
    gen, prompt = torch.Generator().manual_seed(0), torch.tensor([[3]])
    spec = spec or TreeSpec(2, 2, 2, draws)
    counts = torch.zeros(4, 4)
    for _ in range(n):
        tokens = tree_sampler(kind)(target, drafter, prompt, 3, spec, 1.0, generator=gen).tokens
        counts[tokens[1], tokens[2]] += 1
    return total_variation(counts / n, exact), total_variation(counts.sum(1) / n, exact.sum(1))


@pytest.mark.parametrize("kind", ["device", "host"])
def test_sampled_tree_is_lossless_on_bigram_models(one_thread, monkeypatch, kind):
    """Stub models whose exact joint distribution is known: the sampler matches it; accepting the
    first child, or ranking by EAGLE-2's log q(x) (verified children not a prefix of the draw
    order), fails the same check."""
    import draftsmith.decode as decode

    joint, first = bigram_tv(2000, kind)
    assert joint < 0.06 and first < 0.045  # noise: means 0.015 and 0.008, 0.046 and 0.038 at the 1e-4 quantile
    with monkeypatch.context() as m:
        wrong_walk(m, kind)
        assert bigram_tv(300, kind)[1] > 0.25
    monkeypatch.setattr(decode, "children_sampled", scored_by_own_token(prefix=False))
    assert bigram_tv(300, kind)[1] > 0.12


def test_a_sampled_chain_on_the_device_is_lossless_on_bigram_models(one_thread, monkeypatch):
    """What bench runs for --mode chain at T > 0: the device-resident cycle with TreeSpec(1, k, k, "sample"),
    a chain of k drafts sampled from the drafter, each kept with probability min(1, p/q) (recursive
    rejection over one sibling is Leviathan's rule). The joint matches; always keeping the draft fails."""
    chain = TreeSpec(1, 2, 2, "sample")
    joint, first = bigram_tv(2000, spec=chain)
    assert joint < 0.06 and first < 0.045  # as the sampled tree's bounds (same counts, same exact table)
    wrong_walk(monkeypatch, "device")
    assert bigram_tv(300, spec=chain)[1] > 0.25


def test_the_chain_acceptance_is_the_walk_at_topk_1():
    """accept_sampled_chain (all depths tested at once) returns what accept_sampled_walk's loop does for a chain,
    from the same uniforms: n, the rows and the next token, over every outcome (each n from 0 to the depth,
    a tail the drafter could not draw) and a drafter close to or far from the target."""
    from draftsmith.decode import accept_sampled_chain, accept_sampled_walk

    V, Vd, D = 64, 24, 3
    seen_n, seen_missing = set(), False
    for seed in range(400):
        g = torch.Generator().manual_seed(seed)
        draft_ids = torch.randperm(V, generator=g)[:Vd].sort().values
        q = torch.distributions.Dirichlet(torch.full((Vd,), 0.3)).sample((D,))  # row d: depth d+1's draws
        x = torch.stack([torch.multinomial(q[d], 1, generator=g)[0] for d in range(D)])  # draft vocab
        qfull = torch.zeros(D, V).index_copy(1, draft_ids, q)
        noise = torch.distributions.Dirichlet(torch.full((V,), 0.3)).sample((D + 1,))
        mix = seed % 4 / 4  # 0: the target is the drafter (up to its last row), 0.75: far from it
        p = torch.cat([(1 - mix) * qfull + mix * noise[:D], noise[D:]])  # (D+1, V): root, nodes
        tree = DraftTree(draft_ids[x], torch.arange(-1, D - 1), torch.arange(1, D + 1))
        exists = torch.arange(D) < (D if seed % 5 else seed % 3 + 1)  # sometimes a tail that was not drawn
        qrow = torch.where(torch.arange(D) < D - 1, torch.arange(1, D + 1), -1)
        u_nodes, u_vocab = torch.rand(D + 1, generator=g), torch.rand(V, generator=g)
        chain = accept_sampled_chain(p, tree, exists, qrow, q, draft_ids, u_nodes, u_vocab, D)
        walk = accept_sampled_walk(p, tree, torch.zeros(D, dtype=torch.long), exists, qrow, q, draft_ids,
                                   u_nodes, u_vocab, D, 1)
        for a, b in zip(chain, walk):
            assert torch.equal(a, b), (seed, chain, walk)
        seen_n.add(int(chain[0]))
        seen_missing |= bool(int(chain[0]) == exists.sum() < D)
    assert seen_n == set(range(D + 1)) and seen_missing


@pytest.mark.parametrize("kind", ["device", "host"])
def test_the_greedy_tree_with_the_targets_own_draws_is_lossless_on_bigram_models(one_thread, monkeypatch, kind):
    """TreeSpec.draws "top": the tree is drafted as at T=0 and the target draws its own token at every
    node. The joint matches the exact one; always accepting the first child fails, and so does
    accepting a child that is the target's argmax rather than its draw (greedy acceptance with sampled
    bonus tokens, a tempting shortcut that favours the argmax)."""
    import draftsmith.decode as decode

    joint, first = bigram_tv(2000, kind, "top")
    assert joint < 0.06 and first < 0.045  # as the sampled tree's bounds (same counts, same exact table)
    with monkeypatch.context() as m:
        wrong_walk(m, kind, "top")
        assert bigram_tv(300, kind, "top")[1] > 0.2  # token 1 is always 0 then: 0.25 exactly
    walk = decode.accept_tree_greedy if kind == "host" else decode.accept_on_device
    last = {}  # the verify pass's distributions (the last probs() before the walk)

    def greedy_then_draw(best, tree, *a):  # the argmax where a child has it, else the draw
        argmax = last["p"].argmax(-1)
        matched = torch.zeros_like(best, dtype=torch.bool)
        for j in range(len(tree.parents)):
            matched[int(tree.parents[j]) + 1] |= bool(tree.tokens[j] == argmax[int(tree.parents[j]) + 1])
        return walk(torch.where(matched, argmax, best), tree, *a)
    real_probs = decode.probs

    def keep_probs(logits, *a, **kw):
        last["p"] = real_probs(logits, *a, **kw)
        return last["p"]
    monkeypatch.setattr(decode, "probs", keep_probs)
    monkeypatch.setattr(decode, walk.__name__, greedy_then_draw)
    assert bigram_tv(300, kind, "top")[1] > 0.1


@pytest.mark.parametrize("kind", ["device", "host"])
def test_a_prefix_whose_length_reads_the_childrens_tokens_is_detected(one_thread, monkeypatch, kind):
    """Verifying a prefix of the draw order is not enough: if the ranking reads the children's own
    draft probabilities (EAGLE-2's score made monotone over the draw order), whether the second
    child is tried depends on its token, and the output is biased (by ~0.085 here)."""
    import draftsmith.decode as decode

    monkeypatch.setattr(decode, "children_sampled", scored_by_own_token(prefix=True))
    assert bigram_tv(2000, kind)[1] > 0.05  # the correct sampler stays below 0.045 (previous test)


# --------------------------------------------------------------------------- graphs, captured on the CPU


class CapturedOnCPU(Graphs):
    """Graphs' CUDA path on the CPU: steps captured once per key into static buffers and replayed,
    every run of a step under CaptureRules, which fails on what a CUDA graph cannot hold."""

    def __init__(self):
        super().__init__(True)

    @staticmethod
    def capture(fn, inputs, clone: bool = True):
        static_in = [x.clone() for x in inputs] if clone else list(inputs)
        graph = Replay(fn, static_in)
        graph.replay()  # as the real capture's warm-up (Graphs.start loads the inputs again)
        return static_in, graph, graph.out


class Replay:
    def __init__(self, fn, static_in):
        self.fn, self.static_in, self.out = fn, static_in, None

    def replay(self):
        with CaptureRules():
            out = self.fn(*self.static_in)
        if self.out is None:
            self.out = out
        else:  # a graph's outputs are the same buffers at every replay
            copy_into(self.out, out)


def copy_into(buf, x):
    """Copy a step's outputs (tensors, tuples of them, dataclasses of tensors such as DraftTree) into buf."""
    if isinstance(x, torch.Tensor):
        buf.copy_(x)
    elif isinstance(x, tuple):
        for b, y in zip(buf, x):
            copy_into(b, y)
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            if getattr(x, f.name) is not None:
                copy_into(getattr(buf, f.name), getattr(x, f.name))


class CaptureRules(TorchDispatchMode):
    """Fails on a read of a tensor's value on the host (.item(), bool(), int(); .tolist() bypasses
    dispatch, so it is patched), on an output shape that depends on values (nonzero, boolean-mask
    indexing) and on a random draw: on CUDA the first two sync, which capture forbids, and a draw
    from the caller's generator inside a graph would replay the same numbers."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masked = name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])
        if name in ("_local_scalar_dense", "nonzero") or masked or draws(func, args, kwargs or {}):
            raise AssertionError(f"{func} inside a captured step")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.tolist = torch.Tensor.tolist
        torch.Tensor.tolist = no_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)


def draws(func, args, kwargs) -> bool:
    """Whether an op draws random numbers: a seeded op, unless it is one whose only draw is dropout and
    its dropout_p is 0 (SDPA, as the captured prefill runs it)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    return kwargs.get("dropout_p", args[i] if i < len(args) else 0.0) != 0


def no_tolist(tensor):
    raise AssertionError("tolist inside a captured step")


def test_capture_rules_catch_host_reads_and_random_draws():
    graphs, x = CapturedOnCPU(), torch.ones(1, 3)
    q = torch.ones(1, 1, 2, 4)
    for i, step in enumerate([lambda x: x.sum().item() * x, lambda x: torch.multinomial(x, 1), lambda x: x.tolist(),
                              lambda x: x[x > 0], lambda x: torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)]):
        with pytest.raises(AssertionError):
            graphs(("bad", i), step, x)
    assert torch.equal(graphs(("good",), lambda x: probs(x, 1.0, 0.9).argmax(-1), x), torch.zeros(1, dtype=torch.long))
    assert graphs(("no dropout",), lambda x: torch.nn.functional.scaled_dot_product_attention(q, q, q) * x[0, 0], x).shape == q.shape


def test_captured_sampling_steps_decode_as_eager(one_thread, target):
    """With graphs enabled (captured on the CPU) plain sampling runs in blocks of CHECK_EVERY steps
    that read uniforms the host drew ahead, and the sampled tree's drafter levels and verify pass
    are replayed steps: the same seed gives the same tokens (and accept lengths) as eager decoding,
    across blocks and at an EOS inside one; the sampled tree's whole cycle (draft, then verify with
    acceptance, commit and catch-up) is two replayed steps. (The CPU generator fills a (16, V) block with the numbers
    16 draws of (1, V) would give, so the uniforms are the same.)"""
    prompt = torch.randint(3, 320, (1, 8), generator=torch.Generator().manual_seed(3))
    graphs = CapturedOnCPU()

    def plain(g, **kw):
        return decode_plain(target, prompt, 40, graphs=g, temperature=0.8, top_p=0.9,
                            generator=torch.Generator().manual_seed(0), **kw).tokens

    ref = plain(None)
    assert plain(graphs) == ref and plain(eager()) == ref
    eos = ref[20]  # inside the second block of captured steps
    assert plain(graphs, eos_ids=(eos,)) == plain(None, eos_ids=(eos,)) == ref[: ref.index(eos) + 1]
    assert decode_plain(target, prompt, 40, graphs=graphs).tokens == decode_plain(target, prompt, 40).tokens
    drafter = tiny_drafter(target, draft_vocab=200)
    for draws in ("sample", "top"):
        runs = [decode_tree_sampled(target, drafter, prompt, 30, TreeSpec(3, 3, 6, draws), 0.8, 0.9,
                                    generator=torch.Generator().manual_seed(0), graphs=g) for g in (None, graphs)]
        assert runs[0].tokens == runs[1].tokens and runs[0].accept_lengths == runs[1].accept_lengths
    assert {key[0] for key in graphs.entries} == {"prefill", "draft_prompt", "plain_loop", "tree-draft", "tree-verify"}  # prompts in captured passes
    assert {key[1].draws for key in graphs.entries if key[0] == "tree-verify"} == {"sample", "top"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_sampling_on_cuda_keeps_the_distribution():
    """On CUDA, sampled plain decoding and the sampled tree's steps are captured as CUDA graphs (capture
    fails on a sync or a random draw inside them). Plain sampling keeps the target's joint distribution
    and syncs once per further CHECK_EVERY tokens; the sampled tree gives eager's tokens for the same
    seed (its randomness is drawn outside the graphs, which compute what eager kernels do)."""
    from draftsmith.decode import CHECK_EVERY

    small = tiny_native(vocab=8).cuda()
    prompt = torch.randint(3, 8, (1, 5), generator=torch.Generator().manual_seed(1)).cuda()
    got = sampled_joint(small, prompt, 0.7, 0.8, 600, Graphs(True))
    assert total_variation(got, exact_joint(small, prompt, 0.7, 0.8)) < 0.17
    target, graphs = tiny_native().cuda(), Graphs(True)
    prompt = torch.randint(3, 320, (1, 7), generator=torch.Generator().manual_seed(5)).cuda()
    gen = torch.Generator("cuda").manual_seed(0)

    def syncs(max_new):
        out, n = cuda_syncs(lambda: decode_plain(target, prompt, max_new, graphs=graphs, temperature=0.8, top_p=0.9,
                                                 generator=gen))
        assert len(out.tokens) == max_new
        return n

    decode_plain(target, prompt, 4 * CHECK_EVERY + 1, graphs=graphs, temperature=0.8, top_p=0.9, generator=gen)  # capture
    assert syncs(4 * CHECK_EVERY + 1) - syncs(CHECK_EVERY + 1) <= 3  # 4 blocks of steps against 1
    drafter = tiny_drafter(target, draft_vocab=200).cuda()
    for draws in ("sample", "top"):
        runs = [decode_tree_sampled(target, drafter, prompt, 60, TreeSpec(4, 5, 16, draws), 0.8, 0.9,
                                    generator=torch.Generator("cuda").manual_seed(0), graphs=g) for g in (None, graphs)]
        assert runs[0].tokens == runs[1].tokens and runs[0].accept_lengths == runs[1].accept_lengths
    # the device-resident cycle ran under graphs (decode_tree's sampled draft and verify steps), not the host loop
    assert {key[0] for key in graphs.entries if "sampled" in key} == {"tree-draft", "tree-verify"}


def test_captured_greedy_chain_and_tree_decode_as_eager(target):
    """Greedy chain and tree decoding with graphs enabled (captured on the CPU, where a host read,
    a value-dependent shape or a random draw inside a step fails): the same tokens and accept lengths
    as eager decoding. The tree queues each next draft before reading the verified tokens, so a
    replayed draft must take the verify step's device outputs, not the host's view of them."""
    prompt = torch.randint(3, 320, (1, 8), generator=torch.Generator().manual_seed(4))
    oracle = prompt[0].tolist() + decode_plain(target, prompt, 40).tokens + [0] * 20
    drafter = OracleDrafter(DraftConfig.from_target(target.args, target.args.vocab_size), oracle, 0.6)
    for decode in (lambda g: decode_chain(target, drafter, prompt, 40, 3, graphs=g),
                   lambda g: decode_tree(target, drafter, prompt, 40, TreeSpec(2, 4, 6), graphs=g)):
        ref, got = decode(None), decode(CapturedOnCPU())
        assert got.tokens == ref.tokens and got.accept_lengths == ref.accept_lengths
        assert max(ref.accept_lengths) > 1
