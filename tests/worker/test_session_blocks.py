"""A session's turns go home (fleet.worker.prefix_blocks): the session's block leads their
prompt blocks, so the runner that served a session holds it and the routing prefers it."""

from __future__ import annotations

from fleet.runner.spans import request_attributes
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.prefix_blocks import prompt_blocks
from fleet.worker.routing import Candidate, PrefixHeld, choose_runner


def turn(text: str, session: str | None = None, system: str = "") -> TextGeneration:
    messages = [ChatMessage(role="system", content=system)] if system else []
    messages.append(ChatMessage(role="user", content=text))
    return TextGeneration(task_id="t", model="m", messages=messages, session=session)


def test_a_session_leads_its_blocks_and_sets_conversations_apart() -> None:
    assert prompt_blocks(turn("hi")) == ()  # shorter than a block, no session: no blocks
    first, later = prompt_blocks(turn("hi", "s1")), prompt_blocks(turn("bye now", "s1"))
    assert len(first) == 1 and later[0] == first[0]  # a short turn still has its session
    assert prompt_blocks(turn("hi", "s2"))[0] != first[0]
    system = "You are helpful. " * 40  # a system prompt two sessions share
    one, two = prompt_blocks(turn("q", "s1", system)), prompt_blocks(turn("q", "s2", system))
    assert not set(one) & set(two)  # each session is its own prefix
    assert prompt_blocks(turn("q", None, system))[0] not in one


def held(blocks: tuple[int, ...]) -> PrefixHeld:
    return PrefixHeld(blocks, frozenset(blocks))


def test_idle_runners_send_a_returning_session_where_it_was_served() -> None:
    served_a, served_b = prompt_blocks(turn("hi", "to-a")), prompt_blocks(turn("hi", "to-b"))
    runners = [Candidate("a", 1, 0, held(served_a)), Candidate("b", 1, 0, held(served_b))]
    assert choose_runner(prompt_blocks(turn("more", "to-a")), runners) == "a"
    assert choose_runner(prompt_blocks(turn("more", "to-b")), runners) == "b"
    # Without a session a short prompt has no blocks and both idle runners tie: "a" wins
    # by id, so the test above could fail.
    assert choose_runner(prompt_blocks(turn("more")), runners) == "a"


def test_traces_carry_the_session_as_the_conversation_id() -> None:
    assert request_attributes(turn("hi", "s1"))["gen_ai.conversation.id"] == "s1"
    assert "gen_ai.conversation.id" not in request_attributes(turn("hi"))
