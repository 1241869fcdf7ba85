"""The live cost model on the job's nodes: one node changes no prediction; a group that crosses
nodes is priced at the rate measured across nodes; the topology is read from the ranks' hosts
(or ``ANYSHARD_DEVICES_PER_NODE``); ``anyshard layouts`` shows it.

Run: python -m pytest tests/unit/test_costmodel_topology.py -q
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from anyshard.trainer_integration.gpt.config import Config, ParallelConfig
from anyshard.trainer_integration.gpt.layout_chooser.cluster import (
    DEVICES_PER_NODE_ENV,
    dim_spans,
    topology_of_hosts,
)
from anyshard.trainer_integration.gpt.layout_chooser.costmodel import (
    main,
    predict,
    rank_layouts,
    workload,
)
from anyshard.trainer_integration.gpt.layout_chooser.scheduler import Scheduler
from anyshard.trainer_integration.planning.step_cost import Collective, Rates
from anyshard.trainer_integration.planning.topology import Span, Topology

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")
BIG = 1 << 34


def _rates(slower: float = 10.0) -> Rates:
    """Nominal rates, and across nodes the same ``slower`` times slower (latency and bytes)."""
    base = Rates.nominal()
    crossing = {
        f"{k}/{g}/{q}": (slower * a, slower * b)
        for k in KINDS
        for g, q in ((2, 1), (4, 2), (4, 1))
        for a, b in [base.in_node_rate(k, g)]
    }
    return dataclasses.replace(base, crossing=crossing, topology=(2, 2), topology_source="test")


def test_on_one_node_every_prediction_of_a_4_rank_world_is_unchanged():
    cfg = Config()
    for rates in (Rates.nominal(), _rates()):
        plain = rank_layouts(cfg, 4, rates, memory_bytes=BIG)
        one = rank_layouts(cfg, 4, rates, memory_bytes=BIG, topology=Topology(4, 1))
        assert len(plain.rows) == 13
        assert one.rows == plain.rows  # every figure ==, and no dim crosses nodes
        assert not one.notes
        for row in plain.rows:
            assert predict(cfg, row.parallel, rates, topology=Topology(4, 1)) == row


def test_a_tp_group_across_nodes_is_predicted_slower_than_inside_one():
    cfg, rates = Config(), _rates()
    two_by_two, one_per_node = Topology(2, 2), Topology(1, 4)
    p = ParallelConfig(tp=2, dp_shard=2)
    inside = predict(cfg, p, rates, topology=two_by_two)
    across = predict(cfg, p, rates, topology=one_per_node)
    assert inside.crossing == ("fsdp", "world") and "tp" in across.crossing
    assert across.step_s > inside.step_s
    assert across.by_dim["tp"] == pytest.approx(10 * inside.by_dim["tp"])
    # the same layout with tp over all 4 ranks: across 2 nodes of 2 vs inside one node of 4
    tp4 = ParallelConfig(tp=4)
    assert (
        predict(cfg, tp4, rates, topology=two_by_two).step_s
        > predict(cfg, tp4, rates, topology=Topology(4, 1)).step_s
    )
    # tp is the innermost dim: no layout of 4 ranks on 2 nodes of 2 puts it across nodes
    table = rank_layouts(cfg, 4, rates, memory_bytes=BIG, topology=two_by_two)
    assert not any("tp" in r.crossing for r in table.rows)


def test_the_spans_follow_the_trainers_mesh_order():
    def at(spans: dict[str, Span]) -> dict[str, tuple[int, int]]:
        return {d: (s.size, s.per_node) for d, s in spans.items()}

    spans = at(dim_spans(ParallelConfig(pp=2, dp_shard=2, tp=2), devices_per_node=2))
    assert spans["tp"] == (2, 2)
    assert spans["dp_shard"] == (2, 1) and spans["fsdp"] == (2, 1)
    assert spans["pp"] == (2, 1)  # neighbouring stages are 4 ranks apart
    assert spans["world"] == (8, 2)
    spans = at(dim_spans(ParallelConfig(pp=2, tp=2), devices_per_node=4))
    assert spans["pp"] == (2, 2) and spans["tp"] == (2, 2)  # one node holds both stages


def test_a_collective_across_nodes_without_a_measured_rate_uses_the_in_node_rate_and_says_so():
    nominal = Rates.nominal()
    c = Collective("fsdp", "all_gather", 4, 1 << 20, 1, Span(4, 2))
    assert nominal.collective_s(c) == nominal.collective_s(dataclasses.replace(c, span=None))
    table = rank_layouts(Config(), 4, nominal, memory_bytes=BIG, topology=Topology(2, 2))
    assert table.notes and "no rate across nodes" in table.notes[0]
    assert "note: no rate across nodes" in table.text()
    # with rates across nodes: the nearest placement measured, 10x the in-node rate
    rates = _rates()
    assert rates.collective_s(c) > 5 * nominal.collective_s(c)
    odd = dataclasses.replace(c, group=8, span=Span(8, 2))  # 4 nodes: the nearest is (4, 1)
    assert rates.crossing_rate("all_gather", odd.span) == rates.crossing["all_gather/4/1"]


def test_rates_across_nodes_survive_the_json_round_trip_and_old_files_load():
    rates = _rates()
    again = Rates.from_json(rates.to_json())
    assert again == rates and again.measured_topology == Topology(2, 2)
    old = json.loads(Rates.nominal().to_json())
    for key in ("crossing", "topology", "topology_source"):
        del old[key]
    assert Rates.from_json(json.dumps(old)) == Rates.nominal()


def test_the_topology_is_read_from_the_ranks_hosts():
    assert topology_of_hosts(["a", "a", "b", "b"], {}) == (
        Topology(2, 2),
        "from the process group",
    )
    assert topology_of_hosts(["a"] * 4, {"LOCAL_WORLD_SIZE": "4"})[0] == Topology(4, 1)
    forced = topology_of_hosts(["a"] * 4, {DEVICES_PER_NODE_ENV: "2", "LOCAL_WORLD_SIZE": "4"})
    assert forced == (Topology(2, 2), f"{DEVICES_PER_NODE_ENV}=2")
    with pytest.raises(ValueError, match="unequal numbers of ranks"):
        topology_of_hosts(["a", "a", "a", "b"], {})
    with pytest.raises(ValueError, match="numbered host by host"):
        topology_of_hosts(["a", "b", "a", "b"], {})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=4"):
        topology_of_hosts(["a", "a", "b", "b"], {"LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="divides the world"):
        topology_of_hosts(["a"] * 4, {DEVICES_PER_NODE_ENV: "3"})


def test_the_scheduler_prices_its_layouts_on_the_nodes_it_is_given():
    cfg, rates = Config(), _rates()
    p = ParallelConfig(tp=2, dp_shard=2)
    s = Scheduler(cfg, p, rates, total_steps=50, topology=(Topology(1, 4), "test"))
    assert s.table.topology_text() == "4 nodes x 1 ranks (test)"
    assert s.predicted(p) == predict(cfg, p, rates, topology=Topology(1, 4)).step_s
    assert s.predicted(p) > predict(cfg, p, rates).step_s


def test_anyshard_layouts_prints_the_topology_and_the_dims_across_nodes(tmp_path, capsys):
    path = tmp_path / "rates.json"
    rates = dataclasses.replace(_rates(), topology_source="from the process group")
    path.write_text(rates.to_json())
    assert main(["--world", "4", "--rates", str(path), "--memory-gib", "16"]) == 0
    text = capsys.readouterr().out
    assert "topology: 2 nodes x 2 ranks (from the process group, in the rates file)" in text
    assert "across nodes" in text and "note:" not in text
    assert main(["--world", "4", "--devices-per-node", "2", "--memory-gib", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["topology"] == {"devices_per_node": 2, "nodes": 2, "source": "--devices-per-node"}
    rows = {r["layout"]: r for r in out["layouts"]}
    assert rows["dp_shard=2 x tp=2"]["crosses_nodes"] == ["fsdp", "world"]
    assert out["notes"]  # nominal rates: nothing measured across nodes


def test_the_workload_places_its_collectives_only_when_given_nodes():
    cfg, p = Config(), ParallelConfig(dp_replicate=2, tp=2)
    assert all(c.span is None for c in workload(cfg, p).collectives)
    placed = workload(cfg, p, Topology(2, 2)).collectives
    assert {c.dim for c in placed if c.crosses_nodes} == {"dp_replicate", "world"}


def test_the_docstring_examples_of_the_topology_and_crossing_measurement_run():
    import doctest

    from anyshard.trainer_integration.gpt.layout_chooser import cluster, measure

    for module in (cluster, measure):
        assert doctest.testmod(module).failed == 0, module.__name__
