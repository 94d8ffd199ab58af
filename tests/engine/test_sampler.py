"""Sampling is numerically safe for every value SamplingParams accepts, and seeds cover the
OpenAI API's int64 range."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampler import sample
from engine.sampling_params import SEED_MAX, SEED_MIN, InvalidRequestError, SamplingParams
from engine.sequence import Sequence

# Every temperature the API accepts, subnormals and the bounds included.
temperatures = st.one_of(
    st.floats(min_value=0.0, max_value=2.0, allow_subnormal=True),
    st.sampled_from([0.0, 5e-324, 1e-310, 1e-45, 1e-30, 1e-7, 2.0]),
)
top_ps = st.one_of(st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_subnormal=True),
                   st.sampled_from([5e-324, 1e-30, 1.0]))
top_ks = st.one_of(st.just(-1), st.integers(min_value=1, max_value=10**30))
seeds = st.one_of(st.none(), st.integers(min_value=SEED_MIN, max_value=SEED_MAX), st.sampled_from([SEED_MIN, SEED_MAX, -1, 0]))
# Finite fp32 logits, from everyday magnitudes up to the edge of the range.
logit_rows = st.lists(st.floats(min_value=-3.0000000054977558e+38, max_value=3.0000000054977558e+38, width=32), min_size=2, max_size=48)


def _seq(params: SamplingParams) -> Sequence:
    return Sequence("r", [1], params, detokenizer=None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row=logit_rows, temperature=temperatures, top_p=top_ps, top_k=top_ks, seed=seeds)
def test_every_accepted_value_samples_a_valid_token(row, temperature, top_p, top_k, seed):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    logits = torch.tensor([row], dtype=torch.float32)
    (tok,) = sample(logits, [_seq(params)])
    assert 0 <= tok < len(row)
    ordered = sorted(logits[0].tolist(), reverse=True)
    if top_k >= 1:
        # Never a token outside the k most likely (ties with the k-th count as inside).
        assert logits[0, tok] >= ordered[min(top_k, len(row)) - 1]
    top, second = ordered[0], next((x for x in ordered if x < ordered[0]), None)
    if params.greedy or (second is not None and temperature > 0 and (top - second) / temperature > 1e3):
        # Greedy, or a temperature so small that only the maximum keeps any probability.
        assert logits[0, tok] == top
    if seed is not None:
        assert sample(logits, [_seq(params)]) == [tok]  # same seed, same token


@given(row=logit_rows, seed=st.integers(min_value=SEED_MIN, max_value=SEED_MAX))
@settings(max_examples=50, deadline=None)
def test_subnormal_temperature_is_greedy_in_effect(row, seed):
    logits = torch.tensor([row], dtype=torch.float32)
    params = SamplingParams(temperature=5e-324, seed=seed)
    (tok,) = sample(logits, [_seq(params)])
    assert logits[0, tok] == logits[0].max()


def test_rows_of_one_batch_are_sampled_independently():
    logits = torch.randn(3, 1000) * 5
    a = SamplingParams(temperature=1e-30, seed=1)
    b = SamplingParams(temperature=2.0, top_p=0.5, top_k=40, seed=SEED_MIN)
    c = SamplingParams(temperature=0.0)
    batched = sample(logits, [_seq(a), _seq(b), _seq(c)])
    alone = [sample(logits[i:i + 1], [_seq(p)])[0] for i, p in enumerate((a, b, c))]
    assert batched == alone


def test_a_row_that_cannot_be_sampled_fails_alone_when_asked():
    logits = torch.randn(3, 100)
    logits[1, 7] = float("nan")
    seqs = [_seq(SamplingParams(temperature=0.8, seed=i)) for i in range(3)]
    errors = {}
    tokens = sample(logits, seqs, errors)
    assert tokens[1] is None and list(errors) == [1]
    assert tokens[0] == sample(logits[0:1], [_seq(SamplingParams(temperature=0.8, seed=0))])[0]
    with pytest.raises(RuntimeError):
        sample(logits, [_seq(SamplingParams(temperature=0.8, seed=1)) for _ in range(3)])


@pytest.mark.parametrize("seed", [SEED_MIN - 1, SEED_MAX + 1, 2**64, -(2**64)])
def test_seed_outside_int64_is_refused_naming_the_parameter(seed):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({"seed": seed})
    assert e.value.param == "seed"
    assert "64-bit" in e.value.message


def test_negative_and_extreme_seeds_are_distinct_and_reproducible():
    logits = torch.zeros(1, 4096)  # uniform: the seed alone picks the token
    picks = {}
    # Seeds that differ only above their low 32 bits, or in sign: every bit of the seed counts.
    for seed in (SEED_MIN, -1, 0, 1, 1 << 32, (1 << 32) + 1, SEED_MAX, -(1 << 32)):
        p = SamplingParams(temperature=1.0, seed=seed)
        first = [sample(logits, [_seq(p)])[0] for _ in range(2)]
        assert first[0] == first[1]
        s, drawn = _seq(p), []
        for _ in range(4):  # successive tokens of one completion
            drawn.append(sample(logits, [s])[0])
            s.append_token(drawn[-1])
        picks[seed] = tuple(drawn)
    assert len(set(picks.values())) == len(picks)
