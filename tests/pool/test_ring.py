"""The agents' recent windows (polykv.pool.ring) at the AgentCache level, without a model: every
forward's attention against an independent torch oracle — plain softmax over the dequantised rows,
each query's own last R suffix rows taken from q8_0 of the true rows, the prefix and older suffix
rows from the pool's codecs — through prompts (left-padded, longer than the ring), decode steps,
verify-shaped steps with rollback, slot moves, a deep truncate, reset and ring growth; full and
sliding layers, InnerQ keys."""

from types import SimpleNamespace

import pytest
import torch

from polykv.cache.layer import CompressedLayer
from polykv.codecs import get_codec
from polykv.pool.agent_cache import AgentCache

Hkv, G_HEADS, D = 2, 2, 64
SCALE = D ** -0.5
PAGE = 16  # suffix page rows (test_ring_triton.py: 64, the kernels' row tile)
TOL = 1e-4  # torch reference vs oracle: float rounding (test_ring_triton.py: the kernels' fp16 tolerance)


def q8(x):
    c = get_codec("q8_0", D)
    return c.decode(c.encode(x)).float()


def main_codec(x, codec, s=None):
    """What the pool's codec gives back for true rows x [..., Hkv, T, D] (InnerQ: stored x * s)."""
    if s is None:
        return codec.decode(codec.encode(x)).float()
    return codec.decode(codec.encode(x * s[:, None, :])).float() / s[:, None, :]


class Oracle:
    """Each slot's true suffix rows per layer and which positions were refilled from the pages."""

    def __init__(self, layers):
        self.layers = layers  # [(k_codec, v_codec, s, window, R, prefix (k, v) true-space decoded, start)]
        self.rows = {}  # slot -> per layer list of (k [Hkv, D], v [Hkv, D])
        self.refilled = {}  # slot -> set of positions read as q8(main(row))

    def attend(self, li, q, slot, n_q, doc_len):
        """Expected out [Hq, n_q, D] of the agent in `slot` whose rows are all written."""
        kc, vc, s, W, R, (pk, pv), start = self.layers[li]
        rows = self.rows[slot][li]
        L = len(rows)
        sk = torch.stack([r[0] for r in rows], 1)  # [Hkv, L, D]
        sv = torch.stack([r[1] for r in rows], 1)
        main_k, main_v = main_codec(sk, kc, s), main_codec(sv, vc)
        ring_k, ring_v = q8(sk), q8(sv)
        for p in self.refilled.get(slot, set()):
            if p < L:
                ring_k[:, p], ring_v[:, p] = q8(main_k[:, p]), q8(main_v[:, p])
        out = torch.zeros(q.shape[0], n_q, D)
        for j in range(n_q):
            p = L - n_q + j
            keys, vals = [], []
            a = doc_len + p
            for i in range(pk.shape[1]):
                if W is None or start + i > a - W:
                    keys.append(pk[:, i]), vals.append(pv[:, i])
            for i in range(p + 1):
                if W is not None and doc_len + i <= a - W:
                    continue
                src_k, src_v = (ring_k, ring_v) if i > p - R else (main_k, main_v)
                keys.append(src_k[:, i]), vals.append(src_v[:, i])
            K, V = torch.stack(keys, 1), torch.stack(vals, 1)  # [Hkv, n, D]
            K, V = K.repeat_interleave(G_HEADS, 0), V.repeat_interleave(G_HEADS, 0)
            w = torch.softmax(torch.einsum("hd,hnd->hn", q[:, j].float(), K) * SCALE, -1)
            out[:, j] = torch.einsum("hn,hnd->hd", w, V)
        return out


def make(kinds, recent, P=23, seed=0, capacity=2):
    """An AgentCache over a document of P tokens; kinds: per layer (k, v, innerq?, window)."""
    torch.manual_seed(seed)
    doc_layers, starts, windows, olayers = [], [], [], []
    for kn, vn, innerq, W in kinds:
        kc, vc = get_codec(kn, D), get_codec(vn, D)
        s = (torch.rand(Hkv, D) + 0.5) if innerq else None
        keep = P if W is None else min(P, W - 1)
        k, v = torch.randn(1, Hkv, keep, D), torch.randn(1, Hkv, keep, D)
        lay = CompressedLayer.for_types(kn, vn, D, 1, Hkv, "cpu", s)
        lay.append(k, v)
        doc_layers.append(lay)
        starts.append(P - keep)
        windows.append(W)
        pk = kc.decode(lay.keys())[0].float() / (1 if s is None else s[:, None, :])
        pv = vc.decode(lay.values())[0].float()
        R = recent if W is None else min(recent, W - 1)
        olayers.append((kc, vc, s, W, R, (pk, pv), P - keep))
    cache = AgentCache(doc_layers, starts, P, windows, batch_capacity=capacity, seq_capacity=4,
                       page_size=PAGE, recent=recent)
    return cache, Oracle(olayers)


def forward(cache, oracle, slots, counts, n_q, seed):
    """One forward: random rows for each slot's counts[i] new tokens; checks every real query."""
    g = torch.Generator().manual_seed(seed)
    cache.begin(slots, counts, n_q)
    for slot, c in zip(slots, counts):
        oracle.rows.setdefault(slot, [[] for _ in cache.store])
    outs = []
    for li in range(len(cache.store)):
        k = torch.randn(len(slots), Hkv, n_q, D, generator=g)
        v = torch.randn(len(slots), Hkv, n_q, D, generator=g)
        q = torch.randn(len(slots), Hkv * G_HEADS, n_q, D, generator=g)
        for i, (slot, c) in enumerate(zip(slots, counts)):
            oracle.rows[slot][li] += [(k[i, :, j], v[i, :, j]) for j in range(n_q - c, n_q)]
        cache.update(k, v, li)
        outs.append((q, cache.attend(SimpleNamespace(layer_idx=li), q, None, None, None, scaling=SCALE)))
    cache.commit()
    for li, (q, out) in enumerate(outs):
        for i, (slot, c) in enumerate(zip(slots, counts)):
            want = oracle.attend(li, q[i], slot, n_q, cache.doc_len)
            got = out[i].transpose(0, 1)  # [Hq, n_q, D]
            torch.testing.assert_close(got[:, n_q - c:], want[:, n_q - c:], rtol=TOL, atol=TOL,
                                       msg=lambda m: f"layer {li} slot {slot}: {m}")


def rollback(cache, oracle, slots, cuts):
    cache.rollback(slots, cuts)
    for slot, m in zip(slots, cuts):
        for rows in oracle.rows[slot]:
            del rows[len(rows) - m:]


def move(cache, oracle, src, dst):
    cache.move_slot(src, dst)
    oracle.rows[dst] = oracle.rows.pop(src)
    oracle.refilled[dst] = oracle.refilled.pop(src, set())


FULL = ("q8_0", "turbo3", False, None)
INNERQ = ("turbo4", "q4_0", True, None)
SLIDING = ("turbo4", "turbo3", True, 8)


@pytest.mark.parametrize("kinds,recent", [
    ([FULL, SLIDING], 4),
    ([INNERQ, SLIDING], 3),
    ([FULL], 1),
    ([SLIDING, INNERQ], 12),  # R past the sliding window: 7 there, 12 on the full layer
])
def test_window_equals_oracle(kinds, recent):
    cache, oracle = make(kinds, recent, seed=recent)
    step = iter(range(1000))
    # prompts of 5, 1 and 11 tokens in one left-padded forward (11 > R + spare: written partly)
    cache.reserve(3)
    forward(cache, oracle, [0, 1, 2], [5, 1, 11], 11, next(step))
    for _ in range(3):  # decode steps: the windows slide
        forward(cache, oracle, [0, 1, 2], [1, 1, 1], 1, next(step))
    cache.reserve_ring_spare(3)  # verify steps of up to 3 drafts (the ring's rows relaid)
    forward(cache, oracle, [0, 1, 2], [4, 2, 1], 4, next(step))  # pending token + drafts, left-padded
    rollback(cache, oracle, [0, 1], [3, 1])  # rejected drafts: the windows must read as before
    forward(cache, oracle, [0, 1, 2], [1, 1, 1], 1, next(step))
    forward(cache, oracle, [0, 1, 2], [4, 4, 4], 4, next(step))
    rollback(cache, oracle, [0, 1, 2], [3, 2, 0])
    forward(cache, oracle, [0, 1, 2], [2, 1, 3], 3, next(step))  # a multi-token feed
    # remove the agent in slot 0: the last slot moves in (its window with it)
    move(cache, oracle, 2, 0)
    cache.clear_slot(2)
    oracle.rows.pop(2, None)
    forward(cache, oracle, [0, 1], [1, 1], 1, next(step))
    forward(cache, oracle, [0, 1, 2], [1, 1, 6], 6, next(step))  # a new agent in slot 2
    for _ in range(2):
        forward(cache, oracle, [0, 1, 2], [1, 1, 1], 1, next(step))
    forward(cache, oracle, [2, 0], [1, 1], 1, next(step))  # slots out of order (a host index)
    forward(cache, oracle, [1], [1], 1, next(step))


def test_deep_cut_refills_from_the_pages():
    """`truncate` / `rollback` deeper than the spare rows + 1: the positions the cut rows overwrote come back from
    the pages (codec, then q8_0), the rest of the window keeps its exact q8_0 rows."""
    cache, oracle = make([FULL, SLIDING], 4, seed=7)
    forward(cache, oracle, [0, 1], [9, 3], 9, 0)
    for i in range(6):
        forward(cache, oracle, [0, 1], [1, 1], 1, 1 + i)
    L = int(cache.lens[0])  # 15 rows; the ring held positions 11..14 (C = 4)
    cache.truncate(0, L - 3)  # 12 rows: positions 8..11 needed, 8..10 overwritten by 12..14
    for rows in oracle.rows[0]:
        del rows[L - 3:]
    oracle.refilled[0] = {8, 9, 10}
    rollback(cache, oracle, [1], [2])  # 9 -> 7 rows: 3..6 needed, 3..4 overwritten by 7..8
    oracle.refilled[1] = {3, 4}
    forward(cache, oracle, [0, 1], [1, 1], 1, 10)
    forward(cache, oracle, [0, 1], [1, 1], 1, 11)


def test_reset_starts_windows_fresh():
    """A parked cache's `reset` keeps the ring storage: new agents must not read old rows."""
    cache, oracle = make([FULL, SLIDING], 5, seed=3)
    forward(cache, oracle, [0, 1], [7, 2], 7, 0)
    forward(cache, oracle, [0, 1], [1, 1], 1, 1)
    cache.reset()
    oracle.rows.clear()
    forward(cache, oracle, [0, 1], [2, 3], 3, 2)
    forward(cache, oracle, [0, 1], [1, 1], 1, 3)


def test_ring_bytes_are_real_tensors():
    """tensors() holds the windows: K and V q8_0 rows [Hkv, slots * (R + spare) + 1] per layer
    (layers of one shape as views of one tensor: their distinct storages counted)."""
    from polykv.cache.accounting import storage_bytes

    cache, _ = make([FULL, SLIDING], 6, capacity=3)
    row = get_codec("q8_0", D).encode(torch.randn(1, D)).nbytes()  # 34 bytes: 32 int8 + fp16 scale
    want = sum(2 * Hkv * (3 * R + 1) * row for R in (6, 6))  # the sliding layer's R: min(6, 7)
    assert storage_bytes(cache.ring_tensors()) == want
    assert set(map(id, cache.ring_tensors())) <= set(map(id, cache.tensors()))
    before = cache.storage_version
    cache.reserve_ring_spare(2)  # reallocated: captured steps must see a new storage version
    assert cache.storage_version != before
    assert storage_bytes(cache.ring_tensors()) == \
        sum(2 * Hkv * (3 * (R + 2) + 1) * row for R in (6, 6))


def test_no_window_no_ring():
    cache, _ = make([FULL, SLIDING], 0)
    assert cache.rings is None and cache.ring_tensors() == []
    with pytest.raises(ValueError):
        make([FULL], -1)


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_indices_follow_their_definition(path, monkeypatch):
    """`AgentRings._indices` (the forward's ring rows: few torch ops, or one launch of
    `triton_ring._ring_index_kernel` — here through Triton's interpreter) against their
    definition element by element: segment row i of agent g at position L - W + i (W = R - 1 + n_q)
    lives in ring row slot * C + position mod C; column j (position L - n_q + j) is real where its
    page row is not the pages' scratch row, and is stored where real and among the newest C rows,
    else at the scratch row; kv_start = clamp(W - L, 0, W); older = max(L - R, 0). Slots as a slice
    and as a tensor; prompts longer than the ring (n_q > C) and segments that start before the
    agent's first row included."""
    from polykv.kernels import dispatch
    from polykv.pool.ring import AgentRings

    if path == "triton":
        monkeypatch.setenv("POLYKV_TRITON_ON_CPU", "1")
        monkeypatch.delenv("POLYKV_FORCE_REFERENCE", raising=False)
        dispatch._k()
    launched = []
    if path == "triton":
        from polykv.kernels import triton_ring

        run = triton_ring.ring_indices_triton
        monkeypatch.setattr(triton_ring, "ring_indices_triton", lambda *a: launched.append(1) or run(*a))

    g = torch.Generator().manual_seed(3)
    cases = [(1, 4, 6), (3, 4, 8), (9, 3, 4), (12, 8, 10), (5, 1, 2)]
    for (n_q, R, C), ranged in zip(cases, (False, True, False, True, False)):
        G, W, scratch, page_scratch = 4, R - 1 + n_q, 10_000, 777
        # a decode step's consecutive slots (a slice), or any slots
        slots = slice(3, 3 + G) if ranged else torch.randperm(9, generator=g)[:G]
        lens = torch.randint(0, 3 * W, (G,), generator=g, dtype=torch.int32)
        real = torch.rand(G, n_q, generator=g) > 0.25
        page_rows = torch.where(real, torch.randint(0, 700, (G, n_q), generator=g), page_scratch)
        gather, rows, kv_start, r, older = AgentRings._indices(slots, lens, page_rows, page_scratch,
                                                               n_q, R, C, scratch, "cpu")
        for a in range(G):
            s, L = (3 + a if ranged else int(slots[a])), int(lens[a])
            assert gather[a].tolist() == [s * C + (L - W + i) % C for i in range(W)]
            assert rows[a].tolist() == [s * C + (L - n_q + j) % C if real[a, j] and L - n_q + j >= L - C
                                        else scratch for j in range(n_q)]
            assert int(kv_start[a]) == min(max(W - L, 0), W) and kv_start.dtype == torch.int32
            assert int(older[a]) == max(L - R, 0) and older.dtype == torch.int32
        assert torch.equal(r, real)
        assert gather.dtype == rows.dtype == torch.int64
    assert len(launched) == (5 if path == "triton" else 0)


def test_cut_into_the_spare_rows_decodes_nothing(monkeypatch):
    """A rollback of at most `spare` rows (rejected drafts) finds every window position held: no
    page is decoded (the per-layer search was ~1 ms of a 32-agent verify step's host time); a
    deeper cut still refills from the pages."""
    cache, oracle = make([FULL, SLIDING], 4, seed=5)
    forward(cache, oracle, [0, 1], [9, 3], 9, 0)
    cache.reserve_ring_spare(3)
    forward(cache, oracle, [0, 1], [4, 4], 4, 1)
    decoded = []
    real = type(cache)._decode_suffix_rows
    monkeypatch.setattr(type(cache), "_decode_suffix_rows",
                        lambda self, li, slot, pos: decoded.append((slot, pos)) or real(self, li, slot, pos))
    rollback(cache, oracle, [0, 1], [3, 2])
    assert decoded == []
    forward(cache, oracle, [0, 1], [1, 1], 1, 2)  # the windows read as before the drafts
    forward(cache, oracle, [0, 1], [4, 4], 4, 3)
    rollback(cache, oracle, [1], [4])  # one row past the spare ones: the window's oldest refilled
    assert decoded and {s for s, _ in decoded} == {1}
    oracle.refilled[1] = {p for _, pos in decoded for p in pos}
    forward(cache, oracle, [0, 1], [1, 1], 1, 4)
