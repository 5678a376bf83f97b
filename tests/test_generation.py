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


def test_sample_next_is_one_row_of_sample_rows():
    from polykv.generation import sample_next, sample_rows

    torch.manual_seed(0)
    lg = torch.randn(4, 500) * 3
    for t, p, k in [(1.0, 1.0, 0), (0.7, 0.9, 50), (1.3, 0.5, 0), (0.0, 1.0, 0), (2.0, 1.0, 1)]:
        g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        rows = [int(sample_rows(lg[i:i + 1], t, p, k, g1)[0]) for i in range(4)]
        assert rows == [sample_next(lg[i], t, p, k, g2) for i in range(4)]
    assert int(sample_rows(lg, 2.0, top_k=1, generator=torch.Generator())[0]) == int(lg[0].argmax())


def test_find_stop_is_the_earliest_occurrence():
    from polykv.generation import find_stop

    assert find_stop("abc END xyz STOP", ["STOP", "END"]) == 4
    assert find_stop("a ENSTOPD", ["END", "STOP"]) == 4
    assert find_stop("abc", ["x", ""]) == -1
    assert find_stop("abc", []) == -1
