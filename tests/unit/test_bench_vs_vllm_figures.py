"""The pure parts of `benchmarks/bench_vs_vllm.py`: CPU accounting from `/proc` text, ratios, roofline.

The benchmark itself needs vLLM, which CI never installs; what it computes from what it
measures is checked here on hand-made inputs, and its run with two weightsync servers is in
tests/integration/test_bench_vs_vllm_run.py.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_vs_vllm as bench
from model_dir import LLAMA_27M_SHAPE, LLAMA_27M_VOCAB_SIZE


def _stat(pid: int, name: str, ppid: int, utime: int, stime: int, cutime: int = 0,
          cstime: int = 0) -> str:  # fmt: skip
    """A `/proc/PID/stat` line as Linux writes it (fields after the times are left out)."""
    return (f"{pid} ({name}) S {ppid} {pid} {pid} 0 -1 4194560 100 0 0 0 "
            f"{utime} {stime} {cutime} {cstime} 20 0 3 0 12345")  # fmt: skip


def test_proc_stat_is_read_after_the_last_parenthesis():
    """A command name with spaces and parentheses does not shift the fields."""
    assert bench.parse_proc_stat(_stat(9, "py (x) y", 4, 30, 12, 5, 1)) == (4, 48)


def test_proc_stat_with_too_few_fields_is_refused():
    with pytest.raises(ValueError, match="fields"):
        bench.parse_proc_stat("9 (x) S 4 9")


def test_tree_cpu_counts_the_tree_and_nothing_else():
    """A server's tree: itself, its child and grandchild (with a reaped child's time); not others."""
    stats = {
        100: _stat(100, "sh", 1, 1, 1),
        101: _stat(101, "api server", 100, 50, 10, cutime=7, cstime=3),
        102: _stat(102, "EngineCore", 101, 200, 20),
        200: _stat(200, "other", 1, 999, 999),
        201: _stat(201, "other child", 200, 999, 999),
    }
    assert bench.tree_cpu_ticks(stats, 100) == 2 + 70 + 220
    assert bench.tree_cpu_ticks(stats, 102) == 220
    assert bench.tree_cpu_ticks(stats, 999) == 0  # a tree that has ended


def test_machine_busy_ticks_leave_idle_and_iowait_out():
    text = "cpu  100 5 50 800 40 3 2 7 9 0\ncpu0 50 2 25 400 20 1 1 3 4 0\nintr 1\n"
    assert bench.busy_and_total_ticks(text) == (167, 1007)


def test_paired_ratios_and_their_median():
    """The median of per-round ratios, not the ratio of medians: they differ here."""
    a = [100.0, 200.0, 400.0]
    b = [120.0, 180.0, 600.0]
    ratios = bench.paired_ratios(b, a)
    assert ratios == [1.2, 0.9, 1.5]
    assert bench.summary(ratios)["median"] == 1.2
    assert statistics.median(b) / statistics.median(a) == 0.9


@pytest.mark.parametrize("rounds", [6, 12])
def test_every_side_runs_as_often_in_each_position_and_after_each_other_side(rounds):
    """No side always runs in the middle: a side there came out ahead of its twin."""
    sides = ["vllm", "weightsync", "inprocess"]
    orders = [bench.round_order(index, sides) for index in range(rounds)]
    assert all(sorted(order) == sorted(sides) for order in orders)
    positions = Counter((side, order.index(side)) for order in orders for side in sides)
    assert set(positions.values()) == {rounds // 3}
    assert len(positions) == 9
    after = Counter(pair for order in orders for pair in itertools.pairwise(order))
    assert set(after.values()) == {rounds // 3} and len(after) == 6


def test_unpaired_rounds_are_refused():
    with pytest.raises(ValueError, match="not paired"):
        bench.paired_ratios([1.0, 2.0], [1.0])


def test_roofline_of_a_small_workload_by_hand():
    """Two streams, 2-token prompts, 3 tokens each: a prefill step, then two decode steps.

    Prefill: 100 + 2*2*4 = 116 bytes, 2*(2*10*2 + 2*5 + 2*3) = 112 FLOPs; the decode steps at
    context 3 and 4: 124 and 132 bytes, 72 and 76 FLOPs. At 100 bytes/s and 100 FLOP/s the
    steps take max 1.16 + 1.24 + 1.32 = 3.72 s, or 2.28 + 1.96 + 2.08 = 6.32 s in sum.
    """
    costs = bench.ModelCosts(parameters=40, weight_bytes=100, layer_matmul_params=10,
                             head_params=5, kv_bytes_per_token=4, attention_flops_per_context=2)  # fmt: skip
    ceiling = bench.roofline(costs, streams=2, prompt_tokens=2, max_tokens=3,
                             read_bytes_per_s=100.0, flop_per_s=100.0)  # fmt: skip
    assert ceiling["overlapped_tokens_per_s"] == pytest.approx(6 / 3.72)
    assert ceiling["serial_tokens_per_s"] == pytest.approx(6 / 6.32)


def test_more_streams_raise_a_memory_bound_roofline():
    """One stream reads the weights for one token, 64 streams for 64: the ceiling rises."""
    costs = bench.model_costs({**LLAMA_27M_SHAPE, "vocab_size": LLAMA_27M_VOCAB_SIZE,
                               "tie_word_embeddings": True}, 4)  # fmt: skip
    rates = {"read_bytes_per_s": 12.5e9, "flop_per_s": 170e9}
    one = bench.roofline(costs, streams=1, prompt_tokens=32, max_tokens=64, **rates)
    many = bench.roofline(costs, streams=64, prompt_tokens=32, max_tokens=64, **rates)
    assert many["overlapped_tokens_per_s"] > 10 * one["overlapped_tokens_per_s"]
    # At one stream a decode step is memory-bound: the weights' bytes over the bandwidth.
    assert one["overlapped_tokens_per_s"] == pytest.approx(12.5e9 / costs.weight_bytes, rel=0.05)


@pytest.mark.parametrize(("tied", "head_dim"), [(True, None), (False, 96)])
def test_model_costs_count_the_parameters_transformers_builds(tied, head_dim):
    """The parameters, from `config.json` alone, are those of the model `transformers` builds."""
    import transformers

    shape = {"hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
             "tie_word_embeddings": tied, **({"head_dim": head_dim} if head_dim else {})}  # fmt: skip
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    costs = bench.model_costs(shape, 4)
    assert costs.parameters == model.num_parameters()
    per_token_kv = 2 * 2 * 2 * (head_dim or 32) * 4  # K and V, layers, KV heads, head size, bytes
    assert costs.kv_bytes_per_token == per_token_kv


def test_the_benchmark_model_has_27m_parameters():
    costs = bench.model_costs({**LLAMA_27M_SHAPE, "vocab_size": LLAMA_27M_VOCAB_SIZE,
                               "tie_word_embeddings": True}, 4)  # fmt: skip
    assert costs.parameters == 27_402_752


def test_tokens_per_cpu_second_sums_before_dividing():
    bursts = [bench.Burst(64, 1.0, 0.01, 10.0, 0.02), bench.Burst(64, 1.0, 0.01, 10.0, 0.14)]
    assert bench.tokens_per_cpu_s(bursts) == pytest.approx(128 / 0.16)
    assert bench.tokens_per_cpu_s([bench.Burst(64, 1.0, 0.01, 10.0, 0.0)]) is None


def test_greedy_agreement_counts_tokens_and_first_divergence():
    result = bench.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert result == {"identical_prompts": 1, "identical_tokens": 5, "total_tokens": 6,
                      "first_divergence": [1]}  # fmt: skip
