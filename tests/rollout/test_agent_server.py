"""The OpenAI-compatible endpoint for outside agents, driven by the ``openai`` client package
against a loopback server: what each call returns, and the tokens it records."""

from __future__ import annotations

import httpx
import openai
import pytest

from examples.openai_agent import solve
from tests.rollout.environments_fakes import byte_tokenizer, task
from treadle.core.protocols import Finished, SamplingParams, check_new_request
from treadle.core.types import Completion, FinishReason
from treadle.rollout.environments.agent_server import AgentServer
from treadle.rollout.environments.episode import Budgets
from treadle.rollout.environments.rollout import AgentRollout
from treadle.rollout.environments.trajectory import ChatRenderer, Source

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
PARAMS = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=200)


class TextEngine:
    """A per-request engine that answers each request with the next scripted text (its ids and
    the end token, logprob -0.25 each), and records the prompts it was sent."""

    def __init__(self, renderer: ChatRenderer, texts):
        self.renderer, self.texts, self.prompts = renderer, list(texts), []
        self._live: dict[str, tuple[int, ...]] = {}

    def submit(self, request):
        check_new_request(request, self._live)
        self.prompts.append(list(request.prompt_token_ids))
        text = self.texts.pop(0)
        self._live[request.request_id] = (*self.renderer.encode(text), self.renderer.end_of_turn_id)

    def step(self):
        done = [
            Finished(rid, Completion(ids, (-0.25,) * len(ids), FinishReason.STOP, 2))
            for rid, ids in self._live.items()
        ]
        self._live.clear()
        return done

    def abort(self, request_ids):
        return []

    def running(self):
        return len(self._live)


@pytest.fixture
def renderer():
    return ChatRenderer(byte_tokenizer())


def test_an_agent_tool_loop_is_recorded_as_one_sample_of_the_sampled_ids(renderer):
    engine = TextEngine(renderer, [CALL, "<answer>42</answer>"])
    server = AgentServer(engine, renderer, PARAMS)
    try:
        server.open("e1")
        answer = solve(server.base_url("e1"), [{"role": "user", "content": "What is 6 * 7?"}])
        episode = server.episodes["e1"]
    finally:
        server.close()
    assert answer == "<answer>42</answer>" and episode.calls == 2
    (seg,) = episode.trajectory.segments  # the agent appended to its history: one sample
    first, second = engine.prompts
    call_ids = [*renderer.encode(CALL), renderer.end_of_turn_id]
    # the second call's context is the first's, the sampled call as sampled, the glue and the
    # tool result rendered as a suffix: nothing re-encoded from the text the agent sent back
    assert second[: len(first) + len(call_ids)] == first + call_ids
    assert seg.token_ids[: len(second)] == second
    sampled = [t for t, s in zip(seg.token_ids, seg.sources, strict=True) if s == Source.SAMPLED]
    assert sampled == [*call_ids, *renderer.encode("<answer>42</answer>"), renderer.end_of_turn_id]
    env_text = renderer.decode(
        [t for t, s in zip(seg.token_ids, seg.sources, strict=True) if s == Source.ENVIRONMENT]
    )
    assert "42" in env_text  # the tool's result, in the context and out of the loss


def test_the_response_carries_the_parsed_tool_calls(renderer):
    server = AgentServer(TextEngine(renderer, [CALL]), renderer, PARAMS)
    try:
        server.open("e1")
        client = openai.OpenAI(base_url=server.base_url("e1"), api_key="x")
        reply = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "6 * 7?"}]
        )
    finally:
        server.close()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    (call,) = choice.message.tool_calls
    assert (
        call.function.name == "calculate" and call.function.arguments == '{"expression": "6 * 7"}'
    )
    assert reply.usage.completion_tokens == len(renderer.encode(CALL)) + 1


def test_a_rewritten_history_starts_a_new_sample_and_rewards_can_be_posted(renderer):
    server = AgentServer(TextEngine(renderer, ["one", "two"]), renderer, PARAMS)
    try:
        server.open("e1")
        client = openai.OpenAI(base_url=server.base_url("e1"), api_key="x")
        user = {"role": "user", "content": "hi"}
        client.chat.completions.create(model="policy", messages=[user])
        # the agent sends back an edited reply: the held tokens are not what it shows
        edited = [user, {"role": "assistant", "content": "ONE"}, {"role": "user", "content": "?"}]
        client.chat.completions.create(model="policy", messages=edited)
        url = server.base_url("e1").removesuffix("/v1")
        assert httpx.post(f"{url}/reward", json={"reward": 0.75}).status_code == 200
        assert httpx.post(f"{url}/reward", json={"reward": "high"}).status_code == 400
        missing = httpx.post(server.base_url("nope") + "/chat/completions", json={"messages": []})
        assert missing.status_code == 404 and "no episode 'nope'" in missing.text
        bad = httpx.post(server.base_url("e1") + "/chat/completions", content=b"{not json")
        assert bad.status_code == 400
        episode = server.episodes["e1"]
    finally:
        server.close()
    assert len(episode.trajectory.segments) == 2 and episode.reward == 0.75
    assert renderer.decode(episode.trajectory.segments[1].token_ids).count("ONE") == 1


def test_an_agent_rollout_makes_groups_and_keeps_a_failed_agent_untrained(renderer):
    """Three episodes of one task, one at a time: the second agent crashes after its first
    call; its episode stays in the group (reward 0) with no token trained."""
    episodes = iter(range(3))

    def agent(base_url, messages):
        if next(episodes) == 1:
            client = openai.OpenAI(base_url=base_url, api_key="x")
            client.chat.completions.create(model="policy", messages=messages)
            raise RuntimeError("the agent crashed")
        return solve(base_url, messages)

    answer = "<answer>42</answer>"
    engine = TextEngine(renderer, [CALL, answer, CALL, CALL, answer])
    rollout = AgentRollout(agent, renderer, Budgets(max_tokens=4000), max_concurrent=1)
    out = rollout.run(engine, [task()], SamplingParams(3, 1.0, 1.0, 200))
    (generated,) = out.generated
    assert [e.masked for e in out.episodes[0]] == [False, True, False]
    assert [e.reward for e in out.episodes[0]] == [None, 0.0, None]  # None: the domain scores
    first, crashed, third = (c.sampled_mask for c in generated.completions)
    assert True in first and False in first and first == third  # call, tool result, answer
    assert crashed == (False,) * len(crashed)
    assert out.stats()["env/agent_errors"] == pytest.approx(1 / 3)


class FailingOnce(TextEngine):
    """Refuses its second request, as an engine that fails mid-run."""

    def submit(self, request):
        if len(self.prompts) == 1 and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("engine down")
        super().submit(request)


def test_a_failed_call_records_nothing_and_budgets_and_bad_bodies_are_refused(renderer):
    """The engine fails on call 2: 503 and the trajectory as before it; the agent's retry then
    extends it once. A 4th call is over max_calls=3; a posted infinite reward and a body nested
    100,000 deep are refused."""
    engine = FailingOnce(renderer, ["one", "two", "three"])
    server = AgentServer(engine, renderer, PARAMS, max_calls=3)
    try:
        server.open("e1")
        url = server.base_url("e1")
        user = {"role": "user", "content": "hi"}
        first = httpx.post(f"{url}/chat/completions", json={"messages": [user]}).json()
        held = [user, first["choices"][0]["message"], {"role": "user", "content": "more"}]
        tokens_before = list(server.episodes["e1"].trajectory.current.token_ids)
        failed = httpx.post(f"{url}/chat/completions", json={"messages": held})
        assert failed.status_code == 503 and "engine down" in failed.text
        assert server.episodes["e1"].trajectory.current.token_ids == tokens_before
        retry = httpx.post(f"{url}/chat/completions", json={"messages": held})
        assert retry.status_code == 200
        text = renderer.decode(server.episodes["e1"].trajectory.current.token_ids)
        assert text.count("more") == 1 and len(server.episodes["e1"].trajectory.segments) == 1
        held += [retry.json()["choices"][0]["message"], {"role": "user", "content": "again"}]
        assert httpx.post(f"{url}/chat/completions", json={"messages": held}).status_code == 200
        over = httpx.post(f"{url}/chat/completions", json={"messages": held})
        assert over.status_code == 400 and "3 calls" in over.text
        base = url.removesuffix("/v1")
        assert httpx.post(f"{base}/reward", content=b'{"reward": 1e999}').status_code == 400
        deep = httpx.post(f"{url}/chat/completions", content=b"[" * 100_000)
        assert deep.status_code == 400
    finally:
        server.close()


def test_concurrent_calls_of_one_episode_run_one_after_the_other(renderer):
    """Two simultaneous identical calls (a client's retry): the second waits for the first, then
    no longer extends what was answered and starts a sample of its own; no token is mixed."""
    import threading

    server = AgentServer(TextEngine(renderer, ["A", "B"]), renderer, PARAMS)
    try:
        server.open("e1")
        url = server.base_url("e1") + "/chat/completions"
        body = {"messages": [{"role": "user", "content": "hi"}]}
        replies = []
        threads = [
            threading.Thread(target=lambda: replies.append(httpx.post(url, json=body)))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        segments = server.episodes["e1"].trajectory.segments
    finally:
        server.close()
    assert [r.status_code for r in replies] == [200, 200]
    texts = sorted(renderer.decode(s.token_ids) for s in segments)
    prompt = renderer.decode(renderer.prompt(body["messages"]))
    assert texts == [f"{prompt}A<|im_end|>", f"{prompt}B<|im_end|>"]


def test_a_raw_completion_call_is_a_sample_of_its_own(renderer):
    """/v1/completions: the agent's prompt text encoded as it is (special tokens read), the
    reply sampled after it; each call starts a sample of its own."""
    engine = TextEngine(renderer, ["4", "5"])
    server = AgentServer(engine, renderer, PARAMS)
    try:
        server.open("e1")
        client = openai.OpenAI(base_url=server.base_url("e1"), api_key="x")
        first = client.completions.create(model="policy", prompt="2 + 2 =")
        second = client.completions.create(model="policy", prompt="2 + 3 =")
        episode = server.episodes["e1"]
    finally:
        server.close()
    assert first.choices[0].text == "4" and second.choices[0].text == "5"
    assert engine.prompts == [renderer.encode("2 + 2 ="), renderer.encode("2 + 3 =")]
    texts = [renderer.decode(s.token_ids) for s in episode.trajectory.segments]
    assert texts == ["2 + 2 =4<|im_end|>", "2 + 3 =5<|im_end|>"]
    assert episode.calls == 2 and episode.answer == "5"


def test_the_thread_that_steps_the_engine_settles_its_torch_threads_first(renderer, monkeypatch):
    # vLLM's CPU attention checks the OpenMP thread count it planned with against the one its
    # kernel runs with; a new thread's count is settled only at its first parallel op, which
    # can fall in between (CI: "Check failed: thread_num (1 vs. 2)" in the agent run)
    import threading

    import torch

    from treadle.rollout.environments import agent_server

    pinned = []
    monkeypatch.setattr(
        agent_server, "pin_threads", lambda n: pinned.append((threading.current_thread().name, n))
    )
    server = AgentServer(TextEngine(renderer, ["hi"]), renderer, PARAMS)
    server.close()
    assert pinned == [("treadle-agents", torch.get_num_threads())]
