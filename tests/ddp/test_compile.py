"""``torch.compile`` over a model observed by ddpscope: same training as eager torch DDP, no noise."""

from __future__ import annotations

from pathlib import Path

from tests.ddp.engine_jobs import run_job


def test_a_compiled_engine_and_a_compiled_instrumented_ddp_train_as_eager_torch_ddp_does_quietly(
    tmp_path: Path,
) -> None:
    ranks = run_job("compiled.py", 2, [], tmp_path, timeout_s=240)
    for rank in ranks:
        assert rank["engine"] == rank["reference"]
        assert rank["instrumented"] == rank["reference"]
        # The models inside compiled: under instrument() as under torch's DDP alone, and the engine's
        # model into a graph. ddpscope's frames were not traced, so Dynamo had nothing to warn about.
        assert rank["instrumented_graphs"] == rank["torch_graphs"]
        assert rank["engine_graphs"] >= 1
        assert rank["warnings"] == []
        assert rank["steps"] == [0, 1, 2, 0, 1, 2]  # both models' steps recorded
