"""Which trainers run on which nodes (actors/service/scheduler/cluster_plan.py): per-node kinds follow the nodes,
spread kinds stay where they are while their node lives, threads come from the trainer's own node, and the CPU
trainers on one node share its RAM for their default budgets."""

from __future__ import annotations

from collections import Counter

from actors.service.scheduler.cluster_plan import NodeInfo, plan_trainers, trainer_kinds
from actors.service.scheduler.config import ServiceConfig, TrainerConfig

HEAD = NodeInfo("h" * 56, "10.0.0.1", cpus=8, gpus=0, head=True)
CPU_WORKER = NodeInfo("c" * 56, "10.0.0.2", cpus=2, gpus=0)
GPU_WORKER = NodeInfo("g" * 56, "10.0.0.3", cpus=16, gpus=4)


def test_default_follows_every_node_of_a_cpu_cluster_with_threads_from_each_node():
    kinds = trainer_kinds(ServiceConfig(cpu_trainers_per_node=2), cluster_has_gpus=False)
    plan = plan_trainers(kinds, [HEAD, CPU_WORKER])
    assert Counter(p.node for p in plan) == {HEAD.id: 2, CPU_WORKER.id: 2}
    # the 8-CPU head's trainers get 4 threads each, the 2-CPU worker's 1 each: not the scheduler's node's count
    assert {p.node: p.threads for p in plan} == {HEAD.id: 4, CPU_WORKER.id: 1}
    assert plan_trainers(kinds, [HEAD]) == [p for p in plan if p.node == HEAD.id]   # the worker left


def test_default_on_a_gpu_cluster_is_one_trainer_per_gpu_and_none_on_cpu_nodes():
    kinds = trainer_kinds(ServiceConfig(), cluster_has_gpus=True)
    plan = plan_trainers(kinds, [HEAD, GPU_WORKER])
    assert [p.node for p in plan] == [GPU_WORKER.id] * 4
    assert all(p.config.num_gpus == 1 and p.threads is None for p in plan)
    assert len({p.key for p in plan}) == 4


def test_spread_kind_balances_over_nodes_and_stays_put_while_its_node_lives():
    kind = TrainerConfig(count=3, num_cpus=1)
    two = [HEAD, NodeInfo("w" * 56, "10.0.0.4", cpus=8, gpus=0)]
    plan = plan_trainers([kind], two)
    assert sorted(Counter(p.node for p in plan).values()) == [1, 2]
    current = {p.key: p.node for p in plan}
    assert {p.key: p.node for p in plan_trainers([kind], two, current)} == current   # stable
    moved = plan_trainers([kind], [HEAD], current)   # the worker left: its trainers go to the head
    assert [p.node for p in moved] == [HEAD.id] * 3
    assert {p.key for p in moved} == set(current)          # same trainers, new place
    assert [p.threads for p in moved] == [8 // 3] * 3


def test_explicit_threads_and_kinds_without_a_fitting_node():
    kinds = [TrainerConfig(count=1, threads=3, nodes="each"), TrainerConfig(count=1, num_gpus=1)]
    plan = plan_trainers(kinds, [HEAD, CPU_WORKER])
    cpu = [p for p in plan if p.config.num_gpus == 0]
    assert {p.node for p in cpu} == {HEAD.id, CPU_WORKER.id} and all(p.threads == 3 for p in cpu)
    gpu = [p for p in plan if p.config.num_gpus == 1]
    assert len(gpu) == 1 and gpu[0].node is None      # no node has a GPU: Ray places it once one joins
    # a head started with --num-cpus=0 (kept free of work) gets no CPU trainer
    idle_head = NodeInfo(HEAD.id, HEAD.address, cpus=0, gpus=0, head=True)
    assert {p.node for p in plan_trainers(trainer_kinds(ServiceConfig(), False), [idle_head, CPU_WORKER])} == {
        CPU_WORKER.id}


def test_a_pipeline_trainer_counts_its_stages_on_its_node():
    """A 2-stage GPU kind takes 2 GPUs a trainer (4-GPU node: 2 trainers); a 2-stage CPU trainer's stages
    share the node's CPUs as two trainers would; spread over nodes, only stage 0 is counted on its node."""
    gpu = TrainerConfig(num_gpus=1, stages=2, nodes="each", count=8)
    assert len(plan_trainers([gpu], [HEAD, GPU_WORKER])) == 2
    spread = TrainerConfig(num_gpus=1, stages=2, nodes="each", count=8, stage_placement="spread")
    assert len(plan_trainers([spread], [HEAD, GPU_WORKER])) == 4
    cpu = TrainerConfig(stages=2, nodes="each", count=1)
    assert {p.node: p.threads for p in plan_trainers([cpu], [HEAD])} == {HEAD.id: 4}
    whole = TrainerConfig(num_gpus=1, stages=8, count=1, stage_placement="strict_pack")
    assert [p.node for p in plan_trainers([whole], [HEAD, GPU_WORKER])] == [None]   # no node has 8 GPUs



def test_cpu_trainers_on_one_node_share_its_ram_for_their_default_budgets():
    """Each CPU trainer process would plan for half the RAM alone: n of them on a node plan for 1/n of that each
    (a pipeline's stages are processes of their own); GPU trainers' budgets come from their GPUs."""
    two = plan_trainers(trainer_kinds(ServiceConfig(cpu_trainers_per_node=2), cluster_has_gpus=False), [HEAD])
    assert [p.ram_share for p in two] == [0.5, 0.5]
    alone = plan_trainers([TrainerConfig(count=1, nodes="each")], [HEAD, CPU_WORKER])
    assert [p.ram_share for p in alone] == [1.0, 1.0]
    mixed = plan_trainers([TrainerConfig(stages=2, nodes="each", count=1), TrainerConfig(nodes="each", count=1),
                           TrainerConfig(num_gpus=1, nodes="each", count=1)], [HEAD, GPU_WORKER])
    on_head = [p.ram_share for p in mixed if p.node == HEAD.id]
    assert on_head == [1 / 3, 1 / 3]    # a 2-stage trainer's two processes and a single one: three sharers
    assert [p.ram_share for p in mixed if p.config.num_gpus] == [1.0]
