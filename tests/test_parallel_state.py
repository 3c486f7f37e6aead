"""Process groups and collectives on real gloo ranks (tracevllm/distributed/)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from tests.parallel_utils import run_ranks
from tracevllm.distributed.utils import get_pp_indices

pytestmark = pytest.mark.timeout(300)


def _groups_and_collectives(rank: int) -> dict[str, Any]:
    from tracevllm.distributed import parallel_state as ps

    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    x = torch.full((2, 3), float(rank + 1))
    # TP collectives: sum, concatenation in rank order, gather to one rank.
    reduced = tp.all_reduce(x.clone())
    gathered_last = tp.all_gather(torch.tensor([[rank, rank]]), dim=-1)
    gathered_first = tp.all_gather(torch.tensor([[rank, rank]]), dim=0)
    to_first = tp.gather(torch.tensor([rank]), dst=0)
    shared = tp.broadcast(torch.tensor([rank * 10]), src=1)
    obj = tp.broadcast_object({"from": rank} if tp.rank_in_group == 0 else None, src=0)
    # PP: stage 0 sends a dict (a tensor, a value, an empty tensor) to stage 1.
    sent = {"hidden_states": torch.arange(6.0).reshape(2, 3) + rank, "n": rank, "e": torch.empty(0)}
    received = None
    if pp.is_first_rank:
        pp.send_tensor_dict(sent)
    else:
        received = pp.recv_tensor_dict()
    bcast = tp.broadcast_tensor_dict(
        {"t": torch.tensor([7, rank]), "s": "x"} if tp.rank_in_group == 0 else None
    )
    return {
        "tp_ranks": tp.ranks,
        "pp_ranks": pp.ranks,
        "dp_ranks": ps.get_dp_group().ranks,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "first_last": (pp.is_first_rank, pp.is_last_rank),
        "reduced": reduced,
        "gathered_last": gathered_last,
        "gathered_first": gathered_first,
        "to_first": to_first,
        "shared": shared,
        "obj": obj,
        "received": received,
        "bcast": bcast,
    }


def test_groups_and_collectives_tp2_pp2() -> None:
    out = run_ranks(_groups_and_collectives, 4, tp=2, pp=2)
    # TP fastest: [0, 1] and [2, 3] split each layer; [0, 2] and [1, 3] are pipelines.
    assert [o["tp_ranks"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["pp_ranks"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o["dp_ranks"] for o in out] == [[0], [1], [2], [3]]
    assert [o["tp_rank"] for o in out] == [0, 1, 0, 1]
    assert {o["tp_size"] for o in out} == {2}
    assert [o["first_last"] for o in out] == [(True, False)] * 2 + [(False, True)] * 2
    for rank, o in enumerate(out):
        group = [0, 1] if rank < 2 else [2, 3]
        torch.testing.assert_close(o["reduced"], torch.full((2, 3), float(sum(group) + 2)))
        assert o["gathered_last"].tolist() == [[group[0], group[0], group[1], group[1]]]
        assert o["gathered_first"].tolist() == [[group[0]] * 2, [group[1]] * 2]
        if rank % 2:
            assert o["to_first"] is None  # only the group's rank 0 gets it
        else:
            assert o["to_first"].tolist() == group
        assert o["shared"].tolist() == [group[1] * 10]
        assert o["obj"] == {"from": group[0]}
        assert o["bcast"]["s"] == "x" and o["bcast"]["t"].tolist() == [7, group[0]]
    # Stage 1 got stage 0's dict (same TP rank): values, shapes and an empty tensor.
    for rank in (2, 3):
        got = out[rank]["received"]
        assert got["n"] == rank - 2
        torch.testing.assert_close(got["hidden_states"], torch.arange(6.0).reshape(2, 3) + rank - 2)
        assert got["e"].shape == (0,)
    assert out[0]["received"] is None


def _three_ranks(rank: int) -> list[float]:
    from tracevllm.distributed.communication_op import (
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
    )

    total = tensor_model_parallel_all_reduce(torch.tensor([float(rank)]))
    return tensor_model_parallel_all_gather(total * 0 + rank).tolist() + total.tolist()


def test_three_ranks_communication_ops() -> None:
    assert run_ranks(_three_ranks, 3) == [[0.0, 1.0, 2.0, 3.0]] * 3


def test_get_pp_indices_even_uneven_and_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRACEVLLM_PP_LAYER_PARTITION", raising=False)
    split = [get_pp_indices(30, r, 4) for r in range(4)]
    # The remainder goes to the stages before the last: [7, 8, 8, 7].
    assert split == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert [get_pp_indices(2, r, 2) for r in range(2)] == [(0, 1), (1, 2)]
    monkeypatch.setenv("TRACEVLLM_PP_LAYER_PARTITION", "8,8,8,6")
    assert [get_pp_indices(30, r, 4) for r in range(4)] == [(0, 8), (8, 16), (16, 24), (24, 30)]
    monkeypatch.setenv("TRACEVLLM_PP_LAYER_PARTITION", "8,8")
    with pytest.raises(ValueError, match="does not match pp_size=4"):
        get_pp_indices(30, 0, 4)
    monkeypatch.setenv("TRACEVLLM_PP_LAYER_PARTITION", "8,8,8,5")
    with pytest.raises(ValueError, match="does not match num_hidden_layers=30"):
        get_pp_indices(30, 0, 4)
    monkeypatch.setenv("TRACEVLLM_PP_LAYER_PARTITION", "8,x")
    with pytest.raises(ValueError, match="Invalid partition string"):
        get_pp_indices(30, 0, 2)


# A fresh process: a world of one, made twice as two engines would, and what is left after.
_WORLD_OF_ONE = textwrap.dedent(
    """
    import glob, json, os, tempfile, time
    from tracevllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from tracevllm.distributed import parallel_state as ps
    from tracevllm.distributed.utils import temporary_file_init_method

    config = VllmConfig(ModelConfig(model="unused", hf_config={"architectures":
        ["LlamaForCausalLM"]}), CacheConfig(), SchedulerConfig())
    times = []
    for _ in range(2):
        start = time.perf_counter()
        with temporary_file_init_method() as method:
            ps.init_worker_distributed_environment(config, 0, method, 0)
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            world = ps.get_world_group()
    def listening():
        # TCP sockets of this process in LISTEN state, by local address.
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in open(table).readlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:
                    found.append(f[1])
        return found
    print(json.dumps({
        "same_world": ps.get_world_group() is world,
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp": [ps.get_pp_group().is_first_rank, ps.get_pp_group().is_last_rank],
        "leftover": glob.glob(os.path.join(tempfile.gettempdir(), "tracevllm-dist-*")),
        "listening": listening(),
        "times": times,
    }))
    """
)


def test_world_of_one_is_made_once_and_leaves_nothing(tmp_path: Any) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _WORLD_OF_ONE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same_world"] and out["tp_size"] == 1 and out["pp"] == [True, True]
    assert out["leftover"] == []  # the rendezvous directory is gone
    # gloo's own pair listeners only, on the loopback (127.0.0.1 is 0100007F):
    # no key-value store listening on every interface.
    assert all(addr.startswith("0100007F:") for addr in out["listening"]), out["listening"]
    # The second engine finds the world there: no new rendezvous.
    assert out["times"][1] < out["times"][0] and out["times"][1] < 0.05, out["times"]
