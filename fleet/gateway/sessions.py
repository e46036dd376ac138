"""A request's session (a conversation's id), from whichever place its client puts it: pure.

Clients name a conversation in different places: any client can send the `X-Session-Id`
header; Anthropic's Messages API carries `metadata.user_id` (Claude Code puts its session
there); OpenAI's carries `prompt_cache_key` (meant for exactly this: routing to the cache) and
`user`. The session rides on the task (`TextGeneration.session`): the worker's prefix routing
then keeps the conversation's turns on the runner that served it (fleet.worker.prefix_blocks),
and the runner's spans carry it as `gen_ai.conversation.id`.

The header wins over the body (an operator's proxy can set it for clients that say nothing),
then the body's fields in the order the caller gives them.
"""

from __future__ import annotations

from collections.abc import Mapping

from fleet.errors import InvalidParameter

SESSION_HEADER = "x-session-id"
MAX_SESSION_CHARS = 256


def session_of(
    headers: Mapping[str, str], body_fields: Mapping[str, object] | None = None,
) -> str | None:
    """The request's session id, or None. `headers`: the request's (Starlette's are
    case-insensitive; a plain dict must use lower case), `body_fields`: the body's fields
    that may name a session, by parameter name, most specific first (e.g.
    `{"prompt_cache_key": ..., "user": ...}`). Blank values count as absent; a value that is
    not text is ignored; one over MAX_SESSION_CHARS is a 400 naming where it came from."""
    named = [(SESSION_HEADER, headers.get(SESSION_HEADER)), *(body_fields or {}).items()]
    for param, value in named:
        if not isinstance(value, str) or not value.strip():
            continue
        session = value.strip()
        if len(session) > MAX_SESSION_CHARS:
            raise InvalidParameter(
                f"{param}: a session id has at most {MAX_SESSION_CHARS} characters "
                f"(this one has {len(session)})", param,
            )
        return session
    return None
