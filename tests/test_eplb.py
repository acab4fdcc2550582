"""EPLB placement algorithms (pure numpy): exact tables and the imbalance they reach."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sgl_jax.srt.layers.moe.balancing import (
    compute_placement,
    device_load,
    greedy_placement,
    hierarchical_placement,
    imbalance,
    pack,
    replicate,
)
from sgl_jax.srt.layers.moe.placement import (
    default_placement,
    physical_ids_np,
    read_init_location,
    replica_choice,
    replica_tables,
)


def skewed_load() -> np.ndarray:
    load = np.zeros((2, 16))
    load[0, [5, 9]] = [400, 200]
    load[0] += 10
    load[1, [13, 14, 15]] = 300
    load[1] += 5
    return load


def test_replicate_gives_extra_slots_to_the_hottest_per_replica():
    assert replicate([100, 1, 1, 1], 6).tolist() == [3, 1, 1, 1]
    assert replicate([10, 9, 1, 1], 6).tolist() == [2, 2, 1, 1]
    assert replicate([1, 1, 1], 3).tolist() == [1, 1, 1]  # ties: nothing extra
    with pytest.raises(ValueError, match="cannot hold"):
        replicate([1, 1, 1], 2)


def test_pack_lpt_with_equal_slot_counts():
    assert pack([5, 4, 3, 3, 2, 1], 2) == [[0, 3, 5], [1, 2, 4]]  # 9 and 9
    # Equal weights: replicas of one label go to different bins on a tie.
    assert pack([2, 2, 1, 1], 2, labels=[0, 0, 1, 2]) == [[0, 2], [1, 3]]


def test_greedy_exact_tables():
    table = greedy_placement(skewed_load(), 4, 20)
    assert table.tolist() == [
        [0, 2, 4, 7, 9, 1, 3, 6, 8, 9, 5, 5, 10, 12, 14, 5, 5, 11, 13, 15],
        [4, 7, 10, 13, 14, 5, 8, 11, 13, 14, 6, 9, 12, 13, 15, 0, 1, 2, 3, 15],
    ]


def test_every_expert_placed_and_imbalance_drops():
    load = skewed_load()
    base = np.tile(default_placement(16, 20), (2, 1))
    before = imbalance(device_load(load, base, 4))
    for algorithm in ("greedy", "hierarchical"):
        table = compute_placement(load, 4, 20, algorithm, num_nodes=2)
        assert table.shape == (2, 20)
        for row in table:
            assert set(row.tolist()) == set(range(16))
        after = imbalance(device_load(load, table, 4))
        assert (after < before).all(), (algorithm, before, after)
    np.testing.assert_allclose(before, [3.421053, 2.551020], rtol=1e-6)
    np.testing.assert_allclose(imbalance(device_load(load, greedy_placement(load, 4, 20), 4)),
                               [1.236842, 1.098639], rtol=1e-6)
    # Total load is preserved by the split over replicas.
    np.testing.assert_allclose(device_load(load, greedy_placement(load, 4, 20), 4).sum(1),
                               load.sum(1))


def test_hierarchical_keeps_replicas_in_their_device_group():
    load = np.array([[50, 40, 1, 1, 30, 1, 1, 1]], float)
    table = hierarchical_placement(load, 4, 12, num_groups=4, num_nodes=2)
    assert table.tolist() == [[0, 1, 6, 0, 1, 7, 4, 4, 5, 2, 3, 4]]
    node0, node1 = set(table[0, :6].tolist()), set(table[0, 6:].tolist())
    assert not node0 & node1  # each expert lives in one device group
    with pytest.raises(ValueError, match="hierarchical"):
        hierarchical_placement(load, 4, 12, num_groups=3, num_nodes=2)


def test_replica_tables_and_deterministic_choice():
    p2l = np.array([0, 0, 5, 6, 7, 0, 1, 2, 3, 4])
    replicas, num = replica_tables(p2l, 8, 3)
    assert replicas[0].tolist() == [0, 1, 5] and num.tolist() == [3, 1, 1, 1, 1, 1, 1, 1]
    assert replicas[5].tolist() == [2, 2, 2]
    ids = np.array([[0, 1], [0, 2], [3, 0]])
    # assignment (t, j) of expert e takes replica (t + j) % num_replicas[e]
    assert replica_choice(ids, num).tolist() == [[0, 0], [1, 0], [0, 0]]
    assert physical_ids_np(ids, p2l, 3).tolist() == [[0, 6], [1, 7], [8, 0]]
    # An expert always at slot 0 of k=4 with 2 replicas: its tokens alternate replicas.
    hot = np.array([[0, 1, 2, 3]] * 4)
    assert replica_choice(hot, np.array([2, 1, 1, 1]))[:, 0].tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="physical slots"):
        replica_tables(np.array([0, 0, 0, 0, 1]), 3, 3)


def test_init_location_from_dump_and_json(tmp_path):
    load = skewed_load()
    dump = tmp_path / "stat.npz"
    np.savez(dump, counts=load, tokens=np.int64(100))
    table = read_init_location(str(dump), 2, 16, 4, 20)
    np.testing.assert_array_equal(table, greedy_placement(load, 4, 20))
    spec = tmp_path / "loc.json"
    spec.write_text(json.dumps({"physical_to_logical": list(range(16)) + [0, 1, 2, 3]}))
    assert read_init_location(str(spec), 2, 16, 4, 20).shape == (2, 20)
    spec.write_text(json.dumps(list(range(20))))
    with pytest.raises(ValueError, match="every row"):
        read_init_location(str(spec), 2, 16, 4, 20)



def test_flags():
    import argparse

    from sgl_jax.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args([
        "--enable-eplb", "--ep-num-redundant-experts", "4", "--eplb-algorithm", "hierarchical",
        "--eplb-rebalance-num-iterations", "100", "--init-expert-location", "x.npz"]))
    assert (args.enable_eplb, args.ep_num_redundant_experts, args.eplb_algorithm,
            args.eplb_rebalance_num_iterations, args.init_expert_location) == (
        True, 4, "hierarchical", 100, "x.npz")
    assert args.expert_distribution_recorder_mode == "stat"  # EPLB reads the stat counts
    assert not ServerArgs().enable_eplb
    for kwargs, message in [
        ({"ep_num_redundant_experts": 2}, "need enable_eplb"),
        ({"enable_eplb": True, "eplb_algorithm": "random"}, "eplb_algorithm"),
        ({"enable_eplb": True, "expert_distribution_recorder_mode": "per_pass"}, "stat"),
        ({"enable_eplb": True, "enable_deterministic_inference": True}, "exclusive"),
        ({"enable_eplb": True, "ep_expert_mapping": "[[0]]"}, "exclusive"),
    ]:
        with pytest.raises(ValueError, match=message):
            ServerArgs(**kwargs)


def test_one_placement_type_for_static_and_eplb():
    """A static mapping is a placement without redundant rows; EPLB's is dynamic, with them."""
    from sgl_jax.srt.layers.moe.balancing import balanced_mapping
    from sgl_jax.srt.layers.moe.placement import ExpertPlacement

    load = skewed_load()[0]
    static = ExpertPlacement(balanced_mapping(load, 4))
    assert not static.dynamic and static.num_physical == static.num_experts == 16
    # balanced_mapping is greedy without redundant rows, row by row.
    np.testing.assert_array_equal(static.physical_order(7), greedy_placement(load, 4, 16)[0])
    eplb = ExpertPlacement.from_layers({0: greedy_placement(load, 4, 20)[0]}, 16, 4)
    assert eplb.dynamic and (eplb.num_physical, eplb.rows_per_device) == (20, 5)
    np.testing.assert_array_equal(ExpertPlacement.redundant(16, 20, 4).physical_order(3),
                                  default_placement(16, 20))
    with pytest.raises(ValueError, match="at least once"):
        ExpertPlacement.from_layers({0: np.zeros(20, np.int32)}, 16, 4)
    with pytest.raises(ValueError, match="several devices"):
        eplb.device_of(0)
    with pytest.raises(ValueError, match="multiple of ep_size=3"):
        ExpertPlacement.redundant(16, 20, 3)


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("num_experts,redundant", [(8, 4), (300, 40)])
def test_jitted_placement_lookups_match_numpy(num_experts, redundant, one_hot):
    """The forward's logical -> physical translation, by gathers (CPU) or one-hot matmuls
    (compiled for TPU), equals the numpy twin, also with physical rows past 255 (the one-hot
    lookup's high byte)."""
    import jax
    import jax.numpy as jnp

    from sgl_jax.srt.layers.moe.ep_moe import physical_ids, static_physical_ids

    rng = np.random.default_rng(num_experts)
    p2l = np.concatenate([np.arange(num_experts),
                          rng.integers(0, num_experts, redundant)])
    rng.shuffle(p2l)
    max_replicas = int(np.bincount(p2l).max())
    ids = rng.integers(0, num_experts, (37, 8)).astype(np.int32)
    replicas, num = replica_tables(p2l, num_experts, max_replicas)
    got = jax.jit(physical_ids, static_argnums=3)(
        jnp.asarray(ids), jnp.asarray(replicas), jnp.asarray(num), one_hot)
    np.testing.assert_array_equal(np.asarray(got), physical_ids_np(ids, p2l, max_replicas))

    order = rng.permutation(num_experts)
    got = jax.jit(lambda i: static_physical_ids(i, tuple(order), one_hot))(jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(got), np.argsort(order)[ids])
