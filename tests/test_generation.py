import pytest
import torch

from polykv.generation import Sampler, SamplingParams, StopChecker, sample_token


def test_greedy_is_argmax():
    lg = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_token(lg, SamplingParams(temperature=0.0)) == 1
    assert sample_token(lg, SamplingParams(temperature=1.5, top_k=1)) == 1


def test_seeded_sampler_is_reproducible_and_private():
    lg = torch.randn(1000)
    p = SamplingParams(temperature=1.0, seed=1234)
    a = Sampler(p)
    b = Sampler(p)
    seq_a = [a(lg) for _ in range(20)]
    # interleave another request's draws: b must not be affected by anything else
    other = Sampler(SamplingParams(temperature=1.0, seed=99))
    seq_b = []
    for _ in range(20):
        other(lg)
        torch.rand(3)  # global RNG use must not matter either
        seq_b.append(b(lg))
    assert seq_a == seq_b
    c = Sampler(SamplingParams(temperature=1.0, seed=1235))
    assert [c(lg) for _ in range(20)] != seq_a


def test_top_k_restricts_support():
    lg = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    s = Sampler(SamplingParams(temperature=5.0, top_k=2, seed=0))
    assert {s(lg) for _ in range(200)} == {0, 1}


def test_top_p_restricts_support():
    # probs ~ [0.64, 0.23, 0.09, 0.03, ...]: top_p=0.8 keeps the first two only
    lg = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=0))
    assert {s(lg) for _ in range(300)} == {0, 1}
    # tiny top_p keeps the most likely token only
    s = Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=0))
    assert {s(lg) for _ in range(50)} == {0}


def test_temperature_sharpens():
    lg = torch.tensor([1.0, 0.0])
    cold = Sampler(SamplingParams(temperature=0.05, seed=0))
    assert sum(cold(lg) == 0 for _ in range(200)) == 200
    hot = Sampler(SamplingParams(temperature=100.0, seed=0))
    n0 = sum(hot(lg) == 0 for _ in range(400))
    assert 120 < n0 < 280


def test_distribution_matches_softmax():
    lg = torch.tensor([0.0, 1.0, 2.0])
    s = Sampler(SamplingParams(temperature=1.0, seed=7))
    n = 6000
    counts = torch.bincount(torch.tensor([s(lg) for _ in range(n)]), minlength=3).float() / n
    assert torch.allclose(counts, torch.softmax(lg, 0), atol=0.03)


def test_nonfinite_logits_fall_back():
    lg = torch.full((4,), float("-inf"))
    lg[2] = 0.0
    assert sample_token(lg, SamplingParams(temperature=1.0, top_p=0.5, top_k=3)) == 2


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1.0),
                                 dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(stop=[""])])
def test_validate_rejects(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()


def _run_stop(stops, pieces):
    sc = StopChecker(stops)
    out = []
    for p in pieces:
        emit, stopped = sc.push(p)
        out.append(emit)
        if stopped:
            return "".join(out), True
    out.append(sc.flush())
    return "".join(out), False


def test_stop_strings_across_deltas():
    assert _run_stop(["END"], ["hello E", "N", "D more"]) == ("hello ", True)
    assert _run_stop(["END"], ["hello E", "N", "x"]) == ("hello ENx", False)
    assert _run_stop(["\n\n", "###"], ["a\n", "b#", "##c"]) == ("a\nb", True)
    assert _run_stop([], ["a", "b"]) == ("ab", False)
    # held-back prefix is flushed at the end
    assert _run_stop(["STOP"], ["abc ST"]) == ("abc ST", False)


# --- the one EOS rule -------------------------------------------------------------------------


class _VocabTok:
    """Duck-typed tokenizer: an eos id and a vocabulary."""

    def __init__(self, eos=None, vocab=None):
        self.eos_token_id = eos
        self._vocab = dict(vocab or {})

    def get_vocab(self):
        return dict(self._vocab)


def _model(gen_eos=None, cfg_eos=None):
    from types import SimpleNamespace

    return SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=gen_eos),
                           config=SimpleNamespace(eos_token_id=cfg_eos))


def test_stop_token_ids_is_the_union_of_every_source():
    from polykv.generation import stop_token_ids

    vocab = {"a": 3, "<|im_end|>": 9, "<end_of_turn>": 10, "<|eot_id|>": 11, "<|im_start|>": 12}
    got = stop_token_ids(_VocabTok(eos=2, vocab=vocab), _model(gen_eos=[4, 5], cfg_eos=6))
    assert got == {2, 4, 5, 6, 9, 10, 11}
    assert stop_token_ids(_VocabTok(eos=2), None) == {2}
    assert stop_token_ids(_VocabTok(vocab={"<end_of_turn>": 106}), _model(gen_eos=1)) == {1, 106}
    assert stop_token_ids(_VocabTok(), _model(gen_eos=True, cfg_eos=[None])) == frozenset()


def test_stop_token_ids_reads_the_text_config():
    from transformers import Gemma3Config, Gemma3TextConfig

    from polykv.generation import stop_token_ids

    cfg = Gemma3Config(text_config=Gemma3TextConfig(vocab_size=64, eos_token_id=[1, 7]).to_dict())

    class M:
        config = cfg
        generation_config = None

    assert stop_token_ids(_VocabTok(), M()) == {1, 7}


def test_find_stop_is_the_earliest_occurrence():
    from polykv.generation import find_stop

    assert find_stop("abc END xyz STOP", ["STOP", "END"]) == 4
    assert find_stop("a ENSTOPD", ["END", "STOP"]) == 4
    assert find_stop("abc", ["x", ""]) == -1
    assert find_stop("abc", []) == -1


# --- choose_tokens: per-row parameters and counter-based draws (the engine's device path) -------


def _lowbias32(x: int) -> int:
    m = 0xFFFFFFFF
    x &= m
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def _rows(G, temperature=1.0, top_p=1.0, top_k=0, seed=0, index=0):
    """Per-row argument tensors of choose_tokens; scalars broadcast, lists taken as rows."""
    def col(v, dtype):
        return torch.as_tensor(v if isinstance(v, list) else [v] * G, dtype=dtype)

    seeds = col(seed, torch.int64)
    return dict(temperature=col(temperature, torch.float32), top_p=col(top_p, torch.float32),
                top_k=col(top_k, torch.int64), seed_lo=seeds & 0xFFFFFFFF, seed_hi=seeds >> 32,
                index=col(index, torch.int64))


def test_hash32_is_exact_lowbias32():
    from polykv.generation import hash32

    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF, 2**40 + 7]
    assert hash32(torch.tensor(xs)).tolist() == [_lowbias32(x) for x in xs]


def test_choose_tokens_greedy_rows_are_argmax():
    from polykv.generation import choose_tokens

    torch.manual_seed(0)
    lg = (torch.randn(7, 301) * 4).to(torch.bfloat16)
    # rows 0, 3 greedy by temperature, row 5 by top_k == 1; the rest sample
    t = [0.0, 1.0, 0.7, 0.0, 2.0, 1.5, 1.0]
    k = [0, 0, 20, 5, 0, 1, 0]
    ids = choose_tokens(lg, **_rows(7, temperature=t, top_k=k, top_p=[1, 1, .9, 1, 1, .5, 1], seed=list(range(7))))
    best = torch.argmax(lg.float(), dim=-1)
    for r in (0, 3, 5):
        assert int(ids[r]) == int(best[r])
    allg = choose_tokens(lg, **_rows(7, temperature=0.0, seed=list(range(7))))
    assert torch.equal(allg, best)


def test_choose_tokens_row_is_independent_of_its_neighbours():
    """A seeded row draws the same token alone and in a batch with other rows (other params, other
    positions), at every token index; other seeds give other tokens."""
    from polykv.generation import choose_tokens

    torch.manual_seed(1)
    mine = torch.randn(1000)
    others = torch.randn(5, 1000) * 2
    seq_alone, seq_batch = [], []
    for idx in range(12):
        seq_alone.append(int(choose_tokens(mine[None], **_rows(1, 0.9, 0.95, 50, 2**40 + 17, idx))[0]))
        lg = torch.cat([others[:3], mine[None], others[3:]]) if idx % 2 else torch.cat([mine[None], others])
        pos = 3 if idx % 2 else 0
        t = [1.3, 0.0, 0.5, 2.0, 1.0, 0.8]
        p = [1.0, 1.0, 0.5, 0.7, 0.99, 1.0]
        k = [0, 0, 3, 0, 7, 100]
        s = [idx, 5, 6, 7, 8, 9]
        t[pos], p[pos], k[pos], s[pos] = 0.9, 0.95, 50, 2**40 + 17
        ids = choose_tokens(lg, **_rows(6, t, p, k, s, [idx] * 6))
        seq_batch.append(int(ids[pos]))
    assert seq_alone == seq_batch
    assert len(set(seq_alone)) > 3  # it does sample
    other_seed = [int(choose_tokens(mine[None], **_rows(1, 0.9, 0.95, 50, 2**40 + 18, i))[0]) for i in range(12)]
    assert other_seed != seq_alone


def test_choose_tokens_distribution_matches_softmax():
    """Chi-square of 40,000 draws (distinct seeds; then one seed over distinct token indices) on a
    5-token vocabulary against softmax(logits / T)."""
    from polykv.generation import choose_tokens

    lg = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    T, n = 0.7, 40_000
    want = torch.softmax(lg / T, 0) * n
    for rows in (_rows(n, T, seed=list(range(n))), _rows(n, T, seed=3, index=list(range(n)))):
        ids = choose_tokens(lg.expand(n, -1), **rows)
        got = torch.bincount(ids, minlength=5).float()
        chi2 = float(((got - want) ** 2 / want).sum())
        assert chi2 < 25.0, (chi2, got, want)  # 4 dof: p < 1e-4


def test_choose_tokens_top_k_never_leaves_the_top_k():
    from polykv.generation import choose_tokens

    torch.manual_seed(2)
    G = 4000
    lg = torch.randn(G, 40) * 3
    k = torch.randint(1, 8, (G,))
    ids = choose_tokens(lg, **_rows(G, 2.0, top_k=k.tolist(), seed=list(range(G))))
    rank = (lg > lg.gather(1, ids[:, None])).sum(-1)  # tokens strictly more likely than the chosen
    assert bool((rank < k).all())
    assert int(rank.max()) == 6  # the k-th token does come up (hot temperature)


def test_choose_tokens_top_p_never_leaves_the_nucleus():
    from polykv.generation import choose_tokens

    torch.manual_seed(3)
    G = 4000
    lg = torch.randn(G, 30) * 2
    p = (torch.rand(G) * 0.9 + 0.05)
    ids = choose_tokens(lg, **_rows(G, 1.0, top_p=p.tolist(), seed=list(range(G))))
    probs = torch.softmax(lg, -1)
    sp, order = torch.sort(probs, -1, descending=True)
    before = torch.cumsum(sp, -1) - sp  # mass strictly before each token in sorted order
    pos = (order == ids[:, None]).float().argmax(-1)
    mass_before = before.gather(1, pos[:, None])[:, 0]
    assert bool((mass_before < p + 1e-6).all())
    assert int(pos.max()) >= 3


def test_choose_tokens_nonfinite_rows_take_the_argmax():
    from polykv.generation import choose_tokens

    lg = torch.full((2, 6), float("-inf"))
    lg[0, 4] = 0.0
    lg[1, 2] = float("nan")
    lg[1, 1] = 1.0
    ids = choose_tokens(lg, **_rows(2, 1.0, 0.5, 3, [1, 2]))
    assert ids.tolist()[0] == 4 and ids.tolist()[1] == 1


def test_sampler_draws_like_choose_tokens_and_sampling_rows():
    """The host path (Sampler) and the device rows (SamplingRows) give the same tokens."""
    from polykv.generation import SamplingRows

    torch.manual_seed(4)
    lg = torch.randn(6, 200) * 2
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=2**63 + 5)
    s = Sampler(p)
    host = [s(lg[i]) for i in range(6)]
    rows = SamplingRows(2, "cpu")
    rows.set(3, 0.0, 1.0, 0, 0)  # grows; a neighbour that is greedy
    rows.set(1, p.temperature, p.top_p, p.top_k, p.seed)
    dev = []
    for i in range(6):
        if i == 3:
            rows.move(1, 0)  # the row changes slot mid-stream
        slot = 0 if i >= 3 else 1
        ids = rows.choose(torch.stack([lg[i], lg[i] * 3]), torch.tensor([slot, 3]))
        dev.append(int(ids[0]))
        assert int(ids[1]) == int(lg[i].argmax())
    assert dev == host
