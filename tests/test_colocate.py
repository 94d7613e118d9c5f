"""Generation on every rank (rlplug.rollout.colocate, issue 35): the global micro-batches and their seeds, the
ranks' shares, the join, the config checks; the batch equality between 1, 2 and 3 ranks with a scripted engine
(ranks as threads meeting in an all-gather) and with rollout=hf on the tiny model. The real two-process run is in
tests/test_fsdp2.py (torchrun, slow)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rlplug.config.compose import compose
from rlplug.config.schema import ConfigError
from rlplug.contracts.registry import get_registry
from rlplug.contracts.types import RolloutOutput, SamplingParams
from rlplug.rollout import colocate
from rlplug.rollout.colocate import (
    check_colocate_config,
    colocate_enabled,
    generate_colocated,
    idle_ranks,
    micro_batch_seed,
    micro_batches,
    rank_cores,
    rank_micro_batches,
)


# ---------------------------------------------------------------------------- micro-batches, shares, seeds
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 2, 3, 7, 10])
def test_every_micro_batch_has_exactly_one_rank_in_contiguous_balanced_blocks(world: int, count: int) -> None:
    shares = [list(rank_micro_batches(count, r, world)) for r in range(world)]
    assert [k for share in shares for k in share] == list(range(count))  # each once, in rank order
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1


def test_micro_batches_cut_the_sequences_and_refuse_a_size_below_one() -> None:
    assert micro_batches(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert micro_batches(6, 3) == [(0, 3), (3, 6)]
    assert micro_batches(0, 3) == []
    with pytest.raises(ValueError, match="rollout.micro_batch_size must be >= 1"):
        micro_batches(4, 0)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        rank_micro_batches(4, 2, 2)


def test_micro_batch_seeds_differ_per_index_and_per_rollout_seed() -> None:
    seeds = {micro_batch_seed(s, k) for s in range(5) for k in range(50)}
    assert len(seeds) == 250 and all(0 <= x < 2**63 - 1 for x in seeds)
    assert micro_batch_seed(None, 3) == micro_batch_seed(0, 3)


def test_rank_cores_split_the_cores_by_local_rank_and_share_when_asked_for_more() -> None:
    assert [rank_cores(r, 2, None, [0, 1]) for r in range(2)] == [[0], [1]]
    assert [rank_cores(r, 2, None, [4, 5, 6, 7]) for r in range(2)] == [[4, 5], [6, 7]]
    assert rank_cores(0, 1, None, [0, 1]) == [0, 1]
    assert [rank_cores(r, 3, 1, [0, 1]) for r in range(3)] == [[0], [1], [0]]  # 3 ranks on 2 cores: they share
    assert rank_cores(1, 2, 4, [0, 1]) == [0, 1]  # never more cores than there are


# ---------------------------------------------------------------------------- the join, ranks as threads
class ScriptedEngine:
    """Responses that depend only on (prompt, seed, position in the call): ``[prompt, seed % 97, position]``,
    as a seeded engine's would; log-probs and a per-call metric; records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], int]] = []

    def __call__(self, indices: list[int], params: SamplingParams) -> RolloutOutput:
        assert params.n == 1
        self.calls.append((list(indices), int(params.seed or 0)))
        ids = [[p, int(params.seed or 0) % 97, j] for j, p in enumerate(indices)]
        return RolloutOutput(
            response_ids=ids,
            finish_reasons=["stop"] * len(ids),
            prompt_index=list(range(len(ids))),
            log_probs=[[-0.5] * 3 for _ in ids],
            metrics={"rollout/turns_mean": float(len(ids)), "num_turns/max": float(len(ids) + 1)},
        )


def run_ranks(
    world: int, num_prompts: int, params: SamplingParams, size: int, engines: list | None = None
) -> tuple[list[RolloutOutput], list]:
    """``generate_colocated`` on ``world`` threads (``engines[rank]``; default: a scripted engine each) that meet in
    an all-gather; every rank's result."""
    barrier = threading.Barrier(world)
    box: list[Any] = [None] * world
    results: list[Any] = [None] * world
    engines = engines or [ScriptedEngine() for _ in range(world)]

    def all_gather_for(rank: int):
        def gather(obj: Any) -> list[Any]:
            box[rank] = obj
            barrier.wait()
            got = list(box)
            barrier.wait()
            return got

        return gather

    def rank_main(rank: int) -> None:
        results[rank] = generate_colocated(
            num_prompts, params, engines[rank], rank=rank, world_size=world, all_gather=all_gather_for(rank),
            micro_batch_size=size,
        )  # fmt: skip

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results), "a rank failed (its exception is printed above)"
    return results, engines


def test_the_batch_is_the_same_whether_one_two_or_three_ranks_generated_it() -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=4, seed=11)
    (one,), engines = run_ranks(1, 5, params, size=4)  # 15 sequences: micro-batches of 4, 4, 4, 3
    assert one.prompt_index == [p for p in range(5) for _ in range(3)]
    assert [len(c) for c, _ in engines[0].calls] == [4, 4, 4, 3]
    assert [seed for _, seed in engines[0].calls] == [micro_batch_seed(11, k) for k in range(4)]
    # hand-derived: micro-batch 1 holds sequences 4..7, i.e. prompts 1, 1, 2, 2, at positions 0..3
    assert one.response_ids[4:8] == [[p, micro_batch_seed(11, 1) % 97, j] for j, p in enumerate([1, 1, 2, 2])]
    for world in (2, 3):
        outs, engines = run_ranks(world, 5, params, size=4)
        for out in outs:  # every rank holds the whole batch, equal to the one-rank batch
            assert out.response_ids == one.response_ids and out.prompt_index == one.prompt_index
            assert out.log_probs == one.log_probs and out.finish_reasons == one.finish_reasons
        assert sorted(len(e.calls) for e in engines) == sorted(
            len(rank_micro_batches(4, r, world)) for r in range(world)
        )
    # the engine metrics: means over the micro-batches weighted by their responses (4*4 + 4*4 + 4*4 + 3*3) / 15
    assert one.metrics["rollout/turns_mean"] == pytest.approx((16 + 16 + 16 + 9) / 15)
    assert one.metrics["num_turns/max"] == 5.0  # a maximum stays the maximum over the micro-batches (4 + 1)
    assert one.metrics["rollout/gen_s_rank_max"] >= one.metrics["rollout/gen_s_rank_min"] >= 0.0


def test_engine_restarts_are_each_engines_count_added_up_over_the_ranks() -> None:
    class Restarted(ScriptedEngine):
        def __init__(self, restarts: int) -> None:
            super().__init__()
            self.restarts = restarts

        def __call__(self, indices: list[int], params: SamplingParams) -> RolloutOutput:
            out = super().__call__(indices, params)
            if self.restarts:  # as EngineProcess and the vllm engine child report it: absent before the first
                out.metrics["rollout/engine_restarts"] = float(self.restarts)
            return out

    params = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=3)
    # 3 ranks, 6 micro-batches of 2 (two per rank): the engines have restarted 2, 0 and 1 times
    outs, _ = run_ranks(3, 6, params, size=2, engines=[Restarted(2), Restarted(0), Restarted(1)])
    assert all(o.metrics["rollout/engine_restarts"] == 3.0 for o in outs)  # not 1.5, the per-micro-batch mean
    (one,), _ = run_ranks(1, 6, params, size=2, engines=[ScriptedEngine()])
    assert "rollout/engine_restarts" not in one.metrics


def test_a_part_with_the_wrong_number_of_responses_is_refused() -> None:
    def short(indices: list[int], params: SamplingParams) -> RolloutOutput:
        return RolloutOutput(response_ids=[[1]], finish_reasons=["stop"], prompt_index=[0])

    with pytest.raises(ValueError, match="micro-batch 0: the engine returned 1 responses for 2 prompts"):
        generate_colocated(
            2, SamplingParams(n=1, seed=0), short, rank=0, world_size=1, all_gather=lambda o: [o], micro_batch_size=4
        )


# ---------------------------------------------------------------------------- the same with the hf engine
def test_hf_engine_gives_bitwise_the_same_batch_from_one_or_two_ranks() -> None:
    from rlplug.plugins.rollout.hf import HFRollout
    from rlplug.training.models import load_tokenizer, resolve_model_path

    torch.set_num_threads(1)
    cfg = compose(["model=tiny", "rollout.dtype=fp32", "trainer.seed=3"])
    path = resolve_model_path(cfg.model)
    prompts = [[1, 9690, 198, 2683, 314], [1, 4093, 28, 540], [1, 30, 31], [1, 77, 78, 79, 80, 81]]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=5, logprobs=True)
    lock = threading.Lock()  # the ranks' calls one at a time: the engine seeds torch's global RNG per call
    with HFRollout(cfg, path, load_tokenizer(path)) as engine:

        def part(indices: list[int], p: SamplingParams) -> RolloutOutput:
            with lock:
                return engine.generate([prompts[i] for i in indices], p)

        (one,), _ = run_ranks(1, 4, params, 3, [part])
        two, _ = run_ranks(2, 4, params, 3, [part, part])
    assert len(one.response_ids) == 8 and one.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3]
    for out in two:
        assert out.response_ids == one.response_ids and out.log_probs == one.log_probs
    assert len({tuple(r) for r in one.response_ids}) > 1  # sampled, not all the same


# ---------------------------------------------------------------------------- config
def test_colocate_config_refusals_name_the_key_and_the_way_out() -> None:
    with pytest.raises(ConfigError, match=r"rollout.colocate=true .* trainer.async_mode=one_step_off"):
        check_colocate_config(compose(["rollout.colocate=true", "trainer.async_mode=one_step_off"]))
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2: an engine spread over several"):
        check_colocate_config(compose(["rollout.colocate=true", "rollout.tensor_model_parallel_size=2"]))
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=0 must be an integer >= 1"):
        check_colocate_config(compose(["rollout.tensor_model_parallel_size=0"]))
    check_colocate_config(compose(["rollout.tensor_model_parallel_size=2"]))  # rank-0 generation: a layout only
    check_colocate_config(compose(["trainer.async_mode=async"]))  # unset: async modes generate on rank 0


def test_colocate_is_on_by_default_only_for_several_ranks_in_sync_with_an_engine_that_supports_it() -> None:
    reg = get_registry()
    hf = reg.get("rollout_backend", "hf")
    on = dict(can_gather=True)
    assert colocate_enabled(compose([]), 2, hf, reg, **on) is True
    assert colocate_enabled(compose([]), 1, hf, reg, **on) is False  # one process: nothing to share
    assert colocate_enabled(compose(["trainer.async_mode=async"]), 2, hf, reg, **on) is False
    assert colocate_enabled(compose(["rollout.tensor_model_parallel_size=2"]), 2, hf, reg, **on) is False
    assert colocate_enabled(compose([]), 2, hf, reg, can_gather=False) is False
    assert colocate_enabled(compose(["rollout.colocate=false"]), 2, hf, reg, **on) is False
    assert colocate_enabled(compose(["rollout.colocate=true"]), 1, hf, reg, **on) is True  # one rank, asked for
    vllm = reg.get("rollout_backend", "vllm")
    assert colocate_enabled(compose(["rollout=vllm"]), 2, vllm, reg, **on) is True
    server = compose(["rollout=vllm", "rollout.mode=server"])
    assert colocate_enabled(server, 2, vllm, reg, **on) is False
    with pytest.raises(ConfigError, match=r"cannot run an engine per rank: servers are shared by every rank"):
        colocate_enabled(compose(["rollout=vllm", "rollout.mode=server", "rollout.colocate=true"]), 2, vllm, reg, **on)
    with pytest.raises(ConfigError, match=r"coordinator has no 'rank' and 'all_gather'"):
        colocate_enabled(compose(["rollout.colocate=true"]), 2, hf, reg, can_gather=False)


def test_fewer_micro_batches_than_ranks_warns_with_a_size_that_fits() -> None:
    cfg = compose(["data.train_batch_size=4", "rollout.n=2", "rollout.micro_batch_size=64"])
    msg = idle_ranks(cfg, 2)
    assert msg is not None and "8 sequences make 1 micro-batch(es)" in msg and "rollout.micro_batch_size=4" in msg
    assert idle_ranks(compose(["data.train_batch_size=4", "rollout.n=2", "rollout.micro_batch_size=4"]), 2) is None


def test_rank_engine_config_gives_each_local_rank_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(colocate.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = colocate.rank_engine_config(compose([]))
    assert list(cfg.trainer.engine_cpus) == [1] and cfg.rollout.num_threads == 1


# ---------------------------------------------------------------------------- scoring per rank
def test_rank_groups_are_contiguous_blocks_of_whole_groups() -> None:
    # 4 prompts x 3 responses: groups start at 0, 3, 6, 9; 2 ranks take groups {0,1} and {2,3}
    index = [p for p in range(4) for _ in range(3)]
    assert [colocate.rank_groups(index, r, 2) for r in range(2)] == [range(6), range(6, 12)]
    # 3 ranks over 4 groups: floor(k * 4 / 3) boundaries 0, 1, 2, 4
    assert [colocate.rank_groups(index, r, 3) for r in range(3)] == [range(3), range(3, 6), range(6, 12)]
    # more ranks than groups: the first ranks score nothing, every response is scored once
    spans = [colocate.rank_groups([0, 0, 1, 1], r, 3) for r in range(3)]
    assert spans == [range(0), range(2), range(2, 4)]
    # micro-batches of 4 would split these groups of 3 (responses 0..3 | 4..7 ...): the scoring shares do not
    for world in (2, 3, 5):
        shares = [colocate.rank_groups(index, r, world) for r in range(world)]
        assert [i for share in shares for i in share] == list(range(12))
        assert all(len(share) % 3 == 0 for share in shares)


def test_merged_engine_metrics_add_counts_keep_extremes_and_weight_means() -> None:
    from rlplug.rollout.utils import merge_engine_metrics

    parts = [
        ({"multi_turn/tool_calls": 3.0, "multi_turn/ended_by_done": 2.0, "rollout/turns_mean": 1.0, "x/max": 4.0}, 2),
        ({"multi_turn/tool_calls": 5.0, "multi_turn/ended_by_done": 1.0, "rollout/turns_mean": 4.0, "x/max": 2.0}, 1),
        ({"x/min": 7.0}, 0),
    ]
    assert merge_engine_metrics(parts) == {
        "multi_turn/tool_calls": 8.0,  # counts of events: added up
        "multi_turn/ended_by_done": 3.0,
        "rollout/turns_mean": pytest.approx((1.0 * 2 + 4.0 * 1) / 3),  # a mean: weighted by responses
        "x/max": 4.0,
        "x/min": 7.0,
    }


def test_the_episodes_count_metrics_are_added_up_when_micro_batches_are_joined() -> None:
    from fnmatch import fnmatchcase

    from rlplug.orchestration import episodes
    from rlplug.rollout.utils import COUNTED_ROLLOUT_METRICS

    counts = [f"multi_turn/{k}" for k in (*episodes._INFO_COUNTS.values(), "env_errors", "overflow")]
    counts += [f"multi_turn/ended_by_{r}" for r in episodes._END_REASONS]
    for name in counts:
        assert any(fnmatchcase(name, p) for p in COUNTED_ROLLOUT_METRICS), name
    for mean in ("multi_turn/turns_mean", "multi_turn/turns_max", "multi_turn/masked_token_share", "num_turns/mean"):
        assert not any(fnmatchcase(mean, p) for p in COUNTED_ROLLOUT_METRICS), mean


def raising_ranks(world: int, generate: Callable[[int, Callable[[Any], list[Any]]], Any]) -> list[BaseException | None]:
    """``generate(rank, all_gather)`` on ``world`` threads that meet in an all-gather; what each rank raised (None:
    nothing). Fails when a rank is still waiting after 60 s."""
    barrier = threading.Barrier(world)
    box: list[Any] = [None] * world
    raised: list[BaseException | None] = [None] * world

    def rank_main(rank: int) -> None:
        def gather(obj: Any) -> list[Any]:
            box[rank] = obj
            barrier.wait(timeout=30)
            got = list(box)
            barrier.wait(timeout=30)
            return got

        try:
            generate(rank, gather)
        except BaseException as exc:
            raised[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank was left waiting"
    return raised


def test_a_rank_whose_generation_raises_makes_every_rank_raise_after_the_gather() -> None:
    """Rank 1's engine fails: rank 1 raises its own error, rank 0 a RuntimeError naming rank 1; neither is left
    waiting in the all-gather."""

    def broken(indices: list[int], params: SamplingParams) -> RolloutOutput:
        raise OSError("engine child died: no restart left")

    engines = [ScriptedEngine(), broken]
    raised = raising_ranks(
        2,
        lambda rank, gather: generate_colocated(
            4, SamplingParams(n=2, seed=1), engines[rank], rank=rank, world_size=2, all_gather=gather,
            micro_batch_size=2,
        ),
    )  # fmt: skip
    assert isinstance(raised[1], OSError) and "no restart left" in str(raised[1])
    assert isinstance(raised[0], RuntimeError)
    assert str(raised[0]) == "colocated generation failed on rank 1: OSError: engine child died: no restart left"


def test_a_scoring_error_without_overlap_is_handed_to_the_join_not_raised() -> None:
    """reward.overlap=false scores inside score_async: its error goes into the returned future, so the rank still
    reaches the all-gather of join_rank_scores and every rank raises there."""
    from types import SimpleNamespace

    from rlplug.run.colocated import colocated_scoring

    def score_async(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("the reward function raised on response 3")

    trainer = SimpleNamespace(
        coordinator=SimpleNamespace(rank=0, world_size=1),
        reward=SimpleNamespace(score_async=score_async),
        cfg=SimpleNamespace(reward=SimpleNamespace(overlap=False)),
        _decode=lambda out: [],
    )
    out = RolloutOutput(response_ids=[[1], [2]], finish_reasons=["stop"] * 2, prompt_index=[0, 0])
    future = colocated_scoring(trainer, [{"prompt_ids": [5]}], out)
    with pytest.raises(ValueError, match="raised on response 3"):
        future.result(timeout=1)


def test_join_scores_puts_the_ranks_scores_in_order_and_sums_only_the_counts() -> None:
    rank1 = (3, ([0.5, 1.0], {"acc": [1.0, 0.0], "format": [1.0, 1.0]}, {"reward/failures": 1.0, "reward/m": 4.0}))
    rank0 = (0, ([0.0, 0.1, 0.2], {"acc": [0.0, 1.0, 1.0]}, {"reward/failures": 2.0, "reward/m": 1.0}))
    scores, extra, metrics = colocate.join_scores([rank0, None, rank1], 5)  # the middle rank had no responses
    assert scores == [0.0, 0.1, 0.2, 0.5, 1.0]
    assert extra["acc"] == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert all(math.isnan(x) for x in extra["format"][:3]) and extra["format"][3:] == [1.0, 1.0]  # NaN: not reported
    assert metrics["reward/failures"] == 3.0  # a count: summed
    assert metrics["reward/m"] == pytest.approx((1.0 * 3 + 4.0 * 2) / 5)  # a mean: weighted by responses
    with pytest.raises(ValueError, match="not each exactly once"):
        colocate.join_scores([rank0], 5)


def test_a_wake_error_on_a_rank_without_micro_batches_still_reaches_every_rank() -> None:
    """One micro-batch, two ranks: rank 0 generates nothing, and its engine failed to wake. Its error goes through
    the all-gather, so rank 1 raises too, naming rank 0."""
    assert len(rank_micro_batches(1, 0, 2)) == 0  # rank 0 has no share
    errors = [RuntimeError("vllm wake_up failed: CUDA out of memory"), None]
    raised = raising_ranks(
        2,
        lambda rank, gather: generate_colocated(
            2, SamplingParams(n=1, seed=1), ScriptedEngine(), rank=rank, world_size=2, all_gather=gather,
            micro_batch_size=4, error=errors[rank],
        ),
    )  # fmt: skip
    assert raised[0] is errors[0]
    assert (
        str(raised[1]) == "colocated generation failed on rank 0: RuntimeError: vllm wake_up failed: CUDA out of memory"
    )
