"""Priority scheduling (issue 53, item 5; vLLM's `--scheduling-policy priority`): lower `priority` values are
admitted first from a saturated queue, the running are preempted from the other end when blocks run out, fcfs
keeps arrival order and refuses a priority it would ignore, and the server passes a request's `priority` through
for every one of its sequences."""

from __future__ import annotations

import time

import pytest

from kiln import LLM, SamplingParams
from kiln.config import SchedulerConfig
from kiln.engine.request import Request, RequestOptions
from kiln.engine.scheduling.kv_cache import BlockPool
from kiln.engine.scheduling.scheduler import Scheduler
from kiln.errors import RequestError
from tests.engine.test_long_prefill import run_step
from tests.engine.tiny_models import write_hf_model
from tests.server.app_harness import Served, serve
from tests.server.fake_core import FakeCore


def request(rid: str, priority: int, prompt_len: int = 8) -> Request:
    params = SamplingParams(max_tokens=64, temperature=0)
    return Request(rid, None, list(range(1, prompt_len + 1)), params, None, RequestOptions(priority=priority))


def admission_order(policy: str) -> list[str]:
    """One sequence runs at a time: the order the others wait in is the order they are admitted in."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, policy=policy), BlockPool(64, 16))
    for rid, priority in [("a", 5), ("b", 0), ("c", 5), ("d", -1)]:
        scheduler.add(request(rid, priority))
        time.sleep(0.001)  # distinct arrival times
    order = []
    while scheduler.waiting:
        (admitted,) = run_step(scheduler)
        order.append(admitted)
        scheduler.finish(scheduler.running[0], "stop")
    return order


def test_the_priority_policy_admits_lower_values_first_then_by_arrival() -> None:
    assert admission_order("priority") == ["d", "b", "a", "c"]
    assert admission_order("fcfs") == ["a", "b", "c", "d"]


@pytest.mark.parametrize(("policy", "victim"), [("priority", "low"), ("fcfs", "high")])
def test_blocks_running_out_preempt_the_lowest_priority_first(policy: str, victim: str) -> None:
    """Two sequences fill a 4-block pool; growing one more block preempts the one the policy ranks last: under
    priority the low-priority sequence though it came first, under fcfs the latest admitted."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, policy=policy), BlockPool(5, 4))  # block 0 is null
    scheduler.add(request("low", 9, prompt_len=8))
    time.sleep(0.001)
    scheduler.add(request("high", 0, prompt_len=8))
    assert run_step(scheduler) == {"low": 8, "high": 8}
    out = scheduler.schedule()  # each needs a third block for its next token: one is preempted
    assert out.preempted == [victim]
    assert [r.request_id for r in scheduler.waiting] == [victim]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama_priority")
    write_hf_model(path, "llama", perturb=0.05)
    return str(path)


def test_fcfs_refuses_a_priority_it_would_ignore(tiny: str) -> None:
    llm = LLM(tiny, num_kv_blocks=32, graph_mode="eager")
    with pytest.raises(RequestError, match="--scheduling-policy priority") as refused:
        llm.engine.add_request("r", [5, 6], SamplingParams(max_tokens=2), priority=3)
    assert refused.value.param == "priority"
    assert llm.engine.add_request("r0", [5, 6], SamplingParams(max_tokens=2), priority=0).priority == 0


def test_a_saturated_engine_serves_the_urgent_prompt_first(tiny: str) -> None:
    llm = LLM(tiny, num_kv_blocks=64, graph_mode="eager", max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12]], params, priority=[2, 0, 1])
    started = [out.metrics.first_token_time for out in outs]
    assert started[1] < started[2] < started[0]  # priority 0, then 1, then 2: not the order they were given
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[5], [6]], params, priority=[1])


def test_the_server_passes_a_requests_priority_to_each_sequence() -> None:
    core = FakeCore()

    async def body(s: Served) -> None:
        done = await s.client.post("/v1/completions", json={"prompt": ["x", "y"], "max_tokens": 2, "priority": -4})
        assert done.status_code == 200, done.text
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2, "priority": 7}
        assert (await s.client.post("/v1/chat/completions", json=chat)).status_code == 200
        bad = await s.client.post("/v1/completions", json={"prompt": "x", "priority": "soon"})
        assert bad.status_code == 400 and "priority" in bad.text

    serve(core, body)
    assert sorted(core.priorities.values()) == [-4, -4, 7, 7]
